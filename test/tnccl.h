/*
 * tnccl.h - one rank of NCCL on a CUDA context, for the tests that run on
 * a GPU (MT_TEST_GPU=1: the real driver and the libnccl.so.2 the library
 * finds) or else over the stand-ins (MT_FAKE_NCCL, MT_FAKE_CUDA and
 * MT_FAKE_CUBLASLT).
 */
#ifndef MT_TEST_TNCCL_H
#define MT_TEST_TNCCL_H

#include "check.h"
#include "memtrain/comm.h"

/* Whether the test runs on a GPU (MT_TEST_GPU=1). */
bool tnccl_gpu(void);
/* The context on a one-rank NCCL communicator (*c), with *first a context
 * without one made before it, which keeps the device's primary context
 * current for NCCL; NULL when the test cannot run (a skip said: neither a
 * GPU nor the stand-ins, or no libnccl.so.2 on the GPU's machine) or a
 * check failed. Free with tnccl_free. */
mt_context *tnccl_one_rank(mt_context **first, mt_comm **c);
void tnccl_free(mt_context *ctx, mt_context *first, mt_comm *c);
/* The collectives the calling thread queued with the stand-in libnccl
 * (MT_FAKE_NCCL, loaded) on `stream` (others 0) or on every other stream
 * (others 1): fake_nccl_calls; ~0 without it. */
unsigned long tnccl_calls(void *stream, int others);

#endif
