/*
 * bench_offload.c - disk offload of the optimizer state and masters
 * against the resident run: peak RSS and step time of GPT-2 124M (fp32
 * AdamW by default, the fused step), each run in a child process, with the
 * disk's own O_DIRECT bandwidth measured beside it.
 *
 *   bench_offload --dir DIR [--steps N] [--batch B] [--seq T] [--threads N]
 *                 [--precision fp32|bf16] [--optimizer NAME] [--unfused] [--sqrt]
 *                 [--disk-only] (a model the resident run would not fit)
 *                 [--params] (a third run: the weights on disk too, offload_params,
 *                 the model created straight there, mt_gpt_spec.deferred)
 *                 [--layers L --heads H --channels C]
 *                 [--lr X] [--repeat] (the same batch every step: the loss falls)
 *
 * Each step's loss and time go to stderr as they come (a large model's
 * steps take a while); the steps' own peak RSS (VmHWM, reset once the
 * trainer is made, so without the setup's) beside the whole run's, and the
 * trainer's end's (reset before mt_trainer_destroy, which gives the model
 * its weights back whole; with the weights on disk the run ends with
 * mt_trainer_destroy_with_model, which does not).
 *
 * (make bench-offload; docs/benchmarks.md, "Disk offload")
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "memtrain.h"

typedef struct opts {
    const char *dir;
    int steps, batch, seq, threads, fused, sqrt_recompute, disk_only, params, repeat;
    float lr;
    mt_precision prec;
    mt_optimizer_kind opt;
    mt_gpt_spec spec;
} opts;

typedef struct result {
    int ok;
    double step_s, first_loss, last_loss, setup_s, model_s;
    long rss_kib, setup_rss_kib, step_rss_kib, end_rss_kib;
    uint64_t device_peak, disk_peak, optim_dev, master_dev, param_dev;
    uint64_t dev_class[MT_MEM_COUNT], disk_class[MT_MEM_COUNT];
    char err[256];
} result;

/* The process's peak RSS since the last reset_hwm (VmHWM), KiB; -1 unknown. */
static long hwm_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) v = strtol(line + 6, NULL, 10);
    if (f) fclose(f);
    return v;
}

/* Resets VmHWM to the current RSS (Linux: 5 into clear_refs). */
static void reset_hwm(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) fputs("5", f), fclose(f);
}

/* One run (in a child): the model, the trainer, a warm-up step and the timed ones. */
static void run(const opts *o, mt_place place, int params, result *r)
{
    memset(r, 0, sizeof *r);
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = o->threads;
    mt_context *ctx = NULL;
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    const double t_setup = now_s();
    mt_status s = mt_context_create(&cc, &ctx);
    mt_gpt_spec spec = o->spec;
    spec.deferred = params; /* (the weights on disk: made straight there, never whole) */
    if (!s) s = mt_model_gpt_create(ctx, &spec, &m);
    r->model_s = now_s() - t_setup;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = o->batch;
    tc.max_seq = o->seq;
    tc.optimizer = o->opt;
    tc.lr = o->lr;
    tc.precision = o->prec;
    tc.fused_step = o->fused;
    tc.recompute = o->sqrt_recompute ? MT_RECOMPUTE_SQRT : MT_RECOMPUTE_NONE;
    tc.offload = place;
    tc.offload_dir = o->dir;
    tc.offload_params = params;
    if (!s) s = mt_trainer_create(m, &tc, &t);
    r->setup_s = now_s() - t_setup;
    r->setup_rss_kib = hwm_kib();
    if (!s) fprintf(stderr, "  setup %.1f s (the model %.1f s), RSS peak so far %.1f MiB\n",
                    r->setup_s, r->model_s, r->setup_rss_kib / 1024.0);
    reset_hwm(); /* (ru_maxrss follows it) */
    int32_t *tok = malloc((size_t)o->batch * o->seq * 4), *tg = malloc((size_t)o->batch * o->seq * 4);
    double *dt = malloc((size_t)(o->steps + 1) * sizeof *dt);
    uint64_t x = 88172645463325252ull;
    for (int k = 0; !s && k <= o->steps; k++) {
        for (int i = 0; i < o->batch * o->seq && (k == 0 || !o->repeat); i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            tok[i] = (int32_t)(x % 50257);
            tg[i] = (int32_t)((x >> 20) % 50257);
        }
        mt_batch b = {.n = o->batch, .tokens = tok, .targets = tg, .seq_len = o->seq};
        float loss;
        double t0 = now_s();
        s = mt_trainer_step(t, &b, &loss);
        dt[k] = now_s() - t0;
        if (!s) fprintf(stderr, "  step %d: loss %.4f, %.2f s\n", k + 1, loss, dt[k]);
        if (k == 0) r->first_loss = loss;
        r->last_loss = loss;
    }
    if (!s) {
        r->step_s = median(dt + 1, o->steps);
        mt_memory_stats st, disk;
        mt_context_memory_stats(ctx, &st);
        mt_context_place_stats(ctx, MT_PLACE_DISK, &disk);
        r->device_peak = st.peak_live_bytes;
        r->optim_dev = st.per_class[MT_MEM_OPTIM].peak_live_bytes;
        r->master_dev = st.per_class[MT_MEM_MASTER].peak_live_bytes;
        r->param_dev = st.per_class[MT_MEM_PARAM].peak_live_bytes;
        r->disk_peak = disk.peak_live_bytes;
        for (int c = 0; c < MT_MEM_COUNT; c++) {
            r->dev_class[c] = st.per_class[c].peak_live_bytes;
            r->disk_class[c] = disk.per_class[c].peak_live_bytes;
        }
        r->step_rss_kib = hwm_kib();
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        r->rss_kib = ru.ru_maxrss > r->setup_rss_kib ? ru.ru_maxrss : r->setup_rss_kib;
        r->ok = 1;
    } else {
        snprintf(r->err, sizeof r->err, "%s: %s", mt_status_string(s), mt_last_error(ctx));
    }
    reset_hwm();
    /* the end: the weights back in the model, or with --params (done with
       both) the trainer and the model freed together, nothing read back */
    if (params && t) mt_trainer_destroy_with_model(t), m = NULL;
    else mt_trainer_destroy(t);
    r->end_rss_kib = hwm_kib();
    if (r->end_rss_kib > r->rss_kib) r->rss_kib = r->end_rss_kib;
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    free(tok), free(tg), free(dt);
}

