/*
 * test_scratch.c - the scratch directory of a trainer's state on disk
 * (lib/train/scratch.c), through mt_trainer_create: directories a killed run
 * left are found by the next trainer in offload_dir and removed with a
 * warning, under its own name and under names it does not use (a run of
 * another world size), their owners known to have ended by the process
 * number, the host's boot and the process's start; an owner that runs, or
 * runs on another host, keeps its directory.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

/* A process number nobody holds now: a child's, once it has ended. */
static long ended_pid(void)
{
    const pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) _exit(0);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    return (long)pid;
}

/* base/name as a killed run leaves it: its lock file holding `lock`
 * (NULL: none), the state's files, and with `foreign` a file of the
 * user's. */
static void left_dir(const char *base, const char *name, const char *lock, bool foreign)
{
    char d[512], p[600];
    snprintf(d, sizeof d, "%s/%s", base, name);
    CHECK(mkdir(d, 0700) == 0);
    static const char *const files[] = {"optim.bin", "master.bin", "lock", "notes.txt"};
    for (int f = 0; f < 4; f++) {
        if ((f == 2 && !lock) || (f == 3 && !foreign)) continue;
        snprintf(p, sizeof p, "%s/%s", d, files[f]);
        FILE *fp = fopen(p, "w");
        CHECK(fp && fputs(f == 2 ? lock : "x", fp) >= 0 && fclose(fp) == 0);
    }
}

static bool there(const char *base, const char *name)
{
    char d[512];
    struct stat sb;
    snprintf(d, sizeof d, "%s/%s", base, name);
    return stat(d, &sb) == 0;
}

/* Removes base/name and what is in it (the test's leftovers). */
static void remove_dir(const char *base, const char *name)
{
    char d[512], p[600];
    snprintf(d, sizeof d, "%s/%s", base, name);
    static const char *const files[] = {"optim.bin", "master.bin", "param.bin", "lock", "notes.txt"};
    for (int f = 0; f < 5; f++) {
        snprintf(p, sizeof p, "%s/%s", d, files[f]);
        unlink(p);
    }
    CHECK_MSG(rmdir(d) == 0, "rmdir %s: %s", d, strerror(errno));
}

/* The context's warnings, one a line. */
typedef struct said {
    char text[8192];
    int n;
} said;

static void on_log(void *user, mt_log_level level, const char *msg)
{
    said *s = user;
    if (level != MT_LOG_WARN) return;
    const size_t k = strlen(s->text);
    snprintf(s->text + k, sizeof s->text - k, "%s\n", msg);
    s->n++;
}

/* A one-rank trainer with its state in base: its status, the message;
 * with lock, its scratch directory's lock file's text (LOCK_LEN bytes)
 * while it lives. */
enum { LOCK_LEN = 512 };
static mt_status trainer_in(const char *base, said *log, char *msg, size_t cap, char *lock)
{
    mt_context_config cc;
    mt_context_config_init(&cc);
    cc.device = MT_DEVICE_CPU;
    cc.threads = 1;
    cc.log_fn = on_log;
    cc.log_user = log;
    mt_context *ctx = NULL;
    CHECK_OK(mt_context_create(&cc, &ctx));
    mt_model *m = check_small_gpt(ctx, 64, 8, 32, 3);
    mt_trainer_config tc;
    mt_trainer_config_init(&tc);
    tc.max_batch = 2;
    tc.optimizer = MT_OPT_ADAMW;
    tc.offload = MT_PLACE_DISK;
    tc.offload_dir = base;
    mt_trainer *t = NULL;
    const mt_status s = mt_trainer_create(m, &tc, &t);
    snprintf(msg, cap, "%s", s ? mt_last_error(ctx) : "");
    if (lock) {
        char p[512];
        snprintf(p, sizeof p, "%s/memtrain-scratch/lock", base);
        FILE *f = fopen(p, "r");
        const size_t n = f ? fread(lock, 1, LOCK_LEN - 1, f) : 0;
        lock[n] = 0;
        if (f) fclose(f);
    }
    mt_trainer_destroy(t);
    mt_model_destroy(m);
    mt_context_destroy(ctx);
    return s;
}

/* What the library's lock file says of this process: its host, the boot,
 * its start (read from a trainer's, whose first line names this process). */
static void about_me(char *host, char *boot, unsigned long long *start)
{
    char base[64], lock[LOCK_LEN], msg[1024], want[96];
    snprintf(base, sizeof base, "/tmp/mt_scratch_%ld_XXXXXX", (long)getpid());
    CHECK(mkdtemp(base) != NULL);
    said log = {{0}, 0};
    CHECK_MSG(trainer_in(base, &log, msg, sizeof msg, lock) == MT_OK, "%s", msg);
    snprintf(want, sizeof want, "memtrain scratch directory of process %ld\nhost ", (long)getpid());
    CHECK_MSG(!strncmp(lock, want, strlen(want)) &&
                  sscanf(lock + strlen(want), "%255s\nboot %63s\nstart %llu", host, boot, start) == 3,
              "%s", lock);
    CHECK(rmdir(base) == 0);
}

/* A run of 3 ranks was killed, and other runs left theirs; a trainer of one
 * process in the same directory removes every directory whose owner has
 * ended (a dead process; a live number on a host booted since; our own
 * number, which the dead owner had before us, at another start; a lock of
 * an older library naming a dead process), each with a warning naming it,
 * and leaves the rest: a live owner, an owner on another host, no lock (a
 * run making it now), a dead owner's directory holding a file memtrain
 * did not make (said), and names that are not a scratch directory's. */
