/*
 * lora.c - LoRA adapters on a model's linear weights: adding them, merging
 * them into the weights, and the adapter file (docs/formats.md).
 *
 * The adapters are parameters like any other, after the base's (params
 * [n_base ..], get/set_params offsets after the base's): per adapted
 * weight W (out, in), A (rank, in) then B (rank, out). The engine adds
 * (alpha / rank) (x A^T) B to the weight's output (engine.c, lora_fwd);
 * the trainer freezes the base. So gradients, masters, optimizer state,
 * the fused step, data parallel and training-state files treat adapters
 * as the parameters they are, with nothing of their own.
 */
#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/kernels.h"
#include "model/model.h"
#include "rng.h"

#define LORA_MAX_RANK 4096
#define LORA_MAGIC "MTLORA\0\0"
#define LORA_VERSION 1u
#define LORA_HEADER 32u
#define LORA_ENTRY (MTI_NAME_LEN + 16) /* name, in, out */

bool mti_name_targeted(const char *targets, const char *name, int *hits)
{
    if (!targets || !*targets) return true;
    bool any = false;
    char pat[256];
    int k = 0;
    for (const char *p = targets; *p; k++) {
        size_t n = strcspn(p, ",");
        snprintf(pat, sizeof pat, "%.*s", (int)(n < sizeof pat ? n : sizeof pat - 1), p);
        if (n && fnmatch(pat, name, 0) == 0) {
            any = true;
            if (hits) hits[k]++;
        }
        p += n + (p[n] == ',');
    }
    return any;
}

static int count_patterns(const char *targets)
{
    int n = 1;
    for (const char *p = targets; *p; p++) n += *p == ',';
    return n;
}

/* The adapted weights' names, comma-separated (malloc'd). */
static char *names_of(const mt_model *m)
{
    size_t len = 1;
    for (int i = 0; i < m->n_base; i++)
        if (m->params[i].lora >= 0) len += strlen(m->params[i].name) + 1;
    char *s = malloc(len), *at = s;
    if (!s) return NULL;
    *s = 0;
    for (int i = 0; i < m->n_base; i++)
        if (m->params[i].lora >= 0) at += sprintf(at, "%s%s", at == s ? "" : ",", m->params[i].name);
    return s;
}

void mti_lora_detach(mt_model *m)
{
    if (!m->lora_rank) return;
    for (int i = m->n_base; i < m->n_param; i++) {
        mti_tensor_free(m->ctx, &m->params[i].w);
        mti_tensor_free(m->ctx, &m->params[i].master);
    }
    for (int i = 0; i < m->n_base; i++) m->params[i].lora = -1;
    m->n_param = m->n_base;
    m->n_params = m->n_base_params;
    m->lora_rank = 0;
    free(m->lora_targets);
    m->lora_targets = NULL;
}

/* A's draw: uniform in +-1/sqrt(in), from one generator over the adapters
 * in order; B zero. */
