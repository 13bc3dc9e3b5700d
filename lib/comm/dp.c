/*
 * dp.c - data parallel training over the context's communicator: the
 * trainer's checks that the ranks agree, the status and count exchanges
 * around a step, and the gradients' all-reduce.
 *
 * A step on N ranks, each with its own rows of the global batch:
 *   begin: one all-gather of (status, targets): a batch refused on any rank
 *     fails the step on every rank before anything runs, and the gradient
 *     of the loss is scaled by the targets of the whole global batch, so the
 *     sum over ranks of the gradients is that of the global batch's mean;
 *   forward and backward as on one rank;
 *   end: one all-gather of (status, loss sum): a failure on any rank fails
 *     the step on every rank (before any update), and the loss is the
 *     global batch's mean (the sums added in rank order);
 *   the gradients all-reduced (summed) tensor by tensor, in place, before
 *     the fp16 check, the clipping norm and the update, which then run on
 *     the same values on every rank: an overflow on any rank skips the step
 *     on all, the norm is the global one, and the weights stay equal.
 * With the fused step the all-reduce runs in backward, in the hook, before
 * each tensor's check or update.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "comm/dp.h"
#include "comm/local_sgd.h"
#include "comm/overlap.h"
#include "trainer.h"

bool mti_dp_on(const mt_trainer *t) { return mt_comm_size(t->ctx->cfg.comm) > 1; }

/* ---- what the ranks must agree on ---- */

#define H(h, x) ((h) = mti_hash((h), &(x), sizeof(x)))

static uint64_t model_hash(const mt_model *m)
{
    uint64_t h = MTI_HASH_START;
    int v[8] = {(int)m->kind, (int)m->input, m->features, m->vocab, m->padded_vocab, m->max_seq,
                m->classes, m->n_layers};
    H(h, v);
    for (int l = 0; l < m->n_layers; l++) {
        const mti_layer *L = &m->layers[l];
        int w[8] = {(int)L->kind, L->in, L->out, L->heads, L->tied, L->positions, L->stable, L->bias};
        H(h, w);
    }
    H(h, m->n_param);
    for (int i = 0; i < m->n_param; i++) {
        const mti_param *p = &m->params[i];
        h = mti_hash(h, p->name, strlen(p->name));
        H(h, p->ndim);
        H(h, p->shape);
    }
    return h;
}

/* The trainer's settings, field by field (never the struct's bytes, whose
 * padding may differ), in groups that a message can name. */
enum { W_MODEL, W_BATCH, W_OPTIM, W_SCHEDULE, W_PRECISION, W_CLIP, W_RECOMPUTE, W_FUSED,
       W_FREEZE, W_ZERO, W_OFFLOAD, W_N };
static const char *const group_names[W_N] = {
    "model (layers and shapes)", "max_batch, micro_batch, max_seq",
    "optimizer settings",        "learning rate, schedule and local_sgd_every",
    "precision and loss scaling", "grad_clip",
    "recompute and memory_budget", "fused_step", "frozen parameters (freeze) and LoRA",
    "zero_stage, zero3_prefetch and zero3_keep", "offload and offload_params"};

