/*
 * test_tp.c - tensor parallel (cfg.tensor_parallel) over the in-process
 * communicator (threads as ranks): each step's loss, the whole gradients
 * and (SGD) the weights after training against one process on the same rows,
 * for 2 and 3 ranks per group (6 heads), every precision, optimizers,
 * clipping and recompute; data-parallel groups of tensor groups; every
 * rank's per-class peaks against its estimate; the refusals; a dead rank.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "engine/engine.h"
#include "test_comm.h"

#define TP_MAXN 4
#define TP_STEPS 10
#define TP_T 8

typedef struct tp_case {
    const char *name;
    mt_optimizer_kind opt;
    mt_precision prec;
    float clip;
    mt_recompute_policy rec;
    double tol; /* relative, on the losses and gradients */
    int fused;  /* the fused step (not with sequence parallel) */
} tp_case;

static const tp_case tp_cases[] = {
    {"sgd fp32 clip", MT_OPT_SGD, MT_PREC_FP32, 0.5f, MT_RECOMPUTE_NONE, 1e-5, 0},
    {"adamw fp32 selective", MT_OPT_ADAMW, MT_PREC_FP32, 0.0f, MT_RECOMPUTE_SELECTIVE, 1e-5, 0},
    {"adamw fp32 every 2", MT_OPT_ADAMW, MT_PREC_FP32, 1.0f, MT_RECOMPUTE_EVERY_K, 1e-5, 0},
    {"adamw bf16", MT_OPT_ADAMW, MT_PREC_BF16, 1.0f, MT_RECOMPUTE_NONE, 3e-2, 0},
    {"adamw fp16", MT_OPT_ADAMW, MT_PREC_FP16, 0.0f, MT_RECOMPUTE_NONE, 1e-2, 0},
    {"adamw fp32 fused clip", MT_OPT_ADAMW, MT_PREC_FP32, 1.0f, MT_RECOMPUTE_NONE, 1e-5, 1},
    {"sgd bf16 fused", MT_OPT_SGD, MT_PREC_BF16, 0.0f, MT_RECOMPUTE_SELECTIVE, 3e-2, 1},
};

/* A run: n ranks in groups of tp (n / tp data-parallel groups of `rows`
 * rows each), or one process (n 1, tp 1) over all the rows. */
typedef struct tp_run {
    const tp_case *c;
    int n, tp, rows, steps;
    int sp;                    /* sequence parallel */
    int zero;                  /* the ZeRO stage */
    const char *offload_dir;   /* the state on disk there */
    int params;                /* ... and the weights (offload_params) */
    const char *load, *save;   /* a training-state file loaded before the steps, saved after */
    int estimate;              /* check each rank's peaks against its estimate */
    int deferred;              /* the model deferred (mt_gpt_spec.deferred) */
    uint64_t param_live[TP_MAXN], param_peak[TP_MAXN]; /* PARAM after the steps, and its peak */
    uint64_t act_peak[TP_MAXN];
    tcomm_world *world;
    float loss[TP_MAXN][TP_STEPS];
    float *g[TP_MAXN];         /* the whole gradients before the first step */
    float *w[TP_MAXN];         /* the weights after the trainer */
    size_t nw;
    mt_status st[TP_MAXN];
    char msg[TP_MAXN][512];
    float eloss[TP_MAXN], eacc[TP_MAXN]; /* mt_trainer_eval after the steps */
    float *lg[TP_MAXN];        /* mt_trainer_logits of the eval batch (rows x 50) */
} tp_run;

static void tp_rows(int step, int r0, int n, int32_t *tok, int32_t *tgt)
{
    for (int r = 0; r < n; r++)
        for (int j = 0; j < TP_T; j++) {
            const int row = r0 + r;
            tok[r * TP_T + j] = (row * 7 + j * 3 + step * 11) % 50;
            tgt[r * TP_T + j] = (row * 5 + j * 13 + step * 3 + 1) % 50;
        }
}

static mt_trainer_config tp_config(const tp_case *c, int tp, int rows)
{
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.optimizer = c->opt;
    tc.lr = c->opt == MT_OPT_SGD ? 0.1f : 1e-2f;
    tc.momentum = c->opt == MT_OPT_SGD ? 0.9f : 0.0f;
    tc.weight_decay = 0.01f;
    tc.precision = c->prec;
    tc.grad_clip = c->clip;
    tc.recompute = c->rec;
    tc.recompute_every = 2;
    tc.max_batch = rows;
    tc.tensor_parallel = tp;
    tc.fused_step = c->fused;
    tc.min_8bit_size = 256; /* (8-bit AdamW: the small tensors' state 8-bit too) */
    if (c->prec == MT_PREC_FP16) tc.loss_scale.init_scale = 1024.0f;
    return tc;
}

static mt_status tp_open(mt_comm *c, int deferred, mt_context **ctx, mt_model **m)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = TP_T, g.layers = 2, g.heads = 6;
    g.channels = 24, g.seed = 7, g.deferred = deferred;
    mt_status s = tcomm_context(c, ctx);
    return s ? s : mt_model_gpt_create(*ctx, &g, m);
}

