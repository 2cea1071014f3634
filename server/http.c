/* http.c - psd's response helpers: common/endpoint.h's replies, recorded in
 * the request's state (status, bytes, answered) for the metrics, and
 * answers built from blobs without a copy. */
#include "http.h"

#include "endpoint.h"
#include "jsonmem.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

const char *http_header(request *r, const char *name)
{
    return MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, name);
}

const char *http_query(request *r, const char *name)
{
    return MHD_lookup_connection_value(r->conn, MHD_GET_ARGUMENT_KIND, name);
}

static enum MHD_Result queue(request *r, unsigned status, struct MHD_Response *resp)
{
    if (!resp) {
        log_error("psd: cannot build a response for %s %s", r->method, r->name);
        return MHD_NO;
    }
    r->status = status;
    enum MHD_Result rc = endpoint_queue(r->conn, status, resp);
    r->answered = 1;
    return rc;
}

enum MHD_Result http_reply_text(request *r, unsigned status, const char *content_type,
                                char *body, size_t len)
{
    struct MHD_Response *resp = endpoint_text_response(body, len, content_type);
    if (resp)
        r->bytes_out = len;
    return queue(r, status, resp);
}

enum MHD_Result http_reply_json(request *r, unsigned status, json_t *body)
{
    /* a jansson allocation failed while the handler built it: some
     * json_object_set went missing, so the document may lack a member */
    if (json_failed_allocs() != r->json_fail_mark && status != MHD_HTTP_SERVICE_UNAVAILABLE) {
        json_decref(body);
        r->json_fail_mark = json_failed_allocs();
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory building the answer");
    }
    size_t n;
    char *s = endpoint_json_text(body, &n);
    if (!s)
        return queue(r, status, NULL);
    return http_reply_text(r, status, "application/json", s, n);
}

enum MHD_Result http_reply_error(request *r, unsigned status, const char *fmt, ...)
{
    /* jansson calls some failed allocations syntax errors (jsonmem.h): not
     * the client's fault */
    if (status >= 400 && status < 500 && json_failed_allocs() != r->json_fail_mark)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    char msg[ENDPOINT_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    endpoint_error_message(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return http_reply_json(r, status, json_pack("{s:s}", "error", msg));
}

typedef struct parts_ctx {
    char *head;
    int n_hold;
    blob *hold[];
} parts_ctx;

static void parts_free(void *cls)
{
    parts_ctx *c = cls;
    for (int i = 0; i < c->n_hold; i++)
        blob_unref(c->hold[i]);
    free(c->head);
    free(c);
}

enum MHD_Result http_reply_parts(request *r, unsigned status, const char *content_type,
                                 char *head, size_t head_len, const struct http_part *parts,
                                 int n_parts, blob **hold, int n_hold,
                                 const char *const *headers)
{
    parts_ctx *c = malloc(sizeof(*c) + sizeof(blob *) * (size_t)n_hold);
    struct MHD_IoVec *iov = malloc(sizeof(*iov) * (size_t)(n_parts + 1));
    if (!c || !iov) {
        free(c);
        free(iov);
        free(head);
        return http_reply_error(r, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory");
    }
    c->head = head;
    c->n_hold = n_hold;
    for (int i = 0; i < n_hold; i++)
        c->hold[i] = blob_ref(hold[i]);
    int k = 0;
    r->bytes_out = head_len;
    for (int i = 0; i < n_parts; i++)
        r->bytes_out += parts[i].len;
    if (head && head_len) {
        iov[k].iov_base = head;
        iov[k++].iov_len = head_len;
    }
    for (int i = 0; i < n_parts; i++)
        if (parts[i].len) {
            iov[k].iov_base = parts[i].base;
            iov[k++].iov_len = parts[i].len;
        }
    struct MHD_Response *resp = MHD_create_response_from_iovec(iov, (unsigned)k, parts_free, c);
    free(iov);
    if (!resp) {
        parts_free(c);
        return queue(r, status, NULL);
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    for (int i = 0; headers && headers[i]; i += 2)
        MHD_add_response_header(resp, headers[i], headers[i + 1]);
    return queue(r, status, resp);
}

/* Shared by a request and its streamed answer, which may outlive it. */
struct http_counter {
    atomic_int refs;
    atomic_ullong n;
};

static void counter_unref(struct http_counter *c)
{
    if (c && atomic_fetch_sub(&c->refs, 1) == 1)
        free(c);
}

typedef struct stream_ctx {
    MHD_ContentReaderCallback read;
    void *cls;
    MHD_ContentReaderFreeCallback done;
    struct http_counter *count;
} stream_ctx;

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    stream_ctx *s = cls;
    ssize_t n = s->read(s->cls, pos, buf, max);
    if (n > 0)
        atomic_fetch_add(&s->count->n, (unsigned long long)n);
    return n;
}

static void stream_free(void *cls)
{
    stream_ctx *s = cls;
    s->done(s->cls);
    counter_unref(s->count);
    free(s);
}

enum MHD_Result http_reply_stream(request *r, unsigned status, const char *content_type,
                                  size_t block, MHD_ContentReaderCallback read, void *cls,
                                  MHD_ContentReaderFreeCallback done, const char *const *headers)
{
    stream_ctx *s = malloc(sizeof(*s));
    struct http_counter *c = calloc(1, sizeof(*c));
    if (!s || !c || r->streamed) {
        free(s);
        free(c);
        done(cls);
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    }
    atomic_store(&c->refs, 2);
    *s = (stream_ctx){read, cls, done, c};
    r->streamed = c;
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, block, stream_read, s, stream_free);
    if (!resp) {
        stream_free(s);
        return queue(r, status, NULL);
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    for (int i = 0; headers && headers[i]; i += 2)
        MHD_add_response_header(resp, headers[i], headers[i + 1]);
    return queue(r, status, resp);
}

void http_request_done(request *r)
{
    if (r->streamed) {
        r->bytes_out = atomic_load(&r->streamed->n);
        counter_unref(r->streamed);
        r->streamed = NULL;
    }
}
