/*
 * trace_file.c - allocation traces: the file format, validation, and replay
 * (recording is trace.c's).
 *
 * File format (little-endian; docs/formats.md):
 *   header, 40 bytes: "MTTRACE\0", u32 version (2; 1 is read too), u32 event size (48),
 *                     u64 count, u64 dropped, u64 zero
 *   count events of 48 bytes: u64 t_ns, u64 id, u64 bytes, u64 tag,
 *                     u32 alignment, u8 op, u8 class, u8 lifetime, u8 flags,
 *                     u8 scope, u8 instance, u8 place (version 1: 0), 5 zero bytes
 *   u32 CRC-32 of everything before it.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "memory/livemap.h"
#include "memory/trace.h"

/* ---- file format ---- */

static void encode_event(unsigned char *p, const mt_trace_event *e)
{
    memset(p, 0, TRACE_EVENT);
    mti_put_u64(p + 0, e->t_ns);
    mti_put_u64(p + 8, e->id);
    mti_put_u64(p + 16, e->bytes);
    mti_put_u64(p + 24, e->tag);
    mti_put_u32(p + 32, e->alignment);
    p[36] = e->op;
    p[37] = e->mem_class;
    p[38] = e->lifetime;
    p[39] = e->flags;
    p[40] = e->scope;
    p[41] = e->instance;
    p[42] = e->place;
}

static void decode_event(const unsigned char *p, mt_trace_event *e)
{
    e->t_ns = mti_get_u64(p + 0);
    e->id = mti_get_u64(p + 8);
    e->bytes = mti_get_u64(p + 16);
    e->tag = mti_get_u64(p + 24);
    e->alignment = mti_get_u32(p + 32);
    e->op = p[36];
    e->mem_class = p[37];
    e->lifetime = p[38];
    e->flags = p[39];
    e->scope = p[40];
    e->instance = p[41];
    e->place = p[42];
}

mt_status mt_trace_save(mt_context *ctx, const mt_trace *t, const char *path)
{
    if (!t || !path)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trace_save: %s is NULL", t ? "path" : "t");
    size_t n = mti_trace_count(t);
    size_t size = TRACE_HEADER + n * TRACE_EVENT + 4;
    unsigned char *buf = malloc(size);
    if (!buf) return mti_fail(ctx, MT_ERR_OOM, "out of host memory writing a trace");
    memcpy(buf, TRACE_MAGIC, 8);
    mti_put_u32(buf + 8, TRACE_VERSION);
    mti_put_u32(buf + 12, TRACE_EVENT);
    mti_put_u64(buf + 16, n);
    mti_put_u64(buf + 24, atomic_load(&((mt_trace *)t)->dropped));
    mti_put_u64(buf + 32, 0);
    for (size_t i = 0; i < n; i++) encode_event(buf + TRACE_HEADER + i * TRACE_EVENT, &t->events[i]);
    mti_put_u32(buf + size - 4, mti_crc32(0, buf, size - 4));
    mt_status s = mti_write_file_atomic(ctx, path, buf, size);
    free(buf);
    return s;
}

/* ---- validation ---- */

