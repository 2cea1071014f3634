/* transfer.h - libps's transfer engine, private to client/: the ps_client
 * (one keep-alive easy handle per shard, the options, the last error), and
 * requests run with retries: one at a time or to every shard at once over
 * libcurl's multi interface, bodies read straight into the caller's buffers
 * and sent straight from them, network errors and 503 retried with backoff
 * and jitter where a retry cannot apply anything twice. The endpoint calls of
 * libps.h (libps.c) build paths and headers on it and read the answers. */
#ifndef RESTPS_TRANSFER_H
#define RESTPS_TRANSFER_H

#include <curl/curl.h>
#include <jansson.h>
#include <stddef.h>

#include "cluster.h"
#include "errmsg.h"
#include "libps/libps.h"

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
    int moving_average;    /* a plain GET /v1/params reads the moving averages */
    unsigned seed;         /* backoff jitter */
    CURLM *multi;          /* requests to every shard at once */
    char *ca_file;         /* HTTPS: the CAs to trust, or NULL (the system's) */
    int (*abort_fn)(void); /* nonzero: stop waiting (a signal asked the program to stop) */
    void (*while_fn)(void *); /* ps_set_while_waiting: once the next body is sent */
    void *while_arg;
    void (*stall_fn)(void *, const ps_stall *); /* ps_set_stall_report */
    void *stall_arg;
    double last_wait;  /* ps_last_wait_secs */
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
    ps_landed_fn landed; /* streaming: bytes landed in buf (libps.h) */
    void *landed_arg;
    int shard;
} sink;

/* What a request sends: part[0] then part[1], or with n_more > 0 part[0]
 * then the pieces more[0..n_more) (each asked of gate first, libps.h). */
typedef struct source {
    const unsigned char *part[2];
    size_t len[2];
    size_t idx, pos;
    const ps_part *more;
    int n_more;
    int (*gate)(void *arg, int part);
    void *gate_arg;
    int gated;  /* pieces the gate let through on this try */
} source;
/* Its bytes in all. */
size_t source_total(const source *src);

/* Which failures a request retries: any network error and 503 (idempotent
 * requests), or only a connection that was never made. */
enum retry_mode { RETRY_ANY, RETRY_CONNECT_ONLY };

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
    int hook;                 /* call the client's while_fn once the body is sent (on_progress) */
    ps_client *c;
    long status;
    char err[1024];
    char curl_err[CURL_ERROR_SIZE]; /* libcurl's own words (certificate problems) */
    /* the stall report: when a byte last moved, the counts then, the next report */
    uint64_t moved_ns, report_ns;
    long long last_dn, last_un;
    int stalled, long_poll;
    int retried; /* a failed try of this call was reported (the stall report) */
} xfer;

/* The message ps_error() returns, printf-style. */
#define xfer_seterr(c, ...) errmsg((c)->err, sizeof((c)->err), __VA_ARGS__)

/* Run xs (distinct shards) with retries: network errors and 503 where the
 * mode allows, with backoff and jitter, `retries` times and for retry_ms in
 * all. Returns PS_OK, or the first failure in shard order (its message in
 * ps_error, its status in ps_http_status). Clears c->extra_timeout_ms. */
int xfer_run(ps_client *c, xfer *xs, int n);

/* One request with retries. method: "GET", "PUT", "POST". extra: NULL-ended
 * header lines (may be NULL). src may be NULL. The answer lands in s. */
int xfer_one(ps_client *c, int shard, const char *method, const char *path,
             const char *const *extra, source *src, sink *s, enum retry_mode mode);

/* xfer_one with the answer parsed as JSON into *out (json_decref it). */
int xfer_json(ps_client *c, int shard, const char *method, const char *path,
              const char *const *extra, source *src, enum retry_mode mode, json_t **out);

#endif
