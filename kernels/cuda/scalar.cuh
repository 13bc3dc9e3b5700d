/*
 * scalar.cuh - the conversions between fp32 and fp16/bf16 bits and the
 * stochastic-rounding hash of the kernels of kernels/cuda, bit for bit
 * lib/ops/kctx.c's (the CPU table and the golden vectors follow that file):
 * round to nearest even, fp16 overflow to inf from 65520 up, NaN kept NaN
 * with kctx's bits (fp16: sign | 0x7E00; bf16: the top half with the quiet
 * bit set), and bf16 stochastic rounding from mt_sr_bits(seed, element
 * index). They are integer code, not the hardware cvt instructions, because
 * those write a canonical NaN (0x7FFF) where kctx keeps the sign and
 * payload; integer work is free in kernels bound by memory. The exception
 * is fp32 -> fp16 on the device, whose integer code is long enough to slow
 * the fp16 kernels: there the hardware conversion (the same bits) runs, NaN
 * handled apart.
 *
 * Plain C as well as CUDA: nvcc makes them __host__ __device__, a C
 * compiler static inline, so host code (the stand-in driver's twins of the
 * dequantizing kernels, test/fake_cuda) runs the very same conversions.
 */
#ifndef MT_CUDA_SCALAR_CUH
#define MT_CUDA_SCALAR_CUH

#include <stdint.h>
#ifndef __CUDA_ARCH__
#include <string.h>
#endif

#ifdef __CUDACC__
#define MT_HD __host__ __device__ __forceinline__
#else
#define MT_HD static inline
#endif

MT_HD uint32_t mt_bits_of(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

MT_HD float mt_float_of(uint32_t u)
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
MT_HD uint16_t mt_f32_to_bf16(float f)
{
    uint32_t u = mt_bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp32 -> bf16 bits, stochastic: rnd's low 16 bits are added below the kept
 * part, so the value rounds up with probability equal to the dropped
 * fraction. inf stays inf. */
MT_HD uint16_t mt_f32_to_bf16_sr(float f, uint32_t rnd)
{
    uint32_t u = mt_bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)(u >> 16);
    u += rnd & 0xFFFFu;
    return (uint16_t)(u >> 16);
}

MT_HD float mt_bf16_to_f32(uint16_t h)
{
    return mt_float_of((uint32_t)h << 16);
}

/* fp32 -> fp16 bits, nearest even. Below 2^-14 the result is subnormal, in
 * steps of 2^-24; from 65520 up it is inf. */
MT_HD uint16_t mt_f32_to_f16(float f)
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

MT_HD float mt_f16_to_f32(uint16_t h)
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
MT_HD uint32_t mt_sr_bits(unsigned long long seed, unsigned long long i)
{
    unsigned long long z =
        seed * 0x9E3779B97F4A7C15ull + i * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)((z ^ (z >> 31)) >> 32);
}

#endif /* MT_CUDA_SCALAR_CUH */
