/*
 * test_offload.c - optimizer state and master weights at home on disk
 * (cfg.offload = MT_PLACE_DISK, lib/train/offload.c): every optimizer and
 * precision trains to the resident run's bits, the estimate equals the run
 * per class and per place, scratch files never outlive their trainer (a
 * failure, a kill), and I/O faults give MT_ERR_IO with nothing else lost.
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "train/offload.h"
#include "test_comm.h"

enum { B = 2, T = 16, V = 256, STEPS = 3 };

static mt_model *gpt_of(mt_context *ctx, int channels, uint64_t seed)
{
    return check_small_gpt(ctx, V, T, channels, seed);
}

static mt_model *gpt(mt_context *ctx) { return gpt_of(ctx, 64, 11); }

/* The runs with the state on disk made from a deferred model (its weights
 * straight into their homes), against the resident runs' whole models. */
static int deferred_as;

static mt_model *gpt_deferred_of(mt_context *ctx, int layers)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = layers, g.heads = 4, g.channels = 64, g.seed = 11;
    g.deferred = 1;
    mt_model *m = NULL;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    return m;
}

static mt_model *gpt_deferred(mt_context *ctx) { return gpt_deferred_of(ctx, 2); }

typedef struct ocase {
    mt_optimizer_kind opt;
    mt_precision prec;
    int masters, fused;
    float clip;
} ocase;

/* offload_params with the disk (the weights there too), and the recompute
 * policy of every run (the parameters' order then has recomputed layers) */
static int params_too;
static mt_recompute_policy recompute_as = MT_RECOMPUTE_NONE;
static int freeze_some; /* the positions and block 0's weights frozen (resident) */

static void config(mt_trainer_config *tc, const ocase *c, mt_place place, const char *dir)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B;
    tc->optimizer = c->opt;
    tc->lr = c->opt == MT_OPT_SGD ? 0.05f : 2e-3f;
    tc->momentum = c->opt == MT_OPT_SGD ? 0.9f : 0.0f;
    tc->weight_decay = 0.01f;
    tc->precision = c->prec;
    tc->master_weights = c->masters;
    tc->fused_step = c->fused;
    tc->grad_clip = c->clip;
    tc->min_8bit_size = 256;
    tc->offload = place;
    tc->offload_dir = dir;
    tc->offload_params = place == MT_PLACE_DISK && params_too;
    tc->recompute = recompute_as;
    tc->recompute_every = 2;
    static const char *const frozen[] = {"wpe", "h.0.*"};
    if (freeze_some) tc->freeze = frozen, tc->n_freeze = 2;
}

static void batch(mt_batch *b, int32_t *tok, int32_t *tg, int step)
{
    check_token_batch(b, tok, tg, B, T, V, step);
}

/* A scratch parent directory for this test (removed by the caller). */
static const char *tmp_dir(void)
{
    char *d = check_alloc(64);
    snprintf(d, 64, "/tmp/mt_offload_%ld_XXXXXX", (long)getpid());
    CHECK(mkdtemp(d) != NULL);
    return d;
}

static bool scratch_gone(const char *dir)
{
    char p[512];
    snprintf(p, sizeof p, "%s/memtrain-scratch", dir);
    struct stat sb;
    return stat(p, &sb) != 0 && errno == ENOENT;
}

/* Whether dir holds nothing (no rank's scratch directory left). */
static bool dir_empty(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return false;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n == 0;
}

/* Trains STEPS steps; the weights (while the trainer lives, and after it)
 * and the losses come back. With check_est the measured peaks per class and
 * per place must equal the estimate to the byte. */
static void train(const ocase *c, mt_place place, const char *dir, float *w, float *w_after,
                  float *loss, bool check_est)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *m = deferred_as && place == MT_PLACE_DISK ? gpt_deferred(ctx) : gpt(ctx);
    mt_trainer_config tc;
    config(&tc, c, place, dir);
    mt_estimate_report est;
    CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int32_t tok[B * T], tg[B * T];
    for (int s = 0; s < STEPS; s++) {
        mt_batch b;
        batch(&b, tok, tg, s);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss[s]));
    }
    const size_t n = mt_model_num_params(m);
    if (check_est) {
        mt_memory_stats st, disk;
        CHECK_OK(mt_context_memory_stats(ctx, &st));
        CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_DISK, &disk));
        for (int k = 0; k < MT_MEM_COUNT; k++) {
            CHECK_MSG(st.per_class[k].peak_live_bytes == est.class_peak[k],
                      "%s %s: class %s peak %llu, estimate %llu", mt_place_name(place), mt_optimizer_name(c->opt),
                      mt_mem_class_name(k), (unsigned long long)st.per_class[k].peak_live_bytes,
                      (unsigned long long)est.class_peak[k]);
            CHECK_EQ(disk.per_class[k].peak_live_bytes, est.place_class_peak[MT_PLACE_DISK][k]);
            CHECK_EQ(est.place_class_peak[MT_PLACE_DEVICE][k], est.class_peak[k]);
        }
        CHECK_EQ(st.peak_live_bytes, est.peak);
        CHECK_EQ(disk.peak_live_bytes, est.place_peak[MT_PLACE_DISK]);
        CHECK_EQ(st.peak_reserved_bytes, est.peak_reserved);
        if (place == MT_PLACE_DISK) {
            CHECK(disk.per_class[MT_MEM_OPTIM].live_bytes > 0 || c->opt == MT_OPT_SGD);
            CHECK_EQ(disk.per_class[MT_MEM_MASTER].live_bytes > 0,
                     c->prec != MT_PREC_FP32 && c->masters);
            CHECK_EQ(disk.per_class[MT_MEM_PARAM].live_bytes > 0, params_too);
            char rep[8192];
            CHECK_OK(mt_memory_report(ctx, rep, sizeof rep, NULL));
            CHECK(strstr(rep, "disk") != NULL);
        } else {
            CHECK_EQ(disk.peak_live_bytes, 0);
        }
    }
    CHECK_OKC(ctx, mt_model_get_params(m, w, n)); /* (after: it may stage through IO) */
    mt_trainer_destroy(t);
    CHECK_OKC(ctx, mt_model_get_params(m, w_after, n));
    mt_memory_stats disk;
    CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_DISK, &disk));
    CHECK_EQ(disk.live_bytes, 0);
    if (dir) CHECK(scratch_gone(dir));
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

static void compare(const ocase *c, const char *dir)
{
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = gpt(ctx);
    const size_t n = mt_model_num_params(m);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    float *w0 = check_alloc(n * 4), *w1 = check_alloc(n * 4), *a0 = check_alloc(n * 4),
          *a1 = check_alloc(n * 4), l0[STEPS], l1[STEPS];
    train(c, MT_PLACE_DEVICE, NULL, w0, a0, l0, true);
    train(c, MT_PLACE_DISK, dir, w1, a1, l1, true);
    for (int s = 0; s < STEPS; s++)
        CHECK_MSG(memcmp(&l0[s], &l1[s], 4) == 0, "%s prec %d: step %d loss %.9g vs %.9g",
                  mt_optimizer_name(c->opt), (int)c->prec, s, l0[s], l1[s]);
    CHECK_MSG(memcmp(w0, w1, n * 4) == 0, "%s prec %d fused %d: weights differ",
              mt_optimizer_name(c->opt), (int)c->prec, c->fused);
    CHECK_MSG(memcmp(a0, a1, n * 4) == 0, "%s prec %d: weights after the trainer differ",
              mt_optimizer_name(c->opt), (int)c->prec);
}

