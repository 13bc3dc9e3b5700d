#!/usr/bin/env bash
# gpt2_side_by_side.sh - GPT-2 training on the CPU, memtrain (bench_gpt2)
# against PyTorch (bench/torch_gpt2.py), in one invocation, turn by turn,
# on the same data, from the same weights, with the same thread count.
#
#   bench/gpt2_side_by_side.sh [--quick] [--threads N] [--steps N] [--warmup N]
#                              [--rounds R] [--sections side,ckpt,cpu] [--work DIR]
#                              [--ours-only]
#   bench/gpt2_side_by_side.sh --long [--threads N] [--work DIR]
#
# Sections (all by default):
#   side  (a) fp32 AdamW; (b) each memory feature alone: bf16, 8-bit AdamW,
#         fused step, recompute sqrt, recompute selective; (c) all of them
#         together, and again with bf16 without master weights (--no-master;
#         PyTorch runs its (c) again). Each run by both sides: ours / PyTorch
#         for ms/step and peak RSS, and each of ours against our own fp32
#         AdamW run; then oneDNN's fp32 matmul rate at the step's GEMM shapes
#         (bench_gpt2 --gemm, at the start and the end of each round) and
#         our step time against 6 x params x tokens / rate.
#   cpu   (with --sections cpu; not in the default) the CPU-speed table:
#         PyTorch fp32 AdamW and bf16 autocast, ours fp32 AdamW, bf16 with
#         master weights and the lean configuration (bf16 without masters,
#         8-bit AdamW, fused step, recompute sqrt), and fp32 with the lean
#         recipe (8-bit AdamW, fused step, recompute sqrt: the lean step's
#         work in fp32), ours with --profile;
#         each against our fp32 step of the same round, every op family's
#         share of our steps, and our fp32 step against the step's GEMMs
#         at oneDNN's fp32 rate. The CPU's model and ISA are printed.
#   ckpt  recompute none / every:1 / sqrt / selective (ours, fp32 AdamW):
#         ms/step against none and the ACT class peak; PyTorch without and
#         with per-block checkpointing for reference.
# Shape: GPT-2 124M (V 50257, maxT 1024, L 12, H 12, C 768), B 4, T 64,
# --steps 5 --warmup 1; --quick: L 4, H 4, C 256 (same vocabulary).
# --ours-only leaves PyTorch's runs out (more rounds of ours, for the
# ratios between our own configurations).
# Every section runs --rounds times (2), each round every run in turn; a
# table shows each run's best round (the lowest median ms/step: the one the
# rest of the machine disturbed least) and the ours / PyTorch ratio of each
# round, so the spread is visible.
#
# --long: 200 steps at the small shape (V 50257, maxT 1024, L 4, H 4, C 256,
# B 4, T 64), ours fp32 AdamW against ours with every feature on
# (bf16 + 8-bit AdamW + fused + recompute sqrt, with and without master
# weights), PyTorch fp32 AdamW for reference; final loss = mean of the last
# 10 steps. Never at the 124M shape.
#
# The data is a synthetic token file (bench/gpt2_tools.py tokens) and the
# starting weights an llm.c checkpoint written by torch_gpt2.py
# --write-llmc-checkpoint, both made once under --work (default
# build/gpt2-bench) and read by both sides. Each invocation's raw JSON
# lines, the commands run and the tables are kept in a new folder there.
#
# PyTorch comes from the virtualenv $MT_TORCH_VENV (default /work/venv-torch);
# nothing is installed by this script. MT_CPU_ISA (avx2, baseline, ...)
# caps our kernels' CPU class, and PyTorch's side is capped with it
# (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA).
set -euo pipefail

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
VENV=${MT_TORCH_VENV:-/work/venv-torch}
PY="$VENV/bin/python"
BIN=${BENCH_GPT2:-$BUILD/bench/bench_gpt2} # BENCH_GPT2: a bench_gpt2 built elsewhere
TORCH=bench/torch_gpt2.py
TOOLS=bench/gpt2_tools.py

