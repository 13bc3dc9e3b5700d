/*
 * test_optim.c - the 8-bit blockwise AdamW (adamw8) and Adafactor ops of
 * the CPU table: the quantization maps, golden vectors, thread
 * independence, non-finite gradients, argument checks, and that neither op
 * takes workspace. The CUDA table is checked against this one in
 * test_ops.c (ops_optimizers_8bit_adafactor, under MT_TEST_GPU=1).
 *
 * test/golden/gen_optim.py made adamw8.gv and adafactor.gv (its docstring
 * says what each reference is). The cases' inputs come from a small
 * counter-based generator that gen_optim.py and urand below share bit for
 * bit; the files hold the outputs, and the inputs of the small cases so the
 * two generators can be compared.
 *
 * Tolerances.
 *   adamw8 against its reference (a numpy model of bitsandbytes' CUDA
 *   kernel in the same fp32 operations as ours): codes and absmax are
 *   compared exactly, parameters to 2 fp32 ulps (both sides make the same
 *   roundings; the ulps leave room for a compiler that fuses a
 *   multiply-add, where FMA is the norm). Codes may then differ by one
 *   where a value lies within an ulp of a midpoint between codes: at most
 *   one in 500, never by more than one (TOL_CODE_FRAC); with gcc and clang
 *   on x86-64 none differ.
 *   adamw8 against bitsandbytes' own CPU backend (bnb.params): 1% of the
 *   largest total step of the run. That backend applies weight decay
 *   before the step and its quantizer is not exactly nearest; gen_optim.py
 *   measured 0.6% and 0.1% for the two stored cases (MANIFEST.txt).
 *   Adafactor against transformers (torch fp32): torch sums in other orders
 *   and fuses some multiply-adds, so the update of a step is off by a few
 *   fp32 roundings: 2 ulps of the parameter plus 1e-4 of the element's
 *   total step plus 1e-5 of the largest, after 1, 2 and 6 steps; the state
 *   (means of squares) within 1e-5 relative.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/cpu/arch.h"
#include "check.h"
#include "golden.h"
#include "ops/kernels.h"
#include "../kernels/cpu/cpu_ops.h"

#define TOL_CODE_FRAC 0.002 /* codes one off (adamw8 vs its model) */
#define TOL_BNB 0.01        /* of the largest total step (adamw8 vs bnb's CPU backend) */

/* ---- per-test resources, released by the next setup ---- */

static gv_file gfile;
static int have_file;
static mt_context *g_ctx;

static void release(void)
{
    if (have_file) gv_free(&gfile);
    have_file = 0;
    if (g_ctx) mt_context_destroy(g_ctx);
    g_ctx = NULL;
}

/* A fresh CPU context (2 threads) and its kernel context. */
static mti_kctx setup(void)
{
    release();
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 2;
    CHECK_OK(mt_context_create(&cfg, &g_ctx));
    return (mti_kctx){g_ctx, g_ctx->dev};
}

static const gv_file *golden(const char *name)
{
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/%s.gv", gv_dir(), name);
    CHECK_MSG(gv_load(path, &gfile, err, sizeof err), "%s", err);
    have_file = 1;
    return &gfile;
}

static const void *arr(const char *name, gv_dtype dt, size_t numel)
{
    const gv_array *a = gv_find(&gfile, name);
    CHECK_MSG(a != NULL, "golden array '%s' missing", name);
    CHECK_MSG(a->dtype == dt && a->numel == numel, "golden array '%s': %s of %zu, expected %s of %zu",
              name, gv_dtype_name(a->dtype), a->numel, gv_dtype_name(dt), numel);
    return a->data;
}

static const gv_array *arr_any(const char *name)
{
    const gv_array *a = gv_find(&gfile, name);
    CHECK_MSG(a != NULL, "golden array '%s' missing", name);
    return a;
}

static int geti(const char *name)
{
    int32_t v;
    memcpy(&v, arr(name, GV_I32, 1), 4);
    return v;
}

static float getf(const char *name)
{
    float v;
    memcpy(&v, arr(name, GV_F32, 1), 4);
    return v;
}

static char keybuf[128];
#define KEY(c, s) (snprintf(keybuf, sizeof keybuf, "c%d.%s", (c), (s)), keybuf)

/* ---- the inputs' generator (gen_optim.py: urand, make_grads) ---- */

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* n values in [-1, 1): the top 24 bits of a hash of (seed, stream, i) */
static void urand(float *out, uint64_t seed, uint64_t stream, size_t n)
{
    uint64_t base = seed * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull;
    for (size_t i = 0; i < n; i++) {
        uint64_t k = mix64(base + i * 0x632BE59BD9B4E019ull) >> 40;
        out[i] = (float)((double)k - 8388608.0) / 8388608.0f;
    }
}

/* the gradients of step s (from 0): urand(seed, 1 + s) * gscale (1 + s) */
static void make_grads(float *g, uint64_t seed, int s, size_t n, float gscale)
{
    urand(g, seed, 1 + (uint64_t)s, n);
    float k = (float)((double)gscale * (1 + s));
    for (size_t i = 0; i < n; i++) g[i] *= k;
}

/* ---- comparisons ---- */

static double ulp_of(float x)
{
    int e;
    frexpf(fabsf(x), &e);
    return x == 0.0f ? 1.4e-45 : ldexp(1.0, e - 24);
}

/* got against want after a run that started at p0: each element within
 * ulps of want + rel of its own total step + rel_max of the largest. */
static void expect_params(const char *what, const float *got, const float *want, const float *p0,
                          size_t n, double ulps, double rel, double rel_max)
{
    double maxstep = 0;
    for (size_t i = 0; i < n; i++) maxstep = fmax(maxstep, fabs((double)want[i] - p0[i]));
    for (size_t i = 0; i < n; i++) {
        double step = fabs((double)want[i] - p0[i]);
        double lim = ulps * ulp_of(want[i]) + rel * step + rel_max * maxstep;
        double d = fabs((double)got[i] - want[i]);
        CHECK_MSG(d <= lim, "%s: element %zu is %.9g, expected %.9g (|diff| %.3g > %.3g; step %.3g)",
                  what, i, got[i], want[i], d, lim, step);
    }
}

