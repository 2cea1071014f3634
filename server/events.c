/* events.c - GET /v1/events. (stub: filled in by the history work) */
#include "routes.h"

enum MHD_Result h_events(request *r)
{
    return http_reply_error(r, MHD_HTTP_NOT_IMPLEMENTED, "not built yet");
}
