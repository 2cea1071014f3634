/* test_http_server.c - the endpoint layer (common/http_server.h) on a real
 * daemon on 127.0.0.1:0, spoken to with libcurl: two modules on one port,
 * each handler with its own module's context; 404, 405 with Allow, 401 with
 * WWW-Authenticate; a body echoed byte for byte; a body refused with 413
 * before it is read; a body into a caller's buffer, and one that ends
 * short; the range-checked query helper; %XX in a {name}; a chunked body
 * past its announced length never copied (a canary after a buffer of the
 * exact size); a repeated query argument refused; the connection
 * tracker's log lines named for the program. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "http_server.h"

/* ---- two modules ---- */

typedef struct mod_ctx {
    const char *who;
    unsigned char fixed[8]; /* module B's caller buffer */
    int fixed_hits;
} mod_ctx;

static enum MHD_Result h_who(http_req *r)
{
    mod_ctx *m = r->ctx;
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:s,s:s}", "who", m->who, "name", r->name));
}

static enum MHD_Result h_echo(http_req *r)
{
    char *copy = malloc(r->body_len ? r->body_len : 1);
    if (!copy)
        return MHD_NO;
    memcpy(copy, r->body_data, r->body_len);
    return http_reply_text(r, MHD_HTTP_OK, "application/octet-stream", copy, r->body_len);
}

static enum MHD_Result h_int(http_req *r)
{
    long long v = -7;
    int rc = http_query_int(r, "v", 1000, &v);
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:i,s:I}", "rc", rc, "v", (json_int_t)v));
}

static enum MHD_Result fixed_begin(http_req *r)
{
    mod_ctx *m = r->ctx;
    http_body_into(r, m->fixed, sizeof(m->fixed));
    return MHD_YES;
}

static enum MHD_Result h_fixed(http_req *r)
{
    mod_ctx *m = r->ctx;
    m->fixed_hits++;
    return http_reply_response(r, MHD_HTTP_NO_CONTENT, MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT),
                               0);
}

/* ---- module C: bodies in buffers of exactly the size asked, a canary after ---- */

#define CANARY 64
static int canary_broken, canary_allocs;

typedef struct exact_buf {
    size_t cap;
    unsigned char data[];
} exact_buf;

static void *exact_alloc(void *cls, size_t cap, unsigned char **data, size_t *got)
{
    (void)cls;
    exact_buf *b = malloc(sizeof(*b) + cap + CANARY);
    if (!b)
        return NULL;
    b->cap = cap;
    memset(b->data + cap, 0xA5, CANARY);
    canary_allocs++;
    *data = b->data;
    *got = cap;
    return b;
}

static void exact_check(exact_buf *b)
{
    for (size_t i = 0; i < CANARY; i++)
        if (b->data[b->cap + i] != 0xA5)
            canary_broken++;
}

static void *exact_grow(void *cls, void *h, size_t used, size_t cap, unsigned char **data, size_t *got)
{
    exact_buf *old = h;
    exact_check(old);
    unsigned char *d;
    exact_buf *b = exact_alloc(cls, cap, &d, got);
    if (!b)
        return NULL;
    memcpy(b->data, old->data, used);
    free(old);
    *data = b->data;
    return b;
}

static void exact_release(void *cls, void *h)
{
    (void)cls;
    exact_check(h);
    free(h);
}

static const http_body_ops exact_ops = {exact_alloc, exact_grow, NULL, exact_release, NULL};

static int shaped_hits;
static unsigned char into_buf[8 + CANARY];

/* as psd's PUT /v1/vars/{name}: X-Shape says 8 bytes, a chunked body has no
 * Content-Length, so the hook announces the length itself */
static enum MHD_Result shaped_begin(http_req *r)
{
    if (r->expect_len != UINT64_MAX && r->expect_len != 8)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "8 bytes, not %llu", (unsigned long long)r->expect_len);
    r->expect_len = 8;
    return MHD_YES;
}

static enum MHD_Result h_shaped(http_req *r)
{
    shaped_hits++;
    return h_echo(r);
}

