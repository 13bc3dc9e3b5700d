/*
 * memtrain/allocator.h - the allocator plug-in contract.
 *
 * An allocator is a table of functions (mt_allocator_vtable) plus the state
 * its create function makes. The library wraps every instance: it checks
 * requests before they reach the allocator, counts live bytes per memory
 * class, counts every byte the allocator takes from its backing, records
 * traces, and takes a lock when the instance was asked to be thread-safe.
 * So an allocator only has to hand out addresses.
 *
 * Rules an allocator follows:
 *   1. It gets memory only from the backing it is given (mt_backing), so every
 *      byte is counted, and gives all of it back in destroy.
 *   2. It keeps its bookkeeping in host memory and never reads or writes the
 *      memory it hands out: on a CUDA context that memory is on the device.
 *   3. alloc returns an address aligned to req->alignment, inside memory it
 *      holds from the backing, not overlapping any other live block, valid for
 *      req->bytes bytes. It puts what it needs to find the block again in
 *      out->handle (the library fills the other fields of mt_block).
 *   4. free gets back the block exactly as alloc returned it. It returns
 *      MT_ERR_BAD_BLOCK for a block it did not hand out or already freed,
 *      where it can tell, and then changes nothing.
 *   5. reset(scope) frees every live block whose lifetime is >= scope. The
 *      library has already counted them as freed.
 *   6. Out of memory is MT_ERR_OOM, never a crash, and the instance stays
 *      usable afterwards.
 *   7. Functions return MT_OK or an mt_status; they never print or abort.
 *
 * A block that breaks rule 3 (NULL, misaligned, or, with
 * MT_ALLOCATOR_CHECKED, outside the memory held or over a live block) is
 * given back through free and the call fails with MT_ERR_PLUGIN.
 *
 * The library guarantees: alloc is never called with bytes == 0 (empty
 * blocks are handled before), alignment is a power of two between
 * MT_DEFAULT_ALIGNMENT and MT_MAX_ALIGNMENT, mem_class and lifetime are in
 * range, bytes <= MT_MAX_REQUEST. Calls into one instance are serialized
 * when the instance was created with MT_ALLOCATOR_THREAD_SAFE; otherwise the
 * application must not call one instance from two threads at once.
 *
 * examples/custom_allocator.c is a complete allocator written against this
 * header alone.
 */
#ifndef MEMTRAIN_ALLOCATOR_H
#define MEMTRAIN_ALLOCATOR_H

#include "../memtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever mt_allocator_vtable or mt_backing change incompatibly. */
#define MT_ALLOCATOR_ABI_VERSION 1u

/* The largest request the library passes to an allocator (2^50 bytes), so
 * size arithmetic inside allocators cannot overflow. */
#define MT_MAX_REQUEST ((size_t)1 << 50)

/* Where an allocator's memory comes from. The library makes one per
 * instance; its calls are counted as the instance's reserved bytes and
 * backing calls, and fail with MT_ERR_OOM past the instance's limit. */
typedef struct mt_backing {
    uint32_t abi_version;   /* MT_ALLOCATOR_ABI_VERSION */
    mt_device_kind device;  /* MT_DEVICE_CPU or MT_DEVICE_CUDA */
    size_t min_alignment;   /* every address reserve returns is aligned to at least this (>= 256) */
    size_t granularity;     /* the device's natural segment multiple: 4096 (host), 2 MiB (CUDA) */
    void *self;             /* pass to every function below */

    /* Takes `bytes` (> 0) aligned to `alignment` (a power of two; 0 means
     * min_alignment). On success *ptr is set and *granted to the usable size
     * (>= bytes; the whole of it counts as reserved). On CUDA, alignment
     * above min_alignment can cost up to alignment - 256 bytes of the
     * device that are not counted (cuMemAlloc is over-asked when its address
     * is not aligned enough), so ask for it only where it is needed. */
    mt_status (*reserve)(void *self, size_t bytes, size_t alignment, void **ptr,
                         size_t *granted);
    /* Gives back a whole reservation: ptr and granted exactly as reserve set them. */
    void (*release)(void *self, void *ptr, size_t granted);

    /* Growable ranges: address space reserved up front and backed piece by
     * piece, so a region can grow in place. Offered where the device can
     * (host: mmap; CUDA: cuMemAddressReserve + cuMemCreate/cuMemMap); NULL
     * otherwise. Sizes and offsets are multiples of `granularity`. Only
     * committed bytes count as reserved. */
    mt_status (*va_reserve)(void *self, size_t bytes, void **base);
    mt_status (*va_commit)(void *self, void *addr, size_t bytes);
    void (*va_decommit)(void *self, void *addr, size_t bytes);
    void (*va_release)(void *self, void *base, size_t bytes);
} mt_backing;

