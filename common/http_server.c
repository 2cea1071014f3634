/* http_server.c - the one HTTP(S) endpoint layer: route tables of several
 * modules on one libmicrohttpd daemon, the checks before a handler, body
 * reading with limits, the replies (http_server.h). */
#include "http_server.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "clock.h"
#include "conntrack.h"
#include "endpoint.h"
#include "jsonmem.h"
#include "log.h"
#include "tls_priorities.h"
#include "token.h"

struct http_server {
    http_server_config cfg;
    char name[64];
    /* the layer's log lines begin with this: the program, then the
     * server's name when it says more ("psd"; "workerd: ring endpoint") */
    char logname[128];
    http_module *mods;
    size_t n_mods;
    size_t ext_max;
    struct sockaddr_storage addr;
    int has_addr;
    struct MHD_Daemon *d;
    struct conntrack *conns;
    int port;
    int fd_given; /* cfg.listen_fd not yet handed to a daemon */
};

/* What a streamed answer sent: shared by a request and its response, which
 * may outlive it. */
struct http_counter {
    atomic_int refs;
    atomic_ullong n;
};

/* An upload's buffer starts at UPLOAD_FIRST bytes and grows as they arrive:
 * 8x what came, and to the whole announced length once UPLOAD_WHOLE bytes
 * and at least 1/UPLOAD_AHEAD of it came (a 64 MiB body is copied twice, 64
 * KiB and 512 KiB, not up to 32 MiB). So a sender never has more than
 * UPLOAD_AHEAD x what it sent reserved: one that announces --max_body_bytes
 * of 1 GiB, sends 2 MiB and stalls holds 16 MiB, not 1 GiB. */
#define UPLOAD_FIRST ((size_t)64 * 1024)
#define UPLOAD_GROWTH 8
#define UPLOAD_WHOLE ((uint64_t)512 * 1024)
#define UPLOAD_AHEAD 128
/* A refused upload is swallowed up to this, then the connection is cut. */
#define DISCARD_MAX ((uint64_t)16 << 20)
/* Where a request's extension state starts: aligned for any type. */
#define REQ_SIZE ((sizeof(http_req) + 15) & ~(size_t)15)

/* ---- the default body storage: malloc ---- */

static void *mem_alloc(void *cls, size_t cap, unsigned char **data, size_t *got)
{
    (void)cls;
    unsigned char *p = malloc(cap ? cap : 1);
    *data = p;
    *got = p ? cap : 0;
    return p;
}

static void *mem_grow(void *cls, void *h, size_t used, size_t cap, unsigned char **data, size_t *got)
{
    (void)cls;
    (void)used;
    unsigned char *p = realloc(h, cap ? cap : 1);
    if (!p)
        return NULL;
    *data = p;
    *got = cap;
    return p;
}

static void mem_release(void *cls, void *h)
{
    (void)cls;
    free(h);
}

static const http_body_ops mem_ops = {mem_alloc, mem_grow, NULL, mem_release, NULL};

static const http_body_ops *body_ops(const http_req *r)
{
    return r->module && r->module->body ? r->module->body : &mem_ops;
}

/* ---- the server ---- */

http_server *http_server_new(const http_server_config *cfg, char *err, size_t errlen)
{
    http_server *s = calloc(1, sizeof(*s));
    if (!s) {
        snprintf(err, errlen, "out of memory for an HTTP server");
        return NULL;
    }
    s->cfg = *cfg;
    snprintf(s->name, sizeof(s->name), "%s", cfg->name ? cfg->name : "http");
    s->cfg.name = s->name;
    const char *prog = cfg->program && *cfg->program ? cfg->program : program_invocation_short_name;
    if (!prog || !*prog)
        prog = s->name;
    if (strcmp(prog, s->name) == 0)
        snprintf(s->logname, sizeof(s->logname), "%s", prog);
    else
        snprintf(s->logname, sizeof(s->logname), "%.60s: %s", prog, s->name);
    s->cfg.program = NULL; /* borrowed: the copy in logname is what is kept */
    s->port = -1;
    s->fd_given = cfg->listen_fd >= 0;
    if (cfg->listen_fd < 0 && cfg->bind_addr) {
        size_t n = cfg->bind_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                          : sizeof(struct sockaddr_in);
        memcpy(&s->addr, cfg->bind_addr, n);
        s->has_addr = 1;
    }
    s->cfg.bind_addr = NULL;
    return s;
}

