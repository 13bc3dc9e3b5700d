/*
 * internal.h - names shared between the library's files (mti_ prefix).
 */
#ifndef MT_INTERNAL_H
#define MT_INTERNAL_H

#include <pthread.h>
#include <stdio.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "memtrain.h"
#include "memtrain/allocator.h"
#include "device/device.h"

#define MTI_ERR_LEN 1024

#if defined(__GNUC__)
#define MTI_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MTI_PRINTF(a, b)
#endif

/* Branch hints, for the allocators' hot paths (the one definition). */
#if defined(__GNUC__)
#define MTI_LIKELY(x) __builtin_expect(!!(x), 1)
#define MTI_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define MTI_COLD __attribute__((noinline, cold)) /* keeps rare paths out of hot ones */
#else
#define MTI_LIKELY(x) (x)
#define MTI_UNLIKELY(x) (x)
#define MTI_COLD
#endif

/* Returns the status of expr when it fails (s is the caller's mt_status). */
#define MTI_TRY(expr)                                                                          \
    do {                                                                                       \
        if ((s = (expr)) != MT_OK) return s;                                                   \
    } while (0)

/* ---- allocation tags (mt_alloc_request.tag, the traces' events) ----
 * node << 32 | tensor. Node 0: a pass's inputs and outputs (features,
 * tokens, targets, losses); node 1: what belongs to one parameter, with its
 * kind in the tensor's top 8 bits and the parameter in the low 24, and the
 * trainer's own tensors (kind MTI_TAG_TRAINER); node 2 + i: layer i's
 * activations, gradients and workspace (the tensor is the layer's slot). */
#define MTI_TAG(node, tensor) (((uint64_t)(node) << 32) | (uint64_t)(tensor))
typedef enum mti_tag_kind {
    MTI_TAG_WEIGHT = 0,  /* PARAM: the weight */
    MTI_TAG_MASTER = 1,  /* MASTER: its fp32 master */
    MTI_TAG_GRAD = 2,    /* GRAD: its gradient */
    MTI_TAG_STATE = 3,   /* OPTIM: optimizer state slot j is MTI_TAG_STATE + j (3..6) */
    MTI_TAG_MASK = 7,    /* PARAM: a pruned weight's mask (lib/sparse/sparse.h) */
    MTI_TAG_TRAINER = 8, /* the trainer's tensors (the tensor says which) */
    MTI_TAG_STAGE = 9,   /* a model's staging tensor for host reads and writes */
    MTI_TAG_COMM = 10    /* COMM: communication buffers (lib/comm/; the tensor says which) */
} mti_tag_kind;
#define MTI_TAG_PARAM(kind, i) MTI_TAG(1, ((uint64_t)(kind) << 24) | (uint64_t)(i))

/* ---- errors and logging (status.c) ---- */

/* A precision's name ("fp32", "fp16", "bf16"; mt_precision), NULL for
 * another value. */
const char *mti_precision_name(unsigned p);

/* Records a message for `s` on ctx (or on this thread when ctx is NULL),
 * logs it at debug level, and returns s. */
mt_status mti_fail(mt_context *ctx, mt_status s, const char *fmt, ...) MTI_PRINTF(3, 4);
void mti_log(const mt_context *ctx, mt_log_level level, const char *fmt, ...) MTI_PRINTF(3, 4);
/* Forgets the last failure on ctx (NULL: this thread's context-less one). */
void mti_clear_error(mt_context *ctx);
/* A copy of the last failure's message on ctx (NULL: this thread's), so
 * that a failure can quote the one before it in a single call:
 *     return mti_fail(ctx, s, "%s: %s", fn, mti_last_msg(ctx).s);
 * (the copy lives to the end of the full expression). */
typedef struct mti_msg {
    char s[MTI_ERR_LEN];
} mti_msg;
mti_msg mti_last_msg(const mt_context *ctx);

/* ---- traces (trace.c) ---- */

struct mt_trace {
    mt_trace_event *events;
    size_t capacity;
    _Atomic size_t n;         /* slots claimed; events kept = min(n, capacity) */
    _Atomic uint64_t dropped; /* events past capacity */
    uint64_t t0_ns;
    bool recording;
};

uint64_t mti_now_ns(void);
mt_status mti_trace_new(mt_context *ctx, size_t capacity, mt_trace **out);
void mti_trace_record(mt_trace *t, const mt_trace_event *ev);

/* ---- allocator instances (allocator.c) ---- */

struct mt_allocator {
    mt_context *ctx;
    const mt_allocator_vtable *vt;
    void *state;
    mt_backing backing;      /* handed to the allocator; self = this instance */
    mt_allocator_config cfg; /* as created */
    int index;               /* instance number in the context, -1 standalone */
    bool locked;
    pthread_mutex_t mu;

