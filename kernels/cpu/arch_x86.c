/*
 * arch_x86.c - x86-64: the CPU's class (cpuid, and the OS's support for
 * the registers), oneDNN's cap, and the hand-written AVX2 and AVX-512
 * loops (arch.h). Everything here that uses an instruction beyond SSE2
 * is compiled for its own target and called only at a level that has it.
 */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <string.h>

#include "arch.h"
#include "ops/kernels.h"
#include "vecmath.h"

/* ---- the class ---- */

/* The register state the OS saves (XCR0): bits 1-2 SSE and AVX, 5-7
 * AVX-512, 17-18 AMX tiles. */
__attribute__((target("xsave"))) static uint64_t os_state(void) { return _xgetbv(0); }

static int g_vbmi; /* AVX512-VBMI: the 8-bit optimizer's permutes */

mti_isa mti_arch_detect(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return MTI_ISA_BASELINE;
    const int fma = (c & bit_FMA) != 0, f16c = (c & bit_F16C) != 0;
    if (!(c & bit_OSXSAVE) || !(c & bit_AVX) || __get_cpuid_max(0, NULL) < 7)
        return MTI_ISA_BASELINE;
    const uint64_t xcr0 = os_state();
    if ((xcr0 & 0x6) != 0x6) return MTI_ISA_BASELINE;
    unsigned subleaves;
    __cpuid_count(7, 0, subleaves, b, c, d);
    if (!(b & bit_AVX2) || !f16c) return MTI_ISA_BASELINE;
    const unsigned v4 = bit_AVX512F | bit_AVX512DQ | bit_AVX512CD | bit_AVX512BW | bit_AVX512VL;
    if ((xcr0 & 0xE6) != 0xE6 || (b & v4) != v4 || !fma) return MTI_ISA_AVX2;
    g_vbmi = (c & bit_AVX512VBMI) != 0;
    const int amx = (d & (1u << 22)) && (d & (1u << 24)) && (xcr0 & 0x60000) == 0x60000;
    unsigned a1 = 0, b1, c1, d1;
    if (subleaves >= 1) __cpuid_count(7, 1, a1, b1, c1, d1);
    if (!(a1 & (1u << 5))) return MTI_ISA_AVX512; /* no AVX512-BF16 */
    return amx ? MTI_ISA_AMX : MTI_ISA_AVX512_BF16;
}

/* oneDNN's names for the classes: the most each may use. The baseline
 * has none of its own: SSE4.1 is the least oneDNN makes code for (on a
 * CPU without it oneDNN runs its reference loops). */
static dnnl_cpu_isa_t onednn_of(mti_isa i)
{
    switch (i) {
    case MTI_ISA_BASELINE: return dnnl_cpu_isa_sse41;
    case MTI_ISA_AVX2: return dnnl_cpu_isa_avx2;
    case MTI_ISA_AVX512: return dnnl_cpu_isa_avx512_core;
    case MTI_ISA_AVX512_BF16: return dnnl_cpu_isa_avx512_core_bf16;
    default: return dnnl_cpu_isa_all;
    }
}

int mti_arch_cap_onednn(mti_isa i)
{
    dnnl_cpu_isa_t want = onednn_of(i);
    if (want == dnnl_cpu_isa_all || dnnl_set_max_cpu_isa(want) == dnnl_success) return 0;
    /* refused: oneDNN was capped or made code already; fine if within */
    dnnl_cpu_isa_t e = dnnl_get_effective_cpu_isa();
    return ((unsigned)e & ~(unsigned)want) ? -1 : 0;
}

const char *mti_arch_onednn_isa(void)
{
    switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    default: return "an unnamed class";
    }
}

/* ---- casts ---- */


/* Hand-written AVX2 loops where the compilers' own fall short: level avx2
 * (AVX2 and F16C) and up. */

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

/* ---- 8-bit AdamW's block in AVX-512, written out ----
 * gcc does not gather for Zen (it loads lane by lane), which made
 * optim8.c's portable block several times its memory's time. This is the
 * same arithmetic, one operation for each of the scalar code's, in its
 * order and without FMA, so the bits are the same: a full block at a time,
 * 16 lanes; the map lookups are gathers: dequantizing from the 1 KiB maps,
 * quantizing one word a value from the bucket tables (optim8.c's
 * q8_lut.word). The signed map's negative codes are its first ones
 * (optim8.c checks), so a code's sign bit is a comparison of the code. */
