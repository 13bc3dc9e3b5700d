/*
 * bench_kernels.c - the CPU op table's GEMMs and attention, side by side with
 * what they replace, in one run.
 *
 * (a) GEMM: matmul_fwd and matmul_bwd through the table on GPT-2-shaped
 *     linear layers in fp32, fp16 and bf16, against whole-matrix oneDNN
 *     matmuls on the same shapes threaded by oneDNN over the same number of
 *     threads (fp32 and bf16), in GFLOP/s. Targets: table fp32 >= 0.9x
 *     direct fp32; table bf16 no slower than table fp32.
 * (b) Attention (B 4, C 768, H 12): the table's memory-efficient attention
 *     against a naive one that materialises the (T,T) scores and
 *     probabilities: bytes kept from forward to backward (counted from the
 *     allocations each makes in the ACT class), peak workspace, and the time
 *     of forward and of forward + backward.
 * (c) Optimizer updates over a GPT-2 124M-sized parameter (124M fp32
 *     elements; --quick 16M): SGD with momentum, AdamW, 8-bit AdamW, 4-bit
 *     AdamW (rank-1 over the matrix) and Adafactor through the table, each against the memory-bandwidth bound
 *     (its bytes moved at the rate of an in-place triad, a += s b,
 *     threaded, measured in the same turns), and AdamW against the same loop written plainly (scalar, one
 *     thread: what the update costs without the table). Also the passes
 *     over the gradients around the update (the non-finite check, the
 *     unscale, the sum of squares of clipping) and the casts of an update
 *     without master weights, against the same bound; 8-bit AdamW also
 *     through its portable loops (the hand-written block off), and on bf16
 *     weights without masters both ways: an fp32 slice and two casts, and
 *     the one-pass adamw8_bf16.
 * (d) The step's other ops: every op of a GPT-2 124M step (B 4, T 64) but
 *     the GEMMs and the update, at the step's shapes, fp32 and bf16 in
 *     turns: ms per call and per step (times its calls per step), bf16
 *     against fp32, and the rate of the memory-bound ones.
 *
 * Times are medians over batches; in each batch every target runs once, in
 * turns, so whatever else the machine does falls on all of them alike.
 *
 * Usage: bench_kernels [--quick] [--threads N] [--optim] [--ops] [--gemm]
 *        (--optim: (c) alone; --ops: (d) alone; --gemm: (a) alone)
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "ops/kernels.h"
#include "../kernels/cpu/arch.h"
#include "../kernels/cpu/cpu_ops.h"
#include "../kernels/cpu/vecmath.h"
#include "common.h"
#include "dnnl_direct.h"

static bool quick, optim_only, ops_only, gemm_only;
static mt_context *ctx;
static mti_kctx K;

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) / 4503599627370496.0 - 1.0);
}

static void die(const char *what, mt_status s)
{
    fprintf(stderr, "%s: %s (%s)\n", what, mt_status_string(s), mt_last_error(ctx));
    exit(1);
}

/* A buffer from the context's allocator of class c (so the bench's memory
 * is counted like the engine's). */
static void *take(mt_block *b, size_t bytes, mt_mem_class c)
{
    mt_alloc_request r = {.bytes = bytes, .mem_class = c, .lifetime = MT_LIFE_STEP};
    mt_status s = mt_context_alloc(ctx, &r, b);
    if (s) die("alloc", s);
    return b->ptr;
}

static void give(mt_block *b) { mt_context_free(ctx, b); }

/* n values, uniform in [-scale, scale), stored as dt. */
static void fill(void *p, mti_dtype dt, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) {
        float v = frand() * scale;
        if (dt == MTI_F32) ((float *)p)[i] = v;
        else if (dt == MTI_F16) ((uint16_t *)p)[i] = mti_f32_to_f16(v);
        else ((uint16_t *)p)[i] = mti_f32_to_bf16(v);
    }
}

/* ---- (a) GEMM ---- */

typedef struct lin {
    const char *name;
    int in, out;
} lin;

/* The tensors of one linear layer in one dtype. */
typedef struct lin_bufs {
    mt_block bx, bw, bb, by, bdy, bdx, bdw, bdb;
    void *x, *w, *b, *y, *dy, *dx;
    float *dw, *db;
} lin_bufs;

static void lin_make(lin_bufs *L, mti_dtype dt, int n, int in, int out)
{
    size_t es = mti_dtype_size(dt), nx = (size_t)n * in, nw = (size_t)out * in,
           ny = (size_t)n * out;
    L->x = take(&L->bx, nx * es, MT_MEM_ACT);
    L->w = take(&L->bw, nw * es, MT_MEM_PARAM);
    L->b = take(&L->bb, (size_t)out * es, MT_MEM_PARAM);
    L->y = take(&L->by, ny * es, MT_MEM_ACT);
    L->dy = take(&L->bdy, ny * es, MT_MEM_ACT);
    L->dx = take(&L->bdx, nx * es, MT_MEM_ACT);
    L->dw = take(&L->bdw, nw * 4, MT_MEM_GRAD);
    L->db = take(&L->bdb, (size_t)out * 4, MT_MEM_GRAD);
    fill(L->x, dt, nx, 1.0f);
    fill(L->w, dt, nw, 0.05f);
    fill(L->b, dt, (size_t)out, 0.1f);
    fill(L->dy, dt, ny, 1.0f);
    memset(L->dw, 0, nw * 4);
    memset(L->db, 0, (size_t)out * 4);
}

static void lin_free(lin_bufs *L)
{
    give(&L->bx), give(&L->bw), give(&L->bb), give(&L->by);
    give(&L->bdy), give(&L->bdx), give(&L->bdw), give(&L->bdb);
}

/* A layer's GEMMs through one threaded oneDNN matmul each: forward x W^T +
 * b, backward dy W and dW += dy^T x, and the bias gradient summed row after
 * row. What a caller without the table would write. */
typedef struct dd_layer {
    dd_mm fwd, dx, dw;
} dd_layer;

static void dd_layer_make(dd_layer *d, dnnl_data_type_t dt, int n, int in, int out)
{
    dd_make(&d->fwd, n, out, in, 0, 1, dt, dt, 1, 0);
    dd_make(&d->dx, n, in, out, 0, 0, dt, dt, 0, 0);
    dd_make(&d->dw, out, in, n, 1, 0, dt, dnnl_f32, 0, 1);
}

