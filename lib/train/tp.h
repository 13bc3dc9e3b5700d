/*
 * tp.h - tensor parallel (tp.c): a GPT model's blocks, token table and LM
 * head split over a group of ranks, as the trainer's parameter homes see
 * it (docs/distributed.md, "Tensor parallel").
 *
 * The ranks of a run form groups of cfg.tensor_parallel neighbours (ranks
 * g T .. g T + T - 1: tensor group g; the ranks with one place in their
 * groups form a data-parallel group). At create each split parameter's
 * weights become this rank's part (model.h, mti_tp_split; a deferred
 * model's straight from its source), and the model, its shapes and every
 * home above it see the part as the tensor: the optimizer, masters,
 * precisions and the estimate work on parts as on any tensor. The engine
 * (engine.c) runs the blocks on this rank's heads and columns and sums
 * the partial outputs over the group. The context's own collectives run
 * within the data-parallel group meanwhile (mti_comm_narrow). At destroy
 * the parts are gathered back into the whole model.
 */
#ifndef MT_TP_H
#define MT_TP_H

#include "train/trainer.h"

/* cfg.tensor_parallel checked against the model, the world and the rest
 * of cfg (MT_ERR_INVALID_ARG, MT_ERR_UNSUPPORTED with the reason). */
mt_status mti_tp_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *c);
/* Creation's status s so far agreed over the world (every rank calls it,
 * failed or not), then the groups made (sub-communicators of the
 * context's) and the model split: each split parameter's part made beside
 * its whole, which stays until mti_tp_commit (a creation that fails gives
 * the wholes back, nothing exchanged). A collective over the world. */
mt_status mti_tp_begin(mt_trainer *t, mt_status s);
/* Status s agreed over communicator c of n ranks (`over` names them),
 * this one `me` (every rank calls it, failed or not): a rank's failure
 * fails every rank, naming it; fn and `about` name the exchange. */
mt_status mti_group_agree(mt_trainer *t, mt_comm *c, int n, int me, const char *fn,
                          const char *about, const char *over, mt_status s);
/* Loading: status s (every rank calls it) and the file's digest agreed
 * over communicator c of n ranks (`over` names them), this one me. */
mt_status mti_group_agree_file(mt_trainer *t, mt_comm *c, int n, int me, const char *over,
                               const char *fn, uint64_t digest, mt_status s);
/* Creation's status agreed over the tensor group (after the
 * data-parallel group's): one rank's failure fails every rank. */
mt_status mti_tp_agree(mt_trainer *t, mt_status s);
/* Creation succeeded everywhere: the wholes go. */
void mti_tp_commit(mt_trainer *t);
/* At destroy, the weights back in fp32: the parts gathered into whole
 * tensors (a collective of the tensor group; a part left unmade stays
 * unmade), the context's collectives widened to the world again, the
 * groups freed. */
void mti_tp_end(mt_trainer *t);
/* The step's checks over the group: finish_checks' per-parameter sums of
 * squares h (n of them, or none) and found; the parts' sums add up over
 * the group, the replicated tensors' count once. */
mt_status mti_tp_checks(mt_trainer *t, const float *h, int n, int *found, double *sum);
/* Status s agreed over the tensor group (fn and what name the exchange),
 * as mti_dp_agree_status over the data-parallel group. */
mt_status mti_tp_agree_status(mt_trainer *t, const char *fn, const char *what, mt_status s);
/* Loading: status s (every rank calls it, failed or not) and the file's
 * digest agreed over the tensor group: one rank's failure, or files that
 * differ between its ranks, fail every rank of the group. */
mt_status mti_tp_agree_file(mt_trainer *t, const char *fn, uint64_t digest, mt_status s);
/* Whether a training-state file can hold the trainer's state whole
 * (MT_ERR_UNSUPPORTED, naming why, when not): every split tensor's state
 * element by element, no ZeRO. The same answer on every rank. */
mt_status mti_tp_files_ok(const mt_trainer *t, const char *fn);
/* Sequence parallel (t->tp.sp: some gradients are each rank's rows'
 * parts, final only once summed over the group): parameter i's gradient
 * summed (a LayerNorm's; others: nothing): whole, or this rank's own
 * elements (mti_home_own: under ZeRO its slice, once reduced over the
 * data-parallel group). Every rank of the group calls it for every
 * parameter, in order. */
mt_status mti_tp_sum_grad(mt_trainer *t, int i, bool whole);
/* The whole fp32 values of split parameter i into host memory (its whole
 * numel), from this rank's part `local` (fp32, context memory): a
 * collective of the group. */
mt_status mti_tp_gather_host(mt_trainer *t, int i, const float *local, float *whole);

#endif /* MT_TP_H */
