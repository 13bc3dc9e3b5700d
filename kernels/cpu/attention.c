/*
 * attention.c - causal self-attention that never stores the (T,T) scores.
 *
 * Forward, per (batch, head) and block of queries: the keys 0..t are visited
 * in blocks; each query row keeps a running maximum m and a running sum l of
 * exp(score - m), rescales its output accumulator whenever m grows, and ends
 * with out = acc / l and lse = m + log(l) (fp32, (B,H,T)). That one float per
 * row is all the backward needs to rebuild any probability exactly as
 * p = exp(score - lse).
 *
 * Backward (the FlashAttention-2 scheme): D_t = dout_t . out_t per query row;
 * then for each block of keys and each query row t that sees it, recompute
 * p (from q, k and lse) and dp = dout_t . v, form ds = p (dp - D_t), and
 * accumulate dv += p dout_t, dk += ds q_t, dq_t += ds k (dq scaled at the
 * end).
 *
 * Work is split over (b,h) pairs, each thread owning a whole head so no sum
 * is shared. When there are fewer heads than threads, the work is split over
 * (head, block) items instead: query blocks in the forward; in the backward a
 * pass over key blocks (dk, dv) and a pass over query blocks (dq), which
 * recomputes p and ds once more. Every accumulator is summed in the same
 * order in both schemes, and no loop reduces across vector lanes (scores are
 * built as sums of rows of the transposed keys, in order of the head
 * dimension), so results are bit-identical for any thread count.
 *
 * Workspace (fp32, from the WORK allocator): per head being worked on, the
 * head's keys and values (forward: 2 T hs floats) or its q, k, v, dout and
 * gradients (backward: 8 T hs + T floats); heads in flight are min(B H,
 * threads). Plus a block of queries and scores per thread.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu_ops.h"

/* Queries and keys per block. A block of keys (hs rows of ATT_BLK, 16 KiB at
 * hs 64) is reused by every query row of a block while it is in L1/L2. */
#define ATT_BLK 64

typedef struct att_args {
    int B, T, C, H, hs;
    float scale; /* 1/sqrt(hs) */
    mti_dtype dt;
} att_args;

static int mini(int a, int b) { return a < b ? a : b; }

/* Floats, rounded up to a 64-byte multiple so sub-buffers stay aligned. */
static size_t pad16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Element offset of (b, t, part, h, 0) in qkv (B,T,3C): part 0 q, 1 k, 2 v. */
static size_t qkv_at(const att_args *a, int b, int t, int part, int h)
{
    return ((size_t)b * (size_t)a->T + (size_t)t) * 3 * (size_t)a->C + (size_t)part * (size_t)a->C +
           (size_t)h * (size_t)a->hs;
}

/* Element offset of (b, t, h, 0) in a (B,T,C) tensor. */
static size_t btc_at(const att_args *a, int b, int t, int h)
{
    return ((size_t)b * (size_t)a->T + (size_t)t) * (size_t)a->C + (size_t)h * (size_t)a->hs;
}

/* dst (T,hs) fp32 = rows of one head's part of qkv, times mul. */
static void load_rows(float *dst, const void *qkv, const att_args *a, int b, int h, int part,
                      float mul)
{
    int hs = a->hs;
    for (int t = 0; t < a->T; t++) {
        float *r = dst + (size_t)t * (size_t)hs;
        mti_cpu_load_f32(r, qkv, a->dt, qkv_at(a, b, t, part, h), (size_t)hs);
        if (mul != 1.0f)
            for (int d = 0; d < hs; d++) r[d] *= mul;
    }
}

/* dst (hs,T) fp32 = one head's part of qkv, transposed; row (hs) is scratch. */
static void load_cols(float *dst, float *row, const void *qkv, const att_args *a, int b, int h,
                      int part)
{
    size_t T = (size_t)a->T;
    for (int t = 0; t < a->T; t++) {
        mti_cpu_load_f32(row, qkv, a->dt, qkv_at(a, b, t, part, h), (size_t)a->hs);
        for (int d = 0; d < a->hs; d++) dst[(size_t)d * T + (size_t)t] = row[d];
    }
}

/* s[c] = sum_d q[d] kt[d][c] for c < n: kt (hs rows, leading dimension ld)
 * holds keys as columns, so the inner loop runs along keys and sums each
 * score in the order of d. */
