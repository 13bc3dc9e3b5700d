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
    /* the first failure's message (which call, which rank, the table's
     * word: a timeout or an error), kept for every later failure to name;
     * cause_set once it is written */
    char cause[MTI_ERR_LEN];
    _Atomic int cause_set;
    /* what the call in progress is for, set around it by the library's
     * collectives on behalf of a context (the one thread calling): the
     * caller's words and its trainer step (0: none), for the cause */
    const char *call_what;
    uint64_t call_step;
};

/* Breaks c: every later call fails at once. The first time, why (with
 * c's call_what and call_step, or else `step` when not 0) becomes the cause
 * later failures name. */
void mti_comm_break(mt_comm *c, uint64_t step, const char *why);
/* The cause of c's breaking ("" while whole). */
const char *mti_comm_cause(const mt_comm *c);

/* Collectives on behalf of a context, on the context's memory (device
 * memory on CUDA), with a failure's message (naming `what`, e.g. "the
 * all-reduce of the gradients of h.3.qkv.w") kept on ctx. Arguments and
 * in-place forms as in memtrain/comm.h. A device communicator works on the
 * buffers themselves, on the device's stream; a host one never sees the
 * library's memory: each call goes through the context's staging buffer
 * (COMM class), MTI_COMM_STAGE bytes at a time (a copy in, the collective
 * in place, a copy out), so a collective that times out leaves MPI only
 * the staging buffer, which the context then never gives back. */
#define MTI_COMM_STAGE ((size_t)4 << 20)
/* Bytes per rank of a device communicator's record buffer (COMM). */
#define MTI_COMM_RECORD 256
mt_status mti_comm_all_reduce(mt_context *ctx, const char *what, const void *send, void *recv,
                              size_t count, mt_comm_dtype dt, mt_comm_op op);
mt_status mti_comm_reduce_scatter(mt_context *ctx, const char *what, const void *send, void *recv,
                                  size_t count, mt_comm_dtype dt, mt_comm_op op);
mt_status mti_comm_all_gather(mt_context *ctx, const char *what, const void *send, void *recv,
                              size_t count, mt_comm_dtype dt);
mt_status mti_comm_broadcast(mt_context *ctx, const char *what, void *buf, size_t count,
                             mt_comm_dtype dt, int root);
/* The same collectives within a group of the context's ranks (a
 * sub-communicator c of the context's, mt_comm_split: tensor parallel's):
 * staged through the context's buffers for a host table, on the context's
 * stream for a device one; the turn rule below holds for them too.
 * host_all_reduce: count fp32 values of host memory in place, whatever the
 * table. */
mt_status mti_comm_group_all_reduce(mt_context *ctx, mt_comm *c, const char *what,
                                    const void *send, void *recv, size_t count, mt_comm_dtype dt,
                                    mt_comm_op op);
mt_status mti_comm_group_reduce_scatter(mt_context *ctx, mt_comm *c, const char *what,
                                        const void *send, void *recv, size_t count,
                                        mt_comm_dtype dt, mt_comm_op op);
mt_status mti_comm_group_all_gather(mt_context *ctx, mt_comm *c, const char *what,
                                    const void *send, void *recv, size_t count, mt_comm_dtype dt);
mt_status mti_comm_group_host_all_reduce(mt_context *ctx, mt_comm *c, const char *what,
                                         float *buf, size_t count, mt_comm_op op);
mt_status mti_comm_group_broadcast(mt_context *ctx, mt_comm *c, const char *what, void *buf,
                                   size_t count, mt_comm_dtype dt, int root);
/* Point to point within group c (pipeline parallel's): send_bytes bytes of
 * send to rank `to` and recv_bytes bytes from rank `from` into recv, both
 * at once (either absent: to or from -1, its bytes 0); through the staging
 * buffer for a host table. The buffers are the context's memory, or with
 * host set host memory (a host table's only: a device table's caller
 * bounces them through device memory itself). */
mt_status mti_comm_group_sendrecv(mt_context *ctx, mt_comm *c, const char *what, const void *send,
                                  size_t send_bytes, int to, void *recv, size_t recv_bytes,
                                  int from, bool host);
