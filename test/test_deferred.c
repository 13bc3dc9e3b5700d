/*
 * test_deferred.c - deferred models (mt_*_spec.deferred,
 * mt_model_gpt_load_deferred) on one process: their values before any
 * trainer, a trainer that keeps them resident, refusals, a creation that
 * fails, and mt_trainer_destroy_with_model. (ZeRO-3 and the weights on disk:
 * test_zero3.c's zero3_deferred_creation, test_offload.c's
 * offload_params_deferred_model.)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

enum { V = 64, T = 8, C = 32, B = 2 };

static mt_gpt_spec spec_of(int deferred)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 2, g.heads = 4, g.channels = C, g.seed = 5;
    g.deferred = deferred;
    return g;
}

static float *params_of(mt_context *ctx, mt_model *m)
{
    const size_t n = mt_model_num_params(m);
    float *w = check_alloc(n * sizeof *w);
    CHECK_OKC(ctx, mt_model_get_params(m, w, n));
    return w;
}

static uint64_t param_live(mt_context *ctx)
{
    mt_memory_stats st;
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    return st.per_class[MT_MEM_PARAM].live_bytes;
}

/* Models a (made at once) and b (deferred) have the same values; both go. */
static void check_same_values(mt_context *ctx, mt_model *a, mt_model *b)
{
    const float *wa = params_of(ctx, a), *wb = params_of(ctx, b);
    CHECK(memcmp(wa, wb, mt_model_num_params(a) * 4) == 0);
    mt_model_destroy(a), mt_model_destroy(b);
}

/* A deferred GPT, MLP and layer-list model hold no weights, and read the
 * values of the model made at once, in any order (a tensor read from the
 * middle, then the whole model twice). */
TEST(deferred_models_read_the_values_made_at_once)
{
    mt_context *ctx = check_cpu_context(1);
    mt_gpt_spec g0 = spec_of(0), g1 = spec_of(1);
    mt_model *a, *b;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g0, &a));
    const uint64_t whole = param_live(ctx);
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g1, &b));
    CHECK_EQ(param_live(ctx), whole);
    const size_t n = mt_model_num_params(a);
    float *wa = params_of(ctx, a), *wb = params_of(ctx, b), *wc = params_of(ctx, b);
    CHECK(memcmp(wa, wb, n * 4) == 0 && memcmp(wa, wc, n * 4) == 0);
    CHECK_EQ(param_live(ctx), whole); /* (read without being made) */
    mt_model_destroy(a), mt_model_destroy(b);

    mt_mlp_spec m0, m1;
    mt_mlp_spec_init(&m0);
    m0.n_layers = 3, m0.dims[0] = 5, m0.dims[1] = 7, m0.dims[2] = 6, m0.dims[3] = 3, m0.seed = 9;
    m1 = m0;
    m1.deferred = 1;
    CHECK_OKC(ctx, mt_model_mlp_create(ctx, &m0, &a));
    CHECK_OKC(ctx, mt_model_mlp_create(ctx, &m1, &b));
    check_same_values(ctx, a, b);

    const mt_layer_spec ls[] = {{.kind = MT_LAYER_EMBEDDING, .units = 16, .positions = 1},
                                {.kind = MT_LAYER_BLOCK, .heads = 2},
                                {.kind = MT_LAYER_LAYERNORM},
                                {.kind = MT_LAYER_LM_HEAD}};
    mt_model_spec s0, s1;
    mt_model_spec_init(&s0);
    s0.input = MT_INPUT_TOKENS, s0.vocab = 40, s0.max_seq = T, s0.n_layers = 4, s0.layers = ls;
    s0.seed = 3;
    s1 = s0;
    s1.deferred = 1;
    CHECK_OKC(ctx, mt_model_create(ctx, &s0, &a));
    CHECK_OKC(ctx, mt_model_create(ctx, &s1, &b));
    check_same_values(ctx, a, b);
    mt_context_destroy(ctx);
}

/* Three steps from a deferred model on one rank (its weights made whole by
 * the trainer): the losses and weights of the model made at once, the
 * estimate equal to the run; from an llm.c file too. */
TEST(deferred_model_trains_as_made_at_once)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/mt_deferred_%d.bin", (int)getpid());
    for (int file = 0; file < 2; file++) {
        float loss[2][3], *w[2];
        size_t n = 0;
        for (int d = 0; d < 2; d++) {
            mt_context *ctx = check_cpu_context(1);
            mt_gpt_spec g = spec_of(d);
            mt_model *m;
            if (file && !d) {
                CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
                CHECK_OKC(ctx, mt_model_gpt_save(m, path));
                mt_model_destroy(m);
            }
            if (file) CHECK_OKC(ctx, d ? mt_model_gpt_load_deferred(ctx, path, &m)
                                       : mt_model_gpt_load(ctx, path, &m));
            else CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
            mt_trainer_config tc;
            mt_trainer_config_init(&tc);
            tc.max_batch = B, tc.precision = MT_PREC_BF16;
            mt_estimate_report e;
            CHECK_OKC(ctx, mt_estimate_model(m, &tc, &e));
            mt_trainer *t;
            CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
            int32_t tok[B * T], tg[B * T];
            for (int s = 0; s < 3; s++) {
                mt_batch b;
                check_token_batch(&b, tok, tg, B, T, V, s);
                CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss[d][s]));
            }
            mt_memory_stats st;
            CHECK_OK(mt_context_memory_stats(ctx, &st));
            CHECK_EQ(st.peak_live_bytes, e.peak);
            mt_trainer_destroy(t);
            w[d] = params_of(ctx, m);
            n = mt_model_num_params(m);
            mt_model_destroy(m);
            mt_context_destroy(ctx);
        }
        CHECK(memcmp(loss[0], loss[1], sizeof loss[0]) == 0);
        CHECK(memcmp(w[0], w[1], 4 * n) == 0);
    }
    remove(path);
}

