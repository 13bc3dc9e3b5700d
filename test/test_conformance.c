/*
 * test_conformance.c - one suite, run against every allocator (the
 * user-written example included) on every device the test can open: the
 * CPU, and the CUDA device layer over the stand-in driver when MT_FAKE_CUDA
 * names it. Every allocation is checked against an independent model
 * (shadow.h) for alignment, overlap and exact per-class accounting.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "memtrain/allocator.h"
#include "shadow.h"

/* the example allocator (examples/custom_allocator.c) */
const mt_allocator_vtable *example_allocator(void);
/* test hook of the library: the n-th next backing call of a fails */
void mti_allocator_fail_backing_after(mt_allocator *a, long n);

typedef struct acase {
    const char *name;
    const mt_allocator_vtable *vt;
    uint32_t flags;
} acase;

/* Every allocator, plain and in checking mode (which must find nothing
 * wrong with a correct allocator). */
static int allocator_cases(acase *out)
{
    int n = 0;
    for (const mt_allocator_vtable *vt; n < 7 && (vt = mt_allocator_builtin(n)) != NULL;)
        out[n++] = (acase){vt->name, vt, 0};
    out[n++] = (acase){"custom", example_allocator(), 0};
    for (int i = 0, plain = n; i < plain; i++) {
        out[n] = out[i];
        out[n].flags = MT_ALLOCATOR_CHECKED;
        n++;
    }
    return n;
}

typedef struct dcase {
    const char *name;
    mt_context *ctx;
    bool host; /* blocks may be written from the host */
} dcase;

static int device_cases(dcase *out)
{
    int n = 0;
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 1;
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    out[n++] = (dcase){"cpu", ctx, true};
    if (check_fake_cuda()) {
        cfg.device = MT_DEVICE_CUDA;
        cfg.cuda_driver_path = check_fake_cuda();
        CHECK_OK(mt_context_create(&cfg, &ctx));
        out[n++] = (dcase){"cuda(fake)", ctx, false};
    }
    return n;
}

static void close_devices(dcase *d, int n)
{
    for (int i = 0; i < n; i++) CHECK_OKC(d[i].ctx, mt_context_destroy(d[i].ctx));
}

/* ---- the harness: an instance, its model, and checked operations ---- */

typedef struct harness {
    char name[96];
    mt_context *ctx;
    mt_allocator *a;
    const mt_allocator_vtable *vt;
    bool host;
    shadow sh;
    uint64_t rng;
} harness;

static uint64_t rnd(harness *h)
{
    h->rng ^= h->rng << 13;
    h->rng ^= h->rng >> 7;
    h->rng ^= h->rng << 17;
    return h->rng;
}

static void h_open(harness *h, const dcase *d, const acase *c, size_t limit, uint32_t flags,
                   uint64_t seed)
{
    memset(h, 0, sizeof *h);
    snprintf(h->name, sizeof h->name, "%s%s on %s", c->name,
             c->flags & MT_ALLOCATOR_CHECKED ? " (checked)" : "", d->name);
    h->ctx = d->ctx;
    h->vt = c->vt;
    h->host = d->host;
    h->rng = seed * 0x9E3779B97F4A7C15ull + 1;
    shadow_init(&h->sh);
    mt_allocator_config ac = {.vtable = c->vt, .limit_bytes = limit, .flags = flags | c->flags};
    mt_status s = mt_allocator_create(d->ctx, &ac, &h->a);
    CHECK_MSG(s == MT_OK, "%s: create: %s", h->name, mt_last_error(d->ctx));
}

/* A few bytes at each end of a block, derived from its id, so a block that
 * overlaps another (or is moved) is noticed when it is freed. */
