/*
 * test_comm.c - communicators: the table's checks, the collectives over the
 * in-process communicator (threads as ranks), timeouts, contexts on a
 * communicator, and NCCL over the stand-in libnccl (MT_FAKE_NCCL).
 */
#include <dlfcn.h>
#include <stddef.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "comm/comm.h"
#include "comm/cplan.h"
#include "comm/overlap.h"
#include "device/cuda_device.h"
#include "test_comm.h"
#include "tnccl.h"

static mt_status no_reduce(void *s, const void *a, void *b, size_t n, mt_comm_dtype d, mt_comm_op o,
                           void *st)
{
    (void)s, (void)a, (void)b, (void)n, (void)d, (void)o, (void)st;
    return MT_OK;
}
static mt_status no_gather(void *s, const void *a, void *b, size_t n, mt_comm_dtype d, void *st)
{
    (void)s, (void)a, (void)b, (void)n, (void)d, (void)st;
    return MT_OK;
}
static mt_status no_bcast(void *s, void *b, size_t n, mt_comm_dtype d, int root, void *st)
{
    (void)s, (void)b, (void)n, (void)d, (void)root, (void)st;
    return MT_OK;
}
static mt_status no_barrier(void *s)
{
    (void)s;
    return MT_OK;
}
static mt_status failing_barrier(void *s)
{
    (void)s;
    return MT_ERR_IO;
}

static mt_comm_vtable null_table(void)
{
    mt_comm_vtable vt = {.abi_version = MT_COMM_ABI_VERSION,
                         .struct_size = sizeof vt,
                         .name = "null",
                         .all_reduce = no_reduce,
                         .reduce_scatter = no_reduce,
                         .all_gather = no_gather,
                         .broadcast = no_bcast,
                         .barrier = no_barrier};
    return vt;
}

TEST(comm_table_checks)
{
    CHECK(strcmp(mt_status_string(MT_ERR_COMM), "communication failed") == 0);
    mt_comm *c = (mt_comm *)1;
    mt_comm_vtable vt = null_table();
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_create(NULL, NULL, 0, 1, &c));
    CHECK(c == NULL);
    vt.abi_version = 99;
    CHECK_ST(MT_ERR_VERSION, mt_comm_create(&vt, NULL, 0, 1, &c));
    vt = null_table();
    vt.barrier = NULL;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_create(&vt, NULL, 0, 1, &c));
    CHECK(strstr(mt_last_error(NULL), "barrier") != NULL);
    vt = null_table();
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_create(&vt, NULL, 2, 2, &c));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_create(&vt, NULL, 0, 0, &c));
    CHECK_OK(mt_comm_create(&vt, NULL, 1, 4, &c));
    CHECK_EQ(mt_comm_rank(c), 1);
    CHECK_EQ(mt_comm_size(c), 4);
    CHECK(strcmp(mt_comm_name(c), "null") == 0);
    float x[4] = {0};
    /* checked before the table: bytes are not reduced, bf16 needs the cap, roots in range */
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_all_reduce(c, x, x, 4, MT_COMM_BYTE, MT_COMM_SUM, NULL));
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_comm_all_reduce(c, x, x, 2, MT_COMM_BF16, MT_COMM_SUM, NULL));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_all_reduce(c, x, x, 4, MT_COMM_F32, (mt_comm_op)7, NULL));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_broadcast(c, x, 4, MT_COMM_F32, 4, NULL));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_all_gather(c, NULL, x, 1, MT_COMM_F32, NULL));
    /* buffers overlap only in place (rule 3): rank 1 of 4 */
    float y[16] = {0};
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_all_reduce(c, y, y + 1, 4, MT_COMM_F32, MT_COMM_SUM, NULL));
    CHECK(strstr(mt_last_error(NULL), "overlap") != NULL);
    CHECK_OK(mt_comm_all_reduce(c, y, y, 4, MT_COMM_F32, MT_COMM_SUM, NULL));
    CHECK_OK(mt_comm_all_reduce(c, y, y + 4, 4, MT_COMM_F32, MT_COMM_SUM, NULL));
    CHECK_OK(mt_comm_reduce_scatter(c, y, y + 4, 4, MT_COMM_F32, MT_COMM_SUM, NULL)); /* in place */
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_reduce_scatter(c, y, y, 4, MT_COMM_F32, MT_COMM_SUM, NULL));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_reduce_scatter(c, y, y + 12, 4, MT_COMM_F32, MT_COMM_SUM, NULL));
    CHECK_OK(mt_comm_all_gather(c, y + 4, y, 4, MT_COMM_F32, NULL)); /* in place */
    CHECK_OK(mt_comm_all_gather(c, (char *)y + 1, y, 1, MT_COMM_BYTE, NULL)); /* in place, bytes */
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_all_gather(c, y + 8, y, 4, MT_COMM_F32, NULL));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_all_gather(c, y, y, 4, MT_COMM_F32, NULL));
    CHECK_OK(mt_comm_all_gather(c, x, y, 4, MT_COMM_F32, NULL)); /* apart */
    CHECK(!mt_comm_broken(c));
    mt_comm_destroy(c);
    /* NULL: a world of one */
    CHECK_EQ(mt_comm_rank(NULL), 0);
    CHECK_EQ(mt_comm_size(NULL), 1);
    mt_comm_destroy(NULL);
}

TEST(comm_failure_breaks)
{
    mt_comm_vtable vt = null_table();
    vt.barrier = failing_barrier;
    mt_comm *c = NULL;
    CHECK_OK(mt_comm_create(&vt, NULL, 0, 2, &c));
    float x = 1.0f;
    CHECK_OK(mt_comm_all_reduce(c, &x, &x, 1, MT_COMM_F32, MT_COMM_SUM, NULL));
    /* any failure of the table is MT_ERR_COMM, and breaks the communicator */
    CHECK_ST(MT_ERR_COMM, mt_comm_barrier(c));
    CHECK(strstr(mt_last_error(NULL), "mt_comm_barrier") != NULL);
    CHECK(mt_comm_broken(c));
    CHECK_ST(MT_ERR_COMM, mt_comm_all_reduce(c, &x, &x, 1, MT_COMM_F32, MT_COMM_SUM, NULL));
    CHECK(strstr(mt_last_error(NULL), "broken") != NULL);
    mt_comm_destroy(c);
}

/* A collective that timed out may still write its buffer when its peer
 * comes late (MPI cannot cancel one): a context whose communicator broke
 * keeps the staging buffer's memory past mt_context_destroy
 * (docs/distributed.md), so the late write lands in memory no one uses,
 * never in unmapped pages or another owner's. The table here plays two
 * ranks that agree, then times out an all-gather and remembers its buffer. */
static _Atomic int late_armed;
static void *late_buf;
static size_t late_bytes;
static mt_status late_gather(void *s, const void *a, void *b, size_t n, mt_comm_dtype d, void *st)
{
    (void)s, (void)st;
    const size_t es = d == MT_COMM_F32 ? 4 : d == MT_COMM_BF16 ? 2 : 1;
    if (late_armed) {
        late_buf = b, late_bytes = 2 * n * es;
        return MT_ERR_COMM;
    }
    for (int r = 0; r < 2; r++)
        if ((char *)b + (size_t)r * n * es != a) memmove((char *)b + (size_t)r * n * es, a, n * es);
    return MT_OK;
}

/* A communicator of 2 ranks (this one rank 0) over vt, and a CPU
 * context's configuration on it. */
static void table_context_config(const mt_comm_vtable *vt, mt_comm **c, mt_context_config *cc)
{
    CHECK_OK(mt_comm_create(vt, NULL, 0, 2, c));
    mt_context_config_init(cc);
    cc->device = MT_DEVICE_CPU;
    cc->threads = 1;
    cc->comm = *c;
}

