/*
 * bench_sparse.c - pruned weights, measured (docs/benchmarks.md, "Pruning
 * and sparse training").
 *
 * (a) Bytes of the pruned tensors per class against dense: a GPT of the
 *     GPT-2 124M block shape (C 768, H 12; L 4, byte vocabulary), AdamW, fp32
 *     and bf16 with masters, dense and pruned 50%, 90% and 2:4 by
 *     magnitude at create. Each class's live bytes between steps (PARAM,
 *     MASTER, OPTIM) and its peak in a step (GRAD), from the library's
 *     accounting; the pruned tensors' bytes are the dense linear weights'
 *     minus what the class lost, against the dense linear weights'.
 * (b) Step time against dense at 50%, 75% and 90% (the same model, fp32
 *     AdamW, B 8 x T 64): the median of a few steps each, the runs taken in
 *     turns so that the machine's noise falls on both.
 * (c) --quality: GPT-2 124M (L 12, C 768, H 12, byte vocabulary) trained
 *     dense on a text file (the built-in corpus, build/corpus/corpus.txt),
 *     then pruned 50% by one-shot magnitude, by Wanda (4 calibration
 *     batches) and by 2:4 magnitude: the validation loss right after the
 *     prune and after more steps of sparse training, beside the dense model
 *     trained as many steps more; and the whole run's peak against dense.
 *
 * (d) The sparse GEMMs against the dense tile, for one GPT-2 MLP weight (O
 *     3072 x I 768) and N = 512 and 4096 rows, fp32, on the context's
 *     threads: the dense path (expand the pruned weight into its tile, then
 *     the op table's GEMMs: forward, and backward's dx and dW, then gather
 *     dW's kept entries) against the op table's sparse GEMMs
 *     (sparse_matmul_fwd / _bwd: kernels/cpu/sparse_mm.c), at 50% to 98%
 *     unstructured and at 2:4 and 1:16, with the choice the library makes
 *     (sparse_matmul_choice). The median of a few runs each.
 *
 * Usage: bench_sparse [--quick] [--threads N] [--quality] [--data FILE]
 *                     [--dense-steps N] [--sparse-steps N] [--kernels]
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "memtrain.h"
#include "internal.h"
#include "ops/kernels.h"
#include "common.h"

static int threads = 0, layers = 4, dense_steps = 300, sparse_steps = 200;
static bool quick, quality, kernels_only;
static const char *data_path = "build/corpus/corpus.txt";

static void die(mt_context *ctx, const char *what, mt_status s)
{
    fprintf(stderr, "%s: %s (%s)\n", what, mt_status_string(s), mt_last_error(ctx));
    exit(1);
}
#define TRY(ctx, what, call)                                                                      \
    do {                                                                                          \
        mt_status s_ = (call);                                                                    \
        if (s_) die(ctx, what, s_);                                                               \
    } while (0)

static mt_context *context(void)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.threads = threads;
    mt_context *ctx;
    TRY(NULL, "context", mt_context_create(&cc, &ctx));
    return ctx;
}

static mt_model *gpt(mt_context *ctx, int L, int T)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 256, g.max_seq = T, g.layers = L, g.heads = 12, g.channels = 768, g.seed = 5;
    mt_model *m;
    TRY(ctx, "model", mt_model_gpt_create(ctx, &g, &m));
    return m;
}

static bool linear_w(const char *name)
{
    const size_t l = strlen(name);
    return l > 2 && !strcmp(name + l - 2, ".w") &&
           (strstr(name, ".qkv.") || strstr(name, ".attproj.") || strstr(name, ".fc.") ||
            strstr(name, ".fcproj."));
}

static size_t linear_elems(const mt_model *m)
{
    size_t n = 0;
    for (int i = 0; i < mt_model_num_tensors(m); i++) {
        mt_param_info pi;
        mt_model_param_info(m, i, &pi);
        if (linear_w(pi.name)) n += pi.numel;
    }
    return n;
}

static void batch_of(mt_batch *b, int32_t *tok, int32_t *tg, int B, int T, int step)
{
    for (int i = 0; i < B * T; i++) {
        tok[i] = (int32_t)((i * 31 + step * 17 + i / T * 7) % 256);
        tg[i] = (int32_t)((i * 13 + step * 5 + 3) % 256);
    }
    *b = (mt_batch){.n = B, .tokens = tok, .targets = tg, .seq_len = T};
}

typedef struct cfgdesc {
    const char *name;
    double s;
    int n, m;
} cfgdesc;

static void trainer_cfg(mt_trainer_config *tc, mt_precision prec, const cfgdesc *c, int B, int T)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B, tc->max_seq = T;
    tc->optimizer = MT_OPT_ADAMW, tc->lr = 3e-4f, tc->weight_decay = 0.0f;
    tc->precision = prec;
    if (c && (c->s > 0 || c->m)) {
        tc->prune.method = MT_PRUNE_MAGNITUDE;
        tc->prune.sparsity = c->s;
        tc->prune.nm_n = c->n, tc->prune.nm_m = c->m;
    }
}

/* (a) */
static void section_bytes(void)
{
    static const cfgdesc cfgs[] = {{"dense", 0, 0, 0}, {"50%", 0.5, 0, 0}, {"90%", 0.9, 0, 0},
                                   {"2:4", 0, 2, 4}};
    static const mt_precision precs[] = {MT_PREC_FP32, MT_PREC_BF16};
    const int B = 2, T = 32;
    printf("(a) bytes of the pruned tensors per class against dense (GPT C768 H12 L%d, AdamW)\n",
           layers);
    printf("%-6s %-6s %10s %10s %10s %10s\n", "prec", "mask", "PARAM", "MASTER", "GRAD", "OPTIM");
    for (int p = 0; p < 2; p++) {
        uint64_t dense[MT_MEM_COUNT] = {0};
        for (int c = 0; c < 4; c++) {
            mt_context *ctx = context();
            mt_model *m = gpt(ctx, layers, T);
            const size_t nl = linear_elems(m);
            mt_trainer_config tc;
            trainer_cfg(&tc, precs[p], &cfgs[c], B, T);
            mt_trainer *t;
            TRY(ctx, "trainer", mt_trainer_create(m, &tc, &t));
            mt_memory_stats st;
            TRY(ctx, "stats", mt_context_memory_stats(ctx, &st));
            uint64_t v[MT_MEM_COUNT];
            for (int k = 0; k < MT_MEM_COUNT; k++) v[k] = st.per_class[k].live_bytes;
            int32_t tok[B * T], tg[B * T];
            mt_batch b;
            batch_of(&b, tok, tg, B, T, 0);
            TRY(ctx, "step", mt_trainer_step(t, &b, NULL));
            TRY(ctx, "stats", mt_context_memory_stats(ctx, &st));
            v[MT_MEM_GRAD] = st.per_class[MT_MEM_GRAD].peak_live_bytes;
            if (c == 0) memcpy(dense, v, sizeof dense);
            const double per[MT_MEM_COUNT] = {[MT_MEM_PARAM] = precs[p] == MT_PREC_FP32 ? 4 : 2,
                                              [MT_MEM_MASTER] = precs[p] == MT_PREC_FP32 ? 0 : 4,
                                              [MT_MEM_GRAD] = 4,
                                              [MT_MEM_OPTIM] = 8};
            printf("%-6s %-6s", precs[p] == MT_PREC_FP32 ? "fp32" : "bf16", cfgs[c].name);
            const mt_mem_class cls[4] = {MT_MEM_PARAM, MT_MEM_MASTER, MT_MEM_GRAD, MT_MEM_OPTIM};
            for (int k = 0; k < 4; k++) {
                const double full = per[cls[k]] * (double)nl;
                if (full == 0) {
                    printf(" %10s", "-");
                    continue;
                }
                const double pruned = full - ((double)dense[cls[k]] - (double)v[cls[k]]);
                printf(" %9.4fx", pruned / full);
            }
            printf("\n");
            mt_trainer_destroy(t);
            mt_model_destroy(m);
            mt_context_destroy(ctx);
        }
    }
}

