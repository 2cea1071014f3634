/* metrics.h - what psd counts for GET /metrics (Prometheus text exposition):
 * requests by route and status, latency histograms, bytes in and out, pulls
 * and pushes by result. Thread-safe; cheap on the request path. */
#ifndef RESTPS_METRICS_H
#define RESTPS_METRICS_H

#include "http.h"

struct metrics;
struct metrics *metrics_new(void);
void metrics_free(struct metrics *m);

/* Called once per request when it ends (routes_completed): r->route (may be
 * NULL for unknown paths), r->status, r->t_start_ns, r->bytes_in/out.
 * completed: the answer went out whole. m may be NULL. */
void metrics_observe(struct metrics *m, const request *r, int completed);

#endif
