/*
 * matmul.c - y = x W^T + b and its backward, with W stored (out,in) as
 * nn.Linear and llm.c store it.
 *
 * Every GEMM here is cut into tiles of its output, and OpenMP threads take
 * the tiles, each running one single-threaded oneDNN matmul on its own
 * (gemm.c). The tiling depends on the shape only: a GEMM library rounds an
 * output element differently depending on how a call is cut (by its own
 * threads, or by us), so letting oneDNN thread the call, or cutting by the
 * thread count, would make results depend on the number of threads.
 *
 * fp32 and bf16 tiles go to oneDNN as they are stored where it has a
 * matmul for them: bf16 inputs run on the CPU's bf16 instructions
 * (AVX512-BF16, AMX) with fp32 accumulation, the bias added in fp32, and
 * the tile rounded to bf16 once. fp16 does the same where oneDNN has an
 * fp16 matmul (AVX512-FP16, AMX-FP16). Elsewhere (bf16 below AVX512-BF16,
 * or under MT_CPU_ISA's cap; fp16 below AVX512-FP16) a thread keeps an fp32
 * accumulator tile, and for each chunk of the reduction dimension converts
 * the matching panels of both operands to fp32 (exact) and multiplies them
 * in (fp32 GEMM): the first chunk writes the tile with the bias added (a
 * tile that adds to C's values starts from them), the others add to it,
 * and the tile is rounded once, after the last chunk. The chunks are as
 * long as they can be up to MM_KC, cut by the reduction's length alone
 * (conv_kc): fewer chunks are fewer passes over the accumulator and fewer
 * small GEMM calls, which is what the panels cost against oneDNN's own
 * packing (docs/benchmarks.md, "AVX-512 class"). Products of bf16 or fp16
 * values are exact in fp32 either way, so the two paths differ only in the
 * order of the sums. The weight gradient is fp32: its tiles accumulate in
 * place (or, on its first contribution, are written). A quantized weight is
 * dequantized a panel at a time in the activations' dtype, into the direct
 * path's panel, or widened into the converted path's fp32 panel.
 *
 * Workspace, per thread: the largest scratchpad oneDNN asks for among the
 * op's tile shapes, and in the converted path one tile and two panels, at
 * most (MM_TILE_M * MM_TILE_N + MM_KC * (MM_TILE_M + MM_TILE_N)) floats =
 * 2.75 MiB, whatever the sizes of the matrices; and once, the bias widened
 * to fp32.
 */
#include <omp.h>
#include <string.h>

#include "arch.h"
#include "cpu_ops.h"
#include "quant/quant.h"

/* Largest tile of an output (rows, columns). About where one GEMM call on a
 * tile runs as fast as on the whole matrix: the packing of both operands is
 * redone per tile (docs/benchmarks-history.md, "GEMM"). */
#define MM_TILE_M 256
#define MM_TILE_N 512
/* Smaller outputs are cut into at least this many tiles, so that more
 * threads find work, but columns no narrower than 128 and rows no shorter
 * than 256. */
#define MM_MIN_TILES 8
/* The most bytes of a quantized weight's dequantized panel per thread in
 * matmul_dx_q, unless a tile of 16 columns takes more. */
#define MM_Q_PANEL ((size_t)4 << 20)
/* The longest chunk of the reduction per converted GEMM (elements): the
 * reduction is cut into equal chunks of at most this, multiples of 16. */
#define MM_KC 768
/* Elements per dequantize call when a quantized panel is widened. */
#define MM_QC 256

static int mini(int a, int b) { return a < b ? a : b; }
static int ceil_div(int a, int b) { return (a + b - 1) / b; }
/* The converted path's chunk of a reduction of K (the last one may be
 * shorter): by K alone, so every thread count sums the same chunks. */
static int conv_kc(int K) { return mini(K, (ceil_div(K, ceil_div(K, MM_KC)) + 15) & ~15); }
static size_t dt_bytes(mti_dtype dt) { return dt == MTI_F32 ? 4 : 2; }

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

/* ---- one GEMM, tiled ---- */

/* C (M,N) [+]= op(A) (M,K) . op(B) (K,N) [+ bias], tiles [t0, t1) of the
 * plan of (M,N); C's first row is row c_row0 of the plan (a range of dW's
 * rows). Operands as in mti_gemm_shape. */
