/*
 * test_offload_host.c - a CUDA context's optimizer state and masters in
 * page-locked host memory (cfg.offload = MT_PLACE_HOST, lib/train/offload_host.c),
 * over the stand-in driver (MT_FAKE_CUDA, MT_FAKE_CUBLASLT; without them
 * these tests check nothing). The stand-in's kernels compute nothing, so
 * what is checked is what runs on the host: the accounting per class and
 * per place against the estimate and in the trace, the copies and events in their order,
 * the CPU update's numbers on gradients the test puts on the device (against
 * AdamW's formula), and the failures; on 2 and 3 ranks over the stand-in
 * NCCL at ZeRO stages 0 to 3 against one rank, training-state files moved
 * between stages and places, and auto-fit choosing it at stage 3. With
 * MT_TEST_GPU=1 the contexts are real GPUs and host offload is compared
 * with the resident run, and files moved between the two.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "train/dp.h"
#include "device/cuda_device.h"
#include "engine/engine.h"
#include "internal.h"
#include "train/home.h"
#include "train/offload.h"
#include "test_comm.h"

enum { B = 2, T = 16, V = 256 };

typedef struct standin {
    void *lib;
    unsigned long long (*stat)(const char *name);
    const char *(*log)(int reset, void *main_stream);
    void (*fail)(const char *call, int skip, int code);
} standin;

static bool on_gpu(void)
{
    const char *g = getenv("MT_TEST_GPU");
    return g && !strcmp(g, "1");
}

/* false where neither the stand-ins nor a GPU (MT_TEST_GPU=1) are there. */
static bool standin_open(standin *s)
{
    memset(s, 0, sizeof *s);
    if (on_gpu()) return true;
    const char *cu = check_fake_cuda(), *lt = getenv("MT_FAKE_CUBLASLT");
    if (!cu || !lt || !*lt) return false;
    s->lib = dlopen(cu, RTLD_NOW | RTLD_LOCAL);
    CHECK_MSG(s->lib, "cannot load %s: %s", cu, dlerror());
    void *p;
    p = dlsym(s->lib, "fake_cuda_stat"), memcpy(&s->stat, &p, sizeof p);
    p = dlsym(s->lib, "fake_cuda_log"), memcpy(&s->log, &p, sizeof p);
    p = dlsym(s->lib, "fake_cuda_fail"), memcpy(&s->fail, &p, sizeof p);
    CHECK(s->stat && s->log && s->fail);
    return true;
}

static void standin_close(standin *s)
{
    if (s->fail) s->fail("", 0, 0);
    if (s->lib) dlclose(s->lib);
}

/* A CUDA context (NULL: the library has no CUDA kernels). */
static mt_context *cuda_context(void)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CUDA;
    cc.trace_capacity = 1 << 16;
    if (!on_gpu()) {
        cc.cuda_driver_path = check_fake_cuda();
        cc.cublaslt_path = getenv("MT_FAKE_CUBLASLT");
    }
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cc, &ctx));
    if (!ctx->ops) {
        mt_context_destroy(ctx);
        return NULL;
    }
    return ctx;
}

static void config(mt_trainer_config *tc, mt_optimizer_kind opt, mt_precision prec, int fused,
                   mt_place place)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B;
    tc->optimizer = opt;
    tc->lr = opt == MT_OPT_SGD ? 0.05f : 2e-3f;
    tc->momentum = opt == MT_OPT_SGD ? 0.9f : 0.0f;
    tc->weight_decay = 0.01f;
    tc->precision = prec;
    tc->master_weights = 1;
    tc->fused_step = fused;
    tc->min_8bit_size = 256;
    tc->offload = place;
}

/* The small GPT's trainer with tc, estimated first, after `steps` steps
 * (their losses into loss, NULL: none). */
static mt_trainer *trained(mt_context *ctx, mt_model *m, const mt_trainer_config *tc,
                           mt_estimate_report *est, int steps, float *loss)
{
    CHECK_OKC(ctx, mt_estimate_model(m, tc, est));
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, tc, &t));
    int32_t tok[B * T], tg[B * T];
    for (int s = 0; s < steps; s++) {
        mt_batch b;
        check_token_batch(&b, tok, tg, B, T, V, s);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, loss ? &loss[s] : NULL));
    }
    return t;
}

/* A few steps; the peaks per class and per place equal the estimate. */
static void accounting(mt_optimizer_kind opt, mt_precision prec, int fused)
{
    mt_context *ctx = cuda_context();
    if (!ctx) return;
    mt_model *m = check_small_gpt(ctx, V, T, 64, 11);
    mt_trainer_config tc;
    config(&tc, opt, prec, fused, MT_PLACE_HOST);
    mt_estimate_report est;
    mt_trainer *t = trained(ctx, m, &tc, &est, 2, NULL);
    mt_memory_stats st, host;
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_HOST, &host));
    for (int k = 0; k < MT_MEM_COUNT; k++) {
        CHECK_MSG(st.per_class[k].peak_live_bytes == est.class_peak[k],
                  "%s: device %s peak %llu, estimate %llu", mt_optimizer_name(opt),
                  mt_mem_class_name(k), (unsigned long long)st.per_class[k].peak_live_bytes,
                  (unsigned long long)est.class_peak[k]);
        CHECK_MSG(host.per_class[k].peak_live_bytes == est.place_class_peak[MT_PLACE_HOST][k],
                  "%s: host %s peak %llu, estimate %llu", mt_optimizer_name(opt),
                  mt_mem_class_name(k), (unsigned long long)host.per_class[k].peak_live_bytes,
                  (unsigned long long)est.place_class_peak[MT_PLACE_HOST][k]);
    }
    CHECK_EQ(st.peak_live_bytes, est.peak);
    CHECK_EQ(st.peak_reserved_bytes, est.peak_reserved);
    CHECK_EQ(host.peak_live_bytes, est.place_peak[MT_PLACE_HOST]);
    /* nothing of the state or the masters on the device; all of it on the host */
    CHECK_EQ(st.per_class[MT_MEM_OPTIM].peak_live_bytes, 0);
    CHECK_EQ(st.per_class[MT_MEM_MASTER].peak_live_bytes, 0);
    const uint64_t P = mt_model_num_params(m);
    if (opt == MT_OPT_ADAMW) CHECK_EQ(host.per_class[MT_MEM_OPTIM].live_bytes, 8 * P);
    CHECK_EQ(host.per_class[MT_MEM_MASTER].live_bytes, prec == MT_PREC_FP32 ? 0 : 4 * P);
    CHECK(host.per_class[MT_MEM_GRAD].live_bytes > 0 && host.per_class[MT_MEM_PARAM].live_bytes > 0);
    char rep[16384];
    CHECK_OK(mt_memory_report(ctx, rep, sizeof rep, NULL));
    CHECK(strstr(rep, "host") != NULL);
    const uint64_t optim_host = host.per_class[MT_MEM_OPTIM].live_bytes;
    mt_trainer_destroy(t);
    CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_HOST, &host));
    CHECK_EQ(host.live_bytes, 0);
    /* the trace has every pinned block, made and given back, at place host */
    const mt_trace_event *ev;
    size_t n;
    uint64_t dropped, sums[2][MT_MEM_COUNT] = {{0}};
    CHECK_OK(mt_context_trace_events(ctx, &ev, &n, &dropped));
    CHECK_EQ(dropped, 0);
    for (size_t i = 0; i < n; i++)
        if (ev[i].place == MT_PLACE_HOST) sums[ev[i].op == MT_TRACE_FREE][ev[i].mem_class] += ev[i].bytes;
    CHECK_EQ(sums[0][MT_MEM_OPTIM], optim_host);
    CHECK(memcmp(sums[0], sums[1], sizeof sums[0]) == 0);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

