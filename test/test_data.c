/*
 * test_data.c - training data: text and llm.c token files, the split, the
 * shuffled order, prefetch, resuming from a position, bad files.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "memtrain.h"

static unsigned char *some_text(size_t n)
{
    unsigned char *t = malloc(n);
    for (size_t i = 0; i < n; i++) t[i] = (unsigned char)(32 + (i * 7 + i / 13) % 90);
    return t;
}

static mt_data *open_bytes(const void *p, size_t n, int T, int B, uint64_t seed, int prefetch)
{
    mt_data_config c;
    mt_data_config_init(&c);
    c.bytes = p, c.n_bytes = n, c.seq_len = T, c.batch = B, c.seed = seed, c.prefetch = prefetch;
    mt_data *d;
    CHECK_OKC(NULL, mt_data_open(&c, &d));
    return d;
}

/* Targets are the inputs shifted by one, windows come from the text, each
   training window appears once per epoch, validation windows are the last
   ones, in order. */
TEST(data_text_windows_and_epochs)
{
    const size_t n = 64 * 100 + 1;
    unsigned char *t = some_text(n);
    const int T = 64, B = 5;
    mt_data *d = open_bytes(t, n, T, B, 7, 1);
    mt_data_info in;
    CHECK_OK(mt_data_get_info(d, &in));
    CHECK(in.vocab == 256 && in.tokens == n && in.train_windows == 90 && in.val_windows == 10);
    int seen[100] = {0};
    for (int k = 0; k < 18; k++) { /* 90 windows: exactly one epoch */
        mt_batch b;
        CHECK_OK(mt_data_next(d, MT_DATA_TRAIN, &b));
        CHECK(b.n == B && b.seq_len == T);
        for (int r = 0; r < B; r++) {
            const int32_t *x = b.tokens + r * T, *y = b.targets + r * T;
            /* find the window: its first token's place in the text */
            int w = -1;
            for (int c = 0; c < 90 && w < 0; c++) {
                int ok = 1;
                for (int j = 0; j < T && ok; j++) ok = x[j] == t[c * T + j] && y[j] == t[c * T + j + 1];
                if (ok) w = c;
            }
            CHECK_MSG(w >= 0, "batch %d row %d is not a training window", k, r);
            seen[w]++;
        }
    }
    for (int w = 0; w < 90; w++) CHECK_MSG(seen[w] == 1, "window %d served %d times", w, seen[w]);
    CHECK_OK(mt_data_get_info(d, &in));
    CHECK(in.epoch == 0 && in.position == 90);
    mt_batch v;
    CHECK_OK(mt_data_next(d, MT_DATA_VAL, &v));
    for (int r = 0; r < B; r++)
        for (int j = 0; j < T; j++) CHECK(v.tokens[r * T + j] == t[(90 + r) * T + j]);
    mt_data_close(d);
    free(t);
}

/* The same seed gives the same batches, with or without prefetch; a stream
   moved to a saved position goes on as the original does, training and
   validation. */
TEST(data_order_is_seeded_and_resumable)
{
    const size_t n = 32 * 50 + 1;
    unsigned char *t = some_text(n);
    mt_data *a = open_bytes(t, n, 32, 3, 11, 1), *b = open_bytes(t, n, 32, 3, 11, 0);
    mt_data *c = open_bytes(t, n, 32, 3, 12, 1);
    int differs = 0;
    mt_data_info at;
    for (int k = 0; k < 40; k++) { /* across epochs */
        mt_batch x, y, z;
        CHECK_OK(mt_data_next(a, MT_DATA_TRAIN, &x));
        CHECK_OK(mt_data_next(b, MT_DATA_TRAIN, &y));
        CHECK_OK(mt_data_next(c, MT_DATA_TRAIN, &z));
        CHECK(memcmp(x.tokens, y.tokens, 3 * 32 * 4) == 0);
        CHECK(memcmp(x.targets, y.targets, 3 * 32 * 4) == 0);
        differs += memcmp(x.tokens, z.tokens, 3 * 32 * 4) != 0;
        if (k == 24) CHECK_OK(mt_data_get_info(a, &at));
    }
    CHECK(differs > 30); /* another seed, another order */
    CHECK(at.epoch > 0);
    /* resume at batch 25 */
    mt_data *r = open_bytes(t, n, 32, 3, 11, 1), *ref = open_bytes(t, n, 32, 3, 11, 1);
    CHECK_OK(mt_data_seek(r, at.epoch, at.position));
    for (int k = 0; k < 25; k++) {
        mt_batch x;
        CHECK_OK(mt_data_next(ref, MT_DATA_TRAIN, &x));
    }
    for (int k = 0; k < 20; k++) {
        mt_batch x, y;
        CHECK_OK(mt_data_next(ref, MT_DATA_TRAIN, &x));
        CHECK_OK(mt_data_next(r, MT_DATA_TRAIN, &y));
        CHECK_MSG(memcmp(x.tokens, y.tokens, 3 * 32 * 4) == 0, "batch %d after resuming", k);
    }
    CHECK_ST(MT_ERR_INVALID_ARG, mt_data_seek(r, 0, 1000));
    /* the validation stream too: 5 windows, batches of 3 wrap around */
    mt_data_info vi;
    for (int k = 0; k < 3; k++) {
        mt_batch x;
        CHECK_OK(mt_data_next(ref, MT_DATA_VAL, &x));
    }
    CHECK_OK(mt_data_get_info(ref, &vi));
    CHECK_MSG(vi.val_windows == 5 && vi.val_position == 4, "val position %llu of %zu",
              (unsigned long long)vi.val_position, vi.val_windows);
    CHECK_OK(mt_data_seek_val(r, vi.val_position));
    for (int k = 0; k < 4; k++) {
        mt_batch x, y;
        CHECK_OK(mt_data_next(ref, MT_DATA_VAL, &x));
        CHECK_OK(mt_data_next(r, MT_DATA_VAL, &y));
        CHECK_MSG(memcmp(x.tokens, y.tokens, 3 * 32 * 4) == 0, "validation batch %d after seeking", k);
    }
    CHECK_ST(MT_ERR_INVALID_ARG, mt_data_seek_val(r, 5));
    CHECK_OK(mt_data_seek_val(r, 0));
    mt_data_close(a), mt_data_close(b), mt_data_close(c), mt_data_close(r), mt_data_close(ref);
    free(t);
}

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* llm.c token files: read back exactly; truncated, padded, of another
   version or magic, missing: refused, naming the file. */
