/*
 * offload_host.c - a CUDA context's optimizer state and master weights at
 * home in page-locked host memory, updated there by the CPU op table.
 *
 * The state tensors (OPTIM) and, in fp16/bf16 with masters, the fp32
 * masters (MASTER) are the trainer's ordinary tensors, allocated with
 * cuMemHostAlloc instead of from the device's allocators (place host:
 * mti_host_block_alloc). Unified addressing makes them reachable from the
 * device at the same address, so everything that copies a master or a
 * state tensor (get/set_params, training-state files, the trainer's end)
 * works on them unchanged.
 *
 * The update is cut on the grid of the disk offload (mti_offload_piece_elems
 * elements for an optimizer that updates slices, the whole tensor
 * otherwise), and each piece goes through a staging slot (GRAD: its
 * gradient; PARAM: its weights on the way up, and in fp32 on the way down
 * too):
 *   - the caller (backward's hook, or the unfused step's loop) queues the
 *     piece's gradient (fp32 without masters: and its weights) down on the
 *     main stream, after the kernels that made it, and an event after them;
 *   - the update thread waits for the event, runs the optimizer with the
 *     CPU op table on the host's state and master (its kernels split the
 *     piece over the context's threads, ctx->threads, as every CPU op
 *     does: k carries the context), and queues the updated
 *     weights (the compute copy) up on the second stream, with an event;
 *   - the slot is free again once that event has passed.
 * So the GPU goes on with backward while the CPU updates, and the copies
 * down and up overlap both. The step ends (mti_hostoff_end) when every
 * update is done and every upload has landed, before anything reads the
 * weights again. A gradient queued down may be freed by the caller at
 * once: the device's memory is reused only by work queued after the copy
 * on the same stream. Every copy into a slot's page-locked memory is
 * waited for before the slot is taken again or freed, also after a
 * failure: a job skipped because an earlier one failed waits for its
 * copies down, a piece whose second copy fails waits for its first, and
 * the slots are freed only after the device's streams are drained.
 *
 * A dry context counts the same bytes (the state, the masters, the slots)
 * at place host and moves nothing, so the estimate is exact per place.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "train/dp.h"
#include "device/cuda_device.h"
#include "train/home.h"
#include "train/offload.h"

#define HSLOTS 4       /* staging slots of pieces */
#define HSLOTS_WHOLE 2 /* of whole tensors (Adafactor) */

size_t mti_offload_piece_elems = (size_t)1 << 19;

enum { H_FREE, H_QUEUED, H_UP };

typedef struct host_slot {
    mt_block g, w;     /* GRAD: the piece's gradient; PARAM: its weights */
    void *down, *up;   /* events: the copies down done, the upload done */
    int state;
    /* the job */
    int i;
    size_t at, n;
    float grad_scale, lr;
    int64_t step;
} host_slot;

struct mti_hostoff {
    mt_trainer *t;
    mt_context *ctx;
    int dry, masters;
    size_t wes;        /* bytes per element of the w slots */
    host_slot slot[HSLOTS];
    int n_slots;
    int queue[HSLOTS], qhead, qn, busy;
    pthread_t th;
    int started, stop;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    mt_status err;     /* the update thread's first failure */
    char why[1400];
    int flag;          /* the optimizers' scratch int, on the host */
};

mt_status mti_hostoff_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *c)
{
    const char *fn = "mt_trainer_create";
    (void)m;
    if (c->offload != MT_PLACE_HOST) return MT_OK;
    if (ctx->dev->kind != MT_DEVICE_CUDA)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->offload host needs a CUDA context (on a CPU context the "
                        "device's memory is the host's: offload to disk)",
                        fn);
    if (c->precision != MT_PREC_FP32 && !c->master_weights)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->offload host needs master weights in fp16/bf16 "
                        "(cfg->master_weights): without them there is nothing but the optimizer "
                        "state to move, and the bf16 weights' stochastic rounding runs on the device",
                        fn);
    if (c->optimizer == MT_OPT_ADAMW4)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->offload host does not take 4-bit AdamW (its update takes "
                        "workspace from the device); use 8-bit AdamW or AdamW",
                        fn);
    const mti_optim *opt = mti_optim_of(c->optimizer);
    if (opt && !opt->has_ops(mti_cpu_ops()))
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->offload host: %s is not in the CPU op table", fn, opt->title);
    return MT_OK;
}

/* ---- the update thread ---- */

