/*
 * engine.h - forward and backward passes of any model over one
 * micro-batch, with activation recompute.
 *
 * The model is a sequence of layers; boundary j is the tensor between layer
 * j-1 and layer j (boundary 0 the input, boundary n_layers the logits). A
 * layer keeps what its backward needs in its slots. Recompute works on
 * units (model.h): with EVERY_K the units are grouped in segments of k;
 * forward runs every segment but the last without keeping anything except
 * the segment's input boundary, and backward re-runs a segment's forward
 * (keeping everything) just before it needs it. Recompute runs the same ops
 * on the same inputs, so its results are bit-identical to the first run.
 *
 * Parameter gradients (fp32, class GRAD) are made on their first
 * contribution, which writes them (MTI_BWD_SET_DW; only a gradient made by
 * scattering rows, an embedding table's, is zeroed first), and accumulate
 * across micro-batches; after each layer's
 * backward, every parameter whose last contribution of the pass that was
 * gets reported to the hook (the fused optimizer step uses it).
 */
#ifndef MT_ENGINE_H
#define MT_ENGINE_H

#include "ops/kernels.h"
#include "model/model.h"

typedef mt_status (*mti_grad_hook)(void *user, int param);
/* Elements [at, at + n) of parameter param's gradient, final, in g. */
typedef mt_status (*mti_slice_hook)(void *user, int param, float *g, size_t at, size_t n);

/* Before a layer's forward or backward (bwd 0 or 1) with in 1, after it
 * with in 0: ZeRO-3 brings the layer's weights in (each parameter's
 * p->w.blk points at a gathered copy while it is in) and lets them go. A
 * recomputed layer runs its forward again, so it asks again. The call with
 * in 0 follows every call with in 1, also when the layer failed; its
 * status is ignored. The call is entry `at` of the engine's schedule (the
 * calls to come: sched[at + 1 ..], for prefetching). layer -1: the
 * schedule is over or replaced, let go of whatever was brought in ahead
 * (no layer runs then; its status is ignored). */
typedef mt_status (*mti_layer_hook)(void *user, int layer, int bwd, int in);
/* An entry of the schedule: layer * 2 + bwd. */
#define MTI_SCHED(layer, bwd) ((layer) * 2 + (bwd))

/* Test hook: fills a gradient the engine has just made (n values of
 * parameter param from element at, in device memory g) instead of zeroing
 * it, so tests over the stand-in driver, whose kernels compute nothing,
 * train on gradients they know. Not called in dry contexts; NULL in the
 * library. */
extern mt_status (*mti_engine_grad_fill)(mt_context *ctx, int param, size_t at, float *g, size_t n);

/* Calibration (Wanda, lib/train/sparsity.c): x (n rows of `in` in dt,
 * device memory), the input of parameter param's GEMM in a forward. */
typedef mt_status (*mti_calib_hook)(void *user, int param, const void *x, int n, int in,
                                    mti_dtype dt);

/* RigL (lib/train/sparsity.c): the dense gradient g (n fp32, device
 * memory) of pruned parameter param, made by this backward. */
typedef mt_status (*mti_grow_hook)(void *user, int param, const float *g, size_t n);

typedef enum mti_save { MTI_SAVE_NONE = 0, MTI_SAVE_ALL = 1, MTI_SAVE_SEL = 2 } mti_save;

