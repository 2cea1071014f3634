/* routes.c - the route table and the checks every request passes first. */
#include "routes.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "auth.h"
#include "clock.h"
#include "conntrack.h"
#include "endpoint.h"
#include "jsonmem.h"
#include "log.h"
#include "metrics.h"
#include "saver.h"

#include <time.h>

static const route routes[] = {
    {"GET", "/", 0, NULL, h_web, "the monitoring page"},
    {"GET", "/app.js", 0, NULL, h_web, "the monitoring page's script"},
    {"GET", "/style.css", 0, NULL, h_web, "the monitoring page's style sheet"},
    {"GET", "/healthz", ROUTE_OPEN, NULL, h_healthz, "liveness"},
    {"GET", "/metrics", 0, NULL, h_metrics, "Prometheus text exposition"},
    {"GET", "/v1/history", 0, NULL, h_history, "global_step and loss over time"},
    {"GET", "/v1/events", 0, NULL, h_events, "live status as Server-Sent Events"},
    {"GET", "/readyz", ROUTE_OPEN, NULL, h_readyz, "200 once the chief initialized the variables"},
    {"GET", "/v1/status", 0, NULL, h_status, "task status"},
    {"GET", "/v1/vars", 0, NULL, h_vars_list, "list variables"},
    {"GET", "/v1/vars/{name}", 0, NULL, h_var_get, "read a variable"},
    {"PUT", "/v1/vars/{name}", ROUTE_WRITE | ROUTE_BODY, h_var_put_check, h_var_put,
     "create or replace a variable"},
    {"GET", "/v1/vars/{name}/stats", 0, NULL, h_var_stats, "summary statistics"},
    {"POST", "/v1/vars/{name}/grad", ROUTE_WRITE | ROUTE_BODY, h_var_grad_check, h_var_grad,
     "apply a gradient to one variable"},
    {"GET", "/v1/params", 0, NULL, h_params_get, "every variable, one safetensors body"},
    {"POST", "/v1/grads", ROUTE_WRITE | ROUTE_BODY, NULL, h_grads_post,
     "apply gradients from one safetensors body"},
    {"GET", "/v1/config", 0, NULL, h_config_get, "the training configuration"},
    {"PUT", "/v1/config", ROUTE_WRITE | ROUTE_BODY, NULL, h_config_put,
     "set the training configuration (the chief)"},
    {"POST", "/v1/eval", ROUTE_WRITE | ROUTE_BODY, NULL, h_eval_post, "the evaluator's report"},
    {"POST", "/v1/done", ROUTE_WRITE | ROUTE_BODY, NULL, h_done_post, "a worker finished"},
    {"GET", "/v1/checkpoint", 0, NULL, h_checkpoint_get, "the newest checkpoint file"},
    {"POST", "/v1/checkpoint", ROUTE_WRITE, NULL, h_checkpoint_post, "save a checkpoint now"},
    {"GET", "/v1/placement", 0, NULL, h_placement_get, "where every variable lives"},
    {"PUT", "/v1/placement", ROUTE_WRITE | ROUTE_BODY, NULL, h_placement_put,
     "the chief's placement map"},
    {"GET", "/v1/sync", 0, NULL, h_sync, "the sync step in progress: gradients in, workers waited for"},
    {"POST", "/v1/heartbeat", ROUTE_WRITE | ROUTE_BODY, NULL, h_heartbeat,
     "a worker renews its lease"},
    {"POST", "/v1/shutdown", ROUTE_WRITE, NULL, h_shutdown_post, "stop this ps task"},
};
#define N_ROUTES (sizeof(routes) / sizeof(routes[0]))

void routes_print(FILE *out)
{
    for (size_t i = 0; i < N_ROUTES; i++)
        fprintf(out, "%s %s%s%s\n", routes[i].method, routes[i].path,
                routes[i].flags & ROUTE_WRITE ? " write" : "",
                routes[i].flags & ROUTE_OPEN ? " open" : "");
}

/* Turn a URL path into its table pattern; {name} goes to name_out (raw, may
 * be invalid or too long: name_ok says). NULL when nothing matches. */
