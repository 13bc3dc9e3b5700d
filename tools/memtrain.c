/*
 * memtrain.c - the memtrain command.
 *
 *   memtrain train  [options]     train a model on built-in data, print progress and memory
 *   memtrain replay TRACE [opts]  replay an allocation trace through an allocator
 *   memtrain estimate [opts]      the memory of a training run, before it runs
 *   memtrain --version | --help
 *
 * Exit codes: 0 success, 1 a library call failed, 2 bad command line, 3 a
 * memory budget that cannot be met.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "memtrain.h"

#define EXIT_FAIL 1
#define EXIT_USAGE 2
#define EXIT_BUDGET 3

static const char *prog = "memtrain";

static void usage_main(FILE *f)
{
    fprintf(f,
            "usage: memtrain <command> [options]\n"
            "\n"
            "commands:\n"
            "  train     train a model on built-in data (no download) and report memory\n"
            "  replay    replay an allocation trace through an allocator and print its stats\n"
            "  estimate  what a training run will hold, per memory class, before it runs\n"
            "  sample    text from a GPT trained by 'train --model gpt --save'\n"
            "  report    what an allocation trace shows, and its plots (Chrome JSON, SVG)\n"
            "\n"
            "  memtrain --version     print the version\n"
            "  memtrain <command> --help\n");
}

static void usage_train(FILE *f)
{
    fprintf(f,
            "usage: memtrain train [options]\n"
            "  --model mlp|gpt        the MLP on spirals, or a GPT on text (mlp)\n"
            "  --steps N              training steps (300)\n"
            "  --batch N              rows per step (mlp 64, gpt 8)\n"
            "  --lr X                 learning rate (sgd 0.1, adamw 3e-3)\n"
            "  --weight-decay X       (0)\n"
            "  --precision P          fp32, fp16 (fp32 masters, dynamic loss scaling) or bf16 (fp32)\n"
            "  --seed N               data order and initial weights (1)\n"
            "  --every N              print progress every N steps (25)\n"
            "  --device cpu|cuda|auto (cpu)\n"
            "  --threads N            CPU threads, 0 = all (0)\n"
            "  --allocator NAME       caching|arena|pool|checkpoint for every class (caching)\n"
            "  --trace FILE           record every allocation to FILE (replay it later)\n"
            "  --chrome FILE          the run's memory as Chrome trace JSON (Perfetto)\n"
            "  --svg FILE             the run's memory by class as an SVG plot, peak and estimate\n"
            "  --report, --no-report  the memory report at the end (on, but not with --json)\n"
            "  --config FILE          options from FILE, a line 'name = value' each (flags: 1/0);\n"
            "                         the command line overrides it\n"
            "MLP: three interleaved spirals in the plane, 3 classes, made from the seed; SGD.\n"
            "  --hidden N,N,...       hidden layer sizes (64,64)\n"
            "  --activation relu|gelu (relu)\n"
            "  --momentum X           SGD momentum (0.9)\n"
            "GPT: byte-level text or an llm.c token file; 10%% held out for validation.\n"
            "  --data FILE            text or llm.c tokens (the built-in corpus: this project's docs)\n"
            "  --layers N --heads N --channels N   (2 4 128)\n"
            "  --seq N                tokens per row (64)\n"
            "  --micro N              rows per micro-batch, 0 = the whole batch (0)\n"
            "  --optimizer sgd|adamw|adamw8|adafactor  (adamw)\n"
            "  --no-master            bf16 weights without fp32 masters\n"
            "  --recompute none|selective|sqrt|every:K  (none)\n"
            "  --fused                the fused backward + optimizer step\n"
            "  --clip X               global gradient-norm clipping, 0 = none (1)\n"
            "  --schedule cosine|constant  warmup (10%% of --steps) and cosine to 0.1 lr, or constant\n"
            "  --eval-every N         validation loss every N steps (4 x --every)\n"
            "  --json                 one JSON object per step instead of progress lines\n"
            "  --save FILE            a training checkpoint at the end (and every --save-every N)\n"
            "  --resume FILE          go on from a checkpoint (same model and settings)\n"
            "  --llmc FILE            start from an llm.c model checkpoint (fp32; its shape)\n"
            "  --export-llmc FILE     write the trained weights as an llm.c model checkpoint\n");
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

static int parse_recompute(const char *v, mt_trainer_config *tc)
{
    if (!strcmp(v, "none")) tc->recompute = MT_RECOMPUTE_NONE;
    else if (!strcmp(v, "selective")) tc->recompute = MT_RECOMPUTE_SELECTIVE;
    else if (!strcmp(v, "sqrt")) tc->recompute = MT_RECOMPUTE_SQRT;
    else if (!strcmp(v, "budget")) tc->recompute = MT_RECOMPUTE_BUDGET;
    else if (!strncmp(v, "every:", 6)) {
        long k;
        if (parse_long(v + 6, 1, 1 << 20, &k)) return -1;
        tc->recompute = MT_RECOMPUTE_EVERY_K;
        tc->recompute_every = (int)k;
    } else {
        return -1;
    }
    return 0;
}

static int parse_precision(const char *v, mt_precision *out)
{
    if (!strcmp(v, "fp32")) *out = MT_PREC_FP32;
    else if (!strcmp(v, "fp16")) *out = MT_PREC_FP16;
    else if (!strcmp(v, "bf16")) *out = MT_PREC_BF16;
    else return -1;
    return 0;
}

static int parse_optimizer(const char *v, mt_optimizer_kind *out)
{
    if (!strcmp(v, "sgd")) *out = MT_OPT_SGD;
    else if (!strcmp(v, "adamw")) *out = MT_OPT_ADAMW;
    else if (!strcmp(v, "adamw8")) *out = MT_OPT_ADAMW8;
    else if (!strcmp(v, "adafactor")) *out = MT_OPT_ADAFACTOR;
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
    int gpt;                 /* the model: 0 the MLP, 1 a GPT */
    int hidden[MT_MLP_MAX_LAYERS];
    int n_hidden;
    mt_activation act;
    long steps, batch, seed, every, threads;
    float lr, momentum, wd, clip;
    int lr_set;
    mt_device_kind device;
    mt_precision precision;
    const char *allocator, *trace, *chrome, *svg;
    int report;
    /* GPT */
    const char *data;        /* a text or llm.c token file; NULL: the built-in corpus */
    long layers, heads, channels, seq, micro, eval_every, save_every;
    mt_optimizer_kind optimizer;
    int no_master, fused, json, constant_lr;
    mt_trainer_config rc; /* recompute settings */
    const char *save, *resume, *llmc, *export_llmc;
    /* sample */
    int sample;
    const char *prompt;
    long length;
    float temperature;
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

