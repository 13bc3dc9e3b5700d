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
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "train/dp.h"
#include "train/local_sgd.h"
#include "comm/queue.h"
#include "train/trainer.h"

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

/* The formats a model's quantized weights are in: "none", or the format
 * and how many tensors ("nf4, 8 tensors"), compared as a hash of each
 * parameter's format (a teacher's: it stays as it was loaded). */
static void quant_setting(mti_settings *l, const char *name, const mt_model *m)
{
    uint64_t h = MTI_HASH_START;
    int n = 0;
    mti_qformat qf = MTI_QF_NONE;
    for (int i = 0; i < m->n_param; i++) {
        H(h, m->params[i].qf);
        if (m->params[i].qf) n++, qf = m->params[i].qf;
    }
    char text[MTI_SHOWN] = "none";
    const char *f = mti_quant_name(qf);
    if (n) snprintf(text, sizeof text, "%s, %d tensor%s", f ? f : "?", n, n > 1 ? "s" : "");
    mti_set_named(l, name, (int64_t)h, text);
}

static const char *name_of(const char *const *names, int n, int v)
{
    return v >= 0 && v < n ? names[v] : NULL;
}

/* A field of mt_trainer_config compared as it is: its name (the field's,
 * "adafactor.eps1"), where it is, and its type: 'i' int, 'u' uint32_t,
 * 'U' uint64_t, 'f' float, 'd' double. */
typedef struct field {
    const char *name;
    size_t off;
    char type;
} field;
#define FIELD(type, f) {#f, offsetof(mt_trainer_config, f), type}
#define N_OF(a) ((int)(sizeof a / sizeof a[0]))

static void set_fields(mti_settings *l, const mt_trainer_config *c, const field *f, int n)
{
    for (int i = 0; i < n; i++) {
        const char *p = (const char *)c + f[i].off;
        int v;
        uint32_t u;
        uint64_t U;
        float x;
        double d;
        switch (f[i].type) {
        case 'i': memcpy(&v, p, sizeof v), mti_set_int(l, f[i].name, v); break;
        case 'u': memcpy(&u, p, sizeof u), mti_set_int(l, f[i].name, u); break;
        case 'U': memcpy(&U, p, sizeof U), mti_set_int(l, f[i].name, (int64_t)U); break;
        case 'f': memcpy(&x, p, sizeof x), mti_set_float(l, f[i].name, x); break;
        default: memcpy(&d, p, sizeof d), mti_set_double(l, f[i].name, d); break;
        }
    }
}

/* Compared always: every field a step reads whatever the other settings
 * (the optimizer's whichever optimizer reads them) */
static const field always[] = {
    FIELD('u', struct_size), FIELD('i', max_batch), FIELD('i', micro_batch), FIELD('i', max_seq),
    FIELD('f', lr), FIELD('f', momentum), FIELD('f', dampening), FIELD('i', nesterov),
    FIELD('f', weight_decay), FIELD('i', decay_1d), FIELD('f', beta1), FIELD('f', beta2),
    FIELD('f', eps), FIELD('i', min_8bit_size), FIELD('f', adafactor.eps1),
    FIELD('f', adafactor.eps2), FIELD('f', adafactor.clip_threshold),
    FIELD('f', adafactor.decay_rate), FIELD('f', adafactor.beta1),
    FIELD('i', adafactor.scale_parameter), FIELD('i', adafactor.relative_step),
    FIELD('i', adafactor.warmup_init), FIELD('i', n_overrides), FIELD('i', local_sgd_every),
    FIELD('f', grad_clip), FIELD('i', master_weights), FIELD('U', memory_budget),
    FIELD('i', fused_step), FIELD('i', lora.rank), FIELD('i', zero_stage),
    FIELD('i', offload_params), FIELD('i', tensor_parallel), FIELD('i', sequence_parallel), FIELD('i', pipeline_parallel),
};
/* and where they are read */
static const field cosine[] = {FIELD('i', warmup_steps), FIELD('i', total_steps),
                               FIELD('f', min_lr_ratio)};
static const field fp16[] = {FIELD('i', loss_scale.dynamic), FIELD('f', loss_scale.init_scale),
                             FIELD('d', loss_scale.growth_factor),
                             FIELD('d', loss_scale.backoff_factor),
                             FIELD('i', loss_scale.growth_interval)};
static const field segments[] = {FIELD('i', recompute_every)};
static const field lora[] = {FIELD('f', lora.alpha), FIELD('U', lora.seed)};
static const field stage3[] = {FIELD('i', zero3_prefetch), FIELD('i', zero3_keep)};
static const field distill[] = {FIELD('f', distill_alpha), FIELD('f', distill_temp)};

/* The settings every rank's trainer must give alike, field by field (never
 * the struct's bytes, whose padding may differ), each named as
 * mt_trainer_config names it. A field is compared only where the trainer
 * reads it (LoRA's alpha, seed and targets with lora.rank > 0, the loss
 * scaling in fp16, the schedule's steps with warmup and cosine, ...), so
 * a difference that changes nothing is no failure; docs/distributed.md
 * ("Agreement") lists them, and why the others need not agree. */
