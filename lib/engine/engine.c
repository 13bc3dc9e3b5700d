/*
 * engine.c - the layers' forward and backward, and the passes over a
 * model with activation recompute (see engine.h).
 *
 * Memory classes: boundaries and slots are ACT (lifetime STEP), except the
 * input and the logits (IO); the gradient flowing back and the gradients of
 * activations inside a block are WORK (lifetime PHASE); parameter
 * gradients GRAD (STEP). Everything is freed as soon as nothing needs it.
 *
 * A BLOCK's slots (N rows of width C, dt unless said):
 *   0 ln1 (N,C)   1 ln1 mean (N) fp32   2 ln1 rstd (N) fp32   3 qkv (N,3C)
 *   4 att out (N,C)   5 lse (B,H,T) fp32   6 res2 = x + attproj (N,C)
 *   7 ln2 (N,C)   8 ln2 mean   9 ln2 rstd   10 fc out (N,4C)   11 gelu (N,4C)
 * Selective saving keeps 1, 2, 3, 6, 8, 9, 10 and backward recomputes 0,
 * 4, 5, 7, 11 from them (LayerNorm from its input, attention from qkv,
 * GELU from the fc output): no GEMM is repeated.
 * Slots 12..15 hold (alpha / r) x A^T (N, r) of the LoRA adapters of qkv,
 * attproj, fc and fcproj (a LINEAR layer's: slot 12), kept by selective
 * saving too; see lora_fwd.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "comm/comm.h"


enum { LN1, LN1_MEAN, LN1_RSTD, QKV, ATT, LSE, RES2, LN2, LN2_MEAN, LN2_RSTD, FCH, GELU_OUT,
       LORA_QKV, LORA_ATTPROJ, LORA_FC, LORA_FCPROJ };
/* other layers' slots */
enum { S_MEAN = 0, S_RSTD = 1, S_EMB = 2 };

static const unsigned char sel_keep[MTI_SLOTS] = {[LN1_MEAN] = 1, [LN1_RSTD] = 1, [QKV] = 1,
                                                  [RES2] = 1,     [LN2_MEAN] = 1, [LN2_RSTD] = 1,
                                                  [FCH] = 1,      [LORA_QKV] = 1, [LORA_ATTPROJ] = 1,
                                                  [LORA_FC] = 1,  [LORA_FCPROJ] = 1};

/* ---- setup ---- */

/* The LoRA scale as a matrix: S = (alpha / r) I (r, r) in the compute
 * dtype (PARAM), so the scaling is a GEMM of the existing ops (x A^T S:
 * each element multiplied once, rounded once) and no op table needs a
 * kernel of its own. */
static mt_status lora_scale(mti_engine *E)
{
    mt_context *ctx = E->ctx;
    const int r = E->m->lora_rank;
    const float sc = E->m->lora_alpha / (float)r;
    E->lora_s = (mti_tensor){.dtype = E->dt, .ndim = 2, .shape = {r, r}};
    mt_status s = mti_tensor_alloc(ctx, &E->lora_s, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                   MTI_TAG_PARAM(MTI_TAG_TRAINER, 7));
    if (s || ctx->dry) return s;
    const size_t es = mti_dtype_size(E->dt);
    unsigned char *h = calloc((size_t)r * r, es);
    if (!h) return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    for (int i = 0; i < r; i++) {
        size_t at = ((size_t)i * r + i) * es;
        if (E->dt == MTI_F32) memcpy(h + at, &sc, 4);
        else {
            uint16_t v = E->dt == MTI_BF16 ? mti_f32_to_bf16(sc) : mti_f32_to_f16(sc);
            memcpy(h + at, &v, 2);
        }
    }
    s = ctx->dev->copy_h2d(ctx->dev, E->lora_s.blk.ptr, h, (size_t)r * r * es);
    if (!s) s = ctx->dev->sync(ctx->dev);
    free(h);
    return s;
}

mt_status mti_engine_init(mti_engine *E, mt_model *m, mti_dtype dt, const unsigned char *modes,
                          int seg_len)
{
    memset(E, 0, sizeof *E);
    E->m = m;
    E->ctx = m->ctx;
    E->k = (mti_kctx){m->ctx, m->ctx->dev};
    E->dt = dt;
    int L = m->n_layers;
    E->plan = calloc((size_t)L, 1);
    E->seg_start = calloc((size_t)L, sizeof *E->seg_start);
    E->kept = calloc((size_t)L + 1, 1);
    E->bnd = calloc((size_t)L + 1, sizeof *E->bnd);
    E->slot = calloc((size_t)L, sizeof *E->slot);
    E->have = calloc((size_t)L, 1);
    E->redone = calloc((size_t)L, 1);
    E->grad = calloc((size_t)m->n_param, sizeof *E->grad);
    E->fresh = calloc((size_t)m->n_param, 1);
    E->uses_left = calloc((size_t)m->n_param, sizeof *E->uses_left);
    E->sched = calloc((size_t)L * 3 + 1, sizeof *E->sched);
    E->sched_new = calloc((size_t)L * 3 + 1, sizeof *E->sched_new);
    E->sched_have = calloc((size_t)L + 1, 1);
    if (!E->plan || !E->seg_start || !E->kept || !E->bnd || !E->slot || !E->have || !E->redone ||
        !E->grad || !E->fresh || !E->uses_left || !E->sched || !E->sched_new || !E->sched_have) {
        mti_engine_free(E);
        return mti_fail(m->ctx, MT_ERR_OOM, "out of host memory");
    }
    if (seg_len < 1) seg_len = 1;
    /* A kept unit is a segment of its own; a run of recomputed units is cut
       into segments of seg_len units from its start. A segment's input
       boundary is kept through forward (a kept boundary). */
    int start = 0, run = 0;
    for (int i = 0; i < L; i++) {
        const mti_layer *ly = &m->layers[i];
        const unsigned char mode = modes[ly->unit];
        if (ly->unit_start) {
            if (mode != MT_UNIT_RECOMPUTE) run = 0, start = i;
            else if (run++ % seg_len == 0) start = i;
        }
        E->seg_start[i] = start;
        E->plan[i] = mode == MT_UNIT_RECOMPUTE ? MTI_SAVE_NONE
                     : mode == MT_UNIT_SELECTIVE ? MTI_SAVE_SEL
                                                 : MTI_SAVE_ALL;
        if (i == start) E->kept[i] = 1;
    }
    E->kept[0] = 1;
    return m->lora_rank ? lora_scale(E) : MT_OK;
}

void mti_engine_free(mti_engine *E)
{
    if (E->bnd && E->slot) mti_engine_release(E);
    if (E->grad) mti_engine_free_grads(E);
    free(E->plan);
    free(E->seg_start);
    free(E->kept);
    free(E->bnd);
    free(E->slot);
    free(E->have);
    free(E->redone);
    free(E->grad);
    free(E->fresh);
    free(E->uses_left);
    free(E->sched);
    free(E->sched_new);
    free(E->sched_have);
    mti_tensor_free(E->ctx, &E->lora_s);
    memset(E, 0, sizeof *E);
}

static void free_slots(mti_engine *E, int i)
{
    for (int j = 0; j < MTI_SLOTS; j++) mti_tensor_free(E->ctx, &E->slot[i][j]);
    E->have[i] = 0;
}

/* The schedule is over or replaced: what the hook brought in ahead goes. */
static void sched_drop(mti_engine *E)
{
    if (E->params_hook && E->n_sched) (void)E->params_hook(E->params_user, -1, 0, 0);
    E->n_sched = E->at = 0;
}

void mti_engine_release(mti_engine *E)
{
    mt_context *ctx = E->ctx;
    sched_drop(E);
    for (int i = 0; i < E->m->n_layers; i++) {
        free_slots(E, i);
        E->redone[i] = 0;
    }
    for (int i = 0; i <= E->m->n_layers; i++) mti_tensor_free(ctx, &E->bnd[i]);
    mti_tensor_free(ctx, &E->tokens);
    mti_tensor_free(ctx, &E->targets);
    mti_tensor_free(ctx, &E->losses);
    mti_tensor_free(ctx, &E->d);
    mti_tensor_free(ctx, &E->tied_dy);
    mti_tensor_free(ctx, &E->tied_x);
    E->tied_dy_ptr = E->tied_x_ptr = NULL;
}

mt_status mti_pass_init(mti_engine *E, mti_pass *p)
{
    const int L = E->m->n_layers;
    memset(p, 0, sizeof *p);
    p->bnd = calloc((size_t)L + 1, sizeof *p->bnd);
    p->slot = calloc((size_t)L, sizeof *p->slot);
    p->have = calloc((size_t)L, 1);
    p->redone = calloc((size_t)L, 1);
    if (p->bnd && p->slot && p->have && p->redone) return MT_OK;
    mti_pass_free(p);
    return mti_fail(E->ctx, MT_ERR_OOM, "out of host memory");
}

static void swap_bytes(void *a, void *b, size_t n)
{
    unsigned char t[sizeof(mti_tensor)];
    memcpy(t, a, n);
    memcpy(a, b, n);
    memcpy(b, t, n);
}
#define SWAP(a, b) swap_bytes(&(a), &(b), sizeof(a) + 0 * sizeof(char[sizeof(a) == sizeof(b) ? 1 : -1]))

void mti_pass_swap(mti_engine *E, mti_pass *p)
{
    SWAP(E->B, p->B);
    SWAP(E->T, p->T);
    SWAP(E->N, p->N);
    SWAP(E->NL, p->NL);
    SWAP(E->R0, p->R0);
    SWAP(E->head_fused, p->head_fused);
    SWAP(E->bnd, p->bnd);
    SWAP(E->slot, p->slot);
    SWAP(E->have, p->have);
    SWAP(E->redone, p->redone);
    SWAP(E->tokens, p->tokens);
    SWAP(E->targets, p->targets);
    SWAP(E->losses, p->losses);
    SWAP(E->d, p->d);
}

void mti_pass_free(mti_pass *p)
{
    free(p->bnd);
    free(p->slot);
    free(p->have);
    free(p->redone);
    memset(p, 0, sizeof *p);
}

void mti_engine_free_grads(mti_engine *E)
{
    for (int i = 0; i < E->m->n_param; i++) mti_tensor_free(E->ctx, &E->grad[i]);
}

/* Whether layer i has a parameter to train (the tied table counts for the
 * LM head). */
static bool trains(const mt_model *m, int i)
{
    const mti_layer *ly = &m->layers[i];
    for (int j = 0; j < ly->np; j++) {
        const mti_param *p = &m->params[ly->p0 + j];
        if (!p->frozen) return true;
        if (p->lora >= 0 && (!m->params[p->lora].frozen || !m->params[p->lora + 1].frozen))
            return true;
    }
    return ly->tied >= 0 && !m->params[ly->tied].frozen;
}

static int first_trained(const mt_model *m)
{
    int i = 0;
    while (i < m->n_layers - 1 && !trains(m, i)) i++;
    return i;
}

void mti_engine_arm(mti_engine *E)
{
    mt_model *m = E->m;
    for (int i = 0; i < m->n_param; i++) E->uses_left[i] = m->params[i].uses;
    /* (a stage's first layer passes the gradient of its input back) */
    E->train_from = E->stage_in ? 0 : first_trained(m);
}

