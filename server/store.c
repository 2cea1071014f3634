/* store.c - the shard's variables, their versions and updates. */
#include "store.h"

#include <jansson.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"

static void pending_clear(store *s);
static int replicas_needed(const store *s);

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
    optim_defaults(&s->config.optim, OPTIM_SGD, learning_rate);
    s->config.replicas_to_aggregate = 1;
    s->config.workers = 1;
    atomic_store(&s->n_workers, 1);
    s->config.max_staleness = -1;
    s->config.staleness = -1;
    s->lease_ms = 10000;
    s->step_started_ms = clk_mono_ms();
    return STORE_OK;
}

void store_touch(store *s, int worker)
{
    if (worker < 0 || worker >= STORE_MAX_WORKERS)
        return;
    atomic_store(&s->lease_until[worker], clk_mono_ms() + s->lease_ms);
    atomic_store(&s->left[worker], 0);
}

void store_leave(store *s, int worker)
{
    if (worker < 0 || worker >= STORE_MAX_WORKERS)
        return;
    atomic_store(&s->left[worker], 1);
}

/* Workers of the run whose lease is running, or whose gradient for the
 * current step is in (a worker waiting in a long poll is alive). Caller holds
 * the lock. */
static int live_workers(const store *s, int64_t now)
{
    int live = 0;
    for (int w = 0; w < s->config.workers; w++) {
        int in = 0;
        for (int i = 0; i < s->n_pending && !in; i++)
            in = s->pending[i].worker == w;
        live += in || (!atomic_load(&s->left[w]) && atomic_load(&s->lease_until[w]) > now);
    }
    return live;
}

void store_destroy(store *s)
{
    for (int i = 0; i < s->n; i++) {
        blob_unref(s->vars[i].data);
        free(s->vars[i].slots);
    }
    free(s->vars);
    pending_clear(s);
    free(s->pending);
    free(s->scratch);
    free(s->placement);
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
    return store_get_all_pending(s, out, n, global_step, -1, NULL);
}

int store_get_all_pending(store *s, store_snap **out, int *n, int64_t *global_step, int worker,
                          int *pending)
{
    pthread_rwlock_rdlock(&s->lock);
    if (pending) {
        *pending = 0;
        for (int i = 0; i < s->n_pending; i++)
            *pending |= s->pending[i].worker == worker;
    }
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
        if (!tensor_shape_equal(shape, &v->shape) && s->n_pending)
            pending_clear(s); /* sync gradients computed for the old shape */
        if (numel != v->numel) { /* optimizer state no longer fits */
            free(v->slots);
            v->slots = NULL;
            v->n_slots = 0;
            v->updates = 0;
        }
        v->shape = *shape;
        v->numel = numel;
        v->version++;
        s->changes++;
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
    s->changes++;
    s->bytes += (uint64_t)numel * 4;
    *version = 1;
    *created = 1;
    uint64_t bytes = s->bytes;
    pthread_rwlock_unlock(&s->lock);
    pool_follow(s, bytes);
    return STORE_OK;
}

/* The blob the next version of v is written into, or NULL when out of memory. */
static blob *writable(store *s, store_var *v)
{
    if (atomic_load(&v->data->refs) == 1)
        return v->data;
    return blob_new(s->pool, (size_t)v->numel * 4);
}

