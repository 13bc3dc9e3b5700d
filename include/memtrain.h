/*
 * memtrain.h - train neural networks within a memory budget, from C.
 *
 * This header is the manual: every public function is documented where it is
 * declared. Conventions:
 *   - Every function that can fail returns an mt_status; MT_OK (0) is success.
 *   - On failure nothing the caller owns is changed, output pointers are left
 *     as they were (or set to NULL where the documentation says so), and a
 *     message saying what was wrong with which argument is kept: read it with
 *     mt_last_error(ctx).
 *   - The library never aborts, exits or prints. Logging goes through the
 *     callback in mt_context_config.
 *   - Handles are opaque. Configuration structs start with struct_size and
 *     have an _init function that fills the defaults: always call it first, so
 *     a program built against an older header keeps working.
 *   - A NULL configuration (mt_context_config, mt_allocator_config,
 *     mt_trainer_config, and the configs of the estimates) means its
 *     defaults, as its _init sets them. What says what to build or read (a
 *     model spec, an mt_data_config) is never NULL: MT_ERR_INVALID_ARG.
 *
 * The allocator plug-in contract (for people writing their own allocator) is
 * in memtrain/allocator.h; communicators (data-parallel runs over MPI, NCCL
 * or the application's own) are in memtrain/comm.h and memtrain/mpi.h.
 */
#ifndef MEMTRAIN_H
#define MEMTRAIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MT_VERSION_MAJOR 0
#define MT_VERSION_MINOR 1
#define MT_VERSION_PATCH 0
#define MT_VERSION_STRING "0.1.0"

/* The library's version string, e.g. "0.1.0". */
const char *mt_version(void);

/* The class of instructions the CPU kernels use, one of "baseline" (x86-64
 * with SSE2 only, or the baseline of another architecture such as
 * aarch64), "avx2" (AVX2 and F16C), "avx512" (AVX-512 F, BW, CD, DQ, VL),
 * "avx512_bf16" or "amx": the most this CPU and its OS support, capped by
 * the environment variable MT_CPU_ISA when it names one of these classes
 * (read once, at the first call into the library that computes or makes
 * a context; it caps oneDNN's code too). An MT_CPU_ISA that names no
 * class makes mt_context_create fail with MT_ERR_INVALID_ARG, and its
 * message lists the classes. docs/kernels.md says what differs in bits
 * between classes. Never NULL. */
const char *mt_cpu_isa(void);

/* ------------------------------------------------------------------------ */
/* Status codes                                                              */
/* ------------------------------------------------------------------------ */

typedef enum mt_status {
    MT_OK = 0,
    MT_ERR_INVALID_ARG = 1, /* an argument is NULL, out of range or inconsistent */
    MT_ERR_OOM = 2,         /* out of memory: an allocator limit, the device or the host */
    MT_ERR_NO_DEVICE = 3,   /* the device asked for is not there (no driver, no GPU, bad ordinal) */
    MT_ERR_DEVICE = 4,      /* a call into the device driver failed */
    MT_ERR_IO = 5,          /* a file could not be opened, read or written */
    MT_ERR_FORMAT = 6,      /* a file is corrupt, truncated, or of an unknown version */
    MT_ERR_BAD_BLOCK = 7,   /* free of a block the allocator did not hand out, or already freed */
    MT_ERR_VERSION = 8,     /* a plug-in table has an ABI version this library does not speak */
    MT_ERR_UNSUPPORTED = 9, /* a valid request this build or device cannot do */
    MT_ERR_STATE = 10,      /* the call is not valid in the object's current state */
    MT_ERR_BUDGET = 11,     /* a memory budget cannot be met */
    MT_ERR_INTERNAL = 12,   /* a bug in memtrain: please report it */
    MT_ERR_PLUGIN = 13,     /* a plug-in allocator broke its contract (memtrain/allocator.h):
                               a NULL or misaligned block, or, in checking mode, a block
                               outside its memory or over a live one; the message says which */
    MT_ERR_COMM = 14        /* a collective failed or timed out (a rank died or stalled),
                               or the ranks of a run disagree (memtrain/comm.h) */
} mt_status;

/* A short constant description of a status, e.g. "out of memory". Never NULL. */
const char *mt_status_string(mt_status s);

/* ------------------------------------------------------------------------ */
/* Memory classes, lifetimes, scopes                                         */
/* ------------------------------------------------------------------------ */

/* Every allocation carries the class of what it holds. Stats, traces and
 * budgets are kept per class, and each class can have its own allocator. */
typedef enum mt_mem_class {
    MT_MEM_PARAM = 0,  /* weights in compute precision */
    MT_MEM_MASTER = 1, /* fp32 master weights (mixed precision) */
    MT_MEM_GRAD = 2,   /* gradients */
    MT_MEM_OPTIM = 3,  /* optimizer state */
    MT_MEM_ACT = 4,    /* activations kept for backward */
    MT_MEM_WORK = 5,   /* temporaries inside one op */
    MT_MEM_IO = 6,     /* batches, targets, logits */
    MT_MEM_COMM = 7,   /* communication buffers of a run of several ranks: the staging
                          of collectives, buckets, gather buffers (docs/distributed.md) */
    MT_MEM_COUNT = 8
} mt_mem_class;

/* "PARAM", "MASTER", ... ; "?" for an out-of-range value. */
const char *mt_mem_class_name(mt_mem_class c);

/* How long a block is expected to live. Ordered: a block dies at a reset of
 * any scope whose value is <= its lifetime (see mt_scope). */
typedef enum mt_lifetime {
    MT_LIFE_PERSISTENT = 0, /* until freed, or a reset of MT_SCOPE_ALL */
    MT_LIFE_STEP = 1,       /* at most one training step */
    MT_LIFE_PHASE = 2,      /* at most one phase (an op, or forward / backward) */
    MT_LIFE_COUNT = 3
} mt_lifetime;

/* A reset boundary. A reset of scope S frees every live block whose lifetime
 * is >= S: MT_SCOPE_PHASE frees phase blocks, MT_SCOPE_STEP step and phase
 * blocks, MT_SCOPE_ALL everything. */
typedef enum mt_scope {
    MT_SCOPE_ALL = 0,
    MT_SCOPE_STEP = 1,
    MT_SCOPE_PHASE = 2
} mt_scope;

/* ------------------------------------------------------------------------ */
/* Devices and logging                                                       */
/* ------------------------------------------------------------------------ */

typedef enum mt_device_kind {
    MT_DEVICE_AUTO = 0, /* CUDA if a driver and a device are there, else the CPU */
    MT_DEVICE_CPU = 1,
    MT_DEVICE_CUDA = 2
} mt_device_kind;

typedef enum mt_log_level {
    MT_LOG_ERROR = 0,
    MT_LOG_WARN = 1,
    MT_LOG_INFO = 2,
    MT_LOG_DEBUG = 3
} mt_log_level;

/* Called for every message at or below the configured level. `msg` is valid
 * only during the call and has no trailing newline. */
typedef void (*mt_log_fn)(void *user, mt_log_level level, const char *msg);

/* ------------------------------------------------------------------------ */
/* Allocator choice                                                          */
/* ------------------------------------------------------------------------ */

/* The plug-in table; defined in memtrain/allocator.h. */
typedef struct mt_allocator_vtable mt_allocator_vtable;

/* The allocators that ship with memtrain. See docs/allocators.md. */
const mt_allocator_vtable *mt_allocator_caching(void);
const mt_allocator_vtable *mt_allocator_arena(void);
const mt_allocator_vtable *mt_allocator_pool(void);
/* The step-planning allocator: it records a training step and plans every
 * later step's blocks into one region (no relation to training-state
 * files; the name is historical). */
const mt_allocator_vtable *mt_allocator_checkpoint(void);
/* "caching", "arena", "pool" or "checkpoint"; NULL for any other name. */
const mt_allocator_vtable *mt_allocator_by_name(const char *name);
/* The i-th built-in allocator (0, 1, ... in the order above), NULL past the
 * last: mt_allocator_builtin(i)->name lists the names mt_allocator_by_name
 * takes. */
const mt_allocator_vtable *mt_allocator_builtin(int i);

/* flags of mt_allocator_config */
#define MT_ALLOCATOR_THREAD_SAFE 0x1u /* the instance takes a lock on every call */
/* Checking mode, for trying an allocator (your own, say): the library keeps
 * its own record of the memory the instance holds from its backing and of
 * the live blocks, and refuses (MT_ERR_PLUGIN, the block given back to the
 * allocator) a block that is not inside that memory or overlaps a live
 * block; a free of a block not live as handed out is MT_ERR_BAD_BLOCK
 * without reaching the allocator; memory the allocator gives back while a
 * live block is in it stays held (until destroy) and the next allocation
 * fails with MT_ERR_PLUGIN saying so. Costs a search and a record per call. */
#define MT_ALLOCATOR_CHECKED 0x2u

/* How one allocator instance is made. */
typedef struct mt_allocator_config {
    const mt_allocator_vtable *vtable; /* NULL: the library default (caching) */
    const void *options;  /* the allocator's own options struct (e.g. mt_caching_options), or NULL */
    size_t limit_bytes;   /* most bytes the instance may reserve; 0 = no limit but the device's */
    uint32_t flags;       /* MT_ALLOCATOR_* */
    uint32_t group;       /* see mt_context_config.allocators */
} mt_allocator_config;

/* Options of the built-in allocators. Each has an _init that sets defaults;
 * a NULL options pointer means those defaults. Sizes are in bytes. */

typedef struct mt_caching_options {
    uint32_t struct_size;
    size_t round_bytes;     /* requests round up to a multiple of this (512) */
    size_t small_max;       /* requests up to this go to the small pool (1 MiB) */
    size_t small_segment;   /* largest segment of the small pool (2 MiB); a pool's first
                               segments are smaller, 1/8 of what it holds */
    size_t medium_max;      /* requests up to this share large segments (10 MiB) */
    size_t large_segment;   /* largest shared segment for medium requests (20 MiB) */
    size_t huge_round;      /* larger requests get their own segment rounded to this (2 MiB) */
    size_t max_split_waste; /* in the large pools, a free block larger than the request
                               by more than this is split and the rest stays cached;
                               else it is handed out whole. The small pool always
                               splits. Default 0: always split (it measured best) */
} mt_caching_options;
void mt_caching_options_init(mt_caching_options *o);

typedef struct mt_arena_options {
    uint32_t struct_size;
    size_t chunk_bytes; /* size of each chunk taken from the backing (64 MiB) */
} mt_arena_options;
void mt_arena_options_init(mt_arena_options *o);

typedef struct mt_pool_options {
    uint32_t struct_size;
    const size_t *class_bytes; /* block sizes of the classes, ascending; NULL: geometric
                                  classes from min_class to max_class, 4 per power of two */
    size_t n_classes;
    size_t min_class;  /* 256 */
    size_t max_class;  /* 64 MiB; larger requests get their own backing block */
    size_t slab_bytes; /* a slab holds max(1, slab_bytes / class) blocks (2 MiB) */
} mt_pool_options;
void mt_pool_options_init(mt_pool_options *o);

typedef struct mt_checkpoint_options {
    uint32_t struct_size;
    int plan_after_steps; /* steps recorded before offsets are planned (1) */
} mt_checkpoint_options;
void mt_checkpoint_options_init(mt_checkpoint_options *o);

/* ------------------------------------------------------------------------ */
/* Context                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct mt_context mt_context;
/* A communicator joining the ranks of a data-parallel run (memtrain/comm.h). */
typedef struct mt_comm mt_comm;

