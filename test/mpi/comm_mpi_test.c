/*
 * comm_mpi_test.c - the MPI communicator under mpirun (test/mpi_test.sh).
 *
 *   comm_mpi_test collectives   every collective, small and past the staging size
 *   comm_mpi_test stall         rank 1 sleeps through a barrier: rank 0 gets MT_ERR_COMM
 *                               at the timeout, then ends the job with MPI_Abort
 *   comm_mpi_test die           rank 1 exits mid-run: no rank hangs
 *   comm_mpi_test p2p           point to point: a ring of sendrecv, send/recv pairs,
 *                               bf16 and bytes, a message past the staging size
 *   comm_mpi_test p2pstall      rank 1 never sends: rank 0's receive from it is
 *                               MT_ERR_COMM at the timeout, naming rank 1
 *   comm_mpi_test split         sub-communicators by parity (an odd last rank in none),
 *                               ranked by a key, summing and exchanging on their own
 *   comm_mpi_test splitstall    rank 1 never splits: rank 0 gets MT_ERR_COMM at the timeout
 *
 * Prints "ok <what>" on rank 0 when it passes; exit status 1 on a failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "memtrain/mpi.h"

static int rank, size, failed;

#define EXPECT(c)                                                                               \
    do {                                                                                        \
        if (!(c)) {                                                                             \
            fprintf(stderr, "rank %d: %s:%d: failed: %s (%s)\n", rank, __FILE__, __LINE__, #c,  \
                    mt_last_error(NULL));                                                       \
            failed = 1;                                                                         \
        }                                                                                       \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void collectives(mt_comm *c)
{
    EXPECT(mt_comm_rank(c) == rank && mt_comm_size(c) == size);
    EXPECT(strcmp(mt_comm_name(c), "mpi") == 0);
    /* past the 4 MiB staging buffer, so it goes in chunks; sums exact in fp32 */
    const size_t n = (size_t)1500 * 1000;
    float *v = malloc(n * sizeof *v), *g = malloc(n * size * sizeof *g);
    for (size_t i = 0; i < n; i++) v[i] = (float)(i % 1000) + (float)rank;
    EXPECT(!mt_comm_all_reduce(c, v, v, n, MT_COMM_F32, MT_COMM_SUM, NULL));
    for (size_t i = 0; i < n; i += 997)
        EXPECT(v[i] == (float)(size * (i % 1000)) + (float)(size * (size - 1) / 2));
    float m = (float)rank;
    EXPECT(!mt_comm_all_reduce(c, &m, &m, 1, MT_COMM_F32, MT_COMM_MAX, NULL));
    EXPECT(m == (float)(size - 1));
    /* reduce-scatter of n per rank, in place */
    for (size_t i = 0; i < n * size; i++) g[i] = (float)(i / n) + 1.0f;
    EXPECT(!mt_comm_reduce_scatter(c, g, g + (size_t)rank * n, n, MT_COMM_F32, MT_COMM_SUM, NULL));
    for (size_t i = 0; i < n; i += 991) EXPECT(g[(size_t)rank * n + i] == (float)(size * (rank + 1)));
    /* not in place: the ranks' values added in rank order, ((x0 + x1) + x2)
       ..., the same bits on every rank (1 + 2^-24 rounds to 1 each time,
       where 2^-24 + 2^-24 first would not); and the largest */
    const size_t k = 3000;
    float *part = malloc(k * size * sizeof *part), *got = malloc(k * sizeof *got);
    for (size_t i = 0; i < k * size; i++) part[i] = rank == 0 ? 1.0f : 0x1p-24f;
    EXPECT(!mt_comm_reduce_scatter(c, part, got, k, MT_COMM_F32, MT_COMM_SUM, NULL));
    for (size_t i = 0; i < k; i++) EXPECT(got[i] == 1.0f);
    for (size_t i = 0; i < k * size; i++) part[i] = (float)((rank + (int)(i % k)) % size);
    EXPECT(!mt_comm_reduce_scatter(c, part, got, k, MT_COMM_F32, MT_COMM_MAX, NULL));
    for (size_t i = 0; i < k; i++) EXPECT(got[i] == (float)(size - 1));
    free(part);
    free(got);
    /* all-gather of n per rank, in place */
    for (size_t i = 0; i < n; i++) g[(size_t)rank * n + i] = (float)(rank * 7) + (float)(i % 3);
    EXPECT(!mt_comm_all_gather(c, g + (size_t)rank * n, g, n, MT_COMM_F32, NULL));
    for (int r = 0; r < size; r++)
        for (size_t i = 0; i < n; i += 1009) EXPECT(g[(size_t)r * n + i] == (float)(r * 7) + (float)(i % 3));
    char b[64];
    snprintf(b, sizeof b, "from rank %d", rank);
    EXPECT(!mt_comm_broadcast(c, b, sizeof b, MT_COMM_BYTE, size - 1, NULL));
    char want[64];
    snprintf(want, sizeof want, "from rank %d", size - 1);
    EXPECT(strcmp(b, want) == 0);
    EXPECT(mt_comm_all_reduce(c, b, b, 1, MT_COMM_BF16, MT_COMM_SUM, NULL) == MT_ERR_UNSUPPORTED);
    EXPECT(!mt_comm_barrier(c));
    free(v);
    free(g);
}

