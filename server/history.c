/* history.c - global_step, loss and the evaluator's reports over time in
 * bounded memory; the change feed behind /v1/events; ps 0's view of the
 * other shards. */
#include "history.h"

#include <curl/curl.h>
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
#include "routes.h"
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
#define SHARD_BODY_MAX (8u << 20)
#define SHARD_PERIOD_MS 1000

typedef struct shard {
    int task;
    char address[CLUSTER_HOST_MAX + 16];
    char url[CLUSTER_HOST_MAX + 40];
    /* under shards_mu */
    int up;
    int64_t global_step, variables, bytes;
    /* the fetching thread's own */
    CURL *easy;
    char *body;
    size_t len;
} shard;

struct history {
    int tls;               /* the other shards speak HTTPS */
    char tls_ca[4096];     /* CA file to trust for them ("" = the system's) */
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

    pthread_mutex_t shards_mu;
    pthread_cond_t shards_cv;
    shard *shards; /* every ps task; [self_index] is this one */
    int n_shards, n_alloc, self_index;
    char self_address[CLUSTER_HOST_MAX + 16];
    int shards_started, shards_stop;
    pthread_t shards_thread;
    CURLM *multi;
    struct curl_slist *headers;
    int curl_inited;
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

static void shards_stop(struct history *h);

void history_stop(struct history *h)
{
    shards_stop(h);
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

void history_set_tls(struct history *h, const char *ca_file)
{
    h->tls = 1;
    snprintf(h->tls_ca, sizeof(h->tls_ca), "%s", ca_file ? ca_file : "");
}

struct history *history_new(void)
{
    struct history *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    pthread_mutex_init(&h->mu, NULL);
    pthread_mutex_init(&h->shards_mu, NULL);
    clk_mono_cond_init(&h->shards_cv);
    series_init(&h->train);
    series_init(&h->eval);
    h->self_index = -1;
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
    history_stop(h);
    for (int i = 0; i < h->n_alloc; i++) {
        if (h->shards[i].easy)
            curl_easy_cleanup(h->shards[i].easy);
        free(h->shards[i].body);
    }
    free(h->shards);
    if (h->multi)
        curl_multi_cleanup(h->multi);
    curl_slist_free_all(h->headers);
    if (h->curl_inited)
        curl_global_cleanup();
    pthread_mutex_destroy(&h->mu);
    pthread_mutex_destroy(&h->shards_mu);
    pthread_cond_destroy(&h->shards_cv);
    free(h);
}

/* ---------------------------------------------------------- GET /v1/history */

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

enum MHD_Result h_history(request *r)
{
    server *srv = req_srv(r);
    struct history *h = srv->history;
    long long since = -1;
    const char *s = http_query(r, "since");
    if (s) {
        char *end;
        errno = 0;
        since = strtoll(s, &end, 10);
        if (*s < '0' || *s > '9' || *end || errno)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                    "since must be a non-negative integer (a global_step), got '%.40s'",
                                    s);
    }
    enum { MAXP = HISTORY_RECENT + HISTORY_LONG_SLOTS };
    hpoint *tp = malloc(sizeof(hpoint) * MAXP), *ep = malloc(sizeof(hpoint) * MAXP);
    if (!tp || !ep) {
        free(tp);
        free(ep);
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    }
    pthread_mutex_lock(&h->mu);
    int nt = series_copy(&h->train, since, tp);
    int ne = series_copy(&h->eval, since, ep);
    pthread_mutex_unlock(&h->mu);
    int nv, has_loss;
    uint64_t bytes;
    int64_t step;
    double loss;
    store_totals(&srv->store, &nv, &bytes, &step, &has_loss, &loss);

    /* by hand: 4096 points of jansson objects cost more than the answer */
    out o = {NULL, 0, 128 + (size_t)nt * 96 + (size_t)ne * 128};
    o.p = malloc(o.cap);
    if (!o.p) {
        free(tp);
        free(ep);
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    }
    put(&o, "{\"global_step\":%lld,\"points\":[", (long long)step);
    for (int i = 0; i < nt; i++)
        put(&o, "%s[%lld,%.10g,%.3f]", i ? "," : "", (long long)tp[i].step, tp[i].a, tp[i].t);
    put(&o, "],\"eval\":[");
    for (int i = 0; i < ne; i++)
        put(&o, "%s[%lld,%.10g,%.10g,%.3f]", i ? "," : "", (long long)ep[i].step, ep[i].a,
            ep[i].b, ep[i].t);
    put(&o, "]}\n");
    free(tp);
    free(ep);
    return http_reply_text(r, MHD_HTTP_OK, "application/json", o.p, o.len);
}

/* ---------------------------------------------------------- the shards */

static size_t on_body(char *data, size_t size, size_t n, void *cls)
{
    shard *s = cls;
    size_t k = size * n;
    if (s->len + k > SHARD_BODY_MAX)
        return 0; /* too big for a status: an error */
    char *b = realloc(s->body, s->len + k + 1);
    if (!b)
        return 0;
    s->body = b;
    memcpy(s->body + s->len, data, k);
    s->len += k;
    s->body[s->len] = '\0';
    return k;
}

/* One finished fetch: parse and publish. */
static void shard_done(struct history *h, shard *s, CURLcode rc)
{
    long code = 0;
    curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &code);
    json_t *j = rc == CURLE_OK && code == 200 ? json_loadb(s->body, s->len, 0, NULL) : NULL;
    json_t *gs = json_object_get(j, "global_step"), *nv = json_object_get(j, "variables"),
           *by = json_object_get(j, "bytes");
    int ok = json_is_integer(gs) && json_is_integer(nv) && json_is_integer(by);
    pthread_mutex_lock(&h->shards_mu);
    if (ok) {
        s->global_step = json_integer_value(gs);
        s->variables = json_integer_value(nv);
        s->bytes = json_integer_value(by);
    }
    s->up = ok;
    pthread_mutex_unlock(&h->shards_mu);
    json_decref(j);
}

