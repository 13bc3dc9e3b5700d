/*
 * fileio.c - whole-file reads and crash-safe writes.
 *
 * Writes go to a temporary file beside the target, are fsynced, and are
 * renamed over the target, so a crash at any moment leaves either the old
 * file or the new one, never a torn one.
 *
 * Where the file system can (Linux O_TMPFILE, with /proc to link it), the
 * temporary has no name while it is written: a process killed then (a
 * signal, SIGKILL, a crash) leaves nothing behind. It is linked to a
 * fresh name beside the target only at commit, and renamed over the
 * target at once, with the calling thread's signals blocked for those two
 * calls (SIGKILL cannot be blocked: landing between them, it leaves that
 * name). Elsewhere it is a named file from the start, removed on failure.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "rng.h"

mt_status mti_read_file(mt_context *ctx, const char *path, size_t max_bytes, unsigned char **data,
                        size_t *size)
{
    if (!path) return mti_fail(ctx, MT_ERR_INVALID_ARG, "path is NULL");
    /* O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return mti_fail(ctx, MT_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return mti_fail(ctx, MT_ERR_IO, "'%s' is not a regular file", path);
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    if ((uint64_t)sb.st_size > max_bytes) {
        close(fd);
        return mti_fail(ctx, MT_ERR_FORMAT, "'%s' is %lld bytes, more than the %zu allowed", path,
                        (long long)sb.st_size, max_bytes);
    }
    size_t n = (size_t)sb.st_size;
    unsigned char *buf = malloc(n ? n : 1);
    if (!buf) {
        close(fd);
        return mti_fail(ctx, MT_ERR_OOM, "out of host memory reading '%s' (%zu bytes)", path, n);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = errno;
            free(buf);
            close(fd);
            return mti_fail(ctx, MT_ERR_IO, "reading '%s': %s", path,
                            r < 0 ? strerror(e) : "file shrank while being read");
        }
        got += (size_t)r;
    }
    close(fd);
    *data = buf;
    *size = n;
    return MT_OK;
}

static int write_all(int fd, const unsigned char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

mt_status mti_afile_open(mt_context *ctx, const char *path, mti_afile *f)
{
    memset(f, 0, sizeof *f);
    f->fd = -1;
    if (!path) return mti_fail(ctx, MT_ERR_INVALID_ARG, "path is NULL");
    size_t plen = strlen(path);
    f->path = strdup(path);
    f->tmp = malloc(plen + 32);
    if (!f->path || !f->tmp) {
        mti_afile_abort(f);
        return mti_fail(ctx, MT_ERR_OOM, "out of host memory");
    }
    snprintf(f->tmp, plen + 32, "%s.tmp.XXXXXX", path);
#ifdef O_TMPFILE
    if (access("/proc/self/fd", X_OK) == 0) {
        /* an unnamed file in the target's directory */
        char *slash = strrchr(f->tmp, '/');
        char *dir = slash ? strndup(f->tmp, slash == f->tmp ? 1 : (size_t)(slash - f->tmp))
                          : strdup(".");
        if (dir) f->fd = open(dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
        free(dir);
        if (f->fd >= 0) {
            f->unnamed = 1;
            fchmod(f->fd, 0644);
            return MT_OK;
        }
        /* a file system without O_TMPFILE: a named temporary */
    }
#endif
    /* a fresh name beside the target, created exclusively: two writers of
       the same path never share a temporary, and no link is followed */
    f->fd = mkostemp(f->tmp, O_CLOEXEC);
    if (f->fd < 0) {
        mt_status s = mti_fail(ctx, MT_ERR_IO, "cannot create '%s': %s", f->tmp, strerror(errno));
        free(f->tmp); /* nothing was created: nothing to unlink */
        f->tmp = NULL;
        mti_afile_abort(f);
        return s;
    }
    fchmod(f->fd, 0644);
    return MT_OK;
}

