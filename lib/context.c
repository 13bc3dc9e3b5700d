/*
 * context.c - the context: device, allocator instances per memory class,
 * memory stats and the memory report.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "comm/comm.h"
#include "ops/kernels.h"

void mt_context_config_init(mt_context_config *cfg)
{
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->device = MT_DEVICE_AUTO;
    cfg->log_level = MT_LOG_WARN;
}

static const mt_allocator_vtable *vt_or_default(const mt_allocator_vtable *vt)
{
    return vt ? vt : mt_allocator_caching();
}

static bool same_instance(const mt_allocator_config *a, const mt_allocator_config *b)
{
    return vt_or_default(a->vtable) == vt_or_default(b->vtable) && a->options == b->options &&
           a->limit_bytes == b->limit_bytes && a->flags == b->flags && a->group == b->group;
}

/* Copies a caller's config, tolerating an older, shorter struct. */
static mt_status take_config(const mt_context_config *in, mt_context_config *c)
{
    mt_context_config_init(c);
    if (!in) return MT_OK;
    if (in->struct_size < offsetof(mt_context_config, allocators) ||
        in->struct_size > sizeof *c)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_context_create: cfg->struct_size %u is not a size this library knows "
                        "(call mt_context_config_init first)",
                        in->struct_size);
    memcpy(c, in, in->struct_size);
    c->struct_size = sizeof *c;
    if ((unsigned)c->device > MT_DEVICE_CUDA)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_create: cfg->device %d is not a device",
                        (int)c->device);
    if (c->device_ordinal < 0)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_create: cfg->device_ordinal %d < 0",
                        c->device_ordinal);
    if (c->threads < 0 || c->threads > 4096)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_context_create: cfg->threads %d out of range 0..4096", c->threads);
    if (c->world_size < 0 || c->world_size > 65536 || c->rank < 0 ||
        c->rank >= (c->world_size > 1 ? c->world_size : 1))
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_context_create: cfg->rank %d of cfg->world_size %d (need 0 <= rank < "
                        "world_size <= 65536; 0: one rank)",
                        c->rank, c->world_size);
    if (c->comm && c->world_size > 1 &&
        (c->world_size != mt_comm_size(c->comm) || c->rank != mt_comm_rank(c->comm)))
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_context_create: cfg->rank %d of cfg->world_size %d contradicts "
                        "cfg->comm (rank %d of %d): a context with a communicator takes its "
                        "world from it (leave world_size 0)",
                        c->rank, c->world_size, mt_comm_rank(c->comm), mt_comm_size(c->comm));
    if ((unsigned)c->log_level > MT_LOG_DEBUG)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_create: cfg->log_level %d out of range",
                        (int)c->log_level);
    return MT_OK;
}

static void context_free(mt_context *ctx)
{
    mti_comm_free_buffers(ctx);
    for (int i = 0; i < ctx->n_inst; i++) mti_allocator_delete(ctx->inst[i]);
    mti_comm_plan_free(ctx);
    if (ctx->trace) mt_trace_free(ctx->trace);
    if (ctx->dev) ctx->dev->keep_memory = ctx->kept_bytes != 0; /* (the staging's) */
    if (ctx->dev) ctx->dev->destroy(ctx->dev);
    free((char *)ctx->cfg.cublaslt_path);
    mti_clear_error(ctx);
    pthread_mutex_destroy(&ctx->err_mu);
    free(ctx);
}

/* Keeps the failure message for mt_last_error(NULL), then frees ctx. */
static mt_status create_failed(mt_context *ctx, mt_status s)
{
    mti_msg msg = mti_last_msg(ctx);
    context_free(ctx);
    return mti_fail(NULL, s, "%s", msg.s);
}

static mt_status create(const mt_context_config *cfg, bool dry, const mti_device *like,
                        mt_context **out);

mt_status mt_context_create(const mt_context_config *cfg, mt_context **out)
{
    const size_t has_dry = offsetof(mt_context_config, dry_run) + sizeof cfg->dry_run;
    return create(cfg, cfg && cfg->struct_size >= has_dry && cfg->dry_run, NULL, out);
}

mt_status mti_context_create_dry(const mt_context_config *cfg, const mti_device *like,
                                 mt_context **out)
{
    return create(cfg, true, like, out);
}

/* The op table of the context's device (lib/ops/kernels.h): the CPU's; a
 * CUDA device's, made for it (a failure: its kernels did not load); or a
 * dry CUDA context's. Chosen here, above the devices and the tables, so
 * that neither calls the other. */
