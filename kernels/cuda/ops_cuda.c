/*
 * ops_cuda.c - the CUDA op table: the semantics of lib/ops/kernels.h, with the
 * kernels of kernels/cuda (embedded in the library, loaded by the device)
 * and GEMMs through cuBLASLt. Everything is queued on the device's stream;
 * nothing here waits for the GPU.
 *
 * cuBLASLt is opened with dlopen on the first GEMM: the context's
 * cublaslt_path, else $MT_CUBLASLT_PATH, else the first of the usual places
 * that loads (mti_cublaslt_candidates: the loader's path, the CUDA toolkit,
 * PyTorch's pip wheels). The table exists, and every other op runs, where
 * the library is missing; a GEMM then fails with MT_ERR_UNSUPPORTED naming
 * the paths tried.
 * GEMMs accumulate in fp32 (CUBLAS_COMPUTE_32F: no TF32), and an algorithm
 * that splits the inner dimension may only add its pieces in fp32 (the
 * compute-type reduction scheme) when the output is 16-bit, so each output
 * is rounded once. cuBLASLt gives the same bits on every run for the same
 * problem on the same GPU; it does not promise the same bits on another GPU
 * model, and neither do we for GEMMs.
 *
 * Per device the table keeps (mti_cuda_attach) the cuBLASLt handle and a
 * small cache of GEMM plans (descriptors and the chosen algorithm) keyed by
 * shape, types and pointer alignments, so a training step's repeated GEMMs
 * skip the heuristic. Every GEMM takes MTI_GEMM_WORKSPACE of workspace from
 * the WORK allocator, the most the heuristic may choose an algorithm for, so
 * the bytes a step takes do not depend on cuBLASLt's choices.
 *
 * In a dry context (an estimate, lib/engine/estimate.c) the table runs as it is,
 * argument checks and workspace included, but launches nothing and makes no
 * GEMM: launch, gemm and gemm_ready stop there, and the dry device's copies
 * and memsets do nothing.
 *
 * Determinism of the rest: no float atomics anywhere (see each kernel
 * file); every reduction's order depends only on the shapes, never on the
 * GPU's size or timing. Where it costs nothing the kernels also follow the
 * CPU table's order of operations, so these give the CPU's bits exactly:
 * casts, add, accumulate, ReLU, the embedding forward, the layernorm
 * forward and input gradient, the sum of squares, unscaling and the
 * optimizer updates (8-bit AdamW included). GEMMs, attention,
 * cross-entropy and distillation's loss, GELU (the CPU has its own exp),
 * sums over more than 128 rows and Adafactor (its means and RMS sum in
 * another order) agree within rounding.
 *
 * Argument checks follow the CPU table's: bad dtypes and negative sizes
 * are MT_ERR_INVALID_ARG, empty shapes do nothing.
 */
#include <dlfcn.h>
#include <math.h>
#include <unistd.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "device/cublaslt_api.h"
#include "device/cuda_device.h"
#include "ops/kernels.h"
#include "quant/quant.h"
#include "../kernels/cuda/dequant.cuh"

#define MTI_GEMM_WORKSPACE (4u << 20) /* most workspace a GEMM may take, bytes */
#define MTI_GEMM_PLANS 32             /* GEMM plans kept per device */
#define MTI_GEMM_CANDIDATES 4         /* algorithms asked of the heuristic per plan */
#define MTI_COLSUM_CHUNK 128          /* rows per partial sum of a column sum */
#define MTI_SUMSQ_BLOCK 4096          /* elements per block sum of sumsq (reduce.cu) */
#define MTI_SUMSQ_ROUND_BLOCKS 64     /* block sums per round of sumsq (reduce.cu) */
#define MTI_EW_THREADS 256u           /* threads per block, elementwise kernels */
#define MTI_ATTN_THREADS 256u         /* threads per block, attention (attention.cu) */
#define MTI_ATTN_TC_THREADS 128u      /* threads per block, attention_tc.cu */
#define MTI_ATTN_TC_ROWS 64u          /* queries (or keys) per block there */
#define MTI_ATTN_TC_HS 64             /* the one head size it takes */
#define MTI_LN_ROWS 16                /* rows per block of 256, layernorm (layernorm.cu) */
#define MTI_XENT_THREADS 512u         /* threads per block, cross-entropy (xent.cu) */
#define MTI_GRID_Y_MAX 65535u

/* ---- cuBLASLt, loaded once per process ---- */

typedef struct lt_api {
    void *lib;
    PFN_cublasLtCreate Create;
    PFN_cublasLtDestroy Destroy;
    PFN_cublasLtGetVersion GetVersion;
    PFN_cublasLtGetStatusName GetStatusName;
    PFN_cublasLtMatmulDescCreate MatmulDescCreate;
    PFN_cublasLtMatmulDescDestroy MatmulDescDestroy;
    PFN_cublasLtMatmulDescSetAttribute MatmulDescSetAttribute;
    PFN_cublasLtMatrixLayoutCreate MatrixLayoutCreate;
    PFN_cublasLtMatrixLayoutDestroy MatrixLayoutDestroy;
    PFN_cublasLtMatmulPreferenceCreate MatmulPreferenceCreate;
    PFN_cublasLtMatmulPreferenceDestroy MatmulPreferenceDestroy;
    PFN_cublasLtMatmulPreferenceSetAttribute MatmulPreferenceSetAttribute;
    PFN_cublasLtMatmulAlgoGetHeuristic MatmulAlgoGetHeuristic;
    PFN_cublasLtMatmul Matmul;
} lt_api;

static const struct {
    const char *name;
    size_t off;
} lt_syms[] = {
#define SYM(field) {"cublasLt" #field, offsetof(lt_api, field)}
    SYM(Create),
    SYM(Destroy),
    SYM(GetVersion),
    SYM(GetStatusName),
    SYM(MatmulDescCreate),
    SYM(MatmulDescDestroy),
    SYM(MatmulDescSetAttribute),
    SYM(MatrixLayoutCreate),
    SYM(MatrixLayoutDestroy),
    SYM(MatmulPreferenceCreate),
    SYM(MatmulPreferenceDestroy),
    SYM(MatmulPreferenceSetAttribute),
    SYM(MatmulAlgoGetHeuristic),
    SYM(Matmul),
#undef SYM
};

/* The cuBLASLt libraries loaded so far: the default search's, and one per
 * path a context named (mt_context_config.cublaslt_path). They stay loaded
 * (RTLD_NODELETE): handles made from them live in device state. */
#define LT_LIBS 4
typedef struct lt_lib {
    int tried;
    char path[256];      /* "" for the default search */
    lt_api api;          /* api.lib NULL: not loadable, see why */
    char why[2048];
} lt_lib;

static lt_lib g_lt[LT_LIBS];
static pthread_mutex_t g_lt_mu = PTHREAD_MUTEX_INITIALIZER;

/* Opens `path` and takes every entry point, or says in why what failed. */
static int lt_try(lt_lib *L, const char *path, size_t *used)
{
    memset(&L->api, 0, sizeof L->api);
    if (strchr(path, '/') && access(path, F_OK) != 0) { /* the common case, said briefly */
        if (*used < sizeof L->why)
            *used += (size_t)snprintf(L->why + *used, sizeof L->why - *used, " %s (absent);",
                                      path);
        return 0;
    }
    dlerror();
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (!lib) {
        const char *e = dlerror();
        if (*used < sizeof L->why)
            *used += (size_t)snprintf(L->why + *used, sizeof L->why - *used, " %s: %s;", path,
                                      e ? e : "cannot load");
        return 0;
    }
    size_t i = 0;
    for (; i < sizeof lt_syms / sizeof lt_syms[0]; i++) {
        void *fn = dlsym(lib, lt_syms[i].name);
        if (!fn) break;
        memcpy((char *)&L->api + lt_syms[i].off, &fn, sizeof fn);
    }
    if (i < sizeof lt_syms / sizeof lt_syms[0]) {
        if (*used < sizeof L->why)
            *used += (size_t)snprintf(L->why + *used, sizeof L->why - *used, " %s has no %s;",
                                      path, lt_syms[i].name);
        dlclose(lib);
        memset(&L->api, 0, sizeof L->api);
        return 0;
    }
    L->api.lib = lib;
    L->why[0] = 0;
    return 1;
}

/* The cuBLASLt at `path` (NULL: the first of mti_cublaslt_candidates that
 * loads with every entry point), loaded on first use. NULL when too many paths were asked
 * for; otherwise api.lib is NULL when it cannot be loaded, and why says so. */
static const lt_lib *lt_open(const char *path)
{
    const char *key = path ? path : "";
    if (strlen(key) >= sizeof g_lt[0].path) return NULL;
    pthread_mutex_lock(&g_lt_mu);
    lt_lib *L = NULL;
    for (int i = 0; i < LT_LIBS && !L; i++)
        if (!g_lt[i].tried || strcmp(g_lt[i].path, key) == 0) L = &g_lt[i];
    if (L && !L->tried) {
        L->tried = 1;
        snprintf(L->path, sizeof L->path, "%s", key);
        size_t used = (size_t)snprintf(L->why, sizeof L->why,
                                       "cuBLASLt not found (CUDA GEMMs need it: install the CUDA "
                                       "toolkit's cuBLAS, or name the library with "
                                       "MT_CUBLASLT_PATH or cublaslt_path); tried:");
        if (path) {
            lt_try(L, path, &used);
        } else {
            static char cand[MTI_LT_CANDIDATES][MTI_LT_PATH]; /* under g_lt_mu */
            size_t n = mti_cublaslt_candidates(cand, MTI_LT_CANDIDATES);
            for (size_t p = 0; p < n; p++)
                if (lt_try(L, cand[p], &used)) break;
        }
    }
    pthread_mutex_unlock(&g_lt_mu);
    return L;
}

static const char *lt_status_name(const lt_api *api, cublasStatus_t s)
{
    const char *n = api && api->GetStatusName ? api->GetStatusName(s) : NULL;
    return n ? n : "unknown cuBLAS status";
}

/* ---- per-device state ---- */

/* What makes two GEMMs share a plan: all ints, compared as bytes. */
typedef struct gemm_key {
    int ta, tb;                  /* CUBLAS_OP_* of A and B */
    int m, n, k;                 /* D (m,n) = op(A) (m,k) . op(B) (k,n), column-major */
    int lda, ldb, ldd;
    int a_type, b_type, d_type;  /* cudaDataType; C has D's */
    int bias;                    /* 1: bias epilogue (bias in D's type, one per row of D) */
    int align[4];                /* alignment of A, B, D, bias in bytes (<= 256) */
} gemm_key;

typedef struct gemm_plan {
    gemm_key key;
    int used;
    int none;                    /* the heuristic found no algorithm: remembered */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
} gemm_plan;

typedef struct ops_state {
    pthread_mutex_t mu;          /* guards everything below */
    int lt_tried;                /* the handle was asked for once: lt_status says how it went */
    mt_status lt_status;
    char lt_why[2048];
    const lt_api *api;           /* the cuBLASLt the handle came from */
    cublasLtHandle_t lt;
    gemm_plan plans[MTI_GEMM_PLANS];
    unsigned next_evict;
} ops_state;

static void plan_drop(const ops_state *s, gemm_plan *p)
{
    if (!p->used) return;
    if (p->la) s->api->MatrixLayoutDestroy(p->la);
    if (p->lb) s->api->MatrixLayoutDestroy(p->lb);
    if (p->ld) s->api->MatrixLayoutDestroy(p->ld);
    if (p->desc) s->api->MatmulDescDestroy(p->desc);
    memset(p, 0, sizeof *p);
}

