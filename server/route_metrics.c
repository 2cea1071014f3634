/* route_metrics.c - GET /metrics: the Prometheus text exposition (metrics.h). */
#include "metrics.h"
#include "routes.h"

enum MHD_Result h_metrics(request *r)
{
    size_t len;
    char *text = metrics_text(req_srv(r)->metrics, req_srv(r), &len);
    if (!text)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    return http_reply_text(r, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len);
}
