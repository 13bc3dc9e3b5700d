#!/usr/bin/env bash
# run.sh - memtrain's validation on an NVIDIA GPU, offline, in one command,
# from the bundle `make gpu-bundle` makes (bin/, lib/, stand-in/, bench/):
#
#   ./run.sh RESULTS_DIR              on a machine with an NVIDIA GPU, its
#                                     driver, and python3 with PyTorch
#   ./run.sh --stand-in RESULTS_DIR   anywhere: the same groups over the test
#                                     suite's stand-in driver and cuBLASLt
#   options: --groups g1,g2 (default: all), --quick (smaller benchmarks),
#            --timeout N (seconds a test command may take, default 120;
#            compute-sanitizer over one engine test too), --bench-timeout N
#            (a benchmark, or compute-sanitizer over the op suite; 900)
#
# It runs from any directory: the test suite's golden files travel in
# golden/ (MT_GOLDEN_DIR points there unless already set). Every command
# runs under a time limit (timeout(1): TERM, then KILL 10 s later); one
# that runs out fails its group with "timed out after N s" and the other
# groups still run. Each group runs in processes of its own, so a fault in
# one (a kernel that poisons its CUDA context) does not stop the others:
#   standins   the CUDA device layer and op table over the stand-ins
#   ops        the op conformance suite: every op of the CUDA table against
#              the CPU table in fp32, fp16 and bf16 (test/test_ops.c)
#   engine     the training engine on the GPU against the CPU (gpu_engine_*),
#              each test in a process of its own; one that fails is run
#              again with MT_CUDA_DEBUG_SYNC=1, which names a failing kernel;
#              one that runs out of time has its threads' states and
#              stacks (gdb's, else bin/mt_stacks') written to the log
#              before it is ended
#   estimate   estimate == measured, to the byte, on the real driver and
#              cuBLASLt; the budget policy stays within its budget
#   driver     the driver's view (cuMemGetInfo) against the accounting;
#              bench_memory section (d) at GPT-2 124M
#   memcheck   compute-sanitizer memcheck over the op suite and each engine
#              test (when found)
#   nccl       a one-rank NCCL communicator on a CUDA context: every
#              collective on device memory, checked, a few steps of a
#              tiny GPT, and the all-reduce on the communication stream
#              (comm_nccl_one_rank*: the libnccl.so.2 the library finds: the CUDA
#              toolkit's, or PyTorch's nvidia/nccl/lib; skipped when none)
#   kernels    bench_cuda: GEMM TFLOP/s per dtype; cast, unscale, AdamW and
#              8-bit AdamW in GB/s against the device's copy bandwidth; the
#              layer ops (layernorm, GELU, attention) in ms per dtype
#   gpt2       GPT-2 124M training, memtrain (bench_gpt2 --device cuda)
#              and PyTorch (bench/torch_gpt2.py --device cuda) in turns:
#              fp32; bf16; bf16 + 8-bit AdamW + fused step + recompute sqrt;
#              then memtrain's bf16 step profiled per op (bench_gpt2 --profile)
# Under --stand-in the groups that need a GPU's arithmetic (ops, engine,
# memcheck, the PyTorch side) are reported "skipped: needs a GPU"; the
# others run over the stand-ins (nccl over the stand-in libnccl; benchmarks
# then on a tiny shape, and their figures mean nothing).
#
# RESULTS_DIR gets results.txt (one line per group: PASS, FAIL or SKIP,
# seconds, and what failed or why skipped; then the figures), log.txt
# (everything every command printed, each under a header with the command)
# and the benchmarks' JSON. The exit status is 1 when a group failed.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STAND_IN=0 QUICK=0 SEL=standins,ops,engine,estimate,driver,memcheck,nccl,kernels,gpt2 OUT=
TEST_TMO=120 LONG_TMO=900
while [ $# -gt 0 ]; do
    case "$1" in
    --stand-in) STAND_IN=1 ;;
    --quick) QUICK=1 ;;
    --groups) SEL=${2:?--groups g1,g2}; shift ;;
    --timeout) TEST_TMO=${2:?--timeout SECONDS}; shift ;;
    --bench-timeout) LONG_TMO=${2:?--bench-timeout SECONDS}; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) OUT=$1 ;;
    esac
    shift
done
[ -n "$OUT" ] || { echo "usage: run.sh [--stand-in] [--quick] [--groups g1,g2] [--timeout N] [--bench-timeout N] RESULTS_DIR" >&2; exit 2; }
for n in "$TEST_TMO" "$LONG_TMO"; do
    case "$n" in '' | *[!0-9]* | 0) echo "run.sh: a timeout is a whole number of seconds, not '$n'" >&2; exit 2 ;; esac
