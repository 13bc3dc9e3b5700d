/*
 * allocator.c - the library's wrapper around every allocator instance.
 *
 * The wrapper is what makes a plug-in trustworthy: it checks requests before
 * they reach the allocator, hands the allocator a backing that counts every
 * byte taken from the device (and enforces the instance's limit), keeps its
 * own per-class accounting of live bytes, takes the lock of thread-safe
 * instances, records trace events, and on destroy gives back whatever the
 * allocator forgot to.
 */
#include <stdlib.h>
#include <string.h>

#include "memory/alloc_check.h"
#include "internal.h"
#include "memory/resv.h"

typedef struct va_range {
    void *base;
    size_t bytes;
    size_t committed;
} va_range;

/* The part of an instance the wrapper alone uses, kept after struct
 * mt_allocator in the same allocation. */
typedef struct wrap_extra {
    mti_resv_table resv;
    va_range *va;
    size_t n_va, cap_va;
    char why[MTI_ERR_LEN]; /* reason of the last backing failure */
    mti_checker *check;    /* MT_ALLOCATOR_CHECKED: what the instance holds and hands out */
    char fault[256];       /* checked: a backing call that was refused, for the next alloc */
} wrap_extra;

static wrap_extra *extra_of(mt_allocator *a) { return (wrap_extra *)(a + 1); }

/* ---- context-wide totals (all instances of a context together) ---- */

/* Adds n to *cur, raising *peak; true when this call set a new peak. */
static bool ctx_add(_Atomic uint64_t *cur, _Atomic uint64_t *peak, uint64_t n)
{
    uint64_t v = atomic_fetch_add(cur, n) + n;
    uint64_t p = atomic_load(peak);
    while (v > p) {
        if (atomic_compare_exchange_weak(peak, &p, v)) return true;
    }
    return false;
}

/* A dry context (one thread, lib/engine/estimate.c) notes what each class holds
 * at each new peak, so an estimate can say what the peak is made of. */
static void note_at_peak(mt_context *ctx)
{
    memset(ctx->at_peak, 0, sizeof ctx->at_peak);
    for (int i = 0; i < ctx->n_inst; i++)
        for (int c = 0; c < MT_MEM_COUNT; c++)
            ctx->at_peak[c] += ctx->inst[i]->st.per_class[c].live_bytes;
}

/* ---- the backing handed to the allocator ---- */

static mt_status backing_fail(mt_allocator *a, mt_status s, const char *msg)
{
    wrap_extra *x = extra_of(a);
    a->n_backing_fails++;
    if (msg != x->why) snprintf(x->why, sizeof x->why, "%s", msg);
    return s;
}

/* Refusals at an instance's limit on this thread: how the planner
 * (plan.c) tells a plan whose run passes a limit from other failures. */
static _Thread_local uint64_t limit_refusals;

uint64_t mti_limit_refusals(void) { return limit_refusals; }

/* Fault injection and the limit, before any device call. */
static mt_status backing_admit(mt_allocator *a, size_t bytes)
{
    if (a->fail_backing_in == 0) {
        a->fail_backing_in = -1;
        return backing_fail(a, MT_ERR_OOM, "injected backing failure");
    }
    if (a->fail_backing_in > 0) a->fail_backing_in--;
    if (a->cfg.limit_bytes && (bytes > a->cfg.limit_bytes ||
                               a->st.reserved_bytes > a->cfg.limit_bytes - bytes)) {
        char m[256];
        limit_refusals++;
        snprintf(m, sizeof m, "the instance's limit of %zu bytes is reached (%llu reserved)",
                 a->cfg.limit_bytes, (unsigned long long)a->st.reserved_bytes);
        return backing_fail(a, MT_ERR_OOM, m);
    }
    return MT_OK;
}

static void note_reserved(mt_allocator *a, size_t bytes)
{
    mt_stats_on_reserve(&a->st, bytes);
    if (a->index >= 0) ctx_add(&a->ctx->reserved_total, &a->ctx->reserved_peak, bytes);
}

static void note_released(mt_allocator *a, size_t bytes)
{
    mt_stats_on_release(&a->st, bytes);
    if (a->index >= 0) atomic_fetch_sub(&a->ctx->reserved_total, bytes);
}

