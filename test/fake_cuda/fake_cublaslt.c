/*
 * fake_cublaslt.c - a stand-in cuBLASLt for the stand-in CUDA driver
 * (fake_libcuda.c), for tests.
 *
 * Built as build/libfakecublaslt.so and handed to the library as
 * mt_context_config.cublaslt_path (tests find it through MT_FAKE_CUBLASLT),
 * so the CUDA op table's GEMMs go somewhere where there is no GPU, and a
 * whole training step runs on the CUDA path over the stand-in driver. It
 * exports the entry points lib/device/cublaslt_api.h declares and checks their use
 * as cuBLASLt would where that is cheap: descriptors and layouts that exist
 * and agree with the problem (op(A) m x k, op(B) k x n, C and D m x n),
 * leading dimensions at least the rows, the heuristic's workspace limit
 * kept, and at least the chosen algorithm's workspace handed to Matmul.
 *
 * Matmul computes nothing: it touches the first and the last element of
 * every operand (device memory is host memory under the stand-in driver, so
 * an operand outside mapped memory faults) and counts. The heuristic asks
 * for a different workspace per shape (a multiple of 256 KiB up to the
 * limit), so a caller that sized workspace by the algorithm would show it.
 *
 * The heuristic can refuse, as the real one does for shapes, types,
 * alignments and epilogues it has no kernel for: it then returns
 * CUBLAS_STATUS_NOT_SUPPORTED with no results (or, under FAKE_LT_SAY_EMPTY,
 * success with zero results, the other way cuBLASLt says "none"). What it
 * refuses is a set of rules (the FAKE_LT_* bits below); by default
 * operands or a bias aligned less than 16 bytes, and the bias epilogue
 * where D's rows are not a multiple of 8, so the callers' fallbacks run in
 * ordinary tests (MT_FAKE_CUBLASLT_RULES, a number, replaces the default
 * when the library loads).
 * Otherwise it offers up to two algorithms, and Matmul refuses pointers
 * aligned less than the algorithm was chosen for.
 *
 * For tests, besides the entry points:
 *   fake_cublaslt_stat(name)  "matmuls", "heuristics", "refusals",
 *                             "max_ws_asked", "max_ws_given" (bytes),
 *                             "live_objects"
 *   fake_cublaslt_rules(r)    sets the refusal rules, returns the old ones
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "device/cublaslt_api.h"

#define LT_MAGIC_HANDLE 0x4c54484eu
#define LT_MAGIC_DESC 0x4c544445u
#define LT_MAGIC_LAYOUT 0x4c544c41u
#define LT_MAGIC_PREF 0x4c545052u

/* Refusal rules of the heuristic (fake_cublaslt_rules). */
enum {
    FAKE_LT_REFUSE_ALL = 1u,  /* no algorithm for anything */
    FAKE_LT_REFUSE_BIAS = 2u, /* none with the bias epilogue */
    FAKE_LT_SAY_EMPTY = 4u,   /* "none" as success with zero results, not NOT_SUPPORTED */
    FAKE_LT_ALIGN16 = 8u,     /* none for an operand (or bias) aligned less than 16 bytes */
    FAKE_LT_BIAS_M8 = 16u,    /* none with the bias epilogue unless D's rows (m) are a
                                 multiple of 8 */
    FAKE_LT_DEFAULT = FAKE_LT_ALIGN16 | FAKE_LT_BIAS_M8,
};

struct cublasLtContext {
    uint32_t magic;
};
struct cublasLtMatmulDescOpaque {
    uint32_t magic;
    int32_t ta, tb;
    uint32_t epilogue;
    const void *bias;
};
struct cublasLtMatrixLayoutOpaque {
    uint32_t magic;
    cudaDataType type;
    uint64_t rows, cols;
    int64_t ld;
};
struct cublasLtMatmulPreferenceOpaque {
    uint32_t magic;
    uint64_t max_ws;
    uint32_t align[4]; /* least alignment of A, B, C, D in bytes (default 256) */
};

static struct {
    unsigned long long matmuls, heuristics, refusals, max_ws_asked, max_ws_given;
    long long live;
    unsigned rules;
} S;

cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle);
size_t cublasLtGetVersion(void);
const char *cublasLtGetStatusName(cublasStatus_t status);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                        cudaDataType scale_type);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attr,
                                              const void *value, size_t bytes);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *value, size_t bytes);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t *results,
                                              int *returned);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                              const void *alpha, const void *A, cublasLtMatrixLayout_t la,
                              const void *B, cublasLtMatrixLayout_t lb, const void *beta,
                              const void *C, cublasLtMatrixLayout_t lc, void *D,
                              cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t *algo,
                              void *workspace, size_t workspace_bytes, void *stream);
unsigned long long fake_cublaslt_stat(const char *name);
unsigned fake_cublaslt_rules(unsigned rules);

__attribute__((constructor)) static void rules_from_env(void)
{
    const char *e = getenv("MT_FAKE_CUBLASLT_RULES");
    char *end = NULL;
    unsigned long v = e && *e ? strtoul(e, &end, 0) : 0;
    S.rules = e && *e && end && !*end ? (unsigned)v : FAKE_LT_DEFAULT;
}

static void *obj(size_t bytes, uint32_t magic)
{
    uint32_t *p = calloc(1, bytes);
    if (p) {
        *p = magic;
        __atomic_add_fetch(&S.live, 1, __ATOMIC_RELAXED); /* threads as ranks make GEMMs at once */
    }
    return p;
}

static cublasStatus_t drop(void *p, uint32_t magic)
{
    if (!p || *(uint32_t *)p != magic) return CUBLAS_STATUS_INVALID_VALUE;
    *(uint32_t *)p = 0;
    free(p);
    __atomic_sub_fetch(&S.live, 1, __ATOMIC_RELAXED);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle)
{
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = obj(sizeof **handle, LT_MAGIC_HANDLE);
    return *handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) { return drop(handle, LT_MAGIC_HANDLE); }

size_t cublasLtGetVersion(void) { return 999999; }

const char *cublasLtGetStatusName(cublasStatus_t status)
{
    switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_INTERNAL_ERROR";
    }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                        cudaDataType scale_type)
{
    if (!desc || compute != CUBLAS_COMPUTE_32F || scale_type != CUDA_R_32F)
        return CUBLAS_STATUS_INVALID_VALUE;
    *desc = obj(sizeof **desc, LT_MAGIC_DESC);
    if (!*desc) return CUBLAS_STATUS_ALLOC_FAILED;
    (*desc)->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc)
{
    return drop(desc, LT_MAGIC_DESC);
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attr,
                                              const void *value, size_t bytes)
{
    if (!desc || desc->magic != LT_MAGIC_DESC || !value) return CUBLAS_STATUS_INVALID_VALUE;
    int32_t i32;
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
        if (bytes != sizeof i32) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&i32, value, sizeof i32);
        if (i32 != CUBLAS_OP_N && i32 != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
        if (attr == CUBLASLT_MATMUL_DESC_TRANSA) desc->ta = i32;
        else desc->tb = i32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
        if (bytes != sizeof desc->epilogue) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&desc->epilogue, value, sizeof desc->epilogue);
        return desc->epilogue == CUBLASLT_EPILOGUE_DEFAULT ||
                       desc->epilogue == CUBLASLT_EPILOGUE_BIAS
                   ? CUBLAS_STATUS_SUCCESS
                   : CUBLAS_STATUS_NOT_SUPPORTED;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        if (bytes != sizeof desc->bias) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&desc->bias, value, sizeof desc->bias);
        return CUBLAS_STATUS_SUCCESS;
    default:
        return CUBLAS_STATUS_INVALID_VALUE;
    }
}

static int type_ok(cudaDataType t) { return t == CUDA_R_32F || t == CUDA_R_16F || t == CUDA_R_16BF; }

