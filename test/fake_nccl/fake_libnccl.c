/*
 * fake_libnccl.c - a stand-in libnccl.so.2 over host memory, so the NCCL
 * communicator's loading, bootstrap, collectives, deadline and abort run in
 * the test suite without a GPU. Ranks are threads of one process: the ranks
 * made from one unique id form a clique, and a collective completes when
 * the last rank queues it (the reduction is done then, in rank order); a
 * rank may queue several before the others queue the first (a rank's k-th
 * collective meets the others' k-th). When the ranks' k-th collectives
 * differ (kind, type, count, op or root) that one never completes, nor
 * any after it, and no error is reported: NCCL does not check, its ranks
 * wait for data that never comes (until the communicator is aborted).
 * Like
 * NCCL, a collective call only queues: completion shows through
 * cuStreamQuery on the calling thread, which this library also exports
 * (with cuMemAlloc_v2 and cuMemFree_v2 over malloc), so pass it as the
 * communicator's CUDA driver as well. Each stream is its own queue: a
 * stream is done when the last collective the thread queued on it is, so
 * a collective on one stream completes independently of those on another
 * (as on a GPU, where a stream waits only for its own work).
 *
 * For tests: fake_nccl_calls(stream, others) counts the collectives the
 * calling thread queued on `stream` (others 0) or on every other stream
 * (others 1).
 *
 * For the stand-in driver (test/fake_cuda/fake_libcuda.c), whose events
 * must not complete before the collectives queued ahead of them on their
 * stream: fake_nccl_mark(stream, mark) gives the calling thread's last
 * collective on `stream` not known done (1; 0: none), and
 * fake_nccl_reached(mark) whether it is done (or its communicator gone or
 * aborted, which ends its work, as ncclCommAbort ends NCCL's kernels);
 * fake_nccl_busy() whether the calling thread has a collective queued and
 * not done on any stream (the stand-in driver's cuMemFree and cuMemUnmap,
 * which on a GPU wait for the whole device, count a call made then).
 * fake_nccl_stuck(1): from then on an aborted communicator's collectives
 * do not end (kernels that never exit), until fake_nccl_stuck(0).
 *
 * Devices, as the CUDA driver this library also is to the communicator:
 * MT_FAKE_NCCL_DEVICES of them (8), cuDeviceGet, each one's primary context
 * (cuDevicePrimaryCtxRetain, _Release_v2) and a stack of current contexts
 * per thread (cuCtxPushCurrent_v2, cuCtxPopCurrent_v2). Stricter than
 * NCCL, which takes device 0 when no context is current:
 * ncclCommInitRank needs a current context and takes its device; two
 * ranks of one clique on one device fail to start, every rank of it (NCCL:
 * "duplicate GPU"); a call on a communicator made while its device's
 * context is not the current one fails with ncclInvalidUsage (destroy and
 * abort go on), and so does cuMemAlloc_v2 with no context current. For
 * tests: fake_nccl_wrong_device() counts those calls, and
 * fake_nccl_init_device(rank) gives the device of the last communicator
 * set up for that rank (of any clique; -1: none).
 *
 * ncclCommSplit: the ranks' colors and keys exchanged by an all-gather
 * waited for in the call, then each color's ranks in a clique of their own.
 *
 * Point to point (ncclSend, ncclRecv, inside ncclGroupStart/End or not):
 * a send is copied into the pair's mailbox at once and is done; a receive
 * takes the oldest message from its peer when it is there, at the call or
 * later, through cuStreamQuery on its stream (the stream is not done until
 * it came, or the communicator is aborted). A message of another length is
 * never taken (NCCL would read or write past it). Marks and fake_nccl_busy
 * see the collectives only.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int ncclResult_t;
enum { OK = 0, SYSTEM_ERROR = 2, INVALID_ARGUMENT = 4, INVALID_USAGE = 5, REMOTE_ERROR = 6 };
enum { T_U8 = 1, T_F32 = 7, T_BF16 = 9 };
enum { K_ALLREDUCE, K_REDUCE_SCATTER, K_ALLGATHER, K_BROADCAST };
#define MAXR 16

typedef struct { char internal[128]; } ncclUniqueId;

typedef struct pend {
    int kind, type, op, root;
    size_t count;
    void *recv;
    unsigned char *stage; /* a copy of send */
} pend;