    mt_allocator_stats st;   /* measured by the library */
    uint64_t next_id;
    /* live bytes and blocks by lifetime and class, so a reset can be counted */
    uint64_t live_by_life[MT_LIFE_COUNT][MT_MEM_COUNT];
    uint64_t blocks_by_life[MT_LIFE_COUNT][MT_MEM_COUNT];

    mt_trace *trace;          /* the context's trace while recording, else NULL */
    uint64_t trace_first_id;  /* the first block id the trace has seen allocated */

    uint64_t n_backing_fails; /* failed backing calls, to tell whose reason a failure has */
    /* fault injection for tests: backing calls left before one fails (-1: never) */
    long fail_backing_in;
};

/* Makes an instance on ctx's device. index is its number in the context
 * (-1 for a standalone one). */
mt_status mti_allocator_new(mt_context *ctx, const mt_allocator_config *cfg, int index,
                            mt_allocator **out);
void mti_allocator_delete(mt_allocator *a);
/* Test hook: make the n-th next backing call of the instance fail with OOM
 * (n = 0: the very next one; n < 0: never). */
void mti_allocator_fail_backing_after(mt_allocator *a, long n);
/* Starts (t) or stops (NULL) recording the instance's events into t. */
void mti_allocator_set_trace(mt_allocator *a, mt_trace *t);
/* Sets the instance's peaks to the current values. */
void mti_allocator_reset_peak(mt_allocator *a);
/* How many allocations this thread's instances have refused at their
 * limit_bytes so far (a count that only grows). */
uint64_t mti_limit_refusals(void);

/* ---- context (context.c) ---- */

typedef struct mti_ops mti_ops;

struct mt_context {
    mt_context_config cfg;
    mti_device *dev;
    int threads;
    mt_allocator *inst[MT_MEM_COUNT]; /* distinct instances, n_inst of them */
    int n_inst;
    mt_allocator *by_class[MT_MEM_COUNT];
    mt_trace *trace;
    const mti_ops *ops;      /* kernel table of the device */
    int world, rank;         /* the ranks of the run (cfg.comm's; a dry context's
                                planned ones, cfg.world_size and cfg.rank) */
    bool dry;                /* an estimate's context: no memory behind the
                                blocks, ops that only take their workspace
                                (lib/engine/estimate.c) */
    uint64_t at_peak[MT_MEM_COUNT]; /* dry: each class's live bytes at live_peak */
    bool has_estimate;       /* the memory report shows it beside the measured figures */
    mt_estimate_report estimate;
    _Atomic int n_children;  /* models, trainers, standalone allocators alive */
    /* all the context's instances together (standalone ones excluded) */
    _Atomic uint64_t live_total, live_peak, reserved_total, reserved_peak;
    /* the communication layer's plan for the context (lib/comm/cplan.h):
     * its buffers, queues, statistics and the kind of communicator it plans
     * for; opaque outside lib/comm */
    struct mti_comm_plan *comm;
    /* memory a call that never completed (a collective that timed out) may
     * still write: the allocators never give back the reservation holding
     * it, and the device keeps its memory at destroy */
    const void *kept;
    size_t kept_bytes;
    /* places other than the device (lib/memory/place.c; the device's bytes are the
     * allocators'): live bytes per class, peaks, blocks made and removed;
     * changed on the thread that makes and destroys trainers */
    uint64_t place_live[MT_PLACE_COUNT][MT_MEM_COUNT], place_peak[MT_PLACE_COUNT][MT_MEM_COUNT];
    uint64_t place_total[MT_PLACE_COUNT], place_total_peak[MT_PLACE_COUNT];
    uint64_t place_n[MT_PLACE_COUNT][MT_MEM_COUNT][2];
    pthread_mutex_t err_mu;  /* guards err, which every thread may write */
    char err[MTI_ERR_LEN];   /* the last failure on the context, of any thread */
};

/* A dry context (lib/engine/estimate.c): cfg's allocators over a device with no
 * memory behind it and the dry op table of cfg's device kind; a CUDA one
 * takes the geometry of `like` when that is a CUDA device (may be NULL). */
mt_status mti_context_create_dry(const mt_context_config *cfg, const mti_device *like,
                                 mt_context **out);
/* mt_estimate_model without keeping the estimate with the context, for
 * rank `rank` of the model's world (its context's world size, and its
 * communication thread if it has one), without a communicator; -1: the
 * context's own rank. */
mt_status mti_estimate_model(const mt_model *m, const mt_trainer_config *tc, int rank,
                             mt_estimate_report *out);

