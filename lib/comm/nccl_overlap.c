/*
 * nccl_overlap.c - the gradients' collectives on a communication stream,
 * the overlap of a CUDA context with the NCCL communicator (the CPU path's
 * thread is comm/overlap.c).
 *
 * NCCL queues a collective on a stream and returns; the GPU runs it when
 * the stream gets to it. So no thread is needed here, only a second
 * stream: as backward makes a gradient final (written by kernels on the
 * device's stream), an event is recorded on the device's stream, the
 * communication stream is made to wait for it (cuStreamWaitEvent), and
 * the gradient's all-reduce (fp32, sum, in place) is queued there, between
 * two timing events. Backward goes on queueing kernels on the device's
 * stream, which the GPU runs beside the collective. When backward ends,
 * the step waits on the host for the communication stream, polling it up
 * to the communicator's deadline as a blocking collective does (a rank
 * that died or stalled: the communicator is aborted, MT_ERR_COMM), and
 * makes the device's stream wait for it with an event, so the fp16 check,
 * the norm and the update read the sums.
 *
 * The same collectives as the blocking step's, in an order every rank
 * shares: one all-reduce per tensor in place, as the blocking step makes
 * after backward (packing small tensors into buckets, as the CPU thread
 * does, would change how NCCL splits the data into chunks and so the
 * order it adds the ranks' values in; one per tensor keeps the sums the
 * blocking step's, bit for bit), queued from the last tensor down, a
 * tensor once it and every tensor above it are given, whatever order
 * backward gave them in.
 *
 * Jobs and calls. Instead of the sum, a job (ZeRO-2's reduce-scatter, the
 * fused step's collective) runs for each tensor as it is given (fifo, in
 * backward's order), or a call for a caller (ZeRO-3's gathers and
 * reduce-scatters, zero3.c): it makes its collectives through the usual
 * mti_comm_* calls while nccl.c posts them (mti_nccl_post_begin): each goes
 * on the communication stream behind an event of the device's stream (the
 * fence: the job's packing, and the kernels that may still use memory it
 * was just given, come first) and is not waited for. The caller waits for
 * the oldest (mti_ncclov_wait_first, mti_ncclov_done): the host polls the
 * event recorded after it against the deadline, then the device's stream
 * waits for the same event, so what follows on the GPU reads the results
 * and a block may be freed. A collective on the device's stream first
 * waits for every communication stream of the context (mti_ncclovs_quiet,
 * from comm.c), so a communicator's work is never on two streams at once.
 *
 * Memory: nothing is allocated here. At stages 0 and 1 every gradient
 * stays where it is until the update, after the wait (whole gradients are
 * kept until then anyway), so nothing the communication stream still
 * reads is ever freed or reused: the peaks and the estimate are the
 * blocking step's. What a job or call uses the caller keeps until it is
 * waited for, at points that do not depend on timing (the estimate's dry
 * run keeps the same). Memory going back to the driver (cuMemFree and
 * cuMemUnmap wait for the whole device, without a deadline) first waits
 * for the streams here, against the deadline (the device's release guard,
 * at the end of this file).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/cplan.h"
#include "comm/nccl_overlap.h"
#include "device/cuda_device.h"

/* Calls in flight at most: one more first waits for the oldest. */
#define CALLS 64

static bool release_guard(void *arg);
static bool stream_idle(mti_ncclov *ov);

typedef struct tensor {
    float *g;
    const char *name;
    size_t n;
    bool given;
} tensor;

struct mti_ncclov {
    mt_context *ctx;
    mt_comm *comm;
    void *stream;   /* the communication stream */
    void *ready;    /* recorded on the device's stream when gradients are final */
    void *done;     /* recorded on the communication stream at the wait */
    void *idle;     /* recorded on it before device memory goes back (release_guard) */
    void **timing;  /* 2 per tensor: before and after its collective (timed) */
    tensor *t;
    int n;
    int next;       /* the highest tensor not queued yet; -1: none left */
    int given;
    mti_ncclov_job job; /* NULL: each tensor summed in place */
    void *user;
    int *order;     /* the round's tensors in the order queued */
    int n_queued;
    int waited;     /* the first `waited` of them waited for */
    bool pending;   /* work queued since the stream was last waited for */
    /* calls (mti_ncclov_call): tickets from 1, `issued` of them, the first
       `reached` waited for; each with a start and an end event (timed) at
       ticket % CALLS, the first failure's ticket */
    void *cev[2 * CALLS];
    uint64_t issued, reached, failed_at;
    mt_status failed;
    char msg[MTI_ERR_LEN];
    struct mti_ncclov *next_on_ctx; /* the context's other streams (other trainers') */
};

