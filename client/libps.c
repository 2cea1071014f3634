/* libps.c - psd's HTTP contract over libcurl: one keep-alive easy handle per
 * shard, bodies read straight into the caller's buffers and sent straight from
 * them, retries with backoff where a retry cannot apply anything twice. */
#include "libps.h"

#include <curl/curl.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cluster.h"

#define JSON_LIMIT ((size_t)256 << 20)

struct ps_client {
    int n;
    CURL **h;
    char (*base)[CLUSTER_HOST_MAX + 32]; /* "http://host:port" */
    char (*label)[CLUSTER_HOST_MAX + 32]; /* "ps 0 (host:port)" */
    ps_options opt;
    char *auth;  /* "Authorization: Bearer ..." or NULL */
    char err[1024];
    long status;
    long extra_timeout_ms; /* added to the next request's limit (long polls) */
    unsigned seed;         /* backoff jitter */
    CURLM *multi;          /* requests to every shard at once */
    char *ca_file;         /* HTTPS: the CAs to trust, or NULL (the system's) */
    int (*abort_fn)(void); /* nonzero: stop waiting (a signal asked the program to stop) */
};

/* Where an answer goes. */
typedef struct sink {
    CURL *h;
    unsigned char *buf;
    size_t cap, len;
    int growable;  /* buf is ours, grow up to JSON_LIMIT */
    int overflow;
    char errbody[1024];
    size_t errlen;
    /* headers we read */
    char shape[256];
    int has_shape;
    uint64_t version;
    int64_t global_step;
    int has_step;
} sink;

/* What a request sends. */
typedef struct source {
    const unsigned char *part[2];
    size_t len[2];
    size_t idx, pos;
} source;

enum retry_mode { RETRY_ANY, RETRY_CONNECT_ONLY };

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

static void set_err(ps_client *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_err(ps_client *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof(c->err), fmt, ap);
    va_end(ap);
}

const char *ps_error(const ps_client *c) { return c->err; }
long ps_http_status(const ps_client *c) { return c->status; }
int ps_shards(const ps_client *c) { return c->n; }

ps_client *ps_client_new(const char *const *hosts, int n, const ps_options *opt, char *err,
                         size_t errlen)
{
    pthread_once(&curl_once, curl_init);
    if (curl_init_rc != CURLE_OK) {
        snprintf(err, errlen, "libcurl init failed: %s", curl_easy_strerror(curl_init_rc));
        return NULL;
    }
    if (n < 1) {
        snprintf(err, errlen, "no ps hosts given");
        return NULL;
    }
    ps_client *c = calloc(1, sizeof(*c));
    if (!c)
        goto oom;
    c->n = n;
    c->h = calloc((size_t)n, sizeof(*c->h));
    c->base = calloc((size_t)n, sizeof(*c->base));
    c->label = calloc((size_t)n, sizeof(*c->label));
    if (!c->h || !c->base || !c->label)
        goto oom;
    c->opt.timeout_ms = 30000;
    c->opt.connect_timeout_ms = 3000;
    c->opt.retries = 3;
    c->opt.backoff_ms = 100;
    c->opt.backoff_max_ms = 2000;
    {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        c->seed = (unsigned)ts.tv_nsec ^ (unsigned)getpid();
    }
    if (opt) {
        if (opt->backoff_max_ms > 0)
            c->opt.backoff_max_ms = opt->backoff_max_ms;
        if (opt->retry_ms > 0)
            c->opt.retry_ms = opt->retry_ms;
        if (opt->timeout_ms > 0)
            c->opt.timeout_ms = opt->timeout_ms;
        if (opt->connect_timeout_ms > 0)
            c->opt.connect_timeout_ms = opt->connect_timeout_ms;
        if (opt->retries >= 0)
            c->opt.retries = opt->retries;
        if (opt->backoff_ms > 0)
            c->opt.backoff_ms = opt->backoff_ms;
        if (opt->token && asprintf(&c->auth, "Authorization: Bearer %s", opt->token) < 0)
            goto oom;
        if (opt->ca_file && !(c->ca_file = strdup(opt->ca_file)))
            goto oom;
    }
    for (int i = 0; i < n; i++) {
        cluster_addr a;
        if (cluster_parse_addr(hosts[i], &a, err, errlen) != 0) {
            ps_client_free(c);
            return NULL;
        }
        int tls = opt && (opt->tls || opt->ca_file);
        const char *fmt = strchr(a.host, ':') ? (tls ? "https://[%s]:%d" : "http://[%s]:%d")
                                              : (tls ? "https://%s:%d" : "http://%s:%d");
        snprintf(c->base[i], sizeof(c->base[i]), fmt, a.host, a.port);
        snprintf(c->label[i], sizeof(c->label[i]), "ps %d (%s)", i, c->base[i] + (tls ? 8 : 7));
        if (!(c->h[i] = curl_easy_init()))
            goto oom;
    }
    return c;
oom:
    snprintf(err, errlen, "out of memory");
    ps_client_free(c);
    return NULL;
}

