/*
 * fake_libcuda.c - a stand-in CUDA driver over host memory, for tests.
 *
 * Built as build/libfakecuda.so and handed to the library as
 * cuda_driver_path (tests find it through the environment variable
 * MT_FAKE_CUDA), so the CUDA device layer, and the allocators on "device"
 * memory, run where there is no GPU. It exports every entry point
 * lib/device/device_cuda.c looks up, and checks their use as a real driver would
 * where that is cheap: cuInit first, a current context for the calls that
 * need one, copies only inside allocated or mapped-and-accessible memory,
 * unmaps only of whole mappings, handles and streams that exist.
 *
 * Device memory is host memory: cuMemAlloc is an aligned malloc, copies are
 * memmove, and the virtual memory calls are mmap(PROT_NONE) for address
 * space, mprotect when access is granted, and madvise(MADV_DONTNEED) when a
 * mapping goes. Launches of the kernels of kernels/cuda that it knows run
 * on the host; others are only counted. It knows mt_fill_f32, mt_axpy_f32,
 * mt_accumulate_f32 (ZeRO-2 adds the ranks' sums onto its gradient slices
 * with it), mt_sgd under MT_FAKE_CUDA_SGD (below; the arithmetic of
 * kernels/cuda/optim.cu) and the dequantizing kernels of dequant.cu, whose twins here run that
 * file's own arithmetic (kernels/cuda/dequant.cuh, plain C as well as
 * CUDA), so the stand-in tests check it bit for bit against lib/quant/quant.c.
 *
 * Read at every cuInit, so a test can change them between contexts:
 *   MT_FAKE_CUDA_MEM          total device memory, bytes (default 4 GiB)
 *   MT_FAKE_CUDA_DEVICES      number of devices (default 1; 0: none)
 *   MT_FAKE_CUDA_FAIL_INIT    1: cuInit fails with CUDA_ERROR_UNKNOWN;
 *                             another number: cuInit returns that code
 *   MT_FAKE_CUDA_NO_VMM       1: the device does not offer cuMemCreate/cuMemMap
 *   MT_FAKE_CUDA_GRANULARITY  VMM granularity, bytes (default 2 MiB)
 *   MT_FAKE_CUDA_PINNED       page-locked host memory cuMemHostAlloc grants in
 *                             all, bytes (default 64 GiB)
 *   MT_FAKE_CUDA_SGD          1: mt_sgd runs (on fp32 weights without a compute
 *                             copy), so tests that fill the gradients in see the
 *                             weights move by them; else it computes nothing
 *   MT_FAKE_CUDA_CLOCK_US     N > 0: events keep time on a clock of their own that
 *                             each cuEventRecord moves on by N microseconds, so
 *                             elapsed times are whole multiples of N us, whatever
 *                             the host's timing (default 0: the host's clock)
 *
 * For tests, besides the driver's entry points:
 *   fake_cuda_fail(call, skip, code)  the named entry point returns `code`
 *                                     once, after `skip` successful calls
 *   fake_cuda_stat(name)              counters, see fake_cuda_stat below
 *   fake_cuda_last_kernel()           name of the last kernel launched ("" if none)
 *   fake_cuda_log(reset, main)        the copies and events since the last reset
 *                                     (which names the main stream, tagged m:, the
 *                                     others s:), one word each (see fake_log)
 *
 * NCCL's work on a stream (the stand-in libnccl named by MT_FAKE_NCCL, when
 * the process has it loaded) completes when every rank has queued it, not
 * when it is queued: an event recorded on a stream behind a collective of
 * the calling thread's not yet done is not complete either (cuEventQuery
 * says CUDA_ERROR_NOT_READY), and cuEventSynchronize and cuStreamWaitEvent
 * on it block the calling thread until it is (up to 60 s, then
 * CUDA_ERROR_LAUNCH_TIMEOUT): work here runs when it is queued, so a
 * stream that waits for an event must see its work done before anything
 * queued after the wait runs. On a GPU cuMemFree and cuMemUnmap wait for
 * the whole device, so under a collective whose peer never comes they
 * block for good: here such a call (the calling thread has a collective
 * queued and not done) is counted as busy_frees (fake_cuda_stat) and goes
 * on, so a test sees it rather than hangs.
 *
 * Page-locked host memory (cuMemHostAlloc) is reachable from the device at
 * its host address, as under unified addressing: copies may name it as
 * device memory, and cuMemcpyAsync takes any two such addresses.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "device/cuda_driver.h"
#include "../../kernels/cuda/dequant.cuh"

/* ---- the exported entry points (the driver's symbol names) ---- */

CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *version);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attr, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream s);
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream s);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s);
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes, CUstream s);
CUresult cuStreamCreate(CUstream *stream, unsigned int flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamDestroy_v2(CUstream stream);
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s);
CUresult cuMemHostAlloc(void **ptr, size_t bytes, unsigned int flags);
CUresult cuMemFreeHost(void *ptr);
CUresult cuEventCreate(CUevent *event, unsigned int flags);
CUresult cuEventRecord(CUevent event, CUstream stream);
CUresult cuEventSynchronize(CUevent event);
CUresult cuEventDestroy_v2(CUevent event);
CUresult cuEventQuery(CUevent event);
CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end);
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags);
CUresult cuStreamQuery(CUstream stream);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *fn, CUmodule module, const char *name);
CUresult cuModuleUnload(CUmodule module);
CUresult cuFuncLoad(CUfunction fn);
CUresult cuLaunchKernel(CUfunction fn, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                        CUstream stream, void **params, void **extra);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t bytes, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t bytes);
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                     const CUmemAllocationProp *prop, unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemMap(CUdeviceptr ptr, size_t bytes, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t bytes);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t bytes, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option);
CUresult cuGetErrorName(CUresult err, const char **str);
CUresult cuGetErrorString(CUresult err, const char **str);

void fake_cuda_fail(const char *call, int skip, CUresult code);
unsigned long long fake_cuda_stat(const char *name);
const char *fake_cuda_last_kernel(void);
const char *fake_cuda_log(int reset, void *main_stream);

/* ---- state ---- */

#define FAKE_MAX_DEVICES 8
#define FAKE_CTX_DEPTH 64
#define FAKE_MAGIC_STREAM 0x57AEA4u
#define FAKE_MAGIC_MODULE 0x40D01Eu
#define FAKE_MAGIC_FUNC 0xF00Cu
#define FAKE_MAGIC_EVENT 0xE7E4u

struct CUctx_st {
    CUdevice dev;
    int refs; /* primary context retains */
};
struct CUstream_st {
    unsigned magic;
};
struct CUmod_st {
    unsigned magic;
};
struct CUevent_st {
    unsigned magic;
    int recorded;
    unsigned flags;     /* cuEventCreate's */
    double recorded_at; /* host seconds of the last record (work runs at once here) */
    int marked;         /* behind a collective of the stand-in libnccl, not done when recorded */
    unsigned long long mark[2];
};
struct CUfunc_st {
    unsigned magic;
    CUmodule module;
    char name[128];
    struct CUfunc_st *next;
};