/* The hook's calls of a backward whose layers hold what their backward
 * needs where have[] says (copied to h, which it changes), appended to
 * out from n: a layer without it has its segment recomputed first. */
static int sched_backward(const mti_engine *E, unsigned char *h, int *out, int n)
{
    for (int i = E->m->n_layers - 1; i >= first_trained(E->m); i--) {
        if (!h[i])
            for (int j = E->seg_start[i]; j <= i; j++) out[n++] = MTI_SCHED(j, 0), h[j] = 1;
        out[n++] = MTI_SCHED(i, 1);
    }
    return n;
}

mt_status (*mti_engine_grad_fill)(mt_context *ctx, int param, size_t at, float *g, size_t n);

/* A gradient just made, before its first contribution, when the test hook
 * is set: the hook's values, which backward then adds to. */
static mt_status grad_start(mti_engine *E, int i, size_t at, mti_tensor *g)
{
    if (mti_engine_grad_fill && !E->ctx->dry)
        return mti_engine_grad_fill(E->ctx, i, at, g->blk.ptr, (size_t)mti_tensor_numel(g));
    return mti_tensor_zero(E->ctx, g);
}

static bool grad_filled(const mti_engine *E) { return mti_engine_grad_fill && !E->ctx->dry; }

/* Parameter i's gradient, made if it is not there: uninitialised and
 * marked fresh, for an op that writes it whole (see wflags); with the test
 * hook, filled by it and not fresh. */
static mt_status grad_make(mti_engine *E, int i, mti_tensor **out)
{
    mti_tensor *g = &E->grad[i];
    if (!g->blk.ptr) {
        const mti_param *p = &E->m->params[i];
        *g = (mti_tensor){.dtype = MTI_F32, .ndim = p->ndim, .shape = {p->shape[0], p->shape[1]}};
        if (p->sp) *g = (mti_tensor){.dtype = MTI_F32, .ndim = 1, .shape = {(int64_t)p->numel}};
        mt_status s = mti_tensor_alloc(E->ctx, g, MT_MEM_GRAD, MT_LIFE_STEP, MTI_TAG_PARAM(MTI_TAG_GRAD, i));
        if (!s && grad_filled(E)) s = grad_start(E, i, 0, g);
        if (s) {
            mti_tensor_free(E->ctx, g);
            return s;
        }
        E->fresh[i] = !grad_filled(E);
    }
    *out = g;
    return MT_OK;
}

/* A fresh gradient (made, nothing written yet) becomes zeros. */
static mt_status unfresh(mti_engine *E, int i)
{
    if (!E->fresh[i]) return MT_OK;
    E->fresh[i] = 0;
    return mti_tensor_zero(E->ctx, &E->grad[i]);
}

mt_status mti_engine_grad(mti_engine *E, int i, mti_tensor **out)
{
    mt_status s = grad_make(E, i, out);
    return s ? s : unfresh(E, i);
}

/* ---- tensors of a pass ---- */

