/* changes.h - psd's one change notification. The store says what moved (the
 * step, with its loss; a worker's clock or the live workers), the history
 * says its feed moved (a step recorded, the evaluator's report: training.c),
 * and this passes it on to whoever follows it: the parked requests
 * (waiters: WAIT_STEP, WAIT_CLOCK, WAIT_FEED) and the history. */
#ifndef RESTPS_CHANGES_H
#define RESTPS_CHANGES_H

#include "server.h"

/* Wire the store and the history to the waiters (once, before the HTTP
 * server starts and after a checkpoint is restored). */
void changes_follow(server *srv);

#endif
