/*
 * arena.c - the arena allocator: bump allocation in stacks, freed by scope.
 *
 * Stacks. Every (lifetime, memory class) pair has its own stack, 21 in all;
 * a block is carved from the top of its stack with an add, a mask and a
 * compare. The split by class keeps training's interleavings apart: in
 * backward, activations are freed (the ACT stack shrinks) while gradients
 * are allocated (the GRAD stack grows); with one stack per lifetime the
 * freed activations would stay buried under the gradients. reset(scope)
 * rewinds the stacks of lifetimes >= scope and keeps their memory.
 *
 * Records. Each stack keeps a host record per block (address, bytes, tag,
 * freed flag) in allocation order, which is also address order. Freeing
 * the top block pops it and the freed records under it, so a stack shrinks
 * as soon as a LIFO run ends; freeing another block marks it and joins it
 * to the run of freed records around it (runs are listed, each tagged at
 * both ends). The handle holds the stack, the record's index and a 33-bit
 * tag, the stack's count of allocations: a double free or a free after a
 * reset meets a record with another tag, or none, and is refused without a
 * change; a foreign block has no record at its address. (A stale handle
 * would pass only if a multiple of 2^33 allocations of that stack later put
 * a block at the same index and address.)
 *
 * Memory. A stack is a list of chunks. Where the backing offers growable
 * ranges, a chunk is a reserved address range (1 GiB, or the instance's
 * limit if smaller; a stack whose range is full gets another twice as
 * large, up to 64 GiB, or as large as one request needs), committed as the
 * top grows by at least 1/32 of the most it has held (at least the
 * granularity, at most chunk_bytes): there is no tail waste. Memory held
 * but not in use (above a top that came down, in spare chunks, and the
 * whole granules inside runs of freed records) is kept for reuse, but
 * before any stack commits more, about as much is given back while it is
 * over 1/64 of the reserved bytes, so reserved bytes follow what is in use:
 * the memory that activations release serves the gradients, and a block
 * freed under a live one does not hold its memory (its granules become a
 * hole, committed again when the top grows over it). Without ranges, a
 * chunk is a reservation: a stack's chunks double from chunk_bytes / 32 up
 * to chunk_bytes (and at most 1/8 of the instance's limit), a larger
 * request gets its own, and empty chunks move between stacks at no cost;
 * runs of freed records are reused only when the backing is out of memory.
 * trim gives back everything not in use. When the backing is out of
 * memory, what is held is given back and the request tried once more.
 * Alignments above the granularity are met by padding inside the stack.
 *
 * Stats: bytes allocated and freed and their peaks are kept per memory
 * class on every call; the counts of allocations and frees are kept per
 * stack; stats() derives the rest.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "memtrain.h"
#include "memtrain/allocator.h"
#include "internal.h"

#define AR_UNLIKELY(x) MTI_UNLIKELY(x)
#define AR_COLD MTI_COLD

#define AR_NSTACK (MT_LIFE_COUNT * MT_MEM_COUNT)
/* whether an address plus a request (< 2^50) may wrap: not where addresses
 * leave 13 bits spare, as on every 64-bit system */
#define AR_WRAPS ((uint64_t)UINTPTR_MAX >> 50 < (1u << 13))
/* handle = tag (33 bits) | stack + 1 (5 bits) | record index (26 bits) */
#define AR_IDX_BITS 26
#define AR_STK_BITS 5
#define AR_TAG_SHIFT (AR_IDX_BITS + AR_STK_BITS)
#define AR_TAG_MASK ((UINT64_C(1) << (64 - AR_TAG_SHIFT)) - 1)
#define AR_MAX_REC ((uint32_t)1 << AR_IDX_BITS)
#define AR_RANGE_MIN ((size_t)1 << 30) /* bytes of address space of a first range */
#define AR_RANGE_MAX ((size_t)1 << 36) /* ... and at most, unless one request needs more */
#define AR_GROW_DIV 32                 /* a range grows by >= 1/32 of the most it held */
#define AR_SLACK_DIV 64                /* memory above the tops: about 1/64 of reserved */
#define AR_FIRST_CHUNK_DIV 32          /* first plain chunk of a stack: chunk_bytes / 32 */
#define AR_RECYCLE_DIV 32              /* ... and by >= 1/32 of what it has given back */

/* A block. Once freed (and still under a live one) it belongs to a run of
 * freed records: the run's first record keeps the index of its last in
 * addr, and the links of the stack's list of runs in bytes (next) and aux
 * (previous); its last keeps the index of its first in addr (a run of one
 * record does both). Nothing else of a freed record is read. */
typedef struct ar_rec {
    uintptr_t addr;  /* first byte of the block */
    size_t bytes;    /* as requested */
    uint64_t key;    /* tag << 1 | freed */
    uint32_t chunk;  /* index of its chunk in the stack's list */
    uint32_t aux;
} ar_rec;

#define AR_NONE UINT32_MAX

/* A decommitted stretch inside a range: offsets from its base, granule
 * multiples. */
typedef struct ar_hole {
    size_t lo, hi;
} ar_hole;

