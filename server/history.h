/* history.h - global_step and loss over time in bounded memory: a ring of the
 * recent points plus a decimated long history, so a run of millions of steps
 * keeps GET /v1/history and the page fast. */
#ifndef RESTPS_HISTORY_H
#define RESTPS_HISTORY_H

#include <jansson.h>
#include <stdint.h>

struct history;
struct history *history_new(void);
void history_free(struct history *h);

/* The shard's global_step moved to step; loss is the last loss (has_loss 0:
 * none yet). Called after the store's lock is released. */
void history_record(struct history *h, int64_t step, int has_loss, double loss);

/* Add to the /v1/status object: "steps_per_sec" and, on ps 0, "shards" (every
 * ps task's status summary). */
void history_status(struct history *h, json_t *status);

#endif