QUICK=0 LONG=0 OURS_ONLY=0 THREADS=$(nproc) STEPS='' WARMUP='' ROUNDS=2 SECTIONS=side,ckpt WORK=$BUILD/gpt2-bench

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1 ;;
    --long) LONG=1 ;;
    --ours-only) OURS_ONLY=1 ;;
    --threads) THREADS=${2:?--threads N}; shift ;;
    --steps) STEPS=${2:?--steps N}; shift ;;
    --warmup) WARMUP=${2:?--warmup N}; shift ;;
    --rounds) ROUNDS=${2:?--rounds R}; shift ;;
    --sections) SECTIONS=${2:?--sections side,ckpt}; shift ;;
    --work) WORK=${2:?--work DIR}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpt2_side_by_side.sh: unknown argument '$1' (see --help)" >&2; exit 1 ;;
    esac
    shift
done

if [ ! -x "$PY" ] || ! "$PY" -c 'import torch, numpy' 2>/dev/null; then
    echo "gpt2_side_by_side.sh: no PyTorch virtualenv at $VENV (set MT_TORCH_VENV to use another)." >&2
    echo "Create one with:" >&2
    echo "  python3 -m venv $VENV && $VENV/bin/pip install torch numpy" >&2
    echo "(and $VENV/bin/pip install bitsandbytes for PyTorch's side of the 8-bit AdamW rows)" >&2
    exit 1
fi

[ -n "${BENCH_GPT2:-}" ] || make -s BUILD="$BUILD" "$BIN"

V=50257 MAXT=1024 B=4 T=64
if [ "$LONG" = 1 ]; then
    L=4 H=4 C=256 STEPS=200 WARMUP=0 ROUNDS=1 SHAPE=small
elif [ "$QUICK" = 1 ]; then
    L=4 H=4 C=256 SHAPE=small
else
    L=12 H=12 C=768 SHAPE=124m
fi
STEPS=${STEPS:-5} WARMUP=${WARMUP:-1}

mkdir -p "$WORK"
TOKENS="$WORK/tokens_v$V.bin"
CKPT="$WORK/init_${SHAPE}_L${L}_H${H}_C${C}.bin"
if [ ! -s "$TOKENS" ]; then
    echo "making $TOKENS" >&2
    "$PY" "$TOOLS" tokens "$TOKENS" --vocab "$V" --seed 1234
fi
if [ ! -s "$CKPT" ]; then
    echo "making $CKPT (GPT-2 init, seed 1234)" >&2
    "$PY" "$TORCH" --V "$V" --maxT "$MAXT" --L "$L" --H "$H" --C "$C" --B "$B" --T "$T" \
        --steps 1 --warmup 0 --threads "$THREADS" --seed 1234 \
        --write-llmc-checkpoint "$CKPT.tmp" > /dev/null
    mv "$CKPT.tmp" "$CKPT"
fi

# MT_CPU_ISA caps our kernels' CPU class (docs/kernels.md); PyTorch's side
# is capped alike, through its own switches (ATen's vector kernels, MKL's
# GEMMs, its oneDNN), so both run as on a CPU of that class
case "${MT_CPU_ISA:-}" in
'') TORCH_ENV="" ;;
baseline) TORCH_ENV="env ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41" ;;
avx2) TORCH_ENV="env ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2" ;;
avx512) TORCH_ENV="env ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE" ;;
avx512_bf16) TORCH_ENV="env ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" ;;
*) TORCH_ENV="" ;;
esac

RUN="$WORK/run-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN"
COMMON="--tokens $TOKENS --llmc-checkpoint $CKPT --threads $THREADS"
OURS="$BIN $COMMON --batch $B --seq $T --steps $STEPS --warmup $WARMUP"
THEIRS="$PY $TORCH $COMMON --B $B --T $T --steps $STEPS --warmup $WARMUP"
DIR=$RUN # where run() leaves its results: one folder per section
ROUND=1  # the round being run

