/*
 * checkpoint.h - what the checkpoint-aware allocator tells the rest of the
 * library about its plan (mti_ prefix: internal, not part of the public API).
 *
 * Reports and benchmarks read the summary to show how well the recorded step
 * packed: plan_bytes against plan_live_bytes is the planner's own overhead,
 * n_divergences says how often a step left the plan.
 */
#ifndef MT_ALLOCATORS_CHECKPOINT_H
#define MT_ALLOCATORS_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "memtrain.h"

typedef struct mti_checkpoint_summary {
    bool replaying;              /* a plan is in force (false: recording) */
    size_t plan_bytes;           /* bytes the planned offsets span (0: no plan) */
    size_t plan_live_bytes;      /* most planned bytes live at one time: the lower bound */
    size_t region_bytes;         /* bytes held from the backing for the plan right now */
    size_t n_planned;            /* blocks in the plan */
    size_t n_recomputable;       /* planned blocks recorded as MT_REQ_RECOMPUTABLE */
    size_t recomputable_bytes;   /* their planned bytes */
    uint64_t n_steps;            /* steps ended (a reset of MT_SCOPE_STEP or MT_SCOPE_ALL)
                                    that made at least one step or phase request */
    uint64_t n_recorded_steps;   /* steps served from exact reservations and recorded */
    uint64_t n_divergences;      /* steps that left the plan */
    uint64_t n_plans;            /* plans made: the first one and every re-plan */
    uint64_t n_plan_failures;    /* plans whose region could not be reserved */
    uint64_t last_plan_ns;       /* time the last plan took, nanoseconds */
} mti_checkpoint_summary;

/* The summary of an instance made with mt_allocator_checkpoint().
 * MT_ERR_INVALID_ARG when a or out is NULL or a is another allocator. */
mt_status mti_checkpoint_summary_get(const mt_allocator *a, mti_checkpoint_summary *out);

/* The same from the allocator's state pointer (what its create returned),
 * for code that drives the vtable directly. */
mt_status mti_checkpoint_state_summary(const void *state, mti_checkpoint_summary *out);

#endif /* MT_ALLOCATORS_CHECKPOINT_H */
