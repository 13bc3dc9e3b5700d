/*
 * overlap.c - the gradients' all-reduce on a thread of its own (CPU path),
 * so a gradient's communication runs while backward computes the next.
 *
 * Backward gives each gradient as soon as it is final (mti_overlap_push)
 * and goes on; the thread runs the collectives blocking, through the
 * context's staging buffer (comm.c). A blocking call on a thread of its own
 * is what keeps a collective moving: Open MPI progresses a non-blocking
 * collective only inside MPI calls, so one started and left while backward
 * computes would not advance until backward ended.
 *
 * Every rank must make the same collectives in the same order, and the
 * order gradients become final may differ between ranks (a rank whose
 * backward failed gives the rest at once, as zeros), so the thread takes
 * the tensors in a fixed order, the last parameter first: the order
 * backward makes them final, about, so little waiting is lost to it.
 *
 * The communicator is the thread's alone while a step's collectives run
 * (the step's other collectives come before backward and after
 * mti_overlap_wait), so it is still used by one thread at a time, as
 * memtrain/comm.h asks; the table must take calls from any thread
 * (MT_COMM_CAP_THREADS; MPI at MPI_THREAD_SERIALIZED or more).
 *
 * The thread also runs calls queued in order (mti_overlap_call: ZeRO-3's
 * gathers of the layers to come, zero3.c), each once the calls before it
 * are done, in a step that gives it no gradients. Every rank queues the
 * same calls in the same order, so their collectives match; a collective
 * the stepping thread makes meanwhile first waits until the queue is empty
 * (mti_overlap_quiet, from comm.c), so the two threads never call the
 * communicator, or use the staging buffer, at once, and the collectives
 * keep one order on every rank.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/overlap.h"

typedef struct job {
    const char *name;
    float *g;
    size_t n;
    bool given;
} job;

typedef struct call {
    mti_overlap_fn fn;
    void *user;
    int i;
} call;

/* Tensors are summed in buckets: runs of consecutive tensors (from the
 * last down) whose values fit in the staging buffer together, a tensor
 * larger than it alone; one collective per bucket, so small tensors do not
 * each pay a collective's latency. The buckets come from the tensors'
 * sizes alone, so they are the same on every rank. */
struct mti_overlap {
    mt_context *ctx;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t more, done; /* a tensor was given (or the end); the step's are done */
    job *slot;
    int *low;          /* per tensor: the lowest tensor of its bucket */
    job *bucket;       /* the thread's copy of the bucket it sums */
    int n;
    int next;          /* the highest tensor not summed yet; -1: the step's are done */
    int given;         /* tensors given this step */
    int quit;
    mt_status failed;  /* the first failure; the later collectives are dropped */
    char msg[MTI_ERR_LEN];
    /* queued calls: a ring of cap; calls numbered from 1, `queued` of them
       so far, `finished` done (run, or dropped after a failure) */
    call *calls;
    size_t cap;
    uint64_t queued, finished;
    mt_status call_failed; /* the first failed call's status, its number, message */
    uint64_t failed_at;
    char call_msg[MTI_ERR_LEN];
};

bool mti_overlap_possible(const mt_context *ctx)
{
    const mt_comm *c = ctx->cfg.comm;
    return c && c->size > 1 && !ctx->dry && ctx->dev->kind == MT_DEVICE_CPU &&
           !(c->vt.caps & MT_COMM_CAP_DEVICE) && (c->vt.caps & MT_COMM_CAP_THREADS);
}

/* Sums a bucket (k jobs, its highest tensor first) in one collective. */
static void run(mti_overlap *ov, const job *b, int k)
{
    float *p[k];
    size_t n[k];
    int used = 0;
    for (int j = 0; j < k; j++)
        if (b[j].n) p[used] = b[j].g, n[used++] = b[j].n;
    if (!used) return;
    char what[200];
    snprintf(what, sizeof what, "the all-reduce of the gradients of %s%s%s (on the communication thread)",
             b[0].name, k > 1 ? " .. " : "", k > 1 ? b[k - 1].name : "");
    mt_status s = mti_comm_all_reduce_pieces(ov->ctx, what, p, n, used);
    if (!s) return;
    pthread_mutex_lock(&ov->mu);
    if (!ov->failed) {
        ov->failed = s;
        snprintf(ov->msg, sizeof ov->msg, "%s", mt_last_error(ov->ctx));
    }
    pthread_mutex_unlock(&ov->mu);
}

/* Whether every tensor of the next bucket was given. */
static bool bucket_given(const mti_overlap *ov)
{
    if (ov->next < 0) return false;
    for (int i = ov->next; i >= ov->low[ov->next]; i--)
        if (!ov->slot[i].given) return false;
    return true;
}

