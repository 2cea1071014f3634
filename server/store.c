/* store.c - the shard's variables, their versions and updates. */
#include "store.h"

#include <jansson.h>

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "sparse_set.h"
#include "sync_agg.h"
#include "worker_state.h"

_Static_assert(STORE_PUSH_ID_MAX == SYNC_PUSH_ID_MAX, "one push id length");

typedef struct store_var {
    char name[TENSOR_NAME_MAX + 1];
    tensor_shape shape;
    int64_t numel;
    uint64_t version;
    blob *data; /* the store's reference; len = numel * 4 */
    float *slots; /* optimizer state, optim_slots() arrays of numel floats, or NULL */
    int n_slots;
    int64_t updates; /* updates applied since created (adam's t) */
    float *shadow; /* moving average (numel floats), or NULL: not updated since EMA started */
} store_var;

struct store_state {
    pthread_rwlock_t lock;
    /* held by every writer around the write lock (write_lock): an async sgd
     * push runs its pass over the gradients under it alone, so that pulls go
     * on meanwhile (apply_in_body) */
    pthread_mutex_t write_mu;
    store_var *vars; /* sorted by name */
    int n, cap;
    int64_t global_step;
    uint64_t bytes;
    double last_loss;
    int has_loss;
    float learning_rate;
    bufpool *pool;
    store_config config;
    int configured;           /* the chief sent the configuration: variables are ready */
    sync_agg agg;             /* sync: the step's gradients; the push ids (both modes) */
    int64_t stale_dropped;
    int64_t pushes_applied;
    /* told what changed (STORE_CHANGED_*), after the lock is released */
    void (*on_change)(void *ctx, unsigned what, int64_t step);
    void *on_change_ctx;
    uint64_t changes;         /* bumped by every change a checkpoint would hold */
    worker_state workers;     /* leases, clocks, staleness (worker_state.h) */
    int64_t step_started_ms;  /* when the current step began (for /v1/sync) */
    char *placement;          /* the chief's placement map (JSON text), or NULL */
    sparse_set sparse;        /* the row-sparse variables (sparse_set.h) */
    store_stream *stream;     /* the push applied as it arrives, or NULL (store.h) */
    int64_t pushes_streamed, push_replays; /* store_counts */
    atomic_int arriving;      /* pushes whose body is being read (store_push_arriving) */
};

static int replicas_needed(const store_state *s);
static void stream_note_one(store_state *s, const char *name, const float *g, int64_t numel, int64_t step);

static void write_lock(store_state *s)
{
    pthread_mutex_lock(&s->write_mu);
    pthread_rwlock_wrlock(&s->lock);
}

static void write_unlock(store_state *s)
{
    pthread_rwlock_unlock(&s->lock);
    pthread_mutex_unlock(&s->write_mu);
}

int store_init(store *h, float learning_rate, bufpool *pool)
{
    store_state *s = h->st = calloc(1, sizeof(*s));
    if (!s)
        return STORE_ENOMEM;
    /* writers first: a stream of pulls must not hold off the pushes */
    pthread_rwlockattr_t a;
    pthread_rwlockattr_init(&a);
    pthread_rwlockattr_setkind_np(&a, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    int bad = pthread_rwlock_init(&s->lock, &a) != 0;
    pthread_rwlockattr_destroy(&a);
    if (!bad && pthread_mutex_init(&s->write_mu, NULL) != 0) {
        pthread_rwlock_destroy(&s->lock);
        bad = 1;
    }
    if (bad) {
        free(s);
        h->st = NULL;
        return STORE_ENOMEM;
    }
    s->learning_rate = learning_rate;
    s->pool = pool;
    optim_defaults(&s->config.optim, OPTIM_SGD, learning_rate);
    s->config.replicas_to_aggregate = 1;
    s->config.workers = 1;
    worker_state_init(&s->workers);
    s->config.max_staleness = -1;
    s->config.staleness = -1;
    s->step_started_ms = clk_mono_ms();
    return STORE_OK;
}

void store_touch(store *h, int worker)
{
    worker_state_touch(&h->st->workers, worker, clk_mono_ms());
}

void store_leave(store *h, int worker)
{
    worker_state_leave(&h->st->workers, worker);
}

/* Workers of the run whose lease is running, or whose gradient for the
 * current step is in (a worker waiting in a long poll is alive). Caller holds
 * the lock. */
static int live_workers(const store_state *s, int64_t now)
{
    int live = 0;
    for (int w = 0; w < s->config.workers; w++) {
        live += sync_agg_has(&s->agg, w) || worker_state_alive(&s->workers, w, now);
    }
    return live;
}

void store_destroy(store *h)
{
    store_state *s = h->st;
    for (int i = 0; i < s->n; i++) {
        blob_unref(s->vars[i].data);
        free(s->vars[i].slots);
        free(s->vars[i].shadow);
    }
    free(s->vars);
    sync_agg_free(&s->agg);
    sparse_set_free(&s->sparse);
    free(s->placement);
    pthread_rwlock_destroy(&s->lock);
    pthread_mutex_destroy(&s->write_mu);
    free(s);
    h->st = NULL;
}

/* Index of name, or -(insertion point) - 1. Caller holds the lock. */
static int find(const store_state *s, const char *name)
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

int store_get(store *h, const char *name, store_snap *out)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    int i = find(s, name);
    if (i >= 0)
        snap_of(&s->vars[i], out);
    pthread_rwlock_unlock(&s->lock);
    return i >= 0 ? STORE_OK : STORE_ENOENT;
}

/* snap_of with the moving average: a fresh blob holding v's shadow, or v's
 * data when it has none yet. -1 when out of memory. Caller holds the lock. */
static int average_of(store_state *s, const store_var *v, store_snap *out)
{
    snap_of(v, out);
    if (!v->shadow)
        return 0;
    blob *b = blob_new(s->pool, (size_t)v->numel * sizeof(float));
    blob_unref(out->data);
    out->data = b;
    if (!b)
        return -1;
    memcpy(b->data, v->shadow, (size_t)v->numel * sizeof(float));
    return 0;
}

int store_get_average(store *h, const char *name, store_snap *out)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    int i = find(s, name), rc = STORE_OK;
    if (!(s->config.moving_average_decay > 0))
        rc = STORE_EMODE;
    else if (i < 0)
        rc = STORE_ENOENT;
    else if (average_of(s, &s->vars[i], out) != 0)
        rc = STORE_ENOMEM;
    pthread_rwlock_unlock(&s->lock);
    return rc;
}

int store_get_all_average(store *h, store_snap **out, int *n, int64_t *global_step)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    if (!(s->config.moving_average_decay > 0)) {
        pthread_rwlock_unlock(&s->lock);
        return STORE_EMODE;
    }
    store_snap *v = calloc((size_t)(s->n ? s->n : 1), sizeof(store_snap));
    int k = 0;
    while (v && k < s->n && average_of(s, &s->vars[k], &v[k]) == 0)
        k++;
    if (!v || k < s->n) {
        pthread_rwlock_unlock(&s->lock);
        if (v)
            store_snaps_release(v, k);
        return STORE_ENOMEM;
    }
    *n = s->n;
    *global_step = s->global_step;
    pthread_rwlock_unlock(&s->lock);
    *out = v;
    return STORE_OK;
}

void store_snap_release(store_snap *snap)
{
    blob_unref(snap->data);
    snap->data = NULL;
}

int store_peek(store *h, const char *name, tensor_shape *shape)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    int i = find(s, name);
    if (i >= 0 && shape)
        *shape = s->vars[i].shape;
    pthread_rwlock_unlock(&s->lock);
    return i >= 0 ? STORE_OK : STORE_ENOENT;
}

int store_get_all(store *h, store_snap **out, int *n, int64_t *global_step)
{
    return store_get_all_pending(h, out, n, global_step, -1, NULL);
}

int store_get_all_pending(store *h, store_snap **out, int *n, int64_t *global_step, int worker,
                          int *pending)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    if (pending)
        *pending = sync_agg_has(&s->agg, worker);
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

/* Idle buffers kept for reuse: the stored bytes plus 16 MiB, so that the
 * next versions of a push of the whole shard (store_stream) land in memory
 * touched before: with half the stored bytes (as until issue 33) a 64 MiB
 * push cleared 32 fresh 2 MiB pages every time (a third of psd's time in
 * clear_page under perf). psd holds about twice the stored bytes then,
 * which a push of everything needs at its peak anyway (the versions before
 * and after, all or nothing). */
static void pool_follow(store_state *s, uint64_t bytes)
{
    if (s->pool)
        bufpool_set_limit(s->pool, (size_t)bytes + ((size_t)16 << 20));
}

