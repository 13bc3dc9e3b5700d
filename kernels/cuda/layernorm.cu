/*
 * layernorm.cu - layer normalisation over the last dimension, eps 1e-5.
 *
 * Forward and the input gradient: a group of 16 lanes per row (two rows per
 * warp, 16 rows per block of 256). Row sums are taken in the order the CPU
 * table (kernels/cpu/layernorm.c) takes them: lane l adds channels l,
 * l + 16, l + 32, ... in order, then the 16 lane sums are added in the
 * tree l += l + 8, l += l + 4, l += l + 2, l += l + 1. With every product
 * and sum rounded on its own (no fused multiply-add, as the CPU code has
 * none), the forward's mean, rstd and output and the input gradient are the
 * CPU table's bits. Mean and variance are two passes (the variance from the
 * centred values).
 *
 * Weight and bias gradients: column sums over rows, as reduce.cu's (one
 * thread per channel and chunk of rows, rows in order from zero; chunks
 * added in order by mt_colsum_finish; the total added to dw, db once), so
 * they are deterministic without atomics. With up to 128 rows (one chunk)
 * that is the CPU's order too.
 */

#define MT_LN_EPS 1e-5f
#define MT_LN_LANES 16
#define MT_LN_ROWS_PER_BLOCK 16 /* 256 threads / 16 lanes */

/* The 16-lane tree of a lane group; the total is returned to every lane of
 * the group (all 32 lanes of the warp take part). */
__device__ __forceinline__ float ln_lanes_total(float v)
{
#pragma unroll
    for (int o = MT_LN_LANES / 2; o > 0; o >>= 1)
        v = __fadd_rn(v, __shfl_down_sync(MT_FULL_MASK, v, o, MT_LN_LANES));
    return __shfl_sync(MT_FULL_MASK, v, 0, MT_LN_LANES);
}

/* out (N,C) = (x - mean) * rstd * w + b; mean, rstd (N) fp32, each may be
 * NULL. grid ceil(N / 16), block 256. */
template <typename T>
__device__ __forceinline__ void ln_fwd_k(void *out_, float *mean, float *rstd, const void *x_,
                                         const void *w_, const void *b_, int N, int C)
{
    T *out = (T *)out_;
    const T *x = (const T *)x_, *w = (const T *)w_, *b = (const T *)b_;
    const int l = threadIdx.x % MT_LN_LANES;
    const int r = blockIdx.x * MT_LN_ROWS_PER_BLOCK + threadIdx.x / MT_LN_LANES;
    /* a row past N computes a copy of the last (both halves of a warp
     * shuffle together) and writes nothing */
    const bool live = r < N;
    const mt_index base = (mt_index)(live ? r : N - 1) * C;
    float s = 0.0f;
    for (int c = l; c < C; c += MT_LN_LANES) s = __fadd_rn(s, mt_ld(x, base + c));
    const float m = __fdiv_rn(ln_lanes_total(s), (float)C);
    float q = 0.0f;
    for (int c = l; c < C; c += MT_LN_LANES) {
        float d = __fsub_rn(mt_ld(x, base + c), m);
        q = __fadd_rn(q, __fmul_rn(d, d));
    }
    const float var = __fdiv_rn(ln_lanes_total(q), (float)C);
    const float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, MT_LN_EPS)));
    if (!live) return;
    for (int c = l; c < C; c += MT_LN_LANES) {
        float nrm = __fmul_rn(__fsub_rn(mt_ld(x, base + c), m), rs);
        mt_st(out, base + c, __fadd_rn(__fmul_rn(nrm, mt_ld(w, c)), mt_ld(b, c)));
    }
    if (l == 0) {
        if (mean) mean[r] = m;
        if (rstd) rstd[r] = rs;
    }
}
MT_EXPORT_DT(mt_ln_fwd, 256, ln_fwd_k,
             (void *out, float *mean, float *rstd, const void *x, const void *w, const void *b,
              int N, int C),
             (out, mean, rstd, x, w, b, N, C))

/* dx (N,C) = (or += with accumulate) rstd * (g - mean(g) - xhat * mean(g *
 * xhat)), g = dout * w, xhat = (x - mean) * rstd. Each element is read
 * before its lane writes it, after the whole row's sums, so dx may alias
 * dout. grid ceil(N / 16), block 256.
 *
 * A lane takes its channels MT_LN_UNROLL at a time, all of a group's loads
 * issued before its arithmetic and stores: dx may alias dout, so the
 * compiler may not move a load above an earlier store, and one element at a
 * time would wait out a memory latency per element. The sums still add
 * the channels in order, so the bits are the CPU table's. */
