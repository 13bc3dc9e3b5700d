#!/bin/sh
# dp_overlap.sh - data parallel on this machine's cores: one process of 2
# threads against 2 ranks of 1 thread (memtrain train under mpirun) at the
# same global batch: ZeRO stages 0 to 3, and stages 0 to 2 with the
# gradients' all-reduce (reduce-scatter) on a communication thread during
# backward (--overlap) rather than after it. Each round runs every line back to
# back; a line's ratio is its ms per step over the one process's in the
# same round, so a load that changes between rounds cancels out. Prints,
# per line, the median over the rounds of ms per step and of the ratio,
# and rank 0's communication (total and exposed, the time the steps waited
# for it) of the median round; then every round's ms per step.
# Usage: BUILD=build STEPS=20 ROUNDS=3 bench/dp_overlap.sh [extra memtrain
# train options]. Prints markdown tables (docs/benchmarks.md). With TP=1,
# tensor parallel instead: 2 ranks of 1 thread in one tensor group (--tp 2,
# with and without --sp) against the same one process (make bench-tp). With
# PP=1, pipeline parallel: 2 stages of 1 thread each (--pp 2) against one
# process of 2 threads, both in micro-batches of 1 and 2 rows (8 and 4
# micro-batches), with the bubble: the time rank 0 (stage 0) waited for the
# other stage per step, against the 1F1B schedule's (P-1)/(M+P-1) (make
# bench-pp).
set -u
B=${BUILD:-build}
STEPS=${STEPS:-20}
ROUNDS=${ROUNDS:-3}
HALF=$((STEPS / 2))
[ -x "$B/memtrain" ] || { echo "dp_overlap.sh: build $B/memtrain first (make)"; exit 1; }
command -v mpirun > /dev/null || { echo "dp_overlap.sh: no mpirun (make deps installs Open MPI)"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Open MPI's default single copy (CMA) where this machine allows it, else
# copies through the shared-memory queues (containers without ptrace)
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-cma}"
MPIRUN="mpirun --oversubscribe --bind-to none"
ARGS="train --model gpt --layers 4 --heads 4 --channels 256 --seq 128 --batch 8 --optimizer adamw
      --steps $STEPS --every $HALF --eval-every 0 --schedule constant $*"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# shellcheck disable=SC2086
if [ "$OMPI_MCA_btl_vader_single_copy_mechanism" = cma ] &&
    ! timeout 120 $MPIRUN -np 2 "$B/memtrain" $ARGS --steps 1 --threads 1 < /dev/null > "$dir/probe" 2>&1; then
    export OMPI_MCA_btl_vader_single_copy_mechanism=none
fi

# the lines: name, then the command's memtrain options (2 ranks when --zero
# or --tp is there)
if [ "${PP:-0}" = 1 ]; then LINES="base8|--threads 2 --micro 1
pp8|--threads 1 --pp 2 --micro 1
base4|--threads 2 --micro 2
pp4|--threads 1 --pp 2 --micro 2"
elif [ "${TP:-0}" = 1 ]; then LINES="base|--threads 2
tp|--threads 1 --tp 2
tpsp|--threads 1 --tp 2 --sp"
else LINES="base|--threads 2
s0|--threads 1 --zero 0
s0o|--threads 1 --zero 0 --overlap
s1|--threads 1 --zero 1
s1o|--threads 1 --zero 1 --overlap
s2|--threads 1 --zero 2
s2o|--threads 1 --zero 2 --overlap
s3|--threads 1 --zero 3"
fi
label() {
    case $1 in
    base) echo "1 rank x 2 threads" ;;
    base8) echo "1 rank x 2 threads, 8 micro-batches" ;;
    base4) echo "1 rank x 2 threads, 4 micro-batches" ;;
    pp8) echo "2 ranks x 1 thread, 2 pipeline stages (--pp 2), 8 micro-batches" ;;
    pp4) echo "2 ranks x 1 thread, 2 pipeline stages (--pp 2), 4 micro-batches" ;;
    s0) echo "2 ranks x 1 thread, stage 0, all-reduce after backward" ;;
    s0o) echo "2 ranks x 1 thread, stage 0, all-reduce during backward (--overlap)" ;;
    s1) echo "2 ranks x 1 thread, stage 1" ;;
    s1o) echo "2 ranks x 1 thread, stage 1, reduce-scatter during backward (--overlap)" ;;
    s2) echo "2 ranks x 1 thread, stage 2" ;;
    s2o) echo "2 ranks x 1 thread, stage 2, reduce-scatter during backward (--overlap)" ;;
    s3) echo "2 ranks x 1 thread, stage 3" ;;
    tp) echo "2 ranks x 1 thread, one tensor group (--tp 2)" ;;
    tpsp) echo "2 ranks x 1 thread, one tensor group, sequence parallel (--tp 2 --sp)" ;;
    esac
}