#define VEC_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

static inline VEC_FN __m512i v32(uint32_t x) { return _mm512_set1_epi32((int)x); }

/* lut_code of 16 values, from the bucket's word */
static inline VEC_FN __m512i vec_code(const uint32_t *lword, __m512 x)
{
    const uint32_t lo = MTI_Q8_LUT_EMIN << 23, hi = 127u << 23;
    __m512i u = _mm512_castps_si512(x);
    __m512i mag = _mm512_and_si512(u, v32(0x7FFFFFFFu));
    mag = _mm512_min_epu32(_mm512_max_epu32(mag, v32(lo)), v32(hi));
    __m512i mi = _mm512_srli_epi32(_mm512_sub_epi32(mag, v32(lo)), 23 - MTI_Q8_LUT_MB);
    __m512i pos = _mm512_add_epi32(v32(MTI_Q8_LUT_PER_SIGN), mi);
    __m512i neg = _mm512_sub_epi32(v32(MTI_Q8_LUT_PER_SIGN - 1u), mi);
    __mmask16 is_neg = _mm512_movepi32_mask(u);
    __m512i word = _mm512_i32gather_epi32(_mm512_mask_blend_epi32(is_neg, pos, neg), lword, 4);
    __m512i base = _mm512_and_si512(word, v32(0xFFu));
    /* above the threshold inside: a larger magnitude for a positive x, a
       smaller one for a negative x */
    __m512i xl = _mm512_and_si512(mag, v32(0xFFFFu)), tl = _mm512_srli_epi32(word, 16);
    __mmask16 above = (_mm512_cmpgt_epu32_mask(xl, tl) & ~is_neg) |
                      (_mm512_cmplt_epu32_mask(xl, tl) & is_neg);
    above &= _mm512_test_epi32_mask(word, v32(0x100u));
    base = _mm512_mask_add_epi32(base, above, base, v32(1));
    return _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), base);
}

/* absmax_of's integer maximum, 16 lanes folded into one */
static inline VEC_FN __m512i vec_absbits(__m512 x)
{
    __m512i u = _mm512_and_si512(_mm512_castps_si512(x), v32(0x7FFFFFFFu));
    return _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(u, v32(0x7F800000u)), u);
}

/* quantize() of a full block */
static inline VEC_FN void vec_quantize(uint8_t *q, const float *x, float amax, int is_signed,
                                       const mti_q8_tabs *t)
{
    if (amax == 0.0f) {
        memset(q, mti_q8_zero_code(is_signed), MTI_Q8_BLOCK);
        return;
    }
    const __m512 a = _mm512_set1_ps(amax);
    for (size_t j = 0; j < MTI_Q8_BLOCK; j += 16) {
        __m512 xv = _mm512_loadu_ps(x + j);
        __m512i c = vec_code(t->word[is_signed], _mm512_div_ps(xv, a));
        if (is_signed) {
            /* +1 toward a positive value, -1 (255) toward a negative one,
               where the code's sign bit differs from the value's */
            __mmask16 cneg = _mm512_cmplt_epu32_mask(c, v32(t->negc));
            __mmask16 flip = cneg ^ _mm512_movepi32_mask(_mm512_castps_si512(xv));
            __mmask16 up = _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_GT_OQ);
            __m512i step = _mm512_mask_blend_epi32(up, v32(255u), v32(1u));
            c = _mm512_and_si512(_mm512_mask_add_epi32(c, flip, c, step), v32(255u));
        }
        _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtepi32_epi8(c));
    }
}

/* ---- the maps' values by permutes (level 2) ----
 * AMD's gathers are slow (on the family-26 EPYC a 16-lane gather takes
 * about as long as 30 permutes), so where the CPU has AVX512-VBMI the
 * dequantizing makes none: a map's 256 codes are four tables of bytes (byte
 * b of each code's bits, four registers each); 64 codes at a time, two
 * two-register byte permutes and a blend on the code's top bit give byte b
 * of each code, and two rounds of unpacking put the four bytes of each code
 * together. The codes are shuffled first so that the unpacking, which works
 * within 128-bit lanes, leaves them in order. The values are the map's
 * (a table read either way). Quantizing keeps its gather from the bucket
 * table: a binary search over the thresholds by permutes, tried instead,
 * was slower (eight dependent levels). */
