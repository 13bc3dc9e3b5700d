/*
 * memtrain/comm.h - communicators: the ranks of a run talking to each other.
 *
 * A communicator (mt_comm) joins the processes of a data-parallel run, one
 * rank each. It is given to mt_context_create in mt_context_config.comm;
 * without one a context is a world of size 1 and nothing below is used.
 * Three ways to make one:
 *   - from an MPI_Comm the application owns: mt_comm_mpi_create in
 *     memtrain/mpi.h, linked from libmemtrain_mpi.a (so libmemtrain.a never
 *     needs MPI);
 *   - NCCL, for CUDA contexts: mt_comm_nccl_create, with libnccl.so.2 loaded
 *     at run time (as the CUDA driver is), bootstrapped through any other
 *     communicator or from a unique id the application spreads itself;
 *   - the application's own (Gloo, UCC, its framework's): a table of
 *     functions (mt_comm_vtable) given to mt_comm_create.
 *
 * The collectives (all-reduce, reduce-scatter, all-gather, broadcast,
 * barrier) and the point-to-point calls (send, receive, both at once; ABI
 * version 2, optional) take counts in elements of an mt_comm_dtype; a
 * table may also split into sub-communicators (ABI version 2, optional). A communicator
 * without MT_COMM_CAP_DEVICE works on host memory (the library uses it with
 * CPU contexts); one with it works on device memory of a CUDA context,
 * ordered on the stream it is given (NCCL).
 *
 * Rules a table follows (the library checks arguments before calling it):
 *   1. Every rank makes the same calls in the same order, with the same
 *      counts, types and roots: the library never issues a collective on
 *      only some ranks, and an application using the table itself must not.
 *      Point-to-point calls involve two ranks only: between any two ranks,
 *      the sends of one to the other are received by the other's receives
 *      from it in the same order, with the same counts and types.
 *   2. No call blocks for ever: a peer that died or stalled makes the call
 *      return MT_ERR_COMM within the table's timeout. After a call fails
 *      the table may fail every later call with MT_ERR_COMM; the library
 *      treats the communicator as broken from then on (mt_comm_broken),
 *      and the only way on is to destroy it and make a new one.
 *   3. Buffers may overlap only as the in-place forms below allow (the
 *      mt_comm_* calls refuse any other overlap: MT_ERR_INVALID_ARG).
 *      A call that failed may still have written any part of recv.
 *   4. Functions return MT_OK or an mt_status, never print or abort; the
 *      optional last_error gives the message of the last failure.
 * A communicator is used by one thread at a time.
 */
#ifndef MEMTRAIN_COMM_H
#define MEMTRAIN_COMM_H

#include "../memtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever mt_comm_vtable changes. Version 2 added sendrecv and
 * split at the end; a version-1 table (abi_version 1, struct_size up to
 * and without them: offsetof(mt_comm_vtable, sendrecv)) is still taken,
 * and has neither point-to-point calls nor sub-communicators. */
#define MT_COMM_ABI_VERSION 2u

typedef enum mt_comm_dtype {
    MT_COMM_BYTE = 0, /* raw bytes: all-gather and broadcast only, never reduced */
    MT_COMM_F32 = 1,
    MT_COMM_BF16 = 2  /* only on tables with MT_COMM_CAP_BF16 */
} mt_comm_dtype;

typedef enum mt_comm_op {
    MT_COMM_SUM = 0,
    MT_COMM_MAX = 1
} mt_comm_op;

/* Capability flags of a vtable */
#define MT_COMM_CAP_DEVICE 0x1u /* buffers are CUDA device memory; calls run on `stream` */
#define MT_COMM_CAP_BF16 0x2u   /* reduces MT_COMM_BF16 */
/* Calls may come from any thread (still one at a time): the library then
 * sums a CPU step's gradients (the fused step's too) on a thread of its
 * own while backward goes on, and ZeRO-3 gathers the next layers' weights
 * there (docs/distributed.md). The MPI communicator says so when MPI runs at
 * MPI_THREAD_SERIALIZED or more. */
#define MT_COMM_CAP_THREADS 0x4u