/* One collective: each rank's part, and how many have queued it. */
typedef struct round {
    int arrived;
    pend p[MAXR];
} round;
/* Collectives a rank may queue ahead of the slowest (its k-th goes in
   round k; a round completes when the last rank queues it, and so after
   every round before it) */
#define MAXQ 512

/* A message sent and not received yet. */
typedef struct p2p_msg {
    struct p2p_msg *next;
    size_t bytes;
    unsigned char data[];
} p2p_msg;

typedef struct clique {
    char id[128];
    int dev[MAXR]; /* each rank's device */
    p2p_msg *box[MAXR * MAXR]; /* [from * MAXR + to], oldest first */
    unsigned long long serial; /* names it in marks (fake_nccl_mark) */
    int n, joined, live, aborted, stalled; /* stalled: ranks' collectives differed */
    uint64_t seq; /* collectives completed */
    round *r;     /* MAXQ of them, round k at k % MAXQ */
    struct clique *next;
} clique;

typedef struct fake_comm {
    clique *q;
    int rank;
    int dev; /* its device */
    uint64_t issued; /* collectives queued */
    unsigned splits; /* ncclCommSplit calls made */
} fake_comm;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static clique *cliques;
static unsigned ids;
static unsigned long long serials;
static int stuck; /* fake_nccl_stuck */
/* per thread: the streams with collectives queued, each with the number
   its last one completes at; and how many each stream was given */
#define MAXS 8
typedef struct on_stream {
    void *stream;
    fake_comm *c; /* NULL: a free slot */
    uint64_t waiting;
} on_stream;
static _Thread_local on_stream pending[MAXS];
static _Thread_local struct {
    void *stream;
    unsigned long n;
} counted[MAXS];
static _Thread_local int n_counted;

/* Receives not yet matched, per thread: each on a stream. */
typedef struct p2p_wait {
    void *stream;
    fake_comm *c; /* NULL: a free slot */
    int from;
    void *buf;
    size_t bytes;
} p2p_wait;
static _Thread_local p2p_wait waits[MAXS];


/* exported */
ncclResult_t ncclGetVersion(int *v);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(fake_comm **out, int n, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(fake_comm *c);
ncclResult_t ncclCommAbort(fake_comm *c);
ncclResult_t ncclCommGetAsyncError(fake_comm *c, ncclResult_t *e);
const char *ncclGetErrorString(ncclResult_t r);
ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int t, int op, fake_comm *c, void *st);
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, fake_comm *c, void *st);
ncclResult_t ncclAllGather(const void *s, void *r, size_t n, int t, fake_comm *c, void *st);
ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, int t, int root, fake_comm *c, void *st);
ncclResult_t ncclSend(const void *s, size_t n, int t, int peer, fake_comm *c, void *stream);
ncclResult_t ncclRecv(void *r, size_t n, int t, int peer, fake_comm *c, void *stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclCommSplit(fake_comm *c, int color, int key, fake_comm **out, void *config);
ncclResult_t ncclCommCount(const fake_comm *c, int *n);
ncclResult_t ncclCommUserRank(const fake_comm *c, int *r);
int cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t bytes);
int cuStreamQuery(void *stream);
int cuMemAlloc_v2(unsigned long long *p, size_t bytes);
int cuMemFree_v2(unsigned long long p);
unsigned long fake_nccl_calls(void *stream, int others);
int fake_nccl_mark(void *stream, unsigned long long mark[2]);
int fake_nccl_reached(const unsigned long long mark[2]);
int fake_nccl_busy(void);
void fake_nccl_stuck(int on);
int cuInit(unsigned flags);
int cuDeviceGet(int *dev, int ordinal);
int cuDevicePrimaryCtxRetain(void **ctx, int dev);
int cuDevicePrimaryCtxRelease_v2(int dev);
int cuCtxPushCurrent_v2(void *ctx);
int cuCtxPopCurrent_v2(void **ctx);
unsigned long fake_nccl_wrong_device(void);
int fake_nccl_init_device(int rank);