static mt_status init_adapters(mt_model *m, uint64_t seed)
{
    mt_context *ctx = m->ctx;
    mti_rng rng;
    mti_rng_seed(&rng, seed);
    mt_status s = MT_OK;
    for (int i = m->n_base; i < m->n_param && !s; i++) {
        mti_param *p = &m->params[i];
        s = mti_tensor_alloc(ctx, &p->w, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                             MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
        if (s || ctx->dry) continue;
        if ((i - m->n_base) % 2) { /* B */
            s = mti_tensor_zero(ctx, &p->w);
            continue;
        }
        float *h = malloc(p->numel * sizeof *h);
        if (!h) return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
        for (size_t k = 0; k < p->numel; k++)
            h[k] = (2.0f * mti_rng_uniform(&rng) - 1.0f) * p->init_a;
        s = ctx->dev->copy_h2d(ctx->dev, p->w.blk.ptr, h, p->numel * sizeof *h);
        if (!s) s = ctx->dev->sync(ctx->dev);
        free(h);
    }
    return s;
}

/* Adds A and B for every weight `want` marks (n_base entries). */
static mt_status add_adapters(mt_model *m, const unsigned char *want, int rank, float alpha,
                              uint64_t seed, const char *fn)
{
    mt_status made = mti_model_make(m, NULL); /* (a deferred model: the adapters' base whole) */
    if (made) return mti_fail(m->ctx, made, "%s: %s", fn, mti_last_msg(m->ctx).s);
    int k = 0;
    for (int i = 0; i < m->n_param; i++) {
        k += want[i];
        if (want[i] && strlen(m->params[i].name) + 8 >= MTI_NAME_LEN)
            return mti_fail(m->ctx, MT_ERR_INVALID_ARG, "%s: '%s': the adapter's name is too long",
                            fn, m->params[i].name);
    }
    mti_param *np = realloc(m->params, (size_t)(m->n_param + 2 * k) * sizeof *np);
    if (!np) return mti_fail(m->ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    m->params = np;
    m->n_base = m->n_param;
    m->n_base_params = m->n_params;
    size_t off = m->n_params;
    for (int i = 0; i < m->n_base; i++) {
        if (!want[i]) continue;
        mti_param *w = &m->params[i];
        const int64_t in = w->shape[1], out = w->shape[0];
        w->lora = m->n_param;
        for (int j = 0; j < 2; j++) {
            mti_param *p = &m->params[m->n_param++];
            memset(p, 0, sizeof *p);
            const size_t l = strlen(w->name); /* + 8 fits (checked above) */
            memcpy(p->name, w->name, l);
            memcpy(p->name + l, j ? ".lora_b" : ".lora_a", 8);
            p->ndim = 2;
            p->shape[0] = rank;
            p->shape[1] = j ? out : in;
            p->numel = (size_t)rank * (size_t)p->shape[1];
            p->offset = off;
            off += p->numel;
            p->uses = 1;
            p->lora = -1;
            p->adapter_of = i;
            p->init = j ? MTI_INIT_ZERO : MTI_INIT_UNIFORM;
            p->init_a = 1.0f / sqrtf((float)in);
            p->init_rows = rank;
            p->w = (mti_tensor){.dtype = MTI_F32, .ndim = 2, .shape = {p->shape[0], p->shape[1]}};
        }
    }
    m->n_params = off;
    m->lora_rank = rank;
    m->lora_alpha = alpha;
    m->lora_seed = seed;
    mt_status s = (m->lora_targets = names_of(m)) ? MT_OK
                                                   : mti_fail(m->ctx, MT_ERR_OOM, "out of host memory");
    if (!s) s = init_adapters(m, seed);
    if (s) {
        mti_msg msg = mti_last_msg(m->ctx);
        mti_lora_detach(m);
        return mti_fail(m->ctx, s, "%s: %s", fn, msg.s);
    }
    return MT_OK;
}

mt_status mti_lora_attach(mt_model *m, const mt_lora_config *c, const char *fn)
{
    mt_context *ctx = m->ctx;
    if (c->rank < 1 || c->rank > LORA_MAX_RANK)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->lora.rank %d out of range 1..%d", fn,
                        c->rank, LORA_MAX_RANK);
    if (!isfinite(c->alpha) || c->alpha < 0.0f)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->lora.alpha %g must be finite and >= 0",
                        fn, (double)c->alpha);
    const float alpha = c->alpha > 0.0f ? c->alpha : (float)c->rank;
    const int n = m->lora_rank ? m->n_base : m->n_param;
    const int np = c->targets && *c->targets ? count_patterns(c->targets) : 0;
    int *hits = calloc((size_t)np + 1, sizeof *hits);
    unsigned char *want = calloc((size_t)n + 1, 1);
    if (!hits || !want) {
        free(hits), free(want);
        return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    }
    int k = 0;
    for (int i = 0; i < n; i++)
        if (m->params[i].linear && mti_name_targeted(c->targets, m->params[i].name, hits)) want[i] = 1, k++;
    mt_status s = MT_OK;
    for (int j = 0; j < np && !s; j++)
        if (!hits[j]) {
            const char *p = c->targets;
            for (int q = 0; q < j; q++) p += strcspn(p, ",") + 1;
            s = mti_fail(ctx, MT_ERR_INVALID_ARG,
                         "%s: cfg->lora.targets pattern '%.*s' matches no linear weight (LINEAR "
                         "layers' and blocks' qkv, attproj, fc, fcproj weights)",
                         fn, (int)strcspn(p, ","), p);
        }
    if (!s && !k) s = mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: the model has no linear weight to adapt", fn);
    if (!s && m->lora_rank) { /* the model's adapters must be these */
        bool same = m->lora_rank == c->rank && m->lora_alpha == alpha;
        for (int i = 0; i < n && same; i++) same = want[i] == (m->params[i].lora >= 0);
        if (!same)
            s = mti_fail(ctx, MT_ERR_INVALID_ARG,
                         "%s: the model has LoRA adapters of rank %d, alpha %g on '%s'; cfg->lora "
                         "asks for rank %d, alpha %g on others (merge or remove them first, or "
                         "set cfg->lora.rank 0 to train the model's)",
                         fn, m->lora_rank, (double)m->lora_alpha, m->lora_targets, c->rank,
                         (double)alpha);
    } else if (!s) {
        s = add_adapters(m, want, c->rank, alpha, c->seed, fn);
    }
    free(hits), free(want);
    return s;
}

