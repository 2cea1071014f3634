/* ring.c - ring all-reduce over HTTP (or HTTPS): the endpoint each worker
 * serves (libmicrohttpd, GnuTLS with a certificate), the pushes to the right
 * neighbour (libcurl: sender threads, each with its own keep-alive handle,
 * taking the pieces from a queue), and the reduce-scatter / all-gather
 * between them. See ring.h. */
#include "ring/ring.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "crc32c.h"
#include "endpoint.h"
#include "errmsg.h"
#include "http_server.h"
#include "pem.h"
#include "ring_schedule.h"
#include "tensor.h"
#include "tls_priorities.h"
#include "web_assets.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ring.c sends the host's floats as little-endian float32"
#endif

#define PEER_MAX (CLUSTER_HOST_MAX + 16)
#define RING_MISMATCH_LINGER_MS 3000
/* The endpoint's connections: a neighbour or two, the chief's page and
 * curl; a thread each (MHD_USE_THREAD_PER_CONNECTION). A head must arrive
 * within RING_HEADER_SECS, as psd's --connection_timeout default. */
#define RING_MAX_CONNS 256
#define RING_HEADER_SECS 60
#define RING_BODY_GRACE_SECS 10 /* then a piece's body must average 1 KiB/s (the shared layer's floor) */

#define RING_CHANS 2
/* Senders per channel, each on its own keep-alive connection to the right
 * neighbour, taking the channel's queued pieces in order: while one awaits
 * its piece's answer, the next piece is on the wire (with one connection the
 * link sat idle for a round trip after every piece, the answer queued behind
 * the neighbour's own data coming this way). */
#define RING_TX 2
#define RING_QUEUE 64 /* pieces queued on a channel before the all-reduce waits */
#define RING_CANCELLED (-3) /* a send cut because another failed (never returned) */

struct ring_chan;

typedef struct ring_tx {
    struct ring *r;
    struct ring_chan *ch;
    CURL *curl;
    char resp[512];
    size_t resp_len;
    char curl_err[CURL_ERROR_SIZE];
    pthread_t thread;
    int started;
} ring_tx;

/* One piece to send: step's ring step k, at `offset` floats into its chunk. */
typedef struct ring_job {
    int64_t step;
    int k;
    size_t offset, n;
    const float *data;
    double patience; /* retry what may pass for this long */
} ring_job;

typedef struct ring_chan {
    /* tx[RING_TX]: the all-reduce's own connection, for a piece that has
     * nothing to overlap with (enqueue) */
    ring_tx tx[RING_TX + 1];
    int work_init;
    /* under the ring's mu */
    pthread_cond_t work; /* a piece was queued, or the senders are to stop */
    ring_job q[RING_QUEUE];
    size_t head, len; /* the queue: q[head] and the len - 1 after it, cyclically */
    int busy;         /* pieces the senders took and are sending */
    int stop;
    /* the first failure: -1 with err, -2 (abort), RING_CANCELLED (the
     * all-reduce failed itself); then the queue is dropped and the sends in
     * flight are cut. Read without the lock by the senders' progress hook. */
    _Atomic int rc;
    char err[512];
} ring_chan;

struct ring {
    int n, rank;
    char name[64];
    char (*peer)[PEER_MAX]; /* "host:port" */
    char right_url[PEER_MAX + 16];
    size_t n_floats, piece;  /* piece: floats */
    size_t *off;             /* chunk c is [off[c], off[c+1]) */
    size_t chunk_max, pieces_max;
    /* the buckets (ring_options.edges): bucket b is [edge[b], edge[b+1]),
     * n_buckets of them (1: the whole buffer); edges_crc names the interior
     * edges on the wire (0: none). A chunk's pieces break at the buckets'
     * edges and every `piece` floats after each: chunk c's piece j starts at
     * pstart[pbase[c] + j] (from the chunk's start), j < npieces[c], and
     * pstart[pbase[c] + npieces[c]] is the chunk's length. */
    size_t *edge;
    int n_buckets;
    uint32_t edges_crc;
    size_t *pstart, *pbase, *npieces;
    int K;                   /* ring steps per all-reduce: 2(N-1) */
    double timeout;
    int (*abort)(void);
    char *token; /* NULL: the endpoint is open */
    int tls;     /* HTTPS, served and spoken */
    char *cert_pem, *key_pem, *ca_file; /* with tls; ca_file NULL: the system's CAs */
    char *priorities; /* with tls: the GnuTLS priority string served */
    long sslversion;  /* with tls: curl's range of the TLS versions it enables (the pushes offer) */
    char tls_desc[32]; /* with tls: "TLS 1.3", "TLS 1.2-1.3" */
    char self_url[PEER_MAX + 16];
    struct {
        char cert[48], key[48], ca[48], prio[48];
    } names; /* what messages call the TLS settings (ring_tls_names) */
    http_server *srv;        /* the endpoint (header deadlines, room kept for a new peer) */
    struct timespec started;

    /* receive slots: [parity][k] a buffer of chunk_max floats, and per piece
     * the training step whose data it holds (-1: none yet) */
    float *slots;
    int64_t *piece_step;
    pthread_mutex_t mu;
    pthread_cond_t cv;

    /* the senders the pushes go out through: channel 0 for every bucket but
     * the first, channel 1 for the first (ring_allreduce_bucket), so the
     * first layers' sum need not wait behind the last layers' */
    ring_chan ch[RING_CHANS];
    struct curl_slist *hdrs, *auth; /* auth: the token alone (the state fetch); NULL: none */
    _Atomic uint64_t bytes_sent;
    _Atomic int64_t allreduces;
    _Atomic int uploads; /* pieces being received or answered */
    _Atomic int mismatch; /* a peer speaks the other protocol: ring_free lingers */

    /* under mu */
    void *state;
    size_t state_len;
    ring_info info;
    char optimizer[32];
    int64_t global_step, ckpt_step;
    int64_t cur_step; /* the all-reduce in progress or last done; -1 before the first */
    int64_t first_step; /* before the first: its step; RING_STEP_UNKNOWN: not known yet */
    double loss;
    int has_loss;
    char ckpt_path[512];
};

static void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* The chunk rank receives at ring step k (ring_schedule.h). */
static int recv_chunk(const ring *r, int k) { return ring_recv_chunk(r->n, r->rank, k); }

static size_t chunk_len(const ring *r, int c) { return r->off[c + 1] - r->off[c]; }

static float *slot(ring *r, int64_t step, int k)
{
    return r->slots + ((size_t)(step & 1) * (size_t)r->K + (size_t)k) * r->chunk_max;
}

static int64_t *slot_steps(ring *r, int64_t step, int k)
{
    return r->piece_step + ((size_t)(step & 1) * (size_t)r->K + (size_t)k) * r->pieces_max;
}

/* The piece of chunk c that starts at chunk offset o: its index, or -1 when
 * no piece starts there. */
static long piece_at(const ring *r, int c, size_t o)
{
    const size_t *ps = r->pstart + r->pbase[c];
    size_t lo = 0, hi = r->npieces[c];
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (ps[mid] < o)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < r->npieces[c] && ps[lo] == o ? (long)lo : -1;
}

/* The floats of chunk c's piece j. */
static size_t piece_len(const ring *r, int c, size_t j)
{
    const size_t *ps = r->pstart + r->pbase[c];
    return ps[j + 1] - ps[j];
}

/* ---- the endpoint (common/http_server.h) ---- */

/* A chunk upload's state (the request's ext): where its piece goes. */
typedef struct chunk_req {
    int64_t step;
    int k;
    size_t piece;
    int counted; /* in r->uploads */
} chunk_req;

/* The chunk route's before_body: check the upload's arguments against what
 * this worker expects and point the body at its slot; a refusal is sent
 * after the (small) body is swallowed, so that the sender reads it, except
 * a 413, answered before the body is read. */
