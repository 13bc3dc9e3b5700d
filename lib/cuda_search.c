/*
 * cuda_search.c - where cuBLASLt is looked for when no path is configured.
 *
 * The GPU machines this library meets keep cuBLASLt in one of three places,
 * not always on the loader's path: the CUDA toolkit (CUDA_HOME, CUDA_PATH,
 * or its default prefix /usr/local/cuda; lib64 up to CUDA 12, lib on some
 * CUDA 13 installs), or PyTorch's pip wheels (site-packages/nvidia/cublas/lib
 * for CUDA 12, nvidia/cu13/lib for CUDA 13) of the python3 on PATH, in a
 * virtualenv or not, or in the user's site-packages. The list below is
 * tried in order; the first that loads with every entry point is used.
 */
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_device.h"

static const char *const lt_names[] = {"libcublasLt.so.13", "libcublasLt.so.12"};
#define N_NAMES (sizeof lt_names / sizeof lt_names[0])

typedef struct list {
    char (*out)[MTI_LT_PATH];
    size_t n, max;
} list;

/* dir/name for each soname, once each; dir NULL: the bare sonames. */
static void add_dir(list *L, const char *dir)
{
    for (size_t i = 0; i < N_NAMES; i++) {
        char p[MTI_LT_PATH];
        int w = dir ? snprintf(p, sizeof p, "%s/%s", dir, lt_names[i])
                    : snprintf(p, sizeof p, "%s", lt_names[i]);
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
    static const char *const sub[] = {"nvidia/cu13/lib", "nvidia/cublas/lib"};
    for (size_t s = 0; s < sizeof sub / sizeof sub[0]; s++) {
        char pat[MTI_LT_PATH];
        glob_t g;
        snprintf(pat, sizeof pat, "%s/lib/python3*/site-packages/%s", prefix, sub[s]);
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

size_t mti_cublaslt_candidates(char (*out)[MTI_LT_PATH], size_t max)
{
    list L = {out, 0, max};
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
