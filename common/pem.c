/* pem.c - see pem.h. */
#include "pem.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PEM_MAX (1u << 20)

char *pem_read(const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    /* one byte more than allowed: a file that fills it is too large */
    char *buf = malloc(PEM_MAX + 2);
    size_t len = buf ? fread(buf, 1, PEM_MAX + 1, f) : 0;
    int bad = ferror(f);
    fclose(f);
    const char *why = !buf ? "out of memory"
                      : bad ? "read error"
                      : len > PEM_MAX ? "larger than 1 MiB: not a PEM file"
                      : NULL;
    if (!why) {
        buf[len] = '\0';
        if (!strstr(buf, "-----BEGIN "))
            why = "not a PEM file (no -----BEGIN line)";
    }
    if (why) {
        snprintf(err, errlen, "%s: %s", path, why);
        free(buf);
        return NULL;
    }
    return buf;
}