typedef struct mt_context_config {
    uint32_t struct_size;       /* sizeof(mt_context_config) */
    mt_device_kind device;      /* MT_DEVICE_AUTO by default */
    int device_ordinal;         /* which CUDA device (0) */
    int threads;                /* CPU threads for kernels; 0 = all online CPUs. Each
                                   context keeps its own (contexts with different counts
                                   may run at once). Results never depend on it */
    mt_log_fn log_fn;           /* NULL: no logging */
    void *log_user;
    mt_log_level log_level;     /* MT_LOG_WARN */
    /* The allocator of each memory class. Classes whose configs are equal in
     * every field (vtable, options, limit, flags, group) share one instance,
     * so memory freed by one class can serve another; give classes different
     * groups to keep them apart. All NULL (the default): one caching
     * allocator for every class. */
    mt_allocator_config allocators[MT_MEM_COUNT];
    const char *cuda_driver_path; /* NULL: "libcuda.so.1" from the loader's path */
    size_t trace_capacity;        /* > 0: record allocation events from creation,
                                     at most this many (see mt_trace_*) */
    /* 1: a dry context, for planning: its allocators run over a device with
     * no memory behind it and its ops compute nothing, so models and
     * trainers on it cost no memory and steps no time, while every count
     * (mt_context_memory_stats) is what a real context would show. Models
     * made on it serve mt_estimate_model and mt_trainer_autofit; their
     * weights read back as zeros. A dry context of MT_DEVICE_CUDA (or AUTO
     * where a GPU is found) counts as a CUDA context does, with a current
     * NVIDIA GPU's allocation geometry (256-byte alignment, 2 MiB VMM
     * granularity); no GPU is needed. */
    int dry_run;
    /* The cuBLASLt library CUDA GEMMs use (copied; loaded at the first
     * GEMM). NULL or "": the environment variable MT_CUBLASLT_PATH if set
     * (read at the first GEMM),
     * else the first that loads of "libcublasLt.so.13" and ".so.12" on the
     * loader's path, then in lib64/ and lib/ of $CUDA_HOME, $CUDA_PATH and
     * /usr/local/cuda, then in the nvidia/cu13/lib and nvidia/cublas/lib
     * folders of the site-packages of the python3 on PATH (PyTorch's pip
     * wheels) and of ~/.local; one found so must drive the GPU through the
     * same libcuda.so.1 as the context. A path given (here or in
     * MT_CUBLASLT_PATH) is taken as it is, and is trusted to drive the
     * context's device. A GEMM that finds none fails with
     * MT_ERR_UNSUPPORTED naming every path tried. A process loads at most
     * 4 different ones. */
    const char *cublaslt_path;
    /* The ranks this process trains with (memtrain/comm.h), or NULL: a world
     * of one rank, nothing communicated. Borrowed: it must outlive the
     * context. A CPU context takes a host communicator (MPI, or a table
     * without MT_COMM_CAP_DEVICE; MT_ERR_UNSUPPORTED for a device one); a
     * CUDA context a device one (NCCL), or a host one through host memory
     * (docs/distributed.md). Creation is a collective: every rank
     * creates its context, and ranks whose device kinds or world sizes
     * differ get MT_ERR_COMM on every rank. A rank failing before that
     * exchange (a field refused, a device that does not open) returns its
     * own error at once; the others get MT_ERR_COMM at the communicator's
     * timeout. */
    mt_comm *comm;
    /* 1: CUDA debug mode. After every kernel launch and every GEMM the
     * context waits for the GPU, so a kernel that faults fails the call that
     * queued it, with the kernel's name, the op and its shapes in the message
     * (mt_last_error), instead of a later call failing with a message that
     * names no kernel. Slow: for finding a failing kernel. The environment
     * variable MT_CUDA_DEBUG_SYNC=1 turns it on for every CUDA context.
     * Nothing changes on the CPU. */
    int cuda_debug_sync;
    /* The rank a dry context plans for, when it has no communicator: rank
     * `rank` of `world_size` (0 or 1: a world of one). Under ZeRO
     * (mt_trainer_config.zero_stage) what a rank holds depends on the world
     * size and on the rank, so an estimate made before any communicator
     * exists (mt_estimate, `memtrain estimate --ranks N`) names them here.
     * Only for dry contexts (dry_run, and the contexts of the estimates):
     * a real context takes both from comm, and world_size > 1 without
     * dry_run is MT_ERR_INVALID_ARG. A dry context made from a
     * configuration with a communicator (mt_estimate_model on a data
     * parallel model) takes the communicator's; a world_size > 1 and rank
     * that differ from the communicator's are MT_ERR_INVALID_ARG. */
    int world_size;
    int rank;
} mt_context_config;

/* Fills cfg with the defaults. */
void mt_context_config_init(mt_context_config *cfg);

/* Creates a context (cfg NULL: the defaults): opens the device, makes the
 * allocators. On failure *out is set to NULL and the message is in
 * mt_last_error(NULL). Asking for CUDA where there is no driver or device
 * gives MT_ERR_NO_DEVICE and says which. */
mt_status mt_context_create(const mt_context_config *cfg, mt_context **out);

/* Frees everything the context owns. Models and trainers made from it must be
 * destroyed first (they are counted; MT_ERR_STATE otherwise, and nothing is
 * freed). Work still queued on the device ends first; where the device
 * reports a failure of it (a GPU kernel that faulted after the last call
 * that waited), everything is freed all the same and that status
 * (MT_ERR_DEVICE) is returned, its message in mt_last_error(NULL). NULL is
 * accepted and does nothing. */
mt_status mt_context_destroy(mt_context *ctx);

/* The message of the last failed call on ctx, or "" if none: this thread's
 * last failure on ctx if it had one, else the last of any thread. With ctx
 * NULL: the last failure of a call made without a context on this thread
 * (e.g. mt_context_create). Valid until the next call on the same context
 * from the same thread. */
const char *mt_last_error(const mt_context *ctx);

/* The device the context runs on (never MT_DEVICE_AUTO) and its name. */
mt_device_kind mt_context_device(const mt_context *ctx);
const char *mt_context_device_name(const mt_context *ctx);
/* The device's memory as its driver reports it now: bytes free and total
 * (CUDA: cuMemGetInfo, every process's use counted; CPU: MemAvailable and
 * MemTotal; a dry context: a placeholder total of 64 TiB, all free, since
 * it has no memory). Against the context's own
 * accounting (mt_context_memory_stats) it shows what the accounting does
 * not see: the driver's rounding, libraries' own allocations, other users.
 * Either pointer may be NULL. */
mt_status mt_context_device_memory(mt_context *ctx, uint64_t *free_bytes, uint64_t *total_bytes);

/* ------------------------------------------------------------------------ */
/* Allocator instances and blocks                                            */
/* ------------------------------------------------------------------------ */

typedef struct mt_allocator mt_allocator;

/* Request flags */
#define MT_REQ_RECOMPUTABLE 0x1u /* the contents can be recomputed if dropped */

#define MT_DEFAULT_ALIGNMENT 256u
#define MT_MAX_ALIGNMENT (1u << 30)

/* What a caller asks of an allocator. */
typedef struct mt_alloc_request {
    size_t bytes;           /* 0 gives an empty block (ptr NULL) without calling the allocator */
    size_t alignment;       /* a power of two <= MT_MAX_ALIGNMENT; 0 = MT_DEFAULT_ALIGNMENT */
    mt_mem_class mem_class;
    mt_lifetime lifetime;
    uint32_t flags;         /* MT_REQ_* */
    uint64_t tag;           /* free for the caller: the engine puts node << 32 | tensor */
} mt_alloc_request;

/* A block of memory handed out by an allocator. Pass it back unchanged to
 * free it. On a CUDA context `ptr` is a device address: never dereference it
 * on the host. */
typedef struct mt_block {
    void *ptr;
    size_t bytes;           /* as requested */
    uint64_t handle;        /* the allocator's own */
    uint64_t id;            /* the instance's sequence number of this allocation (from 1) */
    mt_mem_class mem_class;
    mt_lifetime lifetime;
} mt_block;

/* Per-class part of the stats. Bytes are requested bytes. */
typedef struct mt_class_stats {
    uint64_t live_bytes, peak_live_bytes;
    uint64_t n_alloc, n_free;
    uint64_t n_oom_failures;
} mt_class_stats;

/* Stats of one allocator instance. live = bytes requested by live blocks;
 * reserved = bytes taken from the backing (device) and not yet given back.
 * Efficiency = peak_reserved_bytes / peak_live_bytes. */
typedef struct mt_allocator_stats {
    uint64_t live_bytes, peak_live_bytes;
    uint64_t reserved_bytes, peak_reserved_bytes;
    uint64_t n_alloc, n_free;            /* successful allocations and frees (frees by reset included) */
    uint64_t n_backing_alloc, n_backing_free; /* calls that took or gave back backing memory */
    uint64_t n_oom_retries;   /* out-of-memory met by releasing cached memory and trying again */
    uint64_t n_oom_failures;  /* allocations that failed for lack of memory */
    uint64_t n_resets, n_trims;
    mt_class_stats per_class[MT_MEM_COUNT];
} mt_allocator_stats;

/* Makes a standalone allocator instance on the context's device (for
 * applications that manage their own memory, for replaying traces, for
 * tests). Its memory is counted in its own stats, not in the context's
 * classes. cfg NULL: the defaults (a caching allocator, no limit). Destroy
 * it before the context. */
mt_status mt_allocator_create(mt_context *ctx, const mt_allocator_config *cfg,
                              mt_allocator **out);
/* Frees all the instance's memory, live blocks included. NULL is accepted. */
void mt_allocator_destroy(mt_allocator *a);

/* The instance serving a memory class of the context. */
mt_status mt_context_allocator(mt_context *ctx, mt_mem_class c, mt_allocator **out);

/* Allocates. On failure *out is zeroed. MT_ERR_OOM when memory is exhausted
 * (the instance stays usable), MT_ERR_INVALID_ARG for a bad alignment, class
 * or lifetime. */
mt_status mt_alloc(mt_allocator *a, const mt_alloc_request *req, mt_block *out);
/* Allocates from the context's allocator for req->mem_class. */
mt_status mt_context_alloc(mt_context *ctx, const mt_alloc_request *req, mt_block *out);

/* Frees a block. MT_ERR_BAD_BLOCK if the block was not handed out by this
 * instance or was already freed (detected where the allocator can: see
 * docs/allocators.md). An empty block (ptr NULL, bytes 0) is accepted. */
mt_status mt_free(mt_allocator *a, const mt_block *blk);
mt_status mt_context_free(mt_context *ctx, const mt_block *blk);

/* Frees every live block whose lifetime ends at `scope` (see mt_scope). */
mt_status mt_allocator_reset(mt_allocator *a, mt_scope scope);
/* Gives cached, unused memory back to the device. */
mt_status mt_allocator_trim(mt_allocator *a);

/* Stats as measured by the library (live from requests, reserved from the
 * backing calls), with the allocator's own counters (retries, trims). */
mt_status mt_allocator_get_stats(const mt_allocator *a, mt_allocator_stats *out);
/* The stats the allocator reports of itself (its stats function), for
 * checking an allocator against the library's measurement.
 * MT_ERR_UNSUPPORTED if it has none. */
mt_status mt_allocator_self_stats(const mt_allocator *a, mt_allocator_stats *out);
/* The allocator's name ("caching", ...) */
const char *mt_allocator_name(const mt_allocator *a);

/* Runs the allocator conformance suite (docs/allocators.md) against an
 * allocator, your own say: instances made from cfg (its vtable, options and
 * flags; the suite sets its own limit_bytes) on ctx's device, each but one
 * in checking mode (MT_ALLOCATOR_CHECKED), through alignment, resets, trim,
 * out of memory under a limit, recovery after it, edge-case requests, bad
 * frees (only if the table claims MT_ALLOCATOR_CAP_DETECTS_BAD_FREE) and
 * randomized runs, checking every block's alignment, that it lies in
 * memory the instance holds and overlaps no live block, the per-class
 * accounting, and the allocator's own stats (if it keeps any) against the
 * library's; on a CPU context (not a dry one) it also writes the ends of
 * every block and checks them when the block is freed. MT_OK when every
 * property holds; else the status of the first that fails (MT_ERR_PLUGIN
 * for a broken contract, MT_ERR_OOM if the device runs out) and
 * mt_last_error(ctx) names the property and what went wrong. Nothing is
 * left allocated. */
mt_status mt_allocator_conformance(mt_context *ctx, const mt_allocator_config *cfg);

/* ------------------------------------------------------------------------ */
/* Memory stats and report of a context                                      */
/* ------------------------------------------------------------------------ */

typedef struct mt_memory_stats {
    mt_class_stats per_class[MT_MEM_COUNT];
    uint64_t live_bytes, peak_live_bytes;         /* all classes together */
    uint64_t reserved_bytes, peak_reserved_bytes; /* all the context's instances together */
    int n_allocators;                             /* instances serving the classes */
} mt_memory_stats;

mt_status mt_context_memory_stats(const mt_context *ctx, mt_memory_stats *out);

/* Where bytes are held. Every class's bytes have a place: the allocators'
 * are the device's; a trainer that offloads state (mt_trainer_config.offload)
 * holds it in page-locked host memory beside a CUDA device, or in scratch
 * files on disk, bringing a piece at a time into buffers on the device for
 * its update (docs/memory.md, "Places and offload"). */
typedef enum mt_place {
    MT_PLACE_DEVICE = 0, /* the context's device memory, from its allocators (on a CPU
                            context that is host memory): what budgets bound */
    MT_PLACE_HOST = 1,   /* host memory held beside a device that is not the host (a
                            CUDA context's page-locked memory, for host offload); nothing
                            on a CPU context */
    MT_PLACE_DISK = 2,   /* scratch files (mt_trainer_config.offload_dir) */
    MT_PLACE_COUNT = 3
} mt_place;

/* "device", "host", "disk"; "?" for an out-of-range value. */
const char *mt_place_name(mt_place p);

/* The stats of one place: per class live bytes and their peak, the place's
 * total and its peak, and n_alloc / n_free (blocks; for disk, the ranges
 * of scratch files made and removed). For MT_PLACE_DEVICE this is
 * mt_context_memory_stats; for the others reserved equals live (a scratch
 * file's bytes are its size) and n_allocators is 0. mt_context_reset_peaks
 * resets every place's peaks. */
mt_status mt_context_place_stats(const mt_context *ctx, mt_place p, mt_memory_stats *out);

