/*
 * trainer.c - the training step: forward, loss, backward, optimizer.
 *
 * Every tensor of a step comes from the context's allocators with its memory
 * class and lifetime, and is freed as soon as nothing needs it, so the
 * allocators see the real pattern of a training step:
 *
 *   IO     x (N,in), targets (N), logits (N,C) reused in place for dlogits, losses (N)
 *   ACT    per hidden layer l: h_l (N,H_l) pre-activation, a_l (N,H_l) after the
 *          activation (ReLU works in place, so h_l is a_l; GELU keeps both)
 *   GRAD   dW_l, db_l, made in backward, freed after the update
 *   WORK   the gradient flowing back, (N,H_l), one layer at a time
 *   OPTIM  momentum buffers, for the trainer's life
 *
 * A step that fails (out of memory, say) frees what it took and leaves the
 * model's weights and the optimizer state as they were: the update runs only
 * after the whole backward pass has succeeded.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "model.h"

struct mt_trainer {
    mt_model *model;
    mt_context *ctx;
    mt_trainer_config cfg;
    mti_tensor momentum[MTI_MAX_PARAMS]; /* OPTIM, only when cfg.momentum > 0 */
    float *host_losses;                  /* (max_batch) */
    float *host_logits;                  /* (max_batch, classes), for accuracy */
    uint64_t steps;
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

void mt_trainer_config_init(mt_trainer_config *c)
{
    if (!c) return;
    memset(c, 0, sizeof *c);
    c->struct_size = sizeof *c;
    c->max_batch = 32;
    c->optimizer = MT_OPT_SGD;
    c->lr = 0.1f;
}

static mt_status check_config(mt_context *ctx, const mt_trainer_config *c)
{
    if (c->struct_size != sizeof *c)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_create: cfg->struct_size %u, expected %zu (call "
                        "mt_trainer_config_init first)",
                        c->struct_size, sizeof *c);
    if (c->max_batch < 1 || c->max_batch > (1 << 24))
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trainer_create: cfg->max_batch %d out of "
                        "range 1..2^24", c->max_batch);
    if (c->optimizer != MT_OPT_SGD)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trainer_create: cfg->optimizer %d is not "
                        "a known optimizer", (int)c->optimizer);
    if (!isfinite(c->lr) || c->lr < 0.0f)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trainer_create: cfg->lr %g must be finite "
                        "and >= 0", (double)c->lr);
    if (!isfinite(c->momentum) || c->momentum < 0.0f || c->momentum >= 1.0f)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trainer_create: cfg->momentum %g out of "
                        "range [0, 1)", (double)c->momentum);
    if (!isfinite(c->weight_decay) || c->weight_decay < 0.0f)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trainer_create: cfg->weight_decay %g must "
                        "be finite and >= 0", (double)c->weight_decay);
    return MT_OK;
}

void mt_trainer_destroy(mt_trainer *t)
{
    if (!t) return;
    for (int i = 0; i < t->model->n_tensors; i++) mti_tensor_free(t->ctx, &t->momentum[i]);
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
    if (ctx->dev->kind != MT_DEVICE_CPU)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "mt_trainer_create: training on %s needs the CUDA op table, which this "
                        "version does not have yet; use a CPU context",
                        ctx->dev->name);
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
    atomic_fetch_add(&m->n_trainers, 1);
    atomic_fetch_add(&ctx->n_children, 1);
    if (cfg->momentum > 0.0f) {
        for (int i = 0; i < m->n_tensors && !s; i++) {
            mti_tensor *mo = &t->momentum[i];
            *mo = m->params[i];
            memset(&mo->blk, 0, sizeof mo->blk);
            s = mti_tensor_alloc(ctx, mo, MT_MEM_OPTIM, MT_LIFE_PERSISTENT, TAG(1, 100 + i));
            if (!s) s = mti_tensor_zero(ctx, mo);
        }
    }
    if (s) {
        mt_trainer_destroy(t);
        return s;
    }
    *out = t;
    return MT_OK;
}

