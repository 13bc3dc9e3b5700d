#!/bin/sh
# Checks the memtrain command: exit codes, errors on bad input, a short
# training run, and a trace recorded and replayed through every allocator.
set -u
tool="$1"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
expect() { # expect CODE DESCRIPTION -- command...
    code=$1; what=$2; shift 3
    "$@" >"$tmp/out" 2>"$tmp/err"; got=$?
    if [ "$got" != "$code" ]; then
        echo "FAIL tool: $what: exit $got, expected $code"; cat "$tmp/out" "$tmp/err"; fail=1
    fi
}
expect 0 "version" -- "$tool" --version
grep -q "^memtrain [0-9]" "$tmp/out" || { echo "FAIL tool: version text"; fail=1; }
grep -Eq "^CPU kernels: (baseline|avx2|avx512|avx512_bf16|amx)$" "$tmp/out" || { echo "FAIL tool: version's CPU class"; cat "$tmp/out"; fail=1; }
# MT_CPU_ISA caps the CPU class; a value that names none is refused, listing them
MT_CPU_ISA=baseline "$tool" --version | grep -q "^CPU kernels: baseline$" || { echo "FAIL tool: MT_CPU_ISA=baseline"; fail=1; }
expect 1 "unknown CPU class" -- env MT_CPU_ISA=avx3 "$tool" train --steps 1
grep -q "MT_CPU_ISA='avx3' is not a CPU class; the classes are baseline, avx2, avx512, avx512_bf16 and amx" "$tmp/err" || { echo "FAIL tool: MT_CPU_ISA message"; cat "$tmp/err"; fail=1; }
expect 0 "help" -- "$tool" --help
expect 0 "train help" -- "$tool" train --help
expect 2 "no command" -- "$tool"
expect 2 "unknown command" -- "$tool" frobnicate
expect 2 "unknown option" -- "$tool" train --frob 1
grep -q "unknown option '--frob'" "$tmp/err" || { echo "FAIL tool: message names the option"; fail=1; }
expect 2 "bad value" -- "$tool" train --steps many
grep -q "bad --steps 'many'" "$tmp/err" || { echo "FAIL tool: message names the value"; fail=1; }
expect 2 "missing value" -- "$tool" train --steps
expect 2 "unknown allocator" -- "$tool" train --allocator nope
expect 1 "cuda without a driver" -- "$tool" train --device cuda --steps 1
grep -qi "cuda\|driver\|device" "$tmp/err" || { echo "FAIL tool: cuda message"; fail=1; }
expect 0 "short training with a trace" -- "$tool" train --steps 40 --every 20 --trace "$tmp/t.trace" --report
grep -q "held-out batch" "$tmp/out" && grep -q "memory report" "$tmp/out" || { echo "FAIL tool: train output"; cat "$tmp/out"; fail=1; }
expect 0 "fp16 training" -- "$tool" train --steps 40 --every 20 --precision fp16
grep -q "scale 65536" "$tmp/out" || { echo "FAIL tool: fp16 output"; cat "$tmp/out"; fail=1; }
expect 2 "bad precision" -- "$tool" train --precision fp8
expect 0 "replay every allocator" -- "$tool" replay "$tmp/t.trace" --allocator all
# 'all' walks the library's registry of built-in allocators: one line each,
# and every name it gives must be in each command's help (no stale list)
names=$(awk '/efficiency/ {print $1}' "$tmp/out")
[ "$(echo "$names" | wc -w)" -ge 4 ] || { echo "FAIL tool: replay output"; cat "$tmp/out"; fail=1; }
for c in train estimate replay; do
    "$tool" $c --help >"$tmp/help" 2>&1
    for n in $names; do
        grep -q -- "$n" "$tmp/help" || { echo "FAIL tool: $c --help does not name allocator $n"; fail=1; }
    done
done
head -c 100 "$tmp/t.trace" > "$tmp/cut.trace"
expect 1 "truncated trace" -- "$tool" replay "$tmp/cut.trace"
grep -q "truncated\|not a memtrain trace" "$tmp/err" || { echo "FAIL tool: truncated trace message"; cat "$tmp/err"; fail=1; }
expect 1 "missing trace" -- "$tool" replay "$tmp/none.trace"
# estimates, budgets, auto-fit; the estimate matches the run's own report.
# estimate's defaults are train's (the estimate is that run's); these are of
# GPT-2 124M's shape without clipping unless they say otherwise (a later
# option overrides an earlier one)
E="--model gpt --layers 12 --heads 12 --channels 768 --vocab 50257 --max-seq 1024 --batch 4 --clip 0"
expect 0 "estimate help" -- "$tool" estimate --help
expect 0 "estimate a GPT-2 124M step" -- "$tool" estimate $E --json --threads 2
grep -q '"peak": 1996332040' "$tmp/out" || { echo "FAIL tool: estimate of GPT-2 124M fp32 AdamW B4 T64"; cat "$tmp/out"; fail=1; }
# one rank of 4 at ZeRO stage 2: a quarter of one rank's optimizer state
# (8 bytes x 124475904 parameters), within a block per tensor
expect 0 "estimate a rank under ZeRO" -- "$tool" estimate $E --json --threads 2 --ranks 4 --rank 3 --zero 2 --batch 16
sed 's/.*"class_peak": {[^}]*"OPTIM": \([0-9]*\).*/\1/' "$tmp/out" |
    awk '{ if ($1 < 995807232 / 4 - 4096 || $1 > 995807232 / 4 + 4096) exit 1 }' ||
    { echo "FAIL tool: the OPTIM of a rank of 4 at ZeRO stage 2"; cat "$tmp/out"; fail=1; }
grep -q '"ranks": 4, "rank": 3, "zero": 2' "$tmp/out" || { echo "FAIL tool: estimate --ranks JSON"; fail=1; }
# tensor groups of 2: a rank holds about half of the weights, gradients and
# optimizer state (the LayerNorms, positions and two biases per block whole)
expect 0 "estimate a rank of a tensor group" -- "$tool" estimate $E --json --threads 2 --ranks 2 --tp 2 --rank 1
sed 's/.*"class_peak": {[^}]*"OPTIM": \([0-9]*\).*/\1/' "$tmp/out" |
    awk '{ if ($1 < 995807232 / 2 || $1 > 995807232 / 2 * 1.01) exit 1 }' ||
    { echo "FAIL tool: the OPTIM of a rank of a tensor group of 2"; cat "$tmp/out"; fail=1; }
