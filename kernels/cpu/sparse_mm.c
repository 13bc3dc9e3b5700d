/*
 * sparse_mm.c - the GEMMs of a linear map whose weight W (out, in) is
 * pruned (lib/sparse/sparse.h), computed from its kept values alone, with
 * no dense tile of W.
 *
 * The kept values are stored in element order, which is row-major CSR's
 * order, so they are CSR's values as they stand. A call builds the index
 * from the mask in WORK: the column of each kept value and where each row
 * starts (4 bytes per kept value, 8 per row), and for the input gradient
 * the transpose (CSC: the row of each kept value and its value in fp32,
 * 8 bytes per kept value, 8 per column).
 *
 * The activations go SPMM_NB rows at a time (fewer when there are fewer,
 * rounded up to 16) through fp32 panels, transposed
 * so that the panel's row c holds column c of those rows (a lane per row):
 *   forward  yT[r] = sum over kept (r, i) of w * xT[i], plus the bias;
 *   dx       dxT[i] = sum over kept (r, i) of w * dyT[r] (the CSC's rows);
 *   dW       each kept (r, i): dyT[r] . xT[i], added over the panels;
 *   db       the sum of dyT[r]'s lanes, added over the panels.
 * Each is a row of a small product, so the threads take rows, and every
 * result is summed in an order the shapes and the mask fix: the bits do
 * not depend on the thread count (nor, as the vector loops do the same
 * operations per lane, on the vector level). Outputs are rounded to dt
 * once, after their sum (dx with MTI_BWD_ACC_DX: the old value plus it).
 *
 * The work is nnz * N multiply-adds where the dense GEMM does out * in * N,
 * at a lower rate (an axpy per kept value, not a blocked GEMM): it wins at
 * high sparsity. sparse_matmul_choice says where (SPMM_DENSITY, measured
 * in docs/benchmarks.md, "Sparse kernels against the dense tile").
 *
 * WORK: the index (above; and the kept values widened to fp32 for a 16-bit
 * dtype, 4 bytes each), the panels, (in + out) * min(N, SPMM_NB) floats
 * (N rounded up to 16), the bias in fp32, and per thread 2 KiB for the
 * transposes.
 */
#include <omp.h>
#include <string.h>

#include "arch.h"
#include "cpu_ops.h"

#define SPMM_NB 256    /* activation rows per panel (lanes) */
#define SPMM_LANES 64  /* lanes an accumulator pass holds */
#define SPMM_ROWS 16   /* output rows per task */
#define SPMM_COLS 256  /* columns per task of a panel's transpose */
/* The sparse GEMMs are expected faster than the dense tile where at most
 * this fraction of W is kept: fp32 (and 16-bit dtypes without their own
 * GEMM instructions, whose dense tile goes through fp32 panels), the
 * crossover measured between 15% and 20%; bf16 and fp16 on the CPU's own
 * instructions (AVX512-BF16, AMX: the dense tile twice as fast), between 5%
 * and 10%. */
#define SPMM_DENSITY 0.15
#define SPMM_DENSITY_16 0.07

static size_t round16(size_t n) { return (n + 15) & ~(size_t)15; }

/* ---- the vector loops ---- */

/* For rows r in [r0, r1) of a product: outT[r] = sum over e in [ptr[r],
 * ptr[r + 1]) of val[e] inT[idx[e]] (+ bias[r]), lanes lanes (a multiple
 * of 16; the panels' rows ld floats apart). */
