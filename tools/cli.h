/*
 * cli.h - what the memtrain command's files share: exit codes, the options
 * of train, sample and estimate (one table, cli_options.c), and the
 * commands (one file each: cli_train.c, cli_sample.c, cli_estimate.c,
 * cli_report.c, cli_replay.c; memtrain.c dispatches).
 */
#ifndef MT_TOOLS_CLI_H
#define MT_TOOLS_CLI_H

#include <stdbool.h>
#include <stdio.h>

#include "memtrain.h"

/* exit codes (docs/cli.md) */
#define EXIT_FAIL 1
#define EXIT_USAGE 2
#define EXIT_BUDGET 3
#define EXIT_DIVERGED 4 /* the training loss was not finite */

extern const char *const cli_prog;

/* The commands that take options from the table, as a mask. */
enum { CLI_TRAIN = 1u, CLI_SAMPLE = 2u, CLI_ESTIMATE = 4u };
/* The models an option means something for (train and sample), as a mask. */
enum { CLI_MLP = 1u, CLI_GPT = 2u, CLI_ANY = 3u };

#define CLI_MAX_OPTIONS 112
#define CLI_MAX_FREEZE 64

/* Every option of train, sample and estimate; each command reads the
 * fields its options set. Defaults come from cli_opts_defaults. */
typedef struct cli_opts {
    unsigned cmd;            /* the command: CLI_TRAIN, CLI_SAMPLE or CLI_ESTIMATE */
    int gpt;                 /* the model: 0 the MLP, 1 a GPT */
    /* MLP */
    int hidden[MT_MLP_MAX_LAYERS];
    int n_hidden;
    mt_activation act;
    /* the run */
    long steps, batch, seed, every, threads;
    float lr, momentum, wd, clip;
    mt_device_kind device;
    mt_precision precision;
    const char *allocator, *trace, *chrome, *svg;
    int report;              /* -1: on unless --json */
    int json, no_master, fused, constant_lr;
    mt_optimizer_kind optimizer;
    mt_recompute_policy recompute;
    int recompute_every;
    /* GPT */
    const char *data;        /* a text or llm.c token file; NULL: the built-in corpus */
    long layers, heads, channels, seq, micro, eval_every, save_every;
    long vocab, max_seq;     /* estimate: the GPT's vocabulary and positions */
    const char *save, *resume, *llmc, *export_llmc;
    /* sample */
    const char *prompt;
    long length;
    float temperature;
    /* estimate */
    double budget_mib;
    int autofit, allow8, allow4;
    int layout;              /* --layout auto: --autofit chooses --tp, --sp and --zero too */
    /* frozen parameters: --freeze patterns, split at commas into freeze_text */
    const char *freeze[CLI_MAX_FREEZE];
    int n_freeze;
    char freeze_text[1024];
    size_t freeze_used;
    /* LoRA */
    long lora;               /* rank, 0: none */
    float lora_alpha;
    const char *lora_targets;
    int merge_lora;
    const char *save_lora, *load_lora; /* adapter files */
    mt_base_format base;     /* --base: the frozen linear weights quantized */
    /* distillation: the teacher's llm.c file, alpha, temperature */
    const char *teacher;
    mt_base_format teacher_base; /* --teacher-base: its linear weights quantized as read */
    float distill_alpha, distill_temp;
    /* pruning: --prune and its settings (the library's mt_prune_config) */
    mt_prune_config prune;
    long calib, prune_at, prune_start, prune_end, prune_every, regrow_every, regrow_end;
    /* train under mpirun */

    long comm_timeout;       /* seconds a collective may wait for the other ranks */
    long local_sgd;          /* local SGD: average the weights every this many steps */
    int overlap;             /* MPI serialized: the gradients summed on a thread */
    long zero;               /* the ZeRO stage (train under mpirun, estimate) */
    long tp;                 /* tensor parallel: ranks per tensor group (1: off) */
    int sp;                  /* --sp: sequence parallel within the tensor groups */
    long pp;                 /* pipeline parallel: stages per pipeline group (1: off) */
    long zero3_prefetch, zero3_keep; /* stage 3: layers gathered ahead, kept for backward */
    long ranks, rank;        /* estimate: one rank of a data-parallel run */
    /* where the optimizer state and masters live: --offload, --offload-dir */
    mt_place offload;
    const char *offload_dir;
    int offload_params;      /* --offload-params: the weights on disk too */
    /* the value each table entry the command line (or --config) gave was
       given last, as text ("" for a flag); NULL: not given */
    const char *text[CLI_MAX_OPTIONS];
} cli_opts;

/* Prints "memtrain: <fmt with its arguments>" and a pointer to --help on
 * stderr; returns EXIT_USAGE. */
int cli_bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Prints "memtrain: <the library's last error>" on stderr; returns EXIT_FAIL. */
int cli_lib_fail(mt_context *ctx, const char *what);

int cli_parse_long(const char *s, long lo, long hi, long *out);
int cli_parse_device(const char *s, mt_device_kind *out);

/* Parses the options of a command (cmd: CLI_TRAIN, CLI_SAMPLE or
 * CLI_ESTIMATE) into o: 0, or an exit code. --help prints the usage (head,
 * then the table's lines), sets *done and gives 0. */
int cli_parse(unsigned cmd, const char *head, int argc, char **argv, cli_opts *o, bool *done);
/* The usage text of a command from the table, after its head lines. */
void cli_usage(FILE *f, unsigned cmd, const char *head);
/* Whether --name (without dashes) is a flag, taking no value (config.c). */
bool cli_is_flag(const char *name);
/* Whether a command (CLI_TRAIN, ...) takes the option name (without its
 * leading "--"). */
bool cli_takes(const char *name, unsigned cmd);

