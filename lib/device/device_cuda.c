/*
 * device_cuda.c - an NVIDIA GPU as a device, through the CUDA Driver API.
 *
 * The driver is opened with dlopen when a context asks for CUDA, so the
 * library links and runs its CPU path where there is no driver, and says
 * exactly what is missing when CUDA is asked for: the library, an entry
 * point, a working cuInit (the toolkit's stub libcuda fails there), a device,
 * or the ordinal. Those are MT_ERR_NO_DEVICE; any later driver failure is
 * MT_ERR_DEVICE naming the call and the driver's result code, except out of
 * memory, which is MT_ERR_OOM.
 *
 * Work runs in the device's primary context (the one the CUDA runtime and
 * cuBLAS share), made current around every call with push/pop, so any
 * thread may call and the application's own current context is left as it
 * was. All copies and memsets are queued on one stream per device.
 *
 * Growable ranges use the virtual memory management calls: address space
 * from cuMemAddressReserve, and physical memory created and mapped one
 * granule at a time, because the driver can only unmap whole mappings and an
 * allocator may shrink a range by any multiple of the granularity. A
 * host-side table per range keeps each granule's physical handle.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/cuda_device.h"
#include "device/cuda_driver.h"
#include "internal.h"
#include "ops/kernels.h"

#if MT_HAVE_CUDA_KERNELS
/* kernels/cuda/kernels.cu compiled to a fatbin by nvcc, embedded by tools/bin2c */
extern const unsigned char mti_cuda_fatbin[];
extern const size_t mti_cuda_fatbin_size;
#endif

#define CUDA_DEFAULT_DRIVER "libcuda.so.1"
#define CUDA_MIN_ALIGN 256u             /* cuMemAlloc aligns at least this, bytes */
#define CUDA_FALLBACK_GRAN (2u << 20)   /* granularity when VMM is not offered, bytes */

/* ---- the driver's entry points ---- */

typedef struct cuda_api {
    void *lib;
    PFN_cuInit Init;
    PFN_cuDriverGetVersion DriverGetVersion;
    PFN_cuDeviceGetCount DeviceGetCount;
    PFN_cuDeviceGet DeviceGet;
    PFN_cuDeviceGetName DeviceGetName;
    PFN_cuDeviceTotalMem DeviceTotalMem;
    PFN_cuDeviceGetAttribute DeviceGetAttribute;
    PFN_cuDevicePrimaryCtxRetain PrimaryCtxRetain;
    PFN_cuDevicePrimaryCtxRelease PrimaryCtxRelease;
    PFN_cuCtxSetCurrent CtxSetCurrent;
    PFN_cuCtxPushCurrent CtxPushCurrent;
    PFN_cuCtxPopCurrent CtxPopCurrent;
    PFN_cuMemAlloc MemAlloc;
    PFN_cuMemFree MemFree;
    PFN_cuMemGetInfo MemGetInfo;
    PFN_cuMemcpyHtoDAsync MemcpyHtoDAsync;
    PFN_cuMemcpyDtoHAsync MemcpyDtoHAsync;
    PFN_cuMemcpyDtoDAsync MemcpyDtoDAsync;
    PFN_cuMemsetD8Async MemsetD8Async;
    PFN_cuStreamCreate StreamCreate;
    PFN_cuStreamSynchronize StreamSynchronize;
    PFN_cuStreamDestroy StreamDestroy;
    PFN_cuMemcpyAsync MemcpyAsync;
    PFN_cuMemHostAlloc MemHostAlloc;
    PFN_cuMemFreeHost MemFreeHost;
    PFN_cuEventCreate EventCreate;
    PFN_cuEventRecord EventRecord;
    PFN_cuEventSynchronize EventSynchronize;
    PFN_cuEventQuery EventQuery;
    PFN_cuEventDestroy EventDestroy;
    PFN_cuEventElapsedTime EventElapsedTime;
    PFN_cuStreamWaitEvent StreamWaitEvent;
    PFN_cuModuleLoadData ModuleLoadData;
    PFN_cuModuleGetFunction ModuleGetFunction;
    PFN_cuModuleUnload ModuleUnload;
    PFN_cuLaunchKernel LaunchKernel;
    PFN_cuMemAddressReserve MemAddressReserve;
    PFN_cuMemAddressFree MemAddressFree;
    PFN_cuMemCreate MemCreate;
    PFN_cuMemRelease MemRelease;
    PFN_cuMemMap MemMap;
    PFN_cuMemUnmap MemUnmap;
    PFN_cuMemSetAccess MemSetAccess;
    PFN_cuMemGetAllocationGranularity MemGetAllocationGranularity;
    PFN_cuGetErrorName GetErrorName;
    PFN_cuGetErrorString GetErrorString;
    PFN_cuFuncLoad FuncLoad; /* optional: NULL for drivers before CUDA 12.4 */
} cuda_api;

/* The exported symbol of each entry point: the versioned name where the
 * driver keeps an old signature under the plain one. */
