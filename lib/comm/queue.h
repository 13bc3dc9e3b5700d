/*
 * comm/queue.h - one queue of collectives that overlap compute, whatever
 * runs it (queue.c): the communication thread of a host communicator
 * (comm/overlap.c, a CPU context) or NCCL's communication stream
 * (comm/nccl_overlap.c, a CUDA context with the NCCL communicator). The
 * trainer and ZeRO-3 hold one and call it without asking which; what
 * differs between the two is said by the queue's capabilities.
 *
 * A queue takes a round of tensors (begin, push, wait: the gradients'
 * sums, or a job's collectives for each), and calls for a caller (call,
 * done: ZeRO-3's gathers and reduce-scatters), in an order every rank
 * shares. The semantics of each call are the backends' (overlap.h,
 * nccl_overlap.h), which agree on everything but what the capabilities
 * name.
 */
#ifndef MT_COMM_QUEUE_H
#define MT_COMM_QUEUE_H

#include "comm/comm.h"

typedef struct mti_queue mti_queue;

/* What runs a context's queue: nothing, the thread, or NCCL's stream. */
typedef enum { MTI_QUEUE_NONE, MTI_QUEUE_THREAD, MTI_QUEUE_STREAM } mti_queue_kind;

/* The queue a context can make now (NONE for a dry context), and the one
 * the context it stands for would make (the same, or for a dry context,
 * an estimate, the one its configuration plans). */
mti_queue_kind mti_queue_possible(const mt_context *ctx);
mti_queue_kind mti_queue_planned(const mt_context *ctx);

/* What the queue does with tensor i's gradient g instead of its sum in
 * place (g NULL: zeros whose results are dropped), and a call it runs for
 * a caller. */
typedef mt_status (*mti_queue_job)(void *user, int i, float *g);
typedef mt_status (*mti_queue_fn)(void *user, int i);

/* The context's queue (mti_queue_possible's kind; MT_ERR_UNSUPPORTED when
 * NONE), for n tensors (0 .. n - 1) of numel[i] fp32 values each (0: one
 * that never takes part); job NULL: each summed over the ranks in place.
 * fifo (with a job): the tensors go to the job in the order given, any
 * number of them in a round (NCCL's stream always takes a job's that
 * way). */
mt_status mti_queue_new(mt_context *ctx, int n, const size_t *numel, mti_queue_job job, void *user,
                        bool fifo, mti_queue **out);
/* Waits for the queue, ends it. NULL is accepted. */
void mti_queue_free(mti_queue *q);

/* Capabilities. DEVICE: its collectives read device memory, so a rank
 * with nothing to give (a failed pass) still gives a buffer of zeros, not
 * NULL. */
enum { MTI_QUEUE_DEVICE = 1 };
unsigned mti_queue_caps(const mti_queue *q);

/* A round begins: no tensor given yet (an earlier round's failure
 * forgotten). */
void mti_queue_begin(mti_queue *q);
/* Gives tensor i (name: for messages); never waits for a collective. */
mt_status mti_queue_push(mti_queue *q, int i, const char *name, float *g);
/* Whether tensor i was given this round. */
bool mti_queue_pushed(const mti_queue *q, int i);
/* Waits until the round's collectives are done (exposed communication
 * time): MT_OK or the first failure. */
mt_status mti_queue_wait(mti_queue *q);
/* fifo: waits until the first k tensors given this round are done. */
mt_status mti_queue_wait_first(mti_queue *q, int k);
/* Queues fn(user, i) after everything queued before it; *ticket names it. */
mt_status mti_queue_call(mti_queue *q, mti_queue_fn fn, void *user, int i, uint64_t *ticket);
/* Waits until call `ticket` is done: MT_OK, its failure, or MT_ERR_COMM
 * when something queued earlier failed. */
mt_status mti_queue_done(mti_queue *q, uint64_t ticket);
/* Waits until everything queued is done; with reset a failure is
 * forgotten (MT_OK; what is queued next runs again). */
mt_status mti_queue_quiet(mti_queue *q, bool reset);
/* This rank stops part-way through the collectives every rank queues in
 * a step: NCCL's stream aborts the communicator at once, so the others'
 * queued collectives end rather than wait for their deadline; the thread
 * has nothing to do (its collectives time out on the others' side as the
 * blocking ones do). */
void mti_queue_abandon(mti_queue *q);

/* Every queue of the context: waits until they are empty (what a
 * collective of the stepping thread does first): MT_OK, or the first
 * failure found ("WHAT: an earlier collective on the communication
 * thread/stream failed: ..."). */
mt_status mti_queues_quiet(mt_context *ctx, const char *what);
/* Waits as mti_queues_quiet and takes the first failure of this rank alone
 * that a queue held, forgetting it (MT_OK if none): what the step's status
 * exchange sends the other ranks (dp.c). Only the thread holds such
 * failures; NCCL's stream has none (every failure there breaks the
 * communicator). */
mt_status mti_queues_take(mt_context *ctx);

#endif /* MT_COMM_QUEUE_H */
