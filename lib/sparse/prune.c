/*
 * prune.c - choosing a model's masks (magnitude per tensor or global, Wanda
 * per row, N:M; lib/sparse/mask.c's selections on scores read from the
 * weights) and applying them (storage.c), and the public calls on a
 * model's pruning: mt_model_prune, mt_prune_check, mt_model_param_mask,
 * mt_model_sparsity.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "ops/kernels.h"

/* ---- choosing the masks ---- */

static bool nm_on(const mt_prune_config *c) { return c->nm_m > 0; }

/* (sparse.h) */
bool mti_prune_later(const mt_prune_config *p)
{
    return p->method != MT_PRUNE_NONE &&
           (p->schedule == MT_PRUNE_GRADUAL ||
            (p->schedule == MT_PRUNE_ONESHOT && (p->at > 0 || p->method == MT_PRUNE_WANDA)));
}

mt_status mti_prune_check(mt_context *ctx, const mt_model *m, const mt_prune_config *c,
                          const char *fn, unsigned char *tg)
{
#define PBAD(...) return mti_fail(ctx, MT_ERR_INVALID_ARG, __VA_ARGS__)
    if (c->method != MT_PRUNE_MAGNITUDE && c->method != MT_PRUNE_WANDA)
        PBAD("%s: prune.method %d is not magnitude (1) or wanda (2)", fn, (int)c->method);
    if (!nm_on(c) && !(isfinite(c->sparsity) && c->sparsity >= 0.0 && c->sparsity < 1.0))
        PBAD("%s: prune.sparsity %g is outside [0, 1)", fn, c->sparsity);
    if ((c->nm_n || c->nm_m) &&
        !(c->nm_m >= 2 && c->nm_m <= MTI_SP_MAX_M && c->nm_n > 0 && c->nm_n < c->nm_m))
        PBAD("%s: prune N:M %d:%d needs 0 < N < M <= %d", fn, c->nm_n, c->nm_m, MTI_SP_MAX_M);
    if (c->scope != MT_PRUNE_TENSOR && c->scope != MT_PRUNE_GLOBAL)
        PBAD("%s: prune.scope %d is not tensor (0) or global (1)", fn, (int)c->scope);
    if (c->scope == MT_PRUNE_GLOBAL && (c->method == MT_PRUNE_WANDA || nm_on(c)))
        PBAD("%s: prune.scope global is for unstructured magnitude pruning (Wanda and N:M "
             "compare within rows)", fn);
    if (c->schedule != MT_PRUNE_ONESHOT && c->schedule != MT_PRUNE_GRADUAL)
        PBAD("%s: prune.schedule %d is not one-shot (0) or gradual (1)", fn, (int)c->schedule);
    if (c->schedule == MT_PRUNE_ONESHOT && c->at < 0) PBAD("%s: prune.at %lld is negative", fn, (long long)c->at);
    if (c->schedule == MT_PRUNE_GRADUAL) {
        if (c->start < 0 || c->end < c->start || c->every < 1)
            PBAD("%s: the gradual prune needs 0 <= start (%lld) <= end (%lld) and every >= 1 "
                 "(%lld)", fn, (long long)c->start, (long long)c->end, (long long)c->every);
        if (nm_on(c))
            PBAD("%s: N:M pruning is one-shot (a gradual schedule ends at N:M from the start)", fn);
    }
    if (c->method == MT_PRUNE_WANDA && c->calib < 1)
        PBAD("%s: Wanda needs prune.calib >= 1 calibration batches (got %d)", fn, c->calib);
    /* the targets: linear weights, every pattern matching */
    int hits[64] = {0}, npat = 0;
    if (c->targets && *c->targets) {
        npat = 1;
        for (const char *q = c->targets; *q; q++) npat += *q == ',';
        if (npat > 64) PBAD("%s: prune.targets has %d patterns (at most 64)", fn, npat);
    }
    int any = 0;
    for (int i = 0; i < m->n_param; i++) {
        const mti_param *p = &m->params[i];
        tg[i] = 0;
        if (p->adapter_of >= 0) continue;
        if (c->targets && *c->targets) {
            if (!mti_name_targeted(c->targets, p->name, hits)) continue;
            if (!p->linear)
                PBAD("%s: prune.targets matches %s, which is not a linear weight (pruning is "
                     "for the weights of linear maps)", fn, p->name);
        } else if (!p->linear) {
            continue;
        }
        if (nm_on(c) && (p->ndim != 2 || p->shape[1] % c->nm_m))
            PBAD("%s: %d:%d pruning needs %d to divide the rows of %s (%lld columns)", fn,
                 c->nm_n, c->nm_m, c->nm_m, p->name, (long long)(p->ndim == 2 ? p->shape[1] : 0));
        if (p->qf)
            return mti_fail(ctx, MT_ERR_UNSUPPORTED, "%s: %s is quantized (%s): a quantized weight "
                            "is not pruned", fn, p->name, mti_quant_name(p->qf));
        if (p->sp && (nm_on(c) != (p->sp->L.fmt == MTI_SP_NM) ||
                      (nm_on(c) && (p->sp->L.n != c->nm_n || p->sp->L.m != c->nm_m))))
            PBAD("%s: %s is pruned %s already", fn, p->name,
                 p->sp->L.fmt == MTI_SP_NM ? "in another N:M pattern" : "unstructured");
        tg[i] = 1;
        any = 1;
    }
    for (int k = 0; k < npat; k++)
        if (!hits[k]) PBAD("%s: prune.targets pattern %d matches no parameter", fn, k + 1);
    if (!any) PBAD("%s: the model has no linear weight to prune", fn);
    return MT_OK;
#undef PBAD
}

