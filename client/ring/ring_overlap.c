/* ring_overlap.c - a ring all-reduce's buckets on threads of their own
 * while the backward pass runs (ring_overlap.h): channel 0 the buckets from
 * the last to the second, channel 1 the first. */
#include "ring/ring_overlap.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor.h"

/* A channel: a thread that sums buckets hi down to lo of each step (ring.c
 * sends them on a curl handle of their own: channel 1 the first bucket,
 * channel 0 the rest). */
typedef struct chan {
    struct ring_overlap *o;
    pthread_t thread;
    int started;
    int hi, lo;
    /* under the overlap's mu */
    int active, rc;
    int done_below; /* buckets done_below..hi of this step are summed */
    int64_t bad;
    char err[512];
} chan;

struct ring_overlap {
    ring *r;
    size_t *layer_start;
    int n_layers;
    size_t loss_at;
    chan ch[2];
    int n_ch;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu */
    int quit, cancel;
    int64_t step;
    float *buf;
    double wait_secs;
    size_t ready_from; /* the floats from here to the end are written */
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

/* One step of channel c: its buckets, the last first, each once written. */
static int run_step(chan *c, int64_t step, float *buf, double wait_secs)
{
    ring_overlap *o = c->o;
    for (int b = c->hi; b >= c->lo; b--) {
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
            c->bad = (int64_t)a + bad;
            return -3;
        }
        int rc = ring_allreduce_bucket(o->r, step, buf, b, wait_secs, c->err, sizeof(c->err));
        if (rc)
            return rc;
        pthread_mutex_lock(&o->mu);
        c->done_below = b;
        pthread_cond_broadcast(&o->cv);
        pthread_mutex_unlock(&o->mu);
    }
    return 0;
}

static void *thread_main(void *arg)
{
    chan *c = arg;
    ring_overlap *o = c->o;
    pthread_mutex_lock(&o->mu);
    for (;;) {
        while (!c->active && !o->quit)
            pthread_cond_wait(&o->cv, &o->mu);
        if (o->quit)
            break;
        int64_t step = o->step;
        float *buf = o->buf;
        double wait_secs = o->wait_secs;
        pthread_mutex_unlock(&o->mu);
        int rc = run_step(c, step, buf, wait_secs);
        pthread_mutex_lock(&o->mu);
        c->rc = rc;
        c->active = 0;
        pthread_cond_broadcast(&o->cv);
    }
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

static void stop_threads(ring_overlap *o)
{
    pthread_mutex_lock(&o->mu);
    o->quit = 1;
    o->cancel = 1;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
    for (int i = 0; i < o->n_ch; i++)
        if (o->ch[i].started)
            pthread_join(o->ch[i].thread, NULL);
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
    int nb = ring_buckets(r);
    /* as ring.c's channels: the first bucket alone on channel 1 */
    o->ch[0] = (chan){.o = o, .hi = nb - 1, .lo = nb > 1 ? 1 : 0};
    o->ch[1] = (chan){.o = o, .hi = 0, .lo = 0};
    o->n_ch = nb > 1 ? 2 : 1;
    for (int i = 0; i < o->n_ch; i++) {
        if (pthread_create(&o->ch[i].thread, NULL, thread_main, &o->ch[i]) != 0) {
            ring_overlap_free(o);
            return NULL;
        }
        o->ch[i].started = 1;
    }
    return o;
}

void ring_overlap_free(ring_overlap *o)
{
    if (!o)
        return;
    stop_threads(o);
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
    for (int i = 0; i < o->n_ch; i++) {
        chan *c = &o->ch[i];
        c->rc = 0;
        c->bad = -1;
        c->err[0] = '\0';
        c->done_below = c->hi + 1;
        c->active = 1;
    }
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

/* What a finished channel says: its rc, *bad, err (mu held). */
static int chan_says(const chan *c, int64_t *bad, char *err, size_t errlen)
{
    if (c->rc == -3 && bad)
        *bad = c->bad;
    if (c->rc == -1 && err && errlen)
        snprintf(err, errlen, "%s", c->err);
    return c->rc;
}

int ring_overlap_wait_bucket(ring_overlap *o, int b, int64_t *bad, char *err, size_t errlen)
{
    chan *c = &o->ch[o->n_ch > 1 && b == 0];
    pthread_mutex_lock(&o->mu);
    while (c->done_below > b && c->active)
        pthread_cond_wait(&o->cv, &o->mu);
    int rc = c->done_below <= b ? 0 : chan_says(c, bad, err, errlen);
    if (rc == 0 && c->done_below > b) /* cannot be: a channel ends with its buckets done or an rc */
        rc = -4;
    pthread_mutex_unlock(&o->mu);
    return rc;
}

int ring_overlap_end(ring_overlap *o, int64_t *bad, char *err, size_t errlen)
{
    pthread_mutex_lock(&o->mu);
    for (int i = 0; i < o->n_ch; i++)
        while (o->ch[i].active)
            pthread_cond_wait(&o->cv, &o->mu);
    /* what says most: this task's own NaN, a broken ring, a stop, a cancel */
    static const int order[] = {-3, -1, -2, -4};
    int rc = 0;
    for (int k = 0; k < 4 && !rc; k++)
        for (int i = 0; i < o->n_ch && !rc; i++)
            if (o->ch[i].rc == order[k])
                rc = chan_says(&o->ch[i], bad, err, errlen);
    pthread_mutex_unlock(&o->mu);
    return rc;
}
