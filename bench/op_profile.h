/*
 * op_profile.h - time per op of a context's op table: a table of the same
 * ops, each timing a call of the context's own table (wall clock, seconds,
 * summed per op). Installed on a fresh context before a model is made;
 * bench_gpt2 --profile prints it per step, as JSON and as a table of op
 * families with each one's share of the step.
 */
#ifndef MT_BENCH_OP_PROFILE_H
#define MT_BENCH_OP_PROFILE_H

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "ops/kernels.h"
#include "common.h"

enum {
    P_cast, P_embedding_fwd, P_embedding_fwd_rows, P_embedding_bwd, P_embedding_dw_rows, P_embedding_fwd_q, P_matmul_fwd, P_matmul_bwd,
    P_matmul_dw_rows, P_matmul_fwd_q, P_matmul_dx_q, P_layernorm_fwd, P_layernorm_bwd, P_gelu_fwd, P_gelu_bwd, P_relu_fwd,
    P_relu_bwd, P_add, P_accumulate, P_attention_fwd, P_attention_bwd, P_xent, P_xent_kd, P_xent_vp,
    P_unscale_check, P_sumsq, P_sgd, P_adamw, P_adamw8, P_adamw8_bf16, P_adamw4, P_adafactor,
    P_dequantize, P_sparse_expand, P_sparse_compress, P_sparse_matmul_fwd, P_sparse_matmul_bwd,
    P_COUNT
};
static const char *const prof_names[P_COUNT] = {
    "cast", "embedding_fwd", "embedding_fwd_rows", "embedding_bwd", "embedding_dw_rows", "embedding_fwd_q", "matmul_fwd", "matmul_bwd",
    "matmul_dw_rows", "matmul_fwd_q", "matmul_dx_q", "layernorm_fwd", "layernorm_bwd", "gelu_fwd", "gelu_bwd", "relu_fwd",
    "relu_bwd", "add", "accumulate", "attention_fwd", "attention_bwd", "xent", "xent_kd", "xent_vp",
    "unscale_check", "sumsq", "sgd", "adamw", "adamw8", "adamw8_bf16", "adamw4", "adafactor",
    "dequantize", "sparse_expand", "sparse_compress", "sparse_matmul_fwd", "sparse_matmul_bwd"};

/* Op families of the table printed with the profile; each op belongs to one. */
enum { F_GEMM, F_ATTN, F_LN, F_ACT, F_ADD, F_XENT, F_EMB, F_CAST, F_CHECK, F_OPT, F_COUNT };
static const char *const prof_family_names[F_COUNT] = {
    "GEMM (matmul fwd, bwd, dW rows, quantized, sparse)", "attention (fwd, bwd)", "layernorm (fwd, bwd)",
    "GELU / ReLU (fwd, bwd)", "residual add, accumulate", "cross-entropy",
    "embedding", "casts (incl. stochastic rounding, pruned tensors)", "gradient check, sum of squares",
    "optimizer update"};
static const unsigned char prof_family[P_COUNT] = {
    F_CAST, F_EMB, F_EMB, F_EMB, F_EMB, F_EMB, F_GEMM, F_GEMM, F_GEMM, F_GEMM, F_GEMM, F_LN, F_LN,
    F_ACT, F_ACT, F_ACT, F_ACT, F_ADD, F_ADD, F_ATTN, F_ATTN, F_XENT, F_XENT, F_XENT, F_CHECK, F_CHECK, F_OPT, F_OPT,
    F_OPT, F_OPT, F_OPT, F_OPT, F_CAST, F_CAST, F_CAST, F_GEMM, F_GEMM};

static const mti_ops *prof_inner;
static double prof_s[P_COUNT];
static long prof_calls[P_COUNT];

