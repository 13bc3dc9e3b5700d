/*
 * test_quant.c - the blockwise weight quantizers (lib/quant/quant.h) against
 * test/golden/quant_nf4.gv (made by bitsandbytes itself: quantize_4bit,
 * nf4, blocksize 64, compress_statistics) and quant_int8.gv (a numpy model
 * of the int8 definition); test/golden/gen_quant.py writes both.
 *
 * Everything is compared bit for bit: the packed codes, the 8-bit codes of
 * the absmaxes, the fp32 absmax of each block of 256, the offset, and the
 * dequantized values in fp32 and bf16, over the whole tensor and over
 * ranges that start and end inside blocks. Then the byte sizes, the
 * refusals (non-finite input, bad ranges, unknown formats), and that the
 * quantizers take no memory.
 */
#include <math.h>
#include <string.h>

#include "check.h"
#include "golden.h"
#include "ops/kernels.h"
#include "quant/quant.h"
#include "../kernels/cpu/cpu_ops.h"

static gv_file qfile;
static int have_qfile;

static void load(const char *name)
{
    if (have_qfile) gv_free(&qfile);
    have_qfile = 0;
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/%s.gv", gv_dir(), name);
    CHECK_MSG(gv_load(path, &qfile, err, sizeof err), "%s", err);
    have_qfile = 1;
}

static const gv_array *get(const char *name, gv_dtype dt)
{
    const gv_array *a = gv_find(&qfile, name);
    CHECK_MSG(a != NULL, "golden array '%s' missing", name);
    CHECK_MSG(a->dtype == dt, "golden array '%s' is %s", name, gv_dtype_name(a->dtype));
    return a;
}

static const gv_array *case_arr(const char *c, const char *what, gv_dtype dt)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", c, what);
    return get(key, dt);
}

/* The first index where a and b (n elements of `size` bytes) differ, or -1. */
static long first_diff(const void *a, const void *b, size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp((const char *)a + i * size, (const char *)b + i * size, size)) return (long)i;
    return -1;
}

#define SAME(what, a, b, n, size)                                                            \
    do {                                                                                     \
        long d_ = first_diff((a), (b), (n), (size));                                         \
        CHECK_MSG(d_ < 0, "%s: %s differs first at %ld of %zu", c, (what), d_, (size_t)(n)); \
    } while (0)

/* Dequantizes q (n elements) in pieces whose bounds cut blocks, and checks
 * every piece against the reference (fp32 and, where there is one, bf16). */
static void check_dequant(const char *c, mti_qformat f, const void *q, size_t n, const float *ref,
                          const uint16_t *ref_bf16)
{
    float *out = check_alloc(n * 4 + 4);
    uint16_t *out16 = check_alloc(n * 2 + 2);
    CHECK_OK(mti_dequantize(NULL, f, q, n, 0, n, out, MTI_F32));
    SAME("dequantized fp32", out, ref, n, 4);
    if (ref_bf16) {
        CHECK_OK(mti_dequantize(NULL, f, q, n, 0, n, out16, MTI_BF16));
        SAME("dequantized bf16", out16, ref_bf16, n, 2);
    }
    /* ranges: odd starts, lengths that cross blocks, empty ones */
    const size_t steps[] = {1, 7, 63, 65, 130};
    for (size_t s = 0; s < sizeof steps / sizeof *steps; s++) {
        memset(out, 0xFF, n * 4);
        for (size_t at = 0; at < n; at += steps[s]) {
            size_t len = n - at < steps[s] ? n - at : steps[s];
            CHECK_OK(mti_dequantize(NULL, f, q, n, at, len, out + at, MTI_F32));
        }
        SAME("dequantized in ranges", out, ref, n, 4);
    }
    CHECK_OK(mti_dequantize(NULL, f, q, n, n, 0, out, MTI_F32));
}

