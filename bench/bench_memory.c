/*
 * bench_memory.c - memory planning, measured: estimates against runs, peak
 * memory against batch and sequence per recompute policy, and the budget
 * policy against the fixed policies at the same memory.
 *
 * (a) GPT-2 124M, fp32 AdamW, B x T over {1, 4, 16} x {64, 256, 1024}:
 *     the estimated peak (live bytes, and the ACT class alone) with no
 *     recompute, selective, sqrt(n) and every block recomputed, and how
 *     long each estimate took.
 * (b) The same model at a few of those points, run for real (two steps,
 *     each in a child process of its own so that its peak RSS is its own):
 *     the library's accounted peak and peak reserve against the estimate,
 *     and against the process's peak RSS growth.
 * (c) The budget policy against fixed policies at the same memory: for each
 *     fixed policy its estimated peak reserve becomes the budget, and the
 *     budget policy picks the plan with the least recompute that fits; both
 *     run (median ms/step over a few steps, in turns) on a model whose
 *     activations dominate (L 12, C 512, H 8, V 8192, B 8, T 256; --quick:
 *     L 6, C 256, H 4, B 4, T 128).
 * (d) On a CUDA device: for a few configurations of the same model, the
 *     estimate made without the GPU (a dry CUDA context) against the run's
 *     accounting, and the accounting against the driver: the device memory
 *     the run took (cuMemGetInfo, from the context's creation to the end of
 *     two steps) against the allocators' reserve. Skipped without a GPU;
 *     MT_FAKE_CUDA and MT_FAKE_CUBLASLT (the test suite's stand-ins) run it
 *     with no GPU, as a check of the section itself.
 * (e) ZeRO: GPT-2 124M, B4 T64 per rank, AdamW in fp32 and in bf16 with
 *     masters, 8-bit AdamW in bf16 without masters, on N = 1, 2, 4 ranks at
 *     stages 0, 1, 2: each class's peak on
 *     rank 0 and on the last rank (estimates of each rank, which equal its
 *     run to the byte), and OPTIM + MASTER per rank against 1/N of one
 *     rank's (docs/memory.md has the per-rank formulas).
 *
 * Usage: bench_memory [--quick] [--threads N] [--sections abcde]
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "memtrain.h"
#include "common.h"

static bool quick;
static int threads = 0;
static const char *sections = "abcde";

static double mib(uint64_t b) { return (double)b / 1048576.0; }

static void die(mt_context *ctx, const char *what, mt_status s)
{
    fprintf(stderr, "%s: %s (%s)\n", what, mt_status_string(s), mt_last_error(ctx));
    exit(1);
}

static void context_config(mt_context_config *cc)
{
    mt_context_config_init(cc);
    cc->device = MT_DEVICE_CPU;
    cc->threads = threads;
}

typedef struct policy {
    const char *name;
    mt_recompute_policy rc;
    int every;
} policy;

static const policy policies[] = {{"none", MT_RECOMPUTE_NONE, 0},
                                  {"selective", MT_RECOMPUTE_SELECTIVE, 0},
                                  {"sqrt", MT_RECOMPUTE_SQRT, 0},
                                  {"every:1", MT_RECOMPUTE_EVERY_K, 1}};
#define N_POL 4

static void trainer_config(mt_trainer_config *tc, int B, int T, const policy *p)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B;
    tc->max_seq = T;
    tc->optimizer = MT_OPT_ADAMW;
    tc->lr = 1e-4f;
    tc->recompute = p->rc;
    tc->recompute_every = p->every ? p->every : 2;
}

/* ---- (a) estimates ---- */

