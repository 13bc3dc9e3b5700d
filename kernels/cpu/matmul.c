/*
 * matmul.c - y = x W^T + b and its backward, with W stored (out,in) as
 * nn.Linear and llm.c store it.
 *
 * Every GEMM here is cut into tiles of its output, and OpenMP threads take
 * the tiles, each calling a single-threaded sgemm on its own. The tiling
 * depends on the shape only: OpenBLAS rounds an output element differently
 * depending on where the element falls in the pieces a call is cut into (by
 * its own threads, or by us), so letting OpenBLAS thread the call, or cutting
 * by the thread count, would make results depend on the number of threads.
 * OpenBLAS itself always runs single-threaded (see mti_cpu_set_threads).
 *
 * fp32 tiles call sgemm on the tensors themselves. fp16 and bf16 have no GEMM
 * here: a thread keeps an fp32 accumulator tile, and for each chunk of the
 * reduction dimension converts the matching panels of both operands to fp32
 * and multiplies them in with sgemm (beta 1); the tile is rounded to the
 * storage dtype once, after the last chunk. The weight gradient is fp32
 * already, so its tiles accumulate in place. Workspace: per thread one tile
 * and two panels, at most (MM_TILE_M * MM_TILE_N + MM_KC * (MM_TILE_M +
 * MM_TILE_N)) floats = 1.25 MiB, whatever the sizes of the matrices.
 */
#include <cblas.h>
#include <omp.h>
#include <string.h>

#include "cpu_ops.h"

/* Largest tile of an output (rows, columns). About where one sgemm call on
 * a tile runs as fast as on the whole matrix: the packing of both operands,
 * redone per tile, costs 2-4% at 256 x 384 and 5-8% at 128 x 256 (one
 * thread, OpenBLAS 0.3.21, Haswell kernels). */
#define MM_TILE_M 256
#define MM_TILE_N 512
/* Smaller outputs are cut into at least this many tiles, so that more
 * threads find work, but columns no narrower than 128 and rows no shorter
 * than 256. */
#define MM_MIN_TILES 8
/* Chunk of the reduction dimension per sgemm in fp16/bf16 (elements): one
 * pass of OpenBLAS's own K blocking. */
#define MM_KC 256

static int mini(int a, int b) { return a < b ? a : b; }
static int ceil_div(int a, int b) { return (a + b - 1) / b; }

/* ---- tiling ---- */

/* An output of (M,N) cut into tm x tn tiles of (mb,nb), the last ones
 * smaller. */
typedef struct mm_plan {
    int M, N, mb, nb, tm, tn;
} mm_plan;

/* n cut into equal parts of at most `most`, rounded up to 16. */
static int side(int n, int most)
{
    int s = ceil_div(n, ceil_div(n, most));
    return mini(n, (s + 15) & ~15);
}

static mm_plan mm_plan_for(int M, int N)
{
    mm_plan p = {M, N, side(M, MM_TILE_M), side(N, MM_TILE_N), 0, 0};
    /* halve the columns, then the rows, while there are too few tiles */
    for (;;) {
        p.tm = ceil_div(M, p.mb), p.tn = ceil_div(N, p.nb);
        if (p.tm * p.tn >= MM_MIN_TILES) break;
        if (p.nb >= 256) p.nb = side(N, p.nb / 2);
        else if (p.mb >= 512) p.mb = side(M, p.mb / 2);
        else break;
    }
    return p;
}

/* Tile i of the plan: first row and column, and sizes. */
static void tile_at(const mm_plan *p, int i, int *m0, int *mc, int *n0, int *nc)
{
    *m0 = (i / p->tn) * p->mb, *n0 = (i % p->tn) * p->nb;
    *mc = mini(p->mb, p->M - *m0), *nc = mini(p->nb, p->N - *n0);
}

/* Threads for a plan: no more than tiles. */
static int plan_threads(const mti_kctx *k, const mm_plan *p)
{
    return mini(mti_cpu_threads(k), p->tm * p->tn);
}

/* ---- fp16 / bf16: a tile through fp32 panels ---- */

