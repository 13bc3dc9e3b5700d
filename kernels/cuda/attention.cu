/*
 * attention.cu - causal self-attention that never stores the (T,T) scores.
 *
 * Layout (lib/ops/kernels.h): qkv (B,T,3C), per token the queries of the H
 * heads (head h at h*hs), then the keys, then the values; out (B,T,C);
 * lse (B,H,T) fp32. s(i,j) = (scale q_i) . k_j with scale = 1/sqrt(hs),
 * keys j <= i: as in the CPU table, the queries are scaled (and rounded)
 * as they are loaded, so the key gradient needs no scaling and the query
 * gradient is scaled once at the end.
 *
 * Work split, all three kernels: a block is 256 threads; each row it owns
 * (a query, or a key in the key-side backward) belongs to a group of G
 * consecutive lanes, and lane g of the group holds the head dimensions
 * d = g, g + G, ..., g + 15G in registers (16 per lane, so a head of up to
 * 16G dimensions; shorter heads are zero-padded, which changes no dot
 * product). A dot product is 16 fused multiply-adds per lane, in order, then
 * an xor butterfly over the group, so every lane holds the same bits and
 * the forward and both backward kernels compute each score identically.
 * Rows per block: 256/G. G is 2, 4, 8 or 16 (heads up to 32, 64, 128, 256).
 * Tiles of the other side (keys and values, or queries and output
 * gradients) are staged in shared memory as fp32, row-major with a padded
 * row of 16G floats: lane g reads element g + G*i of a row that every group
 * of the warp reads at once, so a warp touches G distinct banks and the
 * groups share them by broadcast.
 *
 * Forward (mt_attn_fwd_*): the block owns 256/G consecutive queries of one
 * (b,h) and walks the key tiles 0.. up to its last query, BK keys at a time.
 * Per tile each query computes its BK scores, masks keys after it, and
 * folds the tile into a running maximum m, denominator l and output
 * accumulator with the online softmax: m' = max(m, tile max), everything
 * so far scaled by exp(m - m'), then p = exp(s - m') added. At the end
 * out = acc / l and lse = m + log l.
 *
 * Backward, deterministic without atomics, in two kernels that each own
 * what they write (a FlashAttention-2-style split, recomputing the
 * probabilities p = exp(s - lse) from q, k and the saved lse instead of
 * accumulating dq across key blocks with atomics or keeping per-block
 * partial dq):
 *   mt_attn_bwd_q_*   query-major, like the forward: per query the
 *                     row term D = dout . out (written to a (B,H,T)
 *                     workspace for the next kernel), then over the key
 *                     tiles: dp = dout . v_j, ds = p (dp - D),
 *                     dq += ds k_j; dq *= scale at the end.
 *   mt_attn_bwd_kv_*  key-major: the block owns 256/G keys and walks the
 *                     query tiles from its first key to T, BQ queries at a
 *                     time: dv += p dout_i, dk += ds (scale q_i).
 * The scores are computed twice in the backward (once per kernel): about a
 * third more arithmetic than one fused kernel with dq atomics, for results
 * that are the same bits on every run and no extra memory beyond D.
 *
 * Causal work is uneven: in the query-major kernels the blocks of late
 * queries see the most keys, so their grid runs from the last query tile
 * down; in the key-major kernel the first key tiles see the most queries and
 * run first. Within a block tiles are always walked in increasing order.
 */

#define MT_ATTN_THREADS 256
#define MT_ATTN_DPT 16 /* head dimensions per lane */

/* Dot product of a lane's 16 dimensions with row `r` of a shared tile
 * (lane offset g already applied), then summed over the group. */
template <int G>
__device__ __forceinline__ float attn_dot(const float (&a)[MT_ATTN_DPT], const float *r)
{
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < MT_ATTN_DPT; i++) part = fmaf(a[i], r[G * i], part);
    return mt_group_sum<G>(part);
}