mt_status mti_afile_write(mt_context *ctx, mti_afile *f, const void *data, size_t n)
{
    if (f->fd < 0) return mti_fail(ctx, MT_ERR_STATE, "write to a closed file");
    if (write_all(f->fd, data, n) != 0) {
        int e = errno;
        mt_status s = mti_fail(ctx, MT_ERR_IO, "writing '%s': %s", f->path, strerror(e));
        mti_afile_abort(f);
        return s;
    }
    return MT_OK;
}

void mti_afile_abort(mti_afile *f)
{
    if (f->fd >= 0) close(f->fd);
    if (f->tmp && !f->unnamed) unlink(f->tmp);
    free(f->tmp);
    free(f->path);
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

/* Makes the rename itself durable, and frees f. */
static mt_status synced_dir(mti_afile *f)
{
    free(f->tmp);
    f->tmp = NULL;
    char *dir = f->path;
    char *slash = strrchr(dir, '/');
    const char *d = ".";
    if (slash) {
        *slash = 0;
        d = slash == dir ? "/" : dir;
    }
    int dfd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    mti_afile_abort(f);
    return MT_OK;
}

/* An unnamed temporary linked to a fresh name beside the target and renamed
 * over it, no signal handled in between (a handler that exits or a
 * default action would leave the name behind). */
static mt_status commit_unnamed(mt_context *ctx, mti_afile *f)
{
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", f->fd);
    const size_t X = strlen(f->tmp) - 6; /* the XXXXXX */
    mti_rng rng;
    mti_rng_seed(&rng, (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)f ^ mti_now_ns());
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = -1, e = 0;
    for (int tries = 0; tries < 64 && rc != 0; tries++) {
        uint64_t r = mti_rng_next(&rng);
        for (int i = 0; i < 6; i++)
            f->tmp[X + (size_t)i] = "abcdefghijklmnopqrstuvwxyz0123456789"[(r >> (8 * i)) % 36];
        rc = linkat(AT_FDCWD, proc, AT_FDCWD, f->tmp, AT_SYMLINK_FOLLOW);
        e = errno;
        if (rc != 0 && e != EEXIST) break;
    }
    if (rc == 0 && rename(f->tmp, f->path) != 0) {
        e = errno;
        unlink(f->tmp);
        rc = -1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    int closed = close(f->fd);
    f->fd = -1;
    if (rc != 0 || closed != 0) {
        mt_status s = mti_fail(ctx, MT_ERR_IO, "cannot put '%s' in place: %s", f->path,
                               strerror(rc != 0 ? e : errno));
        mti_afile_abort(f);
        return s;
    }
    return synced_dir(f);
}

mt_status mti_afile_commit(mt_context *ctx, mti_afile *f)
{
    if (f->fd < 0) return mti_fail(ctx, MT_ERR_STATE, "commit of a closed file");
    if (fsync(f->fd) != 0) {
        int e = errno;
        mt_status s = mti_fail(ctx, MT_ERR_IO, "writing '%s': %s", f->path, strerror(e));
        mti_afile_abort(f);
        return s;
    }
    if (f->unnamed) return commit_unnamed(ctx, f);
    int rc = close(f->fd);
    f->fd = -1;
    if (rc != 0 || rename(f->tmp, f->path) != 0) {
        int e = errno;
        mt_status s = mti_fail(ctx, MT_ERR_IO, "cannot put '%s' in place: %s", f->path, strerror(e));
        mti_afile_abort(f);
        return s;
    }
    return synced_dir(f);
}

mt_status mti_write_file_atomic(mt_context *ctx, const char *path, const void *data, size_t size)
{
    if (!path || (!data && size)) return mti_fail(ctx, MT_ERR_INVALID_ARG, "path or data is NULL");
    mti_afile f;
    mt_status s = mti_afile_open(ctx, path, &f);
    if (!s) s = mti_afile_write(ctx, &f, data, size);
    if (!s) s = mti_afile_commit(ctx, &f);
    return s;
}
