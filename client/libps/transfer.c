/* transfer.c - libps's transfer engine (see transfer.h): the ps_client's
 * handles and options, libcurl's callbacks, one try of a batch (one at a time
 * or over the multi interface), and the retry loop around it. */
#include "libps/transfer.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"

#define JSON_LIMIT ((size_t)256 << 20)

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

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
    if (s->landed)
        s->landed(s->landed_arg, s->shard, s->len, s->has_step ? s->global_step : -1);
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

size_t source_total(const source *src)
{
    size_t t = src->len[0] + (src->n_more > 0 ? 0 : src->len[1]);
    for (int k = 0; k < src->n_more; k++)
        t += src->more[k].len;
    return t;
}

static size_t on_read(char *p, size_t size, size_t nmemb, void *ud)
{
    source *src = ud;
    size_t room = size * nmemb, done = 0;
    const size_t n = src->n_more > 0 ? 1 + (size_t)src->n_more : 2;
    while (done < room && src->idx < n) {
        const unsigned char *at = src->idx == 0 || src->n_more == 0 ? src->part[src->idx]
                                                                   : src->more[src->idx - 1].data;
        size_t len = src->idx == 0 || src->n_more == 0 ? src->len[src->idx] : src->more[src->idx - 1].len;
        if (src->idx > 0 && src->gate && src->gated < (int)src->idx) {
            /* a piece not yet ready (streaming): what is here goes first */
            if (done > 0)
                break;
            if (src->gate(src->gate_arg, (int)src->idx - 1) != 0)
                return CURL_READFUNC_ABORT;
            src->gated = (int)src->idx;
        }
        size_t left = len - src->pos;
        if (left == 0) {
            src->idx++;
            src->pos = 0;
            continue;
        }
        size_t k = left < room - done ? left : room - done;
        memcpy(p + done, at + src->pos, k);
        src->pos += k;
        done += k;
    }
    return done;
}

#define STALL_FIRST_NS 5000000000ULL  /* the first report of a request that moves nothing */
#define STALL_EVERY_NS 10000000000ULL /* and the next ones */

static void stall_report(ps_client *c, const xfer *x, double secs, int again, const char *err)
{
    ps_stall s = {.label = c->label[x->shard], .method = x->method, .path = x->path, .err = err,
                  .secs = secs, .again = again, .long_poll = x->long_poll,
                  .budget = (double)c->opt.retry_ms / 1e3};
    c->stall_fn(c->stall_arg, &s);
}

/* A request that moved no byte for a while is reported (ps_set_stall_report),
 * and once more when it moves again. libcurl calls the progress function at
 * least once a second, also while nothing moves. */
static void stall_check(ps_client *c, xfer *x, curl_off_t dn, curl_off_t un)
{
    uint64_t now = clk_mono_ns();
    if ((long long)dn != x->last_dn || (long long)un != x->last_un) {
        if (x->stalled)
            stall_report(c, x, (double)(now - x->moved_ns) / 1e9, 1, NULL);
        x->last_dn = (long long)dn;
        x->last_un = (long long)un;
        x->moved_ns = now;
        x->report_ns = now + STALL_FIRST_NS;
        x->stalled = 0;
    } else if (now >= x->report_ns) {
        x->stalled = 1;
        x->report_ns = now + STALL_EVERY_NS;
        stall_report(c, x, (double)(now - x->moved_ns) / 1e9, 0, NULL);
    }
}

/* libcurl calls it after every read or write of a transfer: the work of
 * ps_set_while_waiting once the whole body is in the socket (un counts the
 * body bytes written), the stall report and the abort check. */
static int on_progress(void *ud, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    (void)dt;
    xfer *x = ud;
    ps_client *c = x->c;
    if (c->stall_fn)
        stall_check(c, x, dn, un);
    if (x->hook && c->while_fn && ut > 0 && un >= ut) {
        void (*fn)(void *) = c->while_fn;
        c->while_fn = NULL;
        fn(c->while_arg);
    }
    return c->abort_fn && c->abort_fn() ? 1 : 0;
}

void ps_set_abort(ps_client *c, int (*fn)(void)) { c->abort_fn = fn; }
double ps_last_wait_secs(const ps_client *c) { return c->last_wait; }

void ps_set_stall_report(ps_client *c, void (*fn)(void *arg, const ps_stall *s), void *arg)
{
    c->stall_fn = fn;
    c->stall_arg = arg;
}
void ps_set_while_waiting(ps_client *c, void (*fn)(void *), void *arg)
{
    c->while_fn = fn;
    c->while_arg = arg;
}

void ps_set_retry_ms(ps_client *c, long retry_ms) { c->opt.retry_ms = retry_ms > 0 ? retry_ms : 0; }
void ps_set_moving_average(ps_client *c, int on) { c->moving_average = on != 0; }

