/* workers.c - per-worker records from the pushes a ps accepted, push totals
 * by outcome, and examples per second over a sliding window. */
#include "workers.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "store.h"

/* The examples window: a ring of 100 ms slots, each tagged with its slot
 * number, so old slots are recognized without clearing them. */
#define SLOT_NS 100000000ull
#define WINDOW_SLOTS (WORKERS_RATE_WINDOW_SECS * 10)
#define RING_SLOTS 64 /* > WINDOW_SLOTS */

typedef struct rec {
    long long worker;
    long long last_step;
    uint64_t last_seen_ns;
    uint64_t pushes, stale;
} rec;

struct workers {
    pthread_mutex_t mu;
    rec *recs; /* sorted by worker */
    int n, cap;
    uint64_t outcomes[4];
    uint64_t first_ns; /* the first push that counted examples; 0 none */
    struct {
        uint64_t slot;
        uint64_t examples;
    } ring[RING_SLOTS];
};

struct workers *workers_new(void)
{
    struct workers *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    if (pthread_mutex_init(&w->mu, NULL) != 0) {
        free(w);
        return NULL;
    }
    return w;
}

void workers_free(struct workers *w)
{
    if (!w)
        return;
    pthread_mutex_destroy(&w->mu);
    free(w->recs);
    free(w);
}

/* Index of worker's record, or -(insertion point)-1. */
static int find(const struct workers *w, long long worker)
{
    int lo = 0, hi = w->n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (w->recs[mid].worker < worker)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < w->n && w->recs[lo].worker == worker ? lo : -lo - 1;
}

/* The record of worker, created when new (NULL when out of memory). */
static rec *record(struct workers *w, long long worker)
{
    int i = find(w, worker);
    if (i >= 0)
        return &w->recs[i];
    if (w->n == WORKERS_MAX_RECORDS) {
        /* forget the worker seen longest ago */
        int old = 0;
        for (int k = 1; k < w->n; k++)
            if (w->recs[k].last_seen_ns < w->recs[old].last_seen_ns)
                old = k;
        memmove(&w->recs[old], &w->recs[old + 1], sizeof(rec) * (size_t)(w->n - old - 1));
        w->n--;
        i = find(w, worker);
    } else if (w->n == w->cap) {
        int cap = w->cap ? w->cap * 2 : 16;
        if (cap > WORKERS_MAX_RECORDS)
            cap = WORKERS_MAX_RECORDS;
        rec *r = realloc(w->recs, sizeof(rec) * (size_t)cap);
        if (!r)
            return NULL;
        w->recs = r;
        w->cap = cap;
    }
    int at = -i - 1;
    memmove(&w->recs[at + 1], &w->recs[at], sizeof(rec) * (size_t)(w->n - at));
    w->recs[at] = (rec){.worker = worker, .last_step = -1};
    w->n++;
    return &w->recs[at];
}

void workers_seen(struct workers *w, long long worker, long long step, long long batch_size,
                  int outcome)
{
    if (!w || outcome < 0 || outcome > 3)
        return;
    uint64_t t = clk_mono_ns();
    pthread_mutex_lock(&w->mu);
    w->outcomes[outcome]++;
    if (worker >= 0) {
        rec *r = record(w, worker);
        if (r) {
            r->last_seen_ns = t;
            if (outcome != STORE_PUSH_DUPLICATE)
                r->pushes++;
            if (outcome == STORE_PUSH_STALE)
                r->stale++;
            if (step > r->last_step)
                r->last_step = step;
        }
    }
    if (batch_size > 0 && (outcome == STORE_PUSH_APPLIED || outcome == STORE_PUSH_PENDING)) {
        uint64_t slot = t / SLOT_NS;
        int k = (int)(slot % RING_SLOTS);
        if (w->ring[k].slot != slot) {
            w->ring[k].slot = slot;
            w->ring[k].examples = 0;
        }
        w->ring[k].examples += (uint64_t)batch_size;
        if (!w->first_ns)
            w->first_ns = t;
    }
    pthread_mutex_unlock(&w->mu);
}

double workers_examples_per_sec(struct workers *w)
{
    if (!w)
        return 0;
    uint64_t t = clk_mono_ns(), slot = t / SLOT_NS, sum = 0;
    pthread_mutex_lock(&w->mu);
    for (int k = 0; k < RING_SLOTS; k++)
        if (w->ring[k].slot <= slot && w->ring[k].slot + WINDOW_SLOTS > slot)
            sum += w->ring[k].examples;
    uint64_t first = w->first_ns;
    pthread_mutex_unlock(&w->mu);
    if (!sum)
        return 0;
    double span = (double)(t - first) / 1e9;
    if (span > WORKERS_RATE_WINDOW_SECS)
        span = WORKERS_RATE_WINDOW_SECS;
    if (span < 1)
        span = 1;
    return (double)sum / span;
}

int workers_list(struct workers *w, workers_rec **out)
{
    *out = NULL;
    if (!w)
        return 0;
    uint64_t t = clk_mono_ns();
    pthread_mutex_lock(&w->mu);
    int n = w->n;
    workers_rec *a = malloc(sizeof(*a) * (size_t)(n ? n : 1));
    if (a)
        for (int i = 0; i < n; i++) {
            const rec *r = &w->recs[i];
            a[i] = (workers_rec){r->worker, r->last_step, (double)(t - r->last_seen_ns) / 1e9,
                                 r->pushes, r->stale};
        }
    pthread_mutex_unlock(&w->mu);
    if (!a)
        return -1;
    *out = a;
    return n;
}

void workers_outcomes(struct workers *w, uint64_t out[4])
{
    memset(out, 0, sizeof(uint64_t) * 4);
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    memcpy(out, w->outcomes, sizeof(w->outcomes));
    pthread_mutex_unlock(&w->mu);
}

json_t *workers_json(struct workers *w)
{
    json_t *a = json_array();
    workers_rec *l;
    int n = workers_list(w, &l);
    for (int i = 0; i < n; i++)
        json_array_append_new(
            a, json_pack("{s:I,s:o,s:f,s:I,s:I}", "worker", (json_int_t)l[i].worker, "last_step",
                         l[i].last_step >= 0 ? json_integer(l[i].last_step) : json_null(),
                         "last_seen_secs_ago", l[i].last_seen_secs_ago, "pushes",
                         (json_int_t)l[i].pushes, "stale_dropped",
                         (json_int_t)l[i].stale_dropped));
    free(l);
    return a;
}

int workers_live(struct workers *w, double secs)
{
    if (!w)
        return 0;
    uint64_t t = clk_mono_ns();
    double ns = secs * 1e9;
    int live = 0;
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n; i++)
        if ((double)(t - w->recs[i].last_seen_ns) <= ns)
            live++;
    pthread_mutex_unlock(&w->mu);
    return live;
}

void workers_status(struct workers *w, struct store *s, json_t *status)
{
    json_object_set_new(status, "workers", workers_json(w));
    json_object_set_new(status, "live_workers", json_integer(workers_live(w, WORKERS_LIVE_SECS)));
    json_object_set_new(status, "examples_per_sec", json_real(workers_examples_per_sec(w)));
    (void)s; /* "waiting_for" comes from the membership (status.c): live workers only */
}
