/* route_web.c - GET /, /app.js, /style.css: the embedded monitoring page
 * (common/web_assets.h), with content types, ETag, Cache-Control and
 * If-None-Match. */
#include <string.h>

#include "routes.h"
#include "web_assets.h"

enum MHD_Result h_web(request *r)
{
    const struct web_asset *a = web_asset_find(r->url);
    if (!a)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no such file '%.200s'", r->url);
    const char *headers[] = {MHD_HTTP_HEADER_ETAG, a->etag, MHD_HTTP_HEADER_CACHE_CONTROL,
                             "no-cache", NULL};
    const char *inm = http_header(r, MHD_HTTP_HEADER_IF_NONE_MATCH);
    if (inm && (strstr(inm, a->etag) || strcmp(inm, "*") == 0))
        return reply_blobs(r, MHD_HTTP_NOT_MODIFIED, a->content_type, NULL, 0, NULL, 0,
                                NULL, 0, headers);
    struct http_part part = {a->data, a->len};
    return reply_blobs(r, MHD_HTTP_OK, a->content_type, NULL, 0, &part, 1, NULL, 0,
                            headers);
}
