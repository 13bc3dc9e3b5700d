/*
 * test_sparse_mm.c - the sparse GEMMs (kernels/cpu/sparse_mm.c) against
 * sums in double and finite differences, and at their edges: row counts around the panel's 256 lanes, widths up to 1030,
 * rows and columns with nothing kept, nothing kept at all, N:M groups that
 * straddle rows, fp32, bf16 and fp16, every combination of outputs and
 * flags, against sums in double, with the same bits on 1, 2, 3 and 5
 * threads; and Adafactor and 4-bit AdamW on pruned weights: estimates
 * equal to the run (fused step too) and files taken by a trainer pruned
 * otherwise or not at all.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"
#include "sparse/sparse.h"
#include "ops/kernels.h"

/* One case of the sparse GEMMs: W (out, in), inputs in dt; p the keep
 * probability of each weight (the edge cases also prune every third row
 * and column 0), or with nm_m, n:m of each group by scores. */
typedef struct spmm_case {
    int n, in, out;
    double p;
    int nm_n, nm_m;
    mti_dtype dt;
} spmm_case;

/* A pruned W, its layout and description (host), and its dense fp32 form. */
typedef struct spmm_w {
    mti_sp_layout L;
    void *meta, *vals; /* vals in dt */
    float *dense;      /* what the values are in dt, zeros where pruned */
} spmm_w;

static float spmm_rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xffffff) / 16777216.0f - 0.5f;
}

static float spmm_round(float f, mti_dtype dt)
{
    if (dt == MTI_BF16) return mti_bf16_to_f32(mti_f32_to_bf16(f));
    if (dt == MTI_F16) return mti_f16_to_f32(mti_f32_to_f16(f));
    return f;
}

/* n values in dt (uniform in [-0.5, 0.5)), and their fp32 reading. */
static void *spmm_fill(size_t n, mti_dtype dt, uint64_t *seed, float *f32)
{
    void *v = check_alloc(n * 4 + 8);
    for (size_t i = 0; i < n; i++) {
        float f = spmm_round(spmm_rnd(seed), dt);
        f32[i] = f;
        if (dt == MTI_BF16) ((uint16_t *)v)[i] = mti_f32_to_bf16(f);
        else if (dt == MTI_F16) ((uint16_t *)v)[i] = mti_f32_to_f16(f);
        else ((float *)v)[i] = f;
    }
    return v;
}

static double spmm_get(const void *v, mti_dtype dt, size_t i)
{
    if (dt == MTI_BF16) return mti_bf16_to_f32(((const uint16_t *)v)[i]);
    if (dt == MTI_F16) return mti_f16_to_f32(((const uint16_t *)v)[i]);
    return ((const float *)v)[i];
}

static void spmm_w_make(const spmm_case *c, uint64_t seed, spmm_w *w)
{
    const size_t nw = (size_t)c->in * (size_t)c->out;
    uint64_t *keep;
    if (c->nm_m) {
        float *score = check_alloc(nw * 4);
        for (size_t e = 0; e < nw; e++) score[e] = spmm_rnd(&seed) + 1.0f;
        keep = check_alloc((mti_sp_words(nw) + 1) * 8);
        CHECK_OK(mti_sp_prune_nm(NULL, score, nw, c->nm_n, c->nm_m, keep));
    } else {
        keep = check_alloc((mti_sp_words(nw) + 1) * 8);
        for (size_t e = 0; e < nw; e++)
            if (spmm_rnd(&seed) + 0.5f < c->p) keep[e / 64] |= (uint64_t)1 << (e % 64);
    }
    const size_t nnz = mti_sp_kept(keep, nw);
    CHECK_OK(mti_sp_layout_of(NULL, c->nm_m ? MTI_SP_NM : MTI_SP_BITMAP, nw, nnz, c->nm_n, c->nm_m,
                              &w->L));
    w->meta = check_alloc(w->L.bytes + 8);
    CHECK_OK(mti_sp_encode(&w->L, keep, w->meta));
    float *kv = check_alloc(nnz * 4 + 4);
    w->vals = spmm_fill(nnz, c->dt, &seed, kv);
    w->dense = check_alloc(nw * 4 + 4);
    mti_sp_expand(&w->L, w->meta, kv, 0, 4, 0, nw, w->dense);
}

