/*
 * layernorm.c - layer normalisation over the last dimension, eps 1e-5,
 * forward and backward, for fp32, fp16 and bf16 storage.
 *
 * Rows are walked in chunks of up to CHUNK channels; fp16/bf16 chunks are
 * widened into fp32 buffers on the stack, so a row of any width needs no
 * workspace. Row sums use LANES partial sums combined in a fixed tree, so
 * they vectorise and depend only on the row width; the parameter gradients
 * are summed over rows in row order, threads splitting the channels.
 * Nothing depends on the thread count.
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

#define LN_EPS 1e-5f
/* channels staged at a time: 4 KiB of fp32 per stream (a multiple of LANES) */
#define CHUNK 1024
/* partial sums per row reduction */
#define LANES 16

static int dt_ok(mti_dtype dt) { return dt == MTI_F32 || dt == MTI_F16 || dt == MTI_BF16; }

/* src[i, i+n) as fp32: the tensor itself when fp32, else widened into buf */
static const float *stage_in(const void *src, mti_dtype dt, size_t i, size_t n, float *buf)
{
    if (dt == MTI_F32) return (const float *)src + i;
    mti_cpu_load_f32(buf, src, dt, i, n);
    return buf;
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* ---- row sums: acc[l] collects elements l, l + LANES, ... ---- */

static float lanes_total(float acc[LANES])
{
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* The sums below keep their LANES partial sums in locals, which the
 * compiler holds in registers (the caller's arrays might alias the data). */

/* acc += x (n values; chunks other than a row's last are multiples of LANES) */
MTI_VEC_VOID(lanes_sum, (float acc[LANES], const float *x, size_t n),
             (acc, x, n))
{
    float s[LANES];
    memcpy(s, acc, sizeof s);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) s[l] += x[j + l];
    for (int l = 0; j + (size_t)l < n; l++) s[l] += x[j + l];
    memcpy(acc, s, sizeof s);
}

/* acc += (x - mean)^2 */
MTI_VEC_VOID(lanes_sqdev, (float acc[LANES], const float *x, size_t n, float mean),
             (acc, x, n, mean))
{
    float s[LANES];
    memcpy(s, acc, sizeof s);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) {
            float d = x[j + l] - mean;
            s[l] += d * d;
        }
    for (int l = 0; j + (size_t)l < n; l++) {
        float d = x[j + l] - mean;
        s[l] += d * d;
    }
    memcpy(acc, s, sizeof s);
}

/* a += dout * w, b += dout * w * xhat, with xhat = (x - mean) * rstd */
MTI_VEC_VOID(lanes_bwd, (float a[LANES], float b[LANES], const float *dout, const float *w,
                         const float *x, size_t n, float mean, float rstd),
             (a, b, dout, w, x, n, mean, rstd))
{
    float sa[LANES], sb[LANES];
    memcpy(sa, a, sizeof sa);
    memcpy(sb, b, sizeof sb);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) {
            float dn = dout[j + l] * w[j + l];
            sa[l] += dn;
            sb[l] += dn * ((x[j + l] - mean) * rstd);
        }
    for (int l = 0; j + (size_t)l < n; l++) {
        float dn = dout[j + l] * w[j + l];
        sa[l] += dn;
        sb[l] += dn * ((x[j + l] - mean) * rstd);
    }
    memcpy(a, sa, sizeof sa);
    memcpy(b, sb, sizeof sb);
}

/* ---- forward ---- */

MTI_VEC_VOID(norm_n, (float *y, const float *x, const float *w, const float *b, size_t n,
                      float mean, float rstd),
             (y, x, w, b, n, mean, rstd))
{
#pragma omp simd
    for (size_t j = 0; j < n; j++) y[j] = (x[j] - mean) * rstd * w[j] + b[j];
}

/* w and b as fp32 over the whole row, when that needs no per-row work:
 * the tensors themselves (fp32), or copies widened once per thread into
 * buf (a row of one chunk); else NULL, and each chunk is widened as met. */
static const float *row_params(const void *p, mti_dtype dt, size_t c, float *buf)
{
    if (dt == MTI_F32) return p;
    if (c > CHUNK) return NULL;
    mti_cpu_load_f32(buf, p, dt, 0, c);
    return buf;
}

/* One row of c channels starting at element `row`: mean and rstd in fp32
 * (two passes over x: the mean first, then the squared deviations from it,
 * which loses nothing to cancellation), then the normalised output. wf, bf:
 * from row_params. */
