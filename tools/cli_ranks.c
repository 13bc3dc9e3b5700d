/*
 * cli_ranks.c - memtrain train under mpirun: the job's ranks as one
 * data-parallel run. Built with mpicc (MT_CLI_MPI) where it is found;
 * without it, a job of more than one rank is refused.
 *
 * Every rank reads the same seeded data, global batches of --batch rows,
 * and trains on its own rows of each (rank r of N: rows r*B/N to
 * (r+1)*B/N - 1); rank 0 alone prints and writes files. Before anything
 * runs the ranks agree on every option as given (and on --data's
 * contents): a run whose ranks would step, evaluate or save at different
 * times is refused, naming the option and each rank's value.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "memtrain/comm.h"
#ifdef MT_CLI_MPI
#include "memtrain/mpi.h"
#endif

cli_ranks cli_world = {NULL, 0, 1, 0, 0, 1, 1};

/* The rank count mpirun (Open MPI, or a PMI launcher) gave this process,
 * or 1. */
static int launched_size(void)
{
    const char *v = getenv("OMPI_COMM_WORLD_SIZE");
    if (!v) v = getenv("PMI_SIZE");
    return v ? atoi(v) : 1;
}

#ifdef MT_CLI_MPI
/* ---- the ranks' agreement on the command's options ---- */

#define SHOWN 64 /* bytes of a value as a message shows it */
#define HASH_START 0xcbf29ce484222325ull
#define HASH_PRIME 0x100000001b3ull

/* One thing every rank must give alike: an option's value as given, or
 * the contents of the file one names; compared as a hash. */
typedef struct item {
    const char *name;
    uint64_t h;
    char shown[SHOWN];
} item;

static uint64_t hash(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * HASH_PRIME;
    return h;
}

/* A file's size and a hash of its bytes (8 at a time: a data file is read
 * whole anyway), as "12345 bytes #1a2b3c4d", or why it cannot be read. */
static uint64_t file_digest(const char *path, char *shown, size_t cap)
{
    enum { CHUNK = 1 << 20 };
    FILE *f = fopen(path, "rb");
    unsigned char *buf = f ? malloc(CHUNK) : NULL;
    if (!buf) {
        snprintf(shown, cap, "unreadable (%s)", f ? "out of memory" : strerror(errno));
        if (f) fclose(f);
        return hash(HASH_START, shown, strlen(shown));
    }
    uint64_t h = HASH_START, bytes = 0;
    size_t got;
    while ((got = fread(buf, 1, CHUNK, f)) > 0) {
        size_t i = 0;
        for (uint64_t w; i + 8 <= got; i += 8) memcpy(&w, buf + i, 8), h = (h ^ w) * HASH_PRIME;
        h = hash(h, buf + i, got - i);
        bytes += got;
    }
    const bool bad = ferror(f);
    fclose(f);
    free(buf);
    if (bad) snprintf(shown, cap, "unreadable (a read failed)");
    else
        snprintf(shown, cap, "%llu bytes #%08llx", (unsigned long long)bytes,
                 (unsigned long long)(h >> 32));
    return hash(h, shown, strlen(shown));
}

/* Every option entry of the table, then --data's contents: n items. */
static void make_items(const cli_opts *o, item *it, int n)
{
    char buf[1200];
    for (int i = 0; i < n - 1; i++) {
        const char *text;
        item *x = &it[i];
        x->name = cli_option_given(o, i, &text, buf, sizeof buf);
        if (!x->name) continue;
        x->h = text ? hash(hash(HASH_START, "+", 1), text, strlen(text)) : HASH_START;
        snprintf(x->shown, sizeof x->shown, "%s", !text ? "(not given)" : *text ? text : "(given)");
        if (text && strlen(text) >= sizeof x->shown) memcpy(x->shown + SHOWN - 4, "...", 4);
    }
    if (o->data) {
        it[n - 1].name = "the contents of --data";
        it[n - 1].h = file_digest(o->data, it[n - 1].shown, SHOWN);
    }
}

