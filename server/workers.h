/* workers.h - what ps knows of each worker from its pushes: last step, last
 * seen, pushes, stale gradients dropped. For /v1/status, /metrics, the page. */
#ifndef RESTPS_WORKERS_H
#define RESTPS_WORKERS_H

#include <jansson.h>
#include <stdint.h>

struct workers;
struct workers *workers_new(void);
void workers_free(struct workers *w);

/* A push from worker (>= 0) computed at step, of batch_size examples (-1
 * unknown); outcome is a STORE_PUSH_* value. */
void workers_seen(struct workers *w, long long worker, long long step, long long batch_size,
                  int outcome);

struct store;
/* Add to the /v1/status object: "workers" (the list below), "live_workers",
 * "examples_per_sec", and in sync mode "waiting_for" (workers whose gradient
 * for the current step has not arrived). */
void workers_status(struct workers *w, struct store *s, json_t *status);

/* [{"worker","last_step","last_seen_secs_ago","pushes","stale_dropped"}...] */
json_t *workers_json(struct workers *w);
/* Workers seen within the last `secs` seconds. */
int workers_live(struct workers *w, double secs);

#endif