static void config_record(const mt_model *m, const mt_trainer_config *c, uint64_t rec[W_N])
{
    for (int i = 0; i < W_N; i++) rec[i] = MTI_HASH_START;
    rec[W_MODEL] = model_hash(m);
    uint64_t *h = &rec[W_BATCH];
    H(*h, c->struct_size);
    H(*h, c->max_batch);
    H(*h, c->micro_batch);
    H(*h, c->max_seq);
    h = &rec[W_OPTIM];
    H(*h, c->optimizer);
    H(*h, c->momentum);
    H(*h, c->dampening);
    H(*h, c->nesterov);
    H(*h, c->weight_decay);
    H(*h, c->decay_1d);
    H(*h, c->beta1);
    H(*h, c->beta2);
    H(*h, c->eps);
    H(*h, c->min_8bit_size);
    const mt_adafactor_config *af = &c->adafactor;
    H(*h, af->eps1);
    H(*h, af->eps2);
    H(*h, af->clip_threshold);
    H(*h, af->decay_rate);
    H(*h, af->beta1);
    H(*h, af->scale_parameter);
    H(*h, af->relative_step);
    H(*h, af->warmup_init);
    H(*h, c->n_overrides);
    for (int i = 0; c->overrides && i < c->n_overrides; i++) {
        const mt_param_override *o = &c->overrides[i];
        if (o->pattern) *h = mti_hash(*h, o->pattern, strlen(o->pattern) + 1);
        H(*h, o->state_bits);
        H(*h, o->weight_decay);
        H(*h, o->lr_scale);
    }
    h = &rec[W_SCHEDULE];
    H(*h, c->lr);
    H(*h, c->lr_schedule);
    H(*h, c->warmup_steps);
    H(*h, c->total_steps);
    H(*h, c->min_lr_ratio);
    H(*h, c->local_sgd_every);
    h = &rec[W_PRECISION];
    H(*h, c->precision);
    H(*h, c->master_weights);
    const mt_loss_scale_config *ls = &c->loss_scale;
    H(*h, ls->dynamic);
    H(*h, ls->init_scale);
    H(*h, ls->growth_factor);
    H(*h, ls->backoff_factor);
    H(*h, ls->growth_interval);
    rec[W_CLIP] = mti_hash(MTI_HASH_START, &c->grad_clip, sizeof c->grad_clip);
    h = &rec[W_RECOMPUTE];
    H(*h, c->recompute);
    H(*h, c->recompute_every);
    if (c->recompute == MT_RECOMPUTE_CUSTOM && c->recompute_units)
        *h = mti_hash(*h, c->recompute_units, (size_t)m->n_units);
    H(*h, c->memory_budget);
    rec[W_FUSED] = mti_hash(MTI_HASH_START, &c->fused_step, sizeof c->fused_step);
    h = &rec[W_FREEZE];
    H(*h, c->n_freeze);
    for (int i = 0; c->freeze && i < c->n_freeze; i++)
        if (c->freeze[i]) *h = mti_hash(*h, c->freeze[i], strlen(c->freeze[i]) + 1);
    H(*h, c->lora.rank);
    H(*h, c->lora.alpha);
    H(*h, c->lora.seed);
    if (c->lora.targets) *h = mti_hash(*h, c->lora.targets, strlen(c->lora.targets) + 1);
    h = &rec[W_ZERO];
    H(*h, c->zero_stage);
    H(*h, c->zero3_prefetch);
    H(*h, c->zero3_keep);
    /* where the state lives decides when a step's collectives are made (the
       offloaded fused step reduces in its hooks): the same on every rank;
       the directory is each rank's own */
    h = &rec[W_OFFLOAD];
    H(*h, c->offload);
    H(*h, c->offload_params);
}

mt_status mti_dp_agree_config(mt_context *ctx, const mt_model *m, const mt_trainer_config *cfg)
{
    if (mt_comm_size(ctx->cfg.comm) < 2) return MT_OK;
    uint64_t rec[W_N];
    config_record(m, cfg, rec);
    return mti_comm_agree(ctx, "mt_trainer_create", "trainer", rec, sizeof rec, group_names);
}

/* A hash of the weights as stored: the fp32 masters where every rank
 * holds them whole, else the weights (fp32, or the 16-bit copy every rank
 * holds whole also when ZeRO shards the masters), read to the host a chunk
 * at a time: nothing is allocated on the device, so a dry run's accounting
 * (which never gets here) is the real run's. */
