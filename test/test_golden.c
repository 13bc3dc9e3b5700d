/*
 * test_golden.c - the CPU op table against vectors computed by PyTorch.
 *
 * test/golden/gen.py made the files in test/golden/ (MANIFEST.txt names the
 * torch version and lists them); this file needs no Python. The reference
 * follows our kernels' model (lib/ops/kernels.h): inputs are stored in the
 * dtype, torch computed in fp32 from exactly those values, and each output
 * in the dtype was rounded once; the attention backward starts, as our op
 * does, from the forward output as stored in the dtype. The files also hold
 * what torch returns when it runs natively in fp16/bf16 ("native.*") and
 * the attention backward by plain autograd ("autograd.*"); those document
 * how torch's own results differ from the model and are not compared here.
 *
 * Run with `mt_tests golden`, from the repository root (or set
 * MT_GOLDEN_DIR to the folder of the .gv files).
 */
#include <math.h>
#include <string.h>

#include "check.h"
#include "golden.h"
#include "ops/kernels.h"
#include "optim/scaler.h"

/* ------------------------------------------------------------------------ */
/* Tolerances                                                                */
/* ------------------------------------------------------------------------ */

/* An element passes when |got - want| <= ulps * (spacing of the output
 * dtype at want) + rel * |want| + abs_of_max * (largest |want| of the
 * array). NaN must meet NaN and an infinity the same infinity. */
typedef struct tol {
    double ulps;
    double rel;
    double abs_of_max;
} tol;

/* Outputs stored in the op's dtype, by dtype.
 *   fp32: torch and we compute in fp32 but sum in different orders (BLAS
 *     blocking, vector lanes, an online softmax over key blocks against a
 *     full one). Each order is off by a few fp32 roundings (2^-24 = 6e-8
 *     each) over reductions of at most ~70 terms here, far below 1e-5
 *     relative. Where a result is the difference of larger terms (layernorm
 *     dx, attention dq and dk, GELU' near its zero) the error follows the
 *     terms, not the result, hence a part relative to the array's largest
 *     value (1e-6 of it: ~16 fp32 roundings of the largest term).
 *   fp16: the same fp32 differences, which may carry a value across a
 *     rounding boundary of fp16 before the one final rounding: 1 ulp of
 *     fp16 (2^-10 relative; 2^-24 in the subnormal range) on top.
 *   bf16: likewise, 1 ulp of bf16 (2^-7 relative). */
static const tol TOL_OUT[3] = {
    [MTI_F32] = {0, 1e-5, 1e-6},
    [MTI_F16] = {1, 1e-5, 1e-6},
    [MTI_BF16] = {1, 1e-5, 1e-6},
};

/* Outputs kept in fp32 whatever the dtype: layernorm mean and rstd, the
 * attention logsumexp, per-row losses, parameter gradients. Both sides start
 * from the same dtype-rounded inputs, so only fp32 summation order differs:
 * the fp32 row above. */
static const tol TOL_F32_OUT = {0, 1e-5, 1e-6};

/* Optimizer updates, fp32 master weights and state, per step from torch's
 * previous state. torch's single-tensor AdamW forms m with lerp, divides
 * sqrt(v) by sqrt(1 - b2^t) and forms the bias corrections in double; the
 * same algebra in a different order in fp32 is a few fp32 roundings apart
 * (6e-8 each): 1e-6 relative. m and v may be the small difference of two
 * terms (b1 m against (1 - b1) g), hence also 1e-6 of the largest value. */
static const tol TOL_OPTIM = {0, 1e-6, 1e-6};

/* Parameters after an update are judged against the size of the update,
 * which is far tighter than 1e-6 of the parameter (a step of lr = 1e-3 on a
 * weight near 1 would hide in it): 2 fp32 ulps of the new value (torch and
 * we each round p - lr * d once or twice), plus rel of that element's step
 * and abs_of_max of the array's largest step (the step's own few fp32
 * roundings, and m, v or the momentum being small differences of larger
 * terms). */
static const tol TOL_STEP = {2, 1e-5, 1e-5};

/* Casts and the loss scaler are compared exactly (bit for bit; NaN payloads
 * aside, which neither torch nor our contract fixes). Unscaling multiplies
 * by a power of two, so its results are exact too. */

_Static_assert((int)GV_F32 == (int)MTI_F32 && (int)GV_F16 == (int)MTI_F16 &&
                   (int)GV_BF16 == (int)MTI_BF16 && (int)GV_I32 == (int)MTI_I32,
               "the file's dtype codes are mti_dtype's");

/* ------------------------------------------------------------------------ */
/* Fixture: a CPU context and golden files                                  */
/* ------------------------------------------------------------------------ */

/* What a test holds is kept here, so a CHECK that ends a test early leaks
 * nothing: the next test (and the end of this one) releases it. Scratch
 * memory comes from check_alloc, which the runner frees after each test. */
#define MAX_FILES 8
static gv_file files[MAX_FILES];
static int n_files;
static mt_context *g_ctx;

static void release(void)
{
    for (int i = 0; i < n_files; i++) gv_free(&files[i]);
    n_files = 0;
    if (g_ctx) mt_context_destroy(g_ctx);
    g_ctx = NULL;
}

/* A buffer whose every byte is 0xFF: a NaN in fp32, fp16 and bf16 alike, so
 * an output an op must overwrite but reads instead shows up. */
static void *tnan(size_t bytes)
{
    void *p = check_alloc(bytes);
    memset(p, 0xFF, bytes);
    return p;
}

/* A fresh CPU context and its op table. */
static mti_kctx setup(const mti_ops **ops)
{
    release();
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = 2;
    CHECK_OK(mt_context_create(&cfg, &g_ctx));
    *ops = g_ctx->ops;
    CHECK(*ops != NULL);
    return (mti_kctx){g_ctx, g_ctx->dev};
}

static const gv_file *golden(const char *name)
{
    char path[512], err[512];
    CHECK(n_files < MAX_FILES);
    snprintf(path, sizeof path, "%s/%s.gv", gv_dir(), name);
    bool ok = gv_load(path, &files[n_files], err, sizeof err);
    CHECK_MSG(ok, "%s", err);
    CHECK_MSG(strstr(files[n_files].header, "torch=") != NULL, "%s: header without a torch version",
              path);
    return &files[n_files++];
}

/* The array `name` of f, which must have dtype dt and numel elements. */
static const void *arr(const gv_file *f, const char *name, gv_dtype dt, size_t numel)
{
    const gv_array *a = gv_find(f, name);
    CHECK_MSG(a != NULL, "golden array '%s' missing (header: %s)", name, f->header);
    CHECK_MSG(a->dtype == dt, "golden array '%s' is %s, expected %s", name,
              gv_dtype_name(a->dtype), gv_dtype_name(dt));
    CHECK_MSG(a->numel == numel, "golden array '%s' has %zu elements, expected %zu", name,
              a->numel, numel);
    return a->data;
}

static int scalar_i32(const gv_file *f, const char *name)
{
    int32_t v;
    memcpy(&v, arr(f, name, GV_I32, 1), sizeof v);
    return v;
}