/* (b) */
static void section_time(void)
{
    static const cfgdesc cfgs[] = {{"dense", 0, 0, 0}, {"50%", 0.5, 0, 0}, {"75%", 0.75, 0, 0},
                                   {"90%", 0.9, 0, 0}, {"2:4", 0, 2, 4}};
    enum { NC = 5 };
    const int B = 8, T = 64, reps = quick ? 3 : 7;
    mt_context *ctx[NC];
    mt_model *m[NC];
    mt_trainer *t[NC];
    double ms[NC][16];
    for (int c = 0; c < NC; c++) {
        ctx[c] = context();
        m[c] = gpt(ctx[c], layers, T);
        mt_trainer_config tc;
        trainer_cfg(&tc, MT_PREC_FP32, &cfgs[c], B, T);
        TRY(ctx[c], "trainer", mt_trainer_create(m[c], &tc, &t[c]));
    }
    int32_t tok[B * T], tg[B * T];
    for (int r = -1; r < reps; r++) /* (one warm-up step each) */
        for (int c = 0; c < NC; c++) {
            mt_batch b;
            batch_of(&b, tok, tg, B, T, r + 1);
            const double t0 = now_s();
            TRY(ctx[c], "step", mt_trainer_step(t[c], &b, NULL));
            if (r >= 0) ms[c][r] = 1e3 * (now_s() - t0);
        }
    printf("(b) step time against dense (GPT C768 H12 L%d, fp32 AdamW, B %d x T %d, median of %d)\n",
           layers, B, T, reps);
    double d = 0;
    for (int c = 0; c < NC; c++) {
        const double med = median(ms[c], reps);
        if (c == 0) d = med;
        printf("%-6s %9.1f ms  %.3fx\n", cfgs[c].name, med, med / d);
        mt_trainer_destroy(t[c]);
        mt_model_destroy(m[c]);
        mt_context_destroy(ctx[c]);
    }
}

