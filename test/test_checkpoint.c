/*
 * test_checkpoint.c - training checkpoints: resume is bit-identical, bad
 * files are refused with the trainer untouched, and a save killed at any
 * moment leaves the last good file loadable.
 */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "memtrain.h"

enum { B = 2, T = 16, V = 256 };

static mt_context *cpu_ctx(void) { return check_cpu_context(2); }

static mt_model *gpt(mt_context *ctx, uint64_t seed, int channels)
{
    return check_small_gpt(ctx, V, T, channels, seed);
}

typedef struct ck_case {
    mt_optimizer_kind opt;
    mt_precision prec;
    int masters, fused;
    float clip;
} ck_case;

static void config(mt_trainer_config *tc, const ck_case *c)
{
    mt_trainer_config_init(tc);
    tc->max_batch = B;
    tc->optimizer = c->opt;
    tc->lr = c->opt == MT_OPT_SGD ? 0.05f : 2e-3f;
    tc->momentum = c->opt == MT_OPT_SGD ? 0.9f : 0.0f;
    tc->precision = c->prec;
    tc->master_weights = c->masters;
    tc->fused_step = c->fused;
    tc->grad_clip = c->clip;
    tc->min_8bit_size = 256;
    tc->lr_schedule = MT_LR_WARMUP_COSINE;
    tc->warmup_steps = 2, tc->total_steps = 8;
    tc->loss_scale.init_scale = 1 << 20; /* fp16: the first steps overflow and are skipped */
}

static int32_t data[64 * B * T + 1];

static void make_data(void)
{
    uint64_t r = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < sizeof data / sizeof *data; i++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        data[i] = (int32_t)(r % V);
    }
}

static void steps(mt_context *ctx, mt_trainer *t, int from, int n, float *loss)
{
    for (int i = from; i < from + n; i++) {
        mt_batch b = {.n = B, .tokens = data + (size_t)i * B * T,
                      .targets = data + (size_t)i * B * T + 1, .seq_len = T};
        CHECK_OKC(ctx, mt_trainer_step(t, &b, &loss[i]));
    }
}

static void tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "/tmp/mt_test_%ld_%s", (long)getpid(), name);
}

/* N steps, save, a new context, model (other initial weights) and trainer,
   load, M steps: the same losses and weights as N + M steps straight, in
   every optimizer and precision mode. */
