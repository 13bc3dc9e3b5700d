/*
 * cli_ranks.c - memtrain train under mpirun: the job's ranks as one
 * data-parallel run. Built with mpicc (MT_CLI_MPI) where it is found;
 * without it, a job of more than one rank is refused.
 *
 * Every rank reads the same seeded data, global batches of --batch rows,
 * and trains on its own rows of each (rank r of N: rows r*B/N to
 * (r+1)*B/N - 1); rank 0 alone prints and writes files.
 */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "memtrain/comm.h"
#ifdef MT_CLI_MPI
#include "memtrain/mpi.h"
#endif

cli_ranks cli_world = {NULL, 0, 1, 0};

/* The rank count mpirun (Open MPI, or a PMI launcher) gave this process,
 * or 1. */
static int launched_size(void)
{
    const char *v = getenv("OMPI_COMM_WORLD_SIZE");
    if (!v) v = getenv("PMI_SIZE");
    return v ? atoi(v) : 1;
}

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
    if (mt_comm_mpi_create(MPI_COMM_WORLD, (double)o->comm_timeout, &cli_world.comm))
        return cli_lib_fail(NULL, NULL);
    cli_world.rank = mt_comm_rank(cli_world.comm);
    cli_world.size = mt_comm_size(cli_world.comm);
    if (cli_world.size > o->batch) {
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
    /* a stop every rank agreed on (a signal, a diverged loss) ends in order;
       any other failure may be this rank's alone, with the others waiting in
       a collective */
    if (rc && rc != EXIT_DIVERGED && rc < 128) MPI_Abort(MPI_COMM_WORLD, rc);
    mt_comm_destroy(cli_world.comm);
    cli_world.comm = NULL;
    MPI_Finalize();
#else
    (void)rc;
#endif
}

void cli_ranks_rows(mt_batch *b, int features)
{
    if (cli_world.size <= 1) return;
    const int T = b->tokens ? b->seq_len : 1;
    const int r0 = (int)((long)b->n * cli_world.rank / cli_world.size);
    const int r1 = (int)((long)b->n * (cli_world.rank + 1) / cli_world.size);
    if (b->inputs) b->inputs += (size_t)r0 * (size_t)features;
    if (b->tokens) b->tokens += (size_t)r0 * T;
    b->targets += (size_t)r0 * T;
    b->n = r1 - r0;
}

void cli_ranks_trainer_config(mt_trainer_config *tc) { cli_ranks_batch(tc, cli_world.size); }

void cli_ranks_batch(mt_trainer_config *tc, int ranks)
{
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