TEST(offload_host_estimate_equals_run)
{
    standin s;
    if (!standin_open(&s) || on_gpu()) return standin_close(&s);
    const unsigned long long pinned0 = s.stat("pinned"), events0 = s.stat("events");
    accounting(MT_OPT_ADAMW, MT_PREC_FP32, 0);
    accounting(MT_OPT_ADAMW, MT_PREC_BF16, 1);
    accounting(MT_OPT_ADAMW8, MT_PREC_FP16, 0);
    accounting(MT_OPT_SGD, MT_PREC_FP32, 1);
    accounting(MT_OPT_ADAFACTOR, MT_PREC_BF16, 0);
    CHECK_EQ(s.stat("pinned"), pinned0); /* every page-locked byte given back */
    CHECK_EQ(s.stat("events"), events0);
    standin_close(&s);
}

/* The update on gradients the test puts on the device: AdamW's first two
 * steps with the same gradient g from zero state move each weight by
 * lr * (g / (|g| + eps) + wd * w), whatever the piece it lies in (pieces
 * of 4096 elements cut every tensor); bf16 weights are the masters rounded. */
static void numbers(mt_precision prec)
{
    mt_context *ctx = cuda_context();
    if (!ctx) return;
    mt_model *m = check_small_gpt(ctx, V, T, 64, 11);
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 4096;
    mt_trainer_config tc;
    config(&tc, MT_OPT_ADAMW, prec, 0, MT_PLACE_HOST);
    tc.lr = 1e-2f;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    const size_t P = mt_model_num_params(m);
    float *w0 = check_alloc(P * 4), *w = check_alloc(P * 4), *g = check_alloc(P * 4);
    CHECK_OKC(ctx, mt_model_get_params(m, w0, P));
    for (size_t e = 0; e < P; e++) g[e] = (float)((int)(e * 7919 % 2001) - 1000) * 1e-4f;
    mt_block gb;
    mt_alloc_request r = {.bytes = P * 4, .mem_class = MT_MEM_IO, .lifetime = MT_LIFE_PERSISTENT};
    CHECK_OKC(ctx, mt_context_alloc(ctx, &r, &gb));
    CHECK_OKC(ctx, ctx->dev->copy_h2d(ctx->dev, gb.ptr, g, P * 4));
    double expect_w = 0;
    for (int step = 0; step < 2; step++) {
        t->lr = tc.lr;
        for (int i = 0; i < m->n_param; i++) {
            const mti_param *p = &m->params[i];
            CHECK_OKC(ctx, mti_hostoff_update(t->hoff, i, (float *)gb.ptr + p->offset, 0, p->numel, 1.0f));
        }
        CHECK_OKC(ctx, mti_hostoff_end(t->hoff));
        t->opt_steps++;
    }
    CHECK_OKC(ctx, mt_model_get_params(m, w, P)); /* (the masters in bf16) */
    double worst = 0;
    for (int i = 0; i < m->n_param; i++) {
        const mti_param *p = &m->params[i];
        const size_t off = p->offset;
        const float wd = tc.weight_decay; /* (decay_1d: every tensor) */
        for (size_t e = off; e < off + p->numel; e++) {
            double x = w0[e];
            for (int k = 0; k < 2; k++) {
                const double gg = g[e], u = gg / (fabs(gg) / sqrt(1.0) + tc.eps);
                x = x - tc.lr * wd * x - tc.lr * u;
            }
            const double d = fabs(x - w[e]) / (fabs(x) + 1e-3);
            if (d > worst) worst = d, expect_w = x;
        }
    }
    CHECK_MSG(worst < 1e-5, "worst relative error %g (weight %g)", worst, expect_w);
    if (prec == MT_PREC_BF16) { /* the compute copy on the device: the masters rounded */
        const mti_param *p = &m->params[1];
        uint16_t *h = check_alloc(p->numel * 2);
        float *ms = check_alloc(p->numel * 4);
        CHECK_OKC(ctx, ctx->dev->copy_d2h(ctx->dev, h, p->w.blk.ptr, p->numel * 2));
        CHECK_OKC(ctx, ctx->dev->copy_d2h(ctx->dev, ms, p->master.blk.ptr, p->numel * 4));
        for (size_t e = 0; e < p->numel; e++) CHECK_EQ(h[e], mti_f32_to_bf16(ms[e]));
            }
    mt_context_free(ctx, &gb);
    mt_trainer_destroy(t);
    mti_offload_piece_elems = keep;
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

TEST(offload_host_update_numbers)
{
    standin s;
    if (!standin_open(&s) || on_gpu()) return standin_close(&s);
    numbers(MT_PREC_FP32);
    numbers(MT_PREC_BF16);
    standin_close(&s);
}

/* Each piece: its gradient down on the main stream with an event, the
 * update thread waiting for that event (a blocking-sync one), the weights
 * up on the second stream with an event; the step's end waits for the
 * second stream. */
TEST(offload_host_copy_sequence)
{
    standin s;
    if (!standin_open(&s) || on_gpu()) return standin_close(&s);
    mt_context *ctx = cuda_context();
    if (!ctx) return standin_close(&s);
    mt_model *m = check_small_gpt(ctx, V, T, 64, 11);
    mt_trainer_config tc;
    config(&tc, MT_OPT_ADAMW, MT_PREC_BF16, 1, MT_PLACE_HOST);
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    check_token_batch(&b, tok, tg, B, T, V, 0);
    s.log(1, mti_cuda_stream(ctx->dev));
    const unsigned long long spins = s.stat("spin_syncs");
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    /* the update thread's waits sleep (blocking-sync events), not spin */
    CHECK_EQ(s.stat("spin_syncs"), spins);
    const char *log = s.log(0, NULL);
    /* two threads write the log, so their words interleave: count each
     * thread's words on their own rather than as adjacent runs */
    int pieces = 0, ups = 0, waits = 0;
    for (const char *q = log; (q = strstr(q, "m:D>H ")); q++) pieces++;
    for (const char *q = log; (q = strstr(q, "s:H>D ")); q++) ups++;
    for (const char *q = log; (q = strstr(q, "wait ")); q++) waits++;
    int trained = 0;
    for (int i = 0; i < m->n_param; i++) trained += !m->params[i].frozen;
    CHECK_MSG(pieces >= trained && ups == pieces && waits >= ups,
              "%d pieces down, %d up, %d waits, %d tensors: %.400s", pieces, ups, waits, trained,
              log);
    CHECK_MSG(!strstr(log, "wait0"), "an event waited for before it was recorded: %.400s", log);
    /* the step's end: the second stream drained after the last upload */
    const char *last_up = NULL;
    for (const char *q = log; (q = strstr(q, "s:rec")); q++) last_up = q;
    CHECK(last_up && strstr(last_up, "s:sync"));
    /* nothing comes up before its gradient went down */
    CHECK(strstr(log, "m:D>H") < strstr(log, "s:H>D"));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    standin_close(&s);
}

TEST(offload_host_refusals_and_faults)
{
    standin s;
    if (!standin_open(&s) || on_gpu()) return standin_close(&s);
    /* pinned memory refused: MT_ERR_OOM naming the amount, nothing held */
    setenv("MT_FAKE_CUDA_PINNED", "65536", 1);
    mt_context *ctx = cuda_context();
    if (!ctx) {
        unsetenv("MT_FAKE_CUDA_PINNED");
        return standin_close(&s);
    }
    mt_model *m = check_small_gpt(ctx, V, T, 64, 11);
    mt_trainer_config tc;
    config(&tc, MT_OPT_ADAMW, MT_PREC_FP32, 0, MT_PLACE_HOST);
    mt_trainer *t = NULL;
    const unsigned long long pinned0 = s.stat("pinned");
    CHECK_ST(MT_ERR_OOM, mt_trainer_create(m, &tc, &t));
    CHECK_MSG(strstr(mt_last_error(ctx), "cuMemHostAlloc of ") &&
                  strstr(mt_last_error(ctx), "pinned host memory"),
              "%s", mt_last_error(ctx));
    CHECK_EQ(s.stat("pinned"), pinned0);
    mt_memory_stats host;
    CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_HOST, &host));
    CHECK_EQ(host.live_bytes, 0);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    unsetenv("MT_FAKE_CUDA_PINNED");

    ctx = cuda_context();
    m = check_small_gpt(ctx, V, T, 64, 11);
    /* settings it does not take */
    config(&tc, MT_OPT_ADAMW, MT_PREC_BF16, 0, MT_PLACE_HOST);
    tc.master_weights = 0;
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "master weights"));
    config(&tc, MT_OPT_ADAMW4, MT_PREC_FP32, 0, MT_PLACE_HOST);
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "4-bit"));
    config(&tc, MT_OPT_ADAMW, MT_PREC_BF16, 0, MT_PLACE_HOST);
    tc.offload_params = 1; /* (the weights stay on the device, at any stage) */
    tc.zero_stage = 3;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK_MSG(strstr(mt_last_error(ctx), "does not combine with cfg->offload host"), "%s",
              mt_last_error(ctx));
    /* a failed copy down: the step fails with the driver's word, the next one runs */
    config(&tc, MT_OPT_ADAMW, MT_PREC_BF16, 0, MT_PLACE_HOST);
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    check_token_batch(&b, tok, tg, B, T, V, 0);
    s.fail("cuMemcpyAsync", 3, 700 /* CUDA_ERROR_ILLEGAL_ADDRESS */);
    CHECK_ST(MT_ERR_DEVICE, mt_trainer_step(t, &b, NULL));
    CHECK_MSG(strstr(mt_last_error(ctx), "cuMemcpyAsync"), "%s", mt_last_error(ctx));
    /* a failed upload (on the update thread): reported by the step */
    s.fail("cuEventRecord", 9, 700);
    CHECK_ST(MT_ERR_DEVICE, mt_trainer_step(t, &b, NULL));
    CHECK_MSG(strstr(mt_last_error(ctx), "host offload") || strstr(mt_last_error(ctx), "cuEventRecord"),
              "%s", mt_last_error(ctx));
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    mt_trainer_destroy(t);
    /* fp32: a piece's second copy down (its weights) fails after its first
       (the gradient) was queued: that one is waited for before the step
       fails, so no copy into the slot's pinned memory is left */
    config(&tc, MT_OPT_ADAMW, MT_PREC_FP32, 0, MT_PLACE_HOST);
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    s.log(1, mti_cuda_stream(ctx->dev));
    s.fail("cuMemcpyAsync", 1, 700);
    CHECK_ST(MT_ERR_DEVICE, mt_trainer_step(t, &b, NULL));
    const char *log = s.log(0, NULL), *down = strstr(log, "m:D>H ");
    CHECK_MSG(down && strstr(down, "m:sync"), "no wait after the failed copy: %.400s", log);
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    /* the masters in host memory through the model's parameters */
    const size_t P = mt_model_num_params(m);
    float *w = check_alloc(P * 4), *w2 = check_alloc(P * 4);
    for (size_t e = 0; e < P; e++) w[e] = (float)e * 1e-6f;
    CHECK_OKC(ctx, mt_model_set_params(m, w, P));
    CHECK_OKC(ctx, mt_model_get_params(m, w2, P));
    CHECK(memcmp(w, w2, P * 4) == 0);
    mt_trainer_destroy(t);
    CHECK_OKC(ctx, mt_model_get_params(m, w2, P)); /* back on the device, in fp32 */
    CHECK(memcmp(w, w2, P * 4) == 0);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    /* a CPU context: host offload is the device's own memory */
    ctx = check_cpu_context(1);
    m = check_small_gpt(ctx, V, T, 64, 11);
    config(&tc, MT_OPT_ADAMW, MT_PREC_FP32, 0, MT_PLACE_HOST);
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "CUDA context"));
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    standin_close(&s);
}

