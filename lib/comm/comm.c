/*
 * comm.c - mt_comm: a communicator table wrapped with argument checks, the
 * broken state after a failure, and the checks that the ranks of a run
 * agree.
 *
 * A collective that fails on one rank leaves the others waiting in it until
 * their own timeout; so any failure breaks the communicator, and every later
 * call fails at once instead of starting a collective the other ranks may
 * never join.
 */
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "cuda_device.h"

#define MAX_RANKS 65536
#define MAX_RECORD 256

uint64_t mti_hash(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

mt_status mt_comm_create(const mt_comm_vtable *vt, void *self, int rank, int size,
                         mt_comm **out)
{
    const char *fn = "mt_comm_create";
    if (!out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (!vt) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: vt is NULL", fn);
    if (vt->abi_version != MT_COMM_ABI_VERSION)
        return mti_fail(NULL, MT_ERR_VERSION, "%s: the table's abi_version is %u; this library speaks %u",
                        fn, vt->abi_version, MT_COMM_ABI_VERSION);
    if (vt->struct_size != sizeof *vt)
        return mti_fail(NULL, MT_ERR_VERSION, "%s: the table's struct_size is %u, expected %zu", fn,
                        vt->struct_size, sizeof *vt);
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
    if (vt->caps & ~(MT_COMM_CAP_DEVICE | MT_COMM_CAP_BF16))
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: the table's caps 0x%x has unknown flags", fn,
                        vt->caps);
    if (size < 1 || size > MAX_RANKS || rank < 0 || rank >= size)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: rank %d of size %d (need 0 <= rank < size <= %d)",
                        fn, rank, size, MAX_RANKS);
    mt_comm *c = calloc(1, sizeof *c);
    if (!c) return mti_fail(NULL, MT_ERR_OOM, "%s: out of host memory", fn);
    c->vt = *vt;
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
                        "%s: the communicator is broken by an earlier failed collective (make a new "
                        "one)",
                        fn);
    return MT_OK;
}

/* After the table's call: a failure breaks the communicator. */
static mt_status after(mt_comm *c, const char *fn, mt_status s)
{
    if (!s) return MT_OK;
    atomic_store(&c->broken, 1);
    const char *why = c->vt.last_error ? c->vt.last_error(c->self) : NULL;
    return mti_fail(NULL, MT_ERR_COMM, "%s (%s, rank %d of %d): %s", fn, mt_comm_name(c), c->rank,
                    c->size, why && *why ? why : mt_status_string(s));
}

mt_status mt_comm_all_reduce(mt_comm *c, const void *send, void *recv, size_t count,
                             mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    const char *fn = "mt_comm_all_reduce";
    mt_status s = check_call(c, fn, send, recv, count, dt, 1, op);
    if (s || !count) return s;
    return after(c, fn, c->vt.all_reduce(c->self, send, recv, count, dt, op, stream));
}

mt_status mt_comm_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                                 mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    const char *fn = "mt_comm_reduce_scatter";
    mt_status s = check_call(c, fn, send, recv, count, dt, 1, op);
    if (s || !count) return s;
    return after(c, fn, c->vt.reduce_scatter(c->self, send, recv, count, dt, op, stream));
}

mt_status mt_comm_all_gather(mt_comm *c, const void *send, void *recv, size_t count,
                             mt_comm_dtype dt, void *stream)
{
    const char *fn = "mt_comm_all_gather";
    mt_status s = check_call(c, fn, send, recv, count, dt, 0, MT_COMM_SUM);
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
    return mti_fail(ctx, s, "%s: %s", what, msg);
}

/* A host communicator on a CUDA context: the device buffer goes through
 * host memory, STAGE_ELEMS at a time (d2h, the collective, h2d). */
#define STAGE_BYTES ((size_t)4 << 20)

static bool staged(const mt_context *ctx)
{
    return ctx->dev->kind == MT_DEVICE_CUDA && !(ctx->cfg.comm->vt.caps & MT_COMM_CAP_DEVICE);
}

