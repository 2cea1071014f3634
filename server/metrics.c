/* metrics.c - counters for GET /metrics, and the Prometheus text exposition
 * (format 0.0.4) of them and of the shard's state. */
#include "metrics.h"
#include "saver.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "server.h"
#include "workers.h"

/* Latency buckets, 100 us to 10 s; their upper bounds in ns and as printed. */
#define N_BUCKETS 16
static const uint64_t bucket_ns[N_BUCKETS] = {
    100000ull,    250000ull,    500000ull,     1000000ull,    2500000ull,    5000000ull,
    10000000ull,  25000000ull,  50000000ull,   100000000ull,  250000000ull,  500000000ull,
    1000000000ull, 2500000000ull, 5000000000ull, 10000000000ull};
static const char *const bucket_le[N_BUCKETS] = {"0.0001", "0.00025", "0.0005", "0.001",
                                                 "0.0025", "0.005",   "0.01",   "0.025",
                                                 "0.05",   "0.1",     "0.25",   "0.5",
                                                 "1",      "2.5",     "5",      "10"};

/* Method labels: a fixed set, so an odd method cannot grow the series. */
static const char *const methods[] = {"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS",
                                      "PATCH", "other"};
#define N_METHODS (int)(sizeof(methods) / sizeof(methods[0]))

enum { K_OTHER, K_PULL, K_PUSH_BULK, K_PUSH_ONE };
enum { PULL_OK, PULL_NOT_MODIFIED, PULL_REFUSED, PULL_ABORTED, N_PULL };
static const char *const pull_results[N_PULL] = {"ok", "not_modified", "refused", "aborted"};

/* One (route, method): requests by status, the latency histogram, bytes. */
#define M_SLOTS 128
#define M_CODES 16
typedef struct slot {
    const http_route *rt; /* NULL: no route matched */
    int method;
    int kind;
    struct {
        atomic_uint code; /* status + 1; 0 free */
        atomic_uint_fast64_t n;
    } codes[M_CODES];
    atomic_uint_fast64_t buckets[N_BUCKETS + 1]; /* not cumulative; the last is over 10 s */
    atomic_uint_fast64_t sum_ns;
    atomic_uint_fast64_t bytes_in, bytes_out;
} slot;

struct metrics {
    pthread_mutex_t mu; /* taken only to claim a new slot */
    atomic_int n;       /* slots[0..n) are set up */
    slot slots[M_SLOTS];
    atomic_uint_fast64_t pulls[N_PULL];
    atomic_uint_fast64_t push_one_applied, push_refused, push_aborted;
    atomic_uint_fast64_t unrecorded; /* no slot or status entry left (not expected) */
};

struct metrics *metrics_new(void)
{
    struct metrics *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    if (pthread_mutex_init(&m->mu, NULL) != 0) {
        free(m);
        return NULL;
    }
    return m;
}

