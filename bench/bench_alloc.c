/*
 * bench_alloc.c - allocator latency and efficiency, side by side in one run.
 *
 * Latency: the median time of an alloc+free pair, over batches of pairs, for
 * each allocator (called through its table, and through mt_alloc/mt_free)
 * and for jemalloc's mallocx/dallocx on the same sequence; reported as ns and
 * as a ratio to jemalloc.
 *
 * Efficiency: peak reserved / peak live when replaying
 *   (a) random traces as RMM's random_allocations benchmark makes them
 *       (73% allocations, sizes uniform in 1..max, a cap on live bytes),
 *   (b) a GPT-2-shaped training trace (llm.c's tensor layout, 5 steps),
 *   (c) a trace recorded from the engine training an MLP (5 steps),
 *   (d, e) traces recorded from the engine training GPT-2 124M (3 steps;
 *       not with --quick).
 *
 * Usage: bench_alloc [--quick]
 */
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "internal.h"

static bool quick;

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e9 * (double)ts.tv_sec + (double)ts.tv_nsec;
}

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* ---- latency ---- */

#define BATCH 1000
#define WINDOW 64

typedef enum { VIA_JEMALLOC, VIA_TABLE, VIA_WRAPPER } via;

typedef struct lat_target {
    via how;
    mt_allocator *a;
} lat_target;

static void *t_alloc(lat_target *t, size_t bytes, mt_block *b)
{
    mt_alloc_request r = {.bytes = bytes, .alignment = 256, .mem_class = MT_MEM_ACT,
                          .lifetime = MT_LIFE_STEP};
    switch (t->how) {
    case VIA_JEMALLOC: return b->ptr = mallocx(bytes, 0);
    case VIA_TABLE:
        if (t->a->vt->alloc(t->a->state, &r, b)) return NULL;
        b->bytes = bytes, b->mem_class = MT_MEM_ACT, b->lifetime = MT_LIFE_STEP;
        return b->ptr;
    case VIA_WRAPPER: return mt_alloc(t->a, &r, b) ? NULL : b->ptr;
    }
    return NULL;
}

static void t_free(lat_target *t, mt_block *b)
{
    switch (t->how) {
    case VIA_JEMALLOC: dallocx(b->ptr, 0); break;
    case VIA_TABLE: t->a->vt->free(t->a->state, b); break;
    case VIA_WRAPPER: mt_free(t->a, b); break;
    }
}

/* The sequences. Each target keeps its own state, and one call times one
 * batch of BATCH pairs, so the targets can be measured in turns (see
 * latency()): whatever else the machine does falls on all of them alike. */

typedef enum { SEQ_PAIR, SEQ_WINDOW, SEQ_STEPS } seq_kind;

/* Sizes for the window and steps sequences: log-uniform 256 B .. 1 MiB. */
static size_t window_sizes[1 << 16];

#define STEP_N 64 /* blocks per step */

typedef struct seq_state {
    mt_block live[WINDOW];
    size_t next;
    int head;
    bool started;
} seq_state;

static void t_reset(lat_target *t)
{
    if (t->how == VIA_TABLE) t->a->vt->reset(t->a->state, MT_SCOPE_STEP);
    else if (t->how == VIA_WRAPPER) mt_allocator_reset(t->a, MT_SCOPE_STEP);
}

/* One batch; returns ns per alloc+free pair.
 *   SEQ_PAIR: the same size again and again, alloc then free.
 *   SEQ_WINDOW: a FIFO window of live blocks; each pair frees the oldest and
 *     allocates a new one.
 *   SEQ_STEPS: a training-shaped loop: a step allocates STEP_N blocks of fixed
 *     sizes (the same every step), frees the first half in order and the
 *     second in reverse, and ends with a step boundary. */
