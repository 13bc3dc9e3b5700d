/*
 * estimate.c - what a training run will hold, per memory class, found
 * before the run without allocating anything.
 *
 * The estimate runs the real thing dry: a context with the caller's
 * allocator configuration is made over a device that has no memory behind
 * it (addresses come from a counter and are never touched), with an op
 * table whose ops compute nothing; the ops that take workspace (the CPU
 * table's fp16/bf16 GEMMs and attention) take it and give it back, with the
 * sizes the real ops use. The model and the trainer are made in it, and two
 * steps of the largest batch run. Every allocation the real run makes is
 * made in the same order with the same sizes, classes and lifetimes, so the
 * figures are what the real context's accounting will show, through
 * whichever allocators (and their waste) the configuration chooses: the
 * estimate is exact by construction, and the test matrix in
 * test/test_estimate.c holds it to that.
 *
 * What it assumes: the batches have max_batch rows of max_seq tokens (the
 * largest a step takes), and no step is skipped (an fp16 overflow skips the
 * update and so allocates less).
 *
 * A CUDA context is estimated without a GPU: the dry device has the CUDA
 * device layer's geometry (a real device's when the estimate is made for a
 * model on one, else a current GPU's), and the op table is the CUDA table
 * run dry (lib/ops_cuda.c: workspace taken, nothing launched; every GEMM
 * takes the same fixed workspace whatever cuBLASLt would choose).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/cpu/cpu_ops.h"
#include "device.h"
#include "engine.h"
#include "kernels.h"
#include "model.h"

/* ---- a device with no memory ---- */

/* Addresses start at 2^47, outside user space on x86-64 and AArch64 with
 * 48-bit addresses, so touching one faults at once. They are never reused. */
#define DRY_BASE ((uintptr_t)1 << 47)

typedef struct dry_impl {
    uintptr_t next;
} dry_impl;

static mt_status dry_take(mti_device *d, size_t bytes, size_t alignment, void **ptr)
{
    dry_impl *di = d->impl;
    uintptr_t at = (di->next + alignment - 1) & ~(uintptr_t)(alignment - 1);
    di->next = at + bytes;
    *ptr = (void *)at;
    return MT_OK;
}

/* As the device it stands for grants: the host device rounds up
 * (mti_cpu_granted); the CUDA device (lib/device_cuda.c) grants the bytes
 * asked for and refuses alignments above MT_MAX_ALIGNMENT. */
static mt_status dry_reserve(mti_device *d, size_t bytes, size_t alignment, void **ptr,
                             size_t *granted)
{
    const bool cuda = d->kind == MT_DEVICE_CUDA;
    if (alignment < d->min_alignment) alignment = d->min_alignment;
    if (bytes == 0 || bytes > MT_MAX_REQUEST || !mti_is_pow2(alignment) ||
        (cuda && alignment > MT_MAX_ALIGNMENT))
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG, "%s reserve: bad size %zu or alignment %zu",
                        cuda ? "CUDA" : "host", bytes, alignment);
    *granted = cuda ? bytes : mti_cpu_granted(bytes, alignment);
    return dry_take(d, *granted, alignment, ptr);
}

static void dry_release(mti_device *d, void *ptr, size_t granted)
{
    (void)d, (void)ptr, (void)granted;
}

static mt_status dry_va_reserve(mti_device *d, size_t bytes, void **base)
{
    if (bytes == 0 || bytes % d->granularity || bytes > MT_MAX_REQUEST)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                        "va_reserve: size %zu is not a positive multiple of %zu", bytes,
                        d->granularity);
    return dry_take(d, bytes, d->granularity, base);
}

static mt_status dry_va_commit(mti_device *d, void *addr, size_t bytes)
{
    (void)d, (void)addr, (void)bytes;
    return MT_OK;
}

static void dry_va_decommit(mti_device *d, void *addr, size_t bytes)
{
    (void)d, (void)addr, (void)bytes;
}

