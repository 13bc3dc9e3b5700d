/*
 * optim_adafactor.c - Adafactor as transformers' Adafactor (kernels.h,
 * mti_adafactor_args). State: a matrix's second moment factored into row
 * and column sums (rows + cols floats), other tensors' in full; the first
 * moment (one float per element) when beta1 > 0. The update needs the
 * whole tensor (RMS, factored statistics) in fp32.
 *
 * A pruned matrix (lib/sparse/sparse.h) keeps its factored statistics over
 * its dense rows and columns and its first moment for the kept entries
 * alone, and is updated as the dense matrix with zeros at the pruned
 * places: its weights, gradient and first moment expanded into dense fp32
 * WORK tiles (and the compute copy's, in its dtype), the update, the kept
 * values gathered back. A pruned place's gradient is 0, so its update is 0
 * and it stays 0; the RMS and the statistics count it as the dense
 * matrix's zero.
 */
#include <math.h>

#include "optim/optim.h"

static double traffic(const mt_trainer_config *c, int *quantized)
{
    (void)c;
    *quantized = 0;
    return 52; /* several passes over p and g (the update is recomputed, not stored) */
}

#define BAD(...) return mti_fail(ctx, MT_ERR_INVALID_ARG, __VA_ARGS__)

static mt_status check(mt_context *ctx, const mt_trainer_config *c)
{
    const char *fn = "mt_trainer_create";
    const mt_adafactor_config *af = &c->adafactor;
    if (!(af->eps1 >= 0.0f) || !(af->eps2 >= 0.0f) || !isfinite(af->eps1) || !isfinite(af->eps2))
        BAD("%s: cfg->adafactor.eps1 and eps2 must be finite and >= 0", fn);
    if (!(af->clip_threshold > 0.0f) || !isfinite(af->clip_threshold))
        BAD("%s: cfg->adafactor.clip_threshold %g must be > 0", fn, (double)af->clip_threshold);
    if (!(af->decay_rate < 0.0f) || !isfinite(af->decay_rate))
        BAD("%s: cfg->adafactor.decay_rate %g must be < 0", fn, (double)af->decay_rate);
    if (!(isfinite(af->beta1) && af->beta1 >= 0.0f && af->beta1 < 1.0f))
        BAD("%s: cfg->adafactor.beta1 %g out of range [0, 1)", fn, (double)af->beta1);
    if (af->warmup_init && !af->relative_step)
        BAD("%s: cfg->adafactor.warmup_init needs relative_step", fn);
    return MT_OK;
}

static int has_ops(const mti_ops *ops) { return ops->adafactor != NULL; }

static void layout(const mt_trainer_config *c, const mti_param *p, const mt_param_override *o,
                   mti_opt_layout *out)
{
    (void)o;
    const int64_t n = (int64_t)p->numel;
    *out = (mti_opt_layout){.bits = 32};
    if (p->ndim == 2) { /* factored */
        out->s[0] = (mti_opt_state){MTI_F32, p->shape[0], 0, 0};
        out->s[1] = (mti_opt_state){MTI_F32, p->shape[1], 0, 0};
    } else {
        out->s[2] = (mti_opt_state){MTI_F32, n, 1, 0};
    }
    if (c->adafactor.beta1 > 0.0f) out->s[3] = (mti_opt_state){MTI_F32, n, 1, 0};
}

/* The update of a pruned matrix through dense tiles (above). */
static mt_status update_pruned(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], float *w32,
                               void *pc, const float *g, const mti_adafactor_args *args)
{
    const mti_param *p = a->p;
    const mti_kctx *k = a->k;
    const mti_ops *op = a->ops;
    const mti_sp_layout *L = &p->sp->L;
    const void *meta = p->sp->meta.blk.ptr;
    const size_t d = L->dense, tile = mti_align_up(d * sizeof(float), 64);
    const bool m1 = a->layout->s[3].numel > 0;
    const size_t pcb = pc ? mti_align_up(d * mti_dtype_size(a->pc_dt), 64) : 0;
    mt_block blk = {0};
    mt_status s = mti_work_alloc(k, (m1 ? 3 : 2) * tile + pcb, &blk);
    if (s) return s;
    char *b = blk.ptr;
    float *P = (float *)b, *G = (float *)(b + tile), *M = m1 ? (float *)(b + 2 * tile) : NULL;
    void *PC = pc ? b + (m1 ? 3 : 2) * tile : NULL;
    s = op->sparse_expand(k, P, w32, meta, L, 0, d, MTI_F32);
    if (!s) s = op->sparse_expand(k, G, g, meta, L, 0, d, MTI_F32);
    if (!s && m1) s = op->sparse_expand(k, M, st[3], meta, L, 0, d, MTI_F32);
    if (!s)
        s = op->adafactor(k, P, G, st[0], st[1], NULL, M, PC, a->pc_dt, p->shape[0], p->shape[1], 1,
                          args);
    if (!s) s = op->sparse_compress(k, w32, P, meta, L, 0, d, MTI_F32, 0);
    if (!s && m1) s = op->sparse_compress(k, st[3], M, meta, L, 0, d, MTI_F32, 0);
    if (!s && pc) s = op->sparse_compress(k, pc, PC, meta, L, 0, d, a->pc_dt, 0);
    mti_work_free(k, &blk);
    return s;
}

static mt_status update(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], float *w32,
                        void *pc, const float *g, size_t at, size_t n)
{
    (void)at, (void)n; /* the whole tensor */
    const mt_adafactor_config *af = &a->cfg->adafactor;
    const mti_param *p = a->p;
    mti_adafactor_args args = {.lr = a->lr,
                               .eps1 = af->eps1,
                               .eps2 = af->eps2,
                               .clip_threshold = af->clip_threshold,
                               .decay_rate = af->decay_rate,
                               .beta1 = af->beta1,
                               .weight_decay = a->weight_decay,
                               .scale_parameter = af->scale_parameter,
                               .relative_step = af->relative_step,
                               .warmup_init = af->warmup_init,
                               .step = a->step,
                               .grad_scale = a->grad_scale};
    if (p->sp) return update_pruned(a, st, w32, pc, g, &args);
    const int factored = p->ndim == 2;
    const int64_t rows = factored ? p->shape[0] : 1;
    const int64_t cols = factored ? p->shape[1] : (int64_t)p->numel;
    return a->ops->adafactor(a->k, w32, g, st[0], st[1], st[2], st[3], pc, a->pc_dt, rows, cols,
                             factored, &args);
}

const mti_optim mti_optim_adafactor = {
    .kind = MT_OPT_ADAFACTOR,
    .name = "adafactor",
    .title = "Adafactor",
    .sliceable = 0,
    .needs_masters = 1,
    .traffic = traffic,
    .check = check,
    .has_ops = has_ops,
    .layout = layout,
    .update = update,
};
