/*
 * source.c - where a model's initial weights come from: a seed, whose one
 * generator is drawn over every parameter in parameter order, or a file of
 * fp32 values (an llm.c model file, opened by gpt.c) in get/set_params
 * order. Any elements of any parameter can be read, in any order, with the
 * values whole-model creation gives them: the generator is moved to a
 * parameter's first draw from the nearest start it has passed, each value
 * of a parameter costing a fixed number of the generator's outputs (two
 * for a normal, one for a uniform, none for a constant or a padding row).
 * A model made at once reads its source tensor by tensor; a deferred model
 * (mt_*_spec.deferred) keeps it until its weights are made, where a
 * trainer's homes read only their own elements.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model/model.h"
#include "rng.h"

typedef struct mti_source {
    uint64_t seed;
    mti_rng cur;      /* the generator at element ce of parameter ci */
    int ci;
    size_t ce;
    mti_rng *start;   /* start[i]: the generator at parameter i's first element, i < known */
    int known;
    FILE *f;          /* a file's values (NULL: the seed's) */
    char *path;
    long long first;  /* the file's byte offset of the values */
} mti_source;

mt_status mti_source_seed(mt_model *m, uint64_t seed)
{
    mti_source *s = calloc(1, sizeof *s);
    if (s) s->start = malloc((size_t)(m->n_param ? m->n_param : 1) * sizeof *s->start);
    if (!s || !s->start) {
        free(s);
        return mti_fail(m->ctx, MT_ERR_OOM, "out of host memory");
    }
    s->seed = seed;
    mti_rng_seed(&s->cur, seed);
    s->start[0] = s->cur;
    s->known = 1;
    m->src = s;
    return MT_OK;
}

