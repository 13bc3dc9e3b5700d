/*
 * test_plugin_faults.c - deliberately faulty plug-in allocators: the
 * library blames the plug-in (MT_ERR_PLUGIN) for NULL and misaligned
 * blocks, and in checking mode (MT_ALLOCATOR_CHECKED) for blocks outside
 * the memory it holds, blocks over live ones and memory given back under
 * live blocks, instead of handing them to the caller.
 */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "memtrain/allocator.h"

typedef enum fault {
    FAULT_NONE,
    FAULT_NULL,       /* the third block is NULL, with success */
    FAULT_MISALIGNED, /* the third block is 8 bytes off */
    FAULT_OVERLAP,    /* the third block is the first one again */
    FAULT_STRAY,      /* the third block lies past the end of its memory */
    FAULT_RELEASE,    /* the second free gives back all its memory, blocks live or not */
} fault;

/* A bump allocator over one 1 MiB reservation, with one fault. */
typedef struct bump {
    const mt_backing *bk;
    fault f;
    char *base;
    size_t granted, top;
    int allocs, frees;
} bump;

static mt_status b_create(const mt_allocator_params *p, const mt_backing *bk, void **state)
{
    bump *b = calloc(1, sizeof *b);
    if (!b) return MT_ERR_OOM;
    b->bk = bk;
    b->f = p->options ? *(const fault *)p->options : FAULT_NONE;
    mt_status s = bk->reserve(bk->self, 1u << 20, 0, (void **)&b->base, &b->granted);
    if (s) {
        free(b);
        return s;
    }
    *state = b;
    return MT_OK;
}

static mt_status b_alloc(void *state, const mt_alloc_request *req, mt_block *out)
{
    bump *b = state;
    size_t at = (b->top + req->alignment - 1) & ~(req->alignment - 1);
    if (!b->base || at + req->bytes > b->granted) return MT_ERR_OOM;
    b->top = at + req->bytes;
    out->ptr = b->base + at;
    if (++b->allocs == 3) {
        switch (b->f) {
        case FAULT_NULL: out->ptr = NULL; break;
        case FAULT_MISALIGNED: out->ptr = b->base + at + 8; break;
        case FAULT_OVERLAP: out->ptr = b->base; break;
        case FAULT_STRAY: out->ptr = b->base + b->granted; break;
        default: break;
        }
    }
    return MT_OK;
}

static mt_status b_free(void *state, const mt_block *blk)
{
    bump *b = state;
    if (++b->frees == 2 && b->f == FAULT_RELEASE && b->base) {
        b->bk->release(b->bk->self, b->base, b->granted);
        b->base = NULL;
    }
    return MT_OK;
}

static mt_status b_reset(void *state, mt_scope scope) { return MT_OK; }

static void b_destroy(void *state)
{
    bump *b = state;
    if (b->base) b->bk->release(b->bk->self, b->base, b->granted);
    free(b);
}

static const mt_allocator_vtable bump_vt = {
    .abi_version = MT_ALLOCATOR_ABI_VERSION,
    .struct_size = sizeof(mt_allocator_vtable),
    .name = "faulty",
    .create = b_create,
    .alloc = b_alloc,
    .free = b_free,
    .reset = b_reset,
    .destroy = b_destroy,
};

static mt_allocator *faulty(mt_context *ctx, const fault *f, uint32_t flags)
{
    mt_allocator_config ac = {.vtable = &bump_vt, .options = f, .flags = flags};
    mt_allocator *a;
    CHECK_OKC(ctx, mt_allocator_create(ctx, &ac, &a));
    return a;
}

static mt_status take(mt_allocator *a, size_t bytes, mt_block *out)
{
    mt_alloc_request r = {.bytes = bytes, .mem_class = MT_MEM_ACT, .lifetime = MT_LIFE_STEP};
    return mt_alloc(a, &r, out);
}

/* The third block of each fault, with and without checking: what is
 * caught always, what only the checking mode catches. */
