/*
 * test_trace.c - allocation traces: what is recorded, the bound, the file
 * format (and its refusal of damaged files), and replay through every
 * allocator.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"

uint32_t mti_crc32(uint32_t crc, const void *data, size_t n);

static void tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "/tmp/mt_test_%ld_%s", (long)getpid(), name);
}

static bool same_event(const mt_trace_event *a, const mt_trace_event *b)
{
    return a->t_ns == b->t_ns && a->id == b->id && a->bytes == b->bytes && a->tag == b->tag &&
           a->alignment == b->alignment && a->op == b->op && a->mem_class == b->mem_class &&
           a->lifetime == b->lifetime && a->flags == b->flags && a->scope == b->scope &&
           a->instance == b->instance;
}

/* A small training-like sequence: per step, activations that live to the
 * end of the step, temporaries freed at once, a phase boundary. */
static void run_steps(mt_context *ctx, int steps)
{
    mt_block keep[8], tmp;
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < 8; i++) {
            mt_alloc_request r = {.bytes = 10000 + 1000 * (size_t)i, .mem_class = MT_MEM_ACT,
                                  .lifetime = MT_LIFE_STEP, .flags = i % 2 ? MT_REQ_RECOMPUTABLE : 0,
                                  .tag = (uint64_t)i};
            CHECK_OKC(ctx, mt_context_alloc(ctx, &r, &keep[i]));
            mt_alloc_request w = {.bytes = 5000, .mem_class = MT_MEM_WORK, .lifetime = MT_LIFE_PHASE};
            CHECK_OKC(ctx, mt_context_alloc(ctx, &w, &tmp));
            CHECK_OKC(ctx, mt_context_free(ctx, &tmp));
        }
        for (int i = 7; i >= 4; i--) CHECK_OKC(ctx, mt_context_free(ctx, &keep[i]));
        mt_allocator *a;
        CHECK_OK(mt_context_allocator(ctx, MT_MEM_ACT, &a));
        CHECK_OK(mt_allocator_reset(a, MT_SCOPE_STEP)); /* the rest die here */
    }
}

