/*
 * cplan.c - a context's communication plan made and freed (cplan.h).
 */
#include <stdlib.h>

#include "comm/comm.h"
#include "comm/cplan.h"
#include "comm/nccl_overlap.h"

mt_status mti_comm_plan_new(mt_context *ctx, const mt_comm *c, const mt_context *outer, bool dry)
{
    mti_comm_plan *p = calloc(1, sizeof *p);
    if (!p) return mti_fail(ctx, MT_ERR_OOM, "mt_context_create: out of host memory");
    p->threads = c ? (c->vt.caps & MT_COMM_CAP_THREADS) != 0 : outer && outer->comm->threads;
    p->nccl = c ? mti_nccl_is(c) : outer ? outer->comm->nccl : true;
    p->device = c ? mti_comm_is_device(c) : outer ? outer->comm->device : dry;
    ctx->comm = p;
    return MT_OK;
}

void mti_comm_plan_free(mt_context *ctx)
{
    free(ctx->comm);
    ctx->comm = NULL;
}
