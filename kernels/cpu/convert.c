/*
 * convert.c - casts between fp32, fp16 and bf16, the fp32 staging loads
 * and stores the other CPU kernels use in their inner loops, and the
 * dequantize op (lib/quant/quant.c's dequantizer).
 *
 * The element conversions (vecmath.h) restate the scalar definitions of
 * lib/ops/kctx.c without branches (selects instead), so the loops vectorise;
 * they give the same bits for every input (the tests run all 65536 fp16 and
 * bf16 patterns and random fp32 ones). One assumption the scalar code does
 * not make: the fp16 subnormal path rounds with one fp32 addition, so it
 * needs the default rounding mode (to nearest), which every fp32 kernel of
 * the library assumes anyway.
 */
#include <string.h>

#include "arch.h"
#include "cpu_ops.h"
#include "vecmath.h"

/* clang warns about every `omp simd` loop it cannot vectorise, which is all
 * of them under the sanitizers' instrumentation */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

/* elements per parallel work item of a cast: 32 KiB of fp32 */
#define CAST_CHUNK 8192
/* fp32 staging for fp16 <-> bf16: 4 KiB on the stack */
#define STAGE 1024

/* The loops below are the hot ones of every kernel. `omp simd` lets GCC
 * vectorise them at -O2 (its cheap cost model alone would not); each lane
 * does the same scalar operations, so the bits do not depend on the vector
 * width, and the copy of the level in use (arch.h) runs them as wide as it
 * may. Where the level has a hand-written loop (arch.h's paths: the fp16
 * conversion instructions, AVX-512 narrowing) that one runs instead, with
 * the same bits. */
MTI_VEC_VOID(h2f_n, (float *restrict d, const uint16_t *restrict s, size_t n), (d, s, n))
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) d[i] = h2f(s[i]);
}

MTI_VEC_VOID(b2f_n, (float *restrict d, const uint16_t *restrict s, size_t n), (d, s, n))
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) d[i] = b2f(s[i]);
}

MTI_VEC_VOID(f2h_n, (uint16_t *restrict d, const float *restrict s, size_t n), (d, s, n))
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) d[i] = f2h(s[i]);
}

MTI_VEC_VOID(f2b_n, (uint16_t *restrict d, const float *restrict s, size_t n), (d, s, n))
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) d[i] = f2b(s[i]);
}

static void bf16_to_f32(float *d, const uint16_t *s, size_t n)
{
    const mti_arch_paths *p = mti_arch_paths_now();
    if (p->bf16_to_f32) p->bf16_to_f32(d, s, n);
    else b2f_n(d, s, n);
}

static void f16_to_f32(float *d, const uint16_t *s, size_t n)
{
    const mti_arch_paths *p = mti_arch_paths_now();
    if (p->f16_to_f32) p->f16_to_f32(d, s, n);
    else h2f_n(d, s, n);
}

static void f32_to_bf16(uint16_t *d, const float *s, size_t n)
{
    const mti_arch_paths *p = mti_arch_paths_now();
    if (p->f32_to_bf16) p->f32_to_bf16(d, s, n);
    else f2b_n(d, s, n);
}

static void f32_to_f16(uint16_t *d, const float *s, size_t n)
{
    const mti_arch_paths *p = mti_arch_paths_now();
    if (p->f32_to_f16) p->f32_to_f16(d, s, n);
    else f2h_n(d, s, n);
}

void mti_cpu_load_f32(float *dst, const void *src, mti_dtype dt, size_t i, size_t n)
{
    switch (dt) {
    case MTI_F32:
        if (dst != (const float *)src + i) memcpy(dst, (const float *)src + i, n * sizeof(float));
        break;
    case MTI_F16: f16_to_f32(dst, (const uint16_t *)src + i, n); break;
    case MTI_BF16: bf16_to_f32(dst, (const uint16_t *)src + i, n); break;
    default: break; /* callers check dtypes before their loops */
    }
}

void mti_cpu_store_f32(void *dst, mti_dtype dt, size_t i, const float *src, size_t n)
{
    switch (dt) {
    case MTI_F32:
        if ((float *)dst + i != src) memcpy((float *)dst + i, src, n * sizeof(float));
        break;
    case MTI_F16: f32_to_f16((uint16_t *)dst + i, src, n); break;
    case MTI_BF16: f32_to_bf16((uint16_t *)dst + i, src, n); break;
    default: break;
    }
}

