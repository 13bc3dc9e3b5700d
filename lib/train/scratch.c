/*
 * scratch.c - the directory a trainer's state on disk lives in
 * (lib/train/offload.c): made, owned, and found again after a run that could not
 * remove it.
 *
 * offload_dir/memtrain-scratch (memtrain-scratch.rankR for rank R of a run
 * of several) is made with mkdir, exclusive, and holds a lock file made
 * with O_EXCL that names its owner, one field a line:
 *     memtrain scratch directory of process PID
 *     host HOSTNAME
 *     boot BOOT_ID        (/proc/sys/kernel/random/boot_id)
 *     start TICKS         (the process's start, clock ticks after boot:
 *                          field 22 of /proc/PID/stat)
 * A process killed from outside (SIGKILL, a job ended by mpirun) removes
 * nothing, so the next trainer to use the directory does, once it knows
 * the owner has ended: the owner ran on this host, and the host has booted
 * since, or no process PID runs (or only its exit status waits for its
 * parent), or the one that does started at another time (the number was
 * reused). An owner on another host cannot be
 * checked from here: its directory is left alone, and refused where this
 * trainer needs its name. A lock without the last three lines (an older
 * library's) is judged by PID alone.
 *
 * Besides its own name, a trainer removes every other scratch directory in
 * offload_dir that no rank of its run makes (a run of another world size
 * left it) and whose owner has ended; each is first renamed, so of several
 * processes finding it one removes it, and it is checked again under its
 * new name before anything in it goes. Each removal is a warning on the
 * context's log.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "comm/comm.h"
#include "train/offload.h"

#define DIRNAME "memtrain-scratch"
#define LOCK_LEN 512 /* a lock file's text, at most */

/* ---- who owns a directory ---- */

typedef enum { OWNER_NONE, OWNER_ENDED, OWNER_LIVE, OWNER_ELSEWHERE } owner_state;

typedef struct owner {
    char text[LOCK_LEN]; /* the lock file as read (compared when checked again) */
    long pid;
    char host[256], boot[64];
    unsigned long long start;
} owner;

/* This host's name, or "" when it has none. */
static void this_host(char *out, size_t cap)
{
    if (gethostname(out, cap) != 0) out[0] = 0;
    out[cap - 1] = 0;
}

/* The kernel's id of this boot, or "". */
static void this_boot(char *out, size_t cap)
{
    out[0] = 0;
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) return;
    if (!fgets(out, (int)cap, f)) out[0] = 0;
    fclose(f);
    out[strcspn(out, "\n")] = 0;
}

/* Process pid's start time (clock ticks after boot): 0 when unknown; and
 * *gone when it has ended but its parent has not yet collected it (a
 * zombie). The second field of /proc/PID/stat is the command in
 * parentheses, which may hold anything: the fields are counted from its
 * last ')'. */
static unsigned long long start_of(long pid, bool *gone)
{
    *gone = false;
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    if (!p) return 0;
    p++;
    while (*p == ' ') p++;
    *gone = *p == 'Z' || *p == 'X'; /* field 3, the state */
    for (int field = 3; field < 22 && *p; field++) { /* past fields 3 to 21 */
        while (*p == ' ') p++;
        while (*p && *p != ' ') p++;
    }
    return strtoull(p, NULL, 10);
}

/* Reads the lock file of directory dir into w: false when there is none
 * or it names no process. */
static bool read_owner(const char *dir, owner *w)
{
    memset(w, 0, sizeof *w);
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/lock", dir);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    const size_t n = fread(w->text, 1, sizeof w->text - 1, f);
    fclose(f);
    w->text[n] = 0;
    if (sscanf(w->text, "memtrain scratch directory of process %ld", &w->pid) != 1 || w->pid <= 0 ||
        w->pid > INT_MAX)
        return false;
    for (const char *line = strchr(w->text, '\n'); line; line = strchr(line, '\n')) {
        line++;
        if (!strncmp(line, "host ", 5)) sscanf(line + 5, "%255s", w->host);
        else if (!strncmp(line, "boot ", 5)) sscanf(line + 5, "%63s", w->boot);
        else if (!strncmp(line, "start ", 6)) w->start = strtoull(line + 6, NULL, 10);
    }
    return true;
}

/* Whether w's process still runs; why says how it is known to have ended
 * (for the warning). */
