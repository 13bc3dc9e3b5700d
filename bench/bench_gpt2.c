/*
 * bench_gpt2.c - GPT-2 training steps on the CPU, timed, with the memory
 * they take; the memtrain side of bench/gpt2_side_by_side.sh, whose other
 * side is bench/torch_gpt2.py.
 *
 * It prints one JSON line with the keys torch_gpt2.py prints where they
 * mean the same (impl, threads, B, T, params, ms_per_step_median,
 * ms_per_step_min, peak_rss_mib, rss_before_model_mib, losses, ...), plus
 * what the library accounted: the peak of live bytes of each memory class,
 * and the peak live / peak reserved bytes of the whole context, in MiB.
 *
 *   bench_gpt2 [--vocab V] [--padded-vocab Vp] [--max-seq T] [--layers L]
 *              [--heads H] [--channels C] [--batch B] [--seq T]
 *              [--steps N] [--warmup N] [--threads N] [--seed S]
 *              [--precision fp32|bf16|fp16] [--optimizer adamw|adamw8|adamw4|adafactor|sgd]
 *              [--lr X] [--wd X] [--fused] [--recompute none|sqrt|selective|every:K]
 *              [--no-master] [--micro N] [--tokens FILE] [--llmc-checkpoint FILE]
 *              [--allocator caching|arena|pool|checkpoint] [--profile] [--device cpu|cuda]
 *              [--lora R] [--lora-targets P,P,...] [--base full|int8|nf4]
 *   bench_gpt2 --gemm [shape flags] [--batch B] [--seq T] [--threads N]
 *
 * A step is one mt_trainer_step (forward, backward, optimizer); times are
 * over --steps steps after --warmup untimed ones; losses holds every step's
 * loss, warmup first, each computed before that step's update. peak_rss_mib
 * is ru_maxrss at the end; rss_before_model_mib is ru_maxrss once the
 * context exists and before the model is made or loaded.
 *
 * Data: an llm.c token file (--tokens: 256 int32 header, [0] 20240520,
 * [1] 1, [2] the number of tokens, then uint16 tokens). Batches follow each
 * other B*T tokens apart, inputs tokens[p .. p+B*T) and targets shifted by
 * one, back to the start when the file runs out (as torch_gpt2.py reads
 * it). Without --tokens, uniform random tokens from --seed.
 *
 * Weights: an llm.c fp32 checkpoint (--llmc-checkpoint; its header sets the
 * shape, the shape flags are then ignored), else GPT-2 init from --seed.
 *
 * Optimizers: AdamW and 8-bit AdamW with betas (0.9, 0.999), eps 1e-8,
 * --lr, --wd (decoupled); SGD without momentum; Adafactor with
 * transformers' defaults, whose relative step size leaves --lr unused.
 * --allocator puts every memory class on one instance of that allocator.
 * --device cuda trains on the GPU (the mem_* figures are then device
 * memory; MT_FAKE_CUDA and MT_FAKE_CUBLASLT, the test suite's stand-ins,
 * run it without one, computing nothing).
 * --no-master: bf16 without fp32 master weights (mt_trainer_config
 * .master_weights = 0).
 * --lora R: LoRA adapters of rank R (alpha 2R) on the weights
 * --lora-targets names (every linear weight), the base frozen.
 * --base int8|nf4 (with --lora): the base's linear weights quantized as the
 * model is made or loaded, one tensor at a time (mt_gpt_spec.base,
 * mt_model_gpt_load_base), and the trainer's cfg.base to match.
 *
 * --gemm measures oneDNN's fp32 matmul instead: the GEMMs of one training
 * step at the given shape (every linear layer's forward x W^T, backward dY W
 * and dY^T X, L blocks and the LM head), each one whole-matrix matmul
 * threaded by oneDNN over --threads threads, and prints their total FLOP and
 * the rate. *
 * --profile adds the time of every op of the op table, in ms per measured
 * step (wall clock around each call: profile_ms_per_step), its calls per
 * step (profile_calls_per_step) and their sum (profile_ops_ms_per_step);
 * the rest of a step is the engine's own work (against ms_per_step_mean,
 * the mean step: the profile is a mean too). It also prints to stderr a
 * table of op families, each with its share of the mean step.
 * On CUDA, --profile turns on cuda_debug_sync (every kernel launch waited
 * for), so each op's time is its kernels' time, not the launch's; the step
 * is then slower than without --profile by the waits.
 *
 * Errors print a message and exit 1; an optimizer or precision the library
 * does not have yet gives a message starting "unsupported:".
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <memtrain.h>
#include "common.h"
#include "dnnl_direct.h"
#include "op_profile.h"

#define TOKENS_MAGIC 20240520
#define TOKENS_VERSION 1
#define HEADER_INTS 256

typedef struct options {
    int vocab, padded_vocab, max_seq, layers, heads, channels;
    int batch, seq, steps, warmup, threads, micro, recompute_every;
    uint64_t seed;
    float lr, wd;
    int fused, gemm, no_master, profile, lora;
    const char *lora_targets;
    mt_base_format base;
    const char *precision, *optimizer, *recompute, *tokens, *checkpoint, *allocator, *device;
} options;

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("bench_gpt2: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

/* A failed library call: "unsupported: ..." for MT_ERR_UNSUPPORTED, so a
 * driver can tell a missing feature from a failure. */
