/*
 * model.h - models as the engine sees them: a sequence of layers, the
 * parameter tensors they own, and what each layer keeps for backward.
 *
 * Every model (MLP, GPT, or built from a list of layers) is the same
 * structure; the engine (engine.c) runs any of them forward and backward.
 */
#ifndef MT_MODEL_H
#define MT_MODEL_H

#include "internal.h"
#include "quant/quant.h"
#include "sparse/sparse.h"

typedef enum mti_model_kind { MTI_MODEL_SEQ = 0, MTI_MODEL_MLP = 1, MTI_MODEL_GPT = 2 } mti_model_kind;

/* How a parameter is initialised. */
typedef enum mti_init {
    MTI_INIT_ZERO = 0,
    MTI_INIT_ONE,
    MTI_INIT_UNIFORM,  /* uniform in +-a */
    MTI_INIT_NORMAL    /* N(0, a) */
} mti_init;

#define MTI_NAME_LEN 40

/* A pruned parameter (lib/sparse/prune.c): its weights (and master) hold
 * the kept values alone, meta says where they are. */
typedef struct mti_psparse {
    mti_sp_layout L;
    mti_tensor meta;     /* PARAM: L.bytes of description, device memory */
    void *host;          /* its copy in host memory, for the host's reads (a device whose
                            memory is not the host's; NULL on a CPU or dry context) */
} mti_psparse;

typedef struct mti_param {
    char name[MTI_NAME_LEN];
    mti_tensor w;        /* PARAM: fp32, or the compute copy in dt while a
                            mixed-precision trainer holds the masters, or
                            bf16 alone under a trainer without masters */
    mti_tensor master;   /* MASTER: fp32, while such a trainer lives; under ZeRO
                            only elements [master_lo, master_lo + its numel) */
    size_t master_lo;
    int ndim;
    int64_t shape[2];    /* (rows, cols), or (n) */
    size_t numel;
    size_t offset;       /* in get/set_params order */
    int uses;            /* gradient contributions per backward pass (2: tied) */
    int force32;         /* optimizer state stays 32-bit (StableEmbedding) */
    int frozen;          /* no gradient, master or optimizer state (set by the
                            trainer from cfg.freeze, for its lifetime) */
    int linear;          /* the weight of a linear map (LINEAR, a block's qkv,
                            attproj, fc, fcproj): LoRA can adapt it */
    int lora;            /* its LoRA adapter's A (B follows), or -1 */
    int adapter_of;      /* an adapter (A or B): the weight it adapts, or -1 */
    mti_qformat qf;      /* MTI_QF_NONE, or the format of a quantized frozen
                            weight: w is then its quantized bytes (MTI_U8,
                            mti_quant_bytes(qf, numel)), kept across trainers */
    mti_init init;
    float init_a;
    int64_t init_rows;   /* NORMAL/UNIFORM of only the first init_rows rows (padding stays 0) */
    unsigned char tp_split; /* mti_tp_split: how tensor parallel splits it (set while
                            a trainer holds the model split: w, shape and numel
                            are then this rank's part, whole_* the tensor's) */
    int64_t whole_shape[2];
    size_t whole_numel;
    mti_psparse *sp;     /* pruned (NULL: dense): w and master hold its sp->L.nnz kept
                            values in element order, numel is that count (what the
                            trainer stores, updates and saves), shape stays the
                            dense one, and the dense elements are sp->L.dense */
    int unmade;          /* its values are still its source's (a deferred model's, until
                            mti_model_make or a trainer's homes take them): w has
                            its dtype and shape and no memory */
} mti_param;

/* Tensor parallel (lib/train/tp.c): how a parameter of a GPT model is split
 * over the T ranks of a tensor group. Rank q's part of a (rows, cols)
 * tensor, its elements in their order:
 *   ROWS: rows [rows q / T, rows (q + 1) / T) (column-parallel linears, fc,
 *         and the vocabulary's rows of the token table);
 *   QKV:  those rows of each third (the heads' q, k and v);
 *   COLS: columns [cols q / T, cols (q + 1) / T) of every row
 *         (row-parallel linears, attproj and fcproj).
 * A 1-D tensor is one column. */
typedef enum mti_tp_split {
    MTI_TP_WHOLE = 0, /* replicated: every rank holds it whole */
    MTI_TP_ROWS,
    MTI_TP_QKV,
    MTI_TP_COLS
} mti_tp_split;