/* ---- devices and contexts ---- */

#define MAXD 64
#define CTX_DEPTH 16
enum { CU_INVALID_DEVICE = 101, CU_INVALID_CONTEXT = 201, CU_UNKNOWN = 999 };
typedef struct fake_ctx {
    int dev, refs;
} fake_ctx;
static fake_ctx devices[MAXD];
static _Thread_local fake_ctx *cur[CTX_DEPTH];
static _Thread_local int depth;
static int init_device[MAXR] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
static unsigned long wrong_device;

static int n_devices(void)
{
    const char *v = getenv("MT_FAKE_NCCL_DEVICES");
    const int n = v && *v ? atoi(v) : 8;
    return n < 0 ? 0 : n > MAXD ? MAXD : n;
}

/* The device of the current context, or -1. */
static int cur_dev(void) { return depth ? cur[depth - 1]->dev : -1; }

/* Whether c's device is current; a call made otherwise is counted. */
static int on_device(const fake_comm *c)
{
    if (cur_dev() == c->dev) return 1;
    pthread_mutex_lock(&mu);
    wrong_device++;
    pthread_mutex_unlock(&mu);
    return 0;
}

int cuInit(unsigned flags)
{
    (void)flags;
    return 0;
}

int cuDeviceGet(int *dev, int ordinal)
{
    if (ordinal < 0 || ordinal >= n_devices()) return CU_INVALID_DEVICE;
    *dev = ordinal;
    return 0;
}

int cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
    if (dev < 0 || dev >= n_devices()) return CU_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    devices[dev].dev = dev;
    devices[dev].refs++;
    pthread_mutex_unlock(&mu);
    *ctx = &devices[dev];
    return 0;
}

int cuDevicePrimaryCtxRelease_v2(int dev)
{
    if (dev < 0 || dev >= n_devices()) return CU_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    const int ok = devices[dev].refs > 0;
    if (ok) devices[dev].refs--;
    pthread_mutex_unlock(&mu);
    return ok ? 0 : CU_INVALID_CONTEXT;
}

int cuCtxPushCurrent_v2(void *ctx)
{
    fake_ctx *x = ctx;
    if (!x || x < devices || x >= devices + MAXD || x->refs <= 0) return CU_INVALID_CONTEXT;
    if (depth == CTX_DEPTH) return CU_UNKNOWN;
    cur[depth++] = x;
    return 0;
}

int cuCtxPopCurrent_v2(void **ctx)
{
    if (!depth) return CU_INVALID_CONTEXT;
    fake_ctx *x = cur[--depth];
    if (ctx) *ctx = x;
    return 0;
}

unsigned long fake_nccl_wrong_device(void)
{
    pthread_mutex_lock(&mu);
    const unsigned long n = wrong_device;
    pthread_mutex_unlock(&mu);
    return n;
}

int fake_nccl_init_device(int rank)
{
    pthread_mutex_lock(&mu);
    const int d = rank >= 0 && rank < MAXR ? init_device[rank] : -1;
    pthread_mutex_unlock(&mu);
    return d;
}

ncclResult_t ncclGetVersion(int *v)
{
    *v = 22800;
    return OK;
}

/* Like NCCL's bootstrap root, a thread that outlives ncclGetUniqueId (a
 * while, here): a library unloaded under it makes it fault when it wakes. */
static void *bootstrap_root(void *arg)
{
    (void)arg;
    struct timespec nap = {0, 200 * 1000 * 1000};
    nanosleep(&nap, NULL);
    return NULL;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    pthread_t th;
    if (pthread_create(&th, NULL, bootstrap_root, NULL) == 0) pthread_detach(th);
    memset(id, 0, sizeof *id);
    pthread_mutex_lock(&mu);
    unsigned k = ++ids;
    pthread_mutex_unlock(&mu);
    memcpy(id->internal, "fakenccl", 8);
    memcpy(id->internal + 8, &k, sizeof k);
    return OK;
}

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case OK: return "no error";
    case SYSTEM_ERROR: return "unhandled system error (stand-in)";
    case INVALID_ARGUMENT: return "invalid argument (stand-in)";
    case INVALID_USAGE: return "invalid usage (stand-in)";
    case REMOTE_ERROR: return "remote process exited or there was a network error (stand-in)";
    }
    return "unknown result (stand-in)";
}