/* One operand of a tiled GEMM: a dt matrix, row-major with leading
 * dimension ld (elements), used as stored (trans 0) or transposed (trans 1). */
typedef struct mm_operand {
    const void *p;
    size_t ld;
    int trans;
} mm_operand;

/* dst (rows,len) fp32, dense = rows of src in dt, row r at element base + r ld. */
static void load_panel(float *dst, const void *src, mti_dtype dt, size_t base, size_t ld,
                       int rows, int len)
{
    for (int r = 0; r < rows; r++)
        mti_cpu_load_f32(dst + (size_t)r * (size_t)len, src, dt, base + (size_t)r * ld,
                         (size_t)len);
}

/* acc (mc,nc) fp32, leading dimension ldacc, += op(A)[m0:m0+mc, :] .
 * op(B)[:, n0:n0+nc], the reduction of length K in chunks of MM_KC. pa and
 * pb (MM_KC * mc and MM_KC * nc floats) take each chunk's panels in the
 * operands' stored orientation, so sgemm does any transposing. */
static void mm_tile(float *acc, int ldacc, const mm_operand *A, const mm_operand *B,
                    mti_dtype dt, int m0, int mc, int n0, int nc, int K, float *pa, float *pb)
{
    for (int k0 = 0; k0 < K; k0 += MM_KC) {
        int kc = mini(MM_KC, K - k0), lda, ldb;
        if (!A->trans) { /* A (M,K): mc rows of kc */
            load_panel(pa, A->p, dt, (size_t)m0 * A->ld + (size_t)k0, A->ld, mc, kc);
            lda = kc;
        } else { /* A stored (K,M): kc rows of mc */
            load_panel(pa, A->p, dt, (size_t)k0 * A->ld + (size_t)m0, A->ld, kc, mc);
            lda = mc;
        }
        if (!B->trans) { /* B (K,N): kc rows of nc */
            load_panel(pb, B->p, dt, (size_t)k0 * B->ld + (size_t)n0, B->ld, kc, nc);
            ldb = nc;
        } else { /* B stored (N,K): nc rows of kc */
            load_panel(pb, B->p, dt, (size_t)n0 * B->ld + (size_t)k0, B->ld, nc, kc);
            ldb = kc;
        }
        cblas_sgemm(CblasRowMajor, A->trans ? CblasTrans : CblasNoTrans,
                    B->trans ? CblasTrans : CblasNoTrans, mc, nc, kc, 1.0f, pa, lda, pb, ldb,
                    1.0f, acc, ldacc);
    }
}

/* Per-thread workspace of the fp16/bf16 GEMMs: an accumulator tile (when
 * with_acc) and two panels, `threads` times over in one block. */
typedef struct mm_work {
    mt_block blk;
    size_t per_thread, acc, pa; /* floats: per thread, then offsets of pa and pb */
} mm_work;

static mt_status mm_work_take(const mti_kctx *k, mm_work *w, const mm_plan *p, int threads,
                              int with_acc)
{
    w->acc = with_acc ? mti_align_up((size_t)p->mb * (size_t)p->nb, 16) : 0;
    w->pa = mti_align_up((size_t)MM_KC * (size_t)p->mb, 16);
    w->per_thread = w->acc + w->pa + mti_align_up((size_t)MM_KC * (size_t)p->nb, 16);
    return mti_work_alloc(k, (size_t)threads * w->per_thread * sizeof(float), &w->blk);
}

/* A dry run (lib/estimate.c) takes the workspace and gives it back
 * without computing: returns s, freeing the workspace if it was taken. */
static mt_status mm_work_give(const mti_kctx *k, mm_work *w, mt_status s)
{
    if (!s) mti_work_free(k, &w->blk);
    return s;
}

static float *mm_work_thread(const mm_work *w, float **pa, float **pb)
{
    float *base = (float *)w->blk.ptr + (size_t)omp_get_thread_num() * w->per_thread;
    *pa = base + w->acc;
    *pb = base + w->acc + w->pa;
    return base;
}

/* ---- forward ---- */

