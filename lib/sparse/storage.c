/*
 * storage.c - a model's parameter pruned in place: its weights (and fp32
 * master, where it has one) become the kept values alone, beside the
 * description of where they are (lib/sparse/sparse.h's storage), and back
 * out as dense elements for the host (mti_param_read, in model.c, and a
 * pruned gradient for mt_trainer_gradients).
 *
 * A prune of a pruned parameter (gradual pruning, RigL's new masks) goes
 * through one dense tensor of WORK at a time: the old values expanded,
 * then gathered by the new description. Every new tensor is made before
 * any old one goes, so a failure leaves the parameter as it was.
 *
 * Nothing here calls the rest of the model's code (model.c reads and writes
 * through it); the masks are chosen in prune.c.
 */
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "ops/kernels.h"

void mti_param_sparse_free(mt_context *ctx, mti_param *p)
{
    if (!p->sp) return;
    mti_tensor_free(ctx, &p->sp->meta);
    free(p->sp->host);
    free(p->sp);
    p->sp = NULL;
}

const void *mti_param_meta_host(const mt_model *m, const mti_param *p)
{
    if (!p->sp || m->ctx->dry) return NULL;
    /* (a CPU device's memory is the host's) */
    return m->ctx->dev->kind == MT_DEVICE_CPU ? p->sp->meta.blk.ptr : p->sp->host;
}

mt_status mti_param_keep(const mt_model *m, int i, uint64_t *keep)
{
    const mti_param *p = &m->params[i];
    const size_t dense = mti_param_dense(p);
    if (!p->sp) {
        memset(keep, 0xff, mti_sp_words(dense) * 8);
        return MT_OK;
    }
    const void *meta = mti_param_meta_host(m, p);
    if (meta) mti_sp_decode(&p->sp->L, meta, keep);
    return MT_OK;
}

mt_status mti_param_dense_host(const mt_model *m, int i, const mti_tensor *t, float *dst)
{
    const mti_param *p = &m->params[i];
    const void *meta = mti_param_meta_host(m, p);
    float *v = malloc((p->numel ? p->numel : 1) * sizeof *v);
    mt_status s = v ? MT_OK : mti_fail(m->ctx, MT_ERR_OOM, "%s: out of host memory", p->name);
    if (!s && meta) s = mti_tensor_download(m->ctx, t, v, p->numel * sizeof *v);
    if (!s && meta) mti_sp_expand(&p->sp->L, meta, v, 0, sizeof *v, 0, p->sp->L.dense, dst);
    free(v);
    return s;
}

mt_status mti_sp_relay(mt_context *ctx, const mti_tensor *t, const mti_psparse *old,
                       const mti_psparse *nw, uint64_t tag, mti_tensor *out)
{
    const mti_sp_layout *L = &nw->L;
    const mti_tensor *meta = &nw->meta;
    const mti_kctx k = {ctx, ctx->dev};
    *out = (mti_tensor){.dtype = t->dtype, .ndim = 1, .shape = {(int64_t)L->nnz}};
    mt_status s = mti_tensor_alloc(ctx, out, t->blk.mem_class, t->blk.lifetime, tag);
    if (s) return s;
    const void *src = t->blk.ptr;
    mti_tensor tmp = {0};
    if (old) {
        tmp = (mti_tensor){.dtype = t->dtype, .ndim = 1, .shape = {(int64_t)L->dense}};
        s = mti_tensor_alloc(ctx, &tmp, MT_MEM_WORK, MT_LIFE_PHASE, tag);
        if (!s)
            s = ctx->ops->sparse_expand(&k, tmp.blk.ptr, t->blk.ptr, old->meta.blk.ptr, &old->L, 0,
                                        L->dense, t->dtype);
        src = tmp.blk.ptr;
    }
    if (!s) s = ctx->ops->sparse_compress(&k, out->blk.ptr, src, meta->blk.ptr, L, 0, L->dense,
                                          t->dtype, 0);
    mti_tensor_free(ctx, &tmp);
    if (s) mti_tensor_free(ctx, out);
    return s;
}

