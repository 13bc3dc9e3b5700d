/*
 * trace_export.c - allocation traces as things people look at: Chrome
 * trace JSON (Perfetto, chrome://tracing) and an SVG plot of memory by
 * class over time.
 *
 * Both walk the trace once, keeping the live blocks (by instance and id) so
 * that frees and resets know what they free: a reset of scope S frees the
 * instance's live blocks whose lifetime is >= S, as the allocators do.
 * After each event the live bytes of every class are known; that timeline
 * is what both files draw.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "memory/livemap.h"

/* ---- a growable text buffer ---- */

typedef struct tbuf {
    char *p;
    size_t len, cap;
    bool oom;
} tbuf;

static void MTI_PRINTF(2, 3) tb_printf(tbuf *b, const char *fmt, ...)
{
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->len;
        int n = vsnprintf(b->p ? b->p + b->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if ((size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 1 << 16;
        while (cap - b->len <= (size_t)n) cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q, b->cap = cap;
    }
}

/* ---- live blocks and the timeline ---- */

/* The live blocks (the trace map of livemap.h) and each class's live bytes. */
typedef struct walker {
    mti_live_map map;
    uint64_t live[MT_MEM_COUNT];
    uint64_t place_live[MT_PLACE_COUNT][MT_MEM_COUNT]; /* other places' bytes (not in live) */
    bool oom;
} walker;

/* What a block's end calls: the Chrome writer closes its slice. */
typedef void (*end_fn)(void *user, const mti_live_rec *b, uint64_t t_ns);

static void end_block(walker *w, size_t r, end_fn on_end, void *user, uint64_t t_ns)
{
    const mti_live_rec *b = &w->map.recs[r];
    if (on_end) on_end(user, b, t_ns);
    w->live[b->blk.mem_class] -= b->blk.bytes;
    mti_live_remove(&w->map, r);
}

/* Applies one event (of a validated trace); blocks that end go to on_end
 * (may be NULL). Returns the block an ALLOC made (for its start), or NULL. */
static const mti_live_rec *apply(walker *w, const mt_trace_event *e, end_fn on_end, void *user)
{
    if (e->place) { /* held off the device: counted apart */
        uint64_t *v = &w->place_live[e->place][e->mem_class];
        *v = e->op == MT_TRACE_ALLOC ? *v + e->bytes : *v > e->bytes ? *v - e->bytes : 0;
        return NULL;
    }
    if (e->op == MT_TRACE_ALLOC) {
        mti_live_rec r = {.key = mti_live_key(e), .lifetime = e->lifetime, .instance = e->instance,
                          .blk = {.bytes = e->bytes, .mem_class = (mt_mem_class)e->mem_class}};
        if (!mti_live_insert(&w->map, &r)) {
            w->oom = true;
            return NULL;
        }
        w->live[e->mem_class] += e->bytes;
        return &w->map.recs[w->map.n - 1];
    }
    if (e->op == MT_TRACE_FREE) {
        size_t r = mti_live_find(&w->map, mti_live_key(e));
        if (r != SIZE_MAX) end_block(w, r, on_end, user, e->t_ns);
    } else if (e->op == MT_TRACE_RESET) {
        for (size_t r = w->map.n; r-- > 0;)
            if (w->map.recs[r].instance == e->instance && w->map.recs[r].lifetime >= e->scope)
                end_block(w, r, on_end, user, e->t_ns);
    }
    return NULL;
}

static uint64_t total_of(const uint64_t *live)
{
    uint64_t s = 0;
    for (int c = 0; c < MT_MEM_COUNT; c++) s += live[c];
    return s;
}

static mt_status write_out(mt_context *ctx, const char *path, tbuf *b, const char *what)
{
    if (b->oom) {
        free(b->p);
        return mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", what);
    }
    mti_afile f;
    mt_status s = mti_afile_open(ctx, path, &f);
    if (!s) s = mti_afile_write(ctx, &f, b->p, b->len);
    if (!s) s = mti_afile_commit(ctx, &f);
    else mti_afile_abort(&f);
    free(b->p);
    return s;
}

static size_t events_of(const mt_trace *t, const mt_trace_event **ev, uint64_t *dropped)
{
    size_t n = 0;
    mt_trace_info(t, &n, dropped);
    *ev = mt_trace_get_events(t);
    return n;
}

/* ---- Chrome trace JSON ---- */

static const char *life_name(int l)
{
    return l == MT_LIFE_PERSISTENT ? "persistent" : l == MT_LIFE_STEP ? "step" : "phase";
}

static void chrome_end(void *user, const mti_live_rec *b, uint64_t t_ns)
{
    tbuf *o = user;
    tb_printf(o,
              ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"e\",\"id\":\"0x%" PRIx64
              "\",\"pid\":1,\"tid\":%d,\"ts\":%.3f}",
              mt_mem_class_name(b->blk.mem_class), mt_mem_class_name(b->blk.mem_class), b->key,
              2 + (int)b->blk.mem_class,
              (double)t_ns / 1e3);
}

static void chrome_counter(tbuf *o, const char *name, uint64_t t_ns, const uint64_t *live)
{
    tb_printf(o, ",\n{\"name\":\"%s\",\"ph\":\"C\",\"pid\":1,\"ts\":%.3f,\"args\":{", name,
              (double)t_ns / 1e3);
    for (int c = 0; c < MT_MEM_COUNT; c++)
        tb_printf(o, "%s\"%s\":%" PRIu64, c ? "," : "", mt_mem_class_name((mt_mem_class)c),
                  live[c]);
    tb_printf(o, "}}");
}

mt_status mt_trace_export_chrome(mt_context *ctx, const mt_trace *t, const mt_estimate_report *est,
                                 const char *path)
{
    if (!t || !path)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trace_export_chrome: %s is NULL",
                        !t ? "the trace" : "path");
    const mt_trace_event *ev;
    uint64_t dropped;
    size_t n = events_of(t, &ev, &dropped);
    tbuf o = {0};
    walker w = {0};
    tb_printf(&o, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"generator\":\"memtrain %s\","
                  "\"events\":%zu,\"dropped\":%" PRIu64 "},\n\"traceEvents\":[\n",
              mt_version(), n, dropped);
    tb_printf(&o, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,"
                  "\"args\":{\"name\":\"memtrain memory\"}}");
    for (int c = 0; c < MT_MEM_COUNT; c++)
        tb_printf(&o, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,"
                      "\"args\":{\"name\":\"%s blocks\"}}",
                  2 + c, mt_mem_class_name((mt_mem_class)c));
    uint64_t zero[MT_MEM_COUNT] = {0}, last_ns = 0;
    chrome_counter(&o, "live bytes", n ? ev[0].t_ns : 0, zero);
    for (size_t i = 0; i < n && !w.oom; i++) {
        const mt_trace_event *e = &ev[i];
        const mti_live_rec *b = apply(&w, e, chrome_end, &o);
        last_ns = e->t_ns;
        if (b)
            tb_printf(&o,
                      ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"b\",\"id\":\"0x%" PRIx64
                      "\",\"pid\":1,\"tid\":%d,\"ts\":%.3f,\"args\":{\"bytes\":%" PRIu64
                      ",\"tag\":\"0x%" PRIx64 "\",\"lifetime\":\"%s\",\"instance\":%d}}",
                      mt_mem_class_name((mt_mem_class)e->mem_class),
                      mt_mem_class_name((mt_mem_class)e->mem_class), b->key, 2 + e->mem_class,
                      (double)e->t_ns / 1e3, e->bytes, e->tag, life_name(e->lifetime),
                      e->instance);
        else if (e->op == MT_TRACE_RESET)
            tb_printf(&o,
                      ",\n{\"name\":\"reset %s\",\"ph\":\"i\",\"s\":\"p\",\"pid\":1,\"tid\":1,"
                      "\"ts\":%.3f,\"args\":{\"instance\":%d}}",
                      e->scope == MT_SCOPE_ALL ? "all" : e->scope == MT_SCOPE_STEP ? "step" : "phase",
                      (double)e->t_ns / 1e3, e->instance);
        else if (e->op == MT_TRACE_FAIL)
            tb_printf(&o,
                      ",\n{\"name\":\"failed %s %" PRIu64 " bytes\",\"ph\":\"i\",\"s\":\"p\","
                      "\"pid\":1,\"tid\":1,\"ts\":%.3f}",
                      mt_mem_class_name((mt_mem_class)e->mem_class), e->bytes,
                      (double)e->t_ns / 1e3);
        if (e->place) {
            char name[32];
            snprintf(name, sizeof name, "%s bytes", mt_place_name((mt_place)e->place));
            chrome_counter(&o, name, e->t_ns, w.place_live[e->place]);
        } else if (e->op == MT_TRACE_ALLOC || e->op == MT_TRACE_FREE || e->op == MT_TRACE_RESET) {
            chrome_counter(&o, "live bytes", e->t_ns, w.live);
        }
    }
    if (est) { /* the estimate as a flat counter over the whole trace */
        for (int k = 0; k < 2; k++)
            tb_printf(&o,
                      ",\n{\"name\":\"estimate\",\"ph\":\"C\",\"pid\":1,\"ts\":%.3f,"
                      "\"args\":{\"peak\":%" PRIu64 ",\"peak reserved\":%" PRIu64 "}}",
                      (double)(k ? last_ns : (n ? ev[0].t_ns : 0)) / 1e3, est->peak,
                      est->peak_reserved);
    }
    tb_printf(&o, "\n]}\n");
    mti_live_free(&w.map);
    if (w.oom) o.oom = true;
    return write_out(ctx, path, &o, "mt_trace_export_chrome");
}

/* ---- SVG ---- */

/* One shade per class, in mt_mem_class order. */
static const char *const class_color[] = {"#4e79a7", "#a0cbe8", "#f28e2b", "#e15759",
                                          "#59a14f", "#b07aa1", "#9c755f", "#edc948"};
_Static_assert(sizeof class_color / sizeof *class_color == MT_MEM_COUNT, "a shade per class");

#define SVG_W 960
#define SVG_H 480
#define PLOT_X0 80
#define PLOT_X1 (SVG_W - 180)
#define PLOT_Y0 40
#define PLOT_Y1 (SVG_H - 50)

static double nice_step(double span)
{
    double raw = span / 5, p = 1;
    while (p * 10 <= raw) p *= 10;
    while (p > raw) p /= 10;
    return raw / p >= 5 ? 5 * p : raw / p >= 2 ? 2 * p : p;
}

mt_status mt_trace_export_svg(mt_context *ctx, const mt_trace *t, const mt_estimate_report *est,
                              const char *path)
{
    if (!t || !path)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trace_export_svg: %s is NULL",
                        !t ? "the trace" : "path");
    const mt_trace_event *ev;
    size_t n = events_of(t, &ev, NULL);
    /* per pixel column, the moment with the most live bytes (peaks survive
       the downsampling), and the overall peak */
    enum { COLS = PLOT_X1 - PLOT_X0 };
    typedef struct col {
        bool set;
        uint64_t live[MT_MEM_COUNT], total;
    } col;
    col *cols = calloc(COLS, sizeof *cols);
    walker w = {0};
    if (!cols) return mti_fail(ctx, MT_ERR_OOM, "mt_trace_export_svg: out of host memory");
    uint64_t t0 = n ? ev[0].t_ns : 0, t1 = n ? ev[n - 1].t_ns : 1, peak = 0, peak_ns = t0;
    uint64_t peak_live[MT_MEM_COUNT] = {0};
    if (t1 <= t0) t1 = t0 + 1;
    for (size_t i = 0; i < n && !w.oom; i++) {
        apply(&w, &ev[i], NULL, NULL);
        uint64_t tot = total_of(w.live);
        int x = (int)((double)(ev[i].t_ns - t0) / (double)(t1 - t0) * (COLS - 1));
        if (!cols[x].set || tot > cols[x].total) {
            cols[x].set = true;
            cols[x].total = tot;
            memcpy(cols[x].live, w.live, sizeof w.live);
        }
        if (tot > peak) {
            peak = tot, peak_ns = ev[i].t_ns;
            memcpy(peak_live, w.live, sizeof w.live);
        }
    }
    mti_live_free(&w.map);
    if (w.oom) {
        free(cols);
        return mti_fail(ctx, MT_ERR_OOM, "mt_trace_export_svg: out of host memory");
    }
    /* a column with no event holds what the one before it held */
    for (int x = 1; x < COLS; x++)
        if (!cols[x].set) cols[x] = cols[x - 1];

    double ymax = (double)peak;
    if (est && (double)est->peak > ymax) ymax = (double)est->peak;
    ymax = ymax > 0 ? ymax * 1.1 : 1;
    const double MiB = 1048576.0, span_ms = (double)(t1 - t0) / 1e6;
    double ystep = nice_step(ymax / MiB), xstep = nice_step(span_ms > 0 ? span_ms : 1);
#define YPX(b) (PLOT_Y1 - (double)(b) / ymax * (PLOT_Y1 - PLOT_Y0))
    tbuf o = {0};
    tb_printf(&o,
              "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
              "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
              "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
              "<title>memtrain: live bytes by memory class</title>\n"
              "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
              SVG_W, SVG_H, SVG_W, SVG_H);
    tb_printf(&o, "<text x=\"%d\" y=\"24\" font-size=\"15\">Live memory by class (%zu events, "
                  "peak %.2f MiB)</text>\n",
              PLOT_X0, n, (double)peak / MiB);
    /* grid and axes */
    for (double v = 0; v <= ymax / MiB + 1e-9; v += ystep)
        tb_printf(&o,
                  "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g MiB</text>\n",
                  PLOT_X0, PLOT_X1, YPX(v * MiB), YPX(v * MiB), PLOT_X0 - 6, YPX(v * MiB) + 4, v);
    for (double v = 0; v <= span_ms + 1e-9; v += xstep) {
        double x = PLOT_X0 + (span_ms > 0 ? v / span_ms : 0) * (COLS - 1);
        tb_printf(&o,
                  "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\" stroke=\"#999\"/>"
                  "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g</text>\n",
                  x, x, PLOT_Y1, PLOT_Y1 + 5, x, PLOT_Y1 + 18, v);
    }
    tb_printf(&o, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">time (ms)</text>\n",
              (PLOT_X0 + PLOT_X1) / 2, SVG_H - 12);
    /* stacked areas, bottom class first */
    for (int c = 0; c < MT_MEM_COUNT; c++) {
        bool any = false;
        for (int x = 0; x < COLS && !any; x++) any = cols[x].live[c] != 0;
        if (!any) continue;
        tb_printf(&o, "<polygon fill=\"%s\" stroke=\"none\" points=\"", class_color[c]);
        for (int x = 0; x < COLS; x++) { /* the top edge, left to right */
            uint64_t top = 0;
            for (int k = 0; k <= c; k++) top += cols[x].live[k];
            tb_printf(&o, "%d,%.1f ", PLOT_X0 + x, YPX(top));
        }
        for (int x = COLS - 1; x >= 0; x--) { /* the bottom edge, back */
            uint64_t bot = 0;
            for (int k = 0; k < c; k++) bot += cols[x].live[k];
            tb_printf(&o, "%d,%.1f ", PLOT_X0 + x, YPX(bot));
        }
        tb_printf(&o, "\"><title>%s</title></polygon>\n", mt_mem_class_name((mt_mem_class)c));
    }
    tb_printf(&o, "<line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke=\"black\"/>"
                  "<line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke=\"black\"/>\n",
              PLOT_X0, PLOT_X1, PLOT_Y1, PLOT_Y1, PLOT_X0, PLOT_X0, PLOT_Y0, PLOT_Y1);
    /* the peak */
    double px = PLOT_X0 + (double)(peak_ns - t0) / (double)(t1 - t0) * (COLS - 1);
    tb_printf(&o,
              "<g id=\"peak\"><line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%.1f\" stroke=\"black\" "
              "stroke-dasharray=\"4 3\"/><circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"black\"/>"
              "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">peak %.2f MiB</text></g>\n",
              px, px, PLOT_Y1, YPX(peak), px, YPX(peak), px, YPX(peak) - 8, (double)peak / MiB);
    /* the estimate */
    if (est)
        tb_printf(&o,
                  "<g id=\"estimate\"><line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" "
                  "stroke=\"#d62728\" stroke-width=\"1.5\" stroke-dasharray=\"8 4\"/>"
                  "<text x=\"%d\" y=\"%.1f\" fill=\"#d62728\" text-anchor=\"end\">estimate "
                  "%.2f MiB</text></g>\n",
                  PLOT_X0, PLOT_X1, YPX(est->peak), YPX(est->peak), PLOT_X1, YPX(est->peak) - 5,
                  (double)est->peak / MiB);
    /* legend: each class with its bytes at the peak */
    int ly = PLOT_Y0;
    for (int c = MT_MEM_COUNT - 1; c >= 0; c--) {
        tb_printf(&o,
                  "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                  "<text x=\"%d\" y=\"%d\">%s %.2f MiB</text>\n",
                  PLOT_X1 + 16, ly, class_color[c], PLOT_X1 + 34, ly + 11,
                  mt_mem_class_name((mt_mem_class)c), (double)peak_live[c] / MiB);
        ly += 20;
    }
    tb_printf(&o, "<text x=\"%d\" y=\"%d\" fill=\"#555\">(at the peak)</text>\n", PLOT_X1 + 16,
              ly + 11);
    tb_printf(&o, "</svg>\n");
#undef YPX
    free(cols);
    return write_out(ctx, path, &o, "mt_trace_export_svg");
}

