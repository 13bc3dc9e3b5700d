/*
 * attention.c - causal self-attention that never stores the (T,T) scores.
 *
 * Forward, per (batch, head) and block of queries: the keys 0..t are visited
 * in blocks; each query row keeps a running maximum m and a running sum l of
 * exp(score - m), rescales its output accumulator whenever m grows, and ends
 * with out = acc / l and lse = m + log(l) (fp32, (B,H,T)). That one float per
 * row is all the backward needs to rebuild any probability as
 * p = exp(score - lse).
 *
 * Backward (the FlashAttention-2 scheme): D_t = dout_t . out_t per query row;
 * then for each pair of a query block and a key block at or below it,
 * recompute P (from q, k and lse) and dP = dout v^T, form
 * dS = P * (dP - D), and accumulate dV += P^T dout, dK += dS^T q,
 * dQ += dS K (dq scaled at the end).
 *
 * Work is split over (b,h) pairs, each thread owning a whole head so no sum
 * is shared. When there are fewer heads than threads, it is split over
 * (head, block) items instead: query blocks in the forward; in the backward a
 * pass over key blocks (dK, dV) and a pass over query blocks (dQ), which
 * recomputes P and dS once more. Every accumulator is summed in the same
 * order in both schemes, and no loop sums across vector lanes, so results are
 * bit-identical for any thread count.
 *
 * A head is copied into fp32 buffers first (queries pre-scaled by 1/sqrt(hs),
 * keys and values also as columns), padded to whole blocks of ATT_BLK rows
 * and rows of a multiple of 16 floats, so the block products below have no
 * edge cases: padded rows and columns are zero and masked. Workspace (WORK
 * allocator): per head being worked on (min(B H, threads) of them) 2 (fwd)
 * or 8 (bwd) times Tp x hsp floats, plus a few blocks per thread.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu_ops.h"
#include "vecmath.h"

/* Queries and keys per block: a (64,64) block of scores is 16 KiB. */
#define ATT_BLK 64

/* The hot loops are compiled once per level (arch.h: MTI_VEC_VOID) and
 * the level in use picks one. Every copy does the same multiplies and adds
 * per lane (no FMA), so the bits do not depend on the CPU. */
#if defined(__GNUC__) || defined(__clang__)
#define ATT_INLINE __attribute__((always_inline)) inline
#else
#define ATT_INLINE inline
#endif

typedef struct att_args {
    int B, T, C, H, hs;
    int Tp, hsp;  /* T rounded up to ATT_BLK, hs up to 16 */
    float scale;  /* 1/sqrt(hs) */
    mti_dtype dt;
} att_args;

static int mini(int a, int b) { return a < b ? a : b; }
static int round_up(int n, int m) { return (n + m - 1) / m * m; }

/* ---- exp ---- */

/* c ? a : b on the bits: GCC keeps a `?:` between floating-point values as a
 * branch, and a branch stops a loop from vectorising. */
static ATT_INLINE float fsel(int c, float a, float b)
{
    uint32_t m = 0u - (uint32_t)(c != 0);
    return float_of((bits_of(a) & m) | (bits_of(b) & ~m));
}

/* e^x in fp32 from basic operations only, so a loop of it vectorises and
 * every lane (and every CPU) gives the same bits; within 1.3 ulp of e^x. x =
 * n ln2 + r with |r| <= ln2/2 (ln2 split in two so n ln2 is exact), e^r by
 * its Taylor series to r^7 (truncation below 2^-27), times 2^n built in the
 * exponent bits (in two steps at n = 128). Results below 2^-126 flush to 0
 * (x < -87.33, and -inf); x > 88.7228 gives inf; NaN stays NaN. */