static void pattern(harness *h, const mt_block *b, bool verify)
{
    if (!h->host) return;
    size_t n = b->bytes / 2 < 16 ? b->bytes / 2 : 16; /* head and tail stamps never overlap */
    unsigned char *p = b->ptr;
    for (size_t i = 0; i < n; i++) {
        unsigned char v = (unsigned char)(b->id * 31 + i);
        if (verify) {
            CHECK_MSG(p[i] == v && p[b->bytes - 1 - i] == v,
                      "%s: block %llu (%zu bytes) was overwritten", h->name,
                      (unsigned long long)b->id, b->bytes);
        } else {
            p[i] = v;
            p[b->bytes - 1 - i] = v;
        }
    }
}

static mt_status h_alloc(harness *h, size_t bytes, size_t align, mt_mem_class c, mt_lifetime l)
{
    mt_alloc_request r = {.bytes = bytes, .alignment = align, .mem_class = c, .lifetime = l,
                          .tag = 7};
    mt_block b;
    mt_status s = mt_alloc(h->a, &r, &b);
    if (s) {
        CHECK_MSG(b.ptr == NULL && b.bytes == 0, "%s: failed alloc left a block", h->name);
        return s;
    }
    size_t want = align < MT_DEFAULT_ALIGNMENT ? MT_DEFAULT_ALIGNMENT : align;
    CHECK_MSG(b.ptr != NULL && ((uintptr_t)b.ptr & (want - 1)) == 0,
              "%s: %zu bytes aligned %zu at %p", h->name, bytes, want, b.ptr);
    CHECK_MSG(b.bytes == bytes && b.mem_class == c && b.lifetime == l && b.id > 0,
              "%s: block fields wrong", h->name);
    mt_block other;
    CHECK_MSG(shadow_add(&h->sh, &b, &other),
              "%s: block %p+%zu overlaps live block %p+%zu", h->name, b.ptr, b.bytes, other.ptr,
              other.bytes);
    pattern(h, &b, false);
    return MT_OK;
}

static void h_free(harness *h, size_t i)
{
    mt_block b = h->sh.v[i];
    pattern(h, &b, true);
    mt_status s = mt_free(h->a, &b);
    CHECK_MSG(s == MT_OK, "%s: free: %s", h->name, mt_last_error(h->ctx));
    shadow_remove(&h->sh, i);
}

static void h_reset(harness *h, mt_scope scope)
{
    for (size_t i = 0; i < h->sh.n; i++)
        if ((int)h->sh.v[i].lifetime < (int)scope) pattern(h, &h->sh.v[i], true);
    CHECK_MSG(mt_allocator_reset(h->a, scope) == MT_OK, "%s: reset: %s", h->name,
              mt_last_error(h->ctx));
    shadow_reset(&h->sh, scope);
}

/* The library's stats must match the model, and the allocator's own stats
 * must match the library's. */
static void h_check_stats(harness *h)
{
    mt_allocator_stats st, self;
    char why[512];
    CHECK_OK(mt_allocator_get_stats(h->a, &st));
    CHECK_MSG(shadow_matches(&h->sh, &st, why, sizeof why), "%s: library stats: %s", h->name, why);
    if (mt_allocator_self_stats(h->a, &self) != MT_OK) return;
    CHECK_MSG(shadow_matches(&h->sh, &self, why, sizeof why), "%s: allocator's own stats: %s",
              h->name, why);
    CHECK_MSG(self.reserved_bytes == st.reserved_bytes &&
                  self.peak_reserved_bytes == st.peak_reserved_bytes &&
                  self.n_backing_alloc == st.n_backing_alloc &&
                  self.n_backing_free == st.n_backing_free &&
                  /* requests refused before reaching the allocator count only here */
                  self.n_oom_failures <= st.n_oom_failures,
              "%s: allocator reports reserved %llu (peak %llu, %llu/%llu backing calls, %llu oom), "
              "library measured %llu (peak %llu, %llu/%llu, %llu)",
              h->name, (unsigned long long)self.reserved_bytes,
              (unsigned long long)self.peak_reserved_bytes,
              (unsigned long long)self.n_backing_alloc, (unsigned long long)self.n_backing_free,
              (unsigned long long)self.n_oom_failures, (unsigned long long)st.reserved_bytes,
              (unsigned long long)st.peak_reserved_bytes, (unsigned long long)st.n_backing_alloc,
              (unsigned long long)st.n_backing_free, (unsigned long long)st.n_oom_failures);
}

