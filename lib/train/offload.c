/*
 * offload.c - optimizer state and master weights at home on disk.
 *
 * Each trained parameter's state tensors (its optimizer's layout, lib/optim/optim.h)
 * and, in mixed precision, its fp32 master live in two scratch files,
 * optim.bin (OPTIM) and master.bin (MASTER), in a directory of their own,
 * offload_dir/memtrain-scratch, beside a lock file naming the process that
 * owns it (lib/train/scratch.c). Every tensor has a region of its file starting at a multiple of
 * ALIGN, so pieces can be moved with O_DIRECT.
 *
 * The update is cut into pieces on a fixed grid: mti_offload_piece_elems
 * (2^19) elements of a parameter whose optimizer updates slices (a
 * multiple of every slice alignment, so each piece's update is the bits of
 * the whole tensor's), the whole tensor otherwise. SLOTS piece buffers on the device (OPTIM for the
 * state, MASTER for the master; SLOTS_WHOLE of whole tensors) hold the piece
 * being updated, the last one being written back and the next ones being
 * read; two I/O threads move them with pread/pwrite while the update and
 * backward compute. The order of the pieces
 * is learned: each piece remembers the piece that came after it last time
 * (the next step asks for them in the same order), and the first step
 * guesses the next piece in storage order.
 *
 * The buffers are made when the trainer is made and live as long, so the
 * device's figures do not depend on the order or the timing of the I/O; a
 * dry context makes them and counts the files' bytes on disk (mt_place)
 * without touching a file, which keeps the estimate exact per place.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "train/offload.h"

#define ALIGN 4096u               /* O_DIRECT's offsets, lengths and addresses */

#define SLOTS 6      /* piece buffers at most: updated, written back, read ahead */
#define SLOTS_WHOLE 3 /* with whole-tensor pieces: updated, written back, the next */
#define THREADS 2

int (*mti_offload_fault)(int write, const char *path, uint64_t off, size_t *n) = NULL;

enum { F_OPTIM = 0, F_MASTER = 1, F_PARAM = 2, F_COUNT = 3 };
static const char *const file_name[] = {"optim.bin", "master.bin", "param.bin"};
static const mt_mem_class file_class[] = {MT_MEM_OPTIM, MT_MEM_MASTER, MT_MEM_PARAM};
_Static_assert(sizeof file_name / sizeof *file_name == F_COUNT &&
                   sizeof file_class / sizeof *file_class == F_COUNT,
               "a name and a class per file");
#define LSLOTS 2 /* a layer's weights (offload_params): the one running, the next */

/* A slot's life: FREE -> READING -> CLEAN -> (acquired) DIRTY -> WRITING ->
 * CLEAN ... ; the I/O threads own a slot while it is READING or WRITING. */
enum { S_FREE, S_READING, S_CLEAN, S_DIRTY, S_WRITING };

typedef struct off_param {
    size_t piece;                  /* elements per piece; 0: nothing offloaded */
    size_t lo, hi;                 /* this rank's elements (ZeRO 1 and 2: its shard) */
    size_t k0;                     /* the grid's piece holding element lo */
    int first, count;              /* its pieces in the global numbering */
    uint64_t st_off[MTI_OPT_SLOTS]; /* its state's regions in optim.bin (this rank's
                                      elements' state) */
    int64_t st0[MTI_OPT_SLOTS];    /* the state element of element lo */
    uint64_t m_off;                /* its master's region in master.bin */
    uint64_t w_off;                /* its weights' region in param.bin (offload_params) */
    size_t w0, wn;                 /* the region's elements: [w0, w0 + wn) (the whole
                                      tensor; ZeRO-3: this rank's slice) */
    int home;                      /* its weights live in param.bin */
    int placed;                    /* ... and have gone there (put_params) */
} off_param;

typedef struct off_slot {
    mt_block stb, msb, pwb; /* OPTIM: a piece's state tensors, MASTER: its master,
                          PARAM: its weights (offload_params) (the
                          blocks: ALIGN more than they hold, at the default alignment,
                          so that their place does not depend on the addresses) */
    char *st, *ms, *pw; /* where they start: a multiple of ALIGN in the blocks, each
                          state tensor at a multiple of ALIGN after st */
    int piece;        /* -1: none */
    int state;
    uint64_t used;    /* when it was last acquired (least recently used goes first) */
    int err;          /* the last I/O's errno; -1 the file was removed, -2 truncated,
                         -3 it ended early */
    int err_file, err_write;
} off_slot;

/* A layer's weights brought in for its forward or backward (offload_params):
 * FREE -> READING -> CLEAN (holding `layer`'s weights until dropped). */
typedef struct lay_slot {
    mt_block b;
    char *p;        /* a multiple of ALIGN in b */
    uint64_t cap;   /* bytes it holds */
    int layer;      /* -1: none */
    int state;
    uint64_t used;
    int err;
} lay_slot;

struct mti_offload {
    mt_trainer *t;
    mt_context *ctx;
    int masters;            /* the masters live here too */
    int params;             /* and the trained weights (offload_params) */
    uint64_t w_bytes;       /* a piece's weights (the update slots' PARAM buffers) */
    int dry;                /* no files: bytes counted, nothing moved */
    mti_scratch sc;         /* the directory (lib/train/scratch.c) */
    char path[F_COUNT][PATH_MAX + 16];
    int fd[F_COUNT];        /* O_DIRECT where the file system takes it */
    int fdb[F_COUNT];       /* buffered: unaligned transfers */
    int made[F_COUNT], counted[F_COUNT];
    uint64_t bytes[F_COUNT]; /* each file's size, counted on disk */
    off_param *pp;
    int n_pieces;
    int *param_of;          /* piece -> parameter */
    int *next;              /* piece -> the piece acquired after it last time (-1: none) */
    int last;               /* the piece acquired last */
    off_slot slot[SLOTS];
    int n_slots;            /* SLOTS, or SLOTS_WHOLE when pieces are whole tensors */
    int cur;                /* the slot acquired last (-1: none) */
    uint64_t tick;
    /* where the acquired piece's tensors are in its slot */
    size_t cur_at, cur_boff[MTI_OPT_SLOTS], cur_es[MTI_OPT_SLOTS];
    int64_t cur_per[MTI_OPT_SLOTS], cur_start[MTI_OPT_SLOTS];
    /* the I/O threads and their queue (slots whose I/O is to start) */
    pthread_t th[THREADS];
    int n_th, stop;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int queue[SLOTS + LSLOTS], qn; /* (SLOTS + k: layer slot k) */
    /* offload_params: the layers' weights */
    lay_slot ls[LSLOTS];
    int *lnext;             /* (layer, bwd) -> the one brought in after it last time */
    int lkey_last, lkey_first; /* this step's last and first (-1: none yet) */
    int io_err, io_file, io_wr; /* the first failed I/O (kept until it is reported) */
    mt_status failed;       /* MT_ERR_IO once the files are lost */
    char why[600];
};