static void leave(fake_comm *c, int abort);

ncclResult_t ncclCommInitRank(fake_comm **out, int n, ncclUniqueId id, int rank)
{
    if (n < 1 || n > MAXR || rank < 0 || rank >= n || memcmp(id.internal, "fakenccl", 8))
        return INVALID_ARGUMENT;
    const int dev = cur_dev();
    if (dev < 0) return INVALID_USAGE; /* (NCCL would take device 0) */
    pthread_mutex_lock(&mu);
    clique *q = cliques;
    while (q && memcmp(q->id, id.internal, 128)) q = q->next;
    if (!q) {
        q = calloc(1, sizeof *q);
        q->r = calloc(MAXQ, sizeof *q->r);
        memcpy(q->id, id.internal, 128);
        q->serial = ++serials;
        q->n = n;
        q->next = cliques;
        cliques = q;
    }
    if (q->n != n) {
        pthread_mutex_unlock(&mu);
        return INVALID_USAGE;
    }
    q->dev[rank] = dev;
    q->joined++;
    q->live++;
    pthread_cond_broadcast(&cv);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 30;
    while (q->joined < q->n)
        if (pthread_cond_timedwait(&cv, &mu, &dl)) break;
    int ok = q->joined >= q->n;
    for (int r = 0; ok && r < n; r++) /* one device per rank, as NCCL wants */
        for (int r2 = r + 1; ok && r2 < n; r2++) ok = q->dev[r] != q->dev[r2];
    pthread_mutex_unlock(&mu);
    fake_comm *c = calloc(1, sizeof *c);
    c->q = q;
    c->rank = rank;
    c->dev = dev;
    if (!ok) {
        const int joined = q->joined >= q->n;
        leave(c, 0);
        return joined ? INVALID_USAGE : SYSTEM_ERROR;
    }
    pthread_mutex_lock(&mu);
    init_device[rank] = dev;
    pthread_mutex_unlock(&mu);
    *out = c;
    return OK;
}

static void leave(fake_comm *c, int abort)
{
    pthread_mutex_lock(&mu);
    clique *q = c->q;
    if (abort) q->aborted = 1;
    if (--q->live == 0) {
        for (clique **pp = &cliques; *pp; pp = &(*pp)->next)
            if (*pp == q) {
                *pp = q->next;
                break;
            }
        for (int k = 0; k < MAXQ; k++)
            for (int r = 0; r < MAXR; r++) free(q->r[k].p[r].stage);
        for (int k = 0; k < MAXR * MAXR; k++)
            for (p2p_msg *m = q->box[k], *nx; m; m = nx) nx = m->next, free(m);
        free(q->r);
        free(q);
    }
    pthread_mutex_unlock(&mu);
    for (int k = 0; k < MAXS; k++) {
        if (pending[k].c == c) pending[k].c = NULL;
        if (waits[k].c == c) waits[k].c = NULL;
    }
    free(c);
}

ncclResult_t ncclCommDestroy(fake_comm *c)
{
    on_device(c);
    leave(c, 0);
    return OK;
}

ncclResult_t ncclCommAbort(fake_comm *c)
{
    on_device(c);
    leave(c, 1);
    return OK;
}

ncclResult_t ncclCommGetAsyncError(fake_comm *c, ncclResult_t *e)
{
    if (!on_device(c)) return INVALID_USAGE;
    pthread_mutex_lock(&mu);
    *e = c->q->aborted ? REMOTE_ERROR : OK; /* (a stalled clique reports nothing) */
    pthread_mutex_unlock(&mu);
    return OK;
}

static size_t tsize(int t) { return t == T_F32 ? 4 : t == T_BF16 ? 2 : 1; }

