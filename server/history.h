/* history.h - global_step and loss over time in bounded memory: a ring of the
 * recent points plus a decimated long history, so a run of millions of steps
 * keeps GET /v1/history and the page fast; the evaluator's reports likewise.
 *
 * Also the change feed behind GET /v1/events (events.c): a version that moves
 * whenever global_step or the evaluator's report does (the streams wait for
 * it in psd's waiters, WAIT_FEED); and, on ps 0 of a cluster with several ps tasks,
 * the other shards' status, fetched once a second (libcurl) for "shards".
 *
 * Thread-safe: the points under one mutex (held for a few memory operations
 * on the training path), the feed an atomic counter, the shards under a
 * second mutex.
 *
 * Test hook: when the environment variable RESTPS_TEST_SYNTHETIC_HISTORY=N
 * (1 <= N <= 100000000) is set, history_new prefills N steps of a synthetic
 * decaying loss (steps 1..N, one step per millisecond ending now) and an
 * evaluator report every N/50 steps, so tests can check that a long run stays
 * fast. history_last_step() then says N (psd starts its global_step there). */
#ifndef RESTPS_HISTORY_H
#define RESTPS_HISTORY_H

#include <jansson.h>
#include <stdint.h>

#include "cluster.h"

/* Points kept: the last HISTORY_RECENT at full resolution, and
 * HISTORY_LONG_SLOTS of the older ones (every stride-th; when full, every
 * other one is dropped and the stride doubles; the first point always stays).
 * An answer holds at most HISTORY_RECENT + HISTORY_LONG_SLOTS points. */
#define HISTORY_RECENT 2048
#define HISTORY_LONG_SLOTS 2048

struct history;
/* NULL when out of memory. */
struct history *history_new(void);
/* Stops what history_start_shards started. */
void history_free(struct history *h);

/* The shard's global_step moved to step; loss is the last loss (has_loss 0:
 * none yet: no point is kept, but steps_per_sec and the feed move). Called
 * after the store's lock is released; a step at or below the last one kept
 * is not kept again. */
void history_record(struct history *h, int64_t step, int has_loss, double loss);
/* The evaluator reported loss and accuracy at step (h_eval_post). A report
 * for the step of the last one replaces it; one for an older step is not
 * kept (the feed moves either way). */
void history_record_eval(struct history *h, int64_t step, double loss, double accuracy);
/* The highest step kept (0 when none). */
int64_t history_last_step(struct history *h);
/* /v1/status's steps_per_sec. */
double history_steps_per_sec(struct history *h);

/* TensorBoard (summaries.c): every training point kept from now on goes to
 * train as "loss", every evaluator report kept to eval as "loss" and
 * "accuracy", with the point's own step and time, so the event files hold
 * what /v1/history answers. NULL, NULL detaches (before closing them). */
struct tfevents;
void history_set_events(struct history *h, struct tfevents *train, struct tfevents *eval);

/* Add to the /v1/status object: "steps_per_sec" and "shards" (on ps 0 of a
 * cluster with several ps tasks: every ps task's summary, itself included
 * from the status object's own fields; elsewhere just itself). */
void history_status(struct history *h, json_t *status);

/* Remember this task's place in the cluster; on ps 0 with more than one ps
 * task, start the thread that fetches every other ps task's GET /v1/status
 * once a second (auth_token: sent as a bearer token when not NULL). Call once
 * the HTTP server runs. 0, or -1 when the thread could not start. */
/* The other ps tasks speak HTTPS; ca_file (may be NULL: the system's) to
 * trust for them. Before history_start_shards. */
void history_set_tls(struct history *h, const char *ca_file);

int history_start_shards(struct history *h, const cluster_spec *c, const char *auth_token,
                         const char *listening);

/* ---- the change feed (GET /v1/events) ---- */

/* Moves on every history_record and history_record_eval. */
uint64_t history_version(struct history *h);
/* fn(ctx) runs (on the recording thread) each time the version moved. Set
 * once, before anything records. */
void history_on_move(struct history *h, void (*fn)(void *ctx), void *ctx);
/* Before MHD_stop_daemon: stop the shards thread. */
void history_stop(struct history *h);

#endif
