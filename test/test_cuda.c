/*
 * test_cuda.c - the CUDA op table and device layer over the stand-in
 * driver and cuBLASLt (test/fake_cuda; paths in MT_FAKE_CUDA and
 * MT_FAKE_CUBLASLT, and these tests pass without checking anything when
 * they are not set): what cuBLASLt's refusals, the driver's failures and
 * the debug mode do to the ops, where no GPU is needed to show it. The
 * stand-in driver runs a few kernels on the host (see fake_libcuda.c); the
 * rest are counted only, so these tests check the host side: which kernel
 * and GEMM run, with which arguments, and what status and message come out.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "check.h"
#include "device/cuda_device.h"
#include "device/cuda_driver.h"
#include "internal.h"
#include "ops/kernels.h"
#include "quant/quant.h"

/* The refusal rules of the stand-in cuBLASLt (fake_cublaslt.c). */
enum {
    FAKE_LT_REFUSE_ALL = 1u,
    FAKE_LT_REFUSE_BIAS = 2u,
    FAKE_LT_SAY_EMPTY = 4u,
    FAKE_LT_ALIGN16 = 8u,
};

/* The stand-ins' test hooks, from the same libraries the context loads. */
typedef struct stand_in {
    void *cuda, *lt;
    void (*fail)(const char *call, int skip, CUresult code);
    unsigned long long (*cuda_stat)(const char *name);
    const char *(*last_kernel)(void);
    unsigned long long (*lt_stat)(const char *name);
    unsigned (*lt_rules)(unsigned rules);
    unsigned old_rules;
} stand_in;

static void *sym(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    CHECK_MSG(p, "the stand-in has no %s", name);
    return p;
}

/* false (the test then checks nothing) when the stand-ins are not named. */
static bool stand_in_open(stand_in *s)
{
    memset(s, 0, sizeof *s);
    const char *cu = check_fake_cuda(), *lt = getenv("MT_FAKE_CUBLASLT");
    if (!cu || !lt || !*lt) return false;
    s->cuda = dlopen(cu, RTLD_NOW | RTLD_LOCAL);
    s->lt = dlopen(lt, RTLD_NOW | RTLD_LOCAL);
    CHECK_MSG(s->cuda && s->lt, "cannot load the stand-ins: %s", dlerror());
    void *p;
    /* copied, as ISO C has no object-to-function pointer conversion */
    p = sym(s->cuda, "fake_cuda_fail"), memcpy(&s->fail, &p, sizeof p);
    p = sym(s->cuda, "fake_cuda_stat"), memcpy(&s->cuda_stat, &p, sizeof p);
    p = sym(s->cuda, "fake_cuda_last_kernel"), memcpy(&s->last_kernel, &p, sizeof p);
    p = sym(s->lt, "fake_cublaslt_stat"), memcpy(&s->lt_stat, &p, sizeof p);
    p = sym(s->lt, "fake_cublaslt_rules"), memcpy(&s->lt_rules, &p, sizeof p);
    s->old_rules = s->lt_rules(0);
    s->lt_rules(s->old_rules);
    return true;
}

static void stand_in_close(stand_in *s)
{
    s->lt_rules(s->old_rules);
    s->fail("", 0, 0);
    dlclose(s->cuda);
    dlclose(s->lt);
}

/* A CUDA context over the stand-ins, its op table and kernel context. */
typedef struct cuda_ctx {
    mt_context *ctx;
    const mti_ops *ops;
    mti_kctx k;
} cuda_ctx;

static void cuda_open_cfg(cuda_ctx *c, mt_context_config *cfg)
{
    cfg->device = MT_DEVICE_CUDA;
    cfg->cuda_driver_path = check_fake_cuda();
    cfg->cublaslt_path = getenv("MT_FAKE_CUBLASLT");
    CHECK_OK(mt_context_create(cfg, &c->ctx));
    CHECK_OKC(c->ctx, mti_cuda_ops(c->ctx->dev, &c->ops));
    c->k = (mti_kctx){c->ctx, c->ctx->dev};
}

static void cuda_open(cuda_ctx *c)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cuda_open_cfg(c, &cfg);
}

static void *dev_alloc(cuda_ctx *c, mt_block *b, size_t bytes)
{
    mt_alloc_request r = {.bytes = bytes, .mem_class = MT_MEM_IO, .lifetime = MT_LIFE_PERSISTENT};
    CHECK_OKC(c->ctx, mt_context_alloc(c->ctx, &r, b));
    CHECK_OKC(c->ctx, c->ctx->dev->memset8(c->ctx->dev, b->ptr, 0, bytes));
    return b->ptr;
}

/* ---- cuBLASLt's "no algorithm" ---- */

/* y (n, out) = x (n, in) . W^T + b with the bias epilogue refused: the
 * fallback sets y to the bias rows and adds the product; the answer is kept,
 * so a second call asks the heuristic nothing. */
