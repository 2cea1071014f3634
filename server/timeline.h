/* timeline.h - the workers' last steps as they spent them: spans of
 * pulling, waiting (and for what), computing and pushing, which each worker
 * sends with its heartbeat (POST /v1/heartbeat's "timeline", offsets in ms
 * from the moment it sent them, anchored here at the heartbeat's arrival)
 * and GET /v1/timeline returns; the page draws them, one row a worker. */
#ifndef RESTPS_TIMELINE_H
#define RESTPS_TIMELINE_H

#include <jansson.h>
#include <stddef.h>

#define TIMELINE_SPANS 256      /* kept per worker, the oldest go first */
#define TIMELINE_MAX_BATCH 1024 /* spans one heartbeat may carry */
#define TIMELINE_WHY_MAX 47     /* bytes of a wait's reason */
#define TIMELINE_BACK_MS 600000.0 /* how far back a span may start */
#define TIMELINE_SECS_MAX 600   /* the longest window GET /v1/timeline gives */

struct timeline;

struct timeline *timeline_new(void);
void timeline_free(struct timeline *t);

/* Add worker's spans (the heartbeat's "timeline" array: [kind, step,
 * start_ms, end_ms(, why)] with -TIMELINE_BACK_MS <= start <= end <= 0) as
 * of now. All or nothing: -1 with err (nothing kept) when one is not so. */
int timeline_add(struct timeline *t, int worker, const json_t *spans, char *err, size_t errlen);

/* {"now", "workers": [{"worker", "spans": [{kind, step, start, end(, for)}]}]}:
 * the spans that ended within the last secs seconds, times in seconds on
 * this psd's clock (since it started), oldest first. NULL: out of memory. */
json_t *timeline_json(struct timeline *t, double secs);

#endif
