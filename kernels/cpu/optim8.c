/*
 * optim8.c - 8-bit blockwise AdamW (bitsandbytes' AdamW8bit; the contract
 * is in lib/kernels.h). The moments live as one byte per element, a code
 * into a 256-entry map (mti_q8_map), and one fp32 absmax per block of
 * MTI_Q8_BLOCK elements; each step dequantizes a block, updates it in fp32,
 * and quantizes it again against the block's new absmax.
 *
 * Blocks are independent, so a block is the unit of work and the result
 * does not depend on the thread count. A block's fresh moments wait in two
 * stack arrays (2 KiB), and its codes in a third (1 KiB), between the update
 * and the quantization: the op takes no memory beyond its arguments.
 *
 * The nearest code is bitsandbytes' rule (its CUDA kernel's binary search,
 * restated): x = value / absmax is compared with the midpoints
 * fl(c[k] + c[k+1]) / 2 of adjacent codes; a value exactly on a midpoint
 * takes the even code of the pair. Then a first moment whose sign bit
 * differs from its code's (a negative or -0 value that landed on the code
 * of 0) moves one code toward its sign, so small negative moments stay
 * negative. The midpoint rule is a count over 255 thresholds, made once
 * per process: bound[k] = the midpoint for even k, and the float just below
 * it for odd k, so that "x > bound[k]" is the whole rule and NaN lands on
 * code 0, as it does in bitsandbytes. The count is read from a table over
 * the float's bits (below), which gives the search's codes with one
 * comparison.
 */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "cpu_ops.h"
#include "vecmath.h"

#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

#define BLK MTI_Q8_BLOCK
/* blocks per parallel work item (4096 elements) */
#define ITEM_BLOCKS 16

/* A map and its decision thresholds. */
typedef struct q8_table {
    const float *code;  /* 256 values, ascending */
    float bound[255];   /* the code of x is the number of k with x > bound[k] */
} q8_table;

static void table_init(q8_table *t, int is_signed)
{
    t->code = mti_q8_map(is_signed);
    for (int k = 0; k < 255; k++) {
        float mid = (t->code[k] + t->code[k + 1]) * 0.5f;
        t->bound[k] = (k & 1) ? nextafterf(mid, -INFINITY) : mid;
    }
}

/* The count of thresholds below x. Its top four bits count the fifteen
 * thresholds bound[16 j - 1] below x (the first four halvings of a binary
 * search, done by comparing with values held in registers); the last four
 * halve within the 16 thresholds left, one gather each. Written out so that
 * the loops around it vectorise. */
static inline __attribute__((always_inline)) uint32_t q8_search(const float *bound,
                                                                const float *c, float x)
{
    uint32_t r = (uint32_t)(x > c[0]) + (uint32_t)(x > c[1]) + (uint32_t)(x > c[2]) +
                 (uint32_t)(x > c[3]) + (uint32_t)(x > c[4]) + (uint32_t)(x > c[5]) +
                 (uint32_t)(x > c[6]) + (uint32_t)(x > c[7]) + (uint32_t)(x > c[8]) +
                 (uint32_t)(x > c[9]) + (uint32_t)(x > c[10]) + (uint32_t)(x > c[11]) +
                 (uint32_t)(x > c[12]) + (uint32_t)(x > c[13]) + (uint32_t)(x > c[14]);
    r <<= 4;
    r += (uint32_t)(x > bound[r + 7]) << 3;
    r += (uint32_t)(x > bound[r + 3]) << 2;
    r += (uint32_t)(x > bound[r + 1]) << 1;
    return r + (uint32_t)(x > bound[r]);
}

/* ---- the same count by a table over the float's bits ----
 * A value x = m / absmax lies in [-1, 1]. Its magnitude's bits, clamped to
 * [2^-25, 1] (every threshold of both maps is at least 5e-8 > 2^-24 from
 * zero, so nothing below 2^-25 is told apart) and cut to the exponent and
 * the top LUT_MB mantissa bits, pick one of LUT_PER_SIGN buckets per sign;
 * the buckets of both signs, negatives mirrored, are consecutive intervals
 * of x in increasing order. With 7 mantissa bits no bucket holds more than
 * one threshold (the closest thresholds, the unsigned map's top decade,
 * are 0.007 apart; a bucket there is 2^-8 wide), so a bucket's code is the
 * count of thresholds below all of it, plus one if x is above the one
 * threshold inside it: one comparison and two table reads instead of
 * eight comparisons. The tables are built from the thresholds at first use
 * and checked: should any bucket hold two thresholds the search is used
 * instead, so the codes are always the search's. */