static double run_batch(lat_target *t, seq_kind k, size_t bytes, seq_state *st)
{
    mt_block b;
    double t0 = now_ns();
    int pairs = BATCH;
    if (k == SEQ_PAIR) {
        for (int i = 0; i < BATCH; i++) {
            t_alloc(t, bytes, &b);
            t_free(t, &b);
        }
    } else if (k == SEQ_WINDOW) {
        if (!st->started) {
            for (int i = 0; i < WINDOW; i++) t_alloc(t, window_sizes[st->next++], &st->live[i]);
            st->started = true;
            t0 = now_ns();
        }
        for (int i = 0; i < BATCH; i++) {
            t_free(t, &st->live[st->head]);
            t_alloc(t, window_sizes[st->next++ & 0xFFFF], &st->live[st->head]);
            st->head = (st->head + 1) % WINDOW;
        }
    } else {
        const int steps = BATCH / STEP_N + 1;
        pairs = steps * STEP_N;
        for (int s = 0; s < steps; s++) {
            for (int i = 0; i < STEP_N; i++) t_alloc(t, window_sizes[i], &st->live[i]);
            for (int i = 0; i < STEP_N / 2; i++) t_free(t, &st->live[i]);
            for (int i = STEP_N; i-- > STEP_N / 2;) t_free(t, &st->live[i]);
            t_reset(t);
        }
    }
    return (now_ns() - t0) / pairs;
}

static void end_sequence(lat_target *t, seq_kind k, seq_state *st)
{
    if (k == SEQ_WINDOW && st->started)
        for (int i = 0; i < WINDOW; i++) t_free(t, &st->live[i]);
    memset(st, 0, sizeof *st);
}

#define N_TARGETS 9 /* jemalloc, then each allocator through its table and mt_alloc */

static void latency(mt_context *ctx)
{
    static const char *const names[] = {"arena", "pool", "caching", "checkpoint"};
    static const size_t sizes[] = {256, 4096, 65536, 1u << 20};
    const int batches = quick ? 21 : 301;
    for (size_t i = 0; i < sizeof window_sizes / sizeof *window_sizes; i++) {
        double lg = 8.0 + (double)(rnd() % 12001) / 1000.0; /* 2^8 .. 2^20 */
        window_sizes[i] = (size_t)(1ull << (int)lg) + rnd() % (1ull << (int)lg);
    }
    lat_target tg[N_TARGETS] = {{.how = VIA_JEMALLOC}};
    const char *label[N_TARGETS] = {"jemalloc"};
    for (int n = 0; n < 4; n++) {
        for (int w = 0; w < 2; w++) {
            lat_target *t = &tg[1 + 2 * n + w];
            mt_allocator_config ac = {.vtable = mt_allocator_by_name(names[n])};
            t->how = w ? VIA_WRAPPER : VIA_TABLE;
            label[1 + 2 * n + w] = names[n];
            if (mt_allocator_create(ctx, &ac, &t->a)) {
                fprintf(stderr, "%s: %s\n", names[n], mt_last_error(ctx));
                exit(1);
            }
        }
    }
    /* med[target][column] */
    static double med[N_TARGETS][6], v[N_TARGETS][512];
    for (int col = 0; col < 6; col++) {
        seq_kind k = col < 4 ? SEQ_PAIR : col == 4 ? SEQ_WINDOW : SEQ_STEPS;
        size_t bytes = col < 4 ? sizes[col] : 0;
        seq_state st[N_TARGETS];
        memset(st, 0, sizeof st);
        for (int b = -3; b < batches; b++) /* three warm-up rounds */
            for (int t = 0; t < N_TARGETS; t++) {
                double ns = run_batch(&tg[t], k, bytes, &st[t]);
                if (b >= 0) v[t][b] = ns;
            }
        for (int t = 0; t < N_TARGETS; t++) {
            med[t][col] = median(v[t], batches);
            end_sequence(&tg[t], k, &st[t]);
        }
    }
    printf("\n## Latency: median ns per alloc+free pair (ratio to jemalloc mallocx/dallocx)\n\n");
    printf("%d batches of %d pairs per cell, all targets measured in turns, batch by batch.\n\n",
           batches, BATCH);
    printf("| allocator | via | 256 B | 4 KiB | 64 KiB | 1 MiB | window of %d, 256 B-1 MiB | "
           "steps of %d |\n", WINDOW, STEP_N);
    printf("|---|---|---|---|---|---|---|---|\n");
    for (int t = 0; t < N_TARGETS; t++) {
        printf("| %s | %s |", label[t],
               tg[t].how == VIA_JEMALLOC ? "mallocx" : tg[t].how == VIA_TABLE ? "table" : "mt_alloc");
        for (int col = 0; col < 6; col++) {
            if (t == 0) printf(" %.1f |", med[0][col]);
            else printf(" %.1f (%.2fx) |", med[t][col], med[t][col] / med[0][col]);
        }
        printf("\n");
    }
    for (int t = 1; t < N_TARGETS; t++) mt_allocator_destroy(tg[t].a);
}

