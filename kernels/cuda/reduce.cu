/*
 * reduce.cu - deterministic sums over rows: column sums (matmul's db,
 * embedding's dwpe) and the sum of squares (global norm).
 *
 * No float atomics anywhere: every sum has one owner thread and a fixed
 * order that depends only on the shape, never on the grid the device
 * happens to run or on timing, so two runs (and two GPUs) agree bit for bit.
 *
 * Column sums cut the rows into chunks of `chunk` rows (chosen by the host
 * from the row count alone). One thread per (column, chunk) adds its chunk's
 * rows in order, from zero. With a single chunk the thread then adds that
 * sum to the output, which is what the CPU table does (a column's rows
 * summed in order, then added once), so up to one chunk of rows the two
 * tables give the same bits. With several chunks each writes its partial
 * sum to a workspace (nchunks, cols), and mt_colsum_finish adds the partials
 * in chunk order and then adds that into the output.
 */

/* out (cols) fp32 += (with set, =) sum over rows of x (rows, cols) in T.
 * grid (ceil(cols / 256), nchunks), block 256. part: NULL when nchunks is
 * 1, else (nchunks, cols) fp32 partials (mt_colsum_finish completes). */
template <typename T>
__device__ __forceinline__ void colsum_k(float *out, float *part, const void *x_, int rows,
                                         long long cols, int chunk, int set)
{
    const T *x = (const T *)x_;
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const int r0 = blockIdx.y * chunk;
    const int r1 = min(rows, r0 + chunk);
    float acc = 0.0f;
    for (int r = r0; r < r1; r++) acc = __fadd_rn(acc, mt_ld(x, (mt_index)r * cols + c));
    if (part)
        part[(long long)blockIdx.y * cols + c] = acc;
    else
        out[c] = set ? acc : __fadd_rn(out[c], acc);
}
MT_EXPORT_DT(mt_colsum, 256, colsum_k,
             (float *out, float *part, const void *x, int rows, long long cols, int chunk,
              int set),
             (out, part, x, rows, cols, chunk, set))

/* out (cols) += (with set, =) sum over k of part (nchunks, cols), k in
 * order. grid ceil(cols / 256), block 256. */
extern "C" __global__ void __launch_bounds__(256)
    mt_colsum_finish(float *out, const float *part, int nchunks, long long cols, int set)
{
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float acc = 0.0f;
    for (int k = 0; k < nchunks; k++) acc = __fadd_rn(acc, part[(long long)k * cols + c]);
    out[c] = set ? acc : __fadd_rn(out[c], acc);
}

/* ---- sum of squares ----
 *
 * The order of kernels/cpu/optim.c, so both tables give the same bits:
 * blocks of 4096 elements; in a block, lane l of 16 adds g^2 for elements
 * l, l + 16, ... in order (each square rounded, then added: no fused
 * multiply-add), and the 16 lane sums are added in the tree l += l + 8,
 * l += l + 4, l += l + 2, l += l + 1. The block sums are taken in rounds of
 * 64 blocks; within a round they are added pairwise (w = 1, 2, 4, ...:
 * s[i] += s[i + w] for i a multiple of 2w), and the rounds' sums are added
 * in order onto the value already in *out.
 *
 *   mt_sumsq_blocks  block sums: 16 threads per block of 4096 elements
 *   mt_sumsq_rounds  one CUDA block per round: the pairwise tree; with a
 *                    single round it writes the result
 *   mt_sumsq_total   the rounds in order, when there are several
 */
#define MT_SUMSQ_BLOCK 4096
#define MT_SUMSQ_LANES 16
#define MT_SUMSQ_ROUND 64

/* bsum (nblocks) = the block sums of g (n). grid ceil(nblocks / 16),
 * block 256 (16 element blocks per thread block). */
extern "C" __global__ void __launch_bounds__(256)
    mt_sumsq_blocks(float *bsum, const float *g, mt_index n)
{
    const int l = threadIdx.x % MT_SUMSQ_LANES;
    const mt_index blk = (mt_index)blockIdx.x * (256 / MT_SUMSQ_LANES) + threadIdx.x / MT_SUMSQ_LANES;
    const mt_index nblocks = (n + MT_SUMSQ_BLOCK - 1) / MT_SUMSQ_BLOCK;
    const mt_index first = blk * MT_SUMSQ_BLOCK;
    float acc = 0.0f;
    if (blk < nblocks) {
        const mt_index end = min(n, first + MT_SUMSQ_BLOCK);
        for (mt_index i = first + l; i < end; i += MT_SUMSQ_LANES) {
            float v = g[i];
            acc = __fadd_rn(acc, __fmul_rn(v, v));
        }
    }
#pragma unroll
    for (int o = MT_SUMSQ_LANES / 2; o > 0; o >>= 1)
        acc = __fadd_rn(acc, __shfl_down_sync(MT_FULL_MASK, acc, o, MT_SUMSQ_LANES));
    if (l == 0 && blk < nblocks) bsum[blk] = acc;
}

/* rsum (nrounds) = each round's pairwise tree of bsum (nblocks); with one
 * round *out += that sum instead. grid nrounds, block MT_SUMSQ_ROUND. */
extern "C" __global__ void __launch_bounds__(MT_SUMSQ_ROUND)
    mt_sumsq_rounds(float *rsum, float *out, const float *bsum, mt_index nblocks)
{
    __shared__ float s[MT_SUMSQ_ROUND];
    const mt_index b0 = (mt_index)blockIdx.x * MT_SUMSQ_ROUND;
    const int nb = (int)min((mt_index)MT_SUMSQ_ROUND, nblocks - b0);
    const int i = threadIdx.x;
    s[i] = i < nb ? bsum[b0 + i] : 0.0f;
    for (int w = 1; w < nb; w *= 2) {
        __syncthreads();
        if (i % (2 * w) == 0 && i + w < nb) s[i] = __fadd_rn(s[i], s[i + w]);
    }
    if (i == 0) {
        if (gridDim.x == 1)
            *out = __fadd_rn(*out, s[0]);
        else
            rsum[blockIdx.x] = s[0];
    }
}

/* *out += rsum[0], then rsum[1], ... in order. grid 1, block 32. */
extern "C" __global__ void __launch_bounds__(32)
    mt_sumsq_total(float *out, const float *rsum, mt_index nrounds)
{
    if (threadIdx.x != 0) return;
    float total = *out;
    for (mt_index r = 0; r < nrounds; r++) total = __fadd_rn(total, rsum[r]);
    *out = total;
}