/* Called by the device when it closes, with its context current. */
static void state_free(mti_device *d, void *arg)
{
    ops_state *s = arg;
    for (int i = 0; i < MTI_GEMM_PLANS; i++) plan_drop(s, &s->plans[i]);
    if (s->lt) s->api->Destroy(s->lt);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static ops_state *state_of(mti_device *d)
{
    ops_state *s = mti_cuda_attached(d);
    if (s) return s;
    ops_state *mine = calloc(1, sizeof *mine);
    if (!mine) return NULL;
    pthread_mutex_init(&mine->mu, NULL);
    s = mti_cuda_attach(d, mine, state_free);
    if (s != mine) {
        pthread_mutex_destroy(&mine->mu);
        free(mine);
    }
    return s;
}

/* The cuBLASLt handle of the device, made on first use. Called with s->mu
 * held and the context current. The library's runtime talks to the
 * process's libcuda.so.1, so the device must be driven by that very driver
 * (not, say, the test suite's stand-in loaded from another path). */
static mt_status lt_handle(const mti_kctx *k, ops_state *s)
{
    if (s->lt_tried) {
        if (s->lt_status != MT_OK) return mti_fail(k->ctx, s->lt_status, "%s", s->lt_why);
        return MT_OK;
    }
    s->lt_tried = 1;
    s->lt_status = MT_OK;
    /* a path given (the context's, else the environment's) is taken as it
     * is and trusted to drive the device */
    const char *path = k->ctx->cfg.cublaslt_path;
    if (!path || !*path) path = getenv("MT_CUBLASLT_PATH");
    if (path && !*path) path = NULL;
    const lt_lib *L = lt_open(path);
    if (!L) {
        s->lt_status = MT_ERR_UNSUPPORTED;
        if (path && strlen(path) >= sizeof L->path)
            snprintf(s->lt_why, sizeof s->lt_why,
                     "cuBLASLt: the path \"%.200s...\" is longer than %zu bytes", path,
                     sizeof L->path - 1);
        else
            snprintf(s->lt_why, sizeof s->lt_why,
                     "cuBLASLt: cannot load \"%.200s\": this process already loaded %d "
                     "different cuBLASLt libraries", path ? path : "", LT_LIBS);
    } else if (!L->api.lib) {
        s->lt_status = MT_ERR_UNSUPPORTED;
        snprintf(s->lt_why, sizeof s->lt_why, "%s", L->why);
    } else if (!path && !mti_cuda_is_system_driver(k->dev)) {
        s->lt_status = MT_ERR_UNSUPPORTED;
        snprintf(s->lt_why, sizeof s->lt_why,
                 "cuBLASLt drives the GPU through the system's libcuda.so.1, and this device "
                 "runs on another CUDA driver library: no GEMMs on it (unless cublaslt_path or "
                 "MT_CUBLASLT_PATH names a cuBLASLt that drives it)");
    } else {
        s->api = &L->api;
        cublasStatus_t r = s->api->Create(&s->lt);
        if (r != CUBLAS_STATUS_SUCCESS) {
            s->lt = NULL;
            s->lt_status = MT_ERR_DEVICE;
            snprintf(s->lt_why, sizeof s->lt_why, "cublasLtCreate (cuBLASLt %zu) failed: %s",
                     s->api->GetVersion(), lt_status_name(s->api, r));
            /* out of memory may pass: try again next time */
            if (r == CUBLAS_STATUS_ALLOC_FAILED) {
                s->lt_tried = 0;
                s->lt_status = MT_ERR_OOM;
            }
        } else {
            mti_log(k->ctx, MT_LOG_INFO, "cuBLASLt %zu ready on %s", s->api->GetVersion(),
                    k->dev->name);
        }
    }
    if (s->lt_status != MT_OK) return mti_fail(k->ctx, s->lt_status, "%s", s->lt_why);
    return MT_OK;
}

/* ---- helpers ---- */

static int dt_ok(mti_dtype dt) { return dt == MTI_F32 || dt == MTI_F16 || dt == MTI_BF16; }

static const char *dt_name(mti_dtype dt)
{
    switch (dt) {
    case MTI_F32: return "fp32";
    case MTI_F16: return "fp16";
    case MTI_BF16: return "bf16";
    default: return "not a storage dtype";
    }
}

static cudaDataType lt_type(mti_dtype dt)
{
    return dt == MTI_F16 ? CUDA_R_16F : dt == MTI_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

static mti_dtype bias_dt(cudaDataType t)
{
    return t == CUDA_R_16F ? MTI_F16 : t == CUDA_R_16BF ? MTI_BF16 : MTI_F32;
}

static mt_status bad_arg(const mti_kctx *k, const char *op, const char *why)
{
    return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "CUDA %s: %s", op, why);
}

static mt_status bad_dt(const mti_kctx *k, const char *op, mti_dtype dt)
{
    return mti_fail(k->ctx, MT_ERR_INVALID_ARG, "CUDA %s: dtype %d (%s) is not fp32, fp16 or bf16",
                    op, (int)dt, dt_name(dt));
}

/* The op running on this thread and its shapes, noted by every op in
 * debug mode (mti_cuda_debug_sync) for the message of a kernel that fails. */
static _Thread_local char t_op[200];
#define OP_NOTE(k, ...)                                                                        \
    do {                                                                                       \
        if (!mti_dry(k) && mti_cuda_debug_sync((k)->dev))                                      \
            snprintf(t_op, sizeof t_op, __VA_ARGS__);                                          \
    } while (0)

/* In debug mode, a failure st gets the op and its shapes in front. */
static mt_status op_failed(const mti_kctx *k, mt_status st)
{
    if (st == MT_OK || !t_op[0] || !mti_cuda_debug_sync(k->dev)) return st;
    return mti_fail(k->ctx, st, "CUDA %s: %s", t_op, mti_last_msg(k->ctx).s);
}

/* Queues kernel `id` (for a per-dtype kernel: its fp32 id plus the dtype). */
static mt_status launch(const mti_kctx *k, int id, mti_dim3 grid, unsigned threads, void **args)
{
    if (mti_dry(k)) return MT_OK; /* an estimate: nothing runs */
    mti_cuda_fn *fn;
    mt_status st = mti_cuda_kernel(k->dev, (mti_cuda_kernel_id)id, &fn);
    if (st != MT_OK) return st;
    return op_failed(k, mti_cuda_launch(k->dev, fn, grid, (mti_dim3){threads, 1, 1}, 0, args));
}

/* Elementwise kernels loop with a grid stride: enough blocks to fill any
 * GPU, capped so huge n does not make huge grids. */
static mti_dim3 ew_grid(size_t n)
{
    size_t blocks = (n + MTI_EW_THREADS - 1) / MTI_EW_THREADS;
    if (blocks == 0) blocks = 1;
    if (blocks > 65535) blocks = 65535;
    return (mti_dim3){(unsigned)blocks, 1, 1};
}

static size_t cdiv(size_t a, size_t b) { return (a + b - 1) / b; }

/* Workspace carved into 256-byte-aligned pieces of one WORK block. */
typedef struct carver {
    mt_block blk;
    size_t off;
} carver;

static void *carve(carver *c, size_t bytes)
{
    void *p = (char *)c->blk.ptr + c->off;
    c->off += mti_align_up(bytes, 256);
    return p;
}

/* out (cols) fp32 += sum over rows of x (rows, cols) in dt, in row order
 * per chunk of MTI_COLSUM_CHUNK rows, chunks in order (reduce.cu). */
static mt_status colsum(const mti_kctx *k, float *out, const void *x, int rows, long long cols,
                        mti_dtype dt, int set)
{
    if (cols <= 0) return MT_OK;
    if (rows <= 0) /* an empty sum: zeros, or nothing to add */
        return set ? k->dev->memset8(k->dev, out, 0, (size_t)cols * sizeof(float)) : MT_OK;
    int chunk = MTI_COLSUM_CHUNK;
    if (cdiv((size_t)rows, (size_t)chunk) > MTI_GRID_Y_MAX)
        chunk = (int)cdiv((size_t)rows, MTI_GRID_Y_MAX);
    int nchunks = (int)cdiv((size_t)rows, (size_t)chunk);
    carver w = {0};
    float *part = NULL;
    mt_status st;
    if (nchunks > 1) {
        if ((st = mti_work_alloc(k, (size_t)nchunks * (size_t)cols * sizeof(float), &w.blk)))
            return st;
        part = w.blk.ptr;
    }
    mti_dim3 grid = {(unsigned)cdiv((size_t)cols, 256), (unsigned)nchunks, 1};
    void *a1[] = {&out, &part, &x, &rows, &cols, &chunk, &set};
    st = launch(k, MTI_CUDA_COLSUM_F32 + dt, grid, 256, a1);
    if (st == MT_OK && part) {
        const float *cpart = part;
        void *a2[] = {&out, &cpart, &nchunks, &cols, &set};
        st = launch(k, MTI_CUDA_COLSUM_FINISH, (mti_dim3){grid.x, 1, 1}, 256, a2);
    }
    mti_work_free(k, &w.blk);
    return st;
}

/* ---- casts ---- */

static mt_status cu_cast(const mti_kctx *k, void *dst, mti_dtype dst_dt, const void *src,
                         mti_dtype src_dt, size_t n, mti_rounding r, uint64_t seed)
{
    OP_NOTE(k, "cast n=%zu %s -> %s", n, dt_name(src_dt), dt_name(dst_dt));
    if (r != MTI_ROUND_NEAREST && r != MTI_ROUND_STOCHASTIC)
        return bad_arg(k, "cast", "rounding is neither nearest nor stochastic");
    /* int32 only to itself (a copy) */
    if (!(dst_dt == src_dt && dst_dt == MTI_I32)) {
        if (!dt_ok(dst_dt)) return bad_dt(k, "cast", dst_dt);
        if (!dt_ok(src_dt)) return bad_dt(k, "cast", src_dt);
    }
    if (r == MTI_ROUND_STOCHASTIC && dst_dt != MTI_BF16)
        return bad_arg(k, "cast", "stochastic rounding is for bf16 destinations only");
    if (n == 0 || (dst == src && dst_dt == src_dt)) return MT_OK;
    if (dst_dt == src_dt) /* exact either way: a copy (NaN bits kept) */
        return k->dev->copy_d2d(k->dev, dst, src, n * mti_dtype_size(dst_dt));
    int ddt = (int)dst_dt, sdt = (int)src_dt, sr = r == MTI_ROUND_STOCHASTIC;
    unsigned long long nn = n, sd = seed;
    void *args[] = {&dst, &ddt, &src, &sdt, &nn, &sr, &sd};
    return launch(k, MTI_CUDA_CAST, ew_grid(n), MTI_EW_THREADS, args);
}

/* ---- embedding ---- */

static mt_status cu_embedding_fwd(const mti_kctx *k, void *out, const int32_t *tok,
                                  const void *wte, const void *wpe, int B, int T, int C,
                                  mti_dtype dt)
{
    OP_NOTE(k, "embedding_fwd B=%d T=%d C=%d %s%s", B, T, C, dt_name(dt),
            wpe ? "" : " (no positions)");
    if (!dt_ok(dt)) return bad_dt(k, "embedding_fwd", dt);
    if (B <= 0 || T <= 0 || C <= 0) return MT_OK;
    unsigned long long n = (unsigned long long)B * T * C;
    void *args[] = {&out, &tok, &wte, &wpe, &T, &C, &n};
    return launch(k, MTI_CUDA_EMB_FWD_F32 + dt, ew_grid(n), MTI_EW_THREADS, args);
}

static mt_status cu_embedding_fwd_rows(const mti_kctx *k, void *out, const int32_t *tok,
                                       const void *wte, int v0, int v1, int B, int T, int C,
                                       mti_dtype dt)
{
    OP_NOTE(k, "embedding_fwd_rows B=%d T=%d C=%d rows [%d,%d) %s", B, T, C, v0, v1,
            dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "embedding_fwd_rows", dt);
    if (v0 < 0 || v1 < v0) return bad_arg(k, "embedding_fwd_rows", "bad row range");
    if (B <= 0 || T <= 0 || C <= 0) return MT_OK;
    unsigned long long n = (unsigned long long)B * T * C;
    void *args[] = {&out, &tok, &wte, &v0, &v1, &C, &n};
    return launch(k, MTI_CUDA_EMB_FWD_ROWS_F32 + dt, ew_grid(n), MTI_EW_THREADS, args);
}

/* Rows [v0, v1) of dwte (pointing at row v0) through the grouping of
 * embedding.cu (hash, scan, fill, rank, add). */
static mt_status wte_grad(const mti_kctx *k, float *dwte, const void *dout, const int32_t *tok,
                          size_t n64, int C, int v0, int v1, mti_dtype dt)
{
    if (n64 > (1u << 28)) return bad_arg(k, "embedding_bwd", "more than 2^28 tokens");
    mt_status st;
    int n = (int)n64, S = 2;
    while ((size_t)S < 2 * n64) S <<= 1;
    carver w = {0};
    size_t bytes = 2 * mti_align_up((size_t)S * 4, 256) +
                   mti_align_up((size_t)(S + 1) * 4, 256) + 3 * mti_align_up(n64 * 4, 256);
    if ((st = mti_work_alloc(k, bytes, &w.blk))) return st;
    int *keys = carve(&w, (size_t)S * 4), *counts = carve(&w, (size_t)S * 4);
    int *start = carve(&w, (size_t)(S + 1) * 4), *slot_of = carve(&w, n64 * 4);
    int *unsorted = carve(&w, n64 * 4), *sorted = carve(&w, n64 * 4);
    st = k->dev->memset8(k->dev, keys, 0xFF, (size_t)S * 4); /* every key -1: free */
    if (st == MT_OK) st = k->dev->memset8(k->dev, counts, 0, (size_t)S * 4);
    if (st == MT_OK) {
        void *a[] = {&keys, &counts, &slot_of, &tok, &n, &S};
        st = launch(k, MTI_CUDA_EMB_HASH, ew_grid(n64), MTI_EW_THREADS, a);
    }
    if (st == MT_OK) {
        void *a[] = {&start, &counts, &S};
        st = launch(k, MTI_CUDA_EMB_SCAN, (mti_dim3){1, 1, 1}, 1024, a);
    }
    if (st == MT_OK) {
        void *a[] = {&unsorted, &counts, &start, &slot_of, &n};
        st = launch(k, MTI_CUDA_EMB_FILL, ew_grid(n64), MTI_EW_THREADS, a);
    }
    if (st == MT_OK) {
        void *a[] = {&sorted, &unsorted, &start, &slot_of, &n};
        st = launch(k, MTI_CUDA_EMB_RANK, ew_grid(n64), MTI_EW_THREADS, a);
    }
    if (st == MT_OK) {
        void *a[] = {&dwte, &dout, &sorted, &start, &slot_of, &tok, &C, &v0, &v1};
        mti_dim3 grid = {(unsigned)n, (unsigned)cdiv((size_t)C, 256), 1};
        if (grid.y > MTI_GRID_Y_MAX) st = bad_arg(k, "embedding_bwd", "C too large");
        else st = launch(k, MTI_CUDA_EMB_BWD_WTE_F32 + dt, grid, 256, a);
    }
    mti_work_free(k, &w.blk);
    return st;
}

/* dwte as wte_grad; dwpe through a column sum over B of dout viewed as
 * (B, T*C). */
static mt_status cu_embedding_bwd(const mti_kctx *k, float *dwte, float *dwpe, const void *dout,
                                  const int32_t *tok, int B, int T, int C, mti_dtype dt)
{
    OP_NOTE(k, "embedding_bwd B=%d T=%d C=%d %s", B, T, C, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "embedding_bwd", dt);
    if (B <= 0 || T <= 0 || C <= 0) return MT_OK;
    mt_status st = MT_OK;
    if (dwte && (st = wte_grad(k, dwte, dout, tok, (size_t)B * (size_t)T, C, 0, INT_MAX, dt)))
        return st;
    if (dwpe) st = colsum(k, dwpe, dout, B, (long long)T * C, dt, 0);
    return st;
}

static mt_status cu_embedding_dw_rows(const mti_kctx *k, float *dwte, const void *dout,
                                      const int32_t *tok, int B, int T, int C, int v0, int v1,
                                      mti_dtype dt)
{
    OP_NOTE(k, "embedding_dw_rows B=%d T=%d C=%d rows [%d,%d) %s", B, T, C, v0, v1,
            dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "embedding_dw_rows", dt);
    if (v0 < 0 || v1 < v0) return bad_arg(k, "embedding_dw_rows", "bad row range");
    if (B <= 0 || T <= 0 || C <= 0 || v0 == v1) return MT_OK;
    return wte_grad(k, dwte, dout, tok, (size_t)B * (size_t)T, C, v0, v1, dt);
}

/* ---- matmul through cuBLASLt ---- */

static int align_of(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 1 && (a & (uintptr_t)(al - 1))) al >>= 1;
    return al;
}