static uint64_t up(uint64_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

static void lay_submit(mti_offload *o, int k, int layer);
static mt_status drop_slots(mti_offload *o);
static int lay_victim(mti_offload *o, int keep, int wait, int layer);

/* ---- geometry ---- */

/* The bytes of slot j's state for elements [at, at + n) of parameter i, and
 * where they start in its state tensor (elements). */
static uint64_t state_part(const mti_offload *o, int i, int j, size_t at, size_t n, int64_t *start)
{
    const mti_opt_state *l = &o->t->ps[i].lay.s[j];
    *start = l->per > 0 ? (int64_t)at / l->per : 0;
    return (uint64_t)mti_optim_state_numel(l, at, n) * mti_dtype_size(l->dtype);
}

/* Piece k of the grid of parameter i, cut to this rank's elements. */
static void grid_piece(const off_param *q, size_t k, size_t *at, size_t *n)
{
    const size_t a = k * q->piece, b = a + q->piece < q->hi ? a + q->piece : q->hi;
    *at = a > q->lo ? a : q->lo;
    *n = b - *at;
}

static void piece_range(const mti_offload *o, int p, int *i, size_t *at, size_t *n)
{
    *i = o->param_of[p];
    const off_param *q = &o->pp[*i];
    grid_piece(q, q->k0 + (size_t)(p - q->first), at, n);
}

/* Bytes of slot j's state (j >= 0) or of the master (-1) of this rank's
 * elements of parameter i. */
static uint64_t region_bytes(const mti_offload *o, int i, int j)
{
    const off_param *q = &o->pp[i];
    if (j < 0) return (uint64_t)(q->hi - q->lo) * 4;
    const mti_opt_state *l = &o->t->ps[i].lay.s[j];
    return (uint64_t)mti_optim_state_numel(l, q->lo, q->hi - q->lo) * mti_dtype_size(l->dtype);
}

/* Lays out the files and the pieces; sizes the slots. */
static mt_status plan(mti_offload *o, uint64_t *st_bytes, uint64_t *m_bytes, uint64_t *w_bytes)
{
    mt_trainer *t = o->t;
    const mt_model *m = t->model;
    const size_t wes = mti_dtype_size(t->dt); /* the trained weights' dtype */
    o->pp = calloc((size_t)m->n_param, sizeof *o->pp);
    if (!o->pp) return mti_fail(o->ctx, MT_ERR_OOM, "out of host memory");
    int np = 0;
    *st_bytes = *m_bytes = *w_bytes = 0;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t fo[F_COUNT] = {0};
        np = 0;
        for (int i = 0; i < m->n_param; i++) {
            const mti_param *p = &m->params[i];
            off_param *q = &o->pp[i];
            q->lo = t->sh[i].lo, q->hi = t->sh[i].hi; /* (all of it on one rank) */
            if (p->frozen) continue; /* no state; its weights stay in memory */
            /* every trained weight whole in param.bin, also one whose state
               another rank holds (ZeRO 1 and 2: the weights are whole on
               every rank; the gathers write the others' slices here) */
            q->home = o->params;
            q->w_off = fo[F_PARAM];
            q->w0 = t->zero == 3 ? q->lo : 0; /* (ZeRO-3: the rank's slice, its home) */
            q->wn = t->zero == 3 ? q->hi - q->lo : p->numel;
            if (o->params) fo[F_PARAM] += up((uint64_t)q->wn * wes);
            if (q->hi == q->lo) continue; /* no state here: another rank's */
            const size_t piece = t->opt->sliceable ? mti_offload_piece_elems : p->numel;
            q->piece = piece < p->numel ? piece : p->numel;
            q->first = np;
            q->k0 = q->lo / q->piece;
            q->count = (int)((q->hi - 1) / q->piece - q->k0 + 1);
            for (int j = 0; j < MTI_OPT_SLOTS; j++) {
                const mti_opt_state *l = &t->ps[i].lay.s[j];
                q->st_off[j] = fo[F_OPTIM];
                q->st0[j] = l->per > 0 ? (int64_t)q->lo / l->per : 0;
                fo[F_OPTIM] += up(region_bytes(o, i, j));
            }
            q->m_off = fo[F_MASTER];
            if (o->masters) fo[F_MASTER] += up(region_bytes(o, i, -1));
            for (int k = 0; k < q->count; k++, np++) {
                if (pass) o->param_of[np] = i;
                size_t at, n;
                grid_piece(q, q->k0 + (size_t)k, &at, &n);
                uint64_t b = 0;
                for (int j = 0; j < MTI_OPT_SLOTS; j++) {
                    int64_t s0;
                    b += up(state_part(o, i, j, at, n, &s0));
                }
                if (b > *st_bytes) *st_bytes = b;
                if (o->masters && up((uint64_t)n * 4) > *m_bytes) *m_bytes = up((uint64_t)n * 4);
                if (o->params && up((uint64_t)n * wes) > *w_bytes) *w_bytes = up((uint64_t)n * wes);
            }
        }
        o->bytes[F_OPTIM] = fo[F_OPTIM];
        o->bytes[F_MASTER] = fo[F_MASTER];
        o->bytes[F_PARAM] = fo[F_PARAM];
        if (!pass) {
            o->param_of = malloc((size_t)np * sizeof *o->param_of + 1);
            o->next = malloc((size_t)np * sizeof *o->next + 1);
            if (!o->param_of || !o->next) return mti_fail(o->ctx, MT_ERR_OOM, "out of host memory");
        }
    }
    o->n_pieces = np;
    for (int p = 0; p < np; p++) o->next[p] = p + 1 < np ? p + 1 : -1; /* storage order first */
    return MT_OK;
}

/* Closes and removes the files and the directory, and gives their bytes
 * back (on disk). */
static void remove_files(mti_offload *o)
{
    for (int f = 0; f < F_COUNT; f++) {
        if (o->fd[f] >= 0) close(o->fd[f]);
        if (o->fdb[f] >= 0) close(o->fdb[f]);
        o->fd[f] = o->fdb[f] = -1;
        if (o->made[f]) unlink(o->path[f]);
        if (o->counted[f]) mti_place_sub(o->ctx, MT_PLACE_DISK, file_class[f], o->bytes[f]);
        o->made[f] = o->counted[f] = 0;
    }
    mti_scratch_remove(&o->sc);
}