static void die_status(mt_context *ctx, const char *what, mt_status s)
{
    if (s == MT_ERR_UNSUPPORTED)
        fprintf(stderr, "unsupported: %s: %s\n", what, mt_last_error(ctx));
    else
        fprintf(stderr, "bench_gpt2: %s: %s (%s)\n", what, mt_status_string(s),
                mt_last_error(ctx));
    exit(1);
}

static double rss_max_mib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0; /* KiB on Linux */
}

static uint64_t rng_state;
static uint64_t rnd(void) /* xorshift64* */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

/* ---- arguments ---- */

static long parse_long(const char *flag, const char *v, long lo, long hi)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        die("%s wants an integer in [%ld, %ld], got '%s'", flag, lo, hi, v);
    return x;
}

static float parse_float(const char *flag, const char *v)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !isfinite(x) || x < 0)
        die("%s wants a finite number >= 0, got '%s'", flag, v);
    return (float)x;
}

static void usage(void)
{
    fputs("usage: bench_gpt2 [--vocab V] [--padded-vocab Vp] [--max-seq T] [--layers L]\n"
          "                  [--heads H] [--channels C] [--batch B] [--seq T] [--steps N]\n"
          "                  [--warmup N] [--threads N] [--seed S] [--precision fp32|bf16|fp16]\n"
          "                  [--optimizer adamw|adamw8|adamw4|adafactor|sgd] [--lr X] [--wd X]\n"
          "                  [--fused] [--recompute none|sqrt|selective|every:K] [--no-master]\n"
          "                  [--micro N]"
          " [--tokens FILE] [--llmc-checkpoint FILE] [--allocator NAME] [--profile]\n"
          "                  [--device cpu|cuda] [--lora R] [--lora-targets P,P,...]\n"
          "                  [--base full|int8|nf4]\n"
          "       bench_gpt2 --gemm [shape flags] [--batch B] [--seq T] [--threads N]\n",
          stderr);
}