/* Writes a human-readable memory report (a table per memory class and per
 * allocator instance) into buf, NUL-terminated and cut to cap bytes. *needed
 * (if not NULL) gets the length the whole report needs, without the NUL. */
mt_status mt_memory_report(const mt_context *ctx, char *buf, size_t cap, size_t *needed);

/* Resets the peak counters of the context (and its instances) to the current
 * values, so the next peak measured is that of what follows. */
mt_status mt_context_reset_peaks(mt_context *ctx);

/* ------------------------------------------------------------------------ */
/* Allocation traces                                                         */
/* ------------------------------------------------------------------------ */

typedef struct mt_trace mt_trace;

typedef enum mt_trace_op {
    MT_TRACE_ALLOC = 1,
    MT_TRACE_FREE = 2,
    MT_TRACE_RESET = 3, /* scope in `scope` */
    MT_TRACE_TRIM = 4,
    MT_TRACE_FAIL = 5   /* an allocation that failed */
} mt_trace_op;

typedef struct mt_trace_event {
    uint64_t t_ns;      /* nanoseconds since the trace started */
    uint64_t id;        /* the block's id (ALLOC, FREE); 0 otherwise */
    uint64_t bytes;     /* requested bytes (ALLOC, FAIL) */
    uint64_t tag;
    uint32_t alignment;
    uint8_t op;         /* mt_trace_op */
    uint8_t mem_class;
    uint8_t lifetime;
    uint8_t flags;      /* MT_REQ_* */
    uint8_t scope;      /* RESET */
    uint8_t instance;   /* which of the context's instances (0.. n_allocators-1) */
    uint8_t place;      /* mt_place: MT_PLACE_DEVICE (0) for the allocators' blocks; a
                           block held elsewhere (a scratch file's bytes on disk) is an
                           ALLOC and a FREE of its place, both with its bytes, which
                           replay, summaries and the SVG plot leave out (they are of
                           the device) and the Chrome export shows as its own counter */
} mt_trace_event;

/* Starts recording every allocation event of the context's instances,
 * keeping at most `capacity` events (later ones are counted as dropped).
 * Replaces a trace already being recorded. */
mt_status mt_context_trace_start(mt_context *ctx, size_t capacity);
/* Stops recording; the events stay until the next start or the context's end. */
mt_status mt_context_trace_stop(mt_context *ctx);
/* Writes the recorded events to a file (format in docs/formats.md). */
mt_status mt_context_trace_write(mt_context *ctx, const char *path);
/* The recorded events (borrowed; valid until the next trace call). */
mt_status mt_context_trace_events(mt_context *ctx, const mt_trace_event **events,
                                  size_t *count, uint64_t *dropped);

/* Loads a trace file. Corrupt or truncated files give MT_ERR_FORMAT.
 * With ctx NULL, the message goes to mt_last_error(NULL). */
mt_status mt_trace_load(mt_context *ctx, const char *path, mt_trace **out);
/* Makes a trace from events in memory (copied). */
mt_status mt_trace_from_events(mt_context *ctx, const mt_trace_event *events, size_t count,
                               mt_trace **out);
void mt_trace_free(mt_trace *t);
mt_status mt_trace_info(const mt_trace *t, size_t *count, uint64_t *dropped);
/* The events of a loaded trace (borrowed). */
const mt_trace_event *mt_trace_get_events(const mt_trace *t);
/* Writes a trace to a file. */
mt_status mt_trace_save(mt_context *ctx, const mt_trace *t, const char *path);

typedef struct mt_replay_result {
    uint64_t n_events, n_alloc, n_free, n_failed; /* n_failed: allocations the allocator refused */
    uint64_t peak_live_bytes, peak_reserved_bytes;
    double efficiency;    /* peak_reserved / peak_live */
    double seconds;       /* time spent in the allocator calls */
} mt_replay_result;

/* Replays a trace through an allocator instance (every event, whatever its
 * instance number). Blocks still live at the end are freed. The instance's
 * stats show the effect; `res` sums it up. */
mt_status mt_trace_replay(const mt_trace *t, mt_allocator *a, mt_replay_result *res);

/* ------------------------------------------------------------------------ */
/* Models                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct mt_model mt_model;
typedef struct mt_trainer mt_trainer;

/* Every model is a sequence of layers ending in a softmax cross-entropy
 * over the last layer's outputs. Feature models take (n, features) fp32
 * rows and one target class per row; token models take (n, seq_len) token
 * sequences and one target per token. The three ways to make one:
 * mt_model_create (any sequence of the layers below), mt_model_mlp_create
 * and mt_model_gpt_create. Every tensor a model and its trainer will use is
 * known from the spec before the first step. */

typedef enum mt_activation {
    MT_ACT_RELU = 1,
    MT_ACT_GELU = 2 /* tanh form */
} mt_activation;

typedef enum mt_layer_kind {
    /* y = x W^T + b: W (units, in), b (units) unless no_bias. */
    MT_LAYER_LINEAR = 1,
    MT_LAYER_RELU = 2,
    MT_LAYER_GELU = 3,      /* tanh form */
    /* over the features of each row, eps 1e-5, weight and bias */
    MT_LAYER_LAYERNORM = 4,
    /* token models, first layer only: a token embedding (padded_vocab, units)
     * plus, with `positions`, a learned position embedding (max_seq, units).
     * With `stable` it is a StableEmbedding (bitsandbytes): the token rows go
     * through a LayerNorm before the positions are added, the table is
     * Xavier-uniform initialised, and its optimizer state stays 32-bit. */
    MT_LAYER_EMBEDDING = 5,
    /* a GPT-2 pre-LayerNorm transformer block of width `in`: LayerNorm,
     * causal self-attention with `heads` heads (qkv and output projections
     * with biases), residual add, LayerNorm, MLP (4 * width, GELU), residual
     * add. In and out widths are equal. */
    MT_LAYER_BLOCK = 6,
    /* token models: logits over the vocabulary, x E^T with the token
     * embedding's table E (tied; no weights of its own, no bias). */
    MT_LAYER_LM_HEAD = 7
} mt_layer_kind;

typedef struct mt_layer_spec {
    mt_layer_kind kind;
    int units;     /* LINEAR: outputs; EMBEDDING: channels */
    int no_bias;   /* LINEAR: 1 for no bias */
    int heads;     /* BLOCK: attention heads; the width must be a multiple */
    int positions; /* EMBEDDING: 1 to add position embeddings */
    int stable;    /* EMBEDDING: 1 for a StableEmbedding */
} mt_layer_spec;

typedef enum mt_input_kind {
    MT_INPUT_FEATURES = 1, /* (n, features) fp32 */
    MT_INPUT_TOKENS = 2    /* (n, seq_len) token ids */
} mt_input_kind;

typedef enum mt_init_kind {
    MT_INIT_DEFAULT = 0, /* as torch.nn: Linear W, b uniform in +-1/sqrt(in); embeddings
                            N(0, 1); LayerNorm weight 1, bias 0; blocks as MT_INIT_GPT2 */
    MT_INIT_GPT2 = 1     /* GPT-2: weights and embeddings N(0, 0.02), the projections that
                            end a block's attention and MLP N(0, 0.02 / sqrt(2 * blocks)),
                            biases 0, LayerNorm weight 1 */
} mt_init_kind;

#define MT_MAX_LAYERS 4096

typedef struct mt_model_spec {
    uint32_t struct_size;
    mt_input_kind input;
    int features;       /* FEATURES: inputs per row */
    int vocab;          /* TOKENS: token ids and targets are in [0, vocab) */
    int padded_vocab;   /* TOKENS: rows of the token embedding, >= vocab (0: vocab
                           rounded up to a multiple of 128); extra rows start at 0 */
    int max_seq;        /* TOKENS: longest sequence */
    int n_layers;       /* 1 .. MT_MAX_LAYERS */
    const mt_layer_spec *layers; /* copied */
    mt_init_kind init;
    uint64_t seed;      /* weight init */
    /* 1: the weights are not made now but where they will live: the first
     * trainer created on the model (mt_trainer_create) reads or draws each
     * rank's own elements straight into their home (its ZeRO-3 slices,
     * param.bin with offload_params), and makes the rest whole; a call that
     * needs them before (mt_model_get_params reads them from the seed or
     * file without making them; mt_model_set_params, LoRA, a teacher's use)
     * makes them whole first. The values are bit-identical to a model made
     * at once (0), whatever the world size (docs/distributed.md, "Models
     * created into their home"). Not with a quantized base
     * (MT_ERR_UNSUPPORTED). Reading a deferred model's values moves its
     * source: no two calls on the same model at once, as for every model. */
    int deferred;
} mt_model_spec;
void mt_model_spec_init(mt_model_spec *s);

/* Makes a model from a sequence of layers. The last layer's outputs are the
 * logits: LINEAR (classes = units) or LM_HEAD (classes = vocab). Shapes are
 * checked layer by layer; the message names the first layer that does not
 * fit. */
mt_status mt_model_create(mt_context *ctx, const mt_model_spec *spec, mt_model **out);

#define MT_MLP_MAX_LAYERS 64

/* A multilayer perceptron: n_layers linear layers (weights stored (out,in),
 * y = x W^T + b), the activation between them, softmax cross-entropy over
 * the last layer's outputs. */
typedef struct mt_mlp_spec {
    uint32_t struct_size;
    int n_layers;                      /* 1 .. MT_MLP_MAX_LAYERS */
    int dims[MT_MLP_MAX_LAYERS + 1];   /* inputs, hidden sizes..., classes */
    mt_activation activation;
    uint64_t seed;                     /* weight init */
    int deferred;                      /* as mt_model_spec.deferred */
} mt_mlp_spec;
void mt_mlp_spec_init(mt_mlp_spec *s);

/* Makes an MLP on the context; its weights live in class PARAM. */
mt_status mt_model_mlp_create(mt_context *ctx, const mt_mlp_spec *spec, mt_model **out);

/* A GPT-2-style decoder in llm.c's layout: token embedding wte (padded_vocab,
 * channels) and position embedding wpe (max_seq, channels), `layers` BLOCKs,
 * a final LayerNorm, the LM head tied to wte. GPT-2 init (MT_INIT_GPT2). */
/* How the frozen linear weights of a base model are stored (docs/engine.md,
 * "Quantized frozen base"): as they are (fp32, or the compute dtype), or
 * quantized and never whole in fp32 or 16 bits again: int8 (blocks of 64
 * with one fp32 scale, 1.0625 bytes per weight) or NF4 (QLoRA's 4-bit
 * NormalFloat, blocks of 64, double-quantized absmax, bitsandbytes' bits:
 * about 0.52 bytes per weight). A quantized weight is frozen for good: the
 * forward and the input gradient run through GEMMs that dequantize it a
 * tile at a time. Only linear weights (LINEAR layers' and blocks' qkv,
 * attproj, fc, fcproj) and a trainer's frozen token table (its lookup
 * dequantizes the rows it reads; it is the tied LM head's W) are
 * quantized; the positions, LayerNorms and biases stay as they are. CPU
 * and CUDA contexts alike: on CUDA each weight is quantized on the host
 * (its fp32 in a host buffer of one tensor) and only the quantized bytes
 * go into device memory, the same bytes as on the CPU; compute in fp32 or
 * bf16 (fp16: MT_ERR_UNSUPPORTED). */
typedef enum mt_base_format {
    MT_BASE_FULL = 0, /* not quantized */
    MT_BASE_INT8 = 1,
    MT_BASE_NF4 = 2
} mt_base_format;
/* "full", "int8", "nf4", or NULL for another value. The formats are
 * numbered from 0 (MT_BASE_FULL) without gaps, so f = 0, 1, ... up to the
 * first NULL names them all. */
const char *mt_base_format_name(mt_base_format f);

typedef struct mt_gpt_spec {
    uint32_t struct_size;
    int vocab;            /* 50257 for GPT-2 */
    int padded_vocab;     /* 0: vocab rounded up to a multiple of 128 (50304) */
    int max_seq;          /* 1024 */
    int layers;           /* 12 */
    int heads;            /* 12 */
    int channels;         /* 768 */
    int stable_embedding; /* 1: the token embedding is a StableEmbedding */
    uint64_t seed;
    /* The blocks' linear weights (qkv, attproj, fc, fcproj) quantized as
     * they are made, one tensor at a time (each made in fp32, quantized,
     * its fp32 freed; on a CUDA context its fp32 is made in a host buffer
     * and only the quantized bytes are allocated and uploaded), so the
     * model never holds them whole in fp32: a
     * quantized base for LoRA or frozen fine-tuning (mt_base_format).
     * The token table stays fp32 (it may train): a trainer's cfg.base
     * quantizes it once it is frozen. MT_BASE_FULL (0): fp32, as always. */
    mt_base_format base;
    int deferred;         /* as mt_model_spec.deferred (with base MT_BASE_FULL) */
} mt_gpt_spec;
/* Fills the GPT-2 124M shape. */
void mt_gpt_spec_init(mt_gpt_spec *s);