/* The built-in corpus: the project's own README and docs, embedded at build
 * time (Makefile), so the demo needs no download. */
extern const unsigned char mt_corpus[];
extern const size_t mt_corpus_size;

/* The end of every run: the trace, the plots, the report. */
static int finish_run(const train_opts *o, mt_context *ctx, const mt_estimate_report *est)
{
    if (o->trace) {
        if (mt_context_trace_write(ctx, o->trace)) {
            fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
            return EXIT_FAIL;
        }
        printf("allocation trace written to %s\n", o->trace);
    }
    if (o->chrome || o->svg) {
        const mt_trace_event *ev;
        size_t n;
        mt_trace *tr = NULL;
        if (mt_context_trace_events(ctx, &ev, &n, NULL) || mt_trace_from_events(ctx, ev, n, &tr) ||
            (o->chrome && mt_trace_export_chrome(ctx, tr, est, o->chrome)) ||
            (o->svg && mt_trace_export_svg(ctx, tr, est, o->svg))) {
            fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
            mt_trace_free(tr);
            return EXIT_FAIL;
        }
        mt_trace_free(tr);
        if (o->chrome)
            printf("memory timeline (Chrome trace JSON, opens in Perfetto) written to %s\n", o->chrome);
        if (o->svg) printf("memory plot (SVG) written to %s\n", o->svg);
    }
    if (o->report) {
        printf("\n");
        print_report(ctx);
    }
    return 0;
}

static const char *const prec_name[] = {"fp32", "fp16", "bf16"};

static int run_mlp(const train_opts *o, mt_context *ctx)
{
    mt_mlp_spec spec;
    mt_mlp_spec_init(&spec);
    spec.n_layers = o->n_hidden + 1;
    spec.dims[0] = 2;
    for (int i = 0; i < o->n_hidden; i++) spec.dims[i + 1] = o->hidden[i];
    spec.dims[o->n_hidden + 1] = 3;
    spec.activation = o->act;
    spec.seed = (uint64_t)o->seed;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = (int)o->batch;
    tc.lr = o->lr_set ? o->lr : 0.1f;
    tc.momentum = o->momentum;
    tc.weight_decay = o->wd;
    tc.precision = o->precision;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    int rc = 0;
    float *x = malloc((size_t)o->batch * 2 * sizeof *x);
    int32_t *y = malloc((size_t)o->batch * sizeof *y);
    mt_estimate_report est;
    if (!x || !y) {
        fprintf(stderr, "%s: out of memory\n", prog);
        rc = EXIT_FAIL;
        goto done;
    }
    /* the estimate first: the report sets it beside the measured figures */
    if (mt_model_mlp_create(ctx, &spec, &m) || mt_estimate_model(m, &tc, &est) ||
        mt_trainer_create(m, &tc, &t)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
        rc = EXIT_FAIL;
        goto done;
    }
    printf("training an MLP (2");
    for (int i = 0; i < o->n_hidden; i++) printf("-%d", o->hidden[i]);
    printf("-3, %s, %zu parameters) on three spirals, %s, %s, allocator %s\n",
           o->act == MT_ACT_RELU ? "relu" : "gelu", mt_model_num_params(m),
           mt_context_device_name(ctx), prec_name[o->precision], o->allocator);
    uint64_t data = (uint64_t)o->seed * 7919u;
    double t0 = now_s(), window = 0.0;
    int in_window = 0;
    for (long step = 1; step <= o->steps; step++) {
        spirals(&data, x, y, (int)o->batch);
        mt_batch b = {.n = (int)o->batch, .inputs = x, .targets = y};
        float loss;
        if (mt_trainer_step(t, &b, &loss)) {
            fprintf(stderr, "%s: step %ld: %s\n", prog, step, mt_last_error(ctx));
            rc = EXIT_FAIL;
            goto done;
        }
        window += loss;
        in_window++;
        if (step == 1 || step % o->every == 0 || step == o->steps) {
            mt_memory_stats ms;
            mt_context_memory_stats(ctx, &ms);
            mt_loss_scale_state ls;
            mt_trainer_get_loss_scale(t, &ls);
            printf("step %6ld  loss %.4f  %.3f ms/step  peak %.1f KiB", step, window / in_window,
                   1e3 * (now_s() - t0) / (double)step, (double)ms.peak_live_bytes / 1024.0);
            if (o->precision == MT_PREC_FP16)
                printf("  scale %g  skipped %llu", (double)ls.scale,
                       (unsigned long long)ls.steps_skipped);
            printf("\n");
            window = 0.0;
            in_window = 0;
        }
    }
    /* held-out points from another part of the data stream */
    uint64_t test = (uint64_t)o->seed * 104729u + 17;
    spirals(&test, x, y, (int)o->batch);
    mt_batch b = {.n = (int)o->batch, .inputs = x, .targets = y};
    float loss, acc;
    if (mt_trainer_eval(t, &b, &loss, &acc)) {
        fprintf(stderr, "%s: eval: %s\n", prog, mt_last_error(ctx));
        rc = EXIT_FAIL;
        goto done;
    }
    printf("held-out batch: loss %.4f  accuracy %.1f%%\n", loss, 100.0 * acc);
    rc = finish_run(o, ctx, &est);
done:
    free(x);
    free(y);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    return rc;
}