static enum MHD_Result chunk_begin(http_req *q)
{
    ring *r = q->ctx;
    chunk_req *cq = q->ext;
    cq->counted = 1;
    atomic_fetch_add(&r->uploads, 1);
    long long vals[7];
    const char *names[] = {"step", "k", "offset", "from", "n", "floats", "edges"};
    for (int i = 0; i < 7; i++) {
        int got = http_query_int(q, names[i], i == 6 ? UINT32_MAX : LLONG_MAX, &vals[i]);
        if (got == 0 && i == 6) /* no buckets */
            vals[i] = 0;
        else if (got != 1)
            return http_refuse_after_body(q, MHD_HTTP_BAD_REQUEST,
                                          i == 6 ? "query argument 'edges' is not a 32-bit unsigned integer"
                                                 : "query argument '%s' is missing or not a non-negative integer",
                                          names[i]);
    }
    long long step = vals[0], k = vals[1], offset = vals[2], from = vals[3], n = vals[4], floats = vals[5];
    if (n != r->n || (size_t)floats != r->n_floats)
        return http_refuse_after_body(q, MHD_HTTP_CONFLICT,
                                      "the sender's ring has %lld workers and %lld floats, this worker's %d and %zu: "
                                      "start every worker with the same --worker_hosts and model",
                                      n, floats, r->n, r->n_floats);
    if ((uint32_t)vals[6] != r->edges_crc)
        return http_refuse_after_body(q, MHD_HTTP_CONFLICT,
                                      "the sender splits the buffer into buckets at other edges (edges=%llu, this "
                                      "worker's %u; 0: no buckets): start every worker with the same --overlap, "
                                      "--overlap_min_bytes and model",
                                      vals[6], (unsigned)r->edges_crc);
    if (from != ring_mod(r->rank - 1, r->n))
        return http_refuse_after_body(q, MHD_HTTP_CONFLICT,
                                      "a piece from worker %lld, but this worker's left neighbour is worker %d", from,
                                      ring_mod(r->rank - 1, r->n));
    /* the left neighbour sends pieces of this worker's step or the next (it
     * is never further ahead: that step needs this worker's gradient), or
     * resends one of the step before; anything else comes from a worker
     * that is not in step with this ring, and must not land in its slots */
    pthread_mutex_lock(&r->mu);
    int64_t cur = r->cur_step, first = r->first_step;
    pthread_mutex_unlock(&r->mu);
    if (cur < 0 && first < 0) /* a worker still fetching the chief's state: the sender retries */
        return http_refuse_after_body(q, MHD_HTTP_SERVICE_UNAVAILABLE,
                                      "a piece of global step %lld, but this worker does not know its first global "
                                      "step yet (it is fetching the chief's state): try again",
                                      step);
    if (cur >= 0 && (step < cur - 1 || step > cur + 1))
        return http_refuse_after_body(q, MHD_HTTP_CONFLICT,
                                      "a piece of global step %lld, but this worker is at global step %lld: a worker "
                                      "restarted alone cannot rejoin a running ring; restart the whole job",
                                      step, (long long)cur);
    /* before the first all-reduce: that one's pieces, or (a left neighbour
     * that finished it first) the next one's */
    if (cur < 0 && step != first && step != first + 1)
        return http_refuse_after_body(q, MHD_HTTP_CONFLICT,
                                      "a piece of global step %lld, but this worker's first all-reduce is global "
                                      "step %lld: a worker restarted alone cannot rejoin a running ring; restart the "
                                      "whole job",
                                      step, (long long)first);
    if (k >= r->K)
        return http_refuse_after_body(q, MHD_HTTP_BAD_REQUEST, "k=%lld: a ring of %d workers has ring steps 0 to %d",
                                      k, r->n, r->K - 1);
    int c = recv_chunk(r, (int)k);
    size_t len = chunk_len(r, c);
    long j = (size_t)offset < len ? piece_at(r, c, (size_t)offset) : -1;
    if (j < 0) {
        if (r->n_buckets > 1)
            return http_refuse_after_body(q, MHD_HTTP_BAD_REQUEST,
                                          "offset=%lld: pieces of chunk %d start at its buckets' edges and every %zu "
                                          "floats after each, below %zu",
                                          offset, c, r->piece, len);
        return http_refuse_after_body(q, MHD_HTTP_BAD_REQUEST,
                                      "offset=%lld: pieces of chunk %d start at multiples of %zu below %zu", offset,
                                      c, r->piece, len);
    }
    size_t want = piece_len(r, c, (size_t)j);
    if (q->expect_len == UINT64_MAX)
        return http_refuse_after_body(q, MHD_HTTP_LENGTH_REQUIRED, "Content-Length is required");
    if (q->expect_len != want * 4) {
        const char *fmt = "the piece at offset %lld of ring step %lld has %zu floats (%zu bytes), the body %llu bytes";
        unsigned long long body = (unsigned long long)q->expect_len;
        if (body > want * 4)
            return http_reply_error(q, MHD_HTTP_CONTENT_TOO_LARGE, fmt, offset, k, want, want * 4, body);
        return http_refuse_after_body(q, MHD_HTTP_BAD_REQUEST, fmt, offset, k, want, want * 4, body);
    }
    cq->step = step;
    cq->k = (int)k;
    cq->piece = (size_t)j;
    http_body_into(q, slot(r, step, (int)k) + offset, want * 4);
    return MHD_YES;
}

/* The piece is in its slot: every float finite (as psd checks a push), mark
 * it and wake the all-reduce; else 400 and the slot stays unmarked (the
 * all-reduce waits on for a piece it can add). */
static enum MHD_Result h_chunk(http_req *q)
{
    ring *r = q->ctx;
    chunk_req *cq = q->ext;
    int c = recv_chunk(r, cq->k);
    size_t off = r->pstart[r->pbase[c] + cq->piece], m = piece_len(r, c, cq->piece);
    const float *got = slot(r, cq->step, cq->k) + off;
    int64_t bad = tensor_find_nonfinite(got, m);
    if (bad >= 0)
        return http_reply_error(q, MHD_HTTP_BAD_REQUEST,
                                "the piece at offset %zu of ring step %d (global step %lld) holds %s at float %lld: "
                                "pieces must be finite float32",
                                off, cq->k, (long long)cq->step, isnan(got[bad]) ? "a NaN" : "an Inf",
                                (long long)bad);
    pthread_mutex_lock(&r->mu);
    slot_steps(r, cq->step, cq->k)[cq->piece] = cq->step;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return http_reply_response(q, MHD_HTTP_NO_CONTENT,
                               MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT), 0);
}

static void chunk_done(http_req *q, int completed_ok)
{
    (void)completed_ok;
    chunk_req *cq = q->ext;
    if (cq && cq->counted)
        atomic_fetch_sub(&((ring *)q->ctx)->uploads, 1);
}

static json_t *status_json(ring *r)
{
    pthread_mutex_lock(&r->mu);
    double up = clk_mono_since(&r->started);
    json_t *o = json_pack("{s:{s:s,s:i},s:s,s:I,s:o,s:b,s:s,s:f,s:i,s:I,s:f}", "task", "type",
                          r->info.task_type ? r->info.task_type : "worker", "index", r->info.task_index,
                          "mode", "ring", "global_step", (json_int_t)r->global_step, "last_loss",
                          r->has_loss ? json_real(r->loss) : json_null(), "ready", r->info.optimizer != NULL,
                          "optimizer", r->optimizer, "learning_rate", r->info.learning_rate, "workers", r->n,
                          "train_steps", (json_int_t)r->info.train_steps, "uptime_secs", up);
    json_object_set_new(o, "ring",
                        json_pack("{s:i,s:i,s:s,s:o,s:s,s:s,s:I,s:I}", "size", r->n, "rank", r->rank, "url",
                                  r->self_url, "tls", r->tls ? json_string(r->tls_desc) : json_null(), "left",
                                  r->peer[ring_mod(r->rank - 1, r->n)], "right", r->peer[ring_mod(r->rank + 1, r->n)],
                                  "bytes_sent", (json_int_t)atomic_load(&r->bytes_sent), "allreduces",
                                  (json_int_t)atomic_load(&r->allreduces)));
    json_object_set_new(o, "checkpoint",
                        r->ckpt_path[0] ? json_pack("{s:I,s:s}", "global_step", (json_int_t)r->ckpt_step,
                                                    "path", r->ckpt_path)
                                        : json_null());
    pthread_mutex_unlock(&r->mu);
    return o;
}

