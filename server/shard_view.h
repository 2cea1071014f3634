/* shard_view.h - ps 0's view of the other shards: on ps 0 of a cluster with
 * two or more ps tasks, a thread fetches every other ps task's GET
 * /v1/status once a second (libcurl multi, 0.5 s to connect, 0.9 s in all)
 * for its global_step, variables and bytes; /v1/status lists them as
 * "shards". Elsewhere the list is this task alone. */
#ifndef RESTPS_SHARD_VIEW_H
#define RESTPS_SHARD_VIEW_H

#include <jansson.h>

#include "cluster.h"

struct shard_view;

/* NULL when out of memory. */
struct shard_view *shard_view_new(void);
/* Stops the thread first. NULL is fine. */
void shard_view_free(struct shard_view *v);

/* The other ps tasks speak HTTPS; ca_file (may be NULL: the system's) to
 * trust for them. Before shard_view_start. */
void shard_view_set_tls(struct shard_view *v, const char *ca_file);
/* Remember this task's place in the cluster (listening: where it really
 * listens, --port/--bind); on ps 0 with more than one ps task, start the
 * thread (auth_token: sent as a bearer token when not NULL). Call before
 * the HTTP server answers anyone: /v1/status reads what this sets. 0, or -1
 * when the thread could not start (then the list is this task alone). */
int shard_view_start(struct shard_view *v, const cluster_spec *c, const char *auth_token,
                     const char *listening);
/* Stop the thread (before the HTTP server stops). Safe to call twice. */
void shard_view_stop(struct shard_view *v);

/* Add "shards" to the /v1/status object: every ps task's summary, this one
 * from the status object's own fields (task, global_step, variables, bytes). */
void shard_view_status(struct shard_view *v, json_t *status);

#endif