static mt_status act(mti_engine *E, mti_tensor *t, mti_dtype dt, int64_t rows, int64_t cols,
                     mt_mem_class c, mt_lifetime life, uint64_t tag)
{
    *t = (mti_tensor){.dtype = dt, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
    return mti_tensor_alloc(E->ctx, t, c, life, tag);
}

static void *P(mti_engine *E, int param) { return E->m->params[param].w.blk.ptr; }

/* ---- tensor parallel (model.h, mti_tp): this rank's share of a block's
   widths, the row-parallel bias, the group's sums ---- */

static int tp_size(const mti_engine *E) { return E->m->tp ? E->m->tp->size : 1; }

/* A row-parallel linear's bias: added by the group's first rank alone,
 * before the sum. */
static void *tp_bias(mti_engine *E, int param)
{
    return E->m->tp && E->m->tp->rank ? NULL : P(E, param);
}

/* The logits' columns on this rank (an LM head's vocabulary share). */
static int out_cols(const mti_engine *E, const mti_layer *ly)
{
    return ly->kind == MT_LAYER_LM_HEAD && E->m->tp ? E->m->tp->v1 - E->m->tp->v0 : ly->out;
}

/* buf (n values in dt) summed over the tensor group, in place: in fp32
 * (a 16-bit dtype through an fp32 WORK copy, rounded to nearest once). */
static mt_status tp_sum(mti_engine *E, void *buf, size_t n, uint64_t tag)
{
    const mti_tp *tp = E->m->tp;
    mt_context *ctx = E->ctx;
    if (!tp || tp->size < 2) return MT_OK;
    const char *what = "tensor parallel: the sum of a layer's partial outputs";
    if (E->dt == MTI_F32)
        return ctx->dry ? MT_OK
                        : mti_comm_group_all_reduce(ctx, tp->comm, what, buf, buf, n, MT_COMM_F32,
                                                    MT_COMM_SUM);
    mti_tensor f;
    mt_status s = act(E, &f, MTI_F32, (int64_t)n, 0, MT_MEM_WORK, MT_LIFE_PHASE, tag);
    if (!s) s = ctx->ops->cast(&E->k, f.blk.ptr, MTI_F32, buf, E->dt, n, MTI_ROUND_NEAREST, 0);
    if (!s && !ctx->dry)
        s = mti_comm_group_all_reduce(ctx, tp->comm, what, f.blk.ptr, f.blk.ptr, n, MT_COMM_F32,
                                      MT_COMM_SUM);
    if (!s) s = ctx->ops->cast(&E->k, buf, E->dt, f.blk.ptr, MTI_F32, n, MTI_ROUND_NEAREST, 0);
    mti_tensor_free(ctx, &f);
    return s;
}

/* The gradient of a parameter (made on its first contribution, fresh), or
 * NULL for a frozen one: the ops then skip that weight gradient. The op
 * that gets it takes wflags' flag for it, or it is zeroed (zgradp). */
static mt_status gradp(mti_engine *E, int param, float **out)
{
    mti_tensor *g;
    if (E->m->params[param].frozen) {
        *out = NULL;
        return MT_OK;
    }
    mt_status s = grad_make(E, param, &g);
    if (!s) *out = g->blk.ptr;
    return s;
}

/* gradp for an op that adds to part of a gradient (an embedding table's
 * scattered rows): a fresh one is zeroed first. */
static mt_status zgradp(mti_engine *E, int param, float **out)
{
    mt_status s = gradp(E, param, out);
    return s || !*out ? s : unfresh(E, param);
}

/* The flag of an op making the gradients ga and gb (of parameters a and b;
 * either pointer NULL when the op does not make it) whole:
 * MTI_BWD_SET_DW when every one it makes is fresh (its first contribution
 * of the step writes it), else 0, after zeroing a fresh one that goes
 * beside one holding earlier contributions. Either way they are then no
 * longer fresh. */
static mt_status wflags(mti_engine *E, int a, const float *ga, int b, const float *gb, int *flag)
{
    const bool fa = ga && E->fresh[a], fb = gb && E->fresh[b];
    *flag = 0;
    if ((fa || !ga) && (fb || !gb) && (ga || gb)) {
        if (ga) E->fresh[a] = 0;
        if (gb) E->fresh[b] = 0;
        *flag = MTI_BWD_SET_DW;
        return MT_OK;
    }
    mt_status s = fa ? unfresh(E, a) : MT_OK;
    return s || !fb ? s : unfresh(E, b);
}

/* ---- a linear map's weight: dense, or quantized (lib/quant/quant.h) ---- */

/* A pruned W (lib/sparse/sparse.h) brought in dense for a GEMM: its kept
 * values expanded into *d (WORK, in its dtype), freed by the caller. */
static mt_status sparse_in(mti_engine *E, int wi, mti_tensor *d)
{
    const mti_param *w = &E->m->params[wi];
    mt_status s = act(E, d, w->w.dtype, (int64_t)w->sp->L.dense, 0, MT_MEM_WORK, MT_LIFE_PHASE,
                      MTI_TAG_PARAM(MTI_TAG_WEIGHT, wi));
    if (!s)
        s = E->ctx->ops->sparse_expand(&E->k, d->blk.ptr, w->w.blk.ptr, w->sp->meta.blk.ptr,
                                       &w->sp->L, 0, w->sp->L.dense, w->w.dtype);
    if (s) mti_tensor_free(E->ctx, d);
    return s;
}

/* Whether the GEMMs of the pruned W parameter wi run from its kept values
 * (the op table's sparse GEMMs) rather than on its dense tile. */
static bool sparse_direct(const mti_engine *E, int wi, int in, int out)
{
    const mti_param *w = &E->m->params[wi];
    if (E->sp_kernel == MT_SPARSE_KERNEL_DENSE || E->grow || w->w.dtype != E->dt) return false;
    const int c = E->ctx->ops->sparse_matmul_choice(&E->k, &w->sp->L, E->N, in, out, E->dt);
    return c == MTI_SPMM_FASTER || (c == MTI_SPMM_SLOWER && E->sp_kernel == MT_SPARSE_KERNEL_SPARSE);
}

/* y (N, out) = x W^T + b with W parameter wi: a quantized W through the
 * dequantizing GEMM, a pruned one through the sparse GEMMs or its dense
 * form. */
static mt_status lin_fwd(mti_engine *E, int wi, void *y, const void *x, const void *b, int in,
                         int out)
{
    const mti_param *w = &E->m->params[wi];
    const mti_ops *op = E->ctx->ops;
    if (E->calib && !E->ctx->dry) {
        mt_status s = E->calib(E->calib_user, wi, x, E->N, in, E->dt);
        if (s) return s;
    }
    if (w->qf) return op->matmul_fwd_q(&E->k, y, x, w->w.blk.ptr, w->qf, b, E->N, in, out, E->dt);
    if (w->sp && sparse_direct(E, wi, in, out))
        return op->sparse_matmul_fwd(&E->k, y, x, w->w.blk.ptr, w->sp->meta.blk.ptr, &w->sp->L, b,
                                     E->N, in, out, E->dt);
    if (w->sp) {
        mti_tensor d;
        mt_status s = sparse_in(E, wi, &d);
        if (!s) s = op->matmul_fwd(&E->k, y, x, d.blk.ptr, b, E->N, in, out, E->dt);
        mti_tensor_free(E->ctx, &d);
        return s;
    }
    return op->matmul_fwd(&E->k, y, x, w->w.blk.ptr, b, E->N, in, out, E->dt);
}

/* Sequence parallel (mti_tp.sp): outside the blocks' split GEMMs, the
 * residual stream, the LayerNorms and the sums hold this rank's rows of
 * the micro-batch alone, rows [R0, R0 + NL) of N. A GEMM over every row
 * gathers its input's rows first (all_rows); a row-parallel linear's
 * partial outputs are reduce-scattered into this rank's rows rather than
 * summed whole (row_par), and a column-parallel one's partial input
 * gradients likewise (col_dx). */
static bool sp_on(const mti_engine *E) { return E->m->tp && E->m->tp->sp; }

static int rows_here(const mti_engine *E) { return sp_on(E) ? E->NL : E->N; }

/* local's (NL, cols) rows of every rank gathered into full (N, cols) WORK (in
 * dt: bytes) */
static mt_status sp_gather(mti_engine *E, const void *local, int cols, mti_tensor *full,
                           uint64_t tag)
{
    mt_context *ctx = E->ctx;
    mt_status s = act(E, full, E->dt, E->N, cols, MT_MEM_WORK, MT_LIFE_PHASE, tag);
    if (s || ctx->dry) return s;
    const size_t bytes = (size_t)E->NL * (size_t)cols * mti_dtype_size(E->dt);
    s = mti_comm_group_all_gather(ctx, E->m->tp->comm,
                                            "sequence parallel: the all-gather of a layer's rows",
                                            local, full->blk.ptr, bytes, MT_COMM_BYTE);
    if (s) mti_tensor_free(ctx, full);
    return s;
}

/* The input of a GEMM over every row: local itself, or its rows gathered
 * into *full (the caller frees it). */
static mt_status all_rows(mti_engine *E, const void *local, int cols, mti_tensor *full,
                          const void **out, uint64_t tag)
{
    *out = local;
    if (!sp_on(E)) return MT_OK;
    mt_status s = sp_gather(E, local, cols, full, tag);
    if (!s) *out = full->blk.ptr;
    return s;
}

/* local (NL, cols) in dt = this rank's rows of full (N, cols) summed over
 * the group, in fp32 (a 16-bit dtype through fp32 WORK copies). */
static mt_status sp_scatter(mti_engine *E, const void *full, void *local, int cols, uint64_t tag)
{
    mt_context *ctx = E->ctx;
    const mti_tp *tp = E->m->tp;
    const size_t nl = (size_t)E->NL * (size_t)cols, n = (size_t)E->N * (size_t)cols;
    const char *what = "sequence parallel: the reduce-scatter of a layer's partial outputs";
    if (E->dt == MTI_F32)
        return ctx->dry ? MT_OK
                        : mti_comm_group_reduce_scatter(ctx, tp->comm, what, full, local, nl,
                                                        MT_COMM_F32, MT_COMM_SUM);
    mti_tensor f = {0}, g = {0};
    mt_status s = act(E, &f, MTI_F32, (int64_t)n, 0, MT_MEM_WORK, MT_LIFE_PHASE, tag);
    if (!s) s = act(E, &g, MTI_F32, (int64_t)nl, 0, MT_MEM_WORK, MT_LIFE_PHASE, tag + 1);
    if (!s) s = ctx->ops->cast(&E->k, f.blk.ptr, MTI_F32, full, E->dt, n, MTI_ROUND_NEAREST, 0);
    if (!s && !ctx->dry)
        s = mti_comm_group_reduce_scatter(ctx, tp->comm, what, f.blk.ptr, g.blk.ptr, nl,
                                          MT_COMM_F32, MT_COMM_SUM);
    if (!s) s = ctx->ops->cast(&E->k, local, E->dt, g.blk.ptr, MTI_F32, nl, MTI_ROUND_NEAREST, 0);
    mti_tensor_free(ctx, &g);
    mti_tensor_free(ctx, &f);
    return s;
}

/* A row-parallel linear (its bias param wi + 1): y (rows_here, out) = x
 * W^T + b over the group: summed in place, or made whole in WORK and
 * reduce-scattered into this rank's rows. */
static mt_status row_par(mti_engine *E, int wi, void *y, const void *x, int in, int out,
                         uint64_t tag)
{
    void *b = tp_bias(E, wi + 1);
    mt_status s;
    if (!sp_on(E)) {
        MTI_TRY(lin_fwd(E, wi, y, x, b, in, out));
        return tp_sum(E, y, (size_t)E->N * (size_t)out, tag);
    }
    mti_tensor f;
    MTI_TRY(act(E, &f, E->dt, E->N, out, MT_MEM_WORK, MT_LIFE_PHASE, tag));
    s = lin_fwd(E, wi, f.blk.ptr, x, b, in, out);
    if (!s) s = sp_scatter(E, f.blk.ptr, y, out, tag + 1);
    mti_tensor_free(E->ctx, &f);
    return s;
}

/* A column-parallel linear's partial input gradient full (N, cols) over
 * the group: summed in place (*dx is full), or reduce-scattered into this
 * rank's rows (*dx made, NL rows, WORK). */
static mt_status col_dx(mti_engine *E, void *full, int cols, mti_tensor *local, void **dx,
                        uint64_t tag)
{
    mt_status s;
    if (!sp_on(E)) {
        *dx = full;
        return tp_sum(E, full, (size_t)E->N * (size_t)cols, tag);
    }
    MTI_TRY(act(E, local, E->dt, E->NL, cols, MT_MEM_WORK, MT_LIFE_PHASE, tag));
    *dx = local->blk.ptr;
    return sp_scatter(E, full, local->blk.ptr, cols, tag + 1);
}

/* embedding_fwd of the token table parameter ti into out: a quantized
 * table through embedding_fwd_q (its rows dequantized as they are read). */
static mt_status emb_fwd(mti_engine *E, int ti, void *out, const void *wpe, int C)
{
    const mti_param *w = &E->m->params[ti];
    const mti_ops *op = E->ctx->ops;
    const mti_tp *tp = E->m->tp;
    if (tp) { /* this rank's rows of the table, summed over the group, then the positions */
        mti_tensor f = {0};
        void *all = out; /* (sequence parallel: every row, then this rank's) */
        mt_status s = sp_on(E) ? act(E, &f, E->dt, E->N, C, MT_MEM_WORK, MT_LIFE_PHASE,
                                     MTI_TAG(1, 209))
                               : MT_OK;
        if (f.blk.ptr) all = f.blk.ptr;
        if (!s)
            s = op->embedding_fwd_rows(&E->k, all, E->tokens.blk.ptr, w->w.blk.ptr, tp->v0, tp->v1,
                                       E->B, E->T, C, E->dt);
        if (!s && f.blk.ptr) s = sp_scatter(E, all, out, C, MTI_TAG(1, 210));
        else if (!s) s = tp_sum(E, out, (size_t)E->N * (size_t)C, MTI_TAG(1, 210));
        mti_tensor_free(E->ctx, &f);
        /* the positions of rows [R0, R0 + NL), a sequence's run at a time */
        const size_t es = mti_dtype_size(E->dt);
        for (int r = E->R0; wpe && r < E->R0 + E->NL && !s;) {
            const int t = r % E->T, n = E->T - t < E->R0 + E->NL - r ? E->T - t : E->R0 + E->NL - r;
            s = op->accumulate(&E->k, (char *)out + (size_t)(r - E->R0) * C * es,
                               (const char *)wpe + (size_t)t * C * es, (size_t)n * C, E->dt);
            r += n;
        }
        return s;
    }
    if (w->qf)
        return op->embedding_fwd_q(&E->k, out, E->tokens.blk.ptr, w->w.blk.ptr, w->qf,
                                   (int)w->shape[0], wpe, E->B, E->T, C, E->dt);
    return op->embedding_fwd(&E->k, out, E->tokens.blk.ptr, w->w.blk.ptr, wpe, E->B, E->T, C,
                             E->dt);
}

/* matmul_bwd of a pruned W (parameter wi): the sparse GEMMs, or the GEMMs
 * on its dense form, the weight gradient made dense (WORK, fp32) and its
 * kept elements written into gw (set: its first contribution) or added to
 * it; the pruned ones' gradient is never kept. */
static mt_status sparse_bwd(mti_engine *E, int wi, void *dx, float *gw, float *gb, const void *dy,
                            const void *x, int in, int out, int accumulate, int set)
{
    const mti_param *w = &E->m->params[wi];
    const mti_ops *op = E->ctx->ops;
    if (sparse_direct(E, wi, in, out))
        return op->sparse_matmul_bwd(&E->k, dx, gw, gb, dy, x, w->w.blk.ptr, w->sp->meta.blk.ptr,
                                     &w->sp->L, E->N, in, out, E->dt, accumulate | set);
    mti_tensor d = {0}, g = {0};
    mt_status s = dx ? sparse_in(E, wi, &d) : MT_OK;
    if (!s && gw)
        s = act(E, &g, MTI_F32, (int64_t)w->sp->L.dense, 0, MT_MEM_WORK, MT_LIFE_PHASE,
                MTI_TAG_PARAM(MTI_TAG_GRAD, wi));
    /* the dense gradient is written whole: where the bias's accumulates,
       it starts from zeros */
    if (!s && gw && gb && !set) s = mti_tensor_zero(E->ctx, &g);
    if (!s)
        s = op->matmul_bwd(&E->k, dx, g.blk.ptr, gb, dy, x, d.blk.ptr, E->N, in, out, E->dt,
                           accumulate | (gw && !gb ? MTI_BWD_SET_DW : set));
    if (!s && gw && E->grow && !E->ctx->dry) s = E->grow(E->grow_user, wi, g.blk.ptr, w->sp->L.dense);
    if (!s && gw)
        s = op->sparse_compress(&E->k, gw, g.blk.ptr, w->sp->meta.blk.ptr, &w->sp->L, 0,
                                w->sp->L.dense, MTI_F32, !set);
    mti_tensor_free(E->ctx, &g);
    mti_tensor_free(E->ctx, &d);
    return s;
}

/* matmul_bwd with W parameter wi (gw its gradient, gb its bias's, wi + 1,
 * either NULL when not wanted). A quantized W is frozen (gw NULL): db from
 * dy, then dx through the dequantizing GEMM. */
static mt_status lin_bwd(mti_engine *E, int wi, void *dx, float *gw, float *gb, const void *dy,
                         const void *x, int in, int out, int accumulate)
{
    const mti_param *w = &E->m->params[wi];
    const mti_ops *op = E->ctx->ops;
    int set;
    mt_status s = wflags(E, wi, gw, wi + 1, gb, &set);
    if (s) return s;
    if (w->sp) return sparse_bwd(E, wi, dx, gw, gb, dy, x, in, out, accumulate, set);
    if (!w->qf)
        return op->matmul_bwd(&E->k, dx, gw, gb, dy, x, w->w.blk.ptr, E->N, in, out, E->dt,
                              accumulate | set);
    s = gb ? op->matmul_bwd(&E->k, NULL, NULL, gb, dy, x, NULL, E->N, in, out, E->dt,
                                      set)
                     : MT_OK;
    if (!s && dx)
        s = op->matmul_dx_q(&E->k, dx, dy, w->w.blk.ptr, w->qf, E->N, in, out, E->dt, accumulate);
    return s;
}

/* ---- LoRA: y += (alpha / r) (x A^T) B for an adapted weight ---- */

/* Weight wi's adapter on the output y (N, out) of x (N, in): u = x A^T
 * (WORK), u' = u S (slot `keep`, ACT, (N, r): what backward needs of the
 * adapter besides x), y += u' B (the input-gradient GEMM, accumulating).
 * With save 0, u' goes at once. Nothing for a weight without one. */
static mt_status lora_fwd(mti_engine *E, int wi, void *y, const void *x, int in, int out,
                          mti_tensor *keep, bool save, uint64_t tag)
{
    const mti_param *w = &E->m->params[wi];
    if (w->lora < 0) return MT_OK;
    const mti_ops *op = E->ctx->ops;
    const mti_kctx *k = &E->k;
    const int N = E->N, r = E->m->lora_rank;
    mti_tensor u = {0};
    mt_status s = act(E, &u, E->dt, N, r, MT_MEM_WORK, MT_LIFE_PHASE, tag + 1);
    if (!s) s = op->matmul_fwd(k, u.blk.ptr, x, P(E, w->lora), NULL, N, in, r, E->dt);
    if (!s) s = act(E, keep, E->dt, N, r, MT_MEM_ACT, MT_LIFE_STEP, tag);
    if (!s) s = op->matmul_fwd(k, keep->blk.ptr, u.blk.ptr, E->lora_s.blk.ptr, NULL, N, r, r, E->dt);
    mti_tensor_free(E->ctx, &u);
    if (!s) s = op->matmul_bwd(k, y, NULL, NULL, keep->blk.ptr, NULL, P(E, w->lora + 1), N, out, r,
                               E->dt, 1);
    if (s || !save) mti_tensor_free(E->ctx, keep);
    return s;
}

/* Backward of lora_fwd, from dy (N, out): dB += u'^T dy, du' = dy B^T,
 * du = du' S, dA += du^T x and, with dx, dx += du A (after the weight's own
 * dx). */
static mt_status lora_bwd(mti_engine *E, int wi, void *dx, const void *dy, const void *x, int in,
                          int out, const mti_tensor *u1, uint64_t tag)
{
    const mti_param *w = &E->m->params[wi];
    if (w->lora < 0) return MT_OK;
    const mti_ops *op = E->ctx->ops;
    const mti_kctx *k = &E->k;
    const int N = E->N, r = E->m->lora_rank, a = w->lora;
    float *ga, *gb;
    int seta, setb;
    mt_status s;
    MTI_TRY(gradp(E, a, &ga));
    MTI_TRY(gradp(E, a + 1, &gb));
    if (!ga && !gb && !dx) return MT_OK;
    MTI_TRY(wflags(E, a, ga, -1, NULL, &seta));
    MTI_TRY(wflags(E, a + 1, gb, -1, NULL, &setb));
    mti_tensor d1 = {0}, d0 = {0};
    s = act(E, &d1, E->dt, N, r, MT_MEM_WORK, MT_LIFE_PHASE, tag + 2);
    if (!s && gb)
        s = op->matmul_bwd(k, NULL, gb, NULL, u1->blk.ptr, dy, NULL, N, out, r, E->dt, setb);
    if (!s) s = op->matmul_fwd(k, d1.blk.ptr, dy, P(E, a + 1), NULL, N, out, r, E->dt);
    if (!s) s = act(E, &d0, E->dt, N, r, MT_MEM_WORK, MT_LIFE_PHASE, tag + 3);
    if (!s) s = op->matmul_fwd(k, d0.blk.ptr, d1.blk.ptr, E->lora_s.blk.ptr, NULL, N, r, r, E->dt);
    mti_tensor_free(E->ctx, &d1);
    if (!s)
        s = op->matmul_bwd(k, dx, ga, NULL, d0.blk.ptr, x, P(E, a), N, in, r, E->dt,
                           MTI_BWD_ACC_DX | seta);
    mti_tensor_free(E->ctx, &d0);
    return s;
}

/* ---- forward of one layer ---- */

static mt_status block_fwd(mti_engine *E, int i, mti_save save)
{
    const mti_layer *ly = &E->m->layers[i];
    const mti_ops *op = E->ctx->ops;
    const mti_kctx *k = &E->k;
    const int N = E->N, C = ly->in, p = ly->p0;
    const int Cl = C / tp_size(E), H = ly->heads / tp_size(E); /* this rank's heads */
    const int NL = rows_here(E); /* the residual stream's rows */
    const mti_dtype dt = E->dt;
    mti_tensor *sl = E->slot[i];
    const void *x = E->bnd[i].blk.ptr;
    const uint64_t nd = (uint64_t)i + 2;
    mti_tensor g = {0};
    const void *in;
    mt_status s;
#define KEEP(j) (save == MTI_SAVE_ALL || (save == MTI_SAVE_SEL && sel_keep[j]))
#define DROP(j)                                                                                \
    do {                                                                                       \
        if (!KEEP(j)) mti_tensor_free(E->ctx, &sl[j]);                                         \
    } while (0)
    MTI_TRY(act(E, &sl[LN1], dt, NL, C, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, LN1)));
    if (save != MTI_SAVE_NONE) {
        MTI_TRY(act(E, &sl[LN1_MEAN], MTI_F32, NL, 0, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, LN1_MEAN)));
        MTI_TRY(act(E, &sl[LN1_RSTD], MTI_F32, NL, 0, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, LN1_RSTD)));
    }
    MTI_TRY(op->layernorm_fwd(k, sl[LN1].blk.ptr, sl[LN1_MEAN].blk.ptr, sl[LN1_RSTD].blk.ptr, x,
                          P(E, p + 0), P(E, p + 1), NL, C, dt));
    MTI_TRY(act(E, &sl[QKV], dt, N, 3 * Cl, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, QKV)));
    MTI_TRY(all_rows(E, sl[LN1].blk.ptr, C, &g, &in, MTI_TAG(nd, 215)));
    s = lin_fwd(E, p + 2, sl[QKV].blk.ptr, in, P(E, p + 3), C, 3 * Cl);
    mti_tensor_free(E->ctx, &g);
    MTI_TRY(s);
    MTI_TRY(lora_fwd(E, p + 2, sl[QKV].blk.ptr, sl[LN1].blk.ptr, C, 3 * C, &sl[LORA_QKV],
                     KEEP(LORA_QKV), MTI_TAG(nd, LORA_QKV)));
    DROP(LN1);
    MTI_TRY(act(E, &sl[ATT], dt, N, Cl, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, ATT)));
    MTI_TRY(act(E, &sl[LSE], MTI_F32, (int64_t)E->B * H * E->T, 0, MT_MEM_ACT, MT_LIFE_STEP,
            MTI_TAG(nd, LSE)));
    MTI_TRY(op->attention_fwd(k, sl[ATT].blk.ptr, sl[LSE].blk.ptr, sl[QKV].blk.ptr, E->B, E->T, Cl, H,
                          dt));
    DROP(QKV);
    DROP(LSE);
    MTI_TRY(act(E, &sl[RES2], dt, NL, C, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, RES2)));
    MTI_TRY(row_par(E, p + 4, sl[RES2].blk.ptr, sl[ATT].blk.ptr, Cl, C, MTI_TAG(nd, 210)));
    MTI_TRY(lora_fwd(E, p + 4, sl[RES2].blk.ptr, sl[ATT].blk.ptr, C, C, &sl[LORA_ATTPROJ],
                     KEEP(LORA_ATTPROJ), MTI_TAG(nd, LORA_ATTPROJ)));
    DROP(ATT);
    MTI_TRY(op->add(k, sl[RES2].blk.ptr, sl[RES2].blk.ptr, x, (size_t)NL * C, dt));
    MTI_TRY(act(E, &sl[LN2], dt, NL, C, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, LN2)));
    if (save != MTI_SAVE_NONE) {
        MTI_TRY(act(E, &sl[LN2_MEAN], MTI_F32, NL, 0, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, LN2_MEAN)));
        MTI_TRY(act(E, &sl[LN2_RSTD], MTI_F32, NL, 0, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, LN2_RSTD)));
    }
    MTI_TRY(op->layernorm_fwd(k, sl[LN2].blk.ptr, sl[LN2_MEAN].blk.ptr, sl[LN2_RSTD].blk.ptr,
                          sl[RES2].blk.ptr, P(E, p + 6), P(E, p + 7), NL, C, dt));
    MTI_TRY(act(E, &sl[FCH], dt, N, 4 * Cl, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, FCH)));
    MTI_TRY(all_rows(E, sl[LN2].blk.ptr, C, &g, &in, MTI_TAG(nd, 216)));
    s = lin_fwd(E, p + 8, sl[FCH].blk.ptr, in, P(E, p + 9), C, 4 * Cl);
    mti_tensor_free(E->ctx, &g);
    MTI_TRY(s);
    MTI_TRY(lora_fwd(E, p + 8, sl[FCH].blk.ptr, sl[LN2].blk.ptr, C, 4 * C, &sl[LORA_FC],
                     KEEP(LORA_FC), MTI_TAG(nd, LORA_FC)));
    DROP(LN2);
    MTI_TRY(act(E, &sl[GELU_OUT], dt, N, 4 * Cl, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, GELU_OUT)));
    MTI_TRY(op->gelu_fwd(k, sl[GELU_OUT].blk.ptr, sl[FCH].blk.ptr, (size_t)N * 4 * Cl, dt));
    DROP(FCH);
    mti_tensor *y = &E->bnd[i + 1];
    MTI_TRY(act(E, y, dt, NL, C, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, 100)));
    MTI_TRY(row_par(E, p + 10, y->blk.ptr, sl[GELU_OUT].blk.ptr, 4 * Cl, C, MTI_TAG(nd, 211)));
    MTI_TRY(lora_fwd(E, p + 10, y->blk.ptr, sl[GELU_OUT].blk.ptr, 4 * C, C, &sl[LORA_FCPROJ],
                     KEEP(LORA_FCPROJ), MTI_TAG(nd, LORA_FCPROJ)));
    DROP(GELU_OUT);
    MTI_TRY(op->add(k, y->blk.ptr, y->blk.ptr, sl[RES2].blk.ptr, (size_t)NL * C, dt));
    DROP(RES2);
