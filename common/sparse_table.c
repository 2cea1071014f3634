/* sparse_table.c - one row-sparse variable: rows by id in an open-addressing
 * hash, a least-recently-updated list, per-row slots (sparse_table.h). */
#include "sparse_table.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* splitmix64 (Steele, Lea, Flood 2014): the initializer's and the hash's mixer. */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int64_t sparse_id_at(const unsigned char *ids, int64_t i)
{
    int64_t v;
    memcpy(&v, ids + 8 * i, 8);
    return v;
}

int sparse_decl_check(const sparse_decl *d, char *err, size_t errlen)
{
    if (d->rows < 0 || d->rows > SPARSE_ROWS_MAX) {
        snprintf(err, errlen, "rows must be 0 (a dynamic table) to %lld", (long long)SPARSE_ROWS_MAX);
        return -1;
    }
    if (d->dim < 1 || d->dim > SPARSE_DIM_MAX) {
        snprintf(err, errlen, "dim must be 1 to %d", SPARSE_DIM_MAX);
        return -1;
    }
    if (d->max_rows < 1 || d->max_rows > SPARSE_ROWS_MAX) {
        snprintf(err, errlen, "max_rows must be 1 to %lld", (long long)SPARSE_ROWS_MAX);
        return -1;
    }
    if ((uint64_t)d->max_rows * (uint64_t)d->dim > ((uint64_t)1 << 40)) {
        snprintf(err, errlen, "max_rows x dim must be at most 2^40 floats");
        return -1;
    }
    if (d->shards < 1 || d->shards > 4096 || d->shard < 0 || d->shard >= d->shards) {
        snprintf(err, errlen, "shard must be 0 to shards - 1, shards 1 to 4096");
        return -1;
    }
    if (!isfinite(d->init_scale) || d->init_scale < 0 || d->init_scale > 1e6f) {
        snprintf(err, errlen, "init_scale must be a finite number 0 to 1e6");
        return -1;
    }
    return 0;
}

int sparse_decl_equal(const sparse_decl *a, const sparse_decl *b)
{
    return a->rows == b->rows && a->dim == b->dim && a->max_rows == b->max_rows && a->init == b->init &&
           a->init_scale == b->init_scale && a->seed == b->seed && a->shard == b->shard &&
           a->shards == b->shards;
}

int sparse_table_init(sparse_table *t, const char *name, const sparse_decl *d)
{
    memset(t, 0, sizeof(*t));
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->d = *d;
    t->head = t->tail = -1;
    t->hcap = 16;
    if (!(t->hash = malloc(sizeof(int64_t) * t->hcap)))
        return -1;
    memset(t->hash, 0xff, sizeof(int64_t) * t->hcap);
    return 0;
}

void sparse_table_free(sparse_table *t)
{
    free(t->ids);
    free(t->values);
    free(t->slot0);
    free(t->slot1);
    free(t->prev);
    free(t->next);
    free(t->hash);
    memset(t, 0, sizeof(*t));
}

uint64_t sparse_table_bytes(const sparse_table *t)
{
    return (uint64_t)t->n * (uint64_t)t->d.dim * 4u * (uint64_t)(1 + t->n_slots);
}

int sparse_check_ids(const sparse_table *t, const unsigned char *ids, int64_t n, char *err,
                     size_t errlen)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t id = sparse_id_at(ids, i);
        if (id < 0) {
            snprintf(err, errlen, "'%s': id %lld at %lld is negative", t->name, (long long)id, (long long)i);
            return -1;
        }
        if (t->d.rows > 0 && id >= t->d.rows) {
            snprintf(err, errlen, "'%s': id %lld at %lld is out of range (the table has %lld rows)", t->name,
                     (long long)id, (long long)i, (long long)t->d.rows);
            return -1;
        }
        if (id % t->d.shards != t->d.shard) {
            snprintf(err, errlen, "'%s': id %lld at %lld belongs to shard %lld of %d, this is shard %d", t->name,
                     (long long)id, (long long)i, (long long)(id % t->d.shards), t->d.shards, t->d.shard);
            return -1;
        }
    }
    return 0;
}

/* The hash slot of id: where it is, or the empty slot where it would go. */
static size_t slot_of(const int64_t *hash, size_t hcap, const int64_t *ids, int64_t id)
{
    size_t h = (size_t)mix64((uint64_t)id) & (hcap - 1);
    while (hash[h] >= 0 && ids[hash[h]] != id)
        h = (h + 1) & (hcap - 1);
    return h;
}

