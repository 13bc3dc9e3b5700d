/*
 * pp.c - pipeline parallel: the grid's pipeline groups, the model cut into
 * stages and made this rank's, the 1F1B schedule of a step's micro-batches,
 * the tied table's gradient between the first and last stages, and the
 * model whole again at the end (pp.h).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train/pp.h"
#include "train/tp.h"
#include "train/home.h"
#include "comm/comm.h"
#include "optim/optim.h"

#define BAD(...) return mti_fail(ctx, MT_ERR_INVALID_ARG, __VA_ARGS__)
#define NO(...) return mti_fail(ctx, MT_ERR_UNSUPPORTED, __VA_ARGS__)

static const char *const fn_create = "mt_trainer_create";

mt_status mti_pp_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *c)
{
    const int P = c->pipeline_parallel;
    if (P < 0 || P > 65536) BAD("%s: cfg->pipeline_parallel %d out of range 0..65536", fn_create, P);
    if (P <= 1) return MT_OK;
    int W;
    mt_comm *world = mti_comm_world(ctx, &W, NULL);
    if (W != ctx->world)
        NO("%s: the context's ranks are split into groups by another trainer; destroy it first",
           fn_create);
    const int T = c->tensor_parallel > 1 ? c->tensor_parallel : 1;
    if (W % (T * P))
        BAD("%s: the world of %d ranks is not a multiple of tensor_parallel %d x "
            "pipeline_parallel %d (the ranks form a grid: N = dp x tp x pp)",
            fn_create, W, T, P);
    if (P > m->n_units)
        BAD("%s: cfg->pipeline_parallel %d is more than the model's %d units (a stage holds "
            "whole recompute units, at least one)", fn_create, P, m->n_units);
    if (world && !ctx->dry && !mt_comm_has_p2p(world))
        NO("%s: cfg->pipeline_parallel needs point-to-point calls, which the %s communicator's "
           "table has not (mt_comm_has_p2p)", fn_create, mt_comm_name(world));
    bool quantized = c->base != MT_BASE_FULL;
    for (int i = 0; i < m->n_param; i++) quantized |= m->params[i].qf != 0;
    const int zero = W / (T * P) > 1 ? c->zero_stage : 0;
    const char *why = c->fused_step                   ? "the fused step (cfg->fused_step)"
                      : zero == 3                     ? "ZeRO stage 3"
                      : c->lora.rank || m->lora_rank  ? "LoRA adapters"
                      : quantized                     ? "a quantized base"
                      : c->teacher                    ? "distillation (cfg->teacher)"
                      : c->offload != MT_PLACE_DEVICE ? "offload (cfg->offload)"
                      : c->local_sgd_every            ? "local SGD (cfg->local_sgd_every)"
                                                      : NULL;
    if (why)
        NO("%s: cfg->pipeline_parallel %d does not combine with %s yet (docs/distributed.md, "
           "\"Pipeline parallel\")", fn_create, P, why);
    if (zero && !mti_optim_of(c->optimizer)->sliceable)
        NO("%s: cfg->pipeline_parallel %d with ZeRO needs an optimizer that updates slices of a "
           "tensor (%s keeps whole tensors on one rank each, which the first and last stages' "
           "copies of the token table would not share)", fn_create, P,
           mti_optim_of(c->optimizer)->title);
    return MT_OK;
}

/* ---- the stages ---- */

/* The first unit of each of the P stages (start[P] = U): contiguous runs
 * of units whose largest sum of costs (forward FLOPs per row, the same
 * ratios as a step's) is the least, the earliest such cut. */