int store_put(store *h, const char *name, const tensor_shape *shape, blob *data,
              int only_create, int *created, uint64_t *version)
{
    store_state *s = h->st;
    int64_t numel = tensor_shape_numel(shape);
    if (data->len != (size_t)numel * 4)
        return STORE_ESHAPE;
    write_lock(s);
    int i = find(s, name);
    if (i >= 0) {
        if (only_create) {
            write_unlock(s);
            return STORE_EEXIST;
        }
        store_var *v = &s->vars[i];
        blob *old = v->data;
        s->bytes = s->bytes - (uint64_t)v->numel * 4 + (uint64_t)numel * 4;
        v->data = data;
        if (!tensor_shape_equal(shape, &v->shape))
            sync_agg_clear(&s->agg); /* sync gradients computed for the old shape */
        if (numel != v->numel) { /* optimizer state no longer fits */
            free(v->slots);
            v->slots = NULL;
            v->n_slots = 0;
            v->updates = 0;
        }
        free(v->shadow); /* a new value: its average starts from it */
        v->shadow = NULL;
        v->shape = *shape;
        v->numel = numel;
        v->version++;
        s->changes++;
        *version = v->version;
        *created = 0;
        uint64_t bytes = s->bytes;
        write_unlock(s);
        blob_unref(old);
        pool_follow(s, bytes);
        return STORE_OK;
    }
    if (s->n == s->cap) {
        int nc = s->cap ? s->cap * 2 : 16;
        store_var *nv = realloc(s->vars, sizeof(store_var) * (size_t)nc);
        if (!nv) {
            write_unlock(s);
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
    s->changes++;
    s->bytes += (uint64_t)numel * 4;
    *version = 1;
    *created = 1;
    uint64_t bytes = s->bytes;
    write_unlock(s);
    pool_follow(s, bytes);
    return STORE_OK;
}

/* The blob the next version of v is written into, or NULL when out of memory. */
static blob *writable(store_state *s, store_var *v)
{
    if (atomic_load(&v->data->refs) == 1)
        return v->data;
    return blob_new(s->pool, (size_t)v->numel * 4);
}

/* The optimizer's state for v exists (zeros at first), and with a moving
 * average its shadow (the value before this update). Caller holds the write lock. */
static int ensure_slots(store_state *s, store_var *v)
{
    if (s->config.moving_average_decay > 0 && !v->shadow) {
        /* the average starts from the value before this update, as TF's */
        if (!(v->shadow = malloc((size_t)v->numel * sizeof(float))))
            return -1;
        memcpy(v->shadow, v->data->data, (size_t)v->numel * sizeof(float));
    }
    int need = optim_slots(s->config.optim.kind);
    if (v->n_slots >= need)
        return 0;
    float *sl = calloc((size_t)need * (size_t)v->numel, sizeof(float));
    if (!sl)
        return -1;
    free(v->slots);
    v->slots = sl;
    v->n_slots = need;
    return 0;
}

/* dst (written) is v's next version: the moving average follows it, the
 * version and change counter move. */
static void take_version(store_state *s, store_var *v, blob *dst)
{
    if (v->shadow && s->config.moving_average_decay > 0)
        optim_ema(v->shadow, (const float *)dst->data, s->config.moving_average_decay,
                  (size_t)v->numel);
    if (dst != v->data) {
        blob_unref(v->data);
        v->data = dst;
    }
    v->version++;
    s->changes++;
}

/* v's next version into dst (see writable) from gradient g * scale. */
static void update_into(store_state *s, store_var *v, blob *dst, const float *g, float scale)
{
    v->updates++;
    float *s0 = v->n_slots > 0 ? v->slots : NULL;
    float *s1 = v->n_slots > 1 ? v->slots + v->numel : NULL;
    /* the schedule reads global_step before this update */
    optim_apply(&s->config.optim, (const float *)v->data->data, (float *)dst->data, g, scale, s0,
                s1, v->updates, s->global_step, (size_t)v->numel);
    take_version(s, v, dst);
}

void store_on_change(store *h, void (*fn)(void *ctx, unsigned what, int64_t step), void *ctx)
{
    store_state *s = h->st;
    s->on_change = fn;
    s->on_change_ctx = ctx;
}

static void notify(store_state *s, unsigned what, int64_t step)
{
    if (s->on_change && what)
        s->on_change(s->on_change_ctx, what, step);
}

int store_apply_grad(store *h, const char *name, const float *g, int64_t numel,
                     int64_t *global_step, uint64_t *version)
{
    store_state *s = h->st;
    write_lock(s);
    int i = find(s, name), rc = STORE_OK;
    if (s->config.sync)
        rc = STORE_EMODE;
    else if (i < 0)
        rc = STORE_ENOENT;
    else if (s->vars[i].numel != numel)
        rc = STORE_ESHAPE;
    else {
        blob *dst = writable(s, &s->vars[i]);
        if (!dst || ensure_slots(s, &s->vars[i]) != 0) {
            if (dst && dst != s->vars[i].data)
                blob_unref(dst);
            write_unlock(s);
            return STORE_ENOMEM;
        }
        update_into(s, &s->vars[i], dst, g, 1.0f);
        stream_note_one(s, name, g, numel, s->global_step);
        *global_step = ++s->global_step;
        s->pushes_applied++;
        *version = s->vars[i].version;
    }
    int64_t step = s->global_step;
    write_unlock(s);
    if (rc == STORE_OK)
        notify(s, STORE_CHANGED_STEP, step);
    return rc;
}

/* Every name exists with the same shape; idx[k] = its variable. */
static int check_grads(const store_state *s, const st_file *f, int *idx, char *err, size_t errlen)
{
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
        if (sparse_tensor_name(t->name)) { /* a sparse variable's (sparse_set_pieces) */
            idx[k] = -1;
            continue;
        }
        int i = find(s, t->name);
        if (i < 0) {
            snprintf(err, errlen, "gradient for unknown variable '%s'", t->name);
            return STORE_EINVAL;
        }
        if (!tensor_shape_equal(&t->shape, &s->vars[i].shape)) {
            char a[128], b[128];
            tensor_shape_format(&t->shape, a, sizeof(a));
            tensor_shape_format(&s->vars[i].shape, b, sizeof(b));
            snprintf(err, errlen, "gradient '%s' has shape [%s], the variable has [%s]", t->name,
                     a, b);
            return STORE_ESHAPE;
        }
        idx[k] = i;
    }
    return STORE_OK;
}

/* Destinations and optimizer state for variables idx[0..n) first, so running
 * out of memory changes nothing. dst[k] set; on failure all released. */
static int prepare(store_state *s, const int *idx, int n, blob **dst)
{
    for (int k = 0; k < n; k++) {
        store_var *v = &s->vars[idx[k]];
        if (!(dst[k] = writable(s, v)) || ensure_slots(s, v) != 0) {
            for (int j = 0; j <= k; j++)
                if (dst[j] && dst[j] != s->vars[idx[j]].data)
                    blob_unref(dst[j]);
            return STORE_ENOMEM;
        }
    }
    return STORE_OK;
}

/* Sync: the step has its replicas. Sum each variable's gradients in worker
 * order, average, apply once; out of memory changes nothing. Caller holds
 * the write lock. */
/* The step's sparse update: every kept gradient's pieces, in worker order. */
static int sparse_of_step(store_state *s, sparse_batch *sb, char *err, size_t errlen)
{
    memset(sb, 0, sizeof(*sb));
    if (s->sparse.n == 0)
        return STORE_OK;
    sparse_piece *all = NULL;
    int n_all = 0, rc = STORE_OK;
    for (int w = 0; w < s->agg.n && rc == STORE_OK; w++) {
        sparse_piece *p;
        int np;
        const sync_grad *g = &s->agg.grads[w];
        int pr = sparse_set_pieces(&s->sparse, &g->f, g->data, &p, &np, err, errlen);
        if (pr != 0) { /* checked when it came: only a table's change can do this */
            rc = pr == -2 ? STORE_ENOMEM : STORE_EINVAL;
            break;
        }
        if (np) {
            sparse_piece *na = realloc(all, sizeof(*na) * (size_t)(n_all + np));
            if (!na)
                rc = STORE_ENOMEM;
            else {
                all = na;
                memcpy(all + n_all, p, sizeof(*p) * (size_t)np);
                n_all += np;
            }
        }
        free(p);
    }
    if (rc == STORE_OK) {
        int pr = sparse_set_prepare(&s->sparse, all, n_all, &s->config.optim, sb, err, errlen);
        rc = pr == 0 ? STORE_OK : pr == -1 ? STORE_ENOMEM : STORE_EINVAL;
    }
    free(all);
    return rc;
}

static int aggregate(store_state *s)
{
    sparse_batch sb;
    int *idx = malloc(sizeof(int) * (size_t)(s->n ? s->n : 1));
    blob **dst = calloc((size_t)(s->n ? s->n : 1), sizeof(blob *));
    int rc = STORE_OK, n = 0;
    if (!idx || !dst) {
        rc = STORE_ENOMEM;
        goto out;
    }
    int64_t maxn = 0;
    for (int i = 0; i < s->n; i++)
        if (sync_agg_count(&s->agg, s->vars[i].name, &s->vars[i].shape) > 0) {
            idx[n++] = i;
            if (s->vars[i].numel > maxn)
                maxn = s->vars[i].numel;
        }
    if (sync_agg_reserve(&s->agg, maxn) != 0) {
        rc = STORE_ENOMEM;
        goto out;
    }
    char err[256];
    if ((rc = sparse_of_step(s, &sb, err, sizeof(err))) != STORE_OK)
        goto out;
    if ((rc = prepare(s, idx, n, dst)) != STORE_OK) {
        sparse_batch_free(&sb);
        goto out;
    }
    for (int k = 0; k < n; k++) {
        store_var *v = &s->vars[idx[k]];
        int cnt;
        const float *sum = sync_agg_sum(&s->agg, v->name, &v->shape, v->numel, &cnt);
        update_into(s, v, dst[k], sum, 1.0f / (float)cnt);
    }
    /* the sparse rows: summed by id in worker order, over every kept gradient */
    if (sb.n)
        s->changes++;
    sparse_set_commit(&s->sparse, &sb, &s->config.optim, 1.0f / (float)s->agg.n, s->global_step);
    double loss;
    if (sync_agg_mean_loss(&s->agg, &loss)) {
        s->last_loss = loss;
        s->has_loss = 1;
    }
    s->global_step++;
    s->pushes_applied++;
    sync_agg_clear(&s->agg);
    s->step_started_ms = clk_mono_ms();
out:
    free(idx);
    free(dst);
    return rc;
}

int store_sync_tick(store *h)
{
    store_state *s = h->st;
    write_lock(s);
    int stepped = s->config.sync && s->agg.n > 0 && s->agg.n >= replicas_needed(s) &&
                  aggregate(s) == STORE_OK;
    int64_t step = s->global_step;
    write_unlock(s);
    notify(s, (stepped ? STORE_CHANGED_STEP : 0) | STORE_CHANGED_CLOCK, step);
    return stepped;
}

/* Gradients a sync step needs right now: min(R, live workers), at least 1. */
static int replicas_needed(const store_state *s)
{
    int r = s->config.replicas_to_aggregate;
    int live = live_workers(s, clk_mono_ms());
    if (live < r)
        r = live;
    return r > 0 ? r : 1;
}

/* What a push did, for store_apply_grads' caller and its notification. */
typedef struct push_result {
    int64_t step;  /* the step it reports */
    int outcome;   /* STORE_PUSH_* */
    int stepped;   /* global_step moved */
    int clocked;   /* the worker's clock rose */
} push_result;

/* Sync: keep the gradient for the current step; complete the step once it
 * has its replicas. Caller holds the write lock. */
/* Sync: would the step's rows of every table this push touches still fit
 * its max_rows (counting the kept gradients' rows, duplicates included)?
 * So that a step, once its replicas are in, can always be applied. */
static int sparse_step_fits(store_state *s, const sparse_piece *p, int np, char *err, size_t errlen)
{
    for (int i = 0; i < np; i++) {
        const sparse_table *t = &s->sparse.t[p[i].table];
        int64_t rows = 0;
        for (int k = 0; k < np; k++)
            rows += p[k].table == p[i].table ? p[k].n : 0;
        for (int w = 0; w < s->agg.n; w++) {
            char buf[TENSOR_NAME_MAX + 16];
            snprintf(buf, sizeof(buf), "%s:ids", t->name);
            int k = st_find(&s->agg.grads[w].f, buf);
            rows += k >= 0 ? s->agg.grads[w].f.tensors[k].shape.dims[0] : 0;
        }
        if (rows > t->d.max_rows) {
            snprintf(err, errlen, "'%s': this sync step's pushes hold %lld rows, max_rows is %lld", t->name,
                     (long long)rows, (long long)t->d.max_rows);
            return STORE_EINVAL;
        }
    }
    return STORE_OK;
}

static int push_sync(store_state *s, const st_file *f, const unsigned char *data,
                     const store_push_meta *meta, const sparse_piece *pieces, int np, push_result *out,
                     char *err, size_t errlen)
{
    if (meta->worker < 0 || meta->step < 0) {
        snprintf(err, errlen, "sync training needs metadata 'worker' and 'step' with every push");
        return STORE_EINVAL;
    }
    if (meta->worker >= s->config.workers) {
        snprintf(err, errlen, "worker %lld is not one of the %d workers of this sync run",
                 meta->worker, s->config.workers);
        return STORE_EINVAL;
    }
    out->step = s->global_step;
    if (meta->step < s->global_step) {
        s->stale_dropped++;
        out->outcome = STORE_PUSH_STALE;
        return STORE_OK;
    }
    if (meta->step > s->global_step) {
        snprintf(err, errlen, "gradient computed from step %lld, but this shard is at step %lld",
                 meta->step, (long long)s->global_step);
        return STORE_EAHEAD;
    }
    if (!sync_agg_has(&s->agg, (int)meta->worker) && sparse_step_fits(s, pieces, np, err, errlen) != STORE_OK)
        return STORE_EINVAL;
    int added = sync_agg_add(&s->agg, (int)meta->worker, meta->body, f, data, meta->has_loss,
                             meta->loss);
    if (added == 1) {
        out->outcome = STORE_PUSH_DUPLICATE;
        return STORE_OK;
    }
    if (added < 0)
        return STORE_ENOMEM;
    sync_agg_remember(&s->agg, meta->push_id, s->global_step);
    out->outcome = STORE_PUSH_PENDING;
    /* out of memory aggregating keeps the gradients: the next push retries the step */
    if (s->agg.n >= replicas_needed(s) && aggregate(s) == STORE_OK) {
        out->outcome = STORE_PUSH_APPLIED;
        out->stepped = 1;
    }
    out->step = s->global_step;
    return STORE_OK;
}

/* A NaN or Inf in any gradient: STORE_EINVAL, err naming the first (the
 * words POST /v1/grads has always used), else STORE_OK. */
static int check_finite(const st_file *f, const unsigned char *data, char *err, size_t errlen)
{
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
        if (sparse_ids_tensor(t))
            continue;
        const float *g = (const float *)(data + t->begin);
        int64_t bad = tensor_find_nonfinite(g, (size_t)((t->end - t->begin) / 4));
        if (bad >= 0) {
            snprintf(err, errlen, "gradient '%s' has %s at element %lld", t->name,
                     isnan(g[bad]) ? "NaN" : "Inf", (long long)bad);
            return STORE_EINVAL;
        }
    }
    return STORE_OK;
}

