/*
 * test_optimizers.c - the optimizer table (lib/optim/optim.h): every kind has a
 * complete entry and a name that maps back to it, and an update of a
 * parameter cut into slices at the table's alignment gives the bits of one
 * update of the whole, state included, for every optimizer that allows
 * slices (what sharding the state across ranks relies on).
 */
#include <math.h>
#include <string.h>

#include "check.h"
#include "internal.h"
#include "optim/optim.h"

TEST(optimizers_table_complete)
{
    int n = 0;
    for (int k = -1; k < 64; k++) {
        const mti_optim *o = mti_optim_of((mt_optimizer_kind)k);
        if (!o) {
            CHECK(mt_optimizer_name((mt_optimizer_kind)k) == NULL);
            continue;
        }
        n++;
        CHECK_EQ((int)o->kind, k);
        CHECK(o->name && o->title && o->traffic && o->has_ops && o->layout &&
              o->update);
        CHECK(!strcmp(mt_optimizer_name(o->kind), o->name));
        mt_optimizer_kind back = 0;
        CHECK_OK(mt_optimizer_by_name(o->name, &back));
        CHECK_EQ((int)back, k);
        CHECK(o->has_ops(mti_cpu_ops())); /* the CPU table has every optimizer */
    }
    CHECK_EQ(n, 5);
    CHECK(mti_optim_of(MT_OPT_SGD) && mti_optim_of(MT_OPT_ADAMW) && mti_optim_of(MT_OPT_ADAMW8) &&
          mti_optim_of(MT_OPT_ADAFACTOR) && mti_optim_of(MT_OPT_ADAMW4));
    mt_optimizer_kind k = MT_OPT_SGD;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_optimizer_by_name("adam", &k));
    CHECK(strstr(mt_last_error(NULL), "adamw8") && strstr(mt_last_error(NULL), "adafactor") &&
          strstr(mt_last_error(NULL), "adamw4"));
    CHECK_EQ((int)k, MT_OPT_SGD);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_optimizer_by_name(NULL, &k));
}

static float urand(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
}

/* Two steps of optimizer `kind` on a (rows, cols) parameter, whole or cut
 * into slices of `slice` elements; p and every state tensor out. */
static void run_steps(mt_context *ctx, mt_optimizer_kind kind, int64_t rows, int64_t cols,
                      size_t slice, float *p, void *st[MTI_OPT_SLOTS], mti_opt_layout *lay)
{
    const mti_optim *o = mti_optim_of(kind);
    mt_trainer_config c;
    mt_trainer_config_init(&c);
    c.optimizer = kind;
    c.momentum = 0.9f;
    c.min_8bit_size = 0;
    c.adafactor.beta1 = 0.9f;
    mti_param prm = {.ndim = 2, .shape = {rows, cols}, .numel = (size_t)(rows * cols)};
    o->layout(&c, &prm, NULL, lay);
    const size_t n = prm.numel;
    for (int j = 0; j < MTI_OPT_SLOTS; j++) {
        size_t bytes = (size_t)lay->s[j].numel * mti_dtype_size(lay->s[j].dtype);
        st[j] = bytes ? check_alloc(bytes) : NULL;
        if (bytes) memset(st[j], lay->s[j].fill, bytes);
    }
    float *g = check_alloc(n * sizeof *g);
    uint32_t seed = 7;
    for (size_t i = 0; i < n; i++) p[i] = urand(&seed);
    const mti_kctx k = {ctx, NULL};
    for (int64_t step = 1; step <= 2; step++) {
        for (size_t i = 0; i < n; i++) g[i] = 0.1f * urand(&seed);
        mti_opt_step a = {.k = &k, .ops = mti_cpu_ops(), .cfg = &c, .p = &prm, .layout = lay,
                          .lr = 1e-2f, .weight_decay = 0.1f, .step = step, .grad_scale = 1.0f,
                          .pc_dt = MTI_F32};
        for (size_t at = 0; at < n; at += slice) {
            size_t len = n - at < slice ? n - at : slice;
            void *sv[MTI_OPT_SLOTS] = {0};
            for (int j = 0; j < MTI_OPT_SLOTS; j++)
                if (st[j])
                    sv[j] = (char *)st[j] + (lay->s[j].per > 0 ? at / (size_t)lay->s[j].per : 0) *
                                                mti_dtype_size(lay->s[j].dtype);
            CHECK_OKC(ctx, o->update(&a, sv, p + at, NULL, g + at, at, len));
        }
    }
}