void ps_client_free(ps_client *c)
{
    if (!c)
        return;
    if (c->multi)
        curl_multi_cleanup(c->multi);
    for (int i = 0; c->h && i < c->n; i++)
        if (c->h[i])
            curl_easy_cleanup(c->h[i]);
    free(c->h);
    free(c->base);
    free(c->label);
    free(c->auth);
    free(c->ca_file);
    free(c);
}

static size_t on_write(char *p, size_t size, size_t nmemb, void *ud)
{
    sink *s = ud;
    size_t n = size * nmemb;
    long code = 0;
    curl_easy_getinfo(s->h, CURLINFO_RESPONSE_CODE, &code);
    if (code >= 300) {
        size_t room = sizeof(s->errbody) - 1 - s->errlen;
        size_t k = n < room ? n : room;
        memcpy(s->errbody + s->errlen, p, k);
        s->errlen += k;
        s->errbody[s->errlen] = '\0';
        return n;
    }
    if (s->len + n > s->cap) {
        if (!s->growable || s->len + n > JSON_LIMIT) {
            s->overflow = 1;
            return 0;
        }
        size_t nc = s->cap ? s->cap : 4096;
        while (nc < s->len + n)
            nc *= 2;
        unsigned char *nb = realloc(s->buf, nc);
        if (!nb) {
            s->overflow = 1;
            return 0;
        }
        s->buf = nb;
        s->cap = nc;
    }
    memcpy(s->buf + s->len, p, n);
    s->len += n;
    return n;
}

/* Case-insensitive "Name:" match; returns the trimmed value or NULL. */
static const char *header_value(const char *line, size_t n, const char *name, char *out,
                                size_t outcap)
{
    size_t nl = strlen(name);
    if (n <= nl || strncasecmp(line, name, nl) != 0 || line[nl] != ':')
        return NULL;
    const char *v = line + nl + 1, *e = line + n;
    while (v < e && (*v == ' ' || *v == '\t'))
        v++;
    while (e > v && (e[-1] == '\r' || e[-1] == '\n' || e[-1] == ' '))
        e--;
    size_t l = (size_t)(e - v);
    if (l >= outcap)
        l = outcap - 1;
    memcpy(out, v, l);
    out[l] = '\0';
    return out;
}

static size_t on_header(char *p, size_t size, size_t nmemb, void *ud)
{
    sink *s = ud;
    size_t n = size * nmemb;
    char v[256];
    if (n >= 5 && strncmp(p, "HTTP/", 5) == 0) { /* a new response: forget the last one's */
        s->has_shape = s->has_step = 0;
        s->version = 0;
    } else if (header_value(p, n, "X-Shape", v, sizeof(v))) {
        snprintf(s->shape, sizeof(s->shape), "%s", v);
        s->has_shape = 1;
    } else if (header_value(p, n, "X-Version", v, sizeof(v))) {
        s->version = strtoull(v, NULL, 10);
    } else if (header_value(p, n, "X-Global-Step", v, sizeof(v))) {
        s->global_step = strtoll(v, NULL, 10);
        s->has_step = 1;
    } else if (!s->growable && header_value(p, n, "Content-Length", v, sizeof(v))) {
        long code = 0;
        curl_easy_getinfo(s->h, CURLINFO_RESPONSE_CODE, &code);
        if (code < 300 && strtoull(v, NULL, 10) > s->cap) {
            s->overflow = 1;
            return 0; /* stop before reading a body that cannot fit */
        }
    }
    return n;
}

static size_t on_read(char *p, size_t size, size_t nmemb, void *ud)
{
    source *src = ud;
    size_t room = size * nmemb, done = 0;
    while (done < room && src->idx < 2) {
        size_t left = src->len[src->idx] - src->pos;
        if (left == 0) {
            src->idx++;
            src->pos = 0;
            continue;
        }
        size_t k = left < room - done ? left : room - done;
        memcpy(p + done, src->part[src->idx] + src->pos, k);
        src->pos += k;
        done += k;
    }
    return done;
}

static int on_progress(void *ud, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    (void)dt, (void)dn, (void)ut, (void)un;
    ps_client *c = ud;
    return c->abort_fn && c->abort_fn() ? 1 : 0;
}

void ps_set_abort(ps_client *c, int (*fn)(void)) { c->abort_fn = fn; }

static void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}

/* One request of a batch: what it sends, where its answer lands, how it ended. */
typedef struct xfer {
    int shard;
    const char *method, *path;
    const char *const *extra; /* NULL-ended header lines */
    source *src;              /* may be NULL */
    sink *s;
    enum retry_mode mode;
    char url[CLUSTER_HOST_MAX + 32 + 512];
    struct curl_slist *hdrs;
    size_t start_len;
    int rc, done, retry;
    long status;
    char err[1024];
    char curl_err[CURL_ERROR_SIZE]; /* libcurl's own words (certificate problems) */
} xfer;

