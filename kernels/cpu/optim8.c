/*
 * optim8.c - 8-bit blockwise AdamW (bitsandbytes' AdamW8bit; the contract
 * is in lib/kernels.h). The moments live as one byte per element, a code
 * into a 256-entry map (mti_q8_map), and one fp32 absmax per block of
 * MTI_Q8_BLOCK elements; each step dequantizes a block, updates it in fp32,
 * and quantizes it again against the block's new absmax.
 *
 * Blocks are independent, so a block is the unit of work and the result
 * does not depend on the thread count. A block's fresh moments wait in two
 * stack arrays (2 KiB) between the update and the quantization: the op
 * takes no memory beyond its arguments.
 *
 * The nearest code is bitsandbytes' rule (its CUDA kernel's binary search,
 * restated): x = value / absmax is compared with the midpoints
 * fl(c[k] + c[k+1]) / 2 of adjacent codes; a value exactly on a midpoint
 * takes the even code of the pair. Then a first moment whose sign bit
 * differs from its code's (a negative or -0 value that landed on the code
 * of 0) moves one code toward its sign, so small negative moments stay
 * negative. The midpoint rule is a search over 255 thresholds, made once
 * per call: bound[k] = the midpoint for even k, and the float just below
 * it for odd k, so that "x > bound[k]" is the whole rule and NaN lands on
 * code 0, as it does in bitsandbytes.
 */
#include <math.h>
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
 * A block whose absmax is 0 is all zeros: the zero code. */
static inline __attribute__((always_inline)) void
quantize(uint8_t *q, const float *x, size_t n, float amax, const q8_table *t,
                            int sign_fix)
{
    if (amax == 0.0f) {
        memset(q, mti_q8_zero_code(sign_fix), n);
        return;
    }
    const float *bound = t->bound, *code = t->code;
    float c[15];
    for (int j = 0; j < 15; j++) c[j] = bound[16 * j + 15];
#pragma omp simd
    for (size_t j = 0; j < n; j++) {
        float v = x[j];
        uint32_t r = q8_search(bound, c, v / amax);
        if (sign_fix) {
            /* +1 toward a positive value, -1 (255) toward a negative one */
            uint32_t flip = (bits_of(code[r]) ^ bits_of(v)) >> 31;
            uint32_t step = 255u - 254u * (uint32_t)(v > 0.0f);
            r = (r + flip * step) & 255u;
        }
        q[j] = (uint8_t)r;
    }
}

/* One block of n <= BLK elements. */
WIDE_CLONES static void adamw8_block(float *p, const float *g, uint8_t *qm, uint8_t *qv,
                                     float *amax_m, float *amax_v, size_t n,
                                     const adamw8_consts *c, const q8_table *tm,
                                     const q8_table *tv)
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
    quantize(qm, m, n, nm, tm, 1);
    quantize(qv, v, n, nv, tv, 0);
}

mt_status mti_cpu_adamw8(const mti_kctx *k, float *p, const float *g, uint8_t *qm, uint8_t *qv,
                         float *absmax_m, float *absmax_v, void *pc, mti_dtype pc_dt, size_t n,
                         const mti_adamw_args *a)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!a) return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adamw8: no arguments");
    if (pc && pc_dt != MTI_F32 && pc_dt != MTI_F16 && pc_dt != MTI_BF16)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adamw8: compute dtype %d is not a float",
                        (int)pc_dt);
    if (a->step < 1)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adamw8: step %lld (steps count from 1)",
                        (long long)a->step);
    if (n > 0 && (!p || !g || !qm || !qv || !absmax_m || !absmax_v))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "adamw8: NULL %s", !p ? "p" : !g ? "g" : !qm ? "qm" : !qv ? "qv"
                                           : !absmax_m ? "absmax_m" : "absmax_v");
    if (n == 0) return MT_OK;
    q8_table tm, tv;
    table_init(&tm, 1);
    table_init(&tv, 0);
    double bc1 = 1.0 - pow((double)a->beta1, (double)a->step);
    double bc2_sqrt = sqrt(1.0 - pow((double)a->beta2, (double)a->step));
    adamw8_consts c = {
        .b1 = a->beta1, .b2 = a->beta2, .c1 = 1.0f - a->beta1, .c2 = 1.0f - a->beta2,
        .gs = a->grad_scale,
        .step_size = (float)(-(double)a->lr * bc2_sqrt / bc1),
        .eps_c2 = (float)((double)a->eps * bc2_sqrt),
        .decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay),
    };
    size_t blocks = (n + BLK - 1) / BLK, items = (blocks + ITEM_BLOCKS - 1) / ITEM_BLOCKS;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) if (n > MTI_CPU_PAR_MIN)
    for (size_t it = 0; it < items; it++) {
        size_t b_end = (it + 1) * ITEM_BLOCKS < blocks ? (it + 1) * ITEM_BLOCKS : blocks;
        for (size_t b = it * ITEM_BLOCKS; b < b_end; b++) {
            size_t i = b * BLK, len = n - i < BLK ? n - i : BLK;
            adamw8_block(p + i, g + i, qm + i, qv + i, absmax_m + b, absmax_v + b, len, &c, &tm,
                         &tv);
            if (pc) mti_cpu_store_f32(pc, pc_dt, i, p + i, len);
        }
    }
    return MT_OK;
}