#undef KEEP
#undef DROP
    return MT_OK;
}

/* Whether layer i's backward needs its output (boundary i+1). */
static bool needs_output(const mti_layer *ly) { return ly->kind == MT_LAYER_RELU; }

bool mti_engine_keeps_output(const mti_engine *E)
{
    return needs_output(&E->m->layers[E->m->n_layers - 1]);
}

static mt_status layer_fwd(mti_engine *E, int i, mti_save save)
{
    mt_model *m = E->m;
    const mti_layer *ly = &m->layers[i];
    const mti_ops *op = E->ctx->ops;
    const mti_kctx *k = &E->k;
    const int N = E->N;
    const mti_dtype dt = E->dt;
    const bool last = i == m->n_layers - 1;
    mti_tensor *x = &E->bnd[i], *y = &E->bnd[i + 1], *sl = E->slot[i];
    const mt_mem_class yc = last && !E->stage_out ? MT_MEM_IO : MT_MEM_ACT;
    const uint64_t nd = (uint64_t)i + 2;
    const size_t nout = (size_t)N * (size_t)ly->out;
    mt_status s;
    switch (ly->kind) {
    case MT_LAYER_LINEAR:
        MTI_TRY(act(E, y, dt, N, ly->out, yc, MT_LIFE_STEP, MTI_TAG(nd, 100)));
        MTI_TRY(lin_fwd(E, ly->p0, y->blk.ptr, x->blk.ptr, ly->bias ? P(E, ly->p0 + 1) : NULL, ly->in,
                        ly->out));
        MTI_TRY(lora_fwd(E, ly->p0, y->blk.ptr, x->blk.ptr, ly->in, ly->out, &sl[LORA_QKV],
                         save != MTI_SAVE_NONE, MTI_TAG(nd, LORA_QKV)));
        break;
    case MT_LAYER_RELU:
        if (!E->kept[i]) { /* in place: its backward needs only the output */
            *y = *x;
            memset(x, 0, sizeof *x);
        } else {
            MTI_TRY(act(E, y, dt, N, ly->out, yc, MT_LIFE_STEP, MTI_TAG(nd, 100)));
        }
        MTI_TRY(op->relu_fwd(k, y->blk.ptr, E->bnd[i].blk.ptr ? E->bnd[i].blk.ptr : y->blk.ptr, nout,
                         dt));
        break;
    case MT_LAYER_GELU:
        MTI_TRY(act(E, y, dt, N, ly->out, yc, MT_LIFE_STEP, MTI_TAG(nd, 100)));
        MTI_TRY(op->gelu_fwd(k, y->blk.ptr, x->blk.ptr, nout, dt));
        break;
    case MT_LAYER_LAYERNORM: { /* (sequence parallel: this rank's rows) */
        const int NL = rows_here(E);
        MTI_TRY(act(E, y, dt, NL, ly->out, yc, MT_LIFE_STEP, MTI_TAG(nd, 100)));
        if (save != MTI_SAVE_NONE) {
            MTI_TRY(act(E, &sl[S_MEAN], MTI_F32, NL, 0, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, S_MEAN)));
            MTI_TRY(act(E, &sl[S_RSTD], MTI_F32, NL, 0, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, S_RSTD)));
        }
        MTI_TRY(op->layernorm_fwd(k, y->blk.ptr, sl[S_MEAN].blk.ptr, sl[S_RSTD].blk.ptr, x->blk.ptr,
                              P(E, ly->p0), P(E, ly->p0 + 1), NL, ly->in, dt));
        break;
    }
    case MT_LAYER_EMBEDDING: {
        const int C = ly->out;
        const void *wpe = ly->positions ? P(E, ly->p0 + 1) : NULL;
        MTI_TRY(act(E, y, dt, rows_here(E), C, yc, MT_LIFE_STEP, MTI_TAG(nd, 100)));
        if (!ly->stable) {
            MTI_TRY(emb_fwd(E, ly->p0, y->blk.ptr, wpe, C));
            break;
        }
        int pl = ly->p0 + (ly->positions ? 2 : 1); /* the LayerNorm's weight */
        MTI_TRY(act(E, &sl[S_EMB], dt, N, C, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, S_EMB)));
        MTI_TRY(emb_fwd(E, ly->p0, sl[S_EMB].blk.ptr, NULL, C));
        if (save != MTI_SAVE_NONE) {
            MTI_TRY(act(E, &sl[S_MEAN], MTI_F32, N, 0, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, S_MEAN)));
            MTI_TRY(act(E, &sl[S_RSTD], MTI_F32, N, 0, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, S_RSTD)));
        }
        MTI_TRY(op->layernorm_fwd(k, y->blk.ptr, sl[S_MEAN].blk.ptr, sl[S_RSTD].blk.ptr,
                              sl[S_EMB].blk.ptr, P(E, pl), P(E, pl + 1), N, C, dt));
        if (save == MTI_SAVE_NONE) mti_tensor_free(E->ctx, &sl[S_EMB]);
        if (wpe) {
            size_t seq = (size_t)E->T * (size_t)C * mti_dtype_size(dt);
            for (int b = 0; b < E->B; b++)
                MTI_TRY(op->accumulate(k, (char *)y->blk.ptr + (size_t)b * seq, wpe,
                                   (size_t)E->T * (size_t)C, dt));
        }
        break;
    }
    case MT_LAYER_BLOCK: MTI_TRY(block_fwd(E, i, save)); break;
    case MT_LAYER_LM_HEAD:
        if (E->head_fused) break; /* the loss runs it (head_loss) */
        MTI_TRY(act(E, y, dt, N, out_cols(E, ly), yc, MT_LIFE_STEP, MTI_TAG(nd, 100)));
        mti_tensor g = {0};
        const void *in;
        MTI_TRY(all_rows(E, x->blk.ptr, ly->in, &g, &in, MTI_TAG(nd, 215)));
        s = lin_fwd(E, ly->tied, y->blk.ptr, in, NULL, ly->in, out_cols(E, ly));
        mti_tensor_free(E->ctx, &g);
        MTI_TRY(s);
        break;
    }
    E->have[i] = save != MTI_SAVE_NONE;
    return MT_OK;
}

