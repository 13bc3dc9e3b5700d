/*
 * comm/nccl_overlap.h - the gradients' collectives on a communication
 * stream (nccl_overlap.c): on a CUDA context with the NCCL communicator,
 * each gradient's all-reduce (or a job's collectives: ZeRO's
 * reduce-scatters) is queued on a stream of its own as backward makes the
 * gradient final, ordered after the kernels that wrote it by an event, and
 * the step waits for them, the oldest first or all at once.
 */
#ifndef MT_COMM_NCCL_OVERLAP_H
#define MT_COMM_NCCL_OVERLAP_H

#include "comm/comm.h"

typedef struct mti_ncclov mti_ncclov;

/* Whether a context's gradients can be summed on a communication stream:
 * a CUDA context (not a dry one) whose communicator is NCCL's
 * (mt_comm_nccl_create) over several ranks, unless the environment
 * variable MT_NCCL_OVERLAP is 0. */
bool mti_ncclov_possible(const mt_context *ctx);
/* The same, or for a dry context (an estimate) whether the context it
 * stands for would have it (a CUDA context of several ranks whose
 * communicator is NCCL's, or none named: a CUDA estimate assumes NCCL). */
bool mti_ncclov_planned(const mt_context *ctx);
/* What the stream runs for tensor i's gradient g instead of its sum in
 * place: the job's collectives (made with the mti_comm_* calls, which go on
 * the communication stream, each after the device's stream's work so far,
 * and are not waited for). Runs on the calling thread; whatever it reads
 * or writes must stay until the tensor is waited for. */
typedef mt_status (*mti_ncclov_job)(void *user, int i, float *g);
/* The stream and its events, for n tensors (0 .. n - 1) of numel[i] fp32
 * values each (0: one that never takes part, a frozen one); job NULL: each
 * summed in place. With a job: each tensor queued as it is given,
 * in that order (every rank gives them in one order), and any number given
 * in a round. Allocates no device memory. The context's collectives on the
 * device's stream wait for the stream from now on (mti_ncclovs_quiet). */
mt_status mti_ncclov_new(mt_context *ctx, int n, const size_t *numel, mti_ncclov_job job, void *user,
                         mti_ncclov **out);
/* Frees it (NULL: nothing), first waiting for its stream's work, if any,
 * up to the communicator's deadline (then aborted); work that still did
 * not end holds the device's releases to the driver for good (see
 * mti_device.release_guard, which mti_ncclov_new installs: every release
 * to the driver waits the same way for the context's streams). */
void mti_ncclov_free(mti_ncclov *ov);
/* A new round: no tensor given yet. */
void mti_ncclov_begin(mti_ncclov *ov);
/* Tensor i's gradient g (device memory, numel[i] values; NULL for one that
 * takes no part) is final on the device's stream: the tensors from the
 * highest not queued yet down to the lowest not given yet are queued on
 * the communication stream, each after an event recorded on the device's
 * stream now, so every rank queues the same collectives in the same order
 * (the last tensor first) whatever order it gives them in. Never waits on
 * the host. After a failure nothing more is queued; the wait reports it. */
mt_status mti_ncclov_push(mti_ncclov *ov, int i, const char *name, float *g);
bool mti_ncclov_pushed(const mti_ncclov *ov, int i);
/* Every tensor given: waits on the host, up to the communicator's
 * deadline, for the communication stream (the time is the exposed
 * communication), then makes the device's stream wait for it too, so what
 * follows reads the sums. MT_ERR_COMM on a failure (the communicator is
 * then aborted and broken). */
mt_status mti_ncclov_wait(mti_ncclov *ov);
/* fifo: waits the same way for the first k tensors given this round only. */
mt_status mti_ncclov_wait_first(mti_ncclov *ov, int k);
/* A call the stream runs for a caller: fn(user, i) queues its collectives
 * (the mti_comm_* calls, posted as a job's are), each after the device's
 * stream's work so far; *ticket names it. Never waits, but for the oldest
 * call when 64 are in flight. After a failure the later calls are dropped
 * (their waits fail). */
typedef mt_status (*mti_ncclov_fn)(void *user, int i);
mt_status mti_ncclov_call(mti_ncclov *ov, mti_ncclov_fn fn, void *user, int i, uint64_t *ticket);
/* Waits on the host (the deadline kept, the time exposed) until call
 * `ticket` and those before it are done, then makes the device's stream
 * wait for them: MT_OK, its failure, or MT_ERR_COMM when an earlier one
 * failed. */
mt_status mti_ncclov_done(mti_ncclov *ov, uint64_t ticket);
/* Every call done (as mti_ncclov_done); with reset a failure is forgotten
 * (MT_OK; the next calls run again). */
mt_status mti_ncclov_quiet(mti_ncclov *ov, bool reset);
/* This rank stops part-way through the collectives every rank queues in
 * a step (a failure in a pass whose collectives go in backward's hooks:
 * ZeRO-2, the fused step, ZeRO-3): the communicator is aborted and broken
 * at once, so the others' collectives queued beyond this rank's end with
 * MT_ERR_COMM rather than meet its next one (the step's status exchange)
 * or wait for their deadline. */
void mti_ncclov_abandon(mti_ncclov *ov);
/* Waits for every communication stream of the context (what a collective
 * on the device's stream does first, so the two streams never hold NCCL
 * work of the communicator at once): MT_OK, or the failure of what they
 * held ("WHAT: an earlier collective on the communication stream
 * failed: ..."). Nothing while a job posts. */
mt_status mti_ncclovs_quiet(mt_context *ctx, const char *what);
/* From nccl.c: whether c is NCCL's communicator; an in-place fp32 sum
 * queued on stream without waiting; the deadline's wait for stream (the
 * communicator aborted when it passes or NCCL reports an error); an
 * abort. The failures leave their message in the table's last_error. */
bool mti_nccl_is(const mt_comm *c);
mt_status mti_nccl_post_sum(mt_comm *c, float *buf, size_t count, void *stream);
mt_status mti_nccl_wait(mt_comm *c, const char *what, void *stream);
void mti_nccl_abort(mt_comm *c);
/* Until mti_nccl_post_end, the calling thread's NCCL collectives go on
 * `stream`, each after fence(arg), and are not waited for (posting:
 * mti_comm_posting says so). */
void mti_nccl_post_begin(void *stream, void (*fence)(void *), void *arg);
void mti_nccl_post_end(void);
/* Waits until done(arg) (1 done, 0 not yet, -1 a CUDA error in *cu), up
 * to the communicator's deadline, as mti_nccl_wait waits for a stream. */
mt_status mti_nccl_wait_until(mt_comm *c, const char *what, int (*done)(void *, int *), void *arg);

#endif /* MT_COMM_NCCL_OVERLAP_H */
