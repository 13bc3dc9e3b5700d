/*
 * cli_options.c - the options of memtrain train, sample and estimate: one
 * table (name, the commands and models it is for, how its value is read,
 * its help line), the parser over it, the usage text made from it, and the
 * library configurations the options give.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "memtrain/allocator.h"

const char *const cli_prog = "memtrain";

int cli_bad_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", cli_prog);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(run '%s --help')\n", cli_prog);
    return EXIT_USAGE;
}

int cli_lib_fail(mt_context *ctx, const char *what)
{
    const char *msg = mt_last_error(ctx);
    if (ctx && !msg[0]) msg = mt_last_error(NULL);
    if (what) fprintf(stderr, "%s: %s: %s\n", cli_prog, what, msg);
    else fprintf(stderr, "%s: %s\n", cli_prog, msg);
    return EXIT_FAIL;
}

int cli_parse_long(const char *s, long lo, long hi, long *out)
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

int cli_parse_device(const char *s, mt_device_kind *out)
{
    if (!strcmp(s, "cpu")) *out = MT_DEVICE_CPU;
    else if (!strcmp(s, "cuda")) *out = MT_DEVICE_CUDA;
    else if (!strcmp(s, "auto")) *out = MT_DEVICE_AUTO;
    else return -1;
    return 0;
}

/* ---- the value readers of the table's custom options: 0, or -1 for a bad value ---- */

static int set_model(cli_opts *o, const char *v)
{
    if (!strcmp(v, "mlp")) o->gpt = 0;
    else if (!strcmp(v, "gpt")) o->gpt = 1;
    else return -1;
    return 0;
}

static int set_hidden(cli_opts *o, const char *s)
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

static int set_activation(cli_opts *o, const char *v)
{
    if (!strcmp(v, "relu")) o->act = MT_ACT_RELU;
    else if (!strcmp(v, "gelu")) o->act = MT_ACT_GELU;
    else return -1;
    return 0;
}

static int set_device(cli_opts *o, const char *v)
{
    if (cli_parse_device(v, &o->device)) return -1;
    return o->cmd == CLI_ESTIMATE && o->device == MT_DEVICE_AUTO ? -1 : 0;
}

static int set_precision(cli_opts *o, const char *v)
{
    if (!strcmp(v, "fp32")) o->precision = MT_PREC_FP32;
    else if (!strcmp(v, "fp16")) o->precision = MT_PREC_FP16;
    else if (!strcmp(v, "bf16")) o->precision = MT_PREC_BF16;
    else return -1;
    return 0;
}

/* The i-th built-in allocator's name (the library's table); NULL past the
 * last. */
static const char *allocator_value(int i)
{
    const mt_allocator_vtable *vt = mt_allocator_builtin(i);
    return vt ? vt->name : NULL;
}

static int set_allocator(cli_opts *o, const char *v)
{
    if (!mt_allocator_by_name(v)) return -1;
    o->allocator = v;
    return 0;
}

/* The i-th base format's name (NULL past the last), as the library names
 * them. */
static const char *base_value(int i) { return i >= 0 ? mt_base_format_name(i) : NULL; }

static int base_named(const char *v, mt_base_format *out)
{
    for (int f = 0; base_value(f); f++)
        if (!strcmp(v, base_value(f))) {
            *out = f;
            return 0;
        }
    return -1;
}

static int set_base(cli_opts *o, const char *v) { return base_named(v, &o->base); }

static int set_teacher_base(cli_opts *o, const char *v) { return base_named(v, &o->teacher_base); }

static int set_optimizer(cli_opts *o, const char *v)
{
    return mt_optimizer_by_name(v, &o->optimizer) ? -1 : 0;
}

/* The i-th optimizer's name as the usage lists them (AdamW's 8- and 4-bit
 * states beside it), then any other the library has in kind order; NULL
 * past the last. */
static const char *optimizer_value(int i)
{
    static const mt_optimizer_kind first[] = {MT_OPT_SGD, MT_OPT_ADAMW, MT_OPT_ADAMW8,
                                              MT_OPT_ADAMW4, MT_OPT_ADAFACTOR};
    const int n = (int)(sizeof first / sizeof *first);
    if (i < n) return i >= 0 ? mt_optimizer_name(first[i]) : NULL;
    for (mt_optimizer_kind k = MT_OPT_SGD; mt_optimizer_name(k); k++) {
        bool listed = false;
        for (int j = 0; j < n; j++) listed |= first[j] == k;
        if (!listed && i-- == n) return mt_optimizer_name(k);
    }
    return NULL;
}

static int set_recompute(cli_opts *o, const char *v)
{
    if (!strcmp(v, "none")) o->recompute = MT_RECOMPUTE_NONE;
    else if (!strcmp(v, "selective")) o->recompute = MT_RECOMPUTE_SELECTIVE;
    else if (!strcmp(v, "sqrt")) o->recompute = MT_RECOMPUTE_SQRT;
    else if (!strcmp(v, "budget") && o->cmd == CLI_ESTIMATE) o->recompute = MT_RECOMPUTE_BUDGET;
    else if (!strncmp(v, "every:", 6)) {
        long k;
        if (cli_parse_long(v + 6, 1, 1 << 20, &k)) return -1;
        o->recompute = MT_RECOMPUTE_EVERY_K;
        o->recompute_every = (int)k;
    } else {
        return -1;
    }
    return 0;
}

static int set_schedule(cli_opts *o, const char *v)
{
    if (!strcmp(v, "cosine")) o->constant_lr = 0;
    else if (!strcmp(v, "constant")) o->constant_lr = 1;
    else return -1;
    return 0;
}

/* v's place in names (n of them; a NULL one names nothing), or -1: the
 * names list an enum's values in order. */
static int name_in(const char *v, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (names[i] && !strcmp(v, names[i])) return i;
    return -1;
}
#define NAMES_N(a) ((int)(sizeof(a) / sizeof *(a)))

/* A number in [lo, hi] (each end open where said) into *out: 0, or -1. */
static int parse_fraction(const char *v, double lo, bool lo_open, double hi, bool hi_open,
                          double *out)
{
    char *end;
    errno = 0;
    const double x = strtod(v, &end);
    if (errno || end == v || *end || !(lo_open ? x > lo : x >= lo) || !(hi_open ? x < hi : x <= hi))
        return -1;
    *out = x; /* (a double: rint(x n) as Python's round(x * n)) */
    return 0;
}

static int set_offload(cli_opts *o, const char *v)
{
    static const char *const names[] = {[MT_PLACE_DEVICE] = "none", [MT_PLACE_HOST] = "host",
                                        [MT_PLACE_DISK] = "disk"};
    const int i = name_in(v, names, NAMES_N(names));
    if (i >= 0) o->offload = i;
    return i < 0 ? -1 : 0;
}

static int set_budget(cli_opts *o, const char *v)
{
    float b;
    if (parse_float(v, &b) || !(b > 0)) return -1;
    o->budget_mib = b;
    return 0;
}

static int set_layout(cli_opts *o, const char *v)
{
    if (strcmp(v, "auto")) return -1;
    o->layout = 1;
    return 0;
}