static void parse(int argc, char **argv, options *o)
{
    *o = (options){.vocab = 50257, .padded_vocab = 0, .max_seq = 1024, .layers = 12,
                   .heads = 12, .channels = 768, .batch = 4, .seq = 64, .steps = 10,
                   .warmup = 2, .threads = 0, .seed = 1234, .lr = 3e-4f, .wd = 0.0f,
                   .precision = "fp32", .optimizer = "adamw", .recompute = "none"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            exit(0);
        }
        if (!strcmp(a, "--fused")) {
            o->fused = 1;
            continue;
        }
        if (!strcmp(a, "--gemm")) {
            o->gemm = 1;
            continue;
        }
        if (!strcmp(a, "--no-master")) {
            o->no_master = 1;
            continue;
        }
        if (!strcmp(a, "--profile")) {
            o->profile = 1;
            continue;
        }
        if (i + 1 >= argc) {
            usage();
            die("unknown flag or missing value: '%s'", a);
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--vocab")) o->vocab = (int)parse_long(a, v, 1, INT_MAX);
        else if (!strcmp(a, "--padded-vocab")) o->padded_vocab = (int)parse_long(a, v, 0, INT_MAX);
        else if (!strcmp(a, "--max-seq")) o->max_seq = (int)parse_long(a, v, 1, INT_MAX);
        else if (!strcmp(a, "--layers")) o->layers = (int)parse_long(a, v, 1, INT_MAX);
        else if (!strcmp(a, "--heads")) o->heads = (int)parse_long(a, v, 1, INT_MAX);
        else if (!strcmp(a, "--channels")) o->channels = (int)parse_long(a, v, 1, INT_MAX);
        else if (!strcmp(a, "--batch")) o->batch = (int)parse_long(a, v, 1, INT_MAX);
        else if (!strcmp(a, "--seq")) o->seq = (int)parse_long(a, v, 1, INT_MAX);
        else if (!strcmp(a, "--steps")) o->steps = (int)parse_long(a, v, 1, 1000000);
        else if (!strcmp(a, "--warmup")) o->warmup = (int)parse_long(a, v, 0, 1000000);
        else if (!strcmp(a, "--threads")) o->threads = (int)parse_long(a, v, 1, 4096);
        else if (!strcmp(a, "--micro")) o->micro = (int)parse_long(a, v, 0, INT_MAX);
        else if (!strcmp(a, "--seed")) o->seed = (uint64_t)parse_long(a, v, 0, LONG_MAX);
        else if (!strcmp(a, "--lr")) o->lr = parse_float(a, v);
        else if (!strcmp(a, "--wd")) o->wd = parse_float(a, v);
        else if (!strcmp(a, "--precision")) o->precision = v;
        else if (!strcmp(a, "--optimizer")) o->optimizer = v;
        else if (!strcmp(a, "--recompute")) o->recompute = v;
        else if (!strcmp(a, "--tokens")) o->tokens = v;
        else if (!strcmp(a, "--llmc-checkpoint")) o->checkpoint = v;
        else if (!strcmp(a, "--allocator")) o->allocator = v;
        else if (!strcmp(a, "--lora")) o->lora = (int)parse_long(a, v, 0, 4096);
        else if (!strcmp(a, "--lora-targets")) o->lora_targets = v;
        else if (!strcmp(a, "--base")) {
            o->base = !strcmp(v, "int8") ? MT_BASE_INT8 : !strcmp(v, "nf4") ? MT_BASE_NF4
                                                                            : MT_BASE_FULL;
            if (strcmp(v, mt_base_format_name(o->base))) die("--base: full, int8 or nf4, not %s", v);
        }
        else if (!strcmp(a, "--device") && (!strcmp(v, "cpu") || !strcmp(v, "cuda"))) o->device = v;
        else {
            usage();
            die("unknown flag '%s'", a);
        }
    }
    if (o->threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        o->threads = n > 0 ? (int)n : 1;
    }
}

