/*
 * test_train.c - the first training slice: the MLP's loss and gradients
 * against an independent double-precision reference and finite
 * differences, SGD semantics, the loss falling, determinism, bad input that
 * changes nothing, out-of-memory in the middle of a step, and the exact
 * per-class memory of a step.
 */
#include <math.h>
#include <string.h>

#include "check.h"

static mt_context *cpu_context(void)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 2;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    return ctx;
}

static uint64_t next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void random_batch(uint64_t *s, float *x, int32_t *y, int n, int in, int classes)
{
    for (int i = 0; i < n * in; i++) x[i] = (float)(next(s) % 2001) / 1000.0f - 1.0f;
    for (int i = 0; i < n; i++) y[i] = (int32_t)(next(s) % (uint64_t)classes);
}

/* ---- the reference: the same network in double precision, plain loops ---- */

#define RMAX 4096

static double act_f(double v, mt_activation a)
{
    if (a == MT_ACT_RELU) return v > 0 ? v : 0;
    double u = sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v);
    return 0.5 * v * (1.0 + tanh(u));
}

static double act_d(double v, mt_activation a)
{
    if (a == MT_ACT_RELU) return v > 0 ? 1 : 0;
    double k = sqrt(2.0 / M_PI), u = k * (v + 0.044715 * v * v * v), t = tanh(u);
    return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * 0.044715 * v * v);
}

/* Mean loss; grads (same layout as the parameters) if not NULL. */
static double ref_loss(const mt_mlp_spec *sp, const float *params, const float *x,
                       const int32_t *y, int n, double *grads)
{
    static double h[MT_MLP_MAX_LAYERS + 1][RMAX], pre[MT_MLP_MAX_LAYERS + 1][RMAX], d[RMAX], dn[RMAX];
    const int L = sp->n_layers;
    double loss = 0;
    size_t np = 0;
    for (int l = 0; l < L; l++) np += (size_t)sp->dims[l + 1] * (sp->dims[l] + 1);
    if (grads) memset(grads, 0, np * sizeof *grads);
    for (int r = 0; r < n; r++) {
        for (int k = 0; k < sp->dims[0]; k++) h[0][k] = x[r * sp->dims[0] + k];
        const float *p = params;
        for (int l = 0; l < L; l++) {
            int in = sp->dims[l], out = sp->dims[l + 1];
            const float *w = p, *b = p + (size_t)out * in;
            for (int o = 0; o < out; o++) {
                double s = b[o];
                for (int k = 0; k < in; k++) s += (double)w[o * in + k] * h[l][k];
                pre[l + 1][o] = s;
                h[l + 1][o] = l == L - 1 ? s : act_f(s, sp->activation);
            }
            p += (size_t)out * (in + 1);
        }
        int C = sp->dims[L];
        double mx = h[L][0], z = 0;
        for (int c = 1; c < C; c++) mx = h[L][c] > mx ? h[L][c] : mx;
        for (int c = 0; c < C; c++) z += exp(h[L][c] - mx);
        loss += log(z) - (h[L][y[r]] - mx);
        if (!grads) continue;
        for (int c = 0; c < C; c++) d[c] = (exp(h[L][c] - mx) / z - (c == y[r])) / n;
        size_t off = np;
        for (int l = L - 1; l >= 0; l--) {
            int in = sp->dims[l], out = sp->dims[l + 1];
            off -= (size_t)out * (in + 1);
            const float *w = params + off;
            double *gw = grads + off, *gb = gw + (size_t)out * in;
            for (int o = 0; o < out; o++) {
                gb[o] += d[o];
                for (int k = 0; k < in; k++) gw[o * in + k] += d[o] * h[l][k];
            }
            if (l == 0) break;
            for (int k = 0; k < in; k++) {
                double s = 0;
                for (int o = 0; o < out; o++) s += d[o] * w[o * in + k];
                dn[k] = s * act_d(pre[l][k], sp->activation);
            }
            memcpy(d, dn, sizeof(double) * (size_t)in);
        }
    }
    return loss / n;
}

