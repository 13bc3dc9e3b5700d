/*
 * comm_mpi.c - the MPI communicator (libmemtrain_mpi.a, built with mpicc).
 *
 * Each collective is a non-blocking MPI collective on a duplicate of the
 * application's communicator, on the buffers it is given, polled with
 * MPI_Test until it completes or the deadline passes. MPI cannot cancel a
 * collective, so one that timed out keeps those buffers: the library only
 * ever gives its staging buffer (lib/comm/comm.c), which a context with a
 * broken communicator never gives back; an application calling the
 * collectives itself must keep its buffers too (memtrain/mpi.h).
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "memtrain/mpi.h"

typedef struct mpi_state {
    MPI_Comm comm;
    int rank, size;
    double timeout;
    int broken;           /* a request is still pending on the duplicate */
    float *scratch;       /* the reduce-scatter's other ranks' parts (kept while broken) */
    size_t scratch_n;     /* its floats */
    char err[256];
} mpi_state;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static mt_status mpi_fail(mpi_state *st, const char *what, int rc)
{
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    snprintf(st->err, sizeof st->err, "%s failed: %.200s", what, s);
    st->broken = 1;
    return MT_ERR_COMM;
}

/* Tests n requests again and again for `burst` seconds (0: once). */
static int test_for(MPI_Request *req, int n, double burst, int *rc)
{
    const double b0 = burst > 0.0 ? now_s() : 0.0;
    for (;;) {
        int done = 0;
        *rc = MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE);
        if (*rc != MPI_SUCCESS || done) return done;
        if (!(burst > 0.0) || now_s() - b0 >= burst) return 0;
    }
}

/* Polls a started request until it completes or the deadline passes.
 *
 * Open MPI moves a large message over shared memory a fragment at a time,
 * and only inside MPI calls: a 4 MiB all-reduce of 2 ranks takes about 90
 * tests without single copy, so a waiter that sleeps between single tests
 * turns 0.4 ms of copying into 9 ms (docs/benchmarks-history.md). So a waiter
 * tests in bursts of 50 us, and sleeps between them (10 us doubling to a
 * cap) only once spinning stops paying:
 * - a thread whose collective is exposed (the main thread, or the
 *   communication thread while the step waits for it, mti_comm_urgent)
 *   first spins for 5 ms, yielding the core on each test (the ranks of a
 *   step arrive within that, and a rank's core has nothing else to do then;
 *   yielding leaves it to other processes when there are more than cores),
 *   then sleeps up to 1 ms between bursts: a rank long in coming (saving, a
 *   stalled rank) costs the waiter about 5% of a core;
 * - the communication thread while backward computes on the rank's core
 *   never spins: it sleeps up to 200 us between bursts, so it takes the core
 *   from the computation only for the bursts. */
static mt_status finish_all(mpi_state *st, const char *what, int rc, MPI_Request *req, int n)
{
    if (rc != MPI_SUCCESS) return mpi_fail(st, what, rc);
    const double start = now_s(), deadline = start + st->timeout;
    int main_thread = 1;
    MPI_Is_thread_main(&main_thread);
    const int urgent = main_thread || mti_comm_urgent();
    const double spin = urgent ? 5e-3 : 0.0, burst = 50e-6;
    const long cap = urgent ? 1000000 : 200000; /* ns */
    struct timespec nap = {0, 10000};
    for (int first = 1;; first = 0) {
        const int done = test_for(req, n, first ? 0.0 : burst, &rc);
        if (rc != MPI_SUCCESS) return mpi_fail(st, what, rc);
        if (done) return MT_OK;
        const double t = now_s();
        if (t > deadline) {
            st->broken = 1; /* the request, and the staging buffers, stay with MPI */
            snprintf(st->err, sizeof st->err,
                     "%s timed out, not complete after %g s: a rank died, stalled, or did not "
                     "make the same call; end the job (MPI_Abort)",
                     what, st->timeout);
            return MT_ERR_COMM;
        }
        if (t - start < spin) {
            sched_yield();
            continue;
        }
        nanosleep(&nap, NULL);
        nap.tv_nsec = nap.tv_nsec * 2 < cap ? nap.tv_nsec * 2 : cap;
    }
}

