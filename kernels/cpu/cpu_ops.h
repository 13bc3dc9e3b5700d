/*
 * cpu_ops.h - the functions of the CPU op table, one file per family of
 * ops in this folder; ops.c assembles the table. Semantics are those of the
 * table's entries in lib/ops/kernels.h.
 */
#ifndef MT_CPU_OPS_H
#define MT_CPU_OPS_H

#include "ops/kernels.h"

/* below this many elements a parallel region costs more than it saves */
#define MTI_CPU_PAR_MIN 16384

/* convert.c */
mt_status mti_cpu_cast(const mti_kctx *k, void *dst, mti_dtype dst_dt, const void *src,
                       mti_dtype src_dt, size_t n, mti_rounding r, uint64_t seed);
/* The op dequantize: lib/quant/quant.c's dequantizer. */
mt_status mti_cpu_dequantize(const mti_kctx *k, void *out, const void *wq, mti_qformat qf, size_t n,
                             size_t at, size_t len, mti_dtype dt);
mt_status mti_cpu_sparse_expand(const mti_kctx *k, void *dense, const void *vals, const void *meta,
                                const mti_sp_layout *L, size_t at, size_t len, mti_dtype dt);
mt_status mti_cpu_sparse_compress(const mti_kctx *k, void *vals, const void *dense,
                                  const void *meta, const mti_sp_layout *L, size_t at, size_t len,
                                  mti_dtype dt, int add);
/* sparse_mm.c */
int mti_cpu_sparse_matmul_choice(const mti_kctx *k, const mti_sp_layout *L, int n, int in, int out,
                                 mti_dtype dt);
mt_status mti_cpu_sparse_matmul_fwd(const mti_kctx *k, void *y, const void *x, const void *vals,
                                    const void *meta, const mti_sp_layout *L, const void *b, int n,
                                    int in, int out, mti_dtype dt);
mt_status mti_cpu_sparse_matmul_bwd(const mti_kctx *k, void *dx, float *dw, float *db,
                                    const void *dy, const void *x, const void *vals,
                                    const void *meta, const mti_sp_layout *L, int n, int in,
                                    int out, mti_dtype dt, int flags);
/* Loads n values of dt at src (element offset i) into fp32 dst / stores n
 * fp32 values as dt, rounding to nearest even. For the kernels' inner loops. */
void mti_cpu_load_f32(float *dst, const void *src, mti_dtype dt, size_t i, size_t n);
void mti_cpu_store_f32(void *dst, mti_dtype dt, size_t i, const float *src, size_t n);
/* n fp32 values into bf16 with stochastic rounding, as elements i .. i+n
 * of a cast seeded with seed (the cast's bits). */
void mti_cpu_store_bf16_sr(uint16_t *dst, const float *src, size_t n, uint64_t i, uint64_t seed);

/* gemm.c: one GEMM on the calling thread through a cached oneDNN matmul
 * primitive. C (M,N) = op(A) (M,K) op(B) (K,N) [+ bias (N)] [+ C], fp32
 * accumulation, rounded to c_dt once. A is stored (M,K) with leading
 * dimension lda, or (K,M) when ta; B (K,N), or (N,K) when tb; C (M,N) with
 * ldc. Leading dimensions in elements. */
typedef struct mti_gemm_shape {
    int M, N, K, ta, tb;
    int64_t lda, ldb, ldc;
    mti_dtype ab_dt, c_dt, bias_dt;
    int bias, accumulate;
} mti_gemm_shape;
typedef struct mti_gemm_prim mti_gemm_prim;
/* 1 when oneDNN has a matmul for inputs of dt on this CPU (fp16 needs
 * AVX512-FP16 or AMX-FP16). */
int mti_gemm_supported(mti_dtype ab_dt);
/* The primitive of a shape (made at the first call), its scratchpad size in
 * bytes, and the call: 0 or -1 (oneDNN failed). mti_gemm_put after the last
 * call of an op. */
mt_status mti_gemm_get(const mti_kctx *k, const mti_gemm_shape *shape, mti_gemm_prim **out);
size_t mti_gemm_scratch(const mti_gemm_prim *p);
int mti_gemm_run(const mti_gemm_prim *p, const void *a, const void *b, void *c, const void *bias,
                 void *scratch);