static void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}
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
    if (s->landed) /* a new try: what landed before does not count */
        s->landed(s->landed_arg, s->shard, s->len, -1);
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
    x->c = c;
    x->moved_ns = clk_mono_ns();
    x->report_ns = x->moved_ns + STALL_FIRST_NS;
    x->last_dn = x->last_un = 0;
    x->stalled = 0;
    x->long_poll = c->extra_timeout_ms > 0;
    if (c->abort_fn || c->stall_fn || (x->hook && c->while_fn)) {
        curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
        curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(h, CURLOPT_XFERINFODATA, x);
    }
    if (x->src) {
        x->src->idx = 0;
        x->src->pos = 0;
        x->src->gated = 0;
        curl_off_t total = (curl_off_t)source_total(x->src);
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
    curl_off_t pre = 0, first = 0; /* request sent, first byte of the answer (us) */
    curl_easy_getinfo(c->h[x->shard], CURLINFO_PRETRANSFER_TIME_T, &pre);
    curl_easy_getinfo(c->h[x->shard], CURLINFO_STARTTRANSFER_TIME_T, &first);
    if (first > pre && (double)(first - pre) / 1e6 > c->last_wait)
        c->last_wait = (double)(first - pre) / 1e6;
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

/* Whether the body of every x not done has gone to the socket: libcurl
 * counts the body bytes it wrote. */
static int bodies_sent(ps_client *c, xfer *xs, int n)
{
    for (int i = 0; i < n; i++) {
        if (xs[i].done)
            continue;
        curl_off_t up = 0;
        if (!xs[i].src || curl_easy_getinfo(c->h[xs[i].shard], CURLINFO_SIZE_UPLOAD_T, &up) != CURLE_OK ||
            up < (curl_off_t)source_total(xs[i].src))
            return 0;
    }
    return 1;
}

/* Every x not done at once over libcurl's multi interface, one connection
 * per shard; the work of ps_set_while_waiting once every body is sent. */
static void multi_try(ps_client *c, xfer *xs, int n)
{
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
        if (mc == CURLM_OK && c->while_fn && bodies_sent(c, xs, n)) {
            void (*fn)(void *) = c->while_fn;
            c->while_fn = NULL;
            fn(c->while_arg);
            continue; /* the answers may be here already */
        }
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

/* One try of every x not done yet: one at a time when it is one or when
 * every body is small, else all at once over libcurl's multi interface (one
 * connection per shard). The work of ps_set_while_waiting runs once the
 * body is sent: of the one transfer, of the last of several one after the
 * other, or of all at once. */
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
        xs[last].hook = xs[last].src != NULL;
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
            size_t b = xs[i].src ? source_total(xs[i].src) : xs[i].s->cap;
            if (b > biggest)
                biggest = b;
        }
    if (biggest < MULTI_MIN_BYTES) {
        for (int i = 0; i < n; i++)
            if (!xs[i].done) {
                xs[i].hook = i == last && xs[i].src; /* after the last body only */
                CURL *h = xfer_setup(c, &xs[i]);
                xfer_judge(c, &xs[i], curl_easy_perform(h));
            }
        return;
    }
    for (int i = 0; i < n; i++)
        xs[i].hook = 0; /* multi_try calls it once every body is sent */
    multi_try(c, xs, n);
}

int xfer_run(ps_client *c, xfer *xs, int n)
{
    int rc = PS_OK;
    for (int i = 0; i < n; i++) {
        xs[i].retried = 0;
        if (xfer_prepare(c, &xs[i]) != PS_OK)
            xs[i].done = 1;
    }
    long wait = c->opt.backoff_ms;
    uint64_t t0 = clk_mono_ns();
    c->last_wait = 0;
    for (int attempt = 0;; attempt++) {
        xfer_try(c, xs, n);
        int again = 0;
        for (int i = 0; i < n; i++)
            again |= xs[i].rc != PS_OK && xs[i].retry;
        if (!again || (c->abort_fn && c->abort_fn()))
            break;
        long spent = (long)((clk_mono_ns() - t0) / 1000000);
        if (attempt >= c->opt.retries && spent >= c->opt.retry_ms)
            break;
        if (c->stall_fn)
            for (int i = 0; i < n; i++)
                if (xs[i].rc != PS_OK && xs[i].retry) {
                    stall_report(c, &xs[i], (double)spent / 1e3, 0, xs[i].err);
                    xs[i].retried = 1;
                }
        /* jitter: uniform in [wait/2, wait] */
        long w = wait / 2 + (long)(rand_r(&c->seed) % (unsigned)(wait - wait / 2 + 1));
        sleep_ms(w);
        wait = wait * 2 > c->opt.backoff_max_ms ? c->opt.backoff_max_ms : wait * 2;
        for (int i = 0; i < n; i++)
            if (xs[i].rc != PS_OK && xs[i].retry)
                xs[i].done = 0;
    }
    if (c->stall_fn) /* the ps answers again after failed tries that were reported */
        for (int i = 0; i < n; i++)
            if (xs[i].retried && xs[i].rc == PS_OK)
                stall_report(c, &xs[i], (double)(clk_mono_ns() - t0) / 1e9, 1, NULL);
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
    for (int i = 0; i < n; i++)
        if (xs[i].src)
            c->while_fn = NULL; /* one-shot: used or not, it was for this request */
    return rc;
}

int xfer_one(ps_client *c, int shard, const char *method, const char *path,
             const char *const *extra, source *src, sink *s, enum retry_mode mode)
{
    xfer x = {.shard = shard, .method = method, .path = path, .extra = extra, .src = src, .s = s,
              .mode = mode};
    return xfer_run(c, &x, 1);
}

int xfer_json(ps_client *c, int shard, const char *method, const char *path,
              const char *const *extra, source *src, enum retry_mode mode, json_t **out)
{
    sink s = {.growable = 1};
    int rc = xfer_one(c, shard, method, path, extra, src, &s, mode);
    if (rc == PS_OK) {
        json_error_t je;
        *out = json_loadb((const char *)s.buf, s.len, 0, &je);
        if (!*out) {
            xfer_seterr(c, "%s: %s %s: answer is not JSON: %s", c->label[shard], method, path, je.text);
            rc = PS_EPROTO;
        }
    }
    free(s.buf);
    return rc;
}