/* "rank 0 A, rank 2 B": rank 0's value, then each rank's whose hash
 * differs from rank 0's (up to 8, then how many more); shown holds each
 * rank's text, SHOWN bytes apart. */
static void rank_values(char *buf, size_t cap, const uint64_t *h, size_t stride, char *shown)
{
    for (int r = 0; r < cli_world.size; r++) shown[(size_t)r * SHOWN + SHOWN - 1] = 0;
    size_t at = (size_t)snprintf(buf, cap, "rank 0 %s", shown);
    int listed = 0;
    for (int r = 1; r < cli_world.size; r++) {
        if (h[(size_t)r * stride] == h[0]) continue;
        if (listed++ < 8 && at < cap)
            at += (size_t)snprintf(buf + at, cap - at, ", rank %d %s", r,
                                   shown + (size_t)r * SHOWN);
    }
    if (listed > 8 && at < cap) snprintf(buf + at, cap - at, ", and %d more ranks", listed - 8);
}

/* The ranks' options, compared: one all-gather of two hashes (the build's
 * and the options'); only when they differ, the hash of each option, then
 * the values of the first one that differs. 0, or EXIT_USAGE on every
 * rank (rank 0 says why), or EXIT_FAIL when a collective fails. */
static int agree_options(const cli_opts *o)
{
    const int n = cli_option_count() + 1, N = cli_world.size;
    mt_comm *c = cli_world.comm;
    item *it = calloc((size_t)n, sizeof *it);
    uint64_t *all = calloc((size_t)N * (size_t)(n > 2 ? n : 2), sizeof *all);
    uint64_t *mine = calloc((size_t)n, sizeof *mine);
    char *shown = calloc((size_t)N, SHOWN);
    char what[SHOWN] = "", list[1024] = "";
    int rc = it && all && mine && shown ? 0 : cli_lib_fail(NULL, "out of memory");
    if (!rc) make_items(o, it, n);
    uint64_t rec[2] = {hash(HASH_START, mt_version(), strlen(mt_version()) + 1), HASH_START};
    for (int i = 0; i < n && !rc; i++) {
        const char *name = it[i].name ? it[i].name : "";
        rec[0] = hash(rec[0], name, strlen(name) + 1);
        rec[1] = hash(rec[1], &it[i].h, sizeof it[i].h);
    }
    if (!rc && mt_comm_all_gather(c, rec, all, sizeof rec, MT_COMM_BYTE, NULL))
        rc = cli_lib_fail(NULL, NULL);
    bool build = false, options = false;
    for (int r = 1; r < N && !rc; r++)
        build |= all[2 * r] != all[0], options |= all[2 * r + 1] != all[1];
    if (!rc && build) { /* other option tables: compare the versions alone */
        snprintf(what, sizeof what, "%s", mt_version());
        if (mt_comm_all_gather(c, what, shown, SHOWN, MT_COMM_BYTE, NULL))
            rc = cli_lib_fail(NULL, NULL);
        else rank_values(list, sizeof list, all, 2, shown);
        snprintf(what, sizeof what, "the memtrain build");
    } else if (!rc && options) {
        for (int i = 0; i < n; i++) mine[i] = it[i].h;
        if (mt_comm_all_gather(c, mine, all, (size_t)n * sizeof *mine, MT_COMM_BYTE, NULL))
            rc = cli_lib_fail(NULL, NULL);
        int first = -1; /* the same on every rank */
        for (int i = 0; i < n && !rc && first < 0; i++)
            for (int r = 1; r < N && first < 0; r++)
                if (all[(size_t)r * n + i] != all[i]) first = i;
        if (!rc && first >= 0) {
            if (mt_comm_all_gather(c, it[first].shown, shown, SHOWN, MT_COMM_BYTE, NULL))
                rc = cli_lib_fail(NULL, NULL);
            else rank_values(list, sizeof list, all + first, (size_t)n, shown);
            snprintf(what, sizeof what, "%s", it[first].name);
        }
    }
    if (!rc && list[0]) {
        cli_world.together = 1;
        rc = cli_world.rank == 0 ? cli_bad_usage("the ranks disagree on %s: %s", what, list)
                                 : EXIT_USAGE;
    }
    free(it), free(all), free(mine), free(shown);
    return rc;
}
#endif

