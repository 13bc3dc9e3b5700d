/*
 * plan.c - recompute plans: what each unit keeps through forward, from a
 * fixed policy or chosen against a memory budget.
 *
 * A plan is one mode per recompute unit (mt_recompute_unit) and a segment
 * length. The budget policy searches a family of plans: the first r units
 * recomputed, in segments of k, the others kept whole or selectively, for
 * every r below the number of units (the last unit makes the logits and is
 * never recomputed) and every k <= r. Each plan's memory is its estimate
 * (estimate.c: exact, and cheap, since nothing is computed); its cost is
 * the forward FLOPs recompute repeats (cost_of). Candidates are tried in
 * order of cost, so the first that fits has the least recompute of the
 * family. A plan fits when its estimate is within the budget and its run
 * passes no allocator instance's limit_bytes (the estimate then fails at
 * the limit, as the run would): such a plan is skipped like one over the
 * budget.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/model.h"
#include "optim/optim.h"
#include "engine/plan.h"
#include "sparse/sparse.h"
#include "comm/comm.h"

void mti_plan_of_policy(const mt_model *m, const mt_trainer_config *c, unsigned char *units,
                        int *seg_len)
{
    const int U = m->n_units;
    *seg_len = 1;
    switch (c->recompute) {
    case MT_RECOMPUTE_CUSTOM:
        memcpy(units, c->recompute_units, (size_t)U);
        *seg_len = c->recompute_every;
        return;
    case MT_RECOMPUTE_EVERY_K:
    case MT_RECOMPUTE_SQRT: {
        /* segments of k from unit 0; the one holding the last unit is kept */
        int k = c->recompute == MT_RECOMPUTE_SQRT ? (int)ceil(sqrt((double)U)) : c->recompute_every;
        if (k < 1) k = 1;
        int kept_from = (U - 1) / k * k;
        for (int u = 0; u < U; u++) units[u] = u < kept_from ? MT_UNIT_RECOMPUTE : MT_UNIT_KEEP;
        *seg_len = k;
        return;
    }
    default:
        memset(units, c->recompute == MT_RECOMPUTE_SELECTIVE ? MT_UNIT_SELECTIVE : MT_UNIT_KEEP,
               (size_t)U);
        return;
    }
}

/* Tokens per row of a step. */
static int seq_of(const mt_model *m, const mt_trainer_config *c)
{
    return m->input == MT_INPUT_TOKENS ? (c->max_seq ? c->max_seq : m->max_seq) : 1;
}

/* The recompute cost of the family's member (r, q): units [0, r)
 * recomputed, [r, r + q) selective, the rest kept. */
static double cost_of(const mt_model *m, const double *full, const double *sel, int r, int q)
{
    double c = 0;
    for (int u = 0; u < m->n_units; u++) c += u < r ? full[u] : u < r + q ? sel[u] : 0;
    return c;
}

static void family(const mt_model *m, int r, int q, unsigned char *units)
{
    for (int u = 0; u < m->n_units; u++)
        units[u] = u < r ? MT_UNIT_RECOMPUTE : u < r + q ? MT_UNIT_SELECTIVE : MT_UNIT_KEEP;
}

/* The estimate of training m with c and this plan (no budget): of the
 * rank that needs the most. At ZeRO stages 1 to 3 a rank's bytes depend on
 * its slices (the last ranks' are short, whole tensors have one owner), so
 * each rank is estimated, without a communicator, and every rank plans for
 * the worst: the plans (and auto-fit's choices) are the same on every
 * rank, as the collectives need, and fit on each. */
