/*
 * test_budget_limits.c - memory budgets against allocator instance limits:
 * a recompute plan whose run would pass an instance's limit_bytes is a plan
 * that does not fit, for the budget policy and for auto-fit alike.
 */
#include <string.h>

#include "check.h"
#include "memtrain.h"

enum { B = 4, T = 32, V = 200 };

/* A GPT of 6 blocks on a CPU context whose activations have their own
 * checkpoint allocator, limited to act_limit bytes (0: none). */
static mt_model *act_limited_model(mt_context **ctx, size_t act_limit)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 2;
    cc.allocators[MT_MEM_ACT].vtable = mt_allocator_checkpoint();
    cc.allocators[MT_MEM_ACT].limit_bytes = act_limit;
    CHECK_OK(mt_context_create(&cc, ctx));
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 6, g.heads = 4, g.channels = 64, g.seed = 3;
    mt_model *m;
    CHECK_OKC(*ctx, mt_model_gpt_create(*ctx, &g, &m));
    return m;
}

static void config(mt_trainer_config *tc, mt_recompute_policy p, uint64_t budget)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B;
    tc->max_seq = T;
    tc->optimizer = MT_OPT_ADAMW;
    tc->lr = 1e-3f;
    tc->recompute = p;
    tc->memory_budget = budget;
}

/* Two steps; the status of the first that fails. */
static mt_status two_steps(mt_trainer *t)
{
    int32_t ids[B * T + 1];
    for (int i = 0; i < B * T + 1; i++) ids[i] = (i * 31 + 7) % V;
    mt_batch b = {.n = B, .tokens = ids, .targets = ids + 1, .seq_len = T};
    mt_status s = MT_OK;
    for (int i = 0; i < 2 && !s; i++) s = mt_trainer_step(t, &b, NULL);
    return s;
}

/* What the ACT instance reserves at most in two steps of a policy, no limit. */
static uint64_t act_reserved(mt_recompute_policy p)
{
    mt_context *ctx;
    mt_model *m = act_limited_model(&ctx, 0);
    mt_trainer_config tc;
    config(&tc, p, 0);
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_OKC(ctx, two_steps(t));
    mt_allocator *a;
    mt_allocator_stats st;
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_ACT, &a));
    CHECK_OK(mt_allocator_get_stats(a, &st));
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
    return st.peak_reserved_bytes;
}

/* The case: the ACT limit halfway between what selective recompute
 * and no recompute reserve. Selective runs, no recompute does not; the
 * budget policy with a roomy budget, and auto-fit, find a plan that fits
 * both the budget and the limit, and it runs. */
TEST(budget_skips_plans_over_an_instance_limit)
{
    const uint64_t sel = act_reserved(MT_RECOMPUTE_SELECTIVE), none = act_reserved(MT_RECOMPUTE_NONE);
    CHECK_MSG(sel < none, "selective %llu, none %llu", (unsigned long long)sel,
              (unsigned long long)none);
    const size_t limit = (size_t)((sel + none) / 2);
    mt_context *ctx;
    mt_model *m = act_limited_model(&ctx, limit);
    mt_trainer_config tc;
    mt_trainer *t;
    /* the setup: selective fits the limit, no recompute passes it */
    config(&tc, MT_RECOMPUTE_SELECTIVE, 0);
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_OKC(ctx, two_steps(t));
    mt_trainer_destroy(t);
    config(&tc, MT_RECOMPUTE_NONE, 0);
    mt_status s = mt_trainer_create(m, &tc, &t);
    if (!s) {
        s = two_steps(t);
        mt_trainer_destroy(t);
    }
    CHECK_ST(MT_ERR_OOM, s);
    /* any roomy budget: a plan within the limit */
    const uint64_t budgets[] = {4u << 20, (uint64_t)1 << 40};
    for (int i = 0; i < 2; i++) {
        mt_context *c2;
        mt_model *m2 = act_limited_model(&c2, limit);
        config(&tc, MT_RECOMPUTE_BUDGET, budgets[i]);
        s = mt_trainer_create(m2, &tc, &t);
        if (s == MT_ERR_BUDGET && budgets[i] == 4u << 20) { /* 4 MiB may be below the least */
            CHECK_OK(mt_model_destroy(m2));
            CHECK_OK(mt_context_destroy(c2));
            continue;
        }
        CHECK_OKC(c2, s);
        unsigned char units[16];
        int seg;
        CHECK_OK(mt_trainer_recompute_plan(t, units, 16, &seg));
        int kept = 0;
        for (int u = 0; u < mt_model_num_units(m2); u++) kept += units[u] == MT_UNIT_KEEP;
        CHECK(kept < mt_model_num_units(m2)); /* something recomputed, as the limit needs */
        CHECK_OKC(c2, two_steps(t));
        mt_memory_stats st;
        CHECK_OK(mt_context_memory_stats(c2, &st));
        CHECK(st.peak_reserved_bytes <= budgets[i]);
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m2));
        CHECK_OK(mt_context_destroy(c2));
    }
    /* auto-fit: the same */
    {
        mt_context *c2;
        mt_model *m2 = act_limited_model(&c2, limit);
        config(&tc, MT_RECOMPUTE_NONE, (uint64_t)1 << 40);
        mt_autofit_report r;
        CHECK_OKC(c2, mt_trainer_autofit(m2, &tc, 0, &r));
        CHECK(r.micro_batch == B && r.recomputed_units + r.selective_units > 0);
        CHECK_OKC(c2, mt_trainer_create(m2, &tc, &t));
        CHECK_OKC(c2, two_steps(t));
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m2));
        CHECK_OK(mt_context_destroy(c2));
    }
    /* a limit nothing fits under: MT_ERR_BUDGET, saying the limits are why */
    mt_context *c3;
    mt_model *m3 = act_limited_model(&c3, 4096);
    config(&tc, MT_RECOMPUTE_BUDGET, (uint64_t)1 << 40);
    CHECK_ST(MT_ERR_BUDGET, mt_trainer_create(m3, &tc, &t));
    CHECK_MSG(strstr(mt_last_error(c3), "limit"), "%s", mt_last_error(c3));
    mt_autofit_report r;
    CHECK_ST(MT_ERR_BUDGET, mt_trainer_autofit(m3, &tc, 1, &r));
    CHECK_MSG(strstr(mt_last_error(c3), "limit"), "%s", mt_last_error(c3));
    CHECK_OK(mt_model_destroy(m3));
    CHECK_OK(mt_context_destroy(c3));
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}
