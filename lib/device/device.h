/*
 * device.h - the device layer behind one small internal interface.
 *
 * A device gives memory (plain reservations and, where it can, growable
 * address ranges), copies, memset and synchronisation. Two implementations:
 * device_cpu.c (host memory from a jemalloc arena of the library's own) and
 * device_cuda.c (the CUDA Driver API, loaded at run time).
 *
 * Device functions report failures through mti_fail on the owning context.
 */
#ifndef MT_DEVICE_H
#define MT_DEVICE_H

#include <stdbool.h>

#include "memtrain.h"

typedef struct mti_device mti_device;
struct mti_ops; /* lib/ops/kernels.h */

struct mti_device {
    mt_device_kind kind;    /* MT_DEVICE_CPU or MT_DEVICE_CUDA */
    int ordinal;
    char name[256];         /* e.g. "CPU (2 threads)", "NVIDIA H100 80GB HBM3" */
    size_t total_bytes;     /* memory the device has (host: physical RAM) */
    size_t min_alignment;   /* alignment of every reservation (>= 256) */
    size_t granularity;     /* segment multiple: host page, or CUDA's VMM granularity */
    mt_context *ctx;        /* for error messages */
    void *impl;

    /* Memory. reserve returns MT_ERR_OOM when the device has no more. */
    mt_status (*mem_reserve)(mti_device *d, size_t bytes, size_t alignment, void **ptr,
                             size_t *granted);
    void (*mem_release)(mti_device *d, void *ptr, size_t granted);

    /* Growable ranges (NULL where not offered). Sizes are multiples of
     * granularity; commit maps memory read-write, decommit gives it back and
     * leaves the addresses reserved. */
    mt_status (*va_reserve)(mti_device *d, size_t bytes, void **base);
    mt_status (*va_commit)(mti_device *d, void *addr, size_t bytes);
    void (*va_decommit)(mti_device *d, void *addr, size_t bytes);
    void (*va_release)(mti_device *d, void *base, size_t bytes);
    /* Called (CUDA) before memory goes back to the driver (mem_release,
     * va_decommit, va_release, and what destroy still holds): waits, up to
     * a deadline of its own, for work another layer queued on streams of
     * its own that may still run, and says whether it ended (true: the
     * memory may go). The communication layer installs it (NCCL's
     * communication streams, comm/nccl_overlap.c), so the device layer
     * knows nothing of NCCL. false: the memory is kept (never given back:
     * freeing it under running work blocks the process in the driver, or
     * lets the work write into memory handed out again); the hook says
     * why. NULL: none. */
    bool (*release_guard)(void *arg);
    void *release_guard_arg;
    /* Set once the guard said no (or its layer found work that did not
     * end): from then on nothing goes back to the driver, destroy
     * included. */
    bool release_held;

    /* Copies and memset, ordered on the device's stream. */
    mt_status (*copy_h2d)(mti_device *d, void *dst, const void *src, size_t bytes);
    mt_status (*copy_d2h)(mti_device *d, void *dst, const void *src, size_t bytes);
    mt_status (*copy_d2d)(mti_device *d, void *dst, const void *src, size_t bytes);
    mt_status (*memset8)(mti_device *d, void *dst, int value, size_t bytes);
    /* Waits until everything queued on the device is done. */
    mt_status (*sync)(mti_device *d);
    /* Bytes free and total on the device, as the driver reports them
     * (host: MemAvailable and MemTotal). */
    mt_status (*mem_info)(mti_device *d, size_t *free_bytes, size_t *total_bytes);

    /* Set before destroy when memory of the device may still be written by
     * a collective that timed out (mt_context.kept): destroy then
     * leaves the device's memory to the process instead of giving it back. */
    bool keep_memory;
    void (*destroy)(mti_device *d);
};

/* Opens the host device. */
mt_status mti_device_cpu_open(mt_context *ctx, int threads, mti_device **out);
/* The host device's alignment and granularity, into d. */
void mti_cpu_geometry(mti_device *d);
/* What the host device grants for a reservation of bytes at alignment. */
size_t mti_cpu_granted(size_t bytes, size_t alignment);
/* A device with no memory behind it, for the dry contexts of estimates
 * (lib/device/device_dry.c). kind MT_DEVICE_CPU: the host device's geometry. kind
 * MT_DEVICE_CUDA: that of `like` when it is a CUDA device (alignment,
 * granularity, growable ranges or not), else a current NVIDIA GPU's (256-byte
 * alignment, 2 MiB granularity, growable ranges). */
mt_status mti_device_dry_open(mt_context *ctx, mt_device_kind kind, const mti_device *like,
                              int threads, mti_device **out);

/* Opens CUDA device `ordinal` through the driver at `driver_path` (NULL:
 * "libcuda.so.1"). MT_ERR_NO_DEVICE when there is no driver, the driver has
 * no device, or the ordinal is out of range; the message says which. */
mt_status mti_device_cuda_open(mt_context *ctx, const char *driver_path, int ordinal,
                               mti_device **out);

/* True if a CUDA driver with at least one device can be opened (for
 * MT_DEVICE_AUTO). Never fails loudly. */
int mti_cuda_available(const char *driver_path);

#endif /* MT_DEVICE_H */