/* Makes the plan for `key`: descriptors, preferences and the heuristic's
 * first usable choice. When the heuristic has no algorithm (no results, or
 * CUBLAS_STATUS_NOT_SUPPORTED) the plan is kept with `none` set (and MT_OK
 * returned), so the question is not asked again.
 * Called with s->mu held and the context current. */
static mt_status plan_make(const mti_kctx *k, ops_state *s, gemm_plan *p, const gemm_key *key,
                           const void *bias, const char *what)
{
    cublasStatus_t r;
    const char *call = "";
    cublasLtMatmulPreference_t pref = NULL;
    memset(p, 0, sizeof *p);
    p->key = *key;
    p->used = 1;
    int32_t ta = key->ta, tb = key->tb;
    uint32_t epi = key->bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    uint64_t max_ws = MTI_GEMM_WORKSPACE;
    uint32_t al[4] = {(uint32_t)key->align[0], (uint32_t)key->align[1], (uint32_t)key->align[2],
                      (uint32_t)key->align[2]};
#define LT_TRY(c)                                                                              \
    do {                                                                                       \
        call = #c;                                                                             \
        if ((r = (c)) != CUBLAS_STATUS_SUCCESS) goto fail;                                     \
    } while (0)
    LT_TRY(s->api->MatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_TRY(s->api->MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_TRY(s->api->MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    LT_TRY(s->api->MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (key->bias) /* the heuristic reads the pointer's alignment */
        LT_TRY(s->api->MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                           sizeof bias));
    /* layouts as stored: op(A) is (m,k), so A is (m,k) or, transposed, (k,m) */
    LT_TRY(s->api->MatrixLayoutCreate(&p->la, key->a_type, key->ta == CUBLAS_OP_N ? key->m : key->k,
                                   key->ta == CUBLAS_OP_N ? key->k : key->m, key->lda));
    LT_TRY(s->api->MatrixLayoutCreate(&p->lb, key->b_type, key->tb == CUBLAS_OP_N ? key->k : key->n,
                                   key->tb == CUBLAS_OP_N ? key->n : key->k, key->ldb));
    LT_TRY(s->api->MatrixLayoutCreate(&p->ld, key->d_type, key->m, key->n, key->ldd));
    LT_TRY(s->api->MatmulPreferenceCreate(&pref));
    LT_TRY(s->api->MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &max_ws, sizeof max_ws));
    for (int i = 0; i < 4; i++)
        LT_TRY(s->api->MatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i, &al[i], sizeof al[i]));
    if (key->d_type != CUDA_R_32F) {
        /* split-K pieces added in fp32 only: 16-bit outputs are rounded once */
        uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
        LT_TRY(s->api->MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                 &mask, sizeof mask));
    }
    /* "no algorithm" comes either as success with no results or as
     * CUBLAS_STATUS_NOT_SUPPORTED from the call itself: both are an answer
     * about the problem, remembered in the plan, not a device failure. Of
     * the candidates, the first valid one within the workspace is taken. */
    cublasLtMatmulHeuristicResult_t res[MTI_GEMM_CANDIDATES];
    int got = 0, pick = -1;
    memset(res, 0, sizeof res);
    call = "cublasLtMatmulAlgoGetHeuristic";
    r = s->api->MatmulAlgoGetHeuristic(s->lt, p->desc, p->la, p->lb, p->ld, p->ld, pref,
                                       MTI_GEMM_CANDIDATES, res, &got);
#undef LT_TRY
    if (r != CUBLAS_STATUS_SUCCESS && r != CUBLAS_STATUS_NOT_SUPPORTED) goto fail;
    s->api->MatmulPreferenceDestroy(pref);
    for (int i = 0; r == CUBLAS_STATUS_SUCCESS && i < got && i < MTI_GEMM_CANDIDATES && pick < 0;
         i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= MTI_GEMM_WORKSPACE)
            pick = i;
    if (pick < 0) {
        plan_drop(s, p);
        p->key = *key;
        p->used = 1;
        p->none = 1;
        return MT_OK;
    }
    p->algo = res[pick].algo;
    return MT_OK;
fail:
    if (pref) s->api->MatmulPreferenceDestroy(pref);
    plan_drop(s, p);
    return mti_fail(k->ctx, r == CUBLAS_STATUS_ALLOC_FAILED ? MT_ERR_OOM : MT_ERR_DEVICE,
                    "CUDA %s: %s failed: %s", what, call, lt_status_name(s->api, r));
}

/* Whether GEMMs can run on the device at all (cuBLASLt loaded, handle
 * made), checked before a backward changes anything. A plan or workspace
 * failing later (no algorithm for a shape, out of memory) can still leave
 * db and dx written: the trainer drops a failed step's gradients anyway. */
static mt_status gemm_ready(const mti_kctx *k)
{
    if (mti_dry(k)) return MT_OK;
    ops_state *s = state_of(k->dev);
    if (!s) return mti_fail(k->ctx, MT_ERR_OOM, "CUDA GEMM: out of host memory");
    mt_status st = mti_cuda_enter(k->dev);
    if (st != MT_OK) return st;
    pthread_mutex_lock(&s->mu);
    st = lt_handle(k, s);
    pthread_mutex_unlock(&s->mu);
    mti_cuda_leave(k->dev);
    return st;
}

/* The plan for `key`: cached, or made now (evicting round-robin when the
 * cache is full). Called with s->mu held and the context current. */
static mt_status plan_for(const mti_kctx *k, ops_state *s, const gemm_key *key, const void *bias,
                          const char *what, gemm_plan **out)
{
    for (int i = 0; i < MTI_GEMM_PLANS; i++)
        if (s->plans[i].used && memcmp(&s->plans[i].key, key, sizeof *key) == 0) {
            *out = &s->plans[i];
            return MT_OK;
        }
    int slot = -1;
    for (int i = 0; i < MTI_GEMM_PLANS && slot < 0; i++)
        if (!s->plans[i].used) slot = i;
    if (slot < 0) slot = (int)(s->next_evict++ % MTI_GEMM_PLANS);
    plan_drop(s, &s->plans[slot]);
    mt_status st = plan_make(k, s, &s->plans[slot], key, bias, what);
    if (st == MT_OK) *out = &s->plans[slot];
    return st;
}

/* D = op(A) . op(B) (+ bias) + beta * D, queued on the device's stream.
 * The bias (one per row of D, in D's type) goes through cuBLASLt's bias
 * epilogue; where cuBLASLt has no algorithm with it, D is first set to the
 * bias rows (mt_bias_rows) and the product added with beta 1, which rounds
 * once all the same. */
static mt_status gemm(const mti_kctx *k, gemm_key key, const void *A, const void *B, void *D,
                      const void *bias, float beta, const char *what)
{
    carver w = {0};
    mt_status st;
    if (mti_dry(k)) { /* an estimate: the workspace, and nothing runs */
        if ((st = mti_work_alloc(k, MTI_GEMM_WORKSPACE, &w.blk)) == MT_OK) mti_work_free(k, &w.blk);
        return st;
    }
    ops_state *s = state_of(k->dev);
    if (!s) return mti_fail(k->ctx, MT_ERR_OOM, "CUDA %s: out of host memory", what);
    key.align[0] = align_of(A);
    key.align[1] = align_of(B);
    key.align[2] = align_of(D);
    key.align[3] = bias ? align_of(bias) : 0;
    key.bias = bias != NULL;
    if ((st = mti_cuda_enter(k->dev)) != MT_OK) return st;
    pthread_mutex_lock(&s->mu);
    gemm_plan *p = NULL;
    if ((st = lt_handle(k, s)) != MT_OK) goto out;
    if ((st = plan_for(k, s, &key, bias, what, &p)) != MT_OK) goto out;
    if (p->none && bias) {
        /* no algorithm with the bias epilogue: bias rows, then beta 1 */
        key.bias = 0;
        key.align[3] = 0;
        if ((st = plan_for(k, s, &key, NULL, what, &p)) != MT_OK) goto out;
        if (!p->none) {
            int rows = key.n, cols = key.m; /* D is column-major (m,n): n rows of m */
            unsigned long long nn = (unsigned long long)rows * (unsigned long long)cols;
            void *args[] = {&D, &bias, &cols, &nn};
            if ((st = launch(k, MTI_CUDA_BIAS_ROWS_F32 + bias_dt(key.d_type), ew_grid(nn),
                             MTI_EW_THREADS, args)) != MT_OK)
                goto out;
            beta = 1.0f;
            bias = NULL;
        }
    }
    if (p->none) {
        st = mti_fail(k->ctx, MT_ERR_UNSUPPORTED,
                      "CUDA %s: cuBLASLt has no algorithm for m=%d n=%d k=%d (types %d,%d->%d, "
                      "alignments %d,%d,%d bytes)", what, key.m, key.n, key.k, key.a_type,
                      key.b_type, key.d_type, key.align[0], key.align[1], key.align[2]);
        goto out;
    }
    if (bias) {
        cublasStatus_t r = s->api->MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &bias, sizeof bias);
        if (r != CUBLAS_STATUS_SUCCESS) {
            st = mti_fail(k->ctx, MT_ERR_DEVICE, "CUDA %s: setting the bias pointer failed: %s",
                          what, lt_status_name(s->api, r));
            goto out;
        }
    }
    /* every GEMM takes the most workspace any algorithm may ask for, so
     * the memory a run takes does not depend on cuBLASLt's choice and an
     * estimate made without the GPU is exact (lib/engine/estimate.c) */
    if ((st = mti_work_alloc(k, MTI_GEMM_WORKSPACE, &w.blk)) != MT_OK) goto out;
    const float alpha = 1.0f;
    cublasStatus_t r = s->api->Matmul(s->lt, p->desc, &alpha, A, p->la, B, p->lb, &beta, D, p->ld,
                                      D, p->ld, &p->algo, w.blk.ptr, MTI_GEMM_WORKSPACE,
                                      mti_cuda_stream(k->dev));
    if (r != CUBLAS_STATUS_SUCCESS)
        st = mti_fail(k->ctx, r == CUBLAS_STATUS_ALLOC_FAILED ? MT_ERR_OOM : MT_ERR_DEVICE,
                      "CUDA %s: cublasLtMatmul (m=%d n=%d k=%d) failed: %s", what, key.m, key.n,
                      key.k, lt_status_name(s->api, r));
    else if (mti_cuda_debug_sync(k->dev) && (st = k->dev->sync(k->dev)) != MT_OK)
        st = op_failed(k, st); /* the sync's message names the GEMM's stream wait */
    /* the stream orders the GEMM before whatever next uses this memory */
    mti_work_free(k, &w.blk);