mt_status mt_model_gpt_create(mt_context *ctx, const mt_gpt_spec *spec, mt_model **out);
/* Loads an llm.c model file (fp32; layout in docs/formats.md) into a
 * new GPT model. Truncated, corrupt or unknown files give MT_ERR_FORMAT. */
mt_status mt_model_gpt_load(mt_context *ctx, const char *path, mt_model **out);
/* mt_model_gpt_load with the blocks' linear weights quantized as they are
 * read, one tensor at a time (as mt_gpt_spec.base; the spec of the model
 * has base set). MT_BASE_FULL: mt_model_gpt_load. */
mt_status mt_model_gpt_load_base(mt_context *ctx, const char *path, mt_base_format base,
                                 mt_model **out);
/* mt_model_gpt_load with the weights deferred (mt_model_spec.deferred): the
 * header and the file's size are checked now and the file is kept open;
 * the values are read where they are placed (each rank reading only its
 * own elements under ZeRO-3), and checked (non-finite: MT_ERR_FORMAT) as
 * they are read. */
mt_status mt_model_gpt_load_deferred(mt_context *ctx, const char *path, mt_model **out);
/* Writes a GPT model as an llm.c model file (fp32), atomically. */
mt_status mt_model_gpt_save(const mt_model *m, const char *path);
/* The spec of a GPT model (MT_ERR_INVALID_ARG for another model). */
mt_status mt_model_gpt_get_spec(const mt_model *m, mt_gpt_spec *out);

/* NULL is accepted. MT_ERR_STATE while a trainer uses the model. */
mt_status mt_model_destroy(mt_model *m);
/* Number of trainable parameters (elements). */
size_t mt_model_num_params(const mt_model *m);
/* Copies the parameters out to / in from host memory as fp32, in the
 * model's order: layer by layer, each layer's tensors in the order of
 * mt_model_param_info; for GPT models the order of an llm.c model file
 * (each per-block tensor stacked over the blocks). n must be
 * mt_model_num_params(m); set_params refuses non-finite values before
 * changing anything (only a device copy failing part-way, MT_ERR_DEVICE,
 * can leave the weights partly written). */
mt_status mt_model_get_params(const mt_model *m, float *dst, size_t n);
mt_status mt_model_set_params(mt_model *m, const float *src, size_t n);

/* One parameter tensor of a model. Names are dotted paths: "wte", "wpe",
 * "h.3.qkv.w", "lnf.b" for GPT models; "l<layer>.<w|b>" ("l0.w"),
 * "l<layer>.emb.tok", "l<layer>.h.qkv.w" ... for others. */
typedef struct mt_param_info {
    const char *name;  /* valid while the model lives */
    int ndim;
    int64_t shape[4];
    size_t numel;
    size_t offset;     /* where its elements start in get/set_params order */
} mt_param_info;
int mt_model_num_tensors(const mt_model *m);
mt_status mt_model_param_info(const mt_model *m, int i, mt_param_info *out);
/* Parameter i's mask: keep[e] = 1 where dense element e is kept, 0 where
 * it is pruned (n must be its mt_param_info.numel; every 1 for a
 * parameter that is not pruned). */
mt_status mt_model_param_mask(const mt_model *m, int i, unsigned char *keep, size_t n);
/* The pruned parameters' pruned elements and all their elements (both 0
 * when none is pruned): the sparsity is pruned / total. */
mt_status mt_model_sparsity(const mt_model *m, uint64_t *pruned, uint64_t *total);

/* ------------------------------------------------------------------------ */
/* Training                                                                  */
/* ------------------------------------------------------------------------ */

typedef enum mt_optimizer_kind {
    MT_OPT_SGD = 1,       /* torch.optim.SGD: momentum, dampening, Nesterov; weight decay as L2 */
    MT_OPT_ADAMW = 2,     /* torch.optim.AdamW: 8 bytes of state per parameter */
    MT_OPT_ADAMW8 = 3,    /* bitsandbytes' 8-bit blockwise AdamW, as its CUDA kernels:
                             ~2.03 bytes per parameter; tensors under min_8bit_size
                             elements keep 32-bit state; weight decay after the step */
    MT_OPT_ADAFACTOR = 4, /* transformers' Adafactor: factored second moment, rows + cols
                             floats per matrix */
    MT_OPT_ADAMW4 = 5     /* 4-bit AdamW (Li, Chen, Zhu 2023): m blockwise in a dynamic-exponent
                             map, v rank-1 normalised in a linear map without zero; ~1.03
                             bytes per parameter; tensors under min_8bit_size elements keep
                             32-bit state; torch's AdamW arithmetic; whole tensors only */
} mt_optimizer_kind;

/* An optimizer's name as the memtrain command spells it ("sgd", "adamw",
 * "adamw8", "adafactor", "adamw4"), or NULL for a value that is no optimizer.
 * The kinds are numbered from 1 without gaps, so kind = 1, 2, ... up to the
 * first NULL names them all. */
const char *mt_optimizer_name(mt_optimizer_kind kind);
/* The optimizer of a name as mt_optimizer_name spells it into *out;
 * MT_ERR_INVALID_ARG, naming those there are, for any other name. */
mt_status mt_optimizer_by_name(const char *name, mt_optimizer_kind *out);

/* How a trainer computes. In fp16 and bf16 the model's weights (PARAM) and
 * the activations are kept in 16 bits, an fp32 master copy of the weights
 * (MASTER) takes the optimizer's updates and the 16-bit copy is refreshed
 * from it after every step; gradients of the weights are fp32. fp16 needs
 * loss scaling (see mt_loss_scale_config); bf16 has fp32's range and does
 * without. */
typedef enum mt_precision {
    MT_PREC_FP32 = 0,
    MT_PREC_FP16 = 1,
    MT_PREC_BF16 = 2
} mt_precision;

/* Loss scaling for fp16, as torch.amp.GradScaler: the loss is multiplied by
 * the scale before backward, gradients are unscaled and checked before the
 * optimizer; a step with an inf or NaN gradient is skipped and the scale
 * multiplied by backoff_factor; after growth_interval clean steps in a row it
 * is multiplied by growth_factor. */
typedef struct mt_loss_scale_config {
    int dynamic;            /* 1 (default): as above; 0: the scale stays init_scale */
    float init_scale;       /* 65536 */
    double growth_factor;   /* 2.0 */
    double backoff_factor;  /* 0.5 */
    int growth_interval;    /* 2000 */
} mt_loss_scale_config;

/* Activation recompute (gradient checkpointing). The units are the model's
 * blocks: a token model's embedding and each BLOCK; in other models each
 * LINEAR with the layers after it up to the next LINEAR. */
typedef enum mt_recompute_policy {
    MT_RECOMPUTE_NONE = 0,      /* keep every activation backward needs */
    MT_RECOMPUTE_EVERY_K = 1,   /* segments of recompute_every units: only each segment's
                                   input is kept through forward; backward recomputes a
                                   segment's activations just before it needs them */
    MT_RECOMPUTE_SQRT = 2,      /* EVERY_K with k = ceil(sqrt(units)) */
    MT_RECOMPUTE_SELECTIVE = 3, /* blocks keep their input, qkv, the attention's residual
                                   sum and the MLP's pre-activation; the LayerNorm outputs,
                                   the attention output and GELU are recomputed */
    MT_RECOMPUTE_CUSTOM = 4,    /* per unit, cfg.recompute_units (mt_recompute_unit);
                                   runs of recomputed units are cut into segments of
                                   recompute_every units */
    MT_RECOMPUTE_BUDGET = 5     /* the plan with the least recompute whose run stays within
                                   cfg.memory_budget and every allocator instance's
                                   limit_bytes, chosen at create from estimates
                                   (mt_trainer_recompute_plan tells which) */
} mt_recompute_policy;

/* What a unit keeps through forward (MT_RECOMPUTE_CUSTOM). The last unit
 * (it makes the logits) cannot be MT_UNIT_RECOMPUTE. */
typedef enum mt_recompute_unit {
    MT_UNIT_KEEP = 0,       /* everything its backward needs */
    MT_UNIT_SELECTIVE = 1,  /* as MT_RECOMPUTE_SELECTIVE (blocks; other units keep all) */
    MT_UNIT_RECOMPUTE = 2   /* nothing but a segment's input; recomputed in backward */
} mt_recompute_unit;

/* Recompute units of a model (see mt_recompute_policy). */
int mt_model_num_units(const mt_model *m);

typedef enum mt_lr_schedule {
    MT_LR_CONSTANT = 0,
    MT_LR_WARMUP_COSINE = 1 /* linear from lr/warmup to lr over warmup_steps, then cosine
                               down to lr * min_lr_ratio at total_steps (held after) */
} mt_lr_schedule;

/* A per-parameter exception to the trainer's settings; the first override
 * whose pattern (fnmatch(3) syntax) matches a parameter's name applies. */
typedef struct mt_param_override {
    const char *pattern;  /* e.g. "wte", "h.*.ln*", "*.b" (copied at create) */
    int state_bits;       /* 0: as configured; 32: keep 32-bit optimizer state; 8: quantized
                             state even for a small tensor (ADAMW8: 8-bit, ADAMW4: 4-bit) */
    float weight_decay;   /* < 0: as configured */
    float lr_scale;       /* 0: 1 */
} mt_param_override;

/* LoRA adapters (Hu et al. 2021; docs/engine.md, "LoRA"). Each adapted
 * linear weight W (out, in) gets A (rank, in) and B (rank, out), named
 * "<weight>.lora_a" and "<weight>.lora_b", and computes
 * y = x W^T + b + (alpha / rank) (x A^T) B: B (rank, out) is the paper's
 * B (out, rank) transposed. A is drawn Kaiming-uniform (+-1/sqrt(in), as
 * PEFT draws it) from seed, B is zero, so the adapted model starts as the
 * base. A trainer over adapters freezes the whole base (cfg.freeze may
 * freeze adapters too): only the adapters have gradients, masters and
 * optimizer state. */
typedef struct mt_lora_config {
    int rank;             /* r, 1 .. 4096; 0: no adapters */
    float alpha;          /* the scale is alpha / rank (0: alpha = rank, scale 1) */
    const char *targets;  /* comma-separated fnmatch(3) patterns over the linear weights'
                             names ("h.*.qkv.w,h.*.fc.w"); NULL or "": every linear
                             weight (LINEAR layers', each block's qkv, attproj, fc and
                             fcproj). A pattern that matches no linear weight is
                             MT_ERR_INVALID_ARG */
    uint64_t seed;        /* A's draw */
} mt_lora_config;

/* The model's adapters: rank 0 when it has none; targets (borrowed, valid
 * until the adapters change) the adapted weights' names, comma-separated. */
mt_status mt_model_lora_get(const mt_model *m, mt_lora_config *out);
/* Merges the adapters into the weights they adapt, W += (alpha / rank)
 * B^T A (in fp32, on the host, a row at a time), and removes them: the
 * model is its base shape again (mt_model_gpt_save exports it). MT_ERR_STATE
 * while a trainer uses the model, or when it has no adapters;
 * MT_ERR_UNSUPPORTED when an adapted weight is pruned (the merged weight
 * would not keep its zeros). */
mt_status mt_model_lora_merge(mt_model *m);
/* Writes the adapters alone (rank, alpha, each adapted weight's name and
 * shape, A and B in fp32; docs/formats.md), CRC-checked, atomically. */
mt_status mt_model_lora_save(const mt_model *m, const char *path);
/* Reads adapters: a model without adapters gets the file's (the weights
 * they name must be linear weights of the file's shapes); a model with
 * adapters must have the file's (rank, alpha, weights), whose values are
 * replaced. The whole file is checked first: truncated or corrupt
 * (MT_ERR_FORMAT) or for another model (MT_ERR_INVALID_ARG) leaves the
 * model as it was. MT_ERR_STATE while a trainer uses the model. */
mt_status mt_model_lora_load(mt_model *m, const char *path);

/* Adafactor's settings (transformers' defaults). */
typedef struct mt_adafactor_config {
    float eps1;            /* 1e-30, added to g^2 */
    float eps2;            /* 1e-3, floor of the parameter scale */
    float clip_threshold;  /* 1.0 */
    float decay_rate;      /* -0.8 */
    float beta1;           /* 0: no first moment */
    int scale_parameter;   /* 1 */
    int relative_step;     /* 1: the step size comes from the step count and lr is unused */
    int warmup_init;       /* 0 */
} mt_adafactor_config;

/* Pruning and sparse training (docs/engine.md, "Pruning and sparse
 * training"). A pruned weight is stored compressed: its kept values alone
 * and a mask (a bitmap, about 1.03 bits per element, or for N:M the kept
 * values' places, ceil(log2 M) bits each: 2:4 takes 2 bits per kept
 * value), in PARAM; its master, gradient and optimizer state hold the kept
 * entries alone, so every class shrinks with the sparsity. Compute expands
 * the weight into a dense tile (WORK, one tensor at a time) for its GEMMs
 * and keeps only the kept entries of its gradient. Pruned weights are
 * exactly 0 and stay so (weight decay included). The pruning is the
 * model's from then on: after the trainer, mt_model_get_params reads the
 * zeros, mt_model_set_params writes the kept places alone, and
 * mt_model_gpt_save writes the dense model with its zeros. */
