/* optim.h - the optimizers psd applies to each variable: sgd, momentum (and
 * Nesterov momentum), adam, adagrad and rmsprop with TensorFlow's update rules
 * and defaults (tf.compat.v1.train), their per-variable state ("slots":
 * momentum's accumulator, adam's m and v, adagrad's accumulator, rmsprop's ms
 * and mom), and what applies to every optimizer: per-variable gradient
 * clipping, decoupled weight decay and a learning-rate schedule by
 * global_step. */
#ifndef RESTPS_OPTIM_H
#define RESTPS_OPTIM_H

#include <stddef.h>
#include <stdint.h>

typedef enum { OPTIM_SGD, OPTIM_MOMENTUM, OPTIM_ADAM, OPTIM_ADAGRAD, OPTIM_RMSPROP } optim_kind;
#define OPTIM_KINDS 5

typedef enum { OPTIM_LR_CONSTANT, OPTIM_LR_EXPONENTIAL, OPTIM_LR_COSINE } optim_schedule;

/* Every field is 4 bytes wide, so the struct has no padding and two
 * configurations built from zeroed memory compare equal with memcmp. Fields
 * the kind or the schedule does not use are zero (optim_clear_unused). */
typedef struct optim_config {
    optim_kind kind;
    float learning_rate;
    float momentum;               /* momentum: 0.9; rmsprop: 0.0 */
    float beta1, beta2, epsilon;  /* adam: 0.9, 0.999, 1e-8; rmsprop's epsilon: 1e-10 */
    int nesterov;                 /* momentum: use_nesterov (default 0) */
    float initial_accumulator_value; /* adagrad: 0.1 */
    float rmsprop_decay;          /* rmsprop: decay (rho), 0.9 */
    float clip_norm;              /* > 0: tf.clip_by_norm of each variable's gradient; 0 off */
    float weight_decay;           /* decoupled: w -= lr_t * weight_decay * w; 0 off */
    optim_schedule lr_schedule;   /* the learning rate by global_step */
    int decay_steps;              /* exponential, cosine: > 0 */
    float decay_rate;             /* exponential: > 0 */
    int staircase;                /* exponential: floor(step / decay_steps) */
    float alpha;                  /* cosine: the floor, a fraction of lr (0.0) */
} optim_config;

/* TensorFlow's defaults for kind with learning_rate lr, a constant schedule,
 * no clipping, no weight decay; then optim_clear_unused. */
void optim_defaults(optim_config *c, optim_kind kind, float lr);
/* Zero the fields c's kind and schedule do not use. */
void optim_clear_unused(optim_config *c);
const char *optim_name(optim_kind k);
/* -1 when the name is not one of sgd, momentum, adam, adagrad, rmsprop. */
int optim_from_name(const char *name, optim_kind *out);
/* "sgd, momentum, adam, adagrad or rmsprop", for messages. */
#define OPTIM_NAMES "sgd, momentum, adam, adagrad or rmsprop"
const char *optim_schedule_name(optim_schedule s);
/* -1 when the name is not constant, exponential or cosine. */
int optim_schedule_from_name(const char *name, optim_schedule *out);
/* How many slot arrays (each numel floats) a variable needs: 0, 1 or 2. */
int optim_slots(optim_kind k);

/* The learning rate at global_step step (the step before this update):
 * constant: lr; exponential (tf.compat.v1.train.exponential_decay):
 * lr * decay_rate^(step / decay_steps), the exponent floored when staircase;
 * cosine (tf.compat.v1.train.cosine_decay): lr * ((1 - alpha) * 0.5 *
 * (1 + cos(pi * min(step, decay_steps) / decay_steps)) + alpha). */
float optim_learning_rate(const optim_config *c, int64_t step);

/* One update of n elements (one variable): out = w - step(g * scale), where
 * g * scale is the gradient (scale = 1/count averages a sum), clipped to
 * clip_norm first when that is > 0; weight decay takes lr_t * weight_decay * w
 * off w before the optimizer's step. t is the 1-based count of updates applied
 * to this variable including this one (adam's bias correction; at t = 1 the
 * slots are set to their initial values: adagrad's accumulator to
 * initial_accumulator_value, rmsprop's ms to 1 as TensorFlow's). step is the
 * global_step before this update (the schedule). out may equal w. slots hold
 * optim_slots(kind) arrays of n floats. */
void optim_apply(const optim_config *c, const float *w, float *out, const float *g, float scale,
                 float *slot0, float *slot1, int64_t t, int64_t step, size_t n);

/* OPTIM_SGD's step of optim_apply, bit for bit, with g checked for NaN and
 * Inf in the same pass, the next value written over the gradient: g[i]
 * becomes w[i]'s next value (w and g must not overlap). The check runs a
 * cache-sized chunk ahead of the update, so a chunk is read from memory once.
 * Returns -1 when every element was finite (all of g now holds the next
 * values), else the index of the first non-finite one: g is then as it came
 * from that element's chunk on (g[bad] can be read) and overwritten before. */
int64_t optim_sgd_into_grad(const optim_config *c, const float *w, float *g, float scale, int64_t step,
                            size_t n);

/* OPTIM_SGD's step of optim_apply without clipping (c->clip_norm must be
 * 0), bit for bit: out[i] = w[i]'s next value for the finite gradient g[i],
 * scale 1, at global_step `step`. out may equal w; g must overlap neither. */
void optim_sgd_next(const optim_config *c, const float *w, const float *g, float *out, int64_t step, size_t n);
/* The same, the gradient as n little-endian float32 at any alignment (a
 * network buffer), checked in the same pass: -1 when all were finite (out
 * holds the next values), else the index of the first NaN or Inf (out is
 * then undefined). */
int64_t optim_sgd_next_bytes(const optim_config *c, const float *w, const unsigned char *g, float *out,
                             int64_t step, size_t n);

/* tf.train.ExponentialMovingAverage's update of a shadow copy after an apply,
 * with a constant decay (TF's default, num_updates=None):
 * shadow -= (1 - decay) * (shadow - w), i.e. decay * shadow + (1 - decay) * w,
 * in float32 as TF's assign_moving_average computes it. */
void optim_ema(float *shadow, const float *w, float decay, size_t n);
/* A usable decay: a finite float32 with 0 < d < 1. */
int optim_ema_decay_ok(double d);

#endif
