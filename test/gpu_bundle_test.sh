#!/usr/bin/env bash
# gpu_bundle_test.sh BUNDLE_DIR - what run.sh does with tests that hang,
# fail or pass, without a GPU: a copy of the bundle's run.sh and golden
# files beside a pretend bin/mt_tests (this script writes it) is run as on a
# GPU machine, from another directory, with a short --timeout. It checks
# that the golden files are found (MT_GOLDEN_DIR), that each engine test
# runs in a process of its own, that a test that printed ok and then never
# exited fails the group as "timed out" within the limit, with its
# threads and (without gdb, by the bundle's mt_stacks) their stacks written
# to the log first, that a failing
# one is run again with MT_CUDA_DEBUG_SYNC=1, and that the groups after a
# hang still run.
set -u
bundle=${1:?usage: gpu_bundle_test.sh BUNDLE_DIR}
bundle=$(cd "$bundle" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
bad() { echo "FAIL gpu bundle: $*"; fail=1; }

[ -s "$bundle/golden/gpt2_tiny_tokens.bin" ] && [ -s "$bundle/golden/gpt2_tiny.bin" ] ||
    bad "the bundle carries no golden files (golden/gpt2_tiny*.bin)"

b=$tmp/memtrain-gpu
mkdir -p "$b/bin" "$b/lib" "$tmp/elsewhere"
cp "$bundle/run.sh" "$b/"
cp "$bundle/bin/mt_stacks" "$b/bin/" || bad "the bundle carries no stack sampler (bin/mt_stacks)"
ln -s "$bundle/golden" "$b/golden"
ln -s "$bundle/stand-in" "$b/stand-in"
# the pretend test suite: each call appended to calls.txt with the
# directory it ran from and its MT_GOLDEN_DIR
cat > "$b/bin/mt_tests" << 'EOF'
#!/usr/bin/env bash
here=$(cd "$(dirname "$0")" && pwd)
echo "$* | ${MT_GOLDEN_DIR:-unset} | ${MT_CUDA_DEBUG_SYNC:-0}" >> "$here/../calls.txt"
if [ "$1" = --list ]; then
    printf '%s\n' gpu_engine_distill_matches_cpu gpu_engine_matches_cpu gpu_engine_lora_matches_cpu
    exit 0
fi
case "$1" in
gpu_engine_distill_matches_cpu) # passes, then never exits
    echo "ok   $1 0.600 s"
    exec sleep 300 ;;
gpu_engine_matches_cpu) # reads the golden files, as the real test does
    [ -s "${MT_GOLDEN_DIR:-test/golden}/gpt2_tiny_tokens.bin" ] || {
        echo "FAIL $1 0.003 s"; exit 1; } ;;
gpu_engine_lora_matches_cpu)
    echo "FAIL $1 0.100 s"; exit 1 ;;
esac
echo "ok   $1 0.001 s"
EOF
chmod +x "$b/bin/mt_tests"

t0=$SECONDS
(cd "$tmp/elsewhere" && env -u MT_GOLDEN_DIR GDB=no-gdb-here "$b/run.sh" --groups engine,nccl --timeout 3 \
    "$tmp/res" > "$tmp/out" 2>&1)
st=$?
took=$((SECONDS - t0))
res=$tmp/res/results.txt
[ $st = 1 ] || bad "run.sh exited $st, expected 1 (a group failed)"
[ $took -lt 60 ] || bad "run.sh took $took s with a 3 s limit per command"
grep -q "^FAIL engine .*timed out after 3 s: mt_tests gpu_engine_distill_matches_cpu" "$res" ||
    bad "the hung test is not reported as timed out"
grep -q "^FAIL engine .*printed ok, then did not exit: gpu_engine_distill_matches_cpu" "$res" ||
    bad "the hung test's passing checks are not said"
grep -q "^FAIL engine .*failed: gpu_engine_lora_matches_cpu" "$res" ||
    bad "the failing test is not named"
grep -q "^PASS nccl" "$res" || bad "the group after the hang did not run, or failed"
grep -q "^(threads of process" "$tmp/res/log.txt" && grep -q "^  sleep S" "$tmp/res/log.txt" ||
    bad "the hung test's threads are not in the log"
# without gdb, the sampler's stacks: sleep's thread waits in libc's sleep call
grep -q "^(their stacks, mt_stacks" "$tmp/res/log.txt" &&
    grep -q "^thread [0-9]* (sleep): at 0x[0-9a-f]* libc[.a-z0-9-]*+0x[0-9a-f]*  [_a-z]*sleep" "$tmp/res/log.txt" ||
    bad "the hung test's stacks (mt_stacks, no gdb) are not in the log"
calls=$b/calls.txt
for t in gpu_engine_distill_matches_cpu gpu_engine_matches_cpu gpu_engine_lora_matches_cpu; do
    grep -q "^$t | $b/golden | 0$" "$calls" ||
        bad "$t was not run alone with MT_GOLDEN_DIR at the bundle's golden files"
done
grep -q "^gpu_engine_lora_matches_cpu | .* | 1$" "$calls" ||
    bad "the failing test was not run again with MT_CUDA_DEBUG_SYNC=1"
grep -q "^gpu_engine_matches_cpu | .* | 1$" "$calls" && bad "a passing test was run again"
grep -q "^gpu_engine_distill_matches_cpu | .* | 1$" "$calls" &&
    bad "the test that passed and hung was run again"
if [ $fail != 0 ]; then
    echo "--- results.txt"; cat "$res"
    echo "--- calls"; cat "$calls"
    echo "--- output"; cat "$tmp/out"
    exit 1
fi
echo "gpu bundle: a hung test times out, a failing one is rerun with debug sync, the rest run"