MTI_VEC_VOID(spmm_rows,
             (float *outT, const float *inT, const size_t *ptr, const int32_t *idx,
              const float *val, size_t r0, size_t r1, size_t lanes, size_t ld, const float *bias),
             (outT, inT, ptr, idx, val, r0, r1, lanes, ld, bias))
{
    for (size_t r = r0; r < r1; r++) {
        float *o = outT + r * ld;
        const float b = bias ? bias[r] : 0.0f;
        size_t l0 = 0;
        for (; l0 + SPMM_LANES <= lanes; l0 += SPMM_LANES) {
            float acc[SPMM_LANES] = {0};
            for (size_t e = ptr[r]; e < ptr[r + 1]; e++) {
                const float w = val[e], *p = inT + (size_t)idx[e] * ld + l0;
                for (int l = 0; l < SPMM_LANES; l++) acc[l] += w * p[l];
            }
            for (int l = 0; l < SPMM_LANES; l++) o[l0 + l] = acc[l] + b;
        }
        for (; l0 < lanes; l0 += 16) {
            float acc[16] = {0};
            for (size_t e = ptr[r]; e < ptr[r + 1]; e++) {
                const float w = val[e], *p = inT + (size_t)idx[e] * ld + l0;
                for (int l = 0; l < 16; l++) acc[l] += w * p[l];
            }
            for (int l = 0; l < 16; l++) o[l0 + l] = acc[l] + b;
        }
    }
}

/* The sum of 16 partial sums, always in this order. */
static inline float sum16(float *a)
{
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++) a[l] += a[l + w];
    return a[0];
}

/* For rows r in [r0, r1) of W: the kept (r, idx[e])'s dW, dyT[r] .
 * xT[idx[e]] over lanes lanes, into dw[e] (with add: added to it); and
 * with db, db[r] (the same). */
MTI_VEC_VOID(sddmm_rows,
             (float *dw, float *db, const float *dyT, const float *xT, const size_t *ptr,
              const int32_t *idx, size_t r0, size_t r1, size_t lanes, size_t ld, int add),
             (dw, db, dyT, xT, ptr, idx, r0, r1, lanes, ld, add))
{
    for (size_t r = r0; r < r1; r++) {
        const float *p = dyT + r * ld;
        if (dw)
            for (size_t e = ptr[r]; e < ptr[r + 1]; e++) {
                const float *q = xT + (size_t)idx[e] * ld;
                float a[16] = {0};
                for (size_t j = 0; j < lanes; j += 16)
                    for (int l = 0; l < 16; l++) a[l] += p[j + (size_t)l] * q[j + (size_t)l];
                const float s = sum16(a);
                dw[e] = add ? dw[e] + s : s;
            }
        if (db) {
            float a[16] = {0};
            for (size_t j = 0; j < lanes; j += 16)
                for (int l = 0; l < 16; l++) a[l] += p[j + (size_t)l];
            const float s = sum16(a);
            db[r] = add ? db[r] + s : s;
        }
    }
}

/* ---- panels ---- */

/* Columns [c0, c1) of rows [n0, n0 + nb) of a (., cols) matrix in dt into
 * the panel (row c, ld floats long; lane j: element (n0 + j, c)), lanes
 * nb .. round16(nb) zero; tmp holds SPMM_COLS floats. */
static void panel_in(float *panel, size_t ld, const void *a, mti_dtype dt, size_t cols, size_t n0,
                     size_t nb, size_t c0, size_t c1, float *tmp)
{
    for (size_t j = 0; j < nb; j++) {
        mti_cpu_load_f32(tmp, a, dt, (n0 + j) * cols + c0, c1 - c0);
        for (size_t c = c0; c < c1; c++) panel[c * ld + j] = tmp[c - c0];
    }
    for (size_t c = c0; c < c1; c++)
        for (size_t j = nb; j < round16(nb); j++) panel[c * ld + j] = 0.0f;
}

/* The panel's lanes back into rows [n0, n0 + nb) of a (., cols) matrix in
 * dt, columns [c0, c1); with add, added to the values there. */
static void panel_out(void *a, mti_dtype dt, size_t cols, const float *panel, size_t ld, size_t n0,
                      size_t nb, size_t c0, size_t c1, int add, float *tmp, float *old)
{
    for (size_t j = 0; j < nb; j++) {
        const size_t at = (n0 + j) * cols + c0;
        for (size_t c = c0; c < c1; c++) tmp[c - c0] = panel[c * ld + j];
        if (add) {
            mti_cpu_load_f32(old, a, dt, at, c1 - c0);
            for (size_t c = 0; c < c1 - c0; c++) tmp[c] = old[c] + tmp[c];
        }
        mti_cpu_store_f32(a, dt, at, tmp, c1 - c0);
    }
}

/* ---- the index ---- */

