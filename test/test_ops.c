/*
 * test_ops.c - the op table's conformance suite.
 *
 * Every case runs against every table the test can open: the CPU table
 * always, and the CUDA table when MT_TEST_GPU=1 and a real driver and GPU
 * are there (`make test-gpu`). The checks:
 *   - every backward against central finite differences of the same op's
 *     fp32 forward (the loss is sum(out * r) for a fixed random r);
 *   - fp16 and bf16 against fp32 on the same (rounded) inputs, forward and
 *     backward, within the tolerances below;
 *   - the CPU table bit-identical with 1 and 2 threads;
 *   - another table against the CPU table, per dtype, within the tolerances.
 * Golden vectors from PyTorch are checked in test_golden.c.
 *
 * Tolerances: |got - want| <= atol + rtol * |want|, per output dtype.
 *   fp32 (rtol 1e-4, atol 1e-5): fp32 results of different summation orders
 *     (blocked GEMM, per-thread partial sums) differ by a few ulps times the
 *     reduction length's square root;
 *   fp16 (rtol 2e-3, atol 2e-3): one rounding of the output to fp16 is half an
 *     ulp (2^-11 = 4.9e-4 relative), plus the inputs' and intermediates'
 *     roundings that the fp32 run does not have;
 *   bf16 (rtol 1.6e-2, atol 1.6e-2): the same with bf16's 8-bit mantissa
 *     (2^-8 = 3.9e-3 relative per rounding).
 * Finite differences (fp32 forward, step 1e-2 on inputs of magnitude ~1):
 *   rtol 2e-2, atol 2e-3, the truncation and fp32 cancellation error.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "ops/kernels.h"
#include "quant/quant.h"

typedef struct tol {
    double rtol, atol;
} tol;

static tol tol_of(mti_dtype dt)
{
    switch (dt) {
    case MTI_F16: return (tol){2e-3, 2e-3};
    case MTI_BF16: return (tol){1.6e-2, 1.6e-2};
    default: return (tol){1e-4, 1e-5};
    }
}

static const tol FD_TOL = {2e-2, 2e-3};
static const mti_dtype DTYPES[3] = {MTI_F32, MTI_F16, MTI_BF16};
static const char *dt_name(mti_dtype dt) { return dt == MTI_F16 ? "fp16" : dt == MTI_BF16 ? "bf16" : "fp32"; }

/* ---- tables and device buffers ---- */

#define MAX_BUFS 64

typedef struct tab {
    const char *name;
    mt_context *ctx;
    const mti_ops *ops;
    mti_kctx k;
    mt_block bufs[MAX_BUFS];
    int n_bufs;
} tab;

static tab tabs[2];
static int n_tabs;

static mt_context *open_ctx(mt_device_kind dev, int threads)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = dev;
    cfg.threads = threads;
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    return ctx;
}

static void open_tables(void)
{
    n_tabs = 0;
    mt_context *ctx = open_ctx(MT_DEVICE_CPU, 2);
    tabs[n_tabs++] = (tab){.name = "cpu", .ctx = ctx, .ops = mti_cpu_ops(), .k = {ctx, ctx->dev}};
    const char *gpu = getenv("MT_TEST_GPU");
    if (gpu && !strcmp(gpu, "1")) {
        mt_context *g = open_ctx(MT_DEVICE_CUDA, 0);
        CHECK_MSG(g && mt_context_device(g) == MT_DEVICE_CUDA, "MT_TEST_GPU=1 but no CUDA context");
        tab *t = &tabs[n_tabs++];
        *t = (tab){.name = "cuda", .ctx = g};
        CHECK_OK(mti_cuda_ops(g->dev, &t->ops));
        t->k = (mti_kctx){g, g->dev};
    }
}

static void free_bufs(tab *t)
{
    for (int i = 0; i < t->n_bufs; i++) CHECK_OK(mt_context_free(t->ctx, &t->bufs[i]));
    t->n_bufs = 0;
}

static void close_tables(void)
{
    for (int i = 0; i < n_tabs; i++) {
        free_bufs(&tabs[i]);
        CHECK_OK(mt_context_destroy(tabs[i].ctx));
    }
    n_tabs = 0;
}

/* A device buffer of `bytes`, filled from host (or zeroed when host is NULL). */
static void *dev_buf(tab *t, const void *host, size_t bytes)
{
    CHECK(t->n_bufs < MAX_BUFS);
    mt_alloc_request r = {.bytes = bytes ? bytes : 4, .mem_class = MT_MEM_IO,
                          .lifetime = MT_LIFE_PERSISTENT};
    mt_block *b = &t->bufs[t->n_bufs++];
    CHECK_OKC(t->ctx, mt_context_alloc(t->ctx, &r, b));
    mti_device *d = t->ctx->dev;
    if (host) CHECK_OK(d->copy_h2d(d, b->ptr, host, bytes));
    else CHECK_OK(d->memset8(d, b->ptr, 0, r.bytes));
    return b->ptr;
}

static void dev_get(tab *t, void *host, const void *dev, size_t bytes)
{
    mti_device *d = t->ctx->dev;
    CHECK_OK(d->copy_d2h(d, host, dev, bytes));
    CHECK_OK(d->sync(d));
}

/* ---- host-side dtype helpers ---- */

static size_t dsize(mti_dtype dt) { return dt == MTI_F32 || dt == MTI_I32 ? 4 : 2; }

static float round_to(float v, mti_dtype dt)
{
    if (dt == MTI_F16) return mti_f16_to_f32(mti_f32_to_f16(v));
    if (dt == MTI_BF16) return mti_bf16_to_f32(mti_f32_to_bf16(v));
    return v;
}

/* host fp32 values -> a host buffer in dt (caller frees) */
static void *pack(const float *x, size_t n, mti_dtype dt)
{
    void *p = malloc(n * dsize(dt) + 4);
    for (size_t i = 0; i < n; i++) {
        if (dt == MTI_F32) ((float *)p)[i] = x[i];
        else if (dt == MTI_F16) ((uint16_t *)p)[i] = mti_f32_to_f16(x[i]);
        else ((uint16_t *)p)[i] = mti_f32_to_bf16(x[i]);
    }
    return p;
}

static void unpack(float *dst, const void *p, size_t n, mti_dtype dt)
{
    for (size_t i = 0; i < n; i++) {
        if (dt == MTI_F32) dst[i] = ((const float *)p)[i];
        else if (dt == MTI_F16) dst[i] = mti_f16_to_f32(((const uint16_t *)p)[i]);
        else dst[i] = mti_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

/* upload fp32 values as dt */
static void *put(tab *t, const float *x, size_t n, mti_dtype dt)
{
    void *h = pack(x, n, dt);
    void *d = dev_buf(t, h, n * dsize(dt));
    free(h);
    return d;
}

static void get(tab *t, float *dst, const void *dev, size_t n, mti_dtype dt)
{
    void *h = malloc(n * dsize(dt) + 4);
    dev_get(t, h, dev, n * dsize(dt));
    unpack(dst, h, n, dt);
    free(h);
}

static uint64_t rng = 0x1234567;
static float urand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / 8388608.0f - 1.0f;
}

static float *randv(size_t n, float scale)
{
    float *v = malloc((n ? n : 1) * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = urand() * scale;
    return v;
}

static float *rounded(const float *x, size_t n, mti_dtype dt)
{
    float *v = malloc((n ? n : 1) * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = round_to(x[i], dt);
    return v;
}

/* Every element within tol; says where the worst one is. */
static void expect_close(const char *what, const float *got, const float *want, size_t n, tol t)
{
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]) - (t.atol + t.rtol * fabs((double)want[i]));
        if (!(err <= worst) || isnan(got[i]) != isnan(want[i])) {
            worst = isnan(err) ? INFINITY : err;
            at = i;
        }
    }
    CHECK_MSG(worst <= 0, "%s: element %zu is %.8g, expected %.8g (rtol %g atol %g)", what, at,
              got[at], want[at], t.rtol, t.atol);
}

