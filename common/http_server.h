/* http_server.h - the one HTTP(S) endpoint layer every daemon here serves
 * with (libmicrohttpd): psd, a ring worker's endpoint, and a pipeline stage's
 * activation endpoint. One server is one daemon on one port; any number of
 * modules add their route tables to it before it starts, so one process can
 * serve several modules' routes on one port (each handler gets its module's
 * context in r->ctx).
 *
 * Before any handler runs, every request goes through the same checks, in
 * this order (a refusal is {"error": "..."} JSON, endpoint.h):
 *   1. the framing and the request target (endpoint_check_framing,
 *      endpoint_uri_guard: 400, 414; sent with Connection: close);
 *   2. the route: the path in no table: 404 (the config's not_found hook
 *      may word it); the path in a table but not with this method: 405 with
 *      Allow (the module's wrong_method hook may word it). GET routes also
 *      answer HEAD;
 *   3. the bearer token (common/token.h), when the server has one and the
 *      route needs it: 401 with WWW-Authenticate: Bearer;
 *   4. a route with {name}: the module's check_name hook (or 1 to
 *      HTTP_NAME_MAX bytes: 400); then a query argument given more than
 *      once (names compared without case, as http_query's lookup does:
 *      400 naming it; no route takes repeats, http_query reads the first);
 *   5. a body route: one Content-Length at most, digits only (400),
 *      Transfer-Encoding chunked or none (400), the body limit (413 before a
 *      byte is read), then the route's before_body hook, which may answer,
 *      refuse after the body (http_refuse_after_body), point the body
 *      into a caller's buffer (http_body_into) or take it piece by piece
 *      as it arrives (http_body_sink);
 *   6. the body, read as it arrives: a body that trickles in (under
 *      body_min_rate bytes/s on average after header_timeout_secs) closes
 *      the connection; one over the limit or longer than announced is
 *      refused once it ends (413/400); a buffer that cannot grow is 503;
 *   7. the handler (route->handle), on the last call for the request.
 * The request path never exits the process: a response that cannot be
 * built is MHD_NO, and libmicrohttpd closes the connection.
 *
 * A connection's head must arrive within header_timeout_secs, and near
 * max_conns each new connection cuts the one that has waited longest for
 * its head (common/conntrack.h). */
#ifndef RESTPS_HTTP_SERVER_H
#define RESTPS_HTTP_SERVER_H

#include <jansson.h>
#include <microhttpd.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>

typedef struct http_server http_server;
typedef struct http_req http_req;
typedef struct http_route http_route;
typedef struct http_module http_module;

/* The longest {name} a path may carry into a handler (r->name); longer is
 * refused before check_name runs with name_ok 0. */
#define HTTP_NAME_MAX 255

/* Route flags. */
enum {
    HTTP_ROUTE_AUTH = 1, /* needs the bearer token whenever the server has one */
    HTTP_ROUTE_OPEN = 2, /* never needs it, even with the module's token_reads */
    HTTP_ROUTE_BODY = 4, /* takes a request body (others: none is read) */
};

/* A body limit that leaves the length to the route's before_body hook (it
 * must then point the body somewhere of a known size: http_body_into). */
#define HTTP_BODY_UNLIMITED UINT64_MAX

struct http_route {
    const char *method; /* "GET" (also HEAD), "PUT", "POST", ... */
    /* "/v1/status", or one {name}: "/v1/vars/{name}/stats". {name} stands
     * for one or more bytes, '/' included; of two patterns that both match,
     * the one with the longer text after {name} wins. */
    const char *path;
    int flags;          /* HTTP_ROUTE_* */
    /* HTTP_ROUTE_BODY: the largest body accepted; 0: the module's max_body */
    uint64_t max_body;
    /* Optional (body routes): runs when the headers are in and checked,
     * before the body is read. MHD_NO drops the connection. It may answer
     * (then the body is never read), call http_refuse_after_body, or call
     * http_body_into. */
    enum MHD_Result (*before_body)(http_req *r);
    /* Answers the request (or suspends it: then it runs again once resumed). */
    enum MHD_Result (*handle)(http_req *r);
    const char *summary; /* one line, for route listings */
};

