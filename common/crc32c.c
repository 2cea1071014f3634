/* crc32c.c - CRC-32C, hardware instruction or slice-by-8 tables. */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

static uint32_t table[8][256];
static int have_hw;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2");
#endif
}

static uint32_t sw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c; /* little-endian */
        c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
            table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
            table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t hw(uint32_t c, const unsigned char *p, size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = __builtin_ia32_crc32di(c64, w);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
#endif

uint32_t crc32c_update(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&once, init);
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (have_hw)
        return ~hw(c, buf, len);
#endif
    return ~sw(c, buf, len);
}
