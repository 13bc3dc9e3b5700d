/*
 * checkpoint.c - training checkpoints: the whole trainer state in one file,
 * written atomically, read back only once all of it has been checked.
 *
 * The format (docs/formats.md), little-endian:
 *   header, 32 bytes: magic "MTTRAIN\0", u32 version (1), u32 sections,
 *     u64 payload bytes (all sections, headers included), u32 CRC-32 of
 *     the first 24 bytes, u32 0;
 *   (the layout ends with the frozen parameters' indices, if any, LoRA's
 *   alpha, if any, and the quantized weights' indices and formats, if any);
 *   sections, each a 32-byte header (u32 kind, u32 index, u64 bytes, u32
 *     CRC-32 of the payload, u32 dtype, u32 CRC-32 of these first 24 bytes,
 *     u32 0) and its payload:
 *     LAYOUT   what the state fits: the model (kind, input, sizes, each
 *              parameter's name, shape and storage dtype) and the trainer
 *              (optimizer, precision, masters, each state tensor's dtype
 *              and size); a trainer loads only a file whose layout is its
 *              own, byte for byte;
 *     COUNTERS steps, optimizer steps, skipped steps, the last norm, the
 *              loss scaler (scale, growth tracker, last skipped);
 *     TENSOR   one per stored tensor, in layout order: the weights as
 *              stored (fp32, the 16-bit compute copy, bf16 alone, or the
 *              bytes of a quantized weight, lib/quant/quant.h), the
 *              fp32 masters, each optimizer state tensor (8-bit codes and
 *              absmax included), raw bytes;
 *     USER     the application's bytes (its data position, its RNG);
 *     END      empty: the file is whole.
 *
 * Loading reads the file twice: first every section is checked (sizes,
 * order, CRCs, the layout) without touching the trainer; only then is the
 * state copied in, each section's CRC checked again on the way. A file
 * that is truncated, corrupt, of another version or for another model or
 * trainer is refused with the trainer as it was.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "train/dp.h"
#include "model/model.h"
#include "train/offload.h"
#include "optim/optim.h"
#include "train/trainer.h"
#include "train/tp.h"
#include "train/pp.h"
#include "train/sparsity.h"
#include "comm/comm.h"

#define CK_MAGIC "MTTRAIN\0"
#define CK_VERSION 1u
#define CK_HEADER 32u
#define CK_SECTION 32u
#define CK_CHUNK ((size_t)1 << 20)

#define CK_COUNTERS 40u /* bytes of the counters section (counters_of) */

enum { SEC_LAYOUT = 1, SEC_COUNTERS = 2, SEC_TENSOR = 3, SEC_USER = 4, SEC_END = 5 };

/* A growable byte buffer for the small sections. */
typedef struct bbuf {
    unsigned char *p;
    size_t len, cap;
    bool oom;
} bbuf;

static void bb_put(bbuf *b, const void *data, size_t n)
{
    if (b->oom) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        unsigned char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q, b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
}
static void bb_u32(bbuf *b, uint32_t v)
{
    unsigned char x[4];
    mti_put_u32(x, v);
    bb_put(b, x, 4);
}
static void bb_u64(bbuf *b, uint64_t v)
{
    unsigned char x[8];
    mti_put_u64(x, v);
    bb_put(b, x, 8);
}

/* ---- what the state is made of ---- */

/* The stored tensors of a trainer, in file order: whole tensors, whatever
 * part of them this rank holds under ZeRO (see held). */
typedef struct ck_tensor {
    mti_tensor *t; /* this rank's (its part; no memory when it holds none) */
    int param;     /* its parameter (pipeline parallel: in this rank's stage, or -1) */
    int wparam;    /* ... in the whole model (the file's) */
    int stage;     /* pipeline parallel: the stage holding it (else 0) */
    int what;      /* 0 weights, 1 master, 2.. state s[what - 2], CK_MASK a pruned
                      weight's mask (sp its layout) */
    mti_dtype dtype;
    uint64_t bytes; /* of the whole tensor */
    mti_sp_layout sp;
} ck_tensor;

#define CK_MASK 6
#define CK_SPARSE_MAGIC 0x53525053u /* "SPRS": the layout's pruned-weights tail */

/* The stored tensors, in file order; over (NULL, or per parameter: fmt 0
 * for none) gives a pruned layout a parameter will take from a file in
 * place of its own. */
static int list_tensors(mt_trainer *t, ck_tensor *out, const mti_sp_layout *over)
{
    mt_model *m = t->model;
    const mti_pp *pp = &t->pp;
    int n = 0;
    for (int i = 0; i < m->n_param; i++) {
        mti_param *p = &m->params[i];
        /* (pipeline parallel: the whole model's index; the last stage's copy
           of the table stands for the table) */
        const int wi = pp->size < 2 ? i : i == pp->tied ? pp->table : pp->q0 + i;
        mti_tensor *w = t->zero == 3 && !p->frozen ? &t->pw[i] : &p->w; /* (ZeRO-3: a slice) */
        /* a pruned weight (as the file's mask will make it): its mask first */
        const mti_sp_layout *L = over && over[i].fmt ? &over[i] : p->sp ? &p->sp->L : NULL;
        if (L && out)
            out[n] = (ck_tensor){p->sp ? &p->sp->meta : NULL, i, wi, pp->rank, CK_MASK, MTI_U8,
                                 L->bytes, *L};
        n += L != NULL;
        /* the elements stored: a pruned weight's kept ones; (tensor parallel)
           a part's whole tensor, element by element, which tp_files_ok has
           checked every stored tensor is */
        const uint64_t whole = L ? L->nnz : mti_whole_numel(p);
        const uint64_t wbytes = L || p->tp_split ? whole * mti_dtype_size(p->w.dtype)
                                                 : mti_tensor_bytes(&p->w); /* (quantized: its bytes) */
        if (out) out[n] = (ck_tensor){w, i, wi, pp->rank, 0, p->w.dtype, wbytes, {0}};
        n++;
        if (m->has_master && !p->frozen) { /* (a frozen weight has none) */
            if (out) out[n] = (ck_tensor){&p->master, i, wi, pp->rank, 1, MTI_F32, whole * 4, {0}};
            n++;
        }
        mti_opt_layout lay = t->ps[i].lay;
        if (!p->frozen && over && over[i].fmt) mti_trainer_layout_for(t, i, L->nnz, &lay);
        for (int j = 0; j < 4; j++) {
            const mti_opt_state *l = &lay.s[j];
            if (!l->numel) continue;
            const uint64_t numel = p->tp_split ? whole : (uint64_t)l->numel;
            if (out)
                out[n] = (ck_tensor){&t->ps[i].s[j], i, wi, pp->rank, 2 + j, l->dtype,
                                     numel * mti_dtype_size(l->dtype), {0}};
            n++;
        }
    }
    return n;
}

/* The bytes [*off, *off + *len) of a stored tensor that rank r holds: the
 * weights whole on every rank (ZeRO-3: a slice, as a master); under ZeRO a master or state tensor's part
 * for the rank's elements of the parameter (lib/train/zero.c), else whole. */
static bool sharded(const mt_trainer *t, const ck_tensor *c)
{
    return t->zero && c->what != CK_MASK &&
           (c->what != 0 || (t->zero == 3 && !t->model->params[c->param].frozen));
}

static void held(const mt_trainer *t, const ck_tensor *c, int r, uint64_t *off, uint64_t *len)
{
    *off = 0;
    *len = c->bytes;
    if (!sharded(t, c)) return;
    size_t lo, hi;
    mti_zero_range(t, c->param, r, &lo, &hi);
    const size_t es = mti_dtype_size(c->dtype);
    if (c->what <= 1) { /* a master's or (ZeRO-3) the weights' slice */
        *off = lo * es, *len = (hi - lo) * es;
        return;
    }
    const mti_opt_state *l = &t->ps[c->param].lay.s[c->what - 2];
    if (hi == lo) *len = 0;
    else if (l->per > 0)
        *off = lo / (size_t)l->per * es, *len = (uint64_t)mti_optim_state_numel(l, lo, hi - lo) * es;
}

/* The layout section: the model and the trainer as far as the stored state
 * depends on them. */
