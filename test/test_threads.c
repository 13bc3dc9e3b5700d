/*
 * test_threads.c - the CPU thread count belongs to the context: contexts
 * with different counts, and estimates, used from several threads at once.
 * Results must be those of a run alone (the CPU kernels give the same bits
 * for any thread count), and an estimate must size the workspace by its own
 * thread count whatever the other threads do.
 */
#include <pthread.h>
#include <string.h>

#include "check.h"
#include "memtrain.h"

enum { B = 2, T = 16, V = 256, STEPS = 3, ROUNDS = 3, EST_ROUNDS = 200 };

static int32_t data[STEPS * B * T + 1];

static void make_data(void)
{
    uint64_t r = 0x2545F4914F6CDD1Dull;
    for (size_t i = 0; i < sizeof data / sizeof *data; i++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        data[i] = (int32_t)(r % V);
    }
}

static void spec(mt_gpt_spec *g)
{
    mt_gpt_spec_init(g);
    g->vocab = V, g->max_seq = T, g->layers = 2, g->heads = 4, g->channels = 64, g->seed = 7;
}

static void tconfig(mt_trainer_config *tc)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B;
    tc->lr = 1e-3f;
    tc->precision = MT_PREC_BF16; /* the GEMMs take per-thread workspace */
}

/* STEPS steps of a fresh model in a fresh context of `threads` threads;
 * losses into loss. Returns the first failing status. */
static mt_status train(int threads, float *loss)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = threads;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_gpt_spec g;
    mt_trainer_config tc;
    spec(&g);
    tconfig(&tc);
    mt_status s = mt_context_create(&cfg, &ctx);
    if (!s) s = mt_model_gpt_create(ctx, &g, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    for (int i = 0; !s && i < STEPS; i++) {
        mt_batch b = {.n = B, .tokens = data + (size_t)i * B * T,
                      .targets = data + (size_t)i * B * T + 1, .seq_len = T};
        s = mt_trainer_step(t, &b, &loss[i]);
    }
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return s;
}

static mt_status estimate(int threads, mt_estimate_report *r)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = threads;
    mt_gpt_spec g;
    mt_trainer_config tc;
    spec(&g);
    tconfig(&tc);
    return mt_estimate_gpt(&cfg, &g, &tc, r);
}

typedef struct worker {
    pthread_t th;
    int threads, est; /* est: runs estimates instead of training */
    const float *ref_loss;
    const mt_estimate_report *ref_est;
    int failures;
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    for (int r = 0; r < (w->est ? EST_ROUNDS : ROUNDS); r++) {
        if (w->est) {
            mt_estimate_report e;
            if (estimate(w->threads, &e) ||
                e.class_peak[MT_MEM_WORK] != w->ref_est->class_peak[MT_MEM_WORK] ||
                e.peak != w->ref_est->peak)
                w->failures++;
        } else {
            float loss[STEPS];
            if (train(w->threads, loss) || memcmp(loss, w->ref_loss, sizeof loss)) w->failures++;
        }
    }
    return NULL;
}

TEST(threads_per_context)
{
    make_data();
    float ref[STEPS];
    mt_estimate_report e1, e2;
    CHECK_OK(train(1, ref));
    for (int i = 0; i < STEPS; i++) CHECK(ref[i] > 0.0f && ref[i] < 10.0f);
    CHECK_OK(estimate(1, &e1));
    CHECK_OK(estimate(2, &e2));
    /* the workspace is per thread: two threads take more than one */
    CHECK(e2.class_peak[MT_MEM_WORK] > e1.class_peak[MT_MEM_WORK]);

    worker w[4] = {{.threads = 1, .ref_loss = ref},
                   {.threads = 2, .ref_loss = ref},
                   {.threads = 2, .est = 1, .ref_est = &e2},
                   {.threads = 1, .est = 1, .ref_est = &e1}};
    for (int i = 0; i < 4; i++) CHECK(pthread_create(&w[i].th, NULL, work, &w[i]) == 0);
    for (int i = 0; i < 4; i++) pthread_join(w[i].th, NULL);
    for (int i = 0; i < 4; i++)
        CHECK_MSG(w[i].failures == 0, "%s with %d threads: %d of %d rounds differ from alone",
                  w[i].est ? "estimate" : "training", w[i].threads, w[i].failures,
                  w[i].est ? EST_ROUNDS : ROUNDS);
}
