/*
 * zero.c - ZeRO stages 1 and 2: the shard layout, and the collectives that
 * move slices of a tensor between the ranks (docs/distributed.md, "ZeRO",
 * and docs/design.md for why the layout is what it is).
 *
 * The layout. Each parameter tensor is cut on its own, never through a
 * flat buffer of all parameters: with an optimizer that updates slices
 * (SGD, AdamW, 8-bit AdamW) it is cut into N contiguous slices of `per`
 * elements, per = ceil(units / N) x align, where align is
 * mti_optim_slice_align of the tensor's optimizer layout (1 for 32-bit
 * state, 256 for 8-bit state: a block never straddles two ranks) and units
 * = ceil(numel / align); rank r holds [r per, (r + 1) per) cut at numel
 * (the last ranks may hold less, or nothing). The optimizer's layout is
 * made for the whole tensor first, so sharding never changes which tensors
 * get 8-bit state or where blocks fall. An optimizer that cannot update a
 * slice (Adafactor: factored row and column statistics and the update's
 * RMS need the whole tensor) gets whole tensors: each goes to the rank
 * holding the fewest elements so far, in parameter order (ties: the lower
 * rank). Frozen parameters (cfg.freeze) have nothing to shard: only their
 * weights, whole on every rank. Everything is a function of the shapes,
 * the optimizer layout and N, so every rank (and a dry run) computes the
 * same layout alone.
 *
 * Moving slices. The communicator's reduce-scatter and all-gather take
 * equal counts per rank, and a range of a tensor (a whole tensor, or a
 * slice of the tied table in the fused step) meets the ranks' slices in
 * unequal pieces; so each goes through a bucket of N x K elements: piece
 * r at r K (zero-padded), the collective, then the piece back, K at a
 * time. A whole-tensor owner's gradient is all-reduced in place and its
 * weights broadcast in place. Buckets come from one helper
 * (mti_comm_buffer): class COMM, with the communication buffers. On a CPU
 * context a gradient's pieces go straight into the context's staging
 * buffer (which a host communicator's collective runs in anyway), so its
 * reduce-scatter holds no bucket: the same collective on the same values,
 * one copy and up to 4 MiB of COMM fewer. A dry context (estimates)
 * allocates exactly as a real one and communicates nothing.
 *
 * The reduce-scatter takes a trainer and touches nothing but the tensors
 * named and, on a CPU context, the staging buffer, and allocates nothing
 * there, so the communication thread (overlap.c) runs it for one tensor
 * while backward computes the next.
 */
#include <stdlib.h>
#include <string.h>

#include "train/dp.h"
#include "train/offload.h"
#include "train/trainer.h"

/* bytes of a bucket, at most: the staging buffer's, which a CPU context's
 * reduce-scatter packs into directly */
#define BUCKET_BYTES MTI_COMM_STAGE

/* Whether collectives run (a dry context plans and communicates nothing). */
static bool live(const mt_trainer *t)
{
    return t->ctx->cfg.comm && mt_comm_size(t->ctx->cfg.comm) > 1;
}

mt_status mti_comm_buffer(mt_context *ctx, mti_tensor *buf, size_t bytes)
{
    *buf = (mti_tensor){.dtype = MTI_U8, .ndim = 1, .shape = {(int64_t)bytes}};
    return mti_tensor_alloc(ctx, buf, MT_MEM_COMM, MT_LIFE_PHASE, MTI_TAG_PARAM(MTI_TAG_TRAINER, 7));
}

/* ---- the layout ---- */

