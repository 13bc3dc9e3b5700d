/*
 * test_nonfinite.c - a step whose loss or gradients are not finite is
 * skipped, in every precision, with and without clipping, fused or not,
 * with accumulation: the weights and the optimizer state stay as they were
 * and the loss scaler's state counts the step as skipped. And the one case
 * that cannot skip (the fused step without clipping or fp16 finding a
 * non-finite gradient after a finite loss, with tensors already updated)
 * stops there with an error, every weight still finite.
 */
#include <math.h>
#include <string.h>

#include "check.h"

enum { FEAT = 4, HID = 8, CLS = 3, ROWS = 4 };

static mt_model *mlp(mt_context *ctx, int f, int h, int c)
{
    mt_mlp_spec s;
    mt_mlp_spec_init(&s);
    s.n_layers = 2;
    s.dims[0] = f, s.dims[1] = h, s.dims[2] = c;
    s.seed = 3;
    mt_model *m = NULL;
    CHECK_OKC(ctx, mt_model_mlp_create(ctx, &s, &m));
    return m;
}

static mt_trainer *trainer(mt_model *m, mt_precision prec, float clip, int fused, int micro)
{
    mt_trainer_config c;
    mt_trainer_config_init(&c);
    c.max_batch = ROWS;
    c.micro_batch = micro;
    c.optimizer = MT_OPT_ADAMW;
    c.lr = 1e-2f;
    c.weight_decay = 0.1f;
    c.precision = prec;
    c.grad_clip = clip;
    c.fused_step = fused;
    mt_trainer *t = NULL;
    CHECK_OK(mt_trainer_create(m, &c, &t));
    return t;
}

static void batch_of(float *x, int32_t *y, uint32_t seed)
{
    for (int i = 0; i < ROWS * FEAT; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)(seed >> 8) / (float)(1u << 24) - 0.5f;
    }
    for (int i = 0; i < ROWS; i++) y[i] = i % CLS;
}

static float *params(const mt_model *m)
{
    size_t n = mt_model_num_params(m);
    float *p = check_alloc(n * sizeof *p);
    CHECK_OK(mt_model_get_params(m, p, n));
    return p;
}

TEST(nonfinite_batch_skips_the_step)
{
    const mt_precision precs[] = {MT_PREC_FP32, MT_PREC_BF16, MT_PREC_FP16};
    const float bad[] = {NAN, INFINITY, -INFINITY};
    for (int pi = 0; pi < 3; pi++)
        for (int clip = 0; clip < 2; clip++)
            for (int mode = 0; mode < 3; mode++) { /* unfused, fused, accumulating */
                mt_context *ctx = check_cpu_context(1);
                mt_model *ma = mlp(ctx, FEAT, HID, CLS), *mb = mlp(ctx, FEAT, HID, CLS);
                const int fused = mode == 1, micro = mode == 2 ? 1 : 0;
                mt_trainer *ta = trainer(ma, precs[pi], clip ? 1.0f : 0.0f, fused, micro);
                mt_trainer *tb = trainer(mb, precs[pi], clip ? 1.0f : 0.0f, fused, micro);
                float x[ROWS * FEAT], xbad[ROWS * FEAT];
                int32_t y[ROWS];
                mt_batch b = {.n = ROWS, .inputs = x, .targets = y};
                mt_batch bb = {.n = ROWS, .inputs = xbad, .targets = y};
                float loss = 0;
                batch_of(x, y, 1);
                CHECK_OK(mt_trainer_step(ta, &b, &loss));
                CHECK_OK(mt_trainer_step(tb, &b, &loss));
                const size_t n = mt_model_num_params(ma);
                float *before = params(ma);
                memcpy(xbad, x, sizeof x);
                xbad[5] = bad[(pi + clip + mode) % 3];
                mt_loss_scale_state ls0, ls;
                CHECK_OK(mt_trainer_get_loss_scale(ta, &ls0));
                CHECK_MSG(mt_trainer_step(ta, &bb, &loss) == MT_OK, "prec %d clip %d mode %d: %s",
                          (int)precs[pi], clip, mode, mt_last_error(ctx));
                CHECK(!isfinite(loss));
                CHECK_OK(mt_trainer_get_loss_scale(ta, &ls));
                CHECK_MSG(ls.last_step_skipped == 1 && ls.steps_skipped == ls0.steps_skipped + 1,
                          "prec %d clip %d mode %d: skipped %d, count %llu", (int)precs[pi], clip,
                          mode, ls.last_step_skipped, (unsigned long long)ls.steps_skipped);
                float *after = params(ma);
                CHECK_MSG(!memcmp(before, after, n * sizeof *after),
                          "prec %d clip %d mode %d: the weights moved", (int)precs[pi], clip, mode);
                CHECK_EQ(mt_trainer_steps(ta), 2);
                /* the optimizer state did not move either: the next clean step
                   gives what it gives without the bad batch in between (fp16's
                   scaler backs off after a skip, which changes the rounding) */
                batch_of(x, y, 2);
                CHECK_OK(mt_trainer_step(ta, &b, &loss));
                CHECK(isfinite(loss));
                CHECK_OK(mt_trainer_get_loss_scale(ta, &ls));
                CHECK_EQ(ls.last_step_skipped, 0);
                CHECK_OK(mt_trainer_step(tb, &b, &loss));
                float *pa = params(ma), *pb = params(mb);
                for (size_t i = 0; i < n; i++) CHECK(isfinite(pa[i]));
                if (precs[pi] != MT_PREC_FP16)
                    CHECK_MSG(!memcmp(pa, pb, n * sizeof *pa),
                              "prec %d clip %d mode %d: the skipped step changed the state",
                              (int)precs[pi], clip, mode);
                mt_trainer_destroy(ta);
                mt_trainer_destroy(tb);
                mt_model_destroy(ma);
                mt_model_destroy(mb);
                mt_context_destroy(ctx);
            }
}

