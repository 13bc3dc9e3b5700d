/*
 * checkpoint.c - the checkpoint-aware allocator.
 *
 * A training step asks for the same blocks, in the same order, every time.
 * So the first step (or the first plan_after_steps steps) is served exactly,
 * one backing reservation per block, and recorded: for each step or phase
 * block its size, alignment, class, lifetime, flags, and how many requests of
 * the step had been made when it died. At the reset that ends the recording
 * the blocks are packed offline into one region (an interval-packing problem:
 * two blocks may share bytes only if they are never live at the same time),
 * and from then on the i-th request of a step gets base + offset[i] in O(1).
 *
 * A step that asks for something else (a larger or different request, or
 * more requests than recorded) leaves the plan: the rest of it is served
 * exactly and recorded, and its reset plans again. A request that is not
 * larger than the recorded one replays, so a smaller last batch costs
 * nothing. Persistent blocks are never planned: each has its own exact
 * reservation, and so has every request of a step past its first
 * CK_STEP_MAX, which bounds the planning time and the bookkeeping.
 *
 * Blocks are found again through their handle, never through their memory
 * (it may be on a GPU):
 *   bits 62..63 kind (1 own-reservation slot, 2 recorded step or phase
 *   block), 32..61 generation, 0..31 index.
 * A slot's generation changes when it is freed; a step block's
 * generation is the step's epoch, which changes at every step boundary, so
 * stale and double frees are told apart from live blocks.
 *
 * The plan is only safe if blocks die where they died when recorded. A block
 * freed later than planned is "overdue"; a request whose planned bytes
 * overlap a live overdue block leaves the plan instead of being served.
 *
 * The region is one backing reservation, taken at the reset that plans
 * (when no step block is live) and replaced only when none of its blocks
 * is live. If it cannot be had, the instance goes on recording and plans
 * again at the next step's end. trim gives it back while none of its blocks
 * is live; the next request the plan serves takes it again. Growable ranges
 * (va_*) are not used: a re-plan happens at a step boundary, when releasing
 * the old region before reserving the new one costs no peak.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "checkpoint.h"

#define CK_KIND_SLOT 1u
#define CK_KIND_STEP 2u
#define CK_GEN_MASK ((UINT64_C(1) << 30) - 1)
#define CK_NONE UINT32_MAX
/* Plans past 2^62 bytes cannot be reserved anyway; the bound keeps offset
 * arithmetic (offset + size, aligned up) from overflowing. */
#define CK_MAX_PLAN ((size_t)1 << 62)
/* Requests of a step that are recorded and planned. Planning is O(n^2)
 * (about 0.2 s for this many), and the per-step bookkeeping is 40 bytes a
 * request, so later requests of a longer step (or of an application that
 * never ends a step) get their own reservations, like persistent blocks. */
#define CK_STEP_MAX 16384u
/* Steps with more requests than this are planned with one ordering only. */
#define CK_ONE_PASS 8192u
/* The planner's local search: at most this many block pairs compared
 * (about 20 ms), in at most this many trials. */
#define CK_SEARCH_WORK (UINT64_C(1) << 24)
#define CK_SEARCH_TRIALS 1024u
/* A re-plan searches only when the plan it replaces lasted this many steps. */
#define CK_STABLE_STEPS 8u

/* A block with its own reservation outside the step's record: persistent,
 * or past the first CK_STEP_MAX requests of a step. */
typedef struct ck_slot {
    void *ptr;
    size_t granted;    /* bytes reserved for it */
    size_t bytes;      /* requested */
    uint32_t gen;      /* bumped at every free */
    uint32_t next_free;
    uint8_t cls, life, live;
} ck_slot;

/* The i-th step or phase request of the step in flight. The array of them
 * is also the record of this step. */
typedef struct ck_ent {
    void *ptr;
    size_t bytes;       /* requested */
    size_t granted;     /* its own reservation; 0 when it sits in the plan region */
    uint32_t die;       /* requests of the step made when it died (CK_NONE while live) */
    uint32_t phase_pos; /* place in the phase live list (phase blocks) */
    uint8_t align_log2, cls, life, flags, live;
} ck_ent;

/* One request of the recorded step and its place in the plan. */
typedef struct ck_rec {
    size_t bytes;      /* the largest request seen at this position */
    size_t off;        /* planned offset from the region's base, bytes */
    uint32_t die;      /* the latest death seen, in requests made (see ck_ent) */
    uint8_t align_log2, cls, life, flags;
} ck_rec;