static int64_t row_of(const sparse_table *t, int64_t id)
{
    return t->hash[slot_of(t->hash, t->hcap, t->ids, id)];
}

void sparse_init_row(const sparse_decl *d, int64_t id, float *out)
{
    if (d->init == SPARSE_INIT_ZEROS) {
        memset(out, 0, sizeof(float) * (size_t)d->dim);
        return;
    }
    /* x_j = splitmix64 of (seed + id * golden) + (j + 1) * golden; u = top 24 bits / 2^24 */
    uint64_t base = d->seed + (uint64_t)id * 0x9E3779B97F4A7C15ull;
    for (int j = 0; j < d->dim; j++) {
        uint64_t x = mix64(base + (uint64_t)(j + 1) * 0x9E3779B97F4A7C15ull);
        float u = (float)(x >> 40) * 0x1p-24f;
        out[j] = d->init_scale * (2.0f * u - 1.0f);
    }
}

void sparse_lookup(const sparse_table *t, const unsigned char *ids, int64_t n, float *out)
{
    const size_t dim = (size_t)t->d.dim;
    for (int64_t i = 0; i < n; i++) {
        int64_t id = sparse_id_at(ids, i), r = row_of(t, id);
        if (r >= 0)
            memcpy(out + (size_t)i * dim, t->values + (size_t)r * dim, sizeof(float) * dim);
        else
            sparse_init_row(&t->d, id, out + (size_t)i * dim);
    }
}

/* ---- accumulation ---- */

int sparse_acc_init(sparse_acc *a, int dim)
{
    memset(a, 0, sizeof(*a));
    a->dim = dim;
    return 0;
}

void sparse_acc_free(sparse_acc *a)
{
    free(a->ids);
    free(a->vals);
    free(a->hash);
    memset(a, 0, sizeof(*a));
}

/* The open-addressing index of ids[0..n) (-1: empty) at most half full for
 * need entries: doubled (from 128) and rebuilt when it would be fuller. */
static int hash_room(int64_t **hash, size_t *hcap, const int64_t *ids, int64_t n, int64_t need)
{
    if ((size_t)need * 2 <= *hcap)
        return 0;
    size_t hc = *hcap ? *hcap : 128;
    while ((size_t)need * 2 > hc)
        hc *= 2;
    int64_t *nh = malloc(sizeof(int64_t) * hc);
    if (!nh)
        return -1;
    memset(nh, 0xff, sizeof(int64_t) * hc);
    for (int64_t i = 0; i < n; i++)
        nh[slot_of(nh, hc, ids, ids[i])] = i;
    free(*hash);
    *hash = nh;
    *hcap = hc;
    return 0;
}

static int acc_room(sparse_acc *a, int64_t need)
{
    if (need > a->cap) {
        int64_t nc = a->cap ? a->cap : 64;
        while (nc < need)
            nc *= 2;
        int64_t *ni = realloc(a->ids, sizeof(int64_t) * (size_t)nc);
        if (!ni)
            return -1;
        a->ids = ni;
        float *nv = realloc(a->vals, sizeof(float) * (size_t)nc * (size_t)a->dim);
        if (!nv)
            return -1;
        a->vals = nv;
        a->cap = nc;
    }
    return hash_room(&a->hash, &a->hcap, a->ids, a->n, need);
}

int sparse_acc_add(sparse_acc *a, const unsigned char *ids, const float *vals, int64_t n)
{
    if (acc_room(a, a->n + n) != 0)
        return -1;
    const size_t dim = (size_t)a->dim;
    for (int64_t i = 0; i < n; i++) {
        int64_t id = sparse_id_at(ids, i);
        size_t h = slot_of(a->hash, a->hcap, a->ids, id);
        float *dst;
        if (a->hash[h] >= 0) {
            dst = a->vals + (size_t)a->hash[h] * dim;
            for (size_t j = 0; j < dim; j++)
                dst[j] += vals[(size_t)i * dim + j];
        } else {
            a->hash[h] = a->n;
            a->ids[a->n] = id;
            memcpy(a->vals + (size_t)a->n * dim, vals + (size_t)i * dim, sizeof(float) * dim);
            a->n++;
        }
    }
    return 0;
}

/* ---- rows ---- */

