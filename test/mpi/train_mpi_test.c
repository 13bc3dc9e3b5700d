/*
 * train_mpi_test.c - data parallel training under mpirun (test/mpi_test.sh).
 *
 *   train_mpi_test train      N ranks with 2 rows each against this process
 *                             alone stepping on the 2N rows as N micro-batches
 *   train_mpi_test disagree   rank 1's model is wider, then rank 1 alone
 *                             freezes a parameter: every rank gets
 *                             MT_ERR_COMM at mt_trainer_create
 *   train_mpi_test stall      rank 1 stops before its second step: rank 0 gets
 *                             MT_ERR_COMM within the timeout
 *   train_mpi_test local      local SGD (every 2 steps): after 2 steps every
 *                             rank holds the mean of what each rank computes
 *                             alone on its rows
 *
 * Prints "ok <what>" on rank 0 when it passes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "memtrain/mpi.h"

#define T 8
#define STEPS 3
#define ROWS 2

static int rank, size, failed;
static int freeze_rank = -1; /* this rank freezes "wte" */

#define EXPECT(c)                                                                               \
    do {                                                                                        \
        if (!(c)) {                                                                             \
            fprintf(stderr, "rank %d: %s:%d: failed: %s\n", rank, __FILE__, __LINE__, #c);      \
            failed = 1;                                                                         \
        }                                                                                       \
    } while (0)

static void rows(int step, int r0, int n, int32_t *tok, int32_t *tgt)
{
    for (int r = 0; r < n; r++)
        for (int j = 0; j < T; j++) {
            tok[r * T + j] = ((r0 + r) * 7 + j * 3 + step * 11) % 50;
            tgt[r * T + j] = ((r0 + r) * 5 + j * 13 + step * 3 + 1) % 50;
        }
}

/* How train() runs: local SGD every `local` steps (0: off); `alone`: this
 * rank's rows without a communicator; `steps` (0: STEPS). */
typedef struct how {
    int local, alone, steps;
} how;

/* Trains STEPS steps; with comm, on this rank's rows; without, on all. */
static mt_status train_how(mt_comm *comm, int channels, int stall_rank, const how *hw, float *loss,
                           float **w, size_t *nw, char *msg, size_t cap)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.comm = comm;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 50, g.padded_vocab = 64, g.max_seq = T, g.layers = 2, g.heads = 2;
    g.channels = channels, g.seed = 7;
    const int n = comm || hw->alone ? ROWS : ROWS * size;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.optimizer = MT_OPT_SGD;
    tc.momentum = 0.9f;
    tc.lr = 0.05f;
    tc.grad_clip = 1.0f;
    tc.max_batch = n;
    tc.micro_batch = ROWS;
    static const char *const frozen[] = {"wte"};
    if (rank == freeze_rank) tc.freeze = frozen, tc.n_freeze = 1;
    tc.local_sgd_every = hw->local;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_status s = mt_context_create(&cc, &ctx);
    if (!s) s = mt_model_gpt_create(ctx, &g, &m);
    if (!s) s = mt_trainer_create(m, &tc, &t);
    int32_t tok[64 * T], tgt[64 * T];
    for (int step = 0; step < (hw->steps ? hw->steps : STEPS) && !s; step++) {
        if (step == 1 && rank == stall_rank) sleep(5); /* past the others' 1 s timeout */
        rows(step, comm || hw->alone ? rank * ROWS : 0, n, tok, tgt);
        mt_batch b = {.n = n, .tokens = tok, .targets = tgt, .seq_len = T};
        s = mt_trainer_step(t, &b, &loss[step]);
    }
    if (s) snprintf(msg, cap, "%s", mt_last_error(ctx ? ctx : NULL));
    if (!s) {
        *nw = mt_model_num_params(m);
        *w = malloc(*nw * sizeof(float));
        s = mt_model_get_params(m, *w, *nw);
    }
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return s;
}

static mt_status train(mt_comm *comm, int channels, int stall_rank, float *loss, float **w,
                       size_t *nw, char *msg, size_t cap)
{
    const how plain = {0, 0, 0};
    return train_how(comm, channels, stall_rank, &plain, loss, w, nw, msg, cap);
}