static mt_status plan_estimate(const mt_model *m, const mt_trainer_config *c,
                               const unsigned char *units, int seg_len, mt_estimate_report *r)
{
    mt_trainer_config d = *c;
    d.recompute = MT_RECOMPUTE_CUSTOM;
    d.recompute_units = units;
    d.recompute_every = seg_len;
    d.memory_budget = 0;
    int world;
    (void)mti_comm_world(m->ctx, &world, NULL);
    /* (tensor parallel: the vocabulary's shares may differ by a row;
       pipeline parallel: the stages differ) */
    if (world < 2 || (!c->zero_stage && c->tensor_parallel < 2 && c->pipeline_parallel < 2))
        return mti_estimate_model(m, &d, -1, r);
    /* (without ZeRO the data-parallel groups' ranks hold alike: the first
       group's ranks, one per stage and place in a tensor group, say it all) */
    const int tp = c->tensor_parallel > 1 ? c->tensor_parallel : 1;
    const int pp = c->pipeline_parallel > 1 ? c->pipeline_parallel : 1;
    const int n = c->zero_stage ? world : tp * pp < world ? tp * pp : world;
    mt_status s = MT_OK;
    for (int q = 0; q < n && !s; q++) {
        mt_estimate_report e;
        s = mti_estimate_model(m, &d, q, &e);
        if (!s && (!q || e.peak_reserved > r->peak_reserved)) *r = e;
    }
    return s;
}

void mti_plan_describe(const mt_model *m, const unsigned char *units, int seg_len, char *buf,
                       size_t cap)
{
    int rec = 0, sel = 0;
    for (int u = 0; u < m->n_units; u++) rec += units[u] == MT_UNIT_RECOMPUTE, sel += units[u] == MT_UNIT_SELECTIVE;
    if (!rec && !sel) snprintf(buf, cap, "no recompute");
    else if (!rec) snprintf(buf, cap, "selective recompute in every unit");
    else
        snprintf(buf, cap, "%d of %d units recomputed in segments of %d%s", rec, m->n_units,
                 seg_len, sel ? ", selective recompute in the others" : "");
}

/* The family searched for budget (0: none fits; only the least is found).
 * fit: the cheapest member within budget (units, seg_len, its estimate and
 * cost); least: the member that needs the least. */
typedef struct search {
    const mt_model *m;
    bool found;
    unsigned char *units, *least_units;
    int seg_len, least_seg;
    double cost;
    double fwd;       /* forward FLOPs per token of the whole model (cost model) */
    mt_estimate_report est;
    uint64_t least;   /* UINT64_MAX: every member tried passes an instance's limit */
    char over[256];   /* why the first member over a limit failed; "" if none did */
} search;

static void search_free(search *q)
{
    free(q->units);
    free(q->least_units);
}

/* Tries one member: its estimate, the least so far, and whether it fits. */
static mt_status try_member(const mt_model *m, const mt_trainer_config *c, search *q,
                            unsigned char *units, int r, int sel, int k, uint64_t budget,
                            bool *fits, mt_estimate_report *est)
{
    family(m, r, sel, units);
    const uint64_t refused = mti_limit_refusals();
    mt_status s = plan_estimate(m, c, units, k, est);
    if (s == MT_ERR_OOM && mti_limit_refusals() != refused) {
        /* its run passes an allocator instance's limit_bytes: it does not fit */
        if (!q->over[0]) snprintf(q->over, sizeof q->over, "%s", mt_last_error(m->ctx));
        *fits = false;
        return MT_OK;
    }
    if (s) return s;
    if (est->peak_reserved < q->least) {
        q->least = est->peak_reserved;
        memcpy(q->least_units, units, (size_t)m->n_units);
        q->least_seg = k;
    }
    *fits = budget && est->peak_reserved <= budget;
    return MT_OK;
}

/* For each r (units recomputed from the first) and segment length k <= r:
 * the member with every other unit selective takes the least memory of its
 * (r, k); if it fits, a binary search finds the fewest selective units that
 * still fit. The cheapest fit wins; since recompute costs more than
 * selective recompute, once r alone costs more than the best found, no
 * larger r can win. */
