/*
 * test_nccl_overlap.c - the gradients' collectives on NCCL's communication
 * stream (lib/comm/nccl_overlap.c), over the stand-in driver and the
 * stand-in libnccl, ranks as threads: the sums and their order, the
 * deadline, a rank without a gradient, and training against the blocking
 * NCCL step at ZeRO stages 0 to 2, with and without the fused step.
 * On a GPU (MT_TEST_GPU=1), with the real driver: the streams and events
 * (gpu_engine_stream_events, the bundle's engine group), and one rank of
 * NCCL on the communication stream with the libnccl.so.2 the library
 * finds (comm_nccl_one_rank_stream, and comm_nccl_one_rank_zero for the
 * jobs stage 2 and the fused step queue; its nccl group).
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "comm/comm.h"
#include "comm/cplan.h"
#include "comm/nccl_overlap.h"
#include "device/cuda_device.h"
#include "test_comm.h"
#include "tnccl.h"
#include "engine/engine.h"
#include "model/model.h"

static const char *fake_nccl(void)
{
    const char *v = getenv("MT_FAKE_NCCL");
    return v && *v ? v : NULL;
}

static bool stand_ins(void)
{
    if (fake_nccl() && check_fake_cuda() && getenv("MT_FAKE_CUBLASLT")) return true;
    fprintf(stderr, "    (skipped: needs MT_FAKE_NCCL, MT_FAKE_CUDA and MT_FAKE_CUBLASLT)\n");
    return false;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct ov_arg {
    tcomm_world *w;
    int n;           /* ranks */
    double timeout;  /* the NCCL communicator's deadline */
    int mode;        /* 0 sums, 1 a rank stops, 2 a rank has no gradient */
    double took[4];  /* each rank's wait, seconds */
    _Atomic int bad;
} ov_arg;

/* Rank `rank`'s NCCL communicator over the stand-in and a CUDA context on
 * it over the stand-in driver (NULL and a bad mark on failure). */
static mt_context *nccl_context(ov_arg *a, int rank, double timeout, mt_comm **comm)
{
    mt_comm *boot = tcomm_make(a->w, rank, a->n, 0), *c = NULL;
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    nc.nccl_path = nc.cuda_driver_path = fake_nccl();
    nc.timeout_seconds = timeout;
    nc.device_ordinal = rank; /* (one GPU per rank) */
    RANK_EXPECT(boot && !mt_comm_nccl_create_over(&nc, boot, &c));
    *comm = c;
    if (!c) {
        mt_comm_destroy(boot);
        return NULL;
    }
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CUDA;
    cc.cuda_driver_path = check_fake_cuda();
    cc.cublaslt_path = getenv("MT_FAKE_CUBLASLT");
    cc.comm = c;
    mt_context *ctx = NULL;
    RANK_EXPECT(!mt_context_create(&cc, &ctx));
    /* every rank's context made before any rank goes on (one that aborts
       its communicator must not fail another's creation) */
    RANK_EXPECT(!mt_comm_barrier(boot));
    mt_comm_destroy(boot);
    return ctx;
}

enum { T = 4, LEN = 300 };

/* A rank's communicator, context, stream for T tensors of numel[i] values
 * and a buffer of T * LEN values. */
typedef struct rank_kit {
    mt_comm *c;
    mt_context *ctx;
    mti_ncclov *ov;
    mt_block b;
} rank_kit;

static bool kit_open(ov_arg *a, int rank, const size_t *numel, rank_kit *k)
{
    memset(k, 0, sizeof *k);
    k->ctx = nccl_context(a, rank, a->timeout, &k->c);
    if (!k->ctx) {
        mt_comm_destroy(k->c);
        return false;
    }
    RANK_EXPECT(!mti_ncclov_new(k->ctx, T, numel, NULL, NULL, &k->ov));
    mt_alloc_request req = {.bytes = T * LEN * sizeof(float), .mem_class = MT_MEM_GRAD,
                            .lifetime = MT_LIFE_STEP};
    RANK_EXPECT(!mt_context_alloc(k->ctx, &req, &k->b));
    return true;
}

static void kit_close(rank_kit *k)
{
    mti_ncclov_free(k->ov);
    mt_context_free(k->ctx, &k->b);
    mt_context_destroy(k->ctx);
    mt_comm_destroy(k->c);
}

/* Four tensors of LEN values, rank r's tensor i holding r + i + k/7:
 * pushed in an order of the rank's own (rank 0 from the first, the others
 * from the last), so the stream must put them in one order. */
static void sums_rank(int rank, void *p)
{
    ov_arg *a = p;
    size_t numel[T] = {LEN, LEN, 0, LEN}; /* tensor 2 takes no part (frozen) */
    rank_kit kit;
    if (!kit_open(a, rank, numel, &kit)) return;
    mt_context *ctx = kit.ctx;
    mti_device *d = ctx->dev;
    mti_ncclov *ov = kit.ov;
    mt_block b = kit.b;
    RANK_EXPECT(mti_ncclov_possible(ctx));
    float h[T * LEN], blocking[T * LEN];
    for (int i = 0; i < T; i++)
        for (int k = 0; k < LEN; k++) h[i * LEN + k] = (float)(rank + i) + (float)k / 7.0f;
    float *g = b.ptr;
    /* the blocking collectives' sums, to compare bit for bit */
    RANK_EXPECT(!d->copy_h2d(d, g, h, sizeof h));
    for (int i = 0; i < T; i++)
        if (numel[i])
            RANK_EXPECT(!mti_comm_all_reduce(ctx, "test", g + i * LEN, g + i * LEN, LEN,
                                             MT_COMM_F32, MT_COMM_SUM));
    RANK_EXPECT(!d->copy_d2h(d, blocking, g, sizeof blocking) && !d->sync(d));
    mt_comm_stats before, after;
    mt_context_comm_stats(ctx, &before);
    void *main_stream = mti_cuda_stream(d);
    const unsigned long side0 = tnccl_calls(main_stream, 1);
    for (int round = 0; round < 2 && ov && !a->bad; round++) {
        RANK_EXPECT(!d->copy_h2d(d, g, h, sizeof h) && !d->sync(d));
        mti_ncclov_begin(ov);
        for (int j = 0; j < T; j++) {
            const int i = rank == 0 ? j : T - 1 - j;
            RANK_EXPECT(!mti_ncclov_push(ov, i, "t", numel[i] ? g + i * LEN : NULL));
            RANK_EXPECT(mti_ncclov_pushed(ov, i));
        }
        RANK_EXPECT(!mti_ncclov_wait(ov));
        float back[T * LEN];
        RANK_EXPECT(!d->copy_d2h(d, back, g, sizeof back) && !d->sync(d));
        for (int i = 0; i < T; i++) {
            const float *want = numel[i] ? blocking + i * LEN : h + i * LEN; /* (untouched) */
            RANK_EXPECT(!memcmp(back + i * LEN, want, LEN * sizeof(float)));
        }
    }
    /* three collectives a round, all on the communication stream, counted */
    RANK_EXPECT(tnccl_calls(main_stream, 1) - side0 == 6);
    mt_context_comm_stats(ctx, &after);
    RANK_EXPECT(after.collectives - before.collectives == 6);
    RANK_EXPECT(after.exposed_seconds >= before.exposed_seconds);
    /* pushing a tensor twice is a bug of the caller */
    mti_ncclov_begin(ov);
    RANK_EXPECT(!mti_ncclov_push(ov, 2, "t", NULL));
    RANK_EXPECT(mti_ncclov_push(ov, 2, "t", NULL) == MT_ERR_INTERNAL);
    RANK_EXPECT(mti_ncclov_wait(ov) == MT_ERR_INTERNAL); /* (not every tensor given) */
    kit_close(&kit);
}

/* The last rank stops after its first tensor (mode 1), or gives no
 * gradient for tensor 1 (mode 2): the others' wait fails with MT_ERR_COMM,
 * at the deadline (1) or as soon as the stopping rank aborts (2). */
