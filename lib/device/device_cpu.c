/*
 * device_cpu.c - the host as a device.
 *
 * Memory comes from a jemalloc arena created for the context alone, without
 * thread caches, so the library's bytes are kept apart from the
 * application's and can be counted and checked against jemalloc's own
 * per-arena statistics. The arena's decay times are set to 0: memory an
 * allocator gives back is returned to the system at once, so the process's
 * resident size follows what the allocators reserve.
 *
 * Growable ranges use mmap directly (jemalloc cannot grow a block in place):
 * address space is reserved PROT_NONE and pages are made read-write as a
 * range grows, and dropped with MADV_DONTNEED when it shrinks.
 */
#include <errno.h>
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ops/kernels.h"

typedef struct cpu_impl {
    unsigned arena; /* jemalloc arena index */
} cpu_impl;

/* jemalloc serves sizes >= 16 KiB as page runs ("large" size classes, 4 per
 * power of two); the tail between the request and the class is address
 * space that is never touched, so it costs no memory: count the page-rounded
 * request. Smaller requests live in slabs of their exact size class. */
#define CPU_LARGE_MIN (16u << 10)
#define CPU_PAGE 4096u

static int cpu_flags(const cpu_impl *c, size_t alignment)
{
    return MALLOCX_ARENA(c->arena) | MALLOCX_TCACHE_NONE | MALLOCX_ALIGN(alignment);
}

void mti_cpu_geometry(mti_device *d)
{
    d->min_alignment = MT_DEFAULT_ALIGNMENT;
    long psz = sysconf(_SC_PAGESIZE);
    d->granularity = psz > 0 ? (size_t)psz : CPU_PAGE;
}

size_t mti_cpu_granted(size_t bytes, size_t alignment)
{
    return bytes >= CPU_LARGE_MIN ? mti_align_up(bytes, CPU_PAGE)
                                  : nallocx(bytes, MALLOCX_TCACHE_NONE | MALLOCX_ALIGN(alignment));
}

static mt_status cpu_reserve(mti_device *d, size_t bytes, size_t alignment, void **ptr,
                             size_t *granted)
{
    cpu_impl *c = d->impl;
    if (alignment < d->min_alignment) alignment = d->min_alignment;
    if (bytes == 0 || bytes > MT_MAX_REQUEST || !mti_is_pow2(alignment))
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                        "host reserve: bad size %zu or alignment %zu", bytes, alignment);
    int flags = cpu_flags(c, alignment);
    size_t g = mti_cpu_granted(bytes, alignment);
    void *p = mallocx(g, flags);
    if (!p)
        return mti_fail(d->ctx, MT_ERR_OOM, "host reserve: out of memory for %zu bytes", g);
    *ptr = p;
    *granted = g;
    return MT_OK;
}

static void cpu_release(mti_device *d, void *ptr, size_t granted)
{
    cpu_impl *c = d->impl;
    if (ptr) dallocx(ptr, MALLOCX_ARENA(c->arena) | MALLOCX_TCACHE_NONE);
    (void)granted;
}

static mt_status cpu_va_reserve(mti_device *d, size_t bytes, void **base)
{
    if (bytes == 0 || bytes % d->granularity)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                        "host va_reserve: size %zu is not a positive multiple of %zu", bytes,
                        d->granularity);
    void *p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return mti_fail(d->ctx, MT_ERR_OOM, "host va_reserve of %zu bytes: %s", bytes,
                        strerror(errno));
    *base = p;
    return MT_OK;
}

static mt_status cpu_va_commit(mti_device *d, void *addr, size_t bytes)
{
    if (mprotect(addr, bytes, PROT_READ | PROT_WRITE) != 0)
        return mti_fail(d->ctx, MT_ERR_OOM, "host va_commit of %zu bytes: %s", bytes,
                        strerror(errno));
    return MT_OK;
}

static void cpu_va_decommit(mti_device *d, void *addr, size_t bytes)
{
    (void)d;
    madvise(addr, bytes, MADV_DONTNEED);
    mprotect(addr, bytes, PROT_NONE);
}

