/*
 * embedding.c - token plus position embedding, forward and backward.
 *
 * Forward: out (B,T,C) = wte[tok] + wpe[t], one row per token, rows in
 * parallel. Backward: the gradients are fp32 sums over tokens; to keep the
 * order of every sum fixed without per-thread copies, threads split the
 * channels and each walks all tokens in order over its run of channels.
 */
#include <string.h>

#include "cpu_ops.h"
#include "quant/quant.h"

/* clang warns about every `omp simd` loop it cannot vectorise, which is all
 * of them under the sanitizers' instrumentation */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

/* channels staged at a time: 4 KiB of fp32 per stream */
#define CHUNK 1024

static int dt_ok(mti_dtype dt) { return dt == MTI_F32 || dt == MTI_F16 || dt == MTI_BF16; }

static mt_status bad_dtype(const mti_kctx *k, const char *op, mti_dtype dt)
{
    return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "%s: dtype %d is not fp32, fp16 or bf16", op,
                    (int)dt);
}

/* src[i, i+n) as fp32: the tensor itself when fp32, else widened into buf */
static const float *stage_in(const void *src, mti_dtype dt, size_t i, size_t n, float *buf)
{
    if (dt == MTI_F32) return (const float *)src + i;
    mti_cpu_load_f32(buf, src, dt, i, n);
    return buf;
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* out row (C) = wte row + wpe row, summed in fp32 and rounded once */
static void emb_row(void *out, size_t orow, const void *wte, size_t erow, const void *wpe,
                    size_t prow, size_t c, mti_dtype dt)
{
    float eb[CHUNK], pb[CHUNK], ob[CHUNK];
    for (size_t j = 0; j < c; j += CHUNK) {
        size_t m = min_sz(CHUNK, c - j);
        const float *e = stage_in(wte, dt, erow + j, m, eb);
        float *o = dt == MTI_F32 ? (float *)out + orow + j : ob;
        if (wpe) {
            const float *p = stage_in(wpe, dt, prow + j, m, pb);
#pragma omp simd
            for (size_t i = 0; i < m; i++) o[i] = e[i] + p[i];
        } else if (o != e) {
            memcpy(o, e, m * sizeof *o);
        }
        if (dt != MTI_F32) mti_cpu_store_f32(out, dt, orow + j, ob, m);
    }
}

mt_status mti_cpu_embedding_fwd(const mti_kctx *k, void *out, const int32_t *tok, const void *wte,
                                const void *wpe, int B, int T, int C, mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "embedding_fwd", dt);
    if (B <= 0 || T <= 0 || C <= 0) return MT_OK;
    size_t c = (size_t)C, rows = (size_t)B * (size_t)T;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) \
    if (rows * c > MTI_CPU_PAR_MIN)
    for (size_t r = 0; r < rows; r++) {
        size_t t = r % (size_t)T;
        emb_row(out, r * c, wte, (size_t)tok[r] * c, wpe, t * c, c, dt);
    }
    return MT_OK;
}

mt_status mti_cpu_embedding_fwd_rows(const mti_kctx *k, void *out, const int32_t *tok,
                                     const void *wte, int v0, int v1, int B, int T, int C,
                                     mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "embedding_fwd_rows", dt);
    if (v0 < 0 || v1 < v0)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "embedding_fwd_rows: rows [%d,%d)", v0, v1);
    if (B <= 0 || T <= 0 || C <= 0) return MT_OK;
    const size_t c = (size_t)C, rows = (size_t)B * (size_t)T, es = mti_dtype_size(dt);
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) \
    if (rows * c > MTI_CPU_PAR_MIN)
    for (size_t r = 0; r < rows; r++) {
        if (tok[r] >= v0 && tok[r] < v1)
            memcpy((char *)out + r * c * es, (const char *)wte + (size_t)(tok[r] - v0) * c * es,
                   c * es);
        else
            memset((char *)out + r * c * es, 0, c * es);
    }
    return MT_OK;
}

/* The table quantized (the frozen token table of a quantized base): each
 * row dequantized in dt, CHUNK values at a time into a stack buffer, then
 * emb_row's sum with the position row, so the bits are embedding_fwd's on
 * the table mti_dequantize makes in dt. */
