/*
 * optim.c - gradient unscaling with the non-finite check, the sum of
 * squares behind global-norm clipping, and the SGD and AdamW updates of
 * fp32 master weights (optionally refreshing the compute copy in the same
 * pass).
 *
 * Updates are per element, walked in chunks that are the unit of the
 * parallel loop. The sum of squares is summed per fixed block and the block
 * sums are combined in a fixed tree, so it does not depend on the thread
 * count.
 */
#include <math.h>
#include <string.h>

#include "cpu_ops.h"
#include "vecmath.h"

/* clang warns about every `omp simd` loop it cannot vectorise, which is all
 * of them under the sanitizers' instrumentation */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

/* elements per parallel work item of the updates */
#define CHUNK 4096
/* sumsq: elements per block summed in fp32 (LANES partial sums each) */
#define SUMSQ_BLOCK 4096
#define LANES 16
/* sumsq: block sums per round (MTI_SUMSQ_ROUND elements) */
#define ROUND_BLOCKS (MTI_SUMSQ_ROUND / SUMSQ_BLOCK)

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

static int pc_dt_ok(mti_dtype dt) { return dt == MTI_F32 || dt == MTI_F16 || dt == MTI_BF16; }

/* ---- unscale + non-finite check ---- */

/* g *= inv; returns 1 if any g was inf or NaN before scaling (exponent all
 * ones), as torch checks the unscaled values */
MTI_VEC_FN(unsigned, unscale_n, (float *g, size_t n, float inv),
           (g, n, inv))
{
    unsigned bad = 0;
#pragma omp simd reduction(| : bad)
    for (size_t j = 0; j < n; j++) {
        float v = g[j];
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        bad |= (u & 0x7F800000u) == 0x7F800000u;
        g[j] = v * inv;
    }
    return bad;
}

/* The check alone (inv_scale 1: the scaling would store every value back
 * unchanged, so g is only read). */
MTI_VEC_FN(unsigned, check_n, (const float *g, size_t n),
           (g, n))
{
    unsigned bad = 0;
#pragma omp simd reduction(| : bad)
    for (size_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, &g[j], sizeof u);
        bad |= (u & 0x7F800000u) == 0x7F800000u;
    }
    return bad;
}

mt_status mti_cpu_unscale_check(const mti_kctx *k, float *g, size_t n, float inv_scale,
                                int *found_inf)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    size_t chunks = (n + CHUNK - 1) / CHUNK;
    unsigned bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) num_threads(mti_cpu_threads(k)) \
    if (n > MTI_CPU_PAR_MIN)
    for (size_t c = 0; c < chunks; c++) {
        size_t i = c * CHUNK;
        size_t m = min_sz(CHUNK, n - i);
        bad |= inv_scale == 1.0f ? check_n(g + i, m) : unscale_n(g + i, m, inv_scale);
    }
    if (bad) *found_inf = 1;
    return MT_OK;
}

/* ---- sum of squares ---- */

MTI_VEC_FN(float, block_sumsq, (const float *g, size_t n),
           (g, n))
{
    float acc[LANES];
    memset(acc, 0, sizeof acc);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) acc[l] += g[j + l] * g[j + l];
    for (int l = 0; j + (size_t)l < n; l++) acc[l] += g[j + l] * g[j + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* Blocks of SUMSQ_BLOCK elements; the sums of up to ROUND_BLOCKS blocks at
 * a time are added pairwise in a fixed tree, and the rounds in order onto
 * *sumsq: the result depends on n alone, is far more accurate than one
 * running sum over millions of values, and a tensor summed in pieces that
 * start at round boundaries gives the same bits as summed whole. */
mt_status mti_cpu_sumsq(const mti_kctx *k, float *sumsq, const float *g, size_t n)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    size_t blocks = (n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    float total = *sumsq;
    for (size_t b0 = 0; b0 < blocks; b0 += ROUND_BLOCKS) {
        float part[ROUND_BLOCKS];
        size_t nb = min_sz(ROUND_BLOCKS, blocks - b0);
        size_t len = min_sz(nb * SUMSQ_BLOCK, n - b0 * SUMSQ_BLOCK);
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) \
    if (len > MTI_CPU_PAR_MIN)
        for (size_t b = 0; b < nb; b++) {
            size_t i = (b0 + b) * SUMSQ_BLOCK;
            part[b] = block_sumsq(g + i, min_sz(SUMSQ_BLOCK, n - i));
        }
        for (size_t w = 1; w < nb; w *= 2)
            for (size_t i = 0; i + w < nb; i += 2 * w) part[i] += part[i + w];
        total += part[0];
    }
    *sumsq = total;
    return MT_OK;
}

/* ---- SGD (torch.optim.SGD) ---- */

/* Per element, in torch's order of operations: d = g s + wd p; with
 * momentum, m = d on the first step, else momentum m + (1 - dampening) d,
 * and d = nesterov ? d + momentum m : m; then p = p - lr d. Inlined once per
 * (nesterov, first) case, so each loop is free of selects and vectorises. */
