/* grad_slices.c - a dense variable's gradient given by element ids, made
 * dense before the push is applied (grad_slices.h). */
#include "grad_slices.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire_dtype.h"

/* NAME of "NAME:ids" / "NAME:values" into buf; the suffix's kind (1 ids,
 * 2 values), or 0 when t is neither. */
static int pair_name(const char *name, char *buf, size_t len)
{
    const char *c = strrchr(name, ':');
    int kind = !c ? 0 : strcmp(c, ":ids") == 0 ? 1 : strcmp(c, ":values") == 0 ? 2 : 0;
    if (!kind || (size_t)(c - name) >= len)
        return 0;
    memcpy(buf, name, (size_t)(c - name));
    buf[c - name] = '\0';
    return kind;
}

/* 1 when NAME is a dense variable of s (its shape into *shape), not a table. */
static int dense_var(store *s, const char *base, tensor_shape *shape)
{
    sparse_decl d;
    return store_sparse_peek(s, base, &d) != STORE_OK && store_peek(s, base, shape) == STORE_OK;
}

#define NAME_LEN (TENSOR_NAME_MAX + 16)

/* One pair: the ids' and the values' tensors and the variable's shape. */
typedef struct pair {
    int ids, vals;
    tensor_shape shape;
    int64_t numel;
} pair;

/* Every pair of f that names a dense variable into p (pair_of[k]: tensor k's
 * pair, or -1); how many, or -1 (err). */
static int find_pairs(store *s, const st_file *f, pair *p, int *pair_of, char *err, size_t errlen)
{
    int n = 0;
    for (int k = 0; k < f->n_tensors; k++)
        pair_of[k] = -1;
    for (int k = 0; k < f->n_tensors; k++) {
        char base[NAME_LEN], other[TENSOR_NAME_MAX + 24];
        tensor_shape shape;
        int kind = pair_name(f->tensors[k].name, base, sizeof(base));
        if (!kind || !dense_var(s, base, &shape))
            continue;
        snprintf(other, sizeof(other), "%s%s", base, kind == 1 ? ":values" : ":ids");
        int o = st_find(f, other);
        if (o < 0) {
            snprintf(err, errlen, "gradient '%s' has no '%s' beside it", f->tensors[k].name, other);
            return -1;
        }
        if (kind == 2)
            continue; /* counted from its ids */
        if (st_find(f, base) >= 0) {
            snprintf(err, errlen, "gradient '%s' is given twice: dense and by ids", base);
            return -1;
        }
        p[n] = (pair){k, o, shape, tensor_shape_numel(&shape)};
        pair_of[k] = pair_of[o] = n++;
    }
    return n;
}

/* Id k of an ids tensor's bytes (I64 when wide, else I32; any alignment). */
static int64_t id_at(const unsigned char *ids, int wide, int64_t k)
{
    if (wide) {
        int64_t id;
        memcpy(&id, ids + 8 * k, 8);
        return id;
    }
    int32_t id;
    memcpy(&id, ids + 4 * k, 4);
    return id;
}

/* The checks of one pair (its ids in range and distinct: seen is numel
 * bits, zeroed); 0 or -1 (err). */
static int check_pair(const st_file *f, const unsigned char *data, const pair *p, unsigned char *seen, char *err,
                      size_t errlen)
{
    const st_tensor *ti = &f->tensors[p->ids], *tv = &f->tensors[p->vals];
    int wide = strcmp(ti->dtype, "I64") == 0;
    if (!wide && strcmp(ti->dtype, "I32") != 0) {
        snprintf(err, errlen, "'%s' has dtype %s: ids are I64 or I32", ti->name, ti->dtype);
        return -1;
    }
    if (strcmp(tv->dtype, "F32") != 0 && strcmp(tv->dtype, "BF16") != 0) {
        snprintf(err, errlen, "'%s' has dtype %s: a dense variable's values by ids are F32 or BF16", tv->name,
                 tv->dtype);
        return -1;
    }
    if (ti->shape.ndim != 1 || tv->shape.ndim != 1 || ti->shape.dims[0] != tv->shape.dims[0]) {
        snprintf(err, errlen, "'%s' and '%s' must both have shape [n] with the same n (ids of the flattened elements)",
                 ti->name, tv->name);
        return -1;
    }
    int64_t n = ti->shape.dims[0];
    const unsigned char *ids = data + ti->begin;
    for (int64_t k = 0; k < n; k++) {
        int64_t id = id_at(ids, wide, k);
        if (id < 0 || id >= p->numel) {
            snprintf(err, errlen, "'%s' element %lld is %lld: outside 0..%lld", ti->name, (long long)k,
                     (long long)id, (long long)(p->numel - 1));
            return -1;
        }
        if (seen[id >> 3] & (1u << (id & 7))) {
            snprintf(err, errlen, "'%s' names element %lld twice", ti->name, (long long)id);
            return -1;
        }
        seen[id >> 3] |= (unsigned char)(1u << (id & 7));
    }
    return 0;
}

