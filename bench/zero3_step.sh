#!/bin/sh
# zero3_step.sh - ZeRO-3's step time against stage 0 on 2 ranks of 1
# thread each, the same global batch, GPT-2 124M (L12 H12 C768, vocabulary
# 50257) on random llm.c tokens made for the run. Each round runs stage 0,
# then every stage-3 line, back to back, so a load that changes between
# rounds cancels out of a round's ratios; a line's ms per step is the
# second half's (after the warm-up half). Prints, per stage-3 line, every
# round's ratio to the round's stage 0 and their median, the ratio of the
# CPU time the whole runs took (user + system of both ranks, setup and
# validation included; /usr/bin/time where it is installed), rank 0's
# communication of the last round, and the load average before and after.
# Usage: BUILD=build ROUNDS=5 STEPS=6 bench/zero3_step.sh [extra memtrain
# train options]. LINES (optional) replaces the stage-3 lines: one per
# line, "name|options" or "name|options|build", the last running that build
# directory's memtrain (an A/B of two builds in the same rounds: make
# BUILD=build-old of the old commit, then "s3old|--zero 3|build-old").
set -u
B=${BUILD:-build} ROUNDS=${ROUNDS:-5} STEPS=${STEPS:-6}
for need in "$B/memtrain" mpirun; do # (make; make deps installs Open MPI)
    command -v "$need" > /dev/null || { echo "zero3_step.sh: $need is missing"; exit 1; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
    OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-cma}"
MPIRUN="mpirun --oversubscribe --bind-to none -np 2"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# 200,000 random tokens below 50257 in an llm.c token file (header of 256
# int32: magic, version, count; then uint16 tokens)
LC_ALL=C awk 'BEGIN { srand(1); n = 200000
    printf "%c%c%c%c", 136, 216, 52, 1               # 20240520, little-endian
    printf "%c%c%c%c", 1, 0, 0, 0
    printf "%c%c%c%c", n % 256, int(n / 256) % 256, int(n / 65536) % 256, 0
    for (i = 3; i < 256; i++) printf "%c%c%c%c", 0, 0, 0, 0
    for (i = 0; i < n; i++) { t = int(rand() * 50257); printf "%c%c", t % 256, int(t / 256) }
}' > "$dir/tokens.bin"
[ "$(wc -c < "$dir/tokens.bin")" = 401024 ] || { echo "zero3_step.sh: could not write the token file"; exit 1; }
ARGS="train --model gpt --data $dir/tokens.bin --layers 12 --heads 12 --channels 768 --seq 64
      --batch 8 --steps $STEPS --every $((STEPS / 2)) --threads 1 --optimizer adamw --eval-every 0
      --schedule constant $*"
# shellcheck disable=SC2086
if [ "$OMPI_MCA_btl_vader_single_copy_mechanism" = cma ] &&
    ! timeout 300 $MPIRUN "$B/memtrain" $ARGS --steps 1 < /dev/null > "$dir/probe" 2>&1; then
    export OMPI_MCA_btl_vader_single_copy_mechanism=none
fi
LINES=${LINES:-"s3|--zero 3
s3p0|--zero 3 --zero3-prefetch 0"}
ms_of() { grep -o '[0-9.]* ms/step' "$1" | tail -n 1 | cut -d' ' -f1; }
# a run's CPU seconds (user + system, its ranks waited for by mpirun), or 0
TIME=; [ -x /usr/bin/time ] && TIME="/usr/bin/time -f %U+%S -o"
timed() { # OUT CPUFILE COMMAND...: runs it, its output to OUT
    out=$1 cpu=$2; shift 2
    if [ -n "$TIME" ]; then $TIME "$cpu" "$@" < /dev/null > "$out" 2>&1
    else echo 0 > "$cpu"; "$@" < /dev/null > "$out" 2>&1; fi
}
cpu_of() { tail -n 1 "$1" | awk -F+ '{ printf "%.1f", $1 + $2 }'; }
load0=$(cut -d' ' -f1-3 /proc/loadavg)
r=1
while [ $r -le "$ROUNDS" ]; do
    # shellcheck disable=SC2086
    timed "$dir/s0.$r" "$dir/s0.cpu.$r" timeout 900 $MPIRUN "$B/memtrain" $ARGS --zero 0 || { cat "$dir/s0.$r"; exit 1; }
    base=$(ms_of "$dir/s0.$r") basecpu=$(cpu_of "$dir/s0.cpu.$r")
    echo "$LINES" | while IFS='|' read -r name opts lb; do
        # shellcheck disable=SC2086
        timed "$dir/$name.$r" "$dir/$name.cpu.$r" timeout 900 $MPIRUN "${lb:-$B}/memtrain" $ARGS $opts || { cat "$dir/$name.$r"; exit 1; }
        ms=$(ms_of "$dir/$name.$r")
        echo "$name $r $base $ms $basecpu $(cpu_of "$dir/$name.cpu.$r")" >> "$dir/rows"
    done || exit 1
    r=$((r + 1))
done
load1=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load average before: $load0; after: $load1"
echo "| line | options | round | stage 0 ms/step | stage 3 ms/step | ratio | stage 0 CPU s | stage 3 CPU s | CPU ratio |"
echo "|---|---|---|---|---|---|---|---|---|"
echo "$LINES" | while IFS='|' read -r name opts lb; do
    awk -v n="$name" -v o="$opts" '$1 == n { printf "| %s | `%s` | %d | %.1f | %.1f | %.2fx | %.1f | %.1f | %.2fx |\n", n, o, $2, $3, $4, $4 / $3, $5, $6, ($5 > 0 ? $6 / $5 : 0) }' "$dir/rows"
done
echo
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) printf "%.2f", v[(NR + 1) / 2]; else printf "%.2f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo "| line | median stage 3 / stage 0 ratio | median CPU-time ratio | rank 0's communication (last round) |"
echo "|---|---|---|---|"
echo "$LINES" | while IFS='|' read -r name opts lb; do
    med=$(awk -v n="$name" '$1 == n { print $4 / $3 }' "$dir/rows" | median)
    cmed=$(awk -v n="$name" '$1 == n && $5 > 0 { print $6 / $5 }' "$dir/rows" | median)
    comm=$(sed -n 's/^communication (rank 0): //p' "$dir/$name.$ROUNDS")
    echo "| $name | ${med}x | ${cmed}x | $comm |"
done
echo "stage 0, last round: $(sed -n 's/^communication (rank 0): //p' "$dir/s0.$ROUNDS")"
