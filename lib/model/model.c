/*
 * model.c - models: layers and parameters from a spec, init, host copies of
 * the parameters, and the MLP and GPT constructors.
 *
 * Every model is built the same way: layers are added one by one, each
 * checking that it fits the width before it and creating its parameters
 * (fp32, class PARAM). GPT models are a sequence of EMBEDDING, BLOCKs,
 * LAYERNORM and LM_HEAD whose parameters are named, and ordered for
 * get/set_params, as in an llm.c model file (gpt.c reads and writes those).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops/kernels.h"
#include "model/model.h"
#include "train/offload.h"
#include "quant/quant.h"

#define MAX_DIM (1 << 24)

void mt_model_spec_init(mt_model_spec *s)
{
    if (!s) return;
    memset(s, 0, sizeof *s);
    s->struct_size = sizeof *s;
    s->input = MT_INPUT_FEATURES;
}

void mt_mlp_spec_init(mt_mlp_spec *s)
{
    if (!s) return;
    memset(s, 0, sizeof *s);
    s->struct_size = sizeof *s;
    s->activation = MT_ACT_RELU;
}

static const char *kind_name(mt_layer_kind k)
{
    switch (k) {
    case MT_LAYER_LINEAR: return "LINEAR";
    case MT_LAYER_RELU: return "RELU";
    case MT_LAYER_GELU: return "GELU";
    case MT_LAYER_LAYERNORM: return "LAYERNORM";
    case MT_LAYER_EMBEDDING: return "EMBEDDING";
    case MT_LAYER_BLOCK: return "BLOCK";
    case MT_LAYER_LM_HEAD: return "LM_HEAD";
    }
    return "?";
}

/* ---- building ---- */

typedef struct builder {
    mt_model *m;
    const char *fn;
    int cap_layers, cap_params;
    int width;          /* features per row after the layers so far */
    int n_blocks;       /* BLOCKs in the whole model (for GPT-2's init) */
    mt_init_kind init;
} builder;

static mt_status bad(builder *b, const char *fmt, const char *detail, int li)
{
    return mti_fail(b->m->ctx, MT_ERR_INVALID_ARG, "%s: layer %d: %s%s", b->fn, li, fmt, detail);
}

