/*
 * bench_cuda.c - the CUDA op table's speed on a GPU: GEMMs in TFLOP/s, and
 * the memory-bound kernels in GB/s against the device's own copy bandwidth.
 *
 * (a) GEMM: matmul_fwd (y = x W^T, no bias: cuBLASLt alone) at the linear
 *     layers of GPT-2 124M for N = B*T rows (8 x 1024; --quick 64): qkv
 *     768->2304, attention projection 768->768, MLP 768->3072 and
 *     3072->768, the head 768->50304 (--quick 768->1024); fp32, fp16 and
 *     bf16; 2 N I O flops per call.
 * (b) Bandwidth over n = 64 Mi elements (--quick 1 Mi): a device-to-device
 *     copy of n fp32 (2 x 4n bytes moved: the reference), and through the
 *     table: cast fp32 -> bf16 (6 bytes an element), unscale and check
 *     (8), AdamW on fp32 state (28: p, g, m, v read, p, m, v written) and
 *     8-bit AdamW (16: p read and written, g read, both codes read and
 *     written; the per-block absmax is 1/64 of that); each in GB/s and as
 *     a fraction of the copy's rate.
 *
 * (c) The layer ops of a GPT-2 124M step at B 8, T 1024 (--quick: B 1, T
 *     64), C 768, H 12, in fp32, fp16 and bf16, ms per call: layernorm
 *     forward and backward (whole; dx alone added to, written, and over
 *     dout; dw and db alone), GELU
 *     forward and backward, attention forward and backward.
 *
 * Each time is the median of 5 batches of calls, the device synchronised
 * before and after each batch. Prints a table, and with --json FILE one JSON
 * line per measurement into FILE. Runs wherever a CUDA context opens:
 * MT_FAKE_CUDA and MT_FAKE_CUBLASLT (the test suite's stand-ins) run it
 * without a GPU, as a check of the program; its figures then mean nothing.
 *
 * Usage: bench_cuda [--quick] [--json FILE]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "ops/kernels.h"
#include "../bench/common.h"

#define BATCHES 5

static bool quick;
static FILE *json;
static mt_context *ctx;
static const mti_ops *ops;
static mti_kctx K;

static void die(const char *what, mt_status s)
{
    fprintf(stderr, "bench_cuda: %s: %s (%s)\n", what, mt_status_string(s), mt_last_error(ctx));
    exit(1);
}

static void *dev(size_t bytes, mt_block *b)
{
    mt_alloc_request r = {.bytes = bytes, .mem_class = MT_MEM_IO, .lifetime = MT_LIFE_PERSISTENT};
    mt_status s = mt_context_alloc(ctx, &r, b);
    if (s) die("allocating device memory", s);
    if ((s = ctx->dev->memset8(ctx->dev, b->ptr, 0, bytes))) die("memset", s);
    return b->ptr;
}

static void sync_dev(void)
{
    mt_status s = ctx->dev->sync(ctx->dev);
    if (s) die("sync", s);
}

/* One measured op: fn(arg) run `reps` times per batch; seconds per call. */
typedef mt_status (*op_fn)(void *arg);

static double time_op(op_fn fn, void *arg, int reps, const char *what)
{
    mt_status s = fn(arg); /* warm-up: plans, lazily loaded code */
    if (s) die(what, s);
    sync_dev();
    double t[BATCHES];
    for (int b = 0; b < BATCHES; b++) {
        double t0 = now_s();
        for (int i = 0; i < reps; i++)
            if ((s = fn(arg))) die(what, s);
        sync_dev();
        t[b] = (now_s() - t0) / reps;
    }
    return median(t, BATCHES);
}

static const char *dt_name(mti_dtype dt)
{
    return dt == MTI_F16 ? "fp16" : dt == MTI_BF16 ? "bf16" : "fp32";
}

/* ---- (a) GEMM ---- */

typedef struct gemm_arg {
    void *y, *x, *w;
    int n, in, out;
    mti_dtype dt;
} gemm_arg;

