/*
 * dequant.cu - a tile of a quantized frozen weight (lib/quant/quant.h: int8
 * blockwise absmax, NF4 with double-quantized absmax) dequantized into a
 * storage dtype, for the quantized matmuls of kernels/cuda/ops_cuda.c: the tile is
 * rows [r0, r0 + rows) x columns [c0, c0 + cols) of the (R, I) weight,
 * whose elements are quantized in row-major order, written as a (rows,
 * cols) matrix with leading dimension ld. Each value is mti_dequantize's
 * (lib/quant/quant.c) bit for bit: the arithmetic is dequant.cuh's, which the
 * stand-in driver's host twins run too; fp16 is that fp32 value rounded to
 * nearest even.
 *
 * Grid: x over columns in blocks of 256 threads, y over rows (strided when
 * there are more than 65535); one element per thread and row, so a warp
 * writes 32 consecutive outputs and reads 32 consecutive codes (int8) or
 * 16 bytes (NF4). NF4's two tables come by value in the parameters and are
 * copied to shared memory; the block absmax is formed per element (two
 * fp32 operations on values the cache holds).
 */

#include "dequant.cuh"

#define MT_DQ_THREADS 256

/* out (rows, cols; ld) in dt (0 fp32, 1 fp16, 2 bf16) from codes (R I
 * int8) and scale (ceil(R I / 64) fp32). */
extern "C" __global__ void __launch_bounds__(MT_DQ_THREADS)
    mt_dequant_int8(void *out, int dt, mt_index ld, const int8_t *codes, const float *scale,
                    mt_index I, mt_index r0, unsigned rows, mt_index c0, unsigned cols)
{
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    for (unsigned r = blockIdx.y; r < rows; r += gridDim.y) {
        const mt_index i = (r0 + r) * I + c0 + c;
        mt_dq_store(out, dt, (mt_index)r * ld + c, mt_dq_int8(codes, scale, i));
    }
}

/* out (rows, cols; ld) in dt from NF4 codes (ceil(R I / 2) bytes), the
 * absmax codes qabsmax (one per block of 64), absmax2 (one fp32 per 256
 * blocks) and the offset (one fp32), with the maps of mt_dq_maps. */
extern "C" __global__ void __launch_bounds__(MT_DQ_THREADS)
    mt_dequant_nf4(void *out, int dt, mt_index ld, const uint8_t *codes, const uint8_t *qabsmax,
                   const float *absmax2, const float *offset, mt_index I, mt_index r0,
                   unsigned rows, mt_index c0, unsigned cols, const __grid_constant__ mt_dq_maps maps)
{
    __shared__ float q8[256], nf4[16];
    for (unsigned t = threadIdx.x; t < 256; t += blockDim.x) q8[t] = maps.q8[t];
    if (threadIdx.x < 16) nf4[threadIdx.x] = maps.nf4[threadIdx.x];
    __syncthreads();
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const float off = *offset;
    for (unsigned r = blockIdx.y; r < rows; r += gridDim.y) {
        const mt_index i = (r0 + r) * I + c0 + c;
        const float am = mt_dq_nf4_absmax(qabsmax, absmax2, off, q8, i / MT_DQ_BLOCK);
        mt_dq_store(out, dt, (mt_index)r * ld + c, mt_dq_nf4(codes, nf4, am, i));
    }
}

/* The embedding from a quantized token table (embedding_fwd_q): out (B,T,C)
 * in dt = the table's row tok[b,t] (a (V,C) weight quantized in row-major
 * order, dequantized as above and rounded to dt) + wpe[t] (dt; NULL: no
 * positions), n = B T C elements, one per thread (grid-strided). */
extern "C" __global__ void __launch_bounds__(MT_DQ_THREADS)
    mt_emb_fwd_q_int8(void *out, int dt, const int *tok, const int8_t *codes, const float *scale,
                      const void *wpe, int T, int C, mt_index n)
{
    for (mt_index o = (mt_index)blockIdx.x * blockDim.x + threadIdx.x; o < n;
         o += (mt_index)gridDim.x * blockDim.x) {
        const mt_index r = o / (mt_index)C, c = o - r * (mt_index)C, t = r % (mt_index)T;
        const mt_index i = (mt_index)tok[r] * (mt_index)C + c;
        mt_dq_emb_store(out, dt, o, mt_dq_int8(codes, scale, i), wpe, t * (mt_index)C + c);
    }
}

extern "C" __global__ void __launch_bounds__(MT_DQ_THREADS)
    mt_emb_fwd_q_nf4(void *out, int dt, const int *tok, const uint8_t *codes,
                     const uint8_t *qabsmax, const float *absmax2, const float *offset,
                     const void *wpe, int T, int C, mt_index n,
                     const __grid_constant__ mt_dq_maps maps)
{
    __shared__ float q8[256], nf4[16];
    for (unsigned t = threadIdx.x; t < 256; t += blockDim.x) q8[t] = maps.q8[t];
    if (threadIdx.x < 16) nf4[threadIdx.x] = maps.nf4[threadIdx.x];
    __syncthreads();
    const float off = *offset;
    for (mt_index o = (mt_index)blockIdx.x * blockDim.x + threadIdx.x; o < n;
         o += (mt_index)gridDim.x * blockDim.x) {
        const mt_index r = o / (mt_index)C, c = o - r * (mt_index)C, t = r % (mt_index)T;
        const mt_index i = (mt_index)tok[r] * (mt_index)C + c;
        const float am = mt_dq_nf4_absmax(qabsmax, absmax2, off, q8, i / MT_DQ_BLOCK);
        mt_dq_emb_store(out, dt, o, mt_dq_nf4(codes, nf4, am, i), wpe, t * (mt_index)C + c);
    }
}
