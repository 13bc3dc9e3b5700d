/*
 * test_qbase.c - a quantized frozen base (cfg.base, mt_gpt_spec.base;
 * docs/engine.md "Quantized frozen base"): the adapters' gradients through
 * the dequantizing GEMMs against finite differences; LoRA on an int8 and
 * an NF4 base learns, ends near LoRA on the fp32 base, and never changes
 * the quantized weights; PARAM holds the quantized bytes; the estimate
 * equals the run; a training-state file resumes bit for bit and refuses
 * another base; merging gives fp32 weights; bad settings are refused.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "memtrain.h"
#include "textfit.h"
#include "model/model.h"
#include "quant/quant.h"
#include "train/trainer.h"

enum { B = 4, T = 8, V = 64 };

static mt_model *tiny_gpt(mt_context *ctx, uint64_t seed, mt_base_format base)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 2, g.heads = 2, g.channels = 64, g.seed = seed;
    g.base = base;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    return m;
}

static void lora_config(mt_trainer_config *tc, int rank, mt_base_format base)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B, tc->max_seq = T;
    tc->optimizer = MT_OPT_ADAMW, tc->lr = 1e-2f;
    tc->lora.rank = rank, tc->lora.alpha = 2.0f * rank, tc->lora.seed = 9;
    tc->base = base;
}

static uint64_t class_live(mt_context *ctx, mt_mem_class c)
{
    mt_memory_stats st;
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    return st.per_class[c].live_bytes;
}

/* Three LINEAR layers (70 -> 80 -> 70 -> 5, GELU between), whole blocks of
 * 64 and a partial one in each weight. */
static mt_model *three_linear(mt_context *ctx)
{
    static const mt_layer_spec ls[] = {
        {.kind = MT_LAYER_LINEAR, .units = 80}, {.kind = MT_LAYER_GELU},
        {.kind = MT_LAYER_LINEAR, .units = 70}, {.kind = MT_LAYER_GELU},
        {.kind = MT_LAYER_LINEAR, .units = 5}};
    mt_model_spec sp;
    mt_model_spec_init(&sp);
    sp.features = 70, sp.n_layers = 5, sp.layers = ls, sp.seed = 4;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_create(ctx, &sp, &m));
    return m;
}

/* The adapters' gradients on a quantized base (the input gradient of every
 * later layer goes through matmul_dx_q) against central differences of the
 * loss; the adapters are written alone (mti_param_write), so the base's
 * bytes never change. A GPT quantized as it is made, and a builder model
 * whose LINEAR weights the trainer quantizes (frozen by pattern). */
TEST(qbase_adapter_gradients_match_finite_differences)
{
    for (int f = MT_BASE_INT8; f <= MT_BASE_NF4; f++)
        for (int kind = 0; kind < 2; kind++) {
            mt_context *ctx = check_cpu_context(1); /* (many tiny ops) */
            mt_model *m;
            mt_batch b;
            int32_t tok[B * T], tg[B * T];
            float x[B * 70];
            mt_trainer_config tc;
            lora_config(&tc, 3, (mt_base_format)f);
            static const char *const frz[] = {"l*.w"};
            if (kind == 0) {
                m = tiny_gpt(ctx, 5, (mt_base_format)f);
                check_token_batch(&b, tok, tg, B, T, V, 1);
            } else {
                m = three_linear(ctx);
                for (int i = 0; i < B * 70; i++) x[i] = sinf((float)i);
                for (int i = 0; i < B; i++) tg[i] = i % 5;
                b = (mt_batch){.n = B, .inputs = x, .targets = tg};
                /* the first layer's adapter alone: its gradient comes
                   through both later quantized weights */
                tc.lora.targets = "l0.w";
                tc.freeze = frz, tc.n_freeze = 1; /* and the biases train */
            }
            mt_trainer *t;
            CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
            int nq = 0;
            for (int i = 0; i < m->n_param; i++) nq += m->params[i].qf == mti_qformat_of(f);
            CHECK(nq == (kind == 0 ? 9 : 3)); /* GPT: the frozen token table too */
            const size_t n = mt_model_num_params(m);
            float *g = check_alloc(n * 4);
            for (int i = 0; i < m->n_param; i++) { /* B drawn too */
                mti_param *p = &m->params[i];
                if (p->adapter_of < 0 || !strstr(p->name, ".lora_b")) continue;
                float *v = check_alloc(p->numel * 4);
                for (size_t j = 0; j < p->numel; j++) v[j] = 0.3f * sinf((float)(p->offset + j));
                CHECK_OK(mti_param_write(m, i, 0, p->numel, v));
            }
            float loss;
            CHECK_OKC(ctx, mt_trainer_gradients(t, &b, &loss, g, n));
            int checked = 0;
            for (int i = 0; i < m->n_param; i++) {
                mti_param *p = &m->params[i];
                if (p->adapter_of < 0) {
                    if (p->qf)
                        for (size_t j = 0; j < p->numel; j++) CHECK(g[p->offset + j] == 0.0f);
                    continue;
                }
                for (size_t j = 0; j < p->numel; j += 1 + p->numel / 2) {
                    float keep, v, lp, lm;
                    const float h = 2e-3f;
                    CHECK_OK(mti_param_read(m, i, j, 1, &keep));
                    v = keep + h;
                    CHECK_OK(mti_param_write(m, i, j, 1, &v));
                    CHECK_OKC(ctx, mt_trainer_eval(t, &b, &lp, NULL));
                    v = keep - h;
                    CHECK_OK(mti_param_write(m, i, j, 1, &v));
                    CHECK_OKC(ctx, mt_trainer_eval(t, &b, &lm, NULL));
                    CHECK_OK(mti_param_write(m, i, j, 1, &keep));
                    double fd = ((double)lp - lm) / (2.0 * h), an = g[p->offset + j];
                    CHECK_MSG(fabs(fd - an) <= 3e-4 + 2e-2 * fabs(an),
                              "%s model %d %s[%zu]: backward %.6g, finite differences %.6g",
                              mt_base_format_name((mt_base_format)f), kind, p->name, j, an, fd);
                    checked++;
                }
            }
            CHECK(checked >= (kind == 0 ? 32 : 4));
            mt_trainer_destroy(t);
            CHECK_OK(mt_model_destroy(m));
            CHECK_OK(mt_context_destroy(ctx));
        }
}

