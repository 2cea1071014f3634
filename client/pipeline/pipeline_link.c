/* pipeline_link.c - a pipeline stage's endpoint (on the shared HTTP layer,
 * common/http_server.h) and its sends to the other stages (libcurl); see
 * pipeline_link.h. */
#include "pipeline/pipeline_link.h"

#include <arpa/inet.h>
#include <errno.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "endpoint.h"
#include "history.h"
#include "http_server.h"
#include "pipeline/pipeline_schedule.h"
#include "web_assets.h"

#define LINK_MAX_CONNS 64
#define LINK_HEADER_SECS 30
#define BODY_GRACE_SECS 10 /* then a message's body must average 1 KiB/s (the shared layer's floor) */
#define LINK_TRY_MS 100 /* between tries of a neighbour that does not answer */

struct pipe_link {
    http_server *srv;
    pipe_mailbox *box;
    int stages, stage;
    uint32_t plan_id;
    char *plan_text, *token, *name;
    char peer[PIPE_MAX_STAGES][CLUSTER_HOST_MAX + 16];
    char url[PIPE_MAX_STAGES][CLUSTER_HOST_MAX + 32];
    int replicas, replica;
    char rpeer[PIPE_MAX_REPLICAS][CLUSTER_HOST_MAX + 16];
    char rurl[PIPE_MAX_REPLICAS][CLUSTER_HOST_MAX + 32];
    int (*abort)(void);
    size_t max_msg_bytes;
    CURL *curl;
    struct curl_slist *headers;
    char resp[512];
    size_t resp_len;
    pthread_mutex_t mu; /* guards st, info and hist_step */
    pipe_link_state st;
    json_t *info;
    struct history *hist; /* the steps' losses, GET /v1/history (psd's, common/history.h) */
    int64_t hist_step;    /* the last step recorded there */
    uint64_t bytes_sent;
    double send_secs;
    atomic_int active; /* messages being received: the stage waits for their answers before it stops */
    /* the sender thread and its queue (pipe_link_post) */
    pthread_t sender;
    int sender_on;
    pthread_mutex_t qmu;
    pthread_cond_t qcv;
    struct job *head, *tail;
    int busy;              /* the thread is sending a message it took off the queue */
    atomic_int stopping, failed;
    char send_err[1024];
};

typedef struct job {
    struct job *next;
    int replica, to;
    pipe_key k;
    float *data;
    size_t n;
    int64_t ex0;
    double deadline;
} job;

/* ---- the endpoint ---- */

typedef struct msg_req {
    pipe_key key;
    size_t floats;
    int64_t example0; /* activations: the micro-batch's first example (dropout's mask) */
    int counted;      /* in l->active */
} msg_req;

int64_t pipe_loss_tag(double loss)
{
    int64_t t;
    memcpy(&t, &loss, sizeof(t));
    return t;
}

double pipe_tag_loss(int64_t tag)
{
    double d;
    memcpy(&d, &tag, sizeof(d));
    return d;
}