typedef struct fake_alloc { /* cuMemAlloc */
    void *raw;
    CUdeviceptr p;
    size_t bytes;
} fake_alloc;

typedef struct fake_resv { /* cuMemAddressReserve */
    CUdeviceptr base;
    size_t bytes;
} fake_resv;

typedef struct fake_phys { /* cuMemCreate */
    size_t bytes;
    int mapped;
    int released;
} fake_phys;

typedef struct fake_map { /* cuMemMap */
    CUdeviceptr at;
    size_t bytes;
    fake_phys *h;
    int access; /* read-write granted */
} fake_map;

#define VEC(T)                                                                                 \
    struct {                                                                                   \
        T *v;                                                                                  \
        size_t n, cap;                                                                         \
    }

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int initialized;
    int n_devices;
    int vmm;
    int sgd; /* MT_FAKE_CUDA_SGD: mt_sgd runs */
    unsigned long long clock_us, clock; /* MT_FAKE_CUDA_CLOCK_US, the events' clock (us) */
    size_t total, used, gran;
    struct CUctx_st ctx[FAKE_MAX_DEVICES];
    VEC(fake_alloc) allocs;
    VEC(fake_resv) resvs;
    VEC(fake_map) maps;
    VEC(fake_alloc) pinned; /* cuMemHostAlloc */
    size_t pinned_used, pinned_max, n_events;
    CUstream first_stream; /* the stream the log calls main */
    char log[1 << 16];
    size_t log_n;
    size_t n_handles, n_streams, n_modules;
    struct CUfunc_st *funcs;
    unsigned long long launches, func_loads, syncs, ctx_pushes, stream_waits;
    unsigned long long busy_frees; /* cuMemFree / cuMemUnmap under NCCL work not done */
    unsigned long long spin_syncs; /* cuEventSynchronize on an event without blocking sync */
    char last_kernel[128];
    /* fault injection */
    char fail_call[64];
    int fail_skip;
    CUresult fail_code;
} F = {.n_devices = 1, .vmm = 1};

static _Thread_local CUcontext tls_stack[FAKE_CTX_DEPTH];
static _Thread_local int tls_depth;

static void *vec_slot(void **v, size_t *n, size_t *cap, size_t elem)
{
    if (*n == *cap) {
        size_t c = *cap ? 2 * *cap : 16;
        void *t = realloc(*v, c * elem);
        if (!t) return NULL;
        *v = t;
        *cap = c;
    }
    return (char *)*v + (*n)++ * elem;
}
#define VEC_PUSH(vec) vec_slot((void **)&(vec).v, &(vec).n, &(vec).cap, sizeof *(vec).v)
#define VEC_DEL(vec, i) ((vec).v[i] = (vec).v[--(vec).n])

static unsigned long long env_ull(const char *name, unsigned long long dflt)
{
    const char *s = getenv(name);
    if (!s || !*s) return dflt;
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    return *end ? dflt : v;
}

/* The injected failure for `call`, if it is due now. Called with mu held. */
static CUresult injected(const char *call)
{
    if (!F.fail_call[0] || strcmp(F.fail_call, call) != 0) return CUDA_SUCCESS;
    if (F.fail_skip > 0) {
        F.fail_skip--;
        return CUDA_SUCCESS;
    }
    F.fail_call[0] = 0;
    return F.fail_code;
}

void fake_cuda_fail(const char *call, int skip, CUresult code)
{
    pthread_mutex_lock(&mu);
    size_t n = call ? strlen(call) : 0;
    if (n >= sizeof F.fail_call) n = sizeof F.fail_call - 1;
    memcpy(F.fail_call, call ? call : "", n);
    F.fail_call[n] = 0;
    F.fail_skip = skip;
    F.fail_code = code;
    pthread_mutex_unlock(&mu);
}

/* Entry preamble: cuInit done, no failure injected. Takes mu. */
#define ENTER(call)                                                                            \
    pthread_mutex_lock(&mu);                                                                   \
    CUresult rc_ = F.initialized ? injected(call) : CUDA_ERROR_NOT_INITIALIZED;                \
    if (rc_ != CUDA_SUCCESS) return leave(rc_)

static CUresult leave(CUresult r)
{
    pthread_mutex_unlock(&mu);
    return r;
}

/* A context is current on this thread and still retained. mu held. */
static int have_ctx(void)
{
    return tls_depth > 0 && tls_stack[tls_depth - 1] && tls_stack[tls_depth - 1]->refs > 0;
}

static int valid_ctx(CUcontext c)
{
    for (int i = 0; i < F.n_devices && i < FAKE_MAX_DEVICES; i++)
        if (c == &F.ctx[i]) return c->refs > 0;
    return 0;
}

/* [p, p + n) lies in one cuMemAlloc block or in mapped, accessible
 * memory. mu held. */
static int dev_range_ok(CUdeviceptr p, size_t n)
{
    if (n == 0) return 1;
    for (size_t i = 0; i < F.allocs.n; i++) {
        const fake_alloc *a = &F.allocs.v[i];
        if (p >= a->p && p - a->p <= a->bytes && n <= a->bytes - (p - a->p)) return 1;
    }
    for (size_t i = 0; i < F.pinned.n; i++) { /* unified addressing */
        const fake_alloc *a = &F.pinned.v[i];
        if (p >= a->p && p - a->p <= a->bytes && n <= a->bytes - (p - a->p)) return 1;
    }
    /* a range may run across several adjacent mappings */
    while (n > 0) {
        const fake_map *m = NULL;
        for (size_t i = 0; i < F.maps.n; i++)
            if (p >= F.maps.v[i].at && p < F.maps.v[i].at + F.maps.v[i].bytes) m = &F.maps.v[i];
        if (!m || !m->access) return 0;
        size_t here = (size_t)(m->at + m->bytes - p);
        if (here >= n) return 1;
        p += here;
        n -= here;
    }
    return 1;
}

static int valid_stream(CUstream s)
{
    return s == NULL || s->magic == FAKE_MAGIC_STREAM;
}

/* ---- init, devices, contexts ---- */