/* The optimizer's state for v exists (zeros at first). Caller holds the write lock. */
static int ensure_slots(store *s, store_var *v)
{
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

/* v's next version into dst (see writable) from gradient g * scale. */
static void update_into(store *s, store_var *v, blob *dst, const float *g, float scale)
{
    v->updates++;
    float *s0 = v->n_slots > 0 ? v->slots : NULL;
    float *s1 = v->n_slots > 1 ? v->slots + v->numel : NULL;
    /* the schedule reads global_step before this update */
    optim_apply(&s->config.optim, (const float *)v->data->data, (float *)dst->data, g, scale, s0,
                s1, v->updates, s->global_step, (size_t)v->numel);
    if (dst != v->data) {
        blob_unref(v->data);
        v->data = dst;
    }
    v->version++;
    s->changes++;
}

void store_on_change(store *s, void (*fn)(void *ctx, unsigned what, int64_t step), void *ctx)
{
    s->on_change = fn;
    s->on_change_ctx = ctx;
}

static void notify(store *s, unsigned what, int64_t step)
{
    if (s->on_change && what)
        s->on_change(s->on_change_ctx, what, step);
}

/* max-only: a late or repeated report never lowers it. 1 when raised. */
static int clock_raise(store *s, int worker, int64_t done)
{
    int64_t was = atomic_load(&s->clock_done[worker]);
    while (done > was)
        if (atomic_compare_exchange_weak(&s->clock_done[worker], &was, done))
            return 1;
    return 0;
}

int store_apply_grad(store *s, const char *name, const float *g, int64_t numel,
                     int64_t *global_step, uint64_t *version)
{
    pthread_rwlock_wrlock(&s->lock);
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
            pthread_rwlock_unlock(&s->lock);
            return STORE_ENOMEM;
        }
        update_into(s, &s->vars[i], dst, g, 1.0f);
        *global_step = ++s->global_step;
        s->pushes_applied++;
        *version = s->vars[i].version;
    }
    int64_t step = s->global_step;
    pthread_rwlock_unlock(&s->lock);
    if (rc == STORE_OK)
        notify(s, STORE_CHANGED_STEP, step);
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

static void push_remember(store *s, const char *id, int64_t step)
{
    if (!id)
        return;
    snprintf(s->pushes[s->push_next].id, sizeof(s->pushes[0].id), "%s", id);
    s->pushes[s->push_next].step = step;
    s->push_next = (s->push_next + 1) % STORE_PUSH_IDS;
}