static void dd_layer_free(dd_layer *d) { dd_free(&d->fwd), dd_free(&d->dx), dd_free(&d->dw); }

static void dd_layer_run(const dd_layer *d, lin_bufs *L, int bwd, int n, int out, mti_dtype dt)
{
    if (!bwd) {
        dd_run(&d->fwd, L->x, L->w, L->y, L->b);
        return;
    }
    dd_run(&d->dx, L->dy, L->w, L->dx, NULL);
    dd_run(&d->dw, L->dy, L->x, L->dw, NULL);
    float row[4096];
    for (int i = 0; i < n; i++)
        for (int j0 = 0; j0 < out; j0 += 4096) {
            int len = out - j0 < 4096 ? out - j0 : 4096;
            mti_cpu_load_f32(row, L->dy, dt, (size_t)i * out + j0, (size_t)len);
            for (int j = 0; j < len; j++) L->db[j0 + j] += row[j];
        }
}

/* The targets of (a), in turns. */
enum { T_DD32, T_DD16, T_TAB32, T_TAB_F16, T_TAB16, N_TARGETS };
static const mti_dtype target_dt[N_TARGETS] = {MTI_F32, MTI_BF16, MTI_F32, MTI_F16, MTI_BF16};

/* One timed call of target t; bwd selects the backward. Returns seconds. */
static double gemm_once(int t, lin_bufs *L, const dd_layer *dd, int bwd, int n, int in, int out)
{
    const mti_ops *ops = ctx->ops;
    double t0 = now_s();
    mt_status s = MT_OK;
    if (t == T_DD32 || t == T_DD16) {
        dd_layer_run(dd, L, bwd, n, out, target_dt[t]);
    } else if (bwd) {
        s = ops->matmul_bwd(&K, L->dx, L->dw, L->db, L->dy, L->x, L->w, n, in, out, target_dt[t],
                            0);
    } else {
        s = ops->matmul_fwd(&K, L->y, L->x, L->w, L->b, n, in, out, target_dt[t]);
    }
    if (s) die("matmul", s);
    return now_s() - t0;
}

static void gemm_bench(void)
{
    static const lin layers[] = {{"qkv", 768, 2304},   {"attn proj", 768, 768},
                                 {"fc", 768, 3072},     {"fc proj", 3072, 768},
                                 {"lm head", 768, 50304}};
    static const int rows_full[] = {256, 1024}, rows_quick[] = {256};
    const int *rows = quick ? rows_quick : rows_full;
    const int n_rows = quick ? 1 : 2, batches = quick ? 5 : 15;
    printf("\n## (a) GEMM: the table vs direct GEMM calls, %d threads\n\n", mti_cpu_threads(&K));
    printf("Median GFLOP/s over %d batches, the %d targets in turns. Forward: y = x W^T + b "
           "(N,in) -> (N,out). Backward: dx, dW and db. \"direct\": one GEMM call per product "
           "on the whole matrices, one oneDNN matmul each, threaded by oneDNN (fp32, bf16). \"table\": the op table (tiles by shape, single-threaded "
           "oneDNN calls in the library's threads; results independent of the thread count).\n\n",
           batches, N_TARGETS);
    printf("| layer | N x in -> out | pass | direct fp32 | direct bf16 | table fp32 | table fp16 "
           "| table bf16 | table fp32 / direct fp32 | table bf16 / direct bf16 | table bf16 / "
           "table fp32 |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    double worst[3] = {1e9, 1e9, 1e9};
    /* oneDNN has no bf16 matmul below AVX512-BF16 (or under MT_CPU_ISA's
       cap): no direct bf16 column then, and the table converts */
    const int has_bf16 = mti_gemm_supported(MTI_BF16);
    for (int r = 0; r < n_rows; r++)
        for (size_t l = 0; l < sizeof layers / sizeof *layers; l++) {
            int n = rows[r], in = layers[l].in, out = layers[l].out;
            lin_bufs L[N_TARGETS];
            for (int t = 0; t < N_TARGETS; t++) lin_make(&L[t], target_dt[t], n, in, out);
            dd_layer dd32, dd16;
            dd_layer_make(&dd32, dnnl_f32, n, in, out);
            if (has_bf16) dd_layer_make(&dd16, dnnl_bf16, n, in, out);
            double flops = 2.0 * n * in * out;
            for (int bwd = 0; bwd < 2; bwd++) {
                /* calls per batch: about 20 ms of work at 100 GFLOP/s */
                double work = flops * (bwd ? 2 : 1);
                int reps = (int)fmax(1.0, fmin(50.0, 2e9 / work));
                static double v[N_TARGETS][64];
                for (int b = -1; b < batches; b++) /* one warm-up round */
                    for (int t = 0; t < N_TARGETS; t++) {
                        double s = 0;
                        if (t == T_DD16 && !has_bf16) continue;
                        for (int i = 0; i < reps; i++)
                            s += gemm_once(t, &L[t], t == T_DD16 ? &dd16 : &dd32, bwd, n, in,
                                           out);
                        if (b >= 0) v[t][b] = s / reps;
                    }
                double g[N_TARGETS];
                for (int t = 0; t < N_TARGETS; t++)
                    g[t] = t == T_DD16 && !has_bf16 ? NAN : work / median(v[t], batches) * 1e-9;
                double r0 = g[T_TAB32] / g[T_DD32], r1 = g[T_TAB16] / g[T_DD16],
                       r2 = g[T_TAB16] / g[T_TAB32];
                worst[0] = fmin(worst[0], r0);
                if (has_bf16) worst[1] = fmin(worst[1], r1);
                worst[2] = fmin(worst[2], r2);
                printf("| %s | %d x %d -> %d | %s |", layers[l].name, n, in, out,
                       bwd ? "bwd" : "fwd");
                for (int t = 0; t < N_TARGETS; t++)
                    isnan(g[t]) ? printf(" - |") : printf(" %.0f |", g[t]);
                if (has_bf16) printf(" %.2fx | %.2fx | %.2fx |\n", r0, r1, r2);
                else printf(" %.2fx | - | %.2fx |\n", r0, r2);
                fflush(stdout);
            }
            dd_layer_free(&dd32);
            if (has_bf16) dd_layer_free(&dd16);
            for (int t = 0; t < N_TARGETS; t++) lin_free(&L[t]);
        }
    if (has_bf16)
        printf("\nLowest ratios: table fp32 / direct fp32 %.2fx, table bf16 / direct bf16 %.2fx, "
               "table bf16 / table fp32 %.2fx.\n",
               worst[0], worst[1], worst[2]);
    else
        printf("\nLowest ratios: table fp32 / direct fp32 %.2fx, table bf16 / table fp32 %.2fx "
               "(no direct bf16: oneDNN has no bf16 matmul at this class).\n",
               worst[0], worst[2]);
}

/* ---- (b) attention ---- */

/* The naive causal attention, fp32: scores (B,H,T,T) and probabilities
 * (B,H,T,T) are made in forward and kept for backward, which makes two more
 * (T,T) tensors (gradients of both). Rows of the upper triangle are never
 * touched. */
typedef struct naive_att {
    mt_block bpre, batt;
    float *pre, *att; /* (B,H,T,T) */
} naive_att;

static mt_status naive_fwd(naive_att *na, float *out, const float *qkv, int B, int T, int C,
                           int H)
{
    const int hs = C / H;
    const float scale = 1.0f / sqrtf((float)hs);
    const size_t TT = (size_t)T * T, bytes = (size_t)B * H * TT * sizeof(float);
    na->pre = take(&na->bpre, bytes, MT_MEM_ACT);
    na->att = take(&na->batt, bytes, MT_MEM_ACT);
#pragma omp parallel for collapse(2) num_threads(mti_cpu_threads(&K)) schedule(dynamic, 8)
    for (int bh = 0; bh < B * H; bh++)
        for (int t = 0; t < T; t++) {
            const int b = bh / H, h = bh % H;
            const float *q = qkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
            float *pre = na->pre + (size_t)bh * TT + (size_t)t * T;
            float *att = na->att + (size_t)bh * TT + (size_t)t * T;
            float mx = -INFINITY;
            for (int j = 0; j <= t; j++) {
                const float *k = qkv + ((size_t)b * T + j) * 3 * C + C + (size_t)h * hs;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < hs; d++) s += q[d] * k[d];
                pre[j] = s * scale;
                mx = pre[j] > mx ? pre[j] : mx;
            }
            float sum = 0.0f;
            for (int j = 0; j <= t; j++) sum += att[j] = expf(pre[j] - mx);
            float inv = 1.0f / sum;
            float *o = out + ((size_t)b * T + t) * C + (size_t)h * hs;
            for (int d = 0; d < hs; d++) o[d] = 0.0f;
            for (int j = 0; j <= t; j++) {
                att[j] *= inv;
                const float *v = qkv + ((size_t)b * T + j) * 3 * C + 2 * C + (size_t)h * hs;
#pragma omp simd
                for (int d = 0; d < hs; d++) o[d] += att[j] * v[d];
            }
        }
    return MT_OK;
}

