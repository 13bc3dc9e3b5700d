/*
 * mask.c - pruned tensors' storage and masks (the contract in
 * lib/sparse/sparse.h).
 *
 * The choices select by value with a radix select over the scores' bits
 * (a finite score that is not negative orders as its fp32 bit pattern):
 * three passes of histograms find the k-th smallest key, then one pass
 * prunes every key below it and, in element order, as many equal to it
 * as the count still needs. Nothing is sorted and nothing copied, so a
 * global choice over a whole model takes no memory beyond its masks.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sparse/sparse.h"

static inline int bit_get(const uint64_t *w, size_t e) { return (int)(w[e >> 6] >> (e & 63)) & 1; }
static inline void bit_clr(uint64_t *w, size_t e) { w[e >> 6] &= ~((uint64_t)1 << (e & 63)); }
static inline void bit_set(uint64_t *w, size_t e) { w[e >> 6] |= (uint64_t)1 << (e & 63); }

static int idx_bits(int m)
{
    int b = 1;
    while ((1 << b) < m) b++;
    return b;
}

mt_status mti_sp_layout_of(mt_context *ctx, mti_sp_format fmt, size_t dense, size_t nnz, int n,
                           int m, mti_sp_layout *out)
{
    memset(out, 0, sizeof *out);
    out->fmt = fmt;
    out->dense = dense;
    out->nnz = nnz;
    if (nnz > dense) return mti_fail(ctx, MT_ERR_INVALID_ARG, "sparse: %zu kept of %zu", nnz, dense);
    if (fmt == MTI_SP_BITMAP) {
        out->words = mti_sp_words(dense);
        out->pre = out->words * 8;
        out->pre_n = (dense + MTI_SP_SPAN - 1) / MTI_SP_SPAN;
        out->bytes = (out->pre + 4 * out->pre_n + 7) / 8 * 8;
        return MT_OK;
    }
    if (fmt != MTI_SP_NM) return mti_fail(ctx, MT_ERR_INVALID_ARG, "sparse: unknown format %d", fmt);
    if (m < 2 || m > MTI_SP_MAX_M || n < 1 || n >= m)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "sparse: N:M needs 0 < N < M <= %d (got %d:%d)", MTI_SP_MAX_M, n, m);
    if (dense % (size_t)m)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "sparse: %d:%d needs a multiple of %d elements, not %zu",
                        n, m, m, dense);
    if (nnz != dense / (size_t)m * (size_t)n)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "sparse: %d:%d of %zu keeps %zu, not %zu", n, m,
                        dense, dense / (size_t)m * (size_t)n, nnz);
    out->n = n;
    out->m = m;
    out->bits = idx_bits(m);
    out->bytes = (nnz * (size_t)out->bits + 63) / 64 * 8;
    return MT_OK;
}

size_t mti_sp_kept(const uint64_t *keep, size_t n)
{
    size_t c = 0, w = n / 64;
    for (size_t i = 0; i < w; i++) c += (size_t)__builtin_popcountll(keep[i]);
    if (n & 63) c += (size_t)__builtin_popcountll(keep[w] & (((uint64_t)1 << (n & 63)) - 1));
    return c;
}

/* NM: the place of kept value k in its group. */
static inline unsigned nm_get(const uint8_t *meta, int b, size_t k)
{
    const size_t bit = k * (size_t)b;
    unsigned v = meta[bit >> 3];
    if ((bit & 7) + (size_t)b > 8) v |= (unsigned)meta[(bit >> 3) + 1] << 8;
    return (v >> (bit & 7)) & ((1u << b) - 1);
}

static inline void nm_put(uint8_t *meta, int b, size_t k, unsigned v)
{
    const size_t bit = k * (size_t)b;
    for (int i = 0; i < b; i++)
        if (v >> i & 1) meta[(bit + (size_t)i) >> 3] |= (uint8_t)(1u << ((bit + (size_t)i) & 7));
}

