/*
 * layernorm.cu - layer normalisation over the last dimension, eps 1e-5.
 *
 * Forward and the input gradient: one warp per row (8 rows per block of
 * 256). Lane l takes channels l, l + 32, ... in order and the warp adds the
 * 32 lane sums by butterfly, a fixed order. Mean and variance are two
 * passes (the variance from the centred values, not E[x^2] - mean^2).
 *
 * Weight and bias gradients: a column sum over rows, as reduce.cu's (one
 * thread per channel and chunk of rows, rows in order, then the chunks in
 * order by mt_colsum_finish), so they are deterministic without atomics.
 */

#define MT_LN_EPS 1e-5f
#define MT_LN_ROWS_PER_BLOCK 8

/* out (N,C) = (x - mean) * rstd * w + b; mean, rstd (N) fp32, each may be
 * NULL. grid ceil(N / 8), block 256. */
template <typename T>
__device__ __forceinline__ void ln_fwd_k(void *out_, float *mean, float *rstd, const void *x_,
                                         const void *w_, const void *b_, int N, int C)
{
    T *out = (T *)out_;
    const T *x = (const T *)x_, *w = (const T *)w_, *b = (const T *)b_;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MT_LN_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= N) return; /* the whole warp leaves together */
    const mt_index base = (mt_index)row * C;
    float s = 0.0f;
    for (int c = lane; c < C; c += 32) s += mt_ld(x, base + c);
    const float m = mt_group_sum<32>(s) / (float)C;
    float q = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float d = mt_ld(x, base + c) - m;
        q = fmaf(d, d, q);
    }
    const float var = mt_group_sum<32>(q) / (float)C;
    const float r = 1.0f / sqrtf(var + MT_LN_EPS);
    for (int c = lane; c < C; c += 32) {
        float nrm = (mt_ld(x, base + c) - m) * r;
        mt_st(out, base + c, nrm * mt_ld(w, c) + mt_ld(b, c));
    }
    if (lane == 0) {
        if (mean) mean[row] = m;
        if (rstd) rstd[row] = r;
    }
}
MT_EXPORT_DT(mt_ln_fwd, 256, ln_fwd_k,
             (void *out, float *mean, float *rstd, const void *x, const void *w, const void *b,
              int N, int C),
             (out, mean, rstd, x, w, b, N, C))

/* dx (N,C) = (or += with accumulate) rstd * (g - mean(g) - xhat * mean(g *
 * xhat)), g = dout * w, xhat = (x - mean) * rstd. Each element is read
 * before its lane writes it, after the whole row's sums, so dx may even
 * alias dout. grid ceil(N / 8), block 256. */
template <typename T>
__device__ __forceinline__ void ln_bwd_dx_k(void *dx_, const void *dout_, const void *x_,
                                            const void *w_, const float *mean,
                                            const float *rstd, int N, int C, int accumulate)
{
    T *dx = (T *)dx_;
    const T *dout = (const T *)dout_, *x = (const T *)x_, *w = (const T *)w_;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MT_LN_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= N) return;
    const mt_index base = (mt_index)row * C;
    const float m = mean[row], r = rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float g = mt_ld(dout, base + c) * mt_ld(w, c);
        float xh = (mt_ld(x, base + c) - m) * r;
        sg += g;
        sgx = fmaf(g, xh, sgx);
    }
    const float mg = mt_group_sum<32>(sg) / (float)C;
    const float mgx = mt_group_sum<32>(sgx) / (float)C;
    for (int c = lane; c < C; c += 32) {
        float g = mt_ld(dout, base + c) * mt_ld(w, c);
        float xh = (mt_ld(x, base + c) - m) * r;
        float d = (g - mg - xh * mgx) * r;
        if (accumulate) d += mt_ld(dx, base + c);
        mt_st(dx, base + c, d);
    }
}
MT_EXPORT_DT(mt_ln_bwd_dx, 256, ln_bwd_dx_k,
             (void *dx, const void *dout, const void *x, const void *w, const float *mean,
              const float *rstd, int N, int C, int accumulate),
             (dx, dout, x, w, mean, rstd, N, C, accumulate))

/* dw (C) += sum over rows of dout * xhat, db (C) += sum over rows of dout,
 * fp32, rows of the block's chunk in order. grid (ceil(C / 256), nchunks),
 * block 256. part_w, part_b: NULL with one chunk (add straight into dw, db,
 * starting from their values), else (nchunks, C) partials for
 * mt_colsum_finish. dw or db may be NULL (not wanted). */
template <typename T>
__device__ __forceinline__ void ln_bwd_dwdb_k(float *dw, float *db, float *part_w, float *part_b,
                                              const void *dout_, const void *x_,
                                              const float *mean, const float *rstd, int N, int C,
                                              int chunk)
{
    const T *dout = (const T *)dout_, *x = (const T *)x_;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int r0 = blockIdx.y * chunk, r1 = min(N, r0 + chunk);
    const bool direct = part_w == NULL;
    float aw = direct && dw ? dw[c] : 0.0f, ab = direct && db ? db[c] : 0.0f;
    for (int r = r0; r < r1; r++) {
        const mt_index i = (mt_index)r * C + c;
        float g = mt_ld(dout, i);
        float xh = (mt_ld(x, i) - mean[r]) * rstd[r];
        aw = fmaf(g, xh, aw);
        ab += g;
    }
    if (direct) {
        if (dw) dw[c] = aw;
        if (db) db[c] = ab;
    } else {
        part_w[(mt_index)blockIdx.y * C + c] = aw;
        part_b[(mt_index)blockIdx.y * C + c] = ab;
    }
}
MT_EXPORT_DT(mt_ln_bwd_dwdb, 256, ln_bwd_dwdb_k,
             (float *dw, float *db, float *part_w, float *part_b, const void *dout, const void *x,
              const float *mean, const float *rstd, int N, int C, int chunk),
             (dw, db, part_w, part_b, dout, x, mean, rstd, N, C, chunk))