static void p2p(mt_comm *c)
{
    EXPECT(mt_comm_has_p2p(c));
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    /* a ring: each rank sends to the next and receives from the previous at once */
    const size_t n = (size_t)1200 * 1000; /* (4.8 MB: past any eager size) */
    float *out = malloc(n * sizeof *out), *in = malloc(n * sizeof *in);
    for (size_t i = 0; i < n; i++) out[i] = (float)(rank * 1000 + (int)(i % 977));
    EXPECT(!mt_comm_sendrecv(c, out, n, next, in, n, prev, MT_COMM_F32, NULL));
    for (size_t i = 0; i < n; i += 101) EXPECT(in[i] == (float)(prev * 1000 + (int)(i % 977)));
    /* pairs: even ranks send first, odd receive first (rank size-1 of an odd
       size sits out), in bf16 and bytes, in order */
    const int peer = rank % 2 ? rank - 1 : rank + 1;
    if (peer < size) {
        unsigned short h[5] = {1, 2, 3, 4, (unsigned short)rank}, g[5];
        char word[16], got[16];
        snprintf(word, sizeof word, "rank %d", rank);
        if (rank % 2 == 0) {
            EXPECT(!mt_comm_send(c, h, 5, MT_COMM_BF16, peer, NULL));
            EXPECT(!mt_comm_send(c, word, sizeof word, MT_COMM_BYTE, peer, NULL));
            EXPECT(!mt_comm_recv(c, g, 5, MT_COMM_BF16, peer, NULL));
            EXPECT(!mt_comm_recv(c, got, sizeof got, MT_COMM_BYTE, peer, NULL));
        } else {
            EXPECT(!mt_comm_recv(c, g, 5, MT_COMM_BF16, peer, NULL));
            EXPECT(!mt_comm_recv(c, got, sizeof got, MT_COMM_BYTE, peer, NULL));
            EXPECT(!mt_comm_send(c, h, 5, MT_COMM_BF16, peer, NULL));
            EXPECT(!mt_comm_send(c, word, sizeof word, MT_COMM_BYTE, peer, NULL));
        }
        char want[24];
        snprintf(want, sizeof want, "rank %d", peer);
        EXPECT(g[4] == (unsigned short)peer && g[0] == 1 && !strncmp(got, want, sizeof got));
    }
    /* refused before anything is sent: oneself, out of range, overlap */
    EXPECT(mt_comm_send(c, out, 1, MT_COMM_F32, rank, NULL) == MT_ERR_INVALID_ARG);
    EXPECT(mt_comm_recv(c, in, 1, MT_COMM_F32, size, NULL) == MT_ERR_INVALID_ARG);
    EXPECT(mt_comm_sendrecv(c, out, 4, next, out + 2, 4, prev, MT_COMM_F32, NULL) ==
           MT_ERR_INVALID_ARG);
    EXPECT(!mt_comm_broken(c));
    EXPECT(!mt_comm_barrier(c));
    free(out);
    free(in);
}

