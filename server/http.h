/* http.h - one request's state, and the helpers every handler answers with
 * (JSON, errors, blobs). The helpers never exit: a failure to build a
 * response is logged and the connection is closed by libmicrohttpd. */
#ifndef RESTPS_HTTP_H
#define RESTPS_HTTP_H

#include <jansson.h>
#include <microhttpd.h>
#include <stdint.h>

#include "bufpool.h"
#include "server.h"

struct route;

typedef struct request {
    server *srv;
    struct MHD_Connection *conn;
    const struct route *route;
    const char *method;
    char name[TENSOR_NAME_MAX + 1]; /* {name} in the path, when the route has one */
    blob *body;                     /* the upload, read straight into one buffer */
    uint64_t expect_len;            /* from Content-Length; UINT64_MAX when absent */
    int answered;                   /* a response is queued */
    int discard;                    /* swallow the rest of the upload, then answer with: */
    unsigned discard_status;
    char discard_msg[200];
    uint64_t discarded;
    const char *url;                /* the path as requested (valid for the request's life) */
    uint64_t t_start_ns;            /* CLOCK_MONOTONIC when the headers were in */
    unsigned status;                /* the status answered (0 until then) */
    uint64_t bytes_in, bytes_out;   /* body bytes received and answered */
    int parked;                     /* suspended in a long poll */
    int resumed;                    /* set by the waiters when it is resumed */
    struct waiters *parked_on;      /* which waiters hold it (long polls on step or clock) */
    unsigned long json_fail_mark;   /* json_failed_allocs() when the handler was called */
} request;

/* HTTPS (--tls_cert): the GnuTLS priority string psd serves with unless
 * --tls_priorities names another. TLS 1.3 and 1.2 only; AEAD suites only
 * (AES-GCM, then ChaCha20-Poly1305), ECDHE key exchange; and the server's
 * order wins. libmicrohttpd's own default took TLS 1.0/1.1, CBC/SHA-1 and RSA
 * key exchange, and followed the client's order: a client listing ChaCha20
 * first got it, and GnuTLS 3.7's ChaCha20-Poly1305 runs at 0.29 GB/s on this
 * kind of CPU against 4.9 GB/s for AES-128-GCM (gnutls-cli
 * --benchmark-ciphers): one step's push + pull of 16 MiB went 2.7x slower. */
#define HTTP_TLS_PRIORITIES                                                                 \
    "NORMAL:-VERS-ALL:+VERS-TLS1.3:+VERS-TLS1.2:-CIPHER-ALL:+AES-256-GCM:+AES-128-GCM:"     \
    "+CHACHA20-POLY1305:-MAC-ALL:+AEAD:-KX-ALL:+ECDHE-ECDSA:+ECDHE-RSA:%SERVER_PRECEDENCE"

/* Request header or query argument, or NULL. */
const char *http_header(request *r, const char *name);
const char *http_query(request *r, const char *name);

enum MHD_Result http_reply_json(request *r, unsigned status, json_t *body_new);
enum MHD_Result http_reply_text(request *r, unsigned status, const char *content_type,
                                char *body_malloced, size_t len);
/* {"error": msg} with status. */
enum MHD_Result http_reply_error(request *r, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Answer with the concatenation of parts; takes one reference to each blob in
 * `hold` (released when the response is destroyed) and ownership of `head`
 * (malloc'd, may be NULL). Extra headers: pairs in `headers`, NULL-terminated. */
struct http_part {
    const void *base;
    size_t len;
};
enum MHD_Result http_reply_parts(request *r, unsigned status, const char *content_type,
                                 char *head, size_t head_len, const struct http_part *parts,
                                 int n_parts, blob **hold, int n_hold,
                                 const char *const *headers);

#endif
