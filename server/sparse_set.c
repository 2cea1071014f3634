/* sparse_set.c - the shard's sparse tables and their part of a push (sparse_set.h). */
#include "sparse_set.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sparse_set_free(sparse_set *s)
{
    for (int i = 0; i < s->n; i++)
        sparse_table_free(&s->t[i]);
    free(s->t);
    memset(s, 0, sizeof(*s));
}

/* Index of name, or -(insertion point) - 1. */
static int lookup(const sparse_set *s, const char *name, size_t len)
{
    int lo = 0, hi = s->n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = strncmp(s->t[mid].name, name, len);
        if (c == 0 && s->t[mid].name[len] != '\0')
            c = 1;
        if (c == 0)
            return mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -lo - 1;
}

int sparse_set_find(const sparse_set *s, const char *name)
{
    int i = lookup(s, name, strlen(name));
    return i >= 0 ? i : -1;
}

int sparse_set_declare(sparse_set *s, const char *name, const sparse_decl *d, int *created, char *err,
                       size_t errlen)
{
    int i = lookup(s, name, strlen(name));
    if (i >= 0) {
        if (!sparse_decl_equal(&s->t[i].d, d)) {
            snprintf(err, errlen, "sparse variable '%s' is declared already, with another declaration", name);
            return -2;
        }
        *created = 0;
        return 0;
    }
    if (s->n == s->cap) {
        int nc = s->cap ? 2 * s->cap : 4;
        sparse_table *nt = realloc(s->t, sizeof(*nt) * (size_t)nc);
        if (!nt)
            return -1;
        s->t = nt;
        s->cap = nc;
    }
    int at = -i - 1;
    sparse_table fresh;
    if (sparse_table_init(&fresh, name, d) != 0)
        return -1;
    memmove(&s->t[at + 1], &s->t[at], sizeof(sparse_table) * (size_t)(s->n - at));
    s->t[at] = fresh;
    s->n++;
    *created = 1;
    return 0;
}

static const char *suffix(const char *name)
{
    const char *c = strrchr(name, ':');
    return c && (strcmp(c, ":ids") == 0 || strcmp(c, ":values") == 0) ? c : NULL;
}

int sparse_tensor_name(const char *name)
{
    return suffix(name) != NULL;
}

int sparse_ids_tensor(const st_tensor *t)
{
    const char *sx = suffix(t->name);
    return sx && strcmp(sx, ":ids") == 0 && strcmp(t->dtype, "I64") == 0;
}

/* The other half of tensor k (ids for values, values for ids), or -1. */
static int other_half(const st_file *f, const char *name, size_t base, int want_ids)
{
    char buf[TENSOR_NAME_MAX + 16];
    if (base > TENSOR_NAME_MAX)
        return -1;
    snprintf(buf, sizeof(buf), "%.*s%s", (int)base, name, want_ids ? ":ids" : ":values");
    return st_find(f, buf);
}

static int one_piece(const sparse_set *s, const st_file *f, const unsigned char *data, int k,
                     sparse_piece *out, char *err, size_t errlen)
{
    const st_tensor *v = &f->tensors[k];
    size_t base = (size_t)(suffix(v->name) - v->name);
    int ti = lookup(s, v->name, base);
    if (ti < 0) {
        snprintf(err, errlen, "gradient for unknown sparse variable '%.*s'", (int)base, v->name);
        return -1;
    }
    const sparse_table *t = &s->t[ti];
    int ki = other_half(f, v->name, base, 1);
    if (ki < 0) {
        snprintf(err, errlen, "'%s' needs '%s:ids' beside it", v->name, t->name);
        return -1;
    }
    const st_tensor *ids = &f->tensors[ki];
    if (strcmp(ids->dtype, "I64") != 0 || ids->shape.ndim != 1) {
        snprintf(err, errlen, "'%s:ids' must be I64 [n], not %s of %d dimensions", t->name, ids->dtype,
                 ids->shape.ndim);
        return -1;
    }
    int64_t n = ids->shape.dims[0];
    if (strcmp(v->dtype, "F32") != 0 || v->shape.ndim != 2 || v->shape.dims[0] != n ||
        v->shape.dims[1] != t->d.dim) {
        char a[128];
        tensor_shape_format(&v->shape, a, sizeof(a));
        snprintf(err, errlen, "'%s' must be F32 [%lld, %d] (its ids' count, the table's dim), not %s [%s]",
                 v->name, (long long)n, t->d.dim, v->dtype, a);
        return -1;
    }
    if (sparse_check_ids(t, data + ids->begin, n, err, errlen) != 0)
        return -1;
    *out = (sparse_piece){ti, data + ids->begin, (const float *)(data + v->begin), n};
    return 0;
}

