/*
 * conformance.c - the allocator conformance suite as a library call
 * (mt_allocator_conformance), so that anyone with an installed memtrain can
 * check an allocator of their own against the contract of
 * memtrain/allocator.h.
 *
 * Every property runs on fresh instances made from the caller's config in
 * checking mode (MT_ALLOCATOR_CHECKED), so blocks outside the memory the
 * instance holds and blocks over live ones are caught by the wrapper as
 * they are handed out. Besides, the suite keeps its own list of the live
 * blocks and byte counts per memory class: the library's stats must match
 * it and the allocator's own stats (if it keeps any) the library's. On a
 * CPU context each block's first and last bytes are stamped and checked
 * when it is freed, so an allocator that writes into live blocks is caught
 * too. The first property that fails ends the run; the message names it.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct suite {
    mt_context *ctx;
    mt_allocator_config cfg;
    const char *name, *prop;
    bool host;
    mt_allocator *a;
    mt_block *live;
    size_t n, cap;
    uint64_t rng;
    uint64_t bytes[MT_MEM_COUNT], n_alloc[MT_MEM_COUNT], n_free[MT_MEM_COUNT];
    mt_status failed;
} suite;

static mt_status fail(suite *s, mt_status st, const char *fmt, ...)
{
    char m[MTI_ERR_LEN - 160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    s->failed = st;
    return mti_fail(s->ctx, st, "allocator conformance: '%s': %s: %s", s->name, s->prop, m);
}

/* The library's message of the call that just failed, for a suite message. */
static mt_status fail_call(suite *s, mt_status st, const char *what)
{
    char m[MTI_ERR_LEN - 320];
    snprintf(m, sizeof m, "%s", mt_last_error(s->ctx));
    return fail(s, st, "%s: %s", what, m);
}

static uint64_t rnd(suite *s)
{
    s->rng ^= s->rng << 13;
    s->rng ^= s->rng >> 7;
    s->rng ^= s->rng << 17;
    return s->rng;
}

static mt_status open_inst(suite *s, const char *prop, size_t limit, bool checked, uint64_t seed)
{
    s->prop = prop;
    s->n = 0;
    s->rng = seed * 0x9E3779B97F4A7C15ull + 1;
    memset(s->bytes, 0, sizeof s->bytes);
    memset(s->n_alloc, 0, sizeof s->n_alloc);
    memset(s->n_free, 0, sizeof s->n_free);
    mt_allocator_config c = s->cfg;
    c.limit_bytes = limit;
    c.flags = checked ? c.flags | MT_ALLOCATOR_CHECKED : c.flags & ~MT_ALLOCATOR_CHECKED;
    mt_status st = mt_allocator_create(s->ctx, &c, &s->a);
    if (st) s->a = NULL;
    return st ? fail_call(s, st, "create") : MT_OK;
}

/* Stamps (or checks) a few bytes at each end of a host block. */
static bool stamp(const suite *s, const mt_block *b, bool check)
{
    if (!s->host) return true;
    size_t n = b->bytes / 2 < 16 ? b->bytes / 2 : 16;
    unsigned char *p = b->ptr;
    for (size_t i = 0; i < n; i++) {
        unsigned char v = (unsigned char)(b->id * 31 + i);
        if (!check) p[i] = p[b->bytes - 1 - i] = v;
        else if (p[i] != v || p[b->bytes - 1 - i] != v) return false;
    }
    return true;
}

/* Allocates; *st gets the status. A failure other than out of memory, or a
 * block with wrong fields, fails the suite. */
static mt_status take(suite *s, size_t bytes, size_t align, mt_mem_class c, mt_lifetime l,
                      mt_status *st)
{
    mt_alloc_request r = {.bytes = bytes, .alignment = align, .mem_class = c, .lifetime = l};
    mt_block b;
    *st = mt_alloc(s->a, &r, &b);
    if (*st == MT_ERR_OOM) return MT_OK;
    if (*st) return fail_call(s, *st, "alloc");
    size_t want = align < MT_DEFAULT_ALIGNMENT ? MT_DEFAULT_ALIGNMENT : align;
    if (!b.ptr || ((uintptr_t)b.ptr & (want - 1)) || b.bytes != bytes || b.mem_class != c ||
        b.lifetime != l || !b.id)
        return fail(s, MT_ERR_PLUGIN, "a block of %zu bytes aligned %zu came back as %p, %zu "
                    "bytes", bytes, want, b.ptr, b.bytes);
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 256;
        mt_block *v = realloc(s->live, cap * sizeof *v);
        if (!v) return fail(s, MT_ERR_OOM, "out of host memory");
        s->live = v, s->cap = cap;
    }
    s->live[s->n++] = b;
    s->bytes[c] += bytes, s->n_alloc[c]++;
    stamp(s, &b, false);
    return MT_OK;
}

