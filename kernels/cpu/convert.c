/*
 * convert.c - casts between fp32, fp16 and bf16, and the fp32 staging
 * loads and stores the other CPU kernels use in their inner loops.
 *
 * The element conversions below restate the scalar definitions of
 * lib/kctx.c without branches (selects instead), so the loops vectorise;
 * they give the same bits for every input (the tests run all 65536 fp16 and
 * bf16 patterns and random fp32 ones). One assumption the scalar code does
 * not make: the fp16 subnormal path rounds with one fp32 addition, so it
 * needs the default rounding mode (to nearest), which every fp32 kernel of
 * the library assumes anyway.
 */
#include <string.h>

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

/* fp16 bits -> fp32, exact. Normal numbers move their exponent from bias
 * 15 to bias 127; inf/NaN keep their payload under an all-ones exponent;
 * subnormals (m * 2^-24) come out of one exact subtraction:
 * 2^-14 (1 + m/1024) - 2^-14. */
static inline float h2f(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7FFFu;
    uint32_t e = em & 0x7C00u;
    uint32_t normal = (em << 13) + (112u << 23);
    uint32_t special = (em << 13) | 0x7F800000u;
    uint32_t sub = bits_of(float_of((113u << 23) | (em << 13)) - float_of(113u << 23));
    uint32_t r = sel(e == 0x7C00u, special, normal);
    r = sel(e == 0, sub, r);
    return float_of(sign | r);
}

/* fp32 -> fp16 bits, to nearest even. Normal results: drop 13 mantissa
 * bits, adding 0xFFF plus the kept lsb so ties go to even (a carry into the
 * exponent is the right answer, up to inf). Subnormal results: adding 0.5f,
 * whose ulp is 2^-24 = the fp16 subnormal step, rounds |f| to a multiple of
 * that step in hardware; the low bits of the sum are then the fp16
 * mantissa (1024 = the smallest normal, also right). */
static inline uint16_t f2h(float f)
{
    uint32_t u = bits_of(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t normal = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    uint32_t sub = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
    uint32_t r = sel(a < 0x38800000u, sub, normal);
    r = sel(a >= 0x477FF000u, 0x7C00u, r); /* from 65520 up: inf */
    r = sel(a > 0x7F800000u, 0x7E00u, r);  /* NaN: the quiet NaN */
    return (uint16_t)(sign | r);
}

/* The loops below are the hot ones of every kernel. `omp simd` lets GCC
 * vectorise them at -O2 (its cheap cost model alone would not); each lane
 * does the same scalar operations, so the bits do not depend on the vector
 * width, and an AVX2 clone (picked at load time where the CPU has it) runs
 * the same code twice as wide. */
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define X86_PATHS 1
#endif

WIDE_CLONES static void h2f_n(float *restrict d, const uint16_t *restrict s, size_t n)
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) d[i] = h2f(s[i]);
}

WIDE_CLONES static void b2f_n(float *restrict d, const uint16_t *restrict s, size_t n)
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) d[i] = b2f(s[i]);
}

WIDE_CLONES static void f2h_n(uint16_t *restrict d, const float *restrict s, size_t n)
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) d[i] = f2h(s[i]);
}

WIDE_CLONES static void f2b_n(uint16_t *restrict d, const float *restrict s, size_t n)
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) d[i] = f2b(s[i]);
}

#ifdef X86_PATHS
#include <cpuid.h>
#include <immintrin.h>

/* Hand-written AVX2 loops where the compilers' own fall short, used when
 * the CPU has AVX2 and F16C (both part of x86-64-v3; every CPU with AVX2 we
 * know of has F16C, but it is checked apart). The answer is cached: cpuid
 * is slow in virtual machines. (The runtime fills in what
 * __builtin_cpu_supports reads before main, with the OS's AVX state.) */
static int have_x86_v3(void)
{
    static _Atomic int known = -1;
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        unsigned a, b, c, d;
        v = __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v;
}

/* fp16 has conversion instructions (F16C). They round to nearest even
 * whatever the rounding mode, and agree with the definition except on NaNs:
 * a narrowed NaN keeps part of its payload (the definition gives the one
 * quiet NaN), and a widened signalling NaN comes out quieted (the
 * definition keeps its bits). Those lanes are patched with blends. */
__attribute__((target("avx2,f16c"))) static void f2h_n_f16c(uint16_t *d, const float *s, size_t n)
{
    const __m128i sign = _mm_set1_epi16((short)0x8000), qnan = _mm_set1_epi16(0x7E00);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(s + i);
        __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        if (_mm256_movemask_ps(nan)) { /* rare: NaNs become the one quiet NaN */
            __m256i m = _mm256_castps_si256(nan);
            __m128i m16 =
                _mm_packs_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
            h = _mm_blendv_epi8(h, _mm_or_si128(_mm_and_si128(h, sign), qnan), m16);
        }
        _mm_storeu_si128((__m128i *)(d + i), h);
    }
    for (; i < n; i++) d[i] = f2h(s[i]);
}