static void fault_rank(int rank, void *p)
{
    ov_arg *a = p;
    const bool odd = rank == a->n - 1;
    size_t numel[T] = {LEN, LEN, LEN, LEN};
    rank_kit kit;
    if (!kit_open(a, rank, numel, &kit)) return;
    mt_context *ctx = kit.ctx;
    mt_comm *c = kit.c;
    mti_ncclov *ov = kit.ov;
    mt_block b = kit.b;
    float *g = b.ptr;
    if (ov && b.ptr) {
        mti_ncclov_begin(ov);
        const double t0 = now_s();
        for (int i = T - 1; i >= 0; i--) {
            if (odd && a->mode == 1 && i < T - 1) break; /* it stops */
            RANK_EXPECT(!mti_ncclov_push(ov, i, "t", odd && i == 1 ? NULL : g + i * LEN));
        }
        if (odd && a->mode == 1) {
            struct timespec nap = {0, (long)(a->timeout * 1.5e9)};
            nanosleep(&nap, NULL); /* (past the others' deadline) */
        } else {
            RANK_EXPECT(mti_ncclov_wait(ov) == MT_ERR_COMM);
            const char *m = mt_last_error(ctx);
            if (a->mode == 1) /* (its deadline, or another's abort heard first) */
                RANK_EXPECT((strstr(m, "not done after") && strstr(m, "aborted")) ||
                            strstr(m, "remote process exited"));
            else if (odd)
                RANK_EXPECT(strstr(m, "no gradient to sum") != NULL);
            RANK_EXPECT(mt_comm_broken(c));
            a->took[rank] = now_s() - t0;
        }
    }
    kit_close(&kit);
}

TEST(nccl_overlap_sums)
{
    if (!stand_ins()) return;
    for (int n = 2; n <= 3; n++) {
        ov_arg a = {.w = tcomm_world_new(n, 30.0), .n = n, .timeout = 30.0};
        tcomm_run(n, sums_rank, &a);
        tcomm_world_free(a.w);
        CHECK_MSG(!a.bad, "%d ranks", n);
    }
}

TEST(nccl_overlap_faults)
{
    if (!stand_ins()) return;
    for (int n = 2; n <= 3; n++) {
        ov_arg a = {.w = tcomm_world_new(n, 30.0), .n = n, .timeout = 0.4, .mode = 1};
        tcomm_run(n, fault_rank, &a);
        tcomm_world_free(a.w);
        CHECK_MSG(!a.bad, "a rank stops, %d ranks", n);
        /* the first rank whose deadline passed waited all of it (the others
           may hear of its abort before their own) */
        double most = 0.0;
        for (int r = 0; r < n - 1; r++) {
            CHECK_MSG(a.took[r] < 5.0, "rank %d waited %g s for a 0.4 s deadline", r, a.took[r]);
            if (a.took[r] > most) most = a.took[r];
        }
        CHECK_MSG(most >= 0.4, "no rank waited its 0.4 s deadline (%g s at most)", most);
        /* no gradient on one rank: it aborts, and the others hear of it long
           before their deadline */
        ov_arg b = {.w = tcomm_world_new(n, 30.0), .n = n, .timeout = 30.0, .mode = 2};
        tcomm_run(n, fault_rank, &b);
        tcomm_world_free(b.w);
        CHECK_MSG(!b.bad, "a rank without a gradient, %d ranks", n);
        for (int r = 0; r < n; r++)
            CHECK_MSG(b.took[r] < 5.0, "rank %d waited %g s", r, b.took[r]);
    }
}

/* ---- training: the stream against the blocking NCCL step ---- */

enum { STEPS = 3, ROWS = 2, SEQ = 8 };

typedef struct train_out {
    float loss[STEPS];
    float *w;
    size_t nw;
    uint64_t collectives;
    unsigned long side_calls;
    int n_trainable;
    char msg[256];
} train_out;

typedef struct tr_arg {
    tcomm_world *w;
    int n;
    int zero, fused; /* the ZeRO stage, the fused step */
    mt_precision prec;
    int inject; /* a kernel launch fails on one rank in the second step */
    train_out out[3];
    _Atomic int bad;
} tr_arg;

/* A symbol of the stand-in driver (kept loaded: its counters live on). */
static void *fake_cuda_sym(const char *name)
{
    static void *lib;
    if (!lib) lib = dlopen(check_fake_cuda(), RTLD_NOW | RTLD_LOCAL);
    return lib ? dlsym(lib, name) : NULL;
}

/* The stand-in driver's entry point `call` fails once (CUDA_ERROR_UNKNOWN)
 * after `skip` successful calls; skip < 0: no failure armed. */
static void fake_cuda_fail_at(const char *call, int skip)
{
    void (*f)(const char *, int, int) = NULL;
    void *sym = fake_cuda_sym("fake_cuda_fail");
    memcpy(&f, &sym, sizeof sym);
    if (f) f(skip < 0 ? "" : call, skip < 0 ? 0 : skip, 999);
}

static void fail_launch(int skip) { fake_cuda_fail_at("cuLaunchKernel", skip); }

static unsigned long long stream_waits(void)
{
    unsigned long long (*f)(const char *) = NULL;
    void *sym = fake_cuda_sym("fake_cuda_stat");
    memcpy(&f, &sym, sizeof sym);
    return f ? f("stream_waits") : 0;
}

/* A rank of a small GPT over NCCL (the stand-ins) and its trainer: the
 * tied table, one frozen tensor, clipping; two micro-batches unless fused;
 * a batch of the rank's own. */
typedef struct tiny {
    mt_comm *c;
    mt_context *ctx;
    mt_model *m;
    mt_trainer *t;
    mt_trainer_config tc;
    int32_t tok[ROWS * SEQ], tgt[ROWS * SEQ];
    mt_batch b;
    bool bad;
} tiny;

/* nccl_overlap_frozen: the final norm frozen too (the top of backward's
 * order), in one micro-batch */
static int freeze_top;

static mt_status tiny_open(tcomm_world *w, int n, int rank, double timeout, int zero, int fused,
                           mt_precision prec, tiny *x)
{
    static const char *const freeze1[] = {"wpe"}, *const freeze2[] = {"wpe", "lnf.*"};
    memset(x, 0, sizeof *x);
    ov_arg oa = {.w = w, .n = n};
    x->ctx = nccl_context(&oa, rank, timeout, &x->c);
    x->bad = oa.bad != 0;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    /* (in half precision the table padded to 512 rows, so its sum's fp32
       bucket outweighs the half-width gathers of every weight) */
    g.vocab = 50, g.padded_vocab = prec ? 512 : 64, g.max_seq = SEQ, g.layers = 2, g.heads = 2, g.channels = 16;
    g.seed = 3;
    mt_trainer_config *tc = &x->tc;
    mt_trainer_config_init(tc);
    tc->max_batch = ROWS;
    tc->grad_clip = 1.0f;
    tc->lr = 0.05f;
    tc->micro_batch = fused || freeze_top ? ROWS : 1; /* (the gradients final in the second
                                                         micro-batch's backward; the fused step
                                                         takes no accumulation) */
    tc->zero_stage = zero;
    tc->fused_step = fused;
    tc->precision = prec;
    tc->freeze = freeze_top ? freeze2 : freeze1;
    tc->n_freeze = freeze_top ? 2 : 1;
    for (int i = 0; i < ROWS * SEQ; i++)
        x->tok[i] = (i * 7 + rank) % 50, x->tgt[i] = (i * 3 + rank) % 50;
    x->b = (mt_batch){.n = ROWS, .tokens = x->tok, .targets = x->tgt, .seq_len = SEQ};
    mt_status s = x->ctx ? mt_model_gpt_create(x->ctx, &g, &x->m) : MT_ERR_NO_DEVICE;
    return s ? s : mt_trainer_create(x->m, tc, &x->t);
}

static void tiny_close(tiny *x)
{
    mt_trainer_destroy(x->t);
    mt_model_destroy(x->m);
    mt_context_destroy(x->ctx);
    mt_comm_destroy(x->c);
}