grep -q '"ranks": 2, "rank": 1, "zero": 0, "tp": 2' "$tmp/out" || { echo "FAIL tool: estimate --tp JSON"; fail=1; }
# pipeline stages of 4, in micro-batches of one row: each rank holds its stage's weights
# and state (about a quarter, the last stage the table's copy too), and stage 0 holds up
# to 4 micro-batches' activations where the last holds one
for r in 0 3; do
    expect 0 "estimate stage $r of 4" -- "$tool" estimate $E --json --threads 2 --ranks 4 --pp 4 --rank $r --micro 1
    sed 's/.*"class_peak": {[^}]*"OPTIM": \([0-9]*\).*/\1/' "$tmp/out" |
        awk '{ if ($1 < 995807232 / 4 * 0.5 || $1 > 995807232 / 4 * 2.2) exit 1 }' ||
        { echo "FAIL tool: the OPTIM of pipeline stage $r of 4"; cat "$tmp/out"; fail=1; }
    grep -q '"tp": 1, "sp": false, "pp": 4' "$tmp/out" || { echo "FAIL tool: estimate --pp JSON"; fail=1; }
    sed 's/.*"class_peak": {[^}]*"ACT": \([0-9]*\).*/\1/' "$tmp/out" >"$tmp/act$r"
done
[ "$(cat "$tmp/act0")" -gt "$(cat "$tmp/act3")" ] ||
    { echo "FAIL tool: stage 0's ACT $(cat "$tmp/act0") not above stage 3's $(cat "$tmp/act3")"; fail=1; }
expect 2 "estimate: --ranks not a multiple of --tp x --pp" -- "$tool" estimate $E --ranks 6 --tp 2 --pp 2
# --layout auto: every layout of 4 ranks (tensor and pipeline groups) auto-fitted, the chosen
# one printed and estimated
expect 0 "estimate: --layout auto" -- "$tool" estimate --model gpt --layers 2 --heads 4 --channels 64 --vocab 512 --seq 64 --batch 8 --ranks 4 --budget 64 --autofit --layout auto
grep -q "^| 4 | 1 | yes | 0 | 1 | " "$tmp/out" && grep -q "^chosen: --tp [124] --pp [124]" "$tmp/out" &&
    grep -q "^| 2 | 1 | no | 3 | 2 | " "$tmp/out" && grep -q "^| 2 | 1 | yes | 3 | 2 | " "$tmp/out" &&
    grep -q "^| 1 | 2 | no | 2 | 2 | yes | " "$tmp/out" && grep -q "^| 2 | 2 | yes | 0 | 1 | yes | " "$tmp/out" ||
    { echo "FAIL tool: --layout auto's table"; cat "$tmp/out"; fail=1; }
expect 2 "estimate: --layout auto without --ranks" -- "$tool" estimate --model gpt --budget 64 --autofit --layout auto
expect 2 "estimate: --tp not dividing --ranks" -- "$tool" estimate $E --ranks 3 --tp 2
expect 1 "estimate: --tp not dividing the heads" -- "$tool" estimate $E --ranks 5 --tp 5 --batch 5
expect 2 "estimate: a rank beyond --ranks" -- "$tool" estimate $E --ranks 2 --rank 2
expect 0 "auto-fit" -- "$tool" estimate $E --budget 1500 --autofit --allow-8bit --seq 256 --batch 8
grep -q "auto-fit for 1500.0 MiB" "$tmp/out" && grep -q "fits" "$tmp/out" || { echo "FAIL tool: auto-fit"; cat "$tmp/out"; fail=1; }
expect 3 "impossible budget" -- "$tool" estimate $E --budget 100 --recompute budget
grep -q "the least this model and config can take is" "$tmp/err" || { echo "FAIL tool: budget message"; cat "$tmp/err"; fail=1; }
# with --json, a budget nothing fits is JSON too: the least the run can take
expect 3 "impossible budget, JSON" -- "$tool" estimate $E --budget 100 --recompute budget --json
grep -q '^{"budget": 104857600, "fits": false, "least": 2[0-9]*, "error": ".*least.*"}$' "$tmp/out" || { echo "FAIL tool: budget JSON"; cat "$tmp/out"; fail=1; }
expect 3 "impossible auto-fit, JSON" -- "$tool" estimate $E --budget 100 --autofit --json
grep -q '^{"budget": 104857600, "fits": false, "least": 2[0-9]*, ' "$tmp/out" || { echo "FAIL tool: auto-fit budget JSON"; cat "$tmp/out"; fail=1; }
expect 2 "bad recompute" -- "$tool" estimate $E --recompute often
expect 2 "autofit without a budget" -- "$tool" estimate $E --autofit
# 4-bit state is its own opt-in: a budget under the least 8-bit state needs
# for this model and over the least 4-bit state needs (19.0 and 17.0 MiB
# here), both from estimates of this run on this CPU (a model whose state
# outweighs the allocators' rounding of the reserve)
least() { # least ESTIMATE-OPTIONS...: the least MiB auto-fit can reach, from its JSON
    "$tool" estimate $E "$@" --budget 0.001 --json 2>/dev/null | sed -n 's/.*"least": \([0-9]*\).*/\1/p'
}
small="--layers 2 --heads 4 --channels 256 --vocab 256 --max-seq 64 --batch 4 --seq 64 --autofit"
# shellcheck disable=SC2086
least8=$(least $small --allow-8bit); least4=$(least $small --allow-8bit --allow-4bit)
mid=$(awk -v a="$least4" -v b="$least8" 'BEGIN { if (a + 0 > 0 && a + 0 < b + 0) printf "%.6f", (a + b) / 2 / 1048576 }')
[ -n "$mid" ] || { echo "FAIL tool: least with 4-bit state ($least4) not below 8-bit's ($least8)"; fail=1; mid=18; }
small="$small --budget $mid"
# shellcheck disable=SC2086
expect 3 "auto-fit, 8-bit state too much" -- "$tool" estimate $E $small --allow-8bit
# shellcheck disable=SC2086
expect 0 "auto-fit choosing 4-bit state" -- "$tool" estimate $E $small --allow-8bit --allow-4bit --json
grep -q '"autofit": {"micro_batch": [0-9]*, "optimizer": "adamw4"' "$tmp/out" || { echo "FAIL tool: auto-fit 4-bit"; cat "$tmp/out"; fail=1; }
# shellcheck disable=SC2086
expect 0 "auto-fit choosing 4-bit state, table" -- "$tool" estimate $E $small --allow-4bit
grep -q "4-bit AdamW" "$tmp/out" || { echo "FAIL tool: auto-fit 4-bit report"; cat "$tmp/out"; fail=1; }
expect 2 "--allow-4bit without --autofit" -- "$tool" estimate $E --allow-4bit
# auto-fit on several ranks: at ZeRO stage 1 on 2 ranks this model needs
# 170.8 MiB at the least resident and 156.9 MiB with the state on disk, so
# 165 MiB takes the disk, the same choice for each rank
table="--layers 4 --heads 4 --channels 512 --vocab 256 --max-seq 64 --batch 4 --seq 64 --ranks 2 --zero 1 --budget 165 --autofit"
big="$table --json"
for r in 0 1; do
    # shellcheck disable=SC2086
    expect 0 "auto-fit on 2 ranks, rank $r" -- "$tool" estimate $E $big --rank $r --offload-dir "$tmp"
    sed 's/.*"autofit": {\([^}]*\)}.*/\1/' "$tmp/out" >"$tmp/fit$r"
    grep -q '"offload": "disk"' "$tmp/fit$r" || { echo "FAIL tool: auto-fit on 2 ranks, rank $r"; cat "$tmp/out"; fail=1; }
