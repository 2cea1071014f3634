/* web.c - serve the embedded page: content types, ETag, Cache-Control. */
#include "web.h"

#include <string.h>

#include "routes.h"

enum MHD_Result h_web(request *r)
{
    for (size_t i = 0; i < n_web_assets; i++) {
        const struct web_asset *a = &web_assets[i];
        if (strcmp(a->path, r->url) != 0)
            continue;
        const char *headers[] = {MHD_HTTP_HEADER_ETAG, a->etag, MHD_HTTP_HEADER_CACHE_CONTROL,
                                 "no-cache", NULL};
        const char *inm = http_header(r, MHD_HTTP_HEADER_IF_NONE_MATCH);
        if (inm && (strstr(inm, a->etag) || strcmp(inm, "*") == 0))
            return http_reply_parts(r, MHD_HTTP_NOT_MODIFIED, a->content_type, NULL, 0, NULL, 0,
                                    NULL, 0, headers);
        struct http_part part = {a->data, a->len};
        return http_reply_parts(r, MHD_HTTP_OK, a->content_type, NULL, 0, &part, 1, NULL, 0,
                                headers);
    }
    return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no such file '%.200s'", r->url);
}
