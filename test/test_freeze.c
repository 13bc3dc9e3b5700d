/*
 * test_freeze.c - frozen parameters (cfg.freeze): the gradients of the
 * others are the unfrozen model's, bit for bit on the CPU; frozen weights
 * never move, in every optimizer, precision, recompute policy, with the
 * fused step, accumulation and clipping; the memory classes shrink by what
 * the frozen parameters would have held; training-state files record the
 * frozen set; bad sets are refused.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "memtrain.h"

enum { B = 4, T = 8, V = 64 };

static mt_model *small_gpt(mt_context *ctx)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 3, g.heads = 2, g.channels = 16, g.seed = 7;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    return m;
}

static void batch_of(mt_batch *b, int32_t *tok, int32_t *tg, int step)
{
    check_token_batch(b, tok, tg, B, T, V, step);
}

static bool is_frozen(const char *name, const char *const *pat, int n)
{
    for (int k = 0; k < n; k++) {
        size_t l = strlen(pat[k]);
        if (pat[k][l - 1] == '*' ? !strncmp(name, pat[k], l - 1) : !strcmp(name, pat[k]))
            return true;
    }
    return false;
}

typedef struct fz_case {
    mt_optimizer_kind opt;
    mt_precision prec;
    int masters, fused, micro;
    mt_recompute_policy rc;
    float clip;
} fz_case;

static void config(mt_trainer_config *tc, const fz_case *c)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B, tc->max_seq = T, tc->micro_batch = c->micro;
    tc->optimizer = c->opt, tc->lr = 1e-2f;
    if (c->opt == MT_OPT_SGD) tc->momentum = 0.9f;
    tc->weight_decay = 0.01f;
    tc->precision = c->prec, tc->master_weights = c->masters;
    tc->recompute = c->rc, tc->fused_step = c->fused, tc->grad_clip = c->clip;
    tc->min_8bit_size = 256;
    tc->loss_scale.init_scale = 256.0f;
    tc->adafactor.relative_step = 0;
}

/* The patterns: the tied table (both uses), the first block, the final
 * LayerNorm's bias and one matrix of the last block. */
static const char *const pats[] = {"wte", "h.0.*", "lnf.b", "h.2.fc.w"};
enum { NP = 4 };

TEST(freeze_gradients_of_the_rest_are_unchanged)
{
    static const fz_case cases[] = {
        {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0, MT_RECOMPUTE_NONE, 0},
        {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 2, MT_RECOMPUTE_SQRT, 1},
        {MT_OPT_SGD, MT_PREC_FP16, 1, 0, 0, MT_RECOMPUTE_SELECTIVE, 0},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        mt_context *ctx = check_cpu_context(2);
        mt_model *ref = small_gpt(ctx), *m = small_gpt(ctx);
        size_t n = mt_model_num_params(m);
        float *g0 = check_alloc(n * 4), *g1 = check_alloc(n * 4);
        int32_t tok[B * T], tg[B * T];
        mt_batch b;
        batch_of(&b, tok, tg, 0);
        mt_trainer_config tc;
        config(&tc, &cases[ci]);
        mt_trainer *t;
        float l0, l1;
        CHECK_OKC(ctx, mt_trainer_create(ref, &tc, &t));
        CHECK_OKC(ctx, mt_trainer_gradients(t, &b, &l0, g0, n));
        mt_trainer_destroy(t);
        tc.freeze = pats, tc.n_freeze = NP;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        CHECK_OKC(ctx, mt_trainer_gradients(t, &b, &l1, g1, n));
        mt_trainer_destroy(t);
        CHECK_MSG(l0 == l1, "case %zu: loss %.9g frozen, %.9g not", ci, (double)l1, (double)l0);
        int frozen = 0;
        for (int i = 0; i < mt_model_num_tensors(m); i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(m, i, &pi));
            bool fz = is_frozen(pi.name, pats, NP);
            frozen += fz;
            for (size_t j = 0; j < pi.numel; j++) {
                float want = fz ? 0.0f : g0[pi.offset + j];
                CHECK_MSG(memcmp(&g1[pi.offset + j], &want, 4) == 0,
                          "case %zu: %s[%zu] gradient %.9g, expected %.9g", ci, pi.name, j,
                          (double)g1[pi.offset + j], (double)want);
            }
        }
        CHECK_EQ(frozen, 15); /* wte, the 12 of block 0, lnf.b, h.2.fc.w */
        CHECK_OK(mt_model_destroy(ref));
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
}

