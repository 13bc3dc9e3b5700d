/*
 * sparsity.c - the trainer's pruning (mt_trainer_config.prune): when each
 * prune happens, Wanda's calibration, and each target's optimizer state
 * rebuilt for its new mask beside its weights (lib/sparse/prune.c).
 *
 * A prune at create (a one-shot magnitude prune at step 0) comes before
 * the optimizer state is planned, so the state is made for the kept
 * entries alone; a prune at a step's start rebuilds the state of each
 * target through mti_param_prune's hook, one tensor at a time, each slot
 * gathered by the new mask from its old one (an entry the old mask did not
 * keep starts at 0). The step's gradients are gone by then.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train/sparsity.h"
#include "train/trainer.h"

struct mti_sparsity {
    unsigned char *tg;   /* per parameter: a target */
    char *targets;       /* cfg.prune.targets' copy */
    float **norms;       /* Wanda: per target, its input columns' sums of squares (host) */
    int calibrated;      /* batches gathered into them since the last prune */
    int64_t done_at;     /* the step whose prune is done (-1: none) */
    /* RigL's step: per target, the mask after the drop and the new one
       (host, made by grow_hook), and whether every target's was made */
    uint64_t **drop, **grown;
    int regrow_bad;
    mti_prune_undo *undo; /* a prune at create, undone if the creation fails */
    int64_t stepped_at;   /* the step that made a prune at its start (-1: none) */
};

/* What a prune at create changed: each target's dense values before it
 * (host), and its mask then (NULL: dense). */
struct mti_prune_undo {
    int n;
    float **vals;        /* per target, the values the prune removes, in element order */
    uint64_t **keep;     /* ... its mask before (NULL: dense) */
    uint64_t **next;     /* ... and the prune's */
    mti_sp_layout *L;    /* ... its layout before (a pruned one's) */
};

void mti_prune_undo_free(mti_prune_undo *u)
{
    if (!u) return;
    for (int i = 0; i < u->n; i++) free(u->vals[i]), free(u->keep[i]), free(u->next[i]);
    free(u->vals), free(u->keep), free(u->next), free(u->L), free(u);
}

/* What a prune at create to the masks next (per target) removes: the
 * values of the elements it prunes that were kept (host; the pruned
 * fraction of the targets' values, until the creation succeeds), the masks
 * before and after. Nothing is kept when it fails (nothing was pruned). */
static mt_status undo_save(mt_trainer *t, uint64_t *const *next)
{
    const mt_model *m = t->model;
    mti_sparsity *sp = t->sparsity;
    if (t->ctx->dry) return MT_OK;
    mti_prune_undo *u = calloc(1, sizeof *u);
    if (u) {
        u->n = m->n_param;
        u->vals = calloc((size_t)m->n_param, sizeof *u->vals);
        u->keep = calloc((size_t)m->n_param, sizeof *u->keep);
        u->next = calloc((size_t)m->n_param, sizeof *u->next);
        u->L = calloc((size_t)m->n_param, sizeof *u->L);
    }
    mt_status s = u && u->vals && u->keep && u->next && u->L
                      ? MT_OK
                      : mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    float *x = NULL;
    for (int i = 0; i < m->n_param && !s; i++) {
        if (!sp->tg[i] || !next[i]) continue;
        const mti_param *p = &m->params[i];
        const size_t n = mti_param_dense(p), w = mti_sp_words(n) * 8 + 8;
        u->keep[i] = malloc(w), u->next[i] = malloc(w);
        free(x);
        x = malloc(n * sizeof *x);
        if (!u->keep[i] || !u->next[i] || !x) {
            s = mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
            break;
        }
        memcpy(u->next[i], next[i], mti_sp_words(n) * 8);
        s = mti_param_keep(m, i, u->keep[i]);
        if (!s) s = mti_param_read(m, i, 0, n, x);
        size_t gone = 0;
        for (size_t e = 0; !s && e < n; e++)
            gone += (u->keep[i][e / 64] >> (e % 64) & 1) && !(next[i][e / 64] >> (e % 64) & 1);
        if (!s && !(u->vals[i] = malloc((gone ? gone : 1) * sizeof(float))))
            s = mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
        for (size_t e = 0, k = 0; !s && e < n; e++)
            if ((u->keep[i][e / 64] >> (e % 64) & 1) && !(next[i][e / 64] >> (e % 64) & 1))
                u->vals[i][k++] = x[e];
        if (p->sp) u->L[i] = p->sp->L;
        else free(u->keep[i]), u->keep[i] = NULL;
    }
    free(x);
    if (s) {
        mti_prune_undo_free(u);
        return s;
    }
    sp->undo = u;
    return MT_OK;
}