static float scalar_f32(const gv_file *f, const char *name)
{
    float v;
    memcpy(&v, arr(f, name, GV_F32, 1), sizeof v);
    return v;
}

/* ------------------------------------------------------------------------ */
/* Comparison                                                                */
/* ------------------------------------------------------------------------ */

static size_t dsize(mti_dtype dt) { return dt == MTI_F32 ? 4 : 2; }

static double elem(mti_dtype dt, const void *p, size_t i)
{
    switch (dt) {
    case MTI_F32: return ((const float *)p)[i];
    case MTI_F16: return mti_f16_to_f32(((const uint16_t *)p)[i]);
    case MTI_BF16: return mti_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return NAN;
    }
}

/* The spacing of dt's values at |x|; below the smallest normal it is the
 * subnormal step. */
static double spacing(mti_dtype dt, double x)
{
    int mant = dt == MTI_F16 ? 10 : dt == MTI_BF16 ? 7 : 23;
    double min_normal = dt == MTI_F16 ? 6.103515625e-05 : 1.1754943508222875e-38;
    double a = fabs(x) < min_normal ? min_normal : fabs(x);
    int e;
    frexp(a, &e); /* 2^(e-1) <= a < 2^e */
    return ldexp(1.0, e - 1 - mant);
}

/* MT_GOLDEN_VERBOSE=1: print how close every compared array comes to its
 * tolerance (for revisiting the table above). */
static bool verbose(void)
{
    const char *v = getenv("MT_GOLDEN_VERBOSE");
    return v && *v && strcmp(v, "0") != 0;
}

/* Compares n values of got (in got_dt) with want (in want_dt) times
 * want_scale under t, ulps counted in got_dt. Prints the worst offender
 * and returns false on a mismatch, so a test can report every array before
 * it fails. */
static bool compare(const char *what, mti_dtype got_dt, const void *got, mti_dtype want_dt,
                    const void *want, double want_scale, size_t n, tol t)
{
    double maxabs = 0;
    for (size_t i = 0; i < n; i++) {
        double w = elem(want_dt, want, i) * want_scale;
        if (isfinite(w) && fabs(w) > maxabs) maxabs = fabs(w);
    }
    size_t bad = 0, worst = 0;
    double worst_ratio = 0;
    for (size_t i = 0; i < n; i++) {
        double g = elem(got_dt, got, i), w = elem(want_dt, want, i) * want_scale;
        double ratio;
        if (isnan(w) || isinf(w)) {
            ratio = (isnan(w) ? isnan(g) : g == w) ? 0 : INFINITY;
        } else {
            double allowed = t.ulps * spacing(got_dt, w) + t.rel * fabs(w) + t.abs_of_max * maxabs;
            double diff = fabs(g - w);
            if (isnan(diff)) ratio = INFINITY;
            else if (diff == 0) ratio = 0;
            else ratio = allowed > 0 ? diff / allowed : INFINITY;
        }
        if (ratio > 1) bad++;
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            worst = i;
        }
    }
    if (verbose())
        fprintf(stderr,
                "    %-48s worst %.3g of allowed at [%zu]: got %.9g want %.9g (max |want| %.3g)\n",
                what, worst_ratio, worst, elem(got_dt, got, worst),
                elem(want_dt, want, worst) * want_scale, maxabs);
    if (bad == 0) return true;
    double g = elem(got_dt, got, worst), w = elem(want_dt, want, worst) * want_scale;
    fprintf(stderr,
            "    %s: %zu of %zu elements out of tolerance; worst [%zu]: got %.9g, want %.9g "
            "(|diff| %.3g = %.3g x allowed; max |want| %.3g)\n",
            what, bad, n, worst, g, w, fabs(g - w), worst_ratio, maxabs);
    return false;
}

/* Parameters after an update (got, want) from the same parameters before
 * (old), under TOL_STEP: the rel and abs_of_max parts apply to the step
 * want - old. */
static bool compare_step(const char *what, const float *got, const float *want, const float *old,
                         size_t n)
{
    const tol t = TOL_STEP;
    double maxstep = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs((double)want[i] - old[i]) > maxstep) maxstep = fabs((double)want[i] - old[i]);
    size_t bad = 0, worst = 0;
    double worst_ratio = 0;
    for (size_t i = 0; i < n; i++) {
        double diff = fabs((double)got[i] - want[i]), step = fabs((double)want[i] - old[i]);
        double allowed = t.ulps * spacing(MTI_F32, want[i]) + t.rel * step + t.abs_of_max * maxstep;
        double ratio = isnan(diff) ? INFINITY : diff == 0 ? 0 : diff / allowed;
        if (ratio > 1) bad++;
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            worst = i;
        }
    }
    if (verbose())
        fprintf(stderr, "    %-48s worst %.3g of allowed (largest step %.3g)\n", what, worst_ratio,
                maxstep);
    if (bad == 0) return true;
    fprintf(stderr,
            "    %s: %zu of %zu elements out of tolerance; worst [%zu]: got %.9g, want %.9g, "
            "before %.9g (|diff| %.3g = %.3g x allowed; largest step %.3g)\n",
            what, bad, n, worst, got[worst], want[worst], old[worst],
            fabs((double)got[worst] - want[worst]), worst_ratio, maxstep);
    return false;
}

/* The same for golden arrays, by name. */
static bool cmp_golden(const char *what, mti_dtype got_dt, const void *got, const gv_file *f,
                       const char *name, double want_scale, size_t n, tol t)
{
    const gv_array *a = gv_find(f, name);
    CHECK_MSG(a != NULL, "golden array '%s' missing", name);
    CHECK_MSG(a->numel == n && (a->dtype == GV_F32 || a->dtype == GV_F16 || a->dtype == GV_BF16),
              "golden array '%s': %zu elements of %s, expected %zu floats", name, a->numel,
              gv_dtype_name(a->dtype), n);
    return compare(what, got_dt, got, (mti_dtype)a->dtype, a->data, want_scale, n, t);
}

static const struct {
    const char *tag;
    mti_dtype dt;
} DTYPES[] = {{"f32", MTI_F32}, {"f16", MTI_F16}, {"bf16", MTI_BF16}};

/* ------------------------------------------------------------------------ */
/* The reader itself                                                         */
/* ------------------------------------------------------------------------ */

static const char *const ALL_FILES[] = {
    "casts",         "layernorm_f32",   "layernorm_f16",  "layernorm_bf16", "gelu_f32",
    "gelu_f16",      "gelu_bf16",       "attention_f32",  "attention_f16",  "attention_bf16",
    "xent_f32",      "xent_f16",        "xent_bf16",      "matmul_f32",     "matmul_f16",
    "matmul_bf16",   "scaler_interval5", "scaler_default", "scaler_saturate", "adamw",
    "sgd"};

