/*
 * kernels.cu - the CUDA kernels of memtrain, one translation unit.
 *
 * nvcc compiles this file alone into a fatbin (a cubin per architecture in
 * CUDA_ARCHS plus PTX of the newest, for GPUs that come later), which the
 * build embeds in the library and the CUDA device loads with
 * cuModuleLoadData when it opens. Other .cu files of this folder are
 * #included below as the op table grows, so there is one module to load.
 *
 * Every kernel is extern "C" so the host finds it by its plain name (see
 * lib/device/cuda_device.h, which lists them), and takes its parameters by value in
 * the types the host passes: device pointers, float, int, unsigned long long
 * element counts. Elementwise kernels loop with a grid stride, so any grid
 * covers any n. Kernels over tensors of a storage dtype exist once per dtype
 * (NAME_f32, NAME_f16, NAME_bf16; see MT_EXPORT_DT in common.cuh).
 *
 * The op table (kernels/cuda/ops_cuda.c) launches them:
 *   elementwise.cu  cast, GELU, ReLU, add, accumulate, bias rows
 *   embedding.cu    token + position embedding, forward and backward
 *   layernorm.cu    layer normalisation, forward and backward
 *   attention.cu    causal self-attention, forward and backward
 *   attention_tc.cu the same on the tensor cores (fp16, bf16, heads of 64)
 *   xent.cu         fused softmax cross-entropy, and distillation's loss
 *   reduce.cu       column sums and the sum of squares
 *   optim.cu        unscale + inf check, SGD, AdamW
 *   optim8.cu       8-bit blockwise AdamW
 *   optim4.cu       4-bit AdamW
 *   adafactor.cu    Adafactor
 *   dequant.cu      tiles of int8 / NF4 quantized weights, for the quantized matmuls
 *   sparse.cu       pruned tensors expanded and gathered back
 * GEMMs go through cuBLASLt from the host, not through kernels here.
 */

#include "common.cuh"

/* y[i] = value for i < n.  y: (n) fp32 */
extern "C" __global__ void mt_fill_f32(float *__restrict__ y, float value, mt_index n)
{
    const mt_index stride = (mt_index)gridDim.x * blockDim.x;
    for (mt_index i = (mt_index)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = value;
}

/* y[i] += a * x[i] for i < n.  y, x: (n) fp32, not overlapping unless equal */
extern "C" __global__ void mt_axpy_f32(float *y, float a, const float *x, mt_index n)
{
    const mt_index stride = (mt_index)gridDim.x * blockDim.x;
    for (mt_index i = (mt_index)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = fmaf(a, x[i], y[i]);
}

#include "elementwise.cu"
#include "embedding.cu"
#include "layernorm.cu"
#include "attention.cu"
#include "attention_tc.cu"
#include "xent.cu"
#include "reduce.cu"
#include "optim.cu"
#include "optim8.cu"
#include "optim4.cu"
#include "adafactor.cu"
#include "dequant.cu"
#include "sparse.cu"
