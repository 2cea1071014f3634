/* etag.c - entity tags (etag.h). */
#include "etag.h"

#include <stdio.h>
#include <string.h>

int etag_matches(const char *inm, const char *etag)
{
    if (!inm)
        return 0;
    size_t el = strlen(etag);
    for (const char *p = inm; *p;) {
        while (*p == ' ' || *p == ',')
            p++;
        if (p[0] == 'W' && p[1] == '/')
            p += 2;
        const char *e = p;
        while (*e && *e != ',')
            e++;
        size_t l = (size_t)(e - p);
        while (l && p[l - 1] == ' ')
            l--;
        if ((l == 1 && *p == '*') || (l == el && memcmp(p, etag, el) == 0))
            return 1;
        p = e;
    }
    return 0;
}

/* FNV-1a, 64 bits: the tag tells versions apart, it guards against no one */
static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

void etag_of_params(char *out, size_t cap, const char *instance, const store_snap *v, int n, int64_t step,
                    wire_dtype dt, int avg)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int i = 0; i < n; i++) {
        h = fnv(h, v[i].name, strlen(v[i].name) + 1); /* the NUL: "a" "bc" is not "ab" "c" */
        h = fnv(h, &v[i].version, sizeof(v[i].version));
        h = fnv(h, &v[i].numel, sizeof(v[i].numel));
    }
    snprintf(out, cap, "\"%s-%lld-%016llx%s%s%s\"", instance, (long long)step, (unsigned long long)h,
             dt == WIRE_F32 ? "" : "-", dt == WIRE_F32 ? "" : wire_dtype_name(dt), avg ? "-avg" : "");
}