TEST(golden_files_load)
{
    release();
    for (size_t i = 0; i < sizeof ALL_FILES / sizeof *ALL_FILES; i++) {
        const gv_file *f = golden(ALL_FILES[i]);
        CHECK(f->n > 0);
        char want[64];
        snprintf(want, sizeof want, "case=%s ", ALL_FILES[i]);
        CHECK_MSG(strstr(f->header, want) != NULL, "%s: header '%s'", ALL_FILES[i], f->header);
        release(); /* one at a time */
    }
}

/* A little writer for crafted files: the parser's checks past the CRC can
 * only be reached by files whose CRC is right. */
typedef struct wbuf {
    unsigned char b[1024];
    size_t n;
} wbuf;

static void w_bytes(wbuf *w, const void *p, size_t n)
{
    CHECK(w->n + n <= sizeof w->b);
    memcpy(w->b + w->n, p, n);
    w->n += n;
}
static void w_u32(wbuf *w, uint32_t v)
{
    unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 24)};
    w_bytes(w, b, 4);
}
static void w_u64(wbuf *w, uint64_t v)
{
    w_u32(w, (uint32_t)v);
    w_u32(w, (uint32_t)(v >> 32));
}
static void w_start(wbuf *w, uint32_t narrays)
{
    w->n = 0;
    w_bytes(w, "MTGOLD01", 8);
    w_u32(w, 3);
    w_bytes(w, "h=1", 3);
    w_u32(w, narrays);
}
static void w_array_head(wbuf *w, const char *name, uint32_t dt, uint32_t rank,
                         const uint64_t *dims)
{
    w_u32(w, (uint32_t)strlen(name));
    w_bytes(w, name, strlen(name));
    w_u32(w, dt);
    w_u32(w, rank);
    for (uint32_t i = 0; i < rank; i++) w_u64(w, dims[i]);
}
static void w_finish(wbuf *w) { w_u32(w, gv_crc32(0, w->b, w->n)); }

/* Parses w's bytes from a heap copy of exactly that size, so that a read
 * past the end is seen by AddressSanitizer or valgrind. */
static bool try_parse(const unsigned char *b, size_t n, char *err, size_t errlen)
{
    unsigned char *copy = malloc(n ? n : 1);
    CHECK(copy != NULL);
    memcpy(copy, b, n);
    gv_file f;
    bool ok = gv_parse(copy, n, &f, err, errlen);
    if (ok) {
        CHECK(f.header != NULL);
        for (int i = 0; i < f.n; i++) CHECK(f.arrays[i].data != NULL);
    } else {
        CHECK_MSG(err[0] != '\0', "a refusal without a message");
        CHECK(f.n == 0 && f.arrays == NULL && f.header == NULL);
    }
    gv_free(&f);
    free(copy);
    return ok;
}

static void expect_refused(wbuf *w, const char *needle)
{
    char err[400];
    bool ok = try_parse(w->b, w->n, err, sizeof err);
    CHECK_MSG(!ok, "a file that should be refused (%s) was accepted", needle);
    CHECK_MSG(strstr(err, needle) != NULL, "message '%s' does not say '%s'", err, needle);
}

TEST(golden_reader_refuses_bad_files)
{
    release();
    char err[400];
    wbuf w;
    uint64_t d2[2] = {2, 3};

    /* well-formed, to show the writer is right: scalars, empty arrays, no arrays */
    w_start(&w, 0);
    w_finish(&w);
    CHECK_MSG(try_parse(w.b, w.n, err, sizeof err), "%s", err);
    w_start(&w, 2);
    w_array_head(&w, "s", GV_I32, 0, NULL);
    w_u32(&w, 7);
    uint64_t zero[2] = {0, 5};
    w_array_head(&w, "empty", GV_F32, 2, zero);
    w_finish(&w);
    {
        gv_file f;
        CHECK_MSG(gv_parse(w.b, w.n, &f, err, sizeof err), "%s", err);
        const gv_array *s = gv_find(&f, "s"), *e = gv_find(&f, "empty");
        bool good = s && s->numel == 1 && *(int32_t *)s->data == 7 && e && e->numel == 0 &&
                    e->rank == 2 && e->dims[1] == 5 && strcmp(f.header, "h=1") == 0;
        gv_free(&f);
        CHECK(good);
    }

    /* structure wrong, CRC right */
    w_start(&w, 1);
    w_array_head(&w, "a", 99, 1, d2);
    w_finish(&w);
    expect_refused(&w, "unknown dtype");
    w_start(&w, 1);
    w_array_head(&w, "a", GV_F32, 5, (uint64_t[5]){1, 1, 1, 1, 1});
    w_finish(&w);
    expect_refused(&w, "rank");
    w_start(&w, 1);
    w_array_head(&w, "", GV_F32, 1, d2);
    w_finish(&w);
    expect_refused(&w, "name length");
    w_start(&w, 1);
    w_array_head(&w, "a b", GV_F32, 1, d2);
    w_bytes(&w, "\0\0\0\0\0\0\0\0", 8);
    w_finish(&w);
    expect_refused(&w, "name has byte");
    w_start(&w, 1);
    w_u32(&w, 0xFFFFFFFFu); /* name length */
    w_finish(&w);
    expect_refused(&w, "name length");
    /* dimensions whose product wraps around 64 bits, or exceeds the file */
    w_start(&w, 1);
    w_array_head(&w, "a", GV_F32, 3, (uint64_t[3]){1ull << 32, 1ull << 32, 4});
    w_finish(&w);
    expect_refused(&w, "overflows");
    w_start(&w, 1);
    w_array_head(&w, "a", GV_U8, 2, (uint64_t[2]){UINT64_MAX, 2});
    w_finish(&w);
    expect_refused(&w, "too large");
    w_start(&w, 1);
    w_array_head(&w, "a", GV_U8, 3, (uint64_t[3]){1ull << 40, 1ull << 40, 0}); /* empty */
    w_finish(&w);
    CHECK_MSG(try_parse(w.b, w.n, err, sizeof err), "%s", err);
    w_start(&w, 1);
    w_array_head(&w, "a", GV_F32, 2, (uint64_t[2]){4, 4});
    w_bytes(&w, "12345678", 8); /* 8 of 64 bytes */
    w_finish(&w);
    expect_refused(&w, "data needs 64 bytes");
    /* counts and lengths beyond what is there */
    w_start(&w, 3);
    w_array_head(&w, "a", GV_U8, 1, (uint64_t[1]){1});
    w_bytes(&w, "x", 1);
    w_finish(&w);
    expect_refused(&w, "truncated");
    w_start(&w, 0x7FFFFFFFu);
    w_finish(&w);
    expect_refused(&w, "arrays");
    w.n = 0;
    w_bytes(&w, "MTGOLD01", 8);
    w_u32(&w, 0xFFFFFFF0u);
    w_u32(&w, 0);
    w_finish(&w);
    expect_refused(&w, "header length");
    /* a repeated name, bytes after the last array */
    w_start(&w, 2);
    w_array_head(&w, "a", GV_U8, 0, NULL);
    w_bytes(&w, "x", 1);
    w_array_head(&w, "a", GV_U8, 0, NULL);
    w_bytes(&w, "y", 1);
    w_finish(&w);
    expect_refused(&w, "twice");
    w_start(&w, 1);
    w_array_head(&w, "a", GV_U8, 0, NULL);
    w_bytes(&w, "xyz", 3);
    w_finish(&w);
    expect_refused(&w, "after the last array");
    /* not a golden file, too short, CRC wrong */
    w_start(&w, 0);
    w.b[7] = '2';
    w_finish(&w);
    expect_refused(&w, "magic");
    w.n = 5;
    expect_refused(&w, "too short");
    w_start(&w, 0);
    w_finish(&w);
    w.b[w.n - 1] ^= 1;
    expect_refused(&w, "CRC");
    CHECK(!gv_parse(NULL, 10, &(gv_file){0}, err, sizeof err));

    /* a real file: every truncation and every single-byte change is refused
     * (the CRC sees them); with the CRC recomputed, the parser must refuse
     * or accept the change cleanly, never read outside the buffer */
    FILE *fp;
    char path[512];
    snprintf(path, sizeof path, "%s/xent_f32.gv", gv_dir());
    fp = fopen(path, "rb");
    CHECK_MSG(fp != NULL, "cannot open %s", path);
    unsigned char *img = check_alloc(1 << 16);
    size_t size = fread(img, 1, 1 << 16, fp);
    fclose(fp);
    CHECK(size > 100 && size < (1 << 16));
    CHECK_MSG(try_parse(img, size, err, sizeof err), "%s", err);
    size_t step = check_light() ? 7 : 1;
    for (size_t n = 0; n < size; n += step)
        CHECK_MSG(!try_parse(img, n, err, sizeof err), "truncated to %zu bytes: accepted", n);
    unsigned char *mod = check_alloc(size);
    for (size_t i = 0; i < size - 4; i += step) {
        static const unsigned char flips[] = {0x01, 0x80, 0xFF};
        for (size_t k = 0; k < sizeof flips; k++) {
            memcpy(mod, img, size);
            mod[i] ^= flips[k];
            CHECK_MSG(!try_parse(mod, size, err, sizeof err), "byte %zu changed: accepted", i);
            uint32_t crc = gv_crc32(0, mod, size - 4);
            for (int b = 0; b < 4; b++) mod[size - 4 + (size_t)b] = (unsigned char)(crc >> (8 * b));
            (void)try_parse(mod, size, err, sizeof err);
        }
    }

    /* files that are not there, or not files */
    gv_file f;
    CHECK(!gv_load("test/golden/no-such-file.gv", &f, err, sizeof err));
    CHECK(strstr(err, "no-such-file") != NULL);
    CHECK(!gv_load(gv_dir(), &f, err, sizeof err)); /* a directory */
    CHECK(err[0] != '\0');
    release();
}

