/*
 * quant.c - blockwise int8 and NF4 quantization of frozen weights (the
 * contract, and why each rounding is where it is, in lib/quant/quant.h).
 *
 * Every operation is one fp32 operation in the reference's order (the
 * build does not contract multiply-adds: -std=c11), so the bits are
 * bitsandbytes' (NF4) or the definition's (int8).
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "ops/kernels.h"
#include "quant/quant.h"

/* QLoRA's NormalFloat levels, as bitsandbytes' table holds them (fp32). */
static const float nf4[16] = {
    -1.0f,         -0.696192801f, -0.525073051f, -0.394917488f, -0.284441382f, -0.18477343f,
    -0.0910500363f, 0.0f,         0.0795802996f, 0.160930201f,  0.246112302f,  0.337915242f,
    0.440709829f,  0.562617004f,  0.722956836f,  1.0f};
#define NF4_ZERO 7

const float *mti_nf4_code(void) { return nf4; }

/* The absmax of block b of x (n values) as the NF4 quantizer keeps it:
 * max |x| for a full block, at least 1e-38 for a partial last one. */
static float nf4_absmax(const float *x, size_t n, size_t b)
{
    const size_t i0 = b * MTI_QF_BLOCK, len = n - i0 < MTI_QF_BLOCK ? n - i0 : MTI_QF_BLOCK;
    float am = 0.0f;
    for (size_t i = 0; i < len; i++) am = fmaxf(am, fabsf(x[i0 + i]));
    const float floor_am = (float)1e-38;
    return len == MTI_QF_BLOCK || am > floor_am ? am : floor_am;
}

/* ---- torch's fp32 sum, one thread (what torch.mean divides by n) ----
 * Here of the absmaxes of x's blocks, made as they are needed (the
 * quantizer takes no memory). Its cascade: rows of `width` values summed
 * into four levels of accumulators, a level carried into the next every
 * 2^lp rows. */
static void cascade_rows(const float *x, size_t n, int64_t rows, int width, float *out)
{
    int64_t cl2 = rows <= 2 ? 1 : 64 - __builtin_clzll((unsigned long long)(rows - 1));
    const int lp = cl2 / 4 > 4 ? (int)(cl2 / 4) : 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    float acc[4][32];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < width; k++) acc[0][k] += nf4_absmax(x, n, (size_t)(i * width + k));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < width; k++) acc[j][k] += acc[j - 1][k], acc[j - 1][k] = 0.0f;
            if (i & (mask << (j * lp))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < width; k++) acc[0][k] += nf4_absmax(x, n, (size_t)(i * width + k));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < width; k++) acc[0][k] += acc[j][k];
    memcpy(out, acc[0], (size_t)width * sizeof(float));
}

/* torch.sum of the nb absmaxes on the CPU, one thread: fewer than 8 values
 * as four interleaved partial sums; else vectors of 8 lanes, four vectors
 * interleaved, the leftover values summed apart and the lanes added to them
 * in order. */
static float absmax_sum(const float *x, size_t n, size_t nb)
{
    enum { W = 8, ILP = 4 };
    if (nb < W) {
        float ps[ILP] = {0};
        int64_t rows = (int64_t)nb / ILP;
        if (rows) cascade_rows(x, n, rows, ILP, ps);
        for (size_t i = (size_t)rows * ILP; i < nb; i++) ps[0] += nf4_absmax(x, n, i);
        for (int k = 1; k < ILP; k++) ps[0] += ps[k];
        return 0.0f + ps[0];
    }
    const int64_t vecs = (int64_t)(nb / W), rows = vecs / ILP;
    float ps[ILP * W] = {0};
    if (rows) cascade_rows(x, n, rows, ILP * W, ps);
    for (int64_t v = rows * ILP; v < vecs; v++)
        for (int k = 0; k < W; k++) ps[k] += nf4_absmax(x, n, (size_t)(v * W + k));
    for (int j = 1; j < ILP; j++)
        for (int k = 0; k < W; k++) ps[k] += ps[j * W + k];
    float s = 0.0f;
    for (size_t i = (size_t)vecs * W; i < nb; i++) s += nf4_absmax(x, n, i);
    for (int k = 0; k < W; k++) s += ps[k];
    return 0.0f + s;
}

/* ---- bitsandbytes' CPU blockwise 8-bit quantizer (its nearest-code table) ---- */
#define LUT_SIZE 65536
static uint8_t g_lut[LUT_SIZE];
static pthread_once_t g_lut_once = PTHREAD_ONCE_INIT;