static void train_rank(int rank, void *p)
{
    tr_arg *a = p;
    train_out *o = &a->out[rank];
    tiny x;
    mt_status s = tiny_open(a->w, a->n, rank, 30.0, a->zero, a->fused, a->prec, &x);
    if (x.bad) a->bad = 1;
    mt_comm *c = x.c;
    mt_context *ctx = x.ctx;
    mt_model *m = x.m;
    mt_trainer *t = x.t;
    mt_trainer_config tc = x.tc;
    mt_batch b = x.b;
    void *main_stream = ctx ? mti_cuda_stream(ctx->dev) : NULL;
    const unsigned long side0 = tnccl_calls(main_stream, 1);
    for (int k = 0; k < STEPS && !s; k++) {
        if (!a->inject || k != 1) {
            s = mt_trainer_step(t, &b, &o->loss[k]);
            continue;
        }
        /* every rank out of the first step before the launch is set to
           fail; one rank's pass fails, its gradients still go (as zeros),
           and every rank's step fails at once (the status exchange), the
           communicator whole */
        RANK_EXPECT(!mt_comm_barrier(c));
        if (rank == 0) fail_launch(3);
        RANK_EXPECT(!mt_comm_barrier(c));
        const double t0 = now_s();
        RANK_EXPECT(mt_trainer_step(t, &b, &o->loss[k]) != MT_OK);
        RANK_EXPECT(now_s() - t0 < 10.0 && !mt_comm_broken(c));
        RANK_EXPECT(!mt_comm_barrier(c));
        if (rank == 0) fail_launch(-1); /* (none left over) */
        o->loss[k] = 0.0f;
    }
    o->side_calls = tnccl_calls(main_stream, 1) - side0;
    if (t) {
        o->n_trainable = 0;
        for (int i = 0; i < m->n_param; i++) o->n_trainable += !m->params[i].frozen;
    }
    mt_comm_stats cs = {0};
    if (ctx) mt_context_comm_stats(ctx, &cs);
    o->collectives = cs.collectives;
    mt_estimate_report e;
    if (!s) s = mt_estimate_model(m, &tc, &e);
    if (!s) {
        mt_memory_stats ms;
        mt_context_memory_stats(ctx, &ms);
        for (int k = 0; k < MT_MEM_COUNT && !s; k++)
            if (e.class_peak[k] != ms.per_class[k].peak_live_bytes) {
                snprintf(o->msg, sizeof o->msg, "%s peak %llu, estimate %llu",
                         mt_mem_class_name((mt_mem_class)k),
                         (unsigned long long)ms.per_class[k].peak_live_bytes,
                         (unsigned long long)e.class_peak[k]);
                s = MT_ERR_INTERNAL;
            }
    } else if (!o->msg[0]) {
        snprintf(o->msg, sizeof o->msg, "%s", ctx ? mt_last_error(ctx) : "no context");
    }
    mt_trainer_destroy(t);
    x.t = NULL;
    if (!s) {
        o->nw = mt_model_num_params(m);
        o->w = malloc(o->nw * sizeof *o->w);
        s = o->w ? mt_model_get_params(m, o->w, o->nw) : MT_ERR_OOM;
    }
    if (s) a->bad = 1;
    tiny_close(&x);
}

/* n ranks training at `zero` (fused: the fused step) with the stream
 * (run[0]) and without it (run[1], MT_NCCL_OVERLAP=0); waits[mode]: the
 * streams' waits for events (cuStreamWaitEvent) each made. */
static void train_modes(int n, int zero, int fused, mt_precision prec, tr_arg run[2],
                        unsigned long long waits[2])
{
    for (int mode = 0; mode < 2; mode++) {
        if (mode) setenv("MT_NCCL_OVERLAP", "0", 1);
        memset(&run[mode], 0, sizeof run[mode]);
        run[mode].w = tcomm_world_new(n, 30.0);
        run[mode].n = n;
        run[mode].zero = zero;
        run[mode].fused = fused;
        run[mode].prec = prec;
        const unsigned long long w0 = stream_waits();
        tcomm_run(n, train_rank, &run[mode]);
        waits[mode] = stream_waits() - w0;
        tcomm_world_free(run[mode].w);
        unsetenv("MT_NCCL_OVERLAP");
        for (int r = 0; r < n; r++)
            CHECK_MSG(!run[mode].bad, "%d ranks, stage %d%s%s, %s, rank %d: %s", n, zero,
                      fused ? " fused" : "", prec == MT_PREC_BF16 ? " bf16" : prec ? " fp16" : "",
                      mode ? "blocking" : "stream", r, run[mode].out[r].msg);
    }
}

/* Stage 0 on 2 and 3 ranks: with the stream (the default) and without it
 * (MT_NCCL_OVERLAP=0, the blocking step), the same losses and weights bit
 * for bit, the same number of collectives, each rank's peaks equal to its
 * estimate; the gradients' sums went on another stream than the
 * device's, one per trainable tensor and step, only with the stream. */
TEST(nccl_overlap_train)
{
    if (!stand_ins()) return;
    for (int n = 2; n <= 3; n++) {
        tr_arg run[2];
        unsigned long long waits[2];
        train_modes(n, 0, 0, MT_PREC_FP32, run, waits);
        /* the stream waited for backward's kernels, the device's for it */
        CHECK(waits[0] >= 2ull * STEPS * (unsigned long long)n);
        CHECK_EQ(waits[1], 0);
        for (int r = 0; r < n && !run[0].bad && !run[1].bad; r++) {
            const train_out *x = &run[0].out[r], *y = &run[1].out[r];
            CHECK(!memcmp(x->loss, y->loss, sizeof x->loss));
            CHECK(x->nw == y->nw && x->w && y->w && !memcmp(x->w, y->w, x->nw * sizeof *x->w));
            CHECK_EQ(x->collectives, y->collectives);
            CHECK_EQ(x->side_calls, (unsigned long)(STEPS * x->n_trainable));
            CHECK_EQ(y->side_calls, 0);
        }
        for (int mode = 0; mode < 2; mode++)
            for (int r = 0; r < n; r++) free(run[mode].out[r].w);
        /* a step that fails on one rank fails on all, at once; the next runs */
        tr_arg f = {.w = tcomm_world_new(n, 30.0), .n = n, .inject = 1};
        tcomm_run(n, train_rank, &f);
        tcomm_world_free(f.w);
        for (int r = 0; r < n; r++) {
            CHECK_MSG(!f.bad, "a failing launch, %d ranks, rank %d: %s", n, r, f.out[r].msg);
            free(f.out[r].w);
        }
    }
}

/* ZeRO stages 1 and 2 and the fused step (stages 0 to 2) on 2 and 3
 * ranks, with the stream and without it (MT_NCCL_OVERLAP=0), on gradients
 * the test fills in (tcomm_fill_grads; the stand-in's SGD kernel runs,
 * MT_FAKE_CUDA_SGD, so
 * the weights move by their sums): the same weights, bit for bit, the
 * same number of collectives, each rank's peaks equal to its
 * estimate (which plans the buckets the stream keeps); with the stream,
 * collectives went on another stream than the device's (stage 1: the
 * sums and the all-gathers of the updated weights, one each per trainable
 * tensor and step; stage 2 and the fused step: the reduce-scatters and
 * sums, at least one per tensor and step, and the gathers), without it
 * none did. */