/* Runs the oldest queued call (the lock held on entry and on return). */
static void run_call(mti_overlap *ov)
{
    const call c = ov->calls[ov->finished % ov->cap];
    const bool drop = ov->call_failed != MT_OK;
    pthread_mutex_unlock(&ov->mu);
    const mt_status s = drop ? MT_OK : c.fn(c.user, c.i);
    pthread_mutex_lock(&ov->mu);
    if (s && !ov->call_failed) {
        ov->call_failed = s;
        ov->failed_at = ov->finished + 1;
        snprintf(ov->call_msg, sizeof ov->call_msg, "%s", mt_last_error(ov->ctx));
    }
    ov->finished++;
    pthread_cond_broadcast(&ov->done);
}

static void *thread_main(void *p)
{
    mti_overlap *ov = p;
    mti_comm_on_thread(); /* its collectives are hidden behind backward, not waited for */
    pthread_mutex_lock(&ov->mu);
    for (;;) {
        while (!ov->quit && !bucket_given(ov) && ov->finished == ov->queued)
            pthread_cond_wait(&ov->more, &ov->mu);
        if (ov->quit) break;
        if (ov->finished < ov->queued) {
            run_call(ov);
            continue;
        }
        const int hi = ov->next, lo = ov->low[hi];
        for (int i = hi; i >= lo; i--) ov->bucket[hi - i] = ov->slot[i];
        const bool drop = ov->failed != MT_OK;
        pthread_mutex_unlock(&ov->mu);
        if (!drop) run(ov, ov->bucket, hi - lo + 1);
        pthread_mutex_lock(&ov->mu);
        ov->next = lo - 1;
        if (ov->next < 0) pthread_cond_broadcast(&ov->done);
    }
    pthread_mutex_unlock(&ov->mu);
    return NULL;
}

mt_status mti_overlap_new(mt_context *ctx, int n, const size_t *numel, mti_overlap **out)
{
    *out = NULL;
    const size_t cnt = (size_t)(n > 0 ? n : 1);
    mti_overlap *ov = calloc(1, sizeof *ov);
    job *slot = calloc(cnt, sizeof *slot), *bucket = calloc(cnt, sizeof *bucket);
    int *low = calloc(cnt, sizeof *low);
    if (!ov || !slot || !bucket || !low) {
        free(ov), free(slot), free(bucket), free(low);
        return mti_fail(ctx, MT_ERR_OOM, "mt_trainer_create: out of host memory");
    }
    const size_t fit = MTI_COMM_STAGE / sizeof(float);
    for (int hi = n - 1; hi >= 0;) { /* the buckets, from the last tensor down */
        int lo = hi;
        size_t sum = numel[hi];
        while (lo > 0 && sum + numel[lo - 1] <= fit) sum += numel[--lo];
        for (int i = lo; i <= hi; i++) low[i] = lo;
        hi = lo - 1;
    }
    for (int i = 0; i < n; i++) slot[i].n = numel[i];
    ov->ctx = ctx;
    ov->slot = slot;
    ov->bucket = bucket;
    ov->low = low;
    ov->n = n;
    ov->next = -1;
    pthread_mutex_init(&ov->mu, NULL);
    pthread_cond_init(&ov->more, NULL);
    pthread_cond_init(&ov->done, NULL);
    if (pthread_create(&ov->th, NULL, thread_main, ov)) {
        pthread_cond_destroy(&ov->done);
        pthread_cond_destroy(&ov->more);
        pthread_mutex_destroy(&ov->mu);
        free(slot), free(bucket), free(low), free(ov);
        return mti_fail(ctx, MT_ERR_OOM, "mt_trainer_create: cannot start the communication thread");
    }
    *out = ov;
    return MT_OK;
}

void mti_overlap_free(mti_overlap *ov)
{
    if (!ov) return;
    pthread_mutex_lock(&ov->mu);
    ov->quit = 1;
    pthread_cond_signal(&ov->more);
    pthread_mutex_unlock(&ov->mu);
    pthread_join(ov->th, NULL);
    pthread_cond_destroy(&ov->done);
    pthread_cond_destroy(&ov->more);
    pthread_mutex_destroy(&ov->mu);
    free(ov->slot);
    free(ov->bucket);
    free(ov->low);
    free(ov->calls);
    free(ov);
}

void mti_overlap_begin(mti_overlap *ov)
{
    pthread_mutex_lock(&ov->mu);
    for (int i = 0; i < ov->n; i++) ov->slot[i].given = false, ov->slot[i].g = NULL;
    ov->given = 0;
    ov->next = ov->n - 1;
    pthread_mutex_unlock(&ov->mu);
}