static mt_status make_file(mti_offload *o, int f)
{
    mt_context *ctx = o->ctx;
    snprintf(o->path[f], sizeof o->path[f], "%s/%s", o->sc.dir, file_name[f]);
    int fd = open(o->path[f], O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0600);
    if (fd < 0 && errno == EINVAL) /* no O_DIRECT on this file system */
        fd = open(o->path[f], O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return mti_fail(ctx, MT_ERR_IO, "offload: cannot make '%s': %s", o->path[f], strerror(errno));
    o->fd[f] = fd;
    o->made[f] = o->counted[f] = 1;
    mti_place_add(ctx, MT_PLACE_DISK, file_class[f], o->bytes[f]);
    o->fdb[f] = open(o->path[f], O_RDWR | O_CLOEXEC);
    if (o->fdb[f] < 0)
        return mti_fail(ctx, MT_ERR_IO, "offload: cannot open '%s': %s", o->path[f], strerror(errno));
    /* the whole file's blocks now: a disk too small fails here, not mid-run */
    int e = o->bytes[f] ? posix_fallocate(fd, 0, (off_t)o->bytes[f]) : 0;
    if (e == EOPNOTSUPP || e == EINVAL) e = ftruncate(fd, (off_t)o->bytes[f]) ? errno : 0;
    if (e)
        return mti_fail(ctx, MT_ERR_IO, "offload: cannot give '%s' its %llu bytes: %s", o->path[f],
                        (unsigned long long)o->bytes[f], strerror(e));
    return MT_OK;
}

/* ---- moving bytes ---- */

/* n bytes at off of file f, from or to buf: on the O_DIRECT descriptor
 * while the transfer is aligned, else the buffered one. Returns 0 or an
 * errno (-3: the file ended early). */
static int move(mti_offload *o, int f, int wr, void *buf, size_t n, uint64_t off)
{
    const int aligned = (uintptr_t)buf % ALIGN == 0 && n % ALIGN == 0 && off % ALIGN == 0;
    int fd = aligned ? o->fd[f] : o->fdb[f];
    size_t done = 0;
    while (done < n) {
        size_t len = n - done;
        int e = mti_offload_fault ? mti_offload_fault(wr, o->path[f], off + done, &len) : 0;
        ssize_t r;
        if (e) {
            errno = e;
            r = -1;
        } else if (wr) {
            r = pwrite(fd, (char *)buf + done, len, (off_t)(off + done));
        } else {
            r = pread(fd, (char *)buf + done, len, (off_t)(off + done));
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return wr ? ENOSPC : -3;
        done += (size_t)r;
        if ((size_t)r % ALIGN || (uintptr_t)buf % ALIGN) fd = o->fdb[f]; /* the rest, unaligned */
    }
    return 0;
}

/* The scratch file is there, as large as it was made (0), or -1 (removed)
 * or -2 (truncated); the errno of fstat otherwise. */
static int file_ok(const mti_offload *o, int f)
{
    struct stat sb;
    if (fstat(o->fd[f], &sb) != 0) return errno;
    if (sb.st_nlink == 0) return -1;
    if ((uint64_t)sb.st_size < o->bytes[f]) return -2;
    return 0;
}

/* A slot's piece in or out (an I/O thread, or the caller in tests). */
static void slot_io(mti_offload *o, off_slot *sl, int wr)
{
    int i;
    size_t at, n;
    piece_range(o, sl->piece, &i, &at, &n);
    const off_param *q = &o->pp[i];
    sl->err = 0;
    for (int f = 0; f < F_COUNT && !sl->err; f++)
        if (o->bytes[f] && (sl->err = file_ok(o, f))) sl->err_file = f;
    /* the tensor's last piece moves up to its region's end (aligned); the
       others their own bytes (aligned at the library's piece size) */
    const int last = at + n == q->hi;
    uint64_t boff = 0;
    for (int j = 0; j < MTI_OPT_SLOTS && !sl->err; j++) {
        int64_t s0;
        const uint64_t b = state_part(o, i, j, at, n, &s0);
        if (!b) continue;
        const size_t es = mti_dtype_size(o->t->ps[i].lay.s[j].dtype);
        const uint64_t fo = q->st_off[j] + (uint64_t)(s0 - q->st0[j]) * es;
        sl->err = move(o, F_OPTIM, wr, sl->st + boff, last && fo % ALIGN == 0 ? up(b) : b, fo);
        sl->err_file = F_OPTIM;
        boff += up(b);
    }
    if (!sl->err && o->masters) {
        const uint64_t fo = q->m_off + (uint64_t)(at - q->lo) * 4;
        sl->err = move(o, F_MASTER, wr, sl->ms, last && fo % ALIGN == 0 ? up((uint64_t)n * 4) : (uint64_t)n * 4, fo);
        sl->err_file = F_MASTER;
    }
    if (!sl->err && q->home) {
        /* (the weights' region holds the whole tensor, at ZeRO-3 the rank's
           slice: only its end pads, never into the next rank's elements,
           which the gathers write) */
        const int wlast = at + n == q->w0 + q->wn;
        const size_t wes = mti_dtype_size(o->t->dt);
        const uint64_t fo = q->w_off + (uint64_t)(at - q->w0) * wes;
        sl->err = move(o, F_PARAM, wr, sl->pw, wlast && fo % ALIGN == 0 ? up((uint64_t)n * wes) : (uint64_t)n * wes, fo);
        sl->err_file = F_PARAM;
    }
    sl->err_write = wr;
}

/* The parameters of layer `layer` whose weights live in param.bin (the
 * tied table at the LM head too), in the order they sit in its slot: *n
 * of them into idx (at most np + 1). */
static int lay_params(const mti_offload *o, int layer, int *idx)
{
    const mti_layer *ly = &o->t->model->layers[layer];
    int n = 0;
    for (int j = 0; j <= ly->np; j++) {
        const int i = j < ly->np ? ly->p0 + j : ly->tied;
        if (i >= 0 && o->pp[i].home) idx[n++] = i;
    }
    return n;
}

/* The bytes of parameter i's weights in param.bin (ZeRO-3: its slice's). */
static uint64_t weight_bytes(const mti_offload *o, int i)
{
    return (uint64_t)o->pp[i].wn * mti_dtype_size(o->t->dt);
}

/* A layer slot's weights read from param.bin (an I/O thread). Returns 0 or an errno. */
static int lay_io(mti_offload *o, lay_slot *l)
{
    int idx[MTI_SLOTS + 2], e = o->bytes[F_PARAM] ? file_ok(o, F_PARAM) : 0;
    const int n = lay_params(o, l->layer, idx);
    uint64_t off = 0;
    for (int k = 0; k < n && !e; k++) {
        const uint64_t b = up(weight_bytes(o, idx[k]));
        e = move(o, F_PARAM, 0, l->p + off, b, o->pp[idx[k]].w_off);
        off += b;
    }
    return e;
}

static void *io_thread(void *arg)
{
    mti_offload *o = arg;
    pthread_mutex_lock(&o->mu);
    for (;;) {
        while (!o->stop && !o->qn) pthread_cond_wait(&o->work, &o->mu);
        if (!o->qn) break; /* stopping, nothing queued */
        const int qs = o->queue[0];
        memmove(o->queue, o->queue + 1, (size_t)--o->qn * sizeof *o->queue);
        if (qs >= SLOTS) { /* a layer's weights in */
            lay_slot *l = &o->ls[qs - SLOTS];
            pthread_mutex_unlock(&o->mu);
            const int e = lay_io(o, l);
            pthread_mutex_lock(&o->mu);
            l->err = e;
            l->state = e ? S_FREE : S_CLEAN;
            if (e) l->layer = -1;
            if (e && !o->io_err) o->io_err = e, o->io_file = F_PARAM, o->io_wr = 0;
            pthread_cond_broadcast(&o->done);
            continue;
        }
        off_slot *sl = &o->slot[qs];
        const int wr = sl->state == S_WRITING;
        pthread_mutex_unlock(&o->mu);
        slot_io(o, sl, wr);
        pthread_mutex_lock(&o->mu);
        /* a failed read leaves nothing; a failed write leaves the piece dirty */
        sl->state = sl->err ? (wr ? S_DIRTY : S_FREE) : S_CLEAN;
        if (sl->err && !wr) sl->piece = -1;
        if (sl->err && !o->io_err) o->io_err = sl->err, o->io_file = sl->err_file, o->io_wr = wr;
        pthread_cond_broadcast(&o->done);
    }
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

/* Starts a slot's read (of piece p) or write. Called unlocked. */
static void submit(mti_offload *o, int s, int wr, int p)
{
    off_slot *sl = &o->slot[s];
    pthread_mutex_lock(&o->mu);
    if (!wr) sl->piece = p;
    sl->state = wr ? S_WRITING : S_READING;
    if (o->dry) { /* nothing to move */
        sl->state = S_CLEAN;
        sl->err = 0;
    } else {
        o->queue[o->qn++] = s;
        pthread_cond_signal(&o->work);
    }
    pthread_mutex_unlock(&o->mu);
}

/* Waits for a slot's I/O; returns its errno (0: done well). */
static int wait_slot(mti_offload *o, int s, int *state)
{
    off_slot *sl = &o->slot[s];
    pthread_mutex_lock(&o->mu);
    while (sl->state == S_READING || sl->state == S_WRITING) pthread_cond_wait(&o->done, &o->mu);
    int e = sl->err;
    sl->err = 0;
    if (state) *state = sl->state;
    pthread_mutex_unlock(&o->mu);
    return e;
}

static int state_of(mti_offload *o, int s)
{
    pthread_mutex_lock(&o->mu);
    int st = o->slot[s].state;
    pthread_mutex_unlock(&o->mu);
    return st;
}

/* Waits for layer slot k's read. */
static void lay_wait(mti_offload *o, int k)
{
    pthread_mutex_lock(&o->mu);
    while (o->ls[k].state == S_READING) pthread_cond_wait(&o->done, &o->mu);
    pthread_mutex_unlock(&o->mu);
}

/* Every layer slot emptied (its read waited for): the weights in param.bin
 * are about to change, or have. */
static void lay_drop(mti_offload *o)
{
    for (int k = 0; k < LSLOTS; k++) {
        lay_wait(o, k);
        o->ls[k].layer = -1;
        o->ls[k].state = S_FREE;
    }
    o->lkey_last = -1;
}

/* The files are lost: every I/O waited for, the files removed, and the
 * trainer told. Returns MT_ERR_IO with the message. */
static mt_status lose(mti_offload *o, int f, int wr, int e)
{
    char what[300];
    if (e == -1) snprintf(what, sizeof what, "the scratch file '%s' was removed", o->path[f]);
    else if (e == -2 || e == -3)
        snprintf(what, sizeof what, "the scratch file '%s' was truncated", o->path[f]);
    else snprintf(what, sizeof what, "%s '%s': %s", wr ? "writing" : "reading", o->path[f], strerror(e));
    for (int s = 0; s < o->n_slots; s++) {
        (void)wait_slot(o, s, NULL);
        o->slot[s].piece = -1;
        o->slot[s].state = S_FREE;
    }
    lay_drop(o);
    o->cur = -1;
    remove_files(o);
    o->failed = MT_ERR_IO;
    snprintf(o->why, sizeof o->why,
             "offload: %s; the offloaded optimizer state%s%s is lost and the scratch directory "
             "removed (load the last training-state file into a new trainer)",
             what, o->masters ? ", master weights" : "", o->params ? " and weights" : "");
    return mti_fail(o->ctx, MT_ERR_IO, "%s", o->why);
}

static mt_status lost(mti_offload *o) { return mti_fail(o->ctx, MT_ERR_IO, "%s", o->why); }

/* Waits for a slot and turns a failure (of any I/O so far) into MT_ERR_IO. */
static mt_status settle(mti_offload *o, int s)
{
    (void)wait_slot(o, s, NULL);
    pthread_mutex_lock(&o->mu);
    const int e = o->io_err, f = o->io_file, wr = o->io_wr;
    pthread_mutex_unlock(&o->mu);
    return e ? lose(o, f, wr, e) : MT_OK;
}

/* ---- create / destroy ---- */

mt_status mti_offload_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *c)
{
    const char *fn = "mt_trainer_create";
    if (c->offload_params != 0 && c->offload_params != 1)
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "%s: cfg->offload_params %d must be 0 or 1", fn,
                        c->offload_params);
    if (c->offload_params && c->offload == MT_PLACE_HOST)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: cfg->offload_params does not combine with cfg->offload host: the "
                        "weights stay on the device (at ZeRO stage 3 each rank's slice, 1/N of "
                        "them, which each layer's gather reads there); for weights that do not "
                        "fit, use cfg->offload disk", fn);
    if (c->offload_params && c->offload != MT_PLACE_DISK)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: cfg->offload_params needs cfg->offload disk (the weights' file "
                        "lives beside the optimizer state's)", fn);
    if (c->offload == MT_PLACE_DEVICE) return MT_OK;
    if ((unsigned)c->offload >= MT_PLACE_COUNT)
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: cfg->offload %d is not a place (device, host or disk)", fn, (int)c->offload);
    if (c->offload == MT_PLACE_HOST) return mti_hostoff_check(ctx, m, c); /* (offload_host.c) */
    if (ctx->dev->kind != MT_DEVICE_CPU)
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->offload disk is supported on CPU contexts only, for now", fn);
    if (ctx->world > 1 && c->local_sgd_every > 0 &&
        (c->offload_params || (c->precision != MT_PREC_FP32 && c->master_weights)))
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->local_sgd_every %d averages the %s across the ranks in memory, "
                        "and cfg->offload %s keeps them on disk: run local SGD with them "
                        "resident%s",
                        fn, c->local_sgd_every, c->offload_params ? "weights" : "fp32 masters",
                        c->offload_params ? "disk with cfg->offload_params" : "disk",
                        c->offload_params ? " (the state alone may stay on disk)"
                                          : " (or without masters)");
    if (c->offload_params && (c->lora.rank || m->lora_rank))
        return mti_fail(ctx, MT_ERR_UNSUPPORTED,
                        "%s: cfg->offload_params with LoRA is not supported (the adapters are "
                        "small: offload the state alone)", fn);
    if (!ctx->dry && (!c->offload_dir || !*c->offload_dir))
        return mti_fail(ctx, MT_ERR_INVALID_ARG,
                        "%s: cfg->offload disk needs cfg->offload_dir, the directory for the "
                        "scratch files",
                        fn);
    return MT_OK;
}

