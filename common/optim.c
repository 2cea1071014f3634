/* optim.c - sgd, momentum (plain and Nesterov), adam, adagrad and rmsprop as
 * tf.compat.v1.train's optimizers apply them (the kernels' order of
 * operations), with per-variable gradient clipping (tf.clip_by_norm),
 * decoupled weight decay and a learning-rate schedule by global_step. */
#include "optim.h"
#include "tensor.h"

#include <math.h>
#include <string.h>

static const char *const names[OPTIM_KINDS] = {"sgd", "momentum", "adam", "adagrad", "rmsprop"};
static const char *const schedules[] = {"constant", "exponential", "cosine"};

/* rmsprop's ms slot starts at one (RMSPropOptimizer's ones_initializer) */
#define RMSPROP_MS_INIT 1.0f

void optim_defaults(optim_config *c, optim_kind kind, float lr)
{
    memset(c, 0, sizeof(*c));
    c->kind = kind;
    c->learning_rate = lr;
    c->momentum = kind == OPTIM_RMSPROP ? 0.0f : 0.9f;
    c->beta1 = 0.9f;
    c->beta2 = 0.999f;
    c->epsilon = kind == OPTIM_RMSPROP ? 1e-10f : 1e-8f;
    c->initial_accumulator_value = 0.1f;
    c->rmsprop_decay = 0.9f;
    c->lr_schedule = OPTIM_LR_CONSTANT;
    optim_clear_unused(c);
}

void optim_clear_unused(optim_config *c)
{
    optim_kind k = c->kind;
    if (k != OPTIM_MOMENTUM && k != OPTIM_RMSPROP)
        c->momentum = 0;
    if (k != OPTIM_MOMENTUM)
        c->nesterov = 0;
    if (k != OPTIM_ADAM)
        c->beta1 = c->beta2 = 0;
    if (k != OPTIM_ADAM && k != OPTIM_RMSPROP)
        c->epsilon = 0;
    if (k != OPTIM_ADAGRAD)
        c->initial_accumulator_value = 0;
    if (k != OPTIM_RMSPROP)
        c->rmsprop_decay = 0;
    if (c->lr_schedule == OPTIM_LR_CONSTANT)
        c->decay_steps = 0;
    if (c->lr_schedule != OPTIM_LR_EXPONENTIAL) {
        c->decay_rate = 0;
        c->staircase = 0;
    }
    if (c->lr_schedule != OPTIM_LR_COSINE)
        c->alpha = 0;
}

const char *optim_name(optim_kind k)
{
    return (unsigned)k < OPTIM_KINDS ? names[k] : "unknown";
}

int optim_from_name(const char *name, optim_kind *out)
{
    for (int i = 0; i < OPTIM_KINDS; i++)
        if (strcmp(name, names[i]) == 0) {
            *out = (optim_kind)i;
            return 0;
        }
    return -1;
}

const char *optim_schedule_name(optim_schedule s)
{
    return (unsigned)s <= OPTIM_LR_COSINE ? schedules[s] : "unknown";
}

int optim_schedule_from_name(const char *name, optim_schedule *out)
{
    for (int i = 0; i <= OPTIM_LR_COSINE; i++)
        if (strcmp(name, schedules[i]) == 0) {
            *out = (optim_schedule)i;
            return 0;
        }
    return -1;
}

int optim_slots(optim_kind k)
{
    switch (k) {
    case OPTIM_SGD:
        return 0;
    case OPTIM_MOMENTUM:
    case OPTIM_ADAGRAD:
        return 1;
    case OPTIM_ADAM:
    case OPTIM_RMSPROP:
        return 2;
    }
    return 0;
}

