/*
 * alloc_check.c - the checking mode of allocator instances
 * (MT_ALLOCATOR_CHECKED): an independent record of what the instance holds
 * from its backing and of the blocks it has handed out, so that a plug-in
 * that hands out memory it does not hold, or the same bytes twice, is
 * caught at the call that does it rather than as wrong results or a crash
 * later.
 *
 * Two sorted arrays of address ranges [lo, hi): the backed memory (plain
 * reservations and the committed parts of growable ranges, adjacent ranges
 * merged) and the live blocks. A new block must lie inside one backed range
 * and overlap no live block (a binary search and a look at the neighbours);
 * insertions and removals move the tail of an array, which is cheap for the
 * thousands of blocks a training step holds. This is a debugging mode: the
 * common path of an unchecked instance never comes here.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory/alloc_check.h"

typedef struct ck_range {
    uintptr_t lo, hi;
    uint64_t id;       /* live blocks: the block's id */
    uint32_t lifetime; /* live blocks */
} ck_range;

typedef struct ck_set {
    ck_range *v;
    size_t n, cap;
} ck_set;

struct mti_checker {
    ck_set backed, live;
};

static bool set_room(ck_set *s, size_t more)
{
    if (s->n + more <= s->cap) return true;
    size_t cap = s->cap ? s->cap * 2 : 64;
    while (cap < s->n + more) cap *= 2;
    ck_range *v = realloc(s->v, cap * sizeof *v);
    if (!v) return false;
    s->v = v, s->cap = cap;
    return true;
}

/* The first range whose lo is > x. */
static size_t upper(const ck_set *s, uintptr_t x)
{
    size_t a = 0, b = s->n;
    while (a < b) {
        size_t m = a + (b - a) / 2;
        if (s->v[m].lo <= x) a = m + 1;
        else b = m;
    }
    return a;
}

static void insert_at(ck_set *s, size_t i, ck_range r)
{
    memmove(&s->v[i + 1], &s->v[i], (s->n - i) * sizeof *s->v);
    s->v[i] = r;
    s->n++;
}

static void remove_at(ck_set *s, size_t i)
{
    memmove(&s->v[i], &s->v[i + 1], (s->n - i - 1) * sizeof *s->v);
    s->n--;
}

/* The index of a live range overlapping [lo, hi), or SIZE_MAX. */
static size_t overlapping(const ck_set *s, uintptr_t lo, uintptr_t hi)
{
    size_t i = upper(s, lo); /* ranges before i start at or below lo */
    if (i > 0 && s->v[i - 1].hi > lo) return i - 1;
    if (i < s->n && s->v[i].lo < hi) return i;
    return SIZE_MAX;
}

mti_checker *mti_checker_new(void) { return calloc(1, sizeof(mti_checker)); }

void mti_checker_delete(mti_checker *c)
{
    if (!c) return;
    free(c->backed.v);
    free(c->live.v);
    free(c);
}

bool mti_checker_back(mti_checker *c, const void *p, size_t n)
{
    ck_set *s = &c->backed;
    uintptr_t lo = (uintptr_t)p, hi = lo + n;
    if (!set_room(s, 1)) return false;
    size_t i = upper(s, lo);
    /* merge with a neighbour that touches or overlaps */
    if (i > 0 && s->v[i - 1].hi >= lo) {
        if (s->v[i - 1].hi < hi) s->v[i - 1].hi = hi;
        i--;
    } else {
        insert_at(s, i, (ck_range){lo, hi, 0, 0});
    }
    while (i + 1 < s->n && s->v[i + 1].lo <= s->v[i].hi) {
        if (s->v[i + 1].hi > s->v[i].hi) s->v[i].hi = s->v[i + 1].hi;
        remove_at(s, i + 1);
    }
    return true;
}

void mti_checker_unback(mti_checker *c, const void *p, size_t n)
{
    ck_set *s = &c->backed;
    uintptr_t lo = (uintptr_t)p, hi = lo + n;
    /* splitting a range needs one more slot; without it the whole range
       goes (blocks in its rest are then reported, never missed) */
    bool room = set_room(s, 1);
    size_t i = upper(s, lo);
    if (i > 0) i--;
    while (i < s->n && s->v[i].lo < hi) {
        ck_range *r = &s->v[i];
        if (r->hi <= lo) {
            i++;
            continue;
        }
        if (r->lo < lo && r->hi > hi && room) { /* a hole in the middle */
            ck_range tail = {hi, r->hi, 0, 0};
            r->hi = lo;
            insert_at(s, i + 1, tail);
            return;
        }
        if (r->lo < lo && room) {
            r->hi = lo;
            i++;
        } else if (r->hi > hi && room) {
            r->lo = hi;
            i++;
        } else {
            remove_at(s, i);
        }
    }
}

bool mti_checker_live_within(const mti_checker *c, const void *p, size_t n, uint64_t *id)
{
    size_t i = overlapping(&c->live, (uintptr_t)p, (uintptr_t)p + n);
    if (i == SIZE_MAX) return false;
    if (id) *id = c->live.v[i].id;
    return true;
}

mt_status mti_checker_add_block(mti_checker *c, const mt_block *b, char *why, size_t cap)
{
    uintptr_t lo = (uintptr_t)b->ptr, hi = lo + b->bytes;
    if (hi < lo) {
        snprintf(why, cap, "returned a block at %p of %zu bytes that wraps around the address "
                 "space", b->ptr, b->bytes);
        return MT_ERR_PLUGIN;
    }
    const ck_set *k = &c->backed;
    size_t i = upper(k, lo);
    if (i == 0 || k->v[i - 1].hi < hi) {
        snprintf(why, cap, "returned a block at %p of %zu bytes that is not inside memory it "
                 "holds from its backing", b->ptr, b->bytes);
        return MT_ERR_PLUGIN;
    }
    ck_set *s = &c->live;
    size_t o = overlapping(s, lo, hi);
    if (o != SIZE_MAX) {
        snprintf(why, cap, "returned a block at %p of %zu bytes that overlaps live block %llu "
                 "at %p of %zu bytes", b->ptr, b->bytes, (unsigned long long)s->v[o].id,
                 (void *)s->v[o].lo, (size_t)(s->v[o].hi - s->v[o].lo));
        return MT_ERR_PLUGIN;
    }
    if (!set_room(s, 1)) {
        snprintf(why, cap, "out of host memory for the checking mode's records");
        return MT_ERR_OOM;
    }
    insert_at(s, upper(s, lo), (ck_range){lo, hi, b->id, (uint32_t)b->lifetime});
    return MT_OK;
}

size_t mti_checker_find(const mti_checker *c, const mt_block *b)
{
    const ck_set *s = &c->live;
    uintptr_t lo = (uintptr_t)b->ptr;
    size_t i = upper(s, lo);
    if (i == 0) return SIZE_MAX;
    const ck_range *r = &s->v[i - 1];
    return r->lo == lo && r->hi - r->lo == b->bytes && r->lifetime == (uint32_t)b->lifetime
               ? i - 1
               : SIZE_MAX;
}

void mti_checker_remove(mti_checker *c, size_t i) { remove_at(&c->live, i); }

void mti_checker_reset(mti_checker *c, mt_scope scope)
{
    ck_set *s = &c->live;
    size_t k = 0;
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i].lifetime < (uint32_t)scope) s->v[k++] = s->v[i];
    s->n = k;
}