CUresult cuInit(unsigned int flags)
{
    pthread_mutex_lock(&mu);
    unsigned long long fail = env_ull("MT_FAKE_CUDA_FAIL_INIT", 0);
    if (fail) {
        F.initialized = 0;
        return leave(fail == 1 ? CUDA_ERROR_UNKNOWN : (CUresult)fail);
    }
    if (flags != 0) return leave(CUDA_ERROR_INVALID_VALUE);
    unsigned long long nd = env_ull("MT_FAKE_CUDA_DEVICES", 1);
    F.n_devices = nd > FAKE_MAX_DEVICES ? FAKE_MAX_DEVICES : (int)nd;
    F.total = (size_t)env_ull("MT_FAKE_CUDA_MEM", 4ull << 30);
    F.vmm = env_ull("MT_FAKE_CUDA_NO_VMM", 0) ? 0 : 1;
    F.sgd = env_ull("MT_FAKE_CUDA_SGD", 0) != 0;
    F.clock_us = env_ull("MT_FAKE_CUDA_CLOCK_US", 0);
    unsigned long long g = env_ull("MT_FAKE_CUDA_GRANULARITY", 2u << 20);
    F.pinned_max = (size_t)env_ull("MT_FAKE_CUDA_PINNED", 64ull << 30);
    F.gran = (g >= 4096 && !(g & (g - 1))) ? (size_t)g : (2u << 20);
    for (int i = 0; i < FAKE_MAX_DEVICES; i++) F.ctx[i].dev = i;
    F.initialized = 1;
    return leave(CUDA_SUCCESS);
}

