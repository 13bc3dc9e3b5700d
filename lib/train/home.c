/*
 * home.c - a parameter's home on this rank (home.h): the table of kinds,
 * one entry each, and the step's questions answered through it.
 *
 * An entry has two sides (home.h): a share's answers (its fields from
 * `split` to `bucket`; a kind that is no share leaves them empty) and a
 * kept-where's (from `state_here` on; NULL where the kind does nothing
 * there). The device's kinds are both: a parameter resident, or a ZeRO
 * slice on the device, has the same entry as kind and share. Host and
 * disk are kinds over a share: a ZeRO-2 slice on disk asks the ZeRO-1/2
 * entry how the ranks share it and the disk entry where it is kept.
 *
 * A new home (a tensor-parallel shard, a pipeline stage) is one more
 * mti_home_kind, one more entry below, and a line in mti_home_choose.
 */
#include <stdlib.h>

#include "train/home.h"
#include "train/dp.h"
#include "train/offload.h"

typedef struct mti_home_ops {
    const char *name;
    /* ---- the share: how the ranks split the parameter ---- */
    /* each rank holds, checks and updates a slice of the master and state */
    bool split;
    /* the updated weights are gathered from the slices' owners */
    bool gathers;
    /* the unfused step's gradient is reduced into this rank's slice in
       backward (t->gs); NULL: never */
    bool (*grad_sliced)(const mt_trainer *t);
    /* mti_home_reduce, mti_home_reduce_grad, mti_home_bucket */
    mt_status (*reduce)(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst,
                        void *bucket, int phase);
    mt_status (*reduce_grad)(mt_trainer *t, int i);
    size_t (*bucket)(const mt_trainer *t, int i, size_t n);
    /* ---- the kind: where this rank's part is kept ---- */
    /* the state is in this process's memory (made by the trainer) */
    bool state_here;
    /* updates land after they return (by the step's end) */
    bool queued;
    /* mti_home_locate, mti_home_update */
    void (*locate)(const mt_trainer *t, int i, size_t at, mti_home_loc *l);
    mt_status (*update)(mt_trainer *t, int i, const float *g, size_t at, size_t n,
                        float grad_scale, mti_home_span span);
    /* the share's gather of the updated weights waits for the step's end
       (NULL: never) */
    bool (*delays)(const mt_trainer *t);
    /* the step's end waits for the ranks to agree that the updates landed
       (NULL: never) */
    bool (*agrees)(const mt_trainer *t);
    /* the step begins; the updates land (queued ones done, pieces written);
       the step's last word (every piece home); NULL: nothing to do */
    mt_status (*begin)(mt_trainer *t);
    mt_status (*land)(mt_trainer *t);
    mt_status (*finish)(mt_trainer *t);
    /* at the step's end, whether a gathering share's weights are gathered
       then (updated: the unfused step updated) */
    bool (*late)(const mt_trainer *t, bool updated);
    /* what the ranks agree on at the end: the landing, the late gathers
       (NULL: no agreement) */
    const char *landed, *gathered;
} mti_home_ops;

/* ---- the shares ---- */

static const mti_home_ops *share_of(const mt_trainer *t, int i);

/* whether parameter i's gradient is kept as this rank's slice (t->gs[i]) */
static bool kept_sliced(const mt_trainer *t, int i)
{
    const mti_home_ops *h = share_of(t, i);
    return h->grad_sliced && h->grad_sliced(t) && !t->cfg.fused_step;
}

static bool stage2(const mt_trainer *t) { return t->zero >= 2; }
static bool always(const mt_trainer *t) { return true; }

/* whole on every rank: gradients summed in place */
static mt_status reduce_whole(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst,
                              void *bucket, int phase)
{
    return phase == MTI_ZR_FINISH ? MT_OK : mti_dp_reduce(t, i, g, n);
}

static size_t no_bucket(const mt_trainer *t, int i, size_t n) { return 0; }

/* slices: each rank's elements to it (reduce-scatter) */
static mt_status reduce_slice(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst,
                              void *bucket, int phase)
{
    return mti_zero_reduce_phase(t, i, g, at, n, dst, 0, bucket, phase);
}

static mt_status reduce_grad_slice(mt_trainer *t, int i)
{
    if (kept_sliced(t, i)) return MT_OK; /* (reduced into it in backward) */
    mti_tensor *g = NULL;
    mt_status s = mti_engine_grad(&t->E, i, &g); /* one the batch did not reach: zeros */
    float *p = g ? g->blk.ptr : NULL;
    return s ? s : reduce_slice(t, i, p, 0, t->model->params[i].numel, p + t->sh[i].lo, NULL,
                                MTI_ZR_ALL);
}

static size_t slice_bucket(const mt_trainer *t, int i, size_t n)
{
    return mti_zero_reduce_bytes_all(t, i, 0, n);
}

/* ---- the kinds: in memory ---- */