static void bias_fallback(stand_in *s, unsigned rules)
{
    cuda_ctx c;
    cuda_open(&c);
    enum { N = 16, IN = 32, OUT = 24 };
    mt_block bx, bw, bb, by;
    void *x = dev_alloc(&c, &bx, N * IN * 4), *w = dev_alloc(&c, &bw, OUT * IN * 4);
    void *b = dev_alloc(&c, &bb, OUT * 4), *y = dev_alloc(&c, &by, N * OUT * 4);
    s->lt_rules(rules);
    unsigned long long h0 = s->lt_stat("heuristics"), m0 = s->lt_stat("matmuls");
    unsigned long long r0 = s->lt_stat("refusals");
    CHECK_OKC(c.ctx, c.ops->matmul_fwd(&c.k, y, x, w, b, N, IN, OUT, MTI_F32));
    CHECK_MSG(strcmp(s->last_kernel(), "mt_bias_rows_f32") == 0, "last kernel %s",
              s->last_kernel());
    CHECK_EQ(s->lt_stat("heuristics"), h0 + 2); /* with the bias, then without */
    CHECK_EQ(s->lt_stat("refusals"), r0 + 1);
    CHECK_EQ(s->lt_stat("matmuls"), m0 + 1);
    CHECK_OKC(c.ctx, c.ops->matmul_fwd(&c.k, y, x, w, b, N, IN, OUT, MTI_F32));
    CHECK_EQ(s->lt_stat("heuristics"), h0 + 2);
    CHECK_EQ(s->lt_stat("matmuls"), m0 + 2);

    /* no algorithm at all: UNSUPPORTED naming the problem, asked once */
    s->lt_rules(rules | FAKE_LT_REFUSE_ALL);
    h0 = s->lt_stat("heuristics");
    for (int i = 0; i < 2; i++) {
        CHECK_ST(MT_ERR_UNSUPPORTED,
                 c.ops->matmul_bwd(&c.k, x, NULL, NULL, y, x, w, N, IN, OUT, MTI_F32, 0));
        CHECK_MSG(strstr(mt_last_error(c.ctx), "no algorithm for m=32 n=16 k=24"), "%s",
                  mt_last_error(c.ctx));
    }
    CHECK_EQ(s->lt_stat("heuristics"), h0 + 1);
    s->lt_rules(s->old_rules);
    mt_block *all[] = {&bx, &bw, &bb, &by};
    for (int i = 0; i < 4; i++) CHECK_OKC(c.ctx, mt_context_free(c.ctx, all[i]));
    CHECK_OK(mt_context_destroy(c.ctx));
}

TEST(cuda_standin_no_algorithm_is_an_answer)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    bias_fallback(&s, FAKE_LT_REFUSE_BIAS);                     /* CUBLAS_STATUS_NOT_SUPPORTED */
    bias_fallback(&s, FAKE_LT_REFUSE_BIAS | FAKE_LT_SAY_EMPTY); /* zero results */
    stand_in_close(&s);
}

/* ---- row slices of the tied table ---- */

/* A training step of a tied-head model on the CUDA path, with the stand-in
 * cuBLASLt refusing any operand aligned less than 16 bytes (as the real one
 * may). The fused step makes the tied table's gradient in slices of about 4
 * MiB: at 768 channels 1365 rows before alignment, so a slice of a 16-bit
 * dy would start 2 bytes off a 16-byte boundary. 11008 x 768 is the
 * smallest table (a multiple of 64 rows) cut that way. */
static const mt_layer_spec tied_layers[] = {
    {.kind = MT_LAYER_EMBEDDING, .units = 768, .positions = 1},
    {.kind = MT_LAYER_LAYERNORM},
    {.kind = MT_LAYER_LM_HEAD},
};

static void tied_step(stand_in *s, mt_precision prec, int fused, float clip)
{
    cuda_ctx c;
    cuda_open(&c);
    mt_model_spec sp;
    mt_model_spec_init(&sp);
    sp.input = MT_INPUT_TOKENS, sp.vocab = 11008, sp.max_seq = 16;
    sp.n_layers = (int)(sizeof tied_layers / sizeof *tied_layers), sp.layers = tied_layers;
    mt_model *m = NULL;
    CHECK_OKC(c.ctx, mt_model_create(c.ctx, &sp, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 2, tc.max_seq = 16, tc.optimizer = MT_OPT_ADAMW, tc.lr = 1e-3f;
    tc.precision = prec, tc.fused_step = fused, tc.grad_clip = clip;
    mt_trainer *t = NULL;
    CHECK_OKC(c.ctx, mt_trainer_create(m, &tc, &t));
    int32_t ids[2 * 16 + 1];
    for (int i = 0; i < 2 * 16 + 1; i++) ids[i] = (i * 337 + 11) % 11008;
    mt_batch b = {.n = 2, .tokens = ids, .targets = ids + 1, .seq_len = 16};
    unsigned long long r0 = s->lt_stat("refusals");
    CHECK_OKC(c.ctx, mt_trainer_step(t, &b, NULL));
    CHECK_EQ(s->lt_stat("refusals"), r0);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(c.ctx));
}

TEST(cuda_standin_tied_slices_are_aligned)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    s.lt_rules(FAKE_LT_ALIGN16);
    tied_step(&s, MT_PREC_BF16, 1, 0.0f);
    tied_step(&s, MT_PREC_FP32, 1, 0.0f);

    /* the op itself: slices at its alignment are served, others refused */
    cuda_ctx c;
    cuda_open(&c);
    enum { N = 8, I = 32, O = 500 };
    mt_block bdy, bx, bw;
    void *dy = dev_alloc(&c, &bdy, N * O * 2), *x = dev_alloc(&c, &bx, N * I * 2);
    float *dw = dev_alloc(&c, &bw, O * I * 4);
    int a = c.ops->matmul_dw_align(O, I);
    CHECK(a % 8 == 0);
    CHECK_OKC(c.ctx, c.ops->matmul_dw_rows(&c.k, dw + a * I, dy, x, N, I, O, a, 2 * a, MTI_BF16, 0));
    CHECK_OKC(c.ctx, c.ops->matmul_dw_rows(&c.k, dw + a * I, dy, x, N, I, O, a, O, MTI_BF16,
                                                     MTI_BWD_SET_DW));
    CHECK_ST(MT_ERR_INVALID_ARG,
             c.ops->matmul_dw_rows(&c.k, dw + I, dy, x, N, I, O, 1, a, MTI_BF16, 0));
    CHECK(strstr(mt_last_error(c.ctx), "multiples of 8"));
    mt_block *all[] = {&bdy, &bx, &bw};
    for (int i = 0; i < 3; i++) CHECK_OKC(c.ctx, mt_context_free(c.ctx, all[i]));
    CHECK_OK(mt_context_destroy(c.ctx));
    stand_in_close(&s);
}