uint64_t mt_trainer_steps(const mt_trainer *t) { return t ? t->steps : 0; }

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

/* Inputs and targets in, forward through every layer; logits in st->h[L-1]. */
static mt_status forward(mt_trainer *t, const mt_batch *b, step_state *st)
{
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    const struct mti_ops *op = ctx->ops;
    const int L = m->mlp.n_layers, N = b->n;
    const int *dims = m->mlp.dims;
    mt_status s;
    if ((s = new_tensor(ctx, &st->x, MTI_F32, N, dims[0], MT_MEM_IO, MT_LIFE_STEP, TAG(0, 0))) ||
        (s = mti_tensor_upload(ctx, &st->x, b->inputs, (size_t)N * dims[0] * sizeof(float))) ||
        (s = new_tensor(ctx, &st->y, MTI_I32, N, 0, MT_MEM_IO, MT_LIFE_STEP, TAG(0, 1))) ||
        (s = mti_tensor_upload(ctx, &st->y, b->targets, (size_t)N * sizeof(int32_t))))
        return s;
    for (int l = 0; l < L; l++) {
        const float *in = l == 0 ? st->x.blk.ptr : act_out(m, st, l - 1)->blk.ptr;
        mt_mem_class c = l == L - 1 ? MT_MEM_IO : MT_MEM_ACT; /* the logits are IO */
        if ((s = new_tensor(ctx, &st->h[l], MTI_F32, N, dims[l + 1], c, MT_LIFE_STEP,
                            TAG(2 + l, 0))))
            return s;
        float *h = st->h[l].blk.ptr;
        op->matmul_fwd(h, in, m->params[2 * l].blk.ptr, m->params[2 * l + 1].blk.ptr, N, dims[l],
                       dims[l + 1]);
        if (l == L - 1) break;
        size_t n = (size_t)N * dims[l + 1];
        if (m->mlp.activation == MT_ACT_RELU) {
            op->relu_fwd(h, h, n); /* in place: ReLU's backward only needs the output */
        } else {
            if ((s = new_tensor(ctx, &st->a[l], MTI_F32, N, dims[l + 1], MT_MEM_ACT, MT_LIFE_STEP,
                                TAG(2 + l, 1))))
                return s;
            op->gelu_fwd(st->a[l].blk.ptr, h, n);
        }
        /* the GELU input stays for backward; nothing else of layer l-1 is needed now */
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

/* From dlogits (in st->h[L-1]) back to the gradients of every parameter. */
static mt_status backward(mt_trainer *t, int N, step_state *st)
{
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    const struct mti_ops *op = ctx->ops;
    const int L = m->mlp.n_layers;
    const int *dims = m->mlp.dims;
    mti_tensor cur = st->h[L - 1]; /* the gradient flowing back, (N, dims[l+1]) */
    memset(&st->h[L - 1], 0, sizeof st->h[L - 1]);
    mt_status s = MT_OK;
    for (int l = L - 1; l >= 0; l--) {
        const float *in = l == 0 ? st->x.blk.ptr : act_out(m, st, l - 1)->blk.ptr;
        const mti_tensor *w = &m->params[2 * l], *bias = &m->params[2 * l + 1];
        mti_tensor *gw = &st->g[2 * l], *gb = &st->g[2 * l + 1];
        if ((s = new_tensor(ctx, gw, MTI_F32, w->shape[0], w->shape[1], MT_MEM_GRAD, MT_LIFE_STEP,
                            TAG(2 + l, 10))) ||
            (s = new_tensor(ctx, gb, MTI_F32, bias->shape[0], 0, MT_MEM_GRAD, MT_LIFE_STEP,
                            TAG(2 + l, 11))))
            break;
        if (l > 0 && (s = new_tensor(ctx, &st->d, MTI_F32, N, dims[l], MT_MEM_WORK, MT_LIFE_PHASE,
                                     TAG(2 + l, 12))))
            break;
        op->matmul_bwd(l > 0 ? st->d.blk.ptr : NULL, gw->blk.ptr, gb->blk.ptr, cur.blk.ptr, in,
                       w->blk.ptr, N, dims[l], dims[l + 1], 0);
        mti_tensor_free(ctx, &cur);
        if (l == 0) break;
        /* through the activation of layer l-1, in place */
        float *d = st->d.blk.ptr;
        size_t n = (size_t)N * dims[l];
        if (m->mlp.activation == MT_ACT_RELU) {
            op->relu_bwd(d, d, st->h[l - 1].blk.ptr, n);
        } else {
            op->gelu_bwd(d, d, st->h[l - 1].blk.ptr, n);
            mti_tensor_free(ctx, &st->a[l - 1]);
        }
        mti_tensor_free(ctx, &st->h[l - 1]);
        cur = st->d;
        memset(&st->d, 0, sizeof st->d);
    }
    mti_tensor_free(ctx, &cur); /* only left on an error path */
    return s;
}

static void optimizer_step(mt_trainer *t, step_state *st)
{
    const mt_model *m = t->model;
    for (int i = 0; i < m->n_tensors; i++) {
        const mti_tensor *p = &m->params[i];
        float *mom = t->cfg.momentum > 0.0f ? t->momentum[i].blk.ptr : NULL;
        t->ctx->ops->sgd_update(p->blk.ptr, st->g[i].blk.ptr, mom, (size_t)mti_tensor_numel(p),
                                t->cfg.lr, t->cfg.momentum, t->cfg.weight_decay);
        mti_tensor_free(t->ctx, &st->g[i]); /* this gradient is done */
    }
}

static mt_status step_failed(mt_trainer *t, step_state *st, const char *fn, mt_status s)
{
    char msg[MTI_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", mt_last_error(t->ctx));
    step_release(t->ctx, st);
    reset_all(t->ctx, MT_SCOPE_STEP);
    return mti_fail(t->ctx, s, "%s: %s (weights and optimizer state unchanged)", fn, msg);
}

mt_status mt_trainer_step(mt_trainer *t, const mt_batch *b, float *loss)
{
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_trainer_step: trainer is NULL");
    mt_status s = check_batch(t, b, "mt_trainer_step");
    if (s) return s;
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    const int L = m->mlp.n_layers, N = b->n, C = m->mlp.dims[L];
    step_state st;
    memset(&st, 0, sizeof st);

    if ((s = forward(t, b, &st))) return step_failed(t, &st, "mt_trainer_step", s);
    /* loss, and dlogits in place of the logits: mean over the batch */
    ctx->ops->xent_fwd_bwd(st.losses.blk.ptr, st.h[L - 1].blk.ptr, st.h[L - 1].blk.ptr,
                           st.y.blk.ptr, N, C, 1.0f / (float)N);
    float mean = mean_loss(t, &st, N, &s);
    if (s) return step_failed(t, &st, "mt_trainer_step", s);
    reset_all(ctx, MT_SCOPE_PHASE); /* end of forward */

    if ((s = backward(t, N, &st))) return step_failed(t, &st, "mt_trainer_step", s);
    reset_all(ctx, MT_SCOPE_PHASE); /* end of backward */

    optimizer_step(t, &st);
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
    const mt_model *m = t->model;
    const int L = m->mlp.n_layers, N = b->n, C = m->mlp.dims[L];
    step_state st;
    memset(&st, 0, sizeof st);
    if ((s = forward(t, b, &st))) return step_failed(t, &st, "mt_trainer_eval", s);
    ctx->ops->xent_fwd(st.losses.blk.ptr, st.h[L - 1].blk.ptr, st.y.blk.ptr, N, C);
    float mean = mean_loss(t, &st, N, &s);
    if (!s && accuracy)
        s = mti_tensor_download(ctx, &st.h[L - 1], t->host_logits, (size_t)N * C * sizeof(float));
    if (s) return step_failed(t, &st, "mt_trainer_eval", s);
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