static int same_route(const http_route *a, const http_route *b)
{
    return strcmp(a->method, b->method) == 0 && strcmp(a->path, b->path) == 0;
}

int http_server_add(http_server *s, const http_module *m, char *err, size_t errlen)
{
    if (s->d) {
        snprintf(err, errlen, "%s: routes are added before the server starts", s->name);
        return -1;
    }
    for (size_t i = 0; i < m->n_routes; i++) {
        const http_route *rt = &m->routes[i];
        if (strstr(rt->path, "{name}") != strrchr(rt->path, '{')) {
            snprintf(err, errlen, "%s: route %s %s has more than one {name}", s->name, rt->method, rt->path);
            return -1;
        }
        for (size_t j = 0; j < s->n_mods; j++)
            for (size_t k = 0; k < s->mods[j].n_routes; k++)
                if (same_route(rt, &s->mods[j].routes[k])) {
                    snprintf(err, errlen, "%s: %s %s is served by %s already", s->name, rt->method,
                             rt->path, s->mods[j].name ? s->mods[j].name : "another module");
                    return -1;
                }
    }
    http_module *mods = realloc(s->mods, (s->n_mods + 1) * sizeof(*mods));
    if (!mods) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    s->mods = mods;
    s->mods[s->n_mods++] = *m;
    if (m->ext_size > s->ext_max)
        s->ext_max = m->ext_size;
    return 0;
}

/* ---- routing ---- */

/* How well url matches pattern: -1 not at all, INT32_MAX exactly, else the
 * length of the text after {name} (longer wins). The name goes to name. */
static long match(const char *url, const char *pattern, char *name, int *name_ok)
{
    const char *brace = strstr(pattern, "{name}");
    if (!brace)
        return strcmp(url, pattern) == 0 ? INT32_MAX : -1;
    size_t plen = (size_t)(brace - pattern), n = strlen(url);
    const char *suffix = brace + 6;
    size_t slen = strlen(suffix);
    if (n < plen + slen || strncmp(url, pattern, plen) != 0 || strcmp(url + n - slen, suffix) != 0)
        return -1;
    size_t len = n - plen - slen;
    *name_ok = len > 0 && len <= HTTP_NAME_MAX;
    if (len > HTTP_NAME_MAX)
        len = HTTP_NAME_MAX;
    memcpy(name, url + plen, len);
    name[len] = '\0';
    return (long)slen;
}

/* The pattern url falls under (NULL: none), its name into r. */
static const char *pattern_of(const http_server *s, http_req *r, const char *url)
{
    long best = -1;
    const char *pattern = NULL;
    char name[HTTP_NAME_MAX + 1];
    for (size_t j = 0; j < s->n_mods; j++)
        for (size_t k = 0; k < s->mods[j].n_routes; k++) {
            int ok = 1;
            long q = match(url, s->mods[j].routes[k].path, name, &ok);
            if (q > best) {
                best = q;
                pattern = s->mods[j].routes[k].path;
                memcpy(r->name, name, sizeof(name));
                r->name_ok = ok;
                if (!strstr(pattern, "{name}")) {
                    r->name[0] = '\0';
                    r->name_ok = 1;
                }
            }
        }
    return pattern;
}

