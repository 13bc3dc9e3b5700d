/*
 * vecmath.h - what the CPU kernels share to vectorise their inner loops
 * while giving the same bits on every CPU and thread count.
 */
#ifndef MT_CPU_VECMATH_H
#define MT_CPU_VECMATH_H

#include <stdint.h>
#include <string.h>

#include "arch.h"

static inline uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* c ? a : b with masks: GCC keeps a `?:` next to a floating-point operation
 * as a branch (the operation might trap), and a branch stops vectorisation. */
static inline uint32_t sel(int c, uint32_t a, uint32_t b)
{
    uint32_t m = 0u - (uint32_t)(c != 0);
    return (a & m) | (b & ~m);
}

/* bf16 bits -> fp32 (exact), and fp32 -> bf16 bits to nearest even (NaN
 * stays a quiet NaN): lib/ops/kctx.c's definitions without branches, for the
 * loops that read or write bf16 in place of staging it. */
static inline float b2f(uint16_t h) { return float_of((uint32_t)h << 16); }

static inline uint16_t f2b(float f)
{
    uint32_t u = bits_of(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)sel((u & 0x7FFFFFFFu) > 0x7F800000u, nan, r);
}

/* e^x for x <= 0 in straight-line code that vectorises (libm's expf is a
 * call per element). x = k ln2 + r with |r| <= ln2/2 (ln2 split in two so
 * k ln2 is exact), e^r by its Taylor series to r^7 (truncation below 1e-8
 * relative), times 2^k built in the exponent bits: within 1.3 ulp of e^x
 * (checked on every float in [-87, 0]). Below -87 the result would be under
 * 2^-125: it is 0. NaN stays NaN. */
static inline float exp_le0(float x)
{
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float t = x * 1.44269504f + magic;
    float kf = t - magic;
    uint32_t k = bits_of(t) - bits_of(magic); /* kf as an integer, in [-126, 0] */
    float r = (x - kf * 0.693359375f) - kf * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    float y = p * float_of((k + 127u) << 23);
    uint32_t keep = 0u - (uint32_t)!(x < -87.0f);
    return float_of(bits_of(y) & keep);
}

/* fp16 bits -> fp32, exact. Normal numbers move their exponent from bias
 * 15 to bias 127; inf/NaN keep their payload under an all-ones exponent;
 * subnormals (m * 2^-24) come out of one exact subtraction:
 * 2^-14 (1 + m/1024) - 2^-14. */
static inline float h2f(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7FFFu;
    uint32_t e = em & 0x7C00u;
    uint32_t normal = (em << 13) + (112u << 23);
    uint32_t special = (em << 13) | 0x7F800000u;
    uint32_t sub = bits_of(float_of((113u << 23) | (em << 13)) - float_of(113u << 23));
    uint32_t r = sel(e == 0x7C00u, special, normal);
    r = sel(e == 0, sub, r);
    return float_of(sign | r);
}

/* fp32 -> fp16 bits, to nearest even. Normal results: drop 13 mantissa
 * bits, adding 0xFFF plus the kept lsb so ties go to even (a carry into the
 * exponent is the right answer, up to inf). Subnormal results: adding 0.5f,
 * whose ulp is 2^-24 = the fp16 subnormal step, rounds |f| to a multiple of
 * that step in hardware; the low bits of the sum are then the fp16
 * mantissa (1024 = the smallest normal, also right). */
static inline uint16_t f2h(float f)
{
    uint32_t u = bits_of(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t normal = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    uint32_t sub = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
    uint32_t r = sel(a < 0x38800000u, sub, normal);
    r = sel(a >= 0x477FF000u, 0x7C00u, r); /* from 65520 up: inf */
    r = sel(a > 0x7F800000u, 0x7E00u, r);  /* NaN: the quiet NaN */
    return (uint16_t)(sign | r);
}

#endif /* MT_CPU_VECMATH_H */