/* A model split over a tensor group (mt_model.tp while a trainer holds it). */
typedef struct mti_tp {
    int size, rank;      /* T, and this rank's place in the group */
    mt_comm *comm;       /* the group (NULL in a dry context) */
    int v0, v1;          /* the token table's rows (padded vocabulary) on this rank */
    int classes;         /* of them real (below the model's classes) */
    int sp;              /* sequence parallel: outside the split GEMMs each rank holds
                            its rows of a micro-batch alone (engine.c) */
} mti_tp;

/* The runs of rank q's part of a parameter split `split` of shape (rows,
 * cols) over T ranks: how many, and run j's first element in the whole and
 * length. */
size_t mti_tp_nruns(mti_tp_split split, int64_t rows, int64_t cols, int T);
void mti_tp_run(mti_tp_split split, int64_t rows, int64_t cols, int T, int q, size_t j,
                size_t *at, size_t *len);
/* The shape of rank q's part. */
void mti_tp_part_shape(mti_tp_split split, int64_t rows, int64_t cols, int T, int q,
                       int64_t *prow, int64_t *pcol);

/* A parameter's whole size and columns (1 for a 1-D one), split or not. */
static inline size_t mti_whole_numel(const mti_param *p)
{
    return p->sp ? p->sp->L.dense : p->tp_split ? p->whole_numel : p->numel;
}
/* Its dense elements on this rank (a pruned one's, all of them; else numel). */
static inline size_t mti_param_dense(const mti_param *p) { return p->sp ? p->sp->L.dense : p->numel; }
static inline int64_t mti_whole_cols(const mti_param *p)
{
    return p->tp_split ? p->whole_shape[1] : p->ndim == 2 ? p->shape[1] : 1;
}

/* Calls fn for each run of elements [at, at + n) of rank q's part of
 * parameter p (split over T ranks): the run's place in the whole tensor,
 * its length, and its place in [at, at + n); stops at a failure. */
mt_status mti_tp_each_run(const mti_param *p, int T, int q, size_t at, size_t n,
                          mt_status (*fn)(void *user, size_t whole_at, size_t len, size_t off),
                          void *user);

/* The tensors a layer keeps from forward for backward, by slot. */
#define MTI_SLOTS 16 /* a block's 12, and its 4 linear maps' LoRA (x A^T) */

typedef struct mti_layer {
    mt_layer_kind kind;
    int in, out;         /* features per row in and out */
    int heads;           /* BLOCK */
    int p0, np;          /* its parameters: params[p0 .. p0+np) */
    int tied;            /* LM_HEAD: the parameter index of the table */
    int positions, stable, bias;
    int unit;            /* the recompute unit it belongs to */
    int unit_start;      /* it starts a unit */
} mti_layer;

/* A model cut into pipeline stages (mt_model.pp while a trainer holds it;
 * lib/train/pp.c). The model's layers and parameters are then this rank's
 * stage's: whole layers [l0, l1) of the model and their parameters (the
 * model's from q0), and on the last stage of a model whose LM head is tied
 * to the token table, a copy of the table as its last parameter (tied).
 * The whole model's arrays wait here until the trainer goes. */
typedef struct mti_pp {
    int size, rank;      /* P, and this rank's stage */
    mt_comm *comm;       /* the pipeline group: stage s is its rank s (NULL when dry) */
    int l0, l1, u0, q0;  /* the stage's first and end layer, its first unit and parameter */
    int table;           /* the whole model's token table tied to the head, or -1 */
    int tied;            /* last stage: the stage's copy of it, or -1 */
    int *starts;         /* per stage, the whole model's parameter it starts from */
    int n_layers, n_units, n_param, n_base; /* the whole model's */
    size_t n_params, n_base_params;
    mti_layer *layers;
    mti_param *params;
} mti_pp;

struct mt_model {
    mt_context *ctx;
    mti_model_kind kind;
    mt_input_kind input;
    int features;        /* FEATURES */
    int vocab, padded_vocab, max_seq; /* TOKENS */
    int classes;         /* real columns of the logits */
    int out_width;       /* columns of the logits (padded_vocab for an LM head) */
    int n_layers;
    mti_layer *layers;
    int n_units;
    int n_param;
    mti_param *params;
    size_t n_params;     /* elements in all of them */
    bool has_master;
    /* LoRA adapters (lora.c): params[n_base ..] are, per adapted weight,
       A (rank, in) and B (rank, out); y += (alpha / rank) (x A^T) B */
    int lora_rank;       /* 0: none */
    float lora_alpha;
    uint64_t lora_seed;
    int n_base;          /* the base's parameter tensors (with adapters) */
    size_t n_base_params;
    char *lora_targets;  /* the adapted weights' names, comma-separated */
    bool master_sliced;  /* the masters are ZeRO slices: the fp32 values read
                            are the compute copy's */
    bool params_sharded; /* a ZeRO-3 trainer holds the weights as slices over
                            the ranks: p->w is whole only while a layer runs */
    struct mti_offload *master_home; /* the masters live on disk (lib/train/offload.c): the
                            fp32 values are read and written there */
    struct mti_source *src; /* where the unmade weights' values come from (source.c) */
    mti_tp *tp;          /* split over a tensor group (lib/train/tp.c), or NULL */
    mti_pp *pp;          /* cut into pipeline stages (lib/train/pp.c), or NULL */
    struct mti_offload *params_home; /* the trained weights live on disk too
                            (offload_params): p->w is there only while a layer runs */
    mt_mlp_spec mlp;     /* MLP */
    mt_gpt_spec gpt;     /* GPT */
    _Atomic int n_trainers;
};