/* ------------------------------------------------------------------------ */
/* The maps                                                                  */
/* ------------------------------------------------------------------------ */

TEST(optim_q8_maps)
{
    setup();
    const float *s = mti_q8_map(1), *u = mti_q8_map(0);
    CHECK(s != NULL && u != NULL && s != u);
    CHECK(mti_q8_map(1) == s); /* made once */
    for (int i = 1; i < 256; i++) CHECK_MSG(s[i - 1] < s[i] && u[i - 1] < u[i], "not ascending at %d", i);
    CHECK(s[127] == 0.0f && !signbit(s[127]) && s[255] == 1.0f);
    CHECK(fabsf(s[254] - 0.99297f) < 1e-5f && fabsf(s[0] + 0.99297f) < 1e-5f);
    for (int i = 0; i < 127; i++) CHECK_MSG(s[i] == -s[254 - i], "signed map not symmetric at %d", i);
    CHECK(u[0] == 0.0f && u[255] == 1.0f && u[1] > 0.0f && u[1] < 1e-6f);
    CHECK_EQ(mti_q8_zero_code(1), 127);
    CHECK_EQ(mti_q8_zero_code(0), 0);
    CHECK(s[mti_q8_zero_code(1)] == 0.0f && u[mti_q8_zero_code(0)] == 0.0f);
    /* bit for bit bitsandbytes' create_dynamic_map */
    golden("adamw8");
    CHECK_MSG(memcmp(s, arr("map_signed", GV_F32, 256), 1024) == 0, "signed map differs from bnb's");
    CHECK_MSG(memcmp(u, arr("map_unsigned", GV_F32, 256), 1024) == 0, "unsigned map differs from bnb's");
    release();
}

/* ------------------------------------------------------------------------ */
/* 8-bit AdamW                                                               */
/* ------------------------------------------------------------------------ */

/* One golden case's inputs and run. */
typedef struct a8_case {
    size_t n, nb;
    mti_adamw_args a;
    float *p0, *grads; /* (steps, n) */
} a8_case;

static void a8_load(int c, int steps, a8_case *k)
{
    k->n = (size_t)geti(KEY(c, "n"));
    k->nb = (k->n + MTI_Q8_BLOCK - 1) / MTI_Q8_BLOCK;
    uint64_t seed = (uint64_t)geti(KEY(c, "seed"));
    k->a = (mti_adamw_args){.lr = getf(KEY(c, "lr")), .beta1 = getf(KEY(c, "beta1")),
                            .beta2 = getf(KEY(c, "beta2")), .eps = getf(KEY(c, "eps")),
                            .weight_decay = getf(KEY(c, "wd")), .grad_scale = getf(KEY(c, "gs"))};
    float gscale = getf(KEY(c, "gscale"));
    size_t n = k->n;
    k->p0 = check_alloc(n * 4);
    k->grads = check_alloc((size_t)steps * n * 4);
    urand(k->p0, seed, 0, n);
    for (int s = 0; s < steps; s++) make_grads(k->grads + (size_t)s * n, seed, s, n, gscale);
    const gv_array *zb = arr_any(KEY(c, "zero_blocks"));
    for (size_t i = 0; i < zb->numel; i++) {
        int32_t b = ((const int32_t *)zb->data)[i];
        if (b < 0) continue;
        for (int s = 0; s < steps; s++)
            for (size_t j = (size_t)b * MTI_Q8_BLOCK; j < n && j < (size_t)(b + 1) * MTI_Q8_BLOCK; j++)
                k->grads[(size_t)s * n + j] = 0.0f;
    }
    const gv_array *at = arr_any(KEY(c, "bad_at"));
    const float *val = arr(KEY(c, "bad_val"), GV_F32, at->numel / 2);
    for (size_t i = 0; i < at->numel / 2; i++) {
        const int32_t *sj = (const int32_t *)at->data + 2 * i;
        if (sj[0] >= 0) k->grads[(size_t)sj[0] * n + (size_t)sj[1]] = val[i];
    }
    /* the stored inputs are ours, bit for bit */
    if (gv_find(&gfile, KEY(c, "p0"))) {
        CHECK_MSG(memcmp(k->p0, arr(KEY(c, "p0"), GV_F32, n), n * 4) == 0,
                  "case %d: p0 differs from gen_optim.py's generator", c);
        CHECK_MSG(memcmp(k->grads, arr(KEY(c, "grads"), GV_F32, (size_t)steps * n),
                         (size_t)steps * n * 4) == 0,
                  "case %d: gradients differ from gen_optim.py's generator", c);
    }
}

/* codes equal, or one off in at most TOL_CODE_FRAC of them */
static void expect_codes(const char *what, const uint8_t *got, const uint8_t *want, size_t n)
{
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        int d = abs((int)got[i] - (int)want[i]);
        CHECK_MSG(d <= 1, "%s: code %zu is %d, expected %d", what, i, got[i], want[i]);
        off += d != 0;
    }
    CHECK_MSG((double)off <= TOL_CODE_FRAC * (double)n, "%s: %zu of %zu codes one off", what, off, n);
}