# run IMPL TAG FLAGS: one run, its JSON line into $DIR/TAG.IMPL.rROUND.json,
# or its messages into $DIR/TAG.IMPL.rROUND.err when it fails (an
# "unsupported:" message for a feature the library does not have yet);
# never stops the script.
run() {
    local impl=$1 tag=$2 flags=$3 cmd out="$DIR/$2.$1.r$ROUND"
    if [ "$impl" = memtrain ]; then cmd="$OURS $flags"; else cmd="$TORCH_ENV $THEIRS $flags"; fi
    echo "$cmd" >> "$RUN/commands.txt"
    # shellcheck disable=SC2086 # the flags are words
    if $cmd > "$out.json" 2> "$out.err"; then
        rm -f "$out.err"
        "$PY" -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]);
print("  r%s %-9s %-14s %9.1f ms/step  peak RSS %8.1f MiB" % (sys.argv[2], sys.argv[3], sys.argv[4],
d["ms_per_step_median"], d["peak_rss_mib"]))' "$out.json" "$ROUND" "$impl" "$tag" >&2
    else
        rm -f "$out.json"
        echo "  r$ROUND $impl $tag: $(grep -m1 '^unsupported:' "$out.err" || tail -n1 "$out.err")" >&2
    fi
}

# row FIELDS...: a line of the section's table order (tab-separated), once
row() { [ "$ROUND" != 1 ] || (IFS=$'\t'; echo "$*") >> "$DIR/order.txt"; }

# pair I TAG LABEL OURS_FLAGS TORCH_FLAGS: both sides, the order alternating
# with I and the round so that neither always runs first.
pair() {
    row "$2" "$3" "$4" "$5"
    if [ "$OURS_ONLY" = 1 ]; then
        run memtrain "$2" "$4"
    elif [ $((($1 + ROUND) % 2)) = 1 ]; then
        run memtrain "$2" "$4"; run pytorch "$2" "$5"
    else
        run pytorch "$2" "$5"; run memtrain "$2" "$4"
    fi
}

gemm() {
    local cmd="$BIN --gemm --vocab $V --layers $L --heads $H --channels $C --batch $B --seq $T --threads $THREADS"
    echo "$cmd" >> "$RUN/commands.txt"
    # shellcheck disable=SC2086
    $cmd > "$DIR/$1.onednn.r$ROUND.json"
}

unsupported() { grep -qs '^unsupported:' "$DIR/$1.memtrain.r$ROUND.err"; }

section() {
    DIR="$RUN/$1" ROUND=1
    mkdir -p "$DIR"
    echo "== $2" >&2
}

report() {
    echo
    "$PY" "$TOOLS" report "$DIR" --mode "$1" | tee "$DIR/report.md"
}

{
    echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs," \
        "$(free -g | awk '/^Mem:/ {print $2}') GiB memory; $(uname -sr)"
    echo "threads: $THREADS; torch $("$PY" -c 'import torch; print(torch.__version__)');" \
        "$(${CC:-cc} --version | head -n1); memtrain $(git describe --always --dirty 2>/dev/null || echo '?')"
    echo "shape: V $V, maxT $MAXT, L $L, H $H, C $C, B $B, T $T; steps $STEPS after $WARMUP warmup;" \
        "$ROUNDS round(s)"
    echo "data: $TOKENS; weights: $CKPT; raw results: $RUN"
} | tee "$RUN/machine.txt" >&2

if [ "$LONG" = 1 ]; then
    section long "200-step loss comparison"
    ALL="--precision bf16 --optimizer adamw8 --fused --recompute sqrt"
    row long_fp32 "fp32 AdamW" memtrain ""
    row long_all "bf16 + 8-bit AdamW + fused + sqrt" memtrain "$ALL"
    row long_nomaster "the same, bf16 without master weights" memtrain "$ALL --no-master"
    row long_fp32 "fp32 AdamW (reference)" pytorch ""
    run memtrain long_fp32 ""
    run memtrain long_all "$ALL"
    run pytorch long_fp32 ""
    run memtrain long_nomaster "$ALL --no-master"
    if unsupported long_all; then
        AVAIL="--precision bf16 --fused --recompute sqrt"
        row long_avail "bf16 + fused + sqrt (8-bit AdamW unsupported)" memtrain "$AVAIL"
        run memtrain long_avail "$AVAIL"
    fi
    report long
    exit 0
