/*
 * test_sparse.c - pruning masks and pruned storage (lib/sparse/sparse.h):
 * the masks against torch.nn.utils.prune, the Wanda paper's code and
 * ASP's N:M (test/golden/sparse.gv, written by test/golden/gen_sparse.py),
 * the storage formats' round trips, and the schedules against their
 * formulas.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "golden.h"
#include "internal.h"
#include "ops/kernels.h"
#include "sparse/sparse.h"

static gv_file sfile;

static void load_sparse(void)
{
    static int have;
    if (have) return;
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/sparse.gv", gv_dir());
    CHECK_MSG(gv_load(path, &sfile, err, sizeof err), "%s", err);
    have = 1;
}

static const gv_array *arr(const char *name, gv_dtype dt)
{
    const gv_array *a = gv_find(&sfile, name);
    CHECK_MSG(a != NULL, "golden array '%s' missing", name);
    CHECK_MSG(a->dtype == dt, "golden array '%s' is %s", name, gv_dtype_name(a->dtype));
    return a;
}

static float *abs_of(const gv_array *w)
{
    float *s = malloc(w->numel * sizeof *s);
    CHECK(s != NULL);
    for (size_t i = 0; i < w->numel; i++) s[i] = fabsf(((const float *)w->data)[i]);
    return s;
}

static uint64_t *all_kept(size_t n)
{
    uint64_t *k = malloc(mti_sp_words(n) * 8);
    CHECK(k != NULL);
    memset(k, 0xff, mti_sp_words(n) * 8);
    return k;
}

/* keep (n bits) equals the golden uint8 mask `name`. */
static void same_mask(const char *name, const uint64_t *keep, size_t n)
{
    const gv_array *g = arr(name, GV_U8);
    CHECK_EQ(g->numel, n);
    const uint8_t *m = g->data;
    for (size_t e = 0; e < n; e++)
        CHECK_MSG((int)(keep[e / 64] >> (e % 64) & 1) == m[e], "%s: element %zu is %s in torch's",
                  name, e, m[e] ? "kept" : "pruned");
}

TEST(sparse_magnitude_l1_unstructured_golden)
{
    load_sparse();
    static const struct {
        const char *w;
        double a;
        const char *mask;
    } cases[] = {{"l1_a.w", 0.5, "l1_a.mask_0.5"},   {"l1_a.w", 0.9, "l1_a.mask_0.9"},
                 {"l1_a.w", 0.3, "l1_a.mask_0.3"},   {"l1_a.w", 0.75, "l1_a.mask_0.75"},
                 {"l1_b.w", 0.25, "l1_b.mask_0.25"}, {"l1_b.w", 0.35, "l1_b.mask_0.35"},
                 {"l1_b.w", 0.05, "l1_b.mask_0.05"}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const gv_array *w = arr(cases[c].w, GV_F32);
        float *score = abs_of(w);
        uint64_t *keep = all_kept(w->numel);
        mti_sp_seg seg = {score, w->numel, keep};
        CHECK_OK(mti_sp_prune_smallest(NULL, &seg, 1, mti_sp_count(cases[c].a, w->numel)));
        same_mask(cases[c].mask, keep, w->numel);
        free(score);
        free(keep);
    }
    /* round(amount n) is half to even: 0.25 of 10 prunes 2, 0.35 of 10 prunes 4 */
    CHECK_EQ(mti_sp_count(0.25, 10), 2);
    CHECK_EQ(mti_sp_count(0.35, 10), 4);
}

TEST(sparse_magnitude_global_unstructured_golden)
{
    load_sparse();
    const double amounts[] = {0.6, 0.25};
    for (int a = 0; a < 2; a++) {
        mti_sp_seg seg[3];
        size_t total = 0;
        for (int i = 0; i < 3; i++) {
            char name[64];
            snprintf(name, sizeof name, "glob.w%d", i);
            const gv_array *w = arr(name, GV_F32);
            seg[i] = (mti_sp_seg){abs_of(w), w->numel, all_kept(w->numel)};
            total += w->numel;
        }
        CHECK_OK(mti_sp_prune_smallest(NULL, seg, 3, mti_sp_count(amounts[a], total)));
        for (int i = 0; i < 3; i++) {
            char name[64];
            snprintf(name, sizeof name, "glob.mask_%g_%d", amounts[a], i);
            same_mask(name, seg[i].keep, seg[i].n);
            free((void *)seg[i].score);
            free(seg[i].keep);
        }
    }
}

/* Wanda's scores from the weights and the calibration batches: |w|
 * sqrt(sum over the batches' tokens of x^2) (the paper divides by the
 * batches, which no row's order depends on). */
static float *wanda_scores(const gv_array *w)
{
    const int64_t rows = w->dims[0], cols = w->dims[1];
    double *sq = calloc((size_t)cols, sizeof *sq);
    CHECK(sq != NULL);
    for (int b = 0; b < 3; b++) {
        char name[32];
        snprintf(name, sizeof name, "wanda.x%d", b);
        const gv_array *x = arr(name, GV_F32);
        CHECK_EQ(x->dims[1], cols);
        const float *xv = x->data;
        for (int64_t t = 0; t < x->dims[0]; t++)
            for (int64_t j = 0; j < cols; j++) sq[j] += (double)xv[t * cols + j] * xv[t * cols + j];
    }
    float *s = malloc(w->numel * sizeof *s);
    CHECK(s != NULL);
    const float *wv = w->data, *ref = arr("wanda.score", GV_F32)->data;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) {
            s[r * cols + j] = fabsf(wv[r * cols + j]) * sqrtf((float)sq[j]);
            /* the reference's scale differs by sqrt(3): the same order */
            const double rel = fabs(s[r * cols + j] / sqrt(3.0) - ref[r * cols + j]) / ref[r * cols + j];
            CHECK_MSG(rel < 1e-5, "wanda score (%lld, %lld): %g vs %g", (long long)r, (long long)j,
                      s[r * cols + j] / sqrt(3.0), (double)ref[r * cols + j]);
        }
    free(sq);
    return s;
}

TEST(sparse_wanda_golden)
{
    load_sparse();
    const gv_array *w = arr("wanda.w", GV_F32);
    const int64_t rows = w->dims[0], cols = w->dims[1];
    float *score = wanda_scores(w);
    const double ratios[] = {0.5, 0.7};
    for (int i = 0; i < 2; i++) {
        uint64_t *keep = all_kept(w->numel);
        CHECK_OK(mti_sp_prune_rows(NULL, score, rows, cols, (size_t)(cols * ratios[i]), keep));
        char name[32];
        snprintf(name, sizeof name, "wanda.mask_%g", ratios[i]);
        same_mask(name, keep, w->numel);
        free(keep);
    }
    /* the paper's N:M on Wanda's scores */
    const int nm[2][2] = {{2, 4}, {4, 8}};
    for (int i = 0; i < 2; i++) {
        uint64_t *keep = all_kept(w->numel);
        CHECK_OK(mti_sp_prune_nm(NULL, score, w->numel, nm[i][0], nm[i][1], keep));
        char name[32];
        snprintf(name, sizeof name, "wanda.nm_%d_%d", nm[i][0], nm[i][1]);
        same_mask(name, keep, w->numel);
        free(keep);
    }
    /* magnitude alone chooses otherwise (the calibration matters) */
    float *mag = abs_of(w);
    uint64_t *a = all_kept(w->numel), *b = all_kept(w->numel);
    CHECK_OK(mti_sp_prune_rows(NULL, mag, rows, cols, (size_t)cols / 2, a));
    CHECK_OK(mti_sp_prune_rows(NULL, score, rows, cols, (size_t)cols / 2, b));
    CHECK(memcmp(a, b, mti_sp_words(w->numel) * 8) != 0);
    free(a);
    free(b);
    free(mag);
    free(score);
}

TEST(sparse_nm_asp_golden)
{
    load_sparse();
    const int nm[4][2] = {{2, 4}, {1, 4}, {3, 8}, {5, 16}};
    for (int i = 0; i < 4; i++) {
        char name[32];
        snprintf(name, sizeof name, "nm_%d_%d.w", nm[i][0], nm[i][1]);
        const gv_array *w = arr(name, GV_F32);
        float *score = abs_of(w);
        uint64_t *keep = all_kept(w->numel);
        CHECK_OK(mti_sp_prune_nm(NULL, score, w->numel, nm[i][0], nm[i][1], keep));
        snprintf(name, sizeof name, "nm_%d_%d.mask", nm[i][0], nm[i][1]);
        same_mask(name, keep, w->numel);
        CHECK_EQ(mti_sp_kept(keep, w->numel), w->numel / (size_t)nm[i][1] * (size_t)nm[i][0]);
        free(score);
        free(keep);
    }
}

/* A mask of n bits keeping each element with probability p (a fixed LCG). */
static uint64_t *random_mask(size_t n, double p, uint64_t seed)
{
    uint64_t *k = calloc(mti_sp_words(n) + 1, 8);
    CHECK(k != NULL);
    for (size_t e = 0; e < n; e++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        if ((double)(seed >> 11) / 9007199254740992.0 < p) k[e / 64] |= (uint64_t)1 << (e % 64);
    }
    return k;
}

/* Every range of a tensor expands and compresses back to the same values,
 * in both formats, at several densities and sizes (spans cut anywhere). */