static mt_status finish(mpi_state *st, const char *what, int rc, MPI_Request *req)
{
    return finish_all(st, what, rc, req, 1);
}

static mt_status ready(mpi_state *st)
{
    if (st->broken) {
        snprintf(st->err, sizeof st->err, "an earlier collective did not complete");
        return MT_ERR_COMM;
    }
    return MT_OK;
}

static size_t esize(mt_comm_dtype dt) { return dt == MT_COMM_F32 ? 4 : dt == MT_COMM_BF16 ? 2 : 1; }
static MPI_Datatype mtype(mt_comm_dtype dt) { return dt == MT_COMM_F32 ? MPI_FLOAT : MPI_BYTE; }
static MPI_Op mop(mt_comm_op op) { return op == MT_COMM_MAX ? MPI_MAX : MPI_SUM; }

/* MPI counts are ints: contiguous collectives go in pieces of at most this
 * many elements; the gathers and scatters take at most this many per rank. */
#define MAX_COUNT ((size_t)1 << 30)

static mt_status too_many(mpi_state *st, size_t count)
{
    snprintf(st->err, sizeof st->err, "%zu elements per rank: MPI takes at most %zu per call",
             count, MAX_COUNT);
    return MT_ERR_INVALID_ARG;
}

static mt_status m_all_reduce(void *self, const void *send, void *recv, size_t count,
                              mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    (void)stream;
    mpi_state *st = self;
    mt_status s = ready(st);
    const size_t es = esize(dt);
    for (size_t at = 0; at < count && !s; at += MAX_COUNT) {
        size_t n = count - at < MAX_COUNT ? count - at : MAX_COUNT;
        char *r = (char *)recv + at * es;
        const void *in = send == recv ? MPI_IN_PLACE : (const char *)send + at * es;
        MPI_Request req;
        int rc = MPI_Iallreduce(in, r, (int)n, mtype(dt), mop(op), st->comm, &req);
        s = finish(st, "MPI_Iallreduce", rc, &req);
    }
    return s;
}

/* The fp32 reduce-scatter, rank to rank: each rank sends every other rank
 * its part of send and receives theirs of its own into the scratch (kept,
 * so its pages are touched once, not at every call), then adds the ranks'
 * values in rank order. MPI's nonblocking reduce-scatter (Open MPI's
 * libnbc) reduces the whole buffer onto rank 0 and scatters it back, into a
 * temporary buffer it allocates and frees at each call: rank 0 did all the
 * adding and received the whole buffer, and both ranks faulted in fresh
 * pages every call, about a quarter of a ZeRO-3 rank's time (docs/
 * benchmarks-history.md, table (i)). Every rank receives (N - 1) parts of `count`
 * into the scratch; the sums are the same in either order on 2 ranks, and
 * in rank order on more. */
#define P2P_TAG 0x3e3

static void add_into(float *restrict a, const float *restrict b, size_t n, mt_comm_op op)
{
    if (op == MT_COMM_MAX)
        for (size_t i = 0; i < n; i++) a[i] = b[i] > a[i] ? b[i] : a[i];
    else
        for (size_t i = 0; i < n; i++) a[i] += b[i];
}