/* ---- the passes ---- */

static mt_status upload_i32(mti_engine *E, mti_tensor *t, const int32_t *src, int64_t n,
                            uint64_t tag)
{
    mt_status s = act(E, t, MTI_I32, n, 0, MT_MEM_IO, MT_LIFE_STEP, tag);
    return s ? s : mti_tensor_upload(E->ctx, t, src, (size_t)n * sizeof *src);
}

static mt_status layer_bwd(mti_engine *E, int i, bool keep);

/* Layer i's forward or backward between its weights' in and out. */
static mt_status with_params(mti_engine *E, int i, int bwd, mti_save save, bool keep)
{
    if (!E->params_hook) return bwd ? layer_bwd(E, i, keep) : layer_fwd(E, i, save);
    if (E->at >= E->n_sched || E->sched[E->at] != MTI_SCHED(i, bwd)) {
        sched_drop(E); /* (not the call foreseen: this one alone) */
        E->sched[0] = MTI_SCHED(i, bwd);
        E->n_sched = 1;
    }
    mt_status s = E->params_hook(E->params_user, i, bwd, 1);
    if (!s) { /* (else the hook undid what it brought in for this call) */
        s = bwd ? layer_bwd(E, i, keep) : layer_fwd(E, i, save);
        (void)E->params_hook(E->params_user, i, bwd, 0);
    }
    E->at++;
    return s;
}

/* The schedule of a forward (eval: alone; else with the backward that
 * follows, predicted from the plan, as layer_fwd sets have[]). */
static void sched_forward(mti_engine *E, int eval)
{
    const int L = E->m->n_layers;
    if (!E->params_hook) return;
    sched_drop(E);
    for (int i = 0; i < L; i++) E->sched[i] = MTI_SCHED(i, 0);
    E->n_sched = L;
    if (eval) return;
    for (int i = 0; i < L; i++) E->sched_have[i] = E->plan[i] != MTI_SAVE_NONE;
    E->n_sched = sched_backward(E, E->sched_have, E->sched, L);
}

/* Runs layers [from, to) forward. The main forward uses the plan; the
 * recompute of a segment keeps everything. */
static mt_status run_forward(mti_engine *E, int from, int to, int recompute)
{
    mt_status s;
    for (int i = from; i < to; i++) {
        mti_save save = recompute ? MTI_SAVE_ALL : (mti_save)E->plan[i];
        MTI_TRY(with_params(E, i, 0, save, false));
        if (recompute) E->redone[i] = 1;
        /* with nothing saved, the input is needed again only if it is a kept boundary */
        if (save == MTI_SAVE_NONE && i > 0 && !E->kept[i]) mti_tensor_free(E->ctx, &E->bnd[i]);
    }
    return MT_OK;
}

mt_status mti_engine_forward(mti_engine *E, const mt_batch *b, int r0, int rows, int eval)
{
    mt_model *m = E->m;
    mt_context *ctx = E->ctx;
    const mti_kctx *k = &E->k;
    mt_status s;
    int T = m->input == MT_INPUT_TOKENS ? b->seq_len : 1;
    E->B = rows;
    E->T = T;
    E->N = rows * T;
    E->NL = E->N;
    E->R0 = 0;
    if (sp_on(E)) { /* this rank's rows of the residual stream */
        const mti_tp *tp = m->tp;
        if (E->N % tp->size)
            return mti_fail(ctx, MT_ERR_INVALID_ARG,
                            "sequence parallel: a micro-batch of %d rows of %d tokens is %d "
                            "rows, not a multiple of the tensor group's %d ranks",
                            rows, T, E->N, tp->size);
        E->NL = E->N / tp->size;
        E->R0 = tp->rank * E->NL;
    }
    E->head_fused = !eval && E->head_rows > 0 && !E->head_unfused && !E->params_hook && !E->stage_out;
    int64_t N = E->N;
    if (E->stage_in) { /* the input is the stage's before (the caller's, in bnd[0]) */
        if (!E->bnd[0].blk.ptr && !ctx->dry)
            return mti_fail(ctx, MT_ERR_INTERNAL, "pipeline stage: no input");
    } else if (m->input == MT_INPUT_TOKENS) {
        MTI_TRY(upload_i32(E, &E->tokens, b->tokens + (size_t)r0 * T, N, MTI_TAG(0, 0)));
    } else {
        mti_tensor *x = &E->bnd[0];
        size_t bytes = (size_t)N * (size_t)m->features * sizeof(float);
        MTI_TRY(act(E, x, MTI_F32, N, m->features, MT_MEM_IO, MT_LIFE_STEP, MTI_TAG(0, 0)));
        MTI_TRY(mti_tensor_upload(ctx, x, b->inputs + (size_t)r0 * m->features, bytes));
        if (E->dt != MTI_F32) { /* the inputs in the compute dtype */
            mti_tensor x32 = *x;
            s = act(E, x, E->dt, N, m->features, MT_MEM_IO, MT_LIFE_STEP, MTI_TAG(0, 2));
            if (!s)
                s = ctx->ops->cast(k, x->blk.ptr, E->dt, x32.blk.ptr, MTI_F32,
                                   (size_t)N * m->features, MTI_ROUND_NEAREST, 0);
            mti_tensor_free(ctx, &x32);
            if (s) return s;
        }
    }
    if (!E->stage_out) /* (the loss's, on the last stage) */
        MTI_TRY(upload_i32(E, &E->targets, b->targets + (size_t)r0 * T, N, MTI_TAG(0, 1)));
    sched_forward(E, eval);
    if (!eval) return run_forward(E, 0, m->n_layers, 0);
    /* eval: nothing is kept */
    for (int i = 0; i < m->n_layers; i++) {
        MTI_TRY(with_params(E, i, 0, MTI_SAVE_NONE, false));
        free_slots(E, i);
        if (i > 0) mti_tensor_free(ctx, &E->bnd[i]);
    }
    return MT_OK;
}

/* The rows of a block of the LM head (last layer h): a multiple of 8, so
 * every block's rows start 16-byte aligned; larger on a GPU, where each
 * block's pass over the whole head weight (a quantized one dequantized
 * again) costs more than the memory. */
static int head_block(const mti_engine *E, const mti_layer *h)
{
    const size_t block = mt_context_device(E->ctx) == MT_DEVICE_CUDA ? MTI_HEAD_BLOCK_GPU : MTI_HEAD_BLOCK;
    const size_t r = (block / ((size_t)h->out * mti_dtype_size(E->dt)) + 7) / 8 * 8;
    return r > (1 << 24) ? 1 << 24 : (int)r;
}

int mti_engine_head_rows(const mti_engine *E)
{
    const mt_model *m = E->m;
    const mti_layer *h = &m->layers[m->n_layers - 1];
    if (h->kind != MT_LAYER_LM_HEAD || m->tp) return 0;
    /* a trained head's weight gradient is made block by block with the
       loss, unless its dlogits wait for the embedding (defer_tied) or the
       model is a pipeline's stage (stage_in, stage_out: set first) */
    if (!m->params[h->tied].frozen && (E->defer_tied || E->stage_in || E->stage_out)) return 0;
    return head_block(E, h);
}

