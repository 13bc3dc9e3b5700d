/*
 * embedding.cu - token + position embedding, forward and backward.
 *
 * Forward: out (B,T,C) = wte[tok] (V,C) + wpe[t] (maxT,C), elementwise.
 *
 * Backward of wte, deterministic without float atomics: the n = B*T
 * positions are grouped by token and each group's dout rows are added in
 * position order by one owner thread per channel, starting from the value
 * already in dwte, the order a CPU loop over positions has. The op is not
 * told the vocabulary size, so tokens are grouped through an open-addressing
 * hash table of S >= 2n slots (a power of two) keyed by token:
 *
 *   1. mt_emb_hash   each position finds or claims its token's slot
 *                    (atomicCAS on int keys) and counts itself there
 *                    (atomicAdd on int counts);
 *   2. mt_emb_scan   exclusive prefix sum of the counts: start[s] of each
 *                    slot's group in a list of n positions, start[S] = n;
 *   3. mt_emb_fill   each position takes a place in its group (atomicSub
 *                    on the count): the group's set is right, its order
 *                    is not yet;
 *   4. mt_emb_rank   each position counts the group's positions smaller
 *                    than itself and writes itself at that rank: the
 *                    group is now in position order, whatever order step 3
 *                    ran in;
 *   5. mt_emb_bwd_wte  the first position of each group (its leader) adds the
 *                    group's dout rows into dwte[token], channel-parallel.
 *
 * Integer atomics only decide where things go; every float sum has one
 * owner and a fixed order, so dwte is the same bits on every run. Which slot
 * a token gets may vary between runs, which nothing observes. Step 4 costs
 * the sum of the squared group sizes (a token repeated k times costs k^2
 * compares), cheap for text; a batch of one repeated token is the worst
 * case. The backward of wpe is a column sum over B (reduce.cu).
 */

#define MT_EMB_EMPTY (-1) /* a free hash slot */

/* out (B,T,C) = wte[tok[b,t]] + wpe[t], n_out = B*T*C. Without positions
 * (wpe NULL) the row is loaded and stored, adding nothing, as the CPU table
 * does: an added 0.0f would turn -0 into +0 and NaN payloads into the
 * canonical NaN, where the load and store keep kctx's bits. */
template <typename T>
__device__ __forceinline__ void emb_fwd_k(void *out_, const int *tok, const void *wte_,
                                          const void *wpe_, int Tn, int C, mt_index n_out)
{
    T *out = (T *)out_;
    const T *wte = (const T *)wte_, *wpe = (const T *)wpe_;
    MT_FOR_EACH(i, n_out)
    {
        mt_index bt = i / (mt_index)C, c = i - bt * (mt_index)C;
        mt_index t = bt % (mt_index)Tn;
        mt_index v = (mt_index)tok[bt];
        float x = mt_ld(wte, v * C + c);
        if (wpe) x += mt_ld(wpe, t * C + c);
        mt_st(out, i, x);
    }
}
MT_EXPORT_DT(mt_emb_fwd, 256, emb_fwd_k,
             (void *out, const int *tok, const void *wte, const void *wpe, int Tn, int C,
              mt_index n_out),
             (out, tok, wte, wpe, Tn, C, n_out))

/* embedding_fwd_rows: rows [v0, v1) of the table (wte at row v0), a token
 * outside them a zero row; no positions. grid-stride over n_out. */
template <typename T>
__device__ __forceinline__ void emb_fwd_rows_k(void *out_, const int *tok, const void *wte_,
                                               int v0, int v1, int C, mt_index n_out)
{
    T *out = (T *)out_;
    const T *wte = (const T *)wte_;
    MT_FOR_EACH(i, n_out)
    {
        mt_index bt = i / (mt_index)C, c = i - bt * (mt_index)C;
        const int v = tok[bt];
        const float x = v >= v0 && v < v1 ? mt_ld(wte, (mt_index)(v - v0) * C + c) : 0.0f;
        mt_st(out, i, x);
    }
}
MT_EXPORT_DT(mt_emb_fwd_rows, 256, emb_fwd_rows_k,
             (void *out, const int *tok, const void *wte, int v0, int v1, int C, mt_index n_out),
             (out, tok, wte, v0, v1, C, n_out))

/* Step 1. keys (S) start MT_EMB_EMPTY, counts (S) start 0; S a power of two
 * >= 2n, so probing always ends. slot_of (n) = the slot of each position's
 * token. grid-stride over n. */