bool mti_ncclov_possible(const mt_context *ctx)
{
    const mt_comm *c = ctx->cfg.comm;
    const char *env = getenv("MT_NCCL_OVERLAP");
    if (env && !strcmp(env, "0")) return false;
    return c && c->size > 1 && !ctx->dry && ctx->dev->kind == MT_DEVICE_CUDA && ctx->comm->nccl;
}

bool mti_ncclov_planned(const mt_context *ctx)
{
    if (!ctx->dry) return mti_ncclov_possible(ctx);
    const char *env = getenv("MT_NCCL_OVERLAP");
    if (env && !strcmp(env, "0")) return false;
    return ctx->world > 1 && ctx->dev->kind == MT_DEVICE_CUDA && ctx->comm->nccl;
}

mt_status mti_ncclov_new(mt_context *ctx, int n, const size_t *numel, mti_ncclov_job job, void *user,
                         mti_ncclov **out)
{
    *out = NULL;
    mti_ncclov *ov = calloc(1, sizeof *ov);
    tensor *t = calloc((size_t)(n > 0 ? n : 1), sizeof *t);
    void **timing = calloc(2 * (size_t)(n > 0 ? n : 1), sizeof *timing);
    int *order = calloc((size_t)(n > 0 ? n : 1), sizeof *order);
    if (!ov || !t || !timing || !order) {
        free(ov), free(t), free(timing), free(order);
        return mti_fail(ctx, MT_ERR_OOM, "mt_trainer_create: out of host memory");
    }
    ov->job = job;
    ov->user = user;
    ov->order = order;
    ov->ctx = ctx;
    ov->comm = ctx->cfg.comm;
    ov->t = t;
    ov->timing = timing;
    ov->n = n;
    ov->next = -1;
    for (int i = 0; i < n; i++) t[i].n = numel[i];
    mti_device *d = ctx->dev;
    mt_status s = mti_cuda_stream_new(d, &ov->stream);
    if (!s) s = mti_cuda_event_new(d, &ov->ready);
    if (!s) s = mti_cuda_event_new(d, &ov->done);
    if (!s) s = mti_cuda_event_new(d, &ov->idle);
    for (int k = 0; k < 2 * n && !s; k++)
        if (numel[k / 2]) s = mti_cuda_event_new_timed(d, &timing[k]);
    for (int k = 0; k < 2 * CALLS && !s; k++) s = mti_cuda_event_new_timed(d, &ov->cev[k]);
    if (s) {
        mti_msg msg = mti_last_msg(ctx);
        mti_ncclov_free(ov);
        return mti_fail(ctx, s, "mt_trainer_create: the communication stream: %s", msg.s);
    }
    ov->next_on_ctx = ctx->comm->streams_q; /* (waited for by the context's other collectives) */
    ctx->comm->streams_q = ov;
    ctx->comm->quiet_streams = mti_ncclovs_quiet;
    d->release_guard = release_guard; /* (and before memory goes back to the driver) */
    d->release_guard_arg = ctx;
    *out = ov;
    return MT_OK;
}

void mti_ncclov_free(mti_ncclov *ov)
{
    if (!ov) return;
    mti_device *d = ov->ctx->dev;
    /* the memory its work may still use goes back to the driver later, so
       that work ends first (up to the deadline); if it does not, nothing
       is given back from now on */
    if (ov->stream && ov->idle && !stream_idle(ov)) d->release_held = true;
    for (mti_ncclov **q = &ov->ctx->comm->streams_q; *q; q = &(*q)->next_on_ctx)
        if (*q == ov) {
            *q = ov->next_on_ctx;
            break;
        }
    if (!ov->ctx->comm->streams_q && d->release_guard == release_guard) {
        d->release_guard = NULL;
        d->release_guard_arg = NULL;
    }
    for (int k = 0; k < 2 * ov->n; k++) mti_cuda_event_free(d, ov->timing[k]);
    for (int k = 0; k < 2 * CALLS; k++) mti_cuda_event_free(d, ov->cev[k]);
    mti_cuda_event_free(d, ov->ready);
    mti_cuda_event_free(d, ov->done);
    mti_cuda_event_free(d, ov->idle);
    mti_cuda_stream_free(d, ov->stream);
    free(ov->timing);
    free(ov->order);
    free(ov->t);
    free(ov);
}

