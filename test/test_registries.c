/*
 * test_registries.c - each registry has one source of truth, and what
 * hangs off it is complete: every op of the op table is in the CPU and the
 * CUDA tables, every built-in allocator is listed once and found by its
 * name, and the allocation tags of different kinds of tensor never meet.
 */
#include <stddef.h>
#include <string.h>

#include "check.h"
#include "ops/kernels.h"

typedef void (*any_fn)(void);

/* Every member of mti_ops from `cast` on is an op (lib/ops/kernels.h), so a
 * table that leaves one out has a NULL there. */
static void table_complete(const mti_ops *t)
{
    const size_t first = offsetof(mti_ops, cast);
    CHECK((sizeof(mti_ops) - first) % sizeof(any_fn) == 0);
    int n = 0;
    for (size_t off = first; off + sizeof(any_fn) <= sizeof(mti_ops); off += sizeof(any_fn), n++) {
        any_fn fn;
        memcpy(&fn, (const char *)t + off, sizeof fn);
        CHECK_MSG(fn != NULL, "the %s op table has no op %d (byte %zu of mti_ops)", t->name, n, off);
    }
    CHECK(n >= 25);
}

TEST(registries_op_tables_complete)
{
    table_complete(mti_cpu_ops());
    table_complete(mti_cuda_dry_ops()); /* the CUDA table, as a dry context runs it */
    CHECK(mti_cpu_ops()->device == MT_DEVICE_CPU && mti_cuda_dry_ops()->device == MT_DEVICE_CUDA);
}

TEST(registries_allocators_listed_once)
{
    int n = 0;
    for (; mt_allocator_builtin(n); n++) {
        const mt_allocator_vtable *vt = mt_allocator_builtin(n);
        CHECK(mt_allocator_by_name(vt->name) == vt);
        for (int j = 0; j < n; j++) CHECK(strcmp(mt_allocator_builtin(j)->name, vt->name) != 0);
    }
    CHECK_EQ(n, 4);
    CHECK(mt_allocator_builtin(-1) == NULL && mt_allocator_by_name("nope") == NULL);
    CHECK(mt_allocator_by_name("caching") == mt_allocator_caching() &&
          mt_allocator_by_name("arena") == mt_allocator_arena() &&
          mt_allocator_by_name("pool") == mt_allocator_pool() &&
          mt_allocator_by_name("checkpoint") == mt_allocator_checkpoint());
}

TEST(registries_tags_apart)
{
    /* parameter i's tensors of different kinds, the trainer's own, a
       layer's and a pass's: all different for any parameter below 2^24 */
    const uint64_t big = (1u << 24) - 1;
    uint64_t tags[] = {MTI_TAG_PARAM(MTI_TAG_WEIGHT, 2),  MTI_TAG_PARAM(MTI_TAG_MASTER, 2),
                       MTI_TAG_PARAM(MTI_TAG_GRAD, 2),    MTI_TAG_PARAM(MTI_TAG_STATE, 2),
                       MTI_TAG_PARAM(MTI_TAG_STATE + 3, 2), MTI_TAG_PARAM(MTI_TAG_TRAINER, 2),
                       MTI_TAG_PARAM(MTI_TAG_STAGE, 0),   MTI_TAG_PARAM(MTI_TAG_WEIGHT, big),
                       MTI_TAG_PARAM(MTI_TAG_MASTER, 0),  MTI_TAG(0, 2), MTI_TAG(2, 2)};
    const int n = (int)(sizeof tags / sizeof tags[0]);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++) CHECK_MSG(tags[i] != tags[j], "tags %d and %d meet", i, j);
    CHECK(MTI_TAG_STATE + 3 < MTI_TAG_TRAINER);
}

/* The device chooses its op table: the host device and the dry device
 * standing for it give the CPU table, whose every op stops in a dry context
 * before touching memory (the dry device's addresses fault if touched). */
TEST(registries_devices_choose_their_tables)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 1;
    mt_context *real = NULL, *dry = NULL;
    CHECK_OK(mt_context_create(&cfg, &real));
    cfg.dry_run = 1;
    CHECK_OK(mt_context_create(&cfg, &dry));
    CHECK(real->ops == mti_cpu_ops() && dry->ops == mti_cpu_ops() && dry->dry && !real->dry);
    mt_block b;
    mt_alloc_request r = {.bytes = 4096, .alignment = 256, .mem_class = MT_MEM_WORK,
                          .lifetime = MT_LIFE_STEP};
    CHECK_OK(mt_context_alloc(dry, &r, &b)); /* an address nothing is behind */
    const mti_kctx k = {dry, dry->dev};
    float *p = b.ptr;
    mti_adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 1,
                        .grad_scale = 1.0f};
    CHECK_OK(dry->ops->adamw(&k, p, p + 256, p + 512, p + 768, NULL, MTI_F32, 256, &a));
    CHECK_OK(dry->ops->gelu_fwd(&k, p, p + 256, 256, MTI_F32));
    CHECK_OK(dry->ops->cast(&k, p, MTI_BF16, p + 256, MTI_F32, 256, MTI_ROUND_NEAREST, 0));
    CHECK_OK(mt_context_free(dry, &b));
    CHECK_OK(mt_context_destroy(dry));
    CHECK_OK(mt_context_destroy(real));
}