done
cmp -s "$tmp/fit0" "$tmp/fit1" || { echo "FAIL tool: auto-fit differs between ranks"; cat "$tmp/fit0" "$tmp/fit1"; fail=1; }
# shellcheck disable=SC2086
expect 3 "auto-fit on 2 ranks without the disk" -- "$tool" estimate $E $big
# a CUDA run (no GPU needed; 174 MiB at the least resident, 116 MiB with
# the state in pinned host memory): the state in host memory
# shellcheck disable=SC2086
expect 0 "auto-fit on 2 ranks, CUDA" -- "$tool" estimate $E $big --device cuda --budget 150
grep -q '"offload": "host"' "$tmp/out" || { echo "FAIL tool: auto-fit to host memory"; cat "$tmp/out"; fail=1; }
# shellcheck disable=SC2086
expect 0 "auto-fit on 2 ranks, CUDA, table" -- "$tool" estimate $E $table --device cuda --budget 150 --rank 1
grep -q "auto-fit for 150.0 MiB on each of 2 ranks: .*in pinned host memory" "$tmp/out" || { echo "FAIL tool: auto-fit on 2 ranks, table"; cat "$tmp/out"; fail=1; }
# at ZeRO stage 3 (above 170 MiB at the least resident, 150 MiB with the
# state in pinned host memory): 160 MiB takes host memory
# shellcheck disable=SC2086
expect 0 "auto-fit on 2 ranks at stage 3, CUDA" -- "$tool" estimate $E $big --zero 3 --device cuda --budget 160
grep -q '"zero": 3,' "$tmp/out" && grep -q '"offload": "host"' "$tmp/out" || { echo "FAIL tool: auto-fit to host memory at stage 3"; cat "$tmp/out"; fail=1; }
expect 0 "train with plots" -- "$tool" train --steps 5 --every 5 --report --svg "$tmp/m.svg" --chrome "$tmp/m.json"
grep -q "<svg" "$tmp/m.svg" && grep -q '"traceEvents"' "$tmp/m.json" || { echo "FAIL tool: plots"; fail=1; }
# the report's estimate column equals its peak column on every class row
awk '/^(PARAM|MASTER|GRAD|OPTIM|ACT|WORK|IO|COMM|total) / && !done { if ($4 $5 != $6 $7) bad = 1; if ($1 == "total") done = 1 } END { exit bad }' "$tmp/out" || { echo "FAIL tool: estimate column"; cat "$tmp/out"; fail=1; }

# the MLP takes the trainer's options, each changing its run (the loss, the
# peak, or ACT's own peak); options that mean nothing for it are refused, and
# so are combinations that cannot go together, by their option names
mlp() { "$tool" train --steps 20 --json "$@" | grep '"step": 20,' | grep -o '"loss": [0-9.]*\|"peak_bytes": [0-9]*' | tr '\n' ' '; }
mlp_base=$(mlp)
for opts in "--optimizer adamw" "--clip 0.01" "--micro 16" "--fused" "--precision bf16 --no-master"; do
    got=$(mlp $opts)
    [ -n "$got" ] && [ "$got" != "$mlp_base" ] || { echo "FAIL tool: mlp $opts: '$got' against '$mlp_base'"; fail=1; }
done
act() { "$tool" train --steps 3 --hidden 256,256,256,256 --batch 128 --report "$@" | grep '^ACT'; }
[ -n "$(act)" ] && [ "$(act)" != "$(act --recompute sqrt)" ] || { echo "FAIL tool: mlp --recompute sqrt"; act; fail=1; }
# --json with --report, a trace and plots: stdout is JSON alone, the rest on stderr
expect 0 "json with a report" -- "$tool" train --steps 5 --json --report --trace "$tmp/j.trace" --svg "$tmp/j.svg"
[ "$(grep -vc '^{' "$tmp/out")" = 0 ] && grep -q "memory report" "$tmp/err" && grep -q "j.svg" "$tmp/err" || { echo "FAIL tool: --json --report output"; cat "$tmp/out"; fail=1; }
expect 0 "gpt json with a report" -- "$tool" train --model gpt --layers 1 --channels 32 --steps 2 --json --report --save "$tmp/j.ckpt" --threads 2
[ "$(grep -vc '^{' "$tmp/out")" = 0 ] && grep -q "memory report" "$tmp/err" || { echo "FAIL tool: gpt --json --report output"; cat "$tmp/out"; fail=1; }
expect 0 "mlp json" -- "$tool" train --steps 5 --json
[ "$(grep -vc '^{' "$tmp/out")" = 0 ] && grep -q '"held_out_rows": 64, "loss": [0-9.]*, "accuracy"' "$tmp/out" || { echo "FAIL tool: mlp --json"; cat "$tmp/out"; fail=1; }
expect 2 "mlp refuses --seq" -- "$tool" train --seq 32
grep -q -- "--seq: not for the MLP" "$tmp/err" || { echo "FAIL tool: mlp --seq message"; cat "$tmp/err"; fail=1; }
expect 2 "mlp refuses selective recompute" -- "$tool" train --recompute selective
expect 2 "gpt refuses --hidden" -- "$tool" train --model gpt --hidden 8
expect 2 "estimate of an mlp refuses --layers" -- "$tool" estimate $E --model mlp --layers 3
expect 2 "--no-master without bf16" -- "$tool" train --model gpt --no-master
grep -q -- "--no-master needs --precision bf16" "$tmp/err" || { echo "FAIL tool: --no-master message"; cat "$tmp/err"; fail=1; }
expect 2 "heads not dividing channels" -- "$tool" train --model gpt --heads 5
grep -q -- "--heads must divide --channels" "$tmp/err" || { echo "FAIL tool: --heads message"; cat "$tmp/err"; fail=1; }
expect 2 "estimate: heads not dividing channels" -- "$tool" estimate $E --heads 7
expect 2 "--fused with micro-batches" -- "$tool" train --model gpt --fused --micro 4
expect 2 "--micro over --batch" -- "$tool" train --micro 100
expect 2 "--momentum without sgd" -- "$tool" train --model gpt --momentum 0.5
expect 2 "--save-every without --save" -- "$tool" train --model gpt --save-every 5
expect 2 "--llmc with a shape" -- "$tool" train --model gpt --llmc x --layers 3

# output paths are checked before training: a directory, or a path in no
# directory, is a bad command line, and nothing runs; so is a --config that
# is a directory
for o in --save --trace --svg --chrome --export-llmc; do
    expect 2 "$o a directory" -- "$tool" train --model gpt --steps 2 $o "$tmp"
    grep -q -- "$o $tmp: a directory" "$tmp/err" && [ ! -s "$tmp/out" ] || { echo "FAIL tool: $o a directory"; cat "$tmp/out" "$tmp/err"; fail=1; }
    expect 2 "$o in no directory" -- "$tool" train --model gpt --steps 2 $o "$tmp/none/x"
    grep -q -- "$o $tmp/none/x: no directory" "$tmp/err" && [ ! -s "$tmp/out" ] || { echo "FAIL tool: $o in no directory"; cat "$tmp/out" "$tmp/err"; fail=1; }