TEST(comm_timed_out_staging_outlives_context)
{
    mt_comm_vtable vt = null_table();
    vt.all_gather = late_gather;
    mt_comm *c = NULL;
    mt_context_config cc;
    table_context_config(&vt, &c, &cc);
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_mlp_spec ms;
    mt_mlp_spec_init(&ms);
    ms.n_layers = 1, ms.dims[0] = 4, ms.dims[1] = 3;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 2;
    CHECK_OK(mt_context_create(&cc, &ctx));
    CHECK_OK(mt_model_mlp_create(ctx, &ms, &m));
    CHECK_OK(mt_trainer_create(m, &tc, &t));
    float x[8] = {0};
    int32_t y[2] = {0, 1};
    mt_batch b = {.n = 2, .inputs = x, .targets = y};
    late_armed = 1;
    CHECK_ST(MT_ERR_COMM, mt_trainer_step(t, &b, NULL));
    late_armed = 0;
    CHECK(mt_comm_broken(c) && late_buf != NULL);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    CHECK_OK(mt_context_destroy(ctx));
    /* the late completion: its pages still mapped, then written */
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = (uintptr_t)late_buf & ~(pg - 1);
    const size_t span = (size_t)((uintptr_t)late_buf + late_bytes - lo);
    unsigned char vec[64];
    const bool mapped = span <= 64 * pg && mincore((void *)lo, span, vec) == 0;
    CHECK_MSG(mapped, "the staging buffer %p was given back while a collective may write it",
              late_buf);
    if (mapped) memset(late_buf, 0x5a, late_bytes);
    mt_comm_destroy(c);
}

/* ---- the collectives over threads ---- */

typedef struct coll_arg {
    tcomm_world *w;
    int n;
    _Atomic int bad;
} coll_arg;

static void collectives_rank(int rank, void *p)
{
    coll_arg *a = p;
    const int n = a->n;
    mt_comm *c = tcomm_make(a->w, rank, n, 0);
    RANK_EXPECT(c != NULL);
    if (!c) return;
    float v[6], out[6 * 8];
    for (int i = 0; i < 6; i++) v[i] = (float)(rank * 10 + i);
    RANK_EXPECT(!mt_comm_all_reduce(c, v, out, 6, MT_COMM_F32, MT_COMM_SUM, NULL));
    for (int i = 0; i < 6; i++) RANK_EXPECT(out[i] == (float)(10 * n * (n - 1) / 2 + n * i));
    RANK_EXPECT(!mt_comm_all_reduce(c, v, v, 6, MT_COMM_F32, MT_COMM_MAX, NULL)); /* in place */
    for (int i = 0; i < 6; i++) RANK_EXPECT(v[i] == (float)(10 * (n - 1) + i));
    /* reduce-scatter: 2 elements per rank */
    float rs[2 * 8], mine[2];
    for (int i = 0; i < 2 * n; i++) rs[i] = (float)(i + rank);
    RANK_EXPECT(!mt_comm_reduce_scatter(c, rs, mine, 2, MT_COMM_F32, MT_COMM_SUM, NULL));
    for (int j = 0; j < 2; j++)
        RANK_EXPECT(mine[j] == (float)(n * (2 * rank + j) + n * (n - 1) / 2));
    /* all-gather of bytes, in place */
    unsigned char g[3 * 8];
    memset(g, 0xee, sizeof g);
    for (int j = 0; j < 3; j++) g[3 * rank + j] = (unsigned char)(rank * 3 + j);
    RANK_EXPECT(!mt_comm_all_gather(c, g + 3 * rank, g, 3, MT_COMM_BYTE, NULL));
    for (int i = 0; i < 3 * n; i++) RANK_EXPECT(g[i] == (unsigned char)i);
    /* broadcast from the last rank */
    int32_t b[2] = {rank, -rank};
    RANK_EXPECT(!mt_comm_broadcast(c, b, sizeof b, MT_COMM_BYTE, n - 1, NULL));
    RANK_EXPECT(b[0] == n - 1 && b[1] == 1 - n);
    RANK_EXPECT(!mt_comm_barrier(c));
    mt_comm_destroy(c);
    (void)out;
}

TEST(comm_threads_collectives)
{
    for (int n = 1; n <= 3; n++) {
        coll_arg a = {.w = tcomm_world_new(n, 10.0), .n = n};
        tcomm_run(n, collectives_rank, &a);
        tcomm_world_free(a.w);
        CHECK_MSG(!a.bad, "collectives over %d ranks", n);
    }
}

/* A rank that never joins: the others get MT_ERR_COMM at the timeout, and
 * the communicator refuses every later call at once. */
static void stall_rank(int rank, void *p)
{
    coll_arg *a = p;
    mt_comm *c = tcomm_make(a->w, rank, 2, 0);
    RANK_EXPECT(c != NULL);
    if (rank == 0) {
        float x = 1.0f;
        RANK_EXPECT(mt_comm_all_reduce(c, &x, &x, 1, MT_COMM_F32, MT_COMM_SUM, NULL) == MT_ERR_COMM);
        RANK_EXPECT(strstr(mt_last_error(NULL), "did not join") != NULL);
        RANK_EXPECT(mt_comm_broken(c));
        RANK_EXPECT(mt_comm_barrier(c) == MT_ERR_COMM);
        /* a later call names the first failure: the call, the rank, the table's word */
        const char *e = mt_last_error(NULL);
        RANK_EXPECT(strstr(e, "mt_comm_barrier: the communicator is broken by an earlier failure") &&
                    strstr(e, "mt_comm_all_reduce (") && strstr(e, "rank 0 of 2") &&
                    strstr(e, "did not join"));
    }
    mt_comm_destroy(c);
}

/* Runs fn on n threads as the ranks of a world with that timeout: whether
 * every rank's expectations held. */
static bool ranks_pass(int n, double timeout, void (*fn)(int rank, void *arg))
{
    coll_arg a = {.w = tcomm_world_new(n, timeout), .n = n};
    tcomm_run(n, fn, &a);
    tcomm_world_free(a.w);
    return !a.bad;
}

TEST(comm_threads_timeout) { CHECK(ranks_pass(2, 0.2, stall_rank)); }

/* ---- point to point ---- */

/* A ring of sendrecv (each rank to the next, from the previous, at once),
 * ordered send/recv pairs, and the refusals, over the in-process world. */
static void p2p_rank(int rank, void *p)
{
    coll_arg *a = p;
    const int n = a->n, next = (rank + 1) % n, prev = (rank + n - 1) % n;
    mt_comm *c = tcomm_make(a->w, rank, n, 0);
    RANK_EXPECT(c != NULL && mt_comm_has_p2p(c));
    float out[5], in[5];
    for (int i = 0; i < 5; i++) out[i] = (float)(rank * 10 + i);
    RANK_EXPECT(!mt_comm_sendrecv(c, out, 5, next, in, 5, prev, MT_COMM_F32, NULL));
    for (int i = 0; i < 5; i++) RANK_EXPECT(in[i] == (float)(prev * 10 + i));
    /* two sends then two receives per direction: received in order */
    int32_t x[2] = {rank, 1}, y[2] = {rank, 2}, g1[2], g2[2];
    RANK_EXPECT(!mt_comm_send(c, x, sizeof x, MT_COMM_BYTE, next, NULL));
    RANK_EXPECT(!mt_comm_send(c, y, sizeof y, MT_COMM_BYTE, next, NULL));
    RANK_EXPECT(!mt_comm_recv(c, g1, sizeof g1, MT_COMM_BYTE, prev, NULL));
    RANK_EXPECT(!mt_comm_recv(c, g2, sizeof g2, MT_COMM_BYTE, prev, NULL));
    RANK_EXPECT(g1[0] == prev && g1[1] == 1 && g2[0] == prev && g2[1] == 2);
    /* refused before anything moves */
    RANK_EXPECT(mt_comm_send(c, out, 1, MT_COMM_F32, rank, NULL) == MT_ERR_INVALID_ARG);
    RANK_EXPECT(strstr(mt_last_error(NULL), "this rank itself") != NULL);
    RANK_EXPECT(mt_comm_recv(c, in, 1, MT_COMM_F32, n, NULL) == MT_ERR_INVALID_ARG);
    RANK_EXPECT(mt_comm_send(c, out, 1, MT_COMM_F32, -1, NULL) == MT_ERR_INVALID_ARG);
    RANK_EXPECT(mt_comm_sendrecv(c, out, 4, next, out + 2, 4, prev, MT_COMM_F32, NULL) ==
                MT_ERR_INVALID_ARG);
    RANK_EXPECT(mt_comm_send(c, NULL, 3, MT_COMM_F32, next, NULL) == MT_ERR_INVALID_ARG);
    RANK_EXPECT(!mt_comm_send(c, out, 0, MT_COMM_F32, -1, NULL)); /* (nothing) */
    RANK_EXPECT(!mt_comm_broken(c));
    RANK_EXPECT(!mt_comm_barrier(c));
    mt_comm_destroy(c);
}

