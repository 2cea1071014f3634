/* fuzz_util.h - helpers shared by the libFuzzer harnesses. */
#ifndef RESTPS_FUZZ_UTIL_H
#define RESTPS_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* The readers take a path: put the bytes in an anonymous in-memory file and
 * name it /proc/self/fd/N (no disk, nothing left behind). The fd, or -1. */
static inline int fuzz_memfile(const void *data, size_t size, char *path, size_t cap)
{
    int fd = memfd_create("fuzz", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    const char *p = data;
    size_t done = 0;
    while (done < size) {
        ssize_t w = write(fd, p + done, size - done);
        if (w <= 0) {
            close(fd);
            return -1;
        }
        done += (size_t)w;
    }
    snprintf(path, cap, "/proc/self/fd/%d", fd);
    return fd;
}

/* A harness's own invariant broke: report and abort (libFuzzer saves the input). */
#define FUZZ_CHECK(cond)                                                               \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                   \
        }                                                                              \
    } while (0)

/* Split data at the first `sep` into a NUL-terminated malloc'd field; advances
 * *data and *size past it. The rest goes into the last field. */
static inline char *fuzz_field(const uint8_t **data, size_t *size, char sep)
{
    const uint8_t *e = *size ? memchr(*data, sep, *size) : NULL;
    size_t n = e ? (size_t)(e - *data) : *size;
    char *s = malloc(n + 1);
    if (!s)
        abort();
    if (n)
        memcpy(s, *data, n);
    s[n] = '\0';
    *data += e ? n + 1 : n;
    *size -= e ? n + 1 : n;
    return s;
}

#endif
