/*
 * cublaslt_api.h - the part of cuBLASLt the CUDA op table calls, declared
 * here so the library builds without the CUDA toolkit's headers.
 *
 * cuBLASLt (libcublasLt.so.13, or .12) is opened with dlopen the first time
 * a GEMM runs and every entry point is looked up by name, so nothing here is
 * linked against. Types and values follow cuBLASLt's documented C ABI
 * (64-bit Linux): handles and descriptors are pointers to opaque library
 * structs, enums are passed as 32-bit ints, and the heuristic result is a
 * plain struct returned by value into an array the caller owns.
 *
 * The library works in column-major order: a row-major (R, C) matrix is the
 * column-major (C, R) matrix with leading dimension C. kernels/cuda/ops_cuda.c says
 * how each GEMM of the op table is mapped.
 */
#ifndef MT_CUBLASLT_API_H
#define MT_CUBLASLT_API_H

#include <stddef.h>
#include <stdint.h>

/* ---- handles and scalars ---- */

typedef int cublasStatus_t; /* 0 is success; see CUBLAS_STATUS_* */
typedef struct cublasLtContext *cublasLtHandle_t;
typedef struct cublasLtMatmulDescOpaque *cublasLtMatmulDesc_t;
typedef struct cublasLtMatrixLayoutOpaque *cublasLtMatrixLayout_t;
typedef struct cublasLtMatmulPreferenceOpaque *cublasLtMatmulPreference_t;

/* An algorithm chosen by the heuristic: 64 bytes the library fills in and
 * reads back, valid with the descriptors it was chosen for. */
typedef struct cublasLtMatmulAlgo_t {
    uint64_t data[8];
} cublasLtMatmulAlgo_t;

/* One answer of cublasLtMatmulAlgoGetHeuristic: 96 bytes. */
typedef struct cublasLtMatmulHeuristicResult_t {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize; /* bytes the algorithm needs */
    cublasStatus_t state; /* CUBLAS_STATUS_SUCCESS when the fields above are valid */
    float wavesCount;     /* device utilisation estimate (1.0: one full wave) */
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;

_Static_assert(sizeof(cublasLtMatmulAlgo_t) == 64, "cublasLtMatmulAlgo_t ABI");
_Static_assert(sizeof(cublasLtMatmulHeuristicResult_t) == 96,
               "cublasLtMatmulHeuristicResult_t ABI");

/* ---- values ---- */

enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
};

/* Element types of matrices (the CUDA library-wide numbering). */
typedef int cudaDataType;
enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };

/* Accumulation types: plain fp32 multiply-adds, no TF32 or fp16 shortcuts. */
typedef int cublasComputeType_t;
enum { CUBLAS_COMPUTE_32F = 68 };

/* How an operand is read: as stored, or transposed. */
enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };

/* Matmul descriptor attributes, with the type of each value. */
typedef int cublasLtMatmulDescAttributes_t;
enum {
    CUBLASLT_MATMUL_DESC_TRANSA = 3,         /* int32_t, CUBLAS_OP_* */
    CUBLASLT_MATMUL_DESC_TRANSB = 4,         /* int32_t, CUBLAS_OP_* */
    CUBLASLT_MATMUL_DESC_EPILOGUE = 7,       /* uint32_t, CUBLASLT_EPILOGUE_* */
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,   /* const void *: one value per row of D */
    CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26 /* int32_t cudaDataType; default: D's type */
};

/* What happens to the product before it is stored. */
enum {
    CUBLASLT_EPILOGUE_DEFAULT = 1, /* nothing */
    CUBLASLT_EPILOGUE_BIAS = 4     /* add the bias vector to every column of D */
};

/* Heuristic preferences, with the type of each value. */
typedef int cublasLtMatmulPreferenceAttributes_t;
enum {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1, /* uint64_t; default 0 */
    CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = 3, /* uint32_t, CUBLASLT_REDUCTION_SCHEME_* */
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5, /* uint32_t; default 256 */
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
};

/* How an algorithm that splits the inner dimension adds the pieces: not at
 * all (NONE, always allowed), in place in D's type, in a workspace in the
 * compute type, or in a workspace in D's type. Only the compute-type one
 * keeps "accumulate in fp32, round to D's type once". */
enum {
    CUBLASLT_REDUCTION_SCHEME_NONE = 0,
    CUBLASLT_REDUCTION_SCHEME_INPLACE = 1,
    CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE = 2,
    CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE = 4
};

/* ---- entry points: pointer types, one per symbol looked up ---- */

typedef cublasStatus_t (*PFN_cublasLtCreate)(cublasLtHandle_t *handle);
typedef cublasStatus_t (*PFN_cublasLtDestroy)(cublasLtHandle_t handle);
typedef size_t (*PFN_cublasLtGetVersion)(void); /* e.g. 130001 for 13.0.1 */
/* A constant string owned by the library, e.g. "CUBLAS_STATUS_NOT_SUPPORTED". */
typedef const char *(*PFN_cublasLtGetStatusName)(cublasStatus_t status);

typedef cublasStatus_t (*PFN_cublasLtMatmulDescCreate)(cublasLtMatmulDesc_t *desc,
                                                        cublasComputeType_t compute,
                                                        cudaDataType scale_type);
typedef cublasStatus_t (*PFN_cublasLtMatmulDescDestroy)(cublasLtMatmulDesc_t desc);
typedef cublasStatus_t (*PFN_cublasLtMatmulDescSetAttribute)(cublasLtMatmulDesc_t desc,
                                                              cublasLtMatmulDescAttributes_t attr,
                                                              const void *value, size_t bytes);

/* A column-major matrix as stored: rows x cols, leading dimension ld (>= rows). */
typedef cublasStatus_t (*PFN_cublasLtMatrixLayoutCreate)(cublasLtMatrixLayout_t *layout,
                                                          cudaDataType type, uint64_t rows,
                                                          uint64_t cols, int64_t ld);
typedef cublasStatus_t (*PFN_cublasLtMatrixLayoutDestroy)(cublasLtMatrixLayout_t layout);

typedef cublasStatus_t (*PFN_cublasLtMatmulPreferenceCreate)(cublasLtMatmulPreference_t *pref);
typedef cublasStatus_t (*PFN_cublasLtMatmulPreferenceDestroy)(cublasLtMatmulPreference_t pref);
typedef cublasStatus_t (*PFN_cublasLtMatmulPreferenceSetAttribute)(
    cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void *value,
    size_t bytes);

/* Up to `requested` algorithms for the problem, best first; *returned says
 * how many were written. */
typedef cublasStatus_t (*PFN_cublasLtMatmulAlgoGetHeuristic)(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t *results,
    int *returned);

/* D = alpha * op(A) op(B) + beta * C (+ epilogue), queued on `stream` (a
 * CUstream). alpha and beta are host pointers to the scale type (fp32 here).
 * C may be D. */
typedef cublasStatus_t (*PFN_cublasLtMatmul)(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              const void *alpha, const void *A,
                                              cublasLtMatrixLayout_t a, const void *B,
                                              cublasLtMatrixLayout_t b, const void *beta,
                                              const void *C, cublasLtMatrixLayout_t c, void *D,
                                              cublasLtMatrixLayout_t d,
                                              const cublasLtMatmulAlgo_t *algo, void *workspace,
                                              size_t workspace_bytes, void *stream);

#endif /* MT_CUBLASLT_API_H */