typedef struct mt_comm_vtable {
    uint32_t abi_version; /* MT_COMM_ABI_VERSION */
    uint32_t struct_size; /* sizeof(mt_comm_vtable) */
    const char *name;     /* short, lower case, no spaces ("mpi", "nccl") */
    uint32_t caps;        /* MT_COMM_CAP_* */

    /* recv[i] = op over ranks of send[i], i < count. send == recv: in place. */
    mt_status (*all_reduce)(void *self, const void *send, void *recv, size_t count,
                            mt_comm_dtype dt, mt_comm_op op, void *stream);
    /* send holds size * count elements; rank r gets in recv the op over
     * ranks of send[r * count .. (r + 1) * count). recv == send + rank *
     * count (in elements): in place. */
    mt_status (*reduce_scatter)(void *self, const void *send, void *recv, size_t count,
                                mt_comm_dtype dt, mt_comm_op op, void *stream);
    /* recv (size * count elements) gets every rank's count elements of send,
     * in rank order. send == recv + rank * count: in place. */
    mt_status (*all_gather)(void *self, const void *send, void *recv, size_t count,
                            mt_comm_dtype dt, void *stream);
    /* buf (count elements) on every rank gets root's. */
    mt_status (*broadcast)(void *self, void *buf, size_t count, mt_comm_dtype dt, int root,
                           void *stream);
    /* Returns once every rank has called it (or MT_ERR_COMM past the timeout). */
    mt_status (*barrier)(void *self);
    /* The message of the last failed call, or NULL. May be NULL. */
    const char *(*last_error)(void *self);
    /* Frees self (mt_comm_destroy calls it). May be NULL. */
    void (*destroy)(void *self);

    /* ---- ABI version 2 ---- */
    /* Point to point: sends send_count elements of send to rank `to` and
     * receives recv_count elements from rank `from` into recv, and returns
     * once both are done (each may be absent: to or from -1, its count 0).
     * Both are started before either is waited for, so two ranks may each
     * send to the other in one call without deadlock. Neither peer is the
     * caller. A peer that died or stalled makes the call return
     * MT_ERR_COMM within the timeout (rule 2); a message of another length
     * than recv_count is MT_ERR_COMM too where the table can tell. NULL: the
     * table has no point-to-point calls (mt_comm_sendrecv and the layouts
     * that need them give MT_ERR_UNSUPPORTED). */
    mt_status (*sendrecv)(void *self, const void *send, size_t send_count, int to, void *recv,
                          size_t recv_count, int from, mt_comm_dtype dt, void *stream);
    /* A collective (every rank calls it, rule 1): the ranks with the same
     * color >= 0 form a new instance of this table, *out_self, in which
     * this rank is *out_rank of *out_size (ranks ordered by key, then by
     * their rank here); color -1: this rank joins none (*out_self NULL).
     * No rank may wait for ever: a rank that never calls it makes the
     * others MT_ERR_COMM within the timeout (rule 2). NULL: the table
     * cannot split (mt_comm_split gives MT_ERR_UNSUPPORTED). */
    mt_status (*split)(void *self, int color, int key, void **out_self, int *out_rank,
                       int *out_size);
} mt_comm_vtable;

/* Wraps a table as a communicator of `size` ranks (1 .. 65536) in which
 * this process is `rank`. self is passed to every function and, through
 * destroy, freed by mt_comm_destroy; on failure destroy is not called.
 * MT_ERR_VERSION for another abi_version or a struct_size other than
 * sizeof(mt_comm_vtable), MT_ERR_INVALID_ARG for a table
 * missing a function; messages in mt_last_error(NULL). */
mt_status mt_comm_create(const mt_comm_vtable *vt, void *self, int rank, int size,
                         mt_comm **out);
/* Frees a communicator (its table's destroy). Contexts made with it must be
 * destroyed first. NULL is accepted. */
void mt_comm_destroy(mt_comm *c);
/* This process's rank and the number of ranks (0 and 1 for NULL). */
int mt_comm_rank(const mt_comm *c);
int mt_comm_size(const mt_comm *c);
/* 1 once a call on the communicator has failed with MT_ERR_COMM (see rule
 * 2): every later collective fails at once, its message naming that first
 * failure (the call, this rank, the table's message: a timeout or an error;
 * for the library's own collectives what they were for and the trainer
 * step). */
int mt_comm_broken(const mt_comm *c);
/* The table's name ("mpi", "nccl", ...). */
const char *mt_comm_name(const mt_comm *c);

/* The collectives, for applications (the library calls the same). Arguments
 * are checked (counts, types, roots, the table's capabilities), then the
 * table is called; a failure is MT_ERR_COMM with the table's message in
 * mt_last_error(NULL), and breaks the communicator. stream: a CUstream for
 * MT_COMM_CAP_DEVICE tables (NULL: the default stream), ignored otherwise. */
mt_status mt_comm_all_reduce(mt_comm *c, const void *send, void *recv, size_t count,
                             mt_comm_dtype dt, mt_comm_op op, void *stream);
mt_status mt_comm_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                                 mt_comm_dtype dt, mt_comm_op op, void *stream);
mt_status mt_comm_all_gather(mt_comm *c, const void *send, void *recv, size_t count,
                             mt_comm_dtype dt, void *stream);
mt_status mt_comm_broadcast(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root,
                            void *stream);