static mt_status all_reduce_staged(mt_context *ctx, const char *what, const void *send, void *recv,
                                   size_t count, mt_comm_dtype dt, mt_comm_op op)
{
    mti_device *d = ctx->dev;
    const size_t es = dt == MT_COMM_F32 ? 4 : 2, chunk = STAGE_BYTES / es;
    size_t first = count < chunk ? count : chunk;
    unsigned char *h = malloc(first * es);
    if (!h) return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", what);
    mt_status s = MT_OK;
    for (size_t at = 0; at < count && !s; at += chunk) {
        size_t n = count - at < chunk ? count - at : chunk;
        s = d->copy_d2h(d, h, (const char *)send + at * es, n * es);
        if (!s) s = d->sync(d);
        if (!s) s = on_ctx(ctx, what, mt_comm_all_reduce(ctx->cfg.comm, h, h, n, dt, op, NULL));
        if (!s) s = d->copy_h2d(d, (char *)recv + at * es, h, n * es);
        if (!s) s = d->sync(d); /* h is reused (or freed) next */
    }
    free(h);
    return s;
}

mt_status mti_comm_all_reduce(mt_context *ctx, const char *what, const void *send, void *recv,
                              size_t count, mt_comm_dtype dt, mt_comm_op op)
{
    if (staged(ctx)) return all_reduce_staged(ctx, what, send, recv, count, dt, op);
    return on_ctx(ctx, what,
                  mt_comm_all_reduce(ctx->cfg.comm, send, recv, count, dt, op, mti_comm_stream(ctx)));
}

mt_status mti_comm_all_gather(mt_context *ctx, const char *what, const void *send, void *recv,
                              size_t count, mt_comm_dtype dt)
{
    return on_ctx(ctx, what,
                  mt_comm_all_gather(ctx->cfg.comm, send, recv, count, dt, mti_comm_stream(ctx)));
}

mt_status mti_comm_host_gather(mt_context *ctx, const char *what, const void *send, void *recv,
                               size_t len)
{
    mt_comm *c = ctx->cfg.comm;
    if (!(c->vt.caps & MT_COMM_CAP_DEVICE)) return mti_comm_all_gather(ctx, what, send, recv, len, MT_COMM_BYTE);
    mti_device *d = ctx->dev;
    const size_t all = len * (size_t)c->size;
    void *buf = NULL;
    size_t granted = 0;
    mt_status s = d->mem_reserve(d, all, 0, &buf, &granted);
    if (!s) s = d->copy_h2d(d, (char *)buf + (size_t)c->rank * len, send, len);
    if (!s) s = mti_comm_all_gather(ctx, what, (char *)buf + (size_t)c->rank * len, buf, len, MT_COMM_BYTE);
    if (!s) s = d->copy_d2h(d, recv, buf, all);
    if (!s) s = d->sync(d);
    if (buf) d->mem_release(d, buf, granted);
    return s;
}

mt_status mti_comm_attach(mt_context *ctx)
{
    const char *fn = "mt_context_create";
    mt_comm *c = ctx->cfg.comm;
    if ((c->vt.caps & MT_COMM_CAP_DEVICE) && ctx->dev->kind != MT_DEVICE_CUDA)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->comm is a device communicator (%s) and the context is on the "
                        "CPU: a CPU context takes a host communicator (MPI)",
                        fn, mt_comm_name(c));
    static const char *const fields[] = {"device kind", "world size"};
    const uint64_t rec[2] = {(uint64_t)ctx->dev->kind, (uint64_t)c->size};
    return mti_comm_agree(ctx, fn, "context", rec, sizeof rec, fields);
}

mt_status mti_comm_agree(mt_context *ctx, const char *fn, const char *what, const void *record,
                         size_t len, const char *const *fields)
{
    mt_comm *c = ctx->cfg.comm;
    if (!c || c->size == 1) return MT_OK;
    if (len > MAX_RECORD || len % 8) return mti_fail(ctx, MT_ERR_INTERNAL, "%s: record of %zu bytes", fn, len);
    unsigned char *all = malloc((size_t)c->size * len);
    if (!all) return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    /* a byte gather on the host, whatever the table: a device table's
     * record goes through a staging copy (mti_comm_host_gather) */
    char why[96];
    snprintf(why, sizeof why, "%s: checking that the ranks agree on the %s", fn, what);
    mt_status s = mti_comm_host_gather(ctx, why, record, all, len);
    for (int r = 1; r < c->size && !s; r++) {
        const unsigned char *a = all, *b = all + (size_t)r * len;
        if (!memcmp(a, b, len)) continue;
        size_t w = 0;
        while (w + 8 <= len && !memcmp(a + w, b + w, 8)) w += 8;
        s = mti_fail(ctx, MT_ERR_COMM,
                     "%s: the ranks disagree on the %s: rank %d's %s%s differs from rank 0's (every "
                     "rank must make the same call)",
                     fn, what, r, fields ? "field " : "", fields ? fields[w / 8] : "");
    }
    free(all);
    return s;
}
