/*
 * test_pp.c - pipeline parallel (cfg.pipeline_parallel) over the
 * in-process communicator (threads as ranks): each step's loss and the
 * weights after training against one process accumulating the same
 * micro-batches (an MLP, untied: bit for bit; a GPT, whose tied table's
 * two halves are summed in another order: to 1e-5 in fp32), for 2 and 3
 * stages; grids with tensor and data parallel and ZeRO-1; each rank's
 * per-class peaks against its estimate; stage 0's activations bounded by
 * the stages, not the micro-batches; the refusals; a dead rank.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "engine/engine.h"
#include "model/model.h"
#include "test_comm.h"

#define PP_MAXN 8
#define PP_STEPS 6
#define PP_T 8

typedef struct pp_run {
    int n, tp, pp, sp, zero;
    int mlp;                   /* an MLP (else a GPT of 4 blocks) */
    int rows, micro, steps;    /* rows per data-parallel group, per micro-batch */
    mt_optimizer_kind opt;
    mt_precision prec;
    float clip;
    mt_recompute_policy rec;
    int deferred, estimate;
    int threads;               /* the communicator takes calls from any thread (a comm thread) */
    const char *load, *save;   /* a training-state file loaded before the steps, saved after */
    tcomm_world *world;
    float loss[PP_MAXN][PP_STEPS];
    float eloss[PP_MAXN], eacc[PP_MAXN];
    float *w[PP_MAXN];
    size_t nw;
    uint64_t act_peak[PP_MAXN];
    mt_status st[PP_MAXN];
    char msg[PP_MAXN][512];
} pp_run;

/* Row `row` of step `step`: tokens and targets (GPT), or features and a
 * class (MLP). */
static void pp_rows(const pp_run *a, int step, int r0, int n, int32_t *tok, int32_t *tgt,
                    float *x)
{
    for (int r = 0; r < n; r++) {
        const int row = r0 + r;
        if (a->mlp) {
            for (int j = 0; j < 6; j++) x[r * 6 + j] = (float)((row * 7 + j * 3 + step * 5) % 11) / 7.0f - 0.7f;
            tgt[r] = (row * 3 + step) % 5;
            continue;
        }
        for (int j = 0; j < PP_T; j++) {
            tok[r * PP_T + j] = (row * 7 + j * 3 + step * 11) % 50;
            tgt[r * PP_T + j] = (row * 5 + j * 13 + step * 3 + 1) % 50;
        }
    }
}

static mt_trainer_config pp_config(const pp_run *a)
{
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.optimizer = a->opt;
    tc.lr = a->opt == MT_OPT_SGD ? 0.1f : 1e-2f;
    tc.momentum = a->opt == MT_OPT_SGD ? 0.9f : 0.0f;
    tc.weight_decay = 0.01f;
    tc.precision = a->prec;
    tc.grad_clip = a->clip;
    tc.recompute = a->rec;
    tc.recompute_every = 2;
    tc.max_batch = a->rows;
    tc.micro_batch = a->micro;
    tc.tensor_parallel = a->tp;
    tc.sequence_parallel = a->sp;
    tc.pipeline_parallel = a->pp;
    tc.zero_stage = a->zero;
    if (a->prec == MT_PREC_FP16) tc.loss_scale.init_scale = 1024.0f;
    return tc;
}

static mt_status pp_model(const pp_run *a, mt_context *ctx, mt_model **m)
{
    if (a->mlp) {
        mt_mlp_spec s;
        mt_mlp_spec_init(&s);
        s.n_layers = 4;
        s.dims[0] = 6, s.dims[1] = 16, s.dims[2] = 12, s.dims[3] = 16, s.dims[4] = 5;
        s.seed = 3, s.deferred = a->deferred;
        return mt_model_mlp_create(ctx, &s, m);
    }
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = PP_T, g.layers = 4, g.heads = 6;
    g.channels = 24, g.seed = 7, g.deferred = a->deferred;
    return mt_model_gpt_create(ctx, &g, m);
}

/* A rank's trainer, model, context and communicator, each if made, gone. */
static void pp_close(mt_trainer *t, mt_model *m, mt_context *ctx, mt_comm *c)
{
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

/* fn(rank, arg) on n threads, the ranks of a world of their own (*w
 * while they run: a collective waits timeout seconds at most). */
static void pp_each_rank(int n, double timeout, void (*fn)(int rank, void *arg), void *arg,
                         tcomm_world **w)
{
    *w = tcomm_world_new(n, timeout);
    tcomm_run(n, fn, arg);
    tcomm_world_free(*w);
}

/* Seconds since t0 (CLOCK_MONOTONIC). */
static double pp_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0->tv_nsec);
}