static double dot(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* Central differences of a scalar loss over `samples` elements of x,
 * against the analytic gradient g of the same elements. */
typedef double (*loss_fn)(void *arg);

static void fd_check(const char *what, float *x, size_t n, const float *g, loss_fn f, void *arg,
                     int samples)
{
    for (int s = 0; s < samples; s++) {
        size_t i = n <= (size_t)samples ? (size_t)s % n : (size_t)((urand() + 1.0f) * 0.5f * (float)n) % n;
        const float e = 1e-2f, keep = x[i];
        x[i] = keep + e;
        double lp = f(arg);
        x[i] = keep - e;
        double lm = f(arg);
        x[i] = keep;
        float fd = (float)((lp - lm) / (2.0 * e));
        char w[128];
        snprintf(w, sizeof w, "%s (element %zu) vs finite differences", what, i);
        expect_close(w, &g[i], &fd, 1, FD_TOL);
    }
}

/* Runs the CPU table with 1 thread: the caller compares with its 2-thread run. */
static void with_one_thread(void (*body)(void *), void *arg)
{
    tabs[0].ctx->threads = 1;
    body(arg);
    tabs[0].ctx->threads = 2;
}

static void expect_same_bits(const char *what, const float *a, const float *b, size_t n)
{
    CHECK_MSG(memcmp(a, b, n * sizeof *a) == 0, "%s: 1 and 2 threads differ", what);
}

/* ---- matmul ---- */

typedef struct mm_case {
    int n, in, out;
} mm_case;

/* y, and the backward's dx, dw, db for upstream gradient dy, on table t in dt */
static void run_matmul(tab *t, mti_dtype dt, const mm_case *c, const float *x, const float *w,
                       const float *b, const float *dy, float *y, float *dx, float *dw, float *db)
{
    size_t nx = (size_t)c->n * c->in, nw = (size_t)c->out * c->in, ny = (size_t)c->n * c->out;
    void *X = put(t, x, nx, dt), *W = put(t, w, nw, dt), *B = put(t, b, (size_t)c->out, dt);
    void *Y = dev_buf(t, NULL, ny * dsize(dt));
    CHECK_OKC(t->ctx, t->ops->matmul_fwd(&t->k, Y, X, W, B, c->n, c->in, c->out, dt));
    get(t, y, Y, ny, dt);
    if (dy) {
        void *DY = put(t, dy, ny, dt), *DX = dev_buf(t, NULL, nx * dsize(dt));
        float *DW = dev_buf(t, NULL, nw * 4), *DB = dev_buf(t, NULL, (size_t)c->out * 4);
        CHECK_OKC(t->ctx, t->ops->matmul_bwd(&t->k, DX, DW, DB, DY, X, W, c->n, c->in, c->out, dt, 0));
        get(t, dx, DX, nx, dt);
        get(t, dw, DW, nw, MTI_F32);
        get(t, db, DB, (size_t)c->out, MTI_F32);
    }
    free_bufs(t);
}

TEST(ops_matmul)
{
    open_tables();
    static const mm_case cases[] = {{7, 5, 3}, {33, 70, 129}, {64, 300, 96}, {300, 64, 40}};
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const mm_case *c = &cases[ci];
        size_t nx = (size_t)c->n * c->in, nw = (size_t)c->out * c->in, ny = (size_t)c->n * c->out;
        float *x = randv(nx, 1), *w = randv(nw, 0.3f), *b = randv((size_t)c->out, 0.5f),
              *dy = randv(ny, 1);
        float *y32 = malloc(ny * 4), *dx32 = malloc(nx * 4), *dw32 = malloc(nw * 4),
              *db32 = malloc((size_t)c->out * 4);
        /* finite differences of the fp32 forward on the CPU: L = sum(y * dy) */
        tab *cpu = &tabs[0];
        run_matmul(cpu, MTI_F32, c, x, w, b, dy, y32, dx32, dw32, db32);
        float *yp = malloc(ny * 4);
        for (int s = 0; s < 12; s++) {
            size_t i = (size_t)(rng % nx), j = (size_t)(rng >> 20) % nw;
            float e = 1e-2f, keep = x[i];
            x[i] = keep + e;
            run_matmul(cpu, MTI_F32, c, x, w, b, NULL, yp, NULL, NULL, NULL);
            double lp = dot(yp, dy, ny);
            x[i] = keep - e;
            run_matmul(cpu, MTI_F32, c, x, w, b, NULL, yp, NULL, NULL, NULL);
            x[i] = keep;
            float fd = (float)((lp - dot(yp, dy, ny)) / (2 * e));
            expect_close("matmul dx vs finite differences", &dx32[i], &fd, 1, FD_TOL);
            keep = w[j];
            w[j] = keep + e;
            run_matmul(cpu, MTI_F32, c, x, w, b, NULL, yp, NULL, NULL, NULL);
            lp = dot(yp, dy, ny);
            w[j] = keep - e;
            run_matmul(cpu, MTI_F32, c, x, w, b, NULL, yp, NULL, NULL, NULL);
            w[j] = keep;
            fd = (float)((lp - dot(yp, dy, ny)) / (2 * e));
            expect_close("matmul dw vs finite differences", &dw32[j], &fd, 1, FD_TOL);
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        }
        /* db is the column sum of dy */
        for (int o = 0; o < c->out; o++) {
            double sdy = 0;
            for (int r = 0; r < c->n; r++) sdy += dy[(size_t)r * c->out + o];
            float want = (float)sdy;
            expect_close("matmul db = column sums of dy", &db32[o], &want, 1, tol_of(MTI_F32));
        }
        /* every dtype on every table against fp32 on the CPU with the same rounded inputs */
        for (int d = 0; d < 3; d++) {
            mti_dtype dt = DTYPES[d];
            float *xr = rounded(x, nx, dt), *wr = rounded(w, nw, dt), *br = rounded(b, (size_t)c->out, dt),
                  *dyr = rounded(dy, ny, dt);
            float *ry = malloc(ny * 4), *rdx = malloc(nx * 4), *rdw = malloc(nw * 4), *rdb = malloc((size_t)c->out * 4);
            run_matmul(cpu, MTI_F32, c, xr, wr, br, dyr, ry, rdx, rdw, rdb);
            for (int ti = 0; ti < n_tabs; ti++) {
                float *gy = malloc(ny * 4), *gdx = malloc(nx * 4), *gdw = malloc(nw * 4), *gdb = malloc((size_t)c->out * 4);
                run_matmul(&tabs[ti], dt, c, xr, wr, br, dyr, gy, gdx, gdw, gdb);
                char what[96];
                snprintf(what, sizeof what, "matmul %s %s y", tabs[ti].name, dt_name(dt));
                /* the output is a sum of `in` products: its rounding scales with sqrt(in) */
                tol ty = tol_of(dt);
                expect_close(what, gy, ry, ny, ty);
                snprintf(what, sizeof what, "matmul %s %s dx", tabs[ti].name, dt_name(dt));
                expect_close(what, gdx, rdx, nx, ty);
                snprintf(what, sizeof what, "matmul %s %s dw", tabs[ti].name, dt_name(dt));
                expect_close(what, gdw, rdw, nw, tol_of(MTI_F32));
                snprintf(what, sizeof what, "matmul %s %s db", tabs[ti].name, dt_name(dt));
                expect_close(what, gdb, rdb, (size_t)c->out, tol_of(MTI_F32));
                if (ti == 0) { /* 1 and 2 threads: the same bits */
                    float *oy = malloc(ny * 4), *odx = malloc(nx * 4), *odw = malloc(nw * 4),
                          *odb = malloc((size_t)c->out * 4);
                    tabs[0].ctx->threads = 1;
                    run_matmul(&tabs[0], dt, c, xr, wr, br, dyr, oy, odx, odw, odb);
                    tabs[0].ctx->threads = 2;
                    expect_same_bits("matmul y", oy, gy, ny);
                    expect_same_bits("matmul dx", odx, gdx, nx);
                    expect_same_bits("matmul dw", odw, gdw, nw);
                    expect_same_bits("matmul db", odb, gdb, (size_t)c->out);
                    free(oy), free(odx), free(odw), free(odb);
                }
                free(gy), free(gdx), free(gdw), free(gdb);
            }
            free(xr), free(wr), free(br), free(dyr), free(ry), free(rdx), free(rdw), free(rdb);
        }
        /* accumulation, and the optional arguments, on every table in every dtype:
           dx += dy W, dW and db added to what they held; no bias; NULLs skipped */
        for (int d = 0; d < 3; d++) {
            mti_dtype dt = DTYPES[d];
            float *xr = rounded(x, nx, dt), *wr = rounded(w, nw, dt), *dyr = rounded(dy, ny, dt);
            float *pdx = randv(nx, 1), *pdw = randv(nw, 1), *pdb = randv((size_t)c->out, 1);
            float *pdxr = rounded(pdx, nx, dt);
            float *ry = malloc(ny * 4), *rdx = malloc(nx * 4), *rdw = malloc(nw * 4), *rdb = malloc((size_t)c->out * 4);
            float *zero = calloc((size_t)c->out, 4);
            run_matmul(cpu, MTI_F32, c, xr, wr, zero, dyr, ry, rdx, rdw, rdb);
            for (size_t i = 0; i < nx; i++) rdx[i] = round_to(rdx[i] + pdxr[i], dt);
            for (size_t i = 0; i < nw; i++) rdw[i] += pdw[i];
            for (int o = 0; o < c->out; o++) rdb[o] += pdb[o];
            for (int ti = 0; ti < n_tabs; ti++) {
                tab *t = &tabs[ti];
                void *X = put(t, xr, nx, dt), *W = put(t, wr, nw, dt), *DY = put(t, dyr, ny, dt);
                void *Y = dev_buf(t, NULL, ny * dsize(dt)), *DX = put(t, pdxr, nx, dt);
                float *DW = put(t, pdw, nw, MTI_F32), *DB = put(t, pdb, (size_t)c->out, MTI_F32);
                float *gy = malloc(ny * 4), *gdx = malloc(nx * 4), *gdw = malloc(nw * 4), *gdb = malloc((size_t)c->out * 4);
                CHECK_OKC(t->ctx, t->ops->matmul_fwd(&t->k, Y, X, W, NULL, c->n, c->in, c->out, dt));
                CHECK_OKC(t->ctx, t->ops->matmul_bwd(&t->k, DX, DW, DB, DY, X, W, c->n, c->in, c->out, dt, 1));
                get(t, gy, Y, ny, dt);
                get(t, gdx, DX, nx, dt);
                get(t, gdw, DW, nw, MTI_F32);
                get(t, gdb, DB, (size_t)c->out, MTI_F32);
                char what[96];
                snprintf(what, sizeof what, "matmul %s %s without bias", t->name, dt_name(dt));
                expect_close(what, gy, ry, ny, tol_of(dt));
                snprintf(what, sizeof what, "matmul %s %s accumulated", t->name, dt_name(dt));
                expect_close(what, gdx, rdx, nx, (tol){2 * tol_of(dt).rtol, 2 * tol_of(dt).atol});
                expect_close(what, gdw, rdw, nw, tol_of(MTI_F32));
                expect_close(what, gdb, rdb, (size_t)c->out, tol_of(MTI_F32));
                /* NULL outputs are skipped: only dW changes here */
                CHECK_OKC(t->ctx, t->ops->matmul_bwd(&t->k, NULL, DW, NULL, DY, X, W, c->n, c->in, c->out, dt, 0));
                float *g2 = malloc((size_t)c->out * 4);
                get(t, g2, DB, (size_t)c->out, MTI_F32);
                CHECK_MSG(memcmp(g2, gdb, (size_t)c->out * 4) == 0, "%s: db changed though NULL", what);
                free(g2);
                /* MTI_BWD_SET_DW writes dW and db over what they held: the bits of
                   adding onto zeros; with no rows, zeros */
                float *zw = calloc(nw, 4);
                float *ZW = put(t, zw, nw, MTI_F32), *ZB = put(t, zero, (size_t)c->out, MTI_F32);
                CHECK_OKC(t->ctx, t->ops->matmul_bwd(&t->k, NULL, ZW, ZB, DY, X, W, c->n, c->in, c->out, dt, 0));
                CHECK_OKC(t->ctx, t->ops->matmul_bwd(&t->k, NULL, DW, DB, DY, X, W, c->n, c->in, c->out, dt,
                                                     MTI_BWD_SET_DW));
                float *sw = malloc(nw * 4), *sb = malloc((size_t)c->out * 4);
                get(t, gdw, ZW, nw, MTI_F32);
                get(t, gdb, ZB, (size_t)c->out, MTI_F32);
                get(t, sw, DW, nw, MTI_F32);
                get(t, sb, DB, (size_t)c->out, MTI_F32);
                snprintf(what, sizeof what, "matmul %s %s dW written", t->name, dt_name(dt));
                expect_same_bits(what, sw, gdw, nw);
                expect_same_bits(what, sb, gdb, (size_t)c->out);
                CHECK_OKC(t->ctx, t->ops->matmul_bwd(&t->k, NULL, DW, DB, DY, X, W, 0, c->in, c->out, dt,
                                                     MTI_BWD_SET_DW));
                get(t, sw, DW, nw, MTI_F32);
                get(t, sb, DB, (size_t)c->out, MTI_F32);
                expect_same_bits("matmul dW written from no rows", sw, zw, nw);
                expect_same_bits("matmul db written from no rows", sb, zero, (size_t)c->out);
                free(zw), free(sw), free(sb);
                free_bufs(t);
                free(gy), free(gdx), free(gdw), free(gdb);
            }
            free(xr), free(wr), free(dyr), free(pdx), free(pdw), free(pdb), free(pdxr), free(ry), free(rdx),
                free(rdw), free(rdb), free(zero);
        }
        free(x), free(w), free(b), free(dy), free(y32), free(dx32), free(dw32), free(db32), free(yp);
    }
    close_tables();
}

/* ---- matmul through a quantized frozen weight ---- */

/* y = x deq(W)^T + b and dx = (or +=) dy deq(W) with W quantized (int8,
 * NF4) on every table, fp32 and bf16, against the CPU table within the
 * dtype's tolerance and against the same table's dense matmul on the
 * dequantized weight (the CPU: bit for bit, test_quant.c; CUDA, whose
 * tiles are GEMMs of other shapes: within the tolerance). The second shape
 * takes several tiles of rows (forward) and of columns (dx) on CUDA. */
TEST(ops_matmul_quantized)
{
    open_tables();
    static const mm_case cases[] = {{33, 200, 136}, {16, 1024, 2056}};
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const mm_case *c = &cases[ci];
        const size_t nx = (size_t)c->n * c->in, nw = (size_t)c->out * c->in,
                     ny = (size_t)c->n * c->out;
        float *x = randv(nx, 1), *w = randv(nw, 0.3f), *b = randv((size_t)c->out, 0.5f),
              *dy = randv(ny, 1), *wd = malloc(nw * 4);
        for (int f = MTI_QF_INT8; f <= MTI_QF_NF4; f++) {
            const size_t qb = mti_quant_bytes((mti_qformat)f, nw);
            void *q = malloc(qb);
            CHECK_OK(mti_quantize(NULL, (mti_qformat)f, w, nw, q));
            CHECK_OK(mti_dequantize(NULL, (mti_qformat)f, q, nw, 0, nw, wd, MTI_F32));
            for (int d = 0; d < 3; d += 2) {
                const mti_dtype dt = DTYPES[d];
                float *want[3] = {malloc(ny * 4), malloc(nx * 4), malloc(nx * 4)};
                for (int ti = 0; ti < n_tabs; ti++) {
                    tab *t = &tabs[ti];
                    float *got[3] = {malloc(ny * 4), malloc(nx * 4), malloc(nx * 4)};
                    float *dense[2] = {malloc(ny * 4), malloc(nx * 4)};
                    void *X = put(t, x, nx, dt), *B = put(t, b, (size_t)c->out, dt);
                    void *DY = put(t, dy, ny, dt), *Q = dev_buf(t, q, qb);
                    void *W = put(t, wd, nw, dt); /* rounded as mti_dequantize rounds */
                    void *Y = dev_buf(t, NULL, ny * dsize(dt)), *DX = put(t, x, nx, dt);
                    CHECK_OKC(t->ctx, t->ops->matmul_fwd_q(&t->k, Y, X, Q, f, B, c->n, c->in,
                                                           c->out, dt));
                    get(t, got[0], Y, ny, dt);
                    CHECK_OKC(t->ctx, t->ops->matmul_dx_q(&t->k, DX, DY, Q, f, c->n, c->in,
                                                          c->out, dt, 1));
                    get(t, got[2], DX, nx, dt);
                    CHECK_OKC(t->ctx, t->ops->matmul_dx_q(&t->k, DX, DY, Q, f, c->n, c->in,
                                                          c->out, dt, 0));
                    get(t, got[1], DX, nx, dt);
                    CHECK_OKC(t->ctx, t->ops->matmul_fwd(&t->k, Y, X, W, B, c->n, c->in, c->out,
                                                         dt));
                    get(t, dense[0], Y, ny, dt);
                    CHECK_OKC(t->ctx, t->ops->matmul_bwd(&t->k, DX, NULL, NULL, DY, X, W, c->n,
                                                         c->in, c->out, dt, 0));
                    get(t, dense[1], DX, nx, dt);
                    CHECK_ST(MT_ERR_UNSUPPORTED, t->ops->matmul_fwd_q(&t->k, Y, X, Q, f, NULL, c->n,
                                                                      c->in, c->out, MTI_F16));
                    free_bufs(t);
                    char what[96];
                    snprintf(what, sizeof what, "%s matmul_q %s %s (%d,%d,%d)", t->name,
                             mti_quant_name((mti_qformat)f), dt_name(dt), c->n, c->in, c->out);
                    if (ti == 0)
                        for (int o = 0; o < 3; o++) memcpy(want[o], got[o], (o ? nx : ny) * 4);
                    expect_close(what, got[0], want[0], ny, tol_of(dt));
                    expect_close(what, got[1], want[1], nx, tol_of(dt));
                    expect_close(what, got[2], want[2], nx, tol_of(dt));
                    expect_close(what, got[0], dense[0], ny, tol_of(dt));
                    expect_close(what, got[1], dense[1], nx, tol_of(dt));
                    for (int o = 0; o < 3; o++) free(got[o]);
                    free(dense[0]), free(dense[1]);
                }
                for (int o = 0; o < 3; o++) free(want[o]);
            }
            free(q);
        }
        free(x), free(w), free(b), free(dy), free(wd);
    }
    close_tables();
}

/* ---- embedding from a quantized token table ---- */

/* embedding_fwd_q on every table (CPU; CUDA with MT_TEST_GPU=1), int8 and
 * NF4, fp32 and bf16, with and without positions: the same bits as the
 * table's embedding_fwd on the dequantized table (mti_dequantize rounds
 * it to dt), and as the CPU table's. The second shape's rows are longer
 * than the CPU's staging chunk and the table ends in a partial block. */