typedef struct ar_chunk {
    uintptr_t base;
    size_t size;     /* bytes of address space (a reservation's granted size) */
    size_t end;      /* ranges: committed up to this offset, holes excepted;
                        reservations: size */
    size_t held;     /* bytes backed now, counted as reserved */
    size_t peak;     /* the most held so far: regrowth steps follow it */
    size_t recycled; /* bytes decommitted so far: a range that keeps recycling
                        memory grows in larger steps */
    ar_hole *holes;  /* ranges: decommitted stretches below end, ascending */
    uint32_t nholes, cap_holes;
    bool va;         /* a growable range, else a plain reservation */
} ar_chunk;

typedef struct ar_stack {
    uintptr_t top;   /* next free byte in the current chunk (0: no chunk) */
    uintptr_t limit; /* end of the committed bytes from top on */
    ar_rec *rec;     /* live and freed-but-covered blocks, in allocation order */
    uint32_t nrec, cap;
    uint32_t cur;     /* chunk of the last record; 0 when there is none */
    uint32_t runs;    /* first record of the first run of freed records, AR_NONE */
    bool holey;       /* the current chunk has holes, which the limit follows */
    uint32_t nchunk, cap_chunk;
    ar_chunk *chunk; /* chunks past cur (all of them when nrec == 0) are spares */
    uint64_t serial; /* allocations made: the source of tags, and n_alloc */
    uint64_t nfreed; /* blocks freed, by free or reset: n_free */
    uint32_t mclass; /* the memory class of the stack's blocks */
} ar_stack;

/* Bytes allocated and freed (ever) and the peak of their difference: one
 * addition per call on each side, so alloc and free do not wait on each
 * other's updates of a live count. */
typedef struct ar_acct {
    uint64_t in, out, peak;
} ar_acct;

typedef struct arena {
    ar_stack stk[AR_NSTACK];
    const mt_backing *bk;
    bool va;            /* the backing offers growable ranges */
    size_t gran;        /* commit multiple (bytes) */
    size_t chunk_bytes; /* plain chunk size; cap of one commit step */
    size_t range_min;   /* first range of a stack (bytes of address space) */
    size_t limit;       /* the instance's limit, 0 = none (for sizing only) */
    ar_acct total, per[MT_MEM_COUNT];
    mt_allocator_stats st; /* reserved bytes and backing calls; the rest from the above */
} arena;

void mt_arena_options_init(mt_arena_options *o)
{
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->struct_size = (uint32_t)sizeof *o;
    o->chunk_bytes = (size_t)64 << 20;
}

static size_t ar_align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

/* Live bytes and their peaks; the counts of allocations and frees are the
 * stacks' (serial, nfreed), summed by stats(). */
static inline void ar_count_alloc(arena *a, uint32_t c, size_t bytes)
{
    ar_acct *t = &a->total, *k = &a->per[c];
    uint64_t v = (t->in += bytes) - t->out;
    if (v > t->peak) t->peak = v;
    v = (k->in += bytes) - k->out;
    if (v > k->peak) k->peak = v;
}

static inline void ar_count_free(arena *a, uint32_t c, size_t bytes)
{
    a->total.out += bytes;
    a->per[c].out += bytes;
}

/* Record i of stack si now holds the block [p, p + bytes). */
static inline mt_status ar_fill(arena *a, unsigned si, uint32_t i, uintptr_t p, size_t bytes,
                                mt_block *out)
{
    ar_stack *s = &a->stk[si];
    uint64_t tag = s->serial++ & AR_TAG_MASK;
    ar_rec *r = &s->rec[i];
    r->addr = p;
    r->bytes = bytes;
    r->key = tag << 1;
    ar_count_alloc(a, s->mclass, bytes);
    out->ptr = (void *)p;
    out->handle = tag << AR_TAG_SHIFT | (uint64_t)(si + 1) << AR_IDX_BITS | i;
    return MT_OK;
}

/* ---- stack position ---- */

static uint32_t ar_spare_from(const ar_stack *s) { return s->nrec ? s->cur + 1 : 0; }

/* Offset of the first hole of c at or above off, else c->end. Holes never
 * straddle a top: they lie inside runs of freed records. */
static size_t ar_stop(const ar_chunk *c, size_t off)
{
    size_t stop = c->end;
    for (uint32_t k = c->nholes; k-- > 0 && c->holes[k].lo >= off;) stop = c->holes[k].lo;
    return stop;
}

static void ar_set_cur(ar_stack *s, uint32_t cur, uintptr_t top)
{
    s->cur = cur;
    s->top = top;
    s->limit = 0;
    s->holey = false;
    if (!s->nchunk) return;
    const ar_chunk *c = &s->chunk[cur];
    s->limit = c->base + ar_stop(c, top - c->base);
    s->holey = c->nholes != 0;
}

/* Puts top right after the last record (or at the start of chunk 0). */
AR_COLD static void ar_rewind(ar_stack *s)
{
    if (s->nrec) {
        const ar_rec *r = &s->rec[s->nrec - 1];
        ar_set_cur(s, r->chunk, r->addr + r->bytes);
    } else {
        ar_set_cur(s, 0, s->nchunk ? s->chunk[0].base : 0);
    }
}

/* ---- runs of freed records ---- */

static void ar_run_unlink(ar_stack *s, uint32_t h)
{
    uint32_t prev = s->rec[h].aux, next = (uint32_t)s->rec[h].bytes;
    if (prev != AR_NONE) s->rec[prev].bytes = next;
    else s->runs = next;
    if (next != AR_NONE) s->rec[next].aux = prev;
}