TEST(plugin_faults_are_blamed_on_the_plugin)
{
    mt_context *ctx = check_cpu_context(1);
    static const struct {
        fault f;
        bool always; /* caught without the checking mode too */
        const char *says;
    } cases[] = {
        {FAULT_NULL, true, "returned NULL with success"},
        {FAULT_MISALIGNED, true, "misaligned"},
        {FAULT_OVERLAP, false, "overlaps live block 1"},
        {FAULT_STRAY, false, "not inside memory it holds"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        for (int checked = 0; checked < 2; checked++) {
            mt_allocator *a = faulty(ctx, &cases[i].f, checked ? MT_ALLOCATOR_CHECKED : 0);
            mt_block b[3];
            CHECK_OKC(ctx, take(a, 1000, &b[0]));
            CHECK_OKC(ctx, take(a, 1000, &b[1]));
            mt_status s = take(a, 1000, &b[2]);
            if (checked || cases[i].always) {
                CHECK_MSG(s == MT_ERR_PLUGIN, "fault %d, checked %d: %s", (int)cases[i].f,
                          checked, mt_status_string(s));
                const char *e = mt_last_error(ctx);
                CHECK_MSG(strstr(e, cases[i].says) && strstr(e, "plug-in allocator") &&
                              strstr(e, "'faulty'"),
                          "%s", e);
                CHECK(b[2].ptr == NULL && b[2].bytes == 0);
                mt_allocator_stats st;
                CHECK_OK(mt_allocator_get_stats(a, &st));
                CHECK(st.n_alloc == 2 && st.live_bytes == 2000); /* not counted */
                CHECK_OKC(ctx, take(a, 1000, &b[2])); /* the fault was one call's */
            } else {
                CHECK_OKC(ctx, s); /* unchecked, the bad block gets through */
            }
            for (int k = 0; k < 3; k++) CHECK_OKC(ctx, mt_free(a, &b[k]));
            mt_allocator_destroy(a);
        }
    }
    CHECK_OK(mt_context_destroy(ctx));
}

/* Checking mode: memory given back under a live block stays held, and the
 * next allocation says what happened; a free of a block that is not live
 * never reaches the allocator. */
TEST(plugin_checked_mode_guards_releases_and_frees)
{
    mt_context *ctx = check_cpu_context(1);
    const fault f = FAULT_RELEASE;
    mt_allocator *a = faulty(ctx, &f, MT_ALLOCATOR_CHECKED);
    mt_block b[3];
    for (int k = 0; k < 3; k++) CHECK_OKC(ctx, take(a, 4096, &b[k]));
    CHECK_OKC(ctx, mt_free(a, &b[0]));
    CHECK_OKC(ctx, mt_free(a, &b[1])); /* the allocator releases all while b[2] lives */
    memset(b[2].ptr, 0x5a, b[2].bytes); /* still mapped: the release was refused */
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(a, &st));
    CHECK(st.reserved_bytes >= 1u << 20);
    mt_block c;
    CHECK_ST(MT_ERR_PLUGIN, take(a, 100, &c));
    CHECK_MSG(strstr(mt_last_error(ctx), "released") && strstr(mt_last_error(ctx), "live"),
              "%s", mt_last_error(ctx));
    /* freeing a block twice, or one never handed out: refused before the allocator */
    CHECK_ST(MT_ERR_BAD_BLOCK, mt_free(a, &b[1]));
    mt_block forged = b[2];
    forged.ptr = (char *)forged.ptr + 256;
    forged.bytes = 256;
    CHECK_ST(MT_ERR_BAD_BLOCK, mt_free(a, &forged));
    CHECK_OKC(ctx, mt_free(a, &b[2]));
    mt_allocator_destroy(a); /* gives back what the allocator kept */
    /* unknown flags are still refused */
    mt_allocator_config ac = {.vtable = &bump_vt, .flags = 0x80};
    CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_create(ctx, &ac, &a));
    CHECK_OK(mt_context_destroy(ctx));
}

/* ---- the public conformance suite finds faulty allocators ---- */

const mt_allocator_vtable *example_allocator(void);

static const mt_allocator_vtable *example;
static void *last_ptr; /* the last block the scribbling allocator handed out */

/* The example allocator, but its stats count one byte too many reserved. */
static mt_status lying_stats(void *state, mt_allocator_stats *out)
{
    mt_status s = example->stats(state, out);
    out->reserved_bytes++;
    return s;
}