done
expect 2 "--config a directory" -- "$tool" train --config "$tmp"
[ ! -s "$tmp/out" ] || { echo "FAIL tool: --config a directory trained"; fail=1; }

# a GPT on the built-in corpus learns; a run split by a checkpoint equals one
# run, its training and validation losses
losses() { grep -o '"step": [0-9]*, "loss": [0-9.]*\|"val_loss": [0-9.]*' "$1"; }
expect 0 "gpt learns" -- "$tool" train --model gpt --steps 60 --every 60 --eval-every 10 --json --schedule constant --threads 2
first=$(head -n 1 "$tmp/out" | sed 's/.*"loss": \([0-9.]*\).*/\1/')
last=$(tail -n 1 "$tmp/out" | sed 's/.*"loss": \([0-9.]*\).*/\1/')
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 1.5) }' || { echo "FAIL tool: gpt loss $first -> $last"; fail=1; }
cp "$tmp/out" "$tmp/straight"
expect 0 "gpt first half, saved" -- "$tool" train --model gpt --steps 30 --eval-every 10 --json --schedule constant --threads 2 --save "$tmp/g.ckpt"
expect 0 "gpt resumed" -- "$tool" train --model gpt --steps 60 --eval-every 10 --json --schedule constant --threads 2 --resume "$tmp/g.ckpt"
losses "$tmp/out" > "$tmp/resumed.l"
tail -n 30 "$tmp/straight" > "$tmp/straight.tail"
losses "$tmp/straight.tail" > "$tmp/straight.l"
[ "$(grep -c val_loss "$tmp/resumed.l")" = 3 ] || { echo "FAIL tool: resumed run's validation"; cat "$tmp/resumed.l"; fail=1; }
cmp -s "$tmp/resumed.l" "$tmp/straight.l" || { echo "FAIL tool: resumed losses differ"; diff "$tmp/resumed.l" "$tmp/straight.l" | head; fail=1; }
# --save with no step to train still writes the file (the state it starts
# from), and says so: --steps 0, and a resume already at --steps
expect 0 "--steps 0 --save" -- "$tool" train --model gpt --layers 1 --channels 32 --steps 0 --threads 2 --save "$tmp/zero.ckpt"
[ -s "$tmp/zero.ckpt" ] && grep -q "checkpoint written to $tmp/zero.ckpt (no step trained: the state at step 0 of --steps 0)" "$tmp/out" || { echo "FAIL tool: --steps 0 --save"; cat "$tmp/out" "$tmp/err"; fail=1; }
expect 0 "resumed at --steps, saved" -- "$tool" train --model gpt --steps 30 --schedule constant --threads 2 --resume "$tmp/g.ckpt" --save "$tmp/again.ckpt" --eval-every 10
[ -s "$tmp/again.ckpt" ] && grep -q "the state at step 30 of --steps 30" "$tmp/out" || { echo "FAIL tool: resumed at --steps, --save"; cat "$tmp/out" "$tmp/err"; fail=1; }
expect 0 "the saved copy resumes" -- "$tool" train --model gpt --steps 31 --schedule constant --threads 2 --resume "$tmp/again.ckpt" --eval-every 10
# a run whose loss stops being finite: null in the JSON (never nan or inf),
# exit 4, and no checkpoint written over the last good one
expect 4 "gpt diverges" -- "$tool" train --model gpt --layers 1 --channels 32 --steps 30 --optimizer sgd --lr 1e30 --clip 0 --json --threads 2 --save "$tmp/div.ckpt"
grep -q '"loss": null' "$tmp/out" && ! grep -qi 'nan\|inf' "$tmp/out" || { echo "FAIL tool: JSON of a diverged run"; cat "$tmp/out"; fail=1; }
grep -q "diverged" "$tmp/err" && [ ! -e "$tmp/div.ckpt" ] || { echo "FAIL tool: diverged run's message or checkpoint"; cat "$tmp/err"; fail=1; }
# the skipped step is on the progress line in every precision, and the
# library's warning on stderr
expect 4 "gpt diverges, progress lines" -- "$tool" train --model gpt --layers 1 --channels 32 --steps 30 --optimizer sgd --lr 1e30 --clip 0 --every 1 --threads 2
grep -q "^step .*  skipped 1$" "$tmp/out" && grep -q "^memtrain: warning: mt_trainer_step: step [0-9]* skipped" "$tmp/err" || { echo "FAIL tool: skipped step not shown"; cat "$tmp/out" "$tmp/err"; fail=1; }
# a run whose every step is skipped with a finite loss (the final
# LayerNorm's gain at 1e22: the loss near 4e21, the gradients' sum of
# squares overflows) stops as diverged after 10 in a row, each shown
"$tool" train --model gpt --layers 1 --channels 32 --steps 0 --threads 2 --no-report --export-llmc "$tmp/gain.llmc" >/dev/null 2>&1
python3 - "$tmp/gain.llmc" <<'EOF_PY'
import struct, sys
b = bytearray(open(sys.argv[1], 'rb').read())
C = struct.unpack_from('<i', b, 24)[0]          # the header's channels
for i in range(C):                              # lnf.w: the last C floats but C
    struct.pack_into('<f', b, len(b) - 8 * C + 4 * i, 1e22)
