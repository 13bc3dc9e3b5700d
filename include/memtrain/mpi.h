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
 * not fatal; but Open MPI 4 reports an error met inside a non-blocking
 * collective, such as ranks that called different collectives
 * (MPI_ERR_TRUNCATE), through MPI_COMM_WORLD's error handler when the
 * request is tested, and its default one aborts the job: an application
 * that wants MT_ERR_COMM there too sets MPI_ERRORS_RETURN on
 * MPI_COMM_WORLD). Collective over `comm`: every rank calls it.
 *
 * timeout_seconds (> 0) bounds every collective: each runs as a
 * non-blocking MPI collective (MPI_Iallreduce, ...) on the buffers it is
 * given, polled with MPI_Test in bursts of 50 us (a waiter the step waits
 * on first spins for 5 ms, yielding the core on each test, then sleeps
 * between bursts, 10 us doubling up to 1 ms; the library's communication
 * thread while backward computes never spins and sleeps at most 200 us;
 * docs/distributed.md), and one
 * not complete by then (a rank died or stalled) gives MT_ERR_COMM. MPI
 * cannot cancel a collective, so after a timeout the communicator is broken
 * and the request stays pending in MPI with its buffers: the library gives
 * it only a context's staging buffer (never its tensors), which the context
 * then keeps even past mt_context_destroy; an application calling the
 * collectives itself must likewise never free or reuse buffers of a call
 * that timed out. The application should then end the job (MPI_Abort)
 * rather than call MPI_Finalize, which may wait for the stalled rank. When
 * a rank dies, Open MPI's mpirun usually ends the whole job itself, often
 * before the timeout. A call takes at most 2^30 elements per rank for the
 * gathers and scatters.
 *
 * The fp32 reduce-scatter runs rank to rank (MPI_Irecv and MPI_Isend on the
 * duplicate): each rank sends every other rank its part and receives their
 * parts of its own into a buffer the communicator keeps until it is
 * destroyed ((size - 1) x count floats, grown to the largest call), then
 * adds the ranks' values in rank order.
 *
 * MPI has no portable bf16: fp32 and bytes only (no MT_COMM_CAP_BF16). The
 * library calls MPI from the threads that call it; with MPI_THREAD_SINGLE or
 * FUNNELED that must be the thread that initialised MPI. With MPI
 * initialised at MPI_THREAD_SERIALIZED or more (MPI_Init_thread) the
 * communicator takes calls from any thread (MT_COMM_CAP_THREADS), and a CPU
 * step sums its gradients on a thread of its own while backward goes on. */
mt_status mt_comm_mpi_create(MPI_Comm comm, double timeout_seconds, mt_comm **out);

#ifdef __cplusplus
}
#endif
#endif /* MEMTRAIN_MPI_H */
