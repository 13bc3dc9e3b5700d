/*
 * pool.c - the pool allocator: fixed-size classes carved from slabs.
 *
 * Classes. A request goes to the smallest class whose block size fits it:
 * the sizes the options list (exact tensor sizes, rounded up to 256
 * bytes), or by default four per power of two from min_class to
 * max_class. A size finds its class through a table indexed by a
 * 1/16-octave bucket of the size (a count of leading zeros, a shift, a
 * load, rarely a step to the next class): no search. Block addresses are
 * aligned to the largest power of two dividing the class size, up to the
 * backing's granularity (slabs are reserved with that alignment); a request
 * wanting more goes to the next class that gives it, else gets a block of
 * its own.
 *
 * Slabs. A class's slabs hold at most max(1, slab_bytes / size) blocks; the
 * first holds 64 KiB worth (at least one block) and each new one twice as
 * many, so a class with few blocks does not hold a whole slab. A slab keeps
 * a free list of its blocks and a bump index for blocks never used; the
 * class keeps a list of its slabs with a free block. Requests above the
 * largest class, or needing more alignment than any class that fits gives,
 * get their own reservation ("direct"), given back when freed. Slabs with
 * no live block stay for reuse; only when a new slab would raise the peak
 * of reserved bytes are the large ones (slab_bytes or more) given back,
 * while they hold more than 1/16 of the reserved bytes, so that memory one
 * class left can serve another. trim gives back the slabs with no live
 * block and starts every class's slab growth again from its first size;
 * when the backing is out of memory the empty slabs are given back and the
 * request tried once more, then with slabs of half as many blocks, down to
 * one, so a class whose slabs have grown still serves what fits.
 *
 * State is on the host only: 16 bytes per block (live bit, lifetime,
 * memory class, generation, and the requested bytes or the next free
 * block). The handle holds the slab's number and the block's generation,
 * the low 40 bits of a count of all allocations; the block's index comes
 * from the pointer by an exact division (a shift, a multiply by the
 * inverse of the odd part of the size) checked by multiplying back. A
 * double free, a free after a reset or a block from elsewhere finds no
 * live block of that generation at that address and is refused without a
 * change (a stale handle would pass only if a multiple of 2^40 allocations
 * later put a block at the same address). reset(scope) visits only the
 * slabs that may hold live blocks of the lifetimes it frees (a mask per
 * slab, set by alloc and recomputed by reset).
 *
 * Stats: bytes allocated and freed, peaks and counts are kept per memory
 * class on every call; stats() derives the rest.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "memtrain.h"
#include "memtrain/allocator.h"
#include "internal.h"

#define PL_UNLIKELY(x) MTI_UNLIKELY(x)
#define PL_COLD MTI_COLD

/* handle = generation (40 bits) << 24 | slab number (24 bits) */
#define PL_SID_BITS 24
#define PL_MAX_SLABS ((uint32_t)1 << PL_SID_BITS)
#define PL_GEN_MASK ((UINT64_C(1) << (64 - PL_SID_BITS)) - 1)
/* meta key = generation << 8 | memory class << 3 | lifetime << 1 | live */
#define PL_KEY_GEN_SHIFT 8
#define PL_NONE UINT32_MAX
#define PL_DIRECT (UINT32_MAX - 1) /* class of a slab holding one direct block */
#define PL_VACANT (UINT32_MAX - 2) /* class of an unused slab number */
#define PL_MAX_BLOCKS ((uint32_t)1 << 20) /* blocks per slab */
#define PL_MAX_CLASSES 4096u
#define PL_UNIT 256u /* class sizes are multiples of this (bytes) */
#define PL_FIRST_SLAB ((size_t)64 << 10) /* bytes of a class's first slab (or one block) */
#define PL_IDLE_DIV 16 /* large idle slabs: at most about 1/16 of the reserved bytes */

typedef struct pl_meta {
    uint64_t key;  /* see PL_KEY_GEN_SHIFT; bit 0 = live */
    uint64_t word; /* live: requested bytes; free: index of the next free block */
} pl_meta;