int cli_ranks_open(const cli_opts *o)
{
    const int n = launched_size();
    if (n <= 1) return 0;
#ifdef MT_CLI_MPI
    int argc = 0;
    char **argv = NULL;
    /* --overlap, and --zero 3 with prefetch: serialized, so the gradients'
       collectives or the gathers of the layers to come can run on a thread
       of their own (single otherwise: the communicator then says it
       cannot, and they run on the main thread) */
    int level = 0;
    const bool thread = o->overlap || (o->zero == 3 && o->zero3_prefetch > 0);
    const int want = thread ? MPI_THREAD_SERIALIZED : MPI_THREAD_SINGLE;
    if (MPI_Init_thread(&argc, &argv, want, &level) != MPI_SUCCESS) {
        fprintf(stderr, "%s: MPI_Init_thread failed\n", cli_prog);
        return EXIT_FAIL;
    }
    cli_world.mpi = 1;
    /* an error inside a non-blocking collective is reported through
       MPI_COMM_WORLD's handler (memtrain/mpi.h): returned, not fatal (the
       communicator's duplicate returns its own) */
    if (MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN) != MPI_SUCCESS) {
        fprintf(stderr, "%s: MPI_Comm_set_errhandler failed\n", cli_prog);
        return EXIT_FAIL;
    }
    if (mt_comm_mpi_create(MPI_COMM_WORLD, (double)o->comm_timeout, &cli_world.comm))
        return cli_lib_fail(NULL, NULL);
    cli_world.rank = mt_comm_rank(cli_world.comm);
    cli_world.size = mt_comm_size(cli_world.comm);
    cli_world.tp = (int)o->tp;
    cli_world.pp = (int)o->pp;
    int rc = agree_options(o);
    if (rc) return rc;
    const long groups = cli_world.size / (o->tp > 1 ? o->tp : 1) / (o->pp > 1 ? o->pp : 1);
    if (groups > o->batch) {
        if (o->tp > 1 || o->pp > 1)
            fprintf(stderr, "%s: --batch %ld is less than the %ld data-parallel groups of --tp "
                    "%ld x --pp %ld (every group needs a row)\n", cli_prog, o->batch, groups,
                    o->tp, o->pp);
        else
            fprintf(stderr, "%s: --batch %ld is less than the %d ranks (every rank needs a row)\n",
                    cli_prog, o->batch, cli_world.size);
        return EXIT_USAGE;
    }
    if (cli_world.rank != 0) { /* rank 0 speaks for the run; errors still go to stderr */
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0) dup2(fd, STDOUT_FILENO), close(fd);
    }
    return 0;
#else
    (void)o;
    fprintf(stderr, "%s: started as %d ranks, but this memtrain was built without MPI (install "
            "libopenmpi-dev and rebuild)\n", cli_prog, n);
    return EXIT_FAIL;
#endif
}

void cli_ranks_close(int rc)
{
#ifdef MT_CLI_MPI
    if (!cli_world.mpi) return;
    fflush(stdout);
    fflush(stderr);
    /* a stop every rank agreed on (a signal, a diverged loss, options that
       differ) ends in order;
       any other failure may be this rank's alone, with the others waiting in
       a collective */
    if (rc && rc != EXIT_DIVERGED && rc < 128 && !cli_world.together) MPI_Abort(MPI_COMM_WORLD, rc);
    mt_comm_destroy(cli_world.comm);
    cli_world.comm = NULL;
    MPI_Finalize();
#else
    (void)rc;
#endif
}

void cli_ranks_rows(mt_batch *b, int features)
{
    /* a tensor (and pipeline) group shares its rows: the data-parallel
       groups split them */
    const int tp = (cli_world.tp > 1 ? cli_world.tp : 1) * (cli_world.pp > 1 ? cli_world.pp : 1);
    const int groups = cli_world.size / tp, g = cli_world.rank / tp;
    if (groups <= 1) return;
    const int T = b->tokens ? b->seq_len : 1;
    const int r0 = (int)((long)b->n * g / groups);
    const int r1 = (int)((long)b->n * (g + 1) / groups);
    if (b->inputs) b->inputs += (size_t)r0 * (size_t)features;
    if (b->tokens) b->tokens += (size_t)r0 * T;
    b->targets += (size_t)r0 * T;
    b->n = r1 - r0;
}