static mt_status dry_copy(mti_device *d, void *dst, const void *src, size_t bytes)
{
    (void)d, (void)dst, (void)src, (void)bytes;
    return MT_OK;
}

/* device to host: the host side reads zeros (losses, flags, norms) */
static mt_status dry_download(mti_device *d, void *dst, const void *src, size_t bytes)
{
    (void)d, (void)src;
    if (bytes) memset(dst, 0, bytes);
    return MT_OK;
}

static mt_status dry_memset8(mti_device *d, void *dst, int value, size_t bytes)
{
    (void)d, (void)dst, (void)value, (void)bytes;
    return MT_OK;
}

static mt_status dry_sync(mti_device *d)
{
    (void)d;
    return MT_OK;
}

static mt_status dry_mem_info(mti_device *d, size_t *free_bytes, size_t *total_bytes)
{
    if (free_bytes) *free_bytes = d->total_bytes;
    if (total_bytes) *total_bytes = d->total_bytes;
    return MT_OK;
}

static void dry_destroy(mti_device *d)
{
    if (!d) return;
    free(d->impl);
    free(d);
}

/* A current NVIDIA GPU's geometry, where no device tells it. */
#define DRY_CUDA_ALIGN 256u
#define DRY_CUDA_GRAN ((size_t)2 << 20)

mt_status mti_device_dry_open(mt_context *ctx, mt_device_kind kind, const mti_device *like,
                              int threads, mti_device **out)
{
    mti_device *d = calloc(1, sizeof *d);
    dry_impl *di = calloc(1, sizeof *di);
    if (!d || !di) {
        free(d);
        free(di);
        return mti_fail(ctx, MT_ERR_OOM, "estimate: out of host memory");
    }
    di->next = DRY_BASE;
    d->total_bytes = (size_t)1 << 46; /* no limit but the configuration's */
    d->ctx = ctx;
    d->impl = di;
    bool growable = true;
    if (kind == MT_DEVICE_CUDA) {
        d->kind = MT_DEVICE_CUDA;
        const bool real = like && like->kind == MT_DEVICE_CUDA;
        snprintf(d->name, sizeof d->name, "%.200s (estimate)", real ? like->name : "CUDA GPU");
        d->min_alignment = real ? like->min_alignment : DRY_CUDA_ALIGN;
        d->granularity = real ? like->granularity : DRY_CUDA_GRAN;
        growable = real ? like->va_reserve != NULL : true;
    } else {
        d->kind = MT_DEVICE_CPU;
        snprintf(d->name, sizeof d->name, "CPU (%d threads, estimate)", threads);
        mti_cpu_geometry(d); /* as the host device */
    }
    d->mem_reserve = dry_reserve;
    d->mem_release = dry_release;
    if (growable) {
        d->va_reserve = dry_va_reserve;
        d->va_commit = dry_va_commit;
        d->va_decommit = dry_va_decommit;
        d->va_release = dry_va_decommit;
    }
    d->copy_h2d = dry_copy;
    d->copy_d2h = dry_download;
    d->copy_d2d = dry_copy;
    d->memset8 = dry_memset8;
    d->sync = dry_sync;
    d->mem_info = dry_mem_info;
    d->destroy = dry_destroy;
    *out = d;
    return MT_OK;
}

/* ---- ops that compute nothing ---- */

