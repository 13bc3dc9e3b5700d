/*
 * agree.c - the checks that the ranks of a run agree: each caller lists
 * the settings every rank must give alike (mti_set_*), and one all-gather
 * compares their values; ranks that disagree all fail, with a message that
 * names the first setting that differs and each rank's value.
 *
 * The values are 8 bytes each (numbers bit for bit, text and tables as a
 * hash), so the exchange is one small fixed record per rank. A message
 * shows a number or a hash from the values gathered; only when a setting
 * shown as text (a name, patterns, a path) differs does a second
 * all-gather bring each rank's text. Every rank sees the same gathered
 * records, so every rank makes the same calls and finds the same setting.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"

/* The next setting of the list, or NULL when it is full: then the value
 * is hashed into the last one's, so a difference is still found. */
static mti_setting *next(mti_settings *l, const char *name, uint64_t v)
{
    if (l->n == MTI_MAX_SETTINGS) {
        mti_setting *last = &l->s[MTI_MAX_SETTINGS - 1];
        last->v = mti_hash(last->v, &v, sizeof v);
        last->name = "the settings past the list's end";
        last->kind = 'h';
        mti_hash_shown(last->v, last->shown);
        return NULL;
    }
    mti_setting *s = &l->s[l->n++];
    *s = (mti_setting){.name = name, .v = v, .kind = 's'};
    return s;
}

/* A value of kind 'i', 'f', 'd' or 'h' as text: what any rank can make
 * of another's value, with no text sent. */
static void render(char kind, uint64_t v, char shown[MTI_SHOWN])
{
    double d;
    memcpy(&d, &v, sizeof d);
    if (kind == 'h') {
        snprintf(shown, MTI_SHOWN, "#%08llx", (unsigned long long)(v >> 32));
    } else if (kind == 'f') { /* a float's: the shorter of %g and %.9g that reads back */
        snprintf(shown, MTI_SHOWN, "%g", d);
        if (strtof(shown, NULL) != (float)d) snprintf(shown, MTI_SHOWN, "%.9g", d);
    } else if (kind == 'd') { /* a double's: %g or %.17g */
        snprintf(shown, MTI_SHOWN, "%g", d);
        if (strtod(shown, NULL) != d) snprintf(shown, MTI_SHOWN, "%.17g", d);
    } else {
        snprintf(shown, MTI_SHOWN, "%lld", (long long)v);
    }
}

static void add(mti_settings *l, const char *name, char kind, uint64_t v)
{
    mti_setting *s = next(l, name, v);
    if (s) s->kind = kind, render(kind, v, s->shown);
}

void mti_set_int(mti_settings *l, const char *name, int64_t v) { add(l, name, 'i', (uint64_t)v); }

/* A double's bits (a float's made a double: exact, and distinct for
 * distinct floats). */
static uint64_t bits_of(double d)
{
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    return bits;
}

void mti_set_float(mti_settings *l, const char *name, float v) { add(l, name, 'f', bits_of(v)); }

void mti_set_double(mti_settings *l, const char *name, double v) { add(l, name, 'd', bits_of(v)); }

void mti_hash_shown(uint64_t h, char shown[MTI_SHOWN]) { render('h', h, shown); }

void mti_set_hash(mti_settings *l, const char *name, uint64_t h) { add(l, name, 'h', h); }

void mti_set_named(mti_settings *l, const char *name, int64_t v, const char *text)
{
    mti_setting *s = next(l, name, (uint64_t)v);
    if (s && text) snprintf(s->shown, sizeof s->shown, "%s", text);
    else if (s) snprintf(s->shown, sizeof s->shown, "%lld", (long long)v);
}

void mti_set_texts(mti_settings *l, const char *name, const char *const *text, int n)
{
    uint64_t h = mti_hash(MTI_HASH_START, &n, sizeof n);
    for (int i = 0; text && i < n; i++)
        h = text[i] ? mti_hash(h, text[i], strlen(text[i]) + 1) : mti_hash(h, "", 0);
    mti_setting *s = next(l, name, h);
    if (!s) return;
    if (!text || n <= 0) {
        snprintf(s->shown, sizeof s->shown, "(none)");
        return;
    }
    /* the texts joined by commas, cut short with "..." */
    char *out = s->shown;
    const size_t cap = sizeof s->shown;
    size_t at = 0;
    for (int i = 0; i < n && at < cap; i++)
        at += (size_t)snprintf(out + at, cap - at, "%s%s", i ? "," : "", text[i] ? text[i] : "");
    if (at >= cap) memcpy(out + cap - 4, "...", 4);
}

void mti_set_text(mti_settings *l, const char *name, const char *text)
{
    mti_set_texts(l, name, &text, text ? 1 : 0);
}

void mti_set_hint(mti_settings *l, const char *hint)
{
    if (l->n) l->s[l->n - 1].hint = hint;
}