static enum MHD_Result h_healthz(http_req *q)
{
    return http_reply_json(q, MHD_HTTP_OK, json_pack("{s:s}", "status", "ok"));
}

static enum MHD_Result h_status(http_req *q)
{
    return http_reply_json(q, MHD_HTTP_OK, status_json(q->ctx));
}

/* The whole model (the chief's): a read that needs the token, as a write does. */
static enum MHD_Result h_state(http_req *q)
{
    ring *r = q->ctx;
    pthread_mutex_lock(&r->mu);
    void *s = r->state;
    size_t len = r->state_len;
    pthread_mutex_unlock(&r->mu);
    if (!s)
        return http_reply_error(q, MHD_HTTP_SERVICE_UNAVAILABLE,
                                "%s has not published the parameters (yet): only the chief does", r->name);
    /* published once and kept until ring_free, which stops this server first */
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, s, MHD_RESPMEM_PERSISTENT);
    if (resp)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/octet-stream");
    return http_reply_response(q, MHD_HTTP_OK, resp, len);
}

/* The monitoring page (the chief's is the job's). */
static enum MHD_Result h_web(http_req *q)
{
    const struct web_asset *a = web_asset_find(q->url);
    if (!a)
        return http_reply_error(q, MHD_HTTP_NOT_FOUND, "no route GET '%.200s' on a ring worker", q->url);
    return web_asset_reply(q, a);
}

/* The endpoint's routes: the token guards the chunks and the state (the
 * whole model); status, health and the page stay open. */
static const http_route ring_routes[] = {
    {"GET", "/healthz", 0, 0, NULL, h_healthz, "liveness"},
    {"GET", "/v1/status", 0, 0, NULL, h_status, "the ring task's status"},
    {"GET", "/v1/ring/state", HTTP_ROUTE_AUTH, 0, NULL, h_state, "the chief's published parameters"},
    {"POST", "/v1/ring/chunk", HTTP_ROUTE_AUTH | HTTP_ROUTE_BODY, HTTP_BODY_UNLIMITED, chunk_begin, h_chunk,
     "one piece of a chunk from the left neighbour"},
    {"GET", "/", 0, 0, NULL, h_web, "the monitoring page"},
    {"GET", "/app.js", 0, 0, NULL, h_web, "the monitoring page's script"},
    {"GET", "/style.css", 0, 0, NULL, h_web, "the monitoring page's style sheet"},
};
#define N_RING_ROUTES (sizeof(ring_routes) / sizeof(ring_routes[0]))

/* An unknown path (GET for HEAD: the routes' names). */
static enum MHD_Result ring_not_found(http_req *q)
{
    const char *m = strcmp(q->method, "HEAD") == 0 ? "GET" : q->method;
    return http_reply_error(q, MHD_HTTP_NOT_FOUND, "no route %s '%.200s' on a ring worker", m, q->url);
}

/* Another method on a known path: the chunk route says what it takes, the
 * state route is a 405, the open routes answer as an unknown path does. */
static enum MHD_Result ring_wrong_method(http_req *q, const char *pattern, const char *allow)
{
    (void)allow;
    const char *m = strcmp(q->method, "HEAD") == 0 ? "GET" : q->method;
    if (strcmp(pattern, "/v1/ring/chunk") == 0)
        return http_reply_error(q, MHD_HTTP_METHOD_NOT_ALLOWED, "%s takes %s", pattern, "POST");
    return http_reply_error(q, strcmp(pattern, "/v1/ring/state") == 0 ? MHD_HTTP_METHOD_NOT_ALLOWED : MHD_HTTP_NOT_FOUND,
                            "no route %s '%.200s' on a ring worker", m, q->url);
}

/* ---- the client side ---- */

static size_t on_body(char *p, size_t size, size_t n, void *ctx)
{
    ring_tx *r = ctx;
    size_t len = size * n, room = sizeof(r->resp) - 1 - r->resp_len;
    size_t k = len < room ? len : room;
    memcpy(r->resp + r->resp_len, p, k);
    r->resp_len += k;
    r->resp[r->resp_len] = '\0';
    return len;
}

/* The "error" of a JSON error body, or the body itself. */
static const char *resp_error(const ring_tx *r)
{
    static __thread char out[sizeof(((ring_tx *)0)->resp)];
    json_t *j = json_loads(r->resp, 0, NULL);
    const char *e = j ? json_string_value(json_object_get(j, "error")) : NULL;
    snprintf(out, sizeof(out), "%s", e ? e : r->resp);
    json_decref(j);
    return out;
}

/* What a peer's 401 means, after "worker N (host:port)". */
static const char *token_refused(const ring *r)
{
    return r->token ? "refused this task's bearer token (HTTP 401): start every task with the same "
                      "--auth_token_file"
                    : "wants a bearer token (HTTP 401) and this task has none: start every task with "
                      "the same --auth_token_file";
}

static size_t on_discard(char *p, size_t size, size_t n, void *ctx)
{
    (void)p;
    (void)ctx;
    return size * n;
}

/* HTTPS on a handle to a peer: offer the TLS versions this task serves,
 * and verify its certificate (and host name, curl's default) against the
 * ring's CA file, or the system's. */
static void set_tls(const ring *r, CURL *h)
{
    if (!r->tls)
        return;
    curl_easy_setopt(h, CURLOPT_SSLVERSION, r->sslversion);
    if (r->ca_file)
        curl_easy_setopt(h, CURLOPT_CAINFO, r->ca_file);
}

/* GET /healthz on peer i over `scheme` (HTTPS: unverified, with curl's TLS
 * versions sslversion): CURLE_OK when it answers 200, CURLE_HTTP_RETURNED_ERROR
 * when it answers something else, else the failure's code. One request, 3 s
 * at most. */
static CURLcode probe(const ring *r, int i, const char *scheme, long sslversion)
{
    CURL *h = curl_easy_init();
    if (!h)
        return CURLE_OUT_OF_MEMORY;
    char url[PEER_MAX + 32];
    snprintf(url, sizeof(url), "%s://%s/healthz", scheme, r->peer[i]);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_SSLVERSION, sslversion);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 3000L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_discard);
    /* only asks which protocol it speaks: nothing is sent but the path */
    curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 0L);
    curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 0L);
    long status = 0;
    CURLcode cc = curl_easy_perform(h);
    if (cc == CURLE_OK)
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(h);
    return cc != CURLE_OK ? cc : status == 200 ? CURLE_OK : CURLE_HTTP_RETURNED_ERROR;
}

/* 1 when peer i speaks the other protocol than this task (HTTP when this
 * task speaks HTTPS, HTTPS when it speaks HTTP): it was started with other
 * TLS flags. (An answer is proof; no answer proves nothing.) */
static int speaks_other(const ring *r, int i)
{
    return probe(r, i, r->tls ? "http" : "https", CURL_SSLVERSION_DEFAULT) == CURLE_OK;
}

/* 1 when peer i, on HTTPS as this task, refuses a TLS handshake offering
 * only this task's versions (CURLE_SSL_CONNECT_ERROR: GnuTLS behind
 * libmicrohttpd hangs up, no alert, and OpenSSL says SSL_ERROR_SYSCALL) and
 * right after answers one offering curl's: its priority string shares no TLS
 * version with this task's, or none of the cipher suites libcurl offers for
 * them. The restricted probe goes first, so a peer that stops meanwhile fails
 * the second; the pair runs twice, so one hang-up (an overloaded peer) is not
 * taken for a refusal; any other outcome (a timeout, a refused connection, a
 * 503) proves nothing and is left to the retries. */