TEST(optimizers_slices_equal_whole)
{
    mt_context *ctx = check_cpu_context(2);
    const int64_t rows = 13, cols = 97; /* 1261 elements: 4 blocks of 256 and a part */
    const size_t n = (size_t)(rows * cols);
    for (int kind = MT_OPT_SGD; kind <= MT_OPT_ADAMW4; kind++) {
        const mti_optim *o = mti_optim_of((mt_optimizer_kind)kind);
        float *pw = check_alloc(n * 4), *ps = check_alloc(n * 4);
        void *sw[MTI_OPT_SLOTS], *ss[MTI_OPT_SLOTS];
        mti_opt_layout lw, ls;
        run_steps(ctx, (mt_optimizer_kind)kind, rows, cols, n, pw, sw, &lw);
        if (!o->sliceable) continue;
        size_t align = mti_optim_slice_align(&lw);
        CHECK(align == (kind == MT_OPT_ADAMW8 ? (size_t)MTI_Q8_BLOCK : 1u));
        run_steps(ctx, (mt_optimizer_kind)kind, rows, cols, align == 1 ? 100 : 2 * align, ps, ss,
                  &ls);
        CHECK_MSG(!memcmp(pw, ps, n * 4), "%s: sliced update differs", o->name);
        for (int j = 0; j < MTI_OPT_SLOTS; j++) {
            CHECK(lw.s[j].numel == ls.s[j].numel);
            CHECK_EQ(mti_optim_state_numel(&lw.s[j], 0, n), lw.s[j].numel);
            if (lw.s[j].numel)
                CHECK_MSG(!memcmp(sw[j], ss[j],
                                  (size_t)lw.s[j].numel * mti_dtype_size(lw.s[j].dtype)),
                          "%s: state %d of a sliced update differs", o->name, j);
        }
        for (size_t i = 0; i < n; i++) CHECK(isfinite(pw[i]));
    }
    mt_context_destroy(ctx);
}

/* 8-bit AdamW keeps 32-bit state for tensors under min_8bit_size and
 * updates them as bitsandbytes' 32-bit kernel (kOptimizer32bit2State):
 * the step, then the weight decay p *= 1 - lr wd. The reference is that
 * kernel's arithmetic in double; decaying before the step (torch's order)
 * is off by about lr wd times the step, far outside the tolerance. */
TEST(optimizers_adamw8_small_tensors_decay_after)
{
    mt_context *ctx = check_cpu_context(1);
    const mti_optim *o = mti_optim_of(MT_OPT_ADAMW8);
    mt_trainer_config c;
    mt_trainer_config_init(&c);
    c.optimizer = MT_OPT_ADAMW8;
    enum { N = 300 };
    mti_param prm = {.ndim = 1, .shape = {N}, .numel = N};
    mti_opt_layout lay;
    o->layout(&c, &prm, NULL, &lay);
    CHECK_EQ(lay.bits, 32); /* under min_8bit_size (4096) */
    float p[N], g[N], m[N] = {0}, v[N] = {0};
    uint16_t pc[N];
    double rp[N], rm[N] = {0}, rv[N] = {0};
    uint32_t seed = 11;
    for (int i = 0; i < N; i++) p[i] = urand(&seed), rp[i] = p[i];
    int scratch = 0;
    const mti_kctx k = {ctx, NULL};
    const float lr = 0.05f, wd = 0.5f;
    for (int64_t t = 1; t <= 3; t++) {
        for (int i = 0; i < N; i++) g[i] = 0.3f * urand(&seed);
        mti_opt_step a = {.k = &k, .ops = mti_cpu_ops(), .cfg = &c, .p = &prm, .layout = &lay,
                          .lr = lr, .weight_decay = wd, .step = t, .grad_scale = 1.0f,
                          .pc_dt = MTI_BF16, .scratch = &scratch};
        void *st[MTI_OPT_SLOTS] = {m, v};
        CHECK_OKC(ctx, o->update(&a, st, p, pc, g, 0, N));
        const double b1 = c.beta1, b2 = c.beta2, eps = c.eps;
        const double c1 = 1 - pow(b1, (double)t), c2 = sqrt(1 - pow(b2, (double)t));
        for (int i = 0; i < N; i++) {
            rm[i] = b1 * rm[i] + (1 - b1) * g[i];
            rv[i] = b2 * rv[i] + (1 - b2) * (double)g[i] * g[i];
            rp[i] = (rp[i] - lr * c2 / c1 * rm[i] / (sqrt(rv[i]) + eps * c2)) * (1 - (double)lr * wd);
        }
        for (int i = 0; i < N; i++) {
            CHECK_MSG(fabs(p[i] - rp[i]) <= 4e-7 * (fabs(rp[i]) + lr), /* ulps of p and the step */
                      "step %d, element %d: %.9g, bitsandbytes' 32-bit kernel %.9g", (int)t, i,
                      (double)p[i], rp[i]);
            CHECK_EQ(pc[i], mti_f32_to_bf16(p[i])); /* the compute copy after the decay */
        }
    }
    CHECK_EQ(scratch, 0);
    mt_context_destroy(ctx);
}