/* Pushes applied in their own body (store.h, in_body): async, sgd (no
 * optimizer slots to keep unchanged when a later chunk is refused). Caller
 * holds the lock. */
static int fuses(const store_state *s)
{
    return !s->config.sync && s->config.optim.kind == OPTIM_SGD;
}

int store_push_in_body(store *h)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    int f = fuses(s);
    pthread_rwlock_unlock(&s->lock);
    return f;
}

/* parent's bytes still in use as variables: when under a quarter of it,
 * those variables get blobs of their own, so that variables pushed apart do
 * not keep old bodies alive (at most 4x the stored bytes pinned). Caller
 * holds the write lock. */
static void loosen(store_state *s, blob *parent)
{
    size_t live = 0;
    for (int i = 0; i < s->n; i++)
        if (s->vars[i].data->parent == parent)
            live += s->vars[i].data->len;
    if (live == 0 || live >= parent->cap / 4)
        return;
    for (int i = 0; i < s->n; i++) {
        store_var *v = &s->vars[i];
        if (v->data->parent != parent || atomic_load(&v->data->refs) != 1)
            continue; /* a pull holds it: next time */
        blob *own = blob_new(s->pool, v->data->len);
        if (!own)
            continue;
        memcpy(own->data, v->data->data, v->data->len);
        blob_unref(v->data);
        v->data = own; /* the same value: the version stays */
    }
}

/* A body whose gradients are under a quarter of it, less this, is not kept
 * as the variables' data (store_apply_grads). */
#define PIN_SLACK ((uint64_t)64 << 10)

