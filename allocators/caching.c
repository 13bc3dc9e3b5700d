/*
 * caching.c - the general-purpose caching allocator.
 *
 * Memory comes from the backing in segments and is cached: a freed block
 * goes back to its pool, merged with free neighbours, and serves the next
 * request that fits. Wholly free segments go back to the backing on trim,
 * on an out-of-memory retry, on destroy, and when a request too big for
 * any of them needs a segment of its own (see seg_new).
 *
 * Sizes. A request rounds up to the granule G = max(round_bytes, 256), so
 * every block starts and ends on a G boundary and every segment is aligned
 * to at least G. Requests up to small_max live in the small pool, in
 * segments of up to small_segment bytes. Larger ones live in a large pool:
 * up to medium_max they share segments of up to large_segment bytes,
 * beyond that a segment of their own is reserved, rounded up to
 * huge_round. There are two large pools, one for persistent blocks and one
 * for the rest (see POOL_*). A pool's first segments are smaller than the
 * configured size: each new segment is 1/8 of what the pool holds, or the
 * request if that is more (see GROWTH_DIV), so a small model does not pay
 * for a 20 MiB segment.
 *
 * Finding a block. Each pool keeps its free blocks in size bins, TLSF-like:
 * exact bins below 64 granules, then 64 bins per power of two. A two-level
 * bitmap finds the next non-empty bin in O(1). Each bin is a treap keyed by
 * (size, segment, address), so the search is exact best fit, among equal
 * sizes the block in the segment reserved first, lowest address first
 * inside a segment (never the address across segments, which the backing
 * chooses: an estimate's dry device must pick the blocks the real one
 * does): the lower bound of the request in its own bin, else
 * the smallest block of the next non-empty bin. Bins hold a 1/64 spread of
 * sizes, so the trees are tiny and a search is a few pointer steps. Small
 * blocks freed a moment ago are reused first from quick lists (see
 * N_QUICK), the one place where best fit is traded for speed.
 *
 * Split and coalesce. The block found is cut at the first address with the
 * request's alignment (a front gap stays a free block of its own) and then
 * after the rounded request. The tail always becomes a free block in the
 * small pool; in the large pools only when it is larger than
 * max_split_waste, else it is handed out with the block. Blocks carry links
 * to their address neighbours inside the segment; a freed block merges with
 * free neighbours, so no two free blocks in the bins ever touch.
 *
 * Records. Every block, live or free, is a record in host memory: slabs of
 * 1024 records that never move, recycled through a free list, so alloc and
 * free never call malloc on their way (a new slab is taken only when the
 * spare records run out). A handle is (generation << 32) | record index;
 * free checks the index against the slabs, the record's state, generation
 * and address, and the generation is bumped on every free, so foreign,
 * stale and double frees are all caught without touching the pointer.
 * Live blocks sit in one list per lifetime, for reset.
 *
 * No locking here: the library serializes calls when asked to.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Bins: 64 per power of two of the size in granules; sizes up to 2^63
 * granules are covered, far beyond MT_MAX_REQUEST. */
#define SL_LOG 6
#define SL_COUNT (1u << SL_LOG)
#define N_BINS (59u * SL_COUNT) /* 3776 */
#define N_WORDS (N_BINS / 64u)  /* 59 words of bits, one top-level word */

#define SLAB_LOG 10
#define SLAB_RECS (1u << SLAB_LOG) /* records per slab (72 KiB) */

/* Default of max_split_waste: 0, split whatever is left over (at least one
 * granule). A tail left inside a live block is waste until that block is
 * freed, while a split tail can merge with a neighbour freed earlier, so
 * splitting never reserves more; measured on random and training-shaped
 * traces it reserved less than PyTorch's 1 MiB rule. */
#define DEFAULT_SPLIT_WASTE ((size_t)0)

