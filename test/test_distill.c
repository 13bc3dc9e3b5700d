/*
 * test_distill.c - knowledge distillation (cfg.teacher; the xent_kd op):
 * the fused loss and gradient against a direct double-precision formula
 * and central differences; alpha 0 is plain training bit for bit; bad
 * settings are refused; the estimate equals the run; a small student
 * distilled from a larger teacher against the same student on labels.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "ops/kernels.h"
#include "memtrain.h"
#include "model/model.h"

/* The loss of one row in double, straight from the definition. */
static double kd_ref(const float *s, const float *t, int tgt, int V, double alpha, double T,
                     double *grad)
{
    double ms = -INFINITY, mt = -INFINITY;
    for (int j = 0; j < V; j++) ms = fmax(ms, s[j]), mt = fmax(mt, t[j]);
    double z1 = 0, zs = 0, zt = 0;
    for (int j = 0; j < V; j++)
        z1 += exp(s[j] - ms), zs += exp((s[j] - ms) / T), zt += exp((t[j] - mt) / T);
    double ce = log(z1) + ms - s[tgt], kl = 0;
    for (int j = 0; j < V; j++) {
        double pt = exp((t[j] - mt) / T) / zt, ps = exp((s[j] - ms) / T) / zs;
        kl += pt * (log(pt) - log(ps));
        if (grad)
            grad[j] = (1 - alpha) * (exp(s[j] - ms) / z1 - (j == tgt)) + alpha * T * (ps - pt);
    }
    return (1 - alpha) * ce + alpha * T * T * kl;
}

enum { KN = 5, KV = 37, KVP = 40, KTVP = 48 };

TEST(distill_op_matches_formula_and_finite_differences)
{
    mt_context *ctx = check_cpu_context(2);
    const mti_ops *op = mti_cpu_ops();
    const mti_kctx k = {ctx, ctx->dev};
    float s[KN * KVP], t[KN * KTVP], d[KN * KVP], loss[KN], l2[KN];
    int32_t tg[KN];
    uint64_t r = 5;
    for (int i = 0; i < KN * KTVP; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        float u = (float)((r >> 40) & 0xffff) / 65536.0f;
        if (i < KN * KVP) s[i] = 4.0f * u - 2.0f;
        t[i] = 6.0f * u - 3.0f + (float)(i % 7) * 0.3f;
    }
    for (int i = 0; i < KN; i++) tg[i] = (i * 11) % KV;
    const float alphas[] = {0.3f, 1.0f}, temps[] = {2.5f, 0.7f};
    for (int c = 0; c < 2; c++) {
        const float a = alphas[c], T = temps[c], dloss = 0.5f;
        CHECK_OKC(ctx, op->xent_kd(&k, loss, d, s, t, tg, KN, KV, KVP, KTVP, a, T, dloss, MTI_F32));
        for (int i = 0; i < KN; i++) {
            double g[KV];
            double ref = kd_ref(s + i * KVP, t + i * KTVP, tg[i], KV, a, T, g);
            CHECK_MSG(fabs(loss[i] - ref) <= 1e-5 * (1 + fabs(ref)), "row %d: loss %.9g, formula %.9g",
                      i, (double)loss[i], ref);
            for (int j = 0; j < KVP; j++) {
                double want = j < KV ? dloss * g[j] : 0.0;
                CHECK_MSG(fabs(d[i * KVP + j] - want) <= 1e-6, "row %d col %d: %.9g, formula %.9g",
                          i, j, (double)d[i * KVP + j], want);
            }
            /* central differences of the kernel's own loss */
            for (int j = 0; j < KV; j += 3) {
                float keep = s[i * KVP + j], h = 1e-2f;
                s[i * KVP + j] = keep + h;
                CHECK_OKC(ctx, op->xent_kd(&k, l2, NULL, s, t, tg, KN, KV, KVP, KTVP, a, T, 1, MTI_F32));
                double up = l2[i];
                s[i * KVP + j] = keep - h;
                CHECK_OKC(ctx, op->xent_kd(&k, l2, NULL, s, t, tg, KN, KV, KVP, KTVP, a, T, 1, MTI_F32));
                s[i * KVP + j] = keep;
                double fd = (up - l2[i]) / (2.0 * h);
                CHECK_MSG(fabs(fd - d[i * KVP + j] / dloss) <= 2e-3,
                          "row %d col %d: gradient %.6g, finite differences %.6g", i, j,
                          (double)(d[i * KVP + j] / dloss), fd);
            }
        }
    }
    /* alpha 0 is the cross-entropy, bit for bit; bad settings are refused */
    float dx[KN * KVP], lx[KN];
    CHECK_OKC(ctx, op->xent_kd(&k, loss, d, s, t, tg, KN, KV, KVP, KTVP, 0.0f, 3.0f, 0.25f, MTI_F32));
    CHECK_OKC(ctx, op->xent(&k, lx, dx, s, tg, KN, KV, KVP, 0.25f, MTI_F32));
    CHECK(!memcmp(loss, lx, sizeof lx) && !memcmp(d, dx, sizeof dx));
    CHECK_ST(MT_ERR_INVALID_ARG, op->xent_kd(&k, loss, d, s, t, tg, KN, KV, KVP, KTVP, 1.5f, 1, 1, MTI_F32));
    CHECK_ST(MT_ERR_INVALID_ARG, op->xent_kd(&k, loss, d, s, t, tg, KN, KV, KVP, KTVP, 0.5f, 0, 1, MTI_F32));
    CHECK_OK(mt_context_destroy(ctx));
}

