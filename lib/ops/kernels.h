/*
 * kernels.h - the op table.
 *
 * One table of operations, implemented twice with the same names and
 * semantics: kernels/cpu (the reference, and the CPU backend) and
 * kernels/cuda (launched on the context's stream). A context's table is
 * ctx->ops. One conformance suite (test/test_ops.c) runs the same cases
 * against both.
 *
 * Conventions:
 *   - Pointers are device pointers of the table's device. Tensors are dense
 *     and row-major; shapes are written beside each op, e.g. (B,T,C).
 *   - `dt` is the storage dtype of the tensors marked dt (fp32, fp16 or
 *     bf16). Everything is computed and accumulated in fp32 (GEMMs,
 *     reductions, softmax statistics); results are rounded to dt once, to
 *     nearest even.
 *   - Parameter gradients are always fp32 and accumulated (+=), so gradient
 *     accumulation over micro-batches is the same code; the ops that make a
 *     gradient whole (matmul_bwd, layernorm_bwd: MTI_BWD_SET_DW) can write
 *     it instead, which the engine asks for on a gradient's first
 *     contribution of a step, so a gradient is never zeroed only to be
 *     added to once. Gradients of activations are in dt; `accumulate` (or
 *     the flag MTI_BWD_ACC_DX) says whether an op adds into dx (residual
 *     streams) or overwrites it.
 *   - Saved statistics (layernorm mean and rstd, attention logsumexp) are
 *     fp32.
 *   - On the CPU every reduction runs in a fixed order, so results do not
 *     depend on the number of threads.
 *   - Ops return MT_OK or a status (a device launch failing, or workspace
 *     running out); they never change their inputs unless an output aliases
 *     one, where the op says it may.
 *   - Workspace an op needs beyond its arguments comes from the context's
 *     WORK allocator (mti_work_alloc), so it is counted like everything else.
 */
#ifndef MT_KERNELS_H
#define MT_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "quant/quant.h"
#include "sparse/sparse.h"

/* What every op gets: the context (errors, workspace) and its device. */
typedef struct mti_kctx {
    mt_context *ctx;
    mti_device *dev;
} mti_kctx;

/* A dry run (an estimate, lib/engine/estimate.c, on lib/device/device_dry.c): every op of
 * every table checks this first; an op that takes workspace takes it and
 * frees it with its real size, and no op computes anything. */
static inline bool mti_dry(const mti_kctx *k) { return k && k->ctx && k->ctx->dry; }

/* Workspace of `bytes` from the context's WORK allocator, lifetime PHASE,
 * freed with mti_work_free before the op returns. */
mt_status mti_work_alloc(const mti_kctx *k, size_t bytes, mt_block *out);
void mti_work_free(const mti_kctx *k, mt_block *b);

typedef enum mti_rounding {
    MTI_ROUND_NEAREST = 0,    /* to nearest, ties to even */
    MTI_ROUND_STOCHASTIC = 1  /* bf16 only: probability proportional to the distance */
} mti_rounding;

/* SGD as torch.optim.SGD: d = g * grad_scale + wd * p;
 * m = momentum * m + (1 - dampening) * d, except m = d on the first step;
 * d = nesterov ? d + momentum * m : m (when momentum > 0); p -= lr * d. */
typedef struct mti_sgd_args {
    float lr, momentum, dampening, weight_decay;
    int nesterov;
    int first_step;   /* the momentum buffer is uninitialised: m = d */
    float grad_scale; /* gradients are multiplied by this first (1: none) */
} mti_sgd_args;

/* AdamW as torch.optim.AdamW (docs/engine.md, Optimizers), step t from 1:
 * g = g * grad_scale; p *= 1 - lr * wd; m = b1 m + (1 - b1) g;
 * v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). */
typedef struct mti_adamw_args {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;
    float grad_scale;
} mti_adamw_args;