/* got (n values in dt) against ref within tol of each one's scale. */
static void spmm_close(const char *what, const spmm_case *c, const void *got, mti_dtype dt,
                       const double *ref, const double *scale, size_t n)
{
    const double tol = dt == MTI_BF16 ? 1.0 / 128 : 1e-5;
    for (size_t i = 0; i < n; i++) {
        const double g = spmm_get(got, dt, i);
        CHECK_MSG(fabs(g - ref[i]) <= tol * scale[i] + 1e-30, "%s (n %d in %d out %d p %g %d:%d dt %d)[%zu]: %.9g vs %.9g",
                  what, c->n, c->in, c->out, c->p, c->nm_n, c->nm_m, (int)c->dt, i, g, ref[i]);
    }
}

/* y = x W^T + b, dx = dy W (+ dx before), dW's kept elements and db (+
 * theirs before, or set) equal sums in double over the dense W to the
 * rounding of their dtype; the same bits on 1, 2 and 3 threads. */
TEST(sparse_matmul_ops_match_dense_sums)
{
    const spmm_case cases[] = {
        {37, 70, 33, 0.05, 0, 0, MTI_F32},   {300, 96, 48, 0.08, 0, 0, MTI_F32},
        {1, 40, 24, 0.5, 0, 0, MTI_F32},     {64, 130, 20, 0.0, 0, 0, MTI_F32},
        {16, 65, 17, 1.0, 0, 0, MTI_F32},    {260, 64, 40, 0.1, 0, 0, MTI_BF16},
        {50, 64, 20, 0.0, 1, 8, MTI_F32},    {40, 48, 30, 0.0, 2, 4, MTI_BF16},
        {0, 32, 16, 0.2, 0, 0, MTI_F32}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const spmm_case *c = &cases[ci];
        const size_t N = (size_t)c->n, I = (size_t)c->in, O = (size_t)c->out, es = c->dt == MTI_BF16 ? 2 : 4;
        uint64_t seed = 100 + ci;
        spmm_w w;
        spmm_w_make(c, seed, &w);
        float *xf = check_alloc(N * I * 4 + 4), *dyf = check_alloc(N * O * 4 + 4);
        float *bf = check_alloc(O * 4), *dx0f = check_alloc(N * I * 4 + 4);
        void *x = spmm_fill(N * I, c->dt, &seed, xf), *dy = spmm_fill(N * O, c->dt, &seed, dyf);
        void *b = spmm_fill(O, c->dt, &seed, bf), *dx0 = spmm_fill(N * I, c->dt, &seed, dx0f);
        const size_t nnz = w.L.nnz;
        float *dw0 = check_alloc(nnz * 4 + 4), *db0 = check_alloc(O * 4);
        for (size_t e = 0; e < nnz; e++) dw0[e] = spmm_rnd(&seed);
        for (size_t o = 0; o < O; o++) db0[o] = spmm_rnd(&seed);
        /* the sums in double, and the sums of their terms' magnitudes */
        double *y = check_alloc((N * O + 1) * 8), *ys = check_alloc((N * O + 1) * 8), *dx = check_alloc((N * I + 1) * 8),
               *dxs = check_alloc((N * I + 1) * 8), *dwd = check_alloc((I * O) * 8), *dws = check_alloc((I * O) * 8),
               *db = check_alloc((O) * 8), *dbs = check_alloc((O) * 8);
        for (size_t n = 0; n < N; n++)
            for (size_t o = 0; o < O; o++) {
                y[n * O + o] = bf[o], ys[n * O + o] = fabs(bf[o]);
                for (size_t i = 0; i < I; i++) {
                    const double wv = w.dense[o * I + i];
                    y[n * O + o] += wv * xf[n * I + i], ys[n * O + o] += fabs(wv * xf[n * I + i]);
                    dx[n * I + i] += wv * dyf[n * O + o], dxs[n * I + i] += fabs(wv * dyf[n * O + o]);
                    dwd[o * I + i] += (double)dyf[n * O + o] * xf[n * I + i];
                    dws[o * I + i] += fabs((double)dyf[n * O + o] * xf[n * I + i]);
                }
                db[o] += dyf[n * O + o], dbs[o] += fabs(dyf[n * O + o]);
            }
        for (size_t e = 0; e < N * I; e++) dx[e] += dx0f[e], dxs[e] += fabs(dx0f[e]);
        /* dW's kept elements: the expansion's order is the values' */
        double *dwk = check_alloc((nnz + 1) * 8), *dwks = check_alloc((nnz + 1) * 8), *dwk_add = check_alloc((nnz + 1) * 8);
        double *dwks_add = check_alloc((nnz + 1) * 8), *dbs_add = check_alloc((O) * 8);
        for (size_t e = 0, k = 0; e < I * O; e++)
            if (mti_sp_rank(&w.L, w.meta, e + 1) > k) dwk[k] = dwd[e], dwks[k] = dws[e] + 1e-30, k++;
        for (size_t k = 0; k < nnz; k++)
            dwk_add[k] = dwk[k] + dw0[k], dwks_add[k] = dwks[k] + fabs(dw0[k]);
        double *db_add = check_alloc((O) * 8);
        for (size_t o = 0; o < O; o++)
            db_add[o] = db[o] + db0[o], dbs[o] += 1e-30, dbs_add[o] = dbs[o] + fabs(db0[o]);
        unsigned char *first_y = NULL, *first_dx = NULL, *first_dw = NULL;
        for (int threads = 1; threads <= 3; threads++) {
            mt_context *ctx = check_cpu_context(threads);
            const mti_ops *op = mti_cpu_ops();
            const mti_kctx k = {ctx, ctx->dev};
            void *yo = check_alloc(N * O * es + 4), *dxo = check_alloc(N * I * es + 4);
            float *dwo = check_alloc(nnz * 4 + 4), *dbo = check_alloc(O * 4);
            CHECK_OKC(ctx, op->sparse_matmul_fwd(&k, yo, x, w.vals, w.meta, &w.L, b, c->n, c->in,
                                                 c->out, c->dt));
            spmm_close("y", c, yo, c->dt, y, ys, N * O);
            /* set: dW and db written, dx added to */
            memcpy(dxo, dx0, N * I * es);
            memset(dwo, 0x7f, nnz * 4), memset(dbo, 0x7f, O * 4);
            CHECK_OKC(ctx, op->sparse_matmul_bwd(&k, dxo, dwo, dbo, dy, x, w.vals, w.meta, &w.L, c->n,
                                                 c->in, c->out, c->dt,
                                                 MTI_BWD_ACC_DX | MTI_BWD_SET_DW));
            spmm_close("dx", c, dxo, c->dt, dx, dxs, N * I);
            spmm_close("dW", c, dwo, MTI_F32, dwk, dwks, nnz);
            spmm_close("db", c, dbo, MTI_F32, db, dbs, O);
            if (threads == 1) {
                first_y = check_alloc(N * O * es + 1), first_dx = check_alloc(N * I * es + 1);
                first_dw = check_alloc(nnz * 4 + 1);
                memcpy(first_y, yo, N * O * es), memcpy(first_dx, dxo, N * I * es);
                memcpy(first_dw, dwo, nnz * 4);
            } else {
                CHECK_MSG(memcmp(first_y, yo, N * O * es) == 0, "case %zu: y differs on %d threads", ci, threads);
                CHECK_MSG(memcmp(first_dx, dxo, N * I * es) == 0, "case %zu: dx on %d threads", ci, threads);
                CHECK_MSG(memcmp(first_dw, dwo, nnz * 4) == 0, "case %zu: dW on %d threads", ci, threads);
            }
            /* added: dW and db onto theirs; dx alone (written) */
            memcpy(dwo, dw0, nnz * 4), memcpy(dbo, db0, O * 4);
            CHECK_OKC(ctx, op->sparse_matmul_bwd(&k, dxo, dwo, dbo, dy, x, w.vals, w.meta, &w.L, c->n,
                                                 c->in, c->out, c->dt, 0));
            for (size_t e = 0; e < N * I; e++) dx[e] -= dx0f[e];
            spmm_close("dx written", c, dxo, c->dt, dx, dxs, N * I);
            for (size_t e = 0; e < N * I; e++) dx[e] += dx0f[e];
            spmm_close("dW added", c, dwo, MTI_F32, dwk_add, dwks_add, nnz);
            spmm_close("db added", c, dbo, MTI_F32, db_add, dbs_add, O);
            /* dW alone, db alone */
            CHECK_OKC(ctx, op->sparse_matmul_bwd(&k, NULL, dwo, NULL, dy, x, w.vals, w.meta, &w.L,
                                                 c->n, c->in, c->out, c->dt, MTI_BWD_SET_DW));
            spmm_close("dW alone", c, dwo, MTI_F32, dwk, dwks, nnz);
            CHECK_OKC(ctx, op->sparse_matmul_bwd(&k, NULL, NULL, dbo, dy, NULL, w.vals, w.meta, &w.L,
                                                 c->n, c->in, c->out, c->dt, MTI_BWD_SET_DW));
            spmm_close("db alone", c, dbo, MTI_F32, db, dbs, O);
            /* a W of another shape is refused */
            CHECK_ST(MT_ERR_INVALID_ARG, op->sparse_matmul_fwd(&k, yo, x, w.vals, w.meta, &w.L, b, c->n,
                                                               c->in + 1, c->out, c->dt));
            CHECK_OK(mt_context_destroy(ctx));
        }
    }
}