/* ---- the trainer ---- */

enum { B = 4, T = 8, V = 64 };

static mt_model *gpt(mt_context *ctx, int layers, int channels, uint64_t seed)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V, g.max_seq = T, g.layers = layers, g.heads = 2, g.channels = channels, g.seed = seed;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    return m;
}

static void kd_config(mt_trainer_config *tc, mt_model *teacher, float alpha)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B, tc->max_seq = T, tc->optimizer = MT_OPT_ADAMW, tc->lr = 1e-2f;
    tc->teacher = teacher, tc->distill_alpha = alpha, tc->distill_temp = 2.0f;
}

/* Steps the student, returning its weights (held by the test). */
static float *trained(mt_context *ctx, mt_model *m, const mt_trainer_config *tc, int steps)
{
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, tc, &t));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    for (int s = 0; s < steps; s++) {
        check_token_batch(&b, tok, tg, B, T, V, s);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    }
    mt_trainer_destroy(t);
    size_t n = mt_model_num_params(m);
    float *w = check_alloc(n * 4);
    CHECK_OK(mt_model_get_params(m, w, n));
    return w;
}

/* alpha 0: the teacher runs, and the student's weights are those of plain
 * training, bit for bit, in fp32 and in bf16 with accumulation and
 * recompute. Alpha 0.5 moves them elsewhere. */