TEST(sparse_storage_round_trips)
{
    const size_t sizes[] = {1, 63, 64, 65, 1000, 1024, 1025, 5000};
    const double dens[] = {0.0, 0.1, 0.5, 0.97, 1.0};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (size_t di = 0; di < sizeof dens / sizeof dens[0]; di++) {
            const size_t n = sizes[si];
            uint64_t *keep = random_mask(n, dens[di], si * 31 + di), *back = calloc(mti_sp_words(n) + 1, 8);
            const size_t nnz = mti_sp_kept(keep, n);
            mti_sp_layout L;
            CHECK_OK(mti_sp_layout_of(NULL, MTI_SP_BITMAP, n, nnz, 0, 0, &L));
            CHECK_EQ(L.bytes % 8, 0);
            void *meta = malloc(L.bytes);
            float *vals = malloc((nnz + 1) * 4), *dense = malloc(n * 4), *v2 = calloc(nnz + 1, 4);
            CHECK(meta && vals && dense && v2 && back);
            for (size_t i = 0; i < nnz; i++) vals[i] = (float)i + 1.0f;
            CHECK_OK(mti_sp_encode(&L, keep, meta));
            mti_sp_decode(&L, meta, back);
            CHECK_EQ(mti_sp_kept(back, n), nnz);
            CHECK(memcmp(back, keep, (n / 64) * 8) == 0);
            /* whole, then in pieces of 37 */
            mti_sp_expand(&L, meta, vals, 0, 4, 0, n, dense);
            size_t r = 0;
            for (size_t e = 0; e < n; e++) {
                const int kept = (int)(keep[e / 64] >> (e % 64) & 1);
                CHECK_MSG(dense[e] == (kept ? (float)++r : 0.0f), "n %zu element %zu", n, e);
                CHECK_EQ(mti_sp_rank(&L, meta, e), r - (size_t)kept);
            }
            for (size_t at = 0; at < n; at += 37) {
                const size_t len = n - at < 37 ? n - at : 37;
                float piece[37];
                mti_sp_expand(&L, meta, vals, 0, 4, at, len, piece);
                CHECK(memcmp(piece, dense + at, len * 4) == 0);
                mti_sp_compress(&L, meta, piece, 4, at, len, v2, 0, 0);
            }
            CHECK(memcmp(v2, vals, nnz * 4) == 0);
            mti_sp_compress(&L, meta, dense, 4, 0, n, v2, 0, 1); /* added: twice */
            for (size_t i = 0; i < nnz; i++) CHECK_EQ(v2[i], 2.0f * vals[i]);
            free(meta), free(vals), free(dense), free(v2), free(keep), free(back);
        }
    /* N:M: every pattern of 2:4 and 3:8, and 5:16 */
    const int nm[3][2] = {{2, 4}, {3, 8}, {5, 16}};
    for (int i = 0; i < 3; i++) {
        const int N = nm[i][0], M = nm[i][1];
        const size_t n = (size_t)M * 40;
        float *score = malloc(n * 4), *dense = malloc(n * 4);
        uint64_t *keep = calloc(mti_sp_words(n), 8), *back = calloc(mti_sp_words(n), 8);
        uint64_t seed = 7;
        for (size_t e = 0; e < n; e++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            score[e] = (float)(seed >> 40);
        }
        CHECK_OK(mti_sp_prune_nm(NULL, score, n, N, M, keep));
        mti_sp_layout L;
        const size_t nnz = n / (size_t)M * (size_t)N;
        CHECK_OK(mti_sp_layout_of(NULL, MTI_SP_NM, n, nnz, N, M, &L));
        CHECK_EQ(L.bytes, (nnz * (size_t)L.bits + 63) / 64 * 8);
        void *meta = malloc(L.bytes);
        CHECK_OK(mti_sp_encode(&L, keep, meta));
        mti_sp_decode(&L, meta, back);
        CHECK(memcmp(back, keep, mti_sp_words(n) * 8) == 0);
        float *vals = malloc(nnz * 4), *v2 = calloc(nnz, 4);
        for (size_t k = 0; k < nnz; k++) vals[k] = (float)k + 1.0f;
        mti_sp_expand(&L, meta, vals, 0, 4, 0, n, dense);
        size_t r = 0;
        for (size_t e = 0; e < n; e++) {
            const int kept = (int)(keep[e / 64] >> (e % 64) & 1);
            CHECK_EQ(dense[e], kept ? (float)++r : 0.0f);
        }
        for (size_t at = 0; at < n; at += 5) {
            const size_t len = n - at < 5 ? n - at : 5;
            mti_sp_compress(&L, meta, dense + at, 4, at, len, v2, 0, 0);
        }
        CHECK(memcmp(v2, vals, nnz * 4) == 0);
        /* a mask that is not N:M is refused */
        keep[0] ^= 1;
        CHECK_ST(MT_ERR_INVALID_ARG, mti_sp_encode(&L, keep, meta));
        free(score), free(dense), free(keep), free(back), free(meta), free(vals), free(v2);
    }
    mti_sp_layout L;
    CHECK_OK(mti_sp_layout_of(NULL, MTI_SP_NM, 12, 6, 2, 4, &L));
    CHECK_ST(MT_ERR_INVALID_ARG, mti_sp_layout_of(NULL, MTI_SP_NM, 10, 5, 2, 4, &L)); /* 4 does not divide 10 */
    CHECK_ST(MT_ERR_INVALID_ARG, mti_sp_layout_of(NULL, MTI_SP_NM, 16, 16, 4, 4, &L)); /* N = M */
    CHECK_ST(MT_ERR_INVALID_ARG, mti_sp_layout_of(NULL, MTI_SP_NM, 34, 17, 1, 17, &L)); /* M > 16 */
}

/* Gradual pruning keeps what was pruned: each step prunes only more, and
 * ends with exactly the count asked for. Ties go to the earlier element. */
TEST(sparse_prune_keeps_pruned_and_ties)
{
    const size_t n = 3000;
    float *score = malloc(n * 4);
    for (size_t e = 0; e < n; e++) score[e] = (float)((e * 7919) % 1000); /* many ties */
    uint64_t *keep = all_kept(n), *prev = all_kept(n);
    mti_sp_seg seg = {score, n, keep};
    for (int t = 0; t <= 10; t++) {
        const size_t k = mti_sp_count(mti_sp_gradual(0.8, 0, 10, t), n);
        memcpy(prev, keep, mti_sp_words(n) * 8);
        CHECK_OK(mti_sp_prune_smallest(NULL, &seg, 1, k));
        CHECK_EQ(n - mti_sp_kept(keep, n), k);
        for (size_t w = 0; w < mti_sp_words(n); w++) CHECK((keep[w] & ~prev[w]) == 0);
    }
    /* the pruned are the smallest: every pruned score <= every kept one, and
       among equal scores at the edge the earlier went first */
    float kmin = INFINITY, pmax = -1.0f;
    for (size_t e = 0; e < n; e++) {
        const int kept = (int)(keep[e / 64] >> (e % 64) & 1);
        if (kept) kmin = fminf(kmin, score[e]);
        else pmax = fmaxf(pmax, score[e]);
    }
    CHECK(pmax <= kmin);
    int seen_kept_edge = 0;
    for (size_t e = 0; e < n; e++)
        if (score[e] == kmin) {
            const int kept = (int)(keep[e / 64] >> (e % 64) & 1);
            if (kept) seen_kept_edge = 1;
            else CHECK_MSG(!seen_kept_edge || kmin != pmax, "a later equal score went first");
        }
    /* bad scores are refused */
    score[5] = -1.0f;
    CHECK_ST(MT_ERR_INVALID_ARG, mti_sp_prune_smallest(NULL, &seg, 1, 10));
    score[5] = NAN;
    CHECK_ST(MT_ERR_INVALID_ARG, mti_sp_prune_smallest(NULL, &seg, 1, 10));
    free(score), free(keep), free(prev);
}

/* The schedules equal their formulas. */
TEST(sparse_schedules)
{
    const double sf = 0.9;
    for (int64_t t = 0; t < 120; t++) {
        double want = t < 20 ? 0.0 : t >= 100 ? sf : sf * (1.0 - pow(1.0 - (t - 20) / 80.0, 3));
        CHECK(fabs(mti_sp_gradual(sf, 20, 100, t) - want) < 1e-15);
    }
    CHECK_EQ(mti_sp_gradual(0.5, 7, 7, 7), 0.5);
    CHECK(fabs(mti_sp_rigl_frac(0.3, 0, 100) - 0.3) < 1e-15);
    CHECK(fabs(mti_sp_rigl_frac(0.3, 50, 100) - 0.15) < 1e-15);
    CHECK_EQ(mti_sp_rigl_frac(0.3, 100, 100), 0.0);
}

/* ---- pruned models and their training ---- */

#include "memtrain.h"

enum { GB = 4, GT = 8, GV = 64, GC = 32 };

static void prune_cfg(mt_trainer_config *tc, mt_optimizer_kind opt, double sparsity)
{
    mt_trainer_config_init(tc);
    tc->max_batch = GB, tc->max_seq = GT;
    tc->optimizer = opt, tc->lr = 1e-2f, tc->weight_decay = 0.1f;
    if (opt == MT_OPT_SGD) tc->momentum = 0.9f;
    tc->prune.method = MT_PRUNE_MAGNITUDE;
    tc->prune.sparsity = sparsity;
}

/* A CPU context of 2 threads and a small GPT on it (seed). */
static mt_model *setup(mt_context **ctx, uint64_t seed)
{
    *ctx = check_cpu_context(2);
    return check_small_gpt(*ctx, GV, GT, GC, seed);
}

/* A context and two small GPTs on it of the same seed (*b the second). */
static mt_model *setup_pair(mt_context **ctx, uint64_t seed, mt_model **b)
{
    mt_model *a = setup(ctx, seed);
    *b = check_small_gpt(*ctx, GV, GT, GC, seed);
    return a;
}