/* L = sum(y * r) in double, y the sparse forward of x through w (fp32). */
static double spmm_loss(mt_context *ctx, const spmm_w *w, const float *x, const float *r, float *y,
                        int N, int I, int O)
{
    const mti_kctx k = {ctx, ctx->dev};
    CHECK_OKC(ctx, mti_cpu_ops()->sparse_matmul_fwd(&k, y, x, w->vals, w->meta, &w->L, NULL, N, I,
                                                    O, MTI_F32));
    double l = 0;
    for (size_t j = 0; j < (size_t)N * (size_t)O; j++) l += (double)y[j] * r[j];
    return l;
}

/* Central differences of the loss in every step-th of v's n values (the
 * kept values or the inputs) against the backward's grad of them. */
static void spmm_fd(mt_context *ctx, const spmm_w *w, const float *x, const float *r, float *y,
                    int N, int I, int O, float *v, size_t n, size_t step, const float *grad,
                    const char *what)
{
    const float h = 1e-2f;
    for (size_t e = 0; e < n; e += step) {
        const float keep = v[e];
        v[e] = keep + h;
        const double lp = spmm_loss(ctx, w, x, r, y, N, I, O);
        v[e] = keep - h;
        const double lm = spmm_loss(ctx, w, x, r, y, N, I, O);
        v[e] = keep;
        const double fd = (lp - lm) / (2.0 * (double)h);
        CHECK_MSG(fabs(fd - grad[e]) <= 1e-3 * (1.0 + fabs(fd)), "%s[%zu]: %g vs %g", what, e,
                  grad[e], fd);
    }
}

