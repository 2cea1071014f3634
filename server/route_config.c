/* route_config.c - GET/PUT /v1/config (the chief's training configuration:
 * optimizer, sync or async, parsed and range-checked) and GET /readyz (200
 * once it is set). */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "jsonmem.h"
#include "history.h"
#include "log.h"
#include "routes.h"
#include "saver.h"

static json_t *config_json(const store_config *c)
{
    json_t *o = json_pack("{s:s,s:f,s:b,s:i,s:i}", "optimizer", optim_name(c->optim.kind),
                          "learning_rate", (double)c->optim.learning_rate, "sync", c->sync,
                          "replicas_to_aggregate", c->replicas_to_aggregate, "workers", c->workers);
    if (c->max_staleness >= 0)
        json_object_set_new(o, "max_staleness", json_integer(c->max_staleness));
    if (c->staleness >= 0)
        json_object_set_new(o, "staleness", json_integer(c->staleness));
    /* what the optimizer and the schedule use; clipping, weight decay and a
     * schedule only when on (off, the answer is what it always was) */
    const optim_config *p = &c->optim;
    if (p->kind == OPTIM_MOMENTUM || p->kind == OPTIM_RMSPROP)
        json_object_set_new(o, "momentum", json_real(p->momentum));
    if (p->kind == OPTIM_MOMENTUM && p->nesterov)
        json_object_set_new(o, "nesterov", json_true());
    if (p->kind == OPTIM_ADAM) {
        json_object_set_new(o, "beta1", json_real(p->beta1));
        json_object_set_new(o, "beta2", json_real(p->beta2));
    }
    if (p->kind == OPTIM_ADAM || p->kind == OPTIM_RMSPROP)
        json_object_set_new(o, "epsilon", json_real(p->epsilon));
    if (p->kind == OPTIM_RMSPROP)
        json_object_set_new(o, "rmsprop_decay", json_real(p->rmsprop_decay));
    if (p->kind == OPTIM_ADAGRAD)
        json_object_set_new(o, "initial_accumulator_value", json_real(p->initial_accumulator_value));
    if (p->clip_norm > 0)
        json_object_set_new(o, "clip_norm", json_real(p->clip_norm));
    if (p->weight_decay > 0)
        json_object_set_new(o, "weight_decay", json_real(p->weight_decay));
    if (p->lr_schedule != OPTIM_LR_CONSTANT) {
        json_object_set_new(o, "lr_schedule", json_string(optim_schedule_name(p->lr_schedule)));
        json_object_set_new(o, "decay_steps", json_integer(p->decay_steps));
    }
    if (p->lr_schedule == OPTIM_LR_EXPONENTIAL) {
        json_object_set_new(o, "decay_rate", json_real(p->decay_rate));
        json_object_set_new(o, "staircase", json_boolean(p->staircase));
    }
    if (p->lr_schedule == OPTIM_LR_COSINE)
        json_object_set_new(o, "alpha", json_real(p->alpha));
    if (c->moving_average_decay > 0)
        json_object_set_new(o, "moving_average_decay", json_real(c->moving_average_decay));
    return o;
}

/* A number field that must be finite as a float and satisfy ok; 0 absent,
 * 1 read into *out, -1 with err (what the field must be). */
static int float_field(json_t *o, const char *key, int (*ok)(double), const char *must, float *out,
                       char *err, size_t errlen)
{
    double x;
    int k = body_number(o, key, &x);
    if (k == 0)
        return 0;
    if (k < 0 || !(fabs(x) <= FLT_MAX) || !ok(x)) {
        snprintf(err, errlen, "%s must be %s", key, must);
        return -1;
    }
    *out = (float)x;
    return 1;
}

static int positive(double x) { return x > 0 && (float)x > 0; }
static int non_negative(double x) { return x >= 0; }
static int fraction(double x) { return x >= 0 && (float)x < 1; }
static int unit(double x) { return x >= 0 && x <= 1; }
static int ema_decay(double x) { return x == 0 || optim_ema_decay_ok(x); }

/* Nesterov, adagrad's and rmsprop's settings, clipping, weight decay and the
 * learning-rate schedule into c (its kind already set, defaults in place). */