static const struct {
    const char *name;
    size_t off;
} cuda_syms[] = {
#define SYM(field, sym) {sym, offsetof(cuda_api, field)}
    SYM(Init, "cuInit"),
    SYM(DriverGetVersion, "cuDriverGetVersion"),
    SYM(DeviceGetCount, "cuDeviceGetCount"),
    SYM(DeviceGet, "cuDeviceGet"),
    SYM(DeviceGetName, "cuDeviceGetName"),
    SYM(DeviceTotalMem, "cuDeviceTotalMem_v2"),
    SYM(DeviceGetAttribute, "cuDeviceGetAttribute"),
    SYM(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    SYM(PrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
    SYM(CtxSetCurrent, "cuCtxSetCurrent"),
    SYM(CtxPushCurrent, "cuCtxPushCurrent_v2"),
    SYM(CtxPopCurrent, "cuCtxPopCurrent_v2"),
    SYM(MemAlloc, "cuMemAlloc_v2"),
    SYM(MemFree, "cuMemFree_v2"),
    SYM(MemGetInfo, "cuMemGetInfo_v2"),
    SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
    SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
    SYM(MemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"),
    SYM(MemsetD8Async, "cuMemsetD8Async"),
    SYM(StreamCreate, "cuStreamCreate"),
    SYM(StreamSynchronize, "cuStreamSynchronize"),
    SYM(StreamDestroy, "cuStreamDestroy_v2"),
    SYM(MemcpyAsync, "cuMemcpyAsync"),
    SYM(MemHostAlloc, "cuMemHostAlloc"),
    SYM(MemFreeHost, "cuMemFreeHost"),
    SYM(EventCreate, "cuEventCreate"),
    SYM(EventRecord, "cuEventRecord"),
    SYM(EventSynchronize, "cuEventSynchronize"),
    SYM(EventQuery, "cuEventQuery"),
    SYM(EventDestroy, "cuEventDestroy_v2"),
    SYM(EventElapsedTime, "cuEventElapsedTime"),
    SYM(StreamWaitEvent, "cuStreamWaitEvent"),
    SYM(ModuleLoadData, "cuModuleLoadData"),
    SYM(ModuleGetFunction, "cuModuleGetFunction"),
    SYM(ModuleUnload, "cuModuleUnload"),
    SYM(LaunchKernel, "cuLaunchKernel"),
    SYM(MemAddressReserve, "cuMemAddressReserve"),
    SYM(MemAddressFree, "cuMemAddressFree"),
    SYM(MemCreate, "cuMemCreate"),
    SYM(MemRelease, "cuMemRelease"),
    SYM(MemMap, "cuMemMap"),
    SYM(MemUnmap, "cuMemUnmap"),
    SYM(MemSetAccess, "cuMemSetAccess"),
    SYM(MemGetAllocationGranularity, "cuMemGetAllocationGranularity"),
    SYM(GetErrorName, "cuGetErrorName"),
    SYM(GetErrorString, "cuGetErrorString"),
#undef SYM
};

/* Opens the driver and looks up every entry point. On failure the library is
 * closed again and `why` says what was missing. The driver is never
 * unloaded (RTLD_NODELETE): once initialised it keeps threads and exit
 * handlers that must outlive any one context. */
static int cuda_api_load(cuda_api *api, const char *path, char *why, size_t cap)
{
    memset(api, 0, sizeof *api);
    dlerror();
    api->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (!api->lib) {
        const char *e = dlerror();
        snprintf(why, cap, "CUDA driver not found: cannot load \"%s\" (%s)", path,
                 e ? e : "no reason given");
        return -1;
    }
    for (size_t i = 0; i < sizeof cuda_syms / sizeof cuda_syms[0]; i++) {
        void *fn = dlsym(api->lib, cuda_syms[i].name);
        if (!fn) {
            snprintf(why, cap,
                     "CUDA driver \"%s\" has no entry point %s (not a CUDA driver, or one "
                     "older than CUDA 10.2)",
                     path, cuda_syms[i].name);
            dlclose(api->lib);
            api->lib = NULL;
            return -1;
        }
        /* POSIX lets a dlsym result be used as a function pointer; copy the
         * bytes so no object-to-function pointer cast is needed. */
        memcpy((char *)api + cuda_syms[i].off, &fn, sizeof fn);
    }
    void *fn = dlsym(api->lib, "cuFuncLoad");
    memcpy(&api->FuncLoad, &fn, sizeof fn);
    return 0;
}

static void cuda_api_unload(cuda_api *api)
{
    if (api->lib) dlclose(api->lib);
    api->lib = NULL;
}

/* Names of the result codes the library meets most, for drivers whose
 * cuGetErrorName cannot answer (the stub library answers nothing). */
static const char *cuda_known_name(CUresult r)
{
    switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_DEINITIALIZED: return "CUDA_ERROR_DEINITIALIZED";
    case CUDA_ERROR_STUB_LIBRARY: return "CUDA_ERROR_STUB_LIBRARY";
    case CUDA_ERROR_DEVICE_UNAVAILABLE: return "CUDA_ERROR_DEVICE_UNAVAILABLE";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_NO_BINARY_FOR_GPU: return "CUDA_ERROR_NO_BINARY_FOR_GPU";
    case CUDA_ERROR_INVALID_PTX: return "CUDA_ERROR_INVALID_PTX";
    case CUDA_ERROR_JIT_COMPILER_NOT_FOUND: return "CUDA_ERROR_JIT_COMPILER_NOT_FOUND";
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: return "CUDA_ERROR_UNSUPPORTED_PTX_VERSION";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES";
    case CUDA_ERROR_LAUNCH_TIMEOUT: return "CUDA_ERROR_LAUNCH_TIMEOUT";
    case CUDA_ERROR_ILLEGAL_INSTRUCTION: return "CUDA_ERROR_ILLEGAL_INSTRUCTION";
    case CUDA_ERROR_MISALIGNED_ADDRESS: return "CUDA_ERROR_MISALIGNED_ADDRESS";
    case CUDA_ERROR_LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_SYSTEM_NOT_READY: return "CUDA_ERROR_SYSTEM_NOT_READY";
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
        return "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    }
    return NULL;
}

/* What to do about a failing cuInit, for the codes that have a usual cause. */
static const char *cuda_init_hint(CUresult r)
{
    switch (r) {
    case CUDA_ERROR_STUB_LIBRARY:
        return "; this is the CUDA toolkit's link-time stub, not a driver: is the NVIDIA driver "
               "installed?";
    case CUDA_ERROR_NO_DEVICE: return "; the driver sees no GPU (is CUDA_VISIBLE_DEVICES empty?)";
    case CUDA_ERROR_SYSTEM_NOT_READY:
        return "; the system is not ready for CUDA (on NVSwitch systems: is nvidia-fabricmanager "
               "running?)";
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
        return "; the CUDA driver library and the loaded NVIDIA kernel module are different "
               "versions: after a driver update, reboot (or reload the nvidia module); or a "
               "CUDA forward-compatibility libcuda on the library path does not match this "
               "driver: take it off LD_LIBRARY_PATH";
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
        return "; a CUDA forward-compatibility libcuda (the cuda-compat package) was loaded, and "
               "this GPU does not support forward compatibility: take it off LD_LIBRARY_PATH so "
               "the driver's own libcuda is used";
    }
    return "";
}

/* "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" into buf. */
static const char *cuda_describe(const cuda_api *api, CUresult r, char *buf, size_t cap)
{
    const char *name = NULL, *text = NULL;
    if (api->GetErrorName && api->GetErrorName(r, &name) != CUDA_SUCCESS) name = NULL;
    if (api->GetErrorString && api->GetErrorString(r, &text) != CUDA_SUCCESS) text = NULL;
    if (!name) name = cuda_known_name(r);
    if (name && text) snprintf(buf, cap, "%s (%s)", name, text);
    else if (name) snprintf(buf, cap, "%s", name);
    else snprintf(buf, cap, "CUresult %d", (int)r);
    return buf;
}

/* ---- the device ---- */

/* A reservation over-allocated to meet an alignment above cuMemAlloc's:
 * the address handed out and the one to free. */
typedef struct cuda_aligned {
    CUdeviceptr user, raw;
} cuda_aligned;

/* An address range from va_reserve; one slot per granule. */
typedef struct cuda_range {
    CUdeviceptr base;
    size_t bytes;
    CUmemGenericAllocationHandle *handle; /* physical memory mapped at the granule */
    unsigned char *mapped;                /* 1 where handle[i] is mapped; 2 where it is
                                             decommitted but kept mapped (may_release) */
} cuda_range;

typedef struct cuda_dev {
    cuda_api api;
    char path[256];      /* the driver, for messages */
    int driver_version;  /* 1000 * major + 10 * minor */
    CUdevice dev;
    CUcontext pctx;      /* the primary context, retained */
    CUstream stream;
    CUstream side;       /* the second stream (mti_cuda_copy_async), made at first use */
    int cc_major, cc_minor;
    int vmm;             /* the device offers cuMemCreate/cuMemMap */
    int debug_sync;      /* wait for every launch (mti_cuda_debug_sync) */
    CUmemAllocationProp prop; /* pinned memory on this device, for cuMemCreate */

    CUmodule module;     /* the built-in kernels, or NULL */
    CUfunction kernels[MTI_CUDA_KERNEL_COUNT];
    char kernel_err[512]; /* why the built-in kernels are missing */

    void *ops_state;     /* the op table's state for this device (mti_cuda_attach) */
    void (*ops_state_free)(mti_device *d, void *state);

    pthread_mutex_t mu;  /* guards the two tables below */
    cuda_aligned *aligned;
    size_t n_aligned, cap_aligned;
    cuda_range *ranges;
    size_t n_ranges, cap_ranges;
} cuda_dev;

static inline CUdeviceptr dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }
static inline void *hptr(CUdeviceptr p) { return (void *)(uintptr_t)p; }

/* Records "what failed: NAME (text)" on the context and returns s. */
static mt_status cuda_fail(mti_device *d, mt_status s, CUresult r, const char *fmt, ...)
    MTI_PRINTF(4, 5);
static mt_status cuda_fail(mti_device *d, mt_status s, CUresult r, const char *fmt, ...)
{
    cuda_dev *c = d->impl;
    char what[512], desc[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return mti_fail(d->ctx, s, "%s failed: %s", what, cuda_describe(&c->api, r, desc, sizeof desc));
}

/* Out of memory from a call that takes memory is MT_ERR_OOM; anything else
 * the driver says is a device error. */
static mt_status cuda_mem_status(CUresult r)
{
    return r == CUDA_ERROR_OUT_OF_MEMORY ? MT_ERR_OOM : MT_ERR_DEVICE;
}

/* Makes the device's primary context current on this thread until
 * cuda_leave, keeping whatever the thread had current underneath. */
static mt_status cuda_enter(mti_device *d)
{
    cuda_dev *c = d->impl;
    CUresult r = c->api.CtxPushCurrent(c->pctx);
    if (r != CUDA_SUCCESS) return cuda_fail(d, MT_ERR_DEVICE, r, "cuCtxPushCurrent_v2");
    return MT_OK;
}

static void cuda_leave(mti_device *d)
{
    cuda_dev *c = d->impl;
    CUcontext prev;
    c->api.CtxPopCurrent(&prev);
}

/* Waits for the streams (the main one, then the second), logging a
 * failure (for the void paths that must not free memory still in use by
 * queued work). */
static CUresult cuda_drain(mti_device *d)
{
    cuda_dev *c = d->impl;
    CUresult r = c->api.StreamSynchronize(c->stream);
    if (r == CUDA_SUCCESS && c->side) r = c->api.StreamSynchronize(c->side);
    if (r != CUDA_SUCCESS) {
        char desc[256];
        mti_log(d->ctx, MT_LOG_ERROR, "cuStreamSynchronize failed: %s",
                cuda_describe(&c->api, r, desc, sizeof desc));
    }
    return r;
}

/* Whether memory may go back to the driver now: the release guard (the
 * communication layer's: NCCL work on streams of its own) waited for the
 * work that may still use it, or there is none. cuMemFree and cuMemUnmap
 * wait for the whole device, so under work that never ends (a collective
 * whose peer stalled) they would block for good; and a release the driver
 * made at once would hand the memory out again under that work. A guard
 * that says no holds every later release too (the work is still running);
 * `what` and the bytes go in the log. */
static bool may_release(mti_device *d, const char *what, const void *p, size_t bytes)
{
    if (!d->release_held && d->release_guard && !d->release_guard(d->release_guard_arg))
        d->release_held = true;
    char size[48] = "";
    if (bytes) snprintf(size, sizeof size, " of %zu bytes", bytes);
    if (d->release_held && p)
        mti_log(d->ctx, MT_LOG_ERROR,
                "CUDA %s%s at %p: not given back to the driver (work on a communication "
                "stream that did not end may still use it; kept until the process ends)",
                what, size, p);
    else if (d->release_held)
        mti_log(d->ctx, MT_LOG_ERROR,
                "CUDA %s: the device memory still held is not given back to the driver (work "
                "on a communication stream that did not end may still use it; kept until the "
                "process ends)", what);
    return !d->release_held;
}

/* ---- plain reservations (cuMemAlloc) ---- */

static int aligned_add(cuda_dev *c, CUdeviceptr user, CUdeviceptr raw)
{
    if (c->n_aligned == c->cap_aligned) {
        size_t cap = c->cap_aligned ? 2 * c->cap_aligned : 16;
        cuda_aligned *t = realloc(c->aligned, cap * sizeof *t);
        if (!t) return -1;
        c->aligned = t;
        c->cap_aligned = cap;
    }
    c->aligned[c->n_aligned++] = (cuda_aligned){user, raw};
    return 0;
}

/* The address to free for a reservation handed out at user. */
static CUdeviceptr aligned_take(cuda_dev *c, CUdeviceptr user)
{
    for (size_t i = 0; i < c->n_aligned; i++) {
        if (c->aligned[i].user == user) {
            CUdeviceptr raw = c->aligned[i].raw;
            c->aligned[i] = c->aligned[--c->n_aligned];
            return raw;
        }
    }
    return user;
}

static mt_status cuda_reserve(mti_device *d, size_t bytes, size_t alignment, void **ptr,
                              size_t *granted)
{
    cuda_dev *c = d->impl;
    if (alignment < d->min_alignment) alignment = d->min_alignment;
    if (bytes == 0 || bytes > MT_MAX_REQUEST || !mti_is_pow2(alignment) ||
        alignment > MT_MAX_ALIGNMENT)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                        "CUDA reserve: bad size %zu or alignment %zu", bytes, alignment);
    mt_status st = cuda_enter(d);
    if (st != MT_OK) return st;
    CUdeviceptr p = 0;
    CUresult r = c->api.MemAlloc(&p, bytes);
    if (r != CUDA_SUCCESS) {
        st = cuda_fail(d, cuda_mem_status(r), r, "cuMemAlloc_v2 of %zu bytes", bytes);
        goto out;
    }
    if (p % alignment == 0) {
        /* the usual case: the driver aligns large blocks to 2 MiB */
        *ptr = hptr(p);
        *granted = bytes;
        goto out;
    }
    /* Over-allocate by the alignment less what cuMemAlloc guarantees and
     * hand out the aligned address inside; the table remembers what to free. */
    if (may_release(d, "reserve (a misaligned block)", hptr(p), bytes)) c->api.MemFree(p);
    size_t over = bytes + alignment - CUDA_MIN_ALIGN;
    r = c->api.MemAlloc(&p, over);
    if (r != CUDA_SUCCESS) {
        st = cuda_fail(d, cuda_mem_status(r), r,
                       "cuMemAlloc_v2 of %zu bytes (%zu aligned to %zu)", over, bytes, alignment);
        goto out;
    }
    CUdeviceptr user = (p + alignment - 1) & ~(CUdeviceptr)(alignment - 1);
    if (user != p) {
        pthread_mutex_lock(&c->mu);
        int e = aligned_add(c, user, p);
        pthread_mutex_unlock(&c->mu);
        if (e != 0) {
            if (may_release(d, "reserve", hptr(p), over)) c->api.MemFree(p);
            st = mti_fail(d->ctx, MT_ERR_OOM, "CUDA reserve: out of host memory for bookkeeping");
            goto out;
        }
    }
    *ptr = hptr(user);
    /* the bytes asked for, not what the address happened to leave usable:
     * the accounting (and so an estimate) does not depend on where the
     * driver put the block; the slack is the driver's, like its rounding */
    *granted = bytes;
out:
    cuda_leave(d);
    return st;
}

static void cuda_release(mti_device *d, void *ptr, size_t granted)
{
    cuda_dev *c = d->impl;
    if (!ptr || !may_release(d, "release", ptr, granted)) return;
    pthread_mutex_lock(&c->mu);
    CUdeviceptr raw = aligned_take(c, dptr(ptr));
    pthread_mutex_unlock(&c->mu);
    if (cuda_enter(d) != MT_OK) return;
    cuda_drain(d); /* queued work may still use the block */
    CUresult r = c->api.MemFree(raw);
    if (r != CUDA_SUCCESS) {
        char desc[256];
        mti_log(d->ctx, MT_LOG_ERROR, "cuMemFree_v2 of %p failed: %s", ptr,
                cuda_describe(&c->api, r, desc, sizeof desc));
    }
    cuda_leave(d);
}

/* ---- growable ranges (virtual memory management) ---- */

/* The range holding [addr, addr + bytes), or NULL. Called with mu held. */
static cuda_range *range_find(cuda_dev *c, CUdeviceptr addr, size_t bytes)
{
    for (size_t i = 0; i < c->n_ranges; i++) {
        cuda_range *g = &c->ranges[i];
        if (addr >= g->base && addr - g->base <= g->bytes && bytes <= g->bytes - (addr - g->base))
            return g;
    }
    return NULL;
}

/* Unmaps and frees granules [first, first + n) of g where mapped. Called
 * with mu held and the context current. Returns the first failure. */
static CUresult range_unmap(mti_device *d, cuda_range *g, size_t first, size_t n)
{
    cuda_dev *c = d->impl;
    CUresult bad = CUDA_SUCCESS;
    for (size_t i = first; i < first + n; i++) {
        if (!g->mapped[i]) continue;
        if (d->release_held) { /* (kept mapped: may_release) */
            g->mapped[i] = 2;
            continue;
        }
        CUdeviceptr a = g->base + (CUdeviceptr)i * d->granularity;
        CUresult r = c->api.MemUnmap(a, d->granularity);
        if (r == CUDA_SUCCESS) r = c->api.MemRelease(g->handle[i]);
        if (r != CUDA_SUCCESS && bad == CUDA_SUCCESS) bad = r;
        g->mapped[i] = 0;
        g->handle[i] = 0;
    }
    return bad;
}

static mt_status cuda_va_reserve(mti_device *d, size_t bytes, void **base)
{
    cuda_dev *c = d->impl;
    if (bytes == 0 || bytes % d->granularity || bytes > MT_MAX_REQUEST)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                        "CUDA va_reserve: size %zu is not a positive multiple of %zu", bytes,
                        d->granularity);
    size_t n = bytes / d->granularity;
    cuda_range g = {0, bytes, calloc(n, sizeof *g.handle), calloc(n, 1)};
    if (!g.handle || !g.mapped) {
        free(g.handle);
        free(g.mapped);
        return mti_fail(d->ctx, MT_ERR_OOM, "CUDA va_reserve: out of host memory for a table "
                                            "of %zu granules", n);
    }
    mt_status st = cuda_enter(d);
    if (st != MT_OK) goto fail;
    CUresult r = c->api.MemAddressReserve(&g.base, bytes, d->granularity, 0, 0);
    cuda_leave(d);
    if (r != CUDA_SUCCESS) {
        st = cuda_fail(d, cuda_mem_status(r), r, "cuMemAddressReserve of %zu bytes", bytes);
        goto fail;
    }
    pthread_mutex_lock(&c->mu);
    if (c->n_ranges == c->cap_ranges) {
        size_t cap = c->cap_ranges ? 2 * c->cap_ranges : 8;
        cuda_range *t = realloc(c->ranges, cap * sizeof *t);
        if (!t) {
            pthread_mutex_unlock(&c->mu);
            if (cuda_enter(d) == MT_OK) {
                c->api.MemAddressFree(g.base, bytes);
                cuda_leave(d);
            }
            st = mti_fail(d->ctx, MT_ERR_OOM, "CUDA va_reserve: out of host memory");
            goto fail;
        }
        c->ranges = t;
        c->cap_ranges = cap;
    }
    c->ranges[c->n_ranges++] = g;
    pthread_mutex_unlock(&c->mu);
    *base = hptr(g.base);
    return MT_OK;
fail:
    free(g.handle);
    free(g.mapped);
    return st;
}

static mt_status cuda_va_commit(mti_device *d, void *addr, size_t bytes)
{
    cuda_dev *c = d->impl;
    const size_t gran = d->granularity;
    CUdeviceptr a = dptr(addr);
    if (bytes == 0 || bytes % gran || a % gran)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                        "CUDA va_commit: address %p or size %zu is not a multiple of %zu", addr,
                        bytes, gran);
    pthread_mutex_lock(&c->mu);
    cuda_range *g = range_find(c, a, bytes);
    mt_status st = MT_OK;
    if (!g) {
        st = mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                      "CUDA va_commit: [%p, +%zu) is not inside a reserved range", addr, bytes);
        goto out;
    }
    size_t first = (size_t)(a - g->base) / gran, n = bytes / gran;
    for (size_t i = first; i < first + n; i++) {
        if (g->mapped[i] == 1) {
            st = mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                          "CUDA va_commit: granule at %p is already committed",
                          hptr(g->base + (CUdeviceptr)i * gran));
            goto out;
        }
    }
    st = cuda_enter(d);
    if (st != MT_OK) goto out;
    for (size_t i = first; i < first + n; i++) {
        CUdeviceptr at = g->base + (CUdeviceptr)i * gran;
        if (g->mapped[i] == 2) { /* kept mapped when decommitted: in use again */
            g->mapped[i] = 3;
            continue;
        }
        CUmemGenericAllocationHandle h = 0;
        CUresult r = c->api.MemCreate(&h, gran, &c->prop, 0);
        if (r != CUDA_SUCCESS) {
            st = cuda_fail(d, cuda_mem_status(r), r,
                           "cuMemCreate of %zu bytes (committing %zu bytes at %p)", gran, bytes,
                           addr);
            break;
        }
        r = c->api.MemMap(at, gran, 0, h, 0);
        if (r != CUDA_SUCCESS) {
            c->api.MemRelease(h);
            st = cuda_fail(d, cuda_mem_status(r), r, "cuMemMap of %zu bytes at %p", gran,
                           hptr(at));
            break;
        }
        g->handle[i] = h;
        g->mapped[i] = 1;
    }
    if (st == MT_OK) {
        /* one access call for the whole span: it may cover many mappings */
        CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, c->dev},
                               CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        CUresult r = c->api.MemSetAccess(a, bytes, &acc, 1);
        if (r != CUDA_SUCCESS)
            st = cuda_fail(d, cuda_mem_status(r), r, "cuMemSetAccess of %zu bytes at %p", bytes,
                           addr);
    }
    for (size_t i = first; i < first + n; i++) /* (3: kept, reused by this call) */
        if (g->mapped[i] == 3) g->mapped[i] = st == MT_OK ? 1 : 2;
    if (st != MT_OK) range_unmap(d, g, first, n); /* nothing of this call stays */
    cuda_leave(d);