mt_status mti_sp_encode(const mti_sp_layout *L, const uint64_t *keep, void *meta)
{
    memset(meta, 0, L->bytes);
    if (L->fmt == MTI_SP_BITMAP) {
        uint64_t *w = meta;
        memcpy(w, keep, L->words * 8);
        if (L->dense & 63) w[L->words - 1] &= ((uint64_t)1 << (L->dense & 63)) - 1;
        uint32_t *pre = (uint32_t *)((char *)meta + L->pre);
        size_t c = 0;
        for (size_t s = 0; s < L->pre_n; s++) {
            pre[s] = (uint32_t)c;
            const size_t w0 = s * (MTI_SP_SPAN / 64), w1 = w0 + MTI_SP_SPAN / 64;
            for (size_t i = w0; i < w1 && i < L->words; i++) c += (size_t)__builtin_popcountll(w[i]);
        }
        return c == L->nnz ? MT_OK : MT_ERR_INVALID_ARG;
    }
    const size_t groups = L->dense / (size_t)L->m;
    size_t k = 0;
    for (size_t g = 0; g < groups; g++) {
        int c = 0;
        for (int j = 0; j < L->m; j++)
            if (bit_get(keep, g * (size_t)L->m + (size_t)j)) {
                if (++c > L->n) return MT_ERR_INVALID_ARG;
                nm_put(meta, L->bits, k++, (unsigned)j);
            }
        if (c != L->n) return MT_ERR_INVALID_ARG;
    }
    return MT_OK;
}

void mti_sp_decode(const mti_sp_layout *L, const void *meta, uint64_t *keep)
{
    memset(keep, 0, mti_sp_words(L->dense) * 8);
    if (L->fmt == MTI_SP_BITMAP) {
        memcpy(keep, meta, L->words * 8);
        return;
    }
    for (size_t k = 0; k < L->nnz; k++)
        bit_set(keep, k / (size_t)L->n * (size_t)L->m + nm_get(meta, L->bits, k));
}

size_t mti_sp_rank(const mti_sp_layout *L, const void *meta, size_t e)
{
    if (L->fmt == MTI_SP_BITMAP) {
        const uint64_t *w = meta;
        const uint32_t *pre = (const uint32_t *)((const char *)meta + L->pre);
        if (e >= L->dense) return L->nnz;
        size_t c = pre[e / MTI_SP_SPAN];
        for (size_t i = e / MTI_SP_SPAN * (MTI_SP_SPAN / 64); i < e / 64; i++)
            c += (size_t)__builtin_popcountll(w[i]);
        if (e & 63) c += (size_t)__builtin_popcountll(w[e / 64] & (((uint64_t)1 << (e & 63)) - 1));
        return c;
    }
    const size_t g = e / (size_t)L->m, j = e % (size_t)L->m;
    if (g * (size_t)L->m >= L->dense) return L->nnz;
    size_t c = g * (size_t)L->n;
    for (int i = 0; i < L->n; i++)
        if (nm_get(meta, L->bits, g * (size_t)L->n + (size_t)i) < j) c++;
    return c;
}

/* Calls the kept elements of [at, at + len) in order: fn(e, value index). */
#define SP_EACH_KEPT(L, meta, at, len, BODY)                                                      \
    do {                                                                                          \
        size_t r_ = mti_sp_rank(L, meta, at);                                                     \
        if ((L)->fmt == MTI_SP_BITMAP) {                                                          \
            const uint64_t *w_ = (meta);                                                          \
            for (size_t e = (at); e < (at) + (len);) {                                            \
                uint64_t word_ = w_[e >> 6] >> (e & 63);                                          \
                size_t lim_ = 64 - (e & 63);                                                      \
                if (lim_ > (at) + (len) - e) lim_ = (at) + (len) - e;                             \
                if (lim_ < 64) word_ &= ((uint64_t)1 << lim_) - 1;                                \
                while (word_) {                                                                   \
                    const size_t t_ = (size_t)__builtin_ctzll(word_);                             \
                    const size_t ke = e + t_, kv = r_++;                                          \
                    (void)ke;                                                                     \
                    (void)kv;                                                                     \
                    BODY;                                                                         \
                    word_ &= word_ - 1;                                                           \
                }                                                                                 \
                e += lim_;                                                                        \
            }                                                                                     \
        } else {                                                                                  \
            const size_t m_ = (size_t)(L)->m, n_ = (size_t)(L)->n;                                \
            for (size_t g_ = (at) / m_; g_ * m_ < (at) + (len); g_++)                             \
                for (size_t i_ = 0; i_ < n_; i_++) {                                              \
                    const size_t kv = g_ * n_ + i_;                                               \
                    const size_t ke = g_ * m_ + nm_get((const uint8_t *)(meta), (L)->bits, kv);   \
                    if (ke < (at) || ke >= (at) + (len)) continue;                                \
                    BODY;                                                                         \
                }                                                                                 \
            (void)r_;                                                                             \
        }                                                                                         \
    } while (0)

