/*
 * test_isa.c - the CPU class the kernels use (kernels/cpu/arch.h, MT_CPU_ISA)
 * and the promise that our own loops give the same bits at every level:
 * every cast pattern, and whole training runs of every optimizer and
 * precision (layernorm, GELU, attention, cross-entropy, the updates, the
 * casts), at each level this CPU has, against the baseline level. oneDNN's
 * GEMMs keep the process's cap meanwhile, so any difference is ours.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/cpu/arch.h"
#include "../kernels/cpu/cpu_ops.h"
#include "check.h"
#include "internal.h"

/* The levels of our own loops this process can run: baseline, avx2, avx512. */
static int top_level(void)
{
    mti_isa u = mti_isa_used();
    return u >= MTI_ISA_AVX512 ? 2 : u >= MTI_ISA_AVX2 ? 1 : 0;
}

static const mti_isa level_isa[3] = {MTI_ISA_BASELINE, MTI_ISA_AVX2, MTI_ISA_AVX512};

TEST(isa_name_and_cap)
{
    const char *name = mt_cpu_isa();
    CHECK(name != NULL);
    const mti_isa used = mti_isa_used(), det = mti_isa_detected();
    CHECK_MSG(!strcmp(name, mti_isa_name(used)), "mt_cpu_isa %s, used %s", name,
              mti_isa_name(used));
    CHECK(used <= det);
    CHECK(mti_isa_name(MTI_ISA_COUNT) == NULL);
    const char *cap = getenv("MT_CPU_ISA");
    char msg[320];
    CHECK_EQ(mti_isa_check(msg, sizeof msg), 0); /* the suite runs under a valid value or none */
    if (cap && *cap) {
        int c = -1;
        for (int i = 0; i < MTI_ISA_COUNT; i++)
            if (!strcmp(cap, mti_isa_name((mti_isa)i))) c = i;
        CHECK(c >= 0);
        CHECK_MSG(used == ((mti_isa)c < det ? (mti_isa)c : det), "cap %s, CPU %s, used %s", cap,
                  mti_isa_name(det), name);
    } else {
        CHECK(used == det);
    }
    /* forcing a level moves our loops and is undone */
    mti_isa was = mti_isa_force(MTI_ISA_BASELINE);
    CHECK_EQ(mti_vec_level(), 0);
    CHECK(mti_isa_force(was) == MTI_ISA_BASELINE);
    CHECK(mti_isa_used() == used);
    /* never above the CPU or the cap */
    mti_isa_force(MTI_ISA_AMX);
    CHECK(mti_isa_used() == used);
}

/* Every fp16 and bf16 pattern widened, and fp32 values (random, every
 * exponent, the specials, ties) narrowed to nearest even and stochastically,
 * at each level: the baseline's bits. */
TEST(isa_levels_same_bits_casts)
{
    mt_context *ctx = check_cpu_context(2);
    const mti_kctx k = {ctx, ctx->dev};
    const mti_ops *ops = mti_cpu_ops();
    const size_t nh = 65536, nf = 1 << 18;
    uint16_t *h = check_alloc(nh * 2);
    for (size_t i = 0; i < nh; i++) h[i] = (uint16_t)i;
    float *f = check_alloc(nf * 4);
    uint32_t seed = 12345u;
    for (size_t i = 0; i < nf; i++) {
        seed = seed * 1664525u + 1013904223u;
        uint32_t u = seed;
        if (i % 4 == 1) u = (u & 0x807FFFFFu) | ((uint32_t)(i / 4 % 256) << 23); /* every exponent */
        if (i % 4 == 2) u &= 0xFFFF8000u | 0x8000u; /* ties and near ties */
        memcpy(&f[i], &u, 4);
    }
    const float special[] = {0.0f, -0.0f, 1.0f / 0.0f, -1.0f / 0.0f, 65504.0f, 65520.0f, 6e-8f};
    memcpy(f, special, sizeof special);
    const mti_dtype dts[2] = {MTI_F16, MTI_BF16};
    const int top = top_level();
    const mti_isa was = mti_isa_used();
    float *wide[2][3];
    uint16_t *narrow[2][3], *sr[3];
    for (int l = 0; l <= top; l++) {
        mti_isa_force(level_isa[l]);
        for (int d = 0; d < 2; d++) {
            wide[d][l] = check_alloc(nh * 4);
            narrow[d][l] = check_alloc(nf * 2);
            CHECK_OK(ops->cast(&k, wide[d][l], MTI_F32, h, dts[d], nh, MTI_ROUND_NEAREST, 0));
            CHECK_OK(ops->cast(&k, narrow[d][l], dts[d], f, MTI_F32, nf, MTI_ROUND_NEAREST, 0));
        }
        sr[l] = check_alloc(nf * 2);
        CHECK_OK(ops->cast(&k, sr[l], MTI_BF16, f, MTI_F32, nf, MTI_ROUND_STOCHASTIC, 99));
    }
    mti_isa_force(was);
    for (int l = 1; l <= top; l++) {
        for (int d = 0; d < 2; d++) {
            CHECK_MSG(!memcmp(wide[d][l], wide[d][0], nh * 4), "%s widened at %s",
                      d ? "bf16" : "fp16", mti_isa_name(level_isa[l]));
            CHECK_MSG(!memcmp(narrow[d][l], narrow[d][0], nf * 2), "%s narrowed at %s",
                      d ? "bf16" : "fp16", mti_isa_name(level_isa[l]));
        }
        CHECK_MSG(!memcmp(sr[l], sr[0], nf * 2), "stochastic bf16 at %s",
                  mti_isa_name(level_isa[l]));
    }
    CHECK_OK(mt_context_destroy(ctx));
}

