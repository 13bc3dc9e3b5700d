/*
 * plan.c - recompute plans: what each unit keeps through forward, from a
 * fixed policy or chosen against a memory budget.
 *
 * A plan is one mode per recompute unit (mt_recompute_unit) and a segment
 * length. The budget policy searches a family of plans: the first r units
 * recomputed, in segments of k, the others kept whole or selectively, for
 * every r below the number of units (the last unit makes the logits and is
 * never recomputed) and every k <= r. Each plan's memory is its estimate
 * (estimate.c: exact, and cheap, since nothing is computed); its cost is
 * the forward FLOPs recompute repeats (cost_of). Candidates are tried in
 * order of cost, so the first that fits has the least recompute of the
 * family.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "plan.h"

void mti_plan_of_policy(const mt_model *m, const mt_trainer_config *c, unsigned char *units,
                        int *seg_len)
{
    const int U = m->n_units;
    *seg_len = 1;
    switch (c->recompute) {
    case MT_RECOMPUTE_CUSTOM:
        memcpy(units, c->recompute_units, (size_t)U);
        *seg_len = c->recompute_every;
        return;
    case MT_RECOMPUTE_EVERY_K:
    case MT_RECOMPUTE_SQRT: {
        /* segments of k from unit 0; the one holding the last unit is kept */
        int k = c->recompute == MT_RECOMPUTE_SQRT ? (int)ceil(sqrt((double)U)) : c->recompute_every;
        if (k < 1) k = 1;
        int kept_from = (U - 1) / k * k;
        for (int u = 0; u < U; u++) units[u] = u < kept_from ? MT_UNIT_RECOMPUTE : MT_UNIT_KEEP;
        *seg_len = k;
        return;
    }
    default:
        memset(units, c->recompute == MT_RECOMPUTE_SELECTIVE ? MT_UNIT_SELECTIVE : MT_UNIT_KEEP,
               (size_t)U);
        return;
    }
}

/* Forward FLOPs of each unit, per row of a micro-batch of T tokens (a
 * GEMM's 2 m n k; elementwise work counted once per element), and what
 * selective recompute repeats of a block (its LayerNorms, GELU and the
 * attention's forward). Only their ratios matter. */
static void unit_costs(const mt_model *m, int T, double *full, double *sel)
{
    memset(full, 0, (size_t)m->n_units * sizeof *full);
    memset(sel, 0, (size_t)m->n_units * sizeof *sel);
    for (int i = 0; i < m->n_layers; i++) {
        const mti_layer *ly = &m->layers[i];
        double in = ly->in, out = ly->out, f = 0, s = 0;
        switch (ly->kind) {
        case MT_LAYER_LINEAR:
        case MT_LAYER_LM_HEAD: f = 2 * in * out; break;
        case MT_LAYER_BLOCK: {
            double C = in, att = 2.0 * T * C; /* causal: half of 4 T C */
            f = 2 * C * 3 * C + 2 * C * C + 2 * 2 * C * 4 * C + att + 30 * C;
            s = att + 30 * C;
            break;
        }
        default: f = 8 * out; break;
        }
        full[ly->unit] += f;
        sel[ly->unit] += ly->kind == MT_LAYER_BLOCK ? s : 0;
    }
}

/* The recompute cost of the plan family's member (r, selective). */
static double cost_of(const mt_model *m, const double *full, const double *sel, int r, int selective)
{
    double c = 0;
    for (int u = 0; u < m->n_units; u++) c += u < r ? full[u] : selective ? sel[u] : 0;
    return c;
}

static void family(const mt_model *m, int r, int selective, unsigned char *units)
{
    for (int u = 0; u < m->n_units; u++)
        units[u] = u < r ? MT_UNIT_RECOMPUTE : selective ? MT_UNIT_SELECTIVE : MT_UNIT_KEEP;
}

/* The estimate of training m with c and this plan (no budget). */
static mt_status plan_estimate(const mt_model *m, const mt_trainer_config *c,
                               const unsigned char *units, int seg_len, mt_estimate_report *r)
{
    mt_trainer_config d = *c;
    d.recompute = MT_RECOMPUTE_CUSTOM;
    d.recompute_units = units;
    d.recompute_every = seg_len;
    d.memory_budget = 0;
    return mt_estimate_model(m, &d, r);
}

