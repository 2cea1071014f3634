/* history.c - global_step, loss and the evaluator's reports over time in
 * bounded memory; the change feed behind /v1/events. */
#include "history.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "log.h"
#include "tfevents.h"

/* ------------------------------------------------------------ one series */

typedef struct hpoint {
    int64_t step;
    double a, b; /* loss; accuracy (eval only) */
    double t;    /* unix time, seconds */
} hpoint;

/* The last HISTORY_RECENT points in a ring; the ones pushed out of it go to
 * the long history, every stride-th of them. Both hold ascending steps and
 * every long point is older than every ring point. */
typedef struct series {
    hpoint ring[HISTORY_RECENT];
    int ring_head, ring_n; /* oldest at ring_head */
    hpoint lng[HISTORY_LONG_SLOTS];
    int lng_n;
    uint64_t stride;  /* keep evicted point k when k % stride == 0 */
    uint64_t evicted; /* points pushed out of the ring so far */
} series;

static void series_init(series *s) { s->stride = 1; }

static const hpoint *series_last(const series *s)
{
    if (!s->ring_n)
        return NULL;
    return &s->ring[(s->ring_head + s->ring_n - 1) % HISTORY_RECENT];
}

/* 1 when p was kept (added, or replacing the last point of its step). */
static int series_push(series *s, const hpoint *p)
{
    hpoint *last = s->ring_n ? &s->ring[(s->ring_head + s->ring_n - 1) % HISTORY_RECENT] : NULL;
    if (last && p->step <= last->step) {
        if (p->step == last->step)
            *last = *p; /* the same step again: the newer values win */
        return p->step == last->step;
    }
    if (s->ring_n == HISTORY_RECENT) {
        const hpoint *old = &s->ring[s->ring_head];
        uint64_t k = s->evicted++;
        if (s->lng_n == HISTORY_LONG_SLOTS && k % s->stride == 0) {
            /* full: keep every other one (the first stays) and double the stride */
            for (int i = 0; i < HISTORY_LONG_SLOTS / 2; i++)
                s->lng[i] = s->lng[2 * i];
            s->lng_n = HISTORY_LONG_SLOTS / 2;
            s->stride *= 2;
        }
        if (k % s->stride == 0)
            s->lng[s->lng_n++] = *old;
        s->ring_head = (s->ring_head + 1) % HISTORY_RECENT;
        s->ring_n--;
    }
    s->ring[(s->ring_head + s->ring_n) % HISTORY_RECENT] = *p;
    s->ring_n++;
    return 1;
}

/* Copy the points with step > since, in order, to out (room for
 * HISTORY_RECENT + HISTORY_LONG_SLOTS). Returns how many. */
static int series_copy(const series *s, int64_t since, hpoint *out)
{
    int n = 0;
    for (int i = 0; i < s->lng_n; i++)
        if (s->lng[i].step > since)
            out[n++] = s->lng[i];
    for (int i = 0; i < s->ring_n; i++) {
        const hpoint *p = &s->ring[(s->ring_head + i) % HISTORY_RECENT];
        if (p->step > since)
            out[n++] = *p;
    }
    return n;
}

/* ------------------------------------------------------------- the struct */

#define RATE_SAMPLES 64
#define RATE_SAMPLE_MS 100
#define RATE_WINDOW_MS 5000

struct history {
    pthread_mutex_t mu; /* the series, the rate samples, the event writers */
    series train, eval;
    struct tfevents *ev_train, *ev_eval; /* TensorBoard (summaries.c), or NULL */
    struct {
        int64_t ms, step;
    } rate[RATE_SAMPLES];
    int rate_head, rate_n;
    int64_t cur_step, cur_ms;

    _Atomic uint64_t version;          /* the feed */
    void (*on_move)(void *ctx);        /* told when it moves */
    void *on_move_ctx;

};

/* ---------------------------------------------------------- the feed */

static void feed_moved(struct history *h)
{
    atomic_fetch_add(&h->version, 1);
    if (h->on_move)
        h->on_move(h->on_move_ctx);
}