static ATT_INLINE float att_exp(float x)
{
    const float lo = -87.33f, hi = 88.7228f;
    const float big = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float xc = fsel(x < lo, lo, x);
    xc = fsel(xc > hi, hi, xc);
    xc = fsel(x != x, 0.0f, xc);
    float t = xc * 1.44269504f + big; /* x log2(e), rounded, in the low bits of t */
    float n = t - big;
    int32_t ni = (int32_t)(bits_of(t) - bits_of(big));
    float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f; /* ln2 = hi + lo parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    p = fsel(ni > 127, p * 2.0f, p);
    ni = ni > 127 ? 127 : ni;
    float e = p * float_of((uint32_t)(ni + 127) << 23);
    e = fsel(x < lo, 0.0f, e);
    e = fsel(x > hi, INFINITY, e);
    return fsel(x != x, x, e);
}

/* ---- block products ---- */

/* C (4,16) at c (leading dimension ldc) = (zero ? 0 : C) + sum over k < K of
 * A(i,k) B(k,:), in order of k, one multiply and one add per term; A(i,k) is
 * a[i ra + k ca], row k of B is at b + k ldb. Each lane does the same
 * multiply and add however the rows are cut into vectors, so every copy
 * below gives the same bits. */
#if defined(__GNUC__) || defined(__clang__)
/* A row of the piece as two 8-float vectors: one register each in the AVX2
 * and AVX-512 copies. (A 16-float vector, one AVX-512 register, is what gcc
 * lowers badly for AVX2: through memory and general registers, at a fifth
 * of this speed; 8-float vectors are as bad for the baseline, whose copy
 * takes the 16-float form, split into four SSE registers.) Macros, not
 * functions: a function returning a vector has a different ABI per copy. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
#define LDV(v, p) memcpy(&(v), (p), sizeof(v))
#define STV(p, v) memcpy((p), &(v), sizeof(v))
#define BC8(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})
#define BC16(x)                                                                             \
    ((v16){(x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x)})

static ATT_INLINE void mk4x16_w8(float *c, size_t ldc, const float *a, size_t ra, size_t ca,
                                 const float *b, size_t ldb, int K, int zero)
{
    v8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};
    if (!zero) {
        LDV(c0, c), LDV(d0, c + 8);
        LDV(c1, c + ldc), LDV(d1, c + ldc + 8);
        LDV(c2, c + 2 * ldc), LDV(d2, c + 2 * ldc + 8);
        LDV(c3, c + 3 * ldc), LDV(d3, c + 3 * ldc + 8);
    }
    for (int k = 0; k < K; k++) {
        const float *ak = a + (size_t)k * ca;
        const float x0 = ak[0], x1 = ak[ra], x2 = ak[2 * ra], x3 = ak[3 * ra];
        v8 bk, bl;
        LDV(bk, b + (size_t)k * ldb);
        LDV(bl, b + (size_t)k * ldb + 8);
        c0 += BC8(x0) * bk, d0 += BC8(x0) * bl;
        c1 += BC8(x1) * bk, d1 += BC8(x1) * bl;
        c2 += BC8(x2) * bk, d2 += BC8(x2) * bl;
        c3 += BC8(x3) * bk, d3 += BC8(x3) * bl;
    }
    STV(c, c0), STV(c + 8, d0);
    STV(c + ldc, c1), STV(c + ldc + 8, d1);
    STV(c + 2 * ldc, c2), STV(c + 2 * ldc + 8, d2);
    STV(c + 3 * ldc, c3), STV(c + 3 * ldc + 8, d3);
}

static ATT_INLINE void mk4x16_w16(float *c, size_t ldc, const float *a, size_t ra, size_t ca,
                                  const float *b, size_t ldb, int K, int zero)
{
    v16 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
    if (!zero) {
        LDV(c0, c);
        LDV(c1, c + ldc);
        LDV(c2, c + 2 * ldc);
        LDV(c3, c + 3 * ldc);
    }
    for (int k = 0; k < K; k++) {
        const float *ak = a + (size_t)k * ca;
        const float x0 = ak[0], x1 = ak[ra], x2 = ak[2 * ra], x3 = ak[3 * ra];
        v16 bk;
        LDV(bk, b + (size_t)k * ldb);
        c0 += BC16(x0) * bk;
        c1 += BC16(x1) * bk;
        c2 += BC16(x2) * bk;
        c3 += BC16(x3) * bk;
    }
    STV(c, c0);
    STV(c + ldc, c1);
    STV(c + 2 * ldc, c2);
    STV(c + 3 * ldc, c3);
}

/* the piece in the form of the copy's level (a constant in each copy) */
static ATT_INLINE void mk4x16(int vl, float *c, size_t ldc, const float *a, size_t ra, size_t ca,
                              const float *b, size_t ldb, int K, int zero)
{
    if (vl >= 1) mk4x16_w8(c, ldc, a, ra, ca, b, ldb, K, zero);
    else mk4x16_w16(c, ldc, a, ra, ca, b, ldb, K, zero);
}
#else
static ATT_INLINE void mk4x16(int vl, float *c, size_t ldc, const float *a, size_t ra, size_t ca,
                              const float *b, size_t ldb, int K, int zero)
{
    (void)vl;
    float acc[4][16];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 16; j++) acc[i][j] = zero ? 0.0f : c[(size_t)i * ldc + j];
    for (int k = 0; k < K; k++)
        for (int i = 0; i < 4; i++) {
            float av = a[(size_t)i * ra + (size_t)k * ca];
            for (int j = 0; j < 16; j++) acc[i][j] += av * b[(size_t)k * ldb + j];
        }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 16; j++) c[(size_t)i * ldc + j] = acc[i][j];
}
#endif

