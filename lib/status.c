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

static _Thread_local char tls_err[MTI_ERR_LEN];

const char *mt_version(void) { return MT_VERSION_STRING; }

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
    }
    return "unknown status";
}

const char *mt_mem_class_name(mt_mem_class c)
{
    static const char *const names[MT_MEM_COUNT] = {"PARAM", "MASTER", "GRAD", "OPTIM",
                                                    "ACT",   "WORK",   "IO"};
    return (unsigned)c < MT_MEM_COUNT ? names[c] : "?";
}

const char *mt_last_error(const mt_context *ctx) { return ctx ? ctx->err : tls_err; }

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
    char *dst = ctx ? ctx->err : tls_err;
    va_list ap;
    va_start(ap, fmt);
    /* format into a scratch buffer first: an argument may point into dst */
    char msg[MTI_ERR_LEN];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(dst, msg, sizeof msg);
    mti_log(ctx, MT_LOG_DEBUG, "%s: %s", mt_status_string(s), msg);
    return s;
}
