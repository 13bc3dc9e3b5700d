/*
 * test_fileio.c - crash-safe file writes: a writer killed at any moment
 * leaves the old file or the new one and no temporary beside it; an
 * aborted write leaves nothing.
 */
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

/* The names in dir other than . and .. that are not keep: how many, and
   the first into other. */
static int others(const char *dir, const char *keep, char *other, size_t cap)
{
    DIR *d = opendir(dir);
    int n = 0;
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, keep))
            continue;
        if (!n++) snprintf(other, cap, "%s", e->d_name);
    }
    closedir(d);
    return n;
}

static size_t file_size(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (size_t)sb.st_size : 0;
}

/* A process writing a 4 MiB file over and over is killed (SIGKILL, and
   SIGINT and SIGTERM with their default action) at random moments: the file
   is always whole, and no temporary is left beside it (but the one name a
   SIGKILL between link and rename can leave). */
TEST(fileio_killed_writer_leaves_no_temporary)
{
    char dir[] = "/tmp/mt_test_fileio_XXXXXX", path[64], other[256];
    CHECK(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/f.bin", dir);
    const size_t n = (size_t)4 << 20;
    unsigned char *buf = check_alloc(n);
    uint64_t r = (uint64_t)time(NULL) | 1;
    const int sigs[] = {SIGKILL, SIGINT, SIGTERM};
    const int rounds = check_light() ? 3 : 9;
    for (int round = 0; round < rounds; round++) {
        remove(path);
        fflush(stdout);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            signal(SIGINT, SIG_DFL), signal(SIGTERM, SIG_DFL);
            for (unsigned char k = 0;; k++) {
                memset(buf, k, n);
                if (mti_write_file_atomic(NULL, path, buf, n)) _exit(3);
            }
        }
        for (int w = 0; w < 30000 && access(path, F_OK) != 0; w++) usleep(1000);
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        usleep((useconds_t)(r % 20000));
        kill(pid, sigs[round % 3]);
        int status;
        waitpid(pid, &status, 0);
        CHECK_MSG(WIFSIGNALED(status), "the writer ended by itself (status %d)", status);
        CHECK_MSG(file_size(path) == n, "round %d: the file has %zu bytes", round, file_size(path));
        /* SIGINT and SIGTERM are blocked while the temporary has a name;
           SIGKILL cannot be, and landing in those two calls (link, rename)
           it leaves that one name behind: at most one, never for a caught
           signal. */
        int left = others(dir, "f.bin", other, sizeof other);
        CHECK_MSG(left <= (sigs[round % 3] == SIGKILL), "round %d (signal %d): %d files left beside it, e.g. %s",
                  round, sigs[round % 3], left, other);
        if (left) {
            char full[512];
            snprintf(full, sizeof full, "%s/%s", dir, other);
            CHECK(remove(full) == 0);
        }
    }
    remove(path);
    CHECK(rmdir(dir) == 0);
}

/* Written and committed: in place; aborted, or failing to open: nothing
   written, the old file as it was. */
TEST(fileio_commit_and_abort)
{
    char dir[] = "/tmp/mt_test_fileio_XXXXXX", path[64], other[256];
    CHECK(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/g.bin", dir);
    CHECK_OK(mti_write_file_atomic(NULL, path, "old", 3));
    mti_afile f;
    CHECK_OK(mti_afile_open(NULL, path, &f));
    CHECK_OK(mti_afile_write(NULL, &f, "newer", 5));
    mti_afile_abort(&f);
    CHECK(file_size(path) == 3 && others(dir, "g.bin", other, sizeof other) == 0);
    CHECK_OK(mti_afile_open(NULL, path, &f));
    CHECK_OK(mti_afile_write(NULL, &f, "newer", 5));
    CHECK_OK(mti_afile_commit(NULL, &f));
    CHECK(file_size(path) == 5 && others(dir, "g.bin", other, sizeof other) == 0);
    char missing[96];
    snprintf(missing, sizeof missing, "%s/none/h.bin", dir);
    CHECK_ST(MT_ERR_IO, mti_write_file_atomic(NULL, missing, "x", 1));
    CHECK(others(dir, "g.bin", other, sizeof other) == 0);
    remove(path);
    CHECK(rmdir(dir) == 0);
}