/* Pair p's dense float32 gradient into dst (numel floats, perhaps not
 * aligned: a BF16 tensor with an odd count may lie before it). */
static void scatter(const st_file *f, const unsigned char *data, const pair *p, unsigned char *dst)
{
    const st_tensor *ti = &f->tensors[p->ids], *tv = &f->tensors[p->vals];
    int wide = strcmp(ti->dtype, "I64") == 0, bf16 = strcmp(tv->dtype, "BF16") == 0;
    memset(dst, 0, (size_t)p->numel * 4);
    for (int64_t k = 0; k < ti->shape.dims[0]; k++) {
        int64_t id = id_at(data + ti->begin, wide, k);
        float v;
        if (bf16)
            wire_decode(WIRE_BF16, data + tv->begin + 2 * k, 1, 1.0f, &v);
        else
            memcpy(&v, data + tv->begin + 4 * k, 4);
        memcpy(dst + 4 * id, &v, 4);
    }
}

int grad_slices_densify(store *s, bufpool *pool, const st_file *f, const unsigned char *data, blob **out,
                        char *err, size_t errlen)
{
    *out = NULL;
    int any = 0; /* most pushes name no pair: nothing to allocate for them */
    for (int k = 0; k < f->n_tensors && !any; k++)
        any = strchr(f->tensors[k].name, ':') != NULL;
    if (!any)
        return 0;
    int nt = f->n_tensors ? f->n_tensors : 1;
    pair *p = malloc(sizeof(pair) * (size_t)nt);
    int *pair_of = malloc(sizeof(int) * (size_t)nt);
    st_desc *d = malloc(sizeof(st_desc) * (size_t)nt);
    const char **meta = malloc(sizeof(char *) * 2 * (size_t)(f->n_meta ? f->n_meta : 1));
    unsigned char *seen = NULL;
    char *head = NULL, *names = NULL;
    int rc = -2, n;
    if (!p || !pair_of || !d || !meta)
        goto done;
    if ((n = find_pairs(s, f, p, pair_of, err, errlen)) <= 0) {
        rc = n; /* 0: nothing to do, -1: refused */
        goto done;
    }
    /* the checks first, then the new header: tensors in f's order, a pair
     * one dense tensor where its ids were */
    int64_t most = 0;
    for (int i = 0; i < n; i++)
        most = p[i].numel > most ? p[i].numel : most;
    if (!(seen = malloc((size_t)(most + 7) / 8)))
        goto done;
    for (int i = 0; i < n; i++) {
        memset(seen, 0, (size_t)(p[i].numel + 7) / 8);
        if (check_pair(f, data, &p[i], seen, err, errlen) != 0) {
            rc = -1;
            goto done;
        }
    }
    if (!(names = malloc((size_t)n * NAME_LEN)))
        goto done;
    int nd = 0;
    size_t data_len = 0;
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
        int i = pair_of[k];
        if (i < 0) {
            d[nd++] = (st_desc){t->name, t->dtype, &t->shape};
            data_len += (size_t)(t->end - t->begin);
        } else if (p[i].ids == k) {
            pair_name(t->name, names + (size_t)i * NAME_LEN, NAME_LEN);
            d[nd++] = (st_desc){names + (size_t)i * NAME_LEN, "F32", &p[i].shape};
            data_len += (size_t)p[i].numel * 4;
        }
    }
    for (int m = 0; m < f->n_meta; m++) {
        meta[2 * m] = f->meta[m].key;
        meta[2 * m + 1] = f->meta[m].value;
    }
    size_t hl;
    if (st_header_build(d, nd, meta, f->n_meta, &head, &hl, err, errlen) != 0) {
        rc = -1;
        goto done;
    }
    blob *b = blob_new(pool, hl + data_len);
    if (!b)
        goto done;
    memcpy(b->data, head, hl);
    size_t at = hl;
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
        int i = pair_of[k];
        if (i < 0) {
            memcpy(b->data + at, data + t->begin, (size_t)(t->end - t->begin));
            at += (size_t)(t->end - t->begin);
        } else if (p[i].ids == k) {
            scatter(f, data, &p[i], b->data + at);
            at += (size_t)p[i].numel * 4;
        }
    }
    b->len = at;
    *out = b;
    rc = 0;
done:
    if (rc == -2)
        snprintf(err, errlen, "out of memory making a gradient by ids dense");
    free(p);
    free(pair_of);
    free(d);
    free(meta);
    free(seen);
    free(head);
    free(names);
    return rc;
}