static void h_free_all(harness *h)
{
    while (h->sh.n) h_free(h, h->sh.n - 1);
}

static void h_close(harness *h)
{
    h_free_all(h);
    h_check_stats(h);
    mt_allocator_destroy(h->a);
    shadow_fini(&h->sh);
}

/* Runs body(h) for every allocator on every device. */
static void each(void (*body)(harness *h, const dcase *d, const acase *c))
{
    acase ac[16];
    dcase dc[2];
    int na = allocator_cases(ac), nd = device_cases(dc);
    for (int d = 0; d < nd; d++) {
        for (int c = 0; c < na; c++) {
            harness h;
            body(&h, &dc[d], &ac[c]);
        }
    }
    close_devices(dc, nd);
}

/* ---- the properties ---- */

static void alignment_body(harness *h, const dcase *d, const acase *c)
{
    static const size_t aligns[] = {0, 1, 16, 256, 512, 4096, 65536, 1u << 20, 1u << 24};
    static const size_t sizes[] = {1, 100, 4096, 100000, 3u << 20};
    h_open(h, d, c, 0, 0, 1);
    for (size_t i = 0; i < sizeof aligns / sizeof *aligns; i++)
        for (size_t j = 0; j < sizeof sizes / sizeof *sizes; j++)
            CHECK_MSG(h_alloc(h, sizes[j], aligns[i], (mt_mem_class)(j % MT_MEM_COUNT),
                              (mt_lifetime)(i % MT_LIFE_COUNT)) == MT_OK,
                      "%s: %zu bytes aligned %zu: %s", h->name, sizes[j], aligns[i],
                      mt_last_error(h->ctx));
    h_check_stats(h);
    h_close(h);
}

TEST(conformance_alignment) { each(alignment_body); }

static void reset_body(harness *h, const dcase *d, const acase *c)
{
    h_open(h, d, c, 0, 0, 2);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 30; i++)
            CHECK(h_alloc(h, 1000 + (size_t)i * 4000, 0, (mt_mem_class)(i % MT_MEM_COUNT),
                          (mt_lifetime)(i % MT_LIFE_COUNT)) == MT_OK);
        mt_block phase_blk = {0};
        for (size_t i = 0; i < h->sh.n; i++)
            if (h->sh.v[i].lifetime == MT_LIFE_PHASE) phase_blk = h->sh.v[i];
        h_reset(h, MT_SCOPE_PHASE);
        h_check_stats(h);
        for (size_t i = 0; i < h->sh.n; i++) CHECK(h->sh.v[i].lifetime != MT_LIFE_PHASE);
        /* a block freed by the reset cannot be freed again */
        CHECK_ST(MT_ERR_BAD_BLOCK, mt_free(h->a, &phase_blk));
        h_check_stats(h);
        h_reset(h, MT_SCOPE_STEP);
        h_check_stats(h);
        for (size_t i = 0; i < h->sh.n; i++) CHECK(h->sh.v[i].lifetime == MT_LIFE_PERSISTENT);
        CHECK(h->sh.n > 0);
    }
    h_reset(h, MT_SCOPE_ALL);
    CHECK_EQ(h->sh.n, 0);
    h_check_stats(h);
    CHECK(h_alloc(h, 12345, 0, MT_MEM_ACT, MT_LIFE_STEP) == MT_OK); /* still usable */
    h_close(h);
}

TEST(conformance_reset) { each(reset_body); }

