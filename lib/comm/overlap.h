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
 * a bucket (ZeRO-1: the reduce-scatter to the slices' owners), a
 * collective; g NULL: zeros whose results are dropped. It runs on the
 * thread: it must allocate nothing (the accounting's peaks stay those of
 * the step without the thread) and touch nothing backward touches. */
typedef mt_status (*mti_overlap_job)(void *user, int i, float *g);
/* Starts the thread, for n tensors (0 .. n - 1) of numel[i] fp32 values
 * each (0: a tensor that never takes part, a frozen one); job NULL: the
 * tensors are summed over the ranks in place, in buckets. fifo (with a
 * job): the tensors go to the job in the order they are given, not in the
 * fixed order (ZeRO-2, whose every rank gives them in the same order
 * unless its backward fails, which the blocking step cannot survive
 * either), and any number of them may be given in a round. */
mt_status mti_overlap_new(mt_context *ctx, int n, const size_t *numel, mti_overlap_job job,
                          void *user, bool fifo, mti_overlap **out);
/* Ends the thread (its step must be finished). NULL is accepted. */
void mti_overlap_free(mti_overlap *ov);
/* A step (a round) begins: the thread will sum tensors n - 1 down to 0 in
 * buckets (or give them to the job one by one; fifo: in the order given), each bucket
 * once all its tensors are given, in that order on every rank whatever
 * order they come in. */
void mti_overlap_begin(mti_overlap *ov);
/* Gives tensor i: the sum over the ranks of its numel fp32 values at g, in
 * place, or the job's work on them (name: for messages). g NULL: zeros whose sums are dropped (a rank
 * that has no gradient to give still makes the collectives the others
 * make). Never waits for a collective. */
mt_status mti_overlap_push(mti_overlap *ov, int i, const char *name, float *g);
/* Whether tensor i was given this step. */
bool mti_overlap_pushed(const mti_overlap *ov, int i);
/* Waits until the step's collectives are done (every tensor must have been
 * given, unless fifo: those given): MT_OK, or the first one's failure (its message on ctx), after
 * which the later ones were dropped. The wait counts as exposed
 * communication time (mt_context_comm_stats). */
mt_status mti_overlap_wait(mti_overlap *ov);
/* fifo: waits until the first k tensors given this round are done (as
 * exposed time): MT_OK, or the first failure so far. */
mt_status mti_overlap_wait_first(mti_overlap *ov, int k);

#endif /* MT_COMM_OVERLAP_H */