done
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
RESULTS=$OUT/results.txt LOG=$OUT/log.txt
: > "$RESULTS"
: > "$LOG"
rm -f "$OUT/.why" "$OUT/.timeouts"

BIN=$HERE/bin
# the golden files the engine tests read, wherever run.sh is started from
export MT_GOLDEN_DIR="${MT_GOLDEN_DIR:-$HERE/golden}"
# The programs find lib/ through their rpath; LD_LIBRARY_PATH is left alone
# (PyTorch runs under it too), except for the C++ and GCC runtimes of the
# build machine, added only where this one has none.
for l in libstdc++.so.6 libgcc_s.so.1; do
    if [ -e "$HERE/lib/fallback/$l" ] && ! /sbin/ldconfig -p 2>/dev/null | grep -q "$l "; then
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$HERE/lib/fallback"
        break
    fi
done
FAKE_ENV=(MT_FAKE_CUDA="$HERE/stand-in/libfakecuda.so" MT_FAKE_CUBLASLT="$HERE/stand-in/libfakecublaslt.so")
if [ "$STAND_IN" = 1 ]; then DEV_ENV=("${FAKE_ENV[@]}"); else DEV_ENV=(MT_TEST_GPU=1); fi

FAILED=0
note() { echo "$*" >> "$RESULTS"; echo "$*"; }

HAVE_TIMEOUT=0
command -v timeout > /dev/null 2>&1 && HAVE_TIMEOUT=1
TMO=$TEST_TMO # the limit of the commands run now; a group may set its own

# limited ARGS...: env ARGS... within TMO seconds; the status, 124 when the
# time ran out (noted in the output and in $OUT/.timeouts for the group)
limited() {
    local st
    if [ $HAVE_TIMEOUT = 0 ]; then
        env "$@"
        return
    fi
    timeout -k 10 "$TMO" env "$@"
    st=$?
    [ $st = 124 ] || [ $st = 137 ] || return $st
    late "" "$@"
}