static const char *pattern_of(const char *url, char *name_out, size_t name_cap, int *name_ok)
{
    static const char prefix[] = "/v1/vars/";
    *name_ok = 1;
    if (strncmp(url, prefix, sizeof(prefix) - 1) != 0)
        return url;
    const char *rest = url + sizeof(prefix) - 1;
    size_t n = strlen(rest);
    const char *pattern = "/v1/vars/{name}";
    static const struct {
        const char *suffix, *pattern;
    } subs[] = {{"/stats", "/v1/vars/{name}/stats"}, {"/grad", "/v1/vars/{name}/grad"}};
    for (size_t i = 0; i < 2; i++) {
        size_t sl = strlen(subs[i].suffix);
        if (n >= sl && strcmp(rest + n - sl, subs[i].suffix) == 0) {
            n -= sl;
            pattern = subs[i].pattern;
            break;
        }
    }
    if (n == 0 || n >= name_cap) {
        *name_ok = 0;
        n = n >= name_cap ? name_cap - 1 : n;
    }
    memcpy(name_out, rest, n);
    name_out[n] = '\0';
    return pattern;
}

static enum MHD_Result refuse_method(request *r, const char *pattern)
{
    char allow[64] = "";
    for (size_t i = 0; i < N_ROUTES; i++)
        if (strcmp(routes[i].path, pattern) == 0) {
            size_t l = strlen(allow);
            snprintf(allow + l, sizeof(allow) - l, "%s%s%s", l ? ", " : "", routes[i].method,
                     strcmp(routes[i].method, "GET") == 0 ? ", HEAD" : "");
        }
    char *msg = NULL;
    if (asprintf(&msg, "{\"error\":\"method %s not allowed on %s (allowed: %s)\"}\n", r->method,
                 pattern, allow) < 0)
        return MHD_NO;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(msg), msg, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(msg);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    r->status = MHD_HTTP_METHOD_NOT_ALLOWED;
    r->bytes_out = strlen(msg);
    enum MHD_Result rc = MHD_queue_response(r->conn, MHD_HTTP_METHOD_NOT_ALLOWED, resp);
    MHD_destroy_response(resp);
    r->answered = 1;
    return rc;
}

/* Counts the Content-Length headers into *cls. */
static enum MHD_Result count_content_length(void *cls, enum MHD_ValueKind kind, const char *key,
                                            const char *value)
{
    (void)kind;
    (void)value;
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0)
        ++*(int *)cls;
    return MHD_YES;
}

/* An upload's buffer starts at UPLOAD_FIRST bytes and grows as they arrive. */
#define UPLOAD_FIRST ((size_t)64 * 1024)
#define UPLOAD_GROWTH 8

/* Checks that need only the request line and headers. */
static enum MHD_Result on_headers(request *r, const char *url)
{
    server *srv = r->srv;
    int name_ok;
    const char *pattern = pattern_of(url, r->name, sizeof(r->name), &name_ok);
    int known = 0;
    const char *m = strcmp(r->method, "HEAD") == 0 ? "GET" : r->method;
    for (size_t i = 0; i < N_ROUTES; i++) {
        if (strcmp(routes[i].path, pattern) != 0)
            continue;
        known = 1;
        if (strcmp(routes[i].method, m) == 0)
            r->route = &routes[i];
    }
    if (!known)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no such path '%.200s'", url);
    if (!r->route)
        return refuse_method(r, pattern);
    const route *rt = r->route;