static mti_param *add_param(builder *b, const char *name, int ndim, int64_t rows, int64_t cols,
                            mti_init init, float a)
{
    mt_model *m = b->m;
    if (m->n_param == b->cap_params) {
        int cap = b->cap_params ? 2 * b->cap_params : 16;
        mti_param *np = realloc(m->params, (size_t)cap * sizeof *np);
        if (!np) return NULL;
        m->params = np;
        b->cap_params = cap;
    }
    mti_param *p = &m->params[m->n_param++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = ndim;
    p->shape[0] = rows;
    p->shape[1] = ndim == 2 ? cols : 0;
    p->numel = (size_t)rows * (size_t)(ndim == 2 ? cols : 1);
    p->uses = 1;
    p->lora = p->adapter_of = -1;
    p->init = init;
    p->init_a = a;
    p->init_rows = rows;
    p->w = (mti_tensor){.dtype = MTI_F32, .ndim = ndim, .shape = {rows, ndim == 2 ? cols : 0}};
    return p;
}

#define PARAM(nm, nd, r, c, in, a)                                                             \
    do {                                                                                       \
        char n_[MTI_NAME_LEN];                                                                 \
        snprintf(n_, sizeof n_, "%s%s", prefix, nm);                                           \
        if (!add_param(b, n_, nd, r, c, in, a)) return oom(b);                                 \
    } while (0)

static mt_status oom(builder *b)
{
    return mti_fail(b->m->ctx, MT_ERR_OOM, "%s: out of host memory", b->fn);
}

/* Adds one layer after what is there; prefix starts its parameters' names. */
static mt_status add_layer(builder *b, const mt_layer_spec *ls, const char *prefix)
{
    mt_model *m = b->m;
    int li = m->n_layers;
    if (m->n_layers == b->cap_layers) {
        int cap = b->cap_layers ? 2 * b->cap_layers : 8;
        mti_layer *nl = realloc(m->layers, (size_t)cap * sizeof *nl);
        if (!nl) return oom(b);
        m->layers = nl;
        b->cap_layers = cap;
    }
    mti_layer *L = &m->layers[m->n_layers++];
    memset(L, 0, sizeof *L);
    L->kind = ls->kind;
    L->in = b->width;
    L->out = b->width;
    L->p0 = m->n_param;
    L->tied = -1;
    bool tokens = m->input == MT_INPUT_TOKENS;
    bool gpt2 = b->init == MT_INIT_GPT2;
    if ((ls->kind == MT_LAYER_EMBEDDING) != (tokens && li == 0))
        return bad(b, ls->kind == MT_LAYER_EMBEDDING ? "EMBEDDING" : kind_name(ls->kind),
                   ls->kind == MT_LAYER_EMBEDDING
                       ? " must be the first layer, and only of a token model"
                       : " cannot be the first layer of a token model (EMBEDDING must)",
                   li);
    switch (ls->kind) {
    case MT_LAYER_LINEAR: {
        if (ls->units < 1 || ls->units > MAX_DIM) return bad(b, "units out of range 1..2^24", "", li);
        if ((int64_t)ls->units * L->in > INT32_MAX)
            return bad(b, "LINEAR has more than 2^31-1 weights", "", li);
        L->out = ls->units;
        L->bias = !ls->no_bias;
        float bound = 1.0f / sqrtf((float)L->in);
        PARAM("w", 2, L->out, L->in, gpt2 ? MTI_INIT_NORMAL : MTI_INIT_UNIFORM,
              gpt2 ? 0.02f : bound);
        m->params[m->n_param - 1].linear = 1;
        if (L->bias) PARAM("b", 1, L->out, 0, gpt2 ? MTI_INIT_ZERO : MTI_INIT_UNIFORM, bound);
        break;
    }
    case MT_LAYER_RELU:
    case MT_LAYER_GELU: break;
    case MT_LAYER_LAYERNORM:
        PARAM("w", 1, L->in, 0, MTI_INIT_ONE, 0);
        PARAM("b", 1, L->in, 0, MTI_INIT_ZERO, 0);
        break;
    case MT_LAYER_EMBEDDING: {
        if (ls->units < 1 || ls->units > MAX_DIM) return bad(b, "units out of range 1..2^24", "", li);
        if ((int64_t)ls->units * m->padded_vocab > INT32_MAX)
            return bad(b, "the token embedding has more than 2^31-1 weights", "", li);
        L->out = ls->units;
        L->positions = ls->positions != 0;
        L->stable = ls->stable != 0;
        if (L->stable) {
            float xb = sqrtf(6.0f / (float)(m->vocab + L->out));
            PARAM(prefix[0] ? "tok" : "wte", 2, m->padded_vocab, L->out, MTI_INIT_UNIFORM, xb);
        } else {
            PARAM(prefix[0] ? "tok" : "wte", 2, m->padded_vocab, L->out, MTI_INIT_NORMAL,
                  gpt2 ? 0.02f : 1.0f);
        }
        m->params[m->n_param - 1].init_rows = m->vocab;
        if (L->stable) m->params[m->n_param - 1].force32 = 1;
        if (L->positions)
            PARAM(prefix[0] ? "pos" : "wpe", 2, m->max_seq, L->out, MTI_INIT_NORMAL,
                  gpt2 ? 0.02f : 1.0f);
        if (L->stable) {
            PARAM(prefix[0] ? "ln.w" : "wte.ln.w", 1, L->out, 0, MTI_INIT_ONE, 0);
            PARAM(prefix[0] ? "ln.b" : "wte.ln.b", 1, L->out, 0, MTI_INIT_ZERO, 0);
        }
        break;
    }
    case MT_LAYER_BLOCK: {
        int C = L->in;
        if (!tokens) return bad(b, "BLOCK needs a token model (sequences)", "", li);
        if (ls->heads < 1 || C % ls->heads)
            return bad(b, "BLOCK heads must be >= 1 and divide the width", "", li);
        if ((int64_t)4 * C * C > INT32_MAX) return bad(b, "BLOCK is too wide", "", li);
        L->heads = ls->heads;
        float proj = 0.02f / sqrtf(2.0f * (float)(b->n_blocks > 0 ? b->n_blocks : 1));
        PARAM("ln1.w", 1, C, 0, MTI_INIT_ONE, 0);
        PARAM("ln1.b", 1, C, 0, MTI_INIT_ZERO, 0);
        PARAM("qkv.w", 2, 3 * C, C, MTI_INIT_NORMAL, 0.02f);
        PARAM("qkv.b", 1, 3 * C, 0, MTI_INIT_ZERO, 0);
        PARAM("attproj.w", 2, C, C, MTI_INIT_NORMAL, proj);
        PARAM("attproj.b", 1, C, 0, MTI_INIT_ZERO, 0);
        PARAM("ln2.w", 1, C, 0, MTI_INIT_ONE, 0);
        PARAM("ln2.b", 1, C, 0, MTI_INIT_ZERO, 0);
        PARAM("fc.w", 2, 4 * C, C, MTI_INIT_NORMAL, 0.02f);
        PARAM("fc.b", 1, 4 * C, 0, MTI_INIT_ZERO, 0);
        PARAM("fcproj.w", 2, C, 4 * C, MTI_INIT_NORMAL, proj);
        PARAM("fcproj.b", 1, C, 0, MTI_INIT_ZERO, 0);
        for (int j = 2; j <= 10; j += j == 4 ? 4 : 2) m->params[L->p0 + j].linear = 1;
        break;
    }
    case MT_LAYER_LM_HEAD: {
        if (!tokens) return bad(b, "LM_HEAD needs a token model", "", li);
        if (m->layers[0].out != L->in)
            return bad(b, "LM_HEAD's input width differs from the embedding's", "", li);
        L->tied = m->layers[0].p0; /* the token table */
        m->params[L->tied].uses++;
        L->out = m->padded_vocab;
        break;
    }
    default: return bad(b, "unknown layer kind", "", li);
    }
    L->np = m->n_param - L->p0;
    L->unit_start = li == 0 || ls->kind == MT_LAYER_LINEAR || ls->kind == MT_LAYER_BLOCK ||
                    ls->kind == MT_LAYER_EMBEDDING;
    if (L->unit_start && li > 0) m->n_units++;
    if (li == 0) m->n_units = 1;
    L->unit = m->n_units - 1;
    b->width = L->out;
    return MT_OK;
}

static void gpt_offsets(mt_model *m);

/* Parameter i allocated (PARAM) and its values read from the model's
 * source a chunk at a time through host (ch floats) onto the device; a
 * base's linear weight quantized (qf) once whole. On a device context a
 * weight quantized as it is made has its fp32 only on the host: read
 * whole into a host buffer, quantized there, and only the quantized bytes
 * allocated and uploaded. */
static mt_status quantize_from(mt_model *m, int i, mti_qformat qf, const float *x);

static mt_status make_param(mt_model *m, int i, mti_qformat qf, float *host, size_t ch)
{
    mt_context *ctx = m->ctx;
    mti_param *p = &m->params[i];
    if (qf && ctx->dev->kind != MT_DEVICE_CPU) {
        if (ctx->dry) return quantize_from(m, i, qf, NULL);
        float *x = malloc(p->numel * sizeof *x);
        mt_status s = x ? mti_source_read(m, i, 0, p->numel, x)
                        : mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory (its fp32 staging)",
                                   p->name);
        if (!s) s = quantize_from(m, i, qf, x);
        free(x);
        return s;
    }
    mt_status s = mti_tensor_alloc(ctx, &p->w, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                   MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
    for (size_t at = 0; at < p->numel && !s && !ctx->dry; at += ch) {
        size_t n = p->numel - at < ch ? p->numel - at : ch;
        s = mti_source_read(m, i, at, n, host);
        if (!s) s = ctx->dev->copy_h2d(ctx->dev, (float *)p->w.blk.ptr + at, host, n * sizeof *host);
    }
    if (!s && !ctx->dry) s = ctx->dev->sync(ctx->dev);
    if (!s && qf) s = mti_param_quantize(m, i, qf);
    if (s) mti_tensor_free(ctx, &p->w);
    return s;
}

/* The unmade parameters with which[i] set (which NULL: all), or parameter
 * `only` alone (>= 0), made from the source; the source goes once none is
 * left unmade. */
static mt_status make_where(mt_model *m, const unsigned char *which, int only)
{
    mt_context *ctx = m->ctx;
    enum { CH = 1 << 16 };
    if (!m->src) return MT_OK;
    const mti_qformat qf = m->kind == MTI_MODEL_GPT ? mti_qformat_of(m->gpt.base) : MTI_QF_NONE;
    float *host = malloc(CH * sizeof *host);
    mt_status s = host ? MT_OK : mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    int left = 0;
    for (int i = 0; i < m->n_param && !s; i++) {
        mti_param *p = &m->params[i];
        if (!p->unmade) continue;
        if ((which && !which[i]) || (only >= 0 && i != only)) {
            left++;
            continue;
        }
        s = make_param(m, i, qf && mti_param_quantizable(m, i) ? qf : MTI_QF_NONE, host, CH);
        if (!s) p->unmade = 0;
    }
    free(host);
    /* (every weight made: the file is closed; a tensor-parallel split keeps
       it until creation commits, lib/train/tp.c) */
    if (!s && !left && !m->tp) mti_source_free(m);
    return s;
}

mt_status mti_model_make(mt_model *m, const unsigned char *which) { return make_where(m, which, -1); }

/* The parameters' offsets in get/set_params order and the model's size. */
static void lay_out(mt_model *m)
{
    size_t off = 0;
    for (int i = 0; i < m->n_param; i++) {
        m->params[i].offset = off;
        off += m->params[i].numel;
    }
    m->n_params = off;
    if (m->kind == MTI_MODEL_GPT) gpt_offsets(m);
}

static void free_model(mt_model *m)
{
    if (!m) return;
    for (int i = 0; i < m->n_param; i++) {
        mti_tensor_free(m->ctx, &m->params[i].w);
        mti_tensor_free(m->ctx, &m->params[i].master);
        mti_param_sparse_free(m->ctx, &m->params[i]);
    }
    mti_source_free(m);
    free(m->params);
    free(m->layers);
    free(m->lora_targets);
    free(m);
}

/* The common end of every constructor: last-layer checks, the weights'
 * source (o: a seed, or a file of the model's fp32 values), and the parameters made from it now, or (o->deferred) when a
 * trainer places them or a call needs them (mti_model_make). */
static mt_status finish(builder *b, const mti_origin *o, mt_model **out)
{
    mt_model *m = b->m;
    mt_context *ctx = m->ctx;
    mti_layer *last = &m->layers[m->n_layers - 1];
    if (last->kind != MT_LAYER_LINEAR && last->kind != MT_LAYER_LM_HEAD) {
        mt_layer_kind k = last->kind;
        free_model(m);
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: the last layer must be LINEAR or LM_HEAD (it gives the logits), "
                        "not %s",
                        b->fn, kind_name(k));
    }
    m->out_width = last->out;
    m->classes = last->kind == MT_LAYER_LM_HEAD ? m->vocab : last->out;
    lay_out(m);
    mt_status s = o->path ? mti_source_file(m, o->path, o->first) : mti_source_seed(m, o->seed);
    if (!s && o->deferred && m->kind == MTI_MODEL_GPT && m->gpt.base)
        s = mti_fail(ctx, MT_ERR_UNSUPPORTED,
                     "a deferred model's base is not quantized as it is made (base %s): make it "
                     "at once (deferred 0)",
                     mt_base_format_name(m->gpt.base));
    for (int i = 0; i < m->n_param; i++) m->params[i].unmade = 1;
    if (!s && !o->deferred) s = mti_model_make(m, NULL);
    if (s) {
        mti_msg msg = mti_last_msg(ctx);
        free_model(m);
        return mti_fail(ctx, s, "%s: %s", b->fn, msg.s);
    }
    atomic_fetch_add(&ctx->n_children, 1);
    *out = m;
    return MT_OK;
}