/* ---- LoRA on a pretrained base: fp32, int8, NF4 ---- */


/* The tolerance of the docs (docs/engine.md, "Quantized frozen base"): the
 * loss after LoRA on a quantized base within this fraction of LoRA's on the
 * fp32 base, and the loss before LoRA too. */
#define QBASE_INT8_TOL 0.01f
#define QBASE_NF4_TOL 0.05f

/* A byte-level GPT pretrained on the project's docs, then LoRA (rank 8 on
 * qkv and fc, 40 steps) on C source over its fp32, int8 and NF4 base: the
 * loss on the source falls by 4% each time (5.6% on the fp32 base, 6.4% on
 * int8, 5.0% on NF4, whose token table is quantized too), the quantized runs end within
 * the documented tolerance of the fp32 one, their quantized weights do not
 * change, and PARAM holds less. */
TEST(qbase_lora_fine_tunes_int8_and_nf4_bases)
{
    size_t nc;
    const unsigned char *code = tf_slurp("test/data/c_source.txt", &nc);
    mt_context *ctx = check_cpu_context(2);
    mt_trainer_config tc;
    uint64_t rng = 1;
    mt_model *m = tf_pretrained(ctx, &tc, &rng, NULL);
    mt_trainer *t;
    mt_gpt_spec g;
    CHECK_OK(mt_model_gpt_get_spec(m, &g));
    const size_t n = mt_model_num_params(m);
    float *pre = check_alloc(n * 4);
    CHECK_OK(mt_model_get_params(m, pre, n));
    CHECK_OK(mt_model_destroy(m));
    float before[3], after[3];
    uint64_t param[3];
    for (int f = 0; f < 3; f++) {
        mt_gpt_spec gq = g;
        gq.base = (mt_base_format)f;
        CHECK_OKC(ctx, mt_model_gpt_create(ctx, &gq, &m));
        CHECK_OK(mt_model_set_params(m, pre, n)); /* quantized from the pretrained fp32 */
        tc.lora.rank = 8, tc.lora.alpha = 16.0f, tc.lora.targets = "*.qkv.w,*.fc.w";
        tc.lr = 1e-2f, tc.base = (mt_base_format)f;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        param[f] = class_live(ctx, MT_MEM_PARAM);
        float *w0 = check_alloc(n * 4), *w1 = check_alloc(mt_model_num_params(m) * 4);
        CHECK_OK(mt_model_get_params(m, w1, mt_model_num_params(m)));
        memcpy(w0, w1, n * 4); /* the base comes first */
        uint64_t r2 = 5;
        before[f] = tf_mean_loss(ctx, t, code, nc);
        tf_train(ctx, t, code, nc, &r2, 40);
        after[f] = tf_mean_loss(ctx, t, code, nc);
        CHECK_OK(mt_model_get_params(m, w1, mt_model_num_params(m)));
        CHECK_MSG(!memcmp(w0, w1, n * 4), "%s: the frozen base changed",
                  mt_base_format_name((mt_base_format)f));
        CHECK_MSG(after[f] < 0.96f * before[f], "%s base: the loss went from %.4f to %.4f",
                  mt_base_format_name((mt_base_format)f), (double)before[f], (double)after[f]);
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
    }
    if (getenv("MT_TEST_VERBOSE"))
        for (int f = 0; f < 3; f++)
            printf("    %s base: PARAM %llu bytes, source loss %.4f before LoRA, %.4f after\n",
                   mt_base_format_name((mt_base_format)f), (unsigned long long)param[f],
                   (double)before[f], (double)after[f]);
    const float tol[3] = {0, QBASE_INT8_TOL, QBASE_NF4_TOL};
    for (int f = 1; f < 3; f++) {
        CHECK_MSG(fabsf(after[f] - after[0]) <= tol[f] * after[0],
                  "%s: %.4f after LoRA, fp32 base %.4f", mt_base_format_name((mt_base_format)f),
                  (double)after[f], (double)after[0]);
        CHECK_MSG(fabsf(before[f] - before[0]) <= tol[f] * before[0],
                  "%s: %.4f before LoRA, fp32 base %.4f", mt_base_format_name((mt_base_format)f),
                  (double)before[f], (double)before[0]);
        CHECK(param[f] < param[f - 1]);
    }
    CHECK_OK(mt_context_destroy(ctx));
}