/* model.c */
/* Uploads all parameters from host fp32 values in get/set_params order
 * (no checks), refreshing the compute copies. */
mt_status mti_model_upload(mt_model *m, const float *src);
/* Elements [at, at + n) of parameter i's fp32 values to / from host memory,
 * whatever the weights' storage (fp32, master + compute copy, or 16 bits
 * alone); a write refreshes the compute copy. */
mt_status mti_param_read(const mt_model *m, int i, size_t at, size_t n, float *dst);
/* MT_ERR_UNSUPPORTED, fn named, while a ZeRO-3 trainer holds any of the
 * weights as slices: for calls on every weight, before they touch one. */
mt_status mti_model_all_whole(const mt_model *m, const char *fn);
mt_status mti_param_write(mt_model *m, int i, size_t at, size_t n, const float *src);

/* lora.c: whether name matches one of the comma-separated fnmatch(3)
 * patterns (NULL or "": every name); with hits, counts each pattern's
 * matches. */
bool mti_name_targeted(const char *targets, const char *name, int *hits);

/* lib/sparse/prune.c: parameter i pruned in place to the mask keep (its
 * dense elements' bits; NULL in a dry context), which keeps nnz of them,
 * stored in format fmt (n:mm for MTI_SP_NM): its weights and master
 * become the kept values alone. A pruned parameter is pruned again the
 * same way. Not for a quantized, unmade, split or offloaded one
 * (MT_ERR_UNSUPPORTED). On failure it is as it was. */
typedef mt_status (*mti_prune_hook)(void *user, int i, const mti_psparse *old,
                                    const mti_psparse *nw);
mt_status mti_param_prune(mt_model *m, int i, const uint64_t *keep, size_t nnz, mti_sp_format fmt,
                          int n, int mm, mti_prune_hook hook, void *user);
/* hook, where given, is called once the parameter's new tensors are made
 * (old: its description until now, NULL when dense; nw: the new one): the
 * trainer's state rebuilt alike (mti_sp_relay), kept only when it
 * succeeds. */
/* t (a value tensor of a parameter described by old, or dense with NULL)
 * gathered by nw into *out (nw's kept count, t's dtype, class and
 * lifetime; a dense WORK tensor between them when old is not NULL):
 * what old did not keep is 0. */
mt_status mti_sp_relay(mt_context *ctx, const mti_tensor *t, const mti_psparse *old,
                       const mti_psparse *nw, uint64_t tag, mti_tensor *out);
/* The targets of prune config c (tg[i] = 1), after checking c against the
 * model: MT_ERR_INVALID_ARG or MT_ERR_UNSUPPORTED naming fn. */
mt_status mti_prune_check(mt_context *ctx, const mt_model *m, const mt_prune_config *c,
                          const char *fn, unsigned char *tg);
/* Each target's new mask (keep[i], made here; NULL when dry) and its kept
 * count (nnz[i]) at sparsity sfrac, pruning on from its mask now; norms[i]
 * (Wanda): per input column, the sum of squares of the calibration's
 * inputs. */
mt_status mti_prune_masks(const mt_model *m, const mt_prune_config *c, double sfrac,
                          const unsigned char *tg, float *const *norms, uint64_t **keep, size_t *nnz);
/* The targets pruned to those masks (one unchanged is left). */
mt_status mti_prune_apply(mt_model *m, const mt_prune_config *c, const unsigned char *tg,
                          uint64_t *const *keep, const size_t *nnz, mti_prune_hook hook, void *user);
void mti_prune_free_masks(const mt_model *m, uint64_t **keep);
/* Its mask (mti_param_dense bits; every bit set for a dense one). */
mt_status mti_param_keep(const mt_model *m, int i, uint64_t *keep);
/* Its description in host memory: the device's own on a CPU context, else
 * the host copy kept beside it. NULL for a dense one or when dry. */