/* The example allocator, but it writes into the block it handed out last. */
static mt_status scribbling_alloc(void *state, const mt_alloc_request *req, mt_block *out)
{
    if (last_ptr) *(unsigned char *)last_ptr ^= 0xff;
    mt_status s = example->alloc(state, req, out);
    last_ptr = s ? NULL : out->ptr;
    return s;
}

TEST(plugin_conformance_suite_finds_faults)
{
    mt_context *ctx = check_cpu_context(1);
    static const struct {
        fault f;
        const char *says;
    } cases[] = {
        {FAULT_NULL, "returned NULL with success"},
        {FAULT_MISALIGNED, "misaligned"},
        {FAULT_OVERLAP, "overlaps live block"},
        {FAULT_STRAY, "not inside memory it holds"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        mt_allocator_config ac = {.vtable = &bump_vt, .options = &cases[i].f};
        CHECK_ST(MT_ERR_PLUGIN, mt_allocator_conformance(ctx, &ac));
        const char *e = mt_last_error(ctx);
        CHECK_MSG(strstr(e, "allocator conformance: 'faulty': alignment") &&
                      strstr(e, cases[i].says),
                  "%s", e);
    }
    example = example_allocator();
    mt_allocator_vtable liar = *example, scribbler = *example;
    liar.stats = lying_stats;
    scribbler.alloc = scribbling_alloc;
    mt_allocator_config ac = {.vtable = &liar};
    CHECK_ST(MT_ERR_PLUGIN, mt_allocator_conformance(ctx, &ac));
    CHECK_MSG(strstr(mt_last_error(ctx), "its own stats say"), "%s", mt_last_error(ctx));
    ac.vtable = &scribbler;
    last_ptr = NULL;
    CHECK_ST(MT_ERR_PLUGIN, mt_allocator_conformance(ctx, &ac));
    CHECK_MSG(strstr(mt_last_error(ctx), "overwritten while live"), "%s", mt_last_error(ctx));
    /* and the example itself passes */
    ac.vtable = example;
    CHECK_OKC(ctx, mt_allocator_conformance(ctx, &ac));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_conformance(ctx, NULL));
    CHECK_OK(mt_context_destroy(ctx));
}

/* The checking mode finds nothing wrong with the built-in allocators in
 * training, and changes no result: the same losses, bit for bit. */
TEST(plugin_checked_mode_trains_with_every_allocator)
{
    const mt_allocator_vtable *vts[4] = {mt_allocator_caching(), mt_allocator_arena(),
                                         mt_allocator_pool(), mt_allocator_checkpoint()};
    int32_t ids[2 * 16 + 1];
    for (int i = 0; i < 2 * 16 + 1; i++) ids[i] = (i * 37 + 11) % 64;
    mt_batch b = {.n = 2, .tokens = ids, .targets = ids + 1, .seq_len = 16};
    for (int v = 0; v < 4; v++) {
        float loss[2][3];
        for (int checked = 0; checked < 2; checked++) {
            mt_context_config cc;
            mt_context_config_init(&cc);
            cc.device = MT_DEVICE_CPU;
            cc.threads = 1;
            for (int c = 0; c < MT_MEM_COUNT; c++) {
                cc.allocators[c].vtable = vts[v];
                cc.allocators[c].flags = checked ? MT_ALLOCATOR_CHECKED : 0;
            }
            mt_context *ctx;
            CHECK_OK(mt_context_create(&cc, &ctx));
            mt_gpt_spec g;
            mt_gpt_spec_init(&g);
            g.vocab = 64, g.max_seq = 16, g.layers = 2, g.heads = 2, g.channels = 32, g.seed = 5;
            mt_model *m;
            CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
            mt_trainer_config tc;
            mt_trainer_config_init(&tc);
            tc.max_batch = 2, tc.optimizer = MT_OPT_ADAMW, tc.lr = 1e-3f;
            tc.recompute = MT_RECOMPUTE_SELECTIVE;
            mt_trainer *t;
            CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
            for (int s = 0; s < 3; s++) CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss[checked][s]));
            mt_trainer_destroy(t);
            CHECK_OK(mt_model_destroy(m));
            CHECK_OK(mt_context_destroy(ctx));
        }
        CHECK_MSG(memcmp(loss[0], loss[1], sizeof loss[0]) == 0, "%s: losses differ when checked",
                  vts[v]->name);
    }
}
