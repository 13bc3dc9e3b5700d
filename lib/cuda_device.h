/*
 * cuda_device.h - kernel issue on a CUDA device (device_cuda.c).
 *
 * The CUDA device of a context loads the kernels built into the library
 * (kernels/cuda, embedded as a fatbin when the library was built with nvcc)
 * when it opens; the op table gets them with mti_cuda_kernel and queues them
 * on the device's stream with mti_cuda_launch. Other modules (e.g. kernels
 * generated at run time) can be loaded from an image with
 * mti_cuda_module_load.
 *
 * Every function here takes a device opened by mti_device_cuda_open (kind
 * MT_DEVICE_CUDA); on another device it returns MT_ERR_INVALID_ARG. Failures
 * are recorded on the device's context with mti_fail. Launches are
 * asynchronous: a failure inside a kernel shows at the next sync.
 */
#ifndef MT_CUDA_DEVICE_H
#define MT_CUDA_DEVICE_H

#include <stdint.h>

#include "device.h"

/* A loaded module and a kernel function in it (driver handles, opaque). */
typedef struct mti_cuda_module mti_cuda_module;
typedef struct mti_cuda_fn mti_cuda_fn;

typedef struct mti_dim3 {
    unsigned int x, y, z;
} mti_dim3;

/* The kernels of kernels/cuda, by their extern "C" names. */
typedef enum mti_cuda_kernel_id {
    MTI_CUDA_FILL_F32 = 0, /* mt_fill_f32(float *y, float value, uint64_t n) */
    MTI_CUDA_AXPY_F32 = 1, /* mt_axpy_f32(float *y, float a, const float *x, uint64_t n) */
    MTI_CUDA_KERNEL_COUNT = 2
} mti_cuda_kernel_id;

/* The extern "C" name of a built-in kernel; NULL for an id out of range. */
const char *mti_cuda_kernel_name(mti_cuda_kernel_id k);

/* Whether the device has the built-in kernels (the library was built with
 * nvcc and the module loaded). */
int mti_cuda_has_kernels(const mti_device *d);

/* The device's compute capability, e.g. 9 and 0 for an H100. */
mt_status mti_cuda_compute_capability(mti_device *d, int *major, int *minor);

/* A built-in kernel of the device. MT_ERR_UNSUPPORTED, with the reason, when
 * the library was built without CUDA kernels or the driver could not load
 * them (the device still serves memory and copies then). */
mt_status mti_cuda_kernel(mti_device *d, mti_cuda_kernel_id k, mti_cuda_fn **out);

/* Loads a module from an image in memory (cubin, fatbin or NUL-terminated
 * PTX; the driver copies what it needs, so the image may be freed after). */
mt_status mti_cuda_module_load(mti_device *d, const void *image, mti_cuda_module **out);
/* Unloads a module; its functions become invalid. NULL is accepted. */
void mti_cuda_module_unload(mti_device *d, mti_cuda_module *m);
/* A kernel of a module by its (extern "C") name. A name the module does not
 * have is MT_ERR_INVALID_ARG, with the name in the message. */
mt_status mti_cuda_module_function(mti_device *d, mti_cuda_module *m, const char *name,
                                   mti_cuda_fn **out);

/* Queues fn on the device's stream: grid blocks of block threads, with
 * shared_bytes of dynamic shared memory per block. args holds one pointer
 * per kernel parameter, to a value of exactly the parameter's type (device
 * pointers are passed as the address of a void * / float * variable). */
mt_status mti_cuda_launch(mti_device *d, mti_cuda_fn *fn, mti_dim3 grid, mti_dim3 block,
                          unsigned int shared_bytes, void **args);

/* Convenience launchers for the built-in kernels, on the device's stream.
 * y and x are device addresses of n floats. */
mt_status mti_cuda_fill_f32(mti_device *d, float *y, float value, uint64_t n);
mt_status mti_cuda_axpy_f32(mti_device *d, float *y, float a, const float *x, uint64_t n);

#endif /* MT_CUDA_DEVICE_H */