mti_prune_undo *mti_sparsity_take_undo(mt_trainer *t)
{
    mti_prune_undo *u = t->sparsity ? t->sparsity->undo : NULL;
    if (t->sparsity) t->sparsity->undo = NULL;
    return u;
}

void mti_prune_undo_apply(mt_model *m, mti_prune_undo *u)
{
    for (int i = 0; u && i < u->n && i < m->n_param; i++) {
        if (!u->vals[i]) continue;
        mti_param *p = &m->params[i];
        const size_t n = mti_param_dense(p);
        float *x = malloc(n * sizeof *x);
        mt_status s = x ? MT_OK : mti_fail(m->ctx, MT_ERR_OOM, "out of host memory");
        /* the mask before (its pruned elements' values come back below) */
        if (!s) s = u->keep[i] ? mti_param_prune(m, i, u->keep[i], u->L[i].nnz, u->L[i].fmt,
                                                 u->L[i].n, u->L[i].m, NULL, NULL)
                               : mti_param_unprune(m, i);
        if (!s) s = mti_param_read(m, i, 0, n, x);
        for (size_t e = 0, k = 0; !s && e < n; e++) {
            const bool kept = !u->keep[i] || (u->keep[i][e / 64] >> (e % 64) & 1);
            if (kept && !(u->next[i][e / 64] >> (e % 64) & 1)) x[e] = u->vals[i][k++];
        }
        if (!s) s = mti_param_write(m, i, 0, n, x);
        free(x);
        if (s)
            mti_log(m->ctx, MT_LOG_WARN, "mt_trainer_create: %s could not be given back as it "
                    "was before the failed creation pruned it: %s", p->name, mti_last_msg(m->ctx).s);
    }
    mti_prune_undo_free(u);
}

/* What a trainer of a pruned model (or one that prunes) cannot do yet, or
 * NULL. */
static const char *combo_refused(const mt_context *ctx, const mt_trainer_config *c, int zero)
{
    const mt_prune_config *p = &c->prune;
    return zero                           ? "ZeRO on several ranks"
           : c->offload != MT_PLACE_DEVICE  ? "offload"
           : c->tensor_parallel > 1         ? "tensor parallel"
           : c->pipeline_parallel > 1       ? "pipeline parallel"
           : c->base != MT_BASE_FULL        ? "a quantized base"
           : p->method == MT_PRUNE_WANDA && ctx->world > 1
               ? "Wanda on several ranks (each rank's calibration is its own)"
               : NULL;
}

static bool model_pruned(const mt_model *m)
{
    for (int i = 0; i < m->n_param; i++)
        if (m->params[i].sp) return true;
    return false;
}

