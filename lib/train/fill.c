/*
 * fill.c - a deferred model's weights made straight into their homes
 * (fill.h; docs/distributed.md, "Models created into their home").
 *
 * A trained parameter whose home is not whole on this rank (its ZeRO-3
 * slice, or param.bin with offload_params) stays unmade while the trainer
 * is created: the conversions to the compute dtype and the homes are made
 * without its values (masters allocated where they stay in memory, slices
 * zeroed), and once every home exists its values are read from the
 * model's source a chunk at a time, only the elements this rank keeps,
 * and written where they live: the fp32 masters (in memory or in their
 * scratch file) and the weights in the compute dtype, rounded to nearest
 * as the whole-model conversion rounds them. Everything else is made whole
 * first, as a model made at once. The parameters stay marked unmade until
 * the trainer's creation has succeeded on every rank (mti_fill_commit): a
 * creation that fails leaves them to the source again, on every rank alike.
 */
#include <stdlib.h>
#include <string.h>

#include "train/fill.h"
#include "train/home.h"
#include "train/offload.h"
#include "model/model.h"

/* Whether this trainer places parameter i straight from the source. */
static bool straight(const mt_trainer *t, int i)
{
    const mt_trainer_config *c = &t->cfg;
    const bool homes = (t->zero == 3 && c->offload != MT_PLACE_HOST) ||
                       (c->offload == MT_PLACE_DISK && c->offload_params);
    return homes && !t->model->params[i].frozen;
}

mt_status mti_fill_plan(mt_trainer *t)
{
    mt_model *m = t->model;
    if (!mti_model_unmade(m)) return MT_OK;
    unsigned char *rest = malloc((size_t)m->n_param);
    if (!rest) return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    for (int i = 0; i < m->n_param; i++) rest[i] = !straight(t, i);
    mt_status s = mti_model_make(m, rest);
    free(rest);
    return s;
}

enum { CH = 1 << 16 }; /* values per chunk */

/* Values [x, x + n) of parameter i (in host buf) into their homes. */
static mt_status put(mt_trainer *t, int i, size_t x, size_t n, const float *buf, void *half,
                     mti_tensor *st)
{
    mt_context *ctx = t->ctx;
    mt_model *m = t->model;
    mti_param *p = &m->params[i];
    const mti_kctx k = {ctx, ctx->dev};
    const bool sliced = mti_home_sliced(t, i);
    const size_t es = mti_dtype_size(t->dt), lo = sliced ? t->sh[i].lo : 0;
    mt_status s = MT_OK;
    if (m->has_master) { /* the fp32 master: whole, or this rank's slice under ZeRO */
        const size_t mlo = t->zero ? t->sh[i].lo : 0, mhi = t->zero ? t->sh[i].hi : p->numel;
        const size_t a = x > mlo ? x : mlo, b = x + n < mhi ? x + n : mhi;
        if (a < b && m->master_home)
            s = mti_offload_write(m->master_home, i, 1, (uint64_t)(a - mlo) * 4, buf + (a - x),
                                  (b - a) * 4);
        else if (a < b)
            s = ctx->dev->copy_h2d(ctx->dev, (float *)p->master.blk.ptr + (a - p->master_lo),
                                   buf + (a - x), (b - a) * 4);
    }
    if (s) return s;
    if (mti_offload_has_weights(t->off, i)) { /* param.bin (a CPU context: host memory) */
        const void *w = buf;
        if (t->dt != MTI_F32) {
            s = ctx->ops->cast(&k, half, t->dt, buf, MTI_F32, n, MTI_ROUND_NEAREST, 0);
            w = half;
        }
        return s ? s : mti_offload_weights_io(t->off, i, x, n, (void *)w, 1);
    }
    void *dst = (char *)(sliced ? t->pw[i].blk.ptr : p->w.blk.ptr) + (x - lo) * es;
    if (t->dt == MTI_F32) return ctx->dev->copy_h2d(ctx->dev, dst, buf, n * 4);
    s = ctx->dev->copy_h2d(ctx->dev, st->blk.ptr, buf, n * 4);
    return s ? s : ctx->ops->cast(&k, dst, t->dt, st->blk.ptr, MTI_F32, n, MTI_ROUND_NEAREST, 0);
}

mt_status mti_fill_homes(mt_trainer *t)
{
    mt_context *ctx = t->ctx;
    mt_model *m = t->model;
    if (!mti_model_unmade(m)) return MT_OK;
    /* the device's staging of a chunk for its cast (IO; a dry run's too) */
    mti_tensor st = {.dtype = MTI_F32, .ndim = 1, .shape = {CH}};
    bool staged = false;
    for (int i = 0; i < m->n_param; i++)
        staged |= m->params[i].unmade && t->dt != MTI_F32 && !mti_offload_has_weights(t->off, i);
    mt_status s = staged ? mti_tensor_alloc(ctx, &st, MT_MEM_IO, MT_LIFE_PERSISTENT,
                                            MTI_TAG_PARAM(MTI_TAG_STAGE, 1))
                         : MT_OK;
    float *buf = ctx->dry ? NULL : malloc(CH * sizeof *buf);
    void *half = ctx->dry ? NULL : malloc(CH * sizeof(float));
    if (!s && !ctx->dry && (!buf || !half)) s = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    for (int i = 0; i < m->n_param && !s && !ctx->dry; i++) {
        const mti_param *p = &m->params[i];
        if (!p->unmade) continue;
        /* the elements this rank keeps: its slice at ZeRO-3, else all (the
           master's slice at stages 1 and 2 is inside them) */
        const bool sliced = mti_home_sliced(t, i);
        const size_t lo = sliced ? t->sh[i].lo : 0, hi = sliced ? t->sh[i].hi : p->numel;
        for (size_t x = lo, n; x < hi && !s; x += n) {
            n = hi - x < CH ? hi - x : CH;
            s = mti_source_read(m, i, x, n, buf);
            if (!s) s = put(t, i, x, n, buf, half, &st);
        }
        if (s) s = mti_fail(ctx, s, "placing %s: %s", p->name, mti_last_msg(ctx).s);
    }
    if (!s && !ctx->dry) s = ctx->dev->sync(ctx->dev);
    free(buf);
    free(half);
    mti_tensor_free(ctx, &st);
    return s;
}

void mti_fill_commit(mt_trainer *t)
{
    mt_model *m = t->model;
    for (int i = 0; i < m->n_param; i++) m->params[i].unmade = 0;
    mti_source_free(m);
}