#define LUT_EMIN 102u                 /* exponent field of 2^-25 */
#define LUT_MB 7                      /* mantissa bits kept */
#define LUT_PER_SIGN ((127u - LUT_EMIN) * (1u << LUT_MB) + 1u)
#define LUT_N (2u * LUT_PER_SIGN)

typedef struct q8_lut {
    uint32_t base[LUT_N]; /* thresholds below every x of the bucket */
    float thr[LUT_N];     /* the threshold inside it, or +inf */
    /* the same in one word, for the vector path: base in bits 0-7, bit 8
     * set when a threshold is inside, and that threshold's low 16 bits of
     * magnitude in bits 16-31. A bucket's magnitudes share their exponent
     * and top LUT_MB mantissa bits, so the comparison with the threshold
     * is one of the low 16 bits (reversed for negatives): one read */
    uint32_t word[LUT_N];
    int ok;               /* no bucket holds two thresholds */
    int word_ok;          /* and the words hold (no threshold at the clamped ends) */
} q8_lut;

static q8_table g_tab[2]; /* [0] unsigned, [1] signed */
static q8_lut g_lut[2];
static pthread_once_t g_tab_once = PTHREAD_ONCE_INIT;

static inline __attribute__((always_inline)) uint32_t lut_index(float x)
{
    const uint32_t lo = LUT_EMIN << 23, hi = 127u << 23; /* 2^-25 and 1.0 */
    uint32_t u = bits_of(x), mag = u & 0x7FFFFFFFu;
    mag = mag < lo ? lo : mag;
    mag = mag > hi ? hi : mag;
    uint32_t mi = (mag - lo) >> (23 - LUT_MB), neg = u >> 31;
    /* LUT_PER_SIGN + mi, or LUT_PER_SIGN - 1 - mi for a negative x,
     * without a branch (so the loops vectorise) */
    return LUT_PER_SIGN + mi - neg * (2u * mi + 1u);
}

/* The code of x by the table (NaN: code 0); the same count as q8_search. */
static inline __attribute__((always_inline)) uint32_t lut_code(const uint32_t *base,
                                                              const float *thr, float x)
{
    uint32_t i = lut_index(x);
    uint32_t c = base[i] + (uint32_t)(x > thr[i]);
    return c & (0u - (uint32_t)(x == x));
}

static void lut_build(q8_lut *l, const float *bound)
{
    const uint32_t lo = LUT_EMIN << 23;
    l->ok = l->word_ok = 1;
    for (uint32_t mi = 0; mi < LUT_PER_SIGN; mi++) {
        /* the bucket's magnitudes: [mlo, mhi), 0 included in the first */
        float mlo = mi == 0 ? 0.0f : float_of(lo + (mi << (23 - LUT_MB)));
        float mhi = float_of(lo + ((mi + 1u) << (23 - LUT_MB)));
        for (int neg = 0; neg < 2; neg++) {
            /* x in [mlo, mhi) or in (-mhi, -mlo] */
            uint32_t below = 0, inside = 0;
            float thr = INFINITY;
            for (int k = 0; k < 255; k++) {
                float b = bound[k];
                int under = neg ? b <= -mhi : b < mlo;
                int in = neg ? (b > -mhi && b <= -mlo) : (b >= mlo && b < mhi);
                below += (uint32_t)under;
                if (in) inside++, thr = b;
            }
            if (inside > 1) l->ok = 0;
            uint32_t i = neg ? LUT_PER_SIGN - 1u - mi : LUT_PER_SIGN + mi;
            l->base[i] = below;
            l->thr[i] = thr;
            uint32_t tm = bits_of(thr) & 0x7FFFFFFFu;
            l->word[i] = below;
            if (inside) {
                l->word[i] |= 0x100u | (tm & 0xFFFFu) << 16;
                /* the threshold's magnitude in this bucket, unclamped */
                if (mi == 0 || mi == LUT_PER_SIGN - 1u || tm < lo ||
                    (tm - lo) >> (23 - LUT_MB) != mi)
                    l->word_ok = 0;
            }
        }
    }
}