static size_t type_size(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld)
{
    if (!layout || !type_ok(type) || ld < 1 || (uint64_t)ld < rows)
        return CUBLAS_STATUS_INVALID_VALUE;
    *layout = obj(sizeof **layout, LT_MAGIC_LAYOUT);
    if (!*layout) return CUBLAS_STATUS_ALLOC_FAILED;
    (*layout)->type = type, (*layout)->rows = rows, (*layout)->cols = cols, (*layout)->ld = ld;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout)
{
    return drop(layout, LT_MAGIC_LAYOUT);
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref)
{
    if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
    *pref = obj(sizeof **pref, LT_MAGIC_PREF);
    if (!*pref) return CUBLAS_STATUS_ALLOC_FAILED;
    for (int i = 0; i < 4; i++) (*pref)->align[i] = 256;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref)
{
    return drop(pref, LT_MAGIC_PREF);
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *value, size_t bytes)
{
    if (!pref || pref->magic != LT_MAGIC_PREF || !value) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
        if (bytes != sizeof pref->max_ws) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&pref->max_ws, value, sizeof pref->max_ws);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
        return bytes == sizeof(uint32_t) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
        uint32_t a;
        if (bytes != sizeof a) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&a, value, sizeof a);
        if (!a || (a & (a - 1))) return CUBLAS_STATUS_INVALID_VALUE;
        pref->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = a;
        return CUBLAS_STATUS_SUCCESS;
    }
    default:
        return CUBLAS_STATUS_INVALID_VALUE;
    }
}

/* The problem's m, n, k when the layouts agree with the descriptor. */
static int problem(const struct cublasLtMatmulDescOpaque *d, const struct cublasLtMatrixLayoutOpaque *a,
                   const struct cublasLtMatrixLayoutOpaque *b,
                   const struct cublasLtMatrixLayoutOpaque *c,
                   const struct cublasLtMatrixLayoutOpaque *dl, uint64_t mnk[3])
{
    if (!d || d->magic != LT_MAGIC_DESC || !a || a->magic != LT_MAGIC_LAYOUT || !b ||
        b->magic != LT_MAGIC_LAYOUT || !c || c->magic != LT_MAGIC_LAYOUT || !dl ||
        dl->magic != LT_MAGIC_LAYOUT)
        return 0;
    uint64_t m = d->ta == CUBLAS_OP_N ? a->rows : a->cols;
    uint64_t k = d->ta == CUBLAS_OP_N ? a->cols : a->rows;
    uint64_t kb = d->tb == CUBLAS_OP_N ? b->rows : b->cols;
    uint64_t n = d->tb == CUBLAS_OP_N ? b->cols : b->rows;
    if (k != kb || dl->rows != m || dl->cols != n || c->rows != m || c->cols != n ||
        c->type != dl->type)
        return 0;
    if (d->epilogue == CUBLASLT_EPILOGUE_BIAS && !d->bias) return 0;
    mnk[0] = m, mnk[1] = n, mnk[2] = k;
    return 1;
}

/* Whether the rules refuse the problem. */
static int refused(const struct cublasLtMatmulDescOpaque *d,
                   const struct cublasLtMatmulPreferenceOpaque *p, uint64_t m)
{
    if (S.rules & FAKE_LT_REFUSE_ALL) return 1;
    if (S.rules & FAKE_LT_ALIGN16) {
        for (int i = 0; i < 4; i++)
            if (p->align[i] < 16) return 1;
        if (d->epilogue == CUBLASLT_EPILOGUE_BIAS && (uintptr_t)d->bias % 16) return 1;
    }
    if ((S.rules & FAKE_LT_REFUSE_BIAS) && d->epilogue == CUBLASLT_EPILOGUE_BIAS) return 1;
    if ((S.rules & FAKE_LT_BIAS_M8) && d->epilogue == CUBLASLT_EPILOGUE_BIAS && m % 8) return 1;
    return 0;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t *results,
                                              int *returned)
{
    uint64_t mnk[3];
    if (!handle || handle->magic != LT_MAGIC_HANDLE || !pref || pref->magic != LT_MAGIC_PREF ||
        requested < 1 || !results || !returned || !problem(desc, a, b, c, d, mnk))
        return CUBLAS_STATUS_INVALID_VALUE;
    S.heuristics++;
    int n = requested < 2 ? requested : 2;
    memset(results, 0, (size_t)n * sizeof *results);
    *returned = 0;
    if (refused(desc, pref, mnk[0])) {
        S.refusals++;
        return S.rules & FAKE_LT_SAY_EMPTY ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
    }
    uint64_t ws = ((mnk[0] * 31 + mnk[1] * 17 + mnk[2] * 7) % 17) << 18; /* 0..4 MiB */
    if (ws > pref->max_ws) ws = pref->max_ws / (1u << 18) * (1u << 18);
    if (ws > S.max_ws_asked) S.max_ws_asked = ws;
    for (int i = 0; i < n; i++) {
        /* data: workspace, an id, the four alignments it was chosen for */
        results[i].algo.data[0] = i ? 0 : ws;
        results[i].algo.data[1] = mnk[0] ^ (mnk[1] << 20) ^ (mnk[2] << 40) ^ (uint64_t)i << 63;
        for (int j = 0; j < 4; j++) results[i].algo.data[2 + j] = pref->align[j];
        results[i].workspaceSize = i ? 0 : (size_t)ws;
        results[i].state = CUBLAS_STATUS_SUCCESS;
        results[i].wavesCount = 1.0f;
    }
    *returned = n;
    return CUBLAS_STATUS_SUCCESS;
}