static unsigned parse_msg(pipe_link *l, http_req *r, msg_req *q, char *msg, size_t cap)
{
    long long step = -1, mb = -1, from = -1, plan = -1;
    const char *dir = http_query(r, "dir");
    const char *names[] = {"step", "mb", "from", "plan"};
    long long *vals[] = {&step, &mb, &from, &plan};
    const long long max[] = {(long long)1 << 50, PIPE_MAX_MICRO, PIPE_MAX_STAGES, 0xffffffffLL};
    for (int i = 0; i < 4; i++)
        if (http_query_int(r, names[i], max[i], vals[i]) != 1) {
            snprintf(msg, cap, "query argument '%s' is missing or not an integer from 0 to %lld", names[i], max[i]);
            return 400;
        }
    pipe_dir d;
    if (pipe_dir_from_wire(dir, &d) != 0) {
        snprintf(msg, cap, "query argument 'dir' must be act, grad, params, reduce or ring");
        return 400;
    }
    if ((uint32_t)plan != l->plan_id) {
        snprintf(msg, cap, "the sender's plan is %08llx, this stage's %08x (%s): start every task with the same flags",
                 plan, l->plan_id, l->plan_text);
        return 409;
    }
    int want_from = d == PIPE_ACT ? l->stage - 1 : d == PIPE_GRAD ? l->stage + 1 : (int)mb;
    if (d == PIPE_REDUCE && (from != mb || from == l->replica || from >= l->replicas)) {
        snprintf(msg, cap, "gradient sums from replica %lld (mb=%lld): this is stage %d of replica %d of %d",
                 from, mb, l->stage, l->replica, l->replicas);
        return 409;
    }
    const int left = (l->replica + l->replicas - 1) % l->replicas;
    if (d == PIPE_RING && (l->replicas < 2 || from != left)) {
        snprintf(msg, cap, "ring chunks from replica %lld: this is stage %d of replica %d of %d, which takes them "
                           "from replica %d (its left neighbour) alone",
                 from, l->stage, l->replica, l->replicas, l->replicas < 2 ? -1 : left);
        return 409;
    }
    if (d != PIPE_REDUCE && d != PIPE_RING && (from != want_from || from < 0 || from >= l->stages)) {
        snprintf(msg, cap, "%s from stage %lld: stage %d takes them from %s", pipe_dir_name(d), from, l->stage,
                 d == PIPE_ACT   ? (l->stage > 0 ? "the stage before it" : "no one (it reads the data)")
                 : d == PIPE_GRAD ? (l->stage < l->stages - 1 ? "the stage after it" : "no one (it computes the loss)")
                                 : "the stage named by mb");
        return 409;
    }
    unsigned long long len = r->expect_len;
    if (len == UINT64_MAX) {
        snprintf(msg, cap, "Content-Length is required");
        return 411;
    }
    if (len % 4) {
        snprintf(msg, cap, "a body of %llu bytes is not whole float32 values", len);
        return 400;
    }
    long long ex0 = 0;
    if (d == PIPE_ACT && http_query_int(r, "example0", (long long)1 << 62, &ex0) != 1) {
        snprintf(msg, cap, "activations need the query argument 'example0', a non-negative integer");
        return 400;
    }
    const char *ls = d == PIPE_GRAD ? http_query(r, "loss") : NULL;
    if (d == PIPE_GRAD) {
        double loss = NAN;
        char *end = NULL;
        if (ls) {
            errno = 0;
            loss = strtod(ls, &end);
            if (!*ls || *end || errno || !isfinite(loss)) {
                snprintf(msg, cap, "query argument 'loss' must be a finite number");
                return 400;
            }
        }
        ex0 = pipe_loss_tag(loss);
    }
    q->example0 = ex0;
    q->key = (pipe_key){step, (int)mb, d};
    q->floats = (size_t)(len / 4);
    return pipe_mailbox_check(l->box, &q->key, q->floats, msg, cap);
}

static enum MHD_Result msg_before_body(http_req *r)
{
    pipe_link *l = r->ctx;
    msg_req *q = r->ext;
    char msg[ENDPOINT_ERROR_MAX];
    q->counted = 1;
    atomic_fetch_add(&l->active, 1);
    unsigned bad = parse_msg(l, r, q, msg, sizeof(msg));
    if (bad == 413 || bad == 411 || bad == 503)
        return http_reply_error(r, bad, "%s", msg); /* before a byte of the body is read (503: it comes again) */
    if (bad)
        return http_refuse_after_body(r, bad, "%s", msg); /* read and dropped: the sender reads the answer */
    return MHD_YES;
}

static enum MHD_Result msg_handle(http_req *r)
{
    pipe_link *l = r->ctx;
    msg_req *q = r->ext;
    char msg[ENDPOINT_ERROR_MAX];
    if (r->body_len != q->floats * 4)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "the body ended after %zu of %zu bytes", r->body_len,
                                q->floats * 4);
    /* a NaN or an Inf would poison every stage after it (psd and the ring
     * refuse them alike); a stage whose own values went non-finite says so */
    const unsigned char *b = r->body_data;
    for (size_t i = 0; i < q->floats; i++) {
        float v;
        memcpy(&v, b + 4 * i, 4);
        if (!isfinite(v))
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s: float %zu of %zu is %s: not taken",
                                    pipe_dir_name(q->key.dir), i, q->floats, isnan(v) ? "NaN" : "infinite");
    }
    unsigned st = pipe_mailbox_put(l->box, &q->key, r->body_data, q->floats, q->example0, msg, sizeof(msg));
    if (st)
        return http_reply_error(r, st, "%s", msg);
    return http_reply_response(r, MHD_HTTP_NO_CONTENT,
                               MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT), 0);
}