typedef struct mm_job {
    mm_plan p;
    int K, t0, t1, c_row0;
    const void *a, *b, *bias;
    void *c;
    int ta, tb, accumulate;
    int64_t lda, ldb, ldc;
    mti_dtype ab_dt, c_dt;
    /* a quantized B (lib/quant/quant.h) of qn elements, stored (N,K) when tb or
     * (K,N), with row length qld; each tile dequantizes its panel of B into
     * a per-thread buffer, which the GEMM reads with leading dimension ldb */
    const void *bq;
    mti_qformat qf;
    size_t qn;
    int64_t qld;
} mm_job;

/* The variant of a tile: full or edge rows, full or edge columns. */
static int tile_kind(const mm_plan *p, int mc, int nc)
{
    return (mc != p->mb) * 2 + (nc != p->nb);
}

/* The tile shapes of a job, by variant: (mc, nc), or (0, 0) when no tile
 * of [t0, t1) has that shape. */
static void tile_variants(const mm_job *j, int mc_of[4], int nc_of[4])
{
    for (int v = 0; v < 4; v++) mc_of[v] = nc_of[v] = 0;
    for (int t = j->t0; t < j->t1; t++) {
        int m0, mc, n0, nc;
        tile_at(&j->p, t, &m0, &mc, &n0, &nc);
        int v = tile_kind(&j->p, mc, nc);
        mc_of[v] = mc, nc_of[v] = nc;
    }
}

static mti_gemm_shape tile_shape(const mm_job *j, int mc, int nc)
{
    return (mti_gemm_shape){.M = mc, .N = nc, .K = j->K, .ta = j->ta, .tb = j->tb,
                            .lda = j->lda, .ldb = j->ldb, .ldc = j->ldc, .ab_dt = j->ab_dt,
                            .c_dt = j->c_dt, .bias_dt = j->ab_dt, .bias = j->bias != NULL,
                            .accumulate = j->accumulate};
}

/* Columns [n0, n0 + nc) of a quantized B into panel, as the tile's GEMM
 * reads them: rows [n0, n0 + nc) of an (N,K) B whole (leading dimension
 * ldb = K, as the dense B's), or of a (K,N) B the nc elements of each of
 * its K rows (leading dimension ldb). */
static mt_status dequant_panel(const mm_job *j, char *panel, int n0, int nc)
{
    const size_t ea = dt_bytes(j->ab_dt);
    if (j->tb)
        return mti_dequantize(NULL, j->qf, j->bq, j->qn, (size_t)n0 * (size_t)j->qld,
                              (size_t)nc * (size_t)j->qld, panel, j->ab_dt);
    mt_status s = MT_OK;
    for (int r = 0; r < j->K && !s; r++)
        s = mti_dequantize(NULL, j->qf, j->bq, j->qn, (size_t)r * (size_t)j->qld + (size_t)n0,
                           (size_t)nc, panel + ea * (size_t)r * (size_t)j->ldb, j->ab_dt);
    return s;
}

