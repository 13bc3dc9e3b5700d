/*
 * data.c - training data: text as bytes or llm.c token files, split into
 * training and validation, cut into sequences, served as batches in a
 * seeded shuffled order, with the next batch made on a background thread.
 *
 * The tokens are cut into windows of seq_len + 1 (inputs and their next
 * tokens), stride seq_len. The validation split is the last val_fraction of
 * the windows, served in order; the training windows are served in an
 * order shuffled per epoch (Fisher-Yates from a generator seeded by the
 * seed and the epoch), so a position (epoch, window) says exactly what
 * comes next: a resumed run sees the same batches as an unbroken one. The
 * validation stream's position (the next validation window) is saved and
 * restored the same way.
 *
 * The prefetch thread makes the batch after the one just handed out while
 * the caller trains on it; mt_data_next hands it over and starts the next.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "rng.h"

#define LLMC_TOKENS_MAGIC 20240520
#define LLMC_HEADER_INTS 256

struct mt_data {
    mt_data_config cfg;
    uint16_t *tok;        /* all tokens (bytes of text are tokens 0..255) */
    size_t n_tok;
    int vocab;            /* 256 for text; the largest token + 1 for token files */
    size_t windows, n_train, n_val; /* windows of seq_len + 1 */
    uint32_t *order;      /* the training windows of the current epoch, shuffled */
    uint64_t epoch, next; /* the next training window: order[next] of epoch */
    uint64_t val_next;
    /* two training batch buffers, the caller's and the one being made, each
       (batch, seq_len) inputs then (batch, seq_len) targets, with the
       stream position after it; and one for validation */
    int32_t *buf[2], *vbuf;
    uint64_t after_epoch[2], after_next[2];
    int cur;              /* the caller's buffer */
    uint64_t pos_epoch, pos_next; /* after the last batch handed out */
    /* the prefetch thread */
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool thread, stop, want, ready;
    int ready_rows;
};

void mt_data_config_init(mt_data_config *c)
{
    memset(c, 0, sizeof *c);
    c->struct_size = sizeof *c;
    c->format = MT_DATA_AUTO;
    c->val_fraction = 0.1;
    c->seq_len = 64;
    c->batch = 8;
    c->seed = 1;
    c->prefetch = 1;
}

static mt_status bad_tokens(const char *path, const char *what)
{
    return mti_fail(NULL, MT_ERR_FORMAT, "mt_data_open: %s: %s", path, what);
}

/* The shuffled order of an epoch. */
static void shuffle(mt_data *d)
{
    mti_rng r;
    mti_rng_seed(&r, d->cfg.seed * 0x9E3779B97F4A7C15ull + d->epoch);
    for (size_t i = 0; i < d->n_train; i++) d->order[i] = (uint32_t)i;
    for (size_t i = d->n_train; i > 1; i--) {
        size_t j = (size_t)(mti_rng_next(&r) % i);
        uint32_t t = d->order[i - 1];
        d->order[i - 1] = d->order[j];
        d->order[j] = t;
    }
}

/* Window w into row r of a batch buffer: its first seq_len tokens are the
 * inputs, its last seq_len the targets. */
static void put_window(const mt_data *d, int32_t *dst, int r, size_t w)
{
    const size_t T = (size_t)d->cfg.seq_len, BT = (size_t)d->cfg.batch * T;
    const uint16_t *src = d->tok + w * T;
    for (size_t j = 0; j < T; j++) {
        dst[(size_t)r * T + j] = src[j];
        dst[BT + (size_t)r * T + j] = src[j + 1];
    }
}

/* The next training batch into buffer slot. */
static void make_train(mt_data *d, int slot)
{
    for (int r = 0; r < d->cfg.batch; r++) {
        if (d->next == d->n_train) {
            d->epoch++, d->next = 0;
            shuffle(d);
        }
        put_window(d, d->buf[slot], r, d->order[d->next++]);
    }
    d->after_epoch[slot] = d->epoch, d->after_next[slot] = d->next;
}

static void *prefetch_main(void *arg)
{
    mt_data *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->want && !d->stop) pthread_cond_wait(&d->cv, &d->mu);
        if (d->stop) break;
        d->want = false;
        int slot = 1 - d->cur;
        pthread_mutex_unlock(&d->mu);
        make_train(d, slot);
        pthread_mutex_lock(&d->mu);
        d->ready = true;
        pthread_cond_broadcast(&d->cv);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