/* ---- efficiency ---- */

typedef struct evbuf {
    mt_trace_event *v;
    size_t n, cap;
    uint64_t next_id;
} evbuf;

static void ev_push(evbuf *e, mt_trace_event ev)
{
    if (e->n == e->cap) {
        e->cap = e->cap ? 2 * e->cap : 4096;
        e->v = realloc(e->v, e->cap * sizeof *e->v);
    }
    e->v[e->n++] = ev;
}

static uint64_t ev_alloc(evbuf *e, uint64_t bytes, mt_mem_class c, mt_lifetime l)
{
    uint64_t id = ++e->next_id;
    ev_push(e, (mt_trace_event){.op = MT_TRACE_ALLOC, .id = id, .bytes = bytes,
                                .alignment = 256, .mem_class = (uint8_t)c, .lifetime = (uint8_t)l});
    return id;
}

static void ev_free(evbuf *e, uint64_t id)
{
    ev_push(e, (mt_trace_event){.op = MT_TRACE_FREE, .id = id});
}

static void ev_reset(evbuf *e, mt_scope s)
{
    ev_push(e, (mt_trace_event){.op = MT_TRACE_RESET, .scope = (uint8_t)s});
}

/* RMM's random_allocations: 2n iterations; allocate (73%) a size uniform in
 * 1..max while under n allocations and under max_usage, else free a random
 * live block. */
static void random_trace(evbuf *e, size_t n, uint64_t max_size, uint64_t max_usage)
{
    uint64_t *live = malloc(n * sizeof *live), *sz = malloc(n * sizeof *sz);
    size_t active = 0, count = 0;
    uint64_t used = 0;
    for (size_t i = 0; i < 2 * n; i++) {
        uint64_t size = 1 + rnd() % max_size;
        bool do_alloc = active == 0 ||
                        (rnd() % 100 < 73 && count < n && used + size < max_usage);
        if (do_alloc) {
            live[active] = ev_alloc(e, size, MT_MEM_ACT, MT_LIFE_PERSISTENT);
            sz[active++] = size;
            count++;
            used += size;
        } else if (active) {
            size_t k = (size_t)(rnd() % active);
            ev_free(e, live[k]);
            used -= sz[k];
            live[k] = live[--active];
            sz[k] = sz[active];
        }
    }
    while (active) ev_free(e, live[--active]);
    free(live);
    free(sz);
}

/* A GPT-2 training step in llm.c's layout (fp32), as an eager framework runs
 * it: parameters and AdamW state first, then per step the activations of
 * every layer, temporaries inside attention, gradients made in backward and
 * freed after the update, activation gradients one layer at a time. */
