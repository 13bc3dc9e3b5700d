/*
 * cli_train.c - memtrain train: the MLP on spirals or a GPT on text,
 * progress lines or JSON, checkpoints, the trace and plots, the memory
 * report. The GPT's setup (cli_gpt_open) serves memtrain sample too.
 */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "memtrain/comm.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *const prec_name[] = {"fp32", "fp16", "bf16"};
_Static_assert(sizeof prec_name / sizeof *prec_name == MT_PREC_BF16 + 1, "a name per precision");

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

/* SIGINT (Ctrl-C) or SIGTERM: the run stops after the step in progress and
 * saves its checkpoint (docs/cli.md). The handler goes back to the default
 * action, so a second signal ends the process at once; a checkpoint being
 * written then leaves the previous one (lib/files/fileio.c). */
static volatile sig_atomic_t stop_signal;

static void on_stop(int sig)
{
    stop_signal = sig;
}

static void catch_stop_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

static int interrupted(long step)
{
    if (cli_world.rank == 0) /* (under mpirun every rank stops after the same step) */
        fprintf(stderr, "%s: %s after step %ld\n", cli_prog,
                stop_signal == SIGINT ? "interrupted (SIGINT)" : "stopped (SIGTERM)", step);
    return 128 + stop_signal;
}

/* The built-in corpus: the project's own README and docs, embedded at build
 * time (Makefile), so the demo needs no download. */
extern const unsigned char mt_corpus[];
extern const size_t mt_corpus_size;

/* The end of every run: the trace, the plots, the report; with --json, on
 * stderr, so that stdout holds JSON alone. */
static int finish_run(const cli_opts *o, mt_context *ctx, const mt_estimate_report *est)
{
    FILE *info = o->json ? stderr : stdout;
    if (o->trace) {
        if (mt_context_trace_write(ctx, o->trace)) return cli_lib_fail(ctx, NULL);
        fprintf(info, "allocation trace written to %s\n", o->trace);
    }
    if (o->chrome || o->svg) {
        const mt_trace_event *ev;
        size_t n;
        mt_trace *tr = NULL;
        if (mt_context_trace_events(ctx, &ev, &n, NULL) || mt_trace_from_events(ctx, ev, n, &tr) ||
            (o->chrome && mt_trace_export_chrome(ctx, tr, est, o->chrome)) ||
            (o->svg && mt_trace_export_svg(ctx, tr, est, o->svg))) {
            mt_trace_free(tr);
            return cli_lib_fail(ctx, NULL);
        }
        mt_trace_free(tr);
        if (o->chrome)
            fprintf(info, "memory timeline (Chrome trace JSON, opens in Perfetto) written to %s\n",
                    o->chrome);
        if (o->svg) fprintf(info, "memory plot (SVG) written to %s\n", o->svg);
    }
    if (o->report) {
        fprintf(info, "\n");
        cli_print_report(ctx, info);
    }
    return 0;
}

/* The members of a step's JSON object that both models write, the object
 * left open for more. */
/* The fraction of the pruned tensors' weights that are pruned (0: none). */
static double sparsity_of(const mt_model *m)
{
    uint64_t pruned = 0, total = 0;
    mt_model_sparsity(m, &pruned, &total);
    return total ? (double)pruned / (double)total : 0.0;
}

/* Before a step: Wanda's calibration, where the prune that comes with the
 * step needs it, on the next batches of the training data (next: one
 * batch, as the steps read them). 0, or an exit code. */
static int calibrate_if_due(mt_context *ctx, mt_trainer *t, int (*next)(void *u, mt_batch *b),
                            void *u)
{
    int64_t at;
    int need = 0;
    if (mt_trainer_prune_next(t, &at, &need) || at != (int64_t)mt_trainer_steps(t)) return 0;
    for (; need > 0; need--) {
        mt_batch b;
        if (next(u, &b) || mt_trainer_calibrate(t, &b)) {
            fprintf(stderr, "%s: calibrating for the prune after step %lld: %s\n", cli_prog,
                    (long long)at, mt_last_error(ctx)[0] ? mt_last_error(ctx) : mt_last_error(NULL));
            return EXIT_FAIL;
        }
    }
    return 0;
}

