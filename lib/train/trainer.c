/*
 * trainer.c - the training step: micro-batches through the engine, loss
 * scaling, gradient clipping, learning-rate schedules and the optimizers,
 * unfused or fused into backward.
 *
 * A step on a batch of n rows:
 *   for each micro-batch: forward, loss (dloss = scale / targets in the
 *     whole batch, so the gradients sum to those of the batch's mean loss),
 *     backward; parameter gradients (GRAD, fp32) accumulate;
 *   fp16: unscale every gradient and check it (skip the step on inf/NaN);
 *   clipping: the global norm from per-tensor sums of squares, added on the
 *     host in parameter order, and clip = min(1, max_norm / (norm + 1e-6));
 *   the update, tensor by tensor, each gradient freed after its update.
 * Fused (cfg.fused_step): the update runs in backward as soon as a
 * parameter's gradient is final (engine hook). With clipping or fp16 it
 * takes two backward passes over the same forward: the first computes the
 * norm and the overflow check, freeing each gradient at once; the second
 * (only if the step is not skipped) recomputes the gradients and updates
 * with the same ops in the same order as the unfused step, so the results
 * are the same bits.
 *
 * A step that fails before the update (out of memory, say) frees what it
 * took and leaves the weights, the optimizer state and the scaler as they
 * were. A step can fail part-way through its updates (the fused step's,
 * or with the state on disk), or after all of them (the pieces going home,
 * another rank failing); the error says which, and how many of the trained
 * tensors were updated.
 */
#include <fnmatch.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train/dp.h"
#include "train/local_sgd.h"
#include "comm/overlap.h"
#include "comm/queue.h"
#include "engine/plan.h"
#include "train/fill.h"
#include "train/home.h"
#include "train/tp.h"
#include "train/pp.h"
#include "comm/comm.h"
#include "train/trainer.h"
#include "train/sparsity.h"
#include "train/offload.h"


#define ROWS_CHUNK 16

void mt_trainer_config_init(mt_trainer_config *c)
{
    if (!c) return;
    memset(c, 0, sizeof *c);
    c->struct_size = sizeof *c;
    c->max_batch = 32;
    c->optimizer = MT_OPT_SGD;
    c->lr = 0.1f;
    c->decay_1d = 1;
    c->beta1 = 0.9f;
    c->beta2 = 0.999f;
    c->eps = 1e-8f;
    c->min_8bit_size = 4096;
    c->adafactor = (mt_adafactor_config){.eps1 = 1e-30f,
                                         .eps2 = 1e-3f,
                                         .clip_threshold = 1.0f,
                                         .decay_rate = -0.8f,
                                         .beta1 = 0.0f,
                                         .scale_parameter = 1,
                                         .relative_step = 1,
                                         .warmup_init = 0};
    c->precision = MT_PREC_FP32;
    c->master_weights = 1;
    c->loss_scale.dynamic = 1;
    c->loss_scale.init_scale = 65536.0f;
    c->loss_scale.growth_factor = 2.0;
    c->loss_scale.backoff_factor = 0.5;
    c->loss_scale.growth_interval = 2000;
    c->recompute_every = 2;
    c->zero3_prefetch = 1;
    c->distill_alpha = 0.5f;
    c->distill_temp = 2.0f;
}

static bool in01(float x) { return isfinite(x) && x >= 0.0f && x < 1.0f; }

#define BAD(...) return mti_fail(ctx, MT_ERR_INVALID_ARG, __VA_ARGS__)

/* Distillation's settings (cfg->teacher NULL: none, and alpha and T unread). */
static mt_status check_teacher(mt_context *ctx, const mt_model *m, const mt_trainer_config *c)
{
    const char *fn = "mt_trainer_create";
    const mt_model *te = c->teacher;
    if (!te) return MT_OK;
    if (!(c->distill_alpha >= 0.0f && c->distill_alpha <= 1.0f))
        BAD("%s: cfg->distill_alpha %g must be in [0, 1]", fn, (double)c->distill_alpha);
    if (!(c->distill_temp > 0.0f) || !isfinite(c->distill_temp))
        BAD("%s: cfg->distill_temp %g must be a finite number > 0", fn, (double)c->distill_temp);
    if (te == m) BAD("%s: cfg->teacher is the student model itself", fn);
    if (te->ctx != m->ctx) BAD("%s: cfg->teacher is on another context than the student", fn);
    if (te->input != m->input)
        BAD("%s: cfg->teacher takes %s, the student %s", fn,
            te->input == MT_INPUT_TOKENS ? "tokens" : "features",
            m->input == MT_INPUT_TOKENS ? "tokens" : "features");
    if (m->input == MT_INPUT_TOKENS && te->vocab != m->vocab)
        BAD("%s: cfg->teacher's vocabulary is %d tokens, the student's %d", fn, te->vocab,
            m->vocab);
    if (m->input == MT_INPUT_FEATURES && te->features != m->features)
        BAD("%s: cfg->teacher takes %d features, the student %d", fn, te->features, m->features);
    if (te->classes != m->classes)
        BAD("%s: cfg->teacher gives %d classes, the student %d", fn, te->classes, m->classes);
    int T = m->input == MT_INPUT_TOKENS ? (c->max_seq ? c->max_seq : m->max_seq) : 1;
    if (m->input == MT_INPUT_TOKENS && te->max_seq < T)
        BAD("%s: cfg->teacher's context is %d tokens, shorter than the student's %d", fn,
            te->max_seq, T);
    if (te->lora_rank)
        BAD("%s: cfg->teacher has LoRA adapters: merge them first (mt_model_lora_merge)", fn);
    if (atomic_load(&((mt_model *)te)->n_trainers))
        BAD("%s: cfg->teacher has a trainer of its own, or teaches another trainer", fn);
    return MT_OK;
}

static mt_status check_config(mt_context *ctx, const mt_model *m, const mt_trainer_config *c)
{
    const char *fn = "mt_trainer_create";
    if (c->struct_size != sizeof *c)
        BAD("%s: cfg->struct_size %u, expected %zu (call mt_trainer_config_init first)", fn,
            c->struct_size, sizeof *c);
    if (c->max_batch < 1 || c->max_batch > (1 << 24))
        BAD("%s: cfg->max_batch %d out of range 1..2^24", fn, c->max_batch);
    if (c->micro_batch < 0 || c->micro_batch > c->max_batch)
        BAD("%s: cfg->micro_batch %d out of range 0..max_batch (%d)", fn, c->micro_batch,
            c->max_batch);
    if (m->input == MT_INPUT_TOKENS && (c->max_seq < 0 || c->max_seq > m->max_seq))
        BAD("%s: cfg->max_seq %d out of range 0..%d (the model's)", fn, c->max_seq, m->max_seq);
    const mti_optim *opt = mti_optim_of(c->optimizer);
    if (!opt) BAD("%s: cfg->optimizer %d is not a known optimizer", fn, (int)c->optimizer);
    if (!isfinite(c->lr) || c->lr < 0.0f) BAD("%s: cfg->lr %g must be finite and >= 0", fn, (double)c->lr);
    if (!in01(c->momentum)) BAD("%s: cfg->momentum %g out of range [0, 1)", fn, (double)c->momentum);
    if (!in01(c->dampening)) BAD("%s: cfg->dampening %g out of range [0, 1)", fn, (double)c->dampening);
    if (c->nesterov && (c->momentum <= 0.0f || c->dampening != 0.0f))
        BAD("%s: cfg->nesterov needs momentum > 0 and dampening 0", fn);
    if (!isfinite(c->weight_decay) || c->weight_decay < 0.0f)
        BAD("%s: cfg->weight_decay %g must be finite and >= 0", fn, (double)c->weight_decay);
    if (!in01(c->beta1) || !in01(c->beta2))
        BAD("%s: cfg->beta1 %g and beta2 %g must be in [0, 1)", fn, (double)c->beta1,
            (double)c->beta2);
    if (!isfinite(c->eps) || c->eps <= 0.0f) BAD("%s: cfg->eps %g must be > 0", fn, (double)c->eps);
    if (c->min_8bit_size < 0) BAD("%s: cfg->min_8bit_size %d must be >= 0", fn, c->min_8bit_size);
    mt_status s = opt->check ? opt->check(ctx, c) : MT_OK; /* its own settings */
    if (s) return s;
    if (c->n_overrides < 0 || (c->n_overrides > 0 && !c->overrides))
        BAD("%s: cfg->n_overrides %d with overrides %s", fn, c->n_overrides,
            c->overrides ? "set" : "NULL");
    for (int i = 0; i < c->n_overrides; i++) {
        const mt_param_override *o = &c->overrides[i];
        if (!o->pattern) BAD("%s: cfg->overrides[%d].pattern is NULL", fn, i);
        if (o->state_bits != 0 && o->state_bits != 8 && o->state_bits != 32)
            BAD("%s: cfg->overrides[%d].state_bits %d must be 0, 8 or 32", fn, i, o->state_bits);
        if (!isfinite(o->weight_decay) || !isfinite(o->lr_scale) || o->lr_scale < 0.0f)
            BAD("%s: cfg->overrides[%d]: weight_decay and lr_scale must be finite, lr_scale >= 0",
                fn, i);
    }
    if (c->n_freeze < 0 || (c->n_freeze > 0 && !c->freeze))
        BAD("%s: cfg->n_freeze %d with freeze %s", fn, c->n_freeze, c->freeze ? "set" : "NULL");
    for (int i = 0; i < c->n_freeze; i++)
        if (!c->freeze[i]) BAD("%s: cfg->freeze[%d] is NULL", fn, i);
    if ((unsigned)c->lr_schedule > MT_LR_WARMUP_COSINE)
        BAD("%s: cfg->lr_schedule %d is not a schedule", fn, (int)c->lr_schedule);
    if (c->lr_schedule == MT_LR_WARMUP_COSINE &&
        (c->warmup_steps < 0 || c->total_steps <= c->warmup_steps))
        BAD("%s: cfg->warmup_steps %d and total_steps %d: need 0 <= warmup < total", fn,
            c->warmup_steps, c->total_steps);
    if (!(c->min_lr_ratio >= 0.0f && c->min_lr_ratio <= 1.0f))
        BAD("%s: cfg->min_lr_ratio %g out of range [0, 1]", fn, (double)c->min_lr_ratio);
    if (!isfinite(c->grad_clip) || c->grad_clip < 0.0f)
        BAD("%s: cfg->grad_clip %g must be finite and >= 0", fn, (double)c->grad_clip);
    if ((unsigned)c->precision > MT_PREC_BF16)
        BAD("%s: cfg->precision %d is not a precision", fn, (int)c->precision);
    const mt_loss_scale_config *ls = &c->loss_scale;
    if (c->precision == MT_PREC_FP16) {
        if (!isfinite(ls->init_scale) || ls->init_scale <= 0.0f)
            BAD("%s: cfg->loss_scale.init_scale %g must be finite and > 0", fn, (double)ls->init_scale);
        if (ls->dynamic && (!(ls->growth_factor > 1.0) || !isfinite(ls->growth_factor)))
            BAD("%s: cfg->loss_scale.growth_factor %g must be > 1", fn, ls->growth_factor);
        if (ls->dynamic && !(ls->backoff_factor > 0.0 && ls->backoff_factor < 1.0))
            BAD("%s: cfg->loss_scale.backoff_factor %g must be in (0, 1)", fn, ls->backoff_factor);
        if (ls->dynamic && ls->growth_interval < 1)
            BAD("%s: cfg->loss_scale.growth_interval %d must be >= 1", fn, ls->growth_interval);
    }
    if (c->master_weights != 0 && c->master_weights != 1)
        BAD("%s: cfg->master_weights %d must be 0 or 1", fn, c->master_weights);
    if (!c->master_weights && c->precision != MT_PREC_BF16)
        BAD("%s: cfg->master_weights 0 needs precision bf16 (fp32 weights are their own "
            "masters; fp16 is too narrow to update without them)",
            fn);
    if (!c->master_weights && opt->needs_masters)
        BAD("%s: cfg->master_weights 0 does not combine with %s, whose update needs the "
            "whole tensor in fp32",
            fn, opt->title);
    if (c->local_sgd_every < 0)
        BAD("%s: cfg->local_sgd_every %d must be >= 0 (0: off)", fn, c->local_sgd_every);
    if (c->local_sgd_every > 0 && c->zero_stage > 0)
        BAD("%s: cfg->zero_stage %d does not combine with cfg->local_sgd_every %d (local SGD "
            "keeps each rank's own optimizer state; ZeRO shards one state over the ranks)",
            fn, c->zero_stage, c->local_sgd_every);
    if ((unsigned)c->recompute > MT_RECOMPUTE_BUDGET)
        BAD("%s: cfg->recompute %d is not a recompute policy", fn, (int)c->recompute);
    if ((c->recompute == MT_RECOMPUTE_EVERY_K || c->recompute == MT_RECOMPUTE_CUSTOM) &&
        c->recompute_every < 1)
        BAD("%s: cfg->recompute_every %d must be >= 1", fn, c->recompute_every);
    if (c->recompute == MT_RECOMPUTE_CUSTOM) {
        if (!c->recompute_units)
            BAD("%s: cfg->recompute_units is NULL (MT_RECOMPUTE_CUSTOM needs one mode per unit, "
                "%d here)",
                fn, m->n_units);
        for (int u = 0; u < m->n_units; u++)
            if (c->recompute_units[u] > MT_UNIT_RECOMPUTE)
                BAD("%s: cfg->recompute_units[%d] %d is not a unit mode", fn, u,
                    (int)c->recompute_units[u]);
        if (c->recompute_units[m->n_units - 1] == MT_UNIT_RECOMPUTE)
            BAD("%s: cfg->recompute_units[%d]: the last unit makes the logits and cannot be "
                "recomputed",
                fn, m->n_units - 1);
    }
    if (c->recompute == MT_RECOMPUTE_BUDGET && !c->memory_budget)
        BAD("%s: cfg->recompute MT_RECOMPUTE_BUDGET needs cfg->memory_budget", fn);
    if (c->zero_stage < 0 || c->zero_stage > 3)
        BAD("%s: cfg->zero_stage %d out of range 0..3", fn, c->zero_stage);
    if (c->zero3_prefetch < 0 || c->zero3_prefetch > 64)
        BAD("%s: cfg->zero3_prefetch %d out of range 0..64 (layers gathered ahead)", fn,
            c->zero3_prefetch);
    if (c->zero3_keep < -1)
        BAD("%s: cfg->zero3_keep %d must be >= -1 (layers kept from forward to backward; -1: "
            "every layer)",
            fn, c->zero3_keep);
    if (c->fused_step && c->micro_batch && c->micro_batch < c->max_batch)
        BAD("%s: cfg->fused_step cannot combine with gradient accumulation (micro_batch %d < "
            "max_batch %d): the fused step frees each gradient as soon as it is final, and "
            "accumulation must keep them across micro-batches",
            fn, c->micro_batch, c->max_batch);
    if (!mt_base_format_name(c->base))
        BAD("%s: cfg->base %d is not a base format (MT_BASE_FULL, MT_BASE_INT8, MT_BASE_NF4)",
            fn, (int)c->base);
    int quantized = c->base != MT_BASE_FULL;
    for (int i = 0; i < m->n_param; i++) quantized |= m->params[i].qf != 0;
    if (quantized && c->precision == MT_PREC_FP16)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: a quantized base computes in fp32 or bf16, not fp16 (its GEMMs "
                        "dequantize into the compute dtype)",
                        fn);
    return check_teacher(ctx, m, c);
}