TEST(nccl_overlap_zero)
{
    if (!stand_ins()) return;
    static const int cases[][2] = {{1, 0}, {2, 0}, {0, 1}, {1, 1}, {2, 1}}; /* stage, fused */
    mti_engine_grad_fill = tcomm_fill_grads;
    setenv("MT_FAKE_CUDA_SGD", "1", 1);
    for (int n = 2; n <= 3; n++)
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            tr_arg run[2];
            unsigned long long waits[2];
            train_modes(n, cases[c][0], cases[c][1], MT_PREC_FP32, run, waits);
            for (int r = 0; r < n && !run[0].bad && !run[1].bad; r++) {
                const train_out *x = &run[0].out[r], *y = &run[1].out[r];
                CHECK_MSG(x->nw == y->nw && x->w && y->w && !memcmp(x->w, y->w, x->nw * sizeof *x->w),
                          "%d ranks, case %zu: the weights differ", n, c);
                CHECK_EQ(x->collectives, y->collectives);
                if (cases[c][0] == 1 && !cases[c][1]) /* (the sums, then the gathers) */
                    CHECK_EQ(x->side_calls, (unsigned long)(2 * STEPS * x->n_trainable));
                else
                    CHECK_MSG(x->side_calls >= (unsigned long)(STEPS * (x->n_trainable - 1)),
                              "%d ranks, case %zu: %lu on the stream", n, c, x->side_calls);
                CHECK_EQ(y->side_calls, 0);
            }
            for (int mode = 0; mode < 2; mode++)
                for (int r = 0; r < n; r++) free(run[mode].out[r].w);
        }
    unsetenv("MT_FAKE_CUDA_SGD");
    mti_engine_grad_fill = NULL;
}

/* Stage 1 in bf16 and fp16 (the update's gathers move half-width weights,
 * smaller than the sums' fp32 buckets) on 2 and 3 ranks, with the stream
 * and without it: each rank's peaks equal to its estimate in both (the
 * dry run allocates what the stream's in-place sums do: no bucket), the
 * same number of collectives, the sums and gathers on the stream. (The
 * stand-in's update runs on fp32 weights only, so the weights are not
 * compared here; nccl_overlap_zero compares them in fp32.) */
TEST(nccl_overlap_zero_half)
{
    if (!stand_ins()) return;
    static const mt_precision precs[] = {MT_PREC_BF16, MT_PREC_FP16};
    for (int n = 2; n <= 3; n++)
        for (int p = 0; p < 2; p++) {
            tr_arg run[2];
            unsigned long long waits[2];
            train_modes(n, 1, 0, precs[p], run, waits);
            for (int r = 0; r < n && !run[0].bad && !run[1].bad; r++) {
                const train_out *x = &run[0].out[r], *y = &run[1].out[r];
                CHECK_EQ(x->collectives, y->collectives);
                CHECK_EQ(x->side_calls, (unsigned long)(2 * STEPS * x->n_trainable));
                CHECK_EQ(y->side_calls, 0);
            }
            for (int mode = 0; mode < 2; mode++)
                for (int r = 0; r < n; r++) free(run[mode].out[r].w);
        }
}

/* The calls each rank had queued on its other streams when backward began
 * (the tied table's gradient, made first, at the head) and when it made
 * the first layer's first gradient (near its end), in the last step. */
static unsigned long at_head[3], at_low[3];

static mt_status watching_fill(mt_context *ctx, int param, size_t at, float *g, size_t n)
{
    if (ctx->rank < 3 && (param == 0 || param == 2)) {
        const unsigned long k = tnccl_calls(mti_cuda_stream(ctx->dev), 1);
        *(param ? &at_low[ctx->rank] : &at_head[ctx->rank]) = k;
    }
    return tcomm_fill_grads(ctx, param, at, g, n);
}

/* Stages 0 and 1 with the top of backward's order frozen (the final norm,
 * besides wpe) on 2 and 3 ranks, with the stream and without it: the same
 * weights bit for bit, the same number of collectives, each rank's peaks
 * its estimate's; with the stream the sums went on it, and the tensors
 * below the frozen ones were queued during backward (before the first
 * layer's gradients were made), not held back until it ended. */
TEST(nccl_overlap_frozen)
{
    if (!stand_ins()) return;
    mti_engine_grad_fill = watching_fill;
    setenv("MT_FAKE_CUDA_SGD", "1", 1);
    freeze_top = 1;
    for (int n = 2; n <= 3; n++)
        for (int zero = 0; zero <= 1; zero++) {
            tr_arg run[2];
            unsigned long long waits[2];
            train_modes(n, zero, 0, MT_PREC_FP32, run, waits);
            for (int r = 0; r < n && !run[0].bad && !run[1].bad; r++) {
                const train_out *x = &run[0].out[r], *y = &run[1].out[r];
                CHECK_MSG(x->nw == y->nw && x->w && y->w && !memcmp(x->w, y->w, x->nw * sizeof *x->w),
                          "%d ranks, stage %d: the weights differ", n, zero);
                CHECK_EQ(x->collectives, y->collectives);
                CHECK_EQ(x->side_calls, (unsigned long)((zero + 1) * STEPS * x->n_trainable));
                CHECK_EQ(y->side_calls, 0);
            }
            /* (run[1], the blocking step, ran last: run the stream's again for the marks) */
            tr_arg again = {.w = tcomm_world_new(n, 30.0), .n = n, .zero = zero};
            tcomm_run(n, train_rank, &again);
            tcomm_world_free(again.w);
            for (int r = 0; r < n; r++) {
                CHECK_MSG(!again.bad && at_low[r] > at_head[r],
                          "%d ranks, stage %d, rank %d: %lu sums queued before the first layer's "
                          "gradients", n, zero, r, at_low[r] - at_head[r]);
                free(again.out[r].w);
            }
            for (int mode = 0; mode < 2; mode++)
                for (int r = 0; r < n; r++) free(run[mode].out[r].w);
        }
    freeze_top = 0;
    unsetenv("MT_FAKE_CUDA_SGD");
    mti_engine_grad_fill = NULL;
}

/* ---- a rank that stalls while the others' collectives are on the stream ---- */

static _Atomic int stall_armed; /* the last rank sleeps in its next backward */
static double stall_for;

static mt_status stalling_fill(mt_context *ctx, int param, size_t at, float *g, size_t n)
{
    if (ctx->rank == ctx->world - 1 && param == 3 && atomic_exchange(&stall_armed, 0)) {
        struct timespec nap = {(time_t)stall_for, (long)((stall_for - (double)(time_t)stall_for) * 1e9)};
        nanosleep(&nap, NULL); /* (past the others' deadline) */
    }
    return tcomm_fill_grads(ctx, param, at, g, n);
}

typedef struct stall_arg {
    tcomm_world *w;
    int n, zero, fused;
    bool in_fill;      /* (local_fault_rank) rank 0's failure: its backward's, else a stream wait's */
    double took[3];
    mt_status got[3];  /* (nccl_overlap_local_fault) */
    bool broken[3];
    char msg[3][256];
    _Atomic int bad;
} stall_arg;

static void stall_rank(int rank, void *p)
{
    stall_arg *a = p;
    tiny x;
    mt_status s = tiny_open(a->w, a->n, rank, 0.4, a->zero, a->fused, MT_PREC_FP32, &x);
    float loss;
    if (!s) s = mt_trainer_step(x.t, &x.b, &loss);
    RANK_EXPECT(!s && !x.bad);
    if (!s) {
        RANK_EXPECT(!mt_comm_barrier(x.c)); /* (a blocking collective: the stream is idle) */
        if (rank == 0) atomic_store(&stall_armed, 1);
        RANK_EXPECT(!mt_comm_barrier(x.c));
        const double t0 = now_s();
        s = mt_trainer_step(x.t, &x.b, &loss);
        a->took[rank] = now_s() - t0;
        snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(x.ctx));
        RANK_EXPECT(s != MT_OK);
        if (rank != a->n - 1) RANK_EXPECT(s == MT_ERR_COMM && mt_comm_broken(x.c));
    }
    tiny_close(&x);
}

/* Stage 2, the fused step at stage 1, and stage 3 (prefetch 1, with and
 * without the fused step) with the stream, 2 and 3 ranks: the last rank
 * stalls in its second step's backward (0.8 s, past the 0.4 s deadline)
 * while the others' reduce-scatters (and gathers) are on their streams:
 * they stop with MT_ERR_COMM, their communicator aborted, well before the
 * stalled rank wakes plus a margin, and nothing hangs. */