static int table_room(sparse_table *t, int64_t need)
{
    const size_t dim = (size_t)t->d.dim;
    if (need > t->cap) {
        int64_t nc = t->cap ? t->cap : 64;
        while (nc < need)
            nc *= 2;
        if (nc > t->d.max_rows)
            nc = t->d.max_rows;
        void *p;
#define GROW(field, sz)                                                                            \
    if (!(p = realloc(t->field, (sz) * (size_t)nc)))                                                \
        return -1;                                                                                 \
    t->field = p;
        GROW(ids, sizeof(int64_t));
        GROW(prev, sizeof(int64_t));
        GROW(next, sizeof(int64_t));
        GROW(values, sizeof(float) * dim);
        if (t->n_slots > 0) {
            GROW(slot0, sizeof(float) * dim);
        }
        if (t->n_slots > 1) {
            GROW(slot1, sizeof(float) * dim);
        }
#undef GROW
        t->cap = nc;
    }
    return hash_room(&t->hash, &t->hcap, t->ids, t->n, need);
}

static void lru_unlink(sparse_table *t, int64_t r)
{
    if (t->prev[r] >= 0)
        t->next[t->prev[r]] = t->next[r];
    else
        t->head = t->next[r];
    if (t->next[r] >= 0)
        t->prev[t->next[r]] = t->prev[r];
    else
        t->tail = t->prev[r];
}

static void lru_push_head(sparse_table *t, int64_t r)
{
    t->prev[r] = -1;
    t->next[r] = t->head;
    if (t->head >= 0)
        t->prev[t->head] = r;
    t->head = r;
    if (t->tail < 0)
        t->tail = r;
}

/* Linear probing's deletion by backward shift (no tombstones). */
static void hash_delete(sparse_table *t, size_t h)
{
    size_t mask = t->hcap - 1, j = h;
    t->hash[h] = -1;
    for (;;) {
        j = (j + 1) & mask;
        if (t->hash[j] < 0)
            return;
        size_t home = (size_t)mix64((uint64_t)t->ids[t->hash[j]]) & mask;
        /* can the entry at j move to the hole at h? (home not in (h, j]) */
        int move = h <= j ? (home <= h || home > j) : (home <= h && home > j);
        if (move) {
            t->hash[h] = t->hash[j];
            t->hash[j] = -1;
            h = j;
        }
    }
}

/* Evict row r: the last row moves into its place. */
static void evict(sparse_table *t, int64_t r)
{
    const size_t dim = (size_t)t->d.dim;
    lru_unlink(t, r);
    hash_delete(t, slot_of(t->hash, t->hcap, t->ids, t->ids[r]));
    int64_t last = t->n - 1;
    if (r != last) {
        size_t h = slot_of(t->hash, t->hcap, t->ids, t->ids[last]);
        t->hash[h] = r;
        t->ids[r] = t->ids[last];
        memcpy(t->values + (size_t)r * dim, t->values + (size_t)last * dim, sizeof(float) * dim);
        if (t->slot0)
            memcpy(t->slot0 + (size_t)r * dim, t->slot0 + (size_t)last * dim, sizeof(float) * dim);
        if (t->slot1)
            memcpy(t->slot1 + (size_t)r * dim, t->slot1 + (size_t)last * dim, sizeof(float) * dim);
        t->prev[r] = t->prev[last];
        t->next[r] = t->next[last];
        if (t->prev[r] >= 0)
            t->next[t->prev[r]] = r;
        else
            t->head = r;
        if (t->next[r] >= 0)
            t->prev[t->next[r]] = r;
        else
            t->tail = r;
    }
    t->n--;
    t->evicted++;
}

/* The starting slots of a new row (what optim_apply sets at t = 1). */
static float slot0_start(optim_kind k, const optim_config *c)
{
    if (k == OPTIM_ADAGRAD)
        return c->initial_accumulator_value;
    if (k == OPTIM_RMSPROP)
        return 1.0f; /* optim.c's RMSPROP_MS_INIT, as TensorFlow's */
    return 0.0f;
}

static void start_slots(sparse_table *t, int64_t r, float s0)
{
    const size_t dim = (size_t)t->d.dim;
    for (size_t j = 0; t->slot0 && j < dim; j++)
        t->slot0[(size_t)r * dim + j] = s0;
    if (t->slot1)
        memset(t->slot1 + (size_t)r * dim, 0, sizeof(float) * dim);
}

