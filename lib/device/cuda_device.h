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

#include <stdbool.h>
#include <stdint.h>

#include "device/device.h"

/* A loaded module and a kernel function in it (driver handles, opaque). */
typedef struct mti_cuda_module mti_cuda_module;
typedef struct mti_cuda_fn mti_cuda_fn;

typedef struct mti_dim3 {
    unsigned int x, y, z;
} mti_dim3;

/* The kernels of kernels/cuda, by their extern "C" names: X(ID, "name")
 * for each. A kernel over tensors of a storage dtype comes three times,
 * NAME_f32, NAME_f16, NAME_bf16, with consecutive ids in mti_dtype order, so
 * the op table takes the one for dt as ID_F32 + dt. Parameters are listed
 * beside each kernel in kernels/cuda. */
#define MTI_CUDA_DT3(X, ID, NAME) X(ID##_F32, NAME "_f32") X(ID##_F16, NAME "_f16") \
    X(ID##_BF16, NAME "_bf16")
#define MTI_CUDA_KERNELS(X)                                                                    \
    X(MTI_CUDA_FILL_F32, "mt_fill_f32") /* (float *y, float value, uint64_t n) */             \
    X(MTI_CUDA_AXPY_F32, "mt_axpy_f32") /* (float *y, float a, const float *x, uint64_t n) */ \
    X(MTI_CUDA_CAST, "mt_cast")                                                                \
    MTI_CUDA_DT3(X, MTI_CUDA_GELU_FWD, "mt_gelu_fwd")                                          \
    MTI_CUDA_DT3(X, MTI_CUDA_GELU_BWD, "mt_gelu_bwd")                                          \
    MTI_CUDA_DT3(X, MTI_CUDA_RELU_FWD, "mt_relu_fwd")                                          \
    MTI_CUDA_DT3(X, MTI_CUDA_RELU_BWD, "mt_relu_bwd")                                          \
    MTI_CUDA_DT3(X, MTI_CUDA_ADD, "mt_add")                                                    \
    MTI_CUDA_DT3(X, MTI_CUDA_ACCUMULATE, "mt_accumulate")                                      \
    MTI_CUDA_DT3(X, MTI_CUDA_BIAS_ROWS, "mt_bias_rows")                                        \
    MTI_CUDA_DT3(X, MTI_CUDA_EMB_FWD, "mt_emb_fwd")                                            \
    MTI_CUDA_DT3(X, MTI_CUDA_EMB_FWD_ROWS, "mt_emb_fwd_rows")                                  \
    X(MTI_CUDA_EMB_HASH, "mt_emb_hash")                                                        \
    X(MTI_CUDA_EMB_SCAN, "mt_emb_scan")                                                        \
    X(MTI_CUDA_EMB_FILL, "mt_emb_fill")                                                        \
    X(MTI_CUDA_EMB_RANK, "mt_emb_rank")                                                        \
    MTI_CUDA_DT3(X, MTI_CUDA_EMB_BWD_WTE, "mt_emb_bwd_wte")                                    \
    MTI_CUDA_DT3(X, MTI_CUDA_LN_FWD, "mt_ln_fwd")                                              \
    MTI_CUDA_DT3(X, MTI_CUDA_LN_BWD_DX, "mt_ln_bwd_dx")                                        \
    MTI_CUDA_DT3(X, MTI_CUDA_LN_BWD_DWDB, "mt_ln_bwd_dwdb")                                    \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_FWD_32, "mt_attn_fwd_32")                                    \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_FWD_64, "mt_attn_fwd_64")                                    \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_FWD_128, "mt_attn_fwd_128")                                  \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_FWD_256, "mt_attn_fwd_256")                                  \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_BWD_Q_32, "mt_attn_bwd_q_32")                                \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_BWD_Q_64, "mt_attn_bwd_q_64")                                \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_BWD_Q_128, "mt_attn_bwd_q_128")                              \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_BWD_Q_256, "mt_attn_bwd_q_256")                              \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_BWD_KV_32, "mt_attn_bwd_kv_32")                              \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_BWD_KV_64, "mt_attn_bwd_kv_64")                              \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_BWD_KV_128, "mt_attn_bwd_kv_128")                            \
    MTI_CUDA_DT3(X, MTI_CUDA_ATTN_BWD_KV_256, "mt_attn_bwd_kv_256")                            \
    X(MTI_CUDA_ATTN_TC_FWD_F16, "mt_attn_tc_fwd_f16")                                          \
    X(MTI_CUDA_ATTN_TC_FWD_BF16, "mt_attn_tc_fwd_bf16")                                        \
    X(MTI_CUDA_ATTN_TC_BWD_Q_F16, "mt_attn_tc_bwd_q_f16")                                      \
    X(MTI_CUDA_ATTN_TC_BWD_Q_BF16, "mt_attn_tc_bwd_q_bf16")                                    \
    X(MTI_CUDA_ATTN_TC_BWD_KV_F16, "mt_attn_tc_bwd_kv_f16")                                    \
    X(MTI_CUDA_ATTN_TC_BWD_KV_BF16, "mt_attn_tc_bwd_kv_bf16")                                  \
    MTI_CUDA_DT3(X, MTI_CUDA_XENT, "mt_xent")                                                  \
    MTI_CUDA_DT3(X, MTI_CUDA_XENT_KD, "mt_xent_kd")                                            \
    MTI_CUDA_DT3(X, MTI_CUDA_XENT_VP, "mt_xent_vp")                                            \
    MTI_CUDA_DT3(X, MTI_CUDA_COLSUM, "mt_colsum")                                              \
    X(MTI_CUDA_COLSUM_FINISH, "mt_colsum_finish")                                              \
    X(MTI_CUDA_SUMSQ_BLOCKS, "mt_sumsq_blocks")                                                \
    X(MTI_CUDA_SUMSQ_ROUNDS, "mt_sumsq_rounds")                                                \
    X(MTI_CUDA_SUMSQ_TOTAL, "mt_sumsq_total")                                                  \
    X(MTI_CUDA_UNSCALE_CHECK, "mt_unscale_check")                                              \
    X(MTI_CUDA_SGD, "mt_sgd")                                                                  \
    X(MTI_CUDA_ADAMW, "mt_adamw")                                                              \
    X(MTI_CUDA_ADAMW8, "mt_adamw8")                                                            \
    X(MTI_CUDA_ADAMW4_MAXIMA, "mt_adamw4_maxima")                                              \
    X(MTI_CUDA_ADAMW4, "mt_adamw4")                                                            \
    X(MTI_CUDA_AF_PARTIALS, "mt_af_partials")                                                  \
    X(MTI_CUDA_AF_FINISH, "mt_af_finish")                                                      \
    X(MTI_CUDA_AF_ROWS, "mt_af_rows")                                                          \
    X(MTI_CUDA_AF_COLS, "mt_af_cols")                                                          \
    X(MTI_CUDA_AF_UPD, "mt_af_upd")                                                            \
    X(MTI_CUDA_AF_APPLY, "mt_af_apply")                                                        \
    X(MTI_CUDA_DEQUANT_INT8, "mt_dequant_int8")                                                \
    X(MTI_CUDA_DEQUANT_NF4, "mt_dequant_nf4")                                                  \
    X(MTI_CUDA_SP_EXPAND, "mt_sp_expand") /* (void *dense, vals, meta, mt_sp_desc, int es) */ \
    X(MTI_CUDA_SP_COMPRESS, "mt_sp_compress") /* (vals, dense, meta, mt_sp_desc, es, int add) */ \
    X(MTI_CUDA_EMB_FWD_Q_INT8, "mt_emb_fwd_q_int8")                                            \
    X(MTI_CUDA_EMB_FWD_Q_NF4, "mt_emb_fwd_q_nf4")

