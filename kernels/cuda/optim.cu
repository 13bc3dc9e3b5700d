/*
 * optim.cu - mixed-precision unscaling and the optimizer updates: fp32
 * master weights p, fp32 gradients g, fp32 state, one pass over n elements
 * (grid-stride), optionally refreshing the compute copy pc in pc_dt in the
 * same pass (rounded to nearest even), so the weights are read once per
 * step.
 *
 * The updates are written with explicitly rounded operations (__fmul_rn,
 * __fadd_rn, ...: the compiler may not fuse them into multiply-adds) in the
 * order of kernels/cpu/optim.c, and the host passes the same fp32 scalars
 * the CPU table makes, so both tables step the weights to the same bits.
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
        bad |= (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u;
        if (inv_scale != 1.0f) g[i] = __fmul_rn(v, inv_scale); /* 1: a check, read only */
    }
    if (__any_sync(MT_FULL_MASK, bad) && (threadIdx.x & 31) == 0) *found_inf = 1;
}

/* SGD as torch.optim.SGD (lib/ops/kernels.h): d = g * grad_scale + wd * p;
 * with a momentum buffer m (NULL when momentum is 0): m = first_step ? d :
 * momentum m + damp1 d (damp1 = 1 - dampening), d = nesterov ? d +
 * momentum m : m; then p = p - lr d. pc NULL when there is no compute copy. */
extern "C" __global__ void __launch_bounds__(256)
    mt_sgd(float *p, const float *g, float *m, void *pc, int pc_dt, mt_index n, float lr,
           float momentum, float damp1, float weight_decay, int nesterov, int first_step,
           float grad_scale)
{
    MT_FOR_EACH(i, n)
    {
        float w = p[i];
        float d = __fadd_rn(__fmul_rn(g[i], grad_scale), __fmul_rn(weight_decay, w));
        if (m) {
            float b = first_step ? d : __fadd_rn(__fmul_rn(momentum, m[i]), __fmul_rn(damp1, d));
            m[i] = b;
            d = nesterov ? __fadd_rn(d, __fmul_rn(momentum, b)) : b;
        }
        w = __fsub_rn(w, __fmul_rn(lr, d));
        p[i] = w;
        if (pc) store_copy(pc, pc_dt, i, w);
    }
}

/* AdamW as torch.optim.AdamW (lib/ops/kernels.h), with the step's scalars made
 * by the host as torch makes them: step_size = lr / (1 - beta1^t),
 * bc2_sqrt = sqrt(1 - beta2^t), decay = 1 - lr wd. g = g * grad_scale;
 * m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
 * p = p decay - step_size (m / (sqrt(v) / bc2_sqrt + eps)). */
extern "C" __global__ void __launch_bounds__(256)
    mt_adamw(float *p, const float *g, float *m, float *v, void *pc, int pc_dt, mt_index n,
             float beta1, float beta2, float eps, float grad_scale, float decay, float step_size,
             float bc2_sqrt)
{
    const float c1 = __fsub_rn(1.0f, beta1), c2 = __fsub_rn(1.0f, beta2);
    MT_FOR_EACH(i, n)
    {
        float gv = __fmul_rn(g[i], grad_scale);
        float mv = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(c1, gv));
        float vv = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(c2, gv), gv));
        m[i] = mv;
        v[i] = vv;
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), bc2_sqrt), eps);
        float w = __fsub_rn(__fmul_rn(p[i], decay), __fmul_rn(step_size, __fdiv_rn(mv, denom)));
        p[i] = w;
        if (pc) store_copy(pc, pc_dt, i, w);
    }
}
