/*
 * model_mlp.c - the multilayer perceptron: parameters, init, host copies.
 * Layer i has W_i (dims[i+1], dims[i]) and b_i (dims[i+1]); y = x W^T + b.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "model.h"
#include "rng.h"

#define MLP_MAX_DIM (1 << 24)

void mt_mlp_spec_init(mt_mlp_spec *s)
{
    if (!s) return;
    memset(s, 0, sizeof *s);
    s->struct_size = sizeof *s;
    s->activation = MT_ACT_RELU;
}

static mt_status check_spec(mt_context *ctx, const mt_mlp_spec *s)
{
    if (s->struct_size != sizeof *s)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "mt_model_mlp_create: spec->struct_size %u, expected %zu (call "
                        "mt_mlp_spec_init first)",
                        s->struct_size, sizeof *s);
    if (s->n_layers < 1 || s->n_layers > MT_MLP_MAX_LAYERS)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "mt_model_mlp_create: spec->n_layers %d out of range 1..%d", s->n_layers,
                        MT_MLP_MAX_LAYERS);
    for (int i = 0; i <= s->n_layers; i++)
        if (s->dims[i] < 1 || s->dims[i] > MLP_MAX_DIM)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "mt_model_mlp_create: spec->dims[%d] = %d out of range 1..%d", i,
                            s->dims[i], MLP_MAX_DIM);
    for (int i = 0; i < s->n_layers; i++)
        if ((int64_t)s->dims[i] * s->dims[i + 1] > INT32_MAX)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "mt_model_mlp_create: layer %d has %lld weights, more than 2^31-1", i,
                            (long long)s->dims[i] * s->dims[i + 1]);
    if (s->activation != MT_ACT_RELU && s->activation != MT_ACT_GELU)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "mt_model_mlp_create: spec->activation %d is not MT_ACT_RELU or MT_ACT_GELU",
                        (int)s->activation);
    return MT_OK;
}

static void free_params(mt_model *m)
{
    for (int i = 0; i < m->n_tensors; i++) mti_tensor_free(m->ctx, &m->params[i]);
}

mt_status mt_model_mlp_create(mt_context *ctx, const mt_mlp_spec *spec, mt_model **out)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_model_mlp_create: ctx is NULL");
    if (!spec || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_model_mlp_create: %s is NULL",
                        spec ? "out" : "spec");
    mt_status s = check_spec(ctx, spec);
    if (s) return s;
    mt_model *m = calloc(1, sizeof *m);
    if (!m) return mti_fail(ctx, MT_ERR_OOM, "mt_model_mlp_create: out of host memory");
    m->ctx = ctx;
    m->kind = MTI_MODEL_MLP;
    m->mlp = *spec;
    m->n_tensors = 2 * spec->n_layers;
    size_t max_w = 0;
    for (int l = 0; l < spec->n_layers; l++) {
        mti_tensor *w = &m->params[2 * l], *b = &m->params[2 * l + 1];
        *w = (mti_tensor){.dtype = MTI_F32, .ndim = 2, .shape = {spec->dims[l + 1], spec->dims[l]}};
        *b = (mti_tensor){.dtype = MTI_F32, .ndim = 1, .shape = {spec->dims[l + 1]}};
        m->n_params += (size_t)mti_tensor_numel(w) + (size_t)mti_tensor_numel(b);
        if ((size_t)mti_tensor_numel(w) > max_w) max_w = (size_t)mti_tensor_numel(w);
    }
    /* init as torch.nn.Linear: W and b uniform in +-1/sqrt(fan_in) */
    float *host = malloc(max_w * sizeof *host);
    if (!host) {
        free(m);
        return mti_fail(ctx, MT_ERR_OOM, "mt_model_mlp_create: out of host memory");
    }
    mti_rng rng;
    mti_rng_seed(&rng, spec->seed);
    for (int i = 0; i < m->n_tensors && !s; i++) {
        mti_tensor *t = &m->params[i];
        s = mti_tensor_alloc(ctx, t, MT_MEM_PARAM, MT_LIFE_PERSISTENT, ((uint64_t)1 << 32) | (uint64_t)i);
        if (s) break;
        float bound = 1.0f / sqrtf((float)spec->dims[i / 2]);
        size_t n = (size_t)mti_tensor_numel(t);
        for (size_t k = 0; k < n; k++) host[k] = (2.0f * mti_rng_uniform(&rng) - 1.0f) * bound;
        s = mti_tensor_upload(ctx, t, host, n * sizeof *host);
    }
    free(host);
    if (s) {
        char msg[MTI_ERR_LEN];
        snprintf(msg, sizeof msg, "%s", mt_last_error(ctx));
        free_params(m);
        free(m);
        return mti_fail(ctx, s, "mt_model_mlp_create: %s", msg);
    }
    atomic_fetch_add(&ctx->n_children, 1);
    *out = m;
    return MT_OK;
}