static mt_status gemm_call(void *p)
{
    gemm_arg *a = p;
    return ops->matmul_fwd(&K, a->y, a->x, a->w, NULL, a->n, a->in, a->out, a->dt);
}

static void bench_gemm(void)
{
    const int N = quick ? 64 : 8 * 1024, V = quick ? 1024 : 50304;
    const int shapes[5][2] = {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}, {768, V}};
    static const char *names[5] = {"qkv", "attn proj", "mlp up", "mlp down", "head"};
    static const mti_dtype dts[3] = {MTI_F32, MTI_F16, MTI_BF16};
    printf("\n(a) GEMM y = x W^T, N = %d rows (TFLOP/s)\n\n| layer | I | O |", N);
    for (int d = 0; d < 3; d++) printf(" %s |", dt_name(dts[d]));
    printf("\n|---|---|---|---|---|---|\n");
    for (int s = 0; s < 5; s++) {
        int in = shapes[s][0], out = shapes[s][1];
        printf("| %s | %d | %d |", names[s], in, out);
        for (int d = 0; d < 3; d++) {
            size_t es = mti_dtype_size(dts[d]);
            mt_block bx, bw, by;
            gemm_arg a = {dev((size_t)N * out * es, &by), dev((size_t)N * in * es, &bx),
                          dev((size_t)out * in * es, &bw), N, in, out, dts[d]};
            double flop = 2.0 * N * in * out;
            int reps = quick ? 1 : (int)(2e12 / flop) + 1; /* about 2 TFLOP a batch */
            double t = time_op(gemm_call, &a, reps, "matmul_fwd");
            double tf = flop / t / 1e12;
            printf(" %.1f |", tf);
            if (json)
                fprintf(json, "{\"bench\": \"gemm\", \"layer\": \"%s\", \"N\": %d, \"I\": %d, \"O\": %d, "
                        "\"dtype\": \"%s\", \"ms\": %.4f, \"tflops\": %.3f}\n", names[s], N, in, out,
                        dt_name(dts[d]), t * 1e3, tf);
            mt_context_free(ctx, &bx), mt_context_free(ctx, &bw), mt_context_free(ctx, &by);
        }
        printf("\n");
    }
}

/* ---- (b) bandwidth ---- */

typedef struct bw_arg {
    size_t n;
    float *p, *g, *m, *v;
    void *half;
    uint8_t *qm, *qv;
    float *am, *av;
    int *found;
    int64_t step;
} bw_arg;

static mt_status copy_call(void *p)
{
    bw_arg *a = p;
    return ctx->dev->copy_d2d(ctx->dev, a->m, a->p, a->n * 4);
}
static mt_status cast_call(void *p)
{
    bw_arg *a = p;
    return ops->cast(&K, a->half, MTI_BF16, a->p, MTI_F32, a->n, MTI_ROUND_NEAREST, 0);
}
static mt_status unscale_call(void *p)
{
    bw_arg *a = p;
    return ops->unscale_check(&K, a->g, a->n, 1.0f, a->found);
}
static mti_adamw_args adamw_args(bw_arg *a)
{
    return (mti_adamw_args){.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                            .weight_decay = 0.0f, .step = ++a->step, .grad_scale = 1.0f};
}
static mt_status adamw_call(void *p)
{
    bw_arg *a = p;
    mti_adamw_args aa = adamw_args(a);
    return ops->adamw(&K, a->p, a->g, a->m, a->v, NULL, MTI_F32, a->n, &aa);
}
static mt_status adamw8_call(void *p)
{
    bw_arg *a = p;
    mti_adamw_args aa = adamw_args(a);
    return ops->adamw8(&K, a->p, a->g, a->qm, a->qv, a->am, a->av, NULL, MTI_F32, a->n, &aa);
}

