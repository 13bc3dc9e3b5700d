/*
 * overlap.c - the communication thread (CPU path): one queue of
 * collectives per rank, run in order while the stepping thread computes.
 * Gradients go on it as backward makes them final: summed in buckets
 * (stage 0), or reduce-scattered to the slices' owners (stages 1 and 2, a
 * job the trainer gives); and calls a caller queues (stage 3's gathers of
 * the layers to come and its reduce-scatters, zero3.c).
 *
 * The thread runs the collectives blocking, through the context's staging
 * buffer (comm.c). A blocking call on a thread of its own is what keeps a
 * collective moving: Open MPI progresses a non-blocking collective only
 * inside MPI calls, so one started and left while backward computes would
 * not advance until backward ended.
 *
 * Every rank must make the same collectives in the same order. The queue
 * is that order: the stepping thread queues in its program order, which is
 * the same on every rank, and the thread runs the queue front to back. A
 * gradient given out of the fixed order is held until it can go in it: at
 * stages 0 and 1 the order gradients become final may differ between
 * ranks (a rank whose backward failed gives the rest at once, as zeros),
 * so a bucket is queued once all its tensors are given and every bucket
 * above it was queued, the last parameter first (about the order backward
 * makes them final, so little waiting is lost to it). At stage 2 a
 * gradient is queued as it is given (every rank gives them in one order).
 * A collective the stepping thread makes itself first waits until the
 * queue is empty (mti_overlap_quiet, from comm.c: ctx->comm->threads_q), so the
 * two threads never call the communicator, or use the staging buffer, at
 * once, and the collectives keep one order on every rank, as
 * memtrain/comm.h asks; the table must take calls from any thread
 * (MT_COMM_CAP_THREADS; MPI at MPI_THREAD_SERIALIZED or more).
 *
 * After something queued fails and the communicator is broken, what is
 * queued after it is dropped (its collectives not made) until a new round
 * begins or the failure is forgotten (mti_overlap_quiet with reset): a
 * broken communicator fails every later collective anyway. A failure of
 * this rank alone, the communicator whole (a copy or an update on the
 * thread that failed, after its collective), is held instead: what is
 * queued after it still runs, the waits report nothing, and the stepping
 * thread goes on as if nothing had failed, so this rank makes every
 * collective the others make, in their order, up to the step's status
 * exchange (dp.c), which takes the failure (mti_overlaps_take) and fails
 * the step on every rank at once, naming this rank. Stopping this rank at
 * the failure instead would leave the others in a collective it never
 * makes until their deadline.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/cplan.h"
#include "comm/overlap.h"

typedef struct job {
    int i;
    const char *name;
    float *g;
    size_t n;
    uint64_t ticket; /* the queue entry that carries it (0: not queued yet) */
    bool given;
} job;

/* An entry of the queue: a call, or a bucket of the round's tensors. */
typedef struct entry {
    mti_overlap_fn fn; /* NULL: the bucket of tensors hi down to lo */
    void *user;
    int hi, lo;
} entry;

/* Tensors are summed in buckets: runs of consecutive tensors (from the
 * last down) whose values fit in MTI_OVERLAP_BUCKET bytes together, a
 * tensor larger than it alone; one collective per bucket, so small tensors
 * do not each pay a collective's latency. The buckets come from the
 * tensors' sizes alone, so they are the same on every rank. With a job
 * (ZeRO-1) every tensor is a bucket of its own, given to the job. In
 * arrival order (ZeRO-2) the tensors go to the job in the order they are
 * given, each as it comes. */
struct mti_overlap {
    mt_context *ctx;
    mti_overlap_job job;
    void *user;
    bool fifo;         /* the round's tensors in the order given */
    int *order;        /* the round's tensors in the order given */
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t more, done; /* something was queued (or the end); something finished */
    job *slot;
    int *low;          /* per tensor: the lowest tensor of its bucket */
    job *bucket;       /* the thread's copy of the bucket it runs */
    int n;
    int next;          /* the highest tensor not queued yet this round; -1: none left */
    int given;         /* tensors given this round */
    int quit;
    /* the queue: a ring of cap entries; entries numbered from 1, `queued`
       of them so far, `finished` done (run, or dropped after a failure) */
    entry *ring;
    size_t cap;
    uint64_t queued, finished;
    mt_status failed;  /* the first failure that broke the communicator, its entry, its message */
    uint64_t failed_at;
    char msg[MTI_ERR_LEN];
    mt_status held;    /* the first failure of this rank alone (the communicator whole) */
    char held_msg[MTI_ERR_LEN];
    struct mti_overlap *next_on_ctx; /* the context's other queues (other trainers') */
};

mt_status (*mti_overlap_fault)(const mt_context *ctx, uint64_t entry);