static void sweep(void)
{
    static const int Bs[] = {1, 4, 16}, Ts[] = {64, 256, 1024};
    mt_context_config cc;
    context_config(&cc);
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    printf("\n## (a) Estimated peak, GPT-2 124M, fp32 AdamW, by batch, sequence and recompute "
           "policy\n\n");
    printf("Peak of live bytes over the run (MiB; ACT class peak in brackets), from "
           "mt_estimate_gpt; the last column is the slowest estimate of the row.\n\n");
    printf("| B | T | tokens |");
    for (int p = 0; p < N_POL; p++) printf(" %s |", policies[p].name);
    printf(" estimate ms |\n|---|---|---|");
    for (int p = 0; p < N_POL; p++) printf("---|");
    printf("---|\n");
    for (int bi = 0; bi < 3; bi++)
        for (int ti = 0; ti < 3; ti++) {
            int B = Bs[bi], T = Ts[ti];
            if (quick && B * T > 4096) continue;
            printf("| %d | %d | %d |", B, T, B * T);
            double slow = 0;
            for (int p = 0; p < N_POL; p++) {
                mt_trainer_config tc;
                trainer_config(&tc, B, T, &policies[p]);
                mt_estimate_report e;
                double t0 = now_s();
                mt_status s = mt_estimate_gpt(&cc, &g, &tc, &e);
                double ms = 1e3 * (now_s() - t0);
                if (s) die(NULL, "mt_estimate_gpt", s);
                if (ms > slow) slow = ms;
                printf(" %.1f (%.1f) |", mib(e.peak), mib(e.class_peak[MT_MEM_ACT]));
            }
            printf(" %.2f |\n", slow);
            fflush(stdout);
        }
}

/* ---- (b) runs against estimates, each in a child process ---- */

static double rss_kib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss;
}

typedef struct run_result {
    uint64_t est_peak, est_reserved, peak, reserved, reserved_end;
    double rss_growth_mib;
    double device_mib; /* device memory the run took, as the driver reports it */
    int ok;
} run_result;

/* tokens for B rows of T (targets: the next ones), *ids to free */
static mt_batch token_batch(int B, int T, int vocab, int32_t **ids)
{
    size_t n = (size_t)B * T + 1;
    *ids = malloc(n * sizeof **ids);
    if (!*ids) die(NULL, "tokens", MT_ERR_OOM);
    for (size_t i = 0; i < n; i++) (*ids)[i] = (int32_t)((i * 2654435761u) % (unsigned)vocab);
    return (mt_batch){.n = B, .tokens = *ids, .targets = *ids + 1, .seq_len = T};
}

/* The estimate, then the run (model, trainer, two steps of the largest
 * batch) on a context made from cc: its accounting, the process's peak RSS
 * growth and the device memory it took, from before the context to the end. */
static run_result measure(const mt_context_config *cc, const mt_gpt_spec *g,
                          const mt_trainer_config *tc)
{
    run_result r = {0};
    mt_estimate_report e;
    mt_status s = mt_estimate_gpt(cc, g, tc, &e);
    if (s) die(NULL, "mt_estimate_gpt", s);
    double rss0 = rss_kib();
    mt_context *ctx;
    if ((s = mt_context_create(cc, &ctx))) die(NULL, "mt_context_create", s);
    uint64_t free0, free1;
    if ((s = mt_context_device_memory(ctx, &free0, NULL))) die(ctx, "device memory", s);
    mt_model *m;
    mt_trainer *t;
    if ((s = mt_model_gpt_create(ctx, g, &m))) die(ctx, "mt_model_gpt_create", s);
    if ((s = mt_trainer_create(m, tc, &t))) die(ctx, "mt_trainer_create", s);
    int32_t *ids;
    mt_batch b = token_batch(tc->max_batch, tc->max_seq, g->vocab, &ids);
    for (int i = 0; i < 2; i++)
        if ((s = mt_trainer_step(t, &b, NULL))) die(ctx, "mt_trainer_step", s);
    if ((s = mt_context_device_memory(ctx, &free1, NULL))) die(ctx, "device memory", s);
    mt_memory_stats st;
    mt_context_memory_stats(ctx, &st);
    r.est_peak = e.peak, r.est_reserved = e.peak_reserved;
    r.peak = st.peak_live_bytes, r.reserved = st.peak_reserved_bytes;
    r.reserved_end = st.reserved_bytes;
    r.rss_growth_mib = (rss_kib() - rss0) / 1024.0;
    r.device_mib = ((double)free0 - (double)free1) / 1048576.0;
    r.ok = 1;
    free(ids);
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return r;
}