static void tp_peaks(mt_context *ctx, mt_model *m, const mt_trainer_config *tc, tp_run *a, int rank)
{
    mt_memory_stats ms;
    mt_estimate_report e;
    mt_context_memory_stats(ctx, &ms);
    a->param_live[rank] = ms.per_class[MT_MEM_PARAM].live_bytes;
    a->param_peak[rank] = ms.per_class[MT_MEM_PARAM].peak_live_bytes;
    a->act_peak[rank] = ms.per_class[MT_MEM_ACT].peak_live_bytes;
    if (a->deferred) return; /* (estimated after the model is made: not deferred any more) */
    if (mt_estimate_model(m, tc, &e)) {
        snprintf(a->msg[rank], sizeof a->msg[rank], "estimate: %s", mt_last_error(ctx));
        a->st[rank] = MT_ERR_INTERNAL;
        return;
    }
    for (int k = 0; k < MT_MEM_COUNT; k++)
        if (e.class_peak[k] != ms.per_class[k].peak_live_bytes) {
            snprintf(a->msg[rank], sizeof a->msg[rank], "%s peak %llu, estimate %llu",
                     mt_mem_class_name((mt_mem_class)k),
                     (unsigned long long)ms.per_class[k].peak_live_bytes,
                     (unsigned long long)e.class_peak[k]);
            a->st[rank] = MT_ERR_INTERNAL;
            return;
        }
}