static const ocase cases[] = {
    {MT_OPT_SGD, MT_PREC_FP32, 1, 0, 0.0f},
    {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0.0f},
    {MT_OPT_ADAMW, MT_PREC_FP32, 1, 1, 0.0f},
    {MT_OPT_ADAMW8, MT_PREC_FP32, 1, 1, 1.0f},
    {MT_OPT_ADAMW4, MT_PREC_FP32, 1, 0, 0.0f},
    {MT_OPT_ADAFACTOR, MT_PREC_FP32, 1, 0, 0.0f},
    {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 1.0f},
    {MT_OPT_ADAMW, MT_PREC_FP16, 1, 1, 0.0f},
    {MT_OPT_SGD, MT_PREC_BF16, 1, 1, 0.0f},
    {MT_OPT_ADAMW8, MT_PREC_BF16, 0, 1, 0.0f},
    {MT_OPT_ADAMW8, MT_PREC_BF16, 1, 0, 0.0f},
    {MT_OPT_ADAMW4, MT_PREC_BF16, 1, 1, 0.0f},
    {MT_OPT_ADAFACTOR, MT_PREC_FP16, 1, 0, 0.0f},
    {MT_OPT_ADAMW, MT_PREC_BF16, 0, 0, 0.0f},
};

TEST(offload_disk_equals_resident_each_optimizer)
{
    const char *dir = tmp_dir();
    /* small pieces, so tensors are cut (the tied table's slices too) */
    const size_t keep = mti_offload_piece_elems;
    for (int k = 0; k < 2; k++) {
        mti_offload_piece_elems = k ? keep : 4096;
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
            if (!k || i % 4 == 1) compare(&cases[i], dir); /* (whole pieces: a few) */
    }
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0); /* nothing left in it */
}

/* ---- several ranks: each its own part on disk ---- */

enum { ZN = 2, ZMAX = 3 }; /* ranks: usually, at most */
static uint32_t zcaps; /* the communicators' (MT_COMM_CAP_THREADS: a communication thread) */

typedef struct zrun {
    mt_trainer_config tc;
    int n;             /* ranks */
    char save[600];    /* the training-state file saved after the steps */
    tcomm_world *world;
    mt_status st[ZMAX]; /* each rank's, and what failed */
    char msg[ZMAX][512];
    float loss[ZMAX][STEPS], last[ZMAX]; /* (last: one more step after mt_model_set_params) */
    float *w[ZMAX];    /* each rank's weights at the end */
    float *wa[ZMAX];   /* ... and after its trainer */
    size_t nw;
} zrun;

/* rank's failure with a message, kept (the first) */
static void zfail(zrun *a, int rank, mt_status *s, mt_status why, const char *fmt, ...)
{
    *s = why;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->msg[rank], sizeof a->msg[rank], fmt, ap);
    va_end(ap);
}

/* Whether rank's peaks per class and place equal its estimate e, to the byte. */
static mt_status zpeaks(zrun *a, int rank, mt_context *ctx, const mt_estimate_report *e)
{
    mt_memory_stats st, disk;
    mt_status s = mt_context_memory_stats(ctx, &st);
    if (!s) s = mt_context_place_stats(ctx, MT_PLACE_DISK, &disk);
    if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    for (int k = 0; k < MT_MEM_COUNT && !s; k++)
        if (st.per_class[k].peak_live_bytes != e->class_peak[k] ||
            disk.per_class[k].peak_live_bytes != e->place_class_peak[MT_PLACE_DISK][k])
            zfail(a, rank, &s, MT_ERR_INTERNAL, "%s: device peak %llu (estimate %llu), disk %llu (estimate %llu)",
                  mt_mem_class_name((mt_mem_class)k),
                  (unsigned long long)st.per_class[k].peak_live_bytes,
                  (unsigned long long)e->class_peak[k],
                  (unsigned long long)disk.per_class[k].peak_live_bytes,
                  (unsigned long long)e->place_class_peak[MT_PLACE_DISK][k]);
    if (!s && (st.peak_live_bytes != e->peak || st.peak_reserved_bytes != e->peak_reserved))
        zfail(a, rank, &s, MT_ERR_INTERNAL, "peak %llu (estimate %llu), reserved %llu (estimate %llu)",
              (unsigned long long)st.peak_live_bytes, (unsigned long long)e->peak,
              (unsigned long long)st.peak_reserved_bytes, (unsigned long long)e->peak_reserved);
    if (!s && a->tc.offload == MT_PLACE_DISK && !disk.per_class[MT_MEM_MASTER].peak_live_bytes &&
        a->tc.precision != MT_PREC_FP32 && a->tc.master_weights)
        zfail(a, rank, &s, MT_ERR_INTERNAL, "no master slice on disk");
    if (!s && a->tc.offload_params && !disk.per_class[MT_MEM_PARAM].peak_live_bytes)
        zfail(a, rank, &s, MT_ERR_INTERNAL, "no weights on disk");
    return s;
}

/* Rank `rank` of a ZeRO run (its own rows each step): STEPS steps, then its
 * peaks per class and place against its estimate, to the byte. */