static void layout_of(mt_trainer *t, const ck_tensor *ts, int n, bbuf *b)
{
    mt_model *m = t->model;
    /* (pipeline parallel: the whole model's, so a file fits every layout) */
    const bool pp = t->pp.size > 1;
    const mti_param *params = pp ? t->pp.params : m->params;
    const int n_param = pp ? t->pp.n_param : m->n_param;
    bb_u32(b, (uint32_t)m->kind);
    bb_u32(b, (uint32_t)m->input);
    bb_u32(b, (uint32_t)m->features);
    bb_u32(b, (uint32_t)m->vocab);
    bb_u32(b, (uint32_t)m->padded_vocab);
    bb_u32(b, (uint32_t)m->max_seq);
    bb_u32(b, (uint32_t)(pp ? t->pp.n_layers : m->n_layers));
    bb_u32(b, (uint32_t)n_param);
    for (int i = 0; i < n_param; i++) {
        const mti_param *p = &params[i];
        char name[MTI_NAME_LEN] = {0};
        snprintf(name, sizeof name, "%s", p->name);
        bb_put(b, name, sizeof name);
        /* (tensor parallel: the whole tensor's, so a file fits every layout) */
        bb_u64(b, (uint64_t)(p->tp_split ? p->whole_shape[0] : p->shape[0]));
        bb_u64(b, (uint64_t)(p->ndim != 2 ? 0 : p->tp_split ? p->whole_shape[1] : p->shape[1]));
        bb_u64(b, mti_whole_numel(p));
    }
    bb_u32(b, (uint32_t)t->cfg.optimizer);
    bb_u32(b, (uint32_t)t->cfg.precision);
    bb_u32(b, (uint32_t)t->bare);
    bb_u32(b, (uint32_t)n);
    for (int k = 0; k < n; k++) {
        bb_u32(b, (uint32_t)ts[k].wparam);
        bb_u32(b, (uint32_t)ts[k].what);
        bb_u32(b, (uint32_t)ts[k].dtype);
        bb_u64(b, ts[k].bytes);
    }
    /* the frozen parameters, when there are any (so a file without them is
       as it always was): their count, then their indices */
    uint32_t nf = 0;
    for (int i = 0; i < n_param; i++) nf += params[i].frozen != 0;
    if (nf) bb_u32(b, nf);
    for (int i = 0; nf && i < n_param; i++)
        if (params[i].frozen) bb_u32(b, (uint32_t)i);
    if (m->lora_rank) { /* LoRA's alpha (the rank is in the adapters' shapes) */
        uint32_t a;
        memcpy(&a, &m->lora_alpha, 4);
        bb_u32(b, a);
    }
    /* the quantized weights (cfg.base), when there are any: their count,
       then each one's index and format (1 int8, 2 NF4) */
    _Static_assert(MTI_QF_INT8 == 1 && MTI_QF_NF4 == 2, "the formats' numbers in a file");
    uint32_t nq = 0;
    for (int i = 0; i < n_param; i++) nq += params[i].qf != 0;
    if (nq) bb_u32(b, nq);
    for (int i = 0; nq && i < n_param; i++)
        if (params[i].qf) bb_u32(b, (uint32_t)i), bb_u32(b, (uint32_t)params[i].qf);
    /* the pruned weights, when there are any: each one's index, format,
       N:M, dense and kept elements, then their count and the tail's magic
       (read from the end: sparse_tail) */
    uint32_t ns = 0;
    for (int k = 0; k < n; k++) {
        if (ts[k].what != CK_MASK) continue;
        const mti_sp_layout *L = &ts[k].sp;
        bb_u32(b, (uint32_t)ts[k].wparam), bb_u32(b, (uint32_t)L->fmt);
        bb_u32(b, (uint32_t)L->n), bb_u32(b, (uint32_t)L->m);
        bb_u64(b, L->dense), bb_u64(b, L->nnz);
        ns++;
    }
    if (ns) bb_u32(b, ns), bb_u32(b, CK_SPARSE_MAGIC);
}

/* The pruned layouts a file's layout section (lay, len bytes) names, into
 * over (per parameter of t's model; fmt 0 where it names none, or names
 * what does not fit the model: the layouts then differ, and say so). */
static void sparse_tail(const mt_trainer *t, const unsigned char *lay, size_t len,
                        mti_sp_layout *over)
{
    const mt_model *m = t->model;
    memset(over, 0, (size_t)m->n_param * sizeof *over);
    if (len < 8 || mti_get_u32(lay + len - 4) != CK_SPARSE_MAGIC) return;
    const uint32_t ns = mti_get_u32(lay + len - 8);
    if ((uint64_t)ns * 32 > len - 8) return;
    const unsigned char *e = lay + len - 8 - (size_t)ns * 32;
    for (uint32_t k = 0; k < ns; k++, e += 32) {
        const uint32_t i = mti_get_u32(e);
        if (i >= (uint32_t)m->n_param || mti_get_u64(e + 16) != mti_param_dense(&m->params[i]))
            continue;
        mti_sp_layout L;
        if (!mti_sp_layout_of(NULL, (mti_sp_format)mti_get_u32(e + 4), mti_get_u64(e + 16),
                              mti_get_u64(e + 24), (int)mti_get_u32(e + 8),
                              (int)mti_get_u32(e + 12), &L))
            over[i] = L;
    }
}

/* Pipeline parallel: the whole model's stored tensors in file order, every
 * stage's list (mine: this rank's n, its stage's; NULL when it could not be
 * made) put together over the pipeline group, each stage's tied copy left
 * out (the first stage's table is the one stored). This stage's entries
 * keep their tensors; the others' have none (param -1), except on the last
 * stage the table's, which point at its copy's (loading fills both). A
 * collective of the group, whose calls are the same on every rank whatever
 * fails on one (host memory), which then fails every rank. */
static mt_status whole_list(mt_trainer *t, const ck_tensor *mine, int n, ck_tensor **out,
                            int *nout)
{
    mt_context *ctx = t->ctx;
    const mti_pp *pp = &t->pp;
    const int P = pp->size;
    const char *what = "pipeline parallel: the stages' stored tensors";
    enum { F = 6, CH = 170 }; /* whole index, role, dtype, bytes in three 16-bit pieces:
                                 exact in fp32; CH entries an exchange */
    *out = NULL;
    *nout = 0;
    float cnt[P + 1], e[CH * F];
    memset(cnt, 0, sizeof cnt);
    for (int k = 0; mine && k < n; k++) cnt[pp->rank] += mine[k].param != pp->tied;
    cnt[P] = !mine;
    mt_status s = pp->comm ? mti_comm_group_host_all_reduce(ctx, pp->comm, what, cnt,
                                                            (size_t)P + 1, MT_COMM_SUM)
                           : MT_OK;
    if (s) return s;
    int total = 0, before = 0;
    for (int q = 0; q < P; q++) total += (int)cnt[q], before += q < pp->rank ? (int)cnt[q] : 0;
    ck_tensor *w = calloc((size_t)total + 1, sizeof *w);
    bool failed = cnt[P] > 0 || !w;
    int next = 0; /* (this rank's entries, in order) */
    for (int j0 = 0; j0 < total && !s; j0 += CH) {
        const int m = total - j0 < CH ? total - j0 : CH;
        memset(e, 0, sizeof e);
        for (int j = j0; mine && j < j0 + m; j++) {
            if (j < before || j >= before + (int)cnt[pp->rank]) continue;
            while (mine[next].param == pp->tied) next++;
            const ck_tensor *c = &mine[next++];
            float *f = e + (size_t)(j - j0) * F;
            f[0] = (float)c->wparam, f[1] = (float)c->what, f[2] = (float)c->dtype;
            for (int q = 0; q < 3; q++) f[3 + q] = (float)((c->bytes >> (16 * q)) & 0xffff);
        }
        if (pp->comm) s = mti_comm_group_host_all_reduce(ctx, pp->comm, what, e, (size_t)m * F, MT_COMM_SUM);
        for (int j = j0, st = 0, end = (int)cnt[0]; !s && w && j < j0 + m; j++) {
            while (j >= end && st + 1 < P) end += (int)cnt[++st];
            const float *f = e + (size_t)(j - j0) * F;
            ck_tensor *c = &w[j];
            *c = (ck_tensor){NULL, -1, (int)f[0], st, (int)f[1], (mti_dtype)(int)f[2], 0, {0}};
            for (int q = 0; q < 3; q++) c->bytes |= (uint64_t)f[3 + q] << (16 * q);
            for (int k = 0; mine && k < n; k++) /* (this stage's, or the last stage's copy of the table) */
                if (mine[k].wparam == c->wparam && mine[k].what == c->what &&
                    (st == pp->rank || mine[k].param == pp->tied)) {
                    c->t = mine[k].t, c->param = mine[k].param;
                    break;
                }
        }
    }
    /* (a rank without its list or room for the whole one fails every rank) */
    float bad = failed;
    if (!s && pp->comm)
        s = mti_comm_group_host_all_reduce(ctx, pp->comm, what, &bad, 1, MT_COMM_SUM);
    if (!s && bad > 0.0f)
        s = mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory on %s", what,
                     failed ? "this rank" : "a rank of the pipeline group");
    if (s) {
        free(w);
        return s;
    }
    *out = w;
    *nout = total;
    return MT_OK;
}