TEST(nccl_overlap_zero_stall)
{
    if (!stand_ins()) return;
    static const int cases[][2] = {{2, 0}, {1, 1}, {3, 0}, {3, 1}};
    stall_for = 0.8;
    mti_engine_grad_fill = stalling_fill;
    for (int n = 2; n <= 3; n++)
        for (int c = 0; c < 4; c++) {
            stall_arg a = {.w = tcomm_world_new(n, 30.0), .n = n, .zero = cases[c][0],
                           .fused = cases[c][1]};
            tcomm_run(n, stall_rank, &a);
            tcomm_world_free(a.w);
            atomic_store(&stall_armed, 0);
            CHECK_MSG(!a.bad, "%d ranks, stage %d%s", n, cases[c][0], cases[c][1] ? " fused" : "");
            for (int r = 0; r < n - 1; r++) {
                CHECK_MSG(a.took[r] >= 0.4 && a.took[r] < 5.0, "rank %d took %g s", r, a.took[r]);
                /* (stage 3's fused step reduce-scatters in its hooks, on the device's stream) */
                CHECK_MSG((c == 3 || strstr(a.msg[r], "on the communication stream")) &&
                              (strstr(a.msg[r], "not done after 0.4 s") ||
                               strstr(a.msg[r], "remote process exited")),
                          "rank %d: %s", r, a.msg[r]);
            }
        }
    mti_engine_grad_fill = NULL;
}

/* ---- a local failure beside the stream ---- */

static _Atomic int fail_armed; /* rank 0 fails in its next backward */

static mt_status failing_fill(mt_context *ctx, int param, size_t at, float *g, size_t n)
{
    if (ctx->rank == 0 && param == 3 && atomic_exchange(&fail_armed, 0))
        return mti_fail(ctx, MT_ERR_DEVICE, "an injected failure in backward");
    return tcomm_fill_grads(ctx, param, at, g, n);
}

static void local_fault_rank(int rank, void *p)
{
    stall_arg *a = p;
    tiny x;
    mt_status s = tiny_open(a->w, a->n, rank, 20.0, a->zero, a->fused, MT_PREC_FP32, &x);
    float loss;
    if (!s) s = mt_trainer_step(x.t, &x.b, &loss);
    RANK_EXPECT(!s && !x.bad);
    if (!s) {
        RANK_EXPECT(!mt_comm_barrier(x.c));
        /* the next wait of a stream for an event (made only by the
           communication stream's code) fails on one of the ranks, or its
           next backward */
        if (rank == 0 && a->in_fill) atomic_store(&fail_armed, 1);
        else if (rank == 0) fake_cuda_fail_at("cuStreamWaitEvent", 0);
        RANK_EXPECT(!mt_comm_barrier(x.c));
        const double t0 = now_s();
        a->got[rank] = mt_trainer_step(x.t, &x.b, &loss);
        a->took[rank] = now_s() - t0;
        a->broken[rank] = mt_comm_broken(x.c);
        snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(x.ctx));
    }
    tiny_close(&x);
}

/* Stage 0 (the sums) and stage 2 (the reduce-scatters, a job) on the
 * stream, 2 and 3 ranks: a stream's wait for an event fails on one rank
 * in the second step's backward, so that rank stops queueing collectives
 * the others' wait for; the communicator is aborted there at once, before
 * any buffer is freed, and every rank's step gives MT_ERR_COMM, its
 * communicator broken, well before the 20 s deadline. */
TEST(nccl_overlap_local_fault)
{
    if (!stand_ins()) return;
    static const int stages[] = {0, 2};
    for (int n = 2; n <= 3; n++)
        for (int c = 0; c < 2; c++) {
            stall_arg a = {.w = tcomm_world_new(n, 30.0), .n = n, .zero = stages[c]};
            tcomm_run(n, local_fault_rank, &a);
            tcomm_world_free(a.w);
            fake_cuda_fail_at("", -1); /* (none left over) */
            CHECK_MSG(!a.bad, "%d ranks, stage %d", n, stages[c]);
            for (int r = 0; r < n; r++)
                CHECK_MSG(a.got[r] == MT_ERR_COMM && a.broken[r] && a.took[r] < 5.0,
                          "%d ranks, stage %d, rank %d: status %d after %g s: %s", n, stages[c], r,
                          (int)a.got[r], a.took[r], a.msg[r]);
        }
}

enum { N = 1 << 20 };

/* One rank of NCCL on a CUDA context (tnccl_one_rank), two host buffers of
 * N values and a block of k x N on the device; NULL when the test cannot
 * run. */
static mt_context *one_rank_kit(mt_context **first, mt_comm **c, size_t k, float **h, float **back,
                                mt_block *b)
{
    mt_context *ctx = tnccl_one_rank(first, c);
    if (!ctx) return NULL;
    *h = malloc(N * sizeof **h);
    *back = malloc(N * sizeof **back);
    CHECK(*h && *back);
    mt_alloc_request req = {.bytes = k * N * sizeof(float), .mem_class = MT_MEM_GRAD,
                            .lifetime = MT_LIFE_STEP};
    CHECK_OK(mt_context_alloc(ctx, &req, b));
    return ctx;
}

/* What one_rank_kit made, freed. */
static void kit_free(mt_context *ctx, mt_context *first, mt_comm *c, mt_block *b, float *h,
                     float *back)
{
    mt_context_free(ctx, b);
    free(h);
    free(back);
    tnccl_free(ctx, first, c);
}

/* One rank on a GPU (MT_TEST_GPU=1, with the real driver and the
 * libnccl.so.2 the library finds; the stand-ins otherwise): copies on the
 * device's stream write two 4 MiB tensors, each given to the
 * communication stream right after its copy is queued (no host wait
 * between), whose all-reduce (one rank: the values as they are) must run
 * after the copy; after the wait the device's stream reads them back, and
 * they must be the values written; the collectives are counted and timed. */
TEST(comm_nccl_one_rank_stream)
{
    const bool gpu = tnccl_gpu();
    mt_context *first, *ctx;
    mt_comm *c;
    float *h, *back;
    mt_block b = {0};
    if (!(ctx = one_rank_kit(&first, &c, 2, &h, &back, &b))) return;
    CHECK(!mti_ncclov_possible(ctx)); /* one rank: nothing to sum in a step */
    mti_device *d = ctx->dev;
    size_t numel[2] = {N, N};
    mti_ncclov *ov = NULL;
    CHECK_OK(mti_ncclov_new(ctx, 2, numel, NULL, NULL, &ov));
    float *g = b.ptr;
    for (int round = 0; round < 3 && ov && g && h && back; round++) {
        for (int i = 0; i < N; i++) h[i] = (float)((i + round) % 1013) - 500.0f;
        mti_ncclov_begin(ov);
        /* written on the device's stream, queued behind it: no host wait */
        CHECK_OK(d->copy_h2d(d, g + N, h, N * sizeof *h));
        CHECK_OK(mti_ncclov_push(ov, 1, "b", g + N));
        CHECK_OK(d->copy_d2d(d, g, g + N, N * sizeof *h));
        CHECK_OK(mti_ncclov_push(ov, 0, "a", g));
        CHECK_MSG(mti_ncclov_wait(ov) == MT_OK, "%s", mt_last_error(ctx));
        CHECK_OK(d->copy_d2h(d, back, g, N * sizeof *back));
        CHECK_OK(d->sync(d));
        CHECK_MSG(!memcmp(back, h, N * sizeof *h), "round %d: the sum differs", round);
        CHECK_OK(d->copy_d2h(d, back, g + N, N * sizeof *back));
        CHECK_OK(d->sync(d));
        CHECK_MSG(!memcmp(back, h, N * sizeof *h), "round %d: the second sum differs", round);
    }
    mt_comm_stats cs;
    CHECK_OK(mt_context_comm_stats(ctx, &cs));
    CHECK_EQ(cs.collectives, 6);
    if (gpu) CHECK_MSG(cs.seconds > 0.0, "the collectives took %g s", cs.seconds);
    mti_ncclov_free(ov);
    kit_free(ctx, first, c, &b, h, back);
}