static mt_status load_tokens(mt_data *d, const unsigned char *p, size_t n, const char *path)
{
    if (n < LLMC_HEADER_INTS * 4)
        return bad_tokens(path, "too short for an llm.c token file (no 1024-byte header)");
    int32_t h[3];
    for (int i = 0; i < 3; i++) h[i] = (int32_t)mti_get_u32(p + 4 * i);
    if (h[0] != LLMC_TOKENS_MAGIC)
        return bad_tokens(path, "not an llm.c token file (magic)");
    if (h[1] != 1)
        return bad_tokens(path, "llm.c token file version is not 1");
    if (h[2] < 0 || (size_t)h[2] != (n - LLMC_HEADER_INTS * 4) / 2 || (n - LLMC_HEADER_INTS * 4) % 2)
        return bad_tokens(path, "truncated or padded: the token count does not match the file size");
    d->n_tok = (size_t)h[2];
    d->tok = malloc((d->n_tok ? d->n_tok : 1) * sizeof *d->tok);
    if (!d->tok) return mti_fail(NULL, MT_ERR_OOM, "mt_data_open: out of host memory");
    int most = 0;
    for (size_t i = 0; i < d->n_tok; i++) {
        const unsigned char *q = p + LLMC_HEADER_INTS * 4 + 2 * i;
        d->tok[i] = (uint16_t)(q[0] | q[1] << 8);
        if (d->tok[i] > most) most = d->tok[i];
    }
    d->vocab = most + 1;
    return MT_OK;
}

mt_status mt_data_open(const mt_data_config *cfg, mt_data **out)
{
    if (!cfg || !out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_data_open: %s is NULL",
                                      cfg ? "out" : "cfg");
    *out = NULL;
    if (cfg->struct_size != sizeof *cfg)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_data_open: cfg->struct_size %u (call mt_data_config_init first)",
                        cfg->struct_size);
    if (!cfg->path == !cfg->bytes)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_data_open: give either cfg->path or cfg->bytes, not %s",
                        cfg->path ? "both" : "neither");
    if (cfg->seq_len < 1 || cfg->seq_len > (1 << 20) || cfg->batch < 1 || cfg->batch > (1 << 20))
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_data_open: seq_len %d and batch %d must be in 1..2^20", cfg->seq_len,
                        cfg->batch);
    if (!(cfg->val_fraction >= 0.0 && cfg->val_fraction < 1.0))
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_data_open: val_fraction %g out of [0, 1)",
                        cfg->val_fraction);
    if ((unsigned)cfg->format > MT_DATA_TOKENS)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_data_open: format %d unknown",
                        (int)cfg->format);
    mt_data *d = calloc(1, sizeof *d);
    if (!d) return mti_fail(NULL, MT_ERR_OOM, "mt_data_open: out of host memory");
    d->cfg = *cfg;
    d->cfg.path = NULL, d->cfg.bytes = NULL;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    unsigned char *file = NULL;
    size_t n = cfg->n_bytes;
    const unsigned char *p = cfg->bytes;
    const char *name = cfg->path ? cfg->path : "(bytes)";
    mt_status s = MT_OK;
    if (cfg->path) {
        s = mti_read_file(NULL, cfg->path, (size_t)1 << 34, &file, &n); /* 16 GiB at most */
        p = file;
    }
    if (!s) {
        bool tokens = cfg->format == MT_DATA_TOKENS ||
                      (cfg->format == MT_DATA_AUTO && n >= 4 &&
                       mti_get_u32(p) == LLMC_TOKENS_MAGIC);
        if (tokens) {
            s = load_tokens(d, p, n, name);
        } else {
            d->n_tok = n;
            d->vocab = 256;
            d->tok = malloc((n ? n : 1) * sizeof *d->tok);
            if (!d->tok) s = mti_fail(NULL, MT_ERR_OOM, "mt_data_open: out of host memory");
            for (size_t i = 0; !s && i < n; i++) d->tok[i] = p[i];
        }
    }
    free(file);
    if (!s) {
        const size_t T = (size_t)cfg->seq_len;
        d->windows = d->n_tok > T ? (d->n_tok - 1) / T : 0;
        d->n_val = (size_t)((double)d->windows * cfg->val_fraction);
        if (cfg->val_fraction > 0 && d->n_val == 0 && d->windows > 1) d->n_val = 1;
        d->n_train = d->windows - d->n_val;
        if (d->n_train < 1 || (cfg->val_fraction > 0 && d->n_val < 1))
            s = mti_fail(NULL, MT_ERR_INVALID_ARG,
                         "mt_data_open: %s: %zu tokens are too few for a training window and a "
                         "validation window of %d + 1 tokens",
                         name, d->n_tok, cfg->seq_len);
        if (!s && d->n_train > UINT32_MAX)
            s = mti_fail(NULL, MT_ERR_UNSUPPORTED, "mt_data_open: %s: more than 2^32 windows", name);
    }
    size_t cells = 2 * (size_t)cfg->batch * (size_t)cfg->seq_len;
    if (!s) {
        d->order = malloc(d->n_train * sizeof *d->order);
        d->buf[0] = malloc(cells * sizeof(int32_t));
        d->buf[1] = malloc(cells * sizeof(int32_t));
        d->vbuf = malloc(cells * sizeof(int32_t));
        if (!d->order || !d->buf[0] || !d->buf[1] || !d->vbuf)
            s = mti_fail(NULL, MT_ERR_OOM, "mt_data_open: out of host memory");
    }
    if (!s) {
        shuffle(d);
        if (cfg->prefetch) {
            /* the first batch is wanted before the thread starts, so it
               cannot miss the request */
            d->cur = 0;
            d->want = true;
            if (pthread_create(&d->th, NULL, prefetch_main, d) == 0) d->thread = true;
            else d->want = false; /* made on demand instead */
        }
    }
    if (s) {
        mt_data_close(d);
        return s;
    }
    *out = d;
    return MT_OK;
}