#define PROF(op, params, args)                                                                 \
    static mt_status prof_##op params                                                          \
    {                                                                                          \
        double t0_ = now_s();                                                                  \
        mt_status s_ = prof_inner->op args;                                                    \
        prof_s[P_##op] += now_s() - t0_;                                                       \
        prof_calls[P_##op]++;                                                                  \
        return s_;                                                                             \
    }

PROF(cast, (const mti_kctx *k, void *d, mti_dtype dd, const void *s, mti_dtype sd, size_t n,
            mti_rounding r, uint64_t seed), (k, d, dd, s, sd, n, r, seed))
PROF(embedding_fwd, (const mti_kctx *k, void *o, const int32_t *t, const void *wte,
                     const void *wpe, int B, int T, int C, mti_dtype dt),
     (k, o, t, wte, wpe, B, T, C, dt))
PROF(embedding_fwd_rows, (const mti_kctx *k, void *o, const int32_t *t, const void *wte, int v0,
                          int v1, int B, int T, int C, mti_dtype dt),
     (k, o, t, wte, v0, v1, B, T, C, dt))
PROF(embedding_bwd, (const mti_kctx *k, float *dwte, float *dwpe, const void *d,
                     const int32_t *t, int B, int T, int C, mti_dtype dt),
     (k, dwte, dwpe, d, t, B, T, C, dt))
PROF(embedding_dw_rows, (const mti_kctx *k, float *dwte, const void *d, const int32_t *t, int B,
                         int T, int C, int v0, int v1, mti_dtype dt),
     (k, dwte, d, t, B, T, C, v0, v1, dt))
PROF(embedding_fwd_q, (const mti_kctx *k, void *o, const int32_t *t, const void *wq,
                       mti_qformat qf, int V, const void *wpe, int B, int T, int C, mti_dtype dt),
     (k, o, t, wq, qf, V, wpe, B, T, C, dt))
PROF(matmul_fwd, (const mti_kctx *k, void *y, const void *x, const void *w, const void *b, int n,
                  int in, int out, mti_dtype dt), (k, y, x, w, b, n, in, out, dt))
PROF(matmul_bwd, (const mti_kctx *k, void *dx, float *dw, float *db, const void *dy,
                  const void *x, const void *w, int n, int in, int out, mti_dtype dt, int acc),
     (k, dx, dw, db, dy, x, w, n, in, out, dt, acc))
PROF(matmul_dw_rows, (const mti_kctx *k, float *dw, const void *dy, const void *x, int n, int in,
                      int out, int o0, int o1, mti_dtype dt, int flags),
     (k, dw, dy, x, n, in, out, o0, o1, dt, flags))
PROF(matmul_fwd_q, (const mti_kctx *k, void *y, const void *x, const void *wq, mti_qformat qf,
                    const void *b, int n, int in, int out, mti_dtype dt),
     (k, y, x, wq, qf, b, n, in, out, dt))
PROF(matmul_dx_q, (const mti_kctx *k, void *dx, const void *dy, const void *wq, mti_qformat qf,
                   int n, int in, int out, mti_dtype dt, int acc),
     (k, dx, dy, wq, qf, n, in, out, dt, acc))
PROF(dequantize, (const mti_kctx *k, void *o, const void *wq, mti_qformat qf, size_t n, size_t at,
                  size_t len, mti_dtype dt), (k, o, wq, qf, n, at, len, dt))
PROF(sparse_expand, (const mti_kctx *k, void *d, const void *v, const void *meta,
                     const mti_sp_layout *L, size_t at, size_t len, mti_dtype dt),
     (k, d, v, meta, L, at, len, dt))
PROF(sparse_compress, (const mti_kctx *k, void *v, const void *d, const void *meta,
                       const mti_sp_layout *L, size_t at, size_t len, mti_dtype dt, int add),
     (k, v, d, meta, L, at, len, dt, add))
PROF(layernorm_fwd, (const mti_kctx *k, void *o, float *mean, float *rstd, const void *x,
                     const void *w, const void *b, int n, int c, mti_dtype dt),
     (k, o, mean, rstd, x, w, b, n, c, dt))
PROF(layernorm_bwd, (const mti_kctx *k, void *dx, float *dw, float *db, const void *d,
                     const void *x, const void *w, const float *mean, const float *rstd, int n,
                     int c, mti_dtype dt, int acc), (k, dx, dw, db, d, x, w, mean, rstd, n, c, dt, acc))
PROF(gelu_fwd, (const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt), (k, y, x, n, dt))
PROF(gelu_bwd, (const mti_kctx *k, void *dx, const void *dy, const void *x, size_t n, mti_dtype dt),
     (k, dx, dy, x, n, dt))
PROF(relu_fwd, (const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt), (k, y, x, n, dt))
PROF(relu_bwd, (const mti_kctx *k, void *dx, const void *dy, const void *y, size_t n, mti_dtype dt),
     (k, dx, dy, y, n, dt))
PROF(add, (const mti_kctx *k, void *y, const void *a, const void *b, size_t n, mti_dtype dt),
     (k, y, a, b, n, dt))
PROF(accumulate, (const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt), (k, y, x, n, dt))
PROF(attention_fwd, (const mti_kctx *k, void *o, float *lse, const void *qkv, int B, int T, int C,
                     int H, mti_dtype dt), (k, o, lse, qkv, B, T, C, H, dt))
PROF(attention_bwd, (const mti_kctx *k, void *dqkv, const void *d, const void *qkv, const void *o,
                     const float *lse, int B, int T, int C, int H, mti_dtype dt),
     (k, dqkv, d, qkv, o, lse, B, T, C, H, dt))
PROF(xent, (const mti_kctx *k, float *l, void *dl, const void *lg, const int32_t *t, int n, int V,
            int Vp, float dloss, mti_dtype dt), (k, l, dl, lg, t, n, V, Vp, dloss, dt))
PROF(xent_vp, (const mti_kctx *k, int ph, float *st, float *l, void *dl, const void *lg,
               const int32_t *t, int n, int v0, int Vr, int W, float dloss, mti_dtype dt),
     (k, ph, st, l, dl, lg, t, n, v0, Vr, W, dloss, dt))
PROF(xent_kd, (const mti_kctx *k, float *l, void *dl, const void *lg, const float *tl,
               const int32_t *t, int n, int V, int Vp, int tVp, float alpha, float temp,
               float dloss, mti_dtype dt), (k, l, dl, lg, tl, t, n, V, Vp, tVp, alpha, temp, dloss, dt))
PROF(unscale_check, (const mti_kctx *k, float *g, size_t n, float inv, int *bad), (k, g, n, inv, bad))
PROF(sumsq, (const mti_kctx *k, float *s, const float *g, size_t n), (k, s, g, n))
PROF(sgd, (const mti_kctx *k, float *p, const float *g, float *m, void *pc, mti_dtype pd, size_t n,
           const mti_sgd_args *a), (k, p, g, m, pc, pd, n, a))
PROF(adamw, (const mti_kctx *k, float *p, const float *g, float *m, float *v, void *pc,
             mti_dtype pd, size_t n, const mti_adamw_args *a), (k, p, g, m, v, pc, pd, n, a))
PROF(adamw8, (const mti_kctx *k, float *p, const float *g, uint8_t *qm, uint8_t *qv, float *am,
              float *av, void *pc, mti_dtype pd, size_t n, const mti_adamw_args *a),
     (k, p, g, qm, qv, am, av, pc, pd, n, a))
PROF(adamw8_bf16, (const mti_kctx *k, uint16_t *w, const float *g, uint8_t *qm, uint8_t *qv,
                   float *am, float *av, size_t n, size_t at, uint64_t seed,
                   const mti_adamw_args *a), (k, w, g, qm, qv, am, av, n, at, seed, a))
PROF(adamw4, (const mti_kctx *k, float *p, const float *g, const mti_adamw4_state *st, void *pc,
              mti_dtype pd, int64_t rows, int64_t cols, int r1, const mti_adamw_args *a),
     (k, p, g, st, pc, pd, rows, cols, r1, a))
PROF(adafactor, (const mti_kctx *k, float *p, const float *g, float *row, float *col, float *v,
                 float *m, void *pc, mti_dtype pd, int64_t rows, int64_t cols, int f,
                 const mti_adafactor_args *a), (k, p, g, row, col, v, m, pc, pd, rows, cols, f, a))
PROF(sparse_matmul_fwd, (const mti_kctx *k, void *y, const void *x, const void *v,
                         const void *meta, const mti_sp_layout *L, const void *b, int n, int in,
                         int out, mti_dtype dt), (k, y, x, v, meta, L, b, n, in, out, dt))
PROF(sparse_matmul_bwd, (const mti_kctx *k, void *dx, float *dw, float *db, const void *dy,
                         const void *x, const void *v, const void *meta, const mti_sp_layout *L,
                         int n, int in, int out, mti_dtype dt, int flags),
     (k, dx, dw, db, dy, x, v, meta, L, n, in, out, dt, flags))

static int prof_matmul_dw_align(int out, int in) { return prof_inner->matmul_dw_align(out, in); }
static int prof_sparse_matmul_choice(const mti_kctx *k, const mti_sp_layout *L, int n, int in,
                                     int out, mti_dtype dt)
{
    return prof_inner->sparse_matmul_choice(k, L, n, in, out, dt);
}

/* Made from lib/ops/kernels.h's list of the ops, as the CPU and CUDA tables
 * are: an op added there and not timed here does not compile. */
#define PROF_OP(op) .op = prof_##op,
static mti_ops prof_ops = {.name = "profiled", MTI_OPS(PROF_OP)};
#undef PROF_OP

/* Puts the timing table in front of ctx's own (before a model is made). */
static inline void prof_install(mt_context *ctx)
{
    prof_inner = ctx->ops;
    prof_ops.device = prof_inner->device;
    ctx->ops = &prof_ops;
}

static inline void prof_reset(void)
{
    memset(prof_s, 0, sizeof prof_s);
    memset(prof_calls, 0, sizeof prof_calls);
}

/* JSON: ms and calls per step of each op that ran, and the ops' total. */
static inline void prof_print(FILE *f, int steps)
{
    double total = 0.0;
    fprintf(f, "\"profile_ms_per_step\": {");
    int first = 1;
    for (int i = 0; i < P_COUNT; i++) {
        if (!prof_calls[i]) continue;
        fprintf(f, "%s\"%s\": %.2f", first ? "" : ", ", prof_names[i], 1e3 * prof_s[i] / steps);
        total += prof_s[i];
        first = 0;
    }
    fprintf(f, "}, \"profile_calls_per_step\": {");
    first = 1;
    for (int i = 0; i < P_COUNT; i++) {
        if (!prof_calls[i]) continue;
        fprintf(f, "%s\"%s\": %.1f", first ? "" : ", ", prof_names[i],
                (double)prof_calls[i] / steps);
        first = 0;
    }
    fprintf(f, "}, \"profile_ops_ms_per_step\": %.2f, ", 1e3 * total / steps);
}

/* A table of op families: ms per step, calls per step and share of the
 * step (step_ms, the mean step), the ops of each family beneath it, and
 * the rest of the step (the engine's own work: allocation, bookkeeping,
 * the host side of the checks). */
static inline void prof_table(FILE *f, int steps, double step_ms, const char *title)
{
    double fam[F_COUNT] = {0}, total = 0.0;
    long calls[F_COUNT] = {0};
    for (int i = 0; i < P_COUNT; i++) {
        fam[prof_family[i]] += 1e3 * prof_s[i] / steps;
        calls[prof_family[i]] += prof_calls[i];
        total += 1e3 * prof_s[i] / steps;
    }
    fprintf(f, "\n%s: profile of a step, %.1f ms (mean of %d)\n\n", title, step_ms, steps);
    fprintf(f, "| op family | ms/step | share of the step | calls/step | ops (ms/step) |\n");
    fprintf(f, "|---|---|---|---|---|\n");
    for (;;) { /* families by time, largest first */
        int best = -1;
        for (int c = 0; c < F_COUNT; c++)
            if (calls[c] && (best < 0 || fam[c] > fam[best])) best = c;
        if (best < 0) break;
        fprintf(f, "| %s | %.1f | %.1f%% | %.0f | ", prof_family_names[best], fam[best],
                100.0 * fam[best] / step_ms, (double)calls[best] / steps);
        int first = 1;
        for (int i = 0; i < P_COUNT; i++)
            if (prof_family[i] == best && prof_calls[i]) {
                fprintf(f, "%s%s %.1f", first ? "" : ", ", prof_names[i], 1e3 * prof_s[i] / steps);
                first = 0;
            }
        fprintf(f, " |\n");
        calls[best] = 0;
    }
    fprintf(f, "| rest of the step (engine) | %.1f | %.1f%% | | |\n", step_ms - total,
            100.0 * (step_ms - total) / step_ms);
    fprintf(f, "| **step** | %.1f | 100%% | | |\n", step_ms);
}

#endif /* MT_BENCH_OP_PROFILE_H */