TEST(checkpoint_resume_is_bit_identical)
{
    make_data();
    static const ck_case cases[] = {{MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 1.0f},
                                    {MT_OPT_ADAMW8, MT_PREC_BF16, 0, 1, 0.0f},
                                    {MT_OPT_SGD, MT_PREC_FP16, 1, 0, 0.5f},
                                    {MT_OPT_ADAFACTOR, MT_PREC_BF16, 1, 0, 0.0f},
                                    {MT_OPT_ADAMW8, MT_PREC_FP32, 1, 1, 1.0f},
                                    {MT_OPT_ADAMW4, MT_PREC_BF16, 1, 0, 1.0f},
                                    {MT_OPT_ADAMW4, MT_PREC_FP32, 1, 1, 0.0f}};
    char path[256];
    tmp_path(path, sizeof path, "resume.ckpt");
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int N = 4, M = 4;
        mt_trainer_config tc;
        config(&tc, &cases[c]);
        float straight[8], resumed[8];
        /* straight */
        mt_context *ctx = cpu_ctx();
        mt_model *m = gpt(ctx, 1, 32);
        size_t np = mt_model_num_params(m);
        float *p0 = malloc(np * 4), *p1 = malloc(np * 4);
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        steps(ctx, t, 0, N + M, straight);
        mt_loss_scale_state ls0, ls1;
        CHECK_OK(mt_trainer_get_loss_scale(t, &ls0));
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_get_params(m, p0, np));
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
        /* N steps, save with the data position */
        ctx = cpu_ctx();
        m = gpt(ctx, 1, 32);
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        steps(ctx, t, 0, N, resumed);
        int pos = N;
        CHECK_OKC(ctx, mt_trainer_save(t, path, &pos, sizeof pos));
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
        /* elsewhere: other weights, then the file */
        ctx = cpu_ctx();
        m = gpt(ctx, 99, 32);
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        int got = -1;
        size_t len = 0;
        CHECK_OKC(ctx, mt_trainer_load(t, path, &got, sizeof got, &len));
        CHECK(got == N && len == sizeof got);
        CHECK_EQ(mt_trainer_steps(t), (uint64_t)N);
        steps(ctx, t, got, M, resumed);
        CHECK_OK(mt_trainer_get_loss_scale(t, &ls1));
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_get_params(m, p1, np));
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
        CHECK_MSG(memcmp(straight, resumed, sizeof straight) == 0,
                  "case %zu: losses differ after resume (%.9g vs %.9g at the last step)", c,
                  (double)straight[7], (double)resumed[7]);
        CHECK_MSG(memcmp(p0, p1, np * 4) == 0, "case %zu: weights differ after resume", c);
        CHECK_MSG(ls0.scale == ls1.scale && ls0.growth_tracker == ls1.growth_tracker &&
                      ls0.steps_skipped == ls1.steps_skipped &&
                      ls0.last_step_skipped == ls1.last_step_skipped, "case %zu: scale %g/%g tracker %d/%d "
                  "skipped %llu/%llu last %d/%d", c, (double)ls0.scale, (double)ls1.scale,
                  ls0.growth_tracker, ls1.growth_tracker, (unsigned long long)ls0.steps_skipped,
                  (unsigned long long)ls1.steps_skipped, ls0.last_step_skipped,
                  ls1.last_step_skipped);
        if (cases[c].prec == MT_PREC_FP16) CHECK(ls0.steps_skipped > 0);
        free(p0), free(p1);
    }
    remove(path);
}

static unsigned char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    CHECK(f);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    rewind(f);
    unsigned char *p = malloc(*n);
    CHECK(fread(p, 1, *n, f) == *n);
    fclose(f);
    return p;
}

static void spill(const char *path, const unsigned char *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(p, 1, n, f) == n);
    fclose(f);
}

static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Truncated, corrupt, other-version, other-model and other-config files
   are refused; the trainer's whole state is then the same bytes as before
   (saved again and compared). */
