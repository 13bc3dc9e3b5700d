/*
 * comm/overlap.h - the communication thread (overlap.c): one queue of
 * collectives per rank, run in the order they were queued, while the
 * stepping thread computes: the gradients' all-reduce in buckets (stage
 * 0), their reduce-scatter to the slices' owners (stages 1 and 2), and
 * calls queued for a caller (stage 3's gathers and reduce-scatters).
 */
#ifndef MT_COMM_OVERLAP_H
#define MT_COMM_OVERLAP_H

#include "comm/comm.h"

typedef struct mti_overlap mti_overlap;

/* Whether a context's gradient collectives can run on a thread of their
 * own: a host communicator of several ranks that takes calls from any
 * thread (MT_COMM_CAP_THREADS), on a CPU context. */
bool mti_overlap_possible(const mt_context *ctx);
/* The same, or for a dry context (an estimate) whether the context it
 * stands for had it (made from a configuration whose communicator says
 * MT_COMM_CAP_THREADS: mt_estimate_model on a data-parallel model). */
bool mti_overlap_planned(const mt_context *ctx);
/* Bytes of gradients summed together in one collective, at most (a larger
 * tensor alone). Small enough that little is left to sum when backward
 * ends (the first layers' gradients and the embeddings, final last), large
 * enough that a step makes few collectives (docs/benchmarks.md). */
#define MTI_OVERLAP_BUCKET ((size_t)512 << 10)
/* What the thread does with tensor i's gradient g instead of summing it in
 * a bucket (ZeRO-1 and 2: the reduce-scatter to the slices' owners), a
 * collective; g NULL: zeros whose results are dropped. It runs on the
 * thread: it must allocate nothing (the accounting's peaks stay those of
 * the step without the thread) and touch nothing backward touches. */
typedef mt_status (*mti_overlap_job)(void *user, int i, float *g);
/* Starts the thread, for n tensors (0 .. n - 1) of numel[i] fp32 values
 * each (0: a tensor that never takes part, a frozen one; n 0: none, the
 * queue takes calls alone); job NULL: the tensors are summed over the
 * ranks in place, in buckets. fifo (with a job): the tensors go to the
 * job in the order they are given, not in the fixed order (ZeRO-2, whose
 * every rank gives them in the same order unless its backward fails,
 * which the blocking step cannot survive either), and any number of them
 * may be given in a round. The context's collectives from other threads
 * wait for the queue from now on (ctx->comm->threads_q, the context's queues) until
 * mti_overlap_free. */
mt_status mti_overlap_new(mt_context *ctx, int n, const size_t *numel, mti_overlap_job job,
                          void *user, bool fifo, mti_overlap **out);
/* Waits until every queue of the context (each trainer with a thread has
 * one) is empty: what a collective of the stepping thread does first. The
 * first failure found is returned. */
mt_status mti_overlaps_quiet(mt_context *ctx, const char *what);
/* Waits until every queue of the context is empty and takes the first
 * failure of this rank alone that one of them held (MT_OK if none; its
 * message on ctx), forgetting it: what the step's status exchange sends
 * the other ranks (dp.c). A failure on the thread whose communicator
 * stays whole (anything but a failed collective) is held, not reported
 * by the waits below: what was queued after it still runs, so this rank
 * makes the collectives the others make until the exchange. */
mt_status mti_overlaps_take(mt_context *ctx);
/* Test hook: called by the thread after each entry of a queue that ran
 * (entries numbered from 1 since the queue was made); a status other than
 * MT_OK fails that entry after its collectives, as a failure of this rank
 * alone would. NULL (the default) in the library. */
extern mt_status (*mti_overlap_fault)(const mt_context *ctx, uint64_t entry);
/* Waits for the queue, ends the thread. NULL is accepted. */
void mti_overlap_free(mti_overlap *ov);
/* A round of gradients (a step) begins, once the queue is empty: the
 * thread will sum tensors n - 1 down to 0 in buckets (or give them to the
 * job one by one; fifo: in the order given), each bucket queued once all
 * its tensors are given, in that order on every rank whatever order they
 * come in. A failure of an earlier round is forgotten (a broken
 * communicator fails again at once). */
void mti_overlap_begin(mti_overlap *ov);
/* Gives tensor i: the sum over the ranks of its numel fp32 values at g, in
 * place, or the job's work on them (name: for messages). g NULL: zeros
 * whose sums are dropped (a rank that has no gradient to give still makes
 * the collectives the others make). Never waits for a collective. */
mt_status mti_overlap_push(mti_overlap *ov, int i, const char *name, float *g);
/* Whether tensor i was given this round. */
bool mti_overlap_pushed(const mti_overlap *ov, int i);
/* Waits until the round's collectives and every call queued before this
 * are done (every tensor must have been given, unless fifo: those given):
 * MT_OK, or the first failure that broke the communicator (its message on
 * ctx), after which the later ones were dropped (one of this rank alone is
 * held for mti_overlaps_take). The wait counts as exposed communication
 * time (mt_context_comm_stats). */
mt_status mti_overlap_wait(mti_overlap *ov);
/* fifo: waits until the first k tensors given this round are done (as
 * exposed time): MT_OK, or the failure of one of them or of something
 * queued before. */
mt_status mti_overlap_wait_first(mti_overlap *ov, int k);

/* A call the thread runs for a caller (fn(user, i)), in the queue's order:
 * after everything queued before it, every rank queuing the same calls in
 * the same order. */
typedef mt_status (*mti_overlap_fn)(void *user, int i);
/* Queues fn(user, i); *ticket names it for mti_overlap_done. Never waits
 * for a collective. After anything queued fails and breaks the
 * communicator, the later ones are dropped. */
mt_status mti_overlap_call(mti_overlap *ov, mti_overlap_fn fn, void *user, int i, uint64_t *ticket);
/* Waits until call `ticket` is done: MT_OK, its failure (its message on
 * ctx), or MT_ERR_COMM when something queued earlier failed (and this one
 * was dropped), each only a failure that broke the communicator. The wait
 * counts as exposed communication time. */
mt_status mti_overlap_done(mti_overlap *ov, uint64_t ticket);
/* Waits until the queue is empty (exposed time): MT_OK, or the status of
 * something queued that failed and broke the communicator (with `what`,
 * the message "WHAT: an earlier collective on the communication thread
 * failed: ..." on ctx). With reset, that failure is forgotten (MT_OK;
 * what is queued next runs again); one held for mti_overlaps_take stays. */
mt_status mti_overlap_quiet(mti_overlap *ov, bool reset, const char *what);

#endif /* MT_COMM_OVERLAP_H */
