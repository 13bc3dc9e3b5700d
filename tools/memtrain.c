/*
 * memtrain.c - the memtrain command.
 *
 *   memtrain train  [options]     train a model on built-in data, print progress and memory
 *   memtrain replay TRACE [opts]  replay an allocation trace through an allocator
 *   memtrain --version | --help
 *
 * Exit codes: 0 success, 1 a library call failed, 2 bad command line.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "memtrain.h"

#define EXIT_FAIL 1
#define EXIT_USAGE 2

static const char *prog = "memtrain";

static void usage_main(FILE *f)
{
    fprintf(f,
            "usage: memtrain <command> [options]\n"
            "\n"
            "commands:\n"
            "  train     train a model on built-in data (no download) and report memory\n"
            "  replay    replay an allocation trace through an allocator and print its stats\n"
            "\n"
            "  memtrain --version     print the version\n"
            "  memtrain <command> --help\n");
}

static void usage_train(FILE *f)
{
    fprintf(f,
            "usage: memtrain train [options]\n"
            "  --model mlp            the model (mlp)\n"
            "  --hidden N,N,...       hidden layer sizes (64,64)\n"
            "  --activation relu|gelu (relu)\n"
            "  --steps N              training steps (300)\n"
            "  --batch N              examples per step (64)\n"
            "  --lr X                 learning rate (0.1)\n"
            "  --momentum X           SGD momentum (0.9)\n"
            "  --weight-decay X       L2 weight decay (0)\n"
            "  --precision P          fp32, fp16 (fp32 masters, dynamic loss scaling) or bf16 (fp32)\n"
            "  --seed N               data and init seed (1)\n"
            "  --every N              print the loss every N steps (25)\n"
            "  --device cpu|cuda|auto (cpu)\n"
            "  --threads N            CPU threads, 0 = all (0)\n"
            "  --allocator NAME       caching|arena|pool|checkpoint for every class (caching)\n"
            "  --trace FILE           record every allocation to FILE (replay it later)\n"
            "  --chrome FILE          the run's memory as Chrome trace JSON (Perfetto)\n"
            "  --svg FILE             the run's memory by class as an SVG plot, peak and estimate\n"
            "  --report               print the memory report at the end\n"
            "data: three interleaved spirals in the plane, 3 classes, made from the seed.\n");
}

static void usage_replay(FILE *f)
{
    fprintf(f,
            "usage: memtrain replay TRACE [options]\n"
            "  --allocator NAME       caching|arena|pool|checkpoint (caching); 'all' for each\n"
            "  --device cpu|cuda|auto (cpu)\n");
}

static int bad_usage(const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", prog);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(run '%s --help')\n", prog);
    return EXIT_USAGE;
}

static int parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

static int parse_device(const char *s, mt_device_kind *out)
{
    if (!strcmp(s, "cpu")) *out = MT_DEVICE_CPU;
    else if (!strcmp(s, "cuda")) *out = MT_DEVICE_CUDA;
    else if (!strcmp(s, "auto")) *out = MT_DEVICE_AUTO;
    else return -1;
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void print_report(mt_context *ctx)
{
    size_t need = 0;
    mt_memory_report(ctx, NULL, 0, &need);
    char *buf = malloc(need + 1);
    if (!buf) return;
    mt_memory_report(ctx, buf, need + 1, NULL);
    fputs(buf, stdout);
    free(buf);
}

/* ---- train ---- */

typedef struct train_opts {
    int hidden[MT_MLP_MAX_LAYERS];
    int n_hidden;
    mt_activation act;
    long steps, batch, seed, every, threads;
    float lr, momentum, wd;
    mt_device_kind device;
    mt_precision precision;
    const char *allocator, *trace, *chrome, *svg;
    int report;
} train_opts;

/* Three spirals: class k's points lie on the arm r -> angle k*2pi/3 + 4r,
 * with noise. Features are the two coordinates. */
static void spirals(uint64_t *state, float *x, int32_t *y, int n)
{
    for (int i = 0; i < n; i++) {
        uint64_t s = (*state += 0x9E3779B97F4A7C15ull);
        s = (s ^ (s >> 30)) * 0xBF58476D1CE4E5B9ull;
        s = (s ^ (s >> 27)) * 0x94D049BB133111EBull;
        s ^= s >> 31;
        int k = (int)(s % 3);
        float r = (float)((s >> 8) & 0xFFFF) / 65536.0f;
        float noise = ((float)((s >> 24) & 0xFFFF) / 65536.0f - 0.5f) * 0.3f;
        float a = (float)k * 2.0943951f + 4.0f * r + noise;
        x[2 * i] = r * cosf(a);
        x[2 * i + 1] = r * sinf(a);
        y[i] = k;
    }
}