/* ---- several ranks over the stand-in NCCL (threads as ranks) ---- */

enum { MAXR = 3, HR_STEPS = 2 };

typedef struct hr_run {
    tcomm_world *w;
    int n;    /* ranks; 1: the reference, one context without a communicator */
    int host; /* the ranks' communicator: the in-process host one, not NCCL */
    mt_trainer_config tc;
    const char *dir;         /* where the ranks save their training-state files */
    const char *load, *save; /* or: a file loaded (no steps), saved again as save */
    const char *name;        /* the files' names' start (NULL: "ranks", or "one" on one rank) */
    unsigned char *wb[MAXR]; /* per rank: every tensor's weights as stored (compute dtype) */
    unsigned char *held[MAXR]; /* and which of those bytes it holds (ZeRO-3: its slices) */
    float *ms[MAXR];         /* and the fp32 masters it holds, NaN elsewhere */
    float *w0[MAXR];         /* and its weights before the trainer (fp32) */
    size_t wlen, P;
    mt_status st[MAXR];
    char msg[MAXR][400];
} hr_run;

/* Each tensor's weights and masters as this rank holds them, after its
 * steps (ZeRO-3: the slices of the weights it holds, and those marked). */
static mt_status hr_take(hr_run *a, int rank, const mt_trainer *t)
{
    const mt_model *m = t->model;
    mt_context *ctx = m->ctx;
    size_t len = 0;
    for (int i = 0; i < m->n_param; i++) len += mti_tensor_bytes(&m->params[i].w);
    a->wlen = len;
    a->P = mt_model_num_params(m);
    a->wb[rank] = malloc(len);
    a->held[rank] = calloc(len, 1);
    a->ms[rank] = malloc(a->P * sizeof(float));
    if (!a->wb[rank] || !a->held[rank] || !a->ms[rank]) return MT_ERR_OOM;
    mt_status s = MT_OK;
    size_t at = 0;
    for (size_t e = 0; e < a->P; e++) a->ms[rank][e] = NAN;
    for (int i = 0; i < m->n_param && !s; i++) {
        const mti_param *p = &m->params[i];
        const size_t bytes = mti_tensor_bytes(&p->w), es = mti_dtype_size(p->w.dtype);
        const bool slices = m->params_sharded && !p->frozen;
        const size_t lo = slices ? t->sh[i].lo : 0, hi = slices ? t->sh[i].hi : p->numel;
        if (hi > lo) s = ctx->dev->copy_d2h(ctx->dev, a->wb[rank] + at + lo * es,
                                            mti_home_weights(t, i, lo), (hi - lo) * es);
        memset(a->held[rank] + at + lo * es, 1, (hi - lo) * es);
        at += bytes;
        if (!s && p->master.blk.ptr)
            s = ctx->dev->copy_d2h(ctx->dev, a->ms[rank] + p->offset + p->master_lo,
                                   p->master.blk.ptr, mti_tensor_bytes(&p->master));
        if (!s) s = ctx->dev->sync(ctx->dev);
    }
    return s;
}

