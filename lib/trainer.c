/*
 * trainer.c - the training step: forward, loss, backward, loss-scale check,
 * optimizer, in fp32 or mixed precision.
 *
 * Every tensor of a step comes from the context's allocators with its memory
 * class and lifetime, and is freed as soon as nothing needs it, so the
 * allocators see the real pattern of a training step. dt is the compute
 * dtype (fp32, fp16 or bf16):
 *
 *   IO     x (N,in) in dt (uploaded as fp32 and cast), targets (N), logits
 *          (N,C) in dt reused in place for dlogits, losses (N) fp32
 *   ACT    per hidden layer l: h_l (N,H_l) pre-activation, a_l (N,H_l) after the
 *          activation, in dt (ReLU works in place, so h_l is a_l; GELU keeps both)
 *   GRAD   dW_l, db_l, fp32, made in backward, freed after the update
 *   WORK   the gradient flowing back, (N,H_l) in dt, one layer at a time
 *   PARAM  the weights in dt; MASTER their fp32 masters when dt is not fp32
 *   OPTIM  momentum buffers, fp32, for the trainer's life
 *
 * fp16 scales the loss before backward (through the cross-entropy's dloss),
 * unscales and checks the fp32 gradients, and skips the update when one is
 * not finite (see scaler.h). A step that fails (out of memory, say) frees
 * what it took and leaves the weights, the optimizer state and the scaler as
 * they were: nothing is updated before the whole backward pass has
 * succeeded.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "model.h"
#include "scaler.h"

struct mt_trainer {
    mt_model *model;
    mt_context *ctx;
    mt_trainer_config cfg;
    mti_dtype dt;                        /* compute dtype */
    mti_tensor momentum[MTI_MAX_PARAMS]; /* OPTIM, only when cfg.momentum > 0 */
    mti_tensor found_inf;                /* one device int, fp16 only */
    mti_scaler scaler;
    uint64_t steps, opt_steps, steps_skipped;
    int last_skipped;
    float *host_losses;                  /* (max_batch) */
    float *host_logits;                  /* (max_batch, classes), for accuracy */
};

/* The tensors one step holds; whatever has a block is freed on the way out. */
typedef struct step_state {
    mti_tensor x, y, losses;
    mti_tensor h[MT_MLP_MAX_LAYERS]; /* h[L-1] is the logits */
    mti_tensor a[MT_MLP_MAX_LAYERS]; /* GELU only */
    mti_tensor g[MTI_MAX_PARAMS];
    mti_tensor d;                    /* the gradient flowing back */
} step_state;

#define TAG(node, tensor) (((uint64_t)(node) << 32) | (uint64_t)(tensor))
#define TRY(expr)                                                                              \
    do {                                                                                       \
        if ((s = (expr)) != MT_OK) return s;                                                   \
    } while (0)

void mt_trainer_config_init(mt_trainer_config *c)
{
    if (!c) return;
    memset(c, 0, sizeof *c);
    c->struct_size = sizeof *c;
    c->max_batch = 32;
    c->optimizer = MT_OPT_SGD;
    c->lr = 0.1f;
    c->precision = MT_PREC_FP32;
    c->loss_scale.dynamic = 1;
    c->loss_scale.init_scale = 65536.0f;
    c->loss_scale.growth_factor = 2.0;
    c->loss_scale.backoff_factor = 0.5;
    c->loss_scale.growth_interval = 2000;
}

