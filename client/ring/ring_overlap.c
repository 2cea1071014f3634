/* ring_overlap.c - a ring all-reduce's buckets on a thread of their own
 * while the backward pass runs (ring_overlap.h). */
#include "ring/ring_overlap.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor.h"

struct ring_overlap {
    ring *r;
    size_t *layer_start;
    int n_layers;
    size_t loss_at;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu */
    int active, quit, cancel;
    int64_t step;
    float *buf;
    double wait_secs;
    size_t ready_from; /* the floats from here to the end are written */
    int rc;
    int64_t bad;
    char err[512];
};

int ring_overlap_edges(const size_t *layer_start, int n_layers, size_t n_floats, size_t min_floats, size_t *edges,
                       int cap)
{
    int n = 0;
    size_t end = n_floats;
    for (int l = n_layers - 1; l >= 1 && n < cap; l--) {
        size_t s = layer_start[l];
        if (s > 0 && s < end && end - s >= min_floats) {
            edges[n++] = s;
            end = s;
        }
    }
    for (int i = 0; i < n / 2; i++) { /* increasing */
        size_t t = edges[i];
        edges[i] = edges[n - 1 - i];
        edges[n - 1 - i] = t;
    }
    return n;
}

/* One step: the buckets, the last first, each once written. */
static int run_step(ring_overlap *o, int64_t step, float *buf, double wait_secs)
{
    for (int b = ring_buckets(o->r) - 1; b >= 0; b--) {
        size_t a, e;
        ring_bucket_range(o->r, b, &a, &e);
        pthread_mutex_lock(&o->mu);
        while (o->ready_from > a && !o->cancel)
            pthread_cond_wait(&o->cv, &o->mu);
        int cancel = o->cancel;
        pthread_mutex_unlock(&o->mu);
        if (cancel)
            return -4;
        /* as ring_train checks the whole buffer before ring_allreduce: a
         * neighbour would refuse the piece */
        int64_t bad = tensor_find_nonfinite(buf + a, e - a);
        if (bad >= 0) {
            o->bad = (int64_t)a + bad;
            return -3;
        }
        int rc = ring_allreduce_bucket(o->r, step, buf, b, wait_secs, o->err, sizeof(o->err));
        if (rc)
            return rc;
    }
    return 0;
}

static void *thread_main(void *arg)
{
    ring_overlap *o = arg;
    pthread_mutex_lock(&o->mu);
    for (;;) {
        while (!o->active && !o->quit)
            pthread_cond_wait(&o->cv, &o->mu);
        if (o->quit)
            break;
        int64_t step = o->step;
        float *buf = o->buf;
        double wait_secs = o->wait_secs;
        pthread_mutex_unlock(&o->mu);
        int rc = run_step(o, step, buf, wait_secs);
        pthread_mutex_lock(&o->mu);
        o->rc = rc;
        o->active = 0;
        pthread_cond_broadcast(&o->cv);
    }
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

ring_overlap *ring_overlap_new(ring *r, const size_t *layer_start, int n_layers, size_t loss_at)
{
    ring_overlap *o = calloc(1, sizeof(*o));
    if (!o)
        return NULL;
    o->r = r;
    o->n_layers = n_layers;
    o->loss_at = loss_at;
    o->layer_start = malloc((size_t)(n_layers > 0 ? n_layers : 1) * sizeof(size_t));
    if (!o->layer_start) {
        free(o);
        return NULL;
    }
    if (n_layers > 0)
        memcpy(o->layer_start, layer_start, (size_t)n_layers * sizeof(size_t));
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
    if (pthread_create(&o->thread, NULL, thread_main, o) != 0) {
        pthread_cond_destroy(&o->cv);
        pthread_mutex_destroy(&o->mu);
        free(o->layer_start);
        free(o);
        return NULL;
    }
    return o;
}

void ring_overlap_free(ring_overlap *o)
{
    if (!o)
        return;
    pthread_mutex_lock(&o->mu);
    o->quit = 1;
    o->cancel = 1;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
    pthread_join(o->thread, NULL);
    pthread_cond_destroy(&o->cv);
    pthread_mutex_destroy(&o->mu);
    free(o->layer_start);
    free(o);
}

void ring_overlap_begin(ring_overlap *o, int64_t step, float *buf, double wait_secs)
{
    pthread_mutex_lock(&o->mu);
    o->step = step;
    o->buf = buf;
    o->wait_secs = wait_secs;
    o->ready_from = (size_t)-1;
    o->cancel = 0;
    o->rc = 0;
    o->bad = -1;
    o->err[0] = '\0';
    o->active = 1;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

/* The floats from `from` on are written. */
static void written_from(ring_overlap *o, size_t from)
{
    pthread_mutex_lock(&o->mu);
    if (from < o->ready_from) {
        o->ready_from = from;
        pthread_cond_broadcast(&o->cv);
    }
    pthread_mutex_unlock(&o->mu);
}

int ring_overlap_loss(void *arg, double loss)
{
    ring_overlap *o = arg;
    o->buf[o->loss_at] = (float)loss; /* the thread reads it once told */
    written_from(o, o->loss_at);
    return 0;
}

void ring_overlap_grads(void *arg, int layer)
{
    ring_overlap *o = arg;
    if (layer >= 0 && layer < o->n_layers)
        written_from(o, o->layer_start[layer]);
}

void ring_overlap_all_written(ring_overlap *o) { written_from(o, 0); }

void ring_overlap_cancel(ring_overlap *o)
{
    pthread_mutex_lock(&o->mu);
    o->cancel = 1;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

int ring_overlap_end(ring_overlap *o, int64_t *bad, char *err, size_t errlen)
{
    pthread_mutex_lock(&o->mu);
    while (o->active)
        pthread_cond_wait(&o->cv, &o->mu);
    int rc = o->rc;
    if (bad)
        *bad = o->bad;
    if (rc == -1 && err && errlen)
        snprintf(err, errlen, "%s", o->err);
    pthread_mutex_unlock(&o->mu);
    return rc;
}