/* The MLP's next batch of spirals, for the calibration (cli_ranks_rows: this rank's rows). */
typedef struct mlp_feed {
    uint64_t *data;
    float *x;
    int32_t *y;
    int n;
} mlp_feed;

static int mlp_next(void *u, mt_batch *b)
{
    mlp_feed *f = u;
    spirals(f->data, f->x, f->y, f->n);
    *b = (mt_batch){.n = f->n, .inputs = f->x, .targets = f->y};
    cli_ranks_rows(b, 2);
    return 0;
}

/* The GPT's next training batch (this rank's rows). */
static int gpt_next(void *u, mt_batch *b)
{
    if (mt_data_next(u, MT_DATA_TRAIN, b)) return -1;
    cli_ranks_rows(b, 0);
    return 0;
}

static void json_step(mt_context *ctx, const mt_model *m, const mt_trainer *t, long step,
                      float loss, double ms)
{
    mt_memory_stats st;
    mt_context_memory_stats(ctx, &st);
    mt_loss_scale_state ls;
    mt_trainer_get_loss_scale(t, &ls);
    printf("{\"step\": %ld", step);
    cli_json_num(stdout, "loss", "%.6f", loss);
    cli_json_num(stdout, "lr", "%g", mt_trainer_lr(t));
    cli_json_num(stdout, "ms", "%.4f", ms);
    printf(", \"live_bytes\": %llu, \"peak_bytes\": %llu", (unsigned long long)st.live_bytes,
           (unsigned long long)st.peak_live_bytes);
    cli_json_num(stdout, "loss_scale", "%g", ls.scale);
    printf(", \"skipped\": %llu", (unsigned long long)ls.steps_skipped);
    cli_json_num(stdout, "sparsity", "%.6f", sparsity_of(m));
}

/* A step's loss that is not a number or infinite: the run stops there,
 * without a checkpoint (the last one saved stays). */
static int diverged(long step)
{
    fprintf(stderr, "%s: step %ld: the training loss is not finite: training diverged (a lower "
            "--lr, or --clip, may help)\n", cli_prog, step);
    return EXIT_DIVERGED;
}

/* Steps in a row skipped for non-finite gradients (their weights did not
 * move) after which a run stops as diverged (docs/cli.md, exit 4). */
#define SKIPPED_IN_ROW_STOP 10

/* After a step: counts the steps skipped in a row (*in_row), and when
 * SKIPPED_IN_ROW_STOP have been, says so and gives EXIT_DIVERGED (else 0).
 * Under mpirun every rank skips the same steps (their summed gradients are
 * checked). */
static int skipped_in_row(const cli_opts *o, const mt_loss_scale_state *ls, long step, int *in_row)
{
    *in_row = ls->last_step_skipped ? *in_row + 1 : 0;
    if (*in_row < SKIPPED_IN_ROW_STOP) return 0;
    if (cli_world.rank == 0)
        fprintf(stderr, "%s: step %ld: the last %d steps were skipped, their gradients not finite "
                "(%llu skipped in all%s): training diverged (a lower --lr, or --clip, may help)\n",
                cli_prog, step, *in_row, (unsigned long long)ls->steps_skipped,
                o->precision == MT_PREC_FP16 ? ", even at the loss scale's back-off" : "");
    return EXIT_DIVERGED;
}

/* The skipped steps on a progress line: fp16's loss scale and its skipped
 * steps always, other precisions' skipped steps once there are any. */
static void print_skipped(const cli_opts *o, const mt_loss_scale_state *ls)
{
    if (o->precision == MT_PREC_FP16)
        printf("  scale %g  skipped %llu", (double)ls->scale, (unsigned long long)ls->steps_skipped);
    else if (ls->steps_skipped)
        printf("  skipped %llu", (unsigned long long)ls->steps_skipped);
}

/* The end of a run of every rank: each rank's peak gathered (every rank
 * takes part), then rank 0 alone writes the files and the report, and ends
 * it with every rank's peak and its own communication (not with --json). */
