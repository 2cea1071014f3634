/* endpoint.c - JSON replies, error replies and loopback hosts for every
 * libmicrohttpd endpoint (endpoint.h). */
#include "endpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "jsonmem.h"

#define STR_(x) #x
#define STR(x) STR_(x)

enum MHD_Result endpoint_queue(struct MHD_Connection *c, unsigned status, struct MHD_Response *resp)
{
    if (!resp)
        return MHD_NO;
    if (status == MHD_HTTP_UNAUTHORIZED)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    enum MHD_Result rc = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return rc;
}

struct MHD_Response *endpoint_text_response(char *body, size_t len, const char *content_type)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(body);
        return NULL;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    return resp;
}

char *endpoint_json_text(json_t *j, size_t *len)
{
    char *s = j ? json_dumps_checked(j, JSON_COMPACT | JSON_REAL_PRECISION(10)) : NULL;
    json_decref(j);
    if (!s)
        return NULL;
    size_t n = strlen(s);
    /* a trailing newline keeps curl output readable (kept off when there
     * is no memory for it) */
    char *t = realloc(s, n + 2);
    if (t) {
        s = t;
        s[n++] = '\n';
        s[n] = '\0';
    }
    *len = n;
    return s;
}

void endpoint_error_message(char *msg, size_t cap, const char *fmt, va_list ap)
{
    vsnprintf(msg, cap, fmt, ap);
    for (char *p = msg; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e)
            *p = '?';
}

enum MHD_Result endpoint_reply_json(struct MHD_Connection *c, unsigned status, json_t *j)
{
    size_t n;
    char *s = endpoint_json_text(j, &n);
    if (!s)
        return MHD_NO;
    return endpoint_queue(c, status, endpoint_text_response(s, n, "application/json"));
}

enum MHD_Result endpoint_reply_error(struct MHD_Connection *c, unsigned status, const char *fmt, ...)
{
    char msg[ENDPOINT_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    endpoint_error_message(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return endpoint_reply_json(c, status, json_pack("{s:s}", "error", msg));
}

int endpoint_host_is_loopback(const char *host)
{
    return strcmp(host, "localhost") == 0 || strncmp(host, "127.", 4) == 0 || strcmp(host, "::1") == 0;
}

struct framing {
    int n_cl, n_te;
    const char *bad_key; /* the first field with a byte RFC 9110 refuses */
    const char *ws_key;  /* the first field name with whitespace in it */
};

/* 1 when s[0..n) holds a NUL or a control byte other than HTAB (or is not
 * n bytes long: a NUL libmicrohttpd cut it at). */
static int has_control(const char *s, size_t n, int allow_tab)
{
    if (strlen(s) != n)
        return 1;
    for (size_t i = 0; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        if ((b < 0x20 && !(allow_tab && b == '\t')) || b == 0x7f)
            return 1;
    }
    return 0;
}

static enum MHD_Result framing_field(void *cls, enum MHD_ValueKind kind, const char *key,
                                     size_t key_size, const char *value, size_t value_size)
{
    (void)kind;
    struct framing *f = cls;
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0)
        f->n_cl++;
    if (strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING) == 0)
        f->n_te++;
    if (!f->bad_key && (has_control(key, key_size, 0) || !value ||
                        has_control(value, value_size, 1)))
        f->bad_key = key;
    /* "Content-Length : 4": libmicrohttpd keeps the space in the name, a
     * proxy in front may not (RFC 9112 5.1: a server must refuse it) */
    if (!f->ws_key && strpbrk(key, " \t"))
        f->ws_key = key;
    return MHD_YES;
}

/* The spans of the request head that libmicrohttpd parsed out of its read
 * buffer (it cuts the head in place, writing NULs), for head_hides_bytes;
 * and the NULs it wrote there that a parsed string accounts for. */
struct cover {
    const char *head;
    size_t size;
    unsigned char *covered; /* 1: a parsed string's byte; 2: a NUL accounted for */
};

static int in_head(const struct cover *cv, const char *s)
{
    return s && s >= cv->head && s < cv->head + cv->size;
}

static void cover(struct cover *cv, const char *s, size_t n)
{
    if (!in_head(cv, s))
        return;
    size_t off = (size_t)(s - cv->head);
    if (n > cv->size - off)
        n = cv->size - off;
    memset(cv->covered + off, 1, n);
}

/* The NUL that ends s (n bytes; past what an escape freed, which is
 * covered), and with line_end the next one too (a CRLF is two NULs), are
 * accounted for. */