TEST(distill_alpha0_is_plain_training)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *teacher = gpt(ctx, 3, 32, 99);
    for (int c = 0; c < 2; c++) {
        mt_trainer_config tc;
        kd_config(&tc, NULL, 0.0f);
        if (c) tc.precision = MT_PREC_BF16, tc.micro_batch = 2, tc.recompute = MT_RECOMPUTE_SQRT;
        mt_model *m = gpt(ctx, 2, 16, 4);
        float *plain = trained(ctx, m, &tc, 3);
        CHECK_OK(mt_model_destroy(m));
        m = gpt(ctx, 2, 16, 4);
        tc.teacher = teacher;
        float *kd0 = trained(ctx, m, &tc, 3);
        size_t n = mt_model_num_params(m);
        CHECK_MSG(!memcmp(plain, kd0, n * 4), "case %d: alpha 0 differs from plain training", c);
        CHECK_OK(mt_model_destroy(m));
        m = gpt(ctx, 2, 16, 4);
        tc.distill_alpha = 0.5f;
        float *kd = trained(ctx, m, &tc, 3);
        CHECK(memcmp(plain, kd, n * 4) != 0);
        CHECK_OK(mt_model_destroy(m));
    }
    CHECK_OK(mt_model_destroy(teacher));
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(distill_refuses_bad_settings)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *m = gpt(ctx, 2, 16, 4), *te = gpt(ctx, 1, 16, 5), *t;
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = V + 1, g.max_seq = T, g.layers = 1, g.heads = 2, g.channels = 16;
    mt_model *other;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &other));
    g.vocab = V, g.max_seq = T / 2;
    mt_model *shorter;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &shorter));
    struct {
        mt_model *teacher;
        float alpha, temp;
        const char *says;
    } bad[] = {
        {te, 1.5f, 2.0f, "distill_alpha"}, {te, -0.1f, 2.0f, "distill_alpha"},
        {te, 0.5f, 0.0f, "distill_temp"}, {te, 0.5f, NAN, "distill_temp"},
        {m, 0.5f, 2.0f, "student model itself"}, {other, 0.5f, 2.0f, "vocabulary"},
        {shorter, 0.5f, 2.0f, "context"},
    };
    mt_trainer *tr;
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        mt_trainer_config tc;
        kd_config(&tc, bad[i].teacher, bad[i].alpha);
        tc.distill_temp = bad[i].temp;
        CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &tr));
        CHECK_MSG(strstr(mt_last_error(ctx), bad[i].says), "case %zu: %s", i, mt_last_error(ctx));
    }
    /* a teaching teacher is held: no trainer of its own, no destroy */
    mt_trainer_config tc;
    kd_config(&tc, te, 0.5f);
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &tr));
    CHECK_ST(MT_ERR_STATE, mt_trainer_create(te, NULL, &(mt_trainer *){NULL}));
    CHECK_ST(MT_ERR_STATE, mt_model_destroy(te));
    mt_trainer_destroy(tr);
    t = te;
    CHECK_OK(mt_model_destroy(t));
    CHECK_OK(mt_model_destroy(other));
    CHECK_OK(mt_model_destroy(shorter));
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* The estimate of a distilling run (teacher included) equals the run,
 * class by class, over precisions, the fused step, accumulation, recompute
 * and LoRA, on the CPU and on a CUDA context (over the stand-in driver and
 * cuBLASLt, whose kernels compute nothing: the accounting is what counts). */