static int finish_ranks(const cli_opts *o, mt_context *ctx, const mt_estimate_report *est)
{
    if (cli_world.size < 2) return finish_run(o, ctx, est);
    uint64_t *peaks = calloc((size_t)cli_world.size, sizeof *peaks);
    if (!peaks) return cli_lib_fail(NULL, "out of host memory");
    int rc = cli_ranks_peaks(ctx, peaks);
    if (!rc && cli_world.rank == 0) rc = finish_run(o, ctx, est);
    if (!rc && cli_world.rank == 0 && !o->json) {
        printf("%d ranks, peak live MiB per rank:", cli_world.size);
        for (int r = 0; r < cli_world.size; r++) printf(" %.2f", (double)peaks[r] / 1048576.0);
        printf("\n");
        mt_comm_stats cs;
        mt_context_comm_stats(ctx, &cs);
        printf("communication (rank 0): %llu collectives, %.3f s, %.3f s of it exposed (%.0f%%)\n",
               (unsigned long long)cs.collectives, cs.seconds, cs.exposed_seconds,
               cs.seconds > 0.0 ? 100.0 * cs.exposed_seconds / cs.seconds : 0.0);
    }
    free(peaks);
    return rc;
}

static int run_mlp(const cli_opts *o, mt_context *ctx)
{
    mt_mlp_spec spec;
    cli_mlp_spec(o, &spec);
    mt_trainer_config tc;
    cli_trainer_config(o, &tc);
    cli_ranks_trainer_config(&tc);
    mt_model *m = NULL;
    mt_trainer *t = NULL;
    int rc = 0;
    float *x = malloc((size_t)o->batch * 2 * sizeof *x);
    int32_t *y = malloc((size_t)o->batch * sizeof *y);
    mt_estimate_report est;
    if (!x || !y) {
        fprintf(stderr, "%s: out of memory\n", cli_prog);
        rc = EXIT_FAIL;
        goto done;
    }
    /* the estimate first: the report sets it beside the measured figures */
    if (!mt_model_mlp_create(ctx, &spec, &m) && (rc = cli_prune_check(o, ctx, m))) goto done;
    if (!m || mt_estimate_model(m, &tc, &est) || mt_trainer_create(m, &tc, &t)) {
        rc = cli_lib_fail(ctx, NULL);
        goto done;
    }
    if (!o->json) {
        printf("training an MLP (2");
        for (int i = 0; i < o->n_hidden; i++) printf("-%d", o->hidden[i]);
        printf("-3, %s, %zu parameters) on three spirals, %s, %s, %s, allocator %s\n",
               o->act == MT_ACT_RELU ? "relu" : "gelu", mt_model_num_params(m),
               cli_device_label(ctx), prec_name[o->precision],
               mt_optimizer_name(o->optimizer), o->allocator);
    }
    uint64_t data = (uint64_t)o->seed * 7919u;
    double t0 = now_s(), window = 0.0;
    int in_window = 0, skipped = 0;
    for (long step = 1; step <= o->steps; step++) {
        mlp_feed feed = {&data, x, y, (int)o->batch};
        if ((rc = calibrate_if_due(ctx, t, mlp_next, &feed))) goto done;
        spirals(&data, x, y, (int)o->batch);
        mt_batch b = {.n = (int)o->batch, .inputs = x, .targets = y};
        cli_ranks_rows(&b, 2);
        float loss;
        const double t_step = now_s();
        if (mt_trainer_step(t, &b, &loss)) {
            fprintf(stderr, "%s: step %ld: %s\n", cli_prog, step, mt_last_error(ctx));
            rc = EXIT_FAIL;
            goto done;
        }
        if (o->local_sgd && (rc = cli_ranks_mean(&loss, 1, b.n))) goto done;
        window += loss;
        in_window++;
        mt_loss_scale_state ls;
        mt_trainer_get_loss_scale(t, &ls);
        if (o->json) {
            json_step(ctx, m, t, step, loss, 1e3 * (now_s() - t_step));
            printf("}\n");
        } else if (step == 1 || step % o->every == 0 || step == o->steps) {
            mt_memory_stats ms;
            mt_context_memory_stats(ctx, &ms);
            printf("step %6ld  loss %.4f  %.3f ms/step  peak %.1f KiB", step, window / in_window,
                   1e3 * (now_s() - t0) / (double)step, (double)ms.peak_live_bytes / 1024.0);
            if (o->prune.method) printf("  sparsity %.3f", sparsity_of(m));
            print_skipped(o, &ls);
            printf("\n");
            window = 0.0;
            in_window = 0;
        }
        if (!isfinite(loss)) {
            rc = diverged(step);
            goto done;
        }
        if ((rc = skipped_in_row(o, &ls, step, &skipped))) goto done;
        bool stopping;
        if ((rc = cli_ranks_any(stop_signal != 0, step, &stopping))) goto done;
        if (stopping) { /* under mpirun, every rank */
            rc = interrupted(step);
            goto done;
        }
    }
    /* held-out points from another part of the data stream */
    uint64_t test = (uint64_t)o->seed * 104729u + 17;
    spirals(&test, x, y, (int)o->batch);
    mt_batch b = {.n = (int)o->batch, .inputs = x, .targets = y};
    cli_ranks_rows(&b, 2);
    float la[2];
    if (mt_trainer_eval(t, &b, &la[0], &la[1])) {
        rc = cli_lib_fail(ctx, "eval");
        goto done;
    }
    if ((rc = cli_ranks_mean(la, 2, b.n))) goto done;
    const float loss = la[0], acc = la[1];
    if (o->json) {
        printf("{\"held_out_rows\": %ld", o->batch);
        cli_json_num(stdout, "loss", "%.6f", loss);
        cli_json_num(stdout, "accuracy", "%.4f", acc);
        printf("}\n");
    } else {
        printf("held-out batch: loss %.4f  accuracy %.1f%%\n", loss, 100.0 * acc);
    }
    rc = finish_ranks(o, ctx, &est);
done:
    free(x);
    free(y);
    if (t) mt_trainer_destroy_with_model(t);
    else mt_model_destroy(m);
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
        if (mt_data_next(d, MT_DATA_VAL, &b)) return cli_lib_fail(ctx, "eval");
        cli_ranks_rows(&b, 0);
        if (mt_trainer_eval(t, &b, &l, NULL)) return cli_lib_fail(ctx, "eval");
        int rc = cli_ranks_mean(&l, 1, b.n);
        if (rc) return rc;
        sum += l;
    }
    *out = (float)(sum / k);
    return 0;
}