#define VBMI_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")))

typedef struct q8_perm {
    uint8_t plane[4][256]; /* byte b of each code's bits */
} q8_perm;

static q8_perm g_perm[2] __attribute__((aligned(64)));
static uint8_t g_deq_shuf[64] __attribute__((aligned(64)));

/* The permutes' tables, from the maps. */
static void perm_init(const mti_q8_tabs *tabs)
{
    for (int t = 0; t < 2; t++) {
        q8_perm *P = &g_perm[t];
        const float *code = tabs->code[t];
        for (int c = 0; c < 256; c++)
            for (int b = 0; b < 4; b++) P->plane[b][c] = (uint8_t)(bits_of(code[c]) >> (8 * b));
    }
    /* output register j, 128-bit lane L, dword p holds code 16 j + 4 L + p
       after the unpacking when the shuffled codes have it at 16 L + 4 j + p */
    for (int j = 0; j < 4; j++)
        for (int L = 0; L < 4; L++)
            for (int p = 0; p < 4; p++) g_deq_shuf[16 * L + 4 * j + p] = (uint8_t)(16 * j + 4 * L + p);
}

/* The map values of n (a multiple of 64) codes into out. */
static VBMI_FN void perm_dequant(float *out, const uint8_t *q, size_t n, const q8_perm *P)
{
    const __m512i shuf = _mm512_load_si512(g_deq_shuf);
    for (size_t j = 0; j < n; j += 64) {
        __m512i idx = _mm512_permutexvar_epi8(shuf, _mm512_loadu_si512(q + j));
        __mmask64 top = _mm512_movepi8_mask(idx);
        __m512i B[4];
        for (int b = 0; b < 4; b++) {
            const __m512i *t = (const __m512i *)P->plane[b];
            __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t), idx, _mm512_load_si512(t + 1));
            __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t + 2), idx, _mm512_load_si512(t + 3));
            B[b] = _mm512_mask_blend_epi8(top, lo, hi);
        }
        __m512i w01l = _mm512_unpacklo_epi8(B[0], B[1]), w01h = _mm512_unpackhi_epi8(B[0], B[1]);
        __m512i w23l = _mm512_unpacklo_epi8(B[2], B[3]), w23h = _mm512_unpackhi_epi8(B[2], B[3]);
        _mm512_store_si512(out + j, _mm512_unpacklo_epi16(w01l, w23l));
        _mm512_store_si512(out + j + 16, _mm512_unpackhi_epi16(w01l, w23l));
        _mm512_store_si512(out + j + 32, _mm512_unpacklo_epi16(w01h, w23h));
        _mm512_store_si512(out + j + 48, _mm512_unpackhi_epi16(w01h, w23h));
    }
}

/* adamw8_block of a full block: the codes' map values first (gathers, or
 * permutes at level 2), into two stack arrays */