static void bench_bandwidth(void)
{
    const size_t n = quick ? (size_t)1 << 20 : (size_t)64 << 20;
    const size_t nb = (n + MTI_Q8_BLOCK - 1) / MTI_Q8_BLOCK;
    mt_block b[10];
    bw_arg a = {.n = n};
    a.p = dev(n * 4, &b[0]), a.g = dev(n * 4, &b[1]), a.m = dev(n * 4, &b[2]);
    a.v = dev(n * 4, &b[3]), a.half = dev(n * 2, &b[4]), a.qm = dev(n, &b[5]);
    a.qv = dev(n, &b[6]), a.am = dev(nb * 4, &b[7]), a.av = dev(nb * 4, &b[8]);
    a.found = dev(256, &b[9]);
    const struct {
        const char *name;
        op_fn fn;
        double bytes; /* per element */
    } k[] = {{"copy (device to device)", copy_call, 8.0},
             {"cast fp32 -> bf16", cast_call, 6.0},
             {"unscale and check", unscale_call, 8.0},
             {"AdamW (fp32 state)", adamw_call, 28.0},
             {"8-bit AdamW", adamw8_call, 16.0 + 16.0 / MTI_Q8_BLOCK}};
    int reps = quick ? 1 : 10;
    printf("\n(b) memory-bound kernels over %zu Mi elements\n\n"
           "| kernel | bytes/element | ms | GB/s | of copy |\n|---|---|---|---|---|\n", n >> 20);
    double copy_gbs = 0.0;
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        double t = time_op(k[i].fn, &a, reps, k[i].name);
        double gbs = k[i].bytes * (double)n / t / 1e9;
        if (i == 0) copy_gbs = gbs;
        printf("| %s | %.2f | %.3f | %.0f | %.2f |\n", k[i].name, k[i].bytes, t * 1e3, gbs,
               gbs / copy_gbs);
        if (json)
            fprintf(json, "{\"bench\": \"bandwidth\", \"kernel\": \"%s\", \"n\": %zu, "
                    "\"bytes_per_element\": %.4f, \"ms\": %.4f, \"gbs\": %.2f, \"of_copy\": %.3f}\n",
                    k[i].name, n, k[i].bytes, t * 1e3, gbs, gbs / copy_gbs);
    }
    for (int i = 0; i < 10; i++) mt_context_free(ctx, &b[i]);
}

/* ---- (c) the layer ops of a GPT-2 124M step ---- */

typedef struct layer_arg {
    int B, T, C, H;
    mti_dtype dt;
    void *x, *y, *dy, *dx, *w, *b, *qkv, *dqkv, *att;
    float *mean, *rstd, *dw, *db, *lse;
} layer_arg;

static mt_status ln_fwd_call(void *p)
{
    layer_arg *a = p;
    return ops->layernorm_fwd(&K, a->y, a->mean, a->rstd, a->x, a->w, a->b, a->B * a->T, a->C,
                              a->dt);
}
/* layernorm_bwd into dx (NULL: none; may be dy itself), with or without
 * dw and db, added to dx or written */
static mt_status ln_bwd(layer_arg *a, void *dx, bool params, int acc)
{
    return ops->layernorm_bwd(&K, dx, params ? a->dw : NULL, params ? a->db : NULL, a->dy, a->x,
                              a->w, a->mean, a->rstd, a->B * a->T, a->C, a->dt, acc);
}
static mt_status ln_bwd_call(void *p) { return ln_bwd(p, ((layer_arg *)p)->dx, true, 1); }
static mt_status ln_bwd_dx_call(void *p) { return ln_bwd(p, ((layer_arg *)p)->dx, false, 1); }
static mt_status ln_bwd_dwdb_call(void *p) { return ln_bwd(p, NULL, true, 1); }
static mt_status ln_bwd_dx_set_call(void *p) { return ln_bwd(p, ((layer_arg *)p)->dx, false, 0); }
static mt_status ln_bwd_dx_inplace_call(void *p) { return ln_bwd(p, ((layer_arg *)p)->dy, false, 0); }
static mt_status gelu_fwd_call(void *p)
{
    layer_arg *a = p;
    return ops->gelu_fwd(&K, a->y, a->x, (size_t)a->B * a->T * a->C, a->dt);
}
static mt_status gelu_bwd_call(void *p)
{
    layer_arg *a = p;
    return ops->gelu_bwd(&K, a->dx, a->dy, a->x, (size_t)a->B * a->T * a->C, a->dt);
}
static mt_status attn_fwd_call(void *p)
{
    layer_arg *a = p;
    return ops->attention_fwd(&K, a->att, a->lse, a->qkv, a->B, a->T, a->C, a->H, a->dt);
}
static mt_status attn_bwd_call(void *p)
{
    layer_arg *a = p;
    return ops->attention_bwd(&K, a->dqkv, a->dy, a->qkv, a->att, a->lse, a->B, a->T, a->C,
                              a->H, a->dt);
}