/* A run of one configuration: 3 steps of a small GPT; the losses and the
 * final weights. */
typedef struct isa_run {
    const char *name;
    mt_optimizer_kind opt;
    mt_precision prec;
    int masters, fused;
    mt_recompute_policy rc;
} isa_run;

static void run_case(const isa_run *r, float loss[3], float *w, size_t n)
{
    mt_context *ctx = check_cpu_context(2);
    mt_gpt_spec sp;
    mt_gpt_spec_init(&sp);
    /* channels 64 and a vocabulary of 300: tensors past the 8-bit and
       4-bit states' 4096-element floor, and a head wider than a block */
    sp.vocab = 300, sp.max_seq = 16, sp.layers = 2, sp.heads = 4, sp.channels = 64;
    sp.seed = 5;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &sp, &m));
    CHECK(mt_model_num_params(m) == n);
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 2;
    tc.max_seq = 16;
    tc.optimizer = r->opt;
    tc.lr = r->opt == MT_OPT_SGD ? 0.05f : 2e-3f;
    tc.momentum = 0.9f;
    tc.weight_decay = 0.01f;
    tc.grad_clip = 1.0f;
    tc.precision = r->prec;
    tc.master_weights = r->masters;
    tc.fused_step = r->fused;
    if (r->fused) tc.grad_clip = 0.0f;
    tc.recompute = r->rc;
    tc.min_8bit_size = 1024;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int32_t tok[2 * 16], tgt[2 * 16];
    for (int s = 0; s < 3; s++) {
        for (int i = 0; i < 32; i++) tok[i] = (i * 37 + s * 11) % 300, tgt[i] = (i * 53 + s) % 300;
        mt_batch b = {.n = 2, .tokens = tok, .targets = tgt, .seq_len = 16};
        CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss[s]));
    }
    mt_trainer_destroy(t);
    CHECK_OKC(ctx, mt_model_get_params(m, w, n));
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

TEST(isa_levels_same_bits_training)
{
    static const isa_run runs[] = {
        {"fp32 AdamW", MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, MT_RECOMPUTE_NONE},
        {"bf16 8-bit AdamW", MT_OPT_ADAMW8, MT_PREC_BF16, 1, 0, MT_RECOMPUTE_SELECTIVE},
        {"bf16 without masters, 8-bit AdamW, fused, sqrt", MT_OPT_ADAMW8, MT_PREC_BF16, 0, 1,
         MT_RECOMPUTE_SQRT},
        {"fp16 Adafactor", MT_OPT_ADAFACTOR, MT_PREC_FP16, 1, 0, MT_RECOMPUTE_NONE},
        {"bf16 4-bit AdamW", MT_OPT_ADAMW4, MT_PREC_BF16, 1, 0, MT_RECOMPUTE_NONE},
        {"fp32 SGD momentum", MT_OPT_SGD, MT_PREC_FP32, 1, 0, MT_RECOMPUTE_NONE},
    };
    /* the parameter count of run_case's model */
    mt_context *ctx = check_cpu_context(1);
    mt_gpt_spec sp;
    mt_gpt_spec_init(&sp);
    sp.vocab = 300, sp.max_seq = 16, sp.layers = 2, sp.heads = 4, sp.channels = 64;
    mt_model *m;
    CHECK_OK(mt_model_gpt_create(ctx, &sp, &m));
    const size_t np = mt_model_num_params(m);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
    const int top = top_level();
    const mti_isa was = mti_isa_used();
    for (size_t r = 0; r < sizeof runs / sizeof *runs; r++) {
        float loss[3][3];
        float *w[3];
        for (int l = 0; l <= top; l++) {
            mti_isa_force(level_isa[l]);
            w[l] = check_alloc(np * 4);
            run_case(&runs[r], loss[l], w[l], np);
        }
        mti_isa_force(was);
        for (int l = 1; l <= top; l++) {
            CHECK_MSG(!memcmp(loss[l], loss[0], sizeof loss[0]),
                      "%s at %s: losses %.9g %.9g %.9g, baseline %.9g %.9g %.9g", runs[r].name,
                      mti_isa_name(level_isa[l]), (double)loss[l][0], (double)loss[l][1],
                      (double)loss[l][2], (double)loss[0][0], (double)loss[0][1],
                      (double)loss[0][2]);
            size_t diff = 0;
            for (size_t i = 0; i < np; i++) diff += memcmp(&w[l][i], &w[0][i], 4) != 0;
            CHECK_MSG(diff == 0, "%s at %s: %zu of %zu weights differ from the baseline's",
                      runs[r].name, mti_isa_name(level_isa[l]), diff, np);
        }
    }
}