static mt_status check_config(mt_context *ctx, const mt_trainer_config *c)
{
    const char *fn = "mt_trainer_create";
    if (c->struct_size != sizeof *c)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: cfg->struct_size %u, expected %zu (call mt_trainer_config_init first)",
                        fn, c->struct_size, sizeof *c);
    if (c->max_batch < 1 || c->max_batch > (1 << 24))
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->max_batch %d out of range 1..2^24", fn,
                        c->max_batch);
    if (c->optimizer != MT_OPT_SGD)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->optimizer %d is not a known optimizer",
                        fn, (int)c->optimizer);
    if (!isfinite(c->lr) || c->lr < 0.0f)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->lr %g must be finite and >= 0", fn,
                        (double)c->lr);
    if (!isfinite(c->momentum) || c->momentum < 0.0f || c->momentum >= 1.0f)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->momentum %g out of range [0, 1)", fn,
                        (double)c->momentum);
    if (!isfinite(c->weight_decay) || c->weight_decay < 0.0f)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->weight_decay %g must be finite and >= 0",
                        fn, (double)c->weight_decay);
    if ((unsigned)c->precision > MT_PREC_BF16)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->precision %d is not a precision", fn,
                        (int)c->precision);
    const mt_loss_scale_config *ls = &c->loss_scale;
    if (c->precision == MT_PREC_FP16) {
        if (!isfinite(ls->init_scale) || ls->init_scale <= 0.0f)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s: cfg->loss_scale.init_scale %g must be finite and > 0", fn,
                            (double)ls->init_scale);
        if (ls->dynamic && (!(ls->growth_factor > 1.0) || !isfinite(ls->growth_factor)))
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s: cfg->loss_scale.growth_factor %g must be > 1", fn,
                            ls->growth_factor);
        if (ls->dynamic && !(ls->backoff_factor > 0.0 && ls->backoff_factor < 1.0))
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s: cfg->loss_scale.backoff_factor %g must be in (0, 1)", fn,
                            ls->backoff_factor);
        if (ls->dynamic && ls->growth_interval < 1)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s: cfg->loss_scale.growth_interval %d must be >= 1", fn,
                            ls->growth_interval);
    }
    return MT_OK;
}

static mti_dtype dtype_of(mt_precision p)
{
    return p == MT_PREC_FP16 ? MTI_F16 : p == MT_PREC_BF16 ? MTI_BF16 : MTI_F32;
}

/* ---- the weights' precision: fp32 masters and a 16-bit compute copy ---- */

static mti_tensor like(const mti_tensor *t, mti_dtype dt)
{
    mti_tensor r = *t;
    r.dtype = dt;
    memset(&r.blk, 0, sizeof r.blk);
    return r;
}

/* The model's fp32 weights become masters (MASTER), and the weights (PARAM)
 * a copy in dt. On failure the model is left as it was. */
static mt_status to_mixed(mt_trainer *t)
{
    mt_model *m = t->model;
    mt_context *ctx = t->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    mti_tensor master[MTI_MAX_PARAMS], half[MTI_MAX_PARAMS];
    memset(master, 0, sizeof master);
    memset(half, 0, sizeof half);
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_tensors && !s; i++) {
        const mti_tensor *p = &m->params[i];
        master[i] = like(p, MTI_F32);
        half[i] = like(p, t->dt);
        size_t n = (size_t)mti_tensor_numel(p);
        if ((s = mti_tensor_alloc(ctx, &master[i], MT_MEM_MASTER, MT_LIFE_PERSISTENT, TAG(1, 200 + i))) ||
            (s = ctx->dev->copy_d2d(ctx->dev, master[i].blk.ptr, p->blk.ptr, n * sizeof(float))) ||
            (s = mti_tensor_alloc(ctx, &half[i], MT_MEM_PARAM, MT_LIFE_PERSISTENT, ((uint64_t)1 << 32) | (uint64_t)i)) ||
            (s = ctx->ops->cast(&k, half[i].blk.ptr, t->dt, master[i].blk.ptr, MTI_F32, n,
                                MTI_ROUND_NEAREST, 0)))
            break;
    }
    if (s) {
        for (int i = 0; i < m->n_tensors; i++) {
            mti_tensor_free(ctx, &master[i]);
            mti_tensor_free(ctx, &half[i]);
        }
        return s;
    }
    for (int i = 0; i < m->n_tensors; i++) {
        mti_tensor_free(ctx, &m->params[i]);
        m->params[i] = half[i];
        m->master[i] = master[i];
    }
    m->has_master = true;
    return MT_OK;
}

/* Back to fp32 weights from the masters. Cannot fail: if an fp32 copy of a
 * weight cannot be had, its master block becomes the weight. */
static void from_mixed(mt_trainer *t)
{
    mt_model *m = t->model;
    mt_context *ctx = t->ctx;
    for (int i = 0; i < m->n_tensors; i++) {
        mti_tensor_free(ctx, &m->params[i]);
        mti_tensor p = like(&m->master[i], MTI_F32);
        size_t bytes = mti_tensor_bytes(&p);
        if (mti_tensor_alloc(ctx, &p, MT_MEM_PARAM, MT_LIFE_PERSISTENT, ((uint64_t)1 << 32) | (uint64_t)i) == MT_OK &&
            ctx->dev->copy_d2d(ctx->dev, p.blk.ptr, m->master[i].blk.ptr, bytes) == MT_OK) {
            mti_tensor_free(ctx, &m->master[i]);
            m->params[i] = p;
        } else {
            mti_tensor_free(ctx, &p);
            m->params[i] = m->master[i];
            memset(&m->master[i], 0, sizeof m->master[i]);
        }
    }
    m->has_master = false;
}