void mti_ncclov_begin(mti_ncclov *ov)
{
    for (int i = 0; i < ov->n; i++) ov->t[i].given = false, ov->t[i].g = NULL;
    ov->next = ov->n - 1;
    while (ov->next >= 0 && !ov->t[ov->next].n) ov->next--; /* (see mti_ncclov_push) */
    ov->given = 0;
    ov->n_queued = ov->waited = 0;
    ov->failed = MT_OK;
    ov->msg[0] = 0;
}

/* The first failure of the round, its message kept for the wait. Whatever
 * failed (a collective, or here: an event, a fence, a job's packing), the
 * collectives this rank has queued may still read and write buffers the
 * caller frees once told, its waits are skipped from now on, and the
 * others' collectives wait for ones this rank no longer queues: so the
 * communicator is aborted at once, before anything is freed, which ends
 * the queued work on every rank (theirs with MT_ERR_COMM well before
 * their deadline, and none of this rank's later collectives can meet
 * their stale ones). The round fails with MT_ERR_COMM. */
static void failed(mti_ncclov *ov, mt_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void failed(mti_ncclov *ov, mt_status s, const char *fmt, ...)
{
    if (ov->failed) return;
    mti_nccl_abort(ov->comm);
    ov->failed = MT_ERR_COMM;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(ov->msg, sizeof ov->msg, fmt, ap);
    va_end(ap);
    if (s != MT_ERR_COMM && k >= 0 && (size_t)k < sizeof ov->msg)
        snprintf(ov->msg + k, sizeof ov->msg - (size_t)k, " (on this rank, beside the communication "
                 "stream: the NCCL communicator was aborted)");
    char why[sizeof ov->msg + 64];
    snprintf(why, sizeof why, "%s (rank %d of %d)", ov->msg, ov->comm->rank, ov->comm->size);
    mti_comm_break(ov->comm, atomic_load(&ov->ctx->comm->step), why);
}

/* The fence before each collective a job posts: the communication stream
 * waits for what the device's stream has queued so far (the job's packing
 * included). */
static void fence(void *arg)
{
    mti_ncclov *ov = arg;
    mti_device *d = ov->ctx->dev;
    mt_status s = ov->failed ? MT_OK : mti_cuda_record(d, ov->ready, NULL);
    if (!s && !ov->failed) s = mti_cuda_stream_wait(d, ov->stream, ov->ready);
    if (s) failed(ov, s, "%s", mti_last_msg(ov->ctx).s);
}

/* Queues tensor i's sum (or the job's collectives) on the communication
 * stream (it already waits for the gradients given so far). */
static void queue(mti_ncclov *ov, int i)
{
    tensor *x = &ov->t[i];
    mti_device *d = ov->ctx->dev;
    if (!x->n || ov->failed) return;
    if (!x->g && !ov->job) {
        /* no buffer to sum: the others' collective cannot be met, so end
           it for them at once rather than at their deadline */
        failed(ov, MT_ERR_COMM, "the all-reduce of the gradients of %s: no gradient to sum (the "
               "NCCL communicator was aborted)", x->name ? x->name : "?");
        return;
    }
    if (ov->job) fence(ov); /* (its time on the stream starts after backward's kernels) */
    mt_status s = ov->failed ? ov->failed : mti_cuda_record(d, ov->timing[2 * i], ov->stream);
    if (s) {
        failed(ov, s, "%s", mti_last_msg(ov->ctx).s);
        return;
    }
    s = mti_cuda_enter(d); /* (NCCL queues on the current context's stream) */
    if (!s && ov->job) {
        mti_nccl_post_begin(ov->stream, fence, ov);
        s = ov->job(ov->user, i, x->g);
        mti_nccl_post_end();
        mti_cuda_leave(d);
        if (s) {
            failed(ov, s, "%s", mti_last_msg(ov->ctx).s);
            return;
        }
    } else if (!s) {
        s = mti_nccl_post_sum(ov->comm, x->g, x->n, ov->stream);
        mti_cuda_leave(d);
        if (s) {
            const char *why = ov->comm->vt.last_error ? ov->comm->vt.last_error(ov->comm->self) : "";
            failed(ov, MT_ERR_COMM, "the all-reduce of the gradients of %s (on the communication "
                   "stream): %s", x->name, why);
            return;
        }
        atomic_fetch_add(&ov->ctx->comm->calls, 1);
    }
    if (!s) s = mti_cuda_record(d, ov->timing[2 * i + 1], ov->stream);
    if (s) {
        failed(ov, s, "%s", mti_last_msg(ov->ctx).s);
        return;
    }
    ov->order[ov->n_queued++] = i;
    ov->pending = true;
}

mt_status mti_ncclov_push(mti_ncclov *ov, int i, const char *name, float *g)
{
    if (i < 0 || i >= ov->n || ov->t[i].given)
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "tensor %d given twice to the communication stream", i);
    tensor *x = &ov->t[i];
    x->g = g;
    x->name = name;
    x->given = true;
    ov->given++;
    if (ov->job) { /* (queued as given; the job fences each collective itself) */
        queue(ov, i);
        return MT_OK;
    }
    if (ov->next != i) return MT_OK; /* (it waits for the tensors above it) */
    /* the gradients given so far are written: the stream waits for that */
    fence(ov);
    /* a tensor with nothing to sum (frozen: backward never gives it, the
       step's end does) holds back none of those below it */
    while (ov->next >= 0 && (ov->t[ov->next].given || !ov->t[ov->next].n)) queue(ov, ov->next--);
    return MT_OK;
}