/* What a checkpoint keeps of the run beside the trainer: the data streams'
 * positions. Files written before the validation stream's position was
 * kept hold the first two (validation then starts over). */
typedef struct run_pos {
    uint64_t epoch, position, val_position;
} run_pos;
#define RUN_POS_OLD (2 * sizeof(uint64_t))

void cli_gpt_close(cli_gpt *g)
{
    /* done with both: the weights are not brought back whole (a model made
       into its home is never whole in memory) */
    if (g->trainer) mt_trainer_destroy_with_model(g->trainer);
    else mt_model_destroy(g->model);
    mt_model_destroy(g->teacher);
    mt_data_close(g->data);
    memset(g, 0, sizeof *g);
}

int cli_data_open(const cli_opts *o, mt_data **out)
{
    mt_data_config dc;
    mt_data_config_init(&dc);
    if (o->data) dc.path = o->data;
    else dc.bytes = mt_corpus, dc.n_bytes = mt_corpus_size;
    dc.seq_len = (int)o->seq, dc.batch = (int)o->batch, dc.seed = (uint64_t)o->seed;
    return mt_data_open(&dc, out) ? cli_lib_fail(NULL, NULL) : 0;
}

int cli_gpt_model(const cli_opts *o, mt_context *ctx, int data_vocab, mt_gpt_spec *spec,
                  mt_model **out)
{
    mt_status s;
    if (o->llmc) { /* weights (and the shape) from an llm.c checkpoint */
        s = cli_deferred(o) ? mt_model_gpt_load_deferred(ctx, o->llmc, out)
                            : mt_model_gpt_load_base(ctx, o->llmc, cli_spec_base(o), out);
        if (!s) s = mt_model_gpt_get_spec(*out, spec);
        if (!s && (spec->vocab < data_vocab || spec->max_seq < (int)o->seq)) {
            fprintf(stderr, "%s: %s: vocab %d and max_seq %d cannot take the data (vocab %d) "
                    "at --seq %ld\n", cli_prog, o->llmc, spec->vocab, spec->max_seq, data_vocab,
                    o->seq);
            return EXIT_FAIL;
        }
    } else {
        spec->deferred = cli_deferred(o);
        s = mt_model_gpt_create(ctx, spec, out);
    }
    return s ? cli_lib_fail(ctx, NULL) : 0;
}

