/*
 * train_mpi_test.c - data parallel training under mpirun (test/mpi_test.sh).
 *
 *   train_mpi_test train      N ranks with 2 rows each against this process
 *                             alone stepping on the 2N rows as N micro-batches
 *   train_mpi_test disagree   rank 1's model is wider, then rank 1 alone
 *                             freezes a parameter: every rank gets
 *                             MT_ERR_COMM at mt_trainer_create
 *   train_mpi_test stall      rank 1 stops before its second step: rank 0 gets
 *                             MT_ERR_COMM within the timeout
 *   train_mpi_test kill       rank 1 is killed (SIGKILL) as its second step
 *                             begins (mpirun told not to end the job): rank 0,
 *                             inside that step, gets MT_ERR_COMM within the
 *                             1 s timeout, saying a rank died or stalled, and
 *                             the communicator is broken
 *   train_mpi_test killmid    the same at ZeRO stage 2 (bf16), rank 1 killed
 *                             by a thread of its own half a step's time after
 *                             its second step began, so inside a step, the
 *                             others inside its collectives wherever it fell
 *                             (backward's reduce-scatters among them)
 *   train_mpi_test killmid3   the same at ZeRO stage 3 (MPI serialized), the
 *                             others' gathers of the layers to come running
 *                             on their communication threads
 *   train_mpi_test zero3      ZeRO stage 3 (MPI serialized, the gathers on a
 *                             communication thread) at prefetch depths 0 to 2,
 *                             keeping no layer, the last one or every one
 *                             from forward to backward: each stage 2's bits,
 *                             losses and weights, for every case of "zero";
 *                             each rank's peaks equal its estimate
 *   train_mpi_test zero       ZeRO stages 0, 1 and 2, each with AdamW in bf16
 *                             (fp32 masters, clipping), 8-bit AdamW in fp16
 *                             with dynamic loss scaling, Adafactor in fp32
 *                             and the fused step (AdamW, clipping): N ranks
 *                             against this process alone accumulating N
 *                             micro-batches; each rank's per-class peaks
 *                             equal its estimate to the byte
 *   train_mpi_test overlap    (MPI at MPI_THREAD_SERIALIZED) stages 0 to 2
 *                             with the gradients' collectives on the
 *                             communication thread during backward, for
 *                             each unfused case of "zero": the weights and
 *                             losses of the same run without the thread
 *                             (its communicator wrapped in a table that
 *                             does not take calls from other threads), bit
 *                             for bit; each rank's peaks its estimate's
 *   train_mpi_test killover   as killmid, at stage 1 with the thread
 *                             (MPI_THREAD_SERIALIZED; killover2: stage 2),
 *                             rank 0 stops with
 *                             MT_ERR_COMM within the timeout wherever it
 *                             was (the thread's reduce-scatters among them)
 *   train_mpi_test threadfail (MPI serialized) stages 0 to 3 with the
 *                             communication thread: rank 1's thread fails
 *                             after the first collective of its second step
 *                             (a failure of that rank alone): rank 1 returns
 *                             its own status, every other rank at once
 *                             MT_ERR_COMM naming rank 1 (not at the 60 s
 *                             deadline), the communicator stays whole, and
 *                             the next step runs on every rank
 *   train_mpi_test overflow   fp16 at stages 0, 1 and 2: rank 1's input
 *                             overflows, so every rank skips the step and
 *                             keeps its weights
 *   train_mpi_test alone      at stages 0, 1 and 2, rank 0 alone evaluates
 *                             between two steps (and at stage 0 saves): it
 *                             returns at once, and the next steps give every
 *                             rank the weights of a run without it
 *   train_mpi_test local      local SGD (every 2 steps): after 2 steps every
 *                             rank holds the mean of what each rank computes
 *                             alone on its rows
 *   train_mpi_test tp         tensor parallel: a GPT of 6 heads in tensor
 *                             groups of N ranks (4 ranks: 2 groups of 2),
 *                             AdamW with clipping in fp32 and bf16 (and fp32
 *                             with sequence parallel), against
 *                             this process alone over all the rows; each
 *                             rank's peaks equal its estimate
 *   train_mpi_test offload    ZeRO stages 0 to 3 with the optimizer state
 *                             on disk (each rank its part's; at 1 to 3 also
 *                             with the weights on disk): the resident
 *                             run's losses, weights and training-state file
 *                             bit for bit; the file loads into an offloaded
 *                             trainer and saves the same bytes again; each
 *                             rank's peaks (device, disk) equal its estimate
 *
 * Prints "ok <what>" on rank 0 when it passes.
 */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "comm/overlap.h" /* (mti_overlap_fault: the test hook) */
#include "memtrain/mpi.h"

#define T 8
#define STEPS 3
#define ROWS 2

static int rank, size, failed;
static int freeze_rank = -1; /* this rank freezes "wte" */

