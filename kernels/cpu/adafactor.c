/*
 * adafactor.c - Adafactor as HuggingFace transformers' Adafactor (the
 * contract is in lib/ops/kernels.h), on fp32 masters p (rows, cols) and fp32
 * gradients g.
 *
 * No temporaries: the update of an element is a function of its gradient,
 * the new second-moment state and a few scalars, so it is recomputed in
 * each pass instead of stored. The passes:
 *   1. RMS(p), before the update (mti_cpu_sumsq's fixed order);
 *   2. the second moment: factored, the row means (one row per work item)
 *      and the column means (strips of STRIP columns walked down all rows),
 *      then the mean of the row state; else v itself, fused with pass 3;
 *   3. RMS(update), summed per tile of TILE_ROWS x TILE_COLS (per chunk of
 *      CHUNK elements unfactored), the tile sums added in a fixed tree per
 *      round of ROUND tiles, the rounds in order;
 *   4. the step: update clipped and scaled, first moment, weight decay, p,
 *      and the compute copy.
 * Every sum runs in an order fixed by the shape alone, so the result does
 * not depend on the thread count. Within a tile the column factors
 * rsqrt(col) are made once into a stack array, and a row's updates wait in
 * another (1 KiB each) between the two halves of the step; nothing is held
 * across tiles.
 *
 * Operations follow transformers' order (torch, fp32): u = g^2 + eps1;
 * row = beta2t row + (1 - beta2t) (sum of u over the row / cols), col
 * likewise over the column; update = (rsqrt(row / mean(row)) rsqrt(col)) g,
 * or rsqrt(v) g; update / max(RMS(update) / clip, 1) * lr_t; rsqrt(x) is
 * 1 / sqrt(x), two roundings, as torch's CPU kernels make it. torch sums in
 * another order and fuses some multiply-adds, so results agree with it to
 * rounding, not to the bit (test/golden/adafactor.gv).
 */
#include <math.h>
#include <string.h>

#include "cpu_ops.h"
#include "vecmath.h"

#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

#define LANES 16      /* partial sums of a contiguous run */
#define TILE_ROWS 64  /* tile of the RMS and update passes (factored) */
#define TILE_COLS 256
#define STRIP 32      /* columns per work item of the column means */
#define ROW_BLOCK 256 /* rows summed per column before adding to its total */
#define CHUNK 4096    /* elements per work item (unfactored) */
#define ROUND 1024    /* partial sums per parallel round (4 KiB on the stack) */

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* What every pass reads. */
typedef struct af_ctx {
    float *p, *row, *col, *v, *m;
    const float *g;
    void *pc;
    mti_dtype pc_dt;
    size_t rows, cols, n;
    size_t row_tiles, col_tiles; /* tiles down and across (factored) */
    float gs, eps1, b2t, c2t;    /* grad_scale, eps1, beta2t, 1 - beta2t */
    int threads;                 /* the context's CPU threads */
    float mean_row;              /* mean of the new row state (factored) */
    float den, lr;               /* max(RMS(update) / clip, 1), lr_t */
    float b1, c1, wdl;           /* beta1 (0: none), 1 - beta1, -wd lr_t */
    int wd;                      /* weight decay is on (wd != 0) */
} af_ctx;

/* Adds the LANES partial sums in a fixed tree. */
static inline float lanes_total(float *acc)
{
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* sum of x (n), in LANES partial sums */
MTI_VEC_FN(float, plain_sum, (const float *x, size_t n),
           (x, n))
{
    float acc[LANES];
    memset(acc, 0, sizeof acc);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) acc[l] += x[j + l];
    for (int l = 0; j + (size_t)l < n; l++) acc[l] += x[j + l];
    return lanes_total(acc);
}

/* sum of u = (g gs)^2 + eps1 over n gradients, in LANES partial sums */
MTI_VEC_FN(float, u_sum, (const float *g, size_t n, float gs, float eps1),
           (g, n, gs, eps1))
{
    float acc[LANES];
    memset(acc, 0, sizeof acc);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) {
            float gv = g[j + l] * gs;
            acc[l] += gv * gv + eps1;
        }
    for (int l = 0; j + (size_t)l < n; l++) {
        float gv = g[j + l] * gs;
        acc[l] += gv * gv + eps1;
    }
    return lanes_total(acc);
}

/* ---- sums of per-item partials, in a fixed order ---- */

typedef float (*part_fn)(const af_ctx *c, size_t item);

/* The sum over items of f(c, item): ROUND items at a time in parallel,
 * each round's partials added pairwise in a fixed tree, rounds in order. */