open(sys.argv[1], 'wb').write(b)
EOF_PY
expect 4 "every step skipped" -- "$tool" train --model gpt --llmc "$tmp/gain.llmc" --steps 30 --every 1 --threads 2 --no-report
grep -q "^memtrain: step 10: the last 10 steps were skipped" "$tmp/err" && grep -q "^step     10/30  loss [0-9]*\.[0-9]* .* skipped 10$" "$tmp/out" && ! grep -q "^step     11" "$tmp/out" || { echo "FAIL tool: ten skipped steps"; cat "$tmp/out" "$tmp/err"; fail=1; }
expect 4 "mlp diverges" -- "$tool" train --steps 30 --lr 1e30 --json
grep -q '"loss": null' "$tmp/out" && ! grep -qi 'nan\|inf' "$tmp/out" || { echo "FAIL tool: JSON of a diverged MLP"; cat "$tmp/out"; fail=1; }
# Ctrl-C: the run stops after the step in progress, writes its checkpoint
# (saving every step, so the signal often lands in a save), exits 130 and
# leaves no temporary file; the checkpoint resumes at the step after
"$tool" train --model gpt --layers 1 --channels 32 --steps 100000 --save-every 1 --save "$tmp/int.ckpt" --json --schedule constant --threads 2 >"$tmp/int.out" 2>"$tmp/int.err" &
pid=$!
n=0; while [ ! -e "$tmp/int.ckpt" ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n + 1)); done
kill -INT $pid; wait $pid; code=$?
[ $code = 130 ] && grep -q "interrupted" "$tmp/int.err" || { echo "FAIL tool: Ctrl-C exit $code"; cat "$tmp/int.err"; fail=1; }
last=$(tail -n 1 "$tmp/int.out" | sed 's/{"step": \([0-9]*\),.*/\1/')
expect 0 "resume after Ctrl-C" -- "$tool" train --model gpt --layers 1 --channels 32 --steps $((last + 1)) --json --schedule constant --threads 2 --resume "$tmp/int.ckpt"
grep -q "^{\"step\": $((last + 1))," "$tmp/out" || { echo "FAIL tool: resumed after Ctrl-C at step $last"; cat "$tmp/out"; fail=1; }
expect 0 "sample" -- "$tool" sample --model gpt --resume "$tmp/g.ckpt" --prompt "The " --length 40 --temperature 0
cp "$tmp/out" "$tmp/sample1"
[ "$(head -c 4 "$tmp/sample1")" = "The " ] && [ "$(wc -c < "$tmp/sample1")" -ge 44 ] || { echo "FAIL tool: sample output"; cat "$tmp/sample1"; fail=1; }
expect 0 "sample again" -- "$tool" sample --model gpt --resume "$tmp/g.ckpt" --prompt "The " --length 40 --temperature 0
cmp -s "$tmp/out" "$tmp/sample1" || { echo "FAIL tool: greedy sampling is not repeatable"; fail=1; }
expect 2 "sample without a checkpoint" -- "$tool" sample --model gpt
expect 1 "sample with another model's checkpoint" -- "$tool" sample --model gpt --layers 3 --resume "$tmp/g.ckpt"
head -c 2000 "$tmp/g.ckpt" > "$tmp/cut.ckpt"
expect 1 "resume from a truncated checkpoint" -- "$tool" train --model gpt --steps 60 --resume "$tmp/cut.ckpt"
grep -q "truncated" "$tmp/err" || { echo "FAIL tool: truncated checkpoint message"; cat "$tmp/err"; fail=1; }
expect 1 "missing data file" -- "$tool" train --model gpt --data "$tmp/none.txt"
expect 2 "data without a gpt" -- "$tool" train --data x

# options from a key = value file, the command line overriding it
printf '# a short run\nmodel = gpt\nsteps = 50\njson = 1\nschedule = constant # no warmup\n' > "$tmp/run.cfg"
expect 0 "config file" -- "$tool" train --config "$tmp/run.cfg" --steps 3 --threads 2
[ "$(grep -c '"step"' "$tmp/out")" = 3 ] || { echo "FAIL tool: config file run"; cat "$tmp/out"; fail=1; }
printf 'model = gpt\nlayer = 3\n' > "$tmp/bad.cfg"
expect 2 "unknown key in a config file" -- "$tool" train --config "$tmp/bad.cfg"
grep -q "bad.cfg:2: unknown option 'layer'" "$tmp/err" || { echo "FAIL tool: unknown key message"; cat "$tmp/err"; fail=1; }
printf 'model = gpt\nprompt = hi\n' > "$tmp/bad.cfg" # (sample's, not train's)
expect 2 "another command's key in a config file" -- "$tool" train --config "$tmp/bad.cfg"
grep -q "bad.cfg:2: unknown option 'prompt'" "$tmp/err" || { echo "FAIL tool: other command's key"; cat "$tmp/err"; fail=1; }
printf 'model = gpt\njson = perhaps\n' > "$tmp/bad.cfg"
expect 2 "bad flag value in a config file" -- "$tool" train --config "$tmp/bad.cfg"
grep -q "bad.cfg:2" "$tmp/err" || { echo "FAIL tool: config line number"; cat "$tmp/err"; fail=1; }
expect 1 "missing config file" -- "$tool" train --config "$tmp/none.cfg"

# memtrain report: the trace's peak is the run's
expect 0 "a traced gpt run" -- "$tool" train --model gpt --steps 3 --report --trace "$tmp/g.trace"
runpeak=$(awk '/^total/ { print $4 $5; exit }' "$tmp/out")
expect 0 "report" -- "$tool" report "$tmp/g.trace" --svg "$tmp/r.svg" --chrome "$tmp/r.json"
tracepeak=$(awk '/^peak/ { print $2 "MiB"; exit }' "$tmp/out")
[ "$runpeak" = "$tracepeak" ] || { echo "FAIL tool: report peak $tracepeak, run peak $runpeak"; fail=1; }
[ -s "$tmp/r.svg" ] && [ -s "$tmp/r.json" ] || { echo "FAIL tool: report plots"; fail=1; }
expect 2 "report without a trace" -- "$tool" report
expect 1 "report of a damaged trace" -- "$tool" report "$tmp/cut.trace"

# llm.c model checkpoints: export, import, export again: the same file
expect 0 "export llm.c" -- "$tool" train --model gpt --steps 5 --no-report --export-llmc "$tmp/a.llmc"
expect 0 "import and export llm.c" -- "$tool" train --model gpt --steps 0 --no-report --llmc "$tmp/a.llmc" --export-llmc "$tmp/b.llmc"
cmp -s "$tmp/a.llmc" "$tmp/b.llmc" || { echo "FAIL tool: llm.c round trip"; fail=1; }
head -c 5000 "$tmp/a.llmc" > "$tmp/cut.llmc"
expect 1 "truncated llm.c checkpoint" -- "$tool" train --model gpt --steps 1 --llmc "$tmp/cut.llmc"
grep -qi "truncated\|size" "$tmp/err" || { echo "FAIL tool: llm.c message"; cat "$tmp/err"; fail=1; }

