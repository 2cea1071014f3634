/* libps.h - the client library of psd's HTTP contract (openapi/openapi.yaml),
 * over libcurl. One ps_client talks to every ps shard of a cluster through
 * one keep-alive handle per shard.
 *
 * Every call returns 0 or a negative PS_E* code; ps_error() then holds a
 * one-line message naming the shard and, when the server answered, its
 * status and its own error text. A client is used by one thread at a time;
 * use one client per thread. No global state beyond libcurl's own
 * (curl_global_init runs once, thread-safely, in ps_client_new). The calls
 * live in libps.c, the transfer engine under them in transfer.c. */
#ifndef RESTPS_LIBPS_H
#define RESTPS_LIBPS_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

enum {
    PS_OK = 0,
    PS_EINVAL = -1,    /* bad argument (message says which) */
    PS_ENET = -2,      /* no answer: connect failure, timeout, reset (after retries) */
    PS_EHTTP = -3,     /* the server refused: ps_http_status() says how */
    PS_ETOOBIG = -4,   /* the answer does not fit the caller's buffer */
    PS_EPROTO = -5,    /* the answer is not what the contract says */
    PS_ENOMEM = -6,
    PS_ETLS = -7,      /* TLS failed: certificate not trusted, wrong name, handshake (not retried) */
};

typedef struct ps_options {
    long timeout_ms;     /* whole-request limit; default 30000 */
    long connect_timeout_ms; /* default 3000 */
    int retries;         /* extra tries on network errors and 503; default 3 */
    long backoff_ms;     /* first wait between tries, doubled each time; default 100 */
    long backoff_max_ms; /* the wait never grows past this; default 2000 */
    long retry_ms;       /* also keep trying until this long has passed since the first
                            try (a ps restarting); 0 (default) = only `retries` */
    /* Each wait is drawn uniformly from [w/2, w] (jitter), so workers that
     * lost the same ps do not all come back at the same instant. */
    const char *token;   /* bearer token for writes (and reads), or NULL */
    int tls;             /* talk HTTPS (psd --tls_cert); the server's certificate is verified */
    const char *ca_file; /* PEM file of the CA(s) to trust for it (implies tls); NULL = the system's */
} ps_options;

typedef struct ps_client ps_client;

/* hosts: n "host:port" strings (the ps job). opt may be NULL for defaults.
 * NULL with err on failure. */
ps_client *ps_client_new(const char *const *hosts, int n, const ps_options *opt, char *err,
                         size_t errlen);
void ps_client_free(ps_client *c);
int ps_shards(const ps_client *c);

/* The last error's message, and the HTTP status of the last answer (0 if none). */
const char *ps_error(const ps_client *c);
long ps_http_status(const ps_client *c);

typedef struct ps_var_info {
    char name[TENSOR_NAME_MAX + 1];
    tensor_shape shape;
    uint64_t version;
    uint64_t bytes;
} ps_var_info;

/* GET /v1/vars/{name}: the raw float32 tensor into dst (cap floats). The
 * shape and version it had come back in info (may be NULL). */
int ps_pull(ps_client *c, int shard, const char *name, float *dst, size_t cap,
            ps_var_info *info);

/* PUT /v1/vars/{name}. only_create sends If-None-Match: * (then PS_EHTTP with
 * status 412 when it exists). *created (may be NULL) says 201 vs 200. */
int ps_put(ps_client *c, int shard, const char *name, const tensor_shape *shape,
           const float *data, int only_create, int *created);

/* POST /v1/vars/{name}/grad. */
int ps_push_grad(ps_client *c, int shard, const char *name, const float *grad, size_t numel,
                 int64_t *global_step);

/* GET /v1/params: the shard's whole safetensors body, straight into buf (cap
 * bytes). *len is its length; *global_step from the X-Global-Step header. */
int ps_pull_params(ps_client *c, int shard, void *buf, size_t cap, size_t *len,
                   int64_t *global_step);