/* set_params makes what it writes; a quantized base is refused; a
 * truncated file is refused when it is opened. */
TEST(deferred_model_set_params_and_refusals)
{
    mt_context *ctx = check_cpu_context(1);
    mt_gpt_spec g = spec_of(1);
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    const size_t n = mt_model_num_params(m);
    float *w = check_alloc(n * sizeof *w), *r;
    for (size_t i = 0; i < n; i++) w[i] = (float)(i % 97) * 0.01f;
    CHECK_OKC(ctx, mt_model_set_params(m, w, n));
    r = params_of(ctx, m);
    CHECK(memcmp(w, r, n * 4) == 0);
    mt_model_destroy(m);

    g.base = MT_BASE_NF4;
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_model_gpt_create(ctx, &g, &m));
    CHECK(strstr(mt_last_error(ctx), "deferred"));

    char path[64];
    snprintf(path, sizeof path, "/tmp/mt_deferred_t%d.bin", (int)getpid());
    g = spec_of(0);
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    CHECK_OKC(ctx, mt_model_gpt_save(m, path));
    mt_model_destroy(m);
    CHECK(truncate(path, 2048) == 0);
    CHECK_ST(MT_ERR_FORMAT, mt_model_gpt_load_deferred(ctx, path, &m));
    CHECK(strstr(mt_last_error(ctx), "truncated"));
    remove(path);
    mt_context_destroy(ctx);
}

/* A creation into the disk that fails (its file's value not finite, found
 * as it is placed) leaves the model deferred, its values the source's; a
 * trainer made after it works, and mt_trainer_destroy_with_model frees
 * both without reading the weights back. */
TEST(deferred_model_failed_creation_and_destroy_with_model)
{
    char path[64], dir[64];
    snprintf(path, sizeof path, "/tmp/mt_deferred_f%d.bin", (int)getpid());
    snprintf(dir, sizeof dir, "/tmp/mt_deferred_d%d_XXXXXX", (int)getpid());
    CHECK(mkdtemp(dir) != NULL);
    mt_context *ctx = check_cpu_context(1);
    mt_gpt_spec g = spec_of(0);
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    CHECK_OKC(ctx, mt_model_gpt_save(m, path));
    float *good = params_of(ctx, m);
    mt_model_destroy(m);
    /* a NaN in the last tensor of the file (lnf.b, the last values) */
    FILE *f = fopen(path, "r+b");
    CHECK(f && fseek(f, -4, SEEK_END) == 0);
    const float nan = NAN;
    CHECK(fwrite(&nan, 4, 1, f) == 1);
    CHECK(fclose(f) == 0);
    CHECK_OKC(ctx, mt_model_gpt_load_deferred(ctx, path, &m));
    const uint64_t before = param_live(ctx);
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = B;
    tc.offload = MT_PLACE_DISK, tc.offload_dir = dir, tc.offload_params = 1;
    mt_trainer *t = NULL;
    CHECK_ST(MT_ERR_FORMAT, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "non-finite"));
    CHECK_EQ(param_live(ctx), before);
    /* the file mended: the same model trains, then goes with its trainer */
    f = fopen(path, "r+b");
    CHECK(f && fseek(f, -4, SEEK_END) == 0);
    CHECK(fwrite(&good[mt_model_num_params(m) - 1], 4, 1, f) == 1);
    CHECK(fclose(f) == 0);
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    check_token_batch(&b, tok, tg, B, T, V, 0);
    float loss;
    CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss));
    CHECK(isfinite(loss));
    mt_trainer_destroy_with_model(t);
    CHECK_EQ(param_live(ctx), 0);
    mt_memory_stats disk;
    CHECK_OK(mt_context_place_stats(ctx, MT_PLACE_DISK, &disk));
    CHECK_EQ(disk.live_bytes, 0);
    mt_context_destroy(ctx);
    remove(path);
    CHECK(rmdir(dir) == 0);
}

/* LoRA on a deferred model (adapters added by the trainer, or loaded from a
 * file before it, then merged): the base made whole first, the bits of the
 * model made at once. */
TEST(deferred_model_with_lora)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/mt_deferred_l%d.lora", (int)getpid());
    float loss[2], *w[2];
    size_t n = 0;
    for (int d = 0; d < 2; d++) {
        mt_context *ctx = check_cpu_context(1);
        mt_gpt_spec g = spec_of(d);
        mt_model *m;
        CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
        mt_trainer_config tc;
        mt_trainer_config_init(&tc);
        tc.max_batch = B, tc.lora.rank = 4;
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        int32_t tok[B * T], tg[B * T];
        mt_batch b;
        check_token_batch(&b, tok, tg, B, T, V, 0);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss[d]));
        mt_trainer_destroy(t);
        if (!d) CHECK_OKC(ctx, mt_model_lora_save(m, path));
        CHECK_OKC(ctx, mt_model_lora_merge(m));
        w[d] = params_of(ctx, m);
        n = mt_model_num_params(m);
        mt_model_destroy(m);
        mt_context_destroy(ctx);
    }
    CHECK(loss[0] == loss[1]);
    CHECK(memcmp(w[0], w[1], n * 4) == 0);
    /* adapters loaded into a deferred model, then merged: the eager model's */
    mt_context *ctx = check_cpu_context(1);
    mt_gpt_spec g = spec_of(1);
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    CHECK_OKC(ctx, mt_model_lora_load(m, path));
    CHECK_OKC(ctx, mt_model_lora_merge(m));
    float *wl = params_of(ctx, m);
    CHECK(memcmp(wl, w[0], n * 4) == 0);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    remove(path);
}