/* The first 64 bytes are what alloc and free touch; the array of slabs is
 * 64-byte aligned and the struct 128 bytes, so they share one cache line. */
typedef struct pl_slab {
    uintptr_t base;
    pl_meta *meta;       /* [0, bump) are initialised */
    uint64_t inv;        /* inverse of the odd part of size, mod 2^64 */
    size_t size;         /* bytes per block */
    uint32_t shift;      /* trailing zero bits of size */
    uint32_t cls;        /* class index, PL_DIRECT or PL_VACANT */
    uint32_t nfree, bump, free_head;
    uint32_t lives;      /* bit l: blocks of lifetime l may be live (reset clears) */
    uint32_t nblocks;
    uint32_t prev, next; /* the class's list of slabs with a free block; next links vacant numbers */
    size_t granted;      /* bytes of the reservation */
    unsigned char pad_[48];
} pl_slab;

typedef struct pl_class {
    size_t size;        /* bytes per block, a multiple of PL_UNIT */
    size_t align;       /* every block of the class is aligned to this */
    uint32_t partial;   /* first slab with a free block, PL_NONE */
    uint32_t per_slab;  /* blocks per slab at most: max(1, slab_bytes / size) */
    size_t slab_align;  /* alignment asked of the backing per slab (0: its own) */
    uint64_t inv;       /* inverse of the odd part of size, mod 2^64 */
    uint32_t shift;     /* trailing zero bits of size */
    uint32_t next_blocks; /* blocks of the next slab: doubles up to per_slab */
    uint32_t first_blocks; /* blocks of the first slab (trim starts the growth again) */
    unsigned char pad_[12];
} pl_class;

_Static_assert(sizeof(void *) != 8 || (sizeof(pl_slab) == 128 && sizeof(pl_class) == 64),
               "cache-line layout");

/* Bytes allocated and freed (ever) and the peak of their difference: one
 * addition per call on each side, so alloc and free do not wait on each
 * other's updates of a live count. */
typedef struct pl_acct {
    uint64_t in, out, peak;
    uint64_t n_in, n_out;
} pl_acct;

typedef struct pool {
    pl_class *cls;
    uint32_t ncls;
    uint16_t *bucket;   /* size bucket -> first class that can fit it */
    size_t max_size;    /* the largest class */
    pl_slab *slab;
    uint32_t nslab, cap_slab;
    uint32_t vacant;    /* first vacant slab number, PL_NONE */
    uint64_t serial;    /* allocations made, the source of generations */
    size_t slab_bytes;  /* the option */
    const mt_backing *bk;
    pl_acct total, per[MT_MEM_COUNT];
    mt_allocator_stats st; /* reserved bytes and backing calls; the rest from the above */
} pool;

void mt_pool_options_init(mt_pool_options *o)
{
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->struct_size = (uint32_t)sizeof *o;
    o->class_bytes = NULL;
    o->n_classes = 0;
    o->min_class = 256;
    o->max_class = (size_t)64 << 20;
    o->slab_bytes = (size_t)2 << 20;
}

static size_t pl_align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

static inline void pl_count_alloc(pool *p, unsigned c, size_t bytes)
{
    pl_acct *t = &p->total, *k = &p->per[c];
    uint64_t v = (t->in += bytes) - t->out;
    if (v > t->peak) t->peak = v;
    v = (k->in += bytes) - k->out;
    if (v > k->peak) k->peak = v;
    k->n_in++;
}

static inline void pl_count_free(pool *p, unsigned c, size_t bytes)
{
    p->total.out += bytes;
    p->per[c].out += bytes;
    p->per[c].n_out++;
}

static unsigned pl_log2(uint64_t x) /* x > 0 */
{
#if defined(__GNUC__)
    return 63u - (unsigned)__builtin_clzll(x);
#else
    unsigned n = 0;
    while (x >>= 1) n++;
    return n;
#endif
}