static mt_status begin(mt_context *ctx, builder *b, const char *fn, mti_model_kind kind,
                       mt_input_kind input)
{
    memset(b, 0, sizeof *b);
    b->fn = fn;
    b->m = calloc(1, sizeof *b->m);
    if (!b->m) return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    b->m->ctx = ctx;
    b->m->kind = kind;
    b->m->input = input;
    return MT_OK;
}

static mt_status check_tokens(mt_context *ctx, const char *fn, int vocab, int *padded, int max_seq)
{
    if (vocab < 1 || vocab > MAX_DIM)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: vocab %d out of range 1..2^24", fn, vocab);
    if (*padded == 0) *padded = (vocab + 127) / 128 * 128;
    if (*padded < vocab || *padded > MAX_DIM)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: padded vocab %d out of range %d..2^24", fn,
                        *padded, vocab);
    if (max_seq < 1 || max_seq > MAX_DIM)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: max_seq %d out of range 1..2^24", fn,
                        max_seq);
    return MT_OK;
}

mt_status mt_model_create(mt_context *ctx, const mt_model_spec *spec, mt_model **out)
{
    const char *fn = "mt_model_create";
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: ctx is NULL", fn);
    if (!spec || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: %s is NULL", fn, spec ? "out" : "spec");
    if (spec->struct_size != sizeof *spec)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: spec->struct_size %u, expected %zu (call mt_model_spec_init first)",
                        fn, spec->struct_size, sizeof *spec);
    if (spec->input != MT_INPUT_FEATURES && spec->input != MT_INPUT_TOKENS)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: spec->input %d is not an input kind", fn,
                        (int)spec->input);
    if (spec->n_layers < 1 || spec->n_layers > MT_MAX_LAYERS || !spec->layers)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: spec->n_layers %d out of range 1..%d%s", fn,
                        spec->n_layers, MT_MAX_LAYERS, spec->layers ? "" : " or layers NULL");
    if (spec->init != MT_INIT_DEFAULT && spec->init != MT_INIT_GPT2)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: spec->init %d is not an init kind", fn,
                        (int)spec->init);
    int padded = spec->padded_vocab;
    if (spec->input == MT_INPUT_FEATURES) {
        if (spec->features < 1 || spec->features > MAX_DIM)
            return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: spec->features %d out of range 1..2^24",
                            fn, spec->features);
    } else {
        mt_status s = check_tokens(ctx, fn, spec->vocab, &padded, spec->max_seq);
        if (s) return s;
    }
    builder b;
    mt_status s = begin(ctx, &b, fn, MTI_MODEL_SEQ, spec->input);
    if (s) return s;
    mt_model *m = b.m;
    m->features = spec->features;
    m->vocab = spec->vocab;
    m->padded_vocab = padded;
    m->max_seq = spec->max_seq;
    b.width = spec->input == MT_INPUT_FEATURES ? spec->features : 0;
    b.init = spec->init;
    for (int i = 0; i < spec->n_layers; i++) b.n_blocks += spec->layers[i].kind == MT_LAYER_BLOCK;
    for (int i = 0; i < spec->n_layers && !s; i++) {
        char prefix[24];
        snprintf(prefix, sizeof prefix, "l%d.", i);
        s = add_layer(&b, &spec->layers[i], prefix);
    }
    if (s) {
        free_model(m);
        return s;
    }
    const mti_origin o = {.seed = spec->seed, .deferred = spec->deferred != 0};
    return finish(&b, &o, out);
}