out:
    pthread_mutex_unlock(&c->mu);
    return st;
}

static void cuda_va_decommit(mti_device *d, void *addr, size_t bytes)
{
    cuda_dev *c = d->impl;
    const size_t gran = d->granularity;
    CUdeviceptr a = dptr(addr);
    if (bytes == 0) return;
    const bool may = may_release(d, "va_decommit", addr, bytes);
    pthread_mutex_lock(&c->mu);
    cuda_range *g = range_find(c, a, bytes);
    if (!g || a % gran || bytes % gran) {
        mti_log(d->ctx, MT_LOG_ERROR, "CUDA va_decommit: [%p, +%zu) is not granule-aligned "
                "inside a reserved range; nothing done", addr, bytes);
        goto out;
    }
    if (!may) { /* kept mapped, free for the next commit */
        for (size_t i = (size_t)(a - g->base) / gran; i < (size_t)(a - g->base + bytes) / gran; i++)
            if (g->mapped[i]) g->mapped[i] = 2;
        goto out;
    }
    if (cuda_enter(d) != MT_OK) goto out;
    cuda_drain(d); /* queued work may still use the memory */
    CUresult r = range_unmap(d, g, (size_t)(a - g->base) / gran, bytes / gran);
    if (r != CUDA_SUCCESS) {
        char desc[256];
        mti_log(d->ctx, MT_LOG_ERROR, "CUDA va_decommit of %zu bytes at %p: %s", bytes, addr,
                cuda_describe(&c->api, r, desc, sizeof desc));
    }
    cuda_leave(d);
out:
    pthread_mutex_unlock(&c->mu);
}