static mt_status slot_alloc(mt_context *ctx, mt_block *b, char **at, uint64_t bytes, mt_mem_class c,
                            int k)
{
    const mt_alloc_request req = {.bytes = bytes ? (size_t)bytes + ALIGN : 0,
                                  .alignment = MT_DEFAULT_ALIGNMENT,
                                  .mem_class = c,
                                  .lifetime = MT_LIFE_PERSISTENT,
                                  .tag = MTI_TAG_PARAM(MTI_TAG_TRAINER, 16 + k)};
    mt_status s = mt_context_alloc(ctx, &req, b);
    if (!s && bytes) s = ctx->dev->memset8(ctx->dev, b->ptr, 0, b->bytes);
    *at = bytes ? (char *)(((uintptr_t)b->ptr + ALIGN - 1) / ALIGN * ALIGN) : NULL;
    return s;
}

/* The fresh state (its layout's fill byte) in every region of optim.bin,
 * through slot 0's buffer. */
static mt_status write_fresh(mti_offload *o)
{
    mt_trainer *t = o->t;
    off_slot *sl = &o->slot[0];
    const size_t cap = sl->stb.bytes ? sl->stb.bytes - ALIGN : 0;
    for (int i = 0; i < t->model->n_param; i++) {
        if (!o->pp[i].piece) continue;
        for (int j = 0; j < MTI_OPT_SLOTS; j++) {
            const mti_opt_state *l = &t->ps[i].lay.s[j];
            const uint64_t b = up(region_bytes(o, i, j));
            if (b) memset(sl->st, l->fill, cap);
            for (uint64_t d = 0; d < b; d += cap) {
                const size_t n = b - d < cap ? (size_t)(b - d) : cap;
                int e = move(o, F_OPTIM, 1, sl->st, n, o->pp[i].st_off[j] + d);
                if (e) return lose(o, F_OPTIM, 1, e);
            }
        }
    }
    return MT_OK;
}

