/* web.h - the monitoring page's files, compiled into psd from web/ by
 * scripts/embed_web.sh (build/web_assets.c). */
#ifndef RESTPS_WEB_H
#define RESTPS_WEB_H

#include <stddef.h>

struct web_asset {
    const char *path;          /* "/", "/app.js", "/style.css" */
    const char *content_type;
    const unsigned char *data;
    size_t len;
    const char *etag;          /* quoted, from the content's hash */
};
extern const struct web_asset web_assets[];
extern const size_t n_web_assets;

#endif