/* 8-bit blockwise AdamW as bitsandbytes >= 0.44 (docs/engine.md, Optimizers):
 * its CUDA kernel, kOptimizerStatic8bit2StateBlockwise.
 * The state of n elements: qm, qv (n) uint8 codes into the signed map (m)
 * and the unsigned map (v) of mti_q8_map; absmax_m, absmax_v
 * (ceil(n / MTI_Q8_BLOCK)) fp32, one per block of MTI_Q8_BLOCK elements.
 * Per element: g = g * grad_scale; m, v dequantized (code value * absmax of
 * the block); a non-finite g sets m = v = 0 and leaves p unchanged; else
 * m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
 * p += -lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps sqrt(1 - b2^t)),
 * then p *= 1 - lr wd (decoupled, after the step). Each block's new absmax
 * is max |m| (|v|) over the block, and each value is stored as the code
 * nearest value / absmax (IEEE division), by bitsandbytes' rule: the
 * value is compared with the fp32 midpoints (c[k] + c[k+1]) / 2 of
 * adjacent codes, a value exactly on a midpoint takes the even code of the
 * two, and NaN takes code 0; then a first moment whose sign bit differs
 * from its code's (a negative or -0 value that landed on the code of 0)
 * moves one code toward its sign, so small negative moments stay negative.
 * A block whose new absmax is 0 (all zeros) stores the zero codes, so it
 * equals a fresh state (bitsandbytes divides 0 by 0 there and stores code
 * 255 for m: the same values). The args are those of AdamW. A fresh state
 * is filled with mti_q8_zero_code and absmax 0 (bitsandbytes zeroes the
 * bytes: code 0 with absmax 0 decodes to the same zeros). The op quantizes
 * any n; bitsandbytes' optimizer keeps 32-bit state for tensors under 4096
 * elements (min_8bit_size), which is the caller's choice. Differences from
 * the kernel, all within rounding: its divisions are approximate
 * (__fdividef), it may fuse multiply-adds, and it tests g for finiteness
 * before grad_scale. */
#define MTI_Q8_BLOCK 256
/* Elements per piece of a stochastic rounding seeded per piece (adamw8_bf16,
 * and the trainer's update of weights without masters). */
#define MTI_SR_PIECE ((size_t)1 << 16)

/* 4-bit AdamW after Li, Chen, Zhu, "Memory Efficient Optimizers with 4-bit
 * States" (NeurIPS 2023) and its code (lpmm, default configuration; docs/
 * engine.md, Optimizers). The update is torch's AdamW (as the adamw op:
 * g = g * grad_scale; p = p * (1 - lr wd) - lr / (1 - b1^t) * m /
 * (sqrt(v) / sqrt(1 - b2^t) + eps), with m = b1 m + (1 - b1) g and
 * v = b2 v + (1 - b2) g^2 from the dequantized state), then both moments
 * are quantized again, to nearest (no stochastic rounding):
 *   - m: blocks of MTI_Q4_BLOCK elements of the flat tensor, absmax_m (one
 *     fp32 per block) = max |m|, code = the nearest level of m / absmax
 *     (IEEE division) in the signed 4-bit dynamic-exponent map
 *     (mti_q4_map(1): +-{0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625,
 *     0.8875}, 0 and 1); a block whose absmax is 0 stores the code of 0;
 *   - v: with `rank1` (a matrix of rows x cols), normalised rank-1: the
 *     scale of element (r, c) is min(rowmax[r], colmax[c]) of the new v,
 *     scale_v holding the rows' maxima then the columns'; else (a vector)
 *     blocks of MTI_Q4_BLOCK with one absmax each in scale_v. The code is
 *     the nearest level of v / scale in the linear map without zero
 *     (mti_q4_map(0): k / 16, k = 1..16), so no nonzero second moment
 *     dequantizes to 0 (the zero-point problem of 8-bit AdamW); a scale of
 *     0 (v = 0 there) stores code 0;
 *   - nearest: the count of midpoints fl(c[k] + c[k+1]) * 0.5 strictly
 *     below the value (a tie takes the lower level), as lpmm's search;
 *   - codes are packed two to a byte, element 2i in the low nibble of byte
 *     i and 2i + 1 in the high one (lpmm's order); an odd n pads the last
 *     high nibble with the fresh state's code (7 for m, 0 for v);
 *   - a non-finite g sets that element's m = v = 0 and leaves p unchanged
 *     (as the adamw8 op; lpmm has no such rule).
 * State: qm, qv (ceil(n / 2)) bytes; absmax_m (ceil(n / MTI_Q4_BLOCK));
 * scale_v (rows + cols, or ceil(n / MTI_Q4_BLOCK)). A fresh state is qm
 * filled with 0x77 (the code of 0, twice), everything else 0. The rank-1
 * update needs the whole matrix: it computes the new maxima first (a pass
 * that does not write), then updates and quantizes; its workspace is
 * (rows + threads x cols) floats on the CPU, rows + cols on the GPU. Bits
 * do not depend on the thread count. n = rows * cols in both cases. */
#define MTI_Q4_BLOCK 128
typedef struct mti_adamw4_state {
    uint8_t *qm, *qv;
    float *absmax_m, *scale_v;
} mti_adamw4_state;

/* Elements per round of the sumsq op (see there). */
#define MTI_SUMSQ_ROUND (64 * 4096)