void mt_trainer_destroy(mt_trainer *t)
{
    if (!t) return;
    for (int i = 0; i < t->model->n_tensors; i++) mti_tensor_free(t->ctx, &t->momentum[i]);
    mti_tensor_free(t->ctx, &t->found_inf);
    if (t->model->has_master) from_mixed(t);
    free(t->host_losses);
    free(t->host_logits);
    atomic_fetch_sub(&t->model->n_trainers, 1);
    atomic_fetch_sub(&t->ctx->n_children, 1);
    free(t);
}

mt_status mt_trainer_create(mt_model *m, const mt_trainer_config *cfg, mt_trainer **out)
{
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_trainer_create: model is NULL");
    mt_context *ctx = m->ctx;
    if (!cfg || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trainer_create: %s is NULL",
                        cfg ? "out" : "cfg");
    mt_status s = check_config(ctx, cfg);
    if (s) return s;
    if (!ctx->ops)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "mt_trainer_create: %s has no kernels in this build or driver",
                        ctx->dev->name);
    if (atomic_load(&m->n_trainers))
        return mti_fail(ctx, MT_ERR_STATE,
                        "mt_trainer_create: the model already has a trainer; destroy it first");
    mt_trainer *t = calloc(1, sizeof *t);
    int classes = m->mlp.dims[m->mlp.n_layers];
    if (t) {
        t->host_losses = malloc((size_t)cfg->max_batch * sizeof(float));
        t->host_logits = malloc((size_t)cfg->max_batch * (size_t)classes * sizeof(float));
    }
    if (!t || !t->host_losses || !t->host_logits) {
        if (t) {
            free(t->host_losses);
            free(t->host_logits);
        }
        free(t);
        return mti_fail(ctx, MT_ERR_OOM, "mt_trainer_create: out of host memory");
    }
    t->model = m;
    t->ctx = ctx;
    t->cfg = *cfg;
    t->dt = dtype_of(cfg->precision);
    const mt_loss_scale_config *ls = &cfg->loss_scale;
    if (cfg->precision == MT_PREC_FP16)
        mti_scaler_init(&t->scaler, ls->init_scale, ls->growth_factor, ls->backoff_factor,
                        ls->growth_interval, ls->dynamic);
    else
        mti_scaler_init(&t->scaler, 1.0f, 2.0, 0.5, 1, 0);
    atomic_fetch_add(&m->n_trainers, 1);
    atomic_fetch_add(&ctx->n_children, 1);
    if (t->dt != MTI_F32) s = to_mixed(t);
    if (!s && cfg->momentum > 0.0f) {
        for (int i = 0; i < m->n_tensors && !s; i++) {
            mti_tensor *mo = &t->momentum[i];
            *mo = like(&m->params[i], MTI_F32);
            s = mti_tensor_alloc(ctx, mo, MT_MEM_OPTIM, MT_LIFE_PERSISTENT, TAG(1, 100 + i));
            if (!s) s = mti_tensor_zero(ctx, mo);
        }
    }
    if (!s && cfg->precision == MT_PREC_FP16) {
        t->found_inf = (mti_tensor){.dtype = MTI_I32, .ndim = 1, .shape = {1}};
        s = mti_tensor_alloc(ctx, &t->found_inf, MT_MEM_IO, MT_LIFE_PERSISTENT, TAG(1, 2));
    }
    if (s) {
        char msg[MTI_ERR_LEN];
        snprintf(msg, sizeof msg, "%s", mt_last_error(ctx));
        mt_trainer_destroy(t);
        return mti_fail(ctx, s, "mt_trainer_create: %s", msg);
    }
    *out = t;
    return MT_OK;
}

uint64_t mt_trainer_steps(const mt_trainer *t) { return t ? t->steps : 0; }

