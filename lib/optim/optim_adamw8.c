/*
 * optim_adamw8.c - 8-bit blockwise AdamW as bitsandbytes' AdamW8bit
 * (kernels.h, the adamw8 op): codes into its dynamic maps, one absmax per
 * block of MTI_Q8_BLOCK elements (about 2.03 bytes per parameter).
 * Tensors under min_8bit_size elements, those the model marks (a
 * StableEmbedding's table) and overrides with state_bits 32 keep 32-bit
 * state, as bitsandbytes does, and are updated as its 32-bit kernel
 * (kOptimizer32bit2State) updates them: the AdamW step, then the decoupled
 * weight decay p *= 1 - lr wd after it, as in the 8-bit kernel (torch's
 * AdamW, MT_OPT_ADAMW, decays before the step).
 */
#include "optim/optim.h"

static double traffic(const mt_trainer_config *c, int *quantized)
{
    (void)c;
    *quantized = 1;
    return 16; /* p, g read (8), p written (4), codes and absmax (~4) */
}

static int has_ops(const mti_ops *ops)
{
    return ops->adamw8 && ops->adamw8_bf16 && ops->adamw && ops->unscale_check && ops->cast;
}

static void layout(const mt_trainer_config *c, const mti_param *p, const mt_param_override *o,
                   mti_opt_layout *out)
{
    const int64_t n = (int64_t)p->numel;
    /* (the whole tensor's size decides, so that a tensor-parallel part's
       state is laid out as the whole's on every rank of its group) */
    bool eight = !p->force32 && (int64_t)mti_whole_numel(p) >= c->min_8bit_size;
    if (o && o->state_bits) eight = o->state_bits == 8;
    if (!eight) {
        mti_adamw_layout32(p, out);
        return;
    }
    const int64_t nb = (n + MTI_Q8_BLOCK - 1) / MTI_Q8_BLOCK;
    *out = (mti_opt_layout){.bits = 8};
    out->s[0] = (mti_opt_state){MTI_U8, n, 1, mti_q8_zero_code(1)};
    out->s[1] = (mti_opt_state){MTI_U8, n, 1, mti_q8_zero_code(0)};
    out->s[2] = (mti_opt_state){MTI_F32, nb, MTI_Q8_BLOCK, 0};
    out->s[3] = (mti_opt_state){MTI_F32, nb, MTI_Q8_BLOCK, 0};
}

static mt_status update(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], float *w32,
                        void *pc, const float *g, size_t at, size_t n)
{
    (void)at; /* a multiple of the block (mti_optim_slice_align) */
    if (a->layout->bits == 8) {
        mti_adamw_args args = mti_adamw_args_of(a, a->weight_decay);
        return a->ops->adamw8(a->k, w32, g, st[0], st[1], st[2], st[3], pc, a->pc_dt, n, &args);
    }
    /* 32-bit state: the step without decay, then p *= 1 - lr wd (the unscale
       op multiplies in fp32, as the kernel does), then the compute copy */
    mti_adamw_args args = mti_adamw_args_of(a, 0.0f);
    const float decay = 1.0f - a->lr * a->weight_decay;
    const bool decays = a->weight_decay > 0.0f;
    mt_status s = a->ops->adamw(a->k, w32, g, st[0], st[1], decays ? NULL : pc, a->pc_dt, n, &args);
    if (!s && decays) s = a->ops->unscale_check(a->k, w32, n, decay, a->scratch);
    if (!s && decays && pc)
        s = a->ops->cast(a->k, pc, a->pc_dt, w32, MTI_F32, n, MTI_ROUND_NEAREST, 0);
    return s;
}

/* bf16 weights without masters: the 8-bit state's one-pass op; the
 * 32-bit state of small tensors has none */
static mt_status update_bf16(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], uint16_t *w,
                             const float *g, size_t at, size_t n, uint64_t seed, int *done)
{
    if (a->layout->bits != 8) return MT_OK;
    *done = 1;
    mti_adamw_args args = mti_adamw_args_of(a, a->weight_decay);
    return a->ops->adamw8_bf16(a->k, w, g, st[0], st[1], st[2], st[3], n, at, seed, &args);
}

const mti_optim mti_optim_adamw8 = {
    .kind = MT_OPT_ADAMW8,
    .name = "adamw8",
    .title = "8-bit AdamW",
    .sliceable = 1,
    .traffic = traffic,
    .has_ops = has_ops,
    .layout = layout,
    .update = update,
    .update_bf16 = update_bf16,
};
