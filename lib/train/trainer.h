/*
 * trainer.h - the trainer's state (trainer.c), shared with the training
 * checkpoints (checkpoint.c).
 */
#ifndef MT_TRAINER_H
#define MT_TRAINER_H

#include "engine/engine.h"
#include "optim/optim.h"
#include "optim/scaler.h"

/* optimizer state of one parameter (class OPTIM): the tensors of its
 * layout, slot by slot (lib/optim/optim.h; unused slots empty) */
typedef struct pstate {
    mti_tensor s[MTI_OPT_SLOTS];
    mti_opt_layout lay;
    float wd, lr_scale;
} pstate;

/* A parameter's shard under ZeRO (lib/train/zero.c): this rank's elements
 * [lo, hi) of it (lo == hi: none). Sliced: rank r holds [r per, (r + 1)
 * per) cut at numel (owner -1); a whole-tensor owner (optimizers that
 * cannot update a slice): only rank `owner` holds it, whole. Without
 * sharding every rank holds [0, numel). */
typedef struct mti_shard {
    size_t lo, hi;
    size_t per;
    int owner;
} mti_shard;

struct mt_trainer {
    mt_model *model;
    mt_context *ctx;
    mt_trainer_config cfg;
    mti_dtype dt;
    mti_engine E;
    mti_engine TE;           /* the teacher's (cfg.teacher), forward only */
    int teaching;            /* TE is made and the teacher held */
    const mti_optim *opt;    /* cfg.optimizer's entry */
    pstate *ps;
    char **patterns;         /* copies of the overrides' patterns */
    mt_param_override *overrides;
    char **freeze;           /* copies of cfg.freeze */
    int froze;               /* some parameter was marked frozen (cleared at destroy) */
    int attached;            /* this trainer added the model's LoRA adapters */
    mti_tensor found_inf;    /* two device ints: [0] a gradient is not finite (the
                                unscale op's flag), [1] the optimizers' scratch */
    int flag_grads;          /* gradients are checked by the flag (fp16, or no
                                clipping, whose norm finds them otherwise) */
    mti_tensor sumsq;        /* per parameter, device fp32 */
    mti_scaler scaler;
    uint64_t steps, opt_steps, steps_skipped;
    int last_skipped;
    float last_norm;
    int micro, max_seq;
    float *host_losses;      /* (micro * max_seq) */
    float *host_rows;        /* (ROWS_CHUNK * out_width), eval's argmax */
    /* the step being taken */
    float lr, clip, inv;
    int check_each;          /* fused in one pass: each tensor's check is read
                                before its update */
    int halted;              /* that check found a non-finite gradient */
    int touched;             /* some elements were updated this step (the fused
                                step's slices count before their tensor does) */
    int updated;             /* tensors updated this step */
    int counted;             /* counted in the model's and context's children */
    int bare;                /* weights in dt alone, no masters */
    struct mti_queue *q;     /* the collectives' queue (comm/queue.h): the communication
                                thread or NCCL's stream, or NULL */
    int overlap_now;         /* this step's gradients go to it as backward makes them */
    int sum_on_stream;       /* stages 0 and 1: the sums in place on NCCL's stream, or
                                planned so in an estimate (which then makes no bucket) */
    int check_now;           /* unfused, one rank: each gradient is checked and measured in
                                the last backward as it becomes final (final_hook) */
    int s2;                  /* ZeRO-2's reduce-scatters on it (trainer.c, held_give), or
                                planned so in an estimate */
    int fq;                  /* the fused step's reductions on it (trainer.c, held_give),
                                or planned so in an estimate */
    int fq_pass;             /* the fused backward running with them: 1 the checks', 2 the
                                updates' (0: none) */
    int *s2q;                /* the tensors given in this pass, in order */
    int s2_head, s2_tail;    /* let go up to head, given up to tail */
    size_t s2_bytes;         /* whole gradients held, given and not let go (and their
                                buckets) */
    int phased;              /* s2 or fq on NCCL's communication stream (or planned so):
                                each reduce-scatter's chunks packed into a bucket of
                                its own, kept until its sums are taken (hb) */
    mti_tensor *hb;          /* per parameter, that bucket (COMM), while held */
    int ag_on;               /* ZeRO-1/2 on NCCL's stream (or planned so): each updated
                                tensor's all-gather queued there (ag_post), its bucket
                                kept until it is retired */
    mti_tensor *agb;         /* per parameter, that bucket (COMM) */
    uint64_t *agt;           /* per parameter, its call on the stream (0: none) */
    int *agq;                /* the gathers posted, in order */
    int ag_head, ag_tail;    /* retired up to head, posted up to tail */
    size_t ag_bytes;         /* their buckets' bytes, held */
    /* ZeRO (cfg.zero_stage on more than one rank; docs/distributed.md) */
    int zero;                /* the stage in force: 0 without sharding */
    int world, rank;         /* the context's (a dry context's planned ones) */
    mti_shard *sh;           /* per parameter */
    mti_tensor *gs;          /* stage 2: per parameter, the gradient of its shard
                                (GRAD), summed over the ranks */
    mti_tensor *pw;          /* stage 3: per parameter, this rank's slice of the
                                weights (PARAM; lib/train/zero3.c) */
    mti_tensor *gb;          /* stage 3: per parameter, its gather buffer (COMM)
                                while a layer holds it in */
    int *gref;               /* stage 3: per parameter, the layers holding it in */
    uint64_t *z3_ticket;     /* stage 3: per parameter, its gather queued on the
                                communication thread, not waited for yet (0: none) */
    unsigned char *z3_held;  /* stage 3: per entry of the engine's schedule, its
                                weights are brought in */
    int z3_prefetch;         /* stage 3: entries brought in ahead (cfg.zero3_prefetch) */
    int z3_stream;           /* stage 3: its queue is NCCL's communication stream (or
                                planned so), whose reduce-scatters go in two halves */
    int z3_keep_from;        /* stage 3: layers from this one on are kept from
                                forward to backward (cfg.zero3_keep) */
    struct mti_z3_group *z3_grp; /* stage 3: per schedule entry, the parameters
                                  * its one packed gather brings in */
    struct mti_z3_rs *z3_rs; /* stage 3: per parameter, its reduce-scatter queued
                                in backward (lib/train/zero3.c) */
    /* tensor parallel (cfg.tensor_parallel > 1; lib/train/tp.c) */
    mti_tp tp;               /* the split (t->model->tp points here while it holds) */
    mt_comm *tp_comm;        /* the tensor group's communicator (owned when tp_own) */
    mt_comm *dp_comm;        /* the data-parallel group's (owned), or NULL */
    int tp_own;
    mti_tensor *tp_whole;    /* per parameter, its whole weights until creation commits */
    /* pipeline parallel (cfg.pipeline_parallel > 1; lib/train/pp.c) */
    mti_pp pp;               /* the stages (t->model->pp points here while it holds) */
    int pp_made;             /* the model is the stage's view */
    int pp_committed;        /* creation succeeded: the other stages' weights are gone */
    int pp_discard;          /* destroy brings nothing back (destroy_with_model) */
    mti_pass *pp_pass;       /* P passes held aside by the schedule */
    struct mti_home *home;   /* per parameter, its home on this rank (lib/train/home.h),
                                chosen at create */
    unsigned home_used;      /* the kinds and shares of home some parameter has (bits) */
    struct mti_offload *off; /* state and masters at home on disk (lib/train/offload.c), or NULL */
    struct mti_hostoff *hoff; /* ... in page-locked host memory (lib/train/offload_host.c), or NULL */
    char *offload_dir;       /* cfg.offload_dir's copy */
    struct mti_sparsity *sparsity; /* cfg.prune's (lib/train/sparsity.c), or NULL */
    unsigned char *units;    /* the recompute plan: a mode per unit */
    int seg_len;             /* and the segment length */
};

#endif /* MT_TRAINER_H */