/* Each op once per layer call at B 8, T 1024 (--quick: B 1, T 64), C 768,
 * H 12, in every dtype; bytes are the op's reads and writes of its tensors
 * (B T C elements each) at the dtype's size, for GB/s. */
static void bench_layers(void)
{
    layer_arg a = {.B = quick ? 1 : 8, .T = quick ? 64 : 1024, .C = 768, .H = 12};
    const size_t n = (size_t)a.B * a.T * a.C, rows = (size_t)a.B * a.T;
    const struct {
        const char *name;
        op_fn fn;
        double tensors; /* B T C tensors read and written */
    } k[] = {{"layernorm forward", ln_fwd_call, 2.0},
             {"layernorm backward (dx, dw, db)", ln_bwd_call, 5.0},
             {"layernorm backward (dx alone, added)", ln_bwd_dx_call, 5.0},
             {"layernorm backward (dx alone, written)", ln_bwd_dx_set_call, 4.0},
             {"layernorm backward (dx alone, over dout)", ln_bwd_dx_inplace_call, 3.0},
             {"layernorm backward (dw, db alone)", ln_bwd_dwdb_call, 2.0},
             {"GELU forward", gelu_fwd_call, 2.0},
             {"GELU backward", gelu_bwd_call, 3.0},
             {"attention forward", attn_fwd_call, 5.0},
             {"attention backward", attn_bwd_call, 9.0}};
    int reps = quick ? 1 : 10;
    printf("\n(c) layer ops at B %d, T %d, C %d, H %d (ms per call)\n\n"
           "| op | fp32 | fp16 | bf16 | GB/s fp32 | GB/s bf16 |\n|---|---|---|---|---|---|\n",
           a.B, a.T, a.C, a.H);
    double ms[10][3];
    for (int d = 0; d < 3; d++) {
        mt_block blk[16];
        int nb = 0;
        a.dt = (mti_dtype)d;
        size_t es = d == 0 ? 4 : 2;
        a.x = dev(n * es, &blk[nb++]), a.y = dev(n * es, &blk[nb++]);
        a.dy = dev(n * es, &blk[nb++]), a.dx = dev(n * es, &blk[nb++]);
        a.w = dev((size_t)a.C * es, &blk[nb++]), a.b = dev((size_t)a.C * es, &blk[nb++]);
        a.qkv = dev(3 * n * es, &blk[nb++]), a.dqkv = dev(3 * n * es, &blk[nb++]);
        a.att = dev(n * es, &blk[nb++]);
        a.mean = dev(rows * 4, &blk[nb++]), a.rstd = dev(rows * 4, &blk[nb++]);
        a.dw = dev((size_t)a.C * 4, &blk[nb++]), a.db = dev((size_t)a.C * 4, &blk[nb++]);
        a.lse = dev(rows * (size_t)a.H * 4, &blk[nb++]);
        /* values in [-1, 1) (gradients 1/64 of that): some kernels take
         * data-dependent time, and zeros would hide it */
        size_t most = 3 * n;
        float *h = malloc(most * 4);
        mt_block tmp;
        float *d32 = dev(most * 4, &tmp);
        if (!h) die("host memory", MT_ERR_OOM);
        uint64_t z = 0x9E3779B97F4A7C15ull;
        for (size_t i = 0; i < most; i++) {
            z ^= z << 13, z ^= z >> 7, z ^= z << 17;
            h[i] = (float)(z >> 40) / (float)(1 << 23) - 1.0f;
        }
        mt_status st = ctx->dev->copy_h2d(ctx->dev, d32, h, most * 4);
        void *fill[] = {a.x, a.qkv, a.w, a.b};
        size_t len[] = {n, 3 * n, (size_t)a.C, (size_t)a.C};
        for (int i = 0; i < 4 && !st; i++)
            st = ops->cast(&K, fill[i], a.dt, d32, MTI_F32, len[i], MTI_ROUND_NEAREST, 0);
        for (size_t i = 0; i < n; i++) h[i] *= 1.0f / 64.0f;
        if (!st) st = ctx->dev->copy_h2d(ctx->dev, d32, h, n * 4);
        if (!st) st = ops->cast(&K, a.dy, a.dt, d32, MTI_F32, n, MTI_ROUND_NEAREST, 0);
        if (!st) st = ctx->dev->sync(ctx->dev);
        free(h);
        mt_context_free(ctx, &tmp);
        if (st) die("filling the layer ops' inputs", st);
        /* the saved statistics and lse the backward ops read */
        st = ln_fwd_call(&a);
        if (!st) st = attn_fwd_call(&a);
        if (st) die("layer ops", st);
        for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
            ms[i][d] = time_op(k[i].fn, &a, reps, k[i].name) * 1e3;
        for (int i = 0; i < nb; i++) mt_context_free(ctx, &blk[i]);
    }
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        double g32 = k[i].tensors * (double)n * 4 / (ms[i][0] * 1e-3) / 1e9;
        double g16 = k[i].tensors * (double)n * 2 / (ms[i][2] * 1e-3) / 1e9;
        printf("| %s | %.3f | %.3f | %.3f | %.0f | %.0f |\n", k[i].name, ms[i][0], ms[i][1],
               ms[i][2], g32, g16);
        for (int d = 0; d < 3 && json; d++)
            fprintf(json, "{\"bench\": \"layer\", \"op\": \"%s\", \"dtype\": \"%s\", "
                    "\"B\": %d, \"T\": %d, \"C\": %d, \"H\": %d, \"ms\": %.4f}\n",
                    k[i].name, dt_name((mti_dtype)d), a.B, a.T, a.C, a.H, ms[i][d]);
    }
}

int main(int argc, char **argv)
{
    const char *json_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
        else {
            fprintf(stderr, "usage: bench_cuda [--quick] [--json FILE]\n");
            return 2;
        }
    }
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CUDA;
    cc.cuda_driver_path = getenv("MT_FAKE_CUDA");
    cc.cublaslt_path = getenv("MT_FAKE_CUBLASLT");
    mt_status s = mt_context_create(&cc, &ctx);
    if (s) {
        fprintf(stderr, "bench_cuda: no CUDA context: %s (%s)\n", mt_status_string(s),
                mt_last_error(NULL));
        return 1;
    }
    if (!ctx->ops) die("the CUDA op table", MT_ERR_UNSUPPORTED);
    ops = ctx->ops;
    K = (mti_kctx){ctx, ctx->dev};
    if (json_path && !(json = fopen(json_path, "w"))) {
        perror(json_path);
        return 1;
    }
    printf("bench_cuda on %s%s\n", mt_context_device_name(ctx),
           cc.cuda_driver_path ? " (the stand-in driver: no GPU, the figures mean nothing)" : "");
    bench_gemm();
    bench_bandwidth();
    bench_layers();
    if (json) fclose(json);
    mt_context_destroy(ctx);
    return 0;
}