/* C (m,n) (+)= A (m,K) B (K,n) by (4,16) pieces; m % 4 == 0, n % 16 == 0;
 * vl: the level of the copy (arch.h). */
static ATT_INLINE void block_mm(int vl, float *c, size_t ldc, const float *a, size_t ra,
                                size_t ca, const float *b, size_t ldb, int m, int n, int K,
                                int zero)
{
    for (int i = 0; i < m; i += 4)
        for (int j = 0; j < n; j += 16)
            mk4x16(vl, c + (size_t)i * ldc + (size_t)j, ldc, a + (size_t)i * ra, ra, ca, b + j,
                   ldb, K, zero);
}

/* ---- loading a head ---- */

/* Element offset of row t of head h in a tensor of rows of `width` elements
 * (3C for qkv, C for out and dout), `part` C-sized parts in. */
static size_t row_at(const att_args *a, int b, int t, int h, int width, int part)
{
    return ((size_t)b * (size_t)a->T + (size_t)t) * (size_t)width + (size_t)part * (size_t)a->C +
           (size_t)h * (size_t)a->hs;
}

/* dst (Tp,hsp) fp32 = the head's rows times mul, zero padded. */
static void load_rows(float *dst, const void *src, const att_args *a, int b, int h, int width,
                      int part, float mul)
{
    memset(dst, 0, (size_t)a->Tp * (size_t)a->hsp * sizeof(float));
    for (int t = 0; t < a->T; t++) {
        float *r = dst + (size_t)t * (size_t)a->hsp;
        mti_cpu_load_f32(r, src, a->dt, row_at(a, b, t, h, width, part), (size_t)a->hs);
        if (mul != 1.0f)
            for (int d = 0; d < a->hs; d++) r[d] *= mul;
    }
}

/* dst (hs,Tp) fp32 = the head's rows as columns, zero padded; row: hs floats. */
static void load_cols(float *dst, float *row, const void *src, const att_args *a, int b, int h,
                      int width, int part)
{
    size_t Tp = (size_t)a->Tp;
    memset(dst, 0, (size_t)a->hs * Tp * sizeof(float));
    for (int t = 0; t < a->T; t++) {
        mti_cpu_load_f32(row, src, a->dt, row_at(a, b, t, h, width, part), (size_t)a->hs);
        for (int d = 0; d < a->hs; d++) dst[(size_t)d * Tp + (size_t)t] = row[d];
    }
}

/* ---- forward ---- */

typedef struct fwd_head {
    float *kt; /* (hs,Tp) keys as columns */
    float *v;  /* (Tp,hsp) */
} fwd_head;

static size_t rows_floats(const att_args *a) { return (size_t)a->Tp * (size_t)a->hsp; }
static size_t cols_floats(const att_args *a) { return (size_t)a->hs * (size_t)a->Tp; }

static size_t fwd_head_floats(const att_args *a) { return cols_floats(a) + rows_floats(a); }