int cli_gpt_open(const cli_opts *o, mt_context *ctx, cli_gpt *g)
{
    memset(g, 0, sizeof *g);
    int rc = cli_data_open(o, &g->data);
    if (rc) return rc;
    mt_data_get_info(g->data, &g->info);
    mt_gpt_spec_init(&g->spec);
    g->spec.vocab = g->info.vocab, g->spec.max_seq = (int)o->seq, g->spec.layers = (int)o->layers;
    g->spec.heads = (int)o->heads, g->spec.channels = (int)o->channels;
    g->spec.seed = (uint64_t)o->seed;
    g->spec.base = cli_spec_base(o);
    mt_trainer_config tc;
    cli_trainer_config(o, &tc);
    cli_ranks_trainer_config(&tc);
    if ((rc = cli_gpt_model(o, ctx, g->info.vocab, &g->spec, &g->model)) ||
        (rc = cli_prune_check(o, ctx, g->model))) {
        cli_gpt_close(g);
        return rc;
    }
    mt_status made = MT_OK;
    if (!made && o->load_lora) made = mt_model_lora_load(g->model, o->load_lora);
    if (!made && o->teacher) { /* after the student, as the estimate makes it */
        made = mt_model_gpt_load_base(ctx, o->teacher, o->teacher_base, &g->teacher);
        tc.teacher = g->teacher;
    }
    if (made || mt_estimate_model(g->model, &tc, &g->est) ||
        mt_trainer_create(g->model, &tc, &g->trainer)) {
        cli_gpt_close(g);
        return cli_lib_fail(ctx, NULL);
    }
    if (o->resume) {
        run_pos p = {0};
        size_t len = 0;
        bool bad_len = false;
        if (mt_trainer_load(g->trainer, o->resume, &p, sizeof p, &len) ||
            (bad_len = len != sizeof p && len != RUN_POS_OLD) ||
            mt_data_seek(g->data, p.epoch, p.position) ||
            mt_data_seek_val(g->data, p.val_position)) {
            fprintf(stderr, "%s: resume: %s\n", cli_prog,
                    bad_len ? "the file holds no data position"
                            : mt_last_error(ctx)[0] ? mt_last_error(ctx) : mt_last_error(NULL));
            cli_gpt_close(g);
            return EXIT_FAIL;
        }
    }
    return 0;
}

static int save_checkpoint(const cli_opts *o, mt_context *ctx, const cli_gpt *g)
{
    mt_data_info now;
    mt_data_get_info(g->data, &now);
    run_pos p = {now.epoch, now.position, now.val_position};
    if (mt_trainer_save(g->trainer, o->save, &p, sizeof p)) return cli_lib_fail(ctx, NULL);
    return 0;
}