/* Reads the first and last element of a stored matrix, and writes them back. */
static void touch(const void *p, const struct cublasLtMatrixLayoutOpaque *l, int write)
{
    if (!l->rows || !l->cols) return;
    size_t es = type_size(l->type);
    size_t last = ((size_t)(l->cols - 1) * (size_t)l->ld + (size_t)(l->rows - 1)) * es;
    volatile unsigned char *b = (volatile unsigned char *)p;
    unsigned char x = b[0], y = b[last + es - 1];
    if (write) b[0] = x, b[last + es - 1] = y;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                              const void *alpha, const void *A, cublasLtMatrixLayout_t la,
                              const void *B, cublasLtMatrixLayout_t lb, const void *beta,
                              const void *C, cublasLtMatrixLayout_t lc, void *D,
                              cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t *algo,
                              void *workspace, size_t workspace_bytes, void *stream)
{
    uint64_t mnk[3];
    (void)stream;
    if (!handle || handle->magic != LT_MAGIC_HANDLE || !alpha || !beta || !algo ||
        !problem(desc, la, lb, lc, ld, mnk))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (workspace_bytes < algo->data[0] || (workspace_bytes && !workspace))
        return CUBLAS_STATUS_INVALID_VALUE;
    /* pointers as aligned as the algorithm was chosen for (C is D here) */
    const void *ptrs[4] = {A, B, C, D};
    for (int i = 0; i < 4; i++)
        if (ptrs[i] && (uintptr_t)ptrs[i] % (algo->data[2 + i] ? algo->data[2 + i] : 1))
            return CUBLAS_STATUS_NOT_SUPPORTED;
    if (mnk[0] && mnk[1] && (!D || !C || (mnk[2] && (!A || !B))))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (mnk[0] && mnk[1]) {
        if (mnk[2]) touch(A, la, 0), touch(B, lb, 0);
        touch(C, lc, 0);
        touch(D, ld, 1);
        if (workspace_bytes) touch(workspace, &(struct cublasLtMatrixLayoutOpaque){
                                                  .type = CUDA_R_16F, .rows = workspace_bytes / 2,
                                                  .cols = 1, .ld = (int64_t)(workspace_bytes / 2)},
                                   1);
    }
    S.matmuls++;
    if (workspace_bytes > S.max_ws_given) S.max_ws_given = workspace_bytes;
    return CUBLAS_STATUS_SUCCESS;
}

unsigned long long fake_cublaslt_stat(const char *name)
{
    if (!name) return 0;
    if (!strcmp(name, "matmuls")) return S.matmuls;
    if (!strcmp(name, "heuristics")) return S.heuristics;
    if (!strcmp(name, "refusals")) return S.refusals;
    if (!strcmp(name, "max_ws_asked")) return S.max_ws_asked;
    if (!strcmp(name, "max_ws_given")) return S.max_ws_given;
    if (!strcmp(name, "live_objects")) return (unsigned long long)S.live; /* < 0: huge */
    return 0;
}

unsigned fake_cublaslt_rules(unsigned rules)
{
    unsigned old = S.rules;
    S.rules = rules;
    return old;
}