/* A new segment is sized to 1/GROWTH_DIV of what its pool holds already,
 * between the request and the configured segment size, so the free tail of
 * a pool's newest segment stays a small part of the pool even for a model
 * of a few MiB. Measured against 2, 4, 16 and 32: 8 wasted least overall. */
#define GROWTH_DIV 8u

/* The large pool is two: persistent blocks get segments of their own, so
 * a weight or an optimizer state allocated while activations are free
 * does not land in the middle of the space the next step's activations
 * need (GPT-2 124M, B4 T1024, fp32: 1.08 -> 1.02). The small pool is one:
 * splitting it cost more in segment tails than it saved. */
enum { POOL_SMALL = 0, POOL_LARGE_KEEP = 1, POOL_LARGE_TEMP = 2, N_POOLS = 3 };
enum { REC_UNUSED = 0, REC_FREE = 1, REC_LIVE = 2, REC_QUICK = 3 };

/* Quick lists: freed small-pool blocks of fewer than N_QUICK granules
 * (31.5 KiB at the default granule) wait, unmerged, on a LIFO list of their
 * exact size to serve the next request of that size in O(1), as a thread
 * cache does. At most QUICK_CAP blocks per size and 1/QUICK_DIV of the
 * small pool's bytes (at least QUICK_FLOOR) wait so: deferred merging
 * costs some fragmentation (at most one or two small segments in the
 * random traces measured). They are merged back before a small segment is
 * reserved, at reset, trim and out of memory. */
#define N_QUICK 64u
#define QUICK_CAP 64u
#define QUICK_DIV 32u
#define QUICK_FLOOR ((size_t)256 << 10)

typedef struct rec rec;
struct rec {
    uintptr_t addr;   /* first byte of the block; never dereferenced */
    size_t size;      /* bytes the block covers, a multiple of the granule */
    uint64_t seg_no;  /* its segment's number, in the order they were reserved */
    rec *prev, *next; /* address neighbours in the segment, NULL at its ends;
                         on the unused list `next` links the spare records */
    union {
        rec *kid[2];                    /* free: children in its bin's treap;
                                           quick: kid[0] is the next on its list */
        struct { rec *lprev, *lnext; }; /* live: links in its lifetime's list */
    };
    size_t req;       /* live: bytes requested */
    uint32_t idx;     /* this record's index: the low half of handles */
    uint32_t gen;     /* bumped whenever a live block is freed: the high half */
    uint8_t state;    /* REC_* */
    uint8_t pool;     /* POOL_* */
    uint8_t mem_class, lifetime;
};

typedef struct seg seg;
struct seg {
    void *base;       /* as the backing returned it */
    size_t granted;   /* as the backing returned it (all of it counts as reserved) */
    rec *first;       /* the block at base; it keeps this record for the segment's life */
    uint8_t pool;     /* POOL_* */
    seg *prev, *next; /* every segment of the instance */
};

typedef struct pool {
    rec *root[N_BINS];      /* treap of free blocks per bin */
    uint64_t bits[N_WORDS]; /* bit b: root[b] is not empty */
    uint64_t top;           /* bit w: bits[w] is not zero */
} pool;

/* The fields alloc and free touch every time come first, the bins (90 KiB)
 * last, so the hot path stays within a few cache lines. */
typedef struct caching {
    unsigned glog;        /* log2 of the granule */
    size_t gran;          /* the granule in bytes: max(round_bytes, 256) */
    size_t small_max;
    rec **slabs;          /* slab i holds records i * SLAB_RECS .. */
    size_t n_recs;        /* records in all slabs */
    size_t quick_bytes;   /* bytes of all blocks on quick lists */
    size_t quick_cap;     /* most bytes the quick lists may hold */
    rec *live[MT_LIFE_COUNT]; /* live blocks by lifetime */
    rec *quick[N_QUICK];  /* by size in granules, small pool only */
    uint32_t n_quick[N_QUICK];
    mt_allocator_stats st;

    const mt_backing *bk;
    size_t seg_align;     /* alignment asked of the backing for every segment */
    size_t seg_quantum;   /* small segments are a multiple of this */
    size_t small_seg, medium_max, large_seg, huge_round, split_waste;
    size_t n_slabs, cap_slabs;
    rec *spare;           /* unused records */
    size_t n_spare;
    seg *segs;
    uint64_t n_seg_made;  /* segments reserved so far: the next one's number */
    size_t pool_bytes[N_POOLS]; /* reserved for each pool (granted bytes) */
    pool pools[N_POOLS];
} caching;