void mti_sp_expand(const mti_sp_layout *L, const void *meta, const void *vals, size_t vbase,
                   size_t es, size_t at, size_t len, void *dense)
{
    char *d = dense;
    const char *v = vals;
    memset(d, 0, len * es);
    SP_EACH_KEPT(L, meta, at, len, memcpy(d + (ke - at) * es, v + (kv - vbase) * es, es));
}

void mti_sp_csr_rows(const mti_sp_layout *L, const void *meta, size_t cols, size_t r0, size_t r1,
                     size_t *ptr, int32_t *idx)
{
    for (size_t r = r0; r < r1; r++) {
        const size_t at = r * cols;
        ptr[r] = mti_sp_rank(L, meta, at);
        SP_EACH_KEPT(L, meta, at, cols, idx[kv] = (int32_t)(ke - at));
    }
}

void mti_sp_compress(const mti_sp_layout *L, const void *meta, const void *dense, size_t es,
                     size_t at, size_t len, void *vals, size_t vbase, int add)
{
    const char *d = dense;
    char *v = vals;
    if (add) {
        const float *df = dense;
        float *vf = vals;
        SP_EACH_KEPT(L, meta, at, len, vf[kv - vbase] += df[ke - at]);
        return;
    }
    SP_EACH_KEPT(L, meta, at, len, memcpy(v + (kv - vbase) * es, d + (ke - at) * es, es));
}

/* ---- choosing masks ---- */

size_t mti_sp_count(double s, size_t n) { return (size_t)rint(s * (double)n); }

/* A score's key: its bits, which order as the values do (finite, not
 * negative; -0 is 0). */
static inline uint32_t key_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return x == 0.0f ? 0u : u;
}

/* A segment with its mask's first bit (rows of one tensor share a mask). */
typedef struct seg {
    const float *score;
    size_t n, bit0;
    uint64_t *keep; /* NULL: every element kept, and this choice makes no mask */
} seg;

static mt_status check_scores(mt_context *ctx, const seg *s, int ns)
{
    for (int i = 0; i < ns; i++)
        for (size_t e = 0; e < s[i].n; e++)
            if (!(s[i].score[e] >= 0.0f) || isinf(s[i].score[e]))
                return mti_fail(ctx, MT_ERR_INVALID_ARG,
                                "prune: score %g of element %zu (tensor %d of the choice) is "
                                "negative or not finite",
                                (double)s[i].score[e], e, i);
    return MT_OK;
}

static inline int kept_in(const seg *s, size_t e) { return bit_get(s->keep, s->bit0 + e); }

/* The k smallest kept scores over s pruned (see the file's comment); with
 * largest, the k largest (each key taken as its complement). */
static void select_kx(seg *s, int ns, size_t k, bool largest);
static void select_k(seg *s, int ns, size_t k) { select_kx(s, ns, k, false); }

static inline uint32_t key_in(float x, bool largest) { return largest ? ~key_of(x) : key_of(x); }

static void select_kx(seg *s, int ns, size_t k, bool largest)
{
    size_t pruned = 0;
    for (int i = 0; i < ns; i++)
        for (size_t e = 0; e < s[i].n; e++) pruned += !kept_in(&s[i], e);
    if (k <= pruned) return;
    size_t need = k - pruned;
    static const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    uint32_t prefix = 0, known = 0;
    size_t hist[2048];
    for (int p = 0; p < 3; p++) {
        const uint32_t nb = 1u << width[p];
        memset(hist, 0, nb * sizeof hist[0]);
        for (int i = 0; i < ns; i++)
            for (size_t e = 0; e < s[i].n; e++) {
                const uint32_t key = key_in(s[i].score[e], largest);
                if ((key & known) == prefix && kept_in(&s[i], e)) hist[(key >> shift[p]) & (nb - 1)]++;
            }
        uint32_t b = 0;
        while (hist[b] < need) need -= hist[b++];
        prefix |= b << shift[p];
        known |= (nb - 1) << shift[p];
    }
    /* prefix is the k-th smallest key: below it all go, of it `need` */
    for (int i = 0; i < ns; i++)
        for (size_t e = 0; e < s[i].n; e++) {
            if (!kept_in(&s[i], e)) continue;
            const uint32_t key = key_in(s[i].score[e], largest);
            if (key < prefix || (key == prefix && need && need--)) bit_clr(s[i].keep, s[i].bit0 + e);
        }
}