/* Loads a lane's 16 dimensions of one head row, times mul; row points at
 * dimension 0 of the head. */
template <typename T, int G>
__device__ __forceinline__ void attn_load_row(float (&a)[MT_ATTN_DPT], const T *row, int g, int hs,
                                              float mul)
{
#pragma unroll
    for (int i = 0; i < MT_ATTN_DPT; i++) {
        const int d = g + G * i;
        a[i] = d < hs ? __fmul_rn(mt_ld(row, d), mul) : 0.0f;
    }
}

/* Stages `rows` head rows starting at token t0 of one (b,h) into a shared
 * tile (rows, 16G) fp32, times mul, zero past T and past hs. src points at
 * dimension 0 of the head's part (q, k or v) of token 0; stride is the token
 * stride in elements. Coalesced: consecutive threads take consecutive
 * dimensions. */
template <typename T, int G>
__device__ __forceinline__ void attn_stage(float *tile, int rows, const T *src, mt_index stride,
                                           int t0, int Tn, int hs, float mul)
{
    constexpr int HSP = G * MT_ATTN_DPT;
    for (int e = threadIdx.x; e < rows * HSP; e += MT_ATTN_THREADS) {
        const int j = e / HSP, d = e - j * HSP, t = t0 + j;
        tile[e] = t < Tn && d < hs ? __fmul_rn(mt_ld(src, (mt_index)t * stride + d), mul) : 0.0f;
    }
}

/* ---- forward ----
 * out (B,T,C), lse (B,H,T) from qkv (B,T,3C). grid (B*H, ceil(T / (256/G))),
 * block 256, static shared 2 * BK * 16G floats. */
template <typename T, int G, int BK>
__device__ __forceinline__ void attn_fwd_k(void *out_, float *lse, const void *qkv_, int Tn, int C,
                                           int H, int hs, float scale)
{
    constexpr int HSP = G * MT_ATTN_DPT, ROWS = MT_ATTN_THREADS / G;
    __shared__ float ks[BK * HSP], vs[BK * HSP];
    const T *qkv = (const T *)qkv_;
    T *out = (T *)out_;
    const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS; /* late queries first */
    const int g = threadIdx.x % G, tq = q0 + threadIdx.x / G;
    const bool live = tq < Tn;
    const int tqc = live ? tq : Tn - 1; /* rows past T compute a copy of the last, unwritten */
    const mt_index stride = (mt_index)3 * C;
    const T *head = qkv + (mt_index)b * Tn * stride + (mt_index)h * hs;

    float q[MT_ATTN_DPT], acc[MT_ATTN_DPT];
    attn_load_row<T, G>(q, head + (mt_index)tqc * stride, g, hs, scale);
#pragma unroll
    for (int i = 0; i < MT_ATTN_DPT; i++) acc[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    const int last = min(q0 + ROWS, Tn) - 1; /* the block's last query: its last key */
    for (int k0 = 0; k0 <= last; k0 += BK) {
        __syncthreads(); /* the previous tile is no longer read */
        attn_stage<T, G>(ks, BK, head + C, stride, k0, Tn, hs, 1.0f);
        attn_stage<T, G>(vs, BK, head + 2 * C, stride, k0, Tn, hs, 1.0f);
        __syncthreads();
        float s[BK];
        float tmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < BK; j++) {
            float v = attn_dot<G>(q, ks + j * HSP + g);
            s[j] = k0 + j <= tqc ? v : -INFINITY;
            tmax = fmaxf(tmax, s[j]);
        }
        /* key 0 is in the first tile and every query sees it, so mn is
         * finite from the first tile on; a later tile wholly after this
         * query has tmax -inf and leaves m as it was */
        const float mn = fmaxf(m, tmax);
        const float corr = expf(m - mn); /* 0 on the first tile */
        l *= corr;
#pragma unroll
        for (int i = 0; i < MT_ATTN_DPT; i++) acc[i] *= corr;
#pragma unroll
        for (int j = 0; j < BK; j++) {
            const float p = expf(s[j] - mn); /* masked: exp(-inf) = 0 */
            l += p;
            const float *vr = vs + j * HSP + g;
#pragma unroll
            for (int i = 0; i < MT_ATTN_DPT; i++) acc[i] = fmaf(p, vr[G * i], acc[i]);
        }
        m = mn;
    }
    if (!live) return;
    T *orow = out + ((mt_index)b * Tn + tq) * C + (mt_index)h * hs;
#pragma unroll
    for (int i = 0; i < MT_ATTN_DPT; i++) {
        const int d = g + G * i;
        if (d < hs) mt_st(orow, d, __fdiv_rn(acc[i], l));
    }
    if (g == 0) lse[(mt_index)bh * Tn + tq] = m + logf(l);
}