static mt_status backing_reserve(void *self, size_t bytes, size_t alignment, void **ptr,
                                 size_t *granted)
{
    mt_allocator *a = self;
    mti_device *d = a->ctx->dev;
    if (!ptr || !granted || bytes == 0 || (alignment && !mti_is_pow2(alignment)))
        return backing_fail(a, MT_ERR_INVALID_ARG, "backing reserve: bad arguments");
    mt_status s = backing_admit(a, bytes);
    if (s) return s;
    void *p = NULL;
    size_t g = 0;
    s = d->mem_reserve(d, bytes, alignment ? alignment : d->min_alignment, &p, &g);
    if (s) return backing_fail(a, s, mt_last_error(a->ctx));
    if (a->cfg.limit_bytes && a->st.reserved_bytes + g > a->cfg.limit_bytes) {
        d->mem_release(d, p, g);
        return backing_admit(a, g); /* fails with the limit message */
    }
    if (!mti_resv_insert(&extra_of(a)->resv, (uintptr_t)p, g)) {
        d->mem_release(d, p, g);
        return backing_fail(a, MT_ERR_OOM, "out of host memory for bookkeeping");
    }
    if (extra_of(a)->check && !mti_checker_back(extra_of(a)->check, p, g)) {
        mti_resv_remove(&extra_of(a)->resv, (uintptr_t)p);
        d->mem_release(d, p, g);
        return backing_fail(a, MT_ERR_OOM, "out of host memory for bookkeeping");
    }
    note_reserved(a, g);
    *ptr = p;
    *granted = g;
    return MT_OK;
}

/* Checked instances: memory given back under a live block would leave the
 * block dangling, so the call is refused (the memory stays until destroy)
 * and the next allocation says why. */
static bool refuse_unback(mt_allocator *a, const char *what, const void *p, size_t n)
{
    wrap_extra *x = extra_of(a);
    uint64_t id;
    if (!x->check) return false;
    if (!mti_checker_live_within(x->check, p, n, &id)) {
        mti_checker_unback(x->check, p, n);
        return false;
    }
    snprintf(x->fault, sizeof x->fault,
             "it %s %zu bytes at %p while block %llu in them was live (kept until destroy)",
             what, n, p, (unsigned long long)id);
    mti_log(a->ctx, MT_LOG_ERROR, "allocator '%s': %s", a->vt->name, x->fault);
    return true;
}

/* Whether [p, p + n) holds memory a collective that timed out may still
 * write (mt_context.kept): such a reservation is never given back to
 * the device, so a late completion writes into memory no one else has. Only
 * after a failure; the leak is the reservation holding the staging. */
static bool kept(const mt_allocator *a, const void *p, size_t n)
{
    const mt_context *c = a->ctx;
    const uintptr_t lo = (uintptr_t)c->kept, q = (uintptr_t)p;
    return c->kept_bytes && q < lo + c->kept_bytes && lo < q + n;
}

static void backing_release(void *self, void *ptr, size_t granted)
{
    mt_allocator *a = self;
    size_t held = mti_resv_find(&extra_of(a)->resv, (uintptr_t)ptr);
    if (held && refuse_unback(a, "released", ptr, held)) return;
    size_t g = mti_resv_remove(&extra_of(a)->resv, (uintptr_t)ptr);
    if (!g) {
        mti_log(a->ctx, MT_LOG_ERROR, "allocator '%s' released %p, which it does not hold",
                a->vt->name, ptr);
        return;
    }
    if (g != granted)
        mti_log(a->ctx, MT_LOG_WARN, "allocator '%s' released %p with size %zu, not %zu",
                a->vt->name, ptr, granted, g);
    if (!kept(a, ptr, g)) a->ctx->dev->mem_release(a->ctx->dev, ptr, g);
    note_released(a, g);
}

static va_range *va_find(mt_allocator *a, const void *addr, size_t bytes)
{
    wrap_extra *x = extra_of(a);
    uintptr_t p = (uintptr_t)addr;
    for (size_t i = 0; i < x->n_va; i++) {
        uintptr_t b = (uintptr_t)x->va[i].base;
        if (p >= b && p - b <= x->va[i].bytes && bytes <= x->va[i].bytes - (p - b))
            return &x->va[i];
    }
    return NULL;
}