CUresult cuDriverGetVersion(int *version)
{
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 13000; /* 13.0; answered before cuInit, as the real driver does */
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
    ENTER("cuDeviceGetCount");
    if (!count) return leave(CUDA_ERROR_INVALID_VALUE);
    *count = F.n_devices;
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    ENTER("cuDeviceGet");
    if (!dev) return leave(CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0 || ordinal >= F.n_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    *dev = ordinal;
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    ENTER("cuDeviceGetName");
    if (!name || len <= 0) return leave(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= F.n_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    const char *s = "memtrain fake GPU";
    size_t n = strlen(s);
    if (n >= (size_t)len) n = (size_t)len - 1;
    memcpy(name, s, n);
    name[n] = 0;
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    ENTER("cuDeviceTotalMem_v2");
    if (!bytes) return leave(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= F.n_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    *bytes = F.total;
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attr, CUdevice dev)
{
    ENTER("cuDeviceGetAttribute");
    if (!value) return leave(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= F.n_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    switch (attr) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *value = F.vmm; break;
    default: return leave(CUDA_ERROR_INVALID_VALUE);
    }
    return leave(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    ENTER("cuDevicePrimaryCtxRetain");
    if (!ctx) return leave(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= F.n_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    F.ctx[dev].refs++;
    *ctx = &F.ctx[dev];
    return leave(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    ENTER("cuDevicePrimaryCtxRelease_v2");
    if (dev < 0 || dev >= F.n_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    if (F.ctx[dev].refs <= 0) return leave(CUDA_ERROR_INVALID_CONTEXT);
    F.ctx[dev].refs--;
    return leave(CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    ENTER("cuCtxSetCurrent");
    if (ctx && !valid_ctx(ctx)) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (tls_depth == 0) {
        if (ctx) tls_stack[tls_depth++] = ctx;
    } else {
        tls_stack[tls_depth - 1] = ctx;
        if (!ctx) tls_depth--;
    }
    return leave(CUDA_SUCCESS);
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    ENTER("cuCtxPushCurrent_v2");
    if (!valid_ctx(ctx)) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (tls_depth == FAKE_CTX_DEPTH) return leave(CUDA_ERROR_UNKNOWN);
    tls_stack[tls_depth++] = ctx;
    F.ctx_pushes++;
    return leave(CUDA_SUCCESS);
}

CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    ENTER("cuCtxPopCurrent_v2");
    if (tls_depth == 0) return leave(CUDA_ERROR_INVALID_CONTEXT);
    CUcontext c = tls_stack[--tls_depth];
    if (ctx) *ctx = c;
    return leave(CUDA_SUCCESS);
}

/* ---- plain memory ---- */

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    ENTER("cuMemAlloc_v2");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!dptr || bytes == 0) return leave(CUDA_ERROR_INVALID_VALUE);
    if (bytes > F.total - F.used) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    /* 256-aligned but never 512-aligned, the weakest the driver promises, so
     * callers that need more have to do their own aligning; zeroed, so the
     * values read back where no kernel ran (losses, norms) are finite and the
     * same every run */
    void *raw = calloc(1, bytes + 512);
    fake_alloc *a = raw ? VEC_PUSH(F.allocs) : NULL;
    if (!a) {
        free(raw);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    CUdeviceptr p = ((CUdeviceptr)(uintptr_t)raw + 255) & ~(CUdeviceptr)255;
    if (p % 512 == 0) p += 256;
    *a = (fake_alloc){raw, p, bytes};
    F.used += bytes;
    *dptr = p;
    return leave(CUDA_SUCCESS);
}

static void nccl_find(void);
static int (*nccl_busy)(void); /* (the stand-in libnccl's, found by nccl_find) */

/* A call that waits for the whole device on a GPU: counted when the
 * calling thread's NCCL work is not done (see the top). */
static int busy_now(void)
{
    nccl_find();
    return nccl_busy && nccl_busy();
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    const int busy = busy_now();
    ENTER("cuMemFree_v2");
    F.busy_frees += (unsigned long long)busy;
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (dptr == 0) return leave(CUDA_SUCCESS);
    for (size_t i = 0; i < F.allocs.n; i++) {
        if (F.allocs.v[i].p == dptr) {
            free(F.allocs.v[i].raw);
            F.used -= F.allocs.v[i].bytes;
            VEC_DEL(F.allocs, i);
            return leave(CUDA_SUCCESS);
        }
    }
    return leave(CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    ENTER("cuMemGetInfo_v2");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!free_bytes || !total_bytes) return leave(CUDA_ERROR_INVALID_VALUE);
    *free_bytes = F.total - F.used;
    *total_bytes = F.total;
    return leave(CUDA_SUCCESS);
}

/* ---- copies (done at once: the fake's stream never has work pending) ---- */

static CUresult copy_check(CUstream s, int ok_dst, int ok_src, int host_ok)
{
    if (!have_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!valid_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    if (!host_ok || !ok_dst || !ok_src) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream s)
{
    ENTER("cuMemcpyHtoDAsync_v2");
    CUresult r = copy_check(s, dev_range_ok(dst, bytes), 1, src != NULL || bytes == 0);
    if (r == CUDA_SUCCESS && bytes) memmove((void *)(uintptr_t)dst, src, bytes);
    return leave(r);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream s)
{
    ENTER("cuMemcpyDtoHAsync_v2");
    CUresult r = copy_check(s, 1, dev_range_ok(src, bytes), dst != NULL || bytes == 0);
    if (r == CUDA_SUCCESS && bytes) memmove(dst, (const void *)(uintptr_t)src, bytes);
    return leave(r);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s)
{
    ENTER("cuMemcpyDtoDAsync_v2");
    CUresult r = copy_check(s, dev_range_ok(dst, bytes), dev_range_ok(src, bytes), 1);
    if (r == CUDA_SUCCESS && bytes)
        memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
    return leave(r);
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes, CUstream s)
{
    ENTER("cuMemsetD8Async");
    CUresult r = copy_check(s, dev_range_ok(dst, bytes), 1, 1);
    if (r == CUDA_SUCCESS && bytes) memset((void *)(uintptr_t)dst, value, bytes);
    return leave(r);
}

static void fake_log(CUstream s, const char *what);

/* ---- streams ---- */

CUresult cuStreamCreate(CUstream *stream, unsigned int flags)
{
    ENTER("cuStreamCreate");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!stream || flags > CU_STREAM_NON_BLOCKING) return leave(CUDA_ERROR_INVALID_VALUE);
    struct CUstream_st *s = malloc(sizeof *s);
    if (!s) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    s->magic = FAKE_MAGIC_STREAM;
    F.n_streams++;
    *stream = s;
    return leave(CUDA_SUCCESS);
}

CUresult cuStreamSynchronize(CUstream stream)
{
    ENTER("cuStreamSynchronize");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!valid_stream(stream)) return leave(CUDA_ERROR_INVALID_HANDLE);
    F.syncs++;
    fake_log(stream, "sync");
    return leave(CUDA_SUCCESS);
}

CUresult cuStreamDestroy_v2(CUstream stream)
{
    ENTER("cuStreamDestroy_v2");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!stream || stream->magic != FAKE_MAGIC_STREAM) return leave(CUDA_ERROR_INVALID_HANDLE);
    stream->magic = 0;
    free(stream);
    F.n_streams--;
    return leave(CUDA_SUCCESS);
}

/* ---- unified copies, page-locked host memory, events ---- */

/* One word of the log: "m:" or "s:" (main or second stream) and what,
 * e.g. "m:D>H", "s:H>D", "m:rec", "sync", "host+", "host-". mu held. */
static void fake_log(CUstream s, const char *what)
{
    size_t n = strlen(what) + 4;
    if (F.log_n + n >= sizeof F.log) return;
    F.log_n += (size_t)snprintf(F.log + F.log_n, sizeof F.log - F.log_n, "%s%s ",
                                s ? (s == F.first_stream ? "m:" : "s:") : "", what);
}

const char *fake_cuda_log(int reset, void *main_stream)
{
    pthread_mutex_lock(&mu);
    if (reset) F.log_n = 0;
    if (reset) F.first_stream = main_stream;
    F.log[F.log_n] = 0;
    pthread_mutex_unlock(&mu);
    return F.log;
}

/* Device (1), page-locked host (2) or neither (0). mu held. */
static int where(CUdeviceptr p, size_t n)
{
    for (size_t i = 0; i < F.pinned.n; i++) {
        const fake_alloc *a = &F.pinned.v[i];
        if (p >= a->p && p - a->p <= a->bytes && n <= a->bytes - (p - a->p)) return 2;
    }
    return dev_range_ok(p, n) ? 1 : 0;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s)
{
    ENTER("cuMemcpyAsync");
    int wd = where(dst, bytes), ws = where(src, bytes);
    CUresult r = copy_check(s, wd != 0, ws != 0, 1);
    if (r == CUDA_SUCCESS && bytes) {
        memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
        fake_log(s, ws == 2 && wd == 1 ? "H>D" : ws == 1 && wd == 2 ? "D>H" : ws == 1 ? "D>D" : "H>H");
    }
    return leave(r);
}

CUresult cuMemHostAlloc(void **ptr, size_t bytes, unsigned int flags)
{
    ENTER("cuMemHostAlloc");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!ptr || bytes == 0 || flags > 0xF) return leave(CUDA_ERROR_INVALID_VALUE);
    if (bytes > F.pinned_max || F.pinned_used > F.pinned_max - bytes) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    void *raw = NULL;
    if (posix_memalign(&raw, 4096, bytes) != 0) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    fake_alloc *a = VEC_PUSH(F.pinned);
    if (!a) {
        free(raw);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *a = (fake_alloc){raw, (CUdeviceptr)(uintptr_t)raw, bytes};
    F.pinned_used += bytes;
    fake_log(NULL, "host+");
    *ptr = raw;
    return leave(CUDA_SUCCESS);
}

CUresult cuMemFreeHost(void *ptr)
{
    ENTER("cuMemFreeHost");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    for (size_t i = 0; i < F.pinned.n; i++) {
        if (F.pinned.v[i].raw == ptr) {
            free(ptr);
            F.pinned_used -= F.pinned.v[i].bytes;
            VEC_DEL(F.pinned, i);
            fake_log(NULL, "host-");
            return leave(CUDA_SUCCESS);
        }
    }
    return leave(CUDA_ERROR_INVALID_VALUE);
}

static int valid_event(CUevent e) { return e && e->magic == FAKE_MAGIC_EVENT; }

/* The stand-in libnccl's marks (see the top), once the process has it. */
static int (*nccl_mark)(void *stream, unsigned long long mark[2]);
static int (*nccl_reached)(const unsigned long long mark[2]);

static void nccl_find(void)
{
    if (nccl_reached) return;
    const char *path = getenv("MT_FAKE_NCCL");
    void *lib = path && *path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    if (!lib) return;
    void *m = dlsym(lib, "fake_nccl_mark"), *r = dlsym(lib, "fake_nccl_reached");
    void *b = dlsym(lib, "fake_nccl_busy");
    if (!m || !r || !b) return;
    memcpy(&nccl_busy, &b, sizeof b);
    memcpy(&nccl_mark, &m, sizeof m);
    memcpy(&nccl_reached, &r, sizeof r); /* (kept loaded: the library never unloads it) */
}

static int event_done(CUevent e) { return !e->marked || nccl_reached(e->mark); }

/* Blocks until the event's collective is done (called without mu). */
static CUresult event_await(CUevent e)
{
    if (!valid_event(e)) return CUDA_SUCCESS; /* (refused under mu) */
    struct timespec nap = {0, 50000};
    for (int k = 0; k < 1200000 && !event_done(e); k++) nanosleep(&nap, NULL);
    return event_done(e) ? CUDA_SUCCESS : CUDA_ERROR_LAUNCH_TIMEOUT;
}

CUresult cuEventCreate(CUevent *event, unsigned int flags)
{
    ENTER("cuEventCreate");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!event || (flags & ~0xFu)) return leave(CUDA_ERROR_INVALID_VALUE);
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    e->magic = FAKE_MAGIC_EVENT;
    e->flags = flags;
    F.n_events++;
    *event = e;
    return leave(CUDA_SUCCESS);
}

CUresult cuEventRecord(CUevent event, CUstream stream)
{
    nccl_find();
    ENTER("cuEventRecord");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!valid_event(event) || !valid_stream(stream)) return leave(CUDA_ERROR_INVALID_HANDLE);
    event->recorded = 1;
    event->marked = nccl_mark && nccl_mark(stream, event->mark);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    event->recorded_at = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    if (F.clock_us) event->recorded_at = 1e-6 * (double)(F.clock += F.clock_us);
    fake_log(stream, "rec");
    return leave(CUDA_SUCCESS);
}

CUresult cuEventSynchronize(CUevent event)
{
    const CUresult w = event_await(event);
    ENTER("cuEventSynchronize");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!valid_event(event)) return leave(CUDA_ERROR_INVALID_HANDLE);
    if (!(event->flags & CU_EVENT_BLOCKING_SYNC)) F.spin_syncs++;
    if (w) return leave(w);
    fake_log(NULL, event->recorded ? "wait" : "wait0");
    return leave(CUDA_SUCCESS);
}

CUresult cuEventDestroy_v2(CUevent event)
{
    ENTER("cuEventDestroy_v2");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!valid_event(event)) return leave(CUDA_ERROR_INVALID_HANDLE);
    event->magic = 0;
    free(event);
    F.n_events--;
    return leave(CUDA_SUCCESS);
}