static enum MHD_Result refuse_method(http_req *r, const char *pattern, const char *allow)
{
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
    return http_reply_response(r, MHD_HTTP_METHOD_NOT_ALLOWED, resp, strlen(msg));
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

/* Content-Length as a number: 1 and *v, 0 absent, -1 not digits. */
static int content_length(http_req *r, unsigned long long *v)
{
    const char *cl = http_header(r, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (!cl)
        return 0;
    char *end;
    errno = 0;
    *v = strtoull(cl, &end, 10);
    return (*cl < '0' || *cl > '9' || *end != '\0' || errno) ? -1 : 1;
}

static enum MHD_Result refuse_token(http_req *r)
{
    const http_route *rt = r->route;
    unsigned long long n;
    uint64_t max = r->module->swallow_refused_max;
    if ((rt->flags & HTTP_ROUTE_BODY) && max && content_length(r, &n) == 1 && n <= max)
        return http_refuse_after_body(r, MHD_HTTP_UNAUTHORIZED, "missing or wrong bearer token for %s %s",
                                      r->method, rt->path);
    return http_reply_error(r, MHD_HTTP_UNAUTHORIZED, "missing or wrong bearer token for %s %s", r->method,
                            rt->path);
}

/* The body's framing and limit, the route's before_body, the first buffer. */
static enum MHD_Result body_headers(http_req *r)
{
    const http_route *rt = r->route;
    const http_module *m = r->module;
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
    r->limit = rt->max_body ? rt->max_body : m->max_body ? m->max_body : HTTP_BODY_UNLIMITED;
    unsigned long long v;
    int has = content_length(r, &v);
    if (has < 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "bad Content-Length '%.40s'",
                                http_header(r, MHD_HTTP_HEADER_CONTENT_LENGTH));
    if (has) {
        if (v > r->limit)
            return http_reply_error(r, MHD_HTTP_CONTENT_TOO_LARGE, "body of %llu bytes is over the limit of %llu%s%s%s",
                                    v, (unsigned long long)r->limit, m->max_body_flag ? " (" : "",
                                    m->max_body_flag ? m->max_body_flag : "", m->max_body_flag ? ")" : "");
        r->expect_len = v;
    }
    if (rt->before_body) {
        enum MHD_Result rc = rt->before_body(r);
        if (rc != MHD_YES || r->answered || r->discard || r->body_fixed || r->sink)
            return rc;
    }
    /* the buffer grows as the bytes arrive (on_upload): a head that
     * announces 1 GiB and sends nothing reserves 64 KiB, not 1 GiB */
    size_t first = r->expect_len < UPLOAD_FIRST ? (size_t)r->expect_len : UPLOAD_FIRST;
    if (first > r->limit)
        first = (size_t)r->limit;
    const http_body_ops *ops = body_ops(r);
    r->body_h = ops->alloc(ops->cls, first, &r->body_data, &r->body_cap);
    if (!r->body_h)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory for a body of %zu bytes", first);
    r->body_len = 0;
    return MHD_YES;
}

/* The query's argument names, for repeated_arg. */
typedef struct arg_names {
    const char **keys;
    size_t n, cap;
} arg_names;

static enum MHD_Result note_arg(void *cls, enum MHD_ValueKind kind, const char *key, const char *value)
{
    (void)kind;
    (void)value;
    arg_names *a = cls;
    if (a->n < a->cap && key && *key)
        a->keys[a->n++] = key;
    return MHD_YES;
}

static int cmp_arg(const void *x, const void *y)
{
    return strcasecmp(*(const char *const *)x, *(const char *const *)y);
}

/* A query argument given more than once ("?min_step=5&min_step=7": the
 * lookup takes the first, so the second was ignored in silence), compared
 * as libmicrohttpd's lookup compares names (without case): the name, or
 * NULL when there is none, or "" when out of memory to look. Empty names
 * ("?a=1&&b=2") are none: no lookup can ask for them. Sorted, not pairwise:
 * a head of --max_header_bytes holds thousands of "&a". */
static const char *repeated_arg(http_req *r)
{
    int n = MHD_get_connection_values(r->conn, MHD_GET_ARGUMENT_KIND, NULL, NULL);
    if (n < 2)
        return NULL;
    const char *local[32];
    arg_names a = {local, 0, sizeof(local) / sizeof(local[0])};
    if ((size_t)n > a.cap) {
        a.keys = malloc((size_t)n * sizeof(*a.keys));
        if (!a.keys)
            return "";
        a.cap = (size_t)n;
    }
    MHD_get_connection_values(r->conn, MHD_GET_ARGUMENT_KIND, note_arg, &a);
    qsort(a.keys, a.n, sizeof(*a.keys), cmp_arg);
    const char *dup = NULL;
    for (size_t i = 1; i < a.n && !dup; i++)
        if (strcasecmp(a.keys[i - 1], a.keys[i]) == 0)
            dup = a.keys[i];
    if (a.keys != local)
        free(a.keys);
    return dup;
}

/* Checks that need only the request line and headers. */
static enum MHD_Result on_headers(http_req *r)
{
    http_server *s = r->server;
    const char *pattern = pattern_of(s, r, r->url);
    if (!pattern) {
        if (s->cfg.not_found)
            return s->cfg.not_found(r);
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no such path '%.200s'", r->url);
    }
    const char *m = strcmp(r->method, "HEAD") == 0 ? "GET" : r->method;
    const http_module *owner = NULL;
    char allow[128] = "";
    for (size_t j = 0; j < s->n_mods; j++)
        for (size_t k = 0; k < s->mods[j].n_routes; k++) {
            const http_route *rt = &s->mods[j].routes[k];
            if (strcmp(rt->path, pattern) != 0)
                continue;
            if (!owner)
                owner = &s->mods[j];
            size_t l = strlen(allow);
            snprintf(allow + l, sizeof(allow) - l, "%s%s%s", l ? ", " : "", rt->method,
                     strcmp(rt->method, "GET") == 0 ? ", HEAD" : "");
            if (!r->route && strcmp(rt->method, m) == 0) {
                r->route = rt;
                r->module = &s->mods[j];
            }
        }
    if (!r->route) {
        r->module = owner;
        r->ctx = owner->ctx;
        r->ext = owner->ext_size ? (char *)r + REQ_SIZE : NULL;
        enum MHD_Result rc = owner->wrong_method ? owner->wrong_method(r, pattern, allow)
                                                 : refuse_method(r, pattern, allow);
        r->module = NULL;
        return rc;
    }
    const http_route *rt = r->route;
    const http_module *mod = r->module;
    r->ctx = mod->ctx;
    r->ext = mod->ext_size ? (char *)r + REQ_SIZE : NULL;

    /* the token first: no one learns anything else without it */
    int needs_token = s->cfg.token && !(rt->flags & HTTP_ROUTE_OPEN) &&
                      ((rt->flags & HTTP_ROUTE_AUTH) || mod->token_reads);
    if (needs_token && !token_header_ok(s->cfg.token, http_header(r, MHD_HTTP_HEADER_AUTHORIZATION)))
        return refuse_token(r);
    if (strstr(rt->path, "{name}")) {
        if (mod->check_name) {
            enum MHD_Result rc = mod->check_name(r);
            if (rc != MHD_YES || r->answered)
                return rc;
        } else if (!r->name_ok) {
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "the name in the path must be 1 to %d bytes",
                                    HTTP_NAME_MAX);
        }
    }
    /* every route reads an argument once (http_query takes the first):
     * a second one is refused, not ignored */
    const char *dup = repeated_arg(r);
    if (dup && !*dup)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory reading the query");
    if (dup)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "query argument '%.64s' is given more than once: give it once", dup);
    r->expect_len = UINT64_MAX;
    if (rt->flags & HTTP_ROUTE_BODY)
        return body_headers(r);
    return MHD_YES;
}