static float ordered_sum(const af_ctx *c, size_t items, part_fn f, size_t work)
{
    float total = 0.0f;
    for (size_t i0 = 0; i0 < items; i0 += ROUND) {
        float part[ROUND];
        size_t nb = min_sz(ROUND, items - i0);
#pragma omp parallel for schedule(static) num_threads(c->threads) \
    if (work > MTI_CPU_PAR_MIN && nb > 1)
        for (size_t b = 0; b < nb; b++) part[b] = f(c, i0 + b);
        for (size_t w = 1; w < nb; w *= 2)
            for (size_t i = 0; i + w < nb; i += 2 * w) part[i] += part[i + w];
        total += part[0];
    }
    return total;
}

/* item: the sum of CHUNK entries of the row state */
static float row_state_part(const af_ctx *c, size_t item)
{
    size_t i = item * CHUNK;
    return plain_sum(c->row + i, min_sz(CHUNK, c->rows - i));
}

/* ---- factored second moment ---- */

/* row[r] = b2t row[r] + c2t mean over the row of u, for every row */
static void row_means(const af_ctx *c)
{
    const float cols_f = (float)c->cols;
#pragma omp parallel for schedule(static) num_threads(c->threads) if (c->n > MTI_CPU_PAR_MIN)
    for (size_t r = 0; r < c->rows; r++) {
        float mean = u_sum(c->g + r * c->cols, c->cols, c->gs, c->eps1) / cols_f;
        c->row[r] = c->b2t * c->row[r] + c->c2t * mean;
    }
}

/* col[c0 .. c0+w) = b2t col + c2t mean down the column of u: each column
 * summed in row order, ROW_BLOCK rows at a time, the blocks in order. */
MTI_VEC_VOID(col_strip, (const af_ctx *c, size_t c0, size_t w),
             (c, c0, w))
{
    float total[STRIP], blk[STRIP];
    memset(total, 0, sizeof total);
    const float gs = c->gs, eps1 = c->eps1;
    for (size_t r0 = 0; r0 < c->rows; r0 += ROW_BLOCK) {
        memset(blk, 0, sizeof blk);
        size_t r1 = min_sz(c->rows, r0 + ROW_BLOCK);
        for (size_t r = r0; r < r1; r++) {
            const float *gr = c->g + r * c->cols + c0;
#pragma omp simd
            for (size_t j = 0; j < w; j++) {
                float gv = gr[j] * gs;
                blk[j] += gv * gv + eps1;
            }
        }
#pragma omp simd
        for (size_t j = 0; j < w; j++) total[j] += blk[j];
    }
    const float rows_f = (float)c->rows;
    for (size_t j = 0; j < w; j++)
        c->col[c0 + j] = c->b2t * c->col[c0 + j] + c->c2t * (total[j] / rows_f);
}

static void col_means(const af_ctx *c)
{
    size_t strips = (c->cols + STRIP - 1) / STRIP;
#pragma omp parallel for schedule(static) num_threads(c->threads) if (c->n > MTI_CPU_PAR_MIN)
    for (size_t s = 0; s < strips; s++)
        col_strip(c, s * STRIP, min_sz(STRIP, c->cols - s * STRIP));
}

/* ---- factored update, per tile ---- */

/* The tile's column factors rsqrt(col) into cf; returns the tile's first
 * row, and its size in *h, *w. */
static size_t tile_setup(const af_ctx *c, size_t item, float *cf, size_t *c0, size_t *h,
                         size_t *w)
{
    size_t tr = item / c->col_tiles, tc = item % c->col_tiles;
    size_t r0 = tr * TILE_ROWS;
    *c0 = tc * TILE_COLS;
    *h = min_sz(TILE_ROWS, c->rows - r0);
    *w = min_sz(TILE_COLS, c->cols - *c0);
    for (size_t j = 0; j < *w; j++) cf[j] = 1.0f / sqrtf(c->col[*c0 + j]);
    return r0;
}

/* item: the sum of update^2 over one tile; each column accumulates down
 * the tile's rows, then the columns in a fixed tree */
MTI_VEC_FN(float, tile_sumsq, (const af_ctx *c, size_t item),
           (c, item))
{
    float cf[TILE_COLS], acc[TILE_COLS];
    size_t c0, h, w;
    size_t r0 = tile_setup(c, item, cf, &c0, &h, &w);
    memset(acc, 0, sizeof acc);
    const float gs = c->gs;
    for (size_t r = r0; r < r0 + h; r++) {
        const float rf = 1.0f / sqrtf(c->row[r] / c->mean_row);
        const float *gr = c->g + r * c->cols + c0;
#pragma omp simd
        for (size_t j = 0; j < w; j++) {
            float u = rf * cf[j] * (gr[j] * gs);
            acc[j] += u * u;
        }
    }
    for (size_t s = TILE_COLS / 2; s > 0; s /= 2)
        for (size_t j = 0; j < s; j++) acc[j] += acc[j + s];
    return acc[0];
}