typedef struct ck_state {
    const mt_backing *bk;
    int plan_after;            /* steps recorded before the first plan */
    mt_allocator_stats st;

    ck_slot *slots;            /* blocks outside the record (see ck_slot) */
    uint32_t n_slots, cap_slots, free_slot;
    uint32_t n_slot_step;      /* live slots of step or phase lifetime */

    ck_ent *ent;               /* the step in flight, n_ent requests so far */
    uint32_t n_ent, cap_ent;
    uint32_t *plive;           /* live phase blocks of the step (indices into ent) */
    uint32_t n_plive, cap_plive;
    uint64_t epoch;            /* step number: the generation of step handles */
    bool diverged;             /* this step has left the plan */

    ck_rec *rec;               /* the record the next plan is made from */
    uint32_t n_rec, cap_rec;
    uint32_t rec_steps;        /* steps merged into it */

    bool have_plan;
    ck_rec *plan;              /* n_plan blocks with their offsets */
    uint32_t n_plan;
    uint32_t *due_start;       /* blocks by planned death: due_idx[due_start[k]..due_start[k+1]) */
    uint32_t *due_idx;         /*   are the blocks planned to die before request k */
    uint32_t due_upto;         /* deaths checked for requests < due_upto */
    uint32_t *odue;            /* live blocks found overdue this step */
    uint32_t n_odue;
    size_t plan_bytes, plan_align, plan_lb;
    void *region;              /* the plan's reservation, NULL when not held */
    size_t region_granted;
    uint32_t live_planned;     /* blocks of the step living in the region */

    uint64_t n_steps, n_recorded, n_divergences, n_plans, n_plan_failures, last_plan_ns;
    uint64_t plan_step;        /* n_steps when the plan in force was made */
} ck_state;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint8_t log2_of(size_t pow2)
{
    uint8_t k = 0;
    while (((size_t)1 << k) < pow2) k++;
    return k;
}

static uint64_t make_handle(unsigned kind, uint64_t gen, uint32_t idx)
{
    return (uint64_t)kind << 62 | (gen & CK_GEN_MASK) << 32 | idx;
}

/* Returns arr grown (elements of `size` bytes) to hold at least `need`,
 * doubling, so growth costs O(1) amortized and stops once a step's size is
 * known. On failure returns arr as it was and clears *ok. */
static void *grow(void *arr, uint32_t *cap, uint32_t need, size_t size, bool *ok)
{
    if (need <= *cap) return arr;
    uint64_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    if (c > CK_NONE) c = CK_NONE;
    void *p = realloc(arr, (size_t)c * size);
    if (!p) {
        *ok = false;
        return arr;
    }
    *cap = (uint32_t)c;
    return p;
}

/* ---- the backing ---- */

static mt_status bk_reserve(ck_state *s, size_t bytes, size_t align, void **p, size_t *g)
{
    void *q = NULL;
    size_t got = 0;
    mt_status rc = s->bk->reserve(s->bk->self, bytes, align, &q, &got);
    if (rc != MT_OK) return rc;
    if (!q || got < bytes) { /* a backing breaking its contract */
        if (q) s->bk->release(s->bk->self, q, got);
        return MT_ERR_INTERNAL;
    }
    mt_stats_on_reserve(&s->st, got);
    *p = q;
    *g = got;
    return MT_OK;
}

static void bk_release(ck_state *s, void *p, size_t g)
{
    s->bk->release(s->bk->self, p, g);
    mt_stats_on_release(&s->st, g);
}

static void region_release(ck_state *s)
{
    if (!s->region) return;
    bk_release(s, s->region, s->region_granted);
    s->region = NULL;
    s->region_granted = 0;
}

static mt_status region_reserve(ck_state *s)
{
    if (s->region) return MT_OK;
    return bk_reserve(s, s->plan_bytes, s->plan_align, &s->region, &s->region_granted);
}

/* A block's own reservation. When the backing is full and the plan region
 * is held with none of its blocks live (a persistent request between steps,
 * say), the region goes back and the request is tried again: the next step
 * reserves the region anew, or records if it cannot. */
static mt_status reserve_exact(ck_state *s, size_t bytes, size_t align, void **p, size_t *g)
{
    mt_status rc = bk_reserve(s, bytes, align, p, g);
    if (rc == MT_ERR_OOM && s->region && s->live_planned == 0) {
        region_release(s);
        s->st.n_oom_retries++;
        rc = bk_reserve(s, bytes, align, p, g);
    }
    return rc;
}

