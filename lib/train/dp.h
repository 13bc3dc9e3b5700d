/*
 * comm/dp.h - data parallel training (dp.c): what the trainer calls so that
 * ranks sharing a communicator train one model on a global batch.
 * Every function is a no-op returning its status argument (or MT_OK) in a
 * world of one rank.
 */
#ifndef MT_COMM_DP_H
#define MT_COMM_DP_H

#include "comm/comm.h"

typedef struct mt_trainer mt_trainer;

/* Whether the trainer's context has more than one rank. */
bool mti_dp_on(const mt_trainer *t);
/* mt_trainer_create, first: the ranks' models and settings agree (one
 * all-gather; agree.c). Every rank gets MT_ERR_COMM naming the first
 * setting that differs and each rank's value. */
mt_status mti_dp_agree_config(mt_context *ctx, const mt_model *m, const mt_trainer_config *cfg);
/* mt_trainer_create, last, with its status s: fails on every rank when any
 * rank failed, or when the weights (or the teacher's) differ. */
mt_status mti_dp_created(mt_trainer *t, mt_status s);
/* mt_trainer_load, once every rank has checked its file: fails on every
 * rank (MT_ERR_COMM) when the files' digests differ. */
mt_status mti_dp_agree_file(mt_trainer *t, const char *fn, uint64_t digest);
/* A step, after its batch checks (status s): fails on every rank when any
 * rank's batch was refused, or at ZeRO stages 2 and 3 (collectives in every
 * pass) when the ranks' passes over their rows differ; *targets (this
 * rank's) becomes the global batch's. */
mt_status mti_dp_begin(mt_trainer *t, const char *fn, mt_status s, double *targets, int passes);
/* mt_trainer_eval and _logits at ZeRO stage 3, whose forward gathers the
 * weights: the same agreement on the batch and the passes (elsewhere they
 * are local and this does nothing). */
mt_status mti_dp_agree_forward(mt_trainer *t, const char *fn, mt_status s, int passes);
/* A step, after forward and backward (status s): fails on every rank when
 * any rank failed; *loss_sum (this rank's) becomes the global batch's. */
mt_status mti_dp_end(mt_trainer *t, const char *fn, mt_status s, double *loss_sum);
/* A step of a collective (saving, loading), with this rank's status s:
 * fails on every rank when any rank failed (this rank's own message, or
 * MT_ERR_COMM naming the first rank that failed). One all-gather. */
mt_status mti_dp_agree_status(mt_trainer *t, const char *fn, const char *what, mt_status s);
/* Sums n gradient values of parameter i over the ranks, in place. */
mt_status mti_dp_reduce(mt_trainer *t, int i, float *g, size_t n);
/* The same for parameter i's whole gradient (made zero where the batch did
 * not reach the parameter, so every rank makes the same calls). */
mt_status mti_dp_reduce_grad(mt_trainer *t, int i);

/* ---- ZeRO (zero.c) ---- */

/* A communication buffer of `bytes` (a phase's, class COMM): every bucket
 * and gather buffer ZeRO makes goes through here. */
mt_status mti_comm_buffer(mt_context *ctx, mti_tensor *buf, size_t bytes);
/* The shard of every parameter (t->sh) for t->zero, t->world and t->rank;
 * the optimizer layouts (t->ps[i].lay) must be made. */
mt_status mti_zero_layout(mt_trainer *t);
/* Rank r's elements [*lo, *hi) of parameter i. */
void mti_zero_range(const mt_trainer *t, int i, int r, size_t *lo, size_t *hi);
/* g holds this rank's gradient of elements [at, at + n) of parameter i
 * (every rank passes the same range); afterwards dst gets (acc: adds) the
 * sum over the ranks of the elements of that range this rank holds, from
 * the first of them. A collective. */
mt_status mti_zero_reduce(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst, int acc);
/* mti_zero_reduce through a bucket the caller made (NULL: made and freed
 * here) of mti_zero_reduce_bytes(t, i, at, n) bytes (0: none needed), so a
 * communication thread can run it without allocating. */
mt_status mti_zero_reduce_in(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst, int acc,
                             void *bucket);