static mt_status backing_va_reserve(void *self, size_t bytes, void **base)
{
    mt_allocator *a = self;
    wrap_extra *x = extra_of(a);
    mti_device *d = a->ctx->dev;
    if (!base || bytes == 0 || bytes % d->granularity)
        return backing_fail(a, MT_ERR_INVALID_ARG, "va_reserve: size not a granularity multiple");
    if (x->n_va == x->cap_va) {
        size_t nc = x->cap_va ? 2 * x->cap_va : 8;
        va_range *nv = realloc(x->va, nc * sizeof *nv);
        if (!nv) return backing_fail(a, MT_ERR_OOM, "out of host memory for bookkeeping");
        x->va = nv;
        x->cap_va = nc;
    }
    void *b = NULL;
    mt_status s = d->va_reserve(d, bytes, &b);
    if (s) return backing_fail(a, s, mt_last_error(a->ctx));
    x->va[x->n_va++] = (va_range){b, bytes, 0};
    *base = b;
    return MT_OK;
}

static mt_status backing_va_commit(void *self, void *addr, size_t bytes)
{
    mt_allocator *a = self;
    mti_device *d = a->ctx->dev;
    va_range *r = va_find(a, addr, bytes);
    if (!r || bytes == 0 || bytes % d->granularity ||
        ((uintptr_t)addr - (uintptr_t)r->base) % d->granularity)
        return backing_fail(a, MT_ERR_INVALID_ARG, "va_commit: range not inside a reservation");
    mt_status s = backing_admit(a, bytes);
    if (s) return s;
    s = d->va_commit(d, addr, bytes);
    if (s) return backing_fail(a, s, mt_last_error(a->ctx));
    if (extra_of(a)->check && !mti_checker_back(extra_of(a)->check, addr, bytes)) {
        d->va_decommit(d, addr, bytes);
        return backing_fail(a, MT_ERR_OOM, "out of host memory for bookkeeping");
    }
    r->committed += bytes;
    note_reserved(a, bytes);
    return MT_OK;
}

static void backing_va_decommit(void *self, void *addr, size_t bytes)
{
    mt_allocator *a = self;
    va_range *r = va_find(a, addr, bytes);
    if (!r || bytes > r->committed) {
        mti_log(a->ctx, MT_LOG_ERROR, "allocator '%s' decommitted %zu bytes at %p it did not commit",
                a->vt->name, bytes, addr);
        return;
    }
    if (refuse_unback(a, "decommitted", addr, bytes)) return;
    if (!kept(a, addr, bytes)) a->ctx->dev->va_decommit(a->ctx->dev, addr, bytes);
    r->committed -= bytes;
    note_released(a, bytes);
}

static void va_drop(mt_allocator *a, size_t i)
{
    wrap_extra *x = extra_of(a);
    va_range *r = &x->va[i];
    const bool keep = kept(a, r->base, r->bytes);
    if (r->committed) {
        /* whatever is still committed goes with the range */
        if (!keep) a->ctx->dev->va_decommit(a->ctx->dev, r->base, r->bytes);
        note_released(a, r->committed);
    }
    if (!keep) a->ctx->dev->va_release(a->ctx->dev, r->base, r->bytes);
    x->va[i] = x->va[--x->n_va];
}

static void backing_va_release(void *self, void *base, size_t bytes)
{
    mt_allocator *a = self;
    wrap_extra *x = extra_of(a);
    for (size_t i = 0; i < x->n_va; i++) {
        if (x->va[i].base == base && x->va[i].bytes == bytes) {
            if (refuse_unback(a, "released a range of", base, bytes)) return;
            va_drop(a, i);
            return;
        }
    }
    mti_log(a->ctx, MT_LOG_ERROR, "allocator '%s' released a range at %p it does not hold",
            a->vt->name, base);
}

/* ---- instances ---- */

static mt_status check_vtable(mt_context *ctx, const mt_allocator_vtable *vt)
{
    if (vt->abi_version != MT_ALLOCATOR_ABI_VERSION)
        return mti_fail(ctx, MT_ERR_VERSION,
                        "allocator table '%s' has ABI version %u; this library speaks %u",
                        vt->name ? vt->name : "?", vt->abi_version, MT_ALLOCATOR_ABI_VERSION);
    if (vt->struct_size < sizeof(mt_allocator_vtable))
        return mti_fail(ctx, MT_ERR_VERSION, "allocator table '%s' is %u bytes, expected %zu",
                        vt->name ? vt->name : "?", vt->struct_size, sizeof(mt_allocator_vtable));
    if (!vt->name || !vt->create || !vt->alloc || !vt->free || !vt->reset || !vt->destroy)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "allocator table '%s' lacks a name or one of create, alloc, free, "
                        "reset, destroy",
                        vt->name ? vt->name : "?");
    return MT_OK;
}