/* --freeze P[,P...]: each pattern kept (repeatable) */
static int add_freeze(cli_opts *o, const char *v)
{
    size_t n = strlen(v) + 1;
    if (n > sizeof o->freeze_text - o->freeze_used) return -1;
    char *at = o->freeze_text + o->freeze_used;
    memcpy(at, v, n);
    o->freeze_used += n;
    for (char *p = at, *next; p; p = next) {
        next = strchr(p, ',');
        if (next) *next++ = 0;
        if (!*p || o->n_freeze == CLI_MAX_FREEZE) return -1;
        o->freeze[o->n_freeze++] = p;
    }
    return 0;
}

static int set_prune(cli_opts *o, const char *v)
{
    static const char *const names[] = {[MT_PRUNE_MAGNITUDE] = "magnitude",
                                        [MT_PRUNE_WANDA] = "wanda"};
    const int i = name_in(v, names, NAMES_N(names));
    if (i >= 0) o->prune.method = i;
    return i < 0 ? -1 : 0;
}

static int set_sparsity(cli_opts *o, const char *v)
{
    return parse_fraction(v, 0.0, false, 1.0, true, &o->prune.sparsity);
}

static int set_nm(cli_opts *o, const char *v)
{
    long n, m;
    char a[32];
    const char *colon = strchr(v, ':');
    if (!colon || (size_t)(colon - v) >= sizeof a) return -1;
    snprintf(a, sizeof a, "%.*s", (int)(colon - v), v);
    if (cli_parse_long(a, 1, 15, &n) || cli_parse_long(colon + 1, 2, 16, &m) || n >= m) return -1;
    o->prune.nm_n = (int)n, o->prune.nm_m = (int)m;
    return 0;
}

static int set_prune_scope(cli_opts *o, const char *v)
{
    static const char *const names[] = {[MT_PRUNE_TENSOR] = "tensor", [MT_PRUNE_GLOBAL] = "global"};
    const int i = name_in(v, names, NAMES_N(names));
    if (i >= 0) o->prune.scope = i;
    return i < 0 ? -1 : 0;
}

static int set_prune_schedule(cli_opts *o, const char *v)
{
    static const char *const names[] = {[MT_PRUNE_ONESHOT] = "oneshot",
                                        [MT_PRUNE_GRADUAL] = "gradual"};
    const int i = name_in(v, names, NAMES_N(names));
    if (i >= 0) o->prune.schedule = i;
    return i < 0 ? -1 : 0;
}

static int set_regrow(cli_opts *o, const char *v)
{
    static const char *const names[] = {[MT_REGROW_NONE] = "none", [MT_REGROW_RIGL] = "rigl"};
    const int i = name_in(v, names, NAMES_N(names));
    if (i >= 0) o->prune.regrow = i;
    return i < 0 ? -1 : 0;
}

static int set_sparse_kernel(cli_opts *o, const char *v)
{
    static const char *const names[] = {[MT_SPARSE_KERNEL_AUTO] = "auto",
                                        [MT_SPARSE_KERNEL_DENSE] = "dense",
                                        [MT_SPARSE_KERNEL_SPARSE] = "sparse"};
    const int i = name_in(v, names, NAMES_N(names));
    if (i >= 0) o->prune.kernel = i;
    return i < 0 ? -1 : 0;
}

static int set_regrow_frac(cli_opts *o, const char *v)
{
    return parse_fraction(v, 0.0, true, 1.0, false, &o->prune.regrow_frac);
}

/* --config is read before the options (memtrain.c); one inside a
 * configuration file is refused */
static int set_config(cli_opts *o, const char *v)
{
    return -1;
}

/* ---- the table ---- */

typedef enum opt_kind {
    K_HEAD,  /* no option: a heading line in the usage text */
    K_FLAG,  /* takes no value: sets the int at off to lo */
    K_LONG,  /* the long at off, in lo..hi */
    K_FLOAT, /* the float at off, in lo..hi (open at an end as `open` says) */
    K_STR,   /* the string at off */
    K_FN     /* fn reads it */
} opt_kind;

typedef struct opt {
    const char *name, *arg; /* "--steps", "N" */
    unsigned cmds;          /* CLI_TRAIN | CLI_SAMPLE | CLI_ESTIMATE */
    unsigned models;        /* CLI_MLP | CLI_GPT: what train and sample use it for */
    opt_kind kind;
    size_t off;
    double lo, hi;
    int (*fn)(cli_opts *o, const char *v);
    const char *hint;       /* after "bad --name 'value'" */
    const char *help;       /* the usage line */
    const char *help_est;   /* estimate's usage line, where it differs */
    unsigned char open;     /* K_FLOAT: OPEN_LO, x > lo; OPEN_HI, x < hi */
    /* K_FN naming an entry of a library table: the i-th name it takes, NULL
       past the last; its usage argument ("a|b", unless arg names it) and
       hint ("(a, b)"), and "{names}" in its help ("a|b") */
    const char *(*value)(int i);
} opt;

enum { OPEN_LO = 1, OPEN_HI = 2 };
#define NO_MAX HUGE_VAL

#define TS (CLI_TRAIN | CLI_SAMPLE)
#define ALL (TS | CLI_ESTIMATE)
#define TE (CLI_TRAIN | CLI_ESTIMATE)
#define OFF(f) offsetof(cli_opts, f)
#define FLAG(n, c, m, f, v, h) {n, NULL, c, m, K_FLAG, OFF(f), v, 0, NULL, NULL, h, NULL, 0, NULL}
#define LONG(n, a, c, m, f, lo, hi, h, he) \
    {n, a, c, m, K_LONG, OFF(f), lo, hi, NULL, NULL, h, he, 0, NULL}
#define FLOAT(n, c, m, f, lo, hi, open, h) \
    {n, "X", c, m, K_FLOAT, OFF(f), lo, hi, NULL, NULL, h, NULL, open, NULL}
#define STR(n, a, c, m, f, h) {n, a, c, m, K_STR, OFF(f), 0, 0, NULL, NULL, h, NULL, 0, NULL}
#define FN(n, a, c, m, fn, hint, h, he) {n, a, c, m, K_FN, 0, 0, 0, fn, hint, h, he, 0, NULL}
#define NAMED(n, c, m, fn, value, h, he) {n, NULL, c, m, K_FN, 0, 0, 0, fn, NULL, h, he, 0, value}
#define NAMED_ARG(n, a, c, m, fn, value, h, he) {n, a, c, m, K_FN, 0, 0, 0, fn, NULL, h, he, 0, value}
#define HEAD(c, h) {NULL, NULL, c, CLI_ANY, K_HEAD, 0, 0, 0, NULL, NULL, h, NULL, 0, NULL}