bool mti_ncclov_pushed(const mti_ncclov *ov, int i) { return ov->t[i].given; }

typedef struct event_of {
    mti_device *d;
    void *ev;
} event_of;

static int event_done(void *arg, int *cu)
{
    const event_of *a = arg;
    bool done = false;
    *cu = 0;
    if (mti_cuda_event_done(a->d, a->ev, &done)) return *cu = -1, -1;
    return done ? 1 : 0;
}

/* Waits on the host, up to the communicator's deadline, until the first k
 * tensors queued this round (every one: all the stream holds) are done
 * (the exposed communication), then makes the device's stream wait for
 * them too, and adds their time on the stream to the context's. */
static mt_status settle(mti_ncclov *ov, int k)
{
    mt_context *ctx = ov->ctx;
    mti_device *d = ctx->dev;
    mt_comm *c = ov->comm;
    const bool all = k >= ov->n_queued;
    if (all) k = ov->n_queued;
    const char *what = ov->job ? "the collectives of the gradients (on the communication stream)"
                               : "the all-reduce of the gradients (on the communication stream)";
    const uint64_t t0 = mti_now_ns();
    mt_status s = MT_OK;
    if (!ov->failed && ov->pending && k > ov->waited) {
        s = mti_cuda_enter(d);
        if (!s) {
            event_of a = {d, k ? ov->timing[2 * ov->order[k - 1] + 1] : NULL};
            s = all ? mti_nccl_wait(c, what, ov->stream) : mti_nccl_wait_until(c, what, event_done, &a);
            mti_cuda_leave(d);
            if (s) {
                failed(ov, MT_ERR_COMM, "%s", c->vt.last_error ? c->vt.last_error(c->self) : what);
            }
        }
    }
    mti_comm_waited(ctx, mti_now_ns() - t0);
    if (ov->failed) {
        ov->pending = false; /* (reported here; the next round starts afresh) */
        return mti_fail(ctx, ov->failed, "%s (nccl, rank %d of %d)", ov->msg, c->rank, c->size);
    }
    if (k <= ov->waited) return MT_OK;
    /* the results are there: the device's stream waits for them too */
    if (all) {
        s = mti_cuda_record(d, ov->done, ov->stream);
        if (!s) s = mti_cuda_stream_wait(d, NULL, ov->done);
        ov->pending = false;
    } else {
        s = mti_cuda_stream_wait(d, NULL, ov->timing[2 * ov->order[k - 1] + 1]);
    }
    /* what the collectives took on the stream, waits for backward left out */
    uint64_t ns = 0;
    for (int j = ov->waited; j < k && !s; j++) {
        const int i = ov->order[j];
        float ms = 0.0f;
        s = mti_cuda_elapsed(d, ov->timing[2 * i], ov->timing[2 * i + 1], &ms);
        if (!s && ms > 0.0f) ns += (uint64_t)((double)ms * 1e6);
    }
    atomic_fetch_add(&ctx->comm->ns, ns);
    ov->waited = k;
    return s;
}