static int in_child(const opts *o, mt_place place, int params, result *r)
{
    int fd[2];
    if (pipe(fd)) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        close(fd[0]);
        result c;
        run(o, place, params, &c);
        ssize_t w = write(fd[1], &c, sizeof c);
        _exit(w == (ssize_t)sizeof c ? 0 : 1);
    }
    close(fd[1]);
    ssize_t got = read(fd[0], r, sizeof *r);
    close(fd[0]);
    int st;
    waitpid(pid, &st, 0);
    return got == (ssize_t)sizeof *r ? 0 : -1;
}

/* The disk's O_DIRECT bandwidth: 1 GiB written in 8 MiB calls (then
 * fsync), then read back, in a file in dir. */
static void disk_bandwidth(const char *dir, double *wr, double *rd)
{
    *wr = *rd = 0.0;
    char path[4096];
    snprintf(path, sizeof path, "%s/bench_offload.%ld", dir, (long)getpid());
    const size_t chunk = (size_t)8 << 20, total = (size_t)1 << 30;
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, chunk)) return;
    memset(buf, 0x5a, chunk);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd < 0) {
        free(buf);
        return;
    }
    double t0 = now_s();
    size_t done = 0;
    for (; done < total; done += chunk)
        if (pwrite(fd, buf, chunk, (off_t)done) != (ssize_t)chunk) break;
    fsync(fd);
    if (done == total) *wr = (double)total / (now_s() - t0) / 1e9;
    t0 = now_s();
    for (done = 0; done < total; done += chunk)
        if (pread(fd, buf, chunk, (off_t)done) != (ssize_t)chunk) break;
    if (done == total) *rd = (double)total / (now_s() - t0) / 1e9;
    close(fd);
    unlink(path);
    free(buf);
}