/* The parameters are those of the op table (kernels.h); none is used. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"

static mt_status nop_cast(const mti_kctx *k, void *dst, mti_dtype dst_dt, const void *src,
                          mti_dtype src_dt, size_t n, mti_rounding r, uint64_t seed)
{
    return MT_OK;
}
static mt_status nop_embedding_fwd(const mti_kctx *k, void *out, const int32_t *tok,
                                   const void *wte, const void *wpe, int B, int T, int C,
                                   mti_dtype dt)
{
    return MT_OK;
}
static mt_status nop_embedding_bwd(const mti_kctx *k, float *dwte, float *dwpe, const void *dout,
                                   const int32_t *tok, int B, int T, int C, mti_dtype dt)
{
    return MT_OK;
}
static mt_status nop_embedding_dw_rows(const mti_kctx *k, float *dwte, const void *dout,
                                       const int32_t *tok, int B, int T, int C, int v0, int v1,
                                       mti_dtype dt)
{
    return MT_OK;
}
static mt_status nop_layernorm_fwd(const mti_kctx *k, void *out, float *mean, float *rstd,
                                   const void *x, const void *w, const void *b, int n, int c,
                                   mti_dtype dt)
{
    return MT_OK;
}
static mt_status nop_layernorm_bwd(const mti_kctx *k, void *dx, float *dw, float *db,
                                   const void *dout, const void *x, const void *w,
                                   const float *mean, const float *rstd, int n, int c,
                                   mti_dtype dt, int accumulate)
{
    return MT_OK;
}
static mt_status nop_unary(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt)
{
    return MT_OK;
}
static mt_status nop_binary(const mti_kctx *k, void *dx, const void *dy, const void *x, size_t n,
                            mti_dtype dt)
{
    return MT_OK;
}
static mt_status nop_accumulate(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt)
{
    return MT_OK;
}
static mt_status nop_xent(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                          const int32_t *targets, int n, int V, int Vp, float dloss, mti_dtype dt)
{
    return MT_OK;
}
static mt_status nop_unscale_check(const mti_kctx *k, float *g, size_t n, float inv_scale,
                                   int *found_inf)
{
    return MT_OK;
}
static mt_status nop_sumsq(const mti_kctx *k, float *sumsq, const float *g, size_t n)
{
    return MT_OK;
}
static mt_status nop_sgd(const mti_kctx *k, float *p, const float *g, float *m, void *pc,
                         mti_dtype pc_dt, size_t n, const mti_sgd_args *a)
{
    return MT_OK;
}
static mt_status nop_adamw(const mti_kctx *k, float *p, const float *g, float *m, float *v,
                           void *pc, mti_dtype pc_dt, size_t n, const mti_adamw_args *a)
{
    return MT_OK;
}
static mt_status nop_adamw8(const mti_kctx *k, float *p, const float *g, uint8_t *qm, uint8_t *qv,
                            float *absmax_m, float *absmax_v, void *pc, mti_dtype pc_dt, size_t n,
                            const mti_adamw_args *a)
{
    return MT_OK;
}
static mt_status nop_adafactor(const mti_kctx *k, float *p, const float *g, float *row,
                               float *col, float *v, float *m, void *pc, mti_dtype pc_dt,
                               int64_t rows, int64_t cols, int factored,
                               const mti_adafactor_args *a)
{
    return MT_OK;
}

#pragma GCC diagnostic pop

/* The CPU table's GEMMs and attention (they take their workspace and stop:
 * mti_dry), everything else a no-op. */
static const mti_ops dry_ops = {
    .name = "dry",
    .device = MT_DEVICE_CPU,
    .cast = nop_cast,
    .embedding_fwd = nop_embedding_fwd,
    .embedding_bwd = nop_embedding_bwd,
    .embedding_dw_rows = nop_embedding_dw_rows,
    .matmul_fwd = mti_cpu_matmul_fwd,
    .matmul_bwd = mti_cpu_matmul_bwd,
    .matmul_dw_align = mti_cpu_matmul_dw_align,
    .matmul_dw_rows = mti_cpu_matmul_dw_rows,
    .layernorm_fwd = nop_layernorm_fwd,
    .layernorm_bwd = nop_layernorm_bwd,
    .gelu_fwd = nop_unary,
    .gelu_bwd = nop_binary,
    .relu_fwd = nop_unary,
    .relu_bwd = nop_binary,
    .add = nop_binary,
    .accumulate = nop_accumulate,
    .attention_fwd = mti_cpu_attention_fwd,
    .attention_bwd = mti_cpu_attention_bwd,
    .xent = nop_xent,
    .unscale_check = nop_unscale_check,
    .sumsq = nop_sumsq,
    .sgd = nop_sgd,
    .adamw = nop_adamw,
    .adamw8 = nop_adamw8,
    .adafactor = nop_adafactor,
};