mt_status mti_sparsity_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *c,
                             int zero)
{
    const mt_prune_config *p = &c->prune;
    const char *fn = "mt_trainer_create";
    if ((unsigned)p->kernel > MT_SPARSE_KERNEL_SPARSE)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: prune.kernel %d is not auto (0), dense (1) or sparse (2)", fn,
                        (int)p->kernel);
    if (p->method == MT_PRUNE_NONE) { /* a model pruned before: what its trainer cannot do */
        const char *why = model_pruned(m) ? combo_refused(ctx, c, zero) : NULL;
        if (why)
            return mti_fail(ctx, MT_ERR_UNSUPPORTED, "%s: the model is pruned: its trainer does "
                            "not combine with %s yet", fn, why);
        return MT_OK;
    }
    unsigned char *tg = calloc((size_t)m->n_param + 1, 1);
    if (!tg) return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    mt_status s = mti_prune_check(ctx, m, p, fn, tg);
    free(tg);
    if (s) return s;
    const char *why = combo_refused(ctx, c, zero);
    if (why)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED, "%s: pruning (cfg->prune) does not combine with %s",
                        fn, why);
    if (p->regrow != MT_REGROW_NONE) {
        if (p->regrow != MT_REGROW_RIGL)
            return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: prune.regrow %d is not none (0) or rigl (1)",
                            fn, (int)p->regrow);
        if (p->regrow_every < 1 || !(p->regrow_frac > 0.0 && p->regrow_frac <= 1.0) ||
            p->regrow_end < 1)
            return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: RigL needs regrow_every >= 1 (%lld), "
                            "regrow_frac in (0, 1] (%g) and regrow_end >= 1 (%lld)", fn,
                            (long long)p->regrow_every, p->regrow_frac, (long long)p->regrow_end);
        if (p->nm_m)
            return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: RigL changes unstructured masks, not N:M", fn);
        if (p->kernel == MT_SPARSE_KERNEL_SPARSE)
            return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: RigL takes the dense gradient of its "
                            "regrowth steps from the dense tile: prune.kernel sparse does not "
                            "combine with it (auto uses the dense tile)", fn);
        const int micro = c->micro_batch ? c->micro_batch : c->max_batch;
        const char *no = ctx->world > 1                  ? "several ranks"
                         : micro < c->max_batch          ? "gradient accumulation (micro_batch below max_batch)"
                         : c->fused_step                 ? "the fused step"
                         : c->optimizer == MT_OPT_ADAMW8 ? "8-bit AdamW (its state is quantized in blocks of the kept entries)"
                         : c->optimizer == MT_OPT_ADAMW4 ? "4-bit AdamW (its state is quantized in blocks of the kept entries)"
                                                         : NULL;
        if (no)
            return mti_fail(ctx, MT_ERR_UNSUPPORTED, "%s: RigL does not combine with %s yet (it "
                            "takes the dense gradient of the step's one pass)", fn, no);
    }
    if (mti_prune_later(p) && (c->optimizer == MT_OPT_ADAMW8 || c->optimizer == MT_OPT_ADAMW4))
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: a prune after create does not combine with %d-bit AdamW (its state is "
                        "quantized in blocks of the kept entries); prune at step 0 by magnitude, "
                        "or use AdamW or SGD", fn, c->optimizer == MT_OPT_ADAMW8 ? 8 : 4);
    return MT_OK;
}

int mti_sparsity_kernel(const mt_trainer_config *c)
{
    const mt_prune_config *p = &c->prune;
    return p->method != MT_PRUNE_NONE && p->regrow != MT_REGROW_NONE ? MT_SPARSE_KERNEL_DENSE
                                                                    : (int)p->kernel;
}

bool mti_sparsity_pruned_now(const mt_trainer *t)
{
    return t->sparsity && t->sparsity->stepped_at == (int64_t)t->steps;
}

bool mti_sparsity_changes_later(const mt_trainer *t)
{
    const mt_prune_config *p = &t->cfg.prune;
    if (!t->sparsity) return false;
    return p->schedule == MT_PRUNE_GRADUAL || p->at > 0 || p->method == MT_PRUNE_WANDA ||
           p->regrow != MT_REGROW_NONE;
}

void mti_sparsity_free(mt_trainer *t)
{
    mti_sparsity *sp = t->sparsity;
    if (!sp) return;
    for (int i = 0; sp->norms && i < t->model->n_param; i++) free(sp->norms[i]);
    free(sp->norms);
    for (int i = 0; i < t->model->n_param; i++) {
        if (sp->drop) free(sp->drop[i]);
        if (sp->grown) free(sp->grown[i]);
    }
    free(sp->drop);
    free(sp->grown);
    mti_prune_undo_free(sp->undo);
    free(sp->tg);
    free(sp->targets);
    free(sp);
    t->sparsity = NULL;
}