static owner_state judge(const owner *w, const char **why)
{
    char here[256], boot[64];
    *why = "";
    if (w->host[0]) {
        this_host(here, sizeof here);
        if (strcmp(here, w->host) != 0) return OWNER_ELSEWHERE;
    }
    this_boot(boot, sizeof boot);
    if (w->boot[0] && boot[0] && strcmp(boot, w->boot) != 0) {
        *why = "ran before this host last started";
        return OWNER_ENDED;
    }
    if (kill((pid_t)w->pid, 0) != 0 && errno == ESRCH) {
        *why = "has ended";
        return OWNER_ENDED;
    }
    bool gone;
    const unsigned long long now = start_of(w->pid, &gone);
    if (gone || (w->start && now && now != w->start)) { /* (another process's number now) */
        *why = "has ended";
        return OWNER_ENDED;
    }
    return OWNER_LIVE;
}

/* ---- removing a directory ---- */

/* Whether dir holds nothing but the lock and the files names[0..n). */
static bool only_ours(const char *dir, const char *const *names, int n)
{
    DIR *d = opendir(dir);
    if (!d) return false;
    bool ok = true;
    for (struct dirent *e; ok && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, "lock"))
            continue;
        bool known = false;
        for (int f = 0; f < n && !known; f++) known = !strcmp(e->d_name, names[f]);
        ok = known;
    }
    closedir(d);
    return ok;
}

/* Removes what this library puts in dir, then dir: 0, or an errno (ENOTEMPTY:
 * it holds files memtrain did not make, and nothing was removed). */
static int clean_dir(const char *dir, const char *const *names, int n)
{
    if (!only_ours(dir, names, n)) return ENOTEMPTY;
    char p[PATH_MAX + 16];
    for (int f = 0; f < n; f++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[f]);
        unlink(p);
    }
    snprintf(p, sizeof p, "%s/lock", dir);
    unlink(p);
    return rmdir(dir) == 0 || errno == ENOENT ? 0 : errno;
}

/* ---- the other scratch directories of offload_dir ---- */

/* Whether `name` is a scratch directory's name that no rank of a run of
 * `world` ranks makes. */
static bool foreign_name(const char *name, int world)
{
    const size_t k = strlen(DIRNAME);
    if (strncmp(name, DIRNAME, k) != 0) return false;
    if (!name[k]) return world > 1; /* a single process's */
    if (strncmp(name + k, ".rank", 5) != 0) return false;
    const char *d = name + k + 5;
    if (!*d || strspn(d, "0123456789") != strlen(d) || strlen(d) > 6) return false;
    return world == 1 || atoi(d) >= world;
}

/* Removes base/name if its owner has ended (see the top). */
static void clear_stale(mt_context *ctx, const char *base, const char *name,
                        const char *const *names, int n)
{
    char dir[PATH_MAX + 64], aside[PATH_MAX + 96];
    if (snprintf(dir, sizeof dir, "%s/%s", base, name) >= (int)sizeof dir) return;
    owner w, again;
    const char *why;
    if (!read_owner(dir, &w) || judge(&w, &why) != OWNER_ENDED) return;
    snprintf(aside, sizeof aside, "%s/.%s.removing.%ld", base, name, (long)getpid());
    if (rename(dir, aside) != 0) return; /* (another process took it first) */
    if (!read_owner(aside, &again) || strcmp(w.text, again.text) != 0) {
        /* made again between the two reads: not stale after all */
        (void)rename(aside, dir);
        return;
    }
    const int e = clean_dir(aside, names, n);
    if (e) {
        (void)rename(aside, dir);
        mti_log(ctx, MT_LOG_WARN,
                "offload: the scratch directory '%s' of process %ld, which %s, was left: %s", dir,
                w.pid, why, e == ENOTEMPTY ? "it holds files memtrain did not make" : strerror(e));
        return;
    }
    mti_log(ctx, MT_LOG_WARN, "offload: removed the stale scratch directory '%s' (its owner, "
            "process %ld on this host, %s)", dir, w.pid, why);
}

static void clear_others(mt_context *ctx, const char *base, const char *const *names, int n)
{
    DIR *d = opendir(base);
    if (!d) return;
    /* the names first: the directory changes as they go */
    char (*found)[64] = NULL;
    size_t k = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        int world;
        (void)mti_comm_world(ctx, &world, NULL);
        if (!foreign_name(e->d_name, world) || strlen(e->d_name) >= 64) continue;
        if (k == cap) {
            char (*more)[64] = realloc(found, (cap = cap ? 2 * cap : 8) * sizeof *found);
            if (!more) break;
            found = more;
        }
        snprintf(found[k++], 64, "%s", e->d_name);
    }
    closedir(d);
    for (size_t i = 0; i < k; i++) clear_stale(ctx, base, found[i], names, n);
    free(found);
}

/* ---- this trainer's directory ---- */