static json_t *key_json(const pipe_key *k)
{
    return json_pack("{s:s,s:I,s:i}", "dir", pipe_dir_wire(k->dir), "step", (json_int_t)k->step,
                     k->dir == PIPE_PARAMS ? "stage" : "micro_batch", k->mb);
}

static enum MHD_Result state_handle(http_req *r)
{
    pipe_link *l = r->ctx;
    pthread_mutex_lock(&l->mu);
    json_t *j = json_deep_copy(l->info);
    pipe_link_state st = l->st;
    pthread_mutex_unlock(&l->mu);
    if (!j)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    json_object_set_new(j, "current_step", json_integer(st.step));
    json_object_set_new(j, "current_slot", json_integer(st.slot));
    json_object_set_new(j, "done", json_boolean(st.done));
    if (st.waiting) {
        json_t *w = key_json(&st.wait_key);
        json_object_set_new(w, "from_stage", json_integer(st.wait_from));
        json_object_set_new(w, "from", json_string(l->peer[st.wait_from]));
        json_object_set_new(j, "waiting_for", w);
    } else {
        json_object_set_new(j, "waiting_for", json_null());
    }
    json_object_set_new(j, "busy_secs", json_real(st.busy_secs));
    json_object_set_new(j, "idle_secs", json_real(st.idle_secs));
    json_object_set_new(j, "buffered", json_integer(pipe_mailbox_pending(l->box)));
    return http_reply_json(r, MHD_HTTP_OK, j);
}

/* What a stage's /v1/pipeline says of its progress (from j, a whole answer). */
static json_t *progress_of(json_t *j, int stage, const char *url)
{
    json_t *o = json_pack("{s:i,s:s}", "stage", stage, "url", url);
    const char *keys[] = {"current_step", "current_slot", "done", "waiting_for", "busy_secs", "idle_secs",
                          "buffered"};
    for (size_t i = 0; o && i < sizeof(keys) / sizeof(keys[0]); i++) {
        json_t *v = json_object_get(j, keys[i]);
        if (v)
            json_object_set(o, keys[i], v);
    }
    return o;
}

static size_t on_grow(char *p, size_t size, size_t n, void *ctx)
{
    char **buf = ctx;
    size_t len = size * n, have = *buf ? strlen(*buf) : 0;
    if (have + len > (1 << 20))
        return 0; /* a status is small */
    char *b = realloc(*buf, have + len + 1);
    if (!b)
        return 0;
    memcpy(b + have, p, len);
    b[have + len] = 0;
    *buf = b;
    return len;
}

/* GET /v1/pipeline of stage k (1 s); its progress, or {"stage", "url", "error"}. */
static json_t *fetch_progress(pipe_link *l, int k)
{
    char url[CLUSTER_HOST_MAX + 64], *body = NULL;
    snprintf(url, sizeof(url), "%s/v1/pipeline", l->url[k]);
    CURL *h = curl_easy_init();
    long status = 0;
    CURLcode cc = CURLE_FAILED_INIT;
    if (h) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 1000L);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_grow);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &body);
        cc = curl_easy_perform(h);
        if (cc == CURLE_OK)
            curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
        curl_easy_cleanup(h);
    }
    json_t *j = cc == CURLE_OK && status == 200 && body ? json_loads(body, 0, NULL) : NULL, *o;
    if (j) {
        o = progress_of(j, k, l->peer[k]);
    } else {
        char e[200];
        snprintf(e, sizeof(e), "%s", cc != CURLE_OK ? curl_easy_strerror(cc) : "not a pipeline stage's answer");
        o = json_pack("{s:i,s:s,s:s}", "stage", k, "url", l->peer[k], "error", e);
    }
    json_decref(j);
    free(body);
    return o;
}