static mt_status validate(mt_context *ctx, const mt_trace_event *ev, size_t n)
{
    mti_live_map m = {0};
    mt_status s = MT_OK;
    for (size_t i = 0; i < n && !s; i++) {
        const mt_trace_event *e = &ev[i];
        if (e->place) { /* bytes held off the device: an ALLOC or FREE of its place */
            if (e->place >= MT_PLACE_COUNT || e->mem_class >= MT_MEM_COUNT ||
                (e->op != MT_TRACE_ALLOC && e->op != MT_TRACE_FREE))
                s = mti_fail(ctx, MT_ERR_FORMAT, "trace event %zu: place %u, class %u, operation "
                             "%u", i, e->place, e->mem_class, e->op);
            continue;
        }
        switch (e->op) {
        case MT_TRACE_ALLOC:
        case MT_TRACE_FAIL:
            if (e->mem_class >= MT_MEM_COUNT || e->lifetime >= MT_LIFE_COUNT ||
                (e->alignment && (!mti_is_pow2(e->alignment) || e->alignment > MT_MAX_ALIGNMENT)) ||
                (e->flags & ~MT_REQ_RECOMPUTABLE)) {
                s = mti_fail(ctx, MT_ERR_FORMAT, "trace event %zu: bad class, lifetime, "
                             "alignment or flags", i);
                break;
            }
            if (e->op == MT_TRACE_FAIL) break;
            if (e->id == 0 || e->id >= ((uint64_t)1 << 56) || e->bytes == 0 ||
                e->bytes > MT_MAX_REQUEST) {
                s = mti_fail(ctx, MT_ERR_FORMAT, "trace event %zu: allocation with id %llu of %llu "
                             "bytes", i, (unsigned long long)e->id, (unsigned long long)e->bytes);
                break;
            }
            if (mti_live_find(&m, mti_live_key(e)) != SIZE_MAX) {
                s = mti_fail(ctx, MT_ERR_FORMAT, "trace event %zu: block %llu allocated twice", i,
                             (unsigned long long)e->id);
                break;
            }
            if (!mti_live_insert(&m, &(mti_live_rec){.key = mti_live_key(e), .lifetime = e->lifetime,
                                            .instance = e->instance}))
                s = mti_fail(ctx, MT_ERR_OOM, "out of host memory checking a trace");
            break;
        case MT_TRACE_FREE: {
            size_t r = e->id < ((uint64_t)1 << 56) ? mti_live_find(&m, mti_live_key(e)) : SIZE_MAX;
            if (r == SIZE_MAX) {
                s = mti_fail(ctx, MT_ERR_FORMAT, "trace event %zu: free of block %llu, which is "
                             "not live", i, (unsigned long long)e->id);
                break;
            }
            mti_live_remove(&m, r);
            break;
        }
        case MT_TRACE_RESET:
            if (e->scope > MT_SCOPE_PHASE) {
                s = mti_fail(ctx, MT_ERR_FORMAT, "trace event %zu: reset scope %u", i, e->scope);
                break;
            }
            for (size_t r = m.n; r-- > 0;)
                if (m.recs[r].instance == e->instance && m.recs[r].lifetime >= e->scope)
                    mti_live_remove(&m, r);
            break;
        case MT_TRACE_TRIM: break;
        default:
            s = mti_fail(ctx, MT_ERR_FORMAT, "trace event %zu: unknown operation %u", i, e->op);
        }
    }
    mti_live_free(&m);
    return s;
}

static mt_status trace_make(mt_context *ctx, size_t n, uint64_t dropped, mt_trace **out)
{
    mt_status s = mti_trace_alloc(ctx, n, out);
    if (s) return s;
    atomic_store(&(*out)->n, n);
    atomic_store(&(*out)->dropped, dropped);
    return MT_OK;
}

mt_status mt_trace_from_events(mt_context *ctx, const mt_trace_event *events, size_t count,
                               mt_trace **out)
{
    if (!out || (!events && count))
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trace_from_events: %s is NULL",
                        out ? "events (with count > 0)" : "out");
    mt_status s = validate(ctx, events, count);
    if (s) return s == MT_ERR_FORMAT ? mti_fail(ctx, MT_ERR_INVALID_ARG, "%s", mt_last_error(ctx))
                                     : s;
    mt_trace *t;
    s = trace_make(ctx, count, 0, &t);
    if (s) return s;
    if (count) memcpy(t->events, events, count * sizeof *events);
    *out = t;
    return MT_OK;
}