/* A bf16 trainer of LoRA rank 4 on a tiny GPT made with base f. */
static mt_trainer *bf16_lora(mt_context *ctx, uint64_t seed, mt_base_format f, mt_model **m)
{
    *m = tiny_gpt(ctx, seed, f);
    mt_trainer_config tc;
    lora_config(&tc, 4, f);
    tc.precision = MT_PREC_BF16;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(*m, &tc, &t));
    return t;
}

/* The estimate of a quantized base equals the run (the quantized bytes,
 * the dequantizing GEMMs' panels); a state file resumes bit for bit into a
 * model of other weights (the quantized bytes come from the file), and a
 * trainer of another base refuses it. */
TEST(qbase_estimate_and_resume)
{
    for (int f = MT_BASE_INT8; f <= MT_BASE_NF4; f++)
        for (int prec = 0; prec < 2; prec++) { /* (a context each: the model's creation counts) */
            mt_context *ctx = check_cpu_context(2);
            mt_model *m = tiny_gpt(ctx, 3, (mt_base_format)f);
            mt_trainer_config tc;
            mt_trainer *t;
            mt_estimate_report est;
            lora_config(&tc, 4, (mt_base_format)f);
            if (prec) tc.precision = MT_PREC_BF16, tc.recompute = MT_RECOMPUTE_SELECTIVE;
            CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
            CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
            check_token_steps(ctx, t, B, T, V, 0, 2);
            char what[32];
            snprintf(what, sizeof what, "%s, precision %d", mt_base_format_name((mt_base_format)f),
                     prec);
            check_estimate_matches(ctx, &est, what);
            mt_trainer_destroy(t);
            CHECK_OK(mt_model_destroy(m));
            CHECK_OK(mt_context_destroy(ctx));
        }
    /* resume */
    mt_context *ctx = check_cpu_context(2);
    char path[512];
    snprintf(path, sizeof path, "%s/mt_qbase_%d_state", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (int)getpid());
    float *w[2];
    size_t n = 0;
    mt_model *m;
    mt_trainer *t;
    for (int k = 0; k < 2; k++) {
        t = bf16_lora(ctx, 23 + (uint64_t)k, MT_BASE_NF4, &m);
        if (k == 0) check_token_steps(ctx, t, B, T, V, 0, 2);
        CHECK_OKC(ctx, k ? mt_trainer_load(t, path, NULL, 0, NULL) : mt_trainer_save(t, path, NULL, 0));
        check_token_steps(ctx, t, B, T, V, 2, 4);
        n = mt_model_num_params(m);
        w[k] = check_alloc(n * 4);
        CHECK_OK(mt_model_get_params(m, w[k], n));
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
    }
    CHECK_MSG(!memcmp(w[0], w[1], n * 4), "the resumed run differs");
    t = bf16_lora(ctx, 23, MT_BASE_INT8, &m); /* another base refuses the file */
    mt_status s = mt_trainer_load(t, path, NULL, 0, NULL);
    unlink(path);
    CHECK_EQ(s, MT_ERR_INVALID_ARG);
    CHECK(strstr(mt_last_error(ctx), "weights' storage"));
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* Merging LoRA into a quantized base: the merged weights are fp32 (the
 * dequantized base plus the adapters), and the model then gives the
 * adapted model's logits. */
TEST(qbase_merge_gives_fp32_weights)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *m = tiny_gpt(ctx, 7, MT_BASE_NF4);
    mt_trainer_config tc;
    lora_config(&tc, 4, MT_BASE_NF4);
    tc.lora.targets = "*.fc.w";
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    check_token_steps(ctx, t, B, T, V, 0, 3);
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    float *adapted = check_alloc((size_t)B * V * 4), *merged = check_alloc((size_t)B * V * 4);
    check_token_batch(&b, tok, tg, B, T, V, 9);
    CHECK_OKC(ctx, mt_trainer_logits(t, &b, adapted, (size_t)B * V));
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_lora_merge(m));
    int fp32 = 0, q = 0;
    for (int i = 0; i < m->n_param; i++) {
        fp32 += strstr(m->params[i].name, ".fc.w") && !m->params[i].qf;
        q += m->params[i].qf != 0;
    }
    CHECK(fp32 == 2 && q == 7); /* the other linear weights and the token table stay NF4 */
    /* the merged model's logits: the NF4 weights frozen (cfg.base), the
       fp32 fc weights left to train, so nothing is quantized again */
    mt_trainer_config_init(&tc);
    tc.max_batch = B, tc.max_seq = T, tc.base = MT_BASE_NF4;
    static const char *const qs[] = {"*.qkv.w", "*.attproj.w", "*.fcproj.w", "wte"};
    tc.freeze = qs, tc.n_freeze = 4;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    check_token_batch(&b, tok, tg, B, T, V, 9);
    CHECK_OKC(ctx, mt_trainer_logits(t, &b, merged, (size_t)B * V));
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
    for (int i = 0; i < B * V; i++)
        CHECK_MSG(fabsf(merged[i] - adapted[i]) <= 1e-4f + 1e-4f * fabsf(adapted[i]),
                  "logit %d: merged %.7g, adapted %.7g", i, (double)merged[i], (double)adapted[i]);
}

/* The frozen token table quantized (cfg.base with wte frozen): the lookup
 * dequantizes the rows it reads and the tied LM head runs through the
 * quantized matmuls, so on the CPU a trainer over it gives, bit for bit,
 * the losses, gradients and updates of the same model with the dequantized
 * table stored dense (fp32, and bf16 where the dense table is rounded as
 * the dequantizer rounds). PARAM holds the table's quantized bytes
 * (qbase_estimate_and_resume: the estimate and a resume with it). */
