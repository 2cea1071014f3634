/* sync_agg.c - sync training's aggregation and the push ids (see sync_agg.h). */
#include "sync_agg.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"

void sync_agg_free(sync_agg *a)
{
    sync_agg_clear(a);
    free(a->grads);
    free(a->sum);
    a->grads = NULL;
    a->sum = NULL;
    a->cap = 0;
    a->sum_cap = 0;
}

int sync_agg_has(const sync_agg *a, int worker)
{
    for (int i = 0; i < a->n; i++)
        if (a->grads[i].worker == worker)
            return 1;
    return 0;
}

/* The tensors of f (names, dtypes, shapes, offsets), no metadata. */
static int copy_tensors(const st_file *f, st_file *out)
{
    memset(out, 0, sizeof(*out));
    out->tensors = calloc((size_t)(f->n_tensors ? f->n_tensors : 1), sizeof(st_tensor));
    if (!out->tensors)
        return -1;
    for (int k = 0; k < f->n_tensors; k++) {
        out->tensors[k] = f->tensors[k];
        if (!(out->tensors[k].name = strdup(f->tensors[k].name))) {
            out->n_tensors = k;
            st_file_free(out);
            return -1;
        }
    }
    out->n_tensors = f->n_tensors;
    out->header_len = f->header_len;
    out->data_start = f->data_start;
    out->data_len = f->data_len;
    return 0;
}

int sync_agg_add(sync_agg *a, int worker, blob *body, const st_file *f, const unsigned char *data,
                 int has_loss, double loss)
{
    int at = 0;
    while (at < a->n && a->grads[at].worker < worker)
        at++;
    if (at < a->n && a->grads[at].worker == worker)
        return 1;
    if (a->n == a->cap) {
        int nc = a->cap ? 2 * a->cap : 8;
        sync_grad *ng = realloc(a->grads, sizeof(*ng) * (size_t)nc);
        if (!ng)
            return -1;
        a->grads = ng;
        a->cap = nc;
    }
    st_file copy;
    if (copy_tensors(f, &copy) != 0)
        return -1;
    memmove(&a->grads[at + 1], &a->grads[at], sizeof(sync_grad) * (size_t)(a->n - at));
    a->grads[at] = (sync_grad){worker, blob_ref(body), copy, data, has_loss, loss};
    if (a->n++ == 0)
        a->first_ms = clk_mono_ms();
    return 0;
}

void sync_agg_clear(sync_agg *a)
{
    for (int i = 0; i < a->n; i++) {
        blob_unref(a->grads[i].body);
        st_file_free(&a->grads[i].f);
    }
    a->n = 0;
    a->first_ms = 0;
}

/* The index of name with shape in g's tensors, or -1. */
static int tensor_of(const sync_grad *g, const char *name, const tensor_shape *shape)
{
    int t = st_find(&g->f, name);
    return t >= 0 && tensor_shape_equal(&g->f.tensors[t].shape, shape) ? t : -1;
}

int sync_agg_count(const sync_agg *a, const char *name, const tensor_shape *shape)
{
    int c = 0;
    for (int p = 0; p < a->n; p++)
        c += tensor_of(&a->grads[p], name, shape) >= 0;
    return c;
}

int sync_agg_reserve(sync_agg *a, int64_t numel)
{
    if ((size_t)numel <= a->sum_cap)
        return 0;
    float *s = realloc(a->sum, (size_t)numel * sizeof(float));
    if (!s)
        return -1;
    a->sum = s;
    a->sum_cap = (size_t)numel;
    return 0;
}

const float *sync_agg_sum(sync_agg *a, const char *name, const tensor_shape *shape, int64_t numel,
                          int *count)
{
    *count = 0;
    if ((size_t)numel > a->sum_cap)
        return NULL; /* not reserved */
    for (int p = 0; p < a->n; p++) {
        const sync_grad *g = &a->grads[p];
        int t = tensor_of(g, name, shape);
        if (t < 0)
            continue;
        const float *x = (const float *)(g->data + g->f.tensors[t].begin);
        if ((*count)++ == 0)
            memcpy(a->sum, x, (size_t)numel * 4);
        else
            for (int64_t e = 0; e < numel; e++)
                a->sum[e] += x[e];
    }
    return *count ? a->sum : NULL;
}

int sync_agg_mean_loss(const sync_agg *a, double *loss)
{
    double sum = 0;
    int n = 0;
    for (int p = 0; p < a->n; p++)
        if (a->grads[p].has_loss) {
            sum += a->grads[p].loss;
            n++;
        }
    if (n)
        *loss = sum / n;
    return n > 0;
}

void sync_agg_remember(sync_agg *a, const char *id, int64_t step)
{
    if (!id)
        return;
    snprintf(a->ids[a->id_next].id, sizeof(a->ids[0].id), "%s", id);
    a->ids[a->id_next].step = step;
    a->id_next = (a->id_next + 1) % SYNC_PUSH_IDS;
}

int sync_agg_seen(const sync_agg *a, const char *id, int64_t *step)
{
    for (int i = 0; i < SYNC_PUSH_IDS; i++)
        if (a->ids[i].id[0] && strcmp(a->ids[i].id, id) == 0) {
            *step = a->ids[i].step;
            return 1;
        }
    return 0;
}
