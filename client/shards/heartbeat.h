/* heartbeat.h - a sync worker's lease on every ps (POST /v1/heartbeat each
 * interval), so a step that takes long to compute is not mistaken for a dead
 * worker. A thread with its own libps client; failures are ignored (the next
 * pull or push says what is wrong). */
#ifndef RESTPS_HEARTBEAT_H
#define RESTPS_HEARTBEAT_H

#include "libps/libps.h"

typedef struct heartbeat heartbeat;

/* Takes ownership of pc (freed by heartbeat_stop). NULL when it cannot start. */
heartbeat *heartbeat_start(ps_client *pc, int worker, long interval_ms);
void heartbeat_stop(heartbeat *h);

#endif
