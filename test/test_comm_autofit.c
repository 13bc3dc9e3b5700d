/*
 * test_comm_autofit.c - auto-fit on several ranks (threads as ranks over
 * the in-process communicator): every rank chooses the same configuration,
 * the one that fits its worst rank, and the offload tiers are offered
 * there too.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "train/offload.h"
#include "test_comm.h"

#define T 8 /* tokens a row (tcomm_gpt_rank's model) */

typedef struct fit_arg {
    tcomm_world *world;
    mt_trainer_config tc;
    bool offload;          /* a budget only the disk meets; else one only the lighter rank meets */
    int channels;
    uint64_t budget[2];    /* each rank's */
    uint64_t need[2];      /* each rank's need of the configuration as given (ranks differ) */
    bool tight;            /* the budget is below the heavier rank's need */
    mt_autofit_report r[2];
    uint64_t run_peak[2];  /* the chosen run's peak reserve */
    char msg[2][512];
    _Atomic int bad;
} fit_arg;

static uint64_t least_of(const mt_model *m, const mt_trainer_config *base, mt_context *ctx)
{
    mt_trainer_config c = *base;
    c.memory_budget = 1;
    mt_autofit_report r;
    if (mt_trainer_autofit(m, &c, 0, &r) != MT_ERR_BUDGET) return 0;
    const char *at = strstr(mt_last_error(ctx), "the least is ");
    unsigned long long least = 0;
    return at && sscanf(at, "the least is %llu", &least) == 1 ? least : 0;
}

/* The budget of a case on one rank (0 on failure): with offload, between
 * the least with the state on disk and the least without; else the need
 * of the configuration as given on the lighter rank, or the least the
 * heavier rank can fit if that is more, as long as that is below the
 * heavier rank's need (the needs and the leasts come from estimates made
 * here, on this CPU and its workspace sizes, exchanged over the
 * communicator as an application would). */
static uint64_t budget_of(fit_arg *a, int rank, mt_comm *c, mt_context *ctx, const mt_model *m)
{
    if (a->offload) {
        mt_trainer_config resident = a->tc;
        resident.offload_dir = NULL;
        const uint64_t lo = least_of(m, &a->tc, ctx), hi = least_of(m, &resident, ctx);
        snprintf(a->msg[rank], sizeof a->msg[rank], "least %llu with offload, %llu without",
                 (unsigned long long)lo, (unsigned long long)hi);
        return lo && lo < hi ? (lo + hi) / 2 : 0;
    }
    mt_estimate_report e;
    if (mt_estimate_model(m, &a->tc, &e)) return 0;
    uint64_t mine[2] = {e.peak_reserved, least_of(m, &a->tc, ctx)}, all[4];
    if (!mine[1] || mt_comm_all_gather(c, mine, all, sizeof mine, MT_COMM_BYTE, NULL)) return 0;
    a->need[rank] = mine[0];
    snprintf(a->msg[rank], sizeof a->msg[rank], "the ranks need %llu and %llu, at least %llu and %llu",
             (unsigned long long)all[0], (unsigned long long)all[2], (unsigned long long)all[1],
             (unsigned long long)all[3]);
    const uint64_t need_lo = all[0] < all[2] ? all[0] : all[2];
    const uint64_t need_hi = all[0] < all[2] ? all[2] : all[0];
    const uint64_t least_hi = all[1] < all[3] ? all[3] : all[1];
    const uint64_t b = need_lo > least_hi ? need_lo : least_hi;
    /* where the heavier rank can fit nothing less than the configuration
       as given (on some CPUs, at this tiny shape), its need: the ranks
       must still agree */
    if (rank == 0) a->tight = b < need_hi;
    return b < need_hi ? b : need_hi;
}

/* One rank: auto-fit at the case's budget, then two steps of what it chose. */
static void fit_rank(int rank, void *p)
{
    fit_arg *a = p;
    tcomm_rank R;
    mt_trainer *t = NULL;
    mt_status s = tcomm_gpt_rank(a->world, rank, 2, MT_COMM_CAP_THREADS, a->channels, &R);
    mt_trainer_config f = a->tc;
    f.memory_budget = a->budget[rank] = s ? 0 : budget_of(a, rank, R.c, R.ctx, R.m);
    if (!s && !f.memory_budget) s = MT_ERR_INTERNAL;
    if (!s) s = mt_trainer_autofit(R.m, &f, 0, &a->r[rank]);
    if (!s) s = mt_trainer_create(R.m, &f, &t);
    int32_t tok[2 * T], tgt[2 * T];
    for (int step = 0; step < 2 && !s; step++) {
        for (int i = 0; i < 2 * T; i++)
            tok[i] = (i * 7 + rank * 3 + step) % 50, tgt[i] = (i * 5 + rank + step * 3) % 50;
        mt_batch b = {.n = 2, .tokens = tok, .targets = tgt, .seq_len = T};
        s = mt_trainer_step(t, &b, NULL);
    }
    if (s) {
        const size_t n = strlen(a->msg[rank]);
        snprintf(a->msg[rank] + n, sizeof a->msg[rank] - n, ": %s", mt_last_error(R.ctx));
        a->bad = 1;
    }
    mt_memory_stats ms;
    if (R.ctx && !mt_context_memory_stats(R.ctx, &ms)) a->run_peak[rank] = ms.peak_reserved_bytes;
    mt_trainer_destroy(t);
    tcomm_rank_free(&R);
}