static enum MHD_Result status_handle(http_req *r)
{
    pipe_link *l = r->ctx;
    pthread_mutex_lock(&l->mu);
    pipe_link_state st = l->st;
    pthread_mutex_unlock(&l->mu);
    json_t *j = json_pack("{s:s,s:i,s:i,s:i,s:i,s:I,s:o}", "mode", "pipeline", "stage", l->stage, "stages",
                          l->stages, "replica", l->replica, "replicas", l->replicas, "global_step",
                          (json_int_t)st.step, "last_loss", st.loss == st.loss ? json_real(st.loss) : json_null());
    if (j && l->stage == 0 && l->replica == 0) {
        json_t *all = json_array();
        for (int k = 0; k < l->stages && all; k++)
            json_array_append_new(all, fetch_progress(l, k));
        json_object_set_new(j, "pipeline", all);
    }
    if (!j)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    return http_reply_json(r, MHD_HTTP_OK, j);
}

/* The monitoring page (the chief's shows every stage from its /v1/status). */
static enum MHD_Result web_handle(http_req *r)
{
    const struct web_asset *a = web_asset_find(r->url);
    if (!a)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no route GET '%.200s' on a pipeline stage", r->url);
    return web_asset_reply(r, a);
}

static enum MHD_Result health_handle(http_req *r)
{
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:s}", "status", "ok"));
}

/* GET /v1/history[?since=STEP]: the replica's steps and losses, as psd's */
static enum MHD_Result history_handle(http_req *r)
{
    pipe_link *l = r->ctx;
    long long since = -1;
    if (http_query_int(r, "since", (long long)1 << 62, &since) < 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "since must be a non-negative integer (a global_step), "
                                                         "got '%.40s'", http_query(r, "since"));
    pthread_mutex_lock(&l->mu);
    int64_t step = l->st.step;
    pthread_mutex_unlock(&l->mu);
    size_t len;
    char *text = history_json(l->hist, since, step, &len);
    if (!text)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    return http_reply_text(r, MHD_HTTP_OK, "application/json", text, len);
}

static void msg_done(http_req *r, int completed_ok)
{
    pipe_link *l = r->ctx;
    msg_req *q = r->ext;
    (void)completed_ok;
    if (q && q->counted)
        atomic_fetch_sub(&l->active, 1);
}

static const http_route link_routes[] = {
    {"POST", "/v1/pipeline/msg", HTTP_ROUTE_AUTH | HTTP_ROUTE_BODY, 0, msg_before_body, msg_handle,
     "one message from a neighbouring stage (raw float32)"},
    {"GET", "/v1/pipeline", HTTP_ROUTE_OPEN, 0, NULL, state_handle, "the stage's plan, table and state"},
    {"GET", "/v1/status", HTTP_ROUTE_OPEN, 0, NULL, status_handle, "the stage; on the chief, every stage"},
    {"GET", "/v1/history", HTTP_ROUTE_OPEN, 0, NULL, history_handle, "the replica's step losses over time"},
    {"GET", "/healthz", HTTP_ROUTE_OPEN, 0, NULL, health_handle, "alive"},
    {"GET", "/", HTTP_ROUTE_OPEN, 0, NULL, web_handle, "the monitoring page"},
    {"GET", "/app.js", HTTP_ROUTE_OPEN, 0, NULL, web_handle, "the monitoring page's script"},
    {"GET", "/style.css", HTTP_ROUTE_OPEN, 0, NULL, web_handle, "the monitoring page's style sheet"},
};

/* ---- the sends ---- */

static size_t on_resp(char *p, size_t size, size_t n, void *ctx)
{
    pipe_link *l = ctx;
    size_t len = size * n, room = sizeof(l->resp) - 1 - l->resp_len;
    size_t k = len < room ? len : room;
    memcpy(l->resp + l->resp_len, p, k);
    l->resp_len += k;
    l->resp[l->resp_len] = '\0';
    return len;
}