uint64_t history_version(struct history *h)
{
    return atomic_load(&h->version);
}

void history_on_move(struct history *h, void (*fn)(void *ctx), void *ctx)
{
    h->on_move = fn;
    h->on_move_ctx = ctx;
}

/* ---------------------------------------------------------- the points */

static void rate_sample(struct history *h, int64_t step, int64_t ms)
{
    h->cur_step = step;
    h->cur_ms = ms;
    if (h->rate_n) {
        int last = (h->rate_head + h->rate_n - 1) % RATE_SAMPLES;
        if (ms - h->rate[last].ms < RATE_SAMPLE_MS)
            return;
    }
    if (h->rate_n == RATE_SAMPLES) {
        h->rate_head = (h->rate_head + 1) % RATE_SAMPLES;
        h->rate_n--;
    }
    int i = (h->rate_head + h->rate_n) % RATE_SAMPLES;
    h->rate[i].ms = ms;
    h->rate[i].step = step;
    h->rate_n++;
}

/* Steps after the oldest sample of the last RATE_WINDOW_MS, over the time
 * since it (at least 1 s). Caller holds mu. */
static double steps_per_sec(struct history *h, int64_t now)
{
    for (int i = 0; i < h->rate_n; i++) {
        int k = (h->rate_head + i) % RATE_SAMPLES;
        if (h->rate[k].ms < now - RATE_WINDOW_MS)
            continue;
        /* the step moved only after a pause longer than the window: count
         * from the sample before it, not 0 (a rate of 0 while the step moves) */
        if (h->rate[k].step == h->cur_step && i > 0)
            k = (h->rate_head + i - 1) % RATE_SAMPLES;
        double secs = (double)(now - h->rate[k].ms) / 1000.0;
        if (secs < 1.0)
            secs = 1.0;
        int64_t steps = h->cur_step - h->rate[k].step;
        return steps > 0 ? (double)steps / secs : 0.0;
    }
    return 0.0;
}

void history_record(struct history *h, int64_t step, int has_loss, double loss)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    if (step > h->cur_step)
        rate_sample(h, step, clk_mono_ms());
    if (has_loss && isfinite(loss)) {
        hpoint p = {step, loss, 0, clk_unix_secs()};
        if (series_push(&h->train, &p)) /* under mu: the file keeps the history's order */
            tfevents_scalar(h->ev_train, "loss", p.step, p.t, p.a);
    }
    pthread_mutex_unlock(&h->mu);
    feed_moved(h);
}

void history_record_eval(struct history *h, int64_t step, double loss, double accuracy)
{
    if (!h)
        return;
    if (isfinite(loss) && isfinite(accuracy)) {
        pthread_mutex_lock(&h->mu);
        hpoint p = {step, loss, accuracy, clk_unix_secs()};
        if (series_push(&h->eval, &p)) {
            tfevents_scalar(h->ev_eval, "loss", p.step, p.t, p.a);
            tfevents_scalar(h->ev_eval, "accuracy", p.step, p.t, p.b);
        }
        pthread_mutex_unlock(&h->mu);
    }
    feed_moved(h);
}

int64_t history_last_step(struct history *h)
{
    pthread_mutex_lock(&h->mu);
    const hpoint *p = series_last(&h->train);
    int64_t s = p ? p->step : 0;
    pthread_mutex_unlock(&h->mu);
    return s;
}

double history_steps_per_sec(struct history *h)
{
    pthread_mutex_lock(&h->mu);
    double sps = steps_per_sec(h, clk_mono_ms());
    pthread_mutex_unlock(&h->mu);
    return sps;
}

void history_set_events(struct history *h, struct tfevents *train, struct tfevents *eval)
{
    pthread_mutex_lock(&h->mu);
    h->ev_train = train;
    h->ev_eval = eval;
    pthread_mutex_unlock(&h->mu);
}