#define MT_LN_UNROLL 8
template <typename T>
__device__ __forceinline__ void ln_bwd_dx_k(void *dx_, const void *dout_, const void *x_,
                                            const void *w_, const float *mean,
                                            const float *rstd, int N, int C, int accumulate)
{
    T *dx = (T *)dx_;
    const T *dout = (const T *)dout_, *x = (const T *)x_, *w = (const T *)w_;
    const int l = threadIdx.x % MT_LN_LANES;
    const int r = blockIdx.x * MT_LN_ROWS_PER_BLOCK + threadIdx.x / MT_LN_LANES;
    const bool live = r < N;
    const int rc = live ? r : N - 1;
    const mt_index base = (mt_index)rc * C;
    const float m = mean[rc], rs = rstd[rc];
    float sa = 0.0f, sb = 0.0f;
    for (int c0 = l; c0 < C; c0 += MT_LN_LANES * MT_LN_UNROLL) {
        float g[MT_LN_UNROLL], xh[MT_LN_UNROLL];
#pragma unroll
        for (int u = 0; u < MT_LN_UNROLL; u++) {
            const int c = c0 + MT_LN_LANES * u;
            g[u] = xh[u] = 0.0f;
            if (c < C) {
                g[u] = __fmul_rn(mt_ld(dout, base + c), mt_ld(w, c));
                xh[u] = __fmul_rn(__fsub_rn(mt_ld(x, base + c), m), rs);
            }
        }
#pragma unroll
        for (int u = 0; u < MT_LN_UNROLL; u++)
            if (c0 + MT_LN_LANES * u < C) {
                sa = __fadd_rn(sa, g[u]);
                sb = __fadd_rn(sb, __fmul_rn(g[u], xh[u]));
            }
    }
    const float ga = __fdiv_rn(ln_lanes_total(sa), (float)C);
    const float gb = __fdiv_rn(ln_lanes_total(sb), (float)C);
    if (!live) return;
    for (int c0 = l; c0 < C; c0 += MT_LN_LANES * MT_LN_UNROLL) {
        float d[MT_LN_UNROLL], old[MT_LN_UNROLL];
#pragma unroll
        for (int u = 0; u < MT_LN_UNROLL; u++) {
            const int c = c0 + MT_LN_LANES * u;
            d[u] = old[u] = 0.0f;
            if (c < C) {
                const float g = __fmul_rn(mt_ld(dout, base + c), mt_ld(w, c));
                const float xh = __fmul_rn(__fsub_rn(mt_ld(x, base + c), m), rs);
                d[u] = __fmul_rn(__fsub_rn(__fsub_rn(g, ga), __fmul_rn(xh, gb)), rs);
                if (accumulate) old[u] = mt_ld(dx, base + c);
            }
        }
#pragma unroll
        for (int u = 0; u < MT_LN_UNROLL; u++) {
            const int c = c0 + MT_LN_LANES * u;
            if (c < C) mt_st(dx, base + c, accumulate ? __fadd_rn(old[u], d[u]) : d[u]);
        }
    }
}
MT_EXPORT_DT(mt_ln_bwd_dx, 256, ln_bwd_dx_k,
             (void *dx, const void *dout, const void *x, const void *w, const float *mean,
              const float *rstd, int N, int C, int accumulate),
             (dx, dout, x, w, mean, rstd, N, C, accumulate))

/* dw (C) += sum over rows of dout * xhat, db (C) += sum over rows of dout
 * (with set, =), fp32, the rows of the block's chunk in order from zero.
 * grid (ceil(C / 256), nchunks), block 256. part_w, part_b: NULL with one
 * chunk (the sums go to dw, db), else (nchunks, C) partials for
 * mt_colsum_finish. dw or db may be NULL (not wanted). */
template <typename T>
__device__ __forceinline__ void ln_bwd_dwdb_k(float *dw, float *db, float *part_w, float *part_b,
                                              const void *dout_, const void *x_,
                                              const float *mean, const float *rstd, int N, int C,
                                              int chunk, int set)
{
    const T *dout = (const T *)dout_, *x = (const T *)x_;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int r0 = blockIdx.y * chunk, r1 = min(N, r0 + chunk);
    float aw = 0.0f, ab = 0.0f;
    for (int r = r0; r < r1; r++) {
        const mt_index i = (mt_index)r * C + c;
        float g = mt_ld(dout, i);
        float xh = __fmul_rn(__fsub_rn(mt_ld(x, i), mean[r]), rstd[r]);
        aw = __fadd_rn(aw, __fmul_rn(g, xh));
        ab = __fadd_rn(ab, g);
    }
    if (!part_w) {
        if (dw) dw[c] = set ? aw : __fadd_rn(dw[c], aw);
        if (db) db[c] = set ? ab : __fadd_rn(db[c], ab);
    } else {
        part_w[(mt_index)blockIdx.y * C + c] = aw;
        part_b[(mt_index)blockIdx.y * C + c] = ab;
    }
}
MT_EXPORT_DT(mt_ln_bwd_dwdb, 256, ln_bwd_dwdb_k,
             (float *dw, float *db, float *part_w, float *part_b, const void *dout, const void *x,
              const float *mean, const float *rstd, int N, int C, int chunk, int set),
             (dw, db, part_w, part_b, dout, x, mean, rstd, N, C, chunk, set))
