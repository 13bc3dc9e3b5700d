/*
 * nccl.c - the NCCL communicator: libnccl.so.2 opened with dlopen at run
 * time (like the CUDA driver), so nothing needs NCCL to build or link.
 *
 * Every collective is queued on the stream it is given and then waited for
 * on the host, polling the stream (cuStreamQuery) and the communicator's
 * asynchronous error (ncclCommGetAsyncError) until the deadline: a peer
 * that died or stalled leaves the stream unfinished, and at the deadline
 * the communicator is aborted (ncclCommAbort, which frees what NCCL holds
 * and ends its kernels) and the call gives MT_ERR_COMM. After that the
 * communicator is broken; every rank should end its run.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "comm/nccl_overlap.h"
#include "device/cuda_device.h"

/* NCCL's C ABI, as far as used here (nccl.h of the 2.x series) */
typedef int nccl_result;          /* ncclResult_t: 0 success, 7 in progress */
typedef struct nccl_comm_s *nccl_comm;
enum { NCCL_UINT8 = 1, NCCL_FLOAT32 = 7, NCCL_BF16 = 9 };
enum { NCCL_SUM = 0, NCCL_MAX = 2 };
enum { NCCL_IN_PROGRESS = 7 };
enum { CU_SUCCESS = 0, CU_NOT_READY = 600 };

typedef struct nccl_api {
    void *lib, *cuda;
    nccl_result (*GetVersion)(int *);
    nccl_result (*GetUniqueId)(mt_nccl_id *);
    nccl_result (*CommInitRank)(nccl_comm *, int, mt_nccl_id, int);
    nccl_result (*CommDestroy)(nccl_comm);
    nccl_result (*CommAbort)(nccl_comm);
    nccl_result (*CommGetAsyncError)(nccl_comm, nccl_result *);
    const char *(*GetErrorString)(nccl_result);
    nccl_result (*AllReduce)(const void *, void *, size_t, int, int, nccl_comm, void *);
    nccl_result (*ReduceScatter)(const void *, void *, size_t, int, int, nccl_comm, void *);
    nccl_result (*AllGather)(const void *, void *, size_t, int, nccl_comm, void *);
    nccl_result (*Broadcast)(const void *, void *, size_t, int, int, nccl_comm, void *);
    nccl_result (*Send)(const void *, size_t, int, int, nccl_comm, void *);
    nccl_result (*Recv)(void *, size_t, int, int, nccl_comm, void *);
    nccl_result (*GroupStart)(void);
    nccl_result (*GroupEnd)(void);
    /* optional: sub-communicators (NCCL 2.18), NULL where missing */
    nccl_result (*CommSplit)(nccl_comm, int, int, nccl_comm *, void *);
    nccl_result (*CommCount)(nccl_comm, int *);
    nccl_result (*CommUserRank)(nccl_comm, int *);
    /* from the CUDA driver: waiting with a deadline, the barrier's scratch */
    int (*StreamQuery)(void *);
    int (*MemAlloc)(unsigned long long *, size_t);
    int (*MemFree)(unsigned long long);
    int (*MemcpyHtoD)(unsigned long long, const void *, size_t); /* (the split's; optional) */
    /* the rank's device: its primary context made current around each call */
    int (*Init)(unsigned);
    int (*DeviceGet)(int *, int);
    int (*CtxRetain)(void **, int);
    int (*CtxRelease)(int);
    int (*CtxPush)(void *);
    int (*CtxPop)(void **);
} nccl_api;

typedef struct nccl_state {
    nccl_api api;
    nccl_comm comm;
    int dev;   /* the CUDA device (mt_nccl_config.device_ordinal) */
    void *ctx; /* its primary context, retained (NULL: none yet) */
    double timeout;
    unsigned long long scratch; /* 4 device bytes the barrier reduces */
    int aborted;
    char err[256];
} nccl_state;

void mt_nccl_config_init(mt_nccl_config *cfg)
{
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->timeout_seconds = 600.0;
}

static mt_status take_config(const char *fn, const mt_nccl_config *in, mt_nccl_config *c)
{
    mt_nccl_config_init(c);
    if (!in) return MT_OK;
    if (in->struct_size != sizeof *in)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "%s: cfg->struct_size %u, expected %zu (call mt_nccl_config_init first)", fn,
                        in->struct_size, sizeof *in);
    *c = *in;
    if (!(c->timeout_seconds > 0.0) || c->timeout_seconds > 1e7)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: cfg->timeout_seconds %g out of range (0, 1e7]",
                        fn, c->timeout_seconds);
    if (c->device_ordinal < 0)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: cfg->device_ordinal %d < 0", fn,
                        c->device_ordinal);
    return MT_OK;
}

