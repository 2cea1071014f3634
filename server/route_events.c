/* route_events.c - GET /v1/events: the task's status as Server-Sent Events.
 *
 * One long response per client, produced by a content reader: `retry: 1000`
 * at once, then an event `id: <global_step>` / `event: status` / `data:
 * <the /v1/status object on one line>` at once and whenever global_step or
 * the evaluator's report moves (history's change feed), at most one per
 * EVENTS_MIN_GAP_MS, and a `: keepalive` comment after EVENTS_KEEPALIVE_MS
 * without a write.
 *
 * No HTTP thread ever waits: a reader with nothing to send suspends its
 * connection (libmicrohttpd allows that from the content reader) and parks
 * it in psd's waiters (WAIT_FEED), which resume it when the feed's version
 * moves or its deadline (the next allowed event, the next keepalive)
 * passes; an idle client costs no CPU. waiters_wake_all resumes everyone
 * before the server stops.
 *
 * Reconnects: a client that sends Last-Event-ID equal to the current
 * global_step has seen that status, so its first event waits for the next
 * change; any other value (or none) gets the current status at once. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "jsonmem.h"
#include "history.h"
#include "routes.h"

#define EVENTS_MIN_GAP_MS 100     /* at most 10 events a second */
#define EVENTS_KEEPALIVE_MS 15000 /* a comment line after this long without a write */

typedef struct sse_client {
    server *srv;
    request *r;
    struct MHD_Connection *conn;
    char *out; /* what is still to go out: out[off..len) */
    size_t off, len;
    uint64_t seen;       /* the feed version the last event showed */
    int need_first;      /* an event is due regardless of the version */
    int64_t last_event_ms, last_write_ms;
} sse_client;

static void sse_free(void *cls)
{
    sse_client *c = cls;
    free(c->out);
    free(c);
}

/* Replace the pending output with s (malloc'd, len n). */
static void set_out(sse_client *c, char *s, size_t n)
{
    free(c->out);
    c->out = s;
    c->off = 0;
    c->len = s ? n : 0;
}

static void make_event(sse_client *c)
{
    json_t *st = status_json(c->srv);
    char *data = st ? json_dumps_checked(st, JSON_COMPACT | JSON_REAL_PRECISION(10)) : NULL;
    long long step = (long long)json_integer_value(json_object_get(st, "global_step"));
    json_decref(st);
    char *ev = NULL;
    int n = data ? asprintf(&ev, "id: %lld\nevent: status\ndata: %s\n\n", step, data) : -1;
    free(data);
    if (n < 0) /* out of memory: say so in a comment rather than end the stream */
        set_out(c, strdup(": out of memory\n\n"), 17);
    else
        set_out(c, ev, (size_t)n);
}

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    sse_client *c = cls;
    struct history *h = c->srv->history;
    for (;;) {
        if (c->off < c->len) {
            size_t n = c->len - c->off < max ? c->len - c->off : max;
            memcpy(buf, c->out + c->off, n);
            c->off += n;
            c->r->bytes_out += n;
            return (ssize_t)n;
        }
        if (waiters_stopping(c->srv->waiters))
            return MHD_CONTENT_READER_END_OF_STREAM;
        int64_t now = clk_mono_ms();
        uint64_t version = history_version(h);
        int due = c->need_first || version != c->seen;
        if (due && now - c->last_event_ms >= EVENTS_MIN_GAP_MS) {
            c->seen = version; /* read before the status: a change while it is built is not lost */
            c->need_first = 0;
            make_event(c);
            c->last_event_ms = c->last_write_ms = now;
            continue;
        }
        if (now - c->last_write_ms >= EVENTS_KEEPALIVE_MS) {
            set_out(c, strdup(": keepalive\n\n"), 13);
            c->last_write_ms = now;
            continue;
        }
        /* nothing to send yet: wait for a change (a version past the one
         * seen; or, when one is due but too soon, only for the gap to pass),
         * at most until the keepalive */
        int64_t deadline = c->last_write_ms + EVENTS_KEEPALIVE_MS;
        int64_t until = (int64_t)c->seen + 1;
        if (due) {
            until = INT64_MAX;
            if (c->last_event_ms + EVENTS_MIN_GAP_MS < deadline)
                deadline = c->last_event_ms + EVENTS_MIN_GAP_MS;
        }
        if (waiters_park(c->srv->waiters, WAIT_FEED, c->conn, until, deadline))
            return 0; /* suspended: called again once resumed */
    }
}

enum MHD_Result h_events(request *r)
{
    server *srv = req_srv(r);
    if (strcmp(r->method, "HEAD") == 0) {
        /* the headers of the stream, without one */
        struct MHD_Response *resp = MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT);
        if (!resp)
            return MHD_NO;
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
        r->status = MHD_HTTP_OK;
        enum MHD_Result rc = MHD_queue_response(r->conn, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp);
        r->answered = 1;
        return rc;
    }
    sse_client *c = calloc(1, sizeof(*c));
    if (!c)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    c->srv = srv;
    c->r = r;
    c->conn = r->conn;
    c->need_first = 1;
    c->seen = history_version(srv->history);
    const char *last = http_header(r, "Last-Event-ID");
    if (last && *last >= '0' && *last <= '9') {
        char *end;
        errno = 0;
        long long id = strtoll(last, &end, 10);
        if (!*end && !errno && id == store_global_step(&srv->store))
            c->need_first = 0; /* seen already: wait for the next change */
    }
    int64_t now = clk_mono_ms();
    c->last_event_ms = now - EVENTS_MIN_GAP_MS;
    c->last_write_ms = now;
    c->out = strdup("retry: 1000\n\n");
    c->len = c->out ? 13 : 0;
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_read, c, sse_free);
    if (!resp) {
        sse_free(c);
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no"); /* nginx: pass events at once */
    r->status = MHD_HTTP_OK;
    enum MHD_Result rc = MHD_queue_response(r->conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    r->answered = 1;
    return rc;
}