/* y (N,O) fp32 = x W^T + b: a tile's rows start as the bias, sgemm adds. */
static void fwd_f32(const mti_kctx *k, float *y, const float *x, const float *w, const float *b, int n, int in,
                    int out)
{
    mm_plan p = mm_plan_for(n, out);
    int nt = plan_threads(k, &p);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int t = 0; t < p.tm * p.tn; t++) {
        int m0, mc, n0, nc;
        tile_at(&p, t, &m0, &mc, &n0, &nc);
        float *yt = y + (size_t)m0 * (size_t)out + (size_t)n0;
        for (int i = 0; i < mc && (b || in == 0); i++) {
            float *r = yt + (size_t)i * (size_t)out;
            if (b) memcpy(r, b + n0, (size_t)nc * sizeof(float));
            else memset(r, 0, (size_t)nc * sizeof(float));
        }
        if (in > 0)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mc, nc, in, 1.0f,
                        x + (size_t)m0 * (size_t)in, in, w + (size_t)n0 * (size_t)in, in,
                        b ? 1.0f : 0.0f, yt, out);
    }
}

/* y (N,O) in fp16/bf16: per tile, bias rows, += x W^T in fp32, one rounding. */
static mt_status fwd_lowp(const mti_kctx *k, void *y, const void *x, const void *w,
                          const void *b, int n, int in, int out, mti_dtype dt)
{
    mm_plan p = mm_plan_for(n, out);
    int nt = plan_threads(k, &p);
    mm_work wk;
    mt_status s = mm_work_take(k, &wk, &p, nt, 1);
    if (s || mti_dry(k)) return mm_work_give(k, &wk, s);
    const mm_operand A = {x, (size_t)in, 0}, B = {w, (size_t)in, 1}; /* op(B) = W^T (I,O) */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int t = 0; t < p.tm * p.tn; t++) {
        int m0, mc, n0, nc;
        float *pa, *pb, *acc = mm_work_thread(&wk, &pa, &pb);
        tile_at(&p, t, &m0, &mc, &n0, &nc);
        if (b) {
            mti_cpu_load_f32(acc, b, dt, (size_t)n0, (size_t)nc);
            for (int i = 1; i < mc; i++)
                memcpy(acc + (size_t)i * (size_t)nc, acc, (size_t)nc * sizeof(float));
        } else {
            memset(acc, 0, (size_t)mc * (size_t)nc * sizeof(float));
        }
        mm_tile(acc, nc, &A, &B, dt, m0, mc, n0, nc, in, pa, pb);
        for (int i = 0; i < mc; i++)
            mti_cpu_store_f32(y, dt, (size_t)(m0 + i) * (size_t)out + (size_t)n0,
                              acc + (size_t)i * (size_t)nc, (size_t)nc);
    }
    mti_work_free(k, &wk.blk);
    return MT_OK;
}

static int dtype_ok(mti_dtype dt) { return dt == MTI_F32 || dt == MTI_F16 || dt == MTI_BF16; }

mt_status mti_cpu_matmul_fwd(const mti_kctx *k, void *y, const void *x, const void *w,
                             const void *b, int n, int in, int out, mti_dtype dt)
{
    if (n < 0 || in < 0 || out < 0 || !dtype_ok(dt))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "matmul_fwd: bad shape (%d,%d,%d) or dtype %d", n, in, out, (int)dt);
    if (n == 0 || out == 0) return MT_OK;
    mt_status s = MT_OK;
    if (dt == MTI_F32) {
        if (!mti_dry(k)) fwd_f32(k, y, x, w, b, n, in, out);
    } else {
        s = fwd_lowp(k, y, x, w, b, n, in, out, dt);
    }
    return s;
}

/* ---- backward ---- */

/* db (O) += the column sums of dy (N,O), each column summed over the rows in
 * order, in fp32; threads own chunks of columns. */
