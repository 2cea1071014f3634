/* push_stream.h - POST /v1/grads applied as its body arrives (issue 33,
 * part 4): libmicrohttpd's pieces of the body go straight through the
 * optimizer into the variables' next versions (store.h, store_stream), one
 * pass over the bytes, with no copy of the body and no fresh pages.
 *
 * The first bytes (the 8-byte prefix and the safetensors header) are kept
 * and checked as the route checks them (grads_head); a push the store can
 * stream (async sgd, no clipping or moving averages, float32/BF16/F16
 * gradients of existing dense variables, no push id seen) is then applied
 * piece by piece: each element widened (BF16/F16, divided by the loss
 * scale), checked finite as the float32 it becomes, its next value computed;
 * a piece may end anywhere, even inside an element. Nothing is visible until
 * the whole body came and every value was finite: then the commit publishes
 * all of it at once; a NaN or Inf, or a body cut short, changes nothing.
 * Any other push (or one whose header does not pass) is read whole, as
 * before, and the route applies it as it always did. */
#ifndef RESTPS_PUSH_STREAM_H
#define RESTPS_PUSH_STREAM_H

#include "request.h"
#include "store.h"

/* What a push's metadata and headers say, checked (route_grads.c). */
typedef struct grads_head {
    long long worker, step, batch, clock;
    double loss_scale; /* 1 unless metadata loss_scale */
    store_push_meta meta; /* push_id, loss, worker, step, clock (body, in_body: the caller's) */
} grads_head;

/* route_grads.c: the checks of a parsed body's metadata, X-Push-Id and
 * dtypes, in the route's order and words: 0, or -1 with *status and err. */
int grads_check_head(request *r, const st_file *f, grads_head *h, int *status, char *err, size_t errlen);

/* Bodies smaller than this are read whole (they come in a few pieces, and
 * two passes over them stay in the caches). */
#define PUSH_STREAM_MIN_BYTES ((uint64_t)1 << 20)

typedef struct push_stream push_stream;

/* In before_body (Content-Length known): a stream for r, installed as its
 * body sink (http_body_sink); NULL when out of memory (then the body is
 * read as usual). */
push_stream *push_stream_start(request *r);
/* After the body. NULL when the push was streamed (then
 * push_stream_commit); else the whole body as a blob (ps keeps the
 * reference), or NULL with *oom set. */
blob *push_stream_body(push_stream *ps, int *oom);
/* A streamed push, its body complete: STORE_OK (*gstep, *outcome) or a
 * store error with err (STORE_EINVAL: a NaN or Inf, in the words the route
 * uses; nothing changed). *head: its checked metadata. */
int push_stream_commit(push_stream *ps, const grads_head **head, int64_t *gstep, int *outcome, char *err,
                       size_t errlen);
/* The request ended (committed or not): NULL is fine. */
void push_stream_free(push_stream *ps);

#endif