static int refuses_these_versions(const ring *r, int i)
{
    if (!r->tls)
        return 0;
    for (int k = 0; k < 2; k++) {
        if (k)
            sleep_ms(50);
        if (probe(r, i, "https", r->sslversion) != CURLE_SSL_CONNECT_ERROR ||
            probe(r, i, "https", CURL_SSLVERSION_DEFAULT) != CURLE_OK)
            return 0;
    }
    return 1;
}

/* After a request to peer i (`who`: "worker 1 (h:p), the right neighbour")
 * failed with cc: -1 with err when no retry can help (its certificate does
 * not verify, the CA file is unusable, it speaks the other protocol, or it
 * refuses the TLS versions this task offers: refuses_these_versions), else 0.
 * curl_err: the handle's error buffer. */
static int tls_refused(ring *r, int i, CURLcode cc, const char *curl_err, const char *who, char *err,
                       size_t errlen)
{
    const char *why = curl_err && *curl_err ? curl_err : curl_easy_strerror(cc);
    switch (cc) {
    case CURLE_PEER_FAILED_VERIFICATION:
        errmsg(err, errlen,
               "%s: its certificate does not verify (%s): every task's %s must be signed by a CA "
               "in %s%s%s and name its host in the cluster",
               who, why, r->names.cert, r->ca_file ? "" : "the system's store (no ", r->names.ca,
               r->ca_file ? "" : ")");
        return -1;
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CERTPROBLEM:
        errmsg(err, errlen, "cannot talk HTTPS to %s: %s (%s)", who, why, r->names.ca);
        return -1;
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_OPERATION_TIMEDOUT: /* a TLS hello to an HTTP server waits for a line end */
        if (speaks_other(r, i)) {
            atomic_store(&r->mismatch, 1);
            if (r->tls)
                errmsg(err, errlen,
                       "%s, serves the ring over plain HTTP and this task over HTTPS (%s): "
                       "give every task %s and %s, or none",
                       who, r->names.cert, r->names.cert, r->names.key);
            else
                errmsg(err, errlen,
                       "%s, serves the ring over HTTPS (%s) and this task over plain HTTP: "
                       "give every task %s and %s, or none",
                       who, r->names.cert, r->names.cert, r->names.key);
            return -1;
        }
        /* a refused handshake fails with this code alone */
        if (cc == CURLE_SSL_CONNECT_ERROR && refuses_these_versions(r, i)) {
            atomic_store(&r->mismatch, 1);
            errmsg(err, errlen,
                   "%s, could not agree on TLS with this task's %s (%s): it takes other TLS versions, "
                   "not these (or not with the cipher suites libcurl offers): give every task %s that "
                   "share a TLS version",
                   who, r->names.prio, r->tls_desc, r->names.prio);
            return -1;
        }
        return 0;
    default:
        return 0;
    }
}

/* A sender's transfer goes on while its channel has not failed. */
static int tx_progress(void *ctx, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal, curl_off_t ulnow)
{
    (void)dltotal;
    (void)dlnow;
    (void)ultotal;
    (void)ulnow;
    const ring_tx *t = ctx;
    return atomic_load(&t->ch->rc) != 0;
}

/* POST one piece to the right neighbour on sender t's connection, retrying
 * what may pass (it is not up yet, a 5xx) until `deadline`. 0, -1 with err,
 * -2 (abort), RING_CANCELLED (its channel failed meanwhile). */
static int send_piece(ring *r, ring_tx *t, int64_t step, int k, size_t offset, const float *data, size_t n,
                      double deadline, char *err, size_t errlen)
{
    char url[PEER_MAX + 200];
    int at = snprintf(url, sizeof(url), "%s/v1/ring/chunk?step=%lld&k=%d&offset=%zu&from=%d&n=%d&floats=%zu",
                      r->right_url, (long long)step, k, offset, r->rank, r->n, r->n_floats);
    if (r->edges_crc && at > 0 && (size_t)at < sizeof(url))
        snprintf(url + at, sizeof(url) - (size_t)at, "&edges=%u", (unsigned)r->edges_crc);
    int right = ring_mod(r->rank + 1, r->n);
    long wait = 20;
    for (;;) {
        t->resp_len = 0;
        t->resp[0] = '\0';
        t->curl_err[0] = '\0';
        curl_easy_setopt(t->curl, CURLOPT_URL, url);
        curl_easy_setopt(t->curl, CURLOPT_POSTFIELDS, (const char *)data);
        curl_easy_setopt(t->curl, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)(n * 4));
        CURLcode cc = curl_easy_perform(t->curl);
        if (atomic_load(&t->ch->rc) != 0)
            return RING_CANCELLED;
        long status = 0;
        if (cc == CURLE_OK)
            curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
        if (cc == CURLE_OK && status >= 200 && status < 300) {
            atomic_fetch_add(&r->bytes_sent, (uint64_t)n * 4);
            return 0;
        }
        if (cc == CURLE_OK && status == 401) {
            errmsg(err, errlen, "worker %d (%s), the right neighbour, %s", right, r->peer[right],
                   token_refused(r));
            return -1;
        }
        if (cc == CURLE_OK && status >= 400 && status < 500) {
            errmsg(err, errlen, "worker %d (%s) refused a piece: HTTP %ld: %s", right, r->peer[right],
                   status, resp_error(t));
            return -1;
        }
        if (cc != CURLE_OK) {
            char who[PEER_MAX + 64];
            snprintf(who, sizeof(who), "worker %d (%s), the right neighbour", right, r->peer[right]);
            if (tls_refused(r, right, cc, t->curl_err, who, err, errlen))
                return -1;
        }
        if (r->abort && r->abort())
            return -2;
        if (clk_mono_secs() + (double)wait / 1000 > deadline) {
            if (cc != CURLE_OK)
                errmsg(err, errlen, "cannot reach worker %d (%s), the right neighbour: %s: it died or was stopped",
                       right, r->peer[right], t->curl_err[0] ? t->curl_err : curl_easy_strerror(cc));
            else
                errmsg(err, errlen, "worker %d (%s), the right neighbour, answers HTTP %ld: %s", right,
                       r->peer[right], status, resp_error(t));
            return -1;
        }
        sleep_ms(wait);
        wait = wait * 2 > 500 ? 500 : wait * 2;
    }
}

/* ---- the senders ---- */