/* The LM head's weight gradient g (its W (out, in) the tied table; rows
 * [r0, r1) of it, r1 0: all) from dy (N, out) and x (N, in): summed over
 * blocks of the head's rows in order (head_rows, or the shape's block when
 * the head is not fused), the first block's written with flag set (0:
 * added), the others added. The head fused with the loss adds each
 * block's part as the loss makes it, in the same blocks, so the fused and
 * the unfused head make the same bits. */
static mt_status head_dw(mti_engine *E, float *g, const void *dy, const void *x, int in, int out,
                         int r0, int r1, int set)
{
    const mti_ops *op = E->ctx->ops;
    const int N = E->N, hb = E->head_rows > 0 ? E->head_rows : head_block(E, &E->m->layers[E->m->n_layers - 1]);
    const size_t es = mti_dtype_size(E->dt);
    mt_status s = MT_OK;
    for (int b0 = 0; (b0 == 0 || b0 < N) && !s; b0 += hb) { /* (no rows: one empty sum) */
        const int n = N - b0 < hb ? N - b0 : hb, fl = b0 == 0 ? set : 0;
        const void *dyb = (const char *)dy + (size_t)b0 * (size_t)out * es;
        const void *xb = (const char *)x + (size_t)b0 * (size_t)in * es;
        s = r1 ? op->matmul_dw_rows(&E->k, g, dyb, xb, n, in, out, r0, r1, E->dt, fl)
               : op->matmul_bwd(&E->k, NULL, g, NULL, dyb, xb, NULL, n, in, out, E->dt, fl);
    }
    return s;
}

/* The LM head fused with the loss (head_rows): per block of rows, the
 * logits (IO), the losses and dlogits in their place (xent, or xent_kd
 * against the teacher's logits tl, which has tw columns), the head's input
 * gradient of those rows into the last boundary and, for a trained head,
 * the block's part of its weight gradient added (the first block's
 * written when the gradient is fresh: wflags through lin_bwd), then the
 * block goes. */
static mt_status head_loss(mti_engine *E, const float *tl, int tw, float alpha, float temp,
                           float dloss)
{
    const mt_model *m = E->m;
    const int L = m->n_layers, N = E->N, C = m->layers[L - 1].in, W = m->out_width;
    const int wi = m->layers[L - 1].tied;
    const mti_ops *op = E->ctx->ops;
    const size_t es = mti_dtype_size(E->dt);
    const char *x = E->bnd[L - 1].blk.ptr;
    float *gw = NULL; /* a trained head's weight gradient: each block's part added (head_dw) */
    mt_status s = gradp(E, wi, &gw);
    if (!s) s = act(E, &E->bnd[L], E->dt, N, C, MT_MEM_IO, MT_LIFE_STEP, MTI_TAG(L + 1, 100));
    for (int r0 = 0; r0 < N && !s; r0 += E->head_rows) {
        const int n = N - r0 < E->head_rows ? N - r0 : E->head_rows;
        mti_tensor y;
        s = act(E, &y, E->dt, n, W, MT_MEM_IO, MT_LIFE_STEP, MTI_TAG(L + 1, 101));
        E->N = n; /* (lin_fwd and lin_bwd take their rows from it) */
        if (!s) s = lin_fwd(E, wi, y.blk.ptr, x + (size_t)r0 * C * es, NULL, C, W);
        if (!s && tl)
            s = op->xent_kd(&E->k, (float *)E->losses.blk.ptr + r0, y.blk.ptr, y.blk.ptr,
                            tl + (size_t)r0 * tw, (const int32_t *)E->targets.blk.ptr + r0, n,
                            m->classes, W, tw, alpha, temp, dloss, E->dt);
        else if (!s)
            s = op->xent(&E->k, (float *)E->losses.blk.ptr + r0, y.blk.ptr, y.blk.ptr,
                         (const int32_t *)E->targets.blk.ptr + r0, n, m->classes, W, dloss, E->dt);
        if (!s)
            s = lin_bwd(E, wi, (char *)E->bnd[L].blk.ptr + (size_t)r0 * C * es, gw, NULL,
                        y.blk.ptr, x + (size_t)r0 * C * es, C, W, 0);
        E->N = N;
        mti_tensor_free(E->ctx, &y);
    }
    return s;
}

/* The cross-entropy of logits split by vocabulary over the tensor group
 * (never gathered): each row's max over the group, then its sum of
 * exponentials and its target's logit, then the losses and dlogits in
 * place (the op's three phases; stats (3, N) fp32 WORK). */
static mt_status tp_loss(mti_engine *E, float dloss, int want_grad)
{
    mt_context *ctx = E->ctx;
    const mti_tp *tp = E->m->tp;
    const int N = E->N;
    void *logits = E->bnd[E->m->n_layers].blk.ptr;
    mti_tensor st;
    mt_status s = act(E, &st, MTI_F32, 3 * (int64_t)N, 0, MT_MEM_WORK, MT_LIFE_PHASE, MTI_TAG(0, 4));
    float *f = st.blk.ptr;
    const char *what = "tensor parallel: the cross-entropy's sums over the vocabulary";
    for (int phase = 0; phase < 3 && !s; phase++) {
        s = ctx->ops->xent_vp(&E->k, phase, f, E->losses.blk.ptr, want_grad ? logits : NULL,
                              logits, E->targets.blk.ptr, N, tp->v0, tp->classes,
                              tp->v1 - tp->v0, dloss, E->dt);
        if (!s && phase < 2 && !ctx->dry && tp->size > 1)
            s = mti_comm_group_all_reduce(ctx, tp->comm, what, f + (phase ? N : 0),
                                          f + (phase ? N : 0), (size_t)(phase ? 2 * N : N),
                                          MT_COMM_F32, phase ? MT_COMM_SUM : MT_COMM_MAX);
    }
    mti_tensor_free(ctx, &st);
    return s;
}

mt_status mti_engine_loss(mti_engine *E, float dloss, int want_grad)
{
    mt_model *m = E->m;
    mt_status s;
    MTI_TRY(act(E, &E->losses, MTI_F32, E->N, 0, MT_MEM_IO, MT_LIFE_STEP, MTI_TAG(0, 3)));
    if (E->head_fused) return head_loss(E, NULL, 0, 0.0f, 1.0f, dloss);
    if (m->tp) return tp_loss(E, dloss, want_grad);
    void *logits = E->bnd[m->n_layers].blk.ptr;
    return E->ctx->ops->xent(&E->k, E->losses.blk.ptr, want_grad ? logits : NULL, logits,
                             E->targets.blk.ptr, E->N, m->classes, m->out_width, dloss, E->dt);
}

mt_status mti_engine_loss_kd(mti_engine *E, const mti_engine *teacher, float alpha, float temp,
                            float dloss)
{
    mt_model *m = E->m;
    mt_status s;
    MTI_TRY(act(E, &E->losses, MTI_F32, E->N, 0, MT_MEM_IO, MT_LIFE_STEP, MTI_TAG(0, 3)));
    if (E->head_fused)
        return head_loss(E, teacher->bnd[teacher->m->n_layers].blk.ptr, teacher->m->out_width,
                         alpha, temp, dloss);
    void *logits = E->bnd[m->n_layers].blk.ptr;
    return E->ctx->ops->xent_kd(&E->k, E->losses.blk.ptr, logits, logits,
                                teacher->bnd[teacher->m->n_layers].blk.ptr, E->targets.blk.ptr,
                                E->N, m->classes, m->out_width, teacher->m->out_width, alpha, temp,
                                dloss, E->dt);
}

mt_status mti_engine_loss_sum(mti_engine *E, float *host, double *sum)
{
    mt_status s = mti_tensor_download(E->ctx, &E->losses, host, (size_t)E->N * sizeof(float));
    double acc = 0.0;
    for (int i = 0; i < E->N && !s; i++) acc += host[i];
    *sum = acc;
    return s;
}

/* ---- backward of one layer: E->d holds d(output), leaves d(input) ---- */

static mt_status block_redo(mti_engine *E, int i)
{
    /* selective saving: recompute what was not kept, from what was */
    const mti_layer *ly = &E->m->layers[i];
    const mti_ops *op = E->ctx->ops;
    const mti_kctx *k = &E->k;
    const int N = E->N, C = ly->in, p = ly->p0;
    const int Cl = C / tp_size(E), H = ly->heads / tp_size(E), NL = rows_here(E);
    const mti_dtype dt = E->dt;
    mti_tensor *sl = E->slot[i];
    const uint64_t nd = (uint64_t)i + 2;
    mt_status s;
    MTI_TRY(act(E, &sl[LN1], dt, NL, C, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, LN1)));
    MTI_TRY(op->layernorm_fwd(k, sl[LN1].blk.ptr, NULL, NULL, E->bnd[i].blk.ptr, P(E, p), P(E, p + 1),
                          NL, C, dt));
    MTI_TRY(act(E, &sl[ATT], dt, N, Cl, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, ATT)));
    MTI_TRY(act(E, &sl[LSE], MTI_F32, (int64_t)E->B * H * E->T, 0, MT_MEM_ACT, MT_LIFE_STEP,
            MTI_TAG(nd, LSE)));
    MTI_TRY(op->attention_fwd(k, sl[ATT].blk.ptr, sl[LSE].blk.ptr, sl[QKV].blk.ptr, E->B, E->T, Cl, H,
                          dt));
    MTI_TRY(act(E, &sl[LN2], dt, NL, C, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, LN2)));
    MTI_TRY(op->layernorm_fwd(k, sl[LN2].blk.ptr, NULL, NULL, sl[RES2].blk.ptr, P(E, p + 6),
                          P(E, p + 7), NL, C, dt));
    MTI_TRY(act(E, &sl[GELU_OUT], dt, N, 4 * Cl, MT_MEM_ACT, MT_LIFE_STEP, MTI_TAG(nd, GELU_OUT)));
    MTI_TRY(op->gelu_fwd(k, sl[GELU_OUT].blk.ptr, sl[FCH].blk.ptr, (size_t)N * 4 * Cl, dt));
    return MT_OK;
}

/* The gradients of a block's parameters p + a and p + a + 1 (a weight and
 * its bias, or a LayerNorm's pair) into g[a], g[a + 1]. */
static mt_status grad_pair(mti_engine *E, int p, float **g, int a)
{
    mt_status s = gradp(E, p + a, &g[a]);
    return s ? s : gradp(E, p + a + 1, &g[a + 1]);
}

