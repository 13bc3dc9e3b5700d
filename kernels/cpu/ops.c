/*
 * ops.c - the CPU op table: the reference every other table is checked
 * against, and the CPU backend. GEMMs go through oneDNN (gemm.c); everything
 * else is loops threaded with OpenMP where the work pays for it; oneDNN runs
 * single-threaded inside the library's own parallel loops.
 */
#include "cpu_ops.h"

/* The parallelism is ours: OpenMP over tiles, rows, heads, with the
 * context's thread count, so two contexts with different counts can run at
 * once in one process. */
static const mti_ops cpu_ops = {
    .name = "cpu",
    .device = MT_DEVICE_CPU,
    .cast = mti_cpu_cast,
    .embedding_fwd = mti_cpu_embedding_fwd,
    .embedding_fwd_q = mti_cpu_embedding_fwd_q,
    .embedding_bwd = mti_cpu_embedding_bwd,
    .embedding_dw_rows = mti_cpu_embedding_dw_rows,
    .matmul_fwd = mti_cpu_matmul_fwd,
    .matmul_bwd = mti_cpu_matmul_bwd,
    .matmul_dw_align = mti_cpu_matmul_dw_align,
    .matmul_dw_rows = mti_cpu_matmul_dw_rows,
    .matmul_fwd_q = mti_cpu_matmul_fwd_q,
    .matmul_dx_q = mti_cpu_matmul_dx_q,
    .layernorm_fwd = mti_cpu_layernorm_fwd,
    .layernorm_bwd = mti_cpu_layernorm_bwd,
    .gelu_fwd = mti_cpu_gelu_fwd,
    .gelu_bwd = mti_cpu_gelu_bwd,
    .relu_fwd = mti_cpu_relu_fwd,
    .relu_bwd = mti_cpu_relu_bwd,
    .add = mti_cpu_add,
    .accumulate = mti_cpu_accumulate,
    .attention_fwd = mti_cpu_attention_fwd,
    .attention_bwd = mti_cpu_attention_bwd,
    .xent = mti_cpu_xent,
    .xent_kd = mti_cpu_xent_kd,
    .unscale_check = mti_cpu_unscale_check,
    .sumsq = mti_cpu_sumsq,
    .sgd = mti_cpu_sgd,
    .adamw = mti_cpu_adamw,
    .adamw8 = mti_cpu_adamw8,
    .adamw8_bf16 = mti_cpu_adamw8_bf16,
    .adamw4 = mti_cpu_adamw4,
    .adafactor = mti_cpu_adafactor,
};

const mti_ops *mti_cpu_ops(void) { return &cpu_ops; }