static mti_dtype dtype_of(mt_precision p)
{
    return p == MT_PREC_FP16 ? MTI_F16 : p == MT_PREC_BF16 ? MTI_BF16 : MTI_F32;
}

/* ---- the weights' precision: fp32 masters and a 16-bit compute copy ---- */

static mti_tensor like(const mti_tensor *t, mti_dtype dt)
{
    mti_tensor r = *t;
    r.dtype = dt;
    memset(&r.blk, 0, sizeof r.blk);
    return r;
}

static mt_status convert_weights(mt_trainer *t, mti_dtype to);
static mt_status home_alloc(mt_trainer *t, mti_tensor *x, mt_mem_class c, uint64_t tag);

/* Parameter i's weights (without a master) in dtype `to` (the new copy,
 * then the old one goes); unchanged on failure. */
static mt_status convert_one(mt_trainer *t, int i, mti_dtype to)
{
    mt_context *ctx = t->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    mti_param *p = &t->model->params[i];
    if (p->w.dtype == to || p->qf) return MT_OK; /* (quantized: stays so) */
    if (p->unmade) { /* (its home is made from the source in dtype `to`) */
        p->w.dtype = to;
        return MT_OK;
    }
    mti_tensor w = like(&p->w, to);
    mt_status s = mti_tensor_alloc(ctx, &w, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                   MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
    if (!s)
        s = ctx->ops->cast(&k, w.blk.ptr, to, p->w.blk.ptr, p->w.dtype, p->numel,
                           MTI_ROUND_NEAREST, 0);
    if (s) {
        mti_tensor_free(ctx, &w);
        return s;
    }
    mti_tensor_free(ctx, &p->w);
    p->w = w;
    return MT_OK;
}

/* Back to fp32 weights from the masters, for every parameter that has one.
 * Cannot fail: if an fp32 copy of a weight cannot be had, its master block
 * becomes the weight. One tensor at a time, so the transient is one
 * tensor's fp32 copy. */
static void from_mixed(mt_trainer *t)
{
    mt_model *m = t->model;
    mt_context *ctx = t->ctx;
    m->master_home = NULL;
    if (m->master_sliced) { /* each rank has a slice (or its file): the compute copy widened */
        for (int i = 0; i < m->n_param; i++) mti_tensor_free(ctx, &m->params[i].master);
        (void)convert_weights(t, MTI_F32); /* what stays 16-bit, the next trainer widens */
        m->has_master = m->master_sliced = false;
        return;
    }
    for (int i = 0; i < m->n_param; i++) {
        mti_param *p = &m->params[i];
        if (!p->master.blk.ptr && t->off && !p->frozen && !p->unmade && p->w.dtype != MTI_F32 &&
            mti_offload_get_master(t->off, i))
            mti_log(ctx, MT_LOG_ERROR, "%s: its master could not be read back; its weights are "
                    "the %s compute copy's", p->name, t->dt == MTI_BF16 ? "bf16" : "fp16");
        if (!p->master.blk.ptr) continue;
        if (p->unmade) { /* (let go: nothing comes back) */
            mti_tensor_free(ctx, &p->master);
            continue;
        }
        mti_tensor_free(ctx, &p->w);
        mti_tensor w = like(&p->master, MTI_F32);
        if (mti_tensor_alloc(ctx, &w, MT_MEM_PARAM, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_WEIGHT, i)) == MT_OK &&
            ctx->dev->copy_d2d(ctx->dev, w.blk.ptr, p->master.blk.ptr, p->numel * 4) == MT_OK) {
            mti_tensor_free(ctx, &p->master);
            p->w = w;
        } else {
            mti_tensor_free(ctx, &w);
            p->w = p->master;
            memset(&p->master, 0, sizeof p->master);
        }
    }
    m->has_master = false;
}

/* The model's fp32 weights become masters (MASTER), and the weights (PARAM)
 * a copy in dt, one tensor at a time (master, then the fp32 weight goes,
 * then the copy), so the transient is one tensor's worth above the final
 * 6 bytes per parameter. On failure the tensors done go back to fp32. */
static mt_status to_mixed(mt_trainer *t)
{
    mt_model *m = t->model;
    mt_context *ctx = t->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    mt_status s = MT_OK;
    m->master_sliced = t->zero != 0;
    for (int i = 0; i < m->n_param && !s && t->zero; i++) {
        /* ZeRO: the master is this rank's slice, the copy is whole */
        mti_param *p = &m->params[i];
        if (p->frozen) { /* no master: the compute dtype alone */
            s = convert_one(t, i, t->dt);
            continue;
        }
        const size_t lo = t->sh[i].lo, nm = t->sh[i].hi - lo;
        mti_tensor master = {.dtype = MTI_F32, .ndim = 1, .shape = {(int64_t)nm}};
        mti_tensor half = like(&p->w, t->dt);
        if (p->unmade) { /* its homes made from the source: a master slice kept in memory */
            if (nm && !t->off)
                s = home_alloc(t, &master, MT_MEM_MASTER, MTI_TAG_PARAM(MTI_TAG_MASTER, i));
            p->w.dtype = t->dt;
            p->master = master;
            p->master_lo = lo;
            continue;
        }
        if (nm) s = home_alloc(t, &master, MT_MEM_MASTER, MTI_TAG_PARAM(MTI_TAG_MASTER, i));
        if (!s && nm) s = ctx->dev->copy_d2d(ctx->dev, master.blk.ptr, (float *)p->w.blk.ptr + lo, nm * 4);
        if (!s) s = mti_tensor_alloc(ctx, &half, MT_MEM_PARAM, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
        if (!s)
            s = ctx->ops->cast(&k, half.blk.ptr, t->dt, p->w.blk.ptr, MTI_F32, p->numel,
                               MTI_ROUND_NEAREST, 0);
        if (s) {
            mti_tensor_free(ctx, &master);
            mti_tensor_free(ctx, &half);
            break;
        }
        mti_tensor_free(ctx, &p->w);
        p->w = half;
        p->master = master;
        p->master_lo = lo;
        if (nm && t->off) s = mti_offload_put_master(t->off, i); /* the slice's home: disk */
    }
    for (int i = 0; i < m->n_param && !s && !t->zero; i++) {
        mti_param *p = &m->params[i];
        if (p->frozen) { /* no master: the compute dtype alone */
            s = convert_one(t, i, t->dt);
            continue;
        }
        mti_tensor master = like(&p->w, MTI_F32), half = like(&p->w, t->dt);
        if (p->unmade) { /* its homes made from the source: the master's is the disk */
            p->w.dtype = t->dt;
            continue;
        }
        s = home_alloc(t, &master, MT_MEM_MASTER, MTI_TAG_PARAM(MTI_TAG_MASTER, i));
        if (!s) s = ctx->dev->copy_d2d(ctx->dev, master.blk.ptr, p->w.blk.ptr, p->numel * 4);
        if (s) {
            mti_tensor_free(ctx, &master);
            break;
        }
        mti_tensor_free(ctx, &p->w);
        p->w = master; /* for now the master is the weight */
        s = mti_tensor_alloc(ctx, &half, MT_MEM_PARAM, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
        if (!s)
            s = ctx->ops->cast(&k, half.blk.ptr, t->dt, master.blk.ptr, MTI_F32, p->numel,
                               MTI_ROUND_NEAREST, 0);
        if (s) { /* this one back to fp32 as well (from_mixed below) */
            mti_tensor_free(ctx, &half);
            half = like(&p->w, t->dt);
        }
        p->master = master;
        p->w = half;
        if (!s && t->off) s = mti_offload_put_master(t->off, i); /* its home is the disk */
    }
    if (s) {
        from_mixed(t);
        (void)convert_weights(t, MTI_F32); /* frozen ones */
        return s;
    }
    m->has_master = true;
    if (t->off) m->master_home = t->off;
    return MT_OK;
}

/* Weights stored in dt alone (no masters), or back to fp32, one tensor at
 * a time. To dt cannot leave a mix: on failure the tensors done go back.
 * Back to fp32 can fail (out of memory): the tensor then stays in dt, and
 * the next trainer's create tries again (weights_to_fp32). */
static mt_status convert_weights(mt_trainer *t, mti_dtype to)
{
    mt_model *m = t->model;
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_param && !s; i++) s = convert_one(t, i, to);
    return s;
}

static mt_status weights_to_fp32(mt_trainer *t) { return convert_weights(t, MTI_F32); }

/* ---- optimizer state ---- */

static const mt_param_override *override_of(const mt_trainer *t, const char *name)
{
    for (int i = 0; i < t->cfg.n_overrides; i++)
        if (fnmatch(t->overrides[i].pattern, name, 0) == 0) return &t->overrides[i];
    return NULL;
}

void mti_trainer_layout_for(const mt_trainer *t, int i, size_t numel, mti_opt_layout *out)
{
    mti_param p = t->model->params[i];
    p.numel = numel;
    t->opt->layout(&t->cfg, &p, override_of(t, p.name), out);
}

/* A persistent tensor of the state or the masters: on the device, or in
 * page-locked host memory with host offload. */
static mt_status home_alloc(mt_trainer *t, mti_tensor *x, mt_mem_class c, uint64_t tag)
{
    if (t->hoff) return mti_hostoff_tensor(t->hoff, x, c, tag);
    return mti_tensor_alloc(t->ctx, x, c, MT_LIFE_PERSISTENT, tag);
}

static mt_status state_tensor(mt_trainer *t, mti_tensor *st, const mti_opt_state *l, int pi, int j)
{
    *st = (mti_tensor){.dtype = l->dtype, .ndim = 1, .shape = {l->numel}};
    mt_status s = home_alloc(t, st, MT_MEM_OPTIM, MTI_TAG_PARAM(MTI_TAG_STATE + j, pi));
    if (!s && t->hoff && !t->ctx->dry) memset(st->blk.ptr, l->fill, st->blk.bytes);
    else if (!s) s = t->ctx->dev->memset8(t->ctx->dev, st->blk.ptr, l->fill, st->blk.bytes);
    return s;
}

/* Each parameter's settings and the state its optimizer lays out for the
 * whole tensor, then the shards (which follow the layout); nothing is
 * allocated. */
static mt_status plan_state(mt_trainer *t)
{
    const mt_trainer_config *c = &t->cfg;
    mt_model *m = t->model;
    for (int i = 0; i < m->n_param; i++) {
        const mti_param *p = &m->params[i];
        pstate *ps = &t->ps[i];
        if (p->frozen) continue; /* no state */
        const mt_param_override *o = override_of(t, p->name);
        ps->wd = (c->decay_1d || p->ndim >= 2) ? c->weight_decay : 0.0f;
        ps->lr_scale = 1.0f;
        if (o && o->weight_decay >= 0.0f) ps->wd = o->weight_decay;
        if (o && o->lr_scale > 0.0f) ps->lr_scale = o->lr_scale;
        t->opt->layout(c, p, o, &ps->lay);
    }
    return mti_zero_layout(t);
}

/* The state of this rank's elements of each parameter, fresh (all of it
 * without sharding). */
static mt_status make_state(mt_trainer *t)
{
    mt_model *m = t->model;
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_param && !s; i++) {
        pstate *ps = &t->ps[i];
        const size_t lo = t->sh[i].lo, n = t->sh[i].hi - lo;
        if (!n || !mti_home_state_here(t, i)) continue; /* another rank's, or on disk */
        for (int j = 0; j < MTI_OPT_SLOTS && !s; j++) {
            mti_opt_state l = ps->lay.s[j];
            l.numel = mti_optim_state_numel(&l, lo, n);
            if (l.numel) s = state_tensor(t, &ps->s[j], &l, i, j);
        }
    }
    return s;
}

/* The learning rate of optimizer step `step` (from 0). */
static float lr_at(const mt_trainer_config *c, uint64_t step)
{
    if (c->lr_schedule != MT_LR_WARMUP_COSINE) return c->lr;
    double lr = c->lr, lo = c->lr * (double)c->min_lr_ratio;
    if (step < (uint64_t)c->warmup_steps) return (float)(lr * (double)(step + 1) / c->warmup_steps);
    if (step >= (uint64_t)c->total_steps) return (float)lo;
    double r = (double)(step - (uint64_t)c->warmup_steps) / (double)(c->total_steps - c->warmup_steps);
    return (float)(lo + 0.5 * (1.0 + cos(M_PI * r)) * (lr - lo));
}

/* The optimizer on elements [at, at + n) of parameter i, located at l
 * (its state; mti_home_locate at `at`): w32 points at the fp32 values of
 * those elements, pc (or NULL) at the compute copy's, g at their
 * gradients. With w16 (bf16 weights without masters, w32 NULL) the
 * optimizer's one-pass bf16 update runs where it has one, rounding under
 * `seed`; *done says whether it did. */
static mt_status update_span(mt_trainer *t, int i, const mti_home_loc *l, float *w32, void *pc,
                             uint16_t *w16, uint64_t seed, int *done, const float *g, size_t at,
                             size_t n, float grad_scale)
{
    const mti_kctx k = {t->ctx, t->ctx->dev};
    pstate *ps = &t->ps[i];
    const mti_opt_step a = {.k = &k,
                            .ops = t->ctx->ops,
                            .cfg = &t->cfg,
                            .p = &t->model->params[i],
                            .layout = &ps->lay,
                            .lr = t->lr * ps->lr_scale,
                            .weight_decay = ps->wd,
                            .step = (int64_t)t->opt_steps + 1,
                            .grad_scale = grad_scale,
                            .pc_dt = t->dt,
                            .scratch = (int *)t->found_inf.blk.ptr + 1};
    if (w16) {
        *done = 0;
        return t->opt->update_bf16 ? t->opt->update_bf16(&a, l->st, w16, g, at, n, seed, done)
                                   : MT_OK;
    }
    return t->opt->update(&a, l->st, w32, pc, g, at, n);
}