mt_status mti_cpu_embedding_fwd_q(const mti_kctx *k, void *out, const int32_t *tok, const void *wq,
                                  mti_qformat qf, int V, const void *wpe, int B, int T, int C,
                                  mti_dtype dt)
{
    mt_status s = mti_quant_emb_check(k->ctx, "embedding_fwd_q", wq, qf, V, B, T, C, dt);
    if (s) return s;
    if (mti_dry(k) || B == 0 || T == 0 || C == 0) return MT_OK;
    const size_t c = (size_t)C, rows = (size_t)B * (size_t)T, n = (size_t)V * c;
    for (size_t r = 0; r < rows; r++)
        if (tok[r] < 0 || tok[r] >= V)
            return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                            "embedding_fwd_q: token %d at %zu outside the table's %d rows",
                            (int)tok[r], r, V);
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(k)) \
    if (rows * c > MTI_CPU_PAR_MIN)
    for (size_t r = 0; r < rows; r++) {
        float eb[CHUNK]; /* CHUNK values of dt (fp32 or bf16) */
        const size_t t = r % (size_t)T, e0 = (size_t)tok[r] * c;
        for (size_t j = 0; j < c; j += CHUNK) {
            const size_t m = min_sz(CHUNK, c - j);
            /* in range by the checks above: cannot fail */
            (void)mti_dequantize(NULL, qf, wq, n, e0 + j, m, eb, dt);
            emb_row(out, r * c + j, eb, 0, wpe, t * c + j, m, dt);
        }
    }
    return MT_OK;
}

/* Channels [c0, c0 + m) of both gradients, m <= CHUNK. dwte (rows [v0, v1)
 * of the table's gradient, pointing at row v0): the row of each token in
 * that range added in (b, t) order. dwpe: for each t, the B rows summed in b order,
 * then added once. Each element's sum has this order however the channels
 * are split between threads. */
static void emb_bwd_span(float *dwte, float *dwpe, const void *dout, const int32_t *tok, size_t B,
                         size_t T, size_t c, size_t c0, size_t m, int32_t v0, int32_t v1,
                         mti_dtype dt)
{
    float gb[CHUNK], sum[CHUNK];
    if (dwte) {
        for (size_t r = 0; r < B * T; r++) {
            if (tok[r] < v0 || tok[r] >= v1) continue;
            const float *g = stage_in(dout, dt, r * c + c0, m, gb);
            float *d = dwte + (size_t)(tok[r] - v0) * c + c0;
#pragma omp simd
            for (size_t j = 0; j < m; j++) d[j] += g[j];
        }
    }
    if (dwpe) {
        for (size_t t = 0; t < T; t++) {
            memset(sum, 0, m * sizeof(float));
            for (size_t b = 0; b < B; b++) {
                const float *g = stage_in(dout, dt, (b * T + t) * c + c0, m, gb);
#pragma omp simd
                for (size_t j = 0; j < m; j++) sum[j] += g[j];
            }
            float *d = dwpe + t * c + c0;
#pragma omp simd
            for (size_t j = 0; j < m; j++) d[j] += sum[j];
        }
    }
}

/* Both gradients, or rows [v0, v1) of dwte's (dwpe NULL), channels split
 * between threads. */
static void emb_bwd(const mti_kctx *k, float *dwte, float *dwpe, const void *dout, const int32_t *tok, int B, int T,
                    int C, int32_t v0, int32_t v1, mti_dtype dt)
{
    size_t c = (size_t)C;
    int par = (size_t)B * (size_t)T * c > MTI_CPU_PAR_MIN;
    int nth = par ? mti_cpu_threads(k) : 1;
    /* each thread a contiguous run of channels in whole cache lines (16
     * floats), so rows of dwte are streamed, not picked at by the line */
    size_t span = (c + (size_t)nth - 1) / (size_t)nth;
    span = (span + 15) / 16 * 16;
    size_t items = (c + span - 1) / span;
#pragma omp parallel for schedule(static) num_threads(nth) if (par)
    for (size_t it = 0; it < items; it++) {
        size_t end = min_sz(c, (it + 1) * span);
        for (size_t c0 = it * span; c0 < end; c0 += CHUNK)
            emb_bwd_span(dwte, dwpe, dout, tok, (size_t)B, (size_t)T, c, c0,
                         min_sz(CHUNK, end - c0), v0, v1, dt);
    }
}

mt_status mti_cpu_embedding_bwd(const mti_kctx *k, float *dwte, float *dwpe, const void *dout,
                                const int32_t *tok, int B, int T, int C, mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "embedding_bwd", dt);
    if (B <= 0 || T <= 0 || C <= 0) return MT_OK;
    emb_bwd(k, dwte, dwpe, dout, tok, B, T, C, 0, INT32_MAX, dt);
    return MT_OK;
}

mt_status mti_cpu_embedding_dw_rows(const mti_kctx *k, float *dwte, const void *dout,
                                    const int32_t *tok, int B, int T, int C, int v0, int v1,
                                    mti_dtype dt)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing to compute */
    if (!dt_ok(dt)) return bad_dtype(k, "embedding_dw_rows", dt);
    if (v0 < 0 || v1 < v0)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "embedding_dw_rows: rows [%d,%d)", v0, v1);
    if (B <= 0 || T <= 0 || C <= 0 || v0 == v1) return MT_OK;
    emb_bwd(k, dwte, NULL, dout, tok, B, T, C, v0, v1, dt);
    return MT_OK;
}