static VEC_FN void vec_block(float *p, const float *g, uint8_t *qm, uint8_t *qv, float *amax_m,
                             float *amax_v, const mti_adamw8_consts *c, const mti_q8_tabs *t,
                             int level)
{
    float m[MTI_Q8_BLOCK] __attribute__((aligned(64))), v[MTI_Q8_BLOCK] __attribute__((aligned(64)));
    if (level >= 2) {
        perm_dequant(m, qm, MTI_Q8_BLOCK, &g_perm[1]);
        perm_dequant(v, qv, MTI_Q8_BLOCK, &g_perm[0]);
    } else {
        const float *cm = t->code[1], *cv = t->code[0];
        for (size_t j = 0; j < MTI_Q8_BLOCK; j += 16) {
            __m512i im = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qm + j)));
            __m512i iv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qv + j)));
            _mm512_store_ps(m + j, _mm512_i32gather_ps(im, cm, 4));
            _mm512_store_ps(v + j, _mm512_i32gather_ps(iv, cv, 4));
        }
    }
    const __m512 am = _mm512_set1_ps(*amax_m), av = _mm512_set1_ps(*amax_v);
    const __m512 b1 = _mm512_set1_ps(c->b1), b2 = _mm512_set1_ps(c->b2);
    const __m512 c1 = _mm512_set1_ps(c->c1), c2 = _mm512_set1_ps(c->c2);
    const __m512 gs = _mm512_set1_ps(c->gs), step_size = _mm512_set1_ps(c->step_size);
    const __m512 eps_c2 = _mm512_set1_ps(c->eps_c2), decay = _mm512_set1_ps(c->decay);
    __m512i mxm = _mm512_setzero_si512(), mxv = _mm512_setzero_si512();
    for (size_t j = 0; j < MTI_Q8_BLOCK; j += 16) {
        __m512 gv = _mm512_mul_ps(_mm512_loadu_ps(g + j), gs);
        __mmask16 keep = _mm512_cmpneq_epi32_mask(
            _mm512_and_si512(_mm512_castps_si512(gv), v32(0x7F800000u)), v32(0x7F800000u));
        __m512 mv = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_mul_ps(_mm512_load_ps(m + j), am)),
                                  _mm512_mul_ps(c1, gv));
        __m512 vv = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_mul_ps(_mm512_load_ps(v + j), av)),
                                  _mm512_mul_ps(_mm512_mul_ps(c2, gv), gv));
        mv = _mm512_maskz_mov_ps(keep, mv);
        vv = _mm512_maskz_mov_ps(keep, vv);
        _mm512_store_ps(m + j, mv);
        _mm512_store_ps(v + j, vv);
        __m512 pj = _mm512_loadu_ps(p + j);
        __m512 d = _mm512_div_ps(mv, _mm512_add_ps(_mm512_sqrt_ps(vv), eps_c2));
        __m512 w = _mm512_mul_ps(_mm512_add_ps(pj, _mm512_mul_ps(step_size, d)), decay);
        _mm512_storeu_ps(p + j, _mm512_mask_blend_ps(keep, pj, w));
        mxm = _mm512_max_epu32(mxm, vec_absbits(mv));
        mxv = _mm512_max_epu32(mxv, vec_absbits(vv));
    }
    float nm = float_of((uint32_t)_mm512_reduce_max_epu32(mxm));
    float nv = float_of((uint32_t)_mm512_reduce_max_epu32(mxv));
    *amax_m = nm;
    *amax_v = nv;
    vec_quantize(qm, m, nm, 1, t);
    vec_quantize(qv, v, nv, 0, t);
}

/* ---- the same block in AVX2 ----
 * Eight lanes, the same operations in the same order (no FMA: the target
 * has none), gathers for the lookups. Magnitudes and bucket words are
 * below 2^31, so AVX2's signed comparisons and maxima order them as the
 * unsigned ones above do. */
#define V2_FN __attribute__((target("avx2")))

static inline V2_FN __m256i w32(uint32_t x) { return _mm256_set1_epi32((int)x); }

/* lut_code of 8 values, from the bucket's word */
static inline V2_FN __m256i v2_code(const uint32_t *lword, __m256 x)
{
    const uint32_t lo = MTI_Q8_LUT_EMIN << 23, hi = 127u << 23;
    __m256i u = _mm256_castps_si256(x);
    __m256i mag = _mm256_and_si256(u, w32(0x7FFFFFFFu));
    mag = _mm256_min_epi32(_mm256_max_epi32(mag, w32(lo)), w32(hi));
    __m256i mi = _mm256_srli_epi32(_mm256_sub_epi32(mag, w32(lo)), 23 - MTI_Q8_LUT_MB);
    __m256i pos = _mm256_add_epi32(w32(MTI_Q8_LUT_PER_SIGN), mi);
    __m256i neg = _mm256_sub_epi32(w32(MTI_Q8_LUT_PER_SIGN - 1u), mi);
    __m256i is_neg = _mm256_srai_epi32(u, 31);
    __m256i word = _mm256_i32gather_epi32((const int *)lword, _mm256_blendv_epi8(pos, neg, is_neg), 4);
    __m256i base = _mm256_and_si256(word, w32(0xFFu));
    /* above the threshold inside: a larger magnitude for a positive x, a
       smaller one for a negative x */
    __m256i xl = _mm256_and_si256(mag, w32(0xFFFFu)), tl = _mm256_srli_epi32(word, 16);
    __m256i above = _mm256_blendv_epi8(_mm256_cmpgt_epi32(xl, tl), _mm256_cmpgt_epi32(tl, xl), is_neg);
    above = _mm256_and_si256(above, _mm256_cmpeq_epi32(_mm256_and_si256(word, w32(0x100u)), w32(0x100u)));
    base = _mm256_sub_epi32(base, above); /* above is all ones: + 1 */
    __m256i ord = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
    return _mm256_and_si256(base, ord);
}

