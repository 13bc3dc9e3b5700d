/*
 * arena.c - the arena allocator: bump allocation in stacks, freed by scope.
 *
 * Every (lifetime, memory class) pair has its own stack, 21 in all. A block
 * is carved from the top of its stack with one add and one compare. The
 * split by class matters in training: in backward, activations are freed
 * (top of the ACT stack, so it shrinks) while gradients are allocated (top of
 * the GRAD stack); one stack per lifetime would bury the freed activations
 * under the gradients. reset(scope) rewinds the stacks whose lifetime is
 * >= scope and keeps their memory for the next step.
 *
 * Each stack keeps a host-side record per block (address, bytes, a tag,
 * a freed flag), in allocation order. Freeing the top block pops it and
 * any already-freed records below it, so the stack shrinks as soon as a
 * LIFO run ends; freeing another block only marks it. The handle names the
 * stack, the record and the tag (a count of the stack's allocations), so
 * double frees and frees after a reset find a record with another tag or
 * none, and are refused (MT_ERR_BAD_BLOCK) without touching anything.
 *
 * Memory: a stack is a list of chunks. Where the backing offers growable
 * ranges, a chunk is a reserved address range (1 GiB, or the instance's
 * limit if smaller; each further range of a stack twice the last) committed
 * piece by piece as the top grows, by 1/16 of what it holds (at least the
 * granularity, at most chunk_bytes), so there is no tail waste. Memory
 * above the tops (a shrunk stack, empty spare chunks) is kept for reuse,
 * but before a stack commits more, the others give back whole pieces until
 * what they hold above their tops is at most 1/16 of the reserved bytes:
 * memory released by the activations serves the gradients. Without ranges,
 * a chunk is a reservation of chunk_bytes (larger for a larger request);
 * empty chunks move between stacks at no cost. trim gives back everything
 * above the tops. Pieces are decommitted whole, newest first, exactly as
 * they were committed.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "memtrain.h"
#include "memtrain/allocator.h"
#include "internal.h"

#if defined(__GNUC__)
#define AR_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define AR_UNLIKELY(x) (x)
#endif

#define AR_NSTACK (MT_LIFE_COUNT * MT_MEM_COUNT)
/* handle = tag (33 bits) | stack + 1 (5 bits) | record index (26 bits) */
#define AR_IDX_BITS 26
#define AR_STK_BITS 5
#define AR_TAG_SHIFT (AR_IDX_BITS + AR_STK_BITS)
#define AR_TAG_MASK ((UINT64_C(1) << (64 - AR_TAG_SHIFT)) - 1)
#define AR_MAX_REC ((uint32_t)1 << AR_IDX_BITS)
#define AR_RANGE_MIN ((size_t)1 << 30) /* bytes of address space of a first range */
#define AR_RANGE_MAX ((size_t)1 << 36) /* ... and at most, unless one request needs more */
#define AR_GROW_DIV 16                 /* a range grows by >= 1/16 of its commit */
#define AR_SLACK_DIV 16                /* memory above the tops: <= 1/16 of reserved */

typedef struct ar_rec {
    uintptr_t addr;  /* first byte of the block */
    size_t bytes;    /* as requested */
    uint64_t key;    /* tag << 1 | freed */
    uint32_t chunk;  /* index of its chunk in the stack's list */
} ar_rec;

typedef struct ar_chunk {
    uintptr_t base;
    size_t size;      /* bytes of address space (granted size of a reservation) */
    size_t committed; /* bytes backed from base; == size for a reservation */
    size_t *pieces;   /* ranges: the size of each commit, oldest first */
    uint32_t npieces, cap_pieces;
    bool va;          /* a growable range, else a plain reservation */
} ar_chunk;

typedef struct ar_stack {
    uintptr_t top;   /* next free byte in the current chunk (0: no chunk) */
    uintptr_t limit; /* end of the committed bytes of the current chunk */
    ar_rec *rec;     /* live and freed-but-buried blocks, in allocation order */
    uint32_t nrec, cap;
    uint32_t cur;    /* chunk of the last record; 0 when there is none */
    uint32_t nchunk, cap_chunk;
    ar_chunk *chunk; /* chunks past cur (all of them when nrec == 0) are spares */
    uint64_t serial; /* allocations made, the source of tags */
    uint64_t live_bytes, n_live;
} ar_stack;

typedef struct arena {
    ar_stack stk[AR_NSTACK];
    const mt_backing *bk;
    bool va;            /* the backing offers growable ranges */
    size_t gran;        /* commit multiple (bytes) */
    size_t chunk_bytes; /* plain chunk size; cap of one commit step */
    size_t range_min;   /* first range of a stack (bytes of address space) */
    size_t limit;       /* the instance's limit, 0 = none (for sizing only) */
    mt_allocator_stats st;
} arena;

