/*
 * livemap.h - the live blocks of an allocation trace, by (instance, id):
 * what trace validation, replay and the trace exports walk (livemap.c).
 */
#ifndef MT_LIVEMAP_H
#define MT_LIVEMAP_H

#include "internal.h"

typedef struct mti_live_rec {
    uint64_t key;     /* instance << 56 | id */
    uint8_t lifetime;
    uint8_t instance;
    bool failed;      /* replay: the allocator refused it */
    mt_block blk;     /* replay: the block; exports: its bytes and class */
} mti_live_rec;

/* Open addressing; a slot's state is in idx, never in the key, so every
 * 64-bit key is usable: idx 0 is an empty slot, SIZE_MAX a deleted one,
 * anything else the record's index + 1. The records are dense in recs[0, n). */
typedef struct mti_live_map {
    uint64_t *keys;
    size_t *idx;
    size_t cap, used; /* used: slots not empty (deleted ones included) */
    mti_live_rec *recs;
    size_t n, cap_recs;
} mti_live_map;

/* An event's key; ids are below 2^56 in a validated trace, so it is unique. */
uint64_t mti_live_key(const mt_trace_event *e);
/* The index of the live record with key k, or SIZE_MAX. */
size_t mti_live_find(const mti_live_map *m, uint64_t k);
/* false when out of memory. */
bool mti_live_insert(mti_live_map *m, const mti_live_rec *r);
/* Removes record r (the last record moves into its place). */
void mti_live_remove(mti_live_map *m, size_t r);
void mti_live_free(mti_live_map *m);

#endif /* MT_LIVEMAP_H */