/* Two models and their context freed. */
static void teardown_pair(mt_context *ctx, mt_model *a, mt_model *b)
{
    CHECK_OK(mt_model_destroy(b));
    CHECK_OK(mt_model_destroy(a));
    CHECK_OK(mt_context_destroy(ctx));
}

/* The trainer, the model and the context freed. */
static void teardown(mt_context *ctx, mt_trainer *t, mt_model *m)
{
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* Whether parameter name is a linear weight of check_small_gpt's model. */
static bool linear_w(const char *name)
{
    const size_t l = strlen(name);
    return l > 2 && !strcmp(name + l - 2, ".w") &&
           (strstr(name, ".qkv.") || strstr(name, ".attproj.") || strstr(name, ".fc.") ||
            strstr(name, ".fcproj."));
}

/* Each target's mask is the smallest |w| of its weights before, by
 * magnitude (rint(s n) pruned); pruned weights stay exactly 0 through
 * training, with weight decay; kept ones move; the rest stays dense. */
TEST(sparse_train_magnitude_pruned_stay_zero)
{
    const mt_optimizer_kind opts[] = {MT_OPT_ADAMW, MT_OPT_SGD, MT_OPT_ADAMW8, MT_OPT_ADAMW4,
                                      MT_OPT_ADAFACTOR};
    for (int oi = 0; oi < 5; oi++) {
        mt_context *ctx = check_cpu_context(2);
        mt_model *m = check_small_gpt(ctx, GV, GT, GC, 5);
        const size_t n = mt_model_num_params(m);
        float *w0 = check_alloc(n * 4), *w1 = check_alloc(n * 4);
        CHECK_OK(mt_model_get_params(m, w0, n));
        mt_trainer_config tc;
        prune_cfg(&tc, opts[oi], 0.6);
        tc.min_8bit_size = 64;
        mt_estimate_report est;
        CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        uint64_t pruned, total, want_p = 0, want_t = 0;
        CHECK_OK(mt_model_sparsity(m, &pruned, &total));
        for (int i = 0; i < mt_model_num_tensors(m); i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(m, i, &pi));
            unsigned char *keep = check_alloc(pi.numel);
            CHECK_OK(mt_model_param_mask(m, i, keep, pi.numel));
            float *score = check_alloc(pi.numel * 4);
            uint64_t *bits = all_kept(pi.numel);
            for (size_t e = 0; e < pi.numel; e++) score[e] = fabsf(w0[pi.offset + e]);
            if (linear_w(pi.name)) {
                mti_sp_seg seg = {score, pi.numel, bits};
                CHECK_OK(mti_sp_prune_smallest(NULL, &seg, 1, mti_sp_count(0.6, pi.numel)));
                want_p += mti_sp_count(0.6, pi.numel), want_t += pi.numel;
            }
            for (size_t e = 0; e < pi.numel; e++)
                CHECK_MSG(keep[e] == (bits[e / 64] >> (e % 64) & 1), "%s element %zu", pi.name, e);
            free(bits);
        }
        CHECK_EQ(pruned, want_p);
        CHECK_EQ(total, want_t);
        check_token_steps(ctx, t, GB, GT, GV, 0, 4);
        char what[32];
        snprintf(what, sizeof what, "optimizer %d", oi);
        check_estimate_matches(ctx, &est, what);
        CHECK_OK(mt_model_get_params(m, w1, n));
        size_t moved = 0, kept = 0;
        for (int i = 0; i < mt_model_num_tensors(m); i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(m, i, &pi));
            unsigned char *keep = check_alloc(pi.numel);
            CHECK_OK(mt_model_param_mask(m, i, keep, pi.numel));
            for (size_t e = 0; e < pi.numel; e++) {
                const float a = w0[pi.offset + e], b = w1[pi.offset + e];
                if (!keep[e]) CHECK_MSG(b == 0.0f && !signbit(b), "%s[%zu] = %g", pi.name, e, b);
                else if (linear_w(pi.name)) kept++, moved += a != b;
            }
        }
        CHECK_MSG(moved == kept, "optimizer %d: %zu of %zu kept weights moved", oi, moved, kept);
        mt_trainer_destroy(t);
        /* the model keeps its masks: get_params reads zeros there after the trainer */
        CHECK_OK(mt_model_get_params(m, w0, n));
        CHECK(memcmp(w0, w1, n * 4) == 0);
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
}

/* Adafactor on a pruned matrix is Adafactor of the dense matrix with zeros
 * at the pruned places and a zero gradient there (the op, whose numerics
 * test_golden checks against transformers, on dense tiles): the same bits
 * after a step, with and without a first moment; the pruned weights stay
 * 0 and the factored statistics keep the dense rows and columns. */
TEST(sparse_adafactor_is_the_dense_update_with_zeros)
{
    for (int b1 = 0; b1 < 2; b1++) {
        mt_context *ctx;
        mt_model *m = setup(&ctx, 31);
        mt_trainer_config tc;
        prune_cfg(&tc, MT_OPT_ADAFACTOR, 0.75);
        tc.adafactor.relative_step = 0, tc.adafactor.scale_parameter = 0;
        tc.adafactor.beta1 = b1 ? 0.9f : 0.0f;
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        const size_t n = mt_model_num_params(m);
        float *w0 = check_alloc(n * 4), *w1 = check_alloc(n * 4), *g = check_alloc(n * 4);
        CHECK_OK(mt_model_get_params(m, w0, n));
        int32_t tok[GB * GT], tg[GB * GT];
        mt_batch bt;
        check_token_batch(&bt, tok, tg, GB, GT, GV, 0);
        float l;
        CHECK_OKC(ctx, mt_trainer_gradients(t, &bt, &l, g, n));
        CHECK_OKC(ctx, mt_trainer_step(t, &bt, &l));
        CHECK_OK(mt_model_get_params(m, w1, n));
        const mti_ops *op = mti_cpu_ops();
        const mti_kctx k = {ctx, ctx->dev};
        int pruned_seen = 0;
        for (int i = 0; i < mt_model_num_tensors(m); i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(m, i, &pi));
            if (!linear_w(pi.name)) continue;
            pruned_seen++;
            const int64_t rows = pi.shape[0], cols = pi.shape[1];
            float *p = check_copy(w0 + pi.offset, pi.numel * 4);
            float *row = check_alloc((size_t)rows * 4), *col = check_alloc((size_t)cols * 4);
            float *mom = b1 ? check_alloc(pi.numel * 4) : NULL;
            const mti_adafactor_args a = {.lr = tc.lr, .eps1 = tc.adafactor.eps1,
                                          .eps2 = tc.adafactor.eps2,
                                          .clip_threshold = tc.adafactor.clip_threshold,
                                          .decay_rate = tc.adafactor.decay_rate,
                                          .beta1 = tc.adafactor.beta1,
                                          .weight_decay = tc.weight_decay, .step = 1,
                                          .grad_scale = 1.0f};
            CHECK_OKC(ctx, op->adafactor(&k, p, g + pi.offset, row, col, NULL, mom, NULL, MTI_F32,
                                         rows, cols, 1, &a));
            unsigned char *keep = check_alloc(pi.numel);
            CHECK_OK(mt_model_param_mask(m, i, keep, pi.numel));
            for (size_t e = 0; e < pi.numel; e++) {
                if (!keep[e]) CHECK_EQ(g[pi.offset + e], 0.0f);
                CHECK_MSG(memcmp(&p[e], &w1[pi.offset + e], 4) == 0, "beta1 %d %s[%zu]: %g vs %g",
                          b1, pi.name, e, w1[pi.offset + e], p[e]);
            }
        }
        CHECK(pruned_seen > 0);
        teardown(ctx, t, m);
    }
}

/* A pruned model's gradients are the dense model's with the pruned
 * weights set to 0, bit for bit at the kept places, and 0 at the pruned
 * ones (fp32 and bf16; N:M and unstructured). */
TEST(sparse_gradients_equal_dense_with_zeros)
{
    const mt_precision precs[] = {MT_PREC_FP32, MT_PREC_BF16};
    for (int pi_ = 0; pi_ < 2; pi_++)
        for (int nm = 0; nm < 2; nm++) {
            mt_context *ctx;
            mt_model *b, *a = setup_pair(&ctx, 9, &b);
            mt_prune_config pc = {.method = MT_PRUNE_MAGNITUDE, .sparsity = 0.5};
            if (nm) pc.nm_n = 2, pc.nm_m = 4;
            CHECK_OKC(ctx, mt_model_prune(a, &pc));
            const size_t n = mt_model_num_params(a);
            float *w = check_alloc(n * 4), *ga = check_alloc(n * 4), *gb = check_alloc(n * 4);
            CHECK_OK(mt_model_get_params(a, w, n));
            CHECK_OK(mt_model_set_params(b, w, n));
            mt_trainer_config tc;
            prune_cfg(&tc, MT_OPT_ADAMW, 0);
            tc.prune.method = MT_PRUNE_NONE;
            tc.precision = precs[pi_];
            mt_trainer *ta, *tb;
            CHECK_OKC(ctx, mt_trainer_create(a, &tc, &ta));
            CHECK_OKC(ctx, mt_trainer_create(b, &tc, &tb));
            int32_t tok[GB * GT], tg[GB * GT];
            mt_batch bt;
            check_token_batch(&bt, tok, tg, GB, GT, GV, 0);
            float la, lb;
            CHECK_OKC(ctx, mt_trainer_gradients(ta, &bt, &la, ga, n));
            CHECK_OKC(ctx, mt_trainer_gradients(tb, &bt, &lb, gb, n));
            CHECK_EQ(la, lb);
            for (int i = 0; i < mt_model_num_tensors(a); i++) {
                mt_param_info pi;
                CHECK_OK(mt_model_param_info(a, i, &pi));
                unsigned char *keep = check_alloc(pi.numel);
                CHECK_OK(mt_model_param_mask(a, i, keep, pi.numel));
                size_t nk = 0;
                for (size_t e = 0; e < pi.numel; e++) {
                    nk += keep[e];
                    const float x = ga[pi.offset + e], y = keep[e] ? gb[pi.offset + e] : 0.0f;
                    CHECK_MSG(memcmp(&x, &y, 4) == 0, "prec %d nm %d %s[%zu]: %g vs %g", pi_, nm,
                              pi.name, e, x, y);
                }
                if (linear_w(pi.name)) CHECK_EQ(nk, pi.numel / 2);
                else CHECK_EQ(nk, pi.numel);
            }
            mt_trainer_destroy(ta);
            mt_trainer_destroy(tb);
            teardown_pair(ctx, a, b);
        }
}