static enum MHD_Result into_begin(http_req *r)
{
    http_body_into(r, into_buf, 8);
    return MHD_YES;
}

static const http_route routes_c[] = {
    {"POST", "/c/shaped", HTTP_ROUTE_BODY, 0, shaped_begin, h_shaped, "8 bytes, announced by the hook"},
    {"POST", "/c/into", HTTP_ROUTE_BODY, HTTP_BODY_UNLIMITED, into_begin, h_shaped, "8 bytes, into a buffer"},
};

static const http_route routes_a[] = {
    {"GET", "/a", 0, 0, NULL, h_who, "who serves /a"},
    {"GET", "/a/{name}/x", HTTP_ROUTE_AUTH, 0, NULL, h_who, "a name, behind the token"},
    {"PUT", "/a/{name}/x", HTTP_ROUTE_AUTH | HTTP_ROUTE_BODY, 0, NULL, h_echo, "echo"},
    {"GET", "/int", HTTP_ROUTE_OPEN, 0, NULL, h_int, "the query helper"},
};
static const http_route routes_b[] = {
    {"GET", "/b/{name}", 0, 0, NULL, h_who, "who serves /b"},
    {"POST", "/b/echo/small", HTTP_ROUTE_BODY, 16, NULL, h_echo, "echo, 16 bytes at most"},
    {"POST", "/b/fixed", HTTP_ROUTE_BODY, HTTP_BODY_UNLIMITED, fixed_begin, h_fixed, "8 bytes, into a buffer"},
};

static mod_ctx ctx_a = {"a", {0}, 0}, ctx_b = {"b", {0}, 0}, ctx_c = {"c", {0}, 0};
static http_server *srv;
static int port;

static int setup(void **state)
{
    (void)state;
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = 0;
    http_server_config c = {
        .name = "test",
        .listen_fd = -1,
        .bind_addr = (struct sockaddr *)&sa,
        .threads = 1,
        .idle_timeout_secs = 10,
        .header_timeout_secs = 10,
        .max_conns = 64,
        .conn_memory = 64 * 1024,
        .token = "s3cret",
    };
    char err[256];
    srv = http_server_new(&c, err, sizeof(err));
    assert_non_null(srv);
    http_module a = {.name = "a", .routes = routes_a, .n_routes = 4, .ctx = &ctx_a, .max_body = 1 << 20};
    http_module b = {.name = "b", .routes = routes_b, .n_routes = 3, .ctx = &ctx_b, .max_body = 1 << 20};
    assert_int_equal(http_server_add(srv, &a, err, sizeof(err)), 0);
    assert_int_equal(http_server_add(srv, &b, err, sizeof(err)), 0);
    http_module c3 = {.name = "c", .routes = routes_c, .n_routes = 2, .ctx = &ctx_c, .max_body = 1 << 20,
                      .body = &exact_ops, .length_header = "X-Shape"};
    assert_int_equal(http_server_add(srv, &c3, err, sizeof(err)), 0);
    /* the same method and path twice: refused, naming the module */
    assert_int_equal(http_server_add(srv, &a, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "served by a"));
    port = http_server_start(srv, err, sizeof(err));
    assert_true(port > 0);
    assert_int_equal(http_server_port(srv), port);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    http_server_free(srv);
    return 0;
}

/* ---- a request with libcurl ---- */

typedef struct reply {
    long status;
    char body[4096];
    size_t len;
    char headers[4096];
    size_t hlen;
} reply;

static size_t on_body(char *p, size_t size, size_t n, void *cls)
{
    reply *r = cls;
    size_t k = size * n;
    if (k > sizeof(r->body) - 1 - r->len)
        k = sizeof(r->body) - 1 - r->len;
    memcpy(r->body + r->len, p, k);
    r->len += k;
    r->body[r->len] = '\0';
    return size * n;
}

static size_t on_header(char *p, size_t size, size_t n, void *cls)
{
    reply *r = cls;
    size_t k = size * n;
    if (k > sizeof(r->headers) - 1 - r->hlen)
        k = sizeof(r->headers) - 1 - r->hlen;
    memcpy(r->headers + r->hlen, p, k);
    r->hlen += k;
    r->headers[r->hlen] = '\0';
    return size * n;
}

