/* heartbeat.h - a sync worker's lease on every ps (POST /v1/heartbeat each
 * interval), so a step that takes long to compute is not mistaken for a dead
 * worker. A thread with its own libps client; failures are ignored (the next
 * pull or push says what is wrong). */
#ifndef RESTPS_HEARTBEAT_H
#define RESTPS_HEARTBEAT_H

#include "libps/libps.h"
#include "shards/step_timeline.h"

typedef struct heartbeat heartbeat;

/* Takes ownership of pc (freed by heartbeat_stop). NULL when it cannot start. */
heartbeat *heartbeat_start(ps_client *pc, int worker, long interval_ms);
void heartbeat_stop(heartbeat *h);
/* From now on every beat also carries the spans t gathered since the last
 * one (the ps's live timeline); t must outlive h. NULL: none. */
void heartbeat_set_timeline(heartbeat *h, step_timeline *t);
/* From now on every beat carries this process's instance string (the task
 * id's claim on the ps, server/task_claims.h; copied); a beat refused because
 * another process holds the id is said once on stderr. NULL: none. */
void heartbeat_set_instance(heartbeat *h, const char *instance);

#endif
