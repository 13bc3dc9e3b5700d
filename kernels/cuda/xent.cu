/*
 * xent.cu - softmax cross-entropy over a padded vocabulary, fused with its
 * gradient, and distillation's loss (the cross-entropy fused with the KL to
 * a teacher's softmax) the same way. One block per row (512 threads): the
 * row's maximum (exact in any order), then the sum of exp(logit - max) with
 * thread t adding columns t, t + 512, ... in order and the block adding the
 * thread sums in a fixed tree, then the loss, then, with dlogits, the
 * gradient written over the row. The target's logit is read before any
 * gradient is written, and every other element is read by the thread that
 * then writes it, so dlogits may alias logits and no probability tensor
 * exists.
 */

#define MT_XENT_THREADS 512

/* losses (N) fp32 = logsumexp(logits[r, :V]) - logits[r, target] (losses
 * may be NULL: only the gradient wanted);
 * dlogits (N,Vp) = (softmax - onehot(target)) * dloss for columns < V, 0 for
 * the padding, when dlogits is not NULL. grid N, block 512. */
template <typename T>
__device__ __forceinline__ void xent_k(float *losses, void *dlogits_, const void *logits_,
                                       const int *targets, int V, int Vp, float dloss)
{
    __shared__ float sh[32];
    __shared__ float target_logit;
    const T *logits = (const T *)logits_;
    T *dlogits = (T *)dlogits_;
    const int row = blockIdx.x, t = threadIdx.x;
    const mt_index base = (mt_index)row * Vp;
    const int target = targets[row];
    if (t == 0) target_logit = mt_ld(logits, base + target);

    float mx = -INFINITY;
    for (int j = t; j < V; j += MT_XENT_THREADS) mx = fmaxf(mx, mt_ld(logits, base + j));
    mx = mt_block_max(mx, sh);
    float s = 0.0f;
    for (int j = t; j < V; j += MT_XENT_THREADS) s += expf(mt_ld(logits, base + j) - mx);
    s = mt_block_sum(s, sh); /* its barriers also publish target_logit */

    if (t == 0 && losses) losses[row] = logf(s) - (target_logit - mx);
    if (!dlogits) return;
    /* as the CPU table forms it: softmax * dloss = e^(x - max) * (dloss /
     * sum), then dloss taken off at the target */
    const float scale = dloss / s;
    for (int j = t; j < Vp; j += MT_XENT_THREADS) {
        float d = 0.0f;
        if (j < V) {
            d = __fmul_rn(expf(mt_ld(logits, base + j) - mx), scale);
            if (j == target) d = __fsub_rn(d, dloss);
        }
        mt_st(dlogits, base + j, d);
    }
}
MT_EXPORT_DT(mt_xent, MT_XENT_THREADS, xent_k,
             (float *losses, void *dlogits, const void *logits, const int *targets, int V, int Vp,
              float dloss),
             (losses, dlogits, logits, targets, V, Vp, dloss))

/* The cross-entropy split by vocabulary over a tensor group
 * (lib/ops/kernels.h's xent_vp): logits (N,W) are the whole's columns [v0,
 * v0 + W), the first Vr real; stats (3,N). One block per row, xent_k's
 * reductions and formulas, one phase per launch. */
template <typename T>
__device__ __forceinline__ void xent_vp_k(int phase, float *stats, float *losses, void *dlogits_,
                                          const void *logits_, const int *targets, int n, int v0,
                                          int Vr, int W, float dloss)
{
    __shared__ float sh[32];
    const T *logits = (const T *)logits_;
    T *dlogits = (T *)dlogits_;
    const int row = blockIdx.x, t = threadIdx.x;
    const mt_index base = (mt_index)row * W;
    const int target = targets[row] - v0;
    const bool here = target >= 0 && target < Vr;
    if (phase == 0) {
        float mx = -INFINITY;
        for (int j = t; j < Vr; j += MT_XENT_THREADS) mx = fmaxf(mx, mt_ld(logits, base + j));
        mx = mt_block_max(mx, sh);
        if (t == 0) stats[row] = mx;
        return;
    }
    const float mx = stats[row];
    if (phase == 1) {
        float s = 0.0f;
        for (int j = t; j < Vr; j += MT_XENT_THREADS) s += expf(mt_ld(logits, base + j) - mx);
        s = mt_block_sum(s, sh);
        if (t == 0) {
            stats[n + row] = s;
            stats[2 * n + row] = here ? mt_ld(logits, base + target) : 0.0f;
        }
        return;
    }
    const float s = stats[n + row];
    if (t == 0 && losses) losses[row] = logf(s) - (stats[2 * n + row] - mx);
    if (!dlogits) return;
    const float scale = dloss / s;
    for (int j = t; j < W; j += MT_XENT_THREADS) {
        float d = 0.0f;
        if (j < Vr) {
            d = __fmul_rn(expf(mt_ld(logits, base + j) - mx), scale);
            if (j == target) d = __fsub_rn(d, dloss);
        }
        mt_st(dlogits, base + j, d);
    }
}
MT_EXPORT_DT(mt_xent_vp, MT_XENT_THREADS, xent_vp_k,
             (int phase, float *stats, float *losses, void *dlogits, const void *logits,
              const int *targets, int n, int v0, int Vr, int W, float dloss),
             (phase, stats, losses, dlogits, logits, targets, n, v0, Vr, W, dloss))