/* elements per slice of an update without masters (a multiple of the 8-bit block) */
#define BARE_SLICE MTI_SR_PIECE

/* Updates elements [at, at + n) of parameter i from their gradients g
 * times grad_scale (the whole tensor, a slice of the tied table that
 * starts at a multiple of the 8-bit block and of BARE_SLICE, or this
 * rank's shard, which starts at a multiple of the 8-bit block). Without
 * masters the bf16 weights are updated in one pass where the optimizer
 * has one (8-bit AdamW), else they go through an fp32 slice (WORK) and
 * come back with stochastic rounding; either way element e's random bits
 * are those of element e mod BARE_SLICE of a cast seeded by the step, the
 * tensor and e's BARE_SLICE-aligned piece, so runs repeat exactly however
 * the tensor is cut (slices, shards, ranks). */
static mt_status update_piece(mt_trainer *t, int i, const float *g, size_t at, size_t n,
                              float grad_scale)
{
    mt_model *m = t->model;
    mti_param *p = &m->params[i];
    mti_home_loc l; /* where its weights, master and state are */
    mti_home_locate(t, i, at, &l);
    if (!t->bare) {
        float *w32 = m->has_master ? l.master : l.w;
        void *pc = m->has_master ? l.w : NULL;
        return update_span(t, i, &l, w32, pc, NULL, 0, NULL, g, at, n, grad_scale);
    }
    mt_context *ctx = t->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    /* the seed of the tensor at this step; a piece's is it ^ the piece's first element */
    const uint64_t seed0 = (t->opt_steps + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)i << 32);
    int done = 0;
    mt_status s = MT_OK;
    if (p->w.dtype == MTI_BF16)
        s = update_span(t, i, &l, NULL, NULL, l.w, seed0, &done, g, at, n, grad_scale);
    if (s || done) return s;
    mti_tensor sl = {.dtype = MTI_F32, .ndim = 1, .shape = {(int64_t)(n < BARE_SLICE ? n : BARE_SLICE)}};
    s = mti_tensor_alloc(ctx, &sl, MT_MEM_WORK, MT_LIFE_PHASE, MTI_TAG_PARAM(MTI_TAG_TRAINER, 6));
    for (size_t j = 0, len; j < n && !s; j += len) {
        const size_t e = at + j, piece = e - e % BARE_SLICE;
        len = n - j < piece + BARE_SLICE - e ? n - j : piece + BARE_SLICE - e;
        mti_home_locate(t, i, e, &l);
        uint64_t seed = mti_sr_seed_at(seed0 ^ piece, e - piece);
        s = ctx->ops->cast(&k, sl.blk.ptr, MTI_F32, l.w, p->w.dtype, len, MTI_ROUND_NEAREST, 0);
        if (!s) s = update_span(t, i, &l, sl.blk.ptr, NULL, NULL, 0, NULL, g + j, e, len, grad_scale);
        if (!s) s = ctx->ops->cast(&k, l.w, p->w.dtype, sl.blk.ptr, MTI_F32, len,
                                   MTI_ROUND_STOCHASTIC, seed);
    }
    mti_tensor_free(ctx, &sl);
    return s;
}

/* ZeRO-1 and 2 on NCCL's stream: the all-gather of an updated tensor's
 * weights in two halves, this rank's pieces packed into a bucket of the
 * tensor's size and the chunks' collectives queued on the stream (a call),
 * the others' pieces taken when it is retired: oldest first once more than
 * HELD bytes of buckets besides the newest are held, the rest when the
 * updates end (ag_retire), so the next tensors' updates run beside the
 * gathers. Where they are retired depends on the sizes alone; an estimate
 * (no stream) makes each at once and retires it at the same points. */
static mt_status ag_run(void *user, int i)
{
    mt_trainer *t = user;
    return mti_zero_gather_phase(t, i, 0, t->model->params[i].numel, t->agb[i].blk.ptr, MTI_ZR_POST);
}

#define HELD MTI_COMM_STAGE

/* Retires the oldest gathers: all, or while more than HELD bytes besides
 * the newest are held (s: the status so far; after a failure each is only
 * waited for and its bucket freed). */
static mt_status ag_retire(mt_trainer *t, bool all, mt_status s)
{
    while (t->ag_head < t->ag_tail &&
           (all || (t->ag_tail - t->ag_head > 1 && t->ag_bytes > HELD))) {
        const int i = t->agq[t->ag_head++];
        if (t->agt[i]) {
            const mt_status e = mti_queue_done(t->q, t->agt[i]);
            if (!s) s = e;
            t->agt[i] = 0;
        }
        if (!s) s = mti_zero_gather_phase(t, i, 0, t->model->params[i].numel, t->agb[i].blk.ptr,
                                          MTI_ZR_FINISH);
        t->ag_bytes -= mti_tensor_bytes(&t->agb[i]);
        mti_tensor_free(t->ctx, &t->agb[i]);
    }
    if (t->ag_head == t->ag_tail) t->ag_head = t->ag_tail = 0;
    return s;
}

static mt_status ag_post(mt_trainer *t, int i)
{
    const size_t bb = mti_zero_gather_bytes_all(t, i, 0, t->model->params[i].numel);
    mt_status s = bb ? mti_comm_buffer(t->ctx, &t->agb[i], bb) : MT_OK;
    if (s) return s;
    t->agq[t->ag_tail++] = i;
    t->ag_bytes += mti_tensor_bytes(&t->agb[i]);
    s = t->q ? mti_queue_call(t->q, ag_run, t, i, &t->agt[i]) : ag_run(t, i);
    return s ? s : ag_retire(t, false, MT_OK);
}

/* Updates parameter i (this rank's elements) from its gradient times
 * grad_scale; under ZeRO the weights are then gathered from every rank. */
static mt_status update_param(mt_trainer *t, int i, float grad_scale)
{
    size_t at, n;
    float *g = mti_home_own(t, i, &at, &n);
    mt_status s = n ? mti_home_update(t, i, g, at, n, grad_scale, update_piece) : MT_OK;
    if (!s && mti_home_gathers_now(t, i))
        s = t->ag_on ? ag_post(t, i) : mti_zero_gather(t, i, 0, t->model->params[i].numel);
    return s;
}

/* Rows per slice of the tied table's gradient in the fused step (0: made
 * whole). Slices start on the op table's dW tile rows, and at multiples of
 * the 8-bit block (8-bit state), of BARE_SLICE (no masters) and of the
 * sumsq round (clipping), so each slice's update and norm are the bits of
 * the whole tensor's; about 4 MiB each, and at least 8 of them when those
 * allow. Adafactor's factored statistics need the whole gradient. */
static int tied_rows_for(const mt_trainer *t)
{
    const mt_model *m = t->model;
    const mti_ops *op = t->ctx->ops;
    if (!(t->cfg.fused_step || mti_home_grad_sliced(t)) || !t->opt->sliceable || !op->matmul_dw_rows ||
        !op->embedding_dw_rows || !op->matmul_dw_align || m->n_layers < 1)
        return 0;
    const mti_layer *head = &m->layers[m->n_layers - 1];
    if (head->kind != MT_LAYER_LM_HEAD || head->tied < 0 || m->params[head->tied].frozen) return 0;
    const mti_param *p = &m->params[head->tied];
    const int64_t V = p->shape[0], C = p->shape[1];
    /* powers of two: the largest is their lcm */
    size_t elems = mti_optim_slice_align(&t->ps[head->tied].lay);
    if (t->bare && elems < BARE_SLICE) elems = BARE_SLICE;
    if (t->cfg.grad_clip > 0.0f && elems < MTI_SUMSQ_ROUND) elems = MTI_SUMSQ_ROUND;
    int64_t unit = (int64_t)elems, c = C;
    while (c % 2 == 0 && unit % 2 == 0) c /= 2, unit /= 2; /* rows: elems / gcd(elems, C) */
    int64_t a = op->matmul_dw_align((int)V, (int)C), g = a, u = unit;
    while (u) { int64_t r = g % u; g = u, u = r; }
    unit = unit / g * a; /* lcm with the GEMM's tile rows */
    int64_t want = ((int64_t)4 << 20) / (C * 4);
    if (want > V / 8) want = V / 8;
    int64_t rows = want / unit * unit;
    if (rows < unit) rows = unit;
    return rows < V ? (int)rows : 0;
}

/* ---- create / destroy ---- */

/* Marks the parameters cfg.freeze names frozen (for the trainer's life).
 * A pattern that matches nothing is a mistake worth saying; so is a model
 * left with nothing to train. */
static mt_status mark_frozen(mt_trainer *t)
{
    mt_model *m = t->model;
    const mt_trainer_config *c = &t->cfg;
    int trainable = m->n_param;
    for (int i = 0; m->lora_rank && i < m->n_base; i++) { /* LoRA: the base is frozen */
        m->params[i].frozen = 1;
        trainable--;
        t->froze = 1;
    }
    for (int k = 0; k < c->n_freeze; k++) {
        int hits = 0;
        for (int i = 0; i < m->n_param; i++) {
            mti_param *p = &m->params[i];
            if (fnmatch(c->freeze[k], p->name, 0) != 0) continue;
            hits++;
            if (!p->frozen) trainable--;
            p->frozen = 1;
            t->froze = 1;
        }
        if (!hits)
            return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                            "mt_trainer_create: cfg->freeze[%d] '%s' matches no parameter "
                            "(names: mt_model_param_info)",
                            k, c->freeze[k]);
    }
    if (!trainable)
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_create: cfg->freeze freezes every parameter: nothing to train");
    return MT_OK;
}

/* Whether cfg.base quantizes parameter i once it is frozen: a linear
 * weight, or the token table (which is also the tied LM head's W: the
 * lookup dequantizes the rows it reads, the head runs through the
 * quantized matmuls). */
static int base_member(const mt_model *m, int i)
{
    return mti_param_quantizable(m, i) || mti_param_is_table(m, i);
}

/* The quantized base (cfg.base): the model's quantized weights must be
 * frozen and in cfg.base's format; with a format, the frozen linear
 * weights that are not quantized yet are (quantize_base, once the weights
 * are fp32), and there must be at least one. */
static mt_status check_base(mt_trainer *t)
{
    const mt_model *m = t->model;
    const mti_qformat qf = mti_qformat_of(t->cfg.base);
    const char *want = mt_base_format_name(t->cfg.base);
    int n = 0;
    for (int i = 0; i < m->n_param; i++) {
        const mti_param *p = &m->params[i];
        const char *has = mti_quant_name(p->qf);
        if (p->qf && !qf)
            return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                            "mt_trainer_create: the model's %s is quantized (%s): set cfg->base "
                            "to %s",
                            p->name, has, has);
        if (p->qf && p->qf != qf)
            return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                            "mt_trainer_create: the model's %s is quantized as %s, and cfg->base "
                            "asks for %s (a quantized weight is not quantized again)",
                            p->name, has, want);
        if (p->qf && !p->frozen)
            return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                            "mt_trainer_create: %s is quantized (%s) and cannot train: freeze "
                            "it (cfg->freeze) or train LoRA adapters on the base",
                            p->name, has);
        n += p->qf || (qf && p->frozen && base_member(m, i));
    }
    if (qf && !n)
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_create: cfg->base %s quantizes frozen linear weights, and "
                        "none is frozen (freeze some with cfg->freeze, or train LoRA adapters)",
                        want);
    return MT_OK;
}

static mt_status quantize_base(mt_trainer *t)
{
    mt_model *m = t->model;
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_param && !s && t->cfg.base; i++)
        if (m->params[i].frozen && base_member(m, i))
            s = mti_param_quantize(m, i, mti_qformat_of(t->cfg.base));
    return s;
}

void mt_trainer_destroy(mt_trainer *t)
{
    if (!t) return;
    mti_hostoff_destroy(t->hoff); /* (its updates done; the state and masters stay) */
    t->hoff = NULL;
    mti_engine_free(&t->E);
    if (t->teaching) {
        mti_engine_free(&t->TE);
        atomic_fetch_sub(&t->cfg.teacher->n_trainers, 1);
    }
    if (t->ps)
        for (int i = 0; i < t->model->n_param; i++)
            for (int j = 0; j < MTI_OPT_SLOTS; j++) mti_tensor_free(t->ctx, &t->ps[i].s[j]);
    mti_tensor_free(t->ctx, &t->found_inf);
    mti_tensor_free(t->ctx, &t->sumsq);
    /* the offload's buffers go before the weights (and masters) come back
       whole from disk, and with the weights on disk what the allocators
       keep of the steps' memory goes back too, so that the weights' return
       does not stack on the steps' high-water mark */
    mti_offload_drain(t->off);
    for (int a = 0; t->off && t->cfg.offload_params && a < t->ctx->n_inst; a++)
        (void)mt_allocator_trim(t->ctx->inst[a]);
    mti_queue_free(t->q); /* (its queue done) */
    t->q = NULL;          /* (the gathers below run on this thread) */
    if (mti_zero3_unshard(t)) /* (a collective: every rank destroys its trainer) */
        mti_log(t->ctx, MT_LOG_ERROR, "mt_trainer_destroy: the weights could not be gathered "
                "from the ranks' slices (%s); the model's weights are zeros",
                mti_last_msg(t->ctx).s);
    mti_zero3_free(t);
    if (t->gs)
        for (int i = 0; i < t->model->n_param; i++) mti_tensor_free(t->ctx, &t->gs[i]);
    mti_offload_get_params(t->off); /* the weights from disk (offload_params) */
    if (t->model->has_master) from_mixed(t);
    mti_offload_destroy(t->off); /* (after the masters came back) */
    free(t->offload_dir);
    (void)weights_to_fp32(t); /* no masters, or frozen weights in 16 bits */
    mti_tp_end(t); /* (a collective of the tensor group: the parts gathered whole) */
    mti_pp_end(t); /* (a collective of the pipeline group: every stage's weights to every rank) */
    if (t->froze)
        for (int i = 0; i < t->model->n_param; i++) t->model->params[i].frozen = 0;
    if (t->patterns)
        for (int i = 0; i < t->cfg.n_overrides; i++) free(t->patterns[i]);
    free(t->patterns);
    if (t->freeze)
        for (int i = 0; i < t->cfg.n_freeze; i++) free(t->freeze[i]);
    free(t->freeze);
    free(t->overrides);
    free(t->ps);
    free(t->sh);
    free(t->gs);
    free(t->s2q);
    free(t->hb);
    free(t->agb), free(t->agt), free(t->agq);
    free(t->host_losses);
    free(t->host_rows);
    free(t->units);
    mti_sparsity_free(t);
    free(t->home);
    if (t->counted) {
        atomic_fetch_sub(&t->model->n_trainers, 1);
        atomic_fetch_sub(&t->ctx->n_children, 1);
    }
    free(t);
}