    /* The token first: no one learns anything else without it. */
    int needs_token = srv->cfg.auth_token && !(rt->flags & ROUTE_OPEN) &&
                      ((rt->flags & ROUTE_WRITE) || srv->cfg.auth_reads);
    if (needs_token && !auth_check(srv->cfg.auth_token, http_header(r, "Authorization")))
        return http_reply_error(r, MHD_HTTP_UNAUTHORIZED,
                                "missing or wrong bearer token for %s %s", r->method, rt->path);
    if (strstr(rt->path, "{name}")) {
        char err[256];
        if (!name_ok)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "variable name must be 1 to %d characters",
                                    TENSOR_NAME_MAX);
        if (tensor_name_check(r->name, err, sizeof(err)) != 0)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    }
    r->expect_len = UINT64_MAX;
    if (rt->flags & ROUTE_BODY) {
        const char *cl = http_header(r, MHD_HTTP_HEADER_CONTENT_LENGTH);
        const char *te = http_header(r, MHD_HTTP_HEADER_TRANSFER_ENCODING);
        /* two lengths: which one frames the body is a guess (request smuggling) */
        int n_cl = 0;
        MHD_get_connection_values(r->conn, MHD_HEADER_KIND, count_content_length, &n_cl);
        if (n_cl > 1)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "more than one Content-Length header");
        /* libmicrohttpd reads chunked only; another coding left it waiting for a body forever */
        if (te && strcasecmp(te, "chunked") != 0)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                    "Transfer-Encoding '%.40s' is not supported: send chunked or a Content-Length", te);
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long v = strtoull(cl, &end, 10);
            if (*cl < '0' || *cl > '9' || *end != '\0' || errno)
                return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "bad Content-Length '%.40s'", cl);
            if (v > srv->cfg.max_body_bytes)
                return http_reply_error(r, MHD_HTTP_CONTENT_TOO_LARGE,
                                        "body of %llu bytes is over the limit of %llu (--max_body_bytes)",
                                        v, (unsigned long long)srv->cfg.max_body_bytes);
            r->expect_len = v;
        }
        if (rt->before_body) {
            enum MHD_Result rc = rt->before_body(r);
            if (rc != MHD_YES || r->answered)
                return rc;
        }
        /* the buffer grows as the bytes arrive (on_upload): a head that
         * announces 1 GiB and sends nothing reserves 64 KiB, not 1 GiB */
        size_t first = r->expect_len < UPLOAD_FIRST ? (size_t)r->expect_len : UPLOAD_FIRST;
        if (first > srv->cfg.max_body_bytes)
            first = (size_t)srv->cfg.max_body_bytes;
        r->body = blob_new(srv->pool, first);
        if (!r->body)
            return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE,
                                    "out of memory for a body of %zu bytes", first);
        r->body->len = 0;
    }
    return MHD_YES;
}

/* A refusal found mid-upload cannot be queued before the upload ends
 * (libmicrohttpd refuses a response then): drop the body, swallow the rest,
 * answer at the end. A client that keeps sending past DISCARD_MAX is cut off. */
#define DISCARD_MAX ((uint64_t)16 << 20)
static enum MHD_Result refuse_later(request *r, unsigned status, const char *msg)
{
    r->discard = 1;
    r->discard_status = status;
    snprintf(r->discard_msg, sizeof(r->discard_msg), "%s", msg);
    blob_unref(r->body);
    r->body = NULL;
    return MHD_YES;
}

