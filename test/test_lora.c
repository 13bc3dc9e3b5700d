/*
 * test_lora.c - LoRA adapters (cfg.lora; lib/model/lora.c, engine.c): step 0 is
 * the base model; only the adapters hold gradients, masters and state;
 * the adapters' gradients against finite differences; merging gives the
 * adapted model's outputs; the adapter file round-trips and refuses bad
 * files; a base pretrained on one text, LoRA-fine-tuned on another, learns.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "memtrain.h"
#include "textfit.h"

enum { B = 4, T = 8, V = 64 };

static mt_model *tiny_gpt(mt_context *ctx, uint64_t seed)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 2, g.heads = 2, g.channels = 16, g.seed = seed;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    return m;
}

static void batch_of(mt_batch *b, int32_t *tok, int32_t *tg, int step)
{
    check_token_batch(b, tok, tg, B, T, V, step);
}

static void lora_config(mt_trainer_config *tc, int rank, const char *targets)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B, tc->max_seq = T;
    tc->optimizer = MT_OPT_ADAMW, tc->lr = 1e-2f;
    tc->lora.rank = rank, tc->lora.alpha = 2.0f * rank, tc->lora.targets = targets;
    tc->lora.seed = 9;
}

static void tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/mt_lora_%d_%s", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (int)getpid(), name);
}

TEST(lora_starts_as_the_base_and_trains_only_adapters)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *m = tiny_gpt(ctx, 3);
    const size_t nb = mt_model_num_params(m);
    float *w0 = check_alloc(nb * 4);
    CHECK_OK(mt_model_get_params(m, w0, nb));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    batch_of(&b, tok, tg, 0);
    mt_trainer_config tc;
    lora_config(&tc, 0, NULL);
    mt_trainer *t;
    float base, adapted;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_OKC(ctx, mt_trainer_eval(t, &b, &base, NULL));
    mt_trainer_destroy(t);
    lora_config(&tc, 4, "h.*.qkv.w,*.fc.w");
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_OKC(ctx, mt_trainer_eval(t, &b, &adapted, NULL));
    CHECK_MSG(base == adapted, "step 0: %.9g adapted, %.9g base", (double)adapted, (double)base);
    mt_lora_config lc;
    CHECK_OK(mt_model_lora_get(m, &lc));
    CHECK(lc.rank == 4 && lc.alpha == 8.0f && !strcmp(lc.targets, "h.0.qkv.w,h.0.fc.w,h.1.qkv.w,h.1.fc.w"));
    /* adapters: per adapted weight 4 x (in + out) */
    const size_t na = mt_model_num_params(m) - nb, want = 2 * (4 * (16 + 48) + 4 * (16 + 64));
    CHECK_EQ(na, want);
    CHECK_EQ(mt_model_num_tensors(m), 2 * 12 + 4 + 8);
    mt_memory_stats st;
    for (int s = 0; s < 3; s++) {
        batch_of(&b, tok, tg, s);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    }
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    CHECK_EQ(st.per_class[MT_MEM_OPTIM].live_bytes, na * 8); /* AdamW state: adapters only */
    CHECK(st.per_class[MT_MEM_GRAD].peak_live_bytes <= na * 4);
    float *w1 = check_alloc(mt_model_num_params(m) * 4);
    CHECK_OK(mt_model_get_params(m, w1, mt_model_num_params(m)));
    CHECK(!memcmp(w0, w1, nb * 4)); /* the base did not move */
    int moved = 0;
    for (size_t i = nb; i < nb + na; i++) moved += w1[i] != 0.0f && i >= nb;
    CHECK(moved > (int)na / 2);
    float after;
    batch_of(&b, tok, tg, 0);
    CHECK_OKC(ctx, mt_trainer_eval(t, &b, &after, NULL));
    CHECK(after != base);
    mt_trainer_destroy(t);
    /* the adapters stay with the model; another config is refused */
    lora_config(&tc, 2, NULL);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "LoRA adapters of rank 4"));
    lora_config(&tc, 4, "nothing.w");
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK_OK(mt_model_destroy(m));
    m = tiny_gpt(ctx, 3);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "'nothing.w' matches no linear weight"));
    CHECK_EQ(mt_model_num_tensors(m), 2 * 12 + 4); /* refused: the model as it was */
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* The adapters' gradients (B made nonzero first) against central
 * differences of the loss, on a GPT and on a feature model whose first
 * layer is adapted (no input gradient there). */