static mt_status cut_units(mt_context *ctx, const mt_model *m, int P, int T, int *start)
{
    const int U = m->n_units;
    double *full = calloc((size_t)U, sizeof *full), *sel = calloc((size_t)U, sizeof *sel);
    double *pre = calloc((size_t)U + 1, sizeof *pre);
    double *best = malloc((size_t)(P + 1) * (size_t)(U + 1) * sizeof *best);
    int *from = malloc((size_t)(P + 1) * (size_t)(U + 1) * sizeof *from);
    mt_status s = full && sel && pre && best && from
                      ? MT_OK
                      : mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    if (!s) {
        mti_unit_costs(m, T, full, sel);
        for (int u = 0; u < U; u++) pre[u + 1] = pre[u] + full[u];
        /* best[k][u]: the least largest stage of units [0, u) in k stages */
#define B(k, u) best[(size_t)(k) * (size_t)(U + 1) + (size_t)(u)]
#define F(k, u) from[(size_t)(k) * (size_t)(U + 1) + (size_t)(u)]
        for (int u = 0; u <= U; u++) B(1, u) = pre[u], F(1, u) = 0;
        for (int k = 2; k <= P; k++)
            for (int u = k; u <= U; u++) {
                B(k, u) = -1.0;
                for (int v = k - 1; v < u; v++) { /* the last stage: units [v, u) */
                    const double last = pre[u] - pre[v];
                    const double worst = B(k - 1, v) > last ? B(k - 1, v) : last;
                    if (B(k, u) < 0 || worst < B(k, u)) B(k, u) = worst, F(k, u) = v;
                }
            }
        start[P] = U;
        for (int k = P, u = U; k >= 1; k--) u = start[k - 1] = F(k, u);
#undef B
#undef F
    }
    free(full), free(sel), free(pre), free(best), free(from);
    return s;
}

/* The stage's view: layers [l0, l1) and their parameters (from q0), and on
 * the last stage a copy of the tied table; the weights move into it. */
static mt_status make_view(mt_trainer *t, int l0, int l1)
{
    mt_model *m = t->model;
    mti_pp *pp = &t->pp;
    const mti_layer *end = &m->layers[l1 - 1];
    const int q0 = m->layers[l0].p0, q1 = end->p0 + end->np, L = l1 - l0;
    const bool copy = end->kind == MT_LAYER_LM_HEAD && end->tied >= 0 && end->tied < q0;
    const int n = q1 - q0 + (copy ? 1 : 0);
    mti_layer *ly = calloc((size_t)L, sizeof *ly);
    mti_param *ps = calloc((size_t)n + 1, sizeof *ps);
    if (!ly || !ps) {
        free(ly), free(ps);
        return mti_fail(t->ctx, MT_ERR_OOM, "out of host memory");
    }
    pp->l0 = l0, pp->l1 = l1, pp->q0 = q0, pp->u0 = m->layers[l0].unit;
    pp->tied = copy ? n - 1 : -1;
    for (int k = 0; k < n; k++) {
        mti_param *w = &m->params[k < q1 - q0 ? q0 + k : pp->table];
        ps[k] = *w;
        ps[k].uses = k < q1 - q0; /* (its layer's; a head adds its table below) */
        memset(&w->w.blk, 0, sizeof w->w.blk); /* (moved) */
        memset(&w->master.blk, 0, sizeof w->master.blk);
    }
    size_t numel = 0;
    for (int k = 0; k < n; k++) numel += ps[k].numel;
    for (int k = 0; k < L; k++) {
        ly[k] = m->layers[l0 + k];
        ly[k].p0 -= q0;
        ly[k].unit -= pp->u0;
        if (ly[k].kind == MT_LAYER_LM_HEAD && ly[k].tied >= 0) {
            ly[k].tied = copy ? n - 1 : ly[k].tied - q0;
            ps[ly[k].tied].uses++;
        }
    }
    pp->n_layers = m->n_layers, pp->n_units = m->n_units, pp->n_param = m->n_param;
    pp->n_base = m->n_base, pp->n_params = m->n_params, pp->n_base_params = m->n_base_params;
    pp->layers = m->layers, pp->params = m->params;
    m->layers = ly, m->params = ps;
    m->n_layers = L;
    m->n_units = ly[L - 1].unit + 1;
    m->n_param = m->n_base = n;
    m->n_params = m->n_base_params = numel;
    m->pp = pp;
    t->pp_made = 1;
    return MT_OK;
}