const mti_ops *mti_dry_ops(void) { return &dry_ops; }

/* ---- the dry run ---- */

typedef enum spec_kind { SPEC_SEQ, SPEC_MLP, SPEC_GPT } spec_kind;

/* The model's per-class live bytes now. */
static void class_live(mt_context *ctx, uint64_t *live)
{
    mt_memory_stats st;
    mt_context_memory_stats(ctx, &st);
    for (int c = 0; c < MT_MEM_COUNT; c++) live[c] = st.per_class[c].live_bytes;
}

static mt_status dry_model(mt_context *ctx, spec_kind kind, const void *spec, mt_model **m)
{
    switch (kind) {
    case SPEC_SEQ: return mt_model_create(ctx, spec, m);
    case SPEC_MLP: return mt_model_mlp_create(ctx, spec, m);
    case SPEC_GPT: return mt_model_gpt_create(ctx, spec, m);
    }
    return MT_ERR_INTERNAL;
}

/* One step of the largest batch: max_batch rows, zeros for inputs, tokens
 * and targets (valid for any model). */
static mt_status dry_steps(mt_trainer *t, const mt_model *m, const mt_trainer_config *tc, int steps)
{
    int n = tc->max_batch, T = m->input == MT_INPUT_TOKENS ? (tc->max_seq ? tc->max_seq : m->max_seq)
                                                             : 1;
    size_t rows = (size_t)n * (size_t)T;
    int32_t *ids = calloc(rows ? rows : 1, sizeof *ids);
    float *x = m->input == MT_INPUT_FEATURES ? calloc((size_t)n * m->features + 1, sizeof *x) : NULL;
    if (!ids || (m->input == MT_INPUT_FEATURES && !x)) {
        free(ids), free(x);
        return mti_fail(m->ctx, MT_ERR_OOM, "estimate: out of host memory");
    }
    mt_batch b = {.n = n, .targets = ids};
    if (m->input == MT_INPUT_TOKENS) b.tokens = ids, b.seq_len = T;
    else b.inputs = x;
    mt_status s = MT_OK;
    for (int i = 0; i < steps && !s; i++) s = mt_trainer_step(t, &b, NULL);
    free(ids), free(x);
    return s;
}

/* Makes the model and the trainer in a dry context and runs two steps. */
static mt_status dry_run(const mt_context_config *cc, spec_kind kind, const void *spec,
                         const mt_trainer_config *tc, mt_context *report_to,
                         mt_estimate_report *out)
{
    if (!spec || !tc || !out)
        return mti_fail(report_to, MT_ERR_INVALID_ARG, "estimate: %s is NULL",
                        !spec ? "the model spec" : !tc ? "the trainer config" : "out");
    memset(out, 0, sizeof *out);
    /* cc as it is: the allocators, their options and limits (the arena sizes
       its chunks by its limit, so a run that would pass a limit fails the
       estimate with MT_ERR_OOM, as it would fail for real) */
    mt_context *ctx = NULL;
    mt_status s = mti_context_create_dry(cc, report_to ? report_to->dev : NULL, &ctx);
    if (s) {
        char msg[MTI_ERR_LEN];
        snprintf(msg, sizeof msg, "%s", mt_last_error(NULL));
        return mti_fail(report_to, s, "estimate: %s", msg);
    }
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_memory_stats st;
    s = dry_model(ctx, kind, spec, &m);
    if (!s) s = mt_trainer_create(m, tc, &t);
    if (!s) {
        mt_context_memory_stats(ctx, &st);
        out->setup_peak = st.peak_live_bytes;
        out->peak = st.peak_live_bytes;
        memcpy(out->at_peak, ctx->at_peak, sizeof out->at_peak);
        for (int k = 0; k < MT_MEM_COUNT; k++) out->class_peak[k] = st.per_class[k].peak_live_bytes;
        out->peak_reserved = st.peak_reserved_bytes;
        out->between_steps = st.live_bytes;
        out->n_params = m->n_params;
        /* the steps' own peak from here */
        mt_context_reset_peaks(ctx);
        class_live(ctx, ctx->at_peak);
        s = dry_steps(t, m, tc, 2);
    }
    if (!s) {
        mt_context_memory_stats(ctx, &st);
        out->step_peak = st.peak_live_bytes;
        memcpy(out->step_at_peak, ctx->at_peak, sizeof out->step_at_peak);
        if (out->step_peak > out->peak) {
            out->peak = out->step_peak;
            memcpy(out->at_peak, out->step_at_peak, sizeof out->at_peak);
        }
        for (int k = 0; k < MT_MEM_COUNT; k++)
            if (st.per_class[k].peak_live_bytes > out->class_peak[k])
                out->class_peak[k] = st.per_class[k].peak_live_bytes;
        if (st.peak_reserved_bytes > out->peak_reserved)
            out->peak_reserved = st.peak_reserved_bytes;
    }
    char msg[MTI_ERR_LEN];
    if (s) snprintf(msg, sizeof msg, "%s", mt_last_error(ctx));
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    if (s) {
        memset(out, 0, sizeof *out);
        return mti_fail(report_to, s, "estimate: %s", msg);
    }
    return MT_OK;
}

