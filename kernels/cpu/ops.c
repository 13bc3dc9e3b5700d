/*
 * ops.c - the CPU op table (fp32): the reference every other table is
 * checked against, and the CPU backend. GEMMs go through OpenBLAS; the rest
 * is plain loops, threaded with OpenMP where the work is large enough to pay
 * for it. Every reduction runs in a fixed order, so results do not depend on
 * the number of threads.
 */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <string.h>

#include "kernels.h"

static _Atomic int g_threads = 1;

/* below this many elements a parallel region costs more than it saves */
#define PAR_MIN 16384

void mti_cpu_set_threads(int threads)
{
    if (threads < 1) threads = 1;
    atomic_store(&g_threads, threads);
    openblas_set_num_threads(threads);
}

static int nthreads(void) { return atomic_load(&g_threads); }

/* y (N,out) = x (N,in) . W^T + b */
static void matmul_fwd(float *y, const float *x, const float *w, const float *b, int n, int in,
                       int out)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in, 0.0f, y,
                out);
    if (!b) return;
#pragma omp parallel for num_threads(nthreads()) if ((size_t)n * out > PAR_MIN)
    for (int i = 0; i < n; i++) {
        float *row = y + (size_t)i * out;
        for (int j = 0; j < out; j++) row[j] += b[j];
    }
}

static void matmul_bwd(float *dx, float *dw, float *db, const float *dy, const float *x,
                       const float *w, int n, int in, int out, int accumulate)
{
    float beta = accumulate ? 1.0f : 0.0f;
    if (dx) /* dx (N,in) = dy (N,out) . W (out,in) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out, 1.0f, dy, out, w, in,
                    0.0f, dx, in);
    /* dW (out,in) = dy^T (out,N) . x (N,in) */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.0f, dy, out, x, in, beta,
                dw, in);
    if (!db) return;
    /* db (out) = sum over rows, row by row so the order is fixed */
    if (!accumulate) memset(db, 0, sizeof(float) * (size_t)out);
    for (int i = 0; i < n; i++) {
        const float *row = dy + (size_t)i * out;
        for (int j = 0; j < out; j++) db[j] += row[j];
    }
}

static void relu_fwd(float *y, const float *x, size_t n)
{
#pragma omp parallel for num_threads(nthreads()) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

static void relu_bwd(float *dx, const float *dy, const float *x, size_t n)
{
#pragma omp parallel for num_threads(nthreads()) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_C 0.044715f

static void gelu_fwd(float *y, const float *x, size_t n)
{
#pragma omp parallel for num_threads(nthreads()) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        float u = GELU_K * (v + GELU_C * v * v * v);
        y[i] = 0.5f * v * (1.0f + tanhf(u));
    }
}

/* d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2), t = tanh(u) */
static void gelu_bwd(float *dx, const float *dy, const float *x, size_t n)
{
#pragma omp parallel for num_threads(nthreads()) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        float u = GELU_K * (v + GELU_C * v * v * v);
        float t = tanhf(u);
        float du = GELU_K * (1.0f + 3.0f * GELU_C * v * v);
        dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
}

/* One row: returns the loss; writes (softmax - onehot) * dscale into drow if not NULL. */
static float xent_row(float *drow, const float *row, int32_t target, int c, float dscale)
{
    float mx = row[0];
    for (int j = 1; j < c; j++) mx = row[j] > mx ? row[j] : mx;
    float sum = 0.0f;
    for (int j = 0; j < c; j++) sum += expf(row[j] - mx);
    float logz = logf(sum);
    float loss = logz - (row[target] - mx);
    if (drow) {
        float inv = 1.0f / sum;
        for (int j = 0; j < c; j++) {
            float p = expf(row[j] - mx) * inv;
            drow[j] = (p - (j == target ? 1.0f : 0.0f)) * dscale;
        }
    }
    return loss;
}

static void xent_fwd_bwd(float *losses, float *dlogits, const float *logits,
                         const int32_t *targets, int n, int c, float dscale)
{
#pragma omp parallel for num_threads(nthreads()) if ((size_t)n * c > PAR_MIN)
    for (int i = 0; i < n; i++)
        losses[i] = xent_row(dlogits + (size_t)i * c, logits + (size_t)i * c, targets[i], c, dscale);
}

static void xent_fwd(float *losses, const float *logits, const int32_t *targets, int n, int c)
{
#pragma omp parallel for num_threads(nthreads()) if ((size_t)n * c > PAR_MIN)
    for (int i = 0; i < n; i++)
        losses[i] = xent_row(NULL, logits + (size_t)i * c, targets[i], c, 0.0f);
}

static void sgd_update(float *p, const float *g, float *m, size_t n, float lr, float momentum,
                       float wd)
{
#pragma omp parallel for num_threads(nthreads()) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float d = g[i] + wd * p[i];
        if (m) {
            m[i] = momentum * m[i] + d;
            d = m[i];
        }
        p[i] -= lr * d;
    }
}

static const struct mti_ops cpu_ops = {
    .name = "cpu",
    .matmul_fwd = matmul_fwd,
    .matmul_bwd = matmul_bwd,
    .relu_fwd = relu_fwd,
    .relu_bwd = relu_bwd,
    .gelu_fwd = gelu_fwd,
    .gelu_bwd = gelu_bwd,
    .xent_fwd_bwd = xent_fwd_bwd,
    .xent_fwd = xent_fwd,
    .sgd_update = sgd_update,
};

const struct mti_ops *mti_cpu_ops(void) { return &cpu_ops; }
