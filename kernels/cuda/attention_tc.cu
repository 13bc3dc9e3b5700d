/*
 * attention_tc.cu - causal self-attention on the tensor cores, for fp16 and
 * bf16 with heads of 64 dimensions (every GPT-2 size). The same layouts,
 * results and split of the work as attention.cu (read its header first):
 * the forward keeps a running maximum, denominator and output per query
 * (the online softmax) and writes out and lse; the backward is two kernels
 * without atomics, a query-major one writing dq and the row terms D, then a
 * key-major one writing dk and dv, each recomputing the probabilities from
 * q, k and lse.
 *
 * What differs is where the dot products happen: every product of two
 * tiles (S = Q K^T, O += P V, dP = dO V^T, dQ += dS K, dV += P^T dO,
 * dK += dS^T Q) is a warp-wide mma.sync.m16n8k16 with operands in fp16 or
 * bf16 (the storage type) and fp32 accumulation. So the probabilities P and
 * the score gradients dS are rounded to the storage type before their
 * product, as any tensor-core attention does; the softmax statistics, the
 * running rescale and every accumulator stay fp32. The queries are scaled
 * by 1/sqrt(64) = 2^-3, which is exact.
 *
 * Work split: a block is 4 warps (128 threads) and owns 64 rows (queries,
 * or keys in the key-side backward), 16 per warp; it walks the other side
 * in tiles of 64, staged in shared memory as 16-bit words, rows padded to
 * 72 elements so the fragment loads of a warp hit 32 distinct banks. Tiles
 * that need the other layout (V for O += P V, K for dQ += dS K, Q and dO
 * for the key side) are also staged transposed, so every fragment is a
 * 32-bit load of two neighbouring elements.
 *
 * Fragment layouts of mma.m16n8k16 (PTX ISA; g = lane / 4, t = lane % 4):
 *   A (16 x 16, row-major), 4 words: (row g, cols 2t..2t+1), (row g+8, cols
 *     2t..), (row g, cols 2t+8..), (row g+8, cols 2t+8..);
 *   B (16 x 8, k x n), 2 words: (k 2t..2t+1, col g), (k 2t+8.., col g);
 *   C (16 x 8) fp32, 4 values: (row g, cols 2t, 2t+1), (row g+8, cols 2t,
 *     2t+1).
 * Two neighbouring C tiles of a row block are, packed, an A fragment of
 * k 16: that is how P and dS go from one product into the next without
 * leaving the registers.
 */

#define MT_TC_HS 64                 /* head size these kernels take */
#define MT_TC_ROWS 64               /* rows per block and per tile */
#define MT_TC_THREADS 128           /* 4 warps of 16 rows */
#define MT_TC_LD (MT_TC_ROWS + 8)   /* padded row, in 16-bit elements */
#define MT_TC_KS (MT_TC_HS / 16)    /* k steps over the head dimensions */
#define MT_TC_NT (MT_TC_ROWS / 8)   /* n tiles over a tile's rows */
#define MT_TC_DT (MT_TC_HS / 8)     /* n tiles over the head dimensions */
#define MT_TC_KC (MT_TC_ROWS / 16)  /* k steps over a tile's rows */

