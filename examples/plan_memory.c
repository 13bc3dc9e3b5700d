/*
 * plan_memory.c - planning a run's memory before training: estimate a
 * configuration, let the trainer fit a budget, train, and set the measured
 * peak beside the estimate. Built and run by `make test`.
 *
 *   build/examples/plan_memory
 */
#include <memtrain.h>
#include <stdio.h>
#include <stdlib.h>

#define MIB (1024.0 * 1024.0)

static int fail(mt_context *ctx, const char *what)
{
    fprintf(stderr, "%s: %s\n", what, mt_last_error(ctx));
    return 1;
}

int main(void)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    mt_gpt_spec g; /* a small GPT: 4 blocks of width 128 over bytes */
    mt_gpt_spec_init(&g);
    g.vocab = 256, g.max_seq = 128, g.layers = 4, g.heads = 4, g.channels = 128;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 16, tc.optimizer = MT_OPT_ADAMW, tc.lr = 1e-3f;

    /* 1. what it takes, before anything is allocated */
    mt_estimate_report e;
    if (mt_estimate_gpt(&cc, &g, &tc, &e)) return fail(NULL, "estimate");
    printf("no recompute: peak %.2f MiB (ACT %.2f), the allocators reserve %.2f MiB\n",
           e.peak / MIB, e.class_peak[MT_MEM_ACT] / MIB, e.peak_reserved / MIB);

    /* 2. a budget of 80% of that: the trainer picks the cheapest recompute plan */
    mt_context *ctx;
    mt_model *m;
    mt_trainer *t;
    if (mt_context_create(&cc, &ctx)) return fail(NULL, "context");
    if (mt_model_gpt_create(ctx, &g, &m)) return fail(ctx, "model");
    tc.recompute = MT_RECOMPUTE_BUDGET;
    tc.memory_budget = e.peak_reserved * 8 / 10;
    if (mt_trainer_create(m, &tc, &t)) return fail(ctx, "trainer");
    unsigned char units[16];
    int seg, U = mt_model_num_units(m), rec = 0, sel = 0;
    mt_trainer_recompute_plan(t, units, (int)sizeof units, &seg);
    for (int u = 0; u < U; u++) rec += units[u] == MT_UNIT_RECOMPUTE, sel += units[u] == MT_UNIT_SELECTIVE;
    printf("budget %.2f MiB: %d of %d units recomputed, %d selective\n",
           tc.memory_budget / MIB, rec, U, sel);

    /* 3. train a few steps and compare */
    int32_t *tok = malloc((16 * 128 + 1) * sizeof *tok);
    for (int i = 0; i < 16 * 128 + 1; i++) tok[i] = (i * 31 + 7) % 256;
    mt_batch b = {.n = 16, .tokens = tok, .targets = tok + 1, .seq_len = 128};
    for (int s = 0; s < 3; s++)
        if (mt_trainer_step(t, &b, NULL)) return fail(ctx, "step");
    mt_memory_stats st;
    mt_context_memory_stats(ctx, &st);
    printf("measured: peak %.2f MiB, reserved %.2f MiB (budget %s)\n", st.peak_live_bytes / MIB,
           st.peak_reserved_bytes / MIB,
           st.peak_reserved_bytes <= tc.memory_budget ? "kept" : "NOT kept");
    int rc = st.peak_reserved_bytes <= tc.memory_budget ? 0 : 1;

    /* 4. a budget below anything possible is refused, naming the least */
    mt_trainer_destroy(t);
    tc.memory_budget = 1 << 20;
    if (mt_trainer_create(m, &tc, &t) == MT_ERR_BUDGET)
        printf("budget 1 MiB: %s\n", mt_last_error(ctx));
    else
        rc = 1;
    free(tok);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return rc;
}