typedef struct spmm_ix {
    size_t *ptr;   /* CSR: rows + 1 */
    int32_t *idx;  /* CSR: nnz columns */
    float *val;    /* nnz values in fp32 (the kept values themselves when fp32) */
    size_t *cptr;  /* CSC (dx): in + 1 */
    int32_t *crow; /* CSC: nnz rows */
    float *cval;   /* CSC: nnz values */
} spmm_ix;

/* The WORK of an op: the index (with csc, the transpose too), the panels
 * ((in + out) rows of ld lanes: the activations' rows up to SPMM_NB,
 * rounded up to 16), a fp32 bias, and per thread two rows of SPMM_COLS for
 * the transposes; its parts' places. */
typedef struct spmm_work {
    mt_block blk;
    spmm_ix ix;
    size_t ld;      /* lanes per panel row */
    float *xp, *yp; /* the panels: (in) and (out) rows of ld */
    float *bias;
    float *tmp;     /* per thread: 2 * SPMM_COLS */
} spmm_work;

static mt_status spmm_work_alloc(const mti_kctx *k, const mti_sp_layout *L, size_t n, size_t in,
                                 size_t out, mti_dtype dt, int csc, int bias, int nt, spmm_work *w)
{
    const size_t ld = n < SPMM_NB ? round16(n ? n : 1) : SPMM_NB;
    size_t off[9], o = 0, nnz = L->nnz;
    const size_t sz[9] = {(out + 1) * sizeof(size_t), nnz * sizeof(int32_t),
                          dt == MTI_F32 ? 0 : nnz * sizeof(float),
                          csc ? (in + 1) * sizeof(size_t) : 0, csc ? nnz * sizeof(int32_t) : 0,
                          csc ? nnz * sizeof(float) : 0, (in + out) * ld * sizeof(float),
                          bias ? out * sizeof(float) : 0,
                          (size_t)nt * 2 * SPMM_COLS * sizeof(float)};
    for (int i = 0; i < 9; i++) off[i] = o, o += mti_align_up(sz[i], 64);
    memset(w, 0, sizeof *w);
    w->ld = ld;
    mt_status s = mti_work_alloc(k, o, &w->blk);
    if (s || mti_dry(k)) return s;
    char *b = w->blk.ptr;
    w->ix.ptr = (size_t *)(b + off[0]);
    w->ix.idx = (int32_t *)(b + off[1]);
    w->ix.val = sz[2] ? (float *)(b + off[2]) : NULL;
    if (csc) {
        w->ix.cptr = (size_t *)(b + off[3]);
        w->ix.crow = (int32_t *)(b + off[4]);
        w->ix.cval = (float *)(b + off[5]);
    }
    w->xp = (float *)(b + off[6]);
    w->yp = w->xp + in * ld;
    w->bias = bias ? (float *)(b + off[7]) : NULL;
    w->tmp = (float *)(b + off[8]);
    return MT_OK;
}

/* Inside a parallel region: the CSR index and fp32 values (vals in dt);
 * ends with a barrier. */
static void build_csr(spmm_ix *ix, const mti_sp_layout *L, const void *meta, const void *vals,
                      mti_dtype dt, size_t in, size_t out)
{
#pragma omp for schedule(dynamic, 1) nowait
    for (size_t r0 = 0; r0 < out; r0 += 64)
        mti_sp_csr_rows(L, meta, in, r0, r0 + 64 < out ? r0 + 64 : out, ix->ptr, ix->idx);
    if (ix->val) {
#pragma omp for schedule(static) nowait
        for (size_t c = 0; c < L->nnz; c += 4096)
            mti_cpu_load_f32(ix->val + c, vals, dt, c, L->nnz - c < 4096 ? L->nnz - c : 4096);
    }
#pragma omp single
    ix->ptr[out] = L->nnz;
}