static int parse_hidden(const char *s, train_opts *o)
{
    o->n_hidden = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 1 || v > (1 << 20) || o->n_hidden >= MT_MLP_MAX_LAYERS - 1)
            return -1;
        o->hidden[o->n_hidden++] = (int)v;
        if (*end == ',') end++;
        else if (*end) return -1;
        p = end;
    }
    return o->n_hidden ? 0 : -1;
}

static int cmd_train(int argc, char **argv)
{
    train_opts o = {.hidden = {64, 64}, .n_hidden = 2, .act = MT_ACT_RELU, .steps = 300,
                    .batch = 64, .seed = 1, .every = 25, .lr = 0.1f, .momentum = 0.9f,
                    .device = MT_DEVICE_CPU, .allocator = "caching"};
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes = 1;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage_train(stdout);
            return 0;
        } else if (!strcmp(a, "--report")) {
            o.report = 1;
            takes = 0;
        } else if (!v) {
            return bad_usage("option '%s' needs a value, or is unknown", a);
        } else if (!strcmp(a, "--model")) {
            if (strcmp(v, "mlp")) return bad_usage("unknown model '%s' (mlp)", v);
        } else if (!strcmp(a, "--hidden")) {
            if (parse_hidden(v, &o)) return bad_usage("bad --hidden '%s' (sizes like 64,64)", v);
        } else if (!strcmp(a, "--activation")) {
            if (!strcmp(v, "relu")) o.act = MT_ACT_RELU;
            else if (!strcmp(v, "gelu")) o.act = MT_ACT_GELU;
            else return bad_usage("bad --activation '%s' (relu or gelu)", v);
        } else if (!strcmp(a, "--steps")) {
            if (parse_long(v, 0, 100000000, &o.steps)) return bad_usage("bad --steps '%s'", v);
        } else if (!strcmp(a, "--batch")) {
            if (parse_long(v, 1, 1 << 24, &o.batch)) return bad_usage("bad --batch '%s'", v);
        } else if (!strcmp(a, "--seed")) {
            if (parse_long(v, 0, 2147483647, &o.seed)) return bad_usage("bad --seed '%s'", v);
        } else if (!strcmp(a, "--every")) {
            if (parse_long(v, 1, 100000000, &o.every)) return bad_usage("bad --every '%s'", v);
        } else if (!strcmp(a, "--threads")) {
            if (parse_long(v, 0, 4096, &o.threads)) return bad_usage("bad --threads '%s'", v);
        } else if (!strcmp(a, "--lr")) {
            if (parse_float(v, &o.lr) || o.lr < 0) return bad_usage("bad --lr '%s'", v);
        } else if (!strcmp(a, "--momentum")) {
            if (parse_float(v, &o.momentum) || o.momentum < 0 || o.momentum >= 1)
                return bad_usage("bad --momentum '%s' (0 <= m < 1)", v);
        } else if (!strcmp(a, "--weight-decay")) {
            if (parse_float(v, &o.wd) || o.wd < 0) return bad_usage("bad --weight-decay '%s'", v);
        } else if (!strcmp(a, "--device")) {
            if (parse_device(v, &o.device)) return bad_usage("bad --device '%s' (cpu, cuda, auto)", v);
        } else if (!strcmp(a, "--precision")) {
            if (!strcmp(v, "fp32")) o.precision = MT_PREC_FP32;
            else if (!strcmp(v, "fp16")) o.precision = MT_PREC_FP16;
            else if (!strcmp(v, "bf16")) o.precision = MT_PREC_BF16;
            else return bad_usage("bad --precision '%s' (fp32, fp16, bf16)", v);
        } else if (!strcmp(a, "--allocator")) {
            if (!mt_allocator_by_name(v)) return bad_usage("unknown allocator '%s'", v);
            o.allocator = v;
        } else if (!strcmp(a, "--trace")) {
            o.trace = v;
        } else if (!strcmp(a, "--chrome")) {
            o.chrome = v;
        } else if (!strcmp(a, "--svg")) {
            o.svg = v;
        } else {
            return bad_usage("unknown option '%s'", a);
        }
        i += takes;
    }

    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = o.device;
    cfg.threads = (int)o.threads;
    for (int c = 0; c < MT_MEM_COUNT; c++) cfg.allocators[c].vtable = mt_allocator_by_name(o.allocator);
    if (o.trace || o.chrome || o.svg) cfg.trace_capacity = 1u << 22;
    mt_context *ctx;
    if (mt_context_create(&cfg, &ctx)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(NULL));
        return EXIT_FAIL;
    }
    mt_mlp_spec spec;
    mt_mlp_spec_init(&spec);
    spec.n_layers = o.n_hidden + 1;
    spec.dims[0] = 2;
    for (int i = 0; i < o.n_hidden; i++) spec.dims[i + 1] = o.hidden[i];
    spec.dims[o.n_hidden + 1] = 3;
    spec.activation = o.act;
    spec.seed = (uint64_t)o.seed;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = (int)o.batch;
    tc.lr = o.lr;
    tc.momentum = o.momentum;
    tc.weight_decay = o.wd;
    tc.precision = o.precision;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    int rc = 0;
    float *x = malloc((size_t)o.batch * 2 * sizeof *x);
    int32_t *y = malloc((size_t)o.batch * sizeof *y);
    if (!x || !y) {
        fprintf(stderr, "%s: out of memory\n", prog);
        rc = EXIT_FAIL;
        goto done;
    }
    /* the estimate first: the report sets it beside the measured figures */
    mt_estimate_report est;
    if (mt_model_mlp_create(ctx, &spec, &m) || mt_estimate_model(m, &tc, &est) ||
        mt_trainer_create(m, &tc, &t)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
        rc = EXIT_FAIL;
        goto done;
    }
    printf("training an MLP (2");
    for (int i = 0; i < o.n_hidden; i++) printf("-%d", o.hidden[i]);
    static const char *const prec[] = {"fp32", "fp16", "bf16"};
    printf("-3, %s, %zu parameters) on three spirals, %s, %s, allocator %s\n",
           o.act == MT_ACT_RELU ? "relu" : "gelu", mt_model_num_params(m),
           mt_context_device_name(ctx), prec[o.precision], o.allocator);
    uint64_t data = (uint64_t)o.seed * 7919u;
    double t0 = now_s(), window = 0.0;
    int in_window = 0;
    for (long step = 1; step <= o.steps; step++) {
        spirals(&data, x, y, (int)o.batch);
        mt_batch b = {.n = (int)o.batch, .inputs = x, .targets = y};
        float loss;
        if (mt_trainer_step(t, &b, &loss)) {
            fprintf(stderr, "%s: step %ld: %s\n", prog, step, mt_last_error(ctx));
            rc = EXIT_FAIL;
            goto done;
        }
        window += loss;
        in_window++;
        if (step == 1 || step % o.every == 0 || step == o.steps) {
            mt_memory_stats ms;
            mt_context_memory_stats(ctx, &ms);
            mt_loss_scale_state ls;
            mt_trainer_get_loss_scale(t, &ls);
            printf("step %6ld  loss %.4f  %.3f ms/step  peak %.1f KiB", step, window / in_window,
                   1e3 * (now_s() - t0) / (double)step, (double)ms.peak_live_bytes / 1024.0);
            if (o.precision == MT_PREC_FP16)
                printf("  scale %g  skipped %llu", (double)ls.scale,
                       (unsigned long long)ls.steps_skipped);
            printf("\n");
            window = 0.0;
            in_window = 0;
        }
    }
    /* held-out points from another part of the data stream */
    uint64_t test = (uint64_t)o.seed * 104729u + 17;
    spirals(&test, x, y, (int)o.batch);
    mt_batch b = {.n = (int)o.batch, .inputs = x, .targets = y};
    float loss, acc;
    if (mt_trainer_eval(t, &b, &loss, &acc)) {
        fprintf(stderr, "%s: eval: %s\n", prog, mt_last_error(ctx));
        rc = EXIT_FAIL;
        goto done;
    }
    printf("held-out batch: loss %.4f  accuracy %.1f%%\n", loss, 100.0 * acc);
    if (o.trace) {
        if (mt_context_trace_write(ctx, o.trace)) {
            fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
            rc = EXIT_FAIL;
            goto done;
        }
        printf("allocation trace written to %s\n", o.trace);
    }
    if (o.chrome || o.svg) {
        const mt_trace_event *ev;
        size_t n;
        mt_trace *tr = NULL;
        if (mt_context_trace_events(ctx, &ev, &n, NULL) || mt_trace_from_events(ctx, ev, n, &tr) ||
            (o.chrome && mt_trace_export_chrome(ctx, tr, &est, o.chrome)) ||
            (o.svg && mt_trace_export_svg(ctx, tr, &est, o.svg))) {
            fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
            mt_trace_free(tr);
            rc = EXIT_FAIL;
            goto done;
        }
        mt_trace_free(tr);
        if (o.chrome) printf("memory timeline (Chrome trace JSON, opens in Perfetto) written to %s\n", o.chrome);
        if (o.svg) printf("memory plot (SVG) written to %s\n", o.svg);
    }
    if (o.report) {
        printf("\n");
        print_report(ctx);
    }