static mt_status op_table(mt_context *ctx, const mti_ops **out)
{
    if (ctx->dev->kind != MT_DEVICE_CUDA) {
        *out = mti_cpu_ops();
        return MT_OK;
    }
    if (ctx->dry) {
        *out = mti_cuda_dry_ops();
        return MT_OK;
    }
    return mti_cuda_ops(ctx->dev, out);
}

static mt_status create(const mt_context_config *cfg, bool dry, const mti_device *like,
                        mt_context **out)
{
    if (!out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_create: out is NULL");
    *out = NULL;
    mt_context_config c;
    mt_status s = take_config(cfg, &c);
    if (s) return s;
    char isa_msg[320];
    if (mti_isa_check(isa_msg, sizeof isa_msg))
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_create: %s", isa_msg);

    /* an estimate within an estimate (a budget or auto-fit in a dry
       trainer) plans the communicator the outer dry context kept */
    const mt_context *outer = dry && !c.comm && like && like->ctx && like->ctx->dry ? like->ctx : NULL;

    mt_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return mti_fail(NULL, MT_ERR_OOM, "mt_context_create: out of host memory");
    pthread_mutex_init(&ctx->err_mu, NULL);
    mti_clear_error(ctx); /* a context freed before may have had this address */
    if (!dry && c.world_size > 1) {
        context_free(ctx);
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_context_create: cfg->world_size %d is for dry contexts (estimates); a "
                        "context that trains takes its world from cfg->comm",
                        c.world_size);
    }
    ctx->world = c.comm ? mt_comm_size(c.comm) : c.world_size > 1 ? c.world_size : 1;
    ctx->rank = c.comm ? mt_comm_rank(c.comm) : ctx->world > 1 ? c.rank : 0;
    if ((s = mti_comm_plan_new(ctx, c.comm, outer, dry))) return create_failed(ctx, s);
    if (dry) { /* an estimate records and logs nothing */
        c.trace_capacity = 0;
        c.log_fn = NULL;
        c.comm = NULL; /* and communicates nothing, planning as the rank it was */
        c.world_size = ctx->world;
        c.rank = ctx->rank;
    }
    ctx->cfg = c;
    ctx->cfg.cublaslt_path = NULL; /* the context's own copy: it is read at the first GEMM */
    if (c.cublaslt_path && c.cublaslt_path[0] && !(ctx->cfg.cublaslt_path = strdup(c.cublaslt_path)))
        return create_failed(ctx, mti_fail(ctx, MT_ERR_OOM, "mt_context_create: out of host memory"));
    ctx->dry = dry;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    ctx->threads = c.threads ? c.threads : (ncpu > 0 ? (int)ncpu : 1);

    mt_device_kind kind = c.device;
    if (kind == MT_DEVICE_AUTO)
        kind = mti_cuda_available(c.cuda_driver_path) ? MT_DEVICE_CUDA : MT_DEVICE_CPU;
    if (dry)
        s = mti_device_dry_open(ctx, kind, like, ctx->threads, &ctx->dev);
    else if (kind == MT_DEVICE_CUDA)
        s = mti_device_cuda_open(ctx, c.cuda_driver_path, c.device_ordinal, &ctx->dev);
    else
        s = mti_device_cpu_open(ctx, ctx->threads, &ctx->dev);
    if (s) return create_failed(ctx, s);
    /* without kernels the device still serves memory and copies */
    if (op_table(ctx, &ctx->ops) != MT_OK) {
        ctx->ops = NULL;
        mti_log(ctx, MT_LOG_WARN, "no %s op table: %s", ctx->dev->name, mt_last_error(ctx));
    }

    for (int k = 0; k < MT_MEM_COUNT; k++) {
        int found = -1;
        for (int j = 0; j < k && found < 0; j++)
            if (same_instance(&c.allocators[j], &c.allocators[k])) found = j;
        if (found >= 0) {
            ctx->by_class[k] = ctx->by_class[found];
            continue;
        }
        mt_allocator *a = NULL;
        s = mti_allocator_new(ctx, &c.allocators[k], ctx->n_inst, &a);
        if (s) {
            mti_fail(ctx, s, "allocator of class %s: %s", mt_mem_class_name((mt_mem_class)k),
                     mti_last_msg(ctx).s);
            return create_failed(ctx, s);
        }
        ctx->inst[ctx->n_inst++] = a;
        ctx->by_class[k] = a;
    }
    if (c.trace_capacity) {
        s = mt_context_trace_start(ctx, c.trace_capacity);
        if (s) return create_failed(ctx, s);
    }
    if ((s = mti_comm_buffers(ctx))) return create_failed(ctx, s);
    if (c.comm && (s = mti_comm_attach(ctx))) return create_failed(ctx, s);
    mti_log(ctx, MT_LOG_INFO, "context on %s, %d allocator instance(s)", ctx->dev->name,
            ctx->n_inst);
    mti_clear_error(ctx);
    *out = ctx;
    return MT_OK;
}