/* A pruned weight's GEMMs: auto takes the sparse GEMMs at 95% and the
 * dense tile at 50% (the same bits as the forced choice), the two agree to
 * rounding, training through the sparse GEMMs keeps the pruned weights at
 * 0 and moves the kept ones, its estimate equals the run, and a kernel
 * choice that is out of range or sparse with RigL is refused. */
TEST(sparse_kernel_choice)
{
    const double sps[] = {0.95, 0.5};
    for (int si = 0; si < 2; si++) {
        mt_context *ctx;
        mt_model *a = setup(&ctx, 21);
        mt_prune_config pc = {.method = MT_PRUNE_MAGNITUDE, .sparsity = sps[si]};
        CHECK_OKC(ctx, mt_model_prune(a, &pc));
        const size_t n = mt_model_num_params(a);
        float *g[3], l[3];
        int32_t tok[GB * GT], tg[GB * GT];
        mt_batch bt;
        check_token_batch(&bt, tok, tg, GB, GT, GV, 0);
        const mt_sparse_kernel ks[3] = {MT_SPARSE_KERNEL_AUTO, MT_SPARSE_KERNEL_DENSE,
                                        MT_SPARSE_KERNEL_SPARSE};
        for (int ki = 0; ki < 3; ki++) {
            mt_trainer_config tc;
            prune_cfg(&tc, MT_OPT_ADAMW, 0);
            tc.prune.method = MT_PRUNE_NONE;
            tc.prune.kernel = ks[ki];
            mt_trainer *t;
            CHECK_OKC(ctx, mt_trainer_create(a, &tc, &t));
            g[ki] = check_alloc(n * 4);
            CHECK_OKC(ctx, mt_trainer_gradients(t, &bt, &l[ki], g[ki], n));
            mt_trainer_destroy(t);
        }
        const int same = si == 0 ? 2 : 1; /* auto's choice */
        CHECK_MSG(memcmp(g[0], g[same], n * 4) == 0 && l[0] == l[same], "sparsity %g: auto is not %s",
                  sps[si], same == 2 ? "sparse" : "dense");
        CHECK(memcmp(g[1], g[2], n * 4) != 0); /* (the sums in another order) */
        CHECK(fabsf(l[1] - l[2]) <= 1e-5f * fabsf(l[1]));
        double num = 0, den = 0;
        for (size_t e = 0; e < n; e++)
            num += ((double)g[1][e] - g[2][e]) * ((double)g[1][e] - g[2][e]), den += (double)g[1][e] * g[1][e];
        CHECK_MSG(sqrt(num / den) < 1e-5, "sparsity %g: dense and sparse gradients differ by %g",
                  sps[si], sqrt(num / den));
        /* training through the sparse GEMMs, and its estimate */
        for (int prec = 0; prec < 2; prec++) {
            mt_trainer_config tc;
            prune_cfg(&tc, MT_OPT_ADAMW, 0);
            tc.prune.method = MT_PRUNE_NONE;
            tc.prune.kernel = MT_SPARSE_KERNEL_SPARSE;
            tc.precision = prec ? MT_PREC_BF16 : MT_PREC_FP32;
            mt_context *c2; /* (its own context: the estimate is of its peak) */
            mt_model *b = setup(&c2, 21);
            CHECK_OKC(c2, mt_model_prune(b, &pc));
            float *w0 = check_alloc(n * 4), *w1 = check_alloc(n * 4);
            CHECK_OK(mt_model_get_params(b, w0, n));
            mt_estimate_report est;
            CHECK_OKC(c2, mt_estimate_model(b, &tc, &est));
            mt_trainer *t;
            CHECK_OKC(c2, mt_trainer_create(b, &tc, &t));
            check_token_steps(c2, t, GB, GT, GV, 0, 2);
            check_estimate_matches(c2, &est, prec ? "sparse GEMMs, bf16" : "sparse GEMMs, fp32");
            mt_trainer_destroy(t);
            CHECK_OK(mt_model_get_params(b, w1, n));
            for (int i = 0; i < mt_model_num_tensors(b); i++) {
                mt_param_info pi;
                CHECK_OK(mt_model_param_info(b, i, &pi));
                if (!linear_w(pi.name)) continue;
                unsigned char *keep = check_alloc(pi.numel);
                CHECK_OK(mt_model_param_mask(b, i, keep, pi.numel));
                size_t moved = 0, kept = 0;
                for (size_t e = 0; e < pi.numel; e++) {
                    if (!keep[e]) CHECK_EQ(w1[pi.offset + e], 0.0f);
                    else kept++, moved += w1[pi.offset + e] != w0[pi.offset + e];
                }
                CHECK_EQ(moved, kept);
            }
            CHECK_OK(mt_model_destroy(b));
            CHECK_OK(mt_context_destroy(c2));
        }
        CHECK_OK(mt_model_destroy(a));
        CHECK_OK(mt_context_destroy(ctx));
    }
    /* refusals */
    mt_context *ctx;
    mt_model *m = setup(&ctx, 5);
    mt_trainer_config tc;
    prune_cfg(&tc, MT_OPT_ADAMW, 0.9);
    mt_trainer *t;
    tc.prune.kernel = (mt_sparse_kernel)3;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    tc.prune.kernel = MT_SPARSE_KERNEL_SPARSE;
    tc.prune.regrow = MT_REGROW_RIGL, tc.prune.regrow_every = 2, tc.prune.regrow_frac = 0.3;
    tc.prune.regrow_end = 10;
    CHECK_ST(MT_ERR_INVALID_ARG, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "kernel") != NULL);
    tc.prune.kernel = MT_SPARSE_KERNEL_AUTO; /* (RigL: the dense tile) */
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    mt_trainer_destroy(t);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* The estimate of a pruning run equals the run, to the byte, at 50%, 90%,
 * 95% and 2:4 (fp32 and bf16 with masters); and the pruned tensors' classes
 * shrink as the storage says. */
TEST(sparse_estimate_equals_run)
{
    static const struct {
        double s;
        int n, m;
        mt_precision prec;
    } cases[] = {{0.5, 0, 0, MT_PREC_FP32}, {0.9, 0, 0, MT_PREC_FP32}, {0, 2, 4, MT_PREC_FP32},
                 {0.5, 0, 0, MT_PREC_BF16}, {0, 2, 4, MT_PREC_BF16}, {0.95, 0, 0, MT_PREC_FP32},
                 {0.95, 0, 0, MT_PREC_BF16}}; /* (90% and 95%: the sparse GEMMs) */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        mt_context *ctx = check_cpu_context(2);
        mt_model *m = check_small_gpt(ctx, GV, GT, 64, 3);
        mt_trainer_config tc;
        prune_cfg(&tc, MT_OPT_ADAMW, cases[c].s);
        tc.prune.nm_n = cases[c].n, tc.prune.nm_m = cases[c].m;
        tc.precision = cases[c].prec;
        mt_estimate_report est;
        CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        check_token_steps(ctx, t, GB, GT, GV, 0, 2);
        char what[64];
        snprintf(what, sizeof what, "case %zu", c);
        check_estimate_matches(ctx, &est, what);
        mt_trainer_destroy(t);
        CHECK_OK(mt_model_destroy(m));
        CHECK_OK(mt_context_destroy(ctx));
    }
}

/* A gradual prune: at every step the pruned count of each target is
 * rint(s_t n) of Zhu & Gupta's schedule (held between prunes), what was
 * pruned stays pruned, and the weights there stay 0 while AdamW's state
 * (Adafactor's first moment, its factored statistics kept) is rebuilt at
 * each prune. */