static void zrank(int rank, void *arg)
{
    zrun *a = arg;
    mt_comm *c = tcomm_make(a->world, rank, a->n, zcaps);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 2, g.heads = 4, g.channels = 64, g.seed = 11;
    g.deferred = deferred_as && a->tc.offload == MT_PLACE_DISK;
    mt_estimate_report e;
    mt_status s = tcomm_context(c, &ctx);
    if (!s) s = mt_model_gpt_create(ctx, &g, &m);
    if (!s) s = mt_estimate_model(m, &a->tc, &e);
    if (!s) s = mt_trainer_create(m, &a->tc, &t);
    int32_t tok[B * T], tg[B * T];
    for (int k = 0; k < STEPS && !s; k++) {
        mt_batch b;
        check_token_batch(&b, tok, tg, B, T, V, k * a->n + rank);
        s = mt_trainer_step(t, &b, &a->loss[rank][k]);
    }
    if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    /* (a rank whose peaks differ goes on: the others wait for it in the save) */
    const mt_status ps = s ? MT_OK : zpeaks(a, rank, ctx, &e);
    char pmsg[512];
    snprintf(pmsg, sizeof pmsg, "%s", ps ? a->msg[rank] : "");
    a->msg[rank][0] = 0;
    if (!s) s = mt_trainer_save(t, a->save, NULL, 0); /* (a collective) */
    /* new weights through the masters' slices (on disk: their files), and a
       step from them (ZeRO-3: no weights to read or write while sharded) */
    const bool z3 = a->tc.zero_stage == 3;
    const size_t nw = m ? mt_model_num_params(m) : 0;
    float *w = s ? NULL : malloc(nw * sizeof *w), *wa = s ? NULL : malloc(nw * sizeof *wa);
    if (!s && (!w || !wa)) s = MT_ERR_OOM;
    if (!s && !z3) s = mt_model_get_params(m, w, nw);
    for (size_t k = 0; !s && !z3 && k < nw; k++) w[k] = w[k] * 0.5f + 0.001f;
    if (!s && !z3) s = mt_model_set_params(m, w, nw);
    if (!s) {
        mt_batch b;
        check_token_batch(&b, tok, tg, B, T, V, STEPS * a->n + rank);
        s = mt_trainer_step(t, &b, &a->last[rank]);
    }
    if (!s && !z3) s = mt_model_get_params(m, w, nw);
    if (s && !a->msg[rank][0]) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    mt_trainer_destroy(t); /* (ZeRO-3: a collective) */
    if (!s) s = mt_model_get_params(m, wa, nw); /* (the weights back from disk) */
    if (!s && z3) memcpy(w, wa, nw * sizeof *w);
    if (!s && ps) s = ps, snprintf(a->msg[rank], sizeof a->msg[rank], "%s", pmsg);
    a->nw = nw;
    a->w[rank] = w;
    a->wa[rank] = wa;
    a->st[rank] = s;
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

static void zero_go_n(zrun *a, const ocase *c, int stage, mt_place place, const char *dir, int n)
{
    memset(a, 0, sizeof *a);
    config(&a->tc, c, place, dir);
    a->tc.zero_stage = stage;
    a->n = n;
    snprintf(a->save, sizeof a->save, "/tmp/mt_offload_%ld_%s.mtt", (long)getpid(),
             place == MT_PLACE_DISK ? "disk" : "resident");
    a->world = tcomm_world_new(n, 30.0);
    tcomm_run(n, zrank, a);
    tcomm_world_free(a->world);
    for (int r = 0; r < n; r++)
        CHECK_MSG(a->st[r] == MT_OK, "%s prec %d, stage %d, %s, %d ranks, rank %d: %s",
                  mt_optimizer_name(c->opt), (int)c->prec, stage, mt_place_name(place), n, r,
                  a->msg[r]);
}

/* Runs case c at `stage` on n ranks resident and on disk (the weights too
 * with params_too): the losses, the weights (while the trainer lives,
 * after new weights and a step, and after it) and the training-state file
 * are the resident run's bits; no scratch directory is left. */
static void zero_compare(const ocase *c, int stage, int n, const char *dir)
{
    zrun *res = check_alloc(sizeof *res), *off = check_alloc(sizeof *off);
    const int params = params_too;
    params_too = 0;
    zero_go_n(res, c, stage, MT_PLACE_DEVICE, NULL, n);
    params_too = params;
    zero_go_n(off, c, stage, MT_PLACE_DISK, dir, n);
    for (int r = 0; r < n; r++) {
        if (res->w[r] && off->w[r]) {
            CHECK_MSG(memcmp(res->loss[r], off->loss[r], sizeof res->loss[r]) == 0,
                      "%s prec %d, stage %d, rank %d of %d: losses differ", mt_optimizer_name(c->opt),
                      (int)c->prec, stage, r, n);
            CHECK_MSG(memcmp(res->w[r], off->w[r], res->nw * sizeof(float)) == 0,
                      "%s prec %d, stage %d, rank %d of %d: weights differ", mt_optimizer_name(c->opt),
                      (int)c->prec, stage, r, n);
            CHECK_MSG(memcmp(res->wa[r], off->wa[r], res->nw * sizeof(float)) == 0,
                      "%s prec %d, stage %d, rank %d of %d: weights after the trainer differ",
                      mt_optimizer_name(c->opt), (int)c->prec, stage, r, n);
        }
        char p[600];
        snprintf(p, sizeof p, "%s/memtrain-scratch.rank%d", dir, r);
        struct stat sb;
        CHECK(stat(p, &sb) != 0 && errno == ENOENT);
        free(res->w[r]), free(off->w[r]), free(res->wa[r]), free(off->wa[r]);
    }
    CHECK(memcmp(res->last, off->last, sizeof res->last) == 0);
    CHECK_MSG(check_same_file(res->save, off->save), "%s prec %d, stage %d, %d ranks: the files differ",
              mt_optimizer_name(c->opt), (int)c->prec, stage, n);
    CHECK(unlink(res->save) == 0 && unlink(off->save) == 0);
}

/* fp16/bf16 masters at ZeRO stages 1 and 2 on 2 ranks: each rank's master
 * slice goes to disk with its state; the losses, the weights and the
 * training-state file are the resident run's bits at the same stage (also
 * after new weights set through the masters' slices and one more step),
 * and each rank's peaks per class and place equal its estimate. */
TEST(offload_zero_masters_on_disk)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096; /* shards cut across pieces */
    static const ocase zc[] = {
        {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 1.0f},
        {MT_OPT_ADAMW, MT_PREC_FP16, 1, 1, 0.0f},
        {MT_OPT_ADAMW8, MT_PREC_BF16, 1, 1, 0.0f},
        {MT_OPT_ADAFACTOR, MT_PREC_BF16, 1, 0, 0.0f},
    };
    for (size_t i = 0; i < sizeof zc / sizeof *zc; i++)
        for (int stage = 1; stage <= 2; stage++) {
            if (check_light() && (i + (size_t)stage) % 2) continue;
            zero_compare(&zc[i], stage, ZN, dir);
        }
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

/* The runs of several ranks: every optimizer, fp32, bf16 (with and
 * without masters) and fp16, fused and not, with and without clipping. */
static const ocase rank_cases[] = {
    {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 1.0f},
    {MT_OPT_ADAMW, MT_PREC_BF16, 1, 1, 0.0f},
    {MT_OPT_SGD, MT_PREC_BF16, 0, 0, 0.0f},
    {MT_OPT_ADAFACTOR, MT_PREC_FP32, 1, 0, 0.0f},
    {MT_OPT_ADAMW8, MT_PREC_FP16, 1, 0, 0.0f},
    {MT_OPT_ADAMW8, MT_PREC_FP32, 1, 1, 1.0f},
    {MT_OPT_SGD, MT_PREC_BF16, 0, 1, 0.0f},
};

/* The weights on disk too on 2 and 3 ranks at ZeRO stages 0, 1 and 2:
 * each rank's own param.bin holding the whole weights, sent there once the
 * ranks agree on them; at stages 1 and 2 the gathers of the updated slices
 * read each rank's from its pieces and write the others' into its file. The
 * resident run's bits (losses, weights, training-state files, after new
 * weights set), each rank's peaks its estimate's. With Adafactor (whole tensors
 * owned by one rank, broadcast from its file) and on 3 ranks some rank
 * holds no slice of a tensor, and writes all of it. */
TEST(offload_params_on_ranks)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    params_too = 1;
    for (size_t i = 0; i < sizeof rank_cases / sizeof *rank_cases; i++)
        for (int stage = 0; stage <= 2; stage++)
            for (int n = 2; n <= 3; n++) {
                if ((stage == 0 && (n == 3 || i > 2)) || (check_light() && (i + (size_t)n) % 2))
                    continue;
                zero_compare(&rank_cases[i], stage, n, dir);
            }
    params_too = 0;
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

/* ZeRO-3 with the optimizer state and masters on disk (ZeRO-Infinity's
 * usual setting), then with each rank's slice of the weights on disk too:
 * the state and master slices in the rank's scratch files, its weight
 * slice in memory or in its param.bin (read into its part of each gather
 * buffer before the gather), gathered per layer as when resident (on a
 * communication thread ahead of the layers, or when each layer starts;
 * with recompute too). On 2 and 3 ranks the resident stage-3 run's bits
 * (losses, weights after the trainer, training-state files), each rank's
 * peaks per class and place its estimate's. */
TEST(offload_zero3_on_disk)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    for (int params = 0; params < 2; params++)
        for (size_t i = 0; i < sizeof rank_cases / sizeof *rank_cases; i++)
            for (int n = 2; n <= 3; n++) {
                if (check_light() && (i + (size_t)n + (size_t)params) % 2) continue;
                zcaps = (i + (size_t)n) % 2 ? MT_COMM_CAP_THREADS : 0; /* (prefetch on a thread, or not) */
                recompute_as = i == 2 ? MT_RECOMPUTE_EVERY_K : MT_RECOMPUTE_NONE;
                params_too = params;
                zero_compare(&rank_cases[i], 3, n, dir);
            }
    params_too = 0;
    zcaps = 0;
    recompute_as = MT_RECOMPUTE_NONE;
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

/* ---- a disk failing on one rank of several ---- */

/* Fails the rf_at-th transfer (write rf_wr) of a file whose path has
 * rf_path in it (one rank's), with rf_err; counts them in rf_calls. Called
 * from every rank's threads. */
static _Atomic int rf_calls, rf_at = -1;
static int rf_wr, rf_err;
static char rf_path[64];

static int rank_inject(int write, const char *path, uint64_t off, size_t *n)
{
    (void)off, (void)n;
    if (write != rf_wr || !strstr(path, rf_path)) return 0;
    const int k = atomic_fetch_add(&rf_calls, 1);
    return k == atomic_load(&rf_at) ? rf_err : 0;
}

typedef struct frun {
    zrun z;
    int fail_rank, which; /* which: 0 the step's first transfer, 1 its last */
} frun;

/* Rank `rank`: a step, then the failing rank's rf_at-th transfer of the
 * next step fails. Every rank's step fails, at once (the failing rank with
 * MT_ERR_IO naming its file, the others with MT_ERR_COMM naming it, not at
 * a timeout); after the trainer no scratch file is left and the model's
 * weights are finite. */
static void frank(int rank, void *arg)
{
    frun *f = arg;
    zrun *a = &f->z;
    mt_comm *c = tcomm_make(a->world, rank, a->n, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_status s = tcomm_context(c, &ctx);
    if (!s) s = (m = gpt(ctx)) ? MT_OK : MT_ERR_OOM;
    if (!s) s = mt_trainer_create(m, &a->tc, &t);
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    check_token_batch(&b, tok, tg, B, T, V, rank);
    if (rank == f->fail_rank) atomic_store(&rf_calls, 0); /* (the rank's own: counted from here) */
    if (!s) s = mt_trainer_step(t, &b, &a->loss[rank][0]);
    if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "step 0: %s", mt_last_error(ctx));
    if (!s && rank == f->fail_rank) { /* (its transfers in step 0, then the one to fail) */
        const int per = atomic_exchange(&rf_calls, 0);
        atomic_store(&rf_at, f->which ? per - 1 : 0);
    }
    mt_status fs = s ? s : mt_trainer_step(t, &b, &a->loss[rank][1]);
    const char *msg = mt_last_error(ctx);
    char want[600];
    snprintf(want, sizeof want, "%s/memtrain-scratch.rank%d", a->tc.offload_dir, rank);
    if (!s && rank == f->fail_rank && (fs != MT_ERR_IO || !strstr(msg, want) || !strstr(msg, strerror(rf_err))))
        zfail(a, rank, &s, MT_ERR_INTERNAL, "the failing rank: %s: %s", mt_status_string(fs), msg);
    snprintf(want, sizeof want, "rank %d failed (%s)", f->fail_rank, mt_status_string(MT_ERR_IO));
    if (!s && rank != f->fail_rank && (fs != MT_ERR_COMM || !strstr(msg, want)))
        zfail(a, rank, &s, MT_ERR_INTERNAL, "another rank: %s: %s", mt_status_string(fs), msg);
    /* said once, and how far the update went without contradiction: the
       other ranks updated everything (or, failed in forward, nothing) */
    const char *part = strstr(msg, "part-way: ");
    int done = -1, of = -1;
    if (part) sscanf(part, "part-way: %d of the %d", &done, &of);
    if (!s && (strstr(msg, "mt_trainer_step: mt_trainer_step") || (part && !(done < of))))
        zfail(a, rank, &s, MT_ERR_INTERNAL, "the message: %s", msg);
    if (!s && rank != f->fail_rank && !strstr(msg, "(after the update: all ") &&
        !strstr(msg, "(weights and optimizer state unchanged)"))
        zfail(a, rank, &s, MT_ERR_INTERNAL, "another rank's message: %s", msg);
    mt_trainer_destroy(t);
    mt_memory_stats disk;
    if (!s) s = mt_context_place_stats(ctx, MT_PLACE_DISK, &disk);
    if (!s && disk.live_bytes) zfail(a, rank, &s, MT_ERR_INTERNAL, "%llu bytes left on disk",
                                     (unsigned long long)disk.live_bytes);
    const size_t nw = m ? mt_model_num_params(m) : 0;
    float *w = malloc(nw * sizeof *w + 1);
    if (!s && !w) s = MT_ERR_OOM;
    if (!s) s = mt_model_get_params(m, w, nw);
    for (size_t k = 0; !s && k < nw; k++)
        if (!(w[k] == w[k] && w[k] - w[k] == 0.0f)) zfail(a, rank, &s, MT_ERR_INTERNAL, "weight %zu is %g", k, w[k]);
    free(w);
    a->st[rank] = s;
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

/* frank on 2 ranks at `stage`: rank 1's fault in `file` of its scratch
 * directory (a write or a read, the step's first transfer or with `last`
 * its last, failing with err); every rank's checks passed, and nothing is
 * left in dir. */
static void rank_fault(const ocase *c, const char *dir, int stage, const char *file, int wr,
                       int last, int err)
{
    frun f;
    memset(&f, 0, sizeof f);
    config(&f.z.tc, c, MT_PLACE_DISK, dir);
    f.z.tc.zero_stage = stage;
    f.z.n = ZN;
    f.fail_rank = 1;
    f.which = last;
    rf_wr = wr, rf_err = err;
    snprintf(rf_path, sizeof rf_path, "memtrain-scratch.rank1/%s", file);
    atomic_store(&rf_calls, 0);
    atomic_store(&rf_at, -1);
    mti_offload_fault = rank_inject;
    f.z.world = tcomm_world_new(ZN, 60.0);
    tcomm_run(ZN, frank, &f);
    tcomm_world_free(f.z.world);
    mti_offload_fault = NULL;
    for (int r = 0; r < ZN; r++)
        CHECK_MSG(f.z.st[r] == MT_OK, "stage %d, %s %s, %s, weights on disk %d, rank %d: %s", stage,
                  file, wr ? "write" : "read", last ? "last" : "first", params_too, r, f.z.msg[r]);
    CHECK(dir_empty(dir));
}

/* A disk that fails on one rank of 2 at ZeRO stages 1 to 3 with the
 * weights on disk: a write in the update (a piece going home) and, at
 * stages 1 and 2, in the gathers after it (another rank's slice written),
 * disk full or an I/O error, and at stage 1 a read (a layer's weights in
 * forward): the step fails on every rank at once, clearly, and nothing is
 * left on disk. */
TEST(offload_params_fault_on_one_rank)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    const ocase c = {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 0.0f};
    params_too = 1;
    for (int stage = 1; stage <= 3; stage++)
        for (int k = 0; k < 3 - (stage >= 2); k++) { /* (stage 2 reduces in backward, stage 3
                                                          gathers in forward: a rank failing
                                                          there leaves the others in a
                                                          collective, to its timeout) */
            rank_fault(&c, dir, stage, "param.bin", k < 2, k == 1, k == 1 ? EIO : ENOSPC);
        }
    params_too = 0;
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

/* The same at ZeRO stage 0, where every rank updates the whole model from
 * the summed gradients and no collective follows the update: the state on
 * disk (and the weights), rank 1's first write of the step failing (disk
 * full), its last (an I/O error: a piece going home at the step's end), or
 * its first read of the state. The ranks agree at the step's end all the
 * same: every rank's step fails at once, and no rank's scratch directory is
 * left (a rank failing alone would be ended by the job, MPI_Abort, with
 * the others' state left on disk). */
TEST(offload_fault_on_one_rank_stage0)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    const ocase c = {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 0.0f};
    for (int params = 0; params < 2; params++)
        for (int k = 0; k < 3; k++) {
            params_too = params;
            rank_fault(&c, dir, 0, "optim.bin", k < 2, k == 1, k == 0 ? ENOSPC : EIO);
        }
    params_too = 0;
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

/* Local SGD averages the masters (or the weights) in memory: with them on
 * disk it is refused, clearly, on every rank alike. */
TEST(offload_local_sgd_refused)
{
    const char *dir = tmp_dir();
    static const ocase lc[] = {
        {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 0.0f}, /* the masters on disk */
        {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0.0f}, /* the weights on disk */
    };
    for (int k = 0; k < 2; k++) {
        zrun a;
        memset(&a, 0, sizeof a);
        params_too = k;
        config(&a.tc, &lc[k], MT_PLACE_DISK, dir);
        params_too = 0;
        a.tc.local_sgd_every = 2;
        a.n = ZN;
        snprintf(a.save, sizeof a.save, "%s/never.mtt", dir);
        a.world = tcomm_world_new(ZN, 30.0);
        tcomm_run(ZN, zrank, &a);
        tcomm_world_free(a.world);
        for (int r = 0; r < ZN; r++) {
            CHECK_EQ(a.st[r], MT_ERR_UNSUPPORTED);
            CHECK_MSG(strstr(a.msg[r], "local_sgd_every"), "rank %d: %s", r, a.msg[r]);
            /* the way out named fits the case: the masters can go, the weights cannot */
            CHECK_MSG(!strstr(a.msg[r], "without masters") == (k == 1), "rank %d: %s", r,
                      a.msg[r]);
            free(a.w[r]);
        }
    }
    CHECK(rmdir(dir) == 0);
}

TEST(offload_places_in_stats_and_estimate)
{
    mt_context *ctx = check_cpu_context(1);
    CHECK(!strcmp(mt_place_name(MT_PLACE_DEVICE), "device") &&
          !strcmp(mt_place_name(MT_PLACE_HOST), "host") &&
          !strcmp(mt_place_name(MT_PLACE_DISK), "disk") && !strcmp(mt_place_name(3), "?"));
    mt_memory_stats a, b;
    CHECK_OK(mt_context_memory_stats(ctx, &a));
    CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_DEVICE, &b));
    CHECK(memcmp(&a, &b, sizeof a) == 0);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_place_stats(ctx, (mt_place)3, &b));
    CHECK(strstr(mt_last_error(ctx), "place 3"));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_place_stats(ctx, MT_PLACE_DISK, NULL));
    /* the settings refused */
    mt_model *m = gpt(ctx);
    mt_trainer_config tc;
    const ocase c = {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0.0f};
    mt_trainer *t = NULL;
    config(&tc, &c, MT_PLACE_DISK, NULL);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "offload_dir"));
    config(&tc, &c, MT_PLACE_HOST, "/tmp");
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_create(m, &tc, &t));
    config(&tc, &c, MT_PLACE_DISK, "/nonexistent/dir");
    CHECK_ST(MT_ERR_IO, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "/nonexistent/dir"));
    config(&tc, &c, (mt_place)7, "/tmp");
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    /* an estimate needs no directory; disk holds 8 bytes of AdamW state per
       parameter (each tensor's region rounded up to 4 KiB) */
    config(&tc, &c, MT_PLACE_DISK, NULL);
    mt_estimate_report est;
    CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
    const uint64_t P = mt_model_num_params(m);
    CHECK(est.place_class_peak[MT_PLACE_DISK][MT_MEM_OPTIM] >= 8 * P);
    CHECK(est.place_class_peak[MT_PLACE_DISK][MT_MEM_OPTIM] < 8 * P + 64 * 4096);
    CHECK_EQ(est.place_class_peak[MT_PLACE_DISK][MT_MEM_MASTER], 0);
    CHECK_EQ(est.place_peak[MT_PLACE_HOST], 0);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