static mt_status pairwise_rs(mpi_state *st, const float *send, float *recv, size_t count,
                             mt_comm_op op)
{
    const int N = st->size, me = st->rank;
    const size_t need = (size_t)(N - 1) * count;
    if (need > st->scratch_n) {
        float *g = realloc(st->scratch, need * sizeof *g);
        if (!g) {
            snprintf(st->err, sizeof st->err, "out of host memory for %zu bytes of the "
                     "reduce-scatter's parts", need * sizeof *g);
            return MT_ERR_OOM;
        }
        st->scratch = g, st->scratch_n = need;
    }
    MPI_Request stack[16], *req = N <= 8 ? stack : malloc(2 * (size_t)N * sizeof *req);
    if (!req) {
        snprintf(st->err, sizeof st->err, "out of host memory");
        return MT_ERR_OOM;
    }
    int k = 0, rc = MPI_SUCCESS;
    for (int p = 0, j = 0; p < N && rc == MPI_SUCCESS; p++) {
        if (p == me) continue;
        rc = MPI_Irecv(st->scratch + (size_t)j++ * count, (int)count, MPI_FLOAT, p, P2P_TAG, st->comm,
                       &req[k]);
        if (rc == MPI_SUCCESS) k++;
    }
    for (int p = 0; p < N && rc == MPI_SUCCESS; p++) {
        if (p == me) continue;
        rc = MPI_Isend(send + (size_t)p * count, (int)count, MPI_FLOAT, p, P2P_TAG, st->comm, &req[k]);
        if (rc == MPI_SUCCESS) k++;
    }
    /* (a request posted before a failure stays pending: the communicator is broken) */
    mt_status s = rc != MPI_SUCCESS ? mpi_fail(st, "MPI_Isend", rc) : finish_all(st, "the reduce-scatter", rc, req, k);
    if (req != stack) free(req);
    if (s) return s;
    /* acc = part 0, then each next rank's part added onto it: on rank 0 in
       recv itself, elsewhere in the scratch's part of rank 0 */
    const float *own = send + (size_t)me * count;
    float *acc = me == 0 ? recv : st->scratch;
    if (me == 0 && own != recv) memcpy(recv, own, count * sizeof *recv);
    for (int r = 1; r < N; r++)
        add_into(acc, r == me ? own : st->scratch + (size_t)(r < me ? r : r - 1) * count, count, op);
    if (acc != recv) memcpy(recv, acc, count * sizeof *recv);
    return MT_OK;
}

static mt_status m_reduce_scatter(void *self, const void *send, void *recv, size_t count,
                                  mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    (void)stream;
    mpi_state *st = self;
    mt_status s = ready(st);
    if (s) return s;
    if (count > MAX_COUNT) return too_many(st, count);
    if (dt == MT_COMM_F32 && st->size > 1) return pairwise_rs(st, send, recv, count, op);
    const size_t es = esize(dt), mine = (size_t)st->rank * count * es;
    MPI_Request req;
    if ((const char *)send + mine == (const char *)recv) {
        /* in place, MPI's way: the input is the whole of send, and the
           result lands at its start; then moved to this rank's part */
        int rc = MPI_Ireduce_scatter_block(MPI_IN_PLACE, (void *)send, (int)count, mtype(dt),
                                           mop(op), st->comm, &req);
        s = finish(st, "MPI_Ireduce_scatter_block", rc, &req);
        if (!s && mine) memmove(recv, send, count * es);
        return s;
    }
    int rc = MPI_Ireduce_scatter_block(send, recv, (int)count, mtype(dt), mop(op), st->comm, &req);
    return finish(st, "MPI_Ireduce_scatter_block", rc, &req);
}

static mt_status m_all_gather(void *self, const void *send, void *recv, size_t count,
                              mt_comm_dtype dt, void *stream)
{
    (void)stream;
    mpi_state *st = self;
    mt_status s = ready(st);
    if (s) return s;
    if (count > MAX_COUNT) return too_many(st, count);
    const size_t es = esize(dt);
    const void *in = (const char *)recv + (size_t)st->rank * count * es == (const char *)send
                         ? MPI_IN_PLACE
                         : send;
    MPI_Request req;
    int rc = MPI_Iallgather(in, (int)count, mtype(dt), recv, (int)count, mtype(dt), st->comm, &req);
    return finish(st, "MPI_Iallgather", rc, &req);
}

