/*
 * optim4.c - 4-bit AdamW (Li, Chen, Zhu 2023; the contract is in
 * lib/ops/kernels.h, the adamw4 op). The moments live as 4-bit codes, two to a
 * byte: m blockwise (one absmax per MTI_Q4_BLOCK elements) in the signed
 * dynamic-exponent map, v in the linear map without zero, scaled rank-1
 * (a matrix: min of its row's and its column's maximum) or blockwise (a
 * vector).
 *
 * Work is done a quantization block at a time (128 elements, 64 bytes of
 * codes), so blocks are independent and the result does not depend on the
 * thread count. The rank-1 scales need the maxima of the new v over whole
 * rows and columns before any v can be coded, so a matrix takes two
 * passes: the first computes every new v (from the old codes, the old
 * scales and g) only to take the maxima; the second computes the same
 * values again (the same operations, so the same bits), updates p and
 * codes m and v. Workspace: the new maxima (rows + cols floats) and one
 * column-maxima row per thread.
 */
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_ops.h"
#include "vecmath.h"

#define BLK MTI_Q4_BLOCK

typedef struct q4_consts {
    float b1, b2, c1, c2, gs, eps;
    float step_size; /* lr / (1 - b1^t) */
    float bc2_sqrt;  /* sqrt(1 - b2^t) */
    float decay;     /* 1 - lr wd */
    float mid_m[15], mid_v[15];
    const float *code_m, *code_v;
} q4_consts;

/* Code of element j of a block whose first element is even. */
static inline unsigned nib(const uint8_t *q, size_t j)
{
    return (q[j >> 1] >> ((j & 1) << 2)) & 15u;
}

/* The nearest level: the count of midpoints strictly below x. Written
 * out so that the loops around it vectorise. */
static inline __attribute__((always_inline)) uint32_t q4_code(const float *mid, float x)
{
    return (uint32_t)(x > mid[0]) + (uint32_t)(x > mid[1]) + (uint32_t)(x > mid[2]) +
           (uint32_t)(x > mid[3]) + (uint32_t)(x > mid[4]) + (uint32_t)(x > mid[5]) +
           (uint32_t)(x > mid[6]) + (uint32_t)(x > mid[7]) + (uint32_t)(x > mid[8]) +
           (uint32_t)(x > mid[9]) + (uint32_t)(x > mid[10]) + (uint32_t)(x > mid[11]) +
           (uint32_t)(x > mid[12]) + (uint32_t)(x > mid[13]) + (uint32_t)(x > mid[14]);
}

/* All ones where gv is finite (masks vectorise where branches do not). */
static inline uint32_t finite_mask(float gv)
{
    return 0u - (uint32_t)((bits_of(gv) & 0x7F800000u) != 0x7F800000u);
}

/* The new v of an element from its code's value, its old scale and g
 * (0 where g is not finite: keep is the mask). */
static inline float v_new(float b2, float c2, float code, float scale, float gv, uint32_t keep)
{
    float vv = b2 * (code * scale) + c2 * gv * gv;
    return float_of(bits_of(vv) & keep);
}

/* Where the rank-1 scales are: the state's (old) and this step's (new). */
typedef struct q4_view {
    const float *rowmax_old, *colmax_old;
    const float *rowmax_new, *colmax_new;
    int64_t cols;
    int rank1;
} q4_view;

/* One block [i0, i0 + len) (len <= BLK, i0 a multiple of BLK): m, v and p
 * updated, the block's new absmax of m (and of v for a vector), codes. */