void mti_gemm_put(mti_gemm_prim *p);

/* embedding.c */
mt_status mti_cpu_embedding_fwd(const mti_kctx *k, void *out, const int32_t *tok, const void *wte,
                                const void *wpe, int B, int T, int C, mti_dtype dt);
/* embedding_fwd from a quantized table (V,C; lib/quant/quant.h format qf): each
 * row dequantized in dt a chunk at a time on the stack, then embedding_fwd's
 * sum. */
mt_status mti_cpu_embedding_fwd_q(const mti_kctx *k, void *out, const int32_t *tok, const void *wq,
                                  mti_qformat qf, int V, const void *wpe, int B, int T, int C,
                                  mti_dtype dt);
mt_status mti_cpu_embedding_fwd_rows(const mti_kctx *k, void *out, const int32_t *tok,
                                     const void *wte, int v0, int v1, int B, int T, int C,
                                     mti_dtype dt);
mt_status mti_cpu_embedding_bwd(const mti_kctx *k, float *dwte, float *dwpe, const void *dout,
                                const int32_t *tok, int B, int T, int C, mti_dtype dt);
mt_status mti_cpu_embedding_dw_rows(const mti_kctx *k, float *dwte, const void *dout,
                                    const int32_t *tok, int B, int T, int C, int v0, int v1,
                                    mti_dtype dt);

/* matmul.c */
mt_status mti_cpu_matmul_fwd(const mti_kctx *k, void *y, const void *x, const void *w,
                             const void *b, int n, int in, int out, mti_dtype dt);
mt_status mti_cpu_matmul_bwd(const mti_kctx *k, void *dx, float *dw, float *db, const void *dy,
                             const void *x, const void *w, int n, int in, int out, mti_dtype dt,
                             int flags);
int mti_cpu_matmul_dw_align(int out, int in);
/* matmul_fwd and matmul_bwd's dx with W (out,in) quantized (lib/quant/quant.h
 * format qf, from a buffer of mti_quant_bytes): each output
 * tile dequantizes the part of W it reads into a WORK panel of the
 * activations' dtype (fp32 or bf16; fp16 is MT_ERR_UNSUPPORTED) and runs the
 * dense path's GEMM on it, so the results equal, bit for bit, the dense ops
 * on the dequantized W. WORK per thread: one panel of at most the widest
 * tile times the reduction length, plus oneDNN's scratchpad. */
mt_status mti_cpu_matmul_fwd_q(const mti_kctx *k, void *y, const void *x, const void *wq,
                               mti_qformat qf, const void *b, int n, int in, int out, mti_dtype dt);
mt_status mti_cpu_matmul_dx_q(const mti_kctx *k, void *dx, const void *dy, const void *wq,
                              mti_qformat qf, int n, int in, int out, mti_dtype dt,
                              int accumulate);
mt_status mti_cpu_matmul_dw_rows(const mti_kctx *k, float *dw, const void *dy, const void *x,
                                 int n, int in, int out, int o0, int o1, mti_dtype dt, int flags);

/* layernorm.c */
mt_status mti_cpu_layernorm_fwd(const mti_kctx *k, void *out, float *mean, float *rstd,
                                const void *x, const void *w, const void *b, int n, int c,
                                mti_dtype dt);
mt_status mti_cpu_layernorm_bwd(const mti_kctx *k, void *dx, float *dw, float *db,
                                const void *dout, const void *x, const void *w, const float *mean,
                                const float *rstd, int n, int c, mti_dtype dt, int flags);

/* elementwise.c */
mt_status mti_cpu_gelu_fwd(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt);
mt_status mti_cpu_gelu_bwd(const mti_kctx *k, void *dx, const void *dy, const void *x, size_t n,
                           mti_dtype dt);
mt_status mti_cpu_relu_fwd(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt);
mt_status mti_cpu_relu_bwd(const mti_kctx *k, void *dx, const void *dy, const void *y, size_t n,
                           mti_dtype dt);
mt_status mti_cpu_add(const mti_kctx *k, void *y, const void *a, const void *b, size_t n,
                      mti_dtype dt);
mt_status mti_cpu_accumulate(const mti_kctx *k, void *y, const void *x, size_t n, mti_dtype dt);