mt_status mti_zero_layout(mt_trainer *t)
{
    const mt_model *m = t->model;
    const int N = t->world;
    uint64_t *held = calloc((size_t)N, sizeof *held);
    if (!held) return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    for (int i = 0; i < m->n_param; i++) {
        const size_t n = m->params[i].numel;
        mti_shard *sh = &t->sh[i];
        *sh = (mti_shard){.lo = 0, .hi = n, .per = n, .owner = -1};
        if (m->params[i].frozen) sh->hi = 0; /* no master, state or gradient anywhere */
        if (!t->zero || m->params[i].frozen) continue;
        if (t->opt->sliceable) {
            const size_t a = mti_optim_slice_align(&t->ps[i].lay), units = (n + a - 1) / a;
            sh->per = (units + (size_t)N - 1) / (size_t)N * a;
        } else {
            int best = 0;
            for (int r = 1; r < N; r++)
                if (held[r] < held[best]) best = r;
            held[best] += n;
            sh->owner = best;
            sh->per = 0;
        }
        mti_zero_range(t, i, t->rank, &sh->lo, &sh->hi);
    }
    free(held);
    return MT_OK;
}

void mti_zero_range(const mt_trainer *t, int i, int r, size_t *lo, size_t *hi)
{
    const mti_shard *sh = &t->sh[i];
    const size_t n = t->model->params[i].numel;
    if (t->model->params[i].frozen) {
        *lo = *hi = 0;
    } else if (!t->zero) {
        *lo = 0, *hi = n;
    } else if (sh->owner >= 0) {
        *lo = 0, *hi = r == sh->owner ? n : 0;
    } else {
        size_t a = (size_t)r * sh->per, b = a + sh->per;
        *lo = a < n ? a : n;
        *hi = b < n ? b : n;
    }
}

/* Piece r of elements [at, at + n) of parameter i, the part rank r holds:
 * its first element in *from, its length returned (nothing allocated, for
 * the communication thread). */
static size_t piece(const mt_trainer *t, int i, size_t at, size_t n, int r, size_t *from)
{
    size_t lo, hi;
    mti_zero_range(t, i, r, &lo, &hi);
    if (lo < at) lo = at;
    if (hi > at + n) hi = at + n;
    *from = lo;
    return hi > lo ? hi - lo : 0;
}

/* Every rank's piece: piece r is [from[r], from[r] + len[r]); returns the
 * longest. */
static size_t pieces(const mt_trainer *t, int i, size_t at, size_t n, size_t *from, size_t *len)
{
    size_t most = 0;
    for (int r = 0; r < t->world; r++) {
        len[r] = piece(t, i, at, n, r, &from[r]);
        if (len[r] > most) most = len[r];
    }
    return most;
}

/* The longest piece of elements [at, at + n) of parameter i. */
static size_t longest(const mt_trainer *t, int i, size_t at, size_t n)
{
    size_t most = 0, from;
    for (int r = 0; r < t->world; r++) {
        const size_t l = piece(t, i, at, n, r, &from);
        if (l > most) most = l;
    }
    return most;
}

/* ---- gradients to their owners ---- */

/* Elements a piece of a bucket of n_pieces pieces of es-byte elements
 * whose longest piece is `most`: the reduce-scatters' (fp32, a piece per
 * rank) and the gathers'. */
static size_t gather_k(size_t es, int n_pieces, size_t most)
{
    size_t K = BUCKET_BYTES / es / (size_t)n_pieces;
    if (K > most) K = most;
    return K < 1 ? 1 : K;
}

/* Bytes of the bucket reducing [at, at + n) of parameter i: one chunk of
 * N x K (every chunk, each its own, when `every`), or 0 (none needed). */
static size_t bucket_bytes(const mt_trainer *t, int i, size_t at, size_t n, bool every)
{
    if (t->sh[i].owner >= 0 || mti_comm_stage(t->ctx)) return 0; /* (none: in place, or the staging) */
    const size_t most = longest(t, i, at, n);
    const size_t K = gather_k(4, t->world, most), chunks = every ? (most + K - 1) / K : 1;
    return most ? (size_t)t->world * K * chunks * 4 : 0;
}

size_t mti_zero_reduce_bytes(const mt_trainer *t, int i, size_t at, size_t n)
{
    return bucket_bytes(t, i, at, n, false);
}

size_t mti_zero_reduce_bytes_all(const mt_trainer *t, int i, size_t at, size_t n)
{
    return bucket_bytes(t, i, at, n, true);
}