/* Size bucket: exact up to 16 units of 256 bytes, then 16 per octave.
 * Bucket b holds unit counts in (lo(b) - 1, hi(b)], see pl_bucket_lo. */
static inline uint32_t pl_bucket(size_t bytes)
{
    uint64_t u = ((uint64_t)bytes + PL_UNIT - 1) / PL_UNIT;
    if (u <= 16) return u ? (uint32_t)u - 1 : 0;
    unsigned e = pl_log2(u - 1);
    return 16 + (e - 4) * 16 + (uint32_t)(((u - 1) >> (e - 4)) & 15);
}

/* The smallest unit count in bucket b. */
static uint64_t pl_bucket_lo(uint32_t b)
{
    if (b < 16) return b + 1;
    unsigned e = 4 + (b - 16) / 16, m = (b - 16) % 16;
    return ((uint64_t)(16 + m) << (e - 4)) + 1;
}

/* ---- slabs ---- */

static void pl_unlink(pool *p, pl_class *c, uint32_t sid)
{
    pl_slab *s = &p->slab[sid];
    if (s->prev != PL_NONE) p->slab[s->prev].next = s->next;
    else c->partial = s->next;
    if (s->next != PL_NONE) p->slab[s->next].prev = s->prev;
    s->prev = s->next = PL_NONE;
}

static void pl_link(pool *p, pl_class *c, uint32_t sid)
{
    pl_slab *s = &p->slab[sid];
    s->prev = PL_NONE;
    s->next = c->partial;
    if (c->partial != PL_NONE) p->slab[c->partial].prev = sid;
    c->partial = sid;
}

/* A slab number for a new slab (its entry marked vacant until filled). */
static mt_status pl_take_slot(pool *p, uint32_t *sid)
{
    if (p->vacant != PL_NONE) {
        *sid = p->vacant;
        p->vacant = p->slab[*sid].next;
        return MT_OK;
    }
    if (p->nslab == p->cap_slab) {
        if (p->cap_slab >= PL_MAX_SLABS) return MT_ERR_OOM;
        uint32_t nc = p->cap_slab ? p->cap_slab * 2 : 64;
        pl_slab *ns = aligned_alloc(64, (size_t)nc * sizeof *ns); /* a cache line per slab */
        if (!ns) return MT_ERR_OOM;
        if (p->nslab) memcpy(ns, p->slab, (size_t)p->nslab * sizeof *ns);
        free(p->slab);
        p->slab = ns;
        p->cap_slab = nc;
    }
    *sid = p->nslab++;
    memset(&p->slab[*sid], 0, sizeof p->slab[*sid]);
    p->slab[*sid].cls = PL_VACANT;
    return MT_OK;
}

static void pl_put_slot(pool *p, uint32_t sid)
{
    pl_slab *s = &p->slab[sid];
    free(s->meta);
    memset(s, 0, sizeof *s);
    s->cls = PL_VACANT;
    s->next = p->vacant;
    p->vacant = sid;
}

static void pl_release_slab(pool *p, uint32_t sid)
{
    pl_slab *s = &p->slab[sid];
    p->bk->release(p->bk->self, (void *)s->base, s->granted);
    mt_stats_on_release(&p->st, s->granted);
    pl_put_slot(p, sid);
}

/* Gives back every slab with no live block; returns how many. */
static uint32_t pl_release_empty(pool *p)
{
    uint32_t n = 0;
    for (uint32_t sid = 0; sid < p->nslab; sid++) {
        pl_slab *s = &p->slab[sid];
        if (s->cls >= p->ncls || s->nfree != s->nblocks) continue;
        pl_unlink(p, &p->cls[s->cls], sid);
        pl_release_slab(p, sid);
        n++;
    }
    return n;
}

/* Reserves from the backing; when it is out of memory, gives back the
 * empty slabs and tries once more. */