/* A refusal found mid-upload cannot be queued before the upload ends
 * (libmicrohttpd refuses a response then): drop the body, swallow the rest,
 * answer at the end. A client that keeps sending past DISCARD_MAX is cut off. */
static void refuse_later(http_req *r, unsigned status, const char *msg)
{
    r->discard = 1;
    r->discard_status = status;
    snprintf(r->discard_msg, sizeof(r->discard_msg), "%s", msg);
    if (r->body_h)
        body_ops(r)->release(body_ops(r)->cls, r->body_h);
    r->body_h = NULL;
    r->body_data = NULL;
    r->body_len = r->body_cap = 0;
    r->body_fixed = 0;
}

static enum MHD_Result on_upload(http_req *r, const char *data, size_t size)
{
    if (r->discard) {
        r->discarded += size;
        return r->discarded > DISCARD_MAX ? MHD_NO : MHD_YES;
    }
    if (r->answered || (!r->body_data && !r->sink))
        return MHD_YES; /* discard what follows a refusal */
    uint64_t have = r->body_len;
    if (r->body_fixed) {
        if (size > r->body_cap - have) {
            char msg[160];
            snprintf(msg, sizeof(msg), "body is longer than the %zu bytes expected", r->body_cap);
            refuse_later(r, MHD_HTTP_BAD_REQUEST, msg);
            return MHD_YES;
        }
        memcpy(r->body_data + have, data, size);
        r->body_len = have + size;
        return MHD_YES;
    }
    const http_module *m = r->module;
    if (have + size > r->limit) {
        char msg[160];
        snprintf(msg, sizeof(msg), "body is over the limit of %llu bytes%s%s%s", (unsigned long long)r->limit,
                 m->max_body_flag ? " (" : "", m->max_body_flag ? m->max_body_flag : "",
                 m->max_body_flag ? ")" : "");
        refuse_later(r, MHD_HTTP_CONTENT_TOO_LARGE, msg);
        return MHD_YES;
    }
    if (r->expect_len != UINT64_MAX && have + size > r->expect_len) {
        char msg[160];
        snprintf(msg, sizeof(msg), "body is longer than the %llu bytes expected (Content-Length%s%s)",
                 (unsigned long long)r->expect_len, m->length_header ? " or " : "",
                 m->length_header ? m->length_header : "");
        refuse_later(r, MHD_HTTP_BAD_REQUEST, msg);
        return MHD_YES;
    }
    if (r->sink) { /* http_body_sink: the piece as it came, no copy */
        r->body_len = have + size;
        r->sink(r->sink_cls, (const unsigned char *)data, size);
        return MHD_YES;
    }
    if (have + size > r->body_cap) {
        /* 8x what has arrived, up to the length announced (all of it from
         * UPLOAD_WHOLE and 1/UPLOAD_AHEAD of it on): a few copies of a small
         * part of the body, and never more than UPLOAD_AHEAD x sent reserved */
        uint64_t want = (have + size) * UPLOAD_GROWTH;
        if (r->expect_len != UINT64_MAX &&
            (want > r->expect_len ||
             (have + size >= UPLOAD_WHOLE && (have + size) * UPLOAD_AHEAD >= r->expect_len)))
            want = r->expect_len;
        if (want > r->limit)
            want = r->limit;
        const http_body_ops *ops = body_ops(r);
        unsigned char *d;
        size_t cap;
        void *g = ops->grow(ops->cls, r->body_h, (size_t)have, (size_t)want, &d, &cap);
        if (!g) {
            refuse_later(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory for the body");
            return MHD_YES;
        }
        r->body_h = g;
        r->body_data = d;
        r->body_cap = cap;
    }
    memcpy(r->body_data + have, data, size);
    r->body_len = have + size;
    return MHD_YES;
}

/* Every byte resets libmicrohttpd's idle timeout, so a body sent a byte a
 * second would hold its connection for ever: after its grace
 * (body_grace_secs, else header_timeout_secs) a body must average
 * body_min_rate (HTTP_BODY_MIN_RATE) bytes a second, or the connection is
 * closed. Every endpoint of the layer: psd, the ring's, a pipeline stage's. */
static int body_too_slow(const http_req *r)
{
    const http_server_config *c = &r->server->cfg;
    uint64_t rate = c->body_min_rate ? c->body_min_rate : HTTP_BODY_MIN_RATE;
    uint64_t grace = c->body_grace_secs ? c->body_grace_secs : c->header_timeout_secs;
    uint64_t now = clk_mono_ns();
    uint64_t secs = now > r->t_start_ns ? (now - r->t_start_ns) / 1000000000u : 0;
    return secs >= grace && r->bytes_in < secs * rate;
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload_data, size_t *upload_data_size,
                                 void **req_cls)
{
    http_server *s = cls;
    http_req *r = *req_cls;
    if (!r) {
        r = calloc(1, REQ_SIZE + s->ext_max);
        if (!r)
            return MHD_NO;
        r->server = s;
        r->conn = conn;
        r->method = method;
        r->url = url;
        r->name_ok = 1;
        r->t_start_ns = clk_mono_ns();
        *req_cls = r;
        if (s->cfg.begin)
            s->cfg.begin(s->cfg.cls, r);
        conntrack_request_begins(conn); /* its head is in: no longer cut for waiting */
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
        return on_headers(r);
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        r->bytes_in += n;
        *upload_data_size = 0;
        if (body_too_slow(r)) {
            log_info("%s: %s %s: the body trickles in (%llu bytes so far): closing the connection", s->logname,
                     r->method, r->route ? r->route->path : "?", (unsigned long long)r->bytes_in);
            return MHD_NO;
        }
        return on_upload(r, upload_data, n);
    }
    if (r->answered)
        return MHD_YES;
    if (r->discard)
        return http_reply_error(r, r->discard_status, "%s", r->discard_msg);
    if (r->body_fixed && r->body_len != r->body_cap)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "the body ended after %zu of %zu bytes", r->body_len,
                                r->body_cap);
    if (r->body_h && body_ops(r)->done)
        body_ops(r)->done(body_ops(r)->cls, r->body_h, r->body_len);
    r->json_fail_mark = json_failed_allocs();
    return r->route->handle(r);
}

