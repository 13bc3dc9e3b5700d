/*
 * test_q8code.c - the 8-bit quantizer of adamw8 (kernels/cpu/optim8.c)
 * finds each code by a table over the float's bits; these tests hold it to
 * the search over the 255 thresholds that states bitsandbytes' rule, on
 * every threshold and its neighbours, the edges of every bucket, special
 * values and a sweep of random values of every magnitude, for both maps.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "ops/kernels.h"
#include "../kernels/cpu/cpu_ops.h"
#include "../kernels/cpu/vecmath.h"

/* Both ways, both maps; returns the number of values that differ (the
 * first few printed). */
static int agree(float x, int *shown)
{
    int bad = 0;
    for (int s = 0; s < 2; s++) {
        uint8_t a = mti_cpu_q8_code(x, s, 0), b = mti_cpu_q8_code(x, s, 1);
        if (a != b) {
            bad++;
            if ((*shown)++ < 8)
                fprintf(stderr, "    %s map, x = %.9g (bits %08x): table %u, search %u\n",
                        s ? "signed" : "unsigned", (double)x, (unsigned)bits_of(x), (unsigned)a, (unsigned)b);
        }
    }
    return bad;
}

TEST(q8_table_codes_equal_the_search)
{
    CHECK_MSG(mti_cpu_q8_lut_ok(), "the table is not in use: a bucket holds two thresholds");
    int shown = 0;
    long bad = 0, n = 0;
    for (int s = 0; s < 2; s++) {
        const float *code = mti_q8_map(s);
        for (int k = 0; k < 255; k++) {
            /* the midpoint, every float near it, and the codes themselves */
            float mid = (code[k] + code[k + 1]) * 0.5f, x = mid;
            for (int i = 0; i < 4; i++) x = nextafterf(x, -INFINITY);
            for (int i = 0; i < 9; i++, n++, x = nextafterf(x, INFINITY)) bad += agree(x, &shown);
            bad += agree(code[k], &shown), n++;
        }
    }
    /* bucket edges: every 2^-7 step of the mantissa from 2^-27 to 1, both
     * signs, and the floats on either side */
    for (uint32_t e = 100; e <= 127; e++)
        for (uint32_t m = 0; m < 128; m++) {
            uint32_t u = (e << 23) | (m << 16);
            for (int d = -1; d <= 1; d++)
                for (uint32_t sg = 0; sg < 2; sg++, n++)
                    bad += agree(float_of((u + (uint32_t)d) | (sg << 31)), &shown);
        }
    const float special[] = {0.0f, -0.0f, 1.0f, -1.0f, NAN, -NAN, 1e-30f, -1e-30f,
                             float_of(1), float_of(0x80000001u), 5.9604645e-08f, -5.9604645e-08f};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++, n++)
        bad += agree(special[i], &shown);
    /* random values: a uniform mantissa and exponent, so every decade of
     * the maps is visited as often as the top one */
    uint64_t z = 88172645463325252ull;
    for (int i = 0; i < 2000000; i++, n++) {
        z ^= z << 13, z ^= z >> 7, z ^= z << 17;
        uint32_t e = 100u + (uint32_t)(z % 28u), m = (uint32_t)(z >> 20) & 0x7FFFFFu;
        uint32_t u = (e << 23) | m | ((uint32_t)(z >> 63) << 31);
        float x = float_of(u);
        if (fabsf(x) > 1.0f) continue;
        bad += agree(x, &shown);
    }
    CHECK_MSG(bad == 0, "%ld of %ld values got another code from the table than from the search",
              bad, n);
}
