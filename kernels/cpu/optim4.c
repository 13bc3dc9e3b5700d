/*
 * optim4.c - 4-bit AdamW (Li, Chen, Zhu 2023; the contract is in
 * lib/kernels.h, the adamw4 op). The moments live as 4-bit codes, two to a
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

static inline unsigned nib(const uint8_t *q, size_t i)
{
    return i & 1 ? q[i >> 1] >> 4 : q[i >> 1] & 15u;
}

/* The nearest level: the count of midpoints strictly below x. */
static inline unsigned q4_code(const float *mid, float x)
{
    unsigned r = 0;
    for (int k = 0; k < 15; k++) r += x > mid[k];
    return r;
}

/* g scaled, or 0 with keep = 0 where it is not finite. */
static inline float grad_of(const float *g, size_t i, float gs, int *keep)
{
    float gv = g[i] * gs;
    *keep = isfinite(gv);
    return gv;
}

/* The new v of element i from its code, its old scale and g. */
static inline float v_new(const q4_consts *c, unsigned code, float scale, float gv, int keep)
{
    float vv = c->b2 * (c->code_v[code] * scale) + c->c2 * gv * gv;
    return keep ? vv : 0.0f;
}

/* The old rank-1 scale of element (r, col) (state as it was). */
static inline float rank1_scale(const float *rowmax, const float *colmax, int64_t r, int64_t col)
{
    float a = rowmax[r], b = colmax[col];
    return a < b ? a : b;
}

/* One block [i0, i0 + len) (len <= BLK, i0 a multiple of BLK): updates m
 * and p, codes m; v: the old scale of each element comes from old_scale(),
 * the new one from new_scale(); v codes written. For a blockwise v,
 * new_v_block is NULL and the block's new absmax is computed here into
 * *vblock_out. */
typedef struct q4_view {
    const float *rowmax_old, *colmax_old; /* rank-1: the state's scales */
    const float *rowmax_new, *colmax_new; /* rank-1: this step's */
    int64_t cols;
    int rank1;
} q4_view;

static void q4_block(const q4_consts *c, const q4_view *w, float *p, const float *g,
                     const mti_adamw4_state *st, size_t i0, size_t len)
{
    float m[BLK], v[BLK];
    int keep[BLK];
    const size_t b = i0 / BLK;
    const float am_old = st->absmax_m[b];
    const float sv_old = w->rank1 ? 0.0f : st->scale_v[b];
    for (size_t j = 0; j < len; j++) {
        const size_t i = i0 + j;
        float gv = grad_of(g, i, c->gs, &keep[j]);
        float scale = w->rank1 ? rank1_scale(w->rowmax_old, w->colmax_old, (int64_t)i / w->cols,
                                             (int64_t)i % w->cols)
                               : sv_old;
        float mv = c->b1 * (c->code_m[nib(st->qm, i)] * am_old) + c->c1 * gv;
        m[j] = keep[j] ? mv : 0.0f;
        v[j] = v_new(c, nib(st->qv, i), scale, gv, keep[j]);
        if (keep[j]) {
            float denom = sqrtf(v[j]) / c->bc2_sqrt + c->eps;
            p[i] = p[i] * c->decay - c->step_size * (m[j] / denom);
        }
    }
    /* the new scales */
    float am = 0.0f, avb = 0.0f;
    for (size_t j = 0; j < len; j++) am = fmaxf(am, fabsf(m[j]));
    if (!w->rank1)
        for (size_t j = 0; j < len; j++) avb = fmaxf(avb, v[j]);
    st->absmax_m[b] = am;
    if (!w->rank1) st->scale_v[b] = avb;
    /* codes, two to a byte (len is even but for a tensor's odd last block) */
    for (size_t j = 0; j < len; j += 2) {
        unsigned cm[2] = {MTI_Q4_ZERO, MTI_Q4_ZERO}, cv[2] = {0, 0}; /* the fill's pads */
        for (size_t h = 0; h < 2 && j + h < len; h++) {
            const size_t i = i0 + j + h;
            cm[h] = am == 0.0f ? MTI_Q4_ZERO : q4_code(c->mid_m, m[j + h] / am);
            float s = w->rank1 ? rank1_scale(w->rowmax_new, w->colmax_new, (int64_t)i / w->cols,
                                             (int64_t)i % w->cols)
                               : avb;
            cv[h] = s == 0.0f ? 0u : q4_code(c->mid_v, v[j + h] / s);
        }
        st->qm[(i0 + j) >> 1] = (uint8_t)(cm[0] | cm[1] << 4);
        st->qv[(i0 + j) >> 1] = (uint8_t)(cv[0] | cv[1] << 4);
    }
}

/* Pass 1 of a matrix: the maxima of the new v over rows [r0, r1), the
 * columns' into colmax (cols floats, max-accumulated). */
static void rank1_maxima(const q4_consts *c, const float *g, const mti_adamw4_state *st,
                         int64_t r0, int64_t r1, int64_t cols, const float *rowmax_old,
                         const float *colmax_old, float *rowmax, float *colmax)
{
    for (int64_t r = r0; r < r1; r++) {
        float rm = 0.0f;
        for (int64_t col = 0; col < cols; col++) {
            const size_t i = (size_t)(r * cols + col);
            int keep;
            float gv = grad_of(g, i, c->gs, &keep);
            float vv = v_new(c, nib(st->qv, i), rank1_scale(rowmax_old, colmax_old, r, col), gv,
                             keep);
            rm = fmaxf(rm, vv);
            colmax[col] = fmaxf(colmax[col], vv);
        }
        rowmax[r] = rm;
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