TEST(lora_gradients_match_finite_differences)
{
    for (int kind = 0; kind < 2; kind++) {
        mt_context *ctx = check_cpu_context(2);
        mt_model *m;
        mt_batch b;
        int32_t tok[B * T], tg[B * T];
        float x[B * 6];
        if (kind == 0) {
            m = tiny_gpt(ctx, 5);
            batch_of(&b, tok, tg, 1);
        } else {
            static const mt_layer_spec ls[] = {{.kind = MT_LAYER_LINEAR, .units = 8},
                                               {.kind = MT_LAYER_GELU},
                                               {.kind = MT_LAYER_LINEAR, .units = 5}};
            mt_model_spec sp;
            mt_model_spec_init(&sp);
            sp.features = 6, sp.n_layers = 3, sp.layers = ls, sp.seed = 4;
            CHECK_OKC(ctx, mt_model_create(ctx, &sp, &m));
            for (int i = 0; i < B * 6; i++) x[i] = sinf((float)i);
            for (int i = 0; i < B; i++) tg[i] = i % 5;
            b = (mt_batch){.n = B, .inputs = x, .targets = tg};
        }
        mt_trainer_config tc;
        lora_config(&tc, 3, NULL);
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        const size_t n = mt_model_num_params(m);
        float *w = check_alloc(n * 4), *g = check_alloc(n * 4);
        CHECK_OK(mt_model_get_params(m, w, n));
        for (int i = 0; i < mt_model_num_tensors(m); i++) { /* B drawn too */
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(m, i, &pi));
            if (strstr(pi.name, ".lora_b"))
                for (size_t j = 0; j < pi.numel; j++)
                    w[pi.offset + j] = 0.3f * sinf((float)(pi.offset + j));
        }
        CHECK_OK(mt_model_set_params(m, w, n));
        float loss;
        CHECK_OKC(ctx, mt_trainer_gradients(t, &b, &loss, g, n));
        int checked = 0;
        double worst = 0;
        for (int i = 0; i < mt_model_num_tensors(m); i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(m, i, &pi));
            if (!strstr(pi.name, ".lora_")) {
                for (size_t j = 0; j < pi.numel; j++) CHECK(g[pi.offset + j] == 0.0f);
                continue;
            }
            for (size_t j = 0; j < pi.numel; j += 1 + pi.numel / 7) {
                const float h = 2e-3f, keep = w[pi.offset + j];
                float lp, lm;
                w[pi.offset + j] = keep + h;
                CHECK_OK(mt_model_set_params(m, w, n));
                CHECK_OKC(ctx, mt_trainer_eval(t, &b, &lp, NULL));
                w[pi.offset + j] = keep - h;
                CHECK_OK(mt_model_set_params(m, w, n));
                CHECK_OKC(ctx, mt_trainer_eval(t, &b, &lm, NULL));
                w[pi.offset + j] = keep;
                double fd = ((double)lp - lm) / (2.0 * h), an = g[pi.offset + j];
                double err = fabs(fd - an) / (fabs(an) + 1e-3);
                if (err > worst) worst = err;
                CHECK_MSG(fabs(fd - an) <= 2e-4 + 2e-2 * fabs(an),
                          "model %d %s[%zu]: backward %.6g, finite differences %.6g", kind,
                          pi.name, j, an, fd);
                checked++;
            }
        }
        CHECK(checked >= 8);
        if (getenv("MT_TEST_VERBOSE"))
            printf("    model %d: %d adapter elements, worst relative gap %.3g\n", kind, checked, worst);
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
}

/* The logits at every row's last position, through a trainer made with tc. */
static void logits_of(mt_context *ctx, mt_model *m, const mt_trainer_config *tc, float *out)
{
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, tc, &t));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    batch_of(&b, tok, tg, 2);
    CHECK_OKC(ctx, mt_trainer_logits(t, &b, out, (size_t)B * V));
    mt_trainer_destroy(t);
}