/* The request's URL and header list; PS_OK or an error in x->err. */
static int xfer_prepare(ps_client *c, xfer *x)
{
    if (x->shard < 0 || x->shard >= c->n) {
        snprintf(x->err, sizeof(x->err), "shard %d out of range (the cluster has %d ps tasks)",
                 x->shard, c->n);
        return x->rc = PS_EINVAL;
    }
    if ((size_t)snprintf(x->url, sizeof(x->url), "%s%s", c->base[x->shard], x->path) >= sizeof(x->url)) {
        snprintf(x->err, sizeof(x->err), "path too long: %.100s", x->path);
        return x->rc = PS_EINVAL;
    }
    const char *fixed[] = {"Expect:", c->auth};
    for (int i = 0; i < 2; i++) {
        if (!fixed[i])
            continue;
        struct curl_slist *t = curl_slist_append(x->hdrs, fixed[i]);
        if (!t)
            goto oom;
        x->hdrs = t;
    }
    for (int i = 0; x->extra && x->extra[i]; i++) {
        struct curl_slist *t = curl_slist_append(x->hdrs, x->extra[i]);
        if (!t)
            goto oom;
        x->hdrs = t;
    }
    x->start_len = x->s->len;
    return x->rc = PS_OK;
oom:
    snprintf(x->err, sizeof(x->err), "out of memory");
    return x->rc = PS_ENOMEM;
}

/* Set the shard's handle up for one try of x. */
static CURL *xfer_setup(ps_client *c, xfer *x)
{
    CURL *h = c->h[x->shard];
    sink *s = x->s;
    curl_easy_reset(h);
    s->h = h;
    s->len = x->start_len;
    s->overflow = 0;
    s->errlen = 0;
    s->errbody[0] = '\0';
    curl_easy_setopt(h, CURLOPT_URL, x->url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, x->hdrs);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, s);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, s);
    /* Over HTTPS these sizes do not reach the socket: OpenSSL reads and
     * writes one TLS record (16 KiB at most) per system call, two reads per
     * record. OpenSSL's read-ahead would batch the reads, but curl 7.88 then
     * stalls: records already buffered are not seen by its poll (measured:
     * transfers timed out). */
    curl_easy_setopt(h, CURLOPT_BUFFERSIZE, 1L << 20);
    curl_easy_setopt(h, CURLOPT_UPLOAD_BUFFERSIZE, 512L << 10);
    curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, c->opt.timeout_ms + c->extra_timeout_ms);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, c->opt.connect_timeout_ms);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROXY, ""); /* a cluster is never behind http_proxy */
    curl_easy_setopt(h, CURLOPT_PRIVATE, x);
    x->curl_err[0] = '\0';
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, x->curl_err);
    if (c->ca_file)
        curl_easy_setopt(h, CURLOPT_CAINFO, c->ca_file);
    if (c->abort_fn) {
        curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
        curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(h, CURLOPT_XFERINFODATA, c);
    }
    if (x->src) {
        x->src->idx = 0;
        x->src->pos = 0;
        curl_off_t total = (curl_off_t)(x->src->len[0] + x->src->len[1]);
        curl_easy_setopt(h, CURLOPT_READFUNCTION, on_read);
        curl_easy_setopt(h, CURLOPT_READDATA, x->src);
        if (strcmp(x->method, "PUT") == 0) {
            curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
            curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, total);
        } else {
            curl_easy_setopt(h, CURLOPT_POST, 1L);
            curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, total);
        }
    } else if (strcmp(x->method, "GET") != 0) {
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, x->method);
    }
    return h;
}