/* Per thread: q and o blocks (BLK,hsp), scores (BLK,BLK), m and l (BLK), a row. */
static size_t fwd_thread_floats(const att_args *a)
{
    return 2 * (size_t)ATT_BLK * (size_t)a->hsp + (size_t)ATT_BLK * ATT_BLK + 2 * ATT_BLK +
           (size_t)a->hsp;
}

static fwd_head fwd_head_at(float *hb, const att_args *a)
{
    fwd_head f = {hb, hb + cols_floats(a)};
    return f;
}

static void fwd_load(const fwd_head *fh, float *row, const void *qkv, const att_args *a, int b,
                     int h)
{
    load_cols(fh->kt, row, qkv, a, b, h, 3 * a->C, 1);
    load_rows(fh->v, qkv, a, b, h, 3 * a->C, 2, 1.0f);
}

/* One block of queries (qb) of head (b,h): out rows and lse. */
MTI_VEC_VOID_L(fwd_block, (void *out, float *lse, const void *qkv, const att_args *a, int b, int h,
                         const fwd_head *fh, int qb, float *scr),
             (out, lse, qkv, a, b, h, fh, qb, scr))
{
    const int hs = a->hs, hsp = a->hsp, T = a->T;
    const int i0 = qb * ATT_BLK, nq = mini(ATT_BLK, T - i0), mr = round_up(nq, 4);
    float *q = scr;                            /* (BLK,hsp) queries, scaled */
    float *o = q + (size_t)ATT_BLK * hsp;      /* (BLK,hsp) output accumulators */
    float *s = o + (size_t)ATT_BLK * hsp;      /* (BLK,BLK) scores, then p */
    float *m = s + ATT_BLK * ATT_BLK, *l = m + ATT_BLK; /* running max, sum */
    float *row = l + ATT_BLK;

    memset(q, 0, (size_t)ATT_BLK * hsp * sizeof(float));
    memset(o, 0, (size_t)ATT_BLK * hsp * sizeof(float));
    for (int r = 0; r < nq; r++) {
        float *qr = q + (size_t)r * hsp;
        mti_cpu_load_f32(qr, qkv, a->dt, row_at(a, b, i0 + r, h, 3 * a->C, 0), (size_t)hs);
        const float scale = a->scale; /* (held: qr might alias *a) */
#pragma omp simd
        for (int d = 0; d < hs; d++) qr[d] *= scale;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }

    for (int kb = 0; kb <= qb; kb++) {
        const int j0 = kb * ATT_BLK, nk = mini(ATT_BLK, T - j0);
        block_mm(vec_level, s, ATT_BLK, q, (size_t)hsp, 1, fh->kt + j0, (size_t)a->Tp, mr,
                 ATT_BLK, hs, 1);
        for (int r = 0; r < mr; r++) {
            float *sr = s + (size_t)r * ATT_BLK, *orow = o + (size_t)r * hsp;
            const int nv = r < nq ? mini(nk, i0 + r - j0 + 1) : 0; /* keys j0..t */
            if (nv > 0) {
                float mx = sr[0];
                for (int c = 1; c < nv; c++) mx = sr[c] > mx ? sr[c] : mx;
                const float mnew = mx > m[r] ? mx : m[r];
                const float alpha = att_exp(m[r] - mnew); /* 0 on the first block (m = -inf) */
#pragma omp simd
                for (int c = 0; c < nv; c++) sr[c] = att_exp(sr[c] - mnew);
                float sum = 0.0f; /* in order of keys */
                for (int c = 0; c < nv; c++) sum += sr[c];
                l[r] = l[r] * alpha + sum;
                m[r] = mnew;
                if (alpha != 1.0f) {
#pragma omp simd
                    for (int d = 0; d < hsp; d++) orow[d] *= alpha;
                }
            }
            for (int c = nv; c < ATT_BLK; c++) sr[c] = 0.0f;
        }
        /* o += p v, over the keys of the block in order */
        block_mm(vec_level, o, (size_t)hsp, s, ATT_BLK, 1, fh->v + (size_t)j0 * hsp, (size_t)hsp,
                 mr, hsp, nk, 0);
    }

    float *lrow = lse + ((size_t)b * (size_t)a->H + (size_t)h) * (size_t)T;
    for (int r = 0; r < nq; r++) {
        const float *orow = o + (size_t)r * hsp, lr = l[r]; /* (held: row might alias l) */
#pragma omp simd
        for (int d = 0; d < hs; d++) row[d] = orow[d] / lr;
        mti_cpu_store_f32(out, a->dt, row_at(a, b, i0 + r, h, a->C, 0), row, (size_t)hs);
        lrow[i0 + r] = m[r] + logf(l[r]);
    }
}