/* ------------------------------------------------------------------------ */
/* Casts: bit-exact                                                          */
/* ------------------------------------------------------------------------ */

static bool is_nan16(uint16_t h, bool bf16)
{
    if (bf16) return (h & 0x7F80u) == 0x7F80u && (h & 0x7Fu);
    return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu);
}

/* Counts the elements where got differs from want, NaN matching any NaN. */
static size_t diff16(const char *what, const float *in, const uint16_t *got, const uint16_t *want,
                     size_t n, bool bf16)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        bool same = is_nan16(want[i], bf16) ? is_nan16(got[i], bf16) : got[i] == want[i];
        if (same) continue;
        if (bad++ < 8) {
            uint32_t u;
            memcpy(&u, &in[i], 4);
            fprintf(stderr, "    %s [%zu]: %.9g (0x%08x) -> 0x%04x, torch 0x%04x\n", what, i, in[i],
                    u, got[i], want[i]);
        }
    }
    return bad;
}

static size_t diff32(const char *what, const uint16_t *in, const float *got, const float *want,
                     size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t g, w;
        memcpy(&g, &got[i], 4);
        memcpy(&w, &want[i], 4);
        bool same = isnan(want[i]) ? isnan(got[i]) : g == w;
        if (!same && bad++ < 8)
            fprintf(stderr, "    %s [%zu]: 0x%04x -> 0x%08x, torch 0x%08x\n", what, i, in[i], g, w);
    }
    return bad;
}

TEST(golden_casts)
{
    const mti_ops *ops;
    mti_kctx k = setup(&ops);
    const gv_file *f = golden("casts");
    const gv_array *a = gv_find(f, "f32_in");
    CHECK(a != NULL && a->dtype == GV_F32);
    size_t n = a->numel;
    const float *in = a->data;
    const uint16_t *h_want = arr(f, "f16_out", GV_F16, n), *b_want = arr(f, "bf16_out", GV_BF16, n);
    uint16_t *got = check_alloc(n * 2);
    size_t bad = 0;

    /* fp32 -> fp16 / bf16: the scalar definitions, then the op table */
    for (size_t i = 0; i < n; i++) got[i] = mti_f32_to_f16(in[i]);
    bad += diff16("mti_f32_to_f16", in, got, h_want, n, false);
    for (size_t i = 0; i < n; i++) got[i] = mti_f32_to_bf16(in[i]);
    bad += diff16("mti_f32_to_bf16", in, got, b_want, n, true);
    memset(got, 0, n * 2);
    CHECK_OK(ops->cast(&k, got, MTI_F16, in, MTI_F32, n, MTI_ROUND_NEAREST, 0));
    bad += diff16("cast f32->f16", in, got, h_want, n, false);
    memset(got, 0, n * 2);
    CHECK_OK(ops->cast(&k, got, MTI_BF16, in, MTI_F32, n, MTI_ROUND_NEAREST, 0));
    bad += diff16("cast f32->bf16", in, got, b_want, n, true);

    /* fp16 / bf16 -> fp32 on the sampled patterns */
    const struct {
        const char *in, *out, *what;
        gv_dtype dt;
        mti_dtype mdt;
        float (*conv)(uint16_t);
    } up[] = {{"h_in", "h_to_f32", "fp16->fp32", GV_F16, MTI_F16, mti_f16_to_f32},
              {"b_in", "b_to_f32", "bf16->fp32", GV_BF16, MTI_BF16, mti_bf16_to_f32}};
    for (int u = 0; u < 2; u++) {
        const gv_array *pa = gv_find(f, up[u].in);
        CHECK(pa != NULL && pa->dtype == up[u].dt);
        size_t m = pa->numel;
        const uint16_t *pin = pa->data;
        const float *want = arr(f, up[u].out, GV_F32, m);
        float *g32 = check_alloc(m * 4);
        for (size_t i = 0; i < m; i++) g32[i] = up[u].conv(pin[i]);
        bad += diff32(up[u].what, pin, g32, want, m);
        memset(g32, 0, m * 4);
        CHECK_OK(ops->cast(&k, g32, MTI_F32, pin, up[u].mdt, m, MTI_ROUND_NEAREST, 0));
        bad += diff32(up[u].what, pin, g32, want, m);
    }

    /* all 65536 patterns, against torch's CRC of its results (NaNs made
     * 0x7FC00000 on both sides) */
    uint16_t *all = check_alloc(65536 * 2);
    float *all32 = check_alloc(65536 * 4);
    for (uint32_t p = 0; p < 65536; p++) all[p] = (uint16_t)p;
    const struct {
        const char *crc;
        mti_dtype dt;
        float (*conv)(uint16_t);
    } full[] = {{"h_all_crc", MTI_F16, mti_f16_to_f32}, {"b_all_crc", MTI_BF16, mti_bf16_to_f32}};
    for (int u = 0; u < 2; u++) {
        uint32_t want = (uint32_t)scalar_i32(f, full[u].crc);
        for (int via_op = 0; via_op < 2; via_op++) {
            if (via_op)
                CHECK_OK(ops->cast(&k, all32, MTI_F32, all, full[u].dt, 65536,
                                   MTI_ROUND_NEAREST, 0));
            else
                for (uint32_t p = 0; p < 65536; p++) all32[p] = full[u].conv((uint16_t)p);
            uint32_t crc = 0;
            for (uint32_t p = 0; p < 65536; p++) {
                uint32_t bits;
                memcpy(&bits, &all32[p], 4);
                if (isnan(all32[p])) bits = 0x7FC00000u;
                unsigned char le[4] = {(unsigned char)bits, (unsigned char)(bits >> 8),
                                       (unsigned char)(bits >> 16), (unsigned char)(bits >> 24)};
                crc = gv_crc32(crc, le, 4);
            }
            if (crc != want) {
                fprintf(stderr, "    %s of all 65536 patterns (%s): CRC %08x, torch %08x\n",
                        full[u].dt == MTI_F16 ? "fp16->fp32" : "bf16->fp32",
                        via_op ? "op table" : "scalar", crc, want);
                bad++;
            }
        }
    }
    CHECK_MSG(bad == 0, "%zu cast results differ from torch", bad);
    release();
}