/* Adafactor as HuggingFace transformers' Adafactor (docs/engine.md, Optimizers;
 * not torch.optim.Adafactor), step t from 1:
 *   g = g * grad_scale; rms_p = RMS(p) (before the update);
 *   lr_t = relative_step ? min(warmup_init ? 1e-6 t : 1e-2, 1/sqrt(t)) : lr;
 *   if scale_parameter: lr_t *= max(eps2, rms_p);
 *   beta2t = 1 - t^decay_rate; u = g^2 + eps1;
 *   factored (a matrix of rows x cols): row = beta2t row + (1 - beta2t) mean_cols(u),
 *     col = beta2t col + (1 - beta2t) mean_rows(u),
 *     upd = (rsqrt(row / mean(row)) * rsqrt(col)) * g;
 *   else: v = beta2t v + (1 - beta2t) u, upd = rsqrt(v) * g;
 *   upd /= max(1, RMS(upd) / clip_threshold); upd *= lr_t;
 *   if beta1 > 0: m = beta1 m + (1 - beta1) upd, upd = m;
 *   if weight_decay: p -= weight_decay * lr_t * p;  p -= upd.
 * rsqrt(x) is 1 / sqrt(x). transformers factors a tensor of rank > 2 per
 * trailing matrix, with the RMS over the whole tensor: that is not one call
 * of this op (a matrix is). clip_threshold must be > 0, and warmup_init
 * needs relative_step. Reductions (means, RMS) are in fp32 in a fixed
 * order. No temporaries: the update is recomputed in each pass instead of
 * stored; the CPU table takes no workspace, the CUDA table 4 KiB (partial
 * sums and the step's scalars), whatever the shape. */
typedef struct mti_adafactor_args {
    float lr;              /* used when relative_step is 0 */
    float eps1, eps2;      /* 1e-30, 1e-3 */
    float clip_threshold;  /* 1.0 */
    float decay_rate;      /* -0.8 */
    float beta1;           /* <= 0: no first moment (m unused, may be NULL) */
    float weight_decay;
    int scale_parameter, relative_step, warmup_init;
    int64_t step;
    float grad_scale;
} mti_adafactor_args;

/* Flags of matmul_bwd and layernorm_bwd (their last argument; 0 and 1 keep
 * their meaning of a plain `accumulate`). */
#define MTI_BWD_ACC_DX 1 /* dx += the input gradient (else dx = it) */
#define MTI_BWD_SET_DW 2 /* the weight's and bias's gradients = the sums (else +=); an
                            empty sum (no rows) writes zeros */

/* sparse_matmul_choice's answers */
#define MTI_SPMM_NONE 0
#define MTI_SPMM_SLOWER 1
#define MTI_SPMM_FASTER 2

typedef struct mti_ops mti_ops;

/* Every member after `device` is an op (a function pointer), and both
 * tables have every one: each table is made from MTI_OPS (below), so one
 * that lacks an op does not build, and test/test_registries.c walks the
 * members of the tables as they are and fails on one left NULL. */
struct mti_ops {
    const char *name;     /* "cpu", "cuda" */
    mt_device_kind device;

    /* ---- casts ---- */
    /* dst (n) in dst_dt = src (n) in src_dt. Narrowing rounds to nearest even
     * (fp16: values beyond 65504 round to inf as torch does; NaN stays NaN),
     * or, for bf16 with MTI_ROUND_STOCHASTIC, up or down with probability
     * proportional to the distance, from a counter-based generator of (seed,
     * element index), so the result does not depend on threads (stochastic
     * rounding to another dtype is MT_ERR_INVALID_ARG). dst may not alias
     * src unless the dtypes have the same size. */
    mt_status (*cast)(const mti_kctx *k, void *dst, mti_dtype dst_dt, const void *src,
                      mti_dtype src_dt, size_t n, mti_rounding r, uint64_t seed);

    /* ---- embedding: token + position ---- */
    /* out (B,T,C) = wte[tok[b,t]] (V,C) + wpe[t] (maxT,C); out, wte, wpe in dt;
     * wpe may be NULL (no positions). Tokens are checked by the caller to be
     * in [0, V). */
    mt_status (*embedding_fwd)(const mti_kctx *k, void *out, const int32_t *tok, const void *wte,
                               const void *wpe, int B, int T, int C, mti_dtype dt);
    /* dwte (V,C) += dout rows scattered by token; dwpe (maxT,C) += dout summed
     * over B; fp32, in a fixed order (deterministic). Either may be NULL. */
    mt_status (*embedding_bwd)(const mti_kctx *k, float *dwte, float *dwpe, const void *dout,
                               const int32_t *tok, int B, int T, int C, mti_dtype dt);
    /* embedding_fwd of rows [v0, v1) of a token table (wte pointing at row
     * v0) without positions: out (B,T,C) row = wte[tok - v0] for a token in
     * the range, zeros for any other (tensor parallel's share of the
     * vocabulary; the group's sum is embedding_fwd's table rows). */
    mt_status (*embedding_fwd_rows)(const mti_kctx *k, void *out, const int32_t *tok,
                                    const void *wte, int v0, int v1, int B, int T, int C,
                                    mti_dtype dt);
    /* Rows [v0, v1) of embedding_bwd's dwte, dwte pointing at row v0: the
     * rows of dout whose token is in the range, added as embedding_bwd adds
     * them (the same bits). */
    mt_status (*embedding_dw_rows)(const mti_kctx *k, float *dwte, const void *dout,
                                   const int32_t *tok, int B, int T, int C, int v0, int v1,
                                   mti_dtype dt);

