/*
 * xent.c - softmax cross-entropy over a (padded) vocabulary, fused with its
 * gradient.
 *
 * Row by row in fp32: the max, the sum of exponentials (LANES partial sums
 * in a fixed tree: independent of threads), the loss, and, when asked, the
 * gradient written over the row in place. The exponentials are computed
 * twice rather than kept, so no (N,V) probability tensor and no workspace
 * exists at any time. Rows are the unit of the parallel loop.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "cpu_ops.h"
#include "vecmath.h"

/* clang warns about every `omp simd` loop it cannot vectorise, which is all
 * of them under the sanitizers' instrumentation */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

/* columns staged at a time: 4 KiB of fp32 per stream (a multiple of LANES) */
#define CHUNK 1024
#define LANES 16

/* src[i, i+n) as fp32: the tensor itself when fp32, else widened into buf */
static const float *stage_in(const void *src, mti_dtype dt, size_t i, size_t n, float *buf)
{
    if (dt == MTI_F32) return (const float *)src + i;
    mti_cpu_load_f32(buf, src, dt, i, n);
    return buf;
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* The partial sums and maxima below live in locals, which the compiler
 * holds in registers (the caller's array might alias the data). */

/* acc = max(acc, x) lane by lane. The max skips NaN, but a NaN still
 * reaches the loss through the sum. */
MTI_VEC_VOID(lanes_max, (float acc[LANES], const float *x, size_t n),
             (acc, x, n))
{
    float s[LANES];
    memcpy(s, acc, sizeof s);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) s[l] = x[j + l] > s[l] ? x[j + l] : s[l];
    for (int l = 0; j + (size_t)l < n; l++) s[l] = x[j + l] > s[l] ? x[j + l] : s[l];
    memcpy(acc, s, sizeof s);
}

/* acc += e^(x - mx) */
MTI_VEC_VOID(lanes_expsum, (float acc[LANES], const float *x, size_t n, float mx),
             (acc, x, n, mx))
{
    float s[LANES];
    memcpy(s, acc, sizeof s);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) s[l] += exp_le0(x[j + l] - mx);
    for (int l = 0; j + (size_t)l < n; l++) s[l] += exp_le0(x[j + l] - mx);
    memcpy(acc, s, sizeof s);
}

/* d = softmax * dloss = e^(x - mx) * (dloss / sum) */
MTI_VEC_VOID(softmax_scaled, (float *d, const float *x, size_t n, float mx, float scale),
             (d, x, n, mx, scale))
{
#pragma omp simd
    for (size_t j = 0; j < n; j++) d[j] = exp_le0(x[j] - mx) * scale;
}

/* The max over the first V columns of a row (staged CHUNK at a time). */
static float row_max(const void *x, mti_dtype dt, size_t row, size_t V, float *buf)
{
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = -INFINITY;
    for (size_t j = 0; j < V; j += CHUNK) {
        size_t m = min_sz(CHUNK, V - j);
        lanes_max(acc, stage_in(x, dt, row + j, m, buf), m);
    }
    float mx = acc[0];
    for (int l = 1; l < LANES; l++) mx = acc[l] > mx ? acc[l] : mx;
    return mx;
}

/* The gradient of a row of Vp columns at element `row` over itself:
 * e^(x - mx) scale for the first V, dloss off at column `target` (none
 * when outside [0, V)), padding columns 0. */
static void grad_row(void *dlogits, const void *logits, int64_t target, size_t row, size_t V,
                     size_t Vp, float mx, float scale, float dloss, mti_dtype dt)
{
    float xb[CHUNK], db[CHUNK];
    for (size_t j = 0; j < Vp; j += CHUNK) {
        size_t m = min_sz(CHUNK, Vp - j);
        float *d = dt == MTI_F32 ? (float *)dlogits + row + j : db;
        /* the real columns of the chunk, then padding columns: 0 */
        size_t real = j + m <= V ? m : j < V ? V - j : 0;
        if (real) softmax_scaled(d, stage_in(logits, dt, row + j, real, xb), real, mx, scale);
        memset(d + real, 0, (m - real) * sizeof(float));
        if (target >= (int64_t)j && target < (int64_t)(j + real)) d[(size_t)target - j] -= dloss;
        if (dt != MTI_F32) mti_cpu_store_f32(dlogits, dt, row + j, db, m);
    }
}

