/*
 * cli_estimate.c - memtrain estimate: what a training run will hold, per
 * memory class, before it runs (a dry context), with a budget and
 * auto-fit.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* "key": {"PARAM": n, ...} (with the comma before it) */
static void json_classes(const char *key, const uint64_t *v)
{
    printf(", \"%s\": {", key);
    for (int c = 0; c < MT_MEM_COUNT; c++)
        printf("%s\"%s\": %llu", c ? ", " : "", mt_mem_class_name((mt_mem_class)c),
               (unsigned long long)v[c]);
    printf("}");
}

static void print_json(const cli_opts *o, const mt_trainer_config *tc, const mt_estimate_report *e,
                       const mt_autofit_report *fit)
{
    printf("{\"ranks\": %ld, \"rank\": %ld, \"zero\": %ld, \"tp\": %ld, \"sp\": %s, \"pp\": %ld, ",
           o->ranks, o->rank, o->zero, o->tp, o->sp ? "true" : "false", o->pp);
    printf("\"params\": %zu, \"peak\": %llu, \"peak_reserved\": %llu, \"step_peak\": %llu, "
           "\"setup_peak\": %llu",
           e->n_params, (unsigned long long)e->peak, (unsigned long long)e->peak_reserved,
           (unsigned long long)e->step_peak, (unsigned long long)e->setup_peak);
    json_classes("at_peak", e->at_peak);
    json_classes("step_at_peak", e->step_at_peak);
    json_classes("class_peak", e->class_peak);
    printf(", \"place_peak\": {");
    for (int p = 0; p < MT_PLACE_COUNT; p++)
        printf("%s\"%s\": %llu", p ? ", " : "", mt_place_name((mt_place)p),
               (unsigned long long)e->place_peak[p]);
    printf("}");
    json_classes("host_class_peak", e->place_class_peak[MT_PLACE_HOST]);
    json_classes("disk_class_peak", e->place_class_peak[MT_PLACE_DISK]);
    if (tc->memory_budget)
        printf(", \"budget\": %llu, \"fits\": %s", (unsigned long long)tc->memory_budget,
               e->peak_reserved <= tc->memory_budget ? "true" : "false");
    if (o->autofit) {
        printf(", \"autofit\": {\"micro_batch\": %d, \"optimizer\": \"%s\", "
               "\"recomputed_units\": %d, \"selective_units\": %d, \"units\": %d",
               fit->micro_batch,
               fit->optimizer == MT_OPT_ADAMW8 || fit->optimizer == MT_OPT_ADAMW4
                   ? mt_optimizer_name(fit->optimizer) /* (the library's name) */
                   : "as configured",
               fit->recomputed_units, fit->selective_units, fit->units);
        printf(", \"offload\": \"%s\", \"offload_params\": %s",
               fit->offload == MT_PLACE_DEVICE ? "none" : mt_place_name(fit->offload),
               fit->offload_params ? "true" : "false");
        cli_json_num(stdout, "model_tokens_per_second", "%.1f", fit->tokens_per_second);
        printf("}");
    }
    printf("}\n");
}

/* A budget nothing fits, as JSON: the budget, the least the run can take
 * and the message. MT_ERR_BUDGET's message names the least ("the least
 * ... is N bytes"); null where it names none (every plan passes an
 * allocator's limit). */
static void print_json_budget(const mt_trainer_config *tc, const char *msg)
{
    const char *at = strstr(msg, "least");
    at = at ? strstr(at, " is ") : NULL;
    unsigned long long least = 0;
    bool known = at && sscanf(at + 4, "%llu bytes", &least) == 1;
    printf("{\"budget\": %llu, \"fits\": false, \"least\": ",
           (unsigned long long)tc->memory_budget);
    if (known) printf("%llu", least);
    else printf("null");
    printf(", \"error\": ");
    cli_json_str(stdout, msg);
    printf("}\n");
}