/* ---- the stand-in's default refusals ---- */

/* By default the stand-in cuBLASLt refuses what the real one may (16-bit
 * operands off 16 bytes, the bias epilogue on some shapes), so ordinary
 * CUDA runs in the tests take the fallbacks: an MLP step whose layers are
 * 64, 48 and 10 wide (10: no bias epilogue) runs with refusals. */
TEST(cuda_standin_refuses_by_default)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    CHECK(s.old_rules != 0);
    cuda_ctx c;
    cuda_open(&c);
    mt_mlp_spec ml;
    mt_mlp_spec_init(&ml);
    ml.n_layers = 3, ml.dims[0] = 24, ml.dims[1] = 64, ml.dims[2] = 48, ml.dims[3] = 10;
    mt_model *m = NULL;
    CHECK_OKC(c.ctx, mt_model_mlp_create(c.ctx, &ml, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 4, tc.optimizer = MT_OPT_ADAMW, tc.lr = 1e-3f;
    mt_trainer *t = NULL;
    CHECK_OKC(c.ctx, mt_trainer_create(m, &tc, &t));
    float x[4 * 24] = {0};
    int32_t y[4] = {1, 2, 3, 4};
    mt_batch b = {.n = 4, .inputs = x, .targets = y};
    unsigned long long r0 = s.lt_stat("refusals"), m0 = s.lt_stat("matmuls");
    for (int i = 0; i < 2; i++) CHECK_OKC(c.ctx, mt_trainer_step(t, &b, NULL));
    CHECK_EQ(s.lt_stat("refusals"), r0 + 1); /* the 10-wide layer's bias, once */
    CHECK(s.lt_stat("matmuls") > m0);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(c.ctx));
    stand_in_close(&s);
}

/* ---- distillation ---- */

/* xent_kd runs its own kernel (per dtype), alpha 0 runs xent's, nothing
 * runs for no rows, and bad settings are refused before any launch. */
TEST(cuda_standin_distillation_kernel)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    cuda_ctx c;
    cuda_open(&c);
    enum { N = 3, V = 50, VP = 64, TVP = 56 };
    mt_block bl, bs, bt, bg;
    float *L = dev_alloc(&c, &bl, N * 4), *S = dev_alloc(&c, &bs, N * VP * 4);
    float *Tl = dev_alloc(&c, &bt, N * TVP * 4);
    int32_t *G = dev_alloc(&c, &bg, N * 4);
    static const char *const names[3] = {"mt_xent_kd_f32", "mt_xent_kd_f16", "mt_xent_kd_bf16"};
    for (int dt = 0; dt < 3; dt++) {
        CHECK_OKC(c.ctx, c.ops->xent_kd(&c.k, L, S, S, Tl, G, N, V, VP, TVP, 0.5f, 2.0f, 1.0f,
                                        (mti_dtype)dt));
        CHECK_MSG(!strcmp(s.last_kernel(), names[dt]), "ran %s", s.last_kernel());
    }
    CHECK_OKC(c.ctx, c.ops->xent_kd(&c.k, L, S, S, Tl, G, N, V, VP, TVP, 0.0f, 2.0f, 1.0f, MTI_BF16));
    CHECK_MSG(!strcmp(s.last_kernel(), "mt_xent_bf16"), "ran %s", s.last_kernel());
    unsigned long long launches = s.cuda_stat("launches");
    CHECK_OKC(c.ctx, c.ops->xent_kd(&c.k, L, S, S, Tl, G, 0, V, VP, TVP, 0.5f, 2.0f, 1.0f, MTI_F32));
    CHECK_ST(MT_ERR_INVALID_ARG,
             c.ops->xent_kd(&c.k, L, S, S, Tl, G, N, V, VP, TVP, 0.5f, 0.0f, 1.0f, MTI_F32));
    CHECK(strstr(mt_last_error(c.ctx), "temperature"));
    CHECK_ST(MT_ERR_INVALID_ARG,
             c.ops->xent_kd(&c.k, L, S, S, Tl, G, N, V, VP, V - 1, 0.5f, 1.0f, 1.0f, MTI_F32));
    CHECK_ST(MT_ERR_INVALID_ARG,
             c.ops->xent_kd(&c.k, L, S, S, Tl, G, N, V, VP, TVP, 0.5f, 1.0f, 1.0f, MTI_I32));
    CHECK_EQ(s.cuda_stat("launches"), launches);
    CHECK_OKC(c.ctx, mt_context_free(c.ctx, &bl));
    CHECK_OKC(c.ctx, mt_context_free(c.ctx, &bs));
    CHECK_OKC(c.ctx, mt_context_free(c.ctx, &bt));
    CHECK_OKC(c.ctx, mt_context_free(c.ctx, &bg));
    CHECK_OK(mt_context_destroy(c.ctx));
    stand_in_close(&s);
}

