/* history.h - global_step and loss over time in bounded memory: a ring of the
 * recent points plus a decimated long history, so a run of millions of steps
 * keeps GET /v1/history and the page fast; the evaluator's reports likewise.
 *
 * Also the change feed behind GET /v1/events (events.c): a version that moves
 * whenever global_step or the evaluator's report does, and parked
 * connections woken by it; and, on ps 0 of a cluster with several ps tasks,
 * the other shards' status, fetched once a second (libcurl) for "shards".
 *
 * Thread-safe: the points under one mutex (held for a few memory operations
 * on the training path), the feed under another, the shards under a third.
 *
 * Test hook: when the environment variable RESTPS_TEST_SYNTHETIC_HISTORY=N
 * (1 <= N <= 100000000) is set, history_new prefills N steps of a synthetic
 * decaying loss (steps 1..N, one step per millisecond ending now) and an
 * evaluator report every N/50 steps, so tests can check that a long run stays
 * fast. history_last_step() then says N (psd starts its global_step there). */
#ifndef RESTPS_HISTORY_H
#define RESTPS_HISTORY_H

#include <jansson.h>
#include <microhttpd.h>
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
/* Stops what history_start_shards started (history_stop first when the HTTP
 * server runs). */
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
/* Wake on a version other than `seen`; HISTORY_NO_WAKE: on the deadline only. */
#define HISTORY_NO_WAKE UINT64_MAX
/* From a libmicrohttpd callback of conn's own (epoll mode): unless the
 * version already differs from `seen` or the feed stopped, suspend conn and
 * park it until the version moves (unless seen is HISTORY_NO_WAKE),
 * deadline_ms (CLOCK_MONOTONIC ms) passes, or history_stop. 1 parked
 * (return 0 from the content reader), 0 not parked (look again). A parked
 * connection is never closed by libmicrohttpd, so the caller needs no
 * unparking of its own. */
int history_park(struct history *h, struct MHD_Connection *conn, uint64_t seen,
                 int64_t deadline_ms);
/* 1 once history_stop ran. */
int history_stopped(struct history *h);
/* Before MHD_stop_daemon: resume every parked connection and park no more,
 * stop the shards thread. Returns how many were parked. */
int history_stop(struct history *h);

#endif