void mt_arena_options_init(mt_arena_options *o)
{
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->struct_size = (uint32_t)sizeof *o;
    o->chunk_bytes = (size_t)64 << 20;
}

static size_t ar_align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

/* ---- stack position ---- */

static uint32_t ar_spare_from(const ar_stack *s) { return s->nrec ? s->cur + 1 : 0; }

static void ar_set_cur(ar_stack *s, uint32_t cur, uintptr_t top)
{
    s->cur = cur;
    s->top = top;
    s->limit = s->nchunk ? s->chunk[cur].base + s->chunk[cur].committed : 0;
}

/* Puts top right after the last record (or at the start of chunk 0). */
static void ar_rewind(ar_stack *s)
{
    if (s->nrec) {
        const ar_rec *r = &s->rec[s->nrec - 1];
        ar_set_cur(s, r->chunk, r->addr + r->bytes);
    } else {
        ar_set_cur(s, 0, s->nchunk ? s->chunk[0].base : 0);
    }
}

/* ---- giving memory back ---- */

/* Decommits whole pieces of a range lying at or above offset keep (bytes). */
static size_t ar_decommit_above(arena *a, ar_chunk *c, size_t keep)
{
    size_t freed = 0;
    while (c->npieces && c->committed - c->pieces[c->npieces - 1] >= keep) {
        size_t pz = c->pieces[--c->npieces];
        c->committed -= pz;
        a->bk->va_decommit(a->bk->self, (void *)(c->base + c->committed), pz);
        mt_stats_on_release(&a->st, pz);
        freed += pz;
    }
    return freed;
}

static void ar_chunk_release(arena *a, ar_chunk *c)
{
    if (c->va) {
        ar_decommit_above(a, c, 0);
        a->bk->va_release(a->bk->self, (void *)c->base, c->size);
        free(c->pieces);
    } else {
        a->bk->release(a->bk->self, (void *)c->base, c->size);
        mt_stats_on_release(&a->st, c->size);
    }
}

/* Bytes of the range's pieces lying wholly above offset used. */
static size_t ar_tail_excess(const arena *a, const ar_chunk *c, size_t used)
{
    size_t keep = ar_align_up(used, a->gran), at = c->committed, n = 0;
    for (uint32_t k = c->npieces; k-- > 0 && at - c->pieces[k] >= keep;) {
        at -= c->pieces[k];
        n += c->pieces[k];
    }
    return n;
}

/* Committed bytes held above the stacks' tops, the chunk skip excepted. */
static size_t ar_excess(const arena *a, const ar_chunk *skip)
{
    size_t n = 0;
    for (unsigned k = 0; k < AR_NSTACK; k++) {
        const ar_stack *s = &a->stk[k];
        for (uint32_t j = ar_spare_from(s); j < s->nchunk; j++)
            if (&s->chunk[j] != skip) n += s->chunk[j].committed;
        if (s->nrec && s->chunk[s->cur].va && &s->chunk[s->cur] != skip)
            n += ar_tail_excess(a, &s->chunk[s->cur], s->top - s->chunk[s->cur].base);
    }
    return n;
}

/* Gives back memory above the tops (spare chunks first, then the tails of
 * the current ranges) until at most keep bytes of it are left. skip is a
 * chunk being grown, always the current chunk of its stack, so removing
 * spares never moves it. Returns how many things were given back. */
static unsigned ar_shed(arena *a, const ar_chunk *skip, size_t keep)
{
    size_t excess = ar_excess(a, skip);
    unsigned done = 0;
    for (unsigned k = 0; k < AR_NSTACK && excess > keep; k++) {
        ar_stack *s = &a->stk[k];
        uint32_t from = ar_spare_from(s);
        for (uint32_t j = s->nchunk; j-- > from && excess > keep;) {
            if (&s->chunk[j] == skip) continue;
            excess -= s->chunk[j].committed;
            ar_chunk_release(a, &s->chunk[j]);
            memmove(&s->chunk[j], &s->chunk[j + 1], (s->nchunk - j - 1) * sizeof *s->chunk);
            s->nchunk--;
            done++;
        }
        if (!s->nrec) ar_rewind(s);
    }
    for (unsigned k = 0; k < AR_NSTACK && excess > keep; k++) {
        ar_stack *s = &a->stk[k];
        if (!s->nrec || !s->chunk[s->cur].va || &s->chunk[s->cur] == skip) continue;
        ar_chunk *c = &s->chunk[s->cur];
        size_t freed = ar_decommit_above(a, c, ar_align_up(s->top - c->base, a->gran));
        if (freed) done++;
        excess -= freed;
        s->limit = c->base + c->committed;
    }
    return done;
}

/* Before taking delta more bytes from the backing: if the stacks hold too
 * much above their tops, give the older part of it back first. */