/* Threads own whole (b,h) pairs so dk, dv never race. Frees the saved
 * tensors at the end, as an engine would. */
static void naive_bwd(naive_att *na, float *dqkv, const float *dout, const float *qkv, int B,
                      int T, int C, int H)
{
    const int hs = C / H;
    const float scale = 1.0f / sqrtf((float)hs);
    const size_t TT = (size_t)T * T, bytes = (size_t)B * H * TT * sizeof(float);
    mt_block bdatt, bdpre;
    float *datt = take(&bdatt, bytes, MT_MEM_WORK), *dpre = take(&bdpre, bytes, MT_MEM_WORK);
    memset(dqkv, 0, (size_t)B * T * 3 * C * sizeof(float));
#pragma omp parallel for num_threads(mti_cpu_threads(&K)) schedule(dynamic, 1)
    for (int bh = 0; bh < B * H; bh++) {
        const int b = bh / H, h = bh % H;
        for (int t = 0; t < T; t++) {
            const float *att = na->att + (size_t)bh * TT + (size_t)t * T;
            float *da = datt + (size_t)bh * TT + (size_t)t * T;
            float *dp = dpre + (size_t)bh * TT + (size_t)t * T;
            const float *g = dout + ((size_t)b * T + t) * C + (size_t)h * hs;
            const float *q = qkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
            float *dq = dqkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
            float dsum = 0.0f;
            for (int j = 0; j <= t; j++) {
                const float *v = qkv + ((size_t)b * T + j) * 3 * C + 2 * C + (size_t)h * hs;
                float *dv = dqkv + ((size_t)b * T + j) * 3 * C + 2 * C + (size_t)h * hs;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < hs; d++) s += g[d] * v[d];
                da[j] = s;
                dsum += att[j] * s;
#pragma omp simd
                for (int d = 0; d < hs; d++) dv[d] += att[j] * g[d];
            }
            for (int j = 0; j <= t; j++) {
                dp[j] = att[j] * (da[j] - dsum) * scale;
                const float *k = qkv + ((size_t)b * T + j) * 3 * C + C + (size_t)h * hs;
                float *dk = dqkv + ((size_t)b * T + j) * 3 * C + C + (size_t)h * hs;
#pragma omp simd
                for (int d = 0; d < hs; d++) {
                    dq[d] += dp[j] * k[d];
                    dk[d] += dp[j] * q[d];
                }
            }
        }
    }
    give(&bdatt), give(&bdpre);
    give(&na->bpre), give(&na->batt);
}

static uint64_t class_live(mt_mem_class c)
{
    mt_memory_stats st;
    mt_context_memory_stats(ctx, &st);
    return st.per_class[c].live_bytes;
}

static uint64_t class_peak(mt_mem_class c)
{
    mt_memory_stats st;
    mt_context_memory_stats(ctx, &st);
    return st.per_class[c].peak_live_bytes;
}

static double mib(uint64_t b) { return (double)b / 1048576.0; }

/* The table's forward, with lse kept in ACT as the engine keeps it. */
typedef struct ours_att {
    mt_block blse;
    float *lse;
} ours_att;