#define DB_CHUNK 1024
static void bias_grad(const mti_kctx *k, float *db, const void *dy, int n, int out, mti_dtype dt)
{
    int nchunks = ceil_div(out, DB_CHUNK);
#pragma omp parallel for num_threads(mti_cpu_threads(k)) schedule(static) \
    if ((size_t)n * (size_t)out > MTI_CPU_PAR_MIN)
    for (int c = 0; c < nchunks; c++) {
        float sum[DB_CHUNK], row[DB_CHUNK];
        int j0 = c * DB_CHUNK, len = mini(DB_CHUNK, out - j0);
        memset(sum, 0, sizeof sum);
        for (int i = 0; i < n; i++) {
            size_t at = (size_t)i * (size_t)out + (size_t)j0;
            const float *r = row;
            if (dt == MTI_F32) r = (const float *)dy + at;
            else mti_cpu_load_f32(row, dy, dt, at, (size_t)len);
#pragma omp simd
            for (int j = 0; j < len; j++) sum[j] += r[j];
        }
#pragma omp simd
        for (int j = 0; j < len; j++) db[j0 + j] += sum[j];
    }
}

/* dx (N,I) fp32 = (or +=) dy (N,O) . W (O,I). */
static void dx_f32(const mti_kctx *k, float *dx, const float *dy, const float *w, int n, int in, int out,
                   int accumulate)
{
    mm_plan p = mm_plan_for(n, in);
    int nt = plan_threads(k, &p);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int t = 0; t < p.tm * p.tn; t++) {
        int m0, mc, n0, nc;
        tile_at(&p, t, &m0, &mc, &n0, &nc);
        float *dxt = dx + (size_t)m0 * (size_t)in + (size_t)n0;
        if (out > 0)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mc, nc, out, 1.0f,
                        dy + (size_t)m0 * (size_t)out, out, w + n0, in,
                        accumulate ? 1.0f : 0.0f, dxt, in);
        else if (!accumulate)
            for (int i = 0; i < mc; i++) memset(dxt + (size_t)i * (size_t)in, 0, (size_t)nc * sizeof(float));
    }
}

/* Rows [o0, o1) of dW (O,I) fp32 += dy^T (O,N) . x (N,I), dw pointing at
 * row o0; o0 and o1 on tile-row boundaries of the plan of the whole dW, so
 * every row is made by the same sgemm call as when dW is made whole. */
static void dw_f32(const mti_kctx *k, float *dw, const float *dy, const float *x, int n, int in, int out, int o0,
                   int o1)
{
    mm_plan p = mm_plan_for(out, in);
    int t0 = o0 / p.mb * p.tn, t1 = ceil_div(o1, p.mb) * p.tn;
    int nt = mini(mti_cpu_threads(k), t1 - t0);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int t = t0; t < t1; t++) {
        int m0, mc, n0, nc;
        tile_at(&p, t, &m0, &mc, &n0, &nc);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, mc, nc, n, 1.0f, dy + m0, out,
                    x + n0, in, 1.0f, dw + (size_t)(m0 - o0) * (size_t)in + (size_t)n0, in);
    }
}

/* dx (N,I) in fp16/bf16 = (or +=) dy W; a tile starts as 0 or as dx. */
static mt_status dx_lowp(const mti_kctx *k, void *dx, const void *dy, const void *w, int n,
                         int in, int out, mti_dtype dt, int accumulate)
{
    mm_plan p = mm_plan_for(n, in);
    int nt = plan_threads(k, &p);
    mm_work wk;
    mt_status s = mm_work_take(k, &wk, &p, nt, 1);
    if (s || mti_dry(k)) return mm_work_give(k, &wk, s);
    const mm_operand A = {dy, (size_t)out, 0}, B = {w, (size_t)in, 0};
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int t = 0; t < p.tm * p.tn; t++) {
        int m0, mc, n0, nc;
        float *pa, *pb, *acc = mm_work_thread(&wk, &pa, &pb);
        tile_at(&p, t, &m0, &mc, &n0, &nc);
        size_t at = (size_t)m0 * (size_t)in + (size_t)n0;
        if (accumulate) load_panel(acc, dx, dt, at, (size_t)in, mc, nc);
        else memset(acc, 0, (size_t)mc * (size_t)nc * sizeof(float));
        mm_tile(acc, nc, &A, &B, dt, m0, mc, n0, nc, out, pa, pb);
        for (int i = 0; i < mc; i++)
            mti_cpu_store_f32(dx, dt, at + (size_t)i * (size_t)in, acc + (size_t)i * (size_t)nc,
                              (size_t)nc);
    }
    mti_work_free(k, &wk.blk);
    return MT_OK;
}

