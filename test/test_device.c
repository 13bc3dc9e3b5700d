/*
 * test_device.c - the CUDA device layer, without a GPU.
 *
 * The failures that must say "no device" are tried with what a machine
 * without a GPU really has: no driver at all, a library that is not a
 * driver, and the CUDA toolkit's stub libcuda. Everything else runs on the
 * stand-in driver test/fake_cuda (path in MT_FAKE_CUDA; those tests pass
 * without checking anything when it is not set), whose device memory is
 * host memory: the device's calls, the allocators on top of them, copies,
 * growable ranges, out-of-memory and injected driver failures. Each test
 * also checks that the driver is left as found: nothing allocated, mapped
 * or retained, and no context left current on the thread.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "device/cuda_device.h"
#include "device/cuda_driver.h"
#include "internal.h"

#define STUB_LIBCUDA "/usr/local/cuda/lib64/stubs/libcuda.so"
#define MiB ((size_t)1 << 20)
#define FAKE_N_STATS 8

/* ---- the stand-in driver's test hooks ---- */

typedef struct fake {
    void *lib;
    void (*fail)(const char *call, int skip, CUresult code);
    unsigned long long (*raw_stat)(const char *name);
    const char *(*last_kernel)(void);
    unsigned long long base[FAKE_N_STATS]; /* the counters when the test began */
} fake;

/* Counters that must come back to where they were after a test; other
 * tests of the process may have left contexts open on the same driver. */
static const char *const fake_stats[FAKE_N_STATS] = {
    "used", "allocs", "handles", "mappings", "reservations", "streams", "modules", "ctx_refs",
};

/* A counter, less its value when the test began ("ctx_depth", per thread, and
 * the running totals "launches" and "syncs" as they are). */
static unsigned long long fake_stat(const fake *f, const char *name)
{
    unsigned long long v = f->raw_stat(name);
    for (int i = 0; i < FAKE_N_STATS; i++)
        if (strcmp(name, fake_stats[i]) == 0) return v - f->base[i];
    return v;
}

/* Opens the stand-in driver for its hooks (the same library the context
 * loads, as the path is the same). false when MT_FAKE_CUDA is not set. */
static bool fake_open(fake *f)
{
    const char *path = check_fake_cuda();
    memset(f, 0, sizeof *f);
    if (!path) return false;
    f->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    CHECK_MSG(f->lib, "cannot load the stand-in driver %s: %s", path, dlerror());
    /* copied, as ISO C has no object-to-function pointer conversion */
    void *sym = dlsym(f->lib, "fake_cuda_fail");
    memcpy(&f->fail, &sym, sizeof sym);
    sym = dlsym(f->lib, "fake_cuda_stat");
    memcpy(&f->raw_stat, &sym, sizeof sym);
    sym = dlsym(f->lib, "fake_cuda_last_kernel");
    memcpy(&f->last_kernel, &sym, sizeof sym);
    CHECK(f->fail && f->raw_stat && f->last_kernel);
    for (int i = 0; i < FAKE_N_STATS; i++) f->base[i] = f->raw_stat(fake_stats[i]);
    return true;
}

/* Nothing of a closed context may remain in the driver. */
static void fake_check_clean(fake *f)
{
    for (int i = 0; i < FAKE_N_STATS; i++)
        CHECK_MSG(fake_stat(f, fake_stats[i]) == 0, "driver counter %s is %lld, was 0",
                  fake_stats[i], (long long)fake_stat(f, fake_stats[i]));
    CHECK_EQ(fake_stat(f, "ctx_depth"), 0);
}

static void fake_close(fake *f)
{
    if (f->lib) dlclose(f->lib);
    f->lib = NULL;
}

static void clear_fake_env(void)
{
    unsetenv("MT_FAKE_CUDA_MEM");
    unsetenv("MT_FAKE_CUDA_DEVICES");
    unsetenv("MT_FAKE_CUDA_FAIL_INIT");
    unsetenv("MT_FAKE_CUDA_NO_VMM");
    unsetenv("MT_FAKE_CUDA_GRANULARITY");
}

static mt_status open_cuda(const char *path, int ordinal, mt_context **ctx)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CUDA;
    cfg.device_ordinal = ordinal;
    cfg.cuda_driver_path = path;
    return mt_context_create(&cfg, ctx);
}