/* POST /v1/grads: a safetensors body sent as head (prefix + JSON header, from
 * st_header_build) followed by data, without joining them. push_id (may be
 * NULL) makes the push idempotent, and lets it be retried safely. */
int ps_push_grads(ps_client *c, int shard, const void *head, size_t head_len, const void *data,
                  size_t data_len, const char *push_id, int64_t *global_step, int *duplicate);

/* POST /v1/vars/{name}/rows: the rows of a sparse variable for n ids (raw
 * little-endian int64, n >= 1) into dst (n * dim floats, the order of the
 * ids; rows the ps does not hold come as their initial value). buf (cap
 * bytes) receives the answer (a safetensors body of values [n, dim]) first;
 * *global_step (may be NULL) from X-Global-Step. */
int ps_pull_rows(ps_client *c, int shard, const char *name, const int64_t *ids, int64_t n, int dim, float *dst,
                 void *buf, size_t cap, int64_t *global_step);

/* fn (may be NULL) is asked during every wait: nonzero stops the request
 * (PS_ENET) instead of retrying or waiting on, e.g. after SIGTERM. */
void ps_set_abort(ps_client *c, int (*fn)(void));

/* Work to do while the next request waits for its answer: fn(arg) is called
 * once, on this thread, as soon as the whole body of the next request that
 * has one (a push) is in the socket, while the ps reads and applies it; the
 * answer is read after fn returns. One-shot: the request after that one does
 * not call it, and when the body never went out (a failure first) fn is not
 * called at all, so the caller must not count on it. With several shards it
 * runs once, after the last body. fn must not use this ps_client nor change
 * the memory the request sends. NULL: nothing (the default). */
void ps_set_while_waiting(ps_client *c, void (*fn)(void *), void *arg);

/* What a request waits for, as it waits: fn(arg, s) is called on this thread
 * from inside a request that has moved no byte either way for 5 s (then every
 * 10 s more: s->secs), once more when it moves again (s->again), and before
 * each retry of a try that failed (s->err: why). s->label names the ps task
 * ("ps 0 (host:port)"), s->long_poll a request the ps may hold on purpose (a
 * pull that waits for a step). For a program to say what it waits for while
 * a ps or its link is down. NULL: nothing (the default). */
typedef struct ps_stall {
    const char *label, *method, *path;
    const char *err; /* NULL, or why the try failed (a retry follows) */
    double secs;     /* how long nothing has moved, or since the first try */
    int again;       /* 1: bytes move again after a stall that was reported */
    int long_poll;
    double budget;   /* the retry budget now (ps_set_retry_ms), seconds; 0: only the few retries */
} ps_stall;
void ps_set_stall_report(ps_client *c, void (*fn)(void *arg, const ps_stall *s), void *arg);

/* Seconds the last call's requests waited between sending the request and
 * the answer's first byte (the longest over its shards and tries): a long
 * poll's wait for its step, a push's upload and the ps's work on it. */
double ps_last_wait_secs(const ps_client *c);

/* Change the retry time budget (ps_options.retry_ms) from now on. */
void ps_set_retry_ms(ps_client *c, long retry_ms);
/* on: a pull that does not wait (min_step < 0) reads the moving averages
 * (GET /v1/params?moving_average=1, --moving_average_decay) */
void ps_set_moving_average(ps_client *c, int on);

/* Streaming (workerd --overlap), on the thread that runs the request:
 * landed(arg, shard, len, global_step) each time answer bytes land in a
 * pull's buf (or a push's ret_buf): len is how many are there now (0: a new
 * try starts over), global_step the answer's X-Global-Step (-1 when it had
 * none). A push's data may come in pieces (parts, n_parts, instead of data
 * and data_len), and gate(arg, k) (not NULL) is asked before the body reads
 * from piece k, on every try: it returns once the piece may be read (0), or
 * nonzero to stop the request (PS_ENET). */