float optim_learning_rate(const optim_config *c, int64_t step)
{
    const double lr = c->learning_rate, s = step > 0 ? (double)step : 0.0;
    switch (c->lr_schedule) {
    case OPTIM_LR_CONSTANT:
        break;
    case OPTIM_LR_EXPONENTIAL: {
        if (c->decay_steps <= 0)
            break;
        double p = s / (double)c->decay_steps;
        if (c->staircase)
            p = floor(p);
        return (float)(lr * pow((double)c->decay_rate, p));
    }
    case OPTIM_LR_COSINE: {
        if (c->decay_steps <= 0)
            break;
        const double d = (double)c->decay_steps, a = c->alpha;
        const double cosd = 0.5 * (1.0 + cos(M_PI * (s < d ? s : d) / d));
        return (float)(lr * ((1.0 - a) * cosd + a));
    }
    }
    return c->learning_rate;
}

/* tf.clip_by_norm: t * clip / max(||t||, clip), folded into scale. */
static float clipped_scale(const float *g, float scale, float clip, size_t n)
{
    /* four partial sums: the loop vectorizes without reassociating doubles */
    float p0 = 0, p1 = 0, p2 = 0, p3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        float a = g[i] * scale, b = g[i + 1] * scale, c = g[i + 2] * scale, d = g[i + 3] * scale;
        p0 += a * a;
        p1 += b * b;
        p2 += c * c;
        p3 += d * d;
    }
    double ss = (double)p0 + (double)p1 + (double)p2 + (double)p3;
    for (; i < n; i++)
        ss += (double)(g[i] * scale) * (double)(g[i] * scale);
    const double norm = sqrt(ss);
    if (!(norm > (double)clip)) /* within the norm (or not finite): unchanged */
        return scale;
    return (float)((double)scale * (double)clip / norm);
}

static void fill(float *p, float v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = v;
}

void optim_apply(const optim_config *c, const float *w, float *out, const float *g, float scale,
                 float *slot0, float *slot1, int64_t t, int64_t step, size_t n)
{
    const float lr = optim_learning_rate(c, step);
    if (c->clip_norm > 0)
        scale = clipped_scale(g, scale, c->clip_norm, n);
    /* decoupled weight decay (Keras' weight_decay, AdamW's form with the
     * scheduled rate): w -= lr_t * wd * w before the optimizer's step; no
     * optimizer's step reads w, so the order changes nothing but rounding */
    const float wd = lr * c->weight_decay;
    switch (c->kind) {
    case OPTIM_SGD:
        /* GradientDescentOptimizer: w -= lr * g */
        for (size_t i = 0; i < n; i++) {
            float wi = w[i] - wd * w[i];
            out[i] = wi - lr * (g[i] * scale);
        }
        break;
    case OPTIM_MOMENTUM: {
        const float m = c->momentum;
        if (c->nesterov) {
            /* MomentumOptimizer(use_nesterov=True): a = m*a + g; w -= g*lr + a*m*lr */
            for (size_t i = 0; i < n; i++) {
                float gi = g[i] * scale;
                float a = m * slot0[i] + gi;
                slot0[i] = a;
                float wi = w[i] - wd * w[i];
                out[i] = wi - (gi * lr + a * m * lr);
            }
        } else {
            /* MomentumOptimizer: a = m*a + g; w -= lr * a */
            for (size_t i = 0; i < n; i++) {
                float a = m * slot0[i] + g[i] * scale;
                slot0[i] = a;
                float wi = w[i] - wd * w[i];
                out[i] = wi - lr * a;
            }
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
            float wi = w[i] - wd * w[i];
            out[i] = wi - lr_t * m / (sqrtf(v) + eps);
        }
        break;
    }
    case OPTIM_ADAGRAD: {
        /* AdagradOptimizer: accum starts at initial_accumulator_value;
         * accum += g*g; w -= g * lr / sqrt(accum) */
        if (t == 1)
            fill(slot0, c->initial_accumulator_value, n);
        for (size_t i = 0; i < n; i++) {
            float gi = g[i] * scale;
            float a = slot0[i] + gi * gi;
            slot0[i] = a;
            float wi = w[i] - wd * w[i];
            out[i] = wi - gi * lr / sqrtf(a);
        }
        break;
    }
    case OPTIM_RMSPROP: {
        /* RMSPropOptimizer (centered=False): ms starts at 1, mom at 0;
         * ms += (g*g - ms) * (1 - decay); mom = momentum*mom + lr*g/sqrt(ms + eps);
         * w -= mom */
        const float rho1 = 1.0f - c->rmsprop_decay, m = c->momentum, eps = c->epsilon;
        if (t == 1) {
            fill(slot0, RMSPROP_MS_INIT, n);
            fill(slot1, 0.0f, n);
        }
        for (size_t i = 0; i < n; i++) {
            float gi = g[i] * scale;
            float ms = slot0[i] + (gi * gi - slot0[i]) * rho1;
            float mom = m * slot1[i] + lr * gi / sqrtf(ms + eps);
            slot0[i] = ms;
            slot1[i] = mom;
            float wi = w[i] - wd * w[i];
            out[i] = wi - mom;
        }
        break;
    }
    }
}