TEST(qbase_token_table_quantized_equals_dense)
{
    static const char *const frz[] = {"wte"};
    for (int f = MT_BASE_INT8; f <= MT_BASE_NF4; f++)
        for (int prec = 0; prec < 2; prec++) {
            mt_context *ctx = check_cpu_context(2);
            mt_model *mq = tiny_gpt(ctx, 11, MT_BASE_FULL), *md = tiny_gpt(ctx, 12, MT_BASE_FULL);
            const size_t n = mt_model_num_params(mq);
            float *w = check_alloc(n * 4), *g[2] = {check_alloc(n * 4), check_alloc(n * 4)};
            mt_trainer_config tc;
            mt_trainer_config_init(&tc);
            tc.max_batch = B, tc.max_seq = T, tc.optimizer = MT_OPT_ADAMW, tc.lr = 1e-2f;
            tc.freeze = frz, tc.n_freeze = 1;
            if (prec) tc.precision = MT_PREC_BF16;
            mt_trainer *t[2];
            tc.base = (mt_base_format)f;
            const uint64_t p0 = class_live(ctx, MT_MEM_PARAM);
            CHECK_OKC(ctx, mt_trainer_create(mq, &tc, &t[0]));
            CHECK(mq->params[0].qf == mti_qformat_of(f) && !strcmp(mq->params[0].name, "wte"));
            int nq = 0;
            for (int i = 0; i < mq->n_param; i++) nq += mq->params[i].qf != 0;
            CHECK_EQ(nq, 1); /* the linear weights train: only the table */
            const size_t tb = mq->params[0].numel;
            if (!prec) /* (bf16: the trainable weights' copies change PARAM too) */
                CHECK_EQ(p0 - class_live(ctx, MT_MEM_PARAM),
                         tb * 4 - mti_quant_bytes((mti_qformat)f, tb));
            CHECK_OK(mt_model_get_params(mq, w, n)); /* the table dequantized */
            CHECK_OK(mt_model_set_params(md, w, n));
            tc.base = MT_BASE_FULL;
            CHECK_OKC(ctx, mt_trainer_create(md, &tc, &t[1]));
            for (int step = 0; step < 3; step++) {
                int32_t tok[B * T], tg[B * T];
                mt_batch b;
                check_token_batch(&b, tok, tg, B, T, V, step);
                float loss[2];
                for (int k = 0; k < 2; k++) {
                    CHECK_OKC(ctx, mt_trainer_gradients(t[k], &b, &loss[k], g[k], n));
                    CHECK_OKC(ctx, mt_trainer_step(t[k], &b, &loss[k]));
                }
                CHECK_MSG(!memcmp(&loss[0], &loss[1], 4), "%s prec %d step %d: loss %.9g, dense %.9g",
                          mt_base_format_name((mt_base_format)f), prec, step, (double)loss[0],
                          (double)loss[1]);
                CHECK_MSG(!memcmp(g[0], g[1], n * 4), "%s prec %d step %d: gradients differ",
                          mt_base_format_name((mt_base_format)f), prec, step);
            }
            CHECK_OK(mt_model_get_params(mq, g[0], n));
            CHECK_OK(mt_model_get_params(md, g[1], n));
            /* (the table: the dense bf16 one reads back rounded to bf16) */
            CHECK_MSG(!memcmp(g[0] + tb, g[1] + tb, (n - tb) * 4),
                      "%s prec %d: the weights differ after 3 steps",
                      mt_base_format_name((mt_base_format)f), prec);
            CHECK_MSG(!memcmp(g[0], w, tb * 4), "the quantized table changed");
            mt_trainer_destroy(t[1]);
            CHECK_OK(mt_model_destroy(md));
            mt_trainer_destroy(t[0]);
            CHECK_OK(mt_model_destroy(mq));
            CHECK_OK(mt_context_destroy(ctx));
        }
}

/* Bad settings: each refused with a status and a message that names it. */
TEST(qbase_refuses_bad_settings)
{
    mt_context *ctx = check_cpu_context(1);
    mt_trainer_config tc;
    mt_trainer *t;
    mt_model *m = tiny_gpt(ctx, 1, MT_BASE_FULL);
    lora_config(&tc, 0, (mt_base_format)7);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "cfg->base 7"));
    lora_config(&tc, 0, MT_BASE_NF4); /* nothing frozen */
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "none is frozen"));
    static const char *const frz[] = {"*.b"};
    tc.freeze = frz, tc.n_freeze = 1; /* biases alone: no linear weight */
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "none is frozen"));
    lora_config(&tc, 2, MT_BASE_NF4);
    tc.precision = MT_PREC_FP16;
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "fp16"));
    CHECK_OK(mt_model_destroy(m));
    m = tiny_gpt(ctx, 1, MT_BASE_INT8);
    lora_config(&tc, 2, MT_BASE_FULL);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "set cfg->base to int8"));
    lora_config(&tc, 2, MT_BASE_NF4);
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "quantized as int8"));
    lora_config(&tc, 0, MT_BASE_INT8);
    static const char *const emb[] = {"wte"};
    tc.freeze = emb, tc.n_freeze = 1; /* the quantized weights would train */
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "cannot train"));
    CHECK_EQ(mt_model_num_tensors(m), 2 + 24 + 2); /* no adapters left behind */
    CHECK_OK(mt_model_destroy(m));
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = 1, g.heads = 2, g.channels = 16;
    g.base = (mt_base_format)3;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_gpt_create(ctx, &g, &m));
    CHECK(strstr(mt_last_error(ctx), "spec->base 3"));
    CHECK(mt_base_format_name((mt_base_format)3) == NULL);
    CHECK(!strcmp(mt_base_format_name(MT_BASE_NF4), "nf4"));
    CHECK_OK(mt_context_destroy(ctx));
}