static const opt table[] = {
    FN("--model", "mlp|gpt", ALL, CLI_ANY, set_model, "(mlp, gpt)",
       "the MLP on spirals, or a GPT on text (mlp)", NULL),
    LONG("--steps", "N", TS, CLI_ANY, steps, 0, 100000000, "training steps (300)", NULL),
    LONG("--batch", "N", ALL, CLI_ANY, batch, 1, 1 << 24, "rows per step (mlp 64, gpt 8)", NULL),
    FLOAT("--lr", TS, CLI_ANY, lr, 0, NO_MAX, 0, "learning rate (sgd 0.1, adamw 3e-3)"),
    FLOAT("--weight-decay", TS, CLI_ANY, wd, 0, NO_MAX, 0, "(0)"),
    FN("--precision", "P", ALL, CLI_ANY, set_precision, "(fp32, fp16, bf16)",
       "fp32, fp16 (fp32 masters, dynamic loss scaling) or bf16 (fp32)", "fp32|fp16|bf16 (fp32)"),
    LONG("--seed", "N", TS, CLI_ANY, seed, 0, 2147483647, "data order and initial weights (1)",
         NULL),
    LONG("--every", "N", TS, CLI_ANY, every, 1, 100000000, "print progress every N steps (25)",
         NULL),
    FN("--device", "cpu|cuda|auto", TS, CLI_ANY, set_device, "(cpu, cuda, auto)", "(cpu)", NULL),
    FN("--device", "cpu|cuda", CLI_ESTIMATE, CLI_ANY, set_device, "(cpu, cuda)", NULL,
       "the device the run will use (cpu); cuda needs no GPU"),
    LONG("--threads", "N", ALL, CLI_ANY, threads, 0, 4096, "CPU threads, 0 = all (0)", NULL),
    NAMED_ARG("--allocator", "NAME", ALL, CLI_ANY, set_allocator, allocator_value,
              "{names} for every class (caching)", NULL),
    STR("--trace", "FILE", TS, CLI_ANY, trace, "record every allocation to FILE (replay it later)"),
    STR("--chrome", "FILE", TS, CLI_ANY, chrome, "the run's memory as Chrome trace JSON (Perfetto)"),
    STR("--svg", "FILE", TS, CLI_ANY, svg, "the run's memory by class as an SVG plot, peak and estimate"),
    FLAG("--report", TS, CLI_ANY, report, 1, "the memory report at the end (on, but not with --json)"),
    FLAG("--no-report", TS, CLI_ANY, report, 0, "no memory report"),
    {"--json", NULL, ALL, CLI_ANY, K_FLAG, OFF(json), 1, 0, NULL, NULL,
     "one JSON object per step instead of progress lines", "one JSON object instead of the table", 0,
     NULL},
    FN("--config", "FILE", ALL, CLI_ANY, set_config, NULL,
       "options from FILE, a line 'name = value' each (flags: 1/0); the command line overrides it",
       NULL),
    LONG("--micro", "N", ALL, CLI_ANY, micro, 0, 1 << 24,
         "rows per micro-batch, 0 = the whole batch (0)", NULL),
    NAMED("--optimizer", ALL, CLI_ANY, set_optimizer, optimizer_value, "(mlp sgd, gpt adamw)",
          "(adamw)"),
    FLAG("--no-master", ALL, CLI_ANY, no_master, 1, "bf16 weights without fp32 masters"),
    FN("--recompute", "none|selective|sqrt|every:K", TS, CLI_ANY, set_recompute,
       "(none, selective, sqrt, every:K)", "activation recompute (none)", NULL),
    FN("--recompute", "none|selective|sqrt|every:K|budget", CLI_ESTIMATE, CLI_ANY, set_recompute,
       "(none, selective, sqrt, every:K, budget)", NULL,
       "activation recompute (none); budget: the cheapest plan within --budget"),
    FLAG("--fused", ALL, CLI_ANY, fused, 1, "the fused backward + optimizer step"),
    FN("--freeze", "PATTERN", ALL, CLI_ANY, add_freeze,
       "(parameter-name patterns, comma-separated)",
       "freeze the parameters whose names match (fnmatch; repeatable, or P,P,...)", NULL),
    LONG("--lora", "R", ALL, CLI_ANY, lora, 0, 4096,
         "LoRA adapters of rank R on the linear weights; the base is frozen (0: none)", NULL),
    FLOAT("--lora-alpha", ALL, CLI_ANY, lora_alpha, 0, NO_MAX, 0,
          "LoRA's scale is alpha / R (R)"),
    STR("--lora-targets", "PATTERN", ALL, CLI_ANY, lora_targets,
        "the weights LoRA adapts, fnmatch patterns P,P,... (every linear weight)"),
    FLAG("--merge-lora", CLI_TRAIN, CLI_GPT, merge_lora, 1,
         "merge the adapters into the weights after training (for --export-llmc)"),
    STR("--save-lora", "FILE", CLI_TRAIN, CLI_GPT, save_lora,
        "the LoRA adapters alone at the end (with --lora or --load-lora)"),
    STR("--load-lora", "FILE", TS, CLI_GPT, load_lora,
        "start from adapters of --save-lora (their rank and alpha; no --lora)"),
    NAMED("--base", ALL, CLI_ANY, set_base, base_value,
          "store the frozen linear weights and token table quantized, int8 or NF4 (with --lora, "
          "--load-lora or --freeze; full)",
          NULL),
    STR("--teacher", "FILE", TE, CLI_GPT, teacher,
        "distil from this llm.c model file (a GPT of the same vocabulary)"),
    NAMED("--teacher-base", TE, CLI_GPT, set_teacher_base, base_value,
          "the teacher's linear weights quantized as they are read, int8 or NF4 (full)", NULL),
    FLOAT("--distill-alpha", TE, CLI_GPT, distill_alpha, 0, 1, 0,
          "the KL's weight, in [0, 1]; the cross-entropy's is 1 - X (0.5)"),
    FLOAT("--distill-temp", TE, CLI_GPT, distill_temp, 0, NO_MAX, OPEN_LO,
          "the distillation temperature, > 0 (2)"),
    FN("--prune", "magnitude|wanda", ALL, CLI_ANY, set_prune, "(magnitude, wanda)",
       "prune the linear weights: the smallest |w|, or Wanda's |w| ||x|| within each row; "
       "pruned weights are stored compressed in every class (none)", NULL),
    FN("--sparsity", "S", ALL, CLI_ANY, set_sparsity, "(a fraction in [0, 1))",
       "with --prune: the fraction of each target's weights pruned (0.5)", NULL),
    FN("--nm", "N:M", ALL, CLI_ANY, set_nm, "(N:M with 0 < N < M <= 16, like 2:4)",
       "with --prune: N of each M consecutive weights of a row kept (in place of --sparsity)",
       NULL),
    FN("--prune-scope", "tensor|global", ALL, CLI_ANY, set_prune_scope, "(tensor, global)",
       "with --prune magnitude: each tensor its fraction, or all targets together (tensor)",
       NULL),
    LONG("--calib", "N", ALL, CLI_ANY, calib, 1, 1 << 20,
         "with --prune wanda: calibration batches before each prune, taken from the training "
         "data (4)", NULL),
    STR("--prune-targets", "PATTERN", ALL, CLI_ANY, prune.targets,
        "with --prune: the weights pruned, fnmatch patterns P,P,... (every linear weight)"),
    LONG("--prune-at", "S", ALL, CLI_ANY, prune_at, 0, 1 << 30,
         "with --prune: a one-shot prune after S steps, 0 = before training (0)", NULL),
    FN("--prune-schedule", "oneshot|gradual", ALL, CLI_ANY, set_prune_schedule,
       "(oneshot, gradual)",
       "with --prune: once (--prune-at), or gradual: Zhu & Gupta's cubic ramp to --sparsity "
       "from --prune-start to --prune-end, a prune every --prune-every steps (oneshot)", NULL),
    LONG("--prune-start", "A", ALL, CLI_ANY, prune_start, 0, 1 << 30,
         "gradual: the first prune's step (0)", NULL),
    LONG("--prune-end", "B", ALL, CLI_ANY, prune_end, 0, 1 << 30,
         "gradual: the step --sparsity is reached (half of --steps)", NULL),
    LONG("--prune-every", "K", ALL, CLI_ANY, prune_every, 1, 1 << 30,
         "gradual: steps between prunes (a tenth of the ramp)", NULL),
    FN("--regrow", "rigl|none", ALL, CLI_ANY, set_regrow, "(rigl, none)",
       "with --prune (unstructured): RigL, every --regrow-every steps the masks change instead "
       "of the weights, the smallest |w| dropped and the largest |gradient| grown at 0 (none)",
       NULL),
    LONG("--regrow-every", "K", ALL, CLI_ANY, regrow_every, 1, 1 << 30,
         "RigL: steps between mask updates (100)", NULL),
    FN("--regrow-frac", "F", ALL, CLI_ANY, set_regrow_frac, "(a fraction in (0, 1])",
       "RigL: the drop fraction at the start, cosine-annealed to 0 at --regrow-end (0.3)", NULL),
    LONG("--regrow-end", "T", ALL, CLI_ANY, regrow_end, 1, 1 << 30,
         "RigL: no mask update from this step on (3/4 of --steps)", NULL),
    FN("--sparse-kernel", "auto|dense|sparse", ALL, CLI_ANY, set_sparse_kernel,
       "(auto, dense, sparse)",
       "a pruned weight's GEMMs: the faster per weight, the dense tile, or the sparse GEMMs "
       "from the kept values (CPU; not with --regrow) (auto)", NULL),
    FLOAT("--clip", ALL, CLI_ANY, clip, 0, NO_MAX, 0,
          "global gradient-norm clipping, 0 = none (gpt 1, mlp 0)"),
    HEAD(TS, "MLP: three interleaved spirals in the plane, 3 classes, made from the seed."),
    FN("--hidden", "N,N,...", ALL, CLI_MLP, set_hidden, "(sizes like 64,64)",
       "hidden layer sizes (64,64; 2 inputs, 3 classes)", NULL),
    FN("--activation", "relu|gelu", ALL, CLI_MLP, set_activation, "(relu or gelu)", "(relu)", NULL),
    FLOAT("--momentum", ALL, CLI_ANY, momentum, 0, 1, OPEN_HI, "SGD momentum (0.9)"),
    HEAD(TS, "GPT: byte-level text or an llm.c token file; 10% held out for validation."),
    STR("--data", "FILE", ALL, CLI_GPT, data,
        "text or llm.c tokens (the built-in corpus: this project's docs)"),
    LONG("--layers", "N", ALL, CLI_GPT, layers, 1, 1 << 24, "transformer blocks (2)", NULL),
    LONG("--heads", "N", ALL, CLI_GPT, heads, 1, 1 << 24, "attention heads (4)", NULL),
    LONG("--channels", "N", ALL, CLI_GPT, channels, 1, 1 << 24, "embedding width (128)", NULL),
    LONG("--vocab", "N", CLI_ESTIMATE, CLI_GPT, vocab, 1, 1 << 24, NULL,
         "vocabulary (the data's: 256 for text and the built-in corpus; GPT-2's is 50257)"),
    LONG("--max-seq", "N", CLI_ESTIMATE, CLI_GPT, max_seq, 1, 1 << 24, NULL,
         "positions (--seq, as train makes them; GPT-2's are 1024)"),
    LONG("--seq", "N", ALL, CLI_GPT, seq, 1, 1 << 24, "tokens per row (64)", NULL),
    FN("--schedule", "cosine|constant", TS, CLI_GPT, set_schedule, "(cosine, constant)",
       "warmup (10% of --steps) and cosine to 0.1 lr, or constant", NULL),
    LONG("--eval-every", "N", TS, CLI_GPT, eval_every, 0, 1 << 24,
         "validation loss every N steps (4 x --every)", NULL),
    STR("--save", "FILE", TS, CLI_GPT, save, "a training checkpoint at the end (and every --save-every N)"),
    LONG("--save-every", "N", TS, CLI_GPT, save_every, 0, 1 << 24, "a checkpoint every N steps (0: at the end only)", NULL),
    STR("--resume", "FILE", TS, CLI_GPT, resume, "go on from a checkpoint (same model and settings)"),
    STR("--llmc", "FILE", ALL, CLI_GPT, llmc, "start from an llm.c model checkpoint (fp32; its shape)"),
    STR("--export-llmc", "FILE", TS, CLI_GPT, export_llmc,
        "write the trained weights as an llm.c model checkpoint"),
    LONG("--comm-timeout", "S", CLI_TRAIN, CLI_ANY, comm_timeout, 1, 86400,
         "under mpirun: seconds a collective waits for the other ranks (300)", NULL),
    FLAG("--overlap", CLI_TRAIN, CLI_ANY, overlap, 1,
         "under mpirun: sum the gradients (--zero 1, 2: reduce-scatter them; --fused too) on a "
         "thread while backward goes on"),
    LONG("--local-sgd", "H", TE, CLI_ANY, local_sgd, 0, 1 << 24,
         "under mpirun: local SGD, each rank steps alone and the weights are averaged every H "
         "steps (0: off)", NULL),
    LONG("--zero", "S", ALL, CLI_ANY, zero, 0, 3,
         "under mpirun: ZeRO stage, 1 shards masters and optimizer state, 2 gradients too, 3 "
         "weights too (0)",
         "the ZeRO stage of the run (0; with --ranks)"),
    LONG("--tp", "T", ALL, CLI_GPT, tp, 1, 65536,
         "under mpirun: tensor parallel, each group of T neighbouring ranks splits the GPT's "
         "heads, MLP columns and vocabulary, and is given the same rows (1)",
         "ranks per tensor group of the run (1; with --ranks)"),
    FLAG("--sp", ALL, CLI_GPT, sp, 1,
         "with --tp: sequence parallel, the residual stream and LayerNorms split by rows too"),
    LONG("--pp", "P", ALL, CLI_ANY, pp, 1, 65536,
         "under mpirun: pipeline parallel, the layers cut into P stages balanced by compute, "
         "the micro-batches (--micro) run one forward one backward (1F1B) (1)",
         "pipeline stages of the run (1; with --ranks: each rank's peak is its stage's)"),
    LONG("--zero3-prefetch", "N", TE, CLI_ANY, zero3_prefetch, 0, 64,
         "with --zero 3: the next N layers' weights gathered on a thread while a layer "
         "computes, 0 = when each starts (1)", NULL),
    LONG("--zero3-keep", "N", TE, CLI_ANY, zero3_keep, -1, 1 << 24,
         "with --zero 3: the last N layers keep their weights from forward to backward, "
         "-1 = every layer (0)", NULL),
    FN("--offload", "none|host|disk", TE, CLI_ANY, set_offload, "(none, host, disk)",
       "optimizer state and fp32 masters resident, in pinned host memory updated by the CPU "
       "(host: CUDA), or in scratch files on disk, brought in piece by piece for the update "
       "(disk: CPU) (none)",
       "the same, the disk's bytes shown apart (none)"),
    {"--offload-dir", "DIR", TE, CLI_ANY, K_STR, OFF(offload_dir), 0, 0, NULL, NULL,
     "the directory --offload disk makes its scratch directory in",
     "with --autofit: auto-fit may put the state on disk there when nothing fits on the "
     "device, and the weights too when even that does not fit (where the run takes them; "
     "nothing is made)", 0, NULL},
    {"--offload-params", NULL, TE, CLI_ANY, K_FLAG, OFF(offload_params), 1, 0, NULL, NULL,
     "with --offload disk: the trained weights in the scratch files too, each layer's read in "
     "just before it runs (the next one's while it runs) and let go after",
     "with --offload disk: the weights' bytes on disk too", 0, NULL},
    LONG("--ranks", "N", CLI_ESTIMATE, CLI_ANY, ranks, 1, 65536, NULL,
         "one rank of N data-parallel ranks; --batch is the global batch (1)"),
    LONG("--rank", "R", CLI_ESTIMATE, CLI_ANY, rank, 0, 65535, NULL, "which rank (0)"),
    HEAD(CLI_SAMPLE, "sample:"),
    STR("--prompt", "TEXT", CLI_SAMPLE, CLI_GPT, prompt, "the start (a newline)"),
    LONG("--length", "N", CLI_SAMPLE, CLI_GPT, length, 0, 1 << 20, "bytes to write (200)", NULL),
    FLOAT("--temperature", CLI_SAMPLE, CLI_GPT, temperature, 0, NO_MAX, 0,
          "0: the most likely byte each time (0.8)"),
    FN("--budget", "MIB", CLI_ESTIMATE, CLI_ANY, set_budget, "(MiB > 0)", NULL,
       "a memory budget (MiB, what the allocators reserve)"),
    FLAG("--autofit", CLI_ESTIMATE, CLI_ANY, autofit, 1,
         "fit micro-batch, recompute, state and offload to --budget (with --ranks: what fits "
         "every rank)"),
    FN("--layout", "auto", CLI_ESTIMATE, CLI_GPT, set_layout, "(auto)", NULL,
       "with --autofit and --ranks: choose --tp, --pp, --sp and --zero too, showing every layout "
       "tried"),
    FLAG("--allow-8bit", CLI_ESTIMATE, CLI_ANY, allow8, 1, "let --autofit use 8-bit AdamW state"),
    FLAG("--allow-4bit", CLI_ESTIMATE, CLI_ANY, allow4, 1, "let --autofit use 4-bit AdamW state"),
};
#define N_OPTS (sizeof table / sizeof *table)
_Static_assert(N_OPTS <= CLI_MAX_OPTIONS, "cli_opts.text holds a value per table entry");