mt_status mti_sp_prune_smallest(mt_context *ctx, mti_sp_seg *segs, int nseg, size_t k)
{
    seg *s = calloc((size_t)(nseg > 0 ? nseg : 1), sizeof *s);
    if (!s) return mti_fail(ctx, MT_ERR_OOM, "prune: out of host memory");
    size_t total = 0;
    for (int i = 0; i < nseg; i++) {
        s[i] = (seg){segs[i].score, segs[i].n, 0, segs[i].keep};
        total += segs[i].n;
    }
    mt_status st = check_scores(ctx, s, nseg);
    if (!st) select_k(s, nseg, k < total ? k : total);
    free(s);
    return st;
}

mt_status mti_sp_grow(mt_context *ctx, const float *score, size_t n, uint64_t *keep, size_t k)
{
    const size_t words = mti_sp_words(n);
    uint64_t *cand = calloc(words + 1, 8);
    if (!cand) return mti_fail(ctx, MT_ERR_OOM, "grow: out of host memory");
    for (size_t w = 0; w < words; w++) cand[w] = ~keep[w];
    if (n & 63) cand[words - 1] &= ((uint64_t)1 << (n & 63)) - 1;
    seg one = {score, n, 0, cand};
    mt_status s = check_scores(ctx, &one, 1);
    size_t c = mti_sp_kept(cand, n); /* the candidates; all of them pruned: "grown" */
    if (!s) {
        /* select_kx prunes what it picks beyond what the mask prunes: count
           the kept (the grown) as pruned already */
        select_kx(&one, 1, (n - c) + (k < c ? k : c), true);
        for (size_t w = 0; w < words; w++) keep[w] |= ~keep[w] & ~cand[w];
        if (n & 63) keep[words - 1] &= ((uint64_t)1 << (n & 63)) - 1;
    }
    free(cand);
    return s;
}

mt_status mti_sp_prune_rows(mt_context *ctx, const float *score, int64_t rows, int64_t cols,
                            size_t k, uint64_t *keep)
{
    seg one = {score, (size_t)rows * (size_t)cols, 0, keep};
    mt_status s;
    MTI_TRY(check_scores(ctx, &one, 1));
    for (int64_t r = 0; r < rows; r++) {
        seg row = {score + r * cols, (size_t)cols, (size_t)(r * cols), keep};
        select_k(&row, 1, k < (size_t)cols ? k : (size_t)cols);
    }
    return MT_OK;
}

mt_status mti_sp_prune_nm(mt_context *ctx, const float *score, size_t dense, int n, int m,
                          uint64_t *keep)
{
    seg one = {score, dense, 0, keep};
    mt_status s;
    MTI_TRY(check_scores(ctx, &one, 1));
    if (m < 2 || m > MTI_SP_MAX_M || n < 1 || n >= m || dense % (size_t)m)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "prune: %d:%d does not fit %zu elements", n, m,
                        dense);
    memset(keep, 0, mti_sp_words(dense) * 8);
    for (size_t g = 0; g < dense; g += (size_t)m)
        for (int j = 0; j < m; j++) {
            const float x = score[g + (size_t)j];
            int beaten = 0; /* by a larger score, or an equal one earlier */
            for (int i = 0; i < m; i++) {
                const float y = score[g + (size_t)i];
                beaten += y > x || (y == x && i < j);
            }
            if (beaten < n) bit_set(keep, g + (size_t)j);
        }
    return MT_OK;
}

/* ---- when ---- */

double mti_sp_gradual(double sf, int64_t a, int64_t b, int64_t t)
{
    if (t < a) return 0.0;
    if (t >= b) return sf;
    const double r = 1.0 - (double)(t - a) / (double)(b - a);
    return sf * (1.0 - r * r * r);
}

double mti_sp_rigl_frac(double f, int64_t t, int64_t t_end)
{
    if (t >= t_end || t_end <= 0) return 0.0;
    return f / 2.0 * (1.0 + cos(M_PI * (double)t / (double)t_end));
}
