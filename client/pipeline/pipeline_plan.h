/* pipeline_plan.h - model parallelism's plan (workerd --pipeline_stages=K):
 * which contiguous layers each of the K stages runs, and where each training
 * task sits in the grid of K stages x R replicas. Pure functions of the
 * model's layout and the flags, so every task computes the same plan.
 *
 * The cost of a layer is an estimate of its forward + backward FLOPs per
 * example from its shapes (pipe_layer_flops): dense K x N: 6KN (x @ W, then
 * dx and dW); conv2d: 6 x out_h x out_w x KH x KW x C_in x C_out; maxpool:
 * 2 x out x KH x KW (the window scan and the scatter back); relu, dropout: 2
 * per element; flatten: 0. Biases are left out.
 *
 * What a layer really computes depends on where it is (pipe_layer_cost): the
 * backward computes a layer's input gradient only when a layer below it has
 * parameters, so the model's first parameter layer (dense or conv at the
 * bottom, after the flatten of the images) computes the forward and its
 * kernel's gradient only, 4KN (dense) or 4 x out_h x out_w x KH x KW x C_in x
 * C_out (conv), and a relu, dropout or maxpool below it only its forward
 * (out, out x KH x KW). The split balances these costs.
 *
 * The balanced split (pipe_split_balanced) minimizes the largest stage's
 * cost over all splits into K non-empty contiguous ranges; among the splits
 * that reach that minimum it takes, stage by stage from the first, the
 * longest range that still leaves a feasible rest (deterministic).
 *
 * The grid: the training tasks (the chief task, when there is one, then the
 * workers: train_config.trainer) number K x R; task i is stage i mod K of
 * replica i / K, so the chief is stage 0 of replica 0. */
#ifndef RESTPS_PIPELINE_PLAN_H
#define RESTPS_PIPELINE_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

#define PIPE_MIN_STAGES 2
#define PIPE_MAX_STAGES 8

typedef struct pipe_plan {
    int stages;                     /* K */
    int first[PIPE_MAX_STAGES];     /* stage s runs layers first[s]..last[s], inclusive */
    int last[PIPE_MAX_STAGES];
    uint64_t cost[PIPE_MAX_STAGES]; /* pipe_layer_cost summed over the stage */
} pipe_plan;

/* Forward + backward FLOPs per example of one layer (the estimate above). */
uint64_t pipe_layer_flops(const model_layer *l);

/* Forward + backward FLOPs per example of layer i of L as the backward runs
 * it there (above: without the input gradient when no layer below has
 * parameters). */
uint64_t pipe_layer_cost(const model_layout *L, int i);

/* The balanced split of L's layers into K stages (2..8, at most n_layers).
 * 0, or -1 with one line in err. */
int pipe_split_balanced(const model_layout *L, int K, pipe_plan *p, char *err, size_t errlen);

/* --stage_layers: "0-3,4-6,7-9" (a range "5" is "5-5"), K ranges that start
 * at layer 0, follow each other with no gap or overlap and end at the last
 * layer. 0, or -1 with one line in err naming the bad part. */
int pipe_split_parse(const model_layout *L, const char *s, int K, pipe_plan *p, char *err,
                     size_t errlen);

/* "0-3,4-6" (what pipe_split_parse reads back). */
void pipe_plan_format(const pipe_plan *p, char *buf, size_t len);

/* The parameter floats of stage s: the tensors of its layers are one run of
 * the buffer (buffer order is layer order), [*offset, *offset + *numel). */
void pipe_stage_params(const model_layout *L, const pipe_plan *p, int s, size_t *offset,
                       size_t *numel);

/* Where training task `task` of n_tasks sits: 0, or -1 with err when K does
 * not divide n_tasks. */
typedef struct pipe_grid {
    int stages, replicas; /* K, R */
    int stage, replica;   /* this task's */
} pipe_grid;
int pipe_grid_place(int n_tasks, int K, int task, pipe_grid *g, char *err, size_t errlen);
/* The task index of (stage, replica): replica * K + stage. */
static inline int pipe_grid_task(const pipe_grid *g, int stage, int replica)
{
    return replica * g->stages + stage;
}

#endif
