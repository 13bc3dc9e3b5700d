/*
 * queue.c - one queue interface (queue.h) over its two backends: the
 * communication thread (overlap.c) and NCCL's communication stream
 * (nccl_overlap.c). Each backend is a table of the same calls; the
 * differences between them are the table's capabilities, and the
 * thread's `what` for a failure's message, which the stream's messages
 * carry themselves.
 */
#include <stdlib.h>

#include "comm/nccl_overlap.h"
#include "comm/overlap.h"
#include "comm/queue.h"
#include "internal.h"

typedef struct queue_impl {
    unsigned caps;
    void (*free)(void *q);
    void (*begin)(void *q);
    mt_status (*push)(void *q, int i, const char *name, float *g);
    bool (*pushed)(const void *q, int i);
    mt_status (*wait)(void *q);
    mt_status (*wait_first)(void *q, int k);
    mt_status (*call)(void *q, mti_queue_fn fn, void *user, int i, uint64_t *ticket);
    mt_status (*done)(void *q, uint64_t ticket);
    mt_status (*quiet)(void *q, bool reset);
    void (*abandon)(void *q);
} queue_impl;

struct mti_queue {
    const queue_impl *impl;
    void *q; /* the backend's */
};

/* ---- the communication thread ---- */

static void th_free(void *q) { mti_overlap_free(q); }
static void th_begin(void *q) { mti_overlap_begin(q); }
static mt_status th_push(void *q, int i, const char *name, float *g)
{
    return mti_overlap_push(q, i, name, g);
}
static bool th_pushed(const void *q, int i) { return mti_overlap_pushed(q, i); }
static mt_status th_wait(void *q) { return mti_overlap_wait(q); }
static mt_status th_wait_first(void *q, int k) { return mti_overlap_wait_first(q, k); }
static mt_status th_call(void *q, mti_queue_fn fn, void *user, int i, uint64_t *ticket)
{
    return mti_overlap_call(q, fn, user, i, ticket);
}
static mt_status th_done(void *q, uint64_t ticket) { return mti_overlap_done(q, ticket); }
static mt_status th_quiet(void *q, bool reset) { return mti_overlap_quiet(q, reset, NULL); }
static void th_abandon(void *q) { (void)q; }

static const queue_impl thread_impl = {0,        th_free,       th_begin, th_push,
                                       th_pushed, th_wait,      th_wait_first, th_call,
                                       th_done,  th_quiet,      th_abandon};

/* ---- NCCL's communication stream ---- */

static void st_free(void *q) { mti_ncclov_free(q); }
static void st_begin(void *q) { mti_ncclov_begin(q); }
static mt_status st_push(void *q, int i, const char *name, float *g)
{
    return mti_ncclov_push(q, i, name, g);
}
static bool st_pushed(const void *q, int i) { return mti_ncclov_pushed(q, i); }
static mt_status st_wait(void *q) { return mti_ncclov_wait(q); }
static mt_status st_wait_first(void *q, int k) { return mti_ncclov_wait_first(q, k); }
static mt_status st_call(void *q, mti_queue_fn fn, void *user, int i, uint64_t *ticket)
{
    return mti_ncclov_call(q, fn, user, i, ticket);
}
static mt_status st_done(void *q, uint64_t ticket) { return mti_ncclov_done(q, ticket); }
static mt_status st_quiet(void *q, bool reset) { return mti_ncclov_quiet(q, reset); }
static void st_abandon(void *q) { mti_ncclov_abandon(q); }

static const queue_impl stream_impl = {MTI_QUEUE_DEVICE, st_free,       st_begin, st_push,
                                       st_pushed,        st_wait,       st_wait_first, st_call,
                                       st_done,          st_quiet,      st_abandon};

/* ---- the interface ---- */

mti_queue_kind mti_queue_possible(const mt_context *ctx)
{
    return mti_overlap_possible(ctx)   ? MTI_QUEUE_THREAD
           : mti_ncclov_possible(ctx) ? MTI_QUEUE_STREAM
                                      : MTI_QUEUE_NONE;
}

mti_queue_kind mti_queue_planned(const mt_context *ctx)
{
    return mti_overlap_planned(ctx)   ? MTI_QUEUE_THREAD
           : mti_ncclov_planned(ctx) ? MTI_QUEUE_STREAM
                                     : MTI_QUEUE_NONE;
}

mt_status mti_queue_new(mt_context *ctx, int n, const size_t *numel, mti_queue_job job, void *user,
                        bool fifo, mti_queue **out)
{
    *out = NULL;
    const mti_queue_kind kind = mti_queue_possible(ctx);
    if (kind == MTI_QUEUE_NONE)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "mti_queue_new: this context has no communication thread or stream");
    mti_queue *q = calloc(1, sizeof *q);
    if (!q) return mti_fail(ctx, MT_ERR_OOM, "mti_queue_new: out of host memory");
    mt_status s;
    if (kind == MTI_QUEUE_THREAD) {
        mti_overlap *ov = NULL;
        s = mti_overlap_new(ctx, n, numel, job, user, fifo, &ov);
        q->impl = &thread_impl, q->q = ov;
    } else {
        mti_ncclov *ov = NULL;
        s = mti_ncclov_new(ctx, n, numel, job, user, &ov);
        q->impl = &stream_impl, q->q = ov;
    }
    if (s) {
        free(q);
        return s;
    }
    *out = q;
    return MT_OK;
}

void mti_queue_free(mti_queue *q)
{
    if (!q) return;
    q->impl->free(q->q);
    free(q);
}

unsigned mti_queue_caps(const mti_queue *q) { return q->impl->caps; }
void mti_queue_begin(mti_queue *q) { q->impl->begin(q->q); }
mt_status mti_queue_push(mti_queue *q, int i, const char *name, float *g)
{
    return q->impl->push(q->q, i, name, g);
}
bool mti_queue_pushed(const mti_queue *q, int i) { return q->impl->pushed(q->q, i); }
mt_status mti_queue_wait(mti_queue *q) { return q->impl->wait(q->q); }
mt_status mti_queue_wait_first(mti_queue *q, int k) { return q->impl->wait_first(q->q, k); }
mt_status mti_queue_call(mti_queue *q, mti_queue_fn fn, void *user, int i, uint64_t *ticket)
{
    return q->impl->call(q->q, fn, user, i, ticket);
}
mt_status mti_queue_done(mti_queue *q, uint64_t ticket) { return q->impl->done(q->q, ticket); }
mt_status mti_queue_quiet(mti_queue *q, bool reset) { return q->impl->quiet(q->q, reset); }
void mti_queue_abandon(mti_queue *q) { q->impl->abandon(q->q); }

mt_status mti_queues_quiet(mt_context *ctx, const char *what)
{
    const mt_status s = mti_overlaps_quiet(ctx, what);
    return s ? s : mti_ncclovs_quiet(ctx, what);
}

mt_status mti_queues_take(mt_context *ctx) { return mti_overlaps_take(ctx); }