mt_status mti_pp_begin(mt_trainer *t, mt_status s)
{
    const int P = t->cfg.pipeline_parallel;
    if (P <= 1) return s;
    mt_context *ctx = t->ctx;
    mt_model *m = t->model;
    const int W = ctx->world, r = ctx->rank;
    const int T = t->cfg.tensor_parallel > 1 ? t->cfg.tensor_parallel : 1;
    const int q = r % T, st = (r / T) % P, d = r / (T * P);
    /* every rank gets here, failed or not, and they agree before the
       groups (collectives of the world) are made */
    if (!ctx->dry && W > 1)
        s = mti_group_agree(t, ctx->cfg.comm, W, r, fn_create, "the trainer's creation",
                            "the ranks", s);
    if (s) return s;
    t->pp.size = P;
    t->pp.rank = st;
    t->pp.table = -1;
    if (!ctx->dry && W > 1) { /* the pipeline group; the data-parallel one (tensor parallel's own) */
        mt_comm *c = ctx->cfg.comm;
        s = mt_comm_split(c, d * T + q, st, &t->pp.comm);
        if (!s && T == 1) s = mt_comm_split(c, st, d, &t->dp_comm);
        if (s) /* (the world agrees below, whatever failed here) */
            s = mti_fail(ctx, s, "%s: making the pipeline and data-parallel groups: %s",
                         fn_create, mt_last_error(NULL));
    }
    int *start = malloc((size_t)(P + 1) * sizeof *start);
    unsigned char *which = calloc((size_t)m->n_param + 1, 1);
    if (!s && (!start || !which)) s = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    const int Tq = m->input == MT_INPUT_TOKENS ? (t->cfg.max_seq ? t->cfg.max_seq : m->max_seq) : 1;
    if (!s) s = cut_units(ctx, m, P, Tq, start);
    int l0 = 0, l1 = m->n_layers;
    for (int i = 0; !s && i < m->n_layers; i++) {
        if (m->layers[i].unit < start[st]) l0 = i + 1;
        if (m->layers[i].unit >= start[st + 1] && l1 == m->n_layers) l1 = i;
    }
    const mti_layer *end = &m->layers[m->n_layers - 1];
    if (end->kind == MT_LAYER_LM_HEAD && end->tied >= 0) t->pp.table = end->tied;
    if (!s && !(t->pp.starts = calloc((size_t)P, sizeof *t->pp.starts)))
        s = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    for (int k = 0, i = 0; !s && k < P; k++) { /* (every stage's, for the end) */
        while (m->layers[i].unit < start[k]) i++;
        t->pp.starts[k] = m->layers[i].p0;
    }
    if (!s) { /* a deferred model: this stage's weights (and the last's table) made */
        const mti_layer *e = &m->layers[l1 - 1];
        for (int i = m->layers[l0].p0; i < e->p0 + e->np; i++) which[i] = 1;
        if (e->kind == MT_LAYER_LM_HEAD && t->pp.table >= 0) which[t->pp.table] = 1;
        s = mti_model_make(m, which);
    }
    if (!s) s = make_view(t, l0, l1);
    if (!s) { /* the stage's units of the plan */
        memmove(t->units, t->units + t->pp.u0, (size_t)m->n_units);
        t->cfg.recompute_units = t->units;
    }
    free(start);
    free(which);
    if (!s && !(t->pp_pass = calloc((size_t)P, sizeof *t->pp_pass)))
        s = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    /* every rank's stage made, or none: the world agrees again, so what
       follows (the context narrowed, tensor parallel's groups) is the same
       on every rank */
    if (!ctx->dry && W > 1)
        s = mti_group_agree(t, ctx->cfg.comm, W, r, fn_create, "the pipeline stages", "the ranks",
                            s);
    if (!s && T == 1) mti_comm_narrow(ctx, t->dp_comm, W / P, d);
    return s;
}

mt_status mti_pp_files_ok(const mt_trainer *t, const char *fn)
{
    if (!t->zero || t->tp.size < 2) return MT_OK;
    return mti_fail(t->ctx, MT_ERR_UNSUPPORTED,
                    "%s: training-state files of pipeline and tensor parallel with ZeRO in the "
                    "data-parallel groups are not built yet", fn);
}

