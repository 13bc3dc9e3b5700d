/*
 * memory.c - a context's memory: blocks from the allocator instance of
 * their class (mt_context_alloc, mt_context_free) and the instances'
 * figures together (mt_context_memory_stats). Below the context's
 * creation (context.c), so the kernels' workspace, the tensors and the
 * communication buffers, which take memory here, never call up into it.
 */
#include <string.h>

#include "internal.h"

mt_status mt_context_alloc(mt_context *ctx, const mt_alloc_request *req, mt_block *out)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_alloc: ctx is NULL");
    if (!req || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_context_alloc: %s is NULL",
                        req ? "out" : "req");
    if ((unsigned)req->mem_class >= MT_MEM_COUNT) {
        memset(out, 0, sizeof *out);
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_context_alloc: memory class %d out of range",
                        (int)req->mem_class);
    }
    return mt_alloc(ctx->by_class[req->mem_class], req, out);
}

void mti_context_reset(mt_context *ctx, mt_scope scope)
{
    for (int i = 0; i < ctx->n_inst; i++) mt_allocator_reset(ctx->inst[i], scope);
}

mt_status mt_context_free(mt_context *ctx, const mt_block *blk)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_free: ctx is NULL");
    if (!blk) return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_context_free: block is NULL");
    if (!blk->ptr && blk->bytes == 0) return MT_OK;
    if ((unsigned)blk->mem_class >= MT_MEM_COUNT)
        return mti_fail(ctx, MT_ERR_BAD_BLOCK, "mt_context_free: block has memory class %d",
                        (int)blk->mem_class);
    return mt_free(ctx->by_class[blk->mem_class], blk);
}

mt_status mt_context_memory_stats(const mt_context *ctx, mt_memory_stats *out)
{
    if (!ctx || !out)
        return mti_fail((mt_context *)ctx, MT_ERR_INVALID_ARG, "mt_context_memory_stats: %s is NULL",
                        ctx ? "out" : "ctx");
    memset(out, 0, sizeof *out);
    for (int i = 0; i < ctx->n_inst; i++) {
        mt_allocator_stats st;
        mt_allocator_get_stats(ctx->inst[i], &st);
        for (int c = 0; c < MT_MEM_COUNT; c++) {
            mt_class_stats *d = &out->per_class[c];
            const mt_class_stats *s = &st.per_class[c];
            d->live_bytes += s->live_bytes;
            d->peak_live_bytes += s->peak_live_bytes; /* one instance per class: exact */
            d->n_alloc += s->n_alloc;
            d->n_free += s->n_free;
            d->n_oom_failures += s->n_oom_failures;
        }
    }
    out->live_bytes = atomic_load(&ctx->live_total);
    out->peak_live_bytes = atomic_load(&ctx->live_peak);
    out->reserved_bytes = atomic_load(&ctx->reserved_total);
    out->peak_reserved_bytes = atomic_load(&ctx->reserved_peak);
    out->n_allocators = ctx->n_inst;
    return MT_OK;
}