/* ---- the dequantizing kernels and the quantized matmuls ---- */

/* A weight of R x I values with blocks of every kind: mixed magnitudes, a
 * row of zeros, values on NF4's midpoints, a partial last block. */
static float *dq_weight(size_t R, size_t I)
{
    float *w = check_alloc(R * I * 4);
    uint64_t s = 0x5EED;
    for (size_t i = 0; i < R * I; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        float u = (float)(s >> 40) / 8388608.0f - 1.0f;
        w[i] = u * (i % 7 == 0 ? 40.0f : i % 5 == 0 ? 1e-3f : 1.0f);
    }
    for (size_t c = 0; c < I; c++) w[I + c] = 0.0f; /* row 1 */
    return w;
}

/* Tiles of the (R, I) weight quantized in fq (format f) on the device,
 * dequantized by mti_cuda_dequantize in every dtype, against lib/quant/quant.c's
 * dequantizer bit for bit (fp16: its fp32 value rounded to nearest even);
 * the columns between a tile's width and its leading dimension are left
 * alone. */
static void dq_tiles(cuda_ctx *c, int f, const void *fq, const void *hq, size_t R, size_t I)
{
    const size_t tiles[][5] = {/* r0, rows, c0, cols, ld */
                               {0, R, 0, I, I},
                               {3, 7, 0, I, I},
                               {0, R, 5, 130, 130},
                               {1, 3, 63, 67, 70},
                               {R - 1, 1, I - 9, 9, 16}};
    for (size_t t = 0; t < sizeof tiles / sizeof tiles[0]; t++) {
        const size_t r0 = tiles[t][0], rows = tiles[t][1], c0 = tiles[t][2], cols = tiles[t][3],
                     ld = tiles[t][4];
        for (int dt = 0; dt < 3; dt++) {
            const size_t es = dt ? 2 : 4, bytes = rows * ld * es;
            mt_block bo;
            unsigned char *o = dev_alloc(c, &bo, bytes);
            CHECK_OK(c->ctx->dev->memset8(c->ctx->dev, o, 0xA5, bytes));
            CHECK_OKC(c->ctx, mti_cuda_dequantize(&c->k, f, fq, R, I, r0, rows, c0, cols, o, ld,
                                                  (mti_dtype)dt));
            unsigned char *got = check_alloc(bytes), *want = check_alloc(bytes);
            CHECK_OK(c->ctx->dev->copy_d2h(c->ctx->dev, got, o, bytes));
            CHECK_OK(c->ctx->dev->sync(c->ctx->dev));
            memset(want, 0xA5, bytes);
            float *row = check_alloc(cols * 4);
            for (size_t r = 0; r < rows; r++) {
                unsigned char *w = want + r * ld * es;
                size_t at = (r0 + r) * I + c0;
                if (dt == MTI_BF16) {
                    CHECK_OK(mti_dequantize(NULL, (mti_qformat)f, hq, R * I, at, cols, w, MTI_BF16));
                    continue;
                }
                CHECK_OK(mti_dequantize(NULL, (mti_qformat)f, hq, R * I, at, cols, row, MTI_F32));
                if (dt == MTI_F32) memcpy(w, row, cols * 4);
                else
                    for (size_t j = 0; j < cols; j++) {
                        uint16_t h = mti_f32_to_f16(row[j]);
                        memcpy(w + 2 * j, &h, 2);
                    }
            }
            CHECK_MSG(!memcmp(got, want, bytes),
                      "%s tile %zu (rows [%zu,%zu) x columns [%zu,%zu)) dtype %d: not "
                      "lib/quant/quant.c's bits",
                      mti_quant_name((mti_qformat)f), t, r0, r0 + rows, c0, c0 + cols, dt);
            CHECK_OKC(c->ctx, mt_context_free(c->ctx, &bo));
        }
    }
}

/* Both formats, on a weight with two absmax scale blocks and an odd one
 * with a partial last block; then the refusals. */
static void dq_checks(cuda_ctx *c)
{
    const size_t shapes[2][2] = {{37, 448}, {11, 4103}};
    for (int f = MTI_QF_INT8; f <= MTI_QF_NF4; f++)
        for (int s = 0; s < 2; s++) {
            const size_t R = shapes[s][0], I = shapes[s][1], qb = mti_quant_bytes(f, R * I);
            void *hq = check_alloc(qb);
            CHECK_OK(mti_quantize(NULL, (mti_qformat)f, dq_weight(R, I), R * I, hq));
            mt_block bq;
            void *fq = dev_alloc(c, &bq, qb);
            CHECK_OK(c->ctx->dev->copy_h2d(c->ctx->dev, fq, hq, qb));
            dq_tiles(c, f, fq, hq, R, I);
            mt_block bo;
            void *o = dev_alloc(c, &bo, 64 * 4);
            CHECK_ST(MT_ERR_INVALID_ARG, mti_cuda_dequantize(&c->k, f, fq, R, I, R - 1, 2, 0, 8, o,
                                                             8, MTI_F32));
            CHECK(strstr(mt_last_error(c->ctx), "outside"));
            CHECK_ST(MT_ERR_INVALID_ARG,
                     mti_cuda_dequantize(&c->k, f, fq, R, I, 0, 1, 0, 8, o, 4, MTI_F32));
            CHECK_ST(MT_ERR_INVALID_ARG,
                     mti_cuda_dequantize(&c->k, 3, fq, R, I, 0, 1, 0, 8, o, 8, MTI_F32));
            CHECK_ST(MT_ERR_INVALID_ARG,
                     mti_cuda_dequantize(&c->k, f, fq, R, I, 0, 1, 0, 8, o, 8, MTI_I32));
            CHECK_OKC(c->ctx, mt_context_free(c->ctx, &bo));
            CHECK_OKC(c->ctx, mt_context_free(c->ctx, &bq));
        }
}