/* The library's gradient, read off one plain SGD step with lr 1: g = p - p'. */
static void library_grads(mt_model *m, mt_trainer *t, const mt_batch *b, float *p0, float *g,
                          size_t np, float *loss)
{
    CHECK_OK(mt_model_get_params(m, p0, np));
    CHECK_OK(mt_trainer_step(t, b, loss));
    CHECK_OK(mt_model_get_params(m, g, np));
    for (size_t i = 0; i < np; i++) g[i] = p0[i] - g[i];
    CHECK_OK(mt_model_set_params(m, p0, np));
}

static void gradient_check(mt_activation act)
{
    mt_context *ctx = cpu_context();
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 3;
    sp.dims[0] = 5, sp.dims[1] = 16, sp.dims[2] = 12, sp.dims[3] = 4;
    sp.activation = act;
    sp.seed = 42;
    mt_model *m;
    CHECK_OK(mt_model_mlp_create(ctx, &sp, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 8;
    tc.lr = 1.0f;
    mt_trainer *t;
    CHECK_OK(mt_trainer_create(m, &tc, &t));
    size_t np = mt_model_num_params(m);
    CHECK_EQ(np, 16 * 6 + 12 * 17 + 4 * 13);
    static float p0[1024], g[1024], x[8 * 5];
    static double rg[1024];
    int32_t y[8];
    uint64_t s = 7;
    random_batch(&s, x, y, 8, 5, 4);
    mt_batch b = {.n = 8, .inputs = x, .targets = y};
    float loss;
    library_grads(m, t, &b, p0, g, np, &loss);
    double rloss = ref_loss(&sp, p0, x, y, 8, rg);
    CHECK_MSG(fabs(loss - rloss) < 1e-5 * fabs(rloss) + 1e-6, "loss %.8f vs reference %.8f", loss,
              rloss);
    for (size_t i = 0; i < np; i++)
        CHECK_MSG(fabs(g[i] - rg[i]) < 2e-4 * fabs(rg[i]) + 2e-6, "grad %zu: %.8g vs reference %.8g",
                  i, g[i], rg[i]);
    /* the reference itself against central differences (in double) */
    static float pp[1024];
    for (size_t i = 0; i < np; i += 7) {
        memcpy(pp, p0, np * sizeof *pp);
        const double e = 1e-3;
        pp[i] = (float)(p0[i] + e);
        double lp = ref_loss(&sp, pp, x, y, 8, NULL);
        pp[i] = (float)(p0[i] - e);
        double lm = ref_loss(&sp, pp, x, y, 8, NULL);
        double fd = (lp - lm) / ((double)(float)(p0[i] + e) - (double)(float)(p0[i] - e));
        CHECK_MSG(fabs(fd - rg[i]) < 1e-3 * fabs(rg[i]) + 1e-6 || (act == MT_ACT_RELU && fabs(fd - rg[i]) < 1e-2),
                  "param %zu: finite difference %.8g vs analytic %.8g", i, fd, rg[i]);
    }
    /* and the library's own loss (mt_trainer_eval) against central differences */
    int checked = 0;
    for (size_t i = 0; i < np; i += 11) {
        memcpy(pp, p0, np * sizeof *pp);
        float lp, lm;
        const float e = 1e-2f;
        pp[i] = p0[i] + e;
        CHECK_OK(mt_model_set_params(m, pp, np));
        CHECK_OK(mt_trainer_eval(t, &b, &lp, NULL));
        pp[i] = p0[i] - e;
        CHECK_OK(mt_model_set_params(m, pp, np));
        CHECK_OK(mt_trainer_eval(t, &b, &lm, NULL));
        double fd = ((double)lp - lm) / (2.0 * e);
        CHECK_MSG(fabs(fd - g[i]) < 3e-2 * fabs(g[i]) + 2e-4, "param %zu: library fd %.6g vs %.6g", i,
                  fd, g[i]);
        checked++;
    }
    CHECK(checked > 20);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(mlp_gradients_gelu) { gradient_check(MT_ACT_GELU); }
TEST(mlp_gradients_relu) { gradient_check(MT_ACT_RELU); }

/* Momentum and weight decay as torch.optim.SGD, over three steps. */
TEST(sgd_momentum_weight_decay)
{
    mt_context *ctx = cpu_context();
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 2;
    sp.dims[0] = 3, sp.dims[1] = 6, sp.dims[2] = 3;
    sp.activation = MT_ACT_GELU;
    mt_model *m;
    CHECK_OK(mt_model_mlp_create(ctx, &sp, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 4;
    tc.lr = 0.05f;
    tc.momentum = 0.9f;
    tc.weight_decay = 0.01f;
    mt_trainer *t;
    CHECK_OK(mt_trainer_create(m, &tc, &t));
    size_t np = mt_model_num_params(m);
    float p[64], got[64], x[12];
    double buf[64] = {0}, g[64];
    int32_t y[4];
    uint64_t s = 3;
    CHECK_OK(mt_model_get_params(m, p, np));
    for (int step = 0; step < 3; step++) {
        random_batch(&s, x, y, 4, 3, 3);
        mt_batch b = {.n = 4, .inputs = x, .targets = y};
        ref_loss(&sp, p, x, y, 4, g);
        for (size_t i = 0; i < np; i++) {
            double d = g[i] + 0.01 * p[i];
            buf[i] = 0.9 * buf[i] + d;
            p[i] = (float)(p[i] - 0.05 * buf[i]);
        }
        CHECK_OK(mt_trainer_step(t, &b, NULL));
    }
    CHECK_OK(mt_model_get_params(m, got, np));
    for (size_t i = 0; i < np; i++)
        CHECK_MSG(fabs(got[i] - p[i]) < 1e-5, "param %zu: %.7f vs reference %.7f", i, got[i], p[i]);
    CHECK_EQ(mt_trainer_steps(t), 3);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* Three-class spirals: the loss must fall clearly, the same way every run. */
static void spirals(uint64_t *s, float *x, int32_t *y, int n)
{
    for (int i = 0; i < n; i++) {
        int k = (int)(next(s) % 3);
        float r = (float)(next(s) % 10000) / 10000.0f;
        float a = (float)k * 2.0943951f + 4.0f * r + ((float)(next(s) % 1000) / 1000.0f - 0.5f) * 0.3f;
        x[2 * i] = r * cosf(a);
        x[2 * i + 1] = r * sinf(a);
        y[i] = k;
    }
}

static void train_spirals(mt_allocator_vtable const *vt, float *first, float *last, float *losses,
                          int steps)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 2;
    for (int c = 0; c < MT_MEM_COUNT; c++) cfg.allocators[c].vtable = vt;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 3;
    sp.dims[0] = 2, sp.dims[1] = 64, sp.dims[2] = 64, sp.dims[3] = 3;
    sp.seed = 1;
    mt_model *m;
    CHECK_OK(mt_model_mlp_create(ctx, &sp, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 64;
    tc.momentum = 0.9f;
    mt_trainer *t;
    CHECK_OK(mt_trainer_create(m, &tc, &t));
    float x[128];
    int32_t y[64];
    uint64_t s = 11;
    double head = 0, tail = 0;
    for (int i = 0; i < steps; i++) {
        spirals(&s, x, y, 64);
        mt_batch b = {.n = 64, .inputs = x, .targets = y};
        float l;
        CHECK_OKC(ctx, mt_trainer_step(t, &b, &l));
        if (losses) losses[i] = l;
        if (i < 20) head += l;
        if (i >= steps - 20) tail += l;
    }
    *first = (float)(head / 20);
    *last = (float)(tail / 20);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(mlp_loss_falls_and_is_deterministic)
{
    static float a[400], b[400];
    float f1, l1, f2, l2;
    train_spirals(NULL, &f1, &l1, a, 400);
    CHECK_MSG(f1 > 0.9f && l1 < 0.5f * f1, "loss %.3f -> %.3f", f1, l1);
    train_spirals(mt_allocator_arena(), &f2, &l2, b, 400);
    /* bit-identical, whatever allocator holds the memory */
    CHECK(memcmp(a, b, sizeof a) == 0);
    static const char *const others[] = {"pool", "checkpoint"};
    for (int i = 0; i < 2; i++) {
        train_spirals(mt_allocator_by_name(others[i]), &f2, &l2, b, 400);
        CHECK_MSG(memcmp(a, b, sizeof a) == 0, "%s: losses differ", others[i]);
    }
}

TEST(trainer_bad_input_changes_nothing)
{
    mt_context *ctx = cpu_context();
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 2;
    sp.dims[0] = 4, sp.dims[1] = 8, sp.dims[2] = 3;
    mt_model *m;
    /* bad specs */
    mt_mlp_spec bad = sp;
    bad.n_layers = 0;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_mlp_create(ctx, &bad, &m));
    CHECK(strstr(mt_last_error(ctx), "n_layers"));
    bad = sp;
    bad.dims[1] = 0;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_mlp_create(ctx, &bad, &m));
    CHECK(strstr(mt_last_error(ctx), "dims[1]"));
    bad = sp;
    bad.activation = (mt_activation)9;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_mlp_create(ctx, &bad, &m));
    bad = sp;
    bad.struct_size = 1;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_mlp_create(ctx, &bad, &m));
    CHECK_OK(mt_model_mlp_create(ctx, &sp, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 4;
    mt_trainer *t;
    mt_trainer_config badc = tc;
    badc.lr = NAN;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &badc, &t));
    CHECK(strstr(mt_last_error(ctx), "lr"));
    badc = tc;
    badc.momentum = 1.0f;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &badc, &t));
    badc = tc;
    badc.max_batch = 0;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &badc, &t));
    badc = tc;
    badc.optimizer = (mt_optimizer_kind)7;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &badc, &t));
    CHECK_OK(mt_trainer_create(m, &tc, &t));

    size_t np = mt_model_num_params(m);
    float before[128], after[128], x[16] = {0};
    int32_t y[4] = {0, 1, 2, 1};
    CHECK_OK(mt_model_get_params(m, before, np));
    mt_batch b = {.n = 5, .inputs = x, .targets = y};
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_step(t, &b, NULL));
    CHECK(strstr(mt_last_error(ctx), "batch->n 5"));
    b.n = 0;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_step(t, &b, NULL));
    b.n = 4;
    b.inputs = NULL;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_step(t, &b, NULL));
    b.inputs = x;
    y[2] = 3;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_step(t, &b, NULL));
    CHECK(strstr(mt_last_error(ctx), "targets[2] = 3"));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_eval(t, &b, NULL, NULL));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_step(t, NULL, NULL));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_get_params(m, after, np - 1));
    memcpy(after, before, np * sizeof *after);
    after[3] = INFINITY;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_set_params(m, after, np));
    CHECK_OK(mt_model_get_params(m, after, np));
    CHECK(memcmp(before, after, np * sizeof *after) == 0);
    CHECK_EQ(mt_trainer_steps(t), 0);
    y[2] = 2;
    CHECK_OK(mt_trainer_step(t, &b, NULL));
    CHECK_EQ(mt_trainer_steps(t), 1);
    mt_memory_stats ms;
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    for (int c = 0; c < MT_MEM_COUNT; c++)
        if (c != MT_MEM_PARAM) /* IO: the trainer's two device flags */
            CHECK_EQ(ms.per_class[c].live_bytes, c == MT_MEM_IO ? 8 : 0);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* Activations get an instance of their own with a limit: a big batch runs
 * out of memory part-way through, changes nothing, and a smaller one goes on. */