TEST(ops_embedding_quantized)
{
    open_tables();
    static const int shapes[2][4] = {{3, 11, 24, 50}, {2, 3, 1500, 7}}; /* B, T, C, V */
    for (int si = 0; si < 2; si++) {
        const int B = shapes[si][0], T = shapes[si][1], C = shapes[si][2], V = shapes[si][3];
        const size_t nw = (size_t)V * C, no = (size_t)B * T * C, np = (size_t)T * C;
        float *wte = randv(nw, 0.5f), *wpe = randv(np, 1), *wd = malloc(nw * 4);
        int32_t tok[64];
        for (int i = 0; i < B * T; i++) tok[i] = (int32_t)((unsigned)(i * 37 + 5) % (unsigned)V);
        tok[0] = V - 1; /* the last row, in the partial block */
        for (int f = MTI_QF_INT8; f <= MTI_QF_NF4; f++) {
            const size_t qb = mti_quant_bytes((mti_qformat)f, nw);
            void *q = malloc(qb);
            CHECK_OK(mti_quantize(NULL, (mti_qformat)f, wte, nw, q));
            for (int d = 0; d < 3; d += 2) {
                const mti_dtype dt = DTYPES[d];
                CHECK_OK(mti_dequantize(NULL, (mti_qformat)f, q, nw, 0, nw, wd, MTI_F32));
                float *want[2] = {malloc(no * 4), malloc(no * 4)};
                for (int ti = 0; ti < n_tabs; ti++) {
                    tab *t = &tabs[ti];
                    void *Q = dev_buf(t, q, qb), *W = put(t, wd, nw, dt), *P = put(t, wpe, np, dt);
                    int32_t *K = dev_buf(t, tok, (size_t)B * T * 4);
                    void *O = dev_buf(t, NULL, no * dsize(dt));
                    float *got = malloc(no * 4), *dense = malloc(no * 4);
                    for (int pos = 0; pos < 2; pos++) {
                        char what[96];
                        snprintf(what, sizeof what, "%s embedding_fwd_q %s %s C %d%s", t->name,
                                 mti_quant_name((mti_qformat)f), dt_name(dt), C,
                                 pos ? "" : " (no positions)");
                        CHECK_OKC(t->ctx, t->ops->embedding_fwd_q(&t->k, O, K, Q, f, V,
                                                                  pos ? P : NULL, B, T, C, dt));
                        get(t, got, O, no, dt);
                        CHECK_OKC(t->ctx, t->ops->embedding_fwd(&t->k, O, K, W, pos ? P : NULL, B,
                                                                T, C, dt));
                        get(t, dense, O, no, dt);
                        CHECK_MSG(memcmp(got, dense, no * 4) == 0, "%s: not embedding_fwd's bits",
                                  what);
                        if (ti == 0) memcpy(want[pos], got, no * 4);
                        CHECK_MSG(memcmp(got, want[pos], no * 4) == 0, "%s: not the CPU's bits",
                                  what);
                    }
                    CHECK_ST(MT_ERR_UNSUPPORTED, t->ops->embedding_fwd_q(&t->k, O, K, Q, f, V, P, B,
                                                                         T, C, MTI_F16));
                    CHECK_ST(MT_ERR_INVALID_ARG, t->ops->embedding_fwd_q(&t->k, O, K, Q, 5, V, P, B,
                                                                         T, C, dt));
                    free_bufs(t);
                    free(got), free(dense);
                }
                free(want[0]), free(want[1]);
            }
            free(q);
        }
        free(wte), free(wpe), free(wd);
    }
    close_tables();
}

/* ---- dequantize ---- */

/* dequantize on every table, int8 and NF4, fp32 and bf16: ranges whole,
 * inside a block, across blocks and through the partial last block, with
 * lib/quant/quant.c's bits; and what it refuses. */
TEST(ops_dequantize)
{
    open_tables();
    const size_t n = 3 * MTI_QF_STAT_BLOCK * MTI_QF_BLOCK + 37; /* three stat blocks, and some */
    const size_t ranges[][2] = {{0, n}, {5, 40}, {60, 200}, {n - 100, 100}}; /* at, len */
    float *w = randv(n, 0.5f);
    for (mti_qformat f = MTI_QF_INT8; f <= MTI_QF_NF4; f++) {
        const size_t qb = mti_quant_bytes(f, n);
        void *q = malloc(qb);
        CHECK_OK(mti_quantize(NULL, f, w, n, q));
        for (int d = 0; d < 3; d += 2) {
            const mti_dtype dt = DTYPES[d];
            for (size_t r = 0; r < sizeof ranges / sizeof *ranges; r++) {
                const size_t at = ranges[r][0], len = ranges[r][1], bytes = len * dsize(dt);
                void *want = malloc(bytes), *got = malloc(bytes);
                CHECK_OK(mti_dequantize(NULL, f, q, n, at, len, want, dt));
                for (int ti = 0; ti < n_tabs; ti++) {
                    tab *t = &tabs[ti];
                    void *Q = dev_buf(t, q, qb), *O = dev_buf(t, NULL, bytes);
                    CHECK_OKC(t->ctx, t->ops->dequantize(&t->k, O, Q, f, n, at, len, dt));
                    dev_get(t, got, O, bytes);
                    CHECK_MSG(!memcmp(got, want, bytes), "%s dequantize %s %s [%zu, %zu): not "
                              "lib/quant/quant.c's bits", t->name, mti_quant_name(f), dt_name(dt), at,
                              at + len);
                    free_bufs(t);
                }
                free(want), free(got);
            }
        }
        for (int ti = 0; ti < n_tabs; ti++) {
            tab *t = &tabs[ti];
            void *Q = dev_buf(t, q, qb), *O = dev_buf(t, NULL, 64);
            CHECK_ST(MT_ERR_INVALID_ARG, t->ops->dequantize(&t->k, O, Q, f, n, n - 4, 8, MTI_F32));
            CHECK_ST(MT_ERR_INVALID_ARG,
                     t->ops->dequantize(&t->k, O, Q, MTI_QF_NONE, n, 0, 8, MTI_F32));
            CHECK_ST(MT_ERR_INVALID_ARG, t->ops->dequantize(&t->k, O, Q, f, n, 0, 8, MTI_F16));
            free_bufs(t);
        }
        free(q);
    }
    free(w);
    close_tables();
}

/* ---- layernorm ---- */

typedef struct ln_io {
    int n, c;
    mti_dtype dt;
    float *x, *w, *b, *dout;       /* inputs */
    float *out, *mean, *rstd, *dx, *dw, *db; /* outputs */
    tab *t;
} ln_io;

static void run_ln(ln_io *io)
{
    tab *t = io->t;
    size_t nx = (size_t)io->n * io->c;
    void *X = put(t, io->x, nx, io->dt), *W = put(t, io->w, (size_t)io->c, io->dt),
         *B = put(t, io->b, (size_t)io->c, io->dt);
    void *O = dev_buf(t, NULL, nx * dsize(io->dt));
    float *M = dev_buf(t, NULL, (size_t)io->n * 4), *R = dev_buf(t, NULL, (size_t)io->n * 4);
    CHECK_OKC(t->ctx, t->ops->layernorm_fwd(&t->k, O, M, R, X, W, B, io->n, io->c, io->dt));
    get(t, io->out, O, nx, io->dt);
    get(t, io->mean, M, (size_t)io->n, MTI_F32);
    get(t, io->rstd, R, (size_t)io->n, MTI_F32);
    if (io->dout) {
        void *DO = put(t, io->dout, nx, io->dt), *DX = dev_buf(t, NULL, nx * dsize(io->dt));
        float *DW = dev_buf(t, NULL, (size_t)io->c * 4), *DB = dev_buf(t, NULL, (size_t)io->c * 4);
        CHECK_OKC(t->ctx, t->ops->layernorm_bwd(&t->k, DX, DW, DB, DO, X, W, M, R, io->n, io->c,
                                                io->dt, 0));
        get(t, io->dx, DX, nx, io->dt);
        get(t, io->dw, DW, (size_t)io->c, MTI_F32);
        get(t, io->db, DB, (size_t)io->c, MTI_F32);
    }
    free_bufs(t);
}

static double ln_loss(void *arg)
{
    ln_io io = *(ln_io *)arg;
    size_t nx = (size_t)io.n * io.c;
    float *out = malloc(nx * 4), *mean = malloc((size_t)io.n * 4), *rstd = malloc((size_t)io.n * 4);
    io.out = out, io.mean = mean, io.rstd = rstd;
    float *dout = io.dout;
    io.dout = NULL;
    run_ln(&io);
    double l = dot(out, dout, nx);
    free(out), free(mean), free(rstd);
    return l;
}

static void ln_one_thread(void *arg) { run_ln(arg); }

static ln_io ln_alloc(tab *t, mti_dtype dt, int n, int c)
{
    size_t nx = (size_t)n * c;
    return (ln_io){.n = n, .c = c, .dt = dt, .t = t, .out = malloc(nx * 4), .mean = malloc((size_t)n * 4),
                   .rstd = malloc((size_t)n * 4), .dx = malloc(nx * 4), .dw = malloc((size_t)c * 4),
                   .db = malloc((size_t)c * 4)};
}

static void ln_free(ln_io *io)
{
    free(io->out), free(io->mean), free(io->rstd), free(io->dx), free(io->dw), free(io->db);
}

TEST(ops_layernorm)
{
    open_tables();
    const int n = 300, c = 96; /* > 16384 elements: threaded; > 128 rows: chunked sums */
    size_t nx = (size_t)n * c;
    float *x = randv(nx, 2), *w = randv((size_t)c, 1), *b = randv((size_t)c, 0.5f), *dout = randv(nx, 1);
    for (int i = 0; i < c; i++) w[i] += 1.0f;
    ln_io ref = ln_alloc(&tabs[0], MTI_F32, n, c);
    ref.x = x, ref.w = w, ref.b = b, ref.dout = dout;
    run_ln(&ref);
    /* the forward against its definition, in double */
    for (int r = 0; r < n; r++) {
        double mu = 0, var = 0;
        for (int j = 0; j < c; j++) mu += x[(size_t)r * c + j];
        mu /= c;
        for (int j = 0; j < c; j++) var += pow(x[(size_t)r * c + j] - mu, 2);
        var /= c;
        float m = (float)mu, rs = (float)(1.0 / sqrt(var + 1e-5));
        expect_close("layernorm mean", &ref.mean[r], &m, 1, tol_of(MTI_F32));
        expect_close("layernorm rstd", &ref.rstd[r], &rs, 1, tol_of(MTI_F32));
        for (int j = 0; j < c; j++) {
            float o = (float)((x[(size_t)r * c + j] - mu) * rs * w[j] + b[j]);
            expect_close("layernorm out", &ref.out[(size_t)r * c + j], &o, 1, tol_of(MTI_F32));
        }
    }
    fd_check("layernorm dx", x, nx, ref.dx, ln_loss, &ref, 16);
    fd_check("layernorm dw", w, (size_t)c, ref.dw, ln_loss, &ref, 8);
    fd_check("layernorm db", b, (size_t)c, ref.db, ln_loss, &ref, 8);
    for (int d = 0; d < 3; d++) {
        mti_dtype dt = DTYPES[d];
        float *xr = rounded(x, nx, dt), *wr = rounded(w, (size_t)c, dt), *br = rounded(b, (size_t)c, dt),
              *dr = rounded(dout, nx, dt);
        ln_io want = ln_alloc(&tabs[0], MTI_F32, n, c);
        want.x = xr, want.w = wr, want.b = br, want.dout = dr;
        run_ln(&want);
        for (int ti = 0; ti < n_tabs; ti++) {
            ln_io got = ln_alloc(&tabs[ti], dt, n, c);
            got.x = xr, got.w = wr, got.b = br, got.dout = dr;
            run_ln(&got);
            char what[64];
            snprintf(what, sizeof what, "layernorm %s %s", tabs[ti].name, dt_name(dt));
            expect_close(what, got.out, want.out, nx, tol_of(dt));
            expect_close(what, got.mean, want.mean, (size_t)n, tol_of(MTI_F32));
            expect_close(what, got.rstd, want.rstd, (size_t)n, tol_of(MTI_F32));
            expect_close(what, got.dx, want.dx, nx, tol_of(dt));
            expect_close(what, got.dw, want.dw, (size_t)c, tol_of(dt));
            expect_close(what, got.db, want.db, (size_t)c, tol_of(MTI_F32));
            if (ti == 0) {
                /* the CPU computes in fp32 and rounds once, staged or read
                   in place: its fp32 results on the rounded inputs, rounded */
                float *r = rounded(want.out, nx, dt), *rdx = rounded(want.dx, nx, dt);
                expect_same_bits("layernorm out, fp32 rounded", got.out, r, nx);
                expect_same_bits("layernorm dx, fp32 rounded", got.dx, rdx, nx);
                expect_same_bits("layernorm dw, as fp32", got.dw, want.dw, (size_t)c);
                expect_same_bits("layernorm db, as fp32", got.db, want.db, (size_t)c);
                expect_same_bits("layernorm rstd, as fp32", got.rstd, want.rstd, (size_t)n);
                free(r), free(rdx);
                ln_io one = ln_alloc(&tabs[0], dt, n, c);
                one.x = xr, one.w = wr, one.b = br, one.dout = dr;
                with_one_thread(ln_one_thread, &one);
                expect_same_bits("layernorm dx", one.dx, got.dx, nx);
                expect_same_bits("layernorm dw", one.dw, got.dw, (size_t)c);
                ln_free(&one);
            }
            ln_free(&got);
        }
        ln_free(&want);
        free(xr), free(wr), free(br), free(dr);
    }
    /* accumulate adds into dx; dx may alias dout */
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        void *X = put(t, x, nx, MTI_F32), *W = put(t, w, (size_t)c, MTI_F32), *DO = put(t, dout, nx, MTI_F32);
        float *pre = randv(nx, 1), *got = malloc(nx * 4);
        void *DX = put(t, pre, nx, MTI_F32);
        float *DW = dev_buf(t, NULL, (size_t)c * 4), *DB = dev_buf(t, NULL, (size_t)c * 4);
        float *M = put(t, ref.mean, (size_t)n, MTI_F32), *R = put(t, ref.rstd, (size_t)n, MTI_F32);
        CHECK_OK(t->ops->layernorm_bwd(&t->k, DX, DW, DB, DO, X, W, M, R, n, c, MTI_F32, 1));
        get(t, got, DX, nx, MTI_F32);
        for (size_t i = 0; i < nx; i++) pre[i] += ref.dx[i];
        expect_close("layernorm dx accumulated", got, pre, nx, tol_of(MTI_F32));
        void *DO2 = put(t, dout, nx, MTI_F32);
        CHECK_OK(t->ops->layernorm_bwd(&t->k, DO2, DW, DB, DO2, X, W, M, R, n, c, MTI_F32, 0));
        get(t, got, DO2, nx, MTI_F32);
        expect_close("layernorm dx over dout", got, ref.dx, nx, tol_of(MTI_F32));
        /* MTI_BWD_SET_DW writes dw and db over the sums they hold: the bits
           of adding onto zeros; with no rows, zeros */
        float *ZW = dev_buf(t, NULL, (size_t)c * 4), *ZB = dev_buf(t, NULL, (size_t)c * 4);
        float *zw = malloc((size_t)c * 4), *zb = malloc((size_t)c * 4);
        float *sw = malloc((size_t)c * 4), *sb = malloc((size_t)c * 4);
        CHECK_OK(t->ops->layernorm_bwd(&t->k, NULL, ZW, ZB, DO, X, W, M, R, n, c, MTI_F32, 0));
        CHECK_OK(t->ops->layernorm_bwd(&t->k, NULL, DW, DB, DO, X, W, M, R, n, c, MTI_F32,
                                       MTI_BWD_SET_DW));
        get(t, zw, ZW, (size_t)c, MTI_F32), get(t, zb, ZB, (size_t)c, MTI_F32);
        get(t, sw, DW, (size_t)c, MTI_F32), get(t, sb, DB, (size_t)c, MTI_F32);
        expect_same_bits("layernorm dw written", sw, zw, (size_t)c);
        expect_same_bits("layernorm db written", sb, zb, (size_t)c);
        CHECK_OK(t->ops->layernorm_bwd(&t->k, NULL, DW, DB, DO, X, W, M, R, 0, c, MTI_F32,
                                       MTI_BWD_SET_DW));
        get(t, sw, DW, (size_t)c, MTI_F32), get(t, sb, DB, (size_t)c, MTI_F32);
        memset(zw, 0, (size_t)c * 4);
        expect_same_bits("layernorm dw written from no rows", sw, zw, (size_t)c);
        expect_same_bits("layernorm db written from no rows", sb, zw, (size_t)c);
        free(zw), free(zb), free(sw), free(sb);
        free_bufs(t);
        free(pre), free(got);
    }
    ln_free(&ref);
    free(x), free(w), free(b), free(dout);
    close_tables();
}