mt_status mti_ncclov_wait(mti_ncclov *ov)
{
    if (!ov->job && ov->given != ov->n)
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "%d of %d tensors given to the communication stream",
                        ov->given, ov->n);
    return settle(ov, ov->n);
}

mt_status mti_ncclov_wait_first(mti_ncclov *ov, int k)
{
    if (!ov->job || k < 1 || k > ov->given)
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "waiting for %d of the %d tensors given", k, ov->given);
    return settle(ov, k);
}

/* ---- calls ---- */

/* Waits on the host, up to the deadline, for the calls up to ticket upto,
 * then makes the device's stream wait for them too and counts their time:
 * MT_OK, or the failure of one of them (its own message) or of an earlier
 * one ("an earlier collective ... failed"). */
static mt_status reach(mti_ncclov *ov, uint64_t upto)
{
    mt_context *ctx = ov->ctx;
    mti_device *d = ctx->dev;
    mt_comm *c = ov->comm;
    if (upto > ov->issued) upto = ov->issued;
    const uint64_t t0 = mti_now_ns();
    const char *what = "a collective on the communication stream";
    void *end = ov->cev[2 * (upto % CALLS) + 1];
    mt_status s = MT_OK;
    if ((!ov->failed || ov->failed_at > upto) && upto > ov->reached) {
        s = mti_cuda_enter(d);
        if (!s) {
            event_of a = {d, end};
            s = mti_nccl_wait_until(c, what, event_done, &a);
            mti_cuda_leave(d);
            if (s) {
                failed(ov, MT_ERR_COMM, "%s", c->vt.last_error ? c->vt.last_error(c->self) : what);
                if (!ov->failed_at || ov->failed_at > ov->reached + 1) ov->failed_at = ov->reached + 1;
            }
        }
    }
    mti_comm_waited(ctx, mti_now_ns() - t0);
    if (ov->failed && ov->failed_at <= upto) {
        if (ov->reached < upto) ov->reached = upto; /* (the rest dropped) */
        return mti_fail(ctx, ov->failed_at == upto ? ov->failed : MT_ERR_COMM,
                        "%s%s (nccl, rank %d of %d)",
                        ov->failed_at == upto ? "" : "an earlier collective on the communication "
                                                     "stream failed: ",
                        ov->msg, c->rank, c->size);
    }
    if (upto <= ov->reached) return MT_OK;
    s = mti_cuda_stream_wait(d, NULL, end);
    uint64_t ns = 0;
    for (uint64_t k = ov->reached + 1; k <= upto && !s; k++) {
        float ms = 0.0f;
        s = mti_cuda_elapsed(d, ov->cev[2 * (k % CALLS)], ov->cev[2 * (k % CALLS) + 1], &ms);
        if (!s && ms > 0.0f) ns += (uint64_t)((double)ms * 1e6);
    }
    atomic_fetch_add(&ctx->comm->ns, ns);
    ov->reached = upto;
    return s;
}