static mt_status check_mlp(mt_context *ctx, const mt_mlp_spec *s)
{
    const char *fn = "mt_model_mlp_create";
    if (s->struct_size != sizeof *s)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: spec->struct_size %u, expected %zu (call mt_mlp_spec_init first)", fn,
                        s->struct_size, sizeof *s);
    if (s->n_layers < 1 || s->n_layers > MT_MLP_MAX_LAYERS)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: spec->n_layers %d out of range 1..%d", fn,
                        s->n_layers, MT_MLP_MAX_LAYERS);
    for (int i = 0; i <= s->n_layers; i++)
        if (s->dims[i] < 1 || s->dims[i] > MAX_DIM)
            return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: spec->dims[%d] = %d out of range 1..%d",
                            fn, i, s->dims[i], MAX_DIM);
    for (int i = 0; i < s->n_layers; i++)
        if ((int64_t)s->dims[i] * s->dims[i + 1] > INT32_MAX)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s: layer %d has %lld weights, more than 2^31-1", fn, i,
                            (long long)s->dims[i] * s->dims[i + 1]);
    if (s->activation != MT_ACT_RELU && s->activation != MT_ACT_GELU)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: spec->activation %d is not MT_ACT_RELU or MT_ACT_GELU", fn,
                        (int)s->activation);
    return MT_OK;
}

mt_status mt_model_mlp_create(mt_context *ctx, const mt_mlp_spec *spec, mt_model **out)
{
    const char *fn = "mt_model_mlp_create";
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: ctx is NULL", fn);
    if (!spec || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: %s is NULL", fn, spec ? "out" : "spec");
    mt_status s = check_mlp(ctx, spec);
    if (s) return s;
    builder b;
    if ((s = begin(ctx, &b, fn, MTI_MODEL_MLP, MT_INPUT_FEATURES))) return s;
    b.m->mlp = *spec;
    b.m->features = spec->dims[0];
    b.width = spec->dims[0];
    for (int l = 0; l < spec->n_layers && !s; l++) {
        char prefix[24];
        snprintf(prefix, sizeof prefix, "fc%d.", l);
        mt_layer_spec lin = {.kind = MT_LAYER_LINEAR, .units = spec->dims[l + 1]};
        s = add_layer(&b, &lin, prefix);
        if (!s && l < spec->n_layers - 1) {
            mt_layer_spec act = {.kind = spec->activation == MT_ACT_RELU ? MT_LAYER_RELU
                                                                           : MT_LAYER_GELU};
            s = add_layer(&b, &act, prefix);
        }
    }
    if (s) {
        free_model(b.m);
        return s;
    }
    const mti_origin o = {.seed = spec->seed, .deferred = spec->deferred != 0};
    return finish(&b, &o, out);
}

void mt_gpt_spec_init(mt_gpt_spec *s)
{
    if (!s) return;
    memset(s, 0, sizeof *s);
    s->struct_size = sizeof *s;
    s->vocab = 50257;
    s->max_seq = 1024;
    s->layers = 12;
    s->heads = 12;
    s->channels = 768;
}

/* GPT parameter order in an llm.c model file: the per-block tensors come
 * grouped by kind, each stacked over the blocks. Block tensor j of block l
 * (of L) has index 2 (+2 stable) + 12 l + j in params. */
static void gpt_offsets(mt_model *m)
{
    const int L = m->gpt.layers;
    const int b0 = m->layers[0].np; /* wte, wpe (, stable ln w, b) */
    size_t off = m->params[0].numel + m->params[1].numel;
    m->params[0].offset = 0;
    m->params[1].offset = m->params[0].numel;
    for (int j = 0; j < 12; j++)
        for (int l = 0; l < L; l++) {
            mti_param *p = &m->params[b0 + 12 * l + j];
            p->offset = off;
            off += p->numel;
        }
    for (int i = b0 + 12 * L; i < m->n_param; i++) { /* lnf w, b */
        m->params[i].offset = off;
        off += m->params[i].numel;
    }
    for (int i = 2; i < b0; i++) { /* a StableEmbedding's LayerNorm: not in llm.c's files */
        m->params[i].offset = off;
        off += m->params[i].numel;
    }
}

mt_status mti_gpt_build(mt_context *ctx, const mt_gpt_spec *spec, const char *fn,
                        const mti_origin *o, mt_model **out)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: ctx is NULL", fn);
    if (!spec || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: %s is NULL", fn, spec ? "out" : "spec");
    if (spec->struct_size != sizeof *spec)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: spec->struct_size %u, expected %zu (call mt_gpt_spec_init first)", fn,
                        spec->struct_size, sizeof *spec);
    int padded = spec->padded_vocab;
    mt_status s = check_tokens(ctx, fn, spec->vocab, &padded, spec->max_seq);
    if (s) return s;
    if (!mt_base_format_name(spec->base))
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: spec->base %d is not a base format (MT_BASE_FULL, MT_BASE_INT8, "
                        "MT_BASE_NF4)",
                        fn, (int)spec->base);
    if (spec->layers < 1 || spec->layers > MT_MAX_LAYERS - 3)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: spec->layers %d out of range 1..%d", fn,
                        spec->layers, MT_MAX_LAYERS - 3);
    if (spec->channels < 1 || spec->heads < 1 || spec->channels % spec->heads)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: spec->channels %d must be a positive multiple of spec->heads %d", fn,
                        spec->channels, spec->heads);
    builder b;
    if ((s = begin(ctx, &b, fn, MTI_MODEL_GPT, MT_INPUT_TOKENS))) return s;
    mt_model *m = b.m;
    m->gpt = *spec;
    m->gpt.padded_vocab = padded;
    m->vocab = spec->vocab;
    m->padded_vocab = padded;
    m->max_seq = spec->max_seq;
    b.init = MT_INIT_GPT2;
    b.n_blocks = spec->layers;
    mt_layer_spec emb = {.kind = MT_LAYER_EMBEDDING,
                         .units = spec->channels,
                         .positions = 1,
                         .stable = spec->stable_embedding};
    s = add_layer(&b, &emb, "");
    for (int l = 0; l < spec->layers && !s; l++) {
        char prefix[24];
        snprintf(prefix, sizeof prefix, "h.%d.", l);
        mt_layer_spec blk = {.kind = MT_LAYER_BLOCK, .heads = spec->heads};
        s = add_layer(&b, &blk, prefix);
    }
    mt_layer_spec lnf = {.kind = MT_LAYER_LAYERNORM}, head = {.kind = MT_LAYER_LM_HEAD};
    if (!s) s = add_layer(&b, &lnf, "lnf.");
    if (!s) s = add_layer(&b, &head, "");
    if (s) {
        free_model(m);
        return s;
    }
    mti_origin from = *o;
    if (!from.path) from.seed = spec->seed, from.deferred = spec->deferred != 0;
    return finish(&b, &from, out);
}

