/*
 * golden.c - reader of the golden vector files (see golden.h, and the
 * format at the top of test/golden/gen.py).
 */
#include "golden.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const unsigned char MAGIC[8] = {'M', 'T', 'G', 'O', 'L', 'D', '0', '1'};

size_t gv_dtype_size(gv_dtype t)
{
    switch (t) {
    case GV_F32: return 4;
    case GV_F16: return 2;
    case GV_BF16: return 2;
    case GV_I32: return 4;
    case GV_U8: return 1;
    }
    return 0;
}

const char *gv_dtype_name(gv_dtype t)
{
    switch (t) {
    case GV_F32: return "fp32";
    case GV_F16: return "fp16";
    case GV_BF16: return "bf16";
    case GV_I32: return "int32";
    case GV_U8: return "uint8";
    }
    return "?";
}

const char *gv_dir(void)
{
    const char *d = getenv("MT_GOLDEN_DIR");
    return d && *d ? d : "test/golden";
}

uint32_t gv_crc32(uint32_t crc, const void *data, size_t n)
{
    /* four bits at a time from a 16-entry table: fast enough for the
     * damaged-file tests, and a constant table needs no set-up */
    static const uint32_t t[16] = {
        0x00000000u, 0x1DB71064u, 0x3B6E20C8u, 0x26D930ACu, 0x76DC4190u, 0x6B6B51F4u,
        0x4DB26158u, 0x5005713Cu, 0xEDB88320u, 0xF00F9344u, 0xD6D6A3E8u, 0xCB61B38Cu,
        0x9B64C2B0u, 0x86D3D2D4u, 0xA00AE278u, 0xBDBDF21Cu};
    const unsigned char *p = data;
    crc = ~crc;
    while (n--) {
        crc ^= *p++;
        crc = t[crc & 15u] ^ (crc >> 4);
        crc = t[crc & 15u] ^ (crc >> 4);
    }
    return ~crc;
}

/* A cursor over the image: every read checks that the bytes are there. */
typedef struct cursor {
    const unsigned char *p;
    size_t size, off;
    char *err;
    size_t errlen;
} cursor;