static mt_status search_family(const mt_model *m, const mt_trainer_config *c, uint64_t budget,
                               search *q)
{
    const int U = m->n_units;
    memset(q, 0, sizeof *q);
    q->m = m;
    q->least = UINT64_MAX;
    q->units = malloc((size_t)U);
    q->least_units = malloc((size_t)U);
    const int T = seq_of(m, c);
    double *full = malloc((size_t)U * sizeof *full), *sel = malloc((size_t)U * sizeof *sel);
    unsigned char *try = malloc((size_t)U);
    mt_status s = MT_OK;
    if (!q->units || !q->least_units || !full || !sel || !try)
        s = mti_fail(m->ctx, MT_ERR_OOM, "out of host memory");
    if (!s) {
        mti_unit_costs(m, T, full, sel);
        for (int u = 0; u < U; u++) q->fwd += full[u];
    }
    for (int r = 0; r < U && !s; r++) {
        if (q->found && cost_of(m, full, sel, r, 0) >= q->cost) break;
        for (int k = 1; k <= (r ? r : 1) && !s; k++) {
            mt_estimate_report est;
            bool fits;
            if ((s = try_member(m, c, q, try, r, U - r, k, budget, &fits, &est)) || !fits) continue;
            int lo = 0, hi = U - r; /* hi fits */
            mt_estimate_report at_hi = est;
            while (lo < hi && !s) {
                int mid = (lo + hi) / 2;
                s = try_member(m, c, q, try, r, mid, k, budget, &fits, &est);
                if (!s && fits) hi = mid, at_hi = est;
                else lo = mid + 1;
            }
            double cost = cost_of(m, full, sel, r, hi);
            if (!s && (!q->found || cost < q->cost)) {
                q->found = true;
                family(m, r, hi, q->units);
                q->seg_len = k;
                q->est = at_hi;
                q->cost = cost;
            }
        }
    }
    free(full), free(sel), free(try);
    return s;
}

mt_status mti_plan_budget(const mt_model *m, const mt_trainer_config *c, unsigned char *units,
                          int *seg_len, mt_estimate_report *chosen)
{
    const uint64_t budget = c->memory_budget;
    mt_status s;
    mt_estimate_report r;
    uint64_t fixed = 0;
    /* a fixed policy: its plan fits or not */
    if (c->recompute != MT_RECOMPUTE_BUDGET) {
        mti_plan_of_policy(m, c, units, seg_len);
        if ((s = plan_estimate(m, c, units, *seg_len, &r))) return s;
        if (chosen) *chosen = r;
        if (!budget || r.peak_reserved <= budget) return MT_OK;
        fixed = r.peak_reserved;
    }
    search q;
    s = search_family(m, c, fixed ? 0 : budget, &q);
    if (!s && q.found) {
        memcpy(units, q.units, (size_t)m->n_units);
        *seg_len = q.seg_len;
        if (chosen) *chosen = q.est;
    } else if (!s && q.least == UINT64_MAX) {
        s = mti_fail(m->ctx, MT_ERR_BUDGET,
                     "no recompute plan fits the allocators' limits (limit_bytes): every plan "
                     "tried passes one (%s); raise the limit, or take fewer rows per "
                     "micro-batch, shorter sequences, 8-bit optimizer state or the fused step",
                     q.over);
    } else if (!s) {
        char how[160];
        mti_plan_describe(m, q.least_units, q.least_seg, how, sizeof how);
        if (q.over[0]) {
            size_t n = strlen(how);
            snprintf(how + n, sizeof how - n, " (plans needing less pass an allocator's limit)");
        }
        if (fixed)
            s = mti_fail(m->ctx, MT_ERR_BUDGET,
                         "the memory budget of %llu bytes cannot be met with the configured "
                         "recompute policy, which needs %llu; the least this model and config "
                         "can take is %llu bytes (%.1f MiB), with %s (MT_RECOMPUTE_BUDGET "
                         "chooses the cheapest plan that fits)",
                         (unsigned long long)budget, (unsigned long long)fixed,
                         (unsigned long long)q.least, (double)q.least / 1048576.0, how);
        else
            s = mti_fail(m->ctx, MT_ERR_BUDGET,
                         "no recompute plan fits the memory budget of %llu bytes; the least "
                         "this model and config can take is %llu bytes (%.1f MiB), with %s; "
                         "below that, fewer rows per micro-batch, shorter sequences, 8-bit "
                         "optimizer state or the fused step take less",
                         (unsigned long long)budget, (unsigned long long)q.least,
                         (double)q.least / 1048576.0, how);
    }
    search_free(&q);
    return s;
}

/* ---- auto-fit ---- */

