/* waiters.h - psd's one list of parked requests: every long poll (GET
 * /v1/params?min_step=, ?min_clock=) and every SSE stream (GET /v1/events)
 * with nothing to send is suspended (libmicrohttpd) and kept here until the
 * level it waits for reaches its mark, its deadline passes, or psd stops.
 *
 * A level per channel (WAIT_STEP, WAIT_CLOCK, WAIT_FEED: server.h): either
 * stored (waiters_raise: it only goes up) or read from a function each time
 * it is used (waiters_level_from: a level that may also go down). No busy
 * polling: a change resumes exactly the requests it satisfies; the deadlines
 * and (once a second) departed clients are watched by a job on the ticker. */
#ifndef RESTPS_WAITERS_H
#define RESTPS_WAITERS_H

#include <microhttpd.h>
#include <stdint.h>

#include "ticker.h"

#define WAITERS_CHANNELS 4

typedef struct waiters waiters;

/* Every level 0; the deadlines run as a job on t. NULL when out of memory. */
waiters *waiters_new(ticker *t);
/* Resumes everyone still parked (ticker_stop first). */
void waiters_free(waiters *w);

/* The channel's level comes from fn(arg), read under the waiters' lock each
 * time it is used: at every new wait and every waiters_changed. (A level
 * computed by callers outside the lock could be stored after a newer, lower
 * one, and release a wait the bound still holds.) fn must not call back into
 * the waiters. */
void waiters_level_from(waiters *w, int ch, int64_t (*fn)(void *), void *arg);
/* A stored level moved up to `level` (never down): resume whoever it satisfies. */
void waiters_raise(waiters *w, int ch, int64_t level);
/* A level read from its function may have moved: read it, resume whoever it satisfies. */
void waiters_changed(waiters *w, int ch);

/* Park conn (already suspended by the caller) until the level of ch is >=
 * min or deadline_ms (CLOCK_MONOTONIC ms) passes; a client that hung up is
 * noticed within about a second. When the level is already there (or psd is
 * stopping), conn is resumed at once. *flag is set to 1 when resumed (the
 * handler then answers). */
void waiters_add(waiters *w, int ch, struct MHD_Connection *conn, int64_t min, int64_t deadline_ms,
                 int *flag);
/* From a libmicrohttpd callback of conn's own (a content reader): unless the
 * level of ch is already >= min, psd is stopping or the deadline passed,
 * suspend conn and park it as above (but not watched for a departed client:
 * its next write finds that). 1 parked, 0 not (look again). */
int waiters_park(waiters *w, int ch, struct MHD_Connection *conn, int64_t min, int64_t deadline_ms);
/* A connection that closed while parked: forget it. */
void waiters_remove(waiters *w, struct MHD_Connection *conn);

/* Resume everyone and park nobody from now on (shutdown). How many were parked. */
int waiters_wake_all(waiters *w);
/* 1 once waiters_wake_all ran. */
int waiters_stopping(waiters *w);
/* How many are parked on ch now. */
int waiters_count(waiters *w, int ch);

#endif