/* ---- the planner ----
 *
 * Block i is live from its request (position i) until just before request
 * die[i]; blocks i < j may share bytes only if die[i] <= j. Greedy packing:
 * take the blocks in some order and put each in the tightest gap (best fit)
 * left by the already placed blocks it is live together with, or above them
 * all. Several orders are tried and the smallest plan is kept. */

typedef struct ck_key {
    uint64_t k1, k2;
    uint32_t idx;
} ck_key;

/* k1 descending, then k2 descending, then request order */
static int key_cmp(const void *a, const void *b)
{
    const ck_key *x = a, *y = b;
    if (x->k1 != y->k1) return x->k1 > y->k1 ? -1 : 1;
    if (x->k2 != y->k2) return x->k2 > y->k2 ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* Places the n blocks of r in `order`; off gets the offsets. by_off is
 * scratch for n indices (placed blocks sorted by offset). Returns the bytes
 * the plan spans, or SIZE_MAX past CK_MAX_PLAN. O(n^2). */
static size_t place_in_order(const ck_rec *r, uint32_t n, const uint32_t *order,
                             uint32_t *by_off, size_t *off)
{
    uint32_t n_placed = 0;
    size_t total = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t b = order[k];
        size_t sz = r[b].bytes, al = (size_t)1 << r[b].align_log2;
        size_t top = 0, best = SIZE_MAX, best_slack = SIZE_MAX;
        for (uint32_t q = 0; q < n_placed; q++) {
            uint32_t p = by_off[q];
            if (p >= r[b].die || r[p].die <= b) continue; /* never live together */
            size_t cand = mti_align_up(top, al);
            if (cand + sz <= off[p] && off[p] - cand - sz < best_slack) {
                best = cand;
                best_slack = off[p] - cand - sz;
            }
            if (off[p] + r[p].bytes > top) top = off[p] + r[p].bytes;
        }
        if (best == SIZE_MAX) best = mti_align_up(top, al);
        if (best > CK_MAX_PLAN || sz > CK_MAX_PLAN - best) return SIZE_MAX;
        off[b] = best;
        if (best + sz > total) total = best + sz;
        /* keep by_off sorted: binary search for the first offset above */
        uint32_t lo = 0, hi = n_placed;
        while (lo < hi) {
            uint32_t mid = lo + (hi - lo) / 2;
            if (off[by_off[mid]] <= best) lo = mid + 1;
            else hi = mid;
        }
        memmove(by_off + lo + 1, by_off + lo, (size_t)(n_placed - lo) * sizeof *by_off);
        by_off[lo] = b;
        n_placed++;
    }
    return total;
}

/* The most bytes of r live at one time, each block's size rounded up to
 * `round` bytes: with round 1 no plan can be smaller; with round 256 (every
 * offset is a multiple of it) no plan can be smaller by 256 bytes or more. */
static size_t plan_lower_bound(const ck_rec *r, uint32_t n, size_t round, size_t *dead_at)
{
    memset(dead_at, 0, ((size_t)n + 1) * sizeof *dead_at);
    for (uint32_t i = 0; i < n; i++) dead_at[r[i].die] += mti_align_up(r[i].bytes, round);
    size_t live = 0, peak = 0;
    for (uint32_t k = 0; k < n; k++) {
        live -= dead_at[k];
        live += mti_align_up(r[k].bytes, round);
        if (live > peak) peak = live;
    }
    return peak;
}

/* Sets r[i].off for the n recorded blocks; *total gets the bytes the plan
 * spans, *lower the lower bound. Deaths are in [i + 1, n]. Three orders are
 * tried, then (when `search`) a local search swaps a few blocks of the best
 * order at a time and keeps the result when the plan is no larger, until
 * the plan is within 256 bytes of optimal or about CK_SEARCH_WORK block
 * pairs have been compared (~20 ms). This is where a memory budget will
 * come in: blocks flagged MT_REQ_RECOMPUTABLE may then be left out when the
 * plan would exceed it. */