/* floats checked, then updated, at a time: 16 KiB, well inside L1 + L2 */
#define SGD_CHUNK 4096

int64_t optim_sgd_into_grad(const optim_config *c, const float *restrict w, float *restrict g, float scale,
                            int64_t step, size_t n)
{
    const float lr = optim_learning_rate(c, step);
    if (c->clip_norm > 0) /* a NaN makes the norm NaN: scale unchanged, found below */
        scale = clipped_scale(g, scale, c->clip_norm, n);
    const float wd = lr * c->weight_decay;
    for (size_t at = 0; at < n; at += SGD_CHUNK) {
        size_t m = n - at < SGD_CHUNK ? n - at : SGD_CHUNK;
        float *gc = g + at;
        const float *wc = w + at;
        int64_t bad = tensor_find_nonfinite(gc, m);
        if (bad >= 0)
            return (int64_t)at + bad;
        /* the expressions of optim_apply's OPTIM_SGD: the same floats */
        for (size_t i = 0; i < m; i++) {
            float wi = wc[i] - wd * wc[i];
            gc[i] = wi - lr * (gc[i] * scale);
        }
    }
    return -1;
}

void optim_sgd_next(const optim_config *c, const float *w, const float *restrict g, float *out, int64_t step,
                    size_t n)
{
    const float lr = optim_learning_rate(c, step), scale = 1.0f;
    const float wd = lr * c->weight_decay;
    /* the expressions of optim_apply's OPTIM_SGD: the same floats */
    for (size_t i = 0; i < n; i++) {
        float wi = w[i] - wd * w[i];
        out[i] = wi - lr * (g[i] * scale);
    }
}

int64_t optim_sgd_next_bytes(const optim_config *c, const float *w, const unsigned char *restrict g,
                             float *restrict out, int64_t step, size_t n)
{
    const float lr = optim_learning_rate(c, step), scale = 1.0f;
    const float wd = lr * c->weight_decay;
    uint32_t flag = 0; /* tensor_find_nonfinite's sweep, in the same loop */
    for (size_t i = 0; i < n; i++) {
        float gi;
        uint32_t b;
        memcpy(&gi, g + 4 * i, 4);
        memcpy(&b, g + 4 * i, 4);
        flag |= (b & 0x7f800000u) + 0x00800000u;
        float wi = w[i] - wd * w[i];
        out[i] = wi - lr * (gi * scale);
    }
    if (!(flag & 0x80000000u))
        return -1;
    for (size_t i = 0; i < n; i++) {
        float gi;
        memcpy(&gi, g + 4 * i, 4);
        if (!isfinite(gi))
            return (int64_t)i;
    }
    return -1;
}

void optim_ema(float *restrict shadow, const float *restrict w, float decay, size_t n)
{
    const float k = 1.0f - decay;
    for (size_t i = 0; i < n; i++)
        shadow[i] -= k * (shadow[i] - w[i]);
}

int optim_ema_decay_ok(double d)
{
    /* NaN fails the first test; rounding to float32 may give 0 or 1 */
    return d > 0.0 && d < 1.0 && (float)d > 0.0f && (float)d < 1.0f;
}