static mt_status check_args(const mti_kctx *k, const char *op, int B, int T, int C, int H,
                            mti_dtype dt, att_args *a)
{
    if (B < 0 || T < 0 || C < 0 || H <= 0 || C % H != 0 ||
        (dt != MTI_F32 && dt != MTI_F16 && dt != MTI_BF16))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "%s: bad shape B %d T %d C %d H %d (C must be a multiple of H) or dtype %d",
                        op, B, T, C, H, (int)dt);
    int hs = C / H;
    att_args v = {B, T, C, H, hs, round_up(T, ATT_BLK), round_up(hs, 16),
                  hs ? 1.0f / sqrtf((float)hs) : 0.0f, dt};
    *a = v;
    return MT_OK;
}

/* A pass's workspace: per-head and per-thread scratch in one block. A dry
 * run (lib/engine/estimate.c) takes it and gives it back, and *dry says there is
 * nothing more to do. */
static mt_status att_work(const mti_kctx *k, int heads, size_t head_f, int nt, size_t thr_f,
                          mt_block *blk, bool *dry)
{
    *dry = false;
    mt_status s =
        mti_work_alloc(k, ((size_t)heads * head_f + (size_t)nt * thr_f) * sizeof(float), blk);
    if (!s && mti_dry(k)) {
        mti_work_free(k, blk);
        *dry = true;
    }
    return s;
}

mt_status mti_cpu_attention_fwd(const mti_kctx *k, void *out, float *lse, const void *qkv, int B,
                                int T, int C, int H, mti_dtype dt)
{
    att_args a;
    mt_status s = check_args(k, "attention_fwd", B, T, C, H, dt, &a);
    if (s || B == 0 || T == 0 || C == 0) return s;
    const int nt = mti_cpu_threads(k), BH = B * H, nqb = a.Tp / ATT_BLK;
    const int split = BH < nt; /* fewer heads than threads: split heads by query block */
    const int heads = split ? BH : nt;
    const size_t head_f = fwd_head_floats(&a), thr_f = fwd_thread_floats(&a);

    mt_block blk;
    bool dry;
    if ((s = att_work(k, heads, head_f, nt, thr_f, &blk, &dry)) || dry) return s;
    float *base = blk.ptr, *thr_base = base + (size_t)heads * head_f;

    if (!split) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int bh = 0; bh < BH; bh++) {
            int me = omp_get_thread_num();
            float *scr = thr_base + (size_t)me * thr_f;
            fwd_head fh = fwd_head_at(base + (size_t)me * head_f, &a);
            fwd_load(&fh, scr, qkv, &a, bh / H, bh % H);
            for (int qb = 0; qb < nqb; qb++)
                fwd_block(out, lse, qkv, &a, bh / H, bh % H, &fh, qb, scr);
        }
    } else {
#pragma omp parallel num_threads(nt)
        {
            float *scr = thr_base + (size_t)omp_get_thread_num() * thr_f;
#pragma omp for schedule(static)
            for (int bh = 0; bh < BH; bh++) {
                fwd_head fh = fwd_head_at(base + (size_t)bh * head_f, &a);
                fwd_load(&fh, scr, qkv, &a, bh / H, bh % H);
            }
            /* the longest blocks (last queries) first */
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < BH * nqb; it++) {
                int bh = it % BH, qb = nqb - 1 - it / BH;
                fwd_head fh = fwd_head_at(base + (size_t)bh * head_f, &a);
                fwd_block(out, lse, qkv, &a, bh / H, bh % H, &fh, qb, scr);
            }
        }
    }
    mti_work_free(k, &blk);
    return MT_OK;
}