static mt_status direct(const mti_kctx *k, const mm_job *j)
{
    const mm_plan *p = &j->p;
    mti_gemm_prim *prim[4] = {NULL};
    size_t scratch = 0;
    mt_status s = MT_OK;
    /* the primitives of the tile shapes that occur, and the largest scratchpad */
    int mc_of[4], nc_of[4];
    tile_variants(j, mc_of, nc_of);
    for (int v = 0; v < 4 && !s; v++) {
        if (!mc_of[v]) continue;
        mti_gemm_shape sh = tile_shape(j, mc_of[v], nc_of[v]);
        s = mti_gemm_get(k, &sh, &prim[v]);
        if (!s && mti_gemm_scratch(prim[v]) > scratch) scratch = mti_gemm_scratch(prim[v]);
    }
    int nt = mini(mti_cpu_threads(k), j->t1 - j->t0);
    const size_t ea = dt_bytes(j->ab_dt), ec = dt_bytes(j->c_dt);
    size_t sp_bytes = mti_align_up(scratch, 64);
    size_t per = sp_bytes + (j->bq ? mti_align_up(ea * (size_t)p->nb * (size_t)j->K, 64) : 0);
    mt_block wk = {0};
    if (!s && per) s = mti_work_alloc(k, (size_t)nt * per, &wk);
    if (!s && !mti_dry(k)) {
        int bad = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(| : bad) if (nt > 1)
        for (int t = j->t0; t < j->t1; t++) {
            int m0, mc, n0, nc;
            tile_at(p, t, &m0, &mc, &n0, &nc);
            const char *a = (const char *)j->a + ea * (size_t)(j->ta ? m0 : m0 * j->lda);
            const char *b = (const char *)j->b + ea * (size_t)(j->tb ? n0 * j->ldb : n0);
            char *c = (char *)j->c + ec * ((size_t)(m0 - j->c_row0) * (size_t)j->ldc + (size_t)n0);
            const char *bias = j->bias ? (const char *)j->bias + ea * (size_t)n0 : NULL;
            char *sp = wk.ptr ? (char *)wk.ptr + (size_t)omp_get_thread_num() * per : NULL;
            if (j->bq) {
                char *panel = sp + sp_bytes;
                bad |= dequant_panel(j, panel, n0, nc) != MT_OK;
                b = panel;
            }
            if (!sp_bytes) sp = NULL;
            bad |= mti_gemm_run(prim[tile_kind(p, mc, nc)], a, b, c, bias, sp) != 0;
        }
        if (bad) s = mti_fail(k->ctx, MT_ERR_DEVICE, "matmul: a oneDNN matmul call failed");
    }
    mti_work_free(k, &wk);
    for (int v = 0; v < 4; v++) mti_gemm_put(prim[v]);
    return s;
}

/* ---- fp16 without an fp16 matmul: tiles through fp32 panels ---- */

/* dst (rows,len) fp32, dense = rows of src in dt, row r at element base + r ld. */
static void load_panel(float *dst, const void *src, mti_dtype dt, size_t base, size_t ld,
                       int rows, int len)
{
    for (int r = 0; r < rows; r++)
        mti_cpu_load_f32(dst + (size_t)r * (size_t)len, src, dt, base + (size_t)r * ld,
                         (size_t)len);
}

/* The fp32 GEMMs of the converted path: per tile variant v, prim[v][c]
 * with c = last + 2 first: a middle chunk of the reduction and the last one
 * add into the accumulator; when the tile starts from nothing (no C to add
 * to), the first chunk writes it instead, with the bias (widened to fp32
 * once, in bias) added. Panels are dense: a chunk's A panel has leading
 * dimension kc (or mc when ta), B's nc (or kc when tb); the accumulator
 * tile nc, or j->ldc when it is C itself (an fp32 C). */
typedef struct mm_conv {
    mti_gemm_prim *prim[4][4];
    int kc, fresh;      /* chunk; whether the first chunk writes the tile */
    size_t scratch;     /* bytes per thread, aligned */
    size_t acc, pa, pb; /* floats per thread: tile (0 when C is fp32), panels */
    size_t bias;        /* floats: the widened bias (shared) */
} mm_conv;

/* The kind of chunk q of a reduction cut into `chunks` (prim's second
 * index): whether it is the last, and whether it writes the tile. */
static int chunk_kind(const mm_conv *cv, int q, int chunks)
{
    return (q == chunks - 1) + 2 * (q == 0 && cv->fresh);
}