mt_status mt_model_gpt_create(mt_context *ctx, const mt_gpt_spec *spec, mt_model **out)
{
    const mti_origin o = {0}; /* (the spec's seed and deferred, read once it is checked) */
    return mti_gpt_build(ctx, spec, "mt_model_gpt_create", &o, out);
}

mt_status mt_model_gpt_get_spec(const mt_model *m, mt_gpt_spec *out)
{
    if (!m || !out)
        return mti_fail(m ? m->ctx : NULL, MT_ERR_INVALID_ARG, "mt_model_gpt_get_spec: %s is NULL",
                        m ? "out" : "model");
    if (m->kind != MTI_MODEL_GPT)
        return mti_fail(m->ctx, MT_ERR_INVALID_ARG, "mt_model_gpt_get_spec: not a GPT model");
    *out = m->gpt;
    out->deferred = mti_model_unmade(m) > 0; /* (now, not as it was made) */
    return MT_OK;
}

mt_status mt_model_destroy(mt_model *m)
{
    if (!m) return MT_OK;
    if (atomic_load(&m->n_trainers))
        return mti_fail(m->ctx, MT_ERR_STATE,
                        "mt_model_destroy: %d trainer(s) still use this model; destroy them first",
                        atomic_load(&m->n_trainers));
    mt_context *ctx = m->ctx;
    free_model(m);
    atomic_fetch_sub(&ctx->n_children, 1);
    return MT_OK;
}

/* (a pipeline-parallel trainer's stage stands in for the model meanwhile:
   the whole model's answers) */
size_t mt_model_num_params(const mt_model *m) { return m ? m->pp ? m->pp->n_params : m->n_params : 0; }

int mt_model_num_tensors(const mt_model *m) { return m ? m->pp ? m->pp->n_param : m->n_param : 0; }

int mt_model_num_units(const mt_model *m) { return m ? m->pp ? m->pp->n_units : m->n_units : 0; }

mt_status mt_model_param_info(const mt_model *m, int i, mt_param_info *out)
{
    if (!m || !out)
        return mti_fail(m ? m->ctx : NULL, MT_ERR_INVALID_ARG, "mt_model_param_info: %s is NULL",
                        m ? "out" : "model");
    const int n = mt_model_num_tensors(m);
    if (i < 0 || i >= n)
        return mti_fail(m->ctx, MT_ERR_INVALID_ARG,
                        "mt_model_param_info: index %d out of range 0..%d", i, n - 1);
    const mti_param *p = m->pp ? &m->pp->params[i] : &m->params[i];
    memset(out, 0, sizeof *out);
    out->name = p->name;
    out->ndim = p->ndim;
    /* (split by a tensor-parallel trainer: the whole tensor's) */
    out->shape[0] = p->tp_split ? p->whole_shape[0] : p->shape[0];
    out->shape[1] = p->ndim != 2 ? 0 : p->tp_split ? p->whole_shape[1] : p->shape[1];
    out->numel = mti_whole_numel(p);
    out->offset = p->offset;
    return MT_OK;
}

static mt_status check_copy(const mt_model *m, const void *p, size_t n, const char *fn)
{
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: model is NULL", fn);
    if (!p) return mti_fail(m->ctx, MT_ERR_INVALID_ARG, "%s: buffer is NULL", fn);
    if (m->pp) return mti_model_all_whole(m, fn); /* (the stage's alone are here) */
    if (n != m->n_params)
        return mti_fail(m->ctx, MT_ERR_INVALID_ARG, "%s: n is %zu but the model has %zu parameters",
                        fn, n, m->n_params);
    return MT_OK;
}