static void trim_body(harness *h, const dcase *d, const acase *c)
{
    h_open(h, d, c, 0, 0, 3);
    for (int i = 0; i < 200; i++)
        CHECK(h_alloc(h, 1 + rnd(h) % (3u << 20), 0, MT_MEM_ACT,
                      (mt_lifetime)(rnd(h) % MT_LIFE_COUNT)) == MT_OK);
    /* trim with live blocks: they stay intact */
    for (size_t i = h->sh.n; i-- > 0;)
        if (i % 2) h_free(h, i);
    CHECK_OK(mt_allocator_trim(h->a));
    h_check_stats(h);
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(h->a, &st));
    CHECK(st.reserved_bytes >= st.live_bytes);
    h_free_all(h);
    h_reset(h, MT_SCOPE_ALL);
    CHECK_OK(mt_allocator_trim(h->a));
    CHECK_OK(mt_allocator_get_stats(h->a, &st));
    CHECK_MSG(st.reserved_bytes == 0, "%s: %llu bytes still reserved after freeing all and trim",
              h->name, (unsigned long long)st.reserved_bytes);
    CHECK(st.n_trims == 2);
    h_check_stats(h);
    h_close(h);
}

TEST(conformance_trim) { each(trim_body); }

static void oom_body(harness *h, const dcase *d, const acase *c)
{
    const size_t limit = 16u << 20;
    h_open(h, d, c, limit, 0, 4);
    mt_status s = MT_OK;
    int n = 0;
    while (n < 64 && (s = h_alloc(h, 1u << 20, 0, MT_MEM_GRAD, MT_LIFE_STEP)) == MT_OK) n++;
    CHECK_MSG(s == MT_ERR_OOM, "%s: %d MiB fit under a 16 MiB limit (%s)", h->name, n,
              mt_status_string(s));
    CHECK(n >= 4); /* something fits */
    CHECK(strstr(mt_last_error(h->ctx), "limit") != NULL);
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(h->a, &st));
    CHECK(st.n_oom_failures >= 1 && st.per_class[MT_MEM_GRAD].n_oom_failures >= 1);
    CHECK(st.peak_reserved_bytes <= limit);
    h_check_stats(h);
    /* more than the limit in one go */
    CHECK_ST(MT_ERR_OOM, h_alloc(h, limit + 1, 0, MT_MEM_ACT, MT_LIFE_STEP));
    /* still usable: free half and allocate again */
    for (size_t i = h->sh.n; i-- > 0;)
        if (i % 2 == 0) h_free(h, i);
    CHECK_OKC(h->ctx, h_alloc(h, 1u << 20, 0, MT_MEM_GRAD, MT_LIFE_STEP));
    h_check_stats(h);
    /* an injected backing failure: the allocation may fail (OOM) or be served
       after a release-and-retry; either way the instance goes on */
    h_free_all(h);
    h_reset(h, MT_SCOPE_ALL);
    CHECK_OK(mt_allocator_trim(h->a));
    mti_allocator_fail_backing_after(h->a, 0);
    s = h_alloc(h, 2u << 20, 0, MT_MEM_ACT, MT_LIFE_STEP);
    CHECK(s == MT_OK || s == MT_ERR_OOM);
    CHECK_OKC(h->ctx, h_alloc(h, 2u << 20, 0, MT_MEM_ACT, MT_LIFE_STEP));
    h_check_stats(h);
    h_close(h);
}

TEST(conformance_oom) { each(oom_body); }

/* Out of memory under a limit, then everything freed and trimmed: the
 * instance is as good as new. Blocks of one size are taken until the limit
 * refuses one (an allocator that grows its segments has grown them by
 * then), all are freed and the instance trimmed, a big block is taken, and
 * the room left, 1.5 MiB or one segment of the device's granularity (2 MiB
 * on CUDA), must still serve blocks of the first size and tiny ones of
 * the same class and lifetime. */
