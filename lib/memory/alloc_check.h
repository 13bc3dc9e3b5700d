/*
 * alloc_check.h - the checking mode of allocator instances (alloc_check.c):
 * the memory an instance holds from its backing and the blocks it has
 * handed out, recorded independently of the allocator.
 */
#ifndef MT_ALLOC_CHECK_H
#define MT_ALLOC_CHECK_H

#include "internal.h"

typedef struct mti_checker mti_checker;

/* NULL when out of host memory. */
mti_checker *mti_checker_new(void);
void mti_checker_delete(mti_checker *c);
/* Memory now held from the backing (a reservation, a commit); false when
 * out of host memory. */
bool mti_checker_back(mti_checker *c, const void *p, size_t n);
/* Memory given back (a release, a decommit). */
void mti_checker_unback(mti_checker *c, const void *p, size_t n);
/* Whether a live block overlaps [p, p + n); its id into *id (may be NULL). */
bool mti_checker_live_within(const mti_checker *c, const void *p, size_t n, uint64_t *id);
/* Records a block the allocator handed out (ptr, bytes, id, lifetime set):
 * MT_ERR_PLUGIN, and why, if it is not inside held memory or overlaps a
 * live block; MT_ERR_OOM when out of host memory. */
mt_status mti_checker_add_block(mti_checker *c, const mt_block *b, char *why, size_t cap);
/* The record of a live block exactly as handed out (address, bytes,
 * lifetime), or SIZE_MAX; then mti_checker_remove drops it. */
size_t mti_checker_find(const mti_checker *c, const mt_block *b);
void mti_checker_remove(mti_checker *c, size_t i);
/* Drops every live block whose lifetime is >= scope. */
void mti_checker_reset(mti_checker *c, mt_scope scope);

#endif /* MT_ALLOC_CHECK_H */
