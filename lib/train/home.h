/*
 * home.h - a parameter's home on this rank (home.c): where its weights,
 * master, gradient and optimizer state live, and how the step brings them
 * in and sends them home.
 *
 * A home has two sides, each an entry of one table of kinds (home.c):
 *   - how the ranks share the parameter (its share): whole on every rank
 *     (MTI_HOME_RESIDENT), ZeRO-1/2's slices of the master and state
 *     (MTI_HOME_ZERO12), ZeRO-3's slices of the weights too
 *     (MTI_HOME_ZERO3). The share answers which elements are this rank's,
 *     where their gradient is, how a gradient is summed over the ranks and
 *     whether the updated weights are gathered;
 *   - where this rank's part is kept (its kind): on the device (the share's
 *     own kind), in pinned host memory (MTI_HOME_HOST, offload_host.c) or
 *     on disk (MTI_HOME_DISK, offload.c). The kind answers where an
 *     element's weights, master and state are while it is updated, how a
 *     span is updated (brought in first, or queued), and what the step's
 *     start and end do.
 * The trainer chooses each parameter's home once at create, from the
 * configuration (mti_home_choose; a frozen parameter is resident), and
 * its step asks here instead of asking the strategies. A new home (a
 * tensor-parallel shard, a pipeline stage) is one more kind and one more
 * entry of the table.
 *
 * The inline answers below (mti_home_sliced, mti_home_weights,
 * mti_home_state_at) read the trainer's fields alone, so the layers under
 * the table (the host offload's copies, ZeRO-3's slices) can ask them.
 */
#ifndef MT_HOME_H
#define MT_HOME_H

#include "train/trainer.h"

typedef enum mti_home_kind {
    MTI_HOME_RESIDENT, /* whole on the device, every rank alike (one rank, data
                          parallel, frozen parameters) */
    MTI_HOME_ZERO12,   /* ZeRO-1/2: weights whole, master and state this rank's
                          slice (stage 2: its gradient too), the weights gathered
                          from the slices' owners once updated */
    MTI_HOME_ZERO3,    /* ZeRO-3: weights, master, gradient and state this rank's
                          slice (t->pw), the weights gathered per layer */
    MTI_HOME_HOST,     /* master and state in page-locked host memory, the update
                          queued to the CPU (a kind, over a share) */
    MTI_HOME_DISK,     /* master and state (offload_params: and the weights) in
                          scratch files, brought in piece by piece (a kind) */
    MTI_HOME_KINDS
} mti_home_kind;

/* Parameter i's home (t->home[i]): where its part is kept, and how the
 * ranks share it (the same for the device's kinds). */
typedef struct mti_home {
    unsigned char kind, share;
} mti_home;

/* Where an element's values are while it is updated: its weights (the
 * compute copy; fp32 without masters), its fp32 master (NULL without
 * masters) and state slot j's element (NULL where the slot is unused). */
typedef struct mti_home_loc {
    void *w;
    float *master;
    void *st[MTI_OPT_SLOTS];
} mti_home_loc;

/* The optimizer on elements [at, at + n) of parameter i whose values are
 * in memory (located with mti_home_locate): the trainer's, handed to the
 * homes' updates. */
typedef mt_status (*mti_home_span)(mt_trainer *t, int i, const float *g, size_t at, size_t n,
                                   float grad_scale);

/* ---- at create ---- */

/* Chooses every parameter's home from t's configuration (t->zero,
 * cfg.offload, the frozen parameters), once the offloads are made and the
 * weights are at home; before the state is made. */
mt_status mti_home_choose(mt_trainer *t);
/* Whether parameter i's optimizer state lives in this process's memory
 * (made by the trainer; on disk it lives in the offload's files). */
bool mti_home_state_here(const mt_trainer *t, int i);

/* ---- parameter i's part of the step ---- */

/* This rank's elements [*at, *at + *n) of parameter i and their gradient:
 * the slice kept by stage 2's and 3's unfused step, else the reduced part
 * of the whole gradient (NULL: none yet). */
float *mti_home_own(mt_trainer *t, int i, size_t *at, size_t *n);
/* Elements [at, at + n) of parameter i's gradient in g summed over the
 * ranks where this rank needs them: all of them in place (whole), or this
 * rank's into dst (a slice's owner), through bucket (mti_home_bucket
 * bytes; NULL: made here) in phase MTI_ZR_ALL, _POST or _FINISH. A
 * collective. */
