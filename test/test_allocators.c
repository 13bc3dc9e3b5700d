/*
 * test_allocators.c - what each built-in allocator promises beyond the
 * common contract: the checkpoint-aware allocator replays a training step at
 * planned offsets in one reservation, the pool with a model's exact sizes
 * wastes nothing and serves what fits under a limit, the arena rewinds by scope and keeps its memory, the
 * caching allocator releases cached memory and retries when out of memory.
 */
#include <string.h>

#include "../allocators/checkpoint.h"
#include "check.h"
#include "memtrain/allocator.h"

static mt_context *cpu_context(void)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    return ctx;
}

/* The trainer's steps, every class on one checkpoint-aware instance. */
TEST(checkpoint_replays_training_steps)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 2;
    for (int c = 0; c < MT_MEM_COUNT; c++) cfg.allocators[c].vtable = mt_allocator_checkpoint();
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 3;
    sp.dims[0] = 32, sp.dims[1] = 300, sp.dims[2] = 200, sp.dims[3] = 10;
    sp.activation = MT_ACT_GELU;
    mt_model *m;
    CHECK_OK(mt_model_mlp_create(ctx, &sp, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 64;
    tc.momentum = 0.9f;
    mt_trainer *t;
    CHECK_OK(mt_trainer_create(m, &tc, &t));
    static float x[64 * 32];
    int32_t y[64];
    for (int i = 0; i < 64 * 32; i++) x[i] = (float)(i % 17) / 17.0f;
    for (int i = 0; i < 64; i++) y[i] = i % 10;
    mt_batch b = {.n = 64, .inputs = x, .targets = y};
    mt_allocator *a;
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_ACT, &a));
    mti_checkpoint_summary sum;
    for (int s = 0; s < 10; s++) CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    CHECK_OK(mti_checkpoint_summary_get(a, &sum));
    CHECK(sum.replaying);
    CHECK_EQ(sum.n_plans, 1);
    CHECK_EQ(sum.n_divergences, 0);
    CHECK_EQ(sum.n_recorded_steps, 1);
    CHECK(sum.n_planned > 10 && sum.plan_bytes >= sum.plan_live_bytes);
    /* after the first step nothing more is taken from the device */
    mt_allocator_stats st1, st2;
    CHECK_OK(mt_allocator_get_stats(a, &st1));
    for (int s = 0; s < 5; s++) CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    CHECK_OK(mt_allocator_get_stats(a, &st2));
    CHECK_EQ(st2.n_backing_alloc, st1.n_backing_alloc);
    CHECK_EQ(st2.peak_reserved_bytes, st1.peak_reserved_bytes);
    double eff = (double)st2.peak_reserved_bytes / (double)st2.peak_live_bytes;
    CHECK_MSG(eff <= 1.02, "peak reserved / peak live = %.4f", eff);
    /* a smaller batch fits the plan; eval is a prefix of the step */
    b.n = 40;
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    float loss;
    CHECK_OKC(ctx, mt_trainer_eval(t, &b, &loss, NULL));
    CHECK_OK(mti_checkpoint_summary_get(a, &sum));
    CHECK_EQ(sum.n_divergences, 0);
    mt_allocator *other;
    CHECK_OK(mt_allocator_create(ctx, NULL, &other));
    CHECK_ST(MT_ERR_INVALID_ARG, mti_checkpoint_summary_get(other, &sum)); /* not a checkpoint one */
    mt_allocator_destroy(other);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* A step that changes shape leaves the plan, is recorded, and is planned anew. */
TEST(checkpoint_replans_when_the_step_changes)
{
    mt_context *ctx = cpu_context();
    mt_allocator_config ac = {.vtable = mt_allocator_checkpoint()};
    mt_allocator *a;
    CHECK_OK(mt_allocator_create(ctx, &ac, &a));
    mt_block b[8];
    for (int step = 0; step < 8; step++) {
        size_t grow = step >= 4 ? 3 : 1; /* from step 4 on the blocks are larger */
        for (int i = 0; i < 8; i++) {
            mt_alloc_request r = {.bytes = (10000 + 5000 * (size_t)i) * grow,
                                  .mem_class = MT_MEM_ACT, .lifetime = MT_LIFE_STEP};
            CHECK_OKC(ctx, mt_alloc(a, &r, &b[i]));
        }
        for (int i = 7; i >= 0; i--) CHECK_OKC(ctx, mt_free(a, &b[i]));
        CHECK_OK(mt_allocator_reset(a, MT_SCOPE_STEP));
    }
    mti_checkpoint_summary sum;
    CHECK_OK(mti_checkpoint_summary_get(a, &sum));
    CHECK(sum.replaying);
    CHECK_EQ(sum.n_plans, 2);
    CHECK_EQ(sum.n_divergences, 1);
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK(st.live_bytes == 0 && st.reserved_bytes >= sum.plan_bytes);
    CHECK_OK(mt_allocator_trim(a));
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK_EQ(st.reserved_bytes, 0);
    mt_allocator_destroy(a);
    CHECK_OK(mt_context_destroy(ctx));
}

