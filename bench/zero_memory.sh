#!/bin/sh
# zero_memory.sh - one rank's bytes per class at GPT-2 124M for ZeRO stages
# 0 to 3 on N = 1, 2 and 4 ranks, beside the ZeRO paper's per-parameter
# formulas in our dtypes. The figures are memtrain estimate's (a dry run of
# rank 0, whose per-class peaks equal a real rank's accounting to the byte:
# the zero_ and zero3_ tests check it), so N = 4 needs no 4 processes.
# Usage: BUILD=build bench/zero_memory.sh [fp32|bf16] [extra memtrain
# estimate options]. Prints a markdown table (docs/benchmarks.md).
set -u
B=${BUILD:-build}
PREC=${1:-fp32}
[ $# -gt 0 ] && shift
[ -x "$B/memtrain" ] || { echo "zero_memory.sh: build $B/memtrain first (make)"; exit 1; }
# GPT-2 124M (estimate takes train's defaults: the shape is given), no clipping
ARGS="--model gpt --layers 12 --heads 12 --channels 768 --vocab 50257 --max-seq 1024 --clip 0 --batch 8 --seq 64 --optimizer adamw --precision $PREC $*"
MIB=1048576
# Each class's own peak (class_peak), but PARAM as held at the step's
# peak (step_at_peak): at stage 3 the model is made whole and sharded at
# create, before the optimizer state exists, so PARAM's own peak is the
# whole weights once, at setup (the setup column), and the step holds slices.
# Our bytes per parameter of the model states (PARAM + MASTER + GRAD +
# OPTIM) at stage S on N ranks: fp32 AdamW 4 + 4 + 8; bf16 with masters
# 2 + 4 + 4 + 8 (the paper's fp16 Adam: 2 + 2 + 12)
formula() { # PREC STAGE N -> "ours | paper" bytes per parameter
    awk -v p="$1" -v s="$2" -v n="$3" 'BEGIN {
        if (p == "fp32") { w = 4; m = 0; g = 4; o = 8 } else { w = 2; m = 4; g = 4; o = 8 }
        pw = 2; pg = 2; po = 12
        if (s >= 1) { m /= n; o /= n; po /= n }
        if (s >= 2) { g /= n; pg /= n }
        if (s >= 3) { w /= n; pw /= n }
        printf "%.2f | %.2f", w + m + g + o, pw + pg + po }'
}
field() { # JSON OBJECT KEY -> the number after "KEY": in that object
    sed "s/.*\"$1\": {\([^}]*\)}.*/\1/" | tr ',' '\n' | sed -n "s/.*\"$2\": \([0-9]*\).*/\1/p"
}
echo "| N | stage | PARAM | MASTER | GRAD | OPTIM | COMM | ACT + WORK + IO at the step's peak | step peak | setup peak | model states / P | ours, formula | paper (fp16 Adam) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for n in 1 2 4; do
    for s in 0 1 2 3; do
        [ "$n" = 1 ] && [ "$s" != 0 ] && continue
        # shellcheck disable=SC2086
        j=$("$B/memtrain" estimate $ARGS --ranks "$n" --zero "$s" --json) || { echo "$j"; exit 1; }
        P=$(echo "$j" | sed -n 's/.*"params": \([0-9]*\).*/\1/p')
        peak=$(echo "$j" | sed -n 's/.*"step_peak": \([0-9]*\),.*/\1/p')
        setup=$(echo "$j" | sed -n 's/.*"setup_peak": \([0-9]*\),.*/\1/p')
        row="| $n | $s"
        states=0
        for c in PARAM MASTER GRAD OPTIM COMM; do
            if [ "$c" = PARAM ]; then v=$(echo "$j" | field step_at_peak "$c"); else v=$(echo "$j" | field class_peak "$c"); fi
            row="$row | $(awk -v v="$v" -v m=$MIB 'BEGIN { printf "%.1f", v / m }')"
            [ "$c" != COMM ] && states=$((states + v))
        done
        rest=0
        for c in ACT WORK IO; do rest=$((rest + $(echo "$j" | field step_at_peak "$c"))); done
        row="$row | $(awk -v v="$rest" -v m=$MIB 'BEGIN { printf "%.1f", v / m }')"
        row="$row | $(awk -v v="$peak" -v m=$MIB 'BEGIN { printf "%.1f", v / m }')"
        row="$row | $(awk -v v="$setup" -v m=$MIB 'BEGIN { printf "%.1f", v / m }')"
        row="$row | $(awk -v v="$states" -v p="$P" 'BEGIN { printf "%.2f", v / p }')"
        echo "$row | $(formula "$PREC" "$s" "$n") |"
    done
done