__attribute__((target("avx2,f16c"))) static void h2f_n_f16c(float *d, const uint16_t *s, size_t n)
{
    const __m128i em_mask = _mm_set1_epi16(0x7FFF), inf16 = _mm_set1_epi16(0x7C00);
    const __m256i sign = _mm256_set1_epi32(0x8000), inf = _mm256_set1_epi32(0x7F800000);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        __m256 f = _mm256_cvtph_ps(h);
        /* NaN lanes found on the fp16 bits (|h| > inf): clang scalarises a
         * compare of the widened values */
        __m128i nan16 = _mm_cmpgt_epi16(_mm_and_si128(h, em_mask), inf16);
        if (_mm_movemask_epi8(nan16)) { /* rare: keep the NaNs' bits */
            __m256i w = _mm256_cvtepu16_epi32(h);
            __m256i em = _mm256_cvtepu16_epi32(_mm_and_si128(h, em_mask));
            __m256i exact = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, sign), 16),
                                            _mm256_or_si256(_mm256_slli_epi32(em, 13), inf));
            __m256i nan = _mm256_cvtepi16_epi32(nan16);
            f = _mm256_blendv_ps(f, _mm256_castsi256_ps(exact), _mm256_castsi256_ps(nan));
        }
        _mm256_storeu_ps(d + i, f);
    }
    for (; i < n; i++) d[i] = h2f(s[i]);
}

/* bf16 needs no conversion instruction, but the compilers narrow 32-bit
 * lanes to 16 bits clumsily; this is f2b() eight lanes at a time. */
__attribute__((target("avx2"))) static void f2b_n_avx2(uint16_t *d, const float *s, size_t n)
{
    const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i hi = _mm256_srli_epi32(u, 16);
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, half), _mm256_and_si256(hi, one));
        r = _mm256_srli_epi32(r, 16);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet), nan);
        /* pack 2x4 lanes per 128-bit half, then put the halves in order */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(d + i), _mm256_castsi256_si128(p));
    }
    for (; i < n; i++) d[i] = f2b(s[i]);
}

/* AVX-512 F (with VL for the 128-bit tail masks): f2b() and b2f() sixteen
 * lanes at a time, the partial vector at the end under a mask. The same
 * integer operations as the definitions, so the same bits. */
static int have_avx512(void)
{
    static _Atomic int known = -1;
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx512bw");
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v;
}

#define A512 __attribute__((target("avx512f,avx512vl,avx512bw")))

A512 static inline __m256i f2b16(__m512i u)
{
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                 _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

A512 static void f2b_n_avx512(uint16_t *d, const float *s, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(d + i), f2b16(_mm512_loadu_si512(s + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm256_mask_storeu_epi16(d + i, m, f2b16(_mm512_maskz_loadu_epi32(m, s + i)));
    }
}

A512 static void b2f_n_avx512(float *d, const uint16_t *s, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm512_storeu_si512(d + i, _mm512_slli_epi32(w, 16));
    }
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s + i));
        _mm512_mask_storeu_epi32(d + i, m, _mm512_slli_epi32(w, 16));
    }
}
#endif

static void bf16_to_f32(float *d, const uint16_t *s, size_t n)
{
#ifdef X86_PATHS
    if (have_avx512()) {
        b2f_n_avx512(d, s, n);
        return;
    }
#endif
    b2f_n(d, s, n);
}

static void f16_to_f32(float *d, const uint16_t *s, size_t n)
{
#ifdef X86_PATHS
    if (have_x86_v3()) {
        h2f_n_f16c(d, s, n);
        return;
    }
#endif
    h2f_n(d, s, n);
}

static void f32_to_bf16(uint16_t *d, const float *s, size_t n)
{
#ifdef X86_PATHS
    if (have_avx512()) {
        f2b_n_avx512(d, s, n);
        return;
    }
    if (have_x86_v3()) {
        f2b_n_avx2(d, s, n);
        return;
    }
#endif
    f2b_n(d, s, n);
}

static void f32_to_f16(uint16_t *d, const float *s, size_t n)
{
#ifdef X86_PATHS
    if (have_x86_v3()) {
        f2h_n_f16c(d, s, n);
        return;
    }
#endif
    f2h_n(d, s, n);
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

/* mti_f32_to_bf16_sr(f, mti_sr_bits(seed, i)) of lib/kctx.c, restated
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
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
WIDE_CLONES
#endif
void mti_cpu_store_bf16_sr(uint16_t *d, const float *s, size_t n, uint64_t i, uint64_t seed)
{
#pragma omp simd
    for (size_t j = 0; j < n; j++) d[j] = f2b_sr(s[j], seed, i + j);
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
