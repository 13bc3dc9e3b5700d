/* embed.c - the smallest program that trains with memtrain (shown in README.md). */
#include <memtrain.h>
#include <stdio.h>

int main(void) {
    mt_context *ctx; mt_model *m; mt_trainer *t;
    mt_context_config cc; mt_context_config_init(&cc);       /* CPU or CUDA, default allocators */
    mt_mlp_spec ms; mt_mlp_spec_init(&ms);                   /* 4 inputs -> 64 -> 3 classes */
    ms.n_layers = 2, ms.dims[0] = 4, ms.dims[1] = 64, ms.dims[2] = 3;
    mt_trainer_config tc; mt_trainer_config_init(&tc);       /* SGD, lr 0.1, batches up to 32 */
    if (mt_context_create(&cc, &ctx)) return fprintf(stderr, "%s\n", mt_last_error(NULL)), 1;
    if (mt_model_mlp_create(ctx, &ms, &m) || mt_trainer_create(m, &tc, &t))
        return fprintf(stderr, "%s\n", mt_last_error(ctx)), 1;
    float x[32 * 4], loss = 0; int32_t y[32];
    for (int step = 0; step < 300; step++) {                  /* label: the largest of x0, x1, x2 */
        for (int i = 0; i < 32; i++) {
            for (int k = 0; k < 4; k++) x[4 * i + k] = (float)((i * 7 + k * 13 + step * 5) % 17) / 17;
            y[i] = x[4*i] > x[4*i+1] ? (x[4*i] > x[4*i+2] ? 0 : 2) : (x[4*i+1] > x[4*i+2] ? 1 : 2);
        }
        mt_batch b = {.n = 32, .inputs = x, .targets = y};
        if (mt_trainer_step(t, &b, &loss)) return fprintf(stderr, "%s\n", mt_last_error(ctx)), 1;
    }
    char report[4096]; mt_memory_report(ctx, report, sizeof report, NULL);
    printf("final loss %.4f\n%s", loss, report);
    mt_trainer_destroy(t); mt_model_destroy(m); mt_context_destroy(ctx);
}