static mt_status plan_offsets(ck_rec *r, uint32_t n, bool search, size_t *total, size_t *lower)
{
    ck_key *keys = malloc((size_t)n * sizeof *keys);
    uint32_t *order = malloc((size_t)n * sizeof *order);
    uint32_t *best_order = malloc((size_t)n * sizeof *best_order);
    uint32_t *by_off = malloc((size_t)n * sizeof *by_off);
    size_t *off = malloc(((size_t)n + 1) * sizeof *off);
    size_t *best_off = malloc(((size_t)n + 1) * sizeof *best_off);
    mt_status rc = MT_ERR_OOM;
    if (!keys || !order || !best_order || !by_off || !off || !best_off) goto out;

    *lower = plan_lower_bound(r, n, 1, off);
    size_t good = plan_lower_bound(r, n, MT_DEFAULT_ALIGNMENT, off); /* no need to search on */
    size_t best = SIZE_MAX;
    /* 0: largest first (ties: longest lived); 1: longest lived first (ties:
     * largest); 2: request order, as an allocator that knew the future */
    int passes = n > CK_ONE_PASS ? 1 : 3;
    for (int pass = 0; pass < passes && best > good; pass++) {
        for (uint32_t i = 0; i < n; i++) {
            uint64_t len = r[i].die - i;
            keys[i].k1 = pass == 0 ? r[i].bytes : pass == 1 ? len : 0;
            keys[i].k2 = pass == 0 ? len : pass == 1 ? r[i].bytes : 0;
            keys[i].idx = i;
        }
        if (pass < 2) qsort(keys, n, sizeof *keys, key_cmp);
        for (uint32_t i = 0; i < n; i++) order[i] = keys[i].idx;
        size_t t = place_in_order(r, n, order, by_off, off);
        if (t < best) {
            best = t;
            memcpy(best_off, off, (size_t)n * sizeof *off);
            memcpy(best_order, order, (size_t)n * sizeof *order);
        }
    }
    /* a fixed seed keeps plans reproducible from run to run */
    uint64_t x = UINT64_C(0x9E3779B97F4A7C15);
    uint64_t trials = search ? CK_SEARCH_WORK / ((uint64_t)n * n + 1) : 0;
    if (trials > CK_SEARCH_TRIALS) trials = CK_SEARCH_TRIALS;
    for (uint64_t t = 0; t < trials && best > good && best != SIZE_MAX && n > 1; t++) {
        memcpy(order, best_order, (size_t)n * sizeof *order);
        for (int k = 0; k <= (int)(x % 3); k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            uint32_t i = (uint32_t)(x % n), j = (uint32_t)((x >> 32) % n), o = order[i];
            order[i] = order[j];
            order[j] = o;
        }
        size_t size = place_in_order(r, n, order, by_off, off);
        if (size <= best) { /* equal sizes move too, to cross plateaus */
            best = size;
            memcpy(best_off, off, (size_t)n * sizeof *off);
            memcpy(best_order, order, (size_t)n * sizeof *order);
        }
    }
    if (best == SIZE_MAX) {
        rc = MT_ERR_OOM;
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) r[i].off = best_off[i];
    *total = best;
    rc = MT_OK;
out:
    free(keys);
    free(order);
    free(best_order);
    free(by_off);
    free(off);
    free(best_off);
    return rc;
}

/* ---- recording and planning ---- */

/* Folds the step just ended (ent[0..n_ent)) into the record: merged when
 * it asked for the same kinds of blocks in the same order (largest size and
 * latest death win, so the plan fits every merged step), else it replaces
 * the record. */
static mt_status fold_record(ck_state *s)
{
    uint32_t n = s->n_ent;
    bool same = s->rec_steps > 0 && s->n_rec == n;
    for (uint32_t i = 0; same && i < n; i++) {
        const ck_ent *e = &s->ent[i];
        const ck_rec *r = &s->rec[i];
        same = e->align_log2 == r->align_log2 && e->cls == r->cls && e->life == r->life;
    }
    if (same) {
        for (uint32_t i = 0; i < n; i++) {
            ck_rec *r = &s->rec[i];
            if (s->ent[i].bytes > r->bytes) r->bytes = s->ent[i].bytes;
            if (s->ent[i].die > r->die) r->die = s->ent[i].die;
            r->flags &= s->ent[i].flags; /* recomputable only if always said so */
        }
        s->rec_steps++;
        return MT_OK;
    }
    s->rec_steps = 0;
    s->n_rec = 0;
    bool ok = true;
    s->rec = grow(s->rec, &s->cap_rec, n, sizeof *s->rec, &ok);
    if (!ok) return MT_ERR_OOM;
    for (uint32_t i = 0; i < n; i++) {
        const ck_ent *e = &s->ent[i];
        s->rec[i] = (ck_rec){.bytes = e->bytes, .off = 0, .die = e->die,
                             .align_log2 = e->align_log2, .cls = e->cls, .life = e->life,
                             .flags = e->flags};
    }
    s->n_rec = n;
    s->rec_steps = 1;
    return MT_OK;
}

static void drop_plan(ck_state *s)
{
    region_release(s); /* callers make sure no planned block is live */
    s->have_plan = false;
}

/* Plans the record and reserves its region. Called at a step boundary,
 * when no block of the step is live. On failure the instance records again. */