/* The cost model of a step (seconds on a nominal machine; only comparisons
 * between candidates mean anything): forward + backward is 3x the forward
 * FLOPs, recompute adds its forward FLOPs, GEMMs over n rows run at
 * n / (n + half) of the peak rate, and the optimizer update moves its bytes
 * per parameter at the memory bandwidth. The rates are the device's:
 *   CPU: the one this was measured on (docs/benchmarks-history.md): 200 GFLOP/s
 *     sgemm (16-bit compute runs through fp32 GEMMs), 40 GB/s, half at 32
 *     rows; the 8-bit update is compute-bound at about 8.8x its 16 bytes.
 *   CUDA: a nominal H100-class GPU (not measured here): 50 TFLOP/s in fp32
 *     (no TF32), 400 in fp16/bf16, 2.5 TB/s, half at 1024 rows (a GEMM
 *     needs many rows to fill the GPU); the 8-bit update is bandwidth-bound.
 * On several ranks: tensor parallel divides a rank's GEMMs and update by
 * T, and the collectives move their bytes (ring algorithms: 2 (n - 1) / n
 * of the buffer for a sum over n ranks) at a nominal link rate, 10 GB/s
 * between a CPU's processes (shared memory), 100 GB/s between GPUs. */
typedef struct fit_rates {
    double flops, flops16, bw, half, q8, link;
} fit_rates;

static const fit_rates fit_cpu = {200e9, 200e9, 40e9, 32, 8.8, 10e9};
static const fit_rates fit_cuda = {50e12, 400e12, 2.5e12, 1024, 1.0, 100e9};

static double update_bytes(const mt_trainer_config *c, const fit_rates *r)
{
    const mti_optim *o = mti_optim_of(c->optimizer); /* checked before (else AdamW's) */
    int quantized = 0;
    double bytes = o ? o->traffic(c, &quantized) : 28;
    return quantized ? bytes * r->q8 : bytes;
}

/* fwd: the model's forward FLOPs per token; rec_cost: what recompute adds. */
static double step_seconds(const mt_model *m, const mt_trainer_config *c, int micro, double fwd,
                           double rec_cost)
{
    const fit_rates *r = m->ctx->dev->kind == MT_DEVICE_CUDA ? &fit_cuda : &fit_cpu;
    const double flops = c->precision == MT_PREC_FP32 ? r->flops : r->flops16;
    const int T = seq_of(m, c);
    const double tp = c->tensor_parallel > 1 ? c->tensor_parallel : 1;
    /* (pipeline parallel: a stage's share, P of them, and 1F1B's bubble,
       (M + P - 1) / M of the micro-batches' time) */
    const double pp = c->pipeline_parallel > 1 ? c->pipeline_parallel : 1;
    double total = 0, M = 0;
    for (int r0 = 0; r0 < c->max_batch; r0 += micro, M++) {
        int rows = c->max_batch - r0 < micro ? c->max_batch - r0 : micro;
        double tok = (double)rows * T, eff = tok / (tok + r->half);
        total += (3 * fwd + rec_cost) * tok / (flops * eff) / tp / pp;
    }
    if (pp > 1 && M > 0) total *= (M + pp - 1) / M;
    return total + (double)m->n_params * update_bytes(c, r) / r->bw / tp / pp +
           mti_comm_seconds(m, c);
}

