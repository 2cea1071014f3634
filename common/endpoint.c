/* endpoint.c - JSON replies, error replies and loopback hosts for every
 * libmicrohttpd endpoint (endpoint.h). */
#include "endpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jsonmem.h"

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