/* The bytes of layer `layer`'s weights in a layer slot. */
static uint64_t lay_bytes(const mti_offload *o, int layer)
{
    int idx[MTI_SLOTS + 2];
    const int n = lay_params(o, layer, idx);
    uint64_t b = 0;
    for (int k = 0; k < n; k++) b += up(weight_bytes(o, idx[k]));
    return b;
}

/* offload_params: the update slots' weights buffers (PARAM); with `layers`
 * the layer slots (PARAM): one as large as the largest layer's weights, the
 * other as the largest layer's without a token table (the blocks': the
 * table's layers, at the two ends, are never next to each other and go in
 * the first); and the first guess of the layers' order: forward up,
 * backward down. */
static mt_status lay_create(mti_offload *o, bool layers)
{
    mt_status s = MT_OK;
    for (int k = 0; k < o->n_slots && !s; k++)
        s = slot_alloc(o->ctx, &o->slot[k].pwb, &o->slot[k].pw, o->w_bytes, MT_MEM_PARAM, 2 * SLOTS + k);
    if (s || !layers) return s;
    const mt_model *m = o->t->model;
    const int L = m->n_layers;
    uint64_t most = 0, other = 0;
    for (int l = 0; l < L; l++) {
        const mti_layer *ly = &m->layers[l];
        const uint64_t b = lay_bytes(o, l);
        if (b > most) most = b;
        if (ly->kind != MT_LAYER_EMBEDDING && ly->tied < 0 && b > other) other = b;
    }
    if (!(o->lnext = malloc((size_t)(2 * L) * sizeof *o->lnext + 1)))
        return mti_fail(o->ctx, MT_ERR_OOM, "out of host memory");
    for (int l = 0; l < L; l++) {
        o->lnext[2 * l] = l + 1 < L ? 2 * (l + 1) : 2 * l + 1;
        o->lnext[2 * l + 1] = l > 0 ? 2 * (l - 1) + 1 : -1;
    }
    o->ls[0].cap = most;
    o->ls[1].cap = other ? other : most;
    for (int k = 0; k < LSLOTS && !s; k++)
        s = slot_alloc(o->ctx, &o->ls[k].b, &o->ls[k].p, o->ls[k].cap, MT_MEM_PARAM, 3 * SLOTS + k);
    return s;
}

mt_status mti_offload_create(mt_trainer *t, int masters, mti_offload **out)
{
    mt_context *ctx = t->ctx;
    mti_offload *o = calloc(1, sizeof *o);
    if (!o) return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    o->t = t;
    o->ctx = ctx;
    o->masters = masters;
    o->params = t->cfg.offload_params != 0;
    o->dry = ctx->dry;
    o->cur = o->last = -1;
    o->lkey_last = o->lkey_first = -1;
    for (int k = 0; k < LSLOTS; k++) o->ls[k].layer = -1;
    o->n_slots = t->opt->sliceable ? SLOTS : SLOTS_WHOLE;
    for (int f = 0; f < F_COUNT; f++) o->fd[f] = o->fdb[f] = -1;
    for (int s = 0; s < SLOTS; s++) o->slot[s].piece = -1; /* (all of them: find) */
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->work, NULL);
    pthread_cond_init(&o->done, NULL);
    *out = o; /* (destroyed by the trainer on failure) */
    uint64_t st_bytes = 0, m_bytes = 0;
    mt_status s = plan(o, &st_bytes, &m_bytes, &o->w_bytes);
    for (int k = 0; k < o->n_slots && !s; k++) {
        off_slot *sl = &o->slot[k];
        s = slot_alloc(ctx, &sl->stb, &sl->st, st_bytes, MT_MEM_OPTIM, 2 * k);
        if (!s) s = slot_alloc(ctx, &sl->msb, &sl->ms, m_bytes, MT_MEM_MASTER, 2 * k + 1);
    }
    if (s) return s;
    if (o->dry) { /* the files' bytes, without the files */
        for (int f = 0; f < F_COUNT; f++) {
            mti_place_add(ctx, MT_PLACE_DISK, file_class[f], o->bytes[f]);
            o->counted[f] = 1;
        }
        return MT_OK;
    }
    s = mti_scratch_make(ctx, t->cfg.offload_dir, file_name, F_COUNT, &o->sc);
    for (int f = 0; f < F_COUNT && !s; f++) s = make_file(o, f);
    if (!s) s = write_fresh(o);
    for (int k = 0; k < THREADS && !s; k++) {
        if (pthread_create(&o->th[k], NULL, io_thread, o) != 0)
            s = mti_fail(ctx, MT_ERR_OOM, "offload: cannot start an I/O thread");
        else o->n_th++;
    }
    return s;
}

/* Frees the slots' and the layer slots' buffers (the I/O threads idle). */
static void free_buffers(mti_offload *o)
{
    for (int s = 0; s < o->n_slots; s++) {
        off_slot *sl = &o->slot[s];
        if (sl->stb.ptr) mt_context_free(o->ctx, &sl->stb);
        if (sl->msb.ptr) mt_context_free(o->ctx, &sl->msb);
        if (sl->pwb.ptr) mt_context_free(o->ctx, &sl->pwb);
        memset(&sl->stb, 0, sizeof sl->stb), memset(&sl->msb, 0, sizeof sl->msb);
        memset(&sl->pwb, 0, sizeof sl->pwb);
        sl->st = sl->ms = sl->pw = NULL;
    }
    for (int k = 0; k < LSLOTS; k++) {
        if (o->ls[k].b.ptr) mt_context_free(o->ctx, &o->ls[k].b);
        memset(&o->ls[k].b, 0, sizeof o->ls[k].b);
        o->ls[k].p = NULL;
        o->ls[k].cap = 0;
    }
}

void mti_offload_drain(mti_offload *o)
{
    if (!o) return;
    if (!o->failed) (void)drop_slots(o); /* (a failure is logged by what reads after) */
    lay_drop(o);
    free_buffers(o);
}

void mti_offload_destroy(mti_offload *o)
{
    if (!o) return;
    if (!o->failed) (void)mti_offload_end(o);
    pthread_mutex_lock(&o->mu);
    o->stop = 1;
    pthread_cond_broadcast(&o->work);
    pthread_mutex_unlock(&o->mu);
    for (int k = 0; k < o->n_th; k++) pthread_join(o->th[k], NULL);
    remove_files(o);
    free_buffers(o);
    free(o->lnext);
    pthread_mutex_destroy(&o->mu);
    pthread_cond_destroy(&o->work);
    pthread_cond_destroy(&o->done);
    free(o->pp);
    free(o->param_of);
    free(o->next);
    free(o);
}