int main(int argc, char **argv)
{
    opts o = {.dir = NULL, .steps = 5, .batch = 4, .seq = 64, .threads = 0, .fused = 1, .lr = 1e-4f,
              .prec = MT_PREC_FP32, .opt = MT_OPT_ADAMW};
    mt_gpt_spec_init(&o.spec);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--unfused") || !strcmp(a, "--sqrt") || !strcmp(a, "--disk-only") ||
            !strcmp(a, "--params") || !strcmp(a, "--repeat")) {
            if (a[2] == 'u') o.fused = 0;
            else if (a[2] == 'r') o.repeat = 1;
            else if (a[2] == 's') o.sqrt_recompute = 1;
            else if (a[2] == 'p') o.params = 1;
            else o.disk_only = 1;
            continue;
        }
        if (!v) {
            fprintf(stderr, "bench_offload: %s needs a value (or is unknown)\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--dir")) o.dir = v;
        else if (!strcmp(a, "--steps")) o.steps = atoi(v);
        else if (!strcmp(a, "--batch")) o.batch = atoi(v);
        else if (!strcmp(a, "--seq")) o.seq = atoi(v);
        else if (!strcmp(a, "--threads")) o.threads = atoi(v);
        else if (!strcmp(a, "--lr")) o.lr = strtof(v, NULL);
        else if (!strcmp(a, "--layers")) o.spec.layers = atoi(v);
        else if (!strcmp(a, "--heads")) o.spec.heads = atoi(v);
        else if (!strcmp(a, "--channels")) o.spec.channels = atoi(v);
        else if (!strcmp(a, "--precision")) o.prec = !strcmp(v, "bf16") ? MT_PREC_BF16 : MT_PREC_FP32;
        else if (!strcmp(a, "--optimizer")) {
            if (mt_optimizer_by_name(v, &o.opt)) {
                fprintf(stderr, "bench_offload: %s\n", mt_last_error(NULL));
                return 2;
            }
        } else {
            fprintf(stderr, "bench_offload: unknown option %s\n", a);
            return 2;
        }
    }
    if (!o.dir || o.steps < 1) {
        fprintf(stderr, "usage: bench_offload --dir DIR [--steps N] [--batch B] [--seq T] "
                        "[--threads N] [--precision fp32|bf16] [--optimizer NAME] [--unfused] [--sqrt] [--disk-only] [--params] "
                        "[--layers L --heads H --channels C] [--lr X] [--repeat]\n");
        return 2;
    }
    double wr, rd;
    disk_bandwidth(o.dir, &wr, &rd);
    printf("disk (%s): O_DIRECT 8 MiB calls, 1 GiB: write %.2f GB/s, read %.2f GB/s\n", o.dir, wr, rd);
    printf("GPT L%d H%d C%d, B%d T%d, %s %s lr %g%s%s%s, %d timed steps (median)\n", o.spec.layers,
           o.spec.heads, o.spec.channels, o.batch, o.seq, o.prec == MT_PREC_BF16 ? "bf16" : "fp32",
           mt_optimizer_name(o.opt), (double)o.lr, o.fused ? ", fused step" : "",
           o.sqrt_recompute ? ", sqrt(n) recompute" : "", o.repeat ? ", one batch repeated" : "",
           o.steps);
    fflush(stdout);
    printf("%-9s %10s %12s %14s %12s %12s %12s %12s %10s\n", "state", "step s", "peak RSS MiB",
           "device peak MiB", "PARAM dev", "OPTIM dev", "MASTER dev", "disk MiB", "loss");
    result r[3];
    const mt_place where[3] = {MT_PLACE_DEVICE, MT_PLACE_DISK, MT_PLACE_DISK};
    static const char *const name[3] = {"resident", "disk", "+params"};
    for (int k = o.disk_only; k < 2 + o.params; k++) {
        if (in_child(&o, where[k], k == 2, &r[k]) || !r[k].ok) {
            printf("%-9s failed: %s\n", name[k], r[k].err);
            return 1;
        }
        printf("%-9s %10.3f %12.1f %14.1f %12.1f %12.1f %12.1f %12.1f %10.4f\n", name[k],
               r[k].step_s, r[k].rss_kib / 1024.0, r[k].device_peak / 1048576.0,
               r[k].param_dev / 1048576.0, r[k].optim_dev / 1048576.0, r[k].master_dev / 1048576.0,
               r[k].disk_peak / 1048576.0, r[k].last_loss);
        printf("%-9s setup %.1f s (the model %.1f s); peak RSS of the setup %.1f MiB, of the steps %.1f MiB, of the trainer's end %.1f MiB; loss %.4f -> %.4f\n",
               "", r[k].setup_s, r[k].model_s, r[k].setup_rss_kib / 1024.0,
               r[k].step_rss_kib / 1024.0, r[k].end_rss_kib / 1024.0, r[k].first_loss, r[k].last_loss);
        printf("%-9s each class's peak MiB, device / disk:", "");
        for (int c = 0; c < MT_MEM_COUNT; c++)
            if (r[k].dev_class[c] || r[k].disk_class[c])
                printf(" %s %.1f / %.1f", mt_mem_class_name((mt_mem_class)c),
                       r[k].dev_class[c] / 1048576.0, r[k].disk_class[c] / 1048576.0);
        printf("\n");
        fflush(stdout);
    }
    if (!o.disk_only)
        printf("disk / resident: peak RSS %.3fx, step time %.3fx\n",
           (double)r[1].rss_kib / (double)r[0].rss_kib, r[1].step_s / r[0].step_s);
    return 0;
}