static mt_status conv_prims(const mti_kctx *k, const mm_job *j, mm_conv *cv, int in_place)
{
    const mm_plan *p = &j->p;
    size_t scratch = 0;
    mt_status s = MT_OK;
    int mc_of[4], nc_of[4];
    tile_variants(j, mc_of, nc_of);
    const int kc = conv_kc(j->K), chunks = ceil_div(j->K, kc);
    cv->kc = kc, cv->fresh = !j->accumulate;
    for (int v = 0; v < 4 && !s; v++) {
        int mc = mc_of[v], nc = nc_of[v];
        /* chunks 0, 1 and the last are of every kind that runs */
        for (int q = 0; q < chunks && q < 3 && !s && mc; q++) {
            const int c = chunk_kind(cv, q < 2 ? q : chunks - 1, chunks);
            if (cv->prim[v][c]) continue;
            const int last = c & 1, first = c >> 1;
            const int k_c = last ? j->K - (chunks - 1) * kc : kc;
            mti_gemm_shape sh = {.M = mc, .N = nc, .K = k_c, .ta = j->ta, .tb = j->tb,
                                 .lda = j->ta ? mc : k_c, .ldb = j->tb ? k_c : nc,
                                 .ldc = in_place ? j->ldc : nc, .ab_dt = MTI_F32,
                                 .c_dt = MTI_F32, .bias_dt = MTI_F32,
                                 .bias = first && j->bias != NULL, .accumulate = !first};
            s = mti_gemm_get(k, &sh, &cv->prim[v][c]);
            if (!s && mti_gemm_scratch(cv->prim[v][c]) > scratch)
                scratch = mti_gemm_scratch(cv->prim[v][c]);
        }
    }
    cv->scratch = mti_align_up(scratch, 64);
    cv->acc = in_place ? 0 : mti_align_up((size_t)p->mb * (size_t)p->nb, 16);
    cv->pa = mti_align_up((size_t)kc * (size_t)p->mb, 16);
    cv->pb = mti_align_up((size_t)kc * (size_t)p->nb, 16);
    cv->bias = cv->fresh && j->bias ? mti_align_up((size_t)p->N, 16) : 0;
    return s;
}

/* load_panel from a quantized B (lib/quant/quant.h; rows of qld elements): each
 * value dequantized in the job's dtype (a bf16 job rounds the weight to
 * bf16, as the direct path's panel does), then widened, exactly. 0, or -1
 * when the weight cannot be read. */
static int load_panel_q(float *dst, const mm_job *j, size_t base, int rows, int len)
{
    uint16_t st[MM_QC];
    for (int r = 0; r < rows; r++) {
        float *d = dst + (size_t)r * (size_t)len;
        size_t at = base + (size_t)r * (size_t)j->qld;
        if (j->ab_dt == MTI_F32) {
            if (mti_dequantize(NULL, j->qf, j->bq, j->qn, at, (size_t)len, d, MTI_F32)) return -1;
            continue;
        }
        for (int c = 0; c < len; c += MM_QC) {
            int m = mini(MM_QC, len - c);
            if (mti_dequantize(NULL, j->qf, j->bq, j->qn, at + (size_t)c, (size_t)m, st, j->ab_dt))
                return -1;
            mti_cpu_load_f32(d + c, st, j->ab_dt, 0, (size_t)m);
        }
    }
    return 0;
}

/* acc (mc,nc) += (or, fresh, = bias +) op(A)[m0:m0+mc, :] .
 * op(B)[:, n0:n0+nc] in chunks of cv->kc; pa and pb take each chunk's
 * panels in the operands' stored orientation. 0, or -1 when a GEMM call
 * fails. */
static int conv_tile(const mm_job *j, const mm_conv *cv, int v, float *acc, int m0, int mc, int n0,
                     int nc, float *pa, float *pb, const float *bias, void *sp)
{
    const size_t lda = (size_t)j->lda, ldb = (size_t)j->ldb, qld = (size_t)j->qld;
    int bad = 0;
    const int chunks = ceil_div(j->K, cv->kc);
    for (int q = 0, k0 = 0; q < chunks; q++, k0 += cv->kc) {
        const int kc = mini(cv->kc, j->K - k0), c = chunk_kind(cv, q, chunks), first = c >> 1;
        if (!j->ta) load_panel(pa, j->a, j->ab_dt, (size_t)m0 * lda + (size_t)k0, lda, mc, kc);
        else load_panel(pa, j->a, j->ab_dt, (size_t)k0 * lda + (size_t)m0, lda, kc, mc);
        if (j->bq && !j->tb) bad |= load_panel_q(pb, j, (size_t)k0 * qld + (size_t)n0, kc, nc);
        else if (j->bq) bad |= load_panel_q(pb, j, (size_t)n0 * qld + (size_t)k0, nc, kc);
        else if (!j->tb) load_panel(pb, j->b, j->ab_dt, (size_t)k0 * ldb + (size_t)n0, ldb, kc, nc);
        else load_panel(pb, j->b, j->ab_dt, (size_t)n0 * ldb + (size_t)k0, ldb, nc, kc);
        bad |= mti_gemm_run(cv->prim[v][c], pa, pb, acc, first && bias ? bias + n0 : NULL, sp);
    }
    return bad;
}