/* --prune's settings against the model made: 0, or an exit code (a value
 * that does not fit it, such as --nm M not dividing a row: EXIT_USAGE). */
int cli_prune_check(const cli_opts *o, mt_context *ctx, const mt_model *m);

/* Entries of the option table, for the ranks' agreement (cli_ranks.c). */
int cli_option_count(void);
/* Entry i's name ("--eval-every"), or NULL where it is not an option of
 * o's command or is each rank's own (--offload-dir); *text: its value as
 * the command line gave it into buf ("" for a flag; --freeze's patterns
 * joined by commas), or NULL when it was not given. */
const char *cli_option_given(const cli_opts *o, int i, const char **text, char *buf, size_t cap);

/* The trainer configuration the options give, for the model they name. */
void cli_trainer_config(const cli_opts *o, mt_trainer_config *tc);
/* The base format a GPT is made or loaded in: --base's under LoRA (its
 * whole base is frozen, so every linear weight is quantized as it is made),
 * else full (the trainer quantizes the frozen weights it is given). */
mt_base_format cli_spec_base(const cli_opts *o);
/* Whether the model is made straight into the trainer's homes for it
 * (mt_gpt_spec.deferred): at ZeRO-3 and with the weights on disk. */
int cli_deferred(const cli_opts *o);
/* The MLP the options give: 2 inputs, the hidden sizes, 3 classes. */
void cli_mlp_spec(const cli_opts *o, mt_mlp_spec *spec);
/* The context configuration the options give (device, threads, allocators). */
void cli_context_config(const cli_opts *o, mt_context_config *cc);

/* Prints `, "key": v` to f, v with fmt, or null where v is not finite
 * (JSON has no NaN or infinity). */
void cli_json_num(FILE *f, const char *key, const char *fmt, double v);

/* Prints s to f as a JSON string. */
void cli_json_str(FILE *f, const char *s);

/* The context's device name, and on the CPU the class of instructions its
 * kernels use (mt_cpu_isa), e.g. "CPU (2 threads), avx2 kernels". */
const char *cli_device_label(mt_context *ctx);

/* The memory report of a context on f. */
void cli_print_report(mt_context *ctx, FILE *f);

/* train under mpirun (cli_ranks.c): the job's ranks, one data-parallel run */
typedef struct cli_ranks {
    mt_comm *comm;           /* NULL: a world of one */
    int rank, size;
    int mpi;                 /* MPI was started here */
    int together;            /* every rank stops with the same exit code (the ranks'
                                options disagree): MPI ends in order */
    int tp;                  /* ranks per tensor group (--tp): a group shares its rows */
    int pp;                  /* stages per pipeline group (--pp): a group shares its rows too */
} cli_ranks;
extern cli_ranks cli_world;
/* Started by mpirun with more than one rank: MPI (MPI_ERRORS_RETURN on
 * MPI_COMM_WORLD), the communicator, the ranks' agreement on every option
 * (as given; --data's contents too) and stdout closed on ranks other
 * than 0. 0, or an exit code (EXIT_USAGE on every rank, rank 0 naming the
 * option and each rank's value, when they disagree). */
int cli_ranks_open(const cli_opts *o);
/* MPI's end: MPI_Finalize, or MPI_Abort(rc) after a failure that may be
 * this rank's alone (not a signal's stop or a diverged loss, which every
 * rank sees at the same step). */
void cli_ranks_close(int rc);
/* Narrows a global batch to this rank's rows (features per row of inputs). */
void cli_ranks_rows(mt_batch *b, int features);
/* A trainer configuration for this rank's share of the global batch. */
void cli_ranks_trainer_config(mt_trainer_config *tc);
/* The same for a rank of `ranks` (the largest share: ceil(batch / ranks)). */
void cli_ranks_batch(mt_trainer_config *tc, int ranks);
/* The means over the ranks of n (<= 8) values, each rank's weighted by
 * its rows; a collective. 0, or an exit code. */
int cli_ranks_mean(float *v, int n, int rows);
/* *any: whether flag is set on any rank (every rank gets the same answer),
 * asked after step `step`; a collective. 0, or an exit code once a message
 * names the failure (the collective's cause, this rank, the step). */
int cli_ranks_any(bool flag, long step, bool *any);
/* Every rank's peak live bytes into peaks (cli_world.size of them); a
 * collective. 0, or an exit code. */
int cli_ranks_peaks(mt_context *ctx, uint64_t *peaks);

int cmd_train(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_estimate(int argc, char **argv);
int cmd_report(int argc, char **argv);
int cmd_replay(int argc, char **argv);

/* train's GPT, set up for training or sampling (cli_train.c): the data,
 * the model, the trainer, resumed from o->resume when given. */
typedef struct cli_gpt {
    mt_data *data;
    mt_data_info info;
    mt_gpt_spec spec;
    mt_model *model;
    mt_model *teacher;       /* --teacher, or NULL */
    mt_trainer *trainer;
    mt_estimate_report est;
} cli_gpt;
int cli_gpt_open(const cli_opts *o, mt_context *ctx, cli_gpt *g);
/* The GPT of the options on data of vocabulary data_vocab: its weights and
 * shape (into *spec) from --llmc, which must take the data at --seq, or
 * made from *spec. 0, or an exit code (the message printed; *out may hold
 * a model to destroy). */
int cli_gpt_model(const cli_opts *o, mt_context *ctx, int data_vocab, mt_gpt_spec *spec,
                  mt_model **out);
/* The GPT's data as train reads it: --data, or the built-in corpus. 0, or
 * an exit code (the message printed). */
int cli_data_open(const cli_opts *o, mt_data **out);
void cli_gpt_close(cli_gpt *g);

#endif /* MT_TOOLS_CLI_H */
