/*
 * test_context.c - the public API's promises: status strings, config
 * checking, messages that name the bad argument, allocator choice per
 * class, the plug-in table's version check, and what the wrapper does with
 * allocators that break the contract.
 */
#include <string.h>

#include "check.h"
#include "memtrain/allocator.h"

static mt_context *cpu_context(void)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    return ctx;
}

TEST(status_strings)
{
    for (int s = 0; s <= MT_ERR_PLUGIN; s++) {
        const char *str = mt_status_string((mt_status)s);
        CHECK(str && *str && strcmp(str, "unknown status") != 0);
    }
    CHECK(strcmp(mt_status_string((mt_status)999), "unknown status") == 0);
    CHECK(strcmp(mt_mem_class_name(MT_MEM_GRAD), "GRAD") == 0);
    CHECK(strcmp(mt_mem_class_name((mt_mem_class)42), "?") == 0);
    CHECK(strcmp(mt_version(), MT_VERSION_STRING) == 0);
}

TEST(context_config_errors)
{
    mt_context *ctx = (mt_context *)1;
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.struct_size = 3;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_create(&cfg, &ctx));
    CHECK(ctx == NULL);
    CHECK(strstr(mt_last_error(NULL), "struct_size"));
    mt_context_config_init(&cfg);
    cfg.device = (mt_device_kind)9;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_create(&cfg, &ctx));
    CHECK(strstr(mt_last_error(NULL), "cfg->device"));
    mt_context_config_init(&cfg);
    cfg.threads = -2;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_create(&cfg, &ctx));
    CHECK(strstr(mt_last_error(NULL), "cfg->threads"));
    mt_context_config_init(&cfg);
    cfg.device_ordinal = -1;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_create(&cfg, &ctx));
    CHECK(strstr(mt_last_error(NULL), "device_ordinal"));
    mt_context_config_init(&cfg);
    cfg.log_level = (mt_log_level)17;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_create(&cfg, &ctx));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_create(NULL, NULL));
    mt_context_config_init(&cfg);
    cfg.allocators[MT_MEM_ACT].flags = 0x100;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_create(&cfg, &ctx));
    CHECK(strstr(mt_last_error(NULL), "ACT") && strstr(mt_last_error(NULL), "flags"));
    /* NULL means every default */
    CHECK_OK(mt_context_create(NULL, &ctx));
    CHECK(mt_context_device(ctx) == MT_DEVICE_CPU || mt_context_device(ctx) == MT_DEVICE_CUDA);
    CHECK(*mt_context_device_name(ctx));
    CHECK_OK(mt_context_destroy(ctx));
    CHECK_OK(mt_context_destroy(NULL));
}

typedef struct log_seen {
    int n;
    char last[256];
} log_seen;

static void on_log(void *user, mt_log_level level, const char *msg)
{
    log_seen *s = user;
    s->n++;
    snprintf(s->last, sizeof s->last, "%d %s", (int)level, msg);
}