static bool fail(cursor *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(cursor *c, const char *fmt, ...)
{
    if (c->err && c->errlen) {
        char msg[256];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        snprintf(c->err, c->errlen, "%s (at byte %zu of %zu)", msg, c->off, c->size);
    }
    return false;
}

static bool need(cursor *c, size_t n, const char *what)
{
    if (n > c->size - c->off) return fail(c, "truncated: %s needs %zu bytes", what, n);
    return true;
}

static bool get_u32(cursor *c, uint32_t *v, const char *what)
{
    if (!need(c, 4, what)) return false;
    const unsigned char *p = c->p + c->off;
    *v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    c->off += 4;
    return true;
}

static bool get_u64(cursor *c, uint64_t *v, const char *what)
{
    if (!need(c, 8, what)) return false;
    uint64_t x = 0;
    for (int i = 0; i < 8; i++) x |= (uint64_t)c->p[c->off + (size_t)i] << (8 * i);
    *v = x;
    c->off += 8;
    return true;
}

void gv_free(gv_file *f)
{
    if (!f) return;
    if (f->arrays)
        for (int i = 0; i < f->n; i++) free(f->arrays[i].data);
    free(f->arrays);
    free(f->header);
    memset(f, 0, sizeof *f);
}

static bool parse_array(cursor *c, gv_array *a, int index)
{
    uint32_t len, dt, rank;
    if (!get_u32(c, &len, "an array's name length")) return false;
    if (len == 0 || len > GV_MAX_NAME)
        return fail(c, "array %d: name length %u not in 1..%d", index, len, GV_MAX_NAME);
    if (!need(c, len, "an array's name")) return false;
    for (uint32_t i = 0; i < len; i++) {
        unsigned char ch = c->p[c->off + i];
        if (ch < 0x21 || ch > 0x7E) return fail(c, "array %d: name has byte 0x%02x", index, ch);
    }
    memcpy(a->name, c->p + c->off, len);
    a->name[len] = '\0';
    c->off += len;
    if (!get_u32(c, &dt, "a dtype") || !get_u32(c, &rank, "a rank")) return false;
    if (dt > GV_U8)
        return fail(c, "array '%s': unknown dtype code %u", a->name, dt);
    if (rank > GV_MAX_RANK)
        return fail(c, "array '%s': rank %u above %d", a->name, rank, GV_MAX_RANK);
    a->dtype = (gv_dtype)dt;
    a->rank = (int)rank;
    size_t esize = gv_dtype_size(a->dtype);
    uint64_t dims[GV_MAX_RANK];
    bool empty = false;
    for (uint32_t d = 0; d < rank; d++) {
        if (!get_u64(c, &dims[d], "a dimension")) return false;
        if (dims[d] > (uint64_t)INT64_MAX)
            return fail(c, "array '%s': dimension %u = %llu too large", a->name, d,
                        (unsigned long long)dims[d]);
        a->dims[d] = (int64_t)dims[d];
        empty |= dims[d] == 0;
    }
    /* the product, refusing any that would not fit in size_t as bytes */
    size_t numel = empty ? 0 : 1;
    for (uint32_t d = 0; d < rank && !empty; d++) {
        if (dims[d] > SIZE_MAX / esize / numel)
            return fail(c, "array '%s': the dimensions' product overflows", a->name);
        numel *= (size_t)dims[d];
    }
    size_t bytes = numel * esize;
    if (!need(c, bytes, "an array's data"))
        return fail(c, "array '%s': data needs %zu bytes, %zu left", a->name, bytes,
                    c->size - c->off);
    a->numel = numel;
    a->data = malloc(bytes ? bytes : 1);
    if (!a->data) return fail(c, "array '%s': out of memory for %zu bytes", a->name, bytes);
    /* the files are little-endian, and so is every machine we build for */
    memcpy(a->data, c->p + c->off, bytes);
    c->off += bytes;
    return true;
}

bool gv_parse(const unsigned char *buf, size_t size, gv_file *f, char *err, size_t errlen)
{
    cursor c = {buf, size, 0, err, errlen};
    if (err && errlen) err[0] = '\0';
    if (!f) return fail(&c, "no file struct");
    memset(f, 0, sizeof *f);
    if (!buf && size) return fail(&c, "no data");
    if (size < sizeof MAGIC + 12) return fail(&c, "too short to be a golden file");
    if (memcmp(buf, MAGIC, sizeof MAGIC) != 0) return fail(&c, "bad magic (not a .gv file)");
    uint32_t want = (uint32_t)buf[size - 4] | (uint32_t)buf[size - 3] << 8 |
                    (uint32_t)buf[size - 2] << 16 | (uint32_t)buf[size - 1] << 24;
    uint32_t got = gv_crc32(0, buf, size - 4);
    if (got != want) return fail(&c, "CRC mismatch: stored %08x, computed %08x", want, got);
    c.size = size - 4; /* the CRC is not part of the content */
    c.off = sizeof MAGIC;

    uint32_t hlen, n;
    if (!get_u32(&c, &hlen, "the header length")) goto bad;
    if (hlen > GV_MAX_HEADER) {
        fail(&c, "header length %u above %d", hlen, GV_MAX_HEADER);
        goto bad;
    }
    if (!need(&c, hlen, "the header")) goto bad;
    f->header = malloc((size_t)hlen + 1);
    if (!f->header) {
        fail(&c, "out of memory");
        goto bad;
    }
    memcpy(f->header, buf + c.off, hlen);
    f->header[hlen] = '\0';
    c.off += hlen;
    if (!get_u32(&c, &n, "the array count")) goto bad;
    if (n > GV_MAX_ARRAYS) {
        fail(&c, "%u arrays, above %d", n, GV_MAX_ARRAYS);
        goto bad;
    }
    f->arrays = calloc(n ? n : 1, sizeof *f->arrays);
    if (!f->arrays) {
        fail(&c, "out of memory");
        goto bad;
    }
    for (uint32_t i = 0; i < n; i++) {
        f->n = (int)i + 1; /* so gv_free releases what this one allocates */
        if (!parse_array(&c, &f->arrays[i], (int)i)) goto bad;
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(f->arrays[j].name, f->arrays[i].name) == 0) {
                fail(&c, "array name '%s' appears twice", f->arrays[i].name);
                goto bad;
            }
    }
    f->n = (int)n;
    if (c.off != c.size) {
        fail(&c, "%zu bytes after the last array", c.size - c.off);
        goto bad;
    }
    return true;
bad:
    gv_free(f);
    return false;
}

bool gv_load(const char *path, gv_file *f, char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    if (f) memset(f, 0, sizeof *f);
    FILE *fp = path ? fopen(path, "rb") : NULL;
    if (!fp) {
        if (err && errlen)
            snprintf(err, errlen, "%s: cannot open (the tests look in %s, from the repository "
                     "root; MT_GOLDEN_DIR overrides)", path ? path : "(null)", gv_dir());
        return false;
    }
    size_t cap = 1 << 16, size = 0;
    unsigned char *buf = malloc(cap);
    bool ok = buf != NULL;
    while (ok) {
        if (size > GV_MAX_FILE) {
            if (err && errlen) snprintf(err, errlen, "%s: larger than %u bytes", path, GV_MAX_FILE);
            ok = false;
            break;
        }
        if (size == cap) {
            unsigned char *nb = realloc(buf, cap * 2);
            if (!nb) {
                ok = false;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + size, 1, cap - size, fp);
        size += got;
        if (got == 0) {
            if (ferror(fp)) {
                if (err && errlen) snprintf(err, errlen, "%s: read error", path);
                ok = false;
            }
            break;
        }
    }
    fclose(fp);
    if (!ok) {
        if (err && errlen && !err[0]) snprintf(err, errlen, "%s: out of memory", path);
        free(buf);
        return false;
    }
    char msg[300];
    ok = gv_parse(buf, size, f, msg, sizeof msg);
    if (!ok && err && errlen) snprintf(err, errlen, "%s: %s", path, msg);
    free(buf);
    return ok;
}

const gv_array *gv_find(const gv_file *f, const char *name)
{
    if (!f || !name) return NULL;
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->arrays[i].name, name) == 0) return &f->arrays[i];
    return NULL;
}