/* comm_nccl_one_rank_zero's job: tensor i's values packed into its bucket
 * on the device's stream, then a reduce-scatter of the bucket in place and
 * an all-reduce of the tensor in place, both queued on the communication
 * stream (posted, not waited for). */
typedef struct job_kit {
    mt_context *ctx;
    float *bucket[2];
    size_t n;
    float *base; /* the calls' pieces */
} job_kit;

static mt_status pack_job(void *user, int i, float *g)
{
    job_kit *k = user;
    mti_device *d = k->ctx->dev;
    mt_status s = d->copy_d2d(d, k->bucket[i], g, k->n * sizeof(float));
    if (!s) s = mti_comm_reduce_scatter(k->ctx, "test", k->bucket[i], k->bucket[i], k->n, MT_COMM_F32,
                                        MT_COMM_SUM);
    if (!s) s = mti_comm_all_reduce(k->ctx, "test", g, g, k->n, MT_COMM_F32, MT_COMM_SUM);
    return s;
}

/* A call (as ZeRO-3's queued gathers and reduce-scatters are made): the
 * sum of piece j of 1024 values at base, in place. */
static mt_status sum_call(void *user, int j)
{
    job_kit *k = user;
    float *p = k->base + (size_t)j * 1024;
    return mti_comm_all_reduce(k->ctx, "test", p, p, 1024, MT_COMM_F32, MT_COMM_SUM);
}

/* The stream's jobs on one rank (on a GPU with MT_TEST_GPU=1, the real
 * driver and libnccl.so.2; the stand-ins otherwise), as stage 2 and the
 * fused step use them: each tensor written by a copy on the device's
 * stream and given at once (no host wait), the job packing it into a
 * bucket on the device's stream and queueing its collectives behind an
 * event; the first tensor waited for alone (its event), read back through
 * the device's stream, then the rest. The values must be the ones written
 * (one rank: the sums are the values), and every collective counted. Then
 * calls (ZeRO-3's kind), more than are kept in flight; and a trim that
 * gives a segment back to the driver right after a call is queued (the
 * release guard's wait for the stream, with the real driver on a GPU). */
TEST(comm_nccl_one_rank_zero)
{
    mt_context *first, *ctx;
    mt_comm *c;
    float *h, *back;
    mt_block b = {0};
    if (!(ctx = one_rank_kit(&first, &c, 4, &h, &back, &b))) return;
    mti_device *d = ctx->dev;
    float *g = b.ptr;
    job_kit k = {.ctx = ctx, .bucket = {g + 2 * N, g + 3 * N}, .n = N};
    size_t numel[2] = {N, N};
    mti_ncclov *ov = NULL;
    mt_comm_stats before, after;
    CHECK_OK(mt_context_comm_stats(ctx, &before));
    CHECK_OK(mti_ncclov_new(ctx, 2, numel, pack_job, &k, &ov));
    for (int round = 0; round < 3 && ov && g && h && back; round++) {
        for (int i = 0; i < N; i++) h[i] = (float)((i * 7 + round) % 1021) - 510.0f;
        mti_ncclov_begin(ov);
        CHECK_OK(d->copy_h2d(d, g + N, h, N * sizeof *h));
        CHECK_OK(mti_ncclov_push(ov, 1, "b", g + N));
        CHECK_OK(d->copy_d2d(d, g, g + N, N * sizeof *h));
        CHECK_OK(mti_ncclov_push(ov, 0, "a", g));
        CHECK_MSG(mti_ncclov_wait_first(ov, 1) == MT_OK, "%s", mt_last_error(ctx));
        CHECK_OK(d->copy_d2h(d, back, k.bucket[1], N * sizeof *back));
        CHECK_OK(d->sync(d));
        CHECK_MSG(!memcmp(back, h, N * sizeof *h), "round %d: the first bucket differs", round);
        CHECK_MSG(mti_ncclov_wait(ov) == MT_OK, "%s", mt_last_error(ctx));
        for (int j = 0; j < 3; j++) {
            const float *src = j == 0 ? g : j == 1 ? g + N : k.bucket[0];
            CHECK_OK(d->copy_d2h(d, back, src, N * sizeof *back));
            CHECK_OK(d->sync(d));
            CHECK_MSG(!memcmp(back, h, N * sizeof *h), "round %d: buffer %d differs", round, j);
        }
    }
    CHECK_OK(mt_context_comm_stats(ctx, &after));
    CHECK_EQ(after.collectives - before.collectives, 12);
    CHECK(mti_ncclov_wait_first(ov, 3) == MT_ERR_INTERNAL); /* (two given) */
    /* calls, as ZeRO-3 queues its gathers: 70 of them (more than are kept
       in flight, so the oldest are waited for on the way), each summing a
       piece of its own written just before on the device's stream; the
       last waited for, then the first again (done already) */
    enum { CALLS_MADE = 70, PIECE = 1024 };
    uint64_t tk[CALLS_MADE] = {0};
    k.base = g;
    for (int j = 0; j < CALLS_MADE && ov && h && back; j++) {
        for (int e = 0; e < PIECE; e++) h[j * PIECE + e] = (float)(j * 3 + e);
        CHECK_OK(d->copy_h2d(d, g + j * PIECE, h + j * PIECE, PIECE * sizeof *h));
        CHECK_OK(mti_ncclov_call(ov, sum_call, &k, j, &tk[j]));
    }
    CHECK_MSG(mti_ncclov_done(ov, tk[CALLS_MADE - 1]) == MT_OK, "%s", mt_last_error(ctx));
    CHECK_OK(mti_ncclov_done(ov, tk[0]));
    CHECK_OK(d->copy_d2h(d, back, g, CALLS_MADE * PIECE * sizeof *back));
    CHECK_OK(d->sync(d));
    CHECK_MSG(!memcmp(back, h, CALLS_MADE * PIECE * sizeof *h), "a call's sum differs");
    /* a segment going back to the driver (a trim) right after a call is
       queued: the release waits for the stream first (the device's release
       guard), then frees, and the call is done and whole */
    mt_block big = {0};
    mt_alloc_request rb = {.bytes = 8u << 20, .mem_class = MT_MEM_ACT, .lifetime = MT_LIFE_STEP};
    mt_allocator *al = NULL;
    mt_allocator_stats as0, as1;
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_ACT, &al));
    CHECK_OK(mt_context_alloc(ctx, &rb, &big));
    CHECK_OK(mt_context_free(ctx, &big));
    CHECK_OK(mt_allocator_get_stats(al, &as0));
    CHECK_OK(mti_ncclov_call(ov, sum_call, &k, 1, &tk[1]));
    CHECK_OK(mt_allocator_trim(al));
    CHECK_OK(mt_allocator_get_stats(al, &as1));
    CHECK_MSG(as1.reserved_bytes < as0.reserved_bytes, "the trim gave back nothing (%llu bytes "
              "reserved before, %llu after)", (unsigned long long)as0.reserved_bytes,
              (unsigned long long)as1.reserved_bytes);
    CHECK(!ctx->dev->release_held);
    CHECK_MSG(mti_ncclov_done(ov, tk[1]) == MT_OK, "%s", mt_last_error(ctx));
    CHECK_OK(mti_ncclov_quiet(ov, false));
    mti_ncclov_free(ov);
    kit_free(ctx, first, c, &b, h, back);
}

/* Each collective on the communication stream counts once in the
 * communication time: its time on the stream (its timing events), not
 * also the host's time queueing it. The stand-in driver's events keep a
 * clock of their own that each record moves on by 1 ms
 * (MT_FAKE_CUDA_CLOCK_US), so the time counted is a whole number of
 * milliseconds unless host time got in. A job's collectives (a
 * reduce-scatter and an all-reduce per tensor, as stage 2 queues them)
 * and calls (ZeRO-3's kind), one rank over the stand-ins. */
