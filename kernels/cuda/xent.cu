/*
 * xent.cu - softmax cross-entropy over a padded vocabulary, fused with its
 * gradient. One block per row (512 threads): the row's maximum (exact in
 * any order), then the sum of exp(logit - max) with thread t adding columns
 * t, t + 512, ... in order and the block adding the thread sums in a fixed
 * tree, then the loss, then, with dlogits, the gradient written over the
 * row. The target's logit is read before any gradient is written, and every
 * other element is read by the thread that then writes it, so dlogits may
 * alias logits and no probability tensor exists.
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
