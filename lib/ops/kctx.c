/*
 * kctx.c - what ops share: workspace from the WORK allocator, and the one
 * definition of the scalar conversions between fp32, fp16 and bf16 that
 * every table follows.
 */
#include <math.h>
#include <string.h>

#include "ops/kernels.h"

mt_status mti_work_alloc(const mti_kctx *k, size_t bytes, mt_block *out)
{
    mt_alloc_request r = {.bytes = bytes,
                          .alignment = MT_DEFAULT_ALIGNMENT,
                          .mem_class = MT_MEM_WORK,
                          .lifetime = MT_LIFE_PHASE};
    return mt_context_alloc(k->ctx, &r, out);
}

void mti_work_free(const mti_kctx *k, mt_block *b)
{
    if (b->ptr) mt_context_free(k->ctx, b);
    memset(b, 0, sizeof *b);
}

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Stochastic: add 16 random bits below the kept part, then truncate, so the
 * value rounds up with probability equal to the dropped fraction. */
uint16_t mti_f32_to_bf16_sr(float f, uint32_t rnd)
{
    uint32_t u = bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)(u >> 16); /* inf stays inf */
    u += rnd & 0xFFFFu;
    return (uint16_t)(u >> 16);
}

float mti_bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

/* fp16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Largest finite
 * 65504; values from 65520 up round to inf; below 2^-14 subnormal, with
 * steps of 2^-24. */
uint16_t mti_f32_to_f16(float f)
{
    uint32_t u = bits_of(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u); /* NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520: inf */
    if (a < 0x38800000u) {
        /* subnormal or zero: the value in units of 2^-24, rounded to nearest even */
        if (a < 0x33000000u) return sign; /* below 2^-25: rounds to 0 */
        uint32_t mant = (a & 0x007FFFFFu) | 0x00800000u;
        int shift = 126 - (int)(a >> 23) ; /* 2^e * 1.m in units of 2^-24: shift right by 126-e-... */
        /* value = mant * 2^(E-150), E = a>>23; in units of 2^-24: mant * 2^(E-126) */
        uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias the exponent, round the mantissa from 23 to 10 bits */
    uint32_t h = ((a >> 13) - ((127u - 15u) << 10));
    uint32_t rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* may carry into inf: correct */
    return (uint16_t)(sign | h);
}

float mti_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return float_of(sign | 0x7F800000u | (m << 13)); /* inf, NaN */
    if (e == 0) {
        /* zero or subnormal: m * 2^-24 exactly */
        float v = (float)m * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

/* A counter-based hash (splitmix64 finaliser over seed and index): any
 * thread or device gets the same bits for the same element. */
uint32_t mti_sr_bits(uint64_t seed, uint64_t i)
{
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)((z ^ (z >> 31)) >> 32);
}

/* The hash starts from seed K1 + i K2 (mod 2^64), so moving the index by
 * `offset` is moving the seed by offset K2 / K1; K1 is odd, so it has an
 * inverse mod 2^64 (Newton's iteration doubles the good bits each time). */
uint64_t mti_sr_seed_at(uint64_t seed, uint64_t offset)
{
    const uint64_t k1 = 0x9E3779B97F4A7C15ull, k2 = 0xD1B54A32D192ED03ull;
    uint64_t inv = k1; /* right to 3 bits: k1 k1 = 1 mod 8 for odd k1 */
    for (int it = 0; it < 5; it++) inv *= 2 - k1 * inv;
    return seed + offset * k2 * inv;
}
