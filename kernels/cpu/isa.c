/*
 * isa.c - the class of CPU instructions the kernels use (arch.h): the
 * CPU's, capped by the environment variable MT_CPU_ISA, read once per
 * process. The cap also caps oneDNN, which must hear of it before it makes
 * any code: the first context, the first GEMM and the first dispatched
 * loop all come here first.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

#include "arch.h"
#include "ops/kernels.h"

static const char *const g_names[] = {"baseline", "avx2", "avx512", "avx512_bf16", "amx"};
_Static_assert(sizeof g_names / sizeof *g_names == MTI_ISA_COUNT, "a name per mti_isa");

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static mti_isa g_detected, g_cap = MTI_ISA_COUNT - 1, g_used;
static int g_bad;
static char g_msg[320];

_Atomic int mti_vec_level_now = -1;

static int vec_of(mti_isa i) { return i >= MTI_ISA_AVX512 ? 2 : i >= MTI_ISA_AVX2 ? 1 : 0; }

const char *mti_isa_name(mti_isa i)
{
    return (unsigned)i < MTI_ISA_COUNT ? g_names[i] : NULL;
}

static void isa_init(void)
{
    g_detected = mti_arch_detect();
    mti_isa cap = MTI_ISA_COUNT - 1;
    const char *v = getenv("MT_CPU_ISA");
    if (v && *v) {
        int found = -1;
        for (int i = 0; i < MTI_ISA_COUNT; i++)
            if (!strcasecmp(v, g_names[i])) found = i;
        if (found < 0) {
            g_bad = 1;
            snprintf(g_msg, sizeof g_msg,
                     "MT_CPU_ISA='%.64s' is not a CPU class; the classes are baseline, avx2, "
                     "avx512, avx512_bf16 and amx (or leave it unset: the CPU's own)",
                     v);
        } else {
            cap = (mti_isa)found;
            if (mti_arch_cap_onednn(cap)) {
                g_bad = 1;
                snprintf(g_msg, sizeof g_msg,
                         "MT_CPU_ISA=%s cannot cap oneDNN: it made %s code in this process "
                         "before memtrain started; set ONEDNN_MAX_CPU_ISA to match, or set "
                         "MT_CPU_ISA before the program uses oneDNN",
                         g_names[cap], mti_arch_onednn_isa());
            }
        }
    }
    g_cap = cap;
    g_used = g_detected < cap ? g_detected : cap;
    atomic_store_explicit(&mti_vec_level_now, vec_of(g_used), memory_order_relaxed);
}

mti_isa mti_isa_detected(void)
{
    pthread_once(&g_once, isa_init);
    return g_detected;
}

mti_isa mti_isa_used(void)
{
    pthread_once(&g_once, isa_init);
    return g_used;
}

const char *mti_isa_used_name(void) { return mti_isa_name(mti_isa_used()); }

int mti_isa_check(char *msg, size_t cap)
{
    pthread_once(&g_once, isa_init);
    if (!g_bad) return 0;
    if (msg && cap) snprintf(msg, cap, "%s", g_msg);
    return -1;
}

mti_isa mti_isa_force(mti_isa i)
{
    pthread_once(&g_once, isa_init);
    mti_isa was = g_used;
    g_used = i < g_detected ? i : g_detected;
    g_used = g_used < g_cap ? g_used : g_cap;
    atomic_store_explicit(&mti_vec_level_now, vec_of(g_used), memory_order_relaxed);
    return was;
}

int mti_vec_level_init(void)
{
    pthread_once(&g_once, isa_init);
    return atomic_load_explicit(&mti_vec_level_now, memory_order_relaxed);
}

const mti_arch_paths *mti_arch_paths_now(void) { return mti_arch_paths_at(mti_vec_level()); }