/* Record h takes the place of record old in the list of runs (or, with old
 * AR_NONE, goes first). */
static void ar_run_move(ar_stack *s, uint32_t old, uint32_t h)
{
    uint32_t prev = old == AR_NONE ? AR_NONE : s->rec[old].aux;
    uint32_t next = old == AR_NONE ? s->runs : (uint32_t)s->rec[old].bytes;
    s->rec[h].aux = prev;
    s->rec[h].bytes = next;
    if (prev != AR_NONE) s->rec[prev].bytes = h;
    else s->runs = h;
    if (next != AR_NONE) s->rec[next].aux = h;
}

/* Frees record i, which has a live record above it: it joins the runs of
 * freed records around it. */
AR_COLD static void ar_mark(ar_stack *s, uint32_t i)
{
    ar_rec *rec = s->rec;
    bool left = i && (rec[i - 1].key & 1), right = rec[i + 1].key & 1;
    uint32_t h = left ? (uint32_t)rec[i - 1].addr : i, t = right ? (uint32_t)rec[i + 1].addr : i;
    rec[i].key |= 1;
    if (left && right) ar_run_unlink(s, i + 1);
    else if (right) ar_run_move(s, i + 1, i);
    else if (!left) ar_run_move(s, AR_NONE, i);
    rec[h].addr = t;
    rec[t].addr = h;
}

/* The last record of run [from, t] in the chunk of record from (chunks
 * never decrease along the records). */
static uint32_t ar_seg_end(const ar_rec *rec, uint32_t from, uint32_t t)
{
    uint32_t ch = rec[from].chunk;
    if (rec[t].chunk == ch) return t;
    while (from + 1 < t) {
        uint32_t mid = from + (t - from) / 2;
        if (rec[mid].chunk == ch) from = mid;
        else t = mid;
    }
    return from;
}

/* The free stretch [*lo, *hi) (offsets in its chunk) around records
 * [from, e] of a run, all in one chunk c. */
static void ar_seg_span(const ar_stack *s, const ar_chunk *c, uint32_t from, uint32_t e,
                        size_t *lo, size_t *hi)
{
    const ar_rec *rec = s->rec;
    uint32_t ch = rec[from].chunk;
    *lo = from && rec[from - 1].chunk == ch ? rec[from - 1].addr + rec[from - 1].bytes - c->base : 0;
    *hi = e + 1 < s->nrec && rec[e + 1].chunk == ch ? rec[e + 1].addr - c->base : c->end;
    if (*hi > c->end) *hi = c->end;
}

/* ---- giving memory back ---- */

static bool ar_room(void **arr, uint32_t *cap, uint32_t n, size_t elem)
{
    if (n < *cap) return true;
    uint32_t nc = *cap ? *cap * 2 : 8;
    void *p = realloc(*arr, (size_t)nc * elem);
    if (!p) return false;
    *arr = p;
    *cap = nc;
    return true;
}

static void ar_decommit(arena *a, ar_chunk *c, size_t lo, size_t hi)
{
    if (hi <= lo) return;
    a->bk->va_decommit(a->bk->self, (void *)(c->base + lo), hi - lo);
    c->held -= hi - lo;
    c->recycled += hi - lo;
    mt_stats_on_release(&a->st, hi - lo);
}

static void ar_chunk_release(arena *a, ar_chunk *c)
{
    if (c->va) {
        size_t at = 0;
        for (uint32_t k = 0; k < c->nholes; k++) {
            ar_decommit(a, c, at, c->holes[k].lo);
            at = c->holes[k].hi;
        }
        ar_decommit(a, c, at, c->end);
        a->bk->va_release(a->bk->self, (void *)c->base, c->size);
        free(c->holes);
    } else {
        a->bk->release(a->bk->self, (void *)c->base, c->size);
        mt_stats_on_release(&a->st, c->size);
    }
}

/* Committed bytes of range c above offset floor (a granule multiple at or
 * above the top). */
static size_t ar_tail_held(const ar_chunk *c, size_t floor)
{
    if (!c->va || c->end <= floor) return 0;
    size_t n = c->end - floor;
    for (uint32_t k = c->nholes; k-- > 0 && c->holes[k].lo >= floor;)
        n -= c->holes[k].hi - c->holes[k].lo;
    return n;
}

/* Decommits the committed stretches of range c above offset floor, the
 * highest first, until want bytes are given back. Returns the bytes. */
static size_t ar_shed_tail(arena *a, ar_chunk *c, size_t floor, size_t want)
{
    size_t got = 0;
    for (;;) {
        while (c->nholes && c->holes[c->nholes - 1].hi == c->end &&
               c->holes[c->nholes - 1].lo >= floor) /* a hole at the end: fold it */
            c->end = c->holes[--c->nholes].lo;
        if (got >= want || c->end <= floor) return got;
        size_t x = c->nholes && c->holes[c->nholes - 1].hi > floor ? c->holes[c->nholes - 1].hi
                                                                   : floor;
        size_t take = c->end - x, rest = want - got;
        if (take > rest) take = ar_align_up(rest, a->gran); /* rest < take: no overflow */
        ar_decommit(a, c, c->end - take, c->end);
        c->end -= take;
        got += take;
    }
}

/* The runs of freed records of s in ranges: the whole granules between the
 * live blocks around each run that are still committed. Counts them, or
 * with shed set decommits them (until want bytes) and keeps them as holes.
 * Returns the bytes. */