void mt_trainer_destroy_with_model(mt_trainer *t)
{
    if (!t) return;
    mt_model *m = t->model;
    /* the trained weights marked unmade: their homes are let go, not
       brought back (fill.c's rule for a creation that failed) */
    for (int i = 0; i < m->n_param; i++) /* (tensor parallel's parts too: not gathered) */
        m->params[i].unmade |= !m->params[i].frozen || m->params[i].tp_split;
    t->pp_discard = 1; /* (nor pipeline parallel's stages) */
    mt_trainer_destroy(t);
    (void)mt_model_destroy(m);
}

static mt_status held_job(void *user, int i, float *g);

/* ZeRO-1 on the communication thread: a gradient final in backward goes
 * to its slices' owners, each rank's part in place (reduce_grad's
 * collective, on the same values). */
static mt_status zero1_job(void *user, int i, float *g)
{
    mt_trainer *t = user;
    return mti_zero_reduce(t, i, g, 0, t->model->params[i].numel, g ? g + t->sh[i].lo : NULL, 0);
}

/* The communication thread (comm/overlap.c), for the parameters that
 * train: it sums them (stage 0) or reduce-scatters them (stages 1 and 2),
 * in a fixed order, or in the order given (stage 2, the fused step); at
 * stage 3 it runs the calls queued (comm/zero3.c), no gradients given. */
/* The tensors either takes: each parameter's numel, 0 for a frozen one;
 * none at stage 3 (calls alone, comm/zero3.c). NULL: out of host memory. */
static size_t *overlap_numels(const mt_trainer *t, int *n)
{
    const mt_model *m = t->model;
    *n = t->zero == 3 ? 0 : m->n_param;
    size_t *numel = malloc((size_t)*n * sizeof *numel + 1);
    if (!numel) {
        mti_fail(t->ctx, MT_ERR_OOM, "mt_trainer_create: out of host memory");
        return NULL;
    }
    for (int i = 0; i < *n; i++) numel[i] = m->params[i].frozen ? 0 : m->params[i].numel;
    return numel;
}

/* The queue (comm/queue.h): the sums in place in a fixed order (job
 * NULL), or the job's collectives (ZeRO-1's reduce-scatters; held_job:
 * stage 2's and the fused step's, in the order given). */
/* The weights to disk once the ranks have agreed on them, and a deferred
 * model's read from its source into param.bin. */
static mt_status put_params_late(mt_trainer *t)
{
    mt_status s = mti_offload_put_params(t->off);
    return s ? s : mti_fill_homes(t);
}

static mt_status queue_start(mt_trainer *t, mti_queue_job job)
{
    int n;
    size_t *numel = overlap_numels(t, &n);
    if (!numel) return MT_ERR_OOM;
    mt_status s = mti_queue_new(t->ctx, n, numel, job, t, job == held_job, &t->q);
    free(numel);
    return s;
}

mt_status mt_trainer_create(mt_model *m, const mt_trainer_config *cfg, mt_trainer **out)
{
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_trainer_create: model is NULL");
    mt_context *ctx = m->ctx;
    if (!out) return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trainer_create: out is NULL");
    mt_trainer_config defaults;
    if (!cfg) { /* NULL: the defaults */
        mt_trainer_config_init(&defaults);
        cfg = &defaults;
    }
    mt_status s = mti_dp_agree_config(ctx, m, cfg); /* ranks first: they then fail alike */
    if (!s) s = check_config(ctx, m, cfg);
    if (!s) s = mti_tp_check(ctx, m, cfg);
    if (!s) s = mti_pp_check(ctx, m, cfg);
    if (s) return s;
    /* (tensor and pipeline parallel: ZeRO within the data-parallel groups) */
    const int tpn = (cfg->tensor_parallel > 1 ? cfg->tensor_parallel : 1) *
                    (cfg->pipeline_parallel > 1 ? cfg->pipeline_parallel : 1);
    const int zero = ctx->world / tpn > 1 ? cfg->zero_stage : 0;
    if (zero && ctx->dev->kind == MT_DEVICE_CUDA && ctx->cfg.comm &&
        !(ctx->cfg.comm->vt.caps & MT_COMM_CAP_DEVICE))
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "mt_trainer_create: cfg->zero_stage %d on a CUDA context needs a device "
                        "communicator (NCCL), not the %s communicator",
                        zero, mt_comm_name(ctx->cfg.comm));
    if (zero == 3) { /* what the gathers are not built for yet (docs/distributed.md) */
        bool quantized = cfg->base != MT_BASE_FULL;
        for (int i = 0; i < m->n_param; i++) quantized |= m->params[i].qf != 0;
        const char *why = cfg->lora.rank || m->lora_rank ? "LoRA adapters"
                          : quantized                      ? "a quantized base"
                                                           : NULL;
        if (why)
            return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                            "mt_trainer_create: cfg->zero_stage 3 does not combine with %s yet "
                            "(ZeRO-3 runs on full-precision bases without adapters); use stage 2",
                            why);
    }
    if (!ctx->ops)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "mt_trainer_create: %s has no kernels in this build or driver",
                        ctx->dev->name);
    const mti_optim *opt = mti_optim_of(cfg->optimizer);
    if (!opt->has_ops(ctx->ops))
        return mti_fail(ctx, MT_ERR_UNSUPPORTED, "mt_trainer_create: %s is not in the %s op table",
                        opt->title, ctx->ops->name);
    if (atomic_load(&m->n_trainers))
        return mti_fail(ctx, MT_ERR_STATE,
                        "mt_trainer_create: the model already has a trainer; destroy it first");
    if ((s = mti_offload_check(ctx, m, cfg))) return s;
    if ((s = mti_sparsity_check(ctx, m, cfg, zero))) return s;
    mt_trainer *t = calloc(1, sizeof *t);
    if (!t) return mti_fail(ctx, MT_ERR_OOM, "mt_trainer_create: out of host memory");
    t->model = m;
    t->ctx = ctx;
    t->opt = opt;
    t->cfg = *cfg;
    t->cfg.overrides = NULL;
    t->dt = dtype_of(cfg->precision);
    t->micro = cfg->micro_batch ? cfg->micro_batch : cfg->max_batch;
    t->max_seq = m->input == MT_INPUT_TOKENS ? (cfg->max_seq ? cfg->max_seq : m->max_seq) : 1;
    t->last_norm = -1.0f;
    t->zero = zero;
    t->world = ctx->world;
    t->rank = ctx->rank;
    atomic_fetch_add(&m->n_trainers, 1);
    atomic_fetch_add(&ctx->n_children, 1);
    t->counted = 1;
    if (cfg->lora.rank) { /* the adapters, unless the model has them (then checked) */
        bool had = m->lora_rank != 0;
        s = mti_lora_attach(m, &cfg->lora, "mt_trainer_create");
        t->attached = !s && !had;
    }
    t->cfg.lora.targets = NULL; /* (the model's copy is m->lora_targets) */
    bool host_ok = true;
    t->ps = calloc((size_t)m->n_param, sizeof *t->ps);
    t->sh = calloc((size_t)m->n_param, sizeof *t->sh);
    if (zero >= 2) t->gs = calloc((size_t)m->n_param, sizeof *t->gs);
    t->host_losses = malloc((size_t)t->micro * (size_t)t->max_seq * sizeof(float));
    t->host_rows = malloc((size_t)ROWS_CHUNK * (size_t)m->out_width * sizeof(float));
    host_ok = t->ps && t->sh && (zero < 2 || t->gs) && t->host_losses && t->host_rows;
    if (host_ok && cfg->n_overrides) {
        t->overrides = calloc((size_t)cfg->n_overrides, sizeof *t->overrides);
        t->patterns = calloc((size_t)cfg->n_overrides, sizeof *t->patterns);
        host_ok = t->overrides && t->patterns;
        for (int i = 0; host_ok && i < cfg->n_overrides; i++) {
            t->overrides[i] = cfg->overrides[i];
            t->patterns[i] = strdup(cfg->overrides[i].pattern);
            t->overrides[i].pattern = t->patterns[i];
            host_ok = t->patterns[i] != NULL;
        }
        t->cfg.overrides = t->overrides;
    }
    t->cfg.freeze = NULL;
    if (host_ok && cfg->n_freeze) {
        host_ok = (t->freeze = calloc((size_t)cfg->n_freeze, sizeof *t->freeze)) != NULL;
        for (int i = 0; host_ok && i < cfg->n_freeze; i++)
            host_ok = (t->freeze[i] = strdup(cfg->freeze[i])) != NULL;
        t->cfg.freeze = (const char *const *)t->freeze;
    }
    if (!host_ok) s = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    if (!s) s = mark_frozen(t);
    if (!s) s = check_base(t);
    const mt_loss_scale_config *ls = &cfg->loss_scale;
    if (cfg->precision == MT_PREC_FP16)
        mti_scaler_init(&t->scaler, ls->init_scale, ls->growth_factor, ls->backoff_factor,
                        ls->growth_interval, ls->dynamic);
    else
        mti_scaler_init(&t->scaler, 1.0f, 2.0, 0.5, 1, 0);
    if (!s && !(t->units = malloc((size_t)m->n_units))) s = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    if (!s && (cfg->memory_budget || cfg->recompute == MT_RECOMPUTE_BUDGET)) {
        mt_estimate_report est;
        s = mti_plan_budget(m, cfg, t->units, &t->seg_len, &est);
        if (!s) mt_context_set_estimate(ctx, &est);
    }
    else if (!s)
        mti_plan_of_policy(m, cfg, t->units, &t->seg_len);
    t->cfg.recompute_units = t->units;
    /* pipeline parallel: the model becomes this rank's stage; tensor
       parallel: this rank's parts of the split tensors; the context's
       collectives within the data-parallel group */
    s = mti_pp_begin(t, s); /* (every rank: the world agrees first) */
    s = mti_tp_begin(t, s);
    t->world = ctx->world;
    t->rank = ctx->rank;
    /* a deferred model: what its homes do not take, made whole (once the
       budget is known to be met) */
    if (!s) s = mti_fill_plan(t);
    if (!s && cfg->teacher) s = mti_model_make(cfg->teacher, NULL);
    if (!s) s = mti_engine_init(&t->E, m, t->dt, t->units, t->seg_len);
    t->E.sp_kernel = mti_sparsity_kernel(cfg); /* (a pruned weight's GEMMs) */
    t->E.stage_in = t->pp.size > 1 && t->pp.rank > 0; /* (pipeline parallel: a stage) */
    t->E.stage_out = t->pp.size > 1 && t->pp.rank < t->pp.size - 1;
    if (!s && cfg->teacher) { /* forward only, fp32, keeping nothing (the plan is unread) */
        unsigned char *keep = calloc((size_t)cfg->teacher->n_units, 1);
        s = keep ? mti_engine_init(&t->TE, cfg->teacher, MTI_F32, keep, 1)
                 : mti_fail(ctx, MT_ERR_OOM, "out of host memory");
        t->TE.sp_kernel = (int)cfg->prune.kernel; /* (the teacher never regrows) */
        free(keep);
        if (!s) {
            t->teaching = 1;
            atomic_fetch_add(&cfg->teacher->n_trainers, 1);
        }
    }
    /* (tensor parallel: the head's share of the table's gradient is made at
       once, in the head's backward) */
    t->E.defer_tied = (cfg->fused_step != 0 || zero >= 2) && t->tp.size < 2 &&
                      t->pp.size < 2; /* (pipeline parallel: the head and table on two stages) */
    if (!s) s = mti_sparsity_create(t); /* (a prune at create: before the state is planned) */
    if (!s) s = plan_state(t);
    if (!s) s = weights_to_fp32(t); /* left in 16 bits by an earlier trainer's failed end */
    if (!s) s = quantize_base(t); /* the frozen linear weights, one tensor at a time */
    if (!s && cfg->offload == MT_PLACE_HOST) s = mti_hostoff_create(t, &t->hoff);
    if (!s && cfg->offload == MT_PLACE_DISK) { /* the state's (and masters') home */
        t->offload_dir = cfg->offload_dir ? strdup(cfg->offload_dir) : NULL;
        t->cfg.offload_dir = t->offload_dir;
        s = cfg->offload_dir && !t->offload_dir ? mti_fail(ctx, MT_ERR_OOM, "out of host memory")
                                                : mti_offload_create(t, t->dt != MTI_F32 && cfg->master_weights, &t->off);
    }
    if (!s && t->dt != MTI_F32 && cfg->master_weights) s = to_mixed(t);
    if (!s && t->dt != MTI_F32 && !cfg->master_weights) {
        t->bare = 1;
        if ((s = convert_weights(t, t->dt))) (void)weights_to_fp32(t);
        /* the fp32 weights are gone: what a caching allocator kept of them
           goes back, so the state and the steps start from fresh memory
           rather than from the fragments of tensors twice their size */
        for (int a = 0; !s && a < ctx->n_inst; a++) (void)mt_allocator_trim(ctx->inst[a]);
    }
    /* the weights' home: disk (on several ranks once the ranks have agreed on
       them: their hash reads them where they are) */
    const bool params_late = ctx->world > 1;
    if (!s && t->off && cfg->offload_params && !params_late) s = mti_offload_put_params(t->off);
    if (zero == 3) s = mti_zero3_shard(t, s); /* the weights' home: this rank's slices (every rank) */
    const bool fill_late = t->off && cfg->offload_params && params_late;
    if (!s && !fill_late) s = mti_fill_homes(t); /* a deferred model's, from its source */
    if (!s) s = mti_home_choose(t);
    if (!s) s = make_state(t);
    if (!s) t->E.tied_rows = tied_rows_for(t);
    if (!s) t->E.head_rows = mti_engine_head_rows(&t->E); /* (the LM head fused with the loss) */
    t->flag_grads = cfg->precision == MT_PREC_FP16 || !(cfg->grad_clip > 0.0f);
    if (!s) {
        t->found_inf = (mti_tensor){.dtype = MTI_I32, .ndim = 1, .shape = {2}};
        s = mti_tensor_alloc(ctx, &t->found_inf, MT_MEM_IO, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_TRAINER, 2));
    }
    if (!s && cfg->grad_clip > 0.0f) {
        t->sumsq = (mti_tensor){.dtype = MTI_F32, .ndim = 1, .shape = {m->n_param}};
        s = mti_tensor_alloc(ctx, &t->sumsq, MT_MEM_IO, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_TRAINER, 3));
    }
    /* the communication thread, where it can (a CPU context whose
       communicator takes calls from any thread): the gradients' all-reduce
       (stage 1: reduce-scatter) overlapping backward, without the fused
       update, which reduces in its own hooks; stage 3's gathers ahead of
       the layers and its reduce-scatters, with either step */
    const bool ahead = zero == 3 && cfg->zero3_prefetch > 0;
    const mti_queue_kind can = mti_queue_possible(ctx), plan = mti_queue_planned(ctx);
    const bool pp = t->pp.size > 1; /* (pipeline parallel sums after its schedule) */
    if (!s && !mti_local_sgd(t) && can && !pp &&
        (ahead || (!cfg->fused_step && zero < 2 && can == MTI_QUEUE_THREAD)))
        s = queue_start(t, zero == 1 ? zero1_job : NULL);
    /* stage 2's reduce-scatters on it, and the fused step's reductions at
       stages 0 to 2 (not with the state on disk, whose pieces stream in
       the update's order as backward makes it); an estimate plans the
       whole gradients they hold */
    const bool on_stream = plan == MTI_QUEUE_STREAM && cfg->offload == MT_PLACE_DEVICE;
    if (!s && !mti_local_sgd(t) && (plan == MTI_QUEUE_THREAD || on_stream) &&
        ((!cfg->fused_step && zero == 2) ||
         (cfg->fused_step && zero < 3 && cfg->offload == MT_PLACE_DEVICE))) {
        t->s2 = !cfg->fused_step;
        t->fq = cfg->fused_step != 0;
        t->phased = ctx->dev->kind == MT_DEVICE_CUDA; /* (NCCL's stream) */
        if (!(t->s2q = malloc((size_t)m->n_param * sizeof *t->s2q + 1)) ||
            (t->phased && !(t->hb = calloc((size_t)m->n_param + 1, sizeof *t->hb))))
            s = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
        if (!s && can) s = queue_start(t, held_job);
    }
    /* and the all-gathers of the updated weights at stages 1 and 2 */
    if (!s && on_stream && (zero == 1 || zero == 2) && !mti_local_sgd(t) && !pp) {
        t->ag_on = 1;
        t->agb = calloc((size_t)m->n_param + 1, sizeof *t->agb);
        t->agt = calloc((size_t)m->n_param + 1, sizeof *t->agt);
        t->agq = calloc((size_t)m->n_param + 1, sizeof *t->agq);
        if (!t->agb || !t->agt || !t->agq) s = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    }
    /* on a CUDA context with NCCL, stage 0's sums on a communication stream,
       and stage 1's (all-reduced: each rank then takes its slice) */
    t->sum_on_stream = !cfg->fused_step && !mti_local_sgd(t) && plan == MTI_QUEUE_STREAM && !pp &&
                       (zero == 0 || (zero == 1 && cfg->offload == MT_PLACE_DEVICE));
    if (!s && t->sum_on_stream && can) s = queue_start(t, NULL);
    /* (the queues' buckets are sized for each gradient at create) */
    if (!s && mti_sparsity_changes_later(t) && (t->q || t->s2 || t->fq || t->ag_on))
        s = mti_fail(ctx, MT_ERR_UNSUPPORTED,
                     "mt_trainer_create: a prune after create (cfg->prune) does not combine "
                     "with the gradients summed on the communication thread or stream yet (their "
                     "sizes are fixed at create); prune at step 0 by magnitude");
    s = mti_dp_created(t, s);
    s = mti_tp_agree(t, s);
    s = mti_pp_agree(t, "mt_trainer_create", "the trainer's creation", s);
    if (!s && t->off && cfg->offload_params && params_late)
        s = mti_dp_agree_status(t, "mt_trainer_create", "sending the weights to disk",
                                put_params_late(t));
    if (s) {
        mti_msg msg = mti_last_msg(ctx);
        bool attached = t->attached;
        mti_prune_undo *undo = mti_sparsity_take_undo(t); /* (a prune at create, undone) */
        mt_trainer_destroy(t);
        mti_prune_undo_apply(m, undo);
        if (attached) mti_lora_detach(m); /* the model as it was */
        /* (a message the ranks' exchanges made names the call already) */
        const char *fn = "mt_trainer_create: ";
        return mti_fail(ctx, s, "%s%s", strncmp(msg.s, fn, strlen(fn)) ? fn : "", msg.s);
    }
    mti_fill_commit(t);
    mti_tp_commit(t);
    mti_pp_commit(t);
    mti_prune_undo_free(mti_sparsity_take_undo(t));
    *out = t;
    return MT_OK;
}

