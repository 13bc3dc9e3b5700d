/*
 * comm/overlap.h - a communication thread that sums gradients over the
 * ranks while backward goes on (overlap.c).
 */
#ifndef MT_COMM_OVERLAP_H
#define MT_COMM_OVERLAP_H

#include "comm/comm.h"

typedef struct mti_overlap mti_overlap;

/* Whether a context's gradient collectives can run on a thread of their
 * own: a host communicator of several ranks that takes calls from any
 * thread (MT_COMM_CAP_THREADS), on a CPU context. */
bool mti_overlap_possible(const mt_context *ctx);
/* Starts the thread, for n tensors (0 .. n - 1) of numel[i] fp32 values
 * each (0: a tensor that never takes part, a frozen one). */
mt_status mti_overlap_new(mt_context *ctx, int n, const size_t *numel, mti_overlap **out);
/* Ends the thread (its step must be finished). NULL is accepted. */
void mti_overlap_free(mti_overlap *ov);
/* A step begins: the thread will sum tensors n - 1 down to 0 in buckets
 * (runs of tensors that fit in the staging buffer together), each bucket
 * once all its tensors are given, in that order on every rank whatever
 * order they come in. */
void mti_overlap_begin(mti_overlap *ov);
/* Gives tensor i: the sum over the ranks of its numel fp32 values at g, in
 * place (name: for messages). g NULL: zeros whose sums are dropped (a rank
 * that has no gradient to give still makes the collectives the others
 * make). Never waits for a collective. */
mt_status mti_overlap_push(mti_overlap *ov, int i, const char *name, float *g);
/* Whether tensor i was given this step. */
bool mti_overlap_pushed(const mti_overlap *ov, int i);
/* Waits until the step's collectives are done (every tensor must have been
 * given): MT_OK, or the first one's failure (its message on ctx), after
 * which the later ones were dropped. The wait counts as exposed
 * communication time (mt_context_comm_stats). */
mt_status mti_overlap_wait(mti_overlap *ov);

/* A call the thread runs for a caller (fn(user, i)), after every call
 * queued before it: in a step where no gradient is given, and every rank
 * queuing the same calls in the same order. */
typedef mt_status (*mti_overlap_fn)(void *user, int i);
/* Queues fn(user, i); *ticket names it for mti_overlap_done. Never waits
 * for a collective. After a call fails, the later ones are dropped. */
mt_status mti_overlap_call(mti_overlap *ov, mti_overlap_fn fn, void *user, int i, uint64_t *ticket);
/* Waits until call `ticket` is done: MT_OK, its failure (its message on
 * ctx), or MT_ERR_COMM when an earlier call failed (and this one was
 * dropped). The wait counts as exposed communication time. */
mt_status mti_overlap_done(mti_overlap *ov, uint64_t ticket);
/* Waits until every queued call is done (exposed time): MT_OK, or the
 * status of a call that failed (with `what`, the message "WHAT: an earlier
 * collective on the communication thread failed: ..." on ctx). With reset,
 * a failure is forgotten (MT_OK; the next calls run again). */
mt_status mti_overlap_quiet(mti_overlap *ov, bool reset, const char *what);

#endif /* MT_COMM_OVERLAP_H */
