/* route_web.c - GET /, /app.js, /style.css: the embedded monitoring page
 * (common/web_assets.h), with content types, ETag, Cache-Control and
 * If-None-Match. */
#include "routes.h"
#include "web_assets.h"

enum MHD_Result h_web(request *r)
{
    const struct web_asset *a = web_asset_find(r->url);
    if (!a)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no such file '%.200s'", r->url);
    return web_asset_reply(r, a);
}