out:
    pthread_mutex_unlock(&s->mu);
    mti_cuda_leave(k->dev);
    return st;
}

/* Row-major y (N,O) = x (N,I) . W (O,I)^T + b is, column-major,
 * y^T (O,N) = W^T (O,I) . x^T (I,N): A = W stored (I,O) read transposed,
 * B = x stored (I,N), D = y (O,N); the bias (O) is one per row of D. */
static mt_status cu_matmul_fwd(const mti_kctx *k, void *y, const void *x, const void *w,
                               const void *b, int n, int in, int out, mti_dtype dt)
{
    OP_NOTE(k, "matmul_fwd n=%d in=%d out=%d %s", n, in, out, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "matmul_fwd", dt);
    if (n < 0 || in < 0 || out < 0) return bad_arg(k, "matmul_fwd", "negative size");
    if (n == 0 || out == 0) return MT_OK;
    if (in == 0) { /* no inputs: every row is the bias (or 0) */
        unsigned long long nn = (unsigned long long)n * (unsigned long long)out;
        if (!b) return k->dev->memset8(k->dev, y, 0, nn * mti_dtype_size(dt));
        void *args[] = {&y, &b, &out, &nn};
        return launch(k, MTI_CUDA_BIAS_ROWS_F32 + dt, ew_grid(nn), MTI_EW_THREADS, args);
    }
    int t = lt_type(dt);
    gemm_key key = {.ta = CUBLAS_OP_T, .tb = CUBLAS_OP_N, .m = out, .n = n, .k = in, .lda = in,
                    .ldb = in, .ldd = out, .a_type = t, .b_type = t, .d_type = t};
    return gemm(k, key, w, x, y, b, 0.0f, "matmul_fwd");
}

/* dx (N,I) = dy (N,O) . W (O,I): column-major dx^T (I,N) = W^T (I,O) . dy^T
 * (O,N), A = W stored (I,O), B = dy stored (O,N); beta 1 accumulates.
 * dW (O,I) += dy^T . x: column-major dW^T (I,O) = x^T (I,N) . dy (N,O),
 * A = x stored (I,N), B = dy stored (O,N) read transposed; D fp32, beta 1
 * (0 with MTI_BWD_SET_DW). db (O) += (=) column sums of dy (N,O). */
static mt_status cu_matmul_bwd(const mti_kctx *k, void *dx, float *dw, float *db, const void *dy,
                               const void *x, const void *w, int n, int in, int out, mti_dtype dt,
                               int flags)
{
    OP_NOTE(k, "matmul_bwd n=%d in=%d out=%d %s", n, in, out, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "matmul_bwd", dt);
    if (n < 0 || in < 0 || out < 0) return bad_arg(k, "matmul_bwd", "negative size");
    const int accumulate = flags & MTI_BWD_ACC_DX, set = (flags & MTI_BWD_SET_DW) != 0;
    mt_status st = MT_OK;
    if (n == 0 && set) { /* no rows: the weight's and bias's sums are zeros */
        if (dw && in > 0 && out > 0)
            st = k->dev->memset8(k->dev, dw, 0, (size_t)out * in * sizeof(float));
        if (st == MT_OK && db && out > 0)
            st = k->dev->memset8(k->dev, db, 0, (size_t)out * sizeof(float));
        return st;
    }
    if (n == 0 || (in == 0 && out == 0)) return MT_OK;
    if (in > 0 && out > 0 && (dx || dw) && (st = gemm_ready(k)) != MT_OK) return st;
    if (db && out > 0 && (st = colsum(k, db, dy, n, out, dt, set)) != MT_OK) return st;
    if (in == 0) return MT_OK; /* dx and dW are empty */
    if (out == 0) /* dx = dy . W over an empty sum: 0, or unchanged when accumulating */
        return dx && !accumulate
                   ? k->dev->memset8(k->dev, dx, 0, (size_t)n * in * mti_dtype_size(dt))
                   : MT_OK;
    int t = lt_type(dt);
    if (dx) {
        gemm_key key = {.ta = CUBLAS_OP_N, .tb = CUBLAS_OP_N, .m = in, .n = n, .k = out,
                        .lda = in, .ldb = out, .ldd = in, .a_type = t, .b_type = t, .d_type = t};
        st = gemm(k, key, w, dy, dx, NULL, accumulate ? 1.0f : 0.0f, "matmul_bwd dx");
        if (st != MT_OK) return st;
    }
    if (dw) {
        gemm_key key = {.ta = CUBLAS_OP_N, .tb = CUBLAS_OP_T, .m = in, .n = out, .k = n,
                        .lda = in, .ldb = out, .ldd = in, .a_type = t, .b_type = t,
                        .d_type = CUDA_R_32F};
        st = gemm(k, key, x, dy, dw, NULL, set ? 0.0f : 1.0f, "matmul_bwd dW");
    }
    return st;
}

/* Rows in multiples of 8, so a slice's pointers (dy at column o0 in a
 * 16-bit type, dW at row o0) are 16-byte aligned like whole tensors':
 * cuBLASLt's fast kernels need that, and it may have none for less (a
 * 1365-row slice of an fp16 table starts 2 bytes off). The rows' values do
 * not depend on the slicing; the CUDA table makes no bit-identity promise
 * between a sliced and a whole weight gradient all the same. */
#define MTI_DW_ROWS_ALIGN 8

static int cu_matmul_dw_align(int out, int in)
{
    (void)out, (void)in;
    return MTI_DW_ROWS_ALIGN;
}

/* Rows [o0, o1) of dW: as matmul_bwd's dW with B = the columns o0.. of dy
 * (ld out) and D = the slice. */
static mt_status cu_matmul_dw_rows(const mti_kctx *k, float *dw, const void *dy, const void *x,
                                   int n, int in, int out, int o0, int o1, mti_dtype dt,
                                   int flags)
{
    OP_NOTE(k, "matmul_dw_rows n=%d in=%d out=%d rows [%d,%d) %s", n, in, out, o0, o1,
            dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "matmul_dw_rows", dt);
    if (n < 0 || in < 0 || out < 0 || o0 < 0 || o1 < o0 || o1 > out ||
        o0 % MTI_DW_ROWS_ALIGN || (o1 % MTI_DW_ROWS_ALIGN && o1 != out))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "CUDA matmul_dw_rows: bad size (%d,%d,%d) or rows [%d,%d) (multiples "
                        "of %d, or to the end)", n, in, out, o0, o1, MTI_DW_ROWS_ALIGN);
    const int set = (flags & MTI_BWD_SET_DW) != 0;
    if (n == 0 && set && in > 0 && o1 > o0) /* no rows: the sums are zeros */
        return k->dev->memset8(k->dev, dw, 0, (size_t)(o1 - o0) * in * sizeof(float));
    if (n == 0 || in == 0 || o0 == o1) return MT_OK;
    mt_status st = gemm_ready(k);
    if (st != MT_OK) return st;
    int t = lt_type(dt);
    gemm_key key = {.ta = CUBLAS_OP_N, .tb = CUBLAS_OP_T, .m = in, .n = o1 - o0, .k = n,
                    .lda = in, .ldb = out, .ldd = in, .a_type = t, .b_type = t,
                    .d_type = CUDA_R_32F};
    const void *dy0 = (const char *)dy + (size_t)o0 * mti_dtype_size(dt);
    return gemm(k, key, x, dy0, dw, NULL, set ? 0.0f : 1.0f, "matmul_dw_rows");
}

/* ---- a quantized frozen weight (lib/quant/quant.h): dequantized a tile at a time ---- */

/* The most elements of a weight dequantized at once: the tile buffer is
 * this many values of the compute dtype in WORK (8 MiB in fp32, 4 MiB in
 * bf16), whatever the weight's size. Tiles are whole rows (forward) or
 * whole columns (input gradient) in multiples of MTI_DQ_ALIGN, so every
 * tile's GEMM operands start 16-byte aligned. */
#define MTI_DQ_TILE (1u << 21)
#define MTI_DQ_ALIGN 8
#define MTI_DQ_THREADS 256u /* threads per block, dequant.cu */

mt_status mti_cuda_dequantize(const mti_kctx *k, mti_qformat qf, const void *wq, size_t R,
                              size_t I, size_t r0, size_t rows, size_t c0, size_t cols, void *out,
                              size_t ld, mti_dtype dt)
{
    OP_NOTE(k, "dequantize %s %zu x %zu, rows [%zu,%zu) columns [%zu,%zu) %s",
            mti_quant_name(qf) ? mti_quant_name(qf) : "?", R, I, r0, r0 + rows, c0, c0 + cols,
            dt_name(dt));
    mti_qparts p;
    if (!mti_quant_name(qf) || (I && R > SIZE_MAX / I))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "CUDA dequantize: format %d (need int8 or nf4) or size %zu x %zu", qf, R,
                        I);
    if (!dt_ok(dt)) return bad_dt(k, "dequantize", dt);
    if (r0 > R || rows > R - r0 || c0 > I || cols > I - c0 || ld < cols || rows > UINT_MAX ||
        cols > UINT_MAX)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "CUDA dequantize: rows [%zu,%zu) x columns [%zu,%zu) (leading dimension "
                        "%zu) outside a %zu x %zu weight",
                        r0, r0 + rows, c0, c0 + cols, ld, R, I);
    if (rows == 0 || cols == 0) return MT_OK;
    if (!wq || !out) return bad_arg(k, "dequantize", "NULL weight or output");
    mti_quant_parts(qf, R * I, &p);
    const uint8_t *q = wq;
    mti_dim3 grid = {(unsigned)cdiv(cols, MTI_DQ_THREADS),
                     (unsigned)(rows < MTI_GRID_Y_MAX ? rows : MTI_GRID_Y_MAX), 1};
    int idt = (int)dt;
    unsigned long long LD = ld, II = I, R0 = r0, C0 = c0;
    unsigned nr = (unsigned)rows, nc = (unsigned)cols;
    if (qf == MTI_QF_INT8) {
        const void *codes = q + p.codes, *scale = q + p.scale;
        void *args[] = {&out, &idt, &LD, &codes, &scale, &II, &R0, &nr, &C0, &nc};
        return launch(k, MTI_CUDA_DEQUANT_INT8, grid, MTI_DQ_THREADS, args);
    }
    mt_dq_maps maps;
    memcpy(maps.q8, mti_q8_map(1), sizeof maps.q8);
    memcpy(maps.nf4, mti_nf4_code(), sizeof maps.nf4);
    const void *codes = q + p.codes, *qabsmax = q + p.qabsmax, *absmax2 = q + p.absmax2,
               *offset = q + p.offset;
    void *args[] = {&out,     &idt, &LD, &codes, &qabsmax, &absmax2, &offset,
                    &II,      &R0,  &nr, &C0,    &nc,      &maps};
    return launch(k, MTI_CUDA_DEQUANT_NF4, grid, MTI_DQ_THREADS, args);
}

/* embedding_fwd from a quantized table (V,C): dequant.cu's lookup, each
 * element dequantized as mti_dequantize makes it in dt, then the sum with
 * wpe as embedding_fwd's. */
