/* web_assets.h - the monitoring page's files (web/index.html, app.js,
 * style.css), compiled in by scripts/embed_web.sh into
 * build/common/web_assets_table.c, and the one answer that serves them
 * (web_asset_reply): psd, a ring worker's endpoint and a pipeline stage's
 * all serve the page with it. */
#ifndef RESTPS_WEB_ASSETS_H
#define RESTPS_WEB_ASSETS_H

#include <stddef.h>

#include "http_server.h"

struct web_asset {
    const char *path;          /* "/", "/app.js", "/style.css" */
    const char *content_type;
    const unsigned char *data;
    size_t len;
    const char *etag;          /* quoted, from the content's hash */
};
/* The generated table. */
extern const struct web_asset web_assets[];
extern const size_t n_web_assets;

/* The file served at path ("/app.js"), or NULL. */
const struct web_asset *web_asset_find(const char *path);

/* Answer a GET (or HEAD) of the file a: 200 with its bytes, or 304 with no
 * body when If-None-Match names its ETag (or is "*"); either way with its
 * Content-Type, its ETag and Cache-Control: no-cache. */
enum MHD_Result web_asset_reply(http_req *r, const struct web_asset *a);

#endif
