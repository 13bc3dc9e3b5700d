/*
 * crc32.c - CRC-32 (the IEEE 802.3 polynomial, reflected, as zlib and PNG
 * use), for the sections of every file memtrain writes; and the 64-bit
 * FNV-1a hash the ranks compare settings and weights by.
 */
#include "internal.h"

static uint32_t table[256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void make_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[i] = c;
    }
}

uint32_t mti_crc32(uint32_t crc, const void *data, size_t n)
{
    pthread_once(&table_once, make_table);
    const unsigned char *p = data;
    crc = ~crc;
    while (n--) crc = table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

uint64_t mti_hash(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