TEST(optim_adamw8_golden)
{
    mti_kctx k = setup();
    const mti_ops *ops = mti_cpu_ops();
    golden("adamw8");
    const int ncfg = geti("configs"), steps = geti("steps");
    for (int c = 0; c < ncfg; c++) {
        a8_case cs;
        a8_load(c, steps, &cs);
        size_t n = cs.n, nb = cs.nb;
        const gv_array *sv = arr_any(KEY(c, "saved"));
        const int32_t *saved = sv->data;
        const float *want_p = arr(KEY(c, "params"), GV_F32, sv->numel * n);
        const uint8_t *want_qm = arr(KEY(c, "qm"), GV_U8, sv->numel * n);
        const uint8_t *want_qv = arr(KEY(c, "qv"), GV_U8, sv->numel * n);
        const float *want_am = arr(KEY(c, "absmax_m"), GV_F32, (size_t)steps * nb);
        const float *want_av = arr(KEY(c, "absmax_v"), GV_F32, (size_t)steps * nb);
        /* two fresh states: ours (zero codes) and bitsandbytes' (zeroed
         * bytes); they decode alike, so the runs must agree bit for bit */
        for (int init = 0; init < 2; init++) {
            float *p = check_copy(cs.p0, n * 4), *am = check_alloc(nb * 4), *av = check_alloc(nb * 4);
            uint8_t *qm = check_alloc(n), *qv = check_alloc(n);
            memset(qm, init ? 0 : mti_q8_zero_code(1), n);
            memset(qv, mti_q8_zero_code(0), n);
            size_t si = 0;
            for (int t = 1; t <= steps; t++) {
                cs.a.step = t;
                CHECK_OKC(g_ctx, ops->adamw8(&k, p, cs.grads + (size_t)(t - 1) * n, qm, qv, am, av,
                                             NULL, MTI_F32, n, &cs.a));
                char what[96];
                snprintf(what, sizeof what, "adamw8 case %d step %d%s", c, t, init ? " (bnb init)" : "");
                CHECK_MSG(memcmp(am, want_am + (size_t)(t - 1) * nb, nb * 4) == 0 &&
                              memcmp(av, want_av + (size_t)(t - 1) * nb, nb * 4) == 0,
                          "%s: absmax differs", what);
                if (si < sv->numel && saved[si] == t) {
                    expect_codes(what, qm, want_qm + si * n, n);
                    expect_codes(what, qv, want_qv + si * n, n);
                    expect_params(what, p, want_p + si * n, cs.p0, n, 2, 0, 0);
                    si++;
                }
            }
            CHECK(si == sv->numel);
            /* bitsandbytes' CPU backend, where the file has it */
            if (gv_find(&gfile, KEY(c, "bnb.params"))) {
                const float *bp = arr(KEY(c, "bnb.params"), GV_F32, n);
                expect_params("adamw8 vs bitsandbytes' CPU backend", p, bp, cs.p0, n, 0, 0, TOL_BNB);
            }
        }
    }
    release();
}

/* A state of n elements, ours (fresh). */
typedef struct a8_state {
    float *p, *am, *av;
    uint8_t *qm, *qv;
} a8_state;

static a8_state a8_fresh(const float *p0, size_t n)
{
    size_t nb = (n + MTI_Q8_BLOCK - 1) / MTI_Q8_BLOCK;
    a8_state s = {check_copy(p0, n * 4), check_alloc(nb * 4), check_alloc(nb * 4), check_alloc(n), check_alloc(n)};
    memset(s.qm, mti_q8_zero_code(1), n);
    memset(s.qv, mti_q8_zero_code(0), n);
    return s;
}

static int a8_same(const a8_state *x, const a8_state *y, size_t n)
{
    size_t nb = (n + MTI_Q8_BLOCK - 1) / MTI_Q8_BLOCK;
    return !memcmp(x->p, y->p, n * 4) && !memcmp(x->qm, y->qm, n) && !memcmp(x->qv, y->qv, n) &&
           !memcmp(x->am, y->am, nb * 4) && !memcmp(x->av, y->av, nb * 4);
}

static uint64_t work_allocs(void)
{
    mt_memory_stats st;
    CHECK_OK(mt_context_memory_stats(g_ctx, &st));
    return st.per_class[MT_MEM_WORK].n_alloc;
}

TEST(optim_adamw8_behaviour)
{
    mti_kctx k = setup();
    const mti_ops *ops = mti_cpu_ops();
    /* more than MTI_CPU_PAR_MIN elements, so the parallel loop runs; a
     * partial last block */
    const size_t n = 3 * 16384 + 77;
    float *p0 = check_alloc(n * 4), *g = check_alloc(n * 4);
    urand(p0, 7, 0, n);
    mti_adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                        .weight_decay = 0.01f, .grad_scale = 1.0f};
    a8_state s1 = a8_fresh(p0, n), s2 = a8_fresh(p0, n);
    uint64_t w0 = work_allocs();
    for (int t = 1; t <= 3; t++) {
        make_grads(g, 7, t - 1, n, 0.01f);
        a.step = t;
        g_ctx->threads = 1;
        CHECK_OK(ops->adamw8(&k, s1.p, g, s1.qm, s1.qv, s1.am, s1.av, NULL, MTI_F32, n, &a));
        g_ctx->threads = 2;
        CHECK_OK(ops->adamw8(&k, s2.p, g, s2.qm, s2.qv, s2.am, s2.av, NULL, MTI_F32, n, &a));
        CHECK_MSG(a8_same(&s1, &s2, n), "adamw8: 1 and 2 threads differ at step %d", t);
    }
    CHECK_MSG(work_allocs() == w0, "adamw8 took workspace");

    /* grad_scale: gradients times a power of two, unscaled by the op, give
     * the same bits; the compute copy is p rounded to nearest even */
    a8_state s3 = a8_fresh(p0, n);
    uint16_t *pc = check_alloc(n * 2);
    for (int t = 1; t <= 3; t++) {
        make_grads(g, 7, t - 1, n, 0.01f);
        for (size_t i = 0; i < n; i++) g[i] *= 4096.0f;
        a.step = t;
        a.grad_scale = 1.0f / 4096.0f;
        CHECK_OK(ops->adamw8(&k, s3.p, g, s3.qm, s3.qv, s3.am, s3.av, pc, MTI_BF16, n, &a));
    }
    a.grad_scale = 1.0f;
    CHECK_MSG(a8_same(&s2, &s3, n), "adamw8: grad_scale changes the result");
    for (size_t i = 0; i < n; i++) CHECK(pc[i] == mti_f32_to_bf16(s3.p[i]));

    /* non-finite gradients: that element's p is left, its moments are 0
     * (the zero codes), and the rest of its block steps as usual */
    const size_t m = 600;
    a8_state s4 = a8_fresh(p0, m);
    float *before = check_alloc(m * 4);
    for (int t = 1; t <= 2; t++) {
        make_grads(g, 9, t - 1, m, 0.1f);
        g[5] = NAN;
        g[300] = INFINITY;
        g[599] = -INFINITY;
        memcpy(before, s4.p, m * 4);
        a.step = t;
        CHECK_OK(ops->adamw8(&k, s4.p, g, s4.qm, s4.qv, s4.am, s4.av, NULL, MTI_F32, m, &a));
        for (size_t i = 0; i < m; i++) {
            int bad = i == 5 || i == 300 || i == 599;
            CHECK_MSG(bad == (memcmp(&before[i], &s4.p[i], 4) == 0) && isfinite(s4.p[i]),
                      "step %d: element %zu %s", t, i, bad ? "moved" : "did not move");
            if (bad) CHECK(s4.qm[i] == 127 && s4.qv[i] == 0);
        }
    }
    /* a block whose gradients are all non-finite: absmax 0, zero codes, p kept */
    for (size_t i = 256; i < 512; i++) g[i] = NAN;
    memcpy(before, s4.p, m * 4);
    a.step = 3;
    CHECK_OK(ops->adamw8(&k, s4.p, g, s4.qm, s4.qv, s4.am, s4.av, NULL, MTI_F32, m, &a));
    CHECK(s4.am[1] == 0.0f && s4.av[1] == 0.0f);
    for (size_t i = 256; i < 512; i++) CHECK(s4.qm[i] == 127 && s4.qv[i] == 0);
    CHECK(memcmp(before + 256, s4.p + 256, 256 * 4) == 0);

    /* small negative moments keep their sign: a block where one value is
     * 1 and the others far below the smallest code keep -/+ the smallest
     * code for negatives and 0 for positives */
    a8_state s6 = a8_fresh(p0, 256);
    for (size_t i = 0; i < 256; i++) g[i] = (i & 1) ? 1e-12f : -1e-12f;
    g[0] = 1.0f;
    a.step = 1;
    CHECK_OK(ops->adamw8(&k, s6.p, g, s6.qm, s6.qv, s6.am, s6.av, NULL, MTI_F32, 256, &a));
    for (size_t i = 1; i < 256; i++)
        CHECK_MSG(s6.qm[i] == ((i & 1) ? 127 : 126), "tiny moment %zu got code %d", i, s6.qm[i]);
    release();
}