MTI_VEC_VOID(q4_block, (const q4_consts *c, const q4_view *w, float *p, const float *g,
                        const mti_adamw4_state *st, size_t i0, size_t len),
             (c, w, p, g, st, i0, len))
{
    float m[BLK], v[BLK], so[BLK], sn[BLK];
    uint8_t cm[BLK + 1], cv[BLK + 1];
    const size_t b = i0 / BLK;
    const uint8_t *qm = st->qm + (i0 >> 1), *qv = st->qv + (i0 >> 1);
    const float am_old = st->absmax_m[b];
    if (w->rank1) { /* the old and new scales, row and column stepped, not divided */
        int64_t r = (int64_t)i0 / w->cols, col = (int64_t)i0 % w->cols;
        for (size_t j = 0; j < len; j++) {
            float a = w->rowmax_old[r], bb = w->colmax_old[col];
            float an = w->rowmax_new[r], bn = w->colmax_new[col];
            so[j] = a < bb ? a : bb;
            sn[j] = an < bn ? an : bn;
            if (++col == w->cols) col = 0, r++;
        }
    } else {
        const float sv_old = st->scale_v[b];
        for (size_t j = 0; j < len; j++) so[j] = sv_old;
    }
    const float *code_m = c->code_m, *code_v = c->code_v;
    const float b1 = c->b1, c1 = c->c1, b2 = c->b2, c2 = c->c2, gs = c->gs, eps = c->eps;
    const float bc2_sqrt = c->bc2_sqrt;
    const float decay = c->decay, step_size = c->step_size;
    float *pp = p + i0;
    const float *gg = g + i0;
#pragma omp simd
    for (size_t j = 0; j < len; j++) {
        float gv = gg[j] * gs;
        uint32_t keep = finite_mask(gv);
        float mv = b1 * (code_m[nib(qm, j)] * am_old) + c1 * gv;
        mv = float_of(bits_of(mv) & keep);
        float vv = v_new(b2, c2, code_v[nib(qv, j)], so[j], gv, keep);
        m[j] = mv;
        v[j] = vv;
        float denom = sqrtf(vv) / bc2_sqrt + eps;
        float pn = pp[j] * decay - step_size * (mv / denom);
        pp[j] = float_of((bits_of(pn) & keep) | (bits_of(pp[j]) & ~keep));
    }
    /* the new scales (exact maxima) */
    uint32_t am_b = 0, av_b = 0;
#pragma omp simd reduction(max : am_b, av_b)
    for (size_t j = 0; j < len; j++) {
        uint32_t a = bits_of(m[j]) & 0x7FFFFFFFu, vb = bits_of(v[j]) & 0x7FFFFFFFu;
        a = a > 0x7F800000u ? 0u : a; /* NaN left out, as fmaxf does */
        vb = vb > 0x7F800000u ? 0u : vb;
        am_b = a > am_b ? a : am_b;
        av_b = vb > av_b ? vb : av_b;
    }
    const float am = float_of(am_b);
    st->absmax_m[b] = am;
    if (!w->rank1) {
        const float avb = float_of(av_b);
        st->scale_v[b] = avb;
        for (size_t j = 0; j < len; j++) sn[j] = avb;
    }
    float mid_m[15], mid_v[15];
    memcpy(mid_m, c->mid_m, sizeof mid_m);
    memcpy(mid_v, c->mid_v, sizeof mid_v);
    if (am == 0.0f) {
        memset(cm, MTI_Q4_ZERO, len);
    } else {
#pragma omp simd
        for (size_t j = 0; j < len; j++) cm[j] = (uint8_t)q4_code(mid_m, m[j] / am);
    }
    /* a scale of 0 has v = 0 there: 0 / 0 is NaN, below every midpoint, code 0 */
#pragma omp simd
    for (size_t j = 0; j < len; j++) cv[j] = (uint8_t)q4_code(mid_v, v[j] / sn[j]);
    cm[len] = MTI_Q4_ZERO, cv[len] = 0; /* an odd tensor's pads: the fresh state's codes */
    uint8_t *om = st->qm + (i0 >> 1), *ov = st->qv + (i0 >> 1);
    for (size_t j = 0; j < len; j += 2) {
        om[j >> 1] = (uint8_t)(cm[j] | cm[j + 1] << 4);
        ov[j >> 1] = (uint8_t)(cv[j] | cv[j + 1] << 4);
    }
}

/* Pass 1 of a matrix: the maxima of the new v over rows [r0, r1), the
 * columns' into colmax (cols floats, max-accumulated). */
MTI_VEC_VOID(rank1_maxima, (const q4_consts *c, const float *g, const mti_adamw4_state *st,
                            int64_t r0, int64_t r1, int64_t cols, const float *rowmax_old,
                            const float *colmax_old, float *rowmax, float *colmax),
             (c, g, st, r0, r1, cols, rowmax_old, colmax_old, rowmax, colmax))
{
    const float *code_v = c->code_v;
    const float gs = c->gs, b2 = c->b2, c2 = c->c2;
    for (int64_t r = r0; r < r1; r++) {
        const float ro = rowmax_old[r];
        const size_t i0 = (size_t)(r * cols);
        const float *gg = g + i0;
        /* a row may start on an odd element: read its codes by absolute index */
        const uint8_t *qv = st->qv;
        uint32_t rm = 0;
#pragma omp simd reduction(max : rm)
        for (int64_t col = 0; col < cols; col++) {
            const size_t i = i0 + (size_t)col;
            float gv = gg[col] * gs;
            uint32_t keep = finite_mask(gv);
            float co = colmax_old[col], so = ro < co ? ro : co;
            float vv = v_new(b2, c2, code_v[(qv[i >> 1] >> ((i & 1) << 2)) & 15u], so, gv, keep);
            uint32_t vb = bits_of(vv) & 0x7FFFFFFFu;
            vb = vb > 0x7F800000u ? 0u : vb; /* NaN left out, as fmaxf does */
            rm = vb > rm ? vb : rm;
            colmax[col] = vv > colmax[col] ? vv : colmax[col];
        }
        rowmax[r] = float_of(rm);
    }
}

