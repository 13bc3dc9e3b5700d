#!/bin/sh
# The MPI tests: each starts its own ranks with mpirun, a few seconds each.
# Usage: test/mpi_test.sh BUILD_DIR
set -u
B=${1:-build}
if [ ! -x "$B/mpi/comm_mpi_test" ]; then
    echo "skip MPI tests: no mpicc when the library was built (apt-get install libopenmpi-dev openmpi-bin)"
    exit 0
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN="mpirun --oversubscribe --bind-to none"
fail=0
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# run NAME NP EXPECT_OK ARGS...: passes when rank 0 printed "ok NAME", within 60 s
run() {
    name=$1 np=$2; shift 2
    timeout 60 $MPIRUN -np "$np" "$@" >"$out" 2>&1
    rc=$?
    if [ $rc = 124 ]; then echo "FAIL mpi $name (np $np): hung"; cat "$out"; fail=1; return; fi
    if grep -q "^ok $name" "$out"; then echo "ok   mpi $(grep "^ok $name" "$out" | head -1 | cut -c4-) (np $np)"
    else echo "FAIL mpi $name (np $np), exit $rc:"; cat "$out"; fail=1; fi
}

run collectives 2 "$B/mpi/comm_mpi_test" collectives
run collectives 3 "$B/mpi/comm_mpi_test" collectives
run stall 2 "$B/mpi/comm_mpi_test" stall
run p2p 2 "$B/mpi/comm_mpi_test" p2p
run p2p 3 "$B/mpi/comm_mpi_test" p2p
run p2pstall 2 "$B/mpi/comm_mpi_test" p2pstall
run split 3 "$B/mpi/comm_mpi_test" split
run split 4 "$B/mpi/comm_mpi_test" split
run splitstall 2 "$B/mpi/comm_mpi_test" splitstall

run train 2 "$B/mpi/train_mpi_test" train
run train 3 "$B/mpi/train_mpi_test" train
run local 2 "$B/mpi/train_mpi_test" local
run local 3 "$B/mpi/train_mpi_test" local
run offload 2 "$B/mpi/train_mpi_test" offload
run offload 3 "$B/mpi/train_mpi_test" offload
run disagree 2 "$B/mpi/train_mpi_test" disagree
run stall 2 "$B/mpi/train_mpi_test" stall
# ZeRO stages 0-2 with bf16, fp16 (loss scaling) and other optimizers
run tp 2 "$B/mpi/train_mpi_test" tp
run tp 3 "$B/mpi/train_mpi_test" tp
run tp 4 "$B/mpi/train_mpi_test" tp
run zero 2 "$B/mpi/train_mpi_test" zero
run zero 3 "$B/mpi/train_mpi_test" zero
# stages 0 to 2 with the gradients' collectives on a thread during backward
run overlap 2 "$B/mpi/train_mpi_test" overlap
run overlap 3 "$B/mpi/train_mpi_test" overlap
# ZeRO-3's gathers on a thread ahead of the layers: stage 2's bits
run zero3 2 "$B/mpi/train_mpi_test" zero3
run zero3 3 "$B/mpi/train_mpi_test" zero3
# a failure of rank 1 alone on its communication thread: named at once
run threadfail 2 "$B/mpi/train_mpi_test" threadfail
run threadfail 3 "$B/mpi/train_mpi_test" threadfail
run overflow 2 "$B/mpi/train_mpi_test" overflow
run overflow 3 "$B/mpi/train_mpi_test" overflow
run alone 2 "$B/mpi/train_mpi_test" alone
run alone 3 "$B/mpi/train_mpi_test" alone
# a rank killed: mpirun (Open MPI 4's ORTE) is told not to end the job when
# a rank dies, so rank 0 must find it out itself, from its deadline
MPIRUN="mpirun --oversubscribe --bind-to none --mca orte_abort_on_non_zero_status 0"
run kill 2 "$B/mpi/train_mpi_test" kill
run killmid 2 "$B/mpi/train_mpi_test" killmid
run killover 2 "$B/mpi/train_mpi_test" killover
run killover2 2 "$B/mpi/train_mpi_test" killover2
run killoverf 2 "$B/mpi/train_mpi_test" killoverf
run killmid3 2 "$B/mpi/train_mpi_test" killmid3
MPIRUN="mpirun --oversubscribe --bind-to none"