static void nf4_case(const char *c)
{
    const gv_array *x = case_arr(c, "x", GV_F32);
    const size_t n = x->numel;
    mti_qparts p;
    CHECK_OK(mti_quant_parts(MTI_QF_NF4, n, &p));
    CHECK_EQ(p.blocks, (n + 63) / 64);
    CHECK_EQ(mti_quant_bytes(MTI_QF_NF4, n), (n + 1) / 2 + p.blocks + 4 * ((p.blocks + 255) / 256) + 4);
    uint8_t *q = check_alloc(p.bytes);
    CHECK_OK(mti_quantize(NULL, MTI_QF_NF4, x->data, n, q));

    const gv_array *codes = case_arr(c, "codes", GV_U8), *qam = case_arr(c, "qabsmax", GV_U8);
    const gv_array *am2 = case_arr(c, "absmax2", GV_F32), *off = case_arr(c, "offset", GV_F32);
    CHECK_EQ(codes->numel, p.codes_n);
    CHECK_EQ(qam->numel, p.blocks);
    CHECK_EQ(am2->numel, p.absmax2_n);
    SAME("offset (mean of the absmaxes)", q + p.offset, off->data, 1, 4);
    SAME("absmax2", q + p.absmax2, am2->data, p.absmax2_n, 4);
    SAME("absmax codes", q + p.qabsmax, qam->data, p.blocks, 1);
    SAME("packed codes", q + p.codes, codes->data, p.codes_n, 1);
    char key[128];
    snprintf(key, sizeof key, "%s.deq_bf16", c);
    const gv_array *b16 = gv_find(&qfile, key);
    check_dequant(c, MTI_QF_NF4, q, n, case_arr(c, "deq", GV_F32)->data, b16 ? b16->data : NULL);
}

TEST(quant_nf4_bitsandbytes_golden)
{
    load("quant_nf4");
    const char *c = "tables";
    const gv_array *code = get("nf4_code", GV_F32), *dyn = get("dynamic_map", GV_F32);
    CHECK_EQ(code->numel, 16);
    SAME("NF4 levels", mti_nf4_code(), code->data, 16, 4);
    CHECK_EQ(dyn->numel, 256);
    SAME("8-bit dynamic map", mti_q8_map(1), dyn->data, 256, 4);
    nf4_case("mixed");
    nf4_case("big");
    nf4_case("partial_only");
    gv_free(&qfile);
    have_qfile = 0;
}

TEST(quant_int8_golden)
{
    load("quant_int8");
    const char *c = "int8";
    const gv_array *x = get("x", GV_F32);
    const size_t n = x->numel;
    mti_qparts p;
    CHECK_OK(mti_quant_parts(MTI_QF_INT8, n, &p));
    CHECK_EQ(mti_quant_bytes(MTI_QF_INT8, n), n + 4 * ((n + 63) / 64));
    uint8_t *q = check_alloc(p.bytes);
    CHECK_OK(mti_quantize(NULL, MTI_QF_INT8, x->data, n, q));
    SAME("scales", q + p.scale, get("scale", GV_F32)->data, p.blocks, 4);
    SAME("codes", q + p.codes, get("codes", GV_U8)->data, n, 1);
    check_dequant(c, MTI_QF_INT8, q, n, get("deq", GV_F32)->data, get("deq_bf16", GV_BF16)->data);
    gv_free(&qfile);
    have_qfile = 0;
}