static mt_status write_lock(mti_scratch *sc, mt_context *ctx)
{
    int fd = open(sc->lock, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return mti_fail(ctx, MT_ERR_IO, "offload: cannot make '%s': %s", sc->lock, strerror(errno));
    sc->made_lock = 1;
    char host[256], boot[64], text[LOCK_LEN];
    this_host(host, sizeof host);
    this_boot(boot, sizeof boot);
    const long pid = (long)getpid();
    /* (a field this process cannot learn is left out: judged without it) */
    int len = snprintf(text, sizeof text, "memtrain scratch directory of process %ld\n", pid);
    if (host[0] && !strpbrk(host, " \n"))
        len += snprintf(text + len, sizeof text - (size_t)len, "host %s\n", host);
    if (boot[0]) len += snprintf(text + len, sizeof text - (size_t)len, "boot %s\n", boot);
    bool gone;
    const unsigned long long start = start_of(pid, &gone);
    if (start) len += snprintf(text + len, sizeof text - (size_t)len, "start %llu\n", start);
    const bool ok = write(fd, text, (size_t)len) == len;
    close(fd);
    if (!ok) return mti_fail(ctx, MT_ERR_IO, "offload: cannot write '%s'", sc->lock);
    return MT_OK;
}

mt_status mti_scratch_make(mt_context *ctx, const char *base, const char *const *names, int n,
                           mti_scratch *sc)
{
    char name[64]; /* one directory per rank of a run of several (of the world's, also
                      while tensor parallel narrows the context to a group) */
    int world, rank;
    (void)mti_comm_world(ctx, &world, &rank);
    if (world > 1) snprintf(name, sizeof name, "%s.rank%d", DIRNAME, rank);
    else snprintf(name, sizeof name, "%s", DIRNAME);
    struct stat sb;
    if (stat(base, &sb) != 0)
        return mti_fail(ctx, MT_ERR_IO, "offload: the directory '%s': %s", base, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return mti_fail(ctx, MT_ERR_IO, "offload: '%s' is not a directory", base);
    /* the directory named now, whatever the process's working directory
       is when the files are removed */
    char *abs = realpath(base, NULL);
    if (!abs) return mti_fail(ctx, MT_ERR_IO, "offload: the directory '%s': %s", base, strerror(errno));
    const bool fits = snprintf(sc->dir, sizeof sc->dir, "%s/%s", abs, name) < (int)sizeof sc->dir;
    if (!fits) {
        free(abs);
        return mti_fail(ctx, MT_ERR_INVALID_ARG, "offload: the directory name '%s' is too long", base);
    }
    snprintf(sc->lock, sizeof sc->lock, "%s/lock", sc->dir);
    mt_status s = MT_OK;
    for (int tries = 0; !s && mkdir(sc->dir, 0700) != 0; tries++) {
        if (errno != EEXIST || tries) {
            s = mti_fail(ctx, MT_ERR_IO, "offload: cannot make the scratch directory '%s': %s",
                         sc->dir, strerror(errno));
            break;
        }
        owner w;
        const char *why = "";
        const bool named = read_owner(sc->dir, &w);
        const owner_state st = named ? judge(&w, &why) : OWNER_NONE;
        int e = 0;
        if (st == OWNER_LIVE)
            s = mti_fail(ctx, MT_ERR_IO,
                         "offload: the scratch directory '%s' belongs to process %ld, which is "
                         "running; give each trainer a directory of its own",
                         sc->dir, w.pid);
        else if (st == OWNER_ELSEWHERE)
            s = mti_fail(ctx, MT_ERR_IO,
                         "offload: the scratch directory '%s' belongs to process %ld on host %s, "
                         "which cannot be checked from here; give each trainer a directory of its "
                         "own, or remove it once that run has ended",
                         sc->dir, w.pid, w.host);
        else if ((e = clean_dir(sc->dir, names, n)) != 0)
            s = mti_fail(ctx, MT_ERR_IO, "offload: '%s' was left by %s but %s; remove it", sc->dir,
                         named ? "a process that has ended" : "an unknown process",
                         e == ENOTEMPTY ? "holds files memtrain did not make" : strerror(e));
        else if (named)
            mti_log(ctx, MT_LOG_WARN, "offload: removed the stale scratch directory '%s' (its "
                    "owner, process %ld on this host, %s)", sc->dir, w.pid, why);
        else
            mti_log(ctx, MT_LOG_WARN, "offload: removed the stale scratch directory '%s' (its "
                    "lock names no process: a run ended while making it)", sc->dir);
    }
    if (!s) sc->made_dir = 1;
    if (!s) s = write_lock(sc, ctx);
    if (!s) clear_others(ctx, abs, names, n);
    free(abs);
    return s;
}

void mti_scratch_remove(mti_scratch *sc)
{
    if (sc->made_lock) unlink(sc->lock);
    if (sc->made_dir) rmdir(sc->dir);
    sc->made_lock = sc->made_dir = 0;
}
