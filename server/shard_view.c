/* shard_view.c - ps 0's view of the other shards (shard_view.h): a thread
 * that fetches every other ps task's GET /v1/status once a second over
 * libcurl multi, and the "shards" list of /v1/status. */
#include "shard_view.h"

#include <curl/curl.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "log.h"

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

struct shard_view {
    int tls;               /* the other shards speak HTTPS */
    char tls_ca[4096];     /* CA file to trust for them ("" = the system's) */
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

struct shard_view *shard_view_new(void)
{
    struct shard_view *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    pthread_mutex_init(&h->shards_mu, NULL);
    clk_mono_cond_init(&h->shards_cv);
    h->self_index = -1;
    return h;
}

void shard_view_free(struct shard_view *h)
{
    if (!h)
        return;
    shard_view_stop(h);
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
    pthread_mutex_destroy(&h->shards_mu);
    pthread_cond_destroy(&h->shards_cv);
    free(h);
}

void shard_view_set_tls(struct shard_view *h, const char *ca_file)
{
    h->tls = 1;
    snprintf(h->tls_ca, sizeof(h->tls_ca), "%s", ca_file ? ca_file : "");
}


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
static void shard_done(struct shard_view *h, shard *s, CURLcode rc)
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
    struct shard_view *h = arg;
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

void shard_view_stop(struct shard_view *h)
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

int shard_view_start(struct shard_view *h, const cluster_spec *c, const char *auth_token,
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


static json_t *self_shard(struct shard_view *h, json_t *status, int task)
{
    json_t *gs = json_object_get(status, "global_step");
    json_t *nv = json_object_get(status, "variables");
    json_t *by = json_object_get(status, "bytes");
    return json_pack("{s:i,s:s,s:b,s:I,s:I,s:I}", "task", task, "address", h->self_address,
                     "up", 1, "global_step", (json_int_t)json_integer_value(gs), "variables",
                     (json_int_t)json_integer_value(nv), "bytes",
                     (json_int_t)json_integer_value(by));
}

void shard_view_status(struct shard_view *h, json_t *status)
{
    if (!h)
        return;
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