static void make_plan(ck_state *s)
{
    uint64_t t0 = now_ns();
    uint32_t n = s->n_rec, n_phase = 0;
    ck_rec *plan = malloc((size_t)n * sizeof *plan);
    uint32_t *due_start = calloc((size_t)n + 2, sizeof *due_start);
    uint32_t *due_idx = malloc((size_t)n * sizeof *due_idx);
    uint32_t *odue = malloc((size_t)n * sizeof *odue);
    size_t total = 0, lower = 0, align = s->bk->min_alignment;
    for (uint32_t i = 0; i < n; i++) n_phase += s->rec[i].life == MT_LIFE_PHASE;
    /* size the per-step arrays now, so replayed steps never grow them */
    bool ok = plan && due_start && due_idx && odue;
    s->ent = grow(s->ent, &s->cap_ent, n, sizeof *s->ent, &ok);
    s->plive = grow(s->plive, &s->cap_plive, n_phase, sizeof *s->plive, &ok);
    if (ok) {
        memcpy(plan, s->rec, (size_t)n * sizeof *plan);
        /* a sequence that keeps changing gets the quick greedy plans */
        bool search = s->n_plans == 0 || s->n_steps - s->plan_step >= CK_STABLE_STEPS;
        ok = plan_offsets(plan, n, search, &total, &lower) == MT_OK;
    }
    if (!ok) {
        free(plan);
        free(due_start);
        free(due_idx);
        free(odue);
        drop_plan(s);
        s->n_plan_failures++;
        return;
    }
    for (uint32_t i = 0; i < n; i++) {
        size_t a = (size_t)1 << plan[i].align_log2;
        if (a > align) align = a;
        due_start[plan[i].die + 1]++;
    }
    for (uint32_t k = 0; k <= n; k++) due_start[k + 1] += due_start[k];
    for (uint32_t i = 0; i < n; i++) due_idx[due_start[plan[i].die]++] = i;
    for (uint32_t k = n + 1; k > 0; k--) due_start[k] = due_start[k - 1];
    due_start[0] = 0;

    /* keep the region when the new plan fits it snugly (within 1/64) */
    if (s->region && (s->region_granted < total || s->region_granted - total > total / 64 ||
                      (uintptr_t)s->region % align != 0))
        region_release(s);
    free(s->plan);
    free(s->due_start);
    free(s->due_idx);
    free(s->odue);
    s->plan = plan;
    s->due_start = due_start;
    s->due_idx = due_idx;
    s->odue = odue;
    s->n_plan = n;
    s->plan_bytes = total;
    s->plan_align = align;
    s->plan_lb = lower;
    s->have_plan = true;
    s->n_plans++;
    s->plan_step = s->n_steps;
    s->last_plan_ns = now_ns() - t0; /* the planning alone, not the reservation */
    if (region_reserve(s) != MT_OK) {
        drop_plan(s);
        s->n_plan_failures++;
    }
}

/* ---- the step in flight ---- */

/* Leaves the plan for the rest of this step. The region goes back as soon
 * as none of its blocks is live. */
static void diverge(ck_state *s)
{
    s->diverged = true;
    s->n_divergences++;
    if (s->live_planned == 0) region_release(s);
}

/* Finds the blocks planned to die before request j that are still live. */
static void check_deaths(ck_state *s, uint32_t j)
{
    for (; s->due_upto <= j; s->due_upto++) {
        uint32_t k = s->due_upto;
        for (uint32_t t = s->due_start[k]; t < s->due_start[k + 1]; t++) {
            uint32_t i = s->due_idx[t];
            if (i < s->n_ent && s->ent[i].live) s->odue[s->n_odue++] = i;
        }
    }
}

/* True if a live overdue block overlaps the planned bytes of request j.
 * Dead ones are dropped from the list on the way. */
static bool overdue_overlaps(ck_state *s, uint32_t j)
{
    size_t a0 = s->plan[j].off, a1 = a0 + s->plan[j].bytes;
    for (uint32_t q = 0; q < s->n_odue;) {
        uint32_t i = s->odue[q];
        if (!s->ent[i].live) {
            s->odue[q] = s->odue[--s->n_odue];
            continue;
        }
        if (s->plan[i].off < a1 && a0 < s->plan[i].off + s->plan[i].bytes) return true;
        q++;
    }
    return false;
}