/* Given a model's tensor sizes as classes, the pool cuts blocks of exactly
 * those sizes (rounded up to 256 bytes): neighbours in a slab sit one
 * rounded size apart. */
TEST(pool_exact_classes)
{
    mt_context *ctx = cpu_context();
    static const size_t sizes[] = {4096, 12800, 40000, 131072};
    mt_pool_options po;
    mt_pool_options_init(&po);
    po.class_bytes = sizes;
    po.n_classes = 4;
    mt_allocator_config ac = {.vtable = mt_allocator_pool(), .options = &po};
    mt_allocator *a;
    CHECK_OKC(ctx, mt_allocator_create(ctx, &ac, &a));
    mt_block b[64];
    for (int i = 0; i < 64; i++) {
        mt_alloc_request r = {.bytes = sizes[i % 4], .mem_class = MT_MEM_PARAM,
                              .lifetime = MT_LIFE_PERSISTENT};
        CHECK_OKC(ctx, mt_alloc(a, &r, &b[i]));
    }
    for (int k = 0; k < 4; k++) {
        size_t rounded = (sizes[k] + 255) / 256 * 256, exact = 0;
        for (int i = k; i < 64; i += 4)
            for (int j = k; j < 64; j += 4)
                exact += (char *)b[j].ptr - (char *)b[i].ptr == (ptrdiff_t)rounded;
        CHECK_MSG(exact >= 8, "class %zu: only %zu neighbours %zu bytes apart", sizes[k], exact,
                  rounded);
    }
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(a, &st));
    uint64_t live = 16 * (4096 + 12800 + 40000 + 131072);
    CHECK_EQ(st.live_bytes, live);
    /* slabs grow by doubling, so at most about half of a class's slabs is unused */
    CHECK_MSG(st.reserved_bytes <= 2 * live, "reserved %llu for %llu live",
              (unsigned long long)st.reserved_bytes, (unsigned long long)live);
    /* classes must ascend */
    static const size_t bad[] = {4096, 1024};
    po.class_bytes = bad;
    po.n_classes = 2;
    mt_allocator *a2;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_create(ctx, &ac, &a2));
    for (int i = 0; i < 64; i++) CHECK_OK(mt_free(a, &b[i]));
    mt_allocator_destroy(a);
    CHECK_OK(mt_context_destroy(ctx));
}

/* The pool's slabs grow (64 KiB, then twice as many blocks each time, up
 * to 2 MiB): under a limit a class whose next slab would pass it takes
 * smaller ones, down to one block, so out of memory means not even one
 * block fits; and trim starts the growth again. */
TEST(pool_slabs_shrink_at_the_limit_and_trim_resets_growth)
{
    mt_context *ctx = cpu_context();
    const size_t limit = 3u << 20, size = 16u << 10;
    mt_allocator_config ac = {.vtable = mt_allocator_pool(), .limit_bytes = limit};
    mt_allocator *a;
    CHECK_OKC(ctx, mt_allocator_create(ctx, &ac, &a));
    static mt_block b[256];
    mt_alloc_request r = {.bytes = size, .mem_class = MT_MEM_ACT, .lifetime = MT_LIFE_STEP};
    int n = 0;
    while (n < 256 && mt_alloc(a, &r, &b[n]) == MT_OK) n++;
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK_MSG(n < 256 && st.reserved_bytes + size > limit,
              "out of memory after %d blocks with %llu of %zu bytes reserved", n,
              (unsigned long long)st.reserved_bytes, limit);
    for (int i = 0; i < n; i++) CHECK_OK(mt_free(a, &b[i]));
    mt_allocator_destroy(a);
    /* without a limit: the slabs grow to 2 MiB; after trim they start again */
    ac.limit_bytes = 0;
    CHECK_OKC(ctx, mt_allocator_create(ctx, &ac, &a));
    for (int i = 0; i < 256; i++) CHECK_OKC(ctx, mt_alloc(a, &r, &b[i]));
    for (int i = 0; i < 256; i++) CHECK_OK(mt_free(a, &b[i]));
    CHECK_OK(mt_allocator_trim(a));
    CHECK_OKC(ctx, mt_alloc(a, &r, &b[0]));
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK_MSG(st.reserved_bytes == 64u << 10, "the first slab after trim is %llu bytes",
              (unsigned long long)st.reserved_bytes);
    CHECK_OK(mt_free(a, &b[0]));
    mt_allocator_destroy(a);
    CHECK_OK(mt_context_destroy(ctx));
}