TEST(distill_estimate_equals_run)
{
    for (int c = 0; c < 6; c++) {
        mt_context *ctx;
        if (c >= 4) { /* a CUDA context over the stand-ins: the CUDA table's kernel and checks */
            if (!check_fake_cuda() || !getenv("MT_FAKE_CUBLASLT")) continue;
            mt_context_config cc;
            mt_context_config_init(&cc);
            cc.device = MT_DEVICE_CUDA;
            cc.cuda_driver_path = check_fake_cuda();
            cc.cublaslt_path = getenv("MT_FAKE_CUBLASLT");
            CHECK_OK(mt_context_create(&cc, &ctx));
        } else {
            ctx = check_cpu_context(2);
        }
        mt_model *m = gpt(ctx, 2, 16, 4), *te = gpt(ctx, 3, 32, 5);
        mt_trainer_config tc;
        kd_config(&tc, te, 0.7f);
        if (c == 0) tc.fused_step = 1;
        if (c == 1) tc.precision = MT_PREC_BF16, tc.micro_batch = 2;
        if (c == 2) tc.recompute = MT_RECOMPUTE_EVERY_K, tc.recompute_every = 1, tc.precision = MT_PREC_FP16;
        if (c == 3) tc.lora.rank = 2, tc.lora.alpha = 4, tc.lora.targets = "*.qkv.w";
        if (c == 5) tc.precision = MT_PREC_BF16, tc.micro_batch = 2, tc.recompute = MT_RECOMPUTE_SQRT;
        mt_estimate_report est;
        CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        check_token_steps(ctx, t, B, T, V, 0, 2);
        char what[16];
        snprintf(what, sizeof what, "case %d", c);
        check_estimate_matches(ctx, &est, what);
        mt_trainer_destroy(t);
        if (c == 3) CHECK_OK(mt_model_lora_merge(m));
        CHECK_OK(mt_model_destroy(te));
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
}

/* A quantized teacher (mt_model_gpt_load_base / mt_gpt_spec.base: its
 * linear weights int8 or NF4; here also its token table, as a trainer's
 * cfg.base leaves it): the student's gradients equal, bit for bit, those
 * from an fp32 teacher holding the dequantized weights, and stay within
 * the documented tolerance of the fp32 teacher's (the distilled loss
 * within 1% for int8, 2% for NF4); the estimate equals the run; the
 * teacher's PARAM is the quantized bytes. */
TEST(distill_quantized_teacher)
{
    mt_context *ctx = check_cpu_context(2);
    mt_model *te32 = gpt(ctx, 3, 64, 5);
    const size_t nt = mt_model_num_params(te32);
    float *tw = check_alloc(nt * 4), *dq = check_alloc(nt * 4);
    CHECK_OK(mt_model_get_params(te32, tw, nt));
    int32_t tok[B * T], tg[B * T];
    mt_batch b;
    check_token_batch(&b, tok, tg, B, T, V, 3);
    float loss32 = 0;
    for (int f = MT_BASE_FULL; f <= MT_BASE_NF4; f++) {
        mt_gpt_spec g;
        CHECK_OK(mt_model_gpt_get_spec(te32, &g));
        g.base = (mt_base_format)f;
        mt_model *tq, *tdense = gpt(ctx, 3, 64, 6);
        mt_memory_stats st0, st1;
        CHECK_OK(mt_context_memory_stats(ctx, &st0));
        CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &tq));
        CHECK_OK(mt_model_set_params(tq, tw, nt)); /* quantized from the fp32 teacher's */
        if (f) CHECK_OKC(ctx, mti_param_quantize(tq, 0, f)); /* the token table too */
        CHECK_OK(mt_context_memory_stats(ctx, &st1));
        const uint64_t tbytes = st1.per_class[MT_MEM_PARAM].live_bytes -
                                st0.per_class[MT_MEM_PARAM].live_bytes;
        if (f == MT_BASE_NF4) CHECK(tbytes < nt * 4 / 6); /* about 0.52 bytes a weight */
        CHECK_OK(mt_model_get_params(tq, dq, nt));
        CHECK_OK(mt_model_set_params(tdense, dq, nt));
        float loss[2];
        float *grads[2];
        size_t n = 0;
        for (int k = 0; k < 2; k++) {
            mt_model *m = gpt(ctx, 2, 16, 4);
            n = mt_model_num_params(m);
            grads[k] = check_alloc(n * 4);
            mt_trainer_config tc;
            kd_config(&tc, k ? tdense : tq, 0.7f);
            mt_trainer *t;
            CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
            CHECK_OKC(ctx, mt_trainer_gradients(t, &b, &loss[k], grads[k], n));
            mt_trainer_destroy(t);
            CHECK_OK(mt_model_destroy(m));
        }
        CHECK_MSG(!memcmp(&loss[0], &loss[1], 4) && !memcmp(grads[0], grads[1], n * 4),
                  "%s teacher: loss %.9g, the dense teacher's %.9g (or the gradients differ)",
                  mt_base_format_name((mt_base_format)f), (double)loss[0], (double)loss[1]);
        if (f == MT_BASE_FULL) loss32 = loss[0];
        const float tol = f == MT_BASE_INT8 ? 0.01f : 0.02f;
        if (getenv("MT_TEST_VERBOSE"))
            printf("    %s teacher: PARAM %llu bytes, distilled loss %.6f (fp32 teacher %.6f)\n",
                   mt_base_format_name((mt_base_format)f), (unsigned long long)tbytes,
                   (double)loss[0], (double)loss32);
        CHECK_MSG(fabsf(loss[0] - loss32) <= tol * loss32, "%s teacher: loss %.6f, fp32 %.6f",
                  mt_base_format_name((mt_base_format)f), (double)loss[0], (double)loss32);
        CHECK_OK(mt_model_destroy(tdense));
        CHECK_OK(mt_model_destroy(tq));
    }
    CHECK_OK(mt_model_destroy(te32));
    CHECK_OK(mt_context_destroy(ctx));
    /* the estimate with a quantized teacher (its table quantized after it
       was made) equals the run, on a context of its own */
    for (int f = MT_BASE_INT8; f <= MT_BASE_NF4; f++) {
        ctx = check_cpu_context(2);
        mt_model *m = gpt(ctx, 2, 16, 4), *te;
        mt_gpt_spec g;
        CHECK_OK(mt_model_gpt_get_spec(m, &g));
        g.layers = 3, g.channels = 64, g.seed = 5, g.base = (mt_base_format)f;
        CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &te));
        CHECK_OKC(ctx, mti_param_quantize(te, 0, f));
        mt_trainer_config tc;
        kd_config(&tc, te, 0.7f);
        tc.precision = MT_PREC_BF16;
        mt_estimate_report est;
        CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        check_token_steps(ctx, t, B, T, V, 0, 2);
        check_estimate_matches(ctx, &est, mt_base_format_name((mt_base_format)f));
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(te));
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
}