/* Elements [at, at + n) of parameter i as fp32, to or from host memory.
 * The fp32 values are the parameter's master while it has one, else the weights;
 * weights kept only in 16 bits (bf16 without masters) go through a small
 * fp32 staging tensor (IO, at most MTI_STAGE elements). Writes refresh the
 * compute copy when there is a master. Masters sharded by ZeRO hold a
 * slice each: reads take the compute copy (the same on every rank), and
 * writes go to the compute copy and to the master's slice. */
#define MTI_STAGE (1 << 16)

static mt_status stage(mt_model *m, mti_tensor *t, size_t n)
{
    *t = (mti_tensor){.dtype = MTI_F32, .ndim = 1, .shape = {(int64_t)n}};
    return mti_tensor_alloc(m->ctx, t, MT_MEM_IO, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_STAGE, 0));
}

/* Weights a ZeRO-3 trainer holds as slices over the ranks are nowhere
 * whole: refused (the trainer's destroy gathers them back). */
static mt_status sharded_refused(const mt_model *m, const mti_param *p)
{
    if (m->tp && p->tp_split)
        return mti_fail(m->ctx, MT_ERR_UNSUPPORTED,
                        "%s: the weights are split over a tensor group by a tensor-parallel "
                        "trainer (tensor_parallel %d): destroy the trainer on every rank to "
                        "gather them", p->name, m->tp->size);
    if (!m->params_sharded || p->frozen) return MT_OK;
    return mti_fail(m->ctx, MT_ERR_UNSUPPORTED,
                    "%s: the weights are sharded over the ranks by a ZeRO-3 trainer (zero_stage "
                    "3): save a training-state file (mt_trainer_save), or destroy the trainer on "
                    "every rank to gather them",
                    p->name);
}

/* Elements [at, at + n) of quantized parameter p as fp32 into out (memory
 * of the context's device): the op table's dequantize (lib/quant/quant.c's bits
 * on every device; queued on a device's stream). */
static mt_status dequantize_range(const mt_model *m, const mti_param *p, size_t at, size_t n,
                                  float *out)
{
    mt_context *ctx = m->ctx;
    if (!ctx->ops) /* (a device without kernels still holds the bytes) */
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: %s has no kernels in this build or driver to dequantize it", p->name,
                        ctx->dev->name);
    const mti_kctx k = {ctx, ctx->dev};
    return ctx->ops->dequantize(&k, out, p->w.blk.ptr, p->qf, p->numel, at, n, MTI_F32);
}

static mt_status quantize_into(mt_context *ctx, const char *name, mti_qformat qf, const float *x,
                               size_t n, mti_tensor *q);

static mt_status stored_read(const mt_model *m, int i, size_t at, size_t n, float *dst);
static mt_status stored_write(mt_model *m, int i, size_t at, size_t n, const float *src);

/* Dense elements [at, at + n) of a pruned parameter to or from host memory:
 * the kept values among them read or written (a write's values at pruned
 * places are dropped: the mask holds). */
static mt_status sparse_rw(const mt_model *m, int i, size_t at, size_t n, float *buf, bool write)
{
    const mti_param *p = &m->params[i];
    const void *meta = mti_param_meta_host(m, p);
    mt_status s = MT_OK;
    if (!meta) return s;
    const size_t r0 = mti_sp_rank(&p->sp->L, meta, at), r1 = mti_sp_rank(&p->sp->L, meta, at + n);
    float *v = malloc((r1 - r0 ? r1 - r0 : 1) * sizeof *v);
    if (!v) s = mti_fail(m->ctx, MT_ERR_OOM, "%s: out of host memory", p->name);
    if (!s && !write) {
        s = stored_read(m, i, r0, r1 - r0, v);
        if (!s) mti_sp_expand(&p->sp->L, meta, v, r0, sizeof *v, at, n, buf);
    } else if (!s) {
        mti_sp_compress(&p->sp->L, meta, buf, sizeof *v, at, n, v, r0, 0);
        s = stored_write((mt_model *)m, i, r0, r1 - r0, v);
    }
    free(v);
    return s;
}

mt_status mti_param_read(const mt_model *m, int i, size_t at, size_t n, float *dst)
{
    if (m->params[i].sp) return sparse_rw(m, i, at, n, dst, false);
    return stored_read(m, i, at, n, dst);
}

mt_status mti_param_write(mt_model *m, int i, size_t at, size_t n, const float *src)
{
    if (m->params[i].sp) return sparse_rw(m, i, at, n, (float *)src, true);
    return stored_write(m, i, at, n, src);
}

/* Elements [at, at + n) of what parameter i stores (a pruned one's kept
 * values). */
static mt_status stored_read(const mt_model *m, int i, size_t at, size_t n, float *dst)
{
    mt_context *ctx = m->ctx;
    const mti_param *p = &m->params[i];
    if (p->unmade) return mti_source_read(m, i, at, n, dst); /* (deferred: not made for it) */
    if (sharded_refused(m, p)) return MT_ERR_UNSUPPORTED;
    if (m->params_home && mti_offload_has_weights(m->params_home, i)) /* on disk */
        return mti_offload_param_read(m->params_home, i, at, n, dst);
    if (p->qf && ctx->dev->kind == MT_DEVICE_CPU) /* dequantized straight into dst */
        return dequantize_range(m, p, at, n, dst);
    if (m->master_home && !p->frozen && !m->master_sliced) /* the master, from its file */
        return mti_offload_read(m->master_home, i, 1, (uint64_t)at * 4, dst, n * 4);
    /* (a frozen weight has no master; a ZeRO master is a slice) */
    const mti_tensor *t = p->master.blk.ptr && !m->master_sliced ? &p->master : &p->w;
    if (t->dtype == MTI_F32 && !p->qf) {
        mt_status s = ctx->dev->copy_d2h(ctx->dev, dst, (const float *)t->blk.ptr + at, n * 4);
        return s ? s : ctx->dev->sync(ctx->dev);
    }
    const mti_kctx k = {ctx, ctx->dev};
    mt_status s = MT_OK;
    for (size_t d = 0; d < n && !s; d += MTI_STAGE) {
        size_t c = n - d < MTI_STAGE ? n - d : MTI_STAGE;
        mti_tensor st;
        s = stage((mt_model *)m, &st, c);
        if (!s && p->qf) /* quantized on a device: dequantized there */
            s = dequantize_range(m, p, at + d, c, st.blk.ptr);
        else if (!s)
            s = ctx->ops->cast(&k, st.blk.ptr, MTI_F32,
                               (const char *)t->blk.ptr + (at + d) * mti_dtype_size(t->dtype),
                               t->dtype, c, MTI_ROUND_NEAREST, 0);
        if (!s) s = mti_tensor_download(ctx, &st, dst + d, c * 4);
        mti_tensor_free(ctx, &st);
    }
    return s;
}