/* mti_f32_to_bf16_sr(f, mti_sr_bits(seed, i)) of lib/ops/kctx.c, restated
 * without branches or calls so the loop below vectorises; the same bits
 * for every input (the op suite checks it against the definition). */
static inline uint16_t f2b_sr(float f, uint64_t seed, uint64_t i)
{
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    uint32_t rnd = (uint32_t)((z ^ (z >> 31)) >> 32);
    uint32_t u = bits_of(f), a = u & 0x7FFFFFFFu;
    uint32_t nan = (u >> 16) | 0x0040u, inf = u >> 16, r = (u + (rnd & 0xFFFFu)) >> 16;
    return (uint16_t)sel(a > 0x7F800000u, nan, sel(a == 0x7F800000u, inf, r));
}

/* fp32 -> bf16 with stochastic rounding, elements i .. i+n of the cast.
 * Integer arithmetic only, so every copy gives the same bits; AVX512-DQ
 * multiplies 64-bit lanes natively (the hash's three products). */
MTI_VEC_VOID(store_bf16_sr, (uint16_t *d, const float *s, size_t n, uint64_t i, uint64_t seed),
             (d, s, n, i, seed))
{
#pragma omp simd
    for (size_t j = 0; j < n; j++) d[j] = f2b_sr(s[j], seed, i + j);
}

void mti_cpu_store_bf16_sr(uint16_t *d, const float *s, size_t n, uint64_t i, uint64_t seed)
{
    store_bf16_sr(d, s, n, i, seed);
}

/* bf16 with stochastic rounding of src[0..n) (fp32, or fp16 widened
 * exactly first); `i` is the element index of src[0] in the whole cast,
 * which seeds each element's random bits. */
static void to_bf16_sr(uint16_t *d, const void *src, mti_dtype st, size_t i, size_t n,
                       uint64_t seed)
{
    if (st == MTI_F32) {
        mti_cpu_store_bf16_sr(d, src, n, i, seed);
    } else {
        const uint16_t *s = src;
        for (size_t j = 0; j < n; j++)
            d[j] = mti_f32_to_bf16_sr(h2f(s[j]), mti_sr_bits(seed, i + j));
    }
}

static int is_float_dt(mti_dtype t) { return t == MTI_F32 || t == MTI_F16 || t == MTI_BF16; }

static size_t dt_size(mti_dtype t) { return t == MTI_F16 || t == MTI_BF16 ? 2 : 4; }

/* Elements [i, i+n) of the cast; a copy has dst != src. dst may equal src
 * only when the sizes match: fp16 <-> bf16 goes through a stack buffer, one
 * block at a time. */
static void cast_range(void *dst, mti_dtype dt, const void *src, mti_dtype st, size_t i, size_t n,
                       mti_rounding r, uint64_t seed)
{
    if (dt == st) {
        size_t esz = dt_size(dt);
        memcpy((char *)dst + i * esz, (const char *)src + i * esz, n * esz);
        return;
    }
    if (r == MTI_ROUND_STOCHASTIC) { /* dt is bf16, st fp32 or fp16 */
        to_bf16_sr((uint16_t *)dst + i, (const char *)src + i * dt_size(st), st, i, n, seed);
        return;
    }
    if (st == MTI_F32) {
        mti_cpu_store_f32(dst, dt, i, (const float *)src + i, n);
        return;
    }
    if (dt == MTI_F32) {
        mti_cpu_load_f32((float *)dst + i, src, st, i, n);
        return;
    }
    /* fp16 <-> bf16: widening is exact, so this rounds once */
    float buf[STAGE];
    for (size_t j = 0; j < n; j += STAGE) {
        size_t m = n - j < STAGE ? n - j : STAGE;
        mti_cpu_load_f32(buf, src, st, i + j, m);
        mti_cpu_store_f32(dst, dt, i + j, buf, m);
    }
}