/* Where a body goes unless before_body says otherwise (default: malloc'd
 * memory, freed when the request ends). The layer asks for the first
 * min(Content-Length, 64 KiB, limit) bytes and grows the buffer to 8x what
 * has arrived, up to the length announced (to all of it once 512 KiB and
 * 1/128 of it came: a large body is copied a few times, a small part each
 * time, and a sender never has more than 128x what it sent reserved). */
typedef struct http_body_ops {
    /* A buffer of at least cap bytes: a handle, its bytes in *data and its
     * size in *got. NULL when out of memory. */
    void *(*alloc)(void *cls, size_t cap, unsigned char **data, size_t *got);
    /* h grown to at least cap bytes, its first `used` bytes kept: the
     * (maybe new) handle, as alloc. NULL, h untouched, when out of memory. */
    void *(*grow)(void *cls, void *h, size_t used, size_t cap, unsigned char **data, size_t *got);
    /* Optional: the body is complete, len bytes, before the handler runs. */
    void (*done)(void *cls, void *h, size_t len);
    /* The request ended and still holds h (see http_take_body). */
    void (*release)(void *cls, void *h);
    void *cls;
} http_body_ops;

/* One module's routes and what they share. Copied by http_server_add (the
 * table it points to must stay valid while the server runs). */
struct http_module {
    const char *name;          /* "psd", "ring": log lines */
    const http_route *routes;
    size_t n_routes;
    void *ctx;                 /* r->ctx for every route of this module */
    int token_reads;           /* the token is also needed on routes without
                                * HTTP_ROUTE_AUTH (not HTTP_ROUTE_OPEN ones) */
    uint64_t max_body;         /* the body routes' default limit (bytes) */
    const char *max_body_flag; /* named in the 413, e.g. "--max_body_bytes"; NULL: none */
    /* What may announce a body's length besides Content-Length (a
     * before_body hook sets expect_len), named when a body is longer:
     * "X-Shape"; NULL: Content-Length alone. */
    const char *length_header;
    /* A body route refused by the token: a body of at most this many bytes
     * (its Content-Length) is read and dropped before the 401 goes out, so
     * that a sender on a kept-alive connection reads the answer; a larger or
     * unsized one (or with 0 here) is answered at once, before it is read. */
    uint64_t swallow_refused_max;
    size_t ext_size;           /* bytes of zeroed per-request state at r->ext */
    const http_body_ops *body; /* NULL: malloc'd */
    /* Optional: a route with {name}, after the token check; answers (a
     * refusal) or returns MHD_YES with nothing queued to go on. r->name_ok
     * is 0 for an empty or too long name. NULL: 400 unless 1 to
     * HTTP_NAME_MAX bytes. */
    enum MHD_Result (*check_name)(http_req *r);
    /* Optional: the path is this module's but the method is not; allow is
     * "GET, HEAD, PUT" for the Allow header. NULL: 405 {"error": "method M
     * not allowed on PATTERN (allowed: ...)"} with Allow. */
    enum MHD_Result (*wrong_method)(http_req *r, const char *pattern, const char *allow);
    /* Optional: a request routed to this module ended (before the config's
     * end hook); completed_ok: libmicrohttpd sent the whole answer. */
    void (*done)(http_req *r, int completed_ok);
};

/* One request, from its first callback to its completion. The layer writes
 * every field; handlers read them and keep their own state at ext. */
