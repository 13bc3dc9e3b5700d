/*
 * offload.h - a trainer's optimizer state and master weights kept off the
 * device (lib/train/offload.c): their home is a place (mt_place), and the update
 * brings each piece in just before it runs, prefetches the next and writes
 * the last one back while it computes.
 *
 * Today's setting: MT_PLACE_DISK on a CPU context (scratch files). The
 * trainer sees three things: where a piece's state and master are while it
 * is being updated (mti_offload_acquire), the step's start and end (files
 * checked, writes finished), and reads and writes of whole tensors for the
 * training-state files and the model's get/set_params.
 */
#ifndef MT_OFFLOAD_H
#define MT_OFFLOAD_H

#include <limits.h>

#include "train/trainer.h"

typedef struct mti_offload mti_offload;

/* ---- the scratch directory (lib/train/scratch.c) ---- */

typedef struct mti_scratch {
    char dir[PATH_MAX];         /* absolute */
    char lock[PATH_MAX + 16];   /* dir/lock, naming this process */
    int made_dir, made_lock;
} mti_scratch;
/* Makes this trainer's scratch directory in base (memtrain-scratch, or
 * memtrain-scratch.rankR on a context of several ranks) and its lock file.
 * A directory of that name whose owner has ended (a killed run) is removed
 * first; one whose owner runs, or runs on another host, or that holds files
 * other than the lock and names[0..n) (the files the library puts there),
 * is refused (MT_ERR_IO). Then every other scratch directory in base that
 * no rank of this run makes and whose owner has ended is removed. Each
 * removal is a warning on ctx's log. */
mt_status mti_scratch_make(mt_context *ctx, const char *base, const char *const *names, int n,
                           mti_scratch *sc);
/* Removes the lock and the directory, once the caller removed its files. */
void mti_scratch_remove(mti_scratch *sc);

/* Test hook: called before every scratch-file read and write (write 1)
 * with the file's path, offset and length; a nonzero return is the errno
 * the call fails with, and *n may be lowered to make it a short transfer.
 * NULL (the default) in the library. */
extern int (*mti_offload_fault)(int write, const char *path, uint64_t off, size_t *n);
/* Elements per piece of an optimizer that updates slices (a multiple of
 * 256; 2^19 in the library; tests lower it to cut small tensors). Defined
 * in offload_host.c, which the disk's pieces (offload.c) sit above. */
extern size_t mti_offload_piece_elems;

/* Checks the offload settings of cfg for a trainer of m (MT_OK when
 * cfg->offload is MT_PLACE_DEVICE). */
mt_status mti_offload_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *cfg);
/* Makes the offload of t (after plan_state; before to_mixed, which hands
 * it each master with mti_offload_put_master): the scratch directory and
 * files (none in a dry context, whose bytes are counted all the same), the
 * fresh optimizer state written, the piece buffers, the I/O threads. */
mt_status mti_offload_create(mt_trainer *t, int masters, mti_offload **out);
/* Writes what is dirty, stops the threads, removes the scratch files and
 * directory, frees the buffers. NULL is accepted. */
void mti_offload_destroy(mti_offload *o);
/* The trainer is ending: every piece written, and the piece and layer
 * buffers freed, so the weights and masters read back whole into the
 * model never meet them; whole-tensor reads and writes go on. NULL is
 * accepted. */
void mti_offload_drain(mti_offload *o);

/* Parameter i's master (t's model, p->master) moves to its file and is freed. */
mt_status mti_offload_put_master(mti_offload *o, int i);
/* Parameter i's master back into p->master (a new MASTER tensor), from its file. */
mt_status mti_offload_get_master(mti_offload *o, int i);

/* Elements per piece of parameter i: the grid its updates are cut on. */
size_t mti_offload_piece(const mti_offload *o, int i);
/* Brings the piece of parameter i holding element `at` in (waiting for its
 * read), starts writing back the pieces updated before it and reading the
 * one expected next; then the state of slot j for element e of that piece
 * is at mti_offload_state(o, j, e), its master at mti_offload_master(o, e).
 * The piece counts as updated (to be written back). */
mt_status mti_offload_acquire(mti_offload *o, int i, size_t at);
void *mti_offload_state(const mti_offload *o, int j, size_t e);
float *mti_offload_master(const mti_offload *o, size_t e);