static void trainer_config(const options *o, mt_trainer_config *tc)
{
    mt_trainer_config_init(tc);
    tc->max_batch = o->batch;
    tc->micro_batch = o->micro;
    tc->max_seq = o->seq;
    tc->lr = o->lr;
    tc->weight_decay = o->wd;
    tc->fused_step = o->fused;
    tc->lora.rank = o->lora;
    tc->lora.alpha = 2.0f * (float)o->lora;
    tc->lora.targets = o->lora_targets;
    tc->base = o->base;
    if (o->no_master) tc->master_weights = 0;
    if (mt_optimizer_by_name(o->optimizer, &tc->optimizer))
        die("--optimizer: %s", mt_last_error(NULL));
    if (!strcmp(o->precision, "fp32")) tc->precision = MT_PREC_FP32;
    else if (!strcmp(o->precision, "bf16")) tc->precision = MT_PREC_BF16;
    else if (!strcmp(o->precision, "fp16")) tc->precision = MT_PREC_FP16;
    else die("--precision: '%s' is not fp32, bf16 or fp16", o->precision);
    const char *r = o->recompute;
    if (!strcmp(r, "none")) tc->recompute = MT_RECOMPUTE_NONE;
    else if (!strcmp(r, "sqrt")) tc->recompute = MT_RECOMPUTE_SQRT;
    else if (!strcmp(r, "selective")) tc->recompute = MT_RECOMPUTE_SELECTIVE;
    else if (!strncmp(r, "every:", 6)) {
        tc->recompute = MT_RECOMPUTE_EVERY_K;
        tc->recompute_every = (int)parse_long("--recompute every:", r + 6, 1, INT_MAX);
    } else
        die("--recompute: '%s' is not none, sqrt, selective or every:K", r);
}

/* ---- data ---- */

/* The tokens of an llm.c token file as int32 (so that batches point into
 * it); *n gets their number, *max the largest. */
static int32_t *read_tokens(const char *path, size_t *n, int32_t *max)
{
    FILE *f = fopen(path, "rb");
    if (!f) die("--tokens: cannot open '%s': %s", path, strerror(errno));
    int32_t h[HEADER_INTS];
    if (fread(h, sizeof *h, HEADER_INTS, f) != HEADER_INTS)
        die("--tokens: '%s' is shorter than its 1024-byte header", path);
    if (h[0] != TOKENS_MAGIC || h[1] != TOKENS_VERSION)
        die("--tokens: '%s' is not an llm.c token file (magic %d, version %d)", path, h[0], h[1]);
    if (h[2] < 0) die("--tokens: '%s' says it holds %d tokens", path, h[2]);
    size_t count = (size_t)h[2];
    uint16_t *raw = malloc(count * sizeof *raw + 1);
    int32_t *tok = malloc(count * sizeof *tok + 1);
    if (!raw || !tok) die("--tokens: out of memory for %zu tokens", count);
    if (fread(raw, sizeof *raw, count, f) != count)
        die("--tokens: '%s' is truncated: its header says %zu tokens", path, count);
    if (fgetc(f) != EOF) die("--tokens: '%s' is longer than its header says", path);
    fclose(f);
    int32_t hi = 0;
    for (size_t i = 0; i < count; i++) {
        tok[i] = raw[i];
        hi = tok[i] > hi ? tok[i] : hi;
    }
    free(raw);
    *n = count;
    *max = hi;
    return tok;
}

/* ---- the training run ---- */

/* A string as a JSON string literal (file names may hold any byte). */
static void print_json_string(const char *s)
{
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20) printf("\\u%04x", *p);
        else putchar(*p);
    }
    putchar('"');
}

static void print_losses(const float *loss, int n)
{
    printf("\"losses\": [");
    for (int i = 0; i < n; i++) printf("%s%.6f", i ? ", " : "", (double)loss[i]);
    printf("]");
}

