/* optim.c - sgd, momentum and adam, as tf.compat.v1.train's optimizers apply them. */
#include "optim.h"

#include <math.h>
#include <string.h>

static const char *const names[] = {"sgd", "momentum", "adam"};

void optim_defaults(optim_config *c, optim_kind kind, float lr)
{
    c->kind = kind;
    c->learning_rate = lr;
    c->momentum = 0.9f;
    c->beta1 = 0.9f;
    c->beta2 = 0.999f;
    c->epsilon = 1e-8f;
}

const char *optim_name(optim_kind k) { return names[k]; }

int optim_from_name(const char *name, optim_kind *out)
{
    for (int i = 0; i < 3; i++)
        if (strcmp(name, names[i]) == 0) {
            *out = (optim_kind)i;
            return 0;
        }
    return -1;
}

int optim_slots(optim_kind k) { return k == OPTIM_SGD ? 0 : k == OPTIM_MOMENTUM ? 1 : 2; }

void optim_apply(const optim_config *c, const float *w, float *out, const float *g, float scale,
                 float *slot0, float *slot1, int64_t t, size_t n)
{
    const float lr = c->learning_rate;
    switch (c->kind) {
    case OPTIM_SGD:
        /* GradientDescentOptimizer: w -= lr * g */
        for (size_t i = 0; i < n; i++)
            out[i] = w[i] - lr * (g[i] * scale);
        break;
    case OPTIM_MOMENTUM: {
        /* MomentumOptimizer (use_nesterov=False): a = m*a + g; w -= lr * a */
        const float m = c->momentum;
        for (size_t i = 0; i < n; i++) {
            float a = m * slot0[i] + g[i] * scale;
            slot0[i] = a;
            out[i] = w[i] - lr * a;
        }
        break;
    }
    case OPTIM_ADAM: {
        /* AdamOptimizer: lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t);
         * m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; w -= lr_t * m / (sqrt(v) + eps) */
        const float b1 = c->beta1, b2 = c->beta2, eps = c->epsilon;
        const double td = (double)t;
        const float lr_t = (float)((double)lr * sqrt(1.0 - pow((double)b2, td)) /
                                   (1.0 - pow((double)b1, td)));
        for (size_t i = 0; i < n; i++) {
            float gi = g[i] * scale;
            float m = b1 * slot0[i] + (1.0f - b1) * gi;
            float v = b2 * slot1[i] + (1.0f - b2) * gi * gi;
            slot0[i] = m;
            slot1[i] = v;
            out[i] = w[i] - lr_t * m / (sqrtf(v) + eps);
        }
        break;
    }
    }
}
