/*
 * optim_adamw4.c - 4-bit AdamW after Li, Chen, Zhu, "Memory Efficient
 * Optimizers with 4-bit States" (NeurIPS 2023), in its public code's
 * default configuration (kernels.h, the adamw4 op): m in blocks of 128 with
 * the dynamic-exponent map, v normalised rank-1 (matrices) or in blocks of
 * 128 (vectors, and a pruned matrix's kept entries, which have no rows and
 * columns) with the linear map that has no zero. About 1.03 bytes per
 * parameter.
 *
 * As in that code, tensors under min_8bit_size elements (4096), those the
 * model marks (a StableEmbedding's table) and overrides with state_bits 32
 * keep 32-bit state, updated as torch's AdamW (the adamw op), which is also
 * the 4-bit update's arithmetic.
 *
 * Layout of a 4-bit tensor of n elements: slot 0 the codes of m
 * (ceil(n / 2) bytes, two per byte), slot 1 its block absmaxes, slot 2 the
 * codes of v, slot 3 its scales: rows + cols maxima of a matrix (per 0:
 * they belong to the whole tensor) or a vector's block absmaxes. The
 * rank-1 scales need the whole matrix, so the update takes only whole
 * tensors (sliceable 0): a sharded run gives each tensor whole to one rank,
 * and a call on a slice is refused; and fp32 master weights (no bf16-only
 * weights, whose whole-tensor fp32 copy would be a transient as large as
 * the state saved).
 */
#include "optim/optim.h"

static double traffic(const mt_trainer_config *c, int *quantized)
{
    (void)c;
    *quantized = 1;
    return 15; /* p, g read (8), p written (4), codes and scales (~1), v's codes read twice */
}

static int has_ops(const mti_ops *ops) { return ops->adamw4 && ops->adamw; }

/* Whether parameter p gets 4-bit state. */
static bool four_bit(const mt_trainer_config *c, const mti_param *p, const mt_param_override *o)
{
    bool q = !p->force32 && (int64_t)mti_whole_numel(p) >= c->min_8bit_size; /* (as 8-bit's) */
    if (o && o->state_bits) q = o->state_bits != 32;
    return q;
}

/* Whether p's v is normalised rank-1: a matrix, not pruned (a pruned
 * weight's state is a vector of its kept entries, normalised in blocks as
 * any vector's). */
static bool rank1(const mti_param *p) { return p->ndim == 2 && !p->sp; }

static void layout(const mt_trainer_config *c, const mti_param *p, const mt_param_override *o,
                   mti_opt_layout *out)
{
    if (!four_bit(c, p, o)) {
        mti_adamw_layout32(p, out);
        return;
    }
    const int64_t n = (int64_t)p->numel, bytes = (n + 1) / 2;
    const int64_t nb = (n + MTI_Q4_BLOCK - 1) / MTI_Q4_BLOCK;
    *out = (mti_opt_layout){.bits = 4};
    out->s[0] = (mti_opt_state){MTI_U8, bytes, 2, (uint8_t)(MTI_Q4_ZERO | MTI_Q4_ZERO << 4)};
    out->s[1] = (mti_opt_state){MTI_F32, nb, MTI_Q4_BLOCK, 0};
    out->s[2] = (mti_opt_state){MTI_U8, bytes, 2, 0};
    if (rank1(p))
        out->s[3] = (mti_opt_state){MTI_F32, p->shape[0] + p->shape[1], 0, 0};
    else
        out->s[3] = (mti_opt_state){MTI_F32, nb, MTI_Q4_BLOCK, 0};
}

static mt_status update(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], float *w32,
                        void *pc, const float *g, size_t at, size_t n)
{
    const mti_param *p = a->p;
    if (at != 0 || n != p->numel)
        return mti_fail(a->k->ctx, MT_ERR_UNSUPPORTED,
                        "4-bit AdamW updates whole tensors only (its second moment is scaled by "
                        "the tensor's row and column maxima): '%s' elements [%zu, %zu) of %zu",
                        p->name, at, at + n, p->numel);
    mti_adamw_args args = mti_adamw_args_of(a, a->weight_decay);
    if (a->layout->bits != 4) return a->ops->adamw(a->k, w32, g, st[0], st[1], pc, a->pc_dt, n, &args);
    const mti_adamw4_state s4 = {.qm = st[0], .absmax_m = st[1], .qv = st[2], .scale_v = st[3]};
    const int r1 = rank1(p);
    const int64_t rows = r1 ? p->shape[0] : 1, cols = r1 ? p->shape[1] : (int64_t)p->numel;
    return a->ops->adamw4(a->k, w32, g, &s4, pc, a->pc_dt, rows, cols, r1, &args);
}

const mti_optim mti_optim_adamw4 = {
    .kind = MT_OPT_ADAMW4,
    .name = "adamw4",
    .title = "4-bit AdamW",
    .sliceable = 0,
    .needs_masters = 1,
    .traffic = traffic,
    .has_ops = has_ops,
    .layout = layout,
    .update = update,
};