typedef struct mti_engine {
    mt_model *m;
    mt_context *ctx;
    mti_kctx k;
    mti_dtype dt;
    /* plan, per layer */
    unsigned char *plan;   /* mti_save of the main forward */
    int *seg_start;        /* first layer of the layer's segment */
    unsigned char *kept;   /* per boundary: kept through forward (n_layers + 1) */
    /* one pass */
    int B, T, N;           /* sequences (or rows), tokens per sequence (1), rows */
    int NL, R0;            /* sequence parallel: this rank's rows of the N, from row R0
                              (else N and 0) */
    mti_tensor *bnd;       /* n_layers + 1 */
    mti_tensor (*slot)[MTI_SLOTS];
    unsigned char *have;   /* per layer: its slots hold what its backward needs */
    unsigned char *redone; /* per layer: made by recompute in backward */
    mti_tensor tokens, targets, losses;
    mti_tensor d;          /* the gradient flowing back */
    /* gradients */
    mti_tensor *grad;      /* per parameter */
    unsigned char *fresh;  /* per parameter: its gradient is made and not yet
                              written (the op of its first contribution writes
                              it whole, or it is zeroed; see wflags) */
    int *uses_left;
    mti_tensor lora_s;     /* LoRA's scale, (alpha / r) I (r, r) in dt (PARAM) */
    int train_from;        /* the first layer with a parameter to train: backward
                              stops there (mti_engine_arm) */
    /* Deferred tied gradient (the fused step): the LM head's backward makes
     * only its input gradient and leaves its dlogits and input here; the
     * table's gradient is formed from them just before the embedding's
     * backward adds its own, in the same order as without deferring, so the
     * full-size table gradient exists only at the very end. */
    int defer_tied;
    mti_tensor tied_dy, tied_x;   /* owned (moved here) unless keep */
    const void *tied_dy_ptr, *tied_x_ptr;
    /* With tied_rows > 0 and slice_hook set, a deferred table gradient is
     * made tied_rows rows at a time (GEMM part, then the embedding's part:
     * each element summed as when made whole), each slice handed to
     * slice_hook (with backward's user) and dropped; the whole-gradient hook
     * is not called for the table. tied_rows is a multiple of the op
     * table's matmul_dw_align. */
    int tied_rows;
    /* With head_rows > 0 (mti_engine_head_rows) a training forward (not
     * eval) leaves the LM head to the loss, which runs it head_rows rows at
     * a time: each block's logits are made, its losses and dlogits
     * computed, the head's input gradient for its rows made from them, and
     * the block freed, so the (N, out_width) logits never exist whole; the
     * last boundary then holds the head's input gradient (N, in) in place
     * of the dlogits, and a trained head's weight gradient has each block's
     * part (made at the loss, before backward). The same ops on the same
     * rows as the whole head: the same bits. Not with a params_hook (the
     * weights must be resident). */
    int head_rows;
    int head_unfused;              /* (tests) the head not fused, its weight gradient still
                                      summed over head_rows blocks */
    int head_fused;                /* this pass's forward left the head to the loss */
    mti_slice_hook slice_hook;
    mti_layer_hook params_hook;    /* where the weights come from (NULL: resident) */
    void *params_user;
    /* With params_hook: the order of its calls (MTI_SCHED) from this
     * forward on, through the backward that follows (its recomputes
     * included; predicted from the plan at forward, checked at backward's
     * start), or of this backward alone; the call running or next is
     * sched[at]. */
    int *sched;
    int n_sched, at;
    int *sched_new;             /* scratch: a backward's own (3 n_layers) */
    unsigned char *sched_have;  /* scratch: have[] as it will be (n_layers) */
    mti_grad_hook hook;            /* backward's, for its duration */
    void *user;
    /* Pipeline parallel (lib/train/pp.c): the model is one stage's layers.
     * stage_in: its first layer's input comes from the stage before: the
     * caller puts it in bnd[0] ((N, in) in dt, ACT) before forward, which
     * then uploads no inputs or tokens, and backward leaves d(input) in d
     * for the caller to take. stage_out: its last layer's output goes to
     * the stage after: it stays in bnd[n_layers] (ACT), there is no loss
     * (no targets uploaded), and the caller puts d(output) in d before
     * backward. */
    int stage_in, stage_out;
    /* With calib set, every linear map's forward hands its input to it
     * first (not in dry contexts). */
    mti_calib_hook calib;
    void *calib_user;
    /* With grow set, every pruned weight's backward hands its dense weight
     * gradient to it (not in dry contexts). */
    mti_grow_hook grow;
    void *grow_user;
    /* A pruned weight's GEMMs (mt_sparse_kernel): MT_SPARSE_KERNEL_AUTO
     * takes the op table's sparse GEMMs where it expects them faster,
     * SPARSE wherever it has them, DENSE never; never while grow is set. */
    int sp_kernel;
} mti_engine;