uint64_t mt_trainer_steps(const mt_trainer *t) { return t ? t->steps : 0; }

float mt_trainer_lr(const mt_trainer *t) { return t ? lr_at(&t->cfg, t->opt_steps) : 0.0f; }

float mt_trainer_last_grad_norm(const mt_trainer *t) { return t ? t->last_norm : -1.0f; }

mt_status mt_trainer_get_loss_scale(const mt_trainer *t, mt_loss_scale_state *out)
{
    if (!t || !out)
        return mti_fail(t ? t->ctx : NULL, MT_ERR_INVALID_ARG, "mt_trainer_get_loss_scale: %s is NULL",
                        t ? "out" : "t");
    *out = (mt_loss_scale_state){.scale = t->scaler.scale,
                                 .growth_tracker = t->scaler.growth_tracker,
                                 .steps_skipped = t->steps_skipped,
                                 .last_step_skipped = t->last_skipped};
    return MT_OK;
}

mt_status mt_trainer_set_loss_scale(mt_trainer *t, const mt_loss_scale_state *in)
{
    if (!t || !in)
        return mti_fail(t ? t->ctx : NULL, MT_ERR_INVALID_ARG, "mt_trainer_set_loss_scale: %s is NULL",
                        t ? "in" : "t");
    if (!isfinite(in->scale) || in->scale <= 0.0f)
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_set_loss_scale: in->scale %g must be finite and > 0",
                        (double)in->scale);
    int max_tracker = t->scaler.dynamic ? t->scaler.growth_interval - 1 : 0;
    if (in->growth_tracker < 0 || in->growth_tracker > max_tracker)
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_set_loss_scale: in->growth_tracker %d out of range 0..%d",
                        in->growth_tracker, max_tracker);
    if (t->cfg.precision != MT_PREC_FP16 && in->scale != 1.0f)
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_set_loss_scale: the trainer does not scale (precision is not "
                        "fp16): the scale must be 1");
    t->scaler.scale = in->scale;
    t->scaler.growth_tracker = in->growth_tracker;
    t->steps_skipped = in->steps_skipped;
    t->last_skipped = in->last_step_skipped != 0;
    return MT_OK;
}

/* ---- the step ---- */

static mt_status check_batch(mt_trainer *t, const mt_batch *b, const char *fn)
{
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    if (!b) return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch is NULL", fn);
    if (b->n < 1 || b->n > t->cfg.max_batch)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch->n %d out of range 1..%d (max_batch)",
                        fn, b->n, t->cfg.max_batch);
    if (!b->targets) return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch->targets is NULL", fn);
    size_t T = 1;
    if (m->input == MT_INPUT_TOKENS) {
        if (!b->tokens)
            return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch->tokens is NULL (a token model)", fn);
        if (b->seq_len < 1 || b->seq_len > t->max_seq)
            return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch->seq_len %d out of range 1..%d", fn,
                            b->seq_len, t->max_seq);
        T = (size_t)b->seq_len;
        for (size_t i = 0; i < (size_t)b->n * T; i++)
            if (b->tokens[i] < 0 || b->tokens[i] >= m->vocab)
                return mti_fail(ctx, MT_ERR_INVALID_ARG,
                                "%s: batch->tokens[%zu] = %d out of range 0..%d", fn, i,
                                (int)b->tokens[i], m->vocab - 1);
    } else if (!b->inputs) {
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: batch->inputs is NULL", fn);
    }
    for (size_t i = 0; i < (size_t)b->n * T; i++)
        if (b->targets[i] < 0 || b->targets[i] >= m->classes)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s: batch->targets[%zu] = %d out of range 0..%d", fn, i,
                            (int)b->targets[i], m->classes - 1);
    /* sequence parallel: every micro-batch's rows split evenly over the
       tensor group (the last micro-batch's too) */
    const int g = t->tp.sp ? t->tp.size : 1;
    for (int r0 = 0; g > 1 && r0 < b->n; r0 += t->micro) {
        const int rows = b->n - r0 < t->micro ? b->n - r0 : t->micro;
        if (((size_t)rows * T) % (size_t)g)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s: sequence parallel: a micro-batch of %d rows of %zu tokens is "
                            "%zu rows, not a multiple of the tensor group's %d ranks", fn, rows,
                            T, (size_t)rows * T, g);
    }
    return MT_OK;
}

/* n gradient values unscaled in place (fp16; else the scale is 1) and
 * checked for inf and NaN, where the flag checks them (the flag
 * accumulates). */
static mt_status unscale_g(mt_trainer *t, float *g, size_t n)
{
    if (!t->flag_grads) return MT_OK;
    const mti_kctx k = {t->ctx, t->ctx->dev};
    return t->ctx->ops->unscale_check(&k, g, n, t->inv, t->found_inf.blk.ptr);
}

/* clipping: the sum of squares of n gradient values of parameter i added
 * onto its slot (pieces in order, each starting at a multiple of
 * MTI_SUMSQ_ROUND, give the bits of the whole) */
static mt_status sumsq_g(mt_trainer *t, int i, const float *g, size_t n)
{
    if (!(t->cfg.grad_clip > 0.0f)) return MT_OK;
    const mti_kctx k = {t->ctx, t->ctx->dev};
    return t->ctx->ops->sumsq(&k, (float *)t->sumsq.blk.ptr + i, g, n);
}

/* this rank's part of parameter i's gradient (all of it without ZeRO) */
static mt_status unscale(mt_trainer *t, int i)
{
    size_t at, n;
    float *g = mti_home_own(t, i, &at, &n);
    return n ? unscale_g(t, g, n) : MT_OK;
}

static mt_status sumsq(mt_trainer *t, int i)
{
    size_t at, n;
    float *g = mti_home_own(t, i, &at, &n);
    return n ? sumsq_g(t, i, g, n) : MT_OK;
}

/* Parameter i's whole gradient summed over the ranks where this rank
 * needs it: all of it (stage 0), or this rank's elements, in place. Stage
 * 2's unfused step has reduced it into the slices during backward. */
static mt_status reduce_grad(mt_trainer *t, int i)
{
    mti_tensor *g;
    /* an estimate of sums the stream makes in place: the gradient alone,
       as the run's give_rest makes it (stage 1's bucket is not made) */
    if (t->sum_on_stream && t->ctx->dry) return mti_engine_grad(&t->E, i, &g);
    return mti_home_reduce_grad(t, i);
}

/* Elements [at, at + n) of parameter i's gradient in g summed over the
 * ranks where this rank needs them; *own and *own_n get this rank's part
 * of the range (where its elements start in g, how many). */
static mt_status reduce_range(mt_trainer *t, int i, float *g, size_t at, size_t n, size_t *own,
                              size_t *own_n)
{
    size_t lo = t->sh[i].lo > at ? t->sh[i].lo : at, hi = t->sh[i].hi < at + n ? t->sh[i].hi : at + n;
    *own = lo - at;
    *own_n = hi > lo ? hi - lo : 0;
    return mti_home_reduce(t, i, g, at, n, *own_n ? g + *own : NULL, NULL, MTI_ZR_ALL);
}

static mt_status held_give(mt_trainer *t, int i);
static mt_status held_retire(mt_trainer *t, bool all, mt_status s);

/* fused, first of two passes: check and measure each gradient (reduced),
 * then drop it; with the thread (t->fq) the reduction goes there and the
 * rest runs as the gradient is let go */
static mt_status check_grad(mt_trainer *t, int i)
{
    mt_status s = unscale(t, i);
    return s ? s : sumsq(t, i);
}

/* Unfused on one rank (check_now): each gradient checked (fp16: unscaled)
 * and measured in the last micro-batch's backward as soon as it is final,
 * while it is still in cache, instead of in a pass over every gradient
 * after backward. The step reads the checks before its first update as
 * before, and each tensor's check and sum of squares are the same bits. */
static mt_status final_hook(void *user, int i) { return check_grad(user, i); }

static mt_status check_hook(void *user, int i)
{
    mt_trainer *t = user;
    /* (sequence parallel: a LayerNorm's gradient summed over the tensor
       group first; the same in each pass) */
    mt_status s = mti_tp_sum_grad(t, i, true);
    if (s) return s;
    if (t->fq_pass) return held_give(t, i);
    s = reduce_grad(t, i);
    if (!s) s = check_grad(t, i);
    mti_tensor_free(t->ctx, &t->E.grad[i]);
    return s;
}

static mt_status check_slice(void *user, int i, float *g, size_t at, size_t n)
{
    mt_trainer *t = user;
    size_t own, on;
    /* (the table's slices, last: the thread's work done first, so its
       checks and updates keep their order and the communicator is free) */
    mt_status s = t->fq_pass ? held_retire(t, true, MT_OK) : MT_OK;
    if (!s) s = reduce_range(t, i, g, at, n, &own, &on);
    if (!s && on) s = unscale_g(t, g + own, on);
    return s || !on ? s : sumsq_g(t, i, g + own, on);
}

/* Stage 2, unfused: a gradient final in this pass (whole, or a slice of
 * the tied table) goes to the slices' owners at once, each adding it onto
 * its slice (made zero at the step's first), and the whole is dropped. */