static void *tx_main(void *arg)
{
    ring_tx *t = arg;
    ring *r = t->r;
    ring_chan *ch = t->ch;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!ch->stop && (ch->len == 0 || atomic_load(&ch->rc) != 0))
            pthread_cond_wait(&ch->work, &r->mu);
        if (ch->stop)
            break;
        ring_job j = ch->q[ch->head];
        ch->head = (ch->head + 1) % RING_QUEUE;
        if (ch->len-- == RING_QUEUE)
            pthread_cond_broadcast(&r->cv); /* room for an enqueue that waits */
        ch->busy++;
        pthread_mutex_unlock(&r->mu);
        char err[sizeof(ch->err)] = ""; /* (-2, abort, says nothing) */
        int rc = send_piece(r, t, j.step, j.k, j.offset, j.data, j.n, clk_mono_secs() + j.patience, err,
                            sizeof(err));
        pthread_mutex_lock(&r->mu);
        ch->busy--;
        if (rc && rc != RING_CANCELLED && atomic_load(&ch->rc) == 0) {
            snprintf(ch->err, sizeof(ch->err), "%s", err);
            atomic_store(&ch->rc, rc);
            ch->len = 0;
        }
        pthread_cond_broadcast(&r->cv); /* the all-reduce waits on it: for room, the drain, a piece */
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* Queue a piece on ch (waiting for room while the queue is full). 0, or
 * the channel's failure with err. The last piece of a ring step, when
 * nothing is queued or in flight (a small buffer's one piece), goes out from
 * here at once: a hand-off to a sender would cost two thread wake-ups and
 * overlap nothing. */
static int enqueue(ring *r, ring_chan *ch, int64_t step, int k, size_t offset, const float *data, size_t n,
                   double patience, int last, char *err, size_t errlen)
{
    pthread_mutex_lock(&r->mu);
    if (last && ch->len == 0 && ch->busy == 0 && atomic_load(&ch->rc) == 0) {
        pthread_mutex_unlock(&r->mu);
        return send_piece(r, &ch->tx[RING_TX], step, k, offset, data, n, clk_mono_secs() + patience, err, errlen);
    }
    while (atomic_load(&ch->rc) == 0 && ch->len == RING_QUEUE)
        pthread_cond_wait(&r->cv, &r->mu);
    int rc = atomic_load(&ch->rc);
    if (rc == 0) {
        ch->q[(ch->head + ch->len) % RING_QUEUE] =
            (ring_job){.step = step, .k = k, .offset = offset, .n = n, .data = data, .patience = patience};
        ch->len++;
        pthread_cond_signal(&ch->work);
    } else {
        errmsg(err, errlen, "%s", ch->err);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* The end of an all-reduce's sends on ch: every queued piece sent (its
 * floats may change then), or, when it failed (rc != 0) or a send did, the
 * queue dropped and the sends in flight cut. Returns rc when non-zero (err
 * as the caller set it), else the channel's failure (err) or 0; the channel
 * is ready for the next all-reduce. */
static int drain(ring *r, ring_chan *ch, int rc, char *err, size_t errlen)
{
    pthread_mutex_lock(&r->mu);
    if (rc && atomic_load(&ch->rc) == 0)
        atomic_store(&ch->rc, RING_CANCELLED);
    if (atomic_load(&ch->rc) != 0)
        ch->len = 0;
    while (ch->len || ch->busy)
        pthread_cond_wait(&r->cv, &r->mu);
    if (!rc && (rc = atomic_load(&ch->rc)) != 0)
        errmsg(err, errlen, "%s", ch->err);
    atomic_store(&ch->rc, 0);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* Wait until piece p of ring step k holds step's data (or a send on ch
 * failed: its error). The left neighbour's patience counts from the end of
 * this worker's own sends (as when each send blocked): past the deadline
 * with pieces still queued or in flight, the wait goes on for theirs (a
 * sender ends by its own deadline), so a right neighbour that cannot be
 * reached is named as such, not the left one that waits for this worker. */
static int wait_piece(ring *r, ring_chan *ch, int64_t step, int k, size_t p, double deadline, double patience,
                      char *err, size_t errlen)
{
    int64_t *st = slot_steps(r, step, k);
    int rc = 0, held = 0; /* held: the deadline passed while this worker's sends went on */
    pthread_mutex_lock(&r->mu);
    while (st[p] != step) {
        double t = clk_mono_secs();
        if ((rc = atomic_load(&ch->rc)) != 0) {
            errmsg(err, errlen, "%s", ch->err);
            break;
        }
        if (r->abort && r->abort()) {
            rc = -2;
            break;
        }
        if (ch->len || ch->busy) {
            held |= t >= deadline;
        } else if (held) { /* they ended (a sender's broadcast woke this wait) */
            held = 0;
            deadline = t + patience;
        }
        if (t >= deadline && !held) {
            int left = ring_mod(r->rank - 1, r->n);
            errmsg(err, errlen,
                   "nothing from worker %d (%s), the left neighbour, for %.0f s (step %lld, ring step %d): "
                   "it died or is stuck",
                   left, r->peer[left], patience, (long long)step, k);
            rc = -1;
            break;
        }
        /* wake at least every 200 ms to see abort() */
        double until = deadline < t + 0.2 && !held ? deadline : t + 0.2;
        double add = until - t; /* at most 0.2 s: whole milliseconds, rounded up */
        struct timespec ts = clk_mono_after_ms(add > 0 ? (int64_t)(add * 1000.0 + 0.999) : 0);
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* The pieces of chunk c that lie in bucket b: [*j0, return). */
static size_t bucket_pieces(const ring *r, int c, int b, size_t *j0)
{
    size_t a = r->edge[b], e = r->edge[b + 1], base = r->off[c];
    const size_t *ps = r->pstart + r->pbase[c];
    size_t j = 0, np = r->npieces[c];
    while (j < np && base + ps[j] < a)
        j++;
    *j0 = j;
    while (j < np && base + ps[j] < e)
        j++;
    return j;
}

int ring_allreduce_bucket(ring *r, int64_t step, float *buf, int b, double wait_secs, char *err, size_t errlen)
{
    if (r->n == 1) {
        if (b == 0)
            atomic_fetch_add(&r->allreduces, 1);
        return 0;
    }
    pthread_mutex_lock(&r->mu);
    r->cur_step = step;
    pthread_mutex_unlock(&r->mu);
    ring_chan *ch = &r->ch[b == 0 && r->n_buckets > 1];
    double patience = wait_secs > r->timeout ? wait_secs : r->timeout;
    double deadline = clk_mono_secs() + patience;
    int rc = 0;
    /* ring step 0: this worker's own chunk. A piece goes out while the next
     * is summed: its floats stay as they are until drain() (this worker
     * writes a chunk's floats again only once their sum came round the
     * ring, which it was part of) */
    int c = r->rank;
    size_t j0, j1 = bucket_pieces(r, c, b, &j0);
    for (size_t j = j0; j < j1 && !rc; j++) {
        size_t o = r->pstart[r->pbase[c] + j];
        rc = enqueue(r, ch, step, 0, o, buf + r->off[c] + o, piece_len(r, c, j), patience, j + 1 == j1, err,
                     errlen);
    }
    deadline = clk_mono_secs() + patience; /* (enqueue may have waited for room) */
    for (int k = 0; k < r->K && !rc; k++) {
        c = recv_chunk(r, k);
        const float *in = slot(r, step, k);
        float *own = buf + r->off[c];
        j1 = bucket_pieces(r, c, b, &j0);
        for (size_t j = j0; j < j1; j++) {
            size_t o = r->pstart[r->pbase[c] + j], m = piece_len(r, c, j);
            if ((rc = wait_piece(r, ch, step, k, j, deadline, patience, err, errlen)) != 0)
                break;
            if (k < r->n - 1)
                for (size_t i = 0; i < m; i++) /* the left partial sum + this worker's */
                    own[o + i] = in[o + i] + own[o + i];
            else
                memcpy(own + o, in + o, m * 4);
            if (k + 1 < r->K &&
                (rc = enqueue(r, ch, step, k + 1, o, own + o, m, patience, j + 1 == j1, err, errlen)) != 0)
                break;
            deadline = clk_mono_secs() + patience;
        }
    }
    if ((rc = drain(r, ch, rc, err, errlen)) != 0)
        return rc;
    if (b == 0)
        atomic_fetch_add(&r->allreduces, 1);
    return 0;
}

int ring_allreduce(ring *r, int64_t step, float *buf, double wait_secs, char *err, size_t errlen)
{
    for (int b = r->n_buckets - 1; b >= 0; b--) {
        int rc = ring_allreduce_bucket(r, step, buf, b, wait_secs, err, errlen);
        if (rc)
            return rc;
    }
    return 0;
}

int ring_buckets(const ring *r) { return r->n_buckets; }

void ring_bucket_range(const ring *r, int b, size_t *start, size_t *end)
{
    *start = r->edge[b];
    *end = r->edge[b + 1];
}

/* ---- state, status ---- */

void ring_publish(ring *r, void *body, size_t len)
{
    pthread_mutex_lock(&r->mu);
    void *old = r->state;
    r->state = body;
    r->state_len = len;
    pthread_mutex_unlock(&r->mu);
    /* a response may still point into the old body: keep it out of reach
     * only when nothing was published before (the one use: once at start) */
    free(old);
}

typedef struct grow {
    char *p;
    size_t len, cap;
} grow;

static size_t on_grow(char *p, size_t size, size_t n, void *ctx)
{
    grow *g = ctx;
    size_t len = size * n;
    if (g->len + len > g->cap) {
        size_t cap = g->cap ? g->cap : 1 << 16;
        while (cap < g->len + len)
            cap *= 2;
        char *q = realloc(g->p, cap);
        if (!q)
            return 0;
        g->p = q;
        g->cap = cap;
    }
    memcpy(g->p + g->len, p, len);
    g->len += len;
    return len;
}

int ring_fetch_state(ring *r, int from, double wait_secs, void **body, size_t *len, char *err,
                     size_t errlen)
{
    CURL *h = curl_easy_init();
    if (!h) {
        errmsg(err, errlen, "out of memory");
        return -1;
    }
    char url[PEER_MAX + 40], curl_err[CURL_ERROR_SIZE];
    snprintf(url, sizeof(url), "%s://%s/v1/ring/state", r->tls ? "https" : "http", r->peer[from]);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(wait_secs * 1000) + 60000);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_grow);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, r->auth);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, curl_err);
    set_tls(r, h);
    double deadline = clk_mono_secs() + wait_secs, said = clk_mono_secs();
    int rc = -1;
    for (;;) {
        grow g = {0};
        curl_err[0] = '\0';
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &g);
        CURLcode cc = curl_easy_perform(h);
        long status = 0;
        if (cc == CURLE_OK)
            curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
        if (cc == CURLE_OK && status == 200) {
            *body = g.p;
            *len = g.len;
            rc = 0;
            break;
        }
        free(g.p);
        if (cc == CURLE_OK && status == 401) {
            errmsg(err, errlen, "the chief, worker %d (%s), %s", from, r->peer[from], token_refused(r));
            break;
        }
        if (cc != CURLE_OK) {
            char who[PEER_MAX + 64];
            snprintf(who, sizeof(who), "the chief, worker %d (%s)", from, r->peer[from]);
            if (tls_refused(r, from, cc, curl_err, who, err, errlen))
                break;
        }
        if (r->abort && r->abort()) {
            rc = -2;
            break;
        }
        if (clk_mono_secs() > deadline) {
            if (cc != CURLE_OK)
                errmsg(err, errlen, "cannot reach the chief, worker %d (%s), for %.0f s: %s", from,
                       r->peer[from], wait_secs, curl_err[0] ? curl_err : curl_easy_strerror(cc));
            else
                errmsg(err, errlen, "the chief, worker %d (%s), answers HTTP %ld to %s", from, r->peer[from],
                       status, url);
            break;
        }
        if (clk_mono_secs() - said > 5) {
            printf("%s: waiting for the chief (%s) to publish the parameters\n", r->name, r->peer[from]);
            fflush(stdout);
            said = clk_mono_secs();
        }
        sleep_ms(200);
    }
    curl_easy_cleanup(h);
    return rc;
}