/* A gradient this large is checked and applied by two threads, a half
 * each (the pushing worker waits meanwhile, so a core is usually free). */
#define SPLIT_FLOATS ((size_t)2 << 20)

typedef struct sgd_half {
    const optim_config *c;
    const float *w;
    float *g;
    int64_t step;
    size_t n;
    int64_t bad;
} sgd_half;

static void *sgd_half_run(void *arg)
{
    sgd_half *h = arg;
    h->bad = optim_sgd_into_grad(h->c, h->w, h->g, 1.0f, h->step, h->n);
    return NULL;
}

/* optim_sgd_into_grad over n floats, the second half on a thread of its own
 * when n is large and there is no clipping (whose norm needs all of g
 * first); element by element, so the floats are the same either way. */
static int64_t sgd_into_grad(const optim_config *c, const float *w, float *g, int64_t step, size_t n)
{
    pthread_t th;
    size_t h = n / 2;
    sgd_half second = {c, w + h, g + h, step, n - h, -1};
    if (n < SPLIT_FLOATS || c->clip_norm > 0 || pthread_create(&th, NULL, sgd_half_run, &second) != 0)
        return optim_sgd_into_grad(c, w, g, 1.0f, step, n);
    int64_t bad = optim_sgd_into_grad(c, w, g, 1.0f, step, h);
    pthread_join(th, NULL);
    if (bad < 0 && second.bad >= 0)
        bad = (int64_t)h + second.bad;
    return bad;
}

/* The body old the published variables were views of is no longer theirs. */
static void publish_done(store_state *s, blob *old)
{
    if (old) {
        loosen(s, old);
        blob_unref(old);
    }
}

/* Publish next as v's new version (an update); the body v was a view of is
 * loosened once the run of variables that share it ends: pass the last
 * call's result as old, and the last one to publish_done. */
static blob *publish_version(store_state *s, store_var *v, blob *next, blob *old)
{
    blob *p = v->data->parent;
    if (p && p != old) {
        publish_done(s, old);
        old = blob_ref(p);
    }
    v->updates++;
    take_version(s, v, next);
    return old;
}

/* Async sgd in one pass: each gradient, at off in body, is checked and
 * turned into its variable's next value in place (optim_sgd_into_grad), and
 * those bytes become the variables' data (views of body). A NaN or Inf
 * anywhere changes nothing but the body; out of memory changes nothing.
 * Caller holds write_lock (the write lock is let go during the pass and
 * held again on return); idx from check_grads. */
static int apply_in_body(store_state *s, const st_file *f, blob *body, size_t off, const int *idx,
                         char *err, size_t errlen)
{
    int n = f->n_tensors, rc = STORE_OK;
    blob **views = calloc((size_t)n, sizeof(blob *));
    if (!views)
        return STORE_ENOMEM;
    for (int k = 0; k < n; k++)
        if (!(views[k] = blob_view(body, off + f->tensors[k].begin,
                                   (size_t)s->vars[idx[k]].numel * 4))) {
            rc = STORE_ENOMEM;
            goto out;
        }
    /* the pass without the write lock: pulls go on; every writer waits on
     * write_mu, so the variables, their data, the configuration and
     * global_step stay as they are */
    pthread_rwlock_unlock(&s->lock);
    for (int k = 0; k < n && rc == STORE_OK; k++) {
        store_var *v = &s->vars[idx[k]];
        float *g = (float *)views[k]->data;
        /* the schedule reads global_step before this update */
        int64_t bad = sgd_into_grad(&s->config.optim, (const float *)v->data->data, g, s->global_step,
                                    (size_t)v->numel);
        if (bad >= 0) {
            snprintf(err, errlen, "gradient '%s' has %s at element %lld", f->tensors[k].name,
                     isnan(g[bad]) ? "NaN" : "Inf", (long long)bad);
            rc = STORE_EINVAL;
        }
    }
    pthread_rwlock_wrlock(&s->lock);
    if (rc != STORE_OK)
        goto out;
    for (int k = 0; k < n; k++) /* a moving average's shadow, before anything changes */
        if (ensure_slots(s, &s->vars[idx[k]]) != 0) {
            rc = STORE_ENOMEM;
            goto out;
        }
    blob *old = NULL; /* the body the variables were views of (usually one) */
    for (int k = 0; k < n; k++) {
        old = publish_version(s, &s->vars[idx[k]], views[k], old);
        views[k] = NULL;
    }
    publish_done(s, old);
out:
    for (int k = 0; k < n; k++)
        blob_unref(views[k]);
    free(views);
    return rc;
}

/* ---- a push applied as it arrives (store.h, store_stream) ---- */

#define STREAM_LOG_MAX 64

/* A push of the stream's variables applied while it streamed: applied
 * again on top of it at its commit. */
typedef struct stream_entry {
    blob *body;     /* holds the gradients (referenced) */
    const float **g; /* per stream tensor: its gradient in body, or NULL */
    int64_t step;   /* the global_step it was applied at (the schedule) */
} stream_entry;

struct store_stream {
    int n;                                 /* tensors, in f's header order */
    char (*names)[TENSOR_NAME_MAX + 1];
    int64_t *numel;
    blob **w0;     /* the versions the next ones are computed from (referenced) */
    blob **next;   /* the next versions, unpublished */
    blob **expect; /* what each variable holds until the commit (referenced) ... */
    uint64_t *version; /* ... at this version */
    store_config config; /* the configuration of the begin */
    int64_t step0;       /* global_step at the begin */
    int lost;            /* more pushes of its variables meanwhile than the log holds */
    uint64_t bytes, log_bytes; /* its gradients' bytes; the log's */
    int n_log;
    stream_entry log[STREAM_LOG_MAX];
};

/* Does f push one of the active stream's variables? Caller holds the lock. */
static int stream_touches(const store_state *s, const st_file *f)
{
    const store_stream *ss = s->stream;
    for (int j = 0; ss && j < ss->n; j++)
        if (st_find(f, ss->names[j]) >= 0)
            return 1;
    return 0;
}

/* An async push (f, its gradients at data in meta->body) was just applied
 * at `step`: the active stream keeps its gradients for its commit. Caller
 * holds the write lock. */
static void stream_note(store_state *s, const st_file *f, const unsigned char *data, const store_push_meta *meta,
                        int64_t step)
{
    store_stream *ss = s->stream;
    if (!ss || ss->lost || !stream_touches(s, f))
        return;
    const blob *b = meta->body;
    int inside = b && data >= b->data && (uint64_t)(data - b->data) <= b->len &&
                 f->data_len <= b->len - (size_t)(data - b->data);
    stream_entry *e = &ss->log[ss->n_log];
    /* at most 64 pushes, and twice the stream's bytes (+ 16 MiB) kept */
    if (!inside || ss->n_log == STREAM_LOG_MAX || ss->log_bytes + b->len > 2 * ss->bytes + ((uint64_t)16 << 20) ||
        !(e->g = calloc((size_t)ss->n, sizeof(*e->g)))) {
        ss->lost = 1; /* its commit is STORE_ECHANGED */
        return;
    }
    for (int j = 0; j < ss->n; j++) {
        int k = st_find(f, ss->names[j]), i = k >= 0 ? find(s, ss->names[j]) : -1;
        if (i < 0)
            continue;
        e->g[j] = (const float *)(data + f->tensors[k].begin);
        blob_unref(ss->expect[j]); /* what the variable holds now */
        ss->expect[j] = blob_ref(s->vars[i].data);
        ss->version[j] = s->vars[i].version;
    }
    e->body = blob_ref(meta->body);
    e->step = step;
    ss->log_bytes += b->len;
    ss->n_log++;
}

/* POST /v1/vars/NAME/grad applied g (numel floats, the caller's) at step:
 * an active stream of that variable keeps a copy. Caller holds the write lock. */
static void stream_note_one(store_state *s, const char *name, const float *g, int64_t numel, int64_t step)
{
    store_stream *ss = s->stream;
    int j = 0;
    while (ss && j < ss->n && strcmp(ss->names[j], name) != 0)
        j++;
    if (!ss || ss->lost || j == ss->n)
        return;
    blob *copy = blob_new(s->pool, (size_t)numel * 4);
    st_tensor t = {.name = (char *)name, .dtype = "F32", .begin = 0, .end = (uint64_t)numel * 4};
    st_file f = {.n_tensors = 1, .tensors = &t, .data_len = (uint64_t)numel * 4};
    if (!copy) {
        ss->lost = 1;
        return;
    }
    memcpy(copy->data, g, (size_t)numel * 4);
    store_push_meta meta = {.body = copy};
    stream_note(s, &f, copy->data, &meta, step);
    blob_unref(copy); /* the log holds its own reference */
}