/* The sparse backward is the forward's gradient: L = sum(y * r) in double
 * for a fixed r, central differences in the kept values and the inputs
 * against dW and dx (fp32). */
TEST(sparse_matmul_bwd_finite_differences)
{
    const spmm_case c = {9, 40, 12, 0.3, 0, 0, MTI_F32};
    const int N = 9, I = 40, O = 12;
    mt_context *ctx = check_cpu_context(2);
    const mti_kctx k = {ctx, ctx->dev};
    uint64_t seed = 77;
    spmm_w w;
    spmm_w_make(&c, seed, &w);
    float *xf = check_alloc((size_t)N * I * 4), *rf = check_alloc((size_t)N * O * 4);
    float *y = check_alloc((size_t)N * O * 4);
    float *x = spmm_fill((size_t)N * I, MTI_F32, &seed, xf);
    float *r = spmm_fill((size_t)N * O, MTI_F32, &seed, rf);
    float *dx = check_alloc((size_t)N * I * 4), *dw = check_alloc(w.L.nnz * 4);
    CHECK_OKC(ctx, mti_cpu_ops()->sparse_matmul_bwd(&k, dx, dw, NULL, r, x, w.vals, w.meta, &w.L,
                                                    N, I, O, MTI_F32, MTI_BWD_SET_DW));
    spmm_fd(ctx, &w, x, r, y, N, I, O, w.vals, w.L.nnz, 7, dw, "dW");
    spmm_fd(ctx, &w, x, r, y, N, I, O, x, (size_t)N * I, 11, dx, "dx");
    CHECK_OK(mt_context_destroy(ctx));
}