static mt_status cu_embedding_fwd_q(const mti_kctx *k, void *out, const int32_t *tok,
                                    const void *wq, mti_qformat qf, int V, const void *wpe, int B,
                                    int T, int C, mti_dtype dt)
{
    OP_NOTE(k, "embedding_fwd_q B=%d T=%d C=%d V=%d format %d %s%s", B, T, C, V, qf, dt_name(dt),
            wpe ? "" : " (no positions)");
    mt_status st = mti_quant_emb_check(k->ctx, "CUDA embedding_fwd_q", wq, qf, V, B, T, C, dt);
    if (st) return st;
    if (B == 0 || T == 0 || C == 0) return MT_OK;
    mti_qparts p;
    mti_quant_parts(qf, (size_t)V * (size_t)C, &p);
    const uint8_t *q = wq;
    int idt = (int)dt;
    unsigned long long n = (unsigned long long)B * T * C;
    const void *codes = q + p.codes;
    if (qf == MTI_QF_INT8) {
        const void *scale = q + p.scale;
        void *args[] = {&out, &idt, &tok, &codes, &scale, &wpe, &T, &C, &n};
        return launch(k, MTI_CUDA_EMB_FWD_Q_INT8, ew_grid(n), MTI_DQ_THREADS, args);
    }
    mt_dq_maps maps;
    memcpy(maps.q8, mti_q8_map(1), sizeof maps.q8);
    memcpy(maps.nf4, mti_nf4_code(), sizeof maps.nf4);
    const void *qabsmax = q + p.qabsmax, *absmax2 = q + p.absmax2, *offset = q + p.offset;
    void *args[] = {&out, &idt, &tok, &codes, &qabsmax, &absmax2, &offset, &wpe, &T, &C, &n, &maps};
    return launch(k, MTI_CUDA_EMB_FWD_Q_NF4, ew_grid(n), MTI_DQ_THREADS, args);
}

/* dequantize: the range as columns [at, at + len) of a (1, n) weight. */
static mt_status cu_dequantize(const mti_kctx *k, void *out, const void *wq, mti_qformat qf,
                               size_t n, size_t at, size_t len, mti_dtype dt)
{
    if (dt != MTI_F32 && dt != MTI_BF16) /* (the tile kernels take fp16 too; the op does not) */
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "CUDA dequantize: output dtype %s is not fp32 or bf16", dt_name(dt));
    return mti_cuda_dequantize(k, qf, wq, 1, n, 0, 1, at, len, out, len, dt);
}

/* ---- a pruned tensor (lib/sparse/sparse.h; kernels/cuda/sparse.cu) ---- */

/* sparse.cu's mt_sp_desc, as its kernels take it by value. */
typedef struct sp_desc {
    int fmt, n, m, bits;
    unsigned long long pre, dense, at, len;
} sp_desc;

static mt_status sp_launch(const mti_kctx *k, const char *op, int id, void *out, const void *in,
                           const void *meta, const mti_sp_layout *L, size_t at, size_t len,
                           mti_dtype dt, int add)
{
    OP_NOTE(k, "%s %zu of %zu from %zu %s%s", op, len, L->dense, at, dt_name(dt), add ? " add" : "");
    if (!dt_ok(dt)) return bad_dt(k, op, dt);
    if (at > L->dense || len > L->dense - at || (L->fmt != MTI_SP_BITMAP && L->fmt != MTI_SP_NM))
        return bad_arg(k, op, "a range outside the tensor, or an unknown format");
    if (add && dt != MTI_F32) return bad_arg(k, op, "adds in fp32 only");
    if (len == 0) return MT_OK;
    sp_desc d = {(int)L->fmt, L->n, L->m, L->bits, L->pre, L->dense, at, len};
    int es = (int)mti_dtype_size(dt);
    void *args[] = {&out, (void *)&in, (void *)&meta, &d, &es, &add}; /* (expand: no add) */
    return launch(k, id, ew_grid(len), MTI_EW_THREADS, args);
}

static mt_status cu_sparse_expand(const mti_kctx *k, void *dense, const void *vals,
                                  const void *meta, const mti_sp_layout *L, size_t at, size_t len,
                                  mti_dtype dt)
{
    return sp_launch(k, "sparse_expand", MTI_CUDA_SP_EXPAND, dense, vals, meta, L, at, len, dt, 0);
}

static mt_status cu_sparse_compress(const mti_kctx *k, void *vals, const void *dense,
                                    const void *meta, const mti_sp_layout *L, size_t at, size_t len,
                                    mti_dtype dt, int add)
{
    return sp_launch(k, "sparse_compress", MTI_CUDA_SP_COMPRESS, vals, dense, meta, L, at, len, dt,
                     add);
}

/* No sparse GEMMs on CUDA: a pruned W's GEMMs run on its dense tile
   (cuSPARSELt's 2:4 would go here). */
static int cu_sparse_matmul_choice(const mti_kctx *k, const mti_sp_layout *L, int n, int in,
                                   int out, mti_dtype dt)
{
    (void)k, (void)L, (void)n, (void)in, (void)out, (void)dt;
    return MTI_SPMM_NONE;
}

static mt_status cu_sparse_matmul_fwd(const mti_kctx *k, void *y, const void *x, const void *vals,
                                      const void *meta, const mti_sp_layout *L, const void *b,
                                      int n, int in, int out, mti_dtype dt)
{
    (void)y, (void)x, (void)vals, (void)meta, (void)L, (void)b, (void)n, (void)in, (void)out,
        (void)dt;
    return mti_fail(k->ctx, MT_ERR_UNSUPPORTED,
                    "sparse_matmul_fwd: no sparse GEMM on CUDA (the dense tile is used)");
}

static mt_status cu_sparse_matmul_bwd(const mti_kctx *k, void *dx, float *dw, float *db,
                                      const void *dy, const void *x, const void *vals,
                                      const void *meta, const mti_sp_layout *L, int n, int in,
                                      int out, mti_dtype dt, int flags)
{
    (void)dx, (void)dw, (void)db, (void)dy, (void)x, (void)vals, (void)meta, (void)L, (void)n,
        (void)in, (void)out, (void)dt, (void)flags;
    return mti_fail(k->ctx, MT_ERR_UNSUPPORTED,
                    "sparse_matmul_bwd: no sparse GEMM on CUDA (the dense tile is used)");
}

/* The checks of the CPU table's quantized matmuls, in its order. */
/* Tile width (rows or columns) of a tile of `len` elements per row or
 * column, and the WORK the tile buffer takes. */
static int dq_tile(size_t len, int total)
{
    size_t w = MTI_DQ_TILE / (len ? len : 1);
    w = w / MTI_DQ_ALIGN * MTI_DQ_ALIGN;
    if (w < MTI_DQ_ALIGN) w = MTI_DQ_ALIGN;
    return w < (size_t)total ? (int)w : total;
}

/* y (N,O) = x (N,I) . deq(W)^T + b, O rows of W at a time: each tile of
 * rows [o0, o0 + t) dequantized into WORK, then matmul_fwd's GEMM on it
 * for columns [o0, o0 + t) of y (ldd O). One tile takes the bias in the
 * GEMM, as matmul_fwd; several add their products to y set to the bias
 * rows (rounded once all the same: the bias is exact in fp32). */
static mt_status cu_matmul_fwd_q(const mti_kctx *k, void *y, const void *x, const void *wq,
                                 mti_qformat qf, const void *b, int n, int in, int out, mti_dtype dt)
{
    OP_NOTE(k, "matmul_fwd_q n=%d in=%d out=%d format %d %s", n, in, out, qf, dt_name(dt));
    mt_status st = mti_quant_mm_check(k->ctx, "CUDA matmul_fwd_q", wq, qf, n, in, out, dt);
    if (st || n == 0 || out == 0) return st;
    if (in == 0) return cu_matmul_fwd(k, y, x, NULL, b, n, in, out, dt); /* the bias rows */
    const int tile = dq_tile((size_t)in, out);
    const size_t es = mti_dtype_size(dt);
    mt_block w;
    if ((st = mti_work_alloc(k, (size_t)tile * (size_t)in * es, &w)) != MT_OK) return st;
    const int t = lt_type(dt);
    const void *bias = b;
    if (b && tile < out) { /* y set to the bias rows first, each tile's product added once */
        unsigned long long nn = (unsigned long long)n * (unsigned long long)out;
        void *args[] = {&y, &b, &out, &nn};
        st = launch(k, MTI_CUDA_BIAS_ROWS_F32 + dt, ew_grid(nn), MTI_EW_THREADS, args);
        bias = NULL;
    }
    for (int o0 = 0; o0 < out && st == MT_OK; o0 += tile) {
        const int rows = out - o0 < tile ? out - o0 : tile;
        st = mti_cuda_dequantize(k, qf, wq, (size_t)out, (size_t)in, (size_t)o0, (size_t)rows, 0,
                                 (size_t)in, w.ptr, (size_t)in, dt);
        gemm_key key = {.ta = CUBLAS_OP_T, .tb = CUBLAS_OP_N, .m = rows, .n = n, .k = in,
                        .lda = in, .ldb = in, .ldd = out, .a_type = t, .b_type = t, .d_type = t};
        if (st == MT_OK)
            st = gemm(k, key, w.ptr, x, (char *)y + (size_t)o0 * es, bias, b && !bias ? 1.0f : 0.0f,
                      "matmul_fwd_q");
    }
    mti_work_free(k, &w);
    return st;
}

/* dx (N,I) = (or +=) dy (N,O) . deq(W), I columns of W at a time: each
 * tile of columns [i0, i0 + t) (all O rows, leading dimension t)
 * dequantized into WORK, then matmul_bwd's dx GEMM on it for columns
 * [i0, i0 + t) of dx (ldd I). The whole inner dimension O is in every
 * GEMM, so each output is rounded once, as in matmul_bwd. */
static mt_status cu_matmul_dx_q(const mti_kctx *k, void *dx, const void *dy, const void *wq,
                                mti_qformat qf, int n, int in, int out, mti_dtype dt, int accumulate)
{
    OP_NOTE(k, "matmul_dx_q n=%d in=%d out=%d format %d %s", n, in, out, qf, dt_name(dt));
    mt_status st = mti_quant_mm_check(k->ctx, "CUDA matmul_dx_q", wq, qf, n, in, out, dt);
    if (st || n == 0 || in == 0) return st;
    const size_t es = mti_dtype_size(dt);
    if (out == 0) /* an empty sum: 0, or dx unchanged when accumulating */
        return accumulate ? MT_OK : k->dev->memset8(k->dev, dx, 0, (size_t)n * in * es);
    if ((st = gemm_ready(k)) != MT_OK) return st;
    const int tile = dq_tile((size_t)out, in);
    mt_block w;
    if ((st = mti_work_alloc(k, (size_t)tile * (size_t)out * es, &w)) != MT_OK) return st;
    const int t = lt_type(dt);
    for (int i0 = 0; i0 < in && st == MT_OK; i0 += tile) {
        const int cols = in - i0 < tile ? in - i0 : tile;
        st = mti_cuda_dequantize(k, qf, wq, (size_t)out, (size_t)in, 0, (size_t)out, (size_t)i0,
                                 (size_t)cols, w.ptr, (size_t)cols, dt);
        gemm_key key = {.ta = CUBLAS_OP_N, .tb = CUBLAS_OP_N, .m = cols, .n = n, .k = out,
                        .lda = cols, .ldb = out, .ldd = in, .a_type = t, .b_type = t,
                        .d_type = t};
        if (st == MT_OK)
            st = gemm(k, key, w.ptr, dy, (char *)dx + (size_t)i0 * es, NULL,
                      accumulate ? 1.0f : 0.0f, "matmul_dx_q");
    }
    mti_work_free(k, &w);
    return st;
}

/* ---- layernorm ---- */

/* dw, db (C) += sums over rows of dout * xhat and dout, in chunks of rows
 * (layernorm.cu), then the chunks in order. */