static void counters_of(const mt_trainer *t, bbuf *b)
{
    bb_u64(b, t->steps);
    bb_u64(b, t->opt_steps);
    bb_u64(b, t->steps_skipped);
    bb_u32(b, (uint32_t)t->last_skipped);
    uint32_t f;
    memcpy(&f, &t->last_norm, 4);
    bb_u32(b, f);
    memcpy(&f, &t->scaler.scale, 4);
    bb_u32(b, f);
    bb_u32(b, (uint32_t)t->scaler.growth_tracker);
}

/* The inverse of counters_of. */
static void counters_set(mt_trainer *t, const unsigned char *p)
{
    t->steps = mti_get_u64(p);
    t->opt_steps = mti_get_u64(p + 8);
    t->steps_skipped = mti_get_u64(p + 16);
    t->last_skipped = (int)mti_get_u32(p + 24);
    uint32_t f = mti_get_u32(p + 28);
    memcpy(&t->last_norm, &f, 4);
    f = mti_get_u32(p + 32);
    memcpy(&t->scaler.scale, &f, 4);
    t->scaler.growth_tracker = (int)mti_get_u32(p + 36);
}

/* ---- save ---- */

/* A section header, its own CRC included. */
static void section_header(unsigned char *h, uint32_t kind, uint32_t index, uint64_t n,
                           uint32_t crc, uint32_t dtype)
{
    memset(h, 0, CK_SECTION);
    mti_put_u32(h, kind);
    mti_put_u32(h + 4, index);
    mti_put_u64(h + 8, n);
    mti_put_u32(h + 16, crc);
    mti_put_u32(h + 20, dtype);
    mti_put_u32(h + 24, mti_crc32(0, h, 24));
}

/* Saving: rank 0 writes the file; under ZeRO the other ranks send it
 * their parts of the sharded tensors (one broadcast per chunk, in rank
 * order, so the file is the whole tensor in order). A failure to write
 * (rank 0's) or to read a part (any rank's) is kept in *ws while every rank
 * goes on making the same collectives; only a failed collective stops. */
typedef struct saver {
    mt_trainer *t;
    mti_afile f;
    unsigned char *buf;  /* CK_CHUNK, host */
    mti_tensor bk;       /* a device communicator's bounce buffer (CK_CHUNK) */
    bool collective;     /* ZeRO on more than one rank */
    bool tp;             /* tensor parallel: a collective of the tensor group, whose
                            first rank writes the whole tensors */
    float *whole;        /* tensor parallel: the writer's whole tensor being put together */
    bool pp;             /* pipeline parallel: a collective of the pipeline group too; each
                            stage's writer sends its tensors' sections to the first stage's,
                            which writes the file */
    mt_status cs;        /* a failed exchange of those */
    unsigned char *pend; /* a later stage's writer: payload bytes not sent yet (CK_CHUNK) */
    size_t pend_n;
    mt_status ws;        /* this rank's first local failure */
} saver;

/* The rank holding the bytes to write (pipeline parallel: its stage's). */
static bool writer(const saver *v)
{
    return v->tp ? v->t->tp.rank == 0 : v->t->rank == 0 || !v->collective;
}

/* The rank writing the file. */
static bool file_writer(const saver *v) { return writer(v) && (!v->pp || v->t->pp.rank == 0); }

static void sv_write(saver *v, const void *data, size_t n)
{
    if (file_writer(v) && !v->ws && n) v->ws = mti_afile_write(v->t->ctx, &v->f, data, n);
}

/* n bytes (at most CK_CHUNK) of host memory between the stages' writers:
 * sent to the first stage (send), or received from stage `from` (recv);
 * through the device bounce buffer for a device communicator. */
static mt_status pp_move(saver *v, const void *send, void *recv, size_t n, int from)
{
    mt_context *ctx = v->t->ctx;
    mti_device *d = ctx->dev;
    const char *what = "mt_trainer_save: a stage's tensors to the first stage";
    mt_comm *c = v->t->pp.comm;
    if (!v->bk.blk.ptr)
        return mti_comm_group_sendrecv(ctx, c, what, send, send ? n : 0, send ? 0 : -1, recv,
                                       recv ? n : 0, recv ? from : -1, true);
    mt_status s = MT_OK, ls = MT_OK;
    if (send) ls = d->copy_h2d(d, v->bk.blk.ptr, send, n);
    if (send && !ls) ls = d->sync(d);
    if (ls && !v->ws) v->ws = ls; /* (what went is then the bounce buffer's: the files agree after) */
    s = mti_comm_group_sendrecv(ctx, c, what, send ? v->bk.blk.ptr : NULL, send ? n : 0,
                                send ? 0 : -1, recv ? v->bk.blk.ptr : NULL, recv ? n : 0,
                                recv ? from : -1, false);
    if (!s && recv) ls = d->copy_d2h(d, recv, v->bk.blk.ptr, n);
    if (!s && recv && !ls) ls = d->sync(d);
    if (ls && !v->ws) v->ws = ls; /* (a local failure: the exchanges go on, paired) */
    return s;
}

/* Whether this rank sends its tensors' sections to the first stage's writer. */
static bool sender(const saver *v) { return v->pp && v->t->pp.rank != 0 && writer(v); }

/* A tensor section's payload bytes: written, or (a sender) sent to the
 * first stage's writer in pieces of CK_CHUNK of the payload, whatever the
 * pieces it is given and whatever this rank's failures (the exchanges stay
 * paired; emit_flush sends the last piece). */
static void emit(saver *v, const void *data, size_t n)
{
    if (!sender(v)) return sv_write(v, data, n);
    for (size_t at = 0; at < n && !v->cs;) {
        const size_t len = n - at < CK_CHUNK - v->pend_n ? n - at : CK_CHUNK - v->pend_n;
        if (data) memcpy(v->pend + v->pend_n, (const char *)data + at, len);
        else memset(v->pend + v->pend_n, 0, len);
        v->pend_n += len, at += len;
        if (v->pend_n == CK_CHUNK) v->cs = pp_move(v, v->pend, NULL, CK_CHUNK, 0), v->pend_n = 0;
    }
}

static void emit_flush(saver *v)
{
    if (sender(v) && v->pend_n && !v->cs) v->cs = pp_move(v, v->pend, NULL, v->pend_n, 0);
    v->pend_n = 0;
}

/* A section header of a tensor: written, or (a sender) sent alone. */
static void emit_header(saver *v, const unsigned char *h)
{
    if (!sender(v)) return sv_write(v, h, CK_SECTION);
    emit_flush(v);
    if (!v->cs) v->cs = pp_move(v, h, NULL, CK_SECTION, 0);
}

/* The first stage's writer: a later stage's tensor section (emit's pieces:
 * the header, the payload, the header with the payload's CRC) into the
 * file. */
static mt_status relay_tensor(saver *v, const ck_tensor *c)
{
    mt_trainer *t = v->t;
    mt_context *ctx = t->ctx;
    unsigned char h[CK_SECTION];
    off_t at_header = -1;
    if (!v->ws && (at_header = lseek(v->f.fd, 0, SEEK_CUR)) < 0) {
        v->ws = mti_fail(ctx, MT_ERR_IO, "writing '%s': %s", v->f.path, strerror(errno));
        mti_afile_abort(&v->f);
    }
    mt_status cs = pp_move(v, NULL, h, sizeof h, c->stage);
    if (!cs) sv_write(v, h, sizeof h);
    for (uint64_t at = 0; at < c->bytes && !cs; at += CK_CHUNK) {
        const size_t n = c->bytes - at < CK_CHUNK ? (size_t)(c->bytes - at) : CK_CHUNK;
        cs = pp_move(v, NULL, v->buf, n, c->stage);
        if (!cs) sv_write(v, v->buf, n);
    }
    if (!cs) cs = pp_move(v, NULL, h, sizeof h, c->stage);
    if (!cs && !v->ws && (mti_get_u32(h + 4) != (uint32_t)c->wparam ||
                          mti_get_u64(h + 8) != c->bytes))
        v->ws = mti_fail(ctx, MT_ERR_INTERNAL, "mt_trainer_save: a stage's tensor out of order");
    if (!cs && !v->ws && pwrite(v->f.fd, h, sizeof h, at_header) != (ssize_t)sizeof h) {
        v->ws = mti_fail(ctx, MT_ERR_IO, "writing '%s': %s", v->f.path, strerror(errno));
        mti_afile_abort(&v->f);
    }
    return cs;
}