/* Unmaps what is still committed in the range, frees its addresses and
 * drops it from the table. Called with mu held. */
static void range_free(mti_device *d, size_t idx)
{
    cuda_dev *c = d->impl;
    cuda_range *g = &c->ranges[idx];
    if (!d->release_held && cuda_enter(d) == MT_OK) { /* (held: the range stays, unknown) */
        cuda_drain(d);
        range_unmap(d, g, 0, g->bytes / d->granularity);
        CUresult r = c->api.MemAddressFree(g->base, g->bytes);
        if (r != CUDA_SUCCESS) {
            char desc[256];
            mti_log(d->ctx, MT_LOG_ERROR, "cuMemAddressFree of %zu bytes at %p failed: %s",
                    g->bytes, hptr(g->base), cuda_describe(&c->api, r, desc, sizeof desc));
        }
        cuda_leave(d);
    }
    free(g->handle);
    free(g->mapped);
    c->ranges[idx] = c->ranges[--c->n_ranges];
}

static void cuda_va_release(mti_device *d, void *base, size_t bytes)
{
    cuda_dev *c = d->impl;
    may_release(d, "va_release", base, bytes); /* (range_free keeps it when not) */
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_ranges; i++) {
        if (c->ranges[i].base == dptr(base)) {
            if (c->ranges[i].bytes != bytes)
                mti_log(d->ctx, MT_LOG_WARN, "CUDA va_release of %p: %zu bytes given, %zu "
                        "reserved; releasing the whole range", base, bytes, c->ranges[i].bytes);
            range_free(d, i);
            pthread_mutex_unlock(&c->mu);
            return;
        }
    }
    pthread_mutex_unlock(&c->mu);
    mti_log(d->ctx, MT_LOG_ERROR, "CUDA va_release: %p is not a reserved range", base);
}

/* ---- copies, memset, sync, info ---- */

/* Host to device. Waits for the copy: the source is the caller's and may be
 * reused or freed as soon as this returns, even when it is pinned memory
 * the driver would otherwise read later. */
static mt_status cuda_copy_h2d(mti_device *d, void *dst, const void *src, size_t bytes)
{
    cuda_dev *c = d->impl;
    if (!bytes) return MT_OK;
    mt_status st = cuda_enter(d);
    if (st != MT_OK) return st;
    CUresult r = c->api.MemcpyHtoDAsync(dptr(dst), src, bytes, c->stream);
    if (r != CUDA_SUCCESS)
        st = cuda_fail(d, MT_ERR_DEVICE, r, "cuMemcpyHtoDAsync_v2 of %zu bytes to %p", bytes, dst);
    else if ((r = c->api.StreamSynchronize(c->stream)) != CUDA_SUCCESS)
        st = cuda_fail(d, MT_ERR_DEVICE, r, "cuStreamSynchronize after a copy to the device");
    cuda_leave(d);
    return st;
}

