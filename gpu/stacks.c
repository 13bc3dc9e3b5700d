/* stacks.c - where each thread of a running process is, for machines
 * without gdb (the GPU bundle's run.sh uses it on a test that does not
 * end in time):
 *
 *   mt_stacks PID
 *
 * For each thread: its name, its instruction pointer as FILE+OFFSET and
 * the nearest function symbol before it, then the words on its stack (from
 * the stack pointer up, the first 16 KiB) that point into code, innermost
 * first, named the same way. The stack words are not an unwound call
 * chain: a word that points into code may be stale, but the return
 * addresses of the live frames are among them, in order. Symbols come from
 * each mapped file's .symtab or .dynsym, so a stripped library names only
 * its exported functions (the offset then says how far past one).
 *
 * Built statically (it runs where the bundle's libraries are not yet
 * found), with no dependency beyond libc. Needs the right to ptrace the
 * process (the same user, or root). */
#define _GNU_SOURCE
#include <dirent.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

enum { MAX_MAPS = 8192, STACK_BYTES = 16384, MAX_WORDS = 40 };

typedef struct {
    uint64_t addr;
    const char *name;
} sym;

/* A mapped file's function symbols, sorted, and its loadable segments. */
typedef struct {
    char path[512];
    int tried;
    const unsigned char *img;
    size_t img_bytes;
    sym *syms;
    size_t n_syms;
    const Elf64_Phdr *ph;
    int n_ph;
} object;

typedef struct {
    uint64_t lo, hi, off;
    int obj; /* its object's index in objs; -1 for an anonymous mapping ([vdso] and the like) */
    char label[64];
} mapping;

static mapping maps[MAX_MAPS];
static int n_maps;
static object *objs;
static int n_objs, cap_objs;

static int by_addr(const void *a, const void *b)
{
    const sym *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

/* Reads the function symbols of one symbol table section. */
static void add_syms(object *o, const Elf64_Shdr *sh, const Elf64_Shdr *all, int n_sh)
{
    if (sh->sh_link >= (unsigned)n_sh || sh->sh_entsize != sizeof(Elf64_Sym)) return;
    const Elf64_Shdr *str = &all[sh->sh_link];
    if (sh->sh_offset + sh->sh_size > o->img_bytes || str->sh_offset + str->sh_size > o->img_bytes)
        return;
    const Elf64_Sym *s = (const void *)(o->img + sh->sh_offset);
    size_t n = sh->sh_size / sizeof *s;
    sym *grown = realloc(o->syms, (o->n_syms + n) * sizeof *grown);
    if (!grown) return;
    o->syms = grown;
    for (size_t i = 0; i < n; i++) {
        if (ELF64_ST_TYPE(s[i].st_info) != STT_FUNC || !s[i].st_value) continue;
        if (s[i].st_name >= str->sh_size) continue;
        o->syms[o->n_syms++] =
            (sym){s[i].st_value, (const char *)o->img + str->sh_offset + s[i].st_name};
    }
}

static void load(object *o)
{
    o->tried = 1;
    int fd = open(o->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) || st.st_size < (off_t)sizeof(Elf64_Ehdr)) {
        close(fd);
        return;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return;
    o->img = p, o->img_bytes = (size_t)st.st_size;
    const Elf64_Ehdr *eh = p;
    if (memcmp(eh->e_ident, ELFMAG, SELFMAG) || eh->e_ident[EI_CLASS] != ELFCLASS64) return;
    if (eh->e_phoff + (size_t)eh->e_phnum * sizeof(Elf64_Phdr) <= o->img_bytes)
        o->ph = (const void *)(o->img + eh->e_phoff), o->n_ph = eh->e_phnum;
    if (eh->e_shoff + (size_t)eh->e_shnum * sizeof(Elf64_Shdr) > o->img_bytes) return;
    const Elf64_Shdr *sh = (const void *)(o->img + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum; i++)
        if (sh[i].sh_type == SHT_SYMTAB || sh[i].sh_type == SHT_DYNSYM)
            add_syms(o, &sh[i], sh, eh->e_shnum);
    qsort(o->syms, o->n_syms, sizeof *o->syms, by_addr);
}

/* The index of path's object in objs, added if new; -1 out of memory. */
static int object_of(const char *path)
{
    for (int i = 0; i < n_objs; i++)
        if (!strcmp(objs[i].path, path)) return i;
    if (n_objs == cap_objs) {
        int cap = cap_objs ? 2 * cap_objs : 64;
        object *grown = realloc(objs, (size_t)cap * sizeof *grown);
        if (!grown) return -1;
        objs = grown, cap_objs = cap;
    }
    object *o = &objs[n_objs];
    memset(o, 0, sizeof *o);
    snprintf(o->path, sizeof o->path, "%s", path);
    return n_objs++;
}

static int read_maps(int pid)
{
    char p[64], line[1024];
    snprintf(p, sizeof p, "/proc/%d/maps", pid);
    FILE *f = fopen(p, "r");
    if (!f) return -1;
    while (fgets(line, sizeof line, f) && n_maps < MAX_MAPS) {
        unsigned long lo, hi, off;
        char perm[8], name[600] = "";
        if (sscanf(line, "%lx-%lx %7s %lx %*s %*s %599[^\n]", &lo, &hi, perm, &off, name) < 4)
            continue;
        if (perm[2] != 'x') continue;
        mapping *m = &maps[n_maps];
        *m = (mapping){.lo = lo, .hi = hi, .off = off, .obj = name[0] == '/' ? object_of(name) : -1};
        snprintf(m->label, sizeof m->label, "%s", name[0] ? name : "[anonymous]");
        n_maps++;
    }
    fclose(f);
    return 0;
}

/* "FILE+0xOFFSET FUNCTION+0xD" for an address in a mapped file; 0 when the
 * address is in no executable mapping. */
static int describe(uint64_t a, char *out, size_t cap)
{
    for (int i = 0; i < n_maps; i++) {
        const mapping *m = &maps[i];
        if (a < m->lo || a >= m->hi) continue;
        if (m->obj < 0) {
            snprintf(out, cap, "%s+0x%llx", m->label, (unsigned long long)(a - m->lo));
            return 1;
        }
        object *o = &objs[m->obj];
        if (!o->tried) load(o);
        const uint64_t foff = a - m->lo + m->off;
        uint64_t va = foff; /* the file offset's virtual address, by the loadable segments */
        for (int k = 0; k < o->n_ph; k++) {
            const Elf64_Phdr *ph = &o->ph[k];
            if (ph->p_type == PT_LOAD && foff >= ph->p_offset && foff < ph->p_offset + ph->p_filesz)
                va = foff - ph->p_offset + ph->p_vaddr;
        }
        const char *base = strrchr(o->path, '/');
        int n = snprintf(out, cap, "%s+0x%llx", base ? base + 1 : o->path, (unsigned long long)foff);
        size_t lo = 0, hi = o->n_syms; /* the last symbol at or below va */
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (o->syms[mid].addr <= va) lo = mid + 1;
            else hi = mid;
        }
        if (lo > 0 && n > 0 && (size_t)n < cap)
            snprintf(out + n, cap - (size_t)n, "  %s+0x%llx", o->syms[lo - 1].name,
                     (unsigned long long)(va - o->syms[lo - 1].addr));
        return 1;
    }
    return 0;
}