static float get(const unsigned char *p, int t, size_t i)
{
    if (t == T_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void put(unsigned char *p, int t, size_t i, float f)
{
    if (t == T_F32) {
        memcpy(p + 4 * i, &f, 4);
        return;
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
    uint16_t h = (uint16_t)(u >> 16);
    memcpy(p + 2 * i, &h, 2);
}

/* The last rank in: every rank's result, in rank order. */
static void complete(clique *q, round *rd)
{
    const pend *p0 = &rd->p[0];
    for (int r = 1; r < q->n; r++) {
        const pend *p = &rd->p[r];
        if (p->kind != p0->kind || p->type != p0->type || p->count != p0->count ||
            p->op != p0->op || p->root != p0->root)
            q->stalled = 1;
    }
    if (q->stalled) return;
    const size_t es = tsize(p0->type), n = p0->count;
    for (int r = 0; r < q->n; r++) {
        pend *p = &rd->p[r];
        unsigned char *out = p->recv;
        switch (p0->kind) {
        case K_ALLREDUCE:
        case K_REDUCE_SCATTER: {
            size_t at = p0->kind == K_ALLREDUCE ? 0 : (size_t)r * n;
            for (size_t i = 0; i < n; i++) {
                float acc = get(rd->p[0].stage, p0->type, at + i);
                for (int k = 1; k < q->n; k++) {
                    float v = get(rd->p[k].stage, p0->type, at + i);
                    acc = p0->op == 2 ? (v > acc ? v : acc) : acc + v;
                }
                put(out, p0->type, i, acc);
            }
            break;
        }
        case K_ALLGATHER:
            for (int k = 0; k < q->n; k++) memcpy(out + (size_t)k * n * es, rd->p[k].stage, n * es);
            break;
        case K_BROADCAST: memcpy(out, rd->p[p0->root].stage, n * es); break;
        }
    }
}

/* The calling thread's slot for stream (a free one if it has none), or
 * NULL when every slot is taken. */
static on_stream *slot_of(void *stream)
{
    on_stream *free_one = NULL;
    for (int k = 0; k < MAXS; k++) {
        if (pending[k].c && pending[k].stream == stream) return &pending[k];
        if (!pending[k].c && !free_one) free_one = &pending[k];
    }
    return free_one;
}

static void count_on(void *stream)
{
    for (int k = 0; k < n_counted; k++)
        if (counted[k].stream == stream) {
            counted[k].n++;
            return;
        }
    if (n_counted < MAXS) counted[n_counted].stream = stream, counted[n_counted++].n = 1;
}

unsigned long fake_nccl_calls(void *stream, int others)
{
    unsigned long n = 0;
    for (int k = 0; k < n_counted; k++)
        if ((counted[k].stream == stream) != (others != 0)) n += counted[k].n;
    return n;
}

static ncclResult_t queue(fake_comm *c, int kind, const void *send, size_t send_elems, void *recv,
                          size_t count, int type, int op, int root, void *stream)
{
    if (type != T_U8 && type != T_F32 && type != T_BF16) return INVALID_ARGUMENT;
    if (!on_device(c)) return INVALID_USAGE;
    on_stream *slot = slot_of(stream);
    if (!slot) return SYSTEM_ERROR; /* (more streams at once than the stand-in keeps) */
    pthread_mutex_lock(&mu);
    clique *q = c->q;
    if (q->aborted) {
        pthread_mutex_unlock(&mu);
        return REMOTE_ERROR;
    }
    const uint64_t k = c->issued;
    if (k - q->seq >= MAXQ) { /* (further ahead of the others than the stand-in keeps) */
        pthread_mutex_unlock(&mu);
        return SYSTEM_ERROR;
    }
    round *rd = &q->r[k % MAXQ];
    pend *p = &rd->p[c->rank];
    free(p->stage);
    *p = (pend){.kind = kind, .type = type, .op = op, .root = root, .count = count, .recv = recv};
    p->stage = malloc(send_elems * tsize(type) + 1);
    memcpy(p->stage, send, send_elems * tsize(type));
    c->issued++;
    *slot = (on_stream){.stream = stream, .c = c, .waiting = k + 1};
    if (++rd->arrived == q->n && !q->stalled) {
        complete(q, rd);
        if (!q->stalled) rd->arrived = 0, q->seq++;
    }
    pthread_mutex_unlock(&mu);
    count_on(stream);
    return OK;
}

ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int t, int op, fake_comm *c, void *st)
{
    return queue(c, K_ALLREDUCE, s, n, r, n, t, op, 0, st);
}

ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, fake_comm *c, void *st)
{
    return queue(c, K_REDUCE_SCATTER, s, n * (size_t)c->q->n, r, n, t, op, 0, st);
}

ncclResult_t ncclAllGather(const void *s, void *r, size_t n, int t, fake_comm *c, void *st)
{
    return queue(c, K_ALLGATHER, s, n, r, n, t, 0, 0, st);
}

ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, int t, int root, fake_comm *c, void *st)
{
    return queue(c, K_BROADCAST, s, n, r, n, t, 0, root, st);
}

