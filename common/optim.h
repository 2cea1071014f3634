/* optim.h - the optimizers psd applies to each variable: sgd, momentum and
 * adam with TensorFlow's update rules and defaults, and their per-variable
 * state ("slots": momentum's accumulator, adam's m and v). */
#ifndef RESTPS_OPTIM_H
#define RESTPS_OPTIM_H

#include <stddef.h>
#include <stdint.h>

typedef enum { OPTIM_SGD, OPTIM_MOMENTUM, OPTIM_ADAM } optim_kind;

typedef struct optim_config {
    optim_kind kind;
    float learning_rate;
    float momentum;               /* momentum: default 0.9 */
    float beta1, beta2, epsilon;  /* adam: TensorFlow's 0.9, 0.999, 1e-8 */
} optim_config;

/* Defaults for kind with learning_rate lr. */
void optim_defaults(optim_config *c, optim_kind kind, float lr);
const char *optim_name(optim_kind k);
/* -1 when the name is not sgd, momentum or adam. */
int optim_from_name(const char *name, optim_kind *out);
/* How many slot arrays (each numel floats) a variable needs: 0, 1 or 2. */
int optim_slots(optim_kind k);

/* One update of n elements: out = w - step(g * scale), where g * scale is the
 * gradient (scale = 1/count averages a sum). t is the 1-based count of updates
 * applied to this variable including this one (adam's bias correction).
 * out may equal w. slots hold optim_slots(kind) arrays of n floats. */
void optim_apply(const optim_config *c, const float *w, float *out, const float *g, float scale,
                 float *slot0, float *slot1, int64_t t, size_t n);

#endif