static mt_status pl_reserve(pool *p, size_t bytes, size_t al, void **ptr, size_t *granted)
{
    const mt_backing *bk = p->bk;
    mt_status st = bk->reserve(bk->self, bytes, al, ptr, granted);
    if (st != MT_OK && pl_release_empty(p)) {
        p->st.n_oom_retries++;
        st = bk->reserve(bk->self, bytes, al, ptr, granted);
    }
    if (st == MT_OK) mt_stats_on_reserve(&p->st, *granted);
    return st;
}

/* Before a new slab that would raise the peak of reserved bytes: if the
 * large slabs (slab_bytes or more) with no live block hold more than 1/16
 * of the reserved bytes, give some back, so that memory one class left can
 * serve another. Smaller slabs cost little and stay, and below the peak
 * everything stays: a cycle that repeats costs no backing calls. */
static void pl_balance(pool *p, size_t more)
{
    size_t budget = (size_t)p->st.reserved_bytes / PL_IDLE_DIV, idle = 0;
    if (p->st.reserved_bytes + more <= p->st.peak_reserved_bytes) return; /* no new peak */
    if (budget < 2 * p->slab_bytes) budget = 2 * p->slab_bytes;
    if (p->st.reserved_bytes - (p->total.in - p->total.out) <= budget) return; /* a bound */
    for (uint32_t sid = 0; sid < p->nslab; sid++) {
        const pl_slab *s = &p->slab[sid];
        if (s->cls < p->ncls && s->nfree == s->nblocks && s->granted >= p->slab_bytes)
            idle += s->granted;
    }
    if (idle <= budget) return;
    for (uint32_t sid = 0; sid < p->nslab && idle > budget / 2; sid++) {
        pl_slab *s = &p->slab[sid];
        if (s->cls >= p->ncls || s->nfree != s->nblocks || s->granted < p->slab_bytes) continue;
        idle -= s->granted;
        pl_unlink(p, &p->cls[s->cls], sid);
        pl_release_slab(p, sid);
    }
}

static mt_status pl_new_slab(pool *p, uint32_t ci)
{
    uint32_t sid;
    pl_balance(p, (size_t)p->cls[ci].next_blocks * p->cls[ci].size);
    if (pl_take_slot(p, &sid) != MT_OK) return MT_ERR_OOM;
    pl_class *c = &p->cls[ci];
    void *ptr = NULL;
    size_t granted = 0;
    /* out of memory: smaller slabs, down to one block, so that a class
       whose slabs have grown still serves what fits under a limit */
    uint32_t want = c->next_blocks;
    mt_status st;
    while ((st = pl_reserve(p, (size_t)want * c->size, c->slab_align, &ptr, &granted)) != MT_OK &&
           (st == MT_ERR_OOM || st == MT_ERR_INVALID_ARG) && want > 1)
        want /= 2;
    if (st != MT_OK) {
        pl_put_slot(p, sid);
        return st;
    }
    if (want < c->next_blocks) c->next_blocks = want; /* grow again from what fitted */
    else if (c->next_blocks < c->per_slab) /* a class's slabs grow: few blocks hold little */
        c->next_blocks = c->next_blocks > c->per_slab / 2 ? c->per_slab : 2 * c->next_blocks;
    size_t nb = granted / c->size; /* use all of what was granted */
    if (nb > PL_MAX_BLOCKS) nb = PL_MAX_BLOCKS;
    pl_slab *s = &p->slab[sid];
    s->meta = malloc(nb * sizeof *s->meta);
    if (!s->meta) {
        p->bk->release(p->bk->self, ptr, granted);
        mt_stats_on_release(&p->st, granted);
        pl_put_slot(p, sid);
        return MT_ERR_OOM;
    }
    s->base = (uintptr_t)ptr;
    s->granted = granted;
    s->cls = ci;
    s->size = c->size;
    s->shift = c->shift;
    s->inv = c->inv;
    s->nblocks = s->nfree = (uint32_t)nb;
    s->bump = 0;
    s->free_head = PL_NONE;
    pl_link(p, c, sid);
    return MT_OK;
}

/* ---- blocks ---- */

