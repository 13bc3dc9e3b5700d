/*
 * bench_offload_io.c - the disk offload's two ways of moving pieces,
 * measured side by side: a pool of threads each calling pread/pwrite, as
 * lib/train/offload.c does (2 threads), against io_uring (liburing) keeping a
 * queue of requests in flight from one thread. Both use O_DIRECT on one
 * file, at the piece sizes offload moves (4 MiB: a piece of 2^19 elements
 * of AdamW state; 2 MiB: its fp32 master; 1 MiB: its bf16 weights), and
 * three patterns: all writes, all reads, and reads and writes alternating
 * (the update reads the next piece while the last one is written back).
 *
 *   bench_offload_io --dir DIR [--mib N] [--reps R]
 *
 * Prints GB/s per (pattern, piece size, way, depth): the best of R runs
 * over N MiB (512, 3). Without liburing (its header absent at build time)
 * only the thread pool runs. (make bench-offload-io; docs/benchmarks-history.md,
 * "Disk offload: io_uring or threads")
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

#if defined(__has_include)
#if __has_include(<liburing.h>) && !defined(MT_NO_URING)
#include <liburing.h>
#define HAVE_URING 1
#endif
#endif

enum { P_WRITE, P_READ, P_MIXED };
static const char *const pattern_name[] = {"write", "read", "mixed"};

typedef struct job {
    int fd;
    char *buf;          /* one piece per worker or request slot */
    size_t piece;
    uint64_t n_pieces;  /* over the file */
    int pattern;
    _Atomic uint64_t next;
    int err;
} job;

/* Piece k's direction: the mixed pattern reads the even pieces of the
 * file's first half and writes the odd ones, so reads and writes go on
 * at once as in a step. */
static int is_write(const job *j, uint64_t k)
{
    return j->pattern == P_WRITE || (j->pattern == P_MIXED && (k & 1));
}