static void print_table(const cli_opts *o, const mt_trainer_config *tc, const mt_estimate_report *e,
                        const mt_autofit_report *fit)
{
    if (o->gpt)
        printf("estimate for a GPT (%zu parameters), batch %d x %d tokens", e->n_params,
               tc->max_batch, tc->max_seq);
    else
        printf("estimate for an MLP (%zu parameters), batch %d", e->n_params, tc->max_batch);
    if (o->ranks > 1)
        printf(", rank %ld of %ld (its rows of a global batch of %ld), ZeRO stage %ld", o->rank,
               o->ranks, o->batch, o->zero);
    if (o->tp > 1) printf(", tensor groups of %ld%s", o->tp, o->sp ? " with sequence parallel" : "");
    if (o->pp > 1)
        printf(", pipeline stage %ld of %ld", o->rank / (o->tp > 1 ? o->tp : 1) % o->pp, o->pp);
    printf("\n");
    char each[48] = ""; /* (several ranks: one answer for all, the heaviest's) */
    if (o->ranks > 1) snprintf(each, sizeof each, " on each of %ld ranks", o->ranks);
    if (o->autofit)
        printf("auto-fit for %.1f MiB%s: micro-batches of %d rows, %s, %d of %d units "
               "recomputed, %d selective%s (model: %.0f tokens/s)\n",
               o->budget_mib, each, fit->micro_batch,
               fit->optimizer == MT_OPT_ADAMW8   ? "8-bit AdamW"
               : fit->optimizer == MT_OPT_ADAMW4 ? "4-bit AdamW"
                                                 : "the configured optimizer",
               fit->recomputed_units, fit->units, fit->selective_units,
               fit->offload_params            ? ", the optimizer state and the weights on disk"
               : fit->offload == MT_PLACE_DISK ? ", the optimizer state on disk"
               : fit->offload == MT_PLACE_HOST ? ", the optimizer state in pinned host memory"
                                               : "",
               fit->tokens_per_second);
    const bool off = e->place_peak[MT_PLACE_HOST] || e->place_peak[MT_PLACE_DISK];
    printf("%-7s %14s %14s", "class", "at the peak", "own peak");
    if (off) printf(" %14s %14s", "host", "disk");
    printf("\n");
    for (int c = 0; c < MT_MEM_COUNT; c++) {
        printf("%-7s %10.2f MiB %10.2f MiB", mt_mem_class_name((mt_mem_class)c),
               (double)e->at_peak[c] / 1048576.0, (double)e->class_peak[c] / 1048576.0);
        for (int p = MT_PLACE_HOST; off && p < MT_PLACE_COUNT; p++)
            printf(" %10.2f MiB", (double)e->place_class_peak[p][c] / 1048576.0);
        printf("\n");
    }
    if (off)
        printf("device peak %.2f MiB; host %.2f MiB; disk %.2f MiB (scratch files)\n",
               (double)e->place_peak[MT_PLACE_DEVICE] / 1048576.0,
               (double)e->place_peak[MT_PLACE_HOST] / 1048576.0,
               (double)e->place_peak[MT_PLACE_DISK] / 1048576.0);
    printf("peak %.2f MiB (steps %.2f, setup %.2f); the allocators reserve %.2f MiB at most\n",
           (double)e->peak / 1048576.0, (double)e->step_peak / 1048576.0,
           (double)e->setup_peak / 1048576.0, (double)e->peak_reserved / 1048576.0);
    if (tc->memory_budget)
        printf("budget %.1f MiB: %s\n", o->budget_mib,
               e->peak_reserved <= tc->memory_budget ? "fits" : "does not fit");
}

/* --layout auto: every layout of --ranks (tensor groups of T dividing the
 * ranks and the heads, pipelines of P stages dividing the rest, at most the
 * model's units, sequence parallel where T divides --seq, ZeRO stages the
 * layout takes) auto-fitted to the budget (every rank's: the stages differ);
 * the one of the least cost-model step time (compute, 1F1B's bubble and the
 * collectives and exchanges) goes into *tc and o's --tp, --pp, --sp and
 * --zero. A table of them on stdout (not with --json). MT_ERR_BUDGET when
 * none fits. */