mt_status mti_pp_agree_file(mt_trainer *t, const char *fn, uint64_t digest, mt_status s)
{
    if (t->pp.size < 2) return s;
    return mti_group_agree_file(t, t->pp.comm, t->pp.size, t->pp.rank, "the pipeline group", fn,
                                digest, s);
}

mt_status mti_pp_agree(mt_trainer *t, const char *fn, const char *what, mt_status s)
{
    if (t->pp.size < 2 || !t->pp.comm || t->ctx->dry) return s;
    return mti_group_agree(t, t->pp.comm, t->pp.size, t->pp.rank, fn, what, "the pipeline group", s);
}

mt_status mti_pp_agree_batch(mt_trainer *t, const char *fn, const mt_batch *b, mt_status s)
{
    if (t->pp.size < 2) return s;
    s = mti_pp_agree(t, fn, "the batch's checks", s);
    if (s || !t->pp.comm || t->ctx->dry) return s;
    /* (checked: rows and tokens are small, exact in fp32) */
    const float n = (float)b->n, T = t->model->input == MT_INPUT_TOKENS ? (float)b->seq_len : 1.0f;
    float v[4] = {n, -n, T, -T};
    s = mti_comm_group_host_all_reduce(t->ctx, t->pp.comm,
                                       "pipeline parallel: the batch's shape over the group", v, 4,
                                       MT_COMM_MAX);
    if (!s && (v[0] != -v[1] || v[2] != -v[3]))
        s = mti_fail(t->ctx, MT_ERR_INVALID_ARG,
                     "%s: the ranks of the pipeline group were given batches of different shapes "
                     "(%g to %g rows, %g to %g tokens each; every rank of a pipeline group is "
                     "given the same batch)", fn, (double)-v[1], (double)v[0], (double)-v[3],
                     (double)v[2]);
    return s;
}

void mti_pp_commit(mt_trainer *t)
{
    if (!t->pp_made) return;
    const mti_pp *pp = &t->pp;
    for (int i = 0; i < pp->n_param; i++) {
        mti_param *p = &pp->params[i];
        mti_tensor_free(t->ctx, &p->w);
        mti_tensor_free(t->ctx, &p->master);
        p->unmade = 1; /* (its stage's: it comes back at the end) */
    }
    t->pp_committed = 1;
}

/* The stage holding whole parameter i. */
static int stage_of(const mti_pp *pp, int i)
{
    int st = 0;
    while (st + 1 < pp->size && pp->starts[st + 1] <= i) st++;
    return st;
}