/* ---- backward, query side ----
 * dq into dqkv (B,T,3C) (the query third), and D (B,H,T) fp32 = dout . out
 * per query row for the key-side kernel. grid and block as the forward. */
template <typename T, int G, int BK>
__device__ __forceinline__ void attn_bwd_q_k(void *dqkv_, float *Drow, const void *dout_,
                                             const void *qkv_, const void *out_,
                                             const float *lse, int Tn, int C, int H, int hs,
                                             float scale)
{
    constexpr int HSP = G * MT_ATTN_DPT, ROWS = MT_ATTN_THREADS / G;
    __shared__ float ks[BK * HSP], vs[BK * HSP];
    const T *qkv = (const T *)qkv_, *dout = (const T *)dout_, *out = (const T *)out_;
    T *dqkv = (T *)dqkv_;
    const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;
    const int g = threadIdx.x % G, tq = q0 + threadIdx.x / G;
    const bool live = tq < Tn;
    const int tqc = live ? tq : Tn - 1;
    const mt_index stride = (mt_index)3 * C;
    const T *head = qkv + (mt_index)b * Tn * stride + (mt_index)h * hs;
    const mt_index orow = ((mt_index)b * Tn + tqc) * C + (mt_index)h * hs;

    float q[MT_ATTN_DPT], dO[MT_ATTN_DPT], dq[MT_ATTN_DPT];
    attn_load_row<T, G>(q, head + (mt_index)tqc * stride, g, hs, scale);
    attn_load_row<T, G>(dO, dout + orow, g, hs, 1.0f);
    float D;
    {
        float o[MT_ATTN_DPT];
        attn_load_row<T, G>(o, out + orow, g, hs, 1.0f);
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < MT_ATTN_DPT; i++) part = fmaf(dO[i], o[i], part);
        D = mt_group_sum<G>(part);
    }
    if (live && g == 0) Drow[(mt_index)bh * Tn + tq] = D;
    const float L = lse[(mt_index)bh * Tn + tqc];
#pragma unroll
    for (int i = 0; i < MT_ATTN_DPT; i++) dq[i] = 0.0f;

    const int last = min(q0 + ROWS, Tn) - 1;
    for (int k0 = 0; k0 <= last; k0 += BK) {
        __syncthreads();
        attn_stage<T, G>(ks, BK, head + C, stride, k0, Tn, hs, 1.0f);
        attn_stage<T, G>(vs, BK, head + 2 * C, stride, k0, Tn, hs, 1.0f);
        __syncthreads();
        /* a tile wholly after every query of the warp adds nothing; the
         * test is warp-wide because the dot products shuffle across it */
        if (__all_sync(MT_FULL_MASK, k0 > tqc)) continue;
#pragma unroll 4
        for (int j = 0; j < BK; j++) {
            const float *kr = ks + j * HSP + g;
            const float s = attn_dot<G>(q, kr);
            const float dp = attn_dot<G>(dO, vs + j * HSP + g);
            const float p = k0 + j <= tqc ? expf(s - L) : 0.0f;
            const float ds = p * (dp - D);
#pragma unroll
            for (int i = 0; i < MT_ATTN_DPT; i++) dq[i] = fmaf(ds, kr[G * i], dq[i]);
        }
    }
    if (!live) return;
    T *dst = dqkv + ((mt_index)b * Tn + tq) * stride + (mt_index)h * hs;