static int parse_optim_extras(json_t *j, optim_config *c, char *err, size_t errlen)
{
    json_t *nv = json_object_get(j, "nesterov");
    if (nv && !json_is_boolean(nv)) {
        snprintf(err, errlen, "nesterov must be true or false");
        return -1;
    }
    if (json_is_true(nv) && c->kind != OPTIM_MOMENTUM) {
        snprintf(err, errlen, "nesterov applies to optimizer \"momentum\" only, not \"%s\"",
                 optim_name(c->kind));
        return -1;
    }
    c->nesterov = json_is_true(nv);
    if (float_field(j, "initial_accumulator_value", positive, "a positive number",
                    &c->initial_accumulator_value, err, errlen) < 0 ||
        float_field(j, "rmsprop_decay", fraction, "in [0, 1)", &c->rmsprop_decay, err, errlen) < 0 ||
        float_field(j, "clip_norm", non_negative, "a number >= 0 (0: no clipping)", &c->clip_norm,
                    err, errlen) < 0 ||
        float_field(j, "weight_decay", non_negative, "a number >= 0 (0: none)", &c->weight_decay,
                    err, errlen) < 0 ||
        float_field(j, "alpha", unit, "in [0, 1]", &c->alpha, err, errlen) < 0)
        return -1;
    json_t *sch = json_object_get(j, "lr_schedule");
    if (sch && (!json_is_string(sch) ||
                optim_schedule_from_name(json_string_value(sch), &c->lr_schedule) != 0)) {
        snprintf(err, errlen, "lr_schedule must be \"constant\", \"exponential\" or \"cosine\"");
        return -1;
    }
    json_t *ds = json_object_get(j, "decay_steps"), *st = json_object_get(j, "staircase");
    if (ds && (!json_is_integer(ds) || json_integer_value(ds) < 1 ||
               json_integer_value(ds) > INT32_MAX)) {
        snprintf(err, errlen, "decay_steps must be an integer from 1 to %d", INT32_MAX);
        return -1;
    }
    c->decay_steps = ds ? (int)json_integer_value(ds) : 0;
    if (st && !json_is_boolean(st)) {
        snprintf(err, errlen, "staircase must be true or false");
        return -1;
    }
    c->staircase = json_is_true(st);
    int has_rate = float_field(j, "decay_rate", positive, "a positive number", &c->decay_rate, err,
                               errlen);
    if (has_rate < 0)
        return -1;
    if (c->lr_schedule == OPTIM_LR_EXPONENTIAL && (!ds || !has_rate)) {
        snprintf(err, errlen, "lr_schedule \"exponential\" needs decay_steps and decay_rate");
        return -1;
    }
    if (c->lr_schedule == OPTIM_LR_COSINE && !ds) {
        snprintf(err, errlen, "lr_schedule \"cosine\" needs decay_steps");
        return -1;
    }
    return 0;
}