/* Rows [o0, o1) of dW (O,I) fp32 += dy^T x, tile by tile in place (as
 * dw_f32). */
static mt_status dw_lowp(const mti_kctx *k, float *dw, const void *dy, const void *x, int n,
                         int in, int out, int o0, int o1, mti_dtype dt)
{
    mm_plan p = mm_plan_for(out, in);
    int t0 = o0 / p.mb * p.tn, t1 = ceil_div(o1, p.mb) * p.tn;
    int nt = mini(plan_threads(k, &p), t1 - t0);
    mm_work wk;
    mt_status s = mm_work_take(k, &wk, &p, nt, 0);
    if (s || mti_dry(k)) return mm_work_give(k, &wk, s);
    const mm_operand A = {dy, (size_t)out, 1}, B = {x, (size_t)in, 0}; /* op(A) = dy^T (O,N) */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int t = t0; t < t1; t++) {
        int m0, mc, n0, nc;
        float *pa, *pb;
        mm_work_thread(&wk, &pa, &pb);
        tile_at(&p, t, &m0, &mc, &n0, &nc);
        mm_tile(dw + (size_t)(m0 - o0) * (size_t)in + (size_t)n0, in, &A, &B, dt, m0, mc, n0, nc,
                n, pa, pb);
    }
    mti_work_free(k, &wk.blk);
    return MT_OK;
}

mt_status mti_cpu_matmul_bwd(const mti_kctx *k, void *dx, float *dw, float *db, const void *dy,
                             const void *x, const void *w, int n, int in, int out, mti_dtype dt,
                             int accumulate)
{
    if (n < 0 || in < 0 || out < 0 || !dtype_ok(dt))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "matmul_bwd: bad shape (%d,%d,%d) or dtype %d", n, in, out, (int)dt);
    if (n == 0) return MT_OK; /* no rows: dx is empty, dW and db get nothing */
    if (db && out > 0 && !mti_dry(k)) bias_grad(k, db, dy, n, out, dt);
    if (in == 0) return MT_OK; /* dx and dW are empty */
    mt_status s = MT_OK;
    if (dt == MTI_F32) {
        if (mti_dry(k)) return MT_OK; /* no workspace */
        if (dx) dx_f32(k, dx, dy, w, n, in, out, accumulate);
        if (dw && out > 0) dw_f32(k, dw, dy, x, n, in, out, 0, out);
    } else {
        if (dx) s = dx_lowp(k, dx, dy, w, n, in, out, dt, accumulate);
        if (!s && dw && out > 0) s = dw_lowp(k, dw, dy, x, n, in, out, 0, out, dt);
    }
    return s;
}

int mti_cpu_matmul_dw_align(int out, int in)
{
    if (out <= 0 || in <= 0) return 1;
    return mm_plan_for(out, in).mb;
}

mt_status mti_cpu_matmul_dw_rows(const mti_kctx *k, float *dw, const void *dy, const void *x,
                                 int n, int in, int out, int o0, int o1, mti_dtype dt)
{
    int a = mti_cpu_matmul_dw_align(out, in);
    if (n < 0 || in < 0 || out < 0 || !dtype_ok(dt) || o0 < 0 || o1 < o0 || o1 > out ||
        o0 % a || (o1 % a && o1 != out))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "matmul_dw_rows: bad shape (%d,%d,%d), rows [%d,%d) (multiples of %d) "
                        "or dtype %d",
                        n, in, out, o0, o1, a, (int)dt);
    if (n == 0 || in == 0 || o0 == o1) return MT_OK;
    if (dt == MTI_F32) {
        if (!mti_dry(k)) dw_f32(k, dw, dy, x, n, in, out, o0, o1);
        return MT_OK;
    }
    return dw_lowp(k, dw, dy, x, n, in, out, o0, o1, dt);
}