/* adamw8's hand-written paths for full blocks (AVX-512: the map lookups by
 * permutes, and by gathers; AVX2: by gathers) give the portable loops'
 * bits: gradients over many scales, non-finite ones, a block of zeros,
 * blocks of tiny moments of both signs, over several steps; each at the
 * classes the CPU has. */
TEST(optim_adamw8_vector_same_bits)
{
    mti_kctx k = setup();
    const mti_ops *ops = mti_cpu_ops();
    const size_t n = 40 * 256 + 77;
    float *p0 = check_alloc(n * 4), *g = check_alloc(n * 4);
    urand(p0, 13, 0, n);
    mti_adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                        .weight_decay = 0.01f, .grad_scale = 1.0f};
    int had = mti_cpu_q8_vector(2);
    const mti_isa cpu = mti_isa_used();
    /* (class, level): AVX-512 with permutes, AVX-512 with gathers, AVX2 */
    static const struct { mti_isa cls; int level; } runs[] = {
        {MTI_ISA_AVX512, 2}, {MTI_ISA_AVX512, 1}, {MTI_ISA_AVX2, 1}};
    for (size_t r = 0; r < sizeof runs / sizeof *runs; r++) {
        const mti_isa want = runs[r].cls;
        const int level = runs[r].level;
        if (want > cpu) continue;
        const mti_isa was = mti_isa_force(want);
        a8_state sv = a8_fresh(p0, n), ss = a8_fresh(p0, n);
        for (int t = 1; t <= 4; t++) {
            make_grads(g, 13, t - 1, n, 0.01f);
            for (size_t i = 0; i < n; i++) /* scales from 1e-12 to 1e3 by block */
                g[i] *= powf(10.0f, (float)((int)(i / 256) % 16) - 12.0f + (float)(t & 1));
            for (size_t i = 2 * 256; i < 3 * 256; i++) g[i] = (i & 1) ? 1e-30f : -1e-30f;
            g[2 * 256] = 1.0f;
            for (size_t i = 5 * 256; i < 6 * 256; i++) g[i] = 0.0f;
            g[7] = NAN, g[300] = INFINITY, g[9 * 256 + 1] = -INFINITY;
            a.step = t;
            mti_cpu_q8_vector(level);
            CHECK_OK(ops->adamw8(&k, sv.p, g, sv.qm, sv.qv, sv.am, sv.av, NULL, MTI_F32, n, &a));
            mti_cpu_q8_vector(0);
            CHECK_OK(ops->adamw8(&k, ss.p, g, ss.qm, ss.qv, ss.am, ss.av, NULL, MTI_F32, n, &a));
            CHECK_MSG(a8_same(&sv, &ss, n),
                      "adamw8: the vector path (level %d at %s) differs at step %d", level,
                      mti_isa_name(want), t);
        }
        mti_isa_force(was);
    }
    mti_cpu_q8_vector(had);
    if (had < 2) fprintf(stderr, "(adamw8's vector path at level %d on this CPU, of 2)\n", had);
    release();
}

/* adamw8_bf16 as its definition: for each MTI_SR_PIECE-aligned piece of
 * the tensor, widen, adamw8, round back stochastically under the piece's
 * seed; the rounding by the scalar definition of lib/ops/kctx.c. */