/* ---- faults ---- */

static int fault_write_at = -1, fault_read_at = -1, fault_errno, fault_short, fault_calls[2];

static int inject(int write, const char *path, uint64_t off, size_t *n)
{
    (void)path, (void)off;
    int k = fault_calls[write]++;
    if (fault_short && write && *n > 4096) { /* every large write goes half at a time */
        *n = *n / 2;
        return 0;
    }
    if ((write && k == fault_write_at) || (!write && k == fault_read_at)) return fault_errno;
    return 0;
}

/* A trainer with its state on disk under `dir`, and batch 0 for it. */
typedef struct disk_run {
    mt_context *ctx;
    mt_model *m;
    mt_trainer *t;
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
} disk_run;

static void disk_run_open(disk_run *r, const char *dir, const ocase *c)
{
    r->ctx = check_cpu_context(1);
    r->m = gpt(r->ctx);
    mt_trainer_config tc;
    config(&tc, c, MT_PLACE_DISK, dir);
    CHECK_OKC(r->ctx, mt_trainer_create(r->m, &tc, &r->t));
    batch(&r->b, r->tok, r->tg, 0);
}

/* Trains with a fault after `after` steps: the step fails with MT_ERR_IO
 * naming the scratch file, the scratch directory is gone, later steps are
 * refused, and the model's weights stay finite. */