mt_status mt_context_destroy(mt_context *ctx)
{
    if (!ctx) return MT_OK;
    int n = atomic_load(&ctx->n_children);
    if (n)
        return mti_fail(ctx, MT_ERR_STATE,
                        "mt_context_destroy: %d model(s), trainer(s) or allocator(s) made from "
                        "this context are still alive; destroy them first",
                        n);
    /* Work still queued on the device ends first. A failure it reports (a
     * kernel that faulted after the last call that waited for the device)
     * is returned, once everything is released all the same: a fault no
     * call saw would otherwise go unnoticed, and the GPU's driver may not
     * recover from it at exit. */
    mt_status s = ctx->dev ? ctx->dev->sync(ctx->dev) : MT_OK;
    mti_msg why = mti_last_msg(ctx);
    context_free(ctx);
    if (s)
        return mti_fail(NULL, s, "mt_context_destroy: the device reported a failure of earlier "
                        "work: %s (the context was released all the same)", why.s);
    return MT_OK;
}

mt_device_kind mt_context_device(const mt_context *ctx)
{
    return ctx && ctx->dev ? ctx->dev->kind : MT_DEVICE_CPU;
}

const char *mt_context_device_name(const mt_context *ctx)
{
    return ctx && ctx->dev ? ctx->dev->name : "";
}

mt_status mt_context_device_memory(mt_context *ctx, uint64_t *free_bytes, uint64_t *total_bytes)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_device_memory: ctx is NULL");
    size_t f = 0, t = 0;
    mt_status s = ctx->dev->mem_info(ctx->dev, &f, &t);
    if (s) return s;
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
    return MT_OK;
}

/* ---- stats and report ---- */

/* peak = total, then raised again to the total should another thread have
 * added in between, so the peak is never below the current value */
static void reset_peak(_Atomic uint64_t *total, _Atomic uint64_t *peak)
{
    atomic_store(peak, atomic_load(total));
    uint64_t v = atomic_load(total), p = atomic_load(peak);
    while (v > p && !atomic_compare_exchange_weak(peak, &p, v)) {
    }
}

mt_status mt_context_set_estimate(mt_context *ctx, const mt_estimate_report *e)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_set_estimate: ctx is NULL");
    ctx->has_estimate = e != NULL;
    if (e) ctx->estimate = *e;
    return MT_OK;
}

mt_status mt_context_reset_peaks(mt_context *ctx)
{
    if (!ctx) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_context_reset_peaks: ctx is NULL");
    for (int i = 0; i < ctx->n_inst; i++) mti_allocator_reset_peak(ctx->inst[i]);
    reset_peak(&ctx->live_total, &ctx->live_peak);
    reset_peak(&ctx->reserved_total, &ctx->reserved_peak);
    mti_place_reset_peaks(ctx);
    return MT_OK;
}

/* Appends to a bounded buffer, counting what would have been written. */
typedef struct sbuf {
    char *buf;
    size_t cap, len;
} sbuf;

static void MTI_PRINTF(2, 3) sb_printf(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    size_t room = b->len < b->cap ? b->cap - b->len : 0;
    int n = vsnprintf(room ? b->buf + b->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0) b->len += (size_t)n;
}

/* "12.34 MiB" style, into a caller buffer of >= 16 bytes. */
static const char *human(uint64_t bytes, char *s, size_t n)
{
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(s, n, "%llu B", (unsigned long long)bytes);
    else snprintf(s, n, "%.2f %s", v, unit[u]);
    return s;
}

/* The places other than the device, class by class, when anything is or
 * was there (or the estimate puts something there). */
static void place_report(const mt_context *ctx, const mt_estimate_report *e, sbuf *b)
{
    char h1[32], h2[32], he[32];
    for (int p = MT_PLACE_HOST; p < MT_PLACE_COUNT; p++) {
        mt_memory_stats ps;
        mt_context_place_stats(ctx, (mt_place)p, &ps);
        if (!ps.peak_live_bytes && !(e && e->place_peak[p])) continue;
        sb_printf(b, "\n%-7s %12s %12s %12s   (held on %s)\n", mt_place_name((mt_place)p),
                  "current", "peak", "estimate", p == MT_PLACE_DISK ? "disk: scratch files" : "the host");
        for (int c = 0; c < MT_MEM_COUNT; c++) {
            const mt_class_stats *k = &ps.per_class[c];
            if (!k->peak_live_bytes && !(e && e->place_class_peak[p][c])) continue;
            sb_printf(b, "%-7s %12s %12s %12s\n", mt_mem_class_name((mt_mem_class)c),
                      human(k->live_bytes, h1, sizeof h1), human(k->peak_live_bytes, h2, sizeof h2),
                      e ? human(e->place_class_peak[p][c], he, sizeof he) : "-");
        }
        sb_printf(b, "%-7s %12s %12s %12s\n", "total", human(ps.live_bytes, h1, sizeof h1),
                  human(ps.peak_live_bytes, h2, sizeof h2),
                  e ? human(e->place_peak[p], he, sizeof he) : "-");
    }
}