/* The mean loss over a few validation batches. */
static int val_loss(mt_context *ctx, mt_trainer *t, mt_data *d, float *out)
{
    double sum = 0;
    const int k = 4;
    for (int i = 0; i < k; i++) {
        mt_batch b;
        float l;
        if (mt_data_next(d, MT_DATA_VAL, &b) || mt_trainer_eval(t, &b, &l, NULL)) {
            fprintf(stderr, "%s: eval: %s\n", prog, mt_last_error(ctx));
            return EXIT_FAIL;
        }
        sum += l;
    }
    *out = (float)(sum / k);
    return 0;
}

/* What a checkpoint keeps of the run beside the trainer: the data stream's
 * position. */
typedef struct run_pos {
    uint64_t epoch, position;
} run_pos;

/* Text from a trained byte-level GPT: the prompt, then each next byte drawn
 * from the softmax of the logits at the last position (temperature T; 0:
 * the most likely byte), the model seeing the last max_seq bytes. */
static int sample_text(const train_opts *o, mt_context *ctx, mt_trainer *t, const mt_gpt_spec *g)
{
    const int T = g->max_seq, V = g->vocab;
    size_t plen = o->prompt ? strlen(o->prompt) : 0, cap = plen + (size_t)o->length + 1;
    int32_t *tok = malloc(cap * sizeof *tok);
    float *lg = malloc((size_t)V * sizeof *lg);
    if (!tok || !lg) {
        free(tok), free(lg);
        fprintf(stderr, "%s: out of memory\n", prog);
        return EXIT_FAIL;
    }
    size_t n = 0;
    for (size_t i = 0; i < plen; i++) tok[n++] = (unsigned char)o->prompt[i] % V;
    if (!n) tok[n++] = '\n' % V;
    fwrite(o->prompt ? o->prompt : "", 1, plen, stdout);
    uint64_t r = (uint64_t)o->seed * 0x9E3779B97F4A7C15ull + 1;
    for (long k = 0; k < o->length; k++) {
        size_t from = n > (size_t)T ? n - (size_t)T : 0;
        mt_batch b = {.n = 1, .tokens = tok + from, .seq_len = (int)(n - from)};
        if (mt_trainer_logits(t, &b, lg, (size_t)V)) {
            fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
            free(tok), free(lg);
            return EXIT_FAIL;
        }
        int next = 0;
        if (o->temperature <= 0) {
            for (int j = 1; j < V; j++)
                if (lg[j] > lg[next]) next = j;
        } else {
            double mx = lg[0], sum = 0;
            for (int j = 1; j < V; j++) mx = lg[j] > mx ? lg[j] : mx;
            for (int j = 0; j < V; j++) sum += exp((lg[j] - mx) / o->temperature);
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            double u = (double)(r >> 11) / 9007199254740992.0 * sum, acc = 0;
            for (next = 0; next < V - 1; next++) {
                acc += exp((lg[next] - mx) / o->temperature);
                if (acc > u) break;
            }
        }
        tok[n++] = next;
        if (V <= 256) putchar(next);
        else printf(" %d", next);
    }
    printf("\n");
    free(tok), free(lg);
    return 0;
}