static mt_status stored_write(mt_model *m, int i, size_t at, size_t n, const float *src)
{
    mt_context *ctx = m->ctx;
    const mti_kctx k = {ctx, ctx->dev};
    mti_param *p = &m->params[i];
    if (p->unmade) { /* deferred: made now, from the source unless all of it is written */
        mt_status s = MT_OK;
        if (at == 0 && n == p->numel) { /* (an unmade weight is never quantized) */
            s = mti_tensor_alloc(ctx, &p->w, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                 MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
            if (!s) p->unmade = 0;
            if (!s && !mti_model_unmade(m)) mti_source_free(m);
        } else {
            s = make_where(m, NULL, i);
        }
        if (s) return s;
    }
    if (sharded_refused(m, p)) return MT_ERR_UNSUPPORTED;
    if (m->params_home && mti_offload_has_weights(m->params_home, i)) /* on disk */
        return mti_offload_param_write(m->params_home, i, at, n, src);
    if (p->qf) { /* quantized again from the new values, whole */
        if (at != 0 || n != p->numel)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "%s is quantized (%s): it is written whole or not at all", p->name,
                            mti_quant_name(p->qf));
        return quantize_into(ctx, p->name, p->qf, src, n, &p->w);
    }
    const bool master = p->master.blk.ptr != NULL && !m->master_sliced; /* (a frozen weight has none) */
    mti_tensor *t = master ? &p->master : &p->w;
    size_t es = mti_dtype_size(p->w.dtype);
    if (m->master_home && !p->frozen && !m->master_sliced) { /* the master in its file, then the copy below */
        mt_status s = mti_offload_write(m->master_home, i, 1, (uint64_t)at * 4, src, n * 4);
        if (s) return s;
    }
    if (m->master_sliced && !p->frozen) { /* the master's slice of [at, at + n), then the copy below */
        /* (a master at home on disk keeps its shape: the slice's length) */
        size_t lo = p->master_lo, hi = lo + (size_t)mti_tensor_numel(&p->master);
        const size_t l0 = lo;
        if (lo < at) lo = at;
        if (hi > at + n) hi = at + n;
        mt_status s = MT_OK;
        if (lo < hi && m->master_home) /* (its file holds this rank's slice, from l0) */
            s = mti_offload_write(m->master_home, i, 1, (uint64_t)(lo - l0) * 4, src + (lo - at),
                                  (hi - lo) * 4);
        else if (lo < hi)
            s = ctx->dev->copy_h2d(ctx->dev, (float *)p->master.blk.ptr + (lo - l0),
                                   src + (lo - at), (hi - lo) * 4);
        if (s) return s;
    }
    if (t->dtype == MTI_F32) {
        mt_status s = ctx->dev->copy_h2d(ctx->dev, (float *)t->blk.ptr + at, src, n * 4);
        if (!s && master) /* refresh the compute copy */
            s = ctx->ops->cast(&k, (char *)p->w.blk.ptr + at * es, p->w.dtype,
                               (float *)t->blk.ptr + at, MTI_F32, n, MTI_ROUND_NEAREST, 0);
        return s;
    }
    mt_status s = MT_OK;
    for (size_t d = 0; d < n && !s; d += MTI_STAGE) {
        size_t c = n - d < MTI_STAGE ? n - d : MTI_STAGE;
        mti_tensor st;
        s = stage(m, &st, c);
        if (!s) s = mti_tensor_upload(ctx, &st, src + d, c * 4);
        if (!s)
            s = ctx->ops->cast(&k, (char *)t->blk.ptr + (at + d) * es, t->dtype, st.blk.ptr,
                               MTI_F32, c, MTI_ROUND_NEAREST, 0);
        mti_tensor_free(ctx, &st);
    }
    return s;
}

/* A call on every weight: refused before it touches any while a ZeRO-3
 * trainer holds some as slices (frozen ones stay whole, and would be
 * written before the first sharded one refused). */
mt_status mti_model_all_whole(const mt_model *m, const char *fn)
{
    if (m->pp)
        return mti_fail(m->ctx, MT_ERR_UNSUPPORTED,
                        "%s: the model is cut into %d pipeline stages by a pipeline-parallel "
                        "trainer (pipeline_parallel), each rank holding its stage's weights: "
                        "destroy the trainer on every rank to bring them back", fn, m->pp->size);
    for (int i = 0; i < m->n_param; i++)
        if (sharded_refused(m, &m->params[i]))
            return mti_fail(m->ctx, MT_ERR_UNSUPPORTED, "%s: %s", fn, mti_last_msg(m->ctx).s);
    return MT_OK;
}

mt_status mt_model_get_params(const mt_model *m, float *dst, size_t n)
{
    mt_status s = check_copy(m, dst, n, "mt_model_get_params");
    if (!s) s = mti_model_all_whole(m, "mt_model_get_params");
    for (int i = 0; i < (m ? m->n_param : 0) && !s; i++)
        s = mti_param_read(m, i, 0, mti_param_dense(&m->params[i]), dst + m->params[i].offset);
    return s;
}