static void gpt2_trace(evbuf *e, int steps, int L, int B, int T, int C, int H, int Vp, int maxT)
{
    const uint64_t F = 4, BT = (uint64_t)B * T, BTC = BT * C;
    /* parameter tensors (llm.c order) */
    uint64_t psz[16] = {(uint64_t)Vp * C, (uint64_t)maxT * C, (uint64_t)L * C, (uint64_t)L * C,
                        (uint64_t)L * 3 * C * C, (uint64_t)L * 3 * C, (uint64_t)L * C * C,
                        (uint64_t)L * C, (uint64_t)L * C, (uint64_t)L * C,
                        (uint64_t)L * 4 * C * C, (uint64_t)L * 4 * C, (uint64_t)L * 4 * C * C,
                        (uint64_t)L * C, (uint64_t)C, (uint64_t)C};
    for (int i = 0; i < 16; i++) ev_alloc(e, psz[i] * F, MT_MEM_PARAM, MT_LIFE_PERSISTENT);
    for (int i = 0; i < 32; i++) ev_alloc(e, psz[i % 16] * F, MT_MEM_OPTIM, MT_LIFE_PERSISTENT);
    enum { LN1, LN1M, LN1R, QKV, ATTY, PREATT, ATT, PROJ, RES2, LN2, LN2M, LN2R, FCH, FCHG, FCP,
           RES3, NACT };
    uint64_t asz[NACT] = {BTC, BT, BT, 3 * BTC, BTC, (uint64_t)B * H * T * T, (uint64_t)B * H * T * T,
                          BTC, BTC, BTC, BT, BT, 4 * BTC, 4 * BTC, BTC, BTC};
    uint64_t *act = malloc((size_t)L * NACT * sizeof *act);
    for (int s = 0; s < steps; s++) {
        uint64_t tok = ev_alloc(e, BT * 4, MT_MEM_IO, MT_LIFE_STEP);
        uint64_t tgt = ev_alloc(e, BT * 4, MT_MEM_IO, MT_LIFE_STEP);
        uint64_t enc = ev_alloc(e, BTC * F, MT_MEM_ACT, MT_LIFE_STEP);
        for (int l = 0; l < L; l++) {
            for (int a = 0; a < NACT; a++) {
                act[l * NACT + a] = ev_alloc(e, asz[a] * F, MT_MEM_ACT, MT_LIFE_STEP);
                if (a == ATTY) { /* a head-major copy inside attention */
                    uint64_t w = ev_alloc(e, BTC * F, MT_MEM_WORK, MT_LIFE_PHASE);
                    ev_free(e, w);
                }
            }
        }
        uint64_t lnf = ev_alloc(e, BTC * F, MT_MEM_ACT, MT_LIFE_STEP);
        uint64_t lnfm = ev_alloc(e, BT * F, MT_MEM_ACT, MT_LIFE_STEP);
        uint64_t lnfr = ev_alloc(e, BT * F, MT_MEM_ACT, MT_LIFE_STEP);
        uint64_t logits = ev_alloc(e, BT * Vp * F, MT_MEM_IO, MT_LIFE_STEP);
        uint64_t probs = ev_alloc(e, BT * Vp * F, MT_MEM_ACT, MT_LIFE_STEP);
        uint64_t losses = ev_alloc(e, BT * F, MT_MEM_IO, MT_LIFE_STEP);
        ev_reset(e, MT_SCOPE_PHASE);
        /* backward */
        uint64_t grads[16];
        uint64_t dlogits = ev_alloc(e, BT * Vp * F, MT_MEM_WORK, MT_LIFE_PHASE);
        ev_free(e, probs);
        ev_free(e, logits);
        grads[0] = ev_alloc(e, psz[0] * F, MT_MEM_GRAD, MT_LIFE_STEP);
        uint64_t dres = ev_alloc(e, BTC * F, MT_MEM_WORK, MT_LIFE_PHASE);
        ev_free(e, dlogits);
        grads[14] = ev_alloc(e, psz[14] * F, MT_MEM_GRAD, MT_LIFE_STEP);
        grads[15] = ev_alloc(e, psz[15] * F, MT_MEM_GRAD, MT_LIFE_STEP);
        ev_free(e, lnf), ev_free(e, lnfm), ev_free(e, lnfr);
        for (int i = 2; i < 14; i++) grads[i] = ev_alloc(e, psz[i] * F, MT_MEM_GRAD, MT_LIFE_STEP);
        for (int l = L - 1; l >= 0; l--) {
            uint64_t *A = &act[l * NACT];
            uint64_t d4 = ev_alloc(e, 4 * BTC * F, MT_MEM_WORK, MT_LIFE_PHASE); /* d fch_gelu */
            ev_free(e, A[FCP]), ev_free(e, A[RES3]), ev_free(e, A[FCHG]);
            uint64_t d4b = ev_alloc(e, 4 * BTC * F, MT_MEM_WORK, MT_LIFE_PHASE); /* d fch */
            ev_free(e, d4), ev_free(e, A[FCH]);
            uint64_t dln2 = ev_alloc(e, BTC * F, MT_MEM_WORK, MT_LIFE_PHASE);
            ev_free(e, d4b), ev_free(e, A[LN2]), ev_free(e, A[LN2M]), ev_free(e, A[LN2R]);
            ev_free(e, dln2), ev_free(e, A[RES2]), ev_free(e, A[PROJ]);
            uint64_t datty = ev_alloc(e, BTC * F, MT_MEM_WORK, MT_LIFE_PHASE);
            uint64_t datt = ev_alloc(e, asz[ATT] * F, MT_MEM_WORK, MT_LIFE_PHASE);
            ev_free(e, A[ATTY]), ev_free(e, A[ATT]);
            uint64_t dpre = ev_alloc(e, asz[PREATT] * F, MT_MEM_WORK, MT_LIFE_PHASE);
            ev_free(e, datt), ev_free(e, A[PREATT]);
            uint64_t dqkv = ev_alloc(e, 3 * BTC * F, MT_MEM_WORK, MT_LIFE_PHASE);
            ev_free(e, dpre), ev_free(e, datty), ev_free(e, A[QKV]);
            uint64_t dln1 = ev_alloc(e, BTC * F, MT_MEM_WORK, MT_LIFE_PHASE);
            ev_free(e, dqkv), ev_free(e, A[LN1]), ev_free(e, A[LN1M]), ev_free(e, A[LN1R]);
            ev_free(e, dln1);
        }
        grads[1] = ev_alloc(e, psz[1] * F, MT_MEM_GRAD, MT_LIFE_STEP);
        ev_free(e, dres), ev_free(e, enc);
        ev_reset(e, MT_SCOPE_PHASE);
        for (int i = 0; i < 16; i++) ev_free(e, grads[i]); /* after the update */
        ev_free(e, tok), ev_free(e, tgt), ev_free(e, losses);
        ev_reset(e, MT_SCOPE_STEP);
    }
    free(act);
}