mt_status mt_trainer_get_loss_scale(const mt_trainer *t, mt_loss_scale_state *out)
{
    if (!t || !out)
        return mti_fail(t ? t->ctx : NULL, MT_ERR_INVALID_ARG, "mt_trainer_get_loss_scale: %s is NULL",
                        t ? "out" : "t");
    *out = (mt_loss_scale_state){.scale = t->scaler.scale,
                                 .growth_tracker = t->scaler.growth_tracker,
                                 .steps_skipped = t->steps_skipped,
                                 .last_step_skipped = t->last_skipped};
    return MT_OK;
}

mt_status mt_trainer_set_loss_scale(mt_trainer *t, const mt_loss_scale_state *in)
{
    if (!t || !in)
        return mti_fail(t ? t->ctx : NULL, MT_ERR_INVALID_ARG, "mt_trainer_set_loss_scale: %s is NULL",
                        t ? "in" : "t");
    if (!isfinite(in->scale) || in->scale <= 0.0f)
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_set_loss_scale: in->scale %g must be finite and > 0",
                        (double)in->scale);
    int max_tracker = t->scaler.dynamic ? t->scaler.growth_interval - 1 : 0;
    if (in->growth_tracker < 0 || in->growth_tracker > max_tracker)
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_set_loss_scale: in->growth_tracker %d out of range 0..%d",
                        in->growth_tracker, max_tracker);
    if (t->cfg.precision != MT_PREC_FP16 &&
        (in->scale != 1.0f || in->steps_skipped || in->last_step_skipped))
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_set_loss_scale: the trainer does not scale (precision is not "
                        "fp16): the scale must be 1 and no step skipped");
    t->scaler.scale = in->scale;
    t->scaler.growth_tracker = in->growth_tracker;
    t->steps_skipped = in->steps_skipped;
    t->last_skipped = in->last_step_skipped != 0;
    return MT_OK;
}

/* ---- the step ---- */

static void reset_all(mt_context *ctx, mt_scope scope)
{
    for (int i = 0; i < ctx->n_inst; i++) mt_allocator_reset(ctx->inst[i], scope);
}

static void step_release(mt_context *ctx, step_state *st)
{
    mti_tensor_free(ctx, &st->x);
    mti_tensor_free(ctx, &st->y);
    mti_tensor_free(ctx, &st->losses);
    mti_tensor_free(ctx, &st->d);
    for (int i = 0; i < MT_MLP_MAX_LAYERS; i++) {
        mti_tensor_free(ctx, &st->h[i]);
        mti_tensor_free(ctx, &st->a[i]);
    }
    for (int i = 0; i < MTI_MAX_PARAMS; i++) mti_tensor_free(ctx, &st->g[i]);
}

static mt_status new_tensor(mt_context *ctx, mti_tensor *t, mti_dtype dt, int64_t rows,
                            int64_t cols, mt_mem_class c, mt_lifetime life, uint64_t tag)
{
    *t = (mti_tensor){.dtype = dt, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
    return mti_tensor_alloc(ctx, t, c, life, tag);
}

static mt_status check_batch(mt_trainer *t, const mt_batch *b, const char *fn)
{
    mt_context *ctx = t->ctx;
    if (!b) return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch is NULL", fn);
    if (b->n < 1 || b->n > t->cfg.max_batch)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch->n %d out of range 1..%d (max_batch)",
                        fn, b->n, t->cfg.max_batch);
    if (!b->inputs || !b->targets)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch->%s is NULL", fn,
                        b->inputs ? "targets" : "inputs");
    int classes = t->model->mlp.dims[t->model->mlp.n_layers];
    for (int i = 0; i < b->n; i++)
        if (b->targets[i] < 0 || b->targets[i] >= classes)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s: batch->targets[%d] = %d out of range 0..%d", fn, i,
                            (int)b->targets[i], classes - 1);
    return MT_OK;
}

/* The output of hidden layer l after its activation. */
static mti_tensor *act_out(const mt_model *m, step_state *st, int l)
{
    return m->mlp.activation == MT_ACT_RELU ? &st->h[l] : &st->a[l];
}

