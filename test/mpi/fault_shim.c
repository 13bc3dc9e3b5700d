/*
 * fault_shim.c - faults of one rank for test/mpi_test.sh, preloaded
 * (LD_PRELOAD) into memtrain train under mpirun; on the rank MT_FAULT_RANK
 * names:
 *   MT_STALL_CALL=K: the K-th all-reduce of one float taking the maximum
 *     (the command's question after each step whether every rank goes on,
 *     tools/cli_ranks.c; the library makes no such call) first sleeps
 *     MT_STALL_S seconds (10), through MPI's profiling interface, so the
 *     other ranks meet their deadline in that collective and in no other;
 *   MT_FAIL_WRITE=K: the K-th write to a scratch file (a path holding
 *     "memtrain-scratch") fails with EIO, as a failing disk's would;
 *   MT_STALL_SEND=K: the K-th point-to-point send of bytes (pipeline
 *     parallel's exchanges between stages) first sleeps MT_STALL_S seconds
 *     (10), so its peer meets its deadline waiting for it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The value of environment variable `name` when this is the faulty rank, else 0. */
static int on_this_rank(const char *name)
{
    const char *r = getenv("MT_FAULT_RANK"), *me = getenv("OMPI_COMM_WORLD_RANK");
    const char *v = getenv(name);
    return r && me && v && atoi(r) == atoi(me) ? atoi(v) : 0;
}

int MPI_Iallreduce(const void *send, void *recv, int count, MPI_Datatype dt, MPI_Op op,
                   MPI_Comm comm, MPI_Request *req)
{
    static int calls;
    const int at = on_this_rank("MT_STALL_CALL");
    if (at && count == 1 && dt == MPI_FLOAT && op == MPI_MAX && ++calls == at) {
        const char *s = getenv("MT_STALL_S");
        sleep(s ? (unsigned)atoi(s) : 10u);
    }
    return PMPI_Iallreduce(send, recv, count, dt, op, comm, req);
}

int MPI_Isend(const void *buf, int count, MPI_Datatype dt, int to, int tag, MPI_Comm comm,
              MPI_Request *req)
{
    static int calls;
    const int at = on_this_rank("MT_STALL_SEND");
    if (at && dt == MPI_BYTE && ++calls == at) {
        const char *s = getenv("MT_STALL_S");
        sleep(s ? (unsigned)atoi(s) : 10u);
    }
    return PMPI_Isend(buf, count, dt, to, tag, comm, req);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
    static ssize_t (*next)(int, const void *, size_t, off_t);
    static int writes;
    if (!next) next = (ssize_t (*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
    const int at = on_this_rank("MT_FAIL_WRITE");
    if (at) {
        char link[64], path[4096];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        const ssize_t k = readlink(link, path, sizeof path - 1);
        path[k > 0 ? k : 0] = 0;
        if (strstr(path, "memtrain-scratch") && __atomic_add_fetch(&writes, 1, __ATOMIC_SEQ_CST) == at) {
            errno = EIO;
            return -1;
        }
    }
    return next(fd, buf, n, off);
}