struct http_req {
    http_server *server;
    struct MHD_Connection *conn;
    const char *method, *url;     /* valid for the request's life */
    const http_route *route;      /* NULL until routed (and for a 404) */
    const http_module *module;    /* the route's module, or NULL */
    void *ctx;                    /* module->ctx */
    void *ext;                    /* module->ext_size zeroed bytes (NULL if 0) */
    char name[HTTP_NAME_MAX + 1]; /* {name} in the path, when the route has one */
    int name_ok;                  /* 0: empty, or longer than HTTP_NAME_MAX (cut) */
    /* the body: what body ops (or http_body_into) gave; body_h is the
     * handle (NULL for http_body_into), body_len the bytes in */
    void *body_h;
    unsigned char *body_data;
    size_t body_len, body_cap;
    uint64_t expect_len;          /* Content-Length; UINT64_MAX when absent */
    int answered;                 /* a response is queued */
    unsigned status;              /* the status answered (0 until then) */
    uint64_t bytes_in, bytes_out; /* body bytes received and answered */
    uint64_t t_start_ns;          /* CLOCK_MONOTONIC when the head was in */
    unsigned long json_fail_mark; /* json_failed_allocs() when the handler was called */

    /* the layer's own */
    struct http_counter *streamed; /* what a streamed answer sent so far */
    int body_fixed;                /* the body goes to a caller's buffer */
    int discard;                   /* swallow the rest of the upload, then answer: */
    unsigned discard_status;
    char discard_msg[400];
    uint64_t discarded;
    uint64_t limit;                /* this request's body limit */
    void (*sink)(void *cls, const unsigned char *data, size_t n); /* http_body_sink */
    void *sink_cls;
};

/* The floor under a request body's average rate: past its grace a body that
 * trickles slower holds a connection (a slot) no longer. */
#define HTTP_BODY_MIN_RATE 1024

typedef struct http_server_config {
    const char *name;           /* "psd", "ring endpoint": log lines */
    /* The program, for the layer's log lines (the connection tracker's
     * closes, a body that trickles in): "PROGRAM: " and "NAME: " after it
     * when the name differs ("psd: closed ..."; "workerd: ring endpoint:
     * closed ..."). NULL: the process's own name
     * (program_invocation_short_name: workerd, psd, ring_allreduce). */
    const char *program;
    /* Where to listen: a bound, listening socket (>= 0; the server closes
     * it when it stops), else bind_addr (an AF_INET or AF_INET6 address
     * with its port; 0: any free port) */
    int listen_fd;
    const struct sockaddr *bind_addr;
    int dual_stack;             /* with an AF_INET6 bind_addr: IPv4 too */
    int threads;                /* 0: a thread per connection; N >= 1: N
                                 * threads polling with epoll */
    int suspend;                /* handlers may suspend connections
                                 * (MHD_suspend_connection) */
    unsigned idle_timeout_secs; /* libmicrohttpd's idle timeout */
    unsigned header_timeout_secs; /* a head must arrive within this (and a
                                   * body's rate is checked from then on) */
    unsigned body_min_rate;     /* bytes/s a body must average after its
                                 * grace; 0: HTTP_BODY_MIN_RATE (every
                                 * endpoint has the floor) */
    unsigned body_grace_secs;   /* the grace; 0: header_timeout_secs */
    unsigned max_conns;
    size_t conn_memory;         /* libmicrohttpd's per-connection memory */
    const char *token;          /* the bearer token (borrowed); NULL: none */
    /* HTTPS: PEM texts (common/pem.h reads them; borrowed until the server
     * is freed); NULL cert: HTTP. priorities NULL: TLS_PRIORITIES_DEFAULT
     * (check the string up front with common/tls_priorities.h). */
    const char *tls_cert_pem, *tls_key_pem, *tls_priorities;
    /* Optional: a new connection is accepted only when this says MHD_YES. */
    MHD_AcceptPolicyCallback accept;
    void *accept_cls;
    /* Optional: the 404 of a path no module serves. NULL: {"error": "no such
     * path 'URL'"}. */
    enum MHD_Result (*not_found)(http_req *r);
    /* Optional: every request, when its head is in (before the framing
     * check) and when it ended (after the module's done hook). */
    void (*begin)(void *cls, http_req *r);
    void (*end)(void *cls, http_req *r, int completed_ok);
    void *cls;
} http_server_config;

/* A server that serves nothing yet (cfg is copied; what it points to is
 * borrowed). NULL with err when out of memory. */
http_server *http_server_new(const http_server_config *cfg, char *err, size_t errlen);
/* Add a module's routes (before http_server_start). -1 with err when a
 * method and path are already served, or out of memory. */