static void ours_fwd(ours_att *oa, void *out, const void *qkv, int B, int T, int C, int H,
                     mti_dtype dt)
{
    oa->lse = take(&oa->blse, (size_t)B * H * T * sizeof(float), MT_MEM_ACT);
    mt_status s = ctx->ops->attention_fwd(&K, out, oa->lse, qkv, B, T, C, H, dt);
    if (s) die("attention_fwd", s);
}

static void ours_bwd(ours_att *oa, void *dqkv, const void *dout, const void *qkv,
                     const void *out, int B, int T, int C, int H, mti_dtype dt)
{
    mt_status s = ctx->ops->attention_bwd(&K, dqkv, dout, qkv, out, oa->lse, B, T, C, H, dt);
    if (s) die("attention_bwd", s);
    give(&oa->blse);
}

/* Targets: 0 naive fp32, 1 ours fp32, 2 ours bf16. */
#define N_ATT 3
typedef struct att_bufs {
    mt_block bq, bo, bg, bd;
    void *qkv, *out, *dout, *dqkv;
    mti_dtype dt;
} att_bufs;

static double att_once(int t, att_bufs *a, int with_bwd, int B, int T, int C, int H)
{
    double t0 = now_s();
    if (t == 0) {
        naive_att na;
        naive_fwd(&na, a->out, a->qkv, B, T, C, H);
        if (with_bwd) naive_bwd(&na, a->dqkv, a->dout, a->qkv, B, T, C, H);
        else give(&na.bpre), give(&na.batt);
    } else {
        ours_att oa;
        ours_fwd(&oa, a->out, a->qkv, B, T, C, H, a->dt);
        if (with_bwd) ours_bwd(&oa, a->dqkv, a->dout, a->qkv, a->out, B, T, C, H, a->dt);
        else give(&oa.blse);
    }
    return now_s() - t0;
}

static void att_bench(void)
{
    static const int Ts[] = {64, 128, 256, 512, 1024};
    const int B = 4, C = 768, H = 12, n_T = quick ? 4 : 5, batches = quick ? 3 : 7;
    printf("\n## (b) Attention: memory-efficient (the table) vs naive, B %d C %d H %d, %d "
           "threads\n\n",
           B, C, H, mti_cpu_threads(&K));
    printf("Kept for backward: the bytes the forward allocates in the ACT class beyond its "
           "output, counted by the context (naive: scores and probabilities, 2 x B H T T fp32; "
           "ours: lse, B H T fp32). Both also need qkv, and ours the output, which the next "
           "layer keeps anyway. Work peak: the WORK class peak over forward + backward. "
           "Times: median ms over %d batches, targets in turns.\n\n",
           batches);
    printf("| T | naive kept | ours kept | ratio | naive work peak | ours work peak | naive fwd "
           "ms | ours fwd ms | naive fwd+bwd ms | ours fwd+bwd ms | ours bf16 fwd+bwd ms | "
           "speed-up fwd | speed-up fwd+bwd | max abs diff out, dqkv |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int ti = 0; ti < n_T; ti++) {
        const int T = Ts[ti];
        const size_t nqkv = (size_t)B * T * 3 * C, no = (size_t)B * T * C;
        att_bufs a[N_ATT];
        for (int t = 0; t < N_ATT; t++) {
            a[t].dt = t == 2 ? MTI_BF16 : MTI_F32;
            size_t es = mti_dtype_size(a[t].dt);
            a[t].qkv = take(&a[t].bq, nqkv * es, MT_MEM_ACT);
            a[t].out = take(&a[t].bo, no * es, MT_MEM_ACT);
            a[t].dout = take(&a[t].bg, no * es, MT_MEM_ACT);
            a[t].dqkv = take(&a[t].bd, nqkv * es, MT_MEM_ACT);
            rng_state = 0x1234567ull + (uint64_t)T;
            fill(a[t].qkv, a[t].dt, nqkv, 1.0f);
            fill(a[t].dout, a[t].dt, no, 1.0f);
        }

        /* bytes kept and workspace: one counted forward + backward each */
        uint64_t kept[2], work[2];
        for (int t = 0; t < 2; t++) {
            uint64_t act0 = class_live(MT_MEM_ACT);
            mt_context_reset_peaks(ctx);
            if (t == 0) {
                naive_att na;
                naive_fwd(&na, a[0].out, a[0].qkv, B, T, C, H);
                kept[0] = class_live(MT_MEM_ACT) - act0;
                naive_bwd(&na, a[0].dqkv, a[0].dout, a[0].qkv, B, T, C, H);
            } else {
                ours_att oa;
                ours_fwd(&oa, a[1].out, a[1].qkv, B, T, C, H, MTI_F32);
                kept[1] = class_live(MT_MEM_ACT) - act0;
                ours_bwd(&oa, a[1].dqkv, a[1].dout, a[1].qkv, a[1].out, B, T, C, H, MTI_F32);
            }
            work[t] = class_peak(MT_MEM_WORK);
        }
        /* agreement of the two fp32 results */
        double dout_max = 0, dq_max = 0;
        for (size_t i = 0; i < no; i++)
            dout_max = fmax(dout_max, fabs(((float *)a[0].out)[i] - ((float *)a[1].out)[i]));
        for (size_t i = 0; i < nqkv; i++)
            dq_max = fmax(dq_max, fabs(((float *)a[0].dqkv)[i] - ((float *)a[1].dqkv)[i]));

        static double v[2][N_ATT][64];
        for (int b = -1; b < batches; b++)
            for (int wb = 0; wb < 2; wb++)
                for (int t = 0; t < N_ATT; t++) {
                    double s = att_once(t, &a[t], wb, B, T, C, H);
                    if (b >= 0) v[wb][t][b] = s;
                }
        double m[2][N_ATT];
        for (int wb = 0; wb < 2; wb++)
            for (int t = 0; t < N_ATT; t++) m[wb][t] = median(v[wb][t], batches);
        printf("| %d | %.2f MiB | %.3f MiB | %.0fx | %.2f MiB | %.2f MiB | %.2f | %.2f | %.2f | "
               "%.2f | %.2f | %.2fx | %.2fx | %.1e, %.1e |\n",
               T, mib(kept[0]), mib(kept[1]), (double)kept[0] / (double)kept[1], mib(work[0]),
               mib(work[1]), 1e3 * m[0][0], 1e3 * m[0][1], 1e3 * m[1][0], 1e3 * m[1][1],
               1e3 * m[1][2], m[0][0] / m[0][1], m[1][0] / m[1][1], dout_max, dq_max);
        fflush(stdout);
        for (int t = 0; t < N_ATT; t++) give(&a[t].bq), give(&a[t].bo), give(&a[t].bg), give(&a[t].bd);
    }
}