    /* ---- matmul with bias: y = x W^T + b ---- */
    /* y (N,O) = x (N,I) . W (O,I)^T + b (O); all in dt; b may be NULL. */
    mt_status (*matmul_fwd)(const mti_kctx *k, void *y, const void *x, const void *w, const void *b,
                            int n, int in, int out, mti_dtype dt);
    /* dx (N,I) in dt = (or += with MTI_BWD_ACC_DX) dy (N,O) . W; dW (O,I) +=
     * dy^T . x; db (O) += sum over rows of dy (both = with MTI_BWD_SET_DW, the
     * same bits as += onto zeros); dW and db fp32. dx, dw, db may each be
     * NULL. */
    mt_status (*matmul_bwd)(const mti_kctx *k, void *dx, float *dw, float *db, const void *dy,
                            const void *x, const void *w, int n, int in, int out, mti_dtype dt,
                            int flags);
    /* Rows [o0, o1) of matmul_bwd's dW (O,I), dw pointing at row o0:
     * dW[o0:o1] += (with MTI_BWD_SET_DW in flags, =) dy[:, o0:o1]^T . x,
     * with the bits matmul_bwd gives those rows when o0 and o1 are
     * multiples of matmul_dw_align(out, in) (or o1 = out); other rows are
     * refused. A row-sliced weight gradient (the fused step's tied table)
     * is made this way. */
    int (*matmul_dw_align)(int out, int in);
    mt_status (*matmul_dw_rows)(const mti_kctx *k, float *dw, const void *dy, const void *x,
                                int n, int in, int out, int o0, int o1, mti_dtype dt, int flags);

    /* ---- matmul with a quantized, frozen weight ---- */
    /* W (O,I) is a quantized tensor of O*I elements (lib/quant/quant.h): format qf
     * (MTI_QF_INT8 or MTI_QF_NF4), one buffer of
     * mti_quant_bytes(qf, O*I) bytes on the table's device laid out as
     * mti_quant_parts says. A quantized weight is frozen, so there is a
     * forward and an input gradient, and no weight gradient. Both give the
     * bits of matmul_fwd / matmul_bwd's dx on the dequantized W (as
     * mti_dequantize makes it in dt); W is never dequantized whole: the
     * op dequantizes the parts it reads into WORK (per tile, or inside the
     * GEMM's operand load). dt is fp32 or bf16 (fp16, or a device without
     * the kernels: MT_ERR_UNSUPPORTED); an unknown qf is
     * MT_ERR_INVALID_ARG.
     * y (N,O) = x (N,I) . deq(W)^T + b (O); b may be NULL. */
    mt_status (*matmul_fwd_q)(const mti_kctx *k, void *y, const void *x, const void *wq,
                              mti_qformat qf, const void *b, int n, int in, int out, mti_dtype dt);
    /* dx (N,I) = (or += with accumulate) dy (N,O) . deq(W). */
    mt_status (*matmul_dx_q)(const mti_kctx *k, void *dx, const void *dy, const void *wq,
                             mti_qformat qf, int n, int in, int out, mti_dtype dt, int accumulate);
    /* embedding_fwd with the token table (V,C) quantized as a (V,C)
     * weight (the frozen table of a quantized base, which is also the tied
     * LM head's W): each looked-up row dequantized in dt as mti_dequantize
     * makes it, then embedding_fwd's sum with wpe, so the result equals
     * embedding_fwd on the dequantized table bit for bit. The table is never
     * dequantized whole (no WORK). dt fp32 or bf16 (else
     * MT_ERR_UNSUPPORTED); an unknown qf is MT_ERR_INVALID_ARG. */
    mt_status (*embedding_fwd_q)(const mti_kctx *k, void *out, const int32_t *tok, const void *wq,
                                 mti_qformat qf, int V, const void *wpe, int B, int T, int C,
                                 mti_dtype dt);
    /* out (len) in dt = elements [at, at + len) of the quantized tensor wq
     * (n elements, format qf), as mti_dequantize makes them: any range, on a
     * block's boundary or not. The model reads a quantized weight back
     * through it. dt fp32 or bf16; another dt, an unknown qf or a range
     * outside the tensor is MT_ERR_INVALID_ARG. */
    mt_status (*dequantize)(const mti_kctx *k, void *out, const void *wq, mti_qformat qf, size_t n,
                            size_t at, size_t len, mti_dtype dt);