/* Work here is done when it is queued, so an event is complete once
 * recorded (unless behind a collective not done: see the top), and one
 * never recorded counts as complete (the driver's rule). */
CUresult cuEventQuery(CUevent event)
{
    ENTER("cuEventQuery");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!valid_event(event)) return leave(CUDA_ERROR_INVALID_HANDLE);
    return leave(event_done(event) ? CUDA_SUCCESS : (CUresult)600); /* CUDA_ERROR_NOT_READY */
}

/* The driver's rules: both events recorded, neither made with
 * CU_EVENT_DISABLE_TIMING (else an invalid handle). */
CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    ENTER("cuEventElapsedTime");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!ms) return leave(CUDA_ERROR_INVALID_VALUE);
    if (!valid_event(start) || !valid_event(end)) return leave(CUDA_ERROR_INVALID_HANDLE);
    if (!start->recorded || !end->recorded || (start->flags & CU_EVENT_DISABLE_TIMING) ||
        (end->flags & CU_EVENT_DISABLE_TIMING))
        return leave(CUDA_ERROR_INVALID_HANDLE);
    *ms = (float)(1e3 * (end->recorded_at - start->recorded_at));
    return leave(CUDA_SUCCESS);
}

/* Work queued on the stream after this waits for the event's work; an
 * event never recorded makes no wait. Flags: 0 (CU_EVENT_WAIT_DEFAULT) or
 * 1 (CU_EVENT_WAIT_EXTERNAL), anything else is refused. Logged as "wait>"
 * on the stream, counted as stream_waits. */
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags)
{
    const CUresult w = event_await(event); /* (what follows on the stream runs at once here) */
    ENTER("cuStreamWaitEvent");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (flags > 1u) return leave(CUDA_ERROR_INVALID_VALUE);
    if (!valid_stream(stream) || !valid_event(event)) return leave(CUDA_ERROR_INVALID_HANDLE);
    if (w) return leave(w);
    F.stream_waits++;
    fake_log(stream, event->recorded ? "wait>" : "wait0>");
    return leave(CUDA_SUCCESS);
}

/* Everything queued is done already. */
CUresult cuStreamQuery(CUstream stream)
{
    ENTER("cuStreamQuery");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!valid_stream(stream)) return leave(CUDA_ERROR_INVALID_HANDLE);
    return leave(CUDA_SUCCESS);
}

/* ---- modules and launches ---- */

/* A fatbin (magic 0xBA55ED50, little-endian), an ELF cubin, or PTX text. */
static int image_ok(const void *image)
{
    const unsigned char *b = image;
    if (b[0] == 0x50 && b[1] == 0xED && b[2] == 0x55 && b[3] == 0xBA) return 1;
    if (b[0] == 0x7F && b[1] == 'E' && b[2] == 'L' && b[3] == 'F') return 1;
    const char *s = image;
    while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r') s++;
    return strncmp(s, "//", 2) == 0 || strncmp(s, ".version", 8) == 0;
}

CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    ENTER("cuModuleLoadData");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!module || !image) return leave(CUDA_ERROR_INVALID_VALUE);
    if (!image_ok(image)) return leave(CUDA_ERROR_INVALID_IMAGE);
    struct CUmod_st *m = malloc(sizeof *m);
    if (!m) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    m->magic = FAKE_MAGIC_MODULE;
    F.n_modules++;
    *module = m;
    return leave(CUDA_SUCCESS);
}

/* Any name is found (the fake does not parse the image); functions are kept
 * until their module is unloaded. */
CUresult cuModuleGetFunction(CUfunction *fn, CUmodule module, const char *name)
{
    ENTER("cuModuleGetFunction");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!fn || !name) return leave(CUDA_ERROR_INVALID_VALUE);
    if (!module || module->magic != FAKE_MAGIC_MODULE) return leave(CUDA_ERROR_INVALID_HANDLE);
    if (strlen(name) >= sizeof F.funcs->name) return leave(CUDA_ERROR_NOT_FOUND);
    struct CUfunc_st *f = calloc(1, sizeof *f);
    if (!f) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    f->magic = FAKE_MAGIC_FUNC;
    f->module = module;
    strcpy(f->name, name);
    f->next = F.funcs;
    F.funcs = f;
    *fn = f;
    return leave(CUDA_SUCCESS);
}

CUresult cuModuleUnload(CUmodule module)
{
    ENTER("cuModuleUnload");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!module || module->magic != FAKE_MAGIC_MODULE) return leave(CUDA_ERROR_INVALID_HANDLE);
    for (struct CUfunc_st **pp = &F.funcs; *pp;) {
        struct CUfunc_st *f = *pp;
        if (f->module == module) {
            *pp = f->next;
            f->magic = 0;
            free(f);
        } else {
            pp = &f->next;
        }
    }
    module->magic = 0;
    free(module);
    F.n_modules--;
    return leave(CUDA_SUCCESS);
}

CUresult cuFuncLoad(CUfunction fn)
{
    ENTER("cuFuncLoad");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!fn || fn->magic != FAKE_MAGIC_FUNC) return leave(CUDA_ERROR_INVALID_HANDLE);
    F.func_loads++;
    return leave(CUDA_SUCCESS);
}

/* The tile [r0, r0 + rows) x [c0, c0 + cols) of dequant.cu's kernels, run
 * with dequant.cuh's own arithmetic; the reads and the writes must lie in
 * device memory, as on a GPU. mu held. */
