/*
 * optim.h - the optimizers: one table (lib/optim/optim.c), one file per optimizer
 * (lib/optim/optim_sgd.c, optim_adamw.c, optim_adamw8.c, optim_adamw4.c,
 * optim_adafactor.c).
 *
 * An optimizer works on one parameter at a time and sees only that
 * parameter: its shape, its state tensors, its fp32 values and gradients,
 * and the step's scalars. It never sees the trainer. What it needs from
 * the rest of the library is in its table entry:
 *   - layout: the state tensors a parameter of a given shape gets (dtype,
 *     element count, fill byte of a fresh state, and how they follow the
 *     parameter's elements), so a caller can size, place, shard or offload
 *     the state without knowing the optimizer;
 *   - update: the update of elements [at, at + n) of a parameter, where the
 *     optimizer allows slices (entry's sliceable; the slice starts at a
 *     multiple of mti_optim_slice_align) or of the whole tensor;
 *   - the checks of its settings, the ops it needs, its memory traffic.
 * State is saved and loaded as the layout's tensors, byte for byte, in slot
 * order (the training-state file, lib/files/checkpoint.c), so an optimizer whose
 * state is its layout needs nothing more. docs/engine.md has the recipe
 * for adding one.
 */
#ifndef MT_OPTIM_H
#define MT_OPTIM_H

#include "ops/kernels.h"
#include "model/model.h"

#define MTI_OPT_SLOTS 4 /* state tensors per parameter, at most */

/* One state tensor of a parameter. numel 0: the slot is unused. */
typedef struct mti_opt_state {
    mti_dtype dtype;
    int64_t numel;
    /* How the tensor follows the parameter's elements: per > 0, one state
     * element per `per` parameter elements (1: elementwise; MTI_Q8_BLOCK:
     * one absmax per block), so elements [at, at + n) of the parameter own
     * state elements [at / per, ceil((at + n) / per)); per 0: the tensor
     * belongs to the whole parameter (Adafactor's row and column sums). */
    int64_t per;
    uint8_t fill; /* every byte of a fresh state */
} mti_opt_state;

/* The state of one parameter, as the optimizer lays it out. */
typedef struct mti_opt_layout {
    mti_opt_state s[MTI_OPT_SLOTS];
    int bits; /* 4, 8 or 32: how precise the state is (the quantized AdamWs' choice per
                 tensor) */
} mti_opt_layout;

/* What one update call gets besides the tensors. */
typedef struct mti_opt_step {
    const mti_kctx *k;
    const mti_ops *ops;
    const mt_trainer_config *cfg; /* the trainer's settings */
    const mti_param *p;           /* the parameter: name, shape, numel */
    const mti_opt_layout *layout; /* its state's layout */
    float lr;                     /* this step's, times the parameter's lr_scale */
    float weight_decay;           /* the parameter's */
    int64_t step;                 /* optimizer steps including this one (from 1) */
    float grad_scale;             /* gradients are multiplied by this first (clipping) */
    mti_dtype pc_dt;              /* dtype of the compute copy pc */
    int *scratch;                 /* a device int the update may use (a flag) */
} mti_opt_step;

typedef struct mti_optim {
    mt_optimizer_kind kind;
    const char *name;  /* as the command line spells it: "adamw8" */
    const char *title; /* as messages say it: "8-bit AdamW" */
    /* The update can take a slice of a parameter (else only the whole). */
    int sliceable;
    /* fp32 master weights are required (the update needs the whole tensor
     * in fp32: no bf16-only weights). */
    int needs_masters;
    /* Bytes of memory traffic per parameter of one update (the auto-fit's
     * cost model), and whether that traffic runs at the quantized rate. */
    double (*traffic)(const mt_trainer_config *c, int *quantized);
    /* Settings of its own: MT_OK or MT_ERR_INVALID_ARG with a message
     * (NULL: none; the shared ones, such as beta1 and momentum, are checked
     * with the trainer's). */
    mt_status (*check)(mt_context *ctx, const mt_trainer_config *c);
    /* Whether the op table has what the update uses. */
    int (*has_ops)(const mti_ops *ops);
    /* The state of parameter p; o is the first override that matches it
     * (or NULL). */
    void (*layout)(const mt_trainer_config *c, const mti_param *p, const mt_param_override *o,
                   mti_opt_layout *out);
    /* Updates elements [at, at + n) of the parameter: w32 (n) fp32 values,
     * pc (n, or NULL) the compute copy to refresh, g (n) fp32 gradients,
     * st[j] the state of slot j at the slice's first element (for per > 0
     * tensors: base + at / per; per 0: the base). at and n are a whole
     * tensor (0, numel) unless the entry is sliceable. */
    mt_status (*update)(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], float *w32,
                        void *pc, const float *g, size_t at, size_t n);
    /* Elements [at, at + n) of a parameter held in bf16 alone (no masters),
     * in one pass: w (n) the bf16 weights, rounded back stochastically as
     * the adamw8_bf16 op rounds under `seed` (kernels.h); st and g as for
     * update. Sets *done to 1 when it updated, or leaves it 0 and touches
     * nothing where this parameter's layout has no such pass (the caller
     * then goes through an fp32 slice and update). NULL: never. */
    mt_status (*update_bf16)(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], uint16_t *w,
                             const float *g, size_t at, size_t n, uint64_t seed, int *done);
} mti_optim;

/* The entry of an optimizer kind, or NULL when there is none. */
const mti_optim *mti_optim_of(mt_optimizer_kind kind);
/* Elements a slice of a parameter with this layout starts at a multiple of
 * (the least common multiple of its tensors' `per`; 1 without state). */
size_t mti_optim_slice_align(const mti_opt_layout *l);
/* State elements of slot s for parameter elements [at, at + n). */
int64_t mti_optim_state_numel(const mti_opt_state *s, size_t at, size_t n);

/* Shared by AdamW and 8-bit AdamW (optim_adamw.c): the 32-bit state (m, v)
 * and the op's arguments for a step with the given weight decay. */
void mti_adamw_layout32(const mti_param *p, mti_opt_layout *out);
mti_adamw_args mti_adamw_args_of(const mti_opt_step *a, float weight_decay);

/* The entries (one file each). */
extern const mti_optim mti_optim_sgd, mti_optim_adamw, mti_optim_adamw8, mti_optim_adamw4,
    mti_optim_adafactor;

#endif /* MT_OPTIM_H */
