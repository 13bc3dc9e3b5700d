/*
 * tp.c - tensor parallel: the groups, the model split into this rank's
 * parts, the step's checks over a group, and the parts gathered back
 * (tp.h).
 */
#include <stdlib.h>
#include <string.h>

#include "train/tp.h"
#include "train/home.h"
#include "comm/comm.h"

#define BAD(...) return mti_fail(ctx, MT_ERR_INVALID_ARG, __VA_ARGS__)
#define NO(...) return mti_fail(ctx, MT_ERR_UNSUPPORTED, __VA_ARGS__)

/* The layer owning parameter i (its *j-th), or NULL (an adapter's): the
 * layers' parameters follow one another, so a binary search. */
static const mti_layer *owner(const mt_model *m, int i, int *j)
{
    int lo = 0, hi = m->n_layers - 1;
    while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        const mti_layer *ly = &m->layers[mid];
        if (i < ly->p0) hi = mid - 1;
        else if (i >= ly->p0 + ly->np) lo = mid + 1;
        else return *j = i - ly->p0, ly;
    }
    return NULL;
}

/* How parameter i of a GPT model is split: a block's qkv (by heads), fc
 * (by columns of its output) and their biases, attproj and fcproj (by
 * columns of their input), and the token table (by vocabulary rows, the
 * tied LM head with it). */
static mti_tp_split split_of(const mt_model *m, int i)
{
    if (m->pp && i == m->pp->tied) return MTI_TP_ROWS; /* (the last stage's copy of the table) */
    int j;
    const mti_layer *ly = owner(m, i, &j);
    if (ly && ly->kind == MT_LAYER_EMBEDDING) return j == 0 ? MTI_TP_ROWS : MTI_TP_WHOLE;
    if (!ly || ly->kind != MT_LAYER_BLOCK) return MTI_TP_WHOLE;
    switch (j) {
    case 2:
    case 3: return MTI_TP_QKV;
    case 4:
    case 10: return MTI_TP_COLS;
    case 8:
    case 9: return MTI_TP_ROWS;
    default: return MTI_TP_WHOLE;
    }
}

mt_status mti_tp_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *c)
{
    const char *fn = "mt_trainer_create";
    const int T = c->tensor_parallel;
    if (T < 0 || T > 65536) BAD("%s: cfg->tensor_parallel %d out of range 0..65536", fn, T);
    if (c->sequence_parallel != 0 && c->sequence_parallel != 1)
        BAD("%s: cfg->sequence_parallel %d must be 0 or 1", fn, c->sequence_parallel);
    if (c->sequence_parallel && T <= 1)
        BAD("%s: cfg->sequence_parallel needs cfg->tensor_parallel > 1 (it splits the rows "
            "between a tensor group's ranks)", fn);
    if (T <= 1) return MT_OK;
    int W;
    (void)mti_comm_world(ctx, &W, NULL);
    if (W != ctx->world)
        NO("%s: the context's ranks are split into tensor groups by another trainer; destroy "
           "it first", fn);
    if (W % T)
        BAD("%s: cfg->tensor_parallel %d does not divide the world of %d ranks (the ranks form "
            "data-parallel groups of tensor groups: N = dp x tp)",
            fn, T, W);
    if (m->kind != MTI_MODEL_GPT)
        NO("%s: cfg->tensor_parallel splits a GPT model's blocks, token table and LM head; "
           "this model is not a GPT model", fn);
    if (m->gpt.heads % T)
        BAD("%s: cfg->tensor_parallel %d does not divide the model's %d heads (each rank "
            "takes whole heads)", fn, T, m->gpt.heads);
    if (m->padded_vocab < T)
        BAD("%s: cfg->tensor_parallel %d is more than the %d rows of the token table", fn, T,
            m->padded_vocab);
    bool quantized = c->base != MT_BASE_FULL;
    for (int i = 0; i < m->n_param; i++) quantized |= m->params[i].qf != 0;
    const char *why = m->gpt.stable_embedding        ? "a StableEmbedding"
                      : c->lora.rank || m->lora_rank ? "LoRA adapters"
                      : quantized                    ? "a quantized base"
                      : c->teacher                   ? "distillation (cfg->teacher)"
                      : c->optimizer == MT_OPT_ADAFACTOR
                          ? "Adafactor (its factored statistics span the whole tensor)"
                      : c->offload == MT_PLACE_HOST  ? "host offload (cfg->offload)"
                      : c->local_sgd_every           ? "local SGD (cfg->local_sgd_every)"
                                                     : NULL;
    if (why)
        NO("%s: cfg->tensor_parallel %d does not combine with %s yet (docs/distributed.md, "
           "\"Tensor parallel\")", fn, T, why);
    return MT_OK;
}