mt_status mt_comm_barrier(mt_comm *c);
/* Point to point (the table's sendrecv; MT_ERR_UNSUPPORTED for a table
 * without one): count elements of buf to rank `to`, from rank `from` into
 * buf, or both at once (send and recv must not overlap; to or from -1 for
 * none). MT_ERR_INVALID_ARG for a peer out of range or the caller itself.
 * A failure breaks the communicator, as a collective's does. */
mt_status mt_comm_send(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int to,
                       void *stream);
mt_status mt_comm_recv(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int from,
                       void *stream);
mt_status mt_comm_sendrecv(mt_comm *c, const void *send, size_t send_count, int to, void *recv,
                           size_t recv_count, int from, mt_comm_dtype dt, void *stream);
/* 1 when the communicator's table has point-to-point calls (sendrecv). */
int mt_comm_has_p2p(const mt_comm *c);
/* Sub-communicators (the table's split; MT_ERR_UNSUPPORTED for a table
 * without one): a collective over c, every rank calling it; the ranks
 * whose color (0 .. 2^30) is equal form a new communicator *out, ranked by
 * key and then by their rank in c; color -1 gives *out NULL. *out uses
 * c's table and timeout and is destroyed on its own (before c or after).
 * MT_ERR_INVALID_ARG for a color below -1 or above 2^30; a failure
 * (MT_ERR_COMM: a rank that never came) breaks c. */
mt_status mt_comm_split(mt_comm *c, int color, int key, mt_comm **out);

/* What a context's communication took, since its creation. */
typedef struct mt_comm_stats {
    uint64_t collectives;   /* collectives the library issued for the context */
    double seconds;         /* the time they took, wherever they ran */
    double exposed_seconds; /* the time the context's callers waited for them: all of a
                               collective run in the call, and only the wait at the end of
                               backward for the gradients' collectives a communication
                               thread ran during it (overlap) */
} mt_comm_stats;
/* The context's communication figures (all 0 without a communicator). */
mt_status mt_context_comm_stats(const mt_context *ctx, mt_comm_stats *out);

/* ---- NCCL (CUDA contexts) ---- */

/* The 128 bytes one rank makes and every rank of a NCCL communicator is
 * made from (ncclUniqueId). */
typedef struct mt_nccl_id {
    unsigned char bytes[128];
} mt_nccl_id;

typedef struct mt_nccl_config {
    uint32_t struct_size;
    const char *nccl_path;   /* NULL: the environment variable MT_NCCL_PATH if set, else
                                the first libnccl.so.2 that loads: on the loader's path,
                                in lib64/ and lib/ of $CUDA_HOME, $CUDA_PATH and
                                /usr/local/cuda, then in nvidia/nccl/lib of the
                                site-packages of the python3 on PATH (PyTorch's pip
                                wheel) and of ~/.local; MT_ERR_NO_DEVICE naming every
                                path tried when none does */
    const char *cuda_driver_path; /* NULL: "libcuda.so.1"; used to poll streams */
    double timeout_seconds;  /* a collective not done by then aborts the NCCL
                                communicator and gives MT_ERR_COMM (600) */
    int device_ordinal;      /* the CUDA device of this rank (0); one rank per GPU: its
                                primary context is made current around every NCCL call
                                (docs/distributed.md); no such device: MT_ERR_INVALID_ARG */
} mt_nccl_config;
void mt_nccl_config_init(mt_nccl_config *cfg);

/* Makes a fresh unique id (ncclGetUniqueId): on one rank, which then gives
 * it to the others by any channel. MT_ERR_NO_DEVICE when NCCL cannot be
 * loaded. */
mt_status mt_nccl_unique_id(const mt_nccl_config *cfg, mt_nccl_id *out);
/* Makes this process's rank of a NCCL communicator of `size` ranks from a
 * unique id every rank was given (ncclCommInitRank; blocks until every rank
 * has joined, or cfg->timeout_seconds pass: then MT_ERR_COMM, and what NCCL
 * makes of the setup later is aborted), on the CUDA device
 * cfg->device_ordinal names, whose primary
 * context the communicator makes current around each of its calls (any
 * thread may call; what it had current is restored). Collectives take
 * device memory and a CUstream on that device, and bf16 is reduced
 * natively. */
mt_status mt_comm_nccl_create(const mt_nccl_config *cfg, const mt_nccl_id *id, int rank, int size,
                              mt_comm **out);
/* The same, bootstrapped through another communicator (host memory; e.g.
 * MPI): rank 0 makes the id and broadcasts it over `boot`, which then can be
 * destroyed or kept. Ranks and size are those of `boot`. */
mt_status mt_comm_nccl_create_over(const mt_nccl_config *cfg, mt_comm *boot, mt_comm **out);

#ifdef __cplusplus
}
#endif
#endif /* MEMTRAIN_COMM_H */