void ring_expect_first_step(ring *r, int64_t step)
{
    pthread_mutex_lock(&r->mu);
    r->first_step = step < 0 ? RING_STEP_UNKNOWN : step;
    pthread_mutex_unlock(&r->mu);
}

void ring_set_info(ring *r, const ring_info *info)
{
    pthread_mutex_lock(&r->mu);
    r->info = *info;
    snprintf(r->optimizer, sizeof(r->optimizer), "%s", info->optimizer ? info->optimizer : "");
    r->info.optimizer = info->optimizer ? r->optimizer : NULL;
    pthread_mutex_unlock(&r->mu);
}

void ring_set_progress(ring *r, int64_t global_step, double loss)
{
    pthread_mutex_lock(&r->mu);
    r->global_step = global_step;
    r->loss = loss;
    r->has_loss = isfinite(loss); /* json_real refuses inf: /v1/status would fail */
    pthread_mutex_unlock(&r->mu);
}

void ring_set_checkpoint(ring *r, int64_t step, const char *path)
{
    pthread_mutex_lock(&r->mu);
    r->ckpt_step = step;
    snprintf(r->ckpt_path, sizeof(r->ckpt_path), "%s", path);
    pthread_mutex_unlock(&r->mu);
}

uint64_t ring_bytes_sent(const ring *r) { return atomic_load(&r->bytes_sent); }
int64_t ring_allreduces(const ring *r) { return atomic_load(&r->allreduces); }
const char *ring_peer(const ring *r, int i) { return r->peer[i]; }
const char *ring_url(const ring *r) { return r->self_url; }
const char *ring_tls(const ring *r) { return r->tls ? r->tls_desc : NULL; }

/* ---- life ---- */

int ring_tls_priorities_check(const char *prio, char *err, size_t errlen)
{
    int lo, hi;
    if (tls_priorities_check(prio, err, errlen) != 0)
        return -1;
    if (tls_priorities_versions(prio, &lo, &hi) != 0) {
        snprintf(err, errlen, "it enables no TLS version");
        return -1;
    }
    if (hi < 2) {
        const curl_version_info_data *v = curl_version_info(CURLVERSION_NOW);
        snprintf(err, errlen,
                 "it enables TLS 1.%d at most, and this task's requests to the others (libcurl on %s, at its "
                 "default security level) take TLS 1.2 or later: enable +VERS-TLS1.2 or +VERS-TLS1.3",
                 hi, v && v->ssl_version ? v->ssl_version : "its TLS library");
        return -1;
    }
    return 0;
}

/* pem_read with the setting named: "--ring_tls_cert=PATH: why". */
static char *read_pem(const char *flag, const char *path, char *err, size_t errlen)
{
    char why[512];
    char *pem = pem_read(path, why, sizeof(why));
    if (!pem)
        errmsg(err, errlen, "%s=%s", flag, why);
    return pem;
}

/* What a step of ring_new returns: 0, or a failure whose message is in err
 * (NEW_FAILED) or is the out of memory one (NEW_OOM, written by ring_new). */
enum { NEW_FAILED = -1, NEW_OOM = -2 };

/* r's lock, clocks and settings from o (the token copied). 0 or NEW_OOM. */
static int new_basics(ring *r, const ring_options *o)
{
    pthread_mutex_init(&r->mu, NULL);
    clk_mono_cond_init(&r->cv);
    r->started = clk_mono_ts();
    r->n = o->n;
    r->rank = o->rank;
    r->cur_step = -1;
    r->first_step = o->first_step < 0 ? RING_STEP_UNKNOWN : o->first_step;
    r->K = 2 * (o->n - 1);
    r->n_floats = o->n_floats;
    r->piece = o->piece_bytes / 4 ? o->piece_bytes / 4 : 1;
    r->timeout = o->timeout_secs;
    r->abort = o->abort;
    if (o->token && !(r->token = strdup(o->token)))
        return NEW_OOM;
    return 0;
}

/* The TLS settings checked and read: the names messages use, the priority
 * string and the versions the pushes offer, the certificate and key, the CA
 * file. 0, NEW_FAILED (err) or NEW_OOM. */
