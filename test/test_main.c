/*
 * test_main.c - runs the registered tests.
 * Usage: mt_tests [filter ...]             (no argument: every test)
 *        mt_tests --list [filter ...]      the names it would run, one a line
 * A filter is a substring of test names, or a source file's name ending
 * in .c (test_ops.c: every test of test/test_ops.c); a filter that starts
 * with '-' leaves out the tests it names (-every_optimizer).
 */
#include <math.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "check.h"

#define MAX_TESTS 1024

typedef struct test_entry {
    const char *name;
    check_fn fn;
    const char *file;
} test_entry;
static test_entry tests[MAX_TESTS];
static int n_tests;
static jmp_buf jump;
static _Atomic int notes;

void check_register(const char *name, check_fn fn, const char *file)
{
    if (n_tests < MAX_TESTS) tests[n_tests++] = (test_entry){name, fn, file};
}

/* A test a filter selects: by a substring of its name, or by its file's
 * name (a filter ending in .c). */
static bool selects(const test_entry *t, const char *filter)
{
    const size_t n = strlen(filter);
    if (n > 2 && !strcmp(filter + n - 2, ".c")) {
        const char *base = strrchr(t->file, '/');
        return !strcmp(base ? base + 1 : t->file, filter);
    }
    return strstr(t->name, filter) != NULL;
}

void check_fail(const char *file, int line, const char *what)
{
    fprintf(stderr, "    %s:%d: failed: %s\n", file, line, what);
    longjmp(jump, 1);
}

void check_note(const char *file, int line, const char *what)
{
    fprintf(stderr, "    %s:%d: failed: %s\n", file, line, what);
    atomic_fetch_add(&notes, 1);
}

bool check_long(void)
{
    const char *v = getenv("MT_TEST_LONG");
    return v && *v && strcmp(v, "0") != 0;
}

bool check_light(void)
{
    const char *v = getenv("MT_TEST_LIGHT");
    return v && *v && strcmp(v, "0") != 0;
}

const char *check_fake_cuda(void)
{
    const char *v = getenv("MT_FAKE_CUDA");
    return v && *v ? v : NULL;
}

size_t check_search_in(const char *dir, size_t (*list)(char (*)[512], size_t), char (*out)[512],
                       size_t max)
{
    char p[600];
    char *old_path = getenv("PATH") ? strdup(getenv("PATH")) : NULL;
    char *old_home = getenv("CUDA_HOME") ? strdup(getenv("CUDA_HOME")) : NULL;
    snprintf(p, sizeof p, "%s/venv/bin:%s", dir, old_path ? old_path : "/usr/bin");
    setenv("PATH", p, 1);
    snprintf(p, sizeof p, "%s/cuda", dir);
    setenv("CUDA_HOME", p, 1);
    size_t n = list(out, max);
    if (old_path) setenv("PATH", old_path, 1);
    if (old_home) setenv("CUDA_HOME", old_home, 1);
    else unsetenv("CUDA_HOME");
    free(old_path), free(old_home);
    return n;
}

long check_find_path(char (*list)[512], size_t n, const char *path)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(list[i], path)) return (long)i;
    return -1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The running test's scratch memory (check_alloc). */
static void **held;
static size_t n_held, cap_held;

void *check_alloc(size_t bytes)
{
    if (n_held == cap_held) {
        size_t cap = cap_held ? cap_held * 2 : 64;
        void **h = realloc(held, cap * sizeof *h);
        CHECK(h != NULL);
        held = h, cap_held = cap;
    }
    void *p = calloc(1, bytes ? bytes : 1);
    CHECK(p != NULL);
    held[n_held++] = p;
    return p;
}

void *check_copy(const void *src, size_t bytes)
{
    void *p = check_alloc(bytes);
    if (bytes) memcpy(p, src, bytes);
    return p;
}

mt_context *check_cpu_context(int threads)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.threads = threads;
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    return ctx;
}

mt_model *check_small_gpt(mt_context *ctx, int vocab, int max_seq, int channels, uint64_t seed)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = vocab, g.max_seq = max_seq, g.layers = 2, g.heads = 4, g.channels = channels;
    g.seed = seed;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    return m;
}

static const char *gpu_mode(void)
{
    const char *gpu = getenv("MT_TEST_GPU");
    return gpu && (!strcmp(gpu, "1") || !strcmp(gpu, "standin")) ? gpu : NULL;
}

bool check_gpu_values(void)
{
    const char *gpu = gpu_mode();
    return !gpu || strcmp(gpu, "standin") != 0;
}

mt_context *check_gpu_context(void)
{
    if (!gpu_mode()) return NULL;
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CUDA;
    if (!check_gpu_values()) {
        cfg.cuda_driver_path = check_fake_cuda();
        cfg.cublaslt_path = getenv("MT_FAKE_CUBLASLT");
        CHECK_MSG(cfg.cuda_driver_path && cfg.cublaslt_path,
                  "MT_TEST_GPU=standin needs MT_FAKE_CUDA and MT_FAKE_CUBLASLT");
    }
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    return ctx;
}