static void config_settings(const mt_model *m, const mt_trainer_config *c, mti_settings *l)
{
    static const char *const schedules[] = {"constant", "warmup_cosine"};
    static const char *const policies[] = {"none", "every_k", "sqrt", "selective", "custom",
                                           "budget"};
    _Static_assert(N_OF(schedules) == MT_LR_WARMUP_COSINE + 1 &&
                       N_OF(policies) == MT_RECOMPUTE_BUDGET + 1,
                   "a name per schedule and recompute policy");
    /* the model (its weights, quantized or not, are compared once the
       trainer has quantized its base: mti_dp_created) */
    mti_set_hash(l, "the model (layers and shapes)", model_hash(m));
    mti_set_hint(l, "make every rank's model alike");
    if (m->lora_rank) mti_set_float(l, "the model's LoRA alpha", m->lora_alpha);
    mti_set_named(l, "base", c->base, mt_base_format_name(c->base));
    mti_set_named(l, "optimizer", c->optimizer, mt_optimizer_name(c->optimizer));
    mti_set_named(l, "precision", c->precision, mti_precision_name(c->precision));
    mti_set_named(l, "lr_schedule", c->lr_schedule,
                  name_of(schedules, N_OF(schedules), c->lr_schedule));
    /* the recompute plan (at stage 3 a recomputed layer gathers again) */
    mti_set_named(l, "recompute", c->recompute, name_of(policies, N_OF(policies), c->recompute));
    /* where the state lives decides when a step's collectives are made (the
       offloaded fused step reduces in its hooks); the directory is each
       rank's own */
    mti_set_named(l, "offload", c->offload, mt_place_name(c->offload));
    /* a deferred model's weights are agreed on by their source where its
       homes take them from it (fill.c), a whole model's by their values */
    if (c->zero_stage == 3 || c->offload_params) {
        const int deferred = mti_model_unmade(m) > 0;
        mti_set_named(l, "the model's creation", deferred,
                      deferred ? "deferred (mt_*_spec.deferred)" : "at once");
    }
    set_fields(l, c, always, N_OF(always));
    if (c->lr_schedule == MT_LR_WARMUP_COSINE) set_fields(l, c, cosine, N_OF(cosine));
    if (c->precision == MT_PREC_FP16) set_fields(l, c, fp16, N_OF(fp16));
    if (c->recompute == MT_RECOMPUTE_EVERY_K || c->recompute == MT_RECOMPUTE_CUSTOM)
        set_fields(l, c, segments, N_OF(segments));
    if (c->recompute == MT_RECOMPUTE_CUSTOM)
        mti_set_hash(l, "recompute_units", c->recompute_units
                     ? mti_hash(MTI_HASH_START, c->recompute_units, (size_t)m->n_units) : 0);
    if (c->zero_stage == 3) set_fields(l, c, stage3, N_OF(stage3));
    /* the tables: patterns and overrides by their contents */
    uint64_t h = MTI_HASH_START;
    for (int i = 0; c->overrides && i < c->n_overrides; i++) {
        const mt_param_override *o = &c->overrides[i];
        if (o->pattern) h = mti_hash(h, o->pattern, strlen(o->pattern) + 1);
        H(h, o->state_bits);
        H(h, o->weight_decay);
        H(h, o->lr_scale);
    }
    if (c->n_overrides) mti_set_hash(l, "overrides", h);
    mti_set_texts(l, "freeze", c->freeze, c->freeze ? c->n_freeze : 0);
    if (c->lora.rank > 0) {
        set_fields(l, c, lora, N_OF(lora));
        const char *targets = c->lora.targets; /* ("" and NULL: every linear weight) */
        mti_set_text(l, "lora.targets", targets && *targets ? targets : NULL);
    }
    /* distillation: the teacher's weights are compared once the trainer is
       made (mti_dp_created) */
    mti_set_named(l, "teacher", c->teacher != NULL, c->teacher ? "a model" : "none");
    if (c->teacher) {
        mti_set_hash(l, "the teacher (layers and shapes)", model_hash(c->teacher));
        mti_set_hint(l, "load every rank's teacher from the same file");
        quant_setting(l, "the teacher's quantized base", c->teacher);
        set_fields(l, c, distill, N_OF(distill));
    }
}

mt_status mti_dp_agree_config(mt_context *ctx, const mt_model *m, const mt_trainer_config *cfg)
{
    if (mt_comm_size(ctx->cfg.comm) < 2) return MT_OK;
    mti_settings l = {.n = 0};
    config_settings(m, cfg, &l);
    return mti_comm_agree(ctx, "mt_trainer_create", "the trainer's settings", &l);
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
        if (p->unmade) continue; /* (a deferred model's: its source, below) */
        const mti_tensor *w = p->master.blk.ptr && !m->master_sliced ? &p->master : &p->w;
        s = mti_tensor_hash(ctx, w, buf, chunk, &h);
    }
    free(buf);
    if (!s) s = mti_source_mix(m, &h); /* (a deferred model's: what its source makes) */
    *out = h;
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
    const mt_status held = mti_queues_take(ctx);
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
    const mt_model *teacher = t->teaching ? t->cfg.teacher : NULL;
    uint64_t h = 0, th = 0;
    if (!s) s = weights_hash(t->model, &h);
    if (!s && teacher) s = weights_hash(teacher, &th);
    double ignored;
    mt_status e = exchange(t, fn, "the trainer's creation", s, 0.0, &ignored);
    if (e) return e;
    mti_settings l = {.n = 0};
    mti_set_hash(&l, "the weights", h);
    mti_set_hint(&l, "make every rank's model from the same seed or file");
    if (teacher) {
        mti_set_hash(&l, "the teacher's weights", th);
        mti_set_hint(&l, "load every rank's teacher from the same file");
    }
    return mti_comm_agree(t->ctx, fn, "the weights", &l);
}

mt_status mti_dp_agree_file(mt_trainer *t, const char *fn, uint64_t digest)
{
    if (!mti_dp_on(t)) return MT_OK;
    mti_settings l = {.n = 0};
    mti_set_hash(&l, "the training-state file's contents", digest);
    mti_set_hint(&l, "every rank loads the same file");
    return mti_comm_agree(t->ctx, fn, "the training-state file", &l);
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