/* Whether a prune is due after `step` steps, and to which sparsity. */
static bool due(const mt_prune_config *c, int64_t step, double *frac)
{
    if (c->schedule == MT_PRUNE_ONESHOT) {
        *frac = c->sparsity;
        return step == c->at;
    }
    if (step < c->start || step > c->end) return false;
    *frac = mti_sp_gradual(c->sparsity, c->start, c->end, step);
    return (step - c->start) % c->every == 0 || step == c->end;
}

/* The first step from `from` on whose prune is due and not done. */
static int64_t next_due(const mt_prune_config *c, int64_t from, int64_t done)
{
    for (int tries = 0; tries < 2; tries++, from++) {
        int64_t k;
        if (c->schedule == MT_PRUNE_ONESHOT) k = c->at >= from ? c->at : -1;
        else if (from > c->end) k = -1;
        else if (from <= c->start) k = c->start;
        else k = c->start + (from - c->start + c->every - 1) / c->every * c->every;
        if (k > c->end && c->schedule == MT_PRUNE_GRADUAL) k = c->end;
        if (k < 0 || k != done) return k;
        from = k;
    }
    return -1;
}

/* mti_param_prune's hook: parameter i's optimizer state gathered by its
 * new mask (every slot follows its elements one by one: checked at create). */
static mt_status state_hook(void *user, int i, const mti_psparse *old, const mti_psparse *nw)
{
    mt_trainer *t = user;
    pstate *ps = &t->ps[i];
    mti_tensor nt[MTI_OPT_SLOTS];
    memset(nt, 0, sizeof nt);
    mt_status s = MT_OK;
    for (int j = 0; j < MTI_OPT_SLOTS && !s; j++) {
        if (!ps->s[j].blk.ptr || ps->lay.s[j].per == 0) continue; /* (whole-tensor statistics
                                                                     of the dense shape stay) */
        if (ps->lay.s[j].per != 1)
            s = mti_fail(t->ctx, MT_ERR_UNSUPPORTED, "prune: %s's optimizer state slot %d is not "
                         "elementwise", t->model->params[i].name, j);
        if (!s) s = mti_sp_relay(t->ctx, &ps->s[j], old, nw, MTI_TAG_PARAM(MTI_TAG_STATE + j, i), &nt[j]);
    }
    if (!s) s = t->ctx->dev->sync(t->ctx->dev);
    for (int j = 0; j < MTI_OPT_SLOTS; j++) {
        if (s) {
            mti_tensor_free(t->ctx, &nt[j]);
            continue;
        }
        if (ps->lay.s[j].numel && ps->lay.s[j].per == 1) ps->lay.s[j].numel = (int64_t)nw->L.nnz;
        if (!nt[j].blk.ptr) continue;
        mti_tensor_free(t->ctx, &ps->s[j]);
        ps->s[j] = nt[j];
    }
    if (!s) t->sh[i].hi = t->sh[i].lo + nw->L.nnz; /* this rank's elements: all of them */
    return s;
}

/* Prunes the targets to sparsity frac (the state rebuilt once it exists). */
static mt_status prune_now(mt_trainer *t, double frac, bool state)
{
    mt_model *m = t->model;
    mti_sparsity *sp = t->sparsity;
    const mt_prune_config *c = &t->cfg.prune;
    uint64_t **keep = calloc((size_t)m->n_param, sizeof *keep);
    size_t *nnz = calloc((size_t)m->n_param, sizeof *nnz);
    mt_status s = keep && nnz ? MT_OK : mti_fail(t->ctx, MT_ERR_OOM, "prune: out of host memory");
    if (!s) s = mti_prune_masks(m, c, frac, sp->tg, sp->norms, keep, nnz);
    if (!s && !state) s = undo_save(t, keep); /* (at create: the model as it was, should it fail) */
    if (!s) s = mti_prune_apply(m, c, sp->tg, keep, nnz, state ? state_hook : NULL, t);
    for (int i = 0; !s && !state && i < m->n_param; i++) /* (at create: no state yet) */
        if (sp->tg[i]) t->sh[i].hi = t->sh[i].lo + m->params[i].numel;
    if (keep) mti_prune_free_masks(m, keep);
    free(keep);
    free(nnz);
    return s;
}