/* Where the peaks of this rank (device and host, per class) and its
 * estimate differ, into msg ("" where they agree). */
static void hr_estimate(mt_context *ctx, const mt_model *m, const mt_trainer_config *tc, char *msg,
                        size_t cap)
{
    mt_estimate_report e;
    mt_memory_stats dev, host;
    if (mt_estimate_model((mt_model *)m, tc, &e)) {
        snprintf(msg, cap, "estimate: %s", mt_last_error(ctx));
        return;
    }
    mt_context_memory_stats(ctx, &dev);
    mt_context_place_stats(ctx, MT_PLACE_HOST, &host);
    for (int k = 0; k < MT_MEM_COUNT && !*msg; k++) {
        if (dev.per_class[k].peak_live_bytes != e.class_peak[k])
            snprintf(msg, cap, "device %s peak %llu, estimate %llu", mt_mem_class_name(k),
                     (unsigned long long)dev.per_class[k].peak_live_bytes,
                     (unsigned long long)e.class_peak[k]);
        else if (host.per_class[k].peak_live_bytes != e.place_class_peak[MT_PLACE_HOST][k])
            snprintf(msg, cap, "host %s peak %llu, estimate %llu", mt_mem_class_name(k),
                     (unsigned long long)host.per_class[k].peak_live_bytes,
                     (unsigned long long)e.place_class_peak[MT_PLACE_HOST][k]);
    }
    if (!*msg && (dev.peak_live_bytes != e.peak || host.peak_live_bytes != e.place_peak[MT_PLACE_HOST]))
        snprintf(msg, cap, "peaks %llu (device), %llu (host); estimate %llu, %llu",
                 (unsigned long long)dev.peak_live_bytes, (unsigned long long)host.peak_live_bytes,
                 (unsigned long long)e.peak, (unsigned long long)e.place_peak[MT_PLACE_HOST]);
    if (tc->offload != MT_PLACE_HOST) return; /* (a resident run, for comparison) */
    if (!*msg && !host.per_class[MT_MEM_OPTIM].peak_live_bytes)
        snprintf(msg, cap, "no optimizer state on the host");
    if (!*msg && dev.per_class[MT_MEM_OPTIM].peak_live_bytes + dev.per_class[MT_MEM_MASTER].peak_live_bytes)
        snprintf(msg, cap, "optimizer state or masters on the device");
}

/* The ranks' GPT (2 layers, `channels` wide) on ctx. */
static mt_status rank_gpt(mt_context *ctx, int channels, mt_model **m)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 2, g.heads = 4, g.channels = channels, g.seed = 11;
    return mt_model_gpt_create(ctx, &g, m);
}

/* Whether the stand-in NCCL is there too (else the test skips, saying so). */
static bool nccl_open(standin *s)
{
    if (!standin_open(s) || on_gpu()) return false;
    if (getenv("MT_FAKE_NCCL")) return true;
    fprintf(stderr, "    (skipped: MT_FAKE_NCCL is not set)\n");
    return false;
}