mt_status mti_overlap_push(mti_overlap *ov, int i, const char *name, float *g)
{
    pthread_mutex_lock(&ov->mu);
    if (i < 0 || i >= ov->n || ov->slot[i].given) {
        pthread_mutex_unlock(&ov->mu);
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "tensor %d given twice to the communication thread", i);
    }
    ov->slot[i].name = name;
    ov->slot[i].g = g;
    ov->slot[i].given = true;
    ov->given++;
    pthread_cond_signal(&ov->more);
    pthread_mutex_unlock(&ov->mu);
    return MT_OK;
}

bool mti_overlap_pushed(const mti_overlap *ov, int i)
{
    pthread_mutex_lock((pthread_mutex_t *)&ov->mu);
    const bool g = ov->slot[i].given;
    pthread_mutex_unlock((pthread_mutex_t *)&ov->mu);
    return g;
}

mt_status mti_overlap_wait(mti_overlap *ov)
{
    const uint64_t t0 = mti_now_ns();
    pthread_mutex_lock(&ov->mu);
    if (ov->given != ov->n) {
        pthread_mutex_unlock(&ov->mu);
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "%d of %d tensors given to the communication thread",
                        ov->given, ov->n);
    }
    mti_comm_hurry(1);
    while (ov->next >= 0) pthread_cond_wait(&ov->done, &ov->mu);
    mti_comm_hurry(-1);
    mti_comm_waited(ov->ctx, mti_now_ns() - t0);
    const mt_status s = ov->failed;
    char msg[MTI_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", ov->msg);
    pthread_mutex_unlock(&ov->mu);
    return s ? mti_fail(ov->ctx, s, "%s", msg) : MT_OK;
}

mt_status mti_overlap_call(mti_overlap *ov, mti_overlap_fn fn, void *user, int i, uint64_t *ticket)
{
    pthread_mutex_lock(&ov->mu);
    const size_t pending = (size_t)(ov->queued - ov->finished);
    if (pending == ov->cap) { /* full: a ring twice the size, the pending calls in order */
        const size_t cap = ov->cap ? 2 * ov->cap : 64;
        call *c = malloc(cap * sizeof *c);
        if (!c) {
            pthread_mutex_unlock(&ov->mu);
            return mti_fail(ov->ctx, MT_ERR_OOM, "out of host memory queueing a collective");
        }
        for (size_t k = 0; k < pending; k++) c[(ov->finished + k) % cap] = ov->calls[(ov->finished + k) % ov->cap];
        free(ov->calls);
        ov->calls = c;
        ov->cap = cap;
    }
    ov->calls[ov->queued % ov->cap] = (call){fn, user, i};
    *ticket = ++ov->queued;
    pthread_cond_signal(&ov->more);
    pthread_mutex_unlock(&ov->mu);
    return MT_OK;
}

/* Waits (the lock held) until call `upto` is done; the wait is exposed. */
static void wait_calls(mti_overlap *ov, uint64_t upto)
{
    if (ov->finished >= upto) return;
    const uint64_t t0 = mti_now_ns();
    mti_comm_hurry(1);
    while (ov->finished < upto) pthread_cond_wait(&ov->done, &ov->mu);
    mti_comm_hurry(-1);
    mti_comm_waited(ov->ctx, mti_now_ns() - t0);
}

mt_status mti_overlap_done(mti_overlap *ov, uint64_t ticket)
{
    pthread_mutex_lock(&ov->mu);
    wait_calls(ov, ticket);
    /* (a call after a failed one was dropped; one before it ran) */
    const bool hit = ov->call_failed && ov->failed_at <= ticket;
    const mt_status s = !hit ? MT_OK : ov->failed_at == ticket ? ov->call_failed : MT_ERR_COMM;
    char msg[MTI_ERR_LEN];
    if (hit && ov->failed_at == ticket) snprintf(msg, sizeof msg, "%s", ov->call_msg);
    else snprintf(msg, sizeof msg, "an earlier collective on the communication thread failed: %.900s",
                  ov->call_msg);
    pthread_mutex_unlock(&ov->mu);
    return s ? mti_fail(ov->ctx, s, "%s", msg) : MT_OK;
}

mt_status mti_overlap_quiet(mti_overlap *ov, bool reset, const char *what)
{
    pthread_mutex_lock(&ov->mu);
    wait_calls(ov, ov->queued);
    const mt_status s = reset ? MT_OK : ov->call_failed;
    char msg[MTI_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", ov->call_msg);
    if (reset) ov->call_failed = MT_OK, ov->failed_at = 0, ov->call_msg[0] = 0;
    pthread_mutex_unlock(&ov->mu);
    if (!s || !what) return s;
    return mti_fail(ov->ctx, s, "%s: an earlier collective on the communication thread failed: %.800s",
                    what, msg);
}