/* ------------------------------------------------------------------------ */
/* Layernorm                                                                 */
/* ------------------------------------------------------------------------ */

TEST(golden_layernorm)
{
    for (size_t d = 0; d < 3; d++) {
        const mti_ops *ops;
        mti_kctx k = setup(&ops);
        mti_dtype dt = DTYPES[d].dt;
        gv_dtype gdt = (gv_dtype)dt;
        char name[64];
        snprintf(name, sizeof name, "layernorm_%s", DTYPES[d].tag);
        const gv_file *f = golden(name);
        int N = scalar_i32(f, "N"), C = scalar_i32(f, "C");
        size_t nc = (size_t)N * (size_t)C, es = dsize(dt);
        const void *x = arr(f, "x", gdt, nc), *w = arr(f, "w", gdt, (size_t)C),
                   *b = arr(f, "b", gdt, (size_t)C), *dout = arr(f, "dout", gdt, nc);
        const float *mean_w = arr(f, "mean", GV_F32, (size_t)N),
                    *rstd_w = arr(f, "rstd", GV_F32, (size_t)N);
        bool ok = true;
        char what[96];
#define WHAT(s) (snprintf(what, sizeof what, "%s %s", name, s), what)

        void *out = tnan(nc * es);
        float *mean = tnan((size_t)N * 4), *rstd = tnan((size_t)N * 4);
        CHECK_OKC(g_ctx, ops->layernorm_fwd(&k, out, mean, rstd, x, w, b, N, C, dt));
        ok &= cmp_golden(WHAT("out"), dt, out, f, "out", 1, nc, TOL_OUT[dt]);
        ok &= cmp_golden(WHAT("mean"), MTI_F32, mean, f, "mean", 1, (size_t)N, TOL_F32_OUT);
        ok &= cmp_golden(WHAT("rstd"), MTI_F32, rstd, f, "rstd", 1, (size_t)N, TOL_F32_OUT);
        /* mean and rstd are optional outputs; out must not change with them */
        void *out2 = tnan(nc * es);
        CHECK_OKC(g_ctx, ops->layernorm_fwd(&k, out2, NULL, NULL, x, w, b, N, C, dt));
        CHECK_MSG(memcmp(out, out2, nc * es) == 0, "%s: out differs without mean and rstd", name);

        /* backward from torch's saved statistics; dx is overwritten, dw and
         * db accumulate */
        void *dx = tnan(nc * es);
        float *dw = check_alloc((size_t)C * 4), *db = check_alloc((size_t)C * 4);
        CHECK_OKC(g_ctx,
                  ops->layernorm_bwd(&k, dx, dw, db, dout, x, w, mean_w, rstd_w, N, C, dt, 0));
        ok &= cmp_golden(WHAT("dx"), dt, dx, f, "dx", 1, nc, TOL_OUT[dt]);
        ok &= cmp_golden(WHAT("dw"), MTI_F32, dw, f, "dw", 1, (size_t)C, TOL_F32_OUT);
        ok &= cmp_golden(WHAT("db"), MTI_F32, db, f, "db", 1, (size_t)C, TOL_F32_OUT);
        /* again with accumulate: dx, dw and db each hold twice the gradient */
        CHECK_OKC(g_ctx,
                  ops->layernorm_bwd(&k, dx, dw, db, dout, x, w, mean_w, rstd_w, N, C, dt, 1));
        ok &= cmp_golden(WHAT("dx accumulated"), dt, dx, f, "dx", 2, nc, TOL_OUT[dt]);
        ok &= cmp_golden(WHAT("dw accumulated"), MTI_F32, dw, f, "dw", 2, (size_t)C, TOL_F32_OUT);
        ok &= cmp_golden(WHAT("db accumulated"), MTI_F32, db, f, "db", 2, (size_t)C, TOL_F32_OUT);
        CHECK_MSG(ok, "%s: results differ from torch beyond tolerance", name);
#undef WHAT
    }
    release();
}

/* ------------------------------------------------------------------------ */
/* GELU (tanh form)                                                          */
/* ------------------------------------------------------------------------ */

TEST(golden_gelu)
{
    for (size_t d = 0; d < 3; d++) {
        const mti_ops *ops;
        mti_kctx k = setup(&ops);
        mti_dtype dt = DTYPES[d].dt;
        char name[64], what[96];
        snprintf(name, sizeof name, "gelu_%s", DTYPES[d].tag);
        const gv_file *f = golden(name);
        const gv_array *xa = gv_find(f, "x");
        CHECK(xa != NULL);
        size_t n = xa->numel, es = dsize(dt);
        const void *x = arr(f, "x", (gv_dtype)dt, n), *dy = arr(f, "dy", (gv_dtype)dt, n);
        bool ok = true;

        void *y = tnan(n * es);
        CHECK_OKC(g_ctx, ops->gelu_fwd(&k, y, x, n, dt));
        snprintf(what, sizeof what, "%s y", name);
        ok &= cmp_golden(what, dt, y, f, "y", 1, n, TOL_OUT[dt]);
        void *dx = tnan(n * es);
        CHECK_OKC(g_ctx, ops->gelu_bwd(&k, dx, dy, x, n, dt));
        snprintf(what, sizeof what, "%s dx", name);
        ok &= cmp_golden(what, dt, dx, f, "dx", 1, n, TOL_OUT[dt]);

        /* in place (y over x, dx over dy): the same bits */
        void *inplace = check_copy(x, n * es);
        CHECK_OKC(g_ctx, ops->gelu_fwd(&k, inplace, inplace, n, dt));
        CHECK_MSG(memcmp(inplace, y, n * es) == 0, "%s: gelu_fwd in place differs", name);
        inplace = check_copy(dy, n * es);
        CHECK_OKC(g_ctx, ops->gelu_bwd(&k, inplace, inplace, x, n, dt));
        CHECK_MSG(memcmp(inplace, dx, n * es) == 0, "%s: gelu_bwd in place differs", name);
        CHECK_MSG(ok, "%s: results differ from torch beyond tolerance", name);
    }
    release();
}