/* Trains with a frozen set: the frozen weights keep their bits, the others
 * move, and the fused step gives the unfused step's weights. */
TEST(freeze_keeps_weights_in_every_setting)
{
    static const fz_case cases[] = {
        {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 2, MT_RECOMPUTE_NONE, 1},
        {MT_OPT_ADAMW8, MT_PREC_BF16, 1, 0, 0, MT_RECOMPUTE_SQRT, 0},
        {MT_OPT_ADAFACTOR, MT_PREC_FP16, 1, 0, 0, MT_RECOMPUTE_SELECTIVE, 1},
        {MT_OPT_SGD, MT_PREC_BF16, 0, 0, 0, MT_RECOMPUTE_EVERY_K, 0},
        {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 0, MT_RECOMPUTE_NONE, 1},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        float *after[2] = {0};
        size_t nn = 0;
        for (int fused = 0; fused < 2; fused++) {
            fz_case c = cases[ci];
            if (fused && c.micro) break; /* the fused step takes no accumulation */
            c.fused = fused;
            mt_context *ctx = check_cpu_context(2);
            mt_model *m = small_gpt(ctx);
            size_t n = nn = mt_model_num_params(m);
            float *w0 = check_alloc(n * 4);
            after[fused] = check_alloc(n * 4);
            mt_trainer_config tc;
            config(&tc, &c);
            tc.freeze = pats, tc.n_freeze = NP;
            mt_trainer *t;
            CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
            CHECK_OK(mt_model_get_params(m, w0, n)); /* (16-bit frozen weights: as stored) */
            for (int s = 0; s < 3; s++) {
                int32_t tok[B * T], tg[B * T];
                mt_batch b;
                batch_of(&b, tok, tg, s);
                float loss;
                CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss));
            }
            CHECK_OK(mt_model_get_params(m, after[fused], n));
            for (int i = 0; i < mt_model_num_tensors(m); i++) {
                mt_param_info pi;
                CHECK_OK(mt_model_param_info(m, i, &pi));
                bool same = !memcmp(w0 + pi.offset, after[fused] + pi.offset, pi.numel * 4);
                bool fz = is_frozen(pi.name, pats, NP);
                CHECK_MSG(same == fz,
                          "case %zu fused %d: %s %s", ci, fused, pi.name,
                          fz ? "moved though frozen" : "did not move");
            }
            mt_trainer_destroy(t);
            /* back to fp32 after the trainer: the frozen values as they were */
            float *w1 = check_alloc(n * 4);
            CHECK_OK(mt_model_get_params(m, w1, n));
            for (int i = 0; i < mt_model_num_tensors(m); i++) {
                mt_param_info pi;
                CHECK_OK(mt_model_param_info(m, i, &pi));
                if (is_frozen(pi.name, pats, NP))
                    CHECK(!memcmp(w0 + pi.offset, w1 + pi.offset, pi.numel * 4));
            }
            CHECK_OK(mt_model_destroy(m));
            CHECK_OK(mt_context_destroy(ctx));
        }
        if (after[1])
            CHECK_MSG(!memcmp(after[0], after[1], nn * 4),
                      "case %zu: fused differs", ci);
    }
}