#pragma unroll
    for (int i = 0; i < MT_ATTN_DPT; i++) {
        const int d = g + G * i;
        if (d < hs) mt_st(dst, d, __fmul_rn(dq[i], scale));
    }
}

/* ---- backward, key side ----
 * dk, dv into dqkv (B,T,3C) (the key and value thirds) from dout, qkv, lse
 * and D. grid (B*H, ceil(T / (256/G))), block 256, static shared
 * 2 * BQ * 16G + 2 * BQ floats. */
template <typename T, int G, int BQ>
__device__ __forceinline__ void attn_bwd_kv_k(void *dqkv_, const void *dout_, const void *qkv_,
                                              const float *lse, const float *Drow, int Tn, int C,
                                              int H, int hs, float scale)
{
    constexpr int HSP = G * MT_ATTN_DPT, ROWS = MT_ATTN_THREADS / G;
    __shared__ float qs[BQ * HSP], dos[BQ * HSP], ls[BQ], Ds[BQ];
    const T *qkv = (const T *)qkv_, *dout = (const T *)dout_;
    T *dqkv = (T *)dqkv_;
    const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
    const int k0 = blockIdx.y * ROWS; /* early keys (the most work) first */
    const int g = threadIdx.x % G, tk = k0 + threadIdx.x / G;
    const bool live = tk < Tn;
    const int tkc = live ? tk : Tn - 1;
    const mt_index stride = (mt_index)3 * C;
    const T *head = qkv + (mt_index)b * Tn * stride + (mt_index)h * hs;
    const T *dhead = dout + (mt_index)b * Tn * C + (mt_index)h * hs;

    float kk[MT_ATTN_DPT], vv[MT_ATTN_DPT], dk[MT_ATTN_DPT], dv[MT_ATTN_DPT];
    attn_load_row<T, G>(kk, head + (mt_index)tkc * stride + C, g, hs, 1.0f);
    attn_load_row<T, G>(vv, head + (mt_index)tkc * stride + 2 * C, g, hs, 1.0f);
#pragma unroll
    for (int i = 0; i < MT_ATTN_DPT; i++) dk[i] = dv[i] = 0.0f;

    for (int i0 = k0; i0 < Tn; i0 += BQ) {
        __syncthreads();
        attn_stage<T, G>(qs, BQ, head, stride, i0, Tn, hs, scale);
        attn_stage<T, G>(dos, BQ, dhead, (mt_index)C, i0, Tn, hs, 1.0f);
        for (int e = threadIdx.x; e < BQ; e += MT_ATTN_THREADS) {
            const int t = i0 + e;
            ls[e] = t < Tn ? lse[(mt_index)bh * Tn + t] : 0.0f;
            Ds[e] = t < Tn ? Drow[(mt_index)bh * Tn + t] : 0.0f;
        }
        __syncthreads();
        /* a tile wholly before every key of the warp adds nothing (warp-wide:
         * the dot products shuffle across the warp) */
        if (__all_sync(MT_FULL_MASK, i0 + BQ - 1 < tkc)) continue;
#pragma unroll 4
        for (int j = 0; j < BQ; j++) {
            const int t = i0 + j;
            const float *qr = qs + j * HSP + g, *dr = dos + j * HSP + g;
            const float s = attn_dot<G>(kk, qr);
            const float dp = attn_dot<G>(vv, dr);
            const float p = t >= tkc && t < Tn ? expf(s - ls[j]) : 0.0f;
            const float ds = p * (dp - Ds[j]);
#pragma unroll
            for (int i = 0; i < MT_ATTN_DPT; i++) {
                dv[i] = fmaf(p, dr[G * i], dv[i]);
                dk[i] = fmaf(ds, qr[G * i], dk[i]);
            }
        }
    }
    if (!live) return;
    T *dst = dqkv + ((mt_index)b * Tn + tk) * stride + (mt_index)h * hs;
#pragma unroll
    for (int i = 0; i < MT_ATTN_DPT; i++) {
        const int d = g + G * i;
        if (d < hs) {
            mt_st(dst + C, d, dk[i]);
            mt_st(dst + 2 * C, d, dv[i]);
        }
    }
}

