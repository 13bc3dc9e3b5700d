/*
 * fuzz_checkpoint.c - libFuzzer target: the training checkpoint loader
 * (mt_trainer_load) on any bytes, into a small GPT's trainer. A file that
 * is refused must leave the trainer as it was: its state saves to the same
 * bytes before and after.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "memtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static unsigned char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    rewind(f);
    unsigned char *p = malloc(*n ? *n : 1);
    if (p && fread(p, 1, *n, f) != *n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    return p;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static mt_context *ctx;
    static mt_model *m;
    static mt_trainer *t;
    static char in[64], a[64], b[64];
    if (!ctx) {
        mt_context_config cc;
        mt_context_config_init(&cc);
        cc.device = MT_DEVICE_CPU;
        cc.threads = 1;
        mt_gpt_spec g;
        mt_gpt_spec_init(&g);
        g.vocab = 32, g.max_seq = 8, g.layers = 1, g.heads = 2, g.channels = 8, g.seed = 1;
        mt_trainer_config tc;
        mt_trainer_config_init(&tc);
        tc.max_batch = 2, tc.optimizer = MT_OPT_ADAMW8, tc.min_8bit_size = 64;
        if (mt_context_create(&cc, &ctx) || mt_model_gpt_create(ctx, &g, &m) ||
            mt_trainer_create(m, &tc, &t))
            __builtin_trap();
        long pid = (long)getpid();
        snprintf(in, sizeof in, "/tmp/mt_fuzz_%ld.ckpt", pid);
        snprintf(a, sizeof a, "/tmp/mt_fuzz_%ld_a.ckpt", pid);
        snprintf(b, sizeof b, "/tmp/mt_fuzz_%ld_b.ckpt", pid);
    }
    FILE *f = fopen(in, "wb");
    if (!f) return 0;
    fwrite(data, 1, size, f);
    fclose(f);
    if (mt_trainer_save(t, a, NULL, 0)) __builtin_trap();
    char user[16];
    size_t len;
    if (mt_trainer_load(t, in, user, sizeof user, &len) != MT_OK) {
        size_t na, nb;
        if (mt_trainer_save(t, b, NULL, 0)) __builtin_trap();
        unsigned char *pa = slurp(a, &na), *pb = slurp(b, &nb);
        if (!pa || !pb || na != nb || memcmp(pa, pb, na)) __builtin_trap(); /* changed */
        free(pa), free(pb);
    }
    remove(in), remove(a), remove(b);
    return 0;
}