static void ln_fwd_row(void *out, float *mean_out, float *rstd_out, const void *x, const void *w,
                       const void *b, const float *wf, const float *bf, size_t row, size_t c,
                       mti_dtype dt)
{
    float xb[CHUNK], wb[CHUNK], bb[CHUNK], yb[CHUNK];
    float acc[LANES];
    /* a row of one chunk is widened once for all three passes */
    const float *xs = c <= CHUNK ? stage_in(x, dt, row, c, xb) : NULL;

    memset(acc, 0, sizeof acc);
    for (size_t j = 0; j < c; j += CHUNK) {
        size_t m = min_sz(CHUNK, c - j);
        lanes_sum(acc, xs ? xs : stage_in(x, dt, row + j, m, xb), m);
    }
    float mean = lanes_total(acc) / (float)c;

    memset(acc, 0, sizeof acc);
    for (size_t j = 0; j < c; j += CHUNK) {
        size_t m = min_sz(CHUNK, c - j);
        lanes_sqdev(acc, xs ? xs : stage_in(x, dt, row + j, m, xb), m, mean);
    }
    float rstd = 1.0f / sqrtf(lanes_total(acc) / (float)c + LN_EPS);

    for (size_t j = 0; j < c; j += CHUNK) {
        size_t m = min_sz(CHUNK, c - j);
        const float *xj = xs ? xs : stage_in(x, dt, row + j, m, xb);
        const float *wj = wf ? wf + j : stage_in(w, dt, j, m, wb);
        const float *bj = bf ? bf + j : stage_in(b, dt, j, m, bb);
        float *y = dt == MTI_F32 ? (float *)out + row + j : yb;
        norm_n(y, xj, wj, bj, m, mean, rstd);
        if (dt != MTI_F32) mti_cpu_store_f32(out, dt, row + j, yb, m);
    }
    if (mean_out) *mean_out = mean;
    if (rstd_out) *rstd_out = rstd;
}

mt_status mti_cpu_layernorm_fwd(const mti_kctx *k, void *out, float *mean, float *rstd,
                                const void *x, const void *w, const void *b, int n, int c,
                                mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "layernorm_fwd: dtype %d is not a float",
                        (int)dt);
    if (n <= 0 || c <= 0) return MT_OK;
    size_t cc = (size_t)c;
#pragma omp parallel num_threads(mti_cpu_threads(k)) if ((size_t)n * cc > MTI_CPU_PAR_MIN)
    {
        float wbuf[CHUNK], bbuf[CHUNK];
        const float *wf = row_params(w, dt, cc, wbuf), *bf = row_params(b, dt, cc, bbuf);
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++)
            ln_fwd_row(out, mean ? mean + r : NULL, rstd ? rstd + r : NULL, x, w, b, wf, bf,
                       (size_t)r * cc, cc, dt);
    }
    return MT_OK;
}

/* ---- backward ----
 * With xhat = (x - mean) rstd and g = dout * w (per channel):
 *   dx = rstd (g - mean(g) - xhat mean(g xhat))      over the row's channels
 *   dw += sum over rows of dout xhat,  db += sum over rows of dout
 * (= with MTI_BWD_SET_DW).                                                */

MTI_VEC_VOID(dx_n, (float *dx, const float *dout, const float *w, const float *x, size_t n,
                    float mean, float rstd, float ga, float gb, int acc),
             (dx, dout, w, x, n, mean, rstd, ga, gb, acc))
{
    if (acc) {
#pragma omp simd
        for (size_t j = 0; j < n; j++) {
            float xh = (x[j] - mean) * rstd;
            dx[j] += (dout[j] * w[j] - ga - xh * gb) * rstd;
        }
    } else {
#pragma omp simd
        for (size_t j = 0; j < n; j++) {
            float xh = (x[j] - mean) * rstd;
            dx[j] = (dout[j] * w[j] - ga - xh * gb) * rstd;
        }
    }
}

/* dx of one row; wf from row_params */
static void ln_bwd_row(void *dx, const void *dout, const void *x, const void *w, const float *wf,
                       float mean, float rstd, size_t row, size_t c, mti_dtype dt, int accumulate)
{
    float gbuf[CHUNK], xbuf[CHUNK], wbuf[CHUNK], ybuf[CHUNK];
    float a[LANES], b[LANES];
    /* a row of one chunk is widened once for both passes */
    int once = c <= CHUNK;
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    for (size_t j = 0; j < c; j += CHUNK) {
        size_t m = min_sz(CHUNK, c - j);
        lanes_bwd(a, b, stage_in(dout, dt, row + j, m, gbuf),
                  wf ? wf + j : stage_in(w, dt, j, m, wbuf), stage_in(x, dt, row + j, m, xbuf),
                  m, mean, rstd);
    }
    float ga = lanes_total(a) / (float)c, gb = lanes_total(b) / (float)c;
    for (size_t j = 0; j < c; j += CHUNK) {
        size_t m = min_sz(CHUNK, c - j);
        const float *gs = once && dt != MTI_F32 ? gbuf : stage_in(dout, dt, row + j, m, gbuf);
        const float *xs = once && dt != MTI_F32 ? xbuf : stage_in(x, dt, row + j, m, xbuf);
        const float *ws = wf ? wf + j : stage_in(w, dt, j, m, wbuf);
        float *y = ybuf;
        if (dt == MTI_F32)
            y = (float *)dx + row + j;
        else if (accumulate)
            mti_cpu_load_f32(ybuf, dx, dt, row + j, m);
        dx_n(y, gs, ws, xs, m, mean, rstd, ga, gb, accumulate);
        if (dt != MTI_F32) mti_cpu_store_f32(dx, dt, row + j, ybuf, m);
    }
}