done:
    free(x);
    free(y);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return rc;
}

/* ---- replay ---- */

static int replay_one(mt_context *ctx, const mt_trace *tr, const char *name)
{
    mt_allocator_config ac = {.vtable = mt_allocator_by_name(name)};
    mt_allocator *a;
    if (mt_allocator_create(ctx, &ac, &a)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
        return EXIT_FAIL;
    }
    mt_replay_result r;
    mt_status s = mt_trace_replay(tr, a, &r);
    if (s) {
        fprintf(stderr, "%s: replay through %s: %s\n", prog, name, mt_last_error(ctx));
        mt_allocator_destroy(a);
        return EXIT_FAIL;
    }
    mt_allocator_stats st;
    mt_allocator_get_stats(a, &st);
    printf("%-11s events %9llu  allocs %9llu  failed %5llu  peak live %10.2f MiB  peak reserved "
           "%10.2f MiB  efficiency %.3f  backing calls %7llu  %.3f s\n",
           name, (unsigned long long)r.n_events, (unsigned long long)r.n_alloc,
           (unsigned long long)r.n_failed, (double)r.peak_live_bytes / 1048576.0,
           (double)r.peak_reserved_bytes / 1048576.0, r.efficiency,
           (unsigned long long)(st.n_backing_alloc + st.n_backing_free), r.seconds);
    mt_allocator_destroy(a);
    return 0;
}