/* What a frozen set saves: no GRAD, MASTER or OPTIM for it, to the byte. */
TEST(freeze_shrinks_the_classes)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *m = small_gpt(ctx);
    size_t frozen = 0, all = mt_model_num_params(m);
    for (int i = 0; i < mt_model_num_tensors(m); i++) {
        mt_param_info pi;
        CHECK_OK(mt_model_param_info(m, i, &pi));
        if (is_frozen(pi.name, pats, NP)) frozen += pi.numel;
    }
    fz_case c = {MT_OPT_ADAMW, MT_PREC_BF16, 1, 0, 0, MT_RECOMPUTE_NONE, 0};
    mt_trainer_config tc;
    config(&tc, &c);
    mt_estimate_report full, fz;
    CHECK_OKC(ctx, mt_estimate_model(m, &tc, &full));
    tc.freeze = pats, tc.n_freeze = NP;
    CHECK_OKC(ctx, mt_estimate_model(m, &tc, &fz));
    /* masters 4 bytes and AdamW 8 bytes per trained parameter */
    CHECK_EQ(fz.class_peak[MT_MEM_MASTER], (all - frozen) * 4);
    CHECK_EQ(full.class_peak[MT_MEM_MASTER], all * 4);
    CHECK_EQ(fz.class_peak[MT_MEM_OPTIM], (all - frozen) * 8);
    CHECK(fz.class_peak[MT_MEM_GRAD] < full.class_peak[MT_MEM_GRAD]);
    /* between steps: the weights in 16 bits either way, masters and state
       of the trained ones only */
    CHECK_EQ(full.between_steps - fz.between_steps, frozen * 12);
    /* a budget the frozen run fits and the full one does not */
    mt_trainer *t;
    tc.memory_budget = fz.peak_reserved;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    mt_trainer_destroy(t);
    tc.n_freeze = 0;
    CHECK_ST(MT_ERR_BUDGET, mt_trainer_create(m, &tc, &t));
    tc.n_freeze = NP;
    tc.memory_budget = 0;
    /* and the run holds what the estimate says */
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    batch_of(&b, tok, tg, 0);
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    mt_memory_stats st;
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    for (int k = 0; k < MT_MEM_COUNT; k++)
        CHECK_MSG(st.per_class[k].peak_live_bytes == fz.class_peak[k], "class %s: %llu run, %llu "
                  "estimated", mt_mem_class_name((mt_mem_class)k),
                  (unsigned long long)st.per_class[k].peak_live_bytes,
                  (unsigned long long)fz.class_peak[k]);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(freeze_refuses_bad_sets_and_checkpoints_record_it)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *m = small_gpt(ctx);
    fz_case c = {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0, MT_RECOMPUTE_NONE, 0};
    mt_trainer_config tc;
    config(&tc, &c);
    mt_trainer *t = NULL;
    static const char *const none[] = {"h.9.*"}, *const all[] = {"*"}, *const nul[] = {NULL};
    tc.freeze = none, tc.n_freeze = 1;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "h.9.*") && strstr(mt_last_error(ctx), "matches no"));
    tc.freeze = all;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "nothing to train"));
    tc.freeze = nul;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    tc.freeze = NULL;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));

    /* a training-state file knows the frozen set */
    char path[256];
    snprintf(path, sizeof path, "%s/mt_freeze_%d.ckpt", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (int)getpid());
    tc.freeze = pats, tc.n_freeze = NP;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    batch_of(&b, tok, tg, 0);
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    CHECK_OKC(ctx, mt_trainer_save(t, path, NULL, 0));
    CHECK_OKC(ctx, mt_trainer_load(t, path, NULL, 0, NULL));
    mt_trainer_destroy(t);
    static const char *const other[] = {"wte", "h.0.*", "lnf.b"};
    tc.freeze = other, tc.n_freeze = 3;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_load(t, path, NULL, 0, NULL));
    CHECK_MSG(strstr(mt_last_error(ctx), "frozen set") && strstr(mt_last_error(ctx), "h.2.fc.w"),
              "%s", mt_last_error(ctx));
    mt_trainer_destroy(t);
    tc.n_freeze = 0;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_load(t, path, NULL, 0, NULL));
    CHECK_MSG(strstr(mt_last_error(ctx), "frozen set") && strstr(mt_last_error(ctx), "'wte'"),
              "%s", mt_last_error(ctx));
    mt_trainer_destroy(t);
    unlink(path);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}
