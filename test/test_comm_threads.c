/*
 * test_comm_threads.c - the in-process test communicator (test_comm.h).
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "internal.h"
#include "test_comm.h"

struct tcomm_world {
    int n;
    double timeout;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived, dead;
    uint64_t gen;
    unsigned char **stage; /* each rank's send, copied */
    size_t *stage_bytes;
    struct tmsg **box;     /* point to point: box[from * n + to], oldest first */
    struct tcomm_world **sub; /* a split's new worlds, by their first member */
    int refs;              /* a split's world: its members' communicators left (0: not one) */
};

/* A message sent and not yet received (sends are buffered: they never wait). */
typedef struct tmsg {
    struct tmsg *next;
    size_t bytes;
    unsigned char data[];
} tmsg;

typedef struct trank {
    tcomm_world *w;
    int rank;
    char err[128];
} trank;

tcomm_world *tcomm_world_new(int n, double timeout_seconds)
{
    tcomm_world *w = calloc(1, sizeof *w);
    w->n = n;
    w->timeout = timeout_seconds;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->stage = calloc((size_t)n, sizeof *w->stage);
    w->stage_bytes = calloc((size_t)n, sizeof *w->stage_bytes);
    w->box = calloc((size_t)n * (size_t)n, sizeof *w->box);
    w->sub = calloc((size_t)n, sizeof *w->sub);
    return w;
}

void tcomm_world_free(tcomm_world *w)
{
    if (!w) return;
    for (int r = 0; r < w->n; r++) free(w->stage[r]);
    for (int k = 0; k < w->n * w->n; k++)
        for (tmsg *m = w->box[k], *nx; m; m = nx) nx = m->next, free(m);
    free(w->box);
    free(w->sub);
    free(w->stage);
    free(w->stage_bytes);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

/* The world's deadline from now (the lock held by the caller). */
static struct timespec deadline(const tcomm_world *w)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    double s = w->timeout;
    dl.tv_sec += (time_t)s;
    dl.tv_nsec += (long)((s - (double)(time_t)s) * 1e9);
    if (dl.tv_nsec >= 1000000000L) dl.tv_sec++, dl.tv_nsec -= 1000000000L;
    return dl;
}

/* Every rank meets here (the lock held); 0, or -1 when the world died. */
static int meet(trank *t)
{
    tcomm_world *w = t->w;
    if (w->dead) return -1;
    uint64_t g = w->gen;
    if (++w->arrived == w->n) {
        w->arrived = 0;
        w->gen++;
        pthread_cond_broadcast(&w->cv);
        return 0;
    }
    const struct timespec dl = deadline(w);
    while (w->gen == g && !w->dead) {
        if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) == ETIMEDOUT && w->gen == g) {
            w->dead = 1;
            pthread_cond_broadcast(&w->cv);
        }
    }
    return w->gen == g ? -1 : 0;
}

static size_t esz(mt_comm_dtype dt) { return dt == MT_COMM_F32 ? 4 : dt == MT_COMM_BF16 ? 2 : 1; }