static size_t ar_runs(arena *a, ar_stack *s, bool shed, size_t want)
{
    size_t n = 0, gran = a->gran;
    const ar_rec *rec = s->rec;
    for (uint32_t h = s->runs; h != AR_NONE && (!shed || n < want); h = (uint32_t)rec[h].bytes) {
        for (uint32_t from = h, t = (uint32_t)rec[h].addr, e; from <= t; from = e + 1) {
            e = ar_seg_end(rec, from, t);
            ar_chunk *c = &s->chunk[rec[from].chunk];
            size_t lo, hi;
            if (!c->va) continue;
            ar_seg_span(s, c, from, e, &lo, &hi);
            lo = ar_align_up(lo, gran);
            hi &= ~(gran - 1);
            if (hi <= lo) continue;
            /* holes inside came from parts of this run: find them */
            uint32_t first = 0, cnt = 0, top = c->nholes;
            while (first < top) {
                uint32_t mid = first + (top - first) / 2;
                if (c->holes[mid].lo < lo) first = mid + 1;
                else top = mid;
            }
            size_t held = hi - lo;
            while (first + cnt < c->nholes && c->holes[first + cnt].hi <= hi) {
                held -= c->holes[first + cnt].hi - c->holes[first + cnt].lo;
                cnt++;
            }
            if (!held || (shed && !cnt && !ar_room((void **)&c->holes, &c->cap_holes, c->nholes,
                                                   sizeof *c->holes)))
                continue;
            n += held;
            if (!shed) continue;
            size_t at = lo;
            for (uint32_t q = first; q < first + cnt; q++) {
                ar_decommit(a, c, at, c->holes[q].lo);
                at = c->holes[q].hi;
            }
            ar_decommit(a, c, at, hi);
            if (!cnt) { /* a new hole, in order */
                memmove(&c->holes[first + 1], &c->holes[first],
                        (c->nholes - first) * sizeof *c->holes);
                c->nholes++;
            } else { /* one hole for the run */
                memmove(&c->holes[first + 1], &c->holes[first + cnt],
                        (c->nholes - first - cnt) * sizeof *c->holes);
                c->nholes -= cnt - 1;
            }
            c->holes[first] = (ar_hole){lo, hi};
            if (hi == c->end) { /* the run reached the end (of a chunk left behind): fold */
                c->end = lo;
                c->nholes--;
            }
        }
    }
    if (shed) ar_set_cur(s, s->cur, s->top); /* holes below the top: the limit stays */
    return n;
}

/* Committed bytes held above the stacks' tops (spare chunks, tails of the
 * current ranges, runs of freed records), the chunk skip excepted. */
static size_t ar_excess(arena *a, const ar_chunk *skip)
{
    size_t n = 0;
    for (unsigned k = 0; k < AR_NSTACK; k++) {
        ar_stack *s = &a->stk[k];
        for (uint32_t j = ar_spare_from(s); j < s->nchunk; j++)
            if (&s->chunk[j] != skip) n += s->chunk[j].held;
        if (s->nrec && &s->chunk[s->cur] != skip) {
            const ar_chunk *c = &s->chunk[s->cur];
            n += ar_tail_held(c, ar_align_up(s->top - c->base, a->gran));
        }
        n += ar_runs(a, s, false, 0);
    }
    return n;
}

/* Gives back memory held above the tops until want bytes are back: spare
 * chunks first, then the tails of the current ranges, then runs of freed
 * records. skip is a chunk being grown, always the current chunk of its
 * stack: its tail is left alone (its runs, below the top, are fair game),
 * and removing spares never moves it. Returns how many things were given
 * back; *got the bytes. */
static unsigned ar_shed(arena *a, const ar_chunk *skip, size_t want, size_t *got)
{
    unsigned done = 0;
    size_t n = 0;
    for (unsigned k = 0; k < AR_NSTACK && n < want; k++) {
        ar_stack *s = &a->stk[k];
        uint32_t from = ar_spare_from(s);
        for (uint32_t j = s->nchunk; j-- > from && n < want;) {
            if (&s->chunk[j] == skip) continue;
            n += s->chunk[j].held;
            ar_chunk_release(a, &s->chunk[j]);
            memmove(&s->chunk[j], &s->chunk[j + 1], (s->nchunk - j - 1) * sizeof *s->chunk);
            s->nchunk--;
            done++;
        }
        if (!s->nrec) ar_rewind(s);
    }
    for (unsigned k = 0; k < AR_NSTACK && n < want; k++) {
        ar_stack *s = &a->stk[k];
        if (!s->nrec || &s->chunk[s->cur] == skip || !s->chunk[s->cur].va) continue;
        ar_chunk *c = &s->chunk[s->cur];
        size_t g = ar_shed_tail(a, c, ar_align_up(s->top - c->base, a->gran), want - n);
        if (g) done++;
        n += g;
        ar_set_cur(s, s->cur, s->top);
    }
    for (unsigned k = 0; k < AR_NSTACK && n < want; k++) {
        size_t g = ar_runs(a, &a->stk[k], true, want - n);
        if (g) done++;
        n += g;
    }
    *got = n;
    return done;
}

