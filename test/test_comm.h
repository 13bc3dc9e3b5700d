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
/* Runs fn(rank, arg) on n threads and joins them. */
void tcomm_run(int n, void (*fn)(int rank, void *arg), void *arg);

#endif
