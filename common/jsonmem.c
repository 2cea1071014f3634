/* jsonmem.c - jansson when memory runs out (jsonmem.h). */
#include "jsonmem.h"

#include <stdlib.h>
#include <string.h>

static __thread unsigned long failed_allocs;

static void *counted_malloc(size_t n)
{
    void *p = malloc(n);
    if (!p)
        failed_allocs++;
    return p;
}

__attribute__((constructor)) static void jsonmem_init(void)
{
    json_set_alloc_funcs(counted_malloc, free);
}

unsigned long json_failed_allocs(void)
{
    return failed_allocs;
}

struct out {
    char *buf;
    size_t len, cap;
    int failed; /* sticky: jansson may ignore one -1 and call again */
};

static int put(const char *s, size_t n, void *data)
{
    struct out *o = data;
    if (o->failed)
        return -1;
    if (o->len + n + 1 > o->cap) {
        size_t cap = o->cap ? o->cap : 256;
        while (cap < o->len + n + 1)
            cap *= 2;
        char *b = realloc(o->buf, cap);
        if (!b) {
            o->failed = 1;
            return -1;
        }
        o->buf = b;
        o->cap = cap;
    }
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    o->buf[o->len] = '\0';
    return 0;
}

char *json_dumps_checked(const json_t *j, size_t flags)
{
    struct out o = {0};
    unsigned long before = failed_allocs;
    if (!j || json_dump_callback(j, put, &o, flags) != 0 || o.failed || !o.buf ||
        failed_allocs != before) {
        free(o.buf);
        return NULL;
    }
    return o.buf;
}