/* Copies the context's recorded events into e, then ends the run. */
static void take_trace(evbuf *e, mt_context *ctx, mt_trainer *t, mt_model *m)
{
    const mt_trace_event *ev;
    size_t n;
    mt_context_trace_events(ctx, &ev, &n, NULL);
    for (size_t i = 0; i < n; i++) ev_push(e, ev[i]);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

/* A trace recorded from the engine: an MLP trained for a few steps. */
static void engine_trace(evbuf *e, int steps)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 1;
    cfg.trace_capacity = 1u << 20;
    mt_context *ctx;
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 4;
    sp.dims[0] = 784, sp.dims[1] = 1024, sp.dims[2] = 1024, sp.dims[3] = 512, sp.dims[4] = 10;
    sp.activation = MT_ACT_GELU;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 256;
    tc.momentum = 0.9f;
    mt_model *m;
    mt_trainer *t;
    if (mt_context_create(&cfg, &ctx) || mt_model_mlp_create(ctx, &sp, &m) ||
        mt_trainer_create(m, &tc, &t)) {
        fprintf(stderr, "engine trace: %s\n", mt_last_error(NULL));
        exit(1);
    }
    float *x = calloc(256 * 784, sizeof *x);
    int32_t y[256];
    for (int i = 0; i < 256 * 784; i++) x[i] = (float)(rnd() % 1000) / 1000.0f;
    for (int i = 0; i < 256; i++) y[i] = (int32_t)(rnd() % 10);
    mt_batch b = {.n = 256, .inputs = x, .targets = y};
    for (int s = 0; s < steps; s++) mt_trainer_step(t, &b, NULL);
    free(x);
    take_trace(e, ctx, t, m);
}

/* A trace recorded from the engine training GPT-2 124M (B4 T64) for a few
 * steps: fp32 AdamW, or bf16 with the fused step and sqrt(n) recompute. */