/* ---- bins ---- */

static inline unsigned log2_floor(uint64_t x) { return 63u - (unsigned)__builtin_clzll(x); }

/* The bin of a size of u granules (u >= 1): exact below 64, then 64 bins
 * per power of two, each 1/64 of it wide. */
static inline size_t bin_of(uint64_t u)
{
    if (u < SL_COUNT) return (size_t)u;
    unsigned fl = log2_floor(u);
    return ((size_t)(fl - SL_LOG + 1) << SL_LOG) | (size_t)((u >> (fl - SL_LOG)) & (SL_COUNT - 1));
}

/* Treap order: size, then segment (the order they were reserved), then
 * address inside the segment: never by address across segments, which the
 * backing places where it likes, so a dry device (an estimate) picks the
 * same block as the real one. The heap priority is a hash of the address,
 * so the shape is random whatever order blocks come in. */
static inline int key_less(const rec *a, const rec *b)
{
    if (a->size != b->size) return a->size < b->size;
    if (a->seg_no != b->seg_no) return a->seg_no < b->seg_no;
    return a->addr < b->addr;
}

static inline uint32_t prio(const rec *r)
{
    return (uint32_t)((((uint64_t)r->addr >> 8) * 0x9E3779B97F4A7C15ull) >> 32);
}

/* Splits treap t into the nodes before x (*l) and after x (*r). */
static void tree_split(rec *t, const rec *x, rec **l, rec **r)
{
    while (t) {
        if (key_less(t, x)) {
            *l = t;
            l = &t->kid[1];
            t = t->kid[1];
        } else {
            *r = t;
            r = &t->kid[0];
            t = t->kid[0];
        }
    }
    *l = NULL;
    *r = NULL;
}

/* Joins two treaps, every node of a before every node of b. */
static rec *tree_merge(rec *a, rec *b)
{
    rec *root = NULL, **link = &root;
    while (a && b) {
        if (prio(a) > prio(b)) {
            *link = a;
            link = &a->kid[1];
            a = a->kid[1];
        } else {
            *link = b;
            link = &b->kid[0];
            b = b->kid[0];
        }
    }
    *link = a ? a : b;
    return root;
}

static void bin_insert(caching *s, rec *x)
{
    pool *p = &s->pools[x->pool];
    size_t b = bin_of(x->size >> s->glog);
    rec **link = &p->root[b];
    uint32_t px = prio(x);
    while (*link && prio(*link) > px) link = &(*link)->kid[!key_less(x, *link)];
    tree_split(*link, x, &x->kid[0], &x->kid[1]);
    *link = x;
    p->bits[b >> 6] |= 1ull << (b & 63);
    p->top |= 1ull << (b >> 6);
}

static void bin_remove(caching *s, rec *x)
{
    pool *p = &s->pools[x->pool];
    size_t b = bin_of(x->size >> s->glog);
    rec **link = &p->root[b];
    while (*link != x) link = &(*link)->kid[!key_less(x, *link)];
    *link = tree_merge(x->kid[0], x->kid[1]);
    if (!p->root[b]) {
        p->bits[b >> 6] &= ~(1ull << (b & 63));
        if (!p->bits[b >> 6]) p->top &= ~(1ull << (b >> 6));
    }
}

/* The smallest free block of pool p of at least `need` bytes, lowest
 * address first among equals; NULL if none. Leaves it in its bin. */