TEST(context_logging)
{
    log_seen seen = {0};
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.log_fn = on_log;
    cfg.log_user = &seen;
    cfg.log_level = MT_LOG_INFO;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    CHECK(seen.n >= 1 && strstr(seen.last, "context on"));
    /* failures are logged at debug level only: nothing more at INFO */
    int before = seen.n;
    mt_block b;
    mt_alloc_request r = {.bytes = 10, .alignment = 3};
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_alloc(ctx, &r, &b));
    CHECK_EQ(seen.n, before);
    CHECK(strstr(mt_last_error(ctx), "alignment 3"));
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(context_allocator_sharing)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    mt_context *ctx;
    mt_memory_stats ms;
    CHECK_OK(mt_context_create(&cfg, &ctx)); /* the default: one caching instance */
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    CHECK_EQ(ms.n_allocators, 1);
    mt_allocator *a, *b;
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_PARAM, &a));
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_ACT, &b));
    CHECK(a == b && strcmp(mt_allocator_name(a), "caching") == 0);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_allocator(ctx, MT_MEM_COUNT, &a));
    CHECK_OK(mt_context_destroy(ctx));

    /* persistent classes on an arena, activations on the checkpoint-aware
       allocator, the rest caching, and IO kept apart by its group */
    cfg.allocators[MT_MEM_PARAM].vtable = mt_allocator_arena();
    cfg.allocators[MT_MEM_MASTER].vtable = mt_allocator_arena();
    cfg.allocators[MT_MEM_OPTIM].vtable = mt_allocator_arena();
    cfg.allocators[MT_MEM_ACT].vtable = mt_allocator_checkpoint();
    cfg.allocators[MT_MEM_IO].group = 1;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    CHECK_EQ(ms.n_allocators, 4);
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_OPTIM, &a));
    CHECK(strcmp(mt_allocator_name(a), "arena") == 0);
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_IO, &a));
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_GRAD, &b));
    CHECK(a != b && strcmp(mt_allocator_name(a), "caching") == 0);
    CHECK(mt_allocator_by_name("pool") == mt_allocator_pool());
    CHECK(mt_allocator_by_name("nope") == NULL && mt_allocator_by_name(NULL) == NULL);
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(context_destroy_order)
{
    mt_context *ctx = cpu_context();
    mt_allocator *a;
    CHECK_OK(mt_allocator_create(ctx, NULL, &a));
    CHECK_ST(MT_ERR_STATE, mt_context_destroy(ctx));
    CHECK(strstr(mt_last_error(ctx), "still alive"));
    mt_allocator_destroy(a);
    mt_mlp_spec spec;
    mt_mlp_spec_init(&spec);
    spec.n_layers = 1, spec.dims[0] = 3, spec.dims[1] = 2;
    mt_model *m;
    CHECK_OK(mt_model_mlp_create(ctx, &spec, &m));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    mt_trainer *t;
    CHECK_OK(mt_trainer_create(m, &tc, &t));
    CHECK_ST(MT_ERR_STATE, mt_model_destroy(m));
    CHECK_ST(MT_ERR_STATE, mt_context_destroy(ctx));
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* ---- allocator tables that break the contract ---- */

static const mt_allocator_vtable *caching_copy(mt_allocator_vtable *v)
{
    *v = *mt_allocator_caching();
    return v;
}

TEST(allocator_table_checks)
{
    mt_context *ctx = cpu_context();
    mt_allocator_vtable v;
    mt_allocator *a;
    mt_allocator_config ac = {.vtable = caching_copy(&v)};
    v.abi_version = 99;
    CHECK_ST(MT_ERR_VERSION, mt_allocator_create(ctx, &ac, &a));
    CHECK(strstr(mt_last_error(ctx), "ABI version 99"));
    caching_copy(&v);
    v.struct_size = 8;
    CHECK_ST(MT_ERR_VERSION, mt_allocator_create(ctx, &ac, &a));
    caching_copy(&v);
    v.reset = NULL;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_create(ctx, &ac, &a));
    CHECK(strstr(mt_last_error(ctx), "reset"));
    /* the same through a context config */
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    caching_copy(&v);
    v.abi_version = 0;
    cfg.allocators[MT_MEM_GRAD].vtable = &v;
    mt_context *c2;
    CHECK_ST(MT_ERR_VERSION, mt_context_create(&cfg, &c2));
    CHECK(strstr(mt_last_error(NULL), "GRAD"));
    /* bad options are refused by the allocator */
    mt_caching_options co;
    mt_caching_options_init(&co);
    co.round_bytes = 3;
    ac.vtable = mt_allocator_caching();
    ac.options = &co;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_create(ctx, &ac, &a));
    CHECK(strstr(mt_last_error(ctx), "options"));
    /* every built-in refuses options of another size (not made by its _init) */
    mt_arena_options ao;
    mt_arena_options_init(&ao);
    mt_pool_options po;
    mt_pool_options_init(&po);
    mt_checkpoint_options ko;
    mt_checkpoint_options_init(&ko);
    mt_caching_options_init(&co);
    const struct {
        const mt_allocator_vtable *vt;
        void *opt;
        uint32_t *size;
    } cases[] = {{mt_allocator_caching(), &co, &co.struct_size},
                 {mt_allocator_arena(), &ao, &ao.struct_size},
                 {mt_allocator_pool(), &po, &po.struct_size},
                 {mt_allocator_checkpoint(), &ko, &ko.struct_size}};
    for (int i = 0; i < 4; i++) {
        ac.vtable = cases[i].vt;
        ac.options = cases[i].opt;
        CHECK_OKC(ctx, mt_allocator_create(ctx, &ac, &a)); /* the defaults, given explicitly */
        mt_allocator_destroy(a);
        *cases[i].size -= 4;
        CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_create(ctx, &ac, &a));
        *cases[i].size += 4;
    }
    ao.chunk_bytes = 0;
    ac.vtable = mt_allocator_arena();
    ac.options = &ao;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_create(ctx, &ac, &a));
    ko.plan_after_steps = 0;
    ac.vtable = mt_allocator_checkpoint();
    ac.options = &ko;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_create(ctx, &ac, &a));
    CHECK_OK(mt_context_destroy(ctx));
}