#define EXPECT(c)                                                                               \
    do {                                                                                        \
        if (!(c)) {                                                                             \
            fprintf(stderr, "rank %d: %s:%d: failed: %s\n", rank, __FILE__, __LINE__, #c);      \
            failed = 1;                                                                         \
        }                                                                                       \
    } while (0)

static void rows(int step, int r0, int n, int32_t *tok, int32_t *tgt)
{
    for (int r = 0; r < n; r++)
        for (int j = 0; j < T; j++) {
            tok[r * T + j] = ((r0 + r) * 7 + j * 3 + step * 11) % 50;
            tgt[r * T + j] = ((r0 + r) * 5 + j * 13 + step * 3 + 1) % 50;
        }
}

/* A trainer configuration of the "zero" mode, at every stage. */
typedef struct zcase {
    const char *name;
    mt_optimizer_kind opt;
    mt_precision prec;
    float clip;
    int fused;
} zcase;

static const zcase zcases[] = {
    {"adamw bf16 clip", MT_OPT_ADAMW, MT_PREC_BF16, 0.5f, 0},
    {"adamw8 fp16", MT_OPT_ADAMW8, MT_PREC_FP16, 0.0f, 0},
    {"adafactor fp32", MT_OPT_ADAFACTOR, MT_PREC_FP32, 0.0f, 0},
    {"adamw fp32 fused clip", MT_OPT_ADAMW, MT_PREC_FP32, 0.5f, 1},
};

/* How train() runs: local SGD every `local` steps (0: off); `alone`: this
 * rank's rows without a communicator; `steps` (0: STEPS); `zc` (NULL:
 * SGD with momentum in fp32) at ZeRO stage `stage` (with a communicator);
 * `kill`: the stalling rank is killed instead. `step_s` gets how long the
 * last step that ran took. */
typedef struct how {
    int local, alone, steps;
    const zcase *zc;
    int stage, kill; /* kill: 1 before its second step, 2 half way through it */
    int lone;       /* rank 0 alone evaluates (and at stage 0 saves) after step 0 */
    double step_s;  /* out: the last step's seconds */
    double lone_s;  /* out: the seconds rank 0's lone calls took */
    const char *offload; /* the state on disk in this directory (NULL: resident) */
    int params;          /* ... and the weights (offload_params) */
    const char *save;    /* a training-state file saved after the steps */
    const char *load;    /* ... loaded before them */
    int z3set, prefetch, keep; /* z3set: zero3_prefetch and zero3_keep these (else defaults) */
    int fail;            /* rank 1's communication thread fails in step 1, the run goes on */
    mt_status fail_st;   /* out: step 1's status, its message, whether the communicator broke */
    char fail_msg[512];
    int fail_broken;
} how;

/* fail: the thread's entries left before one fails (rank 1, step 1) */
static _Atomic int fail_left;

static mt_status fail_entry(const mt_context *ctx, uint64_t entry)
{
    (void)ctx, (void)entry;
    return atomic_load(&fail_left) > 0 && atomic_fetch_sub(&fail_left, 1) == 1 ? MT_ERR_OOM : MT_OK;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A one-thread CPU context on comm (NULL: alone), the GPT g (NULL: the
 * MLP ms) on it and its trainer; what was made is set even on failure. */
static mt_status open_trainer(mt_comm *comm, const mt_gpt_spec *g, const mt_mlp_spec *ms,
                              const mt_trainer_config *tc, mt_context **ctx, mt_model **m,
                              mt_trainer **t)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.comm = comm;
    *ctx = NULL, *m = NULL, *t = NULL;
    mt_status s = mt_context_create(&cc, ctx);
    if (!s) s = g ? mt_model_gpt_create(*ctx, g, m) : mt_model_mlp_create(*ctx, ms, m);
    if (!s) s = mt_trainer_create(*m, tc, t);
    return s;
}

static void close_trainer(mt_context *ctx, mt_model *m, mt_trainer *t)
{
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

/* Whether this rank's per-class peaks equal its estimate (made without
 * communicating, for the communicator's world size and rank), to the
 * byte; else msg says the first that differs. */
static bool estimate_matches(mt_context *ctx, mt_model *m, const mt_trainer_config *tc, char *msg,
                             size_t cap)
{
    mt_estimate_report e;
    mt_memory_stats ms;
    if (mt_estimate_model(m, tc, &e) || mt_context_memory_stats(ctx, &ms)) {
        snprintf(msg, cap, "estimate: %s", mt_last_error(ctx));
        return false;
    }
    for (int k = 0; k < MT_MEM_COUNT; k++)
        if (e.class_peak[k] != ms.per_class[k].peak_live_bytes) {
            snprintf(msg, cap, "%s peak %llu, estimate %llu", mt_mem_class_name((mt_mem_class)k),
                     (unsigned long long)ms.per_class[k].peak_live_bytes,
                     (unsigned long long)e.class_peak[k]);
            return false;
        }
    return e.peak == ms.peak_live_bytes;
}

/* Kills this process after half of *(double *)arg seconds. */
static void *kill_later(void *arg)
{
    double half = *(const double *)arg / 2;
    struct timespec ts = {(time_t)half, (long)((half - (double)(time_t)half) * 1e9)};
    nanosleep(&ts, NULL);
    kill(getpid(), SIGKILL);
    return NULL;
}

/* Whether this rank's bytes on disk (its part of the offloaded state) are
 * its estimate's, per class, and some. */
static bool disk_matches(mt_context *ctx, mt_model *m, const mt_trainer_config *tc)
{
    mt_estimate_report e;
    mt_memory_stats disk;
    if (mt_estimate_model(m, tc, &e) || mt_context_place_stats(ctx, MT_PLACE_DISK, &disk))
        return false;
    bool ok = disk.peak_live_bytes == e.place_peak[MT_PLACE_DISK] && disk.peak_live_bytes > 0;
    for (int k = 0; k < MT_MEM_COUNT; k++)
        ok = ok && disk.per_class[k].peak_live_bytes == e.place_class_peak[MT_PLACE_DISK][k];
    if (!ok) fprintf(stderr, "rank %d: disk peak %llu, estimate %llu\n", rank,
                     (unsigned long long)disk.peak_live_bytes,
                     (unsigned long long)e.place_peak[MT_PLACE_DISK]);
    return ok;
}

static bool same_file(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    bool same = fa && fb;
    for (int x = 0, y = 0; same && (x != EOF || y != EOF);) {
        x = fgetc(fa), y = fgetc(fb);
        same = x == y;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

/* What a rank may do alone: evaluate (its own rows, no communication)
 * and, at stage 0, save (every rank holds the whole state). */
static mt_status lone_calls(mt_trainer *t, const mt_batch *b, how *hw)
{
    double t0 = now_s();
    float l;
    mt_status s = mt_trainer_eval(t, b, &l, NULL);
    if (!s && hw->stage == 0) {
        char path[] = "/tmp/mt_lone_save_XXXXXX";
        int fd = mkstemp(path);
        if (fd < 0) return MT_ERR_IO;
        close(fd);
        s = mt_trainer_save(t, path, NULL, 0);
        unlink(path);
    }
    hw->lone_s = now_s() - t0;
    return s;
}

/* Trains STEPS steps; with comm, on this rank's rows; without, on all. */
static mt_status train_how(mt_comm *comm, int channels, int stall_rank, how *hw, float *loss,
                           float **w, size_t *nw, char *msg, size_t cap)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = T, g.layers = 2, g.heads = 2;
    g.channels = channels, g.seed = 7;
    const int n = comm || hw->alone ? ROWS : ROWS * size;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.optimizer = MT_OPT_SGD;
    tc.momentum = 0.9f;
    tc.lr = 0.05f;
    tc.grad_clip = 1.0f;
    tc.max_batch = n;
    tc.micro_batch = ROWS;
    static const char *const frozen[] = {"wte"};
    if (rank == freeze_rank) tc.freeze = frozen, tc.n_freeze = 1;
    tc.local_sgd_every = hw->local;
    if (hw->zc) {
        tc.optimizer = hw->zc->opt;
        tc.precision = hw->zc->prec;
        tc.momentum = 0.0f;
        tc.lr = 0.01f;
        tc.weight_decay = 0.01f;
        tc.grad_clip = hw->zc->clip;
        tc.min_8bit_size = 256; /* so the small tensors get 8-bit state too */
        tc.adafactor.relative_step = 0;
        tc.loss_scale.init_scale = 1024.0f;
        tc.fused_step = hw->zc->fused;
        if (tc.fused_step) tc.micro_batch = n; /* alone: the whole batch at once */
        tc.zero_stage = comm ? hw->stage : 0;
        if (hw->z3set) tc.zero3_prefetch = hw->prefetch, tc.zero3_keep = hw->keep;
    }
    if (hw->offload) tc.offload = MT_PLACE_DISK, tc.offload_dir = hw->offload;
    tc.offload_params = hw->offload && hw->params;
    mt_context *ctx;
    mt_model *m;
    mt_trainer *t;
    mt_status s = open_trainer(comm, &g, NULL, &tc, &ctx, &m, &t);
    if (!s && hw->load) s = mt_trainer_load(t, hw->load, NULL, 0, NULL);
    int32_t tok[64 * T], tgt[64 * T];
    for (int step = 0; step < (hw->steps ? hw->steps : STEPS) && !s; step++) {
        if (step == 1 && rank == stall_rank) {
            if (hw->kill == 1) raise(SIGKILL);
            pthread_t th;
            if (hw->kill == 2 && !pthread_create(&th, NULL, kill_later, &hw->step_s))
                pthread_detach(th);
            if (!hw->kill) sleep(5); /* past the others' 1 s timeout */
        }
        rows(step, comm || hw->alone ? rank * ROWS : 0, n, tok, tgt);
        mt_batch b = {.n = n, .tokens = tok, .targets = tgt, .seq_len = T};
        if (hw->fail && step == 1 && rank == 1) atomic_store(&fail_left, 1);
        double t0 = now_s();
        s = mt_trainer_step(t, &b, &loss[step]);
        hw->step_s = now_s() - t0;
        if (hw->fail && step == 1) { /* (it failed: the next step must run) */
            hw->fail_st = s;
            snprintf(hw->fail_msg, sizeof hw->fail_msg, "%s", mt_last_error(ctx));
            hw->fail_broken = mt_comm_broken(comm);
            s = MT_OK;
        }
        if (!s && step == 0 && hw->lone && rank == 0) s = lone_calls(t, &b, hw);
    }
    if (!s && hw->offload && !hw->load && !disk_matches(ctx, m, &tc)) failed = 1;
    if (!s && hw->save) s = mt_trainer_save(t, hw->save, NULL, 0);
    if (!s && hw->zc && comm && !hw->load && !estimate_matches(ctx, m, &tc, msg, cap)) {
        fprintf(stderr, "rank %d: %s, stage %d: %s\n", rank, hw->zc->name, hw->stage, msg);
        failed = 1;
    }
    if (s) snprintf(msg, cap, "%s", mt_last_error(ctx ? ctx : NULL));
    if (hw->stage == 3 && comm) { /* (its destroy gathers the weights back into the model) */
        mt_trainer_destroy(t);
        t = NULL;
    }
    if (!s) {
        *nw = mt_model_num_params(m);
        *w = malloc(*nw * sizeof(float));
        s = mt_model_get_params(m, *w, *nw);
    }
    close_trainer(ctx, m, t);
    return s;
}

static mt_status train(mt_comm *comm, int channels, int stall_rank, float *loss, float **w,
                       size_t *nw, char *msg, size_t cap)
{
    how plain = {0};
    return train_how(comm, channels, stall_rank, &plain, loss, w, nw, msg, cap);
}

/* The largest difference of a and b relative to 1 + |b|. */
static double worst_rel(const float *a, const float *b, size_t n)
{
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]) / (fabs(b[i]) + 1.0);
        if (d > worst) worst = d;
    }
    return worst;
}