/* ---- the update's pieces ---- */

size_t mti_offload_piece(const mti_offload *o, int i) { return o->pp[i].piece; }

static int find(const mti_offload *o, int p)
{
    for (int s = 0; s < o->n_slots; s++)
        if (o->slot[s].piece == p) return s;
    return -1;
}

/* A slot for a new piece, other than `keep`: a free one, else the least
 * recently used clean one; with `wait`, else one being written (waited
 * for), else a dirty one (written, waited for), else one being read.
 * -1 when none without waiting (wait 0), or on an I/O failure (*s set). */
static int victim(mti_offload *o, unsigned keep, int wait, mt_status *s)
{
    static const int pref[] = {S_FREE, S_CLEAN, S_WRITING, S_DIRTY, S_READING};
    for (int k = 0; k < (wait ? 5 : 2); k++) {
        int best = -1;
        for (int v = 0; v < o->n_slots; v++) {
            if ((keep >> v & 1u) || state_of(o, v) != pref[k]) continue;
            if (best < 0 || o->slot[v].used < o->slot[best].used) best = v;
        }
        if (best < 0) continue;
        if (pref[k] == S_DIRTY) submit(o, best, 1, -1);
        if (pref[k] != S_FREE && pref[k] != S_CLEAN && (*s = settle(o, best))) return -1;
        return best;
    }
    return -1;
}

/* Starts reading the pieces expected after piece p (up to all the slots
 * but the current one and one being written back), each into a slot that
 * needs no waiting, keeping the slot `keep` and those holding the pieces
 * expected before it. */
static void prefetch(mti_offload *o, int p, int keep)
{
    mt_status s = MT_OK;
    unsigned held = keep >= 0 ? 1u << keep : 0u;
    for (int d = 0; d < o->n_slots - 2 && p >= 0; d++, p = o->next[p]) {
        int v = find(o, p);
        if (v < 0 && (v = victim(o, held, 0, &s)) >= 0) {
            submit(o, v, 0, p);
            o->slot[v].used = ++o->tick;
        }
        if (v < 0) return;
        held |= 1u << v;
    }
}

mt_status mti_offload_acquire(mti_offload *o, int i, size_t at)
{
    if (o->failed) return lost(o);
    const off_param *q = &o->pp[i];
    const int p = q->first + (int)(at / q->piece - q->k0);
    mt_status s = MT_OK;
    int v = find(o, p);
    if (v < 0) {
        if ((v = victim(o, 0u, 1, &s)) < 0) return s;
        submit(o, v, 0, p);
    }
    if ((s = settle(o, v))) return s;
    if (o->slot[v].piece != p) { /* (its read failed and was cleared) */
        return mti_fail(o->ctx, MT_ERR_INTERNAL, "offload: piece %d lost its slot", p);
    }
    /* the pieces updated before this one go back to disk now */
    for (int w = 0; w < o->n_slots; w++)
        if (w != v && state_of(o, w) == S_DIRTY) submit(o, w, 1, -1);
    if (o->last >= 0 && o->last != p) o->next[o->last] = p;
    o->last = p;
    prefetch(o, o->next[p], v);
    off_slot *sl = &o->slot[v];
    pthread_mutex_lock(&o->mu);
    sl->state = S_DIRTY;
    pthread_mutex_unlock(&o->mu);
    sl->used = ++o->tick;
    o->cur = v;
    /* where its tensors are in the slot */
    int pi;
    size_t pat, n;
    piece_range(o, p, &pi, &pat, &n);
    o->cur_at = pat;
    uint64_t boff = 0;
    for (int j = 0; j < MTI_OPT_SLOTS; j++) {
        const mti_opt_state *l = &o->t->ps[i].lay.s[j];
        int64_t s0;
        const uint64_t b = state_part(o, i, j, pat, n, &s0);
        o->cur_boff[j] = (size_t)boff;
        o->cur_es[j] = mti_dtype_size(l->dtype);
        o->cur_per[j] = l->per;
        o->cur_start[j] = s0;
        boff += up(b);
    }
    return MT_OK;
}

void *mti_offload_state(const mti_offload *o, int j, size_t e)
{
    const int64_t el = o->cur_per[j] > 0 ? (int64_t)e / o->cur_per[j] : 0;
    return o->slot[o->cur].st + o->cur_boff[j] +
           (size_t)(el - o->cur_start[j]) * o->cur_es[j];
}

float *mti_offload_master(const mti_offload *o, size_t e)
{
    return (float *)o->slot[o->cur].ms + (e - o->cur_at);
}

mt_status mti_offload_begin(mti_offload *o)
{
    if (o->failed) return lost(o);
    if (o->dry) return MT_OK;
    for (int f = 0; f < F_COUNT; f++) {
        int e = o->bytes[f] ? file_ok(o, f) : 0;
        if (e) return lose(o, f, 0, e);
    }
    if (o->last >= 0) prefetch(o, o->next[o->last], -1);
    if (o->params) { /* the first layer's weights */
        const int first = o->lkey_first;
        o->lkey_last = o->lkey_first = -1;
        const int k = first >= 0 ? lay_victim(o, -1, 0, first / 2) : -1;
        if (k >= 0) lay_submit(o, k, first / 2);
    }
    return MT_OK;
}

mt_status mti_offload_end(mti_offload *o)
{
    if (o->failed) return lost(o);
    for (int s = 0; s < o->n_slots; s++)
        if (state_of(o, s) == S_DIRTY) submit(o, s, 1, -1);
    mt_status st = MT_OK;
    for (int s = 0; s < o->n_slots && !st; s++) st = settle(o, s);
    o->cur = -1;
    if (o->params) lay_drop(o); /* (the weights the update wrote are read again) */
    return st;
}

/* ---- whole tensors: masters, training-state files, get/set_params ---- */

/* Every piece written and every slot emptied: what follows reads or writes
 * the files directly. */
static mt_status drop_slots(mti_offload *o)
{
    mt_status s = mti_offload_end(o);
    for (int k = 0; k < o->n_slots && !s; k++) o->slot[k].piece = -1, o->slot[k].state = S_FREE;
    return s;
}

static mt_status region(mti_offload *o, int i, int what, uint64_t off, size_t n, int *f,
                        uint64_t *at)
{
    const int l = what >= 2;
    if ((what == 1 && !o->masters) || (what == 0 && !o->pp[i].home) || what < 0 ||
        what >= 2 + MTI_OPT_SLOTS || (what && !o->pp[i].piece) ||
        off + n > (what ? region_bytes(o, i, what - 2 >= 0 ? what - 2 : -1) : weight_bytes(o, i)))
        return mti_fail(o->ctx, MT_ERR_INTERNAL, "offload: no bytes [%llu, +%zu) of tensor %d.%d",
                        (unsigned long long)off, n, i, what);
    *f = l ? F_OPTIM : what ? F_MASTER : F_PARAM;
    *at = (l ? o->pp[i].st_off[what - 2] : what ? o->pp[i].m_off : o->pp[i].w_off) + off;
    return MT_OK;
}

