/*
 * cli_replay.c - memtrain replay: an allocation trace through an
 * allocator, or through each of them, and what each did with it.
 */
#include <string.h>

#include "cli.h"
#include "memtrain/allocator.h"

static void usage_replay(FILE *f)
{
    fprintf(f,
            "usage: memtrain replay TRACE [options]\n"
            "  --allocator NAME       caching|arena|pool|checkpoint (caching); 'all' for each\n"
            "  --device cpu|cuda|auto (cpu)\n");
}

static int replay_one(mt_context *ctx, const mt_trace *tr, const char *name)
{
    mt_allocator_config ac = {.vtable = mt_allocator_by_name(name)};
    mt_allocator *a;
    if (mt_allocator_create(ctx, &ac, &a)) {
        fprintf(stderr, "%s: %s\n", cli_prog, mt_last_error(ctx));
        return EXIT_FAIL;
    }
    mt_replay_result r;
    mt_status s = mt_trace_replay(tr, a, &r);
    if (s) {
        fprintf(stderr, "%s: replay through %s: %s\n", cli_prog, name, mt_last_error(ctx));
        mt_allocator_destroy(a);
        return EXIT_FAIL;
    }
    mt_allocator_stats st;
    mt_allocator_get_stats(a, &st);
    printf("%-11s events %9llu  allocs %9llu  failed %5llu  peak live %10.2f MiB  peak reserved "
           "%10.2f MiB  efficiency %.3f  backing calls %7llu  %.3f s\n",
           name, (unsigned long long)r.n_events, (unsigned long long)r.n_alloc,
           (unsigned long long)r.n_failed, (double)r.peak_live_bytes / 1048576.0,
           (double)r.peak_reserved_bytes / 1048576.0, r.efficiency,
           (unsigned long long)(st.n_backing_alloc + st.n_backing_free), r.seconds);
    mt_allocator_destroy(a);
    return 0;
}

int cmd_replay(int argc, char **argv)
{
    const char *path = NULL, *alloc = "caching";
    mt_device_kind dev = MT_DEVICE_CPU;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage_replay(stdout);
            return 0;
        } else if (a[0] == '-' && a[1] == '-') {
            if (!v) return cli_bad_usage("option '%s' needs a value, or is unknown", a);
            if (!strcmp(a, "--allocator")) {
                if (strcmp(v, "all") && !mt_allocator_by_name(v))
                    return cli_bad_usage("unknown allocator '%s'", v);
                alloc = v;
            } else if (!strcmp(a, "--device")) {
                if (cli_parse_device(v, &dev)) return cli_bad_usage("bad --device '%s'", v);
            } else {
                return cli_bad_usage("unknown option '%s'", a);
            }
            i++;
        } else if (!path) {
            path = a;
        } else {
            return cli_bad_usage("unexpected argument '%s'", a);
        }
    }
    if (!path) return cli_bad_usage("%s", "replay needs a trace file");
    mt_context_config cfg;
    mt_context_config_init(&cfg);
    cfg.device = dev;
    mt_context *ctx;
    if (mt_context_create(&cfg, &ctx)) {
        fprintf(stderr, "%s: %s\n", cli_prog, mt_last_error(NULL));
        return EXIT_FAIL;
    }
    mt_trace *tr;
    if (mt_trace_load(ctx, path, &tr)) {
        fprintf(stderr, "%s: %s\n", cli_prog, mt_last_error(ctx));
        mt_context_destroy(ctx);
        return EXIT_FAIL;
    }
    int rc = 0;
    if (!strcmp(alloc, "all")) {
        for (int i = 0; mt_allocator_builtin(i) && !rc; i++)
            rc = replay_one(ctx, tr, mt_allocator_builtin(i)->name);
    } else {
        rc = replay_one(ctx, tr, alloc);
    }
    mt_trace_free(tr);
    mt_context_destroy(ctx);
    return rc;
}