int sparse_set_pieces(const sparse_set *s, const st_file *f, const unsigned char *data,
                      sparse_piece **pieces, int *n, char *err, size_t errlen)
{
    *pieces = NULL;
    *n = 0;
    int want = 0;
    for (int k = 0; k < f->n_tensors; k++) {
        const char *sx = suffix(f->tensors[k].name);
        if (!sx)
            continue;
        size_t base = (size_t)(sx - f->tensors[k].name);
        if (strcmp(sx, ":ids") == 0) {
            if (other_half(f, f->tensors[k].name, base, 0) < 0) {
                snprintf(err, errlen, "'%s' needs '%.*s:values' beside it", f->tensors[k].name, (int)base,
                         f->tensors[k].name);
                return -1;
            }
            continue;
        }
        want++;
    }
    if (!want)
        return 0;
    sparse_piece *p = malloc(sizeof(*p) * (size_t)want);
    if (!p)
        return -2;
    int got = 0;
    for (int k = 0; k < f->n_tensors; k++) {
        const char *sx = suffix(f->tensors[k].name);
        if (!sx || strcmp(sx, ":values") != 0)
            continue;
        if (one_piece(s, f, data, k, &p[got], err, errlen) != 0) {
            free(p);
            return -1;
        }
        got++;
    }
    *pieces = p;
    *n = got;
    return 0;
}

void sparse_batch_free(sparse_batch *b)
{
    for (int i = 0; i < b->n; i++)
        sparse_acc_free(&b->acc[i]);
    free(b->acc);
    free(b->table);
    memset(b, 0, sizeof(*b));
}

int sparse_set_prepare(sparse_set *s, const sparse_piece *p, int n, const optim_config *c,
                       sparse_batch *b, char *err, size_t errlen)
{
    memset(b, 0, sizeof(*b));
    if (n == 0)
        return 0;
    b->table = malloc(sizeof(int) * (size_t)n);
    b->acc = calloc((size_t)n, sizeof(sparse_acc));
    if (!b->table || !b->acc) {
        sparse_batch_free(b);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        int at = 0;
        while (at < b->n && b->table[at] != p[i].table)
            at++;
        if (at == b->n) {
            b->table[at] = p[i].table;
            sparse_acc_init(&b->acc[at], s->t[p[i].table].d.dim);
            b->n++;
        }
        if (sparse_acc_add(&b->acc[at], p[i].ids, p[i].vals, p[i].n) != 0) {
            sparse_batch_free(b);
            return -1;
        }
    }
    for (int i = 0; i < b->n; i++) {
        sparse_table *t = &s->t[b->table[i]];
        int rc = sparse_ensure_slots(t, c) != 0 ? -1 : sparse_prepare(t, &b->acc[i], err, errlen);
        if (rc != 0) {
            sparse_batch_free(b);
            return rc;
        }
    }
    return 0;
}

void sparse_set_commit(sparse_set *s, sparse_batch *b, const optim_config *c, float scale, int64_t step)
{
    for (int i = 0; i < b->n; i++)
        sparse_apply(&s->t[b->table[i]], &b->acc[i], c, scale, step);
    sparse_batch_free(b);
}