mt_status mti_sparsity_can_adopt(const mt_trainer *t, int i, const mti_sp_layout *L,
                                 const char *fn)
{
    const mti_param *p = &t->model->params[i];
    const mti_sp_layout *now = p->sp ? &p->sp->L : NULL;
    if (now && now->fmt == L->fmt && now->nnz == L->nnz && now->n == L->n && now->m == L->m)
        return MT_OK; /* (only the mask's bits are taken) */
    const char *why = t->zero                               ? "ZeRO on several ranks"
                      : t->off || t->hoff                   ? "offload"
                      : t->tp.size > 1 || t->pp.size > 1    ? "tensor or pipeline parallel"
                      : t->q || t->s2 || t->fq || t->ag_on  ? "the gradients summed on the communication thread or stream"
                                                            : NULL;
    for (int j = 0; !why && !p->frozen && j < MTI_OPT_SLOTS; j++)
        if (t->ps[i].lay.s[j].numel && t->ps[i].lay.s[j].per > 1)
            why = "optimizer state in blocks (8-bit or 4-bit AdamW)";
    if (why)
        return mti_fail(t->ctx, MT_ERR_UNSUPPORTED, "%s: the file's %s keeps %zu of %zu elements, "
                        "the trainer's %zu: taking the file's mask does not combine with %s (the "
                        "trainer is unchanged)", fn, p->name, L->nnz, L->dense,
                        now ? now->nnz : mti_param_dense(p), why);
    return MT_OK;
}

mt_status mti_sparsity_adopt(mt_trainer *t, int i, const mti_sp_layout *L, const void *meta)
{
    mt_model *m = t->model;
    mti_param *p = &m->params[i];
    const mti_sp_layout *now = p->sp ? &p->sp->L : NULL;
    if (!now || now->fmt != L->fmt || now->nnz != L->nnz || now->n != L->n || now->m != L->m) {
        uint64_t *keep = malloc(mti_sp_words(L->dense) * 8 + 8);
        if (!keep) return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
        mti_sp_decode(L, meta, keep);
        mt_status s = mti_param_prune(m, i, keep, L->nnz, L->fmt, L->n, L->m, state_hook, t);
        free(keep);
        if (s) return s;
    }
    mt_status s = mti_tensor_upload(t->ctx, &p->sp->meta, meta, L->bytes);
    if (!s && p->sp->host) memcpy(p->sp->host, meta, L->bytes); /* (the host's copy alike) */
    return s;
}

mt_status mti_sparsity_create(mt_trainer *t)
{
    const mt_prune_config *c = &t->cfg.prune;
    mt_model *m = t->model;
    if (c->method == MT_PRUNE_NONE) return MT_OK;
    mti_sparsity *sp = t->sparsity = calloc(1, sizeof *sp);
    if (sp) {
        sp->done_at = -1;
        sp->stepped_at = -1;
        sp->tg = calloc((size_t)m->n_param + 1, 1);
        sp->targets = c->targets ? strdup(c->targets) : NULL;
    }
    if (!sp || !sp->tg || (c->targets && !sp->targets))
        return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    t->cfg.prune.targets = sp->targets;
    mt_status s = mti_prune_check(t->ctx, m, c, "mt_trainer_create", sp->tg);
    if (!s && c->method == MT_PRUNE_WANDA) {
        if (!(sp->norms = calloc((size_t)m->n_param, sizeof *sp->norms)))
            return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
        for (int i = 0; i < m->n_param; i++)
            if (sp->tg[i] && !(sp->norms[i] = calloc((size_t)m->params[i].shape[1], sizeof(float))))
                return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    }
    double frac;
    if (!s && c->method == MT_PRUNE_MAGNITUDE && due(c, 0, &frac)) { /* before the state is planned */
        s = prune_now(t, frac, false);
        sp->done_at = 0;
    }
    return s;
}