static mt_status weights_hash(const mt_model *m, uint64_t *out)
{
    mt_context *ctx = m->ctx;
    uint64_t h = MTI_HASH_START;
    const size_t chunk = (size_t)1 << 22;
    unsigned char *buf = malloc(chunk);
    mt_status s = buf ? MT_OK : mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    for (int i = 0; i < m->n_param && !s; i++) {
        const mti_param *p = &m->params[i];
        if (m->params_sharded && !p->frozen) continue; /* (ZeRO-3 hashed them before: zero3.c) */
        const mti_tensor *w = p->master.blk.ptr && !m->master_sliced ? &p->master : &p->w;
        s = mti_tensor_hash(ctx, w, buf, chunk, &h);
    }
    free(buf);
    *out = h;
    return s;
}

mt_status mti_tensor_hash(mt_context *ctx, const mti_tensor *w, void *buf, size_t chunk,
                          uint64_t *h)
{
    const size_t bytes = mti_tensor_bytes(w);
    mt_status s = MT_OK;
    for (size_t at = 0; at < bytes && !s; at += chunk) {
        const size_t n = bytes - at < chunk ? bytes - at : chunk;
        s = ctx->dev->copy_d2h(ctx->dev, buf, (const char *)w->blk.ptr + at, n);
        if (!s) s = ctx->dev->sync(ctx->dev);
        if (!s) *h = mti_hash(*h, buf, n);
    }
    return s;
}

/* One all-gather of (status, value) per rank. Returns own_s when this rank
 * failed (its message stands), MT_ERR_COMM naming the first rank that
 * failed when another did, else MT_OK with *sum the values added in rank
 * order. A failure the communication thread held (overlap.c) is this
 * rank's, sent here so that every rank stops at once. */
static mt_status exchange_passes(mt_trainer *t, const char *fn, const char *what, mt_status own_s,
                                 double value, double *sum, int passes);

static mt_status exchange(mt_trainer *t, const char *fn, const char *what, mt_status own_s,
                          double value, double *sum)
{
    return exchange_passes(t, fn, what, own_s, value, sum, -1);
}

/* The same, with this rank's passes over its rows (>= 0: every rank must
 * make as many, at the stages whose collectives run in every pass; a
 * difference is MT_ERR_INVALID_ARG on every rank, before anything runs). */
static mt_status exchange_passes(mt_trainer *t, const char *fn, const char *what, mt_status own_s,
                                 double value, double *sum, int passes)
{
    mt_context *ctx = t->ctx;
    mt_comm *c = ctx->cfg.comm;
    const int n = mt_comm_size(c);
    char own_msg[MTI_ERR_LEN];
    snprintf(own_msg, sizeof own_msg, "%s", own_s ? mt_last_error(ctx) : "");
    const mt_status held = mti_overlaps_take(ctx);
    if (held && !own_s) {
        own_s = held;
        snprintf(own_msg, sizeof own_msg, "%s", mt_last_error(ctx));
    }
    unsigned char rec[24];
    mti_put_u64(rec, (uint64_t)own_s);
    memcpy(rec + 8, &value, 8);
    mti_put_u64(rec + 16, (uint64_t)(int64_t)passes);
    unsigned char *all = malloc((size_t)n * sizeof rec);
    if (!all)
        return own_s ? mti_fail(ctx, own_s, "%s", own_msg)
                     : mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    char why[128];
    snprintf(why, sizeof why, "%s: exchanging %s", fn, what);
    mt_status s = mti_comm_host_gather(ctx, why, rec, all, sizeof rec);
    if (s) {
        free(all);
        if (own_s) return mti_fail(ctx, own_s, "%s", own_msg);
        return s;
    }
    double acc = 0.0;
    for (int r = 0; r < n && !s; r++) {
        mt_status rs = (mt_status)mti_get_u64(all + (size_t)r * sizeof rec);
        double v;
        memcpy(&v, all + (size_t)r * sizeof rec + 8, 8);
        acc += v;
        if (rs && own_s) s = mti_fail(ctx, own_s, "%s", own_msg);
        else if (rs)
            s = mti_fail(ctx, MT_ERR_COMM, "%s: rank %d failed (%s) at %s, so every rank stops", fn,
                         r, mt_status_string(rs), what);
    }
    for (int r = 1; r < n && !s && passes >= 0; r++) {
        const int64_t p0 = (int64_t)mti_get_u64(all + 16);
        const int64_t pr = (int64_t)mti_get_u64(all + (size_t)r * sizeof rec + 16);
        if (pr != p0)
            s = mti_fail(ctx, MT_ERR_INVALID_ARG,
                         "%s: at ZeRO stage %d the ranks communicate in every micro-batch, so each "
                         "must make as many: rank %d makes %lld micro-batches of at most %d rows, "
                         "rank 0 %lld; give the ranks equal rows, or a micro_batch that cuts them "
                         "into as many (0: one pass)",
                         fn, t->zero, r, (long long)pr, t->micro, (long long)p0);
    }
    free(all);
    if (!s && sum) *sum = acc;
    return s;
}