/* ---- elementwise: GELU, ReLU, add, accumulate ---- */

typedef struct ew_io {
    int relu;
    size_t n;
    mti_dtype dt;
    float *x, *dy, *y, *dx;
    tab *t;
} ew_io;

static void run_ew(ew_io *io)
{
    tab *t = io->t;
    void *X = put(t, io->x, io->n, io->dt), *Y = dev_buf(t, NULL, io->n * dsize(io->dt));
    if (io->relu) CHECK_OK(t->ops->relu_fwd(&t->k, Y, X, io->n, io->dt));
    else CHECK_OK(t->ops->gelu_fwd(&t->k, Y, X, io->n, io->dt));
    get(t, io->y, Y, io->n, io->dt);
    if (io->dy) {
        void *D = put(t, io->dy, io->n, io->dt); /* in place: dx aliases dy */
        if (io->relu) CHECK_OK(t->ops->relu_bwd(&t->k, D, D, Y, io->n, io->dt));
        else CHECK_OK(t->ops->gelu_bwd(&t->k, D, D, X, io->n, io->dt));
        get(t, io->dx, D, io->n, io->dt);
    }
    free_bufs(t);
}

static double ew_loss(void *arg)
{
    ew_io io = *(ew_io *)arg;
    float *y = malloc(io.n * 4), *dy = io.dy;
    io.y = y, io.dy = NULL;
    run_ew(&io);
    double l = dot(y, dy, io.n);
    free(y);
    return l;
}

static void ew_one_thread(void *arg) { run_ew(arg); }

TEST(ops_activations)
{
    open_tables();
    const size_t n = 40000; /* large enough to run threaded */
    float *x = randv(n, 4), *dy = randv(n, 1);
    for (int relu = 0; relu < 2; relu++) {
        /* keep ReLU's finite differences away from the kink */
        if (relu)
            for (size_t i = 0; i < n; i++)
                if (fabsf(x[i]) < 0.05f) x[i] = 0.5f;
        float *y = malloc(n * 4), *dx = malloc(n * 4);
        ew_io ref = {relu, n, MTI_F32, x, dy, y, dx, &tabs[0]};
        run_ew(&ref);
        for (size_t i = 0; i < n; i += 997) {
            double v = x[i];
            float want = relu ? (float)(v > 0 ? v : 0)
                              : (float)(0.5 * v * (1 + tanh(sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))));
            expect_close(relu ? "relu" : "gelu", &y[i], &want, 1, tol_of(MTI_F32));
        }
        fd_check(relu ? "relu dx" : "gelu dx", x, n, dx, ew_loss, &ref, 10);
        for (int d = 0; d < 3; d++) {
            mti_dtype dt = DTYPES[d];
            float *xr = rounded(x, n, dt), *dr = rounded(dy, n, dt);
            float *wy = malloc(n * 4), *wdx = malloc(n * 4), *gy = malloc(n * 4), *gdx = malloc(n * 4);
            ew_io want = {relu, n, MTI_F32, xr, dr, wy, wdx, &tabs[0]};
            run_ew(&want);
            for (int ti = 0; ti < n_tabs; ti++) {
                ew_io got = {relu, n, dt, xr, dr, gy, gdx, &tabs[ti]};
                run_ew(&got);
                char what[64];
                snprintf(what, sizeof what, "%s %s %s", relu ? "relu" : "gelu", tabs[ti].name, dt_name(dt));
                expect_close(what, gy, wy, n, tol_of(dt));
                expect_close(what, gdx, wdx, n, tol_of(dt));
                if (ti == 0) { /* the CPU: its fp32 results on the rounded inputs, rounded */
                    float *r = rounded(wy, n, dt), *rdx = rounded(wdx, n, dt);
                    expect_same_bits(what, gy, r, n);
                    expect_same_bits(what, gdx, rdx, n);
                    free(r), free(rdx);
                    float *oy = malloc(n * 4), *odx = malloc(n * 4);
                    ew_io one = {relu, n, dt, xr, dr, oy, odx, &tabs[0]};
                    with_one_thread(ew_one_thread, &one);
                    expect_same_bits(what, oy, gy, n);
                    expect_same_bits(what, odx, gdx, n);
                    free(oy), free(odx);
                }
            }
            free(xr), free(dr), free(wy), free(wdx), free(gy), free(gdx);
        }
        free(y), free(dx);
    }
    /* add and accumulate, exact up to one rounding */
    for (int d = 0; d < 3; d++) {
        mti_dtype dt = DTYPES[d];
        float *a = rounded(x, n, dt), *b = rounded(dy, n, dt), *want = malloc(n * 4), *got = malloc(n * 4);
        for (size_t i = 0; i < n; i++) want[i] = round_to(a[i] + b[i], dt);
        for (int ti = 0; ti < n_tabs; ti++) {
            tab *t = &tabs[ti];
            void *A = put(t, a, n, dt), *B = put(t, b, n, dt), *Y = dev_buf(t, NULL, n * dsize(dt));
            CHECK_OK(t->ops->add(&t->k, Y, A, B, n, dt));
            get(t, got, Y, n, dt);
            CHECK_MSG(memcmp(got, want, n * 4) == 0, "add %s %s", t->name, dt_name(dt));
            CHECK_OK(t->ops->accumulate(&t->k, A, B, n, dt)); /* a += b */
            get(t, got, A, n, dt);
            CHECK_MSG(memcmp(got, want, n * 4) == 0, "accumulate %s %s", t->name, dt_name(dt));
            free_bufs(t);
        }
        free(a), free(b), free(want), free(got);
    }
    free(x), free(dy);
    close_tables();
}

/* ---- attention ---- */

typedef struct at_io {
    int B, T, C, H;
    mti_dtype dt;
    float *qkv, *dout;
    float *out, *lse, *dqkv;
    tab *t;
} at_io;

static void run_attn(at_io *io)
{
    tab *t = io->t;
    size_t nq = (size_t)io->B * io->T * 3 * io->C, no = (size_t)io->B * io->T * io->C,
           nl = (size_t)io->B * io->H * io->T;
    void *Q = put(t, io->qkv, nq, io->dt), *O = dev_buf(t, NULL, no * dsize(io->dt));
    float *L = dev_buf(t, NULL, nl * 4);
    CHECK_OKC(t->ctx, t->ops->attention_fwd(&t->k, O, L, Q, io->B, io->T, io->C, io->H, io->dt));
    get(t, io->out, O, no, io->dt);
    get(t, io->lse, L, nl, MTI_F32);
    if (io->dout) {
        void *DO = put(t, io->dout, no, io->dt), *DQ = dev_buf(t, NULL, nq * dsize(io->dt));
        CHECK_OKC(t->ctx, t->ops->attention_bwd(&t->k, DQ, DO, Q, O, L, io->B, io->T, io->C, io->H,
                                                io->dt));
        get(t, io->dqkv, DQ, nq, io->dt);
    }
    free_bufs(t);
}

static double at_loss(void *arg)
{
    at_io io = *(at_io *)arg;
    size_t no = (size_t)io.B * io.T * io.C;
    float *out = malloc(no * 4), *lse = malloc((size_t)io.B * io.H * io.T * 4), *dout = io.dout;
    io.out = out, io.lse = lse, io.dout = NULL;
    run_attn(&io);
    double l = dot(out, dout, no);
    free(out), free(lse);
    return l;
}

static void at_one_thread(void *arg) { run_attn(arg); }

/* The definition, in double: softmax over keys 0..t of q.k / sqrt(hs). */
static void attn_reference(const at_io *io, double *out, double *lse)
{
    const int B = io->B, T = io->T, C = io->C, H = io->H, hs = C / H;
    double *p = malloc((size_t)T * sizeof *p);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const float *q = io->qkv + ((size_t)b * T + t) * 3 * C + h * hs;
                double mx = -INFINITY;
                for (int u = 0; u <= t; u++) {
                    const float *k = io->qkv + ((size_t)b * T + u) * 3 * C + C + h * hs;
                    double s = 0;
                    for (int e = 0; e < hs; e++) s += (double)q[e] * k[e];
                    p[u] = s / sqrt((double)hs);
                    if (p[u] > mx) mx = p[u];
                }
                double z = 0;
                for (int u = 0; u <= t; u++) z += exp(p[u] - mx);
                lse[((size_t)b * H + h) * T + t] = mx + log(z);
                for (int e = 0; e < hs; e++) {
                    double o = 0;
                    for (int u = 0; u <= t; u++)
                        o += exp(p[u] - mx) / z * io->qkv[((size_t)b * T + u) * 3 * C + 2 * C + h * hs + e];
                    out[((size_t)b * T + t) * C + h * hs + e] = o;
                }
            }
    free(p);
}

TEST(ops_attention)
{
    open_tables();
    /* T past one key block, heads of an odd-ish size */
    /* head sizes 4, 16, 32, 64, 128, then 64 again over two query tiles
     * of the tensor-core kernels (attention_tc.cu: fp16 and bf16 heads of
     * 64 on a GPU), the last one partial */
    static const int shapes[][4] = {{1, 5, 8, 2}, {2, 70, 48, 3}, {1, 160, 64, 2}, {1, 70, 128, 2},
                                    {1, 40, 256, 2}, {2, 80, 128, 2}};
    for (int si = 0; si < 6; si++) {
        const int B = shapes[si][0], T = shapes[si][1], C = shapes[si][2], H = shapes[si][3];
        size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C, nl = (size_t)B * H * T;
        float *qkv = randv(nq, 1.5f), *dout = randv(no, 1);
        at_io ref = {B, T, C, H, MTI_F32, qkv, dout, malloc(no * 4), malloc(nl * 4), malloc(nq * 4), &tabs[0]};
        run_attn(&ref);
        double *ro = malloc(no * sizeof *ro), *rl = malloc(nl * sizeof *rl);
        attn_reference(&ref, ro, rl);
        float *fo = malloc(no * 4), *fl = malloc(nl * 4);
        for (size_t i = 0; i < no; i++) fo[i] = (float)ro[i];
        for (size_t i = 0; i < nl; i++) fl[i] = (float)rl[i];
        expect_close("attention out vs definition", ref.out, fo, no, tol_of(MTI_F32));
        expect_close("attention lse vs definition", ref.lse, fl, nl, tol_of(MTI_F32));
        fd_check("attention dqkv", qkv, nq, ref.dqkv, at_loss, &ref, 24);
        for (int d = 0; d < 3; d++) {
            mti_dtype dt = DTYPES[d];
            float *qr = rounded(qkv, nq, dt), *dr = rounded(dout, no, dt);
            at_io want = {B, T, C, H, MTI_F32, qr, dr, malloc(no * 4), malloc(nl * 4), malloc(nq * 4), &tabs[0]};
            run_attn(&want);
            /* on a GPU, fp16 and bf16 heads of 64 run twice: on the tensor
             * cores, then on attention.cu's kernels (MT_CUDA_ATTN_SIMT) */
            for (int ti = 0; ti < n_tabs; ti++)
            for (int simt = 0; simt < 2; simt++) {
                if (simt && (ti == 0 || dt == MTI_F32 || C / H != 64)) continue;
                if (simt) setenv("MT_CUDA_ATTN_SIMT", "1", 1);
                at_io got = {B, T, C, H, dt, qr, dr, malloc(no * 4), malloc(nl * 4), malloc(nq * 4), &tabs[ti]};
                run_attn(&got);
                if (simt) unsetenv("MT_CUDA_ATTN_SIMT");
                char what[64];
                snprintf(what, sizeof what, "attention %s %s%s", tabs[ti].name, dt_name(dt),
                         simt ? " (simt)" : "");
                expect_close(what, got.out, want.out, no, tol_of(dt));
                expect_close(what, got.lse, want.lse, nl, tol_of(dt));
                expect_close(what, got.dqkv, want.dqkv, nq, tol_of(dt));
                if (ti == 0) {
                    at_io one = {B, T, C, H, dt, qr, dr, malloc(no * 4), malloc(nl * 4), malloc(nq * 4), &tabs[0]};
                    with_one_thread(at_one_thread, &one);
                    expect_same_bits(what, one.out, got.out, no);
                    expect_same_bits(what, one.dqkv, got.dqkv, nq);
                    free(one.out), free(one.lse), free(one.dqkv);
                }
                free(got.out), free(got.lse), free(got.dqkv);
            }
            free(want.out), free(want.lse), free(want.dqkv), free(qr), free(dr);
        }
        free(ref.out), free(ref.lse), free(ref.dqkv), free(qkv), free(dout), free(ro), free(rl),
            free(fo), free(fl);
    }
    close_tables();
}

/* ---- softmax cross-entropy, and distillation's ---- */

typedef struct kd_args {
    const float *tlogits; /* (n, tVp) fp32 */
    int tVp;
    float alpha, temp;
} kd_args;