static void a8_bf16_reference(const mti_kctx *k, uint16_t *w, const float *g, a8_state *s,
                              size_t n, size_t at, uint64_t seed, const mti_adamw_args *a)
{
    float *w32 = check_alloc(MTI_SR_PIECE * 4);
    for (size_t j = 0, len; j < n; j += len) {
        const size_t e = at + j, piece = e - e % MTI_SR_PIECE;
        len = n - j < piece + MTI_SR_PIECE - e ? n - j : piece + MTI_SR_PIECE - e;
        for (size_t i = 0; i < len; i++) w32[i] = mti_bf16_to_f32(w[j + i]);
        const size_t b = j / MTI_Q8_BLOCK;
        CHECK_OK(mti_cpu_ops()->adamw8(k, w32, g + j, s->qm + j, s->qv + j, s->am + b, s->av + b,
                                       NULL, MTI_F32, len, a));
        for (size_t i = 0; i < len; i++)
            w[j + i] = mti_f32_to_bf16_sr(w32[i], mti_sr_bits(seed ^ piece, e - piece + i));
    }
}

/* The one-pass update of bf16 weights without masters gives the bits of
 * the unfused definition, on every thread count, however it is cut. */
TEST(optim_adamw8_bf16)
{
    mti_kctx k = setup();
    const mti_ops *ops = mti_cpu_ops();
    /* starts 512 elements before a piece boundary, crosses two, ends in a
     * partial block */
    const size_t at = MTI_SR_PIECE - 512, n = 2 * MTI_SR_PIECE + 3 * 256 + 77;
    const uint64_t seed = 0x1234ABCDull;
    float *p0 = check_alloc(n * 4), *g = check_alloc(n * 4);
    urand(p0, 11, 0, n);
    uint16_t *w0 = check_alloc(n * 2), *wr = check_alloc(n * 2), *w1 = check_alloc(n * 2);
    uint16_t *w2 = check_alloc(n * 2), *w3 = check_alloc(n * 2);
    for (size_t i = 0; i < n; i++) w0[i] = mti_f32_to_bf16(p0[i]);
    memcpy(wr, w0, n * 2), memcpy(w1, w0, n * 2), memcpy(w2, w0, n * 2), memcpy(w3, w0, n * 2);
    /* the state's p is unused here: the weights are w */
    a8_state sr = a8_fresh(p0, n), s1 = a8_fresh(p0, n), s2 = a8_fresh(p0, n), s3 = a8_fresh(p0, n);
    mti_adamw_args a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                        .weight_decay = 0.01f, .grad_scale = 1.0f};
    uint64_t w_allocs = work_allocs();
    for (int t = 1; t <= 3; t++) {
        make_grads(g, 11, t - 1, n, 0.01f);
        g[3] = NAN, g[n - 1] = INFINITY;
        a.step = t;
        a8_bf16_reference(&k, wr, g, &sr, n, at, seed + (uint64_t)t, &a);
        g_ctx->threads = 1;
        CHECK_OK(ops->adamw8_bf16(&k, w1, g, s1.qm, s1.qv, s1.am, s1.av, n, at,
                                  seed + (uint64_t)t, &a));
        g_ctx->threads = 2;
        CHECK_OK(ops->adamw8_bf16(&k, w2, g, s2.qm, s2.qv, s2.am, s2.av, n, at,
                                  seed + (uint64_t)t, &a));
        /* in two calls, cut at a block that is not on a piece boundary */
        const size_t cut = 300 * 256, cb = cut / 256;
        CHECK_OK(ops->adamw8_bf16(&k, w3, g, s3.qm, s3.qv, s3.am, s3.av, cut, at,
                                  seed + (uint64_t)t, &a));
        CHECK_OK(ops->adamw8_bf16(&k, w3 + cut, g + cut, s3.qm + cut, s3.qv + cut, s3.am + cb,
                                  s3.av + cb, n - cut, at + cut, seed + (uint64_t)t, &a));
        size_t diff = 0;
        for (size_t i = 0; i < n; i++) diff += wr[i] != w1[i];
        CHECK_MSG(diff == 0, "step %d: %zu weights differ from the unfused update", t, diff);
        CHECK_MSG(!memcmp(w1, w2, n * 2) && !memcmp(w1, w3, n * 2),
                  "step %d: threads or cuts change the weights", t);
        size_t nb = (n + 255) / 256;
        for (const a8_state *o = &s1; o; o = o == &s1 ? &s2 : o == &s2 ? &s3 : NULL)
            CHECK_MSG(!memcmp(sr.qm, o->qm, n) && !memcmp(sr.qv, o->qv, n) &&
                          !memcmp(sr.am, o->am, nb * 4) && !memcmp(sr.av, o->av, nb * 4),
                      "step %d: the state differs from the unfused update", t);
    }
    CHECK_MSG(w0[3] == w1[3], "a non-finite gradient moved its weight");
    size_t moved = 0;
    for (size_t i = 0; i < n; i++) moved += w0[i] != w1[i];
    CHECK_MSG(moved > n / 2, "only %zu of %zu weights moved", moved, n);
    CHECK_MSG(work_allocs() == w_allocs, "adamw8_bf16 took workspace");

    const mt_status BAD = MT_ERR_INVALID_ARG;
    CHECK_ST(BAD, ops->adamw8_bf16(&k, w1, g, s1.qm, s1.qv, s1.am, s1.av, 300, 100, 1, &a));
    CHECK(strstr(mt_last_error(g_ctx), "adamw8_bf16") != NULL);
    CHECK_ST(BAD, ops->adamw8_bf16(&k, NULL, g, s1.qm, s1.qv, s1.am, s1.av, 300, 0, 1, &a));
    CHECK_ST(BAD, ops->adamw8_bf16(&k, w1, g, s1.qm, s1.qv, NULL, s1.av, 300, 0, 1, &a));
    CHECK_ST(BAD, ops->adamw8_bf16(&k, w1, g, s1.qm, s1.qv, s1.am, s1.av, 300, 0, 1, NULL));
    a.step = 0;
    CHECK_ST(BAD, ops->adamw8_bf16(&k, w1, g, s1.qm, s1.qv, s1.am, s1.av, 300, 0, 1, &a));
    a.step = 1;
    CHECK_OK(ops->adamw8_bf16(&k, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 1, &a));
    release();
}

/* ------------------------------------------------------------------------ */
/* Adafactor                                                                 */
/* ------------------------------------------------------------------------ */