static void counter_unref(struct http_counter *c);

static void on_completed(void *cls, struct MHD_Connection *conn, void **req_cls,
                         enum MHD_RequestTerminationCode toe)
{
    http_server *s = cls;
    http_req *r = *req_cls;
    conntrack_request_ends(conn);
    if (!r)
        return;
    int ok = toe == MHD_REQUEST_TERMINATED_COMPLETED_OK;
    if (r->module && r->module->done)
        r->module->done(r, ok);
    if (r->streamed) /* a streamed answer's bytes, for the end hook */
        r->bytes_out = atomic_load(&r->streamed->n);
    if (s->cfg.end)
        s->cfg.end(s->cfg.cls, r, ok);
    counter_unref(r->streamed);
    if (r->body_h)
        body_ops(r)->release(body_ops(r)->cls, r->body_h);
    free(r);
    *req_cls = NULL;
}

/* libmicrohttpd's own messages, in this layer's log format. A client that
 * went away while its answer was being sent (a page closed during its event
 * stream: "Failed to send the chunked response body ... forcibly closed by
 * remote peer") is normal for a server and left out. */
static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    const http_server *s = cls;
    char msg[1024];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    if (strstr(msg, "Failed to send the chunked response body") && strstr(msg, "closed by remote peer"))
        return;
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    log_info("%s: libmicrohttpd: %s", s->logname, msg);
}