TEST(quant_refusals_and_sizes)
{
    float x[130];
    for (int i = 0; i < 130; i++) x[i] = (float)i - 60.0f;
    uint8_t q[256];
    const mti_qformat fs[] = {MTI_QF_INT8, MTI_QF_NF4};
    for (int k = 0; k < 2; k++) {
        mti_qformat f = fs[k];
        CHECK(mti_quant_bytes(f, 130) <= sizeof q);
        CHECK_OK(mti_quantize(NULL, f, x, 130, q));
        x[77] = NAN;
        CHECK_EQ(mti_quantize(NULL, f, x, 130, q), MT_ERR_INVALID_ARG);
        CHECK(strstr(mt_last_error(NULL), "element 77"));
        x[77] = INFINITY;
        CHECK_EQ(mti_quantize(NULL, f, x, 130, q), MT_ERR_INVALID_ARG);
        x[77] = 17.0f;
        float out[130];
        CHECK_EQ(mti_dequantize(NULL, f, q, 130, 100, 31, out, MTI_F32), MT_ERR_INVALID_ARG);
        CHECK_EQ(mti_dequantize(NULL, f, q, 130, 131, 0, out, MTI_F32), MT_ERR_INVALID_ARG);
        CHECK_EQ(mti_dequantize(NULL, f, q, 130, 0, 10, out, MTI_F16), MT_ERR_INVALID_ARG);
        CHECK_EQ(mti_dequantize(NULL, f, NULL, 130, 0, 10, out, MTI_F32), MT_ERR_INVALID_ARG);
        CHECK_OK(mti_quantize(NULL, f, x, 0, NULL));
        /* values come back close: within half a level of the block's scale */
        CHECK_OK(mti_dequantize(NULL, f, q, 130, 0, 130, out, MTI_F32));
        for (int i = 0; i < 130; i++)
            CHECK_MSG(fabsf(out[i] - x[i]) <= (f == MTI_QF_INT8 ? 0.01f : 0.2f) * 70.0f,
                      "%s: %g -> %g", mti_quant_name(f), (double)x[i], (double)out[i]);
    }
    /* NF4's offset is a float32 mean of the block maxima: nine blocks near
       3e38 overflow it (every weight would dequantize to NaN), and are
       refused with q untouched; int8 holds them, and one such block is
       NF4's to hold too */
    static float big[9 * 64];
    for (int i = 0; i < 9 * 64; i++) big[i] = (i % 2 ? -3e38f : 3e38f) * (1.0f - 1e-3f * (float)(i % 5));
    static uint8_t qb[1024], before[1024];
    memset(qb, 0xA5, sizeof qb), memcpy(before, qb, sizeof qb);
    CHECK(mti_quant_bytes(MTI_QF_NF4, 9 * 64) <= sizeof qb);
    CHECK_EQ(mti_quantize(NULL, MTI_QF_NF4, big, 9 * 64, qb), MT_ERR_INVALID_ARG);
    CHECK_MSG(strstr(mt_last_error(NULL), "9 blocks' absolute maxima overflows float32"), "%s",
              mt_last_error(NULL));
    CHECK(memcmp(qb, before, sizeof qb) == 0);
    CHECK_EQ(mti_quant_check(NULL, MTI_QF_NF4, big, 9 * 64), MT_ERR_INVALID_ARG);
    CHECK_OK(mti_quant_check(NULL, MTI_QF_INT8, big, 9 * 64));
    CHECK_OK(mti_quantize(NULL, MTI_QF_NF4, big, 64, qb));
    float back[64];
    CHECK_OK(mti_dequantize(NULL, MTI_QF_NF4, qb, 64, 0, 64, back, MTI_F32));
    for (int i = 0; i < 64; i++) CHECK_MSG(isfinite(back[i]), "%d: %g", i, (double)back[i]);
    CHECK_EQ(mti_quant_bytes((mti_qformat)9, 10), 0);
    mti_qparts p;
    CHECK_EQ(mti_quant_parts((mti_qformat)9, 10, &p), MT_ERR_INVALID_ARG);
    CHECK_EQ(mti_quantize(NULL, (mti_qformat)0, x, 10, q), MT_ERR_INVALID_ARG);
    CHECK(mti_quant_name(MTI_QF_NF4) && !strcmp(mti_quant_name(MTI_QF_NF4), "nf4"));
    /* sizes for a GPT-2-sized matrix: NF4 about 0.516 bytes per weight */
    size_t n = 768 * 3072;
    CHECK_EQ(mti_quant_bytes(MTI_QF_NF4, n), n / 2 + n / 64 + 4 * ((n / 64 + 255) / 256) + 4);
    CHECK_EQ(mti_quant_bytes(MTI_QF_INT8, n), n + 4 * (n / 64));
}

/* ---- the dequantizing GEMMs (kernels/cpu/matmul.c) ---- */

/* x with values spread over a few decades and of both signs, deterministic. */
static void fill(float *x, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = ((float)(seed >> 8) / 16777216.0f - 0.5f) * (float)(1 + (i % 7));
    }
}

/* Forward and input gradient on a quantized W equal the dense ops on the
 * dequantized W bit for bit (fp32 and bf16, both formats, shapes with edge
 * tiles and several tiles per side, dx overwritten and accumulated), and
 * their WORK comes back; fp16 is refused. */