/* One warp-wide D += A B of the storage type TY ("f16" or "bf16"). */
#define MT_TC_MMA(TY)                                                                          \
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],          \
                                               uint32_t b0, uint32_t b1)                       \
    {                                                                                          \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 "                 \
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                  \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));          \
    }
template <typename T> struct tc_type;
template <> struct tc_type<__half> {
    static __device__ __forceinline__ float val(uint16_t h) { return mt_f16_to_f32(h); }
    MT_TC_MMA("f16")
};
template <> struct tc_type<__nv_bfloat16> {
    static __device__ __forceinline__ float val(uint16_t h) { return mt_bf16_to_f32(h); }
    MT_TC_MMA("bf16")
};

/* Two 16-bit values in one word, the first in the low half (the element of
 * the lower column, as the fragments want). */
__device__ __forceinline__ uint32_t tc_pack(uint16_t lo, uint16_t hi)
{
    return (uint32_t)lo | ((uint32_t)hi << 16);
}
/* Two floats rounded to nearest even into one word, by the hardware's
 * paired conversion (one instruction; the values here are never NaN, the one
 * case where its bits differ from common.cuh's conversions). */
template <typename T> __device__ __forceinline__ uint32_t tc_pack_f(float lo, float hi);
template <> __device__ __forceinline__ uint32_t tc_pack_f<__half>(float lo, float hi)
{
    __half2 v = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&v;
}
template <> __device__ __forceinline__ uint32_t tc_pack_f<__nv_bfloat16>(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}
__device__ __forceinline__ uint32_t tc_word(const uint16_t *p) { return *(const uint32_t *)p; }

/* The A fragments of the 16 rows rb.. of a head (rows rb + g, rb + g + 8
 * for this lane) over its 64 dimensions, straight from global memory, times
 * mul (1, or the query scale); rows at or past Tn are zeros. */
template <typename T>
__device__ __forceinline__ void tc_load_a(uint32_t (&a)[MT_TC_KS][4], const uint16_t *head,
                                          mt_index stride, int rb, int Tn, float mul)
{
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < MT_TC_KS; kk++)
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const int row = rb + g + ((w & 1) ? 8 : 0), col = 16 * kk + 2 * t + ((w & 2) ? 8 : 0);
            uint32_t x = 0;
            if (row < Tn) {
                x = tc_word(head + (mt_index)row * stride + col);
                if (mul != 1.0f)
                    x = tc_pack_f<T>(tc_type<T>::val((uint16_t)x) * mul,
                                     tc_type<T>::val((uint16_t)(x >> 16)) * mul);
            }
            a[kk][w] = x;
        }
}

/* Stages 64 rows (r0..) of a head into shared memory: row-major in `rows`
 * (MT_TC_LD per row, may be NULL) and transposed in `cols` (cols[d * LD +
 * row], may be NULL), times mul; rows past Tn are zeros. All threads of the
 * block take part. */
template <typename T>
__device__ __forceinline__ void tc_stage(uint16_t *rows, uint16_t *cols, const uint16_t *head,
                                         mt_index stride, int r0, int Tn, float mul)
{
    for (int i = threadIdx.x; i < MT_TC_ROWS * MT_TC_HS / 2; i += MT_TC_THREADS) {
        const int r = i / (MT_TC_HS / 2), c = 2 * (i % (MT_TC_HS / 2));
        uint32_t x = 0;
        if (r0 + r < Tn) {
            x = tc_word(head + (mt_index)(r0 + r) * stride + c);
            if (mul != 1.0f)
                x = tc_pack_f<T>(tc_type<T>::val((uint16_t)x) * mul,
                                 tc_type<T>::val((uint16_t)(x >> 16)) * mul);
        }
        if (rows) *(uint32_t *)(rows + r * MT_TC_LD + c) = x;
        if (cols) {
            cols[c * MT_TC_LD + r] = (uint16_t)x;
            cols[(c + 1) * MT_TC_LD + r] = (uint16_t)(x >> 16);
        }
    }
}

/* acc[n] (16 x 8 per n tile, NT tiles) = A (16 x 16 KS) times the B
 * operand whose (k, n) element is src[n * LD + k] (src row-major by n: K
 * rows for Q K^T, V rows for dO V^T, Q or dO rows for the key side). */
template <typename T, int NT, int KS>
__device__ __forceinline__ void tc_mma_nk(float (&acc)[NT][4], const uint32_t (&a)[KS][4],
                                          const uint16_t *src)
{
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < NT; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            const uint16_t *p = src + (n * 8 + g) * MT_TC_LD + 16 * kk + 2 * t;
            tc_type<T>::mma(acc[n], a[kk], tc_word(p), tc_word(p + 8));
        }
    }
}

/* The A fragments (16 x 64, KC steps of 16) of a 16 x 64 block of fp32
 * values held as NT C tiles, rounded to T. */
template <typename T>
__device__ __forceinline__ void tc_c_to_a(uint32_t (&a)[MT_TC_KC][4], const float (&c)[MT_TC_NT][4])
{
#pragma unroll
    for (int kc = 0; kc < MT_TC_KC; kc++) {
        a[kc][0] = tc_pack_f<T>(c[2 * kc][0], c[2 * kc][1]);
        a[kc][1] = tc_pack_f<T>(c[2 * kc][2], c[2 * kc][3]);
        a[kc][2] = tc_pack_f<T>(c[2 * kc + 1][0], c[2 * kc + 1][1]);
        a[kc][3] = tc_pack_f<T>(c[2 * kc + 1][2], c[2 * kc + 1][3]);
    }
}

