/*
 * comm.c - mt_comm: a communicator table wrapped with argument checks, the
 * broken state after a failure, and the context's check that its ranks
 * agree on the device kind and world size (the comparison: agree.c).
 *
 * A collective that fails on one rank leaves the others waiting in it until
 * their own timeout; so any failure breaks the communicator, and every later
 * call fails at once instead of starting a collective the other ranks may
 * never join.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "comm/cplan.h"
#include "device/cuda_device.h"

#define MAX_RANKS 65536

mt_status mt_comm_create(const mt_comm_vtable *vt, void *self, int rank, int size,
                         mt_comm **out)
{
    const char *fn = "mt_comm_create";
    if (!out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (!vt) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: vt is NULL", fn);
    /* version 1: the table without sendrecv (no point-to-point calls) */
    const size_t v1 = offsetof(mt_comm_vtable, sendrecv);
    if (vt->abi_version != MT_COMM_ABI_VERSION && vt->abi_version != 1)
        return mti_fail(NULL, MT_ERR_VERSION,
                        "%s: the table's abi_version is %u; this library speaks 1 and %u", fn,
                        vt->abi_version, MT_COMM_ABI_VERSION);
    const size_t want = vt->abi_version == 1 ? v1 : sizeof *vt;
    if (vt->struct_size != want)
        return mti_fail(NULL, MT_ERR_VERSION,
                        "%s: the table's struct_size is %u, expected %zu for abi_version %u", fn,
                        vt->struct_size, want, vt->abi_version);
    if (!vt->all_reduce || !vt->reduce_scatter || !vt->all_gather || !vt->broadcast || !vt->barrier)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "%s: the table lacks %s (all_reduce, reduce_scatter, all_gather, broadcast "
                        "and barrier are required)",
                        fn,
                        !vt->all_reduce       ? "all_reduce"
                        : !vt->reduce_scatter ? "reduce_scatter"
                        : !vt->all_gather     ? "all_gather"
                        : !vt->broadcast      ? "broadcast"
                                              : "barrier");
    if (vt->caps & ~(MT_COMM_CAP_DEVICE | MT_COMM_CAP_BF16 | MT_COMM_CAP_THREADS))
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: the table's caps 0x%x has unknown flags", fn,
                        vt->caps);
    if (size < 1 || size > MAX_RANKS || rank < 0 || rank >= size)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: rank %d of size %d (need 0 <= rank < size <= %d)",
                        fn, rank, size, MAX_RANKS);
    mt_comm *c = calloc(1, sizeof *c);
    if (!c) return mti_fail(NULL, MT_ERR_OOM, "%s: out of host memory", fn);
    memcpy(&c->vt, vt, want); /* (a version-1 table: sendrecv stays NULL) */
    c->self = self;
    c->rank = rank;
    c->size = size;
    *out = c;
    return MT_OK;
}

void mt_comm_destroy(mt_comm *c)
{
    if (!c) return;
    if (c->vt.destroy) c->vt.destroy(c->self);
    free(c);
}

int mt_comm_rank(const mt_comm *c) { return c ? c->rank : 0; }
int mt_comm_size(const mt_comm *c) { return c ? c->size : 1; }
int mt_comm_broken(const mt_comm *c) { return c ? atomic_load(&c->broken) : 0; }

void mti_comm_break(mt_comm *c, uint64_t step, const char *why)
{
    if (atomic_exchange(&c->broken, 1)) return; /* (the first cause stands) */
    const unsigned long long at = c->call_step ? c->call_step : step;
    char where[64] = "";
    if (at) snprintf(where, sizeof where, "%sin step %llu", c->call_what ? ", " : "", at);
    snprintf(c->cause, sizeof c->cause, "%s%s%s%s", c->call_what ? c->call_what : "", where,
             c->call_what || at ? ": " : "", why);
    atomic_store(&c->cause_set, 1);
}

const char *mti_comm_cause(const mt_comm *c)
{
    if (!c || !atomic_load(&c->broken)) return "";
    return atomic_load(&c->cause_set) ? c->cause : "an earlier collective failed";
}
const char *mt_comm_name(const mt_comm *c) { return c && c->vt.name ? c->vt.name : ""; }

/* Checks a call's arguments; "reduce" says whether it reduces. */
static mt_status check_call(mt_comm *c, const char *fn, const void *a, const void *b, size_t count,
                            mt_comm_dtype dt, int reduce, mt_comm_op op)
{
    if (!c) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: communicator is NULL", fn);
    if ((unsigned)dt > MT_COMM_BF16)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: dtype %d is not an mt_comm_dtype", fn, (int)dt);
    if (reduce && dt == MT_COMM_BYTE)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: MT_COMM_BYTE cannot be reduced", fn);
    if (reduce && (unsigned)op > MT_COMM_MAX)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: op %d is not an mt_comm_op", fn, (int)op);
    if (dt == MT_COMM_BF16 && reduce && !(c->vt.caps & MT_COMM_CAP_BF16))
        return mti_fail(NULL, MT_ERR_UNSUPPORTED, "%s: the %s communicator does not reduce bf16", fn,
                        mt_comm_name(c));
    if (count > ((size_t)1 << 48) / (size_t)c->size)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: count %zu is too large", fn, count);
    if (count && (!a || !b)) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: a buffer is NULL", fn);
    if (atomic_load(&c->broken))
        return mti_fail(NULL, MT_ERR_COMM,
                        "%s: the communicator is broken by an earlier failure (make a new one): %s",
                        fn, mti_comm_cause(c));
    return MT_OK;
}