/* The sum of e^(x - mx) over V columns at element `row`, in LANES partial sums added in a fixed tree. */
static float row_expsum(const void *logits, mti_dtype dt, size_t row, size_t V, float mx)
{
    float xb[CHUNK], acc[LANES];
    memset(acc, 0, sizeof acc);
    for (size_t j = 0; j < V; j += CHUNK) {
        size_t m = min_sz(CHUNK, V - j);
        lanes_expsum(acc, stage_in(logits, dt, row + j, m, xb), m, mx);
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* One row of Vp columns at element `row`. */
static float xent_row(void *dlogits, const void *logits, int32_t target, size_t row, size_t V,
                      size_t Vp, float dloss, mti_dtype dt)
{
    float xb[CHUNK];
    const float mx = row_max(logits, dt, row, V, xb);
    const float sum = row_expsum(logits, dt, row, V, mx);

    /* read before the gradient may overwrite the row */
    float xt;
    mti_cpu_load_f32(&xt, logits, dt, row + (size_t)target, 1);
    /* logsumexp - x[target], both relative to the max */
    float loss = logf(sum) - (xt - mx);

    if (dlogits) grad_row(dlogits, logits, target, row, V, Vp, mx, dloss / sum, dloss, dt);
    return loss;
}

mt_status mti_cpu_xent(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                       const int32_t *targets, int n, int V, int Vp, float dloss, mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (dt != MTI_F32 && dt != MTI_F16 && dt != MTI_BF16)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "xent: dtype %d is not a float", (int)dt);
    if (V <= 0 || Vp < V)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "xent: vocabulary %d of padded %d", V, Vp);
    if (n <= 0) return MT_OK;
    size_t vp = (size_t)Vp;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) \
    if ((size_t)n * vp > MTI_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        float l = xent_row(dlogits, logits, targets[i], (size_t)i * vp, (size_t)V, vp, dloss, dt);
        if (losses) losses[i] = l;
    }
    return MT_OK;
}

/* ---- split by vocabulary over a tensor group (lib/ops/kernels.h) ---- */

mt_status mti_cpu_xent_vp(const mti_kctx *k, int phase, float *stats, float *losses,
                          void *dlogits, const void *logits, const int32_t *targets, int n, int v0,
                          int Vr, int W, float dloss, mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (dt != MTI_F32 && dt != MTI_F16 && dt != MTI_BF16)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "xent_vp: dtype %d is not a float", (int)dt);
    if (phase < 0 || phase > 2 || Vr < 0 || W < Vr || v0 < 0)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "xent_vp: phase %d, %d real columns of %d from column %d", phase, Vr, W, v0);
    if (n <= 0) return MT_OK;
    const size_t w = (size_t)W, V = (size_t)Vr, N = (size_t)n;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) \
    if (N * w > MTI_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        const size_t row = (size_t)i * w;
        const int64_t t = (int64_t)targets[i] - v0; /* the target's column here, if here */
        const bool here = t >= 0 && t < (int64_t)V;
        float xb[CHUNK];
        if (phase == 0) {
            stats[i] = V ? row_max(logits, dt, row, V, xb) : -INFINITY;
        } else if (phase == 1) {
            stats[N + (size_t)i] = V ? row_expsum(logits, dt, row, V, stats[i]) : 0.0f;
            float xt = 0.0f;
            if (here) mti_cpu_load_f32(&xt, logits, dt, row + (size_t)t, 1);
            stats[2 * N + (size_t)i] = xt;
        } else {
            const float mx = stats[i], sum = stats[N + (size_t)i];
            if (losses) losses[i] = logf(sum) - (stats[2 * N + (size_t)i] - mx);
            if (dlogits) grad_row(dlogits, logits, here ? t : -1, row, V, w, mx, dloss / sum, dloss, dt);
        }
    }
    return MT_OK;
}

/* ---- distillation: cross-entropy fused with KL to a teacher ---- */

/* One row: student s at element `row` (Vp columns, dt), teacher t at
 * element `trow` (fp32). Three sweeps over the columns: the maxima, the
 * sums (double), then the gradient; nothing of the row is kept. */