static const opt *find(const char *name, unsigned cmd)
{
    for (size_t i = 0; i < N_OPTS; i++)
        if (table[i].name && (table[i].cmds & cmd) && !strcmp(table[i].name, name))
            return &table[i];
    return NULL;
}

bool cli_takes(const char *name, unsigned cmd)
{
    char full[80];
    return snprintf(full, sizeof full, "--%s", name) < (int)sizeof full && find(full, cmd);
}

bool cli_is_flag(const char *name)
{
    for (size_t i = 0; i < N_OPTS; i++)
        if (table[i].kind == K_FLAG && !strcmp(table[i].name + 2, name)) return true;
    return false;
}

/* The names an option of a library table takes, joined by sep into b. */
static const char *join_values(const opt *p, const char *sep, char *b, size_t cap)
{
    size_t at = 0;
    b[0] = 0;
    for (int i = 0; p->value(i) && at < cap; i++)
        at += (size_t)snprintf(b + at, cap - at, "%s%s", i ? sep : "", p->value(i));
    return b;
}

void cli_usage(FILE *f, unsigned cmd, const char *head)
{
    fputs(head, f);
    for (size_t i = 0; i < N_OPTS; i++) {
        const opt *p = &table[i];
        if (!(p->cmds & cmd)) continue;
        const char *help = cmd == CLI_ESTIMATE && p->help_est ? p->help_est : p->help;
        if (p->kind == K_HEAD) {
            fprintf(f, "%s\n", p->help);
            continue;
        }
        if (!help) help = "";
        char values[96], name[128], text[256];
        const char *names = p->value ? join_values(p, "|", values, sizeof values) : NULL;
        const char *at = names ? strstr(help, "{names}") : NULL;
        if (at) { /* the library's names in the help's words */
            snprintf(text, sizeof text, "%.*s%s%s", (int)(at - help), help, names, at + 7);
            help = text;
        }
        const char *arg = p->arg ? p->arg : names;
        snprintf(name, sizeof name, "%s%s%s", p->name, arg ? " " : "", arg ? arg : "");
        if (strlen(name) > 22) fprintf(f, "  %s\n  %-22s %s\n", name, "", help);
        else fprintf(f, "  %-22s %s\n", name, help);
    }
}