static void fault_run(const char *dir, int wr, int err)
{
    const ocase c = {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 0.0f};
    disk_run r;
    disk_run_open(&r, dir, &c);
    mt_context *ctx = r.ctx;
    mt_model *m = r.m;
    mt_trainer *t = r.t;
    const mt_batch b = r.b;
    float loss;
    fault_calls[0] = fault_calls[1] = 0;
    mti_offload_fault = inject;
    CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss));
    CHECK(fault_calls[0] > 4 && fault_calls[1] > 4);
    const int per_step = fault_calls[wr];
    fault_calls[0] = fault_calls[1] = 0;
    fault_errno = err;
    if (wr) fault_write_at = per_step / 2;
    else fault_read_at = per_step / 2;
    mt_status fs = mt_trainer_step(t, &b, &loss);
    CHECK_MSG(fs == MT_ERR_IO, "%s: %d writes and %d reads in step 1, then %d and %d", mt_status_string(fs), wr ? per_step : -1, wr ? -1 : per_step, fault_calls[1], fault_calls[0]);
    mti_offload_fault = NULL;
    fault_write_at = fault_read_at = -1;
    const char *msg = mt_last_error(ctx);
    CHECK_MSG(strstr(msg, dir) && strstr(msg, strerror(err)), "%s", msg);
    CHECK(scratch_gone(dir));
    CHECK_ST(MT_ERR_IO, mt_trainer_step(t, &b, &loss));
    CHECK(strstr(mt_last_error(ctx), "lost"));
    mt_trainer_destroy(t);
    const size_t n = mt_model_num_params(m);
    float *w = check_alloc(n * 4);
    CHECK_OKC(ctx, mt_model_get_params(m, w, n));
    for (size_t i = 0; i < n; i++) CHECK(w[i] == w[i] && w[i] - w[i] == 0.0f);
    mt_memory_stats disk;
    CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_DISK, &disk));
    CHECK_EQ(disk.live_bytes, 0);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

/* Disk full and I/O errors (writing, when write_eio, and reading) give
 * clear errors; short writes are finished, not failed: case c's run gives
 * the bits of a resident one. */
static void io_faults(bool write_eio, const ocase *c)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    fault_run(dir, 1, ENOSPC);
    if (write_eio) fault_run(dir, 1, EIO);
    fault_run(dir, 0, EIO);
    fault_short = 1;
    mti_offload_fault = inject;
    compare(c, dir);
    mti_offload_fault = NULL;
    fault_short = 0;
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

TEST(offload_io_faults_are_clear_errors)
{
    io_faults(true, &cases[6]);
}

/* Scratch file `name` removed (cut 0) or truncated (cut 1) after a step of
 * case c: set/get_params see the values on disk; the next step then fails
 * before changing anything, naming the file, and the scratch directory
 * goes; after the trainer the weights are finite. weights: the file holds
 * the weights, so get_params fails too while the trainer lives (after it,
 * the weights lost are zeros; the masters lost leave the compute copy). */
static void lose_scratch_file(const char *dir, const ocase *c, int cut, const char *name, bool weights)
{
    char path[512];
    disk_run r;
    disk_run_open(&r, dir, c);
    mt_context *ctx = r.ctx;
    mt_model *m = r.m;
    mt_trainer *t = r.t;
    const mt_batch b = r.b;
    float loss;
    CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss));
    const size_t n = mt_model_num_params(m);
    float *w0 = check_alloc(n * 4), *w1 = check_alloc(n * 4);
    CHECK_OKC(ctx, mt_model_get_params(m, w0, n));
    for (size_t i = 0; i < n; i++) w1[i] = w0[i] * 0.5f + 1e-3f;
    CHECK_OKC(ctx, mt_model_set_params(m, w1, n));
    CHECK_OKC(ctx, mt_model_get_params(m, w0, n));
    CHECK(memcmp(w0, w1, n * 4) == 0);
    snprintf(path, sizeof path, "%s/memtrain-scratch/%s", dir, name);
    if (cut) CHECK(truncate(path, 4096) == 0);
    else CHECK(unlink(path) == 0);
    CHECK_ST(MT_ERR_IO, mt_trainer_step(t, &b, &loss));
    CHECK_MSG(strstr(mt_last_error(ctx), path) && strstr(mt_last_error(ctx), cut ? "truncated" : "removed"),
              "%s", mt_last_error(ctx));
    CHECK(scratch_gone(dir));
    CHECK_EQ(mt_trainer_steps(t), 1);
    if (weights) CHECK_ST(MT_ERR_IO, mt_model_get_params(m, w0, n));
    mt_trainer_destroy(t);
    CHECK_OKC(ctx, mt_model_get_params(m, w1, n));
    for (size_t i = 0; i < n; i++) CHECK(w1[i] == w1[i]);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