TEST(sparse_gradual_follows_the_schedule)
{
    for (int oi = 0; oi < 2; oi++) { /* AdamW, Adafactor */
        mt_context *ctx;
        mt_model *m = setup(&ctx, 11);
        mt_trainer_config tc;
        prune_cfg(&tc, oi ? MT_OPT_ADAFACTOR : MT_OPT_ADAMW, 0.8);
        tc.adafactor.beta1 = 0.9f; /* (Adafactor: a first moment, relaid per prune) */
        tc.prune.schedule = MT_PRUNE_GRADUAL;
        tc.prune.start = 2, tc.prune.end = 9, tc.prune.every = 3; /* prunes after 2, 5, 8 and 9 steps */
        tc.prune.targets = "h.*.fc.w,h.1.qkv.w";
        mt_trainer *t;
        CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
        const size_t n = mt_model_num_params(m);
        float *w = check_alloc(n * 4);
        unsigned char *prev[16] = {0};
        double held = 0.0;
        for (int step = 0; step < 12; step++) {
            int64_t next;
            CHECK_OK(mt_trainer_prune_next(t, &next, NULL));
            const int64_t want_next = step <= 2 ? 2 : step <= 5 ? 5 : step <= 8 ? 8 : step <= 9 ? 9 : -1;
            CHECK_MSG(next == want_next, "after %d steps the next prune is %lld", step, (long long)next);
            check_token_steps(ctx, t, GB, GT, GV, step, step + 1);
            if (step == 2 || step == 5 || step == 8 || step == 9) held = mti_sp_gradual(0.8, 2, 9, step);
            CHECK_OK(mt_model_get_params(m, w, n));
            int k = 0;
            for (int i = 0; i < mt_model_num_tensors(m); i++) {
                mt_param_info pi;
                CHECK_OK(mt_model_param_info(m, i, &pi));
                unsigned char *keep = check_alloc(pi.numel);
                CHECK_OK(mt_model_param_mask(m, i, keep, pi.numel));
                const bool target = strstr(pi.name, ".fc.w") || !strcmp(pi.name, "h.1.qkv.w");
                size_t pruned = 0;
                for (size_t e = 0; e < pi.numel; e++) {
                    pruned += !keep[e];
                    if (!keep[e]) CHECK_EQ(w[pi.offset + e], 0.0f);
                    if (target && prev[k]) CHECK_MSG(keep[e] <= prev[k][e], "%s regrew %zu", pi.name, e);
                }
                if (!target) {
                    CHECK_EQ(pruned, 0);
                    continue;
                }
                CHECK_MSG(pruned == mti_sp_count(held, pi.numel), "after %d steps %s: %zu pruned, want %zu",
                          step + 1, pi.name, pruned, mti_sp_count(held, pi.numel));
                prev[k++] = keep;
            }
        }
        teardown(ctx, t, m);
    }
}

/* Wanda through a trainer: the prune waits for its calibration (a step
 * without it fails and changes nothing); then each row of each target
 * loses floor(s cols) weights, the first layer's exactly those of the
 * smallest |w| ||x|| over the calibration batches' features (its input). */
TEST(sparse_wanda_calibrates_then_prunes)
{
    mt_context *ctx = check_cpu_context(2);
    mt_mlp_spec sp;
    mt_mlp_spec_init(&sp);
    sp.n_layers = 3;
    sp.dims[0] = 12, sp.dims[1] = 16, sp.dims[2] = 20, sp.dims[3] = 4;
    sp.seed = 3;
    mt_model *m;
    CHECK_OKC(ctx, mt_model_mlp_create(ctx, &sp, &m));
    const size_t n = mt_model_num_params(m);
    float *w0 = check_alloc(n * 4), *w1 = check_alloc(n * 4);
    CHECK_OK(mt_model_get_params(m, w0, n));
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 8, tc.optimizer = MT_OPT_ADAMW, tc.lr = 1e-2f;
    tc.prune.method = MT_PRUNE_WANDA, tc.prune.sparsity = 0.5, tc.prune.calib = 2;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    int64_t next;
    int need;
    CHECK_OK(mt_trainer_prune_next(t, &next, &need));
    CHECK_EQ(next, 0);
    CHECK_EQ(need, 2);
    float x[8 * 12], feat[12] = {0};
    int32_t y[8];
    for (int i = 0; i < 8 * 12; i++) x[i] = (float)((i * 37) % 29) / 7.0f - 2.0f;
    for (int i = 0; i < 8; i++) y[i] = i % 4;
    /* the columns' scales differ widely, so the activations matter */
    for (int i = 0; i < 8 * 12; i++) x[i] *= (float)(1 + (i % 12) * (i % 12));
    mt_batch b = {.n = 8, .inputs = x, .targets = y};
    CHECK_ST(MT_ERR_STATE, mt_trainer_step(t, &b, NULL));
    CHECK_OK(mt_model_get_params(m, w1, n));
    CHECK(memcmp(w0, w1, n * 4) == 0);
    CHECK_OKC(ctx, mt_trainer_calibrate(t, &b));
    CHECK_ST(MT_ERR_STATE, mt_trainer_step(t, &b, NULL));
    CHECK_OKC(ctx, mt_trainer_calibrate(t, &b));
    CHECK_OK(mt_trainer_prune_next(t, &next, &need));
    CHECK_EQ(need, 0);
    /* the first layer's scores, as the paper's: |w| sqrt(sum of x^2) */
    for (int r = 0; r < 8; r++)
        for (int j = 0; j < 12; j++) feat[j] += 2.0f * x[r * 12 + j] * x[r * 12 + j];
    mt_param_info p0;
    CHECK_OK(mt_model_param_info(m, 0, &p0));
    float *score = check_alloc(p0.numel * 4);
    for (size_t e = 0; e < p0.numel; e++) score[e] = fabsf(w0[e]) * sqrtf(feat[e % 12]);
    uint64_t *bits = all_kept(p0.numel);
    CHECK_OK(mti_sp_prune_rows(NULL, score, 16, 12, 6, bits));
    CHECK_OKC(ctx, mt_trainer_step(t, &b, NULL));
    CHECK_OK(mt_trainer_prune_next(t, &next, NULL));
    CHECK_EQ(next, -1);
    for (int i = 0; i < mt_model_num_tensors(m); i++) {
        mt_param_info pi;
        CHECK_OK(mt_model_param_info(m, i, &pi));
        unsigned char *keep = check_alloc(pi.numel);
        CHECK_OK(mt_model_param_mask(m, i, keep, pi.numel));
        if (pi.ndim != 2) continue;
        for (int64_t r = 0; r < pi.shape[0]; r++) {
            int64_t pr = 0;
            for (int64_t j = 0; j < pi.shape[1]; j++) pr += !keep[r * pi.shape[1] + j];
            CHECK_EQ(pr, pi.shape[1] / 2);
        }
        if (i == 0)
            for (size_t e = 0; e < pi.numel; e++)
                CHECK_MSG(keep[e] == (bits[e / 64] >> (e % 64) & 1), "first layer element %zu", e);
    }
    free(bits);
    /* magnitude alone would have chosen otherwise here */
    uint64_t *mag = all_kept(p0.numel);
    for (size_t e = 0; e < p0.numel; e++) score[e] = fabsf(w0[e]);
    CHECK_OK(mti_sp_prune_rows(NULL, score, 16, 12, 6, mag));
    unsigned char *keep0 = check_alloc(p0.numel);
    CHECK_OK(mt_model_param_mask(m, 0, keep0, p0.numel));
    size_t differ = 0;
    for (size_t e = 0; e < p0.numel; e++) differ += keep0[e] != (mag[e / 64] >> (e % 64) & 1);
    CHECK(differ > 0);
    free(mag);
    /* calibrating a trainer that does not prune by Wanda is refused */
    mt_trainer_destroy(t);
    tc.prune.method = MT_PRUNE_NONE;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    CHECK_ST(MT_ERR_STATE, mt_trainer_calibrate(t, &b));
    teardown(ctx, t, m);
}

