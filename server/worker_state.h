/* worker_state.h - what the store keeps of each worker of the run: its lease
 * (sync membership: a worker not heard from for lease_ms no longer holds up
 * a step; one that said it finished left), its stale-synchronous clocks (the
 * iteration it started, the ones it completed) and, for async runs, the
 * staleness of the gradients applied (a histogram).
 *
 * Leases and clocks are atomics, read and written without any lock (the
 * waiters read the slowest clock under their own mutex, which must not wait
 * behind a writer applying a large gradient). The staleness figures are the
 * store's: written under its write lock, read under its read lock. */
#ifndef RESTPS_WORKER_STATE_H
#define RESTPS_WORKER_STATE_H

#include <jansson.h>
#include <stdint.h>

#include "store.h" /* STORE_MAX_WORKERS */

/* staleness histogram: 0, 1, 2, 3, 4-7, 8-15, 16-31, 32-63, 64 and more */
#define WORKER_STALENESS_BUCKETS 9

typedef struct worker_state {
    int64_t lease_ms;  /* set before anyone is served */
    _Atomic int n_workers; /* of the run (the configuration's workers) */
    _Atomic int64_t lease_until[STORE_MAX_WORKERS]; /* CLOCK_MONOTONIC ms */
    _Atomic unsigned char left[STORE_MAX_WORKERS];
    _Atomic int64_t clock_started[STORE_MAX_WORKERS];
    _Atomic int64_t clock_done[STORE_MAX_WORKERS];
    int64_t staleness_hist[WORKER_STALENESS_BUCKETS];
    int64_t staleness_sum, staleness_max, staleness_count;
} worker_state;

/* One worker, lease 10 s. */
void worker_state_init(worker_state *ws);

/* A run of n workers begins (configured, or restored): each gets a lease
 * from now and none has left. */
void worker_state_start(worker_state *ws, int n, int64_t now_ms);
/* worker's request renews its lease (and it is back if it had left). */
void worker_state_touch(worker_state *ws, int worker, int64_t now_ms);
/* The worker finished (or stops): it leaves the run now. */
void worker_state_leave(worker_state *ws, int worker);
/* 1: its lease runs and it has not left. */
int worker_state_alive(const worker_state *ws, int worker, int64_t now_ms);
/* 1: it said it left. */
int worker_state_left(const worker_state *ws, int worker);

/* The clocks: worker starts iteration `clock`; has completed `done` (raised,
 * never lowered: 1 when raised). */
void worker_state_clock_start(worker_state *ws, int worker, int64_t clock);
int worker_state_clock_done(worker_state *ws, int worker, int64_t done);
/* The fewest iterations completed by a live worker of the run (INT64_MAX
 * when none is live). */
int64_t worker_state_min_clock(const worker_state *ws, int64_t now_ms);

/* An applied async gradient was `staleness` steps old (store's write lock). */
void worker_state_staleness(worker_state *ws, int64_t staleness);
/* {"count","mean","max","buckets":[{"le","count"}...]} (store's read lock). */
json_t *worker_state_staleness_json(const worker_state *ws);
/* {"<w>":{"started","done"}...} for the first `workers` workers. */
json_t *worker_state_clocks_json(const worker_state *ws, int workers);

#endif