/* A scratch file removed or truncated between steps: the next step fails
 * before changing anything. */
TEST(offload_removed_or_truncated_scratch)
{
    const char *dir = tmp_dir();
    const ocase c = {MT_OPT_ADAMW, MT_PREC_BF16, 1, 1, 0.0f};
    lose_scratch_file(dir, &c, 0, "master.bin", false);
    lose_scratch_file(dir, &c, 1, "optim.bin", false);
    CHECK(rmdir(dir) == 0);
}

/* A directory a dead process left is cleaned; one a live process holds is
 * refused and left alone; a killed run's directory is cleaned next time. */
TEST(offload_scratch_directory_ownership)
{
    const char *dir = tmp_dir();
    char sd[512], lock[600], other[600];
    snprintf(sd, sizeof sd, "%s/memtrain-scratch", dir);
    snprintf(lock, sizeof lock, "%s/lock", sd);
    snprintf(other, sizeof other, "%s/mine.txt", sd);
    const ocase c = {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0.0f};
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = gpt(ctx);
    mt_trainer_config tc;
    config(&tc, &c, MT_PLACE_DISK, dir);
    mt_trainer *t = NULL, *t2 = NULL;
    /* a live owner (this process: a second trainer in the same directory) */
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    mt_model *m2 = gpt(ctx);
    CHECK_ST(MT_ERR_IO, mt_trainer_create(m2, &tc, &t2));
    CHECK(strstr(mt_last_error(ctx), "belongs to process") && strstr(mt_last_error(ctx), sd));
    struct stat sb;
    CHECK(stat(lock, &sb) == 0); /* left alone */
    mt_trainer_destroy(t);
    CHECK(scratch_gone(dir));
    /* a dead owner: a child that made its trainer and was killed */
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        mt_trainer *tk;
        if (mt_trainer_create(m, &tc, &tk) != MT_OK) _exit(3);
        raise(SIGKILL);
        _exit(4);
    }
    int status;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    CHECK(stat(lock, &sb) == 0); /* the killed run's directory, recognisable */
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    mt_trainer_destroy(t);
    CHECK(scratch_gone(dir));
    /* a directory with files memtrain did not make is refused */
    CHECK(mkdir(sd, 0700) == 0);
    FILE *f = fopen(other, "w");
    CHECK(f && fputs("x", f) >= 0 && fclose(f) == 0);
    CHECK_ST(MT_ERR_IO, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "did not make"));
    CHECK(stat(other, &sb) == 0);
    CHECK(unlink(other) == 0 && rmdir(sd) == 0);
    /* a relative directory is the one it named at create: the process may
       change its working directory, and the scratch is still removed */
    char cwd[512];
    CHECK(getcwd(cwd, sizeof cwd) != NULL);
    CHECK(chdir(dir) == 0);
    config(&tc, &c, MT_PLACE_DISK, ".");
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK(chdir("/") == 0);
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    batch(&b, tok, tg, 0);
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    mt_trainer_destroy(t);
    CHECK(chdir(cwd) == 0);
    CHECK(scratch_gone(dir));
    mt_model_destroy(m2);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    CHECK(rmdir(dir) == 0);
}

/* Training-state files: an offloaded trainer saves the file a resident
 * one does; either loads the other's and trains on to the same bits. */
static void run_ck(mt_place save_at, mt_place load_at, const char *dir, const char *file, float *w)
{
    const ocase c = {MT_OPT_ADAMW8, MT_PREC_BF16, 1, 0, 0.0f};
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    float loss;
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = gpt(ctx);
    mt_trainer_config tc;
    config(&tc, &c, save_at, dir);
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    for (int s = 0; s < 2; s++) {
        batch(&b, tok, tg, s);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss));
    }
    CHECK_OKC(ctx, mt_trainer_save(t, file, "u", 1));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    ctx = check_cpu_context(1);
    m = gpt(ctx);
    config(&tc, &c, load_at, dir);
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_OKC(ctx, mt_trainer_load(t, file, NULL, 0, NULL));
    for (int s = 2; s < 4; s++) {
        batch(&b, tok, tg, s);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss));
    }
    CHECK_OKC(ctx, mt_model_get_params(m, w, mt_model_num_params(m)));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    CHECK(unlink(file) == 0);
}

/* Training-state files saved and loaded with the state (and, params: the
 * weights) on disk or resident, every pairing: the same bits. */
static void training_state_cases(int params)
{
    const char *dir = tmp_dir();
    char file[256];
    snprintf(file, sizeof file, "%s.state", dir);
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = gpt(ctx);
    const size_t n = mt_model_num_params(m);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    float *w[4];
    params_too = params;
    for (int k = 0; k < 4; k++) {
        w[k] = check_alloc(n * 4);
        run_ck(k & 1 ? MT_PLACE_DISK : MT_PLACE_DEVICE, k & 2 ? MT_PLACE_DISK : MT_PLACE_DEVICE, dir,
               file, w[k]);
    }
    params_too = 0;
    mti_offload_piece_elems = keep;
    for (int k = 1; k < 4; k++) CHECK_MSG(memcmp(w[0], w[k], n * 4) == 0, "case %d differs", k);
    CHECK(rmdir(dir) == 0);
}

TEST(offload_training_state_files) { training_state_cases(0); }

/* A context recording its allocation trace from its creation, the small
 * GPT on it and case c's trainer with the state on disk under dir, after
 * one step. */
static void traced_step(const char *dir, const ocase *c, mt_context **ctx, mt_model **m,
                        mt_trainer **t)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.trace_capacity = 1 << 16;
    CHECK_OK(mt_context_create(&cc, ctx));
    *m = gpt(*ctx);
    mt_trainer_config tc;
    config(&tc, c, MT_PLACE_DISK, dir);
    CHECK_OKC(*ctx, mt_trainer_create(*m, &tc, t));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    float loss;
    batch(&b, tok, tg, 0);
    CHECK_OKC(*ctx, mt_trainer_step(*t, &b, &loss));
}

/* The trace: the scratch files' bytes are events of the disk place, which
 * the Chrome export shows as their own counter and replay leaves out. */