static inline uint64_t pl_key(uint64_t gen, const mt_alloc_request *req)
{
    return gen << PL_KEY_GEN_SHIFT | (uint64_t)req->mem_class << 3 |
           (uint64_t)req->lifetime << 1 | 1u;
}

/* Hands out a block of class ci, whose first partial slab exists. */
static inline mt_status pl_take(pool *p, pl_class *c, const mt_alloc_request *req, mt_block *out)
{
    uint32_t sid = c->partial;
    pl_slab *s = &p->slab[sid];
    uint32_t idx = s->free_head;
    pl_meta *m;
    if (idx != PL_NONE) {
        m = &s->meta[idx];
        s->free_head = (uint32_t)m->word;
    } else {
        idx = s->bump++;
        m = &s->meta[idx];
    }
    if (--s->nfree == 0) {
        c->partial = s->next;
        if (s->next != PL_NONE) p->slab[s->next].prev = PL_NONE;
        s->next = PL_NONE;
    }
    uint64_t gen = p->serial++ & PL_GEN_MASK;
    m->key = pl_key(gen, req);
    m->word = req->bytes;
    if (PL_UNLIKELY(!(s->lives >> req->lifetime & 1))) s->lives |= 1u << req->lifetime;
    pl_count_alloc(p, req->mem_class, req->bytes);
    out->ptr = (void *)(s->base + (uintptr_t)idx * s->size);
    out->handle = gen << PL_SID_BITS | sid;
    return MT_OK;
}

/* Frees block idx of slab sid (live, checked by the caller). */
static inline void pl_put(pool *p, uint32_t sid, uint32_t idx)
{
    pl_slab *s = &p->slab[sid];
    pl_meta *m = &s->meta[idx];
    uint64_t key = m->key;
    pl_count_free(p, (unsigned)(key >> 3) & 7u, (size_t)m->word);
    m->key = key & ~(uint64_t)1;
    m->word = s->free_head;
    s->free_head = idx;
    if (s->nfree++ == 0) pl_link(p, &p->cls[s->cls], sid);
}

static mt_status pl_alloc_direct(pool *p, const mt_alloc_request *req, size_t al, mt_block *out)
{
    uint32_t sid;
    if (pl_take_slot(p, &sid) != MT_OK) return MT_ERR_OOM;
    pl_meta *m = malloc(sizeof *m);
    if (!m) {
        pl_put_slot(p, sid);
        return MT_ERR_OOM;
    }
    void *ptr = NULL;
    size_t granted = 0;
    pl_balance(p, req->bytes);
    mt_status st = pl_reserve(p, req->bytes, al > p->bk->min_alignment ? al : 0, &ptr, &granted);
    if (st != MT_OK) {
        free(m);
        pl_put_slot(p, sid);
        return st;
    }
    pl_slab *s = &p->slab[sid];
    uint64_t gen = p->serial++ & PL_GEN_MASK;
    m->key = pl_key(gen, req);
    m->word = req->bytes;
    s->meta = m;
    s->base = (uintptr_t)ptr;
    s->granted = granted;
    s->cls = PL_DIRECT;
    s->nblocks = s->bump = 1;
    s->nfree = 0;
    s->free_head = s->prev = s->next = PL_NONE;
    s->lives = 1u << req->lifetime;
    pl_count_alloc(p, req->mem_class, req->bytes);
    out->ptr = ptr;
    out->handle = gen << PL_SID_BITS | sid;
    return MT_OK;
}

PL_COLD static void pl_free_direct(pool *p, uint32_t sid)
{
    pl_slab *s = &p->slab[sid];
    uint64_t key = s->meta[0].key;
    pl_count_free(p, (unsigned)(key >> 3) & 7u, (size_t)s->meta[0].word);
    pl_release_slab(p, sid);
}