static void oom_recovers_body(harness *h, const dcase *d, const acase *c)
{
    const size_t big = 3u << 19, size = 16u << 10, gran = d->host ? 4096 : 2u << 20;
    const size_t limit = (big + gran - 1) / gran * gran + (big > gran ? big : gran);
    h_open(h, d, c, limit, 0, 8);
    int n = 0;
    while (n < 1000 && h_alloc(h, size, 0, MT_MEM_ACT, MT_LIFE_STEP) == MT_OK) n++;
    CHECK_MSG(n < 1000 && n >= 8, "%s: %d blocks of 16 KiB under a limit of %zu", h->name, n,
              limit);
    h_free_all(h);
    h_reset(h, MT_SCOPE_ALL);
    CHECK_OK(mt_allocator_trim(h->a));
    CHECK_OKC(h->ctx, h_alloc(h, big, 0, MT_MEM_PARAM, MT_LIFE_PERSISTENT));
    mt_allocator_stats st;
    CHECK_OK(mt_allocator_get_stats(h->a, &st));
    CHECK_MSG(h_alloc(h, size, 0, MT_MEM_ACT, MT_LIFE_STEP) == MT_OK,
              "%s: 16 KiB refused with %llu of %zu bytes reserved: %s", h->name,
              (unsigned long long)st.reserved_bytes, limit, mt_last_error(h->ctx));
    CHECK_MSG(h_alloc(h, 256, 0, MT_MEM_ACT, MT_LIFE_STEP) == MT_OK,
              "%s: 256 bytes refused: %s", h->name, mt_last_error(h->ctx));
    h_check_stats(h);
    h_close(h);
}

TEST(conformance_oom_recovers) { each(oom_recovers_body); }

static void edge_body(harness *h, const dcase *d, const acase *c)
{
    h_open(h, d, c, 0, 0, 5);
    CHECK(h_alloc(h, 777, 0, MT_MEM_IO, MT_LIFE_STEP) == MT_OK);
    mt_allocator_stats before, after;
    CHECK_OK(mt_allocator_get_stats(h->a, &before));
    mt_block b;
    mt_alloc_request r = {.bytes = 0, .mem_class = MT_MEM_ACT, .lifetime = MT_LIFE_STEP};
    CHECK_OK(mt_alloc(h->a, &r, &b)); /* zero bytes: an empty block */
    CHECK(b.ptr == NULL && b.bytes == 0);
    CHECK_OK(mt_free(h->a, &b));
    r.bytes = SIZE_MAX; /* huge */
    CHECK_ST(MT_ERR_OOM, mt_alloc(h->a, &r, &b));
    CHECK(b.ptr == NULL);
    r.bytes = ((size_t)1 << 50) + 1;
    CHECK_ST(MT_ERR_OOM, mt_alloc(h->a, &r, &b));
    r.bytes = (size_t)1 << 49; /* allowed, but no device has it */
    CHECK_ST(MT_ERR_OOM, mt_alloc(h->a, &r, &b));
    r.bytes = 100;
    r.alignment = 3; /* misaligned requests */
    CHECK_ST(MT_ERR_INVALID_ARG, mt_alloc(h->a, &r, &b));
    r.alignment = (size_t)1 << 31;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_alloc(h->a, &r, &b));
    r.alignment = 0;
    r.mem_class = MT_MEM_COUNT;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_alloc(h->a, &r, &b));
    r.mem_class = MT_MEM_ACT;
    r.lifetime = MT_LIFE_COUNT;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_alloc(h->a, &r, &b));
    r.lifetime = MT_LIFE_STEP;
    r.flags = 0x80;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_alloc(h->a, &r, &b));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_allocator_reset(h->a, (mt_scope)7));
    CHECK_OK(mt_allocator_get_stats(h->a, &after));
    /* only the three impossible sizes count as out-of-memory failures */
    CHECK_EQ(after.n_oom_failures, before.n_oom_failures + 3);
    CHECK_EQ(after.n_alloc, before.n_alloc);
    CHECK_EQ(after.live_bytes, before.live_bytes);
    CHECK(h_alloc(h, 1, 0, MT_MEM_IO, MT_LIFE_STEP) == MT_OK);
    h_check_stats(h);
    h_close(h);
}

TEST(conformance_edge_requests) { each(edge_body); }