TEST(nccl_overlap_time_once)
{
    if (!stand_ins()) return;
    setenv("MT_FAKE_CUDA_CLOCK_US", "1000", 1);
    mt_context *first, *ctx;
    mt_comm *c;
    float *h, *back;
    mt_block b = {0};
    ctx = one_rank_kit(&first, &c, 4, &h, &back, &b);
    unsetenv("MT_FAKE_CUDA_CLOCK_US"); /* (read when a context opens the driver) */
    if (!ctx) return;
    float *g = b.ptr;
    job_kit k = {.ctx = ctx, .bucket = {g + 2 * N, g + 3 * N}, .n = 4096, .base = g};
    size_t numel[2] = {4096, 4096};
    mti_ncclov *ov = NULL;
    CHECK_OK(mti_ncclov_new(ctx, 2, numel, pack_job, &k, &ov));
    const uint64_t ns0 = atomic_load(&ctx->comm->ns), calls0 = atomic_load(&ctx->comm->calls);
    mti_ncclov_begin(ov);
    CHECK_OK(mti_ncclov_push(ov, 1, "b", g + N));
    CHECK_OK(mti_ncclov_push(ov, 0, "a", g));
    CHECK_MSG(mti_ncclov_wait(ov) == MT_OK, "%s", mt_last_error(ctx));
    uint64_t tk = 0;
    for (int j = 0; j < 3; j++) CHECK_OK(mti_ncclov_call(ov, sum_call, &k, j, &tk));
    CHECK_MSG(mti_ncclov_done(ov, tk) == MT_OK, "%s", mt_last_error(ctx));
    const uint64_t ns = atomic_load(&ctx->comm->ns) - ns0;
    CHECK_EQ(atomic_load(&ctx->comm->calls) - calls0, 7);
    CHECK_MSG(ns > 0 && ns % 1000000 == 0,
              "the stream's collectives counted %llu ns: not whole milliseconds of the events' "
              "clock (the host's time queueing them counted too)", (unsigned long long)ns);
    mti_ncclov_free(ov);
    kit_free(ctx, first, c, &b, h, back);
}

/* The device layer's streams and events for it, and the driver's rules
 * the stand-in keeps (on a GPU with MT_TEST_GPU=1, the real driver's):
 * a stream waits on an event never recorded without error; elapsed time
 * needs two recorded timing events. */
TEST(gpu_engine_stream_events)
{
    const bool gpu = tnccl_gpu();
    if (!gpu && !check_fake_cuda()) {
        fprintf(stderr, "    (skipped: needs MT_TEST_GPU=1 or MT_FAKE_CUDA)\n");
        return;
    }
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CUDA;
    cc.cuda_driver_path = gpu ? NULL : check_fake_cuda();
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cc, &ctx));
    if (!ctx) return;
    mti_device *d = ctx->dev;
    void *q = NULL, *a = NULL, *b = NULL, *plain = NULL;
    CHECK_OK(mti_cuda_stream_new(d, &q));
    CHECK_OK(mti_cuda_event_new_timed(d, &a));
    CHECK_OK(mti_cuda_event_new_timed(d, &b));
    CHECK_OK(mti_cuda_event_new(d, &plain));
    float ms = -1.0f;
    /* the calls the driver must refuse, except under compute-sanitizer
       (the bundle's memcheck group), which counts every refused call as
       an error */
    const bool refusals = !getenv("MT_TEST_MEMCHECK");
    if (refusals) CHECK_ST(MT_ERR_DEVICE, mti_cuda_elapsed(d, a, b, &ms)); /* never recorded */
    CHECK_OK(mti_cuda_stream_wait(d, q, plain));             /* never recorded: no wait */
    CHECK_OK(mti_cuda_record(d, plain, NULL));
    CHECK_OK(mti_cuda_stream_wait(d, q, plain));
    CHECK_OK(mti_cuda_record(d, a, q));
    CHECK_OK(mti_cuda_record(d, b, q));
    CHECK_OK(mti_cuda_stream_wait(d, NULL, b));
    CHECK_OK(d->sync(d));
    CHECK_OK(mti_cuda_event_wait(d, b));
    CHECK_OK(mti_cuda_elapsed(d, a, b, &ms));
    CHECK(ms >= 0.0f && ms < 1000.0f);
    CHECK_OK(mti_cuda_record(d, plain, q));
    CHECK_OK(mti_cuda_event_wait(d, plain));
    bool done = false;
    CHECK_OK(mti_cuda_event_done(d, plain, &done)); /* (waited for: done) */
    CHECK(done);
    if (refusals) CHECK_ST(MT_ERR_DEVICE, mti_cuda_elapsed(d, a, plain, &ms)); /* no timing */
    mti_cuda_event_free(d, plain);
    mti_cuda_event_free(d, a);
    mti_cuda_event_free(d, b);
    mti_cuda_stream_free(d, q);
    mt_context_destroy(ctx);
}

/* ---- memory going back to the driver under a collective on the stream ---- */

typedef struct release_arg {
    tcomm_world *w;
    int n;
    bool stuck;         /* the collective outlives the abort (kernels that never exit) */
    _Atomic int done0;  /* rank 0 is through */
    double took;        /* rank 0's trim */
    unsigned long long busy; /* cuMemFree / cuMemUnmap calls made under the collective */
    long long dropped;  /* device bytes the trim gave back */
    char msg[512];
    _Atomic int bad;
} release_arg;

typedef struct one_call {
    mt_context *ctx;
    float *g;
} one_call;

static mt_status sum_one(void *user, int i)
{
    one_call *k = user;
    (void)i;
    return mti_comm_all_reduce(k->ctx, "test", k->g, k->g, 1024, MT_COMM_F32, MT_COMM_SUM);
}

static unsigned long long fake_cuda_count(const char *name)
{
    unsigned long long (*f)(const char *) = NULL;
    void *sym = fake_cuda_sym("fake_cuda_stat");
    memcpy(&f, &sym, sizeof sym);
    return f ? f(name) : ~0ull;
}

static void fake_nccl_stuck_set(int on)
{
    void *lib = dlopen(fake_nccl(), RTLD_NOW | RTLD_LOCAL);
    void *sym = lib ? dlsym(lib, "fake_nccl_stuck") : NULL;
    void (*f)(int) = NULL;
    memcpy(&f, &sym, sizeof sym);
    if (f) f(on);
    if (lib) dlclose(lib);
}

/* Rank 0 queues a collective on its communication stream that rank 1
 * never joins (a stalled peer), then trims its allocator, whose cached
 * segment goes back to the driver; rank 1 waits until rank 0 is through. */