int http_server_start(http_server *s, char *err, size_t errlen)
{
    const http_server_config *c = &s->cfg;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    flags |= c->threads == 0 ? MHD_USE_THREAD_PER_CONNECTION : MHD_USE_EPOLL;
    if (c->suspend)
        flags |= MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ITC;
    if (c->tls_cert_pem)
        flags |= MHD_USE_TLS;
    if (s->has_addr && s->addr.ss_family == AF_INET6)
        flags |= c->dual_stack ? MHD_USE_DUAL_STACK : MHD_USE_IPv6;
    struct MHD_OptionItem opts[20];
    int n = 0;
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_EXTERNAL_LOGGER, (intptr_t)mhd_log, s};
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_NOTIFY_COMPLETED, (intptr_t)on_completed, s};
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_UNESCAPE_CALLBACK, (intptr_t)http_unescape, NULL};
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_MEMORY_LIMIT, (intptr_t)c->conn_memory, NULL};
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_TIMEOUT, (intptr_t)c->idle_timeout_secs, NULL};
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_LIMIT, (intptr_t)c->max_conns, NULL};
    /* 414 before the query is parsed */
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_URI_LOG_CALLBACK, (intptr_t)endpoint_uri_guard, NULL};
    if (c->listen_fd >= 0)
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_LISTEN_SOCKET, c->listen_fd, NULL};
    else if (s->has_addr)
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_SOCK_ADDR, 0, &s->addr};
    if (c->tls_cert_pem) {
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, (void *)c->tls_cert_pem};
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, (void *)c->tls_key_pem};
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_PRIORITIES, 0,
                                            (void *)(c->tls_priorities ? c->tls_priorities : TLS_PRIORITIES_DEFAULT)};
    }
    if (c->threads > 1)
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_THREAD_POOL_SIZE, c->threads, NULL};
    /* slowloris: a deadline for request heads, beside the idle timeout */
    if (!(s->conns = conntrack_start(s->logname, (int)c->header_timeout_secs, (int)c->max_conns))) {
        snprintf(err, errlen, "cannot start the %s's connection tracker: %s", s->name, strerror(errno));
        return -1;
    }
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_NOTIFY_CONNECTION, (intptr_t)conntrack_notify, s->conns};
    opts[n++] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    uint16_t port = 0;
    if (s->has_addr)
        port = ntohs(s->addr.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&s->addr)->sin6_port
                                                   : ((struct sockaddr_in *)&s->addr)->sin_port);
    errno = 0;
    s->d = MHD_start_daemon(flags, port, c->accept, c->accept_cls, on_access, s, MHD_OPTION_ARRAY, opts,
                            MHD_OPTION_END);
    if (!s->d) {
        int e = errno;
        conntrack_stop(s->conns);
        s->conns = NULL;
        errno = e;
        snprintf(err, errlen, "%s", e ? strerror(e) : "libmicrohttpd failed to start");
        return -1;
    }
    s->fd_given = 0; /* the daemon closes it */
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_LISTEN_FD);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (di && getsockname(di->listen_fd, (struct sockaddr *)&ss, &sl) == 0)
        s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
    else
        s->port = port;
    return s->port;
}

