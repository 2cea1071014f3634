/* flags.c - parse --name=value flags against a table. */
#include "flags.h"

#include <ctype.h>
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

/* The optimal-string-alignment distance (Damerau-Levenshtein: insertions,
 * deletions, substitutions and swaps of two neighbours, each 1) between a
 * (al bytes) and b, ignoring case; more than FLAG_NEAR_MAX once it is sure. */
#define FLAG_NEAR_MAX 2
#define FLAG_NAME_CMP 64
static int distance(const char *a, size_t al, const char *b)
{
    size_t bl = strlen(b);
    if (al > FLAG_NAME_CMP || bl > FLAG_NAME_CMP)
        return FLAG_NEAR_MAX + 1;
    if ((al > bl ? al - bl : bl - al) > FLAG_NEAR_MAX)
        return FLAG_NEAR_MAX + 1;
    int rows[3][FLAG_NAME_CMP + 1];
    int *pp = rows[0], *prev = rows[1], *cur = rows[2];
    for (size_t j = 0; j <= bl; j++)
        prev[j] = (int)j;
    for (size_t i = 1; i <= al; i++) {
        cur[0] = (int)i;
        for (size_t j = 1; j <= bl; j++) {
            int ca = tolower((unsigned char)a[i - 1]), cb = tolower((unsigned char)b[j - 1]);
            int d = prev[j - 1] + (ca != cb);
            if (prev[j] + 1 < d)
                d = prev[j] + 1;
            if (cur[j - 1] + 1 < d)
                d = cur[j - 1] + 1;
            if (i > 1 && j > 1 && ca == tolower((unsigned char)b[j - 2]) &&
                tolower((unsigned char)a[i - 2]) == cb && pp[j - 2] + 1 < d)
                d = pp[j - 2] + 1;
            cur[j] = d;
        }
        int *t = pp;
        pp = prev;
        prev = cur;
        cur = t;
    }
    return prev[bl];
}

const flag *flags_nearest(const flag *flags, int n, const char *name, size_t len)
{
    /* at most 2 edits, and at most a third of the name (at least 1): "--nope"
     * is not a misspelt "--port" */
    int limit = (int)(len / 3);
    if (limit < 1)
        limit = 1;
    if (limit > FLAG_NEAR_MAX)
        limit = FLAG_NEAR_MAX;
    const flag *best = NULL;
    int best_d = limit + 1;
    for (int k = 0; k < n; k++) {
        int d = distance(name, len, flags[k].name);
        if (d < best_d) {
            best = &flags[k];
            best_d = d;
        }
    }
    return best;
}

/* prog NULL: the hint is "(see --help)", on an unknown flag only. */
static int parse(const char *prog, flag *flags, int n, int argc, char **argv, char *err, size_t errlen)
{
    const char *sp = prog ? prog : "", *gap = prog ? " " : "";
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
            const flag *near = flags_nearest(flags, n, a, nl);
            if (near)
                snprintf(err, errlen, "unknown flag '--%.*s' (did you mean --%s? see %s%s--help)", (int)nl, a,
                         near->name, sp, gap);
            else
                snprintf(err, errlen, "unknown flag '--%.*s' (see %s%s--help)", (int)nl, a, sp, gap);
            return -2; /* the hint is in it */
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

int flags_parse(flag *flags, int n, int argc, char **argv, char *err, size_t errlen)
{
    int rc = parse(NULL, flags, n, argc, argv, err, errlen);
    return rc < 0 ? -1 : rc;
}

int flags_parse_prog(const char *prog, flag *flags, int n, int argc, char **argv, char *err, size_t errlen)
{
    int rc = parse(prog, flags, n, argc, argv, err, errlen);
    if (rc == -1) {
        size_t l = strlen(err);
        if (l < errlen)
            snprintf(err + l, errlen - l, " (see %s --help)", prog);
    }
    return rc < 0 ? -1 : rc;
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