TEST(optim_adafactor_golden)
{
    mti_kctx k = setup();
    const mti_ops *ops = mti_cpu_ops();
    golden("adafactor");
    const int ncfg = geti("configs"), steps = geti("steps");
    const gv_array *sv = arr_any("saved");
    const int32_t *saved = sv->data;
    for (int c = 0; c < ncfg; c++) {
        int64_t rows = geti(KEY(c, "rows")), cols = geti(KEY(c, "cols"));
        int factored = geti(KEY(c, "factored"));
        size_t n = (size_t)(rows * cols);
        uint64_t seed = (uint64_t)geti(KEY(c, "seed"));
        mti_adafactor_args a = {
            .lr = getf(KEY(c, "lr")), .eps1 = getf(KEY(c, "eps1")), .eps2 = getf(KEY(c, "eps2")),
            .clip_threshold = getf(KEY(c, "clip_threshold")),
            .decay_rate = getf(KEY(c, "decay_rate")), .beta1 = getf(KEY(c, "beta1")),
            .weight_decay = getf(KEY(c, "weight_decay")),
            .scale_parameter = geti(KEY(c, "scale_parameter")),
            .relative_step = geti(KEY(c, "relative_step")),
            .warmup_init = geti(KEY(c, "warmup_init")), .grad_scale = 1.0f};
        const float *want_p = arr(KEY(c, "params"), GV_F32, sv->numel * n);
        float *p0 = check_alloc(n * 4), *p = check_alloc(n * 4), *g = check_alloc(n * 4);
        float *row = check_alloc((size_t)rows * 4), *col = check_alloc((size_t)cols * 4);
        float *v = check_alloc(n * 4), *m = check_alloc(n * 4);
        urand(p0, seed, 0, n);
        memcpy(p, p0, n * 4);
        size_t si = 0;
        for (int t = 1; t <= steps; t++) {
            make_grads(g, seed, t - 1, n, 0.1f);
            if (t == 2) g[0] *= 50.0f;
            a.step = t;
            CHECK_OKC(g_ctx, ops->adafactor(&k, p, g, factored ? row : NULL, factored ? col : NULL,
                                            factored ? NULL : v, a.beta1 > 0 ? m : NULL, NULL,
                                            MTI_F32, rows, cols, factored, &a));
            if (si < sv->numel && saved[si] == t) {
                char what[64];
                snprintf(what, sizeof what, "adafactor case %d step %d", c, t);
                expect_params(what, p, want_p + si * n, p0, n, 2, 1e-4, 1e-5);
                si++;
            }
        }
        /* the state after the last step */
        struct {
            const char *name;
            const float *got;
            size_t len;
        } st[3] = {{"row", row, (size_t)rows}, {"col", col, (size_t)cols}, {"v", v, n}};
        for (int i = 0; i < 3; i++) {
            if (factored != (i < 2)) continue;
            const float *want = arr(KEY(c, st[i].name), GV_F32, st[i].len);
            for (size_t j = 0; j < st[i].len; j++)
                CHECK_MSG(fabs((double)st[i].got[j] - want[j]) <= 1e-5 * fabs((double)want[j]),
                          "adafactor case %d: %s[%zu] %.9g, expected %.9g", c, st[i].name, j,
                          st[i].got[j], want[j]);
        }
        if (a.beta1 > 0) {
            const float *want = arr(KEY(c, "m"), GV_F32, n);
            double mx = 0;
            for (size_t j = 0; j < n; j++) mx = fmax(mx, fabs(want[j]));
            for (size_t j = 0; j < n; j++)
                CHECK_MSG(fabs((double)m[j] - want[j]) <= 1e-4 * fabs(want[j]) + 1e-5 * mx,
                          "adafactor case %d: m[%zu] %.9g, expected %.9g", c, j, m[j], want[j]);
        }
    }
    release();
}

/* One run of `steps` Adafactor steps from p0 on fresh state. */
static void af_run(const mti_kctx *k, float *p, const float *p0, float *g, float *row, float *col,
                   float *v, float *m, void *pc, int64_t rows, int64_t cols, int factored,
                   mti_adafactor_args a, float prescale)
{
    size_t n = (size_t)(rows * cols);
    memcpy(p, p0, n * 4);
    memset(row, 0, (size_t)rows * 4);
    memset(col, 0, (size_t)cols * 4);
    memset(v, 0, n * 4);
    memset(m, 0, n * 4);
    for (int t = 1; t <= 3; t++) {
        make_grads(g, 11, t - 1, n, 0.1f);
        for (size_t i = 0; i < n; i++) g[i] *= prescale;
        a.step = t;
        a.grad_scale = 1.0f / prescale;
        CHECK_OK(mti_cpu_ops()->adafactor(k, p, g, row, col, v, m, pc, MTI_F16, rows, cols,
                                          factored, &a));
    }
}

