/*
 * golden.h - reader of the golden vector files (the .gv files in
 * test/golden/) that test/golden/gen.py writes with PyTorch. The format is
 * described at the top of gen.py: a magic, a header text, named
 * n-dimensional arrays, and a CRC-32 of everything before it.
 *
 * The reader trusts nothing in a file: every length is checked against the
 * bytes that are there before it is used, sizes are checked for overflow,
 * and a file that fails any check is refused whole with a message saying
 * what was wrong and where. It never aborts.
 */
#ifndef MT_TEST_GOLDEN_H
#define MT_TEST_GOLDEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GV_MAX_RANK 4
#define GV_MAX_NAME 64
#define GV_MAX_HEADER 4096
#define GV_MAX_ARRAYS 4096
#define GV_MAX_FILE (64u << 20) /* the committed files are far smaller */

/* Element types; the numbers are the file's codes. fp16 and bf16 hold raw
 * 16-bit patterns. */
typedef enum gv_dtype { GV_F32 = 0, GV_F16 = 1, GV_BF16 = 2, GV_I32 = 3, GV_U8 = 4 } gv_dtype;

typedef struct gv_array {
    char name[GV_MAX_NAME + 1];
    gv_dtype dtype;
    int rank;
    int64_t dims[GV_MAX_RANK];
    size_t numel;  /* product of dims (1 for rank 0) */
    void *data;    /* numel elements, malloc'd, so aligned for any dtype */
} gv_array;

typedef struct gv_file {
    char *header; /* the header text, NUL-terminated */
    int n;
    gv_array *arrays;
} gv_file;

/* Parses a file image. On failure returns false, writes a message into err
 * (errlen bytes, may be 0) and leaves *f empty; gv_free on it is harmless. */
bool gv_parse(const unsigned char *buf, size_t size, gv_file *f, char *err, size_t errlen);
/* Reads and parses the file at path (at most GV_MAX_FILE bytes). */
bool gv_load(const char *path, gv_file *f, char *err, size_t errlen);
void gv_free(gv_file *f);

/* The array called name, or NULL. */
const gv_array *gv_find(const gv_file *f, const char *name);

size_t gv_dtype_size(gv_dtype t); /* 0 for an unknown code */
const char *gv_dtype_name(gv_dtype t);

/* Where the golden files are: $MT_GOLDEN_DIR if set, else "test/golden"
 * (the tests run from the repository root). */
const char *gv_dir(void);

/* CRC-32 (IEEE, as zlib), continuing from crc (start with 0); the reader's
 * own, so it stands alone. */
uint32_t gv_crc32(uint32_t crc, const void *data, size_t n);

#endif /* MT_TEST_GOLDEN_H */
