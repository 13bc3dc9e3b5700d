/*
 * fill.h - a deferred model's weights made straight into the trainer's
 * homes for them (fill.c).
 */
#ifndef MT_FILL_H
#define MT_FILL_H

#include "train/trainer.h"

/* At create, once the frozen parameters are known: the unmade parameters
 * whose home this trainer makes from the source (trained ones at ZeRO-3,
 * or with offload_params) stay unmade; the others are made whole now. */
mt_status mti_fill_plan(mt_trainer *t);
/* Once every home exists: the unmade parameters' values, this rank's
 * elements only, from the source into their homes (masters, weights in the
 * compute dtype). They stay marked unmade. */
mt_status mti_fill_homes(mt_trainer *t);
/* The creation succeeded on every rank: nothing is unmade now, and the
 * source goes. */
void mti_fill_commit(mt_trainer *t);

#endif /* MT_FILL_H */
