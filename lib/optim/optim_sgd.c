/*
 * optim_sgd.c - SGD as torch.optim.SGD: momentum, dampening, Nesterov,
 * weight decay as L2 (kernels.h, mti_sgd_args). State: the momentum buffer
 * (fp32, one per element) when momentum > 0, else none.
 */
#include "optim/optim.h"

static double traffic(const mt_trainer_config *c, int *quantized)
{
    *quantized = 0;
    return c->momentum > 0.0f ? 20 : 12; /* p, g (and m) read, p (and m) written */
}

static int has_ops(const mti_ops *ops) { return ops->sgd != NULL; }

static void layout(const mt_trainer_config *c, const mti_param *p, const mt_param_override *o,
                   mti_opt_layout *out)
{
    (void)o;
    *out = (mti_opt_layout){.bits = 32};
    if (c->momentum > 0.0f) out->s[0] = (mti_opt_state){MTI_F32, (int64_t)p->numel, 1, 0};
}

static mt_status update(const mti_opt_step *a, void *const st[MTI_OPT_SLOTS], float *w32,
                        void *pc, const float *g, size_t at, size_t n)
{
    (void)at;
    const mt_trainer_config *c = a->cfg;
    mti_sgd_args s = {.lr = a->lr,
                      .momentum = c->momentum,
                      .dampening = c->dampening,
                      .weight_decay = a->weight_decay,
                      .nesterov = c->nesterov,
                      .first_step = a->step == 1,
                      .grad_scale = a->grad_scale};
    return a->ops->sgd(a->k, w32, g, st[0], pc, a->pc_dt, n, &s);
}

const mti_optim mti_optim_sgd = {
    .kind = MT_OPT_SGD,
    .name = "sgd",
    .title = "SGD",
    .sliceable = 1,
    .traffic = traffic,
    .has_ops = has_ops,
    .layout = layout,
    .update = update,
};
