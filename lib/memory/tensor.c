/*
 * tensor.c - tensors: a shape, a dtype and a block from the context's
 * allocator for the tensor's memory class.
 */
#include <string.h>

#include "internal.h"

size_t mti_dtype_size(mti_dtype t)
{
    switch (t) {
    case MTI_F32: return 4;
    case MTI_F16: return 2;
    case MTI_BF16: return 2;
    case MTI_I32: return 4;
    case MTI_U8: return 1;
    }
    return 0;
}

int64_t mti_tensor_numel(const mti_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

size_t mti_tensor_bytes(const mti_tensor *t)
{
    return (size_t)mti_tensor_numel(t) * mti_dtype_size(t->dtype);
}

mt_status mti_tensor_alloc(mt_context *ctx, mti_tensor *t, mt_mem_class c, mt_lifetime life,
                           uint64_t tag)
{
    mt_alloc_request req = {.bytes = mti_tensor_bytes(t),
                            .alignment = MT_DEFAULT_ALIGNMENT,
                            .mem_class = c,
                            .lifetime = life,
                            .tag = tag};
    return mt_context_alloc(ctx, &req, &t->blk);
}

void mti_tensor_free(mt_context *ctx, mti_tensor *t)
{
    if (!t->blk.ptr) return;
    if (t->blk.handle == MTI_HOST_HANDLE) mti_host_block_free(ctx, &t->blk); /* (place host) */
    else mt_context_free(ctx, &t->blk);
    memset(&t->blk, 0, sizeof t->blk);
}

mt_status mti_tensor_upload(mt_context *ctx, mti_tensor *t, const void *src, size_t bytes)
{
    if (bytes > t->blk.bytes)
        return mti_fail(ctx, MT_ERR_INTERNAL, "upload of %zu bytes into a %zu-byte tensor", bytes,
                        t->blk.bytes);
    return ctx->dev->copy_h2d(ctx->dev, t->blk.ptr, src, bytes);
}

mt_status mti_tensor_download(mt_context *ctx, const mti_tensor *t, void *dst, size_t bytes)
{
    if (bytes > t->blk.bytes)
        return mti_fail(ctx, MT_ERR_INTERNAL, "download of %zu bytes from a %zu-byte tensor", bytes,
                        t->blk.bytes);
    mt_status s = ctx->dev->copy_d2h(ctx->dev, dst, t->blk.ptr, bytes);
    return s ? s : ctx->dev->sync(ctx->dev);
}

mt_status mti_tensor_zero(mt_context *ctx, mti_tensor *t)
{
    return ctx->dev->memset8(ctx->dev, t->blk.ptr, 0, t->blk.bytes);
}

mt_status mti_tensor_hash(mt_context *ctx, const mti_tensor *w, void *buf, size_t chunk,
                          uint64_t *h)
{
    const size_t bytes = mti_tensor_bytes(w);
    mt_status s = MT_OK;
    for (size_t at = 0; at < bytes && !s; at += chunk) {
        const size_t n = bytes - at < chunk ? bytes - at : chunk;
        s = ctx->dev->copy_d2h(ctx->dev, buf, (const char *)w->blk.ptr + at, n);
        if (!s) s = ctx->dev->sync(ctx->dev);
        if (!s) *h = mti_hash(*h, buf, n);
    }
    return s;
}