/* ------------------------------------------------------------------------ */
/* Causal self-attention                                                     */
/* ------------------------------------------------------------------------ */

TEST(golden_attention)
{
    for (size_t d = 0; d < 3; d++) {
        const mti_ops *ops;
        mti_kctx k = setup(&ops);
        mti_dtype dt = DTYPES[d].dt;
        gv_dtype gdt = (gv_dtype)dt;
        char name[64], what[96];
        snprintf(name, sizeof name, "attention_%s", DTYPES[d].tag);
        const gv_file *f = golden(name);
        int B = scalar_i32(f, "B"), T = scalar_i32(f, "T"), C = scalar_i32(f, "C"),
            H = scalar_i32(f, "H");
        size_t btc = (size_t)B * (size_t)T * (size_t)C, bht = (size_t)B * (size_t)H * (size_t)T;
        size_t es = dsize(dt);
        const void *qkv = arr(f, "qkv", gdt, 3 * btc), *dout = arr(f, "dout", gdt, btc),
                   *out_w = arr(f, "out", gdt, btc);
        const float *lse_w = arr(f, "lse", GV_F32, bht);
        bool ok = true;

        void *out = tnan(btc * es);
        float *lse = tnan(bht * 4);
        CHECK_OKC(g_ctx, ops->attention_fwd(&k, out, lse, qkv, B, T, C, H, dt));
        snprintf(what, sizeof what, "%s out", name);
        ok &= cmp_golden(what, dt, out, f, "out", 1, btc, TOL_OUT[dt]);
        snprintf(what, sizeof what, "%s lse", name);
        ok &= cmp_golden(what, MTI_F32, lse, f, "lse", 1, bht, TOL_F32_OUT);

        /* backward from torch's forward results (out as stored in the
         * dtype, lse), so a forward difference does not show up twice */
        void *dqkv = tnan(3 * btc * es);
        CHECK_OKC(g_ctx, ops->attention_bwd(&k, dqkv, dout, qkv, out_w, lse_w, B, T, C, H, dt));
        snprintf(what, sizeof what, "%s dqkv", name);
        ok &= cmp_golden(what, dt, dqkv, f, "dqkv", 1, 3 * btc, TOL_OUT[dt]);
        CHECK_MSG(ok, "%s: results differ from torch beyond tolerance", name);
    }
    release();
}

/* ------------------------------------------------------------------------ */
/* Softmax cross-entropy over a padded vocabulary                            */
/* ------------------------------------------------------------------------ */

TEST(golden_xent)
{
    for (size_t d = 0; d < 3; d++) {
        const mti_ops *ops;
        mti_kctx k = setup(&ops);
        mti_dtype dt = DTYPES[d].dt;
        char name[64], what[96];
        snprintf(name, sizeof name, "xent_%s", DTYPES[d].tag);
        const gv_file *f = golden(name);
        int N = scalar_i32(f, "N"), V = scalar_i32(f, "V"), Vp = scalar_i32(f, "Vp");
        float dloss = scalar_f32(f, "dloss");
        size_t nv = (size_t)N * (size_t)Vp, es = dsize(dt);
        const void *logits = arr(f, "logits", (gv_dtype)dt, nv);
        const int32_t *targets = arr(f, "targets", GV_I32, (size_t)N);
        bool ok = true;

        float *losses = tnan((size_t)N * 4);
        void *dl = tnan(nv * es);
        CHECK_OKC(g_ctx, ops->xent(&k, losses, dl, logits, targets, N, V, Vp, dloss, dt));
        snprintf(what, sizeof what, "%s losses", name);
        ok &= cmp_golden(what, MTI_F32, losses, f, "losses", 1, (size_t)N, TOL_F32_OUT);
        snprintf(what, sizeof what, "%s dlogits", name);
        ok &= cmp_golden(what, dt, dl, f, "dlogits", 1, nv, TOL_OUT[dt]);

        /* dlogits over logits, as the engine calls it */
        void *inplace = check_copy(logits, nv * es);
        float *losses2 = tnan((size_t)N * 4);
        CHECK_OKC(g_ctx, ops->xent(&k, losses2, inplace, inplace, targets, N, V, Vp, dloss, dt));
        CHECK_MSG(memcmp(inplace, dl, nv * es) == 0, "%s: dlogits in place differ", name);
        CHECK_MSG(memcmp(losses2, losses, (size_t)N * 4) == 0, "%s: losses differ in place", name);
        /* losses only */
        float *losses3 = tnan((size_t)N * 4);
        CHECK_OKC(g_ctx, ops->xent(&k, losses3, NULL, logits, targets, N, V, Vp, dloss, dt));
        CHECK_MSG(memcmp(losses3, losses, (size_t)N * 4) == 0,
                  "%s: losses differ without dlogits", name);
        CHECK_MSG(ok, "%s: results differ from torch beyond tolerance", name);
    }
    release();
}

/* ------------------------------------------------------------------------ */
/* Matmul with bias                                                          */
/* ------------------------------------------------------------------------ */

