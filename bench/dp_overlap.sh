#!/bin/sh
# dp_overlap.sh - data parallel on this machine's cores: one process of 2
# threads against 2 ranks of 1 thread (memtrain train under mpirun) at the
# same global batch, the gradients' all-reduce on a communication thread
# during backward (--overlap) and after backward (the default): ms per
# step, and rank 0's communication (total and exposed, the time the step
# waited for it). Usage: BUILD=build STEPS=20 bench/dp_overlap.sh [extra
# memtrain train options]. Prints a markdown table (docs/benchmarks.md).
set -u
B=${BUILD:-build}
STEPS=${STEPS:-20}
HALF=$((STEPS / 2))
[ -x "$B/memtrain" ] || { echo "dp_overlap.sh: build $B/memtrain first (make)"; exit 1; }
command -v mpirun > /dev/null || { echo "dp_overlap.sh: no mpirun (make deps installs Open MPI)"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN="mpirun --oversubscribe --bind-to none"
ARGS="train --model gpt --layers 4 --heads 4 --channels 256 --seq 128 --batch 8 --optimizer adamw
      --steps $STEPS --every $HALF --eval-every 0 --schedule constant $*"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# ms/step of the second half (the line after the warm-up half), and the
# communication line: collectives, seconds, exposed seconds
row() {
    ms=$(grep -o '[0-9.]* ms/step' "$out" | tail -n 1 | cut -d' ' -f1)
    comm=$(sed -n 's/^communication (rank 0): \([0-9]*\) collectives, \([0-9.]*\) s, \([0-9.]*\) s of it exposed (\([0-9]*\)%)$/\1 | \2 | \3 | \4%/p' "$out")
    echo "| $1 | ${ms:-?} | ${comm:-- | - | - | -} |"
}
echo "| run | ms/step | collectives (rank 0) | communication s | exposed s | exposed / communication |"
echo "|---|---|---|---|---|---|"
# shellcheck disable=SC2086
"$B/memtrain" $ARGS --threads 2 > "$out" 2>&1 || { cat "$out"; exit 1; }
row "1 rank x 2 threads"
# shellcheck disable=SC2086
timeout 600 $MPIRUN -np 2 "$B/memtrain" $ARGS --threads 1 --overlap > "$out" 2>&1 || { cat "$out"; exit 1; }
row "2 ranks x 1 thread, overlap"
# shellcheck disable=SC2086
timeout 600 $MPIRUN -np 2 "$B/memtrain" $ARGS --threads 1 > "$out" 2>&1 || { cat "$out"; exit 1; }
row "2 ranks x 1 thread, after backward"