typedef struct xe_io {
    int n, V, Vp;
    float dloss;
    mti_dtype dt;
    float *logits;
    int32_t *targets;
    float *losses, *dlogits; /* dlogits NULL: forward only */
    tab *t;
    const kd_args *kd; /* non-NULL: xent_kd with this teacher */
} xe_io;

/* io's op on its table, on device buffers: xent, or xent_kd with the
 * teacher's logits at Tl. */
static mt_status xe_op(const xe_io *io, float *Ls, void *D, const void *Lg, const float *Tl,
                       const int32_t *Tg)
{
    tab *t = io->t;
    if (!io->kd) return t->ops->xent(&t->k, Ls, D, Lg, Tg, io->n, io->V, io->Vp, io->dloss, io->dt);
    const kd_args *a = io->kd;
    return t->ops->xent_kd(&t->k, Ls, D, Lg, Tl, Tg, io->n, io->V, io->Vp, a->tVp, a->alpha,
                           a->temp, io->dloss, io->dt);
}

/* io's inputs on its table: logits, teacher logits (or NULL), targets. */
static void xe_put(const xe_io *io, void **Lg, float **Tl, int32_t **Tg)
{
    tab *t = io->t;
    *Lg = put(t, io->logits, (size_t)io->n * io->Vp, io->dt);
    *Tl = io->kd ? dev_buf(t, io->kd->tlogits, (size_t)io->n * io->kd->tVp * 4) : NULL;
    *Tg = dev_buf(t, io->targets, (size_t)io->n * 4);
}

static void run_xent(xe_io *io)
{
    tab *t = io->t;
    size_t nl = (size_t)io->n * io->Vp;
    void *Lg;
    float *Tl;
    int32_t *Tg;
    xe_put(io, &Lg, &Tl, &Tg);
    float *Ls = dev_buf(t, NULL, (size_t)io->n * 4);
    /* dlogits over the logits */
    CHECK_OKC(t->ctx, xe_op(io, Ls, io->dlogits ? Lg : NULL, Lg, Tl, Tg));
    get(t, io->losses, Ls, (size_t)io->n, MTI_F32);
    if (io->dlogits) get(t, io->dlogits, Lg, nl, io->dt);
    free_bufs(t);
}

static double xe_loss(void *arg)
{
    xe_io io = *(xe_io *)arg;
    float *ls = malloc((size_t)io.n * 4);
    io.losses = ls, io.dlogits = NULL;
    run_xent(&io);
    double l = 0;
    for (int i = 0; i < io.n; i++) l += (double)ls[i] * io.dloss;
    free(ls);
    return l;
}

static void xe_one_thread(void *arg) { run_xent(arg); }

/* ref's op (its fp32 setting) in every dtype on every table against the
 * CPU in fp32 on the same rounded logits, and the CPU with 1 and 2
 * threads. */
static void xe_dtypes(const xe_io *ref, const char *label)
{
    const size_t n = (size_t)ref->n, nl = n * ref->Vp;
    for (int d = 0; d < 3; d++) {
        mti_dtype dt = DTYPES[d];
        float *lr = rounded(ref->logits, nl, dt);
        float *wls = malloc(n * 4), *wdl = malloc(nl * 4), *gls = malloc(n * 4),
              *gdl = malloc(nl * 4);
        xe_io want = *ref;
        want.dt = MTI_F32, want.t = &tabs[0], want.logits = lr, want.losses = wls,
        want.dlogits = wdl;
        run_xent(&want);
        for (int ti = 0; ti < n_tabs; ti++) {
            xe_io got = want;
            got.dt = dt, got.losses = gls, got.dlogits = gdl, got.t = &tabs[ti];
            run_xent(&got);
            char what[96];
            snprintf(what, sizeof what, "%s %s %s", label, tabs[ti].name, dt_name(dt));
            expect_close(what, gls, wls, n, tol_of(MTI_F32));
            expect_close(what, gdl, wdl, nl, tol_of(dt));
            if (ti == 0) {
                float *ol = malloc(n * 4), *od = malloc(nl * 4);
                xe_io one = got;
                one.losses = ol, one.dlogits = od;
                with_one_thread(xe_one_thread, &one);
                expect_same_bits(what, ol, gls, n);
                expect_same_bits(what, od, gdl, nl);
                free(ol), free(od);
            }
        }
        free(lr), free(wls), free(wdl), free(gls), free(gdl);
    }
}

/* ref's op (fp32) on every table with the gradient into a buffer of its
 * own (the logits left as they were) and without the losses, against dl. */
static void xe_other_buffer(const xe_io *ref, const float *dl, const char *label)
{
    const size_t nl = (size_t)ref->n * ref->Vp;
    for (int ti = 0; ti < n_tabs; ti++) {
        xe_io io = *ref;
        tab *t = io.t = &tabs[ti];
        void *Lg;
        float *Tl;
        int32_t *Tg;
        xe_put(&io, &Lg, &Tl, &Tg);
        float *Ls = dev_buf(t, NULL, (size_t)io.n * 4), *D = dev_buf(t, NULL, nl * 4);
        float *got = malloc(nl * 4), *keep = malloc(nl * 4);
        char what[96];
        CHECK_OK(xe_op(&io, Ls, D, Lg, Tl, Tg));
        get(t, got, D, nl, MTI_F32);
        get(t, keep, Lg, nl, MTI_F32);
        snprintf(what, sizeof what, "%s %s into another buffer", label, t->name);
        expect_close(what, got, dl, nl, tol_of(MTI_F32));
        CHECK_MSG(memcmp(keep, io.logits, nl * 4) == 0, "%s: the logits changed", what);
        CHECK_OK(xe_op(&io, NULL, D, Lg, Tl, Tg));
        get(t, got, D, nl, MTI_F32);
        snprintf(what, sizeof what, "%s %s without losses", label, t->name);
        expect_close(what, got, dl, nl, tol_of(MTI_F32));
        free_bufs(t);
        free(got), free(keep);
    }
}

TEST(ops_cross_entropy)
{
    open_tables();
    const int n = 19, V = 1000, Vp = 1024;
    size_t nl = (size_t)n * Vp;
    float *logits = randv(nl, 4);
    int32_t targets[19];
    for (int i = 0; i < n; i++) targets[i] = (int32_t)((unsigned)(i * 7919) % (unsigned)V);
    for (int i = 0; i < n; i++) /* padding columns hold junk the op must ignore */
        for (int j = V; j < Vp; j++) logits[(size_t)i * Vp + j] = 1e4f;
    float *ls = malloc((size_t)n * 4), *dl = malloc(nl * 4);
    xe_io ref = {n, V, Vp, 0.25f, MTI_F32, logits, targets, ls, dl, &tabs[0], NULL};
    run_xent(&ref);
    for (int i = 0; i < n; i++) {
        const float *row = logits + (size_t)i * Vp;
        double mx = row[0], z = 0;
        for (int j = 1; j < V; j++) mx = row[j] > mx ? row[j] : mx;
        for (int j = 0; j < V; j++) z += exp(row[j] - mx);
        float want = (float)(mx + log(z) - row[targets[i]]);
        expect_close("cross-entropy loss vs definition", &ls[i], &want, 1, tol_of(MTI_F32));
        for (int j = V; j < Vp; j++) CHECK(dl[(size_t)i * Vp + j] == 0.0f);
    }
    fd_check("cross-entropy dlogits", logits, (size_t)V, dl, xe_loss, &ref, 12); /* row 0 */
    xe_dtypes(&ref, "cross-entropy");
    xe_other_buffer(&ref, dl, "cross-entropy");
    free(logits), free(ls), free(dl);
    close_tables();
}

/* Distillation's fused loss (xent_kd), for alpha 0.6 and 1, T 2.5 and 0.7:
 * every table in every dtype against the CPU in fp32 on the same rounded
 * inputs, the CPU with 1 and 2 threads, the gradient into another buffer
 * and without the losses; alpha 0 gives xent's bits on each table; bad
 * settings are refused (the CPU op against the formula in double and
 * finite differences: test_distill.c). The teacher is padded differently
 * from the student (its logits are fp32 in every dtype), and both paddings
 * hold junk the op must ignore. */
TEST(ops_distillation)
{
    open_tables();
    const int n = 13, V = 1000, Vp = 1024, tVp = 1008;
    const size_t nl = (size_t)n * Vp, nt = (size_t)n * tVp;
    float *logits = randv(nl, 4), *teacher = randv(nt, 5);
    int32_t targets[13];
    for (int i = 0; i < n; i++) {
        targets[i] = (int32_t)((unsigned)(i * 7919 + 3) % (unsigned)V);
        for (int j = V; j < Vp; j++) logits[(size_t)i * Vp + j] = 1e4f;
        for (int j = V; j < tVp; j++) teacher[(size_t)i * tVp + j] = -1e4f;
    }
    static const float alphas[2] = {0.6f, 1.0f}, temps[2] = {2.5f, 0.7f};
    float *ls = malloc((size_t)n * 4), *dl = malloc(nl * 4);
    for (int c = 0; c < 2; c++) {
        const kd_args kd = {teacher, tVp, alphas[c], temps[c]};
        xe_io ref = {n, V, Vp, 0.25f, MTI_F32, logits, targets, ls, dl, &tabs[0], &kd};
        run_xent(&ref);
        for (int i = 0; i < n; i++)
            for (int j = V; j < Vp; j++) CHECK(dl[(size_t)i * Vp + j] == 0.0f);
        char label[64];
        snprintf(label, sizeof label, "distillation alpha %g T %g", (double)kd.alpha,
                 (double)kd.temp);
        xe_dtypes(&ref, label);
        xe_other_buffer(&ref, dl, label);
    }
    /* alpha 0 is xent bit for bit; bad settings */
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        float *want = malloc(nl * 4), *got = malloc(nl * 4), wl[13], gl[13];
        const kd_args kd0 = {teacher, tVp, 0.0f, 0.7f};
        xe_io io = {n, V, Vp, 0.25f, MTI_F32, logits, targets, wl, want, t, NULL};
        run_xent(&io);
        io.kd = &kd0, io.losses = gl, io.dlogits = got;
        run_xent(&io);
        CHECK_MSG(memcmp(got, want, nl * 4) == 0 && memcmp(gl, wl, sizeof gl) == 0,
                  "%s: distillation with alpha 0 is not xent's bits", t->name);
        void *Lg;
        float *Tl;
        int32_t *Tg;
        xe_put(&io, &Lg, &Tl, &Tg);
        CHECK_ST(MT_ERR_INVALID_ARG, t->ops->xent_kd(&t->k, NULL, Lg, Lg, Tl, Tg, n, V, Vp, tVp,
                                                     1.5f, 1.0f, 1.0f, MTI_F32));
        CHECK_ST(MT_ERR_INVALID_ARG, t->ops->xent_kd(&t->k, NULL, Lg, Lg, Tl, Tg, n, V, Vp, V - 1,
                                                     0.5f, 1.0f, 1.0f, MTI_F32));
        free_bufs(t);
        free(want), free(got);
    }
    free(logits), free(teacher), free(ls), free(dl);
    close_tables();
}

/* ---- embedding ---- */