mt_status mt_estimate(const mt_context_config *cc, const mt_model_spec *spec,
                      const mt_trainer_config *tc, mt_estimate_report *out)
{
    return dry_run(cc, SPEC_SEQ, spec, tc, NULL, out);
}

mt_status mt_estimate_mlp(const mt_context_config *cc, const mt_mlp_spec *spec,
                          const mt_trainer_config *tc, mt_estimate_report *out)
{
    return dry_run(cc, SPEC_MLP, spec, tc, NULL, out);
}

mt_status mt_estimate_gpt(const mt_context_config *cc, const mt_gpt_spec *spec,
                          const mt_trainer_config *tc, mt_estimate_report *out)
{
    return dry_run(cc, SPEC_GPT, spec, tc, NULL, out);
}

mt_status mt_estimate_model(const mt_model *m, const mt_trainer_config *tc,
                            mt_estimate_report *out)
{
    mt_status s = mti_estimate_model(m, tc, out);
    if (!s) mt_context_set_estimate(m->ctx, out);
    return s;
}

mt_status mti_estimate_model(const mt_model *m, const mt_trainer_config *tc,
                             mt_estimate_report *out)
{
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_estimate_model: m is NULL");
    mt_context_config cc = m->ctx->cfg;
    cc.threads = m->ctx->threads;
    cc.device = m->ctx->dev->kind; /* and dry_run takes the device's geometry */
    if (m->kind == MTI_MODEL_GPT) return dry_run(&cc, SPEC_GPT, &m->gpt, tc, m->ctx, out);
    if (m->kind == MTI_MODEL_MLP) return dry_run(&cc, SPEC_MLP, &m->mlp, tc, m->ctx, out);
    /* a built model: its layers, as a spec */
    mt_layer_spec *ls = calloc((size_t)m->n_layers, sizeof *ls);
    if (!ls) return mti_fail(m->ctx, MT_ERR_OOM, "mt_estimate_model: out of host memory");
    for (int i = 0; i < m->n_layers; i++) {
        const mti_layer *ly = &m->layers[i];
        ls[i] = (mt_layer_spec){.kind = ly->kind, .units = ly->out, .no_bias = !ly->bias,
                                .heads = ly->heads, .positions = ly->positions,
                                .stable = ly->stable};
    }
    mt_model_spec spec;
    mt_model_spec_init(&spec);
    spec.input = m->input;
    spec.features = m->features;
    spec.vocab = m->vocab;
    spec.padded_vocab = m->padded_vocab;
    spec.max_seq = m->max_seq;
    spec.n_layers = m->n_layers;
    spec.layers = ls;
    mt_status s = dry_run(&cc, SPEC_SEQ, &spec, tc, m->ctx, out);
    free(ls);
    return s;
}