static void measured_child(int B, int T, const policy *p, int fd)
{
    mt_context_config cc;
    context_config(&cc);
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    mt_trainer_config tc;
    trainer_config(&tc, B, T, p);
    run_result r = measure(&cc, &g, &tc);
    if (write(fd, &r, sizeof r) != (ssize_t)sizeof r) _exit(1);
    _exit(0);
}

static void measured(void)
{
    static const struct {
        int B, T, p;
    } pts[] = {{4, 64, 0}, {4, 64, 2}, {4, 256, 0}, {4, 256, 1}, {4, 256, 3}, {1, 1024, 2}};
    const int npts = quick ? 2 : (int)(sizeof pts / sizeof *pts);
    printf("\n## (b) Estimate vs run, GPT-2 124M, fp32 AdamW, two steps, a process each\n\n");
    printf("| B | T | policy | estimated peak MiB | accounted peak MiB | estimated reserve MiB | "
           "reserved peak MiB | peak RSS growth MiB | RSS growth / accounted peak |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < npts; i++) {
        int fds[2];
        if (pipe(fds)) exit(1);
        fflush(stdout); /* the child must not print what is buffered again */
        pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            measured_child(pts[i].B, pts[i].T, &policies[pts[i].p], fds[1]);
        }
        close(fds[1]);
        run_result r = {0};
        ssize_t got = read(fds[0], &r, sizeof r);
        close(fds[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        if (got != (ssize_t)sizeof r || !r.ok) {
            printf("| %d | %d | %s | (the run failed) |\n", pts[i].B, pts[i].T,
                   policies[pts[i].p].name);
            continue;
        }
        printf("| %d | %d | %s | %.2f | %.2f | %.2f | %.2f | %.1f | %.3f |\n", pts[i].B, pts[i].T,
               policies[pts[i].p].name, mib(r.est_peak), mib(r.peak), mib(r.est_reserved),
               mib(r.reserved), r.rss_growth_mib, r.rss_growth_mib / mib(r.peak));
        fflush(stdout);
    }
}

/* ---- (c) the budget policy against fixed policies at the same memory ---- */

typedef struct runner {
    mt_context *ctx;
    mt_model *m;
    mt_trainer *t;
    int32_t *ids;
    mt_batch b;
} runner;

static void runner_open(runner *r, const mt_gpt_spec *g, const mt_trainer_config *tc)
{
    mt_context_config cc;
    context_config(&cc);
    mt_status s;
    if ((s = mt_context_create(&cc, &r->ctx))) die(NULL, "mt_context_create", s);
    if ((s = mt_model_gpt_create(r->ctx, g, &r->m))) die(r->ctx, "mt_model_gpt_create", s);
    if ((s = mt_trainer_create(r->m, tc, &r->t))) die(r->ctx, "mt_trainer_create", s);
    r->b = token_batch(tc->max_batch, tc->max_seq, g->vocab, &r->ids);
    mt_context_reset_peaks(r->ctx);
}

static double runner_step(runner *r)
{
    double t0 = now_s();
    mt_status s = mt_trainer_step(r->t, &r->b, NULL);
    if (s) die(r->ctx, "mt_trainer_step", s);
    return 1e3 * (now_s() - t0);
}

static void runner_close(runner *r)
{
    mt_trainer_destroy(r->t);
    mt_model_destroy(r->m);
    mt_context_destroy(r->ctx);
    free(r->ids);
}

/* One run of cfg (or of the budget policy at budget, when budget > 0)
   beside the baseline, in turns: median ms/step of each. */
typedef struct side {
    double ms, base_ms;
    uint64_t reserve, act;
    char plan[96];
} side;

static void plan_words(const runner *r, char *buf, size_t cap)
{
    unsigned char units[256];
    int seg, U = mt_model_num_units(r->m), rec = 0, sel = 0;
    mt_trainer_recompute_plan(r->t, units, 256, &seg);
    for (int u = 0; u < U; u++) rec += units[u] == MT_UNIT_RECOMPUTE, sel += units[u] == MT_UNIT_SELECTIVE;
    if (!rec && !sel) snprintf(buf, cap, "no recompute");
    else if (!rec) snprintf(buf, cap, "selective in %d of %d units", sel, U);
    else snprintf(buf, cap, "%d of %d units recomputed (segments of %d)%s", rec, U, seg,
                  sel ? ", the rest selective" : "");
}

static side run_beside(const mt_gpt_spec *g, const mt_trainer_config *base,
                       const mt_trainer_config *tc, int steps)
{
    runner a, b;
    runner_open(&a, g, base);
    runner_open(&b, g, tc);
    side r = {0};
    plan_words(&b, r.plan, sizeof r.plan);
    double ta[16], tb[16];
    for (int i = -1; i < steps; i++) {
        double x = runner_step(&a), y = runner_step(&b);
        if (i >= 0) ta[i] = x, tb[i] = y;
    }
    mt_memory_stats st;
    mt_context_memory_stats(b.ctx, &st);
    r.reserve = st.peak_reserved_bytes;
    r.act = st.per_class[MT_MEM_ACT].peak_live_bytes;
    r.ms = median(tb, steps), r.base_ms = median(ta, steps);
    runner_close(&a);
    runner_close(&b);
    return r;
}

static void budget_vs_fixed(void)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 8192, g.max_seq = quick ? 128 : 256;
    g.layers = quick ? 6 : 12, g.channels = quick ? 256 : 512, g.heads = quick ? 4 : 8;
    const int B = quick ? 4 : 8, T = g.max_seq, steps = quick ? 3 : 5;
    printf("\n## (c) Budget policy vs fixed policies\n\n");
    printf("GPT L %d C %d H %d V %d, B %d T %d, fp32 AdamW. Each row runs beside the same model "
           "with no recompute, in turns (median ms/step over %d steps after one), so its time is "
           "read against that run's. Budget rows: MT_RECOMPUTE_BUDGET with the budget named "
           "(a fixed policy's estimated peak reserve, or points between no recompute's and the "
           "least any plan needs).\n\n",
           g.layers, g.channels, g.heads, g.vocab, B, T, steps);
    printf("| run | budget MiB | plan | peak reserve MiB | reserve / none | ACT peak MiB | "
           "ms/step | ms/step / none |\n|---|---|---|---|---|---|---|---|\n");
    mt_context_config cc;
    context_config(&cc);
    mt_trainer_config none;
    trainer_config(&none, B, T, &policies[0]);
    mt_estimate_report en;
    mt_status s = mt_estimate_gpt(&cc, &g, &none, &en);
    if (s) die(NULL, "mt_estimate_gpt", s);
    for (int p = 1; p < N_POL; p++) {
        mt_trainer_config fixed;
        trainer_config(&fixed, B, T, &policies[p]);
        mt_estimate_report e;
        if ((s = mt_estimate_gpt(&cc, &g, &fixed, &e))) die(NULL, "mt_estimate_gpt", s);
        for (int v = 0; v < 2; v++) {
            mt_trainer_config tc = fixed;
            if (v) tc.recompute = MT_RECOMPUTE_BUDGET, tc.memory_budget = e.peak_reserved;
            side r = run_beside(&g, &none, &tc, steps);
            char name[64];
            snprintf(name, sizeof name, v ? "budget = %s's" : "%s", policies[p].name);
            char bud[32];
            snprintf(bud, sizeof bud, v ? "%.1f" : "(%.1f)", mib(e.peak_reserved));
            printf("| %s | %s | %s | %.1f | %.2fx | %.1f | %.0f | %.2fx |\n", name, bud, r.plan,
                   mib(r.reserve),
                   (double)r.reserve / (double)en.peak_reserved, mib(r.act), r.ms, r.ms / r.base_ms);
            fflush(stdout);
        }
    }
    /* budgets between no recompute's need and the least: read the least
       from MT_ERR_BUDGET's message */
    uint64_t least = 0;
    {
        mt_trainer_config tc = none;
        tc.recompute = MT_RECOMPUTE_BUDGET, tc.memory_budget = 1;
        mt_context *ctx = NULL;
        mt_model *m = NULL;
        mt_trainer *t;
        if ((s = mt_context_create(&cc, &ctx)) || (s = mt_model_gpt_create(ctx, &g, &m)))
            die(NULL, "setup", s);
        if (mt_trainer_create(m, &tc, &t) == MT_ERR_BUDGET) {
            const char *at = strstr(mt_last_error(ctx), "can take is ");
            if (at) least = strtoull(at + strlen("can take is "), NULL, 10);
        }
        mt_model_destroy(m);
        mt_context_destroy(ctx);
    }
    for (int f = 1; f <= 4 && least; f++) {
        uint64_t budget = en.peak_reserved - (en.peak_reserved - least) * (uint64_t)f / 4;
        mt_trainer_config tc = none;
        tc.recompute = MT_RECOMPUTE_BUDGET, tc.memory_budget = budget;
        side r = run_beside(&g, &none, &tc, steps);
        printf("| budget %d/4 of the way to the least | %.1f | %s | %.1f | %.2fx | %.1f | %.0f | "
               "%.2fx |\n",
               f, mib(budget), r.plan, mib(r.reserve),
               (double)r.reserve / (double)en.peak_reserved, mib(r.act), r.ms, r.ms / r.base_ms);
        fflush(stdout);
    }
    printf("\n(fixed rows show the policy's estimated peak reserve in brackets; no recompute "
           "needs %.1f MiB, the least any plan needs %.1f MiB)\n",
           mib(en.peak_reserved), mib(least));
}