mt_status mti_allocator_new(mt_context *ctx, const mt_allocator_config *cfg, int index,
                            mt_allocator **out)
{
    mt_allocator_config c = {0};
    if (cfg) c = *cfg;
    if (!c.vtable) c.vtable = mt_allocator_caching();
    const uint32_t known = MT_ALLOCATOR_THREAD_SAFE | MT_ALLOCATOR_CHECKED;
    if (c.flags & ~known)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "allocator config: unknown flags 0x%x",
                        c.flags & ~known);
    mt_status s = check_vtable(ctx, c.vtable);
    if (s) return s;

    mt_allocator *a = calloc(1, sizeof *a + sizeof(wrap_extra));
    if (!a) return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    a->ctx = ctx;
    a->vt = c.vtable;
    a->cfg = c;
    a->index = index;
    a->fail_backing_in = -1;
    a->locked = (c.flags & MT_ALLOCATOR_THREAD_SAFE) != 0;
    if ((c.flags & MT_ALLOCATOR_CHECKED) && !(extra_of(a)->check = mti_checker_new())) {
        free(a);
        return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    }
    if (a->locked) pthread_mutex_init(&a->mu, NULL);

    mti_device *d = ctx->dev;
    a->backing = (mt_backing){
        .abi_version = MT_ALLOCATOR_ABI_VERSION,
        .device = d->kind,
        .min_alignment = d->min_alignment,
        .granularity = d->granularity,
        .self = a,
        .reserve = backing_reserve,
        .release = backing_release,
    };
    if (d->va_reserve && d->va_commit && d->va_decommit && d->va_release) {
        a->backing.va_reserve = backing_va_reserve;
        a->backing.va_commit = backing_va_commit;
        a->backing.va_decommit = backing_va_decommit;
        a->backing.va_release = backing_va_release;
    }
    mt_allocator_params params = {.struct_size = sizeof params,
                                  .options = c.options,
                                  .flags = c.flags,
                                  .limit_bytes = c.limit_bytes};
    s = c.vtable->create(&params, &a->backing, &a->state);
    if (s) {
        char why[MTI_ERR_LEN];
        snprintf(why, sizeof why, "%s", a->n_backing_fails ? extra_of(a)->why : "");
        mti_allocator_delete(a);
        return mti_fail(ctx, s, "allocator '%s' could not be created: %s%s%s%s", c.vtable->name,
                        mt_status_string(s), why[0] ? ": " : "", why,
                        s == MT_ERR_INVALID_ARG && c.options
                            ? " (check its options: sizes, and struct_size as set by its "
                              "_options_init function)"
                            : "");
    }
    *out = a;
    return MT_OK;
}

void mti_allocator_delete(mt_allocator *a)
{
    if (!a) return;
    /* destroy gives back memory under live blocks: they end here */
    if (extra_of(a)->check) mti_checker_reset(extra_of(a)->check, MT_SCOPE_ALL);
    if (a->state) a->vt->destroy(a->state);
    a->state = NULL;
    wrap_extra *x = extra_of(a);
    /* give back whatever the allocator did not */
    size_t leaked = 0;
    for (size_t i = 0; i < x->resv.cap; i++) {
        mti_resv_slot *sl = &x->resv.slots[i];
        if (sl->ptr <= 1) continue;
        if (!kept(a, (void *)sl->ptr, sl->granted))
            a->ctx->dev->mem_release(a->ctx->dev, (void *)sl->ptr, sl->granted);
        note_released(a, sl->granted);
        leaked += sl->granted;
    }
    while (x->n_va) {
        leaked += x->va[0].committed;
        va_drop(a, 0);
    }
    if (leaked)
        mti_log(a->ctx, MT_LOG_WARN, "allocator '%s' kept %zu bytes after destroy; given back",
                a->vt->name, leaked);
    if (a->index >= 0) atomic_fetch_sub(&a->ctx->live_total, a->st.live_bytes);
    free(x->resv.slots);
    free(x->va);
    mti_checker_delete(x->check);
    if (a->locked) pthread_mutex_destroy(&a->mu);
    free(a);
}