typedef enum mti_cuda_kernel_id {
#define MTI_CUDA_KERNEL_ENUM(id, name) id,
    MTI_CUDA_KERNELS(MTI_CUDA_KERNEL_ENUM)
#undef MTI_CUDA_KERNEL_ENUM
    MTI_CUDA_KERNEL_COUNT
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
 * pointers are passed as the address of a void * / float * variable). In
 * debug mode it waits for the kernel and a failure names it. */
mt_status mti_cuda_launch(mti_device *d, mti_cuda_fn *fn, mti_dim3 grid, mti_dim3 block,
                          unsigned int shared_bytes, void **args);

/* 1 when the device runs in debug mode (mt_context_config.cuda_debug_sync
 * or MT_CUDA_DEBUG_SYNC=1): mti_cuda_launch then waits for each kernel and
 * names it in a failure; callers add what they know (the op, its shapes). */
int mti_cuda_debug_sync(const mti_device *d);

/* The device's stream (a CUstream), for libraries that queue work on it
 * themselves (cuBLASLt); NULL on another device. */
void *mti_cuda_stream(mti_device *d);

/* Makes the device's primary context current on the calling thread until
 * mti_cuda_leave (calls into CUDA libraries need it current); nests. */
mt_status mti_cuda_enter(mti_device *d);
void mti_cuda_leave(mti_device *d);

