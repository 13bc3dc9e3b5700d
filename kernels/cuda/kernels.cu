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
 * lib/cuda_device.h, which lists them), and takes its parameters by value in
 * the types the host passes: device pointers, float, unsigned long long
 * element counts. Elementwise kernels loop with a grid stride, so any grid
 * covers any n.
 */

/* Index type for element loops: counts go past 2^32 elements. */
typedef unsigned long long mt_index;

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