/* Over the stand-in driver, whose twins of dequant.cu's kernels run
 * dequant.cuh's arithmetic on the host: the host side's arguments (parts,
 * tile, leading dimension, dtype) and that arithmetic, bit for bit. */
TEST(cuda_standin_dequantize_matches_quant_c)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    cuda_ctx c;
    cuda_open(&c);
    dq_checks(&c);
    CHECK_MSG(!strcmp(s.last_kernel(), "mt_dequant_nf4"), "ran %s", s.last_kernel());
    CHECK_OK(mt_context_destroy(c.ctx));
    stand_in_close(&s);
}

/* The table's dequantize over the stand-ins: a range of a flat tensor (a
 * row of the tile kernel's), lib/quant/quant.c's bits in fp32 and bf16; fp16,
 * which the tile kernel takes, refused as the CPU table refuses it. */
TEST(cuda_standin_dequantize_op)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    cuda_ctx c;
    cuda_open(&c);
    const size_t n = 11 * 4103, at = 4000, len = 300;
    for (mti_qformat f = MTI_QF_INT8; f <= MTI_QF_NF4; f++) {
        const size_t qb = mti_quant_bytes(f, n);
        void *hq = check_alloc(qb);
        CHECK_OK(mti_quantize(NULL, f, dq_weight(11, 4103), n, hq));
        mt_block bq, bo;
        void *fq = dev_alloc(&c, &bq, qb), *o = dev_alloc(&c, &bo, len * 4);
        CHECK_OK(c.ctx->dev->copy_h2d(c.ctx->dev, fq, hq, qb));
        for (int d = 0; d < 2; d++) {
            const mti_dtype dt = d ? MTI_BF16 : MTI_F32;
            const size_t bytes = len * (d ? 2 : 4);
            unsigned char *got = check_alloc(bytes), *want = check_alloc(bytes);
            CHECK_OKC(c.ctx, c.ops->dequantize(&c.k, o, fq, f, n, at, len, dt));
            CHECK_OK(c.ctx->dev->copy_d2h(c.ctx->dev, got, o, bytes));
            CHECK_OK(c.ctx->dev->sync(c.ctx->dev));
            CHECK_OK(mti_dequantize(NULL, f, hq, n, at, len, want, dt));
            CHECK_MSG(!memcmp(got, want, bytes), "%s dtype %d: not lib/quant/quant.c's bits",
                      mti_quant_name(f), dt);
        }
        CHECK_ST(MT_ERR_INVALID_ARG, c.ops->dequantize(&c.k, o, fq, f, n, at, len, MTI_F16));
        CHECK_OKC(c.ctx, mt_context_free(c.ctx, &bo));
        CHECK_OKC(c.ctx, mt_context_free(c.ctx, &bq));
    }
    CHECK_OK(mt_context_destroy(c.ctx));
    stand_in_close(&s);
}

/* The same on a GPU (MT_TEST_GPU=1; the ops group of the GPU bundle): the
 * kernels themselves, bit for bit. */
TEST(ops_dequantize_matches_quant_c)
{
    mt_context *g = check_gpu_context();
    if (!g) return;
    cuda_ctx c = {.ctx = g};
    CHECK_OKC(g, mti_cuda_ops(g->dev, &c.ops));
    c.k = (mti_kctx){g, g->dev};
    dq_checks(&c);
    CHECK_OK(mt_context_destroy(g));
}

/* embedding_fwd_q on a CUDA table against the CPU table's, bit for bit:
 * int8 and NF4, fp32 and bf16, with and without positions, a table whose
 * last block is partial and rows that do not start on a block. */