static void defaults(cli_opts *o, unsigned cmd)
{
    memset(o, 0, sizeof *o);
    o->cmd = cmd; /* (estimate's defaults are train's: the estimate is that run's) */
    o->hidden[0] = o->hidden[1] = 64, o->n_hidden = 2;
    o->act = MT_ACT_RELU;
    o->steps = 300, o->seed = 1, o->every = 25;
    o->lr = 0.1f, o->momentum = 0.9f;
    o->device = MT_DEVICE_CPU;
    o->allocator = "caching";
    o->report = -1;
    o->optimizer = MT_OPT_ADAMW;
    o->recompute = MT_RECOMPUTE_NONE, o->recompute_every = 2;
    o->seq = 64;
    o->layers = 2, o->heads = 4, o->channels = 128;
    o->vocab = 0, o->max_seq = 0; /* estimate: the data's vocabulary, --seq positions */
    o->length = 200, o->temperature = 0.8f;
    o->comm_timeout = 300;
    o->ranks = 1;
    o->zero3_prefetch = 1;
    o->tp = 1;
    o->pp = 1;
    o->distill_alpha = 0.5f, o->distill_temp = 2.0f;
    o->prune.sparsity = 0.5;
    o->calib = 4;
    o->regrow_every = 100;
    o->prune.regrow_frac = 0.3;
}

/* The options given that mean nothing for the model: "--a, --b" into buf
 * (empty when none). */
static void not_for_model(const cli_opts *o, char *buf, size_t cap)
{
    const unsigned model = o->gpt ? CLI_GPT : CLI_MLP;
    size_t at = 0;
    buf[0] = 0;
    for (size_t i = 0; i < N_OPTS && at < cap; i++)
        if (o->text[i] && !(table[i].models & model))
            at += (size_t)snprintf(buf + at, cap - at, "%s%s", at ? ", " : "", table[i].name);
}

static bool given(const cli_opts *o, const char *name)
{
    for (size_t i = 0; i < N_OPTS; i++)
        if (table[i].name && o->text[i] && !strcmp(table[i].name, name)) return true;
    return false;
}

/* What a value of option p must be, for its message: the table's range of
 * a number, or the hint of a custom option ("(mlp, gpt)"). */
