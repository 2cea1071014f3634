/* ring_overlap.h - a ring all-reduce beside the backward pass (workerd
 * --overlap with --allreduce=ring; PyTorch DDP's gradient buckets): the
 * ring's buckets (ring_options.edges) are summed on threads of their own,
 * the last first, each as soon as the backward pass has written all of its
 * floats, while the backward pass goes on with the layers before; the first
 * bucket on a thread (and ring.c on a connection) of its own, so that the
 * next forward pass can start on it while the later ones travel. The sums
 * are the floats of ring_allreduce (ring_allreduce_bucket's order and
 * arithmetic): only when bytes move changes.
 *
 * The buffer is the gradients in layer order with the loss after them: the
 * loss's float is written by ring_overlap_loss, layer l's gradients (and
 * every later layer's) are in once ring_overlap_grads(o, l) is called, which
 * the model's hooks do (model_ctx: loss_done, grads_done). */
#ifndef RESTPS_RING_OVERLAP_H
#define RESTPS_RING_OVERLAP_H

#include <stddef.h>
#include <stdint.h>

#include "ring/ring.h"

typedef struct ring_overlap ring_overlap;

/* Bucket edges for a buffer of n_floats whose layer l starts at float
 * layer_start[l] (non-decreasing; n_layers of them; a layer without
 * parameters starts where the next does): edges at layers' starts, going
 * from the last layer to the first, closing a bucket once it holds at least
 * min_floats (the first bucket, the first layers', holds what is left).
 * Writes at most cap edges, strictly increasing, each in (0, n_floats);
 * returns how many. */
int ring_overlap_edges(const size_t *layer_start, int n_layers, size_t n_floats, size_t min_floats, size_t *edges,
                       int cap);

/* The thread for r, whose buffers' layer l starts at layer_start[l]
 * (copied); loss_at: the loss's float. NULL when out of memory or no thread
 * could start. */
ring_overlap *ring_overlap_new(ring *r, const size_t *layer_start, int n_layers, size_t loss_at);
/* Stops the thread (a step begun must have been ended). NULL: nothing. */
void ring_overlap_free(ring_overlap *o);

/* Start step's all-reduce of buf (ring_allreduce's wait_secs); nothing of
 * buf is written yet. */
void ring_overlap_begin(ring_overlap *o, int64_t step, float *buf, double wait_secs);
/* The model's hooks (model_ctx.loss_done, .grads_done; arg: the
 * ring_overlap): the loss is known (written into its float; 0), layers
 * layer.. are written. */
int ring_overlap_loss(void *arg, double loss);
void ring_overlap_grads(void *arg, int layer);
/* Every float is written (the backward pass returned). */
void ring_overlap_all_written(ring_overlap *o);
/* The step's gradients will not come (the backward pass failed): the
 * thread stops before its next bucket. */
void ring_overlap_cancel(ring_overlap *o);
/* Wait until bucket b of the step is summed: 0, or (it will not be) what
 * ring_overlap_end would return for its channel. The first bucket goes on a
 * channel of its own (ring.c's second curl handle), so it need not wait
 * behind the later ones: a forward pass of the next step can start on the
 * first layers while the last layers' sum still travels. */
int ring_overlap_wait_bucket(ring_overlap *o, int b, int64_t *bad, char *err, size_t errlen);
/* Wait for the step's all-reduce: 0; -1 with err (as ring_allreduce); -2 a
 * stop; -3 this task's own floats held a NaN or an Inf (*bad: the first
 * found, in the bucket about to be sent; nothing of it was sent); -4
 * cancelled. */
int ring_overlap_end(ring_overlap *o, int64_t *bad, char *err, size_t errlen);

#endif