static void emb_q_checks(cuda_ctx *c)
{
    enum { B = 3, T = 5, C = 200, V = 37 };
    const size_t nw = (size_t)V * C, no = (size_t)B * T * C;
    const float *w = dq_weight(V, C);
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = (int32_t)((i * 11 + 3) % V);
    mt_context *cpu = check_cpu_context(1);
    const mti_kctx hk = {cpu, cpu->dev};
    float pos[T * C];
    for (int i = 0; i < T * C; i++) pos[i] = 0.01f * (float)(i % 97) - 0.4f;
    for (int f = MTI_QF_INT8; f <= MTI_QF_NF4; f++) {
        const size_t qb = mti_quant_bytes((mti_qformat)f, nw);
        void *hq = check_alloc(qb);
        CHECK_OK(mti_quantize(NULL, (mti_qformat)f, w, nw, hq));
        for (int dt = 0; dt < 3; dt += 2) {
            const size_t es = dt ? 2 : 4;
            uint16_t hpos16[T * C];
            for (int i = 0; i < T * C; i++) hpos16[i] = mti_f32_to_bf16(pos[i]);
            const void *hpos = dt ? (const void *)hpos16 : (const void *)pos;
            mt_block bq, bt, bp, bo;
            void *q = dev_alloc(c, &bq, qb), *k = dev_alloc(c, &bt, sizeof tok);
            void *p = dev_alloc(c, &bp, (size_t)T * C * es), *o = dev_alloc(c, &bo, no * es);
            CHECK_OK(c->ctx->dev->copy_h2d(c->ctx->dev, q, hq, qb));
            CHECK_OK(c->ctx->dev->copy_h2d(c->ctx->dev, k, tok, sizeof tok));
            CHECK_OK(c->ctx->dev->copy_h2d(c->ctx->dev, p, hpos, (size_t)T * C * es));
            void *want = check_alloc(no * es), *got = check_alloc(no * es);
            for (int wp = 0; wp < 2; wp++) {
                CHECK_OKC(cpu, mti_cpu_ops()->embedding_fwd_q(&hk, want, tok, hq, f, V,
                                                              wp ? hpos : NULL, B, T, C,
                                                              (mti_dtype)dt));
                CHECK_OKC(c->ctx, c->ops->embedding_fwd_q(&c->k, o, k, q, f, V, wp ? p : NULL, B,
                                                          T, C, (mti_dtype)dt));
                CHECK_OK(c->ctx->dev->copy_d2h(c->ctx->dev, got, o, no * es));
                CHECK_OK(c->ctx->dev->sync(c->ctx->dev));
                CHECK_MSG(memcmp(got, want, no * es) == 0,
                          "embedding_fwd_q %s dtype %d%s: not the CPU table's bits",
                          f == MTI_QF_NF4 ? "nf4" : "int8", dt, wp ? "" : " (no positions)");
            }
            CHECK_ST(MT_ERR_UNSUPPORTED, c->ops->embedding_fwd_q(&c->k, o, k, q, f, V, p, B, T, C,
                                                                 MTI_F16));
            CHECK(strstr(mt_last_error(c->ctx), "fp32 or bf16"));
            CHECK_ST(MT_ERR_INVALID_ARG, c->ops->embedding_fwd_q(&c->k, o, k, q, 9, V, p, B, T, C,
                                                                 (mti_dtype)dt));
            CHECK_OKC(c->ctx, mt_context_free(c->ctx, &bo));
            CHECK_OKC(c->ctx, mt_context_free(c->ctx, &bp));
            CHECK_OKC(c->ctx, mt_context_free(c->ctx, &bt));
            CHECK_OKC(c->ctx, mt_context_free(c->ctx, &bq));
        }
    }
    CHECK_OK(mt_context_destroy(cpu));
}

/* Over the stand-ins, whose twins of dequant.cu's lookup kernels run
 * dequant.cuh's arithmetic on the host. */
TEST(cuda_standin_embedding_quantized)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    cuda_ctx c;
    cuda_open(&c);
    emb_q_checks(&c);
    CHECK_MSG(!strcmp(s.last_kernel(), "mt_emb_fwd_q_nf4"), "ran %s", s.last_kernel());
    CHECK_OK(mt_context_destroy(c.ctx));
    stand_in_close(&s);
}

/* The same on a GPU (MT_TEST_GPU=1; the ops group of the GPU bundle). */
TEST(ops_embedding_quantized_matches_cpu)
{
    mt_context *g = check_gpu_context();
    if (!g) return;
    cuda_ctx c = {.ctx = g};
    CHECK_OKC(g, mti_cuda_ops(g->dev, &c.ops));
    c.k = (mti_kctx){g, g->dev};
    emb_q_checks(&c);
    CHECK_OK(mt_context_destroy(g));
}

/* matmul_fwd_q and matmul_dx_q over the stand-ins: a weight of 2056 x
 * 1024 takes two tiles of rows forward (2048 + 8: 2^21 / 1024) and two of
 * columns for dx (1016 + 8: 2^21 / 2056 rounded down to a multiple of 8),
 * each one dequantizing kernel and one GEMM; with several tiles the bias
 * goes in first as bias rows. The WORK peak is one tile of the compute dtype and a
 * GEMM's 4 MiB workspace, and all of it comes back. fp16 is refused. */