extern "C" __global__ void __launch_bounds__(256)
    mt_emb_hash(int *keys, int *counts, int *slot_of, const int *tok, int n, int S)
{
    MT_FOR_EACH(i, (mt_index)n)
    {
        const int v = tok[i];
        unsigned s = ((unsigned)v * 2654435761u) & (unsigned)(S - 1);
        for (;;) {
            int k = atomicCAS(&keys[s], MT_EMB_EMPTY, v);
            if (k == MT_EMB_EMPTY || k == v) break;
            s = (s + 1) & (unsigned)(S - 1);
        }
        slot_of[i] = (int)s;
        atomicAdd(&counts[s], 1);
    }
}

/* Step 2. start (S + 1) = exclusive prefix sum of counts (S). One block of
 * 1024 threads: thread t sums its run of ceil(S / 1024) slots, the block
 * scans the run totals, then each thread writes its run's starts. */
extern "C" __global__ void __launch_bounds__(1024)
    mt_emb_scan(int *start, const int *counts, int S)
{
    __shared__ int run_sum[1024];
    const int t = threadIdx.x, per = (S + 1023) / 1024;
    const int lo = min(S, t * per), hi = min(S, lo + per);
    int sum = 0;
    for (int s = lo; s < hi; s++) sum += counts[s];
    run_sum[t] = sum;
    __syncthreads();
    /* inclusive scan of the 1024 run totals (Hillis-Steele; ints, exact) */
    for (int o = 1; o < 1024; o <<= 1) {
        int add = t >= o ? run_sum[t - o] : 0;
        __syncthreads();
        run_sum[t] += add;
        __syncthreads();
    }
    int acc = run_sum[t] - sum;
    for (int s = lo; s < hi; s++) {
        start[s] = acc;
        acc += counts[s];
    }
    if (t == 1023) start[S] = run_sum[1023];
}

/* Step 3. unsorted (n): each slot's group gets its positions, in any
 * order. counts are used up (back to 0). grid-stride over n. */
extern "C" __global__ void __launch_bounds__(256)
    mt_emb_fill(int *unsorted, int *counts, const int *start, const int *slot_of, int n)
{
    MT_FOR_EACH(i, (mt_index)n)
    {
        const int s = slot_of[i];
        const int place = atomicSub(&counts[s], 1) - 1;
        unsorted[start[s] + place] = (int)i;
    }
}

/* Step 4. sorted (n): each group in increasing position order. The rank of
 * position i is the number of its group's positions below i (positions are
 * distinct). grid-stride over n. */
extern "C" __global__ void __launch_bounds__(256)
    mt_emb_rank(int *sorted, const int *unsorted, const int *start, const int *slot_of, int n)
{
    MT_FOR_EACH(i, (mt_index)n)
    {
        const int s = slot_of[i];
        const int lo = start[s], hi = start[s + 1];
        int rank = 0;
        for (int j = lo; j < hi; j++) rank += unsorted[j] < (int)i;
        sorted[lo + rank] = (int)i;
    }
}

/* Step 5. dwte (V,C) fp32 += the dout (n,C) rows of each group, in position
 * order, by the group's leader: block x = a place in `sorted`, which leads
 * if it is its group's first; block y = 256 channels. grid (n, ceil(C/256)).
 * Only tokens in [v0, v1) are added, dwte pointing at row v0 (the whole
 * table: 0 and INT_MAX). */
template <typename T>
__device__ __forceinline__ void emb_bwd_wte_k(float *dwte, const void *dout_, const int *sorted,
                                              const int *start, const int *slot_of,
                                              const int *tok, int C, int v0, int v1)
{
    const T *dout = (const T *)dout_;
    const int place = blockIdx.x;
    const int s = slot_of[sorted[place]];
    if (start[s] != place) return; /* not the leader: the leader adds this row */
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int hi = start[s + 1];
    const int v = tok[sorted[place]];
    if (v < v0 || v >= v1) return;
    float *row = dwte + (mt_index)(v - v0) * C + c;
    float acc = *row;
    for (int j = place; j < hi; j++) acc += mt_ld(dout, (mt_index)sorted[j] * C + c);
    *row = acc;
}
MT_EXPORT_DT(mt_emb_bwd_wte, 256, emb_bwd_wte_k,
             (float *dwte, const void *dout, const int *sorted, const int *start,
              const int *slot_of, const int *tok, int C, int v0, int v1),
             (dwte, dout, sorted, start, slot_of, tok, C, v0, v1))