void mti_plan_describe(const mt_model *m, const unsigned char *units, int seg_len, char *buf,
                       size_t cap)
{
    int rec = 0, sel = 0;
    for (int u = 0; u < m->n_units; u++) rec += units[u] == MT_UNIT_RECOMPUTE, sel += units[u] == MT_UNIT_SELECTIVE;
    if (!rec && !sel) snprintf(buf, cap, "no recompute");
    else if (!rec) snprintf(buf, cap, "selective recompute in every unit");
    else
        snprintf(buf, cap, "%d of %d units recomputed in segments of %d%s", rec, m->n_units,
                 seg_len, sel ? ", selective recompute in the others" : "");
}

typedef struct cand {
    int r, sel;
    double cost;
} cand;

static int by_cost(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    return x->cost < y->cost ? -1 : x->cost > y->cost ? 1 : x->r - y->r;
}

mt_status mti_plan_budget(const mt_model *m, const mt_trainer_config *c, unsigned char *units,
                          int *seg_len, mt_estimate_report *chosen)
{
    const int U = m->n_units;
    const uint64_t budget = c->memory_budget;
    mt_status s;
    mt_estimate_report r;
    uint64_t fixed = 0;
    /* a fixed policy: its plan fits or not */
    if (c->recompute != MT_RECOMPUTE_BUDGET) {
        mti_plan_of_policy(m, c, units, seg_len);
        if ((s = plan_estimate(m, c, units, *seg_len, &r))) return s;
        if (chosen) *chosen = r;
        if (!budget || r.peak_reserved <= budget) return MT_OK;
        fixed = r.peak_reserved;
    }
    /* the family, cheapest first; the smallest need is kept for the error */
    const int T = m->input == MT_INPUT_TOKENS ? (c->max_seq ? c->max_seq : m->max_seq) : 1;
    double *full = malloc((size_t)U * sizeof *full), *sel = malloc((size_t)U * sizeof *sel);
    cand *cs = malloc((size_t)2 * U * sizeof *cs);
    unsigned char *try = malloc((size_t)U), *best = malloc((size_t)U);
    if (!full || !sel || !cs || !try || !best) {
        free(full), free(sel), free(cs), free(try), free(best);
        return mti_fail(m->ctx, MT_ERR_OOM, "out of host memory");
    }
    unit_costs(m, T, full, sel);
    int n = 0;
    for (int rr = 0; rr < U; rr++)
        for (int sl = 0; sl < 2; sl++) cs[n++] = (cand){rr, sl, cost_of(m, full, sel, rr, sl)};
    qsort(cs, (size_t)n, sizeof *cs, by_cost);
    uint64_t least = UINT64_MAX;
    int best_k = 1;
    s = MT_OK;
    bool found = false;
    for (int i = 0; i < n && !found && !s; i++) {
        for (int k = 1; k <= (cs[i].r ? cs[i].r : 1) && !found && !s; k++) {
            family(m, cs[i].r, cs[i].sel, try);
            if ((s = plan_estimate(m, c, try, k, &r))) break;
            if (r.peak_reserved < least) {
                least = r.peak_reserved;
                memcpy(best, try, (size_t)U);
                best_k = k;
            }
            if (!fixed && r.peak_reserved <= budget) {
                found = true;
                memcpy(units, try, (size_t)U);
                *seg_len = k;
                if (chosen) *chosen = r;
            }
        }
    }
    if (!s && !found) {
        char how[160];
        mti_plan_describe(m, best, best_k, how, sizeof how);
        if (fixed)
            s = mti_fail(m->ctx, MT_ERR_BUDGET,
                         "the memory budget of %llu bytes cannot be met with the configured "
                         "recompute policy, which needs %llu; the least this model and config "
                         "can take is %llu bytes (%.1f MiB), with %s (MT_RECOMPUTE_BUDGET "
                         "chooses the cheapest plan that fits)",
                         (unsigned long long)budget, (unsigned long long)fixed,
                         (unsigned long long)least, (double)least / 1048576.0, how);
        else
            s = mti_fail(m->ctx, MT_ERR_BUDGET,
                         "no recompute plan fits the memory budget of %llu bytes; the least "
                         "this model and config can take is %llu bytes (%.1f MiB), with %s; "
                         "below that, fewer rows per micro-batch, shorter sequences, 8-bit "
                         "optimizer state or the fused step take less",
                         (unsigned long long)budget, (unsigned long long)least,
                         (double)least / 1048576.0, how);
    }
    free(full), free(sel), free(cs), free(try), free(best);
    return s;
}
