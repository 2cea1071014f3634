/* ticker.h - one thread for psd's timed work: jobs registered on it run one
 * after another, each when it asked to (the sync step's lease tick every
 * 100 ms, the parked requests' nearest deadline). A job returns when it
 * wants to run next; ticker_at brings that forward (a new deadline sooner
 * than the one planned). Jobs must not block: a save (disk) and the shards
 * poller (HTTP to the other ps tasks) keep threads of their own. */
#ifndef RESTPS_TICKER_H
#define RESTPS_TICKER_H

#include <stdint.h>

/* When nothing is planned: the job runs again only once ticker_at asks. */
#define TICKER_IDLE INT64_MAX

typedef struct ticker ticker;
/* Runs on the ticker's thread with no ticker lock held; now_ms is
 * CLOCK_MONOTONIC ms. Returns the next time to run (CLOCK_MONOTONIC ms), or
 * TICKER_IDLE. */
typedef int64_t (*ticker_fn)(void *arg, int64_t now_ms);

/* Starts the thread. NULL when it (or memory) cannot. */
ticker *ticker_new(void);
/* Stops the thread (a job running finishes first) and frees t. */
void ticker_free(ticker *t);

/* Register fn(arg), first run at first_ms. Returns the job's id (>= 0), or -1
 * when out of memory. */
int ticker_add(ticker *t, ticker_fn fn, void *arg, int64_t first_ms);
/* Run job id no later than at_ms (earlier plans stand). Safe from any thread,
 * the job's own included, and from under the lock the job takes. */
void ticker_at(ticker *t, int id, int64_t at_ms);

#endif
