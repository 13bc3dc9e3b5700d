/*
 * status.c - status strings, error messages and logging.
 *
 * Every failing call records a message saying what was wrong with which
 * argument: on the context it was made on, or, for calls without one (such
 * as mt_context_create), in a per-thread slot read with mt_last_error(NULL).
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "ops/kernels.h"

/* Messages of this thread: of its last failure without a context, and of
 * its last failure on a context (tagged with which). A context also keeps
 * the last message of any thread, under its lock, for readers on other
 * threads; a thread reading its own failure never sees another's. */
static _Thread_local char tls_noctx[MTI_ERR_LEN];
static _Thread_local const mt_context *tls_ctx;
static _Thread_local char tls_ctx_msg[MTI_ERR_LEN];

const char *mt_version(void) { return MT_VERSION_STRING; }

const char *mt_cpu_isa(void) { return mti_isa_used_name(); }

const char *mt_status_string(mt_status s)
{
    switch (s) {
    case MT_OK: return "ok";
    case MT_ERR_INVALID_ARG: return "invalid argument";
    case MT_ERR_OOM: return "out of memory";
    case MT_ERR_NO_DEVICE: return "no such device";
    case MT_ERR_DEVICE: return "device error";
    case MT_ERR_IO: return "input/output error";
    case MT_ERR_FORMAT: return "bad file format";
    case MT_ERR_BAD_BLOCK: return "bad block";
    case MT_ERR_VERSION: return "version mismatch";
    case MT_ERR_UNSUPPORTED: return "unsupported";
    case MT_ERR_STATE: return "invalid state";
    case MT_ERR_BUDGET: return "memory budget cannot be met";
    case MT_ERR_INTERNAL: return "internal error";
    case MT_ERR_PLUGIN: return "a plug-in allocator broke its contract";
    case MT_ERR_COMM: return "communication failed";
    }
    return "unknown status";
}

const char *mt_mem_class_name(mt_mem_class c)
{
    static const char *const names[] = {"PARAM", "MASTER", "GRAD", "OPTIM",
                                        "ACT",   "WORK",   "IO",     "COMM"};
    _Static_assert(sizeof names / sizeof *names == MT_MEM_COUNT, "a name per mt_mem_class");
    return (unsigned)c < MT_MEM_COUNT ? names[c] : "?";
}

const char *mti_precision_name(unsigned p)
{
    static const char *const names[] = {"fp32", "fp16", "bf16"};
    _Static_assert(sizeof names / sizeof *names == MT_PREC_BF16 + 1, "a name per mt_precision");
    return p < sizeof names / sizeof *names ? names[p] : NULL;
}

const char *mt_last_error(const mt_context *ctx)
{
    if (!ctx) return tls_noctx;
    return tls_ctx == ctx ? tls_ctx_msg : ctx->err;
}

mti_msg mti_last_msg(const mt_context *ctx)
{
    mti_msg m;
    snprintf(m.s, sizeof m.s, "%s", mt_last_error(ctx));
    return m;
}

void mti_clear_error(mt_context *ctx)
{
    if (!ctx) {
        tls_noctx[0] = 0;
        return;
    }
    if (tls_ctx == ctx) tls_ctx = NULL;
    pthread_mutex_lock(&ctx->err_mu);
    ctx->err[0] = 0;
    pthread_mutex_unlock(&ctx->err_mu);
}

static void vlog(const mt_context *ctx, mt_log_level level, const char *fmt, va_list ap)
{
    if (!ctx || !ctx->cfg.log_fn || level > ctx->cfg.log_level) return;
    char msg[MTI_ERR_LEN];
    vsnprintf(msg, sizeof msg, fmt, ap);
    ctx->cfg.log_fn(ctx->cfg.log_user, level, msg);
}

void mti_log(const mt_context *ctx, mt_log_level level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(ctx, level, fmt, ap);
    va_end(ap);
}

mt_status mti_fail(mt_context *ctx, mt_status s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    /* format into a scratch buffer first: an argument may be the old message */
    char msg[MTI_ERR_LEN];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t n = strlen(msg) + 1;
    if (!ctx) {
        memcpy(tls_noctx, msg, n);
    } else {
        memcpy(tls_ctx_msg, msg, n);
        tls_ctx = ctx;
        pthread_mutex_lock(&ctx->err_mu);
        memcpy(ctx->err, msg, n);
        pthread_mutex_unlock(&ctx->err_mu);
    }
    mti_log(ctx, MT_LOG_DEBUG, "%s: %s", mt_status_string(s), msg);
    return s;
}
