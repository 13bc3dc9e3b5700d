/*
 * config.c - key=value configuration files for the memtrain command: each
 * line `name = value` is the option `--name value` (the same names as on
 * the command line), `#` starts a comment, blank lines are skipped. For
 * options that take no value (flags) the value is a truth: 1, true, yes,
 * on give the flag, 0, false, no, off leave it out.
 */
#include "config.h"
#include "cli.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -1;
}

static char *dup_n(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static int push(cfg_args *a, char *s)
{
    if (!s) return -1;
    if (a->argc == a->cap) {
        int cap = a->cap ? a->cap * 2 : 16;
        char **v = realloc(a->argv, (size_t)cap * sizeof *v);
        if (!v) {
            free(s);
            return -1;
        }
        a->argv = v, a->cap = cap;
    }
    a->argv[a->argc++] = s;
    return 0;
}

void cfg_args_free(cfg_args *a)
{
    for (int i = 0; i < a->argc; i++) free(a->argv[i]);
    free(a->argv);
    memset(a, 0, sizeof *a);
}

static bool name_ok(const char *s, size_t n)
{
    if (!n || n > 64) return false;
    for (size_t i = 0; i < n; i++)
        if (!(islower((unsigned char)s[i]) || isdigit((unsigned char)s[i]) || s[i] == '-'))
            return false;
    return true;
}

int cfg_parse(const char *text, size_t n, const char *what, unsigned cmd, cfg_args *out, char *err,
              size_t cap)
{
    memset(out, 0, sizeof *out);
    size_t line_no = 0;
    for (size_t at = 0; at < n;) {
        size_t end = at;
        while (end < n && text[end] != '\n') end++;
        line_no++;
        /* the line without its comment and surrounding blanks */
        size_t a = at, b = end;
        for (size_t k = a; k < b; k++)
            if (text[k] == '#') {
                b = k;
                break;
            }
        while (a < b && isspace((unsigned char)text[a])) a++;
        while (b > a && isspace((unsigned char)text[b - 1])) b--;
        at = end + 1;
        if (a == b) continue;
        for (size_t k = a; k < b; k++)
            if (text[k] == '\0') {
                cfg_args_free(out);
                return fail(err, cap, "%s:%zu: a NUL byte", what, line_no);
            }
        size_t eq = a;
        while (eq < b && text[eq] != '=') eq++;
        if (eq == b) {
            cfg_args_free(out);
            return fail(err, cap, "%s:%zu: expected name = value", what, line_no);
        }
        size_t ke = eq;
        while (ke > a && isspace((unsigned char)text[ke - 1])) ke--;
        size_t vs = eq + 1;
        while (vs < b && isspace((unsigned char)text[vs])) vs++;
        if (!name_ok(text + a, ke - a)) {
            cfg_args_free(out);
            return fail(err, cap, "%s:%zu: '%.*s' is not an option name", what, line_no,
                        (int)(ke - a > 64 ? 64 : ke - a), text + a);
        }
        if (vs == b) {
            cfg_args_free(out);
            return fail(err, cap, "%s:%zu: %.*s has no value", what, line_no, (int)(ke - a),
                        text + a);
        }
        char name[80];
        snprintf(name, sizeof name, "--%.*s", (int)(ke - a), text + a);
        if (cmd && !cli_takes(name + 2, cmd)) {
            cfg_args_free(out);
            return fail(err, cap, "%s:%zu: unknown option '%s'", what, line_no, name + 2);
        }
        if (cli_is_flag(name + 2)) {
            size_t vn = b - vs;
            const char *v = text + vs;
            bool on = (vn == 1 && *v == '1') || (vn == 4 && !strncmp(v, "true", 4)) ||
                      (vn == 3 && !strncmp(v, "yes", 3)) || (vn == 2 && !strncmp(v, "on", 2));
            bool off = (vn == 1 && *v == '0') || (vn == 5 && !strncmp(v, "false", 5)) ||
                       (vn == 2 && !strncmp(v, "no", 2)) || (vn == 3 && !strncmp(v, "off", 3));
            if (!on && !off) {
                cfg_args_free(out);
                return fail(err, cap, "%s:%zu: %s takes 1/0, true/false, yes/no or on/off, not "
                            "'%.*s'", what, line_no, name + 2, (int)(vn > 64 ? 64 : vn), v);
            }
            if (on && push(out, dup_n(name, strlen(name)))) goto oom;
            continue;
        }
        if (push(out, dup_n(name, strlen(name))) || push(out, dup_n(text + vs, b - vs))) goto oom;
    }
    return 0;
oom:
    cfg_args_free(out);
    return fail(err, cap, "%s: out of memory", what);
}