static enum MHD_Result on_upload(request *r, const char *data, size_t size)
{
    if (r->discard) {
        r->discarded += size;
        return r->discarded > DISCARD_MAX ? MHD_NO : MHD_YES;
    }
    if (r->answered || !r->body)
        return MHD_YES; /* discard what follows a refusal */
    uint64_t have = r->body->len;
    if (have + size > r->srv->cfg.max_body_bytes) {
        char msg[160];
        snprintf(msg, sizeof(msg), "body is over the limit of %llu bytes (--max_body_bytes)",
                 (unsigned long long)r->srv->cfg.max_body_bytes);
        return refuse_later(r, MHD_HTTP_CONTENT_TOO_LARGE, msg);
    }
    if (r->expect_len != UINT64_MAX && have + size > r->expect_len) {
        char msg[160];
        snprintf(msg, sizeof(msg), "body is longer than the %llu bytes expected (Content-Length or X-Shape)",
                 (unsigned long long)r->expect_len);
        return refuse_later(r, MHD_HTTP_BAD_REQUEST, msg);
    }
    if (have + size > r->body->cap) {
        /* 8x what has arrived, up to the length announced: a few copies of
         * a small part of the body, and never much more reserved than sent */
        uint64_t want = (have + size) * UPLOAD_GROWTH;
        if (r->expect_len != UINT64_MAX && want > r->expect_len)
            want = r->expect_len;
        if (want > r->srv->cfg.max_body_bytes)
            want = r->srv->cfg.max_body_bytes;
        blob *g = blob_grow(r->body, (size_t)want);
        if (g)
            g->len = have; /* blob_grow set it to want */
        if (!g)
            return refuse_later(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory for the body");
        r->body = g;
    }
    memcpy(r->body->data + have, data, size);
    r->body->len = have + size;
    return MHD_YES;
}

/* Every byte resets libmicrohttpd's idle timeout, so a body sent a byte a
 * second would hold its connection for ever: after the first
 * --connection_timeout seconds a body must average BODY_MIN_RATE bytes a
 * second, or the connection is closed. */
#define BODY_MIN_RATE 1024
static int body_too_slow(const request *r)
{
    uint64_t now = clk_mono_ns();
    uint64_t secs = now > r->t_start_ns ? (now - r->t_start_ns) / 1000000000u : 0;
    return secs >= (uint64_t)r->srv->cfg.conn_timeout_secs && r->bytes_in < secs * BODY_MIN_RATE;
}

enum MHD_Result routes_access(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_data_size, void **req_cls)
{
    request *r = *req_cls;
    if (!r) {
        r = calloc(1, sizeof(*r));
        if (!r)
            return MHD_NO;
        r->srv = cls;
        r->conn = conn;
        r->method = method;
        r->url = url;
        r->t_start_ns = clk_mono_ns();
        *req_cls = r;
        atomic_fetch_add(&r->srv->in_flight, 1);
        conntrack_request_begins(conn);
        r->json_fail_mark = json_failed_allocs();
        char msg[ENDPOINT_ERROR_MAX];
        unsigned bad = endpoint_check_framing(conn, method, url, version, msg, sizeof(msg));
        if (bad) {
            r->status = bad;
            r->answered = 1;
            return endpoint_reply_close(conn, bad, msg);
        }
        /* Refusals go out at once, before any body is read; an accepted
         * request is answered on a later call (libmicrohttpd 0.9.75 closes
         * the connection when a success is queued on the first call). */
        return on_headers(r, url);
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        r->bytes_in += n;
        *upload_data_size = 0;
        if (body_too_slow(r)) {
            log_info("psd: %s %s: the body trickles in (%llu bytes so far): closing the connection",
                     r->method, r->route ? r->route->path : "?", (unsigned long long)r->bytes_in);
            return MHD_NO;
        }
        return on_upload(r, upload_data, n);
    }
    if (r->answered)
        return MHD_YES;
    if (r->discard)
        return http_reply_error(r, r->discard_status, "%s", r->discard_msg);
    r->json_fail_mark = json_failed_allocs();
    return r->route->handle(r);
}

void routes_completed(void *cls, struct MHD_Connection *conn, void **req_cls,
                      enum MHD_RequestTerminationCode toe)
{
    server *srv = cls;
    request *r = *req_cls;
    conntrack_request_ends(conn);
    if (!r)
        return;
    if (r->parked && !r->resumed && r->parked_on)
        waiters_remove(r->parked_on, r->conn);
    if (r->saver_job && srv->saver) /* POST /v1/checkpoint whose client left */
        saver_forget(srv->saver, r->conn);
    http_request_done(r); /* a streamed answer's bytes, for the metrics */
    metrics_observe(srv->metrics, r, toe == MHD_REQUEST_TERMINATED_COMPLETED_OK);
    blob_unref(r->body);
    free(r);
    *req_cls = NULL;
    atomic_fetch_add(&srv->requests, 1);
    atomic_fetch_sub(&srv->in_flight, 1);
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

size_t routes_unescape(void *cls, struct MHD_Connection *conn, char *s)
{
    (void)cls;
    (void)conn;
    /* %XX decoding, except %00: a NUL would cut the string short (and a name
     * "w%00zz" would reach "w"); left as it is, the '%' makes it invalid. */
    char *w = s;
    const char *r = s;
    while (*r) {
        int hi, lo;
        if (r[0] == '%' && (hi = hexval(r[1])) >= 0 && (lo = hexval(r[2])) >= 0 && (hi | lo)) {
            *w++ = (char)(hi * 16 + lo);
            r += 3;
        } else {
            *w++ = *r++;
        }
    }
    /* what the escapes freed is NULs, not stale bytes: the endpoint layer
     * refuses a head holding bytes no parsed string covers */
    memset(w, 0, (size_t)(r - w) + 1);
    return (size_t)(w - s);
}