/* A rank that never sends: the receive is MT_ERR_COMM at the timeout naming
 * it, and breaks the communicator; a message of another length too. */
static void p2p_stall_rank(int rank, void *p)
{
    coll_arg *a = p;
    mt_comm *c = tcomm_make(a->w, rank, 2, 0);
    RANK_EXPECT(c != NULL);
    if (rank == 0) {
        float x;
        RANK_EXPECT(mt_comm_recv(c, &x, 1, MT_COMM_F32, 1, NULL) == MT_ERR_COMM);
        RANK_EXPECT(strstr(mt_last_error(NULL), "mt_comm_recv") &&
                    strstr(mt_last_error(NULL), "from rank 1"));
        RANK_EXPECT(mt_comm_broken(c));
    }
    mt_comm_destroy(c);
}

static void p2p_length_rank(int rank, void *p)
{
    coll_arg *a = p;
    mt_comm *c = tcomm_make(a->w, rank, 2, 0);
    float v[4] = {0};
    if (rank == 1) RANK_EXPECT(!mt_comm_send(c, v, 4, MT_COMM_F32, 0, NULL));
    if (rank == 0) {
        RANK_EXPECT(mt_comm_recv(c, v, 3, MT_COMM_F32, 1, NULL) == MT_ERR_COMM);
        RANK_EXPECT(strstr(mt_last_error(NULL), "16 bytes, 12 expected") != NULL);
    }
    mt_comm_destroy(c);
}

/* The NCCL communicator's point to point over the stand-in libnccl: a ring
 * of sendrecv in one group, and a peer that never sends (its receive
 * MT_ERR_COMM at the deadline, naming the peer). */
static double p2p_nccl_timeout;

static mt_comm *p2p_nccl(tcomm_world *w, int rank, int n)
{
    mt_comm *boot = tcomm_make(w, rank, n, 0), *c = NULL;
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    nc.nccl_path = nc.cuda_driver_path = getenv("MT_FAKE_NCCL");
    nc.timeout_seconds = p2p_nccl_timeout;
    nc.device_ordinal = rank; /* (one GPU per rank) */
    if (boot && mt_comm_nccl_create_over(&nc, boot, &c)) c = NULL;
    mt_comm_destroy(boot);
    return c;
}

static void p2p_nccl_rank(int rank, void *p)
{
    coll_arg *a = p;
    const int n = a->n, next = (rank + 1) % n, prev = (rank + n - 1) % n;
    mt_comm *c = p2p_nccl(a->w, rank, n);
    RANK_EXPECT(c != NULL && mt_comm_has_p2p(c));
    if (!c) return;
    float out[7], in[7];
    for (int i = 0; i < 7; i++) out[i] = (float)(rank * 100 + i);
    if (p2p_nccl_timeout > 1.0) {
        RANK_EXPECT(!mt_comm_sendrecv(c, out, 7, next, in, 7, prev, MT_COMM_F32, NULL));
        for (int i = 0; i < 7; i++) RANK_EXPECT(in[i] == (float)(prev * 100 + i));
        uint16_t h[3] = {(uint16_t)rank, 2, 3}, g[3];
        if (rank == 0) RANK_EXPECT(!mt_comm_send(c, h, 3, MT_COMM_BF16, 1, NULL));
        if (rank == 1) {
            RANK_EXPECT(!mt_comm_recv(c, g, 3, MT_COMM_BF16, 0, NULL));
            RANK_EXPECT(g[0] == 0 && g[2] == 3);
        }
        RANK_EXPECT(!mt_comm_barrier(c));
    } else if (rank == 0) { /* rank 1 sends nothing */
        RANK_EXPECT(mt_comm_recv(c, in, 7, MT_COMM_F32, 1, NULL) == MT_ERR_COMM);
        RANK_EXPECT(strstr(mt_last_error(NULL), "ncclRecv from rank 1") != NULL);
        RANK_EXPECT(mt_comm_broken(c));
    }
    mt_comm_destroy(c);
}

/* ncclCommSplit over the stand-in: 4 ranks by parity (and 3, the last in
 * none), each group summing, exchanging and splitting on its own. */
static void split_nccl_rank(int rank, void *p)
{
    coll_arg *a = p;
    p2p_nccl_timeout = 30.0;
    mt_comm *c = p2p_nccl(a->w, rank, a->n), *g = NULL;
    RANK_EXPECT(c != NULL);
    if (!c) return;
    const int even = a->n - a->n % 2, color = rank >= even ? -1 : rank % 2;
    RANK_EXPECT(!mt_comm_split(c, color, -rank, &g));
    RANK_EXPECT((g == NULL) == (color < 0));
    if (g) {
        int higher = 0;
        for (int r = rank + 2; r < even; r += 2) higher++;
        RANK_EXPECT(mt_comm_size(g) == even / 2 && mt_comm_rank(g) == higher);
        RANK_EXPECT(strcmp(mt_comm_name(g), "nccl") == 0);
        float v = (float)rank, want = 0.0f;
        for (int r = color; r < even; r += 2) want += (float)r;
        RANK_EXPECT(!mt_comm_all_reduce(g, &v, &v, 1, MT_COMM_F32, MT_COMM_SUM, NULL) && v == want);
        const int n = mt_comm_size(g), gr = mt_comm_rank(g);
        float out = (float)rank, in = -1.0f;
        RANK_EXPECT(!mt_comm_sendrecv(g, &out, 1, (gr + 1) % n, &in, 1, (gr + n - 1) % n,
                                      MT_COMM_F32, NULL));
        RANK_EXPECT((int)in % 2 == color && (int)in != rank);
    }
    RANK_EXPECT(!mt_comm_barrier(c));
    mt_comm_destroy(g);
    mt_comm_destroy(c);
}

TEST(comm_nccl_point_to_point)
{
    const char *fake = getenv("MT_FAKE_NCCL");
    if (!fake || !*fake) {
        fprintf(stderr, "    (skipped: MT_FAKE_NCCL is not set)\n");
        return;
    }
    p2p_nccl_timeout = 30.0;
    for (int n = 2; n <= 3; n++) CHECK_MSG(ranks_pass(n, 30.0, p2p_nccl_rank), "%d ranks", n);
    p2p_nccl_timeout = 0.3;
    CHECK(ranks_pass(2, 30.0, p2p_nccl_rank));
}

TEST(comm_nccl_split)
{
    const char *fake = getenv("MT_FAKE_NCCL");
    if (!fake || !*fake) {
        fprintf(stderr, "    (skipped: MT_FAKE_NCCL is not set)\n");
        return;
    }
    for (int n = 4; n <= 5; n++) CHECK_MSG(ranks_pass(n, 30.0, split_nccl_rank), "%d ranks", n);
}

/* Sub-communicators over the in-process world: 4 ranks into 2 by parity,
 * ranked by a key that reverses them, each summing and exchanging on its
 * own; a rank with color -1 joins none; a table without split is refused. */