static mt_status grad_slice(mt_trainer *t, int i)
{
    const size_t lo = t->sh[i].lo, hi = t->sh[i].hi;
    mti_tensor *gs = &t->gs[i];
    mt_status s = MT_OK;
    if (hi > lo && !gs->blk.ptr) {
        *gs = (mti_tensor){.dtype = MTI_F32, .ndim = 1, .shape = {(int64_t)(hi - lo)}};
        s = mti_tensor_alloc(t->ctx, gs, MT_MEM_GRAD, MT_LIFE_STEP, MTI_TAG_PARAM(MTI_TAG_GRAD, i));
        if (!s) s = mti_tensor_zero(t->ctx, gs);
    }
    return s;
}

static mt_status shard_range(mt_trainer *t, int i, float *g, size_t at, size_t n, bool later)
{
    const size_t lo = t->sh[i].lo, hi = t->sh[i].hi;
    mti_tensor *gs = &t->gs[i];
    mt_status s = grad_slice(t, i);
    const size_t a = lo > at ? lo : at, b = hi < at + n ? hi : at + n;
    float *dst = a < b ? (float *)gs->blk.ptr + (a - lo) : NULL;
    return s ? s : later ? mti_zero3_reduce(t, i, dst) : mti_zero_reduce(t, i, g, at, n, dst, 1);
}

/* Whole gradients on the communication thread, given as backward makes
 * them final and let go in that order: stage 2's (t->s2), which the thread
 * reduce-scatters onto the slices (added, as shard_range), and the fused
 * step's (t->fq), which it sums over the ranks (stage 0) or reduce-scatters
 * in place (stages 1 and 2), reduce_grad's collective on the same values,
 * while backward goes on. The main thread lets them go, oldest first, once
 * more than HELD bytes of them besides the newest are held, waiting for
 * their collectives if it must; the fused step's check or update of a
 * tensor runs then, on the main thread, in the order the blocking step
 * runs them, so the flags, norms and weights are its bits. Where they are
 * let go depends only on the order backward finishes them and their
 * sizes, never on the thread's timing, so the peaks are the same in every
 * run and in the estimate, which runs this without a thread (the
 * collectives then run, dry, at once). (HELD: above.) */

/* A held gradient's collective (phase MTI_ZR_ALL), or on NCCL's stream
 * its two halves: the collective queued (MTI_ZR_POST), and once it is
 * done this rank's sums taken (MTI_ZR_FINISH). */
static mt_status held_reduce(mt_trainer *t, int i, float *g, int phase)
{
    const size_t n = t->model->params[i].numel;
    void *b = t->phased ? t->hb[i].blk.ptr : NULL;
    if (!t->fq) return mti_zero_reduce_phase(t, i, g, 0, n, t->gs[i].blk.ptr, 1, b, phase);
    return mti_home_reduce(t, i, g, 0, n, g ? g + t->sh[i].lo : NULL, b, phase);
}

static mt_status held_job(void *user, int i, float *g)
{
    mt_trainer *t = user;
    return held_reduce(t, i, g, t->phased ? MTI_ZR_POST : MTI_ZR_ALL);
}

static mt_status fused_after(mt_trainer *t, int i);

/* Lets the oldest whole gradients go: all of them, or while more than
 * HELD bytes besides the newest are held; after a failure (s, or one on
 * the way) only waited for and freed. */
static mt_status held_retire(mt_trainer *t, bool all, mt_status s)
{
    while (t->s2_head < t->s2_tail &&
           (all || (t->s2_tail - t->s2_head > 1 && t->s2_bytes > HELD))) {
        const int i = t->s2q[t->s2_head];
        mt_status e = t->q ? mti_queue_wait_first(t->q, t->s2_head + 1) : MT_OK;
        if (!s) s = e;
        if (!s && t->phased) s = held_reduce(t, i, t->E.grad[i].blk.ptr, MTI_ZR_FINISH);
        if (!s && t->fq_pass) s = fused_after(t, i);
        t->s2_bytes -= t->model->params[i].numel * sizeof(float);
        if (t->phased) t->s2_bytes -= mti_tensor_bytes(&t->hb[i]);
        if (t->phased) mti_tensor_free(t->ctx, &t->hb[i]);
        mti_tensor_free(t->ctx, &t->E.grad[i]);
        t->s2_head++;
        if (s && !all) break;
    }
    return s;
}

static mt_status held_give(mt_trainer *t, int i)
{
    mt_status s = t->s2 ? grad_slice(t, i) : MT_OK;
    if (t->s2) t->E.uses_left[i] = -1; /* reduced in this pass */
    if (s) return s;
    float *g = t->E.grad[i].blk.ptr;
    const size_t n = t->model->params[i].numel;
    /* on NCCL's stream, the bucket its chunks wait in until they are taken
       (none at stage 0: the sum is in place) */
    const size_t bb = t->phased ? mti_home_bucket(t, i, n) : 0;
    if (bb && (s = mti_comm_buffer(t->ctx, &t->hb[i], bb))) return s;
    t->s2q[t->s2_tail++] = i;
    t->s2_bytes += n * sizeof(float) + (bb ? mti_tensor_bytes(&t->hb[i]) : 0);
    const char *name = t->model->params[i].name;
    s = t->q ? mti_queue_push(t->q, i, name, g) : held_job(t, i, g);
    return s ? s : held_retire(t, false, MT_OK);
}

/* A backward whose whole gradients go to the thread begins (fq_pass: the
 * fused step's checks 1, updates 2; 0 stage 2's). */
static void held_begin(mt_trainer *t, int fq_pass)
{
    t->s2_head = t->s2_tail = 0;
    t->s2_bytes = 0;
    t->fq_pass = fq_pass;
    if (t->q) mti_queue_begin(t->q);
}

/* ... and ended (status s): every one let go, the thread's work done. */
static mt_status held_end(mt_trainer *t, mt_status s)
{
    s = held_retire(t, true, s);
    if (t->ag_on) s = ag_retire(t, true, s); /* (the fused step's gathers) */
    t->fq_pass = 0;
    return s;
}

static mt_status shard_hook(void *user, int i)
{
    mt_trainer *t = user;
    if (t->s2) return held_give(t, i);
    const bool later = mti_zero3_later(t); /* (then the gradient goes once it is reduced) */
    mt_status s = shard_range(t, i, t->E.grad[i].blk.ptr, 0, t->model->params[i].numel, later);
    if (!later) mti_tensor_free(t->ctx, &t->E.grad[i]);
    t->E.uses_left[i] = -1; /* reduced in this pass */
    return s;
}

static mt_status shard_slice(void *user, int i, float *g, size_t at, size_t n)
{
    mt_trainer *t = user;
    /* (on the thread's stage 2: its work done first, so the communicator is
       this thread's; the slice is the engine's, let go on return) */
    mt_status s = t->s2 ? held_retire(t, true, MT_OK) : MT_OK;
    if (s) return s;
    if (at + n == t->model->params[i].numel) t->E.uses_left[i] = -1;
    return shard_range(t, i, g, at, n, false);
}

/* After a pass of stage 2's unfused step: a parameter the pass gave no
 * gradient still takes part (zeros), in parameter order on every rank. */
static mt_status shard_rest(mt_trainer *t)
{
    mt_status s = MT_OK;
    for (int i = 0; i < t->model->n_param && !s; i++) {
        if (t->E.uses_left[i] < 0 || t->model->params[i].frozen) continue;
        mti_tensor *g;
        s = mti_engine_grad(&t->E, i, &g);
        if (!s) s = shard_hook(t, i);
    }
    return s;
}

static void free_slices(mt_trainer *t)
{
    if (t->gs)
        for (int i = 0; i < t->model->n_param; i++) mti_tensor_free(t->ctx, &t->gs[i]);
}

/* The fused step in one backward pass: the flag is read before each
 * tensor's update, so a non-finite gradient stops the step before it
 * reaches a weight (the step is then skipped if nothing was updated). */
static mt_status halt_if_flagged(mt_trainer *t, int i)
{
    if (!t->check_each) return MT_OK;
    int32_t flag = 0;
    mt_status s = mti_tensor_download(t->ctx, &t->found_inf, &flag, sizeof flag);
    int any = flag != 0;
    if (!s && mti_home_split(t)) s = mti_zero_any(t, &any); /* each rank checked its own slice */
    if (s || !any) return s;
    t->halted = 1;
    return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                    "the gradient of %s is not finite though the loss is (an overflow in "
                    "backward); no weight took a non-finite value",
                    t->model->params[i].name);
}

/* fused: update as soon as the gradient is final (reduced), then drop it;
 * with the thread (t->fq) once its reduction there is done */
static mt_status update_grad(mt_trainer *t, int i)
{
    mt_status s = unscale(t, i);
    if (!s) s = halt_if_flagged(t, i);
    if (!s) s = update_param(t, i, t->clip);
    if (!s) t->touched = 1;
    if (!s) t->updated++;
    return s;
}

static mt_status fused_after(mt_trainer *t, int i)
{
    return t->fq_pass == 1 ? check_grad(t, i) : update_grad(t, i);
}

static mt_status update_hook(void *user, int i)
{
    mt_trainer *t = user;
    mt_status s = mti_tp_sum_grad(t, i, true); /* (as in check_hook) */
    if (s) return s;
    if (t->fq_pass) return held_give(t, i);
    s = reduce_grad(t, i);
    if (!s) s = update_grad(t, i);
    mti_tensor_free(t->ctx, &t->E.grad[i]);
    return s;
}

static mt_status update_slice(void *user, int i, float *g, size_t at, size_t n)
{
    mt_trainer *t = user;
    size_t own, on;
    mt_status s = t->fq_pass ? held_retire(t, true, MT_OK) : MT_OK; /* (as check_slice) */
    if (!s) s = reduce_range(t, i, g, at, n, &own, &on);
    if (!s && on) s = unscale_g(t, g + own, on);
    if (!s) s = halt_if_flagged(t, i);
    if (!s && on) s = mti_home_update(t, i, g + own, at + own, on, t->clip, update_piece);
    if (!s && mti_home_gathers_now(t, i)) s = mti_zero_gather(t, i, at, n);
    if (!s) t->touched = 1;
    if (!s && at + n == t->model->params[i].numel) t->updated++;
    return s;
}

/* After the checks of a step: found (fp16 overflow), and the clip factor
 * from the per-tensor sums of squares, added in parameter order. A
 * non-finite norm skips the step. */
static mt_status finish_checks(mt_trainer *t, int *found)
{
    mt_status s;
    *found = 0;
    if (t->flag_grads) {
        int32_t flag = 0;
        MTI_TRY(mti_tensor_download(t->ctx, &t->found_inf, &flag, sizeof flag));
        *found = flag != 0;
    }
    t->clip = 1.0f;
    t->last_norm = -1.0f;
    const bool clip = t->cfg.grad_clip > 0.0f;
    /* under ZeRO each rank checked and measured its own slices: every rank
       makes the exchange, whatever it found */
    const bool split = mti_home_split(t);
    /* every rank of the tensor and pipeline groups exchanges too */
    const bool tp = t->tp.size > 1, pp = t->pp.size > 1;
    const int n = clip && (split || tp || pp || !*found) ? t->model->n_param : 0;
    if (!n && !split && !tp && !pp) return MT_OK;
    float *h = malloc(((size_t)n + 1) * sizeof *h);
    if (!h) return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    s = n ? mti_tensor_download(t->ctx, &t->sumsq, h, (size_t)n * sizeof *h) : MT_OK;
    if (n && pp && t->pp.tied >= 0) h[t->pp.tied] = 0.0f; /* (the first stage counts the table) */
    double sum = 0.0;
    if (!s && split) s = mti_zero_checks(t, h, n, found, &sum); /* (h: each tensor's) */
    if (!s && tp) s = mti_tp_checks(t, h, n, found, &sum);
    for (int i = 0; i < n && !split && !tp; i++) sum += h[i];
    free(h);
    if (!s && pp) s = mti_pp_checks(t, found, &sum);
    if (s || !clip || *found) return s;
    float norm = (float)sqrt(sum);
    t->last_norm = norm;
    if (!isfinite(norm)) {
        *found = 1;
    } else {
        float coef = t->cfg.grad_clip / (norm + 1e-6f);
        t->clip = coef < 1.0f ? coef : 1.0f;
    }
    return MT_OK;
}

/* A failed step's end: what it took freed, and its message said once,
 * prefixed with fn (unless it is already: the ranks' exchanges name the
 * call), with how far the update went. t->updated counts the tensors
 * whose update finished on this rank; the step can fail after all of them
 * (writing the last pieces home, or another rank failing), which is not
 * part-way. */
static mt_status step_failed(mt_trainer *t, const char *fn, mt_status s)
{
    mti_msg msg = mti_last_msg(t->ctx);
    if (t->ag_on) (void)ag_retire(t, true, s); /* (waited for, their buckets freed) */
    mti_home_abandon(t); /* the updates queued land, what was updated goes home */
    mti_engine_release(&t->E);
    mti_engine_free_grads(&t->E);
    free_slices(t);
    mti_context_reset(t->ctx, MT_SCOPE_STEP);
    const size_t k = strlen(fn);
    const char *why = msg.s;
    if (!strncmp(why, fn, k) && !strncmp(why + k, ": ", 2)) why += k + 2;
    int trained = 0;
    for (int i = 0; i < t->model->n_param; i++) trained += !t->model->params[i].frozen;
    if (!t->updated && !t->touched)
        return mti_fail(t->ctx, s, "%s: %s (weights and optimizer state unchanged%s)", fn, why,
                        mti_sparsity_pruned_now(t) ? " but for the prune made at the step's start"
                                                   : "");
    if (!t->updated) /* (the fused step's slices of the tied table) */
        return mti_fail(t->ctx, s, "%s: %s (the update failed part-way: slices of one weight "
                        "tensor were updated)", fn, why);
    if (mti_home_queued(t)) /* (some may not have landed) */
        return mti_fail(t->ctx, s, "%s: %s (the update failed part-way: at most %d of the %d "
                        "trained weight tensors were updated)", fn, why, t->updated, trained);
    if (t->updated < trained)
        return mti_fail(t->ctx, s, "%s: %s (the update failed part-way: %d of the %d trained "
                        "weight tensors were updated)", fn, why, t->updated, trained);
    return mti_fail(t->ctx, s, "%s: %s (after the update: all %d trained weight tensors were "
                    "updated%s)", fn, why, trained, t->world > 1 ? " on this rank" : "");
}

/* Overlap: a gradient final in the last micro-batch's backward goes to
 * the queue (comm/queue.h: the communication thread, or on a CUDA context
 * with NCCL the communication stream) at once. */
static mt_status give(mt_trainer *t, int i, float *g)
{
    return mti_queue_push(t->q, i, t->model->params[i].name, g);
}