static void sv_section(saver *v, uint32_t kind, const void *data, size_t n)
{
    unsigned char h[CK_SECTION];
    section_header(h, kind, 0, n, mti_crc32(0, data, n), 0);
    sv_write(v, h, sizeof h);
    sv_write(v, data, n);
}

/* Bytes [at, at + n) of rank r's part of an offloaded tensor (at home on
 * disk, lib/train/offload.c: read there on rank r) into v->buf on the writer.
 * Returns a communication failure. */
static mt_status fetch_home(saver *v, const ck_tensor *c, int r, uint64_t at, size_t n)
{
    mt_trainer *t = v->t;
    mt_status ls = MT_OK;
    if ((!v->collective || t->rank == r) && !v->ws)
        ls = mti_offload_read(t->off, c->param, c->what, at, v->buf, n);
    if (ls && !v->ws) v->ws = ls;
    if (!v->collective || r == 0) return MT_OK; /* (the writer's own) */
    char what[64];
    snprintf(what, sizeof what, "mt_trainer_save: sending rank %d's part", r);
    return mti_comm_broadcast(t->ctx, what, v->buf, n, MT_COMM_BYTE, r);
}

/* Bytes [at, at + n) of rank r's part (src: its local memory, on rank r;
 * under tensor parallel, rank r of the tensor group) into v->buf on the
 * writer. Returns a communication failure. */
static mt_status fetch(saver *v, int r, const char *src, size_t n)
{
    mt_context *ctx = v->t->ctx;
    mti_device *d = ctx->dev;
    const bool many = v->collective || v->tp;
    const int me = v->tp ? v->t->tp.rank : v->t->rank;
    const bool mine = !many || me == r, to_me = writer(v);
    mt_status ls = MT_OK;
    if (r == 0 || !many) { /* the writer's own */
        if (mine) {
            ls = d->copy_d2h(d, v->buf, src, n);
            if (!ls) ls = d->sync(d);
        }
        if (ls && !v->ws) v->ws = ls;
        return MT_OK;
    }
    char what[64];
    snprintf(what, sizeof what, "mt_trainer_save: sending rank %d's part", r);
    mt_status cs;
    /* (the tensor group's communicator under tensor parallel, else the context's) */
    mt_comm *c = v->tp ? v->t->tp_comm : ctx->cfg.comm;
    if (v->bk.blk.ptr) { /* a device communicator: through device memory */
        if (mine) ls = d->copy_d2d(d, v->bk.blk.ptr, src, n);
        cs = mti_comm_group_broadcast(ctx, c, what, v->bk.blk.ptr, n, MT_COMM_BYTE, r);
        if (!cs && to_me) ls = d->copy_d2h(d, v->buf, v->bk.blk.ptr, n);
        if (!cs && to_me && !ls) ls = d->sync(d);
    } else { /* a host one: host memory, through the context's staging */
        if (mine) ls = d->copy_d2h(d, v->buf, src, n);
        if (mine && !ls) ls = d->sync(d);
        cs = mti_comm_group_broadcast(ctx, c, what, v->buf, n, MT_COMM_BYTE, r);
    }
    if (ls && !v->ws) v->ws = ls;
    return cs;
}

/* Tensor parallel: the whole of a split parameter's stored tensor put
 * together in v->whole on the writer, each rank's part broadcast over the
 * tensor group a chunk at a time and placed run by run. */
typedef struct place {
    char *whole;
    const char *chunk;
    size_t es, lo, hi; /* the chunk's elements of the part */
} place;

static mt_status place_run(void *user, size_t whole_at, size_t len, size_t off)
{
    const place *p = user;
    memcpy(p->whole + whole_at * p->es, p->chunk + off * p->es, len * p->es);
    return MT_OK;
}

static mt_status gather_split(saver *v, const ck_tensor *c)
{
    mt_trainer *t = v->t;
    const mti_param *p = &t->model->params[c->param];
    const size_t es = mti_dtype_size(c->dtype);
    const int T = t->tp.size;
    for (int q = 0; q < T; q++) {
        int64_t pr, pc;
        mti_tp_part_shape((mti_tp_split)p->tp_split, p->whole_shape[0], p->whole_shape[1], T, q,
                          &pr, &pc);
        const size_t bytes = (size_t)(pr * pc) * es;
        for (size_t at = 0; at < bytes; at += CK_CHUNK) {
            const size_t n = bytes - at < CK_CHUNK ? bytes - at : CK_CHUNK;
            mt_status cs = fetch(v, q, (const char *)c->t->blk.ptr + at, n);
            if (cs) return cs;
            place pl = {(char *)v->whole, (const char *)v->buf, es, at / es, (at + n) / es};
            if (writer(v) && !v->ws)
                (void)mti_tp_each_run(p, T, q, pl.lo, pl.hi - pl.lo, place_run, &pl);
        }
    }
    return MT_OK;
}

/* A stored tensor as a section: the header goes first without the
 * payload's CRC, which is written into it once the payload is out. */
static mt_status write_tensor(saver *v, const ck_tensor *c)
{
    mt_trainer *t = v->t;
    mt_context *ctx = t->ctx;
    unsigned char h[CK_SECTION];
    section_header(h, SEC_TENSOR, (uint32_t)c->wparam, c->bytes, 0, (uint32_t)c->dtype);
    off_t at_header = -1;
    if (file_writer(v) && !v->ws && (at_header = lseek(v->f.fd, 0, SEEK_CUR)) < 0) {
        v->ws = mti_fail(ctx, MT_ERR_IO, "writing '%s': %s", v->f.path, strerror(errno));
        mti_afile_abort(&v->f);
    }
    emit_header(v, h);
    uint32_t crc = 0;
    uint64_t done = 0;
    if (v->tp && t->model->params[c->param].tp_split) { /* the parts, whole */
        free(v->whole);
        v->whole = writer(v) ? malloc(c->bytes ? (size_t)c->bytes : 1) : NULL;
        if (writer(v) && !v->whole && !v->ws) v->ws = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
        mt_status cs = gather_split(v, c);
        if (cs) return cs;
        if (writer(v) && !v->ws) crc = mti_crc32(0, v->whole, (size_t)c->bytes);
        emit(v, v->whole, (size_t)c->bytes);
        done = c->bytes;
        free(v->whole);
        v->whole = NULL;
    }
    const int ranks = done ? 0 : v->collective && sharded(t, c) ? t->world : 1;
    for (int r = 0; r < ranks; r++) {
        uint64_t off, len;
        if (ranks > 1) held(t, c, r, &off, &len);
        else off = 0, len = c->bytes;
        if (len && off != done)
            return mti_fail(ctx, MT_ERR_INTERNAL, "mt_trainer_save: parts out of order");
        for (uint64_t at = 0; at < len; at += CK_CHUNK) {
            size_t n = len - at < CK_CHUNK ? (size_t)(len - at) : CK_CHUNK;
            if (t->off && (c->what || mti_offload_has_weights(t->off, c->param))) {
                /* at home on disk (lib/train/offload.c): rank r's part */
                mt_status cs = fetch_home(v, c, r, at, n);
                if (cs) return cs;
            } else {
                mt_status cs = fetch(v, r, (const char *)c->t->blk.ptr + at, n);
                if (cs) return cs;
            }
            if (writer(v) && !v->ws) crc = mti_crc32(crc, v->buf, n);
            emit(v, v->buf, n);
        }
        done += len;
    }
    if (done != c->bytes) return mti_fail(ctx, MT_ERR_INTERNAL, "mt_trainer_save: parts missing");
    section_header(h, SEC_TENSOR, (uint32_t)c->wparam, c->bytes, crc, (uint32_t)c->dtype);
    if (file_writer(v) && !v->ws && pwrite(v->f.fd, h, sizeof h, at_header) != (ssize_t)sizeof h) {
        v->ws = mti_fail(ctx, MT_ERR_IO, "writing '%s': %s", v->f.path, strerror(errno));
        mti_afile_abort(&v->f);
    }
    if (sender(v)) emit_header(v, h); /* (the CRC: after the payload) */
    return v->cs;
}