static void build_lut(void)
{
    const float *c = mti_q8_map(1);
    float mid[255];
    for (int i = 0; i < 255; i++) mid[i] = 0.5f * (c[i] + c[i + 1]);
    int k = 0;
    for (int i = 0; i < LUT_SIZE; i++) {
        float v = -1.0f + (2.0f * (float)i) / (float)(LUT_SIZE - 1);
        while (k < 255 && mid[k] < v) k++;
        g_lut[i] = (uint8_t)k;
    }
}

static float clamp1(float v) { return v < -1.0f ? -1.0f : v > 1.0f ? 1.0f : v; }

/* y (n <= 256 values) into codes q, returning the block's absmax. */
static float q8_block(const float *y, size_t n, uint8_t *q)
{
    float am = 0.0f;
    for (size_t i = 0; i < n; i++) am = fmaxf(am, fabsf(y[i]));
    if (am == 0.0f) {
        memset(q, 0, n);
        return am;
    }
    const float inv = 1.0f / am;
    for (size_t i = 0; i < n; i++) {
        float t = (clamp1(y[i] * inv) + 1.0f) * 0.5f;
        q[i] = g_lut[(uint16_t)(t * (float)(LUT_SIZE - 1) + 0.5f)];
    }
    return am;
}

/* A block's values v(j) for j in [i, stop) into out[0 .. stop - i) in dt
 * (fp32, or bf16 rounded to nearest even): the dtype chosen once, outside
 * the loop, so each loop is a plain one the compiler vectorises. */
#define PUT_RANGE(out, dt, i, stop, v)                                                        \
    do {                                                                                   \
        if ((dt) == MTI_F32) {                                                             \
            float *o_ = (float *)(out);                                                    \
            for (size_t j = (i); j < (stop); j++) o_[j - (i)] = (v);                       \
        } else {                                                                           \
            uint16_t *o_ = (uint16_t *)(out);                                              \
            for (size_t j = (i); j < (stop); j++) o_[j - (i)] = mti_f32_to_bf16(v);        \
        }                                                                                  \
    } while (0)

/* ---- NF4 ---- */

/* Where the parts of a tensor of p->n elements in p->blocks blocks lie. */
static void nf4_layout(mti_qparts *p)
{
    p->absmax2 = 0, p->absmax2_n = (p->blocks + MTI_QF_STAT_BLOCK - 1) / MTI_QF_STAT_BLOCK;
    p->offset = 4 * p->absmax2_n;
    p->qabsmax = p->offset + 4;
    p->codes = p->qabsmax + p->blocks, p->codes_n = (p->n + 1) / 2;
    p->bytes = p->codes + p->codes_n;
}

/* The code of s in [-1, 1]: the count of midpoints strictly below it. */
static inline unsigned nf4_code_of(const float *mid, float s)
{
    unsigned r = 0;
    for (int k = 0; k < 15; k++) r += s > mid[k];
    return r;
}

static void nf4_quantize(const float *x, size_t n, const mti_qparts *p, float offset,
                         uint8_t *base)
{
    float mid[15];
    for (int k = 0; k < 15; k++) mid[k] = (nf4[k] + nf4[k + 1]) / 2.0f;
    uint8_t *codes = base + p->codes;
    for (size_t b = 0; b < p->blocks; b++) {
        const size_t i0 = b * MTI_QF_BLOCK, len = n - i0 < MTI_QF_BLOCK ? n - i0 : MTI_QF_BLOCK;
        const bool full = len == MTI_QF_BLOCK;
        const float am = nf4_absmax(x, n, b);
        const float d = am > (float)1e-38 ? am : (float)1e-38, r = 1.0f / d;
        for (size_t i = 0; i < len; i += 2) {
            /* a full block multiplies by the reciprocal, the partial one divides */
            float s0 = clamp1(full ? x[i0 + i] * r : x[i0 + i] / d);
            unsigned c1 = NF4_ZERO;
            if (i + 1 < len) {
                float s1 = full ? x[i0 + i + 1] * r : x[i0 + i + 1] / d;
                c1 = nf4_code_of(mid, clamp1(s1));
            }
            codes[(i0 + i) / 2] = (uint8_t)(nf4_code_of(mid, s0) << 4 | c1);
        }
    }
    /* double quantization: absmax - offset in blocks of 256 */
    memcpy(base + p->offset, &offset, 4);
    pthread_once(&g_lut_once, build_lut);
    for (size_t s = 0; s < p->absmax2_n; s++) {
        const size_t b0 = s * MTI_QF_STAT_BLOCK;
        const size_t len = p->blocks - b0 < MTI_QF_STAT_BLOCK ? p->blocks - b0 : MTI_QF_STAT_BLOCK;
        float y[MTI_QF_STAT_BLOCK];
        for (size_t j = 0; j < len; j++) y[j] = nf4_absmax(x, n, b0 + j) - offset;
        float a2 = q8_block(y, len, base + p->qabsmax + b0);
        memcpy(base + p->absmax2 + 4 * s, &a2, 4);
    }
}