static mt_status fit_layouts(cli_opts *o, mt_model *m, mt_trainer_config *tc, int allow,
                             mt_autofit_report *best)
{
    mt_gpt_spec g;
    mt_model_gpt_get_spec(m, &g);
    const int N = (int)o->ranks;
    double best_t = 0;
    mt_trainer_config chosen = *tc;
    if (!o->json)
        printf("| tp | pp | sp | zero | data-parallel groups | fits | micro | recomputed units | "
               "state | peak MiB a rank | compute s | communication s | step s (model) |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int tp = 1; tp <= N; tp++) {
        if (N % tp || g.heads % tp) continue;
        for (int pp = 1; pp <= N / tp; pp++) {
        if ((N / tp) % pp || pp > mt_model_num_units(m)) continue;
        for (int sp = 0; sp <= (tp > 1 && o->seq % tp == 0); sp++)
            for (int zero = 0; zero <= (pp > 1 ? 2 : 3); zero++) {
                const int dp = N / tp / pp;
                if (dp == 1 && zero) continue; /* (the same as stage 0) */
                mt_trainer_config c = *tc;
                c.tensor_parallel = tp, c.sequence_parallel = sp, c.zero_stage = zero;
                c.pipeline_parallel = pp;
                c.max_batch = (int)((o->batch + dp - 1) / dp); /* (a group's rows) */
                if (c.micro_batch > c.max_batch) c.micro_batch = 0;
                mt_autofit_report f = {0};
                mt_status s = mt_trainer_autofit(m, &c, allow, &f);
                const bool refused = s == MT_ERR_UNSUPPORTED || s == MT_ERR_INVALID_ARG;
                if (s && s != MT_ERR_BUDGET && !refused) return s;
                if (!o->json && s)
                    printf("| %d | %d | %s | %d | %d | %s | - | - | - | - | - | - | - |\n", tp, pp,
                           sp ? "yes" : "no", zero, dp, refused ? "refused" : "no");
                else if (!o->json)
                    printf("| %d | %d | %s | %d | %d | yes | %d | %d + %d selective | %s%s | %.1f | "
                           "%.4g | %.4g | %.4g |\n",
                           tp, pp, sp ? "yes" : "no", zero, dp, f.micro_batch, f.recomputed_units,
                           f.selective_units,
                           f.optimizer == MT_OPT_ADAMW8   ? "8-bit"
                           : f.optimizer == MT_OPT_ADAMW4 ? "4-bit"
                                                          : "32-bit",
                           f.offload_params ? ", weights on disk"
                           : f.offload == MT_PLACE_DISK ? ", on disk"
                           : f.offload == MT_PLACE_HOST ? ", in host memory"
                                                        : "",
                           (double)f.peak_reserved / 1048576.0, f.step_seconds - f.comm_seconds,
                           f.comm_seconds, f.step_seconds);
                if (!s && (!best_t || f.step_seconds < best_t)) {
                    best_t = f.step_seconds;
                    chosen = c;
                    *best = f;
                }
            }
        }
    }
    if (!best_t) {
        char m2[160];
        snprintf(m2, sizeof m2, "no layout of %d ranks fits %.1f MiB a rank", N, o->budget_mib);
        fprintf(stderr, "%s: %s\n", cli_prog, m2);
        return MT_ERR_BUDGET;
    }
    *tc = chosen;
    o->tp = chosen.tensor_parallel, o->sp = chosen.sequence_parallel, o->zero = chosen.zero_stage;
    o->pp = chosen.pipeline_parallel > 1 ? chosen.pipeline_parallel : 1;
    if (!o->json)
        printf("chosen: --tp %ld --pp %ld%s --zero %ld (the least step time of the model that "
               "fits)\n\n", o->tp, o->pp, o->sp ? " --sp" : "", o->zero);
    return MT_OK;
}

