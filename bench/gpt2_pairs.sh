#!/usr/bin/env bash
# gpt2_pairs.sh - two of our GPT-2 124M configurations (bench_gpt2) against
# each other, in pairs, in the order A B, B A, A B, ... so that neither always
# runs first: each pair's ratio of ms/step (the median of its measured
# steps), and the median ratio over the pairs. For the ratios between our own
# configurations on a machine whose speed drifts (docs/benchmarks.md, "Every
# CPU class"); PyTorch's side is gpt2_side_by_side.sh.
#
#   bench/gpt2_pairs.sh [--pairs N] [--threads N] -- "FLAGS A" "FLAGS B"
#
# e.g. MT_CPU_ISA=avx2 bench/gpt2_pairs.sh -- "--precision bf16" "--precision fp32"
# Shape and data as gpt2_side_by_side.sh (B4 T64 on its token file and its
# GPT-2 init, made there once under build/gpt2-bench; run it first), 5
# measured steps after 1 warmup a run. Each run's peak RSS is printed too.
set -euo pipefail

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
BIN=${BENCH_GPT2:-$BUILD/bench/bench_gpt2}
WORK=$BUILD/gpt2-bench
PAIRS=8 THREADS=$(nproc)
while [ $# -gt 0 ]; do
    case "$1" in
    --pairs) PAIRS=${2:?--pairs N}; shift ;;
    --threads) THREADS=${2:?--threads N}; shift ;;
    --) shift; break ;;
    *) echo "gpt2_pairs.sh: unknown argument '$1'" >&2; exit 1 ;;
    esac
    shift
done
[ $# = 2 ] || { echo "usage: gpt2_pairs.sh [--pairs N] [--threads N] -- \"FLAGS A\" \"FLAGS B\"" >&2; exit 1; }
A=$1 B=$2
TOKENS=$WORK/tokens_v50257.bin CKPT=$WORK/init_124m_L12_H12_C768.bin
[ -s "$TOKENS" ] && [ -s "$CKPT" ] ||
    { echo "gpt2_pairs.sh: no $TOKENS or $CKPT: run bench/gpt2_side_by_side.sh once first" >&2; exit 1; }
make -s BUILD="$BUILD" "$BIN"
COMMON="--batch 4 --seq 64 --steps 5 --warmup 1 --threads $THREADS --tokens $TOKENS --llmc-checkpoint $CKPT"

# one run: "ms_per_step_median peak_rss_mib"
one() {
    # shellcheck disable=SC2086 # the flags are words
    "$BIN" $COMMON $1 | tail -n1 |
        python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["ms_per_step_median"], d["peak_rss_mib"])'
}

echo "A: $A; B: $B; MT_CPU_ISA=${MT_CPU_ISA:-unset}; $THREADS threads; $PAIRS pairs"
ratios=()
for i in $(seq 1 "$PAIRS"); do
    if [ $((i % 2)) = 1 ]; then a=$(one "$A"); b=$(one "$B"); else b=$(one "$B"); a=$(one "$A"); fi
    r=$(python3 -c "print('%.3f' % (${a% *} / ${b% *}))")
    echo "pair $i: A ${a% *} ms/step (peak RSS ${a#* } MiB), B ${b% *} ms/step (peak RSS ${b#* } MiB), A/B $r"
    ratios+=("$r")
done
python3 -c 'import statistics,sys; v=[float(x) for x in sys.argv[1:]]
print("median A/B %.2fx (min %.2fx, max %.2fx, %d pairs)" % (statistics.median(v), min(v), max(v), len(v)))' "${ratios[@]}"
