/*
 * test_null_configs.c - a NULL config given to a create call means that
 * config's defaults (as its _init sets them); what says what to build or
 * read (a model spec, a data config) is never NULL.
 */
#include <string.h>

#include "check.h"
#include "memtrain.h"

TEST(null_configs_mean_defaults)
{
    mt_context *ctx;
    CHECK_OK(mt_context_create(NULL, &ctx)); /* the default device */
    mt_allocator *a;
    CHECK_OKC(ctx, mt_allocator_create(ctx, NULL, &a));
    CHECK(strcmp(mt_allocator_name(a), "caching") == 0);
    mt_allocator_destroy(a);
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 2, sp.dims[0] = 6, sp.dims[1] = 5, sp.dims[2] = 3;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_mlp_create(ctx, &sp, &m));
    /* a trainer of the defaults: SGD at lr 0.1, batches of up to 32 rows */
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, NULL, &t));
    CHECK(mt_trainer_lr(t) == 0.1f);
    float x[33 * 6] = {0};
    int32_t y[33] = {0};
    mt_batch b = {.n = 32, .inputs = x, .targets = y};
    float loss;
    CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss));
    b.n = 33;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_step(t, &b, &loss));
    mt_trainer_destroy(t);
    /* estimates: NULL context and trainer configs are their defaults */
    mt_context_config cc;
    mt_context_config_init(&cc);
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    mt_estimate_report dflt, null;
    CHECK_OK(mt_estimate_mlp(&cc, &sp, &tc, &dflt));
    CHECK_OK(mt_estimate_mlp(NULL, &sp, NULL, &null));
    CHECK(memcmp(&dflt, &null, sizeof dflt) == 0);
    CHECK_OKC(ctx, mt_estimate_model(m, NULL, &null));
    CHECK(null.peak == dflt.peak);
    /* specs and data configs are refused */
    mt_model *m2;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_mlp_create(ctx, NULL, &m2));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_gpt_create(ctx, NULL, &m2));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_create(ctx, NULL, &m2));
    mt_data *d;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_data_open(NULL, &d));
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}