/* While a trainer splits the ranks into groups (tensor parallel), the
 * context's own collectives (data parallel, ZeRO, the agreements) run
 * within its data-parallel group: narrow points ctx->cfg.comm, ctx->world
 * and ctx->rank at that group (dp: its communicator, NULL for a group of one
 * or in a dry context; world and rank: its size and this rank's place) and
 * keeps the world's; widen gives them back. mti_comm_world: the world's communicator,
 * size and rank whether narrowed or not (an estimate made meanwhile plans
 * for the world). */
void mti_comm_narrow(mt_context *ctx, mt_comm *dp, int world, int rank);
void mti_comm_widen(mt_context *ctx);
mt_comm *mti_comm_world(const mt_context *ctx, int *world, int *rank);
/* One all-reduce (sum, fp32, in place) of k pieces of host memory together,
 * through the staging buffer of a CPU context's host communicator: piece j
 * is n[j] values at p[j], or zeros whose sums are dropped when p[j] is NULL.
 * The pieces together fit in MTI_COMM_STAGE bytes, or there is one piece
 * (then it goes in chunks). */
mt_status mti_comm_all_reduce_pieces(mt_context *ctx, const char *what, float *const *p,
                                     const size_t *n, int k);
/* A CPU context's host staging buffer (MTI_COMM_STAGE bytes of COMM, a dry
 * context's too, whose address is never touched), or NULL: ZeRO packs a
 * gradient's pieces into it directly (zero.c), no bucket between. */
void *mti_comm_stage(const mt_context *ctx);
/* The reduce-scatter (sum, fp32) of the staging buffer in place: count
 * values per rank, rank r's at r count; this rank's sums land at its own.
 * A thread other than the communication thread calls mti_comm_turn before
 * it packs the buffer. */
mt_status mti_comm_reduce_scatter_stage(mt_context *ctx, const char *what, size_t count);
/* The all-gather (bytes) of the staging buffer in place: `bytes` per rank,
 * this rank's at its own r bytes; afterwards rank r's at r bytes for every
 * r. ZeRO-3 packs the slices of several tensors into one (zero3.c). The
 * same turn rule as above. */
mt_status mti_comm_all_gather_stage(mt_context *ctx, const char *what, size_t bytes);
/* A collective of a thread other than the communication thread is about
 * to start (or to pack the staging buffer): what the communication
 * thread's queue holds goes first (ctx->comm->threads_q; exposed time), so the
 * two never call the communicator at once and every rank makes the
 * collectives in one order. MT_OK, or the failure of something queued
 * (MT_ERR_COMM and the like, "WHAT: an earlier collective on the
 * communication thread failed: ..."). Every collective below calls it. */
mt_status mti_comm_turn(mt_context *ctx, const char *what);
/* The calling thread runs collectives nobody waits for (overlap.c): their
 * time is not exposed. */
void mti_comm_on_thread(void);
/* ns spent waiting for collectives that ran elsewhere: exposed time. */
void mti_comm_waited(mt_context *ctx, uint64_t ns);
/* A thread of the process starts (+1) or ends (-1) waiting for a
 * communication thread's collectives (mti_overlap_wait); while one waits,
 * mti_comm_urgent() is true: the collectives are exposed, and a host
 * communicator's thread should finish them as fast as it can rather than
 * leave the core to computation (comm_mpi.c's polling). */
void mti_comm_hurry(int delta);
int mti_comm_urgent(void);

/* The stream a device communicator runs the context's collectives on (the
 * CUDA device's), or NULL. */
void *mti_comm_stream(const mt_context *ctx);
/* An all-gather of len bytes per rank of host memory, whatever the table
 * (a device table's goes through device memory of the context). */
mt_status mti_comm_host_gather(mt_context *ctx, const char *what, const void *send, void *recv,
                               size_t len);

/* ---- the ranks' agreement on their settings (agree.c) ---- */

/* Bytes of a setting's value as a message shows it (with its NUL). */
#define MTI_SHOWN 48
/* A setting every rank must give alike: its name as a message gives it
 * ("distill_temp", "the model (layers and shapes)"), its value as 8 bytes
 * compared bit for bit (a number, or a hash of text or a table), that
 * value as text, and what to do about a difference (NULL: "every rank must
 * make the same call"). */
typedef struct mti_setting {
    const char *name, *hint;
    uint64_t v;
    char kind;           /* 'i', 'f', 'd', 'h': a number, float, double or hash, its
                            text made from v; 's': text of its own (a name, strings) */
    char shown[MTI_SHOWN];
} mti_setting;
/* A list of settings, made with mti_set_*: the first MTI_MAX_SETTINGS
 * (past them, each one's value is hashed into the last, so a difference is
 * still found). */
