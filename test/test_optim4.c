/*
 * test_optim4.c - the 4-bit AdamW op (lib/ops/kernels.h, adamw4) and its
 * optimizer entry (lib/optim/optim_adamw4.c).
 *
 *   - golden: test/golden/adamw4.gv (gen_adamw4.py, a numpy model of the
 *     algorithm of Li, Chen, Zhu 2023 as lpmm runs it): the maps, and after
 *     each of 4 steps the parameters, codes and scales of a matrix (rank-1
 *     second moment, zero rows and columns, an infinite gradient) and of a
 *     vector, bit for bit, with 1 and 2 threads;
 *   - the zero-point case of the issue: a block of 256 gradients spread
 *     over four decades; with 8-bit state (bitsandbytes' algorithm) the
 *     second moment of the small ones rounds to 0 while the first moment
 *     does not, and a weight moves far in one step; with 4-bit state every
 *     step stays within a few lr;
 *   - the entry: 32-bit state under min_8bit_size, slices refused, the
 *     layout's sizes; the op's refusals.
 */
#include <math.h>
#include <string.h>

#include "check.h"
#include "golden.h"
#include "ops/kernels.h"
#include "optim/optim.h"

static gv_file gf;

static const gv_array *arr4(const char *name, gv_dtype dt, size_t numel)
{
    const gv_array *a = gv_find(&gf, name);
    CHECK_MSG(a != NULL, "golden array '%s' missing", name);
    CHECK_MSG(a->dtype == dt && a->numel == numel, "golden array '%s': %s of %zu", name,
              gv_dtype_name(a->dtype), a->numel);
    return a;
}

static long diff_at(const void *a, const void *b, size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp((const char *)a + i * size, (const char *)b + i * size, size)) return (long)i;
    return -1;
}

/* Runs case `c` of adamw4.gv with `threads` threads, checking every step. */
static void golden_case(const char *c, int threads)
{
    char key[96];
    snprintf(key, sizeof key, "%s.shape", c);
    const int32_t *shape = arr4(key, GV_I32, 3)->data;
    const int64_t rows = shape[0], cols = shape[1];
    const int rank1 = shape[2];
    const size_t n = (size_t)(rows * cols), nq = (n + 1) / 2, nb = (n + 127) / 128;
    const size_t ns = rank1 ? (size_t)(rows + cols) : nb;
    const float *hp = arr4("hp", GV_F32, 5)->data;
    snprintf(key, sizeof key, "%s.p0", c);
    float *p = check_copy(arr4(key, GV_F32, n)->data, n * 4);
    snprintf(key, sizeof key, "%s.grads", c);
    const gv_array *ga = gv_find(&gf, key);
    CHECK(ga && ga->dtype == GV_F32 && ga->numel % n == 0);
    const int steps = (int)(ga->numel / n);
    uint8_t *qm = check_alloc(nq), *qv = check_alloc(nq);
    float *am = check_alloc(nb * 4), *sv = check_alloc(ns * 4);
    memset(qm, 0x77, nq);
    mti_adamw4_state st = {.qm = qm, .qv = qv, .absmax_m = am, .scale_v = sv};
    mt_context *ctx = check_cpu_context(threads);
    const mti_kctx k = {ctx, ctx->dev};
    for (int t = 1; t <= steps; t++) {
        mti_adamw_args a = {.lr = hp[0], .beta1 = hp[1], .beta2 = hp[2], .eps = hp[3],
                            .weight_decay = hp[4], .step = t, .grad_scale = 1.0f};
        const float *g = (const float *)ga->data + (size_t)(t - 1) * n;
        CHECK_OKC(ctx, mti_cpu_ops()->adamw4(&k, p, g, &st, NULL, MTI_F32, rows, cols, rank1, &a));
        struct { const char *what; const void *got; size_t n, size; gv_dtype dt; } parts[] = {
            {"p", p, n, 4, GV_F32}, {"qm", qm, nq, 1, GV_U8}, {"am", am, nb, 4, GV_F32},
            {"qv", qv, nq, 1, GV_U8}, {"sv", sv, ns, 4, GV_F32}};
        for (int j = 0; j < 5; j++) {
            snprintf(key, sizeof key, "%s.t%d.%s", c, t, parts[j].what);
            const gv_array *want = arr4(key, parts[j].dt, parts[j].n);
            long d = diff_at(parts[j].got, want->data, parts[j].n, parts[j].size);
            CHECK_MSG(d < 0, "adamw4 %s, %d thread(s), step %d: %s differs first at %ld", c,
                      threads, t, parts[j].what, d);
        }
    }
    mt_context_destroy(ctx);
}