TEST(checkpoint_refuses_bad_files)
{
    make_data();
    mt_context *ctx = cpu_ctx();
    mt_model *m = gpt(ctx, 1, 32);
    ck_case c = {MT_OPT_ADAMW8, MT_PREC_BF16, 1, 0, 0.0f};
    mt_trainer_config tc;
    config(&tc, &c);
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    float loss[8];
    steps(ctx, t, 0, 3, loss);
    char good[256], bad[256], again[256];
    tmp_path(good, sizeof good, "good.ckpt");
    tmp_path(bad, sizeof bad, "bad.ckpt");
    tmp_path(again, sizeof again, "again.ckpt");
    const char user[] = "data position 3";
    CHECK_OKC(ctx, mt_trainer_save(t, good, user, sizeof user));
    size_t n;
    unsigned char *img = slurp(good, &n);
    /* where the sections start: walk the headers */
    size_t starts[512], ns = 0;
    for (size_t at = 32; at + 32 <= n && ns < 512; ) {
        starts[ns++] = at;
        size_t len = (size_t)rd32(img + at + 8) | (size_t)rd32(img + at + 12) << 32;
        at += 32 + len;
    }
    CHECK_MSG(ns == rd32(img + 12), "%zu sections walked, %u in the header", ns, rd32(img + 12));

    int refused = 0;
    /* truncated anywhere */
    const size_t cuts[] = {0, 7, 31, 32, 40, starts[1] + 5, starts[2] + 40, n / 2, n - 33, n - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
        spill(bad, img, cuts[i]);
        CHECK_ST(MT_ERR_FORMAT, mt_trainer_load(t, bad, NULL, 0, NULL));
        CHECK(strstr(mt_last_error(ctx), "unchanged"));
        refused++;
    }
    /* one byte flipped in each section's payload or header */
    for (size_t i = 0; i < ns; i++) {
        unsigned char *cp = malloc(n);
        memcpy(cp, img, n);
        size_t len = (size_t)rd32(img + starts[i] + 8);
        for (int where = 0; where < 2; where++) { /* in the payload; in the header */
            size_t at = where == 0 && len ? starts[i] + 32 + len / 2 : starts[i] + (i * 7) % 32;
            memcpy(cp, img, n);
            cp[at] ^= 0x10;
            spill(bad, cp, n);
            mt_status s = mt_trainer_load(t, bad, NULL, 0, NULL);
            CHECK_MSG(s == MT_ERR_FORMAT || s == MT_ERR_INVALID_ARG,
                      "section %zu: a flipped byte at %zu was taken (%d)", i, at, (int)s);
            refused++;
        }
        free(cp);
    }
    /* another magic, another version (with a valid header CRC) */
    {
        unsigned char *cp = malloc(n);
        memcpy(cp, img, n);
        cp[0] = 'X';
        spill(bad, cp, n);
        CHECK_ST(MT_ERR_FORMAT, mt_trainer_load(t, bad, NULL, 0, NULL));
        CHECK(strstr(mt_last_error(ctx), "not a memtrain"));
        memcpy(cp, img, n);
        cp[8] = 2; /* version 2 */
        extern uint32_t mti_crc32(uint32_t crc, const void *data, size_t n);
        uint32_t crc = mti_crc32(0, cp, 24);
        for (int k = 0; k < 4; k++) cp[24 + k] = (unsigned char)(crc >> (8 * k));
        spill(bad, cp, n);
        CHECK_ST(MT_ERR_FORMAT, mt_trainer_load(t, bad, NULL, 0, NULL));
        CHECK(strstr(mt_last_error(ctx), "version 2"));
        free(cp);
        refused += 2;
    }
    /* bytes the format says are 0, with valid CRCs: the header's last four,
       and a non-tensor section's index and dtype */
    {
        extern uint32_t mti_crc32(uint32_t crc, const void *data, size_t n);
        unsigned char *cp = malloc(n);
        const size_t at[3] = {28, starts[ns - 2] + 4, starts[ns - 1] + 20};
        for (int i = 0; i < 3; i++) {
            memcpy(cp, img, n);
            cp[at[i]] = 1;
            if (i) {
                size_t h = starts[i == 1 ? ns - 2 : ns - 1];
                uint32_t crc = mti_crc32(0, cp + h, 24);
                for (int k = 0; k < 4; k++) cp[h + 24 + k] = (unsigned char)(crc >> (8 * k));
            }
            spill(bad, cp, n);
            CHECK_ST(MT_ERR_FORMAT, mt_trainer_load(t, bad, NULL, 0, NULL));
            CHECK_MSG(strstr(mt_last_error(ctx), i ? "nonzero index or dtype" : "28..31"), "%s",
                      mt_last_error(ctx));
            refused++;
        }
        free(cp);
    }
    /* saved by another model, and by another optimizer */
    {
        mt_context *c2 = cpu_ctx();
        mt_model *m2 = gpt(c2, 1, 64);
        mt_trainer *t2;
        CHECK_OKC(c2, mt_trainer_create(m2, &tc, &t2));
        CHECK_OKC(c2, mt_trainer_save(t2, bad, NULL, 0));
        CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_load(t, bad, NULL, 0, NULL));
        CHECK(strstr(mt_last_error(ctx), "another model"));
        CHECK_MSG(strstr(mt_last_error(ctx), "'wte' (256 x 64) in the file, 'wte' (256 x 32) in "
                                             "this model"),
                  "%s", mt_last_error(ctx));
        mt_trainer_destroy(t2);
        CHECK_OK(mt_model_destroy(m2));
        /* another depth: named as the GPT's blocks (--layers), not its
           internal layers (the embedding, the blocks, lnf and the head) */
        mt_gpt_spec g3;
        mt_gpt_spec_init(&g3);
        g3.vocab = V, g3.max_seq = T, g3.layers = 3, g3.heads = 4, g3.channels = 32, g3.seed = 1;
        CHECK_OKC(c2, mt_model_gpt_create(c2, &g3, &m2));
        CHECK_OKC(c2, mt_trainer_create(m2, &tc, &t2));
        CHECK_OKC(c2, mt_trainer_save(t2, bad, NULL, 0));
        CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_load(t, bad, NULL, 0, NULL));
        CHECK_MSG(strstr(mt_last_error(ctx), "transformer blocks (layers) is 3 in the file, 2 in "
                                             "this model"),
                  "%s", mt_last_error(ctx));
        mt_trainer_destroy(t2);
        CHECK_OK(mt_model_destroy(m2));
        m2 = gpt(c2, 1, 64);
        mt_trainer_config other = tc;
        other.optimizer = MT_OPT_ADAMW;
        CHECK_OKC(c2, mt_trainer_create(m2, &other, &t2));
        mt_trainer_destroy(t2);
        CHECK_OK(mt_model_destroy(m2));
        m2 = gpt(c2, 1, 32);
        /* each setting that differs is named, with both values */
        mt_trainer_config others[6] = {tc, tc, tc, tc, tc, tc};
        others[0].optimizer = MT_OPT_ADAMW;
        others[1].precision = MT_PREC_FP32;
        others[2].master_weights = 0;
        others[3].min_8bit_size = 4096; /* small tensors keep 32-bit state */
        others[4].optimizer = MT_OPT_ADAMW4; /* every optimizer by its name */
        others[5].optimizer = MT_OPT_ADAFACTOR;
        const char *says[6] = {"AdamW in the file, 8-bit AdamW in this trainer",
                               "fp32 in the file, bf16 in this trainer",
                               "no master weights in the file, master weights in this trainer",
                               ("parameter 1's state 0, fp32, 2048 bytes in the file; parameter "
                                "1's state 0, uint8, 512 bytes in this trainer"),
                               "4-bit AdamW in the file, 8-bit AdamW in this trainer",
                               "Adafactor in the file, 8-bit AdamW in this trainer"};
        for (int i = 0; i < 6; i++) {
            CHECK_OKC(c2, mt_trainer_create(m2, &others[i], &t2));
            CHECK_OKC(c2, mt_trainer_save(t2, bad, NULL, 0));
            CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_load(t, bad, NULL, 0, NULL));
            CHECK_MSG(strstr(mt_last_error(ctx), says[i]), "%d: %s", i, mt_last_error(ctx));
            mt_trainer_destroy(t2);
        }
        CHECK_OK(mt_model_destroy(m2));
        CHECK_OK(mt_context_destroy(c2));
        refused += 2;
    }
    CHECK_ST(MT_ERR_IO, mt_trainer_load(t, "/nonexistent/dir/x.ckpt", NULL, 0, NULL));
    /* nothing moved: the state saves to the same bytes */
    CHECK_OKC(ctx, mt_trainer_save(t, again, user, sizeof user));
    size_t n2;
    unsigned char *img2 = slurp(again, &n2);
    CHECK_MSG(n2 == n && memcmp(img, img2, n) == 0, "the trainer changed after %d refused loads",
              refused);
    /* and the good file still loads, the user bytes cut to the room given */
    char room[4];
    size_t len = 0;
    CHECK_OKC(ctx, mt_trainer_load(t, good, room, sizeof room, &len));
    CHECK(len == sizeof user && memcmp(room, user, sizeof room) == 0);
    free(img), free(img2);
    remove(good), remove(bad), remove(again);
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* A training process saving after every step is killed at random moments;
   the file it leaves always loads, at a step it had reached. */