mt_status mti_zero_reduce(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst, int acc)
{
    return mti_zero_reduce_in(t, i, g, at, n, dst, acc, NULL);
}

mt_status mti_zero_reduce_in(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst, int acc,
                             void *bucket)
{
    return mti_zero_reduce_phase(t, i, g, at, n, dst, acc, bucket, MTI_ZR_ALL);
}

mt_status mti_zero_reduce_phase(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst,
                                int acc, void *bucket, int phase)
{
    mt_context *ctx = t->ctx;
    mti_device *d = ctx->dev;
    const mti_kctx k = {ctx, d};
    const int N = t->world, me = t->rank;
    const mti_shard *sh = &t->sh[i];
    const bool post = phase != MTI_ZR_FINISH, take = phase != MTI_ZR_POST;
    char what[112];
    snprintf(what, sizeof what, "the reduce-scatter of the gradients of %s", t->model->params[i].name);
    mt_status s = MT_OK;
    if (sh->owner >= 0) { /* a whole-tensor owner: summed in place, the owner takes it */
        float *const none[1] = {NULL};
        if (live(t) && post) s = g ? mti_comm_all_reduce(ctx, what, g, g, n, MT_COMM_F32, MT_COMM_SUM)
                                   : mti_comm_all_reduce_pieces(ctx, what, none, &n, 1);
        if (s || !take || me != sh->owner || !dst || !g) return s;
        if (acc) return ctx->ops->accumulate(&k, dst, g, n, MTI_F32);
        return dst == g ? MT_OK : d->copy_d2d(d, dst, g, n * 4);
    }
    /* (each piece found again where it is needed: nothing allocated on the
       host, so a rank never fails here alone and skips the collective) */
    const size_t most = longest(t, i, at, n);
    const size_t K = gather_k(4, t->world, most);
    /* a CPU context packs the pieces straight into its staging buffer,
       which the collective works on anyway (once the communication
       thread's queue is done with it); elsewhere through a bucket, the
       caller's or one made here; in phases (a communication stream's),
       the caller's, a chunk of it for each chunk of the range */
    float *stage = phase == MTI_ZR_ALL ? mti_comm_stage(ctx) : NULL;
    mti_tensor bk = {0};
    if (most && stage && live(t)) s = mti_comm_turn(ctx, what);
    const bool made = most && !stage && !bucket;
    if (made && !s) s = mti_comm_buffer(ctx, &bk, (size_t)N * K * 4);
    for (size_t o = 0; o < most && !s; o += K) {
        float *b = stage ? stage : bucket ? bucket : bk.blk.ptr;
        if (phase != MTI_ZR_ALL) b += o / K * (size_t)N * K;
        for (int r = 0; r < N && !s && post; r++) {
            size_t from;
            const size_t len = piece(t, i, at, n, r, &from);
            size_t l = len > o ? len - o : 0;
            if (l > K) l = K;
            if (l && g) s = d->copy_d2d(d, b + (size_t)r * K, g + (from - at) + o, l * 4);
            const size_t z = g ? l : 0; /* no gradient: zeros */
            if (!s && z < K) s = d->memset8(d, b + (size_t)r * K + z, 0, (K - z) * 4);
        }
        if (!s && live(t) && post)
            s = stage ? mti_comm_reduce_scatter_stage(ctx, what, K)
                      : mti_comm_reduce_scatter(ctx, what, b, b + (size_t)me * K, K, MT_COMM_F32,
                                                MT_COMM_SUM);
        size_t from;
        const size_t len = piece(t, i, at, n, me, &from);
        size_t l = len > o ? len - o : 0;
        if (l > K) l = K;
        if (!s && l && dst && take) {
            if (acc) s = ctx->ops->accumulate(&k, dst + o, b + (size_t)me * K, l, MTI_F32);
            else s = d->copy_d2d(d, dst + o, b + (size_t)me * K, l * 4);
        }
    }
    if (made) mti_tensor_free(ctx, &bk);
    return s;
}

/* ---- weights to every rank ---- */