mt_status mti_sparsity_step(mt_trainer *t, const char *fn)
{
    mti_sparsity *sp = t->sparsity;
    const mt_prune_config *c = &t->cfg.prune;
    double frac;
    const int64_t step = (int64_t)t->steps;
    if (!sp || sp->done_at == step || !due(c, step, &frac)) return MT_OK;
    if (c->method == MT_PRUNE_WANDA && sp->calibrated < c->calib && !t->ctx->dry) /* (an
        estimate plans the prune without values) */
        return mti_fail(t->ctx, MT_ERR_STATE,
                        "%s: Wanda's prune after %lld steps needs %d calibration batches "
                        "(mt_trainer_calibrate) since the last prune, and has %d", fn,
                        (long long)step, c->calib, sp->calibrated);
    mti_engine_free_grads(&t->E); /* (none should be left between steps) */
    sp->stepped_at = step; /* (made, or partly made, from here on) */
    mt_status s = prune_now(t, frac, true);
    if (s) return s;
    sp->done_at = step;
    if (sp->norms) { /* the next prune calibrates afresh */
        for (int i = 0; i < t->model->n_param; i++)
            if (sp->norms[i]) memset(sp->norms[i], 0, (size_t)t->model->params[i].shape[1] * sizeof(float));
        sp->calibrated = 0;
    }
    return MT_OK;
}

mt_status mti_sparsity_calib(void *user, int wi, const void *x, int n, int in, mti_dtype dt)
{
    mt_trainer *t = user;
    mti_sparsity *sp = t->sparsity;
    if (!sp->norms[wi] || t->ctx->dry) return MT_OK;
    const size_t es = mti_dtype_size(dt), bytes = (size_t)n * (size_t)in * es;
    unsigned char *h = malloc(bytes ? bytes : 1);
    double *acc = calloc((size_t)in, sizeof *acc);
    mt_status s = h && acc ? MT_OK : mti_fail(t->ctx, MT_ERR_OOM, "calibrate: out of host memory");
    if (!s) s = t->ctx->dev->copy_d2h(t->ctx->dev, h, x, bytes);
    if (!s) s = t->ctx->dev->sync(t->ctx->dev);
    for (int r = 0; !s && r < n; r++)
        for (int j = 0; j < in; j++) {
            const size_t e = (size_t)r * (size_t)in + (size_t)j;
            uint16_t u;
            float v;
            if (dt == MTI_F32) memcpy(&v, h + e * 4, 4);
            else memcpy(&u, h + e * 2, 2), v = dt == MTI_BF16 ? mti_bf16_to_f32(u) : mti_f16_to_f32(u);
            acc[j] += (double)v * v;
        }
    for (int j = 0; !s && j < in; j++) sp->norms[wi][j] += (float)acc[j];
    free(h);
    free(acc);
    return s;
}

bool mti_sparsity_wanda(const mt_trainer *t) { return t->sparsity && t->sparsity->norms; }

void mti_sparsity_calibrated(mt_trainer *t) { t->sparsity->calibrated++; }

/* ---- RigL ---- */

static bool regrow_due(const mt_prune_config *c, int64_t step)
{
    double f;
    return c->regrow == MT_REGROW_RIGL && step > 0 && step % c->regrow_every == 0 &&
           step < c->regrow_end && !due(c, step, &f);
}

/* The engine's hook in a RigL step: target i's new masks from its dense
 * gradient g (device) and its weights. */