/* Every name exists with the same shape; idx[k] = its variable. */
static int check_grads(const store *s, const st_file *f, int *idx, char *err, size_t errlen)
{
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
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
static int prepare(store *s, const int *idx, int n, blob **dst)
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

static void pending_clear(store *s)
{
    for (int i = 0; i < s->n_pending; i++) {
        blob_unref(s->pending[i].body);
        st_file_free(&s->pending[i].f);
    }
    s->n_pending = 0;
    s->first_pending_ms = 0;
}

/* Sync: the step has its replicas. Sum each variable's gradients in worker
 * order, average, apply once. Caller holds the write lock. */
static int aggregate(store *s)
{
    int *idx = malloc(sizeof(int) * (size_t)(s->n ? s->n : 1));
    int *cnt = calloc((size_t)(s->n ? s->n : 1), sizeof(int));
    blob **dst = calloc((size_t)(s->n ? s->n : 1), sizeof(blob *));
    int rc = STORE_OK, n = 0;
    if (!idx || !cnt || !dst) {
        rc = STORE_ENOMEM;
        goto out;
    }
    int64_t maxn = 0;
    for (int p = 0; p < s->n_pending; p++)
        for (int k = 0; k < s->pending[p].f.n_tensors; k++) {
            int i = find(s, s->pending[p].f.tensors[k].name);
            if (i < 0 || !tensor_shape_equal(&s->pending[p].f.tensors[k].shape, &s->vars[i].shape))
                continue; /* cannot happen: variables are never removed, reshaping drops these */
            if (cnt[i]++ == 0)
                idx[n++] = i;
            if (s->vars[i].numel > maxn)
                maxn = s->vars[i].numel;
        }
    if ((size_t)maxn > s->scratch_cap) {
        float *sc = realloc(s->scratch, (size_t)maxn * sizeof(float));
        if (!sc) {
            rc = STORE_ENOMEM;
            goto out;
        }
        s->scratch = sc;
        s->scratch_cap = (size_t)maxn;
    }
    if ((rc = prepare(s, idx, n, dst)) != STORE_OK)
        goto out;
    for (int k = 0; k < n; k++) {
        store_var *v = &s->vars[idx[k]];
        int first = 1;
        for (int p = 0; p < s->n_pending; p++) {
            int t = st_find(&s->pending[p].f, v->name);
            if (t < 0 || !tensor_shape_equal(&s->pending[p].f.tensors[t].shape, &v->shape))
                continue; /* (store_put drops pending gradients of a reshaped variable) */
            const float *g = (const float *)(s->pending[p].data + s->pending[p].f.tensors[t].begin);
            if (first)
                memcpy(s->scratch, g, (size_t)v->numel * 4);
            else
                for (int64_t e = 0; e < v->numel; e++)
                    s->scratch[e] += g[e];
            first = 0;
        }
        update_into(s, v, dst[k], s->scratch, 1.0f / (float)cnt[idx[k]]);
    }
    double loss = 0;
    int nl = 0;
    for (int p = 0; p < s->n_pending; p++)
        if (s->pending[p].has_loss) {
            loss += s->pending[p].loss;
            nl++;
        }
    if (nl) {
        s->last_loss = loss / nl;
        s->has_loss = 1;
    }
    s->global_step++;
    s->pushes_applied++;
    pending_clear(s);
    s->step_started_ms = clk_mono_ms();
    s->first_pending_ms = 0;
out:
    free(idx);
    free(cnt);
    free(dst);
    return rc;
}

int store_sync_tick(store *s)
{
    pthread_rwlock_wrlock(&s->lock);
    int stepped = s->config.sync && s->n_pending > 0 && s->n_pending >= replicas_needed(s) &&
                  aggregate(s) == STORE_OK;
    int64_t step = s->global_step;
    pthread_rwlock_unlock(&s->lock);
    notify(s, (stepped ? STORE_CHANGED_STEP : 0) | STORE_CHANGED_CLOCK, step);
    return stepped;
}

/* Gradients a sync step needs right now: min(R, live workers), at least 1. */
static int replicas_needed(const store *s)
{
    int r = s->config.replicas_to_aggregate;
    int live = live_workers(s, clk_mono_ms());
    if (live < r)
        r = live;
    return r > 0 ? r : 1;
}

int store_apply_grads(store *s, st_file *f, const unsigned char *data,
                      const store_push_meta *meta, int64_t *global_step, int *outcome,
                      char *err, size_t errlen)
{
    *outcome = STORE_PUSH_APPLIED;
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
    if (meta->worker >= 0 && meta->worker < STORE_MAX_WORKERS)
        store_touch(s, (int)meta->worker); /* a push renews its worker's lease */
    pthread_rwlock_wrlock(&s->lock);
    int rc = STORE_OK, stepped = 0, clocked = 0;
    int *idx = NULL;
    blob **dst = NULL;
    if (meta->push_id && push_seen(s, meta->push_id, global_step)) {
        *outcome = STORE_PUSH_DUPLICATE;
        goto out;
    }
    idx = malloc(sizeof(int) * (size_t)f->n_tensors);
    dst = calloc((size_t)f->n_tensors, sizeof(blob *));
    if (!idx || !dst) {
        rc = STORE_ENOMEM;
        goto out;
    }
    if ((rc = check_grads(s, f, idx, err, errlen)) != STORE_OK)
        goto out;

    if (s->config.sync) {
        if (meta->worker < 0 || meta->step < 0) {
            snprintf(err, errlen, "sync training needs metadata 'worker' and 'step' with every push");
            rc = STORE_EINVAL;
            goto out;
        }
        if (meta->worker >= s->config.workers) {
            snprintf(err, errlen, "worker %lld is not one of the %d workers of this sync run",
                     meta->worker, s->config.workers);
            rc = STORE_EINVAL;
            goto out;
        }
        *global_step = s->global_step;
        if (meta->step < s->global_step) {
            s->stale_dropped++;
            *outcome = STORE_PUSH_STALE;
            goto out;
        }
        if (meta->step > s->global_step) {
            snprintf(err, errlen, "gradient computed from step %lld, but this shard is at step %lld",
                     meta->step, (long long)s->global_step);
            rc = STORE_EAHEAD;
            goto out;
        }
        int at = 0;
        while (at < s->n_pending && s->pending[at].worker < meta->worker)
            at++;
        if (at < s->n_pending && s->pending[at].worker == meta->worker) {
            *outcome = STORE_PUSH_DUPLICATE;
            goto out;
        }
        if (s->n_pending == s->cap_pending) {
            int nc = s->cap_pending ? 2 * s->cap_pending : 8;
            store_pending *np = realloc(s->pending, sizeof(*np) * (size_t)nc);
            if (!np) {
                rc = STORE_ENOMEM;
                goto out;
            }
            s->pending = np;
            s->cap_pending = nc;
        }
        memmove(&s->pending[at + 1], &s->pending[at], sizeof(store_pending) * (size_t)(s->n_pending - at));
        store_pending *p = &s->pending[at];
        p->worker = (int)meta->worker;
        p->body = blob_ref(meta->body);
        p->f = *f;
        memset(f, 0, sizeof(*f)); /* the store owns it now */
        p->data = data;
        p->has_loss = meta->has_loss;
        p->loss = meta->loss;
        if (s->n_pending++ == 0)
            s->first_pending_ms = clk_mono_ms();
        push_remember(s, meta->push_id, s->global_step);
        *outcome = STORE_PUSH_PENDING;
        if (s->n_pending >= replicas_needed(s)) {
            if (aggregate(s) != STORE_OK) {
                /* keep the gradients; the next push retries the step */
                rc = STORE_OK;
                goto out;
            }
            *outcome = STORE_PUSH_APPLIED;
            stepped = 1;
        }
        *global_step = s->global_step;
        goto out;
    }

    /* the worker completed this iteration, whether its gradient is applied
     * or dropped below (the stale-synchronous clocks) */
    if (meta->worker >= 0 && meta->worker < STORE_MAX_WORKERS && meta->clock >= 0)
        clocked = clock_raise(s, (int)meta->worker, meta->clock + 1);
    /* async: how stale is it? Drop it past --max_staleness
     * (DropStaleGradientOptimizer) */
    int64_t staleness = meta->step >= 0 && meta->step <= s->global_step ? s->global_step - meta->step : 0;
    if (s->config.max_staleness >= 0 && staleness > s->config.max_staleness) {
        s->stale_dropped++;
        *outcome = STORE_PUSH_STALE;
        *global_step = s->global_step;
        goto out;
    }
    if ((rc = prepare(s, idx, f->n_tensors, dst)) != STORE_OK)
        goto out;
    for (int k = 0; k < f->n_tensors; k++)
        update_into(s, &s->vars[idx[k]], dst[k], (const float *)(data + f->tensors[k].begin), 1.0f);
    if (meta->step >= 0) {
        int b = staleness < 4 ? (int)staleness : staleness < 8 ? 4 : staleness < 16 ? 5
              : staleness < 32 ? 6 : staleness < 64 ? 7 : 8;
        s->staleness_hist[b]++;
        s->staleness_sum += staleness;
        s->staleness_count++;
        if (staleness > s->staleness_max)
            s->staleness_max = staleness;
    }

    *global_step = ++s->global_step;
    s->pushes_applied++;
    stepped = 1;
    if (meta->has_loss) {
        s->last_loss = meta->loss;
        s->has_loss = 1;
    }
    push_remember(s, meta->push_id, *global_step);
out:;
    int64_t step = s->global_step;
    pthread_rwlock_unlock(&s->lock);
    free(idx);
    free(dst);
    notify(s, (stepped ? STORE_CHANGED_STEP : 0) | (clocked ? STORE_CHANGED_CLOCK : 0), step);
    return rc;
}

int store_configure(store *s, const store_config *c, char *err, size_t errlen)
{
    pthread_rwlock_wrlock(&s->lock);
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
            pending_clear(s);
        }
        if (!s->configured || memcmp(&s->config, c, sizeof(*c)) != 0)
            s->changes++;
        /* every worker of the run starts with a lease, and a step begins */
        s->step_started_ms = clk_mono_ms();
        int64_t until = s->step_started_ms + s->lease_ms;
        for (int w = 0; w < c->workers; w++) {
            atomic_store(&s->lease_until[w], until);
            atomic_store(&s->left[w], 0);
        }
        s->config = *c;
        atomic_store(&s->n_workers, c->workers);
        s->learning_rate = c->optim.learning_rate;
        s->configured = 1;
    }
    pthread_rwlock_unlock(&s->lock);
    return rc;
}