/* NCCL is never unloaded: it starts threads that outlive the call that
 * made them (ncclGetUniqueId's bootstrap root, which waits for the ranks to
 * join; a communicator's proxy threads), and unloading it under them would
 * leave them running in unmapped code. The driver it uses stays too. The
 * handles are dropped; the loader keeps one copy of each library however
 * often it is opened. */
static void api_close(nccl_api *a) { memset(a, 0, sizeof *a); }

#define SYM(lib, field, name)                                                                  \
    do {                                                                                       \
        *(void **)&a->field = dlsym(lib, name);                                                \
        if (!a->field && !missing) missing = name;                                                       \
    } while (0)

/* NCCL at the configured path (or MT_NCCL_PATH's), as it is; else the
 * first of mti_nccl_candidates that loads and has ncclGetVersion. On
 * failure the message names every path tried. */
static mt_status nccl_load(const char *fn, const mt_nccl_config *c, nccl_api *a, char *path,
                           size_t cap)
{
    const char *given = c->nccl_path && *c->nccl_path ? c->nccl_path : getenv("MT_NCCL_PATH");
    if (given && *given) {
        snprintf(path, cap, "%s", given);
        a->lib = dlopen(given, RTLD_NOW | RTLD_LOCAL);
        if (a->lib) return MT_OK;
        const char *e = dlerror();
        return mti_fail(NULL, MT_ERR_NO_DEVICE, "%s: cannot load NCCL (%s): %s", fn, given,
                        e ? e : "not found");
    }
    static char cand[MTI_LT_CANDIDATES][MTI_LT_PATH];
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    char tried[1024] = "";
    size_t used = 0;
    pthread_mutex_lock(&mu); /* cand is shared */
    const size_t n = mti_nccl_candidates(cand, MTI_LT_CANDIDATES);
    for (size_t i = 0; i < n && !a->lib; i++) {
        void *h = dlopen(cand[i], RTLD_NOW | RTLD_LOCAL);
        if (h && dlsym(h, "ncclGetVersion")) {
            a->lib = h;
            snprintf(path, cap, "%.*s", (int)sizeof cand[i] - 1, cand[i]);
            break;
        }
        if (h) dlclose(h);
        int w = snprintf(tried + used, sizeof tried - used, "%s%s", used ? ", " : "", cand[i]);
        if (w > 0 && (size_t)w < sizeof tried - used) used += (size_t)w;
    }
    pthread_mutex_unlock(&mu);
    if (a->lib) return MT_OK;
    return mti_fail(NULL, MT_ERR_NO_DEVICE,
                    "%s: cannot load NCCL: no libnccl.so.2 loads (tried %s); name one in "
                    "mt_nccl_config.nccl_path or MT_NCCL_PATH",
                    fn, tried);
}