/* ---- the exported kernels: one per storage dtype and head-size class ----
 * Key tiles of 32 (16 for heads past 128, to keep the static shared memory
 * at 32 KiB); query tiles of the key-side kernel likewise. */
#define MT_ATTN_FWD_PARAMS                                                                     \
    (void *out, float *lse, const void *qkv, int Tn, int C, int H, int hs, float scale)
#define MT_ATTN_FWD_ARGS (out, lse, qkv, Tn, C, H, hs, scale)
#define MT_ATTN_BQ_PARAMS                                                                      \
    (void *dqkv, float *Drow, const void *dout, const void *qkv, const void *out,             \
     const float *lse, int Tn, int C, int H, int hs, float scale)
#define MT_ATTN_BQ_ARGS (dqkv, Drow, dout, qkv, out, lse, Tn, C, H, hs, scale)
#define MT_ATTN_BKV_PARAMS                                                                     \
    (void *dqkv, const void *dout, const void *qkv, const float *lse, const float *Drow,      \
     int Tn, int C, int H, int hs, float scale)
#define MT_ATTN_BKV_ARGS (dqkv, dout, qkv, lse, Drow, Tn, C, H, hs, scale)

template <typename T> __device__ __forceinline__ void attn_fwd_32(void *out, float *lse,
    const void *qkv, int Tn, int C, int H, int hs, float scale)
{ attn_fwd_k<T, 2, 32> MT_ATTN_FWD_ARGS; }
template <typename T> __device__ __forceinline__ void attn_fwd_64(void *out, float *lse,
    const void *qkv, int Tn, int C, int H, int hs, float scale)
{ attn_fwd_k<T, 4, 32> MT_ATTN_FWD_ARGS; }
template <typename T> __device__ __forceinline__ void attn_fwd_128(void *out, float *lse,
    const void *qkv, int Tn, int C, int H, int hs, float scale)
{ attn_fwd_k<T, 8, 32> MT_ATTN_FWD_ARGS; }
template <typename T> __device__ __forceinline__ void attn_fwd_256(void *out, float *lse,
    const void *qkv, int Tn, int C, int H, int hs, float scale)
{ attn_fwd_k<T, 16, 16> MT_ATTN_FWD_ARGS; }
MT_EXPORT_DT(mt_attn_fwd_32, MT_ATTN_THREADS, attn_fwd_32, MT_ATTN_FWD_PARAMS, MT_ATTN_FWD_ARGS)
MT_EXPORT_DT(mt_attn_fwd_64, MT_ATTN_THREADS, attn_fwd_64, MT_ATTN_FWD_PARAMS, MT_ATTN_FWD_ARGS)
MT_EXPORT_DT(mt_attn_fwd_128, MT_ATTN_THREADS, attn_fwd_128, MT_ATTN_FWD_PARAMS, MT_ATTN_FWD_ARGS)
MT_EXPORT_DT(mt_attn_fwd_256, MT_ATTN_THREADS, attn_fwd_256, MT_ATTN_FWD_PARAMS, MT_ATTN_FWD_ARGS)

