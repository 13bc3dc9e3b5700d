/*
 * quant.h - blockwise quantization of frozen weights (lib/quant/quant.c): int8
 * with one scale per block, and NF4 as QLoRA and bitsandbytes make it.
 * Host memory in, host memory out: the quantizers run where a weight is
 * loaded (from fp32), the dequantizer wherever a GEMM wants fp32 or bf16
 * tiles of the weight (a range of its elements: whole rows of an (O, I)
 * weight are elements [r0 I, r1 I)).
 *
 * A quantized tensor of n elements is one buffer of mti_quant_bytes(f, n)
 * bytes, laid out as mti_quant_parts says (fp32 parts first, so a buffer
 * aligned for floats has every part aligned).
 *
 * NF4 (MTI_QF_NF4): bitsandbytes' quantize_4bit(x, blocksize=64,
 * quant_type="nf4", compress_statistics=True) and dequantize_4bit, bit for
 * bit (test/test_quant.c against test/golden/quant_nf4.gv):
 *   - blocks of 64 elements (the last may be partial). A full block's
 *     absmax a = max |x|; each x becomes s = clamp(x * (1 / max(a, 1e-38)),
 *     -1, 1) (fp32 reciprocal, then product); the partial last block uses
 *     a = max(max |x|, 1e-38) and s = clamp(x / a, -1, 1) (a division),
 *     and keeps that clamped a;
 *   - the code of s is the number of NF4 midpoints (c[k] + c[k+1]) / 2
 *     strictly below it (a tie takes the lower code); codes are packed two
 *     to a byte, element 2i in the high nibble of byte i and 2i + 1 in the
 *     low one; an odd n pads the last low nibble with the code of 0 (7);
 *   - double quantization of the absmaxes: offset = their mean (torch's fp32
 *     sum in its one-thread order, divided by the count), and a - offset
 *     quantized blockwise in blocks of 256 with the signed 8-bit dynamic map
 *     (mti_q8_map(1)) as bitsandbytes' CPU kernel does: per block absmax2 =
 *     max |y|, then code = lut[(uint16)((clamp(y * (1 / absmax2), -1, 1) + 1)
 *     * 0.5 * 65535 + 0.5)], where lut[i] is the first code whose upper
 *     midpoint is not below -1 + 2i / 65535 (a table of 65536 nearest codes
 *     on a grid, not an exact nearest); a block whose absmax2 is 0 stores
 *     code 0;
 *   - a value is nf4[code] * absmax_b, with absmax_b = map[qabsmax_b] *
 *     absmax2_(b / 256) + offset (each an fp32 operation); bf16 output is
 *     that rounded to nearest even.
 * Bytes: ceil(n / 2) codes + nb = ceil(n / 64) absmax codes + 4 ceil(nb /
 * 256) + 4 (offset): about 0.5 + 1/64 + 1/4096 bytes per element.
 *
 * int8 (MTI_QF_INT8): blocks of 64; scale = max |x| / 127 (fp32 division,
 * 0 for a block of zeros); code = x / scale rounded half to even, clamped
 * to [-127, 127] (0 where scale is 0); value = code * scale. Bytes: n codes
 * + 4 ceil(n / 64): 1.0625 per element.
 *
 * Inputs must be finite: the quantizers refuse a NaN or an infinity with
 * MT_ERR_INVALID_ARG, saying where it is.
 */
#ifndef MT_QUANT_H
#define MT_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* A quantization format. lib/quant/quant.c keeps one table entry per format
 * (name, layout, quantizer, dequantizer, check), MTI_QF_COUNT of them. */
typedef enum mti_qformat {
    MTI_QF_NONE = 0, /* not quantized (an mti_param's weights as they are) */
    MTI_QF_INT8 = 1, /* int8, one fp32 scale per block of MTI_QF_BLOCK */
    MTI_QF_NF4 = 2,  /* NF4, block MTI_QF_BLOCK, double-quantized absmax */
    MTI_QF_COUNT     /* one past the last format */
} mti_qformat;

