/*
 * trace.h - what trace.c, trace_file.c and context_trace.c share.
 */
#ifndef MT_TRACE_H
#define MT_TRACE_H

#include "internal.h"

#define TRACE_MAGIC "MTTRACE\0"
#define TRACE_VERSION 2u /* 2: events have a place (byte 42, zero in version 1) */
#define TRACE_HEADER 40u
#define TRACE_EVENT 48u
#define TRACE_MAX_FILE ((size_t)1 << 36) /* 64 GiB: far beyond any bounded trace */

/* A trace of room for `capacity` events (at least one slot), none kept yet. */
mt_status mti_trace_alloc(mt_context *ctx, size_t capacity, mt_trace **out);
/* The events kept: recorded, at most the capacity. */
size_t mti_trace_count(const mt_trace *t);

#endif /* MT_TRACE_H */