static int run_gpt(const train_opts *o, mt_context *ctx)
{
    mt_data_config dc;
    mt_data_config_init(&dc);
    if (o->data) dc.path = o->data;
    else dc.bytes = mt_corpus, dc.n_bytes = mt_corpus_size;
    dc.seq_len = (int)o->seq, dc.batch = (int)o->batch, dc.seed = (uint64_t)o->seed;
    mt_data *d = NULL;
    if (mt_data_open(&dc, &d)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(NULL));
        return EXIT_FAIL;
    }
    mt_data_info di;
    mt_data_get_info(d, &di);
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = di.vocab, g.max_seq = (int)o->seq, g.layers = (int)o->layers;
    g.heads = (int)o->heads, g.channels = (int)o->channels, g.seed = (uint64_t)o->seed;
    mt_trainer_config tc = o->rc; /* recompute as parsed */
    tc.max_batch = (int)o->batch;
    tc.micro_batch = (int)o->micro;
    tc.max_seq = (int)o->seq;
    tc.optimizer = o->optimizer;
    tc.lr = o->lr_set ? o->lr : (o->optimizer == MT_OPT_SGD ? 0.1f : 3e-3f);
    tc.momentum = o->optimizer == MT_OPT_SGD ? o->momentum : 0.0f;
    tc.weight_decay = o->wd;
    tc.precision = o->precision;
    tc.master_weights = !o->no_master;
    tc.fused_step = o->fused;
    tc.grad_clip = o->clip;
    tc.lr_schedule = o->constant_lr ? MT_LR_CONSTANT : MT_LR_WARMUP_COSINE;
    tc.warmup_steps = (int)(o->steps / 10 > 0 ? o->steps / 10 : 1);
    tc.total_steps = (int)(o->steps > tc.warmup_steps ? o->steps : tc.warmup_steps + 1);
    tc.min_lr_ratio = 0.1f;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    mt_estimate_report est;
    int rc = 0;
    mt_status made = MT_OK;
    if (o->llmc) { /* weights (and the shape) from an llm.c checkpoint */
        made = mt_model_gpt_load(ctx, o->llmc, &m);
        if (!made) made = mt_model_gpt_get_spec(m, &g);
        if (!made && (g.vocab < di.vocab || g.max_seq < (int)o->seq)) {
            fprintf(stderr, "%s: %s: vocab %d and max_seq %d cannot take the data (vocab %d) "
                    "at --seq %ld\n", prog, o->llmc, g.vocab, g.max_seq, di.vocab, o->seq);
            rc = EXIT_FAIL;
            goto done;
        }
    } else {
        made = mt_model_gpt_create(ctx, &g, &m);
    }
    if (made || mt_estimate_model(m, &tc, &est) || mt_trainer_create(m, &tc, &t)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
        rc = EXIT_FAIL;
        goto done;
    }
    if (o->resume) {
        run_pos p;
        size_t len = 0;
        if (mt_trainer_load(t, o->resume, &p, sizeof p, &len) || len != sizeof p ||
            mt_data_seek(d, p.epoch, p.position)) {
            fprintf(stderr, "%s: resume: %s\n", prog,
                    len != sizeof p && !mt_last_error(ctx)[0] ? "the file holds no data position"
                                                               : mt_last_error(ctx));
            rc = EXIT_FAIL;
            goto done;
        }
    }
    if (o->sample) {
        rc = sample_text(o, ctx, t, &g);
        goto done;
    }
    if (!o->json) {
        printf("training a GPT (L%d H%d C%d, vocab %d, %zu parameters) on %s (%zu tokens), B%ld "
               "T%ld, %s, %s, allocator %s\n",
               g.layers, g.heads, g.channels, g.vocab, mt_model_num_params(m),
               o->data ? o->data : "the built-in corpus", di.tokens, o->batch, o->seq,
               mt_context_device_name(ctx), prec_name[o->precision], o->allocator);
        printf("estimated peak %.2f MiB (allocators reserve %.2f MiB)%s\n",
               (double)est.peak / 1048576.0, (double)est.peak_reserved / 1048576.0,
               o->resume ? "; resumed" : "");
    }
    const double tokens_per_step = (double)o->batch * (double)o->seq;
    const bool live = !o->json && isatty(STDOUT_FILENO);
    double window = 0.0, t_window = 0.0;
    int in_window = 0;
    for (long step = (long)mt_trainer_steps(t) + 1; step <= o->steps; step++) {
        mt_batch b;
        float loss;
        double t0 = now_s(), t_data = 0;
        mt_status ds = mt_data_next(d, MT_DATA_TRAIN, &b);
        t_data = now_s() - t0;
        if (ds || mt_trainer_step(t, &b, &loss)) {
            fprintf(stderr, "%s: step %ld: %s\n", prog, step,
                    mt_last_error(ctx)[0] ? mt_last_error(ctx) : mt_last_error(NULL));
            rc = EXIT_FAIL;
            goto done;
        }
        double dt = now_s() - t0;
        window += loss, t_window += dt, in_window++;
        bool show = step == 1 || step % o->every == 0 || step == o->steps;
        bool eval = o->eval_every && (step % o->eval_every == 0 || step == o->steps);
        float vl = -1;
        if (eval && (rc = val_loss(ctx, t, d, &vl))) goto done;
        mt_memory_stats ms;
        mt_context_memory_stats(ctx, &ms);
        mt_loss_scale_state ls;
        mt_trainer_get_loss_scale(t, &ls);
        if (o->json) {
            printf("{\"step\": %ld, \"loss\": %.6f, \"lr\": %g, \"ms\": %.3f, \"data_ms\": %.4f, "
                   "\"tokens_per_s\": %.1f, \"live_bytes\": %llu, \"peak_bytes\": %llu, "
                   "\"loss_scale\": %g, \"skipped\": %llu",
                   step, loss, (double)mt_trainer_lr(t), 1e3 * dt, 1e3 * t_data, tokens_per_step / dt,
                   (unsigned long long)ms.live_bytes, (unsigned long long)ms.peak_live_bytes,
                   (double)ls.scale, (unsigned long long)ls.steps_skipped);
            if (eval) printf(", \"val_loss\": %.6f", vl);
            printf("}\n");
        } else if (show || eval || live) {
            /* on a terminal every step rewrites the line; every N steps (and
               at each validation) it stays */
            bool keep = show || eval;
            printf("%sstep %6ld/%ld  loss %.4f", live ? "\r" : "", step, o->steps,
                   window / in_window);
            if (eval) printf("  val %.4f", vl);
            printf("  %.0f tok/s  %.1f ms/step  mem %.1f / peak %.1f MiB",
                   tokens_per_step * in_window / t_window, 1e3 * t_window / in_window,
                   (double)ms.live_bytes / 1048576.0, (double)ms.peak_live_bytes / 1048576.0);
            if (o->precision == MT_PREC_FP16)
                printf("  scale %g  skipped %llu", (double)ls.scale,
                       (unsigned long long)ls.steps_skipped);
            printf(keep ? "\n" : "\033[K");
            if (keep) window = t_window = 0.0, in_window = 0;
        }
        fflush(stdout);
        if (o->save && ((o->save_every && step % o->save_every == 0) || step == o->steps)) {
            mt_data_info now;
            mt_data_get_info(d, &now);
            run_pos p = {now.epoch, now.position};
            if (mt_trainer_save(t, o->save, &p, sizeof p)) {
                fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
                rc = EXIT_FAIL;
                goto done;
            }
        }
    }
    if (o->save && !o->json) printf("checkpoint written to %s\n", o->save);
    if (o->export_llmc) {
        mt_trainer_destroy(t); /* the weights back in fp32 */
        t = NULL;
        if (mt_model_gpt_save(m, o->export_llmc)) {
            fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
            rc = EXIT_FAIL;
            goto done;
        }
        if (!o->json) printf("llm.c model checkpoint written to %s\n", o->export_llmc);
    }
    rc = finish_run(o, ctx, &est);
done:
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_data_close(d);
    return rc;
}

static int sampling; /* cmd_sample runs cmd_train's parser in sample mode */

