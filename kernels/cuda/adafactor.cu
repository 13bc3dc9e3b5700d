/*
 * adafactor.cu - Adafactor (transformers' Adafactor; the contract is in
 * lib/ops/kernels.h, the CPU version in kernels/cpu/adafactor.c).
 *
 * The step is a short queue of kernels, none of which stores an update:
 *   mt_af_partials   RMS(p): per-block partial sums of p^2;
 *   mt_af_finish     adds the partials (one block) and makes a scalar;
 *   mt_af_rows       factored: row = b2t row + c2t mean(u) over each row;
 *   mt_af_cols       factored: the same down each column;
 *   mt_af_partials   the sum of the new row state, mt_af_finish its mean;
 *   mt_af_upd        partial sums of update^2 (unfactored: v updated too);
 *   mt_af_finish     the clip divisor max(RMS(update) / clip, 1);
 *   mt_af_apply      the step: update, first moment, weight decay, p, pc.
 * The scalars (lr_t, -wd lr_t, mean(row), the divisor) live in a few
 * floats of workspace next to at most MT_AF_PARTS partial sums: 4 KiB,
 * whatever the shape.
 *
 * Sums run in an order fixed by the shapes (grid sizes are functions of
 * the shape), so a step gives the same bits on every run; they are not the
 * CPU's order, so the two tables agree within fp32 rounding. Elementwise
 * arithmetic is explicitly rounded in the CPU's order.
 */

#define MT_AF_PARTS 1024 /* most partial sums, and blocks of the partial kernels */
#define MT_AF_SEG 1024   /* columns (elements unfactored) per work item: 4 per thread */

/* scalar slots after the partial sums */
enum { MT_AF_LR = 0, MT_AF_WDL = 1, MT_AF_MEAN_ROW = 2, MT_AF_DEN = 3 };

/* part[blockIdx.x] = sum over this block's grid-stride share of x^2 (or
 * x). grid <= MT_AF_PARTS, block 256. */
