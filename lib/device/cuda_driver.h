/*
 * cuda_driver.h - the part of the CUDA Driver API memtrain calls, declared
 * here so the library builds where no CUDA toolkit is installed.
 *
 * The driver (libcuda.so.1) is opened with dlopen at run time and every
 * entry point is looked up by name, so nothing here is linked against. The
 * types and values follow the driver's documented, stable C ABI (64-bit
 * Linux): handles are pointers to opaque driver structs, a device is an int
 * ordinal, a device address is a 64-bit integer. Where the driver exports
 * several versions of a call, the name looked up is the one with the size_t /
 * 64-bit pointer signature declared below (noted beside each typedef).
 *
 * Only what the library and the test driver (test/fake_cuda) need is here;
 * grow it as more calls are used.
 */
#ifndef MT_CUDA_DRIVER_H
#define MT_CUDA_DRIVER_H

#include <stddef.h>

/* ---- handles and scalars ---- */

typedef int CUresult;                  /* 0 is success; see the CUDA_* codes below */
typedef int CUdevice;                  /* a device ordinal as the driver numbers them */
typedef unsigned long long CUdeviceptr; /* a device virtual address */
typedef unsigned long long CUmemGenericAllocationHandle; /* physical memory from cuMemCreate */

typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUevent_st *CUevent;

/* ---- result codes (the ones the library tells apart, and the ones the test
 * driver returns; any other value is reported by the driver's own name).
 * These are the Driver API's CUresult values, which differ from the CUDA
 * runtime's cudaError_t numbering (there, 35 is an insufficient driver; the
 * driver says that with 803 or 804 instead). ---- */

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_STUB_LIBRARY = 34,       /* the toolkit's link-time stub, not a driver */
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ALREADY_MAPPED = 208,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_NOT_MAPPED = 211,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_JIT_COMPILER_NOT_FOUND = 221,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_LAUNCH_TIMEOUT = 702,
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715,
    CUDA_ERROR_MISALIGNED_ADDRESS = 716,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_SYSTEM_NOT_READY = 802,
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,        /* libcuda and the kernel module differ */
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804, /* a forward-compatibility libcuda on a
                                                        GPU that does not take one */
    CUDA_ERROR_UNKNOWN = 999
};

/* ---- device attributes (cuDeviceGetAttribute) ---- */

typedef int CUdevice_attribute;
enum {
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
};

/* cuStreamCreate flags: work on the stream does not wait for the legacy
 * default stream (and the other way round). */
enum { CU_STREAM_DEFAULT = 0x0, CU_STREAM_NON_BLOCKING = 0x1 };

/* ---- virtual memory management (cuMemCreate / cuMemMap family) ---- */

typedef int CUmemAllocationType;
enum { CU_MEM_ALLOCATION_TYPE_PINNED = 0x1 }; /* device memory that is never migrated */

typedef int CUmemAllocationHandleType;
enum { CU_MEM_HANDLE_TYPE_NONE = 0x0 }; /* not exportable to other processes */

typedef int CUmemLocationType;
enum { CU_MEM_LOCATION_TYPE_DEVICE = 0x1 }; /* id is a device ordinal */

typedef int CUmemAccess_flags;
enum { CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3 };

typedef int CUmemAllocationGranularity_flags;
enum { CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1 };

/* Where memory lives: 8 bytes. */
typedef struct CUmemLocation {
    CUmemLocationType type;
    int id;
} CUmemLocation;

/* What cuMemCreate makes: 32 bytes. Every field not set must be zero. */
typedef struct CUmemAllocationProp {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData; /* Windows only; NULL */
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

/* Who may access a mapped range, and how: 12 bytes. */
typedef struct CUmemAccessDesc {
    CUmemLocation location;
    CUmemAccess_flags flags;
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation ABI");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp ABI");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc ABI");

/* ---- entry points: pointer types, one per symbol looked up ---- */

typedef CUresult (*PFN_cuInit)(unsigned int flags); /* flags must be 0 */
typedef CUresult (*PFN_cuDriverGetVersion)(int *version); /* 1000*major + 10*minor */
typedef CUresult (*PFN_cuDeviceGetCount)(int *count);
typedef CUresult (*PFN_cuDeviceGet)(CUdevice *dev, int ordinal);
typedef CUresult (*PFN_cuDeviceGetName)(char *name, int len, CUdevice dev);
typedef CUresult (*PFN_cuDeviceTotalMem)(size_t *bytes, CUdevice dev); /* "_v2" */
typedef CUresult (*PFN_cuDeviceGetAttribute)(int *value, CUdevice_attribute attr, CUdevice dev);

typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice dev);
typedef CUresult (*PFN_cuDevicePrimaryCtxRelease)(CUdevice dev); /* "_v2" */
typedef CUresult (*PFN_cuCtxSetCurrent)(CUcontext ctx);
typedef CUresult (*PFN_cuCtxPushCurrent)(CUcontext ctx); /* "_v2" */
typedef CUresult (*PFN_cuCtxPopCurrent)(CUcontext *ctx); /* "_v2" */

typedef CUresult (*PFN_cuMemAlloc)(CUdeviceptr *dptr, size_t bytes); /* "_v2" */
typedef CUresult (*PFN_cuMemFree)(CUdeviceptr dptr);                  /* "_v2" */
typedef CUresult (*PFN_cuMemGetInfo)(size_t *free_bytes, size_t *total_bytes); /* "_v2" */
typedef CUresult (*PFN_cuMemcpyHtoDAsync)(CUdeviceptr dst, const void *src, size_t bytes,
                                          CUstream stream); /* "_v2" */