static void stream_free(store_stream *ss)
{
    if (!ss)
        return;
    for (int j = 0; j < ss->n; j++) {
        blob_unref(ss->w0 ? ss->w0[j] : NULL);
        blob_unref(ss->next ? ss->next[j] : NULL);
        blob_unref(ss->expect ? ss->expect[j] : NULL);
    }
    for (int i = 0; i < ss->n_log; i++) {
        blob_unref(ss->log[i].body);
        free(ss->log[i].g);
    }
    free(ss->names);
    free(ss->numel);
    free(ss->w0);
    free(ss->next);
    free(ss->expect);
    free(ss->version);
    free(ss);
}

/* Async: apply at once, unless staler than --max_staleness. Caller holds
 * the write lock; idx from check_grads. in_body: the gradients are unchecked
 * and applied in their body (apply_in_body, at off); *nonfinite set when one
 * is refused for a NaN or Inf, which must change nothing (the clock
 * included). */
static int push_async(store_state *s, const st_file *f, const unsigned char *data,
                      const store_push_meta *meta, const int *idx, const sparse_piece *pieces, int np,
                      push_result *out, int in_body, size_t off, int *nonfinite, char *err, size_t errlen)
{
    /* the worker completed this iteration, whether its gradient is applied
     * or dropped below (the stale-synchronous clocks) */
    int clocks = meta->worker >= 0 && meta->worker < STORE_MAX_WORKERS && meta->clock >= 0;
    if (clocks && !in_body)
        out->clocked = worker_state_clock_done(&s->workers, (int)meta->worker, meta->clock + 1);
    /* how stale is it? Drop it past --max_staleness (DropStaleGradientOptimizer) */
    int64_t staleness = meta->step >= 0 && meta->step <= s->global_step ? s->global_step - meta->step : 0;
    if (s->config.max_staleness >= 0 && staleness > s->config.max_staleness) {
        if (in_body && check_finite(f, data, err, errlen) != STORE_OK) {
            *nonfinite = 1;
            return STORE_EINVAL;
        }
        if (clocks && in_body)
            out->clocked = worker_state_clock_done(&s->workers, (int)meta->worker, meta->clock + 1);
        s->stale_dropped++;
        out->outcome = STORE_PUSH_STALE;
        out->step = s->global_step;
        return STORE_OK;
    }
    if (in_body) {
        int rc = apply_in_body(s, f, meta->body, off, idx, err, errlen);
        if (rc != STORE_OK) {
            *nonfinite = rc == STORE_EINVAL;
            return rc;
        }
        if (clocks)
            out->clocked = worker_state_clock_done(&s->workers, (int)meta->worker, meta->clock + 1);
    } else {
        /* the dense variables' indices (a sparse piece's tensors have -1) */
        int nd = 0, *di = malloc(sizeof(int) * (size_t)f->n_tensors);
        blob **dst = calloc((size_t)f->n_tensors, sizeof(blob *));
        sparse_batch sb;
        int sr = di && dst ? sparse_set_prepare(&s->sparse, pieces, np, &s->config.optim, &sb, err, errlen) : -1;
        if (sr != 0) {
            free(di);
            free(dst);
            return sr == -2 ? STORE_EINVAL : STORE_ENOMEM;
        }
        for (int k = 0; k < f->n_tensors; k++)
            if (idx[k] >= 0)
                di[nd++] = idx[k];
        if (prepare(s, di, nd, dst) != STORE_OK) {
            sparse_batch_free(&sb);
            free(di);
            free(dst);
            return STORE_ENOMEM;
        }
        for (int k = 0, j = 0; k < f->n_tensors; k++)
            if (idx[k] >= 0)
                update_into(s, &s->vars[idx[k]], dst[j++], (const float *)(data + f->tensors[k].begin), 1.0f);
        stream_note(s, f, data, meta, s->global_step);
        if (sb.n)
            s->changes++;
        sparse_set_commit(&s->sparse, &sb, &s->config.optim, 1.0f, s->global_step);
        free(di);
        free(dst);
    }
    if (meta->step >= 0)
        worker_state_staleness(&s->workers, staleness);
    out->step = ++s->global_step;
    out->stepped = 1;
    s->pushes_applied++;
    if (meta->has_loss) {
        s->last_loss = meta->loss;
        s->has_loss = 1;
    }
    sync_agg_remember(&s->agg, meta->push_id, out->step);
    return STORE_OK;
}

int store_apply_grads(store *h, const st_file *f, const unsigned char *data,
                      const store_push_meta *meta, int64_t *global_step, int *outcome,
                      char *err, size_t errlen)
{
    store_state *s = h->st;
    *outcome = STORE_PUSH_APPLIED;
    if (f->n_tensors == 0) {
        snprintf(err, errlen, "push holds no gradients");
        return STORE_EINVAL;
    }
    int has_sparse = 0;
    for (int k = 0; k < f->n_tensors; k++) {
        has_sparse |= sparse_tensor_name(f->tensors[k].name);
        if (strcmp(f->tensors[k].dtype, "F32") != 0 && !sparse_ids_tensor(&f->tensors[k])) {
            snprintf(err, errlen, "gradient '%s' has dtype %s, only F32 is accepted",
                     f->tensors[k].name, f->tensors[k].dtype);
            return STORE_EINVAL;
        }
    }
    /* in_body: the data section lies in the body */
    const blob *b = meta->body;
    int in_body = meta->in_body && b && data >= b->data && (uint64_t)(data - b->data) <= b->len &&
                  f->data_len <= b->len - (size_t)(data - b->data);
    size_t off = in_body ? (size_t)(data - b->data) : 0;
    int worker = meta->worker >= 0 && meta->worker < STORE_MAX_WORKERS ? (int)meta->worker : -1;
    if (!in_body && worker >= 0)
        store_touch(h, worker); /* a push renews its worker's lease */
    push_result r = {.step = -1, .outcome = STORE_PUSH_APPLIED};
    int *idx = malloc(sizeof(int) * (size_t)f->n_tensors);
    write_lock(s);
    int rc = STORE_OK, nonfinite = 0;
    /* unchecked gradients: checked here, first (as the caller would have),
     * unless the apply checks them in its one pass */
    /* ... and only a body that is mostly gradients becomes the variables'
     * data: a 4-byte gradient behind a 100 MiB header (ST_MAX_HEADER) would
     * otherwise keep the whole body as long as its variable stays */
    int fused = in_body && !has_sparse && fuses(s) && (uint64_t)f->data_len * 4 + PIN_SLACK >= b->cap &&
                !stream_touches(s, f); /* a stream applies it again from its gradients */
    sparse_piece *pieces = NULL;
    int np = 0;
    if (in_body && !fused && (rc = check_finite(f, data, err, errlen)) != STORE_OK) {
        nonfinite = 1;
    } else {
        if (in_body && !fused && worker >= 0)
            store_touch(h, worker);
        if (meta->push_id && sync_agg_seen(&s->agg, meta->push_id, &r.step)) {
            r.outcome = STORE_PUSH_DUPLICATE;
            if (fused && (rc = check_finite(f, data, err, errlen)) != STORE_OK)
                nonfinite = 1;
        } else if (!idx) {
            rc = STORE_ENOMEM;
        } else if ((rc = check_grads(s, f, idx, err, errlen)) != STORE_OK) {
            if (fused && check_finite(f, data, err, errlen) != STORE_OK) { /* its words first */
                rc = STORE_EINVAL;
                nonfinite = 1;
            }
        } else if (has_sparse &&
                   (rc = sparse_set_pieces(&s->sparse, f, data, &pieces, &np, err, errlen)) != 0) {
            rc = rc == -2 ? STORE_ENOMEM : STORE_EINVAL;
        } else {
            rc = s->config.sync ? push_sync(s, f, data, meta, pieces, np, &r, err, errlen)
                                : push_async(s, f, data, meta, idx, pieces, np, &r, fused, off, &nonfinite,
                                             err, errlen);
        }
    }
    free(pieces);
    int64_t step = s->global_step;
    write_unlock(s);
    free(idx);
    if (fused && !nonfinite && worker >= 0)
        store_touch(h, worker);
    if (r.step >= 0)
        *global_step = r.step;
    *outcome = r.outcome;
    notify(s, (r.stepped ? STORE_CHANGED_STEP : 0) | (r.clocked ? STORE_CHANGED_CLOCK : 0), step);
    return rc;
}