/* Every rank holds rank 0's weights, bit for bit. */
static void same_on_every_rank(const float *w, size_t nw)
{
    float *w0 = malloc(nw * sizeof *w0);
    memcpy(w0, w, nw * sizeof *w0);
    MPI_Bcast(w0, (int)nw, MPI_FLOAT, 0, MPI_COMM_WORLD);
    EXPECT(!memcmp(w0, w, nw * sizeof *w0));
    free(w0);
}

/* Whether every rank passed, told on every rank. */
static int all_passed(void)
{
    int bad = failed;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    failed = bad;
    return !bad;
}

/* Tensor parallel over MPI: a GPT of 6 heads in tensor groups of `tp`
 * ranks (size / tp data-parallel groups of ROWS rows each), STEPS steps of
 * AdamW with clipping, in fp32 and bf16, against this process alone over
 * all the rows: the losses (fp32 1e-5, bf16 3e-2 relative), the weights
 * after the trainer equal on every rank, and each rank's peaks its
 * estimate's. */
static mt_status tp_run(mt_comm *comm, int tp, mt_precision prec, int sp, float *loss, float **w,
                        size_t *nw, char *msg, size_t cap)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = T, g.layers = 2, g.heads = 6;
    g.channels = 24, g.seed = 7;
    const int groups = comm ? size / tp : 1, group = comm ? rank / tp : 0;
    const int n = comm ? ROWS : ROWS * (size / tp);
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.optimizer = MT_OPT_ADAMW;
    tc.lr = 0.01f;
    tc.weight_decay = 0.01f;
    tc.grad_clip = 1.0f;
    tc.precision = prec;
    tc.max_batch = n;
    tc.tensor_parallel = comm ? tp : 1;
    tc.sequence_parallel = comm ? sp : 0;
    (void)groups;
    mt_context *ctx;
    mt_model *m;
    mt_trainer *t;
    mt_status s = open_trainer(comm, &g, NULL, &tc, &ctx, &m, &t);
    int32_t tok[ROWS * 8 * T], tgt[ROWS * 8 * T];
    for (int k = 0; k < STEPS && !s; k++) {
        rows(k, group * ROWS, n, tok, tgt);
        mt_batch b = {.n = n, .tokens = tok, .targets = tgt, .seq_len = T};
        s = mt_trainer_step(t, &b, &loss[k]);
    }
    if (!s && comm && !estimate_matches(ctx, m, &tc, msg, cap)) s = MT_ERR_INTERNAL;
    else if (s) snprintf(msg, cap, "%s", mt_last_error(ctx));
    mt_trainer_destroy(t); /* (the parts gathered back: every rank) */
    *nw = m ? mt_model_num_params(m) : 0;
    *w = malloc(*nw * sizeof **w + 1);
    if (!s && mt_model_get_params(m, *w, *nw)) s = MT_ERR_INTERNAL;
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return s;
}