/* The batch in, forward through every layer; logits in st->h[L-1]. */
static mt_status forward(mt_trainer *t, const mt_batch *b, step_state *st)
{
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    const mti_ops *op = ctx->ops;
    const mti_kctx k = {ctx, ctx->dev};
    const int L = m->mlp.n_layers, N = b->n;
    const int *dims = m->mlp.dims;
    const mti_dtype dt = t->dt;
    mt_status s;
    TRY(new_tensor(ctx, &st->x, MTI_F32, N, dims[0], MT_MEM_IO, MT_LIFE_STEP, TAG(0, 0)));
    TRY(mti_tensor_upload(ctx, &st->x, b->inputs, (size_t)N * dims[0] * sizeof(float)));
    if (dt != MTI_F32) { /* the inputs in the compute dtype */
        mti_tensor x32 = st->x;
        s = new_tensor(ctx, &st->x, dt, N, dims[0], MT_MEM_IO, MT_LIFE_STEP, TAG(0, 2));
        if (!s)
            s = op->cast(&k, st->x.blk.ptr, dt, x32.blk.ptr, MTI_F32, (size_t)N * dims[0],
                         MTI_ROUND_NEAREST, 0);
        mti_tensor_free(ctx, &x32);
        if (s) return s;
    }
    TRY(new_tensor(ctx, &st->y, MTI_I32, N, 0, MT_MEM_IO, MT_LIFE_STEP, TAG(0, 1)));
    TRY(mti_tensor_upload(ctx, &st->y, b->targets, (size_t)N * sizeof(int32_t)));
    for (int l = 0; l < L; l++) {
        const void *in = l == 0 ? st->x.blk.ptr : act_out(m, st, l - 1)->blk.ptr;
        mt_mem_class c = l == L - 1 ? MT_MEM_IO : MT_MEM_ACT; /* the logits are IO */
        TRY(new_tensor(ctx, &st->h[l], dt, N, dims[l + 1], c, MT_LIFE_STEP, TAG(2 + l, 0)));
        void *h = st->h[l].blk.ptr;
        TRY(op->matmul_fwd(&k, h, in, m->params[2 * l].blk.ptr, m->params[2 * l + 1].blk.ptr, N,
                           dims[l], dims[l + 1], dt));
        if (l == L - 1) break;
        size_t n = (size_t)N * dims[l + 1];
        if (m->mlp.activation == MT_ACT_RELU) {
            TRY(op->relu_fwd(&k, h, h, n, dt)); /* in place: the backward needs only the output */
        } else {
            TRY(new_tensor(ctx, &st->a[l], dt, N, dims[l + 1], MT_MEM_ACT, MT_LIFE_STEP,
                           TAG(2 + l, 1)));
            TRY(op->gelu_fwd(&k, st->a[l].blk.ptr, h, n, dt));
        }
    }
    return new_tensor(ctx, &st->losses, MTI_F32, N, 0, MT_MEM_IO, MT_LIFE_STEP, TAG(1, 1));
}

/* Mean of the host copy of the losses, summed in a fixed order. */
static float mean_loss(mt_trainer *t, const step_state *st, int n, mt_status *s)
{
    *s = mti_tensor_download(t->ctx, &st->losses, t->host_losses, (size_t)n * sizeof(float));
    double sum = 0.0;
    for (int i = 0; i < n && !*s; i++) sum += t->host_losses[i];
    return (float)(sum / n);
}