/* Distillation on the CUDA table (MT_TEST_GPU=1; the engine group of the
 * GPU bundle): the student's gradients of a distilled batch against the
 * CPU's, and two steps each of fp32 and bf16 (with accumulation) near the
 * CPU's losses. */
TEST(gpu_engine_distill_matches_cpu)
{
    mt_context *ctx[2] = {check_gpu_context(), NULL};
    if (!ctx[0]) return;
    ctx[1] = check_cpu_context(2);
    float *g[2], loss[2][4];
    size_t n = 0;
    for (int d = 0; d < 2; d++) {
        mt_model *m = gpt(ctx[d], 2, 16, 4), *te = gpt(ctx[d], 3, 32, 5);
        mt_trainer_config tc;
        kd_config(&tc, te, 0.7f);
        mt_trainer *t;
        CHECK_OKC(ctx[d], mt_trainer_create(m, &tc, &t));
        n = mt_model_num_params(m);
        g[d] = check_alloc(n * 4);
        int32_t tok[B * T], tg[B * T];
        mt_batch b;
        check_token_batch(&b, tok, tg, B, T, V, 0);
        CHECK_OKC(ctx[d], mt_trainer_gradients(t, &b, NULL, g[d], n));
        mt_trainer_destroy(t);
        for (int prec = 0; prec < 2; prec++) {
            kd_config(&tc, te, prec ? 1.0f : 0.5f);
            tc.precision = prec ? MT_PREC_BF16 : MT_PREC_FP32;
            tc.micro_batch = prec ? 2 : 0;
            CHECK_OKC(ctx[d], mt_trainer_create(m, &tc, &t));
            for (int s = 0; s < 2; s++) {
                check_token_batch(&b, tok, tg, B, T, V, s + 1);
                CHECK_OKC(ctx[d], mt_trainer_step(t, &b, &loss[d][2 * prec + s]));
            }
            mt_trainer_destroy(t);
        }
        CHECK_OK(mt_model_destroy(te));
        CHECK_OK(mt_model_destroy(m));
    }
    check_gpu_near_cpu(g[0], g[1], n, loss[0], loss[1]);
    CHECK_OK(mt_context_destroy(ctx[0]));
    CHECK_OK(mt_context_destroy(ctx[1]));
}

/* ---- learning: a small student from a larger teacher ---- */

enum { LB = 8, LT = 32 };