TEST(data_token_files)
{
    const int ntok = 3000;
    size_t n = 1024 + 2 * (size_t)ntok;
    unsigned char *f = calloc(1, n);
    put32(f, 20240520), put32(f + 4, 1), put32(f + 8, (uint32_t)ntok);
    for (int i = 0; i < ntok; i++) {
        uint16_t v = (uint16_t)((i * 37) % 50257);
        f[1024 + 2 * i] = (unsigned char)v, f[1024 + 2 * i + 1] = (unsigned char)(v >> 8);
    }
    char path[256];
    snprintf(path, sizeof path, "/tmp/mt_test_%ld_tok.bin", (long)getpid());
    FILE *fp = fopen(path, "wb");
    CHECK(fp && fwrite(f, 1, n, fp) == n);
    fclose(fp);
    mt_data_config c;
    mt_data_config_init(&c);
    c.path = path, c.seq_len = 16, c.batch = 2;
    mt_data *d;
    CHECK_OKC(NULL, mt_data_open(&c, &d));
    mt_data_info in;
    CHECK_OK(mt_data_get_info(d, &in));
    int most = 0;
    for (int i = 0; i < ntok; i++) most = (i * 37) % 50257 > most ? (i * 37) % 50257 : most;
    CHECK_MSG(in.tokens == (size_t)ntok && in.vocab == most + 1, "%zu tokens, vocab %d (want %d)", in.tokens, in.vocab, most + 1);
    mt_batch v;
    CHECK_OK(mt_data_next(d, MT_DATA_VAL, &v));
    size_t w0 = in.train_windows;
    for (int j = 0; j < 16; j++) CHECK(v.tokens[j] == (int32_t)(((w0 * 16 + j) * 37) % 50257));
    mt_data_close(d);
    /* damaged files */
    const struct {
        size_t len;
        int at;
        uint32_t val;
        const char *says;
    } bad[] = {{100, -1, 0, "too short"},
               {n - 1, -1, 0, "token count"},
               {n, 0, 20240521, "magic"},
               {n, 4, 2, "version"},
               {n, 8, 3001, "token count"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        unsigned char *g = malloc(n + 1);
        memcpy(g, f, n);
        if (bad[i].at >= 0) put32(g + bad[i].at, bad[i].val);
        fp = fopen(path, "wb");
        CHECK(fp && fwrite(g, 1, bad[i].len, fp) == bad[i].len);
        fclose(fp);
        c.format = MT_DATA_TOKENS;
        CHECK_ST(MT_ERR_FORMAT, mt_data_open(&c, &d));
        CHECK_MSG(strstr(mt_last_error(NULL), bad[i].says) && strstr(mt_last_error(NULL), path),
                  "case %zu: %s", i, mt_last_error(NULL));
        free(g);
    }
    remove(path);
    CHECK_ST(MT_ERR_IO, mt_data_open(&c, &d));
    /* too little data for both splits */
    mt_data_config_init(&c);
    c.bytes = "abcdefgh", c.n_bytes = 8, c.seq_len = 8;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_data_open(&c, &d));
    free(f);
}

/* Opening, taking a batch and closing, many times over: the prefetch
   thread never misses the first request. (It once could: the request was
   made after the thread started, and a thread that had just checked for it
   slept through it; seen under load, rare otherwise, so this is a stress,
   and the fix is that the request exists before the thread does.) */
TEST(data_prefetch_start_and_stop)
{
    const size_t n = 16 * 20 + 1;
    unsigned char *t = some_text(n);
    for (int i = 0; i < 2000; i++) {
        mt_data *d = open_bytes(t, n, 16, 2, (uint64_t)i, 1);
        if (i % 3) {
            mt_batch b;
            CHECK_OK(mt_data_next(d, MT_DATA_TRAIN, &b));
        }
        mt_data_close(d);
    }
    free(t);
}
