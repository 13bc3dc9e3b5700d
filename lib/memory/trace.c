/*
 * trace.c - allocation traces: recording (the file format, validation and
 * replay are trace_file.c's; the context's trace is context_trace.c's).
 *
 * Recording is off by default and bounded: a trace keeps at most `capacity`
 * events and counts the rest as dropped, so the kept events are always a
 * consistent prefix (every FREE kept has its ALLOC kept). The allocators
 * record into it (mti_trace_record), so this file calls nothing above it.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "memory/trace.h"

mt_status mti_trace_alloc(mt_context *ctx, size_t capacity, mt_trace **out)
{
    mt_trace *t = calloc(1, sizeof *t);
    mt_trace_event *ev = malloc((capacity ? capacity : 1) * sizeof *ev);
    if (!t || !ev) {
        free(t);
        free(ev);
        return mti_fail(ctx, MT_ERR_OOM, "out of host memory for a trace of %zu events", capacity);
    }
    t->events = ev;
    t->capacity = capacity;
    *out = t;
    return MT_OK;
}

mt_status mti_trace_new(mt_context *ctx, size_t capacity, mt_trace **out)
{
    if (capacity == 0 || capacity > TRACE_MAX_FILE / TRACE_EVENT)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "trace capacity %zu out of range 1..%zu",
                        capacity, TRACE_MAX_FILE / TRACE_EVENT);
    mt_status s = mti_trace_alloc(ctx, capacity, out);
    if (!s) (*out)->t0_ns = mti_now_ns();
    return s;
}

void mti_trace_record(mt_trace *t, const mt_trace_event *ev)
{
    size_t i = atomic_fetch_add(&t->n, 1);
    if (i < t->capacity) t->events[i] = *ev;
    else atomic_fetch_add(&t->dropped, 1);
}

size_t mti_trace_count(const mt_trace *t)
{
    size_t n = atomic_load(&((mt_trace *)t)->n);
    return n < t->capacity ? n : t->capacity;
}

void mt_trace_free(mt_trace *t)
{
    if (!t) return;
    free(t->events);
    free(t);
}