typedef struct ps_part {
    const void *data;
    size_t len;
} ps_part;
typedef void (*ps_landed_fn)(void *arg, int shard, size_t len, int64_t global_step);

/* What became of a bulk push (ps_push_req.outcome). */
enum { PS_PUSH_APPLIED, PS_PUSH_DUPLICATE, PS_PUSH_STALE, PS_PUSH_PENDING };

/* Every shard at once (libcurl multi), one request per shard; n distinct
 * shards. Each answer lands in its own buffer. On failure: the first failing
 * shard's error (in the order given) in ps_error/ps_http_status. */
typedef struct ps_pull_req {
    int shard;
    int64_t min_step;   /* < 0: no wait; else GET /v1/params?min_step=N&timeout_ms=T, the
                           long poll of sync training: the answer comes when the shard's
                           global_step reaches min_step, or after timeout_ms with whatever
                           step it is at (check global_step) */
    long timeout_ms;
    int worker;         /* >= 0 (with min_step): sync worker `worker`; the shard answers at
                           once (with its current step) when it does not hold this worker's
                           gradient for its current step, e.g. after it restarted from a
                           checkpoint, instead of waiting for a step that cannot come */
    int64_t min_clock;  /* > 0: stale-synchronous: first wait until the slowest live worker
                           completed this many iterations (with worker; 0 = none) */
    int64_t clock;      /* > 0 with worker: this worker starts iteration `clock` (0 = none) */
    const char *dtype;  /* NULL or "fp32": float32 bodies; "bf16", "fp16": 16-bit (&dtype=) */
    void *buf;
    size_t cap;
    ps_landed_fn landed;  /* may be NULL (above) */
    void *landed_arg;
    size_t len;           /* out */
    int64_t global_step;  /* out */
} ps_pull_req;
int ps_pull_params_many(ps_client *c, ps_pull_req *r, int n);

typedef struct ps_push_req {
    int shard;
    const void *head;     /* as ps_push_grads */
    size_t head_len;
    const void *data;
    size_t data_len;
    const char *push_id;  /* may be NULL */
    const ps_part *parts; /* n_parts > 0: the data in these pieces, in order (streaming, above) */
    int n_parts;
    int (*gate)(void *arg, int part);
    void *gate_arg;
    ps_landed_fn landed;  /* for ret_buf; may be NULL */
    void *landed_arg;
    /* ret_buf != NULL: POST /v1/grads?return=params, one round trip: the
     * answer is the shard's variables after the update (a GET /v1/params
     * body, in ret_dtype: NULL/"fp32", "bf16", "fp16") into ret_buf
     * (ret_cap bytes, *ret_len its length); ret_min_step >= 0: once the
     * shard's step reaches it (or ret_timeout_ms passes); ret_min_clock > 0
     * with ret_worker: once the slowest live worker completed that many
     * iterations, ret_clock > 0: this worker then starts iteration ret_clock
     * (stale-synchronous, as ps_pull_req) */
    void *ret_buf;
    size_t ret_cap;
    size_t ret_len;       /* out */
    const char *ret_dtype;
    int64_t ret_min_step, ret_min_clock, ret_clock;
    long ret_timeout_ms;
    int ret_worker;
    int ret_waited;       /* out: the answer waited (min_step, min_clock) before it came */
    int64_t global_step;  /* out */
    int outcome;          /* out: PS_PUSH_* */
} ps_push_req;
int ps_push_grads_many(ps_client *c, ps_push_req *r, int n);

/* GET /v1/status as parsed JSON (json_decref it). */
int ps_status(ps_client *c, int shard, json_t **out);

/* Any JSON exchange: method "GET", "PUT" or "POST" on path, with body (may be
 * NULL; not stolen) and the answer parsed into *out (may be NULL: discarded).
 * idempotent: retry on network errors and 503; else only when the connection
 * was never made. */
int ps_json(ps_client *c, int shard, const char *method, const char *path, json_t *body,
            int idempotent, json_t **out);

#endif
