/*
 * dequant.cuh - one element of a quantized frozen weight (lib/quant/quant.h) as
 * fp32, and its store in a storage dtype: the arithmetic of dequant.cu's
 * kernels, in plain C as well as CUDA (see scalar.cuh), so the stand-in
 * driver's host twins of those kernels (test/fake_cuda) run this very code
 * and the stand-in tests check it against lib/quant/quant.c bit for bit.
 *
 * Each value is the one fp32 operation (or two) of mti_dequantize, in its
 * order: on the device explicitly rounded (__fmul_rn, __fadd_rn), so nvcc
 * fuses no multiply-add; in C the build does not contract (-std=c11).
 *   int8: code * scale[block]
 *   NF4:  nf4[nibble] * (q8[qabsmax[block]] * absmax2[block / 256] + offset)
 * with blocks of 64 elements, element 2i in the high nibble of byte i.
 */
#ifndef MT_CUDA_DEQUANT_CUH
#define MT_CUDA_DEQUANT_CUH

#include "scalar.cuh"

#define MT_DQ_BLOCK 64       /* elements per block (MTI_QF_BLOCK) */
#define MT_DQ_STAT_BLOCK 256 /* NF4: absmaxes per double-quantization block */

#ifdef __CUDA_ARCH__
#define MT_DQ_MUL(a, b) __fmul_rn(a, b)
#define MT_DQ_ADD(a, b) __fadd_rn(a, b)
#else
#define MT_DQ_MUL(a, b) ((a) * (b))
#define MT_DQ_ADD(a, b) ((a) + (b))
#endif

/* The tables NF4 needs, passed by value to the kernels: the signed 8-bit
 * dynamic map of the absmax codes (mti_q8_map(1)) and the 16 NF4 levels
 * (mti_nf4_code()). */
typedef struct mt_dq_maps {
    float q8[256];
    float nf4[16];
} mt_dq_maps;

/* Element i of an int8 tensor: codes (n), scale (ceil(n / 64)). */
MT_HD float mt_dq_int8(const int8_t *codes, const float *scale, unsigned long long i)
{
    return MT_DQ_MUL((float)codes[i], scale[i / MT_DQ_BLOCK]);
}

/* The absmax of NF4 block b. */
MT_HD float mt_dq_nf4_absmax(const uint8_t *qabsmax, const float *absmax2, float offset,
                             const float *q8, unsigned long long b)
{
    return MT_DQ_ADD(MT_DQ_MUL(q8[qabsmax[b]], absmax2[b / MT_DQ_STAT_BLOCK]), offset);
}

/* Element i of an NF4 tensor whose block's absmax is am. */
MT_HD float mt_dq_nf4(const uint8_t *codes, const float *nf4, float am, unsigned long long i)
{
    const unsigned byte = codes[i / 2], nib = (i & 1) ? byte & 15u : byte >> 4;
    return MT_DQ_MUL(nf4[nib], am);
}

/* v stored as element j of out in dt (0 fp32, 1 fp16, 2 bf16: mti_dtype's
 * numbers), rounded to nearest even. */
MT_HD void mt_dq_store(void *out, int dt, unsigned long long j, float v)
{
    if (dt == 0) ((float *)out)[j] = v;
    else ((uint16_t *)out)[j] = dt == 1 ? mt_f32_to_f16(v) : mt_f32_to_bf16(v);
}

/* v as stored in dt and read back (fp32 unchanged). */
MT_HD float mt_dq_round(int dt, float v)
{
    return dt == 0 ? v : dt == 1 ? mt_f16_to_f32(mt_f32_to_f16(v)) : mt_bf16_to_f32(mt_f32_to_bf16(v));
}

/* Element j of the embedding from a quantized table (embedding_fwd_q):
 * the table's value v (fp32, as mt_dq_int8 / mt_dq_nf4 give it) rounded
 * to dt as the dequantizer stores it, plus the position's value p (read
 * from dt; has_p 0: nothing added, so -0 stays -0), stored in dt. */
MT_HD void mt_dq_emb_store(void *out, int dt, unsigned long long j, float v, const void *wpe,
                           unsigned long long pj)
{
    float x = mt_dq_round(dt, v);
    if (wpe) {
        const float p = dt == 0 ? ((const float *)wpe)[pj]
                        : dt == 1 ? mt_f16_to_f32(((const uint16_t *)wpe)[pj])
                                  : mt_bf16_to_f32(((const uint16_t *)wpe)[pj]);
        x = MT_DQ_ADD(x, p);
    }
    mt_dq_store(out, dt, j, x);
}

#endif /* MT_CUDA_DEQUANT_CUH */
