/*
 * q8map.c - the quantization maps of 8-bit optimizer states: bitsandbytes'
 * "dynamic" maps of 8 bits, signed (first moments) and unsigned (second
 * moments), 256 ascending fp32 values each.
 *
 * Built once per process (pthread_once) by the construction bitsandbytes
 * documents, with its float32 arithmetic reproduced step by step, so the
 * values are the same bits as create_dynamic_map's (test/test_optim.c checks
 * them against the maps in test/golden/adamw8.gv):
 *   for i = 0..6 take k points b = linspace(0.1, 1, k) in fp32, with
 *   k = 2^i + 1 (signed) or 2^(i+1) + 1 (unsigned); each midpoint
 *   (b[j] + b[j+1]) / 2 times 10^(i-6) is a value, and, signed, so is its
 *   negation; then 0 and 1.0; sorted.
 * Signed: 127 negative values, 0 at index 127, 127 positive values up to
 * about 0.99297, and 1.0 at index 255. Unsigned: 0 at index 0, 254 positive
 * values, 1.0 at index 255.
 */
#include <math.h>
#include <pthread.h>

#include "ops/kernels.h"

#define Q8_LEVELS 7 /* decades: values from about 1e-7 to 1 */

static float g_map[2][256]; /* [0] unsigned, [1] signed */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* Point j of torch.linspace(0.1, 1, k) in fp32 (k >= 2). torch computes
 * step = (end - start) / (k - 1) in fp32, then start + step j for the first
 * half and end - step (k - 1 - j) for the second, each as one fused
 * multiply-add (one rounding). */
static float linspace_point(int j, int k)
{
    const float start = 0.1f, end = 1.0f;
    float step = (end - start) / (float)(k - 1);
    if (j < k / 2) return fmaf(step, (float)j, start);
    return fmaf(-step, (float)(k - 1 - j), end);
}

/* The scales 10^(i-6) as Python makes them (a double) before torch rounds
 * them to fp32 for the product with the fp32 midpoints. */
static const double decade[Q8_LEVELS] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};

/* The positive values of level i, in order, go to out; returns how many. */
static int level_values(int i, int is_signed, float *out)
{
    int k = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    float scale = (float)decade[i];
    for (int j = 0; j + 1 < k; j++) {
        float mid = (linspace_point(j, k) + linspace_point(j + 1, k)) / 2.0f;
        out[j] = scale * mid;
    }
    return k - 1;
}

/* Levels are disjoint and ascending (level i lies in (10^(i-7), 10^(i-6)))
 * and each level's values ascend, so no sort is needed: the positive values
 * are the levels in order. */
static void build_maps(void)
{
    float pos[256];
    for (int s = 0; s < 2; s++) {
        int np = 0;
        for (int i = 0; i < Q8_LEVELS; i++) np += level_values(i, s, pos + np);
        float *m = g_map[s];
        int at = 0;
        if (s)
            for (int j = np - 1; j >= 0; j--) m[at++] = -pos[j];
        m[at++] = 0.0f;
        for (int j = 0; j < np; j++) m[at++] = pos[j];
        m[at] = 1.0f; /* index 255 */
    }
}

/* ---- 4-bit maps (lpmm's create_dynamic_map(signed, 3, 4) and
 * create_pow_map(4, unsigned, 1)) ----
 * Signed: for i = 0..2, k = 2^i + 1 points b = linspace(0.1, 1, k); each
 * midpoint (b[j] + b[j+1]) / 2 times 10^(i-2) (the scale rounded to fp32
 * first, as torch multiplies an fp32 tensor by a Python number), and its
 * negation; then 0 and 1. Unsigned: linspace(0, 1, 17) without its 0. */
static float g_map4[2][16];
static pthread_once_t g_once4 = PTHREAD_ONCE_INIT;

static void build_maps4(void)
{
    static const double dec4[3] = {1e-2, 1e-1, 1.0};
    float pos[7];
    int np = 0;
    for (int i = 0; i < 3; i++) {
        int k = (1 << i) + 1;
        for (int j = 0; j + 1 < k; j++)
            pos[np++] = (float)dec4[i] * ((linspace_point(j, k) + linspace_point(j + 1, k)) / 2.0f);
    }
    float *m = g_map4[1];
    for (int j = 0; j < 7; j++) m[j] = -pos[6 - j];
    m[7] = 0.0f;
    for (int j = 0; j < 7; j++) m[8 + j] = pos[j];
    m[15] = 1.0f;
    for (int j = 0; j < 16; j++) g_map4[0][j] = (float)(j + 1) / 16.0f;
}

const float *mti_q4_map(int is_signed)
{
    pthread_once(&g_once4, build_maps4);
    return g_map4[is_signed ? 1 : 0];
}

const float *mti_q8_map(int is_signed)
{
    pthread_once(&g_once, build_maps);
    return g_map[is_signed ? 1 : 0];
}

uint8_t mti_q8_zero_code(int is_signed) { return is_signed ? 127 : 0; }