TEST(checkpoint_survives_kill_during_save)
{
    make_data();
    char path[256];
    tmp_path(path, sizeof path, "kill.ckpt");
    ck_case c = {MT_OPT_ADAMW, MT_PREC_FP32, 1, 0, 0.0f};
    mt_trainer_config tc;
    config(&tc, &c);
    uint64_t r = (uint64_t)time(NULL) | 1;
    const int rounds = check_light() ? 4 : 12;
    for (int round = 0; round < rounds; round++) {
        remove(path);
        fflush(stdout);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) { /* train and save forever, on one thread (OpenMP's pool does not
                           survive fork) */
            mt_context *ctx = check_cpu_context(1);
            mt_model *m = gpt(ctx, 1, 64);
            mt_trainer *t;
            if (mt_trainer_create(m, &tc, &t)) _exit(2);
            float loss[64];
            for (int i = 0;; i = (i + 1) % 60) {
                mt_batch b = {.n = B, .tokens = data + (size_t)i * B * T,
                              .targets = data + (size_t)i * B * T + 1, .seq_len = T};
                if (mt_trainer_step(t, &b, &loss[i])) _exit(3);
                int at = i + 1;
                if (mt_trainer_save(t, path, &at, sizeof at)) _exit(4);
            }
        }
        /* wait for a first file, then kill at a random moment */
        for (int w = 0; w < 2000 && access(path, F_OK) != 0; w++) usleep(1000);
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        usleep((useconds_t)(r % 20000));
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        CHECK_MSG(WIFSIGNALED(status), "the child ended by itself (status %d)", status);
        mt_context *ctx = cpu_ctx();
        mt_model *m = gpt(ctx, 7, 64);
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        int at = 0;
        CHECK_OKC(ctx, mt_trainer_load(t, path, &at, sizeof at, NULL));
        CHECK(at >= 1 && at <= 60 && mt_trainer_steps(t) >= 1);
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
    remove(path);
}