/* Bytes per element. */
static size_t esize(mt_comm_dtype dt) { return dt == MT_COMM_F32 ? 4 : dt == MT_COMM_BF16 ? 2 : 1; }

/* Rule 3 of the table (memtrain/comm.h): send (sn elements) and recv (rn)
 * are the same call's in place (inplace) or do not overlap at all. */
static mt_status check_overlap(const char *fn, const void *send, size_t sn, const void *recv,
                               size_t rn, mt_comm_dtype dt, bool inplace, const char *form)
{
    if (inplace || !sn || !rn) return MT_OK;
    const size_t es = esize(dt);
    const uintptr_t s = (uintptr_t)send, r = (uintptr_t)recv;
    if (s < r + rn * es && r < s + sn * es)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "%s: send (%p, %zu elements) and recv (%p, %zu elements) overlap, but not "
                        "in place (%s)",
                        fn, send, sn, recv, rn, form);
    return MT_OK;
}

/* After the table's call: a failure breaks the communicator, and the
 * first is kept as the cause every later call names. */
static mt_status after(mt_comm *c, const char *fn, mt_status s)
{
    if (!s) return MT_OK;
    const char *why = c->vt.last_error ? c->vt.last_error(c->self) : NULL;
    char msg[MTI_ERR_LEN];
    snprintf(msg, sizeof msg, "%s (%s, rank %d of %d): %s", fn, mt_comm_name(c), c->rank, c->size,
             why && *why ? why : mt_status_string(s));
    mti_comm_break(c, 0, msg);
    return mti_fail(NULL, MT_ERR_COMM, "%s", msg);
}

mt_status mt_comm_all_reduce(mt_comm *c, const void *send, void *recv, size_t count,
                             mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    const char *fn = "mt_comm_all_reduce";
    mt_status s = check_call(c, fn, send, recv, count, dt, 1, op);
    if (!s) s = check_overlap(fn, send, count, recv, count, dt, send == recv, "send == recv");
    if (s || !count) return s;
    return after(c, fn, c->vt.all_reduce(c->self, send, recv, count, dt, op, stream));
}

mt_status mt_comm_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                                 mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    const char *fn = "mt_comm_reduce_scatter";
    mt_status s = check_call(c, fn, send, recv, count, dt, 1, op);
    if (!s)
        s = check_overlap(fn, send, count * (size_t)c->size, recv, count, dt,
                          (const char *)recv == (const char *)send + (size_t)c->rank * count * esize(dt),
                          "recv == send + rank * count");
    if (s || !count) return s;
    return after(c, fn, c->vt.reduce_scatter(c->self, send, recv, count, dt, op, stream));
}

mt_status mt_comm_all_gather(mt_comm *c, const void *send, void *recv, size_t count,
                             mt_comm_dtype dt, void *stream)
{
    const char *fn = "mt_comm_all_gather";
    mt_status s = check_call(c, fn, send, recv, count, dt, 0, MT_COMM_SUM);
    if (!s)
        s = check_overlap(fn, send, count, recv, count * (size_t)c->size, dt,
                          (const char *)send == (const char *)recv + (size_t)c->rank * count * esize(dt),
                          "send == recv + rank * count");
    if (s || !count) return s;
    return after(c, fn, c->vt.all_gather(c->self, send, recv, count, dt, stream));
}

mt_status mt_comm_broadcast(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root,
                            void *stream)
{
    const char *fn = "mt_comm_broadcast";
    mt_status s = check_call(c, fn, buf, buf, count, dt, 0, MT_COMM_SUM);
    if (s) return s;
    if (root < 0 || root >= c->size)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: root %d out of range 0..%d", fn, root,
                        c->size - 1);
    if (!count) return MT_OK;
    return after(c, fn, c->vt.broadcast(c->self, buf, count, dt, root, stream));
}

mt_status mt_comm_barrier(mt_comm *c)
{
    const char *fn = "mt_comm_barrier";
    mt_status s = check_call(c, fn, c, c, 0, MT_COMM_BYTE, 0, MT_COMM_SUM);
    if (s) return s;
    return after(c, fn, c->vt.barrier(c->self));
}

int mt_comm_has_p2p(const mt_comm *c) { return c && c->vt.sendrecv != NULL; }