TEST(trace_record_save_load_replay)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.trace_capacity = 10000;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    run_steps(ctx, 3);
    const mt_trace_event *ev;
    size_t n;
    uint64_t dropped;
    CHECK_OK(mt_context_trace_events(ctx, &ev, &n, &dropped));
    CHECK_EQ(n, 3 * (8 + 8 + 8 + 4 + 1));
    CHECK_EQ(dropped, 0);
    CHECK(ev[0].op == MT_TRACE_ALLOC && ev[0].bytes == 10000 && ev[0].mem_class == MT_MEM_ACT &&
          ev[0].lifetime == MT_LIFE_STEP && ev[0].alignment == 256);
    CHECK(ev[1].op == MT_TRACE_ALLOC && ev[1].mem_class == MT_MEM_WORK);
    CHECK(ev[2].op == MT_TRACE_FREE && ev[2].id == ev[1].id);
    CHECK(ev[3].flags == MT_REQ_RECOMPUTABLE && ev[3].tag == 1);
    CHECK(ev[n - 1].op == MT_TRACE_RESET && ev[n - 1].scope == MT_SCOPE_STEP);
    for (size_t i = 1; i < n; i++) CHECK(ev[i].t_ns >= ev[i - 1].t_ns);

    char path[256];
    tmp_path(path, sizeof path, "a.trace");
    CHECK_OK(mt_context_trace_write(ctx, path));
    mt_trace *t;
    CHECK_OK(mt_trace_load(ctx, path, &t));
    size_t n2;
    CHECK_OK(mt_trace_info(t, &n2, &dropped));
    CHECK_EQ(n2, n);
    for (size_t i = 0; i < n; i++) CHECK(same_event(&mt_trace_get_events(t)[i], &ev[i]));

    mt_memory_stats ms;
    CHECK_OK(mt_context_memory_stats(ctx, &ms));
    for (int k = 0; mt_allocator_builtin(k); k++) {
        mt_allocator *a;
        mt_allocator_config ac = {.vtable = mt_allocator_builtin(k)};
        CHECK_OK(mt_allocator_create(ctx, &ac, &a));
        mt_replay_result r;
        CHECK_OKC(ctx, mt_trace_replay(t, a, &r));
        CHECK_EQ(r.n_events, n);
        CHECK_EQ(r.n_alloc, 3 * 16);
        CHECK_EQ(r.n_free, 3 * 16);
        CHECK_EQ(r.n_failed, 0);
        CHECK_MSG(r.peak_live_bytes == ms.peak_live_bytes, "%s: replay peak %llu, recorded %llu",
                  mt_allocator_name(a), (unsigned long long)r.peak_live_bytes,
                  (unsigned long long)ms.peak_live_bytes);
        CHECK(r.efficiency >= 1.0);
        mt_allocator_stats st;
        CHECK_OK(mt_allocator_get_stats(a, &st));
        CHECK_EQ(st.live_bytes, 0);
        mt_allocator_destroy(a);
    }
    mt_trace_free(t);
    unlink(path);
    CHECK_OK(mt_context_trace_stop(ctx));
    run_steps(ctx, 1); /* not recorded */
    CHECK_OK(mt_context_trace_events(ctx, &ev, &n2, NULL));
    CHECK_EQ(n2, n);
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(trace_bounded)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    const mt_trace_event *ev;
    size_t n;
    uint64_t dropped;
    CHECK_ST(MT_ERR_STATE, mt_context_trace_events(ctx, &ev, &n, &dropped));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_context_trace_start(ctx, 0));
    CHECK_OK(mt_context_trace_start(ctx, 10));
    run_steps(ctx, 1);
    CHECK_OK(mt_context_trace_events(ctx, &ev, &n, &dropped));
    CHECK_EQ(n, 10);
    CHECK_EQ(dropped, 29 - 10);
    /* the kept prefix is a valid trace */
    mt_trace *t;
    CHECK_OK(mt_trace_from_events(ctx, ev, n, &t));
    mt_trace_free(t);
    CHECK_OK(mt_context_destroy(ctx));
}

static void write_bytes(const char *path, const unsigned char *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f);
    CHECK(fwrite(p, 1, n, f) == n);
    fclose(f);
}

static size_t read_bytes(const char *path, unsigned char *p, size_t cap)
{
    FILE *f = fopen(path, "rb");
    CHECK(f);
    size_t n = fread(p, 1, cap, f);
    fclose(f);
    return n;
}

static void expect_refused(mt_context *ctx, const char *path, mt_status want, const char *words)
{
    mt_trace *t = (mt_trace *)1;
    mt_status s = mt_trace_load(ctx, path, &t);
    CHECK_MSG(s == want, "%s: %s (%s)", path, mt_status_string(s), mt_last_error(ctx));
    CHECK(t == (mt_trace *)1);
    CHECK_MSG(strstr(mt_last_error(ctx), words) != NULL, "message '%s' lacks '%s'",
              mt_last_error(ctx), words);
}