static mt_status block_bwd(mti_engine *E, int i, bool keep)
{
    const mti_layer *ly = &E->m->layers[i];
    const mti_ops *op = E->ctx->ops;
    const mti_kctx *k = &E->k;
    const int N = E->N, C = ly->in, p = ly->p0;
    const int Cl = C / tp_size(E), H = ly->heads / tp_size(E), NL = rows_here(E);
    const mti_dtype dt = E->dt;
    mti_tensor *sl = E->slot[i];
    const uint64_t nd = (uint64_t)i + 2;
    mt_status s;
    bool sel = !sl[LN1].blk.ptr; /* selective: the dropped slots come back for this backward */
    if (sel) MTI_TRY(block_redo(E, i));
    /* a slot is freed after its last use, unless the forward's tensors are kept
       for a second backward (and then only the recomputed ones go) */
#define DONE(j)                                                                                \
    do {                                                                                       \
        if (!keep || (sel && !sel_keep[j])) mti_tensor_free(E->ctx, &sl[j]);                   \
    } while (0)
    /* each weight's gradient made when its GEMM or LayerNorm comes (not all
       at the block's start: the later ones are not there at the MLP's peak) */
    float *g[12] = {NULL};
    int set;
    void *d = E->d.blk.ptr, *dx = NULL;
    /* t1: a GEMM's input gradient over every row (N, C); sequence parallel:
       dl its rows here, dg the gradient flowing back and xg a LayerNorm's
       output gathered from every rank */
    mti_tensor t4 = {0}, t1 = {0}, dl = {0}, dg = {0}, xg = {0};
    const void *dfull = d, *xin = NULL;
    /* MLP: fcproj, GELU, fc, ln2 */
    s = all_rows(E, d, C, &dg, &dfull, MTI_TAG(nd, 203));
    if (!s) s = act(E, &t4, dt, N, 4 * Cl, MT_MEM_WORK, MT_LIFE_PHASE, MTI_TAG(nd, 200));
    if (!s) s = grad_pair(E, p, g, 10);
    if (!s)
        s = lin_bwd(E, p + 10, t4.blk.ptr, g[10], g[11], dfull, sl[GELU_OUT].blk.ptr, 4 * Cl,
                        C, 0);
    if (!s)
        s = lora_bwd(E, p + 10, t4.blk.ptr, d, sl[GELU_OUT].blk.ptr, 4 * C, C, &sl[LORA_FCPROJ],
                     MTI_TAG(nd, LORA_FCPROJ));
    mti_tensor_free(E->ctx, &dg);
    if (!s) DONE(GELU_OUT);
    if (!s) DONE(LORA_FCPROJ);
    if (!s) s = op->gelu_bwd(k, t4.blk.ptr, t4.blk.ptr, sl[FCH].blk.ptr, (size_t)N * 4 * Cl, dt);
    if (!s) DONE(FCH);
    if (!s) s = act(E, &t1, dt, N, C, MT_MEM_WORK, MT_LIFE_PHASE, MTI_TAG(nd, 201));
    if (!s) s = all_rows(E, sl[LN2].blk.ptr, C, &xg, &xin, MTI_TAG(nd, 204));
    if (!s) s = grad_pair(E, p, g, 8);
    if (!s)
        s = lin_bwd(E, p + 8, t1.blk.ptr, g[8], g[9], t4.blk.ptr, xin, C, 4 * Cl, 0);
    if (!s)
        s = lora_bwd(E, p + 8, t1.blk.ptr, t4.blk.ptr, sl[LN2].blk.ptr, C, 4 * C, &sl[LORA_FC],
                     MTI_TAG(nd, LORA_FC));
    if (!s) DONE(LORA_FC);
    mti_tensor_free(E->ctx, &xg);
    mti_tensor_free(E->ctx, &t4);
    if (!s) s = col_dx(E, t1.blk.ptr, C, &dl, &dx, MTI_TAG(nd, 212));
    if (!s) DONE(LN2);
    if (!s) s = grad_pair(E, p, g, 6);
    if (!s) s = wflags(E, p + 6, g[6], p + 7, g[7], &set);
    if (!s)
        s = op->layernorm_bwd(k, d, g[6], g[7], dx, sl[RES2].blk.ptr, P(E, p + 6),
                              sl[LN2_MEAN].blk.ptr, sl[LN2_RSTD].blk.ptr, NL, C, dt,
                              MTI_BWD_ACC_DX | set);
    mti_tensor_free(E->ctx, &dl);
    if (!s) {
        DONE(RES2);
        DONE(LN2_MEAN);
        DONE(LN2_RSTD);
    }
    /* attention: attproj, attention, qkv, ln1 */
    if (!s) s = all_rows(E, d, C, &dg, &dfull, MTI_TAG(nd, 205));
    if (!s) s = grad_pair(E, p, g, 4);
    if (!s)
        s = lin_bwd(E, p + 4, t1.blk.ptr, g[4], g[5], dfull, sl[ATT].blk.ptr, Cl, C, 0);
    if (!s)
        s = lora_bwd(E, p + 4, t1.blk.ptr, d, sl[ATT].blk.ptr, C, C, &sl[LORA_ATTPROJ],
                     MTI_TAG(nd, LORA_ATTPROJ));
    mti_tensor_free(E->ctx, &dg);
    if (!s) DONE(LORA_ATTPROJ);
    mti_tensor t3 = {0};
    if (!s) s = act(E, &t3, dt, N, 3 * Cl, MT_MEM_WORK, MT_LIFE_PHASE, MTI_TAG(nd, 202));
    if (!s)
        s = op->attention_bwd(k, t3.blk.ptr, t1.blk.ptr, sl[QKV].blk.ptr, sl[ATT].blk.ptr,
                              sl[LSE].blk.ptr, E->B, E->T, Cl, H, dt);
    if (!s) {
        DONE(ATT);
        DONE(LSE);
    }
    if (!s) s = all_rows(E, sl[LN1].blk.ptr, C, &xg, &xin, MTI_TAG(nd, 206));
    if (!s) s = grad_pair(E, p, g, 2);
    if (!s)
        s = lin_bwd(E, p + 2, t1.blk.ptr, g[2], g[3], t3.blk.ptr, xin, C, 3 * Cl, 0);
    if (!s)
        s = lora_bwd(E, p + 2, t1.blk.ptr, t3.blk.ptr, sl[LN1].blk.ptr, C, 3 * C, &sl[LORA_QKV],
                     MTI_TAG(nd, LORA_QKV));
    if (!s) DONE(LORA_QKV);
    mti_tensor_free(E->ctx, &xg);
    mti_tensor_free(E->ctx, &t3);
    if (!s) s = col_dx(E, t1.blk.ptr, C, &dl, &dx, MTI_TAG(nd, 213));
    if (!s) {
        DONE(QKV);
        DONE(LN1);
    }
    if (!s) s = grad_pair(E, p, g, 0);
    if (!s) s = wflags(E, p, g[0], p + 1, g[1], &set);
    if (!s)
        s = op->layernorm_bwd(k, d, g[0], g[1], dx, E->bnd[i].blk.ptr, P(E, p),
                              sl[LN1_MEAN].blk.ptr, sl[LN1_RSTD].blk.ptr, NL, C, dt,
                              MTI_BWD_ACC_DX | set);
    mti_tensor_free(E->ctx, &dl);
    mti_tensor_free(E->ctx, &t1);
    if (!s) {
        DONE(LN1_MEAN);
        DONE(LN1_RSTD);
    }
#undef DONE
    return s;
}

/* The LM head's part of rows [r0, r1) of the tied table's gradient (r1 0:
 * all of it) into g, from the deferred dlogits and head input: written over
 * a slice (it is the slice's first contribution), and over the whole
 * gradient when that is fresh. */
static mt_status tied_head_grad(mti_engine *E, float *g, int r0, int r1)
{
    const mti_layer *head = &E->m->layers[E->m->n_layers - 1];
    int set;
    mt_status s;
    if (!r1) {
        MTI_TRY(wflags(E, head->tied, g, -1, NULL, &set));
        return head_dw(E, g, E->tied_dy_ptr, E->tied_x_ptr, head->in, head->out, 0, 0, set);
    }
    return head_dw(E, g, E->tied_dy_ptr, E->tied_x_ptr, head->in, head->out, r0, r1,
                   grad_filled(E) ? 0 : MTI_BWD_SET_DW);
}

/* The tied table's gradient, tied_rows rows at a time: the head's part,
 * then the tokens' rows (the order of the whole gradient's sums), handed to
 * the slice hook and dropped. */
static mt_status tied_slices(mti_engine *E, const mti_layer *ly)
{
    const mti_ops *op = E->ctx->ops;
    const int pi = ly->p0, V = (int)E->m->params[pi].shape[0], C = ly->out;
    mt_status s = MT_OK;
    for (int r0 = 0; r0 < V && !s; r0 += E->tied_rows) {
        int r1 = V - r0 < E->tied_rows ? V : r0 + E->tied_rows;
        mti_tensor g = {.dtype = MTI_F32, .ndim = 2, .shape = {r1 - r0, C}};
        s = mti_tensor_alloc(E->ctx, &g, MT_MEM_GRAD, MT_LIFE_PHASE, MTI_TAG_PARAM(MTI_TAG_GRAD, pi));
        if (!s && grad_filled(E)) s = grad_start(E, pi, (size_t)r0 * C, &g);
        if (!s) s = tied_head_grad(E, g.blk.ptr, r0, r1); /* (writes the slice whole) */
        if (!s)
            s = op->embedding_dw_rows(&E->k, g.blk.ptr, E->d.blk.ptr, E->tokens.blk.ptr, E->B,
                                      E->T, C, r0, r1, E->dt);
        if (!s) s = E->slice_hook(E->user, pi, g.blk.ptr, (size_t)r0 * C, (size_t)(r1 - r0) * C);
        mti_tensor_free(E->ctx, &g);
    }
    return s;
}