static void release_rank(int rank, void *p)
{
    release_arg *a = p;
    mt_comm *c = NULL;
    mt_context *ctx = nccl_context(&(ov_arg){.w = a->w, .n = a->n}, rank, 0.5, &c);
    mti_ncclov *ov = NULL;
    mt_block g = {0}, big = {0};
    size_t numel[1] = {1024};
    if (ctx) RANK_EXPECT(!mti_ncclov_new(ctx, 1, numel, NULL, NULL, &ov));
    mt_alloc_request req = {.bytes = 1024 * sizeof(float), .mem_class = MT_MEM_GRAD,
                            .lifetime = MT_LIFE_STEP};
    if (ov) RANK_EXPECT(!mt_context_alloc(ctx, &req, &g));
    if (rank == 0 && g.ptr) {
        mt_alloc_request rb = {.bytes = 8u << 20, .mem_class = MT_MEM_ACT,
                               .lifetime = MT_LIFE_STEP};
        mt_allocator *al = NULL;
        RANK_EXPECT(!mt_context_allocator(ctx, MT_MEM_ACT, &al));
        RANK_EXPECT(!mt_context_alloc(ctx, &rb, &big));
        RANK_EXPECT(!mt_context_free(ctx, &big)); /* (cached) */
        one_call k = {ctx, g.ptr};
        uint64_t tk = 0;
        RANK_EXPECT(!mti_ncclov_call(ov, sum_one, &k, 0, &tk));
        if (a->stuck) fake_nccl_stuck_set(1);
        const unsigned long long busy0 = fake_cuda_count("busy_frees"), used0 = fake_cuda_count("used");
        const double t0 = now_s();
        RANK_EXPECT(al && !mt_allocator_trim(al));
        a->took = now_s() - t0;
        a->busy = fake_cuda_count("busy_frees") - busy0;
        a->dropped = (long long)used0 - (long long)fake_cuda_count("used");
        RANK_EXPECT(mti_ncclov_done(ov, tk) == MT_ERR_COMM);
        snprintf(a->msg, sizeof a->msg, "%s", mt_last_error(ctx));
        RANK_EXPECT(mt_comm_broken(c));
        RANK_EXPECT(ctx->dev->release_held == a->stuck);
        if (a->stuck) { /* (the test's own clean-up: the work is gone now) */
            fake_nccl_stuck_set(0);
            ctx->dev->release_held = false;
        }
        atomic_store(&a->done0, 1);
    } else {
        for (int k = 0; k < 2000 && !atomic_load(&a->done0); k++) {
            struct timespec nap = {0, 10 * 1000 * 1000};
            nanosleep(&nap, NULL);
        }
    }
    if (ctx) mt_context_free(ctx, &g);
    mti_ncclov_free(ov);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

/* A segment going back to the driver (a trim) while a collective whose
 * peer stalled is on the communication stream: cuMemFree and cuMemUnmap
 * wait for the whole device, so made then they would block for good.
 * The release first waits for the stream up to the communicator's
 * deadline (0.5 s): then the communicator is aborted (which ends the
 * collective), the collective's wait reports MT_ERR_COMM naming the
 * release, and the memory goes back with nothing in flight. When the
 * collective outlives the abort (stuck), the memory is kept instead
 * (never given back while the work may use it). With growable ranges
 * (cuMemUnmap) and with plain segments (cuMemFree). */
TEST(nccl_overlap_release_in_flight)
{
    if (!stand_ins()) return;
    for (int k = 0; k < 4; k++) {
        const int stuck = k % 2, plain = k / 2; /* plain: cuMemAlloc'd segments, no VMM */
        if (plain) setenv("MT_FAKE_CUDA_NO_VMM", "1", 1);
        release_arg a = {.w = tcomm_world_new(2, 30.0), .n = 2, .stuck = stuck};
        tcomm_run(2, release_rank, &a);
        tcomm_world_free(a.w);
        unsetenv("MT_FAKE_CUDA_NO_VMM");
        CHECK_MSG(!a.bad, "stuck %d, plain %d", stuck, plain);
        CHECK_MSG(a.busy == 0, "stuck %d: %llu releases to the driver under the collective",
                  stuck, a.busy);
        CHECK_MSG(a.took >= 0.5 && a.took < 5.0, "stuck %d: the trim took %g s (deadline 0.5 s)",
                  stuck, a.took);
        CHECK_MSG(stuck ? a.dropped == 0 : a.dropped > 0, "stuck %d: the trim gave back %lld bytes",
                  stuck, a.dropped);
        CHECK_MSG(strstr(a.msg, "before device memory goes back to the driver") &&
                      strstr(a.msg, "not done after"),
                  "stuck %d: %s", stuck, a.msg);
    }
}

/* ---- an estimate within an estimate keeps the communicator's kind ---- */

/* A budgeted or auto-fitted trainer in a dry context (itself an estimate)
 * estimates its model again: that estimate's dry context has no
 * communicator, and must plan what the outer one's communicator gives,
 * not assume NCCL. Rank 0 of 2 on a dry CUDA context, with a host
 * communicator (host staging, no record buffer, no communication stream)
 * and with a device one that is not NCCL (the record buffer, the blocking
 * step's buckets), at ZeRO stages 0 to 2: the estimate of the dry
 * context's model equals, class by class and to the byte, the estimate
 * made from the configuration with the communicator (the one a run's
 * mt_estimate_model makes, equal to the run's peaks). */
TEST(nccl_overlap_nested_estimate)
{
    static const uint32_t caps[] = {0, MT_COMM_CAP_DEVICE};
    for (int k = 0; k < 2; k++)
        for (int zero = 0; zero <= 2; zero++) {
            tcomm_world *w = tcomm_world_new(2, 30.0);
            mt_comm *c = tcomm_make(w, 0, 2, caps[k]);
            mt_context_config cc;
            mt_context_config_init(&cc);
            cc.device = MT_DEVICE_CUDA;
            cc.dry_run = 1;
            cc.comm = c; /* (a dry context never calls it) */
            mt_gpt_spec g;
            mt_gpt_spec_init(&g);
            g.vocab = 50, g.padded_vocab = 64, g.max_seq = SEQ, g.layers = 2, g.heads = 2, g.channels = 16;
            mt_trainer_config tc;
            mt_trainer_config_init(&tc);
            tc.max_batch = ROWS;
            tc.micro_batch = 1;
            tc.zero_stage = zero;
            mt_estimate_report direct, nested;
            CHECK_OK(mt_estimate_gpt(&cc, &g, &tc, &direct));
            mt_context *dry = NULL;
            mt_model *m = NULL;
            CHECK_OK(mt_context_create(&cc, &dry));
            if (dry) CHECK_OK(mt_model_gpt_create(dry, &g, &m));
            if (m) CHECK_OK(mt_estimate_model(m, &tc, &nested));
            for (int j = 0; j < MT_MEM_COUNT && m; j++)
                CHECK_MSG(nested.class_peak[j] == direct.class_peak[j],
                          "caps %u, stage %d: %s: %llu bytes estimated within a dry context, %llu "
                          "from the communicator", caps[k], zero, mt_mem_class_name((mt_mem_class)j),
                          (unsigned long long)nested.class_peak[j],
                          (unsigned long long)direct.class_peak[j]);
            if (m) CHECK_EQ(nested.peak, direct.peak);
            mt_model_destroy(m);
            mt_context_destroy(dry);
            mt_comm_destroy(c);
            tcomm_world_free(w);
        }
}

/* Stage 2, the fused step at stage 1, and stage 3 (with and without the
 * fused step) with the stream, 2 and 3 ranks: rank 0's second backward
 * fails part-way (on the host, beside the stream), so it queues no more
 * of the collectives the others have queued on their streams; its status
 * exchange must not meet one of those. It aborts its communicator: every
 * other rank's step gives MT_ERR_COMM at once, well before the 20 s
 * deadline, and rank 0's its own failure. */
TEST(nccl_overlap_backward_fault)
{
    if (!stand_ins()) return;
    static const int cases[][2] = {{2, 0}, {1, 1}, {3, 0}, {3, 1}};
    mti_engine_grad_fill = failing_fill;
    for (int n = 2; n <= 3; n++)
        for (int c = 0; c < 4; c++) {
            stall_arg a = {.w = tcomm_world_new(n, 30.0), .n = n, .zero = cases[c][0],
                           .fused = cases[c][1], .in_fill = true};
            tcomm_run(n, local_fault_rank, &a);
            tcomm_world_free(a.w);
            atomic_store(&fail_armed, 0);
            CHECK_MSG(!a.bad, "%d ranks, stage %d%s", n, cases[c][0], cases[c][1] ? " fused" : "");
            for (int r = 0; r < n; r++)
                CHECK_MSG(a.took[r] < 5.0 && a.broken[r] &&
                              (r ? a.got[r] == MT_ERR_COMM
                                 : a.got[r] == MT_ERR_DEVICE &&
                                       strstr(a.msg[r], "an injected failure in backward")),
                          "%d ranks, stage %d%s, rank %d: status %d after %g s%s: %s", n,
                          cases[c][0], cases[c][1] ? " fused" : "", r, (int)a.got[r], a.took[r],
                          a.broken[r] ? "" : " (communicator whole)", a.msg[r]);
        }
    mti_engine_grad_fill = NULL;
}