mt_status mti_cpu_adamw4(const mti_kctx *k, float *p, const float *g, const mti_adamw4_state *st,
                         void *pc, mti_dtype pc_dt, int64_t rows, int64_t cols, int rank1,
                         const mti_adamw_args *a)
{
    const int T = mti_cpu_threads(k);
    const size_t work = rank1 && rows > 0 && cols > 0
                            ? ((size_t)rows + (size_t)T * (size_t)cols) * sizeof(float)
                            : 0;
    mt_status s0 = mti_cpu_adam_check(k, "adamw4", pc, pc_dt, a);
    if (s0) return s0;
    if (rows < 0 || cols < 0)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adamw4: shape %lld x %lld",
                        (long long)rows, (long long)cols);
    const size_t n = (size_t)rows * (size_t)cols;
    mt_block wb = {0};
    if (work) {
        mt_status s = mti_work_alloc(k, work, &wb);
        if (s) return s;
    }
    if (mti_dry(k) || n == 0) { /* an estimate takes the workspace and computes nothing */
        if (work) mti_work_free(k, &wb);
        return MT_OK;
    }
    if (!p || !g || !st || !st->qm || !st->qv || !st->absmax_m || !st->scale_v) {
        if (work) mti_work_free(k, &wb);
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adamw4: NULL %s",
                        !p ? "p" : !g ? "g" : !st ? "state" : "state tensor");
    }
    q4_consts c = {.b1 = a->beta1, .b2 = a->beta2, .c1 = 1.0f - a->beta1, .c2 = 1.0f - a->beta2,
                   .gs = a->grad_scale, .eps = a->eps,
                   .code_m = mti_q4_map(1), .code_v = mti_q4_map(0)};
    /* the scalars as torch makes them: in double, then rounded to fp32 */
    c.step_size = (float)((double)a->lr / (1.0 - pow((double)a->beta1, (double)a->step)));
    c.bc2_sqrt = (float)sqrt(1.0 - pow((double)a->beta2, (double)a->step));
    c.decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay);
    for (int j = 0; j < 15; j++) {
        c.mid_m[j] = (c.code_m[j] + c.code_m[j + 1]) * 0.5f;
        c.mid_v[j] = (c.code_v[j] + c.code_v[j + 1]) * 0.5f;
    }
    q4_view w = {.rank1 = rank1, .cols = cols > 0 ? cols : 1};
    float *rowmax_new = NULL, *colmax_new = NULL;
    if (rank1) {
        rowmax_new = wb.ptr;
        float *colpart = rowmax_new + rows; /* (T, cols) */
        memset(colpart, 0, (size_t)T * (size_t)cols * sizeof(float));
        w.rowmax_old = st->scale_v, w.colmax_old = st->scale_v + rows;
#pragma omp parallel num_threads(T) if (n > MTI_CPU_PAR_MIN)
        {
#ifdef _OPENMP
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
            const int t = 0, nt = 1;
#endif
            int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
            rank1_maxima(&c, g, st, r0, r1, cols, w.rowmax_old, w.colmax_old, rowmax_new,
                         colpart + (size_t)t * (size_t)cols);
        }
        colmax_new = colpart; /* thread 0's row takes the others' maxima (exact: any order) */
        for (int t = 1; t < T; t++)
            for (int64_t col = 0; col < cols; col++)
                colmax_new[col] = fmaxf(colmax_new[col], colpart[(size_t)t * (size_t)cols + col]);
        w.rowmax_new = rowmax_new, w.colmax_new = colmax_new;
    }
    const size_t blocks = (n + BLK - 1) / BLK;
#pragma omp parallel for schedule(static) num_threads(T) if (n > MTI_CPU_PAR_MIN)
    for (size_t b = 0; b < blocks; b++) {
        const size_t i0 = b * BLK, len = n - i0 < BLK ? n - i0 : BLK;
        q4_block(&c, &w, p, g, st, i0, len);
        if (pc) mti_cpu_store_f32(pc, pc_dt, i0, p + i0, len);
    }
    if (rank1) {
        memcpy(st->scale_v, rowmax_new, (size_t)rows * sizeof(float));
        memcpy(st->scale_v + rows, colmax_new, (size_t)cols * sizeof(float));
    }
    if (work) mti_work_free(k, &wb);
    return MT_OK;
}