mt_status mti_ncclov_call(mti_ncclov *ov, mti_ncclov_fn fn, void *user, int i, uint64_t *ticket)
{
    mti_device *d = ov->ctx->dev;
    *ticket = 0;
    mt_status s = ov->issued - ov->reached >= CALLS ? reach(ov, ov->issued + 1 - CALLS) : MT_OK;
    const uint64_t k = ++ov->issued;
    *ticket = k;
    if (ov->failed) {
        if (!ov->failed_at) ov->failed_at = k;
        return MT_OK; /* (dropped: its wait says so) */
    }
    (void)s; /* (a failure there is the ticket's too) */
    fence(ov);
    s = ov->failed ? MT_OK : mti_cuda_record(d, ov->cev[2 * (k % CALLS)], ov->stream);
    if (!s && !ov->failed) s = mti_cuda_enter(d);
    if (!s && !ov->failed) {
        mti_nccl_post_begin(ov->stream, fence, ov);
        s = fn(user, i);
        mti_nccl_post_end();
        mti_cuda_leave(d);
    }
    if (!s && !ov->failed) s = mti_cuda_record(d, ov->cev[2 * (k % CALLS) + 1], ov->stream);
    if (s) failed(ov, s, "%s", mti_last_msg(ov->ctx).s);
    if (ov->failed && !ov->failed_at) ov->failed_at = k;
    return MT_OK;
}

mt_status mti_ncclov_done(mti_ncclov *ov, uint64_t ticket) { return reach(ov, ticket); }

mt_status mti_ncclov_quiet(mti_ncclov *ov, bool reset)
{
    mt_status s = reach(ov, ov->issued);
    if (reset) ov->failed = MT_OK, ov->failed_at = 0, ov->msg[0] = 0, s = MT_OK;
    return s;
}

void mti_ncclov_abandon(mti_ncclov *ov)
{
    failed(ov, MT_ERR_COMM, "this rank stopped part-way through its step's collectives on the "
           "communication stream (the NCCL communicator was aborted)");
}

mt_status mti_ncclovs_quiet(mt_context *ctx, const char *what)
{
    if (mti_comm_posting()) return MT_OK; /* (a job's own collectives) */
    for (mti_ncclov *q = ctx->comm->streams_q; q; q = q->next_on_ctx) {
        if (!q->pending && q->reached == q->issued) continue;
        mt_status s = q->pending ? settle(q, q->n) : MT_OK;
        if (!s) s = reach(q, q->issued);
        if (s && what)
            return mti_fail(ctx, s, "%s: an earlier collective on the communication stream failed: %.800s",
                            what, mti_last_msg(ctx).s);
        if (s) return s;
    }
    return MT_OK;
}

/* ---- before device memory goes back to the driver ---- */

/* Whether the work queued on ov's stream so far has ended: an event
 * recorded behind it, waited for on the host up to the communicator's
 * deadline (not at all once the communicator is aborted). At the deadline
 * the round fails as a collective's wait does (MT_ERR_COMM, the
 * communicator aborted, which ends NCCL's kernels) and the event is asked
 * once more: false if the work is still there. Nothing queued since the
 * stream was last waited for, on a communicator never broken: true at
 * once. */
static bool stream_idle(mti_ncclov *ov)
{
    mt_comm *c = ov->comm;
    if (!ov->pending && ov->reached == ov->issued && !atomic_load(&c->broken)) return true;
    mti_device *d = ov->ctx->dev;
    event_of a = {d, ov->idle};
    int cu = 0;
    if (mti_cuda_record(d, ov->idle, ov->stream) != MT_OK) return false; /* (unknown: kept) */
    if (event_done(&a, &cu) > 0) return true;
    const char *what = "before device memory goes back to the driver, the collectives on the "
                       "communication stream";
    mt_status s = mti_cuda_enter(d);
    if (!s) {
        s = mti_nccl_wait_until(c, what, event_done, &a);
        mti_cuda_leave(d);
    }
    if (!s) return true;
    const char *why = c->vt.last_error ? c->vt.last_error(c->self) : what;
    mti_log(ov->ctx, MT_LOG_ERROR, "%s (nccl, rank %d of %d)", why, c->rank, c->size);
    failed(ov, MT_ERR_COMM, "%s", why);
    return event_done(&a, &cu) > 0;
}

/* The device's release guard on a context with communication streams:
 * every stream's work so far ended (each waited for in turn). */
static bool release_guard(void *arg)
{
    mt_context *ctx = arg;
    bool ok = true;
    for (mti_ncclov *q = ctx->comm->streams_q; q; q = q->next_on_ctx) ok = stream_idle(q) && ok;
    return ok;
}