/* ---- (c) optimizer updates ---- */

/* AdamW written plainly, as torch's formula reads: what the table's update
 * replaces. */
static void plain_adamw(float *p, const float *g, float *m, float *v, size_t n, float lr,
                        float b1, float b2, float eps, float wd, int64_t t)
{
    float bc1 = 1.0f - powf(b1, (float)t), bc2 = 1.0f - powf(b2, (float)t);
    for (size_t j = 0; j < n; j++) {
        p[j] *= 1.0f - lr * wd;
        m[j] = b1 * m[j] + (1.0f - b1) * g[j];
        v[j] = b2 * v[j] + (1.0f - b2) * g[j] * g[j];
        p[j] -= lr / bc1 * m[j] / (sqrtf(v[j]) / sqrtf(bc2) + eps);
    }
}

/* An in-place triad, a = a + s b, threaded in the updates' chunking: its
 * rate (12 bytes per element, read a and b, write a: like the updates, it
 * writes only what it read) is the bandwidth bound. */
MTI_VEC_VOID(triad_n, (float *restrict a, const float *restrict b, size_t n, float s),
             (a, b, n, s))
{
#pragma omp simd
    for (size_t j = 0; j < n; j++) a[j] = a[j] + s * b[j];
}

static void triad_threaded(float *a, const float *b, size_t n)
{
    const size_t chunk = 1 << 16;
    size_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(mti_cpu_threads(&K))
    for (size_t i = 0; i < chunks; i++) {
        size_t o = i * chunk;
        triad_n(a + o, b + o, n - o < chunk ? n - o : chunk, 0.5f);
    }
}

enum { OPT_COPY, OPT_SGD, OPT_ADAMW, OPT_ADAMW_PC, OPT_ADAMW8, OPT_ADAMW8_GATHER, OPT_ADAMW8_PORTABLE,
       OPT_ADAMW8_BARE, OPT_ADAMW8_BF16, OPT_ADAMW8_BF16_GATHER, OPT_ADAMW8_BF16_PORTABLE, OPT_ADAMW4,
       OPT_ADAFACTOR, OPT_PLAIN, OPT_CHECK, OPT_UNSCALE, OPT_SUMSQ, OPT_CAST_SR, N_OPT };

/* elements per slice of an update without master weights (lib/train/trainer.c's
   BARE_SLICE) */
#define BARE MTI_SR_PIECE

/* 8-bit AdamW on bf16 weights without masters, as the trainer ran it before
 * the one-pass op (and still runs the other optimizers): per slice, the
 * weights widened into an fp32 buffer, the update, and the result rounded
 * back stochastically; three parallel sections a slice. */
static mt_status adamw8_bare(uint16_t *w, float *w32, const float *g, uint8_t *qm, uint8_t *qv,
                             float *am, float *av, size_t n, const mti_adamw_args *a)
{
    const mti_ops *ops = ctx->ops;
    mt_status s = MT_OK;
    for (size_t i = 0; i < n && !s; i += BARE) {
        size_t len = n - i < BARE ? n - i : BARE;
        s = ops->cast(&K, w32, MTI_F32, w + i, MTI_BF16, len, MTI_ROUND_NEAREST, 0);
        if (!s)
            s = ops->adamw8(&K, w32, g + i, qm + i, qv + i, am + i / MTI_Q8_BLOCK,
                            av + i / MTI_Q8_BLOCK, NULL, MTI_F32, len, a);
        if (!s) s = ops->cast(&K, w + i, MTI_BF16, w32, MTI_F32, len, MTI_ROUND_STOCHASTIC, i);
    }
    return s;
}