static mt_status m_broadcast(void *self, void *buf, size_t count, mt_comm_dtype dt, int root,
                             void *stream)
{
    (void)stream;
    mpi_state *st = self;
    mt_status s = ready(st);
    const size_t es = esize(dt);
    for (size_t at = 0; at < count && !s; at += MAX_COUNT) {
        size_t n = count - at < MAX_COUNT ? count - at : MAX_COUNT;
        MPI_Request req;
        int rc = MPI_Ibcast((char *)buf + at * es, (int)n, mtype(dt), root, st->comm, &req);
        s = finish(st, "MPI_Ibcast", rc, &req);
    }
    return s;
}

static mt_status m_barrier(void *self)
{
    mpi_state *st = self;
    if (st->broken) return ready(st);
    MPI_Request req;
    int rc = MPI_Ibarrier(st->comm, &req);
    return finish(st, "MPI_Ibarrier", rc, &req);
}

/* Point to point: the send and the receive posted (as bytes, in pieces of
 * at most MAX_COUNT, on a tag of their own), then waited for together
 * under the deadline. A message longer than recv_count is MPI's truncation
 * error. */
#define SENDRECV_TAG 7407

static mt_status m_sendrecv(void *self, const void *send, size_t sn, int to, void *recv, size_t rn,
                            int from, mt_comm_dtype dt, void *stream)
{
    (void)stream;
    mpi_state *st = self;
    mt_status s = ready(st);
    if (s) return s;
    const size_t sb = to >= 0 ? sn * esize(dt) : 0, rb = from >= 0 ? rn * esize(dt) : 0;
    for (size_t sa = 0, ra = 0; !s && (sa < sb || ra < rb);) {
        MPI_Request req[2];
        int k = 0, rc = MPI_SUCCESS;
        const size_t rp = rb - ra < MAX_COUNT ? rb - ra : MAX_COUNT;
        const size_t sp = sb - sa < MAX_COUNT ? sb - sa : MAX_COUNT;
        if (rp) {
            rc = MPI_Irecv((char *)recv + ra, (int)rp, MPI_BYTE, from, SENDRECV_TAG, st->comm, &req[k]);
            if (rc == MPI_SUCCESS) k++;
        }
        if (sp && rc == MPI_SUCCESS) {
            rc = MPI_Isend((const char *)send + sa, (int)sp, MPI_BYTE, to, SENDRECV_TAG, st->comm,
                           &req[k]);
            if (rc == MPI_SUCCESS) k++;
        }
        char what[96];
        if (rp && sp)
            snprintf(what, sizeof what, "the receive from rank %d and the send to rank %d", from, to);
        else if (rp) snprintf(what, sizeof what, "the receive from rank %d", from);
        else snprintf(what, sizeof what, "the send to rank %d", to);
        s = rc != MPI_SUCCESS ? mpi_fail(st, sp ? "MPI_Isend" : "MPI_Irecv", rc)
                              : finish_all(st, what, rc, req, k);
        sa += sp, ra += rp;
    }
    return s;
}

/* MPI_Comm_split blocks: it is called only once an all-gather under the
 * deadline has shown that every rank is in this call (rule 2); the new
 * communicator returns errors and keeps the timeout. */