/* Bad settings are refused at create, naming the setting. */
TEST(sparse_refusals)
{
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = check_small_gpt(ctx, GV, GT, GC, 5);
    static const struct {
        double s;
        int n, mm;
        int scope, method;
        const char *targets;
        mt_optimizer_kind opt;
        mt_status want;
        const char *says;
    } cases[] = {
        {1.0, 0, 0, 0, 1, NULL, MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "outside [0, 1)"},
        {-0.1, 0, 0, 0, 1, NULL, MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "outside [0, 1)"},
        {0.5, 4, 4, 0, 1, NULL, MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "0 < N < M"},
        {0.5, 2, 17, 0, 1, NULL, MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "0 < N < M"},
        {0.5, 2, 3, 0, 1, NULL, MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "to divide the rows"},
        {0.5, 0, 0, 0, 1, "wte", MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "not a linear weight"},
        {0.5, 0, 0, 0, 1, "nothing*", MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "matches no parameter"},
        {0.5, 0, 0, 1, 2, NULL, MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "scope global"},
        {0.5, 0, 0, 0, 7, NULL, MT_OPT_ADAMW, MT_ERR_INVALID_ARG, "prune.method"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        mt_trainer_config tc;
        prune_cfg(&tc, cases[c].opt, cases[c].s);
        tc.prune.nm_n = cases[c].n, tc.prune.nm_m = cases[c].mm;
        tc.prune.scope = (mt_prune_scope)cases[c].scope;
        tc.prune.method = (mt_prune_method)cases[c].method;
        tc.prune.targets = cases[c].targets;
        tc.prune.calib = 1;
        mt_trainer *t;
        CHECK_ST(cases[c].want, mt_trainer_create(m, &tc, &t));
        CHECK_MSG(strstr(mt_last_error(ctx), cases[c].says), "case %zu: %s", c, mt_last_error(ctx));
    }
    /* a prune after steps needs elementwise state */
    mt_trainer_config tc;
    mt_trainer *t;
    for (int q = 0; q < 2; q++) {
        prune_cfg(&tc, q ? MT_OPT_ADAMW4 : MT_OPT_ADAMW8, 0.5);
        tc.prune.at = 3;
        CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_create(m, &tc, &t));
        CHECK(strstr(mt_last_error(ctx), q ? "4-bit" : "8-bit") != NULL);
    }
    /* nothing changed: the model is still dense */
    uint64_t pruned, total;
    CHECK_OK(mt_model_sparsity(m, &pruned, &total));
    CHECK_EQ(total, 0);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* The first mask section of the training-state file at path gets one
 * more kept bit (its payload's and header's CRCs made good again); loading
 * it must fail and leave the trainer and model as they were. */
static void damaged_mask_refused(mt_context *ctx, mt_trainer *t, const char *path, mt_model *m,
                                 const float *w, size_t n)
{
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    unsigned char *buf = check_alloc((size_t)size);
    rewind(f);
    CHECK_EQ(fread(buf, 1, (size_t)size, f), (size_t)size);
    size_t at = 32; /* sections after the file's header */
    bool done = false;
    while (at + 32 <= (size_t)size && !done) {
        unsigned char *h = buf + at;
        const uint64_t bytes = mti_get_u64(h + 8);
        if (mti_get_u32(h) == 3 && mti_get_u32(h + 20) == 4 /* a tensor of uint8: the mask */) {
            unsigned char *p = h + 32;
            for (uint64_t i = 0; i < bytes && !done; i++)
                if (p[i] != 0xff) p[i] |= (unsigned char)(p[i] + 1) & (unsigned char)~p[i], done = true;
            mti_put_u32(h + 16, mti_crc32(0, p, (size_t)bytes));
            mti_put_u32(h + 24, mti_crc32(0, h, 24));
        }
        at += 32 + (size_t)bytes;
    }
    CHECK(done);
    rewind(f);
    CHECK_EQ(fwrite(buf, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    const uint64_t steps = mt_trainer_steps(t);
    CHECK_ST(MT_ERR_FORMAT, mt_trainer_load(t, path, NULL, 0, NULL));
    CHECK_MSG(strstr(mt_last_error(ctx), "mask"), "%s", mt_last_error(ctx));
    CHECK_EQ(mt_trainer_steps(t), steps);
    float *now = check_alloc(n * 4);
    CHECK_OK(mt_model_get_params(m, now, n));
    CHECK(memcmp(now, w, n * 4) == 0);
}

/* Training-state files hold the masks: resuming is bit-identical, after a
 * one-shot prune, between the prunes of a gradual schedule (the fresh
 * trainer takes the file's sparser masks), and in a trainer that does not
 * prune at all. */
TEST(sparse_resume_bit_identical)
{
    /* AdamW; SGD gradual; 1:4; Adafactor gradual; 4-bit AdamW */
    for (int kind = 0; kind < 5; kind++) {
        char path[] = "/tmp/mt_sparse_ckXXXXXX";
        int fd = mkstemp(path);
        CHECK(fd >= 0);
        close(fd);
        mt_trainer_config tc;
        prune_cfg(&tc, kind == 1 ? MT_OPT_SGD : kind == 3 ? MT_OPT_ADAFACTOR
                       : kind == 4 ? MT_OPT_ADAMW4 : MT_OPT_ADAMW, 0.7);
        tc.adafactor.beta1 = 0.9f, tc.min_8bit_size = 64;
        if (kind == 1 || kind == 3) {
            tc.prune.schedule = MT_PRUNE_GRADUAL;
            tc.prune.start = 1, tc.prune.end = 7, tc.prune.every = 2;
        }
        if (kind == 2) tc.prune.nm_n = 1, tc.prune.nm_m = 4;
        mt_context *ctx;
        mt_model *b, *a = setup_pair(&ctx, 21, &b);
        const size_t n = mt_model_num_params(a);
        float *wa = check_alloc(n * 4), *wb = check_alloc(n * 4);
        mt_trainer *ta, *tb;
        CHECK_OKC(ctx, mt_trainer_create(a, &tc, &ta));
        check_token_steps(ctx, ta, GB, GT, GV, 0, 4);
        CHECK_OKC(ctx, mt_trainer_save(ta, path, NULL, 0));
        check_token_steps(ctx, ta, GB, GT, GV, 4, 9);
        CHECK_OK(mt_model_get_params(a, wa, n));
        mt_trainer_config tb_cfg = tc;
        if (kind == 2) tb_cfg.prune.method = MT_PRUNE_NONE; /* the masks come from the file */
        CHECK_OKC(ctx, mt_trainer_create(b, &tb_cfg, &tb));
        CHECK_OKC(ctx, mt_trainer_load(tb, path, NULL, 0, NULL));
        CHECK_EQ(mt_trainer_steps(tb), 4);
        check_token_steps(ctx, tb, GB, GT, GV, 4, 9);
        CHECK_OK(mt_model_get_params(b, wb, n));
        CHECK_MSG(memcmp(wa, wb, n * 4) == 0, "kind %d: the resumed run differs", kind);
        uint64_t pa, ta_, pb, tb_;
        CHECK_OK(mt_model_sparsity(a, &pa, &ta_));
        CHECK_OK(mt_model_sparsity(b, &pb, &tb_));
        CHECK(pa == pb && ta_ == tb_ && pa > 0);
        for (int i = 0; i < mt_model_num_tensors(a); i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(a, i, &pi));
            unsigned char *ka = check_alloc(pi.numel), *kb = check_alloc(pi.numel);
            CHECK_OK(mt_model_param_mask(a, i, ka, pi.numel));
            CHECK_OK(mt_model_param_mask(b, i, kb, pi.numel));
            CHECK(memcmp(ka, kb, pi.numel) == 0);
        }
        /* a file whose mask is damaged (its CRCs made good) is refused, the trainer as it was */
        if (kind == 0) damaged_mask_refused(ctx, tb, path, b, wb, n);
        mt_trainer_destroy(tb);
        unlink(path);
        mt_trainer_destroy(ta);
        teardown_pair(ctx, a, b);
    }
}

/* An llm.c export of a pruned model is the dense model with its zeros. */
TEST(sparse_export_llmc_dense_zeros)
{
    char path[] = "/tmp/mt_sparse_llmcXXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    mt_context *ctx = check_cpu_context(1);
    mt_model *m = check_small_gpt(ctx, GV, GT, GC, 4);
    mt_prune_config pc = {.method = MT_PRUNE_MAGNITUDE, .nm_n = 2, .nm_m = 4};
    CHECK_OKC(ctx, mt_model_prune(m, &pc));
    CHECK_OKC(ctx, mt_model_gpt_save(m, path));
    mt_model *back;
    CHECK_OKC(ctx, mt_model_gpt_load(ctx, path, &back));
    const size_t n = mt_model_num_params(m);
    float *a = check_alloc(n * 4), *b = check_alloc(n * 4);
    CHECK_OK(mt_model_get_params(m, a, n));
    CHECK_OK(mt_model_get_params(back, b, n));
    CHECK(memcmp(a, b, n * 4) == 0);
    size_t zeros = 0;
    for (size_t i = 0; i < n; i++) zeros += b[i] == 0.0f;
    CHECK(zeros * 4 > n); /* half of the linear weights, most of the model */
    unlink(path);
    CHECK_OK(mt_model_destroy(back));
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}

/* RigL: in its steps the masks change and the weights do not: each target
 * drops floor(f_t kept) of its smallest |w| and grows as many of the
 * largest |dense gradient| (the dense model's with zeros, computed apart
 * here), at 0; its kept count stays; other steps train as usual. */
TEST(sparse_rigl_drops_and_grows)
{
    mt_context *ctx;
    mt_model *b, *a = setup_pair(&ctx, 17, &b);
    mt_trainer_config tc;
    prune_cfg(&tc, MT_OPT_ADAMW, 0.5);
    tc.prune.regrow = MT_REGROW_RIGL;
    tc.prune.regrow_every = 2, tc.prune.regrow_frac = 0.4, tc.prune.regrow_end = 5;
    mt_trainer *ta;
    CHECK_OKC(ctx, mt_trainer_create(a, &tc, &ta));
    const size_t n = mt_model_num_params(a);
    float *w = check_alloc(n * 4), *g = check_alloc(n * 4), *w2 = check_alloc(n * 4);
    uint64_t p0, t0;
    CHECK_OK(mt_model_sparsity(a, &p0, &t0));
    int regrew = 0;
    for (int step = 0; step < 7; step++) {
        const bool rigl = step == 2 || step == 4; /* after 2 and 4 steps; 6 is past the end */
        int32_t tok[GB * GT], tg[GB * GT];
        mt_batch bt;
        check_token_batch(&bt, tok, tg, GB, GT, GV, step);
        CHECK_OK(mt_model_get_params(a, w, n));
        if (rigl) { /* the dense gradient, from a dense model with the zeros */
            mt_trainer_config dc;
            prune_cfg(&dc, MT_OPT_ADAMW, 0);
            dc.prune.method = MT_PRUNE_NONE;
            mt_trainer *tb;
            CHECK_OK(mt_model_set_params(b, w, n));
            CHECK_OKC(ctx, mt_trainer_create(b, &dc, &tb));
            float lb;
            CHECK_OKC(ctx, mt_trainer_gradients(tb, &bt, &lb, g, n));
            mt_trainer_destroy(tb);
        }
        const uint64_t opt_before = mt_trainer_steps(ta);
        unsigned char *before[32];
        for (int i = 0; i < mt_model_num_tensors(a) && i < 32; i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(a, i, &pi));
            before[i] = check_alloc(pi.numel);
            CHECK_OK(mt_model_param_mask(a, i, before[i], pi.numel));
        }
        CHECK_OKC(ctx, mt_trainer_step(ta, &bt, NULL));
        CHECK_EQ(mt_trainer_steps(ta), opt_before + 1);
        CHECK_OK(mt_model_get_params(a, w2, n));
        uint64_t pr, tt;
        CHECK_OK(mt_model_sparsity(a, &pr, &tt));
        CHECK(pr == p0 && tt == t0); /* the counts stay */
        for (int i = 0; i < mt_model_num_tensors(a) && i < 32; i++) {
            mt_param_info pi;
            CHECK_OK(mt_model_param_info(a, i, &pi));
            if (!linear_w(pi.name)) {
                if (rigl) CHECK(memcmp(w + pi.offset, w2 + pi.offset, pi.numel * 4) == 0);
                continue;
            }
            unsigned char *now = check_alloc(pi.numel);
            CHECK_OK(mt_model_param_mask(a, i, now, pi.numel));
            size_t changed = 0;
            for (size_t e = 0; e < pi.numel; e++) changed += now[e] != before[i][e];
            if (!rigl) {
                CHECK_EQ(changed, 0);
                continue;
            }
            /* what RigL should have chosen */
            float *sw = check_alloc(pi.numel * 4), *sg = check_alloc(pi.numel * 4);
            uint64_t *keep = calloc(mti_sp_words(pi.numel) + 1, 8);
            size_t kept = 0;
            for (size_t e = 0; e < pi.numel; e++) {
                sw[e] = fabsf(w[pi.offset + e]), sg[e] = fabsf(g[pi.offset + e]);
                if (before[i][e]) keep[e / 64] |= (uint64_t)1 << (e % 64), kept++;
            }
            const size_t k = (size_t)floor(mti_sp_rigl_frac(0.4, step, 5) * (double)kept);
            mti_sp_seg seg = {sw, pi.numel, keep};
            CHECK_OK(mti_sp_prune_smallest(NULL, &seg, 1, (pi.numel - kept) + k));
            unsigned char *dropped = check_alloc(pi.numel);
            for (size_t e = 0; e < pi.numel; e++) dropped[e] = !(keep[e / 64] >> (e % 64) & 1);
            CHECK_OK(mti_sp_grow(NULL, sg, pi.numel, keep, k));
            CHECK(k > 0 && changed > 0 && changed <= 2 * k);
            for (size_t e = 0; e < pi.numel; e++) {
                const int want = (int)(keep[e / 64] >> (e % 64) & 1);
                CHECK_MSG(now[e] == want, "step %d %s[%zu]: %d, RigL's %d", step, pi.name, e, now[e], want);
                const float x = w2[pi.offset + e];
                if (!now[e] || dropped[e]) CHECK_MSG(x == 0.0f, "%s[%zu] = %g", pi.name, e, x); /* grown at 0 */
                else CHECK_EQ(x, w[pi.offset + e]); /* no update in a RigL step */
            }
            free(keep);
            regrew++;
        }
    }
    CHECK(regrew == 16);
    mt_trainer_destroy(ta);
    teardown_pair(ctx, a, b);
}

/* LoRA on a pruned frozen base: the base stays pruned and frozen, only the
 * adapters train, and the step is the same as on the dense base with the
 * zeros. */
TEST(sparse_lora_on_pruned_base)
{
    mt_context *ctx;
    mt_model *b, *a = setup_pair(&ctx, 8, &b);
    mt_prune_config pc = {.method = MT_PRUNE_MAGNITUDE, .sparsity = 0.6};
    CHECK_OKC(ctx, mt_model_prune(a, &pc));
    const size_t n = mt_model_num_params(a);
    float *w = check_alloc(n * 4);
    CHECK_OK(mt_model_get_params(a, w, n));
    CHECK_OK(mt_model_set_params(b, w, n));
    mt_trainer_config tc;
    prune_cfg(&tc, MT_OPT_ADAMW, 0);
    tc.prune.method = MT_PRUNE_NONE;
    tc.lora.rank = 4, tc.lora.alpha = 8.0f;
    mt_trainer *ta, *tb;
    CHECK_OKC(ctx, mt_trainer_create(a, &tc, &ta));
    CHECK_OKC(ctx, mt_trainer_create(b, &tc, &tb));
    float la = 0, lb = 0;
    for (int step = 0; step < 3; step++) {
        int32_t tok[GB * GT], tg[GB * GT];
        mt_batch bt;
        check_token_batch(&bt, tok, tg, GB, GT, GV, step);
        CHECK_OKC(ctx, mt_trainer_step(ta, &bt, &la));
        CHECK_OKC(ctx, mt_trainer_step(tb, &bt, &lb));
        CHECK_EQ(la, lb);
    }
    mt_trainer_destroy(ta);
    mt_trainer_destroy(tb);
    const size_t nl = mt_model_num_params(a);
    float *x = check_alloc(nl * 4), *y = check_alloc(nl * 4);
    CHECK_OK(mt_model_get_params(a, x, nl));
    CHECK_OK(mt_model_get_params(b, y, nl));
    CHECK(memcmp(x, y, nl * 4) == 0); /* the adapters alike, the base unchanged */
    CHECK(memcmp(x, w, n * 4) == 0);
    uint64_t pr, tt;
    CHECK_OK(mt_model_sparsity(a, &pr, &tt));
    CHECK(pr > 0 && pr < tt);
    teardown_pair(ctx, a, b);
}

#include "test_comm.h"

/* Data parallel: the ranks, each on its own rows, prune gradually to the
 * same masks and stay equal bit for bit. */
typedef struct dp_prune {
    tcomm_world *w;
    float *weights[2];
    unsigned char *masks[2];
    size_t n, nmask;
    int bad;
} dp_prune;

static void dp_prune_rank(int rank, void *p)
{
    dp_prune *a = p;
    tcomm_rank k;
    mt_trainer *t = NULL;
    mt_status s = tcomm_gpt_rank(a->w, rank, 2, 0, 16, &k);
    RANK_EXPECT(s == MT_OK);
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 2, tc.optimizer = MT_OPT_ADAMW, tc.lr = 1e-2f;
    tc.prune.method = MT_PRUNE_MAGNITUDE, tc.prune.sparsity = 0.75;
    tc.prune.schedule = MT_PRUNE_GRADUAL, tc.prune.start = 1, tc.prune.end = 5, tc.prune.every = 2;
    if (!s) s = mt_trainer_create(k.m, &tc, &t);
    RANK_EXPECT(s == MT_OK);
    for (int step = 0; step < 6 && !s; step++) {
        int32_t tok[2 * 8], tg[2 * 8];
        for (int i = 0; i < 16; i++) tok[i] = (i * 7 + step * 3 + rank * 11) % 50, tg[i] = (i * 5 + step + rank) % 50;
        mt_batch b = {.n = 2, .tokens = tok, .targets = tg, .seq_len = 8};
        s = mt_trainer_step(t, &b, NULL);
        RANK_EXPECT(s == MT_OK);
    }
    a->n = mt_model_num_params(k.m);
    a->weights[rank] = malloc(a->n * 4);
    a->masks[rank] = malloc(a->n);
    if (!s) s = mt_model_get_params(k.m, a->weights[rank], a->n);
    a->nmask = 0;
    for (int i = 0; !s && i < mt_model_num_tensors(k.m); i++) {
        mt_param_info pi;
        s = mt_model_param_info(k.m, i, &pi);
        if (!s) s = mt_model_param_mask(k.m, i, a->masks[rank] + pi.offset, pi.numel);
    }
    uint64_t pr = 0, tt = 0;
    if (!s) s = mt_model_sparsity(k.m, &pr, &tt);
    RANK_EXPECT(s == MT_OK && tt > 0 && pr == (uint64_t)llround(0.75 * (double)tt));
    mt_trainer_destroy(t);
    tcomm_rank_free(&k);
}

TEST(sparse_data_parallel_ranks_agree)
{
    dp_prune a = {0};
    a.w = tcomm_world_new(2, 30.0);
    tcomm_run(2, dp_prune_rank, &a);
    tcomm_world_free(a.w);
    CHECK(!a.bad);
    CHECK(memcmp(a.weights[0], a.weights[1], a.n * 4) == 0);
    CHECK(memcmp(a.masks[0], a.masks[1], a.n) == 0);
    free(a.weights[0]), free(a.weights[1]), free(a.masks[0]), free(a.masks[1]);
}

/* On a GPU (MT_TEST_GPU=1; the stand-ins' host side under
 * MT_TEST_GPU=standin): a pruned model's gradients and steps are the CPU's,
 * through the CUDA op table's sparse_expand and sparse_compress, pruned at
 * create and again at a step (the state rebuilt on the device); the masks
 * are the CPU's; a training-state file moves between them. */
TEST(gpu_engine_sparse_matches_cpu)
{
    mt_context *ctx[2] = {check_gpu_context(), NULL};
    if (!ctx[0]) return;
    ctx[1] = check_cpu_context(2);
    for (int nm = 0; nm < 2; nm++) {
        float *g[2], loss[2][4];
        size_t n = 0;
        mt_model *m[2];
        for (int d = 0; d < 2; d++) {
            m[d] = check_small_gpt(ctx[d], GV, GT, GC, 19);
            mt_trainer_config tc;
            prune_cfg(&tc, MT_OPT_ADAMW, 0.5);
            if (nm) tc.prune.nm_n = 2, tc.prune.nm_m = 4;
            mt_trainer *t;
            CHECK_OKC(ctx[d], mt_trainer_create(m[d], &tc, &t));
            n = mt_model_num_params(m[d]);
            g[d] = check_alloc(n * 4);
            int32_t tok[GB * GT], tg[GB * GT];
            mt_batch b;
            check_token_batch(&b, tok, tg, GB, GT, GV, 0);
            float l;
            CHECK_OKC(ctx[d], mt_trainer_gradients(t, &b, &l, g[d], n));
            mt_trainer_destroy(t);
            for (int prec = 0; prec < 2; prec++) {
                prune_cfg(&tc, MT_OPT_ADAMW, 0.75);
                tc.precision = prec ? MT_PREC_BF16 : MT_PREC_FP32;
                tc.prune.at = 1; /* a prune between the steps */
                /* (2:4 already; the stand-ins' pruned weights are not numbers: the
                   kernels that made them compute nothing) */
                if (nm || (d == 0 && !check_gpu_values())) tc.prune.method = MT_PRUNE_NONE;
                CHECK_OKC(ctx[d], mt_trainer_create(m[d], &tc, &t));
                for (int s = 0; s < 2; s++) {
                    check_token_batch(&b, tok, tg, GB, GT, GV, s + 1);
                    CHECK_OKC(ctx[d], mt_trainer_step(t, &b, &loss[d][2 * prec + s]));
                }
                mt_trainer_destroy(t);
            }
        }
        check_gpu_near_cpu(g[0], g[1], n, loss[0], loss[1]);
        uint64_t p0, t0, p1, t1;
        CHECK_OK(mt_model_sparsity(m[0], &p0, &t0));
        CHECK_OK(mt_model_sparsity(m[1], &p1, &t1));
        CHECK(p0 > 0 && p1 > 0 && t0 == t1);
        if (check_gpu_values()) CHECK_EQ(p0, p1);
        for (int d = 0; d < 2; d++) CHECK_OK(mt_model_destroy(m[d]));
    }
    CHECK_OK(mt_context_destroy(ctx[0]));
    CHECK_OK(mt_context_destroy(ctx[1]));
}

/* What a model pruned before (by mt_model_prune or an earlier trainer)
 * refuses in a trainer that does not prune, its estimate (the kept counts,
 * to the byte), a merge of adapters over it, and a file whose masks a
 * trainer cannot take; Wanda's estimate plans its prune without its
 * calibration. */
TEST(sparse_pruned_model_later)
{
    mt_context *ctx;
    mt_model *m = setup(&ctx, 23);
    mt_prune_config pc = {.method = MT_PRUNE_MAGNITUDE, .sparsity = 0.9};
    CHECK_OKC(ctx, mt_model_prune(m, &pc));
    mt_trainer_config tc;
    prune_cfg(&tc, MT_OPT_ADAMW, 0);
    tc.prune.method = MT_PRUNE_NONE;
    mt_trainer *t;
    tc.base = MT_BASE_NF4, tc.lora.rank = 4;
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_create(m, &tc, &t));
    CHECK(strstr(mt_last_error(ctx), "the model is pruned"));
    tc.base = MT_BASE_FULL;
    /* the estimate of the pruned model is its run */
    mt_estimate_report est;
    CHECK_OKC(ctx, mt_estimate_model(m, &tc, &est));
    mt_context_reset_peaks(ctx);
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    check_token_steps(ctx, t, GB, GT, GV, 0, 2);
    mt_memory_stats st;
    CHECK_OK(mt_context_memory_stats(ctx, &st));
    CHECK_MSG(st.per_class[MT_MEM_OPTIM].peak_live_bytes == est.class_peak[MT_MEM_OPTIM],
              "OPTIM %llu measured, %llu estimated",
              (unsigned long long)st.per_class[MT_MEM_OPTIM].peak_live_bytes,
              (unsigned long long)est.class_peak[MT_MEM_OPTIM]);
    CHECK_EQ(st.per_class[MT_MEM_GRAD].peak_live_bytes, est.class_peak[MT_MEM_GRAD]);
    mt_trainer_destroy(t);
    /* the adapters are not merged into a pruned weight */
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    mt_trainer_destroy(t);
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_model_lora_merge(m));
    CHECK(strstr(mt_last_error(ctx), "is pruned"));
    /* a file of a pruned 8-bit AdamW run is refused by a dense 8-bit trainer,
       which stays as it was */
    char path[] = "/tmp/mt_sparse_ck8XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    mt_model *a = check_small_gpt(ctx, GV, GT, GC, 24), *b = check_small_gpt(ctx, GV, GT, GC, 24);
    mt_trainer_config t8;
    prune_cfg(&t8, MT_OPT_ADAMW8, 0.5);
    t8.min_8bit_size = 64;
    CHECK_OKC(ctx, mt_trainer_create(a, &t8, &t));
    check_token_steps(ctx, t, GB, GT, GV, 0, 1);
    CHECK_OKC(ctx, mt_trainer_save(t, path, NULL, 0));
    mt_trainer_destroy(t);
    t8.prune.method = MT_PRUNE_NONE;
    CHECK_OKC(ctx, mt_trainer_create(b, &t8, &t));
    CHECK_ST(MT_ERR_UNSUPPORTED, mt_trainer_load(t, path, NULL, 0, NULL));
    CHECK(strstr(mt_last_error(ctx), "trainer is unchanged"));
    uint64_t pr, tt;
    CHECK_OK(mt_model_sparsity(b, &pr, &tt));
    CHECK_EQ(tt, 0);
    CHECK_EQ(mt_trainer_steps(t), 0);
    mt_trainer_destroy(t);
    unlink(path);
    /* Wanda at step 0: the estimate plans the prune, and equals the run */
    mt_context *c2 = check_cpu_context(2);
    mt_model *w = check_small_gpt(c2, GV, GT, GC, 25);
    prune_cfg(&tc, MT_OPT_ADAMW, 0.5);
    tc.prune.method = MT_PRUNE_WANDA, tc.prune.calib = 1;
    CHECK_OKC(c2, mt_estimate_model(w, &tc, &est));
    CHECK_OKC(c2, mt_trainer_create(w, &tc, &t));
    int32_t tok[GB * GT], tg[GB * GT];
    mt_batch bt;
    check_token_batch(&bt, tok, tg, GB, GT, GV, 0);
    CHECK_OKC(c2, mt_trainer_calibrate(t, &bt));
    check_token_steps(c2, t, GB, GT, GV, 0, 2);
    check_estimate_matches(c2, &est, "Wanda at step 0");
    teardown(c2, t, w);
    CHECK_OK(mt_model_destroy(a));
    CHECK_OK(mt_model_destroy(b));
    teardown(ctx, NULL, m);
}