static int train(const options *o)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = o->threads;
    if (o->device && !strcmp(o->device, "cuda")) {
        cc.device = MT_DEVICE_CUDA; /* the test suite's stand-ins where they are named */
        cc.cuda_driver_path = getenv("MT_FAKE_CUDA");
        cc.cublaslt_path = getenv("MT_FAKE_CUBLASLT");
    }
    if (o->allocator) {
        const mt_allocator_vtable *vt = mt_allocator_by_name(o->allocator);
        if (!vt)
            die("--allocator: '%s' is not caching, arena, pool or checkpoint", o->allocator);
        for (int c = 0; c < MT_MEM_COUNT; c++) cc.allocators[c].vtable = vt;
    }
    /* kernels run asynchronously: timing an op's call on the host measures
     * its launch unless every launch is waited for */
    if (o->profile && cc.device == MT_DEVICE_CUDA) cc.cuda_debug_sync = 1;
    mt_trainer_config tc;
    trainer_config(o, &tc);

    mt_context *ctx;
    mt_status s = mt_context_create(&cc, &ctx);
    if (s) die_status(NULL, "mt_context_create", s);
    if (o->profile) prof_install(ctx);
    double rss_before = rss_max_mib();

    /* a bad token file is reported before the model is built */
    size_t per_batch = (size_t)o->batch * (size_t)o->seq, ntok = 0;
    int32_t *tok = NULL, tok_max = 0;
    if (o->tokens) {
        tok = read_tokens(o->tokens, &ntok, &tok_max);
        if (ntok < per_batch + 1)
            die("--tokens: the file holds %zu tokens, one batch needs %zu", ntok, per_batch + 1);
    }

    mt_model *m;
    if (o->checkpoint) {
        s = mt_model_gpt_load_base(ctx, o->checkpoint, o->base, &m);
        if (s) die_status(ctx, "mt_model_gpt_load", s);
    } else {
        mt_gpt_spec sp;
        mt_gpt_spec_init(&sp);
        sp.vocab = o->vocab, sp.padded_vocab = o->padded_vocab, sp.max_seq = o->max_seq;
        sp.layers = o->layers, sp.heads = o->heads, sp.channels = o->channels;
        sp.seed = o->seed, sp.base = o->base;
        s = mt_model_gpt_create(ctx, &sp, &m);
        if (s) die_status(ctx, "mt_model_gpt_create", s);
    }
    mt_gpt_spec sp;
    s = mt_model_gpt_get_spec(m, &sp);
    if (s) die_status(ctx, "mt_model_gpt_get_spec", s);
    if (o->seq > sp.max_seq) die("--seq %d is longer than the model's %d", o->seq, sp.max_seq);

    int nsteps = o->warmup + o->steps;
    if (o->tokens) {
        if (tok_max >= sp.vocab)
            die("--tokens: token %d is outside the model's vocabulary (%d)", tok_max, sp.vocab);
    } else {
        ntok = (size_t)nsteps * per_batch + 1;
        tok = malloc(ntok * sizeof *tok);
        if (!tok) die("out of memory for %zu tokens", ntok);
        rng_state = o->seed * 0x9E3779B97F4A7C15ull + 1;
        for (size_t i = 0; i < ntok; i++) tok[i] = (int32_t)(rnd() % (uint64_t)sp.vocab);
    }

    /* the estimate, made before the trainer, to set beside the measured run */
    mt_estimate_report est;
    double e0 = now_s();
    s = mt_estimate_model(m, &tc, &est);
    double est_ms = 1e3 * (now_s() - e0);
    if (s) die_status(ctx, "mt_estimate_model", s);

    mt_trainer *t;
    s = mt_trainer_create(m, &tc, &t);
    if (s) die_status(ctx, "mt_trainer_create", s);

    float *loss = calloc((size_t)nsteps, sizeof *loss);
    double *ms = calloc((size_t)o->steps, sizeof *ms);
    if (!loss || !ms) die("out of memory");
    size_t pos = 0;
    for (int i = 0; i < nsteps; i++) {
        if (pos + per_batch + 1 > ntok) pos = 0;
        mt_batch b = {.n = o->batch, .tokens = tok + pos, .targets = tok + pos + 1,
                      .seq_len = o->seq};
        pos += per_batch;
        if (i == o->warmup) prof_reset();
        double t0 = now_s();
        s = mt_trainer_step(t, &b, &loss[i]);
        double t1 = now_s();
        if (s) die_status(ctx, "mt_trainer_step", s);
        if (i >= o->warmup) ms[i - o->warmup] = 1e3 * (t1 - t0);
    }
    double peak_rss = rss_max_mib();
    mt_memory_stats ms_;
    s = mt_context_memory_stats(ctx, &ms_);
    if (s) die_status(ctx, "mt_context_memory_stats", s);

    double ms_min = ms[0];
    for (int i = 1; i < o->steps; i++) ms_min = ms[i] < ms_min ? ms[i] : ms_min;
    double ms_mean = 0.0;
    for (int i = 0; i < o->steps; i++) ms_mean += ms[i] / o->steps;
    double ms_med = median(ms, o->steps);
    const double MiB = 1024.0 * 1024.0;

    printf("{\"impl\": \"memtrain\", \"memtrain\": \"%s\", \"threads\": %d, \"B\": %d, "
           "\"T\": %d, \"params\": %zu, \"ms_per_step_median\": %.3f, \"ms_per_step_min\": %.3f, "
           "\"ms_per_step_mean\": %.3f, \"peak_rss_mib\": %.1f, \"rss_before_model_mib\": %.1f, ",
           mt_version(), o->threads, o->batch, o->seq, mt_model_num_params(m), ms_med, ms_min,
           ms_mean, peak_rss, rss_before);
    print_losses(loss, nsteps);
    printf(", ");
    if (o->profile) prof_print(stdout, o->steps);
    printf("\"steps\": %d, \"warmup\": %d, \"config\": {\"V\": %d, \"Vp\": %d, \"maxT\": %d, "
           "\"L\": %d, \"H\": %d, \"C\": %d}, ",
           o->steps, o->warmup, sp.vocab, sp.padded_vocab, sp.max_seq, sp.layers, sp.heads,
           sp.channels);
    printf("\"optimizer\": \"%s\", \"lr\": %g, \"weight_decay\": %g, \"precision\": \"%s\", "
           "\"recompute\": \"%s\", \"fused\": %s, \"master_weights\": %s, \"micro\": %d, "
           "\"allocator\": \"%s\", \"lora\": %d, \"base\": \"%s\", ",
           o->optimizer, (double)o->lr, (double)o->wd, o->precision, o->recompute,
           o->fused ? "true" : "false", tc.master_weights ? "true" : "false", o->micro,
           o->allocator ? o->allocator : "default", o->lora, mt_base_format_name(o->base));
    printf("\"mem_peak_mib\": {");
    for (int c = 0; c < MT_MEM_COUNT; c++)
        printf("%s\"%s\": %.2f", c ? ", " : "", mt_mem_class_name((mt_mem_class)c),
               (double)ms_.per_class[c].peak_live_bytes / MiB);
    printf("}, \"mem_peak_live_mib\": %.2f, \"mem_peak_reserved_mib\": %.2f, ",
           (double)ms_.peak_live_bytes / MiB, (double)ms_.peak_reserved_bytes / MiB);
    printf("\"estimate\": {\"peak_mib\": %.2f, \"reserved_mib\": %.2f, "
           "\"step_peak_mib\": %.2f, \"ms\": %.1f}, ",
           (double)est.peak / MiB, (double)est.peak_reserved / MiB, (double)est.step_peak / MiB,
           est_ms);
    char init[64], data[64];
    snprintf(init, sizeof init, "gpt2 seed=%llu", (unsigned long long)o->seed);
    snprintf(data, sizeof data, "random seed=%llu", (unsigned long long)o->seed);
    printf("\"init\": ");
    print_json_string(o->checkpoint ? o->checkpoint : init);
    printf(", \"data\": ");
    print_json_string(o->tokens ? o->tokens : data);
    printf("}\n");
    fflush(stdout);
    if (o->profile) {
        char title[256];
        snprintf(title, sizeof title, "%s, %s%s%s%s%s, B%d T%d, %d threads", o->precision,
                 o->optimizer, o->no_master ? ", no masters" : "", o->fused ? ", fused" : "",
                 strcmp(o->recompute, "none") ? ", recompute " : "",
                 strcmp(o->recompute, "none") ? o->recompute : "", o->batch, o->seq, o->threads);
        prof_table(stderr, o->steps, ms_mean, title);
    }

    free(loss);
    free(ms);
    free(tok);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return 0;
}