static void bad_free_body(harness *h, const dcase *d, const acase *c)
{
    h_open(h, d, c, 0, 0, 6);
    harness other;
    h_open(&other, d, c, 0, 0, 7);
    for (int i = 0; i < 20; i++) {
        CHECK(h_alloc(h, 5000 + (size_t)i * 300, 0, MT_MEM_ACT, MT_LIFE_STEP) == MT_OK);
        CHECK(h_alloc(&other, 5000 + (size_t)i * 300, 0, MT_MEM_ACT, MT_LIFE_STEP) == MT_OK);
    }
    mt_allocator_stats before, after;
    CHECK_OK(mt_allocator_get_stats(h->a, &before));
    /* a made-up block of a class with nothing live: the library itself knows */
    mt_block fake = {.ptr = (void *)(uintptr_t)0x12345600, .bytes = 64, .handle = 99,
                     .mem_class = MT_MEM_OPTIM, .lifetime = MT_LIFE_PERSISTENT};
    CHECK_ST(MT_ERR_BAD_BLOCK, mt_free(h->a, &fake));
    if (c->vt->caps & MT_ALLOCATOR_CAP_DETECTS_BAD_FREE) {
        /* a block of another instance, same class and lifetime */
        CHECK_ST(MT_ERR_BAD_BLOCK, mt_free(h->a, &other.sh.v[3]));
        /* a made-up block that looks like ours */
        mt_block forged = h->sh.v[2];
        forged.ptr = (char *)forged.ptr + 256;
        CHECK_ST(MT_ERR_BAD_BLOCK, mt_free(h->a, &forged));
        forged = h->sh.v[2];
        forged.handle ^= 0x5555;
        CHECK_ST(MT_ERR_BAD_BLOCK, mt_free(h->a, &forged));
        /* a double free */
        mt_block b = h->sh.v[5];
        h_free(h, 5);
        CHECK_OK(mt_allocator_get_stats(h->a, &before));
        CHECK_ST(MT_ERR_BAD_BLOCK, mt_free(h->a, &b));
    }
    CHECK_OK(mt_allocator_get_stats(h->a, &after));
    CHECK_EQ(after.n_free, before.n_free);
    CHECK_EQ(after.live_bytes, before.live_bytes);
    h_check_stats(h);
    CHECK(h_alloc(h, 4096, 0, MT_MEM_ACT, MT_LIFE_STEP) == MT_OK); /* still usable */
    h_close(&other);
    h_close(h);
}

TEST(conformance_bad_free) { each(bad_free_body); }

/* ---- randomized stress ---- */

static size_t random_size(harness *h)
{
    uint64_t r = rnd(h) % 100;
    if (r < 60) return 1 + rnd(h) % (64u << 10);      /* small */
    if (r < 92) return 1 + rnd(h) % (4u << 20);       /* medium */
    return (4u << 20) + rnd(h) % (28u << 20);         /* large */
}

static void stress(harness *h, long ops)
{
    const uint64_t max_live = 512ull << 20;
    for (long op = 0; op < ops; op++) {
        uint64_t r = rnd(h) % 1000;
        if (r < 560 && h->sh.total < max_live && h->sh.n < 4000) {
            size_t bytes = random_size(h);
            size_t align = rnd(h) % 10 == 0 ? (size_t)256 << (rnd(h) % 9) : 0;
            uint64_t lr = rnd(h) % 100;
            mt_lifetime l = lr < 70 ? MT_LIFE_STEP : lr < 85 ? MT_LIFE_PHASE : MT_LIFE_PERSISTENT;
            mt_status s = h_alloc(h, bytes, align, (mt_mem_class)(rnd(h) % MT_MEM_COUNT), l);
            CHECK_MSG(s == MT_OK, "%s: op %ld: %s", h->name, op, mt_last_error(h->ctx));
        } else if (r < 975) {
            if (h->sh.n) h_free(h, (size_t)(rnd(h) % h->sh.n));
        } else if (r < 990) {
            h_reset(h, MT_SCOPE_PHASE);
        } else if (r < 996) {
            h_reset(h, MT_SCOPE_STEP);
        } else {
            CHECK_OK(mt_allocator_trim(h->a));
        }
        if (op % 997 == 0) h_check_stats(h);
    }
    h_check_stats(h);
}