static void *shards_main(void *arg)
{
    struct history *h = arg;
    for (;;) {
        int64_t t0 = clk_mono_ms();
        pthread_mutex_lock(&h->shards_mu);
        int stop = h->shards_stop;
        pthread_mutex_unlock(&h->shards_mu);
        if (stop)
            break;
        for (int i = 0; i < h->n_shards; i++)
            if (i != h->self_index) {
                h->shards[i].len = 0;
                curl_multi_add_handle(h->multi, h->shards[i].easy);
            }
        int running = 1;
        while (running) {
            if (curl_multi_perform(h->multi, &running) != CURLM_OK)
                break;
            CURLMsg *m;
            int left;
            while ((m = curl_multi_info_read(h->multi, &left)))
                if (m->msg == CURLMSG_DONE) {
                    char *priv = NULL;
                    CURL *e = m->easy_handle;
                    curl_easy_getinfo(e, CURLINFO_PRIVATE, &priv);
                    shard *s = (shard *)priv;
                    CURLcode rc = m->data.result;
                    if (s)
                        shard_done(h, s, rc);
                    curl_multi_remove_handle(h->multi, e);
                }
            pthread_mutex_lock(&h->shards_mu);
            stop = h->shards_stop;
            pthread_mutex_unlock(&h->shards_mu);
            if (stop || !running)
                break;
            curl_multi_poll(h->multi, NULL, 0, 1000, NULL);
        }
        /* whatever is still running (stop, or a failure of the multi handle) */
        for (int i = 0; i < h->n_shards; i++)
            if (i != h->self_index)
                curl_multi_remove_handle(h->multi, h->shards[i].easy);
        if (stop)
            break;
        struct timespec ts = clk_ts_of_ms(t0 + SHARD_PERIOD_MS);
        pthread_mutex_lock(&h->shards_mu);
        while (!h->shards_stop && clk_mono_ms() < t0 + SHARD_PERIOD_MS)
            if (pthread_cond_timedwait(&h->shards_cv, &h->shards_mu, &ts) == ETIMEDOUT)
                break;
        pthread_mutex_unlock(&h->shards_mu);
    }
    return NULL;
}

static void shards_stop(struct history *h)
{
    pthread_mutex_lock(&h->shards_mu);
    int started = h->shards_started;
    h->shards_started = 0;
    h->shards_stop = 1;
    pthread_cond_broadcast(&h->shards_cv);
    pthread_mutex_unlock(&h->shards_mu);
    if (started) {
        curl_multi_wakeup(h->multi);
        pthread_join(h->shards_thread, NULL);
    }
}

static void format_addr(char *out, size_t cap, const cluster_addr *a)
{
    if (strchr(a->host, ':'))
        snprintf(out, cap, "[%s]:%d", a->host, a->port);
    else
        snprintf(out, cap, "%s:%d", a->host, a->port);
}

