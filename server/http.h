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
    int saver_job;                  /* a requested save queued under conn, not collected yet */
    unsigned long json_fail_mark;   /* json_failed_allocs() when the handler was called */
    struct http_counter *streamed;  /* what a streamed answer sent so far (http_reply_stream) */
} request;

/* HTTPS (--tls_cert): psd's default GnuTLS priority string is
 * TLS_PRIORITIES_DEFAULT in common/tls_priorities.h (the ring's too). */

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

/* Answer with a body of unknown length (chunked) that read() produces as it
 * is sent, block bytes at a time; done(cls) runs when the response is
 * destroyed (also when it cannot be built). Extra headers as above. The
 * bytes it sends are counted into bytes_out by http_request_done. */
enum MHD_Result http_reply_stream(request *r, unsigned status, const char *content_type,
                                  size_t block, MHD_ContentReaderCallback read, void *cls,
                                  MHD_ContentReaderFreeCallback done, const char *const *headers);
/* The request is over (its completion callback): a streamed answer's bytes
 * go into bytes_out. */
void http_request_done(request *r);

#endif