/* The arena keeps its memory across resets: the second step takes nothing
 * more from the device, and trim gives everything back. */
TEST(arena_rewinds_by_scope)
{
    mt_context *ctx = cpu_context();
    mt_allocator_config ac = {.vtable = mt_allocator_arena()};
    mt_allocator *a;
    CHECK_OK(mt_allocator_create(ctx, &ac, &a));
    mt_allocator_stats st;
    uint64_t backing_after_first = 0, reserved_after_first = 0;
    for (int step = 0; step < 3; step++) {
        mt_block blk;
        for (int i = 0; i < 20; i++) {
            mt_alloc_request r = {.bytes = 100000, .mem_class = MT_MEM_ACT,
                                  .lifetime = i % 2 ? MT_LIFE_PHASE : MT_LIFE_STEP};
            CHECK_OKC(ctx, mt_alloc(a, &r, &blk));
        }
        CHECK_OK(mt_allocator_reset(a, MT_SCOPE_PHASE));
        CHECK_OK(mt_allocator_get_stats(a, &st));
        CHECK_EQ(st.live_bytes, 10 * 100000);
        CHECK_OK(mt_allocator_reset(a, MT_SCOPE_STEP));
        CHECK_OK(mt_allocator_get_stats(a, &st));
        CHECK_EQ(st.live_bytes, 0);
        if (step == 0) {
            backing_after_first = st.n_backing_alloc;
            reserved_after_first = st.reserved_bytes;
        }
    }
    CHECK_EQ(st.n_backing_alloc, backing_after_first);
    CHECK_EQ(st.reserved_bytes, reserved_after_first);
    CHECK(st.peak_reserved_bytes <= 2000000 + 2000000 / 8);
    CHECK_OK(mt_allocator_trim(a));
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK_EQ(st.reserved_bytes, 0);
    mt_allocator_destroy(a);
    CHECK_OK(mt_context_destroy(ctx));
}

/* Out of memory with cached segments: they are released and the request
 * retried, which the stats count. */
TEST(caching_release_and_retry)
{
    mt_context *ctx = cpu_context();
    mt_allocator_config ac = {.vtable = mt_allocator_caching(), .limit_bytes = 64u << 20};
    mt_allocator *a;
    CHECK_OK(mt_allocator_create(ctx, &ac, &a));
    mt_block b[12];
    for (int i = 0; i < 12; i++) { /* 12 x 5 MiB: shared 20 MiB segments */
        mt_alloc_request r = {.bytes = 5u << 20, .mem_class = MT_MEM_ACT, .lifetime = MT_LIFE_STEP};
        CHECK_OKC(ctx, mt_alloc(a, &r, &b[i]));
    }
    for (int i = 0; i < 12; i++) CHECK_OK(mt_free(a, &b[i]));
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK(st.reserved_bytes >= 60u << 20); /* all of it cached */
    /* a 40 MiB request fits the limit only once the cache is given back */
    mt_alloc_request big = {.bytes = 40u << 20, .mem_class = MT_MEM_GRAD, .lifetime = MT_LIFE_STEP};
    mt_block g;
    CHECK_OKC(ctx, mt_alloc(a, &big, &g));
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK(st.reserved_bytes <= 64u << 20);
    CHECK_OK(mt_free(a, &g));
    mt_allocator_destroy(a);
    CHECK_OK(mt_context_destroy(ctx));
}