TEST(optim_adafactor_behaviour)
{
    mti_kctx k = setup();
    /* a matrix past MTI_CPU_PAR_MIN, with partial tiles both ways */
    const int64_t rows = 300, cols = 263;
    const size_t n = (size_t)(rows * cols);
    float *p0 = check_alloc(n * 4), *g = check_alloc(n * 4);
    urand(p0, 11, 0, n);
    float *p[2], *row[2], *col[2], *v[2], *m[2];
    uint16_t *pc = check_alloc(n * 2);
    for (int i = 0; i < 2; i++) {
        p[i] = check_alloc(n * 4), row[i] = check_alloc((size_t)rows * 4), col[i] = check_alloc((size_t)cols * 4);
        v[i] = check_alloc(n * 4), m[i] = check_alloc(n * 4);
    }
    mti_adafactor_args a = {.eps1 = 1e-30f, .eps2 = 1e-3f, .clip_threshold = 1.0f,
                            .decay_rate = -0.8f, .beta1 = 0.9f, .weight_decay = 0.01f,
                            .scale_parameter = 1, .relative_step = 1};
    uint64_t w0 = work_allocs();
    for (int factored = 0; factored < 2; factored++) {
        /* 1 and 2 threads: the same bits; gradients scaled by a power of
         * two and unscaled by the op: the same bits */
        g_ctx->threads = 1;
        af_run(&k, p[0], p0, g, row[0], col[0], v[0], m[0], NULL, rows, cols, factored, a, 1.0f);
        g_ctx->threads = 2;
        af_run(&k, p[1], p0, g, row[1], col[1], v[1], m[1], pc, rows, cols, factored, a, 256.0f);
        CHECK_MSG(memcmp(p[0], p[1], n * 4) == 0 && memcmp(m[0], m[1], n * 4) == 0,
                  "adafactor (factored %d): 1 and 2 threads, or scaled gradients, differ", factored);
        if (factored)
            CHECK(memcmp(row[0], row[1], (size_t)rows * 4) == 0 &&
                  memcmp(col[0], col[1], (size_t)cols * 4) == 0);
        else
            CHECK(memcmp(v[0], v[1], n * 4) == 0);
        for (size_t i = 0; i < n; i++) CHECK(pc[i] == mti_f32_to_f16(p[1][i]));
        /* the parameters moved, by about lr_t (1% of RMS(p)) per step */
        double d = 0;
        for (size_t i = 0; i < n; i++) { /* (an fmax reduction here stops gcc 12 for aarch64) */
            const double x = fabs((double)p[1][i] - p0[i]);
            d = x > d ? x : d;
        }
        CHECK_MSG(d > 1e-3 && d < 0.2, "adafactor moved the parameters by %g", d);
    }
    CHECK_MSG(work_allocs() == w0, "adafactor took workspace");
    /* without a first moment m is not touched (it may be NULL) */
    a.beta1 = 0.0f;
    a.step = 1;
    make_grads(g, 11, 0, n, 0.1f);
    CHECK_OK(mti_cpu_ops()->adafactor(&k, p[0], g, row[0], col[0], NULL, NULL, NULL, MTI_F32, rows,
                                      cols, 1, &a));
    CHECK_OK(mti_cpu_ops()->adafactor(&k, p[0], g, NULL, NULL, v[0], NULL, NULL, MTI_F32, rows,
                                      cols, 0, &a));
    release();
}

/* ------------------------------------------------------------------------ */
/* Arguments                                                                 */
/* ------------------------------------------------------------------------ */

TEST(optim_arguments)
{
    mti_kctx k = setup();
    const mti_ops *ops = mti_cpu_ops();
    float p[300] = {0}, g[300] = {0}, am[2], av[2], row[10], col[30], v[300], m[300];
    uint8_t qm[300], qv[300];
    uint16_t pc[300];
    mti_adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 1,
                        .grad_scale = 1.0f};
    memset(qm, 127, sizeof qm);
    memset(qv, 0, sizeof qv);
    memset(am, 0, sizeof am);
    memset(av, 0, sizeof av);
    const mt_status BAD = MT_ERR_INVALID_ARG;
    CHECK_ST(BAD, ops->adamw8(&k, p, g, qm, qv, am, av, NULL, MTI_F32, 300, NULL));
    a.step = 0;
    CHECK_ST(BAD, ops->adamw8(&k, p, g, qm, qv, am, av, NULL, MTI_F32, 300, &a));
    a.step = 1;
    CHECK_ST(BAD, ops->adamw8(&k, p, g, qm, qv, am, av, pc, MTI_I32, 300, &a));
    CHECK_ST(BAD, ops->adamw8(&k, NULL, g, qm, qv, am, av, NULL, MTI_F32, 300, &a));
    CHECK_ST(BAD, ops->adamw8(&k, p, NULL, qm, qv, am, av, NULL, MTI_F32, 300, &a));
    CHECK_ST(BAD, ops->adamw8(&k, p, g, NULL, qv, am, av, NULL, MTI_F32, 300, &a));
    CHECK_ST(BAD, ops->adamw8(&k, p, g, qm, NULL, am, av, NULL, MTI_F32, 300, &a));
    CHECK_ST(BAD, ops->adamw8(&k, p, g, qm, qv, NULL, av, NULL, MTI_F32, 300, &a));
    CHECK_ST(BAD, ops->adamw8(&k, p, g, qm, qv, am, NULL, NULL, MTI_F32, 300, &a));
    CHECK(strstr(mt_last_error(g_ctx), "adamw8") != NULL);
    CHECK_OK(ops->adamw8(&k, NULL, NULL, NULL, NULL, NULL, NULL, NULL, MTI_F32, 0, &a));
    CHECK_OK(ops->adamw8(&k, p, g, qm, qv, am, av, pc, MTI_F16, 300, &a));

    mti_adafactor_args f = {.eps1 = 1e-30f, .eps2 = 1e-3f, .clip_threshold = 1.0f,
                            .decay_rate = -0.8f, .scale_parameter = 1, .relative_step = 1,
                            .step = 1, .grad_scale = 1.0f};
    memset(row, 0, sizeof row);
    memset(col, 0, sizeof col);
    memset(v, 0, sizeof v);