TEST(golden_matmul)
{
    for (size_t d = 0; d < 3; d++) {
        const mti_ops *ops;
        mti_kctx k = setup(&ops);
        mti_dtype dt = DTYPES[d].dt;
        gv_dtype gdt = (gv_dtype)dt;
        char name[64], what[96];
        snprintf(name, sizeof name, "matmul_%s", DTYPES[d].tag);
        const gv_file *f = golden(name);
        int N = scalar_i32(f, "N"), I = scalar_i32(f, "I"), O = scalar_i32(f, "O");
        size_t ni = (size_t)N * (size_t)I, no = (size_t)N * (size_t)O, oi = (size_t)O * (size_t)I;
        size_t es = dsize(dt);
        const void *x = arr(f, "x", gdt, ni), *w = arr(f, "w", gdt, oi),
                   *b = arr(f, "b", gdt, (size_t)O), *dy = arr(f, "dy", gdt, no);
        bool ok = true;
#define WHAT(s) (snprintf(what, sizeof what, "%s %s", name, s), what)

        void *y = tnan(no * es);
        CHECK_OKC(g_ctx, ops->matmul_fwd(&k, y, x, w, b, N, I, O, dt));
        ok &= cmp_golden(WHAT("y"), dt, y, f, "y", 1, no, TOL_OUT[dt]);
        CHECK_OKC(g_ctx, ops->matmul_fwd(&k, y, x, w, NULL, N, I, O, dt));
        ok &= cmp_golden(WHAT("y without bias"), dt, y, f, "y_nobias", 1, no, TOL_OUT[dt]);

        void *dx = tnan(ni * es);
        float *dw = check_alloc(oi * 4), *db = check_alloc((size_t)O * 4);
        CHECK_OKC(g_ctx, ops->matmul_bwd(&k, dx, dw, db, dy, x, w, N, I, O, dt, 0));
        ok &= cmp_golden(WHAT("dx"), dt, dx, f, "dx", 1, ni, TOL_OUT[dt]);
        ok &= cmp_golden(WHAT("dw"), MTI_F32, dw, f, "dw", 1, oi, TOL_F32_OUT);
        ok &= cmp_golden(WHAT("db"), MTI_F32, db, f, "db", 1, (size_t)O, TOL_F32_OUT);
        CHECK_OKC(g_ctx, ops->matmul_bwd(&k, dx, dw, db, dy, x, w, N, I, O, dt, 1));
        ok &= cmp_golden(WHAT("dx accumulated"), dt, dx, f, "dx", 2, ni, TOL_OUT[dt]);
        ok &= cmp_golden(WHAT("dw accumulated"), MTI_F32, dw, f, "dw", 2, oi, TOL_F32_OUT);
        ok &= cmp_golden(WHAT("db accumulated"), MTI_F32, db, f, "db", 2, (size_t)O, TOL_F32_OUT);

        /* each output may be left out */
        float *dw1 = check_alloc(oi * 4), *db1 = check_alloc((size_t)O * 4);
        void *dx1 = tnan(ni * es);
        CHECK_OKC(g_ctx, ops->matmul_bwd(&k, NULL, dw1, NULL, dy, x, w, N, I, O, dt, 0));
        ok &= cmp_golden(WHAT("dw alone"), MTI_F32, dw1, f, "dw", 1, oi, TOL_F32_OUT);
        CHECK_OKC(g_ctx, ops->matmul_bwd(&k, NULL, NULL, db1, dy, x, w, N, I, O, dt, 0));
        ok &= cmp_golden(WHAT("db alone"), MTI_F32, db1, f, "db", 1, (size_t)O, TOL_F32_OUT);
        CHECK_OKC(g_ctx, ops->matmul_bwd(&k, dx1, NULL, NULL, dy, x, w, N, I, O, dt, 0));
        ok &= cmp_golden(WHAT("dx alone"), dt, dx1, f, "dx", 1, ni, TOL_OUT[dt]);
        CHECK_MSG(ok, "%s: results differ from torch beyond tolerance", name);
#undef WHAT
    }
    release();
}

/* ------------------------------------------------------------------------ */
/* GradScaler: exact                                                         */
/* ------------------------------------------------------------------------ */

static bool same_bits(float a, float b)
{
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    return memcmp(&a, &b, sizeof a) == 0;
}

TEST(golden_grad_scaler)
{
    static const char *const runs[] = {"scaler_interval5", "scaler_default", "scaler_saturate"};
    for (int r = 0; r < 3; r++) {
        const mti_ops *ops;
        mti_kctx k = setup(&ops);
        const gv_file *f = golden(runs[r]);
        const gv_array *sa = gv_find(f, "found_inf");
        const gv_array *pa = gv_find(f, "params");
        CHECK(sa != NULL && pa != NULL && pa->rank == 2);
        size_t steps = sa->numel, np = (size_t)pa->dims[1];
        CHECK((size_t)pa->dims[0] == steps + 1);
        const float *params = arr(f, "params", GV_F32, (steps + 1) * np);
        const float *gs = arr(f, "grads_scaled", GV_F32, steps * np),
                    *gu = arr(f, "grads_unscaled", GV_F32, steps * np),
                    *scale_used = arr(f, "scale_used", GV_F32, steps),
                    *scale_after = arr(f, "scale_after", GV_F32, steps);
        const int32_t *found_w = arr(f, "found_inf", GV_I32, steps),
                      *skipped = arr(f, "skipped", GV_I32, steps),
                      *tracker = arr(f, "tracker_after", GV_I32, steps);
        float lr = scalar_f32(f, "lr");

        mti_scaler s;
        mti_scaler_init(&s, scalar_f32(f, "init_scale"), scalar_f32(f, "growth_factor"),
                        scalar_f32(f, "backoff_factor"), scalar_i32(f, "growth_interval"), 1);
        float *g = check_alloc(np * 4), *p = check_alloc(np * 4), *m = check_alloc(np * 4);
        bool ok = true;
        for (size_t t = 0; t < steps; t++) {
            CHECK_MSG(same_bits(s.scale, scale_used[t]), "%s step %zu: scale %.9g, torch %.9g",
                      runs[r], t, s.scale, scale_used[t]);
            /* unscale and check: 1/scale formed as torch does (in double,
             * stored as fp32); a power of two, so the products are exact */
            memcpy(g, gs + t * np, np * 4);
            int found = 0;
            float inv = (float)(1.0 / (double)s.scale);
            CHECK(inv == mti_scaler_inv(&s));
            CHECK_OKC(g_ctx, ops->unscale_check(&k, g, np, inv, &found));
            CHECK_MSG(found == found_w[t], "%s step %zu: found_inf %d, torch %d", runs[r], t, found,
                      found_w[t]);
            for (size_t i = 0; i < np; i++)
                CHECK_MSG(same_bits(g[i], gu[t * np + i]),
                          "%s step %zu: unscaled gradient %zu is %.9g, torch %.9g", runs[r], t, i,
                          g[i], gu[t * np + i]);
            /* the step: skipped on overflow, else plain SGD from torch's
             * parameters (so each step is checked on its own) */
            CHECK(skipped[t] == found_w[t]);
            memcpy(p, params + t * np, np * 4);
            if (!found) {
                mti_sgd_args a = {.lr = lr, .grad_scale = 1.0f, .first_step = 1};
                CHECK_OKC(g_ctx, ops->sgd(&k, p, g, m, NULL, MTI_F32, np, &a));
                char what[96];
                snprintf(what, sizeof what, "%s step %zu params", runs[r], t);
                ok &= compare_step(what, p, params + (t + 1) * np, params + t * np, np);
            } else {
                CHECK_MSG(memcmp(params + t * np, params + (t + 1) * np, np * 4) == 0,
                          "%s step %zu: torch changed the parameters on a skipped step", runs[r],
                          t);
            }
            mti_scaler_update(&s, found);
            CHECK_MSG(same_bits(s.scale, scale_after[t]) && s.growth_tracker == tracker[t],
                      "%s step %zu: after update scale %.9g tracker %d, torch %.9g tracker %d",
                      runs[r], t, s.scale, s.growth_tracker, scale_after[t], tracker[t]);
        }
        CHECK_MSG(ok, "%s: parameters differ from torch beyond tolerance", runs[r]);
    }
    release();
}

