/*
 * test_comm.h - an in-process communicator for tests: threads of one
 * process as the ranks, through the public table (memtrain/comm.h).
 * Reductions run in rank order, so results are deterministic; a rank that
 * does not join a collective within the world's timeout makes the others
 * fail with MT_ERR_COMM, and the world is dead from then on.
 */
#ifndef MT_TEST_COMM_H
#define MT_TEST_COMM_H

#include <stdio.h>

#include "memtrain/comm.h"

/* In a rank's function: a failed condition is printed with the rank and
 * marks the test's argument `a` bad (a->bad), the rank going on. */
#define RANK_EXPECT(c)                                                                          \
    do {                                                                                        \
        if (!(c)) {                                                                             \
            fprintf(stderr, "    rank %d: %s:%d: %s (%s)\n", rank, __FILE__, __LINE__, #c,      \
                    mt_last_error(NULL));                                                       \
            a->bad = 1;                                                                         \
        }                                                                                       \
    } while (0)

typedef struct tcomm_world tcomm_world;

tcomm_world *tcomm_world_new(int n, double timeout_seconds);
void tcomm_world_free(tcomm_world *w);
/* Rank `rank`'s communicator of the world; `claimed_size` is the size it
 * tells the library (the world's n, or another to make ranks disagree);
 * caps as in mt_comm_vtable (0: a host communicator). */
mt_comm *tcomm_make(tcomm_world *w, int rank, int claimed_size, uint32_t caps);
/* A CPU context of one kernel thread on communicator c (may be NULL). */
mt_status tcomm_context(mt_comm *c, mt_context **out);
/* A CUDA context on the stand-in driver and cuBLASLt (MT_FAKE_CUDA,
 * MT_FAKE_CUBLASLT) on communicator c (may be NULL); NULL on failure. */
mt_context *tcomm_cuda_context(mt_comm *c);
/* Rank `rank` of n's NCCL communicator over the stand-in libnccl
 * (MT_FAKE_NCCL; bootstrapped over w), or NULL. */
mt_comm *tcomm_nccl(tcomm_world *w, int rank, int n);

/* Gradients a test knows (the stand-in driver's kernels compute nothing):
 * set as mti_engine_grad_fill, it fills rank r's gradient element e of
 * parameter i with tcomm_grad_of(r, i, e), multiples of 2^-10 small enough
 * that every sum over ranks is exact; on a context of one rank with
 * tcomm_fill_sum > 1, the sum over that many ranks (what the ranks'
 * reductions make). */
extern _Atomic int tcomm_fill_sum;
float tcomm_grad_of(int r, int i, size_t e);
mt_status tcomm_fill_grads(mt_context *ctx, int param, size_t at, float *g, size_t n);
/* Rank `rank` of n on world w: its communicator (caps as tcomm_make), a CPU
 * context on it and a tiny GPT (vocab 50, 8 tokens, 2 layers of 2 heads,
 * `channels` wide, seed 7); what was made is kept even on failure, for
 * tcomm_rank_free. */
typedef struct tcomm_rank {
    mt_comm *c;
    mt_context *ctx;
    mt_model *m;
} tcomm_rank;
mt_status tcomm_gpt_rank(tcomm_world *w, int rank, int n, uint32_t caps, int channels,
                         tcomm_rank *out);
void tcomm_rank_free(tcomm_rank *r);
/* Runs fn(rank, arg) on n threads and joins them. */
void tcomm_run(int n, void (*fn)(int rank, void *arg), void *arg);

#endif