void mti_pp_end(mt_trainer *t)
{
    if (t->pp.size < 2) return;
    mt_context *ctx = t->ctx;
    mt_model *m = t->model;
    mti_pp *pp = &t->pp;
    /* (each step's schedule let its passes' tensors go) */
    for (int k = 0; k < pp->size && t->pp_pass; k++) mti_pass_free(&t->pp_pass[k]);
    free(t->pp_pass);
    t->pp_pass = NULL;
    if (t->pp_made) { /* the stage's weights back into the whole model */
        mti_param *vp = m->params;
        const int n = m->n_param;
        m->layers = (free(m->layers), pp->layers);
        m->params = pp->params;
        m->n_layers = pp->n_layers, m->n_units = pp->n_units, m->n_param = pp->n_param;
        m->n_base = pp->n_base, m->n_params = pp->n_params, m->n_base_params = pp->n_base_params;
        for (int k = 0; k < n; k++) {
            mti_param *w = &m->params[k == pp->tied ? pp->table : pp->q0 + k];
            if (k == pp->tied && t->pp_committed) { /* (the first stage's comes) */
                mti_tensor_free(ctx, &vp[k].w);
                continue;
            }
            const int uses = w->uses;
            *w = vp[k];
            w->uses = uses;
        }
        free(vp);
        m->pp = NULL;
    }
    /* every stage's weights to every rank of the group: first every rank
       makes room for the others' (fp32), and the group agrees that all did,
       then each tensor is broadcast from its stage; where any rank has no
       room, none is sent and the others' stages' weights are lost there
       (said in the log), so the ranks' calls stay paired */
    const bool send = t->pp_committed && !t->pp_discard;
    mt_status s = MT_OK;
    for (int i = 0; send && i < m->n_param; i++) {
        mti_param *p = &m->params[i];
        if (p->w.blk.ptr) continue; /* (this stage's) */
        p->w = (mti_tensor){.dtype = MTI_F32, .ndim = p->ndim, .shape = {p->shape[0], p->shape[1]}};
        mt_status e = mti_tensor_alloc(ctx, &p->w, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                       MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
        if (!e && stage_of(pp, i) == pp->rank) e = mti_tensor_zero(ctx, &p->w); /* (its own, lost) */
        if (!s) s = e;
    }
    if (send && pp->comm && !ctx->dry) {
        float bad = s != MT_OK;
        mt_status e = mti_comm_group_host_all_reduce(
            ctx, pp->comm, "pipeline parallel: room for every stage's weights", &bad, 1, MT_COMM_SUM);
        if (!s && (e || bad > 0.0f))
            s = e ? e : mti_fail(ctx, MT_ERR_OOM, "a rank of the pipeline group has no room for "
                                 "the whole model's weights");
    }
    for (int i = 0; send && i < m->n_param; i++) {
        mti_param *p = &m->params[i];
        const int owner = stage_of(pp, i);
        char what[96];
        snprintf(what, sizeof what, "pipeline parallel: %s to every stage", p->name);
        if (!s && pp->comm && !ctx->dry)
            s = mti_comm_group_broadcast(ctx, pp->comm, what, p->w.blk.ptr, p->numel, MT_COMM_F32,
                                         owner);
        if (s && owner != pp->rank) mti_tensor_free(ctx, &p->w); /* (not come: lost) */
        p->unmade = !p->w.blk.ptr;
    }
    if (s)
        mti_log(ctx, MT_LOG_ERROR, "mt_trainer_destroy: the pipeline stages' weights could not be "
                "brought to every rank (%s); the other stages' weights are lost on this rank "
                "(unmade: calls that read them fail)", mti_last_msg(ctx).s);
    if (t->pp_discard)
        for (int i = 0; i < m->n_param; i++)
            if (!m->params[i].w.blk.ptr) m->params[i].unmade = 1;
    free(pp->starts);
    if (t->cfg.tensor_parallel <= 1) { /* (tensor parallel's end widened and freed its own) */
        mti_comm_widen(ctx);
        mt_comm_destroy(t->dp_comm);
        t->dp_comm = NULL;
    }
    mt_comm_destroy(pp->comm);
    memset(pp, 0, sizeof *pp);
    t->pp_made = t->pp_committed = 0;
}

/* ---- the schedule ---- */

/* One exchange with the neighbours: `out` (bytes) to the stage after
 * (fwd) or before, and `in` (bytes) from the stage before (fwd) or after,
 * either absent. */
static mt_status exchange(mt_trainer *t, const char *what, const mti_tensor *out, int to,
                          mti_tensor *in, int from)
{
    mt_context *ctx = t->ctx;
    if (ctx->dry || !t->pp.comm) return MT_OK;
    const size_t ob = out ? mti_tensor_bytes(out) : 0, ib = in ? mti_tensor_bytes(in) : 0;
    if (!ob && !ib) return MT_OK;
    return mti_comm_group_sendrecv(ctx, t->pp.comm, what, ob ? out->blk.ptr : NULL, ob,
                                   ob ? to : -1, ib ? in->blk.ptr : NULL, ib, ib ? from : -1,
                                   false);
}

typedef struct sched {
    mt_trainer *t;
    const mt_batch *b;
    int M, K, T;
    bool first, last, train;
    mti_right_fn count; /* eval's accuracy, or NULL */
    mti_bwd_fn bwd;     /* a micro-batch's backward */
    float dloss;
    double sum;
    int right;
    mti_tensor x;   /* the next forward's input, received */
    mti_tensor dy;  /* the next backward's output gradient, received */
} sched;

static int rows_of(const sched *c, int i)
{
    const int r0 = i * c->t->micro;
    return c->b->n - r0 < c->t->micro ? c->b->n - r0 : c->t->micro;
}

/* A stage boundary's tensor for micro-batch i, in dt: its rows (under
 * sequence parallel this rank's share) of the stage's input (in: x, ACT,
 * kept through its backward) or of the gradient of its output (dy, WORK,
 * used up by its backward). */
static mt_status boundary(sched *c, int i, bool in)
{
    mt_trainer *t = c->t;
    const mt_model *m = t->model;
    const int64_t N = (int64_t)rows_of(c, i) * c->T;
    mti_tensor *x = in ? &c->x : &c->dy;
    *x = (mti_tensor){.dtype = t->dt, .ndim = 2,
                      .shape = {t->tp.sp ? N / t->tp.size : N,
                                in ? m->layers[0].in : m->layers[m->n_layers - 1].out}};
    return mti_tensor_alloc(t->ctx, x, in ? MT_MEM_ACT : MT_MEM_WORK,
                            in ? MT_LIFE_STEP : MT_LIFE_PHASE,
                            MTI_TAG_PARAM(MTI_TAG_TRAINER, in ? 20 : 21));
}

static mt_status recv_forward(sched *c, int i)
{
    mt_trainer *t = c->t;
    if (c->first) return MT_OK;
    mt_status s = boundary(c, i, true);
    return s ? s : exchange(t, "pipeline parallel: an activation from the stage before", NULL, -1,
                            &c->x, t->pp.rank - 1);
}

/* Forward of micro-batch i into pass slot i % K; the loss on the last stage. */
static mt_status forward(sched *c, int i)
{
    mt_trainer *t = c->t;
    mti_engine *E = &t->E;
    mti_pass *p = &t->pp_pass[i % c->K];
    mti_pass_swap(E, p);
    E->bnd[0] = c->x; /* (the first stage's stays empty) */
    memset(&c->x, 0, sizeof c->x);
    mt_status s = mti_engine_forward(E, c->b, i * t->micro, rows_of(c, i), !c->train);
    double part = 0.0;
    if (!s && c->last) s = mti_engine_loss(E, c->dloss, c->train);
    if (!s && c->last) s = mti_engine_loss_sum(E, t->host_losses, &part);
    if (!s && c->last && c->count)
        s = c->count(t, c->b->targets + (size_t)i * t->micro * c->T, &c->right);
    c->sum += part;
    mti_pass_swap(E, p);
    return s;
}

/* Micro-batch i's output to the stage after (and, with j >= 0, micro-batch
 * j's output gradient from it into dy); the output then goes unless its
 * last layer's backward reads it. */
static mt_status send_forward(sched *c, int i, int j)
{
    mt_trainer *t = c->t;
    if (c->last) return MT_OK;
    mti_pass *p = &t->pp_pass[i % c->K];
    mt_status s = j >= 0 ? boundary(c, j, false) : MT_OK;
    mti_tensor *y = &p->bnd[t->model->n_layers];
    if (!s)
        s = exchange(t, j >= 0 ? "pipeline parallel: an activation to the stage after and a "
                                 "gradient from it"
                               : "pipeline parallel: an activation to the stage after",
                     y, t->pp.rank + 1, j >= 0 ? &c->dy : NULL, t->pp.rank + 1);
    if (!c->train || !mti_engine_keeps_output(&t->E)) mti_tensor_free(t->ctx, y);
    return s;
}

/* Backward of micro-batch j (its output gradient in dy, or the loss's);
 * its input gradient then to the stage before (and, with i >= 0,
 * micro-batch i's input from it); the pass is let go. */
static mt_status backward(sched *c, int j, int i)
{
    mt_trainer *t = c->t;
    mti_engine *E = &t->E;
    mti_pass *p = &t->pp_pass[j % c->K];
    mti_pass_swap(E, p);
    if (!c->last) {
        E->d = c->dy;
        memset(&c->dy, 0, sizeof c->dy);
    }
    mti_engine_arm(E);
    mt_status s = c->bwd(t, j == c->M - 1);
    mti_tensor dx = {0};
    if (!c->first) { /* (the engine left it) */
        dx = E->d;
        memset(&E->d, 0, sizeof E->d);
    }
    mti_engine_release(E);
    mti_pass_swap(E, p);
    if (!s && i >= 0 && !c->first) s = boundary(c, i, true);
    if (!s && !c->first)
        s = exchange(t, i >= 0 ? "pipeline parallel: a gradient to the stage before and an "
                                 "activation from it"
                               : "pipeline parallel: a gradient to the stage before",
                     &dx, t->pp.rank - 1, i >= 0 ? &c->x : NULL, t->pp.rank - 1);
    mti_tensor_free(t->ctx, &dx);
    mti_context_reset(t->ctx, MT_SCOPE_PHASE);
    return s;
}

static void sched_free(sched *c)
{
    mt_trainer *t = c->t;
    mti_tensor_free(t->ctx, &c->x);
    mti_tensor_free(t->ctx, &c->dy);
    for (int k = 0; k < t->pp.size; k++) {
        mti_pass *p = &t->pp_pass[k];
        if (p->bnd) {
            mti_pass_swap(&t->E, p);
            mti_engine_release(&t->E);
            mti_pass_swap(&t->E, p);
        }
    }
}

static mt_status sched_init(sched *c, mt_trainer *t, const mt_batch *b, bool train)
{
    memset(c, 0, sizeof *c);
    c->t = t;
    c->b = b;
    c->M = (b->n + t->micro - 1) / t->micro;
    const int P = t->pp.size, st = t->pp.rank;
    c->K = train ? (P - st < c->M ? P - st : c->M) : 1;
    c->T = t->model->input == MT_INPUT_TOKENS ? b->seq_len : 1;
    c->first = st == 0;
    c->last = st == P - 1;
    c->train = train;
    t->E.stage_in = !c->first;
    t->E.stage_out = !c->last;
    mt_status s = MT_OK;
    for (int k = 0; k < c->K && !s; k++)
        if (!t->pp_pass[k].bnd) s = mti_pass_init(&t->E, &t->pp_pass[k]);
    return s;
}

mt_status mti_pp_passes(mt_trainer *t, const mt_batch *b, float dloss, mti_bwd_fn bwd, double *sum)
{
    sched c;
    mt_status s = sched_init(&c, t, b, true);
    if (s) return s;
    c.dloss = dloss;
    c.bwd = bwd;
    const int P = t->pp.size, st = t->pp.rank, M = c.M;
    const int warm = P - st - 1 < M ? P - st - 1 : M;
    /* warm-up: forwards alone */
    for (int i = 0; i < warm && !s; i++) {
        s = recv_forward(&c, i);
        if (!s) s = forward(&c, i);
        mti_context_reset(t->ctx, MT_SCOPE_PHASE);
        if (!s) s = send_forward(&c, i, -1);
    }
    if (!s && warm < M) s = recv_forward(&c, warm);
    /* steady: one forward, one backward */
    for (int j = 0; j < M - warm && !s; j++) {
        const int i = warm + j;
        s = forward(&c, i);
        mti_context_reset(t->ctx, MT_SCOPE_PHASE);
        if (!s) s = send_forward(&c, i, j);
        if (!s) s = backward(&c, j, i + 1 < M ? i + 1 : -1);
    }
    /* cool-down: backwards alone */
    for (int j = M - warm; j < M && !s; j++) {
        if (!c.last) s = boundary(&c, j, false);
        if (!s) s = exchange(t, "pipeline parallel: a gradient from the stage after", NULL, -1, &c.dy,
                             st + 1);
        if (!s) s = backward(&c, j, -1);
    }
    sched_free(&c);
    *sum = c.sum;
    return s;
}

/* A double as three fp32 pieces whose sum over a group where the other
 * ranks give zeros is exact (72 bits of significand); a non-finite one as
 * itself and zeros. */
static void split3(double x, float *v)
{
    v[0] = (float)x, v[1] = v[2] = 0.0f;
    if (!isfinite(v[0])) return;
    x -= (double)v[0];
    v[1] = (float)x;
    v[2] = (float)(x - (double)v[1]);
}

static double join3(const float *v) { return ((double)v[0] + (double)v[1]) + (double)v[2]; }

mt_status mti_pp_eval(mt_trainer *t, const mt_batch *b, mti_right_fn count, double *sum, int *right)
{
    sched c;
    mt_status s = sched_init(&c, t, b, false);
    if (s) return s;
    c.count = count;
    for (int i = 0; i < c.M && !s; i++) {
        s = recv_forward(&c, i);
        if (!s) s = forward(&c, i);
        if (!s) s = send_forward(&c, i, -1);
        sched_free(&c);
        mti_context_reset(t->ctx, MT_SCOPE_STEP);
    }
    sched_free(&c);
    s = mti_pp_loss(t, s, &c.sum);
    if (!s && count && t->pp.comm && !t->ctx->dry) {
        float v[3];
        split3((double)c.right, v);
        s = mti_comm_group_host_all_reduce(t->ctx, t->pp.comm,
                                           "pipeline parallel: eval's right answers over the "
                                           "group", v, 3, MT_COMM_SUM);
        c.right = (int)join3(v);
    }
    *sum = c.sum;
    *right = c.right;
    return s;
}

mt_status mti_pp_loss(mt_trainer *t, mt_status s, double *sum)
{
    if (t->pp.size < 2) return s;
    s = mti_pp_agree(t, "mt_trainer_step", "the micro-batches' passes", s);
    if (s || !t->pp.comm || t->ctx->dry) return s;
    /* the last stage's sum (the others' are 0) in three fp32 pieces, whose
       sum over the group is exact, so every stage has its bits */
    float v[3];
    split3(*sum, v);
    s = mti_comm_group_host_all_reduce(t->ctx, t->pp.comm,
                                       "pipeline parallel: the loss to every stage", v, 3,
                                       MT_COMM_SUM);
    if (!s) *sum = join3(v);
    return s;
}

mt_status mti_pp_tie(mt_trainer *t)
{
    mti_pp *pp = &t->pp;
    if (pp->size < 2 || pp->table < 0) return MT_OK;
    const bool first = pp->rank == 0, last = pp->rank == pp->size - 1;
    if (!first && !last) return MT_OK;
    const int i = first ? pp->table : pp->tied;
    mt_context *ctx = t->ctx;
    if (t->model->params[i].frozen) return MT_OK;
    size_t at, n;
    float *g = mti_home_own(t, i, &at, &n);
    if (!g || !n) return MT_OK;
    /* in pieces of the staging's size: no table-sized buffer */
    const size_t piece = MTI_COMM_STAGE / 2 / sizeof(float), m = n < piece ? n : piece;
    mti_tensor other = {.dtype = MTI_F32, .ndim = 1, .shape = {(int64_t)m}};
    mt_status s = mti_tensor_alloc(ctx, &other, MT_MEM_WORK, MT_LIFE_PHASE,
                                   MTI_TAG_PARAM(MTI_TAG_TRAINER, 22));
    const int peer = first ? pp->size - 1 : 0;
    const mti_kctx k = {ctx, ctx->dev};
    for (size_t a = 0; a < n && !s; a += m) {
        const size_t len = n - a < m ? n - a : m;
        const mti_tensor mine = {.dtype = MTI_F32, .ndim = 1, .shape = {(int64_t)len},
                                 .blk = {.ptr = g + a}};
        other.shape[0] = (int64_t)len;
        s = exchange(t, "pipeline parallel: the tied token table's gradient between the first "
                     "and last stages", &mine, peer, &other, peer);
        /* (mine + theirs on one, theirs + mine on the other: the same bits) */
        if (!s) s = ctx->ops->add(&k, g + a, g + a, other.blk.ptr, len, MTI_F32);
    }
    other.shape[0] = (int64_t)m;
    mti_tensor_free(ctx, &other);
    return s;
}

mt_status mti_pp_checks(mt_trainer *t, int *found, double *sum)
{
    if (t->pp.size < 2 || !t->pp.comm || t->ctx->dry) return MT_OK;
    float v[4] = {0, 0, 0, (float)(*found != 0)};
    split3(*sum, v);
    mt_status s = mti_comm_group_host_all_reduce(t->ctx, t->pp.comm,
                                                 "pipeline parallel: the gradients' checks over "
                                                 "the group", v, 4, MT_COMM_SUM);
    *found = v[3] > 0.0f;
    *sum = join3(v);
    return s;
}
