/*
 * gpt.c - llm.c model files in and out of GPT models.
 *
 * The file (docs/formats.md): a header of 256
 * little-endian int32 ([0] 20240326, [1] 3 for fp32, [2] max_seq, [3]
 * vocab, [4] layers, [5] heads, [6] channels, [7] padded vocab), then every
 * parameter as fp32 in llm.c's order, which is the model's get/set_params
 * order. Files are streamed in chunks, so loading or saving never holds a
 * second copy of the weights in host memory.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model/model.h"

#define LLMC_MAGIC 20240326
#define LLMC_FP32 3
#define HEADER_INTS 256
#define CHUNK (1 << 16)

int *mti_param_order(const mt_model *m)
{
    int *ord = malloc((size_t)m->n_param * sizeof *ord);
    if (!ord) return NULL;
    for (int i = 0; i < m->n_param; i++) ord[i] = i;
    for (int i = 1; i < m->n_param; i++) /* insertion sort: nearly ordered, few hundred */
        for (int j = i; j > 0 && m->params[ord[j - 1]].offset > m->params[ord[j]].offset; j--) {
            int t = ord[j];
            ord[j] = ord[j - 1];
            ord[j - 1] = t;
        }
    return ord;
}

static mt_status fmt(mt_context *ctx, const char *path, const char *what)
{
    return mti_fail(ctx, MT_ERR_FORMAT, "mt_model_gpt_load: '%s' is not an llm.c fp32 model: %s",
                    path, what);
}

static mt_status load(mt_context *ctx, const char *path, mt_base_format base, bool deferred,
                      const char *fn, mt_model **out);

mt_status mt_model_gpt_load(mt_context *ctx, const char *path, mt_model **out)
{
    return load(ctx, path, MT_BASE_FULL, false, "mt_model_gpt_load", out);
}

mt_status mt_model_gpt_load_deferred(mt_context *ctx, const char *path, mt_model **out)
{
    return load(ctx, path, MT_BASE_FULL, true, "mt_model_gpt_load_deferred", out);
}

mt_status mt_model_gpt_load_base(mt_context *ctx, const char *path, mt_base_format base,
                                 mt_model **out)
{
    return load(ctx, path, base, false, base ? "mt_model_gpt_load_base" : "mt_model_gpt_load",
                out);
}

/* The header read and checked; the values are read by the model's source
 * (model/source.c), at once or, deferred, where they are placed. */
static mt_status load(mt_context *ctx, const char *path, mt_base_format base, bool deferred,
                      const char *fn, mt_model **out)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: ctx is NULL", fn);
    if (!path || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: %s is NULL", fn, path ? "out" : "path");
    if (!mt_base_format_name(base))
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: base %d is not a base format", fn, (int)base);
    FILE *f = fopen(path, "rb");
    if (!f) return mti_fail(ctx, MT_ERR_IO, "%s: cannot open '%s': %s", fn, path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return mti_fail(ctx, MT_ERR_IO, "%s: '%s' is not a regular file", fn, path);
    }
    unsigned char hb[HEADER_INTS * 4];
    if (fread(hb, 1, sizeof hb, f) != sizeof hb) {
        fclose(f);
        return fmt(ctx, path, "shorter than its 1024-byte header");
    }
    int32_t h[HEADER_INTS];
    for (int i = 0; i < HEADER_INTS; i++) h[i] = (int32_t)mti_get_u32(hb + 4 * i);
    if (h[0] != LLMC_MAGIC) {
        fclose(f);
        return fmt(ctx, path, "bad magic number");
    }
    if (h[1] != LLMC_FP32) {
        fclose(f);
        return mti_fail(ctx, MT_ERR_FORMAT,
                        "%s: '%s' has version %d; only version 3 (fp32) is read", fn, path, h[1]);
    }
    mt_gpt_spec spec;
    mt_gpt_spec_init(&spec);
    spec.max_seq = h[2];
    spec.vocab = h[3];
    spec.layers = h[4];
    spec.heads = h[5];
    spec.channels = h[6];
    spec.padded_vocab = h[7];
    spec.base = base;
    if (h[7] < h[3] || h[7] <= 0) {
        fclose(f);
        return fmt(ctx, path, "padded vocab smaller than vocab");
    }
    fclose(f);
    spec.deferred = deferred;
    const mti_origin o = {.path = path, .first = HEADER_INTS * 4, .deferred = deferred};
    mt_model *m = NULL;
    mt_status s = mti_gpt_build(ctx, &spec, fn, &o, &m);
    if (s == MT_ERR_INVALID_ARG) /* the header's shape */
        return mti_fail(ctx, MT_ERR_FORMAT, "'%s' has an impossible shape: %s", path,
                        mti_last_msg(ctx).s);
    if (s) return s;
    *out = m;
    return MT_OK;
}

mt_status mt_model_gpt_save(const mt_model *m, const char *path)
{
    const char *fn = "mt_model_gpt_save";
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: model is NULL", fn);
    mt_context *ctx = m->ctx;
    if (!path) return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: path is NULL", fn);
    if (m->kind != MTI_MODEL_GPT)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: not a GPT model", fn);
    if (m->gpt.stable_embedding)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: a StableEmbedding's LayerNorm has no place in an llm.c file", fn);
    if (m->lora_rank)
        return mti_fail(ctx, MT_ERR_STATE,
                        "%s: the model has LoRA adapters: merge them into the weights first "
                        "(mt_model_lora_merge), or save them alone (mt_model_lora_save)", fn);
    mt_status ws = mti_model_all_whole(m, fn);
    if (ws) return ws;
    unsigned char hb[HEADER_INTS * 4];
    memset(hb, 0, sizeof hb);
    const int32_t h[8] = {LLMC_MAGIC, LLMC_FP32, m->gpt.max_seq, m->gpt.vocab, m->gpt.layers,
                          m->gpt.heads, m->gpt.channels, m->gpt.padded_vocab};
    for (int i = 0; i < 8; i++) mti_put_u32(hb + 4 * i, (uint32_t)h[i]);
    float *buf = malloc(CHUNK * sizeof *buf);
    int *ord = mti_param_order(m);
    if (!buf || !ord) {
        free(buf);
        free(ord);
        return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    }
    mti_afile af;
    mt_status s = mti_afile_open(ctx, path, &af);
    if (!s) s = mti_afile_write(ctx, &af, hb, sizeof hb);
    for (int oi = 0; oi < m->n_param && !s; oi++) {
        const mti_param *p = &m->params[ord[oi]];
        const size_t numel = mti_param_dense(p); /* (a pruned one's zeros written) */
        for (size_t at = 0; at < numel && !s; at += CHUNK) {
            size_t n = numel - at < CHUNK ? numel - at : CHUNK;
            s = mti_param_read(m, ord[oi], at, n, buf);
            if (!s) s = mti_afile_write(ctx, &af, buf, n * sizeof(float));
        }
    }
    if (!s) {
        s = mti_afile_commit(ctx, &af);
    } else if (af.fd >= 0) {
        mti_afile_abort(&af);
    }
    free(buf);
    free(ord);
    return s;
}