static void cpu_va_release(mti_device *d, void *base, size_t bytes)
{
    (void)d;
    munmap(base, bytes);
}

static mt_status cpu_copy(mti_device *d, void *dst, const void *src, size_t bytes)
{
    (void)d;
    if (bytes) memmove(dst, src, bytes);
    return MT_OK;
}

static mt_status cpu_memset8(mti_device *d, void *dst, int value, size_t bytes)
{
    (void)d;
    if (bytes) memset(dst, value, bytes);
    return MT_OK;
}

static mt_status cpu_sync(mti_device *d)
{
    (void)d;
    return MT_OK;
}

/* MemAvailable / MemTotal from /proc/meminfo, in bytes. */
static mt_status cpu_mem_info(mti_device *d, size_t *free_bytes, size_t *total_bytes)
{
    unsigned long long avail = 0, total = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        while (fgets(line, sizeof line, f)) {
            unsigned long long kb;
            if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) total = kb * 1024;
            else if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = kb * 1024;
        }
        fclose(f);
    }
    if (!total) {
        long pages = sysconf(_SC_PHYS_PAGES), avp = sysconf(_SC_AVPHYS_PAGES);
        long psz = sysconf(_SC_PAGESIZE);
        if (pages <= 0 || psz <= 0)
            return mti_fail(d->ctx, MT_ERR_DEVICE, "host memory size unknown");
        total = (unsigned long long)pages * (unsigned long long)psz;
        avail = avp > 0 ? (unsigned long long)avp * (unsigned long long)psz : total;
    }
    if (free_bytes) *free_bytes = (size_t)avail;
    if (total_bytes) *total_bytes = (size_t)total;
    return MT_OK;
}

static void cpu_destroy(mti_device *d)
{
    if (!d) return;
    cpu_impl *c = d->impl;
    if (c) {
        char name[64];
        snprintf(name, sizeof name, "arena.%u.destroy", c->arena);
        if (!d->keep_memory) mallctl(name, NULL, NULL, NULL, 0);
        free(c);
    }
    free(d);
}

static int arena_set_ssize(unsigned arena, const char *what, ssize_t v)
{
    char name[64];
    snprintf(name, sizeof name, "arena.%u.%s", arena, what);
    return mallctl(name, NULL, NULL, &v, sizeof v);
}

mt_status mti_device_cpu_open(mt_context *ctx, int threads, mti_device **out)
{
    mti_device *d = calloc(1, sizeof *d);
    cpu_impl *c = calloc(1, sizeof *c);
    if (!d || !c) {
        free(d);
        free(c);
        return mti_fail(ctx, MT_ERR_OOM, "host device: out of host memory");
    }
    size_t sz = sizeof c->arena;
    int e = mallctl("arenas.create", &c->arena, &sz, NULL, 0);
    if (e != 0) {
        free(d);
        free(c);
        return mti_fail(ctx, MT_ERR_DEVICE, "host device: jemalloc arenas.create failed (%s)",
                        strerror(e));
    }
    /* give freed pages back at once (see the top of the file) */
    arena_set_ssize(c->arena, "dirty_decay_ms", 0);
    arena_set_ssize(c->arena, "muzzy_decay_ms", 0);

    d->kind = MT_DEVICE_CPU;
    d->ordinal = 0;
    snprintf(d->name, sizeof d->name, "CPU (%d threads)", threads);
    mti_cpu_geometry(d);
    d->ctx = ctx;
    d->impl = c;
    d->mem_reserve = cpu_reserve;
    d->mem_release = cpu_release;
    d->va_reserve = cpu_va_reserve;
    d->va_commit = cpu_va_commit;
    d->va_decommit = cpu_va_decommit;
    d->va_release = cpu_va_release;
    d->copy_h2d = cpu_copy;
    d->copy_d2h = cpu_copy;
    d->copy_d2d = cpu_copy;
    d->memset8 = cpu_memset8;
    d->sync = cpu_sync;
    d->mem_info = cpu_mem_info;
    d->destroy = cpu_destroy;
    size_t total = 0;
    if (cpu_mem_info(d, NULL, &total) == MT_OK) d->total_bytes = total;
    *out = d;
    return MT_OK;
}
