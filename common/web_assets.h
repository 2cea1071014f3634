/* web_assets.h - the monitoring page's files (web/index.html, app.js,
 * style.css), compiled in by scripts/embed_web.sh into
 * build/common/web_assets_table.c: psd serves them, and so does the chief of
 * a ring job. */
#ifndef RESTPS_WEB_ASSETS_H
#define RESTPS_WEB_ASSETS_H

#include <stddef.h>

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

#endif
