/*
 * comm/nccl_overlap.h - the gradients' sums on a communication stream
 * (nccl_overlap.c): on a CUDA context with the NCCL communicator, each
 * gradient's all-reduce is queued on a stream of its own as backward makes
 * the gradient final, ordered after the kernels that wrote it by an event,
 * and the step waits for them all once backward ends.
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
/* The stream and its events, for n tensors (0 .. n - 1) of numel[i] fp32
 * values each (0: one that never takes part, a frozen one). Allocates no
 * device memory. */
mt_status mti_ncclov_new(mt_context *ctx, int n, const size_t *numel, mti_ncclov **out);
/* Frees it (NULL: nothing); its stream's work, if any, still ends. */
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

/* From nccl.c: whether c is NCCL's communicator; an in-place fp32 sum
 * queued on stream without waiting; the deadline's wait for stream (the
 * communicator aborted when it passes or NCCL reports an error); an
 * abort. The failures leave their message in the table's last_error. */
bool mti_nccl_is(const mt_comm *c);
mt_status mti_nccl_post_sum(mt_comm *c, float *buf, size_t count, void *stream);
mt_status mti_nccl_wait(mt_comm *c, const char *what, void *stream);
void mti_nccl_abort(mt_comm *c);

#endif /* MT_COMM_NCCL_OVERLAP_H */