/* Weights NF4 cannot hold (block maxima whose float32 mean overflows)
 * are refused, naming the tensor, with the model unchanged: set_params
 * checks every quantized weight before it writes any. */
TEST(qbase_nf4_refuses_values_it_cannot_hold)
{
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = tiny_gpt(ctx, 1, MT_BASE_NF4);
    const size_t n = mt_model_num_params(m);
    float *was = check_alloc(n * sizeof *was), *w = check_alloc(n * sizeof *w),
          *now = check_alloc(n * sizeof *now);
    CHECK_OK(mt_model_get_params(m, was, n));
    memcpy(w, was, n * sizeof *w);
    int big = -1; /* the last quantized weight gets values near float32's largest */
    for (int i = 0; i < m->n_param; i++)
        if (m->params[i].qf) big = i;
    CHECK(big >= 0);
    const mti_param *p = &m->params[big];
    for (size_t j = 0; j < p->numel; j++) w[p->offset + j] = j % 2 ? 3e38f : -3e38f;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_model_set_params(m, w, n));
    CHECK_MSG(strstr(mt_last_error(ctx), p->name) && strstr(mt_last_error(ctx), "overflows"),
              "%s", mt_last_error(ctx));
    CHECK_OK(mt_model_get_params(m, now, n));
    CHECK(memcmp(was, now, n * sizeof *now) == 0);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* Three steps of t (the losses into loss), then its gradients of a fourth
 * batch and the model's weights (*w, *gr); the trainer goes. The count of
 * parameters. */
static size_t head_run(mt_context *ctx, mt_trainer *t, mt_model *m, float loss[3], float **w,
                       float **gr)
{
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    for (int st = 0; st < 3; st++) {
        check_token_batch(&b, tok, tg, B, T, V, st);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss[st]));
    }
    const size_t n = mt_model_num_params(m);
    *w = check_alloc(n * 4);
    *gr = check_alloc(n * 4);
    check_token_batch(&b, tok, tg, B, T, V, 7);
    CHECK_OKC(ctx, mt_trainer_gradients(t, &b, NULL, *gr, n));
    CHECK_OK(mt_model_get_params(m, *w, n));
    mt_trainer_destroy(t);
    return n;
}

/* The LM head fused with the loss (a frozen head, mti_engine_head_rows):
 * run a block of rows at a time, it gives the whole head's bits. LoRA on
 * an NF4 base (fp32; bf16 with the fused step and clipping, whose two
 * backward passes keep the head's input gradient), a frozen fp32 table,
 * and distillation from a quantized teacher: blocks of 5 rows (the last
 * partial) and of the default size against the unfused head, losses,
 * gradients and weights after three steps bit for bit. */
TEST(qbase_fused_head_same_bits)
{
    static const char *const frz[] = {"wte", "*.qkv.w"};
    for (int c = 0; c < 4; c++) {
        mt_context *ctx = check_cpu_context(2);
        mt_model *m[3], *te = c == 3 ? tiny_gpt(ctx, 8, MT_BASE_NF4) : NULL;
        float *w[3], *gr[3], loss[3][3];
        size_t n = 0;
        for (int k = 0; k < 3; k++) {
            m[k] = tiny_gpt(ctx, 5, c == 0 || c == 1 ? MT_BASE_NF4 : MT_BASE_FULL);
            mt_trainer_config tc;
            lora_config(&tc, c < 2 ? 4 : 0, c < 2 ? MT_BASE_NF4 : MT_BASE_FULL);
            if (c == 1)
                tc.precision = MT_PREC_BF16, tc.fused_step = 1, tc.grad_clip = 1.0f;
            if (c >= 2) tc.freeze = frz, tc.n_freeze = 2;
            if (c == 3) tc.teacher = te, tc.distill_alpha = 0.6f;
            mt_trainer *t;
            CHECK_OKC(ctx, mt_trainer_create(m[k], &tc, &t));
            CHECK(t->E.head_rows > 0);
            if (k < 2) t->E.head_rows = k ? 5 : 0; /* unfused; blocks of 5 rows */
            n = head_run(ctx, t, m[k], loss[k], &w[k], &gr[k]);
            if (k) {
                CHECK_MSG(!memcmp(loss[k], loss[0], sizeof loss[0]),
                          "case %d, blocks %d: losses %.9g %.9g %.9g, unfused %.9g %.9g %.9g", c, k,
                          (double)loss[k][0], (double)loss[k][1], (double)loss[k][2],
                          (double)loss[0][0], (double)loss[0][1], (double)loss[0][2]);
                CHECK_MSG(!memcmp(w[k], w[0], n * 4), "case %d, blocks %d: the weights differ", c, k);
                CHECK_MSG(!memcmp(gr[k], gr[0], n * 4), "case %d, blocks %d: the gradients differ",
                          c, k);
            }
        }
        for (int k = 0; k < 3; k++) CHECK_OK(mt_model_destroy(m[k]));
        CHECK_OK(mt_model_destroy(te));
        CHECK_OK(mt_context_destroy(ctx));
    }
}