static void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int send_msg(pipe_link *l, const char *base, const char *who, const pipe_key *k, int from,
                    const float *data, size_t floats, int64_t example0, double deadline, char *err, size_t errlen)
{
    char url[CLUSTER_HOST_MAX + 240];
    int at = snprintf(url, sizeof(url), "%s/v1/pipeline/msg?step=%lld&mb=%d&dir=%s&from=%d&plan=%u", base,
                      (long long)k->step, k->mb, pipe_dir_wire(k->dir), from, (unsigned)l->plan_id);
    if (k->dir == PIPE_ACT && at > 0 && (size_t)at < sizeof(url))
        snprintf(url + at, sizeof(url) - (size_t)at, "&example0=%lld", (long long)example0);
    if (k->dir == PIPE_GRAD && at > 0 && (size_t)at < sizeof(url) && isfinite(pipe_tag_loss(example0)))
        snprintf(url + at, sizeof(url) - (size_t)at, "&loss=%.17g", pipe_tag_loss(example0));
    double t0 = clk_mono_secs();
    CURL *h = l->curl;
    int tries = 0;
    for (;;) {
        tries++;
        if ((l->abort && l->abort()) || atomic_load(&l->stopping))
            return -2;
        double left = deadline - clk_mono_secs();
        long ms = left > 30 ? 30000 : left > 0.2 ? (long)(left * 1000) : 200;
        l->resp_len = 0;
        l->resp[0] = 0;
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, floats ? (const char *)data : "");
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)(floats * 4));
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, ms);
        CURLcode cc = curl_easy_perform(h);
        long status = 0;
        if (cc == CURLE_OK)
            curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
        if (cc == CURLE_OK && status == 204) {
            l->bytes_sent += floats * 4;
            l->send_secs += clk_mono_secs() - t0;
            return 0;
        }
        if (cc == CURLE_OK && status != 503) {
            json_t *j = json_loads(l->resp, 0, NULL);
            const char *e = j ? json_string_value(json_object_get(j, "error")) : NULL;
            if (status == 409 && tries > 1 && e && strstr(e, "(a duplicate)")) {
                /* an earlier try arrived, its answer did not */
                json_decref(j);
                l->bytes_sent += floats * 4;
                l->send_secs += clk_mono_secs() - t0;
                return 0;
            }
            snprintf(err, errlen, "%s answered %ld: %s", who, status, e ? e : l->resp);
            json_decref(j);
            return -1;
        }
        if (clk_mono_secs() >= deadline) {
            snprintf(err, errlen, "%s did not take it: %s", who, cc != CURLE_OK ? curl_easy_strerror(cc) : "503");
            return -1;
        }
        sleep_ms(LINK_TRY_MS);
    }
}

int pipe_link_send(pipe_link *l, int to, const pipe_key *k, const float *data, size_t floats,
                   int64_t example0, double deadline, char *err, size_t errlen)
{
    char who[CLUSTER_HOST_MAX + 40];
    snprintf(who, sizeof(who), "stage %d (%s)", to, l->peer[to]);
    return send_msg(l, l->url[to], who, k, l->stage, data, floats, example0, deadline, err, errlen);
}

int pipe_link_send_replica(pipe_link *l, int to, const pipe_key *k, const float *data, size_t floats,
                           double deadline, char *err, size_t errlen)
{
    char who[CLUSTER_HOST_MAX + 60];
    snprintf(who, sizeof(who), "stage %d of replica %d (%s)", l->stage, to, l->rpeer[to]);
    return send_msg(l, l->rurl[to], who, k, l->replica, data, floats, 0, deadline, err, errlen);
}

static void *sender_main(void *arg)
{
    pipe_link *l = arg;
    pthread_mutex_lock(&l->qmu);
    for (;;) {
        while (!l->head && !atomic_load(&l->stopping))
            pthread_cond_wait(&l->qcv, &l->qmu);
        if (atomic_load(&l->stopping))
            break;
        job *j = l->head;
        l->head = j->next;
        if (!l->head)
            l->tail = NULL;
        l->busy = 1;
        pthread_mutex_unlock(&l->qmu);
        char err[900];
        int rc = atomic_load(&l->failed) ? -1
                 : j->replica ? pipe_link_send_replica(l, j->to, &j->k, j->data, j->n, j->deadline, err, sizeof(err))
                              : pipe_link_send(l, j->to, &j->k, j->data, j->n, j->ex0, j->deadline, err, sizeof(err));
        pthread_mutex_lock(&l->qmu);
        if (rc != 0 && !atomic_load(&l->failed)) {
            if (rc == -2)
                snprintf(l->send_err, sizeof(l->send_err), "stopped");
            else
                snprintf(l->send_err, sizeof(l->send_err), "sending the %s of step %lld, %s %d: %s",
                         pipe_dir_name(j->k.dir), (long long)j->k.step,
                         pipe_dir_unit(j->k.dir), j->k.mb, err);
            atomic_store(&l->failed, 1);
        }
        free(j->data);
        free(j);
        l->busy = 0;
        pthread_cond_broadcast(&l->qcv);
    }
    pthread_mutex_unlock(&l->qmu);
    return NULL;
}