static rec *find_fit(const caching *s, const pool *p, size_t need)
{
    size_t b = bin_of(need >> s->glog);
    rec *best = NULL;
    for (rec *t = p->root[b]; t;) {
        if (t->size >= need) {
            best = t;
            t = t->kid[0];
        } else {
            t = t->kid[1];
        }
    }
    if (best) return best;

    /* every block of a later bin fits: take the smallest of the first one */
    b++;
    size_t w = b >> 6;
    if (w >= N_WORDS) return NULL;
    uint64_t m = p->bits[w] & (~0ull << (b & 63));
    if (!m) {
        uint64_t up = p->top & (~0ull << (w + 1)); /* w + 1 <= 59: no overflow */
        if (!up) return NULL;
        w = (size_t)__builtin_ctzll(up);
        m = p->bits[w];
    }
    rec *t = p->root[(w << 6) | (size_t)__builtin_ctzll(m)];
    while (t->kid[0]) t = t->kid[0];
    return t;
}

/* ---- records ---- */

/* Makes sure at least two spare records exist (the most one alloc uses),
 * so nothing can fail once an allocation has started changing state. */
static mt_status ensure_spare(caching *s)
{
    if (s->n_spare >= 2) return MT_OK;
    /* handles keep the index in 32 bits */
    if ((s->n_slabs + 1) * (size_t)SLAB_RECS > UINT32_MAX) return MT_ERR_OOM;
    if (s->n_slabs == s->cap_slabs) {
        size_t cap = s->cap_slabs ? 2 * s->cap_slabs : 16;
        rec **n = realloc(s->slabs, cap * sizeof *n);
        if (!n) return MT_ERR_OOM;
        s->slabs = n;
        s->cap_slabs = cap;
    }
    rec *slab = calloc(SLAB_RECS, sizeof *slab);
    if (!slab) return MT_ERR_OOM;
    uint32_t base = (uint32_t)(s->n_slabs * SLAB_RECS);
    s->slabs[s->n_slabs++] = slab;
    s->n_recs = s->n_slabs * SLAB_RECS;
    /* pushed in reverse so the lowest indices come out first */
    for (uint32_t i = SLAB_RECS; i-- > 0;) {
        slab[i].idx = base + i;
        slab[i].gen = 1;
        slab[i].next = s->spare;
        s->spare = &slab[i];
    }
    s->n_spare += SLAB_RECS;
    return MT_OK;
}

static inline rec *take_rec(caching *s)
{
    rec *r = s->spare;
    s->spare = r->next;
    s->n_spare--;
    return r;
}

static inline void put_rec(caching *s, rec *r)
{
    r->state = REC_UNUSED;
    r->next = s->spare;
    s->spare = r;
    s->n_spare++;
}

/* The live record a handle names, or NULL: the index is bounds-checked
 * against the slabs before anything is read. */
static rec *live_rec(const caching *s, uint64_t handle, const void *ptr)
{
    uint64_t idx = handle & 0xFFFFFFFFu;
    if (idx >= s->n_recs) return NULL;
    rec *r = &s->slabs[idx >> SLAB_LOG][idx & (SLAB_RECS - 1)];
    if (r->state != REC_LIVE || r->gen != (uint32_t)(handle >> 32) || r->addr != (uintptr_t)ptr)
        return NULL;
    return r;
}

/* Puts n right after b in b's segment. */
static inline void link_after(rec *b, rec *n)
{
    n->prev = b;
    n->next = b->next;
    if (b->next) b->next->prev = n;
    b->next = n;
}

/* Puts free block b (state FREE, outside the bins) into its bin, merged
 * with its free neighbours; the lower record survives a merge. */
static void merge_free(caching *s, rec *b)
{
    rec *p = b->prev;
    if (p && p->state == REC_FREE) {
        bin_remove(s, p);
        p->size += b->size;
        p->next = b->next;
        if (b->next) b->next->prev = p;
        put_rec(s, b);
        b = p;
    }
    rec *n = b->next;
    if (n && n->state == REC_FREE) {
        bin_remove(s, n);
        b->size += n->size;
        b->next = n->next;
        if (n->next) n->next->prev = b;
        put_rec(s, n);
    }
    bin_insert(s, b);
}

