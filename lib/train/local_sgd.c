/*
 * local_sgd.c - local SGD, the asynchronous-update mode of data parallel
 * training (mt_trainer_config.local_sgd_every = H): each rank steps on its
 * own rows with no gradient communication (its loss and gradients are its
 * rows' own), and after every H-th step the ranks' weights are replaced by
 * their mean: summed over the ranks (one all-reduce per tensor, fp32) and
 * multiplied by 1/N, on the fp32 masters where there are (the compute copy
 * then rounded from them, as after an update), else on the fp32 weights,
 * else (bf16 without masters) on the bf16 weights widened to fp32 a slice
 * at a time and rounded back to nearest. The optimizer state stays each
 * rank's own, as in the usual formulation (Stich, "Local SGD Converges
 * Fast and Communicates Little"; PyTorch's post-local SGD): every rank
 * keeps its momentum and moments, and the step counters stay equal.
 *
 * The status exchanges of a step (dp.c) still run, so a failure on one rank
 * still fails the step on every rank and the ranks' step counts, which time
 * the averages, never drift apart.
 */
#include <stdio.h>

#include "train/local_sgd.h"
#include "ops/kernels.h"
#include "train/trainer.h"

bool mti_local_sgd(const mt_trainer *t) { return t->cfg.local_sgd_every > 0 && t->ctx->world > 1; }

/* n fp32 values of parameter i become their mean over the ranks: the sum
 * (nothing to sum in a dry context, which has no communicator), times 1/N. */
static mt_status mean_f32(mt_trainer *t, int i, float *v, size_t n)
{
    mt_context *ctx = t->ctx;
    mt_status s = MT_OK;
    if (ctx->cfg.comm) {
        char what[128];
        snprintf(what, sizeof what, "local SGD: the all-reduce of the weights of %s",
                 t->model->params[i].name);
        s = mti_comm_all_reduce(ctx, what, v, v, n, MT_COMM_F32, MT_COMM_SUM);
    }
    const mti_kctx k = {ctx, ctx->dev};
    /* the flag an unscale raises never rises: weights are finite */
    if (!s) s = ctx->ops->unscale_check(&k, v, n, 1.0f / (float)ctx->world, (int *)t->found_inf.blk.ptr);
    return s;
}

/* bf16 weights without masters: through an fp32 slice (WORK), as the
 * update takes them, so the average needs no more memory than a step. */
#define SLICE ((size_t)1 << 16)

static mt_status mean_bare(mt_trainer *t, int i)
{
    mt_context *ctx = t->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    mti_param *p = &t->model->params[i];
    const size_t es = mti_dtype_size(p->w.dtype);
    mti_tensor sl = {.dtype = MTI_F32, .ndim = 1,
                     .shape = {(int64_t)(p->numel < SLICE ? p->numel : SLICE)}};
    mt_status s = mti_tensor_alloc(ctx, &sl, MT_MEM_WORK, MT_LIFE_PHASE, MTI_TAG_PARAM(MTI_TAG_TRAINER, 6));
    for (size_t at = 0; at < p->numel && !s; at += SLICE) {
        const size_t n = p->numel - at < SLICE ? p->numel - at : SLICE;
        void *w = (char *)p->w.blk.ptr + at * es;
        s = ctx->ops->cast(&k, sl.blk.ptr, MTI_F32, w, p->w.dtype, n, MTI_ROUND_NEAREST, 0);
        if (!s) s = mean_f32(t, i, sl.blk.ptr, n);
        if (!s) s = ctx->ops->cast(&k, w, p->w.dtype, sl.blk.ptr, MTI_F32, n, MTI_ROUND_NEAREST, 0);
    }
    mti_tensor_free(ctx, &sl);
    return s;
}

mt_status mti_local_sgd_after_step(mt_trainer *t, const char *fn)
{
    if (!mti_local_sgd(t)) return MT_OK;
    mt_context *ctx = t->ctx;
    mt_model *m = t->model;
    /* an estimate's two steps count as a period, so its figures hold an
       average whatever H is */
    if (t->steps % (uint64_t)t->cfg.local_sgd_every && !(ctx->dry && t->steps == 2)) return MT_OK;
    const mti_kctx k = {ctx, ctx->dev};
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_param && !s; i++) {
        mti_param *p = &m->params[i];
        if (p->frozen) continue; /* equal on every rank, and never changes */
        if (t->bare) {
            s = mean_bare(t, i);
        } else if (m->has_master) {
            s = mean_f32(t, i, p->master.blk.ptr, p->numel);
            if (!s) s = ctx->ops->cast(&k, p->w.blk.ptr, t->dt, p->master.blk.ptr, MTI_F32,
                                       p->numel, MTI_ROUND_NEAREST, 0);
        } else {
            s = mean_f32(t, i, p->w.blk.ptr, p->numel);
        }
    }
    if (!s) s = ctx->dev->sync(ctx->dev);
    if (s)
        return mti_fail(ctx, s,
                        "%s: step %llu: local SGD's average of the weights failed; the step's "
                        "update stands, and the ranks' weights may differ: %s",
                        fn, (unsigned long long)t->steps, mti_last_msg(ctx).s);
    return MT_OK;
}