static CUresult run_dequant(int nf4, void **p)
{
    void *out = *(void **)p[0];
    int dt = *(const int *)p[1];
    unsigned long long ld = *(const unsigned long long *)p[2];
    const void *codes = *(const void **)p[3];
    int a = nf4 ? 7 : 5; /* where I, r0, rows, c0, cols start */
    unsigned long long I = *(const unsigned long long *)p[a];
    unsigned long long r0 = *(const unsigned long long *)p[a + 1];
    unsigned rows = *(const unsigned *)p[a + 2];
    unsigned long long c0 = *(const unsigned long long *)p[a + 3];
    unsigned cols = *(const unsigned *)p[a + 4];
    if (dt < 0 || dt > 2 || !rows || !cols || cols > ld) return CUDA_ERROR_INVALID_VALUE;
    size_t es = dt == 0 ? 4 : 2;
    unsigned long long last = (r0 + rows - 1) * I + c0 + cols; /* elements read: [0, last) */
    unsigned long long blocks = (last + MT_DQ_BLOCK - 1) / MT_DQ_BLOCK;
    if (!dev_range_ok((CUdeviceptr)(uintptr_t)out, ((rows - 1) * ld + cols) * es))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (!nf4) {
        const float *scale = *(const float **)p[4];
        if (!dev_range_ok((CUdeviceptr)(uintptr_t)codes, last) ||
            !dev_range_ok((CUdeviceptr)(uintptr_t)scale, blocks * 4))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        for (unsigned r = 0; r < rows; r++)
            for (unsigned c = 0; c < cols; c++)
                mt_dq_store(out, dt, r * ld + c,
                            mt_dq_int8(codes, scale, (r0 + r) * I + c0 + c));
        return CUDA_SUCCESS;
    }
    const uint8_t *qabsmax = *(const uint8_t **)p[4];
    const float *absmax2 = *(const float **)p[5], *offset = *(const float **)p[6];
    const mt_dq_maps *maps = p[12];
    if (!dev_range_ok((CUdeviceptr)(uintptr_t)codes, (last + 1) / 2) ||
        !dev_range_ok((CUdeviceptr)(uintptr_t)qabsmax, blocks) ||
        !dev_range_ok((CUdeviceptr)(uintptr_t)absmax2,
                      (blocks + MT_DQ_STAT_BLOCK - 1) / MT_DQ_STAT_BLOCK * 4) ||
        !dev_range_ok((CUdeviceptr)(uintptr_t)offset, 4))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    for (unsigned r = 0; r < rows; r++)
        for (unsigned c = 0; c < cols; c++) {
            unsigned long long i = (r0 + r) * I + c0 + c;
            float am = mt_dq_nf4_absmax(qabsmax, absmax2, *offset, maps->q8, i / MT_DQ_BLOCK);
            mt_dq_store(out, dt, r * ld + c, mt_dq_nf4(codes, maps->nf4, am, i));
        }
    return CUDA_SUCCESS;
}

/* dequant.cu's embedding from a quantized table (mt_emb_fwd_q_int8 /
 * _nf4) with dequant.cuh's arithmetic; the table's reads are checked
 * token by token, the rest whole. mu held. */
static CUresult run_emb_q(int nf4, void **p)
{
    void *out = *(void **)p[0];
    int dt = *(const int *)p[1];
    const int *tok = *(const int **)p[2];
    const void *codes = *(const void **)p[3];
    int a = nf4 ? 7 : 5; /* where wpe, T, C, n start */
    const void *wpe = *(const void **)p[a];
    int T = *(const int *)p[a + 1], C = *(const int *)p[a + 2];
    unsigned long long n = *(const unsigned long long *)p[a + 3];
    if (dt < 0 || dt > 2 || T <= 0 || C <= 0 || n % (unsigned long long)C)
        return CUDA_ERROR_INVALID_VALUE;
    size_t es = dt == 0 ? 4 : 2;
    unsigned long long rows = n / (unsigned long long)C;
    if (!dev_range_ok((CUdeviceptr)(uintptr_t)out, n * es) ||
        !dev_range_ok((CUdeviceptr)(uintptr_t)tok, rows * 4) ||
        (wpe && !dev_range_ok((CUdeviceptr)(uintptr_t)wpe,
                              (rows < (unsigned long long)T ? rows : (unsigned long long)T) *
                                  (unsigned long long)C * es)))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    const uint8_t *qabsmax = nf4 ? *(const uint8_t **)p[4] : NULL;
    const float *scale = nf4 ? NULL : *(const float **)p[4];
    const float *absmax2 = nf4 ? *(const float **)p[5] : NULL;
    const float *offset = nf4 ? *(const float **)p[6] : NULL;
    const mt_dq_maps *maps = nf4 ? p[11] : NULL;
    if (nf4 && !dev_range_ok((CUdeviceptr)(uintptr_t)offset, 4)) return CUDA_ERROR_ILLEGAL_ADDRESS;
    for (unsigned long long r = 0; r < rows; r++) {
        if (tok[r] < 0) return CUDA_ERROR_ILLEGAL_ADDRESS;
        unsigned long long e0 = (unsigned long long)tok[r] * (unsigned long long)C, last = e0 + C;
        unsigned long long blocks = (last + MT_DQ_BLOCK - 1) / MT_DQ_BLOCK;
        if (nf4 ? !dev_range_ok((CUdeviceptr)(uintptr_t)codes, (last + 1) / 2) ||
                      !dev_range_ok((CUdeviceptr)(uintptr_t)qabsmax, blocks) ||
                      !dev_range_ok((CUdeviceptr)(uintptr_t)absmax2,
                                    (blocks + MT_DQ_STAT_BLOCK - 1) / MT_DQ_STAT_BLOCK * 4)
                : !dev_range_ok((CUdeviceptr)(uintptr_t)codes, last) ||
                      !dev_range_ok((CUdeviceptr)(uintptr_t)scale, blocks * 4))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        unsigned long long t = r % (unsigned long long)T;
        for (int c = 0; c < C; c++) {
            unsigned long long i = e0 + (unsigned long long)c;
            float v = nf4 ? mt_dq_nf4(codes, maps->nf4,
                                      mt_dq_nf4_absmax(qabsmax, absmax2, *offset, maps->q8,
                                                       i / MT_DQ_BLOCK),
                                      i)
                          : mt_dq_int8(codes, scale, i);
            mt_dq_emb_store(out, dt, r * (unsigned long long)C + (unsigned long long)c, v, wpe,
                            t * (unsigned long long)C + (unsigned long long)c);
        }
    }
    return CUDA_SUCCESS;
}

