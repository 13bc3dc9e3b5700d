/*
 * pp.h - pipeline parallel (pp.c): a model's layers cut into stages over
 * a pipeline group of ranks, as the trainer sees it (docs/distributed.md,
 * "Pipeline parallel").
 *
 * At create the model's recompute units are cut into cfg.pipeline_parallel
 * stages balanced by their estimated compute, and the model becomes this
 * rank's stage (model.h, mti_pp): its layers and parameters, and on the
 * last stage a copy of a tied token table. Every layer above the engine
 * (homes, optimizer, precisions, tensor parallel, the estimate) sees the
 * stage as the model. The engine runs the stage (stage_in, stage_out);
 * this file moves the activations and their gradients between stages on
 * the 1F1B schedule, sums the tied table's gradient between the first and
 * last stages, and sums the step's loss and checks over the group. At
 * destroy every weight goes back to every rank of the group.
 */
#ifndef MT_PP_H
#define MT_PP_H

#include "train/trainer.h"

/* cfg.pipeline_parallel checked against the model, the world and the
 * rest of cfg (MT_ERR_INVALID_ARG, MT_ERR_UNSUPPORTED with the reason). */
mt_status mti_pp_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *c);
/* Creation's status s so far agreed over the world (every rank calls it,
 * failed or not), then the pipeline group made (and the data-parallel one
 * without tensor parallel: the context's collectives narrowed to it), the
 * stages cut, this stage's weights made (a deferred model's) and the model
 * made the stage (t->units cut to its units). A collective of the world. */
mt_status mti_pp_begin(mt_trainer *t, mt_status s);
/* Status s agreed over the pipeline group (fn and what name it): one
 * rank's failure fails every rank of the group, naming it. */
mt_status mti_pp_agree(mt_trainer *t, const char *fn, const char *what, mt_status s);
/* A batch's checks (status s) agreed over the pipeline group, and then
 * its shape (rows, tokens per row): every rank of a group is given the
 * same batch (MT_ERR_INVALID_ARG on every rank otherwise), so every stage
 * runs it, or none. */
mt_status mti_pp_agree_batch(mt_trainer *t, const char *fn, const mt_batch *b, mt_status s);
/* Creation succeeded: the other stages' weights go from this rank. */
void mti_pp_commit(mt_trainer *t);
/* At destroy (after tensor parallel's end), the whole model again: this
 * stage's weights (fp32) back in it and every other stage's broadcast
 * from its stage (a collective of the group; with t->pp_discard nothing
 * is sent and the trained weights are left unmade), the groups freed. */
void mti_pp_end(mt_trainer *t);
/* The step's forward and backward passes of every micro-batch on the 1F1B
 * schedule, the loss gradient scaled by dloss, each backward by bwd (the
 * engine armed and its pass in place; last: the step's last micro-batch);
 * *sum gets the sum of the losses (the last stage's; 0 on the others). */
typedef mt_status (*mti_bwd_fn)(mt_trainer *t, bool last);
mt_status mti_pp_passes(mt_trainer *t, const mt_batch *b, float dloss, mti_bwd_fn bwd, double *sum);
/* Eval's forward passes (nothing kept): *sum and *right (accuracy: count
 * adds a pass's right answers on the last stage, or NULL) summed over the
 * group, the same on every stage. */
typedef mt_status (*mti_right_fn)(mt_trainer *t, const int32_t *targets, int *right);
mt_status mti_pp_eval(mt_trainer *t, const mt_batch *b, mti_right_fn count, double *sum, int *right);
/* After the passes, status s agreed over the group and the loss sum
 * summed over it. */
mt_status mti_pp_loss(mt_trainer *t, mt_status s, double *sum);
/* The tied table's gradient (this rank's elements of it) summed between
 * the first and last stages: the same bits on both. */
mt_status mti_pp_tie(mt_trainer *t);
/* The step's checks over the group: the sum of squares (the tied copy's
 * left out by the caller) and found, summed. */
mt_status mti_pp_checks(mt_trainer *t, int *found, double *sum);

/* Whether a training-state file can hold the trainer's state whole
 * (MT_ERR_UNSUPPORTED, naming why, when not: ZeRO in the data-parallel
 * groups). The same answer on every rank. */
mt_status mti_pp_files_ok(const mt_trainer *t, const char *fn);
/* Loading: status s and the file's digest agreed over the pipeline group. */
mt_status mti_pp_agree_file(mt_trainer *t, const char *fn, uint64_t digest, mt_status s);

#endif /* MT_PP_H */