static mt_status converted(const mti_kctx *k, const mm_job *j)
{
    const mm_plan *p = &j->p;
    const int in_place = j->c_dt == MTI_F32; /* dW: tiles accumulate in C */
    mm_conv cv;
    memset(&cv, 0, sizeof cv);
    mt_status s = conv_prims(k, j, &cv, in_place);
    int nt = mini(mti_cpu_threads(k), j->t1 - j->t0);
    size_t per = cv.scratch + (cv.acc + cv.pa + cv.pb) * sizeof(float);
    mt_block wk = {0};
    if (!s) s = mti_work_alloc(k, (size_t)nt * per + cv.bias * sizeof(float), &wk);
    if (!s && !mti_dry(k)) {
        float *bias = cv.bias ? (float *)((char *)wk.ptr + (size_t)nt * per) : NULL;
        if (bias) mti_cpu_load_f32(bias, j->bias, j->ab_dt, 0, (size_t)p->N);
        int bad = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(| : bad) if (nt > 1)
        for (int t = j->t0; t < j->t1; t++) {
            int m0, mc, n0, nc;
            tile_at(p, t, &m0, &mc, &n0, &nc);
            char *base = (char *)wk.ptr + (size_t)omp_get_thread_num() * per;
            float *acc = (float *)base, *pa = acc + cv.acc, *pb = pa + cv.pa;
            void *sp = cv.scratch ? (void *)(pb + cv.pb) : NULL;
            size_t at = (size_t)(m0 - j->c_row0) * (size_t)j->ldc + (size_t)n0;
            /* dW's tiles are C itself; a tile adds to C's values, or its
               first chunk writes it (the bias added) */
            if (in_place) acc = (float *)j->c + at;
            else if (j->accumulate) load_panel(acc, j->c, j->c_dt, at, (size_t)j->ldc, mc, nc);
            bad |= conv_tile(j, &cv, tile_kind(p, mc, nc), acc, m0, mc, n0, nc, pa, pb, bias,
                             sp) != 0;
            for (int i = 0; i < mc && !in_place; i++)
                mti_cpu_store_f32(j->c, j->c_dt, at + (size_t)i * (size_t)j->ldc,
                                  acc + (size_t)i * (size_t)nc, (size_t)nc);
        }
        if (bad) s = mti_fail(k->ctx, MT_ERR_DEVICE, "matmul: a oneDNN matmul call failed");
    }
    mti_work_free(k, &wk);
    for (int v = 0; v < 4; v++)
        for (int c = 0; c < 4; c++) mti_gemm_put(cv.prim[v][c]);
    return s;
}

/* A job with K == 0: C = bias or 0 unless accumulating (dW gets nothing). */
static void empty_k(const mm_job *j)
{
    if (j->accumulate) return;
    const size_t ec = dt_bytes(j->c_dt);
    for (int i = 0; i < j->p.M; i++) {
        char *r = (char *)j->c + ec * (size_t)i * (size_t)j->ldc;
        if (j->bias) memcpy(r, j->bias, ec * (size_t)j->p.N);
        else memset(r, 0, ec * (size_t)j->p.N);
    }
}

/* Whether a dense fp32 job goes through panels (the converted path's
 * copies) rather than to oneDNN as stored: where the CPU's paths say so
 * (arch.h: gemm_pack_aliased; x86 below AVX-512) and an operand stored
 * K-major (A transposed, or B not: the reduction runs down its rows) has
 * rows a multiple of 4 KiB apart. oneDNN 2.6's AVX2 sgemm reads such an
 * operand down a column of cache sets that alias, at half its rate or less
 * (GPT-2's MLP weight and input gradients, rows of 3072 floats;
 * docs/benchmarks.md, "Every CPU class"); a dense panel costs a copy. */
static int pack_aliased(const mm_job *j)
{
    if (j->ab_dt != MTI_F32 || j->bq || !mti_arch_paths_now()->gemm_pack_aliased) return 0;
    const int64_t set = 4096 / 4; /* floats */
    return (j->ta && j->lda % set == 0) || (!j->tb && j->ldb % set == 0);
}