TEST(offload_trace_has_the_disk)
{
    const char *dir = tmp_dir();
    mt_context *ctx;
    mt_model *m;
    mt_trainer *t;
    const ocase c = {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 0.0f};
    traced_step(dir, &c, &ctx, &m, &t);
    mt_trainer_destroy(t);
    const mt_trace_event *ev;
    size_t n;
    uint64_t dropped;
    CHECK_OK(mt_context_trace_events(ctx, &ev, &n, &dropped));
    uint64_t disk[2][MT_MEM_COUNT] = {{0}};
    for (size_t i = 0; i < n; i++)
        if (ev[i].place == MT_PLACE_DISK) disk[ev[i].op == MT_TRACE_FREE][ev[i].mem_class] += ev[i].bytes;
    CHECK(disk[0][MT_MEM_OPTIM] > 0 && disk[0][MT_MEM_MASTER] > 0);
    CHECK(memcmp(disk[0], disk[1], sizeof disk[0]) == 0); /* made and removed */
    char path[256], json[256];
    snprintf(path, sizeof path, "%s.trace", dir);
    snprintf(json, sizeof json, "%s.json", dir);
    CHECK_OK(mt_context_trace_write(ctx, path));
    mt_trace *tr;
    CHECK_OKC(ctx, mt_trace_load(ctx, path, &tr));
    size_t n2;
    CHECK_OK(mt_trace_info(tr, &n2, &dropped));
    CHECK_EQ(n2, n);
    const mt_trace_event *back = mt_trace_get_events(tr);
    for (size_t i = 0; i < n; i++)
        CHECK(back[i].place == ev[i].place && back[i].op == ev[i].op &&
              back[i].bytes == ev[i].bytes && back[i].mem_class == ev[i].mem_class);
    mt_trace_summary sum;
    CHECK_OKC(ctx, mt_trace_summarize(ctx, tr, &sum));
    mt_memory_stats st;
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    CHECK_EQ(sum.peak, st.peak_live_bytes); /* the device's, the disk left out */
    CHECK_OKC(ctx, mt_trace_export_chrome(ctx, tr, NULL, json));
    unsigned char *text;
    size_t len;
    FILE *f = fopen(json, "rb");
    CHECK(f);
    text = check_alloc(1 << 24);
    len = fread(text, 1, (1 << 24) - 1, f);
    fclose(f);
    text[len] = 0;
    CHECK(strstr((char *)text, "\"disk bytes\"") != NULL);
    mt_allocator *a;
    CHECK_OK(mt_allocator_create(ctx, NULL, &a));
    mt_replay_result rr;
    CHECK_OKC(ctx, mt_trace_replay(tr, a, &rr));
    CHECK_EQ(rr.peak_live_bytes, st.peak_live_bytes);
    mt_allocator_destroy(a);
    mt_trace_free(tr);
    CHECK(unlink(path) == 0 && unlink(json) == 0);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    CHECK(rmdir(dir) == 0);
}

/* The least a budget needs, from auto-fit's MT_ERR_BUDGET message. */
static uint64_t least_of(const mt_model *m, mt_context *ctx, const mt_trainer_config *base)
{
    mt_trainer_config c = *base;
    c.memory_budget = 1;
    mt_autofit_report r;
    CHECK_ST(MT_ERR_BUDGET, mt_trainer_autofit(m, &c, 0, &r));
    const char *at = strstr(mt_last_error(ctx), "the least is ");
    unsigned long long least = 0;
    CHECK(at && sscanf(at, "the least is %llu", &least) == 1);
    return least;
}

/* The last INFO line of a context's log. */
static void last_info(void *user, mt_log_level level, const char *msg)
{
    if (level == MT_LOG_INFO) snprintf((char *)user, 512, "%s", msg);
}

/* rows and tokens enough that the activations outweigh the weights' layer
 * buffers (else the weights on disk save nothing) */
enum { FB = 8, FT = 64 };

/* A context logging INFO lines into said, and auto-fit's model on it. */
static void fit_model(char *said, mt_context **ctx, mt_model **m)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.log_fn = last_info;
    cc.log_user = said;
    cc.log_level = MT_LOG_INFO;
    CHECK_OK(mt_context_create(&cc, ctx));
    *m = check_small_gpt(*ctx, V, FT, 128, 3);
}

/* Auto-fit, given a directory, puts the state on disk when nothing else
 * fits, and the weights too when even that does not fit (not with LoRA),
 * saying so; each chosen run stays within its budget and equals its
 * estimate per class and place to the byte. */
TEST(offload_autofit_chooses_the_disk)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    static char said[512];
    mt_context *ctx;
    mt_model *m;
    fit_model(said, &ctx, &m);
    mt_trainer_config tc;
    const ocase c = {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0.0f};
    config(&tc, &c, MT_PLACE_DEVICE, NULL);
    tc.max_batch = FB;
    tc.max_seq = FT;
    const uint64_t resident = least_of(m, ctx, &tc);
    mt_trainer_config state = tc; /* the state on disk, as asked (the weights stay) */
    state.offload = MT_PLACE_DISK;
    const uint64_t on_disk = least_of(m, ctx, &state);
    CHECK(strstr(mt_last_error(ctx), "the state on disk"));
    tc.offload_dir = dir;
    const uint64_t weights_too = least_of(m, ctx, &tc);
    CHECK_MSG(strstr(mt_last_error(ctx), "the state and the weights on disk"), "%s", mt_last_error(ctx));
    CHECK_MSG(weights_too < on_disk && on_disk < resident, "%llu, %llu, %llu",
              (unsigned long long)weights_too, (unsigned long long)on_disk,
              (unsigned long long)resident);
    /* LoRA: never the weights (the state alone, small, goes to disk) */
    mt_trainer_config lora = tc;
    lora.lora.rank = 4;
    (void)least_of(m, ctx, &lora);
    CHECK_MSG(!strstr(mt_last_error(ctx), "weights"), "%s", mt_last_error(ctx));
    for (int k = 0; k < 2; k++) {
        if (k) fit_model(said, &ctx, &m); /* (a fresh context: its peaks are the run's) */
        mt_trainer_config f = tc;
        f.memory_budget = k ? (weights_too + on_disk) / 2 : (on_disk + resident) / 2;
        mt_trainer_config without = f;
        without.offload_dir = NULL;
        mt_autofit_report r;
        CHECK_ST(MT_ERR_BUDGET, mt_trainer_autofit(m, &without, 0, &r));
        CHECK_MSG(strstr(mt_last_error(ctx), "the disk not tried: no offload_dir") &&
                      !strstr(mt_last_error(ctx), "host"), /* (a CPU context: no host tier) */
                  "%s", mt_last_error(ctx));
        /* a directory the run could not use is no fit: not there, or a file */
        char bad[600];
        snprintf(bad, sizeof bad, "%s/not-there", dir);
        for (int b = 0; b < 2; b++) {
            if (b) CHECK(fclose(fopen(bad, "w")) == 0);
            mt_trainer_config nodir = f;
            nodir.offload_dir = bad;
            CHECK_ST(MT_ERR_BUDGET, mt_trainer_autofit(m, &nodir, 0, &r));
            CHECK_MSG(strstr(mt_last_error(ctx), b ? "is not a directory" : "No such file"), "%s",
                      mt_last_error(ctx));
        }
        CHECK(unlink(bad) == 0);
        if (k) { /* the state on disk, as asked, and no more: nothing fits */
            without.offload = MT_PLACE_DISK;
            CHECK_ST(MT_ERR_BUDGET, mt_trainer_autofit(m, &without, 0, &r));
        }
        said[0] = 0;
        CHECK_OKC(ctx, mt_trainer_autofit(m, &f, 0, &r));
        CHECK_EQ(r.offload, MT_PLACE_DISK);
        CHECK_EQ(f.offload, MT_PLACE_DISK);
        CHECK_EQ(r.offload_params, k);
        CHECK_EQ(f.offload_params, k);
        CHECK_MSG(strstr(said, k ? "the optimizer state and the weights on disk"
                                 : "the optimizer state on disk") != NULL, "%s", said);
        CHECK(r.peak_reserved <= f.memory_budget);
        mt_estimate_report est;
        CHECK_OKC(ctx, mt_estimate_model(m, &f, &est));
        CHECK_EQ(est.peak_reserved, r.peak_reserved);
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &f, &t));
        int32_t tok[FB * FT], tg[FB * FT];
        mt_batch b;
        float loss;
        for (int s = 0; s < 2; s++) {
            check_token_batch(&b, tok, tg, FB, FT, V, s);
            CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss));
        }
        mt_memory_stats st, disk;
        CHECK_OK(mt_context_memory_stats(ctx, &st));
        CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_DISK, &disk));
        CHECK(st.peak_reserved_bytes <= f.memory_budget);
        CHECK_EQ(st.peak_reserved_bytes, est.peak_reserved);
        CHECK_EQ(st.peak_live_bytes, est.peak);
        for (int j = 0; j < MT_MEM_COUNT; j++) {
            CHECK_EQ(st.per_class[j].peak_live_bytes, est.class_peak[j]);
            CHECK_EQ(disk.per_class[j].peak_live_bytes, est.place_class_peak[MT_PLACE_DISK][j]);
        }
        CHECK_EQ(disk.per_class[MT_MEM_PARAM].peak_live_bytes > 0, k);
        mt_trainer_destroy(t);
        CHECK(scratch_gone(dir));
        mt_model_destroy(m);
        mt_context_destroy(ctx);
    }
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