/* Device to host. Waits for the copy, so dst can be read on return. */
static mt_status cuda_copy_d2h(mti_device *d, void *dst, const void *src, size_t bytes)
{
    cuda_dev *c = d->impl;
    if (!bytes) return MT_OK;
    mt_status st = cuda_enter(d);
    if (st != MT_OK) return st;
    CUresult r = c->api.MemcpyDtoHAsync(dst, dptr(src), bytes, c->stream);
    if (r != CUDA_SUCCESS)
        st = cuda_fail(d, MT_ERR_DEVICE, r, "cuMemcpyDtoHAsync_v2 of %zu bytes from %p", bytes,
                       src);
    else if ((r = c->api.StreamSynchronize(c->stream)) != CUDA_SUCCESS)
        st = cuda_fail(d, MT_ERR_DEVICE, r, "cuStreamSynchronize after a copy from the device");
    cuda_leave(d);
    return st;
}

/* Device to device: queued, ordered with the kernels on the stream. */
static mt_status cuda_copy_d2d(mti_device *d, void *dst, const void *src, size_t bytes)
{
    cuda_dev *c = d->impl;
    if (!bytes) return MT_OK;
    mt_status st = cuda_enter(d);
    if (st != MT_OK) return st;
    CUresult r = c->api.MemcpyDtoDAsync(dptr(dst), dptr(src), bytes, c->stream);
    if (r != CUDA_SUCCESS)
        st = cuda_fail(d, MT_ERR_DEVICE, r, "cuMemcpyDtoDAsync_v2 of %zu bytes from %p to %p",
                       bytes, src, dst);
    cuda_leave(d);
    return st;
}

static mt_status cuda_memset8(mti_device *d, void *dst, int value, size_t bytes)
{
    cuda_dev *c = d->impl;
    if (!bytes) return MT_OK;
    mt_status st = cuda_enter(d);
    if (st != MT_OK) return st;
    CUresult r = c->api.MemsetD8Async(dptr(dst), (unsigned char)value, bytes, c->stream);
    if (r != CUDA_SUCCESS)
        st = cuda_fail(d, MT_ERR_DEVICE, r, "cuMemsetD8Async of %zu bytes at %p", bytes, dst);
    cuda_leave(d);
    return st;
}

static mt_status cuda_sync(mti_device *d)
{
    cuda_dev *c = d->impl;
    mt_status st = cuda_enter(d);
    if (st != MT_OK) return st;
    CUresult r = c->api.StreamSynchronize(c->stream);
    if (r != CUDA_SUCCESS) st = cuda_fail(d, MT_ERR_DEVICE, r, "cuStreamSynchronize");
    cuda_leave(d);
    return st;
}

static mt_status cuda_mem_info(mti_device *d, size_t *free_bytes, size_t *total_bytes)
{
    cuda_dev *c = d->impl;
    mt_status st = cuda_enter(d);
    if (st != MT_OK) return st;
    size_t fr = 0, tot = 0;
    CUresult r = c->api.MemGetInfo(&fr, &tot);
    cuda_leave(d);
    if (r != CUDA_SUCCESS) return cuda_fail(d, MT_ERR_DEVICE, r, "cuMemGetInfo_v2");
    if (free_bytes) *free_bytes = fr;
    if (total_bytes) *total_bytes = tot;
    return MT_OK;
}

/* ---- open and close ---- */

static void cuda_destroy(mti_device *d)
{
    if (!d) return;
    cuda_dev *c = d->impl;
    if (c) {
        if (c->pctx && cuda_enter(d) == MT_OK) {
            if (c->stream) cuda_drain(d);
            /* the op table's state may hold library handles that want the
             * context, the stream and their memory still there */
            if (c->ops_state && c->ops_state_free) c->ops_state_free(d, c->ops_state);
            c->ops_state = NULL;
            /* memory the allocators did not give back: the ranges here; plain
             * reservations go with the primary context when its last user
             * releases it */
            if (c->n_ranges || c->n_aligned) may_release(d, "destroy", NULL, 0);
            pthread_mutex_lock(&c->mu);
            while (c->n_ranges) range_free(d, c->n_ranges - 1);
            for (size_t i = 0; i < c->n_aligned && !d->release_held; i++)
                c->api.MemFree(c->aligned[i].raw);
            c->n_aligned = 0;
            pthread_mutex_unlock(&c->mu);
            if (c->module) c->api.ModuleUnload(c->module);
            if (c->side) c->api.StreamDestroy(c->side);
            if (c->stream) c->api.StreamDestroy(c->stream);
            cuda_leave(d);
        }
        if (c->ops_state && c->ops_state_free) c->ops_state_free(d, c->ops_state);
        /* (held: the primary context stays too; its end would wait for the work) */
        if (c->pctx && !d->release_held) c->api.PrimaryCtxRelease(c->dev);
        cuda_api_unload(&c->api);
        pthread_mutex_destroy(&c->mu);
        free(c->aligned);
        free(c->ranges);
        free(c);
    }
    free(d);
}

/* cuInit and the device count, for open and for the availability probe.
 * Failures are MT_ERR_NO_DEVICE with `why` saying which. */
static mt_status cuda_start(const cuda_api *api, const char *path, int *count, char *why,
                            size_t cap)
{
    char desc[256];
    CUresult r = api->Init(0);
    if (r != CUDA_SUCCESS) {
        snprintf(why, cap, "CUDA driver \"%s\": cuInit failed: %s%s", path,
                 cuda_describe(api, r, desc, sizeof desc), cuda_init_hint(r));
        return MT_ERR_NO_DEVICE;
    }
    *count = 0;
    r = api->DeviceGetCount(count);
    if (r != CUDA_SUCCESS) {
        snprintf(why, cap, "CUDA driver \"%s\": cuDeviceGetCount failed: %s", path,
                 cuda_describe(api, r, desc, sizeof desc));
        return MT_ERR_NO_DEVICE;
    }
    if (*count <= 0) {
        snprintf(why, cap, "CUDA driver \"%s\" reports no CUDA devices", path);
        return MT_ERR_NO_DEVICE;
    }
    return MT_OK;
}

int mti_cuda_available(const char *driver_path)
{
    const char *path = driver_path ? driver_path : CUDA_DEFAULT_DRIVER;
    cuda_api api;
    char why[1024];
    if (cuda_api_load(&api, path, why, sizeof why) != 0) return 0;
    int count = 0;
    mt_status st = cuda_start(&api, path, &count, why, sizeof why);
    cuda_api_unload(&api);
    return st == MT_OK && count > 0;
}

/* Loads the built-in kernels, every one of them onto the device now
 * (cuFuncLoad, where the driver has it), so that no launch takes device
 * memory for code in the middle of a step. Out of device memory fails the
 * open (MT_ERR_OOM); any other failure (a driver older than the toolkit
 * that built them, a GPU none of the embedded code runs on) leaves the
 * device usable for memory and copies, the reason kept for
 * mti_cuda_kernel. Called with the context current. */
static mt_status cuda_load_kernels(mti_device *d)
{
    cuda_dev *c = d->impl;
#if MT_HAVE_CUDA_KERNELS
    char desc[256];
    CUresult r = c->api.ModuleLoadData(&c->module, mti_cuda_fatbin);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        c->module = NULL;
        return cuda_fail(d, MT_ERR_OOM, r, "cuModuleLoadData of the built-in kernels (%zu bytes)",
                         mti_cuda_fatbin_size);
    }
    if (r != CUDA_SUCCESS) {
        c->module = NULL;
        snprintf(c->kernel_err, sizeof c->kernel_err,
                 "cuModuleLoadData of the built-in kernels (%zu bytes, built for sm_80/sm_90) "
                 "failed on sm_%d%d with driver %d.%d: %s",
                 mti_cuda_fatbin_size, c->cc_major, c->cc_minor, c->driver_version / 1000,
                 c->driver_version % 1000 / 10, cuda_describe(&c->api, r, desc, sizeof desc));
    } else {
        for (int k = 0; k < MTI_CUDA_KERNEL_COUNT; k++) {
            const char *name = mti_cuda_kernel_name((mti_cuda_kernel_id)k);
            const char *call = "cuModuleGetFunction";
            r = c->api.ModuleGetFunction(&c->kernels[k], c->module, name);
            if (r == CUDA_SUCCESS && c->api.FuncLoad)
                call = "cuFuncLoad", r = c->api.FuncLoad(c->kernels[k]);
            if (r == CUDA_ERROR_OUT_OF_MEMORY) {
                mt_status st = cuda_fail(d, MT_ERR_OOM, r, "%s(\"%s\") of the built-in kernels",
                                         call, name);
                c->api.ModuleUnload(c->module);
                c->module = NULL;
                memset(c->kernels, 0, sizeof c->kernels);
                return st;
            }
            if (r != CUDA_SUCCESS) {
                snprintf(c->kernel_err, sizeof c->kernel_err,
                         "%s(\"%s\") in the built-in kernels failed: %s", call, name,
                         cuda_describe(&c->api, r, desc, sizeof desc));
                c->api.ModuleUnload(c->module);
                c->module = NULL;
                memset(c->kernels, 0, sizeof c->kernels);
                break;
            }
        }
    }
    if (!c->module) mti_log(d->ctx, MT_LOG_WARN, "CUDA kernels unavailable: %s", c->kernel_err);