/* Whether request j of the step can be served from the plan. */
static bool plan_serves(ck_state *s, uint32_t j, const mt_alloc_request *req, size_t align)
{
    if (j >= s->n_plan) return false;
    const ck_rec *r = &s->plan[j];
    if (req->bytes > r->bytes || align > ((size_t)1 << r->align_log2) ||
        (uint8_t)req->mem_class != r->cls || (uint8_t)req->lifetime != r->life)
        return false;
    check_deaths(s, j);
    if (s->n_odue && overdue_overlaps(s, j)) return false;
    /* the region is away only after a trim, when none of its blocks lived */
    return region_reserve(s) == MT_OK;
}

/* Ends the life of step block i (a free, or a reset when from_reset). */
static void kill_ent(ck_state *s, uint32_t i, bool from_reset)
{
    ck_ent *e = &s->ent[i];
    e->live = 0;
    e->die = s->n_ent;
    mt_stats_on_free(&s->st, (mt_mem_class)e->cls, e->bytes);
    if (e->granted) {
        bk_release(s, e->ptr, e->granted);
    } else if (--s->live_planned == 0 && s->diverged) {
        region_release(s);
    }
    if (!from_reset && e->life == MT_LIFE_PHASE) {
        uint32_t last = s->plive[--s->n_plive];
        s->plive[e->phase_pos] = last;
        s->ent[last].phase_pos = e->phase_pos;
    }
}

static void kill_slot(ck_state *s, uint32_t i)
{
    ck_slot *sl = &s->slots[i];
    if (sl->life != MT_LIFE_PERSISTENT) s->n_slot_step--;
    bk_release(s, sl->ptr, sl->granted);
    mt_stats_on_free(&s->st, (mt_mem_class)sl->cls, sl->bytes);
    sl->live = 0;
    sl->ptr = NULL;
    sl->gen = (uint32_t)((sl->gen + 1) & CK_GEN_MASK);
    sl->next_free = s->free_slot;
    s->free_slot = i;
}

/* A reset of scope STEP or ALL: every step block is dead. Records the step
 * when it was served exactly, plans when enough steps are recorded or the
 * step left the plan, and starts the next step. */
static void end_step(ck_state *s)
{
    if (s->n_ent > 0) {
        s->n_steps++;
        if (!s->have_plan || s->diverged) {
            s->n_recorded++;
            if (fold_record(s) != MT_OK) {
                drop_plan(s);
            } else if (s->diverged || (int64_t)s->rec_steps >= s->plan_after) {
                make_plan(s);
            }
        }
    }
    s->epoch++;
    s->n_ent = 0;
    s->n_plive = 0;
    s->diverged = false;
    s->due_upto = 0;
    s->n_odue = 0;
}

/* ---- the vtable ---- */

static mt_status ck_create(const mt_allocator_params *params, const mt_backing *backing,
                           void **state)
{
    if (!params || !backing || !state) return MT_ERR_INVALID_ARG;
    if (backing->abi_version != MT_ALLOCATOR_ABI_VERSION) return MT_ERR_VERSION;
    if (!backing->reserve || !backing->release || !mti_is_pow2(backing->min_alignment))
        return MT_ERR_INVALID_ARG;
    int plan_after = 1;
    const mt_checkpoint_options *o = params->options;
    if (o) {
        if (o->struct_size != sizeof *o) return MT_ERR_INVALID_ARG;
        plan_after = o->plan_after_steps;
    }
    if (plan_after < 1) return MT_ERR_INVALID_ARG;
    ck_state *s = calloc(1, sizeof *s);
    if (!s) return MT_ERR_OOM;
    s->bk = backing;
    s->plan_after = plan_after;
    s->free_slot = CK_NONE;
    s->epoch = 1;
    *state = s;
    return MT_OK;
}

static mt_status alloc_slot(ck_state *s, const mt_alloc_request *req, size_t align,
                            mt_block *out)
{
    bool ok = true;
    if (s->free_slot == CK_NONE) {
        ok = s->n_slots < CK_NONE - 1; /* indices stay below CK_NONE */
        if (ok) s->slots = grow(s->slots, &s->cap_slots, s->n_slots + 1, sizeof *s->slots, &ok);
    }
    if (!ok) return MT_ERR_OOM;
    void *p;
    size_t g;
    mt_status rc = reserve_exact(s, req->bytes, align, &p, &g);
    if (rc != MT_OK) return rc;
    uint32_t i = s->free_slot;
    if (i != CK_NONE) {
        s->free_slot = s->slots[i].next_free;
    } else {
        i = s->n_slots++;
        s->slots[i].gen = 0;
    }
    ck_slot *sl = &s->slots[i];
    sl->ptr = p;
    sl->granted = g;
    sl->bytes = req->bytes;
    sl->cls = (uint8_t)req->mem_class;
    sl->life = (uint8_t)req->lifetime;
    sl->live = 1;
    if (req->lifetime != MT_LIFE_PERSISTENT) s->n_slot_step++;
    sl->next_free = CK_NONE;
    out->ptr = p;
    out->handle = make_handle(CK_KIND_SLOT, sl->gen, i);
    return MT_OK;
}