/* One request; extra: a header line or NULL; body NULL: none. */
static reply request(const char *method, const char *path, const char *extra, const void *body, size_t len)
{
    reply r;
    memset(&r, 0, sizeof(r));
    CURL *h = curl_easy_init();
    assert_non_null(h);
    char url[512];
    snprintf(url, sizeof(url), "http://127.0.0.1:%d%s", port, path);
    struct curl_slist *hd = curl_slist_append(NULL, "Expect:");
    if (extra)
        hd = curl_slist_append(hd, extra);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
    if (strcmp(method, "HEAD") == 0)
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    else
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &r);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, 10L);
    if (body) {
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)len);
    }
    assert_int_equal(curl_easy_perform(h), CURLE_OK);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.status);
    curl_slist_free_all(hd);
    curl_easy_cleanup(h);
    return r;
}

static const char *json_str(const char *text, const char *key, char *out, size_t cap)
{
    json_t *j = json_loads(text, 0, NULL);
    const char *v = j ? json_string_value(json_object_get(j, key)) : NULL;
    snprintf(out, cap, "%s", v ? v : "(none)");
    json_decref(j);
    return out;
}

/* ---- the tests ---- */

static void test_each_module_gets_its_own_context_on_one_port(void **state)
{
    (void)state;
    char v[128];
    reply r = request("GET", "/a", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(json_str(r.body, "who", v, sizeof(v)), "a");
    r = request("GET", "/b/some/name", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(json_str(r.body, "who", v, sizeof(v)), "b");
    assert_string_equal(json_str(r.body, "name", v, sizeof(v)), "some/name");
    /* HEAD on a GET route: the status, no body */
    r = request("HEAD", "/a", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
}

static void test_unknown_path_is_404_and_wrong_method_405_with_allow(void **state)
{
    (void)state;
    char v[256];
    reply r = request("GET", "/nothing", NULL, NULL, 0);
    assert_int_equal(r.status, 404);
    assert_non_null(strstr(json_str(r.body, "error", v, sizeof(v)), "no such path '/nothing'"));
    r = request("DELETE", "/a/w/x", "Authorization: Bearer s3cret", NULL, 0);
    assert_int_equal(r.status, 405);
    assert_non_null(strstr(r.headers, "Allow: GET, HEAD, PUT"));
    assert_non_null(strstr(json_str(r.body, "error", v, sizeof(v)), "method DELETE not allowed on /a/{name}/x"));
}

static void test_the_token_guards_auth_routes_only(void **state)
{
    (void)state;
    reply r = request("GET", "/a/w/x", NULL, NULL, 0);
    assert_int_equal(r.status, 401);
    assert_non_null(strstr(r.headers, "WWW-Authenticate: Bearer"));
    r = request("GET", "/a/w/x", "Authorization: Bearer wrong", NULL, 0);
    assert_int_equal(r.status, 401);
    r = request("GET", "/a/w/x", "Authorization: bearer s3cret", NULL, 0);
    assert_int_equal(r.status, 200);
    r = request("GET", "/a", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
}

static void test_a_body_comes_in_whole_and_a_too_large_one_is_refused_first(void **state)
{
    (void)state;
    /* 300 KiB of bytes from a fixed LCG: past the first 64 KiB buffer, so it grows */
    size_t n = 300 * 1024;
    unsigned char *b = malloc(n);
    assert_non_null(b);
    uint32_t x = 12345;
    for (size_t i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        b[i] = (unsigned char)(x >> 24);
    }
    CURL *h = curl_easy_init();
    char url[128];
    snprintf(url, sizeof(url), "http://127.0.0.1:%d/a/w/x", port);
    struct curl_slist *hd = curl_slist_append(NULL, "Authorization: Bearer s3cret");
    hd = curl_slist_append(hd, "Expect:");
    unsigned char *got = malloc(n + 1); /* fmemopen keeps the last byte for a NUL */
    assert_non_null(got);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "PUT");
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, b);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)n);
    FILE *mem = fmemopen(got, n + 1, "w");
    assert_non_null(mem);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, mem);
    assert_int_equal(curl_easy_perform(h), CURLE_OK);
    long st;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &st);
    fflush(mem);
    size_t got_len = (size_t)ftell(mem);
    fclose(mem);
    assert_int_equal(st, 200);
    assert_int_equal(got_len, n);
    assert_memory_equal(got, b, n);
    curl_slist_free_all(hd);
    curl_easy_cleanup(h);
    free(got);

    char v[256];
    reply r = request("POST", "/b/echo/small", NULL, b, 17);
    assert_int_equal(r.status, 413);
    assert_non_null(strstr(json_str(r.body, "error", v, sizeof(v)), "body of 17 bytes is over the limit of 16"));
    r = request("POST", "/b/echo/small", NULL, b, 16);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.len, 16);
    assert_memory_equal(r.body, b, 16);
    free(b);
}

