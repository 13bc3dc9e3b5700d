/*
 * memtrain.c - the memtrain command: one file per command (cli_*.c), the
 * options of train, sample and estimate in one table (cli_options.c).
 *
 *   memtrain train  [options]     train a model on built-in data, print progress and memory
 *   memtrain replay TRACE [opts]  replay an allocation trace through an allocator
 *   memtrain estimate [opts]      the memory of a training run, before it runs
 *   memtrain sample [opts]        text from a GPT trained by train --save
 *   memtrain report TRACE [opts]  what an allocation trace shows, and its plots
 *   memtrain --version | --help
 *
 * Exit codes: cli.h and docs/cli.md.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "config.h"

static void usage_main(FILE *f)
{
    fprintf(f,
            "usage: memtrain <command> [options]\n"
            "\n"
            "commands:\n"
            "  train     train a model on built-in data (no download) and report memory\n"
            "  replay    replay an allocation trace through an allocator and print its stats\n"
            "  estimate  what a training run will hold, per memory class, before it runs\n"
            "  sample    text from a GPT trained by 'train --model gpt --save'\n"
            "  report    what an allocation trace shows, and its plots (Chrome JSON, SVG)\n"
            "\n"
            "  memtrain --version     print the version\n"
            "  memtrain <command> --help\n");
}

/* Runs cmd with the options of a --config FILE (key = value lines, the same
 * names) first and the command line's after them, so the command line
 * overrides the file. */
static int with_config(int argc, char **argv, unsigned bits, int (*cmd)(int, char **))
{
    const char *path = NULL;
    int at = -1;
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) return cli_bad_usage("%s", "--config needs a file");
            if (path) return cli_bad_usage("%s", "--config given twice");
            path = argv[i + 1], at = i;
        }
    if (!path) return cmd(argc, argv);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: cannot open %s: %s\n", cli_prog, path, strerror(errno));
        return EXIT_FAIL;
    }
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return cli_bad_usage("--config %s: not a file of options", path);
    }
    char *text = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 4096;
            if (cap > ((size_t)1 << 24)) {
                fclose(f);
                free(text);
                fprintf(stderr, "%s: %s: larger than 16 MiB\n", cli_prog, path);
                return EXIT_FAIL;
            }
            char *t = realloc(text, cap);
            if (!t) break;
            text = t;
        }
        size_t got = fread(text + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    fclose(f);
    cfg_args a;
    char err[256];
    int rc = cfg_parse(text ? text : "", n, path, bits, &a, err, sizeof err);
    free(text);
    if (rc) {
        fprintf(stderr, "%s: %s\n(run 'memtrain --help')\n", cli_prog, err);
        return EXIT_USAGE;
    }
    char **all = malloc(((size_t)a.argc + (size_t)argc + 1) * sizeof *all);
    if (!all) {
        cfg_args_free(&a);
        return EXIT_FAIL;
    }
    int k = 0;
    for (int i = 0; i < a.argc; i++) all[k++] = a.argv[i];
    for (int i = 0; i < argc; i++)
        if (i != at && i != at + 1) all[k++] = argv[i];
    all[k] = NULL;
    rc = cmd(k, all);
    free(all);
    cfg_args_free(&a);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage_main(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version")) {
        printf("memtrain %s\nCPU kernels: %s\n", mt_version(), mt_cpu_isa());
        return 0;
    }
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage_main(stdout);
        return 0;
    }
    if (!strcmp(cmd, "train")) return with_config(argc - 2, argv + 2, CLI_TRAIN, cmd_train);
    if (!strcmp(cmd, "replay")) return cmd_replay(argc - 2, argv + 2);
    if (!strcmp(cmd, "estimate")) return with_config(argc - 2, argv + 2, CLI_ESTIMATE, cmd_estimate);
    if (!strcmp(cmd, "sample")) return with_config(argc - 2, argv + 2, CLI_SAMPLE, cmd_sample);
    if (!strcmp(cmd, "report")) return cmd_report(argc - 2, argv + 2);
    return cli_bad_usage("unknown command '%s'", cmd);
}