TEST(ops_embedding)
{
    open_tables();
    static const int shapes[2][3] = {{3, 11, 24}, {160, 2, 24}}; /* B, T, C: few rows, many */
    for (int si = 0; si < 2; si++) {
    const int B = shapes[si][0], T = shapes[si][1], C = shapes[si][2], V = 50, maxT = 16;
    size_t no = (size_t)B * T * C;
    float *wte = randv((size_t)V * C, 1), *wpe = randv((size_t)maxT * C, 1), *dout = randv(no, 1);
    int32_t tok[320];
    for (int i = 0; i < B * T; i++) tok[i] = (int32_t)((unsigned)(i * 37 + 5) % 7); /* repeats */
    for (int d = 0; d < 3; d++) {
        mti_dtype dt = DTYPES[d];
        float *er = rounded(wte, (size_t)V * C, dt), *pr = rounded(wpe, (size_t)maxT * C, dt),
              *dr = rounded(dout, no, dt);
        /* the definition */
        float *want = malloc(no * 4), *wdte = calloc((size_t)V * C, 4), *wdpe = calloc((size_t)maxT * C, 4);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++)
                for (int c = 0; c < C; c++) {
                    size_t o = ((size_t)b * T + t) * C + c;
                    want[o] = round_to(er[(size_t)tok[b * T + t] * C + c] + pr[(size_t)t * C + c], dt);
                    wdte[(size_t)tok[b * T + t] * C + c] += dr[o];
                    wdpe[(size_t)t * C + c] += dr[o];
                }
        for (int ti = 0; ti < n_tabs; ti++) {
            tab *t = &tabs[ti];
            void *E = put(t, er, (size_t)V * C, dt), *P = put(t, pr, (size_t)maxT * C, dt);
            int32_t *K = dev_buf(t, tok, (size_t)B * T * 4);
            void *O = dev_buf(t, NULL, no * dsize(dt)), *DO = put(t, dr, no, dt);
            float *DE = dev_buf(t, NULL, (size_t)V * C * 4), *DP = dev_buf(t, NULL, (size_t)maxT * C * 4);
            CHECK_OK(t->ops->embedding_fwd(&t->k, O, K, E, P, B, T, C, dt));
            CHECK_OK(t->ops->embedding_bwd(&t->k, DE, DP, DO, K, B, T, C, dt));
            CHECK_OK(t->ops->embedding_bwd(&t->k, DE, DP, DO, K, B, T, C, dt)); /* accumulates */
            float *got = malloc(no * 4), *gde = malloc((size_t)V * C * 4), *gdp = malloc((size_t)maxT * C * 4);
            get(t, got, O, no, dt);
            get(t, gde, DE, (size_t)V * C, MTI_F32);
            get(t, gdp, DP, (size_t)maxT * C, MTI_F32);
            for (size_t i = 0; i < (size_t)V * C; i++) gde[i] *= 0.5f;
            for (size_t i = 0; i < (size_t)maxT * C; i++) gdp[i] *= 0.5f;
            char what[64];
            snprintf(what, sizeof what, "embedding %s %s", t->name, dt_name(dt));
            CHECK_MSG(memcmp(got, want, no * 4) == 0, "%s: forward not exact", what);
            expect_close(what, gde, wdte, (size_t)V * C, tol_of(MTI_F32));
            expect_close(what, gdp, wdpe, (size_t)maxT * C, tol_of(MTI_F32));
            if (ti == 0) { /* 1 and 2 threads: the same sums */
                float *ode = malloc((size_t)V * C * 4), *odp = malloc((size_t)maxT * C * 4);
                CHECK_OK(t->ctx->dev->memset8(t->ctx->dev, DE, 0, (size_t)V * C * 4));
                CHECK_OK(t->ctx->dev->memset8(t->ctx->dev, DP, 0, (size_t)maxT * C * 4));
                tabs[0].ctx->threads = 1;
                CHECK_OK(t->ops->embedding_bwd(&t->k, DE, DP, DO, K, B, T, C, dt));
                CHECK_OK(t->ops->embedding_bwd(&t->k, DE, DP, DO, K, B, T, C, dt));
                tabs[0].ctx->threads = 2;
                get(t, ode, DE, (size_t)V * C, MTI_F32);
                get(t, odp, DP, (size_t)maxT * C, MTI_F32);
                for (size_t i = 0; i < (size_t)V * C; i++) ode[i] *= 0.5f;
                for (size_t i = 0; i < (size_t)maxT * C; i++) odp[i] *= 0.5f;
                expect_same_bits("embedding dwte", ode, gde, (size_t)V * C);
                expect_same_bits("embedding dwpe", odp, gdp, (size_t)maxT * C);
                free(ode), free(odp);
            }
            free_bufs(t);
            free(got), free(gde), free(gdp);
        }
        free(er), free(pr), free(dr), free(want), free(wdte), free(wdpe);
    }
    free(wte), free(wpe), free(dout);
    }

    /* Without positions the rows are the table's own, nothing added: -0.0
     * stays -0.0 and a NaN keeps its payload as kctx's conversions keep it
     * (fp32: the bits; fp16, bf16: to fp32 and back), bit for bit on every
     * table (an added 0.0f would give +0.0 and the canonical NaN). */
    enum { NV = 4, NC = 8, NB = 2, NT = 3 };
    static const int32_t ktok[NB * NT] = {3, 0, 2, 2, 1, 3};
    static const uint32_t sp32[4] = {0x80000000u, 0x7FC01234u, 0xFFA00001u, 0x3F800001u};
    static const uint16_t sp16[3][4] = {
        {0}, {0x8000u, 0xFE01u, 0x7D23u, 0x3C01u}, {0x8000u, 0xFFC1u, 0x7F81u, 0x3F81u}};
    for (int d = 0; d < 3; d++) {
        mti_dtype dt = DTYPES[d];
        size_t es = dsize(dt), no = (size_t)NB * NT * NC;
        unsigned char tbl[NV * NC * 4], want[NB * NT * NC * 4], got[NB * NT * NC * 4];
        for (int i = 0; i < NV * NC; i++) {
            uint32_t b = dt == MTI_F32 ? sp32[i % 4] : sp16[d][i % 4];
            memcpy(tbl + (size_t)i * es, &b, es); /* little-endian: the low bytes */
        }
        for (size_t o = 0; o < no; o++) {
            const unsigned char *e = tbl + ((size_t)ktok[o / NC] * NC + o % NC) * es;
            uint16_t h;
            memcpy(&h, e, 2);
            if (dt == MTI_F16) h = mti_f32_to_f16(mti_f16_to_f32(h));
            if (dt == MTI_BF16) h = mti_f32_to_bf16(mti_bf16_to_f32(h));
            memcpy(want + o * es, dt == MTI_F32 ? (const void *)e : (const void *)&h, es);
        }
        for (int ti = 0; ti < n_tabs; ti++) {
            tab *t = &tabs[ti];
            void *E = dev_buf(t, tbl, (size_t)NV * NC * es), *O = dev_buf(t, NULL, no * es);
            int32_t *K = dev_buf(t, ktok, sizeof ktok);
            CHECK_OK(t->ops->embedding_fwd(&t->k, O, K, E, NULL, NB, NT, NC, dt));
            dev_get(t, got, O, no * es);
            CHECK_MSG(memcmp(got, want, no * es) == 0, "embedding %s %s without positions: not "
                      "the table's bits", t->name, dt_name(dt));
            free_bufs(t);
        }
    }
    close_tables();
}

/* ---- casts ---- */

TEST(ops_casts)
{
    open_tables();
    /* every fp16 and bf16 bit pattern, and fp32 values around their edges */
    const size_t n = 65536 + 4096;
    float *src = malloc(n * 4);
    for (size_t i = 0; i < 32768; i++) src[i] = mti_f16_to_f32((uint16_t)(i * 2 + 1));
    for (size_t i = 32768; i < 65536; i++) src[i] = mti_bf16_to_f32((uint16_t)(i * 2));
    static const float edge[] = {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, -65520.0f, 1e-8f,
                                 2.9802322e-08f, 2.9802326e-08f, 5.9604645e-08f, 6.1035156e-05f,
                                 1.00048828125f, 1.0009765625f, 3.4e38f, INFINITY, -INFINITY, NAN};
    for (size_t i = 65536; i < n; i++)
        src[i] = i - 65536 < sizeof edge / sizeof *edge ? edge[i - 65536] : urand() * powf(2.0f, (float)(rng % 40) - 20.0f);
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        float *S = put(t, src, n, MTI_F32);
        for (int d = 1; d < 3; d++) {
            mti_dtype dt = DTYPES[d];
            void *D = dev_buf(t, NULL, n * 2);
            float *B = dev_buf(t, NULL, n * 4);
            CHECK_OK(t->ops->cast(&t->k, D, dt, S, MTI_F32, n, MTI_ROUND_NEAREST, 0));
            uint16_t *h = malloc(n * 2);
            dev_get(t, h, D, n * 2);
            for (size_t i = 0; i < n; i++) {
                uint16_t want = dt == MTI_F16 ? mti_f32_to_f16(src[i]) : mti_f32_to_bf16(src[i]);
                CHECK_MSG(h[i] == want, "%s cast to %s of %.9g: %04x, expected %04x", t->name,
                          dt_name(dt), src[i], h[i], want);
            }
            /* and back: exact */
            CHECK_OK(t->ops->cast(&t->k, B, MTI_F32, D, dt, n, MTI_ROUND_NEAREST, 0));
            float *back = malloc(n * 4);
            dev_get(t, back, B, n * 4);
            for (size_t i = 0; i < n; i++) {
                float want = dt == MTI_F16 ? mti_f16_to_f32(h[i]) : mti_bf16_to_f32(h[i]);
                CHECK_MSG(memcmp(&back[i], &want, 4) == 0, "%s cast from %s of %04x", t->name,
                          dt_name(dt), h[i]);
            }
            free(h), free(back);
        }
        free_bufs(t);
    }
    /* stochastic rounding to bf16: unbiased, deterministic for a seed, the
       same on every table, and the same on 1 or 2 threads */
    const size_t m = 1 << 16;
    float *v = malloc(m * 4);
    for (size_t i = 0; i < m; i++) v[i] = 1.0f + 3.0f / 1024.0f; /* 3/8 of a bf16 ulp above 1 */
    uint16_t *first = malloc(m * 2), *again = malloc(m * 2);
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        float *S = put(t, v, m, MTI_F32);
        uint16_t *D = dev_buf(t, NULL, m * 2);
        CHECK_OK(t->ops->cast(&t->k, D, MTI_BF16, S, MTI_F32, m, MTI_ROUND_STOCHASTIC, 42));
        dev_get(t, ti == 0 ? first : again, D, m * 2);
        if (ti == 0) {
            double mean = 0;
            size_t up = 0;
            for (size_t i = 0; i < m; i++) {
                mean += mti_bf16_to_f32(first[i]);
                up += first[i] != 0x3F80;
                CHECK(first[i] == 0x3F80 || first[i] == 0x3F81);
                CHECK(first[i] == mti_f32_to_bf16_sr(v[i], mti_sr_bits(42, i)));
            }
            mean /= (double)m;
            /* 3/8 of the values round up; the mean is the value, within 4 sigma */
            CHECK_MSG(fabs((double)up / (double)m - 0.375) < 4 * sqrt(0.375 * 0.625 / (double)m),
                      "stochastic rounding rounds up %.4f of the time, not 0.375", (double)up / (double)m);
            CHECK(fabs(mean - v[0]) < 1e-4);
            tabs[0].ctx->threads = 1;
            CHECK_OK(t->ops->cast(&t->k, D, MTI_BF16, S, MTI_F32, m, MTI_ROUND_STOCHASTIC, 42));
            tabs[0].ctx->threads = 2;
            dev_get(t, again, D, m * 2);
            CHECK(memcmp(first, again, m * 2) == 0);
            CHECK_OK(t->ops->cast(&t->k, D, MTI_BF16, S, MTI_F32, m, MTI_ROUND_STOCHASTIC, 43));
            dev_get(t, again, D, m * 2);
            CHECK(memcmp(first, again, m * 2) != 0); /* another seed, other bits */
            /* every kind of value (signs, subnormals, the largest finite, inf,
               NaNs with payloads), at offsets past the vector width: the
               definition's bits */
            static const uint32_t special[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807FFFFFu,
                                               0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F800000u, 0xFF800000u,
                                               0x7FC00001u, 0xFF800001u, 0x3F80FFFFu, 0xC0490FDBu};
            const size_t ns = sizeof special / sizeof *special;
            for (size_t i = 0; i < m; i++) {
                uint32_t u = special[i % ns] ^ (uint32_t)(i / ns & 0xFFFFu);
                memcpy(&v[i], &u, 4);
            }
            float *S2 = put(t, v, m, MTI_F32);
            CHECK_OK(t->ops->cast(&t->k, D, MTI_BF16, S2, MTI_F32, m, MTI_ROUND_STOCHASTIC, 7));
            dev_get(t, again, D, m * 2);
            for (size_t i = 0; i < m; i++)
                CHECK_MSG(again[i] == mti_f32_to_bf16_sr(v[i], mti_sr_bits(7, i)),
                          "stochastic rounding of %08x at %zu", special[i % ns], i);
            for (size_t i = 0; i < m; i++) v[i] = 1.0f + 3.0f / 1024.0f;
        } else {
            CHECK_MSG(memcmp(first, again, m * 2) == 0, "%s: stochastic rounding differs from cpu", t->name);
        }
        free_bufs(t);
    }
    free(src), free(v), free(first), free(again);
    close_tables();
}

/* ---- row slices of weight gradients ---- */

/* matmul_dw_rows and embedding_dw_rows: slices made at the table's
 * alignment, each written by matmul_dw_rows (MTI_BWD_SET_DW, over what
 * the memory held) and added to by embedding_dw_rows, are the rows of the
 * whole gradient made from zeros (the CPU table: the same bits; any table:
 * the CPU's within the GEMM tolerance); rows off the alignment are refused
 * on the CPU. */
TEST(ops_weight_gradient_row_slices)
{
    open_tables();
    const int N = 24, I = 64, O = 1200, V = O, B = 3, T = 8;
    static const mti_dtype dts[] = {MTI_F32, MTI_BF16};
    float *dy = randv((size_t)N * O, 1.0f), *x = randv((size_t)N * I, 1.0f);
    float *dout = randv((size_t)B * T * I, 1.0f);
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = (int32_t)((i * 389) % V);
    tok[5] = tok[17] = 700; /* a repeated token */
    float *whole = malloc((size_t)O * I * 4), *sliced = malloc((size_t)O * I * 4);
    float *junk = randv((size_t)O * I, 100.0f);
    float *cpu = malloc(2 * (size_t)O * I * 4); /* per dtype */
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        for (size_t di = 0; di < sizeof dts / sizeof *dts; di++) {
            mti_dtype dt = dts[di];
            void *DY = put(t, dy, (size_t)N * O, dt), *X = put(t, x, (size_t)N * I, dt);
            void *DO = put(t, dout, (size_t)B * T * I, dt);
            int32_t *K = dev_buf(t, tok, sizeof tok);
            float *GW = dev_buf(t, NULL, (size_t)O * I * 4), *GS = dev_buf(t, junk, (size_t)O * I * 4);
            CHECK_OK(t->ops->matmul_bwd(&t->k, NULL, GW, NULL, DY, X, NULL, N, I, O, dt, 0));
            CHECK_OK(t->ops->embedding_bwd(&t->k, GW, NULL, DO, K, B, T, I, dt));
            get(t, whole, GW, (size_t)O * I, MTI_F32);
            int a = t->ops->matmul_dw_align(O, I);
            CHECK(a >= 1 && a < O);
            int rows = a * ((O / 5 + a - 1) / a); /* about 5 slices */
            for (int r0 = 0; r0 < O; r0 += rows) {
                int r1 = O - r0 < rows ? O : r0 + rows;
                float *g = GS + (size_t)r0 * I;
                CHECK_OK(t->ops->matmul_dw_rows(&t->k, g, DY, X, N, I, O, r0, r1, dt,
                                                MTI_BWD_SET_DW));
                CHECK_OK(t->ops->embedding_dw_rows(&t->k, g, DO, K, B, T, I, r0, r1, dt));
            }
            get(t, sliced, GS, (size_t)O * I, MTI_F32);
            if (ti == 0) {
                CHECK_MSG(memcmp(whole, sliced, (size_t)O * I * 4) == 0,
                          "cpu %d: sliced rows differ from the whole gradient", (int)dt);
                memcpy(cpu + di * (size_t)O * I, whole, (size_t)O * I * 4);
                if (a > 1) {
                    CHECK_ST(MT_ERR_INVALID_ARG,
                             t->ops->matmul_dw_rows(&t->k, GS, DY, X, N, I, O, 1, a, dt, 0));
                    CHECK(strstr(mt_last_error(t->ctx), "multiples of"));
                }
            } else {
                const float *c = cpu + di * (size_t)O * I;
                for (size_t j = 0; j < (size_t)O * I; j++)
                    CHECK_MSG(fabsf(sliced[j] - whole[j]) <= 1e-5f * (1.0f + fabsf(whole[j])) &&
                                  fabsf(whole[j] - c[j]) <= 1e-3f * (1.0f + fabsf(c[j])),
                              "%s %d: element %zu sliced %g whole %g cpu %g", t->name, (int)dt, j,
                              (double)sliced[j], (double)whole[j], (double)c[j]);
            }
            free_bufs(t);
        }
    }
    free(dy), free(x), free(dout), free(whole), free(sliced), free(cpu), free(junk);
    close_tables();
}