static mt_status alloc_step(ck_state *s, const mt_alloc_request *req, size_t align,
                            mt_block *out)
{
    uint32_t j = s->n_ent;
    bool ok = true;
    s->ent = grow(s->ent, &s->cap_ent, j + 1, sizeof *s->ent, &ok);
    if (req->lifetime == MT_LIFE_PHASE)
        s->plive = grow(s->plive, &s->cap_plive, s->n_plive + 1, sizeof *s->plive, &ok);
    if (!ok) return MT_ERR_OOM;

    void *p;
    size_t g = 0;
    bool planned = false;
    if (s->have_plan && !s->diverged) {
        planned = plan_serves(s, j, req, align);
        if (!planned) diverge(s);
    }
    if (planned) {
        p = (char *)s->region + s->plan[j].off;
        s->live_planned++;
    } else {
        mt_status rc = reserve_exact(s, req->bytes, align, &p, &g);
        if (rc != MT_OK) return rc;
    }
    ck_ent *e = &s->ent[j];
    e->ptr = p;
    e->bytes = req->bytes;
    e->granted = g;
    e->die = CK_NONE;
    e->align_log2 = log2_of(align);
    e->cls = (uint8_t)req->mem_class;
    e->life = (uint8_t)req->lifetime;
    e->flags = (uint8_t)(req->flags & MT_REQ_RECOMPUTABLE);
    e->live = 1;
    if (req->lifetime == MT_LIFE_PHASE) {
        e->phase_pos = s->n_plive;
        s->plive[s->n_plive++] = j;
    }
    s->n_ent = j + 1;
    out->ptr = p;
    out->handle = make_handle(CK_KIND_STEP, s->epoch, j);
    return MT_OK;
}

static mt_status ck_alloc(void *state, const mt_alloc_request *req, mt_block *out)
{
    ck_state *s = state;
    if (!s || !req || !out || req->bytes == 0 || (unsigned)req->mem_class >= MT_MEM_COUNT ||
        (unsigned)req->lifetime >= MT_LIFE_COUNT)
        return MT_ERR_INVALID_ARG;
    if (req->bytes > MT_MAX_REQUEST) { /* the library stops these; direct callers get OOM */
        mt_stats_on_oom(&s->st, req->mem_class);
        return MT_ERR_OOM;
    }
    size_t align = req->alignment ? req->alignment : MT_DEFAULT_ALIGNMENT;
    if (!mti_is_pow2(align) || align > MT_MAX_ALIGNMENT) return MT_ERR_INVALID_ARG;
    if (align < MT_DEFAULT_ALIGNMENT) align = MT_DEFAULT_ALIGNMENT;
    mt_status rc = req->lifetime == MT_LIFE_PERSISTENT || s->n_ent >= CK_STEP_MAX
                       ? alloc_slot(s, req, align, out)
                       : alloc_step(s, req, align, out);
    if (rc == MT_OK) mt_stats_on_alloc(&s->st, req->mem_class, req->bytes);
    else if (rc == MT_ERR_OOM) mt_stats_on_oom(&s->st, req->mem_class);
    return rc;
}

static mt_status ck_free(void *state, const mt_block *blk)
{
    ck_state *s = state;
    if (!s || !blk) return MT_ERR_INVALID_ARG;
    unsigned kind = (unsigned)(blk->handle >> 62);
    uint64_t gen = (blk->handle >> 32) & CK_GEN_MASK;
    uint32_t i = (uint32_t)blk->handle;
    if (kind == CK_KIND_SLOT) {
        if (i >= s->n_slots) return MT_ERR_BAD_BLOCK;
        const ck_slot *sl = &s->slots[i];
        if (!sl->live || sl->gen != gen || sl->ptr != blk->ptr || sl->bytes != blk->bytes)
            return MT_ERR_BAD_BLOCK;
        kill_slot(s, i);
        return MT_OK;
    }
    if (kind == CK_KIND_STEP) {
        if (gen != (s->epoch & CK_GEN_MASK) || i >= s->n_ent) return MT_ERR_BAD_BLOCK;
        const ck_ent *e = &s->ent[i];
        if (!e->live || e->ptr != blk->ptr || e->bytes != blk->bytes) return MT_ERR_BAD_BLOCK;
        kill_ent(s, i, false);
        return MT_OK;
    }
    return MT_ERR_BAD_BLOCK;
}