int http_server_add(http_server *s, const http_module *m, char *err, size_t errlen);
/* Start serving: the port it listens on, or -1 with err (errno as
 * libmicrohttpd left it). */
int http_server_start(http_server *s, char *err, size_t errlen);
/* The port served (after a successful start), or -1. */
int http_server_port(const http_server *s);
/* The daemon (after a successful start), for MHD calls the layer does not wrap. */
struct MHD_Daemon *http_server_daemon(http_server *s);
/* Stop serving: every connection closed (nothing may be suspended then:
 * resume them first). Safe to call twice, or without a start. */
void http_server_stop(http_server *s);
/* Stop, and free the server. NULL is fine. */
void http_server_free(http_server *s);

/* ---- in handlers ---- */

/* Request header or query argument, or NULL. */
const char *http_header(http_req *r, const char *name);
const char *http_query(http_req *r, const char *name);
/* A non-negative decimal query argument (digits only, no sign or spaces)
 * of at most max: 1 and *out, 0 absent (*out untouched), -1 malformed or
 * over max. */
int http_query_int(http_req *r, const char *name, long long max, long long *out);
/* The same for any string s (a query argument, a metadata value): 1 and
 * *out; 0 when s is NULL; -1 malformed (not digits only, or past long
 * long); -2 over max. *out is set only on 1. */
int http_parse_uint(const char *s, long long max, long long *out);

/* Answers. Each records status and bytes, sets answered, and returns what
 * MHD_queue_response did (MHD_NO when nothing could be built). */
enum MHD_Result http_reply_json(http_req *r, unsigned status, json_t *body_new);
enum MHD_Result http_reply_text(http_req *r, unsigned status, const char *content_type,
                                char *body_malloced, size_t len);
/* {"error": msg} with status; a 4xx while a jansson allocation failed in
 * the handler becomes 503 (jsonmem.h). */
enum MHD_Result http_reply_error(http_req *r, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* resp (may be NULL: MHD_NO) as status; len: its body bytes, for bytes_out. */
enum MHD_Result http_reply_response(http_req *r, unsigned status, struct MHD_Response *resp,
                                    uint64_t len);
/* A body of unknown length (chunked) that read() produces as it is sent,
 * block bytes at a time; done(cls) runs when the response is destroyed
 * (also when it cannot be built). Extra headers: name/value pairs,
 * NULL-terminated. The bytes sent are counted into bytes_out at the end. */
enum MHD_Result http_reply_stream(http_req *r, unsigned status, const char *content_type,
                                  size_t block, MHD_ContentReaderCallback read, void *cls,
                                  MHD_ContentReaderFreeCallback done, const char *const *headers);

/* ---- in before_body ---- */

/* The body goes to buf, exactly len bytes (the handler runs only when all
 * of them came: else 400; more is refused as longer than announced). */
void http_body_into(http_req *r, void *buf, size_t len);
/* Every piece of the body goes to fn(cls, data, n) as libmicrohttpd reads
 * it (data valid during the call only), within the limit and the
 * Content-Length checks; nothing is buffered and body_h stays NULL. The
 * handler runs once the whole body came; a body cut short never reaches
 * it (the module's done hook sees the end). */
void http_body_sink(http_req *r, void (*fn)(void *cls, const unsigned char *data, size_t n), void *cls);
/* Read and drop the body (up to 16 MiB, then the connection is cut), then
 * answer {"error": msg} with status. Returns MHD_YES. */
enum MHD_Result http_refuse_after_body(http_req *r, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- in a handler that keeps the body ---- */

/* The body's handle (body ops), the request's no longer: the caller
 * releases it. NULL for http_body_into bodies. */
void *http_take_body(http_req *r);

/* libmicrohttpd's unescape callback the layer installs (exposed for the
 * fuzz harness): %XX decoding that leaves %00 alone, and NULs the bytes an
 * escape freed (so that the framing check sees none hidden). */
size_t http_unescape(void *cls, struct MHD_Connection *conn, char *s);

#endif