static void stress_body(harness *h, const dcase *d, const acase *c)
{
    long ops = check_long() ? 1000000 : check_light() ? 2000 : 12000;
    /* the checking mode costs a search per call: one seed of it is enough */
    const uint64_t seeds = c->flags & MT_ALLOCATOR_CHECKED ? 1 : 4;
    for (uint64_t seed = 1; seed <= seeds; seed++) {
        h_open(h, d, c, 0, 0, 100 + seed);
        stress(h, ops);
        h_free_all(h);
        CHECK_OK(mt_allocator_trim(h->a));
        h_close(h);
    }
}

TEST(stress_random) { each(stress_body); }

/* ---- threads: every allocator made thread-safe by its config ---- */

typedef struct thread_arg {
    mt_allocator *a;
    uint64_t seed;
    long ops;
    uint64_t n_alloc, n_free;
} thread_arg;

static void *thread_main(void *p)
{
    thread_arg *t = p;
    mt_block live[64];
    int n = 0;
    uint64_t x = t->seed;
    for (long op = 0; op < t->ops; op++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (n < 64 && (x % 2 == 0 || n == 0)) {
            mt_alloc_request r = {.bytes = 1 + (size_t)(x >> 8) % (256u << 10),
                                  .mem_class = (mt_mem_class)(x % MT_MEM_COUNT),
                                  .lifetime = MT_LIFE_PERSISTENT};
            mt_block b;
            mt_status s = mt_alloc(t->a, &r, &b);
            EXPECT(s == MT_OK);
            if (s) break;
            memset(b.ptr, (int)(b.id & 0xFF), b.bytes < 64 ? b.bytes : 64);
            live[n++] = b;
            t->n_alloc++;
        } else {
            int i = (int)((x >> 8) % (uint64_t)n);
            mt_block b = live[i];
            const unsigned char *q = b.ptr;
            for (size_t k = 0; k < (b.bytes < 64 ? b.bytes : 64); k++)
                EXPECT(q[k] == (unsigned char)(b.id & 0xFF));
            EXPECT(mt_free(t->a, &b) == MT_OK);
            live[i] = live[--n];
            t->n_free++;
        }
    }
    while (n) {
        EXPECT(mt_free(t->a, &live[--n]) == MT_OK);
        t->n_free++;
    }
    return NULL;
}

TEST(stress_threads)
{
    acase ac[16];
    int na = allocator_cases(ac);
    mt_context *ctx;
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    long ops = check_long() ? 250000 : check_light() ? 2000 : 20000;
    for (int c = 0; c < na; c++) {
        mt_allocator *a;
        mt_allocator_config conf = {.vtable = ac[c].vt,
                                    .flags = MT_ALLOCATOR_THREAD_SAFE | ac[c].flags};
        CHECK_OKC(ctx, mt_allocator_create(ctx, &conf, &a));
        enum { T = 4 };
        pthread_t th[T];
        thread_arg args[T];
        for (int i = 0; i < T; i++) {
            args[i] = (thread_arg){.a = a, .seed = 0x1234567ull * (uint64_t)(i + 1), .ops = ops};
            CHECK(pthread_create(&th[i], NULL, thread_main, &args[i]) == 0);
        }
        uint64_t na_ = 0, nf = 0;
        for (int i = 0; i < T; i++) {
            pthread_join(th[i], NULL);
            na_ += args[i].n_alloc;
            nf += args[i].n_free;
        }
        mt_allocator_stats st;
        CHECK_OK(mt_allocator_get_stats(a, &st));
        CHECK_MSG(st.n_alloc == na_ && st.n_free == nf && st.live_bytes == 0,
                  "%s: %llu allocs %llu frees %llu live after threads", ac[c].name,
                  (unsigned long long)st.n_alloc, (unsigned long long)st.n_free,
                  (unsigned long long)st.live_bytes);
        mt_allocator_destroy(a);
    }
    CHECK_OK(mt_context_destroy(ctx));
}