template <typename T> __device__ __forceinline__ void attn_bwd_q_32(void *dqkv, float *Drow,
    const void *dout, const void *qkv, const void *out, const float *lse, int Tn, int C, int H,
    int hs, float scale)
{ attn_bwd_q_k<T, 2, 32> MT_ATTN_BQ_ARGS; }
template <typename T> __device__ __forceinline__ void attn_bwd_q_64(void *dqkv, float *Drow,
    const void *dout, const void *qkv, const void *out, const float *lse, int Tn, int C, int H,
    int hs, float scale)
{ attn_bwd_q_k<T, 4, 32> MT_ATTN_BQ_ARGS; }
template <typename T> __device__ __forceinline__ void attn_bwd_q_128(void *dqkv, float *Drow,
    const void *dout, const void *qkv, const void *out, const float *lse, int Tn, int C, int H,
    int hs, float scale)
{ attn_bwd_q_k<T, 8, 32> MT_ATTN_BQ_ARGS; }
template <typename T> __device__ __forceinline__ void attn_bwd_q_256(void *dqkv, float *Drow,
    const void *dout, const void *qkv, const void *out, const float *lse, int Tn, int C, int H,
    int hs, float scale)
{ attn_bwd_q_k<T, 16, 16> MT_ATTN_BQ_ARGS; }
MT_EXPORT_DT(mt_attn_bwd_q_32, MT_ATTN_THREADS, attn_bwd_q_32, MT_ATTN_BQ_PARAMS, MT_ATTN_BQ_ARGS)
MT_EXPORT_DT(mt_attn_bwd_q_64, MT_ATTN_THREADS, attn_bwd_q_64, MT_ATTN_BQ_PARAMS, MT_ATTN_BQ_ARGS)
MT_EXPORT_DT(mt_attn_bwd_q_128, MT_ATTN_THREADS, attn_bwd_q_128, MT_ATTN_BQ_PARAMS,
             MT_ATTN_BQ_ARGS)
MT_EXPORT_DT(mt_attn_bwd_q_256, MT_ATTN_THREADS, attn_bwd_q_256, MT_ATTN_BQ_PARAMS,
             MT_ATTN_BQ_ARGS)

template <typename T> __device__ __forceinline__ void attn_bwd_kv_32(void *dqkv,
    const void *dout, const void *qkv, const float *lse, const float *Drow, int Tn, int C, int H,
    int hs, float scale)
{ attn_bwd_kv_k<T, 2, 64> MT_ATTN_BKV_ARGS; }
template <typename T> __device__ __forceinline__ void attn_bwd_kv_64(void *dqkv,
    const void *dout, const void *qkv, const float *lse, const float *Drow, int Tn, int C, int H,
    int hs, float scale)
{ attn_bwd_kv_k<T, 4, 64> MT_ATTN_BKV_ARGS; }
template <typename T> __device__ __forceinline__ void attn_bwd_kv_128(void *dqkv,
    const void *dout, const void *qkv, const float *lse, const float *Drow, int Tn, int C, int H,
    int hs, float scale)
{ attn_bwd_kv_k<T, 8, 32> MT_ATTN_BKV_ARGS; }
template <typename T> __device__ __forceinline__ void attn_bwd_kv_256(void *dqkv,
    const void *dout, const void *qkv, const float *lse, const float *Drow, int Tn, int C, int H,
    int hs, float scale)
{ attn_bwd_kv_k<T, 16, 16> MT_ATTN_BKV_ARGS; }
MT_EXPORT_DT(mt_attn_bwd_kv_32, MT_ATTN_THREADS, attn_bwd_kv_32, MT_ATTN_BKV_PARAMS,
             MT_ATTN_BKV_ARGS)
MT_EXPORT_DT(mt_attn_bwd_kv_64, MT_ATTN_THREADS, attn_bwd_kv_64, MT_ATTN_BKV_PARAMS,
             MT_ATTN_BKV_ARGS)
MT_EXPORT_DT(mt_attn_bwd_kv_128, MT_ATTN_THREADS, attn_bwd_kv_128, MT_ATTN_BKV_PARAMS,
             MT_ATTN_BKV_ARGS)
MT_EXPORT_DT(mt_attn_bwd_kv_256, MT_ATTN_THREADS, attn_bwd_kv_256, MT_ATTN_BKV_PARAMS,
             MT_ATTN_BKV_ARGS)