/* RigL's steps wait for the first prune: before it, steps train. */
TEST(sparse_rigl_waits_for_the_prune)
{
    mt_context *ctx;
    mt_model *m = setup(&ctx, 27);
    mt_trainer_config tc;
    prune_cfg(&tc, MT_OPT_ADAMW, 0.5);
    tc.prune.at = 5;
    tc.prune.regrow = MT_REGROW_RIGL;
    tc.prune.regrow_every = 2, tc.prune.regrow_frac = 0.3, tc.prune.regrow_end = 20;
    mt_trainer *t;
    CHECK_OKC(ctx, mt_trainer_create(m, &tc, &t));
    const size_t n = mt_model_num_params(m);
    float *w0 = check_alloc(n * 4), *w1 = check_alloc(n * 4);
    check_token_steps(ctx, t, GB, GT, GV, 0, 2);
    CHECK_OK(mt_model_get_params(m, w0, n));
    check_token_steps(ctx, t, GB, GT, GV, 2, 3); /* after 2 steps: no mask yet, so an update */
    CHECK_OK(mt_model_get_params(m, w1, n));
    CHECK(memcmp(w0, w1, n * 4) != 0);
    teardown(ctx, t, m);
}

/* A creation that fails after its prune gives the model back as it was:
 * dense, every value as before. */