TEST(optim4_golden)
{
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/adamw4.gv", gv_dir());
    CHECK_MSG(gv_load(path, &gf, err, sizeof err), "%s", err);
    const float *mm = arr4("map_m", GV_F32, 16)->data, *mv = arr4("map_v", GV_F32, 16)->data;
    CHECK_MSG(!memcmp(mm, mti_q4_map(1), 64), "the first moment's map differs from lpmm's");
    CHECK_MSG(!memcmp(mv, mti_q4_map(0), 64), "the second moment's map differs from lpmm's");
    CHECK(mti_q4_map(1)[MTI_Q4_ZERO] == 0.0f && mti_q4_map(0)[0] > 0.0f);
    for (int threads = 1; threads <= 2; threads++) {
        golden_case("mat", threads);
        golden_case("vec", threads);
    }
    gv_free(&gf);
}

/* The zero-point case: 256 gradients spread over four decades (1 down to
 * 1e-4), the same two steps for both optimizers; the largest move of a
 * weight in the second step. */
static float zero_point_move(int bits, int64_t rows, int64_t cols)
{
    const size_t n = (size_t)(rows * cols);
    float *p = check_alloc(n * 4), *g = check_alloc(n * 4), *p1 = check_alloc(n * 4);
    for (size_t i = 0; i < n; i++) g[i] = powf(10.0f, -4.0f * (float)i / (float)(n - 1)) * (i & 1 ? -1.0f : 1.0f);
    mt_context *ctx = check_cpu_context(1);
    const mti_kctx k = {ctx, ctx->dev};
    const mti_ops *ops = mti_cpu_ops();
    uint8_t *q = check_alloc(2 * n);
    float *s = check_alloc(8 * n);
    if (bits == 8) memset(q, mti_q8_zero_code(1), n);
    else memset(q, 0x77, n);
    mti_adamw4_state st = {.qm = q, .qv = q + n, .absmax_m = s, .scale_v = s + n};
    float move = 0.0f;
    for (int t = 1; t <= 2; t++) {
        /* step 2: the small gradients vanish, as when a feature falls silent */
        if (t == 2)
            for (size_t i = n / 2; i < n; i++) g[i] = 0.0f;
        memcpy(p1, p, n * 4);
        mti_adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                            .weight_decay = 0.0f, .step = t, .grad_scale = 1.0f};
        if (bits == 8)
            CHECK_OKC(ctx, ops->adamw8(&k, p, g, q, q + n, s, s + n, NULL, MTI_F32, n, &a));
        else
            CHECK_OKC(ctx, ops->adamw4(&k, p, g, &st, NULL, MTI_F32, rows, cols, rows > 1, &a));
        if (t == 2)
            for (size_t i = 0; i < n; i++) move = fmaxf(move, fabsf(p[i] - p1[i]));
    }
    mt_context_destroy(ctx);
    return move;
}

TEST(optim4_zero_point_bounded)
{
    const float lr = 1e-3f;
    float m8 = zero_point_move(8, 1, 256), m4v = zero_point_move(4, 1, 256);
    float m4m = zero_point_move(4, 16, 16);
    fprintf(stderr, "zero-point case, largest move in step 2: 8-bit %.4g, 4-bit vector %.4g, "
                    "4-bit 16x16 matrix %.4g (lr %g)\n",
            (double)m8, (double)m4v, (double)m4m, (double)lr);
    CHECK_MSG(m8 > 100 * lr, "8-bit state: expected the zero-point failure, moved %g", (double)m8);
    CHECK_MSG(m4v <= 4 * lr && m4m <= 4 * lr, "4-bit state moved %g / %g (lr %g)", (double)m4v,
              (double)m4m, (double)lr);
}