mt_status mti_home_reduce(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst,
                          void *bucket, int phase);
/* The same for the whole gradient after backward (made zero where the
 * batch did not reach it), unless backward reduced it already. */
mt_status mti_home_reduce_grad(mt_trainer *t, int i);
/* Bytes of the bucket mti_home_reduce's phases take for its n elements (0: none). */
size_t mti_home_bucket(const mt_trainer *t, int i, size_t n);
/* Where element `at` of parameter i is while it is updated (its piece
 * brought in first where it lives on disk). */
void mti_home_locate(const mt_trainer *t, int i, size_t at, mti_home_loc *l);
/* Updates elements [at, at + n) of parameter i (this rank's) from their
 * gradient g times grad_scale: span on them where they are in memory,
 * each piece brought in first where they are on disk, or queued to land
 * by the step's end (host). */
mt_status mti_home_update(mt_trainer *t, int i, const float *g, size_t at, size_t n,
                          float grad_scale, mti_home_span span);
/* Whether parameter i's updated weights are gathered from the ranks'
 * slices at once (after each update), rather than at the step's end or
 * not at all. */
bool mti_home_gathers_now(const mt_trainer *t, int i);

/* ---- the step, over the kinds in use ---- */

/* Whether each rank checks and updates its own slices (the checks and the
 * norm then go through an exchange of the ranks). */
bool mti_home_split(const mt_trainer *t);
/* Whether the unfused step's gradients are reduced into this rank's slices
 * during backward (stages 2 and 3). */
bool mti_home_grad_sliced(const mt_trainer *t);
/* The step begins: the homes are there (the scratch files checked). */
mt_status mti_home_begin(mt_trainer *t);
/* Whether the step's end waits for the ranks to agree that every rank's
 * updates landed (mti_home_end) before it returns. */
bool mti_home_agrees(const mt_trainer *t);
/* That end (s: how the updates went on this rank): every queued update
 * landed, every piece written home; the ranks agree on it; then the
 * weights whose gather waited are gathered (updated: the unfused step
 * updated), and the ranks agree on the gathers that read and write
 * files. */
mt_status mti_home_end(mt_trainer *t, const char *fn, mt_status s, bool updated);
/* The step's last word on the homes: every piece home (its status). */
mt_status mti_home_finish(mt_trainer *t);
/* A failed step's end: what was updated lands or goes home (statuses
 * dropped). */
void mti_home_abandon(mt_trainer *t);
/* Whether updates may still land after they returned (queued): a failed
 * step then says how many at most were updated. */
bool mti_home_queued(const mt_trainer *t);

/* ---- the fields' answers, for the layers under the table ---- */

/* Whether parameter i's weights live as this rank's ZeRO-3 slice (stage
 * 3, a trained parameter), not whole in the model. */
static inline bool mti_home_sliced(const mt_trainer *t, int i)
{
    return t->zero == 3 && !t->model->params[i].frozen;
}

/* Where element `at` of parameter i's weights (this rank's) is stored: in
 * its ZeRO-3 slice (t->pw, from the slice's first element t->sh[i].lo),
 * else in the model's whole tensor. */
static inline void *mti_home_weights(const mt_trainer *t, int i, size_t at)
{
    const mti_param *p = &t->model->params[i];
    const size_t es = mti_dtype_size(p->w.dtype);
    if (!mti_home_sliced(t, i)) return (char *)p->w.blk.ptr + at * es;
    return (char *)t->pw[i].blk.ptr + (at - t->sh[i].lo) * es;
}

/* Where element `at` of parameter i's state is in memory (the device or
 * pinned host memory): st[j] for each slot j of its layout. The state
 * holds this rank's elements, from t->sh[i].lo. */
static inline void mti_home_state_at(const mt_trainer *t, int i, size_t at,
                                     void *st[MTI_OPT_SLOTS])
{
    const pstate *ps = &t->ps[i];
    for (int j = 0; j < MTI_OPT_SLOTS; j++) {
        const mti_opt_state *l = &ps->lay.s[j];
        st[j] = NULL;
        if (!l->numel) continue;
        const size_t off = l->per > 0 ? (at - t->sh[i].lo) / (size_t)l->per : 0;
        st[j] = (char *)ps->s[j].blk.ptr + off * mti_dtype_size(l->dtype);
    }
}

#endif /* MT_HOME_H */