static void split_rank(int rank, void *p)
{
    coll_arg *a = p;
    mt_comm *c = tcomm_make(a->w, rank, a->n, 0), *g = NULL, *none = (mt_comm *)1;
    const int color = rank == a->n - 1 && a->n % 2 ? -1 : rank % 2;
    RANK_EXPECT(!mt_comm_split(c, color, -rank, &g));
    if (color < 0) {
        RANK_EXPECT(g == NULL);
    } else {
        const int n = (a->n - (a->n % 2)) / 2; /* (the odd last rank sits out) */
        RANK_EXPECT(g && mt_comm_size(g) == n);
        /* ranked by key -rank: the highest rank of the color first */
        int higher = 0;
        for (int r = rank + 2; r < a->n - (a->n % 2); r += 2) higher++;
        RANK_EXPECT(mt_comm_rank(g) == higher);
        float v = (float)rank;
        RANK_EXPECT(!mt_comm_all_reduce(g, &v, &v, 1, MT_COMM_F32, MT_COMM_SUM, NULL));
        float want = 0.0f;
        for (int r = color; r < a->n - (a->n % 2); r += 2) want += (float)r;
        RANK_EXPECT(v == want);
        if (n > 1) { /* a ring inside the group */
            const int gr = mt_comm_rank(g);
            int out = rank, in = -1;
            RANK_EXPECT(!mt_comm_sendrecv(g, &out, 1, (gr + 1) % n, &in, 1, (gr + n - 1) % n,
                                          MT_COMM_F32, NULL));
            RANK_EXPECT(in >= 0 && in % 2 == color);
        }
    }
    RANK_EXPECT(mt_comm_split(c, -2, 0, &none) == MT_ERR_INVALID_ARG && none == NULL);
    RANK_EXPECT(!mt_comm_barrier(c)); /* (the parent goes on) */
    mt_comm_destroy(c); /* (before the sub-communicator: each on its own) */
    mt_comm_destroy(g);
}

TEST(comm_split)
{
    for (int n = 3; n <= 4; n++) CHECK_MSG(ranks_pass(n, 10.0, split_rank), "%d ranks", n);
    mt_comm_vtable vt = null_table();
    mt_comm *c = NULL, *g = (mt_comm *)1;
    CHECK_OK(mt_comm_create(&vt, NULL, 0, 2, &c));
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_comm_split(c, 0, 0, &g));
    CHECK(g == NULL && strstr(mt_last_error(NULL), "no split"));
    mt_comm_destroy(c);
}

TEST(comm_point_to_point)
{
    for (int n = 2; n <= 3; n++) CHECK_MSG(ranks_pass(n, 10.0, p2p_rank), "%d ranks", n);
    CHECK(ranks_pass(2, 0.2, p2p_stall_rank));
    CHECK(ranks_pass(2, 10.0, p2p_length_rank));
    /* a version-1 table (without sendrecv) is taken, and has no point to point */
    mt_comm_vtable vt = null_table();
    vt.abi_version = 1;
    vt.struct_size = (uint32_t)offsetof(mt_comm_vtable, sendrecv);
    vt.sendrecv = (mt_status (*)(void *, const void *, size_t, int, void *, size_t, int,
                                 mt_comm_dtype, void *))1; /* (past a v1 table's end: unread) */
    mt_comm *c = NULL;
    CHECK_OK(mt_comm_create(&vt, NULL, 0, 2, &c));
    CHECK(!mt_comm_has_p2p(c));
    float x = 0.0f;
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_comm_send(c, &x, 1, MT_COMM_F32, 1, NULL));
    CHECK(strstr(mt_last_error(NULL), "no point-to-point") != NULL);
    CHECK(!mt_comm_broken(c));
    mt_comm_destroy(c);
    /* a version-2 size with version 1, and the other way round: refused */
    vt.struct_size = sizeof vt;
    CHECK_ST(MT_ERR_VERSION, mt_comm_create(&vt, NULL, 0, 2, &c));
    vt = null_table();
    vt.struct_size = (uint32_t)offsetof(mt_comm_vtable, sendrecv);
    CHECK_ST(MT_ERR_VERSION, mt_comm_create(&vt, NULL, 0, 2, &c));
}

/* ---- contexts on a communicator ---- */

/* ---- the communication thread's one queue ---- */

/* A rank's record of what its communication thread ran, in order. */
typedef struct queue_log {
    mt_context *ctx;
    int rank, fail_at; /* the job fails (without a collective) on tensor fail_at */
    int break_at;      /* and breaks the communicator on tensor break_at */
    int ran[16], n;
    int bad;
} queue_log;

/* Each entry makes a collective whose sum says which entry every rank ran:
 * mismatched orders give a wrong sum. */
static mt_status queue_sum(queue_log *l, int what)
{
    float v = (float)(what * (l->rank + 1));
    mt_status s = mti_comm_all_reduce(l->ctx, "a queued entry", &v, &v, 1, MT_COMM_F32, MT_COMM_SUM);
    if (!s && v != (float)(3 * what)) l->bad = 1; /* (2 ranks: 1 + 2) */
    l->ran[l->n++] = what;
    return s;
}

static mt_status queue_job(void *user, int i, float *g)
{
    queue_log *l = user;
    if (g[0] != (float)i) l->bad = 1;
    if (i == l->fail_at) return mti_fail(l->ctx, MT_ERR_INTERNAL, "tensor %d fails on purpose", i);
    if (i == l->break_at) {
        atomic_store(&l->ctx->cfg.comm->broken, 1);
        return mti_fail(l->ctx, MT_ERR_COMM, "tensor %d breaks the communicator on purpose", i);
    }
    return queue_sum(l, 10 + i);
}

static mt_status queue_call(void *user, int i) { return queue_sum(user, 100 + i); }