# frozen parameters and LoRA: estimates shrink, a typo is refused, a LoRA run
# samples from its checkpoint, and its merged export loads as a plain model
expect 0 "estimate, frozen" -- "$tool" estimate $E --freeze 'wte,wpe' --freeze 'h.0.*' --json
expect 0 "estimate, LoRA" -- "$tool" estimate $E --lora 8 --lora-targets '*.qkv.w,*.fc.w' --json
# GPT-2 124M: AdamW state for the 663552 adapter parameters alone
grep -q '"OPTIM": 5308416, "ACT"' "$tmp/out" || { echo "FAIL tool: LoRA estimate"; cat "$tmp/out"; fail=1; }
expect 1 "freeze pattern matching nothing" -- "$tool" estimate $E --freeze 'h.99.*'
grep -q "h.99" "$tmp/err" || { echo "FAIL tool: freeze message"; cat "$tmp/err"; fail=1; }
expect 2 "empty freeze pattern" -- "$tool" train --freeze 'wte,,wpe'
expect 2 "--lora-targets without --lora" -- "$tool" train --model gpt --lora-targets '*.fc.w'
expect 2 "LoRA export without merging" -- "$tool" train --model gpt --lora 4 --export-llmc "$tmp/l.llmc"
expect 0 "gpt with LoRA" -- "$tool" train --model gpt --steps 6 --no-report --threads 2 --lora 4 --freeze 'h.0.*' --save "$tmp/l.ckpt"
expect 0 "sample a LoRA run" -- "$tool" sample --model gpt --lora 4 --freeze 'h.0.*' --resume "$tmp/l.ckpt" --length 10
expect 1 "sample a LoRA run without its adapters" -- "$tool" sample --model gpt --resume "$tmp/l.ckpt" --length 10
expect 0 "LoRA merged and exported" -- "$tool" train --model gpt --steps 3 --no-report --threads 2 --lora 4 --merge-lora --export-llmc "$tmp/l.llmc"
grep -q "merged" "$tmp/out" || { echo "FAIL tool: merge message"; cat "$tmp/out"; fail=1; }
expect 0 "the merged export loads" -- "$tool" train --model gpt --steps 0 --no-report --llmc "$tmp/l.llmc"
expect 0 "LoRA adapters saved alone" -- "$tool" train --model gpt --steps 3 --no-report --threads 2 --lora 4 --lora-alpha 8 --save-lora "$tmp/a.lora"
expect 0 "training goes on from them" -- "$tool" train --model gpt --steps 2 --no-report --threads 2 --load-lora "$tmp/a.lora" --save-lora "$tmp/b.lora" --merge-lora --export-llmc "$tmp/m.llmc"
[ -s "$tmp/b.lora" ] && [ -s "$tmp/m.llmc" ] || { echo "FAIL tool: adapter files"; fail=1; }
expect 2 "--load-lora with --lora" -- "$tool" train --model gpt --lora 4 --load-lora "$tmp/a.lora"
expect 2 "--save-lora without adapters" -- "$tool" train --model gpt --save-lora "$tmp/c.lora"
# distillation: the merged model above (2 blocks, width 128) teaches a smaller student
expect 0 "distilled from a teacher" -- "$tool" train --model gpt --steps 3 --no-report --threads 2 --layers 1 --channels 32 --teacher "$tmp/m.llmc" --distill-alpha 0.7 --distill-temp 1.5
expect 0 "estimate with a teacher" -- "$tool" estimate $E --layers 1 --heads 4 --channels 32 --vocab 256 --max-seq 64 --teacher "$tmp/m.llmc" --json
expect 2 "--distill-alpha without --teacher" -- "$tool" train --model gpt --distill-alpha 0.5
# a quantized teacher: its linear weights NF4 as read, so the estimate's PARAM shrinks
expect 0 "distilled from an NF4 teacher" -- "$tool" train --model gpt --steps 3 --no-report --threads 2 --layers 1 --channels 32 --teacher "$tmp/m.llmc" --teacher-base nf4
expect 0 "estimate with the fp32 teacher" -- "$tool" estimate $E --layers 1 --heads 4 --channels 32 --vocab 256 --max-seq 64 --teacher "$tmp/m.llmc" --json
p32=$(grep -o '"class_peak": {"PARAM": [0-9]*' "$tmp/out" | grep -o '[0-9]*$')
expect 0 "estimate with an NF4 teacher" -- "$tool" estimate $E --layers 1 --heads 4 --channels 32 --vocab 256 --max-seq 64 --teacher "$tmp/m.llmc" --teacher-base nf4 --json
pq=$(grep -o '"class_peak": {"PARAM": [0-9]*' "$tmp/out" | grep -o '[0-9]*$')
[ -n "$p32" ] && [ -n "$pq" ] && [ "$pq" -lt "$p32" ] || { echo "FAIL tool: NF4 teacher's PARAM $pq, fp32 $p32"; fail=1; }
expect 2 "--teacher-base without --teacher" -- "$tool" train --model gpt --teacher-base nf4
# disk offload: a short run leaves no scratch; the estimate shows the disk's bytes
mkdir "$tmp/off"
expect 0 "train with disk offload" -- "$tool" train --model gpt --steps 3 --threads 2 --layers 1 --channels 32 --optimizer adamw --precision bf16 --offload disk --offload-dir "$tmp/off"
grep -q "^disk" "$tmp/out" || { echo "FAIL tool: the report has no disk table"; cat "$tmp/out"; fail=1; }
[ -z "$(ls -A "$tmp/off")" ] || { echo "FAIL tool: scratch left in --offload-dir"; ls -la "$tmp/off"; fail=1; }
expect 0 "estimate with disk offload" -- "$tool" estimate $E --layers 1 --heads 4 --channels 32 --offload disk --json
grep -q '"disk_class_peak": {"PARAM": 0, "MASTER": 0, "GRAD": 0, "OPTIM": [1-9]' "$tmp/out" || { echo "FAIL tool: estimate's disk bytes"; cat "$tmp/out"; fail=1; }
expect 0 "estimate table with disk offload" -- "$tool" estimate $E --layers 1 --heads 4 --channels 32 --offload disk
grep -q "disk .* MiB (scratch files)" "$tmp/out" || { echo "FAIL tool: estimate table's disk"; cat "$tmp/out"; fail=1; }
# the weights on disk too: trained and removed; the estimate has PARAM on disk
expect 0 "train with --offload-params" -- "$tool" train --model gpt --steps 2 --threads 2 --layers 1 --channels 32 --optimizer adamw --precision bf16 --offload disk --offload-dir "$tmp/off" --offload-params
awk '/^disk/ {d = 1} d && /^PARAM/ {print; exit}' "$tmp/out" | grep -q "^PARAM  *[1-9][0-9.]* [KM]iB" || { echo "FAIL tool: no PARAM on disk in the report"; cat "$tmp/out"; fail=1; }
[ -z "$(ls -A "$tmp/off")" ] || { echo "FAIL tool: scratch left by --offload-params"; ls -la "$tmp/off"; fail=1; }
expect 0 "estimate with --offload-params" -- "$tool" estimate $E --layers 1 --heads 4 --channels 32 --offload disk --offload-params --json
grep -q '"disk_class_peak": {"PARAM": [1-9][0-9]*, "MASTER": 0, "GRAD": 0, "OPTIM": [1-9]' "$tmp/out" || { echo "FAIL tool: estimate's disk PARAM"; cat "$tmp/out"; fail=1; }
# the library's warnings reach the user: a scratch directory left by a
# process that has ended is removed, and the command says so on stderr
# (and with --json as a {"warning": ...} line)
for j in "" --json; do
    dead=$(sh -c 'echo $$')
    mkdir "$tmp/off/memtrain-scratch"
    echo "memtrain scratch directory of process $dead" > "$tmp/off/memtrain-scratch/lock"
    expect 0 "train over a stale scratch directory $j" -- "$tool" train --model gpt --steps 1 --threads 2 --layers 1 --channels 32 --offload disk --offload-dir "$tmp/off" $j
    grep -q "^memtrain: warning: offload: removed the stale scratch directory '.*memtrain-scratch' (its owner, process $dead on this host, has ended)" "$tmp/err" || { echo "FAIL tool: no warning on stderr $j"; cat "$tmp/err"; fail=1; }
    [ -z "$j" ] || grep -q '^{"warning": "offload: removed the stale scratch directory' "$tmp/out" || { echo "FAIL tool: no JSON warning line"; head -3 "$tmp/out"; fail=1; }
    [ -z "$(ls -A "$tmp/off")" ] || { echo "FAIL tool: stale scratch left"; ls -la "$tmp/off"; fail=1; }
