/*
 * fuzz_tokens.c - libFuzzer target: the training data loader (mt_data_open)
 * on any bytes as an llm.c token file and as auto-detected data, then a
 * batch of each split when it opens.
 */
#include <stddef.h>
#include <stdint.h>

#include "memtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (int f = 0; f < 2; f++) {
        mt_data_config c;
        mt_data_config_init(&c);
        c.bytes = data, c.n_bytes = size, c.seq_len = 4, c.batch = 2, c.prefetch = f;
        c.format = f ? MT_DATA_AUTO : MT_DATA_TOKENS;
        mt_data *d;
        if (mt_data_open(&c, &d) != MT_OK) continue;
        mt_batch b;
        mt_data_info in;
        mt_data_get_info(d, &in);
        for (int i = 0; i < 3; i++) {
            if (mt_data_next(d, MT_DATA_TRAIN, &b) != MT_OK) __builtin_trap();
            for (int j = 0; j < b.n * b.seq_len; j++)
                if (b.tokens[j] < 0 || b.tokens[j] >= in.vocab) __builtin_trap();
        }
        if (in.val_windows && mt_data_next(d, MT_DATA_VAL, &b) != MT_OK) __builtin_trap();
        mt_data_close(d);
    }
    return 0;
}