    /* ---- a pruned tensor (lib/sparse/sparse.h) ----
     * vals: its kept values (dt), meta: its description (L->bytes, device
     * memory), L: its layout (host). Any range [at, at + len) of its
     * L->dense elements. */
    /* dense (len, dt) = elements [at, at + len), zeros where pruned. */
    mt_status (*sparse_expand)(const mti_kctx *k, void *dense, const void *vals, const void *meta,
                               const mti_sp_layout *L, size_t at, size_t len, mti_dtype dt);
    /* The kept elements among dense (len, dt: elements [at, at + len)) into
     * their values; with add (fp32 only) added to them. */
    mt_status (*sparse_compress)(const mti_kctx *k, void *vals, const void *dense,
                                 const void *meta, const mti_sp_layout *L, size_t at, size_t len,
                                 mti_dtype dt, int add);
    /* The GEMMs of a linear map whose W (out, in) is pruned, from its kept
     * values (vals in dt, meta, L as above; L->dense = out * in), without a
     * dense tile. sparse_matmul_choice: MTI_SPMM_NONE where the table has
     * no such GEMMs (the two others then fail with MT_ERR_UNSUPPORTED),
     * else MTI_SPMM_FASTER where they are expected to beat the dense tile
     * (expand, matmul_fwd / matmul_bwd, compress) for this shape, density
     * and dtype, MTI_SPMM_SLOWER where not. Their results are the dense
     * tile's but for the order of the sums (fixed by the shapes and the
     * mask, not by the thread count), and for non-finite inputs, which
     * never meet a pruned place (the tile's 0 x inf). */
    int (*sparse_matmul_choice)(const mti_kctx *k, const mti_sp_layout *L, int n, int in, int out,
                                mti_dtype dt);
    /* y (N,out) = x W^T + b, as matmul_fwd (b may be NULL). */
    mt_status (*sparse_matmul_fwd)(const mti_kctx *k, void *y, const void *x, const void *vals,
                                   const void *meta, const mti_sp_layout *L, const void *b, int n,
                                   int in, int out, mti_dtype dt);
    /* matmul_bwd's dx, dW and db (each NULL when not wanted; flags as
     * matmul_bwd's), dW as its kept elements alone: dw holds L->nnz fp32
     * values in the kept values' order; the pruned ones are never made. */
    mt_status (*sparse_matmul_bwd)(const mti_kctx *k, void *dx, float *dw, float *db,
                                   const void *dy, const void *x, const void *vals,
                                   const void *meta, const mti_sp_layout *L, int n, int in,
                                   int out, mti_dtype dt, int flags);

    /* ---- layernorm, eps 1e-5 ---- */
    /* out (N,C) = (x - mean) * rstd * w + b, per row; mean, rstd (N) saved
     * (either may be NULL when not needed); x, w, b, out in dt. */
    mt_status (*layernorm_fwd)(const mti_kctx *k, void *out, float *mean, float *rstd,
                               const void *x, const void *w, const void *b, int n, int c,
                               mti_dtype dt);
    /* dx (N,C) in dt = (or += with MTI_BWD_ACC_DX) the input gradient; dw, db
     * (C) fp32 += (= with MTI_BWD_SET_DW). Uses the saved mean and rstd. dx
     * may alias dout; dx, dw and db may each be NULL. */
    mt_status (*layernorm_bwd)(const mti_kctx *k, void *dx, float *dw, float *db, const void *dout,
                               const void *x, const void *w, const float *mean, const float *rstd,
                               int n, int c, mti_dtype dt, int flags);

    /* ---- activations (elementwise over n) ---- */
    /* GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). y may alias x. */
    mt_status (*gelu_fwd)(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt);
    /* dx = dy * gelu'(x); dx may alias dy. */
    mt_status (*gelu_bwd)(const mti_kctx *k, void *dx, const void *dy, const void *x, size_t n,
                          mti_dtype dt);
    /* ReLU: y = x < 0 ? 0 : x (NaN and -0 pass through); the backward needs
     * only the output's sign: dx = y > 0 ? dy : 0. y may alias x, dx may
     * alias dy. */
    mt_status (*relu_fwd)(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt);
    mt_status (*relu_bwd)(const mti_kctx *k, void *dx, const void *dy, const void *y, size_t n,
                          mti_dtype dt);