static void hr_rank(int rank, void *arg)
{
    hr_run *a = arg;
    mt_comm *c = NULL;
    mt_status s = MT_OK;
    if (a->n > 1 && a->host) {
        c = tcomm_make(a->w, rank, a->n, 0);
    } else if (a->n > 1) {
        c = tcomm_nccl(a->w, rank, a->n);
        s = c ? MT_OK : MT_ERR_COMM;
    }
    mt_context *ctx = s ? NULL : tcomm_cuda_context(c);
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    if (!s && !ctx) s = MT_ERR_NO_DEVICE;
    if (!s) s = rank_gpt(ctx, 64, &m);
    const size_t P = m ? mt_model_num_params(m) : 0;
    if (!s && !(a->w0[rank] = malloc(P * sizeof(float)))) s = MT_ERR_OOM;
    if (!s) s = mt_model_get_params(m, a->w0[rank], P);
    if (!s) s = mt_trainer_create(m, &a->tc, &t);
    if (a->load) { /* (a collective under ZeRO, as the save) */
        if (!s) s = mt_trainer_load(t, a->load, NULL, 0, NULL);
        if (!s) s = mt_trainer_save(t, a->save, NULL, 0);
        if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
        a->st[rank] = s;
        mt_trainer_destroy(t);
        mt_model_destroy(m);
        mt_context_destroy(ctx);
        mt_comm_destroy(c);
        return;
    }
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    for (int k = 0; k < HR_STEPS && !s; k++) {
        check_token_batch(&b, tok, tg, B, T, V, k);
        s = mt_trainer_step(t, &b, NULL);
    }
    if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    if (!s) s = hr_take(a, rank, t);
    if (!s) hr_estimate(ctx, m, &a->tc, a->msg[rank], sizeof a->msg[rank]);
    /* the training state saved (rank 0 writes it under ZeRO), loaded back
       (every rank keeping its part) and saved again */
    char path[2][512];
    const int me = a->tc.zero_stage ? 0 : rank;
    for (int k = 0; k < 2; k++)
        snprintf(path[k], sizeof path[k], "%s/%s%d.%d.mtt", a->dir,
                 a->name ? a->name : a->n > 1 ? "ranks" : "one", me, k);
    if (!s) s = mt_trainer_save(t, path[0], NULL, 0);
    if (!s) s = mt_trainer_load(t, path[0], NULL, 0, NULL);
    if (!s) s = mt_trainer_save(t, path[1], NULL, 0);
    if (s && !a->msg[rank][0]) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", mt_last_error(ctx));
    a->st[rank] = s;
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

static void hr_free(hr_run *a)
{
    for (int r = 0; r < MAXR; r++) free(a->wb[r]), free(a->held[r]), free(a->ms[r]), free(a->w0[r]);
}

/* A file's bytes (malloc'd) and their count. */
static unsigned char *read_whole(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    CHECK_MSG(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    rewind(f);
    unsigned char *b = malloc(*n + 1);
    CHECK(b != NULL);
    CHECK(fread(b, 1, *n, f) == *n);
    fclose(f);
    return b;
}

/* File `from` loaded by n ranks at `stage` with the state at `place` (one
 * rank: n 1) and saved again as `to` (kept where keep is set): the same
 * bytes as `want`. */
static void moved(const hr_run *like, const char *dir, int n, int stage, mt_place place,
                  const char *from, const char *to, const unsigned char *want, size_t nw, bool keep)
{
    char p[600], q[600];
    snprintf(p, sizeof p, "%s/%s", dir, from);
    snprintf(q, sizeof q, "%s/%s", dir, to);
    hr_run a = {.n = n, .dir = dir, .tc = like->tc, .load = p, .save = q};
    a.tc.zero_stage = stage;
    a.tc.offload = place;
    a.tc.fused_step = 0;
    if (n > 1) {
        a.w = tcomm_world_new(n, 30.0);
        tcomm_run(n, hr_rank, &a);
        tcomm_world_free(a.w);
    } else {
        hr_rank(0, &a);
    }
    for (int r = 0; r < n; r++)
        CHECK_MSG(a.st[r] == MT_OK, "%s loaded on %d ranks at stage %d, %s: rank %d: %s", from, n,
                  stage, mt_place_name(place), r, a.msg[r]);
    size_t got;
    unsigned char *f = a.st[0] ? NULL : read_whole(q, &got);
    CHECK_MSG(!f || (got == nw && !memcmp(f, want, nw)),
              "%s loaded on %d ranks at stage %d, %s, saved again: differs", from, n, stage,
              mt_place_name(place));
    free(f);
    if (!keep) remove(q);
    hr_free(&a);
}

/* n ranks with host offload at tc's stage (over NCCL; host: over a host
 * communicator) against one rank with host offload on the ranks' summed
 * gradients: every rank's weights (compute copies) are the reference's bit
 * for bit, its masters the reference's on the elements it holds, and its
 * peaks per class and per place its estimate's. At stage 3 the ranks'
 * file moves: loaded by one rank with the state on the device, by the
 * ranks at stage 2 with host offload, and one rank's resident file by the
 * ranks at stage 3 with host offload, each saves it again unchanged. */
static void ranks_case(int n, int stage, mt_optimizer_kind opt, mt_precision prec, int fused,
                       int clip, int host)
{
    char dir[] = "/tmp/mt_hostoff_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    hr_run one = {.n = 1, .dir = dir}, dp = {.n = n, .w = tcomm_world_new(n, 30.0), .host = host, .dir = dir};
    config(&one.tc, opt, prec, fused, MT_PLACE_HOST);
    one.tc.grad_clip = clip ? 1.0f : 0.0f;
    dp.tc = one.tc;
    dp.tc.zero_stage = stage;
    one.tc.fused_step = 0;
    tcomm_fill_sum = n;
    hr_rank(0, &one);
    tcomm_fill_sum = 0;
    tcomm_run(n, hr_rank, &dp);
    tcomm_world_free(dp.w);
    const char *name = mt_optimizer_name(opt);
    CHECK_MSG(one.st[0] == MT_OK && !one.msg[0][0], "%s: one rank: %s", name, one.msg[0]);
    for (int r = 0; r < n; r++) {
        CHECK_MSG(dp.st[r] == MT_OK && !dp.msg[r][0], "%s, %d ranks, stage %d, rank %d: %s", name,
                  n, stage, r, dp.msg[r]);
        if (dp.st[r] || one.st[0]) continue;
        size_t wdiff = dp.wlen == one.wlen ? 0 : 1;
        for (size_t k = 0; k < one.wlen && !wdiff; k++)
            wdiff += dp.held[r][k] && dp.wb[r][k] != one.wb[0][k];
        CHECK_MSG(!wdiff, "%s, %d ranks, stage %d: rank %d's weights differ from one rank's", name,
                  n, stage, r);
        size_t held = 0, differ = 0;
        for (size_t e = 0; e < one.P; e++) {
            if (isnan(dp.ms[r][e])) continue;
            held++;
            differ += memcmp(&dp.ms[r][e], &one.ms[0][e], 4) != 0;
        }
        CHECK_MSG(!differ, "%s, %d ranks, stage %d: %zu of rank %d's masters differ", name, n,
                  stage, differ, r);
        if (prec != MT_PREC_FP32 && stage) CHECK(held < one.P); /* a slice of them */
    }
    /* every weight held by some rank (ZeRO-3: by its slice's rank alone) */
    size_t nobody = 0, all = 0;
    for (size_t k = 0; k < one.wlen && dp.wlen == one.wlen && !dp.st[0]; k++) {
        int by = 0;
        for (int r = 0; r < n; r++) by += dp.st[r] == MT_OK && dp.held[r][k];
        nobody += by == 0;
        all += by == n;
    }
    CHECK_MSG(!nobody, "%s, %d ranks, stage %d: %zu weight bytes held by no rank", name, n, stage,
              nobody);
    if (stage == 3) CHECK_MSG(all < one.wlen, "%s, %d ranks: every rank holds every weight", name, n);
    /* the files: the reference's, bit for bit (saved, and saved again after
       a load) */
    char p[600], q[600];
    snprintf(p, sizeof p, "%s/one0.0.mtt", dir);
    size_t n0, n1;
    unsigned char *f0 = read_whole(p, &n0);
    if (stage == 3 && !dp.st[0]) {
        moved(&dp, dir, 1, 0, MT_PLACE_DEVICE, "ranks0.0.mtt", "resident.mtt", f0, n0, true);
        moved(&dp, dir, n, 2, MT_PLACE_HOST, "ranks0.0.mtt", "stage2.mtt", f0, n0, false);
        moved(&dp, dir, n, 3, MT_PLACE_HOST, "resident.mtt", "back.mtt", f0, n0, false);
        snprintf(q, sizeof q, "%s/resident.mtt", dir);
        remove(q);
    }
    for (int r = 0; r < (stage ? 1 : n); r++)
        for (int k = 0; k < 2; k++) {
            snprintf(q, sizeof q, "%s/ranks%d.%d.mtt", dir, r, k);
            unsigned char *f1 = read_whole(q, &n1);
            CHECK_MSG(n1 == n0 && !memcmp(f0, f1, n0), "%s, %d ranks, stage %d: %s differs from one rank's file",
                      name, n, stage, q);
            free(f1);
            remove(q);
        }
    free(f0);
    remove(p);
    snprintf(p, sizeof p, "%s/one0.1.mtt", dir);
    remove(p);
    CHECK(rmdir(dir) == 0);
    hr_free(&one);
    hr_free(&dp);
}

/* Host offload against the resident run at ZeRO stage 3, bit for bit:
 * the stand-in's SGD (MT_FAKE_CUDA_SGD) is the CPU table's arithmetic, so
 * with fp32 SGD with momentum on n ranks the resident run (the device's
 * update of each slice) and the host-offloaded one (the CPU's) hold the
 * same weight slices after their steps, each run's peaks are its
 * estimate's, and their training-state files (the momentum with the
 * weights) are the same bytes. */
static void resident_case(int n, int fused)
{
    char dir[] = "/tmp/mt_hostoff_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    hr_run r[2];
    setenv("MT_FAKE_CUDA_SGD", "1", 1);
    for (int h = 0; h < 2; h++) {
        r[h] = (hr_run){.n = n, .w = tcomm_world_new(n, 30.0), .dir = dir, .name = h ? "host" : "res"};
        config(&r[h].tc, MT_OPT_SGD, MT_PREC_FP32, fused, h ? MT_PLACE_HOST : MT_PLACE_DEVICE);
        r[h].tc.zero_stage = 3;
        tcomm_run(n, hr_rank, &r[h]);
        tcomm_world_free(r[h].w);
    }
    unsetenv("MT_FAKE_CUDA_SGD");
    for (int rk = 0; rk < n; rk++) {
        for (int h = 0; h < 2; h++)
            CHECK_MSG(r[h].st[rk] == MT_OK && !r[h].msg[rk][0], "%d ranks, %s, rank %d: %s", n,
                      h ? "host offload" : "resident", rk, r[h].msg[rk]);
        size_t differ = r[0].wlen == r[1].wlen ? 0 : 1, held = 0;
        for (size_t k = 0; k < r[0].wlen && !differ; k++) {
            differ += r[0].held[rk][k] != r[1].held[rk][k] ||
                      (r[0].held[rk][k] && r[0].wb[rk][k] != r[1].wb[rk][k]);
            held += r[0].held[rk][k];
        }
        CHECK_MSG(!differ && held, "%d ranks, rank %d: host offload's weight slices differ from the "
                  "resident run's", n, rk);
    }
    char p[600], q[600];
    snprintf(p, sizeof p, "%s/res0.0.mtt", dir);
    snprintf(q, sizeof q, "%s/host0.0.mtt", dir);
    CHECK_MSG(check_same_file(p, q), "%d ranks: host offload's file differs from the resident run's", n);
    /* and the weights moved (by the gradients the test fills in) */
    size_t moved_bytes = 0;
    for (size_t k = 0; !r[1].st[0] && k < r[1].wlen; k++)
        moved_bytes += r[1].held[0][k] && r[1].wb[0][k] != ((unsigned char *)r[1].w0[0])[k];
    CHECK_MSG(moved_bytes > 0, "%d ranks: the weights did not move", n);
    for (int k = 0; k < 2; k++)
        for (int h = 0; h < 2; h++) {
            snprintf(q, sizeof q, "%s/%s0.%d.mtt", dir, h ? "host" : "res", k);
            remove(q);
        }
    CHECK(rmdir(dir) == 0);
    hr_free(&r[0]);
    hr_free(&r[1]);
}

TEST(offload_host_ranks_nccl)
{
    standin s;
    if (!nccl_open(&s)) return standin_close(&s);
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 512; /* pieces cut the tensors and the shards */
    mti_engine_grad_fill = tcomm_fill_grads;
    const unsigned long long pinned0 = s.stat("pinned");
    ranks_case(2, 0, MT_OPT_ADAMW, MT_PREC_FP32, 0, 0, 0);
    ranks_case(2, 0, MT_OPT_SGD, MT_PREC_BF16, 1, 0, 0);
    ranks_case(2, 1, MT_OPT_ADAMW, MT_PREC_BF16, 0, 1, 0);
    ranks_case(2, 1, MT_OPT_ADAFACTOR, MT_PREC_FP32, 0, 0, 0);
    ranks_case(2, 2, MT_OPT_ADAMW8, MT_PREC_FP16, 0, 0, 0);
    ranks_case(2, 2, MT_OPT_SGD, MT_PREC_FP32, 1, 1, 0);
    ranks_case(3, 1, MT_OPT_ADAMW8, MT_PREC_FP32, 1, 0, 0);
    ranks_case(3, 2, MT_OPT_ADAMW, MT_PREC_BF16, 0, 0, 0);
    ranks_case(2, 3, MT_OPT_ADAMW, MT_PREC_BF16, 0, 1, 0);
    ranks_case(2, 3, MT_OPT_SGD, MT_PREC_FP32, 1, 0, 0);
    ranks_case(2, 3, MT_OPT_ADAFACTOR, MT_PREC_FP32, 0, 0, 0);
    ranks_case(3, 3, MT_OPT_ADAMW8, MT_PREC_FP16, 0, 0, 0);
    ranks_case(3, 3, MT_OPT_ADAMW, MT_PREC_FP32, 1, 1, 0);
    ranks_case(2, 0, MT_OPT_ADAMW, MT_PREC_BF16, 0, 1, 1); /* (MPI's kind: stage 0 only) */
    resident_case(2, 0);
    resident_case(3, 1);
    mti_engine_grad_fill = NULL;
    mti_offload_piece_elems = keep;
    CHECK_EQ(s.stat("pinned"), pinned0); /* every page-locked byte given back */
    standin_close(&s);
}

/* Auto-fit at ZeRO stage 3 on 2 ranks of a CUDA context: at the least
 * budget anything fits (the state in host memory; resident needs more)
 * both ranks choose host offload, and each rank's run of it stays within
 * the budget, the heavier at the estimate auto-fit chose by. */
typedef struct af_run {
    tcomm_world *w;
    mt_autofit_report r[2];
    uint64_t budget[2], peak[2];
    mt_status st[2];
    char msg[2][600];
} af_run;

static void af_rank(int rank, void *arg)
{
    af_run *a = arg;
    mt_comm *c = tcomm_nccl(a->w, rank, 2);
    mt_context *ctx = c ? tcomm_cuda_context(c) : NULL;
    mt_model *m = NULL;
    /* (128 wide: the state outweighs the allocators' grain) */
    mt_status s = ctx ? rank_gpt(ctx, 128, &m) : MT_ERR_NO_DEVICE;
    mt_trainer *t = NULL;
    mt_trainer_config f;
    config(&f, MT_OPT_ADAMW, MT_PREC_BF16, 0, MT_PLACE_DEVICE);
    f.zero_stage = 3;
    f.max_seq = T;
    f.memory_budget = 1;
    unsigned long long least = 0;
    if (!s && mt_trainer_autofit(m, &f, 0, &a->r[rank]) == MT_ERR_BUDGET) {
        const char *at = strstr(mt_last_error(ctx), "the least is ");
        if (at && sscanf(at, "the least is %llu", &least) == 1 && !strstr(at, "host memory"))
            snprintf(a->msg[rank], sizeof a->msg[rank], "the least is not with host offload: %s", at);
    }
    if (!s && !least) s = MT_ERR_INTERNAL;
    f.memory_budget = a->budget[rank] = least;
    if (!s) s = mt_trainer_autofit(m, &f, 0, &a->r[rank]);
    if (!s) s = mt_trainer_create(m, &f, &t);
    int32_t tok[B * T], tg[B * T];
    for (int k = 0; k < 2 && !s; k++) {
        mt_batch b;
        check_token_batch(&b, tok, tg, B, T, V, k + rank);
        s = mt_trainer_step(t, &b, NULL);
    }
    mt_memory_stats ms;
    if (!s && !mt_context_memory_stats(ctx, &ms)) a->peak[rank] = ms.peak_reserved_bytes;
    if (s && !a->msg[rank][0]) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", ctx ? mt_last_error(ctx) : "no context");
    a->st[rank] = s;
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(offload_host_autofit_zero3)
{
    standin s;
    if (!nccl_open(&s)) return standin_close(&s);
    af_run a = {.w = tcomm_world_new(2, 30.0)};
    tcomm_run(2, af_rank, &a);
    tcomm_world_free(a.w);
    for (int r = 0; r < 2; r++) {
        CHECK_MSG(a.st[r] == MT_OK && !a.msg[r][0], "rank %d: %s", r, a.msg[r]);
        CHECK_EQ(a.r[r].offload, MT_PLACE_HOST);
        CHECK_MSG(a.peak[r] <= a.budget[r], "rank %d: peak %llu, budget %llu", r,
                  (unsigned long long)a.peak[r], (unsigned long long)a.budget[r]);
    }
    CHECK_EQ(a.budget[0], a.budget[1]);
    CHECK(a.r[0].micro_batch == a.r[1].micro_batch && a.r[0].peak_reserved == a.r[1].peak_reserved);
    const uint64_t worst = a.peak[0] > a.peak[1] ? a.peak[0] : a.peak[1];
    CHECK_EQ(worst, a.r[0].peak_reserved);
    standin_close(&s);
}

/* ---- on a GPU (MT_TEST_GPU=1; the GPU bundle's engine group) ---- */

/* Four steps of the small GPT; the losses and the weights come back, and
 * the peaks per class, on the device and on the host, equal the estimate. */
static void gpu_train(mt_context *ctx, mt_optimizer_kind opt, mt_precision prec, int fused,
                      mt_place place, float *loss, float *w)
{
    CHECK_OKC(ctx, mt_context_reset_peaks(ctx)); /* the peaks of this run alone */
    mt_model *m = check_small_gpt(ctx, V, T, 64, 11);
    mt_trainer_config tc;
    config(&tc, opt, prec, fused, place);
    mt_estimate_report est;
    mt_trainer *t = trained(ctx, m, &tc, &est, 4, loss);
    mt_memory_stats host, dev;
    CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_HOST, &host));
    CHECK_OK(mt_context_memory_stats(ctx, &dev));
    for (int k = 0; k < MT_MEM_COUNT; k++) {
        CHECK_EQ(host.per_class[k].peak_live_bytes, est.place_class_peak[MT_PLACE_HOST][k]);
        CHECK_MSG(dev.per_class[k].peak_live_bytes == est.class_peak[k],
                  "%s, %s: device %s peak %llu, estimate %llu", mt_optimizer_name(opt),
                  place == MT_PLACE_HOST ? "host offload" : "resident", mt_mem_class_name(k),
                  (unsigned long long)dev.per_class[k].peak_live_bytes,
                  (unsigned long long)est.class_peak[k]);
    }
    CHECK_OKC(ctx, mt_model_get_params(m, w, mt_model_num_params(m)));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
}

/* Host offload (the CPU op table's update) against the resident run (the
 * CUDA table's): the same losses and weights but for the two tables'
 * rounding, for each optimizer it takes, fp32 and mixed, fused or not. */
TEST(gpu_engine_host_offload_matches_resident)
{
    mt_context *ctx = check_gpu_context();
    if (!ctx) return;
    static const struct {
        mt_optimizer_kind opt;
        mt_precision prec;
        int fused;
    } cases[] = {{MT_OPT_ADAMW, MT_PREC_FP32, 0},    {MT_OPT_ADAMW, MT_PREC_BF16, 1},
                 {MT_OPT_ADAMW8, MT_PREC_FP16, 0},   {MT_OPT_SGD, MT_PREC_FP32, 1},
                 {MT_OPT_ADAFACTOR, MT_PREC_BF16, 0}};
    mt_model *m = check_small_gpt(ctx, V, T, 64, 11);
    const size_t P = mt_model_num_params(m);
    mt_model_destroy(m);
    float *w0 = check_alloc(P * 4), *w1 = check_alloc(P * 4), l0[4], l1[4];
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        gpu_train(ctx, cases[c].opt, cases[c].prec, cases[c].fused, MT_PLACE_DEVICE, l0, w0);
        gpu_train(ctx, cases[c].opt, cases[c].prec, cases[c].fused, MT_PLACE_HOST, l1, w1);
        if (!check_gpu_values()) continue; /* the stand-ins compute nothing */
        const double tol = cases[c].prec == MT_PREC_FP32 ? 1e-4 : 2e-2;
        for (int s = 0; s < 4; s++)
            CHECK_MSG(fabs(l0[s] - l1[s]) <= tol * fabs(l0[s]), "%s: step %d loss %g resident, %g host",
                      mt_optimizer_name(cases[c].opt), s, l0[s], l1[s]);
        double worst = 0;
        for (size_t e = 0; e < P; e++) {
            const double d = fabs(w0[e] - w1[e]) / (fabs(w0[e]) + 1e-2);
            if (d > worst) worst = d;
        }
        CHECK_MSG(worst <= tol, "%s prec %d: weights differ by %g (relative)",
                  mt_optimizer_name(cases[c].opt), (int)cases[c].prec, worst);
    }
    mt_context_destroy(ctx);
}