# memtrain train under mpirun: rank 0 prints one JSON object per step, with
# the losses of one process stepping on the same global batches
losses() { grep '^{' | sed 's/.*"loss": \([-0-9.e]*\).*/\1/' | tr '\n' ' '; }
tool() { # NP BATCH MICRO [ZERO]: 2 or 3 ranks (at a ZeRO stage) against one process
    np=$1 batch=$2 micro=$3 zero=${4:-0}
    args="train --model gpt --steps 4 --batch $batch --seq 16 --layers 1 --channels 32 --heads 2 --threads 1 --json"
    one=$("$B/memtrain" $args --micro "$micro" 2>&1 | losses)
    many=$(timeout 60 $MPIRUN -np "$np" "$B/memtrain" $args ${OVERLAP:-} --zero "$zero" 2>&1 | losses)
    if [ -n "$one" ] && awk -v a="$one" -v b="$many" 'BEGIN { n = split(a, x); m = split(b, y);
        if (n != m || n != 4) exit 1; for (i = 1; i <= n; i++) if (x[i] - y[i] > 1e-5 || y[i] - x[i] > 1e-5) exit 1 }'
    then echo "ok   mpi memtrain train: $np ranks, --batch $batch ${OVERLAP:-} --zero $zero: losses $many equal one process's"
    else echo "FAIL mpi memtrain train: $np ranks, --batch $batch, --zero $zero: losses '$many', one process '$one'"; fail=1; fi
}
# a training-state file saved by 2 ranks at ZeRO stage 2, resumed by one
# process and by 3 ranks at stage 1: the same next losses
reshard() {
    ck=$(mktemp)
    args="train --model gpt --batch 6 --seq 16 --layers 1 --channels 32 --heads 2 --threads 1 --json --optimizer adamw8"
    timeout 60 $MPIRUN -np 2 "$B/memtrain" $args --steps 2 --zero "${ZSAVE:-2}" --save "$ck" >/dev/null 2>&1
    one=$("$B/memtrain" $args --steps 4 --resume "$ck" 2>&1 | losses)
    three=$(timeout 60 $MPIRUN -np "${NLOAD:-3}" "$B/memtrain" $args --steps 4 --zero "${ZLOAD:-1}" --resume "$ck" 2>&1 | losses)
    rm -f "$ck"
    if [ -n "$one" ] && awk -v a="$one" -v b="$three" 'BEGIN { n = split(a, x); m = split(b, y);
        if (n != m || n != 2) exit 1; for (i = 1; i <= n; i++) if (x[i] - y[i] > 1e-5 || y[i] - x[i] > 1e-5) exit 1 }'
    then echo "ok   mpi memtrain train: saved by 2 ranks at --zero ${ZSAVE:-2}, resumed by 1 and by ${NLOAD:-3} at --zero ${ZLOAD:-1}: losses $three"
    else echo "FAIL mpi memtrain train: resharding from --zero ${ZSAVE:-2}: one process '$one', ${NLOAD:-3} ranks '$three'"; fail=1; fi
}
# 2 ranks at ZeRO stage 2 stopped after 2 steps and resumed from their
# training-state file: the same losses as the run that did not stop (the
# data order goes on where it was), to the last digit printed
resume() {
    ck=$(mktemp)
    args="train --model gpt --batch 4 --seq 16 --layers 1 --channels 32 --heads 2 --threads 1 --json --zero 2"
    whole=$(timeout 60 $MPIRUN -np 2 "$B/memtrain" $args --steps 4 2>&1 | losses)
    timeout 60 $MPIRUN -np 2 "$B/memtrain" $args --steps 2 --save "$ck" >/dev/null 2>&1
    again=$(timeout 60 $MPIRUN -np 2 "$B/memtrain" $args --steps 4 --resume "$ck" 2>&1 | losses)
    rm -f "$ck"
    tail2=$(echo "$whole" | awk '{ print $3, $4 }')
    if [ -n "$again" ] && [ "$(echo $again)" = "$tail2" ]; then
        echo "ok   mpi memtrain train: 2 ranks at --zero 2 resumed after 2 steps: losses $again as without the stop"
    else echo "FAIL mpi memtrain train: resumed at --zero 2: '$again', the whole run's last two '$tail2'"; fail=1; fi
}
if [ -x "$B/memtrain" ]; then
    tool 2 4 2
    tool 3 4 0   # uneven: 1, 1 and 2 rows
    OVERLAP=--overlap tool 2 4 2 # the gradients summed on a thread during backward
    OVERLAP=--overlap tool 2 4 2 1 # stage 1: reduce-scattered on the thread
    OVERLAP=--overlap tool 3 6 2 1
    OVERLAP=--overlap tool 2 4 2 2 # stage 2: reduce-scattered on the thread in backward
    OVERLAP="--overlap --fused" tool 2 4 4 # the fused step's all-reduces on the thread
    OVERLAP="--overlap --fused" tool 3 6 6 2
    # local SGD averaging every step: plain SGD, no clipping, equal rows is
    # the data-parallel step (within rounding); the loss shown is the global batch's
    args="train --model gpt --steps 4 --batch 4 --seq 16 --layers 1 --channels 32 --heads 2 --threads 1 --json --optimizer sgd --momentum 0 --clip 0"
    one=$("$B/memtrain" $args --micro 2 2>&1 | losses)
    many=$(timeout 60 $MPIRUN -np 2 "$B/memtrain" $args --local-sgd 1 2>&1 | losses)
    if [ -n "$one" ] && awk -v a="$one" -v b="$many" 'BEGIN { n = split(a, x); m = split(b, y);
        if (n != m || n != 4) exit 1; for (i = 1; i <= n; i++) if (x[i] - y[i] > 1e-5 || y[i] - x[i] > 1e-5) exit 1 }'
    then echo "ok   mpi memtrain train --local-sgd 1: 2 ranks, losses $many equal one process's"
    else echo "FAIL mpi memtrain train --local-sgd 1: losses '$many', one process '$one'"; fail=1; fi
    tool 2 4 2 1
    tool 2 4 2 2
    tool 3 6 2 1
    tool 3 6 2 2
    tool 2 4 2 3 # ZeRO-3: the weights sharded, gathered per layer
    tool 3 6 2 3
    OVERLAP="--zero3-prefetch 0" tool 2 4 2 3 # the gathers when each layer starts
    OVERLAP="--zero3-prefetch 2 --zero3-keep -1" tool 3 6 2 3 # deeper, every layer kept
    reshard
    resume
    ZSAVE=3 ZLOAD=3 reshard # saved at stage 3, resumed by one process and by 3 ranks at stage 3
    # without --json rank 0 prints the report, ending with every rank's peak
    # and its communication
    rep=$(timeout 60 $MPIRUN -np 2 "$B/memtrain" train --model gpt --steps 1 --batch 2 --seq 16 --layers 1 --channels 32 --heads 2 --threads 1 2>/dev/null)
    if [ "$(echo "$rep" | grep -c 'memory report')" = 1 ] && echo "$rep" | tail -n 2 | head -n 1 | grep -q '^2 ranks, peak live MiB per rank: [0-9.]* [0-9.]*$' &&
        echo "$rep" | tail -n 1 | grep -q '^communication (rank 0): '
    then echo "ok   mpi memtrain train: the report ends with every rank's peak and rank 0's communication"
    else echo "FAIL mpi memtrain train: the report's end"; echo "$rep" | tail -n 5; fail=1; fi
    # SIGTERM to the ranks (as mpirun passes it on): every rank stops after the
    # same step, rank 0 saves and alone says so, and the ranks exit with 143
    # (under SAN=1 LeakSanitizer would report Open MPI's own allocations at
    # exit and change the status checked here)
    sd=$(mktemp -d)
    ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 timeout 60 $MPIRUN -np 2 "$B/memtrain" train --model gpt --steps 100000 --batch 2 --seq 16 \
        --layers 1 --channels 32 --heads 2 --threads 1 --json --zero 3 --offload disk \
        --offload-dir "$sd" --save "$sd/stop.ckpt" >"$sd/out" 2>"$sd/err" &
    mp=$!
    n=0
    while [ "$(cat "$sd/out" 2>/dev/null | grep -c '"step"')" -lt 2 ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
    for c in $(pgrep -P "$mp"); do for p in $(pgrep -P "$c"); do kill -TERM "$p"; done; done # (timeout, mpirun, the ranks)
    wait "$mp"
    rc=$?
    if [ $rc = 143 ] && [ "$(grep -c 'stopped (SIGTERM)' "$sd/err")" = 1 ] && [ -s "$sd/stop.ckpt" ] &&
        [ "$(ls "$sd")" = "err
out
stop.ckpt" ]
    then echo "ok   mpi memtrain train: SIGTERM stops every rank, rank 0 saves and says so once, exit 143, the scratch removed"
    else echo "FAIL mpi memtrain train: SIGTERM: exit $rc"; cat "$sd/err"; ls "$sd"; fail=1; fi
    rm -rf "$sd"
    # ranks whose options differ: refused before anything runs (exit 2), rank 0
    # naming the option and each rank's value; the library names what only
    # the files show (the teacher's weights, a training-state file)
    refused() { # WANT_RC PATTERN WHAT, then the mpirun arguments
        want=$1 pat=$2 what=$3; shift 3
        # (under SAN=1 LeakSanitizer would report Open MPI's own allocations
        # at exit and change the status checked here)
        got=$(ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 timeout 60 $MPIRUN "$@" 2>&1)
        rc=$?
        if [ $rc = "$want" ] && [ "$(echo "$got" | grep -cF -- "$pat")" -ge 1 ] &&
            { [ "$want" != 2 ] || [ "$(echo "$got" | grep -c 'disagree')" = 1 ]; }
        then echo "ok   mpi memtrain train: $what: exit $rc, $(echo "$got" | grep -F -- "$pat" | head -1)"
        else echo "FAIL mpi memtrain train: $what: exit $rc (want $want and '$pat'):"; echo "$got" | grep -v '^{' | head -20; fail=1; fi
    }
    ad=$(mktemp -d)
    mt=$(cd "$B" && pwd)/memtrain
    small="train --model gpt --batch 4 --seq 16 --layers 1 --channels 32 --heads 2 --threads 1 --json"
    "$mt" $small --steps 1 --export-llmc "$ad/t1.bin" >/dev/null 2>&1
    "$mt" $small --steps 1 --seed 2 --export-llmc "$ad/t2.bin" >/dev/null 2>&1
    "$mt" $small --steps 1 --save "$ad/ck" >/dev/null 2>&1
    one="$small --steps 2"
    refused 2 "memtrain: the ranks disagree on --eval-every: rank 0 1, rank 1 2" "--eval-every per rank" \
        -np 1 "$mt" $one --eval-every 1 : -np 1 "$mt" $one --eval-every 2
    refused 2 "memtrain: the ranks disagree on --eval-every: rank 0 8, rank 2 16" "--eval-every on rank 2 of 3" \
        -np 2 "$mt" $one --eval-every 8 : -np 1 "$mt" $one --eval-every 16
    for z in 0 2; do
        refused 2 "memtrain: the ranks disagree on --resume: rank 0 $ad/ck, rank 1 (not given)" "--resume on rank 0 alone, --zero $z" \
            -np 1 "$mt" $one --zero $z --resume "$ad/ck" : -np 1 "$mt" $one --zero $z
    done
    refused 2 "memtrain: the ranks disagree on --seed: rank 0 1, rank 1 2" "--seed per rank" \
        -np 1 "$mt" $one --seed 1 : -np 1 "$mt" $one --seed 2
    refused 2 "memtrain: the ranks disagree on --teacher: rank 0 $ad/t1.bin, rank 1 (not given)" "a teacher on rank 0 alone" \
        -np 1 "$mt" $one --teacher "$ad/t1.bin" : -np 1 "$mt" $one
    refused 2 "memtrain: the ranks disagree on --teacher: rank 0 $ad/t1.bin, rank 1 $ad/t2.bin" "--teacher per rank" \
        -np 1 "$mt" $one --teacher "$ad/t1.bin" : -np 1 "$mt" $one --teacher "$ad/t2.bin"
    refused 2 "memtrain: the ranks disagree on --distill-temp: rank 0 2, rank 1 3" "--distill-temp per rank" \
        -np 1 "$mt" $one --teacher "$ad/t1.bin" --distill-temp 2 : -np 1 "$mt" $one --teacher "$ad/t1.bin" --distill-temp 3
    refused 2 "memtrain: the ranks disagree on --distill-alpha: rank 0 0.5, rank 1 (not given)" "--distill-alpha on rank 0 alone" \
        -np 1 "$mt" $one --teacher "$ad/t1.bin" --distill-alpha 0.5 : -np 1 "$mt" $one --teacher "$ad/t1.bin"
    refused 2 "memtrain: the ranks disagree on --teacher-base: rank 0 int8, rank 1 nf4" "--teacher-base per rank" \
        -np 1 "$mt" $one --teacher "$ad/t1.bin" --teacher-base int8 : -np 1 "$mt" $one --teacher "$ad/t1.bin" --teacher-base nf4
    refused 2 "memtrain: the ranks disagree on --base: rank 0 int8, rank 1 nf4" "--base per rank" \
        -np 1 "$mt" $one --lora 2 --base int8 : -np 1 "$mt" $one --lora 2 --base nf4
    # the same paths in each rank's own directory (-wdir), other files
    mkdir -p "$ad/a" "$ad/b"
    cp "$ad/t1.bin" "$ad/a/t.bin" && cp "$ad/t2.bin" "$ad/b/t.bin"
    refused 1 "mt_trainer_create: the ranks disagree on the teacher's weights: rank 0 #" "the same --teacher path, other weights" \
        -np 1 -wdir "$ad/a" "$mt" $one --teacher t.bin : -np 1 -wdir "$ad/b" "$mt" $one --teacher t.bin
    head -c 6000 README.md >"$ad/a/d.txt" && head -c 5000 README.md >"$ad/b/d.txt"
    refused 2 "memtrain: the ranks disagree on the contents of --data: rank 0 6000 bytes #" "the same --data path, other contents" \
        -np 1 -wdir "$ad/a" "$mt" $one --data d.txt : -np 1 -wdir "$ad/b" "$mt" $one --data d.txt
    "$mt" $small --steps 1 --save "$ad/a/ck" >/dev/null 2>&1
    "$mt" $small --steps 1 --seed 2 --save "$ad/b/ck" >/dev/null 2>&1
    refused 1 "mt_trainer_load: the ranks disagree on the training-state file's contents: rank 0 #" "the same --resume path, other files" \
        -np 1 -wdir "$ad/a" "$mt" $one --resume ck : -np 1 -wdir "$ad/b" "$mt" $one --resume ck
    # what may differ: each rank's own scratch directory; and the same teacher trains
    refused 0 '"step": 2' "--offload-dir per rank, the same --teacher" \
        -np 1 "$mt" $one --teacher "$ad/t1.bin" --offload disk --offload-dir "$ad/a" : \
        -np 1 "$mt" $one --teacher "$ad/t1.bin" --offload disk --offload-dir "$ad/b"
    rm -rf "$ad"
    # faults of one rank the command meets (test/mpi/fault_shim.c, preloaded;
    # under SAN=1 the sanitizer's runtime then is not the first library)
    FAULT="-x LD_PRELOAD=$B/mpi/libmtfault.so -x MT_FAULT_RANK=1 -x ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0:detect_leaks=0"
    gargs="train --model gpt --batch 2 --seq 16 --layers 1 --channels 32 --heads 2 --threads 1 --json"
    # rank 1 stalls in the question after step 2 whether every rank goes on:
    # rank 0 says so there (the collective, its rank, the timeout, the step)
    # and ends the job, not a step later with only "the communicator is broken"
    sd=$(mktemp -d)
    timeout 60 $MPIRUN -np 2 $FAULT -x MT_STALL_CALL=2 "$B/memtrain" $gargs --steps 5 --comm-timeout 1 >"$sd/out" 2>"$sd/err"
    rc=$?
    if [ $rc != 0 ] && [ $rc != 124 ] && [ "$(grep -c '"step"' "$sd/out")" = 2 ] &&
        grep -q "^memtrain: after step 2, asking the ranks whether to stop: mt_comm_all_reduce (mpi, rank 0 of 2): MPI_Iallreduce timed out, not complete after 1 s: a rank died, stalled" "$sd/err" &&
        ! grep -q "step 3" "$sd/err"
    then echo "ok   mpi memtrain train: a rank stalled in the stop question: rank 0 names the collective, its rank, the timeout and the step, and ends the job (exit $rc)"
    else echo "FAIL mpi memtrain train: a rank stalled in the stop question: exit $rc"; cat "$sd/err"; fail=1; fi
    rm -rf "$sd"
    # rank 1's disk fails in step 2 at --zero 0 (no collective after the
    # update): every rank's step fails at once, and no rank's scratch is left
    sd=$(mktemp -d)
    timeout 60 $MPIRUN -np 2 $FAULT -x MT_FAIL_WRITE=80 "$B/memtrain" $gargs --steps 6 --offload disk \
        --offload-dir "$sd" >"$sd/out" 2>"$sd/err"
    rc=$?
    if [ $rc != 0 ] && [ $rc != 124 ] && [ "$(ls "$sd" | grep -c memtrain-scratch)" = 0 ] &&
        grep -q "^memtrain: step 2: mt_trainer_step: offload: writing '.*/memtrain-scratch.rank1/optim.bin': Input/output error" "$sd/err" &&
        grep -q "^memtrain: step 2: mt_trainer_step: rank 1 failed (input/output error) at the updates on disk, so every rank stops (after the update: all [0-9]* trained weight tensors were updated on this rank)$" "$sd/err"
    then echo "ok   mpi memtrain train: a disk failing on rank 1 at --zero 0 fails the step on every rank, every scratch directory removed"
    else echo "FAIL mpi memtrain train: a disk failing on rank 1 at --zero 0: exit $rc"; cat "$sd/err"; ls "$sd"; fail=1; fi
    rm -rf "$sd"
    # rank 1 killed (SIGKILL) with the state on disk: mpirun ends the job, and
    # nothing could remove the ranks' scratch; the next run in the directory
    # (one process: other names than the ranks') removes every one of them
    sd=$(mktemp -d)
    timeout 60 $MPIRUN -np 2 "$B/memtrain" $gargs --steps 100000 --offload disk --offload-dir "$sd" >"$sd/out" 2>"$sd/err" &
    mp=$!
    n=0
    while [ "$(cat "$sd/out" 2>/dev/null | grep -c '"step"')" -lt 2 ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
    for c in $(pgrep -P "$mp"); do for p in $(pgrep -P "$c"); do # (timeout, mpirun, the ranks)
        if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1; then kill -KILL "$p"; fi
    done; done
    wait "$mp"
    left=$(ls "$sd" | grep -c '^memtrain-scratch.rank')
    "$B/memtrain" $gargs --steps 1 --offload disk --offload-dir "$sd" >/dev/null 2>"$sd/err1"
    rc=$?
    if [ "$left" -ge 1 ] && [ $rc = 0 ] && [ "$(ls "$sd" | grep -c memtrain-scratch)" = 0 ]
    then echo "ok   mpi memtrain train: rank 1 killed, $left scratch directories left; the next run in the directory removed them"
    else echo "FAIL mpi memtrain train: rank 1 killed: $left left, the next run exit $rc"; cat "$sd/err1"; ls "$sd"; fail=1; fi
    rm -rf "$sd"
    out2=$(timeout 60 $MPIRUN -np 3 "$B/memtrain" train --model gpt --steps 1 --batch 2 2>&1)
    if echo "$out2" | grep -q "less than the 3 ranks"; then echo "ok   mpi memtrain train: fewer rows than ranks refused"
    else echo "FAIL mpi memtrain train: fewer rows than ranks: $out2"; fail=1; fi
fi

# whether two lists of losses (space-separated) are as many and each within 1e-5
near_losses() {
    awk -v a="$1" -v b="$2" 'BEGIN { n = split(a, x, " "); m = split(b, y, " ");
        if (n != m || n == 0) exit 1; for (i = 1; i <= n; i++) { d = x[i] - y[i];
        if (d < 0) d = -d; if (d > 1e-5 * x[i] + 2e-6) exit 1 } }'
}

# memtrain train --tp: 2 ranks in one tensor group, and 4 as 2 groups of 2, give one
# process's losses (to 1e-5) on the same global batch
if [ -x "$B/memtrain" ]; then
    targs="train --model gpt --batch 4 --seq 16 --layers 2 --channels 48 --heads 6 --threads 1 --steps 3 --json"
    one=$("$B/memtrain" $targs 2>/dev/null | grep -o '"loss": [0-9.]*' | cut -d' ' -f2 | tr '\n' ' ')
    for np in 2 4; do
        sp=$([ $np = 4 ] && echo --sp)
        tpo=$(timeout 120 $MPIRUN -np $np "$B/memtrain" $targs --tp 2 $sp 2>&1)
        got=$(echo "$tpo" | grep -o '"loss": [0-9.]*' | cut -d' ' -f2 | tr '\n' ' ')
        if [ -n "$one" ] && near_losses "$one" "$got"
        then echo "ok   mpi memtrain train --tp 2 $sp on $np ranks: one process's losses $got"
        else echo "FAIL mpi memtrain train --tp 2 $sp on $np ranks: losses '$got', one process '$one'"; echo "$tpo"; fail=1; fi
    done
    # a checkpoint saved by a tensor group of 2 resumes on one process and on 2 groups of 2
    # with sequence parallel: the unbroken run's last step
    ck=$(mktemp)
    timeout 120 $MPIRUN -np 2 "$B/memtrain" $targs --tp 2 --steps 2 --save "$ck" >/dev/null 2>&1
    last=$(echo "$one" | cut -d' ' -f3)
    r1=$("$B/memtrain" $targs --resume "$ck" 2>/dev/null | grep -o '"loss": [0-9.]*' | tail -n 1 | cut -d' ' -f2)
    r4=$(timeout 120 $MPIRUN -np 4 "$B/memtrain" $targs --tp 2 --sp --resume "$ck" 2>/dev/null |
         grep -o '"loss": [0-9.]*' | tail -n 1 | cut -d' ' -f2)
    if [ -n "$last" ] && [ "$r1" = "$last" ] && [ "$r4" = "$last" ]
    then echo "ok   mpi memtrain train --tp 2 --save: resumed by 1 rank and by 2 groups of 2 with --sp, the unbroken run's last loss $last"
    else echo "FAIL mpi memtrain train --tp 2 --save: resumed '$r1' (1 rank), '$r4' (4 ranks), unbroken '$last'"; fail=1; fi
    rm -f "$ck"
fi

# memtrain train --pp: 2 and 3 stages, tp 2 x pp 2, pp 2 over 2 groups at ZeRO-2, and 8 ranks as dp 2 x tp 2 x pp 2 with
# ZeRO-1, in micro-batches of one row, give one process's losses (to 1e-5) on the same
# global batch; and an MLP's 2 stages give its losses exactly
if [ -x "$B/memtrain" ]; then
    pargs="train --model gpt --batch 4 --micro 1 --seq 16 --layers 2 --channels 48 --heads 6 --threads 1 --steps 3 --json"
    one=$("$B/memtrain" $pargs 2>/dev/null | grep -o '"loss": [0-9.]*' | cut -d' ' -f2 | tr '\n' ' ')
    for grid in "2 --pp 2" "3 --pp 3" "4 --pp 2 --tp 2" "8 --pp 2 --tp 2 --zero 1" "4 --pp 2 --zero 2"; do
        np=${grid%% *}; flags=${grid#* }
        ppo=$(timeout 180 $MPIRUN -np $np "$B/memtrain" $pargs $flags 2>&1)
        got=$(echo "$ppo" | grep -o '"loss": [0-9.]*' | cut -d' ' -f2 | tr '\n' ' ')
        if [ -n "$one" ] && near_losses "$one" "$got"
        then echo "ok   mpi memtrain train $flags on $np ranks: one process's losses $got"
        else echo "FAIL mpi memtrain train $flags on $np ranks: losses '$got', one process '$one'"; echo "$ppo"; fail=1; fi
    done
    # a checkpoint saved by tp 2 x pp 2 resumes on one process and on 3 stages: the
    # unbroken run's last loss
    ck=$(mktemp)
    timeout 180 $MPIRUN -np 4 "$B/memtrain" $pargs --pp 2 --tp 2 --steps 2 --save "$ck" >/dev/null 2>&1
    last=$(echo "$one" | cut -d' ' -f3)
    r1=$("$B/memtrain" $pargs --resume "$ck" 2>/dev/null | grep -o '"loss": [0-9.]*' | tail -n 1 | cut -d' ' -f2)
    r3=$(timeout 180 $MPIRUN -np 3 "$B/memtrain" $pargs --pp 3 --resume "$ck" 2>/dev/null |
         grep -o '"loss": [0-9.]*' | tail -n 1 | cut -d' ' -f2)
    if [ -n "$last" ] && awk -v a="$last" -v b="$r1" -v c="$r3" 'BEGIN { if (b == "" || c == "") exit 1;
           d = a - b; e = a - c; if (d < 0) d = -d; if (e < 0) e = -e; exit !(d <= 1e-5 * a + 2e-6 && e <= 1e-5 * a + 2e-6) }'
    then echo "ok   mpi memtrain train --tp 2 --pp 2 --save: resumed by 1 rank and by 3 stages, the unbroken run's last loss $last"
    else echo "FAIL mpi memtrain train --tp 2 --pp 2 --save: resumed '$r1' (1 rank), '$r3' (3 stages), unbroken '$last'"; fail=1; fi
    rm -f "$ck"
    margs="train --model mlp --batch 8 --micro 2 --threads 1 --steps 4 --json"
    mone=$("$B/memtrain" $margs 2>/dev/null | grep -o '"loss": [0-9.]*' | tr '\n' ' ')
    mgot=$(timeout 120 $MPIRUN -np 2 "$B/memtrain" $margs --pp 2 2>/dev/null | grep -o '"loss": [0-9.]*' | tr '\n' ' ')
    if [ -n "$mone" ] && [ "$mone" = "$mgot" ]
    then echo "ok   mpi memtrain train --model mlp --pp 2: one process's losses exactly"
    else echo "FAIL mpi memtrain train --model mlp --pp 2: '$mgot', one process '$mone'"; fail=1; fi
    # stage 1 stalls in its 5th send (a gradient back to stage 0, in step 2): stage 0
    # stops with MT_ERR_COMM at its 1 s deadline, naming the exchange, and the job ends
    sd=$(mktemp -d)
    timeout 60 $MPIRUN -np 2 -x LD_PRELOAD=$B/mpi/libmtfault.so -x MT_FAULT_RANK=1 -x MT_STALL_SEND=5 \
        -x ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0:detect_leaks=0 \
        "$B/memtrain" $pargs --pp 2 --steps 5 --comm-timeout 1 >"$sd/out" 2>"$sd/err"
    rc=$?
    if [ $rc != 0 ] && [ $rc != 124 ] && grep -q "pipeline parallel: .*timed out" "$sd/err"
    then echo "ok   mpi memtrain train --pp 2: a stage stalled in a send: the other stopped at its deadline naming the exchange (exit $rc)"
    else echo "FAIL mpi memtrain train --pp 2: a stage stalled in a send: exit $rc"; cat "$sd/err"; fail=1; fi
    rm -rf "$sd"
    bad=$(timeout 60 $MPIRUN -np 3 "$B/memtrain" $pargs --pp 2 2>&1)
    if echo "$bad" | grep -q "not a multiple of tensor_parallel 1 x pipeline_parallel 2"
    then echo "ok   mpi memtrain train --pp 2 on 3 ranks: refused, the grid named"
    else echo "FAIL mpi memtrain train --pp 2 on 3 ranks: $bad"; fail=1; fi
fi

# a rank that dies: mpirun ends the job (or rank 0 times out first); nothing hangs
timeout 60 $MPIRUN -np 2 "$B/mpi/comm_mpi_test" die >"$out" 2>&1
rc=$?
if [ $rc = 124 ] || [ $rc = 0 ]; then echo "FAIL mpi die: exit $rc"; cat "$out"; fail=1
else echo "ok   mpi die: a rank exited mid-run, the job ended (exit $rc), no hang"; fi
exit $fail