    /* ---- residual ---- */
    /* y = a + b (n, dt); y may alias a or b. */
    mt_status (*add)(const mti_kctx *k, void *y, const void *a, const void *b, size_t n,
                     mti_dtype dt);
    /* y += x (n, dt). */
    mt_status (*accumulate)(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt);

    /* ---- causal self-attention, memory-efficient ---- */
    /* qkv (B,T,3C): per token the queries of the H heads (C values, head h at
     * h*hs), then the keys, then the values, hs = C/H. out (B,T,C) in the same
     * head layout; lse (B,H,T) = the logsumexp of each query row's scaled
     * scores (scale 1/sqrt(hs), keys 0..t). The (T,T) scores and
     * probabilities are never stored: keys are visited in blocks with an
     * online softmax. The CUDA table takes head sizes up to 256
     * (MT_ERR_UNSUPPORTED beyond). */
    mt_status (*attention_fwd)(const mti_kctx *k, void *out, float *lse, const void *qkv, int B,
                               int T, int C, int H, mti_dtype dt);
    /* dqkv (B,T,3C) in dt (overwritten) from dout (B,T,C), the forward's
     * inputs and outputs; the probabilities are recomputed block by block from
     * q, k and lse. */
    mt_status (*attention_bwd)(const mti_kctx *k, void *dqkv, const void *dout, const void *qkv,
                               const void *out, const float *lse, int B, int T, int C, int H,
                               mti_dtype dt);

    /* ---- softmax cross-entropy over a vocabulary, fused ---- */
    /* logits (N,Vp) in dt, of which the first V columns are real. losses (N)
     * fp32 = logsumexp(logits[:V]) - logits[target] (losses may be NULL when
     * only the gradient is wanted). With dlogits non-NULL:
     * dlogits (N,Vp) in dt = (softmax(logits[:V]) - onehot(target)) * dloss,
     * padding columns 0; dlogits may alias logits, so no probability tensor
     * is ever kept. Targets are checked by the caller to be in [0, V). */
    mt_status (*xent)(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                      const int32_t *targets, int n, int V, int Vp, float dloss, mti_dtype dt);
    /* Distillation, fused the same way: with student logits s (N,Vp) in dt
     * and teacher logits t (N,tVp) fp32 (V real columns each), losses (N)
     * fp32 = (1 - alpha) xent(s, target) + alpha T^2 KL(softmax(t/T) ||
     * softmax(s/T)), and with dlogits non-NULL dlogits (N,Vp) in dt =
     * dloss ((1 - alpha)(softmax(s) - onehot(target)) + alpha T
     * (softmax(s/T) - softmax(t/T))), padding columns 0; dlogits may alias
     * logits. Row by row: no probability tensor is kept. alpha in [0, 1],
     * T > 0 (else MT_ERR_INVALID_ARG); with alpha 0 the result is xent's,
     * bit for bit, and t is not read. */
    mt_status (*xent_kd)(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                         const float *tlogits, const int32_t *targets, int n, int V, int Vp,
                         int tVp, float alpha, float temp, float dloss, mti_dtype dt);

    /* The cross-entropy of logits split by vocabulary over a group of
     * ranks (tensor parallel; never gathered), in three phases around the
     * group's all-reduces. logits (N,W) in dt are the whole's columns [v0,
     * v0 + W), the first Vr of them real; stats (3,N) fp32.
     *   phase 0: stats[0][r] = the max of row r's real logits here (-inf
     *            with none); the group takes the max;
     *   phase 1: with stats[0][r] the group's max m: stats[1][r] = the sum
     *            of exp(x - m) over the real logits here, stats[2][r] = the
     *            target's logit if its column is here, else 0; the group
     *            sums both;
     *   phase 2: losses (N) = log(stats[1]) - (stats[2] - m) (losses may
     *            be NULL), and with dlogits (may alias logits) dlogits =
     *            (exp(x - m) (dloss / stats[1]) - dloss at the target),
     *            padding columns 0: xent's formulas. */
    mt_status (*xent_vp)(const mti_kctx *k, int phase, float *stats, float *losses, void *dlogits,
                         const void *logits, const int32_t *targets, int n, int v0, int Vr, int W,
                         float dloss, mti_dtype dt);