void mti_allocator_fail_backing_after(mt_allocator *a, long n) { a->fail_backing_in = n; }

static inline void lock(mt_allocator *a)
{
    if (a->locked) pthread_mutex_lock(&a->mu);
}
static inline void unlock(mt_allocator *a)
{
    if (a->locked) pthread_mutex_unlock(&a->mu);
}

static void trace_event(mt_allocator *a, mt_trace_op op, const mt_alloc_request *req,
                        const mt_block *blk, int scope)
{
    mt_trace *t = a->trace;
    if (!t || !t->recording) return;
    mt_trace_event ev = {0};
    ev.t_ns = mti_now_ns() - t->t0_ns;
    ev.op = (uint8_t)op;
    ev.instance = (uint8_t)(a->index < 0 ? 0 : a->index);
    if (req) {
        ev.bytes = req->bytes;
        ev.tag = req->tag;
        ev.alignment = (uint32_t)req->alignment;
        ev.mem_class = (uint8_t)req->mem_class;
        ev.lifetime = (uint8_t)req->lifetime;
        ev.flags = (uint8_t)req->flags;
    }
    if (blk) {
        ev.id = blk->id;
        ev.bytes = blk->bytes;
        ev.mem_class = (uint8_t)blk->mem_class;
        ev.lifetime = (uint8_t)blk->lifetime;
    }
    ev.scope = (uint8_t)scope;
    mti_trace_record(t, &ev);
}

/* ---- public API ---- */

mt_status mt_allocator_create(mt_context *ctx, const mt_allocator_config *cfg, mt_allocator **out)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_allocator_create: ctx is NULL");
    if (!out) return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_allocator_create: out is NULL");
    mt_status s = mti_allocator_new(ctx, cfg, -1, out);
    if (s == MT_OK) atomic_fetch_add(&ctx->n_children, 1);
    return s;
}

void mt_allocator_destroy(mt_allocator *a)
{
    if (!a) return;
    if (a->index >= 0) {
        mti_log(a->ctx, MT_LOG_ERROR, "mt_allocator_destroy: instance belongs to the context");
        return;
    }
    mt_context *ctx = a->ctx;
    mti_allocator_delete(a);
    atomic_fetch_sub(&ctx->n_children, 1);
}

mt_status mt_context_allocator(mt_context *ctx, mt_mem_class c, mt_allocator **out)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_allocator: ctx is NULL");
    if (!out) return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_context_allocator: out is NULL");
    if ((unsigned)c >= MT_MEM_COUNT)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_context_allocator: memory class %d out of range",
                        (int)c);
    *out = ctx->by_class[c];
    return MT_OK;
}

const char *mt_allocator_name(const mt_allocator *a) { return a ? a->vt->name : "?"; }

/* The rare paths of mt_alloc and mt_free, kept out of line so the common
 * path stays a handful of loads and stores around the allocator's call. */

#define COLD MTI_COLD
#define LIKELY(x) MTI_LIKELY(x)

static COLD mt_status alloc_refused(mt_allocator *a, const mt_alloc_request *req, mt_block *out)
{
    mt_context *ctx = a ? a->ctx : NULL;
    if (out) memset(out, 0, sizeof *out);
    if (!a) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_alloc: allocator is NULL");
    if (!req || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_alloc: %s is NULL", req ? "out" : "req");
    if ((unsigned)req->mem_class >= MT_MEM_COUNT)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_alloc: memory class %d out of range",
                        (int)req->mem_class);
    if ((unsigned)req->lifetime >= MT_LIFE_COUNT)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_alloc: lifetime %d out of range",
                        (int)req->lifetime);
    if (req->flags & ~MT_REQ_RECOMPUTABLE)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_alloc: unknown request flags 0x%x",
                        req->flags & ~MT_REQ_RECOMPUTABLE);
    if (req->alignment & (req->alignment - 1) || req->alignment > MT_MAX_ALIGNMENT)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "mt_alloc: alignment %zu is not a power of two up to 2^30",
                        req->alignment);
    /* only a size beyond any device is left */
    lock(a);
    mt_stats_on_oom(&a->st, req->mem_class);
    trace_event(a, MT_TRACE_FAIL, req, NULL, 0);
    unlock(a);
    return mti_fail(ctx, MT_ERR_OOM, "allocator '%s': %zu bytes of %s: larger than any "
                    "allocation can be (2^50 bytes)",
                    a->vt->name, req->bytes, mt_mem_class_name(req->mem_class));
}