/* One case, on 1, 2, 3 and 5 threads. */
static void spmm_edge_case(const spmm_case *c, int ci)
{
    const size_t N = (size_t)c->n, I = (size_t)c->in, O = (size_t)c->out, D = I * O;
    const size_t es = c->dt == MTI_F32 ? 4 : 2;
    uint64_t seed = 1234 + (uint64_t)ci;
    uint64_t *keep = check_alloc((mti_sp_words(D) + 1) * 8);
    if (c->nm_m) {
        float *score = check_alloc(D * 4);
        for (size_t e = 0; e < D; e++) score[e] = spmm_rnd(&seed) + 1.0f;
        CHECK_OK(mti_sp_prune_nm(NULL, score, D, c->nm_n, c->nm_m, keep));
    } else {
        for (size_t e = 0; e < D; e++) {
            const size_t r = e / I, i = e % I;
            const bool k = (spmm_rnd(&seed) + 0.5f) < c->p && r % 3 != 1 && (i != 0 || I == 1);
            if (k) keep[e / 64] |= (uint64_t)1 << (e % 64);
        }
    }
    const size_t nnz = mti_sp_kept(keep, D);
    mti_sp_layout L;
    CHECK_OK(mti_sp_layout_of(NULL, c->nm_m ? MTI_SP_NM : MTI_SP_BITMAP, D, nnz, c->nm_n, c->nm_m, &L));
    void *meta = check_alloc(L.bytes + 16);
    CHECK_OK(mti_sp_encode(&L, keep, meta));
    float *kv = check_alloc(nnz * 4 + 8);
    void *vals = nnz ? spmm_fill(nnz, c->dt, &seed, kv) : NULL;
    float *dense = check_alloc(D * 4 + 8);
    mti_sp_expand(&L, meta, kv, 0, 4, 0, D, dense);
    float *xf = check_alloc(N * I * 4 + 8), *dyf = check_alloc(N * O * 4 + 8), *bf = check_alloc(O * 4 + 8);
    float *dx0f = check_alloc(N * I * 4 + 8);
    void *x = spmm_fill(N * I, c->dt, &seed, xf), *dy = spmm_fill(N * O, c->dt, &seed, dyf);
    void *b = spmm_fill(O, c->dt, &seed, bf), *dx0 = spmm_fill(N * I, c->dt, &seed, dx0f);
    double *y = check_alloc((N * O + 1) * 8), *dx = check_alloc((N * I + 1) * 8);
    double *dwd = check_alloc((D + 1) * 8), *db = check_alloc((O + 1) * 8);
    for (size_t n = 0; n < N; n++)
        for (size_t o = 0; o < O; o++) {
            y[n * O + o] = bf[o];
            for (size_t i = 0; i < I; i++) {
                const double wv = dense[o * I + i];
                y[n * O + o] += wv * xf[n * I + i];
                dx[n * I + i] += wv * dyf[n * O + o];
                dwd[o * I + i] += (double)dyf[n * O + o] * xf[n * I + i];
            }
            db[o] += dyf[n * O + o];
        }
    double *dwk = check_alloc((nnz + 1) * 8);
    for (size_t e = 0, k = 0; e < D; e++)
        if (keep[e / 64] >> (e % 64) & 1) dwk[k++] = dwd[e];
    const double tol = c->dt == MTI_F32 ? 1e-4 : c->dt == MTI_BF16 ? 3e-2 : 4e-3;
    unsigned char *fy = NULL, *fdx = NULL, *fdw = NULL;
    const int threads[] = {1, 2, 3, 5};
    for (int ti = 0; ti < 4; ti++) {
        mt_context *ctx = check_cpu_context(threads[ti]);
        const mti_ops *op = mti_cpu_ops();
        const mti_kctx k = {ctx, ctx->dev};
        void *yo = check_alloc(N * O * es + 8), *dxo = check_alloc(N * I * es + 8);
        float *dwo = check_alloc(nnz * 4 + 8), *dbo = check_alloc(O * 4 + 8);
        CHECK_OKC(ctx, op->sparse_matmul_fwd(&k, yo, x, vals, meta, &L, b, c->n, c->in, c->out, c->dt));
        for (size_t e = 0; e < N * O; e++)
            CHECK_MSG(fabs(spmm_get(yo, c->dt, e) - y[e]) <= tol * (1 + fabs(y[e])),
                      "case %d y[%zu] %g vs %g", ci, e, spmm_get(yo, c->dt, e), y[e]);
        {
            void *y2 = check_alloc(N * O * es + 8);
            CHECK_OKC(ctx, op->sparse_matmul_fwd(&k, y2, x, vals, meta, &L, NULL, c->n, c->in, c->out, c->dt));
            for (size_t e = 0; e < N * O; e++)
                CHECK_MSG(fabs(spmm_get(y2, c->dt, e) - (y[e] - bf[e % O])) <= tol * (1 + fabs(y[e])),
                          "case %d y nobias[%zu] %g vs %g", ci, e, spmm_get(y2, c->dt, e), y[e] - bf[e % O]);
        }
        memcpy(dxo, dx0, N * I * es);
        memset(dwo, 0x7f, nnz * 4), memset(dbo, 0x7f, O * 4);
        CHECK_OKC(ctx, op->sparse_matmul_bwd(&k, dxo, dwo, dbo, dy, x, vals, meta, &L, c->n, c->in,
                                             c->out, c->dt, MTI_BWD_ACC_DX | MTI_BWD_SET_DW));
        for (size_t e = 0; e < N * I; e++)
            CHECK_MSG(fabs(spmm_get(dxo, c->dt, e) - (dx[e] + dx0f[e])) <= tol * (1 + fabs(dx[e])),
                      "case %d dx[%zu] %g vs %g", ci, e, spmm_get(dxo, c->dt, e), dx[e] + dx0f[e]);
        for (size_t e = 0; e < nnz; e++)
            CHECK_MSG(fabs(dwo[e] - dwk[e]) <= 1e-4 * (1 + fabs(dwk[e])) * (1 + N / 64.0),
                      "case %d dw[%zu] %g vs %g", ci, e, dwo[e], dwk[e]);
        for (size_t o = 0; o < O; o++)
            CHECK_MSG(fabs(dbo[o] - db[o]) <= 1e-4 * (1 + fabs(db[o])) * (1 + N / 64.0),
                      "case %d db[%zu] %g vs %g", ci, o, dbo[o], db[o]);
        if (ti == 0) {
            fy = check_copy(yo, N * O * es + 1), fdx = check_copy(dxo, N * I * es + 1);
            fdw = check_copy(dwo, nnz * 4 + 1);
        } else {
            CHECK_MSG(!memcmp(fy, yo, N * O * es), "case %d y bits on %d threads", ci, threads[ti]);
            CHECK_MSG(!memcmp(fdx, dxo, N * I * es), "case %d dx bits on %d threads", ci, threads[ti]);
            CHECK_MSG(!memcmp(fdw, dwo, nnz * 4), "case %d dw bits on %d threads", ci, threads[ti]);
        }
        /* dx alone; db alone, add */
        memset(dxo, 0x7f, N * I * es);
        CHECK_OKC(ctx, op->sparse_matmul_bwd(&k, dxo, NULL, NULL, dy, NULL, vals, meta, &L, c->n,
                                             c->in, c->out, c->dt, 0));
        for (size_t e = 0; e < N * I; e++)
            CHECK_MSG(fabs(spmm_get(dxo, c->dt, e) - dx[e]) <= tol * (1 + fabs(dx[e])),
                      "case %d dx alone [%zu] %g vs %g", ci, e, spmm_get(dxo, c->dt, e), dx[e]);
        for (size_t o = 0; o < O; o++) dbo[o] = 1.0f;
        CHECK_OKC(ctx, op->sparse_matmul_bwd(&k, NULL, NULL, dbo, dy, NULL, vals, meta, &L, c->n,
                                             c->in, c->out, c->dt, 0));
        for (size_t o = 0; o < O; o++)
            CHECK_MSG(fabs(dbo[o] - 1.0 - db[o]) <= 1e-4 * (1 + fabs(db[o])) * (1 + N / 64.0),
                      "case %d db add[%zu] %g vs %g", ci, o, dbo[o], db[o] + 1);
        /* dw with dx, no db, add */
        for (size_t e = 0; e < nnz; e++) dwo[e] = 2.0f;
        CHECK_OKC(ctx, op->sparse_matmul_bwd(&k, dxo, dwo, NULL, dy, x, vals, meta, &L, c->n,
                                             c->in, c->out, c->dt, 0));
        for (size_t e = 0; e < nnz; e++)
            CHECK_MSG(fabs(dwo[e] - 2.0 - dwk[e]) <= 1e-4 * (3 + fabs(dwk[e])) * (1 + N / 64.0),
                      "case %d dw add [%zu] %g vs %g", ci, e, dwo[e], dwk[e] + 2);
        CHECK_OK(mt_context_destroy(ctx));
    }
}