/* Where cuBLASLt is looked for when neither mt_context_config.cublaslt_path
 * nor MT_CUBLASLT_PATH names one (cuda_search.c), in order: the sonames
 * libcublasLt.so.13 and .12 on the loader's path; then in lib64/ and lib/
 * of $CUDA_HOME, $CUDA_PATH and /usr/local/cuda; then in the nvidia/cu13/lib
 * and nvidia/cublas/lib folders of the site-packages of the python3 on PATH
 * (as found, then with links resolved) and of ~/.local. Writes up to max
 * paths to out; returns how many. */
#define MTI_LT_PATH 512
#define MTI_LT_CANDIDATES 40
size_t mti_cublaslt_candidates(char (*out)[MTI_LT_PATH], size_t max);
/* The same for NCCL (lib/comm/nccl.c): libnccl.so.2 on the loader's path,
 * in the toolkit's lib64/ and lib/, and in the wheels' nvidia/nccl/lib. */
size_t mti_nccl_candidates(char (*out)[MTI_LT_PATH], size_t max);

/* 1 when the device runs on the libcuda.so.1 the process would load by that
 * name, the driver the CUDA runtime inside CUDA libraries (cuBLASLt) talks
 * to; 0 for a driver opened from another path (the tests' stand-in). */
int mti_cuda_is_system_driver(mti_device *d);

/* Host-side state of the op table for one device (a cuBLASLt handle, plans):
 * attached once, freed by free_fn when the device closes, with the device's
 * context current and before its stream and memory go. Returns the state
 * attached after the call: `state` if none was, else the one attached
 * before (the caller then frees its own). NULL on another device. */
void *mti_cuda_attach(mti_device *d, void *state, void (*free_fn)(mti_device *d, void *state));
/* The attached state, or NULL. */
void *mti_cuda_attached(mti_device *d);

/* Page-locked host memory (cuMemHostAlloc): bytes the host and the device
 * both reach at the same address (unified addressing), so every copy of
 * the device layer takes it. Refused: MT_ERR_OOM naming the amount. */
mt_status mti_cuda_host_alloc(mti_device *d, size_t bytes, void **out);
void mti_cuda_host_free(mti_device *d, void *p);
/* Events (no timing) to know from the host when queued work is done. */
mt_status mti_cuda_event_new(mti_device *d, void **ev);
void mti_cuda_event_free(mti_device *d, void *ev);
/* Queues a copy of bytes from src to dst (device or page-locked host
 * addresses) on the main stream (side 0: ordered with the kernels) or on a
 * second stream (side 1: beside them), then records ev (NULL: none) there. */
mt_status mti_cuda_copy_async(mti_device *d, int side, void *dst, const void *src, size_t bytes,
                              void *ev);
/* Waits on the host for an event, or for everything on the second stream. */
mt_status mti_cuda_event_wait(mti_device *d, void *ev);
mt_status mti_cuda_side_sync(mti_device *d);
/* A stream of the caller's own (non-blocking, like the device's), for work
 * beside the kernels that events order against them (NCCL's communication
 * stream, comm/nccl_overlap.c); freed with its work still ending. */
mt_status mti_cuda_stream_new(mti_device *d, void **stream);
void mti_cuda_stream_free(mti_device *d, void *stream);
/* An event that times (cuEventElapsedTime); free it with mti_cuda_event_free. */
mt_status mti_cuda_event_new_timed(mti_device *d, void **ev);
/* Records ev on stream (NULL: the device's stream). */
mt_status mti_cuda_record(mti_device *d, void *ev, void *stream);
/* Work queued on stream (NULL: the device's) after the call waits for ev. */
mt_status mti_cuda_stream_wait(mti_device *d, void *stream, void *ev);
/* Whether ev's work is done (never waits; an event never recorded is). */
mt_status mti_cuda_event_done(mti_device *d, void *ev, bool *done);
/* Milliseconds from timed event start to end, both recorded and done. */
mt_status mti_cuda_elapsed(mti_device *d, void *start, void *end, float *ms);

/* Convenience launchers for the built-in kernels, on the device's stream.
 * y and x are device addresses of n floats. */
mt_status mti_cuda_fill_f32(mti_device *d, float *y, float value, uint64_t n);
mt_status mti_cuda_axpy_f32(mti_device *d, float *y, float a, const float *x, uint64_t n);

#endif /* MT_CUDA_DEVICE_H */
