/*
 * optim_adamw.c - AdamW as torch.optim.AdamW (kernels.h, mti_adamw_args):
 * decoupled weight decay before the update. State: the first and second
 * moments, fp32, one each per element (8 bytes per parameter).
 */
#include "optim/optim.h"

static double traffic(const mt_trainer_config *c, int *quantized)
{
    (void)c;
    *quantized = 0;
    return 28; /* p, g, m, v read; p, m, v written */
}

static int has_ops(const mti_ops *ops) { return ops->adamw != NULL; }

void mti_adamw_layout32(const mti_param *p, mti_opt_layout *out)
{
    *out = (mti_opt_layout){.bits = 32};
    out->s[0] = (mti_opt_state){MTI_F32, (int64_t)p->numel, 1, 0};
    out->s[1] = (mti_opt_state){MTI_F32, (int64_t)p->numel, 1, 0};
}

static void layout(const mt_trainer_config *c, const mti_param *p, const mt_param_override *o,
                   mti_opt_layout *out)
{
    (void)c, (void)o;
    mti_adamw_layout32(p, out);
}

mti_adamw_args mti_adamw_args_of(const mti_opt_step *a, float weight_decay)
{
    const mt_trainer_config *c = a->cfg;
    return (mti_adamw_args){.lr = a->lr,
                            .beta1 = c->beta1,
                            .beta2 = c->beta2,
                            .eps = c->eps,
                            .weight_decay = weight_decay,
                            .step = a->step,
                            .grad_scale = a->grad_scale};
}

static mt_status update(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], float *w32,
                        void *pc, const float *g, size_t at, size_t n)
{
    (void)at;
    mti_adamw_args args = mti_adamw_args_of(a, a->weight_decay);
    return a->ops->adamw(a->k, w32, g, st[0], st[1], pc, a->pc_dt, n, &args);
}

const mti_optim mti_optim_adamw = {
    .kind = MT_OPT_ADAMW,
    .name = "adamw",
    .title = "AdamW",
    .sliceable = 1,
    .traffic = traffic,
    .has_ops = has_ops,
    .layout = layout,
    .update = update,
};
