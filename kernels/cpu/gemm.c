/*
 * gemm.c - one GEMM on the calling thread, through a oneDNN matmul
 * primitive: C (M,N) = op(A) op(B) [+ bias] [+ C], fp32 accumulation.
 *
 * Primitives are made once per shape (dims, leading dimensions, dtypes,
 * bias, accumulation) and kept in a process-wide table of at most
 * GEMM_CACHE entries; they are never evicted while the process lives
 * (training uses a few dozen shapes), and a shape past the bound gets a
 * primitive of its own, destroyed after its call.
 *
 * One threading layer: the library's OpenMP loops cut every GEMM into
 * tiles by shape (matmul.c) and each thread runs its tiles here, one
 * primitive call each, single-threaded: the primitive is made and run with
 * the calling thread's OpenMP thread count set to 1 (a per-thread setting),
 * so oneDNN neither starts threads of its own (no oversubscription) nor
 * splits a reduction by thread count (results do not depend on it).
 *
 * Scratchpad: mode "user", so the caller passes it (from the WORK
 * allocator, counted like every other workspace).
 */
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "cpu_ops.h"

#define GEMM_CACHE 512

struct mti_gemm_prim {
    mti_gemm_shape key;
    dnnl_primitive_t prim;
    size_t scratch; /* bytes */
    int cached;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t g_engine;
static mti_gemm_prim *g_cache[GEMM_CACHE];
static int g_n;
static pthread_key_t g_stream_key;
static int g_ready; /* 1: engine and stream key made; -1: failed */

static void stream_free(void *s) { dnnl_stream_destroy(s); }

static void gemm_init(void)
{
    (void)mti_isa_used(); /* MT_CPU_ISA caps oneDNN before it makes any code */
    if (dnnl_engine_create(&g_engine, dnnl_cpu, 0) != dnnl_success) {
        g_ready = -1;
        return;
    }
    g_ready = pthread_key_create(&g_stream_key, stream_free) == 0 ? 1 : -1;
}

static int engine_ready(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, gemm_init);
    return g_ready == 1;
}

/* The calling thread's stream (streams are not shared between threads). */
static dnnl_stream_t thread_stream(void)
{
    dnnl_stream_t s = pthread_getspecific(g_stream_key);
    if (s) return s;
    if (dnnl_stream_create(&s, g_engine, dnnl_stream_default_flags) != dnnl_success) return NULL;
    if (pthread_setspecific(g_stream_key, s)) {
        dnnl_stream_destroy(s);
        return NULL;
    }
    return s;
}

static dnnl_data_type_t dnnl_dt(mti_dtype dt)
{
    return dt == MTI_F32 ? dnnl_f32 : dt == MTI_BF16 ? dnnl_bf16 : dnnl_f16;
}

/* A matrix of rows x cols, stored row-major with leading dimension ld, or
 * transposed (stored cols x rows). */
static dnnl_status_t matrix_md(dnnl_memory_desc_t *md, int64_t rows, int64_t cols, int64_t ld,
                               int trans, mti_dtype dt)
{
    dnnl_dims_t dims = {rows, cols};
    dnnl_dims_t strides = {trans ? 1 : ld, trans ? ld : 1};
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dnnl_dt(dt), strides);
}

/* Runs f with the calling thread's OpenMP thread count at 1. */
#define SINGLE_THREADED(stmt)                                                                 \
    do {                                                                                      \
        int saved_ = omp_get_max_threads();                                                   \
        if (saved_ != 1) omp_set_num_threads(1);                                              \
        stmt;                                                                                 \
        if (saved_ != 1) omp_set_num_threads(saved_);                                         \
    } while (0)

static dnnl_status_t make_prim(const mti_gemm_shape *s, dnnl_primitive_t *prim, size_t *scratch)
{
    dnnl_memory_desc_t a, b, c, bias;
    dnnl_matmul_desc_t op;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_status_t st = matrix_md(&a, s->M, s->K, s->lda, s->ta, s->ab_dt);
    if (!st) st = matrix_md(&b, s->K, s->N, s->ldb, s->tb, s->ab_dt);
    if (!st) st = matrix_md(&c, s->M, s->N, s->ldc, 0, s->c_dt);
    if (!st && s->bias) st = matrix_md(&bias, 1, s->N, s->N, 0, s->bias_dt);
    if (!st) st = dnnl_matmul_desc_init(&op, &a, &b, s->bias ? &bias : NULL, &c);
    if (!st) st = dnnl_primitive_attr_create(&attr);
    if (!st) st = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (!st && s->accumulate) {
        st = dnnl_post_ops_create(&po);
        if (!st) st = dnnl_post_ops_append_sum(po, 1.0f);
        if (!st) st = dnnl_primitive_attr_set_post_ops(attr, po);
    }
    if (!st) SINGLE_THREADED(st = dnnl_primitive_desc_create(&pd, &op, attr, g_engine, NULL));
    if (!st) {
        const dnnl_memory_desc_t *sp = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
        *scratch = sp ? dnnl_memory_desc_get_size(sp) : 0;
        SINGLE_THREADED(st = dnnl_primitive_create(prim, pd));
    }
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return st;
}