static int parse_config(json_t *j, store_config *c, char *err, size_t errlen)
{
    static const char *const known[] = {"optimizer", "learning_rate", "momentum", "beta1", "beta2",
                                        "epsilon", "sync", "replicas_to_aggregate", "workers",
                                        "max_staleness", "staleness", "nesterov",
                                        "initial_accumulator_value", "rmsprop_decay", "clip_norm",
                                        "weight_decay", "lr_schedule", "decay_steps", "decay_rate",
                                        "staircase", "alpha", "moving_average_decay"};
    const char *key;
    json_t *val;
    json_object_foreach(j, key, val) {
        size_t i = 0;
        while (i < sizeof(known) / sizeof(known[0]) && strcmp(key, known[i]) != 0)
            i++;
        if (i == sizeof(known) / sizeof(known[0])) {
            snprintf(err, errlen, "unknown configuration key '%.64s'", key);
            return -1;
        }
    }
    const char *opt = json_string_value(json_object_get(j, "optimizer"));
    optim_kind kind = OPTIM_SGD;
    if (json_object_get(j, "optimizer") && (!opt || optim_from_name(opt, &kind) != 0)) {
        snprintf(err, errlen,
                 "optimizer must be \"sgd\", \"momentum\", \"adam\", \"adagrad\" or \"rmsprop\"");
        return -1;
    }
    /* each value is checked as the float it is stored as: 1e-50 is not a
     * positive learning rate once it is 0.0f, nor 0.99999999999 a beta below 1 */
    float lr = 0.01f;
    if (float_field(j, "learning_rate", positive, "a positive number", &lr, err, errlen) < 0)
        return -1;
    optim_defaults(&c->optim, kind, lr);
    if (float_field(j, "momentum", fraction, "in [0, 1)", &c->optim.momentum, err, errlen) < 0 ||
        float_field(j, "beta1", fraction, "in [0, 1)", &c->optim.beta1, err, errlen) < 0 ||
        float_field(j, "beta2", fraction, "in [0, 1)", &c->optim.beta2, err, errlen) < 0 ||
        float_field(j, "epsilon", positive, "a positive number", &c->optim.epsilon, err, errlen) < 0)
        return -1;
    if (parse_optim_extras(j, &c->optim, err, errlen) != 0)
        return -1;
    json_t *sync = json_object_get(j, "sync");
    if (sync && !json_is_boolean(sync)) {
        snprintf(err, errlen, "sync must be true or false");
        return -1;
    }
    c->sync = json_is_true(sync);
    json_t *w = json_object_get(j, "workers"), *r = json_object_get(j, "replicas_to_aggregate");
    if (w && (!json_is_integer(w) || json_integer_value(w) < 1 ||
              json_integer_value(w) > STORE_MAX_WORKERS)) {
        snprintf(err, errlen, "workers must be an integer from 1 to %d", STORE_MAX_WORKERS);
        return -1;
    }
    c->workers = w ? (int)json_integer_value(w) : 1;
    if (r && (!json_is_integer(r) || json_integer_value(r) < 1 ||
              json_integer_value(r) > c->workers)) {
        snprintf(err, errlen, "replicas_to_aggregate must be an integer from 1 to workers (%d)",
                 c->workers);
        return -1;
    }
    c->replicas_to_aggregate = r ? (int)json_integer_value(r) : c->workers;
    /* async: drop gradients staler than max_staleness; stale-synchronous bound */
    const char *bounds[2] = {"max_staleness", "staleness"};
    int *into[2] = {&c->max_staleness, &c->staleness};
    for (int b = 0; b < 2; b++) {
        json_t *v = json_object_get(j, bounds[b]);
        if (v && !json_is_null(v) &&
            (!json_is_integer(v) || json_integer_value(v) < -1 || json_integer_value(v) > 1000000)) {
            snprintf(err, errlen, "%s must be an integer from 0 to 1000000 (or -1 or null: no limit)",
                     bounds[b]);
            return -1;
        }
        *into[b] = v && json_is_integer(v) ? (int)json_integer_value(v) : -1;
    }
    /* tf.train.ExponentialMovingAverage's decay: 0 (absent) is off */
    c->moving_average_decay = 0;
    if (float_field(j, "moving_average_decay", ema_decay,
                    "0 (off) or between 0 and 1, both excluded, as a float32",
                    &c->moving_average_decay, err, errlen) < 0)
        return -1;
    /* settings the optimizer does not use are zero, so equal configurations compare equal */
    optim_clear_unused(&c->optim);
    return 0;
}

/* The 409 of a configuration other than the one training started with: what
 * the shard holds (the job a checkpoint it restored was of, when nothing
 * trained since: its folder, step, mode, optimizer and model), how the one
 * sent differs, and what to do. */
