/* membership.h - which workers a sync step waits for: a job on psd's ticker
 * that completes a step once the workers still alive have pushed (leases run
 * out between pushes), and the view of the step in progress (whom it has
 * gradients from, whom it waits for, for how long) that GET /v1/sync and
 * /v1/status serve (route_sync.c, route_status.c). The leases themselves live
 * in the store (store_touch, store_leave; POST /v1/heartbeat renews one). */
#ifndef RESTPS_MEMBERSHIP_H
#define RESTPS_MEMBERSHIP_H

#include <jansson.h>

#include "server.h"

/* Adds the job to srv->ticker (every 100 ms). 0, or -1 out of memory. */
int membership_start(server *srv);

/* The /v1/sync object (also "sync" in every ps task's /v1/status). In
 * async mode "waiting_for", "dead" and "left" are empty. */
json_t *membership_json(server *srv);

#endif