/* (c) */
static double val_loss(mt_context *ctx, mt_trainer *t, mt_data *d, int batches)
{
    TRY(ctx, "seek", mt_data_seek_val(d, 0));
    double sum = 0;
    for (int i = 0; i < batches; i++) {
        mt_batch b;
        float l;
        TRY(ctx, "val batch", mt_data_next(d, MT_DATA_VAL, &b));
        TRY(ctx, "eval", mt_trainer_eval(t, &b, &l, NULL));
        sum += l;
    }
    return sum / batches;
}

static void train(mt_context *ctx, mt_trainer *t, mt_data *d, int steps)
{
    for (int i = 0; i < steps; i++) {
        mt_batch b;
        TRY(ctx, "batch", mt_data_next(d, MT_DATA_TRAIN, &b));
        TRY(ctx, "step", mt_trainer_step(t, &b, NULL));
    }
}

static void section_quality(void)
{
    const int B = 8, T = 64, L = quick ? 2 : 12, VB = 16;
    mt_data_config dc;
    mt_data_config_init(&dc);
    dc.path = data_path, dc.seq_len = T, dc.batch = B, dc.seed = 1;
    mt_data *d;
    TRY(NULL, "data", mt_data_open(&dc, &d));
    mt_context *ctx = context();
    mt_model *m = gpt(ctx, L, T);
    const size_t n = mt_model_num_params(m);
    mt_trainer_config tc;
    trainer_cfg(&tc, MT_PREC_FP32, NULL, B, T);
    tc.lr = 1e-3f;
    mt_trainer *t;
    const double t0 = now_s();
    TRY(ctx, "trainer", mt_trainer_create(m, &tc, &t));
    train(ctx, t, d, dense_steps);
    const double dense_at = val_loss(ctx, t, d, VB);
    printf("(c) GPT-2 124M shape (L %d, C 768, H 12, byte vocabulary), B %d x T %d, AdamW lr 1e-3: "
           "%d dense steps (%.0f s), validation loss %.4f\n", L, B, T, dense_steps, now_s() - t0,
           dense_at);
    float *w = malloc(n * sizeof *w);
    TRY(ctx, "get", mt_model_get_params(m, w, n));
    train(ctx, t, d, sparse_steps);
    mt_memory_stats st;
    TRY(ctx, "stats", mt_context_memory_stats(ctx, &st));
    printf("%-10s pruned %s   after %d more steps %.4f   peak %.1f MiB\n", "dense", "  -   ",
           sparse_steps, val_loss(ctx, t, d, VB), (double)st.peak_live_bytes / 1048576.0);
    const uint64_t dense_peak = st.peak_live_bytes;
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    static const struct {
        const char *name;
        mt_prune_method method;
        int n, m;
    } meth[] = {{"magnitude", MT_PRUNE_MAGNITUDE, 0, 0}, {"wanda", MT_PRUNE_WANDA, 0, 0},
                {"2:4", MT_PRUNE_MAGNITUDE, 2, 4}};
    for (int k = 0; k < 3; k++) {
        ctx = context();
        m = gpt(ctx, L, T);
        TRY(ctx, "set", mt_model_set_params(m, w, n));
        /* the prune: a step of SGD at lr 0 (the weights as they are) */
        mt_trainer_config pc;
        mt_trainer_config_init(&pc);
        pc.max_batch = B, pc.max_seq = T, pc.optimizer = MT_OPT_SGD, pc.lr = 0.0f;
        pc.prune.method = meth[k].method, pc.prune.sparsity = 0.5;
        pc.prune.nm_n = meth[k].n, pc.prune.nm_m = meth[k].m, pc.prune.calib = 4;
        TRY(ctx, "pruner", mt_trainer_create(m, &pc, &t));
        for (int c = 0; c < 4 && meth[k].method == MT_PRUNE_WANDA; c++) {
            mt_batch b;
            TRY(ctx, "calib batch", mt_data_next(d, MT_DATA_TRAIN, &b));
            TRY(ctx, "calibrate", mt_trainer_calibrate(t, &b));
        }
        mt_batch b;
        TRY(ctx, "batch", mt_data_next(d, MT_DATA_TRAIN, &b));
        TRY(ctx, "prune step", mt_trainer_step(t, &b, NULL));
        const double pruned = val_loss(ctx, t, d, VB);
        mt_trainer_destroy(t);
        TRY(ctx, "trainer", mt_trainer_create(m, &tc, &t));
        train(ctx, t, d, sparse_steps);
        const double after = val_loss(ctx, t, d, VB);
        TRY(ctx, "stats", mt_context_memory_stats(ctx, &st));
        printf("%-10s pruned %.4f   after %d more steps %.4f   peak %.1f MiB (%.3fx dense)\n",
               meth[k].name, pruned, sparse_steps, after, (double)st.peak_live_bytes / 1048576.0,
               (double)st.peak_live_bytes / (double)dense_peak);
        fflush(stdout);
        mt_trainer_destroy(t);
        mt_model_destroy(m);
        mt_context_destroy(ctx);
    }
    free(w);
    mt_data_close(d);
}

