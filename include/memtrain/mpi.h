/*
 * memtrain/mpi.h - a communicator over MPI, for CPU contexts.
 *
 * Link libmemtrain_mpi.a (before libmemtrain.a) and the application's MPI:
 *   mpicc app.c -lmemtrain_mpi -lmemtrain ...
 * libmemtrain.a itself never needs MPI. The application initialises MPI and
 * finalises it after destroying the communicator.
 */
#ifndef MEMTRAIN_MPI_H
#define MEMTRAIN_MPI_H

#include <mpi.h>

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Makes a communicator of the ranks of `comm` (an MPI communicator the
 * application owns: it is duplicated, so the application's own traffic never
 * mixes with the library's, and MPI errors on the duplicate are returned,
 * not fatal). Collective over `comm`: every rank calls it.
 *
 * timeout_seconds (> 0) bounds every collective: each runs as a
 * non-blocking MPI collective (MPI_Iallreduce, ...) polled with MPI_Test,
 * sleeping up to 1 ms between polls, and one not complete by then (a rank
 * died or stalled) gives MT_ERR_COMM. MPI cannot cancel a collective, so
 * after a timeout the communicator is broken: the request stays pending in
 * MPI, with the buffers it was given (the communicator's own staging
 * buffers, never the library's tensors, which are copied through them), and
 * the application should end the job (MPI_Abort) rather than call
 * MPI_Finalize, which may wait for the stalled rank. When a rank dies,
 * Open MPI's mpirun usually ends the whole job itself, often before the
 * timeout.
 *
 * MPI has no portable bf16: fp32 and bytes only (no MT_COMM_CAP_BF16). The
 * library calls MPI from the threads that call it; with MPI_THREAD_SINGLE or
 * FUNNELED that must be the thread that initialised MPI. */
mt_status mt_comm_mpi_create(MPI_Comm comm, double timeout_seconds, mt_comm **out);

#ifdef __cplusplus
}
#endif
#endif /* MEMTRAIN_MPI_H */