TEST(trace_file_damage)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    cfg.trace_capacity = 1000;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    run_steps(ctx, 1);
    char good[256], bad[256];
    tmp_path(good, sizeof good, "good.trace");
    tmp_path(bad, sizeof bad, "bad.trace");
    CHECK_OK(mt_context_trace_write(ctx, good));
    static unsigned char buf[1 << 16];
    size_t n = read_bytes(good, buf, sizeof buf);
    CHECK(n == 40 + 29 * 48 + 4);

    expect_refused(ctx, "/nonexistent/dir/x.trace", MT_ERR_IO, "cannot open");
    write_bytes(bad, buf, 20);
    expect_refused(ctx, bad, MT_ERR_FORMAT, "not a memtrain trace");
    write_bytes(bad, buf, n - 7);
    expect_refused(ctx, bad, MT_ERR_FORMAT, "truncated");
    buf[100] ^= 0x40;
    write_bytes(bad, buf, n);
    expect_refused(ctx, bad, MT_ERR_FORMAT, "checksum");
    buf[100] ^= 0x40;
    buf[0] = 'X';
    write_bytes(bad, buf, n);
    expect_refused(ctx, bad, MT_ERR_FORMAT, "not a memtrain trace");
    buf[0] = 'M';
    /* a future version, with a valid checksum */
    buf[8] = 3;
    uint32_t crc = mti_crc32(0, buf, n - 4);
    for (int i = 0; i < 4; i++) buf[n - 4 + (size_t)i] = (unsigned char)(crc >> (8 * i));
    write_bytes(bad, buf, n);
    expect_refused(ctx, bad, MT_ERR_FORMAT, "version 3");
    buf[8] = 2;
    /* well-formed bytes, impossible events: a free of a block never allocated */
    unsigned char *ev2 = buf + 40 + 2 * 48; /* event 2 is a FREE */
    CHECK(ev2[36] == MT_TRACE_FREE);
    ev2[8] ^= 0x7F;
    crc = mti_crc32(0, buf, n - 4);
    for (int i = 0; i < 4; i++) buf[n - 4 + (size_t)i] = (unsigned char)(crc >> (8 * i));
    write_bytes(bad, buf, n);
    expect_refused(ctx, bad, MT_ERR_FORMAT, "not live");
    /* the good file still loads */
    mt_trace *t;
    CHECK_OK(mt_trace_load(ctx, good, &t));
    mt_trace_free(t);
    unlink(good);
    unlink(bad);
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(trace_from_events_checks)
{
    mt_trace_event ev[3] = {
        {.op = MT_TRACE_ALLOC, .id = 1, .bytes = 100, .mem_class = MT_MEM_ACT},
        {.op = MT_TRACE_FREE, .id = 1},
        {.op = MT_TRACE_FREE, .id = 1},
    };
    mt_trace *t;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trace_from_events(NULL, ev, 3, &t));
    CHECK(strstr(mt_last_error(NULL), "event 2"));
    CHECK_OK(mt_trace_from_events(NULL, ev, 2, &t));
    mt_trace_free(t);
    ev[0].mem_class = 9;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trace_from_events(NULL, ev, 2, &t));
    ev[0].mem_class = MT_MEM_ACT;
    ev[1].op = 77;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trace_from_events(NULL, ev, 2, &t));
    /* two instances: a reset of one leaves the other's blocks live */
    mt_trace_event two[5] = {
        {.op = MT_TRACE_ALLOC, .id = 1, .bytes = 100, .lifetime = MT_LIFE_STEP, .instance = 0},
        {.op = MT_TRACE_ALLOC, .id = 1, .bytes = 200, .lifetime = MT_LIFE_STEP, .instance = 1},
        {.op = MT_TRACE_RESET, .scope = MT_SCOPE_STEP, .instance = 0},
        {.op = MT_TRACE_FREE, .id = 1, .instance = 1},
        {.op = MT_TRACE_RESET, .scope = MT_SCOPE_STEP, .instance = 1},
    };
    CHECK_OK(mt_trace_from_events(NULL, two, 5, &t));
    mt_context *ctx;
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    mt_allocator *a;
    CHECK_OK(mt_allocator_create(ctx, NULL, &a));
    mt_replay_result r;
    CHECK_OK(mt_trace_replay(t, a, &r));
    CHECK_EQ(r.n_alloc, 2);
    CHECK_EQ(r.n_free, 2);
    CHECK_EQ(r.peak_live_bytes, 300);
    mt_allocator_destroy(a);
    mt_trace_free(t);
    CHECK_OK(mt_context_destroy(ctx));
}