double mti_comm_seconds(const mt_model *m, const mt_trainer_config *c)
{
    const fit_rates *r = m->ctx->dev->kind == MT_DEVICE_CUDA ? &fit_cuda : &fit_cpu;
    int world;
    (void)mti_comm_world(m->ctx, &world, NULL);
    const int pp = c->pipeline_parallel > 1 ? c->pipeline_parallel : 1;
    const int tp = c->tensor_parallel > 1 ? c->tensor_parallel : 1, dp = world / tp / pp;
    const double grads = (double)m->n_params / tp / pp * 4.0; /* a rank's fp32 gradients */
    double bytes = 0.0;
    if (pp > 1) {
        /* a middle stage's exchanges: every row's activation in and out, its
           gradient back and forth, in the compute dtype (a stage's width: the
           blocks' or the MLP's widest); the tied table's gradient once */
        const double rows = (double)c->max_batch * seq_of(m, c), es = c->precision == MT_PREC_FP32 ? 4.0 : 2.0;
        double W = 0;
        for (int i = 0; i < m->n_layers; i++) W = m->layers[i].out > W ? m->layers[i].out : W;
        if (m->kind == MTI_MODEL_GPT) W = m->gpt.channels;
        bytes += 2.0 * rows * W * es / (c->sequence_parallel ? tp : 1);
        if (m->kind == MTI_MODEL_GPT) /* (under ZeRO each rank's slice) */
            bytes += (double)m->padded_vocab * m->gpt.channels * 4.0 / tp /
                     (c->zero_stage && dp > 1 ? dp : 1);
    }
    if (dp > 1) /* the gradients' sums (ZeRO-3: the weights gathered twice besides) */
        bytes += (c->zero_stage == 3 ? 3.0 : 2.0) * (dp - 1) / dp * grads;
    if (tp > 1 && m->kind == MTI_MODEL_GPT) {
        /* four sums a block, the embedding's and the head's, of a micro-batch's
           rows x width, in fp32 (all-reduces; sequence parallel: reduce-scatters,
           half the bytes, and six all-gathers a block of the rows in the
           compute dtype besides) */
        const double rows = (double)c->max_batch * seq_of(m, c), C = m->gpt.channels;
        const double es = c->precision == MT_PREC_FP32 ? 4.0 : 2.0, f = (double)(tp - 1) / tp;
        /* (pipeline parallel: a stage's blocks) */
        const double sums = 4.0 * m->gpt.layers / pp + 2.0;
        bytes += c->sequence_parallel
                     ? sums * rows * C * 4.0 * f + 6.0 * m->gpt.layers / pp * rows * C * es * f
                     : sums * rows * C * 4.0 * 2.0 * f;
    }
    return bytes / r->link;
}

/* The optimizers auto-fit tries for cfg (allow: MT_AUTOFIT_ALLOW_* flags):
 * cfg's own, then 8-bit and 4-bit AdamW state in place of AdamW's where
 * allowed and possible (4-bit needs fp32 masters and the op table's
 * kernel). Returns how many. */
/* Whether the offload directory can take a run's scratch directory (it
 * exists, is a directory, and may be written and entered); else why not,
 * in why. Auto-fit offers the disk only then: its dry runs never touch the
 * disk, and a fit the run's create would refuse is no fit. */
static bool dir_usable(const char *dir, char *why, size_t n)
{
    struct stat sb;
    if (stat(dir, &sb) != 0)
        snprintf(why, n, "the offload directory '%s': %s", dir, strerror(errno));
    else if (!S_ISDIR(sb.st_mode))
        snprintf(why, n, "the offload directory '%s' is not a directory", dir);
    else if (access(dir, W_OK | X_OK) != 0)
        snprintf(why, n, "the offload directory '%s': %s", dir, strerror(errno));
    else
        return true;
    return false;
}

static int fit_optimizers(const mt_model *m, const mt_trainer_config *cfg, int allow,
                          mt_optimizer_kind out[3])
{
    int n = 0;
    out[n++] = cfg->optimizer;
    if (cfg->optimizer != MT_OPT_ADAMW) return n;
    /* (blockwise state does not follow masks that change after create) */
    if (mti_prune_later(&cfg->prune) ||
        (cfg->prune.method != MT_PRUNE_NONE && cfg->prune.regrow != MT_REGROW_NONE))
        return n;
    if (allow & MT_AUTOFIT_ALLOW_8BIT) out[n++] = MT_OPT_ADAMW8;
    const mti_optim *o4 = mti_optim_of(MT_OPT_ADAMW4);
    if ((allow & MT_AUTOFIT_ALLOW_4BIT) && o4->has_ops(m->ctx->ops) &&
        (cfg->master_weights || !o4->needs_masters))
        out[n++] = MT_OPT_ADAMW4;
    return n;
}

