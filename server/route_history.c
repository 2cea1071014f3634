/* route_history.c - GET /v1/history[?since=STEP]: global_step, loss and the
 * evaluator's reports over time (history.h). */
#include <errno.h>
#include <stdlib.h>

#include "history.h"
#include "routes.h"

enum MHD_Result h_history(request *r)
{
    server *srv = req_srv(r);
    long long since = -1;
    const char *s = http_query(r, "since");
    if (s) {
        char *end;
        errno = 0;
        since = strtoll(s, &end, 10);
        if (*s < '0' || *s > '9' || *end || errno)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                    "since must be a non-negative integer (a global_step), got '%.40s'",
                                    s);
    }
    size_t len;
    char *text = history_json(srv->history, since, store_global_step(&srv->store), &len);
    if (!text)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    return http_reply_text(r, MHD_HTTP_OK, "application/json", text, len);
}
