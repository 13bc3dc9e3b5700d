/*
 * optim8.cu - 8-bit blockwise AdamW (bitsandbytes' AdamW8bit; the contract
 * is in lib/ops/kernels.h, the CPU version in kernels/cpu/optim8.c).
 *
 * One CUDA block of 256 threads per quantization block of 256 elements
 * (MTI_Q8_BLOCK), one element per thread, grid-stride over the blocks. The
 * two maps come by value in the kernel's parameters (a __grid_constant__
 * struct of 2 KiB, read in place); each CUDA block copies them to shared
 * memory and makes the 255 decision thresholds of each, as the CPU does.
 *
 * Every operation is an explicitly rounded one in the CPU's order, the
 * absmax is an exact maximum, and the host passes the CPU's fp32 scalars,
 * so both tables give the same parameters, codes and absmax bit for bit.
 */

#define MT_Q8_BLOCK 256

/* The signed (first moment) and unsigned (second moment) maps. */
struct mt_q8_maps {
    float m[256];
    float v[256];
};

/* The code of x: the count of thresholds below it (8 halvings). */
__device__ __forceinline__ unsigned mt_q8_search(const float *bound, float x)
{
    unsigned r = 0;
#pragma unroll
    for (unsigned s = 128; s; s >>= 1) r += x > bound[r + s - 1] ? s : 0u;
    return r;
}

/* p, g (n) fp32; qm, qv (n) codes; absmax_m, absmax_v (ceil(n / 256));
 * pc (n) in pc_dt or NULL. The scalars are the CPU's: c1 = 1 - b1,
 * c2 = 1 - b2, step_size = -lr sqrt(1 - b2^t) / (1 - b1^t),
 * eps_c2 = eps sqrt(1 - b2^t), decay = 1 - lr wd. Block 256. */
extern "C" __global__ void __launch_bounds__(MT_Q8_BLOCK)
    mt_adamw8(float *p, const float *g, unsigned char *qm, unsigned char *qv, float *absmax_m,
              float *absmax_v, void *pc, int pc_dt, mt_index n, float b1, float b2, float c1,
              float c2, float gs, float step_size, float eps_c2, float decay,
              const __grid_constant__ mt_q8_maps maps)
{
    __shared__ float code_m[256], code_v[256], bound_m[256], bound_v[256];
    __shared__ float red[32];
    const unsigned t = threadIdx.x;
    code_m[t] = maps.m[t];
    code_v[t] = maps.v[t];
    __syncthreads();
    if (t < 255) {
        /* the midpoint for even t, the float below it for odd t (ties go
         * to the even code, as bitsandbytes' search sends them) */
        float mm = __fmul_rn(__fadd_rn(code_m[t], code_m[t + 1]), 0.5f);
        float mv = __fmul_rn(__fadd_rn(code_v[t], code_v[t + 1]), 0.5f);
        bound_m[t] = (t & 1) ? nextafterf(mm, -INFINITY) : mm;
        bound_v[t] = (t & 1) ? nextafterf(mv, -INFINITY) : mv;
    }
    __syncthreads();
    const mt_index nblocks = (n + MT_Q8_BLOCK - 1) / MT_Q8_BLOCK;
    for (mt_index b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const mt_index i = b * MT_Q8_BLOCK + t;
        const bool in = i < n;
        const float am = absmax_m[b], av = absmax_v[b];
        float m = 0.0f, v = 0.0f;
        if (in) {
            float gv = __fmul_rn(g[i], gs);
            if (isfinite(gv)) {
                m = __fadd_rn(__fmul_rn(b1, __fmul_rn(code_m[qm[i]], am)), __fmul_rn(c1, gv));
                v = __fadd_rn(__fmul_rn(b2, __fmul_rn(code_v[qv[i]], av)),
                              __fmul_rn(__fmul_rn(c2, gv), gv));
                float d = __fadd_rn(__fsqrt_rn(v), eps_c2);
                float w = __fmul_rn(__fadd_rn(p[i], __fmul_rn(step_size, __fdiv_rn(m, d))), decay);
                p[i] = w;
            }
            if (pc) store_copy(pc, pc_dt, i, p[i]);
        }
        /* the new absmax: an exact maximum of |value| (NaN counted as 0,
         * as the CPU does); every thread has read this block's old absmax
         * before the reduction's first barrier */
        float nm = mt_block_max(isnan(m) ? 0.0f : fabsf(m), red);
        float nv = mt_block_max(isnan(v) ? 0.0f : fabsf(v), red);
        if (t == 0) {
            absmax_m[b] = nm;
            absmax_v[b] = nv;
        }
        if (in) {
            unsigned rm = 127u, rv = 0u; /* the zero codes, for a block of zeros */
            if (nm != 0.0f) {
                rm = mt_q8_search(bound_m, __fdiv_rn(m, nm));
                /* a code whose sign bit differs from the value's moves one
                 * step toward the value's sign (bytes wrap) */
                if (signbit(code_m[rm]) != signbit(m)) rm = (rm + (m > 0.0f ? 1u : 255u)) & 255u;
            }
            if (nv != 0.0f) rv = mt_q8_search(bound_v, __fdiv_rn(v, nv));
            qm[i] = (unsigned char)rm;
            qv[i] = (unsigned char)rv;
        }
    }
}