PL_COLD static mt_status pl_alloc_slow(pool *p, const mt_alloc_request *req, mt_block *out)
{
    size_t al = req->alignment > PL_UNIT ? req->alignment : PL_UNIT;
    mt_status st;
    if (req->bytes <= p->max_size) {
        uint32_t ci = p->bucket[pl_bucket(req->bytes)];
        while (p->cls[ci].size < req->bytes) ci++;
        while (ci < p->ncls && p->cls[ci].align < al) ci++;
        if (ci < p->ncls) {
            pl_class *c = &p->cls[ci];
            if (c->partial == PL_NONE && (st = pl_new_slab(p, ci)) != MT_OK) goto fail;
            return pl_take(p, c, req, out);
        }
    }
    st = pl_alloc_direct(p, req, al, out);
    if (st == MT_OK) return MT_OK;
fail:
    /* a size the backing refuses outright is memory it does not have */
    if (st == MT_ERR_INVALID_ARG) st = MT_ERR_OOM;
    if (st == MT_ERR_OOM) mt_stats_on_oom(&p->st, req->mem_class);
    return st;
}

/* ---- the table's functions ---- */

static mt_status pool_alloc(void *state, const mt_alloc_request *req, mt_block *out)
{
    pool *p = state;
    size_t bytes = req->bytes;
    if (PL_UNLIKELY(bytes > p->max_size)) return pl_alloc_slow(p, req, out);
    uint32_t ci = p->bucket[pl_bucket(bytes)];
    while (p->cls[ci].size < bytes) ci++;
    pl_class *c = &p->cls[ci];
    if (PL_UNLIKELY(req->alignment > c->align || c->partial == PL_NONE))
        return pl_alloc_slow(p, req, out);
    return pl_take(p, c, req, out);
}

static mt_status pool_free(void *state, const mt_block *blk)
{
    pool *p = state;
    uint64_t h = blk->handle;
    uint32_t sid = (uint32_t)(h & (PL_MAX_SLABS - 1));
    if (PL_UNLIKELY(sid >= p->nslab)) return MT_ERR_BAD_BLOCK;
    pl_slab *s = &p->slab[sid];
    uintptr_t off = (uintptr_t)blk->ptr - s->base;
    uint64_t idx;
    if (PL_UNLIKELY(s->cls >= PL_VACANT)) { /* direct or vacant */
        if (s->cls != PL_DIRECT || off != 0) return MT_ERR_BAD_BLOCK;
        idx = 0;
    } else {
        idx = (uint64_t)(off >> s->shift) * s->inv;
        if (PL_UNLIKELY(idx >= s->bump || idx * s->size != (uint64_t)off)) return MT_ERR_BAD_BLOCK;
    }
    uint64_t key = s->meta[idx].key;
    if (PL_UNLIKELY((key >> PL_KEY_GEN_SHIFT) != h >> PL_SID_BITS || !(key & 1)))
        return MT_ERR_BAD_BLOCK;
    if (PL_UNLIKELY(s->cls == PL_DIRECT)) pl_free_direct(p, sid);
    else pl_put(p, sid, (uint32_t)idx);
    return MT_OK;
}

static mt_status pool_reset(void *state, mt_scope scope)
{
    pool *p = state;
    if ((unsigned)scope > MT_SCOPE_PHASE) return MT_ERR_INVALID_ARG;
    uint32_t dying = (1u << MT_LIFE_COUNT) - (1u << scope); /* lifetimes >= scope */
    for (uint32_t sid = 0; sid < p->nslab; sid++) {
        pl_slab *s = &p->slab[sid];
        if (!(s->lives & dying) || s->cls == PL_VACANT) continue;
        if (s->cls == PL_DIRECT) {
            if (s->meta[0].key & 1) pl_free_direct(p, sid);
            continue;
        }
        uint32_t lives = 0; /* of the blocks that stay */
        for (uint32_t i = 0; i < s->bump; i++) {
            uint64_t key = s->meta[i].key;
            if (!(key & 1)) continue;
            unsigned life = (unsigned)(key >> 1) & 3u;
            if (dying >> life & 1) pl_put(p, sid, i);
            else lives |= 1u << life;
        }
        s->lives = lives;
    }
    p->st.n_resets++;
    return MT_OK;
}