static mt_status ln_param_grads(const mti_kctx *k, float *dw, float *db, const void *dout,
                                const void *x, const float *mean, const float *rstd, int n, int c,
                                mti_dtype dt, int set)
{
    if (!dw && !db) return MT_OK;
    mt_status st;
    int chunk = MTI_COLSUM_CHUNK;
    if (cdiv((size_t)n, (size_t)chunk) > MTI_GRID_Y_MAX)
        chunk = (int)cdiv((size_t)n, MTI_GRID_Y_MAX);
    int nchunks = (int)cdiv((size_t)n, (size_t)chunk);
    carver wk = {0};
    float *pw = NULL, *pb = NULL;
    if (nchunks > 1) {
        size_t one = (size_t)nchunks * (size_t)c * sizeof(float);
        if ((st = mti_work_alloc(k, 2 * mti_align_up(one, 256), &wk.blk))) return st;
        pw = carve(&wk, one);
        pb = carve(&wk, one);
    }
    mti_dim3 grid = {(unsigned)cdiv((size_t)c, 256), (unsigned)nchunks, 1};
    void *args[] = {&dw, &db, &pw, &pb, &dout, &x, &mean, &rstd, &n, &c, &chunk, &set};
    st = launch(k, MTI_CUDA_LN_BWD_DWDB_F32 + dt, grid, 256, args);
    long long cols = c;
    for (int i = 0; i < 2 && st == MT_OK && pw; i++) {
        float *o = i ? db : dw;
        const float *part = i ? pb : pw;
        if (!o) continue;
        void *a2[] = {&o, &part, &nchunks, &cols, &set};
        st = launch(k, MTI_CUDA_COLSUM_FINISH, (mti_dim3){grid.x, 1, 1}, 256, a2);
    }
    mti_work_free(k, &wk.blk);
    return st;
}

static mt_status cu_layernorm_fwd(const mti_kctx *k, void *out, float *mean, float *rstd,
                                  const void *x, const void *w, const void *b, int n, int c,
                                  mti_dtype dt)
{
    OP_NOTE(k, "layernorm_fwd n=%d c=%d %s", n, c, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "layernorm_fwd", dt);
    if (n <= 0 || c <= 0) return MT_OK;
    void *args[] = {&out, &mean, &rstd, &x, &w, &b, &n, &c};
    mti_dim3 grid = {(unsigned)cdiv((size_t)n, MTI_LN_ROWS), 1, 1};
    return launch(k, MTI_CUDA_LN_FWD_F32 + dt, grid, 256, args);
}

static mt_status cu_layernorm_bwd(const mti_kctx *k, void *dx, float *dw, float *db,
                                  const void *dout, const void *x, const void *w,
                                  const float *mean, const float *rstd, int n, int c,
                                  mti_dtype dt, int flags)
{
    OP_NOTE(k, "layernorm_bwd n=%d c=%d %s", n, c, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "layernorm_bwd", dt);
    if (!mean || !rstd) return bad_arg(k, "layernorm_bwd", "the saved mean and rstd are needed");
    int accumulate = flags & MTI_BWD_ACC_DX;
    const int set = (flags & MTI_BWD_SET_DW) != 0;
    mt_status st = MT_OK;
    if (n <= 0 && c > 0 && set) { /* no rows: the sums are zeros */
        if (dw) st = k->dev->memset8(k->dev, dw, 0, (size_t)c * sizeof(float));
        if (st == MT_OK && db) st = k->dev->memset8(k->dev, db, 0, (size_t)c * sizeof(float));
    }
    if (st != MT_OK || n <= 0 || c <= 0) return st;
    /* the parameter gradients first, so dx may overwrite dout */
    st = ln_param_grads(k, dw, db, dout, x, mean, rstd, n, c, dt, set);
    if (st != MT_OK || !dx) return st;
    void *args[] = {&dx, &dout, &x, &w, &mean, &rstd, &n, &c, &accumulate};
    mti_dim3 grid = {(unsigned)cdiv((size_t)n, MTI_LN_ROWS), 1, 1};
    return launch(k, MTI_CUDA_LN_BWD_DX_F32 + dt, grid, 256, args);
}

/* ---- activations and residual ---- */

static mt_status ew2(const mti_kctx *k, const char *op, int id0, void *y, const void *x, size_t n,
                     mti_dtype dt)
{
    OP_NOTE(k, "%s n=%zu %s", op, n, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, op, dt);
    if (n == 0) return MT_OK;
    unsigned long long nn = n;
    void *args[] = {&y, &x, &nn};
    return launch(k, id0 + dt, ew_grid(n), MTI_EW_THREADS, args);
}

static mt_status ew3(const mti_kctx *k, const char *op, int id0, void *y, const void *a,
                     const void *b, size_t n, mti_dtype dt)
{
    OP_NOTE(k, "%s n=%zu %s", op, n, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, op, dt);
    if (n == 0) return MT_OK;
    unsigned long long nn = n;
    void *args[] = {&y, &a, &b, &nn};
    return launch(k, id0 + dt, ew_grid(n), MTI_EW_THREADS, args);
}

static mt_status cu_gelu_fwd(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt)
{
    return ew2(k, "gelu_fwd", MTI_CUDA_GELU_FWD_F32, y, x, n, dt);
}

static mt_status cu_gelu_bwd(const mti_kctx *k, void *dx, const void *dy, const void *x, size_t n,
                             mti_dtype dt)
{
    return ew3(k, "gelu_bwd", MTI_CUDA_GELU_BWD_F32, dx, dy, x, n, dt);
}

static mt_status cu_relu_fwd(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt)
{
    return ew2(k, "relu_fwd", MTI_CUDA_RELU_FWD_F32, y, x, n, dt);
}

static mt_status cu_relu_bwd(const mti_kctx *k, void *dx, const void *dy, const void *y, size_t n,
                             mti_dtype dt)
{
    return ew3(k, "relu_bwd", MTI_CUDA_RELU_BWD_F32, dx, dy, y, n, dt);
}

static mt_status cu_add(const mti_kctx *k, void *y, const void *a, const void *b, size_t n,
                        mti_dtype dt)
{
    return ew3(k, "add", MTI_CUDA_ADD_F32, y, a, b, n, dt);
}

static mt_status cu_accumulate(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt)
{
    return ew2(k, "accumulate", MTI_CUDA_ACCUMULATE_F32, y, x, n, dt);
}

/* ---- attention ---- */

/* The head-size class of attention.cu: 0..3 for heads up to 32, 64, 128,
 * 256 dimensions; -1 past that. *rows = queries (or keys) per block. */
static int attn_class(int hs, unsigned *rows)
{
    static const int max_hs[4] = {32, 64, 128, 256};
    for (int i = 0; i < 4; i++)
        if (hs <= max_hs[i]) {
            *rows = MTI_ATTN_THREADS / (unsigned)(max_hs[i] / 16); /* 256 / G */
            return i;
        }
    return -1;
}

static mt_status attn_check(const mti_kctx *k, const char *op, int B, int T, int C, int H,
                            mti_dtype dt, int *cls, unsigned *rows)
{
    if (!dt_ok(dt)) return bad_dt(k, op, dt);
    if (B < 0 || T < 0 || C < 0 || H <= 0 || C % H)
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "CUDA %s: bad shape B=%d T=%d C=%d H=%d (C must be a multiple of H)", op,
                        B, T, C, H);
    if (C == 0) return MT_OK; /* nothing to do; the callers see B, T or C zero */
    *cls = attn_class(C / H, rows);
    if (*cls < 0)
        return mti_fail(k->ctx, MT_ERR_UNSUPPORTED,
                        "CUDA %s: head size %d is over 256, the most the CUDA kernels take", op,
                        C / H);
    if ((size_t)B * H > 0x7FFFFFFFu || cdiv((size_t)T, *rows) > MTI_GRID_Y_MAX)
        return mti_fail(k->ctx, MT_ERR_UNSUPPORTED, "CUDA %s: B*H=%lld or T=%d too large", op,
                        (long long)B * H, T);
    return MT_OK;
}

/* Whether attention_tc.cu's tensor-core kernels take this call: fp16 or
 * bf16, heads of 64, every operand on a 4-byte boundary (their loads are
 * of two elements), and MT_CUDA_ATTN_SIMT unset or "0" (set, it keeps
 * attention.cu's kernels, to compare the two). Returns the kernel id's
 * offset from the fp16 one (0 or 1), or -1. */
static int attn_tc(mti_dtype dt, int hs, int T, const void *a, const void *b, const void *c,
                   const void *d)
{
    if ((dt != MTI_F16 && dt != MTI_BF16) || hs != MTI_ATTN_TC_HS) return -1;
    if ((((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d) & 3u) != 0) return -1;
    if (cdiv((size_t)T, MTI_ATTN_TC_ROWS) > MTI_GRID_Y_MAX) return -1;
    const char *e = getenv("MT_CUDA_ATTN_SIMT");
    if (e && *e && strcmp(e, "0") != 0) return -1;
    return dt == MTI_F16 ? 0 : 1;
}

static mt_status cu_attention_fwd(const mti_kctx *k, void *out, float *lse, const void *qkv,
                                  int B, int T, int C, int H, mti_dtype dt)
{
    OP_NOTE(k, "attention_fwd B=%d T=%d C=%d H=%d %s", B, T, C, H, dt_name(dt));
    int cls;
    unsigned rows;
    mt_status st = attn_check(k, "attention_fwd", B, T, C, H, dt, &cls, &rows);
    if (st != MT_OK || B == 0 || T == 0 || C == 0) return st;
    int hs = C / H;
    float scale = 1.0f / sqrtf((float)hs);
    int tc = attn_tc(dt, hs, T, out, qkv, NULL, NULL);
    if (tc >= 0) {
        mti_dim3 g = {(unsigned)(B * H), (unsigned)cdiv((size_t)T, MTI_ATTN_TC_ROWS), 1};
        void *a[] = {&out, &lse, &qkv, &T, &C, &H, &scale};
        return launch(k, MTI_CUDA_ATTN_TC_FWD_F16 + tc, g, MTI_ATTN_TC_THREADS, a);
    }
    mti_dim3 grid = {(unsigned)(B * H), (unsigned)cdiv((size_t)T, rows), 1};
    void *args[] = {&out, &lse, &qkv, &T, &C, &H, &hs, &scale};
    return launch(k, MTI_CUDA_ATTN_FWD_32_F32 + 3 * cls + dt, grid, MTI_ATTN_THREADS, args);
}

/* The query-side kernel writes dq and the row terms D (B,H,T) to workspace;
 * the key-side kernel, queued after it, writes dk and dv. */
static mt_status cu_attention_bwd(const mti_kctx *k, void *dqkv, const void *dout,
                                  const void *qkv, const void *out, const float *lse, int B,
                                  int T, int C, int H, mti_dtype dt)
{
    OP_NOTE(k, "attention_bwd B=%d T=%d C=%d H=%d %s", B, T, C, H, dt_name(dt));
    int cls;
    unsigned rows;
    mt_status st = attn_check(k, "attention_bwd", B, T, C, H, dt, &cls, &rows);
    if (st != MT_OK || B == 0 || T == 0 || C == 0) return st;
    int hs = C / H;
    float scale = 1.0f / sqrtf((float)hs);
    mt_block wk = {0};
    if ((st = mti_work_alloc(k, (size_t)B * H * T * sizeof(float), &wk))) return st;
    float *Drow = wk.ptr;
    int tc = attn_tc(dt, hs, T, dqkv, dout, qkv, out);
    if (tc >= 0) {
        mti_dim3 g = {(unsigned)(B * H), (unsigned)cdiv((size_t)T, MTI_ATTN_TC_ROWS), 1};
        void *aq[] = {&dqkv, &Drow, &dout, &qkv, &out, &lse, &T, &C, &H, &scale};
        st = launch(k, MTI_CUDA_ATTN_TC_BWD_Q_F16 + tc, g, MTI_ATTN_TC_THREADS, aq);
        if (st == MT_OK) {
            const float *cD = Drow;
            void *akv[] = {&dqkv, &dout, &qkv, &lse, &cD, &T, &C, &H, &scale};
            st = launch(k, MTI_CUDA_ATTN_TC_BWD_KV_F16 + tc, g, MTI_ATTN_TC_THREADS, akv);
        }
        mti_work_free(k, &wk);
        return st;
    }
    mti_dim3 grid = {(unsigned)(B * H), (unsigned)cdiv((size_t)T, rows), 1};
    void *aq[] = {&dqkv, &Drow, &dout, &qkv, &out, &lse, &T, &C, &H, &hs, &scale};
    st = launch(k, MTI_CUDA_ATTN_BWD_Q_32_F32 + 3 * cls + dt, grid, MTI_ATTN_THREADS, aq);
    if (st == MT_OK) {
        const float *cD = Drow;
        void *akv[] = {&dqkv, &dout, &qkv, &lse, &cD, &T, &C, &H, &hs, &scale};
        st = launch(k, MTI_CUDA_ATTN_BWD_KV_32_F32 + 3 * cls + dt, grid, MTI_ATTN_THREADS, akv);
    }
    mti_work_free(k, &wk);
    return st;
}

/* ---- cross-entropy ---- */

static mt_status cu_xent(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                         const int32_t *targets, int n, int V, int Vp, float dloss, mti_dtype dt)
{
    OP_NOTE(k, "xent n=%d V=%d Vp=%d %s", n, V, Vp, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "xent", dt);
    if (V <= 0 || Vp < V) return bad_arg(k, "xent", "bad size (need 0 < V <= Vp)");
    if (n <= 0) return MT_OK;
    void *args[] = {&losses, &dlogits, &logits, &targets, &V, &Vp, &dloss};
    return launch(k, MTI_CUDA_XENT_F32 + dt, (mti_dim3){(unsigned)n, 1, 1}, MTI_XENT_THREADS, args);
}

static mt_status cu_xent_vp(const mti_kctx *k, int phase, float *stats, float *losses,
                            void *dlogits, const void *logits, const int32_t *targets, int n,
                            int v0, int Vr, int W, float dloss, mti_dtype dt)
{
    OP_NOTE(k, "xent_vp phase %d n=%d v0=%d Vr=%d W=%d %s", phase, n, v0, Vr, W, dt_name(dt));
    if (!dt_ok(dt)) return bad_dt(k, "xent_vp", dt);
    if (phase < 0 || phase > 2 || Vr < 0 || W < Vr || v0 < 0)
        return bad_arg(k, "xent_vp", "bad phase or size (need 0 <= Vr <= W)");
    if (n <= 0) return MT_OK;
    void *args[] = {&phase, &stats, &losses, &dlogits, &logits, &targets, &n, &v0, &Vr, &W, &dloss};
    return launch(k, MTI_CUDA_XENT_VP_F32 + dt, (mti_dim3){(unsigned)n, 1, 1}, MTI_XENT_THREADS,
                  args);
}

/* Distillation (xent.cu's mt_xent_kd): the CPU table's checks in its
 * order (alpha and T first, so an estimate refuses what a run refuses),
 * alpha 0 as xent itself, then one block per row. */
static mt_status cu_xent_kd(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                            const float *tlogits, const int32_t *targets, int n, int V, int Vp,
                            int tVp, float alpha, float temp, float dloss, mti_dtype dt)
{
    OP_NOTE(k, "xent_kd n=%d V=%d Vp=%d tVp=%d alpha=%g T=%g %s", n, V, Vp, tVp, (double)alpha,
            (double)temp, dt_name(dt));
    if (!(alpha >= 0.0f && alpha <= 1.0f) || !(temp > 0.0f) || !isfinite(temp))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "CUDA xent_kd: alpha %g (need [0, 1]) and temperature %g (need > 0)",
                        (double)alpha, (double)temp);
    if (alpha == 0.0f) /* plain cross-entropy, bit for bit */
        return cu_xent(k, losses, dlogits, logits, targets, n, V, Vp, dloss, dt);
    if (!dt_ok(dt)) return bad_dt(k, "xent_kd", dt);
    if (V <= 0 || Vp < V || tVp < V)
        return bad_arg(k, "xent_kd", "bad size (need 0 < V <= Vp and V <= the teacher's tVp)");
    if (n <= 0) return MT_OK;
    void *args[] = {&losses, &dlogits, &logits, &tlogits, &targets, &V, &Vp, &tVp,
                    &alpha, &temp, &dloss};
    return launch(k, MTI_CUDA_XENT_KD_F32 + dt, (mti_dim3){(unsigned)n, 1, 1}, MTI_XENT_THREADS,
                  args);
}