/* ---- unscale and check, sum of squares ---- */

TEST(ops_unscale_and_norm)
{
    open_tables();
    const size_t n = (size_t)MTI_SUMSQ_ROUND * 3 + 100003; /* several rounds and a part */
    float *g = randv(n, 1000), *got = malloc(n * 4);
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        float *G = put(t, g, n, MTI_F32);
        int32_t zero = 0, flag = -1;
        int *F = dev_buf(t, &zero, 4);
        CHECK_OK(t->ops->unscale_check(&t->k, G, n, 1.0f / 1024.0f, F));
        get(t, got, G, n, MTI_F32);
        dev_get(t, &flag, F, 4);
        CHECK_EQ(flag, 0);
        for (size_t i = 0; i < n; i++) CHECK(got[i] == g[i] * (1.0f / 1024.0f));
        /* one inf, or one NaN, anywhere: found; the flag is never cleared */
        static const size_t where[] = {0, 77777, 100002};
        for (int w = 0; w < 3; w++) {
            float *h = malloc(n * 4);
            memcpy(h, g, n * 4);
            h[where[w]] = w == 1 ? NAN : (w ? -INFINITY : INFINITY);
            float *H = put(t, h, n, MTI_F32);
            int *F2 = dev_buf(t, &zero, 4);
            CHECK_OK(t->ops->unscale_check(&t->k, H, n, 0.5f, F2));
            dev_get(t, &flag, F2, 4);
            CHECK_MSG(flag == 1, "%s: a non-finite gradient at %zu was not found", t->name, where[w]);
            CHECK_OK(t->ops->unscale_check(&t->k, G, n, 1.0f, F2)); /* clean: flag stays */
            dev_get(t, &flag, F2, 4);
            CHECK_EQ(flag, 1);
            free(h);
        }
        /* sum of squares against double, added onto what *S holds */
        float base = 0.25f, sumsq = 0;
        float *S = dev_buf(t, &base, 4);
        CHECK_OK(t->ops->sumsq(&t->k, S, G, n));
        dev_get(t, &sumsq, S, 4);
        double want = 0.25;
        for (size_t i = 0; i < n; i++) want += (double)got[i] * got[i];
        CHECK_MSG(fabs(sumsq - want) <= 1e-5 * want, "%s: sumsq %.9g, want %.9g", t->name, sumsq, want);
        /* in pieces starting at round boundaries, onto the same start: the
           same bits (what a row-sliced gradient relies on) */
        float pieces = 0;
        float *P = dev_buf(t, &base, 4);
        static const size_t cut[] = {MTI_SUMSQ_ROUND, 2 * MTI_SUMSQ_ROUND};
        CHECK_OK(t->ops->sumsq(&t->k, P, G, cut[0]));
        CHECK_OK(t->ops->sumsq(&t->k, P, G + cut[0], cut[1] - cut[0]));
        CHECK_OK(t->ops->sumsq(&t->k, P, G + cut[1], n - cut[1]));
        CHECK_OK(t->ops->sumsq(&t->k, P, G, 0)); /* nothing: adds nothing */
        dev_get(t, &pieces, P, 4);
        CHECK_MSG(memcmp(&pieces, &sumsq, 4) == 0, "%s: pieces %.9g, whole %.9g", t->name,
                  pieces, sumsq);
        if (ti == 0) {
            float one = 0;
            float *S1 = dev_buf(t, &base, 4);
            tabs[0].ctx->threads = 1;
            CHECK_OK(t->ops->sumsq(&t->k, S1, G, n));
            tabs[0].ctx->threads = 2;
            dev_get(t, &one, S1, 4);
            CHECK(memcmp(&one, &sumsq, 4) == 0);
        }
        free_bufs(t);
    }
    free(g), free(got);
    close_tables();
}

/* ---- optimizer updates, against the torch formulas in double ---- */

TEST(ops_optimizers)
{
    open_tables();
    const size_t n = 30011;
    float *p0 = randv(n, 1);
    float *grads[3];
    for (int s = 0; s < 3; s++) grads[s] = randv(n, 0.1f);
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        for (int variant = 0; variant < 3; variant++) { /* SGD, SGD Nesterov + dampening, AdamW */
            for (int d = 0; d < 3; d++) {
                mti_dtype dt = DTYPES[d];
                float *P = put(t, p0, n, MTI_F32), *M = dev_buf(t, NULL, n * 4), *V = dev_buf(t, NULL, n * 4);
                /* the first SGD step must not read the momentum buffer */
                if (variant < 2) CHECK_OK(t->ctx->dev->memset8(t->ctx->dev, M, 0xFF, n * 4));
                void *PC = dt == MTI_F32 ? NULL : dev_buf(t, NULL, n * 2);
                double *p = malloc(n * sizeof *p), *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
                for (size_t i = 0; i < n; i++) p[i] = p0[i];
                for (int s = 0; s < 3; s++) {
                    float *G = put(t, grads[s], n, MTI_F32);
                    const double gs = 0.5; /* grad_scale */
                    if (variant < 2) {
                        mti_sgd_args a = {.lr = 0.1f, .momentum = 0.9f, .dampening = variant ? 0.1f : 0.0f,
                                          .weight_decay = 0.01f, .nesterov = variant, .first_step = s == 0,
                                          .grad_scale = (float)gs};
                        CHECK_OK(t->ops->sgd(&t->k, P, G, M, PC, dt, n, &a));
                        for (size_t i = 0; i < n; i++) {
                            double g = grads[s][i] * gs + 0.01 * p[i];
                            m[i] = s == 0 ? g : 0.9 * m[i] + (1 - a.dampening) * g;
                            double step = variant ? g + 0.9 * m[i] : m[i];
                            p[i] -= 0.1 * step;
                        }
                    } else {
                        mti_adamw_args a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                            .weight_decay = 0.1f, .step = s + 1, .grad_scale = (float)gs};
                        CHECK_OK(t->ops->adamw(&t->k, P, G, M, V, PC, dt, n, &a));
                        double b1t = 1 - pow(0.9, s + 1), b2t = 1 - pow(0.999, s + 1);
                        for (size_t i = 0; i < n; i++) {
                            double g = grads[s][i] * gs;
                            p[i] *= 1 - 1e-2 * 0.1;
                            m[i] = 0.9 * m[i] + 0.1 * g;
                            v[i] = 0.999 * v[i] + 0.001 * g * g;
                            p[i] -= 1e-2 / b1t * m[i] / (sqrt(v[i]) / sqrt(b2t) + 1e-8);
                        }
                    }
                }
                float *got = malloc(n * 4), *want = malloc(n * 4), *pc = malloc(n * 4), *pcw = malloc(n * 4);
                get(t, got, P, n, MTI_F32);
                for (size_t i = 0; i < n; i++) want[i] = (float)p[i];
                char what[64];
                snprintf(what, sizeof what, "%s %s, refresh %s", variant == 2 ? "adamw" : variant ? "sgd nesterov" : "sgd",
                         t->name, dt_name(dt));
                expect_close(what, got, want, n, (tol){2e-5, 2e-6});
                if (PC) { /* the compute copy is the masters rounded to nearest even */
                    get(t, pc, PC, n, dt);
                    for (size_t i = 0; i < n; i++) pcw[i] = round_to(got[i], dt);
                    CHECK_MSG(memcmp(pc, pcw, n * 4) == 0, "%s: compute copy is not the masters rounded", what);
                }
                free(p), free(m), free(v), free(got), free(want), free(pc), free(pcw);
                free_bufs(t);
            }
        }
    }
    /* plain SGD: no momentum buffer at all */
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        float *P = put(t, p0, n, MTI_F32), *G = put(t, grads[0], n, MTI_F32);
        mti_sgd_args a = {.lr = 0.5f, .weight_decay = 0.1f, .first_step = 1, .grad_scale = 1.0f};
        CHECK_OK(t->ops->sgd(&t->k, P, G, NULL, NULL, MTI_F32, n, &a));
        float *got = malloc(n * 4), *want = malloc(n * 4);
        get(t, got, P, n, MTI_F32);
        for (size_t i = 0; i < n; i++) want[i] = (float)(p0[i] - 0.5 * (grads[0][i] + 0.1 * (double)p0[i]));
        expect_close("sgd without momentum", got, want, n, (tol){2e-6, 2e-7});
        free(got), free(want);
        free_bufs(t);
    }
    for (int s = 0; s < 3; s++) free(grads[s]);
    free(p0);
    close_tables();
}

/* ---- 4-bit AdamW: every table against the CPU's ----
 * (its golden vectors, threads and edge cases are in test_optim4.c). The
 * CUDA kernels make the CPU's roundings in the CPU's order and the maxima
 * are exact, so parameters, codes and scales must be the same bits: a
 * matrix (rank-1 second moment, a partial last block) and a vector, three
 * steps, a non-finite gradient at step 2, the compute copy in bf16. */
TEST(ops_optimizers_4bit)
{
    open_tables();
    static const int64_t shapes[2][3] = {{97, 131, 1}, {1, 5003, 0}};
    for (int f = 0; f < 2; f++) {
        const int64_t rows = shapes[f][0], cols = shapes[f][1];
        const int rank1 = (int)shapes[f][2];
        const size_t n = (size_t)(rows * cols), nq = (n + 1) / 2, nb = (n + MTI_Q4_BLOCK - 1) / MTI_Q4_BLOCK;
        const size_t ns = rank1 ? (size_t)(rows + cols) : nb;
        float *p0 = randv(n, 1), *grads[3];
        for (int s = 0; s < 3; s++) grads[s] = randv(n, 0.1f);
        grads[1][17] = NAN;
        float *ref = malloc((n + nb + ns) * 4), *got = malloc((n + nb + ns) * 4);
        uint8_t *ref_q = malloc(2 * nq), *got_q = malloc(2 * nq);
        float *pc = malloc(n * 4), *pcw = malloc(n * 4);
        for (int ti = 0; ti < n_tabs; ti++) {
            tab *t = &tabs[ti];
            float *P = put(t, p0, n, MTI_F32);
            uint8_t *Q = dev_buf(t, NULL, 2 * nq);
            float *S = dev_buf(t, NULL, (nb + ns) * 4);
            void *PC = dev_buf(t, NULL, n * 2);
            CHECK_OK(t->ctx->dev->memset8(t->ctx->dev, Q, 0x77, nq));
            mti_adamw4_state st = {.qm = Q, .qv = Q + nq, .absmax_m = S, .scale_v = S + nb};
            for (int s = 0; s < 3; s++) {
                float *G = put(t, grads[s], n, MTI_F32);
                mti_adamw_args a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                    .weight_decay = 0.1f, .step = s + 1, .grad_scale = 0.5f};
                CHECK_OKC(t->ctx, t->ops->adamw4(&t->k, P, G, &st, PC, MTI_BF16, rows, cols, rank1, &a));
            }
            float *R = ti ? got : ref;
            uint8_t *RQ = ti ? got_q : ref_q;
            get(t, R, P, n, MTI_F32);
            dev_get(t, R + n, S, (nb + ns) * 4);
            dev_get(t, RQ, Q, 2 * nq);
            get(t, pc, PC, n, MTI_BF16);
            for (size_t i = 0; i < n; i++) pcw[i] = round_to(R[i], MTI_BF16);
            CHECK_MSG(memcmp(pc, pcw, n * 4) == 0, "adamw4 %s: compute copy is not the masters rounded", t->name);
            if (ti) {
                CHECK_MSG(memcmp(got, ref, n * 4) == 0, "adamw4 %s %s: parameters differ from the CPU's", t->name, rank1 ? "matrix" : "vector");
                CHECK_MSG(memcmp(got_q, ref_q, 2 * nq) == 0, "adamw4 %s %s: codes differ from the CPU's", t->name, rank1 ? "matrix" : "vector");
                CHECK_MSG(memcmp(got + n, ref + n, (nb + ns) * 4) == 0, "adamw4 %s %s: scales differ from the CPU's", t->name, rank1 ? "matrix" : "vector");
            }
            free_bufs(t);
        }
        for (int s = 0; s < 3; s++) free(grads[s]);
        free(p0), free(ref), free(got), free(ref_q), free(got_q), free(pc), free(pcw);
    }
    close_tables();
}

/* ---- 8-bit AdamW and Adafactor: every table against the CPU's ----
 * (their golden vectors, threads and edge cases are in test_optim.c).
 * adamw8: the CUDA kernel makes the CPU's roundings in the CPU's order, so
 * codes, absmax and parameters must be the same bits. Adafactor: its sums
 * run in another order on the GPU, so the parameters may differ by a few
 * fp32 roundings of the update: 2 ulps of the value plus 1e-4 of the
 * element's total step plus 1e-5 of the largest; the state 1e-5 relative. */

static void expect_near_step(const char *what, const float *got, const float *want,
                             const float *p0, size_t n)
{
    double maxstep = 0;
    for (size_t i = 0; i < n; i++) maxstep = fmax(maxstep, fabs((double)want[i] - p0[i]));
    for (size_t i = 0; i < n; i++) {
        double step = fabs((double)want[i] - p0[i]), w = fabs((double)want[i]);
        double lim = 2.4e-7 * w + 1e-4 * step + 1e-5 * maxstep;
        CHECK_MSG(fabs((double)got[i] - want[i]) <= lim, "%s: element %zu is %.9g, expected %.9g",
                  what, i, got[i], want[i]);
    }
}