# late NOTE ARGS...: says that the command ARGS... ran out of time (in its
# output and in $OUT/.timeouts, by its name and arguments without the
# environment settings); status 124
late() {
    local note=$1 w
    shift
    while [ $# -gt 1 ] && [[ "$1" == *=* ]]; do shift; done
    w="${1##*/}"; shift
    w="$w${*:+ $*}"
    echo "(timed out after $TMO s: $w$note)"
    echo "after $TMO s: $w" >> "$OUT/.timeouts"
    return 124
}

# threads PID: each thread of PID, its state, where it waits and its system
# call, then every thread's stack: with gdb where it is found ($GDB, else
# gdb on the PATH), else with the bundle's bin/mt_stacks (each thread's
# instruction pointer and the code addresses on its stack, named by the
# nearest symbol)
threads() {
    local t g
    echo "(threads of process $1: name, state, wait channel, system call)"
    for t in /proc/"$1"/task/*; do
        echo "  $(cat "$t/comm" 2>/dev/null) $(awk '{print $3}' "$t/stat" 2>/dev/null)" \
            "wchan=$(cat "$t/wchan" 2>/dev/null) syscall=$(cut -d' ' -f1 "$t/syscall" 2>/dev/null)"
    done
    [ $HAVE_TIMEOUT = 1 ] || return 0
    if g=$(command -v "${GDB:-gdb}"); then
        echo "(their stacks, gdb)"
        timeout 60 "$g" -batch -nx -p "$1" -ex "thread apply all bt" 2>&1 | grep -v '^\[New LWP' | head -n 300
    elif [ -x "$BIN/mt_stacks" ]; then
        echo "(their stacks, mt_stacks: the instruction pointer, then the stack's words that point into code, innermost first)"
        timeout 30 "$BIN/mt_stacks" "$1" 2>&1 | head -n 400
    fi
}

# watched ARGS...: as limited, but a command still running at the limit has
# its threads written out (threads) before it is ended
watched() {
    env "$@" &
    local pid=$! n=0
    while kill -0 "$pid" 2>/dev/null && [ $n -lt $((TMO * 10)) ]; do
        sleep 0.1
        n=$((n + 1))
    done
    if ! kill -0 "$pid" 2>/dev/null; then
        wait "$pid"
        return
    fi
    threads "$pid"
    kill -TERM "$pid" 2>/dev/null
    for n in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid"
    late "; exit status $? once ended" "$@"
}

# cmd ARGS...: runs one command into the log, under a header; its status
cmd() {
    { echo; echo "\$ $*"; } >> "$LOG"
    limited "$@" >> "$LOG" 2>&1
}

# json FILE ARGS...: as cmd, the command's last line of output kept in FILE
# when it is a JSON object (else FILE is removed); its status
json() {
    local f=$1 st
    shift
    { echo; echo "\$ $*"; } >> "$LOG"
    limited "$@" > "$f.out" 2>> "$LOG"
    st=$?
    cat "$f.out" >> "$LOG"
    tail -n 1 "$f.out" | grep '^{' > "$f" || { rm -f "$f"; [ $st = 0 ] && st=1; }
    rm -f "$f.out"
    return $st
}

# group NAME FN: runs FN in a subshell (it exits 0, 1, or 77 for a skip;
# skip and why leave the reason) and records the outcome
group() {
    case ",$SEL," in *",$1,"*) ;; *) return 0 ;; esac
    local t0=$SECONDS st
    { echo; echo "==== group $1"; } >> "$LOG"
    ( "$2" )
    st=$?
    local dt=$((SECONDS - t0)) why late
    why=$(cat "$OUT/.why" 2>/dev/null); rm -f "$OUT/.why"
    late=$(paste -sd ';' "$OUT/.timeouts" 2>/dev/null | sed 's/;/; /g'); rm -f "$OUT/.timeouts"
    if [ -n "$late" ]; then # a command that ran out of time fails its group
        [ $st = 0 ] || [ $st = 77 ] && st=1
        why="timed out $late${why:+; $why}"
    fi
    if [ $st = 77 ]; then
        note "SKIP $1 (${dt} s): skipped: $why"
    elif [ $st = 0 ]; then
        note "PASS $1 (${dt} s)${why:+: $why}"
    else
        note "FAIL $1 (${dt} s): ${why:-see log.txt}"
        FAILED=1
    fi
}
skip() { echo "$*" > "$OUT/.why"; exit 77; }
why() { echo "$*" > "$OUT/.why"; }
needs_gpu() { [ "$STAND_IN" = 0 ] || skip "needs a GPU"; }

g_standins() {
    cmd "${FAKE_ENV[@]}" "$BIN/mt_tests" device_cuda cuda_standin || { why "stand-in tests failed"; exit 1; }
}
g_ops() {
    needs_gpu
    cmd MT_TEST_GPU=1 "$BIN/mt_tests" ops_ || { why "op conformance failed"; exit 1; }
}
# the engine tests' names, one a line
engine_tests() { limited "$BIN/mt_tests" --list gpu_engine; }

g_engine() {
    needs_gpu
    local names t out=$OUT/.engine.out bad=() hung=()
    names=$(engine_tests) && [ -n "$names" ] || { why "cannot list the engine tests"; exit 1; }
    for t in $names; do # each in a process of its own: a fault or hang stays there
        { echo; echo "\$ MT_TEST_GPU=1 $BIN/mt_tests $t"; } >> "$LOG"
        watched MT_TEST_GPU=1 "$BIN/mt_tests" "$t" > "$out" 2>&1
        local st=$?
        cat "$out" >> "$LOG"
        [ $st = 0 ] && continue
        if [ $st = 124 ] && grep -q "^ok  *$t " "$out"; then
            hung+=("$t") # its checks passed; the process did not end
            continue
        fi
        bad+=("$t")
        # again, every launch waited for: a kernel that fails is named
        cmd MT_TEST_GPU=1 MT_CUDA_DEBUG_SYNC=1 "$BIN/mt_tests" "$t"
    done
    rm -f "$out"
    local w=""
    [ ${#bad[@]} = 0 ] || w="failed: ${bad[*]} (see log.txt; each was run again with MT_CUDA_DEBUG_SYNC=1)"
    [ ${#hung[@]} = 0 ] || w="${w:+$w; }printed ok, then did not exit: ${hung[*]}"
    [ -z "$w" ] || { why "$w"; exit 1; }
}
g_estimate() {
    cmd "${DEV_ENV[@]}" "$BIN/mt_tests" estimate_equals_measured_cuda budget_policy_stays_within_cuda ||
        { why "estimate != measured, or over budget"; exit 1; }
}
g_driver() {
    local ok=0 TMO=$LONG_TMO
    cmd "${DEV_ENV[@]}" MT_TEST_VERBOSE=1 "$BIN/mt_tests" driver_sees_the_accounting_cuda || ok=1
    local q=(); [ "$QUICK" = 1 ] || [ "$STAND_IN" = 1 ] && q=(--quick)
    cmd "${DEV_ENV[@]}" "$BIN/bench_memory" --sections d "${q[@]}" || ok=1
    [ $ok = 0 ] || why "driver below the accounting, or bench_memory (d) failed"
    exit $ok
}
g_memcheck() {
    needs_gpu
    local cs ok=0 names t TMO=$LONG_TMO
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null) ||
        skip "compute-sanitizer not found"
    # (MT_TEST_MEMCHECK: the tests leave out the calls they make for the
    # driver to refuse, which the sanitizer would count as errors)
    cmd MT_TEST_GPU=1 MT_TEST_MEMCHECK=1 "$cs" --tool memcheck --error-exitcode 1 "$BIN/mt_tests" ops_ || ok=1
    names=$(TMO=$TEST_TMO engine_tests) || ok=1
    # each engine test within a test's limit: they are small, and one that
    # hangs (memcheck reports an error as it finds it) must not take the
    # benchmark limit
    TMO=$TEST_TMO
    for t in $names; do
        cmd MT_TEST_GPU=1 MT_TEST_MEMCHECK=1 "$cs" --tool memcheck --error-exitcode 1 "$BIN/mt_tests" "$t" || ok=1
    done
    [ $ok = 0 ] || why "memcheck found errors, or a test failed under it"
    exit $ok
}
g_nccl() {
    local env=("${DEV_ENV[@]}") out=$OUT/.nccl.out st
    [ "$STAND_IN" = 1 ] && env+=(MT_FAKE_NCCL="$HERE/stand-in/libfakenccl.so")
    { echo; echo "\$ ${env[*]} $BIN/mt_tests comm_nccl_one_rank"; } >> "$LOG"
    limited "${env[@]}" "$BIN/mt_tests" comm_nccl_one_rank > "$out" 2>&1
    st=$?
    cat "$out" >> "$LOG"
    # the test says why when it skips (no libnccl.so.2 found: the paths tried)
    local skipped
    skipped=$(sed -n 's/^ *(skipped: \(.*\))$/\1/p' "$out" | tail -n 1)
    rm -f "$out"
    [ $st = 0 ] || { why "the one-rank NCCL test failed"; exit 1; }
    [ -z "$skipped" ] || skip "$skipped"
    [ "$STAND_IN" = 1 ] && why "over the stand-in libnccl"
    exit 0
}
g_kernels() {
    local a=(--json "$OUT/bench_cuda.json") TMO=$LONG_TMO
    [ "$QUICK" = 1 ] && a+=(--quick)
    if [ "$STAND_IN" = 1 ]; then
        cmd "${FAKE_ENV[@]}" "$BIN/bench_cuda" --quick --json "$OUT/bench_cuda.json" || exit 1
        why "stand-in: the figures mean nothing"
    else
        cmd "$BIN/bench_cuda" "${a[@]}" || exit 1
    fi
    exit 0
}

# GPT-2: each configuration by both sides, in turns, on the same data and
# starting weights (both read an llm.c checkpoint and token file made here)
g_gpt2() {
    local d=$OUT/gpt2 py=python3 torch=1 TMO=$LONG_TMO
    mkdir -p "$d"
    local shape=(--layers 12 --heads 12 --channels 768) tshape=(--L 12 --H 12 --C 768)
    local bt=(--batch 8 --seq 1024) tbt=(--B 8 --T 1024) steps=(--steps 10 --warmup 3)
    if [ "$STAND_IN" = 1 ] || [ "$QUICK" = 1 ]; then
        shape=(--layers 2 --heads 2 --channels 64) tshape=(--L 2 --H 2 --C 64)
        bt=(--batch 2 --seq 64) tbt=(--B 2 --T 64) steps=(--steps 2 --warmup 1)
    fi
    if [ "$STAND_IN" = 1 ]; then
        torch=0
    elif ! TMO=$TEST_TMO limited "$py" -c 'import torch, numpy; assert torch.cuda.is_available()' >> "$LOG" 2>&1; then
        torch=0
        why "no PyTorch with CUDA in $py: memtrain's side only"
    fi
    local data=()
    if [ $torch = 1 ]; then
        cmd "$py" "$HERE/bench/gpt2_tools.py" tokens "$d/tokens.bin" --vocab 50257 --seed 1234 || exit 1
        cmd "$py" "$HERE/bench/torch_gpt2.py" "${tshape[@]}" --B 1 --T 8 --steps 1 --warmup 0 \
            --write-llmc-checkpoint "$d/init.bin" || exit 1
        data=(--tokens "$d/tokens.bin" --llmc-checkpoint "$d/init.bin")
    fi
    local env=(); [ "$STAND_IN" = 1 ] && env=("${FAKE_ENV[@]}")
    local ok=0 i=0 tag ours theirs
    for row in "fp32||" "bf16|--precision bf16|--bf16" \
        "bf16_adamw8_fused_sqrt|--precision bf16 --optimizer adamw8 --fused --recompute sqrt|--bf16 --adamw8 --step-in-backward --checkpointing"; do
        IFS='|' read -r tag ours theirs <<< "$row"
        # shellcheck disable=SC2086 # the flags are words
        run_ours() {
            json "$d/$tag.memtrain.json" "${env[@]}" "$BIN/bench_gpt2" --device cuda "${data[@]}" \
                "${shape[@]}" "${bt[@]}" "${steps[@]}" $ours || ok=1
        }
        # shellcheck disable=SC2086
        run_theirs() {
            [ $torch = 1 ] || return 0
            json "$d/$tag.pytorch.json" "$py" "$HERE/bench/torch_gpt2.py" --device cuda \
                "${data[@]}" "${tbt[@]}" "${steps[@]}" $theirs || true
        }
        if [ $((i % 2)) = 0 ]; then run_ours; run_theirs; else run_theirs; run_ours; fi
        i=$((i + 1))
    done
    # where the step's time goes: every op's kernels, each launch waited for
    json "$d/bf16_profile.memtrain.json" "${env[@]}" "$BIN/bench_gpt2" --device cuda "${data[@]}" \
        "${shape[@]}" "${bt[@]}" --steps 3 --warmup 1 --precision bf16 --profile || ok=1
    # the shared weights and tokens are large and made again by each run
    rm -f "$d/tokens.bin" "$d/init.bin"
    [ $ok = 0 ] || why "a memtrain run failed"
    exit $ok
}

{
    echo "memtrain GPU validation, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    [ -f "$HERE/MANIFEST" ] && cat "$HERE/MANIFEST"
    echo "machine: $(uname -srm); glibc $(ldd --version 2>/dev/null | head -n1 | awk '{print $NF}')"
    if [ "$STAND_IN" = 1 ]; then
        echo "mode: --stand-in (no GPU: the stand-in driver and cuBLASLt)"
    else
        limited nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
            sed 's/^/gpu: /'
        (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -n1 |
            sed 's/^/toolkit: /'
    fi
} | tee "$OUT/machine.txt" >> "$LOG"
rm -f "$OUT/.timeouts" # (nvidia-smi's, already in machine.txt)

# the bundle's programs want at least the glibc of the machine that built them
need=$(sed -n 's/^needs glibc: //p' "$HERE/MANIFEST" 2>/dev/null)
have=$(ldd --version 2>/dev/null | head -n1 | awk '{print $NF}')
if [ -n "$need" ] && [ -n "$have" ] &&
    [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n1)" != "$need" ]; then
    note "WARNING: this machine's glibc is $have, the bundle's programs need $need: they may not start"
fi

group standins g_standins
group ops g_ops
group engine g_engine
group estimate g_estimate
group driver g_driver
group memcheck g_memcheck
group nccl g_nccl
group kernels g_kernels
group gpt2 g_gpt2

{
    echo
    # GPT-2 side by side: tokens/s and peak device memory (ours: the
    # allocators' peak reserve; PyTorch: its caching allocator's peak reserve)
    if [ -d "$OUT/gpt2" ] && command -v python3 > /dev/null; then
        python3 - "$OUT/gpt2" <<'PY' || true
import json, os, sys
d = sys.argv[1]
def load(tag, impl):
    try:
        return json.loads(open(os.path.join(d, "%s.%s.json" % (tag, impl))).read())
    except (OSError, ValueError):
        return None
print("GPT-2 | memtrain tok/s | PyTorch tok/s | ratio | memtrain peak MiB | PyTorch peak MiB")
for tag in ("fp32", "bf16", "bf16_adamw8_fused_sqrt"):
    m, t = load(tag, "memtrain"), load(tag, "pytorch")
    tps = lambda r: r["B"] * r["T"] * 1000.0 / r["ms_per_step_median"] if r else None
    a, b = tps(m), tps(t)
    f = lambda x: "%.0f" % x if x is not None else "-"
    print("%s | %s | %s | %s | %s | %s" % (tag, f(a), f(b), "%.2f" % (a / b) if a and b else "-",
          f(m["mem_peak_reserved_mib"]) if m else "-",
          f(t.get("peak_device_reserved_mib")) if t else "-"))
PY
    fi
    echo
    echo "figures (JSON, one line each):"
    for f in "$OUT"/bench_cuda.json "$OUT"/gpt2/*.json; do
        [ -s "$f" ] && sed "s|^|${f#"$OUT"/}: |" "$f"
    done
} >> "$RESULTS"
echo "results: $RESULTS; log: $LOG"
exit $FAILED
