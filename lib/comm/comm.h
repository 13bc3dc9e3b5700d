/*
 * comm/comm.h - the communicator behind mt_comm (comm.c), and what the
 * rest of the library calls on it.
 */
#ifndef MT_COMM_INTERNAL_H
#define MT_COMM_INTERNAL_H

#include "internal.h"
#include "memtrain/comm.h"

struct mt_comm {
    mt_comm_vtable vt; /* the caller's table, copied */
    void *self;
    int rank, size;
    _Atomic int broken; /* a call failed: every later one fails at once */
};

/* Collectives on behalf of a context, with a failure's message (naming
 * `what`, e.g. "the all-reduce of the gradients of h.3.qkv.w") kept on
 * ctx. all_reduce takes the context's device memory (through host memory
 * when a CUDA context has a host communicator); all_gather takes memory
 * the communicator reads (host memory for a host one). */
mt_status mti_comm_all_reduce(mt_context *ctx, const char *what, const void *send, void *recv,
                              size_t count, mt_comm_dtype dt, mt_comm_op op);
mt_status mti_comm_all_gather(mt_context *ctx, const char *what, const void *send, void *recv,
                              size_t count, mt_comm_dtype dt);

/* The stream a device communicator runs the context's collectives on (the
 * CUDA device's), or NULL. */
void *mti_comm_stream(const mt_context *ctx);
/* An all-gather of len bytes per rank of host memory, whatever the table
 * (a device table's goes through device memory of the context). */
mt_status mti_comm_host_gather(mt_context *ctx, const char *what, const void *send, void *recv,
                               size_t len);

/* Checks that every rank passes an equal record (len bytes, at most 256)
 * for `what` ("model", "trainer configuration"): one all-gather. Ranks
 * that disagree all get MT_ERR_COMM naming the first rank whose record
 * differs from rank 0's, and the field where, from `fields` (a name per
 * 8-byte word of the record; NULL: none). fn names the caller. */
mt_status mti_comm_agree(mt_context *ctx, const char *fn, const char *what, const void *record,
                         size_t len, const char *const *fields);

/* A 64-bit FNV-1a hash, continuing from h (start with MTI_HASH_START). */
#define MTI_HASH_START 0xcbf29ce484222325ull
uint64_t mti_hash(uint64_t h, const void *data, size_t n);

/* At context create: checks the communicator fits the device and the ranks
 * agree on the device kind and world size. */
mt_status mti_comm_attach(mt_context *ctx);

#endif /* MT_COMM_INTERNAL_H */