void cli_ranks_trainer_config(mt_trainer_config *tc) { cli_ranks_batch(tc, cli_world.size); }

void cli_ranks_batch(mt_trainer_config *tc, int ranks)
{
    if (tc->tensor_parallel > 1) ranks /= tc->tensor_parallel; /* (a group shares its rows) */
    if (tc->pipeline_parallel > 1) ranks /= tc->pipeline_parallel;
    if (ranks <= 1) return;
    const int rows = (tc->max_batch + ranks - 1) / ranks;
    tc->max_batch = rows;
    if (tc->micro_batch > rows) tc->micro_batch = 0;
}

int cli_ranks_peaks(mt_context *ctx, uint64_t *peaks)
{
    mt_memory_stats ms;
    mt_context_memory_stats(ctx, &ms);
    peaks[0] = ms.peak_live_bytes;
    if (cli_world.size <= 1) return 0;
    uint64_t mine = ms.peak_live_bytes;
    if (mt_comm_all_gather(cli_world.comm, &mine, peaks, sizeof mine, MT_COMM_BYTE, NULL))
        return cli_lib_fail(NULL, NULL);
    return 0;
}

int cli_ranks_mean(float *v, int n, int rows)
{
    if (cli_world.size <= 1) return 0;
    float buf[9];
    if (n > 8) return EXIT_FAIL;
    for (int i = 0; i < n; i++) buf[i] = v[i] * (float)rows;
    buf[n] = (float)rows;
    if (mt_comm_all_reduce(cli_world.comm, buf, buf, (size_t)n + 1, MT_COMM_F32, MT_COMM_SUM, NULL))
        return cli_lib_fail(NULL, NULL);
    for (int i = 0; i < n; i++) v[i] = buf[i] / buf[n];
    return 0;
}

int cli_ranks_any(bool flag, long step, bool *any)
{
    *any = flag;
    if (cli_world.size <= 1) return 0;
    float f = flag ? 1.0f : 0.0f;
    /* (the library's message names the call, the table's cause, whether it
       timed out, and this rank; the step is the command's) */
    if (mt_comm_all_reduce(cli_world.comm, &f, &f, 1, MT_COMM_F32, MT_COMM_MAX, NULL)) {
        fprintf(stderr, "%s: after step %ld, asking the ranks whether to stop: %s\n", cli_prog, step,
                mt_last_error(NULL));
        return EXIT_FAIL;
    }
    *any = f > 0.0f;
    return 0;
}

/* The library's warnings and errors: on stderr ("memtrain: warning: ...",
 * under mpirun with the rank), and with train --json also as a
 * {"warning": ...} line on stdout, between the steps' objects. */
static void cli_log(void *user, mt_log_level level, const char *msg)
{
    const cli_opts *o = user;
    const char *kind = level == MT_LOG_ERROR ? "error" : "warning";
    if (cli_world.size > 1) fprintf(stderr, "%s: rank %d: %s: %s\n", cli_prog, cli_world.rank, kind, msg);
    else fprintf(stderr, "%s: %s: %s\n", cli_prog, kind, msg);
    if (o->json && o->cmd == CLI_TRAIN) {
        printf("{\"%s\": ", kind);
        cli_json_str(stdout, msg);
        printf("}\n");
        fflush(stdout);
    }
}

void cli_context_config(const cli_opts *o, mt_context_config *cc)
{
    mt_context_config_init(cc);
    cc->log_fn = cli_log;
    cc->log_user = (void *)o;
    cc->log_level = MT_LOG_WARN;
    cc->device = o->device;
    cc->threads = (int)o->threads;
    for (int c = 0; c < MT_MEM_COUNT; c++) cc->allocators[c].vtable = mt_allocator_by_name(o->allocator);
}