/* Merges every block waiting on a quick list back into the bins. */
static void flush_quick(caching *s)
{
    if (!s->quick_bytes) return;
    for (size_t u = 0; u < N_QUICK; u++) {
        rec *b;
        while ((b = s->quick[u])) {
            s->quick[u] = b->kid[0];
            b->state = REC_FREE;
            merge_free(s, b);
        }
        s->n_quick[u] = 0;
    }
    s->quick_bytes = 0;
}

/* ---- segments ---- */

static void set_quick_cap(caching *s)
{
    size_t cap = s->pool_bytes[POOL_SMALL] / QUICK_DIV;
    s->quick_cap = cap > QUICK_FLOOR ? cap : QUICK_FLOOR;
}

static void seg_release(caching *s, seg *g)
{
    if (g->prev) g->prev->next = g->next;
    else s->segs = g->next;
    if (g->next) g->next->prev = g->prev;
    s->bk->release(s->bk->self, g->base, g->granted);
    mt_stats_on_release(&s->st, g->granted);
    s->pool_bytes[g->pool] -= g->granted;
    set_quick_cap(s);
    free(g);
}

/* Gives every wholly free segment of pool pl (all pools: -1) back to the
 * backing. */
static void release_free_segments(caching *s, int pl)
{
    seg *g = s->segs;
    while (g) {
        seg *nx = g->next;
        rec *f = g->first;
        if ((pl < 0 || g->pool == pl) && f->state == REC_FREE && !f->next) {
            bin_remove(s, f);
            put_rec(s, f);
            seg_release(s, g);
        }
        g = nx;
    }
}

/* Reserves a segment for a request of rs rounded bytes aligned to align
 * (>= the granule) in pool pl, and returns its one free block, outside
 * the bins, at an address aligned to align. On out of memory it gives
 * back every wholly free segment and tries once more. */
static mt_status seg_new(caching *s, int pl, size_t rs, size_t align, rec **out)
{
    size_t want;
    size_t grow = s->pool_bytes[pl] / GROWTH_DIV;
    if (pl == POOL_SMALL) {
        want = s->small_seg < grow ? s->small_seg : grow;
        if (want < rs) want = rs;
        want = mti_align_up(want, s->seg_quantum);
    } else if (rs <= s->medium_max) {
        /* whole huge_round units of growth, else just the request: rounding
         * a 3 MiB request up to 4 MiB would leave a tail nothing may fit */
        want = s->large_seg < grow ? s->large_seg : grow;
        want = want / s->huge_round * s->huge_round;
        if (want < rs) want = mti_align_up(rs, s->seg_quantum);
    } else {
        want = (rs + s->huge_round - 1) / s->huge_round * s->huge_round;
    }
    want = mti_align_up(want, s->gran); /* so the usable part holds want */
    size_t a = align > s->seg_align ? align : s->seg_align;

    /* A request that gets a segment of its own found no cached block big
     * enough, so every wholly free segment of its pool is smaller than it:
     * give those back first rather than hold them next to the new one.
     * Measured: the random 1..64 MiB trace 1.36 -> 1.25, the GPT-2 trace
     * 1.09 -> 1.03; a training loop still reserves only in its first step. */
    if (rs > s->medium_max) release_free_segments(s, pl);
    seg *g = malloc(sizeof *g);
    if (!g) return MT_ERR_OOM;
    void *p = NULL;
    size_t granted = 0;
    mt_status st = s->bk->reserve(s->bk->self, want, a, &p, &granted);
    if (st == MT_ERR_OOM) {
        s->st.n_oom_retries++;
        flush_quick(s);
        release_free_segments(s, -1);
        st = s->bk->reserve(s->bk->self, want, a, &p, &granted);
    }
    if (st != MT_OK) {
        free(g);
        return st;
    }
    mt_stats_on_reserve(&s->st, granted);
    if (!p || granted < want || ((uintptr_t)p & (a - 1))) {
        /* a backing that breaks its contract: refuse rather than overrun */
        if (p) {
            s->bk->release(s->bk->self, p, granted);
            mt_stats_on_release(&s->st, granted);
        }
        free(g);
        return MT_ERR_INTERNAL;
    }

    rec *r = take_rec(s);
    r->addr = (uintptr_t)p;
    r->seg_no = ++s->n_seg_made;
    r->size = granted & ~(s->gran - 1);
    r->prev = r->next = NULL;
    r->state = REC_FREE;
    r->pool = (uint8_t)pl;
    g->base = p;
    g->granted = granted;
    g->pool = (uint8_t)pl;
    s->pool_bytes[pl] += granted;
    set_quick_cap(s);
    g->first = r;
    g->prev = NULL;
    g->next = s->segs;
    if (s->segs) s->segs->prev = g;
    s->segs = g;
    *out = r;
    return MT_OK;
}