mt_status mt_comm_split(mt_comm *c, int color, int key, mt_comm **out)
{
    const char *fn = "mt_comm_split";
    if (!out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    mt_status s = check_call(c, fn, c, c, 0, MT_COMM_BYTE, 0, MT_COMM_SUM);
    if (s) return s;
    if (color < -1 || color > (1 << 30))
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: color %d out of range -1..2^30", fn, color);
    if (!c->vt.split)
        return mti_fail(NULL, MT_ERR_UNSUPPORTED,
                        "%s: the %s communicator cannot make sub-communicators (its table has no "
                        "split)",
                        fn, mt_comm_name(c));
    void *self = NULL;
    int rank = 0, size = 0;
    s = after(c, fn, c->vt.split(c->self, color, key, &self, &rank, &size));
    if (s || color < 0) return s;
    if (!self || size < 1 || rank < 0 || rank >= size) {
        if (self && c->vt.destroy) c->vt.destroy(self);
        return mti_fail(NULL, MT_ERR_PLUGIN, "%s: the %s table's split gave rank %d of %d%s", fn,
                        mt_comm_name(c), rank, size, self ? "" : " and no instance");
    }
    s = mt_comm_create(&c->vt, self, rank, size, out);
    if (s && c->vt.destroy) c->vt.destroy(self);
    return s;
}

/* A point-to-point peer: -1 (none, with no elements), or another rank. */
static mt_status check_peer(const mt_comm *c, const char *fn, const char *which, int peer,
                            size_t count)
{
    if (peer == -1 && !count) return MT_OK;
    if (peer < 0 || peer >= c->size)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: %s rank %d out of range 0..%d%s", fn, which,
                        peer, c->size - 1, peer == -1 ? " (-1 is none, with a count of 0)" : "");
    if (peer == c->rank)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: %s rank %d is this rank itself", fn, which,
                        peer);
    return MT_OK;
}

static mt_status p2p(mt_comm *c, const char *fn, const void *send, size_t sn, int to, void *recv,
                     size_t rn, int from, mt_comm_dtype dt, void *stream)
{
    mt_status s = check_call(c, fn, sn ? send : c, rn ? recv : c, sn > rn ? sn : rn, dt, 0,
                             MT_COMM_SUM);
    if (!s) s = check_peer(c, fn, "the destination", to, sn);
    if (!s) s = check_peer(c, fn, "the source", from, rn);
    if (!s) s = check_overlap(fn, send, sn, recv, rn, dt, false, "never, point to point");
    if (s) return s;
    if (!c->vt.sendrecv)
        return mti_fail(NULL, MT_ERR_UNSUPPORTED,
                        "%s: the %s communicator has no point-to-point calls (its table has no "
                        "sendrecv)",
                        fn, mt_comm_name(c));
    if (!sn && !rn) return MT_OK;
    return after(c, fn, c->vt.sendrecv(c->self, sn ? send : NULL, sn, sn ? to : -1, rn ? recv : NULL,
                                       rn, rn ? from : -1, dt, stream));
}

mt_status mt_comm_send(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int to,
                       void *stream)
{
    return p2p(c, "mt_comm_send", buf, count, to, NULL, 0, -1, dt, stream);
}

mt_status mt_comm_recv(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int from,
                       void *stream)
{
    return p2p(c, "mt_comm_recv", NULL, 0, -1, buf, count, from, dt, stream);
}

mt_status mt_comm_sendrecv(mt_comm *c, const void *send, size_t send_count, int to, void *recv,
                           size_t recv_count, int from, mt_comm_dtype dt, void *stream)
{
    return p2p(c, "mt_comm_sendrecv", send, send_count, to, recv, recv_count, from, dt, stream);
}

/* ---- on behalf of a context ---- */

void *mti_comm_stream(const mt_context *ctx)
{
    return ctx->dev && ctx->dev->kind == MT_DEVICE_CUDA && !ctx->dry ? mti_cuda_stream(ctx->dev)
                                                                       : NULL;
}

