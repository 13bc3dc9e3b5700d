/*
 * fuzz_config.c - libFuzzer target: the memtrain command's key=value
 * configuration parser (tools/config.c) on any bytes.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../../tools/cli.h"
#include "../../tools/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cfg_args a;
    char err[256];
    if (cfg_parse((const char *)data, size, "fuzz", (size & 1) ? CLI_TRAIN : 0, &a, err, sizeof err) == 0) {
        /* the first of the options is a name */
        if (a.argc && strncmp(a.argv[0], "--", 2)) __builtin_trap();
        cfg_args_free(&a);
    } else if (!memchr(err, 0, sizeof err)) {
        __builtin_trap(); /* the message is a string */
    }
    return 0;
}