/* The vector path (below) in use: 0 none (the portable loops), 1 AVX-512
 * with gathers, 2 AVX-512 with permutes for the lookups (VBMI); the most
 * the CPU and the tables allow, unless the tests or the benchmark chose
 * less. */
static int g_vec, g_vec_most;
static int vec_supported(void);

static void tables_init(void)
{
    for (int s = 0; s < 2; s++) {
        table_init(&g_tab[s], s);
        lut_build(&g_lut[s], g_tab[s].bound);
    }
    g_vec = g_vec_most = vec_supported();
}

uint8_t mti_cpu_q8_code(float x, int is_signed, int by_search)
{
    pthread_once(&g_tab_once, tables_init);
    const q8_table *t = &g_tab[is_signed != 0];
    const q8_lut *l = &g_lut[is_signed != 0];
    if (by_search || !l->ok) {
        float c[15];
        for (int j = 0; j < 15; j++) c[j] = t->bound[16 * j + 15];
        return (uint8_t)q8_search(t->bound, c, x);
    }
    return (uint8_t)lut_code(l->base, l->thr, x);
}

int mti_cpu_q8_lut_ok(void)
{
    pthread_once(&g_tab_once, tables_init);
    return g_lut[0].ok && g_lut[1].ok;
}

/* The step's scalars (made once per call, in double, rounded to fp32). */
typedef struct adamw8_consts {
    float b1, b2, c1, c2;   /* betas and 1 - betas */
    float gs;               /* grad_scale */
    float step_size;        /* -lr sqrt(1 - b2^t) / (1 - b1^t) */
    float eps_c2;           /* eps sqrt(1 - b2^t) */
    float decay;            /* 1 - lr wd */
} adamw8_consts;

/* max |x| over n values, NaN left out (as fmaxf): for non-negative floats
 * the bit patterns order as the values, so this is an integer max. */
static inline __attribute__((always_inline)) float absmax_of(const float *x, size_t n)
{
    uint32_t mx = 0;
#pragma omp simd reduction(max : mx)
    for (size_t j = 0; j < n; j++) {
        uint32_t u = bits_of(x[j]) & 0x7FFFFFFFu;
        u = u > 0x7F800000u ? 0u : u;
        mx = u > mx ? u : mx;
    }
    return float_of(mx);
}

/* Codes of x (n) / amax. With `sign_fix` (the signed map) a code whose
 * sign bit differs from the value's moves one step toward the value's sign
 * (255 wraps to 0 and back, as the byte arithmetic of bitsandbytes does).
 * A block whose absmax is 0 is all zeros: the zero code. NaN takes code 0
 * (no threshold is below it). */
static inline __attribute__((always_inline)) void
quantize(uint8_t *q, const float *x, size_t n, float amax, const q8_table *t,
                            const q8_lut *l, int sign_fix)
{
    if (amax == 0.0f) {
        memset(q, mti_q8_zero_code(sign_fix), n);
        return;
    }
    const float *code = t->code;
    uint32_t r[BLK];
    if (l->ok) {
        const uint32_t *base = l->base;
        const float *thr = l->thr;
#pragma omp simd
        for (size_t j = 0; j < n; j++) r[j] = lut_code(base, thr, x[j] / amax);
    } else {
        const float *bound = t->bound;
        float c[15];
        for (int j = 0; j < 15; j++) c[j] = bound[16 * j + 15];
#pragma omp simd
        for (size_t j = 0; j < n; j++) r[j] = q8_search(bound, c, x[j] / amax);
    }
#pragma omp simd
    for (size_t j = 0; j < n; j++) {
        uint32_t c = r[j];
        if (sign_fix) {
            float v = x[j];
            /* +1 toward a positive value, -1 (255) toward a negative one */
            uint32_t flip = (bits_of(code[c]) ^ bits_of(v)) >> 31;
            uint32_t step = 255u - 254u * (uint32_t)(v > 0.0f);
            c = (c + flip * step) & 255u;
        }
        q[j] = (uint8_t)c;
    }
}