void mt_data_close(mt_data *d)
{
    if (!d) return;
    if (d->thread) {
        pthread_mutex_lock(&d->mu);
        d->stop = true;
        pthread_cond_broadcast(&d->cv);
        pthread_mutex_unlock(&d->mu);
        pthread_join(d->th, NULL);
    }
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    free(d->tok);
    free(d->order);
    free(d->buf[0]);
    free(d->buf[1]);
    free(d->vbuf);
    free(d);
}

static void view(const mt_data *d, int32_t *buf, mt_batch *b)
{
    const size_t BT = (size_t)d->cfg.batch * (size_t)d->cfg.seq_len;
    *b = (mt_batch){.n = d->cfg.batch, .tokens = buf, .targets = buf + BT,
                    .seq_len = d->cfg.seq_len};
}

/* Waits for the prefetched batch (the thread is idle after). */
static void wait_ready(mt_data *d)
{
    pthread_mutex_lock(&d->mu);
    while (!d->ready) pthread_cond_wait(&d->cv, &d->mu);
    pthread_mutex_unlock(&d->mu);
}

mt_status mt_data_next(mt_data *d, mt_data_split split, mt_batch *out)
{
    if (!d || !out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_data_next: %s is NULL",
                                    d ? "out" : "d");
    if (split == MT_DATA_VAL) {
        if (!d->n_val) return mti_fail(NULL, MT_ERR_STATE, "mt_data_next: no validation split");
        for (int r = 0; r < d->cfg.batch; r++) {
            put_window(d, d->vbuf, r, d->n_train + d->val_next);
            d->val_next = (d->val_next + 1) % d->n_val;
        }
        view(d, d->vbuf, out);
        return MT_OK;
    }
    if (split != MT_DATA_TRAIN)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_data_next: split %d unknown", (int)split);
    if (!d->thread) {
        make_train(d, 0);
        d->cur = 0;
    } else {
        wait_ready(d);
        pthread_mutex_lock(&d->mu);
        d->cur = 1 - d->cur; /* the made one is the caller's now */
        d->ready = false;
        d->want = true; /* make the next into the other */
        pthread_cond_broadcast(&d->cv);
        pthread_mutex_unlock(&d->mu);
    }
    d->pos_epoch = d->after_epoch[d->cur], d->pos_next = d->after_next[d->cur];
    view(d, d->buf[d->cur], out);
    return MT_OK;
}

mt_status mt_data_get_info(const mt_data *d, mt_data_info *out)
{
    if (!d || !out) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_data_get_info: %s is NULL",
                                    d ? "out" : "d");
    *out = (mt_data_info){.vocab = d->vocab, .tokens = d->n_tok,
                            .train_windows = d->n_train, .val_windows = d->n_val,
                            .epoch = d->pos_epoch, .position = d->pos_next,
                            .val_position = d->val_next};
    return MT_OK;
}

mt_status mt_data_seek(mt_data *d, uint64_t epoch, uint64_t position)
{
    if (!d) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_data_seek: d is NULL");
    if (position > d->n_train)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_data_seek: position %llu past the %zu training windows",
                        (unsigned long long)position, d->n_train);
    if (d->thread) wait_ready(d); /* the thread is idle */
    d->epoch = epoch, d->next = position;
    shuffle(d);
    d->pos_epoch = epoch, d->pos_next = position;
    if (d->thread) {
        pthread_mutex_lock(&d->mu);
        d->ready = false;
        d->want = true; /* remake the next batch from here */
        pthread_cond_broadcast(&d->cv);
        pthread_mutex_unlock(&d->mu);
    }
    return MT_OK;
}

mt_status mt_data_seek_val(mt_data *d, uint64_t position)
{
    if (!d) return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_data_seek_val: d is NULL");
    if (position && position >= d->n_val)
        return mti_fail(NULL, MT_ERR_INVALID_ARG,
                        "mt_data_seek_val: position %llu past the %zu validation windows",
                        (unsigned long long)position, d->n_val);
    d->val_next = position; /* the prefetch thread makes training batches only */
    return MT_OK;
}