done
expect 2 "--offload-params without --offload disk" -- "$tool" train --model gpt --offload-params
grep -q "needs --offload disk" "$tmp/err" || { echo "FAIL tool: --offload-params message"; cat "$tmp/err"; fail=1; }
expect 2 "--offload disk without a directory" -- "$tool" train --model gpt --offload disk
expect 2 "--offload-dir without --offload disk" -- "$tool" train --model gpt --offload-dir "$tmp/off"
expect 1 "--offload host on the CPU" -- "$tool" train --model gpt --steps 1 --offload host
grep -q "CUDA context" "$tmp/err" || { echo "FAIL tool: --offload host on the CPU message"; cat "$tmp/err"; fail=1; }
expect 0 "estimate with host offload" -- "$tool" estimate $E --device cuda --layers 1 --heads 4 --channels 32 --precision bf16 --offload host --json
grep -q '"host_class_peak": {"PARAM": [1-9][0-9]*, "MASTER": [1-9][0-9]*, "GRAD": [1-9][0-9]*, "OPTIM": [1-9]' "$tmp/out" || { echo "FAIL tool: host offload estimate"; cat "$tmp/out"; fail=1; }
# on one rank of 2 at ZeRO stage 2, the host holds about half the state
host_optim() { sed -n 's/.*"host_class_peak": {[^}]*"OPTIM": \([0-9]*\).*/\1/p' "$tmp/out"; }
one_optim=$(host_optim)
expect 0 "estimate with host offload, rank 1 of 2 at stage 2" -- "$tool" estimate $E --device cuda --layers 1 --heads 4 --channels 32 --precision bf16 --offload host --ranks 2 --rank 1 --zero 2 --json
two_optim=$(host_optim)
[ -n "$one_optim" ] && [ -n "$two_optim" ] && [ "$two_optim" -gt 0 ] && [ $((2 * two_optim)) -le $((one_optim + 4096)) ] || { echo "FAIL tool: host offload's state per rank ($two_optim of $one_optim)"; cat "$tmp/out"; fail=1; }
# and at stage 3: the same state slice on the host, none of it on the device,
# and the device's weights a slice (PARAM at the peak below stage 2's)
dev_param() { sed -n 's/.*"at_peak": {"PARAM": \([0-9]*\).*/\1/p' "$tmp/out"; }
two_param=$(dev_param)
expect 0 "estimate with host offload, rank 1 of 2 at stage 3" -- "$tool" estimate $E --device cuda --layers 1 --heads 4 --channels 32 --precision bf16 --offload host --ranks 2 --rank 1 --zero 3 --json
three_optim=$(host_optim)
three_param=$(dev_param)
grep -q '"class_peak": {[^}]*"MASTER": 0, "GRAD": [0-9]*, "OPTIM": 0,' "$tmp/out" && [ "$three_optim" = "$two_optim" ] && [ -n "$three_param" ] && [ "$three_param" -lt "$two_param" ] || { echo "FAIL tool: host offload at stage 3 ($three_optim, $two_optim; PARAM $three_param, $two_param)"; cat "$tmp/out"; fail=1; }
expect 1 "--zero 3 --offload host on the CPU" -- "$tool" train --model gpt --steps 1 --zero 3 --offload host
grep -q "CUDA context" "$tmp/err" || { echo "FAIL tool: --zero 3 --offload host on the CPU message"; cat "$tmp/err"; fail=1; }
# auto-fit may put the state on disk when --offload-dir names a place for it
expect 0 "estimate --autofit --offload-dir" -- "$tool" estimate $E --budget 800 --autofit --fused --offload-dir "$tmp"
grep -q "the optimizer state on disk" "$tmp/out" && grep -q "disk .*MiB (scratch files)" "$tmp/out" || { echo "FAIL tool: autofit offload choice"; cat "$tmp/out"; fail=1; }
expect 0 "estimate --autofit --offload-dir, json" -- "$tool" estimate $E --budget 800 --autofit --fused --offload-dir "$tmp" --json
grep -q '"offload": "disk", "offload_params": false' "$tmp/out" || { echo "FAIL tool: autofit offload json"; cat "$tmp/out"; fail=1; }
# and the weights too when the state on disk is not enough
expect 0 "estimate --autofit, the weights on disk" -- "$tool" estimate $E --budget 700 --autofit --fused --batch 4 --seq 256 --offload-dir "$tmp"
grep -q "the optimizer state and the weights on disk" "$tmp/out" || { echo "FAIL tool: autofit offload-params choice"; cat "$tmp/out"; fail=1; }
expect 0 "estimate --autofit, the weights on disk, json" -- "$tool" estimate $E --budget 700 --autofit --fused --batch 4 --seq 256 --offload-dir "$tmp" --json
grep -q '"offload": "disk", "offload_params": true' "$tmp/out" || { echo "FAIL tool: autofit offload-params json"; cat "$tmp/out"; fail=1; }
expect 2 "estimate --offload-dir without --autofit" -- "$tool" estimate $E --offload-dir "$tmp"
expect 1 "--offload-dir that is not a directory" -- "$tool" train --model gpt --steps 1 --offload disk --offload-dir "$tmp/nope"
grep -q "nope" "$tmp/err" || { echo "FAIL tool: offload dir message"; cat "$tmp/err"; fail=1; }
# every number's range is checked at the command line, the message giving it
range_case() { # range_case COMMAND OPTION VALUE MESSAGE
    expect 2 "$2 $3" -- "$tool" $1 --model gpt --teacher "$tmp/m.llmc" $2 $3
    grep -qF "memtrain: bad $2 '$3': $4" "$tmp/err" || { echo "FAIL tool: $2 $3 message"; cat "$tmp/err"; fail=1; }
}
range_case train --distill-alpha 1.5 "a number in [0, 1]"
range_case train --distill-temp 0 "a number > 0"
range_case estimate --distill-temp -1 "a number > 0"
range_case train --lora 100000 "an integer from 0 to 4096"
range_case train --momentum 1 "a number in [0, 1)"
range_case train --clip -1 "a number >= 0"
range_case estimate --clip -1 "a number >= 0"
range_case train --zero 4 "an integer from 0 to 3"
expect 1 "a teacher of another vocabulary" -- "$tool" estimate $E --layers 1 --heads 4 --channels 32 --teacher "$tmp/m.llmc"
grep -q "vocabulary" "$tmp/err" || { echo "FAIL tool: teacher vocabulary message"; cat "$tmp/err"; fail=1; }
head -c 100 "$tmp/a.lora" > "$tmp/cut.lora"
expect 1 "a truncated adapter file" -- "$tool" train --model gpt --steps 1 --load-lora "$tmp/cut.lora"
grep -q "truncated" "$tmp/err" || { echo "FAIL tool: adapter file message"; cat "$tmp/err"; fail=1; }