/* A training-state file moves between host offload and the resident run
 * on a real GPU: saved by a host-offloaded run that asked for ZeRO stage
 * 3 (on one rank stage 3 shards nothing: the run is stage 0's; several
 * ranks at stage 3 are offload_host_ranks_nccl's, over the stand-in NCCL,
 * and need a GPU per rank on real hardware), loaded by a resident trainer
 * and saved again it is the same file, and loaded back by a host-offloaded
 * one too; the next step from it gives the same loss and weights on the
 * device's update as on the CPU's, but for the two tables' rounding. */
static mt_trainer *moved_trainer(mt_context *ctx, mt_model **m, mt_place place, const char *load,
                                 const char *save, float *loss, float *w)
{
    *m = check_small_gpt(ctx, V, T, 64, 11);
    mt_trainer_config tc;
    config(&tc, MT_OPT_ADAMW, MT_PREC_BF16, 0, place);
    tc.zero_stage = 3;
    mt_estimate_report est;
    mt_trainer *t = trained(ctx, *m, &tc, &est, load ? 0 : 2, NULL);
    if (load) CHECK_OKC(ctx, mt_trainer_load(t, load, NULL, 0, NULL));
    CHECK_OKC(ctx, mt_trainer_save(t, save, NULL, 0));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    check_token_batch(&b, tok, tg, B, T, V, 2);
    CHECK_OKC(ctx, mt_trainer_step(t, &b, loss));
    CHECK_OKC(ctx, mt_model_get_params(*m, w, mt_model_num_params(*m)));
    return t;
}