extern "C" __global__ void __launch_bounds__(256)
    mt_af_partials(float *part, const float *x, mt_index n, int square)
{
    __shared__ float sh[32];
    float acc = 0.0f;
    MT_FOR_EACH(i, n)
    {
        float v = x[i];
        acc = __fadd_rn(acc, square ? __fmul_rn(v, v) : v);
    }
    acc = mt_block_sum(acc, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* Adds nparts partial sums (block 1024, one block) into s and makes:
 *   which 0: lr_t from RMS(p) = sqrt(s) / sqrt_n: rms > eps2 ? rms rel :
 *            eps2_rel when scale_parameter, else rel; and -wd lr_t;
 *   which 1: mean(row) = s / count;
 *   which 2: the divisor max(sqrt(s) / sqrt_n / clip, 1) (NaN kept). */
extern "C" __global__ void __launch_bounds__(1024)
    mt_af_finish(float *scal, const float *part, int nparts, int which, float sqrt_n, float count,
                 float rel, float eps2, float eps2_rel, int scale_parameter, float neg_wd,
                 float clip)
{
    __shared__ float sh[32];
    float v = (int)threadIdx.x < nparts ? part[threadIdx.x] : 0.0f;
    float s = mt_block_sum(v, sh);
    if (threadIdx.x != 0) return;
    if (which == 0) {
        float rms = __fdiv_rn(__fsqrt_rn(s), sqrt_n);
        float lr = scale_parameter ? (rms > eps2 ? __fmul_rn(rms, rel) : eps2_rel) : rel;
        scal[MT_AF_LR] = lr;
        scal[MT_AF_WDL] = __fmul_rn(neg_wd, lr);
    } else if (which == 1) {
        scal[MT_AF_MEAN_ROW] = __fdiv_rn(s, count);
    } else {
        float c = __fdiv_rn(__fdiv_rn(__fsqrt_rn(s), sqrt_n), clip);
        scal[MT_AF_DEN] = c < 1.0f ? 1.0f : c;
    }
}

__device__ __forceinline__ float mt_af_u(float g, float gs, float eps1)
{
    float gv = __fmul_rn(g, gs);
    return __fadd_rn(__fmul_rn(gv, gv), eps1);
}

/* row[r] = b2t row[r] + c2t (sum over the row of u) / cols, one block of
 * 256 per row (grid-stride over rows). g (rows, cols). */
extern "C" __global__ void __launch_bounds__(256)
    mt_af_rows(float *row, const float *g, mt_index rows, mt_index cols, float gs, float eps1,
               float b2t, float c2t)
{
    __shared__ float sh[32];
    const float cols_f = (float)cols;
    for (mt_index r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *gr = g + r * cols;
        float acc = 0.0f;
        for (mt_index j = threadIdx.x; j < cols; j += blockDim.x)
            acc = __fadd_rn(acc, mt_af_u(gr[j], gs, eps1));
        acc = mt_block_sum(acc, sh);
        if (threadIdx.x == 0)
            row[r] = __fadd_rn(__fmul_rn(b2t, row[r]), __fmul_rn(c2t, __fdiv_rn(acc, cols_f)));
    }
}

/* col[c] = b2t col[c] + c2t (sum down the column of u) / rows: a block
 * takes 32 columns; its 8 warps take every 8th row each (a warp reads 32
 * neighbouring columns of a row), then the 8 partial sums are added in
 * order. Block 256. */
extern "C" __global__ void __launch_bounds__(256)
    mt_af_cols(float *col, const float *g, mt_index rows, mt_index cols, float gs, float eps1,
               float b2t, float c2t)
{
    __shared__ float part[8][32];
    const unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const float rows_f = (float)rows;
    for (mt_index c0 = (mt_index)blockIdx.x * 32; c0 < cols; c0 += (mt_index)gridDim.x * 32) {
        const mt_index c = c0 + lane;
        float acc = 0.0f;
        if (c < cols)
            for (mt_index r = w; r < rows; r += 8)
                acc = __fadd_rn(acc, mt_af_u(g[r * cols + c], gs, eps1));
        part[w][lane] = acc;
        __syncthreads();
        if (w == 0 && c < cols) {
            float s = part[0][lane];
#pragma unroll
            for (int k = 1; k < 8; k++) s = __fadd_rn(s, part[k][lane]);
            col[c] = __fadd_rn(__fmul_rn(b2t, col[c]), __fmul_rn(c2t, __fdiv_rn(s, rows_f)));
        }
        __syncthreads();
    }
}

/* A work item of the update kernels: factored, a row's segment of up to
 * MT_AF_SEG columns; unfactored (one row of all elements), a segment of
 * the flat tensor. Numbered row by row, segments within a row. */
struct mt_af_item {
    mt_index base; /* first element */
    mt_index len;  /* elements */
    float rf;      /* the row factor rsqrt(row / mean(row)); 1 unfactored */
    mt_index c0;   /* first column */
};

__device__ __forceinline__ mt_af_item mt_af_item_of(mt_index it, mt_index cols, mt_index segs,
                                                    const float *row, float mean_row)
{
    mt_af_item m;
    mt_index r = it / segs, s = it % segs;
    m.c0 = s * MT_AF_SEG;
    m.base = r * cols + m.c0;
    m.len = cols - m.c0 < MT_AF_SEG ? cols - m.c0 : MT_AF_SEG;
    m.rf = row ? __frcp_rn(__fsqrt_rn(__fdiv_rn(row[r], mean_row))) : 1.0f;
    return m;
}

/* part[blockIdx.x] = this block's share of the sum of update^2. Factored
 * (row, col non-NULL): update = (rf rsqrt(col)) g; else v = b2t v + c2t u
 * is stored and update = rsqrt(v) g. grid <= MT_AF_PARTS, block 256. */
extern "C" __global__ void __launch_bounds__(256)
    mt_af_upd(float *part, const float *scal, const float *g, const float *row, const float *col,
              float *v, mt_index rows, mt_index cols, float gs, float eps1, float b2t, float c2t)
{
    __shared__ float sh[32];
    const mt_index segs = (cols + MT_AF_SEG - 1) / MT_AF_SEG, items = rows * segs;
    const float mean_row = row ? scal[MT_AF_MEAN_ROW] : 1.0f;
    float acc = 0.0f;
    for (mt_index it = blockIdx.x; it < items; it += gridDim.x) {
        mt_af_item m = mt_af_item_of(it, cols, segs, row, mean_row);
        for (mt_index j = threadIdx.x; j < m.len; j += blockDim.x) {
            const mt_index i = m.base + j;
            float gv = __fmul_rn(g[i], gs), u;
            if (row) {
                u = __fmul_rn(__fmul_rn(m.rf, __frcp_rn(__fsqrt_rn(col[m.c0 + j]))), gv);
            } else {
                float vv = __fadd_rn(__fmul_rn(b2t, v[i]), __fmul_rn(c2t, mt_af_u(g[i], gs, eps1)));
                v[i] = vv;
                u = __fmul_rn(__frcp_rn(__fsqrt_rn(vv)), gv);
            }
            acc = __fadd_rn(acc, __fmul_rn(u, u));
        }
    }
    acc = mt_block_sum(acc, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* The step of every element: d = update / den * lr_t; with m,
 * d = b1 m + c1 d (stored); p = (wd ? p + wdl p : p) - d; pc refreshed.
 * Factored (row, col) or not (v), as mt_af_upd. Block 256. */
extern "C" __global__ void __launch_bounds__(256)
    mt_af_apply(float *p, float *m, void *pc, int pc_dt, const float *scal, const float *g,
                const float *row, const float *col, const float *v, mt_index rows, mt_index cols,
                float gs, float b1, float c1, int wd)
{
    const mt_index segs = (cols + MT_AF_SEG - 1) / MT_AF_SEG, items = rows * segs;
    const float mean_row = row ? scal[MT_AF_MEAN_ROW] : 1.0f;
    const float lr = scal[MT_AF_LR], wdl = scal[MT_AF_WDL], den = scal[MT_AF_DEN];
    for (mt_index it = blockIdx.x; it < items; it += gridDim.x) {
        mt_af_item s = mt_af_item_of(it, cols, segs, row, mean_row);
        for (mt_index j = threadIdx.x; j < s.len; j += blockDim.x) {
            const mt_index i = s.base + j;
            float gv = __fmul_rn(g[i], gs);
            float u = row ? __fmul_rn(__fmul_rn(s.rf, __frcp_rn(__fsqrt_rn(col[s.c0 + j]))), gv)
                          : __fmul_rn(__frcp_rn(__fsqrt_rn(v[i])), gv);
            float d = __fmul_rn(__fdiv_rn(u, den), lr);
            if (m) {
                d = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(c1, d));
                m[i] = d;
            }
            float x = p[i];
            if (wd) x = __fadd_rn(x, __fmul_rn(wdl, x));
            x = __fsub_rn(x, d);
            p[i] = x;
            if (pc) store_copy(pc, pc_dt, i, x);
        }
    }
}