mt_status mt_trainer_save(const mt_trainer *tc, const char *path, const void *user, size_t user_len)
{
    const char *fn = "mt_trainer_save";
    if (!tc) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: trainer is NULL", fn);
    mt_trainer *t = (mt_trainer *)tc; /* read only: the list points into it */
    mt_context *ctx = t->ctx;
    if (t->tp.size > 1 || t->pp.size > 1) {
        mt_status ts_ok = t->pp.size > 1 ? mti_pp_files_ok(t, fn) : MT_OK;
        if (!ts_ok && t->tp.size > 1) ts_ok = mti_tp_files_ok(t, fn);
        if (ts_ok) return ts_ok;
        /* the tensor (and pipeline) groups of data-parallel rank 0 write; the
           others' calls do nothing (their state is the same), but under ZeRO
           (pipeline parallel's), where they send their slices */
        if (t->rank != 0 && !t->zero) return MT_OK;
    }
    saver v = {.t = t, .collective = t->zero != 0, .tp = t->tp.size > 1, .pp = t->pp.size > 1,
               .f = {.fd = -1}};
    if (v.collective && !mti_dp_on(t))
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: a dry context's sharded trainer has no state to save", fn);
    /* path and user are the writer's (rank 0's under ZeRO); a bad one there
       still takes part in the collectives, so the other ranks hear of it */
    if (file_writer(&v) && !path) v.ws = mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: path is NULL", fn);
    else if (file_writer(&v) && !user && user_len)
        v.ws = mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: user is NULL but user_len is %zu", fn,
                        user_len);
    if (v.ws && !v.collective && !v.tp && !v.pp) return v.ws;
    if (!file_writer(&v)) user = NULL, user_len = 0; /* (never written here) */
    int n = list_tensors(t, NULL, NULL), nw = n;
    ck_tensor *ts = malloc((size_t)n * sizeof *ts + 1), *ws = ts;
    v.buf = malloc(CK_CHUNK);
    bbuf lay = {0}, cnt = {0};
    mt_status cs = MT_OK;
    if (ts) list_tensors(t, ts, NULL);
    /* (pipeline parallel: the whole model's list, from every stage) */
    if (v.pp) cs = whole_list(t, ts, n, &ws, &nw);
    if (ws) layout_of(t, ws, nw, &lay);
    counters_of(t, &cnt);
    if (v.pp) v.pend = malloc(CK_CHUNK); /* (a sender's pieces: before any exchange) */
    bool oom = !ts || !ws || !v.buf || (v.pp && !v.pend) || lay.oom || cnt.oom;
    if (oom && !v.ws && !cs) v.ws = mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    if (cs) oom = true;
    if (!oom && v.collective && (ctx->cfg.comm->vt.caps & MT_COMM_CAP_DEVICE))
        cs = mti_comm_buffer(ctx, &v.bk, CK_CHUNK);
    if (!oom && !v.bk.blk.ptr && v.tp && t->tp_comm && (t->tp_comm->vt.caps & MT_COMM_CAP_DEVICE))
        cs = mti_comm_buffer(ctx, &v.bk, CK_CHUNK);
    if (!oom && !cs && !v.bk.blk.ptr && v.pp && t->pp.comm &&
        (t->pp.comm->vt.caps & MT_COMM_CAP_DEVICE))
        cs = mti_comm_buffer(ctx, &v.bk, CK_CHUNK);
    if (v.collective) { /* a rank that cannot start (host memory, the bounce buffer) fails
                           every rank before any part moves */
        const mt_status st = mti_dp_agree_status(t, fn, "preparing the training-state file",
                                                 cs ? cs : oom ? (v.ws ? v.ws : MT_ERR_OOM) : MT_OK);
        if (st && !cs) cs = st;
        if (st && !v.ws) v.ws = st;
    }
    if (v.tp) { /* one rank's failure to start fails the group before any part moves */
        cs = mti_tp_agree_status(t, fn, "preparing the training-state file", cs ? cs : v.ws);
        if (cs && !v.ws) v.ws = cs;
    }
    if (v.pp) { /* ... and the pipeline group */
        cs = mti_pp_agree(t, fn, "preparing the training-state file", cs ? cs : v.ws);
        if (cs && !v.ws) v.ws = cs;
    }
    if (v.ws && !v.collective && !v.tp && !v.pp) cs = v.ws; /* alone: nothing to keep in step with */
    if (!oom && !cs) {
        uint64_t total = CK_SECTION * (uint64_t)(nw + 4) + lay.len + cnt.len + user_len;
        for (int k = 0; k < nw; k++) total += ws[k].bytes;
        unsigned char h[CK_HEADER] = {0};
        memcpy(h, CK_MAGIC, 8);
        mti_put_u32(h + 8, CK_VERSION);
        mti_put_u32(h + 12, (uint32_t)(nw + 4));
        mti_put_u64(h + 16, total);
        mti_put_u32(h + 24, mti_crc32(0, h, 24));
        if (file_writer(&v) && !v.ws) v.ws = mti_afile_open(ctx, path, &v.f);
        sv_write(&v, h, sizeof h);
        sv_section(&v, SEC_LAYOUT, lay.p, lay.len);
        sv_section(&v, SEC_COUNTERS, cnt.p, cnt.len);
        /* (pipeline parallel: each stage its own tensors, the copy of the table
           left out; the first stage's writer then puts the others' in, in
           stage order) */
        for (int k = 0; k < n && !cs && (v.collective || v.tp || v.pp || !v.ws); k++)
            if (!v.pp || ts[k].param != t->pp.tied) cs = write_tensor(&v, &ts[k]);
        for (int k = 0; k < nw && !cs && v.pp && file_writer(&v); k++)
            if (ws[k].stage != 0) cs = relay_tensor(&v, &ws[k]);
        sv_section(&v, SEC_USER, user, user_len);
        sv_section(&v, SEC_END, NULL, 0);
    } else if (!cs) {
        cs = v.ws;
    }
    mt_status s = cs ? cs : v.ws;
    if (!cs && v.collective) /* every rank learns whether every part was read and written */
        s = mti_dp_agree_status(t, fn, "writing the training-state file", v.ws);
    if (!cs && v.tp) s = mti_tp_agree_status(t, fn, "writing the training-state file", v.ws);
    if (!cs && v.pp) s = mti_pp_agree(t, fn, "writing the training-state file", s);
    if (!s && file_writer(&v)) s = mti_afile_commit(ctx, &v.f);
    else if (v.f.fd >= 0) mti_afile_abort(&v.f);
    if (!cs && v.collective) s = mti_dp_agree_status(t, fn, "putting the training-state file in place", s);
    if (!cs && v.tp) s = mti_tp_agree_status(t, fn, "putting the training-state file in place", s);
    if (!cs && v.pp) s = mti_pp_agree(t, fn, "putting the training-state file in place", s);
    mti_tensor_free(ctx, &v.bk);
    if (ws != ts) free(ws);
    free(ts), free(v.buf), free(v.whole), free(v.pend), free(lay.p), free(cnt.p);
    if (s) {
        const mti_msg m = mti_last_msg(ctx); /* (an exchange's names the call already) */
        const bool named = !strncmp(m.s, fn, strlen(fn)) && !strncmp(m.s + strlen(fn), ": ", 2);
        const char *at = file_writer(&v) ? path : "rank 0's path";
        return mti_fail(ctx, s, "%s%s%s%s%s%s", named ? "" : fn, named ? "" : ": ", m.s,
                        at ? " (the previous file at " : "", at ? at : "",
                        at ? ", if any, is intact)" : "");
    }
    return MT_OK;
}

/* ---- what differs between a saved layout and this trainer's ---- */

/* An optimizer as messages say it, from the optimizers' table (optim.c). */
static const char *optimizer_str(uint32_t v)
{
    const mti_optim *o = v < 64 ? mti_optim_of((mt_optimizer_kind)v) : NULL;
    return o ? o->title : "unknown";
}

static const char *precision_str(uint32_t v)
{
    const char *n = mti_precision_name(v);
    return n ? n : "unknown";
}

static const char *dtype_str(uint32_t v)
{
    static const char *const names[] = {"fp32", "fp16", "bf16", "int32", "uint8"};
    _Static_assert(sizeof names / sizeof *names == MTI_U8 + 1, "a name per mti_dtype");
    return v < sizeof names / sizeof *names ? names[v] : "unknown";
}

/* A stored tensor's role (layout_of's `what`). */
static void role_str(char *b, size_t cap, uint32_t what)
{
    if (what == 0) snprintf(b, cap, "weights");
    else if (what == 1) snprintf(b, cap, "master");
    else if (what == CK_MASK) snprintf(b, cap, "mask");
    else snprintf(b, cap, "state %u", what - 2);
}

/* A layout section read field by field (layout_of's order); ok is false
 * once a read would pass its end. */
