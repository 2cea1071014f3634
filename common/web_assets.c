/* web_assets.c - find one of the monitoring page's files by its path (the
 * table itself is generated: scripts/embed_web.sh). */
#include "web_assets.h"

#include <string.h>

const struct web_asset *web_asset_find(const char *path)
{
    for (size_t i = 0; i < n_web_assets; i++)
        if (strcmp(web_assets[i].path, path) == 0)
            return &web_assets[i];
    return NULL;
}