typedef enum mt_prune_method {
    MT_PRUNE_NONE = 0,
    MT_PRUNE_MAGNITUDE = 1, /* the smallest |w| (torch.nn.utils.prune.l1_unstructured, or
                               global_unstructured with MT_PRUNE_GLOBAL) */
    MT_PRUNE_WANDA = 2      /* Wanda: the smallest |w| * ||x|| within each output row,
                               ||x|| the input feature's norm over calibration batches
                               (mt_trainer_calibrate) */
} mt_prune_method;
typedef enum mt_prune_scope {
    MT_PRUNE_TENSOR = 0, /* each tensor loses its own fraction */
    MT_PRUNE_GLOBAL = 1  /* the fraction of all the targets together (magnitude only) */
} mt_prune_scope;
typedef enum mt_prune_schedule {
    MT_PRUNE_ONESHOT = 0, /* once, after `at` steps */
    MT_PRUNE_GRADUAL = 1  /* Zhu & Gupta: after `start` steps and every `every` steps
                             until `end`, to s_t = sparsity (1 - (1 - (t - start) /
                             (end - start))^3) at step t, sparsity from end on; what
                             was pruned stays pruned */
} mt_prune_schedule;
typedef enum mt_regrow {
    MT_REGROW_NONE = 0,
    MT_REGROW_RIGL = 1
} mt_regrow;
/* How a pruned weight's GEMMs run: on a dense tile (the kept values
 * expanded one tensor at a time into WORK, then the dense GEMMs, the bits
 * of the dense model with zeros), or from the kept values alone (sparse
 * GEMMs: the work of the kept values only, the sums in another order;
 * the CPU has them, CUDA uses the dense tile). */
typedef enum mt_sparse_kernel {
    MT_SPARSE_KERNEL_AUTO = 0,  /* per weight, the faster: the sparse GEMMs on the CPU where
                                   at most 15% of W is kept (7% for bf16 or fp16 on a CPU with
                                   its own instructions for them: AVX512-BF16, AMX); the
                                   dense tile in a trainer that regrows (RigL's steps take
                                   the dense gradient) */
    MT_SPARSE_KERNEL_DENSE = 1, /* always the dense tile */
    MT_SPARSE_KERNEL_SPARSE = 2 /* the sparse GEMMs wherever the device has them (not with
                                   RigL: MT_ERR_INVALID_ARG) */
} mt_sparse_kernel;
typedef struct mt_prune_config {
    mt_prune_method method;   /* MT_PRUNE_NONE (default): no pruning, nothing else read
                                 but kernel */
    double sparsity;          /* the fraction of each target's weights pruned, in [0, 1):
                                 rint(sparsity n) of a tensor's n (half to even, as
                                 torch's round); Wanda: floor(sparsity cols) of each row.
                                 Unread with N:M */
    int nm_n, nm_m;           /* N:M (both 0: unstructured): in each group of M
                                 consecutive weights of a row the N with the largest
                                 scores kept, 0 < N < M <= 16, M dividing every target's
                                 row (its input features) */
    mt_prune_scope scope;     /* MT_PRUNE_TENSOR (default) */
    const char *targets;      /* comma-separated fnmatch(3) patterns over the parameters'
                                 names (copied); NULL or "": every linear weight (LINEAR
                                 layers', each block's qkv, attproj, fc and fcproj: not
                                 embeddings, LayerNorms or biases). A pattern matching
                                 nothing, or a match that is not a linear weight, is
                                 MT_ERR_INVALID_ARG */
    int calib;                /* Wanda: the calibration batches a prune needs gathered
                                 (mt_trainer_calibrate) since the last one, >= 1 */
    mt_prune_schedule schedule; /* MT_PRUNE_ONESHOT (default) */
    int64_t at;               /* ONESHOT: the steps taken before the prune (0: at create
                                 for magnitude, before the first step's forward for
                                 Wanda, which needs its calibration first) */
    int64_t start, end, every; /* GRADUAL: 0 <= start <= end, every >= 1 */
    /* Dynamic sparsity: RigL (Evci et al. 2020), on unstructured masks once
     * pruned (MT_REGROW_NONE: the masks only change by pruning). After t
     * steps, for t > 0 a multiple of regrow_every and below regrow_end
     * (and no prune due then), the step updates the masks instead of the
     * weights: in each target, floor(f_t kept) kept weights of the
     * smallest |w| are dropped, f_t = regrow_frac / 2 (1 + cos(pi t /
     * regrow_end)), and as many of the largest |dense gradient| of the
     * step's batch among the weights then pruned are grown, at 0 with
     * zeroed optimizer state (one dropped and grown again is reset too):
     * the kept count stays. The dense gradient exists one tensor at a time
     * (the GEMM's tile), only in those steps. One rank, one micro-batch per
     * step, the unfused step and elementwise state (SGD, AdamW);
     * MT_ERR_UNSUPPORTED otherwise. */
    mt_regrow regrow;
    int64_t regrow_every;     /* >= 1 */
    double regrow_frac;       /* in (0, 1] */
    int64_t regrow_end;       /* >= 1 */
    mt_sparse_kernel kernel;  /* the GEMMs of every pruned weight the trainer trains or
                                 runs, pruned by it or before: MT_SPARSE_KERNEL_AUTO */
} mt_prune_config;
/* Prunes the model now, once, by magnitude or N:M (c->method
 * MT_PRUNE_MAGNITUDE; the schedule and calib are unread): its targets
 * become pruned weights (mt_trainer_config.prune says how they are
 * stored and trained). MT_ERR_STATE while a trainer uses the model; the
 * model's other refusals as a trainer's. */
mt_status mt_model_prune(mt_model *m, const mt_prune_config *c);
/* Whether c suits the model (its targets, N:M against their rows, the
 * settings' ranges), as a trainer would check it: MT_OK, or
 * MT_ERR_INVALID_ARG / MT_ERR_UNSUPPORTED with the message. */
mt_status mt_prune_check(const mt_model *m, const mt_prune_config *c);

