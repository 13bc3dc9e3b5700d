/*
 * optim4.cu - 4-bit AdamW (the contract is in lib/ops/kernels.h, the adamw4
 * op; the CPU version in kernels/cpu/optim4.c).
 *
 * mt_adamw4_maxima (matrices only): every new v from the old codes, the old
 * rank-1 scales and g, max-reduced into the new row and column maxima
 * (atomicMax on the bits: the values are non-negative, so their bits order
 * as they do; the maximum is exact whatever the order).
 * mt_adamw4: one CUDA block of 128 threads per quantization block of 128
 * elements, one element per thread: m, v, p; the block's new absmax of m
 * (and of v for a vector); the codes, packed by the even thread of each
 * pair. The host then copies the new maxima into the state.
 *
 * Every operation is an explicitly rounded one in the CPU's order, the
 * maxima are exact and the host passes the CPU's fp32 scalars, so both
 * tables give the same parameters, codes and scales bit for bit.
 */

#define MT_Q4_BLOCK 128

struct mt_q4_maps {
    float m[16];
    float v[16];
};

__device__ __forceinline__ unsigned mt_q4_nib(const unsigned char *q, mt_index i)
{
    return (i & 1) ? (q[i >> 1] >> 4) : (q[i >> 1] & 15u);
}

/* The nearest level: the count of midpoints strictly below x. */
__device__ __forceinline__ unsigned mt_q4_code(const float *mid, float x)
{
    unsigned r = 0;
#pragma unroll
    for (int k = 0; k < 15; k++) r += x > mid[k] ? 1u : 0u;
    return r;
}

__device__ __forceinline__ float mt_q4_vnew(float code, float scale, float gv, float b2, float c2)
{
    return __fadd_rn(__fmul_rn(b2, __fmul_rn(code, scale)), __fmul_rn(__fmul_rn(c2, gv), gv));
}

/* rowmax, colmax (rows + cols, zeroed by the host) = the maxima of the
 * new v of a rows x cols matrix; scale_v holds the old ones. */
extern "C" __global__ void __launch_bounds__(256)
    mt_adamw4_maxima(const float *g, const unsigned char *qv, const float *scale_v,
                     unsigned *rowmax, unsigned *colmax, mt_index rows, mt_index cols, float gs,
                     float b2, float c2, const __grid_constant__ mt_q4_maps maps)
{
    const mt_index n = rows * cols;
    for (mt_index i = (mt_index)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (mt_index)gridDim.x * blockDim.x) {
        const mt_index r = i / cols, c = i % cols;
        float gv = __fmul_rn(g[i], gs), v = 0.0f;
        if (isfinite(gv))
            v = mt_q4_vnew(maps.v[mt_q4_nib(qv, i)], fminf(scale_v[r], scale_v[rows + c]), gv, b2,
                           c2);
        atomicMax(rowmax + r, __float_as_uint(v));
        atomicMax(colmax + c, __float_as_uint(v));
    }
}

/* p, g (n) fp32; qm, qv (ceil(n / 2)) codes; absmax_m (blocks); scale_v:
 * rank1 the old row and column maxima (rows + cols), else the blocks'
 * absmax of v (written here); newmax: rank1 the new maxima (rows + cols),
 * else unused. pc (n) in pc_dt or NULL. The scalars are the CPU's. */
extern "C" __global__ void __launch_bounds__(MT_Q4_BLOCK)
    mt_adamw4(float *p, const float *g, unsigned char *qm, float *absmax_m, unsigned char *qv,
              float *scale_v, const float *newmax, void *pc, int pc_dt, mt_index n,
              mt_index rows, mt_index cols, int rank1, float b1, float b2, float c1, float c2,
              float gs, float eps, float step_size, float bc2_sqrt, float decay,
              const __grid_constant__ mt_q4_maps maps)
{
    __shared__ float mid_m[16], mid_v[16], red[32];
    __shared__ unsigned char cm[MT_Q4_BLOCK], cv[MT_Q4_BLOCK];
    const unsigned t = threadIdx.x;
    if (t < 15) {
        mid_m[t] = __fmul_rn(__fadd_rn(maps.m[t], maps.m[t + 1]), 0.5f);
        mid_v[t] = __fmul_rn(__fadd_rn(maps.v[t], maps.v[t + 1]), 0.5f);
    }
    __syncthreads();
    const mt_index nblocks = (n + MT_Q4_BLOCK - 1) / MT_Q4_BLOCK;
    for (mt_index b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const mt_index i = b * MT_Q4_BLOCK + t;
        const bool in = i < n;
        const float am = absmax_m[b], svb = rank1 ? 0.0f : scale_v[b];
        float m = 0.0f, v = 0.0f;
        if (in) {
            float gv = __fmul_rn(g[i], gs);
            if (isfinite(gv)) {
                float scale = rank1 ? fminf(scale_v[i / cols], scale_v[rows + i % cols]) : svb;
                m = __fadd_rn(__fmul_rn(b1, __fmul_rn(maps.m[mt_q4_nib(qm, i)], am)),
                              __fmul_rn(c1, gv));
                v = mt_q4_vnew(maps.v[mt_q4_nib(qv, i)], scale, gv, b2, c2);
                float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bc2_sqrt), eps);
                p[i] = __fsub_rn(__fmul_rn(p[i], decay), __fmul_rn(step_size, __fdiv_rn(m, denom)));
            }
            if (pc) store_copy(pc, pc_dt, i, p[i]);
        }
        /* every thread has read this block's old scales before the first
         * barrier of the reductions */
        const float nm = mt_block_max(fabsf(m), red);
        const float nv = rank1 ? 0.0f : mt_block_max(v, red);
        if (t == 0) {
            absmax_m[b] = nm;
            if (!rank1) scale_v[b] = nv;
        }
        unsigned qmc = 7u, qvc = 0u; /* the fresh state's codes, also the pads */
        if (in) {
            if (nm != 0.0f) qmc = mt_q4_code(mid_m, __fdiv_rn(m, nm));
            float s = rank1 ? fminf(newmax[i / cols], newmax[rows + i % cols]) : nv;
            if (s != 0.0f) qvc = mt_q4_code(mid_v, __fdiv_rn(v, s));
        }
        cm[t] = (unsigned char)qmc;
        cv[t] = (unsigned char)qvc;
        __syncthreads();
        if (in && !(t & 1)) {
            qm[i >> 1] = (unsigned char)(cm[t] | cm[t + 1] << 4);
            qv[i >> 1] = (unsigned char)(cv[t] | cv[t + 1] << 4);
        }
        __syncthreads();
    }
}
