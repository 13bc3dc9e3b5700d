/* embed.c - the smallest program that trains with memtrain (shown in README.md). */
#include <memtrain.h>
#include <stdio.h>

int main(void)
{
    mt_context_config cfg;
    mt_context_config_init(&cfg);                      /* CPU or CUDA, default allocators */
    mt_context *ctx;
    if (mt_context_create(&cfg, &ctx)) return fprintf(stderr, "%s\n", mt_last_error(NULL)), 1;
    mt_mlp_spec spec;
    mt_mlp_spec_init(&spec);
    spec.n_layers = 2, spec.dims[0] = 4, spec.dims[1] = 64, spec.dims[2] = 3;
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    mt_model *m; mt_trainer *t;
    if (mt_model_mlp_create(ctx, &spec, &m) || mt_trainer_create(m, &tc, &t))
        return fprintf(stderr, "%s\n", mt_last_error(ctx)), 1;
    float x[32 * 4]; int32_t y[32]; float loss = 0;
    for (int step = 0; step < 200; step++) {
        for (int i = 0; i < 32; i++) {                 /* class = which of 3 features is largest */
            for (int k = 0; k < 4; k++) x[4 * i + k] = (float)((i * 7 + k * 13 + step * 5) % 17) / 17;
            y[i] = x[4 * i] > x[4 * i + 1] ? (x[4 * i] > x[4 * i + 2] ? 0 : 2) : (x[4 * i + 1] > x[4 * i + 2] ? 1 : 2);
        }
        mt_batch b = {.n = 32, .inputs = x, .targets = y};
        if (mt_trainer_step(t, &b, &loss)) return fprintf(stderr, "%s\n", mt_last_error(ctx)), 1;
    }
    char report[4096];
    mt_memory_report(ctx, report, sizeof report, NULL);
    printf("final loss %.4f\n%s", loss, report);
    mt_trainer_destroy(t); mt_model_destroy(m); mt_context_destroy(ctx);
    return 0;
}
