/* overlap.h - a step's transfers beside its compute (workerd --overlap, as
 * ByteScheduler orders them): a transfer thread runs one pull or push at a
 * time on the shards' ps client (which no other thread then touches), while
 * the training thread computes. A pull's answers land in the shards' rx
 * buffers and the forward pass takes each layer's tensors as soon as their
 * bytes are in (overlap_take_layer, psd sends them in name order, which is
 * layer order for the model's names); a push's body holds its tensors last
 * layer first and each goes out as soon as the backward pass wrote it
 * (overlap_grads_done). The floats are the same as without: only when bytes
 * move changes. */
#ifndef RESTPS_OVERLAP_H
#define RESTPS_OVERLAP_H

#include "shards/shards.h"

typedef struct overlap overlap;

/* The transfer thread for sh (its placement and layout); NULL when out of
 * memory or no thread could start. */
overlap *overlap_new(shards *sh);
/* Waits for a job that runs, then stops the thread. NULL: nothing. */
void overlap_free(overlap *o);

/* Run fn(arg) on the transfer thread (nothing else may run there: the last
 * job was waited for). fn uses the shards and their client; the caller
 * touches neither until overlap_wait returns. */
void overlap_run(overlap *o, int (*fn)(void *), void *arg);
/* Wait for the job; its return value (0 when none ran). */
int overlap_wait(overlap *o);

/* Before a pull job: its answers stream (shards_stream.pull) into the rx
 * buffers; each shard's step now is kept for the shards' guard
 * (overlap_take_layer refuses an answer the pull would not copy). */
void overlap_pull_begin(overlap *o);
/* Wait until every tensor of layer `layer` has come from its shard, copy it
 * into params; 0, or -1 when it will not come (the transfer failed, tried
 * again after some of it was taken, or a shard came back behind or without
 * the variables, as the guard says): the caller stops the step and reads the
 * pull's outcome after overlap_wait. */
int overlap_take_layer(overlap *o, int layer, float *params);
/* After the pull job was waited for: streaming off; 1 when a try of it
 * started over after the forward pass had taken some of its bytes (they may
 * be of the failed try: pull again), else 0. */
int overlap_pull_end(overlap *o);

/* Before a push job: its body streams (shards_stream.push); no layer's
 * gradients are there yet. overlap_grads_done(o, l): layers l.. (every one
 * from l to the last) are; overlap_push_end after the job. */
void overlap_push_begin(overlap *o);
void overlap_grads_done(overlap *o, int layer);
void overlap_push_end(overlap *o);
/* The push will not get its gradients (the step failed): its body stops
 * (the request ends with PS_ENET), a waiting take returns -1. */
void overlap_cancel(overlap *o);

#endif