static int one(const job *j, char *buf, uint64_t k)
{
    const off_t at = (off_t)(k * j->piece);
    size_t done = 0;
    while (done < j->piece) {
        ssize_t r = is_write(j, k) ? pwrite(j->fd, buf + done, j->piece - done, at + (off_t)done)
                                   : pread(j->fd, buf + done, j->piece - done, at + (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : EIO;
        done += (size_t)r;
    }
    return 0;
}

typedef struct worker {
    job *j;
    char *buf;
    int err;
} worker;

static void *pool_thread(void *arg)
{
    worker *w = arg;
    for (;;) {
        uint64_t k = atomic_fetch_add(&w->j->next, 1);
        if (k >= w->j->n_pieces) break;
        if ((w->err = one(w->j, w->buf, k))) break;
    }
    return NULL;
}

/* The thread pool: `threads` workers, each moving one piece at a time. */
static double run_pool(job *j, int threads)
{
    pthread_t th[16];
    worker w[16];
    atomic_store(&j->next, 0);
    const double t0 = now_s();
    for (int k = 0; k < threads; k++) {
        w[k] = (worker){j, j->buf + (size_t)k * j->piece, 0};
        pthread_create(&th[k], NULL, pool_thread, &w[k]);
    }
    for (int k = 0; k < threads; k++) {
        pthread_join(th[k], NULL);
        if (w[k].err) j->err = w[k].err;
    }
    return now_s() - t0;
}

#ifdef HAVE_URING
/* io_uring: `depth` requests in flight from this thread, each a whole
 * piece (a short transfer is finished with a plain call, as offload would). */
static double run_uring(job *j, int depth)
{
    struct io_uring ring;
    int e = io_uring_queue_init((unsigned)depth, &ring, 0);
    if (e < 0) {
        j->err = -e;
        return 0.0;
    }
    const double t0 = now_s();
    uint64_t next = 0, done = 0;
    int inflight = 0;
    while (done < j->n_pieces && !j->err) {
        while (inflight < depth && next < j->n_pieces) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            char *buf = j->buf + (size_t)(next % (uint64_t)depth) * j->piece;
            const off_t at = (off_t)(next * j->piece);
            if (is_write(j, next)) io_uring_prep_write(sqe, j->fd, buf, (unsigned)j->piece, (uint64_t)at);
            else io_uring_prep_read(sqe, j->fd, buf, (unsigned)j->piece, (uint64_t)at);
            io_uring_sqe_set_data64(sqe, next);
            next++, inflight++;
        }
        io_uring_submit(&ring);
        struct io_uring_cqe *cqe;
        if ((e = io_uring_wait_cqe(&ring, &cqe)) < 0) {
            j->err = -e;
            break;
        }
        const uint64_t k = io_uring_cqe_get_data64(cqe);
        const int res = cqe->res;
        io_uring_cqe_seen(&ring, cqe);
        inflight--, done++;
        if (res < 0) j->err = -res;
        else if ((size_t)res != j->piece) j->err = EIO; /* (not seen on this disk) */
        (void)k;
    }
    const double s = now_s() - t0;
    io_uring_queue_exit(&ring);
    return s;
}
#endif

int main(int argc, char **argv)
{
    const char *dir = NULL;
    long mib = 512;
    int reps = 3;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
        else if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = atol(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_offload_io --dir DIR [--mib N] [--reps R]\n");
            return 2;
        }
    }
    if (!dir || mib < 16 || reps < 1) {
        fprintf(stderr, "bench_offload_io: --dir DIR is needed (--mib at least 16)\n");
        return 2;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/bench_offload_io.%ld", dir, (long)getpid());
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
    if (fd < 0) {
        fprintf(stderr, "bench_offload_io: '%s': %s\n", path, strerror(errno));
        return 1;
    }
    const uint64_t bytes = (uint64_t)mib << 20;
    int rc = posix_fallocate(fd, 0, (off_t)bytes);
    char *buf = NULL;
    if (rc || posix_memalign((void **)&buf, 4096, (size_t)16 << 22)) {
        fprintf(stderr, "bench_offload_io: no room (%s)\n", strerror(rc ? rc : ENOMEM));
        unlink(path);
        return 1;
    }
    memset(buf, 0x5a, (size_t)16 << 22);
    static const size_t pieces[] = {(size_t)4 << 20, (size_t)2 << 20, (size_t)1 << 20};
    static const int depths[] = {1, 2, 4, 8};
#ifdef HAVE_URING
    const int ways = 2;
#else
    const int ways = 1;
    printf("(built without liburing: the thread pool alone)\n");
#endif
    printf("%-6s %6s %-8s %5s %8s\n", "what", "piece", "way", "depth", "GB/s");
    /* the file written once first, so reads read blocks that exist */
    job w0 = {.fd = fd, .buf = buf, .piece = (size_t)4 << 20, .n_pieces = bytes / ((size_t)4 << 20),
              .pattern = P_WRITE};
    (void)run_pool(&w0, 2);
    int status = w0.err ? 1 : 0;
    for (int pat = 0; pat < 3 && !status; pat++)
        for (size_t pz = 0; pz < sizeof pieces / sizeof *pieces && !status; pz++)
            for (int way = 0; way < ways && !status; way++)
                for (size_t d = 0; d < sizeof depths / sizeof *depths && !status; d++) {
                    double best = 0.0;
                    for (int r = 0; r < reps && !status; r++) {
                        job j = {.fd = fd, .buf = buf, .piece = pieces[pz],
                                 .n_pieces = bytes / pieces[pz], .pattern = pat};
                        double s = 0.0;
#ifdef HAVE_URING
                        if (way) s = run_uring(&j, depths[d]);
                        else
#endif
                            s = run_pool(&j, depths[d]);
                        if (j.err) {
                            fprintf(stderr, "bench_offload_io: %s\n", strerror(j.err));
                            status = 1;
                        }
                        const double gbs = s > 0.0 ? (double)bytes / s / 1e9 : 0.0;
                        if (gbs > best) best = gbs;
                    }
                    printf("%-6s %4zuMiB %-8s %5d %8.2f\n", pattern_name[pat], pieces[pz] >> 20,
                           way ? "io_uring" : "threads", depths[d], best);
                    fflush(stdout);
                }
    close(fd);
    unlink(path);
    free(buf);
    return status;
}