static void range_text(const opt *p, char *b, size_t cap)
{
    if (p->kind == K_LONG) {
        snprintf(b, cap, "an integer from %.0f to %.0f", p->lo, p->hi);
    } else if (p->kind == K_FLOAT && p->hi == NO_MAX) {
        snprintf(b, cap, "a number %s %g", p->open & OPEN_LO ? ">" : ">=", p->lo);
    } else if (p->kind == K_FLOAT) {
        snprintf(b, cap, "a number in %c%g, %g%c", p->open & OPEN_LO ? '(' : '[', p->lo, p->hi,
                 p->open & OPEN_HI ? ')' : ']');
    } else if (p->value) {
        char values[96];
        snprintf(b, cap, "(%s)", join_values(p, ", ", values, sizeof values));
    } else {
        snprintf(b, cap, "%s", p->hint ? p->hint : "");
    }
}

/* One option's value into o. */
static int set(const opt *p, cli_opts *o, const char *v)
{
    char *field = (char *)o + p->off;
    long n;
    float x;
    switch (p->kind) {
    case K_FLAG: *(int *)field = (int)p->lo; return 0;
    case K_STR: *(const char **)field = v; return 0;
    case K_LONG:
        if (cli_parse_long(v, (long)p->lo, (long)p->hi, &n)) return -1;
        *(long *)field = n;
        return 0;
    case K_FLOAT:
        if (parse_float(v, &x) || x < p->lo || x > p->hi || ((p->open & OPEN_LO) && x == p->lo) ||
            ((p->open & OPEN_HI) && x == p->hi))
            return -1;
        *(float *)field = x;
        return 0;
    case K_FN: return p->fn(o, v);
    case K_HEAD: break;
    }
    return -1;
}

/* An output file's path: not a directory, in a directory that exists and
 * can be written (files are written beside their target and renamed), so
 * a run does not fail at its end for a path it could have been refused for
 * at the start. */
static int check_output(const char *name, const char *path)
{
    struct stat sb;
    if (!path[0]) return cli_bad_usage("%s: an empty path", name);
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        return cli_bad_usage("%s %s: a directory, not a file", name, path);
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) snprintf(dir, sizeof dir, ".");
    else snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return cli_bad_usage("%s %s: no directory %s", name, path, dir);
    if (access(dir, W_OK | X_OK) != 0)
        return cli_bad_usage("%s %s: cannot write in %s", name, path, dir);
    return 0;
}

/* Options that cannot go together, named as the command line gives them
 * (the library would name its fields). */
static int check_together(const cli_opts *o)
{
    if (o->micro > o->batch)
        return cli_bad_usage("--micro %ld is more than --batch %ld", o->micro, o->batch);
    if (o->no_master && o->precision != MT_PREC_BF16)
        return cli_bad_usage("%s", "--no-master needs --precision bf16 (fp32 weights are their "
                                   "own masters; fp16 needs fp32 masters)");
    if (o->no_master && (o->optimizer == MT_OPT_ADAFACTOR || o->optimizer == MT_OPT_ADAMW4))
        return cli_bad_usage("--no-master does not combine with --optimizer %s (its update "
                             "needs fp32 masters)", mt_optimizer_name(o->optimizer));
    if (o->fused && o->micro && o->micro < o->batch)
        return cli_bad_usage("%s", "--fused cannot combine with --micro smaller than --batch "
                                   "(it cannot accumulate gradients)");
    if (!o->gpt && o->recompute == MT_RECOMPUTE_SELECTIVE)
        return cli_bad_usage("%s", "--recompute selective keeps parts of a GPT's blocks; the MLP "
                                   "takes none, sqrt or every:K");
    if (given(o, "--momentum") && o->optimizer != MT_OPT_SGD)
        return cli_bad_usage("%s", "--momentum is for --optimizer sgd");
    if (o->gpt && o->channels % o->heads && !o->llmc)
        return cli_bad_usage("%s", "--heads must divide --channels");
    if (o->zero != 3 && (given(o, "--zero3-prefetch") || given(o, "--zero3-keep")))
        return cli_bad_usage("%s", "--zero3-prefetch and --zero3-keep are for --zero 3");
    if (o->zero && o->local_sgd)
        return cli_bad_usage("%s", "--zero does not combine with --local-sgd (local SGD keeps each "
                                   "rank's own optimizer state)");
    static const char *const prune_opts[] = {"--sparsity",      "--nm",         "--prune-scope",
                                             "--calib",         "--prune-targets", "--prune-at",
                                             "--prune-schedule", "--prune-start", "--prune-end",
                                             "--prune-every", "--regrow", "--regrow-every",
                                             "--regrow-frac", "--regrow-end"};
    for (size_t i = 0; i < sizeof prune_opts / sizeof *prune_opts; i++)
        if (!o->prune.method && given(o, prune_opts[i]))
            return cli_bad_usage("%s needs --prune magnitude|wanda", prune_opts[i]);
    if (given(o, "--calib") && o->prune.method != MT_PRUNE_WANDA)
        return cli_bad_usage("%s", "--calib is for --prune wanda");
    if (o->prune.nm_m && given(o, "--sparsity"))
        return cli_bad_usage("%s", "--nm N:M sets the sparsity (1 - N/M): not with --sparsity");
    if (!o->prune.regrow &&
        (given(o, "--regrow-every") || given(o, "--regrow-frac") || given(o, "--regrow-end")))
        return cli_bad_usage("%s", "--regrow-every, --regrow-frac and --regrow-end are for "
                                   "--regrow rigl");
    if (o->prune.regrow && o->prune.nm_m)
        return cli_bad_usage("%s", "--regrow rigl changes unstructured masks: not with --nm");
    if (o->prune.regrow && o->prune.kernel == MT_SPARSE_KERNEL_SPARSE)
        return cli_bad_usage("%s", "--regrow rigl takes the dense gradient from the dense tile: "
                                   "not with --sparse-kernel sparse");
    if (o->prune.schedule == MT_PRUNE_GRADUAL && o->prune.nm_m)
        return cli_bad_usage("%s", "--nm prunes once (--prune-schedule oneshot)");
    if (o->prune.schedule == MT_PRUNE_GRADUAL && given(o, "--prune-at"))
        return cli_bad_usage("%s", "--prune-at is the one-shot prune's step: not with "
                                   "--prune-schedule gradual");
    if (o->prune.schedule != MT_PRUNE_GRADUAL &&
        (given(o, "--prune-start") || given(o, "--prune-end") || given(o, "--prune-every")))
        return cli_bad_usage("%s", "--prune-start, --prune-end and --prune-every are for "
                                   "--prune-schedule gradual");
    if (o->prune.schedule == MT_PRUNE_GRADUAL && given(o, "--prune-end") &&
        o->prune_end < o->prune_start)
        return cli_bad_usage("--prune-end %ld is before --prune-start %ld", o->prune_end,
                             o->prune_start);
    if (o->base && !o->lora && !o->load_lora && !o->n_freeze)
        return cli_bad_usage("--base %s quantizes frozen weights: it needs --lora R, --load-lora "
                             "FILE or --freeze PATTERN",
                             mt_base_format_name(o->base));
    if (o->base && o->precision == MT_PREC_FP16)
        return cli_bad_usage("--base %s computes in fp32 or bf16: not with --precision fp16",
                             mt_base_format_name(o->base));
    if (o->tp > 1 && (o->save || o->resume) &&
        (o->zero || o->optimizer == MT_OPT_ADAMW8 || o->optimizer == MT_OPT_ADAMW4))
        return cli_bad_usage("--tp %ld with --save or --resume needs --zero 0 and 32-bit optimizer "
                             "state (a training-state file of tensor parallel holds each split "
                             "tensor's state element by element)", o->tp);
    if (o->pp > 1 && o->tp > 1 && (o->save || o->resume) && o->zero)
        return cli_bad_usage("--pp %ld --tp %ld with --save or --resume needs --zero 0 (a "
                             "training-state file of pipeline and tensor parallel is put "
                             "together from whole parts)", o->pp, o->tp);
    if (o->sp && o->tp < 2)
        return cli_bad_usage("%s", "--sp needs --tp T with T > 1 (it splits a tensor group's rows)");
    if (o->tp > 1 && o->ranks > 1 && o->ranks % o->tp)
        return cli_bad_usage("--tp %ld does not divide --ranks %ld (the ranks form data-parallel "
                             "groups of tensor groups)", o->tp, o->ranks);
    if (o->pp > 1 && o->ranks > 1 && o->ranks % (o->tp * o->pp))
        return cli_bad_usage("--ranks %ld is not a multiple of --tp %ld x --pp %ld (the ranks "
                             "form a grid: dp x tp x pp)", o->ranks, o->tp, o->pp);
    if (o->rank >= o->ranks)
        return cli_bad_usage("--rank %ld is not a rank of --ranks %ld", o->rank, o->ranks);
    if (o->ranks / (o->tp * o->pp) > o->batch) /* (a tensor or pipeline group shares its rows) */
        return cli_bad_usage("--batch %ld is less than --ranks %ld%s%s (every %s needs a row)",
                             o->batch, o->ranks, o->tp > 1 ? " / --tp" : "",
                             o->pp > 1 ? " / --pp" : "",
                             o->tp > 1 || o->pp > 1 ? "data-parallel group" : "rank");
    return 0;
}