/* ---- backward ---- */

/* What the backward keeps per head in flight, all fp32. */
typedef struct bwd_head {
    float *q;            /* (Tp,hsp) queries times the scale */
    float *k;            /* (Tp,hsp) */
    float *dout;         /* (Tp,hsp) */
    float *dq, *dk, *dv; /* (Tp,hsp) accumulators; dq without the scale until stored */
    float *kt, *vt;      /* (hs,Tp) keys and values as columns */
    float *D;            /* (Tp) dout_t . out_t */
    const float *lse;    /* (T) the forward's */
} bwd_head;

static size_t bwd_head_floats(const att_args *a)
{
    return 6 * rows_floats(a) + 2 * cols_floats(a) + (size_t)a->Tp;
}

/* Per thread: P and dS blocks (BLK,BLK) and two rows. */
static size_t bwd_thread_floats(const att_args *a)
{
    return 2 * (size_t)ATT_BLK * ATT_BLK + 2 * (size_t)a->hsp;
}

static bwd_head bwd_head_at(float *hb, const float *lse, const att_args *a, int bh)
{
    size_t r = rows_floats(a), c = cols_floats(a);
    bwd_head h = {hb,         hb + r,         hb + 2 * r,         hb + 3 * r,
                  hb + 4 * r, hb + 5 * r,     hb + 6 * r,         hb + 6 * r + c,
                  hb + 6 * r + 2 * c, lse + (size_t)bh * (size_t)a->T};
    return h;
}

/* Loads head (b,h), computes D, zeroes the accumulators. row, row2: hsp floats. */
static void bwd_load(const bwd_head *hd, float *row, float *row2, const void *dout,
                     const void *qkv, const void *out, const att_args *a, int b, int h)
{
    const int hs = a->hs, w3 = 3 * a->C;
    load_rows(hd->q, qkv, a, b, h, w3, 0, a->scale);
    load_rows(hd->k, qkv, a, b, h, w3, 1, 1.0f);
    load_rows(hd->dout, dout, a, b, h, a->C, 0, 1.0f);
    load_cols(hd->kt, row, qkv, a, b, h, w3, 1);
    load_cols(hd->vt, row, qkv, a, b, h, w3, 2);
    memset(hd->D, 0, (size_t)a->Tp * sizeof(float));
    for (int t = 0; t < a->T; t++) {
        const float *g = hd->dout + (size_t)t * (size_t)a->hsp;
        mti_cpu_load_f32(row2, out, a->dt, row_at(a, b, t, h, a->C, 0), (size_t)hs);
        float sum = 0.0f; /* in order of d */
        for (int d = 0; d < hs; d++) sum += g[d] * row2[d];
        hd->D[t] = sum;
    }
    size_t n = rows_floats(a) * sizeof(float);
    memset(hd->dq, 0, n);
    memset(hd->dk, 0, n);
    memset(hd->dv, 0, n);
}

/* dqkv rows of head (b,h) = the accumulators rounded to dt, dq scaled. */
static void bwd_store(void *dqkv, const bwd_head *hd, float *row, const att_args *a, int b, int h)
{
    const int hs = a->hs, w3 = 3 * a->C;
    const float scale = a->scale, *dq = hd->dq; /* (held: row might alias them) */
    for (int t = 0; t < a->T; t++) {
        size_t r = (size_t)t * (size_t)a->hsp;
#pragma omp simd
        for (int d = 0; d < hs; d++) row[d] = dq[r + d] * scale;
        mti_cpu_store_f32(dqkv, a->dt, row_at(a, b, t, h, w3, 0), row, (size_t)hs);
        mti_cpu_store_f32(dqkv, a->dt, row_at(a, b, t, h, w3, 1), hd->dk + r, (size_t)hs);
        mti_cpu_store_f32(dqkv, a->dt, row_at(a, b, t, h, w3, 2), hd->dv + r, (size_t)hs);
    }
}

/* Query block qb against key block kb: P (BLK,BLK) = exp(q k^T - lse) and
 * dS = P (dout v^T - D), zero where a key is after the query or past T. The
 * one place both are computed, so both work splits see the same values.
 * Returns the query rows to use (a multiple of 4). */