static void tensor_parallel(mt_comm *c)
{
    const int tp = size == 4 ? 2 : size; /* 4 ranks: 2 groups of 2 */
    const mt_precision precs[3] = {MT_PREC_FP32, MT_PREC_BF16, MT_PREC_FP32};
    char msg[1024] = "";
    /* the last with sequence parallel, where a group's rows split evenly */
    for (int k = 0; k < ((ROWS * T) % tp ? 2 : 3); k++) {
        float loss[STEPS], ref_loss[STEPS];
        float *w = NULL, *ref = NULL;
        size_t nw = 0, nref = 0;
        mt_status s = tp_run(c, tp, precs[k], k == 2, loss, &w, &nw, msg, sizeof msg);
        EXPECT(s == MT_OK);
        if (s) fprintf(stderr, "rank %d: %s\n", rank, msg);
        EXPECT(tp_run(NULL, tp, precs[k], 0, ref_loss, &ref, &nref, msg, sizeof msg) == MT_OK);
        const double tol = k == 1 ? 3e-2 : 1e-5;
        for (int j = 0; j < STEPS && !s; j++)
            EXPECT(fabs(loss[j] - ref_loss[j]) <= tol * fabs(ref_loss[j]));
        if (w && !s) same_on_every_rank(w, nw);
        free(w);
        free(ref);
    }
    if (all_passed() && rank == 0)
        printf("ok tp: %d ranks in tensor groups of %d, fp32 and bf16%s: one process's losses, "
               "each rank's peaks its estimate's\n", size, tp,
               (ROWS * T) % tp ? "" : ", and fp32 with sequence parallel");
}

