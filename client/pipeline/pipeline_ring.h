/* pipeline_ring.h - workerd --pipeline_stages=K --allreduce=ring: the same
 * stage of the R replicas sums its step's gradient sum in a ring over the
 * stages' own endpoints (pipeline_link.h), where without it each sends its
 * whole sum to the R - 1 others. The schedule is ring_schedule.h's (the
 * one the ring between workers follows): R chunks, a reduce-scatter and an
 * all-gather of R - 1 ring steps each, so every replica ends with the same
 * floats; each sends 2 (R - 1) / R of the buffer a step (all-to-all: R - 1
 * times it).
 *
 * A ring message is the pipeline's POST /v1/pipeline/msg with dir=ring,
 * mb= the ring step and from= the sending replica (the receiver's left
 * neighbour), and exactly the floats of the chunk that ring step brings.
 * Nothing here exits. */
#ifndef RESTPS_PIPELINE_RING_H
#define RESTPS_PIPELINE_RING_H

#include <stddef.h>
#include <stdint.h>

#include "pipeline/pipeline_mailbox.h"
#include "ring_schedule.h"

/* How a chunk leaves: to replica `to`, key k, n floats of data (copied or
 * sent before it returns), due by clk_mono_secs() + wait. 0, or -1 with
 * err. workerd's queues it on the stage's link (pipe_link_post). */
typedef int (*pipe_ring_send_fn)(void *ctx, int to, const pipe_key *k, const float *data, size_t n,
                                 double wait, char *err, size_t errlen);

/* Sum buf (n floats) over the replicas in place, this task being replica r
 * of R (R >= 2); tmp holds a chunk (n / R + 1 floats). Sends go to replica
 * r + 1 through send, receives come from box (dir PIPE_RING, the step's
 * key), each waiting until clk_mono_secs() + wait; abort as
 * pipe_mailbox_take's. *idle gets the seconds spent waiting added. 0; -1
 * when a chunk did not come in time (*ring_step: which one); -2 when abort()
 * said stop; -3 with err when a send failed. */
int pipe_ring_allreduce(pipe_ring_send_fn send, void *ctx, pipe_mailbox *box, int replicas, int r, int64_t step,
                        float *buf, size_t n, float *tmp, double wait, int (*abort)(void), double *idle,
                        int *ring_step, char *err, size_t errlen);

#endif