/* The allocator said no (s != MT_OK), or broke rule 3: a NULL or
 * misaligned address, or in checking mode a block outside the memory it
 * holds or over a live one (s MT_ERR_PLUGIN); or, in checking mode, it gave
 * back memory under a live block since the last call. The fault (the
 * wrapper's fault text, else the address's) is blamed on the plug-in; a
 * block it handed out is given back to it. Called locked. */
static COLD mt_status alloc_failed(mt_allocator *a, const mt_alloc_request *r, mt_block *out,
                                   mt_status s, uint64_t fails_before, bool handed)
{
    wrap_extra *x = extra_of(a);
    mt_block bad = *out;
    if (handed && bad.ptr) {
        bad.bytes = r->bytes;
        bad.mem_class = r->mem_class;
        bad.lifetime = r->lifetime;
        a->vt->free(a->state, &bad);
    }
    if ((handed && s == MT_OK) || x->fault[0]) {
        char m[MTI_ERR_LEN];
        if (handed && s == MT_ERR_OOM) { /* the checking mode's own records */
            snprintf(m, sizeof m, "%s", x->fault);
        } else {
            snprintf(m, sizeof m, "%s (a fault of the plug-in allocator, not of memtrain)",
                     x->fault[0] ? x->fault
                     : bad.ptr   ? "the allocator returned a misaligned address"
                                 : "the allocator returned NULL with success");
            s = MT_ERR_PLUGIN;
        }
        backing_fail(a, s, m);
        x->fault[0] = 0;
    }
    if (s == MT_ERR_OOM) mt_stats_on_oom(&a->st, r->mem_class);
    trace_event(a, MT_TRACE_FAIL, r, NULL, 0);
    char why[MTI_ERR_LEN];
    /* the backing's reason, if it failed during this call */
    snprintf(why, sizeof why, "%s",
             a->n_backing_fails != fails_before ? extra_of(a)->why : mt_status_string(s));
    unlock(a);
    memset(out, 0, sizeof *out);
    return mti_fail(a->ctx, s, "allocator '%s': %zu bytes of %s: %s", a->vt->name, r->bytes,
                    mt_mem_class_name(r->mem_class), why);
}

/* Checking mode: the block must lie in held memory and overlap no live
 * block; a refused release since the last call is reported here too. */
static COLD mt_status alloc_check(mt_allocator *a, const mt_block *b)
{
    wrap_extra *x = extra_of(a);
    if (x->fault[0]) return MT_ERR_PLUGIN;
    char why[sizeof x->fault - 8];
    mt_status s = mti_checker_add_block(x->check, b, why, sizeof why);
    if (s) snprintf(x->fault, sizeof x->fault, s == MT_ERR_OOM ? "%s" : "it %s", why);
    return s;
}

