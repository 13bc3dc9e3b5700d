/*
 * elementwise.c - GELU (tanh form), ReLU, residual add and accumulate, over
 * n elements of fp32, fp16 or bf16.
 *
 * Every op walks its tensors in chunks of CHUNK elements: a chunk in fp16 or
 * bf16 is widened into an fp32 buffer on the stack, computed on in fp32,
 * and rounded back once (fp32 tensors are used in place). Chunks are the
 * unit of the parallel loop, and every element is computed on its own, so
 * the results do not depend on the thread count. Outputs may alias inputs
 * element for element (y = x, dx = dy).
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

/* elements per chunk: 4 KiB of fp32 per staged stream, in L1 */
#define CHUNK 1024

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_C 0.044715f

/* tanh(u) = sign(u) (1 - e) / (1 + e) with e = e^(-2|u|) <= 1: no overflow,
 * saturates to +-1; absolute error about 1e-7, which is what GELU needs. */
static inline float tanh_f(float u)
{
    float e = exp_le0(-2.0f * fabsf(u));
    float t = (1.0f - e) / (1.0f + e);
    return copysignf(t, u);
}

MTI_VEC_VOID(gelu_fwd_n, (float *y, const float *x, size_t n),
             (y, x, n))
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        float t = tanh_f(GELU_K * (v + GELU_C * v * v * v));
        y[i] = 0.5f * v * (1.0f + t);
    }
}

/* d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2), t = tanh(u) */
MTI_VEC_VOID(gelu_bwd_n, (float *dx, const float *dy, const float *x, size_t n),
             (dx, dy, x, n))
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        float t = tanh_f(GELU_K * (v + GELU_C * v * v * v));
        float du = GELU_K * (1.0f + 3.0f * GELU_C * v * v);
        dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
}

/* NaN passes through (x < 0 is false for it), as in torch */
static void relu_fwd_n(float *y, const float *x, size_t n)
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

static void relu_bwd_n(float *dx, const float *dy, const float *y, size_t n)
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float g = dy[i]; /* read unconditionally, so the select vectorises */
        dx[i] = y[i] > 0.0f ? g : 0.0f;
    }
}

static void add_n(float *y, const float *a, const float *b, size_t n)
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

/* ---- staging ---- */

static int dt_ok(mti_dtype dt) { return dt == MTI_F32 || dt == MTI_F16 || dt == MTI_BF16; }

static mt_status bad_dtype(const mti_kctx *k, const char *op, mti_dtype dt)
{
    return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: dtype %d is not fp32, fp16 or bf16", op,
                    (int)dt);
}

/* src[i, i+n) as fp32: the tensor itself when fp32, else widened into buf */
static const float *stage_in(const void *src, mti_dtype dt, size_t i, size_t n, float *buf)
{
    if (dt == MTI_F32) return (const float *)src + i;
    mti_cpu_load_f32(buf, src, dt, i, n);
    return buf;
}

/* where dst[i, ...) is computed: in place when fp32, else in buf */
static float *stage_at(void *dst, mti_dtype dt, size_t i, float *buf)
{
    return dt == MTI_F32 ? (float *)dst + i : buf;
}

/* rounds buf into dst[i, i+n) unless it was computed in place */
static void stage_out(void *dst, mti_dtype dt, size_t i, const float *buf, size_t n)
{
    if (dt != MTI_F32) mti_cpu_store_f32(dst, dt, i, buf, n);
}

typedef enum { OP_GELU_FWD, OP_GELU_BWD, OP_RELU_FWD, OP_RELU_BWD, OP_ADD } ew_op;

/* out = op(a, b) over n elements; b is NULL for the one-input ops. */
static void run(const mti_kctx *k, ew_op op, void *out, const void *a, const void *b, size_t n, mti_dtype dt)
{
    size_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (n > MTI_CPU_PAR_MIN)
    for (size_t c = 0; c < chunks; c++) {
        float ab[CHUNK], bb[CHUNK], ob[CHUNK];
        size_t i = c * CHUNK, m = n - i < CHUNK ? n - i : CHUNK;
        const float *as = stage_in(a, dt, i, m, ab);
        const float *bs = b ? stage_in(b, dt, i, m, bb) : NULL;
        float *os = stage_at(out, dt, i, ob);
        switch (op) {
        case OP_GELU_FWD: gelu_fwd_n(os, as, m); break;
        case OP_GELU_BWD: gelu_bwd_n(os, as, bs, m); break; /* a = dy, b = x */
        case OP_RELU_FWD: relu_fwd_n(os, as, m); break;
        case OP_RELU_BWD: relu_bwd_n(os, as, bs, m); break; /* a = dy, b = y */
        case OP_ADD: add_n(os, as, bs, m); break;
        }
        stage_out(out, dt, i, os, m);
    }
}

mt_status mti_cpu_gelu_fwd(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "gelu_fwd", dt);
    run(k, OP_GELU_FWD, y, x, NULL, n, dt);
    return MT_OK;
}

mt_status mti_cpu_gelu_bwd(const mti_kctx *k, void *dx, const void *dy, const void *x, size_t n,
                           mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "gelu_bwd", dt);
    run(k, OP_GELU_BWD, dx, dy, x, n, dt);
    return MT_OK;
}

mt_status mti_cpu_relu_fwd(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "relu_fwd", dt);
    run(k, OP_RELU_FWD, y, x, NULL, n, dt);
    return MT_OK;
}

mt_status mti_cpu_relu_bwd(const mti_kctx *k, void *dx, const void *dy, const void *y, size_t n,
                           mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "relu_bwd", dt);
    run(k, OP_RELU_BWD, dx, dy, y, n, dt);
    return MT_OK;
}

mt_status mti_cpu_add(const mti_kctx *k, void *y, const void *a, const void *b, size_t n,
                      mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "add", dt);
    run(k, OP_ADD, y, a, b, n, dt);
    return MT_OK;
}

mt_status mti_cpu_accumulate(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "accumulate", dt);
    run(k, OP_ADD, y, y, x, n, dt);
    return MT_OK;
}