static mt_status ck_reset(void *state, mt_scope scope)
{
    ck_state *s = state;
    if (!s || (unsigned)scope > MT_SCOPE_PHASE) return MT_ERR_INVALID_ARG;
    s->st.n_resets++;
    /* slots of a step past CK_STEP_MAX requests, or everything for ALL */
    for (uint32_t i = 0; i < s->n_slots && (s->n_slot_step || scope == MT_SCOPE_ALL); i++)
        if (s->slots[i].live && s->slots[i].life >= (uint8_t)scope) kill_slot(s, i);
    if (scope == MT_SCOPE_PHASE) {
        for (uint32_t q = 0; q < s->n_plive; q++) kill_ent(s, s->plive[q], true);
        s->n_plive = 0;
        return MT_OK;
    }
    for (uint32_t i = 0; i < s->n_ent; i++)
        if (s->ent[i].live) kill_ent(s, i, true);
    s->n_plive = 0;
    end_step(s);
    return MT_OK;
}

/* Gives back the plan region while none of its blocks is live; the next
 * request the plan serves reserves it again. Persistent and exact blocks
 * are all in use, so there is nothing else to give back. */
static mt_status ck_trim(void *state)
{
    ck_state *s = state;
    if (!s) return MT_ERR_INVALID_ARG;
    s->st.n_trims++;
    if (s->live_planned == 0) region_release(s);
    return MT_OK;
}

static mt_status ck_stats(void *state, mt_allocator_stats *out)
{
    const ck_state *s = state;
    if (!s || !out) return MT_ERR_INVALID_ARG;
    *out = s->st;
    return MT_OK;
}

static void ck_destroy(void *state)
{
    ck_state *s = state;
    if (!s) return;
    for (uint32_t i = 0; i < s->n_ent; i++)
        if (s->ent[i].live && s->ent[i].granted) bk_release(s, s->ent[i].ptr, s->ent[i].granted);
    for (uint32_t i = 0; i < s->n_slots; i++)
        if (s->slots[i].live) bk_release(s, s->slots[i].ptr, s->slots[i].granted);
    region_release(s);
    free(s->slots);
    free(s->ent);
    free(s->plive);
    free(s->rec);
    free(s->plan);
    free(s->due_start);
    free(s->due_idx);
    free(s->odue);
    free(s);
}

static const mt_allocator_vtable ck_vtable = {
    .abi_version = MT_ALLOCATOR_ABI_VERSION,
    .struct_size = sizeof(mt_allocator_vtable),
    .name = "checkpoint",
    .caps = MT_ALLOCATOR_CAP_DETECTS_BAD_FREE,
    .create = ck_create,
    .alloc = ck_alloc,
    .free = ck_free,
    .reset = ck_reset,
    .trim = ck_trim,
    .stats = ck_stats,
    .destroy = ck_destroy,
};

const mt_allocator_vtable *mt_allocator_checkpoint(void) { return &ck_vtable; }

void mt_checkpoint_options_init(mt_checkpoint_options *o)
{
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->struct_size = sizeof *o;
    o->plan_after_steps = 1;
}

mt_status mti_checkpoint_state_summary(const void *state, mti_checkpoint_summary *out)
{
    const ck_state *s = state;
    if (!s || !out) return MT_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    out->replaying = s->have_plan;
    if (s->have_plan) {
        out->plan_bytes = s->plan_bytes;
        out->plan_live_bytes = s->plan_lb;
        out->n_planned = s->n_plan;
        for (uint32_t i = 0; i < s->n_plan; i++) {
            if (!(s->plan[i].flags & MT_REQ_RECOMPUTABLE)) continue;
            out->n_recomputable++;
            out->recomputable_bytes += s->plan[i].bytes;
        }
    }
    out->region_bytes = s->region ? s->region_granted : 0;
    out->n_steps = s->n_steps;
    out->n_recorded_steps = s->n_recorded;
    out->n_divergences = s->n_divergences;
    out->n_plans = s->n_plans;
    out->n_plan_failures = s->n_plan_failures;
    out->last_plan_ns = s->last_plan_ns;
    return MT_OK;
}

mt_status mti_checkpoint_summary_get(const mt_allocator *a, mti_checkpoint_summary *out)
{
    if (!a || !out || a->vt != &ck_vtable) return MT_ERR_INVALID_ARG;
    return mti_checkpoint_state_summary(a->state, out);
}