/* What create gets besides the backing. */
typedef struct mt_allocator_params {
    uint32_t struct_size;
    const void *options; /* mt_allocator_config.options, as given */
    uint32_t flags;      /* mt_allocator_config.flags */
    size_t limit_bytes;  /* informative: the backing enforces it */
} mt_allocator_params;

/* Capability flags of a vtable */
#define MT_ALLOCATOR_CAP_DETECTS_BAD_FREE 0x1u /* free always detects foreign and double frees */

struct mt_allocator_vtable {
    uint32_t abi_version; /* MT_ALLOCATOR_ABI_VERSION */
    uint32_t struct_size; /* sizeof(mt_allocator_vtable) */
    const char *name;     /* short, lower case, no spaces */
    uint32_t caps;        /* MT_ALLOCATOR_CAP_* */

    /* Makes an instance. The backing pointer stays valid until destroy. */
    mt_status (*create)(const mt_allocator_params *params, const mt_backing *backing,
                        void **state);
    mt_status (*alloc)(void *state, const mt_alloc_request *req, mt_block *out);
    mt_status (*free)(void *state, const mt_block *blk);
    /* Frees every live block with lifetime >= scope (see rule 5). */
    mt_status (*reset)(void *state, mt_scope scope);
    /* Gives cached, unused memory back to the backing. May be NULL. */
    mt_status (*trim)(void *state);
    /* The allocator's own view of its stats (see mt_allocator_stats). May be
     * NULL; the helpers below make keeping them easy. */
    mt_status (*stats)(void *state, mt_allocator_stats *out);
    /* Gives everything back to the backing and frees the state. */
    void (*destroy)(void *state);
};

/* ---- helpers for keeping mt_allocator_stats (for allocator authors) ---- */

static inline void mt_stats_on_alloc(mt_allocator_stats *s, mt_mem_class c, size_t bytes)
{
    s->live_bytes += bytes;
    if (s->live_bytes > s->peak_live_bytes) s->peak_live_bytes = s->live_bytes;
    s->n_alloc++;
    mt_class_stats *k = &s->per_class[c];
    k->live_bytes += bytes;
    if (k->live_bytes > k->peak_live_bytes) k->peak_live_bytes = k->live_bytes;
    k->n_alloc++;
}

static inline void mt_stats_on_free(mt_allocator_stats *s, mt_mem_class c, size_t bytes)
{
    s->live_bytes -= bytes;
    s->n_free++;
    s->per_class[c].live_bytes -= bytes;
    s->per_class[c].n_free++;
}

static inline void mt_stats_on_oom(mt_allocator_stats *s, mt_mem_class c)
{
    s->n_oom_failures++;
    s->per_class[c].n_oom_failures++;
}

static inline void mt_stats_on_reserve(mt_allocator_stats *s, size_t bytes)
{
    s->reserved_bytes += bytes;
    if (s->reserved_bytes > s->peak_reserved_bytes) s->peak_reserved_bytes = s->reserved_bytes;
    s->n_backing_alloc++;
}

static inline void mt_stats_on_release(mt_allocator_stats *s, size_t bytes)
{
    s->reserved_bytes -= bytes;
    s->n_backing_free++;
}

#ifdef __cplusplus
}
#endif
#endif /* MEMTRAIN_ALLOCATOR_H */