/* From dlogits (in st->h[L-1]) back to the fp32 gradients of every weight. */
static mt_status backward(mt_trainer *t, int N, step_state *st)
{
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    const mti_ops *op = ctx->ops;
    const mti_kctx k = {ctx, ctx->dev};
    const int L = m->mlp.n_layers;
    const int *dims = m->mlp.dims;
    const mti_dtype dt = t->dt;
    mt_status s;
    for (int l = L - 1; l >= 0; l--) {
        mti_tensor *cur = l == L - 1 ? &st->h[L - 1] : &st->d; /* dy (N, dims[l+1]) */
        const void *in = l == 0 ? st->x.blk.ptr : act_out(m, st, l - 1)->blk.ptr;
        const mti_tensor *w = &m->params[2 * l], *bias = &m->params[2 * l + 1];
        mti_tensor *gw = &st->g[2 * l], *gb = &st->g[2 * l + 1];
        TRY(new_tensor(ctx, gw, MTI_F32, w->shape[0], w->shape[1], MT_MEM_GRAD, MT_LIFE_STEP,
                       TAG(2 + l, 10)));
        TRY(new_tensor(ctx, gb, MTI_F32, bias->shape[0], 0, MT_MEM_GRAD, MT_LIFE_STEP,
                       TAG(2 + l, 11)));
        TRY(mti_tensor_zero(ctx, gw)); /* weight gradients accumulate */
        TRY(mti_tensor_zero(ctx, gb));
        mti_tensor dx = {0};
        if (l > 0)
            TRY(new_tensor(ctx, &dx, dt, N, dims[l], MT_MEM_WORK, MT_LIFE_PHASE, TAG(2 + l, 12)));
        s = op->matmul_bwd(&k, l > 0 ? dx.blk.ptr : NULL, gw->blk.ptr, gb->blk.ptr, cur->blk.ptr,
                           in, w->blk.ptr, N, dims[l], dims[l + 1], dt, 0);
        mti_tensor_free(ctx, cur); /* dy is done */
        if (s) {
            mti_tensor_free(ctx, &dx);
            return s;
        }
        if (l == 0) break;
        st->d = dx;
        /* through the activation of layer l-1, in place */
        size_t n = (size_t)N * dims[l];
        if (m->mlp.activation == MT_ACT_RELU) {
            TRY(op->relu_bwd(&k, st->d.blk.ptr, st->d.blk.ptr, st->h[l - 1].blk.ptr, n, dt));
        } else {
            TRY(op->gelu_bwd(&k, st->d.blk.ptr, st->d.blk.ptr, st->h[l - 1].blk.ptr, n, dt));
            mti_tensor_free(ctx, &st->a[l - 1]);
        }
        mti_tensor_free(ctx, &st->h[l - 1]);
    }
    return MT_OK;
}

/* fp16: unscale every gradient and see whether one is not finite. */
static mt_status unscale_and_check(mt_trainer *t, step_state *st, int *found)
{
    mt_context *ctx = t->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    float inv = mti_scaler_inv(&t->scaler);
    mt_status s;
    TRY(mti_tensor_zero(ctx, &t->found_inf));
    for (int i = 0; i < t->model->n_tensors; i++)
        TRY(ctx->ops->unscale_check(&k, st->g[i].blk.ptr, (size_t)mti_tensor_numel(&st->g[i]), inv,
                                    t->found_inf.blk.ptr));
    int32_t flag = 0;
    TRY(mti_tensor_download(ctx, &t->found_inf, &flag, sizeof flag));
    *found = flag != 0;
    return MT_OK;
}

/* The update, tensor by tensor. *updated counts the tensors already
 * changed when an op fails part-way (possible only on a device whose
 * launches can fail). */
static mt_status optimizer_step(mt_trainer *t, step_state *st, int *updated)
{
    mt_model *m = t->model;
    const mti_kctx k = {t->ctx, t->ctx->dev};
    const mti_sgd_args a = {.lr = t->cfg.lr,
                            .momentum = t->cfg.momentum,
                            .weight_decay = t->cfg.weight_decay,
                            .first_step = t->opt_steps == 0,
                            .grad_scale = 1.0f};
    *updated = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        mti_tensor *p = m->has_master ? &m->master[i] : &m->params[i];
        void *pc = m->has_master ? m->params[i].blk.ptr : NULL;
        float *mom = t->cfg.momentum > 0.0f ? t->momentum[i].blk.ptr : NULL;
        mt_status s = t->ctx->ops->sgd(&k, p->blk.ptr, st->g[i].blk.ptr, mom, pc, t->dt,
                                       (size_t)mti_tensor_numel(p), &a);
        if (s) {
            /* the momentum of the tensors done is initialised now */
            if (i) t->opt_steps++;
            return s;
        }
        *updated = i + 1;
        mti_tensor_free(t->ctx, &st->g[i]); /* this gradient is done */
    }
    t->opt_steps++;
    return MT_OK;
}