/* A new row for id at the head; room was made. */
static int64_t add_row(sparse_table *t, int64_t id, float s0)
{
    int64_t r = t->n++;
    t->ids[r] = id;
    t->hash[slot_of(t->hash, t->hcap, t->ids, id)] = r;
    lru_push_head(t, r);
    start_slots(t, r, s0);
    return r;
}

int sparse_ensure_slots(sparse_table *t, const optim_config *c)
{
    int need = optim_slots(c->kind);
    if (t->n_slots >= need)
        return 0;
    const size_t sz = sizeof(float) * (size_t)t->d.dim * (size_t)(t->cap ? t->cap : 1);
    float *a = need > 0 ? malloc(sz) : NULL, *b = need > 1 ? malloc(sz) : NULL;
    if ((need > 0 && !a) || (need > 1 && !b)) {
        free(a);
        free(b);
        return -1;
    }
    free(t->slot0);
    free(t->slot1);
    t->slot0 = a;
    t->slot1 = b;
    t->n_slots = need;
    float s0 = slot0_start(c->kind, c);
    for (int64_t r = 0; r < t->n; r++)
        start_slots(t, r, s0);
    return 0;
}

int sparse_prepare(sparse_table *t, const sparse_acc *a, char *err, size_t errlen)
{
    if (a->n > t->d.max_rows) {
        snprintf(err, errlen, "'%s': one update touches %lld distinct rows, max_rows is %lld", t->name,
                 (long long)a->n, (long long)t->d.max_rows);
        return -2;
    }
    int64_t fresh = 0;
    for (int64_t i = 0; i < a->n; i++)
        fresh += row_of(t, a->ids[i]) < 0;
    int64_t need = t->n + fresh;
    if (need > t->d.max_rows)
        need = t->d.max_rows;
    return table_room(t, need) == 0 ? 0 : -1;
}

void sparse_apply(sparse_table *t, const sparse_acc *a, const optim_config *c, float scale,
                  int64_t step)
{
    const size_t dim = (size_t)t->d.dim;
    /* touched rows held become the most recent, so eviction spares them */
    int64_t fresh = 0;
    for (int64_t i = 0; i < a->n; i++) {
        int64_t r = row_of(t, a->ids[i]);
        if (r >= 0) {
            lru_unlink(t, r);
            lru_push_head(t, r);
        } else {
            fresh++;
        }
    }
    while (t->n + fresh > t->d.max_rows)
        evict(t, t->tail);
    /* tf.clip_by_norm over the whole update's values */
    optim_config oc = *c;
    if (oc.clip_norm > 0) {
        double ss = 0;
        for (size_t i = 0; i < (size_t)a->n * dim; i++)
            ss += (double)(a->vals[i] * scale) * (double)(a->vals[i] * scale);
        double norm = sqrt(ss);
        if (norm > (double)oc.clip_norm)
            scale = (float)((double)scale * (double)oc.clip_norm / norm);
        oc.clip_norm = 0;
    }
    float s0 = slot0_start(c->kind, c);
    t->updates++;
    for (int64_t i = 0; i < a->n; i++) {
        int64_t r = row_of(t, a->ids[i]);
        if (r < 0) {
            r = add_row(t, a->ids[i], s0);
            sparse_init_row(&t->d, a->ids[i], t->values + (size_t)r * dim);
        }
        float *w = t->values + (size_t)r * dim;
        optim_apply(&oc, w, w, a->vals + (size_t)i * dim, scale, t->slot0 ? t->slot0 + (size_t)r * dim : NULL,
                    t->slot1 ? t->slot1 + (size_t)r * dim : NULL, t->updates, step, dim);
    }
    t->version++;
}

int64_t sparse_oldest(const sparse_table *t)
{
    return t->tail;
}

int64_t sparse_newer(const sparse_table *t, int64_t row)
{
    return t->prev[row];
}

int sparse_restore_row(sparse_table *t, int64_t id, const float *value, const float *s0,
                       const float *s1)
{
    const size_t dim = (size_t)t->d.dim;
    if (t->n >= t->d.max_rows || row_of(t, id) >= 0)
        return -2;
    if (table_room(t, t->n + 1) != 0)
        return -1;
    int64_t r = add_row(t, id, 0.0f);
    memcpy(t->values + (size_t)r * dim, value, sizeof(float) * dim);
    if (t->slot0 && s0)
        memcpy(t->slot0 + (size_t)r * dim, s0, sizeof(float) * dim);
    if (t->slot1 && s1)
        memcpy(t->slot1 + (size_t)r * dim, s1, sizeof(float) * dim);
    return 0;
}