/* (d) */

static void section_kernels(void)
{
    const int O = 3072, I = 768, reps = quick ? 3 : 7;
    const int Ns[] = {512, 4096, 512};
    const mti_dtype dts[] = {MTI_F32, MTI_F32, MTI_BF16};
    mt_context *ctx = context();
    const mti_kctx k = {ctx, ctx->dev};
    const mti_ops *op = mti_cpu_ops();
    const size_t nw = (size_t)O * I, nmax = 4096;
    float *x = malloc(nmax * I * 4), *dy = malloc(nmax * O * 4), *w = malloc(nw * 4);
    float *y = malloc(nmax * O * 4), *dx = malloc(nmax * I * 4), *dw = malloc(nw * 4);
    uint64_t seed = 11;
    for (size_t i = 0; i < nmax * I; i++) seed = seed * 6364136223846793005ull + 1, x[i] = (float)(seed >> 40) / 16777216.0f - 0.5f;
    for (size_t i = 0; i < nmax * O; i++) seed = seed * 6364136223846793005ull + 1, dy[i] = (float)(seed >> 40) / 16777216.0f - 0.5f;
    uint16_t *xb = malloc(nmax * I * 2), *dyb = malloc(nmax * O * 2);
    for (size_t i = 0; i < nmax * I; i++) xb[i] = mti_f32_to_bf16(x[i]);
    for (size_t i = 0; i < nmax * O; i++) dyb[i] = mti_f32_to_bf16(dy[i]);
    printf("(d) sparse GEMMs against the dense tile: W %d x %d, %d threads, median of %d "
           "(ms: forward, backward = dx + dW; sum; the library's choice)\n", O, I, ctx->threads, reps);
    static const struct {
        const char *name;
        double keep;
        int n, m;
    } cases[] = {{"50%", 0.5, 0, 0}, {"75%", 0.25, 0, 0}, {"80%", 0.2, 0, 0}, {"85%", 0.15, 0, 0},
                 {"90%", 0.1, 0, 0}, {"95%", 0.05, 0, 0}, {"98%", 0.02, 0, 0}, {"2:4", 0.5, 2, 4},
                 {"1:16", 1.0 / 16, 1, 16}};
    for (size_t ni = 0; ni < sizeof Ns / sizeof Ns[0]; ni++)
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            const int N = Ns[ni];
            const mti_dtype dt = dts[ni];
            const void *xi = dt == MTI_F32 ? (const void *)x : xb, *dyi = dt == MTI_F32 ? (const void *)dy : dyb;
            /* the mask and the pruned tensor */
            uint64_t *keep = calloc(mti_sp_words(nw) + 1, 8);
            float *score = malloc(nw * 4);
            for (size_t i = 0; i < nw; i++) seed = seed * 6364136223846793005ull + 1, score[i] = (float)(seed >> 40);
            if (cases[c].m) TRY(ctx, "nm", mti_sp_prune_nm(ctx, score, nw, cases[c].n, cases[c].m, keep));
            else {
                memset(keep, 0xff, mti_sp_words(nw) * 8);
                mti_sp_seg sg = {score, nw, keep};
                TRY(ctx, "mask", mti_sp_prune_smallest(ctx, &sg, 1, mti_sp_count(1.0 - cases[c].keep, nw)));
            }
            const size_t nnz = mti_sp_kept(keep, nw);
            mti_sp_layout L;
            TRY(ctx, "layout", mti_sp_layout_of(ctx, cases[c].m ? MTI_SP_NM : MTI_SP_BITMAP, nw, nnz,
                                                   cases[c].n, cases[c].m, &L));
            void *meta = malloc(L.bytes);
            TRY(ctx, "encode", mti_sp_encode(&L, keep, meta));
            float *vals = malloc(nnz * 4), *gv = malloc(nnz * 4);
            for (size_t i = 0; i < nnz; i++) vals[i] = 0.01f * (float)(i % 97) - 0.5f;
            if (dt == MTI_BF16) /* (the values as bf16, in place) */
                for (size_t i = 0; i < nnz; i++) ((uint16_t *)vals)[i] = mti_f32_to_bf16(vals[i]);
            double td[2][16], ts[2][16];
            for (int rep = 0; rep < reps; rep++) {
                /* dense: the tile, then the GEMMs, then dW's kept entries */
                double t0 = now_s();
                TRY(ctx, "expand", op->sparse_expand(&k, w, vals, meta, &L, 0, nw, dt));
                TRY(ctx, "fwd", op->matmul_fwd(&k, y, xi, w, NULL, N, I, O, dt));
                td[0][rep] = now_s() - t0;
                t0 = now_s();
                TRY(ctx, "expand", op->sparse_expand(&k, w, vals, meta, &L, 0, nw, dt));
                TRY(ctx, "bwd", op->matmul_bwd(&k, dx, dw, NULL, dyi, xi, w, N, I, O, dt, MTI_BWD_SET_DW));
                TRY(ctx, "compress", op->sparse_compress(&k, gv, dw, meta, &L, 0, nw, MTI_F32, 0));
                td[1][rep] = now_s() - t0;
                /* sparse: the op table's sparse GEMMs */
                t0 = now_s();
                TRY(ctx, "sfwd", op->sparse_matmul_fwd(&k, y, xi, vals, meta, &L, NULL, N, I, O, dt));
                ts[0][rep] = now_s() - t0;
                t0 = now_s();
                TRY(ctx, "sbwd", op->sparse_matmul_bwd(&k, dx, gv, NULL, dyi, xi, vals, meta, &L, N, I, O,
                                                       dt, MTI_BWD_SET_DW));
                ts[1][rep] = now_s() - t0;
            }
            double d[2], sp[2];
            for (int j = 0; j < 2; j++) d[j] = 1e3 * median(td[j], reps), sp[j] = 1e3 * median(ts[j], reps);
            const int pick = op->sparse_matmul_choice(&k, &L, N, I, O, dt);
            printf("%s N %4d %-4s dense tile %7.2f %7.2f = %7.2f   sparse %7.2f %7.2f = %7.2f   %.2fx  %s\n",
                   dt == MTI_F32 ? "fp32" : "bf16", N,
                   cases[c].name, d[0], d[1], d[0] + d[1], sp[0], sp[1], sp[0] + sp[1],
                   (sp[0] + sp[1]) / (d[0] + d[1]), pick == MTI_SPMM_FASTER ? "sparse" : "dense");
            free(keep), free(score), free(meta), free(vals), free(gv);
        }
    free(x), free(dy), free(w), free(y), free(dx), free(dw), free(xb), free(dyb);
    mt_context_destroy(ctx);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true, layers = 2;
        else if (!strcmp(argv[i], "--quality")) quality = true;
        else if (!strcmp(argv[i], "--kernels")) kernels_only = true;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--data") && i + 1 < argc) data_path = argv[++i];
        else if (!strcmp(argv[i], "--dense-steps") && i + 1 < argc) dense_steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--sparse-steps") && i + 1 < argc) sparse_steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_sparse [--quick] [--threads N] [--quality] [--data FILE] "
                            "[--dense-steps N] [--sparse-steps N] [--kernels]\n");
            return 2;
        }
    }
    if (quality) {
        section_quality();
        return 0;
    }
    if (!kernels_only) {
        section_bytes();
        section_time();
    }
    if (threads > 0) omp_set_num_threads(threads);
    section_kernels();
    return 0;
}
