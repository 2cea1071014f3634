/* web_assets.c - find one of the monitoring page's files by its path (the
 * table itself is generated: scripts/embed_web.sh), and answer a request
 * for it, honouring If-None-Match. */
#include "web_assets.h"

#include <string.h>

const struct web_asset *web_asset_find(const char *path)
{
    for (size_t i = 0; i < n_web_assets; i++)
        if (strcmp(web_assets[i].path, path) == 0)
            return &web_assets[i];
    return NULL;
}

enum MHD_Result web_asset_reply(http_req *r, const struct web_asset *a)
{
    const char *inm = http_header(r, MHD_HTTP_HEADER_IF_NONE_MATCH);
    int unchanged = inm && (strstr(inm, a->etag) || strcmp(inm, "*") == 0);
    size_t len = unchanged ? 0 : a->len;
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, (void *)a->data, MHD_RESPMEM_PERSISTENT);
    if (resp) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, a->content_type);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ETAG, a->etag);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    }
    return http_reply_response(r, unchanged ? MHD_HTTP_NOT_MODIFIED : MHD_HTTP_OK, resp, len);
}