/* On one thread: the CSC from the CSR, each column's entries in row order. */
static void build_csc(spmm_ix *ix, const float *val, size_t nnz, size_t in, size_t out)
{
    memset(ix->cptr, 0, (in + 1) * sizeof *ix->cptr);
    for (size_t e = 0; e < nnz; e++) ix->cptr[ix->idx[e] + 1]++;
    for (size_t i = 0; i < in; i++) ix->cptr[i + 1] += ix->cptr[i];
    for (size_t r = 0; r < out; r++)
        for (size_t e = ix->ptr[r]; e < ix->ptr[r + 1]; e++) {
            const size_t at = ix->cptr[ix->idx[e]]++;
            ix->crow[at] = (int32_t)r, ix->cval[at] = val[e];
        }
    for (size_t i = in; i > 0; i--) ix->cptr[i] = ix->cptr[i - 1]; /* (the cursors back) */
    ix->cptr[0] = 0;
}

/* ---- the ops ---- */

int mti_cpu_sparse_matmul_choice(const mti_kctx *k, const mti_sp_layout *L, int n, int in, int out,
                                 mti_dtype dt)
{
    (void)k, (void)n, (void)in, (void)out;
    const double keep = dt != MTI_F32 && mti_gemm_supported(dt) ? SPMM_DENSITY_16 : SPMM_DENSITY;
    return (double)L->nnz <= keep * (double)L->dense ? MTI_SPMM_FASTER : MTI_SPMM_SLOWER;
}

static mt_status spmm_args(const mti_kctx *k, const char *op, const mti_sp_layout *L, int n,
                           int in, int out, mti_dtype dt)
{
    if (n < 0 || in <= 0 || out <= 0)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: bad shape n %d in %d out %d", op, n, in,
                        out);
    if (L->dense != (size_t)in * (size_t)out)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "%s: the pruned W has %zu elements, not out %d x in %d", op, L->dense, out,
                        in);
    if (L->fmt != MTI_SP_BITMAP && L->fmt != MTI_SP_NM)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: unknown format %d", op, L->fmt);
    if (dt != MTI_F32 && dt != MTI_BF16 && dt != MTI_F16)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: dtype %d is not fp32, bf16 or fp16", op,
                        (int)dt);
    return MT_OK;
}

static int threads_for(const mti_kctx *k, size_t rows)
{
    const size_t tasks = (rows + SPMM_ROWS - 1) / SPMM_ROWS;
    const int nt = mti_cpu_threads(k);
    return tasks < (size_t)nt ? (int)(tasks ? tasks : 1) : nt;
}

mt_status mti_cpu_sparse_matmul_fwd(const mti_kctx *k, void *y, const void *x, const void *vals,
                                    const void *meta, const mti_sp_layout *L, const void *b, int n,
                                    int in, int out, mti_dtype dt)
{
    mt_status s;
    MTI_TRY(spmm_args(k, "sparse_matmul_fwd", L, n, in, out, dt));
    const size_t I = (size_t)in, O = (size_t)out, N = (size_t)n;
    const int nt = threads_for(k, O);
    spmm_work w;
    s = spmm_work_alloc(k, L, N, I, O, dt, 0, b != NULL, nt, &w);
    if (s || mti_dry(k)) {
        mti_work_free(k, &w.blk);
        return s;
    }
    spmm_ix *ix = &w.ix;
    const float *val = ix->val ? ix->val : vals;
    const size_t ld = w.ld;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *tmp = w.tmp + (size_t)omp_get_thread_num() * 2 * SPMM_COLS;
        build_csr(ix, L, meta, vals, dt, I, O);
        if (b) {
#pragma omp single
            mti_cpu_load_f32(w.bias, b, dt, 0, O);
        }
        for (size_t n0 = 0; n0 < N; n0 += ld) {
            const size_t nb = N - n0 < ld ? N - n0 : ld;
#pragma omp for schedule(static)
            for (size_t c0 = 0; c0 < I; c0 += SPMM_COLS)
                panel_in(w.xp, ld, x, dt, I, n0, nb, c0, c0 + SPMM_COLS < I ? c0 + SPMM_COLS : I,
                         tmp);
#pragma omp for schedule(dynamic, 1)
            for (size_t r0 = 0; r0 < O; r0 += SPMM_ROWS)
                spmm_rows(w.yp, w.xp, ix->ptr, ix->idx, val, r0,
                          r0 + SPMM_ROWS < O ? r0 + SPMM_ROWS : O, round16(nb), ld, w.bias);
#pragma omp for schedule(static)
            for (size_t c0 = 0; c0 < O; c0 += SPMM_COLS)
                panel_out(y, dt, O, w.yp, ld, n0, nb, c0, c0 + SPMM_COLS < O ? c0 + SPMM_COLS : O,
                          0, tmp, tmp + SPMM_COLS);
        }
    }
    mti_work_free(k, &w.blk);
    return MT_OK;
}