static void queue_rank(int rank, void *p)
{
    coll_arg *a = p;
    mt_comm *c = tcomm_make(a->w, rank, 2, MT_COMM_CAP_THREADS);
    mt_context *ctx = NULL;
    RANK_EXPECT(c && !tcomm_context(c, &ctx));
    if (!ctx) return;
    const size_t numel[4] = {1, 1, 1, 1};
    float g[4] = {0, 1, 2, 3};
    queue_log l = {.ctx = ctx, .rank = rank, .fail_at = -1, .break_at = -1};
    mti_overlap *ov = NULL;
    RANK_EXPECT(!mti_overlap_new(ctx, 4, numel, queue_job, &l, false, &ov));
    if (!ov) return;
    RANK_EXPECT(ctx->comm->threads_q == ov);
    /* tensor 2 first: it waits for 3 (the fixed order, last first); a call
       queued meanwhile goes ahead of both; timing differs by rank */
    mti_overlap_begin(ov);
    uint64_t t1 = 0;
    RANK_EXPECT(!mti_overlap_push(ov, 2, "t2", &g[2]));
    RANK_EXPECT(!mti_overlap_call(ov, queue_call, &l, 1, &t1));
    if (rank) usleep(20000);
    RANK_EXPECT(!mti_overlap_push(ov, 3, "t3", &g[3]));
    RANK_EXPECT(!mti_overlap_push(ov, 1, "t1", &g[1]));
    /* a collective of this thread waits for everything queued */
    float v = 1.0f;
    RANK_EXPECT(!mti_comm_all_reduce(ctx, "the stepping thread's", &v, &v, 1, MT_COMM_F32, MT_COMM_SUM));
    RANK_EXPECT(v == 2.0f && l.n == 4);
    RANK_EXPECT(!mti_overlap_push(ov, 0, "t0", &g[0]));
    RANK_EXPECT(!mti_overlap_wait(ov));
    const int want[5] = {101, 13, 12, 11, 10};
    RANK_EXPECT(l.n == 5 && !memcmp(l.ran, want, sizeof want));
    RANK_EXPECT(!mti_overlap_done(ov, t1));
    /* a failure of this rank alone (the communicator whole) is held: what
       was queued after it still runs, the waits report nothing, the
       stepping thread's collectives go on, and the status exchange takes
       it (mti_overlaps_take), once */
    l.n = 0;
    l.fail_at = 2;
    mti_overlap_begin(ov);
    uint64_t t2 = 0;
    for (int i = 3; i >= 0; i--) RANK_EXPECT(!mti_overlap_push(ov, i, "t", &g[i]));
    RANK_EXPECT(!mti_overlap_call(ov, queue_call, &l, 2, &t2));
    RANK_EXPECT(!mti_overlap_done(ov, t2));
    RANK_EXPECT(!mti_overlap_wait(ov));
    v = 1.0f;
    RANK_EXPECT(!mti_comm_all_reduce(ctx, "the checks", &v, &v, 1, MT_COMM_F32, MT_COMM_SUM) && v == 2.0f);
    const int held[4] = {13, 11, 10, 102};
    RANK_EXPECT(l.n == 4 && !memcmp(l.ran, held, sizeof held));
    RANK_EXPECT(mti_overlaps_take(ctx) == MT_ERR_INTERNAL);
    RANK_EXPECT(strstr(mt_last_error(ctx), "on the communication thread: tensor 2 fails on purpose"));
    RANK_EXPECT(!mti_overlaps_take(ctx));
    /* a failure that breaks the communicator: what was queued after it is
       dropped (its collectives never made), and so is the stepping
       thread's next collective, until reset (then they fail at once) */
    l.n = 0;
    l.fail_at = -1;
    l.break_at = 2;
    mti_overlap_begin(ov);
    for (int i = 3; i >= 0; i--) RANK_EXPECT(!mti_overlap_push(ov, i, "t", &g[i]));
    RANK_EXPECT(!mti_overlap_call(ov, queue_call, &l, 2, &t2));
    RANK_EXPECT(mti_overlap_done(ov, t2) == MT_ERR_COMM);
    RANK_EXPECT(strstr(mt_last_error(ctx), "tensor 2 breaks the communicator on purpose") != NULL);
    RANK_EXPECT(mti_overlap_wait(ov) == MT_ERR_COMM);
    RANK_EXPECT(mti_comm_all_reduce(ctx, "the checks", &v, &v, 1, MT_COMM_F32, MT_COMM_SUM) ==
                MT_ERR_COMM);
    RANK_EXPECT(strstr(mt_last_error(ctx), "the checks: an earlier collective") != NULL);
    RANK_EXPECT(l.n == 1 && l.ran[0] == 13);
    RANK_EXPECT(!mti_overlaps_take(ctx)); /* (nothing held) */
    RANK_EXPECT(!mti_overlap_quiet(ov, true, NULL));
    RANK_EXPECT(mti_comm_all_reduce(ctx, "after", &v, &v, 1, MT_COMM_F32, MT_COMM_SUM) == MT_ERR_COMM);
    RANK_EXPECT(strstr(mt_last_error(ctx), "broken") != NULL);
    RANK_EXPECT(!l.bad);
    mti_overlap_free(ov);
    RANK_EXPECT(ctx->comm->threads_q == NULL);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

/* Gradients given out of the fixed order and calls queued in between run
 * in one order on every rank; the stepping thread's collectives wait for
 * the queue; a failure of the rank alone is held for the status exchange,
 * one that breaks the communicator drops what follows it until reset. */
TEST(comm_queue_one_order) { CHECK(ranks_pass(2, 10.0, queue_rank)); }

typedef struct ctx_arg {
    tcomm_world *w;
    int sizes[4];       /* the size each rank claims */
    uint32_t caps;
    mt_status want;
    const char *msg;    /* a part of the message every rank must get */
    _Atomic int bad;
} ctx_arg;

static void context_rank(int rank, void *p)
{
    ctx_arg *a = p;
    mt_comm *c = tcomm_make(a->w, rank, a->sizes[rank], a->caps);
    if (!c) {
        a->bad = 1;
        return;
    }
    mt_context *ctx = NULL;
    mt_status s = tcomm_context(c, &ctx);
    if (s != a->want || (a->msg && !strstr(mt_last_error(NULL), a->msg))) {
        fprintf(stderr, "    rank %d: %s: %s\n", rank, mt_status_string(s), mt_last_error(NULL));
        a->bad = 1;
    }
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(comm_context_agree)
{
    /* ranks that agree */
    ctx_arg a = {.w = tcomm_world_new(2, 10.0), .sizes = {2, 2}, .want = MT_OK};
    tcomm_run(2, context_rank, &a);
    tcomm_world_free(a.w);
    CHECK(!a.bad);
    /* ranks that disagree on the world size: an error on every rank */
    ctx_arg b = {.w = tcomm_world_new(2, 10.0),
                 .sizes = {2, 3},
                 .want = MT_ERR_COMM,
                 .msg = "the ranks disagree on the world size: rank 0 2, rank 1 3"};
    tcomm_run(2, context_rank, &b);
    tcomm_world_free(b.w);
    CHECK(!b.bad);
    /* a device communicator on a CPU context */
    ctx_arg d = {.w = tcomm_world_new(1, 10.0),
                 .sizes = {1},
                 .caps = MT_COMM_CAP_DEVICE,
                 .want = MT_ERR_UNSUPPORTED,
                 .msg = "host communicator"};
    tcomm_run(1, context_rank, &d);
    tcomm_world_free(d.w);
    CHECK(!d.bad);
}

/* A dry context (estimates) communicates nothing, whatever the config says. */
TEST(comm_dry_context_ignores_comm)
{
    mt_comm_vtable vt = null_table();
    vt.barrier = failing_barrier;
    mt_comm *c = NULL;
    mt_context_config cc;
    table_context_config(&vt, &c, &cc);
    cc.dry_run = 1;
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cc, &ctx));
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

/* ---- NCCL over the stand-in ---- */

static const char *fake_nccl(void)
{
    const char *v = getenv("MT_FAKE_NCCL");
    return v && *v ? v : NULL;
}

TEST(comm_nccl_load_errors)
{
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    CHECK(nc.timeout_seconds == 600.0);
    nc.nccl_path = "/nonexistent/libnccl.so.2";
    mt_nccl_id id;
    CHECK_ST(MT_ERR_NO_DEVICE, mt_nccl_unique_id(&nc, &id));
    CHECK(strstr(mt_last_error(NULL), "/nonexistent/libnccl.so.2") != NULL);
    nc.timeout_seconds = 0.0;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_nccl_unique_id(&nc, &id));
    mt_comm *c = NULL;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_nccl_create(NULL, NULL, 0, 1, &c));
    if (!fake_nccl()) return;
    /* a driver without the functions the deadline needs */
    mt_nccl_config_init(&nc);
    nc.nccl_path = fake_nccl();
    nc.cuda_driver_path = "libm.so.6";
    CHECK_ST(MT_ERR_NO_DEVICE, mt_nccl_unique_id(&nc, &id));
    CHECK(strstr(mt_last_error(NULL), "cuStreamQuery") != NULL);
}

/* Where NCCL is looked for without a path: the soname, the toolkit, then
 * PyTorch's wheel; MT_NCCL_PATH names it outright. */