#define MTI_MAX_SETTINGS 96
typedef struct mti_settings {
    mti_setting s[MTI_MAX_SETTINGS];
    int n;
} mti_settings;
/* A number, shown in decimal. */
void mti_set_int(mti_settings *l, const char *name, int64_t v);
/* A float or a double, compared bit for bit, shown as the shortest %g
 * that reads back as it. */
void mti_set_float(mti_settings *l, const char *name, float v);
void mti_set_double(mti_settings *l, const char *name, double v);
/* A hash (of weights, of a table), shown as "#" and its top 8 hex digits. */
void mti_set_hash(mti_settings *l, const char *name, uint64_t h);
/* A value of an enumeration, compared as the number v, shown as text (its
 * name; NULL: the number). */
void mti_set_named(mti_settings *l, const char *name, int64_t v, const char *text);
/* n strings (patterns, paths; NULL text or n 0: none), compared as a hash
 * of them all, shown joined by commas and cut short with "...". */
void mti_set_texts(mti_settings *l, const char *name, const char *const *text, int n);
/* One string, or NULL. */
void mti_set_text(mti_settings *l, const char *name, const char *text);
/* The hint of the setting added last. */
void mti_set_hint(mti_settings *l, const char *hint);
/* h as mti_set_hash shows it. */
void mti_hash_shown(uint64_t h, char shown[MTI_SHOWN]);
/* "rank 0 A, rank 2 B" into buf: rank 0's value, then each rank's whose
 * value differs from rank 0's (up to 8 of them, then "and N more ranks").
 * Rank r's value is the vlen bytes at vals + r vstride, its text at
 * shown + r sstride. */
void mti_ranks_values(char *buf, size_t cap, int n, const unsigned char *vals, size_t vstride,
                      size_t vlen, const char *shown, size_t sstride);
/* Checks that every rank gives the same settings l (the same list, in the
 * same order, on every rank): one all-gather of their values, and a second
 * of the first differing one's text only when they differ. Ranks that
 * disagree all get MT_ERR_COMM, "FN: the ranks disagree on NAME: rank 0 A,
 * rank 1 B (HINT)". `what` names the whole for a failed collective ("the
 * trainer's settings"). */
mt_status mti_comm_agree(mt_context *ctx, const char *fn, const char *what, const mti_settings *l);


/* Whether c (may be NULL) works on device memory (MT_COMM_CAP_DEVICE). */
bool mti_comm_is_device(const mt_comm *c);
/* At context create, first: the context's communication plan (ctx->comm,
 * comm/cplan.h), for its communicator c; without one, a dry context
 * (dry: an estimate) plans the kind a run of its device takes (NCCL, on
 * device memory, on CUDA), or the kind `outer`, the dry context of an
 * estimate it is made within, planned. */
mt_status mti_comm_plan_new(mt_context *ctx, const mt_comm *c, const mt_context *outer, bool dry);
/* At context destroy, last: frees it (none: nothing). */
void mti_comm_plan_free(mt_context *ctx);
/* The trainer step (from 1; 0: outside one) the context's collectives
 * belong to from now on, named by a failure that breaks the communicator. */
void mti_comm_step(mt_context *ctx, uint64_t step);
/* This thread's collectives from now on are posted on a communication
 * stream and not waited for (on), or are the usual blocking ones: their
 * time is counted where they are waited for (nccl.c sets it, from
 * mti_nccl_post_begin to mti_nccl_post_end); and whether they are now. */
void mti_comm_set_posting(bool on);
bool mti_comm_posting(void);
/* At context create, once the allocators are made: the buffers a run of
 * several ranks holds until destroy (dry contexts too, so estimates count
 * them): a CPU context's staging (MTI_COMM_STAGE bytes of COMM), a CUDA
 * context's record buffer for a device communicator (MTI_COMM_RECORD bytes
 * per rank of COMM) or its host staging for a host one (malloc'd). */
mt_status mti_comm_buffers(mt_context *ctx);
/* At context destroy: frees them, except staging a broken communicator may
 * still hold (kept: see mt_context.kept). */
void mti_comm_free_buffers(mt_context *ctx);
/* At context create: checks the communicator fits the device and the ranks
 * agree on the device kind and world size. */
mt_status mti_comm_attach(mt_context *ctx);

#endif /* MT_COMM_INTERNAL_H */