/* A trained LM head (the tied table trained) fused with the loss: its
 * logits never exist whole (at most a block of them), and its weight
 * gradient is each block's part added in order, which the unfused head
 * (the whole logits kept) also sums by, so the two give the same bits:
 * fp32 AdamW; bf16 with three micro-batches and clipping; distillation
 * from a teacher; blocks of 5 rows (the last partial) and the default (one
 * block here), losses, weights after three steps and gradients. The fused
 * step defers the head's dlogits and keeps them (no fused head). */
TEST(trained_head_fused_same_bits)
{
    for (int c = 0; c < 3; c++)
        for (int blocks = 0; blocks < 2; blocks++) {
            mt_context *ctx = check_cpu_context(2);
            mt_model *m[2], *te = c == 2 ? tiny_gpt(ctx, 8, MT_BASE_FULL) : NULL;
            float *w[2], *gr[2], loss[2][3];
            size_t n = 0;
            for (int k = 0; k < 2; k++) {
                m[k] = tiny_gpt(ctx, 5, MT_BASE_FULL);
                mt_trainer_config tc;
                lora_config(&tc, 0, MT_BASE_FULL);
                if (c == 1) tc.precision = MT_PREC_BF16, tc.micro_batch = 1, tc.grad_clip = 0.5f;
                if (c == 2) tc.teacher = te, tc.distill_alpha = 0.6f;
                mt_trainer *t;
                CHECK_OKC(ctx, mt_trainer_create(m[k], &tc, &t));
                CHECK(t->E.head_rows > 0);
                if (blocks) t->E.head_rows = 5;
                t->E.head_unfused = k; /* (k 1: the whole logits, the same dW blocks) */
                n = head_run(ctx, t, m[k], loss[k], &w[k], &gr[k]);
            }
            CHECK_MSG(!memcmp(loss[1], loss[0], sizeof loss[0]),
                      "case %d blocks %d: losses %.9g %.9g %.9g, unfused %.9g %.9g %.9g", c, blocks,
                      (double)loss[0][0], (double)loss[0][1], (double)loss[0][2],
                      (double)loss[1][0], (double)loss[1][1], (double)loss[1][2]);
            CHECK_MSG(!memcmp(w[1], w[0], n * 4), "case %d blocks %d: the weights differ", c, blocks);
            CHECK_MSG(!memcmp(gr[1], gr[0], n * 4), "case %d blocks %d: the gradients differ", c,
                      blocks);
            for (int k = 0; k < 2; k++) CHECK_OK(mt_model_destroy(m[k]));
            CHECK_OK(mt_model_destroy(te));
            CHECK_OK(mt_context_destroy(ctx));
        }
    /* the fused step: the head's dlogits deferred to the embedding, unfused */
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = tiny_gpt(ctx, 5, MT_BASE_FULL);
    mt_trainer_config tc;
    lora_config(&tc, 0, MT_BASE_FULL);
    tc.fused_step = 1;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_EQ(t->E.head_rows, 0);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* ---- CUDA contexts ---- */

/* A CUDA context over the stand-in driver and cuBLASLt (NULL where the
 * suite has none): allocation, copies, accounting and the dequantizing
 * kernels' twins are real, the other kernels compute nothing. */
static mt_context *standin_cuda(void)
{
    const char *cu = getenv("MT_FAKE_CUDA"), *lt = getenv("MT_FAKE_CUBLASLT");
    if (!cu || !*cu || !lt || !*lt) return NULL;
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CUDA;
    cc.cuda_driver_path = cu, cc.cublaslt_path = lt;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cc, &ctx));
    return ctx;
}

/* Every parameter of a (on a CUDA context) stored as b's (on the CPU):
 * the same format, and the same bytes, copied back from the device; with
 * quantized_only, the quantized weights alone. */
static void check_same_storage(const mt_model *a, const mt_model *b, const char *what,
                               bool quantized_only)
{
    CHECK_EQ(a->n_param, b->n_param);
    for (int i = 0; i < a->n_param; i++) {
        const mti_param *p = &a->params[i], *q = &b->params[i];
        if (quantized_only && !p->qf && !q->qf) continue;
        const size_t n = mti_tensor_bytes(&p->w);
        CHECK_MSG(p->qf == q->qf && p->w.dtype == q->w.dtype && n == mti_tensor_bytes(&q->w),
                  "%s: %s is stored as format %d dtype %d (%zu bytes), on the CPU as %d, %d (%zu)",
                  what, p->name, p->qf, (int)p->w.dtype, n, q->qf, (int)q->w.dtype,
                  mti_tensor_bytes(&q->w));
        unsigned char *x = check_alloc(n), *y = check_alloc(n);
        CHECK_OKC(a->ctx, mti_tensor_download(a->ctx, &p->w, x, n));
        CHECK_OKC(b->ctx, mti_tensor_download(b->ctx, &q->w, y, n));
        CHECK_MSG(!memcmp(x, y, n), "%s: %s's bytes differ from the CPU's", what, p->name);
    }
}

static bool same_file(const char *a, const char *b)
{
    FILE *f = fopen(a, "rb"), *g = fopen(b, "rb");
    bool same = f && g;
    for (int c = 0; same;) {
        c = fgetc(f);
        same = c == fgetc(g);
        if (c == EOF) break;
    }
    if (f) fclose(f);
    if (g) fclose(g);
    return same;
}