static void test_a_body_into_a_callers_buffer_must_be_whole(void **state)
{
    (void)state;
    const char eight[] = "12345678";
    reply r = request("POST", "/b/fixed", NULL, eight, 8);
    assert_int_equal(r.status, 204);
    assert_memory_equal(ctx_b.fixed, eight, 8);
    assert_int_equal(ctx_b.fixed_hits, 1);
    char v[256];
    r = request("POST", "/b/fixed", NULL, "abc", 3);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(json_str(r.body, "error", v, sizeof(v)), "the body ended after 3 of 8 bytes"));
    r = request("POST", "/b/fixed", NULL, "123456789", 9);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(json_str(r.body, "error", v, sizeof(v)), "longer than the 8 bytes"));
    assert_int_equal(ctx_b.fixed_hits, 1);
}

static void test_query_int_is_digits_only_and_range_checked(void **state)
{
    (void)state;
    static const struct {
        const char *q;
        int rc;
        long long v;
    } cases[] = {{"", 0, -7},          {"?v=0", 1, 0},     {"?v=1000", 1, 1000}, {"?v=1001", -1, -7},
                 {"?v=-1", -1, -7},    {"?v=+1", -1, -7},  {"?v=1x", -1, -7},    {"?v=", -1, -7},
                 {"?v=99999999999999999999", -1, -7}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char path[64];
        snprintf(path, sizeof(path), "/int%s", cases[i].q);
        reply r = request("GET", path, NULL, NULL, 0);
        assert_int_equal(r.status, 200);
        json_t *j = json_loads(r.body, 0, NULL);
        assert_non_null(j);
        assert_int_equal(json_integer_value(json_object_get(j, "rc")), cases[i].rc);
        assert_int_equal(json_integer_value(json_object_get(j, "v")), cases[i].v);
        json_decref(j);
    }
}