/* Ids at the edges of the key space must not confuse the checks. */
TEST(trace_crafted_ids)
{
    mt_trace *t;
    const uint64_t top = ((uint64_t)1 << 56) - 1;
    mt_trace_event edge[3] = {
        {.op = MT_TRACE_ALLOC, .id = top, .bytes = 64, .instance = 255},
        {.op = MT_TRACE_FREE, .id = top, .instance = 255},
        {.op = MT_TRACE_FREE, .id = top, .instance = 255},
    };
    CHECK_OK(mt_trace_from_events(NULL, edge, 2, &t));
    mt_trace_free(t);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trace_from_events(NULL, edge, 3, &t));
    mt_trace_event wide[2] = {
        {.op = MT_TRACE_ALLOC, .id = (uint64_t)1 << 56, .bytes = 64},
        {.op = MT_TRACE_RESET, .scope = MT_SCOPE_ALL},
    };
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trace_from_events(NULL, wide, 2, &t));
    CHECK(strstr(mt_last_error(NULL), "event 0"));
    wide[1] = (mt_trace_event){.op = MT_TRACE_FREE, .id = 0};
    wide[0].id = 5;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trace_from_events(NULL, wide, 2, &t));
}

/* A trace started while blocks are live leaves their frees out, so what it
 * writes loads again. */
TEST(trace_started_mid_run)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    mt_alloc_request r = {.bytes = 1000, .mem_class = MT_MEM_ACT, .lifetime = MT_LIFE_STEP};
    mt_block old, young;
    CHECK_OK(mt_context_alloc(ctx, &r, &old));
    CHECK_OK(mt_context_trace_start(ctx, 100));
    CHECK_OK(mt_context_alloc(ctx, &r, &young));
    CHECK_OK(mt_context_free(ctx, &old));
    CHECK_OK(mt_context_free(ctx, &young));
    const mt_trace_event *ev;
    size_t n;
    CHECK_OK(mt_context_trace_events(ctx, &ev, &n, NULL));
    CHECK_EQ(n, 2);
    char path[256];
    tmp_path(path, sizeof path, "mid.trace");
    CHECK_OK(mt_context_trace_write(ctx, path));
    mt_trace *t;
    CHECK_OKC(ctx, mt_trace_load(ctx, path, &t));
    mt_trace_free(t);
    unlink(path);
    CHECK_OK(mt_context_destroy(ctx));
}

/* A FIFO is refused at once, not waited on. */
TEST(trace_load_not_a_file)
{
    char path[256];
    tmp_path(path, sizeof path, "fifo");
    unlink(path);
    CHECK(mkfifo(path, 0600) == 0);
    mt_trace *t;
    CHECK_ST(MT_ERR_IO, mt_trace_load(NULL, path, &t));
    CHECK(strstr(mt_last_error(NULL), "not a regular file"));
    unlink(path);
    CHECK_ST(MT_ERR_IO, mt_trace_load(NULL, "/tmp", &t));
}

/* Starting and stopping traces while threads allocate on a thread-safe
 * instance: no thread may write into a trace that was freed. */
typedef struct churn_arg {
    mt_context *ctx;
    _Atomic int *stop;
} churn_arg;

static void *churn(void *p)
{
    churn_arg *c = p;
    mt_alloc_request r = {.bytes = 4096, .mem_class = MT_MEM_WORK, .lifetime = MT_LIFE_STEP};
    while (!atomic_load(c->stop)) {
        mt_block b;
        EXPECT(mt_context_alloc(c->ctx, &r, &b) == MT_OK);
        EXPECT(mt_context_free(c->ctx, &b) == MT_OK);
    }
    return NULL;
}

TEST(trace_restart_under_threads)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    for (int c = 0; c < MT_MEM_COUNT; c++) cfg.allocators[c].flags = MT_ALLOCATOR_THREAD_SAFE;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cfg, &ctx));
    _Atomic int stop = 0;
    churn_arg arg = {ctx, &stop};
    pthread_t th[3];
    for (int i = 0; i < 3; i++) CHECK(pthread_create(&th[i], NULL, churn, &arg) == 0);
    for (int i = 0; i < 300; i++) {
        CHECK_OK(mt_context_trace_start(ctx, 64));
        if (i % 3 == 0) CHECK_OK(mt_context_trace_stop(ctx));
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    CHECK_OK(mt_context_destroy(ctx));
}
