/*
 * arch.h - where the CPU kernels meet the processor: which class of
 * instructions the CPU has and the kernels may use (capped by the
 * environment variable MT_CPU_ISA), the vector copies of the hot loops,
 * and the hand-written paths of one architecture.
 *
 * Everything that names an instruction set lives behind this header: the
 * detection (cpuid), the intrinsics and the oneDNN cap of x86-64 are in
 * arch_x86.c; arch_generic.c stands for every other architecture (the
 * portable loops, which the compiler vectorises for the architecture's
 * baseline: NEON on aarch64). Another architecture adds one file in their
 * place, and the kernels do not change.
 *
 * The classes are ordered; each has everything below it:
 *   baseline     x86-64 with SSE2 (or any other architecture's baseline)
 *   avx2         + AVX2 and F16C (x86-64-v3; the kernels use no FMA)
 *   avx512       + AVX-512 F, BW, CD, DQ, VL (x86-64-v4)
 *   avx512_bf16  + AVX512-BF16: oneDNN's bf16 matmul
 *   amx          + AMX-BF16 tiles
 * The class in use is the CPU's (with its OS's support), or less when
 * MT_CPU_ISA names a lower class. Our own loops have three levels
 * (baseline, avx2, avx512 and up) and give the same bits at each; oneDNN
 * is capped at the class through its own max-ISA setting.
 */
#ifndef MT_CPU_ARCH_H
#define MT_CPU_ARCH_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef enum mti_isa {
    MTI_ISA_BASELINE = 0,
    MTI_ISA_AVX2 = 1,
    MTI_ISA_AVX512 = 2,
    MTI_ISA_AVX512_BF16 = 3,
    MTI_ISA_AMX = 4,
    MTI_ISA_COUNT = 5
} mti_isa;

/* ---- isa.c: the class in use ---- */

/* "baseline", "avx2", ...; NULL out of range. */
const char *mti_isa_name(mti_isa i);
/* The most the CPU and its OS give, uncapped. */
mti_isa mti_isa_detected(void);
/* The class in use: the CPU's, capped by MT_CPU_ISA. The first call reads
 * MT_CPU_ISA and caps oneDNN (before any oneDNN primitive is made). */
mti_isa mti_isa_used(void);
/* 0 when MT_CPU_ISA is unset or names a class and oneDNN took its cap;
 * otherwise -1 with a message in msg (what was wrong, and the valid
 * names). */
int mti_isa_check(char *msg, size_t cap);
/* The name of mti_isa_used(). */
const char *mti_isa_used_name(void);
/* For tests and benchmarks: the class our own loops use from now on (at
 * most the CPU's, and MT_CPU_ISA's cap; oneDNN keeps its own cap);
 * returns the class before. Not while kernels run on other threads. */
mti_isa mti_isa_force(mti_isa i);

/* The level of our own vector loops: 0 baseline, 1 avx2, 2 avx512 and up.
 * Read on every call of a dispatched loop: one relaxed load. */
extern _Atomic int mti_vec_level_now;
int mti_vec_level_init(void);
static inline int mti_vec_level(void)
{
    int v = atomic_load_explicit(&mti_vec_level_now, memory_order_relaxed);
    return v >= 0 ? v : mti_vec_level_init();
}

/* ---- arch_*.c: one architecture ---- */

/* The class the CPU and its OS support. */
mti_isa mti_arch_detect(void);
/* Caps oneDNN's code at class i (dnnl_set_max_cpu_isa); 0, or -1 when
 * oneDNN's code is already above it (it made code before the cap). An
 * architecture without the setting returns 0. */
int mti_arch_cap_onednn(mti_isa i);
/* The class of the code oneDNN makes now, for messages ("avx2", ...). */
const char *mti_arch_onednn_isa(void);

/* The hand-written paths of the level in use; a NULL entry means the
 * portable loop. The casts convert n elements with the bits of the
 * definitions (lib/ops/kctx.c). */
/* 8-bit AdamW's step scalars (made once per call, in double, rounded to
 * fp32) and maps, as optim8.c keeps them. */
typedef struct mti_adamw8_consts {
    float b1, b2, c1, c2; /* betas and 1 - betas */
    float gs;             /* grad_scale */
    float step_size;      /* -lr sqrt(1 - b2^t) / (1 - b1^t) */
    float eps_c2;         /* eps sqrt(1 - b2^t) */
    float decay;          /* 1 - lr wd */
} mti_adamw8_consts;
typedef struct mti_q8_tabs {
    const float *code[2];    /* [0] the unsigned map (v), [1] the signed one (m): 256 values */
    const uint32_t *word[2]; /* their bucket words (optim8.c: q8_lut.word) */
    uint32_t negc;           /* the signed map's negative codes are 0 .. negc - 1 */
} mti_q8_tabs;
typedef struct mti_arch_paths {
    void (*f32_to_bf16)(uint16_t *d, const float *s, size_t n);
    void (*bf16_to_f32)(float *d, const uint16_t *s, size_t n);
    void (*f32_to_f16)(uint16_t *d, const float *s, size_t n);
    void (*f16_to_f32)(float *d, const uint16_t *s, size_t n);
    /* 8-bit AdamW over one full block (optim8.c's adamw8_block, the same
     * bits); the tables are optim8.c's. q8_levels: how many variants
     * there are (0: none; 1: gathers for the lookups; 2: also permutes),
     * and `level` (1 .. q8_levels) picks one. */
    int q8_levels;
    /* Whether fp32 GEMMs should get an operand stored K-major (the
     * reduction down its rows) with rows a multiple of 4 KiB apart as a
     * dense copy (matmul.c): where the GEMM library's kernels read such
     * rows slowly (cache sets alias). */
    int gemm_pack_aliased;
    void (*adamw8_block)(float *p, const float *g, uint8_t *qm, uint8_t *qv, float *amax_m,
                         float *amax_v, const mti_adamw8_consts *c, const mti_q8_tabs *t,
                         int level);
} mti_arch_paths;
/* The paths of our level now (mti_vec_level; isa.c); never NULL. */
const mti_arch_paths *mti_arch_paths_now(void);
/* The paths of vector level `level` (0 .. 2; arch_*.c, which knows the
 * level only from its callers: the ISA layer, isa.c, sits above it). */