#else
    snprintf(c->kernel_err, sizeof c->kernel_err,
             "this build of memtrain has no CUDA kernels (nvcc was not found when it was built)");
#endif
    return MT_OK;
}

mt_status mti_device_cuda_open(mt_context *ctx, const char *driver_path, int ordinal,
                               mti_device **out)
{
    const char *path = driver_path ? driver_path : CUDA_DEFAULT_DRIVER;
    mti_device *d = calloc(1, sizeof *d);
    cuda_dev *c = calloc(1, sizeof *c);
    if (!d || !c) {
        free(d);
        free(c);
        return mti_fail(ctx, MT_ERR_OOM, "CUDA device: out of host memory");
    }
    pthread_mutex_init(&c->mu, NULL);
    d->kind = MT_DEVICE_CUDA;
    d->ordinal = ordinal;
    d->ctx = ctx;
    d->impl = c;
    d->destroy = cuda_destroy;
    snprintf(c->path, sizeof c->path, "%s", path);
    const char *dbg = getenv("MT_CUDA_DEBUG_SYNC");
    c->debug_sync = ctx->cfg.cuda_debug_sync || (dbg && *dbg && strcmp(dbg, "0") != 0);

    char why[1024], desc[256];
    int count = 0;
    mt_status st;
    if (cuda_api_load(&c->api, path, why, sizeof why) != 0 ||
        (st = cuda_start(&c->api, path, &count, why, sizeof why)) != MT_OK) {
        cuda_destroy(d);
        return mti_fail(ctx, MT_ERR_NO_DEVICE, "%s", why);
    }
    if (ordinal < 0 || ordinal >= count) {
        cuda_destroy(d);
        return mti_fail(ctx, MT_ERR_NO_DEVICE,
                        "CUDA device ordinal %d is out of range: driver \"%s\" has %d device%s "
                        "(0..%d)", ordinal, path, count, count == 1 ? "" : "s", count - 1);
    }

    const cuda_api *api = &c->api;
    CUresult r;
#define CU_TRY(call, ...)                                                                      \
    do {                                                                                       \
        if ((r = (call)) != CUDA_SUCCESS) {                                                    \
            st = cuda_fail(d, MT_ERR_DEVICE, r, __VA_ARGS__);                                  \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

    CU_TRY(api->DriverGetVersion(&c->driver_version), "cuDriverGetVersion");
    CU_TRY(api->DeviceGet(&c->dev, ordinal), "cuDeviceGet(%d)", ordinal);
    CU_TRY(api->DeviceGetName(d->name, (int)sizeof d->name - 1, c->dev), "cuDeviceGetName");
    d->name[sizeof d->name - 1] = 0;
    size_t total = 0;
    CU_TRY(api->DeviceTotalMem(&total, c->dev), "cuDeviceTotalMem_v2");
    d->total_bytes = total;
    CU_TRY(api->DeviceGetAttribute(&c->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                   c->dev), "cuDeviceGetAttribute(compute capability)");
    CU_TRY(api->DeviceGetAttribute(&c->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                   c->dev), "cuDeviceGetAttribute(compute capability)");
    /* an old driver may not know the attribute: then no growable ranges */
    if (api->DeviceGetAttribute(&c->vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                c->dev) != CUDA_SUCCESS)
        c->vmm = 0;
    CU_TRY(api->PrimaryCtxRetain(&c->pctx, c->dev), "cuDevicePrimaryCtxRetain(device %d)",
           ordinal);
    if ((st = cuda_enter(d)) != MT_OK) goto fail;
    r = api->StreamCreate(&c->stream, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) {
        c->stream = NULL;
        st = cuda_fail(d, MT_ERR_DEVICE, r, "cuStreamCreate");
        cuda_leave(d);
        goto fail;
    }
    d->min_alignment = CUDA_MIN_ALIGN;
    d->granularity = CUDA_FALLBACK_GRAN;
    if (c->vmm) {
        c->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        c->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
        c->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        c->prop.location.id = c->dev;
        size_t g = 0;
        r = api->MemGetAllocationGranularity(&g, &c->prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        if (r != CUDA_SUCCESS || !mti_is_pow2(g)) {
            mti_log(ctx, MT_LOG_WARN, "CUDA device %d: no usable VMM granularity (%s, %zu "
                    "bytes); growable ranges disabled", ordinal,
                    cuda_describe(api, r, desc, sizeof desc), g);
            c->vmm = 0;
        } else {
            d->granularity = g < CUDA_MIN_ALIGN ? CUDA_MIN_ALIGN : g;
        }
    }
    if ((st = cuda_load_kernels(d)) != MT_OK) {
        cuda_leave(d);
        goto fail;
    }
    cuda_leave(d);
#undef CU_TRY

    d->mem_reserve = cuda_reserve;
    d->mem_release = cuda_release;
    if (c->vmm) {
        d->va_reserve = cuda_va_reserve;
        d->va_commit = cuda_va_commit;
        d->va_decommit = cuda_va_decommit;
        d->va_release = cuda_va_release;
    }
    d->copy_h2d = cuda_copy_h2d;
    d->copy_d2h = cuda_copy_d2h;
    d->copy_d2d = cuda_copy_d2d;
    d->memset8 = cuda_memset8;
    d->sync = cuda_sync;
    d->mem_info = cuda_mem_info;
    mti_log(ctx, MT_LOG_INFO,
            "CUDA device %d: %s, sm_%d%d, %zu MiB, driver %d.%d (\"%s\"), VMM %s (granularity "
            "%zu bytes), kernels %s", ordinal, d->name, c->cc_major, c->cc_minor,
            d->total_bytes >> 20, c->driver_version / 1000, c->driver_version % 1000 / 10, path,
            c->vmm ? "on" : "off", d->granularity, c->module ? "loaded" : "missing");
    *out = d;
    return MT_OK;
fail:
    cuda_destroy(d);
    return st;
}

/* ---- kernel issue (cuda_device.h) ---- */

static const char *const kernel_names[MTI_CUDA_KERNEL_COUNT] = {
#define KERNEL_NAME(id, name) [id] = name,
    MTI_CUDA_KERNELS(KERNEL_NAME)
#undef KERNEL_NAME
};

const char *mti_cuda_kernel_name(mti_cuda_kernel_id k)
{
    return (unsigned)k < MTI_CUDA_KERNEL_COUNT ? kernel_names[k] : NULL;
}

/* A device this file opened: kind CUDA alone is not enough, since the dry
 * devices of estimates (lib/engine/estimate.c) are CUDA-kind with another impl. */
static int is_ours(const mti_device *d)
{
    return d && d->kind == MT_DEVICE_CUDA && d->impl && d->destroy == cuda_destroy;
}

static mt_status need_cuda(mti_device *d, const char *fn)
{
    if (!d) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: no device", fn);
    if (!is_ours(d))
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG, "%s: not a CUDA device", fn);
    return MT_OK;
}

int mti_cuda_has_kernels(const mti_device *d)
{
    return is_ours(d) && ((const cuda_dev *)d->impl)->module;
}

mt_status mti_cuda_compute_capability(mti_device *d, int *major, int *minor)
{
    mt_status st = need_cuda(d, "mti_cuda_compute_capability");
    if (st != MT_OK) return st;
    const cuda_dev *c = d->impl;
    if (major) *major = c->cc_major;
    if (minor) *minor = c->cc_minor;
    return MT_OK;
}

mt_status mti_cuda_kernel(mti_device *d, mti_cuda_kernel_id k, mti_cuda_fn **out)
{
    mt_status st = need_cuda(d, "mti_cuda_kernel");
    if (st != MT_OK) return st;
    cuda_dev *c = d->impl;
    if ((unsigned)k >= MTI_CUDA_KERNEL_COUNT)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG, "mti_cuda_kernel: no kernel %d", (int)k);
    if (!c->module)
        return mti_fail(d->ctx, MT_ERR_UNSUPPORTED, "CUDA kernel %s unavailable: %s",
                        kernel_names[k], c->kernel_err);
    *out = (mti_cuda_fn *)c->kernels[k];
    return MT_OK;
}

int mti_cuda_debug_sync(const mti_device *d)
{
    return is_ours(d) && ((const cuda_dev *)d->impl)->debug_sync;
}

void *mti_cuda_stream(mti_device *d)
{
    if (!is_ours(d)) return NULL;
    return ((cuda_dev *)d->impl)->stream;
}

mt_status mti_cuda_enter(mti_device *d)
{
    mt_status st = need_cuda(d, "mti_cuda_enter");
    return st != MT_OK ? st : cuda_enter(d);
}

void mti_cuda_leave(mti_device *d)
{
    if (is_ours(d)) cuda_leave(d);
}

int mti_cuda_is_system_driver(mti_device *d)
{
    if (!is_ours(d)) return 0;
    cuda_dev *c = d->impl;
    void *sys = dlopen(CUDA_DEFAULT_DRIVER, RTLD_NOW | RTLD_NOLOAD);
    int same = sys && sys == c->api.lib;
    if (sys) dlclose(sys);
    return same;
}

void *mti_cuda_attach(mti_device *d, void *state, void (*free_fn)(mti_device *d, void *state))
{
    if (!is_ours(d)) return NULL;
    cuda_dev *c = d->impl;
    pthread_mutex_lock(&c->mu);
    if (!c->ops_state) {
        c->ops_state = state;
        c->ops_state_free = free_fn;
    }
    void *now = c->ops_state;
    pthread_mutex_unlock(&c->mu);
    return now;
}

void *mti_cuda_attached(mti_device *d)
{
    if (!is_ours(d)) return NULL;
    cuda_dev *c = d->impl;
    pthread_mutex_lock(&c->mu);
    void *now = c->ops_state;
    pthread_mutex_unlock(&c->mu);
    return now;
}

mt_status mti_cuda_module_load(mti_device *d, const void *image, mti_cuda_module **out)
{
    mt_status st = need_cuda(d, "mti_cuda_module_load");
    if (st != MT_OK) return st;
    cuda_dev *c = d->impl;
    if (!image || !out)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG, "mti_cuda_module_load: NULL image or out");
    if ((st = cuda_enter(d)) != MT_OK) return st;
    CUmodule m = NULL;
    CUresult r = c->api.ModuleLoadData(&m, image);
    cuda_leave(d);
    if (r != CUDA_SUCCESS) return cuda_fail(d, MT_ERR_DEVICE, r, "cuModuleLoadData");
    *out = (mti_cuda_module *)m;
    return MT_OK;
}

