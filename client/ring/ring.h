/* ring.h - ring all-reduce between workers over HTTP or HTTPS, with no ps.
 *
 * Every worker serves a small libmicrohttpd endpoint on its own address and
 * pushes pieces of the buffer to its right neighbour (rank + 1 mod N) with
 * libcurl. One all-reduce sums a float buffer over the N workers in place:
 * the buffer is split into N chunks; a reduce-scatter (N-1 steps: receive a
 * chunk from the left, add it to one's own, pass it on) leaves each worker
 * with one fully summed chunk, an all-gather (N-1 steps: receive, copy, pass
 * on) hands the sums round. Chunks travel in pieces (--ring_piece_bytes), and
 * a piece is passed on as soon as it is added, so sending and receiving
 * overlap; pieces go out through sender threads with a connection each, so
 * the next one is on the wire while a piece awaits its answer. Each chunk is summed along one path in one order, and everyone
 * copies the result, so all workers end with bit-identical buffers. Each
 * worker sends 2(N-1)/N of the buffer per all-reduce, whatever N is.
 *
 * The receive side: a slot per (step parity, ring step, piece) that the HTTP
 * thread fills and marks with the training step; the caller waits on a
 * condition variable for it, up to a timeout (a dead or stuck neighbour).
 *
 * Routes (every worker):
 *   POST /v1/ring/chunk?step=S&k=K&offset=O&from=R&n=N&floats=F[&edges=E]
 *        one piece, raw little-endian float32 (E: the buckets' edges'
 *        CRC-32C, ring_options.edges; absent: no buckets; 409 when it is not
 *        this worker's); 204; 400/404/409/411/413 with
 *        {"error": ...} for a piece this worker does not expect (409 also for
 *        a step other than this worker's step - 1 (a resend), step or step + 1;
 *        before its first all-reduce, other than that one's step or the next;
 *        503, which the sender retries, while that step is not known yet:
 *        ring_expect_first_step), 400 for a piece holding a NaN or an Inf
 *        (not taken: the slot is not marked)
 *   GET  /v1/ring/state   what ring_publish set (the chief's parameters, a
 *        safetensors body); 503 until then
 *   GET  /v1/status, /healthz, and the monitoring page (/, /app.js, /style.css)
 * With a token (workerd --auth_token_file, as psd's), the chunk and state
 * routes need "Authorization: Bearer <token>" (401 with {"error": ...} and
 * WWW-Authenticate: Bearer otherwise; the state is the whole model, so it is
 * a protected read), and the pushes and the state fetch send it; the status,
 * health and page routes stay open.
 *
 * With a certificate (tls_cert/tls_key; workerd --ring_tls_cert/--ring_tls_key)
 * every route is served over HTTPS only, with the GnuTLS priority string
 * tls_priorities (default psd's, TLS_PRIORITIES_DEFAULT: TLS 1.3/1.2, AEAD,
 * ECDHE), and the pushes and the state fetch go over HTTPS offering only the
 * TLS versions that string enables, the peer's certificate verified against
 * tls_ca (or the system's CAs), its host name included. Every task must then
 * have one: a peer that speaks the other protocol (found by one probe of its
 * /healthz after a failed request), that refuses the TLS versions this task
 * offers (after a handshake failure, a probe offering this task's versions is
 * refused and one offering any version answers, twice in a row) or whose
 * certificate does not verify stops this task at once with an error naming
 * the peer, no retry. /v1/status says the scheme ("ring":
 * {"url": "https://...", "tls": "TLS 1.3", ...}). */
#ifndef RESTPS_RING_H
#define RESTPS_RING_H

#include <stddef.h>
#include <stdint.h>

#include "cluster.h"
#include "ring/ring_ckpt.h"

typedef struct ring ring;

/* What ring_new's and the all-reduce's messages call the TLS settings: the
 * caller's flag names (workerd: "--ring_tls_cert", ..., "--tls_ca"); a NULL
 * member: the ring_options field's name ("tls_cert"). */
typedef struct ring_tls_names {
    const char *cert, *key, *ca, *priorities;
} ring_tls_names;