/* x rounded to the nearest 16-bit value of dtype p (ties to even). */
static float as_16(float x, mt_precision p)
{
    if (p == MT_PREC_FP16) return (float)(_Float16)x;
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

/* Each case of zcases at stages 0, 1 and 2 against one process
 * accumulating the ranks' rows as micro-batches: the weights within 1e-4
 * (relative to 1 + |w|: Adafactor's sums, and with 3 ranks MPI's, run in
 * another order) and the losses within 1e-5. Stages 1 and 2 shard the
 * fp32 masters, so their model reads back the 16-bit compute copy: the
 * reference is rounded to it. */
static void zero_stages(mt_comm *c)
{
    const double tol = 1e-4, ltol = 1e-5;
    double worst_all = 0.0;
    for (size_t k = 0; k < sizeof zcases / sizeof zcases[0]; k++) {
        how alone = {.zc = &zcases[k]};
        float ref_loss[STEPS], loss[STEPS];
        float *ref = NULL;
        size_t nref = 0;
        char msg[1024] = "";
        mt_status s = train_how(NULL, 16, -1, &alone, ref_loss, &ref, &nref, msg, sizeof msg);
        EXPECT(s == MT_OK);
        if (s) fprintf(stderr, "rank %d: %s alone: %s\n", rank, zcases[k].name, msg);
        for (int stage = 0; stage <= 2; stage++) {
            how hw = {.zc = &zcases[k], .stage = stage};
            float *w = NULL;
            size_t nw = 0;
            s = train_how(c, 16, -1, &hw, loss, &w, &nw, msg, sizeof msg);
            EXPECT(s == MT_OK);
            if (s) fprintf(stderr, "rank %d: %s, stage %d: %s\n", rank, zcases[k].name, stage, msg);
            if (!w || !ref || nw != nref) {
                failed = 1;
                free(w);
                continue;
            }
            float *want = malloc(nw * sizeof *want);
            for (size_t i = 0; i < nw; i++)
                want[i] = stage && zcases[k].prec != MT_PREC_FP32 ? as_16(ref[i], zcases[k].prec)
                                                                 : ref[i];
            double worst = worst_rel(w, want, nw), lworst = 0.0;
            free(want);
            for (int i = 0; i < STEPS; i++) {
                double d = fabs((double)loss[i] - ref_loss[i]);
                if (d > lworst) lworst = d;
            }
            if (worst >= tol || lworst >= ltol)
                fprintf(stderr, "rank %d: %s, stage %d: weights differ from one process's by "
                        "%.2e, losses by %.2e\n", rank, zcases[k].name, stage, worst, lworst);
            EXPECT(worst < tol && lworst < ltol);
            if (worst > worst_all) worst_all = worst;
            if (lworst > worst_all) worst_all = lworst;
            same_on_every_rank(w, nw);
            free(w);
        }
        free(ref);
    }
    if (all_passed() && rank == 0)
        printf("ok zero: %d ranks at ZeRO stages 0, 1 and 2, AdamW bf16 with clipping, 8-bit "
               "AdamW fp16 with loss scaling, Adafactor fp32, the fused step: each equals one "
               "process accumulating (within %.1e), each rank's peaks its estimate\n", size,
               worst_all);
}

/* Stage 3 with its gathers on each rank's communication thread, at
 * several prefetch depths and keep settings: stage 2's bits (the same
 * reduce-scatters and updates), losses and weights, on every rank. */
static void zero3_prefetch(mt_comm *c)
{
    static const int v[][2] = {{0, 0}, {1, 0}, {2, 1}, {1, -1}};
    for (size_t k = 0; k < sizeof zcases / sizeof zcases[0]; k++) {
        how h2 = {.zc = &zcases[k], .stage = 2};
        float l2[STEPS], l3[STEPS];
        float *w2 = NULL;
        size_t n2 = 0;
        char msg[1024] = "";
        mt_status s = train_how(c, 16, -1, &h2, l2, &w2, &n2, msg, sizeof msg);
        EXPECT(s == MT_OK);
        for (size_t j = 0; j < sizeof v / sizeof v[0] && !s; j++) {
            how h3 = {.zc = &zcases[k], .stage = 3, .z3set = 1, .prefetch = v[j][0], .keep = v[j][1]};
            float *w3 = NULL;
            size_t n3 = 0;
            s = train_how(c, 16, -1, &h3, l3, &w3, &n3, msg, sizeof msg);
            EXPECT(s == MT_OK);
            if (s) fprintf(stderr, "rank %d: %s, prefetch %d keep %d: %s\n", rank, zcases[k].name,
                           v[j][0], v[j][1], msg);
            const bool same = w3 && n3 == n2 && !memcmp(w3, w2, n2 * sizeof *w2) &&
                              !memcmp(l3, l2, sizeof l2);
            if (!s && !same)
                fprintf(stderr, "rank %d: %s, prefetch %d keep %d: not stage 2's bits\n", rank,
                        zcases[k].name, v[j][0], v[j][1]);
            EXPECT(s || same);
            free(w3);
        }
        free(w2);
    }
    if (all_passed() && rank == 0)
        printf("ok zero3: %d ranks at ZeRO stage 3, the gathers on a thread at prefetch 0 to 2, "
               "keeping none, the last or every layer: stage 2's losses and weights bit for bit in "
               "every case of zero, each rank's peaks its estimate\n", size);
}

/* fp16 on an MLP of features: rank 1's input is beyond fp16, so its
 * gradients are not finite; at every stage every rank skips the step and
 * keeps its weights. */
static void overflow(mt_comm *c)
{
    for (int stage = 0; stage <= 2; stage++) {
        mt_mlp_spec ms;
        mt_mlp_spec_init(&ms);
        ms.n_layers = 2;
        ms.dims[0] = 4, ms.dims[1] = 8, ms.dims[2] = 3;
        ms.seed = 3;
        mt_trainer_config tc;
        mt_trainer_config_init(&tc);
        tc.max_batch = 2;
        tc.precision = MT_PREC_FP16;
        tc.optimizer = MT_OPT_ADAMW;
        tc.zero_stage = stage;
        mt_context *ctx;
        mt_model *m;
        mt_trainer *t;
        mt_status s = open_trainer(c, NULL, &ms, &tc, &ctx, &m, &t);
        enum { NP = 4 * 8 + 8 + 8 * 3 + 3 };
        float before[NP], after[NP], x[8] = {1, 2, 3, 4, 4, 3, 2, 1}, loss;
        int32_t y[2] = {0, 2};
        if (rank == 1) x[5] = 1e30f;
        mt_batch b = {.n = 2, .inputs = x, .targets = y};
        mt_loss_scale_state ls = {0};
        if (!s) s = mt_model_get_params(m, before, NP);
        if (!s) s = mt_trainer_step(t, &b, &loss);
        if (!s) s = mt_trainer_get_loss_scale(t, &ls);
        if (!s) s = mt_model_get_params(m, after, NP);
        if (s) fprintf(stderr, "rank %d, stage %d: %s\n", rank, stage, mt_last_error(ctx));
        EXPECT(s == MT_OK);
        EXPECT(ls.steps_skipped == 1);
        EXPECT(!memcmp(before, after, sizeof before));
        close_trainer(ctx, m, t);
    }
    if (all_passed() && rank == 0)
        printf("ok overflow: fp16, rank 1's input overflows: at stages 0, 1 and 2 all %d ranks "
               "skipped the step and kept their weights\n", size);
}

/* Rank 0's lone evaluation (and save) at each stage: quick, and the run
 * goes on to the weights of the same run without it, bit for bit. */
static void lone(mt_comm *c)
{
    double worst_s = 0.0;
    for (int stage = 0; stage <= 2; stage++) {
        how with = {.zc = &zcases[0], .stage = stage, .lone = 1}, without = with;
        without.lone = 0;
        float loss[STEPS], ref_loss[STEPS];
        float *w = NULL, *ref = NULL;
        size_t nw = 0, nref = 0;
        char msg[1024] = "";
        mt_status s = train_how(c, 16, -1, &with, loss, &w, &nw, msg, sizeof msg);
        if (s) fprintf(stderr, "rank %d, stage %d: %s\n", rank, stage, msg);
        EXPECT(s == MT_OK);
        EXPECT(train_how(c, 16, -1, &without, ref_loss, &ref, &nref, msg, sizeof msg) == MT_OK);
        EXPECT(w && ref && nw == nref && !memcmp(w, ref, nw * sizeof *w));
        EXPECT(!memcmp(loss, ref_loss, sizeof loss));
        EXPECT(with.lone_s < 5.0); /* a collective would wait for the 60 s deadline */
        if (with.lone_s > worst_s) worst_s = with.lone_s;
        free(w);
        free(ref);
    }
    if (all_passed() && rank == 0)
        printf("ok alone: rank 0 evaluated (and at stage 0 saved) alone between steps at stages "
               "0, 1 and 2 in %.3f s at most; the %d ranks then trained to the same bits as "
               "without it\n", worst_s, size);
}

/* Local SGD: 2 steps apart, then the average; against each rank alone. */
static void local_sgd(mt_comm *c)
{
    how ls = {.local = 2, .steps = 2}, alone = {.alone = 1, .steps = 2};
    float loss[STEPS], ref_loss[STEPS];
    float *w = NULL, *ref = NULL;
    size_t nw = 0, nref = 0;
    char msg[1024] = "";
    mt_status s = train_how(c, 16, -1, &ls, loss, &w, &nw, msg, sizeof msg);
    EXPECT(s == MT_OK);
    if (s) fprintf(stderr, "rank %d: %s\n", rank, msg);
    EXPECT(train_how(NULL, 16, -1, &alone, ref_loss, &ref, &nref, msg, sizeof msg) == MT_OK);
    if (!w || !ref || nw != nref) {
        failed = 1;
        return;
    }
    /* each rank's losses are its rows' own; the weights are the mean of the
       ranks alone: summed in rank order, times 1/N */
    for (int k = 0; k < 2; k++) EXPECT(loss[k] == ref_loss[k]);
    float *all = malloc(nw * (size_t)size * sizeof *all);
    MPI_Allgather(ref, (int)nw, MPI_FLOAT, all, (int)nw, MPI_FLOAT, MPI_COMM_WORLD);
    double worst = 0.0;
    size_t differ = 0;
    for (size_t i = 0; i < nw; i++) {
        float sum = 0.0f;
        for (int r = 0; r < size; r++) sum += all[(size_t)r * nw + i];
        const float want = sum * (1.0f / (float)size);
        differ += w[i] != want;
        double d = fabs((double)w[i] - want) / (fabs(want) + 1.0);
        if (d > worst) worst = d;
    }
    /* two ranks: a sum of two is the same bits in any order; with more, MPI
       chooses the order */
    EXPECT(size == 2 ? differ == 0 : worst < 1e-6);
    float *w0 = malloc(nw * sizeof *w0);
    memcpy(w0, w, nw * sizeof *w0);
    MPI_Bcast(w0, (int)nw, MPI_FLOAT, 0, MPI_COMM_WORLD);
    EXPECT(!memcmp(w0, w, nw * sizeof *w0)); /* and the ranks agree, bit for bit */
    int bad = failed;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0 && !bad)
        printf("ok local: %d ranks, local SGD every 2 steps: the weights are the mean of the "
               "ranks alone (%zu of %zu differ, by %.1e at most)\n",
               size, differ, nw, worst);
    failed = bad;
    free(all);
    free(w0);
    free(w);
    free(ref);
}