/* May f be streamed now (store.h)? Caller holds the write lock. */
static int streamable(const store_state *s, const st_file *f, const store_push_meta *meta)
{
    const store_config *c = &s->config;
    int64_t at;
    /* another push arriving meanwhile: read whole, as before (two pushers
     * of the same variables would each pay a second pass, the replay) */
    if (s->stream || atomic_load(&s->arriving) > 1 || c->sync || c->optim.kind != OPTIM_SGD || c->optim.clip_norm > 0 ||
        c->moving_average_decay > 0 || f->n_tensors == 0 ||
        (meta->push_id && sync_agg_seen(&s->agg, meta->push_id, &at)))
        return 0;
    int64_t staleness = meta->step >= 0 && meta->step <= s->global_step ? s->global_step - meta->step : 0;
    if (c->max_staleness >= 0 && staleness > c->max_staleness)
        return 0; /* dropped: read whole and checked as before */
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
        int i = sparse_tensor_name(t->name) ? -1 : find(s, t->name);
        if (i < 0 || !tensor_shape_equal(&t->shape, &s->vars[i].shape))
            return 0; /* refused after the body, in the words of store_apply_grads */
    }
    return 1;
}

void store_push_arriving(store *h, int delta)
{
    atomic_fetch_add(&h->st->arriving, delta);
}

int store_stream_begin(store *h, const st_file *f, const store_push_meta *meta, store_stream **out)
{
    store_state *s = h->st;
    *out = NULL;
    store_stream *ss = calloc(1, sizeof(*ss));
    size_t n = (size_t)(f->n_tensors > 0 ? f->n_tensors : 1);
    if (!ss)
        return STORE_ENOMEM;
    ss->names = calloc(n, sizeof(*ss->names));
    ss->numel = calloc(n, sizeof(*ss->numel));
    ss->w0 = calloc(n, sizeof(blob *));
    ss->next = calloc(n, sizeof(blob *));
    ss->expect = calloc(n, sizeof(blob *));
    ss->version = calloc(n, sizeof(*ss->version));
    if (!ss->names || !ss->numel || !ss->w0 || !ss->next || !ss->expect || !ss->version) {
        stream_free(ss);
        return STORE_ENOMEM;
    }
    write_lock(s);
    int rc = streamable(s, f, meta) ? STORE_OK : STORE_EMODE;
    for (int k = 0; rc == STORE_OK && k < f->n_tensors; k++) {
        store_var *v = &s->vars[find(s, f->tensors[k].name)];
        ss->n = k + 1;
        snprintf(ss->names[k], sizeof(ss->names[k]), "%s", v->name);
        ss->numel[k] = v->numel;
        ss->bytes += (uint64_t)v->numel * 4;
        ss->w0[k] = blob_ref(v->data);
        ss->expect[k] = blob_ref(v->data);
        ss->version[k] = v->version;
        /* from the pool: a buffer touched before, no page cleared per push */
        if (!(ss->next[k] = blob_new(s->pool, (size_t)v->numel * 4)))
            rc = STORE_ENOMEM;
    }
    if (rc == STORE_OK) {
        ss->config = s->config;
        ss->step0 = s->global_step;
        s->stream = ss;
    }
    write_unlock(s);
    if (rc != STORE_OK) {
        stream_free(ss);
        return rc;
    }
    *out = ss;
    return STORE_OK;
}

void store_stream_apply(store_stream *ss, int k, size_t at, const float *g, size_t n)
{
    optim_sgd_next(&ss->config.optim, (const float *)ss->w0[k]->data + at, g, (float *)ss->next[k]->data + at,
                   ss->step0, n);
}

int64_t store_stream_apply_bytes(store_stream *ss, int k, size_t at, const unsigned char *g, size_t n)
{
    return optim_sgd_next_bytes(&ss->config.optim, (const float *)ss->w0[k]->data + at, g,
                                (float *)ss->next[k]->data + at, ss->step0, n);
}

/* Every variable of the stream as it left it (its log aside), the same
 * configuration and learning rate? Caller holds the write lock. */
static int stream_intact(const store_state *s, const store_stream *ss)
{
    if (s->stream != ss || ss->lost || memcmp(&s->config, &ss->config, sizeof(s->config)) != 0 ||
        optim_learning_rate(&s->config.optim, s->global_step) != optim_learning_rate(&ss->config.optim, ss->step0))
        return 0;
    for (int j = 0; j < ss->n; j++) {
        int i = find(s, ss->names[j]);
        if (i < 0 || s->vars[i].data != ss->expect[j] || s->vars[i].version != ss->version[j] ||
            s->vars[i].numel != ss->numel[j])
            return 0;
    }
    return 1;
}

/* The stream's next versions become the variables' data (after the pushes
 * of its log, applied again on top). Caller holds write_lock (the write
 * lock is let go while the log is applied, as in apply_in_body). */
static void stream_publish(store_state *s, store_stream *ss)
{
    if (ss->n_log) {
        pthread_rwlock_unlock(&s->lock);
        for (int e = 0; e < ss->n_log; e++)
            for (int j = 0; j < ss->n; j++)
                if (ss->log[e].g[j])
                    optim_sgd_next(&ss->config.optim, (const float *)ss->next[j]->data, ss->log[e].g[j],
                                   (float *)ss->next[j]->data, ss->log[e].step, (size_t)ss->numel[j]);
        pthread_rwlock_wrlock(&s->lock);
    }
    blob *old = NULL; /* a body the variables were views of */
    for (int j = 0; j < ss->n; j++) {
        old = publish_version(s, &s->vars[find(s, ss->names[j])], ss->next[j], old);
        ss->next[j] = NULL;
    }
    publish_done(s, old);
}

int store_stream_commit(store *h, store_stream *ss, const store_push_meta *meta, int64_t *global_step,
                        int *outcome, char *err, size_t errlen)
{
    store_state *s = h->st;
    int rc = STORE_OK, clocks = meta->worker >= 0 && meta->worker < STORE_MAX_WORKERS && meta->clock >= 0;
    push_result r = {.step = -1, .outcome = STORE_PUSH_APPLIED};
    write_lock(s);
    int64_t staleness = meta->step >= 0 && meta->step <= s->global_step ? s->global_step - meta->step : 0;
    if (meta->push_id && sync_agg_seen(&s->agg, meta->push_id, &r.step)) {
        r.outcome = STORE_PUSH_DUPLICATE; /* the same push, applied meanwhile */
    } else if (!stream_intact(s, ss)) {
        snprintf(err, errlen, "the variables of this push changed while it arrived (a PUT, a restore, a "
                              "configuration, or more pushes than a push keeps): push it again");
        rc = STORE_ECHANGED;
    } else if (s->config.max_staleness >= 0 && staleness > s->config.max_staleness) {
        s->stale_dropped++;
        r.outcome = STORE_PUSH_STALE;
        r.step = s->global_step;
    } else {
        stream_publish(s, ss);
        s->pushes_streamed++;
        s->push_replays += ss->n_log;
        if (meta->step >= 0)
            worker_state_staleness(&s->workers, staleness);
        r.step = ++s->global_step;
        r.stepped = 1;
        s->pushes_applied++;
        if (meta->has_loss) {
            s->last_loss = meta->loss;
            s->has_loss = 1;
        }
        sync_agg_remember(&s->agg, meta->push_id, r.step);
    }
    if (rc == STORE_OK && clocks && r.outcome != STORE_PUSH_DUPLICATE)
        r.clocked = worker_state_clock_done(&s->workers, (int)meta->worker, meta->clock + 1);
    if (s->stream == ss)
        s->stream = NULL;
    int64_t step = s->global_step;
    write_unlock(s);
    if (rc == STORE_OK && meta->worker >= 0 && meta->worker < STORE_MAX_WORKERS)
        store_touch(h, (int)meta->worker); /* a push renews its worker's lease */
    if (r.step >= 0)
        *global_step = r.step;
    *outcome = r.outcome;
    notify(s, (r.stepped ? STORE_CHANGED_STEP : 0) | (r.clocked ? STORE_CHANGED_CLOCK : 0), step);
    return rc;
}

void store_stream_end(store *h, store_stream *ss)
{
    if (!ss)
        return;
    store_state *s = h->st;
    write_lock(s);
    if (s->stream == ss)
        s->stream = NULL;
    write_unlock(s);
    stream_free(ss);
}