/* acc[d tile] += A (16 x 64 over a tile's rows) times the tile's values
 * (64 x 64), staged transposed: the (k = row, n = dim) element is
 * srcT[dim * LD + row]. */
template <typename T>
__device__ __forceinline__ void tc_mma_acc(float (&acc)[MT_TC_DT][4],
                                           const uint32_t (&a)[MT_TC_KC][4], const uint16_t *srcT)
{
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int d = 0; d < MT_TC_DT; d++)
#pragma unroll
        for (int kc = 0; kc < MT_TC_KC; kc++) {
            const uint16_t *p = srcT + (d * 8 + g) * MT_TC_LD + 16 * kc + 2 * t;
            tc_type<T>::mma(acc[d], a[kc], tc_word(p), tc_word(p + 8));
        }
}

/* Writes 16 rows x 64 dims of fp32 C tiles as T to the head rows r, r + 8
 * (r = this lane's first row; rows at or past Tn are skipped), row r times
 * mul0 and row r + 8 times mul1. */
template <typename T>
__device__ __forceinline__ void tc_store(uint16_t *head, mt_index stride, int r, int Tn,
                                         const float (&acc)[MT_TC_DT][4], float mul0, float mul1)
{
    const int t = (threadIdx.x % 32) & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = r + 8 * half;
        if (row >= Tn) continue;
        const float mul = half ? mul1 : mul0;
        uint16_t *dst = head + (mt_index)row * stride + 2 * t;
#pragma unroll
        for (int d = 0; d < MT_TC_DT; d++)
            *(uint32_t *)(dst + 8 * d) =
                tc_pack_f<T>(acc[d][2 * half] * mul, acc[d][2 * half + 1] * mul);
    }
}

