/*
 * zero3.c - ZeRO stage 3: the weights (PARAM) sharded over the ranks, and
 * brought in for each layer that uses them (docs/distributed.md, "ZeRO-3",
 * and docs/design.md for why it is built this way).
 *
 * Home. Each trained parameter's weights live as this rank's slice of the
 * stage 1/2 layout (zero.c): a PARAM tensor of `per` elements, the rank's
 * [lo, hi) at its start and zeros after (the last ranks' slices are short
 * or empty, so every rank holds the same padded count and one all-gather of
 * equal parts assembles the tensor); a whole-tensor owner (Adafactor,
 * 4-bit AdamW) holds the tensor whole and the others nothing. Frozen
 * parameters are not trained and stay whole on every rank. The update
 * writes the slice; nothing is gathered after the step.
 *
 * Bringing in. The engine calls mti_zero3_layer before and after each
 * layer's forward and backward (and a recomputed layer's forward again).
 * Before: each of the layer's parameters that is not in yet gets a gather
 * buffer (COMM, N x per elements in the weights' dtype, whole for an owner's
 * tensor) filled by one all-gather of the ranks' slices (a broadcast from
 * an owner), and the model's p->w.blk points at it; after: the buffer goes
 * and p->w.blk is empty again. A count per parameter lets two layers hold
 * one copy: the tied table is the embedding's and the LM head's, and while
 * either runs it is in once. Backward of the embedding needs neither the
 * table nor the positions (their gradients come from the tokens), so they
 * are not gathered for it; every other backward gathers its layer's
 * weights.
 *
 * Prefetch. The engine says the order of its calls (its schedule: the
 * forward, then the backward with its recomputes); when entry `at` comes
 * in, entries at + 1 .. at + prefetch are brought in too (their buffers
 * made, their gathers queued), so while this layer computes, the
 * communication thread (overlap.c) gathers the next layers' weights, one
 * collective at a time in the schedule's order. Kept: a layer among the
 * last `zero3_keep` of forward, let go after its forward, first brings in
 * its next entry (its recompute or backward), which then needs no gather.
 * What was brought in ahead and not used (a failed pass, a skipped
 * backward) goes when the engine drops the schedule.
 *
 * On a CUDA context with NCCL the same queue is NCCL's communication
 * stream (nccl_overlap.c): each gather queued there behind an event of
 * the device's stream, which waits for the gather's event before the
 * layer's kernels (the host polling it first, against the deadline); a
 * reduce-scatter in two halves, its chunks packed into a bucket of their
 * own and queued, the sums taken when it is retired.
 *
 * Every rank runs the same layers in the same order, so the collectives
 * match; a dry context (estimates) allocates the same buffers at the same
 * points (always on the stepping thread) and communicates nothing, and
 * without the thread (one rank, a communicator that takes one thread, a
 * depth of 0) each gather runs when its buffer is made.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "train/dp.h"
#include "comm/queue.h"
#include "train/home.h"
#include "train/offload.h"
#include "train/trainer.h"

/* Parameter i's reduce-scatter queued in backward: its bucket (COMM) and
 * the gradient stay until it is retired, once the next layer's gradients
 * are final (or the pass ends), at the same point with or without the
 * thread, so the estimate stays exact. */
struct mti_z3_rs {
    mti_tensor bucket;
    float *dst;      /* the rank's shard of the gradient (accumulated into) */
    uint64_t ticket; /* on the thread (0: ran at once, or none) */
    int tag;         /* the engine's schedule entry after the layer that made it */
    int next;        /* the next parameter of its packed group (-1: the last) */
    bool pending;
};

/* Schedule entry p's parameters that its bringing in found not in yet:
 * gathered together, their slices packed side by side into the staging
 * buffer (packed below), by one job of the queue (ticket, until waited
 * for). */
struct mti_z3_group {
    int idx[MTI_SLOTS + 2];
    int n;
    uint64_t ticket;
};

static bool live(const mt_trainer *t)
{
    return t->ctx->cfg.comm && mt_comm_size(t->ctx->cfg.comm) > 1;
}


/* Elements of parameter i's slice tensor on rank r: the padded `per`, or
 * the whole tensor on its owner. */
static size_t slice_elems(const mt_trainer *t, int i, int r)
{
    const mti_shard *sh = &t->sh[i];
    if (sh->owner >= 0) return r == sh->owner ? t->model->params[i].numel : 0;
    return sh->per;
}

/* Elements of parameter i's gather buffer. */
static size_t gather_elems(const mt_trainer *t, int i)
{
    const mti_shard *sh = &t->sh[i];
    return sh->owner >= 0 ? t->model->params[i].numel : sh->per * (size_t)t->world;
}

static mt_status gather_in(mt_trainer *t, int i);
static void gather_out(mt_trainer *t, int i);

/* Parameter i's whole weights back in the model: from the ranks' slices
 * (root < 0), or broadcast from rank root, which still holds them whole
 * (a create that failed part way). A collective. */