TEST(scratch_stale_directories_of_other_runs)
{
    char base[64];
    snprintf(base, sizeof base, "/tmp/mt_scratch_%ld_XXXXXX", (long)getpid());
    CHECK(mkdtemp(base) != NULL);
    char host[256], boot[64], lock[512];
    unsigned long long start;
    about_me(host, boot, &start);
    const long me = (long)getpid(), dead = ended_pid();
#define LOCK(pid, h, b, st)                                                                     \
    (snprintf(lock, sizeof lock,                                                                 \
              "memtrain scratch directory of process %ld\nhost %s\nboot %s\nstart %llu\n", pid, h, \
              b, st),                                                                            \
     lock)
    left_dir(base, "memtrain-scratch.rank0", LOCK(dead, host, boot, 100ull), false);
    left_dir(base, "memtrain-scratch.rank1", LOCK(1L, host, "another-boot", 1ull), false);
    left_dir(base, "memtrain-scratch.rank2", LOCK(me, host, boot, start + 1), false);
    left_dir(base, "memtrain-scratch.rank3", LOCK(me, host, boot, start), false);
    left_dir(base, "memtrain-scratch.rank4", LOCK(dead, "another-host.invalid", boot, 100ull), false);
    left_dir(base, "memtrain-scratch.rank5", NULL, false);
    left_dir(base, "memtrain-scratch.rank6", LOCK(dead, host, boot, 100ull), true);
    snprintf(lock, sizeof lock, "memtrain scratch directory of process %ld\n", dead);
    left_dir(base, "memtrain-scratch.rank7", lock, false);
    left_dir(base, "memtrain-scratch.rank8x", LOCK(dead, host, boot, 100ull), false);
    left_dir(base, "memtrain-scratchy", LOCK(dead, host, boot, 100ull), false);
    said log = {{0}, 0};
    char msg[1024];
    CHECK_MSG(trainer_in(base, &log, msg, sizeof msg, NULL) == MT_OK, "%s", msg);
    static const char *const gone[] = {"memtrain-scratch.rank0", "memtrain-scratch.rank1",
                                       "memtrain-scratch.rank2", "memtrain-scratch.rank7",
                                       "memtrain-scratch"};
    static const char *const kept[] = {"memtrain-scratch.rank3", "memtrain-scratch.rank4",
                                       "memtrain-scratch.rank5", "memtrain-scratch.rank6",
                                       "memtrain-scratch.rank8x", "memtrain-scratchy"};
    for (int i = 0; i < 5; i++) CHECK_MSG(!there(base, gone[i]), "%s is still there", gone[i]);
    for (int i = 0; i < 6; i++) CHECK_MSG(there(base, kept[i]), "%s was removed", kept[i]);
    for (int i = 0; i < 4; i++) {
        char want[600];
        snprintf(want, sizeof want, "removed the stale scratch directory '%s/%s'", base, gone[i]);
        CHECK_MSG(strstr(log.text, want), "no warning for %s: %.1900s", gone[i], log.text);
    }
    CHECK_MSG(strstr(log.text, "ran before this host last started"), "%.1900s", log.text);
    CHECK_MSG(strstr(log.text, "memtrain-scratch.rank6' of process") &&
                  strstr(log.text, "holds files memtrain did not make"),
              "%.1900s", log.text);
    CHECK_EQ(log.n, 5);
    for (int i = 0; i < 6; i++) remove_dir(base, kept[i]);
    CHECK(rmdir(base) == 0);
}

/* A trainer's own directory name: left by an owner that has ended (a live
 * number on a host booted since; this process's number at another start)
 * it is removed and made again, with a warning; an owner on another host
 * cannot be checked, and one that runs is running: both refused, the
 * directory left as it was. */
TEST(scratch_own_name_owner_checked)
{
    char base[64];
    snprintf(base, sizeof base, "/tmp/mt_scratch_%ld_XXXXXX", (long)getpid());
    CHECK(mkdtemp(base) != NULL);
    char host[256], boot[64], lock[512], msg[1024];
    unsigned long long start;
    about_me(host, boot, &start);
    const long me = (long)getpid();
    said log = {{0}, 0};
    left_dir(base, "memtrain-scratch", LOCK(1L, host, "another-boot", 1ull), false);
    CHECK_MSG(trainer_in(base, &log, msg, sizeof msg, NULL) == MT_OK, "%s", msg);
    CHECK_MSG(log.n == 1 && strstr(log.text, "removed the stale scratch directory") &&
                  strstr(log.text, "process 1 on this host, ran before this host last started"),
              "%.1900s", log.text);
    CHECK(!there(base, "memtrain-scratch"));
    left_dir(base, "memtrain-scratch", LOCK(me, host, boot, start + 7), false);
    CHECK_MSG(trainer_in(base, &log, msg, sizeof msg, NULL) == MT_OK, "%s", msg);
    CHECK_EQ(log.n, 2);
    CHECK(!there(base, "memtrain-scratch"));
    left_dir(base, "memtrain-scratch", LOCK(me, "another-host.invalid", boot, start), false);
    CHECK_ST(MT_ERR_IO, trainer_in(base, &log, msg, sizeof msg, NULL));
    CHECK_MSG(strstr(msg, "on host another-host.invalid") && strstr(msg, "cannot be checked"), "%s",
              msg);
    CHECK(there(base, "memtrain-scratch"));
    remove_dir(base, "memtrain-scratch");
    left_dir(base, "memtrain-scratch", LOCK(me, host, boot, start), false);
    CHECK_ST(MT_ERR_IO, trainer_in(base, &log, msg, sizeof msg, NULL));
    CHECK_MSG(strstr(msg, "which is running"), "%s", msg);
    CHECK_EQ(log.n, 2);
    remove_dir(base, "memtrain-scratch");
    CHECK(rmdir(base) == 0);
#undef LOCK
}