/* A step begins: the scratch files are checked (there, of their size) and
 * the first piece's read starts. */
mt_status mti_offload_begin(mti_offload *o);
/* A step ends (or failed): every updated piece written, every I/O done. */
mt_status mti_offload_end(mti_offload *o);

/* Bytes [off, off + n) of parameter i's stored tensor `what` (0 its
 * weights with offload_params, 1 the master, 2 + j state slot j), to or from host memory. */
mt_status mti_offload_read(mti_offload *o, int i, int what, uint64_t off, void *dst, size_t n);
mt_status mti_offload_write(mti_offload *o, int i, int what, uint64_t off, const void *src,
                            size_t n);

/* ---- offload_params: the trained weights (PARAM) at home in param.bin too.
 * The engine's params hook (mti_offload_layer, set by put_params) brings a
 * layer's weights into one of two layer buffers before its forward or
 * backward (p->w.blk points there while it runs) and reads the next
 * layer's into the other meanwhile; the update's pieces carry the weights
 * with the state and masters (mti_offload_weights). ---- */

/* Every trained weight (in the compute dtype) to param.bin and freed; the
 * engine's hook and the model's params_home set. */
mt_status mti_offload_put_params(mti_offload *o);
/* The weights back into the model (zeros, and said, where they cannot be
 * read); the hook cleared. NULL is accepted. */
void mti_offload_get_params(mti_offload *o);
/* Whether parameter i's weights live in param.bin, sent there by put_params (o may be NULL). */
bool mti_offload_has_weights(const mti_offload *o, int i);
/* Elements [at, at + n) of parameter i's weights in param.bin (compute
 * dtype), into buf (wr 0: this rank's newest, from the piece buffers where
 * they are held) or from buf (wr 1: elements of other ranks' slices, which
 * no piece holds): the ZeRO-1/2 gather of the updated weights, a bucket at
 * a time. A dry context moves nothing. */
mt_status mti_offload_weights_io(mti_offload *o, int i, size_t at, size_t n, void *buf, int wr);
/* The acquired piece's weights at element e (compute dtype). */
void *mti_offload_weights(const mti_offload *o, size_t e);
/* The engine's params hook (mti_layer_hook) with user o. */
mt_status mti_offload_layer(void *user, int layer, int bwd, int in);
/* fp32 values [at, at + n) of parameter i (its master where there is one,
 * else its weights widened) / written (the master, and the weights
 * rounded to nearest). */
mt_status mti_offload_param_read(mti_offload *o, int i, size_t at, size_t n, float *dst);
mt_status mti_offload_param_write(mti_offload *o, int i, size_t at, size_t n, const float *src);

/* ---- host offload (lib/train/offload_host.c): a CUDA context's optimizer state
 * and masters in page-locked host memory, updated by the CPU op table ---- */

typedef struct mti_hostoff mti_hostoff;

/* Checks cfg->offload host for a trainer of m (MT_OK when it is not host). */
mt_status mti_hostoff_check(mt_context *ctx, const mt_model *m, const mt_trainer_config *cfg);
/* The staging buffers (place host), the events and the update thread;
 * after plan_state, before to_mixed and make_state, which put the masters
 * and the state at home with mti_hostoff_tensor. */
mt_status mti_hostoff_create(mt_trainer *t, mti_hostoff **out);
/* Waits for every update, stops the thread, frees the staging buffers. NULL
 * is accepted. The state and masters are the trainer's tensors (freed with
 * mti_tensor_free, which knows host blocks). */
void mti_hostoff_destroy(mti_hostoff *h);
/* Allocates x (its dtype and shape set) in page-locked host memory. */
mt_status mti_hostoff_tensor(mti_hostoff *h, mti_tensor *x, mt_mem_class c, uint64_t tag);
/* Queues the update of elements [at, at + n) of parameter i from its
 * gradient g (on the device; it may be freed or reused by work queued
 * after this call): the gradient goes down on the main stream, the update
 * thread runs the optimizer on the host and sends the weights back up on
 * the second stream. Returns once the gradient's copy is queued. */
mt_status mti_hostoff_update(mti_hostoff *h, int i, const float *g, size_t at, size_t n,
                             float grad_scale);
/* Every queued update done and its weights on the device; the first
 * failure of any of them. */
mt_status mti_hostoff_end(mti_hostoff *h);

#endif /* MT_OFFLOAD_H */