/* absmax_of's integer maximum over 8 lanes, NaN as 0 */
static inline V2_FN __m256i v2_absbits(__m256 x)
{
    __m256i u = _mm256_and_si256(_mm256_castps_si256(x), w32(0x7FFFFFFFu));
    return _mm256_andnot_si256(_mm256_cmpgt_epi32(u, w32(0x7F800000u)), u);
}

static inline V2_FN uint32_t v2_max(__m256i m)
{
    __m128i a = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    a = _mm_max_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    a = _mm_max_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(a);
}

/* quantize() of a full block */
static inline V2_FN void v2_quantize(uint8_t *q, const float *x, float amax, int is_signed,
                                     const mti_q8_tabs *t)
{
    if (amax == 0.0f) {
        memset(q, mti_q8_zero_code(is_signed), MTI_Q8_BLOCK);
        return;
    }
    const __m256 a = _mm256_set1_ps(amax);
    for (size_t j = 0; j < MTI_Q8_BLOCK; j += 8) {
        __m256 xv = _mm256_loadu_ps(x + j);
        __m256i c = v2_code(t->word[is_signed], _mm256_div_ps(xv, a));
        if (is_signed) {
            /* +1 toward a positive value, -1 (255) toward a negative one,
               where the code's sign bit differs from the value's */
            __m256i cneg = _mm256_cmpgt_epi32(w32(t->negc), c);
            __m256i flip = _mm256_xor_si256(cneg, _mm256_srai_epi32(_mm256_castps_si256(xv), 31));
            __m256i up = _mm256_castps_si256(_mm256_cmp_ps(xv, _mm256_setzero_ps(), _CMP_GT_OQ));
            __m256i step = _mm256_blendv_epi8(w32(255u), w32(1u), up);
            c = _mm256_and_si256(_mm256_add_epi32(c, _mm256_and_si256(step, flip)), w32(255u));
        }
        __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        _mm_storel_epi64((__m128i *)(q + j), _mm_packus_epi16(h, h));
    }
}