static mt_status whole(mti_offload *o, int i, int what, uint64_t off, void *buf, size_t n, int wr)
{
    if (o->failed) return lost(o);
    int f = F_OPTIM;
    uint64_t at = 0;
    mt_status s = region(o, i, what, off, n, &f, &at);
    if (!s) s = drop_slots(o);
    if (s || o->dry || !n) return s; /* (a dry context moves nothing) */
    int e = file_ok(o, f);
    if (!e) e = move(o, f, wr, buf, n, at);
    return e ? lose(o, f, wr, e) : MT_OK;
}

mt_status mti_offload_read(mti_offload *o, int i, int what, uint64_t off, void *dst, size_t n)
{
    return whole(o, i, what, off, dst, n, 0);
}

mt_status mti_offload_write(mti_offload *o, int i, int what, uint64_t off, const void *src, size_t n)
{
    return whole(o, i, what, off, (void *)src, n, 1);
}

mt_status mti_offload_put_master(mti_offload *o, int i)
{
    mti_param *p = &o->t->model->params[i]; /* (ZeRO: the master is this rank's slice) */
    mt_status s = mti_offload_write(o, i, 1, 0, p->master.blk.ptr,
                                    (size_t)mti_tensor_numel(&p->master) * 4);
    if (!s) mti_tensor_free(o->ctx, &p->master);
    return s;
}

mt_status mti_offload_get_master(mti_offload *o, int i)
{
    mti_param *p = &o->t->model->params[i];
    mti_tensor master = {.dtype = MTI_F32, .ndim = p->w.ndim};
    memcpy(master.shape, p->w.shape, sizeof master.shape);
    mt_status s = mti_tensor_alloc(o->ctx, &master, MT_MEM_MASTER, MT_LIFE_PERSISTENT,
                                   MTI_TAG_PARAM(MTI_TAG_MASTER, i));
    if (!s) s = mti_offload_read(o, i, 1, 0, master.blk.ptr, p->numel * 4);
    if (s) mti_tensor_free(o->ctx, &master);
    else p->master = master;
    return s;
}

/* ---- offload_params: the trained weights at home in param.bin ---- */

void *mti_offload_weights(const mti_offload *o, size_t e)
{
    return o->slot[o->cur].pw + (e - o->cur_at) * mti_dtype_size(o->t->dt);
}

bool mti_offload_has_weights(const mti_offload *o, int i) { return o && o->pp[i].placed; }

mt_status mti_offload_weights_io(mti_offload *o, int i, size_t at, size_t n, void *buf, int wr)
{
    if (o->failed) return lost(o);
    const off_param *q = &o->pp[i];
    const size_t es = mti_dtype_size(o->t->dt);
    if (!q->home || at < q->w0 || at + n > q->w0 + q->wn)
        return mti_fail(o->ctx, MT_ERR_INTERNAL, "offload: no weights [%zu, +%zu) of tensor %d", at,
                        n, i);
    if (o->dry || !n) return MT_OK;
    int e = file_ok(o, F_PARAM);
    /* A write is of other ranks' elements, which no piece holds (pieces
       are cut to this rank's); a layer slot holding them is not read again
       before the step's end drops it (a weight is gathered after its last
       use in the step). A read takes each piece of this rank's elements
       from the slot that holds it, newer than the file while it is dirty,
       else from the file (a piece leaves its slot only once written). */
    for (size_t d = 0, len; d < n && !e; d += len) {
        const size_t x = at + d;
        len = n - d;
        const char *from = NULL;
        if (!wr && q->piece && x >= q->lo && x < q->hi) {
            const size_t k = x / q->piece;
            size_t pat, pn;
            grid_piece(q, k, &pat, &pn);
            if (len > pat + pn - x) len = pat + pn - x;
            const int p = q->first + (int)(k - q->k0);
            pthread_mutex_lock(&o->mu);
            for (int v = 0; v < o->n_slots && !from; v++) {
                const off_slot *sl = &o->slot[v];
                if (sl->piece == p && sl->state != S_FREE && sl->state != S_READING)
                    from = sl->pw + (x - pat) * es;
            }
            pthread_mutex_unlock(&o->mu);
        } else if (!wr && q->piece && x < q->lo && len > q->lo - x) {
            len = q->lo - x; /* (up to this rank's elements) */
        }
        if (from) memcpy((char *)buf + d * es, from, len * es);
        else e = move(o, F_PARAM, wr, (char *)buf + d * es, len * es, q->w_off + (uint64_t)(x - q->w0) * es);
    }
    return e ? lose(o, F_PARAM, wr, e) : MT_OK;
}

/* Starts reading layer `layer`'s weights into layer slot k. */
static void lay_submit(mti_offload *o, int k, int layer)
{
    lay_slot *l = &o->ls[k];
    pthread_mutex_lock(&o->mu);
    l->layer = layer;
    l->used = ++o->tick;
    l->err = 0;
    if (o->dry) {
        l->state = S_CLEAN;
    } else {
        l->state = S_READING;
        o->queue[o->qn++] = SLOTS + k;
        pthread_cond_signal(&o->work);
    }
    pthread_mutex_unlock(&o->mu);
}

static int lay_state(mti_offload *o, int k)
{
    pthread_mutex_lock(&o->mu);
    const int st = o->ls[k].state;
    pthread_mutex_unlock(&o->mu);
    return st;
}

/* A layer slot other than `keep` large enough for layer `layer`: a free
 * one, else the least recently used clean one; with `wait`, else one being
 * read (waited for). -1 when none. */
static int lay_victim(mti_offload *o, int keep, int wait, int layer)
{
    const uint64_t need = lay_bytes(o, layer);
    int best = -1;
    for (int pass = 0; pass < 2 && best < 0; pass++)
        for (int k = 0; k < LSLOTS; k++) {
            const int st = lay_state(o, k);
            if (k == keep || o->ls[k].cap < need || !(st == S_FREE || (pass && st == S_CLEAN)))
                continue;
            if (best < 0 || o->ls[k].used < o->ls[best].used) best = k;
        }
    for (int k = 0; k < LSLOTS && best < 0 && wait; k++)
        if (k != keep && o->ls[k].cap >= need) lay_wait(o, best = k);
    return best;
}