typedef CUresult (*PFN_cuMemcpyDtoHAsync)(void *dst, CUdeviceptr src, size_t bytes,
                                          CUstream stream); /* "_v2" */
typedef CUresult (*PFN_cuMemcpyDtoDAsync)(CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                                          CUstream stream); /* "_v2" */
typedef CUresult (*PFN_cuMemsetD8Async)(CUdeviceptr dst, unsigned char value, size_t bytes,
                                        CUstream stream);

typedef CUresult (*PFN_cuStreamCreate)(CUstream *stream, unsigned int flags);
typedef CUresult (*PFN_cuStreamSynchronize)(CUstream stream);
typedef CUresult (*PFN_cuStreamDestroy)(CUstream stream); /* "_v2" */

/* Page-locked host memory: with unified addressing (every 64-bit Linux
 * system) it is accessible from the device at the same address, so copies
 * to and from it may name it as device memory too. flags: 0 here. */
/* A copy between any two addresses of the unified address space (the
 * driver infers the direction). */
typedef CUresult (*PFN_cuMemcpyAsync)(CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                                      CUstream stream);
typedef CUresult (*PFN_cuMemHostAlloc)(void **ptr, size_t bytes, unsigned int flags);
typedef CUresult (*PFN_cuMemFreeHost)(void *ptr);

/* Events: recorded on a stream, waited for by the host. flags: 0, or
 * CU_EVENT_DISABLE_TIMING, and CU_EVENT_BLOCKING_SYNC (a host thread
 * waiting in cuEventSynchronize sleeps instead of spinning). */
enum { CU_EVENT_DEFAULT = 0x0, CU_EVENT_BLOCKING_SYNC = 0x1, CU_EVENT_DISABLE_TIMING = 0x2 };
typedef CUresult (*PFN_cuEventCreate)(CUevent *event, unsigned int flags);
typedef CUresult (*PFN_cuEventRecord)(CUevent event, CUstream stream);
typedef CUresult (*PFN_cuEventSynchronize)(CUevent event);
/* CUDA_SUCCESS once the event's work is done, 600 (not ready) before. */
typedef CUresult (*PFN_cuEventQuery)(CUevent event);
typedef CUresult (*PFN_cuEventDestroy)(CUevent event); /* "_v2" */
/* Milliseconds between two recorded, completed events, neither made with
 * CU_EVENT_DISABLE_TIMING. */
typedef CUresult (*PFN_cuEventElapsedTime)(float *ms, CUevent start, CUevent end);
/* Work queued on stream after the call waits for the event's work (an
 * event never recorded: no wait). flags: 0. */
typedef CUresult (*PFN_cuStreamWaitEvent)(CUstream stream, CUevent event, unsigned int flags);

typedef CUresult (*PFN_cuModuleLoadData)(CUmodule *module, const void *image);
typedef CUresult (*PFN_cuModuleGetFunction)(CUfunction *fn, CUmodule module, const char *name);
typedef CUresult (*PFN_cuModuleUnload)(CUmodule module);
/* Loads a function's code onto the device now (CUDA 12.4 and later): with
 * lazy module loading, the driver's default, code is otherwise loaded, and
 * device memory taken, at the function's first launch. */
typedef CUresult (*PFN_cuFuncLoad)(CUfunction fn);
/* params: one pointer per kernel argument, each to the argument's value;
 * extra: NULL (the other way of passing arguments, unused here). */
typedef CUresult (*PFN_cuLaunchKernel)(CUfunction fn, unsigned int grid_x, unsigned int grid_y,
                                       unsigned int grid_z, unsigned int block_x,
                                       unsigned int block_y, unsigned int block_z,
                                       unsigned int shared_bytes, CUstream stream,
                                       void **params, void **extra);

/* alignment 0 = the driver's default; addr 0 = anywhere; flags 0 */
typedef CUresult (*PFN_cuMemAddressReserve)(CUdeviceptr *ptr, size_t bytes, size_t alignment,
                                            CUdeviceptr addr, unsigned long long flags);
typedef CUresult (*PFN_cuMemAddressFree)(CUdeviceptr ptr, size_t bytes);
typedef CUresult (*PFN_cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t bytes,
                                    const CUmemAllocationProp *prop, unsigned long long flags);
typedef CUresult (*PFN_cuMemRelease)(CUmemGenericAllocationHandle handle);
/* offset into the handle's memory must be 0; flags 0 */
typedef CUresult (*PFN_cuMemMap)(CUdeviceptr ptr, size_t bytes, size_t offset,
                                 CUmemGenericAllocationHandle handle, unsigned long long flags);
typedef CUresult (*PFN_cuMemUnmap)(CUdeviceptr ptr, size_t bytes);
typedef CUresult (*PFN_cuMemSetAccess)(CUdeviceptr ptr, size_t bytes, const CUmemAccessDesc *desc,
                                       size_t count);
typedef CUresult (*PFN_cuMemGetAllocationGranularity)(size_t *granularity,
                                                      const CUmemAllocationProp *prop,
                                                      CUmemAllocationGranularity_flags option);

/* *str points to a constant string owned by the driver. */
typedef CUresult (*PFN_cuGetErrorName)(CUresult err, const char **str);
typedef CUresult (*PFN_cuGetErrorString)(CUresult err, const char **str);

#endif /* MT_CUDA_DRIVER_H */