TEST(comm_nccl_search)
{
    char tmp[] = "/tmp/mt_nccl_XXXXXX", p[600], want[600];
    CHECK(mkdtemp(tmp) != NULL);
    snprintf(p, sizeof p, "mkdir -p '%s/venv/bin' '%s/venv/lib/python3.12/site-packages/nvidia/nccl/lib' "
                          "&& touch '%s/venv/bin/python3' && chmod +x '%s/venv/bin/python3'",
             tmp, tmp, tmp, tmp);
    CHECK(system(p) == 0);
    static char c[MTI_LT_CANDIDATES][MTI_LT_PATH];
    size_t n = check_search_in(tmp, mti_nccl_candidates, c, MTI_LT_CANDIDATES);
    long soname = check_find_path(c, n, "libnccl.so.2");
    snprintf(want, sizeof want, "%s/cuda/lib64/libnccl.so.2", tmp);
    long home = check_find_path(c, n, want);
    long dflt = check_find_path(c, n, "/usr/local/cuda/lib64/libnccl.so.2");
    snprintf(want, sizeof want, "%s/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", tmp);
    long wheel = check_find_path(c, n, want);
    CHECK_MSG(soname == 0 && home > soname && dflt > home && wheel > dflt,
              "order: soname %ld, CUDA_HOME %ld, default %ld, wheel %ld of %zu", soname, home, dflt,
              wheel, n);
    snprintf(p, sizeof p, "rm -rf '%s'", tmp);
    CHECK(system(p) == 0);
    /* MT_NCCL_PATH, when the config names none */
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    mt_nccl_id id;
    setenv("MT_NCCL_PATH", "/nonexistent/nccl-from-env.so", 1);
    CHECK_ST(MT_ERR_NO_DEVICE, mt_nccl_unique_id(&nc, &id));
    CHECK(strstr(mt_last_error(NULL), "/nonexistent/nccl-from-env.so") != NULL);
    if (fake_nccl()) {
        setenv("MT_NCCL_PATH", fake_nccl(), 1);
        nc.cuda_driver_path = fake_nccl();
        CHECK_OK(mt_nccl_unique_id(&nc, &id));
    }
    unsetenv("MT_NCCL_PATH");
}

typedef struct nccl_arg {
    tcomm_world *w;
    int n;
    double timeout;
    int stall;   /* rank 1 leaves before the second collective */
    int context; /* a CUDA context on the communicator: its COMM buffers */
    _Atomic int bad;
} nccl_arg;

/* A CUDA context of a device communicator holds its record buffer, as its
 * estimate says; with a host communicator nothing is in COMM (the host
 * staging is not the device's memory). */
static void nccl_context(nccl_arg *a, int rank, mt_comm *c)
{
    mt_context *ctx = tcomm_cuda_context(c);
    RANK_EXPECT(ctx != NULL);
    if (!ctx) return;
    mt_memory_stats ms;
    mt_context_memory_stats(ctx, &ms);
    RANK_EXPECT(ms.per_class[MT_MEM_COMM].live_bytes == (uint64_t)a->n * MTI_COMM_RECORD);
    /* records past the buffer's 256 bytes per rank go in pieces */
    unsigned char rec[600], all[3 * 600];
    memset(rec, mt_comm_rank(c) + 1, sizeof rec);
    RANK_EXPECT(!mti_comm_host_gather(ctx, "test", rec, all, sizeof rec));
    for (int r = 0; r < a->n; r++)
        for (size_t i = 0; i < sizeof rec; i += 37) RANK_EXPECT(all[r * sizeof rec + i] == r + 1);
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 64, g.max_seq = 8, g.layers = 1, g.heads = 2, g.channels = 16;
    mt_model *m = NULL;
    mt_estimate_report e;
    RANK_EXPECT(!mt_model_gpt_create(ctx, &g, &m));
    RANK_EXPECT(m && !mt_estimate_model(m, NULL, &e));
    RANK_EXPECT(e.class_peak[MT_MEM_COMM] == (uint64_t)a->n * MTI_COMM_RECORD);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
}

static void nccl_rank(int rank, void *p)
{
    nccl_arg *a = (nccl_arg *)p;
    const int n = a->n;
    mt_comm *boot = tcomm_make(a->w, rank, n, 0), *c = NULL;
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    nc.nccl_path = fake_nccl();
    nc.cuda_driver_path = fake_nccl();
    nc.timeout_seconds = a->timeout;
    nc.device_ordinal = rank; /* (one GPU per rank) */
    RANK_EXPECT(boot && !mt_comm_nccl_create_over(&nc, boot, &c));
    mt_comm_destroy(boot); /* the NCCL communicator does not need it */
    if (!c) return;
    RANK_EXPECT(strcmp(mt_comm_name(c), "nccl") == 0 && mt_comm_rank(c) == rank &&
                mt_comm_size(c) == n);
    float v[3] = {(float)rank, 1.0f, (float)(2 * rank)};
    RANK_EXPECT(!mt_comm_all_reduce(c, v, v, 3, MT_COMM_F32, MT_COMM_SUM, NULL));
    RANK_EXPECT(v[0] == (float)(n * (n - 1) / 2) && v[1] == (float)n);
    if (a->stall) {
        if (rank == 0) {
            RANK_EXPECT(mt_comm_barrier(c) == MT_ERR_COMM);
            RANK_EXPECT(strstr(mt_last_error(NULL), "aborted") != NULL);
            RANK_EXPECT(mt_comm_broken(c));
        }
        mt_comm_destroy(c);
        return;
    }
    uint16_t h[2] = {0x3f80, 0x4000}; /* bf16 1, 2 */
    RANK_EXPECT(!mt_comm_all_reduce(c, h, h, 2, MT_COMM_BF16, MT_COMM_MAX, NULL));
    RANK_EXPECT(h[0] == 0x3f80 && h[1] == 0x4000);
    float g[8];
    float mine = (float)(rank + 1);
    RANK_EXPECT(!mt_comm_all_gather(c, &mine, g, 1, MT_COMM_F32, NULL));
    for (int r = 0; r < n; r++) RANK_EXPECT(g[r] == (float)(r + 1));
    for (int r = 0; r < n; r++) g[r] = (float)(r * (rank + 1));
    float part = -1.0f;
    RANK_EXPECT(!mt_comm_reduce_scatter(c, g, &part, 1, MT_COMM_F32, MT_COMM_SUM, NULL));
    RANK_EXPECT(part == (float)(rank * n * (n + 1) / 2));
    int32_t b = rank == 0 ? 77 : rank;
    RANK_EXPECT(!mt_comm_broadcast(c, &b, 4, MT_COMM_BYTE, 0, NULL));
    RANK_EXPECT(b == 77);
    RANK_EXPECT(!mt_comm_barrier(c));
    if (a->context) nccl_context(a, rank, c);
    mt_comm_destroy(c);
}

TEST(comm_nccl_stand_in)
{
    if (!fake_nccl()) {
        fprintf(stderr, "    (skipped: MT_FAKE_NCCL is not set)\n");
        return;
    }
    for (int n = 1; n <= 3; n++) {
        nccl_arg a = {.w = tcomm_world_new(n, 10.0), .n = n, .timeout = 10.0,
                      .context = n > 1 && check_fake_cuda() != NULL};
        tcomm_run(n, nccl_rank, &a);
        tcomm_world_free(a.w);
        CHECK_MSG(!a.bad, "NCCL stand-in over %d ranks", n);
    }
    /* a rank that stops: the other's barrier times out and aborts */
    nccl_arg a = {.w = tcomm_world_new(2, 10.0), .n = 2, .timeout = 0.2, .stall = 1};
    tcomm_run(2, nccl_rank, &a);
    tcomm_world_free(a.w);
    CHECK(!a.bad);
}

/* A stand-in libnccl's function (NULL without one). */
static void *fake_nccl_fn(const char *name)
{
    void *lib = fake_nccl() ? dlopen(fake_nccl(), RTLD_NOW | RTLD_LOCAL) : NULL; /* (kept) */
    return lib ? dlsym(lib, name) : NULL;
}

typedef struct ordinal_arg {
    tcomm_world *w;
    int ord[2];   /* each rank's device_ordinal */
    mt_status want;
    _Atomic int bad;
} ordinal_arg;