TEST(optim4_entry)
{
    const mti_optim *o = mti_optim_of(MT_OPT_ADAMW4);
    CHECK(o && !strcmp(o->name, "adamw4") && !o->sliceable);
    mt_trainer_config c;
    mt_trainer_config_init(&c);
    c.optimizer = MT_OPT_ADAMW4;
    mti_param big = {.name = "w", .ndim = 2, .shape = {100, 77}, .numel = 7700};
    mti_param vec = {.name = "b", .ndim = 1, .shape = {5001}, .numel = 5001};
    mti_param small = {.name = "s", .ndim = 2, .shape = {10, 10}, .numel = 100};
    mti_opt_layout l;
    o->layout(&c, &big, NULL, &l);
    CHECK_EQ(l.bits, 4);
    CHECK_EQ(l.s[0].numel, 3850);
    CHECK_EQ(l.s[1].numel, 61);
    CHECK_EQ(l.s[2].numel, 3850);
    CHECK_EQ(l.s[3].numel, 177);
    CHECK_EQ(l.s[3].per, 0);
    CHECK_EQ(l.s[0].fill, 0x77);
    o->layout(&c, &vec, NULL, &l);
    CHECK_EQ(l.s[3].numel, 40);
    CHECK_EQ(l.s[0].numel, 2501);
    o->layout(&c, &small, NULL, &l);
    CHECK_EQ(l.bits, 32);
    const mt_param_override keep = {.pattern = "w", .state_bits = 32, .weight_decay = -1};
    o->layout(&c, &big, &keep, &l);
    CHECK_EQ(l.bits, 32);
    const mt_param_override force = {.pattern = "s", .state_bits = 8, .weight_decay = -1};
    o->layout(&c, &small, &force, &l);
    CHECK_EQ(l.bits, 4);
    /* a slice is refused */
    o->layout(&c, &big, NULL, &l);
    mt_context *ctx = check_cpu_context(1);
    const mti_kctx k = {ctx, ctx->dev};
    float *p = check_alloc(7700 * 4), *g = check_alloc(7700 * 4);
    void *st[MTI_OPT_SLOTS];
    for (int j = 0; j < 4; j++) st[j] = check_alloc((size_t)l.s[j].numel * 4);
    mti_opt_step a = {.k = &k, .ops = mti_cpu_ops(), .cfg = &c, .p = &big, .layout = &l,
                      .lr = 1e-3f, .step = 1, .grad_scale = 1.0f, .pc_dt = MTI_F32};
    CHECK_EQ(o->update(&a, st, p, NULL, g, 0, 1024), MT_ERR_UNSUPPORTED);
    CHECK(strstr(mt_last_error(ctx), "whole tensors"));
    CHECK_OKC(ctx, o->update(&a, st, p, NULL, g, 0, 7700));
    /* the op's refusals */
    mti_adamw4_state s4 = {.qm = st[0], .absmax_m = st[1], .qv = st[2], .scale_v = st[3]};
    mti_adamw_args aa = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 1,
                         .grad_scale = 1.0f};
    const mti_ops *ops = mti_cpu_ops();
    CHECK_EQ(ops->adamw4(&k, p, g, &s4, NULL, MTI_F32, 100, 77, 1, NULL), MT_ERR_INVALID_ARG);
    CHECK_EQ(ops->adamw4(&k, p, g, &s4, NULL, MTI_F32, -1, 77, 1, &aa), MT_ERR_INVALID_ARG);
    CHECK_EQ(ops->adamw4(&k, NULL, g, &s4, NULL, MTI_F32, 100, 77, 1, &aa), MT_ERR_INVALID_ARG);
    CHECK_EQ(ops->adamw4(&k, p, g, &s4, p, MTI_I32, 100, 77, 1, &aa), MT_ERR_INVALID_ARG);
    aa.step = 0;
    CHECK_EQ(ops->adamw4(&k, p, g, &s4, NULL, MTI_F32, 100, 77, 1, &aa), MT_ERR_INVALID_ARG);
    mt_context_destroy(ctx);
}
