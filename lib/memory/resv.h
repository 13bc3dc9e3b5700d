/*
 * resv.h - the backing reservations an allocator instance holds (resv.c).
 */
#ifndef MT_RESV_H
#define MT_RESV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct mti_resv_slot {
    uintptr_t ptr; /* 0: empty, 1: deleted */
    size_t granted;
} mti_resv_slot;

/* Zero-initialised is empty; free slots with free(). Walk slots[0, cap)
 * for the held ones (ptr > 1). */
typedef struct mti_resv_table {
    mti_resv_slot *slots;
    size_t cap, used, live;
} mti_resv_table;

/* Records p (granted bytes); false when out of host memory. */
bool mti_resv_insert(mti_resv_table *t, uintptr_t p, size_t granted);
/* The granted size of p, or 0 if p is not held. */
size_t mti_resv_find(const mti_resv_table *t, uintptr_t p);
/* Removes p; returns its granted size, or 0 if p is not held. */
size_t mti_resv_remove(mti_resv_table *t, uintptr_t p);

#endif /* MT_RESV_H */