static void ar_balance(arena *a, const ar_chunk *skip, size_t delta)
{
    size_t budget = (size_t)(a->st.reserved_bytes + delta) / AR_SLACK_DIV;
    if (budget < 4 * a->gran) budget = 4 * a->gran;
    if (ar_excess(a, skip) > budget) ar_shed(a, skip, budget / 2);
}

/* ---- taking memory ---- */

static bool ar_reserve_room(size_t *cap, size_t n, size_t elem, void **arr)
{
    if (n < *cap) return true;
    size_t nc = *cap ? *cap * 2 : 8;
    void *p = realloc(*arr, nc * elem);
    if (!p) return false;
    *arr = p;
    *cap = nc;
    return true;
}

static bool ar_room_u32(uint32_t *cap, uint32_t n, size_t elem, void **arr)
{
    size_t c = *cap;
    if (!ar_reserve_room(&c, n, elem, arr)) return false;
    *cap = (uint32_t)c;
    return true;
}

/* Commits range c up to at least offset need (bytes). */
static mt_status ar_commit(arena *a, ar_chunk *c, size_t need)
{
    size_t gran = a->gran;
    size_t want = ar_align_up(need, gran);
    if (want <= c->committed) return MT_OK;
    if (need > c->size) return MT_ERR_OOM;
    size_t step = ar_align_up(c->committed / AR_GROW_DIV, gran);
    if (step > a->chunk_bytes) step = a->chunk_bytes;
    if (step < gran) step = gran;
    size_t target = c->committed + step > want ? c->committed + step : want;
    if (target > c->size) target = c->size;
    if (a->limit) { /* overshoot only within the limit */
        uint64_t room = a->limit > a->st.reserved_bytes ? a->limit - a->st.reserved_bytes : 0;
        if (target - c->committed > room) {
            size_t t = c->committed + (size_t)room / gran * gran;
            target = t > want ? t : want;
        }
    }
    if (!ar_room_u32(&c->cap_pieces, c->npieces, sizeof *c->pieces, (void **)&c->pieces))
        return MT_ERR_OOM;
    ar_balance(a, c, target - c->committed);
    void *at = (void *)(c->base + c->committed);
    mt_status st = a->bk->va_commit(a->bk->self, at, target - c->committed);
    if (st != MT_OK) {
        /* release what others hold, then ask for the bare need */
        bool shed = ar_shed(a, c, 0) > 0;
        if (shed || target > want) {
            a->st.n_oom_retries++;
            target = want;
            st = a->bk->va_commit(a->bk->self, at, target - c->committed);
        }
        if (st != MT_OK) return st;
    }
    size_t delta = target - c->committed;
    c->pieces[c->npieces++] = delta;
    c->committed = target;
    mt_stats_on_reserve(&a->st, delta);
    return MT_OK;
}

/* A new chunk from the backing, able to hold bytes at alignment al. */
static mt_status ar_new_chunk(arena *a, ar_stack *s, size_t bytes, size_t al, ar_chunk *c)
{
    memset(c, 0, sizeof *c);
    const mt_backing *bk = a->bk;
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
        if (st != MT_OK && ar_shed(a, NULL, 0) > 0) { /* spare ranges hold address space */
            a->st.n_oom_retries++;
            st = bk->va_reserve(bk->self, r, &base);
        }
        if (st != MT_OK) return st;
        c->base = (uintptr_t)base;
        c->size = r;
        c->va = true;
        return MT_OK;
    }
    size_t want = a->chunk_bytes;
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
    if (st != MT_OK && ar_shed(a, NULL, 0) > 0) {
        a->st.n_oom_retries++;
        st = bk->reserve(bk->self, want, ask_al, &p, &granted);
    }
    if (st != MT_OK) return st;
    c->base = (uintptr_t)p;
    c->size = c->committed = granted;
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
        ar_decommit_above(a, old, ar_align_up(s->top - old->base, a->gran));
        s->limit = old->base + old->committed;
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
    if (!ar_room_u32(&s->cap_chunk, s->nchunk, sizeof *s->chunk, (void **)&s->chunk))
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
 * in one chunk, wide enough for the request. Its first record is reused
 * (records stay in address order; the others stay freed). */
static bool ar_fit_hole(const ar_stack *s, size_t bytes, size_t al, uint32_t *ri, uintptr_t *pp)
{
    const ar_rec *rec = s->rec;
    for (uint32_t j = 0, k; j < s->nrec; j = k + 1) {
        k = j;
        if (!(rec[j].key & 1)) continue;
        while (k + 1 < s->nrec && (rec[k + 1].key & 1) && rec[k + 1].chunk == rec[j].chunk) k++;
        const ar_chunk *c = &s->chunk[rec[j].chunk];
        uintptr_t lo = j && rec[j - 1].chunk == rec[j].chunk ? rec[j - 1].addr + rec[j - 1].bytes
                                                             : c->base;
        uintptr_t hi = k + 1 < s->nrec && rec[k + 1].chunk == rec[j].chunk ? rec[k + 1].addr
                                                                           : c->base + c->committed;
        uintptr_t p = ar_align_up(lo, al);
        if (p >= lo && p <= hi && bytes <= hi - p) {
            *ri = j;
            *pp = p;
            return true;
        }
    }
    return false;
}