/* Before taking delta more bytes from the backing, where that would raise
 * the peak of reserved bytes: if the stacks hold more than 1/64 of the
 * reserved bytes not in use, give back about as much as is taken (at least
 * half that slack, so this does not happen on every step of a growing
 * stack), so that memory moves between stacks. (Below the peak nothing is
 * given back: a training step that repeats costs no backing calls.) */
static void ar_balance(arena *a, const ar_chunk *skip, size_t delta)
{
    size_t budget = (size_t)(a->st.reserved_bytes + delta) / AR_SLACK_DIV, got;
    if (a->st.reserved_bytes + delta <= a->st.peak_reserved_bytes) return; /* no new peak */
    if (budget < 4 * a->gran) budget = 4 * a->gran;
    size_t ex = ar_excess(a, skip);
    if (ex <= budget) return;
    size_t want = delta > budget / 2 ? delta : budget / 2;
    if (want > ex - budget / 2) want = ex - budget / 2;
    ar_shed(a, skip, want, &got);
}

/* ---- taking memory ---- */

/* Commits [lo, hi) of range c, or at least [lo, least): when the backing
 * refuses, what the other chunks hold above their tops is given back and
 * [lo, least) tried once more. *got gets the end committed. */
static mt_status ar_commit(arena *a, ar_chunk *c, size_t lo, size_t hi, size_t least, size_t *got)
{
    const mt_backing *bk = a->bk;
    mt_status st = bk->va_commit(bk->self, (void *)(c->base + lo), hi - lo);
    if (st != MT_OK) {
        size_t freed = 0;
        ar_shed(a, c, SIZE_MAX, &freed);
        if (!freed && hi == least) return st;
        a->st.n_oom_retries++;
        hi = least;
        st = bk->va_commit(bk->self, (void *)(c->base + lo), hi - lo);
        if (st != MT_OK) return st;
    }
    c->held += hi - lo;
    mt_stats_on_reserve(&a->st, hi - lo);
    *got = hi;
    return MT_OK;
}

/* Commits what the current range c of s lacks below offset need: the holes
 * above the top, and past the end, overshooting by a step. */
static mt_status ar_grow(arena *a, ar_stack *s, ar_chunk *c, size_t need)
{
    size_t gran = a->gran, want = ar_align_up(need, gran), top = s->top - c->base;
    if (need > c->size) return MT_ERR_OOM;
    size_t target = c->end;
    if (want > c->end) {
        size_t step = (c->peak > c->held ? c->peak : c->held) / AR_GROW_DIV;
        if (step < c->recycled / AR_RECYCLE_DIV) step = c->recycled / AR_RECYCLE_DIV;
        step = ar_align_up(step, gran);
        if (step > a->chunk_bytes) step = a->chunk_bytes;
        if (step < gran) step = gran;
        target = c->end + step > want ? c->end + step : want;
        if (target > c->size) target = c->size;
        if (a->limit) { /* overshoot only within the limit */
            uint64_t room = a->limit > a->st.reserved_bytes ? a->limit - a->st.reserved_bytes : 0;
            if (target - c->end > room) {
                size_t t = c->end + (size_t)room / gran * gran;
                target = t > want ? t : want;
            }
        }
    }
    size_t delta = target - c->end;
    for (uint32_t k = 0; k < c->nholes; k++)
        if (c->holes[k].lo >= top && c->holes[k].lo < want)
            delta += (c->holes[k].hi < want ? c->holes[k].hi : want) - c->holes[k].lo;
    ar_balance(a, c, delta);
    mt_status st = MT_OK;
    for (uint32_t k = 0; k < c->nholes && st == MT_OK;) {
        size_t lo = c->holes[k].lo, x = c->holes[k].hi < want ? c->holes[k].hi : want, got;
        if (lo < top || lo >= want) {
            k++;
            continue;
        }
        st = ar_commit(a, c, lo, x, x, &got);
        if (st != MT_OK) break;
        /* a retry may have made holes below the top: find this one again */
        for (k = 0; c->holes[k].lo != lo; k++) {
        }
        c->holes[k].lo = x;
        if (x < c->holes[k].hi) continue;
        memmove(&c->holes[k], &c->holes[k + 1], (c->nholes - k - 1) * sizeof *c->holes);
        c->nholes--;
    }
    if (st == MT_OK && target > c->end) {
        size_t got;
        st = ar_commit(a, c, c->end, target, want > c->end ? want : c->end, &got);
        if (st == MT_OK) c->end = got;
    }
    if (c->held > c->peak) c->peak = c->held;
    ar_set_cur(s, s->cur, s->top);
    return st;
}