/* An allocator that leaks its reservations and hands out a misaligned block
 * when asked for 333 bytes. */
static const mt_backing *leaky_backing;

static mt_status leaky_create(const mt_allocator_params *p, const mt_backing *b, void **state)
{
    leaky_backing = b;
    *state = (void *)b;
    return MT_OK;
}

static mt_status leaky_alloc(void *state, const mt_alloc_request *req, mt_block *out)
{
    const mt_backing *b = state;
    size_t g;
    mt_status s = b->reserve(b->self, req->bytes + 512, req->alignment, &out->ptr, &g);
    if (s) return s;
    if (req->bytes == 333) out->ptr = (char *)out->ptr + 8;
    return MT_OK;
}

static mt_status leaky_free(void *state, const mt_block *blk) { return MT_OK; }
static mt_status leaky_reset(void *state, mt_scope s) { return MT_OK; }
static void leaky_destroy(void *state) {}

static const mt_allocator_vtable leaky = {
    .abi_version = MT_ALLOCATOR_ABI_VERSION,
    .struct_size = sizeof(mt_allocator_vtable),
    .name = "leaky",
    .create = leaky_create,
    .alloc = leaky_alloc,
    .free = leaky_free,
    .reset = leaky_reset,
    .destroy = leaky_destroy,
};

TEST(allocator_wrapper_guards)
{
    log_seen seen = {0};
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.log_fn = on_log;
    cfg.log_user = &seen;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    mt_allocator *a;
    mt_allocator_config ac = {.vtable = &leaky};
    CHECK_OK(mt_allocator_create(ctx, &ac, &a));
    mt_alloc_request r = {.bytes = 1000, .mem_class = MT_MEM_ACT, .lifetime = MT_LIFE_STEP};
    mt_block b;
    CHECK_OK(mt_alloc(a, &r, &b));
    r.bytes = 333;
    CHECK_ST(MT_ERR_PLUGIN, mt_alloc(a, &r, &b));
    CHECK(strstr(mt_last_error(ctx), "misaligned"));
    CHECK(strstr(mt_last_error(ctx), "plug-in allocator"));
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK(st.reserved_bytes >= 2 * 1000 && st.n_alloc == 1);
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_allocator_self_stats(a, &st));
    /* destroy gives back what the allocator kept, and says so */
    mt_allocator_destroy(a);
    CHECK(strstr(seen.last, "kept") != NULL);
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(context_report_and_peaks)
{
    mt_context *ctx = cpu_context();
    mt_block b[3];
    for (int i = 0; i < 3; i++) {
        mt_alloc_request r = {.bytes = 1000u << i, .mem_class = (mt_mem_class)i,
                              .lifetime = MT_LIFE_STEP};
        CHECK_OK(mt_context_alloc(ctx, &r, &b[i]));
    }
    CHECK_OK(mt_context_free(ctx, &b[2]));
    mt_memory_stats ms;
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    CHECK_EQ(ms.live_bytes, 3000);
    CHECK_EQ(ms.peak_live_bytes, 7000);
    CHECK_EQ(ms.per_class[MT_MEM_GRAD].peak_live_bytes, 4000);
    CHECK_OK(mt_context_reset_peaks(ctx));
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    CHECK_EQ(ms.peak_live_bytes, 3000);
    CHECK_EQ(ms.per_class[MT_MEM_GRAD].peak_live_bytes, 0);
    /* the report is cut to the buffer and says how long it wants to be */
    char small[40];
    size_t need = 0;
    CHECK_OK(mt_memory_report(ctx, small, sizeof small, &need));
    CHECK(need > sizeof small && strlen(small) == sizeof small - 1);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_memory_report(ctx, NULL, 10, NULL));
    CHECK_ST(MT_ERR_BAD_BLOCK, mt_context_free(ctx, &b[2])); /* freed already */
    CHECK_OK(mt_context_free(ctx, &b[0]));
    CHECK_OK(mt_context_free(ctx, &b[1]));
    CHECK_OK(mt_context_destroy(ctx));
}