static ATT_INLINE int bwd_pds(int vl, float *P, float *dS, const bwd_head *hd, const att_args *a,
                              int qb, int kb)
{
    const int T = a->T, i0 = qb * ATT_BLK, j0 = kb * ATT_BLK;
    const int nq = mini(ATT_BLK, T - i0), mr = round_up(nq, 4), nk = mini(ATT_BLK, T - j0);
    const size_t hsp = (size_t)a->hsp, Tp = (size_t)a->Tp;
    block_mm(vl, P, ATT_BLK, hd->q + (size_t)i0 * hsp, hsp, 1, hd->kt + j0, Tp, mr, ATT_BLK, a->hs,
             1);
    block_mm(vl, dS, ATT_BLK, hd->dout + (size_t)i0 * hsp, hsp, 1, hd->vt + j0, Tp, mr, ATT_BLK,
             a->hs, 1);
    for (int r = 0; r < mr; r++) {
        const int t = i0 + r, nv = r < nq ? mini(nk, t - j0 + 1) : 0;
        float *pr = P + (size_t)r * ATT_BLK, *sr = dS + (size_t)r * ATT_BLK;
        if (nv > 0) {
            const float lse = hd->lse[t], D = hd->D[t];
#pragma omp simd
            for (int c = 0; c < nv; c++) {
                pr[c] = att_exp(pr[c] - lse);
                sr[c] = pr[c] * (sr[c] - D);
            }
        }
        for (int c = nv; c < ATT_BLK; c++) pr[c] = sr[c] = 0.0f;
    }
    return mr;
}

/* dV and dK of key block kb += P^T dout and dS^T q of query block qb, the
 * query rows in order. */
static ATT_INLINE void bwd_acc_dkdv(int vl, const bwd_head *hd, const att_args *a, int qb, int kb,
                                   const float *P, const float *dS, int mr)
{
    const int j0 = kb * ATT_BLK, mk = round_up(mini(ATT_BLK, a->T - j0), 4);
    const size_t hsp = (size_t)a->hsp, i0 = (size_t)qb * ATT_BLK;
    block_mm(vl, hd->dv + (size_t)j0 * hsp, hsp, P, 1, ATT_BLK, hd->dout + i0 * hsp, hsp, mk,
             a->hsp, mr, 0);
    block_mm(vl, hd->dk + (size_t)j0 * hsp, hsp, dS, 1, ATT_BLK, hd->q + i0 * hsp, hsp, mk, a->hsp,
             mr, 0);
}

/* dQ of query block qb += dS k of key block kb, the keys in order. */
static ATT_INLINE void bwd_acc_dq(int vl, const bwd_head *hd, const att_args *a, int qb, int kb,
                                  const float *dS, int mr)
{
    const int j0 = kb * ATT_BLK, nk = mini(ATT_BLK, a->T - j0);
    const size_t hsp = (size_t)a->hsp, i0 = (size_t)qb * ATT_BLK;
    block_mm(vl, hd->dq + i0 * hsp, hsp, dS, ATT_BLK, 1, hd->k + (size_t)j0 * hsp, hsp, mr, a->hsp,
             nk, 0);
}

/* Keys of block kb: dK and dV from every query block that sees them, in order. */
MTI_VEC_VOID_L(bwd_dkdv, (const bwd_head *hd, const att_args *a, int kb, float *P, float *dS),
             (hd, a, kb, P, dS))
{
    for (int qb = kb; qb < a->Tp / ATT_BLK; qb++) {
        int mr = bwd_pds(vec_level, P, dS, hd, a, qb, kb);
        bwd_acc_dkdv(vec_level, hd, a, qb, kb, P, dS, mr);
    }
}

/* Queries of block qb: dQ from every key block they see, in order. */
MTI_VEC_VOID_L(bwd_dq, (const bwd_head *hd, const att_args *a, int qb, float *P, float *dS),
             (hd, a, qb, P, dS))
{
    for (int kb = 0; kb <= qb; kb++) {
        int mr = bwd_pds(vec_level, P, dS, hd, a, qb, kb);
        bwd_acc_dq(vec_level, hd, a, qb, kb, dS, mr);
    }
}