/* Opening CUDA must fail with NO_DEVICE, leave *out NULL, and say `what`. */
static void expect_no_device(const char *path, int ordinal, const char *what)
{
    mt_context *ctx = (mt_context *)&ctx; /* must be overwritten with NULL */
    mt_status s = open_cuda(path, ordinal, &ctx);
    CHECK_MSG(s == MT_ERR_NO_DEVICE, "driver %s: got %s (%s)", path, mt_status_string(s),
              mt_last_error(NULL));
    CHECK(ctx == NULL);
    CHECK_MSG(strstr(mt_last_error(NULL), what), "message \"%s\" does not mention \"%s\"",
              mt_last_error(NULL), what);
}

/* ---- no driver, not a driver, the stub ---- */

TEST(device_cuda_no_driver)
{
    const char *path = "/nonexistent/memtrain-test/libcuda.so.1";
    expect_no_device(path, 0, path);
    expect_no_device(path, 0, "CUDA driver not found");
    CHECK(!mti_cuda_available(path));
}

TEST(device_cuda_not_a_driver)
{
    /* a real shared library without the driver's entry points */
    expect_no_device("libm.so.6", 0, "has no entry point cuInit");
    CHECK(!mti_cuda_available("libm.so.6"));
}

TEST(device_cuda_stub_library)
{
    FILE *f = fopen(STUB_LIBCUDA, "rb");
    if (!f) return; /* no CUDA toolkit here */
    fclose(f);
    expect_no_device(STUB_LIBCUDA, 0, "cuInit");
    expect_no_device(STUB_LIBCUDA, 0, "CUDA_ERROR_STUB_LIBRARY");
    CHECK(!mti_cuda_available(STUB_LIBCUDA));
}

TEST(device_auto_falls_back_to_cpu)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_AUTO;
    cfg.cuda_driver_path = "/nonexistent/memtrain-test/libcuda.so.1";
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    CHECK_EQ(mt_context_device(ctx), MT_DEVICE_CPU);
    CHECK_OK(mt_context_destroy(ctx));
}

/* ---- the stand-in driver: failures at open ---- */

TEST(device_cuda_fake_no_devices)
{
    fake f;
    if (!fake_open(&f)) return;
    setenv("MT_FAKE_CUDA_DEVICES", "0", 1);
    expect_no_device(check_fake_cuda(), 0, "reports no CUDA devices");
    CHECK(!mti_cuda_available(check_fake_cuda()));

    /* AUTO with a driver but no device: the CPU */
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.cuda_driver_path = check_fake_cuda();
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    CHECK_EQ(mt_context_device(ctx), MT_DEVICE_CPU);
    CHECK_OK(mt_context_destroy(ctx));
    clear_fake_env();
    fake_check_clean(&f);
    fake_close(&f);
}