static void thread_name(int pid, int tid, char *out, size_t cap)
{
    char p[96];
    snprintf(p, sizeof p, "/proc/%d/task/%d/comm", pid, tid);
    FILE *f = fopen(p, "r");
    out[0] = 0;
    if (f) {
        if (fgets(out, (int)cap, f)) out[strcspn(out, "\n")] = 0;
        fclose(f);
    }
}

static void show_thread(int pid, int tid, int mem)
{
    char name[64], where[800];
    thread_name(pid, tid, name, sizeof name);
    if (ptrace(PTRACE_SEIZE, tid, 0, 0) || ptrace(PTRACE_INTERRUPT, tid, 0, 0)) {
        printf("thread %d (%s): cannot attach: %s\n", tid, name, strerror(errno));
        return;
    }
    int st;
    struct user_regs_struct r;
    if (waitpid(tid, &st, __WALL) < 0 || ptrace(PTRACE_GETREGS, tid, 0, &r)) {
        printf("thread %d (%s): no registers: %s\n", tid, name, strerror(errno));
        ptrace(PTRACE_DETACH, tid, 0, 0);
        return;
    }
    if (!describe(r.rip, where, sizeof where)) snprintf(where, sizeof where, "?");
    printf("thread %d (%s): at 0x%llx %s\n", tid, name, (unsigned long long)r.rip, where);
    static uint64_t stack[STACK_BYTES / 8];
    ssize_t got = pread(mem, stack, sizeof stack, (off_t)r.rsp);
    ptrace(PTRACE_DETACH, tid, 0, 0);
    int shown = 0;
    for (ssize_t i = 0; i < got / 8 && shown < MAX_WORDS; i++)
        if (describe(stack[i], where, sizeof where)) {
            printf("    sp+0x%-5zx %s\n", (size_t)i * 8, where);
            shown++;
        }
}

int main(int argc, char **argv)
{
    char *end;
    long pid = argc == 2 ? strtol(argv[1], &end, 10) : 0;
    if (argc != 2 || *end || pid <= 0) {
        fprintf(stderr, "usage: mt_stacks PID\n");
        return 2;
    }
    if (read_maps((int)pid)) {
        fprintf(stderr, "mt_stacks: no process %ld: %s\n", pid, strerror(errno));
        return 1;
    }
    char p[64];
    snprintf(p, sizeof p, "/proc/%ld/mem", pid);
    int mem = open(p, O_RDONLY | O_CLOEXEC);
    snprintf(p, sizeof p, "/proc/%ld/task", pid);
    DIR *d = opendir(p);
    if (mem < 0 || !d) {
        fprintf(stderr, "mt_stacks: cannot read process %ld: %s\n", pid, strerror(errno));
        return 1;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        int tid = atoi(e->d_name);
        if (tid > 0) show_thread((int)pid, tid, mem);
    }
    closedir(d);
    close(mem);
    return 0;
}