typedef struct mt_trainer_config {
    uint32_t struct_size;
    int max_batch;          /* most rows (examples or sequences) a step will see (32) */
    int micro_batch;        /* rows per forward/backward pass; a step's batch is split
                               into micro-batches whose gradients accumulate, and the
                               optimizer steps once per batch (0: the whole batch) */
    int max_seq;            /* token models: longest sequence a step will see (0: the
                               model's) */
    mt_optimizer_kind optimizer; /* MT_OPT_SGD */
    float lr;               /* 0.1 */
    float momentum;         /* SGD: 0 */
    float dampening;        /* SGD: 0 */
    int nesterov;           /* SGD: 0 */
    float weight_decay;     /* 0; SGD: L2 (g += wd p); AdamW: decoupled (p *= 1 - lr wd,
                               before the step; 8-bit AdamW: after it) */
    int decay_1d;           /* 1 (default): 1-D tensors (biases, LayerNorm) decay too, as
                               torch does; 0: only tensors of 2 or more dimensions */
    float beta1, beta2, eps; /* AdamW and 8-bit AdamW: 0.9, 0.999, 1e-8 */
    int min_8bit_size;      /* 8-bit and 4-bit AdamW: smaller tensors keep 32-bit state (4096) */
    mt_adafactor_config adafactor;
    const mt_param_override *overrides; /* n_overrides of them, or NULL */
    int n_overrides;
    mt_lr_schedule lr_schedule;         /* MT_LR_CONSTANT */
    int warmup_steps, total_steps;      /* WARMUP_COSINE */
    float min_lr_ratio;                 /* WARMUP_COSINE: 0 */
    float grad_clip;        /* > 0: clip the global gradient norm to this (0: none) */
    mt_precision precision; /* MT_PREC_FP32 */
    /* 1 (default): fp16 and bf16 keep fp32 master weights. 0 (bf16 only): no
     * masters; the optimizer reads the bf16 weights, updates in fp32 and
     * writes them back with stochastic rounding, a slice at a time (a 256 KiB
     * WORK buffer), so weights cost 2 bytes per parameter instead of 6.
     * SGD, AdamW and 8-bit AdamW; Adafactor needs masters. */
    int master_weights;
    mt_loss_scale_config loss_scale; /* used with MT_PREC_FP16 */
    mt_recompute_policy recompute;   /* MT_RECOMPUTE_NONE */
    int recompute_every;    /* EVERY_K, CUSTOM: units per segment (2) */
    const unsigned char *recompute_units; /* CUSTOM: mt_model_num_units values (copied) */
    /* A memory budget (0: none): the most bytes the model and the trainer
     * may hold, as the context's allocators reserve them (the estimate's
     * peak_reserved). With MT_RECOMPUTE_BUDGET the recompute plan is chosen
     * to fit; with any other policy a run that would not fit is refused.
     * Either way mt_trainer_create gives MT_ERR_BUDGET, naming the smallest
     * budget that would work and how, when none fits. A plan whose run
     * would pass an allocator instance's limit_bytes does not fit either
     * (the search skips it; docs/memory.md, "Budgets and allocator
     * limits"). */
    uint64_t memory_budget;
    /* Fused backward + optimizer step: each parameter is updated, and its
     * gradient freed, as soon as its gradient is final in backward, so the
     * gradients of the whole model never exist at once. Cannot combine with
     * accumulation (micro_batch < max_batch: MT_ERR_INVALID_ARG). With
     * gradient clipping, fp16 or tensor_parallel, backward runs twice: the first pass finds
     * the global norm and any non-finite gradient, freeing each gradient at
     * once; the second applies the updates (skipped when the first found an
     * overflow). Results equal the unfused step. On several ranks whose
     * communicator takes calls from any thread (MT_COMM_CAP_THREADS), a
     * CPU context at ZeRO stage 0 to 2 without offload reduces each
     * gradient on the communication thread and updates it once that is
     * done, holding up to about 4 MiB more of whole gradients (the same
     * bits; docs/distributed.md, "Overlap of communication with
     * backward"). */
    int fused_step;
    /* Frozen parameters (docs/engine.md, "Frozen parameters"):
     * every parameter whose name matches one of these n_freeze fnmatch(3)
     * patterns (copied at create) is frozen: it gets no gradient, no
     * master copy and no optimizer state, backward skips its weight (and
     * bias) gradient but still passes the input gradient through it, and
     * it never changes. In fp16 and bf16 a frozen weight is kept in the
     * compute dtype alone (rounded to nearest once, at create; its fp32
     * values after the trainer are those 16-bit ones). A frozen token table
     * is frozen for both its uses (the embedding and the tied LM head). A
     * pattern that matches no parameter, or a set that leaves nothing to
     * train, is MT_ERR_INVALID_ARG. */
    const char *const *freeze;
    int n_freeze;
    /* LoRA: with lora.rank > 0 the trainer adds these adapters to a model
     * without any (they stay with the model after the trainer: merge, save
     * or train them again); a model that has adapters must have these
     * (MT_ERR_INVALID_ARG otherwise). A model with adapters always trains
     * them alone, lora.rank 0 included. The estimate counts them. */
    mt_lora_config lora;
    /* Local SGD, the asynchronous-update mode of a data-parallel run (0:
     * off, the default): with H > 0 each rank steps on its own rows alone,
     * with no gradient communication (mt_trainer_step's loss and
     * mt_trainer_gradients' gradients are its rows' own), and after every
     * H-th step (skipped ones counted) the ranks' weights become their mean
     * (the fp32 masters where there are, the compute copy rounded from
     * them); each rank keeps its own optimizer state. Every rank must use
     * the same H. Nothing changes on one rank (docs/distributed.md). It
     * does not combine with zero_stage > 0 (MT_ERR_INVALID_ARG, on one rank
     * too: local SGD keeps each rank's own state, ZeRO shards one). On
     * several ranks with offload MT_PLACE_DISK keeping what it averages on
     * disk (fp16/bf16 masters, or offload_params) it is
     * MT_ERR_UNSUPPORTED. */
    int local_sgd_every;
    /* ZeRO on a data-parallel run of N > 1 ranks (docs/distributed.md); on
     * one rank every stage is stage 0. 0 (default): every rank holds
     * everything and the gradients are all-reduced. 1: the fp32 master
     * weights (MASTER) and the optimizer state (OPTIM) are sharded: each
     * rank holds and updates its slice of every tensor (an optimizer that
     * cannot update a slice, Adafactor or 4-bit AdamW, gets whole tensors
     * spread over the ranks), the gradients are reduce-scattered to the slices' owners,
     * and the updated weights are all-gathered. 2: the gradients (GRAD) are
     * sharded too: each tensor's gradient is reduce-scattered as soon as it
     * is final in backward, so a rank keeps only its slices (and the full
     * gradients of about one layer at a time). The ranks' weights stay
     * equal bit for bit. With sharded masters, the model's fp32 values
     * (mt_model_get_params, and the weights after mt_trainer_destroy) are
     * the 16-bit compute copy's; the training-state file
     * (mt_trainer_save, then a collective) holds the masters whole.
     * 3: the weights (PARAM) are sharded too: each rank keeps its slice of
     * every trained tensor, and each layer's weights are all-gathered into
     * communication buffers (COMM) just before its forward and again
     * before its backward (and a recomputed layer's forward), then let go;
     * the update writes the rank's slice. While a stage-3 trainer lives,
     * the model's trained weights are nowhere whole: mt_model_get_params,
     * mt_model_set_params and mt_model_gpt_save give MT_ERR_UNSUPPORTED,
     * mt_trainer_eval and mt_trainer_logits are collectives (every rank
     * calls them, with as many micro-batches; a batch one rank refuses
     * fails the call on every rank), and mt_trainer_destroy gathers the weights back into the
     * model (a collective: every rank destroys its trainer). Stage 3 runs
     * on CPU contexts and on CUDA contexts with a device communicator
     * (NCCL), without LoRA or a quantized base (MT_ERR_UNSUPPORTED
     * otherwise; docs/distributed.md, "ZeRO-3"); with offload
     * MT_PLACE_DISK (CPU contexts) each rank's state and master slices
     * live in its scratch files, and with offload_params its slice of the
     * weights too; with offload MT_PLACE_HOST (CUDA contexts) its state and
     * master slices live in its pinned host memory, updated there by the
     * CPU, the updated weight slice going back to the device. */
    int zero_stage;
    /* Stage 3's prefetch depth: while a layer computes, the weights of the
     * next zero3_prefetch layers to run (in forward's order, backward's,
     * and a recompute's) are gathered on a communication thread, each into
     * a buffer of its own (COMM, counted by the estimate). 1 (default);
     * 0 to 64; 0: each layer's gather runs when the layer starts. The
     * thread needs a CPU context and a communicator that takes calls from
     * any thread (MT_COMM_CAP_THREADS: MPI at MPI_THREAD_SERIALIZED);
     * without one (and on CUDA contexts, whose NCCL gathers run on the
     * context's stream) the gathers run when their buffers are made, with
     * the same memory. With a depth above 0, backward's reduce-scatters are
     * queued on that thread too, each gradient kept until the next layer's
     * are final. Results are the same bits at every depth. */
    int zero3_prefetch;
    /* Stage 3: the last zero3_keep layers of forward (the LM head first)
     * keep their weights from their forward to their backward (through
     * their recompute) rather than gathering them again: fewer gathers,
     * more memory. 0 (default): none; -1: every layer (stage 2's PARAM at
     * the end of forward, in COMM). */
    int zero3_keep;
    /* Knowledge distillation (docs/engine.md, "Distillation"): with a
     * teacher (NULL: none), each micro-batch first runs the teacher's
     * forward (fp32, keeping nothing but its logits), and the student's loss
     * is (1 - distill_alpha) cross-entropy + distill_alpha T^2
     * KL(softmax(teacher/T) || softmax(student/T)), T = distill_temp, fused
     * over the vocabulary row by row. The teacher: a model on the same
     * context with the same input (vocabulary, or features) and classes, at
     * least the student's context length, no adapters (merge them first),
     * not the student and without a trainer of its own; it is never changed
     * and is held (mt_model_destroy refuses it) while the trainer lives.
     * It may be quantized (mt_model_gpt_load_base: its forward runs
     * through the dequantizing GEMMs, its PARAM is the quantized bytes;
     * CPU and CUDA contexts, as every quantized base). alpha in [0, 1] (0.5),
     * T > 0 (2). The step's loss is this loss; mt_trainer_eval stays the
     * cross-entropy. CPU and CUDA contexts. */
    mt_model *teacher;
    float distill_alpha;
    float distill_temp;
    /* Where the optimizer state (OPTIM) and the fp32 master weights
     * (MASTER, where there are) live between their updates (docs/memory.md,
     * "Places and offload"). MT_PLACE_DEVICE (default): resident.
     * MT_PLACE_DISK (CPU contexts): in scratch files in a directory of its
     * own, offload_dir/memtrain-scratch (made with exclusive access and a
     * lock file naming the process; removed at destroy and on every
     * failure; one a dead process left is cleaned, one a live process holds
     * is refused with MT_ERR_IO). The update brings each tensor's state in,
     * a piece at a time, into a few buffers on the device (counted in OPTIM
     * and MASTER), reading the next piece and writing the last one on I/O
     * threads while it computes; results are bit-identical to a resident
     * run. An I/O failure (disk full, an I/O error, a scratch file removed
     * or truncated) is MT_ERR_IO naming the file; the scratch files are then
     * removed and the trainer refuses further steps (load a training-state
     * file into a new one). The masters being on disk, mt_model_get_params
     * and set_params read and write them there. On a run of several ranks
     * (ZeRO stages 0 to 3) each rank keeps its own part (its shard at
     * stages 1 to 3) in offload_dir/memtrain-scratch.rankR, and
     * training-state files are the resident run's (fp16/bf16 masters: each
     * rank's master slice); CUDA contexts are MT_ERR_UNSUPPORTED.
     * MT_PLACE_HOST (CUDA contexts): in page-locked host memory
     * (cuMemHostAlloc; place host). Each gradient goes down to the host as
     * backward finishes it (a piece at a time, through a few staging buffers
     * counted at place host: GRAD and PARAM), the CPU op table updates the
     * state and masters there on a thread of the trainer's while the GPU goes
     * on, and the updated weights go back up; the step ends when all of them
     * are up. fp32 weights come down with their gradients (no copy is kept
     * on the host). On several ranks (ZeRO stages 0 to 3; stages 1 to 3
     * need a device communicator, NCCL) each rank keeps and updates its own
     * part (at stage 0 all of it, from the summed gradients; at stages 1 to
     * 3 its shard, from its reduce-scattered gradients); at stages 1 and 2
     * the weights are all-gathered once every update has landed, at the
     * step's end, and at stage 3 each rank's updated weight slice goes up
     * into its slice on the device (nothing gathered after the step).
     * fp32, or fp16/bf16 with master weights (not without them), and every
     * optimizer but 4-bit AdamW (MT_ERR_UNSUPPORTED); not with offload_params
     * (MT_ERR_INVALID_ARG); pinned memory refused is MT_ERR_OOM naming the
     * amount. */
    mt_place offload;
    const char *offload_dir; /* MT_PLACE_DISK: an existing directory (copied) */
    /* With offload MT_PLACE_DISK (and only then: MT_ERR_INVALID_ARG
     * otherwise), the trained weights (PARAM) live on disk too, in the
     * compute dtype, in param.bin beside the state (ZeRO-Infinity's
     * parameter offload; docs/memory.md, "Places and offload"). Before a
     * layer's forward, backward or recomputed forward its weights are read
     * into one of two buffers (PARAM at place device, each the largest
     * layer's weights: the tied token table's layers, at both ends of the
     * model, read it each time), the next layer's are read into the other
     * meanwhile, and the update's pieces carry the weights with the state
     * (PARAM buffers as large as a piece's weights). Frozen weights stay
     * resident. Results are bit-identical to a resident run;
     * mt_model_get_params / set_params, training-state files and the
     * weights after the trainer read and write them on disk; an I/O
     * failure loses them with the state (MT_ERR_IO: load the last
     * training-state file). One rank, or several at any ZeRO stage (each
     * rank its own param.bin, written once the ranks have agreed on the
     * weights: at stages 0 to 2 the whole weights, and at stages 1 and 2
     * the all-gather of the updated slices reads the rank's own from its
     * pieces and writes the others' into its file, a bucket of at most 4
     * MiB at a time; at stage 3 the rank's slice, read into its part of
     * each layer's gather buffer before the gather, and no layer buffers);
     * with LoRA, and with local SGD on several ranks, MT_ERR_UNSUPPORTED. */
    int offload_params; /* 0 or 1 (else MT_ERR_INVALID_ARG) */
    /* A quantized frozen base (mt_base_format; docs/engine.md, "Quantized
     * frozen base"). With MT_BASE_INT8 or MT_BASE_NF4 every frozen linear
     * weight and a frozen token table (frozen by cfg.freeze, or the base
     * under LoRA) is quantized from fp32 at create, one tensor at a time,
     * unless the model holds it quantized already (mt_gpt_spec.base,
     * mt_model_gpt_load_base): PARAM then holds the quantized bytes alone.
     * The quantization is the model's from then on (after the trainer
     * too: mt_model_get_params reads the dequantized values,
     * mt_model_set_params quantizes again, mt_model_lora_merge makes a
     * merged weight fp32 again; a later trainer must keep the quantized
     * table frozen). Trainable parameters, positions, LayerNorms and
     * biases stay as they are. MT_ERR_INVALID_ARG: no frozen linear weight
     * or token table to quantize, a model quantized in another format, or
     * a model with quantized weights and base MT_BASE_FULL, or one of them
     * not frozen; MT_ERR_UNSUPPORTED: fp16 compute. On a CUDA context the
     * fp32 of the tensor being quantized comes down into a host buffer,
     * is quantized there and the quantized bytes go up. */
    mt_base_format base;
    /* Tensor parallel (docs/distributed.md, "Tensor parallel"): T > 1 splits
     * a GPT model over groups of T neighbouring ranks of the context's
     * communicator (ranks g T .. g T + T - 1 form tensor group g; the world
     * must be a multiple of T, and the ranks with the same place in their
     * groups form a data-parallel group of world / T ranks, whose rows are
     * summed as in a data-parallel run). Each rank holds and trains 1/T of
     * every block's heads (qkv split by heads, attproj by its input
     * columns), of its MLP's columns (fc by output, fcproj by input), and
     * of the token table's rows (the tied LM head with it: the logits and
     * the cross-entropy are split by vocabulary and never gathered);
     * LayerNorms, positions and the biases of attproj and fcproj stay whole
     * on every rank. Each block's forward sums its two partial outputs over
     * the group and its backward its two partial input gradients (in fp32;
     * fp16 and bf16 through an fp32 WORK copy). Every rank of a group must
     * be given the same batch. T must divide the heads and be at most the
     * padded vocabulary. Results equal one process's up to the sums'
     * rounding (8-bit and 4-bit AdamW quantize their state in blocks of each
     * rank's part: close, not the same). While the trainer lives the model's
     * split weights are nowhere whole (mt_model_get_params,
     * mt_model_set_params and mt_model_gpt_save give MT_ERR_UNSUPPORTED;
     * mt_model_param_info gives the whole tensors' shapes). Every pass is a
     * collective of the group (mt_trainer_step, mt_trainer_eval,
     * mt_trainer_gradients and mt_trainer_logits, which give the whole
     * gradients and every column of the logits), and
     * mt_trainer_destroy gathers the weights back (a collective: every rank
     * destroys its trainer; mt_trainer_destroy_with_model gathers nothing).
     * The context's own collectives run within the data-parallel group
     * meanwhile. 0 and 1: off. Not yet with a StableEmbedding, LoRA, a
     * quantized base, a teacher, Adafactor, host offload or local SGD
     * (MT_ERR_UNSUPPORTED).
     * Training-state files hold the whole tensors and move between layouts
     * (mt_trainer_save: a
     * collective of the tensor group of data-parallel rank 0, the other
     * groups' calls doing nothing; not with 8-bit or 4-bit state in blocks
     * of a part, nor with ZeRO). */
    int tensor_parallel;
    /* Sequence parallel (0 or 1; with tensor_parallel > 1, else
     * MT_ERR_INVALID_ARG): outside the blocks' split GEMMs (the residual
     * stream, the LayerNorms, the embedding's output) each rank of a tensor
     * group holds 1/T of a micro-batch's rows, rows [N q / T, N (q + 1) / T)
     * of its N = rows x seq_len, so those activations cost 1/T too. The
     * blocks' sums become a reduce-scatter (forward) and an all-gather of
     * the rows a GEMM needs (forward and backward), and the LayerNorms'
     * gradients are summed over the group. Every micro-batch's N must be a
     * multiple of T (MT_ERR_INVALID_ARG from the step otherwise).
     * docs/distributed.md, "Sequence parallel". */
    int sequence_parallel;
    /* Pipeline parallel (0, 1: off; P > 1): the model's layers cut into P
     * stages of whole recompute units (mt_model_num_units), balanced by
     * each unit's estimated compute (not by count), the embedding on the
     * first stage and the LM head and loss on the last. The world's ranks
     * form a grid: rank r is place r % T of its tensor group (T =
     * tensor_parallel, or 1), stage (r / T) % P of its pipeline group, and
     * data-parallel rank r / (T P); the world must be a multiple of T P
     * (MT_ERR_INVALID_ARG), and P at most the model's units. Each rank holds
     * its stage's weights, gradients, optimizer state and activations
     * alone. A step runs the batch's micro-batches (micro_batch rows each)
     * on the one-forward-one-backward schedule (1F1B): stage s holds at
     * most P - s micro-batches' activations whatever the number of
     * micro-batches. Activations and their gradients go between
     * neighbouring stages with the communicator's point-to-point calls
     * (mt_comm_has_p2p; MT_ERR_UNSUPPORTED without). A tied token table
     * (GPT) lives on the first stage and as a copy on the last (the LM
     * head's); their gradients are summed between the two before the
     * update, so the two stay equal. Every step, eval and destroy is a
     * collective of the pipeline group; every rank of a pipeline group is
     * given the same batch. The step's loss (its norm, its checks) is the
     * whole model's on every rank. Combines with tensor_parallel,
     * sequence_parallel and ZeRO stages 1 and 2 in the data-parallel groups
     * (with an optimizer that updates slices: not Adafactor).
     * While the trainer lives the other stages' weights are not on this
     * rank (mt_model_get_params, mt_model_set_params, mt_model_gpt_save,
     * mt_trainer_gradients and mt_trainer_logits give MT_ERR_UNSUPPORTED;
     * mt_model_num_params, _num_tensors, _num_units and _param_info
     * answer for the whole model); mt_trainer_destroy sends every weight to
     * every rank of the pipeline group (a collective; where one rank has no
     * room for them none is sent, each rank keeps its stage's and the
     * others' are lost there, said in the log; mt_trainer_destroy_with_model
     * sends nothing). Training-state files hold the
     * whole model's state, as one process writes it, and load under any
     * layout (mt_trainer_save: a collective of the pipeline and tensor
     * groups of data-parallel rank 0, the first stage's first rank writing,
     * the other data-parallel ranks' calls doing nothing, but under ZeRO,
     * where every rank sends its slices; not with ZeRO and tensor_parallel
     * together).
     * A memory budget holds for every rank: a recompute plan it chooses
     * (MT_RECOMPUTE_BUDGET) fits the heaviest stage, each stage running its
     * units of it.
     * Not yet with the fused step, ZeRO stage 3, offload, LoRA, a
     * quantized base, a teacher or local SGD (MT_ERR_UNSUPPORTED).
     * docs/distributed.md, "Pipeline parallel". */
    int pipeline_parallel;
    /* Pruning (mt_prune_config; method MT_PRUNE_NONE: none). The chosen
     * weights are pruned as the schedule says, at create (a one-shot
     * magnitude prune at step 0: the state is made for the kept entries
     * alone) or at the start of a step (the weights, masters and optimizer
     * state of each target rebuilt for its new mask, one tensor at a time).
     * The masks are the model's: a model pruned before keeps its masks, and
     * further pruning only removes. Every optimizer: 4-bit AdamW
     * normalises a pruned weight's second moment in blocks, as a vector's;
     * Adafactor factors it over the dense rows and columns, updating the
     * dense matrix with zeros at the pruned places; a prune after steps
     * were taken needs state that follows the weights element by element
     * (SGD, AdamW, Adafactor; not 8-bit or 4-bit AdamW), and no gradients
     * summed on the communication thread or stream. Data parallel and
     * local SGD work (every rank chooses the same masks); ZeRO on several
     * ranks, offload, tensor and pipeline parallel, a quantized base and a
     * pruned weight that is quantized are MT_ERR_UNSUPPORTED, also for a
     * trainer that does not prune a model pruned before. A creation that
     * fails after its prune gives the model back as it was (the values a
     * prune at create removes are kept in host memory until it succeeds). The estimate
     * counts the kept entries (exactly, but for MT_PRUNE_GLOBAL, whose
     * tensors' shares depend on the weights: each tensor is estimated at
     * the global fraction). */
    mt_prune_config prune;
} mt_trainer_config;
void mt_trainer_config_init(mt_trainer_config *c);