static void tp_rank(int rank, void *p)
{
    tp_run *a = p;
    const int tp = a->tp, rows = a->rows, group = rank / (tp ? tp : 1);
    mt_trainer_config tc = tp_config(a->c, tp, rows);
    tc.sequence_parallel = a->sp;
    tc.zero_stage = a->zero;
    if (a->offload_dir) tc.offload = MT_PLACE_DISK, tc.offload_dir = a->offload_dir;
    tc.offload_params = a->params;
    mt_comm *c = a->n > 1 ? tcomm_make(a->world, rank, a->n, 0) : NULL;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_status s = tp_open(c, a->deferred, &ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    if (!s && a->load) s = mt_trainer_load(t, a->load, NULL, 0, NULL);
    int32_t tok[32 * TP_T], tgt[32 * TP_T];
    const size_t nw = m ? mt_model_num_params(m) : 0;
    /* the whole gradients at the first weights (not at ZeRO-2 or with the
       fused step, where they would outgrow the steps' GRAD, the estimate's) */
    if (!s && a->zero < 2 && !a->c->fused) {
        a->g[rank] = malloc(nw * sizeof(float));
        tp_rows(0, group * rows, rows, tok, tgt);
        mt_batch b = {.n = rows, .tokens = tok, .targets = tgt, .seq_len = TP_T};
        s = mt_trainer_gradients(t, &b, NULL, a->g[rank], nw);
    }
    for (int k = 0; k < a->steps && !s; k++) {
        tp_rows((int)mt_trainer_steps(t), group * rows, rows, tok, tgt);
        mt_batch b = {.n = rows, .tokens = tok, .targets = tgt, .seq_len = TP_T};
        s = mt_trainer_step(t, &b, &a->loss[rank][k]);
    }
    if (!s && a->save) s = mt_trainer_save(t, a->save, NULL, 0);
    a->st[rank] = s;
    if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    if (!s || a->estimate) { /* (one process: its ACT peak, for comparison) */
        mt_memory_stats ms;
        mt_context_memory_stats(ctx, &ms);
        a->act_peak[rank] = ms.per_class[MT_MEM_ACT].peak_live_bytes;
    }
    if (!s && (a->estimate || a->deferred)) tp_peaks(ctx, m, &tc, a, rank);
    if (!s) { /* (a collective of the tensor group; after the steps' peaks) */
        tp_rows(TP_STEPS, group * rows, rows, tok, tgt);
        mt_batch b = {.n = rows, .tokens = tok, .targets = tgt, .seq_len = TP_T};
        s = mt_trainer_eval(t, &b, &a->eloss[rank], &a->eacc[rank]);
        a->lg[rank] = malloc((size_t)rows * 50 * sizeof(float));
        if (!s) s = mt_trainer_logits(t, &b, a->lg[rank], (size_t)rows * 50);
        if (s) {
            a->st[rank] = s;
            snprintf(a->msg[rank], sizeof a->msg[rank], "eval: %s", mt_last_error(ctx));
        }
    }
    mt_trainer_destroy(t); /* (the parts gathered back, on every rank) */
    if (m && !a->st[rank]) {
        a->nw = nw;
        a->w[rank] = malloc(nw * sizeof(float));
        if (mt_model_get_params(m, a->w[rank], nw)) {
            a->st[rank] = MT_ERR_INTERNAL;
            snprintf(a->msg[rank], sizeof a->msg[rank], "get_params: %s", mt_last_error(ctx));
        }
    }
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

static void tp_go(tp_run *a)
{
    a->world = a->n > 1 ? tcomm_world_new(a->n, 30.0) : NULL;
    tcomm_run(a->n, tp_rank, a);
    tcomm_world_free(a->world);
}

static void tp_free(tp_run *a)
{
    for (int r = 0; r < TP_MAXN; r++) free(a->g[r]), free(a->w[r]), free(a->lg[r]);
    memset(a->lg, 0, sizeof a->lg);
    memset(a->g, 0, sizeof a->g);
    memset(a->w, 0, sizeof a->w);
}

/* ||x - y|| / ||y|| over n values. */
static double norm_diff(const float *x, const float *y, size_t n)
{
    double d = 0.0, b = 0.0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        b += (double)y[i] * y[i];
    }
    return sqrt(d / (b > 0.0 ? b : 1.0));
}

/* Groups of 2 and 3 ranks (6 heads; with 3 the vocabulary's 64 rows split
 * 21, 21, 22): every step's loss, the whole gradients and the weights after
 * training equal one process's on the same rows, to the case's tolerance;
 * every rank of a group holds the same weights afterwards, bit for bit. */
TEST(tp_matches_one_process)
{
    for (size_t k = 0; k < sizeof tp_cases / sizeof tp_cases[0]; k++) {
        const tp_case *c = &tp_cases[k];
        tp_run one = {.c = c, .n = 1, .tp = 1, .rows = 3, .steps = TP_STEPS};
        tp_go(&one);
        CHECK_MSG(one.st[0] == MT_OK, "%s: one process: %s", c->name, one.msg[0]);
        for (int T = 2; T <= 3; T++)
        for (int sp = 0; sp <= 1; sp++) {
            tp_run a = {.c = c, .n = T, .tp = T, .rows = 3, .steps = TP_STEPS, .estimate = 1,
                        .sp = sp};
            tp_go(&a);
            for (int r = 0; r < T; r++) {
                CHECK_MSG(a.st[r] == MT_OK, "%s, tp %d, sp %d, rank %d: %s", c->name, T, sp, r,
                          a.msg[r]);
                /* a rank's activations: about 1/T of the blocks' inner ones, and with
                   sequence parallel of the residual stream's too */
                CHECK_MSG(a.act_peak[r] < one.act_peak[0] * (sp ? 0.6 : 0.8),
                          "%s, tp %d, sp %d: ACT peak %llu of one process's %llu", c->name, T,
                          sp, (unsigned long long)a.act_peak[r],
                          (unsigned long long)one.act_peak[0]);
                for (int s = 0; s < TP_STEPS; s++)
                    CHECK_MSG(fabs(a.loss[r][s] - one.loss[0][s]) <= c->tol * fabs(one.loss[0][s]),
                              "%s, tp %d, sp %d, rank %d, step %d: loss %.9g, one process %.9g",
                              c->name, T, sp, r, s, (double)a.loss[r][s], (double)one.loss[0][s]);
                /* fp32: element by element, relative to the largest; 16 bits: as a whole */
                double big = 0.0, gd = 0.0;
                for (size_t i = 0; one.g[0] && i < a.nw; i++) big = fmax(big, fabs(one.g[0][i]));
                CHECK_MSG(fabs(a.eloss[r] - one.eloss[0]) <= c->tol * fabs(one.eloss[0]) &&
                              (c->prec != MT_PREC_FP32 || a.eacc[r] == one.eacc[0]),
                          "%s, tp %d, sp %d, rank %d: eval %g, accuracy %g; one process %g, %g",
                          c->name, T, sp, r, (double)a.eloss[r], (double)a.eacc[r],
                          (double)one.eloss[0], (double)one.eacc[0]);
                /* the logits, gathered from the group's columns (fp32: 16-bit AdamW's
                   weights drift apart in 10 steps, as its loss does within its tolerance) */
                if (a.lg[r] && one.lg[0] && c->prec == MT_PREC_FP32) {
                    const double ld = norm_diff(a.lg[r], one.lg[0], (size_t)a.rows * 50);
                    CHECK_MSG(ld <= c->tol, "%s, tp %d, sp %d, rank %d: logits differ by %.3g",
                              c->name, T, sp, r, ld);
                }
                if (a.g[r] && one.g[0]) /* (not with the fused step) */
                    gd = c->prec == MT_PREC_FP32 ? check_rel_diff(a.g[r], one.g[0], a.nw, big)
                                                 : norm_diff(a.g[r], one.g[0], a.nw);
                CHECK_MSG(gd <= c->tol, "%s, tp %d, sp %d, rank %d: gradients differ by %.3g",
                          c->name, T, sp, r, gd);
                CHECK(memcmp(a.w[r], a.w[0], a.nw * sizeof(float)) == 0);
            }
            /* (Adam's update of a gradient near zero is its sign: no bound) */
            const double wd = check_rel_diff(a.w[0], one.w[0], a.nw, 1e-2);
            CHECK_MSG(c->opt != MT_OPT_SGD || wd <= c->tol * 100,
                      "%s, tp %d, sp %d: weights differ by %.3g", c->name, T, sp, wd);
            tp_free(&a);
        }
        tp_free(&one);
    }
}

/* 4 ranks as 2 data-parallel groups of tensor groups of 2, at ZeRO stages
 * 0 to 3 in the data-parallel groups, each with and without sequence
 * parallel: one process over both groups' rows (fp32, 1e-5), every rank's
 * peaks its estimate's. */
TEST(tp_with_data_parallel)
{
    const tp_case *c = &tp_cases[0];
    tp_run one = {.c = c, .n = 1, .tp = 1, .rows = 6, .steps = TP_STEPS};
    tp_go(&one);
    CHECK_MSG(one.st[0] == MT_OK, "one process: %s", one.msg[0]);
    for (int k = 0; k < 8; k++) {
    const int sp = k & 1, zero = k >> 1;
    tp_run a = {.c = c, .n = 4, .tp = 2, .rows = 3, .steps = TP_STEPS, .estimate = 1, .sp = sp,
                .zero = zero};
    tp_go(&a);
    for (int r = 0; r < 4; r++) {
        CHECK_MSG(a.st[r] == MT_OK, "rank %d: %s", r, a.msg[r]);
        for (int s = 0; s < TP_STEPS; s++)
            CHECK_MSG(fabs(a.loss[r][s] - one.loss[0][s]) <= 1e-5 * fabs(one.loss[0][s]),
                      "rank %d, step %d: loss %.9g, one process %.9g", r, s,
                      (double)a.loss[r][s], (double)one.loss[0][s]);
        CHECK(memcmp(a.w[r], a.w[0], a.nw * sizeof(float)) == 0);
    }
    const double wd = check_rel_diff(a.w[0], one.w[0], a.nw, 1e-2);
    CHECK_MSG(wd <= 1e-3, "sp %d, zero %d: weights differ by %.3g", sp, zero, wd);
    tp_free(&a);
    }
    tp_free(&one);
}

/* A deferred model: each rank makes only its parts, straight from the
 * source: the bits of the model made whole and then split, and PARAM's
 * peak is a rank's share (about half at 2 ranks), not the whole model. */
TEST(tp_deferred_model)
{
    const tp_case *c = &tp_cases[0];
    tp_run whole = {.c = c, .n = 2, .tp = 2, .rows = 3, .steps = 3, .estimate = 1};
    tp_go(&whole);
    tp_run def = {.c = c, .n = 2, .tp = 2, .rows = 3, .steps = 3, .deferred = 1};
    tp_go(&def);
    for (int r = 0; r < 2; r++) {
        CHECK_MSG(whole.st[r] == MT_OK && def.st[r] == MT_OK, "rank %d: %s / %s", r,
                  whole.msg[r], def.msg[r]);
        CHECK(memcmp(whole.loss[r], def.loss[r], 3 * sizeof(float)) == 0);
        CHECK(memcmp(whole.w[r], def.w[r], whole.nw * sizeof(float)) == 0);
        CHECK(def.param_live[r] == whole.param_live[r]);
        /* the whole model is 4 nw bytes: a rank holds its parts and the
           replicated tensors */
        CHECK_MSG(def.param_peak[r] < whole.nw * 4 * 3 / 4 && whole.param_peak[r] > whole.nw * 4,
                  "rank %d: PARAM peak %llu deferred, %llu whole (the model is %zu bytes)", r,
                  (unsigned long long)def.param_peak[r], (unsigned long long)whole.param_peak[r],
                  whole.nw * 4);
    }
    tp_free(&whole);
    tp_free(&def);
}

/* What is refused, before anything runs, on every rank alike. */
typedef struct tp_bad {
    tcomm_world *world;
    int n;
    mt_trainer_config tc;
    int lora;
    mt_status st[TP_MAXN];
    char msg[TP_MAXN][512];
} tp_bad;

static void tp_bad_rank(int rank, void *p)
{
    tp_bad *a = p;
    mt_comm *c = a->n > 1 ? tcomm_make(a->world, rank, a->n, 0) : NULL;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_trainer_config tc = a->tc;
    mt_status s = tp_open(c, 0, &ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(tp_refusals)
{
    struct {
        int n, tp;
        unsigned what;
        mt_status want;
        const char *says;
    } cases[] = {
        {3, 2, 0, MT_ERR_INVALID_ARG, "does not divide the world of 3"},
        {4, 4, 0, MT_ERR_INVALID_ARG, "does not divide the model's 6 heads"},
        {2, 2, 1, MT_ERR_UNSUPPORTED, "LoRA"},
        {2, 2, 8, MT_ERR_UNSUPPORTED, "offload"},
        {2, -1, 0, MT_ERR_INVALID_ARG, "out of range"},
        {2, 1, 16, MT_ERR_INVALID_ARG, "sequence_parallel needs cfg->tensor_parallel > 1"},
        {2, 2, 32, MT_ERR_UNSUPPORTED, "Adafactor"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        tp_bad a = {.n = cases[k].n, .tc = tp_config(&tp_cases[0], cases[k].tp, 2)};
        if (cases[k].what & 1) a.tc.lora.rank = 2;
        if (cases[k].what & 8) a.tc.offload = MT_PLACE_HOST;
        if (cases[k].what & 16) a.tc.sequence_parallel = 1;
        if (cases[k].what & 32) a.tc.optimizer = MT_OPT_ADAFACTOR;
        a.world = tcomm_world_new(a.n, 30.0);
        tcomm_run(a.n, tp_bad_rank, &a);
        tcomm_world_free(a.world);
        for (int r = 0; r < a.n; r++) {
            CHECK_MSG(a.st[r] == cases[k].want, "case %zu rank %d: %s: %s", k, r,
                      mt_status_string(a.st[r]), a.msg[r]);
            CHECK_MSG(strstr(a.msg[r], cases[k].says) != NULL, "case %zu: %s", k, a.msg[r]);
        }
    }
}

/* A rank of a tensor group that stalls before a step: the others stop
 * with MT_ERR_COMM within the timeout, naming the sum they waited in, and
 * every rank's trainer still goes (its weights zeros, said in the log). */
typedef struct tp_death {
    tcomm_world *world;
    mt_status st[2];
    char msg[2][512];
    double seconds[2];
} tp_death;

static void tp_death_rank(int rank, void *p)
{
    tp_death *a = p;
    mt_comm *c = tcomm_make(a->world, rank, 2, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_trainer_config tc = tp_config(&tp_cases[0], 2, 2);
    mt_status s = tp_open(c, 0, &ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[2 * TP_T], tgt[2 * TP_T];
    tp_rows(0, 0, 2, tok, tgt);
    mt_batch b = {.n = 2, .tokens = tok, .targets = tgt, .seq_len = TP_T};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!s && rank == 0) s = mt_trainer_step(t, &b, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    a->seconds[rank] = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    if (rank == 1) { /* stalls: never joins the step, and cleans up once the world is dead */
        struct timespec nap = {1, 500000000};
        nanosleep(&nap, NULL);
    }
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(tp_dead_rank)
{
    tp_death a = {.world = tcomm_world_new(2, 1.0)};
    tcomm_run(2, tp_death_rank, &a);
    tcomm_world_free(a.world);
    CHECK_MSG(a.st[0] == MT_ERR_COMM, "rank 0: %s: %s", mt_status_string(a.st[0]), a.msg[0]);
    CHECK_MSG(strstr(a.msg[0], "tensor parallel") != NULL, "%s", a.msg[0]);
    CHECK_MSG(a.seconds[0] < 1.0 + 3.0, "rank 0 failed after %.2f s", a.seconds[0]);
}

/* On CUDA contexts (the stand-in driver and cuBLASLt) over the stand-in
 * NCCL, 2 and 3 ranks, fp32 and bf16, deferred or not: the steps run on
 * the device (the sums through NCCL on the device's stream), each rank's
 * per-class peaks equal its estimate, and the weights gathered back after
 * the trainer are the model's bit for bit (the stand-in's kernels compute
 * nothing: the update leaves the parts as they were). With a host
 * communicator the sums are staged through host memory, the same way.
 * Sequence parallel too (bf16 over NCCL, fp32 over the host communicator). */
typedef struct tpc_run {
    tcomm_world *w;
    int n, nccl, deferred, sp;
    mt_precision prec;
    mt_status st[TP_MAXN];
    char msg[TP_MAXN][400];
} tpc_run;

static void tpc_rank(int rank, void *arg)
{
    tpc_run *a = arg;
    char *msg = a->msg[rank];
    const size_t cap = sizeof a->msg[rank];
    mt_comm *c = a->nccl ? tcomm_nccl(a->w, rank, a->n) : tcomm_make(a->w, rank, a->n, 0);
    mt_context *ctx = c ? tcomm_cuda_context(c) : NULL;
    mt_model *m = NULL, *w0m = NULL;
    mt_trainer *t = NULL;
    mt_status s = ctx ? MT_OK : MT_ERR_NO_DEVICE;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = TP_T, g.layers = 2, g.heads = 6;
    g.channels = 24, g.seed = 7, g.deferred = a->deferred;
    if (!s) s = mt_model_gpt_create(ctx, &g, &m);
    mt_gpt_spec g0 = g; /* the same weights, made whole, to compare with */
    g0.deferred = 0;
    if (!s) s = mt_model_gpt_create(ctx, &g0, &w0m);
    mt_trainer_config tc = tp_config(&tp_cases[1], a->n, 2);
    tc.precision = a->prec;
    tc.sequence_parallel = a->sp;
    mt_estimate_report pre;
    if (!s && a->deferred) s = mt_estimate_model(m, &tc, &pre);
    const size_t P = m ? mt_model_num_params(m) : 0;
    float *w0 = malloc(P * sizeof *w0 + 1), *w1 = malloc(P * sizeof *w1 + 1);
    if (!s) s = mt_model_get_params(w0m, w0, P);
    mt_model_destroy(w0m);
    mt_context_reset_peaks(ctx);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[2 * TP_T], tgt[2 * TP_T];
    for (int k = 0; k < 2 && !s; k++) {
        tp_rows(k, 0, 2, tok, tgt);
        mt_batch b = {.n = 2, .tokens = tok, .targets = tgt, .seq_len = TP_T};
        s = mt_trainer_step(t, &b, NULL);
    }
    if (!s) {
        mt_estimate_report e;
        mt_memory_stats ms;
        if (a->deferred) e = pre;
        else s = mt_estimate_model(m, &tc, &e);
        mt_context_memory_stats(ctx, &ms);
        for (int k = 0; !s && k < MT_MEM_COUNT && !*msg; k++)
            if (ms.per_class[k].peak_live_bytes != e.class_peak[k])
                snprintf(msg, cap, "%s peak %llu, estimate %llu", mt_mem_class_name(k),
                         (unsigned long long)ms.per_class[k].peak_live_bytes,
                         (unsigned long long)e.class_peak[k]);
    }
    if (s && !*msg) snprintf(msg, cap, "%s", ctx ? mt_last_error(ctx) : "no context");
    mt_trainer_destroy(t); /* (the parts gathered back, on every rank) */
    if (!s && !*msg && mt_model_get_params(m, w1, P)) snprintf(msg, cap, "no weights put back");
    if (!s && !*msg && a->prec == MT_PREC_FP32 && memcmp(w0, w1, P * sizeof *w0))
        snprintf(msg, cap, "the weights gathered back differ from the model's");
    a->st[rank] = s;
    free(w0), free(w1);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(tp_cuda_stand_in)
{
    if (!check_fake_cuda() || !getenv("MT_FAKE_CUBLASLT") || !getenv("MT_FAKE_NCCL")) {
        fprintf(stderr, "    (skipped: MT_FAKE_CUDA, MT_FAKE_CUBLASLT or MT_FAKE_NCCL is not set)\n");
        return;
    }
    mti_engine_grad_fill = tcomm_fill_grads;
    const mt_precision precs[2] = {MT_PREC_FP32, MT_PREC_BF16};
    for (int n = 2; n <= 3; n++)
        for (int k = 0; k < (n == 2 ? 6 : 4); k++) { /* (sequence parallel: 16 rows over 2) */
            tpc_run a = {.n = n, .nccl = k != 3 && k != 5, .deferred = k == 2,
                         .prec = precs[k == 1 || k == 4], .sp = k >= 4};
            a.w = tcomm_world_new(n, 30.0);
            tcomm_run(n, tpc_rank, &a);
            tcomm_world_free(a.w);
            for (int r = 0; r < n; r++)
                CHECK_MSG(a.st[r] == MT_OK && !a.msg[r][0], "%d ranks, case %d, rank %d: %s", n,
                          k, r, a.msg[r]);
        }
    mti_engine_grad_fill = NULL;
}

/* Sequence parallel with a micro-batch whose rows do not split evenly over
 * the group: the step is refused on every rank alike (weights unchanged),
 * and the next, even one runs. */
static void tp_uneven_rank(int rank, void *p)
{
    tp_bad *a = p;
    mt_comm *c = tcomm_make(a->world, rank, 3, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_trainer_config tc = a->tc;
    mt_status s = tp_open(c, 0, &ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[3 * TP_T], tgt[3 * TP_T];
    tp_rows(0, 0, 3, tok, tgt);
    mt_batch b = {.n = 1, .tokens = tok, .targets = tgt, .seq_len = TP_T}; /* 8 rows of 3 */
    if (!s) s = mt_trainer_step(t, &b, NULL);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    b.n = 3; /* 24 rows */
    if (s == MT_ERR_INVALID_ARG && mt_trainer_step(t, &b, NULL)) a->st[rank] = MT_ERR_INTERNAL;
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(tp_sequence_parallel_uneven_rows)
{
    tp_bad a = {.n = 3, .tc = tp_config(&tp_cases[0], 3, 3)};
    a.tc.sequence_parallel = 1;
    a.world = tcomm_world_new(3, 30.0);
    tcomm_run(3, tp_uneven_rank, &a);
    tcomm_world_free(a.world);
    for (int r = 0; r < 3; r++) {
        CHECK_MSG(a.st[r] == MT_ERR_INVALID_ARG, "rank %d: %s: %s", r, mt_status_string(a.st[r]),
                  a.msg[r]);
        CHECK_MSG(strstr(a.msg[r], "not a multiple of the tensor group's 3 ranks"), "%s", a.msg[r]);
    }
}

/* A creation that fails on one rank (its optimizer state over an allocator
 * limit) fails on every rank and gives each rank's model back untouched,
 * made at once or deferred (the parts made from the source go back to it):
 * every weight reads back as the model's. */
typedef struct tp_failed {
    tcomm_world *world;
    int deferred;
    mt_status create[2], after[2];
    int same[2];
    char msg[2][512];
} tp_failed;

static void tp_failed_rank(int rank, void *p)
{
    tp_failed *a = p;
    mt_comm *c = tcomm_make(a->world, rank, 2, 0);
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.comm = c;
    if (rank == 1) cc.allocators[MT_MEM_OPTIM].limit_bytes = 4096;
    mt_context *ctx = NULL;
    mt_model *m = NULL, *w0m = NULL;
    mt_trainer *t = NULL;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = TP_T, g.layers = 2, g.heads = 6;
    g.channels = 24, g.seed = 7, g.deferred = a->deferred;
    mt_status s = mt_context_create(&cc, &ctx);
    if (!s) s = mt_model_gpt_create(ctx, &g, &m);
    mt_gpt_spec g0 = g;
    g0.deferred = 0;
    if (!s) s = mt_model_gpt_create(ctx, &g0, &w0m);
    mt_trainer_config tc = tp_config(&tp_cases[1], 2, 3);
    a->create[rank] = s ? s : mt_trainer_create(m, &tc, &t);
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    const size_t nw = m ? mt_model_num_params(m) : 0;
    float *w = malloc(nw * sizeof *w + 1), *w0 = malloc(nw * sizeof *w0 + 1);
    a->after[rank] = m ? mt_model_get_params(m, w, nw) : MT_ERR_INTERNAL;
    if (!a->after[rank] && !mt_model_get_params(w0m, w0, nw))
        a->same[rank] = !memcmp(w, w0, nw * sizeof *w);
    free(w), free(w0);
    mt_trainer_destroy(t);
    mt_model_destroy(w0m);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(tp_failed_creation_gives_the_model_back)
{
    for (int d = 0; d <= 1; d++) {
        tp_failed a = {.deferred = d, .world = tcomm_world_new(2, 30.0)};
        tcomm_run(2, tp_failed_rank, &a);
        tcomm_world_free(a.world);
        for (int r = 0; r < 2; r++) {
            CHECK_MSG(a.create[r] == (r ? MT_ERR_OOM : MT_ERR_COMM), "deferred %d, rank %d: %s: %s",
                      d, r, mt_status_string(a.create[r]), a.msg[r]);
            CHECK_MSG(a.after[r] == MT_OK && a.same[r], "deferred %d, rank %d: the weights after: %s",
                      d, r, mt_status_string(a.after[r]));
        }
    }
}

/* mt_trainer_destroy_with_model gathers nothing, frozen parts included:
 * one rank's returns at once while the other has not destroyed its trainer. */
typedef struct tp_dwm {
    tcomm_world *world;
    double seconds;
    mt_status st[2];
    mt_context *ctx[2];
    mt_model *m[2];
    mt_trainer *t[2];
} tp_dwm;

static void tp_dwm_rank(int rank, void *p)
{
    tp_dwm *a = p;
    mt_comm *c = tcomm_make(a->world, rank, 2, 0);
    mt_trainer_config tc = tp_config(&tp_cases[0], 2, 3);
    const char *frozen[] = {"h.0.*"};
    tc.freeze = frozen, tc.n_freeze = 1;
    mt_status s = tp_open(c, 0, &a->ctx[rank], &a->m[rank]);
    if (!s) s = mt_trainer_create(a->m[rank], &tc, &a->t[rank]);
    a->st[rank] = s;
    if (rank == 0) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        mt_trainer_destroy_with_model(a->t[0]);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        a->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        mt_context_destroy(a->ctx[0]);
        mt_comm_destroy(c);
    } else {
        a->m[1] = (mt_model *)c; /* (its communicator, for the test to destroy after) */
    }
}

TEST(tp_destroy_with_model_gathers_nothing)
{
    tp_dwm a = {.world = tcomm_world_new(2, 3.0)};
    tcomm_run(2, tp_dwm_rank, &a);
    mt_trainer_destroy_with_model(a.t[1]); /* (rank 1's, alone, after) */
    mt_context_destroy(a.ctx[1]);
    mt_comm_destroy((mt_comm *)a.m[1]);
    tcomm_world_free(a.world);
    CHECK(a.st[0] == MT_OK && a.st[1] == MT_OK);
    CHECK_MSG(a.seconds < 1.0, "rank 0's destroy_with_model took %.2f s", a.seconds);
}

/* Whether two files hold the same bytes. */
static bool same_file(const char *x, const char *y)
{
    FILE *a = fopen(x, "rb"), *b = fopen(y, "rb");
    bool same = a && b;
    for (int p = 0, q = 0; same && (p = fgetc(a)) != EOF;) same = (q = fgetc(b)) == p;
    if (same) same = fgetc(b) == EOF;
    if (a) fclose(a);
    if (b) fclose(b);
    return same;
}

/* Training-state files move between layouts: saved by a tensor group of 2
 * after 2 steps, loaded by groups of 3 (with sequence parallel) and by one
 * process, the next 2 steps give the unbroken one process's losses (fp32,
 * 1e-5); loaded by one process and saved at once, the file is the same
 * bytes, and so is one process's file loaded by a group of 2 and saved
 * again. SGD with momentum and AdamW (the state element by element);
 * 8-bit state in blocks of a part is refused by name. */
TEST(tp_checkpoints_across_layouts)
{
    char f2[128], f1[128], g2[128];
    snprintf(f2, sizeof f2, "/tmp/mt_test_%ld_tp2.ckpt", (long)getpid());
    snprintf(f1, sizeof f1, "/tmp/mt_test_%ld_tp1.ckpt", (long)getpid());
    snprintf(g2, sizeof g2, "/tmp/mt_test_%ld_tpg.ckpt", (long)getpid());
    for (int k = 0; k < 2; k++) {
        const tp_case *c = &tp_cases[k]; /* sgd fp32 clip, adamw fp32 selective */
        tp_run one = {.c = c, .n = 1, .tp = 1, .rows = 3, .steps = 4};
        tp_go(&one);
        CHECK_MSG(one.st[0] == MT_OK, "%s: one process: %s", c->name, one.msg[0]);
        tp_run save = {.c = c, .n = 2, .tp = 2, .rows = 3, .steps = 2, .save = f2};
        tp_go(&save);
        CHECK_MSG(save.st[0] == MT_OK && save.st[1] == MT_OK, "%s: save: %s / %s", c->name,
                  save.msg[0], save.msg[1]);
        const int layouts[2][3] = {{3, 3, 1}, {1, 1, 0}}; /* n, tp, sp */
        for (int l = 0; l < 2; l++) {
            const int n = layouts[l][0];
            tp_run re = {.c = c, .n = n, .tp = layouts[l][1], .sp = layouts[l][2], .rows = 3,
                         .steps = 2, .load = f2};
            tp_go(&re);
            for (int r = 0; r < n; r++) {
                CHECK_MSG(re.st[r] == MT_OK, "%s: resumed on %d: rank %d: %s", c->name, n, r,
                          re.msg[r]);
                for (int j = 0; j < 2; j++)
                    CHECK_MSG(fabs(re.loss[r][j] - one.loss[0][2 + j]) <= 1e-5 * fabs(one.loss[0][2 + j]),
                              "%s: resumed on %d, step %d: %.9g, unbroken %.9g", c->name, n, 3 + j,
                              (double)re.loss[r][j], (double)one.loss[0][2 + j]);
            }
            tp_free(&re);
        }
        tp_run again = {.c = c, .n = 1, .tp = 1, .rows = 3, .steps = 0, .load = f2, .save = f1};
        tp_go(&again);
        CHECK_MSG(again.st[0] == MT_OK && same_file(f1, f2),
                  "%s: loaded by one process and saved again: %s", c->name, again.msg[0]);
        tp_run back = {.c = c, .n = 2, .tp = 2, .rows = 3, .steps = 0, .load = f1, .save = g2};
        tp_go(&back);
        CHECK_MSG(back.st[0] == MT_OK && same_file(g2, f1),
                  "%s: one process's file loaded by a group of 2 and saved again: %s", c->name,
                  back.msg[0]);
        tp_free(&one), tp_free(&save), tp_free(&again), tp_free(&back);
    }
    static const tp_case q8 = {"adamw8 fp32", MT_OPT_ADAMW8, MT_PREC_FP32, 0.0f,
                               MT_RECOMPUTE_NONE, 1e-5, 0};
    tp_run blocks = {.c = &q8, .n = 2, .tp = 2, .rows = 3, .steps = 1, .save = f2};
    tp_go(&blocks);
    for (int r = 0; r < 2; r++)
        CHECK_MSG(blocks.st[r] == MT_ERR_UNSUPPORTED && strstr(blocks.msg[r], "in blocks of"),
                  "8-bit state: rank %d: %s: %s", r, mt_status_string(blocks.st[r]), blocks.msg[r]);
    tp_free(&blocks);
    remove(f2), remove(f1), remove(g2);
}

/* Training-state files, what every rank of a group must agree on: 8-bit
 * AdamW whose threshold falls between the vocabulary's uneven shares (504,
 * 504 and 528 elements of wte at 3 ranks) chooses from the whole tensor's
 * size, so every rank refuses the file alike and at once; ranks of a group
 * that load different files all fail, their weights unchanged. */
typedef struct tp_agree_run {
    tcomm_world *world;
    int n, mode; /* 0: save with 8-bit state; 1: rank r loads f[r] */
    const char *f[3];
    mt_status st[3];
    char msg[3][512];
    double seconds[3];
} tp_agree_run;

static void tp_agree_rank(int rank, void *p)
{
    tp_agree_run *a = p;
    mt_comm *c = tcomm_make(a->world, rank, a->n, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_trainer_config tc = tp_config(&tp_cases[0], a->n, 3);
    mt_param_override ov = {.pattern = "h.*", .state_bits = 32};
    if (a->mode == 0) {
        tc.optimizer = MT_OPT_ADAMW8;
        tc.min_8bit_size = 520;
        tc.overrides = &ov;
        tc.n_overrides = 1;
    }
    mt_status s = tp_open(c, 0, &ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!s && a->mode == 0) s = mt_trainer_save(t, a->f[0], NULL, 0);
    if (!s && a->mode == 1) s = mt_trainer_load(t, a->f[rank], NULL, 0, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    a->seconds[rank] = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(tp_checkpoints_agreed_by_the_group)
{
    char f[128], g[128];
    snprintf(f, sizeof f, "/tmp/mt_test_%ld_tpa.ckpt", (long)getpid());
    snprintf(g, sizeof g, "/tmp/mt_test_%ld_tpb.ckpt", (long)getpid());
    tp_agree_run a = {.n = 3, .mode = 0, .f = {f}, .world = tcomm_world_new(3, 3.0)};
    tcomm_run(3, tp_agree_rank, &a);
    tcomm_world_free(a.world);
    for (int r = 0; r < 3; r++)
        CHECK_MSG(a.st[r] == MT_ERR_UNSUPPORTED && a.seconds[r] < 1.0, "8-bit: rank %d: %s after %.2f s: %s",
                  r, mt_status_string(a.st[r]), a.seconds[r], a.msg[r]);
    tp_run s2 = {.c = &tp_cases[0], .n = 1, .tp = 1, .rows = 3, .steps = 2, .save = f};
    tp_go(&s2);
    tp_run s3 = {.c = &tp_cases[0], .n = 1, .tp = 1, .rows = 3, .steps = 3, .save = g};
    tp_go(&s3);
    CHECK(s2.st[0] == MT_OK && s3.st[0] == MT_OK);
    tp_agree_run b = {.n = 2, .mode = 1, .f = {f, g}, .world = tcomm_world_new(2, 3.0)};
    tcomm_run(2, tp_agree_rank, &b);
    tcomm_world_free(b.world);
    for (int r = 0; r < 2; r++)
        CHECK_MSG(b.st[r] == MT_ERR_COMM && strstr(b.msg[r], "different training-state files"),
                  "different files: rank %d: %s: %s", r, mt_status_string(b.st[r]), b.msg[r]);
    tp_free(&s2), tp_free(&s3);
    remove(f), remove(g);
}

/* The optimizer state and masters on disk (each rank its parts'), and the
 * weights too: the resident run's losses and weights bit for bit, with and
 * without sequence parallel, bf16 with masters; every rank's peaks its
 * estimate's. */
TEST(tp_state_on_disk)
{
    for (int k = 0; k < 3; k++) {
        const tp_case *c = &tp_cases[k == 1 ? 3 : 1];
        tp_run res = {.c = c, .n = 2, .tp = 2, .rows = 3, .steps = 4, .sp = k & 1};
        tp_go(&res);
        tp_run disk = {.c = c, .n = 2, .tp = 2, .rows = 3, .steps = 4, .sp = k & 1, .estimate = 1,
                       .offload_dir = "/tmp", .params = k == 2};
        tp_go(&disk);
        for (int r = 0; r < 2; r++) {
            CHECK_MSG(res.st[r] == MT_OK && disk.st[r] == MT_OK, "%s: rank %d: %s / %s", c->name,
                      r, res.msg[r], disk.msg[r]);
            CHECK(memcmp(res.loss[r], disk.loss[r], 4 * sizeof(float)) == 0);
            CHECK(memcmp(res.w[r], disk.w[r], res.nw * sizeof(float)) == 0);
        }
        tp_free(&res), tp_free(&disk);
    }
}