/* The step's scalars, copied into locals so the loops keep them in
 * registers. */
typedef struct af_step {
    float den, lr, b1, c1, wdl;
    int wd;
} af_step;

static inline af_step step_of(const af_ctx *c)
{
    return (af_step){c->den, c->lr, c->b1, c->c1, c->wdl, c->wd};
}

/* p (w) stepped by the unclipped updates u (w); with m the first moment
 * (w) too. Inlined once per case, so each loop is free of selects. */
static inline __attribute__((always_inline)) void
step_loop(float *p, float *m, const float *u, size_t w, af_step s, const int has_m, const int wd)
{
#pragma omp simd
    for (size_t j = 0; j < w; j++) {
        float d = u[j] / s.den * s.lr, x = p[j];
        if (has_m) {
            d = s.b1 * m[j] + s.c1 * d;
            m[j] = d;
        }
        if (wd) x = x + s.wdl * x;
        p[j] = x - d;
    }
}

static inline __attribute__((always_inline)) void step_run(float *p, float *m, const float *u,
                                                           size_t w, af_step s)
{
    if (m) {
        if (s.wd) step_loop(p, m, u, w, s, 1, 1);
        else step_loop(p, m, u, w, s, 1, 0);
    } else {
        if (s.wd) step_loop(p, NULL, u, w, s, 0, 1);
        else step_loop(p, NULL, u, w, s, 0, 0);
    }
}

MTI_VEC_VOID(tile_apply, (const af_ctx *c, size_t item),
             (c, item))
{
    float cf[TILE_COLS], u[TILE_COLS];
    size_t c0, h, w;
    size_t r0 = tile_setup(c, item, cf, &c0, &h, &w);
    const float gs = c->gs;
    const af_step s = step_of(c);
    for (size_t r = r0; r < r0 + h; r++) {
        const float rf = 1.0f / sqrtf(c->row[r] / c->mean_row);
        size_t i = r * c->cols + c0;
        const float *gr = c->g + i;
#pragma omp simd
        for (size_t j = 0; j < w; j++) u[j] = rf * cf[j] * (gr[j] * gs);
        step_run(c->p + i, c->m ? c->m + i : NULL, u, w, s);
        if (c->pc) mti_cpu_store_f32(c->pc, c->pc_dt, i, c->p + i, w);
    }
}

/* ---- unfactored, per chunk ---- */

/* item: v = b2t v + c2t u over the chunk, and the sum of (rsqrt(v) g)^2 */
MTI_VEC_FN(float, chunk_v_sumsq, (const af_ctx *c, size_t item),
           (c, item))
{
    size_t i = item * CHUNK, n = min_sz(CHUNK, c->n - i);
    const float *g = c->g + i;
    float *v = c->v + i;
    const float gs = c->gs, eps1 = c->eps1, b2t = c->b2t, c2t = c->c2t;
    float acc[LANES];
    memset(acc, 0, sizeof acc);
    size_t j = 0;
    for (; j + LANES <= n; j += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) {
            float gv = g[j + l] * gs;
            float vv = b2t * v[j + l] + c2t * (gv * gv + eps1);
            v[j + l] = vv;
            float u = 1.0f / sqrtf(vv) * gv;
            acc[l] += u * u;
        }
    for (int l = 0; j + (size_t)l < n; l++) {
        float gv = g[j + l] * gs;
        float vv = b2t * v[j + l] + c2t * (gv * gv + eps1);
        v[j + l] = vv;
        float u = 1.0f / sqrtf(vv) * gv;
        acc[l] += u * u;
    }
    return lanes_total(acc);
}

MTI_VEC_VOID(chunk_apply, (const af_ctx *c, size_t item),
             (c, item))
{
    float u[TILE_COLS];
    const float gs = c->gs;
    const af_step s = step_of(c);
    size_t end = min_sz(c->n, (item + 1) * CHUNK);
    for (size_t i = item * CHUNK; i < end; i += TILE_COLS) {
        size_t w = min_sz(TILE_COLS, end - i);
        const float *g = c->g + i, *v = c->v + i;
#pragma omp simd
        for (size_t j = 0; j < w; j++) u[j] = 1.0f / sqrtf(v[j]) * (g[j] * gs);
        step_run(c->p + i, c->m ? c->m + i : NULL, u, w, s);
        if (c->pc) mti_cpu_store_f32(c->pc, c->pc_dt, i, c->p + i, w);
    }
}

/* ---- the op ---- */