# a quantized frozen base: the estimate's PARAM shrinks, a run resumes only
# with its base, its merged export loads, and bad settings are refused
expect 0 "estimate, LoRA on an NF4 base" -- "$tool" estimate $E --lora 8 --lora-targets '*.qkv.w,*.fc.w' --base nf4 --json
# GPT-2 124M: 85M linear weights and the token table in NF4 (204634816 with
# the table fp32: 154533888 bytes of it become 19929820), the positions,
# LayerNorms and biases fp32
grep -q '"at_peak": {"PARAM": 70030748,' "$tmp/out" || { echo "FAIL tool: NF4 estimate"; cat "$tmp/out"; fail=1; }
expect 0 "gpt with LoRA on an int8 base" -- "$tool" train --model gpt --steps 4 --no-report --threads 2 --lora 4 --base int8 --save "$tmp/q.ckpt"
expect 0 "sample it with its base" -- "$tool" sample --model gpt --lora 4 --base int8 --resume "$tmp/q.ckpt" --length 10
expect 1 "sample it without its base" -- "$tool" sample --model gpt --lora 4 --resume "$tmp/q.ckpt" --length 10
grep -q "weights' storage" "$tmp/err" || { echo "FAIL tool: base message"; cat "$tmp/err"; fail=1; }
expect 0 "NF4 base merged and exported" -- "$tool" train --model gpt --steps 3 --no-report --threads 2 --lora 4 --base nf4 --merge-lora --export-llmc "$tmp/q.llmc"
expect 0 "the merged export loads" -- "$tool" train --model gpt --steps 0 --no-report --llmc "$tmp/q.llmc"
expect 0 "it loads as an NF4 base" -- "$tool" train --model gpt --steps 2 --no-report --threads 2 --llmc "$tmp/q.llmc" --lora 2 --base nf4
expect 0 "mlp with frozen int8 weights" -- "$tool" train --steps 5 --no-report --freeze 'fc0.w' --base int8
expect 2 "--base of an unknown format" -- "$tool" train --model gpt --lora 4 --base q3
grep -q "full, int8, nf4" "$tmp/err" || { echo "FAIL tool: --base values"; cat "$tmp/err"; fail=1; }
expect 2 "--base without frozen weights" -- "$tool" estimate $E --base nf4
expect 2 "--base with fp16" -- "$tool" train --model gpt --lora 4 --base int8 --precision fp16
expect 1 "--base freezing no linear weight" -- "$tool" train --model gpt --steps 1 --freeze '*.b' --base nf4
grep -q "none is frozen" "$tmp/err" || { echo "FAIL tool: --base frozen message"; cat "$tmp/err"; fail=1; }

# estimate takes train's options that change memory, with train's
# defaults: its peak is the run's, to the byte, for the same flags (the
# run's largest peak of live bytes over its steps)
head -c 20000 README.md > "$tmp/text.txt"
same_peak() { # same_peak FLAGS...
    e=$("$tool" estimate "$@" --threads 2 --json 2>"$tmp/err" | sed -n 's/.*"peak": \([0-9]*\).*/\1/p')
    r=$("$tool" train "$@" --threads 2 --steps 2 --json 2>>"$tmp/err" | sed -n 's/.*"peak_bytes": \([0-9]*\).*/\1/p' | sort -n | tail -n 1)
    [ -n "$e" ] && [ "$e" = "$r" ] || { echo "FAIL tool: estimate $e, run $r: $*"; cat "$tmp/err"; fail=1; }
}
same_peak
same_peak --optimizer adamw --activation gelu
same_peak --momentum 0 --clip 1
same_peak --model gpt
same_peak --model gpt --clip 0
same_peak --model gpt --fused
same_peak --model gpt --fused --clip 0
same_peak --model gpt --precision bf16 --fused
same_peak --model gpt --precision fp16 --micro 2
same_peak --model gpt --optimizer adamw8 --recompute sqrt
same_peak --model gpt --precision bf16 --no-master --optimizer adamw8 --fused --recompute sqrt
same_peak --model gpt --optimizer adafactor --recompute selective --batch 4
same_peak --model gpt --lora 4 --base nf4 --precision bf16
same_peak --model gpt --freeze 'h.0.*' --base int8
same_peak --model gpt --layers 1 --channels 32 --teacher "$tmp/m.llmc" --teacher-base nf4
same_peak --model gpt --llmc "$tmp/m.llmc" --seq 32
same_peak --model gpt --data "$tmp/text.txt" --seq 32 --layers 3
same_peak --model gpt --prune magnitude --sparsity 0.9
same_peak --model gpt --prune magnitude --nm 2:4 --precision bf16
same_peak --prune magnitude --prune-scope tensor --optimizer adamw
same_peak --model gpt --prune magnitude --sparsity 0.95 --precision bf16
same_peak --model gpt --prune magnitude --sparsity 0.5 --sparse-kernel sparse

# pruning: bad values are usage errors; the JSON lines say the sparsity
expect 2 "--sparsity 1" -- "$tool" train --model gpt --steps 1 --prune magnitude --sparsity 1
expect 2 "--nm 4:4" -- "$tool" train --model gpt --steps 1 --prune magnitude --nm 4:4
expect 2 "--nm M not dividing a row" -- "$tool" train --steps 1 --prune magnitude --nm 2:4
expect 2 "--sparsity without --prune" -- "$tool" estimate --sparsity 0.5
expect 2 "--prune-targets matching an embedding" -- "$tool" train --model gpt --steps 1 --prune wanda --prune-targets wte
expect 2 "--sparse-kernel foo" -- "$tool" train --model gpt --steps 1 --prune magnitude --sparse-kernel foo
expect 2 "--sparse-kernel sparse with --regrow" -- "$tool" train --model gpt --steps 1 --prune magnitude --sparsity 0.9 --regrow rigl --sparse-kernel sparse
expect 2 "--regrow with --nm" -- "$tool" train --model gpt --steps 1 --prune magnitude --nm 2:4 --regrow rigl
expect 0 "gradual pruning with RigL" -- "$tool" train --model gpt --steps 12 --json --prune magnitude --sparsity 0.8 --prune-schedule gradual --prune-start 2 --prune-end 6 --prune-every 2 --regrow rigl --regrow-every 4
if ! grep -q '"step": 12,.*"sparsity": 0.8' "$tmp/out"; then
    echo "FAIL tool: the last step's sparsity is not 0.8"; tail -n 2 "$tmp/out"; fail=1
fi
expect 0 "Wanda after 3 steps" -- "$tool" train --model gpt --steps 5 --json --prune wanda --prune-at 3 --calib 2
if ! grep -q '"step": 3,.*"sparsity": 0.000000' "$tmp/out" || ! grep -q '"step": 4,.*"sparsity": 0.500000' "$tmp/out"; then
    echo "FAIL tool: Wanda's prune is not after step 3"; cat "$tmp/out"; fail=1
fi

# no run left a temporary file beside what it wrote
if ls "$tmp" | grep '\.tmp\.'; then echo "FAIL tool: temporary files left"; fail=1; fi

if [ $fail = 0 ]; then echo "ok   tool tests"; fi
exit $fail
