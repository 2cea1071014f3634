/* store.c - the shard's variables, their versions and updates. */
#include "store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int store_init(store *s, float learning_rate, bufpool *pool)
{
    memset(s, 0, sizeof(*s));
    /* writers first: a stream of pulls must not hold off the pushes */
    pthread_rwlockattr_t a;
    pthread_rwlockattr_init(&a);
    pthread_rwlockattr_setkind_np(&a, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    int bad = pthread_rwlock_init(&s->lock, &a) != 0;
    pthread_rwlockattr_destroy(&a);
    if (bad)
        return STORE_ENOMEM;
    s->learning_rate = learning_rate;
    s->pool = pool;
    return STORE_OK;
}

void store_destroy(store *s)
{
    for (int i = 0; i < s->n; i++)
        blob_unref(s->vars[i].data);
    free(s->vars);
    pthread_rwlock_destroy(&s->lock);
}

/* Index of name, or -(insertion point) - 1. Caller holds the lock. */
static int find(const store *s, const char *name)
{
    int lo = 0, hi = s->n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = strcmp(s->vars[mid].name, name);
        if (c == 0)
            return mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -lo - 1;
}

static void snap_of(const store_var *v, store_snap *out)
{
    memcpy(out->name, v->name, sizeof(out->name));
    out->shape = v->shape;
    out->numel = v->numel;
    out->version = v->version;
    out->data = blob_ref(v->data);
}

int store_get(store *s, const char *name, store_snap *out)
{
    pthread_rwlock_rdlock(&s->lock);
    int i = find(s, name);
    if (i >= 0)
        snap_of(&s->vars[i], out);
    pthread_rwlock_unlock(&s->lock);
    return i >= 0 ? STORE_OK : STORE_ENOENT;
}

void store_snap_release(store_snap *snap)
{
    blob_unref(snap->data);
    snap->data = NULL;
}

int store_peek(store *s, const char *name, tensor_shape *shape)
{
    pthread_rwlock_rdlock(&s->lock);
    int i = find(s, name);
    if (i >= 0 && shape)
        *shape = s->vars[i].shape;
    pthread_rwlock_unlock(&s->lock);
    return i >= 0 ? STORE_OK : STORE_ENOENT;
}

int store_get_all(store *s, store_snap **out, int *n, int64_t *global_step)
{
    pthread_rwlock_rdlock(&s->lock);
    store_snap *v = malloc(sizeof(store_snap) * (size_t)(s->n ? s->n : 1));
    if (!v) {
        pthread_rwlock_unlock(&s->lock);
        return STORE_ENOMEM;
    }
    for (int i = 0; i < s->n; i++)
        snap_of(&s->vars[i], &v[i]);
    *n = s->n;
    *global_step = s->global_step;
    pthread_rwlock_unlock(&s->lock);
    *out = v;
    return STORE_OK;
}

void store_snaps_release(store_snap *snaps, int n)
{
    for (int i = 0; i < n; i++)
        blob_unref(snaps[i].data);
    free(snaps);
}

/* Idle buffers kept for reuse: at most half the stored bytes plus 16 MiB. */
static void pool_follow(store *s, uint64_t bytes)
{
    if (s->pool)
        bufpool_set_limit(s->pool, (size_t)(bytes / 2) + ((size_t)16 << 20));
}

int store_put(store *s, const char *name, const tensor_shape *shape, blob *data,
              int only_create, int *created, uint64_t *version)
{
    int64_t numel = tensor_shape_numel(shape);
    if (data->len != (size_t)numel * 4)
        return STORE_ESHAPE;
    pthread_rwlock_wrlock(&s->lock);
    int i = find(s, name);
    if (i >= 0) {
        if (only_create) {
            pthread_rwlock_unlock(&s->lock);
            return STORE_EEXIST;
        }
        store_var *v = &s->vars[i];
        blob *old = v->data;
        s->bytes = s->bytes - (uint64_t)v->numel * 4 + (uint64_t)numel * 4;
        v->data = data;
        v->shape = *shape;
        v->numel = numel;
        v->version++;
        *version = v->version;
        *created = 0;
        uint64_t bytes = s->bytes;
        pthread_rwlock_unlock(&s->lock);
        blob_unref(old);
        pool_follow(s, bytes);
        return STORE_OK;
    }
    if (s->n == s->cap) {
        int nc = s->cap ? s->cap * 2 : 16;
        store_var *nv = realloc(s->vars, sizeof(store_var) * (size_t)nc);
        if (!nv) {
            pthread_rwlock_unlock(&s->lock);
            return STORE_ENOMEM;
        }
        s->vars = nv;
        s->cap = nc;
    }
    i = -i - 1;
    memmove(&s->vars[i + 1], &s->vars[i], sizeof(store_var) * (size_t)(s->n - i));
    store_var *v = &s->vars[i];
    memset(v, 0, sizeof(*v));
    snprintf(v->name, sizeof(v->name), "%s", name);
    v->shape = *shape;
    v->numel = numel;
    v->version = 1;
    v->data = data;
    s->n++;
    s->bytes += (uint64_t)numel * 4;
    *version = 1;
    *created = 1;
    uint64_t bytes = s->bytes;
    pthread_rwlock_unlock(&s->lock);
    pool_follow(s, bytes);
    return STORE_OK;
}

/* v <- v - lr * g, written into dst: v's own blob when the store holds the only
 * reference, else a fresh blob (readers keep the old version). Caller holds
 * the write lock. */
static void sgd_into(store *s, store_var *v, blob *dst, const float *g)
{
    const float *w = (const float *)v->data->data;
    float *out = (float *)dst->data, lr = s->learning_rate;
    for (int64_t i = 0; i < v->numel; i++)
        out[i] = w[i] - lr * g[i];
    if (dst != v->data) {
        blob_unref(v->data);
        v->data = dst;
    }
    v->version++;
}

/* The blob the next version of v is written into, or NULL when out of memory. */
static blob *writable(store *s, store_var *v)
{
    if (atomic_load(&v->data->refs) == 1)
        return v->data;
    return blob_new(s->pool, (size_t)v->numel * 4);
}

int store_apply_grad(store *s, const char *name, const float *g, int64_t numel,
                     int64_t *global_step, uint64_t *version)
{
    pthread_rwlock_wrlock(&s->lock);
    int i = find(s, name), rc = STORE_OK;
    if (i < 0)
        rc = STORE_ENOENT;
    else if (s->vars[i].numel != numel)
        rc = STORE_ESHAPE;
    else {
        blob *dst = writable(s, &s->vars[i]);
        if (!dst) {
            pthread_rwlock_unlock(&s->lock);
            return STORE_ENOMEM;
        }
        sgd_into(s, &s->vars[i], dst, g);
        *global_step = ++s->global_step;
        *version = s->vars[i].version;
    }
    pthread_rwlock_unlock(&s->lock);
    return rc;
}

static int push_seen(const store *s, const char *id, int64_t *step)
{
    for (int i = 0; i < STORE_PUSH_IDS; i++)
        if (s->pushes[i].id[0] && strcmp(s->pushes[i].id, id) == 0) {
            *step = s->pushes[i].step;
            return 1;
        }
    return 0;
}

int store_apply_grads(store *s, const st_file *f, const unsigned char *data,
                      const store_push_meta *meta, int64_t *global_step, int *duplicate,
                      char *err, size_t errlen)
{
    *duplicate = 0;
    if (f->n_tensors == 0) {
        snprintf(err, errlen, "push holds no gradients");
        return STORE_EINVAL;
    }
    for (int k = 0; k < f->n_tensors; k++)
        if (strcmp(f->tensors[k].dtype, "F32") != 0) {
            snprintf(err, errlen, "gradient '%s' has dtype %s, only F32 is accepted",
                     f->tensors[k].name, f->tensors[k].dtype);
            return STORE_EINVAL;
        }
    pthread_rwlock_wrlock(&s->lock);
    int rc = STORE_OK;
    if (meta->push_id && push_seen(s, meta->push_id, global_step)) {
        *duplicate = 1;
        goto out;
    }
    /* Check everything before changing anything. */
    int *idx = malloc(sizeof(int) * (size_t)f->n_tensors);
    if (!idx) {
        rc = STORE_ENOMEM;
        goto out;
    }
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
        int i = find(s, t->name);
        if (i < 0) {
            snprintf(err, errlen, "gradient for unknown variable '%s'", t->name);
            rc = STORE_EINVAL;
            break;
        }
        if (!tensor_shape_equal(&t->shape, &s->vars[i].shape)) {
            char a[128], b[128];
            tensor_shape_format(&t->shape, a, sizeof(a));
            tensor_shape_format(&s->vars[i].shape, b, sizeof(b));
            snprintf(err, errlen, "gradient '%s' has shape [%s], the variable has [%s]", t->name,
                     a, b);
            rc = STORE_ESHAPE;
            break;
        }
        idx[k] = i;
    }
    /* Every destination first, so running out of memory changes nothing. */
    blob **dst = rc == STORE_OK ? calloc((size_t)f->n_tensors, sizeof(blob *)) : NULL;
    if (rc == STORE_OK && !dst)
        rc = STORE_ENOMEM;
    for (int k = 0; rc == STORE_OK && k < f->n_tensors; k++)
        if (!(dst[k] = writable(s, &s->vars[idx[k]])))
            rc = STORE_ENOMEM;
    for (int k = 0; dst && k < f->n_tensors; k++) {
        if (rc == STORE_OK)
            sgd_into(s, &s->vars[idx[k]], dst[k], (const float *)(data + f->tensors[k].begin));
        else if (dst[k] && dst[k] != s->vars[idx[k]].data)
            blob_unref(dst[k]);
    }
    free(dst);
    free(idx);
    if (rc != STORE_OK)
        goto out;
    *global_step = ++s->global_step;
    if (meta->has_loss) {
        s->last_loss = meta->loss;
        s->has_loss = 1;
    }
    if (meta->push_id) {
        snprintf(s->pushes[s->push_next].id, sizeof(s->pushes[0].id), "%s", meta->push_id);
        s->pushes[s->push_next].step = *global_step;
        s->push_next = (s->push_next + 1) % STORE_PUSH_IDS;
    }
out:
    pthread_rwlock_unlock(&s->lock);
    return rc;
}

void store_totals(store *s, int *n_vars, uint64_t *bytes, int64_t *global_step, int *has_loss,
                  double *last_loss)
{
    pthread_rwlock_rdlock(&s->lock);
    *n_vars = s->n;
    *bytes = s->bytes;
    *global_step = s->global_step;
    *has_loss = s->has_loss;
    *last_loss = s->last_loss;
    pthread_rwlock_unlock(&s->lock);
}
