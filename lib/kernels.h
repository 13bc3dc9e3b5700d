/*
 * kernels.h - the op table. One table per device with the same names and
 * semantics: kernels/cpu (the reference and the CPU backend) and, as it
 * grows, kernels/cuda. Pointers are device pointers of the table's device.
 * Shapes are given beside each op; all storage here is fp32, row-major.
 */
#ifndef MT_KERNELS_H
#define MT_KERNELS_H

#include <stddef.h>
#include <stdint.h>

struct mti_ops {
    const char *name;
    /* y (N,out) = x (N,in) . W^T + b, with W (out,in) and b (out) or NULL */
    void (*matmul_fwd)(float *y, const float *x, const float *w, const float *b, int n, int in,
                       int out);
    /* dx (N,in) = dy (N,out) . W;  dW (out,in) = dy^T . x;  db (out) = sum over rows of dy.
     * With accumulate != 0, dW and db are added to instead of overwritten.
     * dx and db may be NULL (not wanted). */
    void (*matmul_bwd)(float *dx, float *dw, float *db, const float *dy, const float *x,
                       const float *w, int n, int in, int out, int accumulate);
    /* elementwise over n values; the backward's dx may alias dy */
    void (*relu_fwd)(float *y, const float *x, size_t n);
    void (*relu_bwd)(float *dx, const float *dy, const float *x, size_t n);
    /* GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    void (*gelu_fwd)(float *y, const float *x, size_t n);
    void (*gelu_bwd)(float *dx, const float *dy, const float *x, size_t n);
    /* Softmax cross-entropy over C classes for N rows: losses (N) = -log softmax(logits)[target];
     * dlogits (N,C) = (softmax - onehot(target)) * dscale. dlogits may alias logits (the
     * probabilities are never kept). */
    void (*xent_fwd_bwd)(float *losses, float *dlogits, const float *logits,
                         const int32_t *targets, int n, int c, float dscale);
    /* losses only */
    void (*xent_fwd)(float *losses, const float *logits, const int32_t *targets, int n, int c);
    /* SGD as torch.optim.SGD (dampening 0, no Nesterov): g' = g + wd p;
     * m = momentum m + g' (m NULL when momentum is 0); p -= lr (m or g'). */
    void (*sgd_update)(float *p, const float *g, float *m, size_t n, float lr, float momentum,
                       float wd);
};

/* The CPU table, and the CPU thread count for its kernels (OpenMP, OpenBLAS). */
const struct mti_ops *mti_cpu_ops(void);
void mti_cpu_set_threads(int threads);

#endif /* MT_KERNELS_H */