/* ---- alloc and free ---- */

/* Cuts free block b (outside the bins, big enough) into an optional front
 * gap up to the first address aligned to align, the block handed out, and
 * a tail, per the split rule; gap and tail go to the bins. */
static rec *carve(caching *s, rec *b, size_t rs, size_t align)
{
    uintptr_t at = (b->addr + align - 1) & ~(uintptr_t)(align - 1);
    if (at != b->addr) {
        rec *n = take_rec(s);
        n->addr = at;
        n->seg_no = b->seg_no;
        n->size = b->size - (at - b->addr);
        n->pool = b->pool;
        link_after(b, n);
        b->size = at - b->addr;
        bin_insert(s, b);
        b = n;
    }
    size_t rem = b->size - rs;
    if (rem && (b->pool == POOL_SMALL || rem > s->split_waste)) {
        rec *t = take_rec(s);
        t->addr = b->addr + rs;
        t->seg_no = b->seg_no;
        t->size = rem;
        t->state = REC_FREE;
        t->pool = b->pool;
        link_after(b, t);
        b->size = rs;
        bin_insert(s, t);
    }
    return b;
}

/* The slow way to a block of rs rounded bytes aligned to align: best fit
 * in the bins (after merging the quick lists if that fails), else a new
 * segment; then carved. */
static mt_status take_block(caching *s, size_t rs, size_t align, mt_lifetime life, rec **out)
{
    int pl = rs <= s->small_max           ? POOL_SMALL
             : life == MT_LIFE_PERSISTENT ? POOL_LARGE_KEEP
                                          : POOL_LARGE_TEMP;
    mt_status st = ensure_spare(s);
    if (st != MT_OK) return st;
    /* a block aligned beyond the granule may need up to align - gran in front */
    size_t need = rs + (align - s->gran);
    rec *b = find_fit(s, &s->pools[pl], need);
    if (!b && pl == POOL_SMALL && s->quick_bytes) {
        flush_quick(s);
        b = find_fit(s, &s->pools[pl], need);
    }
    if (b) {
        bin_remove(s, b);
    } else {
        st = seg_new(s, pl, rs, align, &b);
        if (st != MT_OK) return st;
    }
    *out = carve(s, b, rs, align);
    return MT_OK;
}