/* One block of n <= BLK elements. */
WIDE_CLONES static void adamw8_block(float *p, const float *g, uint8_t *qm, uint8_t *qv,
                                     float *amax_m, float *amax_v, size_t n,
                                     const adamw8_consts *c, const q8_table *tm,
                                     const q8_table *tv, const q8_lut *lm, const q8_lut *lv)
{
    float m[BLK], v[BLK];
    const float am = *amax_m, av = *amax_v;
    const float *cm = tm->code, *cv = tv->code;
    const float b1 = c->b1, b2 = c->b2, c1 = c->c1, c2 = c->c2, gs = c->gs;
    const float step_size = c->step_size, eps_c2 = c->eps_c2, decay = c->decay;
#pragma omp simd
    for (size_t j = 0; j < n; j++) {
        float gv = g[j] * gs;
        /* all ones where gv is finite; selects as masks, which vectorise */
        uint32_t keep = 0u - (uint32_t)((bits_of(gv) & 0x7F800000u) != 0x7F800000u);
        float mv = b1 * (cm[qm[j]] * am) + c1 * gv;
        float vv = b2 * (cv[qv[j]] * av) + c2 * gv * gv;
        mv = float_of(bits_of(mv) & keep);
        vv = float_of(bits_of(vv) & keep);
        m[j] = mv;
        v[j] = vv;
        float w = (p[j] + step_size * (mv / (sqrtf(vv) + eps_c2))) * decay;
        p[j] = float_of((bits_of(w) & keep) | (bits_of(p[j]) & ~keep));
    }
    float nm = absmax_of(m, n), nv = absmax_of(v, n);
    *amax_m = nm;
    *amax_v = nv;
    quantize(qm, m, n, nm, tm, lm, 1);
    quantize(qv, v, n, nv, tv, lv, 0);
}

/* ---- the block in AVX-512, written out ----
 * gcc does not gather for Zen (it loads lane by lane), which made the block
 * above several times its memory's time. This is the same arithmetic, one
 * operation for each of the scalar code's, in its order and without FMA,
 * so the bits are the same: a full block at a time, 16 lanes; the map
 * lookups are gathers: dequantizing from the 1 KiB maps, quantizing one
 * word a value from the bucket tables (q8_lut.word).
 * The signed map's negative codes are its first ones (checked at first
 * use), so a code's sign bit is a comparison of the code. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>
#define Q8_VEC 1
#define VEC_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

static uint32_t g_negc; /* the signed map's negative codes: 0 .. g_negc - 1 */

static int perm_supported(void);

static int vec_supported(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl"))
        return 0;
    if (!g_lut[0].ok || !g_lut[1].ok || !g_lut[0].word_ok || !g_lut[1].word_ok) return 0;
    const float *code = g_tab[1].code;
    uint32_t negc = 0;
    while (negc < 256 && (bits_of(code[negc]) >> 31)) negc++;
    for (uint32_t c = negc; c < 256; c++)
        if (bits_of(code[c]) >> 31) return 0;
    g_negc = negc;
    return 1 + perm_supported();
}

static inline VEC_FN __m512i v32(uint32_t x) { return _mm512_set1_epi32((int)x); }