/* ---- the split ---- */

typedef struct copy_run {
    mti_device *dev;
    char *dst;
    const char *src;
    size_t es;
} copy_run;

static mt_status copy_one(void *user, size_t whole_at, size_t len, size_t off)
{
    const copy_run *c = user;
    return c->dev->copy_d2d(c->dev, c->dst + off * c->es, c->src + whole_at * c->es, len * c->es);
}

/* Parameter i's part made beside its whole (stashed in t->tp_whole). */
static mt_status split_param(mt_trainer *t, int i, mti_tp_split split)
{
    mt_context *ctx = t->ctx;
    mt_model *m = t->model;
    mti_param *p = &m->params[i];
    const int T = t->tp.size, q = t->tp.rank;
    const int64_t rows = p->shape[0], cols = p->ndim == 2 ? p->shape[1] : 1;
    int64_t pr, pc;
    mti_tp_part_shape(split, rows, cols, T, q, &pr, &pc);
    mti_tensor part = p->w;
    memset(&part.blk, 0, sizeof part.blk);
    part.shape[0] = pr;
    if (p->ndim == 2) part.shape[1] = pc;
    p->whole_shape[0] = rows;
    p->whole_shape[1] = cols;
    p->whole_numel = p->numel;
    p->tp_split = (unsigned char)split; /* (mti_tp_each_run reads the whole's shape) */
    mt_status s = MT_OK;
    if (!p->unmade) {
        s = mti_tensor_alloc(ctx, &part, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                             MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
        copy_run c = {ctx->dev, part.blk.ptr, p->w.blk.ptr, mti_dtype_size(p->w.dtype)};
        if (!s && !ctx->dry) s = mti_tp_each_run(p, T, q, 0, (size_t)(pr * pc), copy_one, &c);
        if (!s && !ctx->dry) s = ctx->dev->sync(ctx->dev);
        if (s) {
            mti_tensor_free(ctx, &part);
            p->tp_split = 0;
            return mti_fail(ctx, s, "tensor parallel: %s's part: %s", p->name, mti_last_msg(ctx).s);
        }
    }
    t->tp_whole[i] = p->w;
    p->w = part;
    p->shape[0] = pr;
    if (p->ndim == 2) p->shape[1] = pc;
    p->numel = (size_t)(pr * pc);
    return MT_OK;
}

/* Parameter i's whole shape again (its part's memory is the caller's). */
static void unsplit_shape(mti_param *p)
{
    p->shape[0] = p->whole_shape[0];
    if (p->ndim == 2) p->shape[1] = p->whole_shape[1];
    p->numel = p->whole_numel;
    p->w.shape[0] = p->shape[0];
    if (p->ndim == 2) p->w.shape[1] = p->shape[1];
    p->tp_split = 0;
}

/* Status s agreed over communicator c of n ranks (`over` names them),
 * this one `me`: a rank's failure fails every rank, naming it; fn and
 * `about` name the exchange. */
mt_status mti_group_agree(mt_trainer *t, mt_comm *c, int n, int me, const char *fn,
                          const char *about, const char *over, mt_status s)
{
    mt_context *ctx = t->ctx;
    char own[MTI_ERR_LEN], what[192];
    snprintf(own, sizeof own, "%s", s ? mt_last_error(ctx) : "");
    float *v = calloc((size_t)n, sizeof *v);
    if (!v) return s ? s : mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    v[me] = (float)s;
    snprintf(what, sizeof what, "%s: exchanging %s over %s", fn, about, over);
    mt_status e = mti_comm_group_host_all_reduce(ctx, c, what, v, (size_t)n, MT_COMM_SUM);
    int bad = -1;
    for (int k = 0; k < n && !e; k++)
        if (v[k] != 0.0f && k != me && bad < 0) bad = k;
    const mt_status other = bad >= 0 ? (mt_status)v[bad] : MT_OK;
    free(v);
    if (s) return mti_fail(ctx, s, "%s", own);
    if (e) return e;
    if (bad >= 0)
        return mti_fail(ctx, MT_ERR_COMM, "%s: rank %d of %s failed (%s) at %s, so every rank stops",
                        fn, bad, over, mt_status_string(other), about);
    return MT_OK;
}

mt_status mti_tp_begin(mt_trainer *t, mt_status s)
{
    const int T = t->cfg.tensor_parallel;
    if (T <= 1) return s;
    mt_context *ctx = t->ctx;
    mt_model *m = t->model;
    const int W = ctx->world, r = ctx->rank, q = r % T, g = r / T;
    /* (pipeline parallel: the grid's stage and data-parallel rank) */
    const int P = t->pp.size > 1 ? t->pp.size : 1, st = g % P, d = g / P;
    /* every rank gets here, failed or not, and they agree before the
       groups (collectives of the world) are made (pipeline parallel's
       start has) */
    if (!ctx->dry && W > 1 && P == 1)
        s = mti_group_agree(t, ctx->cfg.comm, W, r, "mt_trainer_create", "the trainer's creation",
                     "the ranks", s);
    if (s) return s;
    const int PV = m->padded_vocab;
    t->tp = (mti_tp){.size = T, .rank = q, .sp = t->cfg.sequence_parallel};
    /* (from here on every rank makes the same calls, failing or not) */
    t->tp.v0 = (int)((int64_t)PV * q / T);
    t->tp.v1 = (int)((int64_t)PV * (q + 1) / T);
    const int real = m->classes - t->tp.v0;
    t->tp.classes = real < 0 ? 0 : real > t->tp.v1 - t->tp.v0 ? t->tp.v1 - t->tp.v0 : real;
    if (!ctx->dry && W > 1) { /* the groups: neighbours in a tensor group */
        mt_comm *c = ctx->cfg.comm;
        if (T == W) {
            t->tp_comm = c;
        } else {
            t->tp_own = 1;
            s = mt_comm_split(c, g, q, &t->tp_comm);
            if (!s) s = mt_comm_split(c, st * T + q, d, &t->dp_comm);
            if (s)
                return mti_fail(ctx, s, "mt_trainer_create: making the tensor and data-parallel "
                                "groups: %s", mt_last_error(NULL));
        }
    }
    t->tp.comm = t->tp_comm;
    if (!(t->tp_whole = calloc((size_t)m->n_param, sizeof *t->tp_whole)))
        return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    m->tp = &t->tp;
    for (int i = 0; i < m->n_param && !s; i++) {
        const mti_tp_split split = split_of(m, i);
        if (split != MTI_TP_WHOLE) s = split_param(t, i, split);
    }
    mti_comm_narrow(ctx, t->dp_comm, W / (T * P), d);
    return s;
}

mt_status mti_tp_agree_status(mt_trainer *t, const char *fn, const char *what, mt_status s)
{
    if (t->tp.size < 2 || !t->tp_comm || t->ctx->dry) return s;
    return mti_group_agree(t, t->tp_comm, t->tp.size, t->tp.rank, fn, what, "the tensor group", s);
}

mt_status mti_group_agree_file(mt_trainer *t, mt_comm *c, int n, int me, const char *over,
                               const char *fn, uint64_t digest, mt_status s)
{
    if (n < 2 || !c || t->ctx->dry) return s;
    s = mti_group_agree(t, c, n, me, fn, "checking the training-state file", over, s);
    if (s) return s;
    /* the digest in four 16-bit pieces (exact in fp32), and their negatives:
       the group's maxima of both are its greatest and least pieces */
    float v[8];
    for (int k = 0; k < 4; k++) {
        v[k] = (float)((digest >> (16 * k)) & 0xffff);
        v[4 + k] = -v[k];
    }
    char what[96];
    snprintf(what, sizeof what, "mt_trainer_load: exchanging the file's digest over %s", over);
    s = mti_comm_group_host_all_reduce(t->ctx, c, what, v, 8, MT_COMM_MAX);
    for (int k = 0; k < 4 && !s; k++)
        if (v[k] != -v[4 + k])
            s = mti_fail(t->ctx, MT_ERR_COMM,
                         "%s: the ranks of %s loaded different training-state files (every "
                         "rank of a group loads the same file)", fn, over);
    return s;
}

mt_status mti_tp_agree_file(mt_trainer *t, const char *fn, uint64_t digest, mt_status s)
{
    return mti_group_agree_file(t, t->tp_comm, t->tp.size, t->tp.rank, "the tensor group", fn,
                                digest, s);
}

mt_status mti_tp_files_ok(const mt_trainer *t, const char *fn)
{
    mt_context *ctx = t->ctx;
    if (t->zero)
        NO("%s: training-state files of tensor parallel with ZeRO in the data-parallel groups "
           "are not built yet", fn);
    for (int i = 0; i < t->model->n_param; i++) {
        const mti_param *p = &t->model->params[i];
        for (int j = 0; p->tp_split && j < MTI_OPT_SLOTS; j++) {
            const mti_opt_state *l = &t->ps[i].lay.s[j];
            if (l->numel && (l->per != 1 || l->numel != (int64_t)p->numel))
                NO("%s: %s's optimizer state is kept in blocks of this rank's part (%s): a "
                   "tensor-parallel training-state file holds element-by-element state alone "
                   "(SGD, AdamW, or 32-bit state for the split tensors)",
                   fn, p->name, t->opt->title);
        }
    }
    return MT_OK;
}

mt_status mti_tp_agree(mt_trainer *t, mt_status s)
{
    if (t->tp.size < 2 || !t->tp_comm || t->ctx->dry) return s;
    return mti_group_agree(t, t->tp_comm, t->tp.size, t->tp.rank, "mt_trainer_create",
                    "the trainer's creation", "the tensor group", s);
}

void mti_tp_commit(mt_trainer *t)
{
    if (!t->tp_whole) return;
    for (int i = 0; i < t->model->n_param; i++) mti_tensor_free(t->ctx, &t->tp_whole[i]);
    free(t->tp_whole);
    t->tp_whole = NULL;
    if (!mti_model_unmade(t->model)) mti_source_free(t->model); /* (kept until now: model.c) */
}

/* ---- gathering the parts ---- */

typedef mt_status (*run_sink)(void *user, size_t whole_at, const float *src, size_t len);

typedef struct sink_run {
    run_sink fn;
    void *user;
    const float *part;
} sink_run;

static mt_status sink_one(void *user, size_t whole_at, size_t len, size_t off)
{
    const sink_run *r = user;
    return r->fn(r->user, whole_at, r->part + off, len);
}

/* Every rank's part of split parameter i (fp32), each broadcast by its
 * owner through a buffer of context memory and handed to fn run by run. */
static mt_status gather(mt_trainer *t, int i, const float *local, run_sink fn, void *user)
{
    mt_context *ctx = t->ctx;
    const mti_param *p = &t->model->params[i];
    const int T = t->tp.size, me = t->tp.rank;
    const mti_tp_split split = (mti_tp_split)p->tp_split;
    size_t most = 0;
    for (int q = 0; q < T; q++) {
        int64_t pr, pc;
        mti_tp_part_shape(split, p->whole_shape[0], p->whole_shape[1], T, q, &pr, &pc);
        if ((size_t)(pr * pc) > most) most = (size_t)(pr * pc);
    }
    mti_tensor buf = {.dtype = MTI_F32, .ndim = 1, .shape = {(int64_t)most}};
    float *host = malloc(most * sizeof *host + 1);
    mt_status s = host ? mti_tensor_alloc(ctx, &buf, MT_MEM_WORK, MT_LIFE_PHASE,
                                          MTI_TAG_PARAM(MTI_TAG_TRAINER, 6))
                       : mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    char what[96];
    snprintf(what, sizeof what, "tensor parallel: gathering %s", p->name);
    for (int q = 0; q < T && !s; q++) {
        int64_t pr, pc;
        mti_tp_part_shape(split, p->whole_shape[0], p->whole_shape[1], T, q, &pr, &pc);
        const size_t n = (size_t)(pr * pc);
        if (q == me) s = ctx->dev->copy_d2d(ctx->dev, buf.blk.ptr, local, n * sizeof(float));
        if (!s && T > 1 && t->tp_comm)
            s = mti_comm_group_broadcast(ctx, t->tp_comm, what, buf.blk.ptr, n, MT_COMM_F32, q);
        if (!s) s = ctx->dev->copy_d2h(ctx->dev, host, buf.blk.ptr, n * sizeof(float));
        if (!s) s = ctx->dev->sync(ctx->dev);
        sink_run r = {fn, user, host};
        if (!s) s = mti_tp_each_run(p, T, q, 0, n, sink_one, &r);
    }
    mti_tensor_free(ctx, &buf);
    free(host);
    return s;
}

static mt_status to_host(void *user, size_t whole_at, const float *src, size_t len)
{
    memcpy((float *)user + whole_at, src, len * sizeof *src);
    return MT_OK;
}

mt_status mti_tp_gather_host(mt_trainer *t, int i, const float *local, float *whole)
{
    return gather(t, i, local, to_host, whole);
}

typedef struct to_dev {
    mti_device *dev;
    float *dst;
} to_dev;

static mt_status to_device(void *user, size_t whole_at, const float *src, size_t len)
{
    const to_dev *d = user;
    return d->dev->copy_h2d(d->dev, d->dst + whole_at, src, len * sizeof *src);
}

/* Split parameter i whole again: its part gathered into a whole tensor
 * (unmade: left unmade; dry: the whole made, nothing exchanged). */
static mt_status unsplit(mt_trainer *t, int i)
{
    mt_context *ctx = t->ctx;
    mti_param *p = &t->model->params[i];
    mti_tensor part = p->w;
    const unsigned char split = p->tp_split;
    unsplit_shape(p);
    if (p->unmade) {
        mti_tensor_free(ctx, &part);
        memset(&p->w.blk, 0, sizeof p->w.blk);
        return MT_OK;
    }
    mti_tensor whole = p->w; /* (the whole's shape) */
    memset(&whole.blk, 0, sizeof whole.blk);
    mt_status s = part.dtype == MTI_F32 ? MT_OK
                                        : mti_fail(ctx, MT_ERR_INTERNAL, "%s: not fp32", p->name);
    if (!s)
        s = mti_tensor_alloc(ctx, &whole, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                             MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
    if (!s && !ctx->dry) {
        p->tp_split = split; /* (gather reads the split) */
        to_dev d = {ctx->dev, whole.blk.ptr};
        s = gather(t, i, part.blk.ptr, to_device, &d);
        if (!s) s = ctx->dev->sync(ctx->dev);
        p->tp_split = 0;
    }
    if (s && whole.blk.ptr) { /* zeros, said in the log */
        (void)mti_tensor_zero(ctx, &whole);
        mti_log(ctx, MT_LOG_ERROR, "mt_trainer_destroy: %s could not be gathered from the "
                "tensor group's parts (%s); its weights are zeros", p->name, mti_last_msg(ctx).s);
    } else if (s) { /* no memory for the whole: the weights are lost, and reads say so */
        mti_log(ctx, MT_LOG_ERROR, "mt_trainer_destroy: %s could not be made whole (%s); its "
                "weights are lost", p->name, mti_last_msg(ctx).s);
        p->unmade = 1;
    }
    mti_tensor_free(ctx, &part);
    p->w = whole;
    return s;
}

void mti_tp_end(mt_trainer *t)
{
    if (t->tp.size < 2) return;
    mt_context *ctx = t->ctx;
    mt_model *m = t->model;
    for (int i = 0; i < m->n_param; i++) {
        mti_param *p = &m->params[i];
        if (!p->tp_split) continue;
        if (t->tp_whole) { /* creation failed: the wholes back, nothing exchanged */
            mti_tensor_free(ctx, &p->w);
            p->w = t->tp_whole[i];
            unsplit_shape(p);
            /* (a deferred model's part was made from the source, which kept
               it: the whole is the source's again) */
            p->unmade = !p->w.blk.ptr;
            memset(&t->tp_whole[i], 0, sizeof t->tp_whole[i]);
        } else {
            (void)unsplit(t, i);
        }
    }
    free(t->tp_whole);
    t->tp_whole = NULL;
    m->tp = NULL;
    mti_comm_widen(ctx);
    if (t->tp_own) mt_comm_destroy(t->tp_comm);
    mt_comm_destroy(t->dp_comm);
    t->tp_comm = t->dp_comm = NULL;
    t->tp = (mti_tp){0};
}

/* ---- the step ---- */

/* Whether parameter i is a LayerNorm's (a block's ln1 and ln2, or a
 * LAYERNORM layer's): under sequence parallel each rank's gradient of it
 * is its rows' part. */
static bool rows_part(const mt_model *m, int i)
{
    int j;
    const mti_layer *ly = owner(m, i, &j);
    return ly && (ly->kind == MT_LAYER_LAYERNORM ||
                  (ly->kind == MT_LAYER_BLOCK && (j == 0 || j == 1 || j == 6 || j == 7)));
}

mt_status mti_tp_sum_grad(mt_trainer *t, int i, bool whole)
{
    if (!t->tp.sp || t->model->params[i].frozen || !rows_part(t->model, i)) return MT_OK;
    float *g;
    size_t at = 0, n = t->model->params[i].numel;
    if (whole) { /* (one the batch did not reach: zeros) */
        mti_tensor *gt;
        mt_status s = mti_engine_grad(&t->E, i, &gt);
        if (s) return s;
        g = gt->blk.ptr;
    } else { /* this rank's elements' (under ZeRO, of its slice) */
        g = mti_home_own(t, i, &at, &n);
    }
    if (!g || !n || !t->tp_comm || t->ctx->dry) return MT_OK;
    char what[96];
    snprintf(what, sizeof what, "sequence parallel: the sum of %s's gradient over the group",
             t->model->params[i].name);
    return mti_comm_group_all_reduce(t->ctx, t->tp_comm, what, g, g, n, MT_COMM_F32, MT_COMM_SUM);
}

mt_status mti_tp_checks(mt_trainer *t, const float *h, int n, int *found, double *sum)
{
    const mt_model *m = t->model;
    double parts = 0.0, whole = 0.0;
    for (int i = 0; i < n; i++) {
        if (m->params[i].tp_split) parts += h[i];
        else whole += h[i];
    }
    float v[2] = {(float)parts, (float)(*found != 0)};
    mt_status s = MT_OK;
    if (t->tp_comm && !t->ctx->dry)
        s = mti_comm_group_host_all_reduce(t->ctx, t->tp_comm,
                                           "tensor parallel: the gradients' checks over the group",
                                           v, 2, MT_COMM_SUM);
    *found = v[1] > 0.0f;
    *sum = (double)v[0] + whole;
    return s;
}