TEST(gpu_engine_host_offload_checkpoint_moves)
{
    mt_context *ctx = check_gpu_context();
    if (!ctx) return;
    char dir[] = "/tmp/mt_hostoff_gpu_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char a[64], b[64], c[64];
    snprintf(a, sizeof a, "%s/host.mtt", dir);
    snprintf(b, sizeof b, "%s/resident.mtt", dir);
    snprintf(c, sizeof c, "%s/back.mtt", dir);
    mt_model *m = check_small_gpt(ctx, V, T, 64, 11);
    const size_t P = mt_model_num_params(m);
    mt_model_destroy(m);
    float *wh = check_alloc(P * 4), *wr = check_alloc(P * 4), *wb = check_alloc(P * 4), lh, lr, lb;
    mt_trainer *t = moved_trainer(ctx, &m, MT_PLACE_HOST, NULL, a, &lh, wh);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    /* the host run's state, resumed on the device, and back on the host */
    t = moved_trainer(ctx, &m, MT_PLACE_DEVICE, a, b, &lr, wr);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    t = moved_trainer(ctx, &m, MT_PLACE_HOST, b, c, &lb, wb);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    CHECK_MSG(check_same_file(a, b), "the host run's file, loaded resident and saved, differs");
    CHECK_MSG(check_same_file(a, c), "the resident run's file, loaded with host offload and saved, differs");
    /* the step from the same file on the host */
    t = moved_trainer(ctx, &m, MT_PLACE_HOST, a, c, &lh, wh);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    if (check_gpu_values()) {
        CHECK_MSG(fabsf(lh - lr) <= 2e-2f * fabsf(lr) && lb == lh, "loss %g host, %g resident, %g back", lh,
                  lr, lb);
        double worst = 0;
        for (size_t e = 0; e < P; e++) {
            const double d = fabs(wh[e] - wr[e]) / (fabs(wr[e]) + 1e-2);
            if (d > worst) worst = d;
        }
        CHECK_MSG(worst <= 2e-2, "the step from the file: weights differ by %g (relative)", worst);
        CHECK(memcmp(wh, wb, P * 4) == 0);
    }
    remove(a), remove(b), remove(c);
    CHECK(rmdir(dir) == 0);
    mt_context_destroy(ctx);
}