/* updated: weight tensors the optimizer had changed before it failed. */
static mt_status step_failed(mt_trainer *t, step_state *st, const char *fn, mt_status s,
                             int updated)
{
    char msg[MTI_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", mt_last_error(t->ctx));
    step_release(t->ctx, st);
    reset_all(t->ctx, MT_SCOPE_STEP);
    if (updated)
        return mti_fail(t->ctx, s,
                        "%s: %s (the update failed part-way: %d of %d weight tensors were "
                        "updated)",
                        fn, msg, updated, t->model->n_tensors);
    return mti_fail(t->ctx, s, "%s: %s (weights and optimizer state unchanged)", fn, msg);
}

mt_status mt_trainer_step(mt_trainer *t, const mt_batch *b, float *loss)
{
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_trainer_step: trainer is NULL");
    mt_status s = check_batch(t, b, "mt_trainer_step");
    if (s) return s;
    mt_context *ctx = t->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    const mt_model *m = t->model;
    const int L = m->mlp.n_layers, N = b->n, C = m->mlp.dims[L];
    const bool scaled = t->cfg.precision == MT_PREC_FP16;
    step_state st;
    memset(&st, 0, sizeof st);

    if ((s = forward(t, b, &st))) return step_failed(t, &st, "mt_trainer_step", s, 0);
    /* loss, and dlogits in place of the logits: mean over the batch, times the loss scale */
    void *logits = st.h[L - 1].blk.ptr;
    s = ctx->ops->xent(&k, st.losses.blk.ptr, logits, logits, st.y.blk.ptr, N, C, C,
                       t->scaler.scale / (float)N, t->dt);
    float mean = 0.0f;
    if (!s) mean = mean_loss(t, &st, N, &s);
    if (s) return step_failed(t, &st, "mt_trainer_step", s, 0);
    reset_all(ctx, MT_SCOPE_PHASE); /* end of forward */

    if ((s = backward(t, N, &st))) return step_failed(t, &st, "mt_trainer_step", s, 0);
    reset_all(ctx, MT_SCOPE_PHASE); /* end of backward */

    int found = 0;
    if (scaled && (s = unscale_and_check(t, &st, &found)))
        return step_failed(t, &st, "mt_trainer_step", s, 0);
    int updated = 0;
    if (!found && (s = optimizer_step(t, &st, &updated)))
        return step_failed(t, &st, "mt_trainer_step", s, updated);
    if (scaled) mti_scaler_update(&t->scaler, found);
    if (found) t->steps_skipped++;
    t->last_skipped = found;
    step_release(ctx, &st);
    reset_all(ctx, MT_SCOPE_STEP);
    t->steps++;
    if (loss) *loss = mean;
    return MT_OK;
}

mt_status mt_trainer_eval(mt_trainer *t, const mt_batch *b, float *loss, float *accuracy)
{
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_trainer_eval: trainer is NULL");
    mt_status s = check_batch(t, b, "mt_trainer_eval");
    if (s) return s;
    mt_context *ctx = t->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    const mt_model *m = t->model;
    const int L = m->mlp.n_layers, N = b->n, C = m->mlp.dims[L];
    step_state st;
    memset(&st, 0, sizeof st);
    if ((s = forward(t, b, &st))) return step_failed(t, &st, "mt_trainer_eval", s, 0);
    mti_tensor *lg = &st.h[L - 1];
    s = ctx->ops->xent(&k, st.losses.blk.ptr, NULL, lg->blk.ptr, st.y.blk.ptr, N, C, C, 0.0f,
                       t->dt);
    float mean = 0.0f;
    if (!s) mean = mean_loss(t, &st, N, &s);
    if (!s && accuracy && t->dt != MTI_F32) { /* the logits as fp32, in the losses' stead */
        mti_tensor_free(ctx, &st.losses);
        s = new_tensor(ctx, &st.losses, MTI_F32, N, C, MT_MEM_IO, MT_LIFE_STEP, TAG(1, 3));
        if (!s)
            s = ctx->ops->cast(&k, st.losses.blk.ptr, MTI_F32, lg->blk.ptr, t->dt, (size_t)N * C,
                               MTI_ROUND_NEAREST, 0);
        lg = &st.losses;
    }
    if (!s && accuracy)
        s = mti_tensor_download(ctx, lg, t->host_logits, (size_t)N * C * sizeof(float));
    if (s) return step_failed(t, &st, "mt_trainer_eval", s, 0);
    if (accuracy) {
        int right = 0;
        for (int i = 0; i < N; i++) {
            const float *row = t->host_logits + (size_t)i * C;
            int best = 0;
            for (int j = 1; j < C; j++)
                if (row[j] > row[best]) best = j;
            right += best == b->targets[i];
        }
        *accuracy = (float)right / (float)N;
    }
    if (loss) *loss = mean;
    step_release(ctx, &st);
    reset_all(ctx, MT_SCOPE_STEP);
    return MT_OK;
}