/* ---- oneDNN's fp32 rate at the step's GEMM shapes ---- */

typedef struct gemm_shape {
    int in, out, count; /* a linear layer (in -> out) that appears `count` times per step */
} gemm_shape;

static float *randoms(size_t n)
{
    float *p = malloc(n * sizeof *p);
    if (!p) die("out of memory for %zu floats", n);
    for (size_t i = 0; i < n; i++) p[i] = (float)((double)(rnd() >> 11) / 9007199254740992.0 - 0.5);
    return p;
}

/* Seconds for one layer's three GEMMs (forward, dX, dW), N rows. */
static double gemm_layer(const dd_mm *g, const float *x, const float *w, const float *dy, float *y,
                         float *dx, float *dw)
{
    double t0 = now_s();
    dd_run(&g[0], x, w, y, NULL);   /* y (N,out) = x (N,in) W^T, W (out,in) */
    dd_run(&g[1], dy, w, dx, NULL); /* dx (N,in) = dy (N,out) W */
    dd_run(&g[2], dy, x, dw, NULL); /* dW (out,in) += dy^T x */
    return now_s() - t0;
}

static int gemm_rate(const options *o)
{
    int C = o->channels, L = o->layers, N = o->batch * o->seq;
    int Vp = o->padded_vocab ? o->padded_vocab : (o->vocab + 127) / 128 * 128;
    const gemm_shape shapes[] = {{C, 3 * C, L}, {C, C, L}, {C, 4 * C, L}, {4 * C, C, L},
                                 {C, Vp, 1}};
    const int n_shapes = (int)(sizeof shapes / sizeof *shapes), reps = 5;
    omp_set_num_threads(o->threads);
    rng_state = o->seed * 0x9E3779B97F4A7C15ull + 1;
    double flop = 0.0, seconds = 0.0;
    const dnnl_version_t *ver = dnnl_version();
    printf("{\"impl\": \"onednn-gemm\", \"onednn\": \"oneDNN %d.%d.%d\", \"threads\": %d, "
           "\"N\": %d, \"shapes\": [",
           ver->major, ver->minor, ver->patch, o->threads, N);
    for (int i = 0; i < n_shapes; i++) {
        int in = shapes[i].in, out = shapes[i].out;
        float *x = randoms((size_t)N * in), *w = randoms((size_t)out * in),
              *dy = randoms((size_t)N * out), *y = randoms((size_t)N * out),
              *dx = randoms((size_t)N * in), *dw = randoms((size_t)out * in);
        double t[8];
        dd_mm g[3];
        dd_make(&g[0], N, out, in, 0, 1, dnnl_f32, dnnl_f32, 0, 0);
        dd_make(&g[1], N, in, out, 0, 0, dnnl_f32, dnnl_f32, 0, 0);
        dd_make(&g[2], out, in, N, 1, 0, dnnl_f32, dnnl_f32, 0, 1);
        gemm_layer(g, x, w, dy, y, dx, dw); /* warm the caches and threads */
        for (int r = 0; r < reps; r++) t[r] = gemm_layer(g, x, w, dy, y, dx, dw);
        for (int k = 0; k < 3; k++) dd_free(&g[k]);
        double sec = median(t, reps), f = 6.0 * N * (double)in * out;
        printf("%s{\"in\": %d, \"out\": %d, \"count\": %d, \"ms\": %.3f, \"gflops\": %.1f}",
               i ? ", " : "", in, out, shapes[i].count, 1e3 * sec, 1e-9 * f / sec);
        flop += f * shapes[i].count;
        seconds += sec * shapes[i].count;
        free(x), free(w), free(dy), free(y), free(dx), free(dw);
    }
    printf("], \"step_gemm_gflop\": %.3f, \"step_gemm_ms\": %.3f, \"gflops\": %.2f}\n",
           1e-9 * flop, 1e3 * seconds, 1e-9 * flop / seconds);
    return 0;
}

int main(int argc, char **argv)
{
    options o;
    parse(argc, argv, &o);
    return o.gemm ? gemm_rate(&o) : train(&o);
}