static mt_status unshard_one(mt_trainer *t, int i, int root)
{
    mt_context *ctx = t->ctx;
    mti_param *p = &t->model->params[i];
    mt_status s = MT_OK;
    if (p->unmade) { /* (a deferred model's: its values stay its source's) */
        t->gref[i] = 0; /* (a layer that failed may have left it in) */
        mti_tensor_free(ctx, &t->gb[i]);
        memset(&p->w.blk, 0, sizeof(mt_block));
        mti_tensor_free(ctx, &t->pw[i]);
        return MT_OK;
    }
    if (root >= 0) {
        if (!p->w.blk.ptr)
            s = mti_tensor_alloc(ctx, &p->w, MT_MEM_PARAM, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
        char what[112];
        snprintf(what, sizeof what, "restoring the weights of %s", p->name);
        if (!s && live(t)) s = mti_comm_broadcast(ctx, what, p->w.blk.ptr, mti_tensor_bytes(&p->w), MT_COMM_BYTE, root);
        mti_tensor_free(ctx, &t->pw[i]);
        return s;
    }
    t->gref[i] = 0; /* (a layer that failed may have left it in) */
    mti_tensor_free(ctx, &t->gb[i]);
    memset(&p->w.blk, 0, sizeof(mt_block));
    s = gather_in(t, i);
    mti_tensor w = p->w;
    memset(&w.blk, 0, sizeof w.blk);
    if (!s) s = mti_tensor_alloc(ctx, &w, MT_MEM_PARAM, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
    if (!s) s = ctx->dev->copy_d2d(ctx->dev, w.blk.ptr, t->gb[i].blk.ptr, mti_tensor_bytes(&w));
    if (!s) s = ctx->dev->sync(ctx->dev);
    gather_out(t, i);
    if (s) { /* the weights are gone with the slices: zeros, and said */
        mti_tensor_free(ctx, &w);
        if (!mti_tensor_alloc(ctx, &w, MT_MEM_PARAM, MT_LIFE_PERSISTENT, MTI_TAG_PARAM(MTI_TAG_WEIGHT, i)))
            (void)mti_tensor_zero(ctx, &w);
    }
    p->w = w;
    mti_tensor_free(ctx, &t->pw[i]);
    return s;
}

/* This rank's slice of parameter i made from the whole weights, which go. */
static mt_status shard_one(mt_trainer *t, int i)
{
    mt_context *ctx = t->ctx;
    mti_param *p = &t->model->params[i];
    const size_t n = slice_elems(t, i, t->rank), lo = t->sh[i].lo, held = t->sh[i].hi - lo;
    const size_t es = mti_dtype_size(p->w.dtype);
    mt_status s = MT_OK;
    if (n) {
        t->pw[i] = (mti_tensor){.dtype = p->w.dtype, .ndim = 1, .shape = {(int64_t)n}};
        s = mti_tensor_alloc(ctx, &t->pw[i], MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                             MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
        if (!s) s = ctx->dev->memset8(ctx->dev, t->pw[i].blk.ptr, 0, t->pw[i].blk.bytes);
        if (!s && held && !p->unmade) s = ctx->dev->copy_d2d(ctx->dev, t->pw[i].blk.ptr, (char *)p->w.blk.ptr + lo * es, held * es);
        if (!s) s = ctx->dev->sync(ctx->dev);
        if (s) {
            mti_tensor_free(ctx, &t->pw[i]);
            return s;
        }
    }
    mti_tensor_free(ctx, &p->w); /* (its dtype and shape stay) */
    return MT_OK;
}

/* A hash of parameter i's whole weights (this rank's, before sharding). */
static mt_status weights_hash(mt_trainer *t, int i, uint64_t *h)
{
    mt_context *ctx = t->ctx;
    if (ctx->dry) return MT_OK;
    const size_t chunk = (size_t)1 << 20;
    void *buf = malloc(chunk);
    mt_status s = buf ? mti_tensor_hash(ctx, &t->model->params[i].w, buf, chunk, h)
                      : mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    free(buf);
    return s;
}

/* Every rank's pair of values (one all-gather; a dry run's are its own). */
static mt_status exchange(mt_trainer *t, const char *what, const int64_t rec[2], int64_t *all)
{
    if (live(t)) return mti_comm_host_gather(t->ctx, what, rec, all, 2 * sizeof *rec);
    for (int r = 0; r < t->world; r++) all[2 * r] = rec[0], all[2 * r + 1] = rec[1];
    return MT_OK;
}

/* The ranks' (status, weights hash) pairs in all differ in their hashes. */
static mt_status weights_differ(mt_trainer *t, const int64_t *all)
{
    char *shown = malloc((size_t)t->world * MTI_SHOWN), list[MTI_ERR_LEN / 2];
    if (!shown) return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    for (int r = 0; r < t->world; r++)
        mti_hash_shown((uint64_t)all[2 * r + 1], shown + (size_t)r * MTI_SHOWN);
    mti_ranks_values(list, sizeof list, t->world, (const unsigned char *)(all + 1), 2 * sizeof *all,
                     sizeof *all, shown, MTI_SHOWN);
    free(shown);
    return mti_fail(t->ctx, MT_ERR_COMM, "the ranks disagree on the weights: %s (make every rank's "
                    "model from the same seed or file)", list);
}

mt_status mti_zero3_shard(mt_trainer *t, mt_status s)
{
    mt_model *m = t->model;
    mt_context *ctx = t->ctx;
    const int N = t->world;
    t->pw = calloc((size_t)m->n_param, sizeof *t->pw);
    t->gb = calloc((size_t)m->n_param, sizeof *t->gb);
    t->gref = calloc((size_t)m->n_param, sizeof *t->gref);
    t->z3_ticket = calloc((size_t)m->n_param, sizeof *t->z3_ticket);
    t->z3_held = calloc((size_t)m->n_layers * 3 + 1, 1);
    t->z3_rs = calloc((size_t)m->n_param + 1, sizeof *t->z3_rs); /* (and the group being made) */
    t->z3_grp = calloc((size_t)m->n_layers * 3 + 1, sizeof *t->z3_grp);
    const int keep = t->cfg.zero3_keep;
    t->z3_prefetch = t->cfg.zero3_prefetch;
    t->z3_stream = t->z3_prefetch > 0 && mti_queue_planned(ctx) == MTI_QUEUE_STREAM;
    t->z3_keep_from = keep < 0 || keep > m->n_layers ? 0 : m->n_layers - keep;
    int64_t *all = malloc((size_t)N * 2 * sizeof *all);
    if (!(t->pw && t->gb && t->gref && t->z3_ticket && t->z3_held && t->z3_rs && t->z3_grp && all)) { /* (host memory) */
        free(all);
        return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    }
    /* first the ranks agree they all got here with the same weights */
    uint64_t h = MTI_HASH_START;
    for (int i = 0; i < m->n_param && !s; i++)
        if (mti_home_sliced(t, i) && !m->params[i].unmade) s = weights_hash(t, i, &h);
    if (!s && !ctx->dry) s = mti_source_mix(m, &h); /* a deferred model's: what its source makes */
    int64_t rec[2] = {s ? 1 : 0, (int64_t)h};
    const mti_msg own = mti_last_msg(ctx);
    mt_status c = exchange(t, "exchanging the ranks' statuses and weights", rec, all);
    int bad = -1, differs = -1;
    for (int r = 0; r < N && !c; r++) {
        if (bad < 0 && all[2 * r]) bad = r;
        if (differs < 0 && all[2 * r + 1] != all[1]) differs = r;
    }
    if (!c && (s || bad >= 0 || differs >= 0)) c = s ? mti_fail(ctx, s, "%s", own.s)
        : bad >= 0 ? mti_fail(ctx, MT_ERR_COMM, "rank %d failed", bad)
                   : weights_differ(t, all);
    if (c) {
        free(all);
        return c;
    }
    /* tensor by tensor, so the weights never cost more than whole plus one slice */
    rec[0] = 0;
    while (!s && rec[0] < m->n_param) {
        if (mti_home_sliced(t, (int)rec[0])) s = shard_one(t, (int)rec[0]);
        if (!s) rec[0]++;
    }
    const mti_msg own2 = mti_last_msg(ctx);
    if ((c = exchange(t, "exchanging how far the weights were sharded", rec, all))) {
        free(all);
        return c;
    }
    int64_t least = rec[0];
    int first = t->rank;
    for (int r = 0; r < N; r++)
        if (all[2 * r] < least) least = all[2 * r], first = r;
    if (least == m->n_param) {
        free(all);
        m->params_sharded = true;
        t->E.params_hook = mti_zero3_layer;
        t->E.params_user = t;
        return MT_OK;
    }
    /* some rank stopped early: every rank puts the weights back, those all
       ranks sharded from the slices, the others from a rank that still
       holds them whole */
    for (int i = 0; i < m->n_param; i++) {
        if (!mti_home_sliced(t, i)) continue;
        int root = -1;
        for (int r = 0; r < N && root < 0; r++)
            if (all[2 * r] <= i) root = r;
        (void)unshard_one(t, i, root);
    }
    free(all);
    if (s) return mti_fail(ctx, s, "%s", own2.s);
    return mti_fail(ctx, MT_ERR_COMM, "rank %d failed making its slices of the weights (at %s)",
                    first, m->params[least].name);
}

/* Whether parameter i's slice lives on disk (offload_params): then it is
 * read into the rank's part of the gather buffer before the gather. */
static bool on_disk(const mt_trainer *t, int i) { return mti_offload_has_weights(t->off, i); }

/* offload_params: this rank's slice of parameter i from its file into its
 * part of gather buffer g (zeros after it), on the stepping thread before
 * the gather is queued. A slice that cannot be read is zeros. */
static mt_status slice_in(mt_trainer *t, int i, const mti_tensor *g)
{
    const mti_shard *sh = &t->sh[i];
    const size_t es = mti_dtype_size(t->model->params[i].w.dtype), n = sh->hi - sh->lo;
    if (sh->owner >= 0 && t->rank != sh->owner) return MT_OK;
    const size_t part = sh->owner >= 0 ? n : sh->per;
    char *at = (char *)g->blk.ptr + (sh->owner >= 0 ? 0 : (size_t)t->rank * part * es);
    mt_status s = n ? mti_offload_weights_io(t->off, i, sh->lo, n, at, 0) : MT_OK;
    const size_t z = s ? 0 : n; /* (from here on, zeros) */
    if (z < part) (void)t->ctx->dev->memset8(t->ctx->dev, at + z * es, 0, (part - z) * es);
    return s;
}

/* Fills parameter i's gather buffer from the ranks' slices (on the
 * communication thread when the gathers are queued). */
static mt_status gather_run(void *user, int i)
{
    mt_trainer *t = user;
    mt_context *ctx = t->ctx;
    const mti_param *p = &t->model->params[i];
    const mti_shard *sh = &t->sh[i];
    const size_t es = mti_dtype_size(p->w.dtype);
    mti_tensor *g = &t->gb[i];
    const bool disk = on_disk(t, i); /* (the rank's part is in g already) */
    char what[112];
    snprintf(what, sizeof what, "the all-gather of the weights of %s", p->name);
    mt_status s = MT_OK;
    if (sh->owner >= 0) {
        if (t->rank == sh->owner && !disk)
            s = ctx->dev->copy_d2d(ctx->dev, g->blk.ptr, t->pw[i].blk.ptr, p->numel * es);
        if (!s && live(t))
            s = mti_comm_broadcast(ctx, what, g->blk.ptr, p->numel * es, MT_COMM_BYTE, sh->owner);
        return s;
    }
    const size_t part = sh->per * es;
    char *mine = (char *)g->blk.ptr + (size_t)t->rank * part;
    if (live(t))
        return mti_comm_all_gather(ctx, what, disk ? mine : t->pw[i].blk.ptr, g->blk.ptr, part,
                                   MT_COMM_BYTE);
    return disk ? MT_OK : ctx->dev->copy_d2d(ctx->dev, mine, t->pw[i].blk.ptr, part);
}

/* Whether gathers go to the communication thread (or NCCL's stream). */
static bool queued(const mt_trainer *t)
{
    return t->q && t->z3_prefetch > 0 && live(t);
}

/* Whether an entry's gathers go packed through the staging buffer: a CPU
 * context's host communicator, whose collectives run there anyway. A dry
 * context (no collectives) and NCCL's stream (on the buffers themselves)
 * gather tensor by tensor. */
static bool packed(const mt_trainer *t)
{
    return live(t) && mti_comm_stage(t->ctx);
}

/* The queue's calls: the thread's, or the stream's. */
static mt_status q_call(mt_trainer *t, mti_queue_fn fn, int i, uint64_t *ticket)
{
    return mti_queue_call(t->q, fn, t, i, ticket);
}

static mt_status q_done(mt_trainer *t, uint64_t ticket)
{
    return mti_queue_done(t->q, ticket);
}

static mt_status q_quiet(mt_trainer *t, bool reset)
{
    return mti_queue_quiet(t->q, reset);
}

/* Brings parameter i in (one more holder): its buffer made and its gather
 * run, or queued (then z3_ticket[i] names it until it is waited for). */
/* Parameter i's gather buffer made (COMM, the whole tensor's bytes, or
 * N slices' with the padding). */
static mt_status gather_buf(mt_trainer *t, int i)
{
    mti_tensor *g = &t->gb[i];
    const size_t es = mti_dtype_size(t->model->params[i].w.dtype);
    *g = (mti_tensor){.dtype = MTI_U8, .ndim = 1, .shape = {(int64_t)(gather_elems(t, i) * es)}};
    return mti_tensor_alloc(t->ctx, g, MT_MEM_COMM, MT_LIFE_STEP, MTI_TAG_PARAM(MTI_TAG_COMM, i));
}

static mt_status gather_in(mt_trainer *t, int i)
{
    if (t->gref[i]++) return MT_OK;
    mt_context *ctx = t->ctx;
    mti_param *p = &t->model->params[i];
    mti_tensor *g = &t->gb[i];
    mt_status s = gather_buf(t, i);
    const mt_status ls = !s && on_disk(t, i) ? slice_in(t, i, g) : MT_OK;
    if (!s && ls) { /* its slice lost: the others are not left waiting in the gather */
        s = gather_run(t, i); /* (zeros from here, at once, after the queue) */
        if (!s) s = ls;
    } else if (!s) {
        s = queued(t) ? q_call(t, gather_run, i, &t->z3_ticket[i]) : gather_run(t, i);
    }
    if (s) {
        mti_tensor_free(ctx, g);
        t->gref[i]--;
        return s;
    }
    p->w.blk = g->blk;
    return MT_OK;
}

/* Waits for parameter i's queued gather, if any. */
static mt_status gather_wait(mt_trainer *t, int i)
{
    if (!t->z3_ticket || !t->z3_ticket[i]) return MT_OK;
    const mt_status s = q_done(t, t->z3_ticket[i]);
    t->z3_ticket[i] = 0;
    return s;
}

/* Lets parameter i go (one holder fewer). */
static void gather_out(mt_trainer *t, int i)
{
    if (!t->gref[i] || --t->gref[i]) return;
    if (t->z3_ticket && t->z3_ticket[i]) { /* (never freed under the thread's feet) */
        (void)q_quiet(t, false);
        t->z3_ticket[i] = 0;
    }
    memset(&t->model->params[i].w.blk, 0, sizeof(mt_block));
    mti_tensor_free(t->ctx, &t->gb[i]);
}

/* The parameters layer `layer` needs for its forward or backward: *n of
 * them into idx (at most np + 1). */
static int layer_params(const mt_trainer *t, int layer, int bwd, int *idx)
{
    const mti_layer *ly = &t->model->layers[layer];
    int n = 0;
    for (int j = 0; j < ly->np; j++) {
        if (bwd && ly->kind == MT_LAYER_EMBEDDING && (j == 0 || (ly->positions && j == 1)))
            continue; /* the table's and positions' gradients need no weights */
        idx[n++] = ly->p0 + j;
    }
    if (ly->tied >= 0) idx[n++] = ly->tied;
    return n;
}

/* ---- gradients reduce-scattered on the communication thread ---- */

bool mti_zero3_later(const mt_trainer *t) { return t->zero == 3 && t->z3_prefetch > 0 && t->z3_rs; }

/* On NCCL's stream (or planned so: z3_stream) in two halves: the chunks
 * queued here, the sums taken at the retire. */
static mt_status reduce_run(void *user, int i)
{
    mt_trainer *t = user;
    struct mti_z3_rs *r = &t->z3_rs[i];
    return mti_zero_reduce_phase(t, i, t->E.grad[i].blk.ptr, 0, t->model->params[i].numel, r->dst, 1,
                                 r->bucket.blk.ptr, t->z3_stream ? MTI_ZR_POST : MTI_ZR_ALL);
}

/* A layer's reduce-scatters packed (on a CPU context's host communicator,
 * with the queue): its gradients are kept in a group (z3_rs[n_param], the
 * group being made: `next` its first parameter, `dst` unused, `tag` its
 * entry), linked by `next` in the order they came, and the group goes to
 * the queue as one job when the next entry starts (or the pass ends):
 * where the job of each gradient was queued before, ahead of the next
 * entry's gathers. A whole-tensor owner's gradient (an all-reduce) goes
 * alone, as before. */
static bool grouped_rs(const mt_trainer *t) { return packed(t) && queued(t) && !t->z3_stream; }

/* Rank r's elements of parameter i's gradient: [r per, r per + len). */
static size_t rs_len(const mt_trainer *t, int i, int r)
{
    size_t lo, hi;
    mti_zero_range(t, i, r, &lo, &hi);
    return hi - lo;
}

/* The group starting at parameter `first`, reduce-scattered: each rank's
 * pieces of the group's gradients laid end to end, a slice's `per` each
 * (zeros past a short last slice), as many as fill the staging buffer's
 * part of a rank, one reduce-scatter per fill, this rank's sums added onto
 * its shards. The same sums of the same values as a reduce-scatter per
 * tensor, so the same bits, in fewer collectives. */
static mt_status reduce_group(void *user, int first)
{
    mt_trainer *t = user;
    mt_context *ctx = t->ctx;
    mti_device *d = ctx->dev;
    const mti_kctx k = {ctx, d};
    const int N = t->world, me = t->rank;
    const size_t K = MTI_COMM_STAGE / 4 / (size_t)N; /* values of a rank's part of a fill */
    float *st = mti_comm_stage(ctx);
    int last = first;
    while (t->z3_rs[last].next >= 0) last = t->z3_rs[last].next;
    char what[160];
    snprintf(what, sizeof what, "the reduce-scatter of the gradients of %s%s%s",
             t->model->params[first].name, last != first ? " .. " : "",
             last != first ? t->model->params[last].name : "");
    mt_status s = mti_comm_turn(ctx, what); /* (the staging is the queue's until then) */
    int j = first;
    size_t o = 0; /* the fill starts at element o of the slices of j */
    while (j >= 0 && !s) {
        size_t F = 0, o1 = o;
        int j1 = j;
        while (j1 >= 0 && F < K) {
            const size_t per = t->sh[j1].per, l = per - o1 < K - F ? per - o1 : K - F;
            F += l, o1 += l;
            if (o1 == per) j1 = t->z3_rs[j1].next, o1 = 0;
        }
        for (int r = 0; r <= N && !s; r++) { /* each rank's pieces in; at N, this rank's sums out */
            const int q = r < N ? r : me;
            size_t at = 0, oo = o;
            for (int i = j; at < F && !s;) {
                const size_t per = t->sh[i].per, l = per - oo < F - at ? per - oo : F - at;
                const size_t len = rs_len(t, i, q), v = len > oo ? (len - oo < l ? len - oo : l) : 0;
                const float *g = t->E.grad[i].blk.ptr;
                float *b = st + (size_t)q * F + at, *dst = t->z3_rs[i].dst;
                if (r < N) { /* (no gradient: zeros) */
                    if (v && g) s = d->copy_d2d(d, b, g + (size_t)q * per + oo, v * 4);
                    const size_t z = g ? v : 0;
                    if (!s && z < l) s = d->memset8(d, b + z, 0, (l - z) * 4);
                } else if (v && dst) {
                    s = ctx->ops->accumulate(&k, dst + oo, b, v, MTI_F32);
                }
                at += l, oo += l;
                if (oo == per) i = t->z3_rs[i].next, oo = 0;
            }
            if (r == N - 1 && !s) s = mti_comm_reduce_scatter_stage(ctx, what, F);
        }
        j = j1, o = o1;
    }
    return s;
}

/* The group being made goes to the queue (or, queueing refused, runs at
 * once, so every rank still makes its collectives in one order). */
static mt_status flush(mt_trainer *t)
{
    struct mti_z3_rs *h = &t->z3_rs[t->model->n_param];
    if (!h->pending) return MT_OK;
    h->pending = false;
    const int first = h->next;
    const bool one = t->z3_rs[first].next < 0;
    uint64_t ticket = 0;
    mt_status s = one ? q_call(t, reduce_run, first, &ticket) : q_call(t, reduce_group, first, &ticket);
    if (s) s = one ? reduce_run(t, first) : reduce_group(t, first);
    for (int i = first; i >= 0; i = t->z3_rs[i].next) t->z3_rs[i].ticket = ticket;
    return s;
}

/* Retires the reduce-scatters queued before schedule entry `before` (all:
 * INT_MAX): each waited for, its bucket and gradient freed. s: the status
 * so far; a failure of theirs is returned only where s is MT_OK. */
static mt_status retire(mt_trainer *t, int before, mt_status s)
{
    if (t->z3_rs[t->model->n_param].pending && t->z3_rs[t->model->n_param].tag < before) {
        const mt_status f = flush(t); /* (its collectives made on every rank) */
        if (!s) s = f;
    }
    for (int i = t->model->n_param - 1; i >= 0; i--) {
        struct mti_z3_rs *r = &t->z3_rs[i];
        if (!r->pending || r->tag >= before) continue;
        if (r->ticket) {
            if (!s) s = q_done(t, r->ticket);
            else (void)q_quiet(t, false);
            r->ticket = 0;
        }
        if (!s && t->z3_stream)
            s = mti_zero_reduce_phase(t, i, t->E.grad[i].blk.ptr, 0, t->model->params[i].numel, r->dst,
                                      1, r->bucket.blk.ptr, MTI_ZR_FINISH);
        mti_tensor_free(t->ctx, &r->bucket);
        mti_tensor_free(t->ctx, &t->E.grad[i]);
        r->pending = false;
    }
    return s;
}

mt_status mti_zero3_reduce(mt_trainer *t, int i, float *dst)
{
    struct mti_z3_rs *r = &t->z3_rs[i];
    mt_status s = retire(t, t->E.at, MT_OK); /* the layer before this one's */
    if (s) return s;
    const size_t n = t->model->params[i].numel;
    const size_t bytes = t->z3_stream ? mti_zero_reduce_bytes_all(t, i, 0, n) : mti_zero_reduce_bytes(t, i, 0, n);
    if (bytes && (s = mti_comm_buffer(t->ctx, &r->bucket, bytes))) return s;
    r->dst = dst;
    r->tag = t->E.at;
    r->pending = true;
    r->next = -1;
    struct mti_z3_rs *h = &t->z3_rs[t->model->n_param];
    if (grouped_rs(t) && t->sh[i].owner < 0) { /* into the group (retire flushed an older one) */
        if (!h->pending) *h = (struct mti_z3_rs){.next = i, .tag = t->E.at, .pending = true};
        else {
            int last = h->next;
            while (t->z3_rs[last].next >= 0) last = t->z3_rs[last].next;
            t->z3_rs[last].next = i;
        }
        r->ticket = 0;
        return MT_OK;
    }
    if ((s = flush(t))) return s;
    return queued(t) ? q_call(t, reduce_run, i, &r->ticket) : reduce_run(t, i);
}

mt_status mti_zero3_settle(mt_trainer *t, mt_status s)
{
    return t->z3_rs ? retire(t, INT_MAX, s) : s;
}

/* Schedule entry p's parameters (sharded ones) into idx: how many. */
static int entry_params(const mt_trainer *t, int p, int *idx)
{
    const int e = t->E.sched[p];
    int all[MTI_SLOTS + 2], n = 0;
    const int k = layer_params(t, e / 2, e % 2, all);
    for (int j = 0; j < k; j++)
        if (mti_home_sliced(t, all[j])) idx[n++] = all[j];
    return n;
}

/* Rank r's part of sharded parameter i in its gather buffer. */
static char *part_of(const mt_trainer *t, int i, int r)
{
    const size_t part = t->sh[i].per * mti_dtype_size(t->model->params[i].w.dtype);
    return (char *)t->gb[i].blk.ptr + (size_t)r * part;
}

/* Entry p's group gathered: the slices of its tensors laid end to end, as
 * many as fill the staging buffer's part of a rank (a tensor's slice
 * continuing in the next fill where it does not fit), each fill one
 * all-gather in place, then every rank's pieces copied to their places in
 * the gather buffers; a whole-tensor owner's tensor broadcast on its own.
 * The same bytes as a gather per tensor (so the bits are), in a third or
 * less of the collectives: GPT-2's block has 4 matrices and 8 vectors, a
 * collective per vector before. Every rank's group is the same list, so the
 * fills match. On the communication thread when queued. */
static mt_status group_run(void *user, int p)
{
    mt_trainer *t = user;
    mt_context *ctx = t->ctx;
    mti_device *d = ctx->dev;
    const struct mti_z3_group *grp = &t->z3_grp[p];
    const int N = t->world, me = t->rank;
    const size_t K = MTI_COMM_STAGE / (size_t)N; /* bytes of a rank's part of a fill */
    char *st = mti_comm_stage(ctx), what[160];
    snprintf(what, sizeof what, "the all-gather of the weights of %s%s%s",
             t->model->params[grp->idx[0]].name, grp->n > 1 ? " .. " : "",
             grp->n > 1 ? t->model->params[grp->idx[grp->n - 1]].name : "");
    mt_status s = mti_comm_turn(ctx, what); /* (the staging is the queue's until then) */
    int j = 0;
    size_t o = 0; /* the fill starts at byte o of the slice of idx[j] */
    while (j < grp->n && !s) {
        if (t->sh[grp->idx[j]].owner >= 0) {
            s = gather_run(t, grp->idx[j++]);
            continue;
        }
        /* the fill: F bytes, up to (j1, o1) */
        size_t F = 0, o1 = o;
        int j1 = j;
        while (j1 < grp->n && F < K && t->sh[grp->idx[j1]].owner < 0) {
            const int i = grp->idx[j1];
            const size_t part = t->sh[i].per * mti_dtype_size(t->model->params[i].w.dtype);
            const size_t l = part - o1 < K - F ? part - o1 : K - F;
            F += l, o1 += l;
            if (o1 == part) j1++, o1 = 0;
        }
        for (int r = -1; r < N && !s; r++) { /* -1: this rank's slices in; then each rank's out */
            size_t at = 0, oo = o;
            for (int jj = j; at < F && !s;) {
                const int i = grp->idx[jj];
                const size_t part = t->sh[i].per * mti_dtype_size(t->model->params[i].w.dtype);
                const size_t l = part - oo < F - at ? part - oo : F - at;
                if (r < 0) {
                    const char *src = on_disk(t, i) ? part_of(t, i, me) : (const char *)t->pw[i].blk.ptr;
                    if (l) s = d->copy_d2d(d, st + (size_t)me * F + at, src + oo, l);
                } else if (l) {
                    s = d->copy_d2d(d, part_of(t, i, r) + oo, st + (size_t)r * F + at, l);
                }
                at += l, oo += l;
                if (oo == part) jj++, oo = 0;
            }
            if (r < 0 && !s && F) s = mti_comm_all_gather_stage(ctx, what, F);
        }
        j = j1, o = o1;
    }
    return s;
}

/* Brings in entry p's weights packed (packed above): each parameter one
 * holder more, those not in yet given their gather buffers and, together,
 * one job. A slice on disk that cannot be read is zeros: the group is still
 * gathered, at once, so the other ranks are not left in its collectives,
 * and the entry fails. */
static mt_status take_packed(mt_trainer *t, int p, const int *idx, int n)
{
    struct mti_z3_group *grp = &t->z3_grp[p];
    if (grp->ticket) (void)q_done(t, grp->ticket); /* (never rewritten under the thread's feet) */
    grp->ticket = 0;
    grp->n = 0;
    mt_status s = MT_OK, ls = MT_OK;
    int j = 0;
    for (; j < n && !s; j++) {
        const int i = idx[j];
        if (t->gref[i]++) continue;
        if ((s = gather_buf(t, i))) {
            t->gref[i]--;
            break;
        }
        t->model->params[i].w.blk = t->gb[i].blk;
        grp->idx[grp->n++] = i;
        if (on_disk(t, i)) {
            const mt_status r = slice_in(t, i, &t->gb[i]);
            if (!ls) ls = r;
        }
    }
    if (!s && grp->n)
        s = ls || !queued(t) ? group_run(t, p) : q_call(t, group_run, p, &grp->ticket);
    if (!s) s = ls;
    if (s) {
        while (j-- > 0) gather_out(t, idx[j]); /* undo this entry's */
        grp->ticket = 0;
        return s;
    }
    for (int k = 0; k < grp->n; k++) t->z3_ticket[grp->idx[k]] = grp->ticket;
    t->z3_held[p] = 1;
    return MT_OK;
}

/* Brings in entry p's weights (each parameter one holder more). */
static mt_status take(mt_trainer *t, int p)
{
    int idx[MTI_SLOTS + 2];
    const int n = entry_params(t, p, idx);
    if (packed(t)) return take_packed(t, p, idx, n);
    for (int j = 0; j < n; j++) {
        const mt_status s = gather_in(t, idx[j]);
        if (!s) continue;
        while (j-- > 0) gather_out(t, idx[j]); /* undo this entry's */
        return s;
    }
    t->z3_held[p] = 1;
    return MT_OK;
}

/* Lets entry p's weights go, if it holds them. */
static void give(mt_trainer *t, int p)
{
    if (!t->z3_held[p]) return;
    int idx[MTI_SLOTS + 2];
    const int n = entry_params(t, p, idx);
    for (int j = 0; j < n; j++) gather_out(t, idx[j]);
    t->z3_held[p] = 0;
}

/* The engine's schedule is over or replaced: what was brought in ahead
 * goes, and a failure on the thread that broke the communicator is
 * forgotten (it was reported, or belonged to a gather nobody used; the
 * broken communicator fails the next collective, at the latest the step's
 * status exchange). Nothing is lost with it on the thread: a
 * reduce-scatter still pending here (backward failed or its schedule was
 * replaced) that failed on this rank alone is held by the queue, not by
 * its retire, and the step's status exchange reports it on every rank
 * (overlap.c; NCCL's stream says its own, nccl_overlap.c). */
static void drop_all(mt_trainer *t)
{
    (void)mti_zero3_settle(t, MT_ERR_STATE); /* (a pass that failed part way) */
    if (queued(t)) (void)q_quiet(t, true);
    for (int p = 0; p < 3 * t->model->n_layers + 1; p++) {
        give(t, p);
        t->z3_grp[p].ticket = 0; /* (the queue is quiet) */
    }
}

mt_status mti_zero3_layer(void *user, int layer, int bwd, int in)
{
    mt_trainer *t = user;
    const mti_engine *E = &t->E;
    if (layer < 0) {
        drop_all(t);
        return MT_OK;
    }
    const int at = E->at;
    if (in && t->z3_rs && t->z3_rs[t->model->n_param].pending) { /* the entry before's reduce-scatters */
        const mt_status f = flush(t);
        if (f) return f;
    }
    if (!in) {
        if (!bwd && layer >= t->z3_keep_from) /* kept: its next entry holds it from now */
            for (int q = at + 1; q < E->n_sched; q++) {
                if (E->sched[q] / 2 != layer) continue;
                if (!t->z3_held[q]) (void)take(t, q); /* (no gather: its weights are in) */
                break;
            }
        give(t, at);
        return MT_OK;
    }
    mt_status s = t->z3_held[at] ? MT_OK : take(t, at);
    for (int q = at + 1; q <= at + t->z3_prefetch && q < E->n_sched && !s; q++)
        if (!t->z3_held[q]) s = take(t, q);
    int idx[MTI_SLOTS + 2];
    const int n = s ? 0 : entry_params(t, at, idx);
    for (int j = 0; j < n && !s; j++) s = gather_wait(t, idx[j]);
    if (s) give(t, at);
    return s;
}

mt_status mti_zero3_unshard(mt_trainer *t)
{
    mt_model *m = t->model;
    mt_status s = MT_OK;
    if (!t->pw || !m->params_sharded) return MT_OK;
    t->E.params_hook = NULL;
    for (int i = 0; i < m->n_param; i++) {
        mt_status g = mti_home_sliced(t, i) ? unshard_one(t, i, -1) : MT_OK;
        if (!s) s = g;
    }
    m->params_sharded = false;
    return s;
}

void mti_zero3_free(mt_trainer *t)
{
    if (t->pw)
        for (int i = 0; i < t->model->n_param; i++) {
            mti_tensor_free(t->ctx, &t->gb[i]);
            mti_tensor_free(t->ctx, &t->pw[i]);
        }
    if (t->z3_rs) (void)mti_zero3_settle(t, MT_ERR_STATE); /* (the pass's end did it) */
    free(t->pw), free(t->gb), free(t->gref), free(t->z3_ticket), free(t->z3_held), free(t->z3_rs);
    free(t->z3_grp);
    t->z3_rs = NULL;
    t->z3_grp = NULL;
    t->pw = t->gb = NULL;
    t->gref = NULL;
    t->z3_ticket = NULL;
    t->z3_held = NULL;
}