static void optim_bench(void)
{
    const size_t cols = 768, n = (quick ? (size_t)16 << 20 : (size_t)124 << 20) / cols * cols;
    const int64_t rows = (int64_t)(n / cols);
    const size_t nb = (n + MTI_Q8_BLOCK - 1) / MTI_Q8_BLOCK;
    const int batches = quick ? 3 : 7;
    printf("\n## (c) Optimizer updates over %zu fp32 parameters (%lld x %zu), %d threads\n\n", n,
           (long long)rows, cols, mti_cpu_threads(&K));
    printf("Bytes moved per element: the least each update must read and write (triad: 12; "
           "SGD with momentum 20; AdamW 28, and 30 refreshing a bf16 compute copy; 8-bit "
           "AdamW 16, and 12 on bf16 weights without masters (the weights read and written "
           "in bf16: the one-pass op; through an fp32 slice of %d elements and two casts, "
           "as before it, moves more); 4-bit AdamW 14, rank-1 over the "
           "matrix, which reads g and v's codes twice: 18.5 moved; Adafactor factored 12 per "
           "pass, and it makes three passes over g and two over p; the passes over the "
           "gradients before an update: the non-finite check reads 4, the unscale (fp16) "
           "reads and writes 8, clipping's sum of squares reads 4; the stochastic rounding "
           "to bf16 reads 4 and writes 2). Bound: those bytes at the rate of an "
           "in-place triad (a += s b), threaded. Median ms over %d batches, targets in "
           "turns.\n\n",
           (int)BARE, batches);
    mt_block bp, bg, bm, bv, bqm, bqv, bam, bav, brow, bcol, bscr, bq4, bs4;
    float *p = take(&bp, n * 4, MT_MEM_PARAM), *g = take(&bg, n * 4, MT_MEM_GRAD);
    float *m = take(&bm, n * 4, MT_MEM_OPTIM), *v = take(&bv, n * 4, MT_MEM_OPTIM);
    float *scr = take(&bscr, n * 4, MT_MEM_WORK);
    mt_block bw16, bw32, bpc;
    uint16_t *w16 = take(&bw16, n * 2, MT_MEM_PARAM), *pc16 = take(&bpc, n * 2, MT_MEM_PARAM);
    float *w32 = take(&bw32, BARE * 4, MT_MEM_WORK);
    float sq = 0.0f;
    int bad = 0;
    memset(scr, 0, n * 4);
    uint8_t *qm = take(&bqm, n, MT_MEM_OPTIM), *qv = take(&bqv, n, MT_MEM_OPTIM);
    float *am = take(&bam, nb * 4, MT_MEM_OPTIM), *av = take(&bav, nb * 4, MT_MEM_OPTIM);
    float *row = take(&brow, (size_t)rows * 4, MT_MEM_OPTIM), *col = take(&bcol, cols * 4, MT_MEM_OPTIM);
    rng_state = 0xABCDEFull;
    fill(p, MTI_F32, n, 0.05f);
    fill(g, MTI_F32, n, 0.01f);
    fill(w16, MTI_BF16, n, 0.05f);
    memset(m, 0, n * 4), memset(v, 0, n * 4), memset(row, 0, (size_t)rows * 4);
    memset(col, 0, cols * 4), memset(am, 0, nb * 4), memset(av, 0, nb * 4);
    memset(qm, mti_q8_zero_code(1), n), memset(qv, mti_q8_zero_code(0), n);
    /* 4-bit state: codes of m and v (n / 2 bytes each), m's block absmax, v's
       row and column maxima */
    const size_t nb4 = (n + MTI_Q4_BLOCK - 1) / MTI_Q4_BLOCK, ns4 = nb4 + (size_t)rows + cols;
    uint8_t *q4 = take(&bq4, n, MT_MEM_OPTIM);
    float *s4 = take(&bs4, ns4 * 4, MT_MEM_OPTIM);
    memset(q4, 0x77, n / 2), memset(q4 + n / 2, 0, n / 2), memset(s4, 0, ns4 * 4);
    const mti_adamw4_state st4 = {.qm = q4, .qv = q4 + n / 2, .absmax_m = s4, .scale_v = s4 + nb4};

    const mti_ops *ops = ctx->ops;
    static const char *names[N_OPT] = {
        "triad in place (a += s b)", "SGD momentum", "AdamW", "AdamW, bf16 compute copy",
        "8-bit AdamW", "8-bit AdamW, hand-written block with gathers (no permutes)",
        "8-bit AdamW, portable loops (no hand-written block)",
        "8-bit AdamW, bf16 weights, no masters, fp32 slices and casts",
        "8-bit AdamW, bf16 weights, no masters, one pass (adamw8_bf16)",
        "the same, hand-written block with gathers (no permutes)",
        "the same, portable loops (no hand-written block)", "4-bit AdamW (rank-1)",
        "Adafactor", "AdamW, plain loop", "gradient check (non-finite)", "gradient unscale (fp16)",
        "sum of squares (clipping)", "cast fp32 -> bf16, stochastic rounding"};
    static const double bytes[N_OPT] = {12, 20, 28, 30, 16, 16, 16, 12, 12, 12, 12, 14, 12 * 3 + 8 * 2, 28,
                                        4, 8, 4, 6};
    static double t[N_OPT][64];
    mti_adamw_args aa = {.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                         .weight_decay = 0.1f, .step = 1, .grad_scale = 1.0f};
    mti_sgd_args sa = {.lr = 1e-4f, .momentum = 0.9f, .first_step = 1, .grad_scale = 1.0f};
    mti_adafactor_args fa = {.lr = 1e-4f, .eps1 = 1e-30f, .eps2 = 1e-3f, .clip_threshold = 1.0f,
                             .decay_rate = -0.8f, .step = 1, .grad_scale = 1.0f};
    for (int b = -1; b < batches; b++) {
        for (int o = 0; o < N_OPT; o++) {
            double t0 = now_s();
            mt_status s = MT_OK;
            switch (o) {
            case OPT_COPY: triad_threaded(scr, g, n); break;
            case OPT_SGD: s = ops->sgd(&K, p, g, m, NULL, MTI_F32, n, &sa); break;
            case OPT_ADAMW: s = ops->adamw(&K, p, g, m, v, NULL, MTI_F32, n, &aa); break;
            case OPT_ADAMW_PC: s = ops->adamw(&K, p, g, m, v, pc16, MTI_BF16, n, &aa); break;
            case OPT_ADAMW8:
                s = ops->adamw8(&K, p, g, qm, qv, am, av, NULL, MTI_F32, n, &aa);
                break;
            case OPT_ADAMW8_GATHER: /* the map lookups as gathers */
            case OPT_ADAMW8_PORTABLE: { /* the loops gcc vectorises, without the hand-written block */
                int was = mti_cpu_q8_vector(o == OPT_ADAMW8_GATHER ? 1 : 0);
                s = ops->adamw8(&K, p, g, qm, qv, am, av, NULL, MTI_F32, n, &aa);
                mti_cpu_q8_vector(was);
                break;
            }
            case OPT_ADAMW8_BARE: s = adamw8_bare(w16, w32, g, qm, qv, am, av, n, &aa); break;
            case OPT_ADAMW8_BF16:
                s = ops->adamw8_bf16(&K, w16, g, qm, qv, am, av, n, 0, (uint64_t)b, &aa);
                break;
            case OPT_ADAMW8_BF16_GATHER:
            case OPT_ADAMW8_BF16_PORTABLE: {
                int was = mti_cpu_q8_vector(o == OPT_ADAMW8_BF16_GATHER ? 1 : 0);
                s = ops->adamw8_bf16(&K, w16, g, qm, qv, am, av, n, 0, (uint64_t)b, &aa);
                mti_cpu_q8_vector(was);
                break;
            }
            case OPT_CHECK: s = ops->unscale_check(&K, g, n, 1.0f, &bad); break;
            case OPT_UNSCALE: /* exact, and undone by the next batch's 2 */
                s = ops->unscale_check(&K, g, n, (b & 1) ? 2.0f : 0.5f, &bad);
                break;
            case OPT_SUMSQ: sq = 0.0f, s = ops->sumsq(&K, &sq, g, n); break;
            case OPT_CAST_SR:
                s = ops->cast(&K, pc16, MTI_BF16, p, MTI_F32, n, MTI_ROUND_STOCHASTIC, (uint64_t)b);
                break;
            case OPT_ADAMW4:
                s = ops->adamw4(&K, p, g, &st4, NULL, MTI_F32, rows, (int64_t)cols, 1, &aa);
                break;
            case OPT_ADAFACTOR:
                s = ops->adafactor(&K, p, g, row, col, NULL, NULL, NULL, MTI_F32, rows,
                                   (int64_t)cols, 1, &fa);
                break;
            case OPT_PLAIN:
                plain_adamw(p, g, m, v, n, aa.lr, aa.beta1, aa.beta2, aa.eps, aa.weight_decay,
                            aa.step);
                break;
            }
            if (s) die(names[o], s);
            if (b >= 0) t[o][b] = now_s() - t0;
        }
        sa.first_step = 0;
        aa.step++, fa.step++;
    }
    double med[N_OPT];
    for (int o = 0; o < N_OPT; o++) med[o] = median(t[o], batches);
    double rate = bytes[OPT_COPY] * (double)n / med[OPT_COPY]; /* bytes per second */
    printf("| update | ms | bytes/element | GB/s | bound ms | ms / bound |\n|---|---|---|---|---|---|\n");
    for (int o = 0; o < N_OPT; o++) {
        double bound = bytes[o] * (double)n / rate;
        printf("| %s | %.1f | %.0f | %.1f | %.1f | %.2fx |\n", names[o], 1e3 * med[o], bytes[o],
               bytes[o] * (double)n / med[o] / 1e9, 1e3 * bound, med[o] / bound);
    }
    printf("\nAdamW through the table vs the plain loop: %.2fx the time.\n",
           med[OPT_ADAMW] / med[OPT_PLAIN]);
    printf("\nState bytes of this matrix: AdamW %zu (8 per element), 8-bit AdamW %zu (%.4f), "
           "4-bit AdamW %zu (%.4f).\n",
           8 * n, 2 * n + 8 * nb, (double)(2 * n + 8 * nb) / (double)n, n + 4 * ns4,
           (double)(n + 4 * ns4) / (double)n);
    fflush(stdout);
    give(&bp), give(&bg), give(&bm), give(&bv), give(&bscr), give(&bqm), give(&bqv);
    give(&bam), give(&bav), give(&brow), give(&bcol), give(&bq4), give(&bs4);
    give(&bw16), give(&bpc), give(&bw32);
}