void check_gpu_near_cpu(const float *g_gpu, const float *g_cpu, size_t n, const float *l_gpu,
                        const float *l_cpu)
{
    if (!check_gpu_values()) return;
    for (size_t j = 0; j < n; j++)
        CHECK_MSG(fabsf(g_gpu[j] - g_cpu[j]) <= 1e-4f, "gradient %zu: gpu %.7g cpu %.7g", j,
                  (double)g_gpu[j], (double)g_cpu[j]);
    for (int i = 0; i < 4; i++)
        CHECK_MSG(fabsf(l_gpu[i] - l_cpu[i]) <= (i < 2 ? 1e-4f : 2e-2f) * (1 + l_cpu[i]),
                  "step %d: gpu %.6f cpu %.6f", i, (double)l_gpu[i], (double)l_cpu[i]);
}

double check_rel_diff(const float *x, const float *y, size_t n, double floor)
{
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)x[i] - y[i]) / (fabs(y[i]) + floor);
        if (!(d <= worst)) worst = d;
    }
    return worst;
}

bool check_same_file(const char *a, const char *b)
{
    FILE *f = fopen(a, "rb"), *g = fopen(b, "rb");
    bool same = f && g;
    unsigned char x[4096], y[4096];
    while (same) {
        const size_t n = fread(x, 1, sizeof x, f), k = fread(y, 1, sizeof y, g);
        same = n == k && memcmp(x, y, n) == 0;
        if (n < sizeof x) break;
    }
    if (f) fclose(f);
    if (g) fclose(g);
    return same;
}

void check_token_batch(mt_batch *b, int32_t *tok, int32_t *tg, int n, int T, int V, int step)
{
    for (int i = 0; i < n * T; i++) {
        tok[i] = (i * 7 + step * 13 + 3) % V;
        tg[i] = (i * 11 + step * 5 + 1) % V;
    }
    *b = (mt_batch){.n = n, .tokens = tok, .targets = tg, .seq_len = T};
}

void check_token_steps(mt_context *ctx, mt_trainer *t, int n, int T, int V, int from, int to)
{
    int32_t *tok = check_alloc((size_t)n * T * sizeof *tok);
    int32_t *tg = check_alloc((size_t)n * T * sizeof *tg);
    mt_batch b;
    for (int s = from; s < to; s++) {
        check_token_batch(&b, tok, tg, n, T, V, s);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    }
}

void check_estimate_matches(mt_context *ctx, const mt_estimate_report *est, const char *what)
{
    mt_memory_stats st;
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    CHECK_MSG(st.peak_live_bytes == est->peak, "%s: peak %llu measured, %llu estimated", what,
              (unsigned long long)st.peak_live_bytes, (unsigned long long)est->peak);
    for (int k = 0; k < MT_MEM_COUNT; k++)
        CHECK_MSG(st.per_class[k].peak_live_bytes == est->class_peak[k],
                  "%s: class %s peak %llu measured, %llu estimated", what,
                  mt_mem_class_name((mt_mem_class)k),
                  (unsigned long long)st.per_class[k].peak_live_bytes,
                  (unsigned long long)est->class_peak[k]);
    CHECK_MSG(st.peak_reserved_bytes == est->peak_reserved,
              "%s: peak reserved %llu measured, %llu estimated", what,
              (unsigned long long)st.peak_reserved_bytes, (unsigned long long)est->peak_reserved);
}

/* Runs one test; false if a CHECK ended it. Its scratch memory goes after. */
static bool run_one(check_fn fn)
{
    bool ok = false;
    if (setjmp(jump) == 0) {
        fn();
        ok = true;
    }
    for (size_t i = 0; i < n_held; i++) free(held[i]);
    n_held = 0;
    return ok;
}

int main(int argc, char **argv)
{
    int run = 0, failed = 0;
    double t_all = now_s();
    bool list = argc > 1 && !strcmp(argv[1], "--list");
    if (list) argc--, argv++;
    int includes = 0;
    for (int a = 1; a < argc; a++) includes += argv[a][0] != '-';
    for (int i = 0; i < n_tests; i++) {
        bool want = includes == 0, out = false;
        for (int a = 1; a < argc; a++) {
            if (argv[a][0] == '-') out = out || selects(&tests[i], argv[a] + 1);
            else want = want || selects(&tests[i], argv[a]);
        }
        want = want && !out;
        if (!want) continue;
        if (list) {
            printf("%s\n", tests[i].name);
            continue;
        }
        run++;
        int before = atomic_load(&notes);
        double t0 = now_s();
        bool ok = run_one(tests[i].fn) && atomic_load(&notes) == before;
        printf("%s %-48s %7.3f s\n", ok ? "ok  " : "FAIL", tests[i].name, now_s() - t0);
        fflush(stdout);
        if (!ok) failed++;
    }
    if (list) return 0;
    printf("%d test(s), %d failed, %.1f s\n", run, failed, now_s() - t_all);
    /* out before exit's handlers run: a library's exit-time teardown that
     * never returns must not take the summary with it */
    fflush(stdout);
    return failed ? 1 : (run ? 0 : 2);
}