static mt_status mm_run(const mti_kctx *k, const mm_job *j)
{
    if (j->t0 >= j->t1) return MT_OK;
    if (j->K == 0) {
        if (!mti_dry(k)) empty_k(j);
        return MT_OK;
    }
    return mti_gemm_supported(j->ab_dt) && !pack_aliased(j) ? direct(k, j) : converted(k, j);
}

/* ---- forward ---- */

static int dtype_ok(mti_dtype dt) { return dt == MTI_F32 || dt == MTI_F16 || dt == MTI_BF16; }

mt_status mti_cpu_matmul_fwd(const mti_kctx *k, void *y, const void *x, const void *w,
                             const void *b, int n, int in, int out, mti_dtype dt)
{
    if (n < 0 || in < 0 || out < 0 || !dtype_ok(dt))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "matmul_fwd: bad shape (%d,%d,%d) or dtype %d", n, in, out, (int)dt);
    if (n == 0 || out == 0) return MT_OK;
    /* y (N,O) = x (N,I) . W^T, W stored (O,I) */
    mm_job j = {.p = mm_plan_for(n, out), .K = in, .a = x, .b = w, .bias = b, .c = y, .tb = 1,
                .lda = in, .ldb = in, .ldc = out, .ab_dt = dt, .c_dt = dt};
    j.t1 = j.p.tm * j.p.tn;
    return mm_run(k, &j);
}

/* ---- backward ---- */

/* db (O) += (with set, =) the column sums of dy (N,O), each column summed
 * over the rows in order, in fp32; threads own chunks of columns. */
#define DB_CHUNK 1024
static void bias_grad(const mti_kctx *k, float *db, const void *dy, int n, int out, mti_dtype dt,
                      int set)
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
        if (set) {
            memcpy(db + j0, sum, (size_t)len * sizeof(float));
            continue;
        }
#pragma omp simd
        for (int j = 0; j < len; j++) db[j0 + j] += sum[j];
    }
}

/* Rows [o0, o1) of dW (O,I) fp32 += (with set, =) dy^T (O,N) . x (N,I), dw
 * pointing at row o0; o0 and o1 on tile-row boundaries of the plan of the
 * whole dW, so every row is made by the same GEMM call as when dW is made
 * whole. Writing instead of adding onto zeros leaves the sums' bits as they
 * are (x + 0 = x; only a sum of -0 keeps its sign) and reads no dW. */
static mt_status dw_job(const mti_kctx *k, float *dw, const void *dy, const void *x, int n,
                        int in, int out, int o0, int o1, mti_dtype dt, int set)
{
    mm_job j = {.p = mm_plan_for(out, in), .K = n, .a = dy, .b = x, .c = dw, .ta = 1,
                .accumulate = !set, .lda = out, .ldb = in, .ldc = in, .ab_dt = dt,
                .c_dt = MTI_F32, .c_row0 = o0};
    j.t0 = o0 / j.p.mb * j.p.tn, j.t1 = ceil_div(o1, j.p.mb) * j.p.tn;
    return mm_run(k, &j);
}

mt_status mti_cpu_matmul_bwd(const mti_kctx *k, void *dx, float *dw, float *db, const void *dy,
                             const void *x, const void *w, int n, int in, int out, mti_dtype dt,
                             int flags)
{
    if (n < 0 || in < 0 || out < 0 || !dtype_ok(dt))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "matmul_bwd: bad shape (%d,%d,%d) or dtype %d", n, in, out, (int)dt);
    const int set = (flags & MTI_BWD_SET_DW) != 0;
    if (n == 0) { /* no rows: dx is empty, dW and db get nothing (are zeros when set) */
        if (set && !mti_dry(k)) {
            if (dw) memset(dw, 0, (size_t)out * (size_t)in * sizeof(float));
            if (db) memset(db, 0, (size_t)out * sizeof(float));
        }
        return MT_OK;
    }
    if (db && out > 0 && !mti_dry(k)) bias_grad(k, db, dy, n, out, dt, set);
    if (in == 0) return MT_OK; /* dx and dW are empty */
    mt_status s = MT_OK;
    if (dx) { /* dx (N,I) = (or +=) dy (N,O) . W (O,I) */
        mm_job j = {.p = mm_plan_for(n, in), .K = out, .a = dy, .b = w, .c = dx,
                    .accumulate = flags & MTI_BWD_ACC_DX, .lda = out, .ldb = in, .ldc = in,
                    .ab_dt = dt, .c_dt = dt};
        j.t1 = j.p.tm * j.p.tn;
        s = mm_run(k, &j);
    }
    if (!s && dw && out > 0) s = dw_job(k, dw, dy, x, n, in, out, 0, out, dt, set);
    return s;
}