mt_status mti_cpu_cast(const mti_kctx *k, void *dst, mti_dtype dst_dt, const void *src,
                       mti_dtype src_dt, size_t n, mti_rounding r, uint64_t seed)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (r != MTI_ROUND_NEAREST && r != MTI_ROUND_STOCHASTIC)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "cast: unknown rounding %d", (int)r);
    /* between the float dtypes, or a copy (int32 too) */
    int ok = dst_dt == src_dt ? is_float_dt(dst_dt) || dst_dt == MTI_I32
                              : is_float_dt(dst_dt) && is_float_dt(src_dt);
    if (!ok)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "cast: no cast from dtype %d to dtype %d",
                        (int)src_dt, (int)dst_dt);
    if (r == MTI_ROUND_STOCHASTIC && dst_dt != MTI_BF16)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "cast: stochastic rounding is for bf16 only (dtype %d asked)", (int)dst_dt);
    if (n == 0 || (dst == src && dst_dt == src_dt)) return MT_OK;
    size_t chunks = (n + CAST_CHUNK - 1) / CAST_CHUNK;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (n > MTI_CPU_PAR_MIN)
    for (size_t c = 0; c < chunks; c++) {
        size_t i = c * CAST_CHUNK, m = n - i < CAST_CHUNK ? n - i : CAST_CHUNK;
        cast_range(dst, dst_dt, src, src_dt, i, m, r, seed);
    }
    return MT_OK;
}

mt_status mti_cpu_dequantize(const mti_kctx *k, void *out, const void *wq, mti_qformat qf, size_t n,
                             size_t at, size_t len, mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    return mti_dequantize(k->ctx, qf, wq, n, at, len, out, dt);
}

/* ---- a pruned tensor: spans of MTI_SP_SPAN elements in parallel (each
   finds its first value by the tensor's prefix counts) ---- */

static mt_status sparse_args(const mti_kctx *k, const char *op, const mti_sp_layout *L, size_t at,
                             size_t len, mti_dtype dt, int add)
{
    if (at > L->dense || len > L->dense - at)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: elements [%zu, %zu) of a tensor of %zu", op,
                        at, at + len, L->dense);
    if (L->fmt != MTI_SP_BITMAP && L->fmt != MTI_SP_NM)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: unknown format %d", op, L->fmt);
    if (add && dt != MTI_F32)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: adds in fp32 only (dtype %d)", op,
                        (int)dt);
    return MT_OK;
}

mt_status mti_cpu_sparse_expand(const mti_kctx *k, void *dense, const void *vals, const void *meta,
                                const mti_sp_layout *L, size_t at, size_t len, mti_dtype dt)
{
    mt_status s;
    MTI_TRY(sparse_args(k, "sparse_expand", L, at, len, dt, 0));
    if (mti_dry(k)) return MT_OK;
    const size_t es = mti_dtype_size(dt), spans = (len + MTI_SP_SPAN - 1) / MTI_SP_SPAN;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (len > MTI_CPU_PAR_MIN)
    for (size_t c = 0; c < spans; c++) {
        const size_t a = at + c * MTI_SP_SPAN, n = at + len - a < MTI_SP_SPAN ? at + len - a : MTI_SP_SPAN;
        mti_sp_expand(L, meta, vals, 0, es, a, n, (char *)dense + (a - at) * es);
    }
    return MT_OK;
}

mt_status mti_cpu_sparse_compress(const mti_kctx *k, void *vals, const void *dense,
                                  const void *meta, const mti_sp_layout *L, size_t at, size_t len,
                                  mti_dtype dt, int add)
{
    mt_status s;
    MTI_TRY(sparse_args(k, "sparse_compress", L, at, len, dt, add));
    if (mti_dry(k)) return MT_OK;
    const size_t es = mti_dtype_size(dt), spans = (len + MTI_SP_SPAN - 1) / MTI_SP_SPAN;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (len > MTI_CPU_PAR_MIN)
    for (size_t c = 0; c < spans; c++) {
        const size_t a = at + c * MTI_SP_SPAN, n = at + len - a < MTI_SP_SPAN ? at + len - a : MTI_SP_SPAN;
        mti_sp_compress(L, meta, (const char *)dense + (a - at) * es, es, a, n, vals, 0, add);
    }
    return MT_OK;
}
