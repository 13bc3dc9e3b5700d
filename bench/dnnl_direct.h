/*
 * dnnl_direct.h - a whole GEMM through one oneDNN matmul, threaded by
 * oneDNN over the calling thread's OpenMP thread count: what a caller
 * without the op table writes, and the rate the table's tiled GEMMs are
 * compared with (bench_kernels, bench_gpt2 --gemm).
 *
 * C (M,N) [+]= op(A) (M,K) op(B) (K,N) [+ bias (1,N)], dense row-major:
 * A (M,K), or (K,M) when ta; B (K,N), or (N,K) when tb. Any failure exits.
 */
#ifndef MT_BENCH_DNNL_DIRECT_H
#define MT_BENCH_DNNL_DIRECT_H

#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memtrain.h"

typedef struct dd_mm {
    dnnl_primitive_t prim;
    dnnl_memory_desc_t md[4]; /* src, weights, dst, bias */
    int bias;
} dd_mm;

static dnnl_engine_t dd_engine;
static dnnl_stream_t dd_stream;

static inline void dd_check(dnnl_status_t s, const char *what)
{
    if (s == dnnl_success) return;
    fprintf(stderr, "oneDNN: %s failed (status %d)\n", what, (int)s);
    exit(1);
}

static inline void dd_md(dnnl_memory_desc_t *md, int64_t rows, int64_t cols, int trans,
                  dnnl_data_type_t dt)
{
    dnnl_dims_t dims = {rows, cols};
    dd_check(dnnl_memory_desc_init_by_tag(md, 2, dims, dt, trans ? dnnl_ba : dnnl_ab), "md");
}

static inline void dd_make(dd_mm *m, int M, int N, int K, int ta, int tb, dnnl_data_type_t ab,
                    dnnl_data_type_t c, int bias, int accumulate)
{
    if (!dd_engine) {
        (void)mt_cpu_isa(); /* MT_CPU_ISA caps oneDNN before its first code */
        dd_check(dnnl_engine_create(&dd_engine, dnnl_cpu, 0), "engine");
        dd_check(dnnl_stream_create(&dd_stream, dd_engine, dnnl_stream_default_flags), "stream");
    }
    dd_md(&m->md[0], M, K, ta, ab);
    dd_md(&m->md[1], K, N, tb, ab);
    dd_md(&m->md[2], M, N, 0, c);
    m->bias = bias;
    if (bias) dd_md(&m->md[3], 1, N, 0, ab);
    dnnl_matmul_desc_t op;
    dd_check(dnnl_matmul_desc_init(&op, &m->md[0], &m->md[1], bias ? &m->md[3] : NULL, &m->md[2]),
             "matmul desc");
    dnnl_primitive_attr_t attr;
    dnnl_post_ops_t po = NULL;
    dd_check(dnnl_primitive_attr_create(&attr), "attr");
    if (accumulate) {
        dd_check(dnnl_post_ops_create(&po), "post ops");
        dd_check(dnnl_post_ops_append_sum(po, 1.0f), "sum");
        dd_check(dnnl_primitive_attr_set_post_ops(attr, po), "post ops");
    }
    dnnl_primitive_desc_t pd;
    dd_check(dnnl_primitive_desc_create(&pd, &op, attr, dd_engine, NULL), "matmul pd");
    dd_check(dnnl_primitive_create(&m->prim, pd), "matmul");
    dnnl_primitive_desc_destroy(pd);
    if (po) dnnl_post_ops_destroy(po);
    dnnl_primitive_attr_destroy(attr);
}

static inline void dd_run(const dd_mm *m, const void *a, const void *b, void *c, const void *bias)
{
    static const int arg[4] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST, DNNL_ARG_BIAS};
    const void *ptr[4] = {a, b, c, bias};
    dnnl_memory_t mem[4];
    dnnl_exec_arg_t args[4];
    int n = m->bias ? 4 : 3;
    for (int i = 0; i < n; i++) {
        dd_check(dnnl_memory_create(&mem[i], &m->md[i], dd_engine, (void *)ptr[i]), "memory");
        args[i] = (dnnl_exec_arg_t){arg[i], mem[i]};
    }
    dd_check(dnnl_primitive_execute(m->prim, dd_stream, n, args), "execute");
    dd_check(dnnl_stream_wait(dd_stream), "wait");
    for (int i = 0; i < n; i++) dnnl_memory_destroy(mem[i]);
}

static inline void dd_free(dd_mm *m) { dnnl_primitive_destroy(m->prim); }

/* One line: the CPU model, the ISA extensions that matter to the GEMMs,
 * oneDNN's version and the ISA it runs on, and the class of memtrain's
 * kernels (mt_cpu_isa: the CPU's, capped by MT_CPU_ISA). */
static inline void dd_describe(FILE *f)
{
    const char *ours = mt_cpu_isa(); /* first: it caps oneDNN */
    static const char *isa[] = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile",
                                "amx_bf16"};
    char line[8192], model[256] = "unknown", flags[8192] = "";
    FILE *ci = fopen("/proc/cpuinfo", "r");
    while (ci && fgets(line, sizeof line, ci)) {
        char *v = strchr(line, ':');
        if (!v) continue;
        v += 1 + (v[1] == ' ');
        v[strcspn(v, "\n")] = 0;
        if (!strncmp(line, "model name", 10) && !strcmp(model, "unknown"))
            snprintf(model, sizeof model, "%s", v);
        if (!strncmp(line, "flags", 5) && !flags[0]) snprintf(flags, sizeof flags, " %s ", v);
    }
    if (ci) fclose(ci);
    fprintf(f, "CPU: %s; ISA:", model);
    for (size_t i = 0; i < sizeof isa / sizeof *isa; i++) {
        char word[64];
        snprintf(word, sizeof word, " %s ", isa[i]);
        fprintf(f, " %s%s", strstr(flags, word) ? "" : "no ", isa[i]);
    }
    const dnnl_version_t *v = dnnl_version();
    dnnl_cpu_isa_t e = dnnl_get_effective_cpu_isa();
    const char *name = e == dnnl_cpu_isa_avx512_core_amx    ? "avx512_core_amx"
                       : e == dnnl_cpu_isa_avx512_core_bf16 ? "avx512_core_bf16"
                       : e == dnnl_cpu_isa_avx512_core_vnni ? "avx512_core_vnni"
                       : e == dnnl_cpu_isa_avx512_core      ? "avx512_core"
                       : e == dnnl_cpu_isa_avx2_vnni        ? "avx2_vnni"
                       : e == dnnl_cpu_isa_avx2             ? "avx2"
                       : e == dnnl_cpu_isa_sse41            ? "sse41"
                                                            : "other";
    fprintf(f, "; oneDNN %d.%d.%d on %s; memtrain kernels %s\n", v->major, v->minor, v->patch,
            name, ours);
}

#endif /* MT_BENCH_DNNL_DIRECT_H */