bool mti_overlap_possible(const mt_context *ctx)
{
    const mt_comm *c = ctx->cfg.comm;
    return c && c->size > 1 && !ctx->dry && ctx->dev->kind == MT_DEVICE_CPU &&
           !(c->vt.caps & MT_COMM_CAP_DEVICE) && (c->vt.caps & MT_COMM_CAP_THREADS);
}

bool mti_overlap_planned(const mt_context *ctx)
{
    if (!ctx->dry) return mti_overlap_possible(ctx);
    return ctx->world > 1 && ctx->comm->threads && ctx->dev->kind == MT_DEVICE_CPU;
}

/* Sums a bucket (k tensors, its highest first) in one collective, or gives
 * its one tensor to the job. */
static mt_status run_bucket(mti_overlap *ov, const job *b, int k)
{
    float *p[k];
    size_t n[k];
    int used = 0;
    for (int j = 0; j < k; j++)
        if (b[j].n) p[used] = b[j].g, n[used++] = b[j].n;
    if (!used) return MT_OK;
    if (ov->job) return ov->job(ov->user, b[0].i, b[0].g);
    char what[200];
    snprintf(what, sizeof what, "the all-reduce of the gradients of %s%s%s (on the communication thread)",
             b[0].name, k > 1 ? " .. " : "", k > 1 ? b[k - 1].name : "");
    return mti_comm_all_reduce_pieces(ov->ctx, what, p, n, used);
}

static void *thread_main(void *p)
{
    mti_overlap *ov = p;
    mti_comm_on_thread(); /* its collectives are hidden behind the step, not waited for */
    pthread_mutex_lock(&ov->mu);
    for (;;) {
        while (!ov->quit && ov->finished == ov->queued) pthread_cond_wait(&ov->more, &ov->mu);
        if (ov->finished == ov->queued) break; /* (the end, the queue empty) */
        const entry e = ov->ring[ov->finished % ov->cap];
        int k = 0;
        if (!e.fn)
            for (int i = e.hi; i >= e.lo; i--) ov->bucket[k++] = ov->slot[i];
        const bool drop = ov->failed != MT_OK;
        pthread_mutex_unlock(&ov->mu);
        mt_status s = drop ? MT_OK : e.fn ? e.fn(e.user, e.hi) : run_bucket(ov, ov->bucket, k);
        if (!s && !drop && mti_overlap_fault && (s = mti_overlap_fault(ov->ctx, ov->finished + 1)))
            s = mti_fail(ov->ctx, s, "a failure injected after collective %llu of the queue",
                         (unsigned long long)(ov->finished + 1));
        const bool broken = s && mt_comm_broken(ov->ctx->cfg.comm);
        pthread_mutex_lock(&ov->mu);
        if (broken && !ov->failed) {
            ov->failed = s;
            ov->failed_at = ov->finished + 1;
            snprintf(ov->msg, sizeof ov->msg, "%s", mt_last_error(ov->ctx));
        } else if (s && !broken && !ov->held) { /* this rank's alone: held for the exchange */
            ov->held = s;
            snprintf(ov->held_msg, sizeof ov->held_msg, "on the communication thread: %.900s",
                     mt_last_error(ov->ctx));
        }
        ov->finished++;
        pthread_cond_broadcast(&ov->done);
    }
    pthread_mutex_unlock(&ov->mu);
    return NULL;
}

/* Queues e (the lock held): its number, or 0 when out of host memory. */
static uint64_t enqueue(mti_overlap *ov, entry e)
{
    const size_t pending = (size_t)(ov->queued - ov->finished);
    if (pending == ov->cap) { /* full: a ring twice the size, the pending entries in order */
        const size_t cap = 2 * ov->cap;
        entry *r = malloc(cap * sizeof *r);
        if (!r) return 0;
        for (uint64_t k = ov->finished; k < ov->queued; k++) r[k % cap] = ov->ring[k % ov->cap];
        free(ov->ring);
        ov->ring = r;
        ov->cap = cap;
    }
    ov->ring[ov->queued % ov->cap] = e;
    pthread_cond_signal(&ov->more);
    return ++ov->queued;
}

/* Waits (the lock held) until entry `upto` is done; the wait is exposed. */
static void wait_for(mti_overlap *ov, uint64_t upto)
{
    if (ov->finished >= upto) return;
    const uint64_t t0 = mti_now_ns();
    mti_comm_hurry(1);
    while (ov->finished < upto) pthread_cond_wait(&ov->done, &ov->mu);
    mti_comm_hurry(-1);
    mti_comm_waited(ov->ctx, mti_now_ns() - t0);
}