/* Takes w's message if it came (the lock held): 1 done (or aborted), 0 not yet. */
static int take(p2p_wait *w)
{
    clique *q = w->c->q;
    if (q->aborted) return 1;
    p2p_msg **head = &q->box[w->from * MAXR + w->c->rank];
    if (!*head || (*head)->bytes != w->bytes) return 0;
    p2p_msg *m = *head;
    memcpy(w->buf, m->data, m->bytes);
    *head = m->next;
    free(m);
    return 1;
}

ncclResult_t ncclGroupStart(void) { return OK; }
ncclResult_t ncclGroupEnd(void) { return OK; }

ncclResult_t ncclSend(const void *s, size_t n, int t, int peer, fake_comm *c, void *stream)
{
    if (t != T_U8 && t != T_F32 && t != T_BF16) return INVALID_ARGUMENT;
    if (!on_device(c)) return INVALID_USAGE;
    if (peer < 0 || peer >= c->q->n || peer == c->rank) return INVALID_ARGUMENT;
    p2p_msg *m = malloc(sizeof *m + n * tsize(t) + 1);
    if (!m) return SYSTEM_ERROR;
    m->next = NULL, m->bytes = n * tsize(t);
    memcpy(m->data, s, m->bytes);
    pthread_mutex_lock(&mu);
    if (c->q->aborted) {
        pthread_mutex_unlock(&mu);
        free(m);
        return REMOTE_ERROR;
    }
    p2p_msg **end = &c->q->box[c->rank * MAXR + peer];
    while (*end) end = &(*end)->next;
    *end = m;
    pthread_mutex_unlock(&mu);
    count_on(stream);
    return OK;
}

ncclResult_t ncclRecv(void *r, size_t n, int t, int peer, fake_comm *c, void *stream)
{
    if (t != T_U8 && t != T_F32 && t != T_BF16) return INVALID_ARGUMENT;
    if (!on_device(c)) return INVALID_USAGE;
    if (peer < 0 || peer >= c->q->n || peer == c->rank) return INVALID_ARGUMENT;
    p2p_wait *w = NULL;
    for (int k = 0; k < MAXS && !w; k++)
        if (!waits[k].c) w = &waits[k];
    if (!w) return SYSTEM_ERROR; /* (more receives pending than the stand-in keeps) */
    *w = (p2p_wait){.stream = stream, .c = c, .from = peer, .buf = r, .bytes = n * tsize(t)};
    pthread_mutex_lock(&mu);
    if (c->q->aborted) w->c = NULL;
    else if (take(w)) w->c = NULL;
    const int aborted = c->q->aborted;
    pthread_mutex_unlock(&mu);
    count_on(stream);
    return aborted ? REMOTE_ERROR : OK;
}

/* The stream's receives taken and its last collective done (or none queued on it): 0. */
int cuStreamQuery(void *stream)
{
    int waiting = 0;
    pthread_mutex_lock(&mu);
    for (int k = 0; k < MAXS; k++)
        if (waits[k].c && waits[k].stream == stream) {
            if (take(&waits[k])) waits[k].c = NULL;
            else waiting = 1;
        }
    pthread_mutex_unlock(&mu);
    if (waiting) return 600; /* CUDA_ERROR_NOT_READY */
    on_stream *slot = NULL;
    for (int k = 0; k < MAXS && !slot; k++)
        if (pending[k].c && pending[k].stream == stream) slot = &pending[k];
    if (!slot) return 0;
    pthread_mutex_lock(&mu);
    int done = slot->c->q->seq >= slot->waiting;
    pthread_mutex_unlock(&mu);
    if (done) slot->c = NULL;
    return done ? 0 : 600; /* CUDA_ERROR_NOT_READY */
}

