/* waiters.h - long polls: requests parked (libmicrohttpd suspend) until the
 * shard's global_step reaches what they wait for, or their deadline passes.
 * No busy polling: a step change resumes exactly the requests it satisfies;
 * one thread resumes the ones whose deadline passed or whose client hung up. */
#ifndef RESTPS_WAITERS_H
#define RESTPS_WAITERS_H

#include <microhttpd.h>
#include <stdint.h>

typedef struct waiters waiters;

/* step: the shard's global_step now. NULL when out of memory. */
waiters *waiters_new(int64_t step);
/* Resumes everyone still waiting, stops the timer thread. */
void waiters_free(waiters *w);

/* Park conn (already suspended by the caller) until step >= min_step or
 * deadline_ms (CLOCK_MONOTONIC milliseconds). When the step is already there,
 * conn is resumed at once. *flag is set to 1 when resumed (the handler then
 * answers). */
void waiters_add(waiters *w, struct MHD_Connection *conn, int64_t min_step, int64_t deadline_ms,
                 int *flag);

/* A connection that closed while parked: forget it. */
void waiters_remove(waiters *w, struct MHD_Connection *conn);

/* The step moved to `step`: resume whoever it satisfies. */
void waiters_step(waiters *w, int64_t step);
/* A level that may also go down (the slowest worker's clock: a worker that
 * rejoins lowers it) comes from fn(arg), read under the waiters' lock each
 * time it is used: at every new wait and every waiters_relevel. (A level
 * computed by callers outside the lock could be stored after a newer, lower
 * one, and release a wait the bound still holds.) fn must not call back into
 * these waiters. */
void waiters_level_from(waiters *w, int64_t (*fn)(void *), void *arg);
/* The level may have moved: read it and resume whoever it satisfies. */
void waiters_relevel(waiters *w);
/* Resume everyone and park nobody from now on (shutdown). */
void waiters_wake_all(waiters *w);

/* How many are parked now. */
int waiters_count(waiters *w);

#endif