static mt_status grow_hook(void *user, int i, const float *g, size_t n)
{
    mt_trainer *t = user;
    mti_sparsity *sp = t->sparsity;
    const mt_model *m = t->model;
    const mti_param *p = &m->params[i];
    if (!sp->tg[i] || !p->sp || p->sp->L.fmt != MTI_SP_BITMAP) return MT_OK;
    const double f = mti_sp_rigl_frac(t->cfg.prune.regrow_frac, (int64_t)t->steps,
                                      t->cfg.prune.regrow_end);
    const size_t kept = p->sp->L.nnz, k = (size_t)floor(f * (double)kept), words = mti_sp_words(n);
    float *gh = malloc(n * sizeof *gh), *w = malloc(n * sizeof *w);
    uint64_t *drop = malloc(words * 8 + 8), *grown = malloc(words * 8 + 8);
    mt_status s = gh && w && drop && grown ? MT_OK : mti_fail(t->ctx, MT_ERR_OOM, "RigL: out of host memory");
    if (!s) s = t->ctx->dev->copy_d2h(t->ctx->dev, gh, g, n * sizeof *gh);
    if (!s) s = t->ctx->dev->sync(t->ctx->dev);
    if (!s) s = mti_param_read(m, i, 0, n, w);
    if (!s) s = mti_param_keep(m, i, drop);
    bool finite = true;
    for (size_t e = 0; !s && e < n; e++) {
        finite &= isfinite(gh[e]) != 0;
        gh[e] = fabsf(gh[e]), w[e] = fabsf(w[e]);
    }
    if (!s && !finite) sp->regrow_bad = 1; /* (an overflow: the masks stay) */
    if (!s && finite) {
        mti_sp_seg seg = {w, n, drop};
        s = mti_sp_prune_smallest(t->ctx, &seg, 1, (n - kept) + k); /* the drop */
    }
    if (!s && finite) {
        memcpy(grown, drop, words * 8);
        s = mti_sp_grow(t->ctx, gh, n, grown, k);
    }
    free(gh), free(w);
    if (s || !finite) {
        free(drop), free(grown);
        return s;
    }
    free(sp->drop[i]), free(sp->grown[i]);
    sp->drop[i] = drop, sp->grown[i] = grown;
    return MT_OK;
}

bool mti_sparsity_regrow_begin(mt_trainer *t)
{
    mti_sparsity *sp = t->sparsity;
    if (!sp || !regrow_due(&t->cfg.prune, (int64_t)t->steps)) return false;
    const mt_model *m = t->model;
    bool pruned = false; /* (before the first prune there is no mask to change) */
    for (int i = 0; i < m->n_param; i++) pruned |= sp->tg[i] && m->params[i].sp != NULL;
    if (!pruned) return false;
    const int np = m->n_param;
    if (!sp->drop) sp->drop = calloc((size_t)np, sizeof *sp->drop);
    if (!sp->grown) sp->grown = calloc((size_t)np, sizeof *sp->grown);
    if (!sp->drop || !sp->grown) return false; /* (no host memory: an ordinary step) */
    sp->regrow_bad = 0;
    t->E.grow = grow_hook;
    t->E.grow_user = t;
    return true;
}

mt_status mti_sparsity_regrow_end(mt_trainer *t, bool apply)
{
    mti_sparsity *sp = t->sparsity;
    mt_model *m = t->model;
    t->E.grow = NULL;
    mt_status s = MT_OK;
    mti_engine_free_grads(&t->E); /* (the step's sparse gradients are not used) */
    for (int i = 0; i < m->n_param; i++) {
        if (!sp->grown || !sp->drop[i]) continue;
        if (apply && !sp->regrow_bad && !s) { /* drop (their values 0), then grow (from 0) */
            const mti_sp_layout *L = &m->params[i].sp->L;
            const size_t nd = mti_sp_kept(sp->drop[i], L->dense), ng = mti_sp_kept(sp->grown[i], L->dense);
            s = mti_param_prune(m, i, sp->drop[i], nd, MTI_SP_BITMAP, 0, 0, state_hook, t);
            if (!s) s = mti_param_prune(m, i, sp->grown[i], ng, MTI_SP_BITMAP, 0, 0, state_hook, t);
        }
        free(sp->drop[i]), free(sp->grown[i]);
        sp->drop[i] = sp->grown[i] = NULL;
    }
    return s;
}

mt_status mt_trainer_prune_next(const mt_trainer *t, int64_t *step, int *calib)
{
    if (!t || !step) return mti_fail(t ? t->ctx : NULL, MT_ERR_INVALID_ARG, "mt_trainer_prune_next: a NULL argument");
    *step = -1;
    if (calib) *calib = 0;
    const mti_sparsity *sp = t->sparsity;
    if (!sp) return MT_OK;
    const mt_prune_config *c = &t->cfg.prune;
    *step = next_due(c, (int64_t)t->steps, sp->done_at);
    if (calib && *step >= 0 && c->method == MT_PRUNE_WANDA)
        *calib = c->calib > sp->calibrated ? c->calib - sp->calibrated : 0;
    return MT_OK;
}
