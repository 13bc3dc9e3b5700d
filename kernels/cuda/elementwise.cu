/*
 * elementwise.cu - casts, activations and residual adds: one pass over n
 * elements, grid-stride, each element read, computed in fp32 and rounded to
 * its storage dtype once. Every output element depends only on the inputs
 * at its own index, so in-place use (y aliasing x, dx aliasing dy) is safe.
 */

/* ---- cast ---- */

/* dst (n) in Td = src (n) in Ts, to nearest even. */
template <typename Td, typename Ts>
__device__ __forceinline__ void cast_loop(void *dst_, const void *src_, mt_index n)
{
    Td *dst = (Td *)dst_;
    const Ts *src = (const Ts *)src_;
    MT_FOR_EACH(i, n) mt_st(dst, i, mt_ld(src, i));
}

/* dst (n) bf16 = src (n) in Ts, stochastically: element i takes the random
 * bits mt_sr_bits(seed, i), so the result does not depend on the grid. */
template <typename Ts>
__device__ __forceinline__ void cast_sr_loop(void *dst_, const void *src_, mt_index n,
                                             unsigned long long seed)
{
    __nv_bfloat16 *dst = (__nv_bfloat16 *)dst_;
    const Ts *src = (const Ts *)src_;
    MT_FOR_EACH(i, n)
    {
        dst[i] = __ushort_as_bfloat16(mt_f32_to_bf16_sr(mt_ld(src, i), mt_sr_bits(seed, i)));
    }
}

template <typename Td>
__device__ __forceinline__ void cast_from(void *dst, const void *src, int src_dt, mt_index n)
{
    switch (src_dt) {
    case MT_DT_F32: cast_loop<Td, float>(dst, src, n); break;
    case MT_DT_F16: cast_loop<Td, __half>(dst, src, n); break;
    case MT_DT_BF16: cast_loop<Td, __nv_bfloat16>(dst, src, n); break;
    }
}

/* dst (n) in dst_dt = src (n) in src_dt; `stochastic` (bf16 destinations
 * only) rounds with mt_sr_bits(seed, i). One kernel for every pair: the
 * dtypes are uniform over the launch, so the switch costs nothing. */
extern "C" __global__ void __launch_bounds__(256)
    mt_cast(void *dst, int dst_dt, const void *src, int src_dt, mt_index n, int stochastic,
            unsigned long long seed)
{
    if (stochastic && dst_dt == MT_DT_BF16) {
        switch (src_dt) {
        case MT_DT_F32: cast_sr_loop<float>(dst, src, n, seed); break;
        case MT_DT_F16: cast_sr_loop<__half>(dst, src, n, seed); break;
        case MT_DT_BF16: cast_sr_loop<__nv_bfloat16>(dst, src, n, seed); break;
        }
        return;
    }
    switch (dst_dt) {
    case MT_DT_F32: cast_from<float>(dst, src, src_dt, n); break;
    case MT_DT_F16: cast_from<__half>(dst, src, src_dt, n); break;
    case MT_DT_BF16: cast_from<__nv_bfloat16>(dst, src, src_dt, n); break;
    }
}

/* ---- GELU, tanh form ---- */

#define MT_GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define MT_GELU_C 0.044715f

/* y (n) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
template <typename T>
__device__ __forceinline__ void gelu_fwd_k(void *y_, const void *x_, mt_index n)
{
    T *y = (T *)y_;
    const T *x = (const T *)x_;
    MT_FOR_EACH(i, n)
    {
        float v = mt_ld(x, i);
        float u = MT_GELU_K * (v + MT_GELU_C * v * v * v);
        mt_st(y, i, 0.5f * v * (1.0f + tanhf(u)));
    }
}
MT_EXPORT_DT(mt_gelu_fwd, 256, gelu_fwd_k, (void *y, const void *x, mt_index n), (y, x, n))

/* dx (n) = dy * gelu'(x), with gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2)
 * sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(u) */