/* A new chunk from the backing, able to hold bytes at alignment al. */
static mt_status ar_new_chunk(arena *a, ar_stack *s, size_t bytes, size_t al, ar_chunk *c)
{
    memset(c, 0, sizeof *c);
    const mt_backing *bk = a->bk;
    size_t freed;
    if (a->va) {
        size_t pad = al > a->gran ? al : 0; /* room to align inside the range */
        size_t need = ar_align_up(bytes + pad, a->gran);
        size_t r = a->range_min;
        if (s->nrec && s->chunk[s->cur].va) { /* the current range is full: double it */
            size_t twice = s->chunk[s->cur].size < AR_RANGE_MAX / 2 ? 2 * s->chunk[s->cur].size
                                                                     : AR_RANGE_MAX;
            if (r < twice) r = twice;
        }
        if (a->limit && r > ar_align_up(a->limit, a->gran)) r = ar_align_up(a->limit, a->gran);
        if (r < need) r = need;
        void *base = NULL;
        mt_status st = bk->va_reserve(bk->self, r, &base);
        if (st != MT_OK && ar_shed(a, NULL, SIZE_MAX, &freed)) { /* spares hold address space */
            a->st.n_oom_retries++;
            st = bk->va_reserve(bk->self, r, &base);
        }
        if (st != MT_OK) return st;
        c->base = (uintptr_t)base;
        c->size = r;
        c->va = true;
        return MT_OK;
    }
    /* a stack's chunks double from chunk_bytes / 32 up to chunk_bytes, so a
     * small stack does not hold a whole chunk */
    size_t want = a->chunk_bytes / AR_FIRST_CHUNK_DIV;
    if (s->nchunk && want < 2 * s->chunk[s->cur].size) want = 2 * s->chunk[s->cur].size;
    if (want > a->chunk_bytes) want = a->chunk_bytes;
    want = ar_align_up(want, a->gran);
    if (a->limit) { /* under a limit, chunks of at most 1/8 of it, and what is left */
        uint64_t room = a->limit > a->st.reserved_bytes ? a->limit - a->st.reserved_bytes : 0;
        size_t eighth = ar_align_up(a->limit / 8, a->gran);
        if (want > eighth) want = eighth;
        if (want > room) want = (size_t)room;
    }
    if (want < bytes) want = bytes;
    size_t ask_al = al > bk->min_alignment ? al : 0;
    void *p = NULL;
    size_t granted = 0;
    ar_balance(a, NULL, want);
    mt_status st = bk->reserve(bk->self, want, ask_al, &p, &granted);
    if (st != MT_OK && ar_shed(a, NULL, SIZE_MAX, &freed)) {
        a->st.n_oom_retries++;
        st = bk->reserve(bk->self, want, ask_al, &p, &granted);
    }
    if (st != MT_OK) return st;
    c->base = (uintptr_t)p;
    c->size = c->end = c->held = c->peak = granted;
    mt_stats_on_reserve(&a->st, granted);
    return MT_OK;
}

static bool ar_fits(const ar_chunk *c, size_t bytes, size_t al)
{
    size_t pad = (size_t)(ar_align_up(c->base, al) - c->base);
    return pad <= c->size && bytes <= c->size - pad;
}

/* Makes a chunk able to hold the request the current one of s, moving
 * to a spare of s, an empty chunk of another stack, or a new one. */
static mt_status ar_next_chunk(arena *a, ar_stack *s, size_t bytes, size_t al)
{
    if (s->nrec && s->chunk[s->cur].va) { /* the tail we leave behind */
        ar_chunk *old = &s->chunk[s->cur];
        ar_shed_tail(a, old, ar_align_up(s->top - old->base, a->gran), SIZE_MAX);
        ar_set_cur(s, s->cur, s->top);
    }
    uint32_t pos = ar_spare_from(s);
    for (uint32_t j = pos; j < s->nchunk; j++) {
        if (!s->nrec && j == s->cur) continue; /* already tried */
        if (ar_fits(&s->chunk[j], bytes, al)) {
            ar_chunk t = s->chunk[j];
            s->chunk[j] = s->chunk[pos];
            s->chunk[pos] = t;
            ar_set_cur(s, pos, s->chunk[pos].base);
            return MT_OK;
        }
    }
    if (!ar_room((void **)&s->chunk, &s->cap_chunk, s->nchunk, sizeof *s->chunk))
        return MT_ERR_OOM;
    ar_chunk c;
    bool found = false;
    for (unsigned k = 0; k < AR_NSTACK && !found; k++) {
        ar_stack *o = &a->stk[k];
        if (o == s) continue;
        for (uint32_t j = ar_spare_from(o); j < o->nchunk; j++) {
            if (!ar_fits(&o->chunk[j], bytes, al)) continue;
            c = o->chunk[j];
            memmove(&o->chunk[j], &o->chunk[j + 1], (o->nchunk - j - 1) * sizeof *o->chunk);
            o->nchunk--;
            if (!o->nrec) ar_rewind(o);
            found = true;
            break;
        }
    }
    if (!found) {
        mt_status st = ar_new_chunk(a, s, bytes, al, &c);
        if (st != MT_OK) return st;
    }
    memmove(&s->chunk[pos + 1], &s->chunk[pos], (s->nchunk - pos) * sizeof *s->chunk);
    s->chunk[pos] = c;
    s->nchunk++;
    ar_set_cur(s, pos, c.base);
    return MT_OK;
}

/* When the backing has no more: a run of freed records between live ones,
 * wide enough for the request in the chunk of its first record, and not
 * decommitted there. That record is reused (records stay in address order;
 * the rest of the run stays freed). */