# ms/step of the second half (the line after the warm-up half); the
# communication line: collectives | seconds | exposed seconds | exposed %
ms_of() { grep -o '[0-9.]* ms/step' "$1" | tail -n 1 | cut -d' ' -f1; }
comm_of() {
    sed -n 's/^communication (rank 0): \([0-9]*\) collectives, \([0-9.]*\) s, \([0-9.]*\) s of it exposed (\([0-9]*\)%)$/\1 | \2 | \3 | \4%/p' "$1"
}

load0=$(cut -d' ' -f1-3 /proc/loadavg)
r=1
while [ $r -le "$ROUNDS" ]; do
    echo "$LINES" | while IFS='|' read -r name opts; do
        f="$dir/$name.$r"
        case $opts in
        *--zero* | *--tp* | *--pp*) cmd="timeout 600 $MPIRUN -np 2 $B/memtrain" ;;
        *) cmd="$B/memtrain" ;;
        esac
        # shellcheck disable=SC2086
        $cmd $ARGS $opts < /dev/null > "$f" 2>&1 || { cat "$f"; exit 1; }
        ms_of "$f" > "$f.ms"
    done || exit 1
    r=$((r + 1))
done
load1=$(cut -d' ' -f1-3 /proc/loadavg)

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.4g\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo "| run | ms/step | / 1 rank x 2 threads | collectives (rank 0) | communication s | exposed s | exposed / communication |"
echo "|---|---|---|---|---|---|---|"
echo "$LINES" | while IFS='|' read -r name opts; do
    ms=$(for r in $(seq "$ROUNDS"); do cat "$dir/$name.$r.ms"; done | median)
    ref=base
    case $name in pp*) ref=base${name#pp} ;; base?) ref=$name ;; esac
    ratio=$(for r in $(seq "$ROUNDS"); do
        awk -v a="$(cat "$dir/$name.$r.ms")" -v b="$(cat "$dir/$ref.$r.ms")" 'BEGIN { printf "%.3f\n", a / b }'
    done | median)
    # the communication of the round whose ms/step is nearest the median
    near=$(for r in $(seq "$ROUNDS"); do
        awk -v r="$r" -v a="$(cat "$dir/$name.$r.ms")" -v m="$ms" 'BEGIN { d = a - m; print (d < 0 ? -d : d), r }'
    done | sort -g | head -n 1 | cut -d' ' -f2)
    comm=$(comm_of "$dir/$name.$near")
    [ "$name" = "$ref" ] && ratio=1
    echo "| $(label "$name") | $ms | ${ratio}x | ${comm:-- | - | - | -} |"
    # the bubble: stage 0's waiting per step (its exposed communication over the
    # steps, the exchanges' transfers included) over the step
    case $name in pp*)
        M=${name#pp}
        exp=$(echo "$comm" | cut -d'|' -f3)
        awk -v e="$exp" -v ms="$ms" -v n="$STEPS" -v m="$M" 'BEGIN {
            printf "%s\n", sprintf("bubble at %d micro-batches: stage 0 waited %.1f%% of its steps; 1F1B'"'"'s (P-1)/(M+P-1) = %.1f%%", m, 100 * e / (n * ms / 1000), 100 / (m + 1)) }' >> "$dir/bubbles" ;;
    esac
done
[ -f "$dir/bubbles" ] && { echo; sed 's/^/- /' "$dir/bubbles"; }
echo
printf "| run |"; for r in $(seq "$ROUNDS"); do printf " round %s ms/step |" "$r"; done; echo
printf "|---|"; for r in $(seq "$ROUNDS"); do printf -- "---|"; done; echo
echo "$LINES" | while IFS='|' read -r name opts; do
    printf "| %s |" "$(label "$name")"
    for r in $(seq "$ROUNDS"); do printf " %s |" "$(cat "$dir/$name.$r.ms")"; done
    echo
done
echo
echo "$STEPS steps, ms/step of the last $HALF; single copy: $OMPI_MCA_btl_vader_single_copy_mechanism; load average before: $load0, after: $load1; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs"