static mt_status layer_bwd(mti_engine *E, int i, bool keep)
{
    mt_model *m = E->m;
    const mti_layer *ly = &m->layers[i];
    const mti_ops *op = E->ctx->ops;
    const mti_kctx *k = &E->k;
    const int N = E->N;
    const mti_dtype dt = E->dt;
    mti_tensor *x = &E->bnd[i], *sl = E->slot[i];
    const uint64_t nd = (uint64_t)i + 2;
    const size_t nout = (size_t)N * (size_t)ly->out;
    /* no input gradient for the first layer backward reaches (the model's
       first, or the first with something to train) */
    const bool want_dx = i > E->train_from || E->stage_in;
    mt_status s;
    float *gw = NULL, *gb = NULL;
    if (ly->kind == MT_LAYER_LM_HEAD && E->head_fused) {
        /* d is already its input gradient (head_loss), which a second
           backward needs again: a copy flows back */
        if (!keep) return MT_OK;
        mti_tensor dx;
        MTI_TRY(act(E, &dx, dt, N, ly->in, MT_MEM_WORK, MT_LIFE_PHASE, MTI_TAG(nd, 200)));
        s = E->ctx->dev->copy_d2d(E->ctx->dev, dx.blk.ptr, E->d.blk.ptr, mti_tensor_bytes(&dx));
        if (s) {
            mti_tensor_free(E->ctx, &dx);
            return s;
        }
        E->d = dx; /* (the boundary keeps its own) */
        return MT_OK;
    }
    switch (ly->kind) {
    case MT_LAYER_LINEAR:
    case MT_LAYER_LM_HEAD: {
        int wi = ly->kind == MT_LAYER_LINEAR ? ly->p0 : ly->tied;
        /* (not when the layer before needs this input as its own output) */
        const bool defer = ly->kind == MT_LAYER_LM_HEAD && E->defer_tied &&
                           !m->params[wi].frozen && !(i > 0 && needs_output(&m->layers[i - 1]));
        if (!defer) MTI_TRY(gradp(E, wi, &gw));
        if (ly->kind == MT_LAYER_LINEAR && ly->bias) MTI_TRY(gradp(E, ly->p0 + 1, &gb));
        mti_tensor dx = {0}, xg = {0}, dl = {0};
        const void *xin = x->blk.ptr;
        void *dxp = NULL;
        s = MT_OK;
        /* (an LM head under sequence parallel: its input's rows gathered) */
        if (ly->kind == MT_LAYER_LM_HEAD) MTI_TRY(all_rows(E, x->blk.ptr, ly->in, &xg, &xin, MTI_TAG(nd, 207)));
        if (want_dx) s = act(E, &dx, dt, N, ly->in, MT_MEM_WORK, MT_LIFE_PHASE, MTI_TAG(nd, 200));
        if (!s && ly->kind == MT_LAYER_LM_HEAD && gw) { /* the weight's part in the head's blocks */
            int set;
            if (want_dx)
                s = lin_bwd(E, wi, dx.blk.ptr, NULL, NULL, E->d.blk.ptr, xin, ly->in,
                            out_cols(E, ly), 0);
            if (!s) s = wflags(E, wi, gw, -1, NULL, &set);
            if (!s) s = head_dw(E, gw, E->d.blk.ptr, xin, ly->in, out_cols(E, ly), 0, 0, set);
        } else if (!s && (want_dx || gw || gb || defer))
            s = lin_bwd(E, wi, dx.blk.ptr, gw, gb, E->d.blk.ptr, xin, ly->in, out_cols(E, ly), 0);
        mti_tensor_free(E->ctx, &xg);
        if (!s && want_dx && ly->kind == MT_LAYER_LM_HEAD && E->m->tp) { /* (a vocabulary share's part) */
            s = col_dx(E, dx.blk.ptr, ly->in, &dl, &dxp, MTI_TAG(nd, 214));
            if (dl.blk.ptr) { /* this rank's rows flow back */
                mti_tensor_free(E->ctx, &dx);
                dx = dl;
            }
        }
        if (!s && ly->kind == MT_LAYER_LINEAR)
            s = lora_bwd(E, wi, dx.blk.ptr, E->d.blk.ptr, x->blk.ptr, ly->in, ly->out,
                         &sl[LORA_QKV], MTI_TAG(nd, LORA_QKV));
        if (s) {
            mti_tensor_free(E->ctx, &dx);
            return s;
        }
        if (defer) { /* dlogits and the input wait for the embedding (see engine.h) */
            E->tied_dy_ptr = E->d.blk.ptr;
            E->tied_x_ptr = x->blk.ptr;
            if (!keep) {
                E->tied_dy = E->d;
                E->tied_x = *x;
                memset(x, 0, sizeof *x);
            }
            memset(&E->d, 0, sizeof E->d);
        } else if (!(keep && i == m->n_layers - 1)) {
            mti_tensor_free(E->ctx, &E->d);
        } else { /* dlogits are the logits' block: kept for a second backward */
            memset(&E->d, 0, sizeof E->d);
        }
        E->d = dx;
        break;
    }
    case MT_LAYER_RELU:
        MTI_TRY(op->relu_bwd(k, E->d.blk.ptr, E->d.blk.ptr, E->bnd[i + 1].blk.ptr, nout, dt));
        break;
    case MT_LAYER_GELU:
        MTI_TRY(op->gelu_bwd(k, E->d.blk.ptr, E->d.blk.ptr, x->blk.ptr, nout, dt));
        break;
    case MT_LAYER_LAYERNORM: {
        int set;
        MTI_TRY(gradp(E, ly->p0, &gw));
        MTI_TRY(gradp(E, ly->p0 + 1, &gb));
        if (!want_dx && !gw && !gb) break;
        MTI_TRY(wflags(E, ly->p0, gw, ly->p0 + 1, gb, &set));
        MTI_TRY(op->layernorm_bwd(k, want_dx ? E->d.blk.ptr : NULL, gw, gb, E->d.blk.ptr, x->blk.ptr,
                              P(E, ly->p0), sl[S_MEAN].blk.ptr, sl[S_RSTD].blk.ptr, rows_here(E),
                              ly->in, dt, set));
        break;
    }
    case MT_LAYER_EMBEDDING: {
        float *gpos = NULL;
        const bool sliced = E->tied_dy_ptr && E->tied_rows > 0 && E->slice_hook && E->hook;
        if (sliced) {
            gw = NULL; /* made slice by slice at the end */
        } else if (E->tied_dy_ptr) { /* the head's part first, all of it */
            MTI_TRY(gradp(E, ly->p0, &gw));
            MTI_TRY(tied_head_grad(E, gw, 0, 0));
        } else { /* the tokens' rows: a fresh table is zeros first */
            MTI_TRY(zgradp(E, ly->p0, &gw));
        }
        if (ly->positions) MTI_TRY(zgradp(E, ly->p0 + 1, &gpos)); /* (rows T.. get nothing) */
        if (!ly->stable && m->tp) { /* this rank's rows of the table (from every row) */
            mti_tensor g = {0};
            const void *dall;
            MTI_TRY(all_rows(E, E->d.blk.ptr, ly->out, &g, &dall, MTI_TAG(nd, 208)));
            s = gw ? op->embedding_dw_rows(k, gw, dall, E->tokens.blk.ptr, E->B, E->T, ly->out,
                                           m->tp->v0, m->tp->v1, dt)
                   : MT_OK;
            if (!s && gpos)
                s = op->embedding_bwd(k, NULL, gpos, dall, E->tokens.blk.ptr, E->B, E->T, ly->out,
                                      dt);
            mti_tensor_free(E->ctx, &g);
            MTI_TRY(s);
        } else if (!ly->stable) {
            if (gw || gpos)
                MTI_TRY(op->embedding_bwd(k, gw, gpos, E->d.blk.ptr, E->tokens.blk.ptr, E->B, E->T,
                                      ly->out, dt));
        } else {
            int pl = ly->p0 + (ly->positions ? 2 : 1), set;
            float *glw, *glb;
            MTI_TRY(gradp(E, pl, &glw));
            MTI_TRY(gradp(E, pl + 1, &glb));
            MTI_TRY(wflags(E, pl, glw, pl + 1, glb, &set));
            if (gpos)
                MTI_TRY(op->embedding_bwd(k, NULL, gpos, E->d.blk.ptr, E->tokens.blk.ptr, E->B, E->T,
                                      ly->out, dt));
            const bool table = gw || sliced; /* its gradient needs the LayerNorm's dx */
            if (table || glw || glb)
                MTI_TRY(op->layernorm_bwd(k, table ? E->d.blk.ptr : NULL, glw, glb, E->d.blk.ptr,
                                      sl[S_EMB].blk.ptr, P(E, pl), sl[S_MEAN].blk.ptr,
                                      sl[S_RSTD].blk.ptr, N, ly->out, dt, set));
            if (gw)
                MTI_TRY(op->embedding_bwd(k, gw, NULL, E->d.blk.ptr, E->tokens.blk.ptr, E->B, E->T,
                                      ly->out, dt));
        }
        if (sliced) MTI_TRY(tied_slices(E, ly));
        if (E->tied_dy_ptr) {
            mti_tensor_free(E->ctx, &E->tied_dy);
            mti_tensor_free(E->ctx, &E->tied_x);
            E->tied_dy_ptr = E->tied_x_ptr = NULL;
        }
        break;
    }
    case MT_LAYER_BLOCK: MTI_TRY(block_bwd(E, i, keep)); break;
    }
    return MT_OK;
}

/* Frees what layer i's forward made, once its backward is done. */
static void after_bwd(mti_engine *E, int i, bool keep)
{
    mt_model *m = E->m;
    bool gone = !keep || E->redone[i];
    if (gone) {
        free_slots(E, i);
        /* its output, if its own backward needed it (the next layer left it) */
        if (needs_output(&m->layers[i]) && i + 1 < m->n_layers && !(keep && E->kept[i + 1]))
            mti_tensor_free(E->ctx, &E->bnd[i + 1]);
        /* its input, unless the layer before needs it as its output, or it is
           the model's input, or a kept boundary a second pass needs */
        bool input_kept = (i > 0 && needs_output(&m->layers[i - 1])) || i == 0 ||
                          (keep && E->kept[i]);
        if (!input_kept) mti_tensor_free(E->ctx, &E->bnd[i]);
    }
    E->redone[i] = 0;
}

mt_status mti_engine_backward(mti_engine *E, int keep, mti_grad_hook hook, void *user)
{
    mt_model *m = E->m;
    mt_status s;
    const int L = m->n_layers;
    E->hook = hook;
    E->user = user;
    /* d flows back from the dlogits, which live in the logits' block (a
       stage's: from the gradient of its output, given in d) */
    if (!E->stage_out) {
        E->d = E->bnd[L];
        if (!keep) memset(&E->bnd[L], 0, sizeof E->bnd[L]);
    }
    if (E->params_hook) { /* the schedule's rest, or this backward's own */
        memcpy(E->sched_have, E->have, (size_t)L);
        const int n = sched_backward(E, E->sched_have, E->sched_new, 0);
        if (n != E->n_sched - E->at ||
            memcmp(E->sched_new, E->sched + E->at, (size_t)n * sizeof *E->sched)) {
            sched_drop(E);
            memcpy(E->sched, E->sched_new, (size_t)n * sizeof *E->sched);
            E->n_sched = n;
        }
    }
    /* layers before the first with something to train need no backward
       (their tensors go at release) */
    for (int i = L - 1; i >= E->train_from; i--) {
        if (!E->have[i]) { /* recompute the segment up to this layer */
            int st = E->seg_start[i];
            /* the segment's output may still be there (a kept boundary for a
               second pass, or an output the layer's backward needs): it stays,
               and the copy made again (the same values) goes */
            mti_tensor out = E->bnd[i + 1];
            memset(&E->bnd[i + 1], 0, sizeof out);
            s = run_forward(E, st, i + 1, 1);
            if (out.blk.ptr || !needs_output(&m->layers[i])) mti_tensor_free(E->ctx, &E->bnd[i + 1]);
            if (out.blk.ptr) E->bnd[i + 1] = out;
            if (s) return s;
        }
        MTI_TRY(with_params(E, i, 1, MTI_SAVE_NONE, keep));
        after_bwd(E, i, keep);
        const mti_layer *ly = &m->layers[i];
        for (int j = 0; j <= ly->np; j++) {
            int pi = j < ly->np ? ly->p0 + j : ly->tied;
            if (pi < 0) continue;
            /* (every op writes what it was given: a gradient still fresh
               here would be one no op wrote, which reads zeros) */
            MTI_TRY(unfresh(E, pi));
            /* (a table gradient made in slices went to the slice hook) */
            if (--E->uses_left[pi] == 0 && hook && E->grad[pi].blk.ptr) MTI_TRY(hook(user, pi));
            const int a = m->params[pi].lora; /* its adapter's, final with it */
            for (int q = a; j < ly->np && a >= 0 && q <= a + 1; q++) {
                MTI_TRY(unfresh(E, q));
                if (--E->uses_left[q] == 0 && hook && E->grad[q].blk.ptr) MTI_TRY(hook(user, q));
            }
        }
    }
    if (E->d.blk.ptr == E->bnd[L].blk.ptr) memset(&E->d, 0, sizeof E->d); /* kept dlogits */
    if (!E->stage_in) mti_tensor_free(E->ctx, &E->d); /* (a stage's goes back: the caller's) */
    for (int i = 0; i < m->n_param; i++) MTI_TRY(unfresh(E, i)); /* (see above) */
    return MT_OK;
}
