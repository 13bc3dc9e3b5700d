/*
 * rng.h - the library's random numbers: xoshiro256** seeded through
 * splitmix64. Deterministic for a seed on every platform; no global state.
 */
#ifndef MT_RNG_H
#define MT_RNG_H

#include <stdint.h>

typedef struct mti_rng {
    uint64_t s[4];
} mti_rng;

void mti_rng_seed(mti_rng *r, uint64_t seed);
uint64_t mti_rng_next(mti_rng *r);
/* uniform in [0, 1) with 24 random bits */
float mti_rng_uniform(mti_rng *r);
/* standard normal (Box-Muller on two 53-bit uniforms; one draw per call) */
double mti_rng_normal(mti_rng *r);

#endif /* MT_RNG_H */