/* What the options leave to the model or the command, and what cannot go
 * together. */
static int settle(cli_opts *o)
{
    const unsigned cmd = o->cmd;
    char names[256];
    not_for_model(o, names, sizeof names);
    if (names[0]) {
        fprintf(stderr, "%s: %s: not for %s\n(run '%s %s --help')\n", cli_prog, names,
                o->gpt ? "a GPT (--model gpt)" : "the MLP (--model mlp)", cli_prog,
                cmd == CLI_ESTIMATE ? "estimate" : cmd == CLI_SAMPLE ? "sample" : "train");
        return EXIT_USAGE;
    }
    if (!given(o, "--batch")) o->batch = o->gpt ? 8 : 64;
    if (!given(o, "--optimizer") && !o->gpt) o->optimizer = MT_OPT_SGD;
    if (!given(o, "--clip")) o->clip = o->gpt ? 1.0f : 0.0f;
    int rc = check_together(o);
    if (rc) return rc;
    if (o->llmc && (given(o, "--layers") || given(o, "--heads") || given(o, "--channels") ||
                    given(o, "--vocab") || given(o, "--max-seq")))
        return cli_bad_usage("%s", "--layers, --heads, --channels, --vocab and --max-seq come "
                                   "from the --llmc file");
    if (o->data && given(o, "--vocab"))
        return cli_bad_usage("%s", "--vocab comes from the --data file");
    if (cmd == CLI_ESTIMATE) {
        if (o->autofit && !o->budget_mib) return cli_bad_usage("%s", "--autofit needs --budget");
        if (o->allow8 && !o->autofit) return cli_bad_usage("%s", "--allow-8bit is for --autofit");
        if (o->layout && (!o->autofit || o->ranks < 2))
            return cli_bad_usage("%s", "--layout auto is for --autofit with --ranks N > 1");
        if (o->offload_dir && !o->autofit && o->offload != MT_PLACE_DISK)
            return cli_bad_usage("%s", "--offload-dir is for --autofit (or --offload disk)");
        if (o->allow4 && !o->autofit) return cli_bad_usage("%s", "--allow-4bit is for --autofit");
        if (o->offload_params && o->offload != MT_PLACE_DISK)
            return cli_bad_usage("%s", "--offload-params needs --offload disk");
        if (o->recompute == MT_RECOMPUTE_BUDGET && !o->budget_mib)
            return cli_bad_usage("%s", "--recompute budget needs --budget");
        return 0;
    }
    if (o->save_every && !o->save) return cli_bad_usage("%s", "--save-every needs --save");
    if (o->lora && o->load_lora)
        return cli_bad_usage("%s", "--load-lora gives the adapters (rank, alpha, weights): no --lora");
    if (o->offload_dir && o->offload != MT_PLACE_DISK)
        return cli_bad_usage("%s", "--offload-dir needs --offload disk");
    if (o->offload_params && o->offload != MT_PLACE_DISK)
        return cli_bad_usage("%s", "--offload-params needs --offload disk");
    if (o->cmd == CLI_TRAIN && o->offload == MT_PLACE_DISK && !o->offload_dir)
        return cli_bad_usage("%s", "--offload disk needs --offload-dir DIR (where the scratch "
                                   "files go)");
    if (!o->teacher && (given(o, "--distill-alpha") || given(o, "--distill-temp") ||
                        given(o, "--teacher-base")))
        return cli_bad_usage("%s", "--distill-alpha, --distill-temp and --teacher-base need "
                                   "--teacher FILE");
    if (!o->lora && (given(o, "--lora-alpha") || given(o, "--lora-targets")))
        return cli_bad_usage("%s", "--lora-alpha and --lora-targets need --lora R");
    if (!o->lora && !o->load_lora && (o->merge_lora || o->save_lora))
        return cli_bad_usage("%s", "--merge-lora and --save-lora need --lora R or --load-lora FILE");
    if ((o->lora || o->load_lora) && o->export_llmc && !o->merge_lora)
        return cli_bad_usage("%s", "--export-llmc with --lora needs --merge-lora (the llm.c file "
                                   "holds the merged weights)");
    if (cmd == CLI_TRAIN) {
        const char *const outs[] = {"--save", "--trace", "--svg", "--chrome", "--export-llmc",
                                    "--save-lora"};
        const char *const paths[] = {o->save, o->trace, o->svg, o->chrome, o->export_llmc,
                                     o->save_lora};
        for (int i = 0; i < 6 && !rc; i++) rc = paths[i] ? check_output(outs[i], paths[i]) : 0;
        if (rc) return rc;
    }
    if (o->report < 0) o->report = !o->json; /* the memory report unless JSON only is asked for */
    if (cmd == CLI_SAMPLE && (!o->gpt || !o->resume))
        return cli_bad_usage("%s", "sample needs --model gpt and --resume FILE (a checkpoint of it)");
    if (o->gpt && !o->eval_every) o->eval_every = o->every * 4;
    return 0;
}