/* The kept count of a target in a dry context, where no value is read
 * (global: each tensor at the global fraction). */
static size_t dry_kept(const mti_param *p, const mt_prune_config *c, double s)
{
    const size_t dense = mti_param_dense(p);
    if (nm_on(c)) return dense / (size_t)c->nm_m * (size_t)c->nm_n;
    if (c->method == MT_PRUNE_WANDA) {
        const size_t rows = (size_t)p->shape[0], cols = (size_t)p->shape[1];
        return rows * (cols - (size_t)((double)cols * s));
    }
    const size_t k = mti_sp_count(s, dense), old = p->sp ? dense - p->sp->L.nnz : 0;
    return dense - (k > old ? k : old);
}

/* |w| of parameter i's dense elements (host, made here). */
static mt_status abs_scores(const mt_model *m, int i, float **out)
{
    const mti_param *p = &m->params[i];
    const size_t n = mti_param_dense(p);
    float *x = malloc(n * sizeof *x);
    if (!x) return mti_fail(m->ctx, MT_ERR_OOM, "prune: out of host memory for %s's scores", p->name);
    mt_status s = mti_param_read(m, i, 0, n, x);
    for (size_t e = 0; !s && e < n; e++) x[e] = fabsf(x[e]);
    if (s) free(x);
    else *out = x;
    return s;
}

mt_status mti_prune_masks(const mt_model *m, const mt_prune_config *c, double sfrac,
                          const unsigned char *tg, float *const *norms, uint64_t **keep, size_t *nnz)
{
    mt_context *ctx = m->ctx;
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_param && !s; i++) {
        keep[i] = NULL;
        if (!tg[i]) continue;
        const mti_param *p = &m->params[i];
        if (ctx->dry) {
            nnz[i] = dry_kept(p, c, sfrac);
            continue;
        }
        const size_t dense = mti_param_dense(p);
        if (!(keep[i] = malloc(mti_sp_words(dense) * 8)))
            s = mti_fail(ctx, MT_ERR_OOM, "prune: out of host memory");
        if (!s) s = mti_param_keep(m, i, keep[i]);
    }
    if (s || ctx->dry) return s;
    if (c->scope == MT_PRUNE_GLOBAL) { /* every target's scores at once */
        mti_sp_seg *seg = calloc((size_t)m->n_param, sizeof *seg);
        int ns = 0;
        size_t total = 0;
        if (!seg) s = mti_fail(ctx, MT_ERR_OOM, "prune: out of host memory");
        for (int i = 0; i < m->n_param && !s; i++) {
            if (!tg[i]) continue;
            float *x = NULL;
            s = abs_scores(m, i, &x);
            if (!s) seg[ns++] = (mti_sp_seg){x, mti_param_dense(&m->params[i]), keep[i]};
            if (!s) total += seg[ns - 1].n;
        }
        if (!s) s = mti_sp_prune_smallest(ctx, seg, ns, mti_sp_count(sfrac, total));
        for (int j = 0; seg && j < ns; j++) free((void *)seg[j].score);
        free(seg);
    } else {
        for (int i = 0; i < m->n_param && !s; i++) {
            if (!tg[i]) continue;
            const mti_param *p = &m->params[i];
            const size_t dense = mti_param_dense(p);
            float *x = NULL;
            s = abs_scores(m, i, &x);
            if (!s && c->method == MT_PRUNE_WANDA) { /* |w| sqrt(sum x^2) per column */
                const int64_t cols = p->shape[1];
                for (size_t e = 0; e < dense; e++) x[e] *= sqrtf(norms[i][e % (size_t)cols]);
            }
            if (!s && nm_on(c)) {
                s = mti_sp_prune_nm(ctx, x, dense, c->nm_n, c->nm_m, keep[i]);
            } else if (!s && c->method == MT_PRUNE_WANDA) {
                const int64_t cols = p->shape[1];
                s = mti_sp_prune_rows(ctx, x, p->shape[0], cols,
                                      (size_t)((double)cols * sfrac), keep[i]);
            } else if (!s) {
                mti_sp_seg seg = {x, dense, keep[i]};
                s = mti_sp_prune_smallest(ctx, &seg, 1, mti_sp_count(sfrac, dense));
            }
            free(x);
        }
    }
    for (int i = 0; i < m->n_param; i++)
        if (keep[i]) nnz[i] = mti_sp_kept(keep[i], mti_param_dense(&m->params[i]));
    return s;
}

