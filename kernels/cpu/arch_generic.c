/*
 * arch_generic.c - every architecture but x86-64 (arch.h): one class, the
 * architecture's baseline, whose vector unit (NEON on aarch64) the
 * compiler uses for the portable loops; no hand-written paths, and oneDNN
 * (or the BLAS in its place) picks its own code.
 */
#if !(defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)))
#include "arch.h"

mti_isa mti_arch_detect(void) { return MTI_ISA_BASELINE; }

int mti_arch_cap_onednn(mti_isa i)
{
    (void)i;
    return 0;
}

const char *mti_arch_onednn_isa(void) { return "its own"; }

static const mti_arch_paths g_none;

const mti_arch_paths *mti_arch_paths_at(int level)
{
    (void)level;
    return &g_none;
}

int mti_arch_q8_init(const mti_q8_tabs *t)
{
    (void)t;
    return 0;
}
#else
/* ISO C forbids an empty translation unit */
typedef int mti_arch_generic_unused;
#endif
