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
/* Every op of MTI_OPS (lib/ops/kernels.h) as mti_cpu_<op>. */
#define CPU_OP(op) .op = mti_cpu_##op,
static const mti_ops cpu_ops = {.name = "cpu", .device = MT_DEVICE_CPU, MTI_OPS(CPU_OP)};
#undef CPU_OP

const mti_ops *mti_cpu_ops(void) { return &cpu_ops; }
