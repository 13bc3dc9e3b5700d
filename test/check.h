/*
 * check.h - the test suite's small framework.
 *
 * TEST(name) { ... } defines and registers a test. CHECK(cond) ends the
 * running test on failure; EXPECT(cond) records the failure and goes on (use
 * it off the main thread). Tests run in registration order; the runner's
 * arguments pick tests whose names contain any of them.
 */
#ifndef MT_TEST_CHECK_H
#define MT_TEST_CHECK_H

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "memtrain.h"

typedef void (*check_fn)(void);
void check_register(const char *name, check_fn fn, const char *file);
void check_fail(const char *file, int line, const char *what);  /* ends the test */
void check_note(const char *file, int line, const char *what);  /* records and goes on */
bool check_long(void);  /* MT_TEST_LONG=1: the long variants */
bool check_light(void); /* MT_TEST_LIGHT=1: shorter stress, for slow runs (valgrind) */
const char *check_fake_cuda(void); /* path of the stand-in driver, or NULL */
/* A search list of lib/device/cuda_search.c (mti_cublaslt_candidates, ...) made
 * with PATH led by DIR/venv/bin and CUDA_HOME set to DIR/cuda, both put
 * back after; and where a path is in such a list (-1: not there). */
size_t check_search_in(const char *dir, size_t (*list)(char (*)[512], size_t), char (*out)[512],
                       size_t max);
long check_find_path(char (*list)[512], size_t n, const char *path);
/* Memory that lives until the running test ends, however it ends (the
 * runner frees it after each test): zeroed, or a copy. */
void *check_alloc(size_t bytes);
void *check_copy(const void *src, size_t bytes);
/* A CPU context with `threads` kernel threads and the default allocators. */
mt_context *check_cpu_context(int threads);
/* A 2-block, 4-head GPT on ctx (vocab, max_seq, channels, seed as given). */
mt_model *check_small_gpt(mt_context *ctx, int vocab, int max_seq, int channels, uint64_t seed);
/* Under MT_TEST_GPU=1, a CUDA context on the system's driver (the test
 * fails if none opens); under MT_TEST_GPU=standin, one on the stand-in
 * driver and cuBLASLt (MT_FAKE_CUDA, MT_FAKE_CUBLASLT), whose kernels
 * compute nothing: the GPU tests' host side then runs in `make test`, under
 * the sanitizers with SAN=1, and their checks of values are skipped
 * (check_gpu_values); otherwise NULL, and the caller's GPU test skips. */
mt_context *check_gpu_context(void);
/* Whether a GPU test's values mean anything: false under
 * MT_TEST_GPU=standin. */
bool check_gpu_values(void);
/* A GPU run against the CPU's: n gradients within 1e-4, and four step
 * losses, the first two (fp32) within 1e-4 (1 + loss), the last two
 * (16-bit) within 2e-2 (1 + loss); nothing under the stand-ins. */
void check_gpu_near_cpu(const float *g_gpu, const float *g_cpu, size_t n, const float *l_gpu,
                        const float *l_cpu);
/* The largest |x - y| relative to (|y| + floor) over n values (a NaN:
 * itself). */
double check_rel_diff(const float *x, const float *y, size_t n, double floor);
/* Whether two files hold the same bytes (false also when one cannot be read). */
bool check_same_file(const char *a, const char *b);
/* A token batch of n rows of T tokens below V into tok and tg (n * T
 * each), different for each step. */
void check_token_batch(mt_batch *b, int32_t *tok, int32_t *tg, int n, int T, int V, int step);
/* Steps [from, to) of t on check_token_batch's batches of n rows of T
 * tokens below V. */
void check_token_steps(mt_context *ctx, mt_trainer *t, int n, int T, int V, int from, int to);
/* The context's accounting equals the estimate: the peak of live bytes,
 * every class's peak and the allocators' peak reserve (what names the case
 * in a failure). */
void check_estimate_matches(mt_context *ctx, const mt_estimate_report *est, const char *what);

#define TEST(name)                                                                          \
    static void name(void);                                                                 \
    __attribute__((constructor)) static void name##_register(void) { check_register(#name, name, __FILE__); } \
    static void name(void)

#define CHECK(c)                                                                            \
    do {                                                                                    \
        if (!(c)) check_fail(__FILE__, __LINE__, #c);                                       \
    } while (0)
#define EXPECT(c)                                                                           \
    do {                                                                                    \
        if (!(c)) check_note(__FILE__, __LINE__, #c);                                       \
    } while (0)
#define CHECK_MSG(c, ...)                                                                   \
    do {                                                                                    \
        if (!(c)) {                                                                         \
            char check_buf_[2048];                                                           \
            snprintf(check_buf_, sizeof check_buf_, __VA_ARGS__);                           \
            check_fail(__FILE__, __LINE__, check_buf_);                                     \
        }                                                                                   \
    } while (0)
#define CHECK_EQ(a, b)                                                                      \
    CHECK_MSG((a) == (b), "%s == %s (%lld vs %lld)", #a, #b, (long long)(a), (long long)(b))
#define CHECK_OK(s)                                                                         \
    do {                                                                                    \
        mt_status check_s_ = (s);                                                           \
        CHECK_MSG(check_s_ == MT_OK, "%s -> %s: %s", #s, mt_status_string(check_s_),       \
                  mt_last_error(NULL));                                                     \
    } while (0)
/* Like CHECK_OK, with the context whose message to print. */
#define CHECK_OKC(ctx, s)                                                                   \
    do {                                                                                    \
        mt_status check_s_ = (s);                                                           \
        CHECK_MSG(check_s_ == MT_OK, "%s -> %s: %s", #s, mt_status_string(check_s_),       \
                  mt_last_error(ctx));                                                      \
    } while (0)
#define CHECK_ST(expect, s)                                                                 \
    do {                                                                                    \
        mt_status check_s_ = (s);                                                           \
        CHECK_MSG(check_s_ == (expect), "%s -> %s, expected %s", #s,                        \
                  mt_status_string(check_s_), mt_status_string(expect));                   \
    } while (0)

#endif /* MT_TEST_CHECK_H */
