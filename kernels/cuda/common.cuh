/*
 * common.cuh - what every kernel of kernels/cuda shares: the storage types,
 * the conversions between fp32 and fp16/bf16 bits, the stochastic-rounding
 * hash, warp and block reductions, and the macro that exports a kernel once
 * per storage dtype.
 *
 * The conversions (scalar.cuh) are the ones of lib/ops/kctx.c, bit for bit,
 * and plain C too, so host code runs them as the kernels do.
 */
#ifndef MT_CUDA_COMMON_CUH
#define MT_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#ifndef __CUDA_ARCH__
#include <string.h>
#endif

/* Index type for element loops: counts go past 2^32 elements. */
typedef unsigned long long mt_index;

/* Storage dtypes, numbered as lib/internal.h's mti_dtype (the host passes
 * them as int). */
enum { MT_DT_F32 = 0, MT_DT_F16 = 1, MT_DT_BF16 = 2 };

#define MT_FULL_MASK 0xffffffffu

/* ---- scalar conversions (lib/ops/kctx.c): scalar.cuh ---- */

#include "scalar.cuh"

/* ---- loads and stores of one element of a storage dtype, as fp32 ---- */

__device__ __forceinline__ float mt_ld(const float *p, mt_index i) { return p[i]; }
__device__ __forceinline__ float mt_ld(const __half *p, mt_index i)
{
    return mt_f16_to_f32(__half_as_ushort(p[i]));
}
__device__ __forceinline__ float mt_ld(const __nv_bfloat16 *p, mt_index i)
{
    return mt_bf16_to_f32(__bfloat16_as_ushort(p[i]));
}

__device__ __forceinline__ void mt_st(float *p, mt_index i, float v) { p[i] = v; }
__device__ __forceinline__ void mt_st(__half *p, mt_index i, float v)
{
    p[i] = __ushort_as_half(mt_f32_to_f16(v));
}
__device__ __forceinline__ void mt_st(__nv_bfloat16 *p, mt_index i, float v)
{
    p[i] = __ushort_as_bfloat16(mt_f32_to_bf16(v));
}

/* ---- reductions, in a fixed order ---- */

/* Sum over the G consecutive lanes of a group (G a power of two <= 32) by
 * an xor butterfly: each step adds two values whose sum is the same bits
 * either way round, so every lane of the group ends with the same total.
 * All 32 lanes of the warp must take part. */
template <int G> __device__ __forceinline__ float mt_group_sum(float v)
{
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(MT_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float mt_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MT_FULL_MASK, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024): warps by
 * butterfly, then the warp totals in warp order. Every thread gets the
 * total. `sh` is 32 floats of shared memory, free to reuse after return. */
__device__ __forceinline__ float mt_block_sum(float v, float *sh)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = mt_group_sum<32>(v);
    __syncthreads(); /* sh may still be read from a previous call */
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    return mt_group_sum<32>(v);
}

/* Maximum over the block, as mt_block_sum (max is exact, so the order
 * only has to be fixed for NaN, which fmaxf drops). */
__device__ __forceinline__ float mt_block_max(float v, float *sh)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = mt_warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : -INFINITY;
    return mt_warp_max(v);
}

/* ---- one kernel per storage dtype ----
 *
 * Kernels take dt tensors as void pointers and are written once as a
 * __device__ template over the storage type; MT_EXPORT_DT makes the three
 * extern "C" entry points NAME_f32, NAME_f16 and NAME_bf16 (in that order in
 * lib/device/cuda_device.h, so the host adds the mti_dtype to the first id).
 * BOUNDS is the most threads a block of the kernel is launched with. */
#define MT_EXPORT_DT(NAME, BOUNDS, BODY, PARAMS, ARGS)                                          \
    extern "C" __global__ void __launch_bounds__(BOUNDS) NAME##_f32 PARAMS                      \
    {                                                                                          \
        BODY<float> ARGS;                                                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(BOUNDS) NAME##_f16 PARAMS                      \
    {                                                                                          \
        BODY<__half> ARGS;                                                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(BOUNDS) NAME##_bf16 PARAMS                     \
    {                                                                                          \
        BODY<__nv_bfloat16> ARGS;                                                              \
    }

/* Grid-stride loop over [0, n). */
#define MT_FOR_EACH(i, n)                                                                      \
    for (mt_index i = (mt_index)blockIdx.x * blockDim.x + threadIdx.x,                         \
                  i##_stride = (mt_index)gridDim.x * blockDim.x;                               \
         i < (n); i += i##_stride)

#endif /* MT_CUDA_COMMON_CUH */