/* One micro-batch's pass (what forward leaves for its backward), held
 * aside while other micro-batches run (pipeline parallel's 1F1B). */
typedef struct mti_pass {
    int B, T, N, NL, R0, head_fused;
    mti_tensor *bnd;
    mti_tensor (*slot)[MTI_SLOTS];
    unsigned char *have, *redone;
    mti_tensor tokens, targets, losses, d;
} mti_pass;

/* An empty pass for E's model (host memory). */
mt_status mti_pass_init(mti_engine *E, mti_pass *p);
/* Exchanges the engine's pass with p (nothing copied). */
void mti_pass_swap(mti_engine *E, mti_pass *p);
/* Frees p's arrays (its tensors let go before: mti_engine_release with
 * the pass swapped in). */
void mti_pass_free(mti_pass *p);

/* modes: per recompute unit, MT_UNIT_KEEP, _SELECTIVE or _RECOMPUTE (the
 * last unit, which holds the logits, never _RECOMPUTE); runs of recomputed
 * units are cut into segments of seg_len units. */
mt_status mti_engine_init(mti_engine *E, mt_model *m, mti_dtype dt, const unsigned char *modes,
                          int seg_len);
void mti_engine_free(mti_engine *E);

/* Uploads rows [r0, r0 + rows) of the batch and runs forward; the logits
 * are in bnd[n_layers] (IO, (N, out_width) in dt). eval: keep nothing for
 * backward. */
mt_status mti_engine_forward(mti_engine *E, const mt_batch *b, int r0, int rows, int eval);
/* Losses (N, fp32) and, with dloss != 0 or want_grad, dlogits in place of
 * the logits, scaled by dloss. */
mt_status mti_engine_loss(mti_engine *E, float dloss, int want_grad);
/* mti_engine_loss's distillation form (dlogits always made): the loss
 * (1 - alpha) xent + alpha T^2 KL(teacher || student) against the logits
 * that teacher's forward left in its last boundary (fp32, an engine of
 * MTI_F32 over the same rows). */
mt_status mti_engine_loss_kd(mti_engine *E, const mti_engine *teacher, float alpha, float temp,
                            float dloss);
/* Sum of the pass's losses, downloaded and summed in order (double). */
mt_status mti_engine_loss_sum(mti_engine *E, float *host, double *sum);
/* Backward from dlogits. keep: leave every tensor of the forward in place
 * (a second backward follows); hook may be NULL. */
mt_status mti_engine_backward(mti_engine *E, int keep, mti_grad_hook hook, void *user);
/* The rows of the LM head's blocks fused with the loss (head_rows): about
 * MTI_HEAD_BLOCK bytes of logits (MTI_HEAD_BLOCK_GPU on a CUDA context),
 * the rows rounded up to a multiple of 8 (so every block's rows start
 * 16-byte aligned), for a model whose last layer is an LM head (not split
 * by tensor parallel) with a frozen weight, or a trained one whose dlogits
 * are not deferred and not a pipeline stage's (defer_tied, stage_in and
 * stage_out set first); 0 otherwise. A trained head's
 * weight gradient is summed over the same blocks fused or not, so the two
 * make the same bits. */
#define MTI_HEAD_BLOCK ((size_t)16 << 20)
#define MTI_HEAD_BLOCK_GPU ((size_t)256 << 20)
int mti_engine_head_rows(const mti_engine *E);
/* Whether the last layer's backward reads its output (a stage's output
 * stays for it after it is sent). */
bool mti_engine_keeps_output(const mti_engine *E);
/* Frees every tensor of the pass (not the gradients). */
void mti_engine_release(mti_engine *E);
/* Frees the gradients. */
void mti_engine_free_grads(mti_engine *E);
/* The gradient of parameter i, made (zeroed) if it is not there. */
mt_status mti_engine_grad(mti_engine *E, int i, mti_tensor **out);
/* Sets every parameter's contributions-left count for one backward pass. */
void mti_engine_arm(mti_engine *E);

#endif /* MT_ENGINE_H */