typedef struct lay_rd {
    const unsigned char *p;
    size_t len, at;
    bool ok;
} lay_rd;

static uint32_t lr_u32(lay_rd *r)
{
    if (!r->ok || r->len - r->at < 4) return r->ok = false, 0;
    r->at += 4;
    return mti_get_u32(r->p + r->at - 4);
}

static uint64_t lr_u64(lay_rd *r)
{
    if (!r->ok || r->len - r->at < 8) return r->ok = false, 0;
    r->at += 8;
    return mti_get_u64(r->p + r->at - 8);
}

/* A parameter's name, shape and elements; name gets MTI_NAME_LEN bytes. */
static void lr_param(lay_rd *r, char *name, uint64_t *rows, uint64_t *cols, uint64_t *numel)
{
    if (!r->ok || r->len - r->at < MTI_NAME_LEN) {
        r->ok = false;
        name[0] = 0;
        return;
    }
    memcpy(name, r->p + r->at, MTI_NAME_LEN);
    name[MTI_NAME_LEN - 1] = 0;
    r->at += MTI_NAME_LEN;
    *rows = lr_u64(r), *cols = lr_u64(r), *numel = lr_u64(r);
}

static void shape_str(char *b, size_t cap, uint64_t rows, uint64_t cols)
{
    if (cols) snprintf(b, cap, "(%llu x %llu)", (unsigned long long)rows, (unsigned long long)cols);
    else snprintf(b, cap, "(%llu)", (unsigned long long)rows);
}

/* The frozen-parameter lists of two layouts (each reader at its stored
 * tensors' list, of fk and ok entries): when they differ, says in m the
 * first parameter frozen in one and not the other (named from this
 * trainer's layout, mine) and returns true. */
static bool frozen_diff(lay_rd fs, lay_rd os, uint32_t fk, uint32_t ok, const bbuf *mine,
                        char *m, size_t cap)
{
    fs.at += (size_t)fk * 20, os.at += (size_t)ok * 20;
    if (fs.at > fs.len || os.at > os.len) return false;
    uint32_t fnf = fs.at < fs.len ? lr_u32(&fs) : 0, onf = os.at < os.len ? lr_u32(&os) : 0;
    uint32_t fi = 0, oi = 0, np = mti_get_u32(mine->p + 28);
    uint32_t fx = fnf ? lr_u32(&fs) : UINT32_MAX, ox = onf ? lr_u32(&os) : UINT32_MAX;
    while (fs.ok && (fi < fnf || oi < onf)) {
        if (fx != ox) {
            uint32_t p = fx < ox ? fx : ox;
            char name[MTI_NAME_LEN] = "?";
            if (p < np) snprintf(name, sizeof name, "%s", (const char *)mine->p + 32 +
                                                            (size_t)p * (MTI_NAME_LEN + 24));
            snprintf(m, cap, "saved with another frozen set (cfg.freeze, LoRA): parameter %u "
                     "'%s' is %s in the file, %s in this trainer", p, name,
                     fx < ox ? "frozen" : "trained", fx < ox ? "trained" : "frozen");
            return true;
        }
        fx = ++fi < fnf ? lr_u32(&fs) : UINT32_MAX;
        ox = ++oi < onf ? lr_u32(&os) : UINT32_MAX;
    }
    return false;
}

/* Says in m which setting of the saved layout (f) differs from this
 * trainer's (o), with both values: the model's sizes, the optimizer, the
 * precision, the master-weight setting, a parameter's name or shape, or a
 * stored tensor's dtype or size (8-bit or 32-bit optimizer state). */
static void layout_diff(const unsigned char *file, size_t flen, const bbuf *mine, char *m,
                        size_t cap)
{
    static const char *const model_fields[8] = {
        "kind (0 layers, 1 MLP, 2 GPT)", "input kind", "features", "vocabulary",
        "padded vocabulary", "longest sequence", "layers", "parameter tensors"};
    lay_rd f = {file, flen, 0, true}, o = {mine->p, mine->len, 0, true};
    uint32_t fn = 0, on = 0;
    uint32_t kind = 0;
    for (int i = 0; i < 8; i++) {
        uint32_t a = lr_u32(&f), b = lr_u32(&o);
        if (i == 0) kind = a;
        if (f.ok && a != b && i == 6 && kind == 2 && a >= 3 && b >= 3) { /* a GPT: the blocks */
            snprintf(m, cap, "saved for another model: its transformer blocks (layers) is %u in "
                     "the file, %u in this model", a - 3, b - 3);
            return;
        }
        if (f.ok && a != b) {
            snprintf(m, cap, "saved for another model: its %s is %u in the file, %u in this model",
                     model_fields[i], a, b);
            return;
        }
        fn = a, on = b;
    }
    /* the trainer's settings come after the parameters */
    lay_rd fs = f, os = o;
    fs.at += (size_t)fn * (MTI_NAME_LEN + 24);
    os.at += (size_t)on * (MTI_NAME_LEN + 24);
    if (fs.at > fs.len) fs.ok = false;
    uint32_t fo = lr_u32(&fs), oo = lr_u32(&os), fp = lr_u32(&fs), op = lr_u32(&os);
    uint32_t fb = lr_u32(&fs), ob = lr_u32(&os);
    if (fs.ok && fo != oo) {
        snprintf(m, cap, "saved with another optimizer: %s in the file, %s in this trainer",
                 optimizer_str(fo), optimizer_str(oo));
        return;
    }
    if (fs.ok && fp != op) {
        snprintf(m, cap, "saved in another precision: %s in the file, %s in this trainer",
                 precision_str(fp), precision_str(op));
        return;
    }
    if (fs.ok && fb != ob) {
        snprintf(m, cap, "saved with another master-weight setting: %s in the file, %s in this "
                 "trainer", fb ? "no master weights" : "master weights",
                 ob ? "no master weights" : "master weights");
        return;
    }
    char fname[MTI_NAME_LEN], oname[MTI_NAME_LEN], fsh[48], osh[48];
    for (uint32_t i = 0; i < on && f.ok; i++) {
        uint64_t fr = 0, fc = 0, fe = 0, orr = 0, oc = 0, oe = 0;
        lr_param(&f, fname, &fr, &fc, &fe);
        lr_param(&o, oname, &orr, &oc, &oe);
        if (!f.ok) break;
        shape_str(fsh, sizeof fsh, fr, fc);
        shape_str(osh, sizeof osh, orr, oc);
        if (strcmp(fname, oname) || fr != orr || fc != oc || fe != oe) {
            snprintf(m, cap, "saved for another model shape: parameter %u is '%s' %s in the "
                     "file, '%s' %s in this model", i, fname, fsh, oname, osh);
            return;
        }
    }
    uint32_t fk = lr_u32(&fs), ok = lr_u32(&os);
    if (frozen_diff(fs, os, fk, ok, mine, m, cap)) return;
    for (uint32_t k = 0; k < ok && k < fk && fs.ok; k++) {
        uint32_t fpar = lr_u32(&fs), opar = lr_u32(&os), frole = lr_u32(&fs), orole = lr_u32(&os);
        uint32_t fdt = lr_u32(&fs), odt = lr_u32(&os);
        uint64_t fby = lr_u64(&fs), oby = lr_u64(&os);
        if (!fs.ok) break;
        if (fpar == opar && frole == 0 && orole == 0 && (fdt != odt || fby != oby)) {
            snprintf(m, cap, "saved with other weights' storage: parameter %u's weights are %s, "
                     "%llu bytes in the file; %s, %llu bytes in this trainer (a quantized base, "
                     "cfg.base: its weights are uint8 bytes, int8 and NF4 of different sizes)",
                     fpar, dtype_str(fdt), (unsigned long long)fby, dtype_str(odt),
                     (unsigned long long)oby);
            return;
        }
        if (fpar != opar || frole != orole || fdt != odt || fby != oby) {
            char fw[24], ow[24];
            role_str(fw, sizeof fw, frole);
            role_str(ow, sizeof ow, orole);
            snprintf(m, cap, "saved with other optimizer state: stored tensor %u is parameter "
                     "%u's %s, %s, %llu bytes in the file; parameter %u's %s, %s, %llu bytes "
                     "in this trainer (8-bit or 32-bit state: min_8bit_size, overrides)",
                     k, fpar, fw, dtype_str(fdt), (unsigned long long)fby, opar, ow,
                     dtype_str(odt), (unsigned long long)oby);
            return;
        }
    }
    if (fs.ok && fk != ok) {
        snprintf(m, cap, "saved with other optimizer state: %u stored tensors in the file, %u "
                 "in this trainer", fk, ok);
        return;
    }
    snprintf(m, cap, "saved for another trainer layout (the layout section differs from this "
             "trainer's)");
}

