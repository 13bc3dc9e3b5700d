/*
 * sparsity.h - the trainer's pruning (lib/train/sparsity.c; the storage and
 * the masks in lib/sparse/).
 */
#ifndef MT_TRAIN_SPARSITY_H
#define MT_TRAIN_SPARSITY_H

#include "internal.h"
#include "engine/engine.h"
#include "optim/optim.h"

typedef struct mti_sparsity mti_sparsity;

/* The combinations cfg.prune refuses (zero: the ZeRO stage in force). */
mt_status mti_sparsity_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *c,
                             int zero);
/* At create, before the optimizer state is planned: the prune of step 0
 * where it is due then (magnitude). */
mt_status mti_sparsity_create(mt_trainer *t);
/* At a step's start: the prune due after the steps taken, if any. */
mt_status mti_sparsity_step(mt_trainer *t, const char *fn);
void mti_sparsity_free(mt_trainer *t);
/* A prune at create undone when the creation fails: what it changed,
 * taken from the trainer before it goes (NULL: nothing), then given back
 * to the model (and freed). */
typedef struct mti_prune_undo mti_prune_undo;
mti_prune_undo *mti_sparsity_take_undo(mt_trainer *t);
void mti_prune_undo_apply(mt_model *m, mti_prune_undo *u);
void mti_prune_undo_free(mti_prune_undo *u);
/* Whether the masks change after create (a prune at a step, RigL): the
 * gradients' sizes then change between steps. */
bool mti_sparsity_changes_later(const mt_trainer *t);
/* Whether the step being taken made a prune at its start. */
bool mti_sparsity_pruned_now(const mt_trainer *t);
/* The engine's sp_kernel for c (mt_sparse_kernel): c->prune.kernel, or
 * the dense tile when the trainer regrows. */
int mti_sparsity_kernel(const mt_trainer_config *c);
/* RigL: whether this step updates the masks instead of the weights (its
 * backward then hands each target's dense gradient to the trainer); and
 * after its passes, the masks changed (apply: the passes went well). */
bool mti_sparsity_regrow_begin(mt_trainer *t);
mt_status mti_sparsity_regrow_end(mt_trainer *t, bool apply);

/* Parameter i takes the mask of a training-state file (its layout L and
 * description meta, host memory, checked): its description is replaced,
 * and where its kept count or format differs it is pruned to it first,
 * its weights, masters and state rebuilt (their values come next from
 * the file). */
mt_status mti_sparsity_adopt(mt_trainer *t, int i, const mti_sp_layout *L, const void *meta);
/* Whether it can take that mask (checked before a file changes anything):
 * a linear weight, and where its kept count or format changes, a trainer
 * that can rebuild it (one rank's whole tensors, elementwise state, no
 * queues). MT_ERR_FORMAT or MT_ERR_UNSUPPORTED naming fn otherwise. */
mt_status mti_sparsity_can_adopt(const mt_trainer *t, int i, const mti_sp_layout *L,
                                 const char *fn);

/* trainer.c: the optimizer state's layout of parameter i were it to hold
 * numel elements. */
void mti_trainer_layout_for(const mt_trainer *t, int i, size_t numel, mti_opt_layout *out);

/* Wanda's calibration (mt_trainer_calibrate, trainer.c): whether the
 * trainer prunes by Wanda; the engine's hook (user: the trainer), the
 * input x (n rows of `in` in dt, device memory) of parameter wi's GEMM
 * squared and summed per column into its norms; and one batch done. */
bool mti_sparsity_wanda(const mt_trainer *t);
mt_status mti_sparsity_calib(void *user, int wi, const void *x, int n, int in, mti_dtype dt);
void mti_sparsity_calibrated(mt_trainer *t);

#endif /* MT_TRAIN_SPARSITY_H */
