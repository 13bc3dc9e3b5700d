/*
 * sparse.cu - a pruned tensor (lib/sparse/sparse.h) expanded into dense
 * elements, and dense elements gathered back into its kept values, for the
 * op table's sparse_expand and sparse_compress (kernels/cuda/ops_cuda.c).
 *
 * One thread per dense element of the range [at, at + len), grid-strided.
 * A thread finds whether its element is kept and, if so, its value's index:
 *   - bitmap: the span's prefix count plus the set bits of the span's
 *     words before the element's (at most 15 words, which the warp shares
 *     through the cache) and of its own word below it;
 *   - N:M: its group's N places, read from the packed indices.
 * Values are moved as bytes of es (2 or 4) at a time, so one kernel serves
 * every dtype; compress with add adds fp32 values.
 */

#define MT_SP_SPAN 1024 /* MTI_SP_SPAN */

struct mt_sp_desc {
    int fmt, n, m, bits;       /* fmt 1 bitmap, 2 N:M */
    mt_index pre, dense, at, len;
};

__device__ __forceinline__ unsigned mt_sp_nm_get(const unsigned char *meta, int b, mt_index k)
{
    const mt_index bit = k * (mt_index)b;
    unsigned v = meta[bit >> 3];
    if ((bit & 7) + (mt_index)b > 8) v |= (unsigned)meta[(bit >> 3) + 1] << 8;
    return (v >> (bit & 7)) & ((1u << b) - 1);
}

/* Whether element e is kept, and its value's index *r. */
__device__ __forceinline__ bool mt_sp_find(const unsigned char *meta, const mt_sp_desc &d,
                                           mt_index e, mt_index *r)
{
    if (d.fmt == 1) {
        const unsigned long long *w = (const unsigned long long *)meta;
        const unsigned *pre = (const unsigned *)(meta + d.pre);
        const unsigned long long word = w[e >> 6];
        if (!(word >> (e & 63) & 1)) return false;
        mt_index c = pre[e / MT_SP_SPAN];
        for (mt_index i = e / MT_SP_SPAN * (MT_SP_SPAN / 64); i < (e >> 6); i++) c += __popcll(w[i]);
        c += __popcll(word & ((1ull << (e & 63)) - 1));
        *r = c;
        return true;
    }
    const mt_index g = e / (mt_index)d.m;
    const unsigned j = (unsigned)(e % (mt_index)d.m);
    for (int i = 0; i < d.n; i++)
        if (mt_sp_nm_get(meta, d.bits, g * (mt_index)d.n + i) == j) {
            *r = g * (mt_index)d.n + i;
            return true;
        }
    return false;
}

/* dense (len; es bytes each) = elements [at, at + len), zeros where pruned. */
extern "C" __global__ void mt_sp_expand(void *dense, const void *vals, const unsigned char *meta,
                                        mt_sp_desc d, int es)
{
    const mt_index stride = (mt_index)gridDim.x * blockDim.x;
    for (mt_index i = (mt_index)blockIdx.x * blockDim.x + threadIdx.x; i < d.len; i += stride) {
        mt_index r;
        const bool kept = mt_sp_find(meta, d, d.at + i, &r);
        if (es == 4)
            ((unsigned *)dense)[i] = kept ? ((const unsigned *)vals)[r] : 0u;
        else
            ((unsigned short *)dense)[i] = kept ? ((const unsigned short *)vals)[r] : (unsigned short)0;
    }
}

/* The kept elements of dense (elements [at, at + len)) into vals; add: fp32 +=. */
extern "C" __global__ void mt_sp_compress(void *vals, const void *dense, const unsigned char *meta,
                                          mt_sp_desc d, int es, int add)
{
    const mt_index stride = (mt_index)gridDim.x * blockDim.x;
    for (mt_index i = (mt_index)blockIdx.x * blockDim.x + threadIdx.x; i < d.len; i += stride) {
        mt_index r;
        if (!mt_sp_find(meta, d, d.at + i, &r)) continue;
        if (add)
            ((float *)vals)[r] += ((const float *)dense)[i];
        else if (es == 4)
            ((unsigned *)vals)[r] = ((const unsigned *)dense)[i];
        else
            ((unsigned short *)vals)[r] = ((const unsigned short *)dense)[i];
    }
}