/* ---- (d) the step's other ops ---- */

enum { SO_LN_FWD, SO_LN_BWD, SO_GELU_FWD, SO_GELU_BWD, SO_ADD, SO_ATT_FWD, SO_ATT_BWD, SO_XENT,
       SO_COUNT };

/* GPT-2 124M, B 4, T 64: the tensors of one block's ops and the loss, in
 * one dtype */
typedef struct so_bufs {
    mt_block b[16];
    int nb;
    void *x, *y, *dy, *dx, *h, *dh, *qkv, *dqkv, *att, *datt, *logits;
    float *w, *bias, *dw, *db, *mean, *rstd, *lse, *losses;
    int32_t *tgt;
} so_bufs;

#define SO_B 4
#define SO_T 64
#define SO_C 768
#define SO_H 12
#define SO_V 50257
#define SO_VP 50304

static void *so_take(so_bufs *S, size_t bytes, mt_mem_class c)
{
    return take(&S->b[S->nb++], bytes, c);
}

static void so_make(so_bufs *S, mti_dtype dt)
{
    const size_t N = SO_B * SO_T, es = mti_dtype_size(dt);
    S->nb = 0;
    S->x = so_take(S, N * SO_C * es, MT_MEM_ACT);
    S->y = so_take(S, N * SO_C * es, MT_MEM_ACT);
    S->dy = so_take(S, N * SO_C * es, MT_MEM_ACT);
    S->dx = so_take(S, N * SO_C * es, MT_MEM_ACT);
    S->h = so_take(S, N * 4 * SO_C * es, MT_MEM_ACT);
    S->dh = so_take(S, N * 4 * SO_C * es, MT_MEM_ACT);
    S->qkv = so_take(S, N * 3 * SO_C * es, MT_MEM_ACT);
    S->dqkv = so_take(S, N * 3 * SO_C * es, MT_MEM_ACT);
    S->logits = so_take(S, N * SO_VP * es, MT_MEM_ACT);
    /* layernorm's parameters are in the compute dtype, its gradients fp32 */
    S->w = so_take(S, SO_C * es, MT_MEM_PARAM);
    S->bias = so_take(S, SO_C * es, MT_MEM_PARAM);
    S->dw = so_take(S, SO_C * 4, MT_MEM_GRAD);
    S->db = so_take(S, SO_C * 4, MT_MEM_GRAD);
    S->mean = so_take(S, N * 2 * 4 + N * 4, MT_MEM_ACT);
    S->rstd = S->mean + N;
    S->losses = S->mean + 2 * N;
    S->lse = so_take(S, (size_t)SO_B * SO_H * SO_T * 4, MT_MEM_ACT);
    S->tgt = so_take(S, N * 4, MT_MEM_IO);
    fill(S->x, dt, N * SO_C, 1.0f);
    fill(S->dy, dt, N * SO_C, 1.0f);
    fill(S->h, dt, N * 4 * SO_C, 2.0f);
    fill(S->dh, dt, N * 4 * SO_C, 1.0f);
    fill(S->qkv, dt, N * 3 * SO_C, 1.0f);
    fill(S->logits, dt, N * SO_VP, 3.0f);
    fill(S->w, dt, SO_C, 1.0f);
    fill(S->bias, dt, SO_C, 0.1f);
    memset(S->dw, 0, SO_C * 4), memset(S->db, 0, SO_C * 4);
    for (size_t i = 0; i < N; i++) S->tgt[i] = (int32_t)(i * 7919 % SO_V);
}

static void so_free(so_bufs *S)
{
    for (int i = 0; i < S->nb; i++) give(&S->b[i]);
}