mt_status mt_model_lora_get(const mt_model *m, mt_lora_config *out)
{
    if (!m || !out)
        return mti_fail(m ? m->ctx : NULL, MT_ERR_INVALID_ARG, "mt_model_lora_get: %s is NULL",
                        m ? "out" : "model");
    *out = (mt_lora_config){.rank = m->lora_rank, .alpha = m->lora_alpha,
                            .targets = m->lora_targets, .seed = m->lora_seed};
    return MT_OK;
}

static mt_status no_trainer(const mt_model *m, const char *fn, bool need_adapters)
{
    if (atomic_load(&((mt_model *)m)->n_trainers))
        return mti_fail(m->ctx, MT_ERR_STATE, "%s: a trainer uses the model; destroy it first", fn);
    if (need_adapters && !m->lora_rank)
        return mti_fail(m->ctx, MT_ERR_STATE, "%s: the model has no LoRA adapters", fn);
    return MT_OK;
}

mt_status mt_model_lora_merge(mt_model *m)
{
    const char *fn = "mt_model_lora_merge";
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: model is NULL", fn);
    mt_status s = no_trainer(m, fn, true);
    if (!s) s = mti_model_make(m, NULL); /* (a deferred model's base, whole) */
    if (s) return s;
    for (int i = 0; i < m->n_base; i++) /* (a pruned weight keeps its zeros: B A has none) */
        if (m->params[i].lora >= 0 && m->params[i].sp)
            return mti_fail(m->ctx, MT_ERR_UNSUPPORTED, "%s: %s is pruned: its merged weight "
                            "would not keep the zeros (save the adapters with "
                            "mt_model_lora_save instead)", fn, m->params[i].name);
    const float scale = m->lora_alpha / (float)m->lora_rank;
    const int r = m->lora_rank;
    for (int i = 0; i < m->n_base && !s; i++) {
        const mti_param *w = &m->params[i];
        if (w->lora < 0) continue;
        const size_t in = (size_t)w->shape[1], out = (size_t)w->shape[0];
        float *a = malloc((size_t)r * in * sizeof *a), *b = malloc((size_t)r * out * sizeof *b);
        float *row = malloc(in * sizeof *row);
        if (!a || !b || !row) s = mti_fail(m->ctx, MT_ERR_OOM, "%s: out of host memory", fn);
        if (!s) s = mti_param_dequantize(m, i); /* a quantized base: fp32 from here on */
        if (!s) s = mti_param_read(m, w->lora, 0, (size_t)r * in, a);
        if (!s) s = mti_param_read(m, w->lora + 1, 0, (size_t)r * out, b);
        /* row o of W += scale * sum_k B[k][o] A[k] */
        for (size_t o = 0; o < out && !s; o++) {
            s = mti_param_read(m, i, o * in, in, row);
            for (int q = 0; q < r && !s; q++) {
                const float c = scale * b[(size_t)q * out + o];
                const float *aq = a + (size_t)q * in;
                for (size_t j = 0; j < in; j++) row[j] += c * aq[j];
            }
            if (!s) s = mti_param_write(m, i, o * in, in, row);
        }
        free(a), free(b), free(row);
    }
    if (!s) s = m->ctx->dev->sync(m->ctx->dev);
    if (s) return mti_fail(m->ctx, s, "%s: %s (weights merged part-way)", fn, mti_last_msg(m->ctx).s);
    mti_lora_detach(m);
    return MT_OK;
}

/* ---- the adapter file ---- */

static void put_f32(unsigned char *p, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    mti_put_u32(p, u);
}

