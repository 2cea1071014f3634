/* history.h - global_step and loss over time in bounded memory: a ring of the
 * recent points plus a decimated long history, so a run of millions of steps
 * keeps GET /v1/history and the page fast; the evaluator's reports likewise.
 *
 * Also the change feed behind GET /v1/events (route_events.c): a version
 * that moves whenever global_step or the evaluator's report does (the
 * streams wait for it in psd's waiters, WAIT_FEED). The other shards' status
 * is shard_view.h's.
 *
 * Thread-safe: the points under one mutex (held for a few memory operations
 * on the training path), the feed an atomic counter.
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

/* Points kept: the last HISTORY_RECENT at full resolution, and
 * HISTORY_LONG_SLOTS of the older ones (every stride-th; when full, every
 * other one is dropped and the stride doubles; the first point always stays).
 * An answer holds at most HISTORY_RECENT + HISTORY_LONG_SLOTS points. */
#define HISTORY_RECENT 2048
#define HISTORY_LONG_SLOTS 2048

struct history;
/* NULL when out of memory. */
struct history *history_new(void);
void history_free(struct history *h);

/* The shard's global_step moved to step; loss is the last loss (has_loss 0:
 * none yet: no point is kept, but steps_per_sec and the feed move). Called
 * after the store's lock is released; a step below the last one kept is
 * not kept, the same step again replaces it (and goes to the event file
 * once more: TensorBoard keeps the newer of two points of one step). */
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

/* Add "steps_per_sec" to the /v1/status object. */
void history_status(struct history *h, json_t *status);

/* ---- the change feed (GET /v1/events) ---- */

/* GET /v1/history's body: {"global_step": global_step, "points": [[step,
 * loss, unix time], ...], "eval": [[step, loss, accuracy, time], ...]} with
 * the points after step `since` (-1: all), and a newline; malloc'd, its
 * length in *len. NULL when out of memory. */
char *history_json(struct history *h, long long since, int64_t global_step, size_t *len);

/* Moves on every history_record and history_record_eval. */
uint64_t history_version(struct history *h);
/* fn(ctx) runs (on the recording thread) each time the version moved. Set
 * once, before anything records. */
void history_on_move(struct history *h, void (*fn)(void *ctx), void *ctx);

#endif