static mt_status caching_alloc(void *state, const mt_alloc_request *req, mt_block *out)
{
    caching *s = state;
    if (!s || !req || !out) return MT_ERR_INVALID_ARG;
    /* the library checked all this already; one branch keeps it cheap */
    size_t align = req->alignment ? req->alignment : MT_DEFAULT_ALIGNMENT;
    if ((req->bytes - 1 >= MT_MAX_REQUEST) | ((align & (align - 1)) != 0) |
        (align > MT_MAX_ALIGNMENT) | ((unsigned)req->mem_class >= MT_MEM_COUNT) |
        ((unsigned)req->lifetime >= MT_LIFE_COUNT))
        return MT_ERR_INVALID_ARG;
    if (align < s->gran) align = s->gran; /* every block is granule-aligned anyway */

    size_t rs = mti_align_up(req->bytes, s->gran);
    size_t u = rs >> s->glog;
    rec *b;
    if (u < N_QUICK && align == s->gran && rs <= s->small_max && (b = s->quick[u])) {
        s->quick[u] = b->kid[0];
        s->n_quick[u]--;
        s->quick_bytes -= rs;
    } else {
        mt_status st = take_block(s, rs, align, req->lifetime, &b);
        if (st != MT_OK) {
            if (st == MT_ERR_OOM) mt_stats_on_oom(&s->st, req->mem_class);
            return st;
        }
    }

    b->state = REC_LIVE;
    b->req = req->bytes;
    b->mem_class = (uint8_t)req->mem_class;
    b->lifetime = (uint8_t)req->lifetime;
    b->lprev = NULL;
    b->lnext = s->live[b->lifetime];
    if (b->lnext) b->lnext->lprev = b;
    s->live[b->lifetime] = b;
    mt_stats_on_alloc(&s->st, req->mem_class, req->bytes);

    out->ptr = (void *)b->addr;
    out->handle = (uint64_t)b->gen << 32 | b->idx;
    return MT_OK;
}

/* Frees live block b: out of its lifetime list, then onto its quick list
 * if allowed and there is room, else merged into the bins. */
static inline void release_live(caching *s, rec *b, int quick)
{
    if (b->lprev) b->lprev->lnext = b->lnext;
    else s->live[b->lifetime] = b->lnext;
    if (b->lnext) b->lnext->lprev = b->lprev;
    mt_stats_on_free(&s->st, (mt_mem_class)b->mem_class, b->req);
    b->gen++;

    size_t u = b->size >> s->glog;
    if (quick && b->pool == POOL_SMALL && u < N_QUICK && s->n_quick[u] < QUICK_CAP &&
        s->quick_bytes + b->size <= s->quick_cap) {
        b->state = REC_QUICK;
        b->kid[0] = s->quick[u];
        s->quick[u] = b;
        s->n_quick[u]++;
        s->quick_bytes += b->size;
        return;
    }
    b->state = REC_FREE;
    merge_free(s, b);
}

static mt_status caching_free(void *state, const mt_block *blk)
{
    caching *s = state;
    if (!s || !blk) return MT_ERR_INVALID_ARG;
    rec *b = live_rec(s, blk->handle, blk->ptr);
    if (!b) return MT_ERR_BAD_BLOCK;
    release_live(s, b, 1);
    return MT_OK;
}

static mt_status caching_reset(void *state, mt_scope scope)
{
    caching *s = state;
    if (!s || (unsigned)scope > MT_SCOPE_PHASE) return MT_ERR_INVALID_ARG;
    /* lifetime values line up with scopes: a scope frees lifetimes >= it.
     * A reset is a boundary where many blocks die at once: merge them all
     * now, so the next phase starts from the most contiguous free space. */
    for (unsigned l = (unsigned)scope; l < MT_LIFE_COUNT; l++)
        while (s->live[l]) release_live(s, s->live[l], 0);
    flush_quick(s);
    s->st.n_resets++;
    return MT_OK;
}

static mt_status caching_trim(void *state)
{
    caching *s = state;
    if (!s) return MT_ERR_INVALID_ARG;
    flush_quick(s);
    release_free_segments(s, -1);
    s->st.n_trims++;
    return MT_OK;
}

static mt_status caching_stats(void *state, mt_allocator_stats *out)
{
    caching *s = state;
    if (!s || !out) return MT_ERR_INVALID_ARG;
    *out = s->st;
    return MT_OK;
}

/* ---- create and destroy ---- */