/* Makes room for the request at the top of s: record space, a chunk that
 * can hold it, committed memory. *pp gets its address. */
static mt_status ar_make_room(arena *a, ar_stack *s, size_t bytes, size_t al, uintptr_t *pp)
{
    if (s->nrec == s->cap) {
        size_t cap = s->cap;
        if (s->nrec >= AR_MAX_REC || !ar_reserve_room(&cap, s->nrec, sizeof *s->rec, (void **)&s->rec))
            return MT_ERR_OOM;
        s->cap = cap > AR_MAX_REC ? AR_MAX_REC : (uint32_t)cap;
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
        mt_status st = ar_commit(a, c, p + bytes - c->base);
        if (st != MT_OK) {
            ar_rewind(s); /* a chunk just taken stays as a spare */
            return st;
        }
        s->limit = c->base + c->committed;
    }
    *pp = p;
    return MT_OK;
}

static mt_status ar_alloc_slow(arena *a, unsigned si, const mt_alloc_request *req, mt_block *out)
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
    uint64_t tag = s->serial++ & AR_TAG_MASK;
    ar_rec *r = &s->rec[i];
    r->addr = p;
    r->bytes = bytes;
    r->key = tag << 1;
    s->live_bytes += bytes;
    s->n_live++;
    mt_stats_on_alloc(&a->st, req->mem_class, bytes);
    out->ptr = (void *)p;
    out->handle = tag << AR_TAG_SHIFT | (uint64_t)(si + 1) << AR_IDX_BITS | i;
    return MT_OK;
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
    if (AR_UNLIKELY(end > s->limit || end < p || s->nrec == s->cap))
        return ar_alloc_slow(a, si, req, out);
    uint32_t i = s->nrec++;
    uint64_t tag = s->serial++ & AR_TAG_MASK;
    ar_rec *r = &s->rec[i];
    r->addr = p;
    r->bytes = req->bytes;
    r->key = tag << 1;
    r->chunk = s->cur;
    s->top = end;
    s->live_bytes += req->bytes;
    s->n_live++;
    mt_stats_on_alloc(&a->st, req->mem_class, req->bytes);
    out->ptr = (void *)p;
    out->handle = tag << AR_TAG_SHIFT | (uint64_t)(si + 1) << AR_IDX_BITS | i;
    return MT_OK;
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
    s->live_bytes -= r->bytes;
    s->n_live--;
    mt_stats_on_free(&a->st, (mt_mem_class)(si % MT_MEM_COUNT), r->bytes);
    if (i + 1 == s->nrec) {
        /* pop it and the freed records it was covering */
        uint32_t n = i;
        while (n && (s->rec[n - 1].key & 1)) n--;
        s->nrec = n;
        if (n && s->rec[n - 1].chunk == s->cur)
            s->top = s->rec[n - 1].addr + s->rec[n - 1].bytes;
        else
            ar_rewind(s);
    } else {
        r->key |= 1;
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
            a->st.live_bytes -= s->live_bytes;
            a->st.n_free += s->n_live;
            a->st.per_class[c].live_bytes -= s->live_bytes;
            a->st.per_class[c].n_free += s->n_live;
            s->live_bytes = s->n_live = 0;
            s->nrec = 0;
            ar_rewind(s);
        }
    }
    a->st.n_resets++;
    return MT_OK;
}

static mt_status arena_trim(void *state)
{
    arena *a = state;
    ar_shed(a, NULL, 0);
    a->st.n_trims++;
    return MT_OK;
}

static mt_status arena_stats(void *state, mt_allocator_stats *out)
{
    const arena *a = state;
    if (!out) return MT_ERR_INVALID_ARG;
    *out = a->st;
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
    if (!params || !bk || !state) return MT_ERR_INVALID_ARG;
    if (bk->abi_version != MT_ALLOCATOR_ABI_VERSION) return MT_ERR_VERSION;
    if (!bk->reserve || !bk->release || !mti_is_pow2(bk->min_alignment) ||
        !mti_is_pow2(bk->granularity))
        return MT_ERR_INVALID_ARG;
    mt_arena_options o;
    mt_arena_options_init(&o);
    if (params->options) {
        const mt_arena_options *u = params->options;
        if (u->struct_size < sizeof o) return MT_ERR_INVALID_ARG;
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
