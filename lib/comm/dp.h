/*
 * comm/dp.h - data parallel training (dp.c): what the trainer calls so that
 * ranks sharing a communicator train one model on a global batch.
 * Every function is a no-op returning its status argument (or MT_OK) in a
 * world of one rank.
 */
#ifndef MT_COMM_DP_H
#define MT_COMM_DP_H

#include "comm/comm.h"

typedef struct mt_trainer mt_trainer;

/* Whether the trainer's context has more than one rank. */
bool mti_dp_on(const mt_trainer *t);
/* mt_trainer_create, first: the ranks' models and settings agree (one
 * all-gather). Every rank gets MT_ERR_COMM naming the first setting group
 * that differs. */
mt_status mti_dp_agree_config(mt_context *ctx, const mt_model *m, const mt_trainer_config *cfg);
/* mt_trainer_create, last, with its status s: fails on every rank when any
 * rank failed, or when the weights differ. */
mt_status mti_dp_created(mt_trainer *t, mt_status s);
/* A step, after its batch checks (status s): fails on every rank when any
 * rank's batch was refused; *targets (this rank's) becomes the global
 * batch's. */
mt_status mti_dp_begin(mt_trainer *t, const char *fn, mt_status s, double *targets);
/* A step, after forward and backward (status s): fails on every rank when
 * any rank failed; *loss_sum (this rank's) becomes the global batch's. */
mt_status mti_dp_end(mt_trainer *t, const char *fn, mt_status s, double *loss_sum);
/* Sums n gradient values of parameter i over the ranks, in place. */
mt_status mti_dp_reduce(mt_trainer *t, int i, float *g, size_t n);
/* The same for parameter i's whole gradient (made zero where the batch did
 * not reach the parameter, so every rank makes the same calls). */
mt_status mti_dp_reduce_grad(mt_trainer *t, int i);

#endif /* MT_COMM_DP_H */