/* A quantized base on a CUDA context over the stand-ins: a GPT quantized as
 * it is made, the trainer's quantized token table, set_params quantizing
 * again, a model loaded quantized from a file (a teacher) hold the CPU
 * context's quantized bytes in device memory; the estimate (model, LoRA
 * trainer, steps; a quantized teacher's distillation) equals the run; a
 * training-state file saved there loads back into other weights and saves
 * the same file again; merging dequantizes on the device to the CPU's
 * merged weights. */
TEST(qbase_cuda_standin_quantized_in_device_memory)
{
    if (!getenv("MT_FAKE_CUDA") || !getenv("MT_FAKE_CUBLASLT")) return;
#if !MT_HAVE_CUDA_KERNELS
    return; /* a build without nvcc (or for another architecture): no kernels to train with */
#endif
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char path[3][512];
    for (int k = 0; k < 3; k++)
        snprintf(path[k], sizeof path[k], "%s/mt_qbase_cuda_%d_%d", tmp, (int)getpid(), k);
    for (int f = MT_BASE_INT8; f <= MT_BASE_NF4; f++) {
        const char *fname = mt_base_format_name((mt_base_format)f);
        mt_context *gpu = standin_cuda(), *cpu = check_cpu_context(1);
        mt_model *mg = tiny_gpt(gpu, 3, (mt_base_format)f), *mc = tiny_gpt(cpu, 3, (mt_base_format)f);
        check_same_storage(mg, mc, fname, false);
        mt_trainer_config tc;
        lora_config(&tc, 4, (mt_base_format)f);
        mt_estimate_report est;
        CHECK_OKC(gpu, mt_estimate_model(mg, &tc, &est));
        mt_trainer *tg, *tcpu;
        CHECK_OKC(gpu, mt_trainer_create(mg, &tc, &tg));
        CHECK_OKC(cpu, mt_trainer_create(mc, &tc, &tcpu));
        CHECK(mg->params[0].qf == mti_qformat_of(f)); /* the token table, quantized by the trainer */
        check_same_storage(mg, mc, fname, false);
        check_token_steps(gpu, tg, B, T, V, 0, 2);
        check_estimate_matches(gpu, &est, fname);
        /* a training-state file: into a model of other weights, then saved again */
        CHECK_OKC(gpu, mt_trainer_save(tg, path[0], NULL, 0));
        mt_model *m2 = tiny_gpt(gpu, 4, (mt_base_format)f);
        mt_trainer *t2;
        CHECK_OKC(gpu, mt_trainer_create(m2, &tc, &t2));
        CHECK_OKC(gpu, mt_trainer_load(t2, path[0], NULL, 0, NULL));
        CHECK_OKC(gpu, mt_trainer_save(t2, path[1], NULL, 0));
        CHECK_MSG(same_file(path[0], path[1]), "%s: the state file loaded and saved differs", fname);
        mt_trainer_destroy(t2);
        CHECK_OK(mt_model_destroy(m2));
        mt_trainer_destroy(tg);
        mt_trainer_destroy(tcpu);
        /* the same values in both (quantized again), adapters of nonzero B, merged */
        const size_t n = mt_model_num_params(mc);
        float *w = check_alloc(n * 4), *wg = check_alloc(n * 4);
        CHECK_OK(mt_model_get_params(mc, w, n));
        CHECK_OK(mt_model_get_params(mg, wg, n));
        for (int i = 0; i < mc->n_base; i++) /* the base: dequantized on the device, the same */
            CHECK_MSG(!memcmp(w + mc->params[i].offset, wg + mc->params[i].offset,
                              mc->params[i].numel * 4),
                      "%s: %s reads back otherwise than on the CPU", fname, mc->params[i].name);
        for (int i = mc->n_base + 1; i < mc->n_param; i += 2)
            for (size_t j = 0; j < mc->params[i].numel; j++)
                w[mc->params[i].offset + j] = 0.1f * sinf((float)j);
        CHECK_OK(mt_model_set_params(mc, w, n));
        CHECK_OK(mt_model_set_params(mg, w, n));
        check_same_storage(mg, mc, fname, false);
        CHECK_OK(mt_model_lora_merge(mc));
        CHECK_OK(mt_model_lora_merge(mg));
        check_same_storage(mg, mc, fname, false);
        /* a quantized teacher loaded from the merged model's file */
        CHECK_OK(mt_model_gpt_save(mc, path[2]));
        CHECK_OK(mt_model_destroy(mg));
        CHECK_OK(mt_model_destroy(mc));
        CHECK_OK(mt_context_destroy(gpu));
        gpu = standin_cuda();
        mt_model *te, *tec, *st = tiny_gpt(gpu, 5, MT_BASE_FULL);
        CHECK_OKC(gpu, mt_model_gpt_load_base(gpu, path[2], (mt_base_format)f, &te));
        CHECK_OKC(cpu, mt_model_gpt_load_base(cpu, path[2], (mt_base_format)f, &tec));
        check_same_storage(te, tec, fname, false);
        mt_trainer_config_init(&tc);
        tc.max_batch = B, tc.max_seq = T, tc.teacher = te, tc.distill_alpha = 0.5f;
        tc.precision = MT_PREC_BF16;
        CHECK_OKC(gpu, mt_estimate_model(st, &tc, &est));
        CHECK_OKC(gpu, mt_trainer_create(st, &tc, &tg));
        check_token_steps(gpu, tg, B, T, V, 0, 2);
        check_estimate_matches(gpu, &est, "a quantized teacher");
        mt_trainer_destroy(tg);
        CHECK_OK(mt_model_destroy(st));
        CHECK_OK(mt_model_destroy(te));
        CHECK_OK(mt_model_destroy(tec));
        CHECK_OK(mt_context_destroy(gpu));
        CHECK_OK(mt_context_destroy(cpu));
    }
    for (int k = 0; k < 3; k++) unlink(path[k]);
}