TEST(sparse_failed_create_gives_the_model_back)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU, cc.threads = 1;
    cc.allocators[MT_MEM_OPTIM].limit_bytes = 4096, cc.allocators[MT_MEM_OPTIM].group = 7;
    mt_context *ctx;
    CHECK_OK(mt_context_create(&cc, &ctx));
    mt_model *m = check_small_gpt(ctx, GV, GT, GC, 29);
    const size_t n = mt_model_num_params(m);
    float *w0 = check_alloc(n * 4), *w1 = check_alloc(n * 4);
    CHECK_OK(mt_model_get_params(m, w0, n));
    mt_trainer_config tc;
    prune_cfg(&tc, MT_OPT_ADAMW, 0.5);
    mt_trainer *t;
    CHECK_ST(MT_ERR_OOM, mt_trainer_create(m, &tc, &t));
    uint64_t pr, tt;
    CHECK_OK(mt_model_sparsity(m, &pr, &tt));
    CHECK_EQ(tt, 0);
    CHECK_OK(mt_model_get_params(m, w1, n));
    CHECK(memcmp(w0, w1, n * 4) == 0);
    /* and a model pruned before, pruned further: its masks and values as before */
    mt_prune_config pc = {.method = MT_PRUNE_MAGNITUDE, .sparsity = 0.3};
    CHECK_OKC(ctx, mt_model_prune(m, &pc));
    uint64_t p0, t0;
    CHECK_OK(mt_model_sparsity(m, &p0, &t0));
    CHECK_OK(mt_model_get_params(m, w0, n));
    prune_cfg(&tc, MT_OPT_ADAMW, 0.6);
    CHECK_ST(MT_ERR_OOM, mt_trainer_create(m, &tc, &t));
    CHECK_OK(mt_model_sparsity(m, &pr, &tt));
    CHECK(pr == p0 && tt == t0);
    CHECK_OK(mt_model_get_params(m, w1, n));
    CHECK(memcmp(w0, w1, n * 4) == 0);
    CHECK_OK(mt_model_destroy(m));
    CHECK_OK(mt_context_destroy(ctx));
}