static void gpt_engine_trace(evbuf *e, int steps, int lean)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.trace_capacity = 1u << 22;
    mt_context *ctx;
    mt_gpt_spec sp;
    mt_gpt_spec_init(&sp);
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 4;
    tc.max_seq = 64;
    tc.optimizer = MT_OPT_ADAMW;
    tc.lr = 3e-4f;
    if (lean) {
        tc.precision = MT_PREC_BF16;
        tc.fused_step = 1;
        tc.recompute = MT_RECOMPUTE_SQRT;
    }
    mt_model *m;
    mt_trainer *t;
    if (mt_context_create(&cfg, &ctx) || mt_model_gpt_create(ctx, &sp, &m) ||
        mt_trainer_create(m, &tc, &t)) {
        fprintf(stderr, "gpt engine trace: %s\n", mt_last_error(NULL));
        exit(1);
    }
    int32_t tok[4 * 65];
    for (int i = 0; i < 4 * 65; i++) tok[i] = (int32_t)(rnd() % 50257);
    mt_batch b = {.n = 4, .tokens = tok, .targets = tok + 1, .seq_len = 64};
    for (int s = 0; s < steps; s++)
        if (mt_trainer_step(t, &b, NULL)) {
            fprintf(stderr, "gpt engine trace: %s\n", mt_last_error(ctx));
            exit(1);
        }
    take_trace(e, ctx, t, m);
}

static void efficiency_row(mt_context *ctx, const char *what, evbuf *e)
{
    static const char *const names[] = {"arena", "pool", "caching", "checkpoint"};
    mt_trace *t;
    if (mt_trace_from_events(ctx, e->v, e->n, &t)) {
        printf("| %s | bad trace: %s |\n", what, mt_last_error(ctx));
        return;
    }
    printf("| %s |", what);
    for (int n = 0; n < 4; n++) {
        mt_allocator_config ac = {.vtable = mt_allocator_by_name(names[n])};
        mt_allocator *a;
        mt_replay_result r;
        if (mt_allocator_create(ctx, &ac, &a) || mt_trace_replay(t, a, &r)) {
            printf(" error: %s |", mt_last_error(ctx));
            continue;
        }
        printf(" %.3f%s |", r.efficiency, r.n_failed ? " (failures)" : "");
        mt_allocator_destroy(a);
    }
    printf("\n");
    mt_trace_free(t);
}

static void efficiency(mt_context *ctx)
{
    printf("\n## Efficiency: peak reserved / peak live (1.000 is perfect)\n\n");
    printf("| trace | arena | pool | caching | checkpoint |\n|---|---|---|---|---|\n");
    static const uint64_t maxes[] = {1, 4, 64};
    for (int i = 0; i < 3; i++) {
        evbuf e = {0};
        rng_state = 1234567 + (uint64_t)i;
        random_trace(&e, quick ? 2000 : 10000, maxes[i] << 20, 4096ull << 20);
        char what[96];
        snprintf(what, sizeof what, "(a) random, sizes 1 B..%llu MiB, %s allocations",
                 (unsigned long long)maxes[i], quick ? "2000" : "10000");
        efficiency_row(ctx, what, &e);
        free(e.v);
    }
    evbuf g = {0};
    gpt2_trace(&g, 5, 12, 4, 64, 768, 12, 50304, 1024);
    efficiency_row(ctx, "(b) GPT-2 124M shape, B4 T64, fp32, 5 steps (synthetic)", &g);
    free(g.v);
    evbuf m = {0};
    engine_trace(&m, 5);
    efficiency_row(ctx, "(c) recorded: MLP 784-1024-1024-512-10, batch 256, 5 steps", &m);
    free(m.v);
    if (!quick) {
        evbuf d = {0};
        gpt_engine_trace(&d, 3, 0);
        efficiency_row(ctx, "(d) recorded: GPT-2 124M, B4 T64, fp32 AdamW, 3 steps", &d);
        free(d.v);
        evbuf d2 = {0};
        gpt_engine_trace(&d2, 3, 1);
        efficiency_row(ctx, "(e) recorded: GPT-2 124M, B4 T64, bf16 fused sqrt(n), 3 steps", &d2);
        free(d2.v);
    }
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else {
            fprintf(stderr, "usage: bench_alloc [--quick]\n");
            return 2;
        }
    }
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 1; /* no BLAS thread pool competing for the cores */
    mt_context *ctx;
    if (mt_context_create(&cfg, &ctx)) {
        fprintf(stderr, "%s\n", mt_last_error(NULL));
        return 1;
    }
    printf("# bench_alloc (memtrain %s, %s)\n", mt_version(), mt_context_device_name(ctx));
    latency(ctx);
    efficiency(ctx);
    mt_context_destroy(ctx);
    return 0;
}