size_t mti_zero_reduce_bytes(const mt_trainer *t, int i, size_t at, size_t n);
/* The same in two phases, for a communication stream whose collectives
 * are only queued (nccl_overlap.c): MTI_ZR_POST packs every chunk of the
 * range into the bucket (mti_zero_reduce_bytes_all bytes, a chunk's N x K
 * for each) and makes each chunk's collective; MTI_ZR_FINISH, once they
 * are done, takes this rank's sums into dst. A whole-tensor owner's
 * all-reduce is in place in g, which must then stay until the finish.
 * MTI_ZR_ALL: both at once, mti_zero_reduce_in. */
enum { MTI_ZR_ALL, MTI_ZR_POST, MTI_ZR_FINISH };
mt_status mti_zero_reduce_phase(mt_trainer *t, int i, float *g, size_t at, size_t n, float *dst,
                                int acc, void *bucket, int phase);
size_t mti_zero_reduce_bytes_all(const mt_trainer *t, int i, size_t at, size_t n);
/* Elements [at, at + n) of parameter i's weights (PARAM; in param.bin with
 * offload_params), each held up to date by its owner, to every rank. A
 * collective. */
mt_status mti_zero_gather(mt_trainer *t, int i, size_t at, size_t n);
/* Every trained tensor's weights gathered so, in parameter order. A rank
 * whose own reads or writes fail (weights on disk) goes on making every
 * collective, sending zeros, and returns that failure at the end; a failed
 * collective stops at once. */
mt_status mti_zero_gather_every(mt_trainer *t);
/* The same in two phases (MTI_ZR_POST: this rank's pieces packed into the
 * bucket, mti_zero_gather_bytes_all bytes, and each chunk's all-gather
 * made; MTI_ZR_FINISH: the others' pieces into the weights), or both
 * (MTI_ZR_ALL, through a bucket made here when bucket is NULL). An owner's
 * broadcast is in place in the weights. */
mt_status mti_zero_gather_phase(mt_trainer *t, int i, size_t at, size_t n, void *bucket, int phase);
size_t mti_zero_gather_bytes_all(const mt_trainer *t, int i, size_t at, size_t n);
/* The ranks' checks of their slices together: *found (this rank's) becomes
 * whether any rank found a non-finite gradient, and *total the sum over
 * ranks and tensors of the n sums of squares (this rank's alone on one
 * rank or in a dry run), sumsq[i] then tensor i's over the ranks. A
 * collective. */
mt_status mti_zero_checks(mt_trainer *t, float *sumsq, int n, int *found, double *total);
/* *flag becomes whether it is set on any rank. A collective. */
mt_status mti_zero_any(mt_trainer *t, int *flag);

/* ---- ZeRO-3 (zero3.c) ---- */

/* Stage 3, at create, with the status so far (s), once the weights are
 * in their final dtype: each trained parameter's whole weights become this
 * rank's slice (t->pw), tensor by tensor, and the engine then brings each
 * layer's weights in (mti_zero3_layer). A collective (two all-gathers):
 * the ranks first agree on their statuses and weights (a hash; changing
 * nothing when they differ), then on how far each got; if any rank failed,
 * every rank puts the whole weights back and fails (MT_ERR_COMM naming the
 * rank, or its own error). */
mt_status mti_zero3_shard(mt_trainer *t, mt_status s);
/* The engine's params_hook (engine.h): layer's weights in (all-gathered
 * into COMM gather buffers, counted per parameter) or out. A collective. */
mt_status mti_zero3_layer(void *user, int layer, int bwd, int in);
/* At destroy: the whole weights back in the model (a collective; on
 * failure the weights lost are zeros and the status says so). */
mt_status mti_zero3_unshard(mt_trainer *t);
/* Frees the slices and buffers (after unshard, or on a failed create). */
void mti_zero3_free(mt_trainer *t);
/* Whether stage 3 reduce-scatters a final gradient later (with prefetch
 * on): mti_zero3_reduce queues it (the thread runs it, or it runs at once)
 * and keeps the gradient and its bucket until the next layer's gradients
 * are final; mti_zero3_settle, at the pass's end, waits for every one and
 * frees them (status s so far: a failure of theirs returned only where s
 * is MT_OK). */
bool mti_zero3_later(const mt_trainer *t);
mt_status mti_zero3_reduce(mt_trainer *t, int i, float *dst);
mt_status mti_zero3_settle(mt_trainer *t, mt_status s);

#endif /* MT_COMM_DP_H */