    /* ---- mixed precision ---- */
    /* g (n) fp32 *= inv_scale, and *found_inf (a device int) = 1 if any
     * element of g is inf or NaN (it is never cleared here). With inv_scale
     * 1 (the non-finite check of fp32 and bf16 steps) g is only read. */
    mt_status (*unscale_check)(const mti_kctx *k, float *g, size_t n, float inv_scale,
                               int *found_inf);
    /* *sumsq (a device float) += the sum of g^2 over n fp32 values: squares
     * summed in fp32 over blocks of 4096, block sums in a fixed pairwise tree
     * per round of MTI_SUMSQ_ROUND elements, and the rounds added onto *sumsq
     * in order. So a tensor summed in pieces that each start at a multiple
     * of MTI_SUMSQ_ROUND (of the tensor) gives the bits of one call. */
    mt_status (*sumsq)(const mti_kctx *k, float *sumsq, const float *g, size_t n);

    /* ---- optimizer updates: fp32 masters p, fp32 gradients g ---- */
    /* With pc non-NULL, pc (n) in pc_dt = p rounded to nearest even after the
     * update: the compute copy is refreshed in the same pass. */
    mt_status (*sgd)(const mti_kctx *k, float *p, const float *g, float *m, void *pc,
                     mti_dtype pc_dt, size_t n, const mti_sgd_args *a);
    mt_status (*adamw)(const mti_kctx *k, float *p, const float *g, float *m, float *v, void *pc,
                       mti_dtype pc_dt, size_t n, const mti_adamw_args *a);
    /* 8-bit blockwise AdamW (see above); pc as for adamw. */
    mt_status (*adamw8)(const mti_kctx *k, float *p, const float *g, uint8_t *qm, uint8_t *qv,
                        float *absmax_m, float *absmax_v, void *pc, mti_dtype pc_dt, size_t n,
                        const mti_adamw_args *a);
    /* 8-bit AdamW of weights held in bf16 alone (no fp32 masters), in one
     * pass: each weight widened (exactly), updated as adamw8 updates p, and
     * rounded back to bf16 stochastically. Element j of w is element
     * e = at + j of its tensor (at a multiple of MTI_Q8_BLOCK; g and the
     * state point at element at, as for adamw8); its random bits are those
     * of element e mod MTI_SR_PIECE of a cast seeded with
     * seed ^ (e - e mod MTI_SR_PIECE). So the result is the bits of, for
     * each MTI_SR_PIECE-aligned piece, cast to fp32, adamw8, and cast to
     * bf16 with stochastic rounding under that seed; and a tensor updated
     * in pieces rounds as one call. */
    mt_status (*adamw8_bf16)(const mti_kctx *k, uint16_t *w, const float *g, uint8_t *qm,
                             uint8_t *qv, float *absmax_m, float *absmax_v, size_t n, size_t at,
                             uint64_t seed, const mti_adamw_args *a);
    /* 4-bit AdamW (see above) of p viewed as (rows, cols); rank1 selects the
     * second moment's normalisation. pc as for adamw. */
    mt_status (*adamw4)(const mti_kctx *k, float *p, const float *g, const mti_adamw4_state *st,
                        void *pc, mti_dtype pc_dt, int64_t rows, int64_t cols, int rank1,
                        const mti_adamw_args *a);
    /* Adafactor (see above) of p viewed as (rows, cols). factored: row (rows) and
     * col (cols) hold the factored second moment and v is unused (may be NULL);
     * else v (rows * cols) holds it and row, col are unused. m (rows * cols) is
     * the first moment when a->beta1 > 0. pc as for adamw. */
    mt_status (*adafactor)(const mti_kctx *k, float *p, const float *g, float *row, float *col,
                           float *v, float *m, void *pc, mti_dtype pc_dt, int64_t rows,
                           int64_t cols, int factored, const mti_adafactor_args *a);
};

/* The ops of struct mti_ops, by member name. A table is made from this list,
 * each op its implementation's name (kernels/cpu/ops.c: mti_cpu_<op>;
 * kernels/cuda/ops_cuda.c: cu_<op>), so a table without an op does not build; the
 * assertion keeps the list the struct's members (a name that is none fails
 * to build, and a member the list lacks leaves the count short). */
#define MTI_OPS(X)                                                                                 \
    X(cast) X(embedding_fwd) X(embedding_fwd_rows) X(embedding_bwd) X(embedding_dw_rows) X(matmul_fwd) X(matmul_bwd)     \
    X(matmul_dw_align) X(matmul_dw_rows) X(matmul_fwd_q) X(matmul_dx_q) X(embedding_fwd_q)         \
    X(dequantize) X(sparse_expand) X(sparse_compress) X(sparse_matmul_choice) X(sparse_matmul_fwd) X(sparse_matmul_bwd) X(layernorm_fwd) X(layernorm_bwd) X(gelu_fwd) X(gelu_bwd) X(relu_fwd)            \
    X(relu_bwd) X(add) X(accumulate) X(attention_fwd) X(attention_bwd) X(xent) X(xent_kd) X(xent_vp)          \
    X(unscale_check) X(sumsq) X(sgd) X(adamw) X(adamw8) X(adamw8_bf16) X(adamw4) X(adafactor)