/* Moves this thread's context-less message onto ctx, saying what for. */
static mt_status on_ctx(mt_context *ctx, const char *what, mt_status s)
{
    if (!s) return MT_OK;
    char msg[MTI_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", mt_last_error(NULL));
    const unsigned long long step = atomic_load(&ctx->comm->step);
    if (step) return mti_fail(ctx, s, "%s, in step %llu: %s", what, step, msg);
    return mti_fail(ctx, s, "%s: %s", what, msg);
}

/* The communicator's calls until unlabel are for ctx's `what` (a failure
 * that breaks it keeps them in its cause). */
static void label_on(mt_context *ctx, mt_comm *c, const char *what)
{
    if (!c) return;
    c->call_what = what;
    c->call_step = atomic_load(&ctx->comm->step);
}

static mt_status unlabel_on(mt_comm *c, mt_status s)
{
    if (c) c->call_what = NULL, c->call_step = 0;
    return s;
}

static void label(mt_context *ctx, const char *what) { label_on(ctx, ctx->cfg.comm, what); }

static mt_status unlabel(mt_context *ctx, mt_status s) { return unlabel_on(ctx->cfg.comm, s); }

/* ---- groups ---- */

void mti_comm_narrow(mt_context *ctx, mt_comm *dp, int world, int rank)
{
    mti_comm_plan *p = ctx->comm;
    if (!p->narrowed) {
        p->world_comm = ctx->cfg.comm;
        p->world = ctx->world;
        p->rank = ctx->rank;
        p->narrowed = true;
    }
    ctx->cfg.comm = dp;
    ctx->world = world;
    ctx->rank = rank;
}

void mti_comm_widen(mt_context *ctx)
{
    mti_comm_plan *p = ctx->comm;
    if (!p->narrowed) return;
    ctx->cfg.comm = p->world_comm;
    ctx->world = p->world;
    ctx->rank = p->rank;
    p->narrowed = false;
}

mt_comm *mti_comm_world(const mt_context *ctx, int *world, int *rank)
{
    const mti_comm_plan *p = ctx->comm;
    if (world) *world = p->narrowed ? p->world : ctx->world;
    if (rank) *rank = p->narrowed ? p->rank : ctx->rank;
    return p->narrowed ? p->world_comm : ctx->cfg.comm;
}

/* ---- the buffers of a run of several ranks ---- */

bool mti_comm_is_device(const mt_comm *c) { return c && (c->vt.caps & MT_COMM_CAP_DEVICE); }

static mt_status comm_block(mt_context *ctx, size_t bytes, int which, mt_block *out)
{
    mt_alloc_request r = {.bytes = bytes, .mem_class = MT_MEM_COMM, .lifetime = MT_LIFE_PERSISTENT,
                          .tag = MTI_TAG_PARAM(MTI_TAG_COMM, which)};
    mt_status s = mt_context_alloc(ctx, &r, out);
    if (s) return mti_fail(ctx, s, "mt_context_create: the communication buffers: %s",
                           mti_last_msg(ctx).s);
    return MT_OK;
}

void mti_comm_step(mt_context *ctx, uint64_t step) { atomic_store(&ctx->comm->step, step); }

mt_status mti_comm_buffers(mt_context *ctx)
{
    if (ctx->world < 2) return MT_OK;
    if (ctx->dev->kind != MT_DEVICE_CUDA) return comm_block(ctx, MTI_COMM_STAGE, 0, &ctx->comm->stage);
    if (ctx->comm->device)
        return comm_block(ctx, (size_t)ctx->world * MTI_COMM_RECORD, 1, &ctx->comm->records);
    if (ctx->dry) return MT_OK; /* the host staging below is outside the accounting */
    if (!(ctx->comm->host_stage = malloc(MTI_COMM_STAGE)))
        return mti_fail(ctx, MT_ERR_OOM, "mt_context_create: out of host memory for the staging");
    return MT_OK;
}

void mti_comm_free_buffers(mt_context *ctx)
{
    if (!ctx->comm) return;
    const bool broken = ctx->cfg.comm && mt_comm_broken(ctx->cfg.comm);
    if (broken && ctx->comm->stage.ptr) { /* a collective may still write it */
        ctx->kept = ctx->comm->stage.ptr;
        ctx->kept_bytes = ctx->comm->stage.bytes;
    }
    if (ctx->comm->stage.ptr) mt_context_free(ctx, &ctx->comm->stage);
    if (ctx->comm->records.ptr) mt_context_free(ctx, &ctx->comm->records);
    if (!broken) free(ctx->comm->host_stage); /* else left to the communicator */
    memset(&ctx->comm->stage, 0, sizeof ctx->comm->stage);
    memset(&ctx->comm->records, 0, sizeof ctx->comm->records);
    ctx->comm->host_stage = NULL;
}

/* ---- collectives on behalf of a context ---- */

typedef enum coll { ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST } coll;


/* Copies between the staging buffer and the context's memory (host memory
 * when `host`): memcpy on the host, the device's copies on CUDA. */
static mt_status stage_in(mt_context *ctx, bool host, void *stage, const void *src, size_t n)
{
    if (host || ctx->dev->kind != MT_DEVICE_CUDA) return memcpy(stage, src, n), MT_OK;
    return ctx->dev->copy_d2h(ctx->dev, stage, src, n);
}

static mt_status stage_out(mt_context *ctx, bool host, void *dst, const void *stage, size_t n)
{
    if (host || ctx->dev->kind != MT_DEVICE_CUDA) return memcpy(dst, stage, n), MT_OK;
    return ctx->dev->copy_h2d(ctx->dev, dst, stage, n);
}

static mt_status stage_sync(mt_context *ctx, bool host)
{
    return host || ctx->dev->kind != MT_DEVICE_CUDA ? MT_OK : ctx->dev->sync(ctx->dev);
}

/* One collective of a host communicator through the staging buffer:
 * chunks of the buffer's size (per rank for the gathers and scatters),
 * each copied in, reduced or gathered in place, and copied out. */
static mt_status staged(mt_context *ctx, mt_comm *c, const char *what, coll k, bool host,
                        const void *send, void *recv, size_t count, mt_comm_dtype dt,
                        mt_comm_op op, int root)
{
    const size_t es = esize(dt), R = (size_t)c->size, me = (size_t)c->rank;
    if (R == 1) { /* one rank: every collective is a copy (none without buffers) */
        if (send == recv || !count) return MT_OK;
        if (host || ctx->dev->kind != MT_DEVICE_CUDA) return memmove(recv, send, count * es), MT_OK;
        mt_status s = ctx->dev->copy_d2d(ctx->dev, recv, send, count * es);
        return s ? s : ctx->dev->sync(ctx->dev);
    }
    unsigned char *st = ctx->comm->stage.ptr ? ctx->comm->stage.ptr : ctx->comm->host_stage;
    if (!st) return mti_fail(ctx, MT_ERR_INTERNAL, "%s: no staging buffer", what);
    const bool per_rank = k == REDUCE_SCATTER || k == ALL_GATHER;
    const size_t chunk = MTI_COMM_STAGE / es / (per_rank ? R : 1);
    const char *in = send;
    char *out = recv;
    mt_status s = MT_OK;
    for (size_t at = 0; at < count && !s; at += chunk) {
        const size_t n = count - at < chunk ? count - at : chunk, nb = n * es;
        if (k == REDUCE_SCATTER)
            for (size_t r = 0; r < R && !s; r++) s = stage_in(ctx, host, st + r * nb, in + (r * count + at) * es, nb);
        else
            s = stage_in(ctx, host, st + (k == ALL_GATHER ? me * nb : 0), in + at * es, nb);
        if (!s) s = stage_sync(ctx, host);
        if (s) break;
        switch (k) {
        case ALL_REDUCE: s = mt_comm_all_reduce(c, st, st, n, dt, op, NULL); break;
        case REDUCE_SCATTER: s = mt_comm_reduce_scatter(c, st, st + me * nb, n, dt, op, NULL); break;
        case ALL_GATHER: s = mt_comm_all_gather(c, st + me * nb, st, n, dt, NULL); break;
        case BROADCAST: s = mt_comm_broadcast(c, st, n, dt, root, NULL); break;
        }
        if ((s = on_ctx(ctx, what, s))) break;
        if (k == ALL_GATHER)
            for (size_t r = 0; r < R && !s; r++) s = stage_out(ctx, host, out + (r * count + at) * es, st + r * nb, nb);
        else
            s = stage_out(ctx, host, out + at * es, st + (k == REDUCE_SCATTER ? me * nb : 0), nb);
        if (!s) s = stage_sync(ctx, host); /* the staging is reused next */
    }
    return s;
}

static bool device_table(const mt_comm *c) { return c->vt.caps & MT_COMM_CAP_DEVICE; }

static mt_status comm_all_reduce_run(mt_context *ctx, mt_comm *c, const char *what, const void *send, void *recv,
                              size_t count, mt_comm_dtype dt, mt_comm_op op)
{
    if (!device_table(c)) return staged(ctx, c, what, ALL_REDUCE, false, send, recv, count, dt, op, 0);
    return on_ctx(ctx, what,
                  mt_comm_all_reduce(c, send, recv, count, dt, op, mti_comm_stream(ctx)));
}

static mt_status comm_reduce_scatter_run(mt_context *ctx, mt_comm *c, const char *what, const void *send, void *recv,
                                  size_t count, mt_comm_dtype dt, mt_comm_op op)
{
    if (!device_table(c))
        return staged(ctx, c, what, REDUCE_SCATTER, false, send, recv, count, dt, op, 0);
    return on_ctx(ctx, what,
                  mt_comm_reduce_scatter(c, send, recv, count, dt, op, mti_comm_stream(ctx)));
}

static mt_status comm_all_gather_run(mt_context *ctx, mt_comm *c, const char *what, const void *send, void *recv,
                              size_t count, mt_comm_dtype dt)
{
    if (!device_table(c))
        return staged(ctx, c, what, ALL_GATHER, false, send, recv, count, dt, MT_COMM_SUM, 0);
    return on_ctx(ctx, what,
                  mt_comm_all_gather(c, send, recv, count, dt, mti_comm_stream(ctx)));
}

static mt_status comm_broadcast_run(mt_context *ctx, mt_comm *c, const char *what, void *buf, size_t count,
                             mt_comm_dtype dt, int root)
{
    if (!device_table(c)) return staged(ctx, c, what, BROADCAST, false, buf, buf, count, dt, MT_COMM_SUM, root);
    return on_ctx(ctx, what,
                  mt_comm_broadcast(c, buf, count, dt, root, mti_comm_stream(ctx)));
}

static mt_status comm_host_gather_run(mt_context *ctx, mt_comm *c, const char *what, const void *send, void *recv,
                               size_t len)
{
    if (!device_table(c)) return staged(ctx, c, what, ALL_GATHER, true, send, recv, len, MT_COMM_BYTE, MT_COMM_SUM, 0);
    /* a device table: through the record buffer, MTI_COMM_RECORD bytes per
       rank at a time */
    mti_device *d = ctx->dev;
    unsigned char *buf = ctx->comm->records.ptr;
    const size_t R = (size_t)c->size, me = (size_t)c->rank;
    mt_status s = buf ? MT_OK : mti_fail(ctx, MT_ERR_INTERNAL, "%s: no record buffer", what);
    for (size_t at = 0; at < len && !s; at += MTI_COMM_RECORD) {
        const size_t n = len - at < MTI_COMM_RECORD ? len - at : MTI_COMM_RECORD;
        s = d->copy_h2d(d, buf + me * n, (const char *)send + at, n);
        if (!s) s = on_ctx(ctx, what, mt_comm_all_gather(c, buf + me * n, buf, n, MT_COMM_BYTE,
                                                         mti_comm_stream(ctx)));
        for (size_t r = 0; r < R && !s; r++) s = d->copy_d2h(d, (char *)recv + r * len + at, buf + r * n, n);
        if (!s) s = d->sync(d);
    }
    return s;
}

/* ---- what the collectives take ---- */

static _Thread_local bool comm_thread;

void mti_comm_on_thread(void) { comm_thread = true; }

void mti_comm_waited(mt_context *ctx, uint64_t ns) { atomic_fetch_add(&ctx->comm->wait_ns, ns); }

static _Atomic int comm_hurry;

void mti_comm_hurry(int delta) { atomic_fetch_add(&comm_hurry, delta); }

int mti_comm_urgent(void) { return atomic_load(&comm_hurry) > 0; }

mt_status mti_comm_turn(mt_context *ctx, const char *what)
{
    if (comm_thread) return MT_OK;
    const mti_comm_plan *p = ctx->comm;
    mt_status s = p->quiet_threads ? p->quiet_threads(ctx, what) : MT_OK;
    return s ? s : p->quiet_streams ? p->quiet_streams(ctx, what) : MT_OK;
}

/* This thread's collectives are posted on a communication stream (nccl.c
 * says so while it posts), not waited for. */
static _Thread_local bool comm_posting;

void mti_comm_set_posting(bool on) { comm_posting = on; }

bool mti_comm_posting(void) { return comm_posting; }

/* A collective of the context took from t0 until now. One posted on a
 * communication stream (mti_comm_posting) was only queued: its time is
 * its time on the stream, counted when it is waited for (nccl_overlap.c),
 * so only the call counts here. */
static mt_status timed(mt_context *ctx, uint64_t t0, mt_status s)
{
    const uint64_t ns = mti_now_ns() - t0;
    atomic_fetch_add(&ctx->comm->calls, 1);
    if (comm_posting) return s;
    atomic_fetch_add(&ctx->comm->ns, ns);
    if (!comm_thread) atomic_fetch_add(&ctx->comm->wait_ns, ns);
    return s;
}

/* A collective of the context begins: the other thread's queue waited
 * for (its wait counted there), the clock started, and the communicator's
 * calls labelled with `what`; a failed wait is returned, unlabelled. */
static mt_status coll_begin(mt_context *ctx, mt_comm *c, const char *what, uint64_t *t0)
{
    const mt_status q = mti_comm_turn(ctx, what);
    *t0 = mti_now_ns();
    if (!q) label_on(ctx, c, what);
    return q;
}

/* ... and ends with status s: unlabelled, timed. */
static mt_status coll_end(mt_context *ctx, mt_comm *c, uint64_t t0, mt_status s)
{
    return timed(ctx, t0, unlabel_on(c, s));
}

mt_status mti_comm_group_all_reduce(mt_context *ctx, mt_comm *c, const char *what,
                                    const void *send, void *recv, size_t count, mt_comm_dtype dt,
                                    mt_comm_op op)
{
    uint64_t t0;
    const mt_status q = coll_begin(ctx, c, what, &t0);
    return q ? timed(ctx, t0, q)
             : coll_end(ctx, c, t0, comm_all_reduce_run(ctx, c, what, send, recv, count, dt, op));
}

mt_status mti_comm_group_host_all_reduce(mt_context *ctx, mt_comm *c, const char *what,
                                         float *buf, size_t count, mt_comm_op op)
{
    uint64_t t0;
    const mt_status q = coll_begin(ctx, c, what, &t0);
    if (q) return timed(ctx, t0, q);
    mt_status s;
    if (!device_table(c)) {
        s = staged(ctx, c, what, ALL_REDUCE, true, buf, buf, count, MT_COMM_F32, op, 0);
    } else { /* a device table: through the record buffer */
        mti_device *d = ctx->dev;
        unsigned char *rb = ctx->comm->records.ptr;
        const size_t per = MTI_COMM_RECORD * (size_t)c->size / sizeof(float);
        s = rb ? MT_OK : mti_fail(ctx, MT_ERR_INTERNAL, "%s: no record buffer", what);
        for (size_t at = 0; at < count && !s; at += per) {
            const size_t n = count - at < per ? count - at : per;
            s = d->copy_h2d(d, rb, buf + at, n * sizeof(float));
            if (!s)
                s = on_ctx(ctx, what, mt_comm_all_reduce(c, rb, rb, n, MT_COMM_F32, op,
                                                         mti_comm_stream(ctx)));
            if (!s) s = d->copy_d2h(d, buf + at, rb, n * sizeof(float));
            if (!s) s = d->sync(d);
        }
    }
    return coll_end(ctx, c, t0, s);
}

mt_status mti_comm_group_reduce_scatter(mt_context *ctx, mt_comm *c, const char *what,
                                        const void *send, void *recv, size_t count,
                                        mt_comm_dtype dt, mt_comm_op op)
{
    uint64_t t0;
    const mt_status q = coll_begin(ctx, c, what, &t0);
    return q ? timed(ctx, t0, q)
             : coll_end(ctx, c, t0, comm_reduce_scatter_run(ctx, c, what, send, recv, count, dt, op));
}

mt_status mti_comm_group_all_gather(mt_context *ctx, mt_comm *c, const char *what,
                                    const void *send, void *recv, size_t count, mt_comm_dtype dt)
{
    uint64_t t0;
    const mt_status q = coll_begin(ctx, c, what, &t0);
    return q ? timed(ctx, t0, q)
             : coll_end(ctx, c, t0, comm_all_gather_run(ctx, c, what, send, recv, count, dt));
}

mt_status mti_comm_group_broadcast(mt_context *ctx, mt_comm *c, const char *what, void *buf,
                                   size_t count, mt_comm_dtype dt, int root)
{
    uint64_t t0;
    const mt_status q = coll_begin(ctx, c, what, &t0);
    return q ? timed(ctx, t0, q)
             : coll_end(ctx, c, t0, comm_broadcast_run(ctx, c, what, buf, count, dt, root));
}

/* Point to point for a context (host tables: through the staging buffer,
 * half for the bytes going out and half for those coming in, the same
 * chunks on both peers, so each chunk is one message of each direction). */
static mt_status comm_sendrecv_run(mt_context *ctx, mt_comm *c, const char *what,
                                   const void *send, size_t sn, int to, void *recv, size_t rn,
                                   int from, bool host)
{
    if (device_table(c) && host)
        return mti_fail(ctx, MT_ERR_INTERNAL, "%s: host memory for a device communicator", what);
    if (device_table(c))
        return on_ctx(ctx, what, mt_comm_sendrecv(c, send, sn, to, recv, rn, from, MT_COMM_BYTE,
                                                  mti_comm_stream(ctx)));
    unsigned char *st = ctx->comm->stage.ptr ? ctx->comm->stage.ptr : ctx->comm->host_stage;
    if (!st) return mti_fail(ctx, MT_ERR_INTERNAL, "%s: no staging buffer", what);
    const size_t chunk = MTI_COMM_STAGE / 2;
    unsigned char *out = st, *in = st + chunk;
    mt_status s = MT_OK;
    for (size_t at = 0; (at < sn || at < rn) && !s; at += chunk) {
        const size_t a = at < sn ? (sn - at < chunk ? sn - at : chunk) : 0;
        const size_t b = at < rn ? (rn - at < chunk ? rn - at : chunk) : 0;
        if (a) s = stage_in(ctx, host, out, (const char *)send + at, a);
        if (!s && a) s = stage_sync(ctx, host);
        if (!s) s = on_ctx(ctx, what, mt_comm_sendrecv(c, out, a, a ? to : -1, in, b, b ? from : -1,
                                                       MT_COMM_BYTE, NULL));
        if (!s && b) s = stage_out(ctx, host, (char *)recv + at, in, b);
        if (!s && b) s = stage_sync(ctx, host);
    }
    return s;
}

mt_status mti_comm_group_sendrecv(mt_context *ctx, mt_comm *c, const char *what, const void *send,
                                  size_t send_bytes, int to, void *recv, size_t recv_bytes,
                                  int from, bool host)
{
    uint64_t t0;
    const mt_status q = coll_begin(ctx, c, what, &t0);
    return q ? timed(ctx, t0, q)
             : coll_end(ctx, c, t0, comm_sendrecv_run(ctx, c, what, send, send_bytes, to, recv,
                                                      recv_bytes, from, host));
}

mt_status mti_comm_all_reduce(mt_context *ctx, const char *what, const void *send, void *recv, size_t count, mt_comm_dtype dt, mt_comm_op op)
{
    return mti_comm_group_all_reduce(ctx, ctx->cfg.comm, what, send, recv, count, dt, op);
}

mt_status mti_comm_reduce_scatter(mt_context *ctx, const char *what, const void *send, void *recv, size_t count, mt_comm_dtype dt, mt_comm_op op)
{
    return mti_comm_group_reduce_scatter(ctx, ctx->cfg.comm, what, send, recv, count, dt, op);
}

mt_status mti_comm_all_gather(mt_context *ctx, const char *what, const void *send, void *recv, size_t count, mt_comm_dtype dt)
{
    return mti_comm_group_all_gather(ctx, ctx->cfg.comm, what, send, recv, count, dt);
}

mt_status mti_comm_broadcast(mt_context *ctx, const char *what, void *buf, size_t count, mt_comm_dtype dt, int root)
{
    return mti_comm_group_broadcast(ctx, ctx->cfg.comm, what, buf, count, dt, root);
}

mt_status mti_comm_host_gather(mt_context *ctx, const char *what, const void *send, void *recv, size_t len)
{
    mt_comm *c = ctx->cfg.comm;
    uint64_t t0;
    const mt_status q = coll_begin(ctx, c, what, &t0);
    return q ? timed(ctx, t0, q)
             : coll_end(ctx, c, t0, comm_host_gather_run(ctx, c, what, send, recv, len));
}

mt_status mti_comm_all_reduce_pieces(mt_context *ctx, const char *what, float *const *p,
                                     const size_t *n, int k)
{
    const mt_status q = mti_comm_turn(ctx, what); /* (its wait counted there) */
    const uint64_t t0 = mti_now_ns();
    if (q) return timed(ctx, t0, q);
    mt_comm *c = ctx->cfg.comm;
    float *st = ctx->comm->stage.ptr;
    size_t total = 0;
    for (int j = 0; j < k; j++) total += n[j];
    if (!st || (c->vt.caps & MT_COMM_CAP_DEVICE) || ctx->dev->kind != MT_DEVICE_CPU ||
        (k > 1 && total > MTI_COMM_STAGE / sizeof(float)))
        return mti_fail(ctx, MT_ERR_INTERNAL, "%s: pieces need a CPU context's staging", what);
    const size_t chunk = MTI_COMM_STAGE / sizeof(float);
    mt_status s = MT_OK;
    /* one piece past the buffer goes in chunks; else all of them at once */
    for (size_t at = 0; at < total && !s; at += chunk) {
        const size_t len = total - at < chunk ? total - at : chunk;
        size_t off = 0;
        for (int j = 0; j < k; j++, off += n[j - 1]) {
            const size_t m = k > 1 ? n[j] : len;
            const float *src = p[j] ? p[j] + (k > 1 ? 0 : at) : NULL;
            if (src) memcpy(st + off, src, m * sizeof(float));
            else memset(st + off, 0, m * sizeof(float));
        }
        label(ctx, what);
        s = on_ctx(ctx, what,
                   unlabel(ctx, mt_comm_all_reduce(c, st, st, len, MT_COMM_F32, MT_COMM_SUM, NULL)));
        off = 0;
        for (int j = 0; j < k && !s; j++, off += n[j - 1])
            if (p[j]) memcpy(p[j] + (k > 1 ? 0 : at), st + off, (k > 1 ? n[j] : len) * sizeof(float));
    }
    return timed(ctx, t0, s);
}

void *mti_comm_stage(const mt_context *ctx)
{
    return ctx->dev->kind == MT_DEVICE_CPU ? ctx->comm->stage.ptr : NULL;
}

/* A collective of the staging buffer in place (reduce-scatter: count fp32
 * values per rank, summed; all-gather: count bytes per rank). */
static mt_status in_stage(mt_context *ctx, const char *what, coll k, size_t count)
{
    const mt_status q = mti_comm_turn(ctx, what); /* (its wait counted there) */
    const uint64_t t0 = mti_now_ns();
    if (q) return timed(ctx, t0, q);
    mt_comm *c = ctx->cfg.comm;
    char *st = mti_comm_stage(ctx);
    const size_t es = k == REDUCE_SCATTER ? 4 : 1, mine = (size_t)c->rank * count * es;
    if (!st || (c->vt.caps & MT_COMM_CAP_DEVICE) || count * (size_t)c->size > MTI_COMM_STAGE / es)
        return mti_fail(ctx, MT_ERR_INTERNAL, "%s: %zu %s per rank do not fit the staging", what, count,
                        k == REDUCE_SCATTER ? "values" : "bytes");
    label(ctx, what);
    return timed(ctx, t0, on_ctx(ctx, what, unlabel(ctx, k == REDUCE_SCATTER
        ? mt_comm_reduce_scatter(c, st, st + mine, count, MT_COMM_F32, MT_COMM_SUM, NULL)
        : mt_comm_all_gather(c, st + mine, st, count, MT_COMM_BYTE, NULL))));
}

mt_status mti_comm_reduce_scatter_stage(mt_context *ctx, const char *what, size_t count)
{
    return in_stage(ctx, what, REDUCE_SCATTER, count);
}

mt_status mti_comm_all_gather_stage(mt_context *ctx, const char *what, size_t bytes)
{
    return in_stage(ctx, what, ALL_GATHER, bytes);
}

mt_status mt_context_comm_stats(const mt_context *ctx, mt_comm_stats *out)
{
    if (!ctx || !out)
        return mti_fail((mt_context *)ctx, MT_ERR_INVALID_ARG, "mt_context_comm_stats: %s is NULL",
                        ctx ? "out" : "ctx");
    out->collectives = atomic_load(&ctx->comm->calls);
    out->seconds = 1e-9 * (double)atomic_load(&ctx->comm->ns);
    out->exposed_seconds = 1e-9 * (double)atomic_load(&ctx->comm->wait_ns);
    return MT_OK;
}
