/* metrics.h - what psd counts for GET /metrics (Prometheus text exposition
 * format 0.0.4): requests by route, method and status, latency histograms,
 * bytes in and out, pulls and pushes by result; the rest of the exposition
 * (global_step, loss, workers, store sizes) is read when it is served.
 * Thread-safe and lock-free on the request path (atomics; a mutex only the
 * first time a (route, method) or status is seen).
 *
 * Results, as the exposition labels them:
 * - restps_pulls_total{result}: GET /v1/params and GET /v1/vars/{name}
 *   (HEAD is not a pull): ok (200, sent whole), not_modified (304), refused
 *   (any 4xx/5xx), aborted (the client left before the answer went out whole).
 * - restps_pushes_total{result}: POST /v1/grads and POST /v1/vars/{name}/grad:
 *   applied, pending (sync: kept for its step), stale (sync: dropped),
 *   duplicate (a push id or (worker, step) already seen), refused (any
 *   4xx/5xx, the token check and the size limit included), aborted (the client
 *   left before the server answered). The accepted bulk outcomes come from
 *   workers.c (workers_outcomes); a one-variable gradient is always applied. */
#ifndef RESTPS_METRICS_H
#define RESTPS_METRICS_H

#include "request.h"

struct metrics;
struct metrics *metrics_new(void);
void metrics_free(struct metrics *m);

/* Called once per request when it ends (routes_completed): r->route (may be
 * NULL for unknown paths), r->status, r->t_start_ns, r->bytes_in/out.
 * completed: the answer went out whole. m may be NULL. */
void metrics_observe(struct metrics *m, const request *r, int completed);

/* The exposition of m and of srv's shard, workers and saver, malloc'd, its
 * length in *len; NULL when out of memory. */
char *metrics_text(struct metrics *m, server *srv, size_t *len);

#endif