int store_get_config(store *s, store_config *out)
{
    pthread_rwlock_rdlock(&s->lock);
    int ok = s->configured;
    *out = s->config;
    pthread_rwlock_unlock(&s->lock);
    return ok;
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

int store_save(store *s, store_saved *out)
{
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
    }
    free(sv->vars);
    free(sv->placement);
    memset(sv, 0, sizeof(*sv));
}

uint64_t store_changes(store *s)
{
    pthread_rwlock_rdlock(&s->lock);
    uint64_t c = s->changes;
    pthread_rwlock_unlock(&s->lock);
    return c;
}

int store_restore(store *s, store_saved *sv)
{
    store_var *vars = calloc((size_t)(sv->n ? sv->n : 1), sizeof(store_var));
    if (!vars)
        return STORE_ENOMEM;
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
        o->data = NULL;
        o->slots = NULL;
        bytes += (uint64_t)v->numel * 4;
    }
    pthread_rwlock_wrlock(&s->lock);
    for (int i = 0; i < s->n; i++) {
        blob_unref(s->vars[i].data);
        free(s->vars[i].slots);
    }
    free(s->vars);
    pending_clear(s);
    s->vars = vars;
    s->cap = sv->n ? sv->n : 1;
    s->n = sv->n;
    s->bytes = bytes;
    s->global_step = sv->global_step;
    if (sv->configured) { /* else the flags' configuration stays, as at start */
        s->config = sv->config;
        atomic_store(&s->n_workers, sv->config.workers);
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
    for (int w = 0; w < s->config.workers && w < STORE_MAX_WORKERS; w++) {
        atomic_store(&s->lease_until[w], now + s->lease_ms);
        atomic_store(&s->left[w], 0);
    }
    s->step_started_ms = now;
    pthread_rwlock_unlock(&s->lock);
    pool_follow(s, bytes);
    return STORE_OK;
}


