/*
 * device_dry.c - a device with no memory behind it, for the dry contexts of
 * estimates (lib/engine/estimate.c).
 *
 * Reservations succeed with addresses from a counter that are never
 * touched, with the geometry (alignment, granularity, growable ranges) of
 * the device they stand for, so the allocators above place every block as
 * they would on it. Copies and memsets do nothing; reads from the device
 * give zeros (losses, flags, norms). The op table is the device kind's own:
 * its ops see the dry context (mti_dry) and take their workspace as they
 * would, then stop.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/kernels.h"

/* Addresses start at 2^47, outside user space on x86-64 and AArch64 with
 * 48-bit addresses, so touching one faults at once. They are never reused. */
#define DRY_BASE ((uintptr_t)1 << 47)

typedef struct dry_impl {
    uintptr_t next;
} dry_impl;

static mt_status dry_take(mti_device *d, size_t bytes, size_t alignment, void **ptr)
{
    dry_impl *di = d->impl;
    uintptr_t at = (di->next + alignment - 1) & ~(uintptr_t)(alignment - 1);
    di->next = at + bytes;
    *ptr = (void *)at;
    return MT_OK;
}

/* As the device it stands for grants: the host device rounds up
 * (mti_cpu_granted); the CUDA device (lib/device/device_cuda.c) grants the bytes
 * asked for and refuses alignments above MT_MAX_ALIGNMENT. */
static mt_status dry_reserve(mti_device *d, size_t bytes, size_t alignment, void **ptr,
                             size_t *granted)
{
    const bool cuda = d->kind == MT_DEVICE_CUDA;
    if (alignment < d->min_alignment) alignment = d->min_alignment;
    if (bytes == 0 || bytes > MT_MAX_REQUEST || !mti_is_pow2(alignment) ||
        (cuda && alignment > MT_MAX_ALIGNMENT))
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG, "%s reserve: bad size %zu or alignment %zu",
                        cuda ? "CUDA" : "host", bytes, alignment);
    *granted = cuda ? bytes : mti_cpu_granted(bytes, alignment);
    return dry_take(d, *granted, alignment, ptr);
}

static void dry_release(mti_device *d, void *ptr, size_t granted)
{
    (void)d, (void)ptr, (void)granted;
}

static mt_status dry_va_reserve(mti_device *d, size_t bytes, void **base)
{
    if (bytes == 0 || bytes % d->granularity || bytes > MT_MAX_REQUEST)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                        "va_reserve: size %zu is not a positive multiple of %zu", bytes,
                        d->granularity);
    return dry_take(d, bytes, d->granularity, base);
}

static mt_status dry_va_commit(mti_device *d, void *addr, size_t bytes)
{
    (void)d, (void)addr, (void)bytes;
    return MT_OK;
}

static void dry_va_decommit(mti_device *d, void *addr, size_t bytes)
{
    (void)d, (void)addr, (void)bytes;
}

static mt_status dry_copy(mti_device *d, void *dst, const void *src, size_t bytes)
{
    (void)d, (void)dst, (void)src, (void)bytes;
    return MT_OK;
}

/* device to host: the host side reads zeros (losses, flags, norms) */
static mt_status dry_download(mti_device *d, void *dst, const void *src, size_t bytes)
{
    (void)d, (void)src;
    if (bytes) memset(dst, 0, bytes);
    return MT_OK;
}

static mt_status dry_memset8(mti_device *d, void *dst, int value, size_t bytes)
{
    (void)d, (void)dst, (void)value, (void)bytes;
    return MT_OK;
}

static mt_status dry_sync(mti_device *d)
{
    (void)d;
    return MT_OK;
}

static mt_status dry_mem_info(mti_device *d, size_t *free_bytes, size_t *total_bytes)
{
    if (free_bytes) *free_bytes = d->total_bytes;
    if (total_bytes) *total_bytes = d->total_bytes;
    return MT_OK;
}

static void dry_destroy(mti_device *d)
{
    if (!d) return;
    free(d->impl);
    free(d);
}

/* A current NVIDIA GPU's geometry, where no device tells it. */
#define DRY_CUDA_ALIGN 256u
#define DRY_CUDA_GRAN ((size_t)2 << 20)

mt_status mti_device_dry_open(mt_context *ctx, mt_device_kind kind, const mti_device *like,
                              int threads, mti_device **out)
{
    mti_device *d = calloc(1, sizeof *d);
    dry_impl *di = calloc(1, sizeof *di);
    if (!d || !di) {
        free(d);
        free(di);
        return mti_fail(ctx, MT_ERR_OOM, "estimate: out of host memory");
    }
    di->next = DRY_BASE;
    d->total_bytes = (size_t)1 << 46; /* no limit but the configuration's */
    d->ctx = ctx;
    d->impl = di;
    bool growable = true;
    if (kind == MT_DEVICE_CUDA) {
        d->kind = MT_DEVICE_CUDA;
        const bool real = like && like->kind == MT_DEVICE_CUDA;
        snprintf(d->name, sizeof d->name, "%.200s (estimate)", real ? like->name : "CUDA GPU");
        d->min_alignment = real ? like->min_alignment : DRY_CUDA_ALIGN;
        d->granularity = real ? like->granularity : DRY_CUDA_GRAN;
        growable = real ? like->va_reserve != NULL : true;
    } else {
        d->kind = MT_DEVICE_CPU;
        snprintf(d->name, sizeof d->name, "CPU (%d threads, estimate)", threads);
        mti_cpu_geometry(d); /* as the host device */
    }
    d->mem_reserve = dry_reserve;
    d->mem_release = dry_release;
    if (growable) {
        d->va_reserve = dry_va_reserve;
        d->va_commit = dry_va_commit;
        d->va_decommit = dry_va_decommit;
        d->va_release = dry_va_decommit;
    }
    d->copy_h2d = dry_copy;
    d->copy_d2h = dry_download;
    d->copy_d2d = dry_copy;
    d->memset8 = dry_memset8;
    d->sync = dry_sync;
    d->mem_info = dry_mem_info;
    d->destroy = dry_destroy;
    *out = d;
    return MT_OK;
}