mt_status mti_overlaps_quiet(mt_context *ctx, const char *what)
{
    for (mti_overlap *q = ctx->comm->threads_q; q; q = q->next_on_ctx) {
        const mt_status s = mti_overlap_quiet(q, false, what);
        if (s) return s;
    }
    return MT_OK;
}

mt_status mti_overlaps_take(mt_context *ctx)
{
    mt_status s = MT_OK;
    char msg[MTI_ERR_LEN] = "";
    for (mti_overlap *q = ctx->comm->threads_q; q; q = q->next_on_ctx) {
        pthread_mutex_lock(&q->mu);
        wait_for(q, q->queued);
        if (q->held && !s) {
            s = q->held;
            snprintf(msg, sizeof msg, "%s", q->held_msg);
        }
        q->held = MT_OK;
        q->held_msg[0] = 0;
        pthread_mutex_unlock(&q->mu);
    }
    return s ? mti_fail(ctx, s, "%s", msg) : MT_OK;
}

mt_status mti_overlap_new(mt_context *ctx, int n, const size_t *numel, mti_overlap_job work,
                          void *user, bool fifo, mti_overlap **out)
{
    *out = NULL;
    const size_t cnt = (size_t)(n > 0 ? n : 1), cap = cnt + 64;
    mti_overlap *ov = calloc(1, sizeof *ov);
    job *slot = calloc(cnt, sizeof *slot), *bucket = calloc(cnt, sizeof *bucket);
    int *low = calloc(cnt, sizeof *low), *order = calloc(cnt, sizeof *order);
    entry *ring = calloc(cap, sizeof *ring);
    if (!ov || !slot || !bucket || !low || !order || !ring) {
        free(ov), free(slot), free(bucket), free(low), free(order), free(ring);
        return mti_fail(ctx, MT_ERR_OOM, "mt_trainer_create: out of host memory");
    }
    const size_t fit = work ? 0 : MTI_OVERLAP_BUCKET / sizeof(float);
    for (int hi = n - 1; hi >= 0;) { /* the buckets, from the last tensor down */
        int lo = hi;
        size_t sum = numel[hi];
        while (lo > 0 && sum + numel[lo - 1] <= fit) sum += numel[--lo];
        for (int i = lo; i <= hi; i++) low[i] = lo;
        hi = lo - 1;
    }
    for (int i = 0; i < n; i++) slot[i].n = numel[i], slot[i].i = i;
    ov->ctx = ctx;
    ov->job = work;
    ov->user = user;
    ov->fifo = fifo && work;
    ov->order = order;
    ov->slot = slot;
    ov->bucket = bucket;
    ov->low = low;
    ov->n = n;
    ov->next = -1;
    ov->ring = ring;
    ov->cap = cap;
    pthread_mutex_init(&ov->mu, NULL);
    pthread_cond_init(&ov->more, NULL);
    pthread_cond_init(&ov->done, NULL);
    if (pthread_create(&ov->th, NULL, thread_main, ov)) {
        pthread_cond_destroy(&ov->done);
        pthread_cond_destroy(&ov->more);
        pthread_mutex_destroy(&ov->mu);
        free(slot), free(bucket), free(low), free(order), free(ring), free(ov);
        return mti_fail(ctx, MT_ERR_OOM, "mt_trainer_create: cannot start the communication thread");
    }
    ov->next_on_ctx = ctx->comm->threads_q; /* every trainer's queue is waited for */
    ctx->comm->threads_q = ov;
    ctx->comm->quiet_threads = mti_overlaps_quiet;
    *out = ov;
    return MT_OK;
}

void mti_overlap_free(mti_overlap *ov)
{
    if (!ov) return;
    pthread_mutex_lock(&ov->mu);
    ov->quit = 1; /* (the thread ends once the queue is empty) */
    pthread_cond_signal(&ov->more);
    pthread_mutex_unlock(&ov->mu);
    pthread_join(ov->th, NULL);
    for (mti_overlap **q = &ov->ctx->comm->threads_q; *q; q = &(*q)->next_on_ctx)
        if (*q == ov) {
            *q = ov->next_on_ctx;
            break;
        }
    pthread_cond_destroy(&ov->done);
    pthread_cond_destroy(&ov->more);
    pthread_mutex_destroy(&ov->mu);
    free(ov->slot);
    free(ov->bucket);
    free(ov->low);
    free(ov->order);
    free(ov->ring);
    free(ov);
}

void mti_overlap_begin(mti_overlap *ov)
{
    pthread_mutex_lock(&ov->mu);
    wait_for(ov, ov->queued); /* (the last round waited for its own: nothing is left) */
    for (int i = 0; i < ov->n; i++) ov->slot[i].given = false, ov->slot[i].g = NULL, ov->slot[i].ticket = 0;
    ov->given = 0;
    ov->failed = MT_OK; /* (a failure has broken the communicator: the next fail at once) */
    ov->failed_at = 0;
    ov->msg[0] = 0;
    ov->next = ov->n - 1;
    pthread_mutex_unlock(&ov->mu);
}