/* ---- load ---- */

typedef struct reader {
    FILE *f;
    const char *path;
    mt_context *ctx;
    uint64_t size, pos;
    uint64_t digest; /* the file's header and section headers hashed (each holds
                        its payload's CRC): what the ranks compare */
} reader;

static mt_status bad_file(reader *r, const char *what)
{
    return mti_fail(r->ctx, MT_ERR_FORMAT, "mt_trainer_load: %s: %s (the trainer is unchanged)",
                    r->path, what);
}

static mt_status read_exact(reader *r, void *dst, size_t n, const char *what)
{
    if (n > r->size - r->pos) return bad_file(r, what);
    if (n && fread(dst, 1, n, r->f) != n) return bad_file(r, what);
    r->pos += n;
    return MT_OK;
}

typedef struct sec {
    uint32_t kind, index, crc, dtype;
    uint64_t bytes;
} sec;

static mt_status read_section_header(reader *r, sec *s)
{
    unsigned char h[CK_SECTION];
    mt_status st = read_exact(r, h, sizeof h, "truncated (a section header is cut off)");
    if (st) return st;
    if (mti_get_u32(h + 24) != mti_crc32(0, h, 24) || mti_get_u32(h + 28))
        return bad_file(r, "corrupt (a section header's CRC does not match)");
    r->digest = mti_hash(r->digest, h, sizeof h);
    s->kind = mti_get_u32(h), s->index = mti_get_u32(h + 4), s->bytes = mti_get_u64(h + 8);
    s->crc = mti_get_u32(h + 16), s->dtype = mti_get_u32(h + 20);
    if (s->kind != SEC_TENSOR && (s->index || s->dtype))
        return bad_file(r, "corrupt (a section other than a tensor has a nonzero index or dtype)");
    if (s->bytes > r->size - r->pos)
        return bad_file(r, "truncated (a section is longer than what is left of the file)");
    return MT_OK;
}

/* Reads a section's payload in chunks, checking its CRC; each chunk goes
 * to sink (may be NULL) at its offset. */
typedef mt_status (*sink_fn)(void *user, uint64_t at, const unsigned char *p, size_t n);

static mt_status read_payload(reader *r, const sec *s, unsigned char *buf, sink_fn sink, void *user)
{
    uint32_t crc = 0;
    for (uint64_t at = 0; at < s->bytes;) {
        size_t len = s->bytes - at < CK_CHUNK ? (size_t)(s->bytes - at) : CK_CHUNK;
        mt_status st = read_exact(r, buf, len, "truncated");
        if (st) return st;
        crc = mti_crc32(crc, buf, len);
        if (sink && (st = sink(user, at, buf, len))) return st;
        at += len;
    }
    if (crc != s->crc) return bad_file(r, "corrupt (a section's CRC does not match)");
    return MT_OK;
}

/* A section's bytes [off, off + len) into dst (this rank's part of a
 * stored tensor). */
typedef struct upload {
    mt_context *ctx;
    char *dst;
    uint64_t off, len;
    struct mti_offload *off_home; /* or the tensor's home on disk: */
    int param, what;
} upload;

static mt_status upload_sink(void *user, uint64_t at, const unsigned char *p, size_t n)
{
    upload *u = user;
    mti_device *d = u->ctx->dev;
    uint64_t lo = at > u->off ? at : u->off, hi = at + n < u->off + u->len ? at + n : u->off + u->len;
    if (lo < hi && u->off_home)
        return mti_offload_write(u->off_home, u->param, u->what, lo - u->off, p + (lo - at),
                                 (size_t)(hi - lo)); /* (the rank's part, from its start) */
    return lo < hi ? d->copy_h2d(d, u->dst + (lo - u->off), p + (lo - at), (size_t)(hi - lo)) : MT_OK;
}

/* Tensor parallel: the whole tensor's bytes [at, at + n) streaming past,
 * this rank's part's elements of them into dst (context memory). */
typedef struct part_up {
    mt_context *ctx;
    const mti_param *p;
    int T, q;
    char *dst;
    size_t es;
    const unsigned char *chunk;
    size_t c0, c1; /* the chunk's elements of the whole */
} part_up;

static mt_status part_run(void *user, size_t whole_at, size_t len, size_t off)
{
    const part_up *u = user;
    const size_t lo = whole_at > u->c0 ? whole_at : u->c0;
    const size_t hi = whole_at + len < u->c1 ? whole_at + len : u->c1;
    if (lo >= hi) return MT_OK;
    mti_device *d = u->ctx->dev;
    return d->copy_h2d(d, u->dst + (off + (lo - whole_at)) * u->es, u->chunk + (lo - u->c0) * u->es,
                       (hi - lo) * u->es);
}

static mt_status part_sink(void *user, uint64_t at, const unsigned char *p, size_t n)
{
    part_up *u = user;
    u->chunk = p;
    u->c0 = (size_t)at / u->es;
    u->c1 = (size_t)(at + n) / u->es;
    return mti_tp_each_run(u->p, u->T, u->q, 0, u->p->numel, part_run, u);
}

typedef struct grab {
    unsigned char *dst;
    size_t cap;
} grab;

static mt_status grab_sink(void *user, uint64_t at, const unsigned char *p, size_t n)
{
    grab *g = user;
    if (at < g->cap) memcpy(g->dst + at, p, n < g->cap - at ? n : (size_t)(g->cap - at));
    return MT_OK;
}

/* One pass over the file. check: verify everything, change nothing;
 * else: copy the state in. */