static mt_status give_hook(void *user, int i)
{
    mt_trainer *t = user;
    return give(t, i, t->E.grad[i].blk.ptr);
}

/* After the passes (status s): every tensor not given yet goes to the
 * thread (a parameter the batch did not reach as zeros; a frozen one as
 * nothing; all of them as zeros to drop when the passes failed, so the
 * ranks still make the same collectives), then the step waits for them. */
static mt_status give_rest(mt_trainer *t, mt_status s)
{
    const mt_model *m = t->model;
    for (int i = m->n_param - 1; i >= 0; i--) {
        if (mti_queue_pushed(t->q, i)) continue;
        const mti_param *p = &m->params[i];
        mti_tensor *g = NULL;
        /* (a queue that reads device memory needs a buffer for a failed
           rank's zeros too) */
        if ((!s || (mti_queue_caps(t->q) & MTI_QUEUE_DEVICE)) && !p->frozen) {
            mt_status e = mti_engine_grad(&t->E, i, &g);
            if (!s) s = e;
        }
        mt_status e = give(t, i, g ? g->blk.ptr : NULL);
        if (!s) s = e;
    }
    if (!s) return mti_queue_wait(t->q);
    mti_msg msg = mti_last_msg(t->ctx);
    (void)mti_queue_wait(t->q);
    return mti_fail(t->ctx, s, "%s", msg.s);
}

/* The targets (rows x tokens) of a batch. */
static double targets_of(const mt_trainer *t, const mt_batch *b)
{
    return (double)b->n * (t->model->input == MT_INPUT_TOKENS ? b->seq_len : 1);
}

/* The fused step's only backward pass, updating as it goes. A non-finite
 * gradient found before any update skips the step (*found). */
static mt_status fused_pass(mt_trainer *t, int *found)
{
    mti_engine *E = &t->E;
    mt_status s = mti_tensor_zero(t->ctx, &t->found_inf);
    if (s) return s;
    E->slice_hook = update_slice;
    t->check_each = 1;
    t->halted = t->touched = 0;
    if (t->fq) held_begin(t, 2);
    s = mti_engine_backward(E, 0, update_hook, t);
    if (t->fq) s = held_end(t, s);
    t->check_each = 0;
    if (s && t->halted && !t->touched) {
        mti_clear_error(t->ctx);
        *found = 1;
        return MT_OK;
    }
    return s;
}

/* One micro-batch's backward, unfused (the engine armed): at ZeRO-2 each
 * gradient reduce-scattered into its slice as soon as it is final (in the
 * stage's hooks); else accumulated, with last (its gradients are final in
 * it) going to the overlap's queue or the checks as they become final. */
static mt_status micro_backward(mt_trainer *t, bool shard, bool last)
{
    mti_engine *E = &t->E;
    mt_status s;
    if (shard) {
        E->slice_hook = shard_slice;
        if (t->s2) held_begin(t, 0);
        s = mti_engine_backward(E, 0, shard_hook, t);
        if (!s) s = shard_rest(t);
        if (t->s2) s = held_end(t, s); /* the thread's work done, whatever happened */
        return mti_zero3_settle(t, s); /* (stage 3's queued reduce-scatters done) */
    }
    mti_grad_hook hook = !last ? NULL : t->overlap_now ? give_hook : NULL;
    if (last && t->check_now) {
        hook = final_hook;
        if (t->flag_grads) MTI_TRY(mti_tensor_zero(t->ctx, &t->found_inf));
        if (t->cfg.grad_clip > 0.0f) MTI_TRY(mti_tensor_zero(t->ctx, &t->sumsq));
    }
    return mti_engine_backward(E, 0, hook, t);
}

/* The step's: into ZeRO-2's slices where they are (pipeline parallel's
 * schedule calls it). */
static mt_status step_backward(mt_trainer *t, bool last)
{
    return micro_backward(t, mti_home_grad_sliced(t), last);
}

/* Forward and backward of every micro-batch; gradients accumulate (with
 * shard set, in stage 2's slices, each reduce-scattered in backward as
 * soon as it is final). With fused set, the update runs in backward. The loss gradient is scaled by
 * 1 / targets (the whole batch's, over every rank); *sum_out gets the sum
 * of this rank's losses. With skip set and one rank, a micro-batch whose
 * loss is not finite ends the passes (*found: the step is skipped); with
 * several, the summed gradients tell every rank alike. */
static mt_status passes(mt_trainer *t, const mt_batch *b, bool fused, bool shard, bool skip,
                        double targets, int *found, double *sum_out)
{
    mt_context *ctx = t->ctx;
    mti_engine *E = &t->E;
    const float dloss = (float)((double)t->scaler.scale / targets);
    /* (tensor parallel: a non-finite gradient in one rank's part must skip
       every rank's update, which the checks' pass agrees on first) */
    const bool two_pass = t->cfg.precision == MT_PREC_FP16 || t->cfg.grad_clip > 0.0f ||
                          t->tp.size > 1;
    double sum = 0.0;
    mt_status s;
    *found = 0;
    for (int r0 = 0; r0 < b->n; r0 += t->micro) {
        int rows = b->n - r0 < t->micro ? b->n - r0 : t->micro;
        double part = 0.0;
        if (t->teaching) { /* the teacher's logits, then the student's pass */
            s = mti_engine_forward(&t->TE, b, r0, rows, 1);
            mti_tensor_free(ctx, &t->TE.tokens);
            mti_tensor_free(ctx, &t->TE.targets);
            if (!s) s = mti_engine_forward(E, b, r0, rows, 0);
            if (!s) s = mti_engine_loss_kd(E, &t->TE, t->cfg.distill_alpha, t->cfg.distill_temp,
                                           dloss);
            mti_engine_release(&t->TE);
            if (s) return s;
        } else {
            MTI_TRY(mti_engine_forward(E, b, r0, rows, 0));
            MTI_TRY(mti_engine_loss(E, dloss, 1));
        }
        MTI_TRY(mti_engine_loss_sum(E, t->host_losses, &part));
        sum += part;
        mti_context_reset(ctx, MT_SCOPE_PHASE); /* end of forward */
        if (skip && !mti_dp_on(t) && !isfinite(part)) { /* no backward, no update */
            *found = 2;
            mti_engine_release(E);
            mti_context_reset(ctx, MT_SCOPE_PHASE);
            break;
        }
        mti_engine_arm(E);
        if (!fused) {
            MTI_TRY(micro_backward(t, shard, r0 + rows >= b->n));
        } else if (!two_pass) {
            MTI_TRY(fused_pass(t, found));
        } else {
            if (t->flag_grads) MTI_TRY(mti_tensor_zero(ctx, &t->found_inf));
            if (t->cfg.grad_clip > 0.0f) MTI_TRY(mti_tensor_zero(ctx, &t->sumsq));
            E->slice_hook = check_slice;
            if (t->fq) held_begin(t, 1);
            s = mti_engine_backward(E, 1, check_hook, t);
            MTI_TRY(t->fq ? held_end(t, s) : s);
            mti_context_reset(ctx, MT_SCOPE_PHASE);
            MTI_TRY(finish_checks(t, found));
            if (!*found) {
                mti_engine_arm(E);
                E->slice_hook = update_slice;
                if (t->fq) held_begin(t, 2);
                s = mti_engine_backward(E, 0, update_hook, t);
                MTI_TRY(t->fq ? held_end(t, s) : s);
            }
        }
        mti_engine_release(E);
        mti_context_reset(ctx, MT_SCOPE_PHASE); /* end of backward */
    }
    *sum_out = sum;
    return MT_OK;
}

/* The passes (micro-batches) a checked batch takes. */
static int passes_of(const mt_trainer *t, const mt_batch *b)
{
    return (b->n + t->micro - 1) / t->micro;
}

static mt_status step(mt_trainer *t, const mt_batch *b, float *loss)
{
    const char *fn = "mt_trainer_step";
    mt_status s = check_batch(t, b, fn);
    if (!s) s = mti_sparsity_step(t, fn); /* (a prune due now: before the passes) */
    if (!s) s = mti_home_begin(t); /* the homes are there (the files checked) */
    double targets = s ? 0.0 : targets_of(t, b);
    s = mti_dp_begin(t, fn, s, &targets, s ? 0 : passes_of(t, b));
    /* (pipeline parallel: every stage runs the batch, or none) */
    if ((s = mti_pp_agree_batch(t, fn, b, s))) return s;
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    const bool fused = t->cfg.fused_step != 0, pp = t->pp.size > 1;
    t->lr = lr_at(&t->cfg, t->opt_steps);
    t->inv = mti_scaler_inv(&t->scaler);
    t->clip = 1.0f;
    t->updated = t->touched = 0;
    int found = 0;
    double sum = 0.0;
    /* (stage 1: reduce-scattered to the slices' owners; stage 2's go in its hooks) */
    t->overlap_now = t->q && !fused && !mti_home_grad_sliced(t) && !pp;
    if (t->overlap_now) mti_queue_begin(t->q);
    /* (the gradients are final on this rank: no sum over ranks to wait for) */
    t->check_now = !fused && !t->overlap_now && !mti_home_split(t) && !mti_dp_on(t) &&
                   !t->tp.sp && /* (sequence parallel: some are rows' parts until summed) */
                   !pp;         /* (pipeline parallel: the tied table's are halves) */
    const bool regrow = !s && mti_sparsity_regrow_begin(t); /* (RigL: the masks, not the weights) */
    if (pp) /* (the stages' schedule; the checks find a non-finite loss's gradients) */
        s = mti_pp_passes(t, b, (float)((double)t->scaler.scale / targets), step_backward, &sum);
    else
        s = passes(t, b, fused, mti_home_grad_sliced(t), true, targets, &found, &sum);
    if (regrow) { /* one rank, unfused: nothing to sum, no update */
        const mt_status e = mti_sparsity_regrow_end(t, !s && !found);
        if (!s) s = e;
        if (s) return step_failed(t, fn, s);
        mti_context_reset(ctx, MT_SCOPE_STEP);
        t->steps++;
        t->last_skipped = 0;
        if (loss) *loss = (float)(sum / targets);
        return MT_OK;
    }
    const bool checked = t->check_now;
    t->check_now = 0;
    if (t->overlap_now) s = give_rest(t, s); /* the gradients are summed */
    /* failed passes whose collectives go on NCCL's stream in backward's
       hooks stopped part-way through them: the communicator is aborted so
       the others' queued ones end, rather than meet the status exchange */
    if (s && t->q && !t->overlap_now) mti_queue_abandon(t->q);
    s = mti_dp_end(t, fn, s, &sum);
    if ((s = mti_pp_loss(t, s, &sum))) return step_failed(t, fn, s);
    const double mean = sum / targets;
    if (!fused && !found) {
        /* (frozen parameters have no gradient: they take no part) */
        for (int i = 0; i < m->n_param && !s && !t->overlap_now; i++)
            if (!m->params[i].frozen) s = reduce_grad(t, i);
        for (int i = 0; i < m->n_param && !s; i++) s = mti_tp_sum_grad(t, i, false); /* (sequence parallel) */
        if (!s) s = mti_pp_tie(t); /* (pipeline parallel: the tied table's halves) */
        if (!s && t->flag_grads && !checked) s = mti_tensor_zero(ctx, &t->found_inf);
        if (s) return step_failed(t, fn, s);
        for (int i = 0; i < m->n_param && !s && !checked; i++)
            if (!m->params[i].frozen) s = unscale(t, i);
        if (!s && t->cfg.grad_clip > 0.0f && !checked) s = mti_tensor_zero(ctx, &t->sumsq);
        for (int i = 0; i < m->n_param && !s && !checked; i++)
            if (!m->params[i].frozen) s = sumsq(t, i);
        if (!s) s = finish_checks(t, &found);
        if (s) return step_failed(t, fn, s);
        for (int i = 0; i < m->n_param && !found && !s; i++) {
            if (m->params[i].frozen) continue;
            if ((s = update_param(t, i, t->clip))) break;
            t->updated++;
            mti_tensor_free(ctx, &t->E.grad[i]); /* this gradient is done */
            if (t->gs) mti_tensor_free(ctx, &t->gs[i]);
        }
        if (!s && t->ag_on) s = ag_retire(t, true, MT_OK); /* every weight gathered */
        if (s && !mti_home_agrees(t)) {
            if (t->updated) t->opt_steps++; /* some state has moved a step */
            return step_failed(t, fn, s);
        }
    }
    /* every update done (weights up, pieces home); the ranks agree, then gather */
    if (mti_home_agrees(t) && (s = mti_home_end(t, fn, s, !fused && !found))) {
        if (t->updated || t->touched) t->opt_steps++;
        return step_failed(t, fn, s);
    }
    if ((s = mti_home_finish(t))) { /* every piece home */
        if (t->updated || t->touched) t->opt_steps++;
        return step_failed(t, fn, s);
    }
    if (t->cfg.precision == MT_PREC_FP16) mti_scaler_update(&t->scaler, found);
    if (found)
        mti_log(ctx, found == 1 && t->cfg.precision == MT_PREC_FP16 ? MT_LOG_INFO : MT_LOG_WARN,
                "%s: step %llu skipped: the %s is not finite (weights and optimizer state "
                "unchanged)",
                fn, (unsigned long long)t->steps, found == 2 ? "loss" : "gradient");
    if (found) t->steps_skipped++;
    else t->opt_steps++;
    t->last_skipped = found != 0;
    mti_engine_free_grads(&t->E);
    free_slices(t);
    mti_context_reset(ctx, MT_SCOPE_STEP);
    t->steps++;
    if ((s = mti_local_sgd_after_step(t, fn))) return s;
    if (loss) *loss = (float)mean;
    return MT_OK;
}

mt_status mt_trainer_step(mt_trainer *t, const mt_batch *b, float *loss)
{
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_trainer_step: trainer is NULL");
    /* a collective that fails in it names the step (lib/comm/comm.c) */
    mti_comm_step(t->ctx, t->steps + 1);
    const mt_status s = step(t, b, loss);
    mti_comm_step(t->ctx, 0);
    return s;
}

/* What a pipeline-parallel trainer cannot give: every tensor of the model
 * (each rank holds its stage's). */
static mt_status pp_refused(mt_trainer *t, const char *fn)
{
    return mti_fail(t->ctx, MT_ERR_UNSUPPORTED,
                    "%s: the model is cut into %d pipeline stages (pipeline_parallel), each "
                    "rank holding its stage's tensors alone", fn, t->pp.size);
}