static int cmd_train(int argc, char **argv)
{
    train_opts o = {.sample = sampling, .length = 200, .temperature = 0.8f, .report = -1,.hidden = {64, 64}, .n_hidden = 2, .act = MT_ACT_RELU, .steps = 300,
                    .batch = 64, .seed = 1, .every = 25, .lr = 0.1f, .momentum = 0.9f,
                    .device = MT_DEVICE_CPU, .allocator = "caching", .layers = 2, .heads = 4,
                    .channels = 128, .seq = 64, .optimizer = MT_OPT_ADAMW, .clip = 1.0f};
    mt_trainer_config_init(&o.rc);
    long batch = -1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes = 1;
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage_train(stdout);
            return 0;
        } else if (!strcmp(a, "--report")) {
            o.report = 1, takes = 0;
        } else if (!strcmp(a, "--no-report")) {
            o.report = 0, takes = 0;
        } else if (!strcmp(a, "--json")) {
            o.json = 1, takes = 0;
        } else if (!strcmp(a, "--no-master")) {
            o.no_master = 1, takes = 0;
        } else if (!strcmp(a, "--fused")) {
            o.fused = 1, takes = 0;
        } else if (!v) {
            return bad_usage("option '%s' needs a value, or is unknown", a);
        } else if (!strcmp(a, "--model")) {
            if (!strcmp(v, "mlp")) o.gpt = 0;
            else if (!strcmp(v, "gpt")) o.gpt = 1;
            else return bad_usage("unknown model '%s' (mlp, gpt)", v);
        } else if (!strcmp(a, "--hidden")) {
            if (parse_hidden(v, &o)) return bad_usage("bad --hidden '%s' (sizes like 64,64)", v);
        } else if (!strcmp(a, "--activation")) {
            if (!strcmp(v, "relu")) o.act = MT_ACT_RELU;
            else if (!strcmp(v, "gelu")) o.act = MT_ACT_GELU;
            else return bad_usage("bad --activation '%s' (relu or gelu)", v);
        } else if (!strcmp(a, "--steps")) {
            if (parse_long(v, 0, 100000000, &o.steps)) return bad_usage("bad --steps '%s'", v);
        } else if (!strcmp(a, "--batch")) {
            if (parse_long(v, 1, 1 << 24, &batch)) return bad_usage("bad --batch '%s'", v);
        } else if (!strcmp(a, "--seed")) {
            if (parse_long(v, 0, 2147483647, &o.seed)) return bad_usage("bad --seed '%s'", v);
        } else if (!strcmp(a, "--every")) {
            if (parse_long(v, 1, 100000000, &o.every)) return bad_usage("bad --every '%s'", v);
        } else if (!strcmp(a, "--threads")) {
            if (parse_long(v, 0, 4096, &o.threads)) return bad_usage("bad --threads '%s'", v);
        } else if (!strcmp(a, "--lr")) {
            if (parse_float(v, &o.lr) || o.lr < 0) return bad_usage("bad --lr '%s'", v);
            o.lr_set = 1;
        } else if (!strcmp(a, "--momentum")) {
            if (parse_float(v, &o.momentum) || o.momentum < 0 || o.momentum >= 1)
                return bad_usage("bad --momentum '%s' (0 <= m < 1)", v);
        } else if (!strcmp(a, "--weight-decay")) {
            if (parse_float(v, &o.wd) || o.wd < 0) return bad_usage("bad --weight-decay '%s'", v);
        } else if (!strcmp(a, "--clip")) {
            if (parse_float(v, &o.clip) || o.clip < 0) return bad_usage("bad --clip '%s'", v);
        } else if (!strcmp(a, "--device")) {
            if (parse_device(v, &o.device)) return bad_usage("bad --device '%s' (cpu, cuda, auto)", v);
        } else if (!strcmp(a, "--precision")) {
            if (parse_precision(v, &o.precision))
                return bad_usage("bad --precision '%s' (fp32, fp16, bf16)", v);
        } else if (!strcmp(a, "--allocator")) {
            if (!mt_allocator_by_name(v)) return bad_usage("unknown allocator '%s'", v);
            o.allocator = v;
        } else if (!strcmp(a, "--trace")) {
            o.trace = v;
        } else if (!strcmp(a, "--chrome")) {
            o.chrome = v;
        } else if (!strcmp(a, "--svg")) {
            o.svg = v;
        } else if (!strcmp(a, "--data")) {
            o.data = v;
        } else if (!strcmp(a, "--layers") || !strcmp(a, "--heads") || !strcmp(a, "--channels") ||
                   !strcmp(a, "--seq") || !strcmp(a, "--micro") || !strcmp(a, "--eval-every") ||
                   !strcmp(a, "--save-every")) {
            long lo = !strcmp(a, "--micro") || !strcmp(a, "--eval-every") || !strcmp(a, "--save-every") ? 0 : 1;
            if (parse_long(v, lo, 1 << 24, &n)) return bad_usage("bad value for %s", a);
            if (!strcmp(a, "--layers")) o.layers = n;
            else if (!strcmp(a, "--heads")) o.heads = n;
            else if (!strcmp(a, "--channels")) o.channels = n;
            else if (!strcmp(a, "--seq")) o.seq = n;
            else if (!strcmp(a, "--micro")) o.micro = n;
            else if (!strcmp(a, "--eval-every")) o.eval_every = n;
            else o.save_every = n;
        } else if (!strcmp(a, "--optimizer")) {
            if (parse_optimizer(v, &o.optimizer))
                return bad_usage("unknown optimizer '%s' (sgd, adamw, adamw8, adafactor)", v);
        } else if (!strcmp(a, "--recompute")) {
            if (parse_recompute(v, &o.rc) || o.rc.recompute == MT_RECOMPUTE_BUDGET)
                return bad_usage("bad --recompute '%s' (none, selective, sqrt, every:K)", v);
        } else if (!strcmp(a, "--schedule")) {
            if (!strcmp(v, "cosine")) o.constant_lr = 0;
            else if (!strcmp(v, "constant")) o.constant_lr = 1;
            else return bad_usage("bad --schedule '%s' (cosine, constant)", v);
        } else if (o.sample && !strcmp(a, "--prompt")) {
            o.prompt = v;
        } else if (o.sample && !strcmp(a, "--length")) {
            if (parse_long(v, 0, 1 << 20, &o.length)) return bad_usage("bad --length '%s'", v);
        } else if (o.sample && !strcmp(a, "--temperature")) {
            if (parse_float(v, &o.temperature) || o.temperature < 0)
                return bad_usage("bad --temperature '%s' (>= 0)", v);
        } else if (!strcmp(a, "--save")) {
            o.save = v;
        } else if (!strcmp(a, "--resume")) {
            o.resume = v;
        } else if (!strcmp(a, "--llmc")) {
            o.llmc = v;
        } else if (!strcmp(a, "--export-llmc")) {
            o.export_llmc = v;
        } else {
            return bad_usage("unknown option '%s'", a);
        }
        i += takes;
    }
    o.batch = batch > 0 ? batch : o.gpt ? 8 : 64;
    if (o.report < 0) o.report = !o.json; /* the memory report unless JSON only is asked for */
    if (o.sample && (!o.gpt || !o.resume))
        return bad_usage("%s", "sample needs --model gpt and --resume FILE (a checkpoint of it)");
    if (!o.gpt && (o.data || o.save || o.resume || o.llmc || o.export_llmc))
        return bad_usage("%s", "--data, --save, --resume, --llmc and --export-llmc train a GPT "
                               "(--model gpt)");
    if (o.gpt && !o.eval_every) o.eval_every = o.every * 4;

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
    int rc = o.gpt ? run_gpt(&o, ctx) : run_mlp(&o, ctx);
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

