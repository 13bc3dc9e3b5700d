/*
 * overlap.c - the gradients' all-reduce on a thread of its own (CPU path),
 * so a gradient's communication runs while backward computes the next;
 * at ZeRO stage 1 their reduce-scatter to the slices' owners (a job the
 * trainer gives).
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
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/overlap.h"

typedef struct job {
    int i;
    const char *name;
    float *g;
    size_t n;
    bool given;
} job;

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
    bool fifo;         /* in the order given (order[], taken up to `taken`) */
    int *order;
    int taken;
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
};

bool mti_overlap_possible(const mt_context *ctx)
{
    const mt_comm *c = ctx->cfg.comm;
    return c && c->size > 1 && !ctx->dry && ctx->dev->kind == MT_DEVICE_CPU &&
           !(c->vt.caps & MT_COMM_CAP_DEVICE) && (c->vt.caps & MT_COMM_CAP_THREADS);
}

bool mti_overlap_planned(const mt_context *ctx)
{
    if (!ctx->dry) return mti_overlap_possible(ctx);
    return ctx->world > 1 && ctx->comm_threads && ctx->dev->kind == MT_DEVICE_CPU;
}

/* Sums a bucket (k jobs, its highest tensor first) in one collective, or
 * gives its one tensor to the job. */
static void run(mti_overlap *ov, const job *b, int k)
{
    float *p[k];
    size_t n[k];
    int used = 0;
    for (int j = 0; j < k; j++)
        if (b[j].n) p[used] = b[j].g, n[used++] = b[j].n;
    if (!used) return;
    mt_status s;
    if (ov->job) {
        s = ov->job(ov->user, b[0].i, b[0].g);
    } else {
        char what[200];
        snprintf(what, sizeof what,
                 "the all-reduce of the gradients of %s%s%s (on the communication thread)", b[0].name,
                 k > 1 ? " .. " : "", k > 1 ? b[k - 1].name : "");
        s = mti_comm_all_reduce_pieces(ov->ctx, what, p, n, used);
    }
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
    if (ov->fifo) return ov->taken < ov->given;
    if (ov->next < 0) return false;
    for (int i = ov->next; i >= ov->low[ov->next]; i--)
        if (!ov->slot[i].given) return false;
    return true;
}

static void *thread_main(void *p)
{
    mti_overlap *ov = p;
    mti_comm_on_thread(); /* its collectives are hidden behind backward, not waited for */
    pthread_mutex_lock(&ov->mu);
    for (;;) {
        while (!ov->quit && !bucket_given(ov)) pthread_cond_wait(&ov->more, &ov->mu);
        if (ov->quit) break;
        if (ov->fifo) { /* the next in arrival order, alone */
            ov->bucket[0] = ov->slot[ov->order[ov->taken]];
            const bool skip = ov->failed != MT_OK;
            pthread_mutex_unlock(&ov->mu);
            if (!skip) run(ov, ov->bucket, 1);
            pthread_mutex_lock(&ov->mu);
            ov->taken++;
            pthread_cond_broadcast(&ov->done);
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

mt_status mti_overlap_new(mt_context *ctx, int n, const size_t *numel, mti_overlap_job work,
                          void *user, bool fifo, mti_overlap **out)
{
    *out = NULL;
    const size_t cnt = (size_t)(n > 0 ? n : 1);
    mti_overlap *ov = calloc(1, sizeof *ov);
    job *slot = calloc(cnt, sizeof *slot), *bucket = calloc(cnt, sizeof *bucket);
    int *low = calloc(cnt, sizeof *low), *order = calloc(cnt, sizeof *order);
    if (!ov || !slot || !bucket || !low || !order) {
        free(ov), free(slot), free(bucket), free(low), free(order);
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
    pthread_mutex_init(&ov->mu, NULL);
    pthread_cond_init(&ov->more, NULL);
    pthread_cond_init(&ov->done, NULL);
    if (pthread_create(&ov->th, NULL, thread_main, ov)) {
        pthread_cond_destroy(&ov->done);
        pthread_cond_destroy(&ov->more);
        pthread_mutex_destroy(&ov->mu);
        free(slot), free(bucket), free(low), free(order), free(ov);
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
    free(ov->order);
    free(ov);
}

void mti_overlap_begin(mti_overlap *ov)
{
    pthread_mutex_lock(&ov->mu);
    for (int i = 0; i < ov->n; i++) ov->slot[i].given = false, ov->slot[i].g = NULL;
    ov->given = 0;
    ov->taken = 0;
    ov->failed = MT_OK; /* (a failure has broken the communicator: the next fail at once) */
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
    ov->order[ov->given++] = i;
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

/* Waits (ov->mu held) until the first k given are done, as exposed time. */
static mt_status wait_until(mti_overlap *ov, int k, uint64_t t0)
{
    mti_comm_hurry(1);
    while (ov->fifo ? ov->taken < k : ov->next >= 0) pthread_cond_wait(&ov->done, &ov->mu);
    mti_comm_hurry(-1);
    mti_comm_waited(ov->ctx, mti_now_ns() - t0);
    const mt_status s = ov->failed;
    char msg[MTI_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", ov->msg);
    pthread_mutex_unlock(&ov->mu);
    return s ? mti_fail(ov->ctx, s, "%s", msg) : MT_OK;
}

mt_status mti_overlap_wait(mti_overlap *ov)
{
    const uint64_t t0 = mti_now_ns();
    pthread_mutex_lock(&ov->mu);
    if (!ov->fifo && ov->given != ov->n) {
        pthread_mutex_unlock(&ov->mu);
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "%d of %d tensors given to the communication thread",
                        ov->given, ov->n);
    }
    return wait_until(ov, ov->given, t0);
}

mt_status mti_overlap_wait_first(mti_overlap *ov, int k)
{
    const uint64_t t0 = mti_now_ns();
    pthread_mutex_lock(&ov->mu);
    if (!ov->fifo || k > ov->given) {
        pthread_mutex_unlock(&ov->mu);
        return mti_fail(ov->ctx, MT_ERR_INTERNAL, "waiting for %d of the %d tensors given", k, ov->given);
    }
    return wait_until(ov, k, t0);
}
