/*
 * cli_report.c - memtrain report: what an allocation trace shows, and the
 * trace as Chrome trace JSON and as an SVG plot.
 */
#include <string.h>

#include "cli.h"

int cmd_report(int argc, char **argv)
{
    const char *path = NULL, *chrome = NULL, *svg = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: memtrain report TRACE [--chrome FILE] [--svg FILE]\n"
                   "What an allocation trace (train --trace) shows: events, the peak of live\n"
                   "bytes and when, each class at the peak and at its own peak; and the trace\n"
                   "as Chrome trace JSON (Perfetto) and as an SVG plot of memory by class.\n");
            return 0;
        } else if (!strcmp(a, "--chrome") || !strcmp(a, "--svg")) {
            if (!v) return cli_bad_usage("option '%s' needs a value, or is unknown", a);
            if (a[2] == 'c') chrome = v;
            else svg = v;
            i++;
        } else if (a[0] == '-') {
            return cli_bad_usage("unknown option '%s'", a);
        } else if (!path) {
            path = a;
        } else {
            return cli_bad_usage("unexpected argument '%s'", a);
        }
    }
    if (!path) return cli_bad_usage("%s", "report needs a trace file");
    mt_trace *tr;
    if (mt_trace_load(NULL, path, &tr)) {
        fprintf(stderr, "%s: %s\n", cli_prog, mt_last_error(NULL));
        return EXIT_FAIL;
    }
    mt_trace_summary sm;
    int rc = 0;
    if (mt_trace_summarize(NULL, tr, &sm) || (chrome && mt_trace_export_chrome(NULL, tr, NULL, chrome)) ||
        (svg && mt_trace_export_svg(NULL, tr, NULL, svg))) {
        fprintf(stderr, "%s: %s\n", cli_prog, mt_last_error(NULL));
        rc = EXIT_FAIL;
    } else {
        printf("%s: %zu events over %.3f ms (%llu allocations, %llu frees, %llu resets, %llu "
               "failed; %llu dropped)\n",
               path, sm.events, (double)sm.span_ns / 1e6, (unsigned long long)sm.allocs,
               (unsigned long long)sm.frees, (unsigned long long)sm.resets,
               (unsigned long long)sm.failed, (unsigned long long)sm.dropped);
        printf("peak %.2f MiB of live bytes at %.3f ms\n", (double)sm.peak / 1048576.0,
               (double)sm.peak_ns / 1e6);
        printf("%-7s %14s %14s\n", "class", "at the peak", "own peak");
        for (int c = 0; c < MT_MEM_COUNT; c++)
            printf("%-7s %10.2f MiB %10.2f MiB\n", mt_mem_class_name((mt_mem_class)c),
                   (double)sm.at_peak[c] / 1048576.0, (double)sm.class_peak[c] / 1048576.0);
        if (chrome) printf("Chrome trace JSON written to %s\n", chrome);
        if (svg) printf("SVG plot written to %s\n", svg);
    }
    mt_trace_free(tr);
    return rc;
}