TEST(quant_matmul_dequantizing_gemm)
{
    mt_context *ctx = check_cpu_context(2);
    const mti_kctx k = {ctx, ctx->dev};
    const mti_ops *ops = mti_cpu_ops();
    /* (33, 300, 9000): a reduction long enough that dx's tiles are narrower
       than the dense path's (an LM head's vocabulary) */
    const int shapes[][3] = {{37, 200, 300}, {5, 64, 1100}, {300, 1030, 70}, {1, 3, 1},
                             {33, 300, 9000}};
    const mti_qformat fs[] = {MTI_QF_INT8, MTI_QF_NF4};
    const mti_dtype dts[] = {MTI_F32, MTI_BF16};
    for (size_t sh = 0; sh < sizeof shapes / sizeof *shapes; sh++) {
        const int N = shapes[sh][0], I = shapes[sh][1], O = shapes[sh][2];
        const size_t nw = (size_t)I * (size_t)O;
        float *w = check_alloc(nw * 4), *x = check_alloc((size_t)N * I * 4);
        float *dy = check_alloc((size_t)N * O * 4), *bias = check_alloc((size_t)O * 4);
        fill(w, nw, 1u + (uint32_t)sh), fill(x, (size_t)N * I, 7u), fill(dy, (size_t)N * O, 9u);
        fill(bias, (size_t)O, 11u);
        for (int fi = 0; fi < 2; fi++) {
            void *q = check_alloc(mti_quant_bytes(fs[fi], nw));
            CHECK_OK(mti_quantize(NULL, fs[fi], w, nw, q));
            for (int di = 0; di < 2; di++) {
                const mti_dtype dt = dts[di];
                const size_t e = dt == MTI_F32 ? 4 : 2;
                char c[96];
                snprintf(c, sizeof c, "%s %s (%d,%d,%d)", mti_quant_name(fs[fi]),
                         dt == MTI_F32 ? "fp32" : "bf16", N, I, O);
                void *wd = check_alloc(nw * e), *xd = check_alloc((size_t)N * I * e);
                void *dyd = check_alloc((size_t)N * O * e), *bd = check_alloc((size_t)O * e);
                CHECK_OK(mti_dequantize(NULL, fs[fi], q, nw, 0, nw, wd, dt));
                CHECK_OK(ops->cast(&k, xd, dt, x, MTI_F32, (size_t)N * I, MTI_ROUND_NEAREST, 0));
                CHECK_OK(ops->cast(&k, dyd, dt, dy, MTI_F32, (size_t)N * O, MTI_ROUND_NEAREST, 0));
                CHECK_OK(ops->cast(&k, bd, dt, bias, MTI_F32, (size_t)O, MTI_ROUND_NEAREST, 0));
                void *y1 = check_alloc((size_t)N * O * e), *y2 = check_alloc((size_t)N * O * e);
                CHECK_OK(ops->matmul_fwd(&k, y1, xd, wd, bd, N, I, O, dt));
                CHECK_OK(ops->matmul_fwd_q(&k, y2, xd, q, fs[fi], bd, N, I, O, dt));
                SAME("forward", y2, y1, (size_t)N * O, e);
                CHECK_OK(ops->matmul_fwd(&k, y1, xd, wd, NULL, N, I, O, dt));
                CHECK_OK(ops->matmul_fwd_q(&k, y2, xd, q, fs[fi], NULL, N, I, O, dt));
                SAME("forward without bias", y2, y1, (size_t)N * O, e);
                void *d1 = check_alloc((size_t)N * I * e), *d2 = check_alloc((size_t)N * I * e);
                for (int acc = 0; acc < 2; acc++) {
                    memcpy(d1, xd, (size_t)N * I * e), memcpy(d2, xd, (size_t)N * I * e);
                    CHECK_OK(ops->matmul_bwd(&k, d1, NULL, NULL, dyd, xd, wd, N, I, O, dt, acc));
                    CHECK_OK(ops->matmul_dx_q(&k, d2, dyd, q, fs[fi], N, I, O, dt, acc));
                    SAME(acc ? "dx accumulated" : "dx", d2, d1, (size_t)N * I, e);
                }
            }
            CHECK_EQ(ops->matmul_fwd_q(&k, x, x, q, fs[fi], NULL, 1, 1, 1, MTI_F16),
                     MT_ERR_UNSUPPORTED);
            CHECK(strstr(mt_last_error(ctx), "fp32 or bf16"));
            CHECK_EQ(ops->matmul_dx_q(&k, x, x, q, 7, 1, 1, 1, MTI_F32, 0), MT_ERR_INVALID_ARG);
        }
    }
    mt_memory_stats ms;
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    CHECK_EQ(ms.per_class[MT_MEM_WORK].live_bytes, 0);
    CHECK(ms.per_class[MT_MEM_WORK].peak_live_bytes > 0);
    mt_context_destroy(ctx);
}