int store_set_placement(store *s, const char *json_text)
{
    char *copy = json_text ? strdup(json_text) : NULL;
    if (json_text && !copy)
        return STORE_ENOMEM;
    pthread_rwlock_wrlock(&s->lock);
    if (!s->placement || !copy || strcmp(s->placement, copy) != 0)
        s->changes++;
    free(s->placement);
    s->placement = copy;
    pthread_rwlock_unlock(&s->lock);
    return STORE_OK;
}

char *store_get_placement(store *s)
{
    pthread_rwlock_rdlock(&s->lock);
    char *c = s->placement ? strdup(s->placement) : NULL;
    pthread_rwlock_unlock(&s->lock);
    return c;
}

void store_clock_start(store *s, int worker, int64_t clock)
{
    if (worker >= 0 && worker < STORE_MAX_WORKERS)
        atomic_store(&s->clock_started[worker], clock);
}

int store_clock_done(store *s, int worker, int64_t done)
{
    if (worker < 0 || worker >= STORE_MAX_WORKERS)
        return 0;
    if (!clock_raise(s, worker, done))
        return 0;
    notify(s, STORE_CHANGED_CLOCK, 0);
    return 1;
}

int64_t store_min_clock(store *s)
{
    /* lock-free (atomics only): the clock waiters call it under their mutex,
     * which must not wait behind a writer applying a large gradient */
    int64_t now = clk_mono_ms(), m = INT64_MAX;
    int n = atomic_load(&s->n_workers);
    for (int w = 0; w < n && w < STORE_MAX_WORKERS; w++)
        if (!atomic_load(&s->left[w]) && atomic_load(&s->lease_until[w]) > now) {
            int64_t d = atomic_load(&s->clock_done[w]);
            if (d < m)
                m = d;
        }
    return m;
}

json_t *store_staleness_json(store *s)
{
    static const char *const le[STORE_STALENESS_BUCKETS] = {"0", "1", "2", "3", "7", "15", "31", "63", "+Inf"};
    pthread_rwlock_rdlock(&s->lock);
    json_t *b = json_array(), *clocks = json_object();
    for (int i = 0; i < STORE_STALENESS_BUCKETS; i++)
        json_array_append_new(b, json_pack("{s:s,s:I}", "le", le[i], "count",
                                           (json_int_t)s->staleness_hist[i]));
    for (int w = 0; w < s->config.workers && w < STORE_MAX_WORKERS; w++) {
        char k[16];
        snprintf(k, sizeof(k), "%d", w);
        json_object_set_new(clocks, k, json_pack("{s:I,s:I}", "started",
                                                 (json_int_t)atomic_load(&s->clock_started[w]), "done",
                                                 (json_int_t)atomic_load(&s->clock_done[w])));
    }
    json_t *o = json_pack("{s:I,s:f,s:I,s:o,s:i,s:i,s:o}", "count", (json_int_t)s->staleness_count,
                          "mean", s->staleness_count ? (double)s->staleness_sum / (double)s->staleness_count : 0.0,
                          "max", (json_int_t)s->staleness_max, "buckets", b, "max_staleness",
                          s->config.max_staleness, "bound", s->config.staleness, "clocks", clocks);
    pthread_rwlock_unlock(&s->lock);
    return o;
}
