/* metrics.c - counters for /metrics. (stub: filled in by the metrics work) */
#include "metrics.h"

#include <stdlib.h>

#include "routes.h"

struct metrics {
    int unused;
};

struct metrics *metrics_new(void) { return calloc(1, sizeof(struct metrics)); }
void metrics_free(struct metrics *m) { free(m); }
void metrics_observe(struct metrics *m, const request *r, int completed)
{
    (void)m;
    (void)r;
    (void)completed;
}

enum MHD_Result h_metrics(request *r)
{
    return http_reply_error(r, MHD_HTTP_NOT_IMPLEMENTED, "not built yet");
}