TEST(trainer_oom_mid_step)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.allocators[MT_MEM_ACT].vtable = mt_allocator_arena();
    cfg.allocators[MT_MEM_ACT].limit_bytes = 160u << 10;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 3;
    sp.dims[0] = 8, sp.dims[1] = 256, sp.dims[2] = 256, sp.dims[3] = 4;
    mt_model *m;
    CHECK_OK(mt_model_mlp_create(ctx, &sp, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 128;
    tc.momentum = 0.5f;
    mt_trainer *t;
    CHECK_OK(mt_trainer_create(m, &tc, &t));
    size_t np = mt_model_num_params(m);
    static float before[100000], after[100000], x[128 * 8];
    int32_t y[128];
    uint64_t s = 5;
    random_batch(&s, x, y, 128, 8, 4);
    mt_batch b = {.n = 8, .inputs = x, .targets = y};
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL)); /* momentum buffers now hold something */
    CHECK_OK(mt_model_get_params(m, before, np));
    b.n = 128; /* 2 x 128 x 256 x 4 bytes of activations: over the limit */
    CHECK_ST(MT_ERR_OOM, mt_trainer_step(t, &b, NULL));
    CHECK(strstr(mt_last_error(ctx), "ACT") && strstr(mt_last_error(ctx), "unchanged"));
    CHECK_OK(mt_model_get_params(m, after, np));
    CHECK(memcmp(before, after, np * sizeof *after) == 0);
    mt_memory_stats ms;
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    CHECK(ms.per_class[MT_MEM_ACT].n_oom_failures == 1);
    for (int c = 0; c < MT_MEM_COUNT; c++)
        if (c != MT_MEM_PARAM && c != MT_MEM_OPTIM)
            CHECK_EQ(ms.per_class[c].live_bytes, c == MT_MEM_IO ? 8 : 0);
    b.n = 32;
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    CHECK_EQ(mt_trainer_steps(t), 2);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* What one step holds, class by class, is known exactly from the shapes. */
static void step_memory(mt_activation act)
{
    mt_context *ctx = cpu_context();
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 3;
    sp.dims[0] = 2, sp.dims[1] = 64, sp.dims[2] = 48, sp.dims[3] = 3;
    sp.activation = act;
    mt_model *m;
    CHECK_OK(mt_model_mlp_create(ctx, &sp, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 32;
    tc.momentum = 0.9f;
    mt_trainer *t;
    CHECK_OK(mt_trainer_create(m, &tc, &t));
    float x[64];
    int32_t y[32];
    uint64_t s = 9;
    random_batch(&s, x, y, 32, 2, 3);
    mt_batch b = {.n = 32, .inputs = x, .targets = y};
    CHECK_OK(mt_trainer_step(t, &b, NULL));
    mt_memory_stats ms;
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    const uint64_t N = 32, F = 4, P = mt_model_num_params(m) * F;
    const uint64_t acts = N * (64 + 48) * F * (act == MT_ACT_GELU ? 2 : 1);
    CHECK_EQ(ms.per_class[MT_MEM_PARAM].live_bytes, P);
    CHECK_EQ(ms.per_class[MT_MEM_OPTIM].live_bytes, P);
    CHECK_EQ(ms.per_class[MT_MEM_GRAD].peak_live_bytes, P);
    CHECK_EQ(ms.per_class[MT_MEM_ACT].peak_live_bytes, acts);
    /* backward of layer 1 holds the gradient at its output (N,48) and its input (N,64),
       plus what oneDNN asks as scratchpad for its GEMMs (its choice per shape and CPU:
       a few KiB per thread here, 2 threads) */
    const uint64_t work = ms.per_class[MT_MEM_WORK].peak_live_bytes, grads = N * (48 + 64) * F;
    CHECK_MSG(work >= grads && work <= grads + 2 * 65536, "WORK peak %llu, gradients %llu",
              (unsigned long long)work, (unsigned long long)grads);
    /* x, targets, logits, losses, and the trainer's two device flags (8 bytes) */
    CHECK_EQ(ms.per_class[MT_MEM_IO].peak_live_bytes, N * (2 + 1 + 3 + 1) * F + 8);
    for (int c = MT_MEM_GRAD; c < MT_MEM_COUNT; c++)
        if (c != MT_MEM_OPTIM) CHECK_EQ(ms.per_class[c].live_bytes, c == MT_MEM_IO ? 8 : 0);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(step_memory_relu) { step_memory(MT_ACT_RELU); }
TEST(step_memory_gelu) { step_memory(MT_ACT_GELU); }

/* ---- mixed precision ---- */

static mt_trainer *mixed_trainer(mt_context *ctx, mt_model **m, mt_precision p, int interval,
                                 float init_scale, int dims_in)
{
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 3;
    sp.dims[0] = dims_in, sp.dims[1] = 64, sp.dims[2] = 64, sp.dims[3] = 3;
    sp.seed = 1;
    CHECK_OK(mt_model_mlp_create(ctx, &sp, m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 64;
    tc.momentum = 0.9f;
    tc.precision = p;
    tc.loss_scale.growth_interval = interval;
    tc.loss_scale.init_scale = init_scale;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(*m, &tc, &t));
    return t;
}

/* fp16 and bf16 learn the spirals like fp32 does; memory classes as promised */
TEST(mixed_precision_trains)
{
    float last[3];
    for (int p = 0; p < 3; p++) {
        mt_context *ctx = cpu_context();
        mt_model *m;
        mt_trainer *t = mixed_trainer(ctx, &m, (mt_precision)p, 2000, 65536.0f, 2);
        float x[128];
        int32_t y[64];
        uint64_t s = 11;
        double head = 0, tail = 0;
        for (int i = 0; i < 300; i++) {
            spirals(&s, x, y, 64);
            mt_batch b = {.n = 64, .inputs = x, .targets = y};
            float l;
            CHECK_OKC(ctx, mt_trainer_step(t, &b, &l));
            if (i < 20) head += l;
            if (i >= 280) tail += l;
        }
        last[p] = (float)(tail / 20);
        CHECK_MSG(tail < 0.5 * head, "precision %d: loss %.3f -> %.3f", p, head / 20, tail / 20);
        mt_memory_stats ms;
        CHECK_OK(mt_context_memory_stats(ctx, &ms));
        uint64_t np = mt_model_num_params(m);
        CHECK_EQ(ms.per_class[MT_MEM_PARAM].live_bytes, np * (p == MT_PREC_FP32 ? 4 : 2));
        CHECK_EQ(ms.per_class[MT_MEM_MASTER].live_bytes, p == MT_PREC_FP32 ? 0 : np * 4);
        CHECK_EQ(ms.per_class[MT_MEM_GRAD].peak_live_bytes, np * 4);
        mt_loss_scale_state ls;
        CHECK_OK(mt_trainer_get_loss_scale(t, &ls));
        CHECK(p == MT_PREC_FP16 ? ls.scale == 65536.0f : ls.scale == 1.0f);
        mt_trainer_destroy(t);
        /* without the trainer the model is fp32 again, its masters' values */
        CHECK_OK(mt_context_memory_stats(ctx, &ms));
        CHECK_EQ(ms.per_class[MT_MEM_PARAM].live_bytes, np * 4);
        CHECK_EQ(ms.per_class[MT_MEM_MASTER].live_bytes, 0);
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
    /* the same run in lower precision ends near where fp32 does */
    CHECK_MSG(fabsf(last[1] - last[0]) < 0.1f && fabsf(last[2] - last[0]) < 0.1f,
              "final losses fp32 %.4f fp16 %.4f bf16 %.4f", last[0], last[1], last[2]);
}

/* An fp16 overflow: the step is skipped, the scale backs off, the weights
 * and the optimizer's state do not move; clean steps grow the scale back. */
TEST(fp16_overflow_skips_the_step)
{
    mt_context *ctx = cpu_context();
    mt_model *m;
    mt_trainer *t = mixed_trainer(ctx, &m, MT_PREC_FP16, 3, 65536.0f, 4);
    size_t np = mt_model_num_params(m);
    float *before = malloc(np * 4), *after = malloc(np * 4);
    float x[64 * 4];
    int32_t y[64];
    for (int i = 0; i < 64 * 4; i++) x[i] = (float)(i % 9) / 9.0f - 0.5f;
    for (int i = 0; i < 64; i++) y[i] = i % 3;
    mt_batch b = {.n = 64, .inputs = x, .targets = y};
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL)); /* a clean step first: momentum holds something */
    mt_loss_scale_state ls;
    CHECK_OK(mt_trainer_get_loss_scale(t, &ls));
    CHECK(ls.scale == 65536.0f && ls.growth_tracker == 1 && !ls.last_step_skipped);
    CHECK_OK(mt_model_get_params(m, before, np));
    /* inputs far past fp16's range: inf activations, non-finite gradients */
    float big[64 * 4];
    for (int i = 0; i < 64 * 4; i++) big[i] = x[i] * 1e6f;
    mt_batch bb = {.n = 64, .inputs = big, .targets = y};
    CHECK_OKC(ctx, mt_trainer_step(t, &bb, NULL));
    CHECK_OK(mt_trainer_get_loss_scale(t, &ls));
    CHECK(ls.scale == 32768.0f && ls.growth_tracker == 0 && ls.last_step_skipped && ls.steps_skipped == 1);
    CHECK_OK(mt_model_get_params(m, after, np));
    CHECK(memcmp(before, after, np * 4) == 0);
    CHECK_EQ(mt_trainer_steps(t), 2);
    /* three clean steps in a row double the scale (growth_interval 3) */
    for (int i = 0; i < 3; i++) CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    CHECK_OK(mt_trainer_get_loss_scale(t, &ls));
    CHECK(ls.scale == 65536.0f && ls.growth_tracker == 0 && !ls.last_step_skipped);
    CHECK_OK(mt_model_get_params(m, after, np));
    CHECK(memcmp(before, after, np * 4) != 0);
    /* the state can be saved and restored, and is checked */
    mt_loss_scale_state bad = ls;
    bad.scale = INFINITY;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_set_loss_scale(t, &bad));
    bad = ls;
    bad.growth_tracker = 3;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_set_loss_scale(t, &bad));
    ls.scale = 1024.0f;
    ls.growth_tracker = 2;
    CHECK_OK(mt_trainer_set_loss_scale(t, &ls));
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    CHECK_OK(mt_trainer_get_loss_scale(t, &ls));
    CHECK(ls.scale == 2048.0f && ls.growth_tracker == 0);
    free(before), free(after);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* A model that is very sure and right: the softmax's gradient 1 - p is
 * about 1.5e-8, times 1/N, far below fp16's smallest subnormal (6e-8).
 * Unscaled, the fp16 gradient of the logits is 0 and nothing learns; with
 * the loss scale it survives, and the update follows the fp32 one. */
TEST(fp16_underflow_needs_the_scale)
{
    float upd[3];
    const float scales[3] = {1.0f, 65536.0f, 1.0f}; /* run 0 is fp32 */
    for (int r = 0; r < 3; r++) {
        mt_context *ctx = cpu_context();
        mt_mlp_spec sp;
        mt_mlp_spec_init(&sp);
        sp.n_layers = 1, sp.dims[0] = 8, sp.dims[1] = 2;
        sp.seed = 3;
        mt_model *m;
        CHECK_OK(mt_model_mlp_create(ctx, &sp, &m));
        float p0[18], p1[18];
        CHECK_OK(mt_model_get_params(m, p0, 18));
        /* x along W0 - W1, scaled so that logit 0 leads logit 1 by 18 */
        double w2 = 0;
        for (int i = 0; i < 8; i++) w2 += pow(p0[i] - p0[8 + i], 2);
        double c = (18.0 - (p0[16] - p0[17])) / w2;
        float x[32];
        int32_t y[4] = {0, 0, 0, 0};
        for (int i = 0; i < 32; i++) x[i] = (float)(c * (p0[i % 8] - p0[8 + i % 8]));
        mt_trainer_config tc;
        mt_trainer_config_init(&tc);
        tc.max_batch = 4;
        tc.lr = 1000.0f;
        tc.precision = r ? MT_PREC_FP16 : MT_PREC_FP32;
        tc.loss_scale.init_scale = scales[r];
        tc.loss_scale.dynamic = 0;
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        CHECK_OK(mt_model_get_params(m, p0, 18)); /* as the masters hold them */
        mt_batch b = {.n = 4, .inputs = x, .targets = y};
        CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
        CHECK_OK(mt_model_get_params(m, p1, 18));
        upd[r] = 0;
        for (int i = 0; i < 18; i++) upd[r] += fabsf(p1[i] - p0[i]);
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
    CHECK_MSG(upd[0] > 0 && fabsf(upd[1] - upd[0]) < 0.05f * upd[0],
              "scaled fp16 moved the weights by %g, fp32 by %g", upd[1], upd[0]);
    CHECK_MSG(upd[2] == 0.0f, "unscaled fp16 moved the weights by %g (fp32: %g)", upd[2], upd[0]);
}