TEST(lora_merge_export_and_adapter_files)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *m = tiny_gpt(ctx, 11);
    mt_trainer_config tc;
    lora_config(&tc, 4, NULL);
    tc.lr = 3e-2f;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    for (int s = 0; s < 4; s++) {
        int32_t tok[B * T], tg[B * T];
        mt_batch b;
        batch_of(&b, tok, tg, s);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    }
    mt_trainer_destroy(t);
    float adapted[B * V], merged[B * V], loaded[B * V];
    mt_trainer_config plain;
    lora_config(&plain, 0, NULL);
    logits_of(ctx, m, &plain, adapted); /* the model's own adapters */
    char ad[512], ll[512];
    tmp_path(ad, sizeof ad, "adapters");
    tmp_path(ll, sizeof ll, "merged.bin");
    CHECK_ST(MT_ERR_STATE, mt_model_gpt_save(m, ll)); /* adapters: merge first */
    CHECK_OKC(ctx, mt_model_lora_save(m, ad));

    /* the adapters alone, onto a fresh copy of the base */
    mt_model *m2 = tiny_gpt(ctx, 11);
    CHECK_OKC(ctx, mt_model_lora_load(m2, ad));
    logits_of(ctx, m2, &plain, loaded);
    CHECK(!memcmp(loaded, adapted, sizeof loaded));
    CHECK_OKC(ctx, mt_model_lora_load(m2, ad)); /* again, over its own: the same values */

    /* merged into the base and exported: the adapted model's outputs */
    CHECK_OKC(ctx, mt_model_lora_merge(m));
    CHECK_ST(MT_ERR_STATE, mt_model_lora_merge(m));
    CHECK_EQ(mt_model_num_tensors(m), 2 * 12 + 4);
    CHECK_OKC(ctx, mt_model_gpt_save(m, ll));
    mt_model *m3;
    CHECK_OKC(ctx, mt_model_gpt_load(ctx, ll, &m3));
    logits_of(ctx, m3, &plain, merged);
    double worst = 0;
    for (int i = 0; i < B * V; i++) {
        double d = fabs((double)merged[i] - adapted[i]) / (1.0 + fabs(adapted[i]));
        if (d > worst) worst = d;
    }
    CHECK_MSG(worst < 1e-5, "merged logits differ by %.3g", worst);
    if (getenv("MT_TEST_VERBOSE")) printf("    merged vs adapted logits: %.3g\n", worst);

    /* bad adapter files leave the model as it was */
    FILE *f = fopen(ad, "rb");
    CHECK(f);
    unsigned char buf[1 << 16];
    size_t len = fread(buf, 1, sizeof buf, f);
    fclose(f);
    CHECK(len > 100 && len < sizeof buf);
    mt_model *m4 = tiny_gpt(ctx, 11);
    const size_t cuts[] = {0, 10, 31, 100, len - 1};
    for (size_t c = 0; c < sizeof cuts / sizeof *cuts; c++) {
        f = fopen(ad, "wb");
        fwrite(buf, 1, cuts[c], f);
        fclose(f);
        CHECK_ST(MT_ERR_FORMAT, mt_model_lora_load(m4, ad));
    }
    const size_t flips[] = {3, 12, 40, 120, len - 20, len - 6};
    for (size_t c = 0; c < sizeof flips / sizeof *flips; c++) {
        buf[flips[c]] ^= 0x10;
        f = fopen(ad, "wb");
        fwrite(buf, 1, len, f);
        fclose(f);
        CHECK_ST(MT_ERR_FORMAT, mt_model_lora_load(m4, ad));
        buf[flips[c]] ^= 0x10;
    }
    CHECK_EQ(mt_model_num_tensors(m4), 2 * 12 + 4);
    /* a model of another shape */
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 2, g.heads = 2, g.channels = 32, g.seed = 1;
    mt_model *m5;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m5));
    f = fopen(ad, "wb");
    fwrite(buf, 1, len, f);
    fclose(f);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_lora_load(m5, ad));
    CHECK(strstr(mt_last_error(ctx), "h.0.qkv.w"));
    unlink(ad), unlink(ll);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_model_destroy(m2));
    CHECK_OK(mt_model_destroy(m3));
    CHECK_OK(mt_model_destroy(m4));
    CHECK_OK(mt_model_destroy(m5));
    CHECK_OK(mt_context_destroy(ctx));
}

