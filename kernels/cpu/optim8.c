/*
 * optim8.c - 8-bit blockwise AdamW (bitsandbytes' AdamW8bit; the contract
 * is in lib/ops/kernels.h). The moments live as one byte per element, a code
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
#define LUT_EMIN MTI_Q8_LUT_EMIN         /* exponent field of 2^-25 (arch.h) */
#define LUT_MB MTI_Q8_LUT_MB             /* mantissa bits kept */
#define LUT_PER_SIGN MTI_Q8_LUT_PER_SIGN
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

/* The hand-written block of the level in use (arch.h: adamw8_block), for
 * full blocks: 0 none (the portable loops), 1 with gathers, 2 with
 * permutes for the lookups (AVX512-VBMI); at most what the CPU and the
 * tables allow (g_vec_most), and less when the tests or the benchmark
 * chose less. */
static int g_vec, g_vec_most;
static mti_q8_tabs g_tabs;

/* The tables as the hand-written blocks take them, when they can: every
 * bucket a word, and the signed map's negative codes first (so a code's
 * sign bit is a comparison of the code). */
static int vec_tables(void)
{
    if (!g_lut[0].ok || !g_lut[1].ok || !g_lut[0].word_ok || !g_lut[1].word_ok) return 0;
    const float *code = g_tab[1].code;
    uint32_t negc = 0;
    while (negc < 256 && (bits_of(code[negc]) >> 31)) negc++;
    for (uint32_t c = negc; c < 256; c++)
        if (bits_of(code[c]) >> 31) return 0;
    g_tabs = (mti_q8_tabs){.code = {g_tab[0].code, g_tab[1].code},
                           .word = {g_lut[0].word, g_lut[1].word},
                           .negc = negc};
    return 1;
}

static void tables_init(void)
{
    for (int s = 0; s < 2; s++) {
        table_init(&g_tab[s], s);
        lut_build(&g_lut[s], g_tab[s].bound);
    }
    g_vec = g_vec_most = vec_tables() ? mti_arch_q8_init(&g_tabs) : 0;
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

/* The step's scalars (arch.h). */
typedef mti_adamw8_consts adamw8_consts;

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
MTI_VEC_VOID(adamw8_block, (float *p, const float *g, uint8_t *qm, uint8_t *qv, float *amax_m,
                            float *amax_v, size_t n, const adamw8_consts *c, const q8_table *tm,
                            const q8_table *tv, const q8_lut *lm, const q8_lut *lv),
             (p, g, qm, qv, amax_m, amax_v, n, c, tm, tv, lm, lv))
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
    if (g_vec && len == BLK) {
        const mti_arch_paths *ap = mti_arch_paths_now();
        int level = g_vec < ap->q8_levels ? g_vec : ap->q8_levels;
        if (level) {
            ap->adamw8_block(p, g + i, qm + i, qv + i, am + b, av + b, c, &g_tabs, level);
            return;
        }
    }
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
