/* flags.c - parse --name=value flags against a table. */
#include "flags.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static int set_value(flag *f, const char *v, char *err, size_t errlen)
{
    char *end;
    errno = 0;
    switch (f->type) {
    case FLAG_STRING:
        *(const char **)f->value = v;
        return 0;
    case FLAG_INT: {
        long x = strtol(v, &end, 10);
        if (!*v || *end || errno || x < -2147483647L || x > 2147483647L)
            break;
        *(int *)f->value = (int)x;
        return 0;
    }
    case FLAG_U64: {
        if (*v < '0' || *v > '9')
            break;
        unsigned long long x = strtoull(v, &end, 10);
        if (*end || errno)
            break;
        *(uint64_t *)f->value = x;
        return 0;
    }
    case FLAG_FLOAT: {
        float x = strtof(v, &end);
        if (!*v || *end || errno || !isfinite(x))
            break;
        *(float *)f->value = x;
        return 0;
    }
    case FLAG_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "yes")) {
            *(int *)f->value = 1;
            return 0;
        }
        if (!strcmp(v, "false") || !strcmp(v, "0") || !strcmp(v, "no")) {
            *(int *)f->value = 0;
            return 0;
        }
        break;
    }
    snprintf(err, errlen, "--%s: bad value '%s'", f->name, v);
    return -1;
}

int flags_parse(flag *flags, int n, int argc, char **argv, char *err, size_t errlen)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h"))
            return 1;
        if (strncmp(a, "--", 2) != 0) {
            snprintf(err, errlen, "unexpected argument '%s' (flags look like --name=value)", a);
            return -1;
        }
        a += 2;
        const char *eq = strchr(a, '=');
        size_t nl = eq ? (size_t)(eq - a) : strlen(a);
        flag *f = NULL;
        for (int k = 0; k < n; k++)
            if (strlen(flags[k].name) == nl && !strncmp(flags[k].name, a, nl))
                f = &flags[k];
        if (!f) {
            snprintf(err, errlen, "unknown flag '--%.*s' (see --help)", (int)nl, a);
            return -1;
        }
        const char *v = eq ? eq + 1 : NULL;
        if (!v) {
            if (f->type == FLAG_BOOL) {
                v = "true";
            } else if (i + 1 < argc) {
                v = argv[++i];
            } else {
                snprintf(err, errlen, "--%s needs a value", f->name);
                return -1;
            }
        }
        if (set_value(f, v, err, errlen) != 0)
            return -1;
        f->given = 1;
    }
    return 0;
}

void flags_help(FILE *out, const char *usage, const flag *flags, int n)
{
    fprintf(out, "%s\n\nFlags:\n", usage);
    for (int k = 0; k < n; k++) {
        const char *t = flags[k].type == FLAG_BOOL ? "" : flags[k].type == FLAG_STRING ? "=S"
                        : flags[k].type == FLAG_FLOAT                               ? "=X"
                                                                                     : "=N";
        char left[64];
        snprintf(left, sizeof(left), "--%s%s", flags[k].name, t);
        fprintf(out, "  %-26s %s\n", left, flags[k].help);
    }
}

const flag *flags_get(const flag *flags, int n, const char *name)
{
    for (int k = 0; k < n; k++)
        if (!strcmp(flags[k].name, name))
            return &flags[k];
    return NULL;
}