/* Elements [at, at + n) of parameter i's weights into buf (wr 0) or from
 * it (wr 1): in the model's tensor, or in param.bin where they live on
 * disk (offload_params, lib/train/offload.c). */
static mt_status weights_io(mt_trainer *t, int i, size_t at, size_t n, void *buf, int wr)
{
    if (mti_offload_has_weights(t->off, i)) return mti_offload_weights_io(t->off, i, at, n, buf, wr);
    mti_device *d = t->ctx->dev;
    const mti_param *p = &t->model->params[i];
    const size_t es = mti_dtype_size(p->w.dtype);
    char *w = (char *)p->w.blk.ptr + at * es;
    return wr ? d->copy_d2d(d, w, buf, n * es) : d->copy_d2d(d, buf, w, n * es);
}

/* A whole-tensor owner's weights that live on disk (offload_params): read
 * by the owner a bucket at a time, broadcast, written by the others. */
static mt_status broadcast_home(mt_trainer *t, int i, size_t at, size_t n, const char *what,
                                mt_status *ls)
{
    mt_context *ctx = t->ctx;
    mti_device *d = ctx->dev;
    const int owner = t->sh[i].owner, me = t->rank;
    const size_t es = mti_dtype_size(t->model->params[i].w.dtype), K = gather_k(es, 1, n);
    mti_tensor bk;
    mt_status s = n ? mti_comm_buffer(ctx, &bk, K * es) : MT_OK;
    for (size_t o = 0, l; o < n && !s; o += l) {
        l = n - o < K ? n - o : K;
        if (me == owner && !*ls) *ls = weights_io(t, i, at + o, l, bk.blk.ptr, 0);
        if (me == owner && *ls) s = d->memset8(d, bk.blk.ptr, 0, l * es);
        if (!s && live(t)) s = mti_comm_broadcast(ctx, what, bk.blk.ptr, l * es, MT_COMM_BYTE, owner);
        if (!s && me != owner && !*ls) *ls = weights_io(t, i, at + o, l, bk.blk.ptr, 1);
    }
    if (n) mti_tensor_free(ctx, &bk);
    return s;
}

/* The gather of elements [at, at + n) of parameter i. Returns a failure
 * that stops the collectives (a collective's, or the bucket's memory); a
 * local one (reading or writing weights on disk) goes into *ls, and the
 * rank goes on making the collectives, its own part sent as zeros, so the
 * others are not left waiting in one. In phases (a communication
 * stream's, mti_zero_gather_phase) through the caller's bucket, each chunk
 * at its own place. */
static mt_status gather(mt_trainer *t, int i, size_t at, size_t n, mt_status *ls, void *bucket,
                        int phase)
{
    const bool post = phase != MTI_ZR_FINISH, take = phase != MTI_ZR_POST;
    mt_context *ctx = t->ctx;
    mti_device *d = ctx->dev;
    const int N = t->world, me = t->rank;
    const mti_param *p = &t->model->params[i];
    const mti_shard *sh = &t->sh[i];
    const size_t es = mti_dtype_size(p->w.dtype);
    char what[112];
    snprintf(what, sizeof what, "the all-gather of the weights of %s", p->name);
    if (sh->owner >= 0 && mti_offload_has_weights(t->off, i)) /* (never in phases: no stream) */
        return post ? broadcast_home(t, i, at, n, what, ls) : MT_OK;
    if (sh->owner >= 0) { /* the owner's whole tensor, in place */
        if (!live(t) || !post) return MT_OK;
        return mti_comm_broadcast(ctx, what, (char *)p->w.blk.ptr + at * es, n * es, MT_COMM_BYTE,
                                  sh->owner);
    }
    size_t *from = malloc(2 * (size_t)N * sizeof *from);
    if (!from) return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    size_t *len = from + N;
    const size_t most = pieces(t, i, at, n, from, len), K = gather_k(es, N, most), kb = K * es;
    mti_tensor bk;
    const bool made = most && !bucket;
    mt_status s = made ? mti_comm_buffer(ctx, &bk, (size_t)N * kb) : MT_OK;
    for (size_t o = 0; o < most && !s; o += K) {
        char *b = bucket ? bucket : bk.blk.ptr;
        if (phase != MTI_ZR_ALL) b += o / K * (size_t)N * kb;
        size_t l = len[me] > o ? len[me] - o : 0;
        if (l > K) l = K;
        if (l && post && !*ls) *ls = weights_io(t, i, from[me] + o, l, b + (size_t)me * kb, 0);
        if (l && post && *ls) s = d->memset8(d, b + (size_t)me * kb, 0, l * es);
        if (!s && live(t) && post)
            s = mti_comm_all_gather(ctx, what, b + (size_t)me * kb, b, kb, MT_COMM_BYTE);
        for (int r = 0; r < N && !s && !*ls && take; r++) {
            size_t lr = len[r] > o ? len[r] - o : 0;
            if (lr > K) lr = K;
            if (r != me && lr) *ls = weights_io(t, i, from[r] + o, lr, b + (size_t)r * kb, 1);
        }
    }
    if (made) mti_tensor_free(ctx, &bk);
    free(from);
    return s;
}