int cli_parse(unsigned cmd, const char *head, int argc, char **argv, cli_opts *o, bool *done)
{
    defaults(o, cmd);
    *done = false;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            cli_usage(stdout, cmd, head);
            *done = true;
            return 0;
        }
        const opt *p = find(a, cmd);
        if (!p) return cli_bad_usage("unknown option '%s'", a);
        if (!strcmp(a, "--config"))
            return cli_bad_usage("%s", "--config inside a configuration file");
        const char *v = NULL;
        if (p->kind != K_FLAG) {
            if (i + 1 >= argc) return cli_bad_usage("option '%s' needs a value", a);
            v = argv[++i];
        }
        if (set(p, o, v)) {
            char range[96];
            range_text(p, range, sizeof range);
            fprintf(stderr, "%s: bad %s '%s'%s%s\n(run '%s --help')\n", cli_prog, a, v,
                    p->kind == K_FN ? " " : ": ", range, cli_prog);
            return EXIT_USAGE;
        }
        o->text[p - table] = v ? v : "";
    }
    return settle(o);
}

int cli_option_count(void) { return (int)N_OPTS; }

const char *cli_option_given(const cli_opts *o, int i, const char **text, char *buf, size_t cap)
{
    *text = NULL;
    if (i < 0 || i >= (int)N_OPTS) return NULL;
    const opt *p = &table[i];
    /* each rank's own under mpirun: its scratch directory */
    if (!p->name || !(p->cmds & o->cmd) || !strcmp(p->name, "--offload-dir")) return NULL;
    if (!o->text[i]) return p->name;
    *text = o->text[i];
    if (p->fn == add_freeze) { /* (repeatable: every pattern) */
        size_t at = 0;
        buf[0] = 0;
        for (int k = 0; k < o->n_freeze && at < cap; k++)
            at += (size_t)snprintf(buf + at, cap - at, "%s%s", k ? "," : "", o->freeze[k]);
        *text = buf;
    }
    return p->name;
}

/* ---- what the options give ---- */

mt_base_format cli_spec_base(const cli_opts *o)
{
    return o->lora || o->load_lora ? o->base : MT_BASE_FULL;
}

int cli_deferred(const cli_opts *o)
{
    return (o->zero == 3 || o->offload_params || o->tp > 1 || o->pp > 1) &&
           cli_spec_base(o) == MT_BASE_FULL &&
           !o->lora && !o->load_lora;
}

void cli_trainer_config(const cli_opts *o, mt_trainer_config *tc)
{
    mt_trainer_config_init(tc);
    tc->max_batch = (int)o->batch;
    tc->optimizer = o->optimizer;
    tc->lr = given(o, "--lr") ? o->lr : (o->optimizer == MT_OPT_SGD ? 0.1f : 3e-3f);
    tc->momentum = o->optimizer == MT_OPT_SGD ? o->momentum : 0.0f;
    tc->weight_decay = o->wd;
    tc->precision = o->precision;
    tc->max_seq = o->gpt ? (int)o->seq : 0;
    tc->micro_batch = (int)o->micro;
    tc->master_weights = !o->no_master;
    tc->fused_step = o->fused;
    tc->local_sgd_every = (int)o->local_sgd;
    tc->zero_stage = (int)o->zero;
    tc->tensor_parallel = (int)o->tp;
    tc->sequence_parallel = o->sp;
    tc->pipeline_parallel = (int)o->pp;
    tc->zero3_prefetch = (int)o->zero3_prefetch;
    tc->zero3_keep = (int)o->zero3_keep;
    tc->grad_clip = o->clip;
    tc->recompute = o->recompute;
    tc->recompute_every = o->recompute_every;
    tc->freeze = o->freeze;
    tc->n_freeze = o->n_freeze;
    tc->lora.rank = (int)o->lora;
    tc->lora.alpha = o->lora_alpha;
    tc->lora.targets = o->lora_targets;
    tc->lora.seed = (uint64_t)o->seed;
    tc->base = o->base;
    tc->distill_alpha = o->distill_alpha; /* (the teacher: the caller's, from o->teacher) */
    tc->distill_temp = o->distill_temp;
    tc->offload = o->offload;
    tc->offload_dir = o->offload_dir;
    tc->offload_params = o->offload_params;
    tc->prune = o->prune;
    if (o->prune.method) {
        tc->prune.calib = (int)o->calib;
        tc->prune.at = o->prune_at;
        tc->prune.start = o->prune_start;
        tc->prune.end = given(o, "--prune-end") ? o->prune_end
                        : o->prune_start > o->steps / 2 ? o->prune_start
                                                        : o->steps / 2;
        const long ramp = tc->prune.end - o->prune_start;
        tc->prune.every = given(o, "--prune-every") ? o->prune_every : ramp / 10 > 1 ? ramp / 10 : 1;
        tc->prune.regrow_every = o->regrow_every;
        tc->prune.regrow_end = given(o, "--regrow-end") ? o->regrow_end
                               : o->steps * 3 / 4 > 1 ? o->steps * 3 / 4 : 1;
    }
    tc->offload_params = o->offload_params;
    if (o->cmd == CLI_ESTIMATE || !o->gpt) return;
    tc->lr_schedule = o->constant_lr ? MT_LR_CONSTANT : MT_LR_WARMUP_COSINE;
    tc->warmup_steps = (int)(o->steps / 10 > 0 ? o->steps / 10 : 1);
    tc->total_steps = (int)(o->steps > tc->warmup_steps ? o->steps : tc->warmup_steps + 1);
    tc->min_lr_ratio = 0.1f;
}

void cli_mlp_spec(const cli_opts *o, mt_mlp_spec *spec)
{
    mt_mlp_spec_init(spec);
    spec->n_layers = o->n_hidden + 1;
    spec->dims[0] = 2;
    for (int i = 0; i < o->n_hidden; i++) spec->dims[i + 1] = o->hidden[i];
    spec->dims[o->n_hidden + 1] = 3;
    spec->activation = o->act;
    spec->seed = (uint64_t)o->seed;
    spec->deferred = cli_deferred(o);
}

void cli_json_num(FILE *f, const char *key, const char *fmt, double v)
{
    fprintf(f, ", \"%s\": ", key);
    if (isfinite(v)) fprintf(f, fmt, v);
    else fputs("null", f);
}

void cli_json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

const char *cli_device_label(mt_context *ctx)
{
    static char label[320];
    const char *name = mt_context_device_name(ctx);
    if (strncmp(name, "CPU", 3)) return name;
    snprintf(label, sizeof label, "%s, %s kernels", name, mt_cpu_isa());
    return label;
}

void cli_print_report(mt_context *ctx, FILE *f)
{
    size_t need = 0;
    mt_memory_report(ctx, NULL, 0, &need);
    char *buf = malloc(need + 1);
    if (!buf) return;
    mt_memory_report(ctx, buf, need + 1, NULL);
    fputs(buf, f);
    free(buf);
}

int cli_prune_check(const cli_opts *o, mt_context *ctx, const mt_model *m)
{
    if (!o->prune.method) return 0;
    mt_trainer_config tc;
    cli_trainer_config(o, &tc);
    const mt_status s = mt_prune_check(m, &tc.prune);
    if (s == MT_ERR_INVALID_ARG) { /* a value that does not fit the model: bad usage */
        const char *msg = mt_last_error(ctx);
        const char *fn = "mt_prune_check: ";
        return cli_bad_usage("%s", strncmp(msg, fn, strlen(fn)) ? msg : msg + strlen(fn));
    }
    return s ? cli_lib_fail(ctx, NULL) : 0;
}
