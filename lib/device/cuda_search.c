/*
 * cuda_search.c - where cuBLASLt and NCCL are looked for when no path is
 * configured.
 *
 * The GPU machines this library meets keep them in one of three places,
 * not always on the loader's path: the CUDA toolkit (CUDA_HOME, CUDA_PATH,
 * or its default prefix /usr/local/cuda; lib64 up to CUDA 12, lib on some
 * CUDA 13 installs), or PyTorch's pip wheels of the python3 on PATH, in a
 * virtualenv or not, or in the user's site-packages (cuBLASLt in
 * site-packages/nvidia/cublas/lib for CUDA 12 and nvidia/cu13/lib for CUDA
 * 13; NCCL in nvidia/nccl/lib). The list below is tried in order; the first
 * that loads with every entry point is used.
 */
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/cuda_device.h"

/* What is looked for: its sonames, and its folders in the wheels. */
typedef struct lib_kind {
    const char *const *names;
    size_t n_names;
    const char *const *wheels;
    size_t n_wheels;
} lib_kind;

static const char *const lt_names[] = {"libcublasLt.so.13", "libcublasLt.so.12"};
static const char *const lt_wheels[] = {"nvidia/cu13/lib", "nvidia/cublas/lib"};
static const char *const nccl_names[] = {"libnccl.so.2"};
static const char *const nccl_wheels[] = {"nvidia/nccl/lib"};

typedef struct list {
    const lib_kind *kind;
    char (*out)[MTI_LT_PATH];
    size_t n, max;
} list;

/* dir/name for each soname, once each; dir NULL: the bare sonames. */
static void add_dir(list *L, const char *dir)
{
    for (size_t i = 0; i < L->kind->n_names; i++) {
        const char *name = L->kind->names[i];
        char p[MTI_LT_PATH];
        int w = dir ? snprintf(p, sizeof p, "%s/%s", dir, name) : snprintf(p, sizeof p, "%s", name);
        if (w < 0 || (size_t)w >= sizeof p || L->n >= L->max) continue;
        int seen = 0;
        for (size_t j = 0; j < L->n && !seen; j++) seen = !strcmp(L->out[j], p);
        if (!seen) snprintf(L->out[L->n++], MTI_LT_PATH, "%s", p);
    }
}

/* The toolkit under `root` (an environment variable's value, or a prefix). */
static void add_toolkit(list *L, const char *root)
{
    if (!root || !*root) return;
    char d[MTI_LT_PATH];
    snprintf(d, sizeof d, "%s/lib64", root);
    add_dir(L, d);
    snprintf(d, sizeof d, "%s/lib", root);
    add_dir(L, d);
}

/* The nvidia wheels' folders under a Python prefix (prefix/lib/python3.X). */
static void add_wheels(list *L, const char *prefix)
{
    for (size_t s = 0; s < L->kind->n_wheels; s++) {
        char pat[MTI_LT_PATH];
        glob_t g;
        snprintf(pat, sizeof pat, "%s/lib/python3*/site-packages/%s", prefix, L->kind->wheels[s]);
        if (glob(pat, GLOB_ONLYDIR | GLOB_NOSORT, NULL, &g) == 0) {
            for (size_t i = 0; i < g.gl_pathc; i++) add_dir(L, g.gl_pathv[i]);
        }
        globfree(&g);
    }
}

/* The prefix of the first python3 on PATH (its folder's parent), as found
 * (a virtualenv's) and with links resolved (the interpreter's own). */
static void add_python(list *L)
{
    const char *path = getenv("PATH");
    if (!path) return;
    char dir[MTI_LT_PATH];
    for (const char *p = path; *p;) {
        size_t len = strcspn(p, ":");
        if (len > 0 && len < sizeof dir - 16) {
            char exe[MTI_LT_PATH + 16];
            memcpy(dir, p, len);
            dir[len] = 0;
            snprintf(exe, sizeof exe, "%s/python3", dir);
            if (access(exe, X_OK) == 0) {
                char *slash = strrchr(dir, '/');
                if (slash) {
                    *slash = 0;
                    add_wheels(L, dir);
                }
                char real[PATH_MAX];
                if (realpath(exe, real)) {
                    for (int up = 0; up < 2 && (slash = strrchr(real, '/')); up++) *slash = 0;
                    add_wheels(L, real);
                }
                return;
            }
        }
        p += len;
        if (*p == ':') p++;
    }
}

static size_t candidates(const lib_kind *kind, char (*out)[MTI_LT_PATH], size_t max)
{
    list L = {kind, out, 0, max};
    add_dir(&L, NULL); /* the loader's path */
    add_toolkit(&L, getenv("CUDA_HOME"));
    add_toolkit(&L, getenv("CUDA_PATH"));
    add_toolkit(&L, "/usr/local/cuda");
    add_python(&L);
    const char *home = getenv("HOME");
    if (home && *home) {
        char d[MTI_LT_PATH];
        snprintf(d, sizeof d, "%s/.local", home);
        add_wheels(&L, d);
    }
    return L.n;
}

size_t mti_cublaslt_candidates(char (*out)[MTI_LT_PATH], size_t max)
{
    static const lib_kind lt = {lt_names, 2, lt_wheels, 2};
    return candidates(&lt, out, max);
}

size_t mti_nccl_candidates(char (*out)[MTI_LT_PATH], size_t max)
{
    static const lib_kind nccl = {nccl_names, 1, nccl_wheels, 1};
    return candidates(&nccl, out, max);
}