void mt_caching_options_init(mt_caching_options *o)
{
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->struct_size = (uint32_t)sizeof *o;
    o->round_bytes = 512;
    o->small_max = (size_t)1 << 20;
    o->small_segment = (size_t)2 << 20;
    o->medium_max = (size_t)10 << 20;
    o->large_segment = (size_t)20 << 20;
    o->huge_round = (size_t)2 << 20;
    o->max_split_waste = DEFAULT_SPLIT_WASTE;
}

/* Options that make sense: sizes in range, the pools nested, each pool's
 * largest request fitting its segment. */
static mt_status check_options(const mt_caching_options *o)
{
    const size_t cap = MT_MAX_REQUEST;
    if (o->struct_size != sizeof *o) return MT_ERR_INVALID_ARG;
    if (!mti_is_pow2(o->round_bytes) || o->round_bytes > MT_MAX_ALIGNMENT) return MT_ERR_INVALID_ARG;
    if (o->small_segment == 0 || o->small_segment > cap || o->small_max > o->small_segment)
        return MT_ERR_INVALID_ARG;
    if (o->large_segment == 0 || o->large_segment > cap || o->medium_max > o->large_segment ||
        o->medium_max < o->small_max)
        return MT_ERR_INVALID_ARG;
    if (o->huge_round == 0 || o->huge_round > cap || o->max_split_waste > cap)
        return MT_ERR_INVALID_ARG;
    return MT_OK;
}

static mt_status caching_create(const mt_allocator_params *params, const mt_backing *bk,
                                void **state)
{
    if (!params || !bk || !state || params->struct_size < sizeof *params)
        return MT_ERR_INVALID_ARG;
    if (bk->abi_version != MT_ALLOCATOR_ABI_VERSION) return MT_ERR_VERSION;
    if (!bk->reserve || !bk->release || !mti_is_pow2(bk->min_alignment) ||
        bk->min_alignment > MT_MAX_ALIGNMENT)
        return MT_ERR_INVALID_ARG;

    mt_caching_options o;
    if (params->options) {
        const mt_caching_options *u = params->options;
        if (u->struct_size != sizeof o) return MT_ERR_INVALID_ARG;
        o = *u;
    } else {
        mt_caching_options_init(&o);
    }
    mt_status st = check_options(&o);
    if (st != MT_OK) return st;

    caching *s = calloc(1, sizeof *s);
    if (!s) return MT_ERR_OOM;
    s->bk = bk;
    s->gran = o.round_bytes > MT_DEFAULT_ALIGNMENT ? o.round_bytes : MT_DEFAULT_ALIGNMENT;
    s->glog = log2_floor(s->gran);
    s->seg_align = bk->min_alignment > s->gran ? bk->min_alignment : s->gran;
    s->seg_quantum = mti_is_pow2(bk->granularity) && bk->granularity > s->gran ? bk->granularity : s->gran;
    s->small_max = o.small_max;
    s->small_seg = o.small_segment;
    s->medium_max = o.medium_max;
    s->large_seg = o.large_segment;
    s->huge_round = o.huge_round;
    s->split_waste = o.max_split_waste;
    set_quick_cap(s);
    *state = s;
    return MT_OK;
}

static void caching_destroy(void *state)
{
    caching *s = state;
    if (!s) return;
    while (s->segs) seg_release(s, s->segs);
    for (size_t i = 0; i < s->n_slabs; i++) free(s->slabs[i]);
    free(s->slabs);
    free(s);
}

static const mt_allocator_vtable caching_vtable = {
    .abi_version = MT_ALLOCATOR_ABI_VERSION,
    .struct_size = sizeof(mt_allocator_vtable),
    .name = "caching",
    .caps = MT_ALLOCATOR_CAP_DETECTS_BAD_FREE,
    .create = caching_create,
    .alloc = caching_alloc,
    .free = caching_free,
    .reset = caching_reset,
    .trim = caching_trim,
    .stats = caching_stats,
    .destroy = caching_destroy,
};

const mt_allocator_vtable *mt_allocator_caching(void) { return &caching_vtable; }
