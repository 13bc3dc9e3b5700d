/*
 * home.c - a parameter's home on this rank (home.h).
 */
#include "train/home.h"

bool mti_home_sliced(const mt_trainer *t, int i)
{
    return t->zero == 3 && !t->model->params[i].frozen;
}

void *mti_home_weights(const mt_trainer *t, int i, size_t at)
{
    const mti_param *p = &t->model->params[i];
    const size_t es = mti_dtype_size(p->w.dtype);
    if (!mti_home_sliced(t, i)) return (char *)p->w.blk.ptr + at * es;
    return (char *)t->pw[i].blk.ptr + (at - t->sh[i].lo) * es;
}
