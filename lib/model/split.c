/*
 * split.c - where rank q's part of a tensor-parallel parameter lies in the
 * whole tensor (model.h, mti_tp_split): a list of runs of consecutive
 * elements, which, one after another, are the part's elements in order.
 */
#include "model/model.h"

/* [n q / T, n (q + 1) / T): every part within one of the others' size */
static int64_t cut(int64_t n, int T, int q) { return n * q / T; }

size_t mti_tp_nruns(mti_tp_split split, int64_t rows, int64_t cols, int T)
{
    (void)cols;
    (void)T;
    switch (split) {
    case MTI_TP_WHOLE:
    case MTI_TP_ROWS: return 1;
    case MTI_TP_QKV: return 3;
    case MTI_TP_COLS: return (size_t)rows;
    }
    return 1;
}

void mti_tp_run(mti_tp_split split, int64_t rows, int64_t cols, int T, int q, size_t j,
                size_t *at, size_t *len)
{
    switch (split) {
    case MTI_TP_WHOLE:
        *at = 0;
        *len = (size_t)(rows * cols);
        return;
    case MTI_TP_ROWS: {
        const int64_t r0 = cut(rows, T, q), r1 = cut(rows, T, q + 1);
        *at = (size_t)(r0 * cols);
        *len = (size_t)((r1 - r0) * cols);
        return;
    }
    case MTI_TP_QKV: { /* rows (3 C): q, k and v of C rows each */
        const int64_t C = rows / 3, r0 = cut(C, T, q), r1 = cut(C, T, q + 1);
        *at = (size_t)(((int64_t)j * C + r0) * cols);
        *len = (size_t)((r1 - r0) * cols);
        return;
    }
    case MTI_TP_COLS: {
        const int64_t c0 = cut(cols, T, q), c1 = cut(cols, T, q + 1);
        *at = (size_t)((int64_t)j * cols + c0);
        *len = (size_t)(c1 - c0);
        return;
    }
    }
}

void mti_tp_part_shape(mti_tp_split split, int64_t rows, int64_t cols, int T, int q,
                       int64_t *prow, int64_t *pcol)
{
    *prow = rows;
    *pcol = cols;
    switch (split) {
    case MTI_TP_WHOLE: return;
    case MTI_TP_ROWS: *prow = cut(rows, T, q + 1) - cut(rows, T, q); return;
    case MTI_TP_QKV: *prow = 3 * (cut(rows / 3, T, q + 1) - cut(rows / 3, T, q)); return;
    case MTI_TP_COLS: *pcol = cut(cols, T, q + 1) - cut(cols, T, q); return;
    }
}

mt_status mti_tp_each_run(const mti_param *p, int T, int q, size_t at, size_t n,
                          mt_status (*fn)(void *user, size_t whole_at, size_t len, size_t off),
                          void *user)
{
    const int64_t rows = p->whole_shape[0], cols = p->whole_shape[1];
    const mti_tp_split split = (mti_tp_split)p->tp_split;
    const size_t nr = mti_tp_nruns(split, rows, cols, T);
    size_t base = 0; /* the part's element where run j starts */
    mt_status s = MT_OK;
    for (size_t j = 0; j < nr && !s && base < at + n; j++) {
        size_t wat, len;
        mti_tp_run(split, rows, cols, T, q, j, &wat, &len);
        const size_t lo = at > base ? at : base, hi = at + n < base + len ? at + n : base + len;
        if (lo < hi) s = fn(user, wat + (lo - base), hi - lo, lo - at);
        base += len;
    }
    return s;
}