fi

case ",$SECTIONS," in *,side,*)
    section side "side by side"
    for ROUND in $(seq 1 "$ROUNDS"); do
        gemm gemm_start
        pair 0 a_fp32_adamw "(a) fp32 AdamW" "" ""
        pair 1 b_bf16 "(b) bf16" "--precision bf16" "--bf16"
        pair 2 b_adamw8 "(b) 8-bit AdamW" "--optimizer adamw8" "--adamw8"
        pair 3 b_fused "(b) fused step" "--fused" "--step-in-backward"
        pair 4 b_sqrt "(b) recompute sqrt" "--recompute sqrt" "--checkpointing"
        pair 5 b_selective "(b) recompute selective" "--recompute selective" "--checkpointing"
        pair 6 c_all "(c) all together" "--precision bf16 --optimizer adamw8 --fused --recompute sqrt" \
            "--bf16 --adamw8 --step-in-backward --checkpointing"
        pair 7 c_nomaster "(c) without master weights" \
            "--precision bf16 --no-master --optimizer adamw8 --fused --recompute sqrt" \
            "--bf16 --adamw8 --step-in-backward --checkpointing"
        if unsupported c_all; then
            pair 8 c_avail "(c') all but 8-bit AdamW" "--precision bf16 --fused --recompute sqrt" \
                "--bf16 --step-in-backward --checkpointing"
        fi
        gemm gemm_end
    done
    report side
    ;;
esac

case ",$SECTIONS," in *,cpu,*)
    section cpu "CPU speed"
    echo "ISA: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|amx_tile|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')" | tee -a "$RUN/machine.txt" >&2
    echo "class: MT_CPU_ISA=${MT_CPU_ISA:-unset}; PyTorch: ${TORCH_ENV:-uncapped}" | tee -a "$RUN/machine.txt" >&2
    LEAN="--precision bf16 --no-master --optimizer adamw8 --fused --recompute sqrt"
    RECIPE="--optimizer adamw8 --fused --recompute sqrt"
    for ROUND in $(seq 1 "$ROUNDS"); do
        gemm gemm_start
        pair 0 cpu_fp32 "fp32 AdamW" "--profile" ""
        pair 1 cpu_bf16 "bf16 (ours with fp32 masters; PyTorch autocast)" \
            "--precision bf16 --profile" "--bf16"
        row cpu_lean "lean: bf16 without masters + 8-bit AdamW + fused + sqrt" "$LEAN --profile" ""
        run memtrain cpu_lean "$LEAN --profile"
        row cpu_recipe "fp32 with the lean recipe: 8-bit AdamW + fused + sqrt" "$RECIPE --profile" ""
        run memtrain cpu_recipe "$RECIPE --profile"
        gemm gemm_end
    done
    report cpu
    ;;
esac

case ",$SECTIONS," in *,ckpt,*)
    section ckpt "checkpointing cost"
    for ROUND in $(seq 1 "$ROUNDS"); do
        row ck_none none "--recompute none" ""
        row ck_every1 every:1 "--recompute every:1" "--checkpointing"
        row ck_sqrt sqrt "--recompute sqrt" ""
        row ck_selective selective "--recompute selective" ""
        run memtrain ck_none "--recompute none"
        run pytorch ck_none ""
        run memtrain ck_every1 "--recompute every:1"
        run pytorch ck_every1 "--checkpointing"
        run memtrain ck_sqrt "--recompute sqrt"
        run memtrain ck_selective "--recompute selective"
    done
    report ckpt
    ;;
esac