/* ---- (d) CUDA: estimate, accounting and driver ---- */

static void on_cuda(void)
{
    mt_context_config cc;
    context_config(&cc);
    cc.device = MT_DEVICE_CUDA;
    cc.cuda_driver_path = getenv("MT_FAKE_CUDA");
    cc.cublaslt_path = getenv("MT_FAKE_CUBLASLT");
    mt_context *ctx;
    printf("\n(d) CUDA: estimate (made without the GPU) vs run vs driver, two steps\n");
    if (mt_context_create(&cc, &ctx)) {
        printf("    skipped: %s\n", mt_last_error(NULL));
        return;
    }
    printf("    device: %s%s\n", mt_context_device_name(ctx),
           cc.cublaslt_path ? " (the stand-in driver and cuBLASLt: no GPU)" : "");
    mt_context_destroy(ctx);
    static const struct {
        const char *name;
        mt_precision prec;
        int masters;
        mt_optimizer_kind opt;
        int pol, fused, B, T;
    } cfgs[] = {{"fp32 AdamW", MT_PREC_FP32, 1, MT_OPT_ADAMW, 0, 0, 4, 256},
                {"bf16 AdamW sqrt", MT_PREC_BF16, 1, MT_OPT_ADAMW, 2, 0, 8, 512},
                {"bf16 AdamW8 fused selective", MT_PREC_BF16, 1, MT_OPT_ADAMW8, 1, 1, 8, 1024},
                {"bf16 no masters AdamW8 fused sqrt", MT_PREC_BF16, 0, MT_OPT_ADAMW8, 2, 1, 16, 1024}};
    printf("    %-34s %10s %10s %10s %10s %10s %7s\n", "config", "est peak", "peak", "est resv",
           "reserved", "driver", "drv/res");
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) {
        mt_gpt_spec g;
        mt_gpt_spec_init(&g);
        int B = cfgs[i].B, T = cfgs[i].T;
        if (quick) g.layers = 2, g.channels = 256, g.heads = 4, g.vocab = 8192, B = 2, T = 128;
        mt_trainer_config tc;
        trainer_config(&tc, B, T, &policies[cfgs[i].pol]);
        tc.precision = cfgs[i].prec, tc.master_weights = cfgs[i].masters;
        tc.optimizer = cfgs[i].opt, tc.fused_step = cfgs[i].fused;
        run_result r = measure(&cc, &g, &tc);
        printf("    %-34s %10.2f %10.2f %10.2f %10.2f %10.2f %7.3f\n", cfgs[i].name, mib(r.est_peak),
               mib(r.peak), mib(r.est_reserved), mib(r.reserved), r.device_mib,
               r.device_mib / mib(r.reserved_end));
    }
    printf("    MiB; driver = device memory the run took (cuMemGetInfo), drv/res = that over the\n"
           "    allocators' reserve at the end (the caching allocator keeps its peak reserve)\n");
}