mt_status mti_prune_apply(mt_model *m, const mt_prune_config *c, const unsigned char *tg,
                          uint64_t *const *keep, const size_t *nnz, mti_prune_hook hook, void *user)
{
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_param && !s; i++) {
        if (!tg[i]) continue;
        const mti_param *p = &m->params[i];
        if (p->sp && p->sp->L.nnz == nnz[i] && keep[i]) { /* the same mask: nothing to do */
            uint64_t *now = malloc(mti_sp_words(p->sp->L.dense) * 8);
            bool same = now && !mti_param_keep(m, i, now) &&
                        !memcmp(now, keep[i], mti_sp_words(p->sp->L.dense) * 8);
            free(now);
            if (same) continue;
        }
        if (nm_on(c))
            s = mti_param_prune(m, i, keep[i], nnz[i], MTI_SP_NM, c->nm_n, c->nm_m, hook, user);
        else
            s = mti_param_prune(m, i, keep[i], nnz[i], MTI_SP_BITMAP, 0, 0, hook, user);
    }
    return s;
}

void mti_prune_free_masks(const mt_model *m, uint64_t **keep)
{
    for (int i = 0; keep && i < m->n_param; i++) free(keep[i]), keep[i] = NULL;
}

/* ---- the public calls ---- */

mt_status mt_model_prune(mt_model *m, const mt_prune_config *c)
{
    const char *fn = "mt_model_prune";
    if (!m || !c) return mti_fail(m ? m->ctx : NULL, MT_ERR_INVALID_ARG, "%s: model or config is NULL", fn);
    mt_context *ctx = m->ctx;
    if (atomic_load(&m->n_trainers))
        return mti_fail(ctx, MT_ERR_STATE, "%s: a trainer uses the model", fn);
    if (c->method == MT_PRUNE_WANDA)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: Wanda needs calibration batches: prune "
                        "through a trainer (mt_trainer_config.prune, mt_trainer_calibrate)", fn);
    mt_status s = mti_model_all_whole(m, fn);
    if (s) return s;
    unsigned char *tg = calloc((size_t)m->n_param, 1);
    uint64_t **keep = calloc((size_t)m->n_param, sizeof *keep);
    size_t *nnz = calloc((size_t)m->n_param, sizeof *nnz);
    if (!tg || !keep || !nnz) s = mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    if (!s) s = mti_prune_check(ctx, m, c, fn, tg);
    if (!s) s = mti_model_make(m, NULL);
    if (!s) s = mti_prune_masks(m, c, c->sparsity, tg, NULL, keep, nnz);
    if (!s) s = mti_prune_apply(m, c, tg, keep, nnz, NULL, NULL);
    if (keep) mti_prune_free_masks(m, keep);
    free(keep);
    free(nnz);
    free(tg);
    return s;
}

mt_status mt_prune_check(const mt_model *m, const mt_prune_config *c)
{
    if (!m || !c) return mti_fail(m ? m->ctx : NULL, MT_ERR_INVALID_ARG, "mt_prune_check: model or config is NULL");
    unsigned char *tg = calloc((size_t)m->n_param + 1, 1);
    if (!tg) return mti_fail(m->ctx, MT_ERR_OOM, "mt_prune_check: out of host memory");
    mt_status s = mti_prune_check(m->ctx, m, c, "mt_prune_check", tg);
    free(tg);
    return s;
}

mt_status mt_model_param_mask(const mt_model *m, int i, unsigned char *keep, size_t n)
{
    if (!m || !keep || i < 0 || i >= mt_model_num_tensors(m))
        return mti_fail(m ? m->ctx : NULL, MT_ERR_INVALID_ARG,
                        "mt_model_param_mask: model or keep is NULL, or tensor %d is out of range", i);
    mt_param_info info;
    mt_status s = mt_model_param_info(m, i, &info);
    if (s) return s;
    if (n != info.numel)
        return mti_fail(m->ctx, MT_ERR_INVALID_ARG, "mt_model_param_mask: n %zu is not %s's %zu",
                        n, info.name, info.numel);
    const mti_param *p = m->pp ? NULL : &m->params[i];
    if (!p || !p->sp) { /* (a pipeline stage's view: none is pruned there) */
        memset(keep, 1, n);
        return MT_OK;
    }
    uint64_t *bits = malloc(mti_sp_words(n) * 8);
    if (!bits) return mti_fail(m->ctx, MT_ERR_OOM, "mt_model_param_mask: out of host memory");
    s = mti_param_keep(m, i, bits);
    for (size_t e = 0; !s && e < n; e++) keep[e] = (unsigned char)(bits[e / 64] >> (e % 64) & 1);
    free(bits);
    return s;
}

mt_status mt_model_sparsity(const mt_model *m, uint64_t *pruned, uint64_t *total)
{
    if (!m || !pruned || !total)
        return mti_fail(m ? m->ctx : NULL, MT_ERR_INVALID_ARG, "mt_model_sparsity: a NULL argument");
    *pruned = *total = 0;
    for (int i = 0; i < m->n_param; i++) {
        const mti_param *p = &m->params[i];
        if (!p->sp) continue;
        *pruned += p->sp->L.dense - p->sp->L.nnz;
        *total += p->sp->L.dense;
    }
    return MT_OK;
}