/* attention.c */
mt_status mti_cpu_attention_fwd(const mti_kctx *k, void *out, float *lse, const void *qkv, int B,
                                int T, int C, int H, mti_dtype dt);
mt_status mti_cpu_attention_bwd(const mti_kctx *k, void *dqkv, const void *dout, const void *qkv,
                                const void *out, const float *lse, int B, int T, int C, int H,
                                mti_dtype dt);

/* xent.c */
mt_status mti_cpu_xent(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                       const int32_t *targets, int n, int V, int Vp, float dloss, mti_dtype dt);
mt_status mti_cpu_xent_vp(const mti_kctx *k, int phase, float *stats, float *losses,
                          void *dlogits, const void *logits, const int32_t *targets, int n, int v0,
                          int Vr, int W, float dloss, mti_dtype dt);
mt_status mti_cpu_xent_kd(const mti_kctx *k, float *losses, void *dlogits, const void *logits,
                          const float *tlogits, const int32_t *targets, int n, int V, int Vp,
                          int tVp, float alpha, float temp, float dloss, mti_dtype dt);

/* optim.c: unscale, norms, optimizer updates */
mt_status mti_cpu_unscale_check(const mti_kctx *k, float *g, size_t n, float inv_scale,
                                int *found_inf);
mt_status mti_cpu_sumsq(const mti_kctx *k, float *sumsq, const float *g, size_t n);
mt_status mti_cpu_sgd(const mti_kctx *k, float *p, const float *g, float *m, void *pc,
                      mti_dtype pc_dt, size_t n, const mti_sgd_args *a);
mt_status mti_cpu_adamw(const mti_kctx *k, float *p, const float *g, float *m, float *v, void *pc,
                        mti_dtype pc_dt, size_t n, const mti_adamw_args *a);

/* optim8.c: 8-bit blockwise AdamW, and the argument checks of the
 * quantized AdamWs (a status with a message naming op, or MT_OK) */
mt_status mti_cpu_adam_check(const mti_kctx *k, const char *op, const void *pc, mti_dtype pc_dt,
                             const mti_adamw_args *a);
/* The 8-bit code of x (already divided by its block's absmax) in the
 * signed or unsigned map, as adamw8 quantizes: by its table over the
 * float's bits, or with by_search by the search over the thresholds (the
 * two must agree; test_optim.c checks). mti_cpu_q8_lut_ok: whether the
 * table is in use (it is unless a bucket would hold two thresholds). */
uint8_t mti_cpu_q8_code(float x, int is_signed, int by_search);
int mti_cpu_q8_lut_ok(void);
/* Chooses adamw8's path for full blocks: 0 the portable loops, 1 AVX-512
 * with gathers for the map lookups, 2 AVX-512 with permutes instead (needs
 * AVX512-VBMI); a level the CPU lacks gives the most it has. Returns the
 * level before. The same bits at every level: the tests compare them. */
int mti_cpu_q8_vector(int on);
mt_status mti_cpu_adamw8(const mti_kctx *k, float *p, const float *g, uint8_t *qm, uint8_t *qv,
                         float *absmax_m, float *absmax_v, void *pc, mti_dtype pc_dt, size_t n,
                         const mti_adamw_args *a);
mt_status mti_cpu_adamw8_bf16(const mti_kctx *k, uint16_t *w, const float *g, uint8_t *qm,
                              uint8_t *qv, float *absmax_m, float *absmax_v, size_t n, size_t at,
                              uint64_t seed, const mti_adamw_args *a);

/* optim4.c: 4-bit AdamW */
mt_status mti_cpu_adamw4(const mti_kctx *k, float *p, const float *g, const mti_adamw4_state *st,
                         void *pc, mti_dtype pc_dt, int64_t rows, int64_t cols, int rank1,
                         const mti_adamw_args *a);

/* adafactor.c: Adafactor */
mt_status mti_cpu_adafactor(const mti_kctx *k, float *p, const float *g, float *row, float *col,
                            float *v, float *m, void *pc, mti_dtype pc_dt, int64_t rows,
                            int64_t cols, int factored, const mti_adafactor_args *a);

#endif /* MT_CPU_OPS_H */
