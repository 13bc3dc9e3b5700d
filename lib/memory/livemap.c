/*
 * livemap.c - the live blocks of an allocation trace (livemap.h).
 */
#include <stdlib.h>

#include "memory/livemap.h"

#define SLOT_GONE SIZE_MAX

uint64_t mti_live_key(const mt_trace_event *e)
{
    return ((uint64_t)e->instance << 56) | e->id;
}

static size_t slot_of(uint64_t k, size_t cap)
{
    return (size_t)((k * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

void mti_live_free(mti_live_map *m)
{
    free(m->keys);
    free(m->idx);
    free(m->recs);
}

static bool map_rehash(mti_live_map *m, size_t ncap)
{
    uint64_t *nk = malloc(ncap * sizeof *nk);
    size_t *ni = calloc(ncap, sizeof *ni);
    if (!nk || !ni) {
        free(nk);
        free(ni);
        return false;
    }
    for (size_t r = 0; r < m->n; r++) {
        size_t j = slot_of(m->recs[r].key, ncap);
        while (ni[j]) j = (j + 1) & (ncap - 1);
        nk[j] = m->recs[r].key;
        ni[j] = r + 1;
    }
    free(m->keys);
    free(m->idx);
    m->keys = nk;
    m->idx = ni;
    m->cap = ncap;
    m->used = m->n;
    return true;
}

/* The slot holding key k, or SIZE_MAX. */
static size_t map_slot(const mti_live_map *m, uint64_t k)
{
    if (!m->cap) return SIZE_MAX;
    size_t j = slot_of(k, m->cap);
    while (m->idx[j]) {
        if (m->idx[j] != SLOT_GONE && m->keys[j] == k) return j;
        j = (j + 1) & (m->cap - 1);
    }
    return SIZE_MAX;
}

size_t mti_live_find(const mti_live_map *m, uint64_t k)
{
    size_t j = map_slot(m, k);
    return j == SIZE_MAX ? SIZE_MAX : m->idx[j] - 1;
}

bool mti_live_insert(mti_live_map *m, const mti_live_rec *r)
{
    if ((m->used + 1) * 2 > m->cap) {
        /* grow for the live records; rehashing also clears deleted slots */
        size_t ncap = 1024;
        while ((m->n + 1) * 4 > ncap) ncap *= 2;
        if (!map_rehash(m, ncap)) return false;
    }
    if (m->n == m->cap_recs) {
        size_t nc = m->cap_recs ? 2 * m->cap_recs : 1024;
        mti_live_rec *nr = realloc(m->recs, nc * sizeof *nr);
        if (!nr) return false;
        m->recs = nr;
        m->cap_recs = nc;
    }
    size_t j = slot_of(r->key, m->cap);
    while (m->idx[j] && m->idx[j] != SLOT_GONE) j = (j + 1) & (m->cap - 1);
    if (!m->idx[j]) m->used++;
    m->keys[j] = r->key;
    m->idx[j] = m->n + 1;
    m->recs[m->n++] = *r;
    return true;
}

void mti_live_remove(mti_live_map *m, size_t r)
{
    size_t last = m->n - 1;
    m->idx[map_slot(m, m->recs[r].key)] = SLOT_GONE;
    if (r != last) {
        m->recs[r] = m->recs[last];
        m->idx[map_slot(m, m->recs[r].key)] = r + 1;
    }
    m->n--;
}