/* Each case: y, dx (added to and alone), dW and db (set and added) against
 * sums in double, within the dtype's rounding; the same bits on 1, 2, 3
 * and 5 threads. */
TEST(sparse_matmul_edges)
{
    const spmm_case cases[] = {
        {257, 300, 70, 0.2, 0, 0, MTI_F32},  {513, 40, 600, 0.1, 0, 0, MTI_F32},
        {17, 520, 19, 0.3, 0, 0, MTI_F16},   {300, 33, 45, 0.3, 0, 0, MTI_F16},
        {31, 6, 2, 0, 2, 4, MTI_F32},        {31, 10, 6, 0, 3, 5, MTI_BF16},
        {31, 7, 16, 0, 1, 16, MTI_F16},      {20, 30, 40, 0.0, 0, 0, MTI_BF16},
        {20, 30, 40, 0.0, 0, 0, MTI_F32},    {0, 30, 40, 0.3, 0, 0, MTI_BF16},
        {1, 1, 1, 1.0, 0, 0, MTI_F32},       {1, 1, 300, 1.0, 0, 0, MTI_F16},
        {259, 1030, 3, 0.5, 0, 0, MTI_F32},  {5, 1, 37, 1.0, 0, 0, MTI_F32},
        {70, 37, 1, 1.0, 0, 0, MTI_BF16},    {16, 16, 16, 1.0, 0, 0, MTI_F16},
        {64, 64, 64, 0.5, 0, 0, MTI_F32},
    };
    for (int ci = 0; ci < (int)(sizeof cases / sizeof cases[0]); ci++) spmm_edge_case(&cases[ci], ci);
}

