/*
 * textfit.c - byte-level text as training batches (textfit.h).
 */
#include <stdio.h>

#include "check.h"
#include "textfit.h"

unsigned char *tf_slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    CHECK_MSG(f, "cannot open %s", path);
    unsigned char *p = check_alloc(1 << 20);
    *n = fread(p, 1, 1 << 20, f);
    fclose(f);
    return p;
}

void tf_batch(const unsigned char *text, size_t span, uint64_t *rng, int32_t *tok, int32_t *tg,
              mt_batch *b)
{
    for (int r = 0; r < TF_B; r++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t at = (size_t)(*rng >> 33) % (span - TF_T - 1);
        for (int j = 0; j < TF_T; j++)
            tok[r * TF_T + j] = text[at + j], tg[r * TF_T + j] = text[at + j + 1];
    }
    *b = (mt_batch){.n = TF_B, .tokens = tok, .targets = tg, .seq_len = TF_T};
}

float tf_mean_loss(mt_context *ctx, mt_trainer *t, const unsigned char *text, size_t n)
{
    uint64_t rng = 77;
    double sum = 0;
    for (int i = 0; i < 4; i++) {
        int32_t tok[TF_B * TF_T], tg[TF_B * TF_T];
        mt_batch b;
        tf_batch(text, n, &rng, tok, tg, &b);
        float l;
        CHECK_OKC(ctx, mt_trainer_eval(t, &b, &l, NULL));
        sum += l;
    }
    return (float)(sum / 4);
}

void tf_train(mt_context *ctx, mt_trainer *t, const unsigned char *text, size_t n, uint64_t *rng,
              int steps)
{
    for (int s = 0; s < steps; s++) {
        int32_t tok[TF_B * TF_T], tg[TF_B * TF_T];
        mt_batch b;
        tf_batch(text, n, rng, tok, tg, &b);
        CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    }
}

mt_model *tf_pretrained(mt_context *ctx, mt_trainer_config *tc, uint64_t *rng, float *docs_loss)
{
    size_t nd;
    const unsigned char *docs = tf_slurp("test/data/text_corpus.txt", &nd);
    mt_gpt_spec g;
    mt_gpt_spec_init(&g);
    g.vocab = 256, g.max_seq = TF_T, g.layers = 2, g.heads = 4, g.channels = 64, g.seed = 1;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_gpt_create(ctx, &g, &m));
    mt_trainer_config_init(tc);
    tc->max_batch = TF_B, tc->max_seq = TF_T, tc->optimizer = MT_OPT_ADAMW, tc->lr = 3e-3f;
    tc->grad_clip = 1.0f;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, tc, &t));
    tf_train(ctx, t, docs, nd, rng, 40);
    if (docs_loss) *docs_loss = tf_mean_loss(ctx, t, docs, nd);
    mt_trainer_destroy(t);
    return m;
}