static bool ar_fit_hole(ar_stack *s, size_t bytes, size_t al, uint32_t *ri, uintptr_t *pp)
{
    ar_rec *rec = s->rec;
    for (uint32_t h = s->runs; h != AR_NONE; h = (uint32_t)rec[h].bytes) {
        uint32_t t = (uint32_t)rec[h].addr, e = ar_seg_end(rec, h, t);
        const ar_chunk *c = &s->chunk[rec[h].chunk];
        size_t lo, hi;
        ar_seg_span(s, c, h, e, &lo, &hi);
        size_t p = (size_t)(ar_align_up(c->base + lo, al) - c->base);
        if (p < lo || p > hi || bytes > hi - p) continue;
        bool clear = true;
        for (uint32_t q = 0; q < c->nholes && clear; q++)
            clear = c->holes[q].hi <= p || c->holes[q].lo >= p + bytes;
        if (!clear) continue;
        if (t > h) { /* the run goes on from h + 1 */
            ar_run_move(s, h, h + 1);
            rec[h + 1].addr = t;
            rec[t].addr = h + 1;
        } else {
            ar_run_unlink(s, h);
        }
        *ri = h;
        *pp = c->base + p;
        return true;
    }
    return false;
}

/* Makes room for the request at the top of s: record space, a chunk that
 * can hold it, committed memory. *pp gets its address. */
static mt_status ar_make_room(arena *a, ar_stack *s, size_t bytes, size_t al, uintptr_t *pp)
{
    if (s->nrec == s->cap) {
        if (s->nrec >= AR_MAX_REC || !ar_room((void **)&s->rec, &s->cap, s->nrec, sizeof *s->rec))
            return MT_ERR_OOM;
        if (s->cap > AR_MAX_REC) s->cap = AR_MAX_REC;
    }
    uintptr_t p = s->nchunk ? ar_align_up(s->top, al) : 0;
    ar_chunk *c = s->nchunk ? &s->chunk[s->cur] : NULL;
    if (!c || p < s->top || p - c->base > c->size || bytes > c->size - (p - c->base)) {
        mt_status st = ar_next_chunk(a, s, bytes, al);
        if (st != MT_OK) return st;
        c = &s->chunk[s->cur];
        p = ar_align_up(s->top, al);
    }
    if (p + bytes > s->limit) {
        mt_status st = ar_grow(a, s, c, p + bytes - c->base);
        if (st != MT_OK) {
            ar_rewind(s); /* a chunk just taken stays as a spare */
            return st;
        }
    }
    *pp = p;
    return MT_OK;
}

AR_COLD static mt_status ar_alloc_slow(arena *a, unsigned si, const mt_alloc_request *req, mt_block *out)
{
    ar_stack *s = &a->stk[si];
    size_t al = req->alignment > MT_DEFAULT_ALIGNMENT ? req->alignment : MT_DEFAULT_ALIGNMENT;
    size_t bytes = req->bytes;
    uint32_t i;
    uintptr_t p;
    mt_status st = ar_make_room(a, s, bytes, al, &p);
    if (st == MT_OK) {
        i = s->nrec++;
        s->rec[i].chunk = s->cur;
        s->top = p + bytes;
    } else if (st == MT_ERR_OOM && ar_fit_hole(s, bytes, al, &i, &p)) {
        a->st.n_oom_retries++; /* out of memory, met by reusing a hole */
    } else {
        /* a size the backing refuses outright is memory it does not have */
        if (st == MT_ERR_INVALID_ARG) st = MT_ERR_OOM;
        if (st == MT_ERR_OOM) mt_stats_on_oom(&a->st, req->mem_class);
        return st;
    }
    return ar_fill(a, si, i, p, bytes, out);
}

/* ---- the table's functions ---- */

static mt_status arena_alloc(void *state, const mt_alloc_request *req, mt_block *out)
{
    arena *a = state;
    unsigned si = (unsigned)req->lifetime * MT_MEM_COUNT + (unsigned)req->mem_class;
    ar_stack *s = &a->stk[si];
    uintptr_t mask = (uintptr_t)(req->alignment > MT_DEFAULT_ALIGNMENT ? req->alignment
                                                                       : MT_DEFAULT_ALIGNMENT) - 1;
    uintptr_t p = (s->top + mask) & ~mask;
    uintptr_t end = p + req->bytes;
    if (AR_UNLIKELY(end > s->limit || (AR_WRAPS && end < p) || s->nrec == s->cap))
        return ar_alloc_slow(a, si, req, out);
    uint32_t i = s->nrec++;
    s->rec[i].chunk = s->cur;
    s->top = end;
    return ar_fill(a, si, i, p, req->bytes, out);
}

static mt_status arena_free(void *state, const mt_block *blk)
{
    arena *a = state;
    uint64_t h = blk->handle;
    unsigned si = (unsigned)((h >> AR_IDX_BITS) & ((1u << AR_STK_BITS) - 1)) - 1u;
    uint32_t i = (uint32_t)(h & (AR_MAX_REC - 1));
    if (AR_UNLIKELY(si >= AR_NSTACK)) return MT_ERR_BAD_BLOCK;
    ar_stack *s = &a->stk[si];
    if (AR_UNLIKELY(i >= s->nrec)) return MT_ERR_BAD_BLOCK;
    ar_rec *r = &s->rec[i];
    if (AR_UNLIKELY(r->key != (h >> AR_TAG_SHIFT) << 1 || r->addr != (uintptr_t)blk->ptr))
        return MT_ERR_BAD_BLOCK;
    ar_count_free(a, s->mclass, r->bytes);
    s->nfreed++;
    if (i + 1 == s->nrec) {
        /* pop it and the freed records it was covering */
        uint32_t n = i;
        while (n && (s->rec[n - 1].key & 1)) n--;
        if (n < i) ar_run_unlink(s, n); /* the run that was under it */
        s->nrec = n;
        if (AR_UNLIKELY(s->holey)) { /* the limit follows the holes */
            ar_rewind(s);
            return MT_OK;
        }
        if (n) {
            if (s->rec[n - 1].chunk == s->cur) {
                s->top = s->rec[n - 1].addr + s->rec[n - 1].bytes;
                return MT_OK;
            }
        } else if (s->cur == 0) {
            s->top = s->chunk[0].base;
            return MT_OK;
        }
        ar_rewind(s);
    } else {
        ar_mark(s, i);
    }
    return MT_OK;
}