int store_configure(store *h, const store_config *c, char *err, size_t errlen)
{
    store_state *s = h->st;
    write_lock(s);
    int rc = STORE_OK;
    if (s->configured && s->global_step > 0 && memcmp(&s->config, c, sizeof(*c)) != 0) {
        snprintf(err, errlen, "training started (global_step %lld) with another configuration",
                 (long long)s->global_step);
        rc = STORE_ECONFLICT;
    } else {
        if (memcmp(&s->config, c, sizeof(*c)) != 0) {
            /* another optimizer or mode: its state and any gradients waiting
             * under the old configuration start afresh */
            if (s->config.optim.kind != c->optim.kind)
                for (int i = 0; i < s->n; i++) {
                    free(s->vars[i].slots);
                    s->vars[i].slots = NULL;
                    s->vars[i].n_slots = 0;
                    s->vars[i].updates = 0;
                }
            /* another decay (or none): the averages start from the variables */
            if (s->config.moving_average_decay != c->moving_average_decay)
                for (int i = 0; i < s->n; i++) {
                    free(s->vars[i].shadow);
                    s->vars[i].shadow = NULL;
                }
            sync_agg_clear(&s->agg);
        }
        if (!s->configured || memcmp(&s->config, c, sizeof(*c)) != 0)
            s->changes++;
        /* every worker of the run starts with a lease, and a step begins */
        s->step_started_ms = clk_mono_ms();
        worker_state_start(&s->workers, c->workers, s->step_started_ms);
        s->config = *c;
        s->learning_rate = c->optim.learning_rate;
        s->configured = 1;
    }
    write_unlock(s);
    return rc;
}

int store_get_config(store *h, store_config *out)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    int ok = s->configured;
    *out = s->config;
    pthread_rwlock_unlock(&s->lock);
    return ok ? STORE_OK : STORE_ENOENT;
}

void store_totals(store *h, int *n_vars, uint64_t *bytes, int64_t *global_step, int *has_loss,
                  double *last_loss)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    *n_vars = s->n;
    *bytes = s->bytes;
    *global_step = s->global_step;
    *has_loss = s->has_loss;
    *last_loss = s->last_loss;
    pthread_rwlock_unlock(&s->lock);
}

int64_t store_global_step(store *h)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    int64_t step = s->global_step;
    pthread_rwlock_unlock(&s->lock);
    return step;
}

/* Copies of the sparse tables' rows, least recently updated first. Caller
 * holds the lock. */
static int save_sparse(const store_state *s, store_saved *out)
{
    if (s->sparse.n == 0)
        return STORE_OK;
    if (!(out->sparse = calloc((size_t)s->sparse.n, sizeof(store_saved_sparse))))
        return STORE_ENOMEM;
    for (int i = 0; i < s->sparse.n; i++) {
        const sparse_table *t = &s->sparse.t[i];
        store_saved_sparse *o = &out->sparse[i];
        out->n_sparse = i + 1;
        memcpy(o->name, t->name, sizeof(o->name));
        o->decl = t->d;
        o->n = t->n;
        o->updates = t->updates;
        o->evicted = t->evicted;
        o->version = t->version;
        o->n_slots = t->n_slots;
        const size_t dim = (size_t)t->d.dim, rows = (size_t)(t->n ? t->n : 1);
        o->ids = malloc(sizeof(int64_t) * rows);
        o->values = malloc(sizeof(float) * rows * dim);
        o->slots = t->n_slots ? malloc(sizeof(float) * rows * dim * (size_t)t->n_slots) : NULL;
        if (!o->ids || !o->values || (t->n_slots && !o->slots))
            return STORE_ENOMEM;
        size_t k = 0;
        for (int64_t r = sparse_oldest(t); r >= 0; r = sparse_newer(t, r), k++) {
            o->ids[k] = t->ids[r];
            memcpy(o->values + k * dim, t->values + (size_t)r * dim, sizeof(float) * dim);
            if (t->n_slots > 0)
                memcpy(o->slots + k * dim, t->slot0 + (size_t)r * dim, sizeof(float) * dim);
            if (t->n_slots > 1)
                memcpy(o->slots + ((size_t)t->n + k) * dim, t->slot1 + (size_t)r * dim, sizeof(float) * dim);
        }
    }
    return STORE_OK;
}

/* The tables of a checkpoint, built apart (nothing of the store changes on
 * failure). */
static int restore_sparse(const store_saved *sv, const optim_config *c, sparse_set *out)
{
    memset(out, 0, sizeof(*out));
    for (int i = 0; i < sv->n_sparse; i++) {
        const store_saved_sparse *o = &sv->sparse[i];
        int created;
        char err[256];
        if (sparse_set_declare(out, o->name, &o->decl, &created, err, sizeof(err)) != 0)
            goto fail;
        sparse_table *t = &out->t[sparse_set_find(out, o->name)];
        int with_slots = o->n_slots > 0 && o->n_slots == optim_slots(c->kind);
        if (with_slots && sparse_ensure_slots(t, c) != 0)
            goto fail;
        const size_t dim = (size_t)o->decl.dim;
        for (int64_t k = 0; k < o->n; k++) {
            const float *s0 = with_slots ? o->slots + (size_t)k * dim : NULL;
            const float *s1 = with_slots && o->n_slots > 1 ? o->slots + ((size_t)o->n + (size_t)k) * dim : NULL;
            if (sparse_restore_row(t, o->ids[k], o->values + (size_t)k * dim, s0, s1) != 0)
                goto fail;
        }
        t->updates = o->updates;
        t->evicted = o->evicted;
        t->version = o->version;
    }
    return STORE_OK;
fail:
    sparse_set_free(out);
    return STORE_ENOMEM;
}

int store_save(store *h, store_saved *out)
{
    store_state *s = h->st;
    memset(out, 0, sizeof(*out));
    pthread_rwlock_rdlock(&s->lock);
    out->vars = calloc((size_t)(s->n ? s->n : 1), sizeof(store_saved_var));
    if (!out->vars) {
        pthread_rwlock_unlock(&s->lock);
        return STORE_ENOMEM;
    }
    for (int i = 0; i < s->n; i++) {
        const store_var *v = &s->vars[i];
        store_saved_var *o = &out->vars[i];
        memcpy(o->name, v->name, sizeof(o->name));
        o->shape = v->shape;
        o->numel = v->numel;
        o->version = v->version;
        o->updates = v->updates;
        o->data = blob_ref(v->data);
        out->n = i + 1;
        if (v->n_slots > 0) {
            size_t nb = (size_t)v->n_slots * (size_t)v->numel * sizeof(float);
            if (!(o->slots = malloc(nb))) {
                pthread_rwlock_unlock(&s->lock);
                store_saved_free(out);
                return STORE_ENOMEM;
            }
            memcpy(o->slots, v->slots, nb);
            o->n_slots = v->n_slots;
        }
        if (v->shadow) {
            size_t nb = (size_t)v->numel * sizeof(float);
            if (!(o->shadow = malloc(nb))) {
                pthread_rwlock_unlock(&s->lock);
                store_saved_free(out);
                return STORE_ENOMEM;
            }
            memcpy(o->shadow, v->shadow, nb);
        }
    }
    if (save_sparse(s, out) != STORE_OK) {
        pthread_rwlock_unlock(&s->lock);
        store_saved_free(out);
        return STORE_ENOMEM;
    }
    out->global_step = s->global_step;
    out->config = s->config;
    out->configured = s->configured;
    out->has_loss = s->has_loss;
    out->last_loss = s->last_loss;
    out->stale_dropped = s->stale_dropped;
    out->pushes_applied = s->pushes_applied;
    out->changes = s->changes;
    if (s->placement && !(out->placement = strdup(s->placement))) {
        pthread_rwlock_unlock(&s->lock);
        store_saved_free(out);
        return STORE_ENOMEM;
    }
    pthread_rwlock_unlock(&s->lock);
    return STORE_OK;
}

void store_saved_free(store_saved *sv)
{
    for (int i = 0; i < sv->n; i++) {
        blob_unref(sv->vars[i].data);
        free(sv->vars[i].slots);
        free(sv->vars[i].shadow);
    }
    free(sv->vars);
    for (int i = 0; i < sv->n_sparse; i++) {
        free(sv->sparse[i].ids);
        free(sv->sparse[i].values);
        free(sv->sparse[i].slots);
    }
    free(sv->sparse);
    free(sv->placement);
    memset(sv, 0, sizeof(*sv));
}

uint64_t store_changes(store *h)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    uint64_t c = s->changes;
    pthread_rwlock_unlock(&s->lock);
    return c;
}