TEST(cuda_standin_quantized_matmul_tiles)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    enum { N = 16, IN = 1024, OUT = 2056 };
    const size_t nw = (size_t)IN * OUT, qb = mti_quant_bytes(MTI_QF_NF4, nw);
    void *hq = check_alloc(qb);
    CHECK_OK(mti_quantize(NULL, MTI_QF_NF4, dq_weight(OUT, IN), nw, hq));
    for (int dt = 0; dt < 3; dt += 2) {
        cuda_ctx c;
        cuda_open(&c);
        const size_t es = dt ? 2 : 4;
        mt_block bq, bx, by, bb;
        void *q = dev_alloc(&c, &bq, qb), *x = dev_alloc(&c, &bx, (size_t)N * OUT * es);
        void *y = dev_alloc(&c, &by, (size_t)N * OUT * es), *b = dev_alloc(&c, &bb, OUT * es);
        CHECK_OK(c.ctx->dev->copy_h2d(c.ctx->dev, q, hq, qb));
        unsigned long long l0 = s.cuda_stat("launches"), m0 = s.lt_stat("matmuls");
        CHECK_OKC(c.ctx, c.ops->matmul_fwd_q(&c.k, y, x, q, MTI_QF_NF4, b, N, IN, OUT, (mti_dtype)dt));
        CHECK_EQ(s.cuda_stat("launches") - l0, 3); /* bias rows, two tiles */
        CHECK_EQ(s.lt_stat("matmuls") - m0, 2);
        mt_memory_stats ms;
        CHECK_OK(mt_context_memory_stats(c.ctx, &ms));
        CHECK_EQ(ms.per_class[MT_MEM_WORK].peak_live_bytes, 2048 * IN * es + (4u << 20));
        l0 = s.cuda_stat("launches"), m0 = s.lt_stat("matmuls");
        CHECK_OKC(c.ctx, c.ops->matmul_dx_q(&c.k, x, y, q, MTI_QF_NF4, N, IN, OUT, (mti_dtype)dt, 1));
        CHECK_EQ(s.cuda_stat("launches") - l0, 2); /* 1016 + 8 columns */
        CHECK_EQ(s.lt_stat("matmuls") - m0, 2);
        CHECK_MSG(!strcmp(s.last_kernel(), "mt_dequant_nf4"), "ran %s", s.last_kernel());
        CHECK_OK(mt_context_memory_stats(c.ctx, &ms));
        CHECK_EQ(ms.per_class[MT_MEM_WORK].live_bytes, 0);
        CHECK_EQ(ms.per_class[MT_MEM_WORK].peak_live_bytes, 2048 * IN * es + (4u << 20));
        CHECK_ST(MT_ERR_UNSUPPORTED,
                 c.ops->matmul_fwd_q(&c.k, y, x, q, MTI_QF_NF4, b, N, IN, OUT, MTI_F16));
        CHECK(strstr(mt_last_error(c.ctx), "fp32 or bf16"));
        CHECK_ST(MT_ERR_INVALID_ARG,
                 c.ops->matmul_dx_q(&c.k, x, y, q, 7, N, IN, OUT, (mti_dtype)dt, 0));
        CHECK_OK(mt_context_destroy(c.ctx));
    }
    stand_in_close(&s);
}

/* ---- debug mode ---- */

/* With cuda_debug_sync (or MT_CUDA_DEBUG_SYNC=1) every launch is waited
 * for, and a kernel that faults fails its op with the kernel, the op and
 * the shapes named; without it the launch returns at once and the fault
 * would surface at a later sync that names nothing. The fault is the
 * stand-in's cuStreamSynchronize failing as a real driver's does after an
 * illegal address. */
TEST(cuda_standin_debug_sync_names_the_kernel)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    for (int mode = 0; mode < 3; mode++) {
        cuda_ctx c;
        mt_context_config cfg;
        mt_context_config_init(&cfg);
        if (mode == 1) cfg.cuda_debug_sync = 1;
        if (mode == 2) setenv("MT_CUDA_DEBUG_SYNC", "1", 1);
        cuda_open_cfg(&c, &cfg);
        unsetenv("MT_CUDA_DEBUG_SYNC");
        mt_block by, ba;
        void *y = dev_alloc(&c, &by, 1000 * 2), *a = dev_alloc(&c, &ba, 1000 * 2);
        unsigned long long syncs = s.cuda_stat("syncs");
        s.fail("cuStreamSynchronize", 0, CUDA_ERROR_ILLEGAL_ADDRESS);
        mt_status st = c.ops->add(&c.k, y, a, a, 1000, MTI_BF16);
        if (mode == 0) {
            CHECK_OKC(c.ctx, st);
            CHECK_EQ(s.cuda_stat("syncs"), syncs);
            s.fail("", 0, 0);
        } else {
            CHECK_ST(MT_ERR_DEVICE, st);
            const char *m = mt_last_error(c.ctx);
            CHECK_MSG(strstr(m, "mt_add_bf16") && strstr(m, "add n=1000 bf16") &&
                          strstr(m, "CUDA_ERROR_ILLEGAL_ADDRESS"),
                      "message: %s", m);
            /* a GEMM is waited for too */
            syncs = s.cuda_stat("syncs");
            CHECK_OKC(c.ctx, c.ops->matmul_fwd(&c.k, y, a, a, NULL, 10, 10, 10, MTI_BF16));
            CHECK_EQ(s.cuda_stat("syncs"), syncs + 1);
        }
        CHECK_OKC(c.ctx, mt_context_free(c.ctx, &by));
        CHECK_OKC(c.ctx, mt_context_free(c.ctx, &ba));
        CHECK_OK(mt_context_destroy(c.ctx));
    }
    stand_in_close(&s);
}

/* ---- where cuBLASLt is looked for ---- */

static void touch_file(const char *path, mode_t mode)
{
    FILE *f = fopen(path, "w");
    CHECK_MSG(f, "cannot create %s", path);
    fclose(f);
    CHECK(chmod(path, mode) == 0);
}

/* The usual places, in order: the loader's path, CUDA_HOME's lib64 and
 * lib, the toolkit's default prefix, the pip wheels next to the python3 on
 * PATH (a virtualenv's folder here). */