/* How one try of x ended: x->rc, x->status, x->err, x->retry. */
static void xfer_judge(ps_client *c, xfer *x, CURLcode cr)
{
    long code = 0;
    curl_easy_getinfo(c->h[x->shard], CURLINFO_RESPONSE_CODE, &code);
    x->status = code;
    x->retry = 0;
    if (cr == CURLE_OK && code < 300) {
        x->rc = PS_OK;
        x->done = 1;
        return;
    }
    x->done = 1;
    if (x->s->overflow) {
        snprintf(x->err, sizeof(x->err), "%s: %s %s: the answer does not fit the buffer of %zu bytes",
                 c->label[x->shard], x->method, x->path, x->s->cap);
        x->rc = PS_ETOOBIG;
        return;
    }
    if (cr == CURLE_OK) {
        /* the server answered with an error: quote its message */
        const char *msg = x->s->errbody;
        json_t *j = json_loads(x->s->errbody, 0, NULL);
        if (j && json_is_string(json_object_get(j, "error")))
            msg = json_string_value(json_object_get(j, "error"));
        snprintf(x->err, sizeof(x->err), "%.100s: %s %.200s: HTTP %ld: %.600s", c->label[x->shard], x->method,
                 x->path, code, msg);
        json_decref(j);
        x->rc = PS_EHTTP;
        x->retry = code == 503 && x->mode == RETRY_ANY;
    } else {
        snprintf(x->err, sizeof(x->err), "%.100s: %s %.200s: %s%s%.600s", c->label[x->shard],
                 x->method, x->path, curl_easy_strerror(cr), x->curl_err[0] ? ": " : "", x->curl_err);
        int tls = cr == CURLE_PEER_FAILED_VERIFICATION || cr == CURLE_SSL_CERTPROBLEM || cr == CURLE_SSL_CACERT_BADFILE ||
                  cr == CURLE_SSL_ISSUER_ERROR;
        x->rc = tls ? PS_ETLS : PS_ENET;
        x->retry = !tls && (x->mode == RETRY_ANY || cr == CURLE_COULDNT_CONNECT);
    }
}

/* One try of every x not done yet: one at a time when it is one or when
 * every body is small, else all at once over libcurl's multi interface (one
 * connection per shard). */
#define MULTI_MIN_BYTES ((size_t)1 << 20)
static void xfer_try(ps_client *c, xfer *xs, int n)
{
    int todo = 0, last = -1;
    for (int i = 0; i < n; i++)
        if (!xs[i].done) {
            todo++;
            last = i;
        }
    if (todo == 1) {
        CURL *h = xfer_setup(c, &xs[last]);
        xfer_judge(c, &xs[last], curl_easy_perform(h));
        return;
    }
    /* small bodies go one after the other: on loopback the multi interface's
     * extra wake-ups cost more than the overlap saves (measured: the example
     * model on 2 ps, 1 sync worker, 580 vs 414 steps/s) */
    size_t biggest = 0;
    for (int i = 0; i < n; i++)
        if (!xs[i].done) {
            size_t b = xs[i].src ? xs[i].src->len[0] + xs[i].src->len[1] : xs[i].s->cap;
            if (b > biggest)
                biggest = b;
        }
    if (biggest < MULTI_MIN_BYTES) {
        for (int i = 0; i < n; i++)
            if (!xs[i].done) {
                CURL *h = xfer_setup(c, &xs[i]);
                xfer_judge(c, &xs[i], curl_easy_perform(h));
            }
        return;
    }
    if (!c->multi && !(c->multi = curl_multi_init())) {
        for (int i = 0; i < n; i++)
            if (!xs[i].done) {
                xs[i].done = 1;
                xs[i].rc = PS_ENOMEM;
                snprintf(xs[i].err, sizeof(xs[i].err), "out of memory (libcurl multi)");
            }
        return;
    }
    for (int i = 0; i < n; i++)
        if (!xs[i].done)
            curl_multi_add_handle(c->multi, xfer_setup(c, &xs[i]));
    int running = 1;
    while (running) {
        CURLMcode mc = curl_multi_perform(c->multi, &running);
        if (mc == CURLM_OK && running)
            mc = curl_multi_poll(c->multi, NULL, 0, 1000, NULL);
        if (mc != CURLM_OK)
            break;
    }
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(c->multi, &left)))
        if (msg->msg == CURLMSG_DONE) {
            xfer *x = NULL;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&x);
            if (x)
                xfer_judge(c, x, msg->data.result);
        }
    for (int i = 0; i < n; i++)
        if (!xs[i].done) { /* the multi interface failed under it */
            xs[i].done = 1;
            xs[i].rc = PS_ENET;
            snprintf(xs[i].err, sizeof(xs[i].err), "%s: %s %s: transfer did not finish",
                     c->label[xs[i].shard], xs[i].method, xs[i].path);
        }
    for (int i = 0; i < n; i++)
        curl_multi_remove_handle(c->multi, c->h[xs[i].shard]);
}

/* Run xs (distinct shards) with retries: network errors and 503 where the
 * mode allows, with backoff and jitter, `retries` times and for retry_ms in
 * all. Returns PS_OK, or the first failure in shard order (its message in
 * ps_error, its status in ps_http_status). */