static mt_status pool_trim(void *state)
{
    pool *p = state;
    pl_release_empty(p);
    for (uint32_t ci = 0; ci < p->ncls; ci++) p->cls[ci].next_blocks = p->cls[ci].first_blocks;
    p->st.n_trims++;
    return MT_OK;
}

static mt_status pool_stats(void *state, mt_allocator_stats *out)
{
    const pool *p = state;
    if (!out) return MT_ERR_INVALID_ARG;
    *out = p->st;
    out->live_bytes = p->total.in - p->total.out;
    out->peak_live_bytes = p->total.peak;
    for (unsigned c = 0; c < MT_MEM_COUNT; c++) {
        const pl_acct *k = &p->per[c];
        out->per_class[c].live_bytes = k->in - k->out;
        out->per_class[c].peak_live_bytes = k->peak;
        out->per_class[c].n_alloc = k->n_in;
        out->per_class[c].n_free = k->n_out;
        out->n_alloc += k->n_in;
        out->n_free += k->n_out;
    }
    return MT_OK;
}

static void pool_destroy(void *state)
{
    pool *p = state;
    if (!p) return;
    for (uint32_t sid = 0; sid < p->nslab; sid++) {
        pl_slab *s = &p->slab[sid];
        if (s->cls == PL_VACANT) continue;
        p->bk->release(p->bk->self, (void *)s->base, s->granted);
        free(s->meta);
    }
    free(p->slab);
    free(p->cls);
    free(p->bucket);
    free(p);
}

/* ---- classes ---- */

/* Appends size (rounded to PL_UNIT) unless it equals the last class. */
static void pl_add_class(size_t *sizes, uint32_t *n, size_t size)
{
    size = pl_align_up(size, PL_UNIT);
    if (*n && sizes[*n - 1] >= size) return;
    sizes[(*n)++] = size;
}

/* The class sizes the options ask for, in a new array. */
static mt_status pl_class_sizes(const mt_pool_options *o, size_t **out, uint32_t *n)
{
    size_t *sizes;
    *n = 0;
    if (o->class_bytes) {
        if (o->n_classes == 0 || o->n_classes > PL_MAX_CLASSES) return MT_ERR_INVALID_ARG;
        for (size_t i = 0; i < o->n_classes; i++) {
            size_t v = o->class_bytes[i];
            if (v == 0 || v > MT_MAX_REQUEST || (i && v <= o->class_bytes[i - 1]))
                return MT_ERR_INVALID_ARG;
        }
        if (!(sizes = malloc(o->n_classes * sizeof *sizes))) return MT_ERR_OOM;
        for (size_t i = 0; i < o->n_classes; i++) pl_add_class(sizes, n, o->class_bytes[i]);
    } else {
        if (o->n_classes != 0 || o->min_class == 0 || o->max_class < o->min_class ||
            o->max_class > MT_MAX_REQUEST)
            return MT_ERR_INVALID_ARG;
        if (!(sizes = malloc(4 * 64 * sizeof *sizes))) return MT_ERR_OOM;
        size_t lo = pl_align_up(o->min_class, PL_UNIT), hi = pl_align_up(o->max_class, PL_UNIT);
        pl_add_class(sizes, n, lo);
        for (size_t pw = (size_t)1 << pl_log2(lo); pw <= hi; pw *= 2) {
            for (size_t j = 0; j < 4; j++) {
                size_t v = pw + j * (pw / 4);
                if (v > lo && v <= hi) pl_add_class(sizes, n, v);
            }
        }
        pl_add_class(sizes, n, hi);
    }
    *out = sizes;
    return MT_OK;
}