/* A byte-level GPT pretrained on the project's docs (test/data), then
 * LoRA-fine-tuned (rank 8 on qkv and fc) on C source: the loss on the
 * source falls, and the base does not move. */
TEST(lora_fine_tunes_a_pretrained_base)
{
    size_t nc;
    const unsigned char *code = tf_slurp("test/data/c_source.txt", &nc);
    mt_context *ctx = check_cpu_context(2);
    mt_trainer_config tc;
    uint64_t rng = 1;
    float docs_loss;
    mt_model *m = tf_pretrained(ctx, &tc, &rng, &docs_loss);
    mt_trainer *t;
    tc.lora.rank = 8, tc.lora.alpha = 16.0f, tc.lora.targets = "*.qkv.w,*.fc.w", tc.lr = 1e-2f;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    float before = tf_mean_loss(ctx, t, code, nc);
    tf_train(ctx, t, code, nc, &rng, 40);
    float after = tf_mean_loss(ctx, t, code, nc);
    if (getenv("MT_TEST_VERBOSE"))
        printf("    pretrained: docs loss %.3f; source loss %.3f before LoRA, %.3f after\n",
               (double)docs_loss, (double)before, (double)after);
    CHECK_MSG(after < 0.95f * before, "the loss on the new text went from %.4f to %.4f",
              (double)before, (double)after);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* LoRA through the rest of the engine: the gradients are the same bits
 * under every recompute policy, the fused step (one pass, and two with
 * clipping) gives the unfused step's weights, and a training-state file
 * resumes bit for bit. */
TEST(lora_recompute_fused_and_resume_agree)
{
    static const mt_recompute_policy rcs[] = {MT_RECOMPUTE_NONE, MT_RECOMPUTE_SQRT,
                                              MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_EVERY_K};
    mt_context *ctx = check_cpu_context(2);
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    float *g0 = NULL;
    for (size_t r = 0; r < sizeof rcs / sizeof *rcs; r++) {
        mt_model *m = tiny_gpt(ctx, 21);
        mt_trainer_config tc;
        lora_config(&tc, 2, NULL);
        tc.precision = MT_PREC_BF16, tc.recompute = rcs[r], tc.recompute_every = 1;
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        batch_of(&b, tok, tg, 0);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL)); /* B moves off zero */
        const size_t n = mt_model_num_params(m);
        float *g = check_alloc(n * 4);
        batch_of(&b, tok, tg, 1);
        CHECK_OKC(ctx, mt_trainer_gradients(t, &b, NULL, g, n));
        if (!g0) g0 = g;
        CHECK_MSG(!memcmp(g, g0, n * 4), "recompute policy %d: other gradients", (int)rcs[r]);
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
    }
    for (int clip = 0; clip < 2; clip++) {
        float *w[2];
        size_t n = 0;
        for (int fused = 0; fused < 2; fused++) {
            mt_model *m = tiny_gpt(ctx, 22);
            mt_trainer_config tc;
            lora_config(&tc, 4, "*.w");
            tc.fused_step = fused, tc.grad_clip = clip ? 0.5f : 0.0f;
            mt_trainer *t;
            CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
            for (int s = 0; s < 3; s++) {
                batch_of(&b, tok, tg, s);
                CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
            }
            n = mt_model_num_params(m);
            w[fused] = check_alloc(n * 4);
            CHECK_OK(mt_model_get_params(m, w[fused], n));
            mt_trainer_destroy(t);
            CHECK_OK(mt_model_destroy(m));
        }
        CHECK_MSG(!memcmp(w[0], w[1], n * 4), "clip %d: the fused step differs", clip);
    }
    /* resume: 2 steps, save, 2 more, against a new model loading the file */
    char path[512];
    tmp_path(path, sizeof path, "state");
    float *w[2];
    size_t n = 0;
    for (int k = 0; k < 2; k++) {
        mt_model *m = tiny_gpt(ctx, 23);
        mt_trainer_config tc;
        lora_config(&tc, 4, NULL);
        tc.precision = MT_PREC_BF16;
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        for (int s = 0; s < 4; s++) {
            if (k == 1 && s < 2) continue;
            if (k == 1 && s == 2) CHECK_OKC(ctx, mt_trainer_load(t, path, NULL, 0, NULL));
            batch_of(&b, tok, tg, s);
            CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
            if (k == 0 && s == 1) CHECK_OKC(ctx, mt_trainer_save(t, path, NULL, 0));
        }
        n = mt_model_num_params(m);
        w[k] = check_alloc(n * 4);
        CHECK_OK(mt_model_get_params(m, w[k], n));
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
    }
    CHECK(!memcmp(w[0], w[1], n * 4));
    /* a trainer of another rank cannot take it */
    mt_model *m = tiny_gpt(ctx, 23);
    mt_trainer_config tc;
    lora_config(&tc, 2, NULL);
    tc.precision = MT_PREC_BF16;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_load(t, path, NULL, 0, NULL));
    CHECK(strstr(mt_last_error(ctx), "lora_a"));
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    unlink(path);
    CHECK_OK(mt_context_destroy(ctx));
}

