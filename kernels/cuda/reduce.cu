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
 * rows in order. With a single chunk the thread adds straight into the
 * output, starting from the output's value, which is the order a CPU loop
 * `out[c] += x[r][c]` for r = 0, 1, ... has. With several chunks each
 * writes its partial sum to a workspace (nchunks, cols), and mt_colsum_finish
 * adds the partials in chunk order and then adds that into the output.
 */

/* out (cols) fp32 += sum over rows of x (rows, cols) in T.
 * grid (ceil(cols / 256), nchunks), block 256. part: NULL when nchunks is
 * 1, else (nchunks, cols) fp32 partials (mt_colsum_finish completes). */
template <typename T>
__device__ __forceinline__ void colsum_k(float *out, float *part, const void *x_, int rows,
                                         long long cols, int chunk)
{
    const T *x = (const T *)x_;
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const int r0 = blockIdx.y * chunk;
    const int r1 = min(rows, r0 + chunk);
    float acc = part ? 0.0f : out[c];
    for (int r = r0; r < r1; r++) acc += mt_ld(x, (mt_index)r * cols + c);
    if (part)
        part[(long long)blockIdx.y * cols + c] = acc;
    else
        out[c] = acc;
}
MT_EXPORT_DT(mt_colsum, 256, colsum_k,
             (float *out, float *part, const void *x, int rows, long long cols, int chunk),
             (out, part, x, rows, cols, chunk))

/* out (cols) += sum over k of part (nchunks, cols), k in order.
 * grid ceil(cols / 256), block 256. */
extern "C" __global__ void __launch_bounds__(256)
    mt_colsum_finish(float *out, const float *part, int nchunks, long long cols)
{
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float acc = 0.0f;
    for (int k = 0; k < nchunks; k++) acc += part[(long long)k * cols + c];
    out[c] += acc;
}

/* ---- sum of squares ---- */

/* Elements per block of the first pass: 256 threads x 16 each. The host
 * uses the same figure (MTI_SUMSQ_CHUNK in lib/ops_cuda.c). */
#define MT_SUMSQ_THREADS 256
#define MT_SUMSQ_PER_THREAD 16
#define MT_SUMSQ_CHUNK (MT_SUMSQ_THREADS * MT_SUMSQ_PER_THREAD)

/* Block k sums g^2 over [k * 4096, (k + 1) * 4096): thread t takes elements
 * t, t + 256, ... of the chunk in order (coalesced), then the block adds the
 * threads' sums in a fixed tree. With one block the result goes to *out,
 * else to part[k]. grid ceil(n / 4096), block 256. */
extern "C" __global__ void __launch_bounds__(MT_SUMSQ_THREADS)
    mt_sumsq_part(float *part, float *out, const float *g, mt_index n)
{
    __shared__ float sh[32];
    const mt_index base = (mt_index)blockIdx.x * MT_SUMSQ_CHUNK + threadIdx.x;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < MT_SUMSQ_PER_THREAD; j++) {
        mt_index i = base + (mt_index)j * MT_SUMSQ_THREADS;
        if (i < n) {
            float v = g[i];
            acc = fmaf(v, v, acc);
        }
    }
    acc = mt_block_sum(acc, sh);
    if (threadIdx.x == 0) {
        if (gridDim.x == 1)
            *out = acc;
        else
            part[blockIdx.x] = acc;
    }
}

/* *out = sum of part (nparts): thread t adds parts t, t + 256, ... in
 * order, then the block's fixed tree. grid 1, block 256. */
extern "C" __global__ void __launch_bounds__(MT_SUMSQ_THREADS)
    mt_sumsq_finish(float *out, const float *part, mt_index nparts)
{
    __shared__ float sh[32];
    float acc = 0.0f;
    for (mt_index i = threadIdx.x; i < nparts; i += MT_SUMSQ_THREADS) acc += part[i];
    acc = mt_block_sum(acc, sh);
    if (threadIdx.x == 0) *out = acc;
}