/* Must succeed. */
static mt_status take_ok(suite *s, size_t bytes, size_t align, mt_mem_class c, mt_lifetime l)
{
    mt_status st, e = take(s, bytes, align, c, l, &st);
    if (e) return e;
    return st ? fail_call(s, st, "an allocation that fits was refused") : MT_OK;
}

static mt_status give(suite *s, size_t i)
{
    mt_block b = s->live[i];
    if (!stamp(s, &b, true))
        return fail(s, MT_ERR_PLUGIN, "block %llu (%zu bytes at %p) was overwritten while live",
                    (unsigned long long)b.id, b.bytes, b.ptr);
    mt_status st = mt_free(s->a, &b);
    if (st) return fail_call(s, st, "free of a live block");
    s->bytes[b.mem_class] -= b.bytes, s->n_free[b.mem_class]++;
    s->live[i] = s->live[--s->n];
    return MT_OK;
}

static mt_status reset(suite *s, mt_scope scope)
{
    mt_status st = mt_allocator_reset(s->a, scope);
    if (st) return fail_call(s, st, "reset");
    size_t k = 0;
    for (size_t i = 0; i < s->n; i++) {
        mt_block *b = &s->live[i];
        if ((int)b->lifetime < (int)scope) {
            if (!stamp(s, b, true))
                return fail(s, MT_ERR_PLUGIN, "block %llu survived a reset overwritten",
                            (unsigned long long)b->id);
            s->live[k++] = *b;
        } else {
            s->bytes[b->mem_class] -= b->bytes, s->n_free[b->mem_class]++;
        }
    }
    s->n = k;
    return MT_OK;
}

/* The library's stats against the suite's counts; the allocator's own
 * (when it keeps any) against the library's. */
static mt_status stats(suite *s)
{
    mt_allocator_stats lib, own;
    mt_allocator_get_stats(s->a, &lib);
    for (int c = 0; c < MT_MEM_COUNT; c++)
        if (lib.per_class[c].live_bytes != s->bytes[c] || lib.per_class[c].n_alloc != s->n_alloc[c] ||
            lib.per_class[c].n_free != s->n_free[c])
            return fail(s, MT_ERR_INTERNAL, "the library counts %llu live bytes of %s, the suite %llu",
                        (unsigned long long)lib.per_class[c].live_bytes,
                        mt_mem_class_name((mt_mem_class)c), (unsigned long long)s->bytes[c]);
    if (mt_allocator_self_stats(s->a, &own) != MT_OK) return MT_OK;
    for (int c = 0; c < MT_MEM_COUNT; c++)
        if (own.per_class[c].live_bytes != lib.per_class[c].live_bytes)
            return fail(s, MT_ERR_PLUGIN, "its own stats say %llu live bytes of %s, the library "
                        "measured %llu", (unsigned long long)own.per_class[c].live_bytes,
                        mt_mem_class_name((mt_mem_class)c),
                        (unsigned long long)lib.per_class[c].live_bytes);
    if (own.reserved_bytes != lib.reserved_bytes || own.peak_reserved_bytes != lib.peak_reserved_bytes ||
        own.n_backing_alloc != lib.n_backing_alloc || own.n_backing_free != lib.n_backing_free)
        return fail(s, MT_ERR_PLUGIN, "its own stats say %llu bytes reserved (peak %llu, %llu/%llu "
                    "backing calls), the library measured %llu (peak %llu, %llu/%llu)",
                    (unsigned long long)own.reserved_bytes, (unsigned long long)own.peak_reserved_bytes,
                    (unsigned long long)own.n_backing_alloc, (unsigned long long)own.n_backing_free,
                    (unsigned long long)lib.reserved_bytes, (unsigned long long)lib.peak_reserved_bytes,
                    (unsigned long long)lib.n_backing_alloc, (unsigned long long)lib.n_backing_free);
    return MT_OK;
}

static mt_status close_inst(suite *s)
{
    mt_status e = MT_OK;
    while (!e && s->n) e = give(s, s->n - 1);
    if (!e) e = stats(s);
    mt_allocator_destroy(s->a);
    s->a = NULL;
    return e;
}

/* ---- the properties; each returns the first failure ---- */

static mt_status p_alignment(suite *s)
{
    static const size_t aligns[] = {0, 1, 16, 256, 512, 4096, 65536, 1u << 20, 1u << 24};
    static const size_t sizes[] = {1, 100, 4096, 100000, 3u << 20};
    mt_status e = open_inst(s, "alignment", 0, true, 1);
    for (size_t i = 0; i < 9 && !e; i++)
        for (size_t j = 0; j < 5 && !e; j++)
            e = take_ok(s, sizes[j], aligns[i], (mt_mem_class)(j % MT_MEM_COUNT),
                        (mt_lifetime)(i % MT_LIFE_COUNT));
    if (!e) e = stats(s);
    return e ? e : close_inst(s);
}