static mt_status arena_reset(void *state, mt_scope scope)
{
    arena *a = state;
    if ((unsigned)scope > MT_SCOPE_PHASE) return MT_ERR_INVALID_ARG;
    for (unsigned life = (unsigned)scope; life < MT_LIFE_COUNT; life++) {
        for (unsigned c = 0; c < MT_MEM_COUNT; c++) {
            ar_stack *s = &a->stk[life * MT_MEM_COUNT + c];
            uint64_t bytes = 0, n = 0;
            for (uint32_t i = 0; i < s->nrec; i++) {
                if (s->rec[i].key & 1) continue;
                bytes += s->rec[i].bytes;
                n++;
            }
            ar_count_free(a, c, bytes);
            s->nfreed += n;
            s->nrec = 0;
            s->runs = AR_NONE;
            ar_rewind(s);
        }
    }
    a->st.n_resets++;
    return MT_OK;
}

static mt_status arena_trim(void *state)
{
    arena *a = state;
    size_t got;
    ar_shed(a, NULL, SIZE_MAX, &got);
    a->st.n_trims++;
    return MT_OK;
}

static mt_status arena_stats(void *state, mt_allocator_stats *out)
{
    const arena *a = state;
    if (!out) return MT_ERR_INVALID_ARG;
    *out = a->st;
    out->live_bytes = a->total.in - a->total.out;
    out->peak_live_bytes = a->total.peak;
    for (unsigned c = 0; c < MT_MEM_COUNT; c++) {
        out->per_class[c].live_bytes = a->per[c].in - a->per[c].out;
        out->per_class[c].peak_live_bytes = a->per[c].peak;
    }
    for (unsigned k = 0; k < AR_NSTACK; k++) {
        const ar_stack *s = &a->stk[k];
        out->n_alloc += s->serial;
        out->n_free += s->nfreed;
        out->per_class[s->mclass].n_alloc += s->serial;
        out->per_class[s->mclass].n_free += s->nfreed;
    }
    return MT_OK;
}

static void arena_destroy(void *state)
{
    arena *a = state;
    if (!a) return;
    for (unsigned k = 0; k < AR_NSTACK; k++) {
        ar_stack *s = &a->stk[k];
        for (uint32_t j = s->nchunk; j-- > 0;) ar_chunk_release(a, &s->chunk[j]);
        free(s->chunk);
        free(s->rec);
    }
    free(a);
}

static mt_status arena_create(const mt_allocator_params *params, const mt_backing *bk,
                              void **state)
{
    if (!params || !bk || !state || params->struct_size < sizeof *params)
        return MT_ERR_INVALID_ARG;
    if (bk->abi_version != MT_ALLOCATOR_ABI_VERSION) return MT_ERR_VERSION;
    if (!bk->reserve || !bk->release || !mti_is_pow2(bk->min_alignment) ||
        !mti_is_pow2(bk->granularity))
        return MT_ERR_INVALID_ARG;
    mt_arena_options o;
    mt_arena_options_init(&o);
    if (params->options) {
        const mt_arena_options *u = params->options;
        if (u->struct_size != sizeof o) return MT_ERR_INVALID_ARG;
        o.chunk_bytes = u->chunk_bytes;
    }
    if (o.chunk_bytes == 0 || o.chunk_bytes > MT_MAX_REQUEST) return MT_ERR_INVALID_ARG;

    arena *a = calloc(1, sizeof *a);
    if (!a) return MT_ERR_OOM;
    a->bk = bk;
    a->va = bk->va_reserve && bk->va_commit && bk->va_decommit && bk->va_release;
    a->gran = bk->granularity;
    a->chunk_bytes = ar_align_up(o.chunk_bytes, a->gran);
    a->limit = params->limit_bytes;
    a->range_min = AR_RANGE_MIN;
    for (unsigned k = 0; k < AR_NSTACK; k++) {
        a->stk[k].mclass = k % MT_MEM_COUNT;
        a->stk[k].runs = AR_NONE;
    }
    if (a->limit && a->limit < a->range_min) a->range_min = ar_align_up(a->limit, a->gran);
    if (a->range_min < a->gran) a->range_min = a->gran;
    *state = a;
    return MT_OK;
}

static const mt_allocator_vtable ar_vtable = {
    .abi_version = MT_ALLOCATOR_ABI_VERSION,
    .struct_size = (uint32_t)sizeof(mt_allocator_vtable),
    .name = "arena",
    .caps = MT_ALLOCATOR_CAP_DETECTS_BAD_FREE,
    .create = arena_create,
    .alloc = arena_alloc,
    .free = arena_free,
    .reset = arena_reset,
    .trim = arena_trim,
    .stats = arena_stats,
    .destroy = arena_destroy,
};

const mt_allocator_vtable *mt_allocator_arena(void) { return &ar_vtable; }