/* ---- offload_params: the trained weights on disk too ---- */

/* Every optimizer and precision trains to the resident run's bits with the
 * weights on disk, cut in small pieces and whole, with and without
 * recompute (a recomputed layer brings its weights in again); the peaks
 * per class and place equal the estimate. */
TEST(offload_params_equal_resident_each_optimizer)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    params_too = 1;
    for (int k = 0; k < 3; k++) {
        mti_offload_piece_elems = k == 1 ? keep : 4096;
        recompute_as = k == 2 ? MT_RECOMPUTE_EVERY_K : MT_RECOMPUTE_NONE;
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
            if (!k || i % 4 == (size_t)k) compare(&cases[i], dir);
    }
    /* frozen weights stay on the device, beside the trained ones on disk in
       the same layers */
    freeze_some = 1;
    compare(&cases[1], dir);
    compare(&cases[6], dir);
    freeze_some = 0;
    params_too = 0;
    recompute_as = MT_RECOMPUTE_NONE;
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

/* A deferred model created straight onto disk (offload_params): on one
 * rank, at ZeRO stages 0 to 2 on 2 ranks, and at ZeRO-3 (each rank's slice
 * in its param.bin), the resident whole model's bits, with every class's
 * peak (setup included) its estimate's; on one rank the device's PARAM
 * never holds the weights whole. */
TEST(offload_params_deferred_model)
{
    const char *dir = tmp_dir();
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    params_too = 1;
    deferred_as = 1;
    compare(&cases[1], dir);
    compare(&cases[6], dir);
    compare(&cases[9], dir);
    freeze_some = 1;
    compare(&cases[6], dir);
    freeze_some = 0;
    for (int stage = 0; stage <= 3; stage++)
        zero_compare(&rank_cases[stage % 2], stage, 2, dir);
    /* the device's PARAM: two layers' buffers and the update's, not the
       whole weights (fp32 here, 12 blocks) */
    const ocase c = cases[1];
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = gpt_deferred_of(ctx, 12);
    mt_trainer_config tc;
    config(&tc, &c, MT_PLACE_DISK, dir);
    mt_trainer *t = NULL;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    mt_memory_stats st;
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    CHECK_MSG(st.per_class[MT_MEM_PARAM].peak_live_bytes < mt_model_num_params(m) * 4 / 2,
              "PARAM peak %llu for %zu fp32 weights",
              (unsigned long long)st.per_class[MT_MEM_PARAM].peak_live_bytes, mt_model_num_params(m));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    deferred_as = 0;
    params_too = 0;
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0);
}

TEST(offload_params_refusals_and_estimate)
{
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = gpt(ctx);
    mt_trainer_config tc;
    const ocase c = {MT_OPT_ADAMW, MT_PREC_BF16, 0, 0, 0.0f};
    mt_trainer *t = NULL;
    config(&tc, &c, MT_PLACE_DEVICE, NULL);
    tc.offload_params = 1;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "offload_params needs cfg->offload disk"));
    config(&tc, &c, MT_PLACE_DISK, "/tmp");
    for (int v = -1; v <= 2; v += 3) {
        tc.offload_params = v;
        CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
        CHECK(strstr(mt_last_error(ctx), "must be 0 or 1"));
    }
    tc.offload_params = 1;
    tc.lora.rank = 4;
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "LoRA"));
    /* the estimate: bf16 weights (2 bytes a parameter, each tensor's region
       rounded up to 4 KiB) on disk, and on the device two layers' worth
       (the token table's) and a piece's per update buffer */
    params_too = 1;
    config(&tc, &c, MT_PLACE_DISK, NULL);
    mt_estimate_report est, res;
    CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
    params_too = 0;
    config(&tc, &c, MT_PLACE_DISK, NULL); /* the state alone on disk */
    CHECK_OKC(ctx, mt_estimate_model(m, &tc, &res));
    CHECK_EQ(res.place_class_peak[MT_PLACE_DISK][MT_MEM_PARAM], 0);
    const uint64_t P = mt_model_num_params(m);
    const uint64_t on_disk = est.place_class_peak[MT_PLACE_DISK][MT_MEM_PARAM];
    CHECK(on_disk >= 2 * P && on_disk < 2 * P + 64 * 4096);
    CHECK_EQ(est.place_class_peak[MT_PLACE_DISK][MT_MEM_OPTIM],
             res.place_class_peak[MT_PLACE_DISK][MT_MEM_OPTIM]);
    CHECK(est.place_class_peak[MT_PLACE_DISK][MT_MEM_OPTIM] > 0);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

/* I/O faults with the weights on disk: MT_ERR_IO naming the file, the
 * scratch directory gone; the weights after the trainer are finite (zeros
 * where they could not be read back). */
TEST(offload_params_io_faults)
{
    params_too = 1;
    io_faults(false, &cases[10]);
    params_too = 0;
}

/* param.bin removed or truncated between steps: the next step fails before
 * changing anything, naming it; get/set_params see the weights on disk. */
TEST(offload_params_removed_or_truncated)
{
    const char *dir = tmp_dir();
    params_too = 1;
    for (int k = 0; k < 2; k++) {
        const ocase c = {MT_OPT_ADAMW, MT_PREC_FP32, 1, k, 0.0f};
        lose_scratch_file(dir, &c, k, "param.bin", true);
    }
    params_too = 0;
    CHECK(rmdir(dir) == 0);
}

/* The trainer's end with the weights on disk: the offload's buffers (the
 * pieces' state and weights, the layer buffers) are freed before the
 * weights come back into the model whole, so the two never add up: at the
 * first weight made again, no OPTIM or PARAM is live. */
TEST(offload_params_end_frees_the_buffers_first)
{
    const char *dir = tmp_dir();
    mt_context *ctx;
    mt_model *m;
    mt_trainer *t;
    const ocase c = {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0.0f};
    params_too = 1;
    traced_step(dir, &c, &ctx, &m, &t);
    params_too = 0;
    const mt_trace_event *ev;
    size_t n0, n;
    uint64_t dropped;
    CHECK_OK(mt_context_trace_events(ctx, &ev, &n0, &dropped));
    mt_trainer_destroy(t);
    CHECK_OK(mt_context_trace_events(ctx, &ev, &n, &dropped));
    CHECK_EQ(dropped, 0);
    int64_t live[MT_MEM_COUNT] = {0};
    bool seen = false;
    for (size_t i = 0; i < n && !seen; i++) {
        if (ev[i].place != MT_PLACE_DEVICE) continue;
        const int sign = ev[i].op == MT_TRACE_ALLOC ? 1 : ev[i].op == MT_TRACE_FREE ? -1 : 0;
        if (i >= n0 && sign > 0 && ev[i].mem_class == MT_MEM_PARAM) {
            seen = true; /* the first weight back in the model */
            CHECK_EQ(live[MT_MEM_OPTIM], 0);
            CHECK_EQ(live[MT_MEM_PARAM], 0);
        }
        live[ev[i].mem_class] += sign * (int64_t)ev[i].bytes;
    }
    CHECK(seen);
    const size_t np = mt_model_num_params(m);
    float *w = check_alloc(np * 4);
    CHECK_OKC(ctx, mt_model_get_params(m, w, np));
    CHECK(scratch_gone(dir));
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    CHECK(rmdir(dir) == 0);
}

/* Training-state files with the weights on disk: the resident run's file,
 * loaded either way, training on to the same bits. */
TEST(offload_params_training_state_files) { training_state_cases(1); }
