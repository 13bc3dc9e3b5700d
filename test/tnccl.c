/*
 * tnccl.c - one rank of NCCL on a CUDA context (tnccl.h).
 */
#include <dlfcn.h>
#include <string.h>

#include "tnccl.h"

bool tnccl_gpu(void)
{
    const char *g = getenv("MT_TEST_GPU");
    return g && !strcmp(g, "1");
}

mt_context *tnccl_one_rank(mt_context **first, mt_comm **c)
{
    *first = NULL;
    *c = NULL;
    const bool gpu = tnccl_gpu();
    const char *fake = getenv("MT_FAKE_NCCL");
    if (!gpu && (!fake || !*fake || !check_fake_cuda() || !getenv("MT_FAKE_CUBLASLT"))) {
        fprintf(stderr, "    (skipped: needs MT_TEST_GPU=1, or MT_FAKE_NCCL, MT_FAKE_CUDA and "
                        "MT_FAKE_CUBLASLT)\n");
        return NULL;
    }
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CUDA;
    cc.cuda_driver_path = gpu ? NULL : check_fake_cuda();
    cc.cublaslt_path = gpu ? NULL : getenv("MT_FAKE_CUBLASLT");
    CHECK_OK(mt_context_create(&cc, first)); /* the primary context, current */
    mt_nccl_config nc;
    mt_nccl_config_init(&nc);
    nc.timeout_seconds = 60.0;
    if (!gpu) nc.nccl_path = nc.cuda_driver_path = fake;
    mt_nccl_id id;
    mt_status s = mt_nccl_unique_id(&nc, &id);
    if (gpu && s == MT_ERR_NO_DEVICE && strstr(mt_last_error(NULL), "cannot load NCCL")) {
        fprintf(stderr, "    (skipped: %s)\n", mt_last_error(NULL));
        mt_context_destroy(*first);
        *first = NULL;
        return NULL;
    }
    CHECK_MSG(s == MT_OK, "%s", mt_last_error(NULL));
    CHECK_OK(mt_comm_nccl_create(&nc, &id, 0, 1, c));
    cc.comm = *c;
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cc, &ctx));
    return ctx;
}

void tnccl_free(mt_context *ctx, mt_context *first, mt_comm *c)
{
    mt_context_destroy(ctx);
    mt_comm_destroy(c);
    mt_context_destroy(first);
}

unsigned long tnccl_calls(void *stream, int others)
{
    const char *fake = getenv("MT_FAKE_NCCL");
    void *lib = fake && *fake ? dlopen(fake, RTLD_NOW | RTLD_LOCAL) : NULL;
    void *sym = lib ? dlsym(lib, "fake_nccl_calls") : NULL;
    unsigned long (*f)(void *, int) = NULL;
    memcpy(&f, &sym, sizeof sym);
    unsigned long n = f ? f(stream, others) : ~0ul;
    if (lib) dlclose(lib);
    return n;
}