static float get(const unsigned char *p, mt_comm_dtype dt, size_t i)
{
    float f;
    if (dt == MT_COMM_F32) {
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    uint32_t u = (uint32_t)h << 16;
    memcpy(&f, &u, 4);
    return f;
}

static void put(unsigned char *p, mt_comm_dtype dt, size_t i, float f)
{
    if (dt == MT_COMM_F32) {
        memcpy(p + 4 * i, &f, 4);
        return;
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    uint16_t h = (uint16_t)(u >> 16);
    memcpy(p + 2 * i, &h, 2);
}

/* The shared part of every collective: stage `bytes` of send, meet, let
 * fill() make this rank's result from every rank's stage, meet again. */
typedef void (*fill_fn)(trank *t, void *recv, size_t count, mt_comm_dtype dt, int op, int root);

static mt_status collective(trank *t, const char *what, const void *send, size_t bytes, void *recv,
                            size_t count, mt_comm_dtype dt, int op, int root, fill_fn fill)
{
    tcomm_world *w = t->w;
    pthread_mutex_lock(&w->mu);
    unsigned char *st = realloc(w->stage[t->rank], bytes + 1);
    if (st) {
        w->stage[t->rank] = st;
        memcpy(st, send, bytes);
        w->stage_bytes[t->rank] = bytes;
    }
    int rc = st ? meet(t) : -1;
    if (!rc && fill) fill(t, recv, count, dt, op, root);
    if (!rc) rc = meet(t);
    pthread_mutex_unlock(&w->mu);
    if (rc) {
        snprintf(t->err, sizeof t->err, "%s: a rank did not join within %g s", what, w->timeout);
        return MT_ERR_COMM;
    }
    return MT_OK;
}

static void fill_reduce(trank *t, void *recv, size_t count, mt_comm_dtype dt, int op, int scatter)
{
    tcomm_world *w = t->w;
    size_t at = scatter ? (size_t)t->rank * count : 0;
    for (size_t i = 0; i < count; i++) {
        float acc = get(w->stage[0], dt, at + i);
        for (int r = 1; r < w->n; r++) {
            float v = get(w->stage[r], dt, at + i);
            acc = op == MT_COMM_MAX ? (v > acc ? v : acc) : acc + v;
        }
        put(recv, dt, i, acc);
    }
}

static void fill_all_reduce(trank *t, void *recv, size_t count, mt_comm_dtype dt, int op, int root)
{
    (void)root;
    fill_reduce(t, recv, count, dt, op, 0);
}

static void fill_scatter(trank *t, void *recv, size_t count, mt_comm_dtype dt, int op, int root)
{
    (void)root;
    fill_reduce(t, recv, count, dt, op, 1);
}

static void fill_gather(trank *t, void *recv, size_t count, mt_comm_dtype dt, int op, int root)
{
    (void)op, (void)root;
    for (int r = 0; r < t->w->n; r++)
        memcpy((char *)recv + (size_t)r * count * esz(dt), t->w->stage[r], count * esz(dt));
}

static void fill_bcast(trank *t, void *recv, size_t count, mt_comm_dtype dt, int op, int root)
{
    (void)op;
    memcpy(recv, t->w->stage[root], count * esz(dt));
}

static mt_status t_all_reduce(void *self, const void *send, void *recv, size_t count,
                              mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    (void)stream;
    return collective(self, "all_reduce", send, count * esz(dt), recv, count, dt, (int)op, 0,
                      fill_all_reduce);
}

static mt_status t_reduce_scatter(void *self, const void *send, void *recv, size_t count,
                                  mt_comm_dtype dt, mt_comm_op op, void *stream)
{
    (void)stream;
    trank *t = self;
    return collective(t, "reduce_scatter", send, count * esz(dt) * (size_t)t->w->n, recv, count,
                      dt, (int)op, 0, fill_scatter);
}

static mt_status t_all_gather(void *self, const void *send, void *recv, size_t count,
                              mt_comm_dtype dt, void *stream)
{
    (void)stream;
    return collective(self, "all_gather", send, count * esz(dt), recv, count, dt, 0, 0,
                      fill_gather);
}

static mt_status t_broadcast(void *self, void *buf, size_t count, mt_comm_dtype dt, int root,
                             void *stream)
{
    (void)stream;
    return collective(self, "broadcast", buf, count * esz(dt), buf, count, dt, 0, root, fill_bcast);
}

static mt_status t_barrier(void *self)
{
    return collective(self, "barrier", "", 0, NULL, 0, MT_COMM_BYTE, 0, 0, NULL);
}

static mt_status t_sendrecv(void *self, const void *send, size_t sn, int to, void *recv, size_t rn,
                            int from, mt_comm_dtype dt, void *stream)
{
    (void)stream;
    trank *t = self;
    tcomm_world *w = t->w;
    const size_t sb = sn * esz(dt), rb = rn * esz(dt);
    mt_status s = MT_OK;
    pthread_mutex_lock(&w->mu);
    if (w->dead) {
        snprintf(t->err, sizeof t->err, "the world is dead (an earlier call timed out)");
        s = MT_ERR_COMM;
    }
    if (!s && to >= 0) { /* buffered: queued at the end of this pair's box */
        tmsg *m = malloc(sizeof *m + sb + 1), **end = &w->box[t->rank * w->n + to];
        if (!m) {
            snprintf(t->err, sizeof t->err, "out of host memory");
            s = MT_ERR_OOM;
        } else {
            m->next = NULL, m->bytes = sb;
            memcpy(m->data, send, sb);
            while (*end) end = &(*end)->next;
            *end = m;
            pthread_cond_broadcast(&w->cv);
        }
    }
    if (!s && from >= 0) {
        tmsg **head = &w->box[from * w->n + t->rank];
        const struct timespec dl = deadline(w);
        while (!*head && !w->dead)
            if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) == ETIMEDOUT && !*head) break;
        tmsg *m = *head;
        if (!m) {
            snprintf(t->err, sizeof t->err, "nothing came from rank %d within %g s%s", from,
                     w->timeout, w->dead ? " (the world is dead)" : "");
            s = MT_ERR_COMM;
        } else if (m->bytes != rb) {
            snprintf(t->err, sizeof t->err, "rank %d sent %zu bytes, %zu expected", from, m->bytes,
                     rb);
            s = MT_ERR_COMM;
        } else {
            memcpy(recv, m->data, rb);
            *head = m->next;
            free(m);
        }
    }
    pthread_mutex_unlock(&w->mu);
    return s;
}