mt_status mti_zero_gather(mt_trainer *t, int i, size_t at, size_t n)
{
    return mti_zero_gather_phase(t, i, at, n, NULL, MTI_ZR_ALL);
}

mt_status mti_zero_gather_phase(mt_trainer *t, int i, size_t at, size_t n, void *bucket, int phase)
{
    mt_status ls = MT_OK, s = gather(t, i, at, n, &ls, bucket, phase);
    return s ? s : ls;
}

size_t mti_zero_gather_bytes_all(const mt_trainer *t, int i, size_t at, size_t n)
{
    if (t->sh[i].owner >= 0) return 0; /* (a broadcast in place) */
    const size_t most = longest(t, i, at, n);
    const size_t es = mti_dtype_size(t->model->params[i].w.dtype), K = gather_k(es, t->world, most);
    return most ? (size_t)t->world * K * es * ((most + K - 1) / K) : 0;
}

mt_status mti_zero_gather_every(mt_trainer *t)
{
    mt_status ls = MT_OK, s = MT_OK;
    for (int i = 0; i < t->model->n_param && !s; i++)
        if (!t->model->params[i].frozen)
            s = gather(t, i, 0, t->model->params[i].numel, &ls, NULL, MTI_ZR_ALL);
    return s ? s : ls;
}

/* ---- what the ranks' slices say together ---- */

mt_status mti_zero_checks(mt_trainer *t, float *sumsq, int n, int *found, double *total)
{
    *total = 0.0;
    for (int i = 0; i < n; i++) *total += sumsq[i];
    if (!live(t)) return MT_OK;
    mt_context *ctx = t->ctx;
    const int N = t->world;
    const size_t len = ((size_t)n + 1) * sizeof(float);
    float *mine = malloc(len), *all = malloc(len * (size_t)N);
    mt_status s = mine && all ? MT_OK : mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    if (!s) {
        mine[0] = *found ? 1.0f : 0.0f;
        if (n) memcpy(mine + 1, sumsq, (size_t)n * sizeof(float));
        s = mti_comm_host_gather(ctx, "exchanging the gradients' checks and norms", mine, all, len);
    }
    if (!s) {
        double sum = 0.0;
        int any = 0;
        for (int i = 0; i < n; i++) {
            double each = 0.0; /* (the tensor's, over the ranks' slices: tensor parallel's sums) */
            for (int r = 0; r < N; r++) each += all[(size_t)r * (n + 1) + 1 + i];
            sum += each;
            sumsq[i] = (float)each;
        }
        for (int r = 0; r < N; r++) any |= all[(size_t)r * (n + 1)] != 0.0f;
        *found = any;
        *total = sum;
    }
    free(mine), free(all);
    return s;
}

mt_status mti_zero_any(mt_trainer *t, int *flag)
{
    if (!live(t)) return MT_OK;
    double ignored;
    return mti_zero_checks(t, NULL, 0, flag, &ignored);
}
