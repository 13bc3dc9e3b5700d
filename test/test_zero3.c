/*
 * test_zero3.c - ZeRO stage 3 (weights sharded over the ranks, gathered per
 * layer) over the in-process communicator (threads as ranks): against
 * stage 2 and stage 0 on the same ranks and one process accumulating the
 * same rows, with recompute, every rank's per-class peaks against its
 * estimate, and training-state files across stages and world sizes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "test_comm.h"

#define Z3_MAXN 3
#define Z3_STEPS 3
#define Z3_T 8

enum { Z3_NO_MASTERS = 1, Z3_FUSED = 2, Z3_CLIP = 4 };
typedef struct z3_case {
    const char *name;
    mt_optimizer_kind opt;
    mt_precision prec;
    unsigned flags;
} z3_case;

static const z3_case z3_cases[] = {
    {"sgd fp32", MT_OPT_SGD, MT_PREC_FP32, 0},
    {"adamw fp32 clip", MT_OPT_ADAMW, MT_PREC_FP32, Z3_CLIP},
    {"adamw8 fp32 fused", MT_OPT_ADAMW8, MT_PREC_FP32, Z3_FUSED},
    {"adafactor fp32", MT_OPT_ADAFACTOR, MT_PREC_FP32, 0},
    {"adamw bf16", MT_OPT_ADAMW, MT_PREC_BF16, 0},
    {"sgd bf16 no masters", MT_OPT_SGD, MT_PREC_BF16, Z3_NO_MASTERS},
    {"adamw fp16 clip", MT_OPT_ADAMW, MT_PREC_FP16, Z3_CLIP},
    {"adamw8 fp32 fused clip", MT_OPT_ADAMW8, MT_PREC_FP32, Z3_FUSED | Z3_CLIP},
};

static mt_trainer_config z3_config(const z3_case *k)
{
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.optimizer = k->opt, tc.precision = k->prec;
    const bool sgd = k->opt == MT_OPT_SGD;
    tc.lr = sgd ? 0.05f : 0.01f, tc.momentum = sgd ? 0.9f : 0.0f;
    tc.master_weights = !(k->flags & Z3_NO_MASTERS);
    tc.fused_step = (k->flags & Z3_FUSED) != 0;
    tc.grad_clip = k->flags & Z3_CLIP ? 0.5f : 0.0f;
    return tc;
}

/* A context (on c, or alone), and a small GPT of `layers` blocks: made at
 * once, or deferred (from its seed, or from an llm.c file `from`). */
static mt_status z3_open_as(mt_comm *c, int layers, int deferred, const char *from,
                            mt_context **ctx, mt_model **m)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = Z3_T, g.layers = layers, g.heads = 2;
    g.channels = 16, g.seed = 7, g.deferred = deferred;
    mt_status s = tcomm_context(c, ctx);
    if (!s && from) return deferred ? mt_model_gpt_load_deferred(*ctx, from, m)
                                    : mt_model_gpt_load(*ctx, from, m);
    return s ? s : mt_model_gpt_create(*ctx, &g, m);
}

static mt_status z3_open(mt_comm *c, int layers, mt_context **ctx, mt_model **m)
{
    return z3_open_as(c, layers, 0, NULL, ctx, m);
}

/* A run: n ranks of `rows` rows each, or one process (n 1) over `rows`
 * rows in micro-batches of `micro` (0: none). */
typedef struct z3_run {
    mt_trainer_config tc;
    int n, rows, stage, micro;
    uint32_t caps;            /* of the communicators (MT_COMM_CAP_THREADS: prefetch on a thread) */
    uint64_t calls[Z3_MAXN];  /* collectives each rank made */
    const char *load, *save;  /* load before the steps, save after */
    int deferred;             /* the model deferred (mt_gpt_spec.deferred) ... */
    const char *from;         /* ... or loaded (deferred or not) from this llm.c file */
    int steps;
    tcomm_world *world;
    float loss[Z3_MAXN][Z3_STEPS];
    float *w[Z3_MAXN];
    size_t nw;
    mt_status st[Z3_MAXN];
    char msg[Z3_MAXN][512];
    uint64_t peak[Z3_MAXN][MT_MEM_COUNT];
    uint64_t live[Z3_MAXN][MT_MEM_COUNT]; /* after the steps */
} z3_run;