mt_status mti_param_prune(mt_model *m, int i, const uint64_t *keep, size_t nnz, mti_sp_format fmt,
                          int n, int mm, mti_prune_hook hook, void *user)
{
    mt_context *ctx = m->ctx;
    mti_param *p = &m->params[i];
    if (p->qf)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED, "prune: %s is quantized (%s): a pruned weight is "
                        "kept in full precision", p->name, mti_quant_name(p->qf));
    if (p->unmade || p->tp_split || (m->params_home && !p->frozen))
        return mti_fail(ctx, MT_ERR_UNSUPPORTED, "prune: %s is not whole in the model's memory",
                        p->name);
    mti_psparse *sp = calloc(1, sizeof *sp);
    if (!sp) return mti_fail(ctx, MT_ERR_OOM, "prune: out of host memory");
    mt_status s = mti_sp_layout_of(ctx, fmt, mti_param_dense(p), nnz, n, mm, &sp->L);
    sp->meta = (mti_tensor){.dtype = MTI_U8, .ndim = 1, .shape = {(int64_t)sp->L.bytes}};
    if (!s) s = mti_tensor_alloc(ctx, &sp->meta, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                 MTI_TAG_PARAM(MTI_TAG_MASK, i));
    if (!s && !ctx->dry) {
        void *h = calloc(1, sp->L.bytes ? sp->L.bytes : 1);
        if (!h) s = mti_fail(ctx, MT_ERR_OOM, "prune: out of host memory");
        if (!s && mti_sp_encode(&sp->L, keep, h))
            s = mti_fail(ctx, MT_ERR_INVALID_ARG, "prune: %s: the mask does not keep %zu elements%s",
                         p->name, nnz, fmt == MTI_SP_NM ? " in an N:M pattern" : "");
        if (!s) s = mti_tensor_upload(ctx, &sp->meta, h, sp->L.bytes);
        if (!s && ctx->dev->kind != MT_DEVICE_CPU) sp->host = h, h = NULL; /* (kept for the host) */
        free(h);
    }
    mti_tensor w = {0}, master = {0};
    if (!s) s = mti_sp_relay(ctx, &p->w, p->sp, sp, MTI_TAG_PARAM(MTI_TAG_WEIGHT, i), &w);
    if (!s && p->master.blk.ptr)
        s = mti_sp_relay(ctx, &p->master, p->sp, sp, MTI_TAG_PARAM(MTI_TAG_MASTER, i), &master);
    if (!s) s = ctx->dev->sync(ctx->dev);
    if (!s && hook) s = hook(user, i, p->sp, sp); /* (it keeps its tensors only when it succeeds) */
    if (s) {
        mti_tensor_free(ctx, &w);
        mti_tensor_free(ctx, &master);
        mti_tensor_free(ctx, &sp->meta);
        free(sp->host);
        free(sp);
        return s;
    }
    mti_tensor_free(ctx, &p->w);
    p->w = w;
    if (p->master.blk.ptr) {
        mti_tensor_free(ctx, &p->master);
        p->master = master;
    }
    mti_param_sparse_free(ctx, p);
    p->sp = sp;
    p->numel = nnz;
    return MT_OK;
}


mt_status mti_param_unprune(mt_model *m, int i)
{
    mt_context *ctx = m->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    mti_param *p = &m->params[i];
    if (!p->sp) return MT_OK;
    if (p->master.blk.ptr)
        return mti_fail(ctx, MT_ERR_INTERNAL, "%s: made dense again while it has a master", p->name);
    const mti_sp_layout *L = &p->sp->L;
    mti_tensor w = {.dtype = p->w.dtype, .ndim = p->ndim, .shape = {p->shape[0], p->shape[1]}};
    mt_status s = mti_tensor_alloc(ctx, &w, p->w.blk.mem_class, p->w.blk.lifetime,
                                   MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
    if (!s)
        s = ctx->ops->sparse_expand(&k, w.blk.ptr, p->w.blk.ptr, p->sp->meta.blk.ptr, L, 0,
                                    L->dense, p->w.dtype);
    if (!s) s = ctx->dev->sync(ctx->dev);
    if (s) {
        mti_tensor_free(ctx, &w);
        return s;
    }
    p->numel = L->dense;
    mti_tensor_free(ctx, &p->w);
    p->w = w;
    mti_param_sparse_free(ctx, p);
    return MT_OK;
}