static double so_run(int op, so_bufs *S, mti_dtype dt, int reps)
{
    const mti_ops *o = ctx->ops;
    const int N = SO_B * SO_T;
    mt_status s = MT_OK;
    double t0 = now_s();
    for (int r = 0; r < reps && !s; r++) {
        switch (op) {
        case SO_LN_FWD:
            s = o->layernorm_fwd(&K, S->y, S->mean, S->rstd, S->x, S->w, S->bias, N, SO_C, dt);
            break;
        case SO_LN_BWD:
            s = o->layernorm_bwd(&K, S->dx, S->dw, S->db, S->dy, S->x, S->w, S->mean, S->rstd, N,
                                 SO_C, dt, 1);
            break;
        case SO_GELU_FWD: s = o->gelu_fwd(&K, S->dqkv, S->h, (size_t)N * 4 * SO_C, dt); break;
        case SO_GELU_BWD:
            s = o->gelu_bwd(&K, S->logits, S->dh, S->h, (size_t)N * 4 * SO_C, dt);
            break;
        case SO_ADD: s = o->add(&K, S->y, S->x, S->dy, (size_t)N * SO_C, dt); break;
        case SO_ATT_FWD:
            s = o->attention_fwd(&K, S->y, S->lse, S->qkv, SO_B, SO_T, SO_C, SO_H, dt);
            break;
        case SO_ATT_BWD:
            s = o->attention_bwd(&K, S->dqkv, S->dy, S->qkv, S->y, S->lse, SO_B, SO_T, SO_C, SO_H,
                                 dt);
            break;
        case SO_XENT:
            s = o->xent(&K, S->losses, S->logits, S->logits, S->tgt, N, SO_V, SO_VP, 1.0f / N, dt);
            break;
        }
    }
    if (s) die("step op", s);
    return (now_s() - t0) / reps;
}

static void step_ops_bench(void)
{
    static const char *names[SO_COUNT] = {"layernorm fwd", "layernorm bwd", "GELU fwd",
                                          "GELU bwd",      "residual add",  "attention fwd",
                                          "attention bwd", "cross-entropy (fwd + bwd)"};
    /* calls in a step of GPT-2 124M (12 blocks) */
    static const int calls[SO_COUNT] = {25, 25, 12, 12, 24, 12, 12, 1};
    /* elements each call reads and writes in the tensors' dtype (the rate
       of the memory-bound ops) */
    const double N = SO_B * SO_T;
    const double elems[SO_COUNT] = {2 * N * SO_C, 3 * N * SO_C, 2 * N * 4 * SO_C, 3 * N * 4 * SO_C,
                                    3 * N * SO_C, 4 * N * SO_C, 8 * N * SO_C, N * SO_VP};
    static const int reps[SO_COUNT] = {20, 20, 10, 10, 20, 4, 4, 2};
    const int batches = quick ? 5 : 11;
    static double t[SO_COUNT][2][32];
    so_bufs S[2];
    so_make(&S[0], MTI_F32);
    so_make(&S[1], MTI_BF16);
    const mti_dtype dts[2] = {MTI_F32, MTI_BF16};
    for (int b = -1; b < batches; b++)
        for (int op = 0; op < SO_COUNT; op++)
            for (int d = 0; d < 2; d++) {
                double x = so_run(op, &S[d], dts[d], reps[op]);
                if (b >= 0) t[op][d][b] = x;
            }
    printf("\n## (d) The step's other ops, GPT-2 124M B%d T%d, %d threads\n\n", SO_B, SO_T,
           mti_cpu_threads(&K));
    printf("Median over %d batches, fp32 and bf16 in turns. ms/step = ms/call x calls per "
           "step (12 blocks). GB/s: the elements each call reads and writes, at the dtype's "
           "size.\n\n",
           batches);
    printf("| op | calls/step | fp32 ms/call | bf16 ms/call | bf16 / fp32 | fp32 ms/step | "
           "bf16 ms/step | fp32 GB/s | bf16 GB/s |\n|---|---|---|---|---|---|---|---|---|\n");
    double tot[2] = {0, 0};
    for (int op = 0; op < SO_COUNT; op++) {
        double m[2];
        for (int d = 0; d < 2; d++) {
            m[d] = median(t[op][d], batches);
            tot[d] += m[d] * calls[op];
        }
        printf("| %s | %d | %.3f | %.3f | %.2fx | %.2f | %.2f | %.1f | %.1f |\n", names[op],
               calls[op], 1e3 * m[0], 1e3 * m[1], m[1] / m[0], 1e3 * m[0] * calls[op],
               1e3 * m[1] * calls[op], elems[op] * 4 / m[0] / 1e9, elems[op] * 2 / m[1] / 1e9);
    }
    printf("| all of them | | | | %.2fx | %.2f | %.2f | | |\n", tot[1] / tot[0], 1e3 * tot[0],
           1e3 * tot[1]);
    fflush(stdout);
    so_free(&S[1]);
    so_free(&S[0]);
}

int main(int argc, char **argv)
{
    int threads = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--optim")) optim_only = true;
        else if (!strcmp(argv[i], "--ops")) ops_only = true;
        else if (!strcmp(argv[i], "--gemm")) gemm_only = true;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_kernels [--quick] [--threads N] [--optim] [--ops] [--gemm]\n");
            return 2;
        }
    }
    /* Idle OpenMP threads must not spin while the other side of a comparison
     * (the plain one-thread loops of (c)) runs: they sleep at once. */
    if (!getenv("OMP_WAIT_POLICY")) {
        setenv("OMP_WAIT_POLICY", "passive", 0);
        execv("/proc/self/exe", argv);
        /* if re-executing fails, run as we are */
    }
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = threads; /* 0: every online CPU */
    mt_status s = mt_context_create(&cfg, &ctx);
    if (s) {
        fprintf(stderr, "%s\n", mt_last_error(NULL));
        return 1;
    }
    K.ctx = ctx, K.dev = ctx->dev;
    omp_set_num_threads(mti_cpu_threads(&K)); /* oneDNN's threads in the direct calls */
    printf("# bench_kernels (memtrain %s, %s, OMP_WAIT_POLICY=%s)\n# ", mt_version(),
           mt_context_device_name(ctx), getenv("OMP_WAIT_POLICY"));
    dd_describe(stdout);
    if (!optim_only && !ops_only) {
        gemm_bench();
        if (!gemm_only) att_bench();
    }
    if (!ops_only && !gemm_only) optim_bench();
    if (!optim_only && !gemm_only) step_ops_bench();
    mt_context_destroy(ctx);
    return 0;
}
