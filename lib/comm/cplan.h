/*
 * comm/cplan.h - a context's communication plan: what the communication
 * layer keeps for a context (mt_context.comm points to it, opaquely to the
 * rest of the library). Made at context create (mti_comm_plan_new, comm.c)
 * for every context, dry ones too: an estimate plans the buffers and the
 * queues of the run it stands for from the kind of communicator it names
 * or the outer estimate kept. Only lib/comm/ (and tests reaching into it)
 * include this file.
 */
#ifndef MT_COMM_CPLAN_H
#define MT_COMM_CPLAN_H

#include <stdatomic.h>
#include <stdbool.h>

#include "internal.h"

typedef struct mti_comm_plan mti_comm_plan;

struct mti_comm_plan {
    /* the communicator takes calls from any thread (MT_COMM_CAP_THREADS),
     * kept by a dry context, which drops the communicator, so that an
     * estimate plans the communication thread's memory (ZeRO-2) */
    bool threads;
    /* the communicator is NCCL's (or none is named: a CUDA estimate assumes
     * it), kept by a dry context so that an estimate plans the
     * communication stream's memory */
    bool nccl;
    /* the communicator works on device memory (MT_COMM_CAP_DEVICE; none
     * named in a dry context: assumed, as NCCL is), kept by a dry context
     * so that an estimate within an estimate plans the same buffers */
    bool device;
    /* narrowed to a data-parallel group (mti_comm_narrow): the world's */
    bool narrowed;
    mt_comm *world_comm;
    int world, rank;
    /* the buffers a run of several ranks holds from creation to destroy */
    mt_block stage;   /* COMM: host staging of a host communicator (CPU context) */
    mt_block records; /* COMM: device buffer for the records of a device communicator */
    void *host_stage; /* a CUDA context's host staging for a host communicator (the
                         context's allocators hold device memory: malloc'd) */
    /* what the context's collectives took (mt_context_comm_stats) */
    _Atomic uint64_t calls, ns, wait_ns;
    /* the trainer step (counted from 1) the context's collectives belong
     * to, 0 outside one: the first failure that breaks the communicator
     * names it (comm.c) */
    _Atomic uint64_t step;
    /* the trainers' queues (comm/queue.h), lists linked through the
     * backends: the communication threads (overlap.c) and NCCL's streams
     * (nccl_overlap.c); a collective of another thread or on the device's
     * stream first waits until they are empty */
    struct mti_overlap *threads_q;
    struct mti_ncclov *streams_q;
    /* their waits, set by the backend that made the first queue of each
     * list (mti_overlaps_quiet, mti_ncclovs_quiet), so that comm.c, which
     * they sit on, reaches them without calling up */
    mt_status (*quiet_threads)(mt_context *ctx, const char *what);
    mt_status (*quiet_streams)(mt_context *ctx, const char *what);
};

#endif /* MT_COMM_CPLAN_H */