mt_status mt_memory_report(const mt_context *ctx, char *buf, size_t cap, size_t *needed)
{
    if (!ctx || (!buf && cap))
        return mti_fail((mt_context *)ctx, MT_ERR_INVALID_ARG,
                        ctx ? "mt_memory_report: buf is NULL but cap is not 0"
                            : "mt_memory_report: ctx is NULL");
    mt_memory_stats ms;
    mt_context_memory_stats(ctx, &ms);
    sbuf b = {buf, cap, 0};
    char h1[32], h2[32], h3[32], h4[32], h5[32];
    sb_printf(&b, "memory report: %s, %d allocator instance(s)\n", ctx->dev->name, ctx->n_inst);
    /* the estimate beside the measured figures, when one was made for this
       context (mt_estimate_model, a budgeted trainer, mt_context_set_estimate) */
    const mt_estimate_report *e = ctx->has_estimate ? &ctx->estimate : NULL;
    char he[32];
    sb_printf(&b, "%-7s %12s %12s %12s %10s %10s %5s  %s\n", "class", "current", "peak",
              "estimate", "allocs", "frees", "oom", "allocator");
    for (int c = 0; c < MT_MEM_COUNT; c++) {
        const mt_class_stats *k = &ms.per_class[c];
        const mt_allocator *a = ctx->by_class[c];
        sb_printf(&b, "%-7s %12s %12s %12s %10llu %10llu %5llu  %s#%d\n",
                  mt_mem_class_name((mt_mem_class)c), human(k->live_bytes, h1, sizeof h1),
                  human(k->peak_live_bytes, h2, sizeof h2),
                  e ? human(e->class_peak[c], he, sizeof he) : "-", (unsigned long long)k->n_alloc,
                  (unsigned long long)k->n_free, (unsigned long long)k->n_oom_failures,
                  a->vt->name, a->index);
    }
    sb_printf(&b, "%-7s %12s %12s %12s   (peak of all classes together)\n", "total",
              human(ms.live_bytes, h1, sizeof h1), human(ms.peak_live_bytes, h2, sizeof h2),
              e ? human(e->peak, he, sizeof he) : "-");
    sb_printf(&b, "\n%-14s %12s %12s %12s %12s %8s %9s %7s %5s\n", "allocator", "reserved",
              "peak resv", "live", "waste", "peak r/l", "backing", "retries", "oom");
    for (int i = 0; i < ctx->n_inst; i++) {
        mt_allocator_stats st;
        mt_allocator_get_stats(ctx->inst[i], &st);
        char name[32];
        snprintf(name, sizeof name, "%s#%d", ctx->inst[i]->vt->name, i);
        uint64_t waste = st.reserved_bytes > st.live_bytes ? st.reserved_bytes - st.live_bytes : 0;
        double eff = st.peak_live_bytes ? (double)st.peak_reserved_bytes / (double)st.peak_live_bytes
                                        : 0.0;
        sb_printf(&b, "%-14s %12s %12s %12s %12s %8.3f %9llu %7llu %5llu\n", name,
                  human(st.reserved_bytes, h1, sizeof h1),
                  human(st.peak_reserved_bytes, h2, sizeof h2), human(st.live_bytes, h3, sizeof h3),
                  human(waste, h4, sizeof h4), eff,
                  (unsigned long long)(st.n_backing_alloc + st.n_backing_free),
                  (unsigned long long)st.n_oom_retries, (unsigned long long)st.n_oom_failures);
    }
    sb_printf(&b, "%-14s %12s %12s\n", "total", human(ms.reserved_bytes, h1, sizeof h1),
              human(ms.peak_reserved_bytes, h5, sizeof h5));
    if (e)
        sb_printf(&b, "%-14s %12s %12s   (the estimate's peak reserved)\n", "estimate", "",
                  human(e->peak_reserved, h5, sizeof h5));
    place_report(ctx, e, &b);
    if (needed) *needed = b.len;
    if (cap) buf[b.len < cap ? b.len : cap - 1] = 0;
    return MT_OK;
}