#define AF(P, G, R, C, V, M, PC, DT, RO, CO, FA, A) \
    ops->adafactor(&k, P, G, R, C, V, M, PC, DT, RO, CO, FA, A)
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, NULL));
    f.step = 0;
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    f.step = 1;
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, -1, 30, 1, &f));
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, 10, -30, 1, &f));
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, INT64_MAX / 2, 30, 1, &f));
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, pc, MTI_I32, 10, 30, 1, &f));
    CHECK_ST(BAD, AF(NULL, g, row, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    CHECK_ST(BAD, AF(p, NULL, row, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    CHECK_ST(BAD, AF(p, g, NULL, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    CHECK_ST(BAD, AF(p, g, row, NULL, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    CHECK_ST(BAD, AF(p, g, NULL, NULL, NULL, NULL, NULL, MTI_F32, 10, 30, 0, &f));
    f.beta1 = 0.9f;
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    f.beta1 = 0.0f;
    f.clip_threshold = 0.0f;
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    f.clip_threshold = NAN;
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    f.clip_threshold = 1.0f;
    f.relative_step = 0;
    f.warmup_init = 1;
    CHECK_ST(BAD, AF(p, g, row, col, NULL, NULL, NULL, MTI_F32, 10, 30, 1, &f));
    CHECK(strstr(mt_last_error(g_ctx), "adafactor") != NULL);
    f.warmup_init = 0;
    f.lr = 1e-2f;
    /* empty shapes do nothing, NULLs and all */
    CHECK_OK(AF(NULL, NULL, NULL, NULL, NULL, NULL, NULL, MTI_F32, 0, 30, 1, &f));
    CHECK_OK(AF(NULL, NULL, NULL, NULL, NULL, NULL, NULL, MTI_F32, 10, 0, 0, &f));
    CHECK_OK(AF(p, g, row, col, NULL, NULL, pc, MTI_BF16, 10, 30, 1, &f));
    f.beta1 = 0.5f;
    CHECK_OK(AF(p, g, NULL, NULL, v, m, NULL, MTI_F32, 1, 300, 0, &f));
#undef AF
    release();
}

/* ------------------------------------------------------------------------ */
/* The CUDA table's host side, on the stand-in driver                        */
/* ------------------------------------------------------------------------ */

/* The stand-in driver runs no kernels, but the CUDA table's checks, its
 * scalars and launches, and the module it loads for these kernels run. */
TEST(optim_cuda_host_side)
{
    release();
    const char *path = check_fake_cuda();
    if (!path) return;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    CHECK_MSG(lib, "cannot load %s: %s", path, dlerror());
    const char *(*last_kernel)(void);
    unsigned long long (*stat)(const char *);
    void *sym = dlsym(lib, "fake_cuda_last_kernel");
    memcpy(&last_kernel, &sym, sizeof sym);
    sym = dlsym(lib, "fake_cuda_stat");
    memcpy(&stat, &sym, sizeof sym);
    CHECK(last_kernel && stat);
    unsigned long long modules0 = stat("modules"), launches0 = stat("launches");

    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CUDA;
    cfg.cuda_driver_path = path;
    CHECK_OK(mt_context_create(&cfg, &g_ctx));
    const mti_ops *ops = NULL;
    if (mti_cuda_ops(g_ctx->dev, &ops) != MT_OK) { /* a build without CUDA kernels */
        release();
        dlclose(lib);
        return;
    }
    mti_kctx k = {g_ctx, g_ctx->dev};
    const size_t rows = 40, cols = 70, n = rows * cols, nb = (n + 255) / 256;
    mt_block blk;
    mt_alloc_request r = {.bytes = n * 16 + nb * 8 + (rows + cols) * 4, .mem_class = MT_MEM_IO,
                          .lifetime = MT_LIFE_PERSISTENT};
    CHECK_OK(mt_context_alloc(g_ctx, &r, &blk));
    float *p = blk.ptr, *g = p + n, *m = g + n, *v = m + n, *am = v + n, *av = am + nb;
    float *row = av + nb, *col = row + rows;
    uint8_t *qm = (uint8_t *)(col + cols), *qv = qm + n;
    mti_adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 1,
                        .grad_scale = 1.0f};
    CHECK_OKC(g_ctx, ops->adamw8(&k, p, g, qm, qv, am, av, NULL, MTI_F32, n, &a));
    CHECK(strcmp(last_kernel(), "mt_adamw8") == 0);
    CHECK_EQ(stat("modules"), modules0 + 1); /* the built-in one */
    a.step = 0;
    CHECK_ST(MT_ERR_INVALID_ARG, ops->adamw8(&k, p, g, qm, qv, am, av, NULL, MTI_F32, n, &a));
    a.step = 1;
    CHECK_ST(MT_ERR_INVALID_ARG, ops->adamw8(&k, p, NULL, qm, qv, am, av, NULL, MTI_F32, n, &a));
    /* bf16 weights without masters: widen, adamw8, round, three launches */
    unsigned long long l0 = stat("launches");
    CHECK_OKC(g_ctx, ops->adamw8_bf16(&k, (uint16_t *)m, g, qm, qv, am, av, n, 0, 5, &a));
    CHECK(strcmp(last_kernel(), "mt_cast") == 0);
    CHECK_EQ(stat("launches") - l0, 3);
    CHECK_ST(MT_ERR_INVALID_ARG, ops->adamw8_bf16(&k, (uint16_t *)m, g, qm, qv, am, av, n, 7, 5, &a));

    mti_adafactor_args f = {.eps1 = 1e-30f, .eps2 = 1e-3f, .clip_threshold = 1.0f,
                            .decay_rate = -0.8f, .beta1 = 0.9f, .weight_decay = 0.01f,
                            .scale_parameter = 1, .relative_step = 1, .step = 1,
                            .grad_scale = 1.0f};
    unsigned long long before = stat("launches");
    CHECK_OKC(g_ctx, ops->adafactor(&k, p, g, row, col, NULL, m, NULL, MTI_F32, (int64_t)rows,
                                    (int64_t)cols, 1, &f));
    CHECK(strcmp(last_kernel(), "mt_af_apply") == 0);
    CHECK_EQ(stat("launches") - before, 9); /* RMS(p), rows, cols, mean(row), RMS(update), step */
    before = stat("launches");
    CHECK_OKC(g_ctx, ops->adafactor(&k, p, g, NULL, NULL, v, m, NULL, MTI_F32, (int64_t)rows,
                                    (int64_t)cols, 0, &f));
    CHECK_EQ(stat("launches") - before, 5);
    CHECK_ST(MT_ERR_INVALID_ARG, ops->adafactor(&k, p, g, NULL, col, NULL, m, NULL, MTI_F32,
                                                (int64_t)rows, (int64_t)cols, 1, &f));
    f.step = 0;
    CHECK_ST(MT_ERR_INVALID_ARG, ops->adafactor(&k, p, g, row, col, NULL, m, NULL, MTI_F32,
                                                (int64_t)rows, (int64_t)cols, 1, &f));
    CHECK(stat("launches") > launches0);
    CHECK_OK(mt_context_free(g_ctx, &blk));
    release();
    CHECK_EQ(stat("modules"), modules0); /* unloaded with the device */
    dlclose(lib);
}
