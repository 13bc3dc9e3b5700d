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
 * Usage: bench_sparse [--quick] [--threads N] [--quality] [--data FILE]
 *                     [--dense-steps N] [--sparse-steps N]
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memtrain.h"
#include "common.h"

static int threads = 0, layers = 4, dense_steps = 300, sparse_steps = 200;
static bool quick, quality;
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

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true, layers = 2;
        else if (!strcmp(argv[i], "--quality")) quality = true;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--data") && i + 1 < argc) data_path = argv[++i];
        else if (!strcmp(argv[i], "--dense-steps") && i + 1 < argc) dense_steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--sparse-steps") && i + 1 < argc) sparse_steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_sparse [--quick] [--threads N] [--quality] [--data FILE] "
                            "[--dense-steps N] [--sparse-steps N]\n");
            return 2;
        }
    }
    if (quality) {
        section_quality();
        return 0;
    }
    section_bytes();
    section_time();
    return 0;
}