int http_server_port(const http_server *s) { return s->d ? s->port : -1; }

struct MHD_Daemon *http_server_daemon(http_server *s) { return s->d; }

void http_server_stop(http_server *s)
{
    if (s->d) {
        MHD_stop_daemon(s->d); /* closes the listening socket */
        s->d = NULL;
    }
    if (s->conns) {
        conntrack_stop(s->conns); /* after the daemon: every connection closed */
        s->conns = NULL;
    }
    if (s->fd_given) {
        close(s->cfg.listen_fd);
        s->fd_given = 0;
    }
}

void http_server_free(http_server *s)
{
    if (!s)
        return;
    http_server_stop(s);
    free(s->mods);
    free(s);
}

/* ---- in handlers ---- */

const char *http_header(http_req *r, const char *name)
{
    return MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, name);
}

const char *http_query(http_req *r, const char *name)
{
    return MHD_lookup_connection_value(r->conn, MHD_GET_ARGUMENT_KIND, name);
}

int http_parse_uint(const char *s, long long max, long long *out)
{
    if (!s)
        return 0;
    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (*end || errno)
        return -1;
    if (v > max)
        return -2;
    *out = v;
    return 1;
}

int http_query_int(http_req *r, const char *name, long long max, long long *out)
{
    int rc = http_parse_uint(http_query(r, name), max, out);
    return rc < 0 ? -1 : rc;
}