int mti_cpu_matmul_dw_align(int out, int in)
{
    if (out <= 0 || in <= 0) return 1;
    return mm_plan_for(out, in).mb;
}

mt_status mti_cpu_matmul_dw_rows(const mti_kctx *k, float *dw, const void *dy, const void *x,
                                 int n, int in, int out, int o0, int o1, mti_dtype dt, int flags)
{
    int a = mti_cpu_matmul_dw_align(out, in);
    if (n < 0 || in < 0 || out < 0 || !dtype_ok(dt) || o0 < 0 || o1 < o0 || o1 > out ||
        o0 % a || (o1 % a && o1 != out))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "matmul_dw_rows: bad shape (%d,%d,%d), rows [%d,%d) (multiples of %d) "
                        "or dtype %d",
                        n, in, out, o0, o1, a, (int)dt);
    const int set = (flags & MTI_BWD_SET_DW) != 0;
    if (n == 0 && set && !mti_dry(k)) /* no rows: the sums are zeros */
        memset(dw, 0, (size_t)(o1 - o0) * (size_t)in * sizeof(float));
    if (n == 0 || in == 0 || o0 == o1) return MT_OK;
    return dw_job(k, dw, dy, x, n, in, out, o0, o1, dt, set);
}

/* ---- a quantized weight (lib/quant/quant.h): dequantized a tile at a time ---- */

mt_status mti_cpu_matmul_fwd_q(const mti_kctx *k, void *y, const void *x, const void *wq,
                               mti_qformat qf, const void *b, int n, int in, int out, mti_dtype dt)
{
    mt_status s = mti_quant_mm_check(k->ctx, "matmul_fwd_q", wq, qf, n, in, out, dt);
    if (s || n == 0 || out == 0) return s;
    /* as mti_cpu_matmul_fwd: a tile of y's columns reads those rows of W */
    mm_job j = {.p = mm_plan_for(n, out), .K = in, .a = x, .bias = b, .c = y, .tb = 1,
                .lda = in, .ldb = in, .ldc = out, .ab_dt = dt, .c_dt = dt, .bq = wq,
                .qf = qf, .qn = (size_t)in * (size_t)out, .qld = in};
    j.t1 = j.p.tm * j.p.tn;
    return mm_run(k, &j);
}

mt_status mti_cpu_matmul_dx_q(const mti_kctx *k, void *dx, const void *dy, const void *wq,
                              mti_qformat qf, int n, int in, int out, mti_dtype dt,
                              int accumulate)
{
    mt_status s = mti_quant_mm_check(k->ctx, "matmul_dx_q", wq, qf, n, in, out, dt);
    if (s || n == 0 || in == 0) return s;
    /* as mti_cpu_matmul_bwd's dx: a tile of dx's columns reads those columns
     * of W, all its rows, packed with the tile width as leading dimension */
    mm_job j = {.p = mm_plan_for(n, in), .K = out, .a = dy, .c = dx, .accumulate = accumulate,
                .lda = out, .ldc = in, .ab_dt = dt, .c_dt = dt, .bq = wq,
                .qf = qf, .qn = (size_t)in * (size_t)out, .qld = in};
    /* a long reduction (the tied LM head's: the vocabulary) would make each
       thread's panel (tile width x out) large: narrower tiles keep it near
       MM_Q_PANEL bytes (each output is still one GEMM over all of out) */
    const size_t col = (size_t)out * dt_bytes(dt);
    if ((size_t)j.p.nb * col > MM_Q_PANEL) {
        int nb = (int)(MM_Q_PANEL / col) & ~15;
        j.p.nb = mini(j.p.nb, nb < 16 ? 16 : nb);
        j.p.tn = ceil_div(j.p.N, j.p.nb);
    }
    j.ldb = j.p.nb;
    j.t1 = j.p.tm * j.p.tn;
    return mm_run(k, &j);
}
