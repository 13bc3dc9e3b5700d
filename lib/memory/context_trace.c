/*
 * context_trace.c - a context's allocation trace: started, stopped, read
 * and written (mt_context_trace_*). Above the allocators, which record into
 * it, and the trace's recording and file format (trace.c, trace_file.c).
 */
#include "internal.h"
#include "memory/trace.h"

/* Points every instance at t (or at none), each under its lock, so no
 * thread is left recording into a trace about to be freed. */
static void attach(mt_context *ctx, mt_trace *t)
{
    for (int i = 0; i < ctx->n_inst; i++) mti_allocator_set_trace(ctx->inst[i], t);
}

mt_status mt_context_trace_start(mt_context *ctx, size_t capacity)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_trace_start: ctx is NULL");
    mt_trace *t;
    mt_status s = mti_trace_new(ctx, capacity, &t);
    if (s) return s;
    attach(ctx, NULL);
    mt_trace_free(ctx->trace);
    ctx->trace = t;
    t->recording = true;
    attach(ctx, t);
    return MT_OK;
}

mt_status mt_context_trace_stop(mt_context *ctx)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_trace_stop: ctx is NULL");
    if (!ctx->trace) return mti_fail(ctx, MT_ERR_STATE, "mt_context_trace_stop: no trace started");
    attach(ctx, NULL);
    ctx->trace->recording = false;
    return MT_OK;
}

mt_status mt_context_trace_events(mt_context *ctx, const mt_trace_event **events, size_t *count,
                                  uint64_t *dropped)
{
    if (!ctx || !events || !count)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_context_trace_events: %s is NULL",
                        !ctx ? "ctx" : !events ? "events" : "count");
    if (!ctx->trace) return mti_fail(ctx, MT_ERR_STATE, "mt_context_trace_events: no trace started");
    *events = ctx->trace->events;
    *count = mti_trace_count(ctx->trace);
    if (dropped) *dropped = atomic_load(&ctx->trace->dropped);
    return MT_OK;
}

mt_status mt_context_trace_write(mt_context *ctx, const char *path)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_trace_write: ctx is NULL");
    if (!ctx->trace) return mti_fail(ctx, MT_ERR_STATE, "mt_context_trace_write: no trace started");
    return mt_trace_save(ctx, ctx->trace, path);
}
