/*
 * test_zero3_cuda.c - ZeRO stage 3 on CUDA contexts (the stand-in driver and
 * cuBLASLt, MT_FAKE_CUDA and MT_FAKE_CUBLASLT) over the stand-in NCCL
 * (MT_FAKE_NCCL), 2 and 3 ranks as threads of the test. The stand-in's
 * kernels compute nothing (the update leaves the weights as they were), so
 * what is checked is what the collectives and the host do: each time a
 * layer holds its weights in (forward, backward, recompute), every one of
 * them is the model's whole tensor bit for bit; the whole gradients
 * mt_trainer_gradients gives (a collective at stage 3) are the ranks'
 * gradients summed (the test fills them in: tcomm_fill_grads); after the
 * trainer the weights put back from the slices are the model's; each
 * rank's per-class peaks equal its estimate, to the byte. With a host
 * communicator, stage 3 on a CUDA context is refused.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "engine/engine.h"
#include "internal.h"
#include "test_comm.h"
#include "train/dp.h"
#include "tnccl.h"
#include "train/trainer.h"
#include "device/cuda_device.h"

enum { Z3C_MAXN = 3, Z3C_T = 8, Z3C_ROWS = 2, Z3C_STEPS = 2 };

typedef struct z3c_run {
    tcomm_world *w;
    int n;
    mt_trainer_config tc;
    int layers;
    int sgd;                       /* the stand-in's SGD runs (MT_FAKE_CUDA_SGD): the weights move */
    mt_status st[Z3C_MAXN];
    char msg[Z3C_MAXN][400];
    unsigned long side[Z3C_MAXN];  /* collectives on another stream than the device's */
    float *w1[Z3C_MAXN];           /* with sgd: the weights put back */
    size_t nw;                     /* (their count) */
} z3c_run;

/* The engine's params hook, watched: after ZeRO-3's hook brings a layer's
 * weights in, each one in is compared with the model's weights from
 * before the trainer (w0, fp32). */
typedef struct z3c_watch {
    mt_trainer *t;
    const float *w0;
    long checked;
    char *msg;
    size_t cap;
} z3c_watch;

static mt_status watched(void *user, int layer, int bwd, int in)
{
    z3c_watch *wt = user;
    mt_trainer *t = wt->t;
    mt_status s = mti_zero3_layer(t, layer, bwd, in);
    if (s || !in || layer < 0 || *wt->msg) return s;
    const mt_model *m = t->model;
    const mti_layer *ly = &m->layers[layer];
    for (int j = -1; j < ly->np && !*wt->msg; j++) {
        const int i = j < 0 ? ly->tied : ly->p0 + j;
        if (i < 0) continue;
        const mti_param *p = &m->params[i];
        if (!p->w.blk.ptr || p->frozen) continue; /* (not needed by this pass) */
        float *h = malloc(p->numel * sizeof *h);
        if (!h) return MT_ERR_OOM;
        s = t->ctx->dev->copy_d2h(t->ctx->dev, h, p->w.blk.ptr, p->numel * sizeof *h);
        if (!s) s = t->ctx->dev->sync(t->ctx->dev);
        if (!s && memcmp(h, wt->w0 + p->offset, p->numel * sizeof *h))
            snprintf(wt->msg, wt->cap, "layer %d (%s): %s gathered differs from the model's", layer,
                     bwd ? "backward" : "forward", p->name);
        wt->checked++;
        free(h);
    }
    return s;
}

/* The model deferred (mt_gpt_spec.deferred): its slices made straight from
 * the seed on the device, its setup estimated before the trainer. */
static int z3c_deferred;