mt_status mt_model_destroy(mt_model *m)
{
    if (!m) return MT_OK;
    if (atomic_load(&m->n_trainers))
        return mti_fail(m->ctx, MT_ERR_STATE,
                        "mt_model_destroy: %d trainer(s) still use this model; destroy them first",
                        atomic_load(&m->n_trainers));
    mt_context *ctx = m->ctx;
    free_params(m);
    free(m);
    atomic_fetch_sub(&ctx->n_children, 1);
    return MT_OK;
}

size_t mt_model_num_params(const mt_model *m) { return m ? m->n_params : 0; }

static mt_status check_copy(const mt_model *m, const void *p, size_t n, const char *fn)
{
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: model is NULL", fn);
    if (!p) return mti_fail(m->ctx, MT_ERR_INVALID_ARG, "%s: buffer is NULL", fn);
    if (n != m->n_params)
        return mti_fail(m->ctx, MT_ERR_INVALID_ARG, "%s: n is %zu but the model has %zu parameters",
                        fn, n, m->n_params);
    return MT_OK;
}

/* The fp32 values of the weights: the masters while a mixed-precision
 * trainer holds them, else the weights themselves. */
static const mti_tensor *fp32_params(const mt_model *m)
{
    return m->has_master ? m->master : m->params;
}

mt_status mt_model_get_params(const mt_model *m, float *dst, size_t n)
{
    mt_status s = check_copy(m, dst, n, "mt_model_get_params");
    for (int i = 0; i < (m ? m->n_tensors : 0) && !s; i++) {
        const mti_tensor *t = &fp32_params(m)[i];
        size_t k = (size_t)mti_tensor_numel(t);
        s = mti_tensor_download(m->ctx, t, dst, k * sizeof *dst);
        dst += k;
    }
    return s;
}

mt_status mt_model_set_params(mt_model *m, const float *src, size_t n)
{
    mt_status s = check_copy(m, src, n, "mt_model_set_params");
    if (s) return s;
    /* check every value first: a NaN or inf would poison training silently */
    for (size_t i = 0; i < n; i++)
        if (!isfinite(src[i]))
            return mti_fail(m->ctx, MT_ERR_INVALID_ARG,
                            "mt_model_set_params: value %zu is not finite", i);
    const mti_kctx k = {m->ctx, m->ctx->dev};
    for (int i = 0; i < m->n_tensors && !s; i++) {
        const mti_tensor *t = &fp32_params(m)[i];
        size_t e = (size_t)mti_tensor_numel(t);
        s = mti_tensor_upload(m->ctx, (mti_tensor *)t, src, e * sizeof *src);
        if (!s && m->has_master) /* refresh the compute copy */
            s = m->ctx->ops->cast(&k, m->params[i].blk.ptr, m->params[i].dtype, t->blk.ptr, MTI_F32,
                                  e, MTI_ROUND_NEAREST, 0);
        src += e;
    }
    return s ? s : m->ctx->dev->sync(m->ctx->dev);
}