static void ordinal_rank(int rank, void *p)
{
    ordinal_arg *a = p;
    int (*init_device)(int) = (int (*)(int))fake_nccl_fn("fake_nccl_init_device");
    mt_comm *boot = tcomm_make(a->w, rank, 2, 0), *c = NULL;
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    nc.nccl_path = nc.cuda_driver_path = fake_nccl();
    nc.timeout_seconds = 10.0;
    nc.device_ordinal = a->ord[rank];
    const mt_status s = boot ? mt_comm_nccl_create_over(&nc, boot, &c) : MT_ERR_COMM;
    mt_comm_destroy(boot);
    RANK_EXPECT(s == a->want);
    if (s) {
        RANK_EXPECT(strstr(mt_last_error(NULL), a->want == MT_ERR_INVALID_ARG ? "no such CUDA device"
                                                                            : "ncclCommInitRank"));
        return;
    }
    /* the communicator is on the ordinal's device, and calls from a thread
       with no context current (this one) run with it current */
    RANK_EXPECT(init_device && init_device(rank) == a->ord[rank]);
    float v[2] = {(float)rank, 1.0f};
    RANK_EXPECT(!mt_comm_all_reduce(c, v, v, 2, MT_COMM_F32, MT_COMM_SUM, NULL));
    RANK_EXPECT(v[0] == 1.0f && v[1] == 2.0f);
    RANK_EXPECT(!mt_comm_barrier(c));
    mt_comm *sub = NULL;
    RANK_EXPECT(!mt_comm_split(c, 0, rank, &sub) && sub);
    if (sub) RANK_EXPECT(!mt_comm_barrier(sub));
    mt_comm_destroy(sub);
    mt_comm_destroy(c);
}

/* mt_nccl_config.device_ordinal chooses the rank's GPU: NCCL is set up and
 * called with that device's primary context current on the calling thread
 * (the stand-in refuses a call made otherwise), whatever the thread had
 * current; two ranks on one device fail to start, as NCCL refuses
 * duplicate GPUs; an ordinal with no device is MT_ERR_INVALID_ARG. */
TEST(comm_nccl_device_ordinal)
{
    if (!fake_nccl()) {
        fprintf(stderr, "    (skipped: MT_FAKE_NCCL is not set)\n");
        return;
    }
    unsigned long (*wrong)(void) = (unsigned long (*)(void))fake_nccl_fn("fake_nccl_wrong_device");
    CHECK(wrong != NULL);
    const unsigned long before = wrong();
    const struct {
        int a, b;
        mt_status want;
    } cases[] = {{1, 0, MT_OK}, {3, 5, MT_OK}, {2, 2, MT_ERR_COMM}};
    for (int i = 0; i < 3; i++) {
        ordinal_arg a = {.w = tcomm_world_new(2, 10.0), .ord = {cases[i].a, cases[i].b},
                         .want = cases[i].want};
        tcomm_run(2, ordinal_rank, &a);
        tcomm_world_free(a.w);
        CHECK_MSG(!a.bad, "ordinals %d and %d", cases[i].a, cases[i].b);
    }
    CHECK_EQ(wrong(), before);
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    nc.nccl_path = nc.cuda_driver_path = fake_nccl();
    nc.device_ordinal = 99;
    mt_nccl_id id;
    CHECK_OK(mt_nccl_unique_id(&nc, &id));
    mt_comm *c = NULL;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_comm_nccl_create(&nc, &id, 0, 1, &c));
    CHECK(strstr(mt_last_error(NULL), "device_ordinal 99") != NULL);
}

/* NCCL's setup runs under the deadline (non-blocking, polled): a rank
 * whose peer never joins gets MT_ERR_COMM after the timeout, not a hang,
 * and the half-made communicator is aborted. */
TEST(comm_nccl_init_deadline)
{
    if (!fake_nccl()) {
        fprintf(stderr, "    (skipped: MT_FAKE_NCCL is not set)\n");
        return;
    }
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    nc.nccl_path = nc.cuda_driver_path = fake_nccl();
    nc.timeout_seconds = 0.3;
    mt_nccl_id id;
    CHECK_OK(mt_nccl_unique_id(&nc, &id));
    mt_comm *c = NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CHECK_ST(MT_ERR_COMM, mt_comm_nccl_create(&nc, &id, 0, 2, &c)); /* (rank 1 never comes) */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    CHECK(c == NULL);
    CHECK_MSG(strstr(mt_last_error(NULL), "ncclCommInitRank") &&
                  strstr(mt_last_error(NULL), "aborted"),
              "%s", mt_last_error(NULL));
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    CHECK_MSG(s < 20.0, "the setup took %g s against a 0.3 s deadline", s); /* (the stand-in's own
                                                                             wait is 30 s) */
}

/* One rank of NCCL on a CUDA context, the GPU bundle's smoke test (group
 * nccl of gpu/run.sh): on a GPU (MT_TEST_GPU=1) the real driver and the
 * libnccl.so.2 the library finds itself (mti_nccl_candidates), else the
 * stand-ins. Each collective on device memory, out of place so the data
 * must move, checked; then a few steps of a tiny GPT on a context with the
 * communicator (on a GPU the loss must fall). */
TEST(comm_nccl_one_rank)
{
    const bool gpu = tnccl_gpu();
    mt_context *first, *ctx;
    mt_comm *c;
    if (!(ctx = tnccl_one_rank(&first, &c))) return;
    mti_device *d = ctx->dev;
    void *stream = mti_comm_stream(ctx);
    enum { N = 1000 };
    float h[N], back[N];
    for (int i = 0; i < N; i++) h[i] = (float)(i % 97) - 40.0f;
    mt_alloc_request req = {.bytes = N * sizeof(float), .mem_class = MT_MEM_IO,
                            .lifetime = MT_LIFE_PERSISTENT};
    mt_block a, b;
    CHECK_OK(mt_context_alloc(ctx, &req, &a));
    CHECK_OK(mt_context_alloc(ctx, &req, &b));
    CHECK_OK(d->copy_h2d(d, a.ptr, h, sizeof h));
    CHECK_OK(d->sync(d));
#define MOVED(what, call)                                                                        \
    do {                                                                                         \
        CHECK_OK(d->memset8(d, b.ptr, 0, sizeof h));                                             \
        CHECK_OK(d->sync(d));                                                                    \
        CHECK_MSG((call) == MT_OK, "%s: %s", what, mt_last_error(NULL));                        \
        CHECK_OK(d->copy_d2h(d, back, b.ptr, sizeof back));                                      \
        CHECK_OK(d->sync(d));                                                                    \
        CHECK_MSG(!gpu || !memcmp(back, h, sizeof h), "%s: the result differs", what);           \
    } while (0)
    /* the stand-in copies what it is asked to; on a GPU the values are checked */
    MOVED("all-reduce", mt_comm_all_reduce(c, a.ptr, b.ptr, N, MT_COMM_F32, MT_COMM_SUM, stream));
    MOVED("reduce-scatter", mt_comm_reduce_scatter(c, a.ptr, b.ptr, N, MT_COMM_F32, MT_COMM_SUM, stream));
    MOVED("all-gather", mt_comm_all_gather(c, a.ptr, b.ptr, N, MT_COMM_F32, stream));
    MOVED("bf16 all-reduce", mt_comm_all_reduce(c, a.ptr, b.ptr, 2 * N, MT_COMM_BF16, MT_COMM_MAX, stream));
#undef MOVED
    CHECK_OK(mt_comm_broadcast(c, a.ptr, N, MT_COMM_F32, 0, stream));
    CHECK_OK(d->copy_d2h(d, back, a.ptr, sizeof back));
    CHECK_OK(d->sync(d));
    CHECK(!memcmp(back, h, sizeof h));
    CHECK_OK(mt_comm_barrier(c));
    mt_context_free(ctx, &a);
    mt_context_free(ctx, &b);
    /* a few steps of a tiny GPT */
    mt_gpt_spec gs;
    mt_gpt_spec_init(&gs);
    gs.vocab = 64, gs.max_seq = 8, gs.layers = 1, gs.heads = 2, gs.channels = 32, gs.seed = 5;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 4;
    tc.lr = 0.1f;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    CHECK_OK(mt_model_gpt_create(ctx, &gs, &m));
    if (m) CHECK_OK(mt_trainer_create(m, &tc, &t));
    int32_t tok[4 * 8], tgt[4 * 8];
    for (int i = 0; i < 4 * 8; i++) tok[i] = (i * 7) % 64, tgt[i] = (i * 7 + 3) % 64;
    mt_batch bt = {.n = 4, .tokens = tok, .targets = tgt, .seq_len = 8};
    float loss[4] = {0};
    for (int k = 0; t && k < 4; k++)
        CHECK_MSG(mt_trainer_step(t, &bt, &loss[k]) == MT_OK, "step %d: %s", k, mt_last_error(ctx));
    if (gpu) CHECK_MSG(isfinite(loss[3]) && loss[3] < loss[0], "loss %g, then %g", (double)loss[0],
                       (double)loss[3]);
    mt_memory_stats ms;
    mt_context_memory_stats(ctx, &ms);
    CHECK_EQ(ms.per_class[MT_MEM_COMM].peak_live_bytes, 0); /* one rank: no buffers */
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
    mt_context_destroy(first);
}