/* ---- mixed precision ---- */

static mt_status cu_unscale_check(const mti_kctx *k, float *g, size_t n, float inv_scale,
                                  int *found_inf)
{
    OP_NOTE(k, "unscale_check n=%zu", n);
    if (n == 0) return MT_OK;
    unsigned long long nn = n;
    void *args[] = {&g, &nn, &inv_scale, &found_inf};
    return launch(k, MTI_CUDA_UNSCALE_CHECK, ew_grid(n), MTI_EW_THREADS, args);
}

/* Block sums, then rounds of block sums, then the rounds in order: the
 * CPU table's order (reduce.cu). */
static mt_status cu_sumsq(const mti_kctx *k, float *sumsq, const float *g, size_t n)
{
    OP_NOTE(k, "sumsq n=%zu", n);
    if (n == 0) return MT_OK; /* nothing to add */
    size_t nblocks = cdiv(n, MTI_SUMSQ_BLOCK), nrounds = cdiv(nblocks, MTI_SUMSQ_ROUND_BLOCKS);
    if (cdiv(nblocks, 16) > 0x7FFFFFFFu) return bad_arg(k, "sumsq", "too many elements");
    carver w = {0};
    mt_status st = mti_work_alloc(
        k, mti_align_up(nblocks * sizeof(float), 256) + nrounds * sizeof(float), &w.blk);
    if (st != MT_OK) return st;
    float *bsum = carve(&w, nblocks * sizeof(float)), *rsum = carve(&w, nrounds * sizeof(float));
    unsigned long long nn = n, nb = nblocks, nr = nrounds;
    void *a1[] = {&bsum, &g, &nn};
    st = launch(k, MTI_CUDA_SUMSQ_BLOCKS, (mti_dim3){(unsigned)cdiv(nblocks, 16), 1, 1}, 256, a1);
    if (st == MT_OK) {
        const float *cb = bsum;
        void *a2[] = {&rsum, &sumsq, &cb, &nb};
        st = launch(k, MTI_CUDA_SUMSQ_ROUNDS, (mti_dim3){(unsigned)nrounds, 1, 1},
                    MTI_SUMSQ_ROUND_BLOCKS, a2);
    }
    if (st == MT_OK && nrounds > 1) {
        const float *cr = rsum;
        void *a3[] = {&sumsq, &cr, &nr};
        st = launch(k, MTI_CUDA_SUMSQ_TOTAL, (mti_dim3){1, 1, 1}, 32, a3);
    }
    mti_work_free(k, &w.blk);
    return st;
}

/* ---- optimizers ---- */

static mt_status cu_sgd(const mti_kctx *k, float *p, const float *g, float *m, void *pc,
                        mti_dtype pc_dt, size_t n, const mti_sgd_args *a)
{
    OP_NOTE(k, "sgd n=%zu", n);
    if (!a) return bad_arg(k, "sgd", "no arguments");
    if (pc && !dt_ok(pc_dt)) return bad_dt(k, "sgd", pc_dt);
    if (a->momentum != 0.0f && !m) return bad_arg(k, "sgd", "momentum needs a momentum buffer");
    if (n == 0) return MT_OK;
    unsigned long long nn = n;
    float *mm = a->momentum != 0.0f ? m : NULL; /* no momentum: the buffer is not touched */
    int pdt = (int)pc_dt, nesterov = a->nesterov, first = a->first_step;
    float lr = a->lr, mom = a->momentum, damp1 = 1.0f - a->dampening, wd = a->weight_decay,
          gs = a->grad_scale;
    void *args[] = {&p, &g, &mm, &pc, &pdt, &nn, &lr, &mom, &damp1, &wd, &nesterov, &first, &gs};
    return launch(k, MTI_CUDA_SGD, ew_grid(n), MTI_EW_THREADS, args);
}

static mt_status cu_adamw(const mti_kctx *k, float *p, const float *g, float *m, float *v,
                          void *pc, mti_dtype pc_dt, size_t n, const mti_adamw_args *a)
{
    OP_NOTE(k, "adamw n=%zu", n);
    if (!a) return bad_arg(k, "adamw", "no arguments");
    if (pc && !dt_ok(pc_dt)) return bad_dt(k, "adamw", pc_dt);
    if (a->step < 1) return bad_arg(k, "adamw", "step counts from 1");
    if (n == 0) return MT_OK;
    unsigned long long nn = n;
    int pdt = (int)pc_dt;
    float b1 = a->beta1, b2 = a->beta2, eps = a->eps, gs = a->grad_scale;
    /* the step's scalars as torch (and the CPU table) make them: in double,
     * then rounded to fp32 */
    double bc1 = 1.0 - pow((double)a->beta1, (double)a->step);
    double bc2 = 1.0 - pow((double)a->beta2, (double)a->step);
    float step_size = (float)((double)a->lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    float decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay);
    void *args[] = {&p, &g, &m, &v, &pc, &pdt, &nn, &b1, &b2, &eps, &gs, &decay, &step_size,
                    &bc2_sqrt};
    return launch(k, MTI_CUDA_ADAMW, ew_grid(n), MTI_EW_THREADS, args);
}

/* ---- 8-bit AdamW and Adafactor ---- */

/* 4-bit AdamW (kernels/cuda/optim4.cu): the maps by value, as for adamw8. */
typedef struct q4_maps {
    float m[16];
    float v[16];
} q4_maps;

static mt_status cu_adamw4(const mti_kctx *k, float *p, const float *g, const mti_adamw4_state *st,
                           void *pc, mti_dtype pc_dt, int64_t rows, int64_t cols, int rank1,
                           const mti_adamw_args *a)
{
    OP_NOTE(k, "adamw4 %lld x %lld%s", (long long)rows, (long long)cols, rank1 ? " rank-1" : "");
    const char *op = "adamw4";
    if (!a) return bad_arg(k, op, "no arguments");
    if (rows < 0 || cols < 0) return bad_arg(k, op, "negative size");
    if (pc && !dt_ok(pc_dt)) return bad_dt(k, op, pc_dt);
    if (a->step < 1) return bad_arg(k, op, "step counts from 1");
    const size_t n = (size_t)rows * (size_t)cols, nmax = rank1 ? (size_t)(rows + cols) : 0;
    carver w = {0};
    mt_status s = MT_OK;
    if (nmax) {
        s = mti_work_alloc(k, nmax * sizeof(float), &w.blk);
        if (s != MT_OK) return s;
    }
    if (mti_dry(k) || n == 0) {
        if (nmax) mti_work_free(k, &w.blk);
        return MT_OK;
    }
    if (!p || !g || !st || !st->qm || !st->qv || !st->absmax_m || !st->scale_v) {
        if (nmax) mti_work_free(k, &w.blk);
        return bad_arg(k, op, "NULL parameter, gradient or state");
    }
    q4_maps maps;
    memcpy(maps.m, mti_q4_map(1), sizeof maps.m);
    memcpy(maps.v, mti_q4_map(0), sizeof maps.v);
    /* the CPU table's scalars (kernels/cpu/optim4.c) */
    float b1 = a->beta1, b2 = a->beta2, c1 = 1.0f - a->beta1, c2 = 1.0f - a->beta2;
    float gs = a->grad_scale, eps = a->eps;
    float step_size = (float)((double)a->lr / (1.0 - pow((double)a->beta1, (double)a->step)));
    float bc2_sqrt = (float)sqrt(1.0 - pow((double)a->beta2, (double)a->step));
    float decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay);
    unsigned long long nn = n, R = (unsigned long long)rows, C = (unsigned long long)cols;
    int pdt = (int)pc_dt, r1 = rank1 != 0;
    uint8_t *qm = st->qm, *qv = st->qv;
    float *am = st->absmax_m, *sv = st->scale_v, *nmx = w.blk.ptr;
    const float *cnmx = nmx;
    if (nmax) {
        unsigned *rmax = (unsigned *)nmx, *cmax = rmax + rows;
        s = k->dev->memset8(k->dev, nmx, 0, nmax * sizeof(float));
        void *a1[] = {&g, &qv, &sv, &rmax, &cmax, &R, &C, &gs, &b2, &c2, &maps};
        if (s == MT_OK) s = launch(k, MTI_CUDA_ADAMW4_MAXIMA, ew_grid(n), 256, a1);
    }
    size_t blocks = cdiv(n, MTI_Q4_BLOCK);
    mti_dim3 grid = {(unsigned)(blocks < 65535 ? blocks : 65535), 1, 1};
    void *a2[] = {&p, &g, &qm, &am, &qv, &sv, &cnmx, &pc, &pdt, &nn, &R, &C, &r1, &b1, &b2, &c1,
                  &c2, &gs, &eps, &step_size, &bc2_sqrt, &decay, &maps};
    if (s == MT_OK) s = launch(k, MTI_CUDA_ADAMW4, grid, MTI_Q4_BLOCK, a2);
    if (s == MT_OK && nmax) s = cu_cast(k, sv, MTI_F32, nmx, MTI_F32, nmax, MTI_ROUND_NEAREST, 0);
    if (nmax) mti_work_free(k, &w.blk);
    return s;
}