/* NF4's offset (the float32 mean of the blocks' absolute maxima of x, n >
 * 0 finite values) into *offset, so that quantizing takes it once; refused
 * where it overflows. */
static mt_status nf4_check(mt_context *ctx, const float *x, size_t n, float *offset)
{
    /* the offset is a float32 mean, as bitsandbytes takes it: blocks near
       float32's largest values overflow its sum, and every weight would
       dequantize to NaN */
    const size_t blocks = (n + MTI_QF_BLOCK - 1) / MTI_QF_BLOCK;
    *offset = absmax_sum(x, n, blocks) / (float)blocks;
    if (!isfinite(*offset))
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "quantize nf4: the mean of its %zu blocks' absolute maxima overflows "
                        "float32 (values near %g); NF4 cannot hold these values",
                        blocks, (double)FLT_MAX);
    return MT_OK;
}

/* Elements [i, stop) of quantized tensor q, all in block i / MTI_QF_BLOCK,
 * into out[0 .. stop - i) in dt. */
static void nf4_dequantize(const uint8_t *q, const mti_qparts *p, size_t i, size_t stop,
                           void *out, mti_dtype dt)
{
    const size_t b = i / MTI_QF_BLOCK;
    float a2, off;
    memcpy(&a2, q + p->absmax2 + 4 * (b / MTI_QF_STAT_BLOCK), 4);
    memcpy(&off, q + p->offset, 4);
    const float am = mti_q8_map(1)[q[p->qabsmax + b]] * a2 + off;
    const uint8_t *c = q + p->codes;
    PUT_RANGE(out, dt, i, stop, nf4[j & 1 ? c[j / 2] & 15u : c[j / 2] >> 4] * am);
}

/* ---- int8 ---- */

static void int8_layout(mti_qparts *p)
{
    p->scale = 0, p->scale_n = p->blocks;
    p->codes = 4 * p->blocks, p->codes_n = p->n;
    p->bytes = p->codes + p->n;
}

static void int8_quantize(const float *x, size_t n, const mti_qparts *p, float offset,
                          uint8_t *base)
{
    float *scale = (float *)(void *)(base + p->scale);
    int8_t *codes = (int8_t *)(base + p->codes);
    for (size_t b = 0; b < p->blocks; b++) {
        const size_t i0 = b * MTI_QF_BLOCK, len = n - i0 < MTI_QF_BLOCK ? n - i0 : MTI_QF_BLOCK;
        float am = 0.0f;
        for (size_t i = 0; i < len; i++) am = fmaxf(am, fabsf(x[i0 + i]));
        const float s = am / 127.0f;
        scale[b] = s;
        for (size_t i = 0; i < len; i++) {
            float q = s == 0.0f ? 0.0f : nearbyintf(x[i0 + i] / s);
            q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
            codes[i0 + i] = (int8_t)q;
        }
    }
}

static void int8_dequantize(const uint8_t *q, const mti_qparts *p, size_t i, size_t stop,
                            void *out, mti_dtype dt)
{
    float sc;
    memcpy(&sc, q + p->scale + 4 * (i / MTI_QF_BLOCK), 4);
    const int8_t *c = (const int8_t *)(q + p->codes);
    PUT_RANGE(out, dt, i, stop, (float)c[j] * sc);
}

/* ---- the formats ---- */

/* What each format is, indexed by format: its name; where its parts lie
 * (after n and blocks); what it refuses beyond non-finite values (NULL:
 * nothing), giving what its quantizer takes once (offset); its quantizer;
 * and its dequantizer of a range within one block. */
typedef struct qformat_def {
    const char *name;
    void (*layout)(mti_qparts *p);
    mt_status (*check)(mt_context *ctx, const float *x, size_t n, float *offset);
    void (*quantize)(const float *x, size_t n, const mti_qparts *p, float offset, uint8_t *q);
    void (*dequantize)(const uint8_t *q, const mti_qparts *p, size_t i, size_t stop, void *out,
                       mti_dtype dt);
} qformat_def;

static const qformat_def formats[] = {
    [MTI_QF_INT8] = {"int8", int8_layout, NULL, int8_quantize, int8_dequantize},
    [MTI_QF_NF4] = {"nf4", nf4_layout, nf4_check, nf4_quantize, nf4_dequantize},
};
_Static_assert(sizeof formats / sizeof *formats == MTI_QF_COUNT, "one entry per mti_qformat");

