/* pipeline_mailbox.h - what a pipeline stage receives from its neighbours,
 * buffered until the stage's table gets to it: the activations of stage
 * s-1 (PIPE_ACT), the gradients of stage s+1 (PIPE_GRAD), and at the end of
 * training, on stage 0, each other stage's parameters (PIPE_PARAMS, keyed by
 * that stage's number), and with R > 1 replicas the step's gradient sum of
 * the same stage of every other replica (PIPE_REDUCE, keyed by that
 * replica's number), or with --allreduce=ring the chunks of the left
 * neighbour's ring steps (PIPE_RING, keyed by the ring step:
 * pipeline_ring.h). A message is keyed (step, micro-batch, direction).
 *
 * The HTTP thread puts (pipe_mailbox_check before it reads a body, then
 * pipe_mailbox_put), the stage's thread takes with a deadline. What a put
 * refuses leaves nothing buffered:
 *   503 parameters before pipe_mailbox_open_params (the sender retries);
 *   400 a micro-batch or stage out of range, or a size other than expected;
 *   409 a step other than the stage's current one or the next (a neighbour
 *       can run one step ahead while this stage applies its update), or a
 *       key already received for this step (a duplicate, even when taken);
 *   413 a body larger than the message's expected size.
 * Thread-safe. Nothing here exits. */
#ifndef RESTPS_PIPELINE_MAILBOX_H
#define RESTPS_PIPELINE_MAILBOX_H

#include <stddef.h>
#include <stdint.h>

#include "pipeline/pipeline_plan.h"

typedef enum { PIPE_ACT = 0, PIPE_GRAD = 1, PIPE_PARAMS = 2, PIPE_REDUCE = 3, PIPE_RING = 4 } pipe_dir;

#define PIPE_MAX_REPLICAS 8

typedef struct pipe_key {
    int64_t step;
    int mb;      /* the micro-batch; PIPE_PARAMS: the sending stage; PIPE_REDUCE: the sending
                  * replica; PIPE_RING: the ring step */
    pipe_dir dir;
} pipe_key;

/* "activations", "gradients", "parameters", "gradient sums", "ring chunks";
 * and "act", "grad", "params", "reduce", "ring" (the wire's dir=) back to a
 * direction (-1: none). */
const char *pipe_dir_name(pipe_dir d);
/* What a key's mb names: "micro-batch", "stage", "replica", "ring step". */
const char *pipe_dir_unit(pipe_dir d);
const char *pipe_dir_wire(pipe_dir d);
int pipe_dir_from_wire(const char *s, pipe_dir *out);

typedef struct pipe_mailbox pipe_mailbox;

/* micro: M; act_floats, grad_floats: the floats of one micro-batch's
 * activations and gradients this stage receives (0: it receives none: stage
 * 0 no activations, the last stage no gradients); param_floats[k]: stage k's
 * parameters (stage 0 only; NULL elsewhere: it receives none); replicas: R,
 * and reduce_floats the floats of this stage's gradient sum (each other
 * replica sends one per step). NULL when out of memory. */
pipe_mailbox *pipe_mailbox_new(int micro, size_t act_floats, size_t grad_floats, int stages,
                               const size_t *param_floats, int replicas, size_t reduce_floats);
void pipe_mailbox_free(pipe_mailbox *m);
/* Take ring chunks (PIPE_RING) instead of whole sums (PIPE_REDUCE), this
 * stage being replica `replica`: ring step t brings chunk
 * ring_recv_chunk(replicas, replica, t) of the reduce_floats. */
void pipe_mailbox_set_ring(pipe_mailbox *m, int replica);

/* Stage 0, its training buffers freed: take the other stages' parameters
 * from now on (before, they are refused with 503, so they never sit beside
 * those buffers: --max_model_bytes counts the larger of the two, not both). */
void pipe_mailbox_open_params(pipe_mailbox *m);

/* The step this stage is at (it accepts messages for it and the next). */
void pipe_mailbox_set_step(pipe_mailbox *m, int64_t step);

/* Would a message of `floats` floats for k be taken? 0, or the HTTP status
 * (400, 409, 413) with msg. */
unsigned pipe_mailbox_check(pipe_mailbox *m, const pipe_key *k, size_t floats, char *msg,
                            size_t cap);
/* Buffer a copy of data (floats floats) for k, with tag (activations: the
 * epoch-order index of the micro-batch's first example, which dropout's
 * mask follows): 0, or the status as above. */
unsigned pipe_mailbox_put(pipe_mailbox *m, const pipe_key *k, const void *data, size_t floats,
                          int64_t tag, char *msg, size_t cap);

/* Wait until k is there (up to deadline, clk_mono_secs()), then copy it into
 * dst (its expected size) and its tag into *tag (may be NULL). 0; -1 at the
 * deadline; -2 when abort() (polled every 50 ms; may be NULL) said stop. */
int pipe_mailbox_take(pipe_mailbox *m, const pipe_key *k, float *dst, int64_t *tag, double deadline,
                      int (*abort)(void));

/* Messages buffered and not yet taken (GET /v1/pipeline). */
int pipe_mailbox_pending(pipe_mailbox *m);

#endif