#define MTI_AF_PARTS 1024 /* partial sums of adafactor.cu (MT_AF_PARTS) */
#define MTI_AF_SEG 1024   /* columns per work item of adafactor.cu (MT_AF_SEG) */
#define MTI_AF_SCALARS 4  /* scalar slots after the partial sums */

/* The maps, as the kernel's by-value parameter (struct mt_q8_maps). */
typedef struct q8_maps {
    float m[256];
    float v[256];
} q8_maps;

static mt_status cu_adamw8(const mti_kctx *k, float *p, const float *g, uint8_t *qm, uint8_t *qv,
                           float *absmax_m, float *absmax_v, void *pc, mti_dtype pc_dt, size_t n,
                           const mti_adamw_args *a)
{
    OP_NOTE(k, "adamw8 n=%zu", n);
    if (!a) return bad_arg(k, "adamw8", "no arguments");
    if (pc && !dt_ok(pc_dt)) return bad_dt(k, "adamw8", pc_dt);
    if (a->step < 1) return bad_arg(k, "adamw8", "step counts from 1");
    if (n > 0 && (!p || !g || !qm || !qv || !absmax_m || !absmax_v))
        return bad_arg(k, "adamw8", "NULL parameter, gradient or state");
    if (n == 0) return MT_OK;
    q8_maps maps;
    memcpy(maps.m, mti_q8_map(1), sizeof maps.m);
    memcpy(maps.v, mti_q8_map(0), sizeof maps.v);
    /* the CPU table's scalars (kernels/cpu/optim8.c) */
    double bc1 = 1.0 - pow((double)a->beta1, (double)a->step);
    double bc2_sqrt = sqrt(1.0 - pow((double)a->beta2, (double)a->step));
    float b1 = a->beta1, b2 = a->beta2, c1 = 1.0f - a->beta1, c2 = 1.0f - a->beta2;
    float gs = a->grad_scale;
    float step_size = (float)(-(double)a->lr * bc2_sqrt / bc1);
    float eps_c2 = (float)((double)a->eps * bc2_sqrt);
    float decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay);
    unsigned long long nn = n;
    int pdt = (int)pc_dt;
    size_t blocks = cdiv(n, MTI_Q8_BLOCK);
    mti_dim3 grid = {(unsigned)(blocks < 65535 ? blocks : 65535), 1, 1};
    void *args[] = {&p, &g, &qm, &qv, &absmax_m, &absmax_v, &pc, &pdt, &nn, &b1, &b2, &c1, &c2,
                    &gs, &step_size, &eps_c2, &decay, &maps};
    return launch(k, MTI_CUDA_ADAMW8, grid, MTI_Q8_BLOCK, args);
}

/* 8-bit AdamW of bf16 weights without masters: a piece of MTI_SR_PIECE
 * weights at a time widened into an fp32 buffer (WORK), adamw8 on it, and
 * the stochastic cast back under the piece's seed, which is the op's
 * definition (kernels.h); on the GPU these are three launches a piece. */
static mt_status cu_adamw8_bf16(const mti_kctx *k, uint16_t *w, const float *g, uint8_t *qm,
                                uint8_t *qv, float *absmax_m, float *absmax_v, size_t n, size_t at,
                                uint64_t seed, const mti_adamw_args *a)
{
    OP_NOTE(k, "adamw8_bf16 n=%zu at=%zu", n, at);
    if (!a) return bad_arg(k, "adamw8_bf16", "no arguments");
    if (a->step < 1) return bad_arg(k, "adamw8_bf16", "step counts from 1");
    if (at % MTI_Q8_BLOCK) return bad_arg(k, "adamw8_bf16", "first element not on a block");
    if (n > 0 && (!w || !g || !qm || !qv || !absmax_m || !absmax_v))
        return bad_arg(k, "adamw8_bf16", "NULL weights, gradient or state");
    if (n == 0) return MT_OK;
    mt_block buf;
    mt_status st = mti_work_alloc(k, (n < MTI_SR_PIECE ? n : MTI_SR_PIECE) * sizeof(float), &buf);
    if (st) return st;
    float *w32 = buf.ptr;
    for (size_t j = 0, len; j < n && !st; j += len) {
        const size_t e = at + j, piece = e - e % MTI_SR_PIECE;
        len = n - j < piece + MTI_SR_PIECE - e ? n - j : piece + MTI_SR_PIECE - e;
        const size_t b = j / MTI_Q8_BLOCK;
        st = cu_cast(k, w32, MTI_F32, w + j, MTI_BF16, len, MTI_ROUND_NEAREST, 0);
        if (!st)
            st = cu_adamw8(k, w32, g + j, qm + j, qv + j, absmax_m + b, absmax_v + b, NULL,
                           MTI_F32, len, a);
        if (!st)
            st = cu_cast(k, w + j, MTI_BF16, w32, MTI_F32, len, MTI_ROUND_STOCHASTIC,
                         mti_sr_seed_at(seed ^ (uint64_t)piece, e - piece));
    }
    mti_work_free(k, &buf);
    return st;
}

static unsigned af_grid(size_t items, size_t cap)
{
    if (items == 0) items = 1;
    return (unsigned)(items < cap ? items : cap);
}

static mt_status cu_adafactor(const mti_kctx *k, float *p, const float *g, float *row, float *col,
                              float *v, float *m, void *pc, mti_dtype pc_dt, int64_t rows,
                              int64_t cols, int factored, const mti_adafactor_args *a)
{
    OP_NOTE(k, "adafactor %lld x %lld", (long long)rows, (long long)cols);
    const char *op = "adafactor";
    if (!a) return bad_arg(k, op, "no arguments");
    if (a->step < 1) return bad_arg(k, op, "step counts from 1");
    if (rows < 0 || cols < 0) return bad_arg(k, op, "negative size");
    if (cols > 0 && (uint64_t)rows > SIZE_MAX / sizeof(float) / (uint64_t)cols)
        return bad_arg(k, op, "too many elements");
    if (pc && !dt_ok(pc_dt)) return bad_dt(k, op, pc_dt);
    if (!(a->clip_threshold > 0.0f)) return bad_arg(k, op, "clip_threshold not > 0");
    if (a->warmup_init && !a->relative_step)
        return bad_arg(k, op, "warmup_init without relative_step");
    if (rows == 0 || cols == 0) return MT_OK;
    if (!p || !g) return bad_arg(k, op, "NULL p or g");
    if (factored ? (!row || !col) : !v) return bad_arg(k, op, "NULL second-moment state");
    if (a->beta1 > 0.0f && !m) return bad_arg(k, op, "beta1 > 0 without m");

    /* the CPU table's scalars (kernels/cpu/adafactor.c) */
    unsigned long long R = (unsigned long long)rows, C = (unsigned long long)cols, n = R * C;
    float sqrt_n = (float)sqrt((double)n), gs = a->grad_scale, eps1 = a->eps1, eps2 = a->eps2;
    double t = (double)a->step, rel = a->lr;
    if (a->relative_step) rel = fmin(a->warmup_init ? 1e-6 * t : 1e-2, 1.0 / sqrt(t));
    float rel_f = (float)rel, eps2_rel = (float)(a->eps2 * rel);
    double beta2t = 1.0 - pow(t, (double)a->decay_rate);
    float b2t = (float)beta2t, c2t = (float)(1.0 - beta2t);
    float b1 = a->beta1 > 0.0f ? a->beta1 : 0.0f, c1 = 1.0f - b1, neg_wd = -a->weight_decay;
    float clip = a->clip_threshold, rows_f = (float)rows;
    int scale = a->scale_parameter != 0, wd = a->weight_decay != 0.0f, pdt = (int)pc_dt;
    float *mm = a->beta1 > 0.0f ? m : NULL;
    const float *crow = factored ? row : NULL, *ccol = factored ? col : NULL;
    float *vv = factored ? NULL : v;
    /* the update kernels see an unfactored tensor as one row */
    unsigned long long ur = factored ? R : 1, uc = factored ? C : n;
    size_t items = (size_t)ur * cdiv((size_t)uc, MTI_AF_SEG);

    carver w = {0};
    mt_status st = mti_work_alloc(k, (MTI_AF_PARTS + MTI_AF_SCALARS) * sizeof(float), &w.blk);
    if (st != MT_OK) return st;
    float *part = w.blk.ptr, *scal = part + MTI_AF_PARTS;
    const float *cpart = part, *cscal = scal;
    int nparts, which, sq = 1;
    unsigned gp = af_grid(cdiv(n, 1024), MTI_AF_PARTS);

    /* RMS(p) -> lr_t */
    void *a1[] = {&part, &p, &n, &sq};
    st = launch(k, MTI_CUDA_AF_PARTIALS, (mti_dim3){gp, 1, 1}, 256, a1);
    nparts = (int)gp, which = 0;
    void *a2[] = {&scal, &cpart, &nparts, &which, &sqrt_n, &rows_f, &rel_f, &eps2, &eps2_rel,
                  &scale, &neg_wd, &clip};
    if (st == MT_OK) st = launch(k, MTI_CUDA_AF_FINISH, (mti_dim3){1, 1, 1}, 1024, a2);
    if (factored) {
        void *a3[] = {&row, &g, &R, &C, &gs, &eps1, &b2t, &c2t};
        if (st == MT_OK)
            st = launch(k, MTI_CUDA_AF_ROWS, (mti_dim3){af_grid(R, 65535), 1, 1}, 256, a3);
        void *a4[] = {&col, &g, &R, &C, &gs, &eps1, &b2t, &c2t};
        if (st == MT_OK)
            st = launch(k, MTI_CUDA_AF_COLS, (mti_dim3){af_grid(cdiv(C, 32), 65535), 1, 1}, 256, a4);
        /* mean(row) */
        unsigned gr = af_grid(cdiv(R, 1024), MTI_AF_PARTS);
        int plain = 0;
        void *a5[] = {&part, &row, &R, &plain};
        if (st == MT_OK) st = launch(k, MTI_CUDA_AF_PARTIALS, (mti_dim3){gr, 1, 1}, 256, a5);
        nparts = (int)gr, which = 1;
        if (st == MT_OK) st = launch(k, MTI_CUDA_AF_FINISH, (mti_dim3){1, 1, 1}, 1024, a2);
    }
    /* RMS(update) -> the clip divisor (unfactored: v updated here) */
    unsigned gu = af_grid(items, MTI_AF_PARTS);
    void *a6[] = {&part, &cscal, &g, &crow, &ccol, &vv, &ur, &uc, &gs, &eps1, &b2t, &c2t};
    if (st == MT_OK) st = launch(k, MTI_CUDA_AF_UPD, (mti_dim3){gu, 1, 1}, 256, a6);
    nparts = (int)gu, which = 2;
    if (st == MT_OK) st = launch(k, MTI_CUDA_AF_FINISH, (mti_dim3){1, 1, 1}, 1024, a2);
    /* the step */
    void *a7[] = {&p, &mm, &pc, &pdt, &cscal, &g, &crow, &ccol, &vv, &ur, &uc, &gs, &b1, &c1, &wd};
    if (st == MT_OK)
        st = launch(k, MTI_CUDA_AF_APPLY, (mti_dim3){af_grid(items, 65535), 1, 1}, 256, a7);
    mti_work_free(k, &w.blk);
    return st;
}

/* ---- the table ---- */

/* Every op of MTI_OPS (lib/ops/kernels.h) as cu_<op>. */
#define CUDA_OP(op) .op = cu_##op,
static const mti_ops cuda_ops = {.name = "cuda", .device = MT_DEVICE_CUDA, MTI_OPS(CUDA_OP)};
#undef CUDA_OP

mt_status mti_cuda_ops(mti_device *d, const mti_ops **out)
{
    if (!d || !out) return mti_fail(d ? d->ctx : NULL, MT_ERR_INVALID_ARG, "mti_cuda_ops: NULL");
    if (d->kind != MT_DEVICE_CUDA)
        return mti_fail(d->ctx, MT_ERR_INVALID_ARG, "mti_cuda_ops: not a CUDA device");
    /* every kernel was looked up when the device opened; the first one's
     * lookup carries the reason when they are missing */
    mti_cuda_fn *fn;
    mt_status st = mti_cuda_kernel(d, MTI_CUDA_CAST, &fn);
    if (st != MT_OK) return st;
    if (!state_of(d)) return mti_fail(d->ctx, MT_ERR_OOM, "mti_cuda_ops: out of host memory");
    *out = &cuda_ops;
    return MT_OK;
}

const mti_ops *mti_cuda_dry_ops(void) { return &cuda_ops; }
