/* pipeline_schedule.h - the order in which each stage of a pipeline runs
 * the forwards and backwards of a step's M micro-batches: one table,
 * computed up front from (kind, K, M), the same on every stage.
 *
 * gpipe (GPipe): every stage runs F0 F1 ... F(M-1), then B0 B1 ... B(M-1):
 *   all M micro-batches' activations are in flight at once.
 * 1f1b (PipeDream-flush, as Megatron-LM's non-interleaved schedule): stage s
 *   runs w = min(K - 1 - s, M) forwards (the warm-up), then alternates one
 *   forward and one backward until the forwards are done, then the w
 *   backwards left (the cool-down): at most w + 1 <= K - s micro-batches in
 *   flight on stage s.
 * Either way stage s's F(j) needs stage s-1's F(j) (its activations) and
 * B(j) needs stage s+1's B(j) (the gradient of its output); the last stage's
 * B(j) follows its own F(j) (the loss). Run with blocking receives, and sends
 * that the receiver buffers, neither table deadlocks (tests/unit/
 * test_pipeline.c simulates it), and with unit-time ops both take the
 * fill-drain time 2(M + K - 1): a bubble of (K - 1) / (M + K - 1). */
#ifndef RESTPS_PIPELINE_SCHEDULE_H
#define RESTPS_PIPELINE_SCHEDULE_H

#include <stddef.h>

#include "pipeline/pipeline_plan.h"

#define PIPE_MAX_MICRO 256

typedef enum { PIPE_GPIPE = 0, PIPE_1F1B = 1 } pipe_schedule_kind;
typedef enum { PIPE_FWD = 0, PIPE_BWD = 1 } pipe_op;

typedef struct pipe_slot {
    pipe_op op;
    int mb; /* the micro-batch, 0..M-1 */
} pipe_slot;

typedef struct pipe_schedule {
    pipe_schedule_kind kind;
    int stages, micro;   /* K, M */
    int n;               /* slots per stage: 2M */
    pipe_slot *slot;     /* [K][2M]: stage s's i-th op is slot[s * n + i] */
    int max_inflight[PIPE_MAX_STAGES]; /* the most micro-batches forwarded, not yet backwarded */
} pipe_schedule;

const char *pipe_schedule_name(pipe_schedule_kind k);
/* -1 when name is neither "gpipe" nor "1f1b". */
int pipe_schedule_from_name(const char *name, pipe_schedule_kind *out);

/* Build the table for K stages (2..8) and M micro-batches (1..256). 0, or -1
 * with err (a bad argument, out of memory). Free with pipe_schedule_free. */
int pipe_schedule_build(pipe_schedule *s, pipe_schedule_kind kind, int K, int M, char *err,
                        size_t errlen);
void pipe_schedule_free(pipe_schedule *s);

static inline const pipe_slot *pipe_schedule_at(const pipe_schedule *s, int stage, int i)
{
    return &s->slot[(size_t)stage * (size_t)s->n + (size_t)i];
}

/* "F0 F1 B0 F2 B1 B2" for stage s into buf (logs, GET /v1/pipeline). */
void pipe_schedule_format(const pipe_schedule *s, int stage, char *buf, size_t len);

#endif