mt_status mti_source_file(mt_model *m, const char *path, long long first)
{
    mti_source *s = calloc(1, sizeof *s);
    if (s) s->path = strdup(path);
    if (!s || !s->path) {
        free(s);
        return mti_fail(m->ctx, MT_ERR_OOM, "out of host memory");
    }
    s->first = first;
    m->src = s;
    struct stat sb;
    if (!(s->f = fopen(path, "rb")))
        return mti_fail(m->ctx, MT_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    if (fstat(fileno(s->f), &sb) != 0 || !S_ISREG(sb.st_mode))
        return mti_fail(m->ctx, MT_ERR_IO, "'%s' is not a regular file", path);
    const uint64_t want = (uint64_t)first + 4 * (uint64_t)m->n_params;
    if ((uint64_t)sb.st_size != want)
        return mti_fail(m->ctx, MT_ERR_FORMAT,
                        "'%s' is %lld bytes; its header says %llu (truncated or not this model)",
                        path, (long long)sb.st_size, (unsigned long long)want);
    return MT_OK;
}

void mti_source_free(mt_model *m)
{
    mti_source *s = m->src;
    if (!s) return;
    if (s->f) fclose(s->f);
    free(s->path);
    free(s->start);
    free(s);
    m->src = NULL;
}

/* The generator's outputs per value of p, and its values that draw. */
static int per_value(const mti_param *p)
{
    return p->init == MTI_INIT_NORMAL ? 2 : p->init == MTI_INIT_UNIFORM ? 1 : 0;
}

static size_t live_of(const mti_param *p)
{
    return (size_t)p->init_rows * (size_t)mti_whole_cols(p);
}

/* The generator moved past values [from, to) of parameter i. */
static void skip(mti_source *s, const mti_param *p, size_t from, size_t to)
{
    const size_t live = live_of(p);
    if (from > live) from = live;
    if (to > live) to = live;
    const uint64_t outs = to > from ? (uint64_t)(to - from) * (uint64_t)per_value(p) : 0;
    for (uint64_t k = 0; k < outs; k++) (void)mti_rng_next(&s->cur);
}

/* The generator at element `at` of parameter i. */
static void seek(mti_source *s, const mt_model *m, int i, size_t at)
{
    if (i < s->ci || (i == s->ci && at < s->ce) || (i > s->ci && i < s->known)) {
        /* to the nearest start passed: parameter i's own, when known */
        s->ci = i < s->known ? i : s->known - 1;
        s->cur = s->start[s->ci];
        s->ce = 0;
    }
    while (s->ci < i) {
        skip(s, &m->params[s->ci], s->ce, mti_whole_numel(&m->params[s->ci]));
        s->ci++;
        s->ce = 0;
        if (s->ci == s->known) s->start[s->known++] = s->cur;
    }
    skip(s, &m->params[i], s->ce, at);
    s->ce = at;
}

static mt_status draw(mti_source *s, const mt_model *m, int i, size_t at, size_t n, float *dst)
{
    const mti_param *p = &m->params[i];
    const size_t live = live_of(p);
    seek(s, m, i, at);
    for (size_t k = 0; k < n; k++) {
        float v = 0.0f;
        if (at + k < live) switch (p->init) {
            case MTI_INIT_ZERO: v = 0.0f; break;
            case MTI_INIT_ONE: v = 1.0f; break;
            case MTI_INIT_UNIFORM: v = (2.0f * mti_rng_uniform(&s->cur) - 1.0f) * p->init_a; break;
            case MTI_INIT_NORMAL: v = (float)(mti_rng_normal(&s->cur) * p->init_a); break;
            }
        dst[k] = v;
    }
    s->ce = at + n;
    return MT_OK;
}

static mt_status load(mti_source *s, const mt_model *m, int i, size_t at, size_t n, float *dst)
{
    const mti_param *p = &m->params[i];
    if (fseeko(s->f, (off_t)s->first + (off_t)(p->offset + at) * 4, SEEK_SET) != 0)
        return mti_fail(m->ctx, MT_ERR_IO, "seeking in '%s' failed: %s", s->path, strerror(errno));
    if (fread(dst, sizeof *dst, n, s->f) != n)
        return mti_fail(m->ctx, MT_ERR_IO, "reading '%s' failed (%s)", s->path,
                        ferror(s->f) ? strerror(errno) : "the file is shorter than it was");
    for (size_t k = 0; k < n; k++)
        if (!isfinite(dst[k]))
            return mti_fail(m->ctx, MT_ERR_FORMAT, "'%s': %s holds a non-finite value", s->path,
                            p->name);
    return MT_OK;
}

/* Elements [at, at + n) of the whole parameter i. */
static mt_status read_whole(const mt_model *m, int i, size_t at, size_t n, float *dst)
{
    mti_source *s = m->src;
    if (!s) return mti_fail(m->ctx, MT_ERR_INTERNAL, "%s: its weights have no source", m->params[i].name);
    const size_t numel = mti_whole_numel(&m->params[i]);
    if (at > numel || n > numel - at)
        return mti_fail(m->ctx, MT_ERR_INTERNAL, "%s: [%zu, +%zu) is outside it", m->params[i].name,
                        at, n);
    return s->f ? load(s, m, i, at, n, dst) : draw(s, m, i, at, n, dst);
}

typedef struct part_read {
    const mt_model *m;
    int i;
    float *dst;
} part_read;

static mt_status read_run(void *user, size_t whole_at, size_t len, size_t off)
{
    const part_read *r = user;
    return read_whole(r->m, r->i, whole_at, len, r->dst + off);
}

mt_status mti_source_read(const mt_model *m, int i, size_t at, size_t n, float *dst)
{
    const mti_param *p = &m->params[i];
    if (!p->tp_split || !m->tp) return read_whole(m, i, at, n, dst);
    if (at > p->numel || n > p->numel - at)
        return mti_fail(m->ctx, MT_ERR_INTERNAL, "%s: [%zu, +%zu) is outside this rank's part",
                        p->name, at, n);
    part_read r = {m, i, dst};
    return mti_tp_each_run(p, m->tp->size, m->tp->rank, at, n, read_run, &r);
}

int mti_model_unmade(const mt_model *m)
{
    int n = 0;
    for (int i = 0; i < m->n_param; i++) n += m->params[i].unmade != 0;
    return n;
}

mt_status mti_source_mix(const mt_model *m, uint64_t *h)
{
    const mti_source *s = m->src;
    if (!s || !mti_model_unmade(m)) return MT_OK;
    if (!s->f) { /* the seed, and how each parameter draws from it */
        *h = mti_hash(*h, &s->seed, sizeof s->seed);
        for (int i = 0; i < m->n_param; i++) {
            const mti_param *p = &m->params[i];
            const int64_t how[2] = {(int64_t)p->init, p->init_rows};
            *h = mti_hash(*h, how, sizeof how);
            *h = mti_hash(*h, &p->init_a, sizeof p->init_a);
        }
        return MT_OK;
    }
    /* a file: the first and the last values of every parameter (up to
       RECIPE_VALUES each), which a different file or model differs in */
    enum { RECIPE_VALUES = 256 };
    float v[RECIPE_VALUES];
    for (int i = 0; i < m->n_param; i++) {
        const size_t numel = mti_whole_numel(&m->params[i]);
        const size_t n = numel < RECIPE_VALUES ? numel : RECIPE_VALUES;
        mt_status st = read_whole(m, i, 0, n, v);
        if (!st) *h = mti_hash(*h, v, n * sizeof *v);
        if (!st) st = read_whole(m, i, numel - n, n, v);
        if (st) return st;
        *h = mti_hash(*h, v, n * sizeof *v);
    }
    return MT_OK;
}