/* lut_code of 16 values, from the bucket's word */
static inline VEC_FN __m512i vec_code(const q8_lut *l, __m512 x)
{
    const uint32_t lo = LUT_EMIN << 23, hi = 127u << 23;
    __m512i u = _mm512_castps_si512(x);
    __m512i mag = _mm512_and_si512(u, v32(0x7FFFFFFFu));
    mag = _mm512_min_epu32(_mm512_max_epu32(mag, v32(lo)), v32(hi));
    __m512i mi = _mm512_srli_epi32(_mm512_sub_epi32(mag, v32(lo)), 23 - LUT_MB);
    __m512i pos = _mm512_add_epi32(v32(LUT_PER_SIGN), mi);
    __m512i neg = _mm512_sub_epi32(v32(LUT_PER_SIGN - 1u), mi);
    __mmask16 is_neg = _mm512_movepi32_mask(u);
    __m512i word = _mm512_i32gather_epi32(_mm512_mask_blend_epi32(is_neg, pos, neg), l->word, 4);
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
static inline VEC_FN void vec_quantize(uint8_t *q, const float *x, float amax, int is_signed)
{
    if (amax == 0.0f) {
        memset(q, mti_q8_zero_code(is_signed), BLK);
        return;
    }
    const q8_lut *l = &g_lut[is_signed];
    const __m512 a = _mm512_set1_ps(amax);
    for (size_t j = 0; j < BLK; j += 16) {
        __m512 xv = _mm512_loadu_ps(x + j);
        __m512i c = vec_code(l, _mm512_div_ps(xv, a));
        if (is_signed) {
            /* +1 toward a positive value, -1 (255) toward a negative one,
               where the code's sign bit differs from the value's */
            __mmask16 cneg = _mm512_cmplt_epu32_mask(c, v32(g_negc));
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

static int perm_supported(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512vbmi")) return 0;
    for (int t = 0; t < 2; t++) {
        q8_perm *P = &g_perm[t];
        const float *code = g_tab[t].code;
        for (int c = 0; c < 256; c++)
            for (int b = 0; b < 4; b++) P->plane[b][c] = (uint8_t)(bits_of(code[c]) >> (8 * b));
    }
    /* output register j, 128-bit lane L, dword p holds code 16 j + 4 L + p
       after the unpacking when the shuffled codes have it at 16 L + 4 j + p */
    for (int j = 0; j < 4; j++)
        for (int L = 0; L < 4; L++)
            for (int p = 0; p < 4; p++) g_deq_shuf[16 * L + 4 * j + p] = (uint8_t)(16 * j + 4 * L + p);
    return 1;
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
                             float *amax_v, const adamw8_consts *c, int level)
{
    float m[BLK] __attribute__((aligned(64))), v[BLK] __attribute__((aligned(64)));
    if (level >= 2) {
        perm_dequant(m, qm, BLK, &g_perm[1]);
        perm_dequant(v, qv, BLK, &g_perm[0]);
    } else {
        const float *cm = g_tab[1].code, *cv = g_tab[0].code;
        for (size_t j = 0; j < BLK; j += 16) {
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
    for (size_t j = 0; j < BLK; j += 16) {
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
    vec_quantize(qm, m, nm, 1);
    vec_quantize(qv, v, nv, 0);
}
#else
static int vec_supported(void) { return 0; }
#endif

int mti_cpu_q8_vector(int on)
{
    pthread_once(&g_tab_once, tables_init);
    int was = g_vec;
    g_vec = on < 0 ? 0 : on < g_vec_most ? on : g_vec_most;
    return was;
}

mt_status mti_cpu_adam_check(const mti_kctx *k, const char *op, const void *pc, mti_dtype pc_dt,
                             const mti_adamw_args *a)
{
    if (!a) return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: no arguments", op);
    if (pc && pc_dt != MTI_F32 && pc_dt != MTI_F16 && pc_dt != MTI_BF16)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: compute dtype %d is not a float", op,
                        (int)pc_dt);
    if (a->step < 1)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: step %lld (steps count from 1)", op,
                        (long long)a->step);
    return MT_OK;
}

/* The step's scalars, and the maps, made once per call (pthread_once). */
static adamw8_consts consts_of(const mti_adamw_args *a)
{
    pthread_once(&g_tab_once, tables_init);
    double bc1 = 1.0 - pow((double)a->beta1, (double)a->step);
    double bc2_sqrt = sqrt(1.0 - pow((double)a->beta2, (double)a->step));
    return (adamw8_consts){
        .b1 = a->beta1, .b2 = a->beta2, .c1 = 1.0f - a->beta1, .c2 = 1.0f - a->beta2,
        .gs = a->grad_scale,
        .step_size = (float)(-(double)a->lr * bc2_sqrt / bc1),
        .eps_c2 = (float)((double)a->eps * bc2_sqrt),
        .decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay),
    };
}

/* Block b of a call over n elements (its first element, its length). */
static inline size_t block_len(size_t b, size_t n)
{
    return n - b * BLK < BLK ? n - b * BLK : BLK;
}

static void update_block(float *p, const float *g, uint8_t *qm, uint8_t *qv, float *am, float *av,
                         size_t b, size_t n, const adamw8_consts *c)
{
    size_t i = b * BLK, len = block_len(b, n);
#ifdef Q8_VEC
    if (g_vec && len == BLK) {
        vec_block(p, g + i, qm + i, qv + i, am + b, av + b, c, g_vec);
        return;
    }
#endif
    adamw8_block(p, g + i, qm + i, qv + i, am + b, av + b, len, c, &g_tab[1], &g_tab[0],
                 &g_lut[1], &g_lut[0]);
}

/* The tensors of a call of n elements: none NULL unless n is 0. */
static mt_status args_check(const mti_kctx *k, const char *op, const void *p, const float *g,
                            const uint8_t *qm, const uint8_t *qv, const float *am,
                            const float *av, size_t n)
{
    if (n == 0 || (p && g && qm && qv && am && av)) return MT_OK;
    return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: NULL %s", op,
                    !p ? "weights" : !g ? "g" : !qm ? "qm" : !qv ? "qv" : !am ? "absmax_m" : "absmax_v");
}

mt_status mti_cpu_adamw8(const mti_kctx *k, float *p, const float *g, uint8_t *qm, uint8_t *qv,
                         float *absmax_m, float *absmax_v, void *pc, mti_dtype pc_dt, size_t n,
                         const mti_adamw_args *a)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    mt_status s = mti_cpu_adam_check(k, "adamw8", pc, pc_dt, a);
    if (!s) s = args_check(k, "adamw8", p, g, qm, qv, absmax_m, absmax_v, n);
    if (s || n == 0) return s;
    const adamw8_consts c = consts_of(a);
    size_t blocks = (n + BLK - 1) / BLK, items = (blocks + ITEM_BLOCKS - 1) / ITEM_BLOCKS;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (n > MTI_CPU_PAR_MIN)
    for (size_t it = 0; it < items; it++) {
        size_t b_end = (it + 1) * ITEM_BLOCKS < blocks ? (it + 1) * ITEM_BLOCKS : blocks;
        for (size_t b = it * ITEM_BLOCKS; b < b_end; b++) {
            size_t i = b * BLK;
            update_block(p + i, g, qm, qv, absmax_m, absmax_v, b, n, &c);
            if (pc) mti_cpu_store_f32(pc, pc_dt, i, p + i, block_len(b, n));
        }
    }
    return MT_OK;
}

/* The weights of a block go through a stack buffer of fp32 (1 KiB): the
 * op takes no memory beyond its arguments, and the block is in cache from
 * its widening to its rounding. */
mt_status mti_cpu_adamw8_bf16(const mti_kctx *k, uint16_t *w, const float *g, uint8_t *qm,
                              uint8_t *qv, float *absmax_m, float *absmax_v, size_t n, size_t at,
                              uint64_t seed, const mti_adamw_args *a)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    mt_status s = mti_cpu_adam_check(k, "adamw8_bf16", NULL, MTI_F32, a);
    if (!s) s = args_check(k, "adamw8_bf16", w, g, qm, qv, absmax_m, absmax_v, n);
    if (s) return s;
    if (at % BLK)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "adamw8_bf16: first element %zu is not a multiple of the block (%d)", at,
                        BLK);
    if (n == 0) return MT_OK;
    const adamw8_consts c = consts_of(a);
    size_t blocks = (n + BLK - 1) / BLK, items = (blocks + ITEM_BLOCKS - 1) / ITEM_BLOCKS;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (n > MTI_CPU_PAR_MIN)
    for (size_t it = 0; it < items; it++) {
        size_t b_end = (it + 1) * ITEM_BLOCKS < blocks ? (it + 1) * ITEM_BLOCKS : blocks;
        float p[BLK];
        for (size_t b = it * ITEM_BLOCKS; b < b_end; b++) {
            size_t i = b * BLK, len = block_len(b, n);
            mti_cpu_load_f32(p, w, MTI_BF16, i, len);
            update_block(p, g, qm, qv, absmax_m, absmax_v, b, n, &c);
            /* a block lies in one piece: the piece's seed, the offset in it */
            size_t e = at + i, piece = e - e % MTI_SR_PIECE;
            mti_cpu_store_bf16_sr(w + i, p, len, e - piece, seed ^ (uint64_t)piece);
        }
    }
    return MT_OK;
}