typedef struct ring_options {
    const cluster_addr *peers; /* the ring in rank order; peers[rank] is this worker */
    int n, rank;
    size_t n_floats;           /* the length of every buffer all-reduced */
    size_t piece_bytes;        /* a chunk travels in pieces of at most this (rounded to floats) */
    double timeout_secs;       /* wait this long for the left neighbour (or to reach the right) */
    const char *name;          /* "worker 1", for messages */
    int (*abort)(void);        /* non-zero: stop waiting (a signal); may be NULL */
    const char *token;         /* bearer token every peer needs and sends (copied); NULL: open */
    const char *tls_cert;      /* PEM files: serve HTTPS and talk HTTPS to the peers; NULL: HTTP */
    const char *tls_key;       /* (read by ring_new; both or neither) */
    const char *tls_ca;        /* with tls_cert: PEM CA(s) the peers' certificates must chain to;
                                * NULL: the system's */
    const char *tls_priorities; /* with tls_cert: the GnuTLS priority string served (checked by
                                 * ring_new: ring_tls_priorities_check); NULL:
                                 * TLS_PRIORITIES_DEFAULT */
    ring_tls_names tls_names;  /* what the messages call these settings (copied) */
    /* The global step of the first all-reduce (pieces of it and of the next
     * are taken before it begins, no other); RING_STEP_UNKNOWN: not known
     * yet (a worker that fetches the chief's state): pieces are answered 503
     * until ring_expect_first_step. 0 (the default) for a ring that counts
     * from 0. */
    int64_t first_step;
    /* Buckets (workerd --overlap): the buffer's floats split at these
     * strictly increasing edges, each in (0, n_floats), into n_edges + 1
     * buckets that ring_allreduce_bucket sums one at a time; a chunk's pieces
     * break at the edges, so every worker needs the same ones (a piece names
     * them: `edges`, their CRC-32C; 409 where they differ). NULL, 0: one
     * bucket, the whole buffer. Copied. */
    const size_t *edges;
    int n_edges;
} ring_options;

#define RING_MAX_EDGES 4096

#define RING_STEP_UNKNOWN (-1)

/* 0 when prio can be the ring's GnuTLS priority string (tls_priorities): GnuTLS
 * takes it (tls_priorities_check) and it enables TLS 1.2 or 1.3, which the
 * pushes need (libcurl on OpenSSL 3 refuses TLS 1.0 and 1.1 at its default
 * security level, so a string of those alone served GnuTLS clients but no
 * task); -1 with err ("it enables TLS 1.1 at most, and ...") otherwise.
 * ring_new checks tls_priorities so; a caller may first, when reading flags. */
int ring_tls_priorities_check(const char *prio, char *err, size_t errlen);

/* Start this worker's endpoint on peers[rank]'s port (loopback when its host
 * is localhost, 127.x (that address) or ::1, else every address). NULL with err. */
ring *ring_new(const ring_options *o, char *err, size_t errlen);
void ring_free(ring *r);

/* Sum buf (n_floats) over the ring in place; step tells this all-reduce from
 * the previous and the next one (every worker passes the same). wait_secs
 * replaces the timeout for this call when larger (the first one, while the
 * others start). 0; -1 with err naming the peer (it died, or refused what we
 * sent, or its token: at once, no retry); -2 when abort() asked to stop. */
int ring_allreduce(ring *r, int64_t step, float *buf, double wait_secs, char *err, size_t errlen);

/* The buckets (ring_options.edges): how many, and bucket b's floats
 * [*start, *end). */
int ring_buckets(const ring *r);
void ring_bucket_range(const ring *r, int b, size_t *start, size_t *end);
/* Sum bucket b of buf over the ring in place, as ring_allreduce sums the
 * whole buffer (the same floats: a float's chunk, and so the order of its
 * sum, does not depend on the buckets). Every worker sums the buckets of a
 * step in the same order, the last first (ring_allreduce's order); the
 * all-reduce is counted done with bucket 0. Returns as ring_allreduce. */
int ring_allreduce_bucket(ring *r, int64_t step, float *buf, int b, double wait_secs, char *err, size_t errlen);

/* The global step of the first all-reduce, once known (ring_options.first_step);
 * no effect once one has begun. */
void ring_expect_first_step(ring *r, int64_t step);

/* Serve body at GET /v1/ring/state from now on (ring takes the malloc'd body). */
void ring_publish(ring *r, void *body, size_t len);
/* GET /v1/ring/state from peer `from`, retrying while it is not up or has not
 * published yet, for up to wait_secs. 0 with *body (malloc'd) and *len; -1 with err
 * (at once when it refuses this worker's token). */
int ring_fetch_state(ring *r, int from, double wait_secs, void **body, size_t *len, char *err,
                     size_t errlen);

/* What /v1/status says. */
typedef struct ring_info {
    const char *task_type; /* "chief" or "worker" */
    int task_index;
    const char *optimizer;
    double learning_rate;
    int64_t train_steps;
} ring_info;
void ring_set_info(ring *r, const ring_info *info);
/* loss NAN: none yet */
void ring_set_progress(ring *r, int64_t global_step, double loss);
void ring_set_checkpoint(ring *r, int64_t step, const char *path);

/* Body bytes this worker sent, and all-reduces done. */
uint64_t ring_bytes_sent(const ring *r);
int64_t ring_allreduces(const ring *r);
/* "host:port" of peer i, for messages. */
const char *ring_peer(const ring *r, int i);
/* This worker's endpoint, "https://host:port" or "http://host:port". */
const char *ring_url(const ring *r);
/* The TLS versions it serves and offers, "TLS 1.3" or "TLS 1.2-1.3"; NULL over HTTP. */
const char *ring_tls(const ring *r);

#endif