/* Makes a trainer for a model: gradients, optimizer state, activations.
 * cfg NULL: the defaults (mt_trainer_config_init).
 * On a context with a communicator of more than one rank the trainer is
 * data parallel (docs/distributed.md): creation is a collective that
 * checks the ranks' models, settings (a teacher's shape, base format and
 * distillation settings among them) and weights (and the teacher's) agree
 * (MT_ERR_COMM on every rank, naming the setting that differs and each
 * rank's value, when not; when a rank fails to create, that rank gets its
 * own status and the others MT_ERR_COMM naming it), and each step trains
 * on the union of the ranks' batches. */
mt_status mt_trainer_create(mt_model *m, const mt_trainer_config *cfg, mt_trainer **out);
/* Frees the trainer; the model gets its weights back whole (fp32; a
 * quantized base stays quantized), at ZeRO-3 gathered from the ranks'
 * slices (a collective), with offload_params read back from disk. NULL is
 * accepted. */
void mt_trainer_destroy(mt_trainer *t);
/* Frees the trainer and then its model, without bringing the trained
 * weights back whole first: no ZeRO-3 gather (not a collective), nothing
 * read back from disk. For a program done with both, so that a model
 * created into its home (mt_model_spec.deferred) is never whole in memory
 * at the end either. The teacher is not freed. NULL is accepted. */
void mt_trainer_destroy_with_model(mt_trainer *t);
/* What mt_trainer_autofit may choose in place of cfg's AdamW (its allow
 * argument: 0, or these or'ed): 8-bit AdamW state (MT_OPT_ADAMW8), 4-bit
 * AdamW state (MT_OPT_ADAMW4; tried only where its weights have fp32
 * masters, i.e. fp32 compute or cfg.master_weights = 1, and where the op
 * table has its kernel). Opt-in because they change the numerics
 * (docs/engine.md). The argument was a boolean "allow 8-bit" before 4-bit
 * state existed: 1 keeps that meaning, but other non-zero values are no
 * longer "yes" (2 allows 4-bit and not 8-bit; bits outside these two are
 * MT_ERR_INVALID_ARG). */
#define MT_AUTOFIT_ALLOW_8BIT 1
#define MT_AUTOFIT_ALLOW_4BIT 2

/* Auto-fit: fits cfg to cfg->memory_budget for an effective batch of
 * cfg->max_batch rows (and cfg->max_seq tokens), without running a step:
 * for each micro-batch size (accumulating over the rest), and when cfg's
 * optimizer is AdamW for each optimizer state allow permits instead of its
 * 32-bit state (and, when none of
 * those fits, each of them again with the optimizer state in pinned host
 * memory, cfg->offload = MT_PLACE_HOST, on CUDA contexts; when none fits
 * so and cfg->offload_dir names a directory that exists and may be
 * written, with the state on disk,
 * cfg->offload = MT_PLACE_DISK; then with the weights on disk too,
 * cfg->offload_params = 1; each where the trainer takes it for this
 * context, world size and configuration (docs/memory.md), saying so in the
 * log), it finds the
 * cheapest recompute plan that fits (as MT_RECOMPUTE_BUDGET does) and
 * estimates the step time with a cost model (GEMM FLOPs, recompute,
 * micro-batch efficiency, the optimizer update's memory traffic;
 * docs/memory.md); the fastest wins. A configuration whose run would pass
 * an allocator instance's limit_bytes does not fit. cfg gets micro_batch, optimizer (with
 * allow), recompute = MT_RECOMPUTE_BUDGET, offload and offload_params. With the fused step only
 * whole batches are tried (it cannot accumulate). On a context of several
 * ranks (a communicator, or a dry context's world_size) at ZeRO stages 1
 * to 3, whose ranks need different bytes, every rank is estimated (without
 * a communicator) and the configuration chosen by the rank that needs the
 * most: each rank calling it gets the same answer, which fits every rank.
 * MT_ERR_BUDGET, with the least need (and the last offload refused, if
 * one was, and why the disk was not tried, if it was not), when nothing fits; cfg is then unchanged; MT_ERR_INVALID_ARG
 * for other bits in allow. */
typedef struct mt_autofit_report {
    int micro_batch;              /* rows per forward/backward pass */
    mt_optimizer_kind optimizer;  /* AdamW, or 8-bit or 4-bit AdamW when allowed; else cfg's */
    int units, recomputed_units, selective_units; /* the recompute plan */
    int seg_len;
    uint64_t peak_reserved;       /* the chosen run's estimate */
    double step_seconds;          /* the cost model's step time (for comparison only) */
    double comm_seconds;          /* of it, the collectives' (several ranks: nominal link
                                     rates, docs/memory.md; 0 on one rank) */
    double tokens_per_second;     /* max_batch x max_seq / step_seconds */
    int candidates;               /* configurations that fit, of those tried */
    int tried;
    mt_place offload;             /* the chosen place of the state: cfg's own when that fits,
                                     else MT_PLACE_HOST or MT_PLACE_DISK when only the state
                                     there fits */
    int offload_params;           /* 1 when only the state and the weights on disk fit */
} mt_autofit_report;
mt_status mt_trainer_autofit(const mt_model *m, mt_trainer_config *cfg, int allow,
                             mt_autofit_report *out);

/* The recompute plan in use: n (>= mt_model_num_units) unit modes into
 * units, and the segment length into *seg_len (either may be NULL). Under
 * pipeline parallel each stage has its own plan: this rank's stage's
 * units at their places, the other stages' given as MT_UNIT_KEEP. */
mt_status mt_trainer_recompute_plan(const mt_trainer *t, unsigned char *units, int n,
                                    int *seg_len);

/* A batch in host memory. */
typedef struct mt_batch {
    int n;                  /* rows: examples or sequences, 1 .. max_batch */
    const float *inputs;    /* feature models: (n, features) fp32 */
    const int32_t *targets; /* feature models: (n) classes; token models: (n, seq_len) */
    const int32_t *tokens;  /* token models: (n, seq_len) token ids */
    int seq_len;            /* token models: 1 .. max_seq */
} mt_batch;

/* One training step on a batch: forward, loss, backward (per micro-batch),
 * optimizer update. *loss (if not NULL) gets the mean cross-entropy of the
 * batch's targets before the update. On a bad batch (size, NULL data, a
 * token or target out of range), or a failure before the update (out of
 * memory, say), the weights, the optimizer state and the loss scaler are
 * unchanged. Only a device failing during the update itself (a CUDA launch),
 * or the disk holding the state (cfg.offload), can leave the weights partly
 * updated; the error says so, and how many of the trained tensors were.
 * A step whose loss or any gradient is not finite (an inf or NaN input, an
 * overflow) is skipped, in every precision, with or without clipping, fused
 * or not: the weights and the optimizer state do not move, it returns MT_OK
 * with the non-finite *loss, mt_trainer_get_loss_scale tells
 * (last_step_skipped, steps_skipped), the context's log says so, and in fp16
 * the scale backs off. The one exception: the fused step without clipping
 * or fp16 updates during its single backward pass, so a gradient that turns
 * out non-finite after a finite loss (an overflow inside backward) and after
 * some tensors were updated stops the step there with MT_ERR_INVALID_ARG,
 * saying how many tensors were updated; no weight or state ever takes a
 * non-finite value (docs/engine.md). */
/* Data parallel (a communicator of N > 1 ranks): b is this rank's rows of
 * the global batch; the gradients are summed over the ranks before the
 * update, *loss is the global batch's mean, and a failure on any rank
 * (a refused batch included) fails the step on every rank before any
 * update (MT_ERR_COMM on the others); with the state on disk, so does a
 * disk failing on one rank in the update. A collective that fails names
 * itself, this rank and the step ("in step N": mt_trainer_steps + 1), and
 * every later call on the broken communicator names that first failure.
 * Every rank must call it. At ZeRO
 * stages 2 and 3, which communicate in every micro-batch, every rank's
 * batch must make as many micro-batches (MT_ERR_INVALID_ARG on every
 * rank otherwise). With pruning (cfg.prune) a prune due at the step is
 * made first, before its passes, and stays made when the step then fails
 * or is skipped: the step's weights and state are the pruned ones. */
mt_status mt_trainer_step(mt_trainer *t, const mt_batch *b, float *loss);
/* Mean loss and accuracy (argmax == target) of a batch without training.
 * Either output may be NULL. */
mt_status mt_trainer_eval(mt_trainer *t, const mt_batch *b, float *loss, float *accuracy);
/* Wanda's calibration (cfg.prune.method MT_PRUNE_WANDA; MT_ERR_STATE
 * otherwise): a forward of b (no loss, nothing kept) whose linear maps'
 * inputs are squared and summed per input feature, over every batch
 * given since the last prune. A Wanda prune takes those sums as its
 * ||x||^2 and needs cfg.prune.calib batches (mt_trainer_step fails with
 * MT_ERR_STATE at a prune that lacks them, changing nothing). One rank
 * (a data-parallel Wanda is MT_ERR_UNSUPPORTED at create). */
mt_status mt_trainer_calibrate(mt_trainer *t, const mt_batch *b);
/* The steps taken before the next prune (-1: none is left), and with calib
 * the calibration batches it still needs. */
mt_status mt_trainer_prune_next(const mt_trainer *t, int64_t *step, int *calib);

/* Steps taken so far (skipped ones included). */
uint64_t mt_trainer_steps(const mt_trainer *t);
/* The learning rate the next step will use. */
float mt_trainer_lr(const mt_trainer *t);
/* The global gradient norm of the last step (before clipping; unscaled), or
 * -1 when the last step did not compute it (no clipping). */
float mt_trainer_last_grad_norm(const mt_trainer *t);