static void fit_case(const char *name, mt_optimizer_kind opt, int zero, bool offload)
{
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/mt_autofit_%ld_XXXXXX", (long)getpid());
    CHECK(mkdtemp(dir) != NULL);
    const size_t keep = mti_offload_piece_elems;
    mti_offload_piece_elems = 256; /* (pieces small beside a tiny model's state) */
    fit_arg a = {.channels = offload ? 32 : 16, .offload = offload};
    mt_trainer_config_init(&a.tc);
    a.tc.optimizer = opt;
    a.tc.max_batch = 2;
    a.tc.max_seq = T;
    a.tc.zero_stage = zero;
    a.tc.offload_dir = offload ? dir : NULL;
    a.world = tcomm_world_new(2, 60.0);
    tcomm_run(2, fit_rank, &a);
    tcomm_world_free(a.world);
    mti_offload_piece_elems = keep;
    CHECK(rmdir(dir) == 0); /* (nothing left in it) */
    CHECK_MSG(!a.bad, "%s: rank 0: %s; rank 1: %s", name, a.msg[0], a.msg[1]);
    CHECK_EQ(a.budget[0], a.budget[1]);
    const mt_autofit_report *x = &a.r[0], *y = &a.r[1];
    CHECK_MSG(x->micro_batch == y->micro_batch && x->optimizer == y->optimizer &&
                  x->recomputed_units == y->recomputed_units &&
                  x->selective_units == y->selective_units && x->seg_len == y->seg_len &&
                  x->offload == y->offload && x->offload_params == y->offload_params &&
                  x->peak_reserved == y->peak_reserved,
              "%s: rank 0 chose micro %d, %d recomputed, %d selective, offload %d (%llu); rank "
              "1 micro %d, %d, %d, offload %d (%llu)",
              name, x->micro_batch, x->recomputed_units, x->selective_units, (int)x->offload,
              (unsigned long long)x->peak_reserved, y->micro_batch, y->recomputed_units,
              y->selective_units, (int)y->offload, (unsigned long long)y->peak_reserved);
    if (offload) CHECK_EQ(x->offload, MT_PLACE_DISK);
    else if (a.tight) /* the heavier rank does not fit the configuration as given */
        CHECK(x->micro_batch < 2 || x->recomputed_units || x->selective_units);
    /* each rank's run within the budget, the heavier exactly the estimate
       auto-fit chose by */
    const uint64_t worst = a.run_peak[0] > a.run_peak[1] ? a.run_peak[0] : a.run_peak[1];
    CHECK_MSG(worst == x->peak_reserved, "%s: the runs' peaks %llu and %llu, chosen by %llu", name,
              (unsigned long long)a.run_peak[0], (unsigned long long)a.run_peak[1],
              (unsigned long long)x->peak_reserved);
    for (int r = 0; r < 2; r++)
        CHECK_MSG(a.run_peak[r] <= a.budget[r], "%s, rank %d: peak %llu, budget %llu", name, r,
                  (unsigned long long)a.run_peak[r], (unsigned long long)a.budget[r]);
}

/* Ranks that need different bytes (Adafactor's whole tensors have one
 * owner each) choose alike, by the heavier: at the lighter rank's need of
 * the configuration as given (or the heavier rank's least, where that is
 * more on this CPU), which the heavier does not meet. */
TEST(zero_autofit_same_on_every_rank)
{
    fit_case("adafactor, stage 1", MT_OPT_ADAFACTOR, 1, false);
    fit_case("adafactor, stage 2", MT_OPT_ADAFACTOR, 2, false);
}

/* Auto-fit puts the state (and the weights) on disk at ZeRO stages 1 to 3
 * on 2 ranks when nothing else fits, the same on both. */
TEST(zero_autofit_offload_on_two_ranks)
{
    fit_case("adamw, stage 1", MT_OPT_ADAMW, 1, true);
    fit_case("adamw, stage 2", MT_OPT_ADAMW, 2, true);
    fit_case("adamw, stage 3", MT_OPT_ADAMW, 3, true);
}
