/*
 * shadow.c - the independent model of live blocks (see shadow.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shadow.h"

void shadow_init(shadow *s) { memset(s, 0, sizeof *s); }
void shadow_fini(shadow *s) { free(s->v); memset(s, 0, sizeof *s); }

/* first index whose ptr is >= p */
static size_t lower(const shadow *s, uintptr_t p)
{
    size_t lo = 0, hi = s->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((uintptr_t)s->v[mid].ptr < p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

bool shadow_add(shadow *s, const mt_block *b, mt_block *other)
{
    uintptr_t p = (uintptr_t)b->ptr;
    size_t i = lower(s, p);
    if (i < s->n && (uintptr_t)s->v[i].ptr < p + b->bytes) {
        if (other) *other = s->v[i];
        return false;
    }
    if (i > 0 && (uintptr_t)s->v[i - 1].ptr + s->v[i - 1].bytes > p) {
        if (other) *other = s->v[i - 1];
        return false;
    }
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 256;
        s->v = realloc(s->v, s->cap * sizeof *s->v);
    }
    memmove(&s->v[i + 1], &s->v[i], (s->n - i) * sizeof *s->v);
    s->v[i] = *b;
    s->n++;
    mt_mem_class c = b->mem_class;
    s->live[c] += b->bytes;
    if (s->live[c] > s->peak[c]) s->peak[c] = s->live[c];
    s->n_alloc[c]++;
    s->total += b->bytes;
    if (s->total > s->total_peak) s->total_peak = s->total;
    return true;
}

void shadow_remove(shadow *s, size_t i)
{
    mt_mem_class c = s->v[i].mem_class;
    s->live[c] -= s->v[i].bytes;
    s->total -= s->v[i].bytes;
    s->n_free[c]++;
    memmove(&s->v[i], &s->v[i + 1], (s->n - i - 1) * sizeof *s->v);
    s->n--;
}

size_t shadow_find(const shadow *s, const void *ptr)
{
    size_t i = lower(s, (uintptr_t)ptr);
    return i < s->n && s->v[i].ptr == ptr ? i : SIZE_MAX;
}

void shadow_reset(shadow *s, mt_scope scope)
{
    for (size_t i = s->n; i-- > 0;)
        if ((int)s->v[i].lifetime >= (int)scope) shadow_remove(s, i);
}

void shadow_reset_peaks(shadow *s)
{
    for (int c = 0; c < MT_MEM_COUNT; c++) s->peak[c] = s->live[c];
    s->total_peak = s->total;
}

bool shadow_matches(const shadow *s, const mt_allocator_stats *st, char *why, size_t n)
{
    uint64_t na = 0, nf = 0;
    for (int c = 0; c < MT_MEM_COUNT; c++) {
        const mt_class_stats *k = &st->per_class[c];
        if (k->live_bytes != s->live[c] || k->peak_live_bytes != s->peak[c] ||
            k->n_alloc != s->n_alloc[c] || k->n_free != s->n_free[c]) {
            snprintf(why, n,
                     "class %s: live %llu/%llu peak %llu/%llu allocs %llu/%llu frees %llu/%llu "
                     "(stats/model)",
                     mt_mem_class_name((mt_mem_class)c), (unsigned long long)k->live_bytes,
                     (unsigned long long)s->live[c], (unsigned long long)k->peak_live_bytes,
                     (unsigned long long)s->peak[c], (unsigned long long)k->n_alloc,
                     (unsigned long long)s->n_alloc[c], (unsigned long long)k->n_free,
                     (unsigned long long)s->n_free[c]);
            return false;
        }
        na += s->n_alloc[c];
        nf += s->n_free[c];
    }
    if (st->live_bytes != s->total || st->peak_live_bytes != s->total_peak ||
        st->n_alloc != na || st->n_free != nf) {
        snprintf(why, n, "total: live %llu/%llu peak %llu/%llu allocs %llu/%llu frees %llu/%llu",
                 (unsigned long long)st->live_bytes, (unsigned long long)s->total,
                 (unsigned long long)st->peak_live_bytes, (unsigned long long)s->total_peak,
                 (unsigned long long)st->n_alloc, (unsigned long long)na,
                 (unsigned long long)st->n_free, (unsigned long long)nf);
        return false;
    }
    if (st->live_bytes > st->reserved_bytes || st->peak_live_bytes > st->peak_reserved_bytes ||
        st->reserved_bytes > st->peak_reserved_bytes || st->n_free > st->n_alloc) {
        snprintf(why, n, "invariant broken: live %llu reserved %llu peak live %llu peak reserved %llu",
                 (unsigned long long)st->live_bytes, (unsigned long long)st->reserved_bytes,
                 (unsigned long long)st->peak_live_bytes,
                 (unsigned long long)st->peak_reserved_bytes);
        return false;
    }
    return true;
}