mt_status mt_alloc(mt_allocator *a, const mt_alloc_request *req, mt_block *out)
{
    if (!a || !req || !out || (unsigned)req->mem_class >= MT_MEM_COUNT ||
        (unsigned)req->lifetime >= MT_LIFE_COUNT || (req->flags & ~MT_REQ_RECOMPUTABLE) ||
        (req->alignment & (req->alignment - 1)) || req->alignment > MT_MAX_ALIGNMENT ||
        req->bytes > MT_MAX_REQUEST)
        return alloc_refused(a, req, out);
    if (req->bytes == 0) { /* an empty block; the allocator never sees it */
        *out = (mt_block){.mem_class = req->mem_class, .lifetime = req->lifetime};
        return MT_OK;
    }
    /* The caller's request goes to the allocator as it is unless its
     * alignment must be raised: copying it on every call would cost more
     * (the copy reads what the caller has just written) than the check. */
    mt_alloc_request raised;
    const mt_alloc_request *r = req;
    if (req->alignment < MT_DEFAULT_ALIGNMENT) {
        raised = *req;
        raised.alignment = MT_DEFAULT_ALIGNMENT;
        r = &raised;
    }
    lock(a);
    uint64_t fails = a->n_backing_fails;
    mt_status s = a->vt->alloc(a->state, r, out);
    if (!LIKELY(s == MT_OK && out->ptr && ((uintptr_t)out->ptr & (r->alignment - 1)) == 0))
        return alloc_failed(a, r, out, s, fails, s == MT_OK);
    const size_t bytes = r->bytes;
    const mt_mem_class c = r->mem_class;
    const mt_lifetime l = r->lifetime;
    out->bytes = bytes;
    out->id = a->next_id + 1;
    out->mem_class = c;
    out->lifetime = l;
    if (!LIKELY(extra_of(a)->check == NULL) && (s = alloc_check(a, out)) != MT_OK)
        return alloc_failed(a, r, out, s, fails, true);
    a->next_id++;
    mt_stats_on_alloc(&a->st, c, bytes);
    a->live_by_life[l][c] += bytes;
    a->blocks_by_life[l][c]++;
    if (a->index >= 0 && ctx_add(&a->ctx->live_total, &a->ctx->live_peak, bytes) && a->ctx->dry)
        note_at_peak(a->ctx);
    if (a->trace) trace_event(a, MT_TRACE_ALLOC, r, out, 0);
    unlock(a);
    return MT_OK;
}

static COLD mt_status free_refused(mt_allocator *a, const mt_block *blk, mt_status s)
{
    if (!a) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_free: allocator is NULL");
    if (!blk) return mti_fail(a->ctx, MT_ERR_INVALID_ARG, "mt_free: block is NULL");
    if (s == MT_ERR_BAD_BLOCK)
        return mti_fail(a->ctx, s,
                        "mt_free: block %p (%zu bytes of %s) is not live in allocator '%s': "
                        "foreign or already freed",
                        blk->ptr, blk->bytes, mt_mem_class_name(blk->mem_class), a->vt->name);
    return mti_fail(a->ctx, s, "mt_free: allocator '%s' failed: %s", a->vt->name,
                    mt_status_string(s));
}

/* Checking mode: only a block live as handed out reaches the allocator
 * (its record goes first: the allocator may give back the memory under
 * it). Called locked. */
static COLD mt_status free_checked(mt_allocator *a, const mt_block *blk)
{
    mti_checker *k = extra_of(a)->check;
    size_t i = mti_checker_find(k, blk);
    if (i == SIZE_MAX) return MT_ERR_BAD_BLOCK;
    mti_checker_remove(k, i);
    mt_status s = a->vt->free(a->state, blk);
    if (s) { /* the allocator keeps it: so do the records */
        char why[64];
        mti_checker_add_block(k, blk, why, sizeof why);
    }
    return s;
}

mt_status mt_free(mt_allocator *a, const mt_block *blk)
{
    if (!a || !blk) return free_refused(a, blk, MT_ERR_INVALID_ARG);
    if (!blk->ptr && blk->bytes == 0) return MT_OK;
    unsigned c = (unsigned)blk->mem_class, l = (unsigned)blk->lifetime;
    if (c >= MT_MEM_COUNT || l >= MT_LIFE_COUNT || !blk->ptr || blk->bytes == 0)
        return free_refused(a, blk, MT_ERR_BAD_BLOCK);
    lock(a);
    mt_status s;
    if (a->blocks_by_life[l][c] == 0 || a->live_by_life[l][c] < blk->bytes)
        s = MT_ERR_BAD_BLOCK; /* nothing of that kind is live: cannot be ours */
    else if (!LIKELY(extra_of(a)->check == NULL))
        s = free_checked(a, blk);
    else
        s = a->vt->free(a->state, blk);
    if (LIKELY(s == MT_OK)) {
        mt_stats_on_free(&a->st, blk->mem_class, blk->bytes);
        a->live_by_life[l][c] -= blk->bytes;
        a->blocks_by_life[l][c]--;
        if (a->index >= 0) atomic_fetch_sub(&a->ctx->live_total, blk->bytes);
        if (a->trace && blk->id >= a->trace_first_id) trace_event(a, MT_TRACE_FREE, NULL, blk, 0);
    }
    unlock(a);
    return s == MT_OK ? MT_OK : free_refused(a, blk, s);
}