/* the device, or pinned host memory (unified addressing: the same pointers) */
static void locate_memory(const mt_trainer *t, int i, size_t at, mti_home_loc *l)
{
    const mti_param *p = &t->model->params[i];
    l->w = mti_home_weights(t, i, at);
    l->master = t->model->has_master ? (float *)p->master.blk.ptr + (at - p->master_lo) : NULL;
    mti_home_state_at(t, i, at, l->st);
}

static mt_status update_memory(mt_trainer *t, int i, const float *g, size_t at, size_t n,
                               float grad_scale, mti_home_span span)
{
    return span(t, i, g, at, n, grad_scale);
}

/* ---- pinned host memory (offload_host.c) ---- */

static mt_status update_host(mt_trainer *t, int i, const float *g, size_t at, size_t n,
                             float grad_scale, mti_home_span span)
{
    return mti_hostoff_update(t->hoff, i, g, at, n, grad_scale); /* queued */
}

static mt_status land_host(mt_trainer *t) { return mti_hostoff_end(t->hoff); }

/* host offload's updates land later: the gathers wait, and the ranks agree */
static bool late_host(const mt_trainer *t, bool updated) { return true; }

/* ---- disk (offload.c) ---- */

/* the acquired piece's (mti_home_update brought it in); the weights there
   too with offload_params, else at home in memory */
static void locate_disk(const mt_trainer *t, int i, size_t at, mti_home_loc *l)
{
    const mti_offload *o = t->off;
    l->w = mti_offload_has_weights(o, i) ? mti_offload_weights(o, at) : mti_home_weights(t, i, at);
    l->master = t->model->has_master ? mti_offload_master(o, at) : NULL;
    for (int j = 0; j < MTI_OPT_SLOTS; j++)
        l->st[j] = t->ps[i].lay.s[j].numel ? mti_offload_state(o, j, at) : NULL;
}

/* piece by piece on the offload's grid, each brought in first (its update
   is the bits of the whole tensor's: the grid is a multiple of every slice
   alignment); pieces go home as the next ones come in, and at the step's
   end */
static mt_status update_disk(mt_trainer *t, int i, const float *g, size_t at, size_t n,
                             float grad_scale, mti_home_span span)
{
    const size_t piece = mti_offload_piece(t->off, i);
    mt_status s = MT_OK;
    for (size_t e = at, len; e < at + n && !s; e += len) {
        len = (e / piece + 1) * piece - e;
        if (len > at + n - e) len = at + n - e;
        s = mti_offload_acquire(t->off, i, e);
        if (!s) s = span(t, i, g + (e - at), e, len, grad_scale);
    }
    return s;
}

/* the unfused step's gathers wait for the ranks to agree that every
   piece's update reached its file, so a disk that fails on one rank fails
   the step on every rank, none left in a gather */
static bool delays_disk(const mt_trainer *t) { return !t->cfg.fused_step; }

/* on several ranks a disk fails on one rank alone, and a rank that
   returned its failure by itself would be ended (MPI_Abort) with the
   others in their next collective: a failed update goes to the agreement */
static bool agrees_disk(const mt_trainer *t) { return t->world > 1; }
static mt_status begin_disk(mt_trainer *t) { return mti_offload_begin(t->off); }
static mt_status land_disk(mt_trainer *t) { return mti_offload_end(t->off); }
static bool late_disk(const mt_trainer *t, bool updated) { return updated; }

/* what the device's kinds share: kept in memory, updated in place; and
   the shares that cut the master and state into the ranks' slices */
#define IN_MEMORY .state_here = true, .locate = locate_memory, .update = update_memory
#define SLICES .split = true, .reduce = reduce_slice, .reduce_grad = reduce_grad_slice, \
               .bucket = slice_bucket

static const mti_home_ops kinds[] = {
    [MTI_HOME_RESIDENT] = {.name = "resident",
                           .reduce = reduce_whole,
                           .reduce_grad = mti_dp_reduce_grad,
                           .bucket = no_bucket,
                           IN_MEMORY},
    [MTI_HOME_ZERO12] = {.name = "ZeRO-1/2 slice", SLICES, .gathers = true, .grad_sliced = stage2,
                         IN_MEMORY},
    [MTI_HOME_ZERO3] = {.name = "ZeRO-3 slice", SLICES, .grad_sliced = always, IN_MEMORY},
    [MTI_HOME_HOST] = {.name = "pinned host memory",
                       .state_here = true,
                       .queued = true,
                       .locate = locate_memory,
                       .update = update_host,
                       .delays = always,
                       .agrees = always,
                       .land = land_host,
                       .late = late_host,
                       .landed = "the host offload's updates"},
    [MTI_HOME_DISK] = {.name = "disk",
                       .locate = locate_disk,
                       .update = update_disk,
                       .delays = delays_disk,
                       .agrees = agrees_disk,
                       .begin = begin_disk,
                       .land = land_disk,
                       .finish = land_disk,
                       .late = late_disk,
                       .landed = "the updates on disk",
                       .gathered = "the gathers of the weights on disk"},
};
_Static_assert(sizeof kinds / sizeof *kinds == MTI_HOME_KINDS, "an entry per mti_home_kind");

/* ---- choosing ---- */