int cuMemAlloc_v2(unsigned long long *p, size_t bytes)
{
    if (!depth) return CU_INVALID_CONTEXT;
    void *m = calloc(1, bytes);
    if (!m) return 2;
    *p = (unsigned long long)(uintptr_t)m;
    return 0;
}

int cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t bytes)
{
    memcpy((void *)(uintptr_t)dst, src, bytes);
    return 0;
}

ncclResult_t ncclCommCount(const fake_comm *c, int *n)
{
    *n = c->q->n;
    return OK;
}

ncclResult_t ncclCommUserRank(const fake_comm *c, int *r)
{
    *r = c->rank;
    return OK;
}

/* The ranks' (color, key) all-gathered on a stream of its own (waited for
 * here, as NCCL's split blocks), then each color's ranks join a clique of
 * their own, its id made from the parent's serial, the split's number and
 * the color. */
ncclResult_t ncclCommSplit(fake_comm *c, int color, int key, fake_comm **out, void *config)
{
    (void)config;
    static char own_stream;
    const int n = c->q->n, mine[2] = {color, key};
    int all[2 * MAXR];
    ncclResult_t r = queue(c, K_ALLGATHER, mine, sizeof mine, all, sizeof mine, T_U8, 0, 0, &own_stream);
    struct timespec nap = {0, 100000};
    for (int k = 0; !r && cuStreamQuery(&own_stream) != 0; k++) {
        if (k > 300000) return SYSTEM_ERROR; /* (about 30 s) */
        nanosleep(&nap, NULL);
    }
    if (r) return r;
    *out = NULL;
    const unsigned split = c->splits++;
    if (color < 0) return OK;
    int me = 0, size = 0;
    for (int k = 0; k < n; k++) {
        if (all[2 * k] != color) continue;
        size++;
        me += all[2 * k + 1] < key || (all[2 * k + 1] == key && k < c->rank);
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    const unsigned marker = 0xffffffffu;
    memcpy(id.internal, "fakenccl", 8);
    memcpy(id.internal + 8, &marker, 4);
    memcpy(id.internal + 12, &c->q->serial, 8);
    memcpy(id.internal + 20, &split, 4);
    memcpy(id.internal + 24, &color, 4);
    return ncclCommInitRank(out, size, id, me);
}

int cuMemFree_v2(unsigned long long p)
{
    free((void *)(uintptr_t)p);
    return 0;
}

int fake_nccl_mark(void *stream, unsigned long long mark[2])
{
    int got = 0;
    pthread_mutex_lock(&mu);
    for (int k = 0; k < MAXS && !got; k++) {
        const on_stream *p = &pending[k];
        if (!p->c || p->stream != stream || p->c->q->seq >= p->waiting) continue;
        mark[0] = p->c->q->serial;
        mark[1] = p->waiting;
        got = 1;
    }
    pthread_mutex_unlock(&mu);
    return got;
}

int fake_nccl_reached(const unsigned long long mark[2])
{
    pthread_mutex_lock(&mu);
    const clique *q = cliques;
    while (q && q->serial != mark[0]) q = q->next;
    const int done = !q || (q->aborted && !stuck) || q->seq >= mark[1];
    pthread_mutex_unlock(&mu);
    return done;
}

int fake_nccl_busy(void)
{
    int busy = 0;
    pthread_mutex_lock(&mu);
    for (int k = 0; k < MAXS && !busy; k++) {
        const on_stream *p = &pending[k];
        busy = p->c && p->c->q->seq < p->waiting && !(p->c->q->aborted && !stuck);
    }
    pthread_mutex_unlock(&mu);
    return busy;
}

void fake_nccl_stuck(int on)
{
    pthread_mutex_lock(&mu);
    stuck = on;
    pthread_mutex_unlock(&mu);
}