/* ---- forward: grid (B*H, ceil(T / 64)), block 128 ---- */
template <typename T>
__device__ __forceinline__ void attn_tc_fwd_k(void *out_, float *lse, const void *qkv_, int Tn,
                                              int C, int H, float scale)
{
    __shared__ __align__(16) uint16_t Ks[MT_TC_ROWS * MT_TC_LD];
    __shared__ __align__(16) uint16_t Vt[MT_TC_HS * MT_TC_LD];
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int qt = gridDim.y - 1 - blockIdx.y; /* late query tiles (most keys) first */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const mt_index stride = 3 * (mt_index)C;
    const uint16_t *q = (const uint16_t *)qkv_ + (mt_index)b * Tn * stride + (mt_index)h * MT_TC_HS;
    const uint16_t *k = q + C, *v = q + 2 * (mt_index)C;
    const int r0 = qt * MT_TC_ROWS + warp * 16 + g, r1 = r0 + 8;

    uint32_t qa[MT_TC_KS][4];
    tc_load_a<T>(qa, q, stride, r0 - g, Tn, scale);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    float o[MT_TC_DT][4];
#pragma unroll
    for (int d = 0; d < MT_TC_DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads(); /* the last tile's reads are done */
        tc_stage<T>(Ks, NULL, k, stride, kt * MT_TC_ROWS, Tn, 1.0f);
        tc_stage<T>(NULL, Vt, v, stride, kt * MT_TC_ROWS, Tn, 1.0f);
        __syncthreads();
        float s[MT_TC_NT][4];
        tc_mma_nk<T, MT_TC_NT, MT_TC_KS>(s, qa, Ks);
        float x0 = m0, x1 = m1;
#pragma unroll
        for (int n = 0; n < MT_TC_NT; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = kt * MT_TC_ROWS + n * 8 + 2 * t + e;
                if (key > r0) s[n][e] = -INFINITY;
                if (key > r1) s[n][2 + e] = -INFINITY;
                x0 = fmaxf(x0, s[n][e]);
                x1 = fmaxf(x1, s[n][2 + e]);
            }
        x0 = fmaxf(x0, __shfl_xor_sync(MT_FULL_MASK, x0, 1));
        x0 = fmaxf(x0, __shfl_xor_sync(MT_FULL_MASK, x0, 2));
        x1 = fmaxf(x1, __shfl_xor_sync(MT_FULL_MASK, x1, 1));
        x1 = fmaxf(x1, __shfl_xor_sync(MT_FULL_MASK, x1, 2));
        /* key 0 of tile 0 is before every query, so the maxima are finite */
        const float c0 = expf(m0 - x0), c1 = expf(m1 - x1);
        m0 = x0, m1 = x1;
        l0 *= c0, l1 *= c1;
#pragma unroll
        for (int d = 0; d < MT_TC_DT; d++) o[d][0] *= c0, o[d][1] *= c0, o[d][2] *= c1, o[d][3] *= c1;
#pragma unroll
        for (int n = 0; n < MT_TC_NT; n++) {
            s[n][0] = expf(s[n][0] - x0), s[n][1] = expf(s[n][1] - x0);
            s[n][2] = expf(s[n][2] - x1), s[n][3] = expf(s[n][3] - x1);
            l0 += s[n][0] + s[n][1];
            l1 += s[n][2] + s[n][3];
        }
        uint32_t pa[MT_TC_KC][4];
        tc_c_to_a<T>(pa, s);
        tc_mma_acc<T>(o, pa, Vt);
    }
    /* each lane summed its own columns; the row's four lanes add theirs */
    l0 += __shfl_xor_sync(MT_FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(MT_FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(MT_FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(MT_FULL_MASK, l1, 2);
    tc_store<T>((uint16_t *)out_ + (mt_index)b * Tn * C + (mt_index)h * MT_TC_HS, (mt_index)C,
                r0, Tn, o, 1.0f / l0, 1.0f / l1);
    if (t == 0) {
        float *ls = lse + (mt_index)bh * Tn;
        if (r0 < Tn) ls[r0] = m0 + logf(l0);
        if (r1 < Tn) ls[r1] = m1 + logf(l1);
    }
}

/* ---- backward, query side: dq and D; grid (B*H, ceil(T / 64)), block 128 ---- */
template <typename T>
__device__ __forceinline__ void attn_tc_bwd_q_k(void *dqkv_, float *Drow, const void *dout_,
                                                const void *qkv_, const void *out_,
                                                const float *lse, int Tn, int C, int H,
                                                float scale)
{
    __shared__ __align__(16) uint16_t Ks[MT_TC_ROWS * MT_TC_LD];
    __shared__ __align__(16) uint16_t Kt[MT_TC_HS * MT_TC_LD];
    __shared__ __align__(16) uint16_t Vs[MT_TC_ROWS * MT_TC_LD];
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int qt = gridDim.y - 1 - blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const mt_index stride = 3 * (mt_index)C;
    const mt_index hoff = (mt_index)h * MT_TC_HS;
    const uint16_t *q = (const uint16_t *)qkv_ + (mt_index)b * Tn * stride + hoff;
    const uint16_t *k = q + C, *v = q + 2 * (mt_index)C;
    const uint16_t *dout = (const uint16_t *)dout_ + (mt_index)b * Tn * C + hoff;
    const uint16_t *out = (const uint16_t *)out_ + (mt_index)b * Tn * C + hoff;
    const int rb = qt * MT_TC_ROWS + warp * 16, r0 = rb + g, r1 = r0 + 8;

    uint32_t qa[MT_TC_KS][4], da[MT_TC_KS][4];
    tc_load_a<T>(qa, q, stride, rb, Tn, scale);
    tc_load_a<T>(da, dout, (mt_index)C, rb, Tn, 1.0f);
    /* D = dout . out per query: the row's four lanes take 16 dimensions each */
    float D0 = 0.0f, D1 = 0.0f;
    if (r0 < Tn)
        for (int d = 16 * t; d < 16 * t + 16; d++)
            D0 = fmaf(tc_type<T>::val(dout[(mt_index)r0 * C + d]),
                      tc_type<T>::val(out[(mt_index)r0 * C + d]), D0);
    if (r1 < Tn)
        for (int d = 16 * t; d < 16 * t + 16; d++)
            D1 = fmaf(tc_type<T>::val(dout[(mt_index)r1 * C + d]),
                      tc_type<T>::val(out[(mt_index)r1 * C + d]), D1);
    D0 += __shfl_xor_sync(MT_FULL_MASK, D0, 1);
    D0 += __shfl_xor_sync(MT_FULL_MASK, D0, 2);
    D1 += __shfl_xor_sync(MT_FULL_MASK, D1, 1);
    D1 += __shfl_xor_sync(MT_FULL_MASK, D1, 2);
    const float *ls = lse + (mt_index)bh * Tn;
    const float L0 = r0 < Tn ? ls[r0] : 0.0f, L1 = r1 < Tn ? ls[r1] : 0.0f;
    if (t == 0) {
        if (r0 < Tn) Drow[(mt_index)bh * Tn + r0] = D0;
        if (r1 < Tn) Drow[(mt_index)bh * Tn + r1] = D1;
    }
    float dq[MT_TC_DT][4];
#pragma unroll
    for (int d = 0; d < MT_TC_DT; d++) dq[d][0] = dq[d][1] = dq[d][2] = dq[d][3] = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        tc_stage<T>(Ks, Kt, k, stride, kt * MT_TC_ROWS, Tn, 1.0f);
        tc_stage<T>(Vs, NULL, v, stride, kt * MT_TC_ROWS, Tn, 1.0f);
        __syncthreads();
        float s[MT_TC_NT][4], dp[MT_TC_NT][4];
        tc_mma_nk<T, MT_TC_NT, MT_TC_KS>(s, qa, Ks);
        tc_mma_nk<T, MT_TC_NT, MT_TC_KS>(dp, da, Vs);
#pragma unroll
        for (int n = 0; n < MT_TC_NT; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = kt * MT_TC_ROWS + n * 8 + 2 * t + e;
                const float p0 = key <= r0 && r0 < Tn ? expf(s[n][e] - L0) : 0.0f;
                const float p1 = key <= r1 && r1 < Tn ? expf(s[n][2 + e] - L1) : 0.0f;
                s[n][e] = p0 * (dp[n][e] - D0);
                s[n][2 + e] = p1 * (dp[n][2 + e] - D1);
            }
        uint32_t sa[MT_TC_KC][4];
        tc_c_to_a<T>(sa, s);
        tc_mma_acc<T>(dq, sa, Kt);
    }
    uint16_t *dq_head = (uint16_t *)dqkv_ + (mt_index)b * Tn * stride + hoff;
    tc_store<T>(dq_head, stride, rb + g, Tn, dq, scale, scale);
}

/* ---- backward, key side: dk and dv; grid (B*H, ceil(T / 64)), block 128 ---- */
template <typename T>
__device__ __forceinline__ void attn_tc_bwd_kv_k(void *dqkv_, const void *dout_,
                                                 const void *qkv_, const float *lse,
                                                 const float *Drow, int Tn, int C, int H,
                                                 float scale)
{
    __shared__ __align__(16) uint16_t Qs[MT_TC_ROWS * MT_TC_LD];
    __shared__ __align__(16) uint16_t Qt[MT_TC_HS * MT_TC_LD];
    __shared__ __align__(16) uint16_t Os[MT_TC_ROWS * MT_TC_LD]; /* dout rows */
    __shared__ __align__(16) uint16_t Ot[MT_TC_HS * MT_TC_LD];   /* dout, transposed */
    __shared__ float Ls[MT_TC_ROWS], Ds[MT_TC_ROWS];
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int kt = blockIdx.y; /* early key tiles (most queries) first */
    const int nq = (Tn + MT_TC_ROWS - 1) / MT_TC_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const mt_index stride = 3 * (mt_index)C;
    const mt_index hoff = (mt_index)h * MT_TC_HS;
    const uint16_t *q = (const uint16_t *)qkv_ + (mt_index)b * Tn * stride + hoff;
    const uint16_t *k = q + C, *v = q + 2 * (mt_index)C;
    const uint16_t *dout = (const uint16_t *)dout_ + (mt_index)b * Tn * C + hoff;
    const int jb = kt * MT_TC_ROWS + warp * 16, j0 = jb + g, j1 = j0 + 8;

    uint32_t ka[MT_TC_KS][4], va[MT_TC_KS][4];
    tc_load_a<T>(ka, k, stride, jb, Tn, 1.0f);
    tc_load_a<T>(va, v, stride, jb, Tn, 1.0f);
    float dk[MT_TC_DT][4], dv[MT_TC_DT][4];
#pragma unroll
    for (int d = 0; d < MT_TC_DT; d++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[d][e] = dv[d][e] = 0.0f;

    for (int qt = kt; qt < nq; qt++) {
        const int i0 = qt * MT_TC_ROWS;
        __syncthreads();
        tc_stage<T>(Qs, Qt, q, stride, i0, Tn, scale);
        tc_stage<T>(Os, Ot, dout, (mt_index)C, i0, Tn, 1.0f);
        for (int i = threadIdx.x; i < MT_TC_ROWS; i += MT_TC_THREADS) {
            const bool in = i0 + i < Tn;
            Ls[i] = in ? lse[(mt_index)bh * Tn + i0 + i] : 0.0f;
            Ds[i] = in ? Drow[(mt_index)bh * Tn + i0 + i] : 0.0f;
        }
        __syncthreads();
        /* S^T (keys x queries) and its probabilities */
        float s[MT_TC_NT][4];
        tc_mma_nk<T, MT_TC_NT, MT_TC_KS>(s, ka, Qs);
#pragma unroll
        for (int n = 0; n < MT_TC_NT; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int c = n * 8 + 2 * t + e, i = i0 + c;
                const bool in = i < Tn;
                s[n][e] = in && j0 <= i ? expf(s[n][e] - Ls[c]) : 0.0f;
                s[n][2 + e] = in && j1 <= i ? expf(s[n][2 + e] - Ls[c]) : 0.0f;
            }
        uint32_t pa[MT_TC_KC][4];
        tc_c_to_a<T>(pa, s);
        tc_mma_acc<T>(dv, pa, Ot);
        /* dP^T = V dO^T, then dS^T = P^T (dP^T - D) */
        float dp[MT_TC_NT][4];
        tc_mma_nk<T, MT_TC_NT, MT_TC_KS>(dp, va, Os);
#pragma unroll
        for (int n = 0; n < MT_TC_NT; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int c = n * 8 + 2 * t + e;
                dp[n][e] = s[n][e] * (dp[n][e] - Ds[c]);
                dp[n][2 + e] = s[n][2 + e] * (dp[n][2 + e] - Ds[c]);
            }
        tc_c_to_a<T>(pa, dp);
        tc_mma_acc<T>(dk, pa, Qt);
    }
    uint16_t *dk_head = (uint16_t *)dqkv_ + (mt_index)b * Tn * stride + hoff + C;
    tc_store<T>(dk_head, stride, jb + g, Tn, dk, 1.0f, 1.0f);
    tc_store<T>(dk_head + C, stride, jb + g, Tn, dv, 1.0f, 1.0f);
}

/* fp16 and bf16 only (the fp32 table keeps attention.cu's kernels) */
#define MT_EXPORT_TC(NAME, BODY, PARAMS, ARGS)                                                  \
    extern "C" __global__ void __launch_bounds__(MT_TC_THREADS) NAME##_f16 PARAMS              \
    {                                                                                          \
        BODY<__half> ARGS;                                                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MT_TC_THREADS) NAME##_bf16 PARAMS             \
    {                                                                                          \
        BODY<__nv_bfloat16> ARGS;                                                              \
    }
MT_EXPORT_TC(mt_attn_tc_fwd, attn_tc_fwd_k,
             (void *out, float *lse, const void *qkv, int Tn, int C, int H, float scale),
             (out, lse, qkv, Tn, C, H, scale))
MT_EXPORT_TC(mt_attn_tc_bwd_q, attn_tc_bwd_q_k,
             (void *dqkv, float *Drow, const void *dout, const void *qkv, const void *out,
              const float *lse, int Tn, int C, int H, float scale),
             (dqkv, Drow, dout, qkv, out, lse, Tn, C, H, scale))
MT_EXPORT_TC(mt_attn_tc_bwd_kv, attn_tc_bwd_kv_k,
             (void *dqkv, const void *dout, const void *qkv, const float *lse, const float *Drow,
              int Tn, int C, int H, float scale),
             (dqkv, dout, qkv, lse, Drow, Tn, C, H, scale))