static int new_tls(ring *r, const ring_options *o, char *err, size_t errlen)
{
    const ring_tls_names *nm = &o->tls_names;
    snprintf(r->names.cert, sizeof(r->names.cert), "%s", nm->cert ? nm->cert : "tls_cert");
    snprintf(r->names.key, sizeof(r->names.key), "%s", nm->key ? nm->key : "tls_key");
    snprintf(r->names.ca, sizeof(r->names.ca), "%s", nm->ca ? nm->ca : "tls_ca");
    snprintf(r->names.prio, sizeof(r->names.prio), "%s", nm->priorities ? nm->priorities : "tls_priorities");
    if (!o->tls_cert != !o->tls_key) {
        errmsg(err, errlen, "a certificate and its key go together (%s, %s)", r->names.cert, r->names.key);
        return NEW_FAILED;
    }
    if (o->tls_priorities && !o->tls_cert) {
        errmsg(err, errlen, "%s needs %s and %s", r->names.prio, r->names.cert, r->names.key);
        return NEW_FAILED;
    }
    if (o->tls_cert) {
        r->tls = 1;
        const char *prio = o->tls_priorities ? o->tls_priorities : TLS_PRIORITIES_DEFAULT;
        char why[400];
        int lo, hi;
        if (ring_tls_priorities_check(prio, why, sizeof(why)) != 0 || tls_priorities_versions(prio, &lo, &hi) != 0) {
            errmsg(err, errlen, "%s=%s: %s", r->names.prio, prio, why);
            return NEW_FAILED;
        }
        /* the pushes offer the versions the endpoint serves (libcurl is
         * built on OpenSSL here: the cipher suites apply to the endpoint) */
        static const long vmin[] = {CURL_SSLVERSION_TLSv1_0, CURL_SSLVERSION_TLSv1_1, CURL_SSLVERSION_TLSv1_2,
                                    CURL_SSLVERSION_TLSv1_3};
        static const long vmax[] = {CURL_SSLVERSION_MAX_TLSv1_0, CURL_SSLVERSION_MAX_TLSv1_1,
                                    CURL_SSLVERSION_MAX_TLSv1_2, CURL_SSLVERSION_MAX_TLSv1_3};
        r->sslversion = vmin[lo] | vmax[hi];
        if (lo == hi)
            snprintf(r->tls_desc, sizeof(r->tls_desc), "TLS 1.%d", lo);
        else
            snprintf(r->tls_desc, sizeof(r->tls_desc), "TLS 1.%d-1.%d", lo, hi);
        if (!(r->priorities = strdup(prio)))
            return NEW_OOM;
        if (!(r->cert_pem = read_pem(r->names.cert, o->tls_cert, err, errlen)) ||
            !(r->key_pem = read_pem(r->names.key, o->tls_key, err, errlen)))
            return NEW_FAILED;
        if (o->tls_ca && !(r->ca_file = strdup(o->tls_ca)))
            return NEW_OOM;
    }
    return 0;
}

/* The peers' "host:port", the right neighbour's and this worker's URLs, and
 * the chunk table (offsets, the largest chunk, pieces per chunk). 0 or
 * NEW_OOM. */
static int new_peers(ring *r, const ring_options *o)
{
    snprintf(r->name, sizeof(r->name), "%s", o->name ? o->name : "ring");
    r->peer = calloc((size_t)o->n, sizeof(*r->peer));
    r->off = calloc((size_t)o->n + 1, sizeof(size_t));
    if (!r->peer || !r->off)
        return NEW_OOM;
    for (int i = 0; i < o->n; i++)
        snprintf(r->peer[i], PEER_MAX, strchr(o->peers[i].host, ':') ? "[%s]:%d" : "%s:%d",
                 o->peers[i].host, o->peers[i].port);
    snprintf(r->right_url, sizeof(r->right_url), "%s://%s", r->tls ? "https" : "http",
             r->peer[ring_mod(o->rank + 1, o->n)]);
    snprintf(r->self_url, sizeof(r->self_url), "%s://%s", r->tls ? "https" : "http", r->peer[o->rank]);
    for (int c = 0; c <= o->n; c++)
        r->off[c] = ring_chunk_start(o->n_floats, o->n, c);
    for (int c = 0; c < o->n; c++)
        if (chunk_len(r, c) > r->chunk_max)
            r->chunk_max = chunk_len(r, c);
    return 0;
}

/* The buckets from o->edges (checked) and each chunk's pieces, which break
 * at them. 0, NEW_FAILED (err) or NEW_OOM. */
static int new_pieces(ring *r, const ring_options *o, char *err, size_t errlen)
{
    if (o->n_edges < 0 || o->n_edges > RING_MAX_EDGES || (o->n_edges > 0 && !o->edges)) {
        errmsg(err, errlen, "%d bucket edges: at most %d", o->n_edges, RING_MAX_EDGES);
        return NEW_FAILED;
    }
    r->n_buckets = o->n_edges + 1;
    r->edge = malloc(((size_t)r->n_buckets + 1) * sizeof(size_t));
    if (!r->edge)
        return NEW_OOM;
    r->edge[0] = 0;
    for (int i = 0; i < o->n_edges; i++) {
        if (o->edges[i] <= r->edge[i] || o->edges[i] >= o->n_floats) {
            errmsg(err, errlen, "bucket edge %d (%zu) is not between the one before (%zu) and the buffer's end "
                                "(%zu floats)", i, o->edges[i], r->edge[i], o->n_floats);
            return NEW_FAILED;
        }
        r->edge[i + 1] = o->edges[i];
        uint64_t le = o->edges[i]; /* little-endian (ring.c sends the host's floats so) */
        r->edges_crc = crc32c_update(r->edges_crc, &le, sizeof(le));
    }
    r->edge[r->n_buckets] = o->n_floats;
    if (o->n_edges && !r->edges_crc)
        r->edges_crc = 1; /* 0 says "no buckets" on the wire */
    /* count, then fill: a piece starts at the chunk's start, at every edge in
     * it and every `piece` floats after each */
    size_t total = 0;
    r->pbase = calloc((size_t)r->n, sizeof(size_t));
    r->npieces = calloc((size_t)r->n, sizeof(size_t));
    if (!r->pbase || !r->npieces)
        return NEW_OOM;
    for (int pass = 0; pass < 2; pass++) {
        total = 0;
        for (int c = 0; c < r->n; c++) {
            size_t a = r->off[c], e = r->off[c + 1], np = 0;
            r->pbase[c] = total;
            int b = 0;
            while (r->edge[b + 1] <= a)
                b++;
            for (size_t at = a; at < e; b++) {
                size_t seg_end = r->edge[b + 1] < e ? r->edge[b + 1] : e;
                for (; at < seg_end; at = at + r->piece < seg_end ? at + r->piece : seg_end) {
                    if (pass)
                        r->pstart[total + np] = at - a;
                    np++;
                }
            }
            if (pass)
                r->pstart[total + np] = e - a;
            r->npieces[c] = np;
            if (np > r->pieces_max)
                r->pieces_max = np;
            total += np + 1;
        }
        if (!pass && !(r->pstart = malloc(total * sizeof(size_t))))
            return NEW_OOM;
    }
    return 0;
}

/* The receive slots and their pieces' steps (none yet). 0 or NEW_OOM. */
static int new_buffers(ring *r)
{
    if (r->K) {
        size_t slots = 2 * (size_t)r->K;
        r->slots = malloc(slots * r->chunk_max * sizeof(float));
        r->piece_step = malloc(slots * r->pieces_max * sizeof(int64_t));
        if (!r->slots || !r->piece_step)
            return NEW_OOM;
        for (size_t i = 0; i < slots * r->pieces_max; i++)
            r->piece_step[i] = -1;
    }
    return 0;
}

/* The keep-alive curl handle the pushes go out on, with its headers (the
 * token's too). 0 or NEW_OOM. */