static void split(mt_comm *c)
{
    const int color = rank == size - 1 && size % 2 ? -1 : rank % 2, even = size - size % 2;
    mt_comm *g = NULL;
    EXPECT(!mt_comm_split(c, color, -rank, &g));
    if (color < 0) {
        EXPECT(g == NULL);
    } else {
        int higher = 0;
        for (int r = rank + 2; r < even; r += 2) higher++;
        EXPECT(g && mt_comm_size(g) == even / 2 && mt_comm_rank(g) == higher);
        float v = (float)rank, want = 0.0f;
        for (int r = color; r < even; r += 2) want += (float)r;
        EXPECT(g && !mt_comm_all_reduce(g, &v, &v, 1, MT_COMM_F32, MT_COMM_SUM, NULL) && v == want);
        const int n = mt_comm_size(g), gr = mt_comm_rank(g);
        float out = (float)rank, in = -1.0f;
        if (n > 1)
            EXPECT(!mt_comm_sendrecv(g, &out, 1, (gr + 1) % n, &in, 1, (gr + n - 1) % n, MT_COMM_F32,
                                     NULL) && (int)in % 2 == color);
    }
    EXPECT(!mt_comm_barrier(c));
    mt_comm_destroy(g);
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "collectives";
    /* a short deadline where a rank is meant to miss it; elsewhere one that
       a loaded machine (sanitizers, more ranks than cores) never reaches */
    const double timeout =
        strcmp(mode, "collectives") && strcmp(mode, "p2p") && strcmp(mode, "split") ? 1.0 : 60.0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    mt_comm *c = NULL;
    EXPECT(mt_comm_mpi_create(MPI_COMM_WORLD, 0.0, &c) == MT_ERR_INVALID_ARG);
    EXPECT(!mt_comm_mpi_create(MPI_COMM_WORLD, timeout, &c));
    if (!c) MPI_Abort(MPI_COMM_WORLD, 1);
    if (!strcmp(mode, "collectives")) {
        collectives(c);
    } else if (!strcmp(mode, "p2p")) {
        p2p(c);
    } else if (!strcmp(mode, "split")) {
        split(c);
    } else if (!strcmp(mode, "splitstall")) {
        EXPECT(!mt_comm_barrier(c));
        if (rank == 1) sleep((unsigned)(timeout + 4)); /* never splits */
        if (rank == 0) {
            mt_comm *g = NULL;
            const double t0 = now_s();
            mt_status s = mt_comm_split(c, 0, 0, &g);
            const double dt = now_s() - t0;
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", mt_last_error(NULL));
            EXPECT(s == MT_ERR_COMM && g == NULL && dt < timeout + 2.0 && strstr(msg, "split"));
            if (!failed) printf("ok splitstall: rank 0 got MT_ERR_COMM after %.1f s: %s\n", dt, msg);
            fflush(stdout);
            MPI_Abort(MPI_COMM_WORLD, failed ? 1 : 0);
        }
        return 1;
    } else if (!strcmp(mode, "p2pstall")) {
        EXPECT(!mt_comm_barrier(c));
        if (rank == 1) sleep((unsigned)(timeout + 4)); /* never sends */
        if (rank == 0) {
            float x = 0.0f;
            const double t0 = now_s();
            mt_status s = mt_comm_recv(c, &x, 1, MT_COMM_F32, 1, NULL);
            const double dt = now_s() - t0;
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", mt_last_error(NULL));
            EXPECT(s == MT_ERR_COMM && strstr(msg, "rank 1") && dt < timeout + 2.0);
            EXPECT(mt_comm_broken(c));
            if (!failed) printf("ok p2pstall: rank 0 got MT_ERR_COMM after %.1f s: %s\n", dt, msg);
            fflush(stdout);
            MPI_Abort(MPI_COMM_WORLD, failed ? 1 : 0);
        }
        return 1;
    } else if (!strcmp(mode, "stall") || !strcmp(mode, "die")) {
        EXPECT(!mt_comm_barrier(c));
        if (rank == 1) {
            if (!strcmp(mode, "die")) _exit(3);
            sleep((unsigned)(timeout + 4)); /* past rank 0's deadline */
        }
        double t0 = now_s();
        float x = 1.0f;
        mt_status s = mt_comm_all_reduce(c, &x, &x, 1, MT_COMM_F32, MT_COMM_SUM, NULL);
        double dt = now_s() - t0;
        if (rank == 0) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", mt_last_error(NULL));
            EXPECT(s == MT_ERR_COMM);
            EXPECT(dt < timeout + 2.0);
            EXPECT(mt_comm_broken(c));
            EXPECT(mt_comm_barrier(c) == MT_ERR_COMM);
            if (!failed) printf("ok %s: rank 0 got MT_ERR_COMM after %.1f s: %s\n", mode, dt, msg);
            fflush(stdout);
            MPI_Abort(MPI_COMM_WORLD, failed ? 1 : 0); /* the documented way out */
        }
        return 1;
    }
    mt_comm_destroy(c);
    int bad = failed;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0 && !bad) printf("ok %s over %d ranks\n", mode, size);
    MPI_Finalize();
    return bad;
}