/* ------------------------------------------------------------------------ */
/* Optimizers                                                                */
/* ------------------------------------------------------------------------ */

/* The compute copy an update writes must be the updated master rounded to
 * nearest even, bit for bit. */
static bool check_pc(const char *what, const float *p, const uint16_t *pc, mti_dtype dt, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t want = dt == MTI_BF16 ? mti_f32_to_bf16(p[i]) : mti_f32_to_f16(p[i]);
        if (pc[i] != want) {
            fprintf(stderr, "    %s: compute copy [%zu] 0x%04x, master %.9g rounds to 0x%04x\n",
                    what, i, pc[i], p[i], want);
            return false;
        }
    }
    return true;
}

/* Gradients are passed pre-multiplied by this and unscaled by grad_scale in
 * the second pass: a power of two, so the results must not change. */
#define GRAD_PRESCALE 1024.0f

TEST(golden_sgd)
{
    const mti_ops *ops;
    mti_kctx k = setup(&ops);
    const gv_file *f = golden("sgd");
    int ncfg = scalar_i32(f, "configs");
    bool ok = true;
    for (int c = 0; c < ncfg; c++) {
        char key[64], what[128];
#define KEY(s) (snprintf(key, sizeof key, "c%d.%s", c, s), key)
        const gv_array *pa = gv_find(f, KEY("params"));
        CHECK(pa != NULL && pa->rank == 2);
        size_t steps = (size_t)pa->dims[0] - 1, n = (size_t)pa->dims[1];
        const float *params = arr(f, KEY("params"), GV_F32, (steps + 1) * n);
        const float *grads = arr(f, KEY("grads"), GV_F32, steps * n);
        const float *mom = arr(f, KEY("m"), GV_F32, steps * n);
        mti_sgd_args a = {.lr = scalar_f32(f, KEY("lr")),
                          .momentum = scalar_f32(f, KEY("momentum")),
                          .dampening = scalar_f32(f, KEY("dampening")),
                          .weight_decay = scalar_f32(f, KEY("weight_decay")),
                          .nesterov = scalar_i32(f, KEY("nesterov"))};
#undef KEY
        float *p = check_alloc(n * 4), *g = check_alloc(n * 4), *m = check_alloc(n * 4);
        uint16_t *pc = check_alloc(n * 2);
        for (int pass = 0; pass < 2; pass++) {
            for (size_t t = 0; t < steps; t++) {
                /* each step from torch's state after the previous one */
                memcpy(p, params + t * n, n * 4);
                if (t > 0) memcpy(m, mom + (t - 1) * n, n * 4);
                else memset(m, 0, n * 4);
                for (size_t i = 0; i < n; i++)
                    g[i] = grads[t * n + i] * (pass ? GRAD_PRESCALE : 1.0f);
                a.first_step = t == 0;
                a.grad_scale = pass ? 1.0f / GRAD_PRESCALE : 1.0f;
                CHECK_OKC(g_ctx, ops->sgd(&k, p, g, m, pass ? pc : NULL, MTI_F16, n, &a));
                snprintf(what, sizeof what, "sgd config %d step %zu%s params", c, t,
                         pass ? " (scaled grads, fp16 copy)" : "");
                ok &= compare_step(what, p, params + (t + 1) * n, params + t * n, n);
                if (a.momentum > 0) {
                    snprintf(what, sizeof what, "sgd config %d step %zu%s momentum", c, t,
                             pass ? " (scaled grads)" : "");
                    ok &= compare(what, MTI_F32, m, MTI_F32, mom + t * n, 1, n, TOL_OPTIM);
                }
                if (pass) ok &= check_pc(what, p, pc, MTI_F16, n);
            }
        }
    }
    CHECK_MSG(ok, "sgd: results differ from torch beyond tolerance");
    release();
}

TEST(golden_adamw)
{
    const mti_ops *ops;
    mti_kctx k = setup(&ops);
    const gv_file *f = golden("adamw");
    int ncfg = scalar_i32(f, "configs");
    bool ok = true;
    for (int c = 0; c < ncfg; c++) {
        char key[64], what[128];
#define KEY(s) (snprintf(key, sizeof key, "c%d.%s", c, s), key)
        const gv_array *pa = gv_find(f, KEY("params"));
        CHECK(pa != NULL && pa->rank == 2);
        size_t steps = (size_t)pa->dims[0] - 1, n = (size_t)pa->dims[1];
        const float *params = arr(f, KEY("params"), GV_F32, (steps + 1) * n);
        const float *grads = arr(f, KEY("grads"), GV_F32, steps * n);
        const float *mw = arr(f, KEY("m"), GV_F32, steps * n);
        const float *vw = arr(f, KEY("v"), GV_F32, steps * n);
        mti_adamw_args a = {.lr = scalar_f32(f, KEY("lr")),
                            .beta1 = scalar_f32(f, KEY("beta1")),
                            .beta2 = scalar_f32(f, KEY("beta2")),
                            .eps = scalar_f32(f, KEY("eps")),
                            .weight_decay = scalar_f32(f, KEY("weight_decay"))};
#undef KEY
        float *p = check_alloc(n * 4), *g = check_alloc(n * 4), *m = check_alloc(n * 4), *v = check_alloc(n * 4);
        uint16_t *pc = check_alloc(n * 2);
        for (int pass = 0; pass < 2; pass++) {
            for (size_t t = 0; t < steps; t++) {
                memcpy(p, params + t * n, n * 4);
                if (t > 0) {
                    memcpy(m, mw + (t - 1) * n, n * 4);
                    memcpy(v, vw + (t - 1) * n, n * 4);
                } else {
                    memset(m, 0, n * 4);
                    memset(v, 0, n * 4);
                }
                for (size_t i = 0; i < n; i++)
                    g[i] = grads[t * n + i] * (pass ? GRAD_PRESCALE : 1.0f);
                a.step = (int64_t)t + 1;
                a.grad_scale = pass ? 1.0f / GRAD_PRESCALE : 1.0f;
                CHECK_OKC(g_ctx, ops->adamw(&k, p, g, m, v, pass ? pc : NULL, MTI_BF16, n, &a));
                const char *sfx = pass ? " (scaled grads, bf16 copy)" : "";
                snprintf(what, sizeof what, "adamw config %d step %zu%s params", c, t, sfx);
                ok &= compare_step(what, p, params + (t + 1) * n, params + t * n, n);
                snprintf(what, sizeof what, "adamw config %d step %zu%s m", c, t, sfx);
                ok &= compare(what, MTI_F32, m, MTI_F32, mw + t * n, 1, n, TOL_OPTIM);
                snprintf(what, sizeof what, "adamw config %d step %zu%s v", c, t, sfx);
                ok &= compare(what, MTI_F32, v, MTI_F32, vw + t * n, 1, n, TOL_OPTIM);
                if (pass) ok &= check_pc(what, p, pc, MTI_BF16, n);
            }
        }
    }
    CHECK_MSG(ok, "adamw: results differ from torch beyond tolerance");
    release();
}