#include "memtrain.h"

/* Adafactor and 4-bit AdamW on pruned weights: the estimate equals the
 * run, at 95% (the sparse GEMMs) and 50%, fp32 and bf16, fused or not. */
TEST(sparse_estimate_adafactor_adamw4)
{
    const mt_optimizer_kind opts[] = {MT_OPT_ADAFACTOR, MT_OPT_ADAMW4};
    const double sps[] = {0.95, 0.5};
    for (int oi = 0; oi < 2; oi++)
        for (int si = 0; si < 2; si++)
            for (int prec = 0; prec < 2; prec++)
                for (int fused = 0; fused < 2; fused++) {
                    mt_context *ctx = check_cpu_context(2);
                    mt_model *m = check_small_gpt(ctx, 64, 8, 64, 3);
                    mt_trainer_config tc;
                    mt_trainer_config_init(&tc);
                    tc.max_batch = 4, tc.max_seq = 8;
                    tc.optimizer = opts[oi], tc.lr = 1e-2f;
                    tc.adafactor.beta1 = 0.9f, tc.min_8bit_size = 64;
                    tc.prune.method = MT_PRUNE_MAGNITUDE, tc.prune.sparsity = sps[si];
                    tc.precision = prec ? MT_PREC_BF16 : MT_PREC_FP32;
                    tc.master_weights = 1;
                    tc.fused_step = fused;
                    mt_estimate_report est;
                    CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
                    mt_trainer *t;
                    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
                    check_token_steps(ctx, t, 4, 8, 64, 0, 2);
                    char what[96];
                    snprintf(what, sizeof what, "opt %d s %g prec %d fused %d", (int)opts[oi], sps[si], prec, fused);
                    check_estimate_matches(ctx, &est, what);
                    mt_trainer_destroy(t);
                    CHECK_OK(mt_model_destroy(m));
                    CHECK_OK(mt_context_destroy(ctx));
                }
}