int history_start_shards(struct history *h, const cluster_spec *c, const char *auth_token,
                         const char *listening)
{
    const cluster_job *ps = &c->jobs[JOB_PS];
    int self = c->job == JOB_PS ? c->task_index : -1;
    if (listening) /* where it really listens (--port, --bind) */
        snprintf(h->self_address, sizeof(h->self_address), "%s", listening);
    else if (self >= 0 && self < ps->n)
        format_addr(h->self_address, sizeof(h->self_address), &ps->tasks[self]);
    if (self != 0 || ps->n < 2 || h->shards)
        return 0;
    if (curl_global_init(h->tls ? CURL_GLOBAL_DEFAULT : CURL_GLOBAL_NOTHING) != 0) {
        log_error("psd: libcurl did not initialize: no other shards' status");
        return -1;
    }
    h->curl_inited = 1;
    h->shards = calloc((size_t)ps->n, sizeof(shard));
    h->multi = curl_multi_init();
    if (!h->shards || !h->multi)
        goto fail;
    h->n_alloc = ps->n;
    h->n_shards = ps->n;
    h->self_index = self;
    if (auth_token) {
        char *hdr = malloc(strlen(auth_token) + 32);
        if (!hdr)
            goto fail;
        sprintf(hdr, "Authorization: Bearer %s", auth_token);
        h->headers = curl_slist_append(NULL, hdr);
        free(hdr);
        if (!h->headers)
            goto fail;
    }
    for (int i = 0; i < ps->n; i++) {
        shard *s = &h->shards[i];
        s->task = i;
        format_addr(s->address, sizeof(s->address), &ps->tasks[i]);
        if (i == self)
            continue;
        snprintf(s->url, sizeof(s->url), "%s://%s/v1/status", h->tls ? "https" : "http", s->address);
        CURL *e = s->easy = curl_easy_init();
        if (!e)
            goto fail;
        curl_easy_setopt(e, CURLOPT_URL, s->url);
        curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(e, CURLOPT_NOPROXY, "*");
        curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, 500L);
        curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 900L);
        curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(e, CURLOPT_WRITEDATA, s);
        curl_easy_setopt(e, CURLOPT_PRIVATE, (char *)s);
        curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
        if (h->tls_ca[0])
            curl_easy_setopt(e, CURLOPT_CAINFO, h->tls_ca);
        if (h->headers)
            curl_easy_setopt(e, CURLOPT_HTTPHEADER, h->headers);
    }
    if (pthread_create(&h->shards_thread, NULL, shards_main, h) != 0)
        goto fail;
    pthread_mutex_lock(&h->shards_mu);
    h->shards_started = 1;
    pthread_mutex_unlock(&h->shards_mu);
    log_info("psd: ps 0 follows %d other ps task(s) for the cluster view", ps->n - 1);
    return 0;
fail:
    log_error("psd: out of memory for the shards' status: ps 0 shows itself only");
    pthread_mutex_lock(&h->shards_mu);
    h->n_shards = 0;
    pthread_mutex_unlock(&h->shards_mu);
    return -1;
}

/* ---------------------------------------------------------- /v1/status */

static json_t *self_shard(struct history *h, json_t *status, int task)
{
    json_t *gs = json_object_get(status, "global_step");
    json_t *nv = json_object_get(status, "variables");
    json_t *by = json_object_get(status, "bytes");
    return json_pack("{s:i,s:s,s:b,s:I,s:I,s:I}", "task", task, "address", h->self_address,
                     "up", 1, "global_step", (json_int_t)json_integer_value(gs), "variables",
                     (json_int_t)json_integer_value(nv), "bytes",
                     (json_int_t)json_integer_value(by));
}

void history_status(struct history *h, json_t *status)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    double sps = steps_per_sec(h, clk_mono_ms());
    pthread_mutex_unlock(&h->mu);
    json_object_set_new(status, "steps_per_sec", json_real(sps));

    json_t *list = json_array();
    json_t *task = json_object_get(json_object_get(status, "task"), "index");
    int self = (int)json_integer_value(task);
    pthread_mutex_lock(&h->shards_mu);
    if (h->n_shards) {
        for (int i = 0; i < h->n_shards; i++) {
            shard *s = &h->shards[i];
            if (i == h->self_index)
                json_array_append_new(list, self_shard(h, status, i));
            else
                json_array_append_new(
                    list, json_pack("{s:i,s:s,s:b,s:I,s:I,s:I}", "task", s->task, "address",
                                    s->address, "up", s->up, "global_step",
                                    (json_int_t)s->global_step, "variables",
                                    (json_int_t)s->variables, "bytes", (json_int_t)s->bytes));
        }
    } else {
        json_array_append_new(list, self_shard(h, status, self));
    }
    pthread_mutex_unlock(&h->shards_mu);
    json_object_set_new(status, "shards", list);
}