/* The format of a public base format (MT_BASE_FULL: MTI_QF_NONE): the
 * same numbers, as these assertions keep them, and every format is one. */
_Static_assert(MT_BASE_FULL == (int)MTI_QF_NONE && MT_BASE_INT8 == (int)MTI_QF_INT8 &&
                   MT_BASE_NF4 == (int)MTI_QF_NF4 && MT_BASE_NF4 + 1 == (int)MTI_QF_COUNT,
               "mt_base_format and mti_qformat number the formats alike");
static inline mti_qformat mti_qformat_of(mt_base_format b) { return (mti_qformat)b; }

#define MTI_QF_BLOCK 64       /* elements per block, both formats */
#define MTI_QF_STAT_BLOCK 256 /* NF4: absmaxes per block of the double quantization */

/* Where each part of a quantized tensor of n elements lies in its buffer
 * (byte offsets) and how many entries it has. Parts a format does not have
 * have 0 entries. */
typedef struct mti_qparts {
    size_t n;                 /* elements */
    size_t blocks;            /* ceil(n / MTI_QF_BLOCK) */
    size_t scale, scale_n;    /* int8: fp32 scales (blocks) */
    size_t absmax2, absmax2_n; /* NF4: fp32 absmax of each stat block */
    size_t offset;            /* NF4: one fp32, the mean of the absmaxes */
    size_t qabsmax;           /* NF4: uint8 code of each block's absmax (blocks) */
    size_t codes, codes_n;    /* the codes: int8 (n) or packed nibbles (ceil(n / 2)) */
    size_t bytes;             /* total */
} mti_qparts;

/* The layout of a quantized tensor; MT_ERR_INVALID_ARG for an unknown
 * format. */
mt_status mti_quant_parts(mti_qformat f, size_t n, mti_qparts *out);
/* Bytes of a quantized tensor of n elements (0 for an unknown format). */
size_t mti_quant_bytes(mti_qformat f, size_t n);
/* The format's name ("int8", "nf4"), or NULL (MTI_QF_NONE, or no format). */
const char *mti_quant_name(mti_qformat f);

/* Whether format f can hold x (n fp32 values): every value finite, and
 * for NF4 a finite float32 mean of the blocks' absolute maxima (the
 * offset of its double quantization). MT_OK, or MT_ERR_INVALID_ARG with a
 * message ("quantize nf4: ..."; ctx may be NULL). */
mt_status mti_quant_check(mt_context *ctx, mti_qformat f, const float *x, size_t n);
/* Quantizes x (n fp32 values) into q (mti_quant_bytes(f, n) bytes). Takes
 * no memory. Values mti_quant_check refuses are refused before q changes.
 * ctx (may be NULL) receives the message of a failure. */
mt_status mti_quantize(mt_context *ctx, mti_qformat f, const float *x, size_t n, void *q);

/* Elements [at, at + len) of the quantized tensor q (of n elements) into
 * out (len values of dt, MTI_F32 or MTI_BF16). Any range: it need not
 * start or end on a block. */
mt_status mti_dequantize(mt_context *ctx, mti_qformat f, const void *q, size_t n, size_t at,
                         size_t len, void *out, mti_dtype dt);

/* The argument checks of an op table's embedding_fwd_q (op names it in the
 * message): MT_ERR_INVALID_ARG for a negative size, a NULL table or an
 * unknown format; MT_ERR_UNSUPPORTED for a dt other than fp32 or bf16. */
mt_status mti_quant_emb_check(mt_context *ctx, const char *op, const void *wq, mti_qformat qf,
                              int V, int B, int T, int C, mti_dtype dt);
/* The same for matmul_fwd_q and matmul_dx_q (n rows, in -> out): a
 * negative size, a NULL weight or an unknown format; a dt other than fp32
 * or bf16. */
mt_status mti_quant_mm_check(mt_context *ctx, const char *op, const void *wq, mti_qformat qf,
                             int n, int in, int out, mti_dtype dt);

/* The 16 NF4 levels, ascending, -1 to 1 with an exact 0 at index 7. */
const float *mti_nf4_code(void);

#endif /* MT_QUANT_H */