const mti_arch_paths *mti_arch_paths_at(int level);
/* optim8.c's maps, given once (they must put the signed map's negative
 * codes first, and every bucket word must hold: optim8.c checks); returns
 * the adamw8_block variants the CPU has (q8_levels at the top level). */
int mti_arch_q8_init(const mti_q8_tabs *t);

/* The layout of optim8.c's bucket table over a float's bits: exponent
 * field of the smallest magnitude told apart (2^-25), the mantissa bits
 * kept, and the buckets per sign. */
#define MTI_Q8_LUT_EMIN 102u
#define MTI_Q8_LUT_MB 7
#define MTI_Q8_LUT_PER_SIGN ((127u - MTI_Q8_LUT_EMIN) * (1u << MTI_Q8_LUT_MB) + 1u)

/* ---- vector copies of a loop ----
 *   MTI_VEC_FN(float, sum_n, (const float *x, size_t n), (x, n)) { ... }
 *   MTI_VEC_VOID(scale_n, (float *x, size_t n, float s), (x, n, s)) { ... }
 * define `static float sum_n(...)` (and `static void scale_n(...)`) with
 * the body that follows, compiled once per level (the body is inlined into
 * a function of each level's target) and picked at each call by
 * mti_vec_level(). Each lane does the same scalar operations at any width,
 * and no copy may contract a multiply and an add (gcc in ISO C mode
 * contracts nothing; clang, which would, gets no AVX-512 copy: its
 * avx512f implies FMA), so the bits do not depend on the level. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MTI_VEC_INLINE static inline __attribute__((always_inline))
#define MTI_TARGET_AVX2 __attribute__((target("avx2")))
#if defined(__clang__)
#define MTI_VEC_512(def)
#define MTI_VEC_PICK(name) (mti_vec_level() >= 1 ? name##_avx2 : name##_body)
#else
#define MTI_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define MTI_VEC_512(def) def
#define MTI_VEC_PICK(name)                                                                    \
    (mti_vec_level() >= 2 ? name##_avx512 : mti_vec_level() >= 1 ? name##_avx2 : name##_body)
#endif
#define MTI_VEC_FN(ret, name, params, args)                                                   \
    MTI_VEC_INLINE ret name##_body params;                                                    \
    MTI_VEC_512(static MTI_TARGET_AVX512 ret name##_avx512 params { return name##_body args; }) \
    static MTI_TARGET_AVX2 ret name##_avx2 params { return name##_body args; }                \
    static ret name params { return MTI_VEC_PICK(name) args; }                                \
    MTI_VEC_INLINE ret name##_body params
#define MTI_VEC_VOID(name, params, args)                                                      \
    MTI_VEC_INLINE void name##_body params;                                                   \
    MTI_VEC_512(static MTI_TARGET_AVX512 void name##_avx512 params { name##_body args; })   \
    static MTI_TARGET_AVX2 void name##_avx2 params { name##_body args; }                      \
    static void name params { MTI_VEC_PICK(name) args; }                                      \
    MTI_VEC_INLINE void name##_body params
/* MTI_VEC_VOID whose body also takes its level as a first argument, `int
 * vec_level` (0, 1, 2: a constant in each copy), for code that must be
 * written differently per level to vectorise well (attention.c). */
#define MTI_VEC_VOID_L(name, params, args)                                                    \
    MTI_VEC_INLINE void name##_body(int vec_level, MTI_VEC_LIST params);                      \
    MTI_VEC_512(static MTI_TARGET_AVX512 void name##_avx512 params {                          \
        name##_body(2, MTI_VEC_LIST args);                                                    \
    })                                                                                        \
    static MTI_TARGET_AVX2 void name##_avx2 params { name##_body(1, MTI_VEC_LIST args); }     \
    static void name##_base params { name##_body(0, MTI_VEC_LIST args); }                     \
    static void name params { MTI_VEC_PICK_L(name) args; }                                    \
    MTI_VEC_INLINE void name##_body(int vec_level, MTI_VEC_LIST params)
#if defined(__clang__)
#define MTI_VEC_PICK_L(name) (mti_vec_level() >= 1 ? name##_avx2 : name##_base)
#else
#define MTI_VEC_PICK_L(name)                                                                  \
    (mti_vec_level() >= 2 ? name##_avx512 : mti_vec_level() >= 1 ? name##_avx2 : name##_base)
#endif
#else
#define MTI_VEC_INLINE static inline
#define MTI_VEC_FN(ret, name, params, args) static ret name params
#define MTI_VEC_VOID(name, params, args) static void name params
#define MTI_VEC_VOID_L(name, params, args)                                                    \
    MTI_VEC_INLINE void name##_body(int vec_level, MTI_VEC_LIST params);                      \
    static void name params { name##_body(0, MTI_VEC_LIST args); }                            \
    MTI_VEC_INLINE void name##_body(int vec_level, MTI_VEC_LIST params)
#endif
/* (a parenthesised list without its parentheses) */
#define MTI_VEC_LIST(...) __VA_ARGS__

#endif