/* ---- (e) ZeRO, per rank ---- */

static void zero_ranks(void)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    printf("\n## (e) ZeRO: each rank's memory, GPT-2 124M, B4 T64 per rank\n\n");
    printf("Per-class peaks of one rank (MiB; estimates, which equal the rank's run to the\n"
           "byte), rank 0 and the last rank; om - 1/N: the rank's OPTIM + MASTER less 1/N of\n"
           "one rank's, in bytes (the padding of the slices).\n\n");
    printf("| run | N | stage | rank |");
    for (int k = 0; k < MT_MEM_COUNT; k++) printf(" %s |", mt_mem_class_name((mt_mem_class)k));
    printf(" peak | om - 1/N |\n|---|---|---|---|");
    for (int k = 0; k < MT_MEM_COUNT; k++) printf("---|");
    printf("---|---|\n");
    static const struct {
        const char *name;
        mt_precision prec;
        mt_optimizer_kind opt;
        int masters;
    } runs[] = {{"fp32 AdamW", MT_PREC_FP32, MT_OPT_ADAMW, 1},
                {"bf16 AdamW, masters", MT_PREC_BF16, MT_OPT_ADAMW, 1},
                {"bf16 8-bit AdamW, no masters", MT_PREC_BF16, MT_OPT_ADAMW8, 0}};
    for (int pi = 0; pi < 3; pi++) {
        uint64_t om1 = 0;
        for (int n = 1; n <= 4; n *= 2)
            for (int st = 0; st <= (n > 1 ? 2 : 0); st++)
                for (int r = 0; r < n; r += n > 1 ? n - 1 : 1) {
                    mt_context_config cc;
                    context_config(&cc);
                    cc.world_size = n;
                    cc.rank = r;
                    mt_trainer_config tc;
                    trainer_config(&tc, 4, 64, &policies[0]);
                    tc.precision = runs[pi].prec;
                    tc.optimizer = runs[pi].opt;
                    tc.master_weights = runs[pi].masters;
                    tc.zero_stage = st;
                    mt_estimate_report e;
                    mt_status s = mt_estimate_gpt(&cc, &g, &tc, &e);
                    if (s) die(NULL, "mt_estimate_gpt", s);
                    const uint64_t *c = e.class_peak;
                    uint64_t om = c[MT_MEM_OPTIM] + c[MT_MEM_MASTER];
                    if (n == 1) om1 = om;
                    printf("| %s | %d | %d | %d |", runs[pi].name, n, st, r);
                    for (int k = 0; k < MT_MEM_COUNT; k++) printf(" %.1f |", mib(c[k]));
                    printf(" %.1f | %lld |\n", mib(e.peak), (long long)om - (long long)(om1 / (uint64_t)n));
                    fflush(stdout);
                }
    }
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--sections") && i + 1 < argc) sections = argv[++i];
        else {
            fprintf(stderr, "usage: bench_memory [--quick] [--threads N] [--sections abcde]\n");
            return 2;
        }
    }
    printf("# bench_memory (memtrain %s)\n", mt_version());
    if (strchr(sections, 'a')) sweep();
    if (strchr(sections, 'b')) measured();
    if (strchr(sections, 'c')) budget_vs_fixed();
    if (strchr(sections, 'd')) on_cuda();
    if (strchr(sections, 'e')) zero_ranks();
    return 0;
}