static void test_escapes_decode_in_a_name_but_percent_00_stays(void **state)
{
    (void)state;
    char v[128];
    reply r = request("GET", "/b/a%2Fb%41", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(json_str(r.body, "name", v, sizeof(v)), "a/bA");
    r = request("GET", "/b/w%00zz", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(json_str(r.body, "name", v, sizeof(v)), "w%00zz");
}

/* ---- raw heads ---- */

/* The answer to raw (len bytes) on a new connection into out (cap bytes,
 * NUL-terminated), its status returned, and in *closed whether the server
 * then closed it; 0 when no answer came. */
static int raw_answer(const char *raw, size_t len, int *closed, char *out, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons((uint16_t)port);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    assert_int_equal(send(fd, raw, len, MSG_NOSIGNAL), (ssize_t)len);
    char *buf = out;
    size_t got = 0;
    ssize_t n = -1;
    *closed = 0;
    while (got < cap - 1 && (n = recv(fd, buf + got, cap - 1 - got, 0)) > 0)
        got += (size_t)n;
    *closed = n == 0;
    close(fd);
    buf[got] = '\0';
    int st = 0;
    return sscanf(buf, "HTTP/1.%*d %d", &st) == 1 ? st : 0;
}

static int raw_status(const char *raw, size_t len, int *closed)
{
    char buf[4096];
    return raw_answer(raw, len, closed, buf, sizeof(buf));
}

#define RAW(s) s, sizeof(s) - 1

/* issue 37: libmicrohttpd writes a NUL over each separator it cuts the head
 * at, so a NUL the client sent just before a space or a CRLF read as a
 * string's end (200); a NUL anywhere in a head is 400, and the connection
 * closes. The same heads without the NUL are served. */
static void test_a_nul_before_a_separator_is_refused(void **state)
{
    (void)state;
    static const struct {
        const char *raw;
        size_t len;
    } bad[] = {
        {RAW("GET /b/w\0 HTTP/1.1\r\nHost: x\r\n\r\n")},
        {RAW("GET /b/w\0?v=1 HTTP/1.1\r\nHost: x\r\n\r\n")},
        {RAW("GET /b/w?v=1\0 HTTP/1.1\r\nHost: x\r\n\r\n")},
        {RAW("GET /b/%77\0 HTTP/1.1\r\nHost: x\r\n\r\n")},
        {RAW("GET /b/w HTTP/1.1\r\nHost: x\0\r\n\r\n")},
        {RAW("GET /b/w HTTP/1.1\r\nHost: x\r\nX-A: b\0\r\n\r\n")},
        {RAW("GET /b/w HTTP/1.1\r\nHost: x\r\nX-A:\0\r\n\r\n")},
        {RAW("GET\0 /b/w HTTP/1.1\r\nHost: x\r\n\r\n")},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int closed;
        int st = raw_status(bad[i].raw, bad[i].len, &closed);
        if (st != 400 || !closed)
            fail_msg("head %zu: %d%s", i, st, closed ? "" : ", left open");
    }
    static const char *const fine[] = {
        "GET /b/w HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "GET /b/w? HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "GET /b/w?v=1&x=&y&&z=2& HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "GET /b/%77%78?%76=%31 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "GET /b/w HTTP/1.1\r\nHost:   x \t\r\nX-A:\r\nConnection: close\r\n\r\n",
        "GET /b/w HTTP/1.1\nHost: x\nConnection: close\n\n",
    };
    for (size_t i = 0; i < sizeof(fine) / sizeof(fine[0]); i++) {
        int closed;
        int st = raw_status(fine[i], strlen(fine[i]), &closed);
        if (st != 200)
            fail_msg("fine head %zu: %d", i, st);
    }
}

/* issue 37: a chunked body whose last piece runs past the length announced
 * (by a before_body hook, as X-Shape does; or a caller's buffer) is refused
 * before that piece is copied: the bytes past the 8 announced are never
 * written (a canary right after a buffer of exactly the size asked, and
 * after the caller's buffer), the handler never runs, 400 says so. The
 * same body of exactly 8 bytes in two pieces is taken whole. */
static void test_a_chunked_body_past_its_announced_length_is_never_copied(void **state)
{
    (void)state;
    static const char over[] = "POST /c/shaped HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                               "Transfer-Encoding: chunked\r\n\r\n"
                               "5\r\nabcde\r\n7\r\nfghijkl\r\n0\r\n\r\n";
    static const char fits[] = "POST /c/shaped HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                               "Transfer-Encoding: chunked\r\n\r\n"
                               "5\r\nabcde\r\n3\r\nfgh\r\n0\r\n\r\n";
    char ans[4096];
    int closed;
    canary_broken = canary_allocs = shaped_hits = 0;
    assert_int_equal(raw_answer(over, sizeof(over) - 1, &closed, ans, sizeof(ans)), 400);
    if (!strstr(ans, "body is longer than the 8 bytes expected (Content-Length or X-Shape)"))
        fail_msg("answer: %s", ans);
    assert_true(canary_allocs > 0);
    if (canary_broken)
        fail_msg("%d bytes past the 8 announced were written", canary_broken);
    assert_int_equal(shaped_hits, 0);
    /* one piece of 12 at once */
    static const char one[] = "POST /c/shaped HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              "Transfer-Encoding: chunked\r\n\r\nc\r\nabcdefghijkl\r\n0\r\n\r\n";
    assert_int_equal(raw_answer(one, sizeof(one) - 1, &closed, ans, sizeof(ans)), 400);
    assert_int_equal(canary_broken, 0);
    assert_int_equal(shaped_hits, 0);
    assert_int_equal(raw_answer(fits, sizeof(fits) - 1, &closed, ans, sizeof(ans)), 200);
    assert_int_equal(shaped_hits, 1);
    assert_non_null(strstr(ans, "\r\n\r\nabcdefgh"));
    assert_int_equal(canary_broken, 0);

    /* into a caller's buffer: the same */
    memset(into_buf, 0xA5, sizeof(into_buf));
    static const char into[] = "POST /c/into HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                               "Transfer-Encoding: chunked\r\n\r\n"
                               "5\r\nabcde\r\n7\r\nfghijkl\r\n0\r\n\r\n";
    assert_int_equal(raw_answer(into, sizeof(into) - 1, &closed, ans, sizeof(ans)), 400);
    if (!strstr(ans, "longer than the 8 bytes expected"))
        fail_msg("answer: %s", ans);
    for (size_t i = 8; i < sizeof(into_buf); i++)
        if (into_buf[i] != 0xA5)
            fail_msg("byte %zu past the caller's 8 was written", i);
    assert_int_equal(shaped_hits, 1);
}

/* issue 37: "?v=5&v=7" read as 5 and the 7 went unseen: a repeated query
 * argument is 400 naming it, on every route (the lookup is the layer's),
 * compared as the lookup compares (without case); distinct ones and empty
 * segments are fine. */
static void test_a_repeated_query_argument_is_refused(void **state)
{
    (void)state;
    char v[256];
    static const char *const twice[] = {"/int?v=5&v=7", "/int?v=5&V=7", "/int?v&v=1", "/b/w?x=1&y=2&x=1",
                                        "/int?a=1&b=2&c=3&d=4&e=5&f=6&g=7&h=8&i=9&j=10&k=11&l=12&m=13&n=14&o=15"
                                        "&p=16&q=17&r=18&s=19&t=20&u=21&w=22&x=23&y=24&z=25&aa=26&bb=27&cc=28"
                                        "&dd=29&ee=30&ff=31&gg=32&hh=33&v=1&v=2"};
    static const char *const named[] = {"'v'", "'v'", "'v'", "'x'", "'v'"};
    for (size_t i = 0; i < sizeof(twice) / sizeof(twice[0]); i++) {
        reply r = request("GET", twice[i], NULL, NULL, 0);
        json_str(r.body, "error", v, sizeof(v));
        if (r.status != 400 || !strcasestr(v, named[i]) || !strstr(v, "more than once"))
            fail_msg("%s: %ld %s", twice[i], r.status, v);
    }
    /* a body route: refused before the body is read, the handler not run */
    reply r = request("POST", "/b/fixed?n=1&n=2", NULL, "12345678", 8);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(json_str(r.body, "error", v, sizeof(v)), "'n' is given more than once"));
    assert_int_equal(ctx_b.fixed_hits, 1);
    r = request("GET", "/int?v=5&w=7&&x=", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    assert_non_null(j);
    assert_int_equal(json_integer_value(json_object_get(j, "v")), 5);
    json_decref(j);
}

/* ---- the layer's log lines: the program's name ---- */

/* Starts a server (name, max_conns 4: the tracker makes room past 3),
 * opens 4 idle connections, and returns what the layer logged meanwhile
 * (stderr, into out). */
static void eviction_log(const char *name, const char *program, char *out, size_t cap)
{
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    http_server_config c = {.name = name, .listen_fd = -1, .bind_addr = (struct sockaddr *)&sa, .threads = 1,
                            .idle_timeout_secs = 30, .header_timeout_secs = 30, .max_conns = 4,
                            .conn_memory = 64 * 1024};
#ifndef TEST_BEFORE_PROGRAM
    c.program = program;
#else
    (void)program;
#endif
    char err[256];
    http_server *s = http_server_new(&c, err, sizeof(err));
    assert_non_null(s);
    http_module m = {.name = "a", .routes = routes_a, .n_routes = 1, .ctx = &ctx_a};
    assert_int_equal(http_server_add(s, &m, err, sizeof(err)), 0);
    int p = http_server_start(s, err, sizeof(err));
    assert_true(p > 0);
    char path[] = "/tmp/test_http_server_log.XXXXXX";
    int log = mkstemp(path);
    assert_true(log >= 0);
    unlink(path);
    fflush(stderr);
    int saved = dup(2);
    assert_true(saved >= 0);
    assert_true(dup2(log, 2) == 2);
    int fds[4];
    sa.sin_port = htons((uint16_t)p);
    for (int i = 0; i < 4; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        assert_true(fds[i] >= 0);
        assert_int_equal(connect(fds[i], (struct sockaddr *)&sa, sizeof(sa)), 0);
        struct timespec t = {0, 20 * 1000000L}; /* accepted in this order */
        nanosleep(&t, NULL);
    }
    ssize_t n = 0;
    for (int tries = 0; tries < 60; tries++) { /* the tracker logs every 250 ms */
        struct timespec t = {0, 50 * 1000000L};
        nanosleep(&t, NULL);
        n = pread(log, out, cap - 1, 0);
        if (n > 0 && memchr(out, '\n', (size_t)n))
            break;
    }
    dup2(saved, 2);
    close(saved);
    close(log);
    out[n > 0 ? n : 0] = '\0';
    for (int i = 0; i < 4; i++)
        close(fds[i]);
    http_server_free(s);
}

/* issue 37: a workerd endpoint's eviction lines said "psd:": the tracker
 * logs as the program that runs it (here the test's own name, as workerd's
 * ring endpoint says "workerd: ring endpoint:"). */
static void test_the_trackers_lines_name_the_program(void **state)
{
    (void)state;
    char out[2048];
    eviction_log("ring endpoint", NULL, out, sizeof(out));
    if (!strstr(out, " test_http_server: ring endpoint: ") || !strstr(out, "connections open, over 3: closed 1") ||
        strstr(out, "psd:"))
        fail_msg("log: %s", out);
}

#ifndef TEST_BEFORE_PROGRAM
/* psd's lines stay as they were: "psd: 3 connections open, ..."; a
 * program named by the caller comes first, then the server's name */
static void test_the_trackers_lines_keep_psds_words(void **state)
{
    (void)state;
    char out[2048];
    eviction_log("psd", "psd", out, sizeof(out));
    if (!strstr(out, "info psd: ") || !strstr(out, " connections open, over 3: closed 1 that had no request in progress"))
        fail_msg("log: %s", out);
    eviction_log("stage", "workerd", out, sizeof(out));
    if (!strstr(out, "info workerd: stage: ") || !strstr(out, " connections open, over 3"))
        fail_msg("log: %s", out);
}
#endif

int main(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_module_gets_its_own_context_on_one_port),
        cmocka_unit_test(test_unknown_path_is_404_and_wrong_method_405_with_allow),
        cmocka_unit_test(test_the_token_guards_auth_routes_only),
        cmocka_unit_test(test_a_body_comes_in_whole_and_a_too_large_one_is_refused_first),
        cmocka_unit_test(test_a_body_into_a_callers_buffer_must_be_whole),
        cmocka_unit_test(test_query_int_is_digits_only_and_range_checked),
        cmocka_unit_test(test_escapes_decode_in_a_name_but_percent_00_stays),
        cmocka_unit_test(test_a_nul_before_a_separator_is_refused),
        cmocka_unit_test(test_a_chunked_body_past_its_announced_length_is_never_copied),
        cmocka_unit_test(test_a_repeated_query_argument_is_refused),
        cmocka_unit_test(test_the_trackers_lines_name_the_program),
#ifndef TEST_BEFORE_PROGRAM
        cmocka_unit_test(test_the_trackers_lines_keep_psds_words),
#endif
    };
    int rc = cmocka_run_group_tests(tests, setup, teardown);
    curl_global_cleanup();
    return rc;
}
