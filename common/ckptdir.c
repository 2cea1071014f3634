/* ckptdir.c - a folder of checkpoints: names, listing newest first, mkdir -p,
 * leftover temp files, pruning (see ckptdir.h). */
#include "ckptdir.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "safetensors.h"

int ckptdir_path(const char *dir, int64_t step, char *out, size_t cap)
{
    int k = snprintf(out, cap, "%s/" CKPT_PREFIX "%lld" CKPT_SUFFIX, dir, (long long)step);
    return k < 0 || (size_t)k >= cap ? CKPT_EWRITE : 0;
}

int ckptdir_step(const char *name, int64_t *step)
{
    size_t pl = strlen(CKPT_PREFIX), sl = strlen(CKPT_SUFFIX), n = strlen(name);
    if (n <= pl + sl || strncmp(name, CKPT_PREFIX, pl) != 0 || strcmp(name + n - sl, CKPT_SUFFIX) != 0)
        return CKPT_EINVALID;
    int64_t v = 0;
    for (size_t i = pl; i < n - sl; i++) {
        if (name[i] < '0' || name[i] > '9')
            return CKPT_EINVALID;
        int d = name[i] - '0';
        if (v > (INT64_MAX - d) / 10)
            return CKPT_EINVALID;
        v = v * 10 + d;
    }
    *step = v;
    return 0;
}

static int entry_cmp(const void *a, const void *b)
{
    const ckptdir_entry *x = a, *y = b;
    if (x->step != y->step)
        return x->step < y->step ? 1 : -1;
    return strcmp(x->path, y->path);
}

int ckptdir_list(const char *dir, ckptdir_entry **out, int *n, char *err, size_t errlen)
{
    *out = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT)
            return 0;
        snprintf(err, errlen, "cannot read '%s': %s", dir, strerror(errno));
        return CKPT_EREAD;
    }
    ckptdir_entry *v = NULL;
    int cnt = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t step;
        if (ckptdir_step(e->d_name, &step) != 0)
            continue;
        if (cnt == cap) {
            if (cap > INT_MAX / 2)
                goto oom;
            cap = cap ? 2 * cap : 16;
            ckptdir_entry *nv = realloc(v, sizeof(*v) * (size_t)cap);
            if (!nv)
                goto oom;
            v = nv;
        }
        if (asprintf(&v[cnt].path, "%s/%s", dir, e->d_name) < 0)
            goto oom;
        v[cnt++].step = step;
    }
    closedir(d);
    if (cnt > 1)
        qsort(v, (size_t)cnt, sizeof(*v), entry_cmp);
    *out = v;
    *n = cnt;
    return 0;
oom:
    closedir(d);
    ckptdir_list_free(v, cnt);
    snprintf(err, errlen, "out of memory listing '%s'", dir);
    return CKPT_EREAD;
}

void ckptdir_list_free(ckptdir_entry *e, int n)
{
    for (int i = 0; i < n; i++)
        free(e[i].path);
    free(e);
}

int ckptdir_make(const char *dir, char *err, size_t errlen)
{
    char p[PATH_MAX];
    if (snprintf(p, sizeof(p), "%s", dir) >= (int)sizeof(p)) {
        snprintf(err, errlen, "cannot create '%.64s...': path too long", dir);
        return CKPT_EWRITE;
    }
    /* every parent, then dir itself */
    for (char *s = p[0] ? p + 1 : p;; s++) {
        if (*s != '/' && *s != '\0')
            continue;
        char c = *s;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            snprintf(err, errlen, "cannot create '%s': %s", p, strerror(errno));
            return CKPT_EWRITE;
        }
        *s = c;
        if (!c)
            break;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "'%s' is not a folder", dir);
        return CKPT_EWRITE;
    }
    return 0;
}

int ckptdir_remove_temps(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, CKPT_PREFIX, strlen(CKPT_PREFIX)) != 0 ||
            !strstr(e->d_name, CKPT_SUFFIX ST_TEMP_INFIX))
            continue;
        char *p;
        if (asprintf(&p, "%s/%s", dir, e->d_name) < 0)
            continue;
        if (unlink(p) == 0)
            removed++;
        free(p);
    }
    closedir(d);
    return removed;
}

int ckptdir_prune(const char *dir, int keep, int64_t newest)
{
    ckptdir_entry *e;
    int n, removed = 0, kept = 0;
    char err[256];
    if (keep <= 0 || ckptdir_list(dir, &e, &n, err, sizeof(err)) != 0)
        return 0;
    for (int i = 0; i < n; i++) {
        if (e[i].step > newest || ++kept <= keep)
            continue;
        if (unlink(e[i].path) == 0)
            removed++;
    }
    ckptdir_list_free(e, n);
    return removed;
}

static const char *entry_kind(mode_t m)
{
    return S_ISDIR(m) ? "not a regular file (a folder)" : S_ISFIFO(m) ? "not a regular file (a fifo)"
         : S_ISLNK(m) ? "not a regular file (a symbolic link)" : "not a regular file";
}

int ckptdir_prune_owned(const char *dir, int keep, const char *protect,
                        int (*owned)(const char *path, char *why, size_t whylen, void *ctx),
                        void (*skipped)(const char *path, const char *why, void *ctx), void *ctx)
{
    ckptdir_entry *e;
    int n, removed = 0, kept = 0;
    char err[256];
    if (keep <= 0 || ckptdir_list(dir, &e, &n, err, sizeof(err)) != 0)
        return 0;
    for (int i = 0; i < n; i++) {
        struct stat st;
        char why[512] = "";
        if (lstat(e[i].path, &st) != 0) {
            if (skipped)
                skipped(e[i].path, strerror(errno), ctx);
            continue;
        }
        if (!S_ISREG(st.st_mode)) {
            if (skipped)
                skipped(e[i].path, entry_kind(st.st_mode), ctx);
            continue;
        }
        if (owned(e[i].path, why, sizeof(why), ctx) != 1) {
            if (skipped)
                skipped(e[i].path, why[0] ? why : "not this task's", ctx);
            continue;
        }
        if (++kept <= keep || (protect && strcmp(e[i].path, protect) == 0))
            continue;
        if (unlink(e[i].path) == 0)
            removed++;
    }
    ckptdir_list_free(e, n);
    return removed;
}