mt_status mti_offload_layer(void *user, int layer, int bwd, int in)
{
    if (layer < 0) return MT_OK; /* (the engine dropped its schedule: nothing is held ahead here) */
    mti_offload *o = user;
    mt_model *m = o->t->model;
    const mti_layer *ly = &m->layers[layer];
    int idx[MTI_SLOTS + 2];
    const int n = lay_params(o, layer, idx);
    if (!in) {
        for (int k = 0; k < n; k++) memset(&m->params[idx[k]].w.blk, 0, sizeof(mt_block));
        return MT_OK;
    }
    /* the embedding's backward needs neither the table nor the positions */
    int need = 0;
    for (int k = 0; k < n; k++)
        need += !(bwd && ly->kind == MT_LAYER_EMBEDDING &&
                  (idx[k] == ly->p0 || (ly->positions && idx[k] == ly->p0 + 1)));
    if (!need) return MT_OK;
    if (o->failed) return lost(o);
    const int key = 2 * layer + bwd;
    if (o->lkey_last >= 0 && o->lkey_last != key) o->lnext[o->lkey_last] = key;
    if (o->lkey_first < 0) o->lkey_first = key;
    o->lkey_last = key;
    int v = -1;
    for (int k = 0; k < LSLOTS && v < 0; k++)
        if (o->ls[k].layer == layer) v = k;
    if (v < 0) lay_submit(o, v = lay_victim(o, -1, 1, layer), layer);
    lay_wait(o, v);
    pthread_mutex_lock(&o->mu);
    const int e = o->io_err, f = o->io_file, wr = o->io_wr;
    pthread_mutex_unlock(&o->mu);
    if (e) return lose(o, f, wr, e);
    o->ls[v].used = ++o->tick;
    /* the next layer's weights are read while this one computes */
    const int nk = o->lnext[key];
    int nidx[MTI_SLOTS + 2];
    if (nk >= 0 && nk / 2 != layer && lay_params(o, nk / 2, nidx)) {
        int w = -1;
        for (int k = 0; k < LSLOTS && w < 0; k++)
            if (o->ls[k].layer == nk / 2) w = k;
        if (w < 0 && (w = lay_victim(o, v, 0, nk / 2)) >= 0) lay_submit(o, w, nk / 2);
    }
    uint64_t off = 0;
    for (int k = 0; k < n; k++) {
        mti_param *p = &m->params[idx[k]];
        const uint64_t b = weight_bytes(o, idx[k]);
        p->w.blk = (mt_block){.ptr = o->ls[v].p + off, .bytes = (size_t)b,
                              .mem_class = MT_MEM_PARAM, .lifetime = MT_LIFE_PERSISTENT};
        off += up(b);
    }
    return MT_OK;
}

mt_status mti_offload_put_params(mti_offload *o)
{
    mt_trainer *t = o->t;
    mt_model *m = t->model;
    const bool z3 = t->zero == 3; /* (the weights are the rank's slices, t->pw) */
    mt_status s = MT_OK;
    for (int i = 0; i < m->n_param && !s; i++) {
        mti_param *p = &m->params[i];
        mti_tensor *w = z3 ? &t->pw[i] : &p->w;
        if (o->pp[i].home && p->unmade) { /* (a deferred model's: read into its file later) */
            if (z3) mti_tensor_free(o->ctx, w);
            o->pp[i].placed = 1;
            continue;
        }
        if (!o->pp[i].home || !w->blk.ptr) continue;
        if (w->dtype != t->dt)
            return mti_fail(o->ctx, MT_ERR_INTERNAL, "offload: %s is not in the compute dtype", p->name);
        s = mti_offload_write(o, i, 0, 0, w->blk.ptr, (size_t)weight_bytes(o, i));
        if (!s) mti_tensor_free(o->ctx, w); /* (its dtype and shape stay) */
        o->pp[i].placed = !s;
    }
    if (!s) s = lay_create(o, !z3); /* (once the weights are gone) */
    if (z3) return s; /* (ZeRO-3's hook gathers each layer, reading the slice here) */
    m->params_home = o;
    t->E.params_hook = mti_offload_layer;
    t->E.params_user = o;
    return s;
}

void mti_offload_get_params(mti_offload *o)
{
    if (!o) return;
    mt_trainer *t = o->t;
    mt_model *m = t->model;
    if (m->params_home == o) m->params_home = NULL;
    if (t->E.params_user == o) t->E.params_hook = NULL, t->E.params_user = NULL;
    for (int i = 0; i < m->n_param && t->zero < 3; i++) { /* (ZeRO-3: its unsharding read them) */
        mti_param *p = &m->params[i];
        if (!o->pp || !o->pp[i].home || p->w.blk.ptr || p->unmade) continue;
        mt_status s = mti_tensor_alloc(o->ctx, &p->w, MT_MEM_PARAM, MT_LIFE_PERSISTENT,
                                       MTI_TAG_PARAM(MTI_TAG_WEIGHT, i));
        if (!s) s = mti_offload_read(o, i, 0, 0, p->w.blk.ptr, (size_t)weight_bytes(o, i));
        if (s && p->w.blk.ptr) {
            mti_log(o->ctx, MT_LOG_ERROR, "%s: its weights could not be read back from disk (%s); "
                    "they are zeros", p->name, mti_last_msg(o->ctx).s);
            (void)mti_tensor_zero(o->ctx, &p->w);
        } else if (s) {
            mti_log(o->ctx, MT_LOG_ERROR, "%s: no memory for its weights coming back from disk",
                    p->name);
        }
    }
}

/* Host staging for the values of [at, at + n) in the weights' dtype. */
#define STAGE_ELEMS ((size_t)1 << 18)

mt_status mti_offload_param_read(mti_offload *o, int i, size_t at, size_t n, float *dst)
{
    /* (ZeRO 1 and 2: the master file holds this rank's slice; the values
       are the compute copy's, equal on every rank, as when resident) */
    if (o->masters && !o->t->zero) return mti_offload_read(o, i, 1, (uint64_t)at * 4, dst, n * 4);
    const mti_dtype dt = o->t->dt;
    const size_t es = mti_dtype_size(dt);
    if (dt == MTI_F32) return mti_offload_read(o, i, 0, (uint64_t)at * 4, dst, n * 4);
    void *buf = malloc(STAGE_ELEMS * es);
    if (!buf) return mti_fail(o->ctx, MT_ERR_OOM, "out of host memory");
    const mti_kctx k = {o->ctx, o->ctx->dev};
    mt_status s = MT_OK;
    for (size_t d = 0, c; d < n && !s; d += c) {
        c = n - d < STAGE_ELEMS ? n - d : STAGE_ELEMS;
        s = mti_offload_read(o, i, 0, (uint64_t)(at + d) * es, buf, c * es);
        if (!s) s = o->ctx->ops->cast(&k, dst + d, MTI_F32, buf, dt, c, MTI_ROUND_NEAREST, 0);
    }
    free(buf);
    return s;
}

mt_status mti_offload_param_write(mti_offload *o, int i, size_t at, size_t n, const float *src)
{
    mt_status s = MT_OK;
    const off_param *q = &o->pp[i];
    const size_t lo = o->t->zero ? (at > q->lo ? at : q->lo) : at, /* (ZeRO: this rank's slice) */
        hi = o->t->zero ? (at + n < q->hi ? at + n : q->hi) : at + n;
    if (o->masters && lo < hi)
        s = mti_offload_write(o, i, 1, (uint64_t)(lo - (o->t->zero ? q->lo : 0)) * 4, src + (lo - at),
                              (hi - lo) * 4);
    const mti_dtype dt = o->t->dt;
    const size_t es = mti_dtype_size(dt);
    if (s || dt == MTI_F32) return s ? s : mti_offload_write(o, i, 0, (uint64_t)at * 4, src, n * 4);
    void *buf = malloc(STAGE_ELEMS * es);
    if (!buf) return mti_fail(o->ctx, MT_ERR_OOM, "out of host memory");
    const mti_kctx k = {o->ctx, o->ctx->dev};
    for (size_t d = 0, c; d < n && !s; d += c) { /* the compute copy, rounded to nearest */
        c = n - d < STAGE_ELEMS ? n - d : STAGE_ELEMS;
        s = o->ctx->ops->cast(&k, buf, dt, src + d, MTI_F32, c, MTI_ROUND_NEAREST, 0);
        if (!s) s = mti_offload_write(o, i, 0, (uint64_t)(at + d) * es, buf, c * es);
    }
    free(buf);
    return s;
}