void metrics_free(struct metrics *m)
{
    if (!m)
        return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static int method_index(const char *method)
{
    for (int i = 0; i < N_METHODS - 1; i++)
        if (method && strcmp(method, methods[i]) == 0)
            return i;
    return N_METHODS - 1;
}

static int kind_of(const http_route *rt, const char *method)
{
    if (!rt)
        return K_OTHER;
    if (strcmp(method, "GET") == 0 &&
        (strcmp(rt->path, "/v1/params") == 0 || strcmp(rt->path, "/v1/vars/{name}") == 0))
        return K_PULL;
    if (strcmp(method, "POST") == 0 && strcmp(rt->path, "/v1/grads") == 0)
        return K_PUSH_BULK;
    if (strcmp(method, "POST") == 0 && strcmp(rt->path, "/v1/vars/{name}/grad") == 0)
        return K_PUSH_ONE;
    return K_OTHER;
}

static slot *find_slot(struct metrics *m, const http_route *rt, int method)
{
    int n = atomic_load_explicit(&m->n, memory_order_acquire);
    for (int i = 0; i < n; i++)
        if (m->slots[i].rt == rt && m->slots[i].method == method)
            return &m->slots[i];
    pthread_mutex_lock(&m->mu);
    n = atomic_load_explicit(&m->n, memory_order_relaxed);
    slot *s = NULL;
    for (int i = 0; i < n && !s; i++)
        if (m->slots[i].rt == rt && m->slots[i].method == method)
            s = &m->slots[i];
    if (!s && n < M_SLOTS) {
        s = &m->slots[n];
        s->rt = rt;
        s->method = method;
        s->kind = kind_of(rt, methods[method]);
        atomic_store_explicit(&m->n, n + 1, memory_order_release);
    }
    pthread_mutex_unlock(&m->mu);
    return s;
}

static void count_status(struct metrics *m, slot *s, unsigned status)
{
    unsigned want = status + 1;
    for (int j = 0; j < M_CODES; j++) {
        unsigned c = atomic_load(&s->codes[j].code);
        if (c == 0) {
            unsigned zero = 0;
            if (atomic_compare_exchange_strong(&s->codes[j].code, &zero, want))
                c = want;
            else
                c = zero; /* someone claimed it: for this status? */
        }
        if (c == want) {
            atomic_fetch_add_explicit(&s->codes[j].n, 1, memory_order_release);
            return;
        }
    }
    atomic_fetch_add(&m->unrecorded, 1);
}

void metrics_observe(struct metrics *m, const request *r, int completed)
{
    if (!m || !r)
        return;
    int method = method_index(r->method);
    slot *s = find_slot(m, r->route, method);
    if (!s) {
        atomic_fetch_add(&m->unrecorded, 1);
        return;
    }
    uint64_t now = clk_mono_ns();
    uint64_t took = r->t_start_ns && now > r->t_start_ns ? now - r->t_start_ns : 0;
    int b = 0;
    while (b < N_BUCKETS && took > bucket_ns[b])
        b++;
    atomic_fetch_add_explicit(&s->buckets[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->sum_ns, took, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->bytes_in, r->bytes_in, memory_order_relaxed);
    /* a HEAD answer carries no body; an answer cut short sent an unknown part */
    if (completed && method != 1)
        atomic_fetch_add_explicit(&s->bytes_out, r->bytes_out, memory_order_relaxed);

    unsigned st = r->status;
    if (s->kind == K_PULL) {
        int res = st >= 400 ? PULL_REFUSED
                  : st == 304 ? PULL_NOT_MODIFIED
                  : (!completed || st == 0) ? PULL_ABORTED
                  : PULL_OK;
        atomic_fetch_add_explicit(&m->pulls[res], 1, memory_order_relaxed);
    } else if (s->kind == K_PUSH_BULK || s->kind == K_PUSH_ONE) {
        if (st >= 400)
            atomic_fetch_add_explicit(&m->push_refused, 1, memory_order_relaxed);
        else if (st == 0)
            atomic_fetch_add_explicit(&m->push_aborted, 1, memory_order_relaxed);
        else if (s->kind == K_PUSH_ONE)
            atomic_fetch_add_explicit(&m->push_one_applied, 1, memory_order_relaxed);
        /* an accepted bulk push was counted by outcome in workers_seen */
    }
    /* last, with release: a scrape that sees the request counted sees the
     * rest of it (bytes, latency, result) */
    count_status(m, s, r->status);
}

/* ------------------------------------------------------------ exposition */

typedef struct out {
    char *p;
    size_t len, cap;
    int oom;
} out;

static void put(out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(out *o, const char *fmt, ...)
{
    if (o->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(o->p + o->len, o->cap - o->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            o->oom = 1;
            return;
        }
        if ((size_t)n < o->cap - o->len) {
            o->len += (size_t)n;
            return;
        }
        size_t cap = o->cap * 2 + (size_t)n + 1;
        char *p = realloc(o->p, cap);
        if (!p) {
            o->oom = 1;
            return;
        }
        o->p = p;
        o->cap = cap;
    }
}

/* A label value with \ " and newline escaped, as the format wants. */
static void put_label_value(out *o, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\')
            put(o, "\\\\");
        else if (*v == '"')
            put(o, "\\\"");
        else if (*v == '\n')
            put(o, "\\n");
        else
            put(o, "%c", *v);
    }
}

static void family(out *o, const char *name, const char *type, const char *help)
{
    put(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A double as Go's ParseFloat reads it (the format's float syntax). */
static void put_double(out *o, double v)
{
    if (v != v)
        put(o, "NaN");
    else if (v > 1.7976931348623157e308)
        put(o, "+Inf");
    else if (v < -1.7976931348623157e308)
        put(o, "-Inf");
    else {
        /* the shortest form that reads back as the same double */
        char b[32];
        for (int prec = 1; prec <= 17; prec++) {
            snprintf(b, sizeof(b), "%.*g", prec, v);
            if (strtod(b, NULL) == v)
                break;
        }
        put(o, "%s", b);
    }
}

static void gauge(out *o, const char *name, const char *help, double v)
{
    family(o, name, "gauge", help);
    put(o, "%s ", name);
    put_double(o, v);
    put(o, "\n");
}

static void put_secs(out *o, uint64_t ns)
{
    put(o, "%llu.%09llu", (unsigned long long)(ns / 1000000000ull),
        (unsigned long long)(ns % 1000000000ull));
}

static const char *route_label(const slot *s) { return s->rt ? s->rt->path : "unmatched"; }

/* The sparse variables: rows held, their bytes, rows evicted, by variable. */
static void put_sparse(out *o, server *srv)
{
    store_sparse_stat *st;
    int n;
    if (store_sparse_stats(&srv->store, &st, &n) != STORE_OK || n == 0)
        return;
    static const struct {
        const char *name, *type, *help;
    } fam[] = {{"restps_sparse_rows", "gauge", "Rows a sparse variable holds on this shard."},
               {"restps_sparse_bytes", "gauge", "Bytes of a sparse variable's rows and optimizer slots on this shard."},
               {"restps_sparse_evicted_rows_total", "counter", "Rows evicted from a sparse variable (least recently updated)."}};
    for (int f = 0; f < 3; f++) {
        family(o, fam[f].name, fam[f].type, fam[f].help);
        for (int i = 0; i < n; i++) {
            put(o, "%s{var=\"", fam[f].name);
            put_label_value(o, st[i].name);
            put(o, "\"} ");
            put_double(o, f == 0 ? (double)st[i].held : f == 1 ? (double)st[i].bytes : (double)st[i].evicted);
            put(o, "\n");
        }
    }
    free(st);
}

/* The shard's state: step, loss, evaluation, sizes, waits, workers and
 * checkpoints. */
static void put_shard(out *o, server *srv)
{
    int n_vars, has_loss;
    uint64_t bytes;
    int64_t step;
    double loss;
    store_totals(&srv->store, &n_vars, &bytes, &step, &has_loss, &loss);
    store_counts sc;
    store_get_counts(&srv->store, &sc);
    int64_t stale = sc.stale_dropped;
    int pending = sc.pending, ready = sc.configured;
    double up = clk_mono_since(&srv->started);

    gauge(o, "restps_global_step", "The shard's global step.", (double)step);
    if (has_loss)
        gauge(o, "restps_loss", "The training loss of the last push that carried one.", loss);
    pthread_mutex_lock(&srv->info_mu);
    int has_eval = srv->eval.has;
    double eval_loss = srv->eval.loss, eval_acc = srv->eval.accuracy;
    pthread_mutex_unlock(&srv->info_mu);
    if (has_eval) {
        gauge(o, "restps_eval_loss", "The evaluator's last test loss.", eval_loss);
        gauge(o, "restps_eval_accuracy", "The evaluator's last test accuracy (0 to 1).",
              eval_acc);
    }
    gauge(o, "restps_ready", "1 once the chief sent the training configuration.", ready);
    gauge(o, "restps_variables", "Variables held by this shard.", n_vars);
    gauge(o, "restps_stored_bytes", "Bytes of variable values held by this shard.",
          (double)bytes);
    put_sparse(o, srv);
    gauge(o, "restps_uptime_seconds", "Seconds since psd started.", up);
    gauge(o, "restps_waiting_pulls", "Long polls on /v1/params waiting now.",
          waiters_count(srv->waiters, WAIT_STEP) + waiters_count(srv->waiters, WAIT_CLOCK));
    gauge(o, "restps_pending_gradients", "Sync pushes kept for the current step.", pending);
    gauge(o, "restps_live_workers", "Workers whose last push came in the last 10 seconds.",
          workers_live(srv->workers, WORKERS_LIVE_SECS));
    gauge(o, "restps_examples_per_second",
          "Examples of applied and pending pushes per second over the last 5 seconds.",
          workers_examples_per_sec(srv->workers));
    if (srv->saver) {
        saver_stats cs;
        saver_get_stats(srv->saver, &cs);
        if (cs.has_last) {
            gauge(o, "restps_checkpoint_age_seconds",
                  "Seconds since the newest checkpoint was written (or, restored, since its file was).",
                  cs.age_secs);
            gauge(o, "restps_checkpoint_global_step", "The global step the newest checkpoint holds.",
                  (double)cs.last_step);
            gauge(o, "restps_checkpoint_duration_seconds",
                  "How long the last checkpoint written by this process took.", cs.last_duration_secs);
        }
        family(o, "restps_checkpoints_saved_total", "counter", "Checkpoints written by this process.");
        put(o, "restps_checkpoints_saved_total %llu\n", (unsigned long long)cs.saves);
        family(o, "restps_checkpoint_failures_total", "counter",
               "Checkpoint saves that failed (disk full, folder unwritable, ...).");
        put(o, "restps_checkpoint_failures_total %llu\n", (unsigned long long)cs.failures);
    }
    family(o, "restps_stale_gradients_dropped_total", "counter",
           "Sync pushes dropped because they were computed from an older step.");
    put(o, "restps_stale_gradients_dropped_total %lld\n", (long long)stale);
    family(o, "restps_pushes_streamed_total", "counter",
           "Pushes applied as their body arrived (async sgd; server/push_stream.c).");
    put(o, "restps_pushes_streamed_total %lld\n", (long long)sc.pushes_streamed);
    family(o, "restps_push_replays_total", "counter",
           "Pushes of the same variables applied meanwhile, applied again on top of a streamed push.");
    put(o, "restps_push_replays_total %lld\n", (long long)sc.push_replays);
}

/* Pulls and pushes, by result. */
static void put_pulls_pushes(out *o, struct metrics *m, server *srv)
{
    family(o, "restps_pulls_total", "counter",
           "GET /v1/params and GET /v1/vars/{name} by result: ok, not_modified (304), refused "
           "(4xx/5xx), aborted (the client left).");
    for (int i = 0; i < N_PULL; i++)
        put(o, "restps_pulls_total{result=\"%s\"} %llu\n", pull_results[i],
            (unsigned long long)atomic_load(&m->pulls[i]));
    uint64_t oc[4];
    workers_outcomes(srv->workers, oc);
    family(o, "restps_pushes_total", "counter",
           "POST /v1/grads and POST /v1/vars/{name}/grad by result: applied, pending (sync), "
           "stale (sync, dropped), duplicate, refused (4xx/5xx), aborted (the client left).");
    put(o, "restps_pushes_total{result=\"applied\"} %llu\n",
        (unsigned long long)(oc[STORE_PUSH_APPLIED] + atomic_load(&m->push_one_applied)));
    put(o, "restps_pushes_total{result=\"pending\"} %llu\n",
        (unsigned long long)oc[STORE_PUSH_PENDING]);
    put(o, "restps_pushes_total{result=\"stale\"} %llu\n",
        (unsigned long long)oc[STORE_PUSH_STALE]);
    put(o, "restps_pushes_total{result=\"duplicate\"} %llu\n",
        (unsigned long long)oc[STORE_PUSH_DUPLICATE]);
    put(o, "restps_pushes_total{result=\"refused\"} %llu\n",
        (unsigned long long)atomic_load(&m->push_refused));
    put(o, "restps_pushes_total{result=\"aborted\"} %llu\n",
        (unsigned long long)atomic_load(&m->push_aborted));
}

/* Requests by route, method and status, of the first n slots. */
static void put_requests(out *o, struct metrics *m, int n)
{
    family(o, "restps_requests_total", "counter",
           "Requests ended, by route (the path pattern, or unmatched), method and status code "
           "(none: no answer was sent).");
    for (int i = 0; i < n; i++) {
        slot *s = &m->slots[i];
        for (int j = 0; j < M_CODES; j++) {
            unsigned c = atomic_load(&s->codes[j].code);
            if (!c)
                continue;
            put(o, "restps_requests_total{route=\"");
            put_label_value(o, route_label(s));
            if (c == 1)
                put(o, "\",method=\"%s\",code=\"none\"} ", methods[s->method]);
            else
                put(o, "\",method=\"%s\",code=\"%u\"} ", methods[s->method], c - 1);
            put(o, "%llu\n", (unsigned long long)atomic_load(&s->codes[j].n));
        }
    }
}

/* The latency histogram by route and method, of the first n slots. */
static void put_durations(out *o, struct metrics *m, int n)
{
    family(o, "restps_request_duration_seconds", "histogram",
           "Time from a request's headers to the end of its answer, by route and method.");
    for (int i = 0; i < n; i++) {
        slot *s = &m->slots[i];
        uint64_t cum = 0;
        for (int b = 0; b <= N_BUCKETS; b++) {
            cum += atomic_load_explicit(&s->buckets[b], memory_order_relaxed);
            put(o, "restps_request_duration_seconds_bucket{route=\"");
            put_label_value(o, route_label(s));
            put(o, "\",method=\"%s\",le=\"%s\"} %llu\n", methods[s->method],
                b < N_BUCKETS ? bucket_le[b] : "+Inf", (unsigned long long)cum);
        }
        put(o, "restps_request_duration_seconds_sum{route=\"");
        put_label_value(o, route_label(s));
        put(o, "\",method=\"%s\"} ", methods[s->method]);
        put_secs(o, atomic_load_explicit(&s->sum_ns, memory_order_relaxed));
        put(o, "\nrestps_request_duration_seconds_count{route=\"");
        put_label_value(o, route_label(s));
        put(o, "\",method=\"%s\"} %llu\n", methods[s->method], (unsigned long long)cum);
    }
}

/* Body bytes received and sent by route, of the first n slots. */
static void put_bytes(out *o, struct metrics *m, int n)
{
    /* bytes by route: the methods of a path (several table rows) summed */
    for (int which = 0; which < 2; which++) {
        const char *name = which ? "restps_sent_bytes_total" : "restps_received_bytes_total";
        family(o, name, "counter",
               which ? "Response body bytes of answers that went out whole (HEAD: none), by route."
                     : "Request body bytes received, by route.");
        for (int i = 0; i < n; i++) {
            int first = 1;
            for (int k = 0; k < i && first; k++)
                if (strcmp(route_label(&m->slots[k]), route_label(&m->slots[i])) == 0)
                    first = 0;
            if (!first)
                continue;
            uint64_t sum = 0;
            for (int k = i; k < n; k++)
                if (strcmp(route_label(&m->slots[k]), route_label(&m->slots[i])) == 0)
                    sum += atomic_load(which ? &m->slots[k].bytes_out : &m->slots[k].bytes_in);
            put(o, "%s{route=\"", name);
            put_label_value(o, route_label(&m->slots[i]));
            put(o, "\"} %llu\n", (unsigned long long)sum);
        }
    }
}

/* The requests these metrics could not record. */
static void put_unrecorded(out *o, struct metrics *m)
{
    family(o, "restps_metrics_unrecorded_total", "counter",
           "Requests these metrics could not record (no room for another route or status).");
    put(o, "restps_metrics_unrecorded_total %llu\n",
        (unsigned long long)atomic_load(&m->unrecorded));
}

/* Each worker's step, last push, pushes and stale pushes. */
static void put_workers(out *o, server *srv)
{
    workers_rec *wl;
    int nw = workers_list(srv->workers, &wl);
    static const struct {
        const char *name, *type, *help;
    } wf[] = {
        {"restps_worker_last_step", "gauge", "The highest step a worker's pushes said."},
        {"restps_worker_last_push_age_seconds", "gauge",
         "Seconds since a worker's last accepted push."},
        {"restps_worker_pushes_total", "counter",
         "Accepted pushes by worker, not counting duplicates (replays)."},
        {"restps_worker_stale_gradients_dropped_total", "counter",
         "Stale pushes dropped, by worker."},
    };
    for (int f = 0; f < 4 && nw > 0; f++) {
        family(o, wf[f].name, wf[f].type, wf[f].help);
        for (int i = 0; i < nw; i++) {
            if (f == 0 && wl[i].last_step < 0)
                continue;
            put(o, "%s{worker=\"%lld\"} ", wf[f].name, wl[i].worker);
            if (f == 0)
                put(o, "%lld\n", wl[i].last_step);
            else if (f == 1) {
                put_double(o, wl[i].last_seen_secs_ago);
                put(o, "\n");
            } else
                put(o, "%llu\n", (unsigned long long)(f == 2 ? wl[i].pushes
                                                             : wl[i].stale_dropped));
        }
    }
    free(wl);
    if (nw < 0)
        o->oom = 1;
}

char *metrics_text(struct metrics *m, server *srv, size_t *len)
{
    out o = {.cap = 16384};
    o.p = malloc(o.cap);
    if (!o.p)
        return NULL;
    /* the shard */
    put_shard(&o, srv);
    /* pulls and pushes */
    put_pulls_pushes(&o, m, srv);
    /* requests, by the slots seen so far */
    int n = atomic_load_explicit(&m->n, memory_order_acquire);
    put_requests(&o, m, n);
    put_durations(&o, m, n);
    put_bytes(&o, m, n);
    put_unrecorded(&o, m);
    /* each worker */
    put_workers(&o, srv);
    if (o.oom) {
        free(o.p);
        return NULL;
    }
    *len = o.len;
    return o.p;
}