mt_status mt_trainer_autofit(const mt_model *m, mt_trainer_config *cfg, int allow,
                             mt_autofit_report *out)
{
    if (!m || !cfg || !out)
        return mti_fail(m ? m->ctx : NULL, MT_ERR_INVALID_ARG, "mt_trainer_autofit: %s is NULL",
                        !m ? "m" : !cfg ? "cfg" : "out");
    if (!cfg->memory_budget)
        return mti_fail(m->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_autofit: cfg->memory_budget is 0 (auto-fit needs a budget)");
    if (allow & ~(MT_AUTOFIT_ALLOW_8BIT | MT_AUTOFIT_ALLOW_4BIT))
        return mti_fail(m->ctx, MT_ERR_INVALID_ARG,
                        "mt_trainer_autofit: allow %d has bits other than MT_AUTOFIT_ALLOW_8BIT "
                        "(1) and MT_AUTOFIT_ALLOW_4BIT (2)",
                        allow);
    memset(out, 0, sizeof *out);
    mt_optimizer_kind opts[3];
    const int n_opts = fit_optimizers(m, cfg, allow, opts);
    /* The tiers tried in turn, each only when nothing fitted before it:
       cfg's own places; then the optimizer state (and masters) in pinned
       host memory; then, where a directory is named, the state on disk;
       then the weights on disk too. Whether a tier runs for this model,
       context (device, world size) and configuration is the trainer's to
       say (mti_offload_check, read through the estimate's create): a
       candidate it refuses is skipped, and the last tier's refusal said
       when nothing fits. */
    char nodir[320] = "";
    const bool dir = cfg->offload_dir && *cfg->offload_dir &&
                     dir_usable(cfg->offload_dir, nodir, sizeof nodir);
    if (!(cfg->offload_dir && *cfg->offload_dir) && !cfg->offload_params)
        snprintf(nodir, sizeof nodir, "no offload_dir is named");
    struct fit_tier {
        mt_place place;
        int params;
    } tier[4] = {{cfg->offload, cfg->offload_params}};
    int n_tiers = 1;
    if (cfg->offload == MT_PLACE_DEVICE && !cfg->offload_params &&
        m->ctx->dev->kind == MT_DEVICE_CUDA) /* (a CPU context's device memory is the host's) */
        tier[n_tiers++] = (struct fit_tier){MT_PLACE_HOST, 0};
    if (dir && cfg->offload == MT_PLACE_DEVICE && !cfg->offload_params)
        tier[n_tiers++] = (struct fit_tier){MT_PLACE_DISK, 0};
    if (dir && (cfg->offload == MT_PLACE_DEVICE || cfg->offload == MT_PLACE_DISK) &&
        !cfg->offload_params)
        tier[n_tiers++] = (struct fit_tier){MT_PLACE_DISK, 1};
    char refused[320] = "";
    mt_trainer_config best = *cfg;
    double best_t = 0;
    uint64_t least = UINT64_MAX;
    char least_how[320] = "", over[256] = "";
    mt_status s = MT_OK;
    /* micro-batch sizes: for each number of passes, the smallest size that
       gives it (the largest batch first); resident first, then offloaded */
    /* a tier refused for an optimizer is refused at every micro-batch size
       (the refusals read the places, stage, precision and optimizer, never
       the micro-batch): tried once */
    bool refused_opt[3];
    for (int off = 0; off < n_tiers && !s && !best_t; off++)
    for (int passes = 1; passes <= cfg->max_batch && !s; passes++) {
        if (passes == 1) memset(refused_opt, 0, sizeof refused_opt);
        int micro = (cfg->max_batch + passes - 1) / passes;
        if (passes > 1 && (cfg->max_batch + micro - 1) / micro != passes) continue;
        if (cfg->fused_step && micro < cfg->max_batch) break;
        for (int e = 0; e < n_opts && !s; e++) {
            mt_trainer_config c = *cfg;
            c.micro_batch = micro == cfg->max_batch ? 0 : micro;
            c.optimizer = opts[e];
            c.recompute = MT_RECOMPUTE_BUDGET;
            c.offload = tier[off].place;
            c.offload_params = tier[off].params;
            search q;
            out->tried++;
            if (refused_opt[e]) continue;
            s = search_family(m, &c, c.memory_budget, &q);
            if (off && s == MT_ERR_UNSUPPORTED) { /* a tier this run does not take */
                refused_opt[e] = true;
                snprintf(refused, sizeof refused, "%s", mt_last_error(m->ctx)); /* (the last tier's) */
                search_free(&q);
                s = MT_OK;
                continue;
            }
            if (!s && q.found) {
                out->candidates++;
                /* offloaded to disk: the state (and weights) read and
                   written once a step, the weights read once more (forward
                   and backward), at a nominal 1.5 GB/s (this machine's disk,
                   docs/benchmarks-history.md); to host memory: read and written
                   once a step by the CPU's update at a nominal 20 GB/s */
                double t = step_seconds(m, &c, micro, q.fwd, q.cost) +
                           (2.0 * (double)q.est.place_peak[MT_PLACE_DISK] +
                            (double)q.est.place_class_peak[MT_PLACE_DISK][MT_MEM_PARAM]) / 1.5e9 +
                           2.0 * (double)q.est.place_peak[MT_PLACE_HOST] / 20e9;
                if (!best_t || t < best_t) {
                    best_t = t;
                    best = c;
                    out->micro_batch = micro;
                    out->optimizer = c.optimizer;
                    out->offload = c.offload;
                    out->offload_params = c.offload_params;
                    out->units = m->n_units;
                    out->recomputed_units = out->selective_units = 0;
                    for (int u = 0; u < m->n_units; u++) {
                        out->recomputed_units += q.units[u] == MT_UNIT_RECOMPUTE;
                        out->selective_units += q.units[u] == MT_UNIT_SELECTIVE;
                    }
                    out->seg_len = q.seg_len;
                    out->peak_reserved = q.est.peak_reserved;
                }
            }
            if (!s && !q.found && q.over[0] && !over[0]) snprintf(over, sizeof over, "%s", q.over);
            if (!s && !q.found && q.least < least) {
                least = q.least;
                char how[160];
                mti_plan_describe(m, q.least_units, q.least_seg, how, sizeof how);
                snprintf(least_how, sizeof least_how, "micro-batches of %d rows%s%s, %s%s", micro,
                         !e ? "" : opts[e] == MT_OPT_ADAMW8 ? " and 8-bit AdamW"
                                                            : " and 4-bit AdamW",
                         tier[off].params                   ? ", the state and the weights on disk"
                         : tier[off].place == MT_PLACE_DISK ? ", the state on disk"
                         : tier[off].place == MT_PLACE_HOST ? ", the state in host memory"
                                                            : "",
                         how,
                         q.over[0] ? " (plans needing less pass an allocator's limit)" : "");
            }
            search_free(&q);
        }
    }
    if (s) return s;
    if (!best_t && least == UINT64_MAX)
        return mti_fail(m->ctx, MT_ERR_BUDGET,
                        "mt_trainer_autofit: nothing fits the allocators' limits (limit_bytes): "
                        "every configuration tried passes one (%s)", over);
    if (!best_t)
        return mti_fail(m->ctx, MT_ERR_BUDGET,
                        "mt_trainer_autofit: nothing fits the memory budget of %llu bytes; the "
                        "least is %llu bytes (%.1f MiB), with %s%s%.320s%s%.320s",
                        (unsigned long long)cfg->memory_budget, (unsigned long long)least,
                        (double)least / 1048576.0, least_how,
                        refused[0] ? "; not tried, as the trainer refuses it: " : "", refused,
                        nodir[0] ? "; the disk not tried: " : "", nodir);
    const bool masters = cfg->precision != MT_PREC_FP32 && cfg->master_weights;
    if (best.offload == MT_PLACE_HOST && cfg->offload != MT_PLACE_HOST)
        mti_log(m->ctx, MT_LOG_INFO,
                "mt_trainer_autofit: nothing fits %llu bytes with the state on the device; "
                "with the optimizer state%s in pinned host memory it fits",
                (unsigned long long)cfg->memory_budget, masters ? " and masters" : "");
    else if (best.offload != cfg->offload || best.offload_params != cfg->offload_params)
        mti_log(m->ctx, MT_LOG_INFO,
                "mt_trainer_autofit: nothing fits %llu bytes with %s on the device; with the "
                "optimizer state%s on disk (in %s) it fits",
                (unsigned long long)cfg->memory_budget,
                best.offload_params ? "the weights" : "the state",
                best.offload_params ? (masters ? ", the masters and the weights" : " and the weights")
                : masters           ? " and masters"
                                    : "",
                cfg->offload_dir);
    out->step_seconds = best_t;
    out->comm_seconds = mti_comm_seconds(m, &best);
    const int T = seq_of(m, cfg);
    out->tokens_per_second = (double)cfg->max_batch * T / best_t;
    *cfg = best;
    return MT_OK;
}