/* The kernels of kernels/cuda/kernels.cu it knows, run on the host. */
static CUresult run_known(const struct CUfunc_st *f, void **p)
{
    if (strcmp(f->name, "mt_dequant_int8") == 0 || strcmp(f->name, "mt_dequant_nf4") == 0) {
        if (!p) return CUDA_ERROR_INVALID_VALUE;
        return run_dequant(f->name[11] == 'n', p);
    }
    if (strcmp(f->name, "mt_emb_fwd_q_int8") == 0 || strcmp(f->name, "mt_emb_fwd_q_nf4") == 0) {
        if (!p) return CUDA_ERROR_INVALID_VALUE;
        return run_emb_q(f->name[13] == 'n', p);
    }
    if (strcmp(f->name, "mt_fill_f32") == 0) {
        if (!p) return CUDA_ERROR_INVALID_VALUE;
        float *y = *(float **)p[0];
        float v = *(const float *)p[1];
        unsigned long long n = *(const unsigned long long *)p[2];
        if (n > SIZE_MAX / 4 || !dev_range_ok((CUdeviceptr)(uintptr_t)y, n * 4))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        for (unsigned long long i = 0; i < n; i++) y[i] = v;
    } else if (strcmp(f->name, "mt_axpy_f32") == 0) {
        if (!p) return CUDA_ERROR_INVALID_VALUE;
        float *y = *(float **)p[0];
        float a = *(const float *)p[1];
        const float *x = *(const float **)p[2];
        unsigned long long n = *(const unsigned long long *)p[3];
        if (n > SIZE_MAX / 4 || !dev_range_ok((CUdeviceptr)(uintptr_t)y, n * 4) ||
            !dev_range_ok((CUdeviceptr)(uintptr_t)x, n * 4))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        for (unsigned long long i = 0; i < n; i++) y[i] = a * x[i] + y[i];
    } else if (F.sgd && strcmp(f->name, "mt_sgd") == 0) { /* (fp32 weights alone: no compute copy) */
        if (!p) return CUDA_ERROR_INVALID_VALUE;
        float *w = *(float **)p[0], *m = *(float **)p[2];
        const float *g = *(const float **)p[1];
        const void *pc = *(void **)p[3];
        const unsigned long long n = *(const unsigned long long *)p[5];
        const float lr = *(const float *)p[6], mom = *(const float *)p[7], damp1 = *(const float *)p[8];
        const float wd = *(const float *)p[9], scale = *(const float *)p[12];
        const int nesterov = *(const int *)p[10], first = *(const int *)p[11];
        if (pc || n > SIZE_MAX / 4 || !dev_range_ok((CUdeviceptr)(uintptr_t)w, n * 4) ||
            !dev_range_ok((CUdeviceptr)(uintptr_t)g, n * 4) ||
            (m && !dev_range_ok((CUdeviceptr)(uintptr_t)m, n * 4)))
            return pc ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS; /* (a compute copy: not run) */
        for (unsigned long long i = 0; i < n; i++) {
            float d = g[i] * scale + wd * w[i];
            if (m) {
                const float b = first ? d : mom * m[i] + damp1 * d;
                m[i] = b;
                d = nesterov ? d + mom * b : b;
            }
            w[i] = w[i] - lr * d;
        }
    } else if (strcmp(f->name, "mt_accumulate_f32") == 0) {
        if (!p) return CUDA_ERROR_INVALID_VALUE;
        float *y = *(float **)p[0];
        const float *x = *(const float **)p[1];
        unsigned long long n = *(const unsigned long long *)p[2];
        if (n > SIZE_MAX / 4 || !dev_range_ok((CUdeviceptr)(uintptr_t)y, n * 4) ||
            !dev_range_ok((CUdeviceptr)(uintptr_t)x, n * 4))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        for (unsigned long long i = 0; i < n; i++) y[i] += x[i];
    }
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction fn, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                        CUstream stream, void **params, void **extra)
{
    ENTER("cuLaunchKernel");
    if (!have_ctx()) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!fn || fn->magic != FAKE_MAGIC_FUNC || !valid_stream(stream))
        return leave(CUDA_ERROR_INVALID_HANDLE);
    if (!gx || !gy || !gz || !bx || !by || !bz || (unsigned long long)bx * by * bz > 1024 ||
        gy > 65535 || gz > 65535 || shared > 227u * 1024 || (params && extra))
        return leave(CUDA_ERROR_INVALID_VALUE);
    CUresult r = run_known(fn, params);
    if (r == CUDA_SUCCESS) {
        F.launches++;
        strcpy(F.last_kernel, fn->name);
    }
    return leave(r);
}

/* ---- virtual memory management ---- */

