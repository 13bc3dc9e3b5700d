/*
 * estimate.c - what a training run will hold, per memory class, found
 * before the run without allocating anything.
 *
 * The estimate runs the real thing dry: a context with the caller's
 * allocator configuration is made over a device that has no memory behind
 * it (lib/device/device_dry.c: addresses come from a counter and are never
 * touched), with the device kind's own op table, whose ops see the dry
 * context and compute nothing; the ops that take workspace (the CPU
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
 * run dry (kernels/cuda/ops_cuda.c: workspace taken, nothing launched; every GEMM
 * takes the same fixed workspace whatever cuBLASLt would choose).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "comm/comm.h"
#include "ops/kernels.h"
#include "model/model.h"

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

/* A model's spec in *sp: its GPT or MLP spec, or its layers as a
 * sequential spec (layers in *ls, the caller's to free); deferred while
 * some of its weights are unmade. */
typedef union any_spec {
    mt_model_spec seq;
    mt_mlp_spec mlp;
    mt_gpt_spec gpt;
} any_spec;

static mt_status spec_of(const mt_model *m, spec_kind *kind, const void **spec,
                         any_spec *sp, mt_layer_spec **ls)
{
    *ls = NULL;
    const int deferred = mti_model_unmade(m) > 0;
    if (m->kind == MTI_MODEL_GPT) {
        sp->gpt = m->gpt;
        sp->gpt.deferred = deferred;
        return *kind = SPEC_GPT, *spec = &sp->gpt, MT_OK;
    }
    if (m->kind == MTI_MODEL_MLP) {
        sp->mlp = m->mlp;
        sp->mlp.deferred = deferred;
        return *kind = SPEC_MLP, *spec = &sp->mlp, MT_OK;
    }
    mt_model_spec *seq = &sp->seq;
    /* (a pipeline-parallel trainer's stage stands in for the model: the whole's layers) */
    const int L = m->pp ? m->pp->n_layers : m->n_layers;
    const mti_layer *layers = m->pp ? m->pp->layers : m->layers;
    mt_layer_spec *l = calloc((size_t)L, sizeof *l);
    if (!l) return mti_fail(m->ctx, MT_ERR_OOM, "estimate: out of host memory");
    for (int i = 0; i < L; i++) {
        const mti_layer *ly = &layers[i];
        l[i] = (mt_layer_spec){.kind = ly->kind, .units = ly->out, .no_bias = !ly->bias,
                               .heads = ly->heads, .positions = ly->positions,
                               .stable = ly->stable};
    }
    mt_model_spec_init(seq);
    seq->input = m->input;
    seq->features = m->features;
    seq->vocab = m->vocab;
    seq->padded_vocab = m->padded_vocab;
    seq->max_seq = m->max_seq;
    seq->n_layers = L;
    seq->layers = l;
    seq->deferred = deferred;
    *ls = l;
    *kind = SPEC_SEQ;
    *spec = seq;
    return MT_OK;
}

/* src's pruned weights pruned alike in m (a dry model of its shape): their
 * kept counts and formats. */
static mt_status dry_prune_like(mt_model *m, const mt_model *src)
{
    mt_status s = MT_OK;
    for (int i = 0; !s && src && i < src->n_param && i < m->n_param; i++) {
        const mti_psparse *sp = src->params[i].sp;
        if (sp) s = mti_param_prune(m, i, NULL, sp->L.nnz, sp->L.fmt, sp->L.n, sp->L.m, NULL, NULL);
    }
    return s;
}

/* A model of src's shape in the dry context (a teacher's stand-in). */
static mt_status dry_copy(mt_context *ctx, const mt_model *src, mt_model **out)
{
    spec_kind kind;
    const void *spec;
    any_spec seq;
    mt_layer_spec *ls = NULL;
    mt_status s = spec_of(src, &kind, &spec, &seq, &ls);
    if (!s) s = dry_model(ctx, kind, spec, out);
    free(ls);
    /* weights quantized after the model was made (a trainer's cfg.base
       quantized them while it was a student) */
    for (int i = 0; !s && i < src->n_param; i++)
        if (src->params[i].qf) s = mti_param_quantize(*out, i, src->params[i].qf);
    if (!s) s = dry_prune_like(*out, src); /* (a pruned teacher) */
    return s;
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
    for (int i = 0; i < steps && !s; i++) {
        /* Wanda's calibration before a prune due at this step, as a run
           makes it (its forwards' blocks shape the allocators' reserve) */
        int64_t at;
        int need = 0;
        s = mt_trainer_prune_next(t, &at, &need);
        for (; !s && at == (int64_t)mt_trainer_steps(t) && need > 0; need--)
            s = mt_trainer_calibrate(t, &b);
        if (!s) s = mt_trainer_step(t, &b, NULL);
    }
    free(ids), free(x);
    return s;
}

/* The figures per place so far (called after setup and after the steps,
 * keeping the higher): the device's are the classes' (already in out), the
 * others the context's own counts. */
static void place_figures(mt_context *ctx, mt_estimate_report *out)
{
    memcpy(out->place_class_peak[MT_PLACE_DEVICE], out->class_peak, sizeof out->class_peak);
    out->place_peak[MT_PLACE_DEVICE] = out->peak;
    for (int p = MT_PLACE_HOST; p < MT_PLACE_COUNT; p++) {
        for (int c = 0; c < MT_MEM_COUNT; c++)
            if (ctx->place_peak[p][c] > out->place_class_peak[p][c])
                out->place_class_peak[p][c] = ctx->place_peak[p][c];
        if (ctx->place_total_peak[p] > out->place_peak[p]) out->place_peak[p] = ctx->place_total_peak[p];
    }
}