static void fill_pairs(trank *t, void *recv, size_t count, mt_comm_dtype dt, int op, int root)
{
    (void)dt, (void)op, (void)root;
    for (int r = 0; r < t->w->n; r++)
        memcpy((char *)recv + (size_t)r * count, t->w->stage[r], count);
}

/* The ranks' (color, key) gathered; the group's first member makes its
 * world and leaves it in the parent's sub[first] for the others to take
 * after a second meeting. */
static mt_status t_split(void *self, int color, int key, void **out_self, int *out_rank,
                         int *out_size)
{
    trank *t = self;
    tcomm_world *w = t->w;
    int mine[2] = {color, key}, *all = calloc(2 * (size_t)w->n, sizeof *all);
    mt_status s = all ? collective(t, "split", mine, sizeof mine, all, sizeof mine, MT_COMM_BYTE, 0,
                                   0, fill_pairs)
                      : MT_ERR_OOM;
    int first = -1, me = 0, n = 0;
    for (int r = 0; !s && r < w->n; r++) { /* members by (key, rank): count those before me */
        if (all[2 * r] != color || color < 0) continue;
        n++;
        if (all[2 * r + 1] < key || (all[2 * r + 1] == key && r < t->rank)) me++;
        if (first < 0 || all[2 * r + 1] < all[2 * first + 1]) first = r;
    }
    free(all);
    if (!s && color >= 0 && me == 0) { /* (the first member by key: first == t->rank) */
        tcomm_world *nw = tcomm_world_new(n, w->timeout);
        nw->refs = n;
        pthread_mutex_lock(&w->mu);
        w->sub[t->rank] = nw;
        pthread_mutex_unlock(&w->mu);
    }
    if (!s) s = collective(t, "split", "", 0, NULL, 0, MT_COMM_BYTE, 0, 0, NULL);
    if (s || color < 0) return s;
    trank *nt = calloc(1, sizeof *nt);
    pthread_mutex_lock(&w->mu);
    nt->w = w->sub[first];
    pthread_mutex_unlock(&w->mu);
    nt->rank = me;
    *out_self = nt, *out_rank = me, *out_size = n;
    return MT_OK;
}

static const char *t_last_error(void *self) { return ((trank *)self)->err; }

static void t_destroy(void *self)
{
    trank *t = self;
    tcomm_world *w = t->w;
    int last = 0;
    if (w->refs) {
        pthread_mutex_lock(&w->mu);
        last = --w->refs == 0;
        pthread_mutex_unlock(&w->mu);
    }
    if (last) tcomm_world_free(w); /* (a split's world, its last member gone) */
    free(self);
}

