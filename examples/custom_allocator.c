/*
 * custom_allocator.c - an allocator written against memtrain/allocator.h
 * alone, plugged into a context for every memory class, training a small
 * model.
 *
 * The "direct" allocator: every block is its own reservation from the
 * backing (what calling cudaMalloc per tensor does). Simple, never wastes
 * more than the backing's rounding, and slow when blocks come and go often:
 * a good baseline, and a complete example of the contract:
 *   - bookkeeping in host memory (a table of records), never touching blocks;
 *   - handles that let free detect foreign and double frees safely;
 *   - reset by lifetime; stats kept with the helpers of allocator.h.
 *
 * Build: cc -std=c11 custom_allocator.c $(pkg-config --cflags --libs memtrain)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <memtrain/allocator.h>

typedef struct record {
    void *ptr;        /* NULL when the slot is free */
    size_t granted;   /* what the backing gave */
    size_t bytes;     /* what was asked */
    uint32_t gen;     /* bumped on every free, so stale handles are caught */
    mt_mem_class mem_class;
    mt_lifetime lifetime;
    uint32_t next_free;
} record;

typedef struct direct {
    const mt_backing *backing;
    record *rec;
    uint32_t n, cap, free_head; /* free_head: 1-based index of a free slot, 0 if none */
    mt_allocator_stats st;
} direct;

static mt_status d_create(const mt_allocator_params *params, const mt_backing *backing,
                          void **state)
{
    (void)params; /* no options */
    direct *d = calloc(1, sizeof *d);
    if (!d) return MT_ERR_OOM;
    d->backing = backing;
    *state = d;
    return MT_OK;
}

/* handle = generation << 32 | (index + 1) */
static uint64_t handle_of(const direct *d, uint32_t i) { return (uint64_t)d->rec[i].gen << 32 | (i + 1); }

static mt_status d_alloc(void *state, const mt_alloc_request *req, mt_block *out)
{
    direct *d = state;
    uint32_t i;
    if (d->free_head) {
        i = d->free_head - 1;
        d->free_head = d->rec[i].next_free;
    } else {
        if (d->n == d->cap) {
            uint32_t nc = d->cap ? 2 * d->cap : 64;
            record *nr = realloc(d->rec, nc * sizeof *nr);
            if (!nr) return MT_ERR_OOM;
            d->rec = nr;
            d->cap = nc;
        }
        i = d->n++;
        memset(&d->rec[i], 0, sizeof d->rec[i]);
    }
    record *r = &d->rec[i];
    mt_status s = d->backing->reserve(d->backing->self, req->bytes, req->alignment, &r->ptr,
                                      &r->granted);
    if (s) {
        r->ptr = NULL;
        r->next_free = d->free_head;
        d->free_head = i + 1;
        if (s == MT_ERR_OOM) mt_stats_on_oom(&d->st, req->mem_class);
        return s;
    }
    r->bytes = req->bytes;
    r->mem_class = req->mem_class;
    r->lifetime = req->lifetime;
    mt_stats_on_reserve(&d->st, r->granted);
    mt_stats_on_alloc(&d->st, req->mem_class, req->bytes);
    out->ptr = r->ptr;
    out->handle = handle_of(d, i);
    return MT_OK;
}

static void release(direct *d, uint32_t i)
{
    record *r = &d->rec[i];
    d->backing->release(d->backing->self, r->ptr, r->granted);
    mt_stats_on_release(&d->st, r->granted);
    mt_stats_on_free(&d->st, r->mem_class, r->bytes);
    r->ptr = NULL;
    r->gen++;
    r->next_free = d->free_head;
    d->free_head = i + 1;
}

static mt_status d_free(void *state, const mt_block *blk)
{
    direct *d = state;
    uint64_t idx = blk->handle & 0xFFFFFFFFu;
    if (idx == 0 || idx > d->n) return MT_ERR_BAD_BLOCK;
    uint32_t i = (uint32_t)idx - 1;
    const record *r = &d->rec[i];
    if (!r->ptr || r->ptr != blk->ptr || handle_of(d, i) != blk->handle) return MT_ERR_BAD_BLOCK;
    release(d, i);
    return MT_OK;
}

static mt_status d_reset(void *state, mt_scope scope)
{
    direct *d = state;
    for (uint32_t i = 0; i < d->n; i++)
        if (d->rec[i].ptr && (int)d->rec[i].lifetime >= (int)scope) release(d, i);
    d->st.n_resets++;
    return MT_OK;
}

static mt_status d_trim(void *state)
{
    ((direct *)state)->st.n_trims++; /* nothing is cached */
    return MT_OK;
}

static mt_status d_stats(void *state, mt_allocator_stats *out)
{
    *out = ((direct *)state)->st;
    return MT_OK;
}

static void d_destroy(void *state)
{
    direct *d = state;
    for (uint32_t i = 0; i < d->n; i++)
        if (d->rec[i].ptr) release(d, i);
    free(d->rec);
    free(d);
}

static const mt_allocator_vtable direct_vtable = {
    .abi_version = MT_ALLOCATOR_ABI_VERSION,
    .struct_size = sizeof(mt_allocator_vtable),
    .name = "direct",
    .caps = MT_ALLOCATOR_CAP_DETECTS_BAD_FREE,
    .create = d_create,
    .alloc = d_alloc,
    .free = d_free,
    .reset = d_reset,
    .trim = d_trim,
    .stats = d_stats,
    .destroy = d_destroy,
};

const mt_allocator_vtable *example_allocator(void);
const mt_allocator_vtable *example_allocator(void) { return &direct_vtable; }

#ifndef MT_EXAMPLE_NO_MAIN
/* Plug it in for every memory class and train a small MLP on XOR-like data. */
int main(void)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = MT_DEVICE_CPU;
    for (int c = 0; c < MT_MEM_COUNT; c++) cfg.allocators[c].vtable = example_allocator();
    mt_context *ctx;
    if (mt_context_create(&cfg, &ctx) != MT_OK) {
        fprintf(stderr, "context: %s\n", mt_last_error(NULL));
        return 1;
    }
    mt_mlp_spec spec;
    mt_mlp_spec_init(&spec);
    spec.n_layers = 2;
    spec.dims[0] = 2, spec.dims[1] = 32, spec.dims[2] = 2;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 64;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    if (mt_model_mlp_create(ctx, &spec, &m) || mt_trainer_create(m, &tc, &t)) {
        fprintf(stderr, "model: %s\n", mt_last_error(ctx));
        return 1;
    }
    float x[64 * 2], first = 0, loss = 0;
    int32_t y[64];
    uint32_t seed = 1;
    for (int step = 0; step < 300; step++) {
        for (int i = 0; i < 64; i++) { /* the class is the sign of x0 * x1 */
            for (int k = 0; k < 2; k++) {
                seed = seed * 1664525u + 1013904223u;
                x[2 * i + k] = (float)(seed >> 8) / 8388608.0f - 1.0f;
            }
            y[i] = x[2 * i] * x[2 * i + 1] > 0;
        }
        mt_batch b = {.n = 64, .inputs = x, .targets = y};
        if (mt_trainer_step(t, &b, &loss) != MT_OK) {
            fprintf(stderr, "step: %s\n", mt_last_error(ctx));
            return 1;
        }
        if (step == 0) first = loss;
    }
    printf("direct allocator: loss %.3f -> %.3f\n", first, loss);
    char report[4096];
    mt_memory_report(ctx, report, sizeof report, NULL);
    fputs(report, stdout);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return loss < first ? 0 : 1;
}
#endif