/* Queues the buckets whose tensors are all given, from `next` down, and
 * every tensor given in fifo mode (the lock held). */
static mt_status queue_given(mti_overlap *ov, int i)
{
    if (ov->fifo) {
        if (!(ov->slot[i].ticket = enqueue(ov, (entry){.hi = i, .lo = i}))) return MT_ERR_OOM;
        return MT_OK;
    }
    while (ov->next >= 0) {
        const int hi = ov->next, lo = ov->low[hi];
        for (int j = hi; j >= lo; j--)
            if (!ov->slot[j].given) return MT_OK;
        const uint64_t t = enqueue(ov, (entry){.hi = hi, .lo = lo});
        if (!t) return MT_ERR_OOM;
        for (int j = hi; j >= lo; j--) ov->slot[j].ticket = t;
        ov->next = lo - 1;
    }
    return MT_OK;
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
    ov->order[ov->given++] = i;
    const mt_status s = queue_given(ov, i);
    pthread_mutex_unlock(&ov->mu);
    return s ? mti_fail(ov->ctx, s, "out of host memory queueing a collective") : MT_OK;
}

bool mti_overlap_pushed(const mti_overlap *ov, int i)
{
    pthread_mutex_lock((pthread_mutex_t *)&ov->mu);
    const bool g = ov->slot[i].given;
    pthread_mutex_unlock((pthread_mutex_t *)&ov->mu);
    return g;
}

/* Waits (the lock held, released here) until entry `upto` is done: MT_OK,
 * its failure or that of an entry before it (its own message), or with
 * `dropped` MT_ERR_COMM naming the earlier failure. */
static mt_status finish(mti_overlap *ov, uint64_t upto, bool dropped)
{
    wait_for(ov, upto);
    const bool hit = ov->failed && ov->failed_at <= upto;
    const bool own = !dropped || ov->failed_at == upto;
    const mt_status s = !hit ? MT_OK : own ? ov->failed : MT_ERR_COMM;
    char msg[MTI_ERR_LEN];
    if (own) snprintf(msg, sizeof msg, "%s", ov->msg);
    else snprintf(msg, sizeof msg, "an earlier collective on the communication thread failed: %.900s", ov->msg);
    pthread_mutex_unlock(&ov->mu);
    return s ? mti_fail(ov->ctx, s, "%s", msg) : MT_OK;
}

mt_status mti_overlap_wait(mti_overlap *ov)
{
    pthread_mutex_lock(&ov->mu);
    if (!ov->fifo && ov->given != ov->n) {
        pthread_mutex_unlock(&ov->mu);
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "%d of %d tensors given to the communication thread",
                        ov->given, ov->n);
    }
    return finish(ov, ov->queued, false);
}

mt_status mti_overlap_wait_first(mti_overlap *ov, int k)
{
    pthread_mutex_lock(&ov->mu);
    if (!ov->fifo || k < 1 || k > ov->given) {
        pthread_mutex_unlock(&ov->mu);
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "waiting for %d of the %d tensors given", k, ov->given);
    }
    return finish(ov, ov->slot[ov->order[k - 1]].ticket, false);
}

mt_status mti_overlap_call(mti_overlap *ov, mti_overlap_fn fn, void *user, int i, uint64_t *ticket)
{
    pthread_mutex_lock(&ov->mu);
    *ticket = enqueue(ov, (entry){.fn = fn, .user = user, .hi = i, .lo = i});
    pthread_mutex_unlock(&ov->mu);
    return *ticket ? MT_OK : mti_fail(ov->ctx, MT_ERR_OOM, "out of host memory queueing a collective");
}

mt_status mti_overlap_done(mti_overlap *ov, uint64_t ticket)
{
    pthread_mutex_lock(&ov->mu);
    return finish(ov, ticket, true);
}

mt_status mti_overlap_quiet(mti_overlap *ov, bool reset, const char *what)
{
    pthread_mutex_lock(&ov->mu);
    wait_for(ov, ov->queued);
    const mt_status s = reset ? MT_OK : ov->failed;
    char msg[MTI_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", ov->msg);
    if (reset) ov->failed = MT_OK, ov->failed_at = 0, ov->msg[0] = 0;
    pthread_mutex_unlock(&ov->mu);
    if (!s || !what) return s;
    return mti_fail(ov->ctx, s, "%s: an earlier collective on the communication thread failed: %.800s",
                    what, msg);
}
