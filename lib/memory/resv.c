/*
 * resv.c - the backing reservations an allocator instance holds: a small
 * open-addressing table of (address -> granted bytes), so the wrapper
 * (allocator.c) can check the allocator's releases and give back at
 * destroy what a faulty allocator leaked. Backing calls are rare (segments,
 * not blocks), so this is off the hot path.
 */
#include <stdlib.h>

#include "memory/resv.h"

static size_t hash_ptr(uintptr_t p, size_t cap)
{
    uint64_t x = (uint64_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 20) & (cap - 1);
}

static bool grow(mti_resv_table *t)
{
    size_t ncap = t->cap ? t->cap * 2 : 64;
    mti_resv_slot *ns = calloc(ncap, sizeof *ns);
    if (!ns) return false;
    for (size_t i = 0; i < t->cap; i++) {
        if (t->slots[i].ptr <= 1) continue;
        size_t j = hash_ptr(t->slots[i].ptr, ncap);
        while (ns[j].ptr) j = (j + 1) & (ncap - 1);
        ns[j] = t->slots[i];
    }
    free(t->slots);
    t->slots = ns;
    t->cap = ncap;
    t->used = t->live;
    return true;
}

bool mti_resv_insert(mti_resv_table *t, uintptr_t p, size_t granted)
{
    if ((t->used + 1) * 4 >= t->cap * 3 && !grow(t)) return false;
    size_t j = hash_ptr(p, t->cap);
    while (t->slots[j].ptr > 1) j = (j + 1) & (t->cap - 1);
    if (t->slots[j].ptr == 0) t->used++;
    t->slots[j].ptr = p;
    t->slots[j].granted = granted;
    t->live++;
    return true;
}

size_t mti_resv_find(const mti_resv_table *t, uintptr_t p)
{
    if (!t->cap) return 0;
    for (size_t j = hash_ptr(p, t->cap); t->slots[j].ptr; j = (j + 1) & (t->cap - 1))
        if (t->slots[j].ptr == p) return t->slots[j].granted;
    return 0;
}

size_t mti_resv_remove(mti_resv_table *t, uintptr_t p)
{
    if (!t->cap) return 0;
    size_t j = hash_ptr(p, t->cap);
    while (t->slots[j].ptr) {
        if (t->slots[j].ptr == p) {
            size_t g = t->slots[j].granted;
            t->slots[j].ptr = 1;
            t->live--;
            return g;
        }
        j = (j + 1) & (t->cap - 1);
    }
    return 0;
}
