/*
 * sparse.h - pruned tensors (lib/sparse/mask.c): how a pruned tensor is
 * stored, how its mask is chosen, and when.
 *
 * Storage. A pruned tensor of `dense` elements keeps its kept values
 * alone, in element order (vals, nnz of them), and a description of where
 * they are (meta, bytes, laid out as mti_sp_layout says):
 *   - BITMAP (unstructured): one bit per element in 64-bit words (bit e %
 *     64 of word e / 64 set: element e is kept), then one uint32 per
 *     MTI_SP_SPAN elements: the kept elements before that span. The value
 *     of a kept element e is vals[pre[e / SPAN] + the set bits before e in
 *     its span]. About 1.03 bits per element.
 *   - NM (N:M): every group of M consecutive elements keeps exactly N
 *     (group g's values are vals[g N .. g N + N), ascending), and each
 *     kept value's place in its group is packed in b = ceil(log2 M) bits,
 *     least significant first, value k's at bit k b of the little-endian
 *     bit stream (2:4: 2 bits per kept value).
 * meta's size is a multiple of 8 bytes.
 *
 * Masks. A mask is a bitmap of kept elements (keep, host uint64 words,
 * bit e of word e / 64). The choices, each of the smallest scores (the
 * pruned) given a count; scores are finite and not negative (|w|, or
 * Wanda's |w| ||x||), and ties are broken by position, the element
 * earlier in the tensor (the first tensor of a global choice first)
 * pruned first, so that a choice is the same everywhere:
 *   - per tensor: the k = rint(s n) smallest of n (torch.nn.utils.prune's
 *     l1_unstructured: round(amount * n), half to even);
 *   - global: the k = rint(s sum n) smallest over several tensors
 *     together (global_unstructured);
 *   - per row (Wanda): in each row of `cols`, the floor(s cols) smallest
 *     (the paper's int(cols * ratio));
 *   - N:M: in each group of M, the N largest kept (ties: the earlier
 *     kept), the others pruned.
 * A previous mask may be given: what it pruned stays pruned and counts
 * toward k (gradual pruning only removes).
 */
#ifndef MT_SPARSE_H
#define MT_SPARSE_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

#define MTI_SP_SPAN 1024 /* elements per prefix count of a bitmap */
#define MTI_SP_MAX_M 16

typedef enum mti_sp_format {
    MTI_SP_DENSE = 0, /* not pruned */
    MTI_SP_BITMAP = 1,
    MTI_SP_NM = 2
} mti_sp_format;

/* The layout of a pruned tensor's description. */
typedef struct mti_sp_layout {
    mti_sp_format fmt;
    int n, m;           /* NM */
    size_t dense, nnz;  /* elements, and of them kept */
    size_t words;       /* BITMAP: 64-bit words of the bitmap */
    size_t pre, pre_n;  /* BITMAP: byte offset of the prefix counts, and how many */
    int bits;           /* NM: bits per kept value's place */
    size_t bytes;       /* meta's size (a multiple of 8) */
} mti_sp_layout;

/* Words of a mask over n elements. */
static inline size_t mti_sp_words(size_t n) { return (n + 63) / 64; }

/* The layout of a tensor of `dense` elements, nnz kept, in format fmt (n:m
 * for NM: m in [2, 16], 0 < n < m, dense a multiple of m, nnz = dense / m *
 * n). MT_ERR_INVALID_ARG (ctx's message; ctx may be NULL) otherwise. */
mt_status mti_sp_layout_of(mt_context *ctx, mti_sp_format fmt, size_t dense, size_t nnz, int n,
                           int m, mti_sp_layout *out);
/* meta (L->bytes) for the mask keep, which must keep L->nnz elements (and
 * for NM, exactly n of each group): MT_ERR_INVALID_ARG otherwise. */
mt_status mti_sp_encode(const mti_sp_layout *L, const uint64_t *keep, void *meta);
/* The mask meta describes (L->dense bits). */
void mti_sp_decode(const mti_sp_layout *L, const void *meta, uint64_t *keep);
/* The kept elements before element e (the index of its value when kept). */
size_t mti_sp_rank(const mti_sp_layout *L, const void *meta, size_t e);

/* Host forms of the ops sparse_expand and sparse_compress (es-byte
 * values; vals holds the values from index vbase on): dense elements [at,
 * at + len) made from vals (zeros where pruned); and the kept ones among
 * them gathered into vals, added to fp32 ones with add. */
void mti_sp_expand(const mti_sp_layout *L, const void *meta, const void *vals, size_t vbase,
                   size_t es, size_t at, size_t len, void *dense);
void mti_sp_compress(const mti_sp_layout *L, const void *meta, const void *dense, size_t es,
                     size_t at, size_t len, void *vals, size_t vbase, int add);

/* CSR's index of rows [r0, r1) of a pruned (rows, cols) tensor: ptr[r] =
 * the kept elements before row r, and idx[k] = the column of kept value k
 * for the values of those rows (ptr and idx are the whole tensor's). */
void mti_sp_csr_rows(const mti_sp_layout *L, const void *meta, size_t cols, size_t r0, size_t r1,
                     size_t *ptr, int32_t *idx);

/* ---- choosing masks ---- */

/* One tensor's scores in a choice: n values, and its mask (keep, n bits),
 * which holds the previous mask on entry (NULL prev: every element kept)
 * and the new one on return. */
typedef struct mti_sp_seg {
    const float *score;
    size_t n;
    uint64_t *keep;
} mti_sp_seg;

/* The count a fraction s of n prunes: rint(s n) (half to even, in double,
 * as Python's round). */
size_t mti_sp_count(double s, size_t n);
/* Prunes the k smallest scores over the segments together (what their
 * masks prune already counts; k below that prunes nothing more).
 * MT_ERR_INVALID_ARG for a score that is negative or not finite (ctx's
 * message names the segment's element), MT_ERR_OOM. */
mt_status mti_sp_prune_smallest(mt_context *ctx, mti_sp_seg *segs, int nseg, size_t k);
/* RigL's growth: the k largest scores among the elements keep prunes
 * become kept (all of them when there are fewer; ties: the earlier). */
mt_status mti_sp_grow(mt_context *ctx, const float *score, size_t n, uint64_t *keep, size_t k);
/* Per row of a (rows, cols) tensor: the k smallest of each row pruned. */
mt_status mti_sp_prune_rows(mt_context *ctx, const float *score, int64_t rows, int64_t cols,
                            size_t k, uint64_t *keep);
/* N:M: in each group of m, the n largest scores kept and the rest pruned
 * (dense a multiple of m; keep made whole). */
mt_status mti_sp_prune_nm(mt_context *ctx, const float *score, size_t dense, int n, int m,
                          uint64_t *keep);
/* Kept elements of a mask of n bits. */
size_t mti_sp_kept(const uint64_t *keep, size_t n);

/* ---- when ---- */

/* Whether p prunes after create (at a step, gradually, or by Wanda, which
 * waits for its calibration); RigL aside. */
bool mti_prune_later(const mt_prune_config *p);

/* Zhu & Gupta's gradual schedule: the sparsity at step t of pruning from
 * step a to b toward sf, s_t = sf (1 - (1 - (t - a) / (b - a))^3) (0
 * before a, sf from b on). */
double mti_sp_gradual(double sf, int64_t a, int64_t b, int64_t t);
/* RigL's drop fraction at step t of mask updates ending at t_end: f/2
 * (1 + cos(pi t / t_end)) (0 from t_end on). */
double mti_sp_rigl_frac(double f, int64_t t, int64_t t_end);

#endif /* MT_SPARSE_H */