static mt_status run_update(mti_hostoff *h, host_slot *sl)
{
    mt_trainer *t = h->t;
    const mti_param *p = &t->model->params[sl->i];
    pstate *ps = &t->ps[sl->i];
    const mti_kctx k = {h->ctx, h->ctx->dev};
    const mti_opt_step a = {.k = &k,
                            .ops = mti_cpu_ops(),
                            .cfg = &t->cfg,
                            .p = p,
                            .layout = &ps->lay,
                            .lr = sl->lr,
                            .weight_decay = ps->wd,
                            .step = sl->step,
                            .grad_scale = sl->grad_scale,
                            .pc_dt = t->dt,
                            .scratch = &h->flag};
    /* the state and the master hold this rank's elements, from its shard's
       first (all of them at stage 0) */
    void *st[MTI_OPT_SLOTS];
    mti_home_state_at(t, sl->i, sl->at, st);
    float *w32 = h->masters ? (float *)p->master.blk.ptr + (sl->at - p->master_lo) : sl->w.ptr;
    void *pc = h->masters ? sl->w.ptr : NULL;
    mt_status s = MT_OK;
    if (!h->dry) s = mti_cuda_event_wait(h->ctx->dev, sl->down);
    if (!s) s = t->opt->update(&a, st, w32, pc, sl->g.ptr, sl->at, sl->n);
    if (!s && !h->dry)
        s = mti_cuda_copy_async(h->ctx->dev, 1, mti_home_weights(t, sl->i, sl->at), sl->w.ptr,
                                sl->n * h->wes, sl->up);
    return s;
}

static void *update_thread(void *arg)
{
    mti_hostoff *h = arg;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (!h->stop && !h->qn) pthread_cond_wait(&h->work, &h->mu);
        if (!h->qn) break; /* stopped, nothing left */
        const int v = h->queue[h->qhead];
        h->qhead = (h->qhead + 1) % HSLOTS;
        h->qn--;
        h->busy = 1;
        const int failed = h->err != MT_OK;
        pthread_mutex_unlock(&h->mu);
        mt_status s = failed ? MT_OK : run_update(h, &h->slot[v]);
        if (failed && !h->dry) /* (skipped: its copies down still land in the slot) */
            (void)mti_cuda_event_wait(h->ctx->dev, h->slot[v].down);
        if (s && !h->dry) /* (its upload may be queued without its event: it reads the slot) */
            (void)mti_cuda_side_sync(h->ctx->dev);
        mti_msg msg = s ? mti_last_msg(h->ctx) : (mti_msg){0};
        pthread_mutex_lock(&h->mu);
        if (s && !h->err) {
            h->err = s;
            snprintf(h->why, sizeof h->why, "host offload: the update of %s: %s",
                     h->t->model->params[h->slot[v].i].name, msg.s);
        }
        h->slot[v].state = s || failed ? H_FREE : H_UP;
        h->busy = 0;
        pthread_cond_broadcast(&h->done);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* ---- create / destroy ---- */

mt_status mti_hostoff_tensor(mti_hostoff *h, mti_tensor *x, mt_mem_class c, uint64_t tag)
{
    return mti_host_block_alloc(h->ctx, mti_tensor_bytes(x), c, tag, &x->blk);
}

mt_status mti_hostoff_create(mt_trainer *t, mti_hostoff **out)
{
    mt_context *ctx = t->ctx;
    mti_hostoff *h = calloc(1, sizeof *h);
    if (!h) return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    h->t = t;
    h->ctx = ctx;
    h->dry = ctx->dry;
    h->masters = t->dt != MTI_F32;
    h->wes = h->masters ? mti_dtype_size(t->dt) : 4;
    h->n_slots = t->opt->sliceable ? HSLOTS : HSLOTS_WHOLE;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->work, NULL);
    pthread_cond_init(&h->done, NULL);
    *out = h; /* (destroyed by the trainer on failure) */
    size_t most = 0; /* elements of the largest piece (of this rank's elements) */
    const mt_model *m = t->model;
    for (int i = 0; i < m->n_param; i++) {
        const size_t own = t->sh[i].hi - t->sh[i].lo; /* (none: frozen, or another rank's) */
        size_t n = t->opt->sliceable && mti_offload_piece_elems < own ? mti_offload_piece_elems : own;
        if (n > most) most = n;
    }
    mt_status s = MT_OK;
    for (int k = 0; k < h->n_slots && !s; k++) {
        host_slot *sl = &h->slot[k];
        s = mti_host_block_alloc(ctx, most * 4, MT_MEM_GRAD, MTI_TAG_PARAM(MTI_TAG_TRAINER, 40 + 2 * k),
                                 &sl->g);
        if (!s) s = mti_host_block_alloc(ctx, most * h->wes, MT_MEM_PARAM,
                                         MTI_TAG_PARAM(MTI_TAG_TRAINER, 41 + 2 * k), &sl->w);
        if (!s && !h->dry) s = mti_cuda_event_new(ctx->dev, &sl->down);
        if (!s && !h->dry) s = mti_cuda_event_new(ctx->dev, &sl->up);
    }
    if (!s && !h->dry) {
        if (pthread_create(&h->th, NULL, update_thread, h) != 0)
            s = mti_fail(ctx, MT_ERR_OOM, "host offload: cannot start the update thread");
        else h->started = 1;
    }
    return s;
}