/* The model's outputs (logits over the classes, fp32, before the softmax)
 * at the last position of each row of the batch: n = batch->n x classes
 * (the vocabulary for token models). batch->targets may be NULL. For
 * sampling from a token model. */
mt_status mt_trainer_logits(mt_trainer *t, const mt_batch *b, float *out, size_t n);
/* The gradients of the batch's mean loss, fp32, in the model's parameter
 * order (unscaled in fp16), without updating anything: forward and backward
 * as a step would run them (micro-batches, recompute), then a copy out
 * instead of the update (0 for a frozen parameter). *loss gets the batch's mean loss. For tests and
 * debugging; needs memory for every gradient at once, fused or not. */
mt_status mt_trainer_gradients(mt_trainer *t, const mt_batch *b, float *loss, float *grads,
                               size_t n);

/* Training-state files (format: docs/formats.md). Saves the trainer's whole
 * state: the weights as stored (fp32, 16-bit copies, or bf16 alone), fp32
 * masters, the optimizer state (8-bit codes and their absmax included), the
 * step counters and the loss scaler, plus user_len bytes of the
 * application's own (its data position, its RNG; user may be NULL when
 * user_len is 0). Every section carries a CRC-32. Written atomically
 * (temporary file, fsync, rename, directory fsync): a crash or kill at any
 * moment leaves the previous file at path intact. On Linux file systems with
 * O_TMPFILE (ext4, xfs, btrfs, tmpfs) the temporary gets a name only for
 * the two calls that put it in place (link, rename), with the calling
 * thread's signals blocked, so a process stopped by a signal leaves no
 * PATH.tmp.* file (only SIGKILL landing between those two calls can leave
 * one); elsewhere a named one may remain.
 * Under ZeRO (zero_stage >= 1 on several ranks) saving is a collective:
 * every rank calls it, rank 0 writes the same whole file with every rank's
 * slices, and it succeeds on every rank or on none (the previous file then
 * stays intact); path and user are rank 0's. Under tensor parallel
 * (cfg.tensor_parallel) it is a collective of the tensor group of
 * data-parallel rank 0, whose first rank writes the whole tensors (the
 * file one process with the same state writes; SGD and AdamW or 32-bit
 * state, without ZeRO: MT_ERR_UNSUPPORTED otherwise); the other groups'
 * calls return MT_OK at once. Under pipeline parallel
 * (cfg.pipeline_parallel) it is a collective of the pipeline (and tensor)
 * groups of data-parallel rank 0, of every rank under ZeRO, and the first
 * stage's first rank writes the file one process with the same state
 * writes, each later stage's sections sent to it (not with ZeRO and
 * tensor_parallel together: MT_ERR_UNSUPPORTED). */
mt_status mt_trainer_save(const mt_trainer *t, const char *path, const void *user,
                          size_t user_len);
/* Restores a saved state into a trainer of the same model (kind, shapes),
 * optimizer, precision and master-weight setting; its other settings (the
 * learning rate, say) are its own. The whole file is checked first
 * (version, sizes, every CRC, that it fits this trainer): a truncated,
 * corrupt, other-version (MT_ERR_FORMAT) or other-model (MT_ERR_INVALID_ARG)
 * file leaves the trainer as it was; for the latter the message names the
 * first setting that differs and both values. user (may be NULL) gets up to user_cap
 * bytes of the saved user data, *user_len (may be NULL) its full length.
 * On the CPU, N steps, save, load into a new trainer, M steps give the same
 * bits as N + M steps. On several ranks loading is a collective (every
 * rank loads the same file; a rank whose check fails fails every rank
 * before any state changes, and so do files whose contents differ from
 * rank to rank: MT_ERR_COMM on every rank, naming each rank's digest of its
 * file; within a tensor group MT_ERR_COMM saying the files differ), and
 * each rank keeps the part a ZeRO trainer, or a tensor-parallel one
 * (cfg.tensor_parallel), holds: a file saved at any world size, stage and
 * tensor-parallel layout loads at any other (tensor parallel: 32-bit
 * state, no ZeRO). */
mt_status mt_trainer_load(mt_trainer *t, const char *path, void *user, size_t user_cap,
                          size_t *user_len);

/* The loss scaler's state, part of the trainer's state, with the count of
 * skipped steps. Without fp16 the scale is 1. */
typedef struct mt_loss_scale_state {
    float scale;
    int growth_tracker;      /* clean steps in a row since the scale last changed */
    uint64_t steps_skipped;  /* steps skipped for a non-finite loss or gradient (any
                                precision) */
    int last_step_skipped;   /* whether the last step was one of them */
} mt_loss_scale_state;

mt_status mt_trainer_get_loss_scale(const mt_trainer *t, mt_loss_scale_state *out);
/* Restores a saved state (e.g. when resuming). The scale must be finite and
 * > 0, the tracker in [0, growth_interval) (0 with a static scale); without
 * fp16 the scale must be 1. */
mt_status mt_trainer_set_loss_scale(mt_trainer *t, const mt_loss_scale_state *in);

/* ------------------------------------------------------------------------ */
/* Memory estimate                                                          */
/* ------------------------------------------------------------------------ */

/* What a training run will hold, per memory class, found before the run and
 * without allocating: the model and the trainer are made, and two steps of
 * the largest batch (max_batch rows of max_seq tokens) run, in a dry
 * context: the configuration's allocators over a device with no memory
 * behind it, and ops that compute nothing (those that take workspace take
 * it and give it back). The figures are those the context's accounting
 * (mt_context_memory_stats) shows for the same run, through the same
 * allocators: live bytes as the library counts them, and what the
 * allocators reserve. Assumes no step is skipped (an fp16 overflow skips
 * the update, which then allocates less). A CUDA context's run is
 * estimated without a GPU (a current GPU's allocation geometry, or, for
 * mt_estimate_model, that of the model's device). */
typedef struct mt_estimate_report {
    /* From the model's creation through the trainer's and two steps: */
    uint64_t peak;                     /* live bytes of all classes together, at most */
    uint64_t at_peak[MT_MEM_COUNT];    /* each class's live bytes at that moment */
    uint64_t class_peak[MT_MEM_COUNT]; /* each class's own highest live bytes */
    uint64_t peak_reserved;            /* what the allocators held at most */
    /* Parts of that span: */
    uint64_t setup_peak;               /* creating the model and the trainer (a trainer
                                          without master weights converts the weights
                                          one tensor at a time: it can peak above a step) */
    uint64_t step_peak;                /* during a step */
    uint64_t step_at_peak[MT_MEM_COUNT];
    uint64_t between_steps;            /* live between steps: weights, masters, state */
    size_t n_params;                   /* the model's parameters (elements) */
    /* Per place (mt_place): each class's own peak there, and the place's
     * peak (all classes together). The device's are class_peak and peak;
     * disk holds what the trainer offloads (mt_trainer_config.offload). */
    uint64_t place_class_peak[MT_PLACE_COUNT][MT_MEM_COUNT];
    uint64_t place_peak[MT_PLACE_COUNT];
} mt_estimate_report;

/* For a model made with mt_model_create from spec, on a context made from
 * cc, trained with tc (either NULL: its defaults). Bad specs and configs
 * give the errors model and trainer creation give. */
mt_status mt_estimate(const mt_context_config *cc, const mt_model_spec *spec,
                      const mt_trainer_config *tc, mt_estimate_report *out);
mt_status mt_estimate_mlp(const mt_context_config *cc, const mt_mlp_spec *spec,
                          const mt_trainer_config *tc, mt_estimate_report *out);
mt_status mt_estimate_gpt(const mt_context_config *cc, const mt_gpt_spec *spec,
                          const mt_trainer_config *tc, mt_estimate_report *out);
/* For an existing model (its kind and shapes) on its context's
 * configuration; nothing is allocated on that context. The estimate is
 * kept with the context for mt_memory_report (as is the chosen plan's of a
 * trainer made with a memory budget). */
mt_status mt_estimate_model(const mt_model *m, const mt_trainer_config *tc,
                            mt_estimate_report *out);
/* Sets (or with NULL clears) the estimate mt_memory_report shows. */
mt_status mt_context_set_estimate(mt_context *ctx, const mt_estimate_report *e);

/* What a trace shows: live bytes per class over its events (frees and
 * resets applied as the allocators apply them; blocks allocated before the
 * trace began are not known to it). */
typedef struct mt_trace_summary {
    size_t events;
    uint64_t dropped;                   /* events past the trace's capacity */
    uint64_t allocs, frees, resets, failed;
    uint64_t span_ns;                   /* first event to last */
    uint64_t peak, peak_ns;             /* the most live bytes, and when */
    uint64_t at_peak[MT_MEM_COUNT];     /* each class then */
    uint64_t class_peak[MT_MEM_COUNT];  /* each class's own peak */
} mt_trace_summary;
mt_status mt_trace_summarize(mt_context *ctx, const mt_trace *t, mt_trace_summary *out);

/* A trace as Chrome trace JSON (opens in Perfetto and chrome://tracing):
 * a counter track of live bytes per class after every event, each block as
 * an async slice from its allocation to its free or reset (one track per
 * class), resets and failed allocations as instant events, and with est
 * (may be NULL) the estimate's peak and peak reserve as a flat counter.
 * Written atomically. Errors go to ctx (may be NULL). */
mt_status mt_trace_export_chrome(mt_context *ctx, const mt_trace *t, const mt_estimate_report *est,
                                 const char *path);
/* A trace as an SVG plot of live bytes by class over time (stacked areas;
 * each pixel column shows its busiest moment, so peaks survive), the peak
 * marked with its value, the classes at the peak in the legend, and with
 * est the estimate's peak as a dashed line. Written atomically. */
mt_status mt_trace_export_svg(mt_context *ctx, const mt_trace *t, const mt_estimate_report *est,
                              const char *path);

/* ------------------------------------------------------------------------ */
/* Training data                                                            */
/* ------------------------------------------------------------------------ */

/* Text (each byte a token, vocabulary 256) or an llm.c token file (uint16
 * tokens after a 256-int header: docs/formats.md), split into
 * training and validation (the last val_fraction), cut into windows of
 * seq_len + 1 tokens (stride seq_len) and served as batches: training
 * windows in an order shuffled per epoch from the seed, validation windows
 * in order. With prefetch, the next training batch is made on a background
 * thread while the caller trains on the current one. The stream's position
 * (epoch, window) makes a resumed run see the batches an unbroken one
 * would. */
typedef struct mt_data mt_data;

typedef enum mt_data_format {
    MT_DATA_AUTO = 0,   /* an llm.c token file if the magic says so, else text */
    MT_DATA_TEXT = 1,
    MT_DATA_TOKENS = 2
} mt_data_format;

typedef enum mt_data_split { MT_DATA_TRAIN = 0, MT_DATA_VAL = 1 } mt_data_split;

typedef struct mt_data_config {
    uint32_t struct_size;
    const char *path;       /* a file, or: */
    const void *bytes;      /* text (or a token file's bytes) in memory, n_bytes long */
    size_t n_bytes;
    mt_data_format format;  /* MT_DATA_AUTO */
    double val_fraction;    /* of the windows, the last ones (0.1) */
    int seq_len;            /* tokens per row (64) */
    int batch;              /* rows per batch (8) */
    uint64_t seed;          /* the training order (1) */
    int prefetch;           /* 1: a background thread makes the next batch (1) */
} mt_data_config;
void mt_data_config_init(mt_data_config *c);

/* Opens the data. A truncated or corrupt token file gives MT_ERR_FORMAT, a
 * missing file MT_ERR_IO, too little data for one window of each split
 * MT_ERR_INVALID_ARG; the message (mt_last_error(NULL)) names the file. */
mt_status mt_data_open(const mt_data_config *cfg, mt_data **out);
void mt_data_close(mt_data *d);
/* The next batch of a split (tokens and targets, valid until the next call
 * for that split). */
mt_status mt_data_next(mt_data *d, mt_data_split split, mt_batch *out);

typedef struct mt_data_info {
    int vocab;                    /* 256 for text; the largest token + 1 for a token file */
    size_t tokens;
    size_t train_windows, val_windows;
    uint64_t epoch, position;     /* the training stream, after the last batch handed out */
    uint64_t val_position;        /* the validation stream: the window its next batch
                                     starts at (0 .. val_windows - 1; it wraps around) */
} mt_data_info;
mt_status mt_data_get_info(const mt_data *d, mt_data_info *out);
/* Moves the training stream to (epoch, position), as mt_data_get_info gave
 * them (resuming). */
mt_status mt_data_seek(mt_data *d, uint64_t epoch, uint64_t position);
/* Moves the validation stream to position, as mt_data_get_info gave it in
 * val_position, so a resumed run measures on the batches an unbroken one
 * would. A position outside 0 .. val_windows - 1 gives MT_ERR_INVALID_ARG
 * (0 is the start, also without a validation split). */
mt_status mt_data_seek_val(mt_data *d, uint64_t position);

#ifdef __cplusplus
}
#endif
#endif /* MEMTRAIN_H */