static void z3c_rank(int rank, void *arg)
{
    z3c_run *a = arg;
    char *msg = a->msg[rank];
    const size_t cap = sizeof a->msg[rank];
    mt_comm *c = tcomm_nccl(a->w, rank, a->n);
    mt_context *ctx = c ? tcomm_cuda_context(c) : NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_status s = ctx ? MT_OK : MT_ERR_NO_DEVICE;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = Z3C_T, g.layers = a->layers, g.heads = 2;
    g.channels = 16, g.seed = 7, g.deferred = z3c_deferred;
    if (!s) s = mt_model_gpt_create(ctx, &g, &m);
    mt_estimate_report pre;
    if (!s && z3c_deferred) s = mt_estimate_model(m, &a->tc, &pre);
    const size_t P = m ? mt_model_num_params(m) : 0;
    float *w0 = malloc(P * sizeof *w0 + 1), *w1 = malloc(P * sizeof *w1 + 1);
    float *gr = malloc(P * sizeof *gr + 1);
    if (!s && (!w0 || !w1 || !gr)) s = MT_ERR_OOM;
    if (!s) s = mt_model_get_params(m, w0, P);
    if (!s) s = mt_trainer_create(m, &a->tc, &t);
    z3c_watch wt = {.t = t, .w0 = w0, .msg = msg, .cap = cap};
    if (!s && !a->sgd) { /* (the weights stay the model's: the stand-in updates nothing) */
        t->E.params_hook = watched;
        t->E.params_user = &wt;
    }
    int32_t tok[Z3C_ROWS * Z3C_T], tg[Z3C_ROWS * Z3C_T];
    mt_batch b;
    void *main_stream = ctx ? mti_cuda_stream(ctx->dev) : NULL;
    const unsigned long side0 = tnccl_calls(main_stream, 1);
    for (int k = 0; k < Z3C_STEPS && !s; k++) {
        check_token_batch(&b, tok, tg, Z3C_ROWS, Z3C_T, 50, k + rank);
        s = mt_trainer_step(t, &b, NULL);
    }
    a->side[rank] = tnccl_calls(main_stream, 1) - side0;
    if (!s) { /* this rank's estimate of its steps, class by class */
        mt_estimate_report e;
        mt_memory_stats ms;
        if (z3c_deferred) e = pre;
        else s = mt_estimate_model(m, &a->tc, &e);
        mt_context_memory_stats(ctx, &ms);
        for (int k = 0; !s && k < MT_MEM_COUNT && !*msg; k++)
            if (ms.per_class[k].peak_live_bytes != e.class_peak[k])
                snprintf(msg, cap, "%s peak %llu, estimate %llu", mt_mem_class_name(k),
                         (unsigned long long)ms.per_class[k].peak_live_bytes,
                         (unsigned long long)e.class_peak[k]);
        if (!s && !ms.per_class[MT_MEM_COMM].peak_live_bytes)
            snprintf(msg, cap, "nothing gathered in COMM");
    }
    /* the whole gradients: the ranks' summed, exactly */
    if (!s) s = mt_trainer_gradients(t, &b, NULL, gr, P);
    for (int i = 0; !s && !*msg && i < m->n_param; i++) {
        const mti_param *p = &m->params[i];
        for (size_t e = 0; e < p->numel && !*msg; e++) {
            float want = 0.0f;
            for (int r = 0; r < a->n; r++) want += tcomm_grad_of(r, i, e);
            if (gr[p->offset + e] != want)
                snprintf(msg, cap, "the gradient of %s[%zu] is %g, the ranks' sum %g", p->name, e,
                         (double)gr[p->offset + e], (double)want);
        }
    }
    if (!s && !*msg && !wt.checked && !a->sgd) snprintf(msg, cap, "no layer held weights in");
    if (s && !*msg) snprintf(msg, cap, "%s", ctx ? mt_last_error(ctx) : "no context");
    mt_trainer_destroy(t); /* (a collective at stage 3: the weights put back) */
    if (!s && !*msg && mt_model_get_params(m, w1, P)) snprintf(msg, cap, "no weights put back");
    if (!s && !*msg && !a->sgd && memcmp(w0, w1, P * sizeof *w0))
        snprintf(msg, cap, "the weights put back differ from the model's");
    if (!s && !*msg && a->sgd && !memcmp(w0, w1, P * sizeof *w0))
        snprintf(msg, cap, "the weights did not move");
    a->st[rank] = s;
    if (a->sgd) a->w1[rank] = w1, w1 = NULL, a->nw = P;
    free(w0), free(w1), free(gr);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

/* With a host communicator (MPI's kind) a CUDA context's stage 3 is
 * refused at create, on every rank, naming what it needs. */
static void z3c_host_rank(int rank, void *arg)
{
    z3c_run *a = arg;
    mt_comm *c = tcomm_make(a->w, rank, a->n, 0);
    mt_context *ctx = c ? tcomm_cuda_context(c) : NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.max_seq = Z3C_T, g.layers = 1, g.heads = 2, g.channels = 16;
    mt_status s = ctx ? mt_model_gpt_create(ctx, &g, &m) : MT_ERR_NO_DEVICE;
    if (!s) s = mt_trainer_create(m, &a->tc, &t);
    a->st[rank] = s;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", ctx ? mt_last_error(ctx) : "no context");
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

/* One case on n ranks, with NCCL's communication stream (mode 0) and
 * without it (1, MT_NCCL_OVERLAP=0); sgd: the stand-in's SGD runs. */
static void z3c_go(z3c_run *a, int n, mt_optimizer_kind opt, int fused, int prefetch, int keep,
                   mt_recompute_policy rc, int mode, int sgd)
{
    memset(a, 0, sizeof *a);
    a->w = tcomm_world_new(n, 30.0);
    a->n = n;
    a->layers = 2;
    a->sgd = sgd;
    mt_trainer_config_init(&a->tc);
    a->tc.max_batch = Z3C_ROWS;
    a->tc.optimizer = opt;
    a->tc.lr = 0.01f;
    a->tc.zero_stage = 3;
    a->tc.fused_step = fused;
    a->tc.zero3_prefetch = prefetch;
    a->tc.zero3_keep = keep;
    a->tc.recompute = rc;
    if (mode) setenv("MT_NCCL_OVERLAP", "0", 1);
    if (sgd) setenv("MT_FAKE_CUDA_SGD", "1", 1);
    tcomm_run(n, z3c_rank, a);
    unsetenv("MT_NCCL_OVERLAP");
    unsetenv("MT_FAKE_CUDA_SGD");
    tcomm_world_free(a->w);
    for (int r = 0; r < n; r++) {
        CHECK_MSG(a->st[r] == MT_OK && !a->msg[r][0], "%s, %d ranks, prefetch %d, keep %d, %s%s: rank %d: %s",
                  mt_optimizer_name(opt), n, prefetch, keep, mode ? "blocking" : "stream",
                  sgd ? ", SGD run" : "", r, a->msg[r]);
        /* with prefetch the gathers and reduce-scatters went on the stream */
        if (mode || !prefetch) CHECK_EQ(a->side[r], 0);
        else CHECK_MSG(a->side[r] > 0, "rank %d: nothing on the communication stream", r);
    }
}

static void z3c_case(int n, mt_optimizer_kind opt, int fused, int prefetch, int keep,
                     mt_recompute_policy rc)
{
    z3c_run a[2];
    for (int mode = 0; mode < 2; mode++) z3c_go(&a[mode], n, opt, fused, prefetch, keep, rc, mode, 0);
    if (opt != MT_OPT_SGD) return;
    /* the stand-in's SGD moves the weights by the reduce-scattered sums:
       the same weights with the stream and without, bit for bit */
    for (int mode = 0; mode < 2; mode++) z3c_go(&a[mode], n, opt, fused, prefetch, keep, rc, mode, 1);
    for (int r = 0; r < n; r++) {
        CHECK_MSG(a[0].w1[r] && a[1].w1[r], "rank %d: no weights", r);
        if (a[0].w1[r] && a[1].w1[r] && a[0].nw == a[1].nw)
            CHECK_MSG(!memcmp(a[0].w1[r], a[1].w1[r], a[0].nw * sizeof(float)), "%d ranks, prefetch %d, rank %d: "
                      "the weights differ with the stream", n, prefetch, r);
        free(a[0].w1[r]), free(a[1].w1[r]);
    }
}

TEST(zero3_cuda_nccl_stand_in)
{
    if (!check_fake_cuda() || !getenv("MT_FAKE_CUBLASLT") || !getenv("MT_FAKE_NCCL")) {
        fprintf(stderr, "    (skipped: MT_FAKE_CUDA, MT_FAKE_CUBLASLT or MT_FAKE_NCCL is not set)\n");
        return;
    }
    mti_engine_grad_fill = tcomm_fill_grads;
    z3c_case(2, MT_OPT_ADAMW, 0, 1, 0, MT_RECOMPUTE_NONE);
    z3c_case(2, MT_OPT_SGD, 1, 2, 1, MT_RECOMPUTE_SQRT);
    z3c_case(2, MT_OPT_ADAFACTOR, 0, 0, -1, MT_RECOMPUTE_NONE);
    z3c_case(3, MT_OPT_ADAMW8, 0, 1, 1, MT_RECOMPUTE_NONE);
    z3c_case(3, MT_OPT_ADAMW, 1, 0, 0, MT_RECOMPUTE_SQRT);
    z3c_case(3, MT_OPT_SGD, 0, 2, 1, MT_RECOMPUTE_SQRT);
    z3c_case(3, MT_OPT_SGD, 1, 1, 0, MT_RECOMPUTE_NONE);
    z3c_deferred = 1; /* slices made straight from the seed: the same weights gathered */
    z3c_case(2, MT_OPT_ADAMW, 0, 1, 0, MT_RECOMPUTE_NONE);
    z3c_case(3, MT_OPT_ADAMW, 1, 0, 0, MT_RECOMPUTE_SQRT);
    z3c_deferred = 0;
    mti_engine_grad_fill = NULL;
    z3c_run h = {.w = tcomm_world_new(2, 30.0), .n = 2};
    mt_trainer_config_init(&h.tc);
    h.tc.zero_stage = 3;
    tcomm_run(2, z3c_host_rank, &h);
    tcomm_world_free(h.w);
    for (int r = 0; r < 2; r++)
        CHECK_MSG(h.st[r] == MT_ERR_UNSUPPORTED && strstr(h.msg[r], "device communicator"),
                  "rank %d: %s", r, h.msg[r]);
}