static int do_requests(ps_client *c, xfer *xs, int n)
{
    int rc = PS_OK;
    for (int i = 0; i < n; i++)
        if (xfer_prepare(c, &xs[i]) != PS_OK)
            xs[i].done = 1;
    long wait = c->opt.backoff_ms;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int attempt = 0;; attempt++) {
        xfer_try(c, xs, n);
        int again = 0;
        for (int i = 0; i < n; i++)
            again |= xs[i].rc != PS_OK && xs[i].retry;
        if (!again || (c->abort_fn && c->abort_fn()))
            break;
        struct timespec t1;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long spent = (long)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000);
        if (attempt >= c->opt.retries && spent >= c->opt.retry_ms)
            break;
        /* jitter: uniform in [wait/2, wait] */
        long w = wait / 2 + (long)(rand_r(&c->seed) % (unsigned)(wait - wait / 2 + 1));
        sleep_ms(w);
        wait = wait * 2 > c->opt.backoff_max_ms ? c->opt.backoff_max_ms : wait * 2;
        for (int i = 0; i < n; i++)
            if (xs[i].rc != PS_OK && xs[i].retry)
                xs[i].done = 0;
    }
    c->status = 0;
    for (int i = 0; i < n; i++) {
        curl_slist_free_all(xs[i].hdrs);
        xs[i].hdrs = NULL;
        if (rc == PS_OK && xs[i].rc != PS_OK) {
            rc = xs[i].rc;
            snprintf(c->err, sizeof(c->err), "%s", xs[i].err);
            c->status = xs[i].status;
        }
    }
    if (rc == PS_OK && n > 0)
        c->status = xs[n - 1].status;
    c->extra_timeout_ms = 0;
    return rc;
}

/* One request with retries. method: "GET", "PUT", "POST". extra: NULL-ended
 * header lines. src may be NULL. The answer lands in s. */
static int do_request(ps_client *c, int shard, const char *method, const char *path,
                      const char *const *extra, source *src, sink *s, enum retry_mode mode)
{
    xfer x = {.shard = shard, .method = method, .path = path, .extra = extra, .src = src, .s = s,
              .mode = mode};
    return do_requests(c, &x, 1);
}

static int get_json(ps_client *c, int shard, const char *method, const char *path,
                    const char *const *extra, source *src, enum retry_mode mode, json_t **out)
{
    sink s = {.growable = 1};
    int rc = do_request(c, shard, method, path, extra, src, &s, mode);
    if (rc == PS_OK) {
        json_error_t je;
        *out = json_loadb((const char *)s.buf, s.len, 0, &je);
        if (!*out) {
            set_err(c, "%s: %s %s: answer is not JSON: %s", c->label[shard], method, path, je.text);
            rc = PS_EPROTO;
        }
    }
    free(s.buf);
    return rc;
}

static int check_name(ps_client *c, const char *name)
{
    char e[256];
    if (!name || tensor_name_check(name, e, sizeof(e)) != 0) {
        set_err(c, "bad variable name: %s", name ? e : "NULL");
        return PS_EINVAL;
    }
    return PS_OK;
}