#define MTI_OP_ONE(op) +1
_Static_assert(sizeof(mti_ops) ==
                   offsetof(mti_ops, cast) + (0 MTI_OPS(MTI_OP_ONE)) * sizeof(void (*)(void)),
               "MTI_OPS lists every op of mti_ops");
#undef MTI_OP_ONE

/* The CPU table, and the CPU thread count of its kernels: the context's
 * (ctx->threads; 1 without a context). The parallelism is the library's own
 * (OpenMP); the GEMM library runs single-threaded inside it, so results do
 * not depend on the thread count. */
const mti_ops *mti_cpu_ops(void);
static inline int mti_cpu_threads(const mti_kctx *k)
{
    return k && k->ctx && k->ctx->threads > 0 ? k->ctx->threads : 1;
}
/* The class of CPU instructions the CPU table uses (kernels/cpu/arch.h):
 * the CPU's, capped by the environment variable MT_CPU_ISA. mti_isa_check:
 * 0, or -1 with a message in msg when MT_CPU_ISA names no class or could
 * not cap oneDNN (the first call reads it, and caps oneDNN). */
int mti_isa_check(char *msg, size_t cap);
const char *mti_isa_used_name(void);

/* The CUDA table (MT_ERR_UNSUPPORTED when the device has no kernels). */
mt_status mti_cuda_ops(mti_device *d, const mti_ops **out);
/* The same table for a dry CUDA context (an estimate): its ops check their
 * arguments and take their workspace as on the GPU, and run nothing. */
const mti_ops *mti_cuda_dry_ops(void);
/* The CUDA table's dequantizing kernels (kernels/cuda/dequant.cu), which
 * its quantized matmuls run a tile at a time: rows [r0, r0 + rows) x
 * columns [c0, c0 + cols) of the (R, I) weight quantized in wq (format qf,
 * lib/quant/quant.h; device memory) into out (rows x cols, leading dimension ld)
 * in dt (fp32, fp16 or bf16), each value mti_dequantize's bits (fp16: its
 * fp32 value rounded to nearest even). Queued on the device's stream. */
mt_status mti_cuda_dequantize(const mti_kctx *k, mti_qformat qf, const void *wq, size_t R,
                              size_t I, size_t r0, size_t rows, size_t c0, size_t cols, void *out,
                              size_t ld, mti_dtype dt);

/* The 256-entry quantization maps of 8-bit optimizer states, ascending
 * (bitsandbytes' dynamic maps, built as lib/optim/q8map.c says): signed (first
 * moments) and unsigned (second moments). Computed once, constant. */
const float *mti_q8_map(int is_signed);
/* The code of 0.0 in a map (a fresh state is filled with it). */
uint8_t mti_q8_zero_code(int is_signed);
/* The 16-entry maps of 4-bit optimizer states, ascending (lpmm's, built as
 * lib/optim/q8map.c says): signed, the dynamic-exponent map of first moments
 * (0 at index MTI_Q4_ZERO); unsigned, the linear map without zero of second
 * moments (k / 16, k = 1..16). */
const float *mti_q4_map(int is_signed);
#define MTI_Q4_ZERO 7

/* ---- scalar conversions, the one definition both tables follow ---- */

/* fp32 -> fp16 / bf16 bits, round to nearest even; fp16/bf16 bits -> fp32. */
uint16_t mti_f32_to_f16(float f);
/* bf16 keeps the top 16 bits of an fp32: add half an ulp of the kept part,
 * plus one more if the kept part is odd (ties to even), then truncate. NaN
 * is kept a (quiet) NaN; overflow rounds to inf as it should. Inline: the
 * dequantizers call it per element. */
static inline uint16_t mti_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
float mti_f16_to_f32(uint16_t h);
float mti_bf16_to_f32(uint16_t h);
/* bf16 with stochastic rounding: `rnd` supplies the 16 random low bits. */
uint16_t mti_f32_to_bf16_sr(float f, uint32_t rnd);
/* The 32 random bits stochastic rounding uses for element i of a cast
 * seeded with `seed` (a counter-based hash: the same on every device). */
uint32_t mti_sr_bits(uint64_t seed, uint64_t i);
/* The seed under which element i gets the bits element i + offset gets
 * under `seed`: mti_sr_bits(mti_sr_seed_at(seed, o), i) ==
 * mti_sr_bits(seed, i + o), so a cast of a piece that starts o elements
 * into a range rounds as the cast of the whole range does. */
uint64_t mti_sr_seed_at(uint64_t seed, uint64_t offset);

#endif /* MT_KERNELS_H */