TEST(ops_optimizers_8bit_adafactor)
{
    open_tables();
    const size_t n = 30011, nb = (n + MTI_Q8_BLOCK - 1) / MTI_Q8_BLOCK;
    float *p0 = randv(n, 1), *grads[3];
    for (int s = 0; s < 3; s++) grads[s] = randv(n, 0.1f);
    const float keep = grads[1][17];
    grads[1][17] = NAN; /* a non-finite gradient: that element is skipped */
    /* results of table 0 (the CPU), then of each other table */
    float *ref_p = malloc(n * 4), *got_p = malloc(n * 4), *ref_am = malloc(nb * 8), *got_am = malloc(nb * 8);
    uint8_t *ref_q = malloc(2 * n), *got_q = malloc(2 * n);
    float *pc = malloc(n * 4), *pcw = malloc(n * 4);
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        float *P = put(t, p0, n, MTI_F32), *AM = dev_buf(t, NULL, nb * 4), *AV = dev_buf(t, NULL, nb * 4);
        uint8_t *Q = dev_buf(t, NULL, 2 * n), *QM = Q, *QV = Q + n;
        void *PC = dev_buf(t, NULL, n * 2);
        uint8_t zero_m = mti_q8_zero_code(1);
        CHECK_OK(t->ctx->dev->memset8(t->ctx->dev, QM, zero_m, n));
        for (int s = 0; s < 3; s++) {
            float *G = put(t, grads[s], n, MTI_F32);
            mti_adamw_args a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                .weight_decay = 0.1f, .step = s + 1, .grad_scale = 0.5f};
            CHECK_OKC(t->ctx, t->ops->adamw8(&t->k, P, G, QM, QV, AM, AV, PC, MTI_BF16, n, &a));
        }
        float *P_ = ti ? got_p : ref_p, *A_ = ti ? got_am : ref_am;
        uint8_t *Q_ = ti ? got_q : ref_q;
        get(t, P_, P, n, MTI_F32);
        dev_get(t, A_, AM, nb * 4);
        dev_get(t, A_ + nb, AV, nb * 4);
        dev_get(t, Q_, Q, 2 * n);
        get(t, pc, PC, n, MTI_BF16);
        for (size_t i = 0; i < n; i++) pcw[i] = round_to(P_[i], MTI_BF16);
        CHECK_MSG(memcmp(pc, pcw, n * 4) == 0, "adamw8 %s: compute copy is not the masters rounded", t->name);
        if (ti) {
            CHECK_MSG(memcmp(got_p, ref_p, n * 4) == 0, "adamw8 %s: parameters differ from the CPU's", t->name);
            CHECK_MSG(memcmp(got_q, ref_q, 2 * n) == 0, "adamw8 %s: codes differ from the CPU's", t->name);
            CHECK_MSG(memcmp(got_am, ref_am, nb * 8) == 0, "adamw8 %s: absmax differs from the CPU's", t->name);
        }
        free_bufs(t);
    }
    /* bf16 weights without masters, in one pass: the weights rounded back
     * stochastically, starting 40 blocks before the end of a piece and
     * crossing into the next, so both pieces' seeds are used; in two calls
     * cut at a block inside the first piece */
    const size_t at = MTI_SR_PIECE - 40 * MTI_Q8_BLOCK, nw = 20 * MTI_Q8_BLOCK;
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        uint16_t *W = put(t, p0, n, MTI_BF16);
        float *AM = dev_buf(t, NULL, nb * 4), *AV = dev_buf(t, NULL, nb * 4);
        uint8_t *Q = dev_buf(t, NULL, 2 * n), *QM = Q, *QV = Q + n;
        CHECK_OK(t->ctx->dev->memset8(t->ctx->dev, QM, mti_q8_zero_code(1), n));
        for (int s = 0; s < 3; s++) {
            float *G = put(t, grads[s], n, MTI_F32);
            mti_adamw_args a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                .weight_decay = 0.1f, .step = s + 1, .grad_scale = 0.5f};
            /* two calls, the second from the first's end (a block, not a piece) */
            CHECK_OKC(t->ctx, t->ops->adamw8_bf16(&t->k, W, G, QM, QV, AM, AV, nw, at, 77 + s, &a));
            CHECK_OKC(t->ctx, t->ops->adamw8_bf16(&t->k, W + nw, G + nw, QM + nw, QV + nw,
                                                  AM + nw / MTI_Q8_BLOCK, AV + nw / MTI_Q8_BLOCK,
                                                  n - nw, at + nw, 77 + s, &a));
        }
        float *P_ = ti ? got_p : ref_p, *A_ = ti ? got_am : ref_am;
        uint8_t *Q_ = ti ? got_q : ref_q;
        get(t, P_, W, n, MTI_BF16);
        dev_get(t, A_, AM, nb * 4);
        dev_get(t, A_ + nb, AV, nb * 4);
        dev_get(t, Q_, Q, 2 * n);
        if (ti) {
            CHECK_MSG(memcmp(got_p, ref_p, n * 4) == 0, "adamw8_bf16 %s: weights differ from the CPU's", t->name);
            CHECK_MSG(memcmp(got_q, ref_q, 2 * n) == 0, "adamw8_bf16 %s: codes differ from the CPU's", t->name);
            CHECK_MSG(memcmp(got_am, ref_am, nb * 8) == 0, "adamw8_bf16 %s: absmax differs from the CPU's", t->name);
        }
        free_bufs(t);
    }
    grads[1][17] = keep;
    /* Adafactor: factored (a matrix with partial tiles) and not, with a
     * first moment and weight decay, relative step and parameter scale */
    static const int64_t shapes[2][2] = {{97, 131}, {1, 5003}};
    for (int f = 0; f < 2; f++) {
        int64_t rows = shapes[f][0], cols = shapes[f][1];
        size_t m = (size_t)(rows * cols);
        float *ref_s = malloc((m + 4096) * 4), *got_s = malloc((m + 4096) * 4);
        for (int ti = 0; ti < n_tabs; ti++) {
            tab *t = &tabs[ti];
            float *P = put(t, p0, m, MTI_F32), *M = dev_buf(t, NULL, m * 4);
            float *R = dev_buf(t, NULL, (size_t)rows * 4), *C = dev_buf(t, NULL, (size_t)cols * 4);
            float *V = dev_buf(t, NULL, m * 4);
            for (int s = 0; s < 3; s++) {
                float *G = put(t, grads[s], m, MTI_F32);
                mti_adafactor_args a = {.eps1 = 1e-30f, .eps2 = 1e-3f, .clip_threshold = 1.0f,
                                        .decay_rate = -0.8f, .beta1 = 0.9f, .weight_decay = 0.01f,
                                        .scale_parameter = 1, .relative_step = 1, .step = s + 1,
                                        .grad_scale = 2.0f};
                CHECK_OKC(t->ctx, t->ops->adafactor(&t->k, P, G, f ? NULL : R, f ? NULL : C, f ? V : NULL,
                                                    M, NULL, MTI_F32, rows, cols, !f, &a));
            }
            float *P_ = ti ? got_p : ref_p, *S_ = ti ? got_s : ref_s;
            get(t, P_, P, m, MTI_F32);
            get(t, S_, M, m, MTI_F32);
            if (f) get(t, S_ + m, V, m < 4096 ? m : 4096, MTI_F32);
            else {
                get(t, S_ + m, R, (size_t)rows, MTI_F32);
                get(t, S_ + m + (size_t)rows, C, (size_t)cols, MTI_F32);
            }
            if (ti) {
                char what[64];
                snprintf(what, sizeof what, "adafactor %s, %s", t->name, f ? "unfactored" : "factored");
                expect_near_step(what, got_p, ref_p, p0, m);
                size_t ns = f ? (m < 4096 ? m : 4096) : (size_t)(rows + cols);
                expect_close(what, got_s + m, ref_s + m, ns, (tol){1e-5, 0});
                expect_close(what, got_s, ref_s, m, (tol){1e-4, 1e-6});
            }
            free_bufs(t);
        }
        free(ref_s), free(got_s);
    }
    for (int s = 0; s < 3; s++) free(grads[s]);
    free(p0), free(ref_p), free(got_p), free(ref_am), free(got_am), free(ref_q), free(got_q);
    free(pc), free(pcw);
    close_tables();
}

/* Tensor parallel's ops: embedding_fwd_rows over shares of the table's rows
 * adds up to embedding_fwd's rows exactly (one share holds each token), and
 * xent_vp over column shares of the logits (the group's max and sums made
 * here by hand) gives xent's losses and dlogits within fp32 rounding, the
 * padding columns zero; a share with no real column (the last) takes part
 * with -inf and zeros. Shares of 3 uneven widths, fp32 and bf16. */
TEST(ops_tensor_parallel)
{
    open_tables();
    const int N = 7, V = 40, Vp = 64, C = 40, B = 1, T = 7, S = 3;
    const int cut[4] = {0, 21, 42, 64};
    static const mti_dtype dts[] = {MTI_F32, MTI_BF16};
    float *logits = randv((size_t)N * Vp, 4.0f), *wte = randv((size_t)Vp * C, 1.0f);
    int32_t tgt[7] = {0, 20, 21, 39, 38, 30, 7}, tok[7] = {3, 21, 63, 42, 0, 20, 41};
    float *want_l = malloc(N * 4), *want_d = malloc((size_t)N * Vp * 4);
    float *got_d = malloc((size_t)N * Vp * 4), *emb = malloc((size_t)N * C * 4);
    float *sum = malloc((size_t)N * C * 4), *part = malloc((size_t)N * C * 4);
    float stats[3][3 * 7], loss[3][7];
    for (int ti = 0; ti < n_tabs; ti++) {
        tab *t = &tabs[ti];
        for (size_t di = 0; di < sizeof dts / sizeof *dts; di++) {
            const mti_dtype dt = dts[di];
            float *L = dev_buf(t, NULL, N * 4);
            void *X = put(t, logits, (size_t)N * Vp, dt);
            int32_t *G = dev_buf(t, tgt, sizeof tgt), *K = dev_buf(t, tok, sizeof tok);
            CHECK_OK(t->ops->xent(&t->k, L, X, X, G, N, V, Vp, 0.5f, dt));
            get(t, want_l, L, N, MTI_F32);
            get(t, want_d, X, (size_t)N * Vp, dt);
            void *sh[3];
            float *ST[3], *SL[3];
            for (int q = 0; q < S; q++) { /* each share's columns, as its own tensor */
                const int W = cut[q + 1] - cut[q];
                float *cols = malloc((size_t)N * W * 4);
                for (int r = 0; r < N; r++) memcpy(cols + r * W, logits + r * Vp + cut[q], W * 4);
                sh[q] = put(t, cols, (size_t)N * W, dt);
                free(cols);
                ST[q] = dev_buf(t, NULL, 3 * N * 4);
                SL[q] = dev_buf(t, NULL, N * 4);
            }
            for (int phase = 0; phase < 3; phase++) {
                for (int q = 0; q < S; q++) {
                    const int W = cut[q + 1] - cut[q];
                    const int Vr = V - cut[q] < 0 ? 0 : V - cut[q] > W ? W : V - cut[q];
                    if (phase) {
                        CHECK_OK(t->ctx->dev->copy_h2d(t->ctx->dev, ST[q], stats[0], 3 * N * 4));
                        CHECK_OK(t->ctx->dev->sync(t->ctx->dev));
                    }
                    CHECK_OK(t->ops->xent_vp(&t->k, phase, ST[q], SL[q], sh[q], sh[q], G, N,
                                             cut[q], Vr, W, 0.5f, dt));
                    get(t, stats[q], ST[q], 3 * N, MTI_F32);
                }
                for (int r = 0; r < (phase < 2 ? N : 0); r++) { /* the group's max, then sums */
                    for (int q = 1; q < S; q++) {
                        if (phase == 0) stats[0][r] = fmaxf(stats[0][r], stats[q][r]);
                        else stats[0][N + r] += stats[q][N + r], stats[0][2 * N + r] += stats[q][2 * N + r];
                    }
                    if (phase == 0) CHECK(isinf(stats[2][r]) && stats[2][r] < 0); /* (none real) */
                }
            }
            for (int q = 0; q < S; q++) {
                const int W = cut[q + 1] - cut[q];
                float *cols = malloc((size_t)N * W * 4);
                get(t, cols, sh[q], (size_t)N * W, dt);
                get(t, loss[q], SL[q], N, MTI_F32);
                for (int r = 0; r < N; r++) memcpy(got_d + r * Vp + cut[q], cols + r * W, W * 4);
                free(cols);
            }
            const float eps = dt == MTI_F32 ? 1e-5f : 1e-2f;
            for (int r = 0; r < N; r++)
                for (int q = 0; q < S; q++)
                    CHECK_MSG(fabsf(loss[q][r] - want_l[r]) <= 1e-5f * (1.0f + fabsf(want_l[r])),
                              "%s %d: row %d share %d loss %g, xent %g", t->name, (int)dt, r, q,
                              (double)loss[q][r], (double)want_l[r]);
            for (size_t j = 0; j < (size_t)N * Vp; j++)
                CHECK_MSG(fabsf(got_d[j] - want_d[j]) <= eps * (1e-3f + fabsf(want_d[j])) &&
                              ((int)(j % Vp) < V || got_d[j] == 0.0f),
                          "%s %d: dlogits[%zu] %g, xent %g", t->name, (int)dt, j,
                          (double)got_d[j], (double)want_d[j]);
            /* the embedding's shares */
            void *Wt = put(t, wte, (size_t)Vp * C, dt), *E = dev_buf(t, NULL, (size_t)N * C * 4);
            CHECK_OK(t->ops->embedding_fwd(&t->k, E, K, Wt, NULL, B, T, C, dt));
            get(t, emb, E, (size_t)N * C, dt);
            memset(sum, 0, (size_t)N * C * 4);
            for (int q = 0; q < S; q++) {
                const size_t off = (size_t)cut[q] * C * dsize(dt);
                CHECK_OK(t->ops->embedding_fwd_rows(&t->k, E, K, (const char *)Wt + off, cut[q],
                                                    cut[q + 1], B, T, C, dt));
                get(t, part, E, (size_t)N * C, dt);
                for (size_t j = 0; j < (size_t)N * C; j++) sum[j] += part[j];
            }
            CHECK_MSG(memcmp(sum, emb, (size_t)N * C * 4) == 0, "%s %d: the shares' sum differs",
                      t->name, (int)dt);
            free_bufs(t);
        }
    }
    free(logits), free(wte), free(want_l), free(want_d), free(got_d), free(emb), free(sum), free(part);
    close_tables();
}
