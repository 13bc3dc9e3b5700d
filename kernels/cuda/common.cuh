/*
 * common.cuh - what every kernel of kernels/cuda shares: the storage types,
 * the conversions between fp32 and fp16/bf16 bits, the stochastic-rounding
 * hash, warp and block reductions, and the macro that exports a kernel once
 * per storage dtype.
 *
 * The conversions are the ones of lib/kctx.c, bit for bit (the CPU table
 * and the golden vectors follow that file): round to nearest even, fp16
 * overflow to inf from 65520 up, NaN kept NaN with kctx's bits (fp16: sign |
 * 0x7E00; bf16: the top half with the quiet bit set), and bf16 stochastic
 * rounding from mti_sr_bits(seed, element index). They are integer code, not
 * the hardware cvt instructions, because those write a canonical NaN
 * (0x7FFF) where kctx keeps the sign and payload; integer work is free in
 * kernels bound by memory. The exception is fp32 -> fp16 on the device,
 * whose integer code is long enough to slow the fp16 kernels: there the
 * hardware conversion (the same bits) runs, NaN handled apart. The
 * functions are __host__ __device__ so a host program can check them
 * against kctx.c over every input.
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

/* ---- scalar conversions (lib/kctx.c) ---- */

__host__ __device__ __forceinline__ uint32_t mt_bits_of(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

__host__ __device__ __forceinline__ float mt_float_of(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* fp32 -> bf16 bits, nearest even: add half an ulp of the kept part (plus
 * one if the kept part is odd) and truncate; overflow carries into inf. */
__host__ __device__ __forceinline__ uint16_t mt_f32_to_bf16(float f)
{
    uint32_t u = mt_bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp32 -> bf16 bits, stochastic: rnd's low 16 bits are added below the kept
 * part, so the value rounds up with probability equal to the dropped
 * fraction. inf stays inf. */
__host__ __device__ __forceinline__ uint16_t mt_f32_to_bf16_sr(float f, uint32_t rnd)
{
    uint32_t u = mt_bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)(u >> 16);
    u += rnd & 0xFFFFu;
    return (uint16_t)(u >> 16);
}

__host__ __device__ __forceinline__ float mt_bf16_to_f32(uint16_t h)
{
    return mt_float_of((uint32_t)h << 16);
}

/* fp32 -> fp16 bits, nearest even. Below 2^-14 the result is subnormal, in
 * steps of 2^-24; from 65520 up it is inf. */
__host__ __device__ __forceinline__ uint16_t mt_f32_to_f16(float f)
{
#ifdef __CUDA_ARCH__
    /* on the device, the hardware's conversion (IEEE nearest even, the
     * same bits) but for NaN, whose payload it does not keep */
    if (f != f) return (uint16_t)(((mt_bits_of(f) >> 16) & 0x8000u) | 0x7E00u);
    return __half_as_ushort(__float2half_rn(f));
#endif
    uint32_t u = mt_bits_of(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
    if (a < 0x38800000u) {
        if (a < 0x33000000u) return (uint16_t)sign; /* below 2^-25: to zero */
        /* the value is mant * 2^(e-150); in units of 2^-24 that is mant
         * shifted right by 126 - e, rounded to nearest even */
        uint32_t mant = (a & 0x007FFFFFu) | 0x00800000u;
        int shift = 126 - (int)(a >> 23);
        uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias the exponent (127 -> 15) and keep 10 mantissa bits;
     * a carry out of the mantissa bumps the exponent, up to inf */
    uint32_t h = (a >> 13) - ((127u - 15u) << 10);
    uint32_t rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

__host__ __device__ __forceinline__ float mt_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return mt_float_of(sign | 0x7F800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-08f; /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    return mt_float_of(sign | ((e + 112u) << 23) | (m << 13));
}

/* The random bits of stochastic rounding for element i of a cast seeded
 * with `seed`: a splitmix64-style finaliser, the same on every device. */
__host__ __device__ __forceinline__ uint32_t mt_sr_bits(unsigned long long seed,
                                                        unsigned long long i)
{
    unsigned long long z =
        seed * 0x9E3779B97F4A7C15ull + i * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)((z ^ (z >> 31)) >> 32);
}

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
 * lib/cuda_device.h, so the host adds the mti_dtype to the first id).
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