static int run_gpt(const cli_opts *o, mt_context *ctx)
{
    cli_gpt g;
    int rc = cli_gpt_open(o, ctx, &g);
    if (rc) return rc;
    mt_trainer *t = g.trainer;
    if (!o->json) {
        printf("training a GPT (L%d H%d C%d, vocab %d, %zu parameters) on %s (%zu tokens), B%ld "
               "T%ld, %s, %s, allocator %s\n",
               g.spec.layers, g.spec.heads, g.spec.channels, g.spec.vocab,
               mt_model_num_params(g.model), o->data ? o->data : "the built-in corpus",
               g.info.tokens, o->batch, o->seq, cli_device_label(ctx),
               prec_name[o->precision], o->allocator);
        printf("estimated peak %.2f MiB (allocators reserve %.2f MiB)%s\n",
               (double)g.est.peak / 1048576.0, (double)g.est.peak_reserved / 1048576.0,
               o->resume ? "; resumed" : "");
        const long groups = cli_world.size / o->tp / o->pp;
        if (cli_world.size > 1 && o->pp > 1)
            printf("%ld data-parallel groups of pipelines of %ld stages (tensor groups of %ld) "
                   "(%s), ZeRO stage %ld: each pipeline trains on about %ld of the %ld rows of a "
                   "step in micro-batches of %ld; the estimate is rank 0's (stage 0's)\n",
                   groups, o->pp, o->tp, mt_comm_name(cli_world.comm), o->zero,
                   (o->batch + groups - 1) / groups, o->batch, o->micro ? o->micro : o->batch);
        else if (cli_world.size > 1 && o->tp > 1)
            printf("%ld data-parallel groups of tensor groups of %ld ranks (%s), ZeRO stage %ld: "
                   "each group trains on about %ld of the %ld rows of a step; the estimate is "
                   "rank 0's\n",
                   groups, o->tp, mt_comm_name(cli_world.comm), o->zero,
                   (o->batch + groups - 1) / groups, o->batch);
        else if (cli_world.size > 1)
            printf("data parallel over %d ranks (%s), ZeRO stage %ld: each trains on about %ld "
                   "of the %ld rows of a step; the estimate is rank 0's\n",
                   cli_world.size, mt_comm_name(cli_world.comm), o->zero,
                   (o->batch + cli_world.size - 1) / cli_world.size, o->batch);
    }
    const double tokens_per_step = (double)o->batch * (double)o->seq;
    const bool live = !o->json && isatty(STDOUT_FILENO) && cli_world.size == 1;
    double window = 0.0, t_window = 0.0;
    int in_window = 0, skipped = 0;
    const long first = (long)mt_trainer_steps(t) + 1; /* after a resume, its next step */
    for (long step = first; step <= o->steps; step++) {
        mt_batch b;
        float loss;
        double t0 = now_s(), t_data = 0;
        if ((rc = calibrate_if_due(ctx, t, gpt_next, g.data))) goto done;
        mt_status ds = mt_data_next(g.data, MT_DATA_TRAIN, &b);
        t_data = now_s() - t0;
        if (!ds) cli_ranks_rows(&b, 0);
        if (ds || mt_trainer_step(t, &b, &loss)) {
            fprintf(stderr, "%s: step %ld: %s\n", cli_prog, step,
                    mt_last_error(ctx)[0] ? mt_last_error(ctx) : mt_last_error(NULL));
            rc = EXIT_FAIL;
            goto done;
        }
        /* local SGD: each rank's loss is its rows' own; the line shows the global batch's */
        if (o->local_sgd && (rc = cli_ranks_mean(&loss, 1, b.n))) goto done;
        double dt = now_s() - t0;
        window += loss, t_window += dt, in_window++;
        bool show = step == 1 || step % o->every == 0 || step == o->steps;
        bool eval = o->eval_every && (step % o->eval_every == 0 || step == o->steps);
        float vl = -1;
        if (eval && (rc = val_loss(ctx, t, g.data, &vl))) goto done;
        mt_memory_stats ms;
        mt_context_memory_stats(ctx, &ms);
        mt_loss_scale_state ls;
        mt_trainer_get_loss_scale(t, &ls);
        if (o->json) {
            json_step(ctx, g.model, t, step, loss, 1e3 * dt);
            cli_json_num(stdout, "data_ms", "%.4f", 1e3 * t_data);
            cli_json_num(stdout, "tokens_per_s", "%.1f", tokens_per_step / dt);
            if (eval) cli_json_num(stdout, "val_loss", "%.6f", vl);
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
            if (o->prune.method) printf("  sparsity %.3f", sparsity_of(g.model));
            print_skipped(o, &ls);
            printf(keep ? "\n" : "\033[K");
            if (keep) window = t_window = 0.0, in_window = 0;
        }
        fflush(stdout);
        if (!isfinite(loss)) {
            rc = diverged(step);
            goto done;
        }
        if ((rc = skipped_in_row(o, &ls, step, &skipped))) goto done;
        /* read once: the save and the stop agree; under mpirun, every rank */
        bool stopping;
        if ((rc = cli_ranks_any(stop_signal != 0, step, &stopping))) goto done;
        /* under ZeRO saving is a collective: every rank sends its slices */
        if (o->save && (cli_world.rank == 0 || o->zero || o->tp > 1 || o->pp > 1) &&
            ((o->save_every && step % o->save_every == 0) || step == o->steps || stopping) &&
            (rc = save_checkpoint(o, ctx, &g)))
            goto done;
        if (stopping) {
            if (o->save && cli_world.rank == 0)
                fprintf(stderr, "%s: checkpoint written to %s\n", cli_prog, o->save);
            rc = interrupted(step);
            goto done;
        }
    }
    /* a run with no step to train (--steps 0, or resumed at --steps) still
       writes the checkpoint it was asked for: the state it starts from */
    const bool untrained = first > o->steps;
    if (o->save && untrained && (cli_world.rank == 0 || o->zero || o->tp > 1 || o->pp > 1) &&
        (rc = save_checkpoint(o, ctx, &g)))
        goto done;
    if (o->save && cli_world.rank == 0) {
        fprintf(o->json ? stderr : stdout, "checkpoint written to %s", o->save);
        if (untrained)
            fprintf(o->json ? stderr : stdout, " (no step trained: the state at step %ld of "
                    "--steps %ld)", first - 1, o->steps);
        fprintf(o->json ? stderr : stdout, "\n");
    }
    if (o->save_lora && cli_world.rank == 0) {
        if (mt_model_lora_save(g.model, o->save_lora)) {
            rc = cli_lib_fail(ctx, NULL);
            goto done;
        }
        fprintf(o->json ? stderr : stdout, "LoRA adapters written to %s\n", o->save_lora);
    }
    if (o->merge_lora && cli_world.rank == 0) {
        mt_trainer_destroy(g.trainer); /* the weights back in fp32 */
        g.trainer = NULL;
        if (mt_model_lora_merge(g.model)) {
            rc = cli_lib_fail(ctx, NULL);
            goto done;
        }
        fprintf(o->json ? stderr : stdout, "LoRA adapters merged into the weights\n");
    }
    if (o->export_llmc && (cli_world.rank == 0 || o->zero == 3 || o->tp > 1 || o->pp > 1)) {
        /* the weights back in fp32 (ZeRO-3, tensor and pipeline parallel: gathered, every
           rank) */
        mt_trainer_destroy(g.trainer);
        g.trainer = NULL;
    }
    if (o->export_llmc && cli_world.rank == 0) {
        if (mt_model_gpt_save(g.model, o->export_llmc)) {
            rc = cli_lib_fail(ctx, NULL);
            goto done;
        }
        fprintf(o->json ? stderr : stdout, "llm.c model checkpoint written to %s\n",
                o->export_llmc);
    }
    rc = finish_ranks(o, ctx, &g.est);
done:
    cli_gpt_close(&g);
    return rc;
}

int cmd_train(int argc, char **argv)
{
    cli_opts o;
    bool help;
    static const char head[] =
        "usage: memtrain train [options]\n";
    int rc = cli_parse(CLI_TRAIN, head, argc, argv, &o, &help);
    if (rc || help) return rc;
    if ((rc = cli_ranks_open(&o))) {
        cli_ranks_close(rc);
        return rc;
    }
    mt_context_config cfg;
    cli_context_config(&o, &cfg);
    cfg.comm = cli_world.comm;
    if (o.trace || o.chrome || o.svg) cfg.trace_capacity = 1u << 22;
    mt_context *ctx;
    if (mt_context_create(&cfg, &ctx)) {
        rc = cli_lib_fail(NULL, NULL);
    } else {
        catch_stop_signals();
        rc = o.gpt ? run_gpt(&o, ctx) : run_mlp(&o, ctx);
    }
    mt_context_destroy(ctx);
    cli_ranks_close(rc);
    return rc;
}