int mti_gemm_supported(mti_dtype ab_dt)
{
    static int known[3] = {0, 0, 0}; /* per dtype: 0 unknown, 1 yes, -1 no */
    int i = ab_dt == MTI_F32 ? 0 : ab_dt == MTI_BF16 ? 1 : 2;
    int v = __atomic_load_n(&known[i], __ATOMIC_RELAXED);
    if (v) return v > 0;
    /* 16-bit inputs only on the CPU's own 16-bit instructions: oneDNN also
       makes bf16 matmuls on plain AVX-512 by emulating them, at under half
       the fp32 rate, where the converted path (fp32 panels) keeps it. Then
       a small probe: oneDNN picks the ISA at run time, and fp16 needs
       AVX512-FP16 or AMX-FP16 (of the classes, only AMX CPUs have them) */
    const mti_isa need = ab_dt == MTI_F32 ? MTI_ISA_BASELINE
                         : ab_dt == MTI_BF16 ? MTI_ISA_AVX512_BF16 : MTI_ISA_AMX;
    mti_gemm_shape s = {.M = 16, .N = 16, .K = 16, .lda = 16, .ldb = 16, .ldc = 16,
                        .ab_dt = ab_dt, .c_dt = MTI_F32};
    dnnl_primitive_t p = NULL;
    size_t scratch;
    v = mti_isa_used() >= need && engine_ready() && make_prim(&s, &p, &scratch) == dnnl_success
            ? 1 : -1;
    if (p) dnnl_primitive_destroy(p);
    __atomic_store_n(&known[i], v, __ATOMIC_RELAXED);
    return v > 0;
}

mt_status mti_gemm_get(const mti_kctx *k, const mti_gemm_shape *shape, mti_gemm_prim **out)
{
    mti_gemm_shape key;
    memset(&key, 0, sizeof key); /* the key is compared bytewise */
    key.M = shape->M, key.N = shape->N, key.K = shape->K, key.ta = shape->ta, key.tb = shape->tb;
    key.lda = shape->lda, key.ldb = shape->ldb, key.ldc = shape->ldc;
    key.ab_dt = shape->ab_dt, key.c_dt = shape->c_dt, key.bias_dt = shape->bias_dt;
    key.bias = shape->bias, key.accumulate = shape->accumulate;
    *out = NULL;
    if (!engine_ready())
        return mti_fail(k->ctx, MT_ERR_DEVICE, "gemm: no oneDNN CPU engine");
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_n; i++)
        if (!memcmp(&g_cache[i]->key, &key, sizeof key)) {
            *out = g_cache[i];
            pthread_mutex_unlock(&g_lock);
            return MT_OK;
        }
    mti_gemm_prim *p = calloc(1, sizeof *p);
    dnnl_status_t st = p ? make_prim(&key, &p->prim, &p->scratch) : dnnl_out_of_memory;
    if (st != dnnl_success) {
        pthread_mutex_unlock(&g_lock);
        free(p);
        return mti_fail(k->ctx,
                        st == dnnl_out_of_memory  ? MT_ERR_OOM
                        : st == dnnl_unimplemented ? MT_ERR_UNSUPPORTED
                                                   : MT_ERR_DEVICE,
                        "gemm: no oneDNN matmul for (%d,%d,%d) dtype %d -> %d (status %d)",
                        key.M, key.N, key.K, (int)key.ab_dt, (int)key.c_dt, (int)st);
    }
    p->key = key;
    if (g_n < GEMM_CACHE) {
        p->cached = 1;
        g_cache[g_n++] = p;
    }
    pthread_mutex_unlock(&g_lock);
    *out = p;
    return MT_OK;
}

void mti_gemm_put(mti_gemm_prim *p)
{
    if (!p || p->cached) return;
    dnnl_primitive_destroy(p->prim);
    free(p);
}

size_t mti_gemm_scratch(const mti_gemm_prim *p) { return p ? p->scratch : 0; }

int mti_gemm_run(const mti_gemm_prim *p, const void *a, const void *b, void *c,
                 const void *bias, void *scratch)
{
    dnnl_stream_t s = thread_stream();
    if (!s) return -1;
    const mti_gemm_shape *k = &p->key;
    dnnl_memory_desc_t md[5];
    dnnl_memory_t mem[5] = {NULL};
    void *ptr[5] = {(void *)a, (void *)b, c, (void *)bias, scratch};
    int arg[5] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST, DNNL_ARG_BIAS, DNNL_ARG_SCRATCHPAD};
    int n = 3;
    dnnl_status_t st = matrix_md(&md[0], k->M, k->K, k->lda, k->ta, k->ab_dt);
    if (!st) st = matrix_md(&md[1], k->K, k->N, k->ldb, k->tb, k->ab_dt);
    if (!st) st = matrix_md(&md[2], k->M, k->N, k->ldc, 0, k->c_dt);
    if (!st && k->bias) st = matrix_md(&md[n++], 1, k->N, k->N, 0, k->bias_dt);
    if (!st && p->scratch) {
        dnnl_dims_t d = {(int64_t)p->scratch};
        ptr[n] = scratch, arg[n] = DNNL_ARG_SCRATCHPAD;
        st = dnnl_memory_desc_init_by_tag(&md[n++], 1, d, dnnl_u8, dnnl_a);
    }
    dnnl_exec_arg_t args[5];
    for (int i = 0; !st && i < n; i++) {
        st = dnnl_memory_create(&mem[i], &md[i], g_engine, ptr[i]);
        args[i] = (dnnl_exec_arg_t){arg[i], mem[i]};
    }
    if (!st) SINGLE_THREADED(st = dnnl_primitive_execute(p->prim, s, n, args));
    for (int i = 0; i < n; i++)
        if (mem[i]) dnnl_memory_destroy(mem[i]);
    return st == dnnl_success ? 0 : -1;
}