/* Every allocator instance of the context reset at scope (memory.c): what
 * lives at most that long goes. */
void mti_context_reset(mt_context *ctx, mt_scope scope);

/* ---- places (place.c) ---- */

/* Counts bytes of class c held at place p (not the device's, which the
 * allocators count): add them, or give them back. */
void mti_place_add(mt_context *ctx, mt_place p, mt_mem_class c, uint64_t bytes);
void mti_place_sub(mt_context *ctx, mt_place p, mt_mem_class c, uint64_t bytes);
/* A block of page-locked host memory beside a CUDA device (place host, class
 * c; a dry context's bytes are counted at an address that holds nothing):
 * an mt_block whose handle is MTI_HOST_HANDLE, which mti_tensor_free hands
 * to mti_host_block_free. Refused: MT_ERR_OOM naming the amount. */
#define MTI_HOST_HANDLE 0x686F7374506C6365ull
mt_status mti_host_block_alloc(mt_context *ctx, size_t bytes, mt_mem_class c, uint64_t tag,
                               mt_block *out);
void mti_host_block_free(mt_context *ctx, mt_block *b);
/* The places' peaks back to their current values (mt_context_reset_peaks). */
void mti_place_reset_peaks(mt_context *ctx);

/* ---- tensors (tensor.c) ---- */

typedef enum mti_dtype { MTI_F32 = 0, MTI_F16 = 1, MTI_BF16 = 2, MTI_I32 = 3, MTI_U8 = 4 } mti_dtype;

#define MTI_MAX_DIMS 4

typedef struct mti_tensor {
    mt_block blk;
    mti_dtype dtype;
    int ndim;
    int64_t shape[MTI_MAX_DIMS];
} mti_tensor;

size_t mti_dtype_size(mti_dtype t);
int64_t mti_tensor_numel(const mti_tensor *t);
size_t mti_tensor_bytes(const mti_tensor *t);
/* Allocates t (whose dtype, ndim and shape are set) from the context's
 * allocator for class c. */
mt_status mti_tensor_alloc(mt_context *ctx, mti_tensor *t, mt_mem_class c, mt_lifetime life,
                           uint64_t tag);
void mti_tensor_free(mt_context *ctx, mti_tensor *t);
/* Host <-> tensor copies through the device. */
mt_status mti_tensor_upload(mt_context *ctx, mti_tensor *t, const void *src, size_t bytes);
mt_status mti_tensor_download(mt_context *ctx, const mti_tensor *t, void *dst, size_t bytes);
mt_status mti_tensor_zero(mt_context *ctx, mti_tensor *t);
/* Continues the FNV-1a hash *h over t's bytes, read through buf (chunk
 * bytes of host memory). */
mt_status mti_tensor_hash(mt_context *ctx, const mti_tensor *t, void *buf, size_t chunk,
                          uint64_t *h);

/* ---- files (fileio.c) ---- */

/* Reads a whole regular file of at most max_bytes into a malloc'd buffer. */
mt_status mti_read_file(mt_context *ctx, const char *path, size_t max_bytes, unsigned char **data,
                        size_t *size);
/* Writes a file crash-safely: temporary file, fsync, rename. */
mt_status mti_write_file_atomic(mt_context *ctx, const char *path, const void *data, size_t size);
/* The same, streamed: open a temporary beside path, write, then commit
 * (fsync, rename over path) or abort (the temporary is removed). A failed
 * write or commit aborts by itself. */
typedef struct mti_afile {
    int fd;
    char *tmp, *path;
    int unnamed; /* fd is an O_TMPFILE: it gets the name tmp only at commit */
} mti_afile;
mt_status mti_afile_open(mt_context *ctx, const char *path, mti_afile *f);
mt_status mti_afile_write(mt_context *ctx, mti_afile *f, const void *data, size_t n);
mt_status mti_afile_commit(mt_context *ctx, mti_afile *f);
void mti_afile_abort(mti_afile *f);

/* ---- small helpers ---- */

/* CRC-32 (IEEE), continuing from crc (start with 0). */
uint32_t mti_crc32(uint32_t crc, const void *data, size_t n);
/* A 64-bit FNV-1a hash, continuing from h (start with MTI_HASH_START). */
#define MTI_HASH_START 0xcbf29ce484222325ull
uint64_t mti_hash(uint64_t h, const void *data, size_t n);

/* Little-endian field access for file formats. */
static inline void mti_put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline void mti_put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint32_t mti_get_u32(const unsigned char *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static inline uint64_t mti_get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static inline bool mti_is_pow2(size_t x) { return x && !(x & (x - 1)); }
static inline size_t mti_align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

#endif /* MT_INTERNAL_H */