/* Windows of the text in [from, to) as a batch; *rng a fixed LCG. */
static void windows(const unsigned char *text, size_t from, size_t to, uint64_t *rng,
                    int32_t *tok, int32_t *tg, mt_batch *b)
{
    for (int r = 0; r < LB; r++) {
        *rng = *rng * 2862933555777941757ull + 3037000493ull;
        size_t at = from + (size_t)(*rng >> 35) % (to - from - LT - 1);
        for (int j = 0; j < LT; j++) tok[r * LT + j] = text[at + j], tg[r * LT + j] = text[at + j + 1];
    }
    *b = (mt_batch){.n = LB, .tokens = tok, .targets = tg, .seq_len = LT};
}

static mt_model *byte_gpt(mt_context *ctx, int layers, int channels)
{
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 256, g.max_seq = LT, g.layers = layers, g.heads = 4, g.channels = channels, g.seed = 7;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    return m;
}

/* Trains m for `steps` batches of the first 90% of the text (teacher:
 * cfg.teacher), then returns the mean cross-entropy on 8 batches of the
 * last 10%. */
static double train_eval(mt_context *ctx, mt_model *m, mt_model *teacher, float alpha,
                         const unsigned char *text, size_t n, int steps)
{
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = LB, tc.max_seq = LT, tc.optimizer = MT_OPT_ADAMW, tc.lr = 3e-3f;
    tc.grad_clip = 1.0f, tc.teacher = teacher, tc.distill_alpha = alpha, tc.distill_temp = 2.0f;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int32_t tok[LB * LT], tg[LB * LT];
    mt_batch b;
    uint64_t rng = 1;
    size_t split = n / 10 * 9;
    for (int s = 0; s < steps; s++) {
        windows(text, 0, split, &rng, tok, tg, &b);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    }
    double sum = 0;
    rng = 99;
    for (int i = 0; i < 8; i++) {
        float l;
        windows(text, split, n, &rng, tok, tg, &b);
        CHECK_OKC(ctx, mt_trainer_eval(t, &b, &l, NULL));
        sum += l;
    }
    mt_trainer_destroy(t);
    return sum / 8;
}

/* A 2-layer, 64-channel byte GPT trained briefly on the project's text
 * corpus teaches a 1-layer, 32-channel student; the same student trained
 * on the labels alone for as many steps (same batches) is the baseline.
 * Both must learn; which is better is printed with MT_TEST_VERBOSE and
 * recorded in docs/benchmarks.md ("Distillation"). */
TEST(distill_small_student_from_larger_teacher)
{
    FILE *f = fopen("test/data/text_corpus.txt", "rb");
    CHECK_MSG(f, "cannot open test/data/text_corpus.txt");
    unsigned char *text = check_alloc(1 << 20);
    size_t n = fread(text, 1, 1 << 20, f);
    fclose(f);
    CHECK(n > 4096);
    mt_context *ctx = check_cpu_context(2);
    mt_model *teacher = byte_gpt(ctx, 2, 64);
    const int teach_steps = 80, steps = 40;
    const float alpha = 0.5f;
    double tl = train_eval(ctx, teacher, NULL, 0.0f, text, n, teach_steps);
    mt_model *labels = byte_gpt(ctx, 1, 32), *distilled = byte_gpt(ctx, 1, 32);
    double l0 = train_eval(ctx, labels, NULL, 0.0f, text, n, 0);
    double ll = train_eval(ctx, labels, NULL, 0.0f, text, n, steps);
    double ld = train_eval(ctx, distilled, teacher, alpha, text, n, steps);
    if (getenv("MT_TEST_VERBOSE"))
        printf("    held-out loss: teacher %.4f (%d steps); student untrained %.4f, labels %.4f, "
               "distilled %.4f (%d steps)\n",
               tl, teach_steps, l0, ll, ld, steps);
    CHECK_MSG(ll < 0.9 * l0 && ld < 0.9 * l0, "untrained %.4f, labels %.4f, distilled %.4f", l0,
              ll, ld);
    CHECK(isfinite(tl) && tl < l0);
    CHECK_OK(mt_model_destroy(labels));
    CHECK_OK(mt_model_destroy(distilled));
    CHECK_OK(mt_model_destroy(teacher));
    CHECK_OK(mt_context_destroy(ctx));
}