static float get_f32(const unsigned char *p)
{
    uint32_t u = mti_get_u32(p);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

mt_status mt_model_lora_save(const mt_model *m, const char *path)
{
    const char *fn = "mt_model_lora_save";
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: model is NULL", fn);
    mt_context *ctx = m->ctx;
    if (!path) return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: path is NULL", fn);
    if (!m->lora_rank) return mti_fail(ctx, MT_ERR_STATE, "%s: the model has no LoRA adapters", fn);
    const int k = (m->n_param - m->n_base) / 2;
    unsigned char h[LORA_HEADER] = {0};
    memcpy(h, LORA_MAGIC, 8);
    mti_put_u32(h + 8, LORA_VERSION);
    mti_put_u32(h + 12, (uint32_t)m->lora_rank);
    put_f32(h + 16, m->lora_alpha);
    mti_put_u32(h + 20, (uint32_t)k);
    mti_put_u32(h + 24, mti_crc32(0, h, 24));
    size_t biggest = 0;
    for (int i = m->n_base; i < m->n_param; i++)
        if (m->params[i].numel > biggest) biggest = m->params[i].numel;
    float *buf = malloc(biggest * sizeof *buf);
    if (!buf) return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    mti_afile af;
    uint32_t crc = 0;
    mt_status s = mti_afile_open(ctx, path, &af);
    if (!s) s = mti_afile_write(ctx, &af, h, sizeof h);
    for (int i = 0; i < m->n_base && !s; i++) { /* the table */
        const mti_param *w = &m->params[i];
        if (w->lora < 0) continue;
        unsigned char e[LORA_ENTRY] = {0};
        snprintf((char *)e, MTI_NAME_LEN, "%s", w->name);
        mti_put_u64(e + MTI_NAME_LEN, (uint64_t)w->shape[1]);
        mti_put_u64(e + MTI_NAME_LEN + 8, (uint64_t)w->shape[0]);
        crc = mti_crc32(crc, e, sizeof e);
        s = mti_afile_write(ctx, &af, e, sizeof e);
    }
    for (int i = m->n_base; i < m->n_param && !s; i++) { /* A, B of each, fp32 */
        const mti_param *p = &m->params[i];
        s = mti_param_read(m, i, 0, p->numel, buf);
        for (size_t j = 0; j < p->numel && !s; j++) put_f32((unsigned char *)&buf[j], buf[j]);
        if (!s) crc = mti_crc32(crc, buf, p->numel * 4);
        if (!s) s = mti_afile_write(ctx, &af, buf, p->numel * 4);
    }
    unsigned char t[8] = {0};
    mti_put_u32(t, crc);
    if (!s) s = mti_afile_write(ctx, &af, t, sizeof t);
    if (!s) s = mti_afile_commit(ctx, &af);
    else if (af.fd >= 0) mti_afile_abort(&af);
    free(buf);
    return s;
}

static mt_status bad_file(mt_context *ctx, const char *path, const char *what)
{
    return mti_fail(ctx, MT_ERR_FORMAT, "mt_model_lora_load: '%s': %s (the model is unchanged)",
                    path, what);
}

mt_status mt_model_lora_load(mt_model *m, const char *path)
{
    const char *fn = "mt_model_lora_load";
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: model is NULL", fn);
    mt_context *ctx = m->ctx;
    if (!path) return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: path is NULL", fn);
    mt_status s = no_trainer(m, fn, false);
    if (s) return s;
    /* the whole file, checked before anything changes (adapters are small) */
    FILE *f = fopen(path, "rb");
    if (!f) return mti_fail(ctx, MT_ERR_IO, "%s: cannot open '%s': %s", fn, path, strerror(errno));
    unsigned char *d = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            unsigned char *q = realloc(d, cap = cap ? 2 * cap : 1 << 16);
            if (!q) {
                free(d), fclose(f);
                return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
            }
            d = q;
        }
        size_t got = fread(d + len, 1, cap - len, f);
        len += got;
        if (!got) break;
    }
    bool rerr = ferror(f);
    fclose(f);
    if (rerr) {
        free(d);
        return mti_fail(ctx, MT_ERR_IO, "%s: reading '%s' failed", fn, path);
    }
    const char *why = NULL;
    uint32_t r = 0, k = 0;
    float alpha = 0;
    if (len < LORA_HEADER || memcmp(d, LORA_MAGIC, 8)) why = "not a memtrain LoRA adapter file";
    else if (mti_get_u32(d + 24) != mti_crc32(0, d, 24) || mti_get_u32(d + 28)) why = "corrupt header";
    else if (mti_get_u32(d + 8) != LORA_VERSION) why = "another format version";
    if (!why) {
        r = mti_get_u32(d + 12), k = mti_get_u32(d + 20), alpha = get_f32(d + 16);
        if (r < 1 || r > LORA_MAX_RANK || !(alpha > 0) || !isfinite(alpha) || !k ||
            k > (uint32_t)m->n_param)
            why = "corrupt header (rank, alpha or count)";
    }
    uint64_t want = LORA_HEADER + (uint64_t)k * LORA_ENTRY + 8;
    for (uint32_t e = 0; !why && e < k; e++) {
        if (LORA_HEADER + (uint64_t)(e + 1) * LORA_ENTRY > len) {
            why = "truncated";
            break;
        }
        const unsigned char *p = d + LORA_HEADER + (size_t)e * LORA_ENTRY;
        want += (uint64_t)r * 4 * (mti_get_u64(p + MTI_NAME_LEN) + mti_get_u64(p + MTI_NAME_LEN + 8));
    }
    if (!why && len != want) why = len < want ? "truncated" : "longer than its header says";
    if (!why && mti_get_u32(d + len - 8) != mti_crc32(0, d + LORA_HEADER, len - LORA_HEADER - 8))
        why = "corrupt (the CRC of the adapters differs)";
    if (!why && mti_get_u32(d + len - 4)) why = "corrupt (the last 4 bytes are not 0)";
    if (why) {
        free(d);
        return bad_file(ctx, path, why);
    }
    /* the weights it names: linear weights of this model, of these shapes */
    const int n = m->lora_rank ? m->n_base : m->n_param;
    unsigned char *sel = calloc((size_t)n + 1, 1);
    if (!sel) {
        free(d);
        return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    }
    char msg[256] = "";
    uint32_t prev = 0;
    for (uint32_t e = 0; e < k && !msg[0]; e++) {
        const unsigned char *p = d + LORA_HEADER + (size_t)e * LORA_ENTRY;
        char name[MTI_NAME_LEN];
        memcpy(name, p, MTI_NAME_LEN);
        name[MTI_NAME_LEN - 1] = 0;
        uint64_t in = mti_get_u64(p + MTI_NAME_LEN), out = mti_get_u64(p + MTI_NAME_LEN + 8);
        int i = 0;
        while (i < n && strcmp(m->params[i].name, name)) i++;
        if (i == n || !m->params[i].linear || (uint64_t)m->params[i].shape[1] != in ||
            (uint64_t)m->params[i].shape[0] != out || (e && (uint32_t)i <= prev))
            snprintf(msg, sizeof msg, "its adapter %u is for '%s' (%llu x %llu), not a linear "
                     "weight of this model in that order and shape", e, name,
                     (unsigned long long)out, (unsigned long long)in);
        else sel[i] = 1, prev = (uint32_t)i;
    }
    if (!msg[0] && m->lora_rank) {
        bool same = m->lora_rank == (int)r && m->lora_alpha == alpha;
        for (int i = 0; i < n && same; i++) same = sel[i] == (m->params[i].lora >= 0);
        if (!same)
            snprintf(msg, sizeof msg, "rank %u, alpha %g on other weights than the model's "
                     "adapters (rank %d, alpha %g)", r, (double)alpha, m->lora_rank,
                     (double)m->lora_alpha);
    }
    if (msg[0]) {
        free(d), free(sel);
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: '%s': %s (the model is unchanged)", fn, path, msg);
    }
    bool added = !m->lora_rank;
    if (added) s = add_adapters(m, sel, (int)r, alpha, 0, fn);
    const unsigned char *at = d + LORA_HEADER + (size_t)k * LORA_ENTRY;
    float *buf = NULL;
    for (int i = m->n_base; i < m->n_param && !s; i++) {
        const mti_param *p = &m->params[i];
        float *q = realloc(buf, p->numel * sizeof *q);
        if (!q) {
            s = mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
            break;
        }
        buf = q;
        for (size_t j = 0; j < p->numel; j++, at += 4) buf[j] = get_f32(at);
        s = mti_param_write(m, i, 0, p->numel, buf);
    }
    if (!s) s = ctx->dev->sync(ctx->dev);
    if (s && added) mti_lora_detach(m);
    free(buf), free(d), free(sel);
    return s;
}