const void *mti_param_meta_host(const mt_model *m, const mti_param *p);
void mti_param_sparse_free(mt_context *ctx, mti_param *p);
/* A pruned parameter (without a master) dense again, its pruned elements
 * 0 (what undoes a trainer's prune when its creation fails). */
mt_status mti_param_unprune(mt_model *m, int i);
/* t (fp32, one value per kept element of pruned parameter i: its
 * gradient) into dst as its dense elements (zeros where pruned). */
mt_status mti_param_dense_host(const mt_model *m, int i, const mti_tensor *t, float *dst);
/* Parameter i (fp32 weights) quantized in format qf (lib/quant/quant.h): the
 * quantized bytes are made, then the fp32 tensor goes (PARAM holds one
 * tensor's fp32 beside the rest at most). On a CUDA context the fp32 comes
 * down into a host buffer of one tensor, is quantized there by lib/quant/quant.c
 * and the quantized bytes go up. mti_param_dequantize: back to fp32
 * weights (the dequantized values; on CUDA by the dequantizing kernel,
 * lib/quant/quant.c's bits, into the new fp32 tensor). */
mt_status mti_param_quantize(mt_model *m, int i, mti_qformat qf);
mt_status mti_param_dequantize(mt_model *m, int i);
/* Whether parameter i of the model is one a base format quantizes: a linear
 * weight of the base (not an adapter). */
int mti_param_quantizable(const mt_model *m, int i);
/* Whether parameter i is a token model's token table (the EMBEDDING
 * layer's first parameter, the tied LM head's W). A trainer's cfg.base
 * quantizes it when it is frozen; a model's spec.base does not (it may
 * still train). */
int mti_param_is_table(const mt_model *m, int i);
/* Where a model's weights come from: a seed, or a file of its fp32 values
 * in get/set_params order from byte `first` (path set); made at once, or
 * deferred (mt_*_spec.deferred). */
typedef struct mti_origin {
    uint64_t seed;
    const char *path;
    long long first;
    bool deferred;
} mti_origin;
/* Builds a GPT model whose weights come from o. */
mt_status mti_gpt_build(mt_context *ctx, const mt_gpt_spec *spec, const char *fn,
                        const mti_origin *o, mt_model **out);
/* The unmade parameters (which: those with which[i] set; NULL: all) made
 * whole from the source (PARAM), in parameter order; once none is left
 * unmade the source goes. A parameter that fails stays unmade. */
mt_status mti_model_make(mt_model *m, const unsigned char *which);
/* How many parameters are unmade (source.c: what the source still has to make). */
int mti_model_unmade(const mt_model *m);

/* source.c: the model's m->src. A seed's generator is drawn over the
 * parameters in parameter order (each value of a NORMAL init takes two of
 * its outputs, of a UNIFORM one, of a constant or a padding row none); a
 * file (mti_source_file: opened and its size checked against the model's,
 * MT_ERR_IO / MT_ERR_FORMAT) holds them as fp32 from byte `first`. */
mt_status mti_source_seed(mt_model *m, uint64_t seed);
mt_status mti_source_file(mt_model *m, const char *path, long long first);
void mti_source_free(mt_model *m);
/* Elements [at, at + n) of parameter i's initial values into host memory,
 * whatever was read before (a file's non-finite value: MT_ERR_FORMAT). */
mt_status mti_source_read(const mt_model *m, int i, size_t at, size_t n, float *dst);
/* What the source makes of the unmade parameters, mixed into hash h (none
 * unmade: h unchanged), for ranks to agree on without reading it all: the
 * seed and each parameter's init, or a file's first and last values of
 * each parameter. */
mt_status mti_source_mix(const mt_model *m, uint64_t *h);

/* cost.c: forward FLOPs of each of the model's units per row of a
 * micro-batch of T tokens (full), and what selective recompute repeats of
 * each (sel): m->n_units values each. Only their ratios mean anything. */
void mti_unit_costs(const mt_model *m, int T, double *full, double *sel);

/* Parameter indices sorted by offset (get/set_params order); malloc'd. */
int *mti_param_order(const mt_model *m);

/* lora.c */
/* Adds LoRA adapters to the linear weights cfg->targets names (A drawn,
 * B zero), or, when the model has adapters, checks cfg against them. */
mt_status mti_lora_attach(mt_model *m, const mt_lora_config *cfg, const char *fn);
/* Removes the adapters (no trainer may use the model). */
void mti_lora_detach(mt_model *m);


#endif /* MT_MODEL_H */