static int prop_ok(const CUmemAllocationProp *prop)
{
    return prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
           prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->location.id >= 0 &&
           prop->location.id < F.n_devices && !prop->win32HandleMetaData;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option)
{
    ENTER("cuMemGetAllocationGranularity");
    if (!F.vmm) return leave(CUDA_ERROR_NOT_SUPPORTED);
    if (!granularity || !prop_ok(prop) || option < 0 || option > 1)
        return leave(CUDA_ERROR_INVALID_VALUE);
    *granularity = F.gran;
    return leave(CUDA_SUCCESS);
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t bytes, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    ENTER("cuMemAddressReserve");
    (void)addr; /* a hint only */
    if (!F.vmm) return leave(CUDA_ERROR_NOT_SUPPORTED);
    if (alignment == 0) alignment = F.gran;
    if (!ptr || bytes == 0 || bytes % F.gran || flags || (alignment & (alignment - 1)))
        return leave(CUDA_ERROR_INVALID_VALUE);
    size_t span = bytes + alignment;
    void *m = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    uintptr_t lo = (uintptr_t)m, base = (lo + alignment - 1) & ~(uintptr_t)(alignment - 1);
    /* keep [base, base + bytes), give the rest back */
    if (base > lo) munmap(m, base - lo);
    if (lo + span > base + bytes) munmap((void *)(base + bytes), lo + span - (base + bytes));
    fake_resv *v = VEC_PUSH(F.resvs);
    if (!v) {
        munmap((void *)base, bytes);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *v = (fake_resv){base, bytes};
    *ptr = base;
    return leave(CUDA_SUCCESS);
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t bytes)
{
    ENTER("cuMemAddressFree");
    for (size_t i = 0; i < F.resvs.n; i++) {
        if (F.resvs.v[i].base != ptr) continue;
        if (F.resvs.v[i].bytes != bytes) return leave(CUDA_ERROR_INVALID_VALUE);
        for (size_t k = 0; k < F.maps.n; k++)
            if (F.maps.v[k].at >= ptr && F.maps.v[k].at < ptr + bytes)
                return leave(CUDA_ERROR_INVALID_VALUE); /* still mapped */
        munmap((void *)(uintptr_t)ptr, bytes);
        VEC_DEL(F.resvs, i);
        return leave(CUDA_SUCCESS);
    }
    return leave(CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                     const CUmemAllocationProp *prop, unsigned long long flags)
{
    ENTER("cuMemCreate");
    if (!F.vmm) return leave(CUDA_ERROR_NOT_SUPPORTED);
    if (!handle || !prop_ok(prop) || bytes == 0 || bytes % F.gran || flags)
        return leave(CUDA_ERROR_INVALID_VALUE);
    if (bytes > F.total - F.used) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    fake_phys *h = calloc(1, sizeof *h);
    if (!h) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    h->bytes = bytes;
    F.used += bytes;
    F.n_handles++;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return leave(CUDA_SUCCESS);
}

/* Whether h is a live handle. mu held. Handles are not kept in a table:
 * a released-and-unmapped one is freed, so a stale handle is a test bug the
 * address sanitizer catches. */
static fake_phys *phys_of(CUmemGenericAllocationHandle handle)
{
    fake_phys *h = (fake_phys *)(uintptr_t)handle;
    return h && !h->released ? h : NULL;
}

static void phys_drop(fake_phys *h)
{
    F.used -= h->bytes;
    F.n_handles--;
    free(h);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ENTER("cuMemRelease");
    fake_phys *h = phys_of(handle);
    if (!h) return leave(CUDA_ERROR_INVALID_VALUE);
    /* memory still mapped lives on until unmapped, as with the real driver */
    if (h->mapped) h->released = 1;
    else phys_drop(h);
    return leave(CUDA_SUCCESS);
}

static const fake_resv *resv_holding(CUdeviceptr p, size_t n)
{
    for (size_t i = 0; i < F.resvs.n; i++) {
        const fake_resv *v = &F.resvs.v[i];
        if (p >= v->base && p - v->base <= v->bytes && n <= v->bytes - (p - v->base)) return v;
    }
    return NULL;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t bytes, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    ENTER("cuMemMap");
    fake_phys *h = phys_of(handle);
    if (!h || offset || flags || bytes != h->bytes || ptr % F.gran)
        return leave(CUDA_ERROR_INVALID_VALUE);
    if (!resv_holding(ptr, bytes)) return leave(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < F.maps.n; i++) {
        const fake_map *m = &F.maps.v[i];
        if (ptr < m->at + m->bytes && m->at < ptr + bytes) return leave(CUDA_ERROR_ALREADY_MAPPED);
    }
    if (h->mapped) return leave(CUDA_ERROR_NOT_SUPPORTED); /* host memory cannot alias */
    fake_map *m = VEC_PUSH(F.maps);
    if (!m) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    *m = (fake_map){ptr, bytes, h, 0};
    h->mapped = 1;
    return leave(CUDA_SUCCESS);
}

/* The mappings covering [p, p + n) exactly, or 0 if the range has a hole
 * or cuts a mapping. mu held. */
static int covered_exactly(CUdeviceptr p, size_t n)
{
    CUdeviceptr at = p, end = p + n;
    while (at < end) {
        const fake_map *m = NULL;
        for (size_t i = 0; i < F.maps.n; i++)
            if (F.maps.v[i].at == at) m = &F.maps.v[i];
        if (!m || m->at + m->bytes > end) return 0;
        at += m->bytes;
    }
    return 1;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t bytes)
{
    const int busy = busy_now();
    ENTER("cuMemUnmap");
    F.busy_frees += (unsigned long long)busy;
    if (bytes == 0 || !covered_exactly(ptr, bytes)) return leave(CUDA_ERROR_INVALID_VALUE);
    madvise((void *)(uintptr_t)ptr, bytes, MADV_DONTNEED);
    mprotect((void *)(uintptr_t)ptr, bytes, PROT_NONE);
    for (size_t i = 0; i < F.maps.n;) {
        fake_map *m = &F.maps.v[i];
        if (m->at >= ptr && m->at < ptr + bytes) {
            fake_phys *h = m->h;
            h->mapped = 0;
            if (h->released) phys_drop(h);
            VEC_DEL(F.maps, i);
        } else {
            i++;
        }
    }
    return leave(CUDA_SUCCESS);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t bytes, const CUmemAccessDesc *desc, size_t count)
{
    ENTER("cuMemSetAccess");
    if (!desc || count == 0 || bytes == 0 || !covered_exactly(ptr, bytes))
        return leave(CUDA_ERROR_INVALID_VALUE);
    int rw = 0;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
            desc[i].location.id >= F.n_devices)
            return leave(CUDA_ERROR_INVALID_DEVICE);
        if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) rw = 1;
        else if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE)
            return leave(CUDA_ERROR_INVALID_VALUE);
    }
    if (mprotect((void *)(uintptr_t)ptr, bytes, rw ? PROT_READ | PROT_WRITE : PROT_NONE) != 0)
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    for (size_t i = 0; i < F.maps.n; i++)
        if (F.maps.v[i].at >= ptr && F.maps.v[i].at < ptr + bytes) F.maps.v[i].access = rw;
    return leave(CUDA_SUCCESS);
}

/* ---- error names ---- */

static const struct {
    CUresult code;
    const char *name, *text;
} fake_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_lookup(CUresult err, const char **str, int text)
{
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof fake_errors / sizeof fake_errors[0]; i++) {
        if (fake_errors[i].code == err) {
            *str = text ? fake_errors[i].text : fake_errors[i].name;
            return CUDA_SUCCESS;
        }
    }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult err, const char **str) { return error_lookup(err, str, 0); }
CUresult cuGetErrorString(CUresult err, const char **str) { return error_lookup(err, str, 1); }

/* ---- counters for tests ---- */

/* "used" device bytes taken, "allocs" live cuMemAlloc blocks, "handles" live
 * cuMemCreate handles, "mappings", "reservations", "streams", "modules",
 * "launches", "func_loads", "syncs", "ctx_refs" primary context retains of device 0,
 * "ctx_depth" this thread's context stack depth, "ctx_pushes", "pinned" page-locked
 * host bytes held, "pinned_allocs" their blocks, "events" live events, "stream_waits"
 * cuStreamWaitEvent calls, "busy_frees" cuMemFree_v2 and cuMemUnmap calls made while the
 * calling thread's NCCL work was not done (see the top). Unknown: ~0. */
unsigned long long fake_cuda_stat(const char *name)
{
    unsigned long long v = ~0ull;
    pthread_mutex_lock(&mu);
    if (!strcmp(name, "used")) v = F.used;
    else if (!strcmp(name, "allocs")) v = F.allocs.n;
    else if (!strcmp(name, "handles")) v = F.n_handles;
    else if (!strcmp(name, "mappings")) v = F.maps.n;
    else if (!strcmp(name, "reservations")) v = F.resvs.n;
    else if (!strcmp(name, "streams")) v = F.n_streams;
    else if (!strcmp(name, "modules")) v = F.n_modules;
    else if (!strcmp(name, "launches")) v = F.launches;
    else if (!strcmp(name, "func_loads")) v = F.func_loads;
    else if (!strcmp(name, "syncs")) v = F.syncs;
    else if (!strcmp(name, "stream_waits")) v = F.stream_waits;
    else if (!strcmp(name, "busy_frees")) v = F.busy_frees;
    else if (!strcmp(name, "spin_syncs")) v = F.spin_syncs;
    else if (!strcmp(name, "ctx_refs")) v = (unsigned long long)F.ctx[0].refs;
    else if (!strcmp(name, "ctx_depth")) v = (unsigned long long)tls_depth;
    else if (!strcmp(name, "ctx_pushes")) v = F.ctx_pushes;
    else if (!strcmp(name, "pinned")) v = F.pinned_used;
    else if (!strcmp(name, "pinned_allocs")) v = F.pinned.n;
    else if (!strcmp(name, "events")) v = F.n_events;
    pthread_mutex_unlock(&mu);
    return v;
}

const char *fake_cuda_last_kernel(void) { return F.last_kernel; }