void mti_ranks_values(char *buf, size_t cap, int n, const unsigned char *vals, size_t vstride,
                      size_t vlen, const char *shown, size_t sstride)
{
    enum { MAX_LISTED = 8 };
    size_t at = (size_t)snprintf(buf, cap, "rank 0 %s", shown);
    int listed = 0, more = 0;
    for (int r = 1; r < n; r++) {
        if (!memcmp(vals + (size_t)r * vstride, vals, vlen)) continue;
        if (listed == MAX_LISTED) {
            more++;
            continue;
        }
        listed++;
        if (at < cap)
            at += (size_t)snprintf(buf + at, cap - at, ", rank %d %s", r,
                                   shown + (size_t)r * sstride);
    }
    if (more && at < cap)
        snprintf(buf + at, cap - at, ", and %d more rank%s", more, more > 1 ? "s" : "");
}

mt_status mti_comm_agree(mt_context *ctx, const char *fn, const char *what, const mti_settings *l)
{
    mt_comm *c = ctx->cfg.comm;
    if (!c || c->size == 1) return MT_OK;
    /* a record of a fixed size on every rank, whatever its list's length (a
       setting read only under another, as LoRA's under lora.rank, makes the
       lists of ranks that disagree differ in length): the values, zeros
       past the list, and its length last. A list puts each setting after
       the one it depends on, so the first value that differs lies inside
       every rank's list, named alike on each */
    const int n = c->size, k = MTI_MAX_SETTINGS + 1, count = MTI_MAX_SETTINGS;
    unsigned char *mine = calloc((size_t)k, 8), *all = malloc((size_t)n * k * 8);
    char *shown = malloc((size_t)n * MTI_SHOWN);
    if (!mine || !all || !shown) {
        free(mine), free(all), free(shown);
        return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    }
    for (int j = 0; j < l->n; j++) mti_put_u64(mine + (size_t)j * 8, l->s[j].v);
    mti_put_u64(mine + (size_t)count * 8, (uint64_t)l->n);
    /* a byte gather on the host, whatever the table: a device table's
     * record goes through its record buffer (mti_comm_host_gather) */
    char why[128];
    snprintf(why, sizeof why, "%s: checking that the ranks agree on %s", fn, what);
    mt_status s = mti_comm_host_gather(ctx, why, mine, all, (size_t)k * 8);
    int first = -1; /* the first setting that differs: the same on every rank */
    for (int j = 0; j < k && !s && first < 0; j++)
        for (int r = 1; r < n && first < 0; r++)
            if (memcmp(all + ((size_t)r * k + j) * 8, all + (size_t)j * 8, 8)) first = j;
    /* the setting: this rank's entry (each rank's list holds it, named
       alike, as each setting follows the one it depends on), else (a
       list that ends before it: never, with lists so made) the lengths */
    const mti_setting lengths = {.name = "the number of settings", .kind = 'i'};
    const mti_setting *d = first < 0 ? NULL : first < l->n ? &l->s[first] : &lengths;
    if (d == &lengths) first = count;
    /* the ranks' values as text: made here from the values of a number or a
       hash, else gathered (the world size, which may differ when a rank's
       communicator is wrong, is a number: nothing more is gathered then) */
    if (!s && d && d->kind != 's')
        for (int r = 0; r < n; r++)
            render(d->kind, mti_get_u64(all + ((size_t)r * k + first) * 8),
                   shown + (size_t)r * MTI_SHOWN);
    if (!s && d && d->kind == 's') {
        snprintf(why, sizeof why, "%s: gathering the ranks' %s", fn, d->name);
        s = mti_comm_host_gather(ctx, why, d->shown, shown, MTI_SHOWN);
    }
    if (!s && d) {
        char list[MTI_ERR_LEN / 2];
        for (int r = 0; r < n; r++) shown[(size_t)r * MTI_SHOWN + MTI_SHOWN - 1] = 0;
        mti_ranks_values(list, sizeof list, n, all + (size_t)first * 8, (size_t)k * 8, 8, shown,
                         MTI_SHOWN);
        s = mti_fail(ctx, MT_ERR_COMM, "%s: the ranks disagree on %s: %s (%s)", fn, d->name, list,
                     d->hint ? d->hint : "every rank must make the same call");
    }
    free(mine), free(all), free(shown);
    return s;
}

mt_status mti_comm_attach(mt_context *ctx)
{
    const char *fn = "mt_context_create";
    mt_comm *c = ctx->cfg.comm;
    if ((c->vt.caps & MT_COMM_CAP_DEVICE) && ctx->dev->kind != MT_DEVICE_CUDA)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->comm is a device communicator (%s) and the context is on the "
                        "CPU: a CPU context takes a host communicator (MPI)",
                        fn, mt_comm_name(c));
    static const char *const kinds[] = {"auto", "cpu", "cuda"};
    enum { N_KINDS = sizeof kinds / sizeof *kinds };
    _Static_assert(N_KINDS == MT_DEVICE_CUDA + 1, "a name per mt_device_kind");
    const unsigned kind = (unsigned)ctx->dev->kind;
    mti_settings l = {.n = 0};
    mti_set_int(&l, "the world size", c->size); /* (first: see mti_comm_agree) */
    mti_set_named(&l, "the device kind", kind, kind < N_KINDS ? kinds[kind] : NULL);
    return mti_comm_agree(ctx, fn, "the context", &l);
}