mt_status mti_home_choose(mt_trainer *t)
{
    const mt_model *m = t->model;
    free(t->home);
    t->home = calloc((size_t)m->n_param + 1, sizeof *t->home);
    if (!t->home) return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    t->home_used = 0;
    for (int i = 0; i < m->n_param; i++) {
        const bool trained = !m->params[i].frozen;
        const int share = !trained ? MTI_HOME_RESIDENT
                          : mti_home_sliced(t, i) ? MTI_HOME_ZERO3
                          : t->zero ? MTI_HOME_ZERO12
                                    : MTI_HOME_RESIDENT;
        const int kind = trained && t->hoff  ? MTI_HOME_HOST
                         : trained && t->off ? MTI_HOME_DISK
                                             : share;
        t->home[i] = (mti_home){.kind = (unsigned char)kind, .share = (unsigned char)share};
        t->home_used |= 1u << kind | 1u << share;
    }
    return MT_OK;
}

static const mti_home_ops *kind_of(const mt_trainer *t, int i) { return &kinds[t->home[i].kind]; }
static const mti_home_ops *share_of(const mt_trainer *t, int i) { return &kinds[t->home[i].share]; }

/* the kinds and shares some parameter has, in kind order */
#define EACH_USED(t, k)                                                                            \
    for (const mti_home_ops *k = kinds; k < kinds + MTI_HOME_KINDS; k++)                           \
        if ((t)->home_used & 1u << (k - kinds))

bool mti_home_state_here(const mt_trainer *t, int i) { return kind_of(t, i)->state_here; }

/* ---- parameter i ---- */

float *mti_home_own(mt_trainer *t, int i, size_t *at, size_t *n)
{
    *at = t->sh[i].lo;
    *n = t->sh[i].hi - t->sh[i].lo;
    if (kept_sliced(t, i)) return t->gs[i].blk.ptr;
    return t->E.grad[i].blk.ptr ? (float *)t->E.grad[i].blk.ptr + *at : NULL;
}

mt_status mti_home_reduce(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst,
                          void *bucket, int phase)
{
    return share_of(t, i)->reduce(t, i, g, at, n, dst, bucket, phase);
}

mt_status mti_home_reduce_grad(mt_trainer *t, int i) { return share_of(t, i)->reduce_grad(t, i); }

size_t mti_home_bucket(const mt_trainer *t, int i, size_t n)
{
    return share_of(t, i)->bucket(t, i, n);
}

void mti_home_locate(const mt_trainer *t, int i, size_t at, mti_home_loc *l)
{
    kind_of(t, i)->locate(t, i, at, l);
}

mt_status mti_home_update(mt_trainer *t, int i, const float *g, size_t at, size_t n,
                          float grad_scale, mti_home_span span)
{
    return kind_of(t, i)->update(t, i, g, at, n, grad_scale, span);
}

bool mti_home_gathers_now(const mt_trainer *t, int i)
{
    const mti_home_ops *k = kind_of(t, i);
    return share_of(t, i)->gathers && !(k->delays && k->delays(t));
}

/* ---- the step ---- */

bool mti_home_split(const mt_trainer *t)
{
    EACH_USED(t, k) if (k->split) return true;
    return false;
}

bool mti_home_grad_sliced(const mt_trainer *t)
{
    EACH_USED(t, k) if (k->grad_sliced && k->grad_sliced(t)) return true;
    return false;
}

mt_status mti_home_begin(mt_trainer *t)
{
    mt_status s = MT_OK;
    EACH_USED(t, k) if (!s && k->begin) s = k->begin(t);
    return s;
}

bool mti_home_agrees(const mt_trainer *t)
{
    EACH_USED(t, k) if (k->agrees && k->agrees(t)) return true;
    return false;
}

mt_status mti_home_end(mt_trainer *t, const char *fn, mt_status s, bool updated)
{
    EACH_USED(t, k) if (k->land) {
        const mt_status e = k->land(t);
        if (!s) s = e;
        if (t->world > 1) s = mti_dp_agree_status(t, fn, k->landed, s);
    }
    bool gather = false; /* (in parameter order on every rank, trained ones) */
    for (int i = 0; i < t->model->n_param && !gather; i++) {
        const mti_home_ops *k = kind_of(t, i);
        gather = share_of(t, i)->gathers && k->late && k->late(t, updated);
    }
    if (s || !gather) return s;
    s = mti_zero_gather_every(t);
    EACH_USED(t, k) if (k->gathered) s = mti_dp_agree_status(t, fn, k->gathered, s);
    return s;
}

mt_status mti_home_finish(mt_trainer *t)
{
    mt_status s = MT_OK;
    EACH_USED(t, k) if (!s && k->finish) s = k->finish(t);
    return s;
}

void mti_home_abandon(mt_trainer *t)
{
    if (!t->home) return; /* (a failed create's) */
    EACH_USED(t, k) if (k->land) (void)k->land(t);
}

bool mti_home_queued(const mt_trainer *t)
{
    EACH_USED(t, k) if (k->queued) return true;
    return false;
}