static mt_status p_reset(suite *s)
{
    mt_status e = open_inst(s, "reset", 0, true, 2);
    for (int round = 0; round < 3 && !e; round++) {
        for (int i = 0; i < 30 && !e; i++)
            e = take_ok(s, 1000 + (size_t)i * 4000, 0, (mt_mem_class)(i % MT_MEM_COUNT),
                        (mt_lifetime)(i % MT_LIFE_COUNT));
        if (!e) e = reset(s, MT_SCOPE_PHASE);
        if (!e) e = stats(s);
        if (!e) e = reset(s, MT_SCOPE_STEP);
        if (!e) e = stats(s);
    }
    if (!e) e = reset(s, MT_SCOPE_ALL);
    if (!e) e = stats(s);
    if (!e) e = take_ok(s, 12345, 0, MT_MEM_ACT, MT_LIFE_STEP);
    return e ? e : close_inst(s);
}

static mt_status p_trim(suite *s)
{
    mt_status e = open_inst(s, "trim", 0, true, 3);
    for (int i = 0; i < 200 && !e; i++)
        e = take_ok(s, 1 + rnd(s) % (3u << 20), 0, MT_MEM_ACT,
                    (mt_lifetime)(rnd(s) % MT_LIFE_COUNT));
    for (size_t i = s->n; i-- > 0 && !e;)
        if (i % 2) e = give(s, i);
    if (!e && mt_allocator_trim(s->a)) e = fail_call(s, MT_ERR_PLUGIN, "trim");
    if (!e) e = stats(s);
    while (!e && s->n) e = give(s, s->n - 1);
    if (!e) e = reset(s, MT_SCOPE_ALL);
    if (!e && mt_allocator_trim(s->a)) e = fail_call(s, MT_ERR_PLUGIN, "trim");
    mt_allocator_stats st;
    if (!e && s->cfg.vtable->trim && mt_allocator_get_stats(s->a, &st) == MT_OK && st.reserved_bytes)
        e = fail(s, MT_ERR_PLUGIN, "%llu bytes still reserved with nothing live after trim",
                 (unsigned long long)st.reserved_bytes);
    return e ? e : close_inst(s);
}

static mt_status p_oom(suite *s)
{
    const size_t limit = 16u << 20;
    mt_status st = MT_OK, e = open_inst(s, "out of memory under a limit", limit, true, 4);
    int n = 0;
    while (!e && n < 64 && !(e = take(s, 1u << 20, 0, MT_MEM_GRAD, MT_LIFE_STEP, &st)) && !st) n++;
    if (!e && (st != MT_ERR_OOM || n < 4))
        e = fail(s, MT_ERR_PLUGIN, "%d blocks of 1 MiB fit under a 16 MiB limit", n);
    if (!e) e = take(s, limit + 1, 0, MT_MEM_ACT, MT_LIFE_STEP, &st);
    if (!e && st != MT_ERR_OOM) e = fail(s, MT_ERR_PLUGIN, "more than the limit was served");
    for (size_t i = s->n; i-- > 0 && !e;)
        if (i % 2 == 0) e = give(s, i);
    if (!e) e = take_ok(s, 1u << 20, 0, MT_MEM_GRAD, MT_LIFE_STEP);
    if (!e) e = stats(s);
    return e || !s->a ? e : close_inst(s);
}

/* After out of memory, everything freed and trimmed, the room left under
 * the limit serves what fits (one segment of the device's granularity). */
static mt_status p_recovers(suite *s)
{
    const size_t big = 3u << 19, size = 16u << 10;
    const size_t gran = mt_context_device(s->ctx) == MT_DEVICE_CUDA ? 2u << 20 : 4096;
    const size_t limit = (big + gran - 1) / gran * gran + (big > gran ? big : gran);
    mt_status st = MT_OK, e = open_inst(s, "recovery after out of memory", limit, true, 8);
    int n = 0;
    while (!e && n < 1000 && !(e = take(s, size, 0, MT_MEM_ACT, MT_LIFE_STEP, &st)) && !st) n++;
    while (!e && s->n) e = give(s, s->n - 1);
    if (!e) e = reset(s, MT_SCOPE_ALL);
    if (!e && mt_allocator_trim(s->a)) e = fail_call(s, MT_ERR_PLUGIN, "trim");
    if (!e) e = take_ok(s, big, 0, MT_MEM_PARAM, MT_LIFE_PERSISTENT);
    if (!e) e = take_ok(s, size, 0, MT_MEM_ACT, MT_LIFE_STEP);
    if (!e) e = take_ok(s, 256, 0, MT_MEM_ACT, MT_LIFE_STEP);
    return e || !s->a ? e : close_inst(s);
}