int cmd_estimate(int argc, char **argv)
{
    cli_opts o;
    bool help;
    static const char head[] =
        "usage: memtrain estimate [options]\n"
        "What a training run will hold, per memory class, before it runs (nothing is\n"
        "allocated): the peak of live bytes, each class at that moment and at its own\n"
        "peak, and what the allocators will reserve. With --budget, whether the run\n"
        "fits; with --autofit, the fastest micro-batch, recompute plan and optimizer\n"
        "state that fit. With --ranks, one rank of a data-parallel run (--zero: its\n"
        "ZeRO stage); --autofit then chooses what fits every rank, the same on each.\n";
    int rc = cli_parse(CLI_ESTIMATE, head, argc, argv, &o, &help);
    if (rc || help) return rc;
    mt_trainer_config tc;
    cli_trainer_config(&o, &tc);
    cli_ranks_batch(&tc, (int)o.ranks); /* --batch is the global batch */
    tc.memory_budget = (uint64_t)(o.budget_mib * 1048576.0);
    /* a dry context: the model costs nothing, and auto-fit and the estimate
       run on it */
    mt_context_config cc;
    cli_context_config(&o, &cc);
    cc.dry_run = 1;
    cc.world_size = (int)o.ranks; /* the rank the estimate is for */
    cc.rank = (int)o.rank;
    mt_context *ctx;
    if (mt_context_create(&cc, &ctx)) return cli_lib_fail(NULL, NULL);
    mt_model *m = NULL;
    mt_status s;
    if (o.gpt) {
        /* the GPT train would make: the data's vocabulary (--vocab in its
           place), --seq positions (--max-seq), or an llm.c file's shape */
        mt_data_info di = {0};
        if (!o.vocab || o.llmc) {
            mt_data *d;
            if ((rc = cli_data_open(&o, &d))) {
                mt_context_destroy(ctx);
                return rc;
            }
            mt_data_get_info(d, &di);
            mt_data_close(d);
        }
        mt_gpt_spec g;
        mt_gpt_spec_init(&g);
        g.layers = (int)o.layers, g.heads = (int)o.heads, g.channels = (int)o.channels;
        g.vocab = o.vocab ? (int)o.vocab : di.vocab;
        g.max_seq = o.max_seq ? (int)o.max_seq : (int)o.seq;
        g.base = cli_spec_base(&o);
        if ((rc = cli_gpt_model(&o, ctx, di.vocab, &g, &m))) {
            mt_model_destroy(m);
            mt_context_destroy(ctx);
            return rc;
        }
        s = MT_OK;
    } else {
        mt_mlp_spec ml;
        cli_mlp_spec(&o, &ml);
        s = mt_model_mlp_create(ctx, &ml, &m);
    }
    if (!s && (rc = cli_prune_check(&o, ctx, m))) {
        mt_model_destroy(m);
        mt_context_destroy(ctx);
        return rc;
    }
    mt_model *teacher = NULL; /* its shape (a dry context holds no weights) */
    if (!s && o.teacher && !(s = mt_model_gpt_load_base(ctx, o.teacher, o.teacher_base, &teacher))) tc.teacher = teacher;
    mt_autofit_report fit = {0};
    const int allow = (o.allow8 ? MT_AUTOFIT_ALLOW_8BIT : 0) | (o.allow4 ? MT_AUTOFIT_ALLOW_4BIT : 0);
    if (!s && o.autofit && o.layout) {
        s = fit_layouts(&o, m, &tc, allow, &fit);
        if (s == MT_ERR_BUDGET && !o.json) { /* (said above) */
            mt_model_destroy(m);
            mt_model_destroy(teacher);
            mt_context_destroy(ctx);
            return EXIT_BUDGET;
        }
    } else if (!s && o.autofit) s = mt_trainer_autofit(m, &tc,
                                                   (o.allow8 ? MT_AUTOFIT_ALLOW_8BIT : 0) |
                                                       (o.allow4 ? MT_AUTOFIT_ALLOW_4BIT : 0),
                                                   &fit);
    mt_estimate_report e;
    if (!s) s = mt_estimate_model(m, &tc, &e);
    if (s) {
        if (s == MT_ERR_BUDGET && o.json) print_json_budget(&tc, mt_last_error(ctx));
        cli_lib_fail(ctx, NULL);
        rc = s == MT_ERR_BUDGET ? EXIT_BUDGET : EXIT_FAIL;
    } else if (o.json) {
        print_json(&o, &tc, &e, &fit);
    } else {
        print_table(&o, &tc, &e, &fit);
    }
    mt_model_destroy(m);
    mt_model_destroy(teacher);
    mt_context_destroy(ctx);
    return rc;
}