mt_comm *tcomm_make(tcomm_world *w, int rank, int claimed_size, uint32_t caps)
{
    mt_comm_vtable vt = {
        .abi_version = MT_COMM_ABI_VERSION,
        .struct_size = sizeof vt,
        .name = "threads",
        .caps = caps | MT_COMM_CAP_BF16,
        .all_reduce = t_all_reduce,
        .reduce_scatter = t_reduce_scatter,
        .all_gather = t_all_gather,
        .broadcast = t_broadcast,
        .barrier = t_barrier,
        .last_error = t_last_error,
        .destroy = t_destroy,
        .sendrecv = t_sendrecv,
        .split = t_split,
    };
    trank *t = calloc(1, sizeof *t);
    t->w = w;
    t->rank = rank;
    mt_comm *c = NULL;
    if (mt_comm_create(&vt, t, rank, claimed_size, &c)) free(t);
    return c;
}

mt_status tcomm_context(mt_comm *c, mt_context **out)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.comm = c;
    return mt_context_create(&cc, out);
}

mt_context *tcomm_cuda_context(mt_comm *c)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CUDA;
    cc.cuda_driver_path = check_fake_cuda();
    cc.cublaslt_path = getenv("MT_FAKE_CUBLASLT"); /* for GEMMs (a trainer's steps) */
    cc.comm = c;
    mt_context *ctx = NULL;
    return mt_context_create(&cc, &ctx) ? NULL : ctx;
}

mt_comm *tcomm_nccl(tcomm_world *w, int rank, int n)
{
    mt_comm *boot = tcomm_make(w, rank, n, 0), *c = NULL;
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    nc.nccl_path = nc.cuda_driver_path = getenv("MT_FAKE_NCCL");
    nc.timeout_seconds = 30.0;
    nc.device_ordinal = rank; /* (one GPU per rank) */
    if (boot && mt_comm_nccl_create_over(&nc, boot, &c)) c = NULL;
    mt_comm_destroy(boot); /* (NCCL does not need it) */
    return c;
}

_Atomic int tcomm_fill_sum;

float tcomm_grad_of(int r, int i, size_t e)
{
    return (float)((int)((e * 7 + (size_t)i * 13 + (size_t)r * 29) % 41) - 20) / 1024.0f;
}

mt_status tcomm_fill_grads(mt_context *ctx, int param, size_t at, float *g, size_t n)
{
    float *h = malloc(n * sizeof *h + 1);
    if (!h) return MT_ERR_OOM;
    const int sum = ctx->world == 1 ? tcomm_fill_sum : 0;
    for (size_t e = 0; e < n; e++) {
        float v = 0.0f;
        for (int r = 0; r < (sum ? sum : 1); r++) v += tcomm_grad_of(sum ? r : ctx->rank, param, at + e);
        h[e] = v;
    }
    mt_status s = ctx->dev->copy_h2d(ctx->dev, g, h, n * sizeof *h);
    if (!s) s = ctx->dev->sync(ctx->dev);
    free(h);
    return s;
}

mt_status tcomm_gpt_rank(tcomm_world *w, int rank, int n, uint32_t caps, int channels,
                         tcomm_rank *out)
{
    *out = (tcomm_rank){tcomm_make(w, rank, n, caps), NULL, NULL};
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = 8, g.layers = 2, g.heads = 2;
    g.channels = channels;
    g.seed = 7;
    mt_status s = out->c ? tcomm_context(out->c, &out->ctx) : MT_ERR_COMM;
    return s ? s : mt_model_gpt_create(out->ctx, &g, &out->m);
}

void tcomm_rank_free(tcomm_rank *r)
{
    mt_model_destroy(r->m);
    mt_context_destroy(r->ctx);
    mt_comm_destroy(r->c);
    *r = (tcomm_rank){0};
}

typedef struct run_arg {
    void (*fn)(int, void *);
    void *arg;
    int rank;
} run_arg;

static void *run_one(void *p)
{
    run_arg *a = p;
    a->fn(a->rank, a->arg);
    return NULL;
}

void tcomm_run(int n, void (*fn)(int rank, void *arg), void *arg)
{
    pthread_t th[64];
    run_arg ra[64];
    for (int r = 0; r < n; r++) {
        ra[r] = (run_arg){fn, arg, r};
        pthread_create(&th[r], NULL, run_one, &ra[r]);
    }
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
}