void mti_cuda_module_unload(mti_device *d, mti_cuda_module *m)
{
    if (!m || need_cuda(d, "mti_cuda_module_unload") != MT_OK) return;
    cuda_dev *c = d->impl;
    if (cuda_enter(d) != MT_OK) return;
    cuda_drain(d); /* queued launches may still use its code */
    c->api.ModuleUnload((CUmodule)m);
    cuda_leave(d);
}

mt_status mti_cuda_module_function(mti_device *d, mti_cuda_module *m, const char *name,
                                   mti_cuda_fn **out)
{
    mt_status st = need_cuda(d, "mti_cuda_module_function");
    if (st != MT_OK) return st;
    cuda_dev *c = d->impl;
    if (!m || !name || !out)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG, "mti_cuda_module_function: NULL argument");
    if ((st = cuda_enter(d)) != MT_OK) return st;
    CUfunction f = NULL;
    CUresult r = c->api.ModuleGetFunction(&f, (CUmodule)m, name);
    cuda_leave(d);
    if (r == CUDA_ERROR_NOT_FOUND)
        return cuda_fail(d, MT_ERR_INVALID_ARG, r, "cuModuleGetFunction(\"%s\")", name);
    if (r != CUDA_SUCCESS)
        return cuda_fail(d, MT_ERR_DEVICE, r, "cuModuleGetFunction(\"%s\")", name);
    *out = (mti_cuda_fn *)f;
    return MT_OK;
}