/* Local SGD: 2 steps apart, then the average; against each rank alone. */
static void local_sgd(mt_comm *c)
{
    const how ls = {2, 0, 2}, alone = {0, 1, 2};
    float loss[STEPS], ref_loss[STEPS];
    float *w = NULL, *ref = NULL;
    size_t nw = 0, nref = 0;
    char msg[1024] = "";
    mt_status s = train_how(c, 16, -1, &ls, loss, &w, &nw, msg, sizeof msg);
    EXPECT(s == MT_OK);
    if (s) fprintf(stderr, "rank %d: %s\n", rank, msg);
    EXPECT(train_how(NULL, 16, -1, &alone, ref_loss, &ref, &nref, msg, sizeof msg) == MT_OK);
    if (!w || !ref || nw != nref) {
        failed = 1;
        return;
    }
    /* each rank's losses are its rows' own; the weights are the mean of the
       ranks alone: summed in rank order, times 1/N */
    for (int k = 0; k < 2; k++) EXPECT(loss[k] == ref_loss[k]);
    float *all = malloc(nw * (size_t)size * sizeof *all);
    MPI_Allgather(ref, (int)nw, MPI_FLOAT, all, (int)nw, MPI_FLOAT, MPI_COMM_WORLD);
    double worst = 0.0;
    size_t differ = 0;
    for (size_t i = 0; i < nw; i++) {
        float sum = 0.0f;
        for (int r = 0; r < size; r++) sum += all[(size_t)r * nw + i];
        const float want = sum * (1.0f / (float)size);
        differ += w[i] != want;
        double d = fabs((double)w[i] - want) / (fabs(want) + 1.0);
        if (d > worst) worst = d;
    }
    /* two ranks: a sum of two is the same bits in any order; with more, MPI
       chooses the order */
    EXPECT(size == 2 ? differ == 0 : worst < 1e-6);
    float *w0 = malloc(nw * sizeof *w0);
    memcpy(w0, w, nw * sizeof *w0);
    MPI_Bcast(w0, (int)nw, MPI_FLOAT, 0, MPI_COMM_WORLD);
    EXPECT(!memcmp(w0, w, nw * sizeof *w0)); /* and the ranks agree, bit for bit */
    int bad = failed;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0 && !bad)
        printf("ok local: %d ranks, local SGD every 2 steps: the weights are the mean of the "
               "ranks alone (%zu of %zu differ, by %.1e at most)\n",
               size, differ, nw, worst);
    failed = bad;
    free(all);
    free(w0);
    free(w);
    free(ref);
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "train";
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    mt_comm *c = NULL;
    /* 1 s where a rank stalls on purpose; elsewhere a deadline that a
       loaded machine (sanitizers, more ranks than cores) never reaches */
    if (mt_comm_mpi_create(MPI_COMM_WORLD, strcmp(mode, "stall") ? 60.0 : 1.0, &c))
        MPI_Abort(MPI_COMM_WORLD, 1);
    float loss[STEPS], ref_loss[STEPS];
    float *w = NULL, *ref = NULL;
    size_t nw = 0, nref = 0;
    char msg[1024] = "";
    if (!strcmp(mode, "train")) {
        mt_status s = train(c, 16, -1, loss, &w, &nw, msg, sizeof msg);
        EXPECT(s == MT_OK);
        if (s) fprintf(stderr, "rank %d: %s\n", rank, msg);
        EXPECT(train(NULL, 16, -1, ref_loss, &ref, &nref, msg, sizeof msg) == MT_OK);
        double worst = 0.0;
        for (size_t i = 0; w && ref && i < nw; i++) {
            double d = fabs((double)w[i] - ref[i]) / (fabs(ref[i]) + 1.0);
            if (d > worst) worst = d;
        }
        EXPECT(w && ref && nw == nref && worst < 1e-5);
        for (int k = 0; k < STEPS; k++) EXPECT(fabsf(loss[k] - ref_loss[k]) < 1e-5f);
        /* and every rank holds rank 0's weights, bit for bit */
        if (w) {
            float *w0 = malloc(nw * sizeof *w0);
            memcpy(w0, w, nw * sizeof *w0);
            MPI_Bcast(w0, (int)nw, MPI_FLOAT, 0, MPI_COMM_WORLD);
            EXPECT(!memcmp(w0, w, nw * sizeof *w0));
            free(w0);
        }
        int bad = failed;
        MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0 && !bad)
            printf("ok train: %d ranks equal one process accumulating %d micro-batches (within %.1e)\n",
                   size, size, worst);
        failed = bad;
    } else if (!strcmp(mode, "disagree")) {
        mt_status s = train(c, rank == 1 ? 24 : 16, -1, loss, &w, &nw, msg, sizeof msg);
        EXPECT(s == MT_ERR_COMM);
        EXPECT(strstr(msg, "rank 1's field model") != NULL);
        if (failed) fprintf(stderr, "rank %d: %s\n", rank, msg);
        freeze_rank = 1;
        s = train(c, 16, -1, loss, &w, &nw, msg, sizeof msg);
        freeze_rank = -1;
        EXPECT(s == MT_ERR_COMM);
        EXPECT(strstr(msg, "frozen parameters") != NULL);
        if (failed) fprintf(stderr, "rank %d: %s\n", rank, msg);
        int bad = failed;
        MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0 && !bad) printf("ok disagree: every rank refused: %s\n", msg);
        failed = bad;
    } else if (!strcmp(mode, "local")) {
        local_sgd(c);
    } else if (!strcmp(mode, "stall")) {
        mt_status s = train(c, 16, 1, loss, &w, &nw, msg, sizeof msg);
        if (rank == 0) {
            EXPECT(s == MT_ERR_COMM);
            if (!failed) printf("ok stall: rank 0 stopped with MT_ERR_COMM: %s\n", msg);
            else fprintf(stderr, "rank 0: %s: %s\n", mt_status_string(s), msg);
            fflush(stdout);
            MPI_Abort(MPI_COMM_WORLD, failed);
        }
        sleep(30); /* rank 0 ends the job */
        return 1;
    }
    free(w);
    free(ref);
    mt_comm_destroy(c);
    MPI_Finalize();
    return failed;
}