int pipe_link_post(pipe_link *l, int replica, int to, const pipe_key *k, const float *data, size_t floats,
                   int64_t example0, double deadline, char *err, size_t errlen)
{
    if (atomic_load(&l->failed)) {
        pthread_mutex_lock(&l->qmu);
        snprintf(err, errlen, "%s", l->send_err);
        pthread_mutex_unlock(&l->qmu);
        return -1;
    }
    job *j = calloc(1, sizeof(*j));
    float *copy = malloc(floats ? floats * sizeof(float) : 1);
    if (!j || !copy) {
        free(j);
        free(copy);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (floats)
        memcpy(copy, data, floats * sizeof(float));
    *j = (job){NULL, replica, to, *k, copy, floats, example0, deadline};
    pthread_mutex_lock(&l->qmu);
    if (l->tail)
        l->tail->next = j;
    else
        l->head = j;
    l->tail = j;
    pthread_cond_broadcast(&l->qcv);
    pthread_mutex_unlock(&l->qmu);
    return 0;
}

int pipe_link_flush(pipe_link *l, char *err, size_t errlen)
{
    int rc = 0;
    pthread_mutex_lock(&l->qmu);
    while ((l->head || l->busy) && !atomic_load(&l->failed)) {
        if (l->abort && l->abort()) {
            rc = -2;
            break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&l->qcv, &l->qmu, &ts);
    }
    if (rc == 0 && atomic_load(&l->failed)) {
        snprintf(err, errlen, "%s", l->send_err);
        rc = -1;
    }
    pthread_mutex_unlock(&l->qmu);
    return rc;
}

int pipe_link_failed(pipe_link *l) { return atomic_load(&l->failed); }

/* ---- set-up ---- */

pipe_link *pipe_link_new(const pipe_link_options *o, char *err, size_t errlen)
{
    pipe_link *l = calloc(1, sizeof(*l));
    if (!l) {
        snprintf(err, errlen, "out of memory");
        json_decref(o->info);
        return NULL;
    }
    pthread_mutex_init(&l->mu, NULL);
    /* no loss until the stage's first set_state: /v1/status may be asked
     * before it (it said last_loss 0.0 at global_step 0) */
    l->st.loss = NAN;
    l->box = o->mailbox;
    l->stages = o->stages;
    l->stage = o->stage;
    l->plan_id = o->plan_id;
    l->abort = o->abort;
    l->info = o->info;
    l->plan_text = strdup(o->plan_text ? o->plan_text : "");
    l->name = strdup(o->name ? o->name : "stage");
    l->token = o->token ? strdup(o->token) : NULL;
    for (int s = 0; s < o->stages; s++) {
        const cluster_addr *a = &o->peers[s];
        const char *fmt = strchr(a->host, ':') ? "[%s]:%d" : "%s:%d";
        snprintf(l->peer[s], sizeof(l->peer[s]), fmt, a->host, a->port);
        snprintf(l->url[s], sizeof(l->url[s]), strchr(a->host, ':') ? "http://[%s]:%d" : "http://%s:%d", a->host,
                 a->port);
    }
    l->replicas = o->replicas > 0 ? o->replicas : 1;
    l->replica = o->replica;
    for (int r = 0; r < l->replicas && o->replica_peers; r++) {
        const cluster_addr *a = &o->replica_peers[r];
        const char *fmt = strchr(a->host, ':') ? "[%s]:%d" : "%s:%d";
        snprintf(l->rpeer[r], sizeof(l->rpeer[r]), fmt, a->host, a->port);
        snprintf(l->rurl[r], sizeof(l->rurl[r]), strchr(a->host, ':') ? "http://[%s]:%d" : "http://%s:%d", a->host,
                 a->port);
    }
    pthread_mutex_init(&l->qmu, NULL);
    pthread_cond_init(&l->qcv, NULL);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    l->curl = curl_easy_init();
    l->hist = history_new();
    if (!l->info || !l->plan_text || !l->name || (o->token && !l->token) || !l->curl || !l->hist) {
        snprintf(err, errlen, "out of memory");
        pipe_link_free(l);
        return NULL;
    }
    l->headers = curl_slist_append(NULL, "Content-Type: application/octet-stream");
    l->headers = curl_slist_append(l->headers, "Expect:");
    if (l->token) {
        char auth[1100];
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s", l->token);
        l->headers = curl_slist_append(l->headers, auth);
    }
    CURL *h = l->curl;
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, l->headers);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_resp);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, l);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 3000L);
    curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*");

    /* the endpoint on this stage's address */
    const cluster_addr *self = &o->peers[o->stage];
    int loop = endpoint_host_is_loopback(self->host);
    struct sockaddr_in6 sa6 = {0};
    sa6.sin6_family = AF_INET6;
    sa6.sin6_port = htons((uint16_t)self->port);
    sa6.sin6_addr = loop ? in6addr_loopback : in6addr_any;
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)self->port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int v6 = !loop || strchr(self->host, ':') != NULL; /* loopback v4 unless the host is ::1 */
    http_server_config cfg = {.name = "pipeline stage", .listen_fd = -1,
                              .bind_addr = v6 ? (const struct sockaddr *)&sa6 : (const struct sockaddr *)&sa,
                              .dual_stack = !loop, .threads = 0, .idle_timeout_secs = 120,
                              .header_timeout_secs = LINK_HEADER_SECS, .body_grace_secs = BODY_GRACE_SECS,
                              .max_conns = LINK_MAX_CONNS, .conn_memory = 256 * 1024, .token = l->token};
    l->srv = http_server_new(&cfg, err, errlen);
    http_module mod = {.name = "pipeline", .routes = link_routes,
                       .n_routes = sizeof(link_routes) / sizeof(link_routes[0]), .ctx = l,
                       .max_body = (uint64_t)64 << 20, .swallow_refused_max = (uint64_t)1 << 20,
                       .ext_size = sizeof(msg_req), .done = msg_done};
    if (!l->srv || http_server_add(l->srv, &mod, err, errlen) != 0 ||
        http_server_start(l->srv, err, errlen) < 0) {
        char e2[512];
        snprintf(e2, sizeof(e2), "%s", err);
        snprintf(err, errlen, "cannot serve on %s: %s", l->peer[o->stage], e2);
        pipe_link_free(l);
        return NULL;
    }
    if (pthread_create(&l->sender, NULL, sender_main, l) != 0) {
        snprintf(err, errlen, "cannot start the sender thread");
        pipe_link_free(l);
        return NULL;
    }
    l->sender_on = 1;
    return l;
}