int store_restore(store *h, store_saved *sv)
{
    store_state *s = h->st;
    sparse_set sparse;
    if (restore_sparse(sv, sv->configured ? &sv->config.optim : &s->config.optim, &sparse) != STORE_OK)
        return STORE_ENOMEM;
    store_var *vars = calloc((size_t)(sv->n ? sv->n : 1), sizeof(store_var));
    if (!vars) {
        sparse_set_free(&sparse);
        return STORE_ENOMEM;
    }
    uint64_t bytes = 0;
    for (int i = 0; i < sv->n; i++) {
        store_saved_var *o = &sv->vars[i];
        store_var *v = &vars[i];
        memcpy(v->name, o->name, sizeof(v->name));
        v->shape = o->shape;
        v->numel = o->numel;
        v->version = o->version;
        v->updates = o->updates;
        v->data = o->data;
        v->slots = o->slots;
        v->n_slots = o->n_slots;
        /* a checkpoint without averages: they start from the variables */
        v->shadow = sv->configured && sv->config.moving_average_decay > 0 ? o->shadow : NULL;
        if (!v->shadow)
            free(o->shadow);
        o->data = NULL;
        o->slots = NULL;
        o->shadow = NULL;
        bytes += (uint64_t)v->numel * 4;
    }
    write_lock(s);
    for (int i = 0; i < s->n; i++) {
        blob_unref(s->vars[i].data);
        free(s->vars[i].slots);
        free(s->vars[i].shadow);
    }
    free(s->vars);
    sync_agg_clear(&s->agg);
    sparse_set_free(&s->sparse);
    s->sparse = sparse;
    s->vars = vars;
    s->cap = sv->n ? sv->n : 1;
    s->n = sv->n;
    s->bytes = bytes;
    s->global_step = sv->global_step;
    if (sv->configured) { /* else the flags' configuration stays, as at start */
        s->config = sv->config;
        s->learning_rate = sv->config.optim.learning_rate;
    }
    s->configured = sv->configured;
    s->has_loss = sv->has_loss;
    s->last_loss = sv->last_loss;
    s->stale_dropped = sv->stale_dropped;
    s->pushes_applied = sv->pushes_applied;
    s->changes = sv->changes;
    free(s->placement);
    s->placement = sv->placement;
    sv->placement = NULL;
    /* the workers get a lease from now, as at configuration */
    int64_t now = clk_mono_ms();
    worker_state_start(&s->workers, s->config.workers, now);
    s->step_started_ms = now;
    write_unlock(s);
    pool_follow(s, bytes);
    return STORE_OK;
}


int store_set_placement(store *h, const char *json_text)
{
    store_state *s = h->st;
    char *copy = json_text ? strdup(json_text) : NULL;
    if (json_text && !copy)
        return STORE_ENOMEM;
    write_lock(s);
    if (!s->placement || !copy || strcmp(s->placement, copy) != 0)
        s->changes++;
    free(s->placement);
    s->placement = copy;
    write_unlock(s);
    return STORE_OK;
}

char *store_get_placement(store *h)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    char *c = s->placement ? strdup(s->placement) : NULL;
    pthread_rwlock_unlock(&s->lock);
    return c;
}

void store_clock_start(store *h, int worker, int64_t clock)
{
    worker_state_clock_start(&h->st->workers, worker, clock);
}

int store_clock_done(store *h, int worker, int64_t done)
{
    if (!worker_state_clock_done(&h->st->workers, worker, done))
        return 0;
    notify(h->st, STORE_CHANGED_CLOCK, 0);
    return 1;
}

int64_t store_min_clock(store *h)
{
    /* lock-free (atomics only): the clock waiters call it under their mutex,
     * which must not wait behind a writer applying a large gradient */
    return worker_state_min_clock(&h->st->workers, clk_mono_ms());
}

json_t *store_staleness_json(store *h)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    json_t *o = worker_state_staleness_json(&s->workers);
    json_object_set_new(o, "max_staleness", json_integer(s->config.max_staleness));
    json_object_set_new(o, "bound", json_integer(s->config.staleness));
    json_object_set_new(o, "clocks", worker_state_clocks_json(&s->workers, s->config.workers));
    pthread_rwlock_unlock(&s->lock);
    return o;
}

void store_set_lease_ms(store *h, int64_t ms)
{
    h->st->workers.lease_ms = ms;
}

int64_t store_lease_ms(store *h)
{
    return h->st->workers.lease_ms;
}

void store_start_at(store *h, int64_t step)
{
    store_state *s = h->st;
    write_lock(s);
    s->global_step = step;
    write_unlock(s);
}

void store_get_counts(store *h, store_counts *out)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    out->configured = s->configured;
    out->stale_dropped = s->stale_dropped;
    out->pending = s->agg.n;
    out->pushes_streamed = s->pushes_streamed;
    out->push_replays = s->push_replays;
    pthread_rwlock_unlock(&s->lock);
}

int store_get_sync_view(store *h, store_sync_view *v)
{
    store_state *s = h->st;
    memset(v, 0, sizeof(*v));
    int64_t now = clk_mono_ms();
    pthread_rwlock_rdlock(&s->lock);
    int n = s->config.workers;
    if (n > 0 && !(v->member = malloc((size_t)n))) {
        pthread_rwlock_unlock(&s->lock);
        return STORE_ENOMEM;
    }
    v->sync = s->configured && s->config.sync;
    v->workers = n;
    v->replicas = s->config.replicas_to_aggregate;
    for (int w = 0; w < n; w++) {
        int pending = sync_agg_has(&s->agg, w);
        int gone = worker_state_left(&s->workers, w), alive = worker_state_alive(&s->workers, w, now);
        v->live += pending || (!gone && alive);
        v->member[w] = pending ? STORE_MEMBER_HAVE
                     : gone    ? STORE_MEMBER_LEFT
                     : !alive  ? STORE_MEMBER_DEAD
                               : STORE_MEMBER_WAITING;
    }
    v->global_step = s->global_step;
    v->lease_ms = s->workers.lease_ms;
    v->step_secs = (double)(now - s->step_started_ms) / 1000.0;
    v->waiting_secs = s->agg.first_ms ? (double)(now - s->agg.first_ms) / 1000.0 : 0.0;
    pthread_rwlock_unlock(&s->lock);
    return STORE_OK;
}

int store_sparse_declare(store *h, const char *name, const sparse_decl *d, int *created, char *err,
                         size_t errlen)
{
    store_state *s = h->st;
    if (sparse_decl_check(d, err, errlen) != 0)
        return STORE_EINVAL;
    write_lock(s);
    int rc = STORE_OK;
    if (find(s, name) >= 0) {
        snprintf(err, errlen, "'%s' is a dense variable", name);
        rc = STORE_ECONFLICT;
    } else {
        int dr = sparse_set_declare(&s->sparse, name, d, created, err, errlen);
        rc = dr == 0 ? STORE_OK : dr == -1 ? STORE_ENOMEM : STORE_ECONFLICT;
        if (rc == STORE_OK && *created)
            s->changes++;
    }
    write_unlock(s);
    return rc;
}

int store_sparse_peek(store *h, const char *name, sparse_decl *d)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    int i = sparse_set_find(&s->sparse, name);
    if (i >= 0)
        *d = s->sparse.t[i].d;
    pthread_rwlock_unlock(&s->lock);
    return i >= 0 ? STORE_OK : STORE_ENOENT;
}

int store_sparse_lookup(store *h, const char *name, const unsigned char *ids, int64_t n, float *out,
                        int64_t *global_step, char *err, size_t errlen)
{
    store_state *s = h->st;
    pthread_rwlock_rdlock(&s->lock);
    int i = sparse_set_find(&s->sparse, name), rc = STORE_OK;
    if (i < 0) {
        snprintf(err, errlen, "no sparse variable '%s'", name);
        rc = STORE_ENOENT;
    } else if (sparse_check_ids(&s->sparse.t[i], ids, n, err, errlen) != 0) {
        rc = STORE_EINVAL;
    } else {
        sparse_lookup(&s->sparse.t[i], ids, n, out);
    }
    *global_step = s->global_step;
    pthread_rwlock_unlock(&s->lock);
    return rc;
}

int store_sparse_stats(store *h, store_sparse_stat **out, int *n)
{
    store_state *s = h->st;
    *out = NULL;
    *n = 0;
    pthread_rwlock_rdlock(&s->lock);
    int rc = STORE_OK;
    if (s->sparse.n > 0 && !(*out = calloc((size_t)s->sparse.n, sizeof(store_sparse_stat))))
        rc = STORE_ENOMEM;
    for (int i = 0; rc == STORE_OK && i < s->sparse.n; i++) {
        const sparse_table *t = &s->sparse.t[i];
        store_sparse_stat *o = &(*out)[i];
        memcpy(o->name, t->name, sizeof(o->name));
        o->decl = t->d;
        o->held = t->n;
        o->evicted = t->evicted;
        o->updates = t->updates;
        o->bytes = sparse_table_bytes(t);
        o->version = t->version;
        *n = i + 1;
    }
    pthread_rwlock_unlock(&s->lock);
    return rc;
}