/* Makes the model and the trainer in a dry context and runs two steps,
 * planning the communication thread where report_to has one; rank >= 0:
 * for that rank of report_to's world; src (or NULL): the model estimated,
 * whose pruned weights the dry model takes (their kept counts). */
static mt_status dry_run(const mt_context_config *cc, spec_kind kind, const void *spec,
                         const mt_trainer_config *tc, mt_context *report_to, int rank,
                         const mt_model *src, mt_estimate_report *out)
{
    if (!spec || !out)
        return mti_fail(report_to, MT_ERR_INVALID_ARG, "estimate: %s is NULL",
                        !spec ? "the model spec" : "out");
    mt_trainer_config defaults;
    if (!tc) { /* NULL: the defaults */
        mt_trainer_config_init(&defaults);
        tc = &defaults;
    }
    memset(out, 0, sizeof *out);
    /* cc as it is: the allocators, their options and limits (the arena sizes
       its chunks by its limit, so a run that would pass a limit fails the
       estimate with MT_ERR_OOM, as it would fail for real) */
    mt_context *ctx = NULL;
    mt_status s = mti_context_create_dry(cc, report_to ? report_to->dev : NULL, &ctx);
    if (s) {
        return mti_fail(report_to, s, "estimate: %s", mti_last_msg(NULL).s);
    }
    if (rank >= 0 && report_to) /* (nothing the context made depends on its rank) */
        ctx->rank = ctx->cfg.rank = rank;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_memory_stats st;
    mt_model *teacher = NULL;
    mt_trainer_config with_teacher;
    s = dry_model(ctx, kind, spec, &m);
    if (!s) s = dry_prune_like(m, src);
    if (!s && tc->teacher) { /* its stand-in, made after the student as a run makes it */
        s = dry_copy(ctx, tc->teacher, &teacher);
        with_teacher = *tc;
        with_teacher.teacher = teacher;
        tc = &with_teacher;
    }
    if (!s) s = mt_trainer_create(m, tc, &t);
    if (!s) {
        mt_context_memory_stats(ctx, &st);
        out->setup_peak = st.peak_live_bytes;
        out->peak = st.peak_live_bytes;
        memcpy(out->at_peak, ctx->at_peak, sizeof out->at_peak);
        for (int k = 0; k < MT_MEM_COUNT; k++) out->class_peak[k] = st.per_class[k].peak_live_bytes;
        out->peak_reserved = st.peak_reserved_bytes;
        out->between_steps = st.live_bytes;
        out->n_params = mt_model_num_params(m); /* (the whole model's, a stage's trainer or not) */
        place_figures(ctx, out);
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
        place_figures(ctx, out);
    }
    mti_msg msg = mti_last_msg(ctx);
    mt_trainer_destroy(t);
    mt_model_destroy(teacher);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    if (s) {
        memset(out, 0, sizeof *out);
        return mti_fail(report_to, s, "estimate: %s", msg.s);
    }
    return MT_OK;
}

mt_status mt_estimate(const mt_context_config *cc, const mt_model_spec *spec,
                      const mt_trainer_config *tc, mt_estimate_report *out)
{
    return dry_run(cc, SPEC_SEQ, spec, tc, NULL, -1, NULL, out);
}

mt_status mt_estimate_mlp(const mt_context_config *cc, const mt_mlp_spec *spec,
                          const mt_trainer_config *tc, mt_estimate_report *out)
{
    return dry_run(cc, SPEC_MLP, spec, tc, NULL, -1, NULL, out);
}

mt_status mt_estimate_gpt(const mt_context_config *cc, const mt_gpt_spec *spec,
                          const mt_trainer_config *tc, mt_estimate_report *out)
{
    return dry_run(cc, SPEC_GPT, spec, tc, NULL, -1, NULL, out);
}

mt_status mt_estimate_model(const mt_model *m, const mt_trainer_config *tc,
                            mt_estimate_report *out)
{
    mt_status s = mti_estimate_model(m, tc, -1, out);
    if (!s) mt_context_set_estimate(m->ctx, out);
    return s;
}

mt_status mti_estimate_model(const mt_model *m, const mt_trainer_config *tc, int rank,
                             mt_estimate_report *out)
{
    if (!m) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_estimate_model: m is NULL");
    mt_trainer_config with_lora;
    if (m->lora_rank && !(tc && tc->lora.rank)) { /* the model's adapters, made again */
        if (tc) with_lora = *tc;
        else mt_trainer_config_init(&with_lora);
        with_lora.lora = (mt_lora_config){.rank = m->lora_rank, .alpha = m->lora_alpha,
                                          .targets = m->lora_targets, .seed = m->lora_seed};
        tc = &with_lora;
    }
    mt_context_config cc = m->ctx->cfg;
    /* the world's communicator, also while a tensor-parallel trainer has
       narrowed the context's to its data-parallel group */
    cc.comm = mti_comm_world(m->ctx, NULL, NULL);
    cc.threads = m->ctx->threads;
    cc.device = m->ctx->dev->kind; /* and dry_run takes the device's geometry */
    spec_kind kind;
    const void *spec;
    any_spec seq;
    mt_layer_spec *ls = NULL;
    mt_status s = spec_of(m, &kind, &spec, &seq, &ls);
    if (!s) s = dry_run(&cc, kind, spec, tc, m->ctx, rank, m->pp ? NULL : m, out);
    free(ls);
    return s;
}