void pipe_link_free(pipe_link *l)
{
    if (!l)
        return;
    /* a message this stage has taken may still wait for its 204: the
     * sender would take the closed connection for a lost message */
    for (int i = 0; i < 200 && l->srv && atomic_load(&l->active) > 0; i++)
        sleep_ms(10);
    if (l->sender_on) {
        pthread_mutex_lock(&l->qmu);
        atomic_store(&l->stopping, 1);
        pthread_cond_broadcast(&l->qcv);
        pthread_mutex_unlock(&l->qmu);
        pthread_join(l->sender, NULL);
    }
    while (l->head) {
        job *j = l->head;
        l->head = j->next;
        free(j->data);
        free(j);
    }
    pthread_mutex_destroy(&l->qmu);
    pthread_cond_destroy(&l->qcv);
    http_server_free(l->srv);
    if (l->curl)
        curl_easy_cleanup(l->curl);
    curl_slist_free_all(l->headers);
    json_decref(l->info);
    history_free(l->hist);
    free(l->plan_text);
    free(l->name);
    free(l->token);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

void pipe_link_set_state(pipe_link *l, const pipe_link_state *st)
{
    pthread_mutex_lock(&l->mu);
    l->st = *st;
    /* a step done with its loss: a point of /v1/history (once per step) */
    int record = st->step > l->hist_step && st->loss == st->loss;
    if (record)
        l->hist_step = st->step;
    pthread_mutex_unlock(&l->mu);
    if (record)
        history_record(l->hist, st->step, 1, st->loss);
}

const char *pipe_link_peer(const pipe_link *l, int s) { return l->peer[s]; }
const char *pipe_link_replica_peer(const pipe_link *l, int r) { return l->rpeer[r]; }
uint64_t pipe_link_bytes_sent(const pipe_link *l) { return l->bytes_sent; }
double pipe_link_send_secs(const pipe_link *l) { return l->send_secs; }