static mt_status pl_setup_classes(pool *p, const mt_pool_options *o)
{
    size_t *sizes;
    uint32_t n;
    mt_status st = pl_class_sizes(o, &sizes, &n);
    if (st != MT_OK) return st;
    p->cls = calloc(n, sizeof *p->cls);
    p->max_size = sizes[n - 1];
    uint32_t nb = pl_bucket(p->max_size) + 1;
    p->bucket = malloc(nb * sizeof *p->bucket);
    if (!p->cls || !p->bucket) {
        free(sizes);
        return MT_ERR_OOM;
    }
    p->ncls = n;
    size_t gran = p->bk->granularity, min_al = p->bk->min_alignment;
    for (uint32_t i = 0; i < n; i++) {
        pl_class *c = &p->cls[i];
        size_t size = sizes[i], low = size & (~size + 1);
        c->size = size;
        c->shift = pl_log2(low);
        uint64_t odd = (uint64_t)size >> c->shift, inv = odd; /* Newton: 5 steps give 64 bits */
        for (int k = 0; k < 5; k++) inv *= 2 - odd * inv;
        c->inv = inv;
        c->partial = PL_NONE;
        /* slabs aligned to the size's largest power-of-two factor, up to
         * what the backing gives free: the host page; on CUDA only
         * min_alignment (cuMemAlloc promises 256 bytes, and more costs an
         * over-allocation whose slack no accounting sees) */
        size_t free_al = p->bk->device == MT_DEVICE_CUDA ? min_al : gran;
        size_t sa = low < free_al ? low : free_al;
        if (sa < min_al) sa = min_al;
        c->slab_align = sa > min_al ? sa : 0;
        c->align = low < sa ? low : sa;
        size_t per = o->slab_bytes / size, first = PL_FIRST_SLAB / size;
        c->per_slab = per < 1 ? 1 : per > PL_MAX_BLOCKS ? PL_MAX_BLOCKS : (uint32_t)per;
        c->next_blocks = first < 1 ? 1 : first > c->per_slab ? c->per_slab : (uint32_t)first;
        c->first_blocks = c->next_blocks;
    }
    uint32_t ci = 0;
    for (uint32_t b = 0; b < nb; b++) {
        uint64_t lo = pl_bucket_lo(b) * PL_UNIT;
        while (ci + 1 < n && sizes[ci] < lo) ci++;
        p->bucket[b] = (uint16_t)ci;
    }
    free(sizes);
    return MT_OK;
}

static mt_status pool_create(const mt_allocator_params *params, const mt_backing *bk, void **state)
{
    if (!params || !bk || !state || params->struct_size < sizeof *params)
        return MT_ERR_INVALID_ARG;
    if (bk->abi_version != MT_ALLOCATOR_ABI_VERSION) return MT_ERR_VERSION;
    if (!bk->reserve || !bk->release || !mti_is_pow2(bk->min_alignment) ||
        !mti_is_pow2(bk->granularity))
        return MT_ERR_INVALID_ARG;
    mt_pool_options o;
    mt_pool_options_init(&o);
    if (params->options) {
        const mt_pool_options *u = params->options;
        if (u->struct_size != sizeof o) return MT_ERR_INVALID_ARG;
        o = *u;
    }
    if (o.slab_bytes == 0 || o.slab_bytes > MT_MAX_REQUEST) return MT_ERR_INVALID_ARG;
    pool *p = calloc(1, sizeof *p);
    if (!p) return MT_ERR_OOM;
    p->bk = bk;
    p->slab_bytes = o.slab_bytes;
    p->vacant = PL_NONE;
    p->serial = 1;
    mt_status st = pl_setup_classes(p, &o);
    if (st != MT_OK) {
        pool_destroy(p);
        return st;
    }
    *state = p;
    return MT_OK;
}

static const mt_allocator_vtable pl_vtable = {
    .abi_version = MT_ALLOCATOR_ABI_VERSION,
    .struct_size = (uint32_t)sizeof(mt_allocator_vtable),
    .name = "pool",
    .caps = MT_ALLOCATOR_CAP_DETECTS_BAD_FREE,
    .create = pool_create,
    .alloc = pool_alloc,
    .free = pool_free,
    .reset = pool_reset,
    .trim = pool_trim,
    .stats = pool_stats,
    .destroy = pool_destroy,
};

const mt_allocator_vtable *mt_allocator_pool(void) { return &pl_vtable; }