/* ---- summary ---- */

mt_status mt_trace_summarize(mt_context *ctx, const mt_trace *t, mt_trace_summary *out)
{
    if (!t || !out)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "mt_trace_summarize: %s is NULL",
                        !t ? "the trace" : "out");
    memset(out, 0, sizeof *out);
    const mt_trace_event *ev;
    size_t n = events_of(t, &ev, &out->dropped);
    walker w = {0};
    for (size_t i = 0; i < n && !w.oom; i++) {
        const mt_trace_event *e = &ev[i];
        apply(&w, e, NULL, NULL);
        if (e->place) continue; /* the summary is of the device */
        switch (e->op) {
        case MT_TRACE_ALLOC: out->allocs++; break;
        case MT_TRACE_FREE: out->frees++; break;
        case MT_TRACE_RESET: out->resets++; break;
        case MT_TRACE_FAIL: out->failed++; break;
        default: break;
        }
        uint64_t tot = total_of(w.live);
        for (int c = 0; c < MT_MEM_COUNT; c++)
            if (w.live[c] > out->class_peak[c]) out->class_peak[c] = w.live[c];
        if (tot > out->peak) {
            out->peak = tot;
            out->peak_ns = e->t_ns - ev[0].t_ns;
            memcpy(out->at_peak, w.live, sizeof w.live);
        }
    }
    mti_live_free(&w.map);
    if (w.oom) return mti_fail(ctx, MT_ERR_OOM, "mt_trace_summarize: out of host memory");
    out->events = n;
    out->span_ns = n ? ev[n - 1].t_ns - ev[0].t_ns : 0;
    return MT_OK;
}