static V2_FN void v2_block(float *p, const float *g, uint8_t *qm, uint8_t *qv, float *amax_m,
                           float *amax_v, const mti_adamw8_consts *c, const mti_q8_tabs *t)
{
    float m[MTI_Q8_BLOCK] __attribute__((aligned(32))), v[MTI_Q8_BLOCK] __attribute__((aligned(32)));
    const float *cm = t->code[1], *cv = t->code[0];
    for (size_t j = 0; j < MTI_Q8_BLOCK; j += 8) {
        __m256i im = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qm + j)));
        __m256i iv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qv + j)));
        _mm256_store_ps(m + j, _mm256_i32gather_ps(cm, im, 4));
        _mm256_store_ps(v + j, _mm256_i32gather_ps(cv, iv, 4));
    }
    const __m256 am = _mm256_set1_ps(*amax_m), av = _mm256_set1_ps(*amax_v);
    const __m256 b1 = _mm256_set1_ps(c->b1), b2 = _mm256_set1_ps(c->b2);
    const __m256 c1 = _mm256_set1_ps(c->c1), c2 = _mm256_set1_ps(c->c2);
    const __m256 gs = _mm256_set1_ps(c->gs), step_size = _mm256_set1_ps(c->step_size);
    const __m256 eps_c2 = _mm256_set1_ps(c->eps_c2), decay = _mm256_set1_ps(c->decay);
    __m256i mxm = _mm256_setzero_si256(), mxv = _mm256_setzero_si256();
    for (size_t j = 0; j < MTI_Q8_BLOCK; j += 8) {
        __m256 gv = _mm256_mul_ps(_mm256_loadu_ps(g + j), gs);
        __m256 keep = _mm256_castsi256_ps(_mm256_xor_si256(
            _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(gv), w32(0x7F800000u)),
                               w32(0x7F800000u)),
            w32(0xFFFFFFFFu)));
        __m256 mv = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_mul_ps(_mm256_load_ps(m + j), am)),
                                  _mm256_mul_ps(c1, gv));
        __m256 vv = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_mul_ps(_mm256_load_ps(v + j), av)),
                                  _mm256_mul_ps(_mm256_mul_ps(c2, gv), gv));
        mv = _mm256_and_ps(keep, mv);
        vv = _mm256_and_ps(keep, vv);
        _mm256_store_ps(m + j, mv);
        _mm256_store_ps(v + j, vv);
        __m256 pj = _mm256_loadu_ps(p + j);
        __m256 d = _mm256_div_ps(mv, _mm256_add_ps(_mm256_sqrt_ps(vv), eps_c2));
        __m256 w = _mm256_mul_ps(_mm256_add_ps(pj, _mm256_mul_ps(step_size, d)), decay);
        _mm256_storeu_ps(p + j, _mm256_blendv_ps(pj, w, keep));
        mxm = _mm256_max_epi32(mxm, v2_absbits(mv));
        mxv = _mm256_max_epi32(mxv, v2_absbits(vv));
    }
    float nm = float_of(v2_max(mxm)), nv = float_of(v2_max(mxv));
    *amax_m = nm;
    *amax_v = nv;
    v2_quantize(qm, m, nm, 1, t);
    v2_quantize(qv, v, nv, 0, t);
}

/* ---- the paths of each level ---- */

static void q8_block_avx512(float *p, const float *g, uint8_t *qm, uint8_t *qv, float *amax_m,
                            float *amax_v, const mti_adamw8_consts *c, const mti_q8_tabs *t,
                            int level)
{
    vec_block(p, g, qm, qv, amax_m, amax_v, c, t, level);
}

static void q8_block_avx2(float *p, const float *g, uint8_t *qm, uint8_t *qv, float *amax_m,
                          float *amax_v, const mti_adamw8_consts *c, const mti_q8_tabs *t,
                          int level)
{
    (void)level;
    v2_block(p, g, qm, qv, amax_m, amax_v, c, t);
}

static mti_arch_paths g_paths[3];
static pthread_once_t g_paths_once = PTHREAD_ONCE_INIT;

/* Below AVX-512, oneDNN 2.6's sgemm (AVX2, SSE4.1) reads a K-major operand
 * whose rows lie a multiple of 4 KiB apart at half its rate or less; its
 * AVX-512 kernels do not (docs/benchmarks.md). */
static void paths_init(void)
{
    g_paths[0].gemm_pack_aliased = 1;
    g_paths[1] = (mti_arch_paths){.f32_to_bf16 = f2b_n_avx2,
                                  .f32_to_f16 = f2h_n_f16c,
                                  .f16_to_f32 = h2f_n_f16c,
                                  .adamw8_block = q8_block_avx2,
                                  .gemm_pack_aliased = 1};
    g_paths[2] = (mti_arch_paths){.f32_to_bf16 = f2b_n_avx512,
                                  .bf16_to_f32 = b2f_n_avx512,
                                  .f32_to_f16 = f2h_n_f16c,
                                  .f16_to_f32 = h2f_n_f16c,
                                  .adamw8_block = q8_block_avx512};
}

const mti_arch_paths *mti_arch_paths_at(int level)
{
    pthread_once(&g_paths_once, paths_init);
    return &g_paths[level];
}

int mti_arch_q8_init(const mti_q8_tabs *t)
{
    pthread_once(&g_paths_once, paths_init);
    const mti_isa cpu = mti_arch_detect();
    if (cpu >= MTI_ISA_AVX2) g_paths[1].q8_levels = 1;
    if (cpu < MTI_ISA_AVX512) return g_paths[1].q8_levels;
    if (g_vbmi) perm_init(t);
    return g_paths[2].q8_levels = 1 + g_vbmi;
}
#else
/* ISO C forbids an empty translation unit */
typedef int mti_arch_x86_unused;
#endif