/* A model whose loss is finite but one gradient is not: h = relu(w1 x)
 * with w1 = 1e-30 and x = 1e20 is 1e-10, the logits h (+-1e30) are
 * finite, and dw1 = dh x with dh ~ 1e30 overflows. */
static void overflow_weights(mt_model *m)
{
    size_t n = mt_model_num_params(m);
    float *p = check_alloc(n * sizeof *p);
    int k = 0;
    for (int i = 0; i < mt_model_num_tensors(m); i++) {
        mt_param_info pi;
        CHECK_OK(mt_model_param_info(m, i, &pi));
        for (size_t j = 0; j < pi.numel; j++)
            p[pi.offset + j] = pi.ndim == 1 ? 0.0f : k == 0 ? 1e-30f : (j % 2 ? -1e30f : 1e30f);
        if (pi.ndim == 2) k++;
    }
    CHECK_OK(mt_model_set_params(m, p, n));
}

/* An overflow inside backward after a finite loss: the unfused step (on
 * one rank its checks run in backward, each gradient as it becomes final)
 * skips it, without clipping, with clipping (the norm is not finite) and
 * with the overflow in the first of two micro-batches (the sum is what is
 * checked); the fused step without clipping stops with an error. */
TEST(nonfinite_gradient_after_finite_loss)
{
    for (int mode = 0; mode < 4; mode++) {
        const int fused = mode == 3, micro = mode == 2, rows = micro ? 2 : 1;
        mt_context *ctx = check_cpu_context(1);
        mt_model *m = mlp(ctx, 1, 1, 2);
        overflow_weights(m);
        mt_trainer_config c;
        mt_trainer_config_init(&c);
        c.max_batch = rows;
        c.micro_batch = micro;
        c.optimizer = MT_OPT_ADAMW;
        c.lr = 1e-3f;
        c.fused_step = fused;
        c.grad_clip = mode == 1 ? 1.0f : 0.0f;
        mt_trainer *t = NULL;
        CHECK_OK(mt_trainer_create(m, &c, &t));
        const size_t n = mt_model_num_params(m);
        float x[2] = {1e20f, 1.0f}, loss = 0;
        int32_t y[2] = {1, 1};
        mt_batch b = {.n = rows, .inputs = x, .targets = y};
        float *g = check_alloc(n * sizeof *g);
        CHECK_OK(mt_trainer_gradients(t, &b, &loss, g, n));
        CHECK(isfinite(loss));
        int nonfinite = 0;
        for (size_t i = 0; i < n; i++) nonfinite += !isfinite(g[i]);
        CHECK(nonfinite > 0); /* the case is what it should be */
        if (micro) { /* and the second micro-batch's own gradients are finite */
            mt_batch b1 = {.n = 1, .inputs = x + 1, .targets = y + 1};
            CHECK_OK(mt_trainer_gradients(t, &b1, &loss, g, n));
            for (size_t i = 0; i < n; i++) CHECK(isfinite(g[i]));
        }
        float *before = params(m);
        mt_status s = mt_trainer_step(t, &b, &loss);
        float *after = params(m);
        for (size_t i = 0; i < n; i++) CHECK(isfinite(after[i]));
        mt_loss_scale_state ls;
        CHECK_OK(mt_trainer_get_loss_scale(t, &ls));
        if (!fused) { /* every gradient is checked before the first update: skipped */
            CHECK_OKC(ctx, s);
            CHECK_MSG(ls.last_step_skipped == 1, "mode %d", mode);
            CHECK(!memcmp(before, after, n * sizeof *after));
            /* and a finite step after it updates (without clipping: these
               weights' gradients are near 1e30, whose squares overflow) */
            mt_batch b1 = {.n = 1, .inputs = x + 1, .targets = y + 1};
            CHECK_OKC(ctx, mt_trainer_step(t, &b1, &loss));
            CHECK_OK(mt_trainer_get_loss_scale(t, &ls));
            CHECK_MSG(ls.last_step_skipped == (mode == 1), "mode %d", mode);
            after = params(m);
            CHECK((memcmp(before, after, n * sizeof *after) != 0) == (mode != 1));
        } else { /* the head was updated before the first layer's gradient overflowed */
            CHECK_ST(MT_ERR_INVALID_ARG, s);
            CHECK(strstr(mt_last_error(ctx), "not finite") && strstr(mt_last_error(ctx), "updated"));
            CHECK(memcmp(before, after, n * sizeof *after) != 0);
        }
        mt_trainer_destroy(t);
        mt_model_destroy(m);
        mt_context_destroy(ctx);
    }
}

TEST(nonfinite_skips_restore)
{
    /* a skipped step's count survives mt_trainer_set_loss_scale in any precision */
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = mlp(ctx, FEAT, HID, CLS);
    mt_trainer *t = trainer(m, MT_PREC_FP32, 0.0f, 0, 0);
    mt_loss_scale_state ls = {.scale = 1.0f, .steps_skipped = 3, .last_step_skipped = 1};
    CHECK_OKC(ctx, mt_trainer_set_loss_scale(t, &ls));
    mt_loss_scale_state got;
    CHECK_OK(mt_trainer_get_loss_scale(t, &got));
    CHECK(got.steps_skipped == 3 && got.last_step_skipped == 1 && got.scale == 1.0f);
    ls.scale = 2.0f;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_set_loss_scale(t, &ls));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}
