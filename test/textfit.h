/*
 * textfit.h - byte-level text as training batches, for the tests that
 * pretrain a small GPT on one text and fine-tune it on another
 * (test_lora.c, test_qbase.c): TF_B rows of TF_T tokens from windows drawn
 * by a fixed LCG.
 */
#ifndef MT_TEST_TEXTFIT_H
#define MT_TEST_TEXTFIT_H

#include <stddef.h>
#include <stdint.h>

#include "memtrain.h"

enum { TF_B = 8, TF_T = 32 };

/* The first MiB of a file (check_alloc'd; the test fails if it cannot be
 * opened); *n its bytes. */
unsigned char *tf_slurp(const char *path, size_t *n);
/* One batch of windows of the first `span` bytes of text, positions drawn
 * from *rng; tok and tg hold TF_B * TF_T each. */
void tf_batch(const unsigned char *text, size_t span, uint64_t *rng, int32_t *tok, int32_t *tg,
              mt_batch *b);
/* The mean eval loss over 4 fixed batches of the text. */
float tf_mean_loss(mt_context *ctx, mt_trainer *t, const unsigned char *text, size_t n);
/* `steps` training steps on batches of the text. */
void tf_train(mt_context *ctx, mt_trainer *t, const unsigned char *text, size_t n, uint64_t *rng,
              int steps);

/* A byte-level GPT (vocab 256, 2 blocks of width 64, 4 heads, TF_T
 * tokens) pretrained 40 steps on test/data/text_corpus.txt with fp32
 * AdamW (lr 3e-3, clip 1), whose config tc becomes (batch TF_B); with
 * docs_loss, its mean loss on that text after. *rng: the data's draws. */
mt_model *tf_pretrained(mt_context *ctx, mt_trainer_config *tc, uint64_t *rng, float *docs_loss);

#endif