mt_status mt_trace_load(mt_context *ctx, const char *path, mt_trace **out)
{
    if (!path || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trace_load: %s is NULL", path ? "out" : "path");
    unsigned char *buf;
    size_t size;
    mt_status s = mti_read_file(ctx, path, TRACE_MAX_FILE, &buf, &size);
    if (s) return s;
    mt_trace *t = NULL;
    if (size < TRACE_HEADER + 4 || memcmp(buf, TRACE_MAGIC, 8) != 0) {
        s = mti_fail(ctx, MT_ERR_FORMAT, "'%s' is not a memtrain trace (bad magic or too short)",
                     path);
    } else if ((mti_get_u32(buf + 8) != TRACE_VERSION && mti_get_u32(buf + 8) != 1) ||
               mti_get_u32(buf + 12) != TRACE_EVENT) {
        s = mti_fail(ctx, MT_ERR_FORMAT, "'%s': trace version %u (event size %u); this library "
                     "reads versions 1 and %u",
                     path, mti_get_u32(buf + 8), mti_get_u32(buf + 12), TRACE_VERSION);
    } else {
        uint64_t n = mti_get_u64(buf + 16);
        if (n > (size - TRACE_HEADER - 4) / TRACE_EVENT ||
            size != TRACE_HEADER + n * TRACE_EVENT + 4) {
            s = mti_fail(ctx, MT_ERR_FORMAT, "'%s': %zu bytes do not hold the %llu events the "
                         "header announces (truncated or padded)",
                         path, size, (unsigned long long)n);
        } else if (mti_crc32(0, buf, size - 4) != mti_get_u32(buf + size - 4)) {
            s = mti_fail(ctx, MT_ERR_FORMAT, "'%s': checksum mismatch (corrupt file)", path);
        } else if ((s = trace_make(ctx, (size_t)n, mti_get_u64(buf + 24), &t)) == MT_OK) {
            for (size_t i = 0; i < n; i++)
                decode_event(buf + TRACE_HEADER + i * TRACE_EVENT, &t->events[i]);
            s = validate(ctx, t->events, (size_t)n);
            if (s) {
                s = mti_fail(ctx, s, "'%s': %s", path, mti_last_msg(ctx).s);
                mt_trace_free(t);
                t = NULL;
            }
        }
    }
    free(buf);
    if (!s) *out = t;
    return s;
}

mt_status mt_trace_info(const mt_trace *t, size_t *count, uint64_t *dropped)
{
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_trace_info: trace is NULL");
    if (count) *count = mti_trace_count(t);
    if (dropped) *dropped = atomic_load(&((mt_trace *)t)->dropped);
    return MT_OK;
}

const mt_trace_event *mt_trace_get_events(const mt_trace *t) { return t ? t->events : NULL; }

/* ---- replay ---- */

static mt_status replay_free(mti_live_map *m, size_t r, mt_allocator *a, mt_replay_result *res)
{
    mt_status s = MT_OK;
    if (!m->recs[r].failed) {
        s = mt_free(a, &m->recs[r].blk);
        if (!s) res->n_free++;
    }
    mti_live_remove(m, r);
    return s;
}

mt_status mt_trace_replay(const mt_trace *t, mt_allocator *a, mt_replay_result *res)
{
    if (!t || !a || !res)
        return mti_fail(a ? a->ctx : NULL, MT_ERR_INVALID_ARG, "mt_trace_replay: %s is NULL",
                        !t ? "t" : !a ? "a" : "res");
    memset(res, 0, sizeof *res);
    mti_allocator_reset_peak(a);
    mti_live_map m = {0};
    size_t n = mti_trace_count(t);
    mt_status s = MT_OK;
    uint64_t t0 = mti_now_ns();
    for (size_t i = 0; i < n && !s; i++) {
        const mt_trace_event *e = &t->events[i];
        if (e->place) continue; /* not the device's: nothing for an allocator */
        res->n_events++;
        switch (e->op) {
        case MT_TRACE_ALLOC: {
            mt_alloc_request req = {.bytes = e->bytes,
                                    .alignment = e->alignment,
                                    .mem_class = (mt_mem_class)e->mem_class,
                                    .lifetime = (mt_lifetime)e->lifetime,
                                    .flags = e->flags,
                                    .tag = e->tag};
            mti_live_rec rec = {.key = mti_live_key(e), .lifetime = e->lifetime, .instance = e->instance};
            mt_status as = mt_alloc(a, &req, &rec.blk);
            if (as == MT_OK) res->n_alloc++;
            else if (as == MT_ERR_OOM) rec.failed = true, res->n_failed++;
            else s = as;
            if (!s && !mti_live_insert(&m, &rec)) s = mti_fail(a->ctx, MT_ERR_OOM, "replay: out of host memory");
            break;
        }
        case MT_TRACE_FREE: {
            size_t r = mti_live_find(&m, mti_live_key(e));
            if (r != SIZE_MAX) s = replay_free(&m, r, a, res);
            break;
        }
        case MT_TRACE_RESET: {
            bool others = false;
            for (size_t r = m.n; r-- > 0 && !s;) {
                if (m.recs[r].lifetime < e->scope) continue;
                if (m.recs[r].instance == e->instance) s = replay_free(&m, r, a, res);
                else others = true;
            }
            /* the allocator sees the boundary unless it would kill blocks
               of another recorded instance that are still live */
            if (!s && !others) s = mt_allocator_reset(a, (mt_scope)e->scope);
            break;
        }
        case MT_TRACE_TRIM: s = mt_allocator_trim(a); break;
        default: break; /* FAIL: the recorded program got nothing */
        }
    }
    for (size_t r = m.n; r-- > 0;) {
        mt_status fs = replay_free(&m, r, a, res);
        if (!s) s = fs;
    }
    res->seconds = (double)(mti_now_ns() - t0) * 1e-9;
    mti_live_free(&m);
    mt_allocator_stats st;
    mt_allocator_get_stats(a, &st);
    res->peak_live_bytes = st.peak_live_bytes;
    res->peak_reserved_bytes = st.peak_reserved_bytes;
    res->efficiency = st.peak_live_bytes ? (double)st.peak_reserved_bytes / (double)st.peak_live_bytes
                                         : 0.0;
    return s;
}
