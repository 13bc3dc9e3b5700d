/*
 * shadow.h - an independent model of what an allocator has handed out: the
 * live blocks sorted by address (so overlaps are caught as they happen) and
 * the byte counts per memory class that the stats must match.
 */
#ifndef MT_TEST_SHADOW_H
#define MT_TEST_SHADOW_H

#include <stdbool.h>
#include <stdint.h>

#include "memtrain.h"

typedef struct shadow {
    mt_block *v; /* live blocks, ascending address */
    size_t n, cap;
    uint64_t live[MT_MEM_COUNT], peak[MT_MEM_COUNT];
    uint64_t n_alloc[MT_MEM_COUNT], n_free[MT_MEM_COUNT];
    uint64_t total, total_peak;
} shadow;

void shadow_init(shadow *s);
void shadow_fini(shadow *s);
/* Adds a block; false if it overlaps a live one (the overlapping one in *other). */
bool shadow_add(shadow *s, const mt_block *b, mt_block *other);
/* Removes the i-th live block (ascending address). */
void shadow_remove(shadow *s, size_t i);
/* Index of the block starting at ptr, or SIZE_MAX. */
size_t shadow_find(const shadow *s, const void *ptr);
/* Removes every block with lifetime >= scope. */
void shadow_reset(shadow *s, mt_scope scope);
/* Sets the peaks to the current values. */
void shadow_reset_peaks(shadow *s);
/* Compares stats with the model; writes what differs into why. */
bool shadow_matches(const shadow *s, const mt_allocator_stats *st, char *why, size_t n);

#endif
