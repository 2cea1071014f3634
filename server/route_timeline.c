/* route_timeline.c - GET /v1/timeline[?secs=S]: the workers' last steps as
 * they spent them (pull, wait and for what, compute, push; timeline.h), the
 * JSON the page's timeline panel draws. */
#include "routes.h"
#include "timeline.h"

enum MHD_Result h_timeline(request *r)
{
    long long secs = 10;
    if (http_query_int(r, "secs", TIMELINE_SECS_MAX, &secs) < 0 || secs < 1)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "secs must be a whole number of seconds from 1 to %d",
                                TIMELINE_SECS_MAX);
    json_t *o = timeline_json(req_srv(r)->timeline, (double)secs);
    if (!o)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory building the timeline");
    return http_reply_json(r, MHD_HTTP_OK, o);
}