void mti_hostoff_destroy(mti_hostoff *h)
{
    if (!h) return;
    (void)mti_hostoff_end(h);
    pthread_mutex_lock(&h->mu);
    h->stop = 1;
    pthread_cond_broadcast(&h->work);
    pthread_mutex_unlock(&h->mu);
    if (h->started) pthread_join(h->th, NULL);
    if (!h->dry) (void)h->ctx->dev->sync(h->ctx->dev); /* (no copy still into a slot) */
    for (int k = 0; k < h->n_slots; k++) {
        host_slot *sl = &h->slot[k];
        mti_host_block_free(h->ctx, &sl->g);
        mti_host_block_free(h->ctx, &sl->w);
        if (sl->down) mti_cuda_event_free(h->ctx->dev, sl->down);
        if (sl->up) mti_cuda_event_free(h->ctx->dev, sl->up);
    }
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->work);
    pthread_cond_destroy(&h->done);
    free(h);
}

/* ---- the step ---- */

/* A free slot: one whose upload has landed, waiting for the update thread
 * while every slot is queued or being updated. -1 on a failure (*s). */
static int take_slot(mti_hostoff *h, mt_status *s)
{
    pthread_mutex_lock(&h->mu);
    for (;;) {
        int best = -1;
        for (int v = 0; v < h->n_slots && best < 0; v++)
            if (h->slot[v].state == H_FREE) best = v;
        for (int v = 0; v < h->n_slots && best < 0; v++)
            if (h->slot[v].state == H_UP) best = v;
        if (best >= 0) {
            const int up = h->slot[best].state == H_UP;
            pthread_mutex_unlock(&h->mu);
            *s = up ? mti_cuda_event_wait(h->ctx->dev, h->slot[best].up) : MT_OK;
            pthread_mutex_lock(&h->mu);
            h->slot[best].state = H_FREE;
            pthread_mutex_unlock(&h->mu);
            return *s ? -1 : best;
        }
        pthread_cond_wait(&h->done, &h->mu);
    }
}

static mt_status failed(mti_hostoff *h)
{
    pthread_mutex_lock(&h->mu);
    mt_status e = h->err;
    char why[sizeof h->why];
    memcpy(why, h->why, sizeof why);
    pthread_mutex_unlock(&h->mu);
    return e ? mti_fail(h->ctx, e, "%s", why) : MT_OK;
}

/* One piece: its gradient (and in fp32 its weights) down, then the job. */
static mt_status queue_piece(mti_hostoff *h, int i, const float *g, size_t at, size_t n,
                             float grad_scale)
{
    mt_trainer *t = h->t;
    mt_status s = MT_OK;
    const int v = take_slot(h, &s);
    if (v < 0) return s;
    host_slot *sl = &h->slot[v];
    *sl = (host_slot){.g = sl->g, .w = sl->w, .down = sl->down, .up = sl->up, .i = i, .at = at,
                      .n = n, .grad_scale = grad_scale, .lr = t->lr * t->ps[i].lr_scale,
                      .step = (int64_t)t->opt_steps + 1};
    mti_device *d = h->ctx->dev;
    s = mti_cuda_copy_async(d, 0, sl->g.ptr, g, n * 4, h->masters ? sl->down : NULL);
    if (!s && !h->masters) {
        s = mti_cuda_copy_async(d, 0, sl->w.ptr, mti_home_weights(t, i, at), n * 4, sl->down);
        if (s) (void)d->sync(d); /* (the gradient's copy, queued, lands before the slot is reused) */
    }
    if (s) return s;
    pthread_mutex_lock(&h->mu);
    sl->state = H_QUEUED;
    h->queue[(h->qhead + h->qn) % HSLOTS] = v;
    h->qn++;
    pthread_cond_signal(&h->work);
    pthread_mutex_unlock(&h->mu);
    return MT_OK;
}

mt_status mti_hostoff_update(mti_hostoff *h, int i, const float *g, size_t at, size_t n,
                             float grad_scale)
{
    mt_status s = failed(h);
    if (s || h->dry) return s; /* (a dry context moves and computes nothing) */
    const size_t piece = h->t->opt->sliceable ? mti_offload_piece_elems : n;
    for (size_t e = at, len; e < at + n && !s; e += len) {
        len = h->t->opt->sliceable ? (e / piece + 1) * piece - e : n;
        if (len > at + n - e) len = at + n - e;
        s = queue_piece(h, i, g + (e - at), e, len, grad_scale);
    }
    return s;
}

mt_status mti_hostoff_end(mti_hostoff *h)
{
    if (h->dry) return MT_OK;
    pthread_mutex_lock(&h->mu);
    while (h->qn || h->busy) pthread_cond_wait(&h->done, &h->mu);
    pthread_mutex_unlock(&h->mu);
    mt_status s = mti_cuda_side_sync(h->ctx->dev);
    for (int v = 0; v < h->n_slots; v++) h->slot[v].state = H_FREE;
    mt_status e = failed(h);
    pthread_mutex_lock(&h->mu);
    h->err = MT_OK; /* reported once: the next step starts afresh */
    pthread_mutex_unlock(&h->mu);
    return e ? e : s;
}