static inline __attribute__((always_inline)) void
sgd_momentum_loop(float *p, const float *g, float *m, size_t n, float lr, float mom, float damp1,
                  float wd, float gs, const int nesterov, const int first)
{
#pragma omp simd
    for (size_t j = 0; j < n; j++) {
        float d = g[j] * gs + wd * p[j];
        float mv = first ? d : mom * m[j] + damp1 * d;
        m[j] = mv;
        d = nesterov ? d + mom * mv : mv;
        p[j] = p[j] - lr * d;
    }
}

MTI_VEC_VOID(sgd_n, (float *p, const float *g, float *m, size_t n, float lr, float mom, float damp1,
                     float wd, float gs, int nesterov, int first),
             (p, g, m, n, lr, mom, damp1, wd, gs, nesterov, first))
{
    if (!m) {
#pragma omp simd
        for (size_t j = 0; j < n; j++) {
            float d = g[j] * gs + wd * p[j];
            p[j] = p[j] - lr * d;
        }
    } else if (nesterov) {
        if (first)
            sgd_momentum_loop(p, g, m, n, lr, mom, damp1, wd, gs, 1, 1);
        else
            sgd_momentum_loop(p, g, m, n, lr, mom, damp1, wd, gs, 1, 0);
    } else {
        if (first)
            sgd_momentum_loop(p, g, m, n, lr, mom, damp1, wd, gs, 0, 1);
        else
            sgd_momentum_loop(p, g, m, n, lr, mom, damp1, wd, gs, 0, 0);
    }
}

mt_status mti_cpu_sgd(const mti_kctx *k, float *p, const float *g, float *m, void *pc,
                      mti_dtype pc_dt, size_t n, const mti_sgd_args *a)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (pc && !pc_dt_ok(pc_dt))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "sgd: compute dtype %d is not a float",
                        (int)pc_dt);
    if (a->momentum != 0.0f && !m)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "sgd: momentum %g needs a momentum buffer",
                        (double)a->momentum);
    float *mm = a->momentum != 0.0f ? m : NULL; /* no momentum: the buffer is not touched */
    float damp1 = 1.0f - a->dampening;
    size_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (n > MTI_CPU_PAR_MIN)
    for (size_t c = 0; c < chunks; c++) {
        size_t i = c * CHUNK, len = min_sz(CHUNK, n - i);
        sgd_n(p + i, g + i, mm ? mm + i : NULL, len, a->lr, a->momentum, damp1, a->weight_decay,
              a->grad_scale, a->nesterov, a->first_step);
        if (pc) mti_cpu_store_f32(pc, pc_dt, i, p + i, len);
    }
    return MT_OK;
}

/* ---- AdamW (torch.optim.AdamW) ---- */

/* Per element, in torch's order of operations: p *= decay; m, v updated;
 * p -= step_size m / (sqrt(v) / bc2_sqrt + eps). Vector sqrt and division
 * are correctly rounded like the scalar ones, so every width gives the same
 * bits; vectorised, the loop runs about 3x faster than scalar on 124M
 * elements (bench_kernels (c)). */
MTI_VEC_VOID(adamw_n, (float *restrict p, const float *restrict g, float *restrict m,
                       float *restrict v, size_t n, float b1, float b2, float eps, float gs,
                       float decay, float step_size, float bc2_sqrt),
             (p, g, m, v, n, b1, b2, eps, gs, decay, step_size, bc2_sqrt))
{
    float c1 = 1.0f - b1, c2 = 1.0f - b2;
#pragma omp simd
    for (size_t j = 0; j < n; j++) {
        float gv = g[j] * gs;
        float mv = b1 * m[j] + c1 * gv;
        float vv = b2 * v[j] + c2 * gv * gv;
        m[j] = mv;
        v[j] = vv;
        float denom = sqrtf(vv) / bc2_sqrt + eps;
        p[j] = p[j] * decay - step_size * (mv / denom);
    }
}

mt_status mti_cpu_adamw(const mti_kctx *k, float *p, const float *g, float *m, float *v, void *pc,
                        mti_dtype pc_dt, size_t n, const mti_adamw_args *a)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (pc && !pc_dt_ok(pc_dt))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adamw: compute dtype %d is not a float",
                        (int)pc_dt);
    if (a->step < 1)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adamw: step %lld (steps count from 1)",
                        (long long)a->step);
    /* the scalars as torch makes them: in double, then rounded to fp32 */
    double bc1 = 1.0 - pow((double)a->beta1, (double)a->step);
    double bc2 = 1.0 - pow((double)a->beta2, (double)a->step);
    float step_size = (float)((double)a->lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    float decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay);
    size_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (n > MTI_CPU_PAR_MIN)
    for (size_t c = 0; c < chunks; c++) {
        size_t i = c * CHUNK, len = min_sz(CHUNK, n - i);
        adamw_n(p + i, g + i, m + i, v + i, len, a->beta1, a->beta2, a->eps, a->grad_scale, decay,
                step_size, bc2_sqrt);
        if (pc) mti_cpu_store_f32(pc, pc_dt, i, p + i, len);
    }
    return MT_OK;
}