/* ---- per-class accounting through a context ---- */

static void context_classes_for(const mt_allocator_vtable *vt, const char *name)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    for (int c = 0; c < MT_MEM_COUNT; c++) cfg.allocators[c].vtable = vt;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    shadow sh;
    shadow_init(&sh);
    uint64_t x = 99;
    for (int i = 0; i < 500; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (sh.n && x % 3 == 0) {
            size_t k = (size_t)(x >> 8) % sh.n;
            CHECK_OKC(ctx, mt_context_free(ctx, &sh.v[k]));
            shadow_remove(&sh, k);
            continue;
        }
        mt_alloc_request r = {.bytes = 1 + (size_t)(x >> 4) % 300000,
                              .mem_class = (mt_mem_class)((x >> 40) % MT_MEM_COUNT),
                              .lifetime = MT_LIFE_STEP};
        mt_block b;
        CHECK_OKC(ctx, mt_context_alloc(ctx, &r, &b));
        CHECK(shadow_add(&sh, &b, NULL));
    }
    mt_memory_stats ms;
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    CHECK_EQ(ms.n_allocators, 1);
    mt_allocator *a;
    CHECK_OK(mt_context_allocator(ctx, MT_MEM_ACT, &a));
    for (int c = 0; c < MT_MEM_COUNT; c++) {
        CHECK_MSG(ms.per_class[c].live_bytes == sh.live[c] &&
                      ms.per_class[c].peak_live_bytes == sh.peak[c] &&
                      ms.per_class[c].n_alloc == sh.n_alloc[c],
                  "%s: class %s: live %llu vs %llu", name, mt_mem_class_name((mt_mem_class)c),
                  (unsigned long long)ms.per_class[c].live_bytes, (unsigned long long)sh.live[c]);
    }
    CHECK_EQ(ms.live_bytes, sh.total);
    CHECK_EQ(ms.peak_live_bytes, sh.total_peak);
    CHECK(ms.reserved_bytes >= ms.live_bytes);
    char report[8192];
    size_t need = 0;
    CHECK_OK(mt_memory_report(ctx, report, sizeof report, &need));
    CHECK_MSG(need > 100 && need < sizeof report && strstr(report, "GRAD") &&
                  strstr(report, mt_allocator_name(a)),
              "%s: report of %zu bytes:\n%.1000s", name, need, report);
    /* the per-step boundary frees step blocks of every class */
    CHECK_OK(mt_allocator_reset(a, MT_SCOPE_STEP));
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    CHECK_EQ(ms.live_bytes, 0);
    shadow_fini(&sh);
    CHECK_OK(mt_context_destroy(ctx));
}

/* The suite as users run it (mt_allocator_conformance): every allocator
 * passes on every device. */
TEST(conformance_public_suite)
{
    acase ac[16];
    dcase dc[2];
    int na = allocator_cases(ac), nd = device_cases(dc);
    for (int d = 0; d < nd; d++)
        for (int c = 0; c < na; c++) {
            if (ac[c].flags & MT_ALLOCATOR_CHECKED) continue; /* the suite checks anyway */
            mt_allocator_config cfg = {.vtable = ac[c].vt, .flags = ac[c].flags};
            mt_status s = mt_allocator_conformance(dc[d].ctx, &cfg);
            CHECK_MSG(s == MT_OK, "%s on %s: %s", ac[c].name, dc[d].name,
                      mt_last_error(dc[d].ctx));
        }
    close_devices(dc, nd);
}

TEST(conformance_context_classes)
{
    acase ac[16];
    int na = allocator_cases(ac);
    for (int c = 0; c < na; c++) context_classes_for(ac[c].vt, ac[c].name);
}