/* A host communicator on a CUDA context (over the stand-in driver): the
 * device buffers go through host memory, in chunks. */
typedef struct cuda_arg {
    tcomm_world *w;
    int failing;    /* every device-to-host copy fails */
    _Atomic int bad;
} cuda_arg;

static void cuda_rank(int rank, void *p)
{
    cuda_arg *a = p;
    mt_comm *c = tcomm_make(a->w, rank, 2, 0);
    mt_context *ctx = tcomm_cuda_context(c);
    RANK_EXPECT(ctx != NULL);
    if (!ctx) {
        mt_comm_destroy(c);
        return;
    }
    mt_memory_stats ms;
    mt_context_memory_stats(ctx, &ms);
    RANK_EXPECT(ms.per_class[MT_MEM_COMM].peak_live_bytes == 0);
    if (a->failing) { /* the data go through the host: the copy out fails the call */
        mt_alloc_request req = {.bytes = 64, .mem_class = MT_MEM_GRAD, .lifetime = MT_LIFE_STEP};
        mt_block b;
        RANK_EXPECT(!mt_context_alloc(ctx, &req, &b));
        if (rank == 0) /* alone: its copy fails before the collective, so no rank waits */
            RANK_EXPECT(mti_comm_all_reduce(ctx, "test", b.ptr, b.ptr, 16, MT_COMM_F32,
                                            MT_COMM_SUM) != MT_OK);
        mt_context_free(ctx, &b);
        mt_context_destroy(ctx);
        mt_comm_destroy(c);
        return;
    }
    /* past the 4 MiB staging chunk */
    const size_t n = (size_t)1500 * 1000;
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = (float)(i % 100) + (float)rank;
    mt_alloc_request req = {.bytes = n * sizeof *h, .mem_class = MT_MEM_GRAD, .lifetime = MT_LIFE_STEP};
    mt_block b;
    RANK_EXPECT(!mt_context_alloc(ctx, &req, &b));
    RANK_EXPECT(!ctx->dev->copy_h2d(ctx->dev, b.ptr, h, n * sizeof *h));
    RANK_EXPECT(!mti_comm_all_reduce(ctx, "test", b.ptr, b.ptr, n, MT_COMM_F32, MT_COMM_SUM));
    memset(h, 0, n * sizeof *h);
    RANK_EXPECT(!ctx->dev->copy_d2h(ctx->dev, h, b.ptr, n * sizeof *h));
    RANK_EXPECT(!ctx->dev->sync(ctx->dev));
    for (size_t i = 0; i < n; i += 997) RANK_EXPECT(h[i] == (float)(2 * (i % 100) + 1));
    mt_context_free(ctx, &b);
    free(h);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(comm_cuda_host_staging)
{
    if (!check_fake_cuda()) {
        fprintf(stderr, "    (skipped: MT_FAKE_CUDA is not set)\n");
        return;
    }
    cuda_arg a = {.w = tcomm_world_new(2, 30.0)};
    tcomm_run(2, cuda_rank, &a);
    tcomm_world_free(a.w);
    CHECK(!a.bad);
    /* the data did go through the host: a failing device-to-host copy fails
       the all-reduce */
    void *lib = dlopen(check_fake_cuda(), RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL);
    void (*fail)(const char *, int, int) = NULL;
    void *sym = dlsym(lib, "fake_cuda_fail");
    memcpy(&fail, &sym, sizeof sym);
    CHECK(fail != NULL);
    cuda_arg f = {.w = tcomm_world_new(2, 30.0), .failing = 1};
    fail("cuMemcpyDtoHAsync_v2", 0, 999);
    tcomm_run(2, cuda_rank, &f);
    fail("", 0, 0);
    tcomm_world_free(f.w);
    CHECK(!f.bad);
    dlclose(lib);
}

/* ZeRO on CUDA contexts over the stand-in driver: with a device
 * communicator (a table with MT_COMM_CAP_DEVICE: the stand-in's device
 * memory is host memory) stages 1 and 2 run their buckets, gathers and
 * exchanges on device memory, and each rank's per-class peaks equal its
 * estimate made without a GPU; with a host communicator (MPI's kind) they
 * are refused. */
typedef struct zc_arg {
    tcomm_world *w;
    uint32_t caps;
    int stage;
    mt_status st[2];
    char msg[2][256];
} zc_arg;

static void zero_cuda_rank(int rank, void *p)
{
    zc_arg *a = p;
    mt_comm *c = tcomm_make(a->w, rank, 2, a->caps);
    mt_context *ctx = tcomm_cuda_context(c);
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = 8, g.layers = 2, g.heads = 2, g.channels = 16;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 2;
    tc.optimizer = MT_OPT_ADAMW8;
    tc.min_8bit_size = 256;
    tc.precision = MT_PREC_BF16;
    tc.grad_clip = 1.0f;
    tc.zero_stage = a->stage;
    mt_status s = ctx ? MT_OK : MT_ERR_NO_DEVICE;
    if (!s) s = mt_model_gpt_create(ctx, &g, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[2 * 8] = {0};
    mt_batch b = {.n = 2, .tokens = tok, .targets = tok, .seq_len = 8};
    for (int k = 0; k < 2 && !s; k++) s = mt_trainer_step(t, &b, NULL);
    if (s) snprintf(a->msg[rank], sizeof a->msg[rank], "%s", ctx ? mt_last_error(ctx) : "no context");
    mt_estimate_report e;
    mt_memory_stats ms;
    if (!s) s = mt_estimate_model(m, &tc, &e);
    if (!s) {
        mt_context_memory_stats(ctx, &ms);
        for (int k = 0; k < MT_MEM_COUNT; k++)
            if (e.class_peak[k] != ms.per_class[k].peak_live_bytes && !a->msg[rank][0]) {
                snprintf(a->msg[rank], sizeof a->msg[rank], "%s peak %llu, estimate %llu",
                         mt_mem_class_name((mt_mem_class)k),
                         (unsigned long long)ms.per_class[k].peak_live_bytes,
                         (unsigned long long)e.class_peak[k]);
                s = MT_ERR_INTERNAL;
            }
    }
    a->st[rank] = s;
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
}

TEST(zero_cuda_stand_in)
{
    if (!check_fake_cuda() || !getenv("MT_FAKE_CUBLASLT")) {
        fprintf(stderr, "    (skipped: MT_FAKE_CUDA or MT_FAKE_CUBLASLT is not set)\n");
        return;
    }
    for (int stage = 1; stage <= 2; stage++) {
        zc_arg a = {.w = tcomm_world_new(2, 30.0), .caps = MT_COMM_CAP_DEVICE, .stage = stage};
        tcomm_run(2, zero_cuda_rank, &a);
        tcomm_world_free(a.w);
        for (int r = 0; r < 2; r++)
            CHECK_MSG(a.st[r] == MT_OK, "stage %d, rank %d: %s", stage, r, a.msg[r]);
    }
    zc_arg h = {.w = tcomm_world_new(2, 30.0), .caps = 0, .stage = 1};
    tcomm_run(2, zero_cuda_rank, &h);
    tcomm_world_free(h.w);
    for (int r = 0; r < 2; r++) {
        CHECK_EQ(h.st[r], MT_ERR_UNSUPPORTED);
        CHECK(strstr(h.msg[r], "device communicator") != NULL);
    }
}