mt_status mti_cpu_sparse_matmul_bwd(const mti_kctx *k, void *dx, float *dw, float *db,
                                    const void *dy, const void *x, const void *vals,
                                    const void *meta, const mti_sp_layout *L, int n, int in,
                                    int out, mti_dtype dt, int flags)
{
    mt_status s;
    MTI_TRY(spmm_args(k, "sparse_matmul_bwd", L, n, in, out, dt));
    const size_t I = (size_t)in, O = (size_t)out, N = (size_t)n;
    const int acc_dx = flags & MTI_BWD_ACC_DX, set = (flags & MTI_BWD_SET_DW) != 0;
    const int nt = threads_for(k, I > O ? I : O);
    spmm_work w;
    s = spmm_work_alloc(k, L, N, I, O, dt, dx != NULL, 0, nt, &w);
    if (s || mti_dry(k) || (!dx && !dw && !db)) {
        mti_work_free(k, &w.blk);
        return s;
    }
    spmm_ix *ix = &w.ix;
    const float *val = ix->val ? ix->val : vals;
    const size_t ld = w.ld;
    if (N == 0 && set) { /* an empty sum */
        if (dw) memset(dw, 0, L->nnz * sizeof *dw);
        if (db) memset(db, 0, O * sizeof *db);
    }
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *tmp = w.tmp + (size_t)omp_get_thread_num() * 2 * SPMM_COLS;
        build_csr(ix, L, meta, vals, dt, I, O);
        if (dx) {
#pragma omp single
            build_csc(ix, val, L->nnz, I, O);
        }
        for (size_t n0 = 0; n0 < N; n0 += ld) {
            const size_t nb = N - n0 < ld ? N - n0 : ld;
            const int add = !set || n0 > 0;
#pragma omp for schedule(static)
            for (size_t c0 = 0; c0 < O; c0 += SPMM_COLS)
                panel_in(w.yp, ld, dy, dt, O, n0, nb, c0, c0 + SPMM_COLS < O ? c0 + SPMM_COLS : O,
                         tmp);
            if (dw) {
#pragma omp for schedule(static)
                for (size_t c0 = 0; c0 < I; c0 += SPMM_COLS)
                    panel_in(w.xp, ld, x, dt, I, n0, nb, c0,
                             c0 + SPMM_COLS < I ? c0 + SPMM_COLS : I, tmp);
            }
            if (dw || db) {
#pragma omp for schedule(dynamic, 1)
                for (size_t r0 = 0; r0 < O; r0 += SPMM_ROWS)
                    sddmm_rows(dw, db, w.yp, w.xp, ix->ptr, ix->idx, r0,
                               r0 + SPMM_ROWS < O ? r0 + SPMM_ROWS : O, round16(nb), ld, add);
            }
            if (dx) {
                /* (the x panel is read above until the barrier: dxT goes in its place) */
#pragma omp for schedule(dynamic, 1)
                for (size_t i0 = 0; i0 < I; i0 += SPMM_ROWS)
                    spmm_rows(w.xp, w.yp, ix->cptr, ix->crow, ix->cval, i0,
                              i0 + SPMM_ROWS < I ? i0 + SPMM_ROWS : I, round16(nb), ld, NULL);
#pragma omp for schedule(static)
                for (size_t c0 = 0; c0 < I; c0 += SPMM_COLS)
                    panel_out(dx, dt, I, w.xp, ld, n0, nb, c0,
                              c0 + SPMM_COLS < I ? c0 + SPMM_COLS : I, acc_dx, tmp,
                              tmp + SPMM_COLS);
            }
        }
    }
    mti_work_free(k, &w.blk);
    return MT_OK;
}