/* ZeRO 0, 1 and 2 (AdamW in fp32, clipping) with the state on disk
 * against the same ranks resident. */
static void offload(mt_comm *c)
{
    static const zcase zc = {"adamw fp32 clip", MT_OPT_ADAMW, MT_PREC_FP32, 0.5f, 0};
    char dir[64], f0[96], f1[96], f2[96], msg[1024] = "";
    snprintf(dir, sizeof dir, "/tmp/mt_mpi_off_%d", (int)getppid());
    if (rank == 0) mkdir(dir, 0700);
    MPI_Barrier(MPI_COMM_WORLD);
    snprintf(f0, sizeof f0, "%s/resident.mtt", dir);
    snprintf(f1, sizeof f1, "%s/offloaded.mtt", dir);
    snprintf(f2, sizeof f2, "%s/again.mtt", dir);
    for (int k = 0; k < 7 && !failed; k++) { /* stages 0 to 3, then 1 to 3 with the weights on disk */
        const int stage = k < 4 ? k : k - 3, params = k >= 4;
        how res = {.zc = &zc, .stage = stage, .save = f0};
        how off = {.zc = &zc, .stage = stage, .offload = dir, .params = params, .save = f1};
        how again = {.zc = &zc, .stage = stage, .offload = dir, .params = params, .load = f1, .steps = 1,
                     .save = f2};
        how again_res = {.zc = &zc, .stage = stage, .load = f0, .steps = 1, .save = f0};
        float l0[STEPS], l1[STEPS];
        float *w0 = NULL, *w1 = NULL;
        size_t n0 = 0, n1 = 0;
        mt_status s = train_how(c, 16, -1, &res, l0, &w0, &n0, msg, sizeof msg);
        if (!s) s = train_how(c, 16, -1, &off, l1, &w1, &n1, msg, sizeof msg);
        EXPECT(s == MT_OK);
        if (s) fprintf(stderr, "rank %d: stage %d: %s\n", rank, stage, msg);
        EXPECT(w0 && w1 && n0 == n1 && !memcmp(w0, w1, n0 * sizeof *w0));
        EXPECT(!memcmp(l0, l1, sizeof l0));
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) EXPECT(same_file(f0, f1));
        /* a step more from each file: the same bytes again */
        free(w0), free(w1), w0 = w1 = NULL;
        s = train_how(c, 16, -1, &again, l1, &w1, &n1, msg, sizeof msg);
        if (!s) s = train_how(c, 16, -1, &again_res, l0, &w0, &n0, msg, sizeof msg);
        EXPECT(s == MT_OK);
        if (s) fprintf(stderr, "rank %d: stage %d, loaded: %s\n", rank, stage, msg);
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) EXPECT(same_file(f0, f2));
        free(w0), free(w1);
        int bad = failed;
        MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        failed = bad;
        MPI_Barrier(MPI_COMM_WORLD);
    }
    if (rank == 0) {
        unlink(f0), unlink(f1), unlink(f2);
        EXPECT(rmdir(dir) == 0); /* no rank's scratch directory is left */
        if (!failed)
            printf("ok offload: %d ranks, ZeRO 0 to 3 with the state on disk (1 to 3 with "
                   "the weights too): the resident run's losses, weights and files, bit for "
                   "bit; each rank's peaks, device and disk, its estimate's\n",
                   size);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

/* A table forwarding to another communicator, without
 * MT_COMM_CAP_THREADS: the same MPI collectives, none on a thread. */
static mt_status fw_all_reduce(void *self, const void *send, void *recv, size_t count,
                               mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    return mt_comm_all_reduce(self, send, recv, count, dt, op, stream);
}
static mt_status fw_reduce_scatter(void *self, const void *send, void *recv, size_t count,
                                   mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    return mt_comm_reduce_scatter(self, send, recv, count, dt, op, stream);
}
static mt_status fw_all_gather(void *self, const void *send, void *recv, size_t count,
                               mt_comm_dtype dt, void *stream)
{
    return mt_comm_all_gather(self, send, recv, count, dt, stream);
}
static mt_status fw_broadcast(void *self, void *buf, size_t count, mt_comm_dtype dt, int root,
                              void *stream)
{
    return mt_comm_broadcast(self, buf, count, dt, root, stream);
}
static mt_status fw_barrier(void *self) { return mt_comm_barrier(self); }

/* Stages 0 to 2, each case of zcases (the fused step's too: its
 * reductions on the thread, each update once its reduction is done), with
 * the communication thread (c takes calls from any thread) and without (a
 * table forwarding to c without saying so): the same bits. */
static void overlap(mt_comm *c)
{
    const mt_comm_vtable vt = {.abi_version = MT_COMM_ABI_VERSION, .struct_size = sizeof vt,
                               .name = "forward", .all_reduce = fw_all_reduce,
                               .reduce_scatter = fw_reduce_scatter, .all_gather = fw_all_gather,
                               .broadcast = fw_broadcast, .barrier = fw_barrier};
    mt_comm *plain = NULL;
    EXPECT(mt_comm_create(&vt, c, rank, size, &plain) == MT_OK);
    int runs = 0;
    for (size_t k = 0; k < sizeof zcases / sizeof zcases[0] && plain; k++) {
        for (int stage = 0; stage <= 2; stage++) {
            float loss[2][STEPS];
            float *w[2] = {NULL, NULL};
            size_t nw[2] = {0, 0};
            char msg[1024] = "";
            for (int o = 0; o < 2; o++) {
                how hw = {.zc = &zcases[k], .stage = stage};
                mt_status s = train_how(o ? c : plain, 16, -1, &hw, loss[o], &w[o], &nw[o], msg,
                                        sizeof msg);
                EXPECT(s == MT_OK);
                if (s) fprintf(stderr, "rank %d: %s, stage %d, thread %d: %s\n", rank,
                               zcases[k].name, stage, o, msg);
            }
            EXPECT(w[0] && w[1] && nw[0] == nw[1] && !memcmp(w[0], w[1], nw[0] * sizeof(float)));
            EXPECT(!memcmp(loss[0], loss[1], sizeof loss[0]));
            if (failed) fprintf(stderr, "rank %d: %s, stage %d: the thread changed the bits\n", rank,
                                zcases[k].name, stage);
            free(w[0]), free(w[1]);
            runs++;
        }
    }
    mt_comm_destroy(plain);
    if (all_passed() && rank == 0)
        printf("ok overlap: %d ranks, stages 0 to 2, %d runs with the gradients' collectives on "
               "the communication thread (the fused step's too): the bits of the runs without "
               "it, each rank's peaks its estimate\n", size, runs);
}

/* A failure of rank 1 alone on its communication thread, at stages 0 to 3. */
static void thread_failure(mt_comm *c)
{
    mti_overlap_fault = fail_entry;
    for (int stage = 0; stage <= 3; stage++) {
        how hw = {.zc = &zcases[0], .stage = stage, .fail = 1};
        float loss[STEPS];
        float *w = NULL;
        size_t nw = 0;
        char msg[1024] = "";
        mt_status s = train_how(c, 16, -1, &hw, loss, &w, &nw, msg, sizeof msg);
        EXPECT(s == MT_OK); /* (the steps after the failed one) */
        if (rank == 1) EXPECT(hw.fail_st == MT_ERR_OOM && strstr(hw.fail_msg, "injected"));
        else EXPECT(hw.fail_st == MT_ERR_COMM && strstr(hw.fail_msg, "rank 1 failed (out of memory)"));
        EXPECT(!hw.fail_broken);
        if (failed)
            fprintf(stderr, "rank %d, stage %d: %s; the failed step: %s: %s\n", rank, stage, msg,
                    mt_status_string(hw.fail_st), hw.fail_msg);
        free(w);
    }
    mti_overlap_fault = NULL;
    if (all_passed() && rank == 0)
        printf("ok threadfail: %d ranks, stages 0 to 3: rank 1's thread failed, every other rank "
               "stopped that step at once naming it, the communicator whole, the next step ran\n",
               size);
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "train";
    /* the communication thread's modes (the gradients' collectives, stage
       3's gathers): serialized */
    const bool serialized = !strcmp(mode, "overlap") || !strncmp(mode, "killover", 8) ||
                            !strcmp(mode, "zero3") || !strcmp(mode, "killmid3") ||
                            !strcmp(mode, "threadfail");
    if (serialized) {
        int level = MPI_THREAD_SINGLE;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &level);
        if (level < MPI_THREAD_SERIALIZED) {
            fprintf(stderr, "MPI gives thread level %d, not MPI_THREAD_SERIALIZED\n", level);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    } else {
        MPI_Init(&argc, &argv);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    mt_comm *c = NULL;
    /* 1 s where a rank stalls on purpose; elsewhere a deadline that a
       loaded machine (sanitizers, more ranks than cores) never reaches */
    const bool short_deadline = !strcmp(mode, "stall") || !strncmp(mode, "kill", 4);
    if (mt_comm_mpi_create(MPI_COMM_WORLD, short_deadline ? 1.0 : 60.0, &c))
        MPI_Abort(MPI_COMM_WORLD, 1);
    float loss[STEPS], ref_loss[STEPS];
    float *w = NULL, *ref = NULL;
    size_t nw = 0, nref = 0;
    char msg[1024] = "";
    if (!strcmp(mode, "train")) {
        mt_status s = train(c, 16, -1, loss, &w, &nw, msg, sizeof msg);
        EXPECT(s == MT_OK);
        if (s) fprintf(stderr, "rank %d: %s\n", rank, msg);
        EXPECT(train(NULL, 16, -1, ref_loss, &ref, &nref, msg, sizeof msg) == MT_OK);
        double worst = w && ref && nw == nref ? worst_rel(w, ref, nw) : 1.0;
        EXPECT(worst < 1e-5);
        for (int k = 0; k < STEPS; k++) EXPECT(fabsf(loss[k] - ref_loss[k]) < 1e-5f);
        /* and every rank holds rank 0's weights, bit for bit */
        if (w) same_on_every_rank(w, nw);
        if (all_passed() && rank == 0)
            printf("ok train: %d ranks equal one process accumulating %d micro-batches (within %.1e)\n",
                   size, size, worst);
    } else if (!strcmp(mode, "disagree")) {
        mt_status s = train(c, rank == 1 ? 24 : 16, -1, loss, &w, &nw, msg, sizeof msg);
        EXPECT(s == MT_ERR_COMM);
        EXPECT(strstr(msg, "the ranks disagree on the model (layers and shapes): rank 0 #") != NULL);
        if (failed) fprintf(stderr, "rank %d: %s\n", rank, msg);
        freeze_rank = 1;
        s = train(c, 16, -1, loss, &w, &nw, msg, sizeof msg);
        freeze_rank = -1;
        EXPECT(s == MT_ERR_COMM);
        EXPECT(strstr(msg, "the ranks disagree on freeze: rank 0 (none), rank 1 wte") != NULL);
        if (failed) fprintf(stderr, "rank %d: %s\n", rank, msg);
        int bad = failed;
        MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0 && !bad) printf("ok disagree: every rank refused: %s\n", msg);
        failed = bad;
    } else if (!strcmp(mode, "offload")) {
        offload(c);
    } else if (!strcmp(mode, "local")) {
        local_sgd(c);
    } else if (!strcmp(mode, "stall")) {
        mt_status s = train(c, 16, 1, loss, &w, &nw, msg, sizeof msg);
        if (rank == 0) {
            EXPECT(s == MT_ERR_COMM);
            if (!failed) printf("ok stall: rank 0 stopped with MT_ERR_COMM: %s\n", msg);
            else fprintf(stderr, "rank 0: %s: %s\n", mt_status_string(s), msg);
            fflush(stdout);
            MPI_Abort(MPI_COMM_WORLD, failed);
        }
        sleep(30); /* rank 0 ends the job */
        return 1;
    } else if (!strcmp(mode, "overlap")) {
        overlap(c);
    } else if (!strcmp(mode, "kill") || !strcmp(mode, "killmid") || !strcmp(mode, "killmid3") ||
               !strncmp(mode, "killover", 8)) {
        /* killmid: up to 200 steps, so that the kill, half a step after the
           second began, falls inside some step of rank 1's */
        how hw = {.kill = 1};
        float losses[200];
        if (!strcmp(mode, "killmid"))
            hw = (how){.kill = 2, .zc = &zcases[0], .stage = 2, .steps = 200};
        if (!strncmp(mode, "killover", 8)) /* on the thread: MPI serialized, stage 1 or 2 */
            hw = (how){.kill = 2, .zc = &zcases[0], .stage = mode[8] == '2' ? 2 : 1, .steps = 200};
        if (!strcmp(mode, "killoverf")) /* the fused step's reductions on the thread, stage 0 */
            hw = (how){.kill = 2, .zc = &zcases[3], .stage = 0, .steps = 200};
        if (!strcmp(mode, "killmid3"))
            hw = (how){.kill = 2, .zc = &zcases[0], .stage = 3, .steps = 200};
        mt_status s = train_how(c, 16, 1, &hw, losses, &w, &nw, msg, sizeof msg);
        /* (rank 1 is gone) */
        EXPECT(s == MT_ERR_COMM);
        EXPECT(strstr(msg, "died") != NULL);
        EXPECT(hw.step_s < 1.0 + 2.0);
        EXPECT(mt_comm_broken(c));
        if (rank == 0 && !failed)
            printf("ok %s: rank 1 killed, rank 0 stopped with MT_ERR_COMM after %.1f s of its "
                   "step: %s\n", mode, hw.step_s, msg);
        else
            fprintf(stderr, "rank %d: %s after %.1f s: %s\n", rank, mt_status_string(s),
                    hw.step_s, msg);
        fflush(stdout);
        usleep(200000); /* for mpirun to forward the line before the abort */
        MPI_Abort(MPI_COMM_WORLD, failed); /* the documented way out */
    } else if (!strcmp(mode, "tp")) {
        tensor_parallel(c);
    } else if (!strcmp(mode, "zero")) {
        zero_stages(c);
    } else if (!strcmp(mode, "zero3")) {
        zero3_prefetch(c);
    } else if (!strcmp(mode, "threadfail")) {
        thread_failure(c);
    } else if (!strcmp(mode, "overflow")) {
        overflow(c);
    } else if (!strcmp(mode, "alone")) {
        lone(c);
    }
    free(w);
    free(ref);
    mt_comm_destroy(c);
    MPI_Finalize();
    return failed;
}