/* A whole head in one pass, each (query block, key block) pair's P and dS
 * feeding dV, dK and dQ at once. Key blocks outer, query blocks inner: dK and
 * dV still sum over query blocks in order, dQ over key blocks in order, as
 * in the split passes. */
MTI_VEC_VOID_L(bwd_all, (const bwd_head *hd, const att_args *a, float *P, float *dS),
             (hd, a, P, dS))
{
    const int nb = a->Tp / ATT_BLK;
    for (int kb = 0; kb < nb; kb++)
        for (int qb = kb; qb < nb; qb++) {
            int mr = bwd_pds(vec_level, P, dS, hd, a, qb, kb);
            bwd_acc_dkdv(vec_level, hd, a, qb, kb, P, dS, mr);
            bwd_acc_dq(vec_level, hd, a, qb, kb, dS, mr);
        }
}

mt_status mti_cpu_attention_bwd(const mti_kctx *k, void *dqkv, const void *dout, const void *qkv,
                                const void *out, const float *lse, int B, int T, int C, int H,
                                mti_dtype dt)
{
    att_args a;
    mt_status s = check_args(k, "attention_bwd", B, T, C, H, dt, &a);
    if (s || B == 0 || T == 0 || C == 0) return s;
    const int nt = mti_cpu_threads(k), BH = B * H, nb = a.Tp / ATT_BLK;
    const int split = BH < nt;
    const int heads = split ? BH : nt;
    const size_t head_f = bwd_head_floats(&a), thr_f = bwd_thread_floats(&a);

    mt_block blk;
    bool dry;
    if ((s = att_work(k, heads, head_f, nt, thr_f, &blk, &dry)) || dry) return s;
    float *base = blk.ptr, *thr_base = base + (size_t)heads * head_f;

    if (!split) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int bh = 0; bh < BH; bh++) {
            int me = omp_get_thread_num();
            float *P = thr_base + (size_t)me * thr_f, *dS = P + ATT_BLK * ATT_BLK;
            float *row = dS + ATT_BLK * ATT_BLK, *row2 = row + a.hsp;
            bwd_head hd = bwd_head_at(base + (size_t)me * head_f, lse, &a, bh);
            bwd_load(&hd, row, row2, dout, qkv, out, &a, bh / H, bh % H);
            bwd_all(&hd, &a, P, dS);
            bwd_store(dqkv, &hd, row, &a, bh / H, bh % H);
        }
    } else {
#pragma omp parallel num_threads(nt)
        {
            float *P = thr_base + (size_t)omp_get_thread_num() * thr_f, *dS = P + ATT_BLK * ATT_BLK;
            float *row = dS + ATT_BLK * ATT_BLK, *row2 = row + a.hsp;
#pragma omp for schedule(static)
            for (int bh = 0; bh < BH; bh++) {
                bwd_head hd = bwd_head_at(base + (size_t)bh * head_f, lse, &a, bh);
                bwd_load(&hd, row, row2, dout, qkv, out, &a, bh / H, bh % H);
            }
            /* dK, dV by key block, the longest (first keys) first */
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < BH * nb; it++) {
                int bh = it % BH;
                bwd_head hd = bwd_head_at(base + (size_t)bh * head_f, lse, &a, bh);
                bwd_dkdv(&hd, &a, it / BH, P, dS);
            }
            /* dQ by query block, the longest (last queries) first */
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < BH * nb; it++) {
                int bh = it % BH;
                bwd_head hd = bwd_head_at(base + (size_t)bh * head_f, lse, &a, bh);
                bwd_dq(&hd, &a, nb - 1 - it / BH, P, dS);
            }
#pragma omp for schedule(static)
            for (int bh = 0; bh < BH; bh++) {
                bwd_head hd = bwd_head_at(base + (size_t)bh * head_f, lse, &a, bh);
                bwd_store(dqkv, &hd, row, &a, bh / H, bh % H);
            }
        }
    }
    mti_work_free(k, &blk);
    return MT_OK;
}
