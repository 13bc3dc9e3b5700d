/*
 * fuzz_trace.c - libFuzzer target: the allocation trace loader
 * (mt_trace_load) on any bytes, and a replay of what loads.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "memtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static mt_context *ctx;
    static char path[64];
    if (!ctx) {
        mt_context_config cc;
        mt_context_config_init(&cc);
        cc.device = MT_DEVICE_CPU;
        cc.threads = 1;
        if (mt_context_create(&cc, &ctx)) __builtin_trap();
        snprintf(path, sizeof path, "/tmp/mt_fuzz_%ld.trace", (long)getpid());
    }
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    fwrite(data, 1, size, f);
    fclose(f);
    mt_trace *t;
    if (mt_trace_load(ctx, path, &t) == MT_OK) {
        mt_allocator_config ac = {.vtable = mt_allocator_caching()};
        mt_allocator *a;
        if (mt_allocator_create(ctx, &ac, &a) == MT_OK) {
            mt_replay_result r;
            (void)mt_trace_replay(t, a, &r);
            mt_allocator_destroy(a);
        }
        mt_trace_free(t);
    }
    remove(path);
    return 0;
}
