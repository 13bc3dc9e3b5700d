/*
 * place.c - where bytes are held: the device (the allocators' bytes,
 * counted by lib/memory/allocator.c), host memory beside a device that is not the
 * host, and disk (scratch files of offloaded state, lib/train/offload.c).
 *
 * The device's figures are the allocators'; the other places are counted
 * here, per class, by whoever takes their bytes (a scratch file's size when
 * it is made, given back when it is removed). A dry context counts them as
 * a real one does, so the estimate has them per place, exactly.
 */
#include <string.h>

#include "device/cuda_device.h"
#include "internal.h"

const char *mt_place_name(mt_place p)
{
    static const char *const names[] = {"device", "host", "disk"};
    _Static_assert(sizeof names / sizeof *names == MT_PLACE_COUNT, "a name per mt_place");
    return (unsigned)p < MT_PLACE_COUNT ? names[p] : "?";
}

/* An ALLOC or FREE of bytes held at place p, into the context's trace. */
static void trace_place(mt_context *ctx, mt_place p, mt_mem_class c, uint64_t bytes, mt_trace_op op)
{
    mt_trace *t = ctx->trace;
    if (!t || !t->recording) return;
    mti_trace_record(t, &(mt_trace_event){.t_ns = mti_now_ns() - t->t0_ns,
                                          .bytes = bytes,
                                          .op = (uint8_t)op,
                                          .mem_class = (uint8_t)c,
                                          .place = (uint8_t)p});
}

void mti_place_add(mt_context *ctx, mt_place p, mt_mem_class c, uint64_t bytes)
{
    if (!bytes) return;
    trace_place(ctx, p, c, bytes, MT_TRACE_ALLOC);
    ctx->place_live[p][c] += bytes;
    if (ctx->place_live[p][c] > ctx->place_peak[p][c]) ctx->place_peak[p][c] = ctx->place_live[p][c];
    ctx->place_total[p] += bytes;
    if (ctx->place_total[p] > ctx->place_total_peak[p]) ctx->place_total_peak[p] = ctx->place_total[p];
    ctx->place_n[p][c][0]++;
}

void mti_place_sub(mt_context *ctx, mt_place p, mt_mem_class c, uint64_t bytes)
{
    if (!bytes) return;
    trace_place(ctx, p, c, bytes, MT_TRACE_FREE);
    ctx->place_live[p][c] -= bytes;
    ctx->place_total[p] -= bytes;
    ctx->place_n[p][c][1]++;
}

void mti_place_reset_peaks(mt_context *ctx)
{
    memcpy(ctx->place_peak, ctx->place_live, sizeof ctx->place_peak);
    memcpy(ctx->place_total_peak, ctx->place_total, sizeof ctx->place_total_peak);
}

mt_status mt_context_place_stats(const mt_context *ctx, mt_place p, mt_memory_stats *out)
{
    if (!ctx || !out)
        return mti_fail((mt_context *)ctx, MT_ERR_INVALID_ARG, "mt_context_place_stats: %s is NULL",
                        ctx ? "out" : "ctx");
    if ((unsigned)p >= MT_PLACE_COUNT)
        return mti_fail((mt_context *)ctx, MT_ERR_INVALID_ARG,
                        "mt_context_place_stats: place %d is not one of device, host, disk", (int)p);
    if (p == MT_PLACE_DEVICE) return mt_context_memory_stats(ctx, out);
    memset(out, 0, sizeof *out);
    for (int c = 0; c < MT_MEM_COUNT; c++) {
        out->per_class[c].live_bytes = ctx->place_live[p][c];
        out->per_class[c].peak_live_bytes = ctx->place_peak[p][c];
        out->per_class[c].n_alloc = ctx->place_n[p][c][0];
        out->per_class[c].n_free = ctx->place_n[p][c][1];
    }
    out->live_bytes = out->reserved_bytes = ctx->place_total[p];
    out->peak_live_bytes = out->peak_reserved_bytes = ctx->place_total_peak[p];
    return MT_OK;
}

mt_status mti_host_block_alloc(mt_context *ctx, size_t bytes, mt_mem_class c, uint64_t tag,
                               mt_block *out)
{
    memset(out, 0, sizeof *out);
    if (!bytes) return MT_OK;
    void *p = NULL;
    size_t granted = 0;
    mt_status s = ctx->dry ? ctx->dev->mem_reserve(ctx->dev, bytes, 4096, &p, &granted)
                           : mti_cuda_host_alloc(ctx->dev, bytes, &p);
    if (s) return s;
    *out = (mt_block){.ptr = p, .bytes = bytes, .handle = MTI_HOST_HANDLE, .id = tag,
                      .mem_class = c, .lifetime = MT_LIFE_PERSISTENT};
    mti_place_add(ctx, MT_PLACE_HOST, c, bytes);
    return MT_OK;
}

void mti_host_block_free(mt_context *ctx, mt_block *b)
{
    if (!b->ptr) return;
    if (!ctx->dry) mti_cuda_host_free(ctx->dev, b->ptr);
    mti_place_sub(ctx, MT_PLACE_HOST, b->mem_class, b->bytes);
    memset(b, 0, sizeof *b);
}