static void scores(float *s, const float *q, const float *kt, size_t ld, int hs, int n)
{
    float q0 = q[0];
#pragma omp simd
    for (int c = 0; c < n; c++) s[c] = q0 * kt[c];
    for (int d = 1; d < hs; d++) {
        float qd = q[d];
        const float *kr = kt + (size_t)d * ld;
#pragma omp simd
        for (int c = 0; c < n; c++) s[c] += qd * kr[c];
    }
}

/* y (n) += alpha x */
static void axpy(float *y, float alpha, const float *x, int n)
{
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

/* ---- forward ---- */

/* What the forward keeps per head in flight. */
typedef struct fwd_head {
    float *kt; /* (hs,T) keys as columns */
    float *v;  /* (T,hs) */
} fwd_head;

/* Per-thread scratch of the forward, in floats. */
static size_t fwd_thread_floats(int hs)
{
    return 2 * pad16((size_t)ATT_BLK * (size_t)hs) + 3 * pad16(ATT_BLK) + pad16((size_t)hs);
}

static void fwd_load(const fwd_head *fh, float *row, const void *qkv, const att_args *a, int b,
                     int h)
{
    load_cols(fh->kt, row, qkv, a, b, h, 1);
    load_rows(fh->v, qkv, a, b, h, 2, 1.0f);
}

/* One block of queries (qb) of head (b,h): out rows and lse. */
static void fwd_block(void *out, float *lse, const void *qkv, const att_args *a, int b, int h,
                      const fwd_head *fh, int qb, float *scratch)
{
    const int hs = a->hs, T = a->T;
    const int i0 = qb * ATT_BLK, nq = mini(ATT_BLK, T - i0);
    float *q = scratch;                                        /* (BLK,hs), scaled */
    float *o = q + pad16((size_t)ATT_BLK * (size_t)hs);        /* (BLK,hs) accumulators */
    float *s = o + pad16((size_t)ATT_BLK * (size_t)hs);        /* (BLK) scores, then p */
    float *m = s + pad16(ATT_BLK), *l = m + pad16(ATT_BLK);    /* (BLK) running max, sum */

    for (int r = 0; r < nq; r++) {
        float *qr = q + (size_t)r * (size_t)hs;
        mti_cpu_load_f32(qr, qkv, a->dt, qkv_at(a, b, i0 + r, 0, h), (size_t)hs);
        for (int d = 0; d < hs; d++) qr[d] *= a->scale;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, (size_t)nq * (size_t)hs * sizeof(float));

    for (int kb = 0; kb <= qb; kb++) {
        const int j0 = kb * ATT_BLK, nk = mini(ATT_BLK, T - j0);
        for (int r = 0; r < nq; r++) {
            const int nv = mini(nk, i0 + r - j0 + 1); /* keys j0..t */
            float *orow = o + (size_t)r * (size_t)hs;
            scores(s, q + (size_t)r * (size_t)hs, fh->kt + j0, (size_t)T, hs, nv);
            float mx = s[0];
            for (int c = 1; c < nv; c++) mx = s[c] > mx ? s[c] : mx;
            float mnew = mx > m[r] ? mx : m[r];
            float alpha = expf(m[r] - mnew); /* 0 on the first block (m = -inf) */
            float sum = 0.0f;
            for (int c = 0; c < nv; c++) {
                s[c] = expf(s[c] - mnew);
                sum += s[c];
            }
            l[r] = l[r] * alpha + sum;
            m[r] = mnew;
            if (alpha != 1.0f)
                for (int d = 0; d < hs; d++) orow[d] *= alpha;
            for (int c = 0; c < nv; c++) axpy(orow, s[c], fh->v + (size_t)(j0 + c) * (size_t)hs, hs);
        }
    }

    float *lrow = lse + ((size_t)b * (size_t)a->H + (size_t)h) * (size_t)T;
    for (int r = 0; r < nq; r++) {
        float *orow = o + (size_t)r * (size_t)hs;
        for (int d = 0; d < hs; d++) orow[d] /= l[r];
        mti_cpu_store_f32(out, a->dt, btc_at(a, b, i0 + r, h), orow, (size_t)hs);
        lrow[i0 + r] = m[r] + logf(l[r]);
    }
}

static mt_status check_args(const mti_kctx *k, const char *op, int B, int T, int C, int H,
                            mti_dtype dt)
{
    if (B < 0 || T < 0 || C < 0 || H <= 0 || C % H != 0 ||
        (dt != MTI_F32 && dt != MTI_F16 && dt != MTI_BF16))
        return mti_fail(k->ctx, MT_ERR_INVALID_ARG,
                        "%s: bad shape B %d T %d C %d H %d (C must be a multiple of H) or dtype %d",
                        op, B, T, C, H, (int)dt);
    return MT_OK;
}

mt_status mti_cpu_attention_fwd(const mti_kctx *k, void *out, float *lse, const void *qkv, int B,
                                int T, int C, int H, mti_dtype dt)
{
    mt_status s = check_args(k, "attention_fwd", B, T, C, H, dt);
    if (s || B == 0 || T == 0 || C == 0) return s;
    const att_args a = {B, T, C, H, C / H, 1.0f / sqrtf((float)(C / H)), dt};
    const int nt = mti_cpu_threads(), BH = B * H, nqb = (T + ATT_BLK - 1) / ATT_BLK;
    const int split = BH < nt; /* fewer heads than threads: split heads by query block */
    const int heads = split ? BH : nt;
    const size_t head_f = 2 * pad16((size_t)T * (size_t)a.hs), thr_f = fwd_thread_floats(a.hs);

    mt_block blk;
    s = mti_work_alloc(k, ((size_t)heads * head_f + (size_t)nt * thr_f) * sizeof(float), &blk);
    if (s) return s;
    float *base = blk.ptr, *thr_base = base + (size_t)heads * head_f;

    if (!split) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int bh = 0; bh < BH; bh++) {
            int me = omp_get_thread_num();
            float *hb = base + (size_t)me * head_f, *scr = thr_base + (size_t)me * thr_f;
            fwd_head fh = {hb, hb + head_f / 2};
            float *row = scr + thr_f - pad16((size_t)a.hs);
            fwd_load(&fh, row, qkv, &a, bh / H, bh % H);
            for (int qb = 0; qb < nqb; qb++) fwd_block(out, lse, qkv, &a, bh / H, bh % H, &fh, qb, scr);
        }
    } else {
#pragma omp parallel num_threads(nt)
        {
            int me = omp_get_thread_num();
            float *scr = thr_base + (size_t)me * thr_f;
            float *row = scr + thr_f - pad16((size_t)a.hs);
#pragma omp for schedule(static)
            for (int bh = 0; bh < BH; bh++) {
                float *hb = base + (size_t)bh * head_f;
                fwd_head fh = {hb, hb + head_f / 2};
                fwd_load(&fh, row, qkv, &a, bh / H, bh % H);
            }
            /* the longest blocks (last queries) first */
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < BH * nqb; it++) {
                int bh = it % BH, qb = nqb - 1 - it / BH;
                float *hb = base + (size_t)bh * head_f;
                fwd_head fh = {hb, hb + head_f / 2};
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
    float *q;      /* (T,hs) queries times the scale */
    float *k;      /* (T,hs) */
    float *kt;     /* (hs,T) keys as columns */
    float *vt;     /* (hs,T) values as columns */
    float *dout;   /* (T,hs) */
    float *dq, *dk, *dv; /* (T,hs) accumulators; dq without the scale until stored */
    float *D;      /* (T) dout_t . out_t */
    const float *lse; /* (T) the forward's */
} bwd_head;

static size_t bwd_head_floats(int T, int hs)
{
    return 8 * pad16((size_t)T * (size_t)hs) + pad16((size_t)T);
}

/* Per thread: p, ds (BLK) and a row (hs). */
static size_t bwd_thread_floats(int hs) { return 2 * pad16(ATT_BLK) + pad16((size_t)hs); }

static bwd_head bwd_head_at(float *hb, const float *lse, const att_args *a, int bh)
{
    size_t n = pad16((size_t)a->T * (size_t)a->hs);
    bwd_head h = {hb, hb + n, hb + 2 * n, hb + 3 * n, hb + 4 * n, hb + 5 * n, hb + 6 * n,
                  hb + 7 * n, hb + 8 * n, lse + (size_t)bh * (size_t)a->T};
    return h;
}

/* Loads head (b,h), computes D, zeroes the accumulators. row: hs floats. */
static void bwd_load(const bwd_head *hd, float *row, const void *dout, const void *qkv,
                     const void *out, const att_args *a, int b, int h)
{
    const int hs = a->hs;
    load_rows(hd->q, qkv, a, b, h, 0, a->scale);
    load_rows(hd->k, qkv, a, b, h, 1, 1.0f);
    load_cols(hd->kt, row, qkv, a, b, h, 1);
    load_cols(hd->vt, row, qkv, a, b, h, 2);
    for (int t = 0; t < a->T; t++) {
        float *g = hd->dout + (size_t)t * (size_t)hs;
        mti_cpu_load_f32(g, dout, a->dt, btc_at(a, b, t, h), (size_t)hs);
        mti_cpu_load_f32(row, out, a->dt, btc_at(a, b, t, h), (size_t)hs);
        float sum = 0.0f; /* in order of d */
        for (int d = 0; d < hs; d++) sum += g[d] * row[d];
        hd->D[t] = sum;
    }
    size_t n = (size_t)a->T * (size_t)hs * sizeof(float);
    memset(hd->dq, 0, n);
    memset(hd->dk, 0, n);
    memset(hd->dv, 0, n);
}

/* dqkv rows of head (b,h) = the accumulators rounded to dt, dq scaled. */
static void bwd_store(void *dqkv, const bwd_head *hd, float *row, const att_args *a, int b, int h)
{
    const int hs = a->hs;
    for (int t = 0; t < a->T; t++) {
        size_t r = (size_t)t * (size_t)hs;
        for (int d = 0; d < hs; d++) row[d] = hd->dq[r + d] * a->scale;
        mti_cpu_store_f32(dqkv, a->dt, qkv_at(a, b, t, 0, h), row, (size_t)hs);
        mti_cpu_store_f32(dqkv, a->dt, qkv_at(a, b, t, 1, h), hd->dk + r, (size_t)hs);
        mti_cpu_store_f32(dqkv, a->dt, qkv_at(a, b, t, 2, h), hd->dv + r, (size_t)hs);
    }
}

/* Query row t against keys j0..j0+nv-1: p (nv) = exp(q_t . k - lse_t) and
 * ds (nv) = p (dout_t . v - D_t). The one place both are computed, so both
 * work splits see the same values. */
static void bwd_row(float *p, float *ds, const bwd_head *hd, const att_args *a, int t, int j0,
                    int nv)
{
    const int hs = a->hs;
    const size_t T = (size_t)a->T;
    scores(p, hd->q + (size_t)t * (size_t)hs, hd->kt + j0, T, hs, nv);
    scores(ds, hd->dout + (size_t)t * (size_t)hs, hd->vt + j0, T, hs, nv);
    const float lse = hd->lse[t], D = hd->D[t];
    for (int c = 0; c < nv; c++) {
        p[c] = expf(p[c] - lse);
        ds[c] = p[c] * (ds[c] - D);
    }
}

/* Keys of block kb: dk and dv from every query row that sees them, rows in order. */
static void bwd_dkdv(const bwd_head *hd, const att_args *a, int kb, float *p, float *ds)
{
    const int hs = a->hs, T = a->T, j0 = kb * ATT_BLK, nk = mini(ATT_BLK, T - j0);
    for (int t = j0; t < T; t++) {
        const int nv = mini(nk, t - j0 + 1);
        bwd_row(p, ds, hd, a, t, j0, nv);
        const float *qt = hd->q + (size_t)t * (size_t)hs, *gt = hd->dout + (size_t)t * (size_t)hs;
        for (int c = 0; c < nv; c++) {
            size_t j = (size_t)(j0 + c) * (size_t)hs;
            axpy(hd->dv + j, p[c], gt, hs);
            axpy(hd->dk + j, ds[c], qt, hs);
        }
    }
}

/* Queries of block qb: dq from every key block they see, blocks in order. */
static void bwd_dq(const bwd_head *hd, const att_args *a, int qb, float *p, float *ds)
{
    const int hs = a->hs, T = a->T, i0 = qb * ATT_BLK, nq = mini(ATT_BLK, T - i0);
    for (int kb = 0; kb <= qb; kb++) {
        const int j0 = kb * ATT_BLK, nk = mini(ATT_BLK, T - j0);
        for (int t = i0; t < i0 + nq; t++) {
            const int nv = mini(nk, t - j0 + 1);
            bwd_row(p, ds, hd, a, t, j0, nv);
            float *dqt = hd->dq + (size_t)t * (size_t)hs;
            for (int c = 0; c < nv; c++) axpy(dqt, ds[c], hd->k + (size_t)(j0 + c) * (size_t)hs, hs);
        }
    }
}

/* A whole head in one pass: each (row, key block) pair's p and ds feed dv,
 * dk and dq at once. Key blocks outer, rows inner: dk and dv still sum over
 * rows in order, dq over key blocks in order, as in the split passes. */
static void bwd_all(const bwd_head *hd, const att_args *a, float *p, float *ds)
{
    const int hs = a->hs, T = a->T, nkb = (T + ATT_BLK - 1) / ATT_BLK;
    for (int kb = 0; kb < nkb; kb++) {
        const int j0 = kb * ATT_BLK, nk = mini(ATT_BLK, T - j0);
        for (int t = j0; t < T; t++) {
            const int nv = mini(nk, t - j0 + 1);
            bwd_row(p, ds, hd, a, t, j0, nv);
            const float *qt = hd->q + (size_t)t * (size_t)hs;
            const float *gt = hd->dout + (size_t)t * (size_t)hs;
            float *dqt = hd->dq + (size_t)t * (size_t)hs;
            for (int c = 0; c < nv; c++) {
                size_t j = (size_t)(j0 + c) * (size_t)hs;
                axpy(hd->dv + j, p[c], gt, hs);
                axpy(hd->dk + j, ds[c], qt, hs);
                axpy(dqt, ds[c], hd->k + j, hs);
            }
        }
    }
}

mt_status mti_cpu_attention_bwd(const mti_kctx *k, void *dqkv, const void *dout, const void *qkv,
                                const void *out, const float *lse, int B, int T, int C, int H,
                                mti_dtype dt)
{
    mt_status s = check_args(k, "attention_bwd", B, T, C, H, dt);
    if (s || B == 0 || T == 0 || C == 0) return s;
    const att_args a = {B, T, C, H, C / H, 1.0f / sqrtf((float)(C / H)), dt};
    const int nt = mti_cpu_threads(), BH = B * H, nb = (T + ATT_BLK - 1) / ATT_BLK;
    const int split = BH < nt;
    const int heads = split ? BH : nt;
    const size_t head_f = bwd_head_floats(T, a.hs), thr_f = bwd_thread_floats(a.hs);

    mt_block blk;
    s = mti_work_alloc(k, ((size_t)heads * head_f + (size_t)nt * thr_f) * sizeof(float), &blk);
    if (s) return s;
    float *base = blk.ptr, *thr_base = base + (size_t)heads * head_f;

    if (!split) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int bh = 0; bh < BH; bh++) {
            int me = omp_get_thread_num();
            float *scr = thr_base + (size_t)me * thr_f;
            float *p = scr, *ds = scr + pad16(ATT_BLK), *row = ds + pad16(ATT_BLK);
            bwd_head hd = bwd_head_at(base + (size_t)me * head_f, lse, &a, bh);
            bwd_load(&hd, row, dout, qkv, out, &a, bh / H, bh % H);
            bwd_all(&hd, &a, p, ds);
            bwd_store(dqkv, &hd, row, &a, bh / H, bh % H);
        }
    } else {
#pragma omp parallel num_threads(nt)
        {
            int me = omp_get_thread_num();
            float *scr = thr_base + (size_t)me * thr_f;
            float *p = scr, *ds = scr + pad16(ATT_BLK), *row = ds + pad16(ATT_BLK);
#pragma omp for schedule(static)
            for (int bh = 0; bh < BH; bh++) {
                bwd_head hd = bwd_head_at(base + (size_t)bh * head_f, lse, &a, bh);
                bwd_load(&hd, row, dout, qkv, out, &a, bh / H, bh % H);
            }
            /* dk, dv by key block, the longest (first keys) first */
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < BH * nb; it++) {
                int bh = it % BH;
                bwd_head hd = bwd_head_at(base + (size_t)bh * head_f, lse, &a, bh);
                bwd_dkdv(&hd, &a, it / BH, p, ds);
            }
            /* dq by query block, the longest (last queries) first */
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < BH * nb; it++) {
                int bh = it % BH;
                bwd_head hd = bwd_head_at(base + (size_t)bh * head_f, lse, &a, bh);
                bwd_dq(&hd, &a, nb - 1 - it / BH, p, ds);
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