static void describe_conflict(server *srv, const store_config *want, char *err, size_t errlen)
{
    store_config have;
    if (store_get_config(&srv->store, &have) != STORE_OK)
        return;
    long long step = (long long)store_global_step(&srv->store);
    char model[128] = "";
    char *pl = store_get_placement(&srv->store);
    json_t *pj = pl ? json_loads(pl, 0, NULL) : NULL;
    const char *spec = json_string_value(json_object_get(pj, "model"));
    if (spec)
        snprintf(model, sizeof(model), ", %.100s", spec);
    json_decref(pj);
    free(pl);
    /* the keys whose values differ, as "sync true (sent: false)" */
    char diff[160] = "";
    size_t dn = 0;
    json_t *a = config_json(&have), *b = config_json(want), *v;
    const char *key;
    json_t *keys = json_object();
    json_object_foreach(a, key, v) json_object_set(keys, key, json_null());
    json_object_foreach(b, key, v) json_object_set(keys, key, json_null());
    json_object_foreach(keys, key, v) {
        json_t *x = json_object_get(a, key), *y = json_object_get(b, key);
        if (x && y && json_equal(x, y))
            continue;
        char *xs = x ? json_dumps(x, JSON_ENCODE_ANY) : NULL, *ys = y ? json_dumps(y, JSON_ENCODE_ANY) : NULL;
        int k = snprintf(diff + dn, sizeof(diff) - dn, "%s%s %s (sent: %s)", dn ? ", " : "", key,
                         xs ? xs : "none", ys ? ys : "none");
        free(xs);
        free(ys);
        if (k < 0 || (size_t)k >= sizeof(diff) - dn) {
            diff[dn] = '\0';
            break;
        }
        dn += (size_t)k;
    }
    json_decref(keys);
    json_decref(a);
    json_decref(b);
    char dir[PATH_MAX] = "";
    long long restored = -1;
    json_t *ck = srv->saver ? saver_status_json(srv->saver) : NULL;
    json_t *rf = json_object_get(ck, "restored_from");
    const char *file = json_string_value(json_object_get(rf, "file"));
    if (file && json_is_integer(json_object_get(rf, "global_step"))) {
        restored = (long long)json_integer_value(json_object_get(rf, "global_step"));
        snprintf(dir, sizeof(dir), "%s", file);
        char *slash = strrchr(dir, '/');
        if (slash && slash != dir)
            *slash = '\0';
        else
            snprintf(dir, sizeof(dir), ".");
    }
    json_decref(ck);
    if (restored == step)
        snprintf(err, errlen,
                 "%.200s holds a checkpoint of another job: step %lld, %s, %s%s; it differs in %s: "
                 "give the ps tasks a new --logdir, or remove %.200s",
                 dir, step, have.sync ? "sync" : "async", optim_name(have.optim.kind), model,
                 diff[0] ? diff : "a setting", dir);
    else
        snprintf(err, errlen,
                 "training started (global_step %lld) with another configuration: %s, %s%s; it differs in %s: "
                 "send the same configuration, or restart the ps tasks with a new --logdir",
                 step, have.sync ? "sync" : "async", optim_name(have.optim.kind), model,
                 diff[0] ? diff : "a setting");
}

enum MHD_Result h_config_get(request *r)
{
    store_config c;
    if (store_get_config(&req_srv(r)->store, &c) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no training configuration yet: the chief sends it");
    return http_reply_json(r, MHD_HTTP_OK, config_json(&c));
}

enum MHD_Result h_config_put(request *r)
{
    char err[256];
    json_t *j = req_body_json(r, err, sizeof(err));
    if (!j)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    /* global_step (the chief putting back a ps that restarted empty or
     * behind the workers): raise the shard's step to it; never lowers it */
    long long at_step = -1;
    json_t *gs = json_object_get(j, "global_step");
    if (gs) {
        if (!json_is_integer(gs) || json_integer_value(gs) < 0 || json_integer_value(gs) > META_INT_MAX) {
            json_decref(j);
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "global_step must be an integer from 0 to %lld",
                                    META_INT_MAX);
        }
        at_step = (long long)json_integer_value(gs);
        json_object_del(j, "global_step");
    }
    store_config c;
    memset(&c, 0, sizeof(c));
    int bad = parse_config(j, &c, err, sizeof(err));
    json_decref(j);
    if (bad)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    if (store_configure(&req_srv(r)->store, &c, err, sizeof(err)) != STORE_OK) {
        char why[1024];
        snprintf(why, sizeof(why), "%s", err);
        describe_conflict(req_srv(r), &c, why, sizeof(why));
        log_info("psd: refused a training configuration: %s", why);
        return http_reply_error(r, MHD_HTTP_CONFLICT, "%s", why);
    }
    int64_t was = store_global_step(&req_srv(r)->store);
    if (at_step > was) {
        store_start_at(&req_srv(r)->store, at_step);
        waiters_raise(req_srv(r)->waiters, WAIT_STEP, at_step);
        log_info("psd: global step set from %lld to %lld by the chief (it put back the variables the workers hold)",
                 (long long)was, at_step);
    }
    log_info("psd: configured: %s, learning_rate %g, %s, replicas_to_aggregate %d of %d workers",
             optim_name(c.optim.kind), (double)c.optim.learning_rate, c.sync ? "sync" : "async",
             c.replicas_to_aggregate, c.workers);
    return http_reply_json(r, MHD_HTTP_OK, config_json(&c));
}

enum MHD_Result h_readyz(request *r)
{
    store_config c;
    const char *ev = http_query(r, "evaluator");
    if (ev && strcmp(ev, "1") == 0) { /* an evaluator waits: the chief waits for its report at the end */
        server *srv = req_srv(r);
        pthread_mutex_lock(&srv->info_mu);
        srv->evaluator_asked = 1;
        pthread_mutex_unlock(&srv->info_mu);
    }
    if (store_get_config(&req_srv(r)->store, &c) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE,
                                "variables not initialized: waiting for the chief");
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:s}", "status", "ready"));
}