/* ---- memtrain estimate ---- */

static void usage_estimate(FILE *f)
{
    fprintf(f,
            "usage: memtrain estimate [options]\n"
            "What a training run will hold, per memory class, before it runs (nothing is\n"
            "allocated): the peak of live bytes, each class at that moment and at its own\n"
            "peak, and what the allocators will reserve. With --budget, whether the run\n"
            "fits; with --autofit, the fastest micro-batch, recompute plan and optimizer\n"
            "state that fit.\n"
            "  --model gpt|mlp        (gpt)\n"
            "  --layers N --heads N --channels N --vocab N --max-seq N\n"
            "                         GPT shape (12 12 768 50257 1024: GPT-2 124M)\n"
            "  --hidden N,N,...       MLP hidden sizes (64,64; 2 inputs, 3 classes)\n"
            "  --batch N              rows per step (4)\n"
            "  --seq N                tokens per row (64)\n"
            "  --micro N              rows per micro-batch, 0 = the whole batch (0)\n"
            "  --optimizer sgd|adamw|adamw8|adafactor  (adamw)\n"
            "  --precision fp32|fp16|bf16  (fp32)\n"
            "  --no-master            bf16 weights without fp32 masters\n"
            "  --recompute none|selective|sqrt|every:K|budget  (none)\n"
            "  --fused                the fused backward + optimizer step\n"
            "  --allocator NAME       caching|arena|pool|checkpoint for every class (caching)\n"
            "  --device cpu|cuda      the device the run will use (cpu); cuda needs no GPU\n"
            "  --threads N            CPU threads, 0 = all (0)\n"
            "  --budget MIB           a memory budget (MiB, what the allocators reserve)\n"
            "  --autofit              fit micro-batch, recompute and state to --budget\n"
            "  --allow-8bit           let --autofit use 8-bit AdamW state\n"
            "  --json                 one JSON object instead of the table\n"
            "  --config FILE          options from FILE, a line 'name = value' each (flags: 1/0)\n");
}


