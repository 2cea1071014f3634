/* sync_agg.h - sync training's aggregation: the gradients kept for the
 * current step (one per worker, in worker order) until the step has its
 * replicas, their sum per variable, the mean of their losses; and the ring
 * of recently applied push ids (X-Push-Id) that makes a retried push a
 * duplicate, in either mode.
 *
 * No lock of its own: the store holds one inside its state and calls it
 * under its write lock (reads under the read lock). */
#ifndef RESTPS_SYNC_AGG_H
#define RESTPS_SYNC_AGG_H

#include <stdint.h>

#include "bufpool.h"
#include "safetensors.h"
#include "tensor.h"

#define SYNC_PUSH_IDS 1024
#define SYNC_PUSH_ID_MAX 64

typedef struct sync_grad {
    int worker;
    blob *body;    /* a reference: holds the data */
    st_file f;     /* a copy of the tensors' names, shapes and offsets */
    const unsigned char *data;
    int has_loss;
    double loss;
} sync_grad;

typedef struct sync_agg {
    sync_grad *grads; /* sorted by worker */
    int n, cap;
    int64_t first_ms; /* CLOCK_MONOTONIC ms the step's first gradient came; 0 none */
    float *sum;       /* sync_agg_sum's result */
    size_t sum_cap;
    struct {
        char id[SYNC_PUSH_ID_MAX + 1];
        int64_t step;
    } ids[SYNC_PUSH_IDS];
    int id_next;
} sync_agg;

/* (zeroed memory is an empty one) */
void sync_agg_free(sync_agg *a);

/* 1 when worker's gradient for the step is kept. */
int sync_agg_has(const sync_agg *a, int worker);
/* Keep worker's gradient (f's tensors are copied: the caller keeps f; body
 * gets a reference). 0, 1 when worker's is kept already (nothing changes),
 * -1 out of memory. */
int sync_agg_add(sync_agg *a, int worker, blob *body, const st_file *f, const unsigned char *data,
                 int has_loss, double loss);
/* Drop every kept gradient (the step completed, a variable was reshaped,
 * another configuration came). */
void sync_agg_clear(sync_agg *a);

/* How many kept gradients hold `name` with `shape`. */
int sync_agg_count(const sync_agg *a, const char *name, const tensor_shape *shape);
/* Room for a sum of numel floats (so that summing cannot fail). 0 or -1. */
int sync_agg_reserve(sync_agg *a, int64_t numel);
/* The sum, in worker order, of the kept gradients for `name` with `shape`
 * (numel floats, in the room reserved); *count: how many. NULL when none. */
const float *sync_agg_sum(sync_agg *a, const char *name, const tensor_shape *shape, int64_t numel,
                          int *count);
/* The mean loss of the kept gradients that carried one; 0 when none did. */
int sync_agg_mean_loss(const sync_agg *a, double *loss);

/* A push id applied (or kept) for `step`; NULL id: nothing. */
void sync_agg_remember(sync_agg *a, const char *id, int64_t step);
/* 1 (and *step, the step it was for) when id was seen. */
int sync_agg_seen(const sync_agg *a, const char *id, int64_t *step);

#endif