mt_status mt_allocator_reset(mt_allocator *a, mt_scope scope)
{
    if (!a) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_allocator_reset: allocator is NULL");
    if ((unsigned)scope > MT_SCOPE_PHASE)
        return mti_fail(a->ctx, MT_ERR_INVALID_ARG, "mt_allocator_reset: scope %d out of range",
                        (int)scope);
    lock(a);
    /* the records first: the allocator may give back memory under them */
    if (extra_of(a)->check) mti_checker_reset(extra_of(a)->check, scope);
    mt_status s = a->vt->reset(a->state, scope);
    if (s == MT_OK) {
        for (int l = (int)scope; l < MT_LIFE_COUNT; l++) {
            for (int c = 0; c < MT_MEM_COUNT; c++) {
                uint64_t b = a->live_by_life[l][c], n = a->blocks_by_life[l][c];
                a->st.live_bytes -= b;
                a->st.n_free += n;
                a->st.per_class[c].live_bytes -= b;
                a->st.per_class[c].n_free += n;
                if (a->index >= 0) atomic_fetch_sub(&a->ctx->live_total, b);
                a->live_by_life[l][c] = 0;
                a->blocks_by_life[l][c] = 0;
            }
        }
        a->st.n_resets++;
        trace_event(a, MT_TRACE_RESET, NULL, NULL, (int)scope);
    }
    unlock(a);
    if (s) return mti_fail(a->ctx, s, "allocator '%s': reset failed: %s", a->vt->name,
                           mt_status_string(s));
    return MT_OK;
}

mt_status mt_allocator_trim(mt_allocator *a)
{
    if (!a) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_allocator_trim: allocator is NULL");
    lock(a);
    mt_status s = a->vt->trim ? a->vt->trim(a->state) : MT_OK;
    if (s == MT_OK) {
        a->st.n_trims++;
        trace_event(a, MT_TRACE_TRIM, NULL, NULL, 0);
    }
    unlock(a);
    if (s) return mti_fail(a->ctx, s, "allocator '%s': trim failed: %s", a->vt->name,
                           mt_status_string(s));
    return MT_OK;
}

mt_status mt_allocator_self_stats(const mt_allocator *a, mt_allocator_stats *out)
{
    if (!a || !out) return mti_fail(a ? a->ctx : NULL, MT_ERR_INVALID_ARG,
                                    "mt_allocator_self_stats: %s is NULL", a ? "out" : "a");
    if (!a->vt->stats)
        return mti_fail(a->ctx, MT_ERR_UNSUPPORTED, "allocator '%s' keeps no stats of its own",
                        a->vt->name);
    mt_allocator *m = (mt_allocator *)a;
    memset(out, 0, sizeof *out);
    lock(m);
    mt_status s = a->vt->stats(a->state, out);
    unlock(m);
    return s ? mti_fail(a->ctx, s, "allocator '%s': stats failed", a->vt->name) : MT_OK;
}

mt_status mt_allocator_get_stats(const mt_allocator *a, mt_allocator_stats *out)
{
    if (!a || !out) return mti_fail(a ? a->ctx : NULL, MT_ERR_INVALID_ARG,
                                    "mt_allocator_get_stats: %s is NULL", a ? "out" : "a");
    mt_allocator *m = (mt_allocator *)a;
    mt_allocator_stats self = {0};
    lock(m);
    *out = a->st;
    if (a->vt->stats && a->vt->stats(a->state, &self) == MT_OK)
        out->n_oom_retries = self.n_oom_retries; /* only the allocator knows */
    unlock(m);
    return MT_OK;
}

void mti_allocator_set_trace(mt_allocator *a, mt_trace *t)
{
    lock(a);
    a->trace = t;
    /* blocks allocated before the trace began are not in it: their frees
       are left out too, so the trace stays a possible history */
    a->trace_first_id = a->next_id + 1;
    unlock(a);
}

void mti_allocator_reset_peak(mt_allocator *a)
{
    lock(a);
    a->st.peak_live_bytes = a->st.live_bytes;
    a->st.peak_reserved_bytes = a->st.reserved_bytes;
    for (int c = 0; c < MT_MEM_COUNT; c++)
        a->st.per_class[c].peak_live_bytes = a->st.per_class[c].live_bytes;
    unlock(a);
}