TEST(cuda_cublaslt_search_paths)
{
    char tmp[] = "/tmp/mt_lt_XXXXXX", p[600], want[600];
    CHECK(mkdtemp(tmp));
    const char *dirs[] = {"", "/bin", "/lib", "/lib/python3.11", "/lib/python3.11/site-packages",
                          "/lib/python3.11/site-packages/nvidia",
                          "/lib/python3.11/site-packages/nvidia/cublas",
                          "/lib/python3.11/site-packages/nvidia/cublas/lib"};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++) {
        snprintf(p, sizeof p, "%s/venv%s", tmp, dirs[i]);
        CHECK(mkdir(p, 0700) == 0);
    }
    snprintf(p, sizeof p, "%s/venv/bin/python3", tmp);
    touch_file(p, 0700);
    static char c[MTI_LT_CANDIDATES][MTI_LT_PATH];
    size_t n = check_search_in(tmp, mti_cublaslt_candidates, c, MTI_LT_CANDIDATES);
    long soname = check_find_path(c, n, "libcublasLt.so.13");
    snprintf(want, sizeof want, "%s/cuda/lib64/libcublasLt.so.13", tmp);
    long home = check_find_path(c, n, want);
    snprintf(want, sizeof want, "%s/cuda/lib/libcublasLt.so.12", tmp);
    long home_lib = check_find_path(c, n, want);
    long dflt = check_find_path(c, n, "/usr/local/cuda/lib64/libcublasLt.so.12");
    snprintf(want, sizeof want,
             "%s/venv/lib/python3.11/site-packages/nvidia/cublas/lib/libcublasLt.so.12", tmp);
    long wheel = check_find_path(c, n, want);
    CHECK_MSG(soname == 0 && home > soname && home_lib > home && dflt > home_lib && wheel > dflt,
              "order: soname %ld, CUDA_HOME %ld / %ld, default %ld, wheel %ld of %zu", soname,
              home, home_lib, dflt, wheel, n);
    snprintf(p, sizeof p, "rm -rf '%s'", tmp);
    CHECK(system(p) == 0);
}

/* MT_CUBLASLT_PATH (read at the first GEMM) names the library when the
 * context names none; a path that is not there fails the GEMM with the
 * path in the message. */
TEST(cuda_standin_cublaslt_from_the_environment)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    for (int bad = 0; bad < 2; bad++) {
        setenv("MT_CUBLASLT_PATH", bad ? "/nonexistent/libcublasLt.so.13" : getenv("MT_FAKE_CUBLASLT"),
               1);
        cuda_ctx c;
        mt_context_config cfg;
        mt_context_config_init(&cfg);
        cfg.device = MT_DEVICE_CUDA;
        cfg.cuda_driver_path = check_fake_cuda();
        CHECK_OK(mt_context_create(&cfg, &c.ctx));
        CHECK_OKC(c.ctx, mti_cuda_ops(c.ctx->dev, &c.ops));
        c.k = (mti_kctx){c.ctx, c.ctx->dev};
        mt_block bx;
        void *x = dev_alloc(&c, &bx, 64 * 64 * 4);
        unsigned long long m0 = s.lt_stat("matmuls");
        mt_status st = c.ops->matmul_fwd(&c.k, x, x, x, NULL, 16, 16, 16, MTI_F32);
        unsetenv("MT_CUBLASLT_PATH"); /* read at the first GEMM */
        if (bad) {
            CHECK_ST(MT_ERR_UNSUPPORTED, st);
            CHECK_MSG(strstr(mt_last_error(c.ctx), "/nonexistent/libcublasLt.so.13 (absent)"),
                      "message: %s", mt_last_error(c.ctx));
        } else {
            CHECK_OKC(c.ctx, st);
            CHECK_EQ(s.lt_stat("matmuls"), m0 + 1);
        }
        CHECK_OKC(c.ctx, mt_context_free(c.ctx, &bx));
        CHECK_OK(mt_context_destroy(c.ctx));
    }
    stand_in_close(&s);
}

/* ---- a fault no call waited for ---- */

/* A kernel that faults after the last call that waited for the device
 * (the driver then fails every wait with its sticky error): closing the
 * context says so, with the driver's code, and still releases everything
 * (memory, stream, module, the primary context). Silent before, so a
 * training run on a GPU could pass its checks and leave a faulted context
 * behind. */
TEST(cuda_standin_destroy_reports_a_late_fault)
{
    stand_in s;
    if (!stand_in_open(&s)) return;
    cuda_ctx c;
    cuda_open(&c);
    mt_block b;
    float *x = dev_alloc(&c, &b, 4096);
    CHECK_OKC(c.ctx, mti_cuda_fill_f32(c.ctx->dev, x, 1.0f, 1024));
    CHECK_OKC(c.ctx, mt_context_free(c.ctx, &b));
    s.fail("cuStreamSynchronize", 0, CUDA_ERROR_ILLEGAL_ADDRESS);
    CHECK_ST(MT_ERR_DEVICE, mt_context_destroy(c.ctx));
    const char *msg = mt_last_error(NULL);
    CHECK_MSG(strstr(msg, "CUDA_ERROR_ILLEGAL_ADDRESS") && strstr(msg, "released all the same"),
              "%s", msg);
    const char *gone[] = {"allocs", "mappings", "reservations", "streams", "modules", "ctx_refs",
                          "ctx_depth"};
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++)
        CHECK_MSG(s.cuda_stat(gone[i]) == 0, "%s: %llu left", gone[i], s.cuda_stat(gone[i]));
    /* a clean close still says nothing */
    cuda_open(&c);
    CHECK_OK(mt_context_destroy(c.ctx));
    stand_in_close(&s);
}