static int cmd_estimate(int argc, char **argv)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    mt_mlp_spec ml;
    mt_mlp_spec_init(&ml);
    ml.n_layers = 3, ml.dims[0] = 2, ml.dims[1] = 64, ml.dims[2] = 64, ml.dims[3] = 3;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 4, tc.max_seq = 64, tc.optimizer = MT_OPT_ADAMW;
    int gpt = 1, json = 0, autofit = 0, allow8 = 0;
    long threads = 0;
    const char *alloc = "caching";
    double budget_mib = 0;
    mt_device_kind device = MT_DEVICE_CPU;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        int takes = 1;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage_estimate(stdout);
            return 0;
        } else if (!strcmp(a, "--no-master")) {
            tc.master_weights = 0, takes = 0;
        } else if (!strcmp(a, "--fused")) {
            tc.fused_step = 1, takes = 0;
        } else if (!strcmp(a, "--json")) {
            json = 1, takes = 0;
        } else if (!strcmp(a, "--autofit")) {
            autofit = 1, takes = 0;
        } else if (!strcmp(a, "--allow-8bit")) {
            allow8 = 1, takes = 0;
        } else if (!v) {
            return bad_usage("option '%s' needs a value, or is unknown", a);
        } else if (!strcmp(a, "--model")) {
            if (!strcmp(v, "gpt")) gpt = 1;
            else if (!strcmp(v, "mlp")) gpt = 0;
            else return bad_usage("unknown model '%s' (gpt, mlp)", v);
        } else if (!strcmp(a, "--layers") || !strcmp(a, "--heads") || !strcmp(a, "--channels") ||
                   !strcmp(a, "--vocab") || !strcmp(a, "--max-seq") || !strcmp(a, "--batch") ||
                   !strcmp(a, "--seq") || !strcmp(a, "--micro") || !strcmp(a, "--threads")) {
            if (parse_long(v, !strcmp(a, "--micro") || !strcmp(a, "--threads") ? 0 : 1, 1 << 24, &n))
                return bad_usage("bad value for %s", a);
            if (!strcmp(a, "--layers")) g.layers = (int)n;
            else if (!strcmp(a, "--heads")) g.heads = (int)n;
            else if (!strcmp(a, "--channels")) g.channels = (int)n;
            else if (!strcmp(a, "--vocab")) g.vocab = (int)n;
            else if (!strcmp(a, "--max-seq")) g.max_seq = (int)n;
            else if (!strcmp(a, "--batch")) tc.max_batch = (int)n;
            else if (!strcmp(a, "--seq")) tc.max_seq = (int)n;
            else if (!strcmp(a, "--micro")) tc.micro_batch = (int)n;
            else threads = n;
        } else if (!strcmp(a, "--hidden")) {
            train_opts o = {0};
            if (parse_hidden(v, &o)) return bad_usage("bad --hidden '%s' (sizes like 64,64)", v);
            ml.n_layers = o.n_hidden + 1;
            for (int k = 0; k < o.n_hidden; k++) ml.dims[k + 1] = (int)o.hidden[k];
            ml.dims[o.n_hidden + 1] = 3;
        } else if (!strcmp(a, "--optimizer")) {
            if (parse_optimizer(v, &tc.optimizer))
                return bad_usage("unknown optimizer '%s' (sgd, adamw, adamw8, adafactor)", v);
            tc.momentum = tc.optimizer == MT_OPT_SGD ? 0.9f : 0.0f;
        } else if (!strcmp(a, "--precision")) {
            if (parse_precision(v, &tc.precision))
                return bad_usage("bad --precision '%s' (fp32, fp16, bf16)", v);
        } else if (!strcmp(a, "--recompute")) {
            if (parse_recompute(v, &tc))
                return bad_usage("bad --recompute '%s' (none, selective, sqrt, every:K, budget)", v);
        } else if (!strcmp(a, "--allocator")) {
            if (!mt_allocator_by_name(v)) return bad_usage("unknown allocator '%s'", v);
            alloc = v;
        } else if (!strcmp(a, "--device")) {
            if (parse_device(v, &device) || device == MT_DEVICE_AUTO)
                return bad_usage("bad --device '%s' (cpu, cuda)", v);
        } else if (!strcmp(a, "--budget")) {
            float b;
            if (parse_float(v, &b) || !(b > 0)) return bad_usage("bad --budget '%s' (MiB > 0)", v);
            budget_mib = b;
        } else {
            return bad_usage("unknown option '%s'", a);
        }
        i += takes;
    }
    if (!gpt) tc.max_seq = 0;
    if (autofit && !budget_mib) return bad_usage("%s", "--autofit needs --budget");
    tc.memory_budget = (uint64_t)(budget_mib * 1048576.0);
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = device;
    cc.threads = (int)threads;
    for (int c = 0; c < MT_MEM_COUNT; c++) cc.allocators[c].vtable = mt_allocator_by_name(alloc);
    /* a dry context: the model costs nothing, and auto-fit and the estimate
       run on it */
    mt_context_config dc = cc;
    dc.dry_run = 1;
    mt_context *ctx;
    if (mt_context_create(&dc, &ctx)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(NULL));
        return EXIT_FAIL;
    }
    mt_model *m = NULL;
    mt_status s = gpt ? mt_model_gpt_create(ctx, &g, &m) : mt_model_mlp_create(ctx, &ml, &m);
    mt_autofit_report fit = {0};
    if (!s && autofit) s = mt_trainer_autofit(m, &tc, allow8, &fit);
    mt_estimate_report e;
    if (!s) s = mt_estimate_model(m, &tc, &e);
    int rc = 0;
    if (s) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(ctx));
        rc = s == MT_ERR_BUDGET ? EXIT_BUDGET : EXIT_FAIL;
    } else if (json) {
        printf("{\"params\": %zu, \"peak\": %llu, \"peak_reserved\": %llu, \"step_peak\": %llu, "
               "\"setup_peak\": %llu, \"at_peak\": {",
               e.n_params, (unsigned long long)e.peak, (unsigned long long)e.peak_reserved,
               (unsigned long long)e.step_peak, (unsigned long long)e.setup_peak);
        for (int c = 0; c < MT_MEM_COUNT; c++)
            printf("%s\"%s\": %llu", c ? ", " : "", mt_mem_class_name((mt_mem_class)c),
                   (unsigned long long)e.at_peak[c]);
        printf("}, \"class_peak\": {");
        for (int c = 0; c < MT_MEM_COUNT; c++)
            printf("%s\"%s\": %llu", c ? ", " : "", mt_mem_class_name((mt_mem_class)c),
                   (unsigned long long)e.class_peak[c]);
        printf("}");
        if (tc.memory_budget)
            printf(", \"budget\": %llu, \"fits\": %s", (unsigned long long)tc.memory_budget,
                   e.peak_reserved <= tc.memory_budget ? "true" : "false");
        if (autofit)
            printf(", \"autofit\": {\"micro_batch\": %d, \"optimizer\": \"%s\", "
                   "\"recomputed_units\": %d, \"selective_units\": %d, \"units\": %d, "
                   "\"model_tokens_per_second\": %.1f}",
                   fit.micro_batch, fit.optimizer == MT_OPT_ADAMW8 ? "adamw8" : "as configured",
                   fit.recomputed_units, fit.selective_units, fit.units, fit.tokens_per_second);
        printf("}\n");
    } else {
        if (gpt)
            printf("estimate for a GPT (%zu parameters), batch %d x %d tokens\n", e.n_params,
                   tc.max_batch, tc.max_seq);
        else
            printf("estimate for an MLP (%zu parameters), batch %d\n", e.n_params, tc.max_batch);
        if (autofit)
            printf("auto-fit for %.1f MiB: micro-batches of %d rows, %s, %d of %d units "
                   "recomputed, %d selective (model: %.0f tokens/s)\n",
                   budget_mib, fit.micro_batch,
                   fit.optimizer == MT_OPT_ADAMW8 ? "8-bit AdamW" : "the configured optimizer",
                   fit.recomputed_units, fit.units, fit.selective_units, fit.tokens_per_second);
        printf("%-7s %14s %14s\n", "class", "at the peak", "own peak");
        for (int c = 0; c < MT_MEM_COUNT; c++)
            printf("%-7s %10.2f MiB %10.2f MiB\n", mt_mem_class_name((mt_mem_class)c),
                   (double)e.at_peak[c] / 1048576.0, (double)e.class_peak[c] / 1048576.0);
        printf("peak %.2f MiB (steps %.2f, setup %.2f); the allocators reserve %.2f MiB at most\n",
               (double)e.peak / 1048576.0, (double)e.step_peak / 1048576.0,
               (double)e.setup_peak / 1048576.0, (double)e.peak_reserved / 1048576.0);
        if (tc.memory_budget)
            printf("budget %.1f MiB: %s\n", budget_mib,
                   e.peak_reserved <= tc.memory_budget ? "fits" : "does not fit");
    }
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return rc;
}