static mt_status pass(reader *r, mt_trainer *t, const ck_tensor *ts, int n, const bbuf *lay,
                      unsigned char *buf, bool check, unsigned char *counters, void *user,
                      size_t user_cap, size_t *user_len)
{
    unsigned char h[CK_HEADER];
    mt_status s = read_exact(r, h, sizeof h, "too short for a training checkpoint");
    if (s) return s;
    if (memcmp(h, CK_MAGIC, 8)) return bad_file(r, "not a memtrain training checkpoint");
    if (mti_get_u32(h + 24) != mti_crc32(0, h, 24)) return bad_file(r, "corrupt header");
    r->digest = mti_hash(MTI_HASH_START, h, sizeof h);
    if (mti_get_u32(h + 28)) return bad_file(r, "corrupt header (bytes 28..31 are not 0)");
    if (mti_get_u32(h + 8) != CK_VERSION) {
        char m[96];
        snprintf(m, sizeof m, "format version %u, this library reads version %u", mti_get_u32(h + 8),
                 CK_VERSION);
        return bad_file(r, m);
    }
    if (mti_get_u64(h + 16) + CK_HEADER != r->size)
        return bad_file(r, mti_get_u64(h + 16) + CK_HEADER > r->size ? "truncated"
                                                              : "longer than its header says");
    const uint32_t nsec = mti_get_u32(h + 12);
    sec c;
    /* layout */
    if ((s = read_section_header(r, &c))) return s;
    if (c.kind != SEC_LAYOUT) return bad_file(r, "corrupt (no layout section first)");
    if (c.bytes > ((uint64_t)64 << 20)) return bad_file(r, "corrupt (an absurd layout section)");
    unsigned char *got = malloc(c.bytes ? (size_t)c.bytes : 1);
    if (!got) return mti_fail(r->ctx, MT_ERR_OOM, "mt_trainer_load: out of host memory");
    grab g = {got, (size_t)c.bytes};
    s = read_payload(r, &c, buf, grab_sink, &g);
    if (!s && (c.bytes != lay->len || memcmp(got, lay->p, lay->len))) {
        char m[MTI_ERR_LEN - 128];
        layout_diff(got, (size_t)c.bytes, lay, m, sizeof m);
        s = mti_fail(r->ctx, MT_ERR_INVALID_ARG, "mt_trainer_load: %s: %s (the trainer is "
                     "unchanged)", r->path, m);
    }
    free(got);
    if (s) return s;
    if (nsec != (uint32_t)n + 4) return bad_file(r, "corrupt (the section count)");
    /* counters */
    if ((s = read_section_header(r, &c))) return s;
    if (c.kind != SEC_COUNTERS || c.bytes != CK_COUNTERS) return bad_file(r, "corrupt (counters)");
    grab gc = {counters, CK_COUNTERS};
    if ((s = read_payload(r, &c, buf, grab_sink, &gc))) return s;
    /* tensors */
    for (int k = 0; k < n; k++) {
        if ((s = read_section_header(r, &c))) return s;
        if (c.kind != SEC_TENSOR || c.index != (uint32_t)ts[k].wparam ||
            c.dtype != (uint32_t)ts[k].dtype || c.bytes != ts[k].bytes)
            return bad_file(r, "corrupt (a tensor section does not match the layout)");
        if (ts[k].param < 0) { /* (pipeline parallel: another stage's) */
            if ((s = read_payload(r, &c, buf, NULL, NULL))) return s;
            continue;
        }
        if (ts[k].what == CK_MASK) { /* a pruned weight's mask: checked, then taken */
            unsigned char *meta = malloc((size_t)c.bytes + 8);
            uint64_t *keep = malloc(mti_sp_words(ts[k].sp.dense) * 8 + 8);
            unsigned char *again = malloc((size_t)c.bytes + 8);
            grab gm = {meta, (size_t)c.bytes};
            s = meta && keep && again ? read_payload(r, &c, buf, grab_sink, &gm)
                                      : mti_fail(r->ctx, MT_ERR_OOM, "mt_trainer_load: out of host memory");
            if (!s) {
                mti_sp_decode(&ts[k].sp, meta, keep);
                if (mti_sp_encode(&ts[k].sp, keep, again) || memcmp(again, meta, (size_t)c.bytes))
                    s = bad_file(r, "corrupt (a pruned weight's mask does not keep what its "
                                    "layout says)");
            }
            if (!s && !check) s = mti_sparsity_adopt(t, ts[k].param, &ts[k].sp, meta);
            free(meta), free(keep), free(again);
            if (s) return s;
            continue;
        }
        const mti_param *p = &t->model->params[ts[k].param];
        if (p->tp_split) { /* tensor parallel: this rank's part of the whole */
            part_up pu = {r->ctx, p, t->tp.size, t->tp.rank, ts[k].t->blk.ptr,
                          mti_dtype_size(ts[k].dtype), NULL, 0, 0};
            if ((s = read_payload(r, &c, buf, check ? NULL : part_sink, &pu))) return s;
            continue;
        }
        const bool home = ts[k].what || mti_offload_has_weights(t->off, ts[k].param);
        upload u = {r->ctx, ts[k].t->blk.ptr, 0, 0, home ? t->off : NULL, ts[k].param, ts[k].what};
        held(t, &ts[k], t->rank, &u.off, &u.len);
        if ((s = read_payload(r, &c, buf, check ? NULL : upload_sink, &u))) return s;
    }
    /* user bytes */
    if ((s = read_section_header(r, &c))) return s;
    if (c.kind != SEC_USER) return bad_file(r, "corrupt (no user section)");
    grab gu = {user, user ? user_cap : 0};
    if ((s = read_payload(r, &c, buf, check ? NULL : grab_sink, &gu))) return s;
    if (user_len) *user_len = (size_t)c.bytes;
    if ((s = read_section_header(r, &c))) return s;
    if (c.kind != SEC_END || c.bytes) return bad_file(r, "corrupt (no end section)");
    if (r->pos != r->size) return bad_file(r, "corrupt (bytes after the end)");
    return MT_OK;
}

/* The pruned layouts the file's layout section names (sparse_tail), read
 * ahead of the passes; a file that cannot be read that far names none
 * (the check pass then says what is wrong). */
static void file_masks(reader *r, const mt_trainer *t, mti_sp_layout *over)
{
    unsigned char h[CK_HEADER];
    sec c;
    unsigned char *buf = malloc(CK_CHUNK);
    if (buf && !read_exact(r, h, sizeof h, "") && !read_section_header(r, &c) &&
        c.kind == SEC_LAYOUT && c.bytes <= ((uint64_t)64 << 20)) {
        unsigned char *got = malloc(c.bytes ? (size_t)c.bytes : 1);
        grab g = {got, (size_t)c.bytes};
        if (got && !read_payload(r, &c, buf, grab_sink, &g)) sparse_tail(t, got, (size_t)c.bytes, over);
        free(got);
    }
    free(buf);
    rewind(r->f);
    r->pos = 0;
    mti_clear_error(r->ctx);
}

mt_status mt_trainer_load(mt_trainer *t, const char *path, void *user, size_t user_cap,
                          size_t *user_len)
{
    const char *fn = "mt_trainer_load";
    if (!t) return mti_fail(NULL, MT_ERR_INVALID_ARG, "%s: trainer is NULL", fn);
    mt_context *ctx = t->ctx;
    /* on several ranks a rank that cannot start still makes the exchanges
       below, so every rank fails with it at once (tensor parallel: each
       rank reads the whole file and takes its parts) */
    mt_status s = t->pp.size > 1 ? mti_pp_files_ok(t, fn) : MT_OK;
    if (!s && t->tp.size > 1) s = mti_tp_files_ok(t, fn);
    if (s) return s; /* (the same on every rank) */
    if (!path) s = mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: path is NULL", fn);
    else if (!user && user_cap)
        s = mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: user is NULL but user_cap is %zu", fn,
                     user_cap);
    reader r = {.path = path, .ctx = ctx};
    if (!s && !(r.f = fopen(path, "rb")))
        s = mti_fail(ctx, MT_ERR_IO, "%s: cannot open %s: %s", fn, path, strerror(errno));
    if (s && !mti_dp_on(t) && t->tp.size < 2 && t->pp.size < 2) return s;
    if (r.f && fseek(r.f, 0, SEEK_END) == 0) {
        long end = ftell(r.f);
        r.size = end > 0 ? (uint64_t)end : 0;
    }
    if (r.f) rewind(r.f);
    /* the pruned weights take the file's masks: the list as it will be */
    mti_sp_layout *over = calloc((size_t)t->model->n_param + 1, sizeof *over);
    if (over && r.f && !s) file_masks(&r, t, over);
    for (int i = 0; over && !s && i < t->model->n_param; i++) {
        const mti_param *p = &t->model->params[i];
        if (over[i].fmt && (!p->linear || p->qf || p->adapter_of >= 0))
            over[i].fmt = 0; /* (not a weight this trainer could prune: the layouts differ) */
        if (over[i].fmt) s = mti_sparsity_can_adopt(t, i, &over[i], fn);
    }
    int n = list_tensors(t, NULL, over), nw = n;
    ck_tensor *ts = malloc((size_t)n * sizeof *ts + 1), *ws = ts;
    unsigned char *buf = malloc(CK_CHUNK), counters[CK_COUNTERS];
    bbuf lay = {0};
    if (ts) list_tensors(t, ts, over);
    if (!over && !s) s = mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    /* (pipeline parallel: the whole model's list, from every stage; a
       collective of the group, made whatever happened before) */
    if (t->pp.size > 1) {
        mt_status e = whole_list(t, ts, n, &ws, &nw);
        if (!s) s = e;
    }
    if (ws) layout_of(t, ws, nw, &lay);
    if (!s && (!ts || !ws || !buf || lay.oom)) s = mti_fail(ctx, MT_ERR_OOM, "%s: out of host memory", fn);
    /* first pass: check everything; second: copy it in (each rank its part);
       on several ranks, any rank's failure fails every rank, before any
       rank changes anything */
    if (!s) s = pass(&r, t, ws, nw, &lay, buf, true, counters, NULL, 0, NULL);
    /* (over the data-parallel group, then the tensor group, whose ranks are
       one of each data-parallel group: every rank hears of any failure, and
       of any file that differs, before any rank changes anything) */
    s = mti_dp_agree_status(t, fn, "checking the training-state file", s);
    if (!s) s = mti_dp_agree_file(t, fn, r.digest); /* every rank loads the same file */
    s = mti_tp_agree_file(t, fn, r.digest, s);
    s = mti_pp_agree_file(t, fn, r.digest, s);
    if (!s) {
        rewind(r.f);
        r.pos = 0;
        s = pass(&r, t, ws, nw, &lay, buf, false, counters, user, user_cap, user_len);
        if (s) {
            s = mti_fail(ctx, s, "%s: loading %s failed part-way (the file changed while it "
                         "was read, or memory ran out taking its masks); the trainer's state is "
                         "partly loaded: load a good file again before training (%s)",
                         fn, path, mti_last_msg(ctx).s);
        }
    }
    s = mti_dp_agree_status(t, fn, "loading the training-state file", s);
    s = mti_tp_agree_status(t, fn, "loading the training-state file", s);
    s = mti_pp_agree(t, fn, "loading the training-state file", s);
    if (!s) counters_set(t, counters);
    if (r.f) fclose(r.f);
    if (ws != ts) free(ws);
    free(ts), free(buf), free(lay.p), free(over);
    return s;
}