static int new_curl(ring *r, const ring_options *o)
{
    r->hdrs = curl_slist_append(NULL, "Content-Type: application/octet-stream");
    r->hdrs = curl_slist_append(r->hdrs, "Expect:"); /* no 100-continue round trip */
    if (r->token) {
        size_t hl = strlen(r->token) + 32;
        char *h = malloc(hl);
        if (!h)
            return NEW_OOM;
        snprintf(h, hl, "Authorization: Bearer %s", r->token);
        struct curl_slist *l = curl_slist_append(r->hdrs, h);
        r->auth = curl_slist_append(NULL, h);
        free(h);
        if (!l || !r->auth)
            return NEW_OOM;
        r->hdrs = l;
    }
    for (int i = 0; i < RING_CHANS * (RING_TX + 1); i++) {
        ring_tx *t = &r->ch[i / (RING_TX + 1)].tx[i % (RING_TX + 1)];
        t->r = r;
        t->ch = &r->ch[i / (RING_TX + 1)];
        CURL *h = t->curl = curl_easy_init();
        if (!h)
            return NEW_OOM;
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, r->hdrs);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
        curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
        /* a piece goes out in writes of this size (64 KiB by default): HTTPS
         * encrypts each into records of 16 KiB, fewer calls for larger ones */
        curl_easy_setopt(h, CURLOPT_UPLOAD_BUFFERSIZE, 512L << 10);
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
        /* (a timeout past ~30 years: no limit; converting it to long would overflow) */
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS,
                         o->timeout_secs < 1e9 ? (long)(o->timeout_secs * 1000) + 1000 : 0L);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, t);
        curl_easy_setopt(h, CURLOPT_ERRORBUFFER, t->curl_err);
        curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, tx_progress);
        curl_easy_setopt(h, CURLOPT_XFERINFODATA, t);
        curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
        set_tls(r, h);
    }
    for (int i = 0; i < RING_CHANS; i++) {
        if (pthread_cond_init(&r->ch[i].work, NULL) != 0)
            return NEW_OOM;
        r->ch[i].work_init = 1;
    }
    if (r->n > 1) /* a ring of one sends nothing */
        for (int i = 0; i < RING_CHANS * RING_TX; i++) {
            ring_tx *t = &r->ch[i / RING_TX].tx[i % RING_TX];
            if (pthread_create(&t->thread, NULL, tx_main, t) != 0)
                return NEW_OOM;
            t->started = 1;
        }
    return 0;
}

/* The senders stopped and their handles freed. */
static void free_senders(ring *r)
{
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < RING_CHANS; i++) {
        r->ch[i].stop = 1;
        if (r->ch[i].work_init)
            pthread_cond_broadcast(&r->ch[i].work);
    }
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < RING_CHANS * (RING_TX + 1); i++) {
        ring_tx *t = &r->ch[i / (RING_TX + 1)].tx[i % (RING_TX + 1)];
        if (t->started)
            pthread_join(t->thread, NULL);
        if (t->curl)
            curl_easy_cleanup(t->curl);
    }
    for (int i = 0; i < RING_CHANS; i++)
        if (r->ch[i].work_init)
            pthread_cond_destroy(&r->ch[i].work);
}

/* The endpoint, served on peers[rank]'s port. 0, NEW_FAILED (err) or
 * NEW_OOM. */
static int new_endpoint(ring *r, const ring_options *o, char *err, size_t errlen)
{
    const cluster_addr *self = &o->peers[o->rank];
    /* a loopback host: that very address (a socket on 127.0.0.1 refuses
     * connections to 127.0.0.2, and one on IPv4 those to [::1]); any other
     * host: every address, both families when the host is an IPv6 one */
    int v6 = strchr(self->host, ':') != NULL;
    struct sockaddr_in sa = {0};
    struct sockaddr_in6 sa6 = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)self->port);
    sa.sin_addr.s_addr = htonl(endpoint_host_is_loopback(self->host) ? INADDR_LOOPBACK : INADDR_ANY);
    if (strncmp(self->host, "127.", 4) == 0 && inet_pton(AF_INET, self->host, &sa.sin_addr) != 1)
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa6.sin6_family = AF_INET6;
    sa6.sin6_port = htons((uint16_t)self->port);
    sa6.sin6_addr = endpoint_host_is_loopback(self->host) ? in6addr_loopback : in6addr_any;
    /* as psd: a connection that has not sent a whole head within
     * RING_HEADER_SECS is cut, and near RING_MAX_CONNS each new one cuts the
     * one that has waited longest for its head, so idle or half-sent
     * connections cannot lock the neighbours out. HTTPS: psd's default
     * priorities (TLS 1.3/1.2, AEAD suites, AES-GCM first, the server's
     * order) unless the caller named others */
    http_server_config hc = {
        .name = "ring endpoint",
        .listen_fd = -1,
        .bind_addr = v6 ? (struct sockaddr *)&sa6 : (struct sockaddr *)&sa,
        .dual_stack = v6 && !endpoint_host_is_loopback(self->host),
        .threads = 0, /* a thread per connection */
        .idle_timeout_secs = 120,
        .header_timeout_secs = RING_HEADER_SECS,
        .body_grace_secs = RING_BODY_GRACE_SECS,
        .max_conns = RING_MAX_CONNS,
        .conn_memory = 256 * 1024,
        .token = r->token,
        .tls_cert_pem = r->tls ? r->cert_pem : NULL,
        .tls_key_pem = r->tls ? r->key_pem : NULL,
        .tls_priorities = r->tls ? r->priorities : NULL,
        .not_found = ring_not_found,
    };
    http_module hm = {
        .name = "ring",
        .routes = ring_routes,
        .n_routes = N_RING_ROUTES,
        .ctx = r,
        /* a refused piece is read (the sender reads the 401), a bigger body not */
        .swallow_refused_max = (uint64_t)r->piece * 4,
        .ext_size = sizeof(chunk_req),
        .wrong_method = ring_wrong_method,
        .done = chunk_done,
    };
    char herr[256];
    if (!(r->srv = http_server_new(&hc, herr, sizeof(herr))) || http_server_add(r->srv, &hm, herr, sizeof(herr)) != 0)
        return NEW_OOM;
    errno = 0;
    if (http_server_start(r->srv, herr, sizeof(herr)) < 0) {
        int e = errno;
        char hint[160] = "";
        if (r->tls && e != EADDRINUSE)
            snprintf(hint, sizeof(hint), " over HTTPS (is %s the key of %s?)", r->names.key, r->names.cert);
        errmsg(err, errlen, "cannot serve the ring endpoint on %s (port %d)%s: %s", r->peer[o->rank],
               self->port, hint, herr);
        return NEW_FAILED;
    }
    return 0;
}

ring *ring_new(const ring_options *o, char *err, size_t errlen)
{
    if (o->n < 1 || o->rank < 0 || o->rank >= o->n || o->n_floats < (size_t)o->n) {
        errmsg(err, errlen, "a ring of %d workers cannot all-reduce %zu floats", o->n, o->n_floats);
        return NULL;
    }
    ring *r = calloc(1, sizeof(*r));
    if (!r) {
        errmsg(err, errlen, "out of memory");
        return NULL;
    }
    int rc;
    if ((rc = new_basics(r, o)) == 0 && (rc = new_tls(r, o, err, errlen)) == 0 && (rc = new_peers(r, o)) == 0 &&
        (rc = new_pieces(r, o, err, errlen)) == 0 && (rc = new_buffers(r)) == 0 && (rc = new_curl(r, o)) == 0)
        rc = new_endpoint(r, o, err, errlen);
    if (rc == 0)
        return r;
    if (rc == NEW_OOM)
        errmsg(err, errlen, "out of memory for a ring of %d workers and %zu floats", o->n, o->n_floats);
    ring_free(r);
    return NULL;
}

void ring_free(ring *r)
{
    if (!r)
        return;
    if (r->srv) {
        /* the left neighbour's last piece was marked before its answer went
         * out: let the answer go (else it sees an error and waits to retry) */
        for (int i = 0; i < 200 && atomic_load(&r->uploads) > 0; i++)
            sleep_ms(10);
        /* a peer speaks the other protocol: keep serving a while, so that
         * one sending to this task (in a ring of two, that same peer) finds
         * out too, by its probe, rather than by waiting out its timeout */
        if (atomic_load(&r->mismatch))
            sleep_ms(RING_MISMATCH_LINGER_MS);
    }
    free_senders(r);
    http_server_free(r->srv); /* every connection closed, the tracker stopped */
    curl_slist_free_all(r->hdrs);
    curl_slist_free_all(r->auth);
    free(r->slots);
    free(r->piece_step);
    free(r->peer);
    free(r->off);
    free(r->edge);
    free(r->pstart);
    free(r->pbase);
    free(r->npieces);
    free(r->state);
    free(r->token);
    free(r->cert_pem);
    free(r->key_pem);
    free(r->ca_file);
    free(r->priorities);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}