/* ---- report ---- */

static int cmd_report(int argc, char **argv)
{
    const char *path = NULL, *chrome = NULL, *svg = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: memtrain report TRACE [--chrome FILE] [--svg FILE]\n"
                   "What an allocation trace (train --trace) shows: events, the peak of live\n"
                   "bytes and when, each class at the peak and at its own peak; and the trace\n"
                   "as Chrome trace JSON (Perfetto) and as an SVG plot of memory by class.\n");
            return 0;
        } else if (!strcmp(a, "--chrome") || !strcmp(a, "--svg")) {
            if (!v) return bad_usage("option '%s' needs a value, or is unknown", a);
            if (a[2] == 'c') chrome = v;
            else svg = v;
            i++;
        } else if (a[0] == '-') {
            return bad_usage("unknown option '%s'", a);
        } else if (!path) {
            path = a;
        } else {
            return bad_usage("unexpected argument '%s'", a);
        }
    }
    if (!path) return bad_usage("%s", "report needs a trace file");
    mt_trace *tr;
    if (mt_trace_load(NULL, path, &tr)) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(NULL));
        return EXIT_FAIL;
    }
    mt_trace_summary sm;
    int rc = 0;
    if (mt_trace_summarize(NULL, tr, &sm) || (chrome && mt_trace_export_chrome(NULL, tr, NULL, chrome)) ||
        (svg && mt_trace_export_svg(NULL, tr, NULL, svg))) {
        fprintf(stderr, "%s: %s\n", prog, mt_last_error(NULL));
        rc = EXIT_FAIL;
    } else {
        printf("%s: %zu events over %.3f ms (%llu allocations, %llu frees, %llu resets, %llu "
               "failed; %llu dropped)\n",
               path, sm.events, (double)sm.span_ns / 1e6, (unsigned long long)sm.allocs,
               (unsigned long long)sm.frees, (unsigned long long)sm.resets,
               (unsigned long long)sm.failed, (unsigned long long)sm.dropped);
        printf("peak %.2f MiB of live bytes at %.3f ms\n", (double)sm.peak / 1048576.0,
               (double)sm.peak_ns / 1e6);
        printf("%-7s %14s %14s\n", "class", "at the peak", "own peak");
        for (int c = 0; c < MT_MEM_COUNT; c++)
            printf("%-7s %10.2f MiB %10.2f MiB\n", mt_mem_class_name((mt_mem_class)c),
                   (double)sm.at_peak[c] / 1048576.0, (double)sm.class_peak[c] / 1048576.0);
        if (chrome) printf("Chrome trace JSON written to %s\n", chrome);
        if (svg) printf("SVG plot written to %s\n", svg);
    }
    mt_trace_free(tr);
    return rc;
}

static int cmd_sample(int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: memtrain sample --model gpt --resume FILE [train options] [--prompt TEXT]\n"
                   "                       [--length N] [--temperature X]\n"
                   "Text from a GPT trained with 'memtrain train --model gpt --save FILE': give\n"
                   "the same model, data and training options (or the same --config) as the run.\n"
                   "  --prompt TEXT          the start (a newline)\n"
                   "  --length N             bytes to write (200)\n"
                   "  --temperature X        0: the most likely byte each time (0.8)\n"
                   "  --seed N               the draws (1)\n");
            return 0;
        }
    sampling = 1;
    return cmd_train(argc, argv);
}

/* Runs cmd with the options of a --config FILE (key = value lines, the same
 * names) first and the command line's after them, so the command line
 * overrides the file. */
static int with_config(int argc, char **argv, int (*cmd)(int, char **))
{
    const char *path = NULL;
    int at = -1;
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) return bad_usage("%s", "--config needs a file");
            if (path) return bad_usage("%s", "--config given twice");
            path = argv[i + 1], at = i;
        }
    if (!path) return cmd(argc, argv);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: cannot open %s: %s\n", prog, path, strerror(errno));
        return EXIT_FAIL;
    }
    char *text = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 4096;
            if (cap > ((size_t)1 << 24)) {
                fclose(f);
                free(text);
                fprintf(stderr, "%s: %s: larger than 16 MiB\n", prog, path);
                return EXIT_FAIL;
            }
            char *t = realloc(text, cap);
            if (!t) break;
            text = t;
        }
        size_t got = fread(text + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    fclose(f);
    cfg_args a;
    char err[256];
    int rc = cfg_parse(text ? text : "", n, path, &a, err, sizeof err);
    free(text);
    if (rc) {
        fprintf(stderr, "%s: %s\n(run 'memtrain --help')\n", prog, err);
        return EXIT_USAGE;
    }
    char **all = malloc(((size_t)a.argc + (size_t)argc + 1) * sizeof *all);
    if (!all) {
        cfg_args_free(&a);
        return EXIT_FAIL;
    }
    int k = 0;
    for (int i = 0; i < a.argc; i++) all[k++] = a.argv[i];
    for (int i = 0; i < argc; i++)
        if (i != at && i != at + 1) all[k++] = argv[i];
    all[k] = NULL;
    rc = cmd(k, all);
    free(all);
    cfg_args_free(&a);
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
    if (!strcmp(cmd, "train")) return with_config(argc - 2, argv + 2, cmd_train);
    if (!strcmp(cmd, "replay")) return cmd_replay(argc - 2, argv + 2);
    if (!strcmp(cmd, "estimate")) return with_config(argc - 2, argv + 2, cmd_estimate);
    if (!strcmp(cmd, "sample")) return with_config(argc - 2, argv + 2, cmd_sample);
    if (!strcmp(cmd, "report")) return cmd_report(argc - 2, argv + 2);
    return bad_usage("unknown command '%s'", cmd);
}