/* mt_trainer_logits: with one token per row, the cross-entropy computed
   from the logits is the loss mt_trainer_eval gives, in fp32 and bf16; no
   targets needed; bad sizes refused. */
TEST(trainer_logits_match_eval)
{
    make_data();
    for (int p = 0; p < 2; p++) {
        mt_context *ctx = cpu_ctx();
        mt_model *m = gpt(ctx, 3, 32);
        ck_case c = {MT_OPT_ADAMW, p ? MT_PREC_BF16 : MT_PREC_FP32, 1, 0, 0.0f};
        mt_trainer_config tc;
        config(&tc, &c);
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        float loss[4];
        steps(ctx, t, 0, 2, loss);
        mt_batch b = {.n = B, .tokens = data + 5, .targets = data + 6, .seq_len = 1};
        float want, *lg = malloc((size_t)B * V * sizeof *lg);
        CHECK_OKC(ctx, mt_trainer_eval(t, &b, &want, NULL));
        mt_batch nb = b;
        nb.targets = NULL;
        CHECK_OKC(ctx, mt_trainer_logits(t, &nb, lg, (size_t)B * V));
        double ce = 0;
        for (int r = 0; r < B; r++) {
            const float *row = lg + (size_t)r * V;
            double mx = row[0], sum = 0;
            for (int j = 1; j < V; j++) mx = row[j] > mx ? row[j] : mx;
            for (int j = 0; j < V; j++) sum += exp(row[j] - mx);
            ce += mx + log(sum) - row[b.targets[r]];
        }
        ce /= B;
        CHECK_MSG(fabs(ce - want) < 1e-4, "precision %d: %.6f from the logits, %.6f from eval", p,
                  ce, (double)want);
        CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_logits(t, &nb, lg, (size_t)B * V - 1));
        free(lg);
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
}