static mt_status check_args(const mti_kctx *k, const float *p, const float *g, const float *row,
                            const float *col, const float *v, const float *m, const void *pc,
                            mti_dtype pc_dt, int64_t rows, int64_t cols, int factored,
                            const mti_adafactor_args *a)
{
    if (!a) return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adafactor: no arguments");
    if (a->step < 1)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adafactor: step %lld (steps count from 1)",
                        (long long)a->step);
    const char *why = NULL;
    if (rows < 0 || cols < 0) why = "a negative size";
    else if (cols > 0 && (uint64_t)rows > SIZE_MAX / sizeof(float) / (uint64_t)cols)
        why = "too many elements";
    else if (pc && pc_dt != MTI_F32 && pc_dt != MTI_F16 && pc_dt != MTI_BF16)
        why = "a compute dtype that is not a float";
    else if (!(a->clip_threshold > 0.0f)) why = "clip_threshold not > 0";
    else if (a->warmup_init && !a->relative_step) why = "warmup_init without relative_step";
    else if (rows > 0 && cols > 0) {
        if (!p || !g) why = !p ? "NULL p" : "NULL g";
        else if (factored && (!row || !col)) why = "factored without row and col";
        else if (!factored && !v) why = "unfactored without v";
        else if (a->beta1 > 0.0f && !m) why = "beta1 > 0 without m";
    }
    if (!why) return MT_OK;
    return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "adafactor: %s (rows %lld, cols %lld)", why,
                    (long long)rows, (long long)cols);
}

mt_status mti_cpu_adafactor(const mti_kctx *k, float *p, const float *g, float *row, float *col,
                            float *v, float *m, void *pc, mti_dtype pc_dt, int64_t rows,
                            int64_t cols, int factored, const mti_adafactor_args *a)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    mt_status st = check_args(k, p, g, row, col, v, m, pc, pc_dt, rows, cols, factored, a);
    if (st != MT_OK || rows == 0 || cols == 0) return st;
    af_ctx c = {.p = p, .g = g, .row = row, .col = col, .v = v, .pc = pc, .pc_dt = pc_dt,
                .m = a->beta1 > 0.0f ? m : NULL, .rows = (size_t)rows, .cols = (size_t)cols,
                .gs = a->grad_scale, .eps1 = a->eps1, .threads = mti_cpu_threads(k)};
    c.n = c.rows * c.cols;
    const float sqrt_n = (float)sqrt((double)c.n);

    /* 1. RMS(p), and the step size lr_t as transformers makes it: in double,
     * times the fp32 RMS when that is the larger scale */
    float sumsq_p = 0.0f;
    if ((st = mti_cpu_sumsq(k, &sumsq_p, p, c.n)) != MT_OK) return st;
    float rms_p = sqrtf(sumsq_p) / sqrt_n;
    double t = (double)a->step, rel = a->lr;
    if (a->relative_step) rel = fmin(a->warmup_init ? 1e-6 * t : 1e-2, 1.0 / sqrt(t));
    c.lr = (float)rel;
    if (a->scale_parameter) c.lr = rms_p > a->eps2 ? rms_p * (float)rel : (float)(a->eps2 * rel);
    double beta2t = 1.0 - pow(t, (double)a->decay_rate);
    c.b2t = (float)beta2t;
    c.c2t = (float)(1.0 - beta2t);
    c.b1 = a->beta1 > 0.0f ? a->beta1 : 0.0f;
    c.c1 = 1.0f - c.b1;
    c.wdl = -a->weight_decay * c.lr;
    c.wd = a->weight_decay != 0.0f;

    /* 2 and 3. the second moment, and the sum of squares of the update */
    float sumsq_u;
    if (factored) {
        row_means(&c);
        col_means(&c);
        c.mean_row = ordered_sum(&c, (c.rows + CHUNK - 1) / CHUNK, row_state_part, c.rows) /
                     (float)c.rows;
        c.row_tiles = (c.rows + TILE_ROWS - 1) / TILE_ROWS;
        c.col_tiles = (c.cols + TILE_COLS - 1) / TILE_COLS;
        sumsq_u = ordered_sum(&c, c.row_tiles * c.col_tiles, tile_sumsq, c.n);
    } else {
        sumsq_u = ordered_sum(&c, (c.n + CHUNK - 1) / CHUNK, chunk_v_sumsq, c.n);
    }
    float clip = sqrtf(sumsq_u) / sqrt_n / a->clip_threshold;
    c.den = clip < 1.0f ? 1.0f : clip; /* NaN stays NaN, as torch's clamp */

    /* 4. the step */
    if (factored) {
        size_t tiles = c.row_tiles * c.col_tiles;
#pragma omp parallel for schedule(static) num_threads(c.threads) if (c.n > MTI_CPU_PAR_MIN)
        for (size_t it = 0; it < tiles; it++) tile_apply(&c, it);
    } else {
        size_t chunks = (c.n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(c.threads) if (c.n > MTI_CPU_PAR_MIN)
        for (size_t it = 0; it < chunks; it++) chunk_apply(&c, it);
    }
    return MT_OK;
}