/* The test hook: n steps of a decaying loss with a little deterministic
 * noise, one step per millisecond ending now; an eval every n/50 steps. */
static void prefill(struct history *h, int64_t n)
{
    double now = clk_unix_secs(), tau = (double)n * 0.15;
    int64_t every = n / 50 > 0 ? n / 50 : 1;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 1; i <= n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        double noise = ((double)(x >> 11) / 9007199254740992.0 - 0.5) * 0.1;
        double loss = 0.25 + 2.05 * exp(-(double)i / tau);
        hpoint p = {i, loss * (1.0 + noise), 0, now - (double)(n - i) / 1000.0};
        series_push(&h->train, &p);
        if (i % every == 0) {
            hpoint e = {i, loss * 1.08, 0.95 - 0.85 * exp(-(double)i / tau), p.t};
            series_push(&h->eval, &e);
        }
    }
}

struct history *history_new(void)
{
    struct history *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    pthread_mutex_init(&h->mu, NULL);
    series_init(&h->train);
    series_init(&h->eval);
    const char *synth = getenv("RESTPS_TEST_SYNTHETIC_HISTORY");
    if (synth && *synth) {
        char *end;
        errno = 0;
        long long n = strtoll(synth, &end, 10);
        if (*end || errno || n < 1 || n > 100000000)
            log_error("psd: RESTPS_TEST_SYNTHETIC_HISTORY='%.40s' is not 1..100000000: ignored",
                      synth);
        else
            prefill(h, n);
    }
    return h;
}

void history_free(struct history *h)
{
    if (!h)
        return;
    pthread_mutex_destroy(&h->mu);
    free(h);
}

/* ---------------------------------------------------- the series as JSON */

/* Appends printf output to a buffer sized by the caller (never overflows:
 * the caller reserves enough; on a miscount the output is cut short). */
typedef struct out {
    char *p;
    size_t len, cap;
} out;

__attribute__((format(printf, 2, 3))) static void put(out *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(o->p + o->len, o->cap - o->len, fmt, ap);
    va_end(ap);
    if (n > 0)
        o->len = o->len + (size_t)n < o->cap ? o->len + (size_t)n : o->cap - 1;
}

char *history_json(struct history *h, long long since, int64_t global_step, size_t *len)
{
    enum { MAXP = HISTORY_RECENT + HISTORY_LONG_SLOTS };
    hpoint *tp = malloc(sizeof(hpoint) * MAXP), *ep = malloc(sizeof(hpoint) * MAXP);
    if (!tp || !ep) {
        free(tp);
        free(ep);
        return NULL;
    }
    pthread_mutex_lock(&h->mu);
    int nt = series_copy(&h->train, since, tp);
    int ne = series_copy(&h->eval, since, ep);
    pthread_mutex_unlock(&h->mu);

    /* by hand: 4096 points of jansson objects cost more than the answer */
    out o = {NULL, 0, 128 + (size_t)nt * 96 + (size_t)ne * 128};
    o.p = malloc(o.cap);
    if (!o.p) {
        free(tp);
        free(ep);
        return NULL;
    }
    put(&o, "{\"global_step\":%lld,\"points\":[", (long long)global_step);
    for (int i = 0; i < nt; i++)
        put(&o, "%s[%lld,%.10g,%.3f]", i ? "," : "", (long long)tp[i].step, tp[i].a, tp[i].t);
    put(&o, "],\"eval\":[");
    for (int i = 0; i < ne; i++)
        put(&o, "%s[%lld,%.10g,%.10g,%.3f]", i ? "," : "", (long long)ep[i].step, ep[i].a,
            ep[i].b, ep[i].t);
    put(&o, "]}\n");
    free(tp);
    free(ep);
    *len = o.len;
    return o.p;
}

/* ---------------------------------------------------------- /v1/status */

void history_status(struct history *h, json_t *status)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    double sps = steps_per_sec(h, clk_mono_ms());
    pthread_mutex_unlock(&h->mu);
    json_object_set_new(status, "steps_per_sec", json_real(sps));
}