mt_status mt_trainer_gradients(mt_trainer *t, const mt_batch *b, float *loss, float *grads,
                               size_t n)
{
    const char *fn = "mt_trainer_gradients";
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: trainer is NULL", fn);
    if (t->pp.size > 1) return pp_refused(t, fn);
    mt_status s = check_batch(t, b, fn);
    mt_model *m = t->model;
    if (!s && (!grads || n != m->n_params))
        s = mti_fail(t->ctx, MT_ERR_INVALID_ARG, "%s: grads is NULL or n %zu is not %zu", fn, n,
                     m->n_params);
    int found = 0;
    double sum = 0.0, targets = s ? 0.0 : targets_of(t, b);
    t->inv = mti_scaler_inv(&t->scaler);
    t->updated = 0;
    t->overlap_now = 0; /* the gradients are summed below, blocking */
    t->check_now = 0;   /* (and unscaled below, unchecked) */
    if ((s = mti_dp_begin(t, fn, s, &targets, s ? 0 : passes_of(t, b)))) return s;
    s = passes(t, b, false, false, false, targets, &found, &sum); /* every gradient whole */
    if ((s = mti_dp_end(t, fn, s, &sum))) return step_failed(t, fn, s);
    const double mean = sum / targets;
    for (int i = 0; i < m->n_param && !s; i++) {
        mti_tensor *g;
        if (m->params[i].frozen) { /* no gradient: zeros */
            memset(grads + m->params[i].offset, 0, mti_whole_numel(&m->params[i]) * sizeof(float));
            continue;
        }
        s = mti_dp_reduce_grad(t, i);
        if (!s) s = mti_tp_sum_grad(t, i, true);
        if (!s) s = mti_engine_grad(&t->E, i, &g); /* a parameter the batch did not reach: zero */
        if (!s && t->cfg.precision == MT_PREC_FP16) s = unscale_g(t, g->blk.ptr, m->params[i].numel);
        if (!s && m->params[i].tp_split) /* the group's parts, whole */
            s = mti_tp_gather_host(t, i, g->blk.ptr, grads + m->params[i].offset);
        else if (!s && m->params[i].sp) /* pruned: zeros at the pruned places */
            s = mti_param_dense_host(m, i, g, grads + m->params[i].offset);
        else if (!s)
            s = mti_tensor_download(t->ctx, g, grads + m->params[i].offset,
                                    m->params[i].numel * sizeof(float));
    }
    if (s) return step_failed(t, fn, s);
    mti_engine_free_grads(&t->E);
    mti_context_reset(t->ctx, MT_SCOPE_STEP);
    if (loss) *loss = (float)mean;
    return MT_OK;
}

/* Tensor parallel: the argmax of `rows` rows of this rank's share of the
 * logits (t->host_rows, fp32) over the group: each row's greatest value,
 * then the least column holding it (the first, as one process finds it). */
static mt_status tp_right(mt_trainer *t, int rows, const int32_t *targets, int *right)
{
    const int W = t->tp.v1 - t->tp.v0;
    float *v = malloc(2 * (size_t)rows * sizeof *v + 1);
    if (!v) return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    for (int r = 0; r < rows; r++) { /* this rank's greatest */
        const float *row = t->host_rows + (size_t)r * W;
        int best = -1;
        for (int j = 0; j < t->tp.classes; j++)
            if (best < 0 || row[j] > row[best]) best = j;
        v[r] = best < 0 ? -INFINITY : row[best];
    }
    const char *what = "tensor parallel: the logits' argmax over the group";
    mt_status s = t->ctx->dry ? MT_OK
                              : mti_comm_group_host_all_reduce(t->ctx, t->tp_comm, what, v,
                                                               (size_t)rows, MT_COMM_MAX);
    for (int r = 0; r < rows && !s; r++) { /* a column holding the greatest, or none */
        const float *row = t->host_rows + (size_t)r * W;
        const float mx = v[r];
        float own = -1e30f; /* (negated: the group's max is the least column) */
        for (int j = 0; j < t->tp.classes; j++)
            if (row[j] == mx) {
                own = -(float)(t->tp.v0 + j);
                break;
            }
        v[rows + r] = own;
    }
    if (!s && !t->ctx->dry)
        s = mti_comm_group_host_all_reduce(t->ctx, t->tp_comm, what, v + rows, (size_t)rows,
                                           MT_COMM_MAX);
    for (int r = 0; r < rows && !s; r++) *right += (int)-v[rows + r] == targets[r];
    free(v);
    return s;
}

/* Argmax over the real classes of each row of the logits; the rows are
 * brought to the host ROWS_CHUNK at a time, as fp32. */
static mt_status count_right(mt_trainer *t, const int32_t *targets, int *right)
{
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    const mti_kctx k = {ctx, ctx->dev};
    mti_engine *E = &t->E;
    const mti_tensor *lg = &E->bnd[m->n_layers];
    const int W = t->tp.size > 1 ? t->tp.v1 - t->tp.v0 : m->out_width;
    mt_status s = MT_OK;
    mti_tensor f32 = {0};
    if (t->dt != MTI_F32) {
        f32 = (mti_tensor){.dtype = MTI_F32, .ndim = 2, .shape = {ROWS_CHUNK, W}};
        MTI_TRY(mti_tensor_alloc(ctx, &f32, MT_MEM_IO, MT_LIFE_STEP, MTI_TAG_PARAM(MTI_TAG_TRAINER, 4)));
    }
    for (int r0 = 0; r0 < E->N && !s; r0 += ROWS_CHUNK) {
        int rows = E->N - r0 < ROWS_CHUNK ? E->N - r0 : ROWS_CHUNK;
        size_t n = (size_t)rows * W;
        if (t->dt != MTI_F32) {
            s = ctx->ops->cast(&k, f32.blk.ptr, MTI_F32,
                               (const char *)lg->blk.ptr + (size_t)r0 * W * mti_dtype_size(t->dt),
                               t->dt, n, MTI_ROUND_NEAREST, 0);
            if (!s) s = mti_tensor_download(ctx, &f32, t->host_rows, n * sizeof(float));
        } else {
            s = ctx->dev->copy_d2h(ctx->dev, t->host_rows,
                                   (const float *)lg->blk.ptr + (size_t)r0 * W, n * sizeof(float));
            if (!s) s = ctx->dev->sync(ctx->dev);
        }
        if (t->tp.size > 1) { /* the group's argmax of each row's shares */
            if (!s) s = tp_right(t, rows, targets + r0, right);
            continue;
        }
        for (int r = 0; r < rows && !s; r++) {
            const float *row = t->host_rows + (size_t)r * W;
            int best = 0;
            for (int j = 1; j < m->classes; j++)
                if (row[j] > row[best]) best = j;
            *right += best == targets[r0 + r];
        }
    }
    mti_tensor_free(ctx, &f32);
    return s;
}

mt_status mt_trainer_eval(mt_trainer *t, const mt_batch *b, float *loss, float *accuracy)
{
    const char *fn = "mt_trainer_eval";
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: trainer is NULL", fn);
    mt_status s = check_batch(t, b, fn);
    /* (at ZeRO stage 3 a collective: a refused batch fails every rank) */
    s = mti_dp_agree_forward(t, fn, s, s ? 0 : passes_of(t, b));
    if ((s = mti_pp_agree_batch(t, fn, b, s))) return s; /* (pipeline parallel) */
    mti_engine *E = &t->E;
    const int T = t->model->input == MT_INPUT_TOKENS ? b->seq_len : 1;
    double sum = 0.0;
    int right = 0;
    t->updated = 0;
    if (t->pp.size > 1) s = mti_pp_eval(t, b, accuracy ? count_right : NULL, &sum, &right);
    for (int r0 = 0; r0 < b->n && !s && t->pp.size < 2; r0 += t->micro) {
        int rows = b->n - r0 < t->micro ? b->n - r0 : t->micro;
        double part = 0.0;
        s = mti_engine_forward(E, b, r0, rows, 1); /* eval: keeps nothing */
        if (!s) s = mti_engine_loss(E, 0.0f, 0);
        if (!s) s = mti_engine_loss_sum(E, t->host_losses, &part);
        if (!s && accuracy) s = count_right(t, b->targets + (size_t)r0 * T, &right);
        sum += part;
        mti_engine_release(E);
        mti_context_reset(t->ctx, MT_SCOPE_STEP);
    }
    if (s) return step_failed(t, fn, s);
    double targets = (double)b->n * T;
    if (loss) *loss = (float)(sum / targets);
    if (accuracy) *accuracy = (float)((double)right / targets);
    return MT_OK;
}

mt_status mt_trainer_calibrate(mt_trainer *t, const mt_batch *b)
{
    const char *fn = "mt_trainer_calibrate";
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: trainer is NULL", fn);
    if (!mti_sparsity_wanda(t))
        return mti_fail(t->ctx, MT_ERR_STATE, "%s: the trainer does not prune by Wanda "
                        "(cfg.prune.method)", fn);
    mt_status s = check_batch(t, b, fn);
    if (s) return s;
    mti_engine *E = &t->E; /* forward only (eval: nothing kept), each linear map's input summed */
    E->calib = mti_sparsity_calib;
    E->calib_user = t;
    for (int r0 = 0; r0 < b->n && !s; r0 += t->micro) {
        int rows = b->n - r0 < t->micro ? b->n - r0 : t->micro;
        s = mti_engine_forward(E, b, r0, rows, 1);
        mti_engine_release(E);
        mti_context_reset(t->ctx, MT_SCOPE_STEP);
    }
    E->calib = NULL;
    if (!s) mti_sparsity_calibrated(t);
    return s;
}

mt_status mt_trainer_recompute_plan(const mt_trainer *t, unsigned char *units, int n,
                                    int *seg_len)
{
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_trainer_recompute_plan: t is NULL");
    const int U = mt_model_num_units(t->model); /* (the whole model's) */
    if (units && n < U)
        return mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_recompute_plan: n %d is less than the model's %d units", n, U);
    /* (pipeline parallel: this stage's at their places) */
    const int u0 = t->pp.size > 1 ? t->pp.u0 : 0;
    if (units) memset(units, MT_UNIT_KEEP, (size_t)U);
    if (units) memcpy(units + u0, t->units, (size_t)t->model->n_units);
    if (seg_len) *seg_len = t->seg_len;
    return MT_OK;
}

/* The logits of row `pos` of the pass (N rows) into dst (classes fp32). */
static mt_status logits_row(mt_trainer *t, int pos, float *dst, mti_tensor *f32)
{
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    const mti_kctx k = {ctx, ctx->dev};
    const mti_tensor *lg = &t->E.bnd[m->n_layers];
    /* tensor parallel: this rank's columns of the vocabulary, put in their
       place in a row of zeros and summed over the group (exact: each
       column is one rank's) */
    const bool tp = t->tp.size > 1;
    const size_t W = tp ? (size_t)(t->tp.v1 - t->tp.v0) : (size_t)m->out_width;
    const size_t mine = tp ? (size_t)t->tp.classes : (size_t)m->classes;
    float *at = tp ? dst + t->tp.v0 : dst;
    mt_status s = MT_OK;
    if (tp) memset(dst, 0, (size_t)m->classes * sizeof(float));
    if (mine && t->dt == MTI_F32) {
        s = ctx->dev->copy_d2h(ctx->dev, at, (const float *)lg->blk.ptr + (size_t)pos * W,
                               mine * sizeof(float));
        if (!s) s = ctx->dev->sync(ctx->dev);
    } else if (mine) {
        s = ctx->ops->cast(&k, f32->blk.ptr, MTI_F32,
                           (const char *)lg->blk.ptr + (size_t)pos * W * mti_dtype_size(t->dt),
                           t->dt, W, MTI_ROUND_NEAREST, 0);
        if (!s) s = mti_tensor_download(ctx, f32, at, mine * sizeof(float));
    }
    if (!s && tp && !ctx->dry)
        s = mti_comm_group_host_all_reduce(ctx, t->tp_comm,
                                           "tensor parallel: the logits' columns over the group",
                                           dst, (size_t)m->classes, MT_COMM_SUM);
    return s;
}

mt_status mt_trainer_logits(mt_trainer *t, const mt_batch *b, float *out, size_t n)
{
    const char *fn = "mt_trainer_logits";
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: trainer is NULL", fn);
    if (t->pp.size > 1) return pp_refused(t, fn);
    mt_context *ctx = t->ctx;
    const mt_model *m = t->model;
    mt_status s = MT_OK;
    if (!b || !out)
        s = mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: %s is NULL", fn, b ? "out" : "batch");
    else if (n != (size_t)b->n * (size_t)m->classes)
        s = mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: n %zu, expected batch->n x classes = %zu", fn,
                     n, (size_t)b->n * (size_t)m->classes);
    /* the targets play no part: zeros where the caller gave none */
    const int T = !s && m->input == MT_INPUT_TOKENS ? b->seq_len : 1;
    mt_batch bb = s ? (mt_batch){0} : *b;
    int32_t *zeros = NULL;
    if (!s && !bb.targets && b->n > 0 && T > 0) {
        zeros = calloc((size_t)b->n * (size_t)T, sizeof *zeros);
        if (!zeros) s = mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
        bb.targets = zeros;
    }
    if (!s) s = check_batch(t, &bb, fn);
    /* (at ZeRO stage 3 a collective: a refused call fails every rank) */
    if ((s = mti_dp_agree_forward(t, fn, s, s ? 0 : passes_of(t, &bb)))) {
        free(zeros);
        return s;
    }
    mti_tensor f32 = {0};
    if (!s && t->dt != MTI_F32) {
        f32 = (mti_tensor){.dtype = MTI_F32, .ndim = 1, .shape = {m->out_width}};
        s = mti_tensor_alloc(ctx, &f32, MT_MEM_IO, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_TRAINER, 5));
    }
    mti_engine *E = &t->E;
    t->updated = 0;
    for (int r0 = 0; r0 < bb.n && !s; r0 += t->micro) {
        int rows = bb.n - r0 < t->micro ? bb.n - r0 : t->micro;
        s = mti_engine_forward(E, &bb, r0, rows, 1);
        for (int r = 0; r < rows && !s; r++)
            s = logits_row(t, r * T + T - 1, out + (size_t)(r0 + r) * m->classes, &f32);
        mti_engine_release(E);
        mti_context_reset(ctx, MT_SCOPE_STEP);
    }
    mti_tensor_free(ctx, &f32);
    free(zeros);
    if (s) return step_failed(t, fn, s);
    return MT_OK;
}