TEST(device_cuda_fake_init_fails)
{
    fake f;
    if (!fake_open(&f)) return;
    setenv("MT_FAKE_CUDA_FAIL_INIT", "1", 1);
    expect_no_device(check_fake_cuda(), 0, "cuInit failed: CUDA_ERROR_UNKNOWN");
    setenv("MT_FAKE_CUDA_FAIL_INIT", "100", 1); /* what a real driver says with no GPU */
    expect_no_device(check_fake_cuda(), 0, "cuInit failed: CUDA_ERROR_NO_DEVICE");
    /* the driver's codes, named even where its cuGetErrorName is silent, with
     * what to do for the usual causes; 35 is the runtime's, not a driver code */
    setenv("MT_FAKE_CUDA_FAIL_INIT", "803", 1);
    expect_no_device(check_fake_cuda(), 0, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH");
    expect_no_device(check_fake_cuda(), 0, "different versions");
    setenv("MT_FAKE_CUDA_FAIL_INIT", "804", 1);
    expect_no_device(check_fake_cuda(), 0, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE");
    expect_no_device(check_fake_cuda(), 0, "forward compatibility");
    setenv("MT_FAKE_CUDA_FAIL_INIT", "35", 1);
    expect_no_device(check_fake_cuda(), 0, "cuInit failed: CUresult 35");
    CHECK(!mti_cuda_available(check_fake_cuda()));
    clear_fake_env();
    fake_check_clean(&f);
    fake_close(&f);
}

TEST(device_cuda_fake_ordinal_out_of_range)
{
    fake f;
    if (!fake_open(&f)) return;
    expect_no_device(check_fake_cuda(), 1, "ordinal 1 is out of range");
    setenv("MT_FAKE_CUDA_DEVICES", "2", 1);
    expect_no_device(check_fake_cuda(), 2, "has 2 devices");
    mt_context *ctx = NULL;
    CHECK_OK(open_cuda(check_fake_cuda(), 1, &ctx));
    CHECK_EQ(ctx->dev->ordinal, 1);
    CHECK_OK(mt_context_destroy(ctx));
    clear_fake_env();
    fake_check_clean(&f);
    fake_close(&f);
}

/* A driver call failing while the device opens: DEVICE, naming the call and
 * the driver's code, and nothing left behind. */
TEST(device_cuda_fake_open_call_fails)
{
    fake f;
    if (!fake_open(&f)) return;
    static const char *const calls[] = {"cuDeviceGetName", "cuDevicePrimaryCtxRetain",
                                        "cuCtxPushCurrent_v2", "cuStreamCreate"};
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        f.fail(calls[i], 0, CUDA_ERROR_INVALID_VALUE);
        mt_context *ctx = NULL;
        mt_status s = open_cuda(check_fake_cuda(), 0, &ctx);
        CHECK_MSG(s == MT_ERR_DEVICE, "%s failing: got %s", calls[i], mt_status_string(s));
        CHECK(ctx == NULL);
        const char *msg = mt_last_error(NULL);
        CHECK_MSG(strstr(msg, calls[i]) == msg &&
                      strstr(msg, "failed: CUDA_ERROR_INVALID_VALUE (invalid argument)"),
                  "message \"%s\" does not name %s and its result", msg, calls[i]);
        fake_check_clean(&f);
    }
    f.fail("", 0, 0);
    fake_close(&f);
}

/* ---- the stand-in driver: a working device ---- */

TEST(device_cuda_fake_open)
{
    fake f;
    if (!fake_open(&f)) return;
    CHECK(mti_cuda_available(check_fake_cuda()));
    mt_context *ctx = NULL;
    CHECK_OK(open_cuda(check_fake_cuda(), 0, &ctx));
    CHECK_EQ(mt_context_device(ctx), MT_DEVICE_CUDA);
    CHECK(strcmp(mt_context_device_name(ctx), "memtrain fake GPU") == 0);
    mti_device *d = ctx->dev;
    CHECK_EQ(d->total_bytes, (size_t)4 << 30);
    CHECK_EQ(d->granularity, 2 * MiB);
    CHECK_EQ(d->min_alignment, 256);
    CHECK(d->va_reserve && d->va_commit && d->va_decommit && d->va_release);
    int major = 0, minor = -1;
    CHECK_OK(mti_cuda_compute_capability(d, &major, &minor));
    CHECK(major == 9 && minor == 0);
    size_t fr = 0, tot = 0;
    CHECK_OKC(ctx, d->mem_info(d, &fr, &tot));
    CHECK_EQ(tot, (size_t)4 << 30);
    CHECK(fr <= tot);
    CHECK_EQ(fake_stat(&f, "ctx_depth"), 0);
    CHECK_EQ(fake_stat(&f, "ctx_refs"), 1);

    /* AUTO picks the driver when it has a device */
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.cuda_driver_path = check_fake_cuda();
    mt_context *ctx2 = NULL;
    CHECK_OK(mt_context_create(&cfg, &ctx2));
    CHECK_EQ(mt_context_device(ctx2), MT_DEVICE_CUDA);
    CHECK_EQ(fake_stat(&f, "ctx_refs"), 2); /* both share the primary context */
    CHECK_OK(mt_context_destroy(ctx2));
    CHECK_OK(mt_context_destroy(ctx));
    fake_check_clean(&f);
    fake_close(&f);
}

/* Plain reservations, alignment above cuMemAlloc's, and every copy. */
TEST(device_cuda_fake_reserve_and_copy)
{
    fake f;
    if (!fake_open(&f)) return;
    mt_context *ctx = NULL;
    CHECK_OK(open_cuda(check_fake_cuda(), 0, &ctx));
    mti_device *d = ctx->dev;

    static const size_t aligns[] = {0, 256, 512, 4096, 2 * MiB};
    void *p[5];
    size_t g[5];
    for (int i = 0; i < 5; i++) {
        size_t bytes = 1000 + 777 * (size_t)i;
        CHECK_OKC(ctx, d->mem_reserve(d, bytes, aligns[i], &p[i], &g[i]));
        size_t a = aligns[i] ? aligns[i] : 256;
        CHECK_MSG((uintptr_t)p[i] % a == 0, "%p not aligned to %zu", p[i], a);
        CHECK(g[i] >= bytes);
    }
    CHECK_EQ(fake_stat(&f, "allocs"), 5);

    /* h2d, d2d, memset, d2h */
    unsigned char src[3000], dst[3000];
    for (size_t i = 0; i < sizeof src; i++) src[i] = (unsigned char)(i * 7 + 3);
    CHECK_OKC(ctx, d->copy_h2d(d, p[4], src, 3000 - 1));
    CHECK_OKC(ctx, d->copy_d2d(d, p[3], p[4], 2000));
    CHECK_OKC(ctx, d->memset8(d, (char *)p[3] + 100, 0xAB, 50));
    CHECK_OKC(ctx, d->sync(d));
    memset(dst, 0, sizeof dst);
    CHECK_OKC(ctx, d->copy_d2h(d, dst, p[3], 2000));
    for (size_t i = 0; i < 2000; i++)
        CHECK_EQ(dst[i], i >= 100 && i < 150 ? 0xAB : src[i]);
    CHECK_OKC(ctx, d->copy_h2d(d, p[0], src, 0)); /* empty copies are fine */

    /* a copy past the end of a block: the driver refuses, DEVICE names the call */
    mt_status s = d->copy_h2d(d, p[0], src, g[0] + 4096);
    CHECK_ST(MT_ERR_DEVICE, s);
    CHECK(strstr(mt_last_error(ctx), "cuMemcpyHtoDAsync_v2") &&
          strstr(mt_last_error(ctx), "CUDA_ERROR_INVALID_VALUE"));

    for (int i = 0; i < 5; i++) d->mem_release(d, p[i], g[i]);
    CHECK_EQ(fake_stat(&f, "allocs"), 0);
    CHECK_EQ(fake_stat(&f, "ctx_depth"), 0);

    /* injected failures of copies are DEVICE errors with the call's name */
    CHECK_OKC(ctx, d->mem_reserve(d, 4096, 0, &p[0], &g[0]));
    f.fail("cuMemcpyDtoHAsync_v2", 0, CUDA_ERROR_ILLEGAL_ADDRESS);
    CHECK_ST(MT_ERR_DEVICE, d->copy_d2h(d, dst, p[0], 64));
    CHECK(strstr(mt_last_error(ctx), "cuMemcpyDtoHAsync_v2") &&
          strstr(mt_last_error(ctx), "CUDA_ERROR_ILLEGAL_ADDRESS"));
    f.fail("cuStreamSynchronize", 0, CUDA_ERROR_LAUNCH_FAILED);
    CHECK_ST(MT_ERR_DEVICE, d->sync(d));
    CHECK(strstr(mt_last_error(ctx), "cuStreamSynchronize failed: CUDA_ERROR_LAUNCH_FAILED"));
    d->mem_release(d, p[0], g[0]);
    CHECK_EQ(fake_stat(&f, "ctx_depth"), 0);

    CHECK_OK(mt_context_destroy(ctx));
    fake_check_clean(&f);
    fake_close(&f);
}

/* Growable ranges: reserve, commit and decommit granule by granule. */
TEST(device_cuda_fake_va)
{
    fake f;
    if (!fake_open(&f)) return;
    mt_context *ctx = NULL;
    CHECK_OK(open_cuda(check_fake_cuda(), 0, &ctx));
    mti_device *d = ctx->dev;
    const size_t G = d->granularity;

    void *base = NULL;
    CHECK_OKC(ctx, d->va_reserve(d, 8 * G, &base));
    CHECK((uintptr_t)base % G == 0);
    CHECK_EQ(fake_stat(&f, "reservations"), 1);
    CHECK_EQ(fake_stat(&f, "used"), 0); /* address space costs no memory */

    char *b = base;
    CHECK_OKC(ctx, d->va_commit(d, b + G, 3 * G));
    CHECK_EQ(fake_stat(&f, "used"), 3 * G);
    CHECK_EQ(fake_stat(&f, "mappings"), 3); /* one per granule, so any granule can go back */
    uint32_t v[64], w[64];
    for (int i = 0; i < 64; i++) v[i] = 0x9E3779B9u * (uint32_t)i;
    /* across the seam of two mappings */
    CHECK_OKC(ctx, d->copy_h2d(d, b + 2 * G - 128, v, sizeof v));
    CHECK_OKC(ctx, d->copy_d2h(d, w, b + 2 * G - 128, sizeof w));
    CHECK(memcmp(v, w, sizeof v) == 0);

    /* committing over committed memory is refused and changes nothing */
    CHECK_ST(MT_ERR_INVALID_ARG, d->va_commit(d, b + 3 * G, 2 * G));
    CHECK_EQ(fake_stat(&f, "mappings"), 3);
    /* misaligned or outside the range */
    CHECK_ST(MT_ERR_INVALID_ARG, d->va_commit(d, b + 100, G));
    CHECK_ST(MT_ERR_INVALID_ARG, d->va_commit(d, b + 7 * G, 2 * G));

    /* give back the middle granule: its neighbours keep their contents */
    d->va_decommit(d, b + 2 * G, G);
    CHECK_EQ(fake_stat(&f, "mappings"), 2);
    CHECK_EQ(fake_stat(&f, "used"), 2 * G);
    CHECK_OKC(ctx, d->copy_d2h(d, w, b + 2 * G - 128, 128));
    CHECK(memcmp(v, w, 128) == 0);
    CHECK_ST(MT_ERR_DEVICE, d->copy_d2h(d, w, b + 2 * G, 64)); /* no longer mapped */
    /* and commit it again */
    CHECK_OKC(ctx, d->va_commit(d, b + 2 * G, G));
    CHECK_OKC(ctx, d->memset8(d, b + 2 * G, 0, G));

    /* a commit that fails half way leaves nothing of itself */
    f.fail("cuMemMap", 1, CUDA_ERROR_INVALID_VALUE);
    CHECK_ST(MT_ERR_DEVICE, d->va_commit(d, b + 4 * G, 3 * G));
    CHECK(strstr(mt_last_error(ctx), "cuMemMap"));
    CHECK_EQ(fake_stat(&f, "mappings"), 3);
    CHECK_EQ(fake_stat(&f, "handles"), 3);
    f.fail("cuMemSetAccess", 0, CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_ST(MT_ERR_OOM, d->va_commit(d, b + 4 * G, 3 * G));
    CHECK_EQ(fake_stat(&f, "mappings"), 3);
    CHECK_EQ(fake_stat(&f, "handles"), 3);

    /* decommit of the whole range, committed or not, then release */
    d->va_decommit(d, b, 8 * G);
    CHECK_EQ(fake_stat(&f, "mappings"), 0);
    CHECK_EQ(fake_stat(&f, "used"), 0);
    CHECK_OKC(ctx, d->va_commit(d, b, G));
    d->va_release(d, base, 8 * G); /* releasing unmaps what is still committed */
    CHECK_EQ(fake_stat(&f, "reservations"), 0);
    CHECK_EQ(fake_stat(&f, "handles"), 0);
    CHECK_EQ(fake_stat(&f, "ctx_depth"), 0);

    /* a range left reserved is freed with the device */
    CHECK_OKC(ctx, d->va_reserve(d, 2 * G, &base));
    CHECK_OKC(ctx, d->va_commit(d, base, G));
    CHECK_OK(mt_context_destroy(ctx));
    fake_check_clean(&f);
    fake_close(&f);
}

/* Device memory running out: OOM from cuMemAlloc and from cuMemCreate, and
 * through an allocator; the device stays usable. */
TEST(device_cuda_fake_oom)
{
    fake f;
    if (!fake_open(&f)) return;
    /* 64 MiB free, over what contexts of other tests may still hold */
    char mem[32];
    snprintf(mem, sizeof mem, "%llu", f.base[0] + 64 * MiB);
    setenv("MT_FAKE_CUDA_MEM", mem, 1);
    mt_context *ctx = NULL;
    CHECK_OK(open_cuda(check_fake_cuda(), 0, &ctx));
    mti_device *d = ctx->dev;
    CHECK_EQ(d->total_bytes, f.base[0] + 64 * MiB);

    void *p = NULL, *q = NULL;
    size_t g = 0, gq = 0;
    CHECK_ST(MT_ERR_OOM, d->mem_reserve(d, 65 * MiB, 0, &p, &g));
    CHECK(strstr(mt_last_error(ctx), "cuMemAlloc_v2") &&
          strstr(mt_last_error(ctx), "CUDA_ERROR_OUT_OF_MEMORY"));
    CHECK_OKC(ctx, d->mem_reserve(d, 40 * MiB, 0, &p, &g));
    CHECK_ST(MT_ERR_OOM, d->mem_reserve(d, 30 * MiB, 4096, &q, &gq));
    d->mem_release(d, p, g);
    CHECK_OKC(ctx, d->mem_reserve(d, 30 * MiB, 4096, &q, &gq));
    d->mem_release(d, q, gq);

    /* cuMemCreate running out half way through a commit: nothing of it stays */
    void *base = NULL;
    CHECK_OKC(ctx, d->va_reserve(d, 64 * MiB, &base));
    CHECK_OKC(ctx, d->va_commit(d, base, 16 * MiB));
    CHECK_OKC(ctx, d->mem_reserve(d, 40 * MiB, 0, &p, &g)); /* 56 MiB taken */
    CHECK_ST(MT_ERR_OOM, d->va_commit(d, (char *)base + 16 * MiB, 10 * MiB));
    CHECK(strstr(mt_last_error(ctx), "cuMemCreate") &&
          strstr(mt_last_error(ctx), "CUDA_ERROR_OUT_OF_MEMORY"));
    CHECK_EQ(fake_stat(&f, "used"), 56 * MiB);
    CHECK_EQ(fake_stat(&f, "handles"), 8);
    CHECK_OKC(ctx, d->va_commit(d, (char *)base + 16 * MiB, 8 * MiB)); /* exactly full */
    CHECK_EQ(fake_stat(&f, "used"), 64 * MiB);
    d->mem_release(d, p, g);
    d->va_release(d, base, 64 * MiB);
    CHECK_EQ(fake_stat(&f, "used"), 0);

    /* through the context's allocator */
    mt_alloc_request req = {.bytes = 80 * MiB, .mem_class = MT_MEM_PARAM};
    mt_block blk;
    CHECK_ST(MT_ERR_OOM, mt_context_alloc(ctx, &req, &blk));
    req.bytes = 8 * MiB;
    CHECK_OKC(ctx, mt_context_alloc(ctx, &req, &blk));
    CHECK_OKC(ctx, mt_context_free(ctx, &blk));

    CHECK_OK(mt_context_destroy(ctx));
    clear_fake_env();
    fake_check_clean(&f);
    fake_close(&f);
}

/* Every built-in allocator on device memory, with and without growable
 * ranges: blocks are aligned, disjoint, and hold what is copied in. */
static void allocators_on_fake(fake *f)
{
    for (int n = 0; mt_allocator_builtin(n); n++) {
        const mt_allocator_vtable *vt = mt_allocator_builtin(n);
        mt_context_config cfg;
        mt_context_config_init(&cfg);
        cfg.device = MT_DEVICE_CUDA;
        cfg.cuda_driver_path = check_fake_cuda();
        for (int c = 0; c < MT_MEM_COUNT; c++) cfg.allocators[c].vtable = vt;
        mt_context *ctx = NULL;
        CHECK_OK(mt_context_create(&cfg, &ctx));
        CHECK_EQ(mt_context_device(ctx), MT_DEVICE_CUDA);
        mti_device *d = ctx->dev;

        enum { N = 24 };
        mt_block blk[N];
        for (int i = 0; i < N; i++) {
            mt_alloc_request req = {
                .bytes = (size_t)(i % 6 == 5 ? 3 * MiB + 1 : 1 + 997 * (size_t)i * (size_t)i),
                .alignment = (size_t)256 << (i % 5),
                .mem_class = (mt_mem_class)(i % MT_MEM_COUNT),
                .lifetime = MT_LIFE_PERSISTENT,
                .tag = (uint64_t)i,
            };
            CHECK_OKC(ctx, mt_context_alloc(ctx, &req, &blk[i]));
            CHECK_MSG((uintptr_t)blk[i].ptr % req.alignment == 0, "%s: %p not aligned to %zu",
                      vt->name, blk[i].ptr, req.alignment);
            /* fill each block with its own byte, through the device */
            CHECK_OKC(ctx, d->memset8(d, blk[i].ptr, 'A' + i, blk[i].bytes));
        }
        for (int i = 0; i < N; i++) {
            unsigned char head[64], tail[64];
            size_t k = blk[i].bytes < 64 ? blk[i].bytes : 64;
            CHECK_OKC(ctx, d->copy_d2h(d, head, blk[i].ptr, k));
            CHECK_OKC(ctx, d->copy_d2h(d, tail, (char *)blk[i].ptr + blk[i].bytes - k, k));
            for (size_t j = 0; j < k; j++)
                CHECK_MSG(head[j] == 'A' + i && tail[j] == 'A' + i,
                          "%s: block %d overwritten by another", vt->name, i);
        }
        for (int i = 0; i < N; i += 2) CHECK_OKC(ctx, mt_context_free(ctx, &blk[i]));
        for (int i = 1; i < N; i += 2) CHECK_OKC(ctx, mt_context_free(ctx, &blk[i]));
        mt_memory_stats ms;
        CHECK_OK(mt_context_memory_stats(ctx, &ms));
        CHECK_EQ(ms.live_bytes, 0);
        CHECK_EQ(fake_stat(f, "ctx_depth"), 0);
        CHECK_OK(mt_context_destroy(ctx));
        fake_check_clean(f);
    }
}

TEST(device_cuda_fake_allocators)
{
    fake f;
    if (!fake_open(&f)) return;
    allocators_on_fake(&f);
    fake_close(&f);
}

TEST(device_cuda_fake_allocators_no_vmm)
{
    fake f;
    if (!fake_open(&f)) return;
    setenv("MT_FAKE_CUDA_NO_VMM", "1", 1);
    mt_context *ctx = NULL;
    CHECK_OK(open_cuda(check_fake_cuda(), 0, &ctx));
    CHECK(!ctx->dev->va_reserve && !ctx->dev->va_commit);
    CHECK_OK(mt_context_destroy(ctx));
    allocators_on_fake(&f);
    clear_fake_env();
    fake_close(&f);
}

/* The built-in kernels: the stand-in driver runs the two it knows on the
 * host, so arguments are checked end to end. */
TEST(device_cuda_fake_kernels)
{
    fake f;
    if (!fake_open(&f)) return;
    mt_context *ctx = NULL;
    CHECK_OK(open_cuda(check_fake_cuda(), 0, &ctx));
    mti_device *d = ctx->dev;
    CHECK(strcmp(mti_cuda_kernel_name(MTI_CUDA_AXPY_F32), "mt_axpy_f32") == 0);
    CHECK(mti_cuda_kernel_name(MTI_CUDA_KERNEL_COUNT) == NULL);
#if MT_HAVE_CUDA_KERNELS
    CHECK(mti_cuda_has_kernels(d));
    CHECK_EQ(fake_stat(&f, "modules"), 1);
    /* every kernel's code was loaded when the device opened */
    CHECK(fake_stat(&f, "func_loads") >= MTI_CUDA_KERNEL_COUNT);
    enum { N = 1000 };
    void *x = NULL, *y = NULL;
    size_t gx = 0, gy = 0;
    CHECK_OKC(ctx, d->mem_reserve(d, N * sizeof(float), 0, &x, &gx));
    CHECK_OKC(ctx, d->mem_reserve(d, N * sizeof(float), 0, &y, &gy));
    float h[N];
    for (int i = 0; i < N; i++) h[i] = (float)i;
    CHECK_OKC(ctx, d->copy_h2d(d, x, h, sizeof h));
    unsigned long long before = fake_stat(&f, "launches");
    CHECK_OKC(ctx, mti_cuda_fill_f32(d, y, 2.0f, N));
    CHECK_OKC(ctx, mti_cuda_axpy_f32(d, y, 0.5f, x, N));
    CHECK_EQ(fake_stat(&f, "launches"), before + 2);
    CHECK(strcmp(f.last_kernel(), "mt_axpy_f32") == 0);
    CHECK_OKC(ctx, d->copy_d2h(d, h, y, sizeof h));
    for (int i = 0; i < N; i++) CHECK(h[i] == 2.0f + 0.5f * (float)i);

    /* a launch the driver refuses is a DEVICE error naming the call; out of
     * memory at a launch is OOM */
    f.fail("cuLaunchKernel", 0, CUDA_ERROR_INVALID_VALUE);
    CHECK_ST(MT_ERR_DEVICE, mti_cuda_fill_f32(d, y, 1.0f, N));
    CHECK(strstr(mt_last_error(ctx), "cuLaunchKernel"));
    f.fail("cuLaunchKernel", 0, CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_ST(MT_ERR_OOM, mti_cuda_fill_f32(d, y, 1.0f, N));
    CHECK(strstr(mt_last_error(ctx), "CUDA_ERROR_OUT_OF_MEMORY"));
    /* an empty grid never reaches the driver */
    mti_cuda_fn *fn = NULL;
    CHECK_OKC(ctx, mti_cuda_kernel(d, MTI_CUDA_FILL_F32, &fn));
    CHECK_ST(MT_ERR_INVALID_ARG,
             mti_cuda_launch(d, fn, (mti_dim3){0, 1, 1}, (mti_dim3){256, 1, 1}, 0, NULL));

    /* a module of the application's own, from PTX text */
    mti_cuda_module *m = NULL;
    CHECK_OKC(ctx, mti_cuda_module_load(d, "// ptx\n.version 8.0\n", &m));
    CHECK_EQ(fake_stat(&f, "modules"), 2);
    CHECK_OKC(ctx, mti_cuda_module_function(d, m, "my_kernel", &fn));
    f.fail("cuModuleGetFunction", 0, CUDA_ERROR_NOT_FOUND);
    CHECK_ST(MT_ERR_INVALID_ARG, mti_cuda_module_function(d, m, "not_there", &fn));
    CHECK(strstr(mt_last_error(ctx), "not_there"));
    mti_cuda_module_unload(d, m);
    CHECK_ST(MT_ERR_DEVICE, mti_cuda_module_load(d, "not an image", &m));
    CHECK(strstr(mt_last_error(ctx), "CUDA_ERROR_INVALID_IMAGE"));
    d->mem_release(d, x, gx);
    d->mem_release(d, y, gy);
#else
    mti_cuda_fn *fn = NULL;
    CHECK(!mti_cuda_has_kernels(d));
    CHECK_ST(MT_ERR_UNSUPPORTED, mti_cuda_kernel(d, MTI_CUDA_FILL_F32, &fn));
    CHECK(strstr(mt_last_error(ctx), "no CUDA kernels"));
#endif
    CHECK_OK(mt_context_destroy(ctx));
    fake_check_clean(&f);

#if MT_HAVE_CUDA_KERNELS
    /* no device memory for the kernels' code: the open fails with OOM */
    f.fail("cuFuncLoad", 3, CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_ST(MT_ERR_OOM, open_cuda(check_fake_cuda(), 0, &ctx));
    CHECK(strstr(mt_last_error(NULL), "cuFuncLoad"));
    fake_check_clean(&f);
#endif

    /* kernels that fail to load leave the device usable for memory */
    f.fail("cuModuleLoadData", 0, CUDA_ERROR_UNSUPPORTED_PTX_VERSION);
    CHECK_OK(open_cuda(check_fake_cuda(), 0, &ctx));
    CHECK(!mti_cuda_has_kernels(ctx->dev));
#if MT_HAVE_CUDA_KERNELS
    mti_cuda_fn *fn2 = NULL;
    CHECK_ST(MT_ERR_UNSUPPORTED, mti_cuda_kernel(ctx->dev, MTI_CUDA_AXPY_F32, &fn2));
    CHECK(strstr(mt_last_error(ctx), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"));
#endif
    CHECK_OK(mt_context_destroy(ctx));
    f.fail("", 0, 0);
    fake_check_clean(&f);
    fake_close(&f);
}

/* The device works from any thread: its context is made current per call. */
typedef struct worker_arg {
    mti_device *d;
    fake *f;
    int ok;
} worker_arg;

static void *worker(void *p)
{
    worker_arg *w = p;
    mti_device *d = w->d;
    void *ptr = NULL;
    size_t g = 0;
    uint64_t v = 0x1234567890ABCDEFull, r = 0;
    w->ok = d->mem_reserve(d, 4096, 1024, &ptr, &g) == MT_OK &&
            d->copy_h2d(d, ptr, &v, sizeof v) == MT_OK &&
            d->copy_d2h(d, &r, ptr, sizeof r) == MT_OK && r == v &&
            fake_stat(w->f, "ctx_depth") == 0;
    if (ptr) d->mem_release(d, ptr, g);
    return NULL;
}

TEST(device_cuda_fake_threads)
{
    fake f;
    if (!fake_open(&f)) return;
    mt_context *ctx = NULL;
    CHECK_OK(open_cuda(check_fake_cuda(), 0, &ctx));
    enum { T = 4 };
    pthread_t th[T];
    worker_arg args[T];
    for (int i = 0; i < T; i++) {
        args[i] = (worker_arg){ctx->dev, &f, 0};
        CHECK(pthread_create(&th[i], NULL, worker, &args[i]) == 0);
    }
    for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < T; i++) CHECK(args[i].ok);
    CHECK_OK(mt_context_destroy(ctx));
    fake_check_clean(&f);
    fake_close(&f);
}