template <typename T>
__device__ __forceinline__ void gelu_bwd_k(void *dx_, const void *dy_, const void *x_, mt_index n)
{
    T *dx = (T *)dx_;
    const T *dy = (const T *)dy_, *x = (const T *)x_;
    MT_FOR_EACH(i, n)
    {
        float v = mt_ld(x, i);
        float u = MT_GELU_K * (v + MT_GELU_C * v * v * v);
        float t = tanhf(u);
        float du = MT_GELU_K * (1.0f + 3.0f * MT_GELU_C * v * v);
        float g = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
        mt_st(dx, i, mt_ld(dy, i) * g);
    }
}
MT_EXPORT_DT(mt_gelu_bwd, 256, gelu_bwd_k, (void *dx, const void *dy, const void *x, mt_index n),
             (dx, dy, x, n))

/* ---- ReLU ---- */

/* y (n) = x < 0 ? 0 : x: NaN and -0 pass through, as in torch and the CPU
 * table. */
template <typename T>
__device__ __forceinline__ void relu_fwd_k(void *y_, const void *x_, mt_index n)
{
    T *y = (T *)y_;
    const T *x = (const T *)x_;
    MT_FOR_EACH(i, n)
    {
        float v = mt_ld(x, i);
        mt_st(y, i, v < 0.0f ? 0.0f : v);
    }
}
MT_EXPORT_DT(mt_relu_fwd, 256, relu_fwd_k, (void *y, const void *x, mt_index n), (y, x, n))

/* dx (n) = y > 0 ? dy : 0, from the forward's output y. */
template <typename T>
__device__ __forceinline__ void relu_bwd_k(void *dx_, const void *dy_, const void *y_, mt_index n)
{
    T *dx = (T *)dx_;
    const T *dy = (const T *)dy_, *y = (const T *)y_;
    MT_FOR_EACH(i, n) mt_st(dx, i, mt_ld(y, i) > 0.0f ? mt_ld(dy, i) : 0.0f);
}
MT_EXPORT_DT(mt_relu_bwd, 256, relu_bwd_k, (void *dx, const void *dy, const void *y, mt_index n),
             (dx, dy, y, n))

/* ---- residual ---- */

/* y (n) = a + b */
template <typename T>
__device__ __forceinline__ void add_k(void *y_, const void *a_, const void *b_, mt_index n)
{
    T *y = (T *)y_;
    const T *a = (const T *)a_, *b = (const T *)b_;
    MT_FOR_EACH(i, n) mt_st(y, i, __fadd_rn(mt_ld(a, i), mt_ld(b, i)));
}
MT_EXPORT_DT(mt_add, 256, add_k, (void *y, const void *a, const void *b, mt_index n),
             (y, a, b, n))

/* y (n) += x */
template <typename T>
__device__ __forceinline__ void accumulate_k(void *y_, const void *x_, mt_index n)
{
    T *y = (T *)y_;
    const T *x = (const T *)x_;
    MT_FOR_EACH(i, n) mt_st(y, i, __fadd_rn(mt_ld(y, i), mt_ld(x, i)));
}
MT_EXPORT_DT(mt_accumulate, 256, accumulate_k, (void *y, const void *x, mt_index n), (y, x, n))

/* ---- bias rows ---- */

/* y (rows, out) = b (out) on every row: exact (same dtype). The GEMM
 * fallback starts y from the bias and adds the product in with beta 1, so
 * y = x W^T + b is still rounded once. n = rows * out. */
template <typename T>
__device__ __forceinline__ void bias_rows_k(void *y_, const void *b_, int out, mt_index n)
{
    T *y = (T *)y_;
    const T *b = (const T *)b_;
    MT_FOR_EACH(i, n) y[i] = b[i % (mt_index)out];
}
MT_EXPORT_DT(mt_bias_rows, 256, bias_rows_k, (void *y, const void *b, int out, mt_index n),
             (y, b, out, n))
