/* route_sync.c - GET /v1/sync (the sync step in progress: gradients in,
 * workers waited for; membership.h) and POST /v1/heartbeat (a worker renews
 * its lease). */
#include <stdlib.h>

#include "membership.h"
#include "routes.h"
#include "timeline.h"

enum MHD_Result h_sync(request *r)
{
    json_t *m = membership_json(req_srv(r));
    if (!m)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory building the sync state");
    return http_reply_json(r, MHD_HTTP_OK, m);
}

enum MHD_Result h_heartbeat(request *r)
{
    json_error_t je;
    json_t *j = json_loadb((const char *)req_body(r)->data, req_body(r)->len, JSON_REJECT_DUPLICATES, &je);
    int idx = body_worker(j);
    if (idx < 0) {
        json_decref(j);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "body must be {\"worker\": index}");
    }
    /* the worker's step spans for the live timeline: kept for the run's
     * workers only (memory bounded by the configuration), checked whole */
    const json_t *spans = json_object_get(j, "timeline");
    if (spans) {
        store_sync_view v;
        int workers = 0;
        if (store_get_sync_view(&req_srv(r)->store, &v) == STORE_OK) {
            workers = v.workers;
            free(v.member);
        }
        char err[256];
        if (idx < workers && timeline_add(req_srv(r)->timeline, idx, spans, err, sizeof(err)) != 0) {
            json_decref(j);
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
        }
    }
    json_decref(j);
    store_touch(&req_srv(r)->store, idx);
    int64_t step = store_global_step(&req_srv(r)->store);
    return http_reply_json(r, MHD_HTTP_OK,
                           json_pack("{s:I,s:f}", "global_step", (json_int_t)step, "lease_secs",
                                     (double)store_lease_ms(&req_srv(r)->store) / 1000.0));
}
