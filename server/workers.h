/* workers.h - what ps knows of each worker from its pushes: last step, last
 * seen (duplicates count here), pushes (not duplicates), stale gradients
 * dropped; and of all pushes together: how many
 * ended each way, and examples per second. For /v1/status, /metrics, the page.
 * Thread-safe (one mutex, held for a few memory operations). */
#ifndef RESTPS_WORKERS_H
#define RESTPS_WORKERS_H

#include <jansson.h>
#include <stdint.h>

/* Records kept at most; past that the worker seen longest ago is forgotten. */
#define WORKERS_MAX_RECORDS 4096
/* Seen within this many seconds: live. */
#define WORKERS_LIVE_SECS 10.0
/* examples_per_sec is over this sliding window. */
#define WORKERS_RATE_WINDOW_SECS 5

struct workers;
struct workers *workers_new(void);
void workers_free(struct workers *w);

/* An accepted bulk push (POST /v1/grads) from worker (-1: the push did not
 * say; then only the totals count it), computed at step (-1 unknown), of
 * batch_size examples (-1 unknown); outcome is a STORE_PUSH_* value. The
 * examples of applied and pending pushes count toward examples_per_sec
 * (duplicates and stale ones do not: they add nothing to training). */
void workers_seen(struct workers *w, long long worker, long long step, long long batch_size,
                  int outcome);

struct store;
/* Add to the /v1/status object: "workers" (the list below), "live_workers"
 * (pushed in the last WORKERS_LIVE_SECS) and "examples_per_sec". */
void workers_status(struct workers *w, struct store *s, json_t *status);

/* [{"worker","last_step","last_seen_secs_ago","pushes","stale_dropped"}...]
 * sorted by worker; last_step null when no push said its step. */
json_t *workers_json(struct workers *w);
/* Workers seen within the last `secs` seconds. */
int workers_live(struct workers *w, double secs);

/* One worker's record, copied out. */
typedef struct workers_rec {
    long long worker;
    long long last_step;       /* the highest step its pushes said; -1 none */
    double last_seen_secs_ago; /* since its last accepted push */
    uint64_t pushes;           /* accepted pushes but duplicates (replays) */
    uint64_t stale_dropped;
} workers_rec;
/* Every record, sorted by worker, into *out (malloc'd; free it). Returns how
 * many, or -1 when out of memory. */
int workers_list(struct workers *w, workers_rec **out);
/* Accepted bulk pushes by outcome, indexed by STORE_PUSH_* (4 values). */
void workers_outcomes(struct workers *w, uint64_t out[4]);
/* Examples of applied and pending pushes per second over the last
 * WORKERS_RATE_WINDOW_SECS seconds (over the time since the first push when
 * that is shorter, but at least 1 s). */
double workers_examples_per_sec(struct workers *w);

#endif