#include <unistd.h>

/* A file of a pruned run (Adafactor, gradual; 4-bit AdamW, one-shot)
 * loaded into a trainer whose model is dense, pruned at another count, or
 * pruned alike: the run resumes bit for bit. */
TEST(sparse_adafactor_file_adopts)
{
    for (int variant = 0; variant < 3; variant++) {
        char path[] = "/tmp/mt_spe_ckXXXXXX";
        int fd = mkstemp(path);
        CHECK(fd >= 0);
        close(fd);
        mt_context *ctx = check_cpu_context(2);
        mt_model *a = check_small_gpt(ctx, 64, 8, 32, 21), *b = check_small_gpt(ctx, 64, 8, 32, 21);
        mt_trainer_config tc;
        mt_trainer_config_init(&tc);
        tc.max_batch = 4, tc.max_seq = 8;
        tc.optimizer = variant == 2 ? MT_OPT_ADAMW4 : MT_OPT_ADAFACTOR, tc.lr = 1e-2f;
        tc.adafactor.beta1 = 0.9f, tc.min_8bit_size = 64;
        tc.prune.method = MT_PRUNE_MAGNITUDE, tc.prune.sparsity = 0.95;
        if (variant != 2) {
            tc.prune.schedule = MT_PRUNE_GRADUAL;
            tc.prune.start = 1, tc.prune.end = 3, tc.prune.every = 1;
        }
        const size_t n = mt_model_num_params(a);
        float *wa = check_alloc(n * 4), *wb = check_alloc(n * 4);
        mt_trainer *ta, *tb;
        CHECK_OKC(ctx, mt_trainer_create(a, &tc, &ta));
        check_token_steps(ctx, ta, 4, 8, 64, 0, 4);
        CHECK_OKC(ctx, mt_trainer_save(ta, path, NULL, 0));
        check_token_steps(ctx, ta, 4, 8, 64, 4, 8);
        CHECK_OK(mt_model_get_params(a, wa, n));
        mt_trainer_config tbc = tc;
        tbc.prune.method = MT_PRUNE_NONE;
        if (variant == 1) { /* b pruned before, at another count */
            mt_prune_config pc = {.method = MT_PRUNE_MAGNITUDE, .sparsity = 0.5};
            CHECK_OKC(ctx, mt_model_prune(b, &pc));
        }
        if (variant == 2) { /* b pruned alike (same nnz): masks' bits only */
            mt_prune_config pc = {.method = MT_PRUNE_MAGNITUDE, .sparsity = 0.95};
            CHECK_OKC(ctx, mt_model_prune(b, &pc));
        }
        CHECK_OKC(ctx, mt_trainer_create(b, &tbc, &tb));
        CHECK_OKC(ctx, mt_trainer_load(tb, path, NULL, 0, NULL));
        check_token_steps(ctx, tb, 4, 8, 64, 4, 8);
        CHECK_OK(mt_model_get_params(b, wb, n));
        CHECK_MSG(memcmp(wa, wb, n * 4) == 0, "variant %d: the resumed run differs", variant);
        mt_trainer_destroy(tb);
        mt_trainer_destroy(ta);
        unlink(path);
        CHECK_OK(mt_model_destroy(b));
        CHECK_OK(mt_model_destroy(a));
        CHECK_OK(mt_context_destroy(ctx));
    }
}