/* Distillation (lib/ops/kernels.h's xent_kd; the CPU's kd_row in
 * kernels/cpu/xent.c): student logits s (N,Vp) in T, teacher logits t
 * (N,tVp) fp32, V real columns each; alpha in (0, 1], temp > 0 (the host
 * takes alpha 0 to mt_xent and checks both). One block per row, three
 * sweeps as in mt_xent: the maxima of s and t; the four sums z1 = sum
 * e^(s - ms), zs = sum e^((s - ms)/T), zt = sum e^((t - mt)/T) and the KL's
 * cross term a = sum e^((t - mt)/T) ((t - mt)/T - (s - ms)/T), each thread
 * adding its columns in order and the block its thread sums in a fixed
 * tree; then the loss
 *   (1 - alpha)(log z1 - (s[target] - ms)) + alpha T^2 (a/zt - log zt + log zs)
 * and the gradient
 *   dloss ((1 - alpha) softmax(s) + alpha T (softmax(s/T) - softmax(t/T)))
 * less dloss (1 - alpha) at the target, 0 in the padding. The row's scalars
 * (loss, the three coefficients) are formed once, in double, by thread 0,
 * as the CPU forms them. Every element of s is read, then written, by the
 * same thread, and s[target] before any write, so dlogits may alias
 * logits; no probability row exists. grid N, block 512. */
template <typename T>
__device__ __forceinline__ void xent_kd_k(float *losses, void *dlogits_, const void *logits_,
                                          const float *tlogits, const int *targets, int V, int Vp,
                                          int tVp, float alpha, float temp, float dloss)
{
    __shared__ float sh[32];
    __shared__ float target_logit;
    __shared__ float coef[3];
    const T *logits = (const T *)logits_;
    T *dlogits = (T *)dlogits_;
    const int row = blockIdx.x, t = threadIdx.x;
    const mt_index base = (mt_index)row * Vp;
    const float *tl = tlogits + (mt_index)row * tVp;
    const int target = targets[row];
    if (t == 0) target_logit = mt_ld(logits, base + target);

    float ms = -INFINITY, mt = -INFINITY;
    for (int j = t; j < V; j += MT_XENT_THREADS) {
        ms = fmaxf(ms, mt_ld(logits, base + j));
        mt = fmaxf(mt, tl[j]);
    }
    ms = mt_block_max(ms, sh);
    mt = mt_block_max(mt, sh);
    const float inv = __fdiv_rn(1.0f, temp);
    float z1 = 0.0f, zs = 0.0f, zt = 0.0f, a = 0.0f;
    for (int j = t; j < V; j += MT_XENT_THREADS) {
        const float us = mt_ld(logits, base + j) - ms, ut = (tl[j] - mt) * inv;
        const float et = expf(ut);
        z1 += expf(us);
        zs += expf(us * inv);
        zt += et;
        a += et * (ut - us * inv);
    }
    z1 = mt_block_sum(z1, sh); /* its barriers also publish target_logit */
    zs = mt_block_sum(zs, sh);
    zt = mt_block_sum(zt, sh);
    a = mt_block_sum(a, sh);

    if (t == 0) {
        const double ce = log((double)z1) - (double)(target_logit - ms);
        const double kl = (double)a / zt - log((double)zt) + log((double)zs);
        if (losses)
            losses[row] = (float)((1.0 - alpha) * ce + (double)alpha * temp * temp * kl);
        coef[0] = (float)((1.0 - alpha) * dloss / z1);
        coef[1] = (float)((double)alpha * temp * dloss / zs);
        coef[2] = (float)((double)alpha * temp * dloss / zt);
    }
    if (!dlogits) return;
    __syncthreads();
    const float c1 = coef[0], cs = coef[1], ct = coef[2];
    const float hard = (1.0f - alpha) * dloss;
    for (int j = t; j < Vp; j += MT_XENT_THREADS) {
        float d = 0.0f;
        if (j < V) {
            const float us = mt_ld(logits, base + j) - ms;
            d = c1 * expf(us) + cs * expf(us * inv) - ct * expf((tl[j] - mt) * inv);
            if (j == target) d -= hard;
        }
        mt_st(dlogits, base + j, d);
    }
}
MT_EXPORT_DT(mt_xent_kd, MT_XENT_THREADS, xent_kd_k,
             (float *losses, void *dlogits, const void *logits, const float *tlogits,
              const int *targets, int V, int Vp, int tVp, float alpha, float temp, float dloss),
             (losses, dlogits, logits, tlogits, targets, V, Vp, tVp, alpha, temp, dloss))
