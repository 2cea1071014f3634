/* step_timeline.h - what a worker's steps spent their time on, for the ps's
 * live timeline (GET /v1/timeline, the page's timeline panel): spans of
 * pulling, waiting (and for what), computing and pushing, each with its
 * step, kept until the heartbeat takes them to every ps (POST
 * /v1/heartbeat's "timeline"). The times are this host's monotonic clock;
 * they leave as offsets from the moment they are sent, which the ps anchors
 * at its own clock when the heartbeat arrives, so hosts' clocks need not
 * agree. Thread-safe: the training thread adds, the heartbeat takes. */
#ifndef RESTPS_STEP_TIMELINE_H
#define RESTPS_STEP_TIMELINE_H

#include <jansson.h>
#include <stdint.h>

typedef enum { TL_PULL, TL_WAIT, TL_COMPUTE, TL_PUSH, TL_KINDS } tl_kind;

/* "pull", "wait", "compute", "push" */
const char *tl_kind_name(tl_kind k);

typedef struct step_timeline step_timeline;

step_timeline *step_timeline_new(void);
void step_timeline_free(step_timeline *t);

/* A span from t0 to t1 (clk_mono_secs) of step; why: what a wait waits for
 * (copied; NULL for the other kinds). The oldest spans not yet taken go
 * first when more than a heartbeat's worth pile up. */
void step_timeline_add(step_timeline *t, tl_kind k, int64_t step, double t0, double t1, const char *why);

/* The spans added since the last take as a JSON array of
 * [kind, step, start_ms, end_ms(, why)] with times relative to now (<= 0),
 * or NULL when there are none. */
json_t *step_timeline_take(step_timeline *t, double now);

#endif