/* The gradients of t (of n parameters) on the first token batch; t is
 * destroyed. */
static float *first_gradients(mt_trainer *t, size_t n)
{
    float *g = check_alloc(n * 4);
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    check_token_batch(&b, tok, tg, B, T, V, 0);
    CHECK_OK(mt_trainer_gradients(t, &b, NULL, g, n));
    mt_trainer_destroy(t);
    return g;
}

/* LoRA on an int8 and an NF4 base on the CUDA table (MT_TEST_GPU=1; the
 * engine group of the GPU bundle) against the same on the CPU: the
 * adapters' gradients, two fp32 and two bf16 steps' losses, the quantized
 * bytes in PARAM the same; then a student distilled from a quantized
 * teacher. The GPU's frozen head runs with the loss in blocks of 8 rows
 * (the CPU's in one). */
TEST(gpu_engine_qbase_matches_cpu)
{
    mt_context *ctx[2] = {check_gpu_context(), NULL};
    if (!ctx[0]) return;
    ctx[1] = check_cpu_context(2);
    for (int f = MT_BASE_INT8; f <= MT_BASE_NF4 + 1; f++) {
        const bool teach = f > MT_BASE_NF4; /* last: a student of an NF4 teacher */
        float *g[2], loss[2][4];
        size_t n = 0;
        mt_model *m[2], *te[2] = {NULL, NULL};
        for (int d = 0; d < 2; d++) {
            mt_trainer_config tc;
            if (teach) {
                te[d] = tiny_gpt(ctx[d], 41, MT_BASE_NF4);
                m[d] = tiny_gpt(ctx[d], 43, MT_BASE_FULL);
                mt_trainer_config_init(&tc);
                tc.max_batch = B, tc.max_seq = T, tc.optimizer = MT_OPT_ADAMW, tc.lr = 1e-2f;
                tc.teacher = te[d], tc.distill_alpha = 0.7f, tc.distill_temp = 2.0f;
                static const char *const fw[] = {"wte"}; /* (a frozen head: fused) */
                tc.freeze = fw, tc.n_freeze = 1;
            } else {
                m[d] = tiny_gpt(ctx[d], 31, (mt_base_format)f);
                lora_config(&tc, 8, (mt_base_format)f);
                tc.lora.targets = "*.qkv.w,*.fc.w,*.fcproj.w";
            }
            mt_trainer *t;
            CHECK_OKC(ctx[d], mt_trainer_create(m[d], &tc, &t));
            if (d == 0 && t->E.head_rows) t->E.head_rows = 8; /* the fused head in 4 blocks on the GPU */
            n = mt_model_num_params(m[d]);
            float *w = check_alloc(n * 4);
            CHECK_OK(mt_model_get_params(m[d], w, n));
            for (int i = 0; i < m[d]->n_param; i++)
                if (strstr(m[d]->params[i].name, ".lora_b"))
                    for (size_t j = 0; j < m[d]->params[i].numel; j++)
                        w[m[d]->params[i].offset + j] = 0.2f * cosf((float)j);
            CHECK_OK(mt_model_set_params(m[d], w, n));
            g[d] = first_gradients(t, n); /* (t goes) */
            for (int prec = 0; prec < 2; prec++) {
                if (!teach) lora_config(&tc, 0, (mt_base_format)f);
                tc.precision = prec ? MT_PREC_BF16 : MT_PREC_FP32;
                tc.recompute = prec ? MT_RECOMPUTE_SELECTIVE : MT_RECOMPUTE_NONE;
                tc.fused_step = prec && !teach;
                tc.micro_batch = prec && teach ? 2 : 0;
                CHECK_OKC(ctx[d], mt_trainer_create(m[d], &tc, &t));
                if (d == 0 && t->E.head_rows) t->E.head_rows = 8;
                int32_t tok[B * T], tg[B * T];
                mt_batch b;
                for (int s = 0; s < 2; s++) {
                    check_token_batch(&b, tok, tg, B, T, V, s + 1);
                    CHECK_OKC(ctx[d], mt_trainer_step(t, &b, &loss[d][2 * prec + s]));
                }
                mt_trainer_destroy(t);
            }
        }
        check_same_storage(teach ? te[0] : m[0], teach ? te[1] : m[1],
                           teach ? "the teacher" : mt_base_format_name((mt_base_format)f), true);
        check_gpu_near_cpu(g[0], g[1], n, loss[0], loss[1]);
        for (int d = 0; d < 2; d++) {
            CHECK_OK(mt_model_destroy(m[d]));
            CHECK_OK(mt_model_destroy(te[d]));
        }
    }
    CHECK_OK(mt_context_destroy(ctx[0]));
    CHECK_OK(mt_context_destroy(ctx[1]));
}