mt_status mt_model_set_params(mt_model *m, const float *src, size_t n)
{
    mt_status s = check_copy(m, src, n, "mt_model_set_params");
    if (!s) s = mti_model_all_whole(m, "mt_model_set_params");
    if (s) return s;
    /* check every value first: a NaN or inf would poison training silently */
    for (size_t i = 0; i < n; i++)
        if (!isfinite(src[i]))
            return mti_fail(m->ctx, MT_ERR_INVALID_ARG,
                            "mt_model_set_params: value %zu is not finite", i);
    /* and what each quantized weight can hold, before any changes */
    for (int i = 0; i < m->n_param; i++) {
        const mti_param *p = &m->params[i];
        if (p->qf && (s = mti_quant_check(m->ctx, p->qf, src + p->offset, p->numel)))
            return mti_fail(m->ctx, s, "mt_model_set_params: %s: %s", p->name,
                            mti_last_msg(m->ctx).s);
    }
    return mti_model_upload(m, src);
}

mt_status mti_model_upload(mt_model *m, const float *src)
{
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_param && !s; i++)
        s = mti_param_write(m, i, 0, mti_param_dense(&m->params[i]), src + m->params[i].offset);
    return s ? s : m->ctx->dev->sync(m->ctx->dev);
}

/* ---- quantized weights ---- */

const char *mt_base_format_name(mt_base_format f)
{
    return f == MT_BASE_FULL ? "full" : mti_quant_name(mti_qformat_of(f));
}

int mti_param_quantizable(const mt_model *m, int i)
{
    return m->params[i].linear && m->params[i].adapter_of < 0;
}

int mti_param_is_table(const mt_model *m, int i)
{
    return m->input == MT_INPUT_TOKENS && m->n_layers > 0 &&
           m->layers[0].kind == MT_LAYER_EMBEDDING && m->layers[0].p0 == i;
}

/* The quantized tensor of parameter i in format qf: a flat byte tensor. */
static mti_tensor quant_tensor(const mti_param *p, mti_qformat qf)
{
    size_t bytes = mti_quant_bytes(qf, p->numel);
    return (mti_tensor){.dtype = MTI_U8, .ndim = 1, .shape = {(int64_t)bytes}};
}

/* x (n fp32 values on the host) quantized in format qf into q (a quantized
 * tensor on the context's device): on the CPU straight into it, on a
 * device into a host buffer whose bytes then go up. Values it cannot hold
 * are refused before q changes, the message naming the tensor. */
static mt_status quantize_into(mt_context *ctx, const char *name, mti_qformat qf, const float *x,
                               size_t n, mti_tensor *q)
{
    mt_status s;
    if (ctx->dev->kind == MT_DEVICE_CPU) {
        s = mti_quantize(ctx, qf, x, n, q->blk.ptr);
        return s ? mti_fail(ctx, s, "%s: %s", name, mti_last_msg(ctx).s) : MT_OK;
    }
    const size_t bytes = mti_quant_bytes(qf, n);
    void *h = malloc(bytes ? bytes : 1);
    if (!h) return mti_fail(ctx, MT_ERR_OOM, "quantize: out of host memory (%zu bytes)", bytes);
    s = mti_quantize(ctx, qf, x, n, h);
    if (s) s = mti_fail(ctx, s, "%s: %s", name, mti_last_msg(ctx).s);
    if (!s) s = mti_tensor_upload(ctx, q, h, bytes);
    if (!s) s = ctx->dev->sync(ctx->dev);
    free(h);
    return s;
}

/* Parameter i becomes its quantized tensor in format qf made from x (its
 * fp32 values; NULL in a dry context): on the CPU quantized straight into
 * PARAM, on a device through a host buffer of the quantized bytes, which
 * then go up. Its old weights (if any) go after. */
static mt_status quantize_from(mt_model *m, int i, mti_qformat qf, const float *x)
{
    mt_context *ctx = m->ctx;
    mti_param *p = &m->params[i];
    mti_tensor q = quant_tensor(p, qf);
    mt_status s = mti_tensor_alloc(ctx, &q, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                   MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
    if (!s && !ctx->dry) s = quantize_into(ctx, p->name, qf, x, p->numel, &q);
    if (s) {
        mti_tensor_free(ctx, &q);
        return s;
    }
    mti_tensor_free(ctx, &p->w);
    p->w = q;
    p->qf = qf;
    return MT_OK;
}

mt_status mti_param_quantize(mt_model *m, int i, mti_qformat qf)
{
    mt_context *ctx = m->ctx;
    mti_param *p = &m->params[i];
    if (p->qf == qf) return MT_OK;
    if (p->sp)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED, "%s is pruned: a pruned weight is not quantized",
                        p->name);
    if (p->qf || p->w.dtype != MTI_F32 || !mti_quant_name(qf))
        return mti_fail(ctx, MT_ERR_INTERNAL, "%s: cannot be quantized from its storage", p->name);
    if (ctx->dev->kind == MT_DEVICE_CPU || ctx->dry)
        return quantize_from(m, i, qf, p->w.blk.ptr);
    /* on a device: the fp32 down into one tensor's host buffer, quantized there */
    float *x = malloc(p->numel * sizeof *x);
    if (!x)
        return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory (its fp32 staging)", p->name);
    mt_status s = mti_tensor_download(ctx, &p->w, x, p->numel * sizeof *x);
    if (!s) s = quantize_from(m, i, qf, x);
    free(x);
    return s;
}

mt_status mti_param_dequantize(mt_model *m, int i)
{
    mt_context *ctx = m->ctx;
    mti_param *p = &m->params[i];
    if (!p->qf) return MT_OK;
    mti_tensor w = {.dtype = MTI_F32, .ndim = p->ndim, .shape = {p->shape[0], p->shape[1]}};
    mt_status s = mti_tensor_alloc(ctx, &w, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                   MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
    if (!s && !ctx->dry) s = dequantize_range(m, p, 0, p->numel, w.blk.ptr);
    if (!s && !ctx->dry) s = ctx->dev->sync(ctx->dev);
    if (s) {
        mti_tensor_free(ctx, &w);
        return s;
    }
    mti_tensor_free(ctx, &p->w);
    p->w = w;
    p->qf = MTI_QF_NONE;
    return MT_OK;
}