/* sw += g xhat and sb += g over m channels of one row; in bf16 read in
 * place (each value widened exactly: the same bits as staged) */
MTI_VEC_VOID(params_row, (float *sw, float *sb, const float *g, const float *x, size_t m, float mu,
                          float rs),
             (sw, sb, g, x, m, mu, rs))
{
#pragma omp simd
    for (size_t j = 0; j < m; j++) {
        sw[j] += g[j] * ((x[j] - mu) * rs);
        sb[j] += g[j];
    }
}

MTI_VEC_VOID(params_row_b16, (float *sw, float *sb, const uint16_t *g, const uint16_t *x, size_t m,
                              float mu, float rs),
             (sw, sb, g, x, m, mu, rs))
{
#pragma omp simd
    for (size_t j = 0; j < m; j++) {
        float gj = b2f(g[j]);
        sw[j] += gj * ((b2f(x[j]) - mu) * rs);
        sb[j] += gj;
    }
}

/* dw, db for channels [c0, c0 + m), m <= CHUNK: summed over the n rows in
 * row order, then added to the gradients once (with set, stored). Each
 * element's sum has the same order however the channels are split between
 * threads. */
static void ln_bwd_params(float *dw, float *db, const void *dout, const void *x,
                          const float *mean, const float *rstd, size_t n, size_t c, size_t c0,
                          size_t m, mti_dtype dt, int set)
{
    float sw[CHUNK], sb[CHUNK], gbuf[CHUNK], xbuf[CHUNK];
    memset(sw, 0, m * sizeof(float));
    memset(sb, 0, m * sizeof(float));
    for (size_t r = 0; r < n; r++) {
        size_t at = r * c + c0;
        if (dt == MTI_BF16) { /* read in place, not staged */
            params_row_b16(sw, sb, (const uint16_t *)dout + at, (const uint16_t *)x + at, m,
                           mean[r], rstd[r]);
            continue;
        }
        params_row(sw, sb, stage_in(dout, dt, at, m, gbuf), stage_in(x, dt, at, m, xbuf), m,
                   mean[r], rstd[r]);
    }
    if (set) {
        if (dw) memcpy(dw + c0, sw, m * sizeof(float));
        if (db) memcpy(db + c0, sb, m * sizeof(float));
        return;
    }
    if (dw)
        for (size_t j = 0; j < m; j++) dw[c0 + j] += sw[j];
    if (db)
        for (size_t j = 0; j < m; j++) db[c0 + j] += sb[j];
}

mt_status mti_cpu_layernorm_bwd(const mti_kctx *k, void *dx, float *dw, float *db,
                                const void *dout, const void *x, const void *w, const float *mean,
                                const float *rstd, int n, int c, mti_dtype dt, int flags)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    const int accumulate = flags & MTI_BWD_ACC_DX, set = (flags & MTI_BWD_SET_DW) != 0;
    if (!dt_ok(dt))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "layernorm_bwd: dtype %d is not a float",
                        (int)dt);
    if (!mean || !rstd)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "layernorm_bwd: the forward's mean and rstd are needed");
    if (n <= 0 && c > 0 && set) { /* no rows: the sums are zeros */
        if (dw) memset(dw, 0, (size_t)c * sizeof(float));
        if (db) memset(db, 0, (size_t)c * sizeof(float));
    }
    if (n <= 0 || c <= 0) return MT_OK;
    size_t nn = (size_t)n, cc = (size_t)c;
    int par = nn * cc > MTI_CPU_PAR_MIN;
    int nth = par ? mti_cpu_threads(k) : 1;

    /* the parameter gradients first, so dx may overwrite dout. Each thread
     * takes a contiguous run of channels (whole cache lines of 16 floats)
     * and streams through all rows, in chunks of CHUNK channels. */
    if (dw || db) {
        size_t span = (cc + (size_t)nth - 1) / (size_t)nth;
        span = (span + 15) / 16 * 16;
        size_t items = (cc + span - 1) / span;
#pragma omp parallel for schedule(static) num_threads(nth) if (par)
        for (size_t it = 0; it < items; it++) {
            size_t end = min_sz(cc, (it + 1) * span);
            for (size_t c0 = it * span; c0 < end; c0 += CHUNK)
                ln_bwd_params(dw, db, dout, x, mean, rstd, nn, cc, c0, min_sz(CHUNK, end - c0),
                              dt, set);
        }
    }
    if (dx) {
#pragma omp parallel num_threads(nth) if (par)
        {
            float wbuf[CHUNK];
            const float *wf = row_params(w, dt, cc, wbuf);
#pragma omp for schedule(static)
            for (int r = 0; r < n; r++)
                ln_bwd_row(dx, dout, x, w, wf, mean[r], rstd[r], (size_t)r * cc, cc, dt,
                           accumulate);
        }
    }
    return MT_OK;
}
