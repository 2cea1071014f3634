/* request.h - psd's request: the endpoint layer's (common/http_server.h:
 * route, {name}, body, status, bytes) with psd's own state beside it (ext:
 * a parked long poll, a queued save), and the answer built from blobs
 * without a copy (reply_blobs.c). The helpers never exit: a failure to
 * build a response is logged and libmicrohttpd closes the connection. */
#ifndef RESTPS_REQUEST_H
#define RESTPS_REQUEST_H

#include <jansson.h>
#include <microhttpd.h>
#include <stdint.h>

#include "bufpool.h"
#include "http_server.h"
#include "server.h"

typedef http_req request;

/* The largest step or clock a request may carry (query or metadata): exact
 * in JSON (2^53), and far from INT64_MAX, so step and clock arithmetic
 * cannot overflow. */
#define META_INT_MAX (1LL << 53)

/* What psd keeps per request (the module's ext_size bytes at r->ext). */
typedef struct psd_req {
    int parked;                /* suspended in a long poll or a save */
    int resumed;               /* set by the waiters when it is resumed */
    struct waiters *parked_on; /* which waiters hold it (long polls on step or clock) */
    int saver_job;             /* a requested save queued under conn, not collected yet */
    int push_outcome;          /* POST /v1/grads?return=params parked: what became of the push */
    struct push_stream *stream; /* POST /v1/grads applied as it arrives (push_stream.h), or NULL */
    int arriving;              /* counted in store_push_arriving until the request ends */
} psd_req;

/* The server every psd route's handler serves for (the module's context). */
static inline server *req_srv(const request *r) { return (server *)r->ctx; }
/* psd's state of a routed request. */
static inline psd_req *req_psd(const request *r) { return (psd_req *)r->ext; }
/* The body of a body route: a blob from the server's pool (len: the bytes in). */
static inline blob *req_body(const request *r) { return (blob *)r->body_h; }

/* The body as a JSON object (duplicate keys refused); NULL with err ("body
 * is not JSON: ...", "body must be a JSON object"). */
json_t *req_body_json(request *r, char *err, size_t errlen);
/* A number field of a JSON object: 0 absent, 1 *out, -1 present but not a number. */
int body_number(json_t *o, const char *key, double *out);
/* The "worker" field of {"worker": index} (o may be NULL): 0 to
 * STORE_MAX_WORKERS - 1, or -1 when it is missing or not such an integer. */
int body_worker(json_t *o);

/* Answer with the concatenation of parts; takes one reference to each blob in
 * `hold` (released when the response is destroyed) and ownership of `head`
 * (malloc'd, may be NULL). Extra headers: pairs in `headers`, NULL-terminated. */
struct http_part {
    const void *base;
    size_t len;
};
enum MHD_Result reply_blobs(request *r, unsigned status, const char *content_type, char *head,
                            size_t head_len, const struct http_part *parts, int n_parts, blob **hold,
                            int n_hold, const char *const *headers);

#endif
