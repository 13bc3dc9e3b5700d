/*
 * optim.cu - mixed-precision unscaling and the optimizer updates: fp32
 * master weights p, fp32 gradients g, fp32 state, one pass over n elements
 * (grid-stride), optionally refreshing the compute copy pc in pc_dt in the
 * same pass (rounded to nearest even), so the weights are read once per
 * step.
 */

/* pc[i] = v rounded to pc_dt (the dtype is uniform over the launch). */
__device__ __forceinline__ void store_copy(void *pc, int pc_dt, mt_index i, float v)
{
    switch (pc_dt) {
    case MT_DT_F32: ((float *)pc)[i] = v; break;
    case MT_DT_F16: mt_st((__half *)pc, i, v); break;
    case MT_DT_BF16: mt_st((__nv_bfloat16 *)pc, i, v); break;
    }
}

/* g (n) *= inv_scale; *found_inf = 1 if any g was inf or NaN before the
 * scaling (as torch's unscale checks). The flag is only ever set, by one
 * plain store per warp that saw one: every writer writes the same 1, so
 * the result does not depend on timing. grid-stride, block 256. */
extern "C" __global__ void __launch_bounds__(256)
    mt_unscale_check(float *g, mt_index n, float inv_scale, int *found_inf)
{
    int bad = 0;
    MT_FOR_EACH(i, n)
    {
        float v = g[i];
        bad |= !isfinite(v);
        g[i] = v * inv_scale;
    }
    if (__any_sync(MT_FULL_MASK, bad) && (threadIdx.x & 31) == 0) *found_inf = 1;
}

/* SGD as torch.optim.SGD (lib/kernels.h): d = g * grad_scale + wd * p;
 * with momentum > 0: m = first_step ? d : momentum m + (1 - dampening) d,
 * d = nesterov ? d + momentum m : m; then p -= lr d. m may be NULL when
 * momentum is 0; pc NULL when there is no compute copy. */
extern "C" __global__ void __launch_bounds__(256)
    mt_sgd(float *p, const float *g, float *m, void *pc, int pc_dt, mt_index n, float lr,
           float momentum, float dampening, float weight_decay, int nesterov, int first_step,
           float grad_scale)
{
    MT_FOR_EACH(i, n)
    {
        float w = p[i];
        float d = g[i] * grad_scale + weight_decay * w;
        if (momentum > 0.0f) {
            float b = first_step ? d : momentum * m[i] + (1.0f - dampening) * d;
            m[i] = b;
            d = nesterov ? d + momentum * b : b;
        }
        w -= lr * d;
        p[i] = w;
        if (pc) store_copy(pc, pc_dt, i, w);
    }
}

/* AdamW as torch.optim.AdamW (lib/kernels.h). The host passes the bias
 * corrections of step t: bc1 = 1 - beta1^t and sqrt_bc2 = sqrt(1 - beta2^t).
 * g = g * grad_scale; p *= 1 - lr wd; m = b1 m + (1 - b1) g;
 * v = b2 v + (1 - b2) g^2; p -= lr / bc1 * m / (sqrt(v) / sqrt_bc2 + eps). */
extern "C" __global__ void __launch_bounds__(256)
    mt_adamw(float *p, const float *g, float *m, float *v, void *pc, int pc_dt, mt_index n,
             float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale,
             float bc1, float sqrt_bc2)
{
    const float step_size = lr / bc1;
    const float decay = 1.0f - lr * weight_decay;
    MT_FOR_EACH(i, n)
    {
        float gi = g[i] * grad_scale;
        float w = p[i] * decay;
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w -= step_size * mi / (sqrtf(vi) / sqrt_bc2 + eps);
        p[i] = w;
        if (pc) store_copy(pc, pc_dt, i, w);
    }
}