static void account_end(struct cover *cv, const char *s, size_t n, int line_end)
{
    if (!in_head(cv, s))
        return;
    size_t i = (size_t)(s - cv->head) + n;
    while (i < cv->size && cv->covered[i] == 1)
        i++;
    for (int k = 0; k < 1 + !!line_end && i < cv->size; k++, i++)
        if (!cv->head[i] && !cv->covered[i])
            cv->covered[i] = 2;
}

static enum MHD_Result cover_field(void *cls, enum MHD_ValueKind kind, const char *key,
                                   size_t key_size, const char *value, size_t value_size)
{
    (void)kind;
    cover(cls, key, key_size);
    cover(cls, value, value_size);
    return MHD_YES;
}

static enum MHD_Result account_field(void *cls, enum MHD_ValueKind kind, const char *key,
                                     size_t key_size, const char *value, size_t value_size)
{
    /* a header's name ends at its ':', its value at its line's end; a query
     * argument's name at its '=' or '&', its value at its '&' or the space
     * before the version */
    account_end(cls, key, key_size, 0);
    account_end(cls, value, value_size, kind == MHD_HEADER_KIND);
    return MHD_YES;
}

#define UNESCAPED_KEY "restps-unescaped"
#define URI_END_KEY "restps-uri-end"

/* The bytes an escape freed in a URL piece (http_unescape: NULs from the
 * piece's new end up to end, its old one), covered. */
static enum MHD_Result cover_freed(void *cls, enum MHD_ValueKind kind, const char *key,
                                   size_t key_size, const char *value, size_t value_size)
{
    (void)kind;
    (void)key_size;
    (void)value_size;
    struct cover *cv = cls;
    if (strcmp(key, UNESCAPED_KEY) != 0 || !in_head(cv, value))
        return MHD_YES;
    for (size_t i = (size_t)(value - cv->head); i > 0 && !cv->head[i - 1] && !cv->covered[i - 1]; i--)
        cv->covered[i - 1] = 1;
    return MHD_YES;
}

void endpoint_note_unescaped(struct MHD_Connection *c, const char *old_end)
{
    /* the value is the NUL at old_end itself (""), kept where it lies; a
     * note that finds no room leaves those NULs unaccounted: refused */
    if (c)
        MHD_set_connection_value(c, MHD_FOOTER_KIND, UNESCAPED_KEY, old_end);
}

/* 1 when the head holds a byte that no parsed string covers and that is not
 * a separator: what followed a NUL libmicrohttpd read a string up to, or a
 * folded line it dropped; or a NUL that is not one libmicrohttpd wrote: it
 * ends each string it parses with one, written over the separator after it
 * (the space after the method, the '?', '=' and '&' of the query, the space
 * before the version, a header's ':', a line's CR and LF), so a NUL the
 * client sent just before a separator reads as a string's end and a second
 * NUL follows it. Each parsed string accounts for the NUL after it (a line's
 * last, the version and a header's value, for two: CR LF), the end of the
 * head for the empty line's two; the target's end as it was before the query
 * was cut (endpoint_uri_guard notes it: "/w? HTTP/1.1" and "/w\0 HTTP/1.1"
 * look alike after); what escapes freed (http_unescape notes it). A NUL
 * before a bare LF looks like a CR and is not seen. */
static int head_hides_bytes(struct MHD_Connection *c, const char *method, const char *url,
                            const char *version)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    if (!ci || !ci->header_size || !method || !url || !version)
        return 0;
    size_t size = ci->header_size;
    /* the method, URL and version lie in the head, in that order, or this
     * libmicrohttpd keeps them elsewhere and nothing is checked */
    if (!(method < url && url < version && (size_t)(version - method) < size))
        return 0;
    struct cover cv = {method, size, calloc(1, size)};
    if (!cv.covered)
        return 0;
    cover(&cv, method, strlen(method));
    cover(&cv, url, strlen(url));
    cover(&cv, version, strlen(version));
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, cover_field, &cv);
    MHD_get_connection_values_n(c, MHD_GET_ARGUMENT_KIND, cover_field, &cv);
    MHD_get_connection_values_n(c, MHD_FOOTER_KIND, cover_freed, &cv);
    account_end(&cv, method, strlen(method), 0);
    account_end(&cv, url, strlen(url), 0);
    account_end(&cv, version, strlen(version), 1);
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, account_field, &cv);
    MHD_get_connection_values_n(c, MHD_GET_ARGUMENT_KIND, account_field, &cv);
    const char *uri_end = MHD_lookup_connection_value(c, MHD_FOOTER_KIND, URI_END_KEY);
    if (in_head(&cv, uri_end) && !*uri_end && !cv.covered[uri_end - method])
        cv.covered[uri_end - method] = 2;
    for (size_t i = size >= 2 ? size - 2 : 0; i < size; i++)
        if (!method[i] && !cv.covered[i])
            cv.covered[i] = 2;
    int hidden = 0;
    for (size_t i = 0; i < size && !hidden; i++) {
        unsigned char b = (unsigned char)method[i];
        if (!cv.covered[i] && (b ? !strchr(" \t\r\n:?&=", b) : 1))
            hidden = 1;
    }
    free(cv.covered);
    return hidden;
}

