/*
 * driver.c - runs a libFuzzer target over files, without libFuzzer: the
 * regression runs of `make test` feed every input kept in test/fuzz/<target>/
 * (seeds and crashes found) to the target built with the ordinary compiler.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) {
            fprintf(stderr, "cannot open %s\n", argv[i]);
            return 1;
        }
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        rewind(f);
        unsigned char *p = malloc(n > 0 ? (size_t)n : 1);
        if (!p || fread(p, 1, (size_t)n, f) != (size_t)n) {
            fprintf(stderr, "cannot read %s\n", argv[i]);
            return 1;
        }
        fclose(f);
        LLVMFuzzerTestOneInput(p, (size_t)n);
        free(p);
    }
    printf("ok   %d input(s)\n", argc - 1);
    return 0;
}