static mt_status m_split(void *self, int color, int key, void **out_self, int *out_rank,
                         int *out_size)
{
    mpi_state *st = self;
    mt_status s = ready(st);
    if (s) return s;
    int mine[2] = {color, key}, *all = malloc(2 * (size_t)st->size * sizeof *all);
    if (!all) {
        snprintf(st->err, sizeof st->err, "out of host memory");
        return MT_ERR_OOM;
    }
    MPI_Request req;
    int rc = MPI_Iallgather(mine, 2, MPI_INT, all, 2, MPI_INT, st->comm, &req);
    s = finish(st, "the split's exchange (MPI_Iallgather)", rc, &req);
    free(all);
    if (s) return s;
    MPI_Comm nc = MPI_COMM_NULL;
    rc = MPI_Comm_split(st->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc);
    if (rc != MPI_SUCCESS) return mpi_fail(st, "MPI_Comm_split", rc);
    if (nc == MPI_COMM_NULL) return MT_OK; /* (color -1: none) */
    mpi_state *ns = calloc(1, sizeof *ns);
    if (!ns) {
        MPI_Comm_free(&nc);
        snprintf(st->err, sizeof st->err, "out of host memory");
        return MT_ERR_OOM;
    }
    ns->comm = nc;
    ns->timeout = st->timeout;
    rc = MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(nc, &ns->rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(nc, &ns->size);
    if (rc != MPI_SUCCESS) {
        MPI_Comm_free(&nc);
        free(ns);
        return mpi_fail(st, "MPI_Comm_split's communicator", rc);
    }
    *out_self = ns, *out_rank = ns->rank, *out_size = ns->size;
    return MT_OK;
}

static const char *m_last_error(void *self) { return ((mpi_state *)self)->err; }

static void m_destroy(void *self)
{
    mpi_state *st = self;
    if (!st->broken) { /* else MPI still holds a request on the duplicate */
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin) MPI_Comm_free(&st->comm);
        free(st->scratch);
    }
    free(st);
}

static const mt_comm_vtable mpi_vtable = {
    .abi_version = MT_COMM_ABI_VERSION,
    .struct_size = sizeof(mt_comm_vtable),
    .name = "mpi",
    .caps = 0,
    .all_reduce = m_all_reduce,
    .reduce_scatter = m_reduce_scatter,
    .all_gather = m_all_gather,
    .broadcast = m_broadcast,
    .barrier = m_barrier,
    .last_error = m_last_error,
    .destroy = m_destroy,
    .sendrecv = m_sendrecv,
    .split = m_split,
};

mt_status mt_comm_mpi_create(MPI_Comm comm, double timeout_seconds, mt_comm **out)
{
    const char *fn = "mt_comm_mpi_create";
    if (!out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (!(timeout_seconds > 0.0) || timeout_seconds > 1e7)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: timeout_seconds %g out of range (0, 1e7]", fn,
                        timeout_seconds);
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin)
        return mti_fail(NULL, MT_ERR_STATE, "%s: MPI is %s", fn,
                        fin ? "already finalized" : "not initialized (call MPI_Init first)");
    if (comm == MPI_COMM_NULL) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: comm is MPI_COMM_NULL", fn);
    mpi_state *st = calloc(1, sizeof *st);
    if (!st) return mti_fail(NULL, MT_ERR_OOM, "%s: out of host memory", fn);
    st->timeout = timeout_seconds;
    int rc = MPI_Comm_dup(comm, &st->comm);
    if (rc != MPI_SUCCESS) {
        mpi_fail(st, "MPI_Comm_dup", rc);
        mt_status s = mti_fail(NULL, MT_ERR_COMM, "%s: %s", fn, st->err);
        free(st);
        return s;
    }
    rc = MPI_Comm_set_errhandler(st->comm, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(st->comm, &st->rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(st->comm, &st->size);
    mt_status s = MT_OK;
    if (rc != MPI_SUCCESS) {
        mpi_fail(st, "MPI_Comm_set_errhandler", rc);
        s = mti_fail(NULL, MT_ERR_COMM, "%s: %s", fn, st->err);
    } else {
        /* calls from any thread, one at a time, where MPI allows it */
        int level = MPI_THREAD_SINGLE;
        MPI_Query_thread(&level);
        mt_comm_vtable vt = mpi_vtable;
        if (level >= MPI_THREAD_SERIALIZED) vt.caps |= MT_COMM_CAP_THREADS;
        s = mt_comm_create(&vt, st, st->rank, st->size, out);
    }
    if (s) {
        MPI_Comm_free(&st->comm);
        free(st);
    }
    return s;
}