static void z3_rows(int step, int r0, int n, int32_t *tok, int32_t *tgt)
{
    for (int r = 0; r < n; r++)
        for (int j = 0; j < Z3_T; j++) {
            const int row = r0 + r;
            tok[r * Z3_T + j] = (row * 7 + j * 3 + step * 11) % 50;
            tgt[r * Z3_T + j] = (row * 5 + j * 13 + step * 3 + 1) % 50;
        }
}

/* Every class's peak against the estimate of this rank: "" or where they differ. */
static void z3_estimate(mt_context *ctx, mt_model *m, const mt_trainer_config *tc,
                        const mt_estimate_report *pre, z3_run *a, int rank)
{
    mt_memory_stats ms;
    mt_estimate_report e;
    mt_context_memory_stats(ctx, &ms);
    for (int k = 0; k < MT_MEM_COUNT; k++) a->peak[rank][k] = ms.per_class[k].peak_live_bytes;
    for (int k = 0; k < MT_MEM_COUNT; k++) a->live[rank][k] = ms.per_class[k].live_bytes;
    if (pre) e = *pre;
    else if (mt_estimate_model(m, tc, &e)) {
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
    if (e.peak != ms.peak_live_bytes) {
        snprintf(a->msg[rank], sizeof a->msg[rank], "peak %llu, estimate %llu",
                 (unsigned long long)ms.peak_live_bytes, (unsigned long long)e.peak);
        a->st[rank] = MT_ERR_INTERNAL;
    }
}

static void z3_rank(int rank, void *p)
{
    z3_run *a = p;
    mt_trainer_config tc = a->tc;
    tc.zero_stage = a->stage;
    mt_comm *c = a->n > 1 ? tcomm_make(a->world, rank, a->n, a->caps) : NULL;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    tc.max_batch = a->rows;
    tc.micro_batch = a->micro;
    if (tc.micro_batch) tc.fused_step = 0; /* (the fused step cannot accumulate) */
    mt_status s = z3_open_as(c, 2, a->deferred, a->from, &ctx, &m);
    /* a deferred model's setup is estimated while it is unmade */
    mt_estimate_report pre;
    if (!s && a->deferred && (s = mt_estimate_model(m, &tc, &pre)))
        snprintf(a->msg[rank], sizeof a->msg[rank], "estimate: %s", mt_last_error(ctx));
    if (!s) s = mt_trainer_create(m, &tc, &t);
    if (!s && a->load) s = mt_trainer_load(t, a->load, NULL, 0, NULL);
    const int steps = a->steps ? a->steps : Z3_STEPS;
    int32_t tok[16 * Z3_T], tgt[16 * Z3_T];
    for (int k = 0; k < steps && !s; k++) {
        z3_rows((int)mt_trainer_steps(t), rank * a->rows, a->rows, tok, tgt);
        mt_batch b = {.n = a->rows, .tokens = tok, .targets = tgt, .seq_len = Z3_T};
        s = mt_trainer_step(t, &b, &a->loss[rank][k]);
    }
    if (!s && a->save) s = mt_trainer_save(t, a->save, NULL, 0);
    a->st[rank] = s;
    if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    if (!s && !a->load) z3_estimate(ctx, m, &tc, a->deferred ? &pre : NULL, a, rank);
    mt_comm_stats cs = {0};
    if (ctx && !mt_context_comm_stats(ctx, &cs)) a->calls[rank] = cs.collectives;
    mt_trainer_destroy(t); /* (stage 3: the weights gathered back, on every rank) */
    if (m && !a->st[rank]) {
        a->nw = mt_model_num_params(m);
        a->w[rank] = malloc(a->nw * sizeof(float));
        if (mt_model_get_params(m, a->w[rank], a->nw)) a->st[rank] = MT_ERR_INTERNAL;
    }
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

static void z3_go(z3_run *a)
{
    a->world = tcomm_world_new(a->n, 30.0); /* (one rank: no communicator) */
    tcomm_run(a->n, z3_rank, a);
    tcomm_world_free(a->world);
    for (int r = 0; r < a->n; r++) {
        CHECK_MSG(a->st[r] == MT_OK, "%d ranks, stage %d, rank %d: %s", a->n, a->stage, r, a->msg[r]);
        /* every rank ends with rank 0's weights and losses, bit for bit */
        CHECK(a->w[0] && a->w[r] && memcmp(a->w[0], a->w[r], a->nw * sizeof(float)) == 0);
        CHECK(memcmp(a->loss[r], a->loss[0], sizeof a->loss[0]) == 0);
    }
}

static void z3_free(z3_run *a)
{
    for (int r = 0; r < Z3_MAXN; r++) free(a->w[r]);
    memset(a->w, 0, sizeof a->w);
}

static double z3_rel(const z3_run *x, const z3_run *y)
{
    double rel = 0.0;
    for (size_t i = 0; x->w[0] && y->w[0] && i < x->nw; i++) {
        double d = fabs((double)x->w[0][i] - y->w[0][i]) / (fabs(y->w[0][i]) + 1.0);
        if (d > rel) rel = d;
    }
    return x->w[0] && y->w[0] ? rel : INFINITY;
}

static bool z3_same(const z3_run *x, const z3_run *y)
{
    return x->w[0] && y->w[0] && x->nw == y->nw && !memcmp(x->w[0], y->w[0], x->nw * sizeof(float));
}

/* Stage 3 on 2 and 3 ranks: the bits of stage 2 on the same ranks (the same
 * reduce-scatters and updates; only where the weights live differs), so
 * on 2 ranks without clipping stage 0's bits, and one process accumulating
 * the same rows within fp32 rounding (as stage 0 is: docs/distributed.md);
 * every rank's per-class peaks equal its estimate, and a rank holds less
 * PARAM than at stage 2. */
TEST(zero3_equals_stage2_and_one_process)
{
    for (size_t k = 0; k < sizeof z3_cases / sizeof z3_cases[0]; k++) {
        const z3_case *c = &z3_cases[k];
        const mt_trainer_config tc = z3_config(c);
        for (int n = 2; n <= (check_light() ? 2 : 3); n++) {
            z3_run one = {.tc = tc, .n = 1, .rows = 6, .micro = 6 / n};
            z3_go(&one);
            z3_run r0 = {.tc = tc, .n = n, .rows = 6 / n, .stage = 0};
            z3_run r2 = r0, r3 = r0;
            r2.stage = 2, r3.stage = 3;
            z3_go(&r0), z3_go(&r2), z3_go(&r3);
            CHECK_MSG(z3_same(&r3, &r2), "%s, %d ranks: stage 3 differs from stage 2 by %g",
                      c->name, n, z3_rel(&r3, &r2));
            for (int s = 0; s < Z3_STEPS; s++) CHECK(r3.loss[0][s] == r2.loss[0][s]);
            if (n == 2 && !(c->flags & Z3_CLIP) && !(c->prec != MT_PREC_FP32 && !(c->flags & Z3_NO_MASTERS)))
                CHECK_MSG(z3_same(&r3, &r0), "%s: stage 3 differs from stage 0 by %g", c->name,
                          z3_rel(&r3, &r0));
            const double tol = c->prec == MT_PREC_FP32 ? 1e-4 : 2e-2;
            CHECK_MSG(z3_rel(&r3, &one) < tol, "%s, %d ranks: stage 3 differs from one process by %g",
                      c->name, n, z3_rel(&r3, &one));
            for (int s = 0; s < Z3_STEPS; s++) CHECK(fabsf(r3.loss[0][s] - one.loss[0][s]) < 1e-5f);
            /* the weights held between steps: a slice (the model was made
               whole, so the peak includes the whole weights once, at create) */
            for (int r = 0; r < n; r++)
                CHECK_MSG(r3.live[r][MT_MEM_PARAM] * (uint64_t)(n - 1) < r2.live[r][MT_MEM_PARAM],
                          "%s, rank %d of %d: PARAM %llu at stage 3, %llu at stage 2", c->name, r, n,
                          (unsigned long long)r3.live[r][MT_MEM_PARAM],
                          (unsigned long long)r2.live[r][MT_MEM_PARAM]);
            z3_free(&r0), z3_free(&r2), z3_free(&r3), z3_free(&one);
        }
    }
}

/* A deferred model (from its seed, or from an llm.c file) created straight
 * into its slices: the bits of the model made whole first, at every
 * precision and optimizer; a rank's PARAM never holds more than its slices
 * (its peak is what it holds between steps), and every class's peak equals
 * the estimate made while the model was unmade. */
TEST(zero3_deferred_creation)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/mt_z3_deferred_%d.bin", (int)getpid());
    {
        mt_context *ctx = NULL;
        mt_model *m = NULL;
        mt_gpt_spec g;
        CHECK(z3_open(NULL, 2, &ctx, &m) == MT_OK);
        CHECK(mt_model_gpt_get_spec(m, &g) == MT_OK);
        float *w = malloc(mt_model_num_params(m) * sizeof *w);
        for (size_t i = 0; w && i < mt_model_num_params(m); i++) w[i] = sinf((float)i) * 0.05f;
        CHECK(w && mt_model_set_params(m, w, mt_model_num_params(m)) == MT_OK);
        CHECK(mt_model_gpt_save(m, path) == MT_OK);
        free(w);
        mt_model_destroy(m);
        mt_context_destroy(ctx);
    }
    for (size_t k = 0; k < sizeof z3_cases / sizeof z3_cases[0]; k++) {
        const z3_case *c = &z3_cases[k];
        const mt_trainer_config tc = z3_config(c);
        for (int n = 2; n <= (check_light() ? 2 : 3); n++)
            for (int file = 0; file < 2; file++) {
                z3_run whole = {.tc = tc, .n = n, .rows = 6 / n, .stage = 3};
                whole.from = file ? path : NULL;
                z3_run d = whole;
                d.deferred = 1;
                z3_go(&whole), z3_go(&d);
                CHECK_MSG(z3_same(&d, &whole), "%s, %d ranks%s: deferred differs by %g", c->name, n,
                          file ? ", from a file" : "", z3_rel(&d, &whole));
                for (int s = 0; s < Z3_STEPS; s++) CHECK(d.loss[0][s] == whole.loss[0][s]);
                for (int r = 0; r < n; r++) {
                    CHECK_MSG(d.peak[r][MT_MEM_PARAM] == d.live[r][MT_MEM_PARAM],
                              "%s, rank %d of %d: PARAM peak %llu, %llu between steps", c->name, r,
                              n, (unsigned long long)d.peak[r][MT_MEM_PARAM],
                              (unsigned long long)d.live[r][MT_MEM_PARAM]);
                    CHECK(d.peak[r][MT_MEM_PARAM] < whole.peak[r][MT_MEM_PARAM]);
                }
                z3_free(&whole), z3_free(&d);
            }
    }
    remove(path);
}

/* Recompute gathers a recomputed layer's weights again: every unit
 * recomputed (EVERY_K 1) and selective saving give stage 3's bits without
 * recompute, and the estimate still equals each rank's peaks. */
TEST(zero3_with_recompute)
{
    const mt_trainer_config tc = z3_config(&z3_cases[1]);
    z3_run base = {.tc = tc, .n = 2, .rows = 2, .stage = 3};
    z3_go(&base);
    const mt_recompute_policy pol[2] = {MT_RECOMPUTE_EVERY_K, MT_RECOMPUTE_SELECTIVE};
    for (int p = 0; p < 2; p++) {
        z3_run r = base;
        memset(r.w, 0, sizeof r.w);
        r.tc.recompute = pol[p];
        r.tc.recompute_every = 1;
        z3_go(&r);
        CHECK_MSG(z3_same(&r, &base), "recompute policy %d: stage 3 differs by %g", (int)pol[p],
                  z3_rel(&r, &base));
        z3_free(&r);
    }
    z3_free(&base);
}

/* Prefetch and keep change when the weights are gathered, never what they
 * are: on 2 and 3 ranks, every depth (the gathers on each rank's
 * communication thread, or, without MT_COMM_CAP_THREADS, when their
 * buffers are made), keeping the last layer or every layer from forward to
 * backward, with and without recompute, the fused step, accumulation and
 * bf16, gives the bits of the synchronous gathers; every rank's peaks
 * equal its estimate (z3_rank), and keeping every layer makes fewer
 * collectives and holds more COMM than keeping none. */
TEST(zero3_prefetch_and_keep)
{
    static const struct {
        int prefetch, keep, threads;
    } v[] = {{1, 0, 1}, {2, 0, 1}, {1, 0, 0}, {1, 1, 1}, {3, -1, 1}, {0, -1, 0}, {64, 2, 1}};
    const int which[4] = {1, 2, 4, 0}; /* adamw clip, adamw8 fused, adamw bf16, sgd (accumulating) */
    for (int k = 0; k < 4; k++) {
        for (int n = 2; n <= (check_light() ? 2 : 3); n++) {
            for (int rc = 0; rc < 2; rc++) {
                mt_trainer_config tc = z3_config(&z3_cases[which[k]]);
                tc.zero3_prefetch = 0;
                if (rc) tc.recompute = MT_RECOMPUTE_EVERY_K, tc.recompute_every = 1;
                z3_run base = {.tc = tc, .n = n, .rows = 6 / n, .stage = 3,
                               .micro = k == 3 ? 1 : 0};
                z3_go(&base);
                for (size_t j = 0; j < sizeof v / sizeof v[0]; j++) {
                    z3_run r = base;
                    memset(r.w, 0, sizeof r.w);
                    r.tc.zero3_prefetch = v[j].prefetch, r.tc.zero3_keep = v[j].keep;
                    r.caps = v[j].threads ? MT_COMM_CAP_THREADS : 0;
                    z3_go(&r);
                    CHECK_MSG(z3_same(&r, &base),
                              "%s, %d ranks, recompute %d, prefetch %d keep %d threads %d: differs "
                              "by %g",
                              z3_cases[which[k]].name, n, rc, v[j].prefetch, v[j].keep,
                              v[j].threads, z3_rel(&r, &base));
                    CHECK(memcmp(r.loss, base.loss, sizeof r.loss) == 0);
                    if (v[j].keep < 0) /* every layer kept: no gather for backward */
                        for (int q = 0; q < n; q++) {
                            CHECK(r.calls[q] < base.calls[q]);
                            CHECK(r.peak[q][MT_MEM_COMM] > base.peak[q][MT_MEM_COMM]);
                        }
                    z3_free(&r);
                }
                z3_free(&base);
            }
        }
    }
}

/* A communicator around the test one whose rank stops taking part at its
 * `die_at`-th all-gather once armed (it returns at once, failing, as if the
 * rank had died there): the other ranks' gathers, on their communication
 * threads, wait for it until the world's timeout. */
typedef struct z3_dying {
    mt_comm *inner;
    int die_at, gathers;
    _Atomic int armed;
} z3_dying;

static mt_status zd_reduce(void *s, const void *a, void *b, size_t n, mt_comm_dtype d, mt_comm_op o,
                           void *st)
{
    return mt_comm_all_reduce(((z3_dying *)s)->inner, a, b, n, d, o, st);
}

static mt_status zd_scatter(void *s, const void *a, void *b, size_t n, mt_comm_dtype d, mt_comm_op o,
                            void *st)
{
    return mt_comm_reduce_scatter(((z3_dying *)s)->inner, a, b, n, d, o, st);
}

static mt_status zd_gather(void *s, const void *a, void *b, size_t n, mt_comm_dtype d, void *st)
{
    z3_dying *z = s;
    if (z->armed && ++z->gathers == z->die_at) return MT_ERR_COMM;
    return mt_comm_all_gather(z->inner, a, b, n, d, st);
}

static mt_status zd_bcast(void *s, void *b, size_t n, mt_comm_dtype d, int root, void *st)
{
    return mt_comm_broadcast(((z3_dying *)s)->inner, b, n, d, root, st);
}

static mt_status zd_barrier(void *s) { return mt_comm_barrier(((z3_dying *)s)->inner); }

static const char *zd_error(void *s)
{
    (void)s;
    return "this rank stopped taking part";
}

typedef struct z3_death {
    tcomm_world *world;
    z3_dying dying[2];
    mt_status st[2];
    double seconds[2];
    char msg[2][512];
} z3_death;

static double z3_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void z3_death_rank(int rank, void *p)
{
    z3_death *a = p;
    z3_dying *z = &a->dying[rank];
    z->inner = tcomm_make(a->world, rank, 2, MT_COMM_CAP_THREADS);
    const mt_comm_vtable vt = {.abi_version = MT_COMM_ABI_VERSION, .struct_size = sizeof vt,
                               .name = "dying", .caps = MT_COMM_CAP_THREADS,
                               .all_reduce = zd_reduce, .reduce_scatter = zd_scatter,
                               .all_gather = zd_gather, .broadcast = zd_bcast,
                               .barrier = zd_barrier, .last_error = zd_error};
    mt_comm *c = NULL;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_trainer_config tc = z3_config(&z3_cases[1]);
    tc.zero_stage = 3;
    tc.zero3_prefetch = 2;
    tc.max_batch = 3;
    mt_status s = mt_comm_create(&vt, z, rank, 2, &c);
    if (!s) s = z3_open(c, 2, &ctx, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[3 * Z3_T], tgt[3 * Z3_T];
    for (int k = 0; k < 2 && !s; k++) {
        if (k == 1 && rank == 1) z->armed = 1; /* rank 1 dies in its second step */
        z3_rows(k, rank * 3, 3, tok, tgt);
        mt_batch b = {.n = 3, .tokens = tok, .targets = tgt, .seq_len = Z3_T};
        const double t0 = z3_now();
        s = mt_trainer_step(t, &b, NULL);
        a->seconds[rank] = z3_now() - t0;
    }
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    mt_trainer_destroy(t); /* (the gathers back fail at once: logged, zeros) */
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
    mt_comm_destroy(z->inner);
}

/* A rank that dies while the others' gathers of the layers to come run on
 * their communication threads (in forward, and in backward between the
 * reduce-scatters): the others' step fails with MT_ERR_COMM naming the
 * gather, at the timeout, never hanging; destroy then ends too. */
TEST(zero3_prefetch_rank_dies)
{
    /* a gather queued ahead in forward (layer 1's); one in backward (layer
       0's, queued behind the reduce-scatters of the layers above): each
       entry's tensors are one all-gather, after the step's first exchange */
    const int at[2] = {4, 9};
    for (int k = 0; k < 2; k++) {
        z3_death a = {.world = tcomm_world_new(2, 1.0)};
        a.dying[1].die_at = at[k];
        tcomm_run(2, z3_death_rank, &a);
        tcomm_world_free(a.world);
        CHECK_MSG(a.st[0] == MT_ERR_COMM, "gather %d: rank 0: %s: %s", at[k],
                  mt_status_string(a.st[0]), a.msg[0]);
        CHECK_MSG(strstr(a.msg[0], "all-gather of the weights") != NULL, "%s", a.msg[0]);
        CHECK_MSG(a.seconds[0] > 0.9 && a.seconds[0] < 1.0 + 3.0, "rank 0 failed after %.2f s",
                  a.seconds[0]);
        CHECK(a.st[1] == MT_ERR_COMM);
    }
}

/* A training-state file saved at stage 3 on 2 ranks is the whole state:
 * loaded by one process at stage 0 (and by 3 ranks at stage 3) and saved
 * again at once, it is the same file byte for byte; and a file saved by
 * one process loads at stage 3 on 2 ranks the same way. Resumed on the same
 * 2 ranks, a step gives the unbroken run's state. */
TEST(zero3_checkpoint_across_stages)
{
    char a[128], b[128], c[128], d[128];
    snprintf(a, sizeof a, "/tmp/mt_test_%ld_z3_a.ckpt", (long)getpid());
    snprintf(b, sizeof b, "/tmp/mt_test_%ld_z3_b.ckpt", (long)getpid());
    snprintf(c, sizeof c, "/tmp/mt_test_%ld_z3_c.ckpt", (long)getpid());
    snprintf(d, sizeof d, "/tmp/mt_test_%ld_z3_d.ckpt", (long)getpid());
    const int which[2] = {4, 3}; /* adamw bf16 (masters), adafactor (whole tensors) */
    for (int k = 0; k < 2; k++) {
        const mt_trainer_config tc = z3_config(&z3_cases[which[k]]);
        z3_run save3 = {.tc = tc, .n = 2, .rows = 3, .stage = 3, .steps = 2, .save = a};
        z3_go(&save3);
        const int worlds[2][2] = {{1, 0}, {3, 3}};
        for (int w = 0; w < 2; w++) {
            z3_run re = {.tc = tc, .n = worlds[w][0], .rows = 6 / worlds[w][0],
                         .stage = worlds[w][1], .steps = -1, .load = a, .save = b};
            z3_go(&re);
            FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
            bool same = fa && fb;
            for (int x = 0, y = 0; same && (x = fgetc(fa)) != EOF;)
                same = (y = fgetc(fb)) == x;
            if (same) same = fgetc(fb) == EOF;
            if (fa) fclose(fa);
            if (fb) fclose(fb);
            CHECK_MSG(same, "%s: saved at stage 3 on 2 ranks, loaded on %d at stage %d: differs",
                      z3_cases[which[k]].name, worlds[w][0], worlds[w][1]);
            z3_free(&re);
        }
        /* the reverse: one process's file into stage 3 on 2 ranks */
        z3_run one = {.tc = tc, .n = 1, .rows = 6, .stage = 0, .steps = 2, .save = c};
        z3_go(&one);
        z3_run into = {.tc = tc, .n = 2, .rows = 3, .stage = 3, .steps = -1, .load = c, .save = d};
        z3_go(&into);
        FILE *fc = fopen(c, "rb"), *fd = fopen(d, "rb");
        bool same = fc && fd;
        for (int x = 0; same && (x = fgetc(fc)) != EOF;) same = fgetc(fd) == x;
        if (same) same = fgetc(fd) == EOF;
        if (fc) fclose(fc);
        if (fd) fclose(fd);
        CHECK_MSG(same, "%s: one process's file loaded at stage 3 on 2 ranks differs",
                  z3_cases[which[k]].name);
        /* resumed: the unbroken run's bits */
        z3_run full = {.tc = tc, .n = 2, .rows = 3, .stage = 3, .steps = 3};
        z3_go(&full);
        z3_run resumed = {.tc = tc, .n = 2, .rows = 3, .stage = 3, .steps = 1, .load = a};
        z3_go(&resumed);
        CHECK_MSG(z3_same(&resumed, &full), "%s: a resumed run differs from the unbroken one by %g",
                  z3_cases[which[k]].name, z3_rel(&resumed, &full));
        z3_free(&save3), z3_free(&one), z3_free(&into), z3_free(&full), z3_free(&resumed);
    }
    unlink(a), unlink(b), unlink(c), unlink(d);
}

/* What stage 3 does not combine with yet is refused, clearly, on every
 * rank; a stage out of range too; and the model's weights cannot be read
 * while they are sharded (the trainer's destroy gathers them). */
typedef struct z3_refuse {
    tcomm_world *world;
    mt_status st[2], lora[2], read[2];
    char msg[2][512], lmsg[2][512], rmsg[2][512];
} z3_refuse;

static void z3_refuse_rank(int rank, void *p)
{
    z3_refuse *a = p;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.zero_stage = 4; /* out of range */
    mt_comm *c = tcomm_make(a->world, rank, 2, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_status s = z3_open(c, 1, &ctx, &m);
    mt_trainer *t = NULL;
    a->st[rank] = s ? s : mt_trainer_create(m, &tc, &t);
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    tc.zero_stage = 3;
    tc.lora.rank = 2;
    a->lora[rank] = s ? s : mt_trainer_create(m, &tc, &t);
    snprintf(a->lmsg[rank], sizeof a->lmsg[rank], "%s", mt_last_error(ctx));
    tc.lora.rank = 0;
    if (!s) s = mt_trainer_create(m, &tc, &t);
    float *w = malloc(mt_model_num_params(m) * sizeof(float));
    a->read[rank] = s ? s : mt_model_get_params(m, w, mt_model_num_params(m));
    snprintf(a->rmsg[rank], sizeof a->rmsg[rank], "%s", mt_last_error(ctx));
    mt_trainer_destroy(t);
    if (!s && mt_model_get_params(m, w, mt_model_num_params(m))) a->read[rank] = MT_ERR_INTERNAL;
    free(w);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(zero3_refusals)
{
    z3_refuse a = {.world = tcomm_world_new(2, 30.0)};
    tcomm_run(2, z3_refuse_rank, &a);
    tcomm_world_free(a.world);
    for (int r = 0; r < 2; r++) {
        CHECK_EQ(a.st[r], MT_ERR_INVALID_ARG);
        CHECK_MSG(strstr(a.msg[r], "0..3") != NULL, "%s", a.msg[r]);
        CHECK_EQ(a.lora[r], MT_ERR_UNSUPPORTED);
        CHECK_MSG(strstr(a.lmsg[r], "LoRA") != NULL, "%s", a.lmsg[r]);
        CHECK_EQ(a.read[r], MT_ERR_UNSUPPORTED);
        CHECK_MSG(strstr(a.rmsg[r], "sharded") != NULL, "%s", a.rmsg[r]);
    }
}

/* Deferred models the ranks would make differently are refused before
 * anything is placed: the same seed drawn by another init (the recipe
 * covers how each tensor draws), and one rank deferred beside one made at
 * once (named as such). */
typedef struct z3_recipe {
    tcomm_world *world;
    int mixed;
    mt_status st[2];
    char msg[2][512];
} z3_recipe;

static void z3_recipe_rank(int rank, void *p)
{
    z3_recipe *a = p;
    mt_comm *c = tcomm_make(a->world, rank, 2, 0);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    static const mt_layer_spec ls[] = {{.kind = MT_LAYER_EMBEDDING, .units = 16, .positions = 1},
                                       {.kind = MT_LAYER_BLOCK, .heads = 2},
                                       {.kind = MT_LAYER_LAYERNORM},
                                       {.kind = MT_LAYER_LM_HEAD}};
    mt_model_spec sp;
    mt_model_spec_init(&sp);
    sp.input = MT_INPUT_TOKENS, sp.vocab = 40, sp.max_seq = Z3_T, sp.n_layers = 4, sp.layers = ls;
    sp.seed = 3;
    sp.init = a->mixed || !rank ? MT_INIT_DEFAULT : MT_INIT_GPT2;
    sp.deferred = !(a->mixed && rank);
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 2, tc.zero_stage = 3;
    mt_status s = tcomm_context(c, &ctx);
    if (!s) s = mt_model_create(ctx, &sp, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", ctx ? mt_last_error(ctx) : "");
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(zero3_deferred_recipes_disagree)
{
    for (int mixed = 0; mixed < 2; mixed++) {
        z3_recipe a = {.world = tcomm_world_new(2, 30.0), .mixed = mixed};
        tcomm_run(2, z3_recipe_rank, &a);
        tcomm_world_free(a.world);
        for (int r = 0; r < 2; r++) {
            CHECK_MSG(a.st[r] == MT_ERR_COMM, "mixed %d, rank %d: %s", mixed, r, a.msg[r]);
            CHECK_MSG(strstr(a.msg[r], mixed ? "creation" : "weights") != NULL, "rank %d: %s", r,
                      a.msg[r]);
        }
    }
}