mt_status mti_cuda_launch(mti_device *d, mti_cuda_fn *fn, mti_dim3 grid, mti_dim3 block,
                          unsigned int shared_bytes, void **args)
{
    mt_status st = need_cuda(d, "mti_cuda_launch");
    if (st != MT_OK) return st;
    cuda_dev *c = d->impl;
    if (!fn || !grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG,
                        "mti_cuda_launch: no function, or an empty grid (%u,%u,%u) or block "
                        "(%u,%u,%u)", grid.x, grid.y, grid.z, block.x, block.y, block.z);
    if ((st = cuda_enter(d)) != MT_OK) return st;
    CUresult r = c->api.LaunchKernel((CUfunction)fn, grid.x, grid.y, grid.z, block.x, block.y,
                                     block.z, shared_bytes, c->stream, args, NULL);
    const char *name = "a kernel of an application's module";
    for (int k = 0; k < MTI_CUDA_KERNEL_COUNT; k++)
        if (c->kernels[k] == (CUfunction)fn) name = kernel_names[k];
    /* out of memory at a launch (code loaded lazily, a larger local-memory
     * stack) is MT_ERR_OOM, as from an allocation */
    if (r != CUDA_SUCCESS) {
        cuda_leave(d);
        return cuda_fail(d, cuda_mem_status(r), r,
                         "cuLaunchKernel of %s (grid %u,%u,%u block %u,%u,%u, %u shared bytes)",
                         name, grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes);
    }
    if (c->debug_sync && (r = c->api.StreamSynchronize(c->stream)) != CUDA_SUCCESS) {
        cuda_leave(d);
        return cuda_fail(d, MT_ERR_DEVICE, r,
                         "kernel %s (grid %u,%u,%u block %u,%u,%u; debug sync after its launch)",
                         name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
    }
    cuda_leave(d);
    return MT_OK;
}

/* Elementwise kernels loop over the whole range inside the kernel (grid
 * stride), so the grid only has to fill the GPU: 256 threads a block, at
 * most 65535 blocks. */
static mti_dim3 grid_for(uint64_t n)
{
    uint64_t blocks = (n + 255) / 256;
    if (blocks == 0) blocks = 1;
    if (blocks > 65535) blocks = 65535;
    return (mti_dim3){(unsigned int)blocks, 1, 1};
}

mt_status mti_cuda_fill_f32(mti_device *d, float *y, float value, uint64_t n)
{
    mti_cuda_fn *fn;
    mt_status st = mti_cuda_kernel(d, MTI_CUDA_FILL_F32, &fn);
    if (st != MT_OK || n == 0) return st;
    unsigned long long nn = n; /* the kernel's parameter type */
    void *args[] = {&y, &value, &nn};
    return mti_cuda_launch(d, fn, grid_for(n), (mti_dim3){256, 1, 1}, 0, args);
}

mt_status mti_cuda_axpy_f32(mti_device *d, float *y, float a, const float *x, uint64_t n)
{
    mti_cuda_fn *fn;
    mt_status st = mti_cuda_kernel(d, MTI_CUDA_AXPY_F32, &fn);
    if (st != MT_OK || n == 0) return st;
    unsigned long long nn = n;
    void *args[] = {&y, &a, &x, &nn};
    return mti_cuda_launch(d, fn, grid_for(n), (mti_dim3){256, 1, 1}, 0, args);
}

/* ---- page-locked host memory, events, the second stream ---- */

mt_status mti_cuda_host_alloc(mti_device *d, size_t bytes, void **out)
{
    mt_status s;
    MTI_TRY(need_cuda(d, "mti_cuda_host_alloc"));
    cuda_dev *c = d->impl;
    *out = NULL;
    if (!bytes) return MT_OK;
    MTI_TRY(cuda_enter(d));
    CUresult r = c->api.MemHostAlloc(out, bytes, 0);
    cuda_leave(d);
    if (r == CUDA_SUCCESS) return MT_OK;
    *out = NULL;
    return cuda_fail(d, cuda_mem_status(r), r, "cuMemHostAlloc of %zu bytes (%.1f MiB) of pinned host memory",
                     bytes, (double)bytes / 1048576.0);
}

void mti_cuda_host_free(mti_device *d, void *p)
{
    if (!p || !is_ours(d) || !may_release(d, "host_free", p, 0)) return;
    cuda_dev *c = d->impl;
    if (cuda_enter(d) != MT_OK) return;
    CUresult r = c->api.MemFreeHost(p);
    cuda_leave(d);
    if (r != CUDA_SUCCESS) {
        char desc[256];
        mti_log(d->ctx, MT_LOG_ERROR, "cuMemFreeHost(%p) failed: %s", p,
                cuda_describe(&c->api, r, desc, sizeof desc));
    }
}

static mt_status event_new(mti_device *d, const char *fn, unsigned flags, void **ev)
{
    mt_status s;
    *ev = NULL;
    MTI_TRY(need_cuda(d, fn));
    cuda_dev *c = d->impl;
    MTI_TRY(cuda_enter(d));
    CUevent e = NULL;
    CUresult r = c->api.EventCreate(&e, flags);
    cuda_leave(d);
    *ev = r == CUDA_SUCCESS ? e : NULL;
    return r == CUDA_SUCCESS ? MT_OK : cuda_fail(d, MT_ERR_DEVICE, r, "cuEventCreate");
}

/* Blocking sync: a thread that waits for the event (cuEventSynchronize:
 * the update thread, the step's end) sleeps rather than spinning on a core
 * the CPU's own work (the host update) wants. */
mt_status mti_cuda_event_new(mti_device *d, void **ev)
{
    return event_new(d, "mti_cuda_event_new", CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC, ev);
}

void mti_cuda_event_free(mti_device *d, void *ev)
{
    if (!ev || !is_ours(d)) return;
    cuda_dev *c = d->impl;
    if (cuda_enter(d) != MT_OK) return;
    c->api.EventDestroy(ev);
    cuda_leave(d);
}

/* The second stream, made at first use (c->mu held by the caller). */
static CUresult side_stream(cuda_dev *c)
{
    return c->side ? CUDA_SUCCESS : c->api.StreamCreate(&c->side, CU_STREAM_NON_BLOCKING);
}

mt_status mti_cuda_copy_async(mti_device *d, int side, void *dst, const void *src, size_t bytes,
                              void *ev)
{
    mt_status s;
    MTI_TRY(need_cuda(d, "mti_cuda_copy_async"));
    cuda_dev *c = d->impl;
    MTI_TRY(cuda_enter(d));
    pthread_mutex_lock(&c->mu);
    CUresult r = side ? side_stream(c) : CUDA_SUCCESS;
    pthread_mutex_unlock(&c->mu);
    CUstream q = side ? c->side : c->stream;
    const char *what = "cuStreamCreate";
    /* both ends are addresses the device can reach (unified addressing) */
    if (r == CUDA_SUCCESS && bytes) {
        what = "cuMemcpyAsync";
        r = c->api.MemcpyAsync(dptr(dst), dptr(src), bytes, q);
    }
    if (r == CUDA_SUCCESS && ev) {
        what = "cuEventRecord";
        r = c->api.EventRecord(ev, q);
    }
    cuda_leave(d);
    return r == CUDA_SUCCESS ? MT_OK
                             : cuda_fail(d, MT_ERR_DEVICE, r, "%s (%zu bytes from %p to %p, %s stream)",
                                         what, bytes, src, dst, side ? "second" : "main");
}

mt_status mti_cuda_event_wait(mti_device *d, void *ev)
{
    mt_status s;
    MTI_TRY(need_cuda(d, "mti_cuda_event_wait"));
    cuda_dev *c = d->impl;
    MTI_TRY(cuda_enter(d));
    CUresult r = c->api.EventSynchronize(ev);
    cuda_leave(d);
    return r == CUDA_SUCCESS ? MT_OK : cuda_fail(d, MT_ERR_DEVICE, r, "cuEventSynchronize");
}

mt_status mti_cuda_side_sync(mti_device *d)
{
    mt_status s;
    MTI_TRY(need_cuda(d, "mti_cuda_side_sync"));
    cuda_dev *c = d->impl;
    if (!c->side) return MT_OK;
    MTI_TRY(cuda_enter(d));
    CUresult r = c->api.StreamSynchronize(c->side);
    cuda_leave(d);
    return r == CUDA_SUCCESS ? MT_OK
                             : cuda_fail(d, MT_ERR_DEVICE, r, "cuStreamSynchronize (the second stream)");
}

/* ---- streams of a caller's own, ordered with events ---- */

mt_status mti_cuda_stream_new(mti_device *d, void **stream)
{
    mt_status s;
    *stream = NULL;
    MTI_TRY(need_cuda(d, "mti_cuda_stream_new"));
    cuda_dev *c = d->impl;
    MTI_TRY(cuda_enter(d));
    CUstream q = NULL;
    CUresult r = c->api.StreamCreate(&q, CU_STREAM_NON_BLOCKING);
    cuda_leave(d);
    if (r != CUDA_SUCCESS) return cuda_fail(d, MT_ERR_DEVICE, r, "cuStreamCreate");
    *stream = q;
    return MT_OK;
}

void mti_cuda_stream_free(mti_device *d, void *stream)
{
    if (!stream || !is_ours(d)) return;
    cuda_dev *c = d->impl;
    if (cuda_enter(d) != MT_OK) return;
    c->api.StreamDestroy(stream); /* (its work, if any, still ends) */
    cuda_leave(d);
}

mt_status mti_cuda_event_new_timed(mti_device *d, void **ev)
{
    return event_new(d, "mti_cuda_event_new_timed", CU_EVENT_DEFAULT, ev);
}

mt_status mti_cuda_record(mti_device *d, void *ev, void *stream)
{
    mt_status s;
    MTI_TRY(need_cuda(d, "mti_cuda_record"));
    cuda_dev *c = d->impl;
    MTI_TRY(cuda_enter(d));
    CUresult r = c->api.EventRecord(ev, stream ? (CUstream)stream : c->stream);
    cuda_leave(d);
    return r == CUDA_SUCCESS ? MT_OK : cuda_fail(d, MT_ERR_DEVICE, r, "cuEventRecord");
}

mt_status mti_cuda_stream_wait(mti_device *d, void *stream, void *ev)
{
    mt_status s;
    MTI_TRY(need_cuda(d, "mti_cuda_stream_wait"));
    cuda_dev *c = d->impl;
    MTI_TRY(cuda_enter(d));
    CUresult r = c->api.StreamWaitEvent(stream ? (CUstream)stream : c->stream, ev, 0);
    cuda_leave(d);
    return r == CUDA_SUCCESS ? MT_OK : cuda_fail(d, MT_ERR_DEVICE, r, "cuStreamWaitEvent");
}

mt_status mti_cuda_event_done(mti_device *d, void *ev, bool *done)
{
    mt_status s;
    *done = false;
    MTI_TRY(need_cuda(d, "mti_cuda_event_done"));
    cuda_dev *c = d->impl;
    MTI_TRY(cuda_enter(d));
    CUresult r = c->api.EventQuery(ev);
    cuda_leave(d);
    if (r == CUDA_SUCCESS) *done = true;
    return r == CUDA_SUCCESS || r == 600 ? MT_OK : cuda_fail(d, MT_ERR_DEVICE, r, "cuEventQuery");
}

mt_status mti_cuda_elapsed(mti_device *d, void *start, void *end, float *ms)
{
    mt_status s;
    *ms = 0.0f;
    MTI_TRY(need_cuda(d, "mti_cuda_elapsed"));
    cuda_dev *c = d->impl;
    MTI_TRY(cuda_enter(d));
    CUresult r = c->api.EventElapsedTime(ms, start, end);
    cuda_leave(d);
    return r == CUDA_SUCCESS ? MT_OK : cuda_fail(d, MT_ERR_DEVICE, r, "cuEventElapsedTime");
}