static int shape_from_json(json_t *a, tensor_shape *out)
{
    if (!json_is_array(a) || json_array_size(a) > TENSOR_MAX_DIMS)
        return -1;
    out->ndim = (int)json_array_size(a);
    for (int i = 0; i < out->ndim; i++) {
        json_t *d = json_array_get(a, (size_t)i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return -1;
        out->dims[i] = json_integer_value(d);
    }
    return 0;
}

int ps_list(ps_client *c, int shard, ps_var_info **vars, int *n, int64_t *global_step)
{
    json_t *j;
    int rc = get_json(c, shard, "GET", "/v1/vars", NULL, NULL, RETRY_ANY, &j);
    if (rc)
        return rc;
    json_t *arr = json_object_get(j, "vars"), *gs = json_object_get(j, "global_step");
    if (!json_is_array(arr) || !json_is_integer(gs)) {
        json_decref(j);
        set_err(c, "%s: GET /v1/vars: answer lacks vars or global_step", c->label[shard]);
        return PS_EPROTO;
    }
    size_t k = json_array_size(arr);
    ps_var_info *v = calloc(k ? k : 1, sizeof(*v));
    if (!v) {
        json_decref(j);
        set_err(c, "out of memory");
        return PS_ENOMEM;
    }
    for (size_t i = 0; i < k; i++) {
        json_t *e = json_array_get(arr, i);
        const char *name = json_string_value(json_object_get(e, "name"));
        if (!name || strlen(name) > TENSOR_NAME_MAX ||
            shape_from_json(json_object_get(e, "shape"), &v[i].shape) != 0) {
            free(v);
            json_decref(j);
            set_err(c, "%s: GET /v1/vars: malformed entry %zu", c->label[shard], i);
            return PS_EPROTO;
        }
        strcpy(v[i].name, name);
        v[i].version = (uint64_t)json_integer_value(json_object_get(e, "version"));
        v[i].bytes = (uint64_t)json_integer_value(json_object_get(e, "bytes"));
    }
    if (global_step)
        *global_step = json_integer_value(gs);
    *vars = v;
    *n = (int)k;
    json_decref(j);
    return PS_OK;
}

int ps_pull(ps_client *c, int shard, const char *name, float *dst, size_t cap, ps_var_info *info)
{
    int rc = check_name(c, name);
    if (rc)
        return rc;
    char path[TENSOR_NAME_MAX + 32];
    snprintf(path, sizeof(path), "/v1/vars/%s", name);
    sink s = {.buf = (unsigned char *)dst, .cap = cap * sizeof(float)};
    const char *extra[] = {"Accept: application/octet-stream", NULL};
    rc = do_request(c, shard, "GET", path, extra, NULL, &s, RETRY_ANY);
    if (rc)
        return rc;
    tensor_shape shape;
    char e[256];
    if (!s.has_shape || tensor_shape_parse(s.shape, &shape, e, sizeof(e)) != 0 ||
        (size_t)tensor_shape_numel(&shape) * sizeof(float) != s.len) {
        set_err(c, "%s: GET %s: X-Shape '%s' does not match the %zu bytes received",
                c->label[shard], path, s.has_shape ? s.shape : "(none)", s.len);
        return PS_EPROTO;
    }
    if (info) {
        snprintf(info->name, sizeof(info->name), "%s", name);
        info->shape = shape;
        info->version = s.version;
        info->bytes = s.len;
    }
    return PS_OK;
}

int ps_put(ps_client *c, int shard, const char *name, const tensor_shape *shape,
           const float *data, int only_create, int *created)
{
    int rc = check_name(c, name);
    if (rc)
        return rc;
    int64_t numel = tensor_shape_numel(shape);
    char path[TENSOR_NAME_MAX + 32], xs[256] = "X-Shape: ";
    snprintf(path, sizeof(path), "/v1/vars/%s", name);
    tensor_shape_header(shape, xs + 9, sizeof(xs) - 9);
    const char *extra[] = {xs, "Content-Type: application/octet-stream", "X-Dtype: float32",
                           only_create ? "If-None-Match: *" : NULL, NULL};
    source src = {.part = {(const unsigned char *)data, NULL},
                  .len = {(size_t)numel * sizeof(float), 0}};
    sink s = {.growable = 1};
    rc = do_request(c, shard, "PUT", path, extra, &src, &s, RETRY_ANY);
    free(s.buf);
    if (rc == PS_OK && created)
        *created = c->status == 201;
    return rc;
}

static int step_from(ps_client *c, int shard, json_t *j, const char *what, int64_t *global_step)
{
    json_t *gs = json_object_get(j, "global_step");
    if (!json_is_integer(gs)) {
        set_err(c, "%s: %s: answer lacks global_step", c->label[shard], what);
        return PS_EPROTO;
    }
    if (global_step)
        *global_step = json_integer_value(gs);
    return PS_OK;
}

int ps_push_grad(ps_client *c, int shard, const char *name, const float *grad, size_t numel,
                 int64_t *global_step)
{
    int rc = check_name(c, name);
    if (rc)
        return rc;
    char path[TENSOR_NAME_MAX + 32];
    snprintf(path, sizeof(path), "/v1/vars/%s/grad", name);
    const char *extra[] = {"Content-Type: application/octet-stream", NULL};
    source src = {.part = {(const unsigned char *)grad, NULL}, .len = {numel * sizeof(float), 0}};
    json_t *j;
    /* not idempotent: retried only when the connection was never made */
    rc = get_json(c, shard, "POST", path, extra, &src, RETRY_CONNECT_ONLY, &j);
    if (rc)
        return rc;
    rc = step_from(c, shard, j, path, global_step);
    json_decref(j);
    return rc;
}

static int pull_params(ps_client *c, int shard, const char *path, void *buf, size_t cap,
                       size_t *len, int64_t *global_step)
{
    sink s = {.buf = buf, .cap = cap};
    int rc = do_request(c, shard, "GET", path, NULL, NULL, &s, RETRY_ANY);
    if (rc)
        return rc;
    *len = s.len;
    if (global_step) {
        if (!s.has_step) {
            set_err(c, "%s: GET /v1/params: no X-Global-Step header", c->label[shard]);
            return PS_EPROTO;
        }
        *global_step = s.global_step;
    }
    return PS_OK;
}

int ps_pull_params(ps_client *c, int shard, void *buf, size_t cap, size_t *len,
                   int64_t *global_step)
{
    return pull_params(c, shard, "/v1/params", buf, cap, len, global_step);
}

int ps_pull_params_wait(ps_client *c, int shard, int64_t min_step, long timeout_ms, void *buf,
                        size_t cap, size_t *len, int64_t *global_step)
{
    char path[96];
    if (min_step < 0 || timeout_ms < 0 || timeout_ms > 300000) {
        set_err(c, "min_step must be >= 0 and timeout_ms in [0, 300000]");
        return PS_EINVAL;
    }
    snprintf(path, sizeof(path), "/v1/params?min_step=%lld&timeout_ms=%ld", (long long)min_step,
             timeout_ms);
    c->extra_timeout_ms = timeout_ms;
    return pull_params(c, shard, path, buf, cap, len, global_step);
}

int ps_pull_params_wait_worker(ps_client *c, int shard, int64_t min_step, long timeout_ms,
                               int worker, void *buf, size_t cap, size_t *len,
                               int64_t *global_step)
{
    char path[128];
    if (min_step < 0 || timeout_ms < 0 || timeout_ms > 300000 || worker < 0) {
        set_err(c, "min_step and worker must be >= 0 and timeout_ms in [0, 300000]");
        return PS_EINVAL;
    }
    snprintf(path, sizeof(path), "/v1/params?min_step=%lld&timeout_ms=%ld&worker=%d",
             (long long)min_step, timeout_ms, worker);
    c->extra_timeout_ms = timeout_ms;
    return pull_params(c, shard, path, buf, cap, len, global_step);
}

void ps_set_retry_ms(ps_client *c, long retry_ms) { c->opt.retry_ms = retry_ms > 0 ? retry_ms : 0; }

int ps_push_grads(ps_client *c, int shard, const void *head, size_t head_len, const void *data,
                  size_t data_len, const char *push_id, int64_t *global_step, int *duplicate)
{
    int outcome = PS_PUSH_APPLIED;
    int rc = ps_push_grads_ex(c, shard, head, head_len, data, data_len, push_id, global_step,
                              &outcome);
    if (rc == PS_OK && duplicate)
        *duplicate = outcome == PS_PUSH_DUPLICATE;
    return rc;
}

int ps_push_grads_ex(ps_client *c, int shard, const void *head, size_t head_len, const void *data,
                     size_t data_len, const char *push_id, int64_t *global_step, int *outcome)
{
    char idh[128];
    const char *extra[] = {"Content-Type: application/octet-stream", NULL, NULL};
    if (push_id) {
        if (strlen(push_id) > 64) {
            set_err(c, "push id longer than 64 characters");
            return PS_EINVAL;
        }
        snprintf(idh, sizeof(idh), "X-Push-Id: %s", push_id);
        extra[1] = idh;
    }
    source src = {.part = {head, data}, .len = {head_len, data_len}};
    json_t *j;
    int rc = get_json(c, shard, "POST", "/v1/grads", extra, &src,
                      push_id ? RETRY_ANY : RETRY_CONNECT_ONLY, &j);
    if (rc)
        return rc;
    rc = step_from(c, shard, j, "POST /v1/grads", global_step);
    if (outcome) {
        const char *o = json_string_value(json_object_get(j, "outcome"));
        *outcome = json_is_true(json_object_get(j, "duplicate")) ? PS_PUSH_DUPLICATE : PS_PUSH_APPLIED;
        if (o && strcmp(o, "stale") == 0)
            *outcome = PS_PUSH_STALE;
        else if (o && strcmp(o, "pending") == 0)
            *outcome = PS_PUSH_PENDING;
    }
    json_decref(j);
    return rc;
}

int ps_status(ps_client *c, int shard, json_t **out)
{
    return get_json(c, shard, "GET", "/v1/status", NULL, NULL, RETRY_ANY, out);
}

int ps_json(ps_client *c, int shard, const char *method, const char *path, json_t *body,
            int idempotent, json_t **out)
{
    char *text = NULL;
    if (body && !(text = json_dumps(body, JSON_COMPACT))) {
        set_err(c, "out of memory");
        return PS_ENOMEM;
    }
    source src = {.part = {(const unsigned char *)text, NULL}, .len = {text ? strlen(text) : 0, 0}};
    const char *extra[] = {"Content-Type: application/json", NULL};
    json_t *j = NULL;
    int rc = get_json(c, shard, method, path, body ? extra : NULL, body ? &src : NULL,
                      idempotent ? RETRY_ANY : RETRY_CONNECT_ONLY, &j);
    free(text);
    if (rc == PS_OK && out)
        *out = j;
    else
        json_decref(j);
    return rc;
}

/* An outcome word of POST /v1/grads as PS_PUSH_*. */
static int outcome_of(json_t *j)
{
    const char *o = json_string_value(json_object_get(j, "outcome"));
    int r = json_is_true(json_object_get(j, "duplicate")) ? PS_PUSH_DUPLICATE : PS_PUSH_APPLIED;
    if (o && strcmp(o, "stale") == 0)
        r = PS_PUSH_STALE;
    else if (o && strcmp(o, "pending") == 0)
        r = PS_PUSH_PENDING;
    return r;
}

int ps_pull_params_many(ps_client *c, ps_pull_req *r, int n)
{
    xfer *xs = calloc((size_t)(n ? n : 1), sizeof(xfer));
    sink *ss = calloc((size_t)(n ? n : 1), sizeof(sink));
    char (*paths)[192] = calloc((size_t)(n ? n : 1), sizeof(*paths));
    int rc = PS_OK;
    if (!xs || !ss || !paths) {
        set_err(c, "out of memory");
        rc = PS_ENOMEM;
        goto out;
    }
    long extra = 0;
    for (int i = 0; i < n; i++) {
        if (r[i].min_step >= 0) {
            if (r[i].timeout_ms < 0 || r[i].timeout_ms > 300000) {
                set_err(c, "timeout_ms must be in [0, 300000]");
                rc = PS_EINVAL;
                goto out;
            }
            int k = snprintf(paths[i], sizeof(paths[i]), "/v1/params?min_step=%lld&timeout_ms=%ld",
                             (long long)r[i].min_step, r[i].timeout_ms);
            if (r[i].worker >= 0)
                k += snprintf(paths[i] + k, sizeof(paths[i]) - (size_t)k, "&worker=%d", r[i].worker);
            if (r[i].worker >= 0 && r[i].min_clock > 0)
                k += snprintf(paths[i] + k, sizeof(paths[i]) - (size_t)k, "&min_clock=%lld",
                              (long long)r[i].min_clock);
            if (r[i].worker >= 0 && r[i].clock > 0)
                snprintf(paths[i] + k, sizeof(paths[i]) - (size_t)k, "&clock=%lld",
                         (long long)r[i].clock);
            if (r[i].timeout_ms > extra)
                extra = r[i].timeout_ms;
        } else {
            snprintf(paths[i], sizeof(paths[i]), "/v1/params");
        }
        ss[i] = (sink){.buf = r[i].buf, .cap = r[i].cap};
        xs[i] = (xfer){.shard = r[i].shard, .method = "GET", .path = paths[i], .s = &ss[i],
                       .mode = RETRY_ANY};
    }
    c->extra_timeout_ms = extra;
    if ((rc = do_requests(c, xs, n)) != PS_OK)
        goto out;
    for (int i = 0; i < n; i++) {
        if (!ss[i].has_step) {
            set_err(c, "%s: GET /v1/params: no X-Global-Step header", c->label[r[i].shard]);
            rc = PS_EPROTO;
            goto out;
        }
        r[i].len = ss[i].len;
        r[i].global_step = ss[i].global_step;
    }
out:
    c->extra_timeout_ms = 0;
    free(xs);
    free(ss);
    free(paths);
    return rc;
}

int ps_push_grads_many(ps_client *c, ps_push_req *r, int n)
{
    xfer *xs = calloc((size_t)(n ? n : 1), sizeof(xfer));
    sink *ss = calloc((size_t)(n ? n : 1), sizeof(sink));
    source *src = calloc((size_t)(n ? n : 1), sizeof(source));
    char (*idh)[128] = calloc((size_t)(n ? n : 1), sizeof(*idh));
    const char *(*extra)[3] = calloc((size_t)(n ? n : 1), sizeof(*extra));
    int rc = PS_OK;
    if (!xs || !ss || !src || !idh || !extra) {
        set_err(c, "out of memory");
        rc = PS_ENOMEM;
        goto out;
    }
    for (int i = 0; i < n; i++) {
        extra[i][0] = "Content-Type: application/octet-stream";
        if (r[i].push_id) {
            if (strlen(r[i].push_id) > 64) {
                set_err(c, "push id longer than 64 characters");
                rc = PS_EINVAL;
                goto out;
            }
            snprintf(idh[i], sizeof(idh[i]), "X-Push-Id: %s", r[i].push_id);
            extra[i][1] = idh[i];
        }
        src[i] = (source){.part = {r[i].head, r[i].data}, .len = {r[i].head_len, r[i].data_len}};
        ss[i] = (sink){.growable = 1};
        xs[i] = (xfer){.shard = r[i].shard, .method = "POST", .path = "/v1/grads", .extra = extra[i],
                       .src = &src[i], .s = &ss[i],
                       .mode = r[i].push_id ? RETRY_ANY : RETRY_CONNECT_ONLY};
    }
    if ((rc = do_requests(c, xs, n)) != PS_OK)
        goto out;
    for (int i = 0; i < n && rc == PS_OK; i++) {
        json_error_t je;
        json_t *j = json_loadb((const char *)ss[i].buf, ss[i].len, 0, &je);
        if (!j) {
            set_err(c, "%s: POST /v1/grads: answer is not JSON: %s", c->label[r[i].shard], je.text);
            rc = PS_EPROTO;
            break;
        }
        rc = step_from(c, r[i].shard, j, "POST /v1/grads", &r[i].global_step);
        r[i].outcome = outcome_of(j);
        json_decref(j);
    }
out:
    for (int i = 0; ss && i < n; i++)
        free(ss[i].buf);
    free(xs);
    free(ss);
    free(src);
    free(idh);
    free(extra);
    return rc;
}