static mt_status p_edges(suite *s)
{
    static const size_t huge[] = {SIZE_MAX, ((size_t)1 << 50) + 1, (size_t)1 << 49};
    mt_status st = MT_OK, e = open_inst(s, "edge-case requests", 0, true, 5);
    if (!e) e = take_ok(s, 777, 0, MT_MEM_IO, MT_LIFE_STEP);
    for (int i = 0; i < 3 && !e; i++) {
        e = take(s, huge[i], 0, MT_MEM_ACT, MT_LIFE_STEP, &st);
        if (!e && st != MT_ERR_OOM)
            e = fail(s, MT_ERR_PLUGIN, "%zu bytes: %s, not out of memory", huge[i],
                     mt_status_string(st));
    }
    if (!e) e = take_ok(s, 1, 0, MT_MEM_IO, MT_LIFE_STEP);
    if (!e) e = stats(s);
    return e || !s->a ? e : close_inst(s);
}

/* Only for a table that claims MT_ALLOCATOR_CAP_DETECTS_BAD_FREE, on an
 * instance without the checking mode (which would catch them first). */
static mt_status p_bad_frees(suite *s)
{
    if (!(s->cfg.vtable->caps & MT_ALLOCATOR_CAP_DETECTS_BAD_FREE)) return MT_OK;
    mt_status e = open_inst(s, "bad frees", 0, false, 6);
    for (int i = 0; i < 20 && !e; i++) e = take_ok(s, 5000 + (size_t)i * 300, 0, MT_MEM_ACT, MT_LIFE_STEP);
    if (e) return e;
    mt_block forged[3] = {s->live[2], s->live[2], s->live[5]};
    forged[0].ptr = (char *)forged[0].ptr + 256;
    forged[1].handle ^= 0x5555;
    e = give(s, 5); /* forged[2] is then a double free */
    for (int i = 0; i < 3 && !e; i++) {
        mt_status st = mt_free(s->a, &forged[i]);
        if (st != MT_ERR_BAD_BLOCK)
            e = fail(s, MT_ERR_PLUGIN, "%s was %s, not MT_ERR_BAD_BLOCK",
                     i == 0 ? "a free at a moved address" : i == 1 ? "a free with a changed handle"
                                                               : "a double free",
                     mt_status_string(st));
    }
    if (!e) e = stats(s);
    return e || !s->a ? e : close_inst(s);
}

static mt_status p_random(suite *s, uint64_t seed)
{
    mt_status st, e = open_inst(s, "randomized operations", 0, true, seed);
    for (long op = 0; op < 10000 && !e; op++) {
        uint64_t r = rnd(s) % 100;
        if (r < 55 || s->n == 0) {
            size_t bytes = (size_t)1 << (rnd(s) % 22), align = (size_t)1 << (rnd(s) % 17);
            bytes += rnd(s) % bytes;
            e = take(s, bytes, rnd(s) % 4 ? 0 : align, (mt_mem_class)(rnd(s) % MT_MEM_COUNT),
                     (mt_lifetime)(rnd(s) % MT_LIFE_COUNT), &st);
            if (!e && st) e = fail_call(s, st, "an allocation with no limit");
        } else if (r < 97) {
            e = give(s, (size_t)(rnd(s) % s->n));
        } else if (r < 99) {
            e = reset(s, (mt_scope)(1 + rnd(s) % 2));
        } else if (mt_allocator_trim(s->a)) {
            e = fail_call(s, MT_ERR_PLUGIN, "trim");
        }
        if (!e && op % 1000 == 999) e = stats(s);
    }
    return e || !s->a ? e : close_inst(s);
}

mt_status mt_allocator_conformance(mt_context *ctx, const mt_allocator_config *cfg)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_allocator_conformance: ctx is NULL");
    if (!cfg || !cfg->vtable)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_allocator_conformance: %s is NULL",
                        cfg ? "cfg->vtable" : "cfg");
    suite s = {.ctx = ctx, .cfg = *cfg, .name = cfg->vtable->name ? cfg->vtable->name : "?",
               .prop = "create", .host = mt_context_device(ctx) == MT_DEVICE_CPU && !ctx->dry};
    mt_status e = p_alignment(&s);
    if (!e) e = p_reset(&s);
    if (!e) e = p_trim(&s);
    if (!e) e = p_oom(&s);
    if (!e) e = p_recovers(&s);
    if (!e) e = p_edges(&s);
    if (!e) e = p_bad_frees(&s);
    for (uint64_t seed = 11; seed < 14 && !e; seed++) e = p_random(&s, seed);
    if (s.a) mt_allocator_destroy(s.a);
    free(s.live);
    return e;
}