static void pp_check_estimate(pp_run *a, int rank, mt_context *ctx, mt_model *m,
                              const mt_trainer_config *tc)
{
    mt_memory_stats ms;
    mt_estimate_report e;
    mt_context_memory_stats(ctx, &ms);
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

static void pp_rank(int rank, void *p)
{
    pp_run *a = p;
    const int per = (a->tp > 1 ? a->tp : 1) * (a->pp > 1 ? a->pp : 1);
    const int d = rank / per, rows = a->rows;
    mt_trainer_config tc = pp_config(a);
    mt_comm *c = a->n > 1 ? tcomm_make(a->world, rank, a->n, a->threads ? MT_COMM_CAP_THREADS : 0)
                          : NULL;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_status s = tcomm_context(c, &ctx);
    if (!s) s = pp_model(a, ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    if (!s && a->load) s = mt_trainer_load(t, a->load, NULL, 0, NULL);
    int32_t tok[32 * PP_T], tgt[32 * PP_T];
    float x[32 * 6];
    for (int k = 0; k < a->steps && !s; k++) {
        pp_rows(a, (int)mt_trainer_steps(t), d * rows, rows, tok, tgt, x);
        mt_batch b = {.n = rows, .tokens = a->mlp ? NULL : tok, .inputs = a->mlp ? x : NULL,
                      .targets = tgt, .seq_len = a->mlp ? 0 : PP_T};
        s = mt_trainer_step(t, &b, &a->loss[rank][k]);
    }
    if (!s && a->save) s = mt_trainer_save(t, a->save, NULL, 0);
    a->st[rank] = s;
    if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    if (!s) {
        mt_memory_stats ms;
        mt_context_memory_stats(ctx, &ms);
        a->act_peak[rank] = ms.per_class[MT_MEM_ACT].peak_live_bytes;
    }
    /* (a deferred model is made whole by the end: its estimate is another model's) */
    if (!s && a->estimate && !a->deferred) pp_check_estimate(a, rank, ctx, m, &tc);
    if (!s) { /* (a collective of the pipeline group) */
        pp_rows(a, PP_STEPS, d * rows, rows, tok, tgt, x);
        mt_batch b = {.n = rows, .tokens = a->mlp ? NULL : tok, .inputs = a->mlp ? x : NULL,
                      .targets = tgt, .seq_len = a->mlp ? 0 : PP_T};
        s = mt_trainer_eval(t, &b, &a->eloss[rank], &a->eacc[rank]);
        if (s) {
            a->st[rank] = s;
            snprintf(a->msg[rank], sizeof a->msg[rank], "eval: %s", mt_last_error(ctx));
        }
    }
    mt_trainer_destroy(t); /* (every stage's weights to every rank) */
    if (m && !a->st[rank]) {
        a->nw = mt_model_num_params(m);
        a->w[rank] = malloc(a->nw * sizeof(float));
        if (mt_model_get_params(m, a->w[rank], a->nw)) {
            a->st[rank] = MT_ERR_INTERNAL;
            snprintf(a->msg[rank], sizeof a->msg[rank], "get_params: %s", mt_last_error(ctx));
        }
    }
    pp_close(NULL, m, ctx, c);
}

static void pp_go(pp_run *a)
{
    a->world = a->n > 1 ? tcomm_world_new(a->n, 30.0) : NULL;
    tcomm_run(a->n, pp_rank, a);
    tcomm_world_free(a->world);
}

static void pp_free(pp_run *a)
{
    for (int r = 0; r < PP_MAXN; r++) free(a->w[r]);
    memset(a->w, 0, sizeof a->w);
}

/* One process over the same rows and micro-batches as a's data-parallel
 * groups together. */
static pp_run pp_one(const pp_run *a)
{
    const int per = (a->tp > 1 ? a->tp : 1) * (a->pp > 1 ? a->pp : 1);
    pp_run one = *a;
    one.n = 1, one.tp = 0, one.pp = 0, one.sp = 0, one.zero = 0, one.estimate = 0;
    one.rows = a->rows * (a->n / per);
    memset(one.w, 0, sizeof one.w);
    pp_go(&one);
    return one;
}

/* An MLP (no tied tensors): 2 and 3 stages, 4 micro-batches, fp32 AdamW
 * with clipping and SGD, every recompute policy: every step's loss and
 * every weight after training equal one process's bit for bit, on every
 * rank; eval too; each rank's peaks its estimate's. */
TEST(pp_mlp_bit_for_bit)
{
    const struct {
        mt_optimizer_kind opt;
        float clip;
        mt_recompute_policy rec;
        mt_precision prec;
    } cases[] = {
        {MT_OPT_ADAMW, 1.0f, MT_RECOMPUTE_NONE, MT_PREC_FP32},
        {MT_OPT_SGD, 0.0f, MT_RECOMPUTE_EVERY_K, MT_PREC_FP32},
        {MT_OPT_ADAMW, 0.5f, MT_RECOMPUTE_NONE, MT_PREC_BF16},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int P = 2; P <= 3; P++) {
            pp_run a = {.n = P, .pp = P, .mlp = 1, .rows = 8, .micro = 2, .steps = PP_STEPS,
                        .opt = cases[k].opt, .clip = cases[k].clip, .rec = cases[k].rec,
                        .prec = cases[k].prec, .estimate = 1};
            pp_go(&a);
            pp_run one = pp_one(&a);
            CHECK_MSG(one.st[0] == MT_OK, "one process: %s", one.msg[0]);
            for (int r = 0; r < P; r++) {
                CHECK_MSG(a.st[r] == MT_OK, "case %zu, pp %d, rank %d: %s", k, P, r, a.msg[r]);
                if (a.st[r]) continue;
                CHECK_MSG(memcmp(a.loss[r], one.loss[0], sizeof a.loss[r]) == 0,
                          "case %zu, pp %d, rank %d: losses %.9g .. %.9g, one process %.9g .. "
                          "%.9g", k, P, r, (double)a.loss[r][0], (double)a.loss[r][PP_STEPS - 1],
                          (double)one.loss[0][0], (double)one.loss[0][PP_STEPS - 1]);
                CHECK_MSG(a.eloss[r] == one.eloss[0] && a.eacc[r] == one.eacc[0],
                          "case %zu, pp %d, rank %d: eval %.9g %.9g, one process %.9g %.9g", k,
                          P, r, (double)a.eloss[r], (double)a.eacc[r], (double)one.eloss[0],
                          (double)one.eacc[0]);
                CHECK_MSG(a.nw == one.nw && memcmp(a.w[r], one.w[0], a.nw * sizeof(float)) == 0,
                          "case %zu, pp %d, rank %d: weights differ by %.3g", k, P, r,
                          check_rel_diff(a.w[r], one.w[0], a.nw, 1e-3));
            }
            pp_free(&a);
            pp_free(&one);
        }
}

/* A GPT (its token table tied to the LM head: the first stage's and the
 * last's halves of its gradient summed): 2 and 3 stages, 4 micro-batches;
 * the first step's loss bit for bit, every step's to the case's tolerance,
 * the weights after training too (SGD), every rank holding the same
 * weights afterwards; each rank's peaks its estimate's. */
TEST(pp_gpt_matches_one_process)
{
    const struct {
        mt_optimizer_kind opt;
        mt_precision prec;
        float clip;
        mt_recompute_policy rec;
        double tol;
    } cases[] = {
        {MT_OPT_SGD, MT_PREC_FP32, 0.5f, MT_RECOMPUTE_NONE, 1e-5},
        {MT_OPT_ADAMW, MT_PREC_FP32, 1.0f, MT_RECOMPUTE_SELECTIVE, 1e-5},
        {MT_OPT_ADAMW, MT_PREC_BF16, 0.0f, MT_RECOMPUTE_EVERY_K, 3e-2},
        {MT_OPT_ADAMW, MT_PREC_FP16, 0.0f, MT_RECOMPUTE_NONE, 1e-2},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int P = 2; P <= 3; P++) {
            pp_run a = {.n = P, .pp = P, .rows = 4, .micro = 1, .steps = PP_STEPS,
                        .opt = cases[k].opt, .prec = cases[k].prec, .clip = cases[k].clip,
                        .rec = cases[k].rec, .estimate = 1, .deferred = k == 1};
            pp_go(&a);
            pp_run one = pp_one(&a);
            CHECK_MSG(one.st[0] == MT_OK, "one process: %s", one.msg[0]);
            for (int r = 0; r < P; r++) {
                CHECK_MSG(a.st[r] == MT_OK, "case %zu, pp %d, rank %d: %s", k, P, r, a.msg[r]);
                if (a.st[r]) continue;
                CHECK_MSG(a.loss[r][0] == one.loss[0][0], "case %zu, pp %d: loss %.9g, %.9g", k,
                          P, (double)a.loss[r][0], (double)one.loss[0][0]);
                for (int s = 1; s < PP_STEPS; s++)
                    CHECK_MSG(fabs(a.loss[r][s] - one.loss[0][s]) <=
                                  cases[k].tol * fabs(one.loss[0][s]),
                              "case %zu, pp %d, rank %d, step %d: loss %.9g, one process %.9g", k,
                              P, r, s, (double)a.loss[r][s], (double)one.loss[0][s]);
                CHECK_MSG(fabs(a.eloss[r] - one.eloss[0]) <= cases[k].tol * fabs(one.eloss[0]),
                          "case %zu, pp %d: eval %.9g, one process %.9g", k, P,
                          (double)a.eloss[r], (double)one.eloss[0]);
                CHECK(memcmp(a.w[r], a.w[0], a.nw * sizeof(float)) == 0);
            }
            if (!a.st[0] && cases[k].opt == MT_OPT_SGD) {
                const double wd = check_rel_diff(a.w[0], one.w[0], a.nw, 1e-2);
                CHECK_MSG(wd <= 1e-4, "case %zu, pp %d: weights differ by %.3g", k, P, wd);
            }
            pp_free(&a);
            pp_free(&one);
        }
}

/* Grids: tp 2 x pp 2 (with and without sequence parallel), pp 2 over 2
 * data-parallel groups at ZeRO-1 and ZeRO-2, and 8 ranks as dp 2 x tp 2 x
 * pp 2 with ZeRO-1 and (with sequence parallel, a deferred model) ZeRO-2,
 * with and without a communicator that takes calls from any thread (the
 * sums on the communication thread), and bf16 at ZeRO-1 and 8-bit AdamW at
 * ZeRO-2: losses one process's over both data-parallel groups' rows (fp32
 * to 1e-5, bf16 3e-2, 8-bit state 1e-3), every rank's peaks its estimate's
 * (but the deferred model's). */
TEST(pp_grids)
{
    const struct {
        int n, tp, pp, sp, zero, threads;
        mt_precision prec;
        mt_optimizer_kind opt;
        double tol;
    } grids[] = {{4, 2, 2, 0, 0, 0, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {4, 2, 2, 1, 0, 0, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {8, 2, 2, 0, 1, 0, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {4, 1, 2, 0, 1, 0, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {4, 1, 2, 0, 2, 0, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {8, 2, 2, 1, 2, 0, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {4, 1, 2, 0, 2, 1, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {4, 1, 2, 0, 1, 1, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {8, 2, 2, 0, 2, 1, MT_PREC_FP32, MT_OPT_ADAMW, 1e-5},
                 {4, 1, 2, 0, 1, 0, MT_PREC_BF16, MT_OPT_ADAMW, 3e-2},
                 {4, 1, 2, 0, 2, 0, MT_PREC_FP32, MT_OPT_ADAMW8, 1e-3}};
    for (size_t k = 0; k < sizeof grids / sizeof grids[0]; k++) {
        pp_run a = {.n = grids[k].n, .tp = grids[k].tp, .pp = grids[k].pp, .sp = grids[k].sp,
                    .zero = grids[k].zero, .threads = grids[k].threads, .rows = 4, .micro = 2,
                    .deferred = k == 5, .steps = PP_STEPS,
                    .opt = grids[k].opt, .prec = grids[k].prec, .clip = 1.0f, .estimate = 1};
        pp_go(&a);
        pp_run one = pp_one(&a);
        CHECK_MSG(one.st[0] == MT_OK, "one process: %s", one.msg[0]);
        for (int r = 0; r < a.n; r++) {
            CHECK_MSG(a.st[r] == MT_OK, "grid %zu, rank %d: %s", k, r, a.msg[r]);
            if (a.st[r]) continue;
            for (int s = 0; s < PP_STEPS; s++)
                CHECK_MSG(fabs(a.loss[r][s] - one.loss[0][s]) <= grids[k].tol * fabs(one.loss[0][s]),
                          "grid %zu, rank %d, step %d: loss %.9g, one process %.9g", k, r, s,
                          (double)a.loss[r][s], (double)one.loss[0][s]);
            CHECK(memcmp(a.w[r], a.w[0], a.nw * sizeof(float)) == 0);
        }
        pp_free(&a);
        pp_free(&one);
    }
}

/* 1F1B: stage 0 of 4 holds at most 4 micro-batches' activations, so its
 * ACT peak is the same at 4 and 8 micro-batches; the last stage holds one
 * at a time, less than stage 0. */
TEST(pp_activations_bounded_by_stages)
{
    uint64_t peak[2][4];
    for (int k = 0; k < 2; k++) {
        pp_run a = {.n = 4, .pp = 4, .rows = k ? 8 : 4, .micro = 1, .steps = 1,
                    .opt = MT_OPT_SGD, .prec = MT_PREC_FP32};
        pp_go(&a);
        for (int r = 0; r < 4; r++) {
            CHECK_MSG(a.st[r] == MT_OK, "rank %d: %s", r, a.msg[r]);
            peak[k][r] = a.act_peak[r];
        }
        pp_free(&a);
    }
    CHECK_MSG(peak[0][0] == peak[1][0], "stage 0: ACT peak %llu at 4 micro-batches, %llu at 8",
              (unsigned long long)peak[0][0], (unsigned long long)peak[1][0]);
    CHECK_MSG(peak[1][3] < peak[1][0], "ACT peaks: last stage %llu, first %llu",
              (unsigned long long)peak[1][3], (unsigned long long)peak[1][0]);
}

typedef struct pp_bad {
    tcomm_world *world;
    int n;
    mt_trainer_config tc;
    mt_status st[PP_MAXN];
    char msg[PP_MAXN][512];
} pp_bad;

static void pp_bad_rank(int rank, void *p)
{
    pp_bad *a = p;
    mt_comm *c = tcomm_make(a->world, rank, a->n, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    pp_run spec = {0};
    mt_status s = tcomm_context(c, &ctx);
    if (!s) s = pp_model(&spec, ctx, &m);
    if (!s) s = mt_trainer_create(m, &a->tc, &t);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", s ? mt_last_error(ctx) : "");
    pp_close(t, m, ctx, c);
}

/* An impossible grid or combination is refused on every rank before
 * anything runs, with the reason. */
TEST(pp_refusals)
{
    struct {
        int n, tp, pp;
        unsigned what;
        mt_status want;
        const char *says;
    } cases[] = {
        {3, 1, 2, 0, MT_ERR_INVALID_ARG, "not a multiple of tensor_parallel 1 x pipeline_parallel 2"},
        {4, 2, 3, 0, MT_ERR_INVALID_ARG, "not a multiple"},
        {6, 1, 6, 0, MT_ERR_INVALID_ARG, "more than the model's 5 units"},
        {2, 1, 2, 1, MT_ERR_UNSUPPORTED, "fused step"},
        {4, 1, 2, 2, MT_ERR_UNSUPPORTED, "ZeRO stage 3"},
        {4, 1, 2, 8, MT_ERR_UNSUPPORTED, "updates slices"},
        {2, 1, 2, 4, MT_ERR_UNSUPPORTED, "LoRA"},
        {2, 1, -1, 0, MT_ERR_INVALID_ARG, "out of range"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        pp_run r = {.rows = 4, .micro = 1, .opt = MT_OPT_SGD, .tp = cases[k].tp, .pp = cases[k].pp};
        pp_bad a = {.n = cases[k].n, .tc = pp_config(&r)};
        if (cases[k].what & 1) a.tc.fused_step = 1, a.tc.micro_batch = 0;
        if (cases[k].what & 2) a.tc.zero_stage = 3;
        if (cases[k].what & 8) a.tc.zero_stage = 1, a.tc.optimizer = MT_OPT_ADAFACTOR;
        if (cases[k].what & 4) a.tc.lora.rank = 2;
        a.world = tcomm_world_new(a.n, 30.0);
        tcomm_run(a.n, pp_bad_rank, &a);
        tcomm_world_free(a.world);
        for (int q = 0; q < a.n; q++) {
            CHECK_MSG(a.st[q] == cases[k].want, "case %zu rank %d: %s: %s", k, q,
                      mt_status_string(a.st[q]), a.msg[q]);
            CHECK_MSG(strstr(a.msg[q], cases[k].says) != NULL, "case %zu: %s", k, a.msg[q]);
        }
    }
}

/* A stage that stalls before a step: its neighbour stops with
 * MT_ERR_COMM within the timeout, naming what it waited for, and every
 * rank's trainer still goes. */
typedef struct pp_death {
    tcomm_world *world;
    mt_status st[2];
    char msg[2][512];
    double seconds[2];
} pp_death;

static void pp_death_rank(int rank, void *p)
{
    pp_death *a = p;
    pp_run spec = {.rows = 4, .micro = 1, .pp = 2, .opt = MT_OPT_SGD};
    mt_trainer_config tc = pp_config(&spec);
    mt_comm *c = tcomm_make(a->world, rank, 2, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_status s = tcomm_context(c, &ctx);
    if (!s) s = pp_model(&spec, ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[4 * PP_T], tgt[4 * PP_T];
    pp_rows(&spec, 0, 0, 4, tok, tgt, NULL);
    mt_batch b = {.n = 4, .tokens = tok, .targets = tgt, .seq_len = PP_T};
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!s && rank == 1) { /* stalls past the timeout, then steps too late */
        struct timespec nap = {2, 500000000};
        nanosleep(&nap, NULL);
    }
    if (!s) s = mt_trainer_step(t, &b, NULL);
    a->seconds[rank] = pp_since(&t0);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", s ? mt_last_error(ctx) : "");
    pp_close(t, m, ctx, c);
}

TEST(pp_dead_rank)
{
    pp_death a = {0};
    pp_each_rank(2, 1.0, pp_death_rank, &a, &a.world);
    CHECK_MSG(a.st[0] == MT_ERR_COMM, "rank 0: %s: %s", mt_status_string(a.st[0]), a.msg[0]);
    CHECK_MSG(strstr(a.msg[0], "pipeline") != NULL, "%s", a.msg[0]);
    CHECK_MSG(a.seconds[0] < 1.0 + 3.0, "rank 0 failed after %.2f s", a.seconds[0]);
}

/* On CUDA contexts (the stand-in driver and cuBLASLt) over the stand-in
 * NCCL (its send and receive on the device's stream) and over a host
 * communicator (staged through host memory): 2 stages, fp32 and bf16, 4
 * micro-batches, on gradients the test fills in; each rank's per-class
 * peaks equal its estimate, a training-state file is saved and loaded, and
 * the weights brought back to every rank after the trainer are the same
 * on both. */
typedef struct ppc_run {
    tcomm_world *w;
    int nccl;
    mt_precision prec;
    float *wt[2];
    size_t nw;
    char msg[2][400];
} ppc_run;

static void ppc_rank(int rank, void *arg)
{
    ppc_run *a = arg;
    char *msg = a->msg[rank];
    const size_t cap = sizeof a->msg[rank];
    mt_comm *c = a->nccl ? tcomm_nccl(a->w, rank, 2) : tcomm_make(a->w, rank, 2, 0);
    mt_context *ctx = c ? tcomm_cuda_context(c) : NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_status s = ctx ? MT_OK : MT_ERR_NO_DEVICE;
    pp_run spec = {.pp = 2, .rows = 4, .micro = 1, .opt = MT_OPT_ADAMW, .prec = a->prec,
                   .clip = 1.0f};
    mt_trainer_config tc = pp_config(&spec);
    if (!s) s = pp_model(&spec, ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[4 * PP_T], tgt[4 * PP_T];
    for (int k = 0; k < 2 && !s; k++) {
        pp_rows(&spec, k, 0, 4, tok, tgt, NULL);
        mt_batch b = {.n = 4, .tokens = tok, .targets = tgt, .seq_len = PP_T};
        s = mt_trainer_step(t, &b, NULL);
    }
    if (!s) {
        mt_estimate_report e;
        mt_memory_stats ms;
        s = mt_estimate_model(m, &tc, &e);
        mt_context_memory_stats(ctx, &ms);
        for (int k = 0; !s && k < MT_MEM_COUNT && !*msg; k++)
            if (ms.per_class[k].peak_live_bytes != e.class_peak[k])
                snprintf(msg, cap, "%s peak %llu, estimate %llu", mt_mem_class_name(k),
                         (unsigned long long)ms.per_class[k].peak_live_bytes,
                         (unsigned long long)e.class_peak[k]);
    }
    /* (a training-state file: the stages' sections through device memory) */
    char path[64];
    snprintf(path, sizeof path, "/tmp/mt_pp_cuda_%d.ck", a->nccl);
    if (!s && !*msg) s = mt_trainer_save(t, path, NULL, 0);
    if (!s && !*msg) s = mt_trainer_load(t, path, NULL, 0, NULL);
    if (rank == 0) remove(path);
    if (s && !*msg) snprintf(msg, cap, "%s", ctx ? mt_last_error(ctx) : "no context");
    mt_trainer_destroy(t);
    if (!s && !*msg) {
        a->nw = mt_model_num_params(m);
        a->wt[rank] = malloc(a->nw * sizeof(float));
        if (mt_model_get_params(m, a->wt[rank], a->nw))
            snprintf(msg, cap, "get_params: %s", mt_last_error(ctx));
    }
    pp_close(NULL, m, ctx, c);
}

TEST(pp_cuda_stand_in)
{
    if (!check_fake_cuda() || !getenv("MT_FAKE_CUBLASLT") || !getenv("MT_FAKE_NCCL")) {
        fprintf(stderr, "    (skipped: MT_FAKE_CUDA, MT_FAKE_CUBLASLT or MT_FAKE_NCCL is not set)\n");
        return;
    }
    mti_engine_grad_fill = tcomm_fill_grads;
    for (int k = 0; k < 3; k++) {
        ppc_run a = {.nccl = k != 2, .prec = k == 1 ? MT_PREC_BF16 : MT_PREC_FP32};
        a.w = tcomm_world_new(2, 30.0);
        tcomm_run(2, ppc_rank, &a);
        tcomm_world_free(a.w);
        for (int r = 0; r < 2; r++)
            CHECK_MSG(!a.msg[r][0], "case %d, rank %d: %s", k, r, a.msg[r]);
        CHECK(a.wt[0] && a.wt[1] && memcmp(a.wt[0], a.wt[1], a.nw * sizeof(float)) == 0);
        free(a.wt[0]), free(a.wt[1]);
    }
    mti_engine_grad_fill = NULL;
}

/* While the trainer lives: the model's size and tensors are the whole
 * model's, and the calls that need every tensor are refused by name. */
typedef struct pp_calls {
    tcomm_world *world;
    int bad;
} pp_calls;

static void pp_calls_rank(int rank, void *p)
{
    pp_calls *a = p;
    pp_run spec = {.pp = 2, .rows = 4, .micro = 1, .opt = MT_OPT_SGD};
    mt_trainer_config tc = pp_config(&spec);
    mt_comm *c = tcomm_make(a->world, rank, 2, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    RANK_EXPECT(!tcomm_context(c, &ctx) && !pp_model(&spec, ctx, &m));
    const size_t n = mt_model_num_params(m);
    const int k = mt_model_num_tensors(m);
    RANK_EXPECT(!mt_trainer_create(m, &tc, &t));
    RANK_EXPECT(mt_model_num_params(m) == n && mt_model_num_tensors(m) == k);
    mt_param_info pi;
    RANK_EXPECT(!mt_model_param_info(m, k - 1, &pi) && !strcmp(pi.name, "lnf.b"));
    float *w = malloc(n * sizeof *w);
    RANK_EXPECT(mt_model_get_params(m, w, n) == MT_ERR_UNSUPPORTED &&
                strstr(mt_last_error(ctx), "pipeline stages"));
    /* (a save to a path the writer cannot open fails on every rank of the group) */
    RANK_EXPECT(mt_trainer_save(t, "/nonexistent/x", NULL, 0) != MT_OK);
    int32_t tok[4 * PP_T], tgt[4 * PP_T];
    pp_rows(&spec, 0, 0, 4, tok, tgt, NULL);
    mt_batch b = {.n = 4, .tokens = tok, .targets = tgt, .seq_len = PP_T};
    RANK_EXPECT(mt_trainer_gradients(t, &b, NULL, w, n) == MT_ERR_UNSUPPORTED);
    RANK_EXPECT(!mt_trainer_step(t, &b, NULL)); /* (the refusals left the trainer whole) */
    mt_trainer_destroy(t);
    RANK_EXPECT(!mt_model_get_params(m, w, n));
    free(w);
    pp_close(NULL, m, ctx, c);
}

TEST(pp_model_calls)
{
    pp_calls a = {0};
    pp_each_rank(2, 30.0, pp_calls_rank, &a, &a.world);
    CHECK(!a.bad);
}

/* Training-state files move between layouts: a file saved by 2 stages is
 * one process's file byte for byte (an MLP, whose runs are the same bits),
 * and it resumes on one process, on 3 stages and on 2 stages again with the
 * unbroken run's losses bit for bit; a file saved by 2 stages over 2
 * data-parallel groups at ZeRO-2 (MLP) or ZeRO-1 (GPT) resumes on one
 * process and on 2 stages over 2 groups at ZeRO-2, and one process's file
 * there at ZeRO-1 (their sums over the groups in another order: to 1e-5);
 * a GPT's files (from tp 2 x pp 2 among them) likewise to 1e-5. */
TEST(pp_files_move_between_layouts)
{
    char f1[] = "/tmp/mt_pp_ck1_XXXXXX", f2[] = "/tmp/mt_pp_ck2_XXXXXX", f3[] = "/tmp/mt_pp_ck3_XXXXXX";
    CHECK(mkstemp(f1) >= 0 && mkstemp(f2) >= 0 && mkstemp(f3) >= 0);
    for (int mlp = 1; mlp >= 0; mlp--) {
        const pp_run base = {.mlp = mlp, .rows = mlp ? 8 : 4, .micro = mlp ? 2 : 1,
                             .opt = MT_OPT_ADAMW, .prec = MT_PREC_FP32, .clip = 1.0f};
        pp_run whole = base;
        whole.n = 1, whole.steps = PP_STEPS;
        pp_go(&whole);
        CHECK_MSG(whole.st[0] == MT_OK, "unbroken: %s", whole.msg[0]);
        /* the first half: on 2 stages (MLP) or tp 2 x pp 2 (GPT), and on one process */
        pp_run first = base;
        first.n = mlp ? 2 : 4, first.pp = 2, first.tp = mlp ? 0 : 2, first.steps = PP_STEPS / 2;
        first.save = f1;
        pp_go(&first);
        for (int r = 0; r < first.n; r++)
            CHECK_MSG(first.st[r] == MT_OK, "mlp %d, saving rank %d: %s", mlp, r, first.msg[r]);
        pp_run one = base;
        one.n = 1, one.steps = PP_STEPS / 2, one.save = f2;
        pp_go(&one);
        CHECK_MSG(one.st[0] == MT_OK, "one process saving: %s", one.msg[0]);
        if (mlp) CHECK_MSG(check_same_file(f1, f2), "the 2 stages' file is not one process's");
        /* the second half, resumed under other layouts */
        const struct {
            int n, tp, pp, zero, dp;
            const char *from;
        } rs[] = {{1, 0, 0, 0, 1, f1}, {3, 0, 3, 0, 1, f1}, {2, 0, 2, 0, 1, f2},
                  {4, 2, 2, 0, 1, f2}, {4, 0, 2, 1, 2, f1}, {4, 0, 2, 2, 2, f3},
                  {1, 0, 0, 0, 1, f3}};
        /* (a third file: saved by 2 stages over 2 data-parallel groups, at
           ZeRO-2 for the MLP and ZeRO-1 for the GPT) */
        pp_run z = base;
        z.n = 4, z.pp = 2, z.zero = mlp ? 2 : 1, z.rows /= 2, z.steps = PP_STEPS / 2, z.save = f3;
        pp_go(&z);
        for (int r = 0; r < z.n; r++)
            CHECK_MSG(z.st[r] == MT_OK, "mlp %d, ZeRO-1 saving rank %d: %s", mlp, r, z.msg[r]);
        pp_free(&z);
        for (size_t k = 0; k < sizeof rs / sizeof rs[0]; k++) {
            if (mlp && rs[k].tp) continue; /* (tensor parallel: GPT only) */
            pp_run b = base;
            b.n = rs[k].n, b.tp = rs[k].tp, b.pp = rs[k].pp, b.load = rs[k].from;
            b.zero = rs[k].zero, b.rows /= rs[k].dp;
            b.steps = PP_STEPS - PP_STEPS / 2;
            pp_go(&b);
            for (int r = 0; r < b.n; r++) {
                CHECK_MSG(b.st[r] == MT_OK, "mlp %d, case %zu, rank %d: %s", mlp, k, r, b.msg[r]);
                if (b.st[r]) continue;
                for (int q = 0; q < b.steps; q++) {
                    const float want = whole.loss[0][PP_STEPS / 2 + q], got = b.loss[r][q];
                    /* (2 data-parallel groups sum their gradients in another order) */
                    const bool exact = mlp && rs[k].dp == 1 && rs[k].from != f3;
                    CHECK_MSG(exact ? got == want : fabs(got - want) <= 1e-5 * fabs(want),
                              "mlp %d, case %zu, rank %d, step %d: loss %.9g, unbroken %.9g", mlp,
                              k, r, PP_STEPS / 2 + q, (double)got, (double)want);
                }
            }
            pp_free(&b);
        }
        pp_free(&first);
        pp_free(&one);
        pp_free(&whole);
    }
    remove(f1);
    remove(f2);
    remove(f3);
}

/* A recompute plan chosen by a memory budget: each rank plans its own
 * stage (its units of the plan), so with a budget below the heaviest
 * stage's peak without recompute that stage recomputes and every rank
 * stays within the budget, with one process's losses (recompute runs the
 * same ops) to 1e-5. */
typedef struct pp_budget {
    tcomm_world *world;
    uint64_t budget;
    uint64_t peak[2], reserved[2];
    int recomputed[2];
    float loss[2][PP_STEPS];
    int bad;
} pp_budget;

static void pp_budget_rank(int rank, void *p)
{
    pp_budget *a = p;
    pp_run spec = {.pp = 2, .rows = 4, .micro = 1, .opt = MT_OPT_ADAMW, .clip = 1.0f};
    mt_trainer_config tc = pp_config(&spec);
    mt_comm *c = tcomm_make(a->world, rank, 2, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    RANK_EXPECT(!tcomm_context(c, &ctx) && !pp_model(&spec, ctx, &m));
    mt_estimate_report e;
    if (!a->budget) { /* (the first run: each stage's peak without recompute) */
        RANK_EXPECT(!mt_estimate_model(m, &tc, &e));
        a->peak[rank] = e.peak_reserved;
    } else {
        tc.memory_budget = a->budget;
        tc.recompute = MT_RECOMPUTE_BUDGET;
        RANK_EXPECT(!mt_trainer_create(m, &tc, &t));
        unsigned char units[16];
        int seg = 0;
        RANK_EXPECT(t && !mt_trainer_recompute_plan(t, units, 16, &seg));
        for (int u = 0; t && u < mt_model_num_units(m); u++) a->recomputed[rank] += units[u] != 0;
        RANK_EXPECT(mt_model_num_units(m) == 5); /* (the whole model's: 4 blocks and the embedding) */
        int32_t tok[4 * PP_T], tgt[4 * PP_T];
        for (int k = 0; k < PP_STEPS && t; k++) {
            pp_rows(&spec, k, 0, 4, tok, tgt, NULL);
            mt_batch b = {.n = 4, .tokens = tok, .targets = tgt, .seq_len = PP_T};
            RANK_EXPECT(!mt_trainer_step(t, &b, &a->loss[rank][k]));
        }
        mt_memory_stats ms;
        mt_context_memory_stats(ctx, &ms);
        a->reserved[rank] = ms.peak_reserved_bytes;
    }
    pp_close(t, m, ctx, c);
}

TEST(pp_recompute_budget)
{
    pp_budget a = {0};
    pp_each_rank(2, 30.0, pp_budget_rank, &a, &a.world);
    CHECK(!a.bad);
    const int heavy = a.peak[0] >= a.peak[1] ? 0 : 1;
    pp_budget b = {.budget = a.peak[heavy] - 4096};
    pp_each_rank(2, 30.0, pp_budget_rank, &b, &b.world);
    CHECK(!b.bad);
    pp_run one = {.n = 1, .rows = 4, .micro = 1, .steps = PP_STEPS, .opt = MT_OPT_ADAMW,
                  .clip = 1.0f};
    pp_go(&one);
    CHECK_MSG(b.recomputed[heavy] > 0, "stage %d recomputes nothing under %llu bytes", heavy,
              (unsigned long long)b.budget);
    for (int r = 0; r < 2; r++) {
        CHECK_MSG(b.reserved[r] <= b.budget, "rank %d reserved %llu, budget %llu", r,
                  (unsigned long long)b.reserved[r], (unsigned long long)b.budget);
        for (int k = 0; k < PP_STEPS; k++)
            CHECK_MSG(fabs(b.loss[r][k] - one.loss[0][k]) <= 1e-5 * fabs(one.loss[0][k]),
                      "rank %d step %d: loss %.9g, one process %.9g", r, k, (double)b.loss[r][k],
                      (double)one.loss[0][k]);
    }
    pp_free(&one);
}

/* Fewer micro-batches than stages, and a last micro-batch of fewer rows:
 * an MLP's losses, eval and weights one process's bit for bit, each rank's
 * peaks its estimate's. */
TEST(pp_ragged_micro_batches)
{
    const struct {
        int P, rows, micro;
    } cs[] = {{4, 3, 2}, {3, 1, 1}, {4, 5, 2}, {2, 5, 2}, {4, 1, 1}, {3, 7, 3}};
    for (size_t k = 0; k < sizeof cs / sizeof cs[0]; k++) {
        pp_run a = {.n = cs[k].P, .pp = cs[k].P, .mlp = 1, .rows = cs[k].rows,
                    .micro = cs[k].micro, .steps = PP_STEPS, .opt = MT_OPT_ADAMW, .clip = 1.0f,
                    .estimate = 1};
        pp_go(&a);
        pp_run one = pp_one(&a);
        CHECK_MSG(one.st[0] == MT_OK, "one process: %s", one.msg[0]);
        for (int r = 0; r < a.n; r++) {
            CHECK_MSG(a.st[r] == MT_OK, "case %zu rank %d: %s", k, r, a.msg[r]);
            if (a.st[r]) continue;
            CHECK_MSG(memcmp(a.loss[r], one.loss[0], sizeof a.loss[r]) == 0 &&
                          a.eloss[r] == one.eloss[0] && a.eacc[r] == one.eacc[0] &&
                          memcmp(a.w[r], one.w[0], a.nw * sizeof(float)) == 0,
                      "case %zu rank %d: loss %.9g, one process %.9g", k, r,
                      (double)a.loss[r][PP_STEPS - 1], (double)one.loss[0][PP_STEPS - 1]);
        }
        pp_free(&a);
        pp_free(&one);
    }
}

/* A rank that fails alone: its batch refused (a target out of range), in a
 * step and in eval, or its stage's weights without room at create. Every
 * rank of the group stops at once (well within the timeout), the others
 * naming the failed rank, and the trainers still go. */
typedef struct pp_alone {
    tcomm_world *w;
    int what;       /* 0 a step's batch, 1 eval's, 2 creation */
    mt_status st[2];
    double sec[2];
    char msg[2][400];
} pp_alone;

static void pp_alone_rank(int rank, void *p)
{
    pp_alone *a = p;
    pp_run spec = {.pp = 2, .rows = 4, .micro = 1, .opt = MT_OPT_SGD, .deferred = 1};
    mt_trainer_config tc = pp_config(&spec);
    mt_comm *c = tcomm_make(a->w, rank, 2, 0);
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.comm = c;
    if (a->what == 2 && rank == 1) /* (room for the model's source, not for its stage) */
        cc.allocators[MT_MEM_PARAM] = (mt_allocator_config){.limit_bytes = 4096, .group = 1};
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_status s = mt_context_create(&cc, &ctx);
    if (!s) s = pp_model(&spec, ctx, &m);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[4 * PP_T], tgt[4 * PP_T];
    pp_rows(&spec, 0, 0, 4, tok, tgt, NULL);
    if (rank == 1) tgt[3] = 1000; /* (out of the vocabulary) */
    mt_batch b = {.n = 4, .tokens = tok, .targets = tgt, .seq_len = PP_T};
    float l, acc;
    if (!s) s = a->what ? mt_trainer_eval(t, &b, &l, &acc) : mt_trainer_step(t, &b, &l);
    a->sec[rank] = pp_since(&t0);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", s ? mt_last_error(ctx) : "");
    pp_close(t, m, ctx, c);
}

TEST(pp_one_rank_fails_alone)
{
    for (int what = 0; what < 3; what++) {
        pp_alone a = {.what = what};
        pp_each_rank(2, 3.0, pp_alone_rank, &a, &a.w);
        const mt_status want = what == 2 ? MT_ERR_OOM : MT_ERR_INVALID_ARG;
        CHECK_MSG(a.st[1] == want, "case %d, rank 1: %s: %s", what, mt_status_string(a.st[1]),
                  a.msg[1]);
        CHECK_MSG(a.st[0] == MT_ERR_COMM && strstr(a.msg[0], "rank 1"), "case %d, rank 0: %s: %s",
                  what, mt_status_string(a.st[0]), a.msg[0]);
        CHECK_MSG(a.sec[0] < 1.5 && a.sec[1] < 1.5, "case %d: %.2f s and %.2f s (the timeout: 3 s)",
                  what, a.sec[0], a.sec[1]);
    }
}

/* A layer stack's estimate while a pipeline-parallel trainer holds it is
 * the whole model's. */
typedef struct pp_seq {
    tcomm_world *w;
    int bad;
    size_t whole[2], est[2];
} pp_seq;

static void pp_seq_rank(int rank, void *p)
{
    pp_seq *a = p;
    mt_comm *c = tcomm_make(a->w, rank, 2, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_layer_spec ls[] = {{.kind = MT_LAYER_LINEAR, .units = 16}, {.kind = MT_LAYER_RELU},
                          {.kind = MT_LAYER_LINEAR, .units = 12}, {.kind = MT_LAYER_RELU},
                          {.kind = MT_LAYER_LINEAR, .units = 5}};
    mt_model_spec ms;
    mt_model_spec_init(&ms);
    ms.input = MT_INPUT_FEATURES, ms.features = 6, ms.n_layers = 5, ms.layers = ls;
    pp_run spec = {.pp = 2, .rows = 4, .micro = 1, .opt = MT_OPT_SGD, .mlp = 1};
    mt_trainer_config tc = pp_config(&spec);
    mt_estimate_report e;
    RANK_EXPECT(!tcomm_context(c, &ctx) && !mt_model_create(ctx, &ms, &m));
    RANK_EXPECT(!mt_trainer_create(m, &tc, &t));
    a->whole[rank] = mt_model_num_params(m);
    RANK_EXPECT(!mt_estimate_model(m, &tc, &e));
    a->est[rank] = e.n_params;
    pp_close(t, m, ctx, c);
}

TEST(pp_layer_stack_estimate)
{
    pp_seq a = {0};
    pp_each_rank(2, 30.0, pp_seq_rank, &a, &a.w);
    CHECK(!a.bad);
    for (int r = 0; r < 2; r++)
        CHECK_MSG(a.est[r] == a.whole[r] && a.whole[r] == 6 * 16 + 16 + 16 * 12 + 12 + 12 * 5 + 5,
                  "rank %d: estimate of %zu parameters, the model %zu", r, a.est[r], a.whole[r]);
}

/* At destroy a rank without room for the other stages' weights: no
 * broadcast is made (the ranks' calls stay paired), each rank keeps its own
 * stage's weights, the others' are lost (reads refused), said in the log;
 * nothing crashes or waits. */
typedef struct pp_room {
    tcomm_world *w;
    int bad;
    mt_status get[2];
    int lost[2];
} pp_room;

static void pp_room_rank(int rank, void *p)
{
    pp_room *a = p;
    mt_comm *c = tcomm_make(a->w, rank, 2, 0);
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.comm = c;
    if (rank == 1) /* (its stage's weights, about 1.05 MB; not the whole model's 2.1) */
        cc.allocators[MT_MEM_PARAM] = (mt_allocator_config){.limit_bytes = 3 << 19, .group = 1};
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 4;
    sp.dims[0] = 6, sp.dims[1] = 512, sp.dims[2] = 512, sp.dims[3] = 512, sp.dims[4] = 5;
    sp.seed = 3, sp.deferred = 1;
    pp_run spec = {.pp = 2, .rows = 4, .micro = 1, .opt = MT_OPT_SGD, .mlp = 1};
    mt_trainer_config tc = pp_config(&spec);
    RANK_EXPECT(!mt_context_create(&cc, &ctx) && !mt_model_mlp_create(ctx, &sp, &m));
    RANK_EXPECT(!mt_trainer_create(m, &tc, &t));
    float x[4 * 6];
    int32_t tgt[4];
    pp_rows(&spec, 0, 0, 4, NULL, tgt, x);
    mt_batch b = {.n = 4, .inputs = x, .targets = tgt};
    RANK_EXPECT(!mt_trainer_step(t, &b, NULL));
    mt_trainer_destroy(t);
    const size_t n = mt_model_num_params(m);
    float *w = malloc(n * sizeof *w);
    a->get[rank] = mt_model_get_params(m, w, n);
    mt_param_info pi;
    for (int i = 0; i < mt_model_num_tensors(m); i++) {
        mt_model_param_info(m, i, &pi);
        a->lost[rank] += mti_param_read(m, i, 0, 1, w) != MT_OK;
    }
    free(w);
    pp_close(NULL, m, ctx, c);
}

TEST(pp_destroy_without_room)
{
    pp_room a = {0};
    pp_each_rank(2, 3.0, pp_room_rank, &a, &a.w);
    CHECK(!a.bad);
    for (int r = 0; r < 2; r++)
        CHECK_MSG(a.get[r] != MT_OK && a.lost[r] == 4, "rank %d: get_params %s, %d tensors lost",
                  r, mt_status_string(a.get[r]), a.lost[r]);
}

/* A training-state file whose tensors take several of the stages' 1 MiB
 * pieces (a weight of 1.2 MiB), saved by 2 stages and by 2 stages over 2
 * data-parallel groups at ZeRO-1 (each stage's slices in other pieces than
 * the file's), is one process's file byte for byte, and loads on one
 * process. */
typedef struct pp_big {
    tcomm_world *w;
    int n, pp, zero, bad;
    const char *path, *load;
} pp_big;

static void pp_big_rank(int rank, void *p)
{
    pp_big *a = p;
    mt_comm *c = a->n > 1 ? tcomm_make(a->w, rank, a->n, 0) : NULL;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 3;
    sp.dims[0] = 6, sp.dims[1] = 560, sp.dims[2] = 560, sp.dims[3] = 5;
    sp.seed = 3;
    pp_run spec = {.pp = a->pp, .zero = a->zero, .rows = 4 / (a->n / (a->pp ? a->pp : 1)),
                   .micro = 1, .opt = MT_OPT_SGD, .mlp = 1};
    mt_trainer_config tc = pp_config(&spec);
    RANK_EXPECT(!tcomm_context(c, &ctx) && !mt_model_mlp_create(ctx, &sp, &m));
    RANK_EXPECT(!mt_trainer_create(m, &tc, &t));
    if (a->load) RANK_EXPECT(!mt_trainer_load(t, a->load, NULL, 0, NULL));
    else RANK_EXPECT(!mt_trainer_save(t, a->path, NULL, 0));
    pp_close(t, m, ctx, c);
}

TEST(pp_files_of_many_pieces)
{
    char f[3][32];
    for (int k = 0; k < 3; k++) {
        snprintf(f[k], sizeof f[k], "/tmp/mt_pp_big%d_XXXXXX", k);
        CHECK(mkstemp(f[k]) >= 0);
    }
    const struct {
        int n, pp, zero;
    } runs[3] = {{1, 0, 0}, {2, 2, 0}, {4, 2, 1}};
    for (int k = 0; k < 3; k++) {
        pp_big a = {.w = runs[k].n > 1 ? tcomm_world_new(runs[k].n, 30.0) : NULL, .n = runs[k].n,
                    .pp = runs[k].pp, .zero = runs[k].zero, .path = f[k]};
        tcomm_run(a.n, pp_big_rank, &a);
        tcomm_world_free(a.w);
        CHECK_MSG(!a.bad, "run %d", k);
    }
    CHECK_MSG(check_same_file(f[1], f[0]), "2 stages' file is not one process's");
    CHECK_MSG(check_same_file(f[2], f[0]), "2 stages over 2 groups at ZeRO-1: not one process's file");
    pp_big b = {.n = 1, .load = f[2]};
    tcomm_run(1, pp_big_rank, &b);
    CHECK(!b.bad);
    for (int k = 0; k < 3; k++) remove(f[k]);
}