static float kd_row(void *dlogits, const void *logits, const float *tl, int32_t target,
                    size_t row, size_t trow, size_t V, size_t Vp, float alpha, float temp,
                    float dloss, mti_dtype dt)
{
    float xb[CHUNK], db[CHUNK];
    const float *t = tl + trow;
    const float ms = row_max(logits, dt, row, V, xb);
    const float mt = row_max(tl, MTI_F32, trow, V, xb);
    const float inv = 1.0f / temp;
    /* z1: sum e^(s - ms); zs: sum e^((s - ms)/T); zt: sum e^((t - mt)/T);
       a: sum e^((t - mt)/T) ((t - mt) - (s - ms))/T */
    double z1 = 0.0, zs = 0.0, zt = 0.0, a = 0.0;
    for (size_t j = 0; j < V; j += CHUNK) {
        size_t m = min_sz(CHUNK, V - j);
        const float *x = stage_in(logits, dt, row + j, m, xb);
        for (size_t c = 0; c < m; c++) {
            float us = x[c] - ms, ut = (t[j + c] - mt) * inv;
            float et = exp_le0(ut);
            z1 += exp_le0(us);
            zs += exp_le0(us * inv);
            zt += et;
            a += (double)et * (double)(ut - us * inv);
        }
    }
    float xt;
    mti_cpu_load_f32(&xt, logits, dt, row + (size_t)target, 1);
    const double ce = log(z1) - (double)(xt - ms);
    const double kl = a / zt - log(zt) + log(zs);
    const double loss = (1.0 - alpha) * ce + (double)alpha * temp * temp * kl;
    if (dlogits) {
        /* d = dloss ((1 - alpha) p1 + alpha T (ps - pt)) - dloss (1 - alpha) [target] */
        const float c1 = (float)((1.0 - alpha) * dloss / z1);
        const float cs = (float)((double)alpha * temp * dloss / zs);
        const float ct = (float)((double)alpha * temp * dloss / zt);
        for (size_t j = 0; j < Vp; j += CHUNK) {
            size_t m = min_sz(CHUNK, Vp - j);
            float *d = dt == MTI_F32 ? (float *)dlogits + row + j : db;
            size_t real = j + m <= V ? m : j < V ? V - j : 0;
            if (real) {
                const float *x = stage_in(logits, dt, row + j, real, xb);
                for (size_t c = 0; c < real; c++) {
                    float us = x[c] - ms;
                    d[c] = c1 * exp_le0(us) + cs * exp_le0(us * inv) -
                           ct * exp_le0((t[j + c] - mt) * inv);
                }
            }
            memset(d + real, 0, (m - real) * sizeof(float));
            if ((size_t)target >= j && (size_t)target < j + m)
                d[(size_t)target - j] -= (1.0f - alpha) * dloss;
            if (dt != MTI_F32) mti_cpu_store_f32(dlogits, dt, row + j, db, m);
        }
    }
    return (float)loss;
}

mt_status mti_cpu_xent_kd(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                          const float *tlogits, const int32_t *targets, int n, int V, int Vp,
                          int tVp, float alpha, float temp, float dloss, mti_dtype dt)
{
    if (!(alpha >= 0.0f && alpha <= 1.0f) || !(temp > 0.0f) || !isfinite(temp))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "xent_kd: alpha %g (need [0, 1]) and temperature %g (need > 0)",
                        (double)alpha, (double)temp);
    if (alpha == 0.0f) /* plain cross-entropy, bit for bit */
        return mti_cpu_xent(k, losses, dlogits, logits, targets, n, V, Vp, dloss, dt);
    if (mti_dry(k)) return MT_OK;
    if (dt != MTI_F32 && dt != MTI_F16 && dt != MTI_BF16)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "xent_kd: dtype %d is not a float", (int)dt);
    if (V <= 0 || Vp < V || tVp < V)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "xent_kd: vocabulary %d of padded %d (teacher's padded %d)", V, Vp, tVp);
    if (n <= 0) return MT_OK;
    size_t vp = (size_t)Vp, tvp = (size_t)tVp;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) \
    if ((size_t)n * vp > MTI_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        float l = kd_row(dlogits, logits, tlogits, targets[i], (size_t)i * vp, (size_t)i * tvp,
                         (size_t)V, vp, alpha, temp, dloss, dt);
        if (losses) losses[i] = l;
    }
    return MT_OK;
}