static int cmd_replay(int argc, char **argv)
{
    const char *path = NULL, *alloc = "caching";
    mt_device_kind dev = MT_DEVICE_CPU;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage_replay(stdout);
            return 0;
        } else if (a[0] == '-' && a[1] == '-') {
            if (!v) return bad_usage("option '%s' needs a value, or is unknown", a);
            if (!strcmp(a, "--allocator")) {
                if (strcmp(v, "all") && !mt_allocator_by_name(v))
                    return bad_usage("unknown allocator '%s'", v);
                alloc = v;
            } else if (!strcmp(a, "--device")) {
                if (parse_device(v, &dev)) return bad_usage("bad --device '%s'", v);
            } else {
                return bad_usage("unknown option '%s'", a);
            }
            i++;
        } else if (!path) {
            path = a;
        } else {
            return bad_usage("unexpected argument '%s'", a);
        }
    }
    if (!path) return bad_usage("%s", "replay needs a trace file");
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = dev;
    mt_context *ctx;
    if (mt_context_create(&cfg, &ctx)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(NULL));
        return EXIT_FAIL;
    }
    mt_trace *tr;
    if (mt_trace_load(ctx, path, &tr)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
        mt_context_destroy(ctx);
        return EXIT_FAIL;
    }
    int rc = 0;
    if (!strcmp(alloc, "all")) {
        static const char *const names[] = {"caching", "arena", "pool", "checkpoint"};
        for (int i = 0; i < 4 && !rc; i++) rc = replay_one(ctx, tr, names[i]);
    } else {
        rc = replay_one(ctx, tr, alloc);
    }
    mt_trace_free(tr);
    mt_context_destroy(ctx);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage_main(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version")) {
        printf("memtrain %s\n", mt_version());
        return 0;
    }
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage_main(stdout);
        return 0;
    }
    if (!strcmp(cmd, "train")) return cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "replay")) return cmd_replay(argc - 2, argv + 2);
    return bad_usage("unknown command '%s'", cmd);
}