/* What endpoint_uri_guard found, recorded on the connection as a value of a
 * kind no client can send before the body (a trailer), so that
 * endpoint_check_framing refuses the request on its first call. */
#define URI_REFUSED_KEY "restps-uri-refused"
static const char uri_too_long[] = "the request target is over " STR(ENDPOINT_URI_MAX) " bytes";
static const char uri_too_many[] = "the query has over " STR(ENDPOINT_QUERY_ARGS_MAX) " arguments";

void *endpoint_uri_guard(void *cls, const char *uri, struct MHD_Connection *c)
{
    (void)cls;
    if (!uri)
        return NULL;
    size_t n = 0, args = 0;
    const char *q = NULL;
    for (const char *p = uri; *p; p++, n++)
        if (*p == '?' && !q)
            q = p;
        else if (*p == '&' && q)
            args++;
    /* where the target ends before libmicrohttpd cuts its query off: the
     * NUL it wrote over the space before the version, unless the target
     * holds a NUL (head_hides_bytes) */
    MHD_set_connection_value(c, MHD_FOOTER_KIND, URI_END_KEY, uri + n);
    const char *why = n > ENDPOINT_URI_MAX ? uri_too_long : args >= ENDPOINT_QUERY_ARGS_MAX ? uri_too_many : NULL;
    if (!why)
        return NULL;
    /* libmicrohttpd splits the query at the '?' it found before this call
     * and parses what follows up to a NUL: end it right there, so no
     * argument is parsed (2,000 of them filled the connection's memory, and
     * its 431 was never sent). The bytes left are refused anyway. */
    if (q)
        ((char *)q)[1] = '\0';
    MHD_set_connection_value(c, MHD_FOOTER_KIND, URI_REFUSED_KEY, why);
    return NULL;
}

unsigned endpoint_check_framing(struct MHD_Connection *c, const char *method, const char *url,
                                const char *version, char *msg, size_t cap)
{
    const char *why = MHD_lookup_connection_value(c, MHD_FOOTER_KIND, URI_REFUSED_KEY);
    if (why && (strcmp(why, uri_too_long) == 0 || strcmp(why, uri_too_many) == 0)) {
        snprintf(msg, cap, "%s", why);
        return MHD_HTTP_URI_TOO_LONG;
    }
    struct framing f = {0, 0, NULL, NULL};
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, framing_field, &f);
    if (f.bad_key) {
        snprintf(msg, cap, "header '%.60s' holds a NUL or control byte", f.bad_key);
        return MHD_HTTP_BAD_REQUEST;
    }
    if (f.ws_key) {
        snprintf(msg, cap, "header name '%.60s' holds whitespace (none may come before the colon)", f.ws_key);
        return MHD_HTTP_BAD_REQUEST;
    }
    if (head_hides_bytes(c, method, url, version)) {
        snprintf(msg, cap, "the request head holds a NUL or control byte or a folded header line");
        return MHD_HTTP_BAD_REQUEST;
    }
    if (f.n_cl && f.n_te) {
        snprintf(msg, cap, "both Content-Length and Transfer-Encoding: the body's length is ambiguous");
        return MHD_HTTP_BAD_REQUEST;
    }
    return 0;
}

enum MHD_Result endpoint_reply_close(struct MHD_Connection *c, unsigned status, const char *msg)
{
    char *s = NULL;
    size_t n;
    char clean[ENDPOINT_ERROR_MAX];
    snprintf(clean, sizeof(clean), "%s", msg);
    for (char *p = clean; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e)
            *p = '?';
    s = endpoint_json_text(json_pack("{s:s}", "error", clean), &n);
    if (!s)
        return MHD_NO;
    struct MHD_Response *resp = endpoint_text_response(s, n, "application/json");
    if (!resp)
        return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    return endpoint_queue(c, status, resp);
}