/* The entry of format f, or NULL (MTI_QF_NONE, or no format). */
static const qformat_def *format_of(mti_qformat f)
{
    return (unsigned)f < MTI_QF_COUNT && formats[f].name ? &formats[f] : NULL;
}

const char *mti_quant_name(mti_qformat f)
{
    const qformat_def *d = format_of(f);
    return d ? d->name : NULL;
}

mt_status mti_quant_parts(mti_qformat f, size_t n, mti_qparts *out)
{
    const qformat_def *d = format_of(f);
    if (!d)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "quantization format %d is not int8 or nf4", f);
    mti_qparts p = {.n = n, .blocks = (n + MTI_QF_BLOCK - 1) / MTI_QF_BLOCK};
    d->layout(&p);
    *out = p;
    return MT_OK;
}

size_t mti_quant_bytes(mti_qformat f, size_t n)
{
    mti_qparts p = {0};
    return mti_quant_parts(f, n, &p) ? 0 : p.bytes;
}

/* Whether format f can hold x (mti_quant_check), and what its quantizer
 * takes once into *offset. */
static mt_status check_values(mt_context *ctx, mti_qformat f, const float *x, size_t n,
                              float *offset)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "quantize %s: element %zu is %g (values must be finite)",
                            mti_quant_name(f), i, (double)x[i]);
    const qformat_def *d = format_of(f);
    return d && d->check && n ? d->check(ctx, x, n, offset) : MT_OK;
}

mt_status mti_quant_check(mt_context *ctx, mti_qformat f, const float *x, size_t n)
{
    float offset;
    return check_values(ctx, f, x, n, &offset);
}

mt_status mti_quantize(mt_context *ctx, mti_qformat f, const float *x, size_t n, void *q)
{
    mti_qparts p;
    mt_status s = mti_quant_parts(f, n, &p);
    if (s) return mti_fail(ctx, s, "quantize: %s", mti_last_msg(NULL).s);
    if (n && (!x || !q))
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "quantize: %s is NULL", !x ? "x" : "q");
    float offset = 0.0f;
    if ((s = check_values(ctx, f, x, n, &offset))) return s;
    if (n == 0) return MT_OK;
    format_of(f)->quantize(x, n, &p, offset, q);
    return MT_OK;
}

mt_status mti_dequantize(mt_context *ctx, mti_qformat f, const void *q, size_t n, size_t at,
                         size_t len, void *out, mti_dtype dt)
{
    mti_qparts p;
    mt_status s = mti_quant_parts(f, n, &p);
    if (s) return mti_fail(ctx, s, "dequantize: %s", mti_last_msg(NULL).s);
    if (dt != MTI_F32 && dt != MTI_BF16)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "dequantize: output dtype %d is not fp32 or bf16",
                        (int)dt);
    if (at > n || len > n - at)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "dequantize: elements [%zu, %zu) outside a tensor of %zu", at, at + len, n);
    if (len && (!q || !out))
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "dequantize: %s is NULL", !q ? "q" : "out");
    const qformat_def *d = format_of(f);
    const size_t es = mti_dtype_size(dt);
    size_t i = at, end = at + len;
    while (i < end) {
        const size_t b = i / MTI_QF_BLOCK;
        const size_t stop = (b + 1) * MTI_QF_BLOCK < end ? (b + 1) * MTI_QF_BLOCK : end;
        d->dequantize(q, &p, i, stop, (char *)out + (i - at) * es, dt);
        i = stop;
    }
    return MT_OK;
}

mt_status mti_quant_emb_check(mt_context *ctx, const char *op, const void *wq, mti_qformat qf,
                              int V, int B, int T, int C, mti_dtype dt)
{
    if (B < 0 || T < 0 || C < 0 || V < 0 || !wq || !mti_quant_name(qf))
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: bad shape (B %d, T %d, C %d, V %d), table or format %d", op, B, T, C,
                        V, qf);
    if (dt != MTI_F32 && dt != MTI_BF16)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: a quantized table computes with fp32 or bf16 activations, not %s "
                        "(train in fp32 or bf16)", op, dt == MTI_F16 ? "fp16" : "this dtype");
    return MT_OK;
}

mt_status mti_quant_mm_check(mt_context *ctx, const char *op, const void *wq, mti_qformat qf,
                             int n, int in, int out, mti_dtype dt)
{
    if (n < 0 || in < 0 || out < 0 || !wq || !mti_quant_name(qf))
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: bad shape (%d,%d,%d), weight or format %d",
                        op, n, in, out, qf);
    if (dt != MTI_F32 && dt != MTI_BF16)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: a quantized weight computes with fp32 or bf16 activations, not %s "
                        "(train in fp32 or bf16)", op, dt == MTI_F16 ? "fp16" : "this dtype");
    return MT_OK;
}