/* LoRA on the CUDA table (MT_TEST_GPU=1; the engine group of the GPU
 * bundle): the adapters' gradients against the CPU's, and a few steps of
 * fp32 and bf16 training with the base frozen end near the CPU's losses. */
TEST(gpu_engine_lora_matches_cpu)
{
    mt_context *ctx[2] = {check_gpu_context(), NULL};
    if (!ctx[0]) return;
    ctx[1] = check_cpu_context(2);
    float *g[2], loss[2][4];
    size_t n = 0;
    for (int d = 0; d < 2; d++) {
        mt_model *m = tiny_gpt(ctx[d], 31);
        mt_trainer_config tc;
        lora_config(&tc, 8, "*.qkv.w,*.fc.w,*.fcproj.w");
        mt_trainer *t;
        CHECK_OKC(ctx[d], mt_trainer_create(m, &tc, &t));
        n = mt_model_num_params(m);
        float *w = check_alloc(n * 4);
        g[d] = check_alloc(n * 4);
        CHECK_OK(mt_model_get_params(m, w, n));
        for (int i = 0; i < mt_model_num_tensors(m); i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(m, i, &pi));
            if (strstr(pi.name, ".lora_b"))
                for (size_t j = 0; j < pi.numel; j++) w[pi.offset + j] = 0.2f * cosf((float)j);
        }
        CHECK_OK(mt_model_set_params(m, w, n));
        int32_t tok[B * T], tg[B * T];
        mt_batch b;
        batch_of(&b, tok, tg, 0);
        CHECK_OKC(ctx[d], mt_trainer_gradients(t, &b, NULL, g[d], n));
        mt_trainer_destroy(t);
        for (int prec = 0; prec < 2; prec++) {
            lora_config(&tc, 0, NULL);
            tc.precision = prec ? MT_PREC_BF16 : MT_PREC_FP32;
            tc.recompute = prec ? MT_RECOMPUTE_SELECTIVE : MT_RECOMPUTE_NONE;
            tc.fused_step = prec;
            CHECK_OKC(ctx[d], mt_trainer_create(m, &tc, &t));
            for (int s = 0; s < 2; s++) {
                batch_of(&b, tok, tg, s + 1);
                CHECK_OKC(ctx[d], mt_trainer_step(t, &b, &loss[d][2 * prec + s]));
            }
            mt_trainer_destroy(t);
        }
        CHECK_OK(mt_model_destroy(m));
    }
    check_gpu_near_cpu(g[0], g[1], n, loss[0], loss[1]);
    CHECK_OK(mt_context_destroy(ctx[0]));
    CHECK_OK(mt_context_destroy(ctx[1]));
}