enum MHD_Result http_reply_response(http_req *r, unsigned status, struct MHD_Response *resp, uint64_t len)
{
    if (!resp) {
        log_error("%s: cannot build a response for %s %s", r->server->logname, r->method, r->url);
        return MHD_NO;
    }
    r->bytes_out = len;
    r->status = status;
    enum MHD_Result rc = endpoint_queue(r->conn, status, resp);
    r->answered = 1;
    return rc;
}

enum MHD_Result http_reply_text(http_req *r, unsigned status, const char *content_type, char *body, size_t len)
{
    return http_reply_response(r, status, endpoint_text_response(body, len, content_type), len);
}

enum MHD_Result http_reply_json(http_req *r, unsigned status, json_t *body)
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
        return http_reply_response(r, status, NULL, 0);
    return http_reply_text(r, status, "application/json", s, n);
}

static enum MHD_Result reply_error_v(http_req *r, unsigned status, const char *fmt, va_list ap)
{
    /* jansson calls some failed allocations syntax errors (jsonmem.h): not
     * the client's fault */
    if (status >= 400 && status < 500 && json_failed_allocs() != r->json_fail_mark)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    char msg[ENDPOINT_ERROR_MAX];
    endpoint_error_message(msg, sizeof(msg), fmt, ap);
    return http_reply_json(r, status, json_pack("{s:s}", "error", msg));
}

enum MHD_Result http_reply_error(http_req *r, unsigned status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    enum MHD_Result rc = reply_error_v(r, status, fmt, ap);
    va_end(ap);
    return rc;
}

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

enum MHD_Result http_reply_stream(http_req *r, unsigned status, const char *content_type, size_t block,
                                  MHD_ContentReaderCallback read, void *cls, MHD_ContentReaderFreeCallback done,
                                  const char *const *headers)
{
    if (strcmp(r->method, "HEAD") == 0) {
        /* the headers alone: a chunked answer to HEAD would carry its
         * terminator ("0\r\n\r\n", libmicrohttpd 0.9.75), bytes a client on a
         * kept-alive connection reads as the start of its next answer */
        done(cls);
        struct MHD_Response *resp = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
        if (!resp)
            return http_reply_response(r, status, NULL, 0);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
        for (int i = 0; headers && headers[i]; i += 2)
            MHD_add_response_header(resp, headers[i], headers[i + 1]);
        return http_reply_response(r, status, resp, 0);
    }
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
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, block, stream_read, s, stream_free);
    if (!resp) {
        stream_free(s);
        return http_reply_response(r, status, NULL, 0);
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    for (int i = 0; headers && headers[i]; i += 2)
        MHD_add_response_header(resp, headers[i], headers[i + 1]);
    return http_reply_response(r, status, resp, 0);
}

/* ---- in before_body ---- */

void http_body_into(http_req *r, void *buf, size_t len)
{
    r->body_fixed = 1;
    r->body_h = NULL;
    r->body_data = buf;
    r->body_cap = len;
    r->body_len = 0;
}

void http_body_sink(http_req *r, void (*fn)(void *cls, const unsigned char *data, size_t n), void *cls)
{
    r->sink = fn;
    r->sink_cls = cls;
    r->body_h = NULL;
    r->body_data = NULL;
    r->body_len = r->body_cap = 0;
}

enum MHD_Result http_refuse_after_body(http_req *r, unsigned status, const char *fmt, ...)
{
    char msg[ENDPOINT_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    endpoint_error_message(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    refuse_later(r, status, msg);
    return MHD_YES;
}

void *http_take_body(http_req *r)
{
    void *h = r->body_h;
    r->body_h = NULL;
    r->body_data = NULL;
    r->body_len = r->body_cap = 0;
    return h;
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

size_t http_unescape(void *cls, struct MHD_Connection *conn, char *s)
{
    (void)cls;
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
    /* what the escapes freed is NULs, not stale bytes: the framing check
     * refuses a head holding bytes no parsed string covers */
    memset(w, 0, (size_t)(r - w) + 1);
    if (r != w) /* the framing check accounts for those NULs */
        endpoint_note_unescaped(conn, r);
    return (size_t)(w - s);
}