mt_status mti_dp_created(mt_trainer *t, mt_status s)
{
    if (!mti_dp_on(t)) return s;
    const char *fn = "mt_trainer_create";
    uint64_t h = 0;
    if (!s) s = weights_hash(t->model, &h);
    double ignored;
    mt_status e = exchange(t, fn, "the trainer's creation", s, 0.0, &ignored);
    if (e) return e;
    uint64_t rec[1] = {h};
    static const char *const names[] = {"weights (make every rank's model from the same seed or "
                                        "file)"};
    return mti_comm_agree(t->ctx, fn, "weights", rec, sizeof rec, names);
}

/* With local SGD (local_sgd.c) the ranks still fail a step together, but
 * each keeps its own targets, loss sum and gradients. */
mt_status mti_dp_begin(mt_trainer *t, const char *fn, mt_status s, double *targets, int passes)
{
    if (!mti_dp_on(t)) return s;
    double all;
    s = exchange_passes(t, fn, "the batch's checks", s, *targets, &all,
                        t->zero >= 2 && !mti_local_sgd(t) ? passes : -1);
    if (!s && !mti_local_sgd(t)) *targets = all;
    return s;
}

mt_status mti_dp_end(mt_trainer *t, const char *fn, mt_status s, double *loss_sum)
{
    if (!mti_dp_on(t)) return s;
    double all;
    s = exchange(t, fn, "forward and backward", s, *loss_sum, &all);
    if (!s && !mti_local_sgd(t)) *loss_sum = all;
    return s;
}

mt_status mti_dp_agree_forward(mt_trainer *t, const char *fn, mt_status s, int passes)
{
    if (!mti_dp_on(t) || t->zero != 3) return s;
    return exchange_passes(t, fn, "the batch's checks", s, 0.0, NULL, passes);
}

mt_status mti_dp_agree_status(mt_trainer *t, const char *fn, const char *what, mt_status s)
{
    if (!mti_dp_on(t)) return s;
    return exchange(t, fn, what, s, 0.0, NULL);
}

mt_status mti_dp_reduce(mt_trainer *t, int i, float *g, size_t n)
{
    if (!mti_dp_on(t) || mti_local_sgd(t)) return MT_OK;
    char what[96];
    snprintf(what, sizeof what, "the all-reduce of the gradients of %s", t->model->params[i].name);
    return mti_comm_all_reduce(t->ctx, what, g, g, n, MT_COMM_F32, MT_COMM_SUM);
}

mt_status mti_dp_reduce_grad(mt_trainer *t, int i)
{
    if (!mti_dp_on(t) || mti_local_sgd(t)) return MT_OK;
    mti_tensor *g;
    mt_status s = mti_engine_grad(&t->E, i, &g); /* one the batch did not reach: zeros */
    return s ? s : mti_dp_reduce(t, i, g->blk.ptr, t->model->params[i].numel);
}
