/*
 * config.h - key=value configuration files for the memtrain command
 * (config.c).
 */
#ifndef MT_TOOLS_CONFIG_H
#define MT_TOOLS_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

/* Options as the command line gives them: "--name", "value", ... */
typedef struct cfg_args {
    char **argv;
    int argc, cap;
} cfg_args;

/* Parses n bytes of a configuration (what names it in messages) for the
 * command cmd (CLI_TRAIN, ...; 0: any names) into options; -1 with a
 * message in err naming the line on a bad line (a name the command does
 * not take included). */
int cfg_parse(const char *text, size_t n, const char *what, unsigned cmd, cfg_args *out, char *err,
              size_t cap);
void cfg_args_free(cfg_args *a);

#endif /* MT_TOOLS_CONFIG_H */