static mt_status api_open(const char *fn, const mt_nccl_config *c, nccl_api *a)
{
    memset(a, 0, sizeof *a);
    char path[MTI_LT_PATH];
    mt_status ls = nccl_load(fn, c, a, path, sizeof path);
    if (ls) return ls;
    const char *cpath = c->cuda_driver_path && *c->cuda_driver_path ? c->cuda_driver_path
                                                                   : "libcuda.so.1";
    a->cuda = dlopen(cpath, RTLD_NOW | RTLD_LOCAL);
    if (!a->cuda) {
        const char *e = dlerror();
        mt_status s = mti_fail(NULL, MT_ERR_NO_DEVICE, "%s: cannot load the CUDA driver (%s): %s",
                               fn, cpath, e ? e : "not found");
        api_close(a);
        return s;
    }
    const char *missing = NULL;
    SYM(a->lib, GetVersion, "ncclGetVersion");
    SYM(a->lib, GetUniqueId, "ncclGetUniqueId");
    SYM(a->lib, CommInitRank, "ncclCommInitRank");
    SYM(a->lib, CommDestroy, "ncclCommDestroy");
    SYM(a->lib, CommAbort, "ncclCommAbort");
    SYM(a->lib, CommGetAsyncError, "ncclCommGetAsyncError");
    SYM(a->lib, GetErrorString, "ncclGetErrorString");
    SYM(a->lib, AllReduce, "ncclAllReduce");
    SYM(a->lib, ReduceScatter, "ncclReduceScatter");
    SYM(a->lib, AllGather, "ncclAllGather");
    SYM(a->lib, Broadcast, "ncclBroadcast");
    SYM(a->lib, Send, "ncclSend"); /* (NCCL 2.7, the least taken) */
    SYM(a->lib, Recv, "ncclRecv");
    SYM(a->lib, GroupStart, "ncclGroupStart");
    SYM(a->lib, GroupEnd, "ncclGroupEnd");
    SYM(a->cuda, StreamQuery, "cuStreamQuery");
    SYM(a->cuda, MemAlloc, "cuMemAlloc_v2");
    SYM(a->cuda, MemFree, "cuMemFree_v2");
    SYM(a->cuda, Init, "cuInit");
    SYM(a->cuda, DeviceGet, "cuDeviceGet");
    SYM(a->cuda, CtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(a->cuda, CtxRelease, "cuDevicePrimaryCtxRelease_v2");
    SYM(a->cuda, CtxPush, "cuCtxPushCurrent_v2");
    SYM(a->cuda, CtxPop, "cuCtxPopCurrent_v2");
    *(void **)&a->CommSplit = dlsym(a->lib, "ncclCommSplit");
    *(void **)&a->CommCount = dlsym(a->lib, "ncclCommCount");
    *(void **)&a->CommUserRank = dlsym(a->lib, "ncclCommUserRank");
    *(void **)&a->MemcpyHtoD = dlsym(a->cuda, "cuMemcpyHtoD_v2");
    if (!a->CommCount || !a->CommUserRank || !a->MemcpyHtoD) a->CommSplit = NULL;
    if (missing) {
        api_close(a);
        return mti_fail(NULL, MT_ERR_NO_DEVICE, "%s: %s is missing from %s", fn, missing,
                        strncmp(missing, "nccl", 4) ? cpath : path);
    }
    int v = 0;
    if (a->GetVersion(&v) != 0 || v < 20700) {
        api_close(a);
        return mti_fail(NULL, MT_ERR_NO_DEVICE, "%s: NCCL %d at %s; 2.7 or newer is needed", fn, v,
                        path);
    }
    return MT_OK;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Every call into NCCL or the driver for a communicator, on whatever thread
 * makes it (the creating one, the communication thread, the update
 * thread), runs with its device's primary context current: pushed on
 * entry, popped on the way out. NCCL takes the device of a communicator at
 * ncclCommInitRank from the current context (device 0 where there is
 * none), and its calls expect it current. */
static int dev_in(const nccl_state *st)
{
    return st->ctx && st->api.CtxPush(st->ctx) == CU_SUCCESS;
}

/* (pushed: dev_in's answer; nothing is popped that was not pushed) */
static void dev_out(const nccl_state *st, int pushed)
{
    void *prev;
    if (pushed) st->api.CtxPop(&prev);
}

static mt_status fail(nccl_state *st, const char *what, nccl_result r)
{
    snprintf(st->err, sizeof st->err, "%s: %s", what,
             st->api.GetErrorString ? st->api.GetErrorString(r) : "NCCL error");
    return MT_ERR_COMM;
}

/* Aborts the communicator (the deadline passed, or NCCL reported an error
 * of a peer): frees NCCL's resources, ends its kernels on the stream. */
static void abort_comm(nccl_state *st)
{
    if (st->aborted) return;
    st->api.CommAbort(st->comm);
    st->aborted = 1;
}

/* Waits until done(arg) says the work waited for is done, up to the
 * deadline, with the communicator's asynchronous error checked: the
 * communicator aborted on a failure or at the deadline. done: 1 done, 0
 * not yet, -1 (CUDA error *cu) failed. */
static mt_status wait_until(nccl_state *st, const char *what, int (*done)(void *, int *), void *arg)
{
    const double deadline = now_s() + st->timeout;
    struct timespec nap = {0, 20000}; /* 20 us, doubling to 1 ms */
    for (;;) {
        nccl_result ae = 0;
        nccl_result r = st->api.CommGetAsyncError(st->comm, &ae);
        if (r != 0 || (ae != 0 && ae != NCCL_IN_PROGRESS)) {
            abort_comm(st);
            return fail(st, what, r ? r : ae);
        }
        int cu = 0;
        const int q = done(arg, &cu);
        if (q > 0) return MT_OK;
        if (q < 0) {
            abort_comm(st);
            snprintf(st->err, sizeof st->err, "%s: the stream failed (CUDA error %d)", what, cu);
            return MT_ERR_COMM;
        }
        if (now_s() > deadline) {
            abort_comm(st);
            snprintf(st->err, sizeof st->err,
                     "%s: not done after %g s (a rank died or stalled); the NCCL communicator "
                     "was aborted",
                     what, st->timeout);
            return MT_ERR_COMM;
        }
        nanosleep(&nap, NULL);
        if (nap.tv_nsec < 1000000) nap.tv_nsec *= 2;
    }
}

typedef struct stream_of {
    nccl_state *st;
    void *stream;
} stream_of;

static int stream_done(void *arg, int *cu)
{
    const stream_of *a = arg;
    *cu = a->st->api.StreamQuery(a->stream);
    return *cu == CU_SUCCESS ? 1 : *cu == CU_NOT_READY ? 0 : -1;
}

/* Waits for what was queued on the stream, until the deadline. */
static mt_status wait(nccl_state *st, const char *what, void *stream)
{
    stream_of a = {st, stream};
    return wait_until(st, what, stream_done, &a);
}

/* Posting (mti_nccl_post_begin): this thread's collectives go on `stream`,
 * each after fence(arg), and are not waited for. */
static _Thread_local struct {
    void *stream;
    void (*fence)(void *);
    void *arg;
} post;

static int nccl_type(mt_comm_dtype dt) { return dt == MT_COMM_F32 ? NCCL_FLOAT32 : dt == MT_COMM_BF16 ? NCCL_BF16 : NCCL_UINT8; }
static int nccl_op(mt_comm_op op) { return op == MT_COMM_MAX ? NCCL_MAX : NCCL_SUM; }

static mt_status issued(nccl_state *st, const char *what, nccl_result r, void *stream)
{
    if (st->aborted) {
        snprintf(st->err, sizeof st->err, "%s: the communicator was aborted", what);
        return MT_ERR_COMM;
    }
    if (r != 0) {
        abort_comm(st);
        return fail(st, what, r);
    }
    return post.stream ? MT_OK : wait(st, what, stream);
}

/* The stream a collective goes on: the posting one (after its fence), or
 * the one given. */
static void *on(void *stream)
{
    if (!post.stream) return stream;
    if (post.fence) post.fence(post.arg);
    return post.stream;
}

enum { C_ALL_REDUCE, C_REDUCE_SCATTER, C_ALL_GATHER, C_BROADCAST };

/* One collective (kind: send, recv, count, type; op for the reductions,
 * root for the broadcast, recv its buffer) queued with the device current,
 * then issued. */
static mt_status collective(nccl_state *st, int kind, const void *send, void *recv, size_t count,
                            mt_comm_dtype dt, int op_or_root, void *stream)
{
    static const char *const what[] = {"ncclAllReduce", "ncclReduceScatter", "ncclAllGather",
                                       "ncclBroadcast"};
    if (st->aborted) return issued(st, what[kind], 0, stream);
    const int in_ = dev_in(st);
    void *q = on(stream);
    const int t = nccl_type(dt);
    nccl_result r;
    switch (kind) {
    case C_ALL_REDUCE:
        r = st->api.AllReduce(send, recv, count, t, nccl_op(op_or_root), st->comm, q);
        break;
    case C_REDUCE_SCATTER:
        r = st->api.ReduceScatter(send, recv, count, t, nccl_op(op_or_root), st->comm, q);
        break;
    case C_ALL_GATHER: r = st->api.AllGather(send, recv, count, t, st->comm, q); break;
    default: r = st->api.Broadcast(recv, recv, count, t, op_or_root, st->comm, q); break;
    }
    const mt_status s = issued(st, what[kind], r, stream);
    dev_out(st, in_);
    return s;
}

static mt_status n_all_reduce(void *self, const void *send, void *recv, size_t count,
                              mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    return collective(self, C_ALL_REDUCE, send, recv, count, dt, (int)op, stream);
}

static mt_status n_reduce_scatter(void *self, const void *send, void *recv, size_t count,
                                  mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    return collective(self, C_REDUCE_SCATTER, send, recv, count, dt, (int)op, stream);
}

static mt_status n_all_gather(void *self, const void *send, void *recv, size_t count,
                              mt_comm_dtype dt, void *stream)
{
    return collective(self, C_ALL_GATHER, send, recv, count, dt, 0, stream);
}

static mt_status n_broadcast(void *self, void *buf, size_t count, mt_comm_dtype dt, int root,
                             void *stream)
{
    return collective(self, C_BROADCAST, buf, buf, count, dt, root, stream);
}

/* Point to point: the send and the receive in one NCCL group (so two ranks
 * sending to each other do not wait on each other), on the stream like a
 * collective, and waited for under the deadline. */
static mt_status n_sendrecv(void *self, const void *send, size_t sn, int to, void *recv, size_t rn,
                            int from, mt_comm_dtype dt, void *stream)
{
    nccl_state *st = self;
    char what[80];
    if (to >= 0 && from >= 0)
        snprintf(what, sizeof what, "ncclSend to rank %d and ncclRecv from rank %d", to, from);
    else if (to >= 0) snprintf(what, sizeof what, "ncclSend to rank %d", to);
    else snprintf(what, sizeof what, "ncclRecv from rank %d", from);
    if (st->aborted) return issued(st, what, 0, stream);
    const int in_ = dev_in(st);
    void *s = on(stream);
    nccl_result r = st->api.GroupStart();
    if (!r && to >= 0) r = st->api.Send(send, sn, nccl_type(dt), to, st->comm, s);
    if (!r && from >= 0) r = st->api.Recv(recv, rn, nccl_type(dt), from, st->comm, s);
    const nccl_result e = st->api.GroupEnd(); /* (closes the group whatever happened in it) */
    const mt_status out = issued(st, what, r ? r : e, stream);
    dev_out(st, in_);
    return out;
}

static void n_destroy(void *self);

/* Sub-communicators through ncclCommSplit, which blocks: first the ranks'
 * colors and keys all-gathered (in device memory, under the deadline), so
 * every rank is known to be in the call; the new communicator keeps the
 * parent's library, timeout and device. */
static mt_status split_in(nccl_state *st, int color, int key, void **out_self, int *out_rank,
                         int *out_size)
{
    void *self = st;
    if (st->aborted) return issued(st, "ncclCommSplit", 0, NULL);
    int n = 0, me = 0;
    nccl_result r = st->api.CommCount(st->comm, &n);
    if (!r) r = st->api.CommUserRank(st->comm, &me);
    if (r) return fail(st, "ncclCommCount", r);
    unsigned long long buf = 0;
    if (st->api.MemAlloc(&buf, 8 * (size_t)n) != CU_SUCCESS) {
        snprintf(st->err, sizeof st->err, "cuMemAlloc of the split's %d bytes failed", 8 * n);
        return MT_ERR_OOM;
    }
    const int mine[2] = {color, key};
    mt_status s = MT_OK;
    if (st->api.MemcpyHtoD(buf + 8 * (unsigned long long)me, mine, 8) != CU_SUCCESS) {
        snprintf(st->err, sizeof st->err, "copying the split's color and key to the device failed");
        s = MT_ERR_COMM;
    }
    void *at = (void *)(uintptr_t)buf;
    if (!s) s = n_all_gather(self, (char *)at + 8 * me, at, 8, MT_COMM_BYTE, NULL);
    st->api.MemFree(buf);
    if (s) return s;
    nccl_comm nc = NULL;
    r = st->api.CommSplit(st->comm, color < 0 ? -1 : color, key, &nc, NULL); /* (-1: NCCL_SPLIT_NOCOLOR) */
    if (r) return fail(st, "ncclCommSplit", r);
    if (color < 0) return MT_OK;
    nccl_state *ns = calloc(1, sizeof *ns);
    if (!ns) {
        st->api.CommDestroy(nc);
        snprintf(st->err, sizeof st->err, "out of host memory");
        return MT_ERR_OOM;
    }
    ns->api = st->api;
    ns->comm = nc;
    ns->timeout = st->timeout;
    ns->dev = st->dev;
    const int cr = st->ctx ? st->api.CtxRetain(&ns->ctx, st->dev) : CU_SUCCESS;
    if (cr != CU_SUCCESS) ns->ctx = NULL;
    r = cr == CU_SUCCESS ? st->api.CommCount(nc, out_size) : 0;
    if (!r && cr == CU_SUCCESS) r = st->api.CommUserRank(nc, out_rank);
    if (cr != CU_SUCCESS || r || st->api.MemAlloc(&ns->scratch, 4) != CU_SUCCESS) {
        ns->scratch = 0;
        n_destroy(ns);
        snprintf(st->err, sizeof st->err, "the split's communicator: %s",
                 cr != CU_SUCCESS ? "its device's context could not be retained"
                 : r ? st->api.GetErrorString(r) : "cuMemAlloc of the barrier's 4 bytes failed");
        return MT_ERR_COMM;
    }
    *out_self = ns;
    return MT_OK;
}

static mt_status n_split(void *self, int color, int key, void **out_self, int *out_rank,
                         int *out_size)
{
    nccl_state *st = self;
    const int in_ = dev_in(st);
    const mt_status s = split_in(st, color, key, out_self, out_rank, out_size);
    dev_out(st, in_);
    return s;
}

/* NCCL has no barrier: an all-reduce of one float on the default stream,
 * waited for. */
static mt_status n_barrier(void *self)
{
    nccl_state *st = self;
    void *p = (void *)(uintptr_t)st->scratch;
    return n_all_reduce(self, p, p, 1, MT_COMM_F32, MT_COMM_SUM, NULL);
}

static const char *n_last_error(void *self) { return ((nccl_state *)self)->err; }

/* The communicator goes before its memory: cuMemFree waits for the whole
 * device, which work queued behind a dead peer would never leave (an
 * aborted communicator has ended its work and freed itself). */
static void n_destroy(void *self)
{
    nccl_state *st = self;
    const int in_ = dev_in(st);
    if (!st->aborted && st->comm) st->api.CommDestroy(st->comm);
    if (st->scratch) st->api.MemFree(st->scratch);
    dev_out(st, in_);
    if (st->ctx) st->api.CtxRelease(st->dev);
    api_close(&st->api);
    free(st);
}

static const mt_comm_vtable nccl_vtable = {
    .abi_version = MT_COMM_ABI_VERSION,
    .struct_size = sizeof(mt_comm_vtable),
    .name = "nccl",
    .caps = MT_COMM_CAP_DEVICE | MT_COMM_CAP_BF16,
    .all_reduce = n_all_reduce,
    .reduce_scatter = n_reduce_scatter,
    .all_gather = n_all_gather,
    .broadcast = n_broadcast,
    .barrier = n_barrier,
    .last_error = n_last_error,
    .destroy = n_destroy,
    .sendrecv = n_sendrecv,
};

mt_status mt_nccl_unique_id(const mt_nccl_config *cfg, mt_nccl_id *out)
{
    const char *fn = "mt_nccl_unique_id";
    if (!out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: out is NULL", fn);
    mt_nccl_config c;
    nccl_api a;
    mt_status s = take_config(fn, cfg, &c);
    if (!s) s = api_open(fn, &c, &a);
    if (s) return s;
    nccl_result r = a.GetUniqueId(out);
    if (r != 0)
        s = mti_fail(NULL, MT_ERR_COMM, "%s: ncclGetUniqueId: %s", fn, a.GetErrorString(r));
    api_close(&a);
    return s;
}

/* ncclCommInitRank on a thread of its own, with the device current there,
 * so that the caller can stop waiting at the deadline: a rank that never
 * joins leaves the others' setup blocked in NCCL, and a blocking setup has
 * no handle to abort until it returns. At the deadline the caller gives the
 * job up (abandoned); the thread, whenever NCCL lets it go, aborts what it
 * made and frees the job. Its own retain of the context keeps the device's
 * context alive for it. */
typedef struct init_job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, abandoned;
    nccl_api api; /* (the loaded functions; the libraries are never unloaded) */
    void *ctx;
    int dev, size, rank;
    mt_nccl_id id;
    nccl_result r;
    nccl_comm comm;
} init_job;

static void init_job_free(init_job *j)
{
    if (j->ctx) j->api.CtxRelease(j->dev);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static void *init_thread(void *arg)
{
    init_job *j = arg;
    void *prev;
    const int pushed = j->ctx && j->api.CtxPush(j->ctx) == CU_SUCCESS;
    nccl_comm comm = NULL;
    const nccl_result r = j->api.CommInitRank(&comm, j->size, j->id, j->rank);
    pthread_mutex_lock(&j->mu);
    const int abandoned = j->abandoned;
    j->r = r, j->comm = comm, j->done = 1;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (abandoned && r == 0 && comm) j->api.CommAbort(comm); /* (nobody takes it) */
    if (pushed) j->api.CtxPop(&prev);
    if (abandoned) init_job_free(j);
    return NULL;
}

/* The setup under st's deadline: 0 with st->comm made, NCCL's error, -1
 * when the deadline passed first (the job given up), -2 when no job could
 * start (host memory, a thread). */
static nccl_result init_under_deadline(nccl_state *st, const mt_nccl_id *id, int rank, int size)
{
    init_job *j = calloc(1, sizeof *j);
    if (!j) return -2;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->api = st->api, j->dev = st->dev, j->size = size, j->rank = rank, j->id = *id;
    if (st->ctx && st->api.CtxRetain(&j->ctx, st->dev) != CU_SUCCESS) j->ctx = NULL;
    pthread_t th;
    if (pthread_create(&th, NULL, init_thread, j)) {
        init_job_free(j);
        return -2;
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    const double t = (double)dl.tv_sec + 1e-9 * (double)dl.tv_nsec + st->timeout;
    dl.tv_sec = (time_t)t;
    dl.tv_nsec = (long)((t - (double)dl.tv_sec) * 1e9);
    pthread_mutex_lock(&j->mu);
    while (!j->done)
        if (pthread_cond_timedwait(&j->cv, &j->mu, &dl)) break;
    const int done = j->done;
    if (!done) j->abandoned = 1;
    pthread_mutex_unlock(&j->mu);
    if (!done) {
        pthread_detach(th);
        return -1;
    }
    pthread_join(th, NULL);
    const nccl_result r = j->r;
    st->comm = j->comm;
    init_job_free(j);
    return r;
}

mt_status mt_comm_nccl_create(const mt_nccl_config *cfg, const mt_nccl_id *id, int rank, int size,
                              mt_comm **out)
{
    const char *fn = "mt_comm_nccl_create";
    if (!out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (!id) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: id is NULL", fn);
    if (size < 1 || rank < 0 || rank >= size)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: rank %d of size %d", fn, rank, size);
    mt_nccl_config c;
    mt_status s = take_config(fn, cfg, &c);
    if (s) return s;
    nccl_state *st = calloc(1, sizeof *st);
    if (!st) return mti_fail(NULL, MT_ERR_OOM, "%s: out of host memory", fn);
    st->timeout = c.timeout_seconds;
    if ((s = api_open(fn, &c, &st->api))) {
        free(st);
        return s;
    }
    /* the rank's device, current around NCCL's setup (and each call after) */
    int cr = st->api.Init(0);
    if (cr != CU_SUCCESS) s = mti_fail(NULL, MT_ERR_NO_DEVICE, "%s: cuInit failed (CUDA error %d)", fn, cr);
    if (!s && (cr = st->api.DeviceGet(&st->dev, c.device_ordinal)) != CU_SUCCESS)
        s = mti_fail(NULL, MT_ERR_INVALID_ARG,
                     "%s: cfg->device_ordinal %d: no such CUDA device (CUDA error %d)", fn,
                     c.device_ordinal, cr);
    if (!s && (cr = st->api.CtxRetain(&st->ctx, st->dev)) != CU_SUCCESS) {
        st->ctx = NULL;
        s = mti_fail(NULL, MT_ERR_DEVICE,
                     "%s: the primary context of CUDA device %d could not be retained (CUDA "
                     "error %d)", fn, c.device_ordinal, cr);
    }
    nccl_result r = 0;
    if (!s) r = init_under_deadline(st, id, rank, size);
    if (!s && r == -2) {
        st->comm = NULL;
        s = mti_fail(NULL, MT_ERR_OOM, "%s: out of host memory (or threads) for NCCL's setup", fn);
    } else if (!s && r < 0) {
        st->comm = NULL;
        s = mti_fail(NULL, MT_ERR_COMM,
                     "%s: ncclCommInitRank (rank %d of %d, CUDA device %d): not every rank joined "
                     "within %g s (a rank died, stalled or was never started); this rank gave the "
                     "setup up, and what NCCL makes of it later is aborted",
                     fn, rank, size, c.device_ordinal, st->timeout);
    } else if (!s && r != 0) {
        if (st->comm) { /* (a half-made one, if NCCL left it) */
            const int in_ = dev_in(st);
            st->api.CommAbort(st->comm);
            dev_out(st, in_);
        }
        st->comm = NULL;
        s = mti_fail(NULL, MT_ERR_COMM, "%s: ncclCommInitRank (rank %d of %d, CUDA device %d): %s",
                     fn, rank, size, c.device_ordinal, st->api.GetErrorString(r));
    }
    if (!s) {
        const int in_ = dev_in(st);
        cr = st->api.MemAlloc(&st->scratch, 4);
        dev_out(st, in_);
        if (cr != CU_SUCCESS) {
            st->scratch = 0;
            s = mti_fail(NULL, MT_ERR_DEVICE,
                         "%s: cuMemAlloc of the barrier's 4 bytes on CUDA device %d failed (CUDA "
                         "error %d)", fn, c.device_ordinal, cr);
        }
    }
    if (s) {
        n_destroy(st);
        return s;
    }
    mt_comm_vtable vt = nccl_vtable;
    if (st->api.CommSplit) vt.split = n_split; /* (NCCL 2.18 or newer) */
    if ((s = mt_comm_create(&vt, st, rank, size, out))) n_destroy(st);
    return s;
}

mt_status mt_comm_nccl_create_over(const mt_nccl_config *cfg, mt_comm *boot, mt_comm **out)
{
    const char *fn = "mt_comm_nccl_create_over";
    if (!out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (!boot) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: boot is NULL", fn);
    if (boot->vt.caps & MT_COMM_CAP_DEVICE)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "%s: boot must be a host communicator (the id travels in host memory)", fn);
    /* rank 0 makes the id; a failure there must reach the others, so the
     * broadcast carries a status word with it */
    unsigned char msg[4 + sizeof(mt_nccl_id)] = {0};
    mt_nccl_id id;
    char why[MTI_ERR_LEN] = "";
    if (boot->rank == 0) {
        mt_status s0 = mt_nccl_unique_id(cfg, &id);
        mti_put_u32(msg, (uint32_t)s0);
        if (s0) snprintf(why, sizeof why, "%s", mt_last_error(NULL));
        else memcpy(msg + 4, id.bytes, sizeof id.bytes);
    }
    mt_status s = mt_comm_broadcast(boot, msg, sizeof msg, MT_COMM_BYTE, 0, NULL);
    if (s) return s;
    mt_status s0 = (mt_status)mti_get_u32(msg);
    if (s0) {
        if (boot->rank == 0) return mti_fail(NULL, s0, "%s", why);
        return mti_fail(NULL, s0, "%s: rank 0 could not make the NCCL unique id (%s)", fn,
                        mt_status_string(s0));
    }
    memcpy(id.bytes, msg + 4, sizeof id.bytes);
    return mt_comm_nccl_create(cfg, &id, boot->rank, boot->size, out);
}

/* ---- for the communication stream (comm/nccl_overlap.c) ---- */

bool mti_nccl_is(const mt_comm *c) { return c && c->vt.destroy == n_destroy; }

mt_status mti_nccl_post_sum(mt_comm *c, float *buf, size_t count, void *stream)
{
    nccl_state *st = c->self;
    if (st->aborted) {
        snprintf(st->err, sizeof st->err, "ncclAllReduce: the communicator was aborted");
        return MT_ERR_COMM;
    }
    const int in_ = dev_in(st);
    nccl_result r = st->api.AllReduce(buf, buf, count, NCCL_FLOAT32, NCCL_SUM, st->comm, stream);
    if (r) abort_comm(st);
    dev_out(st, in_);
    return r ? fail(st, "ncclAllReduce", r) : MT_OK;
}

mt_status mti_nccl_wait(mt_comm *c, const char *what, void *stream)
{
    stream_of a = {c->self, stream};
    return mti_nccl_wait_until(c, what, stream_done, &a);
}

void mti_nccl_abort(mt_comm *c)
{
    nccl_state *st = c->self;
    const int in_ = dev_in(st);
    abort_comm(st);
    dev_out(st, in_);
}

void mti_nccl_post_begin(void *stream, void (*fence)(void *), void *arg)
{
    post.stream = stream;
    post.fence = fence;
    post.arg = arg;
    mti_comm_set_posting(stream != NULL);
}

void mti_nccl_post_end(void)
{
    post.stream = NULL;
    mti_comm_set_posting(false);
}

mt_status mti_nccl_wait_until(mt_comm *c, const char *what, int (*done)(void *, int *), void *arg)
{
    nccl_state *st = c->self;
    if (st->aborted) {
        snprintf(st->err, sizeof st->err, "%s: the communicator was aborted", what);
        return MT_ERR_COMM;
    }
    const int in_ = dev_in(st);
    const mt_status s = wait_until(st, what, done, arg);
    dev_out(st, in_);
    return s;
}
