/* chief.c - what the chief does besides training: at the start, as
 * tf.train.Supervisor.prepare_or_wait_for_session, wait for every ps, check
 * a placement already there (a restarted chief with other flags), create the
 * variables with create-only PUTs (leaving any that exist, e.g. restored),
 * send the placement map and the training configuration (which marks each ps
 * ready); at the end, wait (bounded) for the other tasks to finish, and
 * for an evaluator's report of the last step before the ps tasks stop. */
#include "workerd/train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "shards/shards.h"

static void wait_others(const train_config *c, ps_client *pc, double secs, int self_done);
static void stop_ps_now(const train_config *c, ps_client *pc);

/* POST /v1/checkpoint on ps i; a ps whose checkpoints are off (409) is left alone. */
static void checkpoint_now(const train_config *c, ps_client *pc, int i, const char *when)
{
    int rc = ps_json(pc, i, "POST", "/v1/checkpoint", NULL, 0, NULL);
    if (rc != PS_OK && !(rc == PS_EHTTP && ps_http_status(pc) == 409))
        fprintf(stderr, "workerd: %s: the checkpoint %s on ps %d: %s\n", c->name, when, i, ps_error(pc));
}

/* The training configuration the chief sends (PUT /v1/config). */
static json_t *config_json(const train_config *c)
{
    json_t *cfg = json_pack("{s:s,s:f,s:b,s:i,s:i}", "optimizer", optim_name(c->optim.kind),
                            "learning_rate", (double)c->optim.learning_rate, "sync", c->sync,
                            "replicas_to_aggregate", c->replicas_to_aggregate, "workers",
                            c->n_trainers);
    const optim_config *o = &c->optim;
    if (o->kind == OPTIM_MOMENTUM || o->kind == OPTIM_RMSPROP)
        json_object_set_new(cfg, "momentum", json_real(o->momentum));
    if (o->kind == OPTIM_MOMENTUM && o->nesterov)
        json_object_set_new(cfg, "nesterov", json_true());
    if (o->kind == OPTIM_RMSPROP)
        json_object_set_new(cfg, "rmsprop_decay", json_real(o->rmsprop_decay));
    if (o->kind == OPTIM_ADAGRAD)
        json_object_set_new(cfg, "initial_accumulator_value", json_real(o->initial_accumulator_value));
    if (o->clip_norm > 0)
        json_object_set_new(cfg, "clip_norm", json_real(o->clip_norm));
    if (o->weight_decay > 0)
        json_object_set_new(cfg, "weight_decay", json_real(o->weight_decay));
    if (o->lr_schedule != OPTIM_LR_CONSTANT) {
        json_object_set_new(cfg, "lr_schedule", json_string(optim_schedule_name(o->lr_schedule)));
        json_object_set_new(cfg, "decay_steps", json_integer(o->decay_steps));
    }
    if (o->lr_schedule == OPTIM_LR_EXPONENTIAL) {
        json_object_set_new(cfg, "decay_rate", json_real(o->decay_rate));
        json_object_set_new(cfg, "staircase", json_boolean(o->staircase));
    }
    if (o->lr_schedule == OPTIM_LR_COSINE)
        json_object_set_new(cfg, "alpha", json_real(o->alpha));
    if (c->max_staleness >= 0)
        json_object_set_new(cfg, "max_staleness", json_integer(c->max_staleness));
    if (c->staleness >= 0)
        json_object_set_new(cfg, "staleness", json_integer(c->staleness));
    if (c->moving_average_decay > 0)
        json_object_set_new(cfg, "moving_average_decay", json_real(c->moving_average_decay));
    return cfg;
}

/* The ps tasks hold another job: give the other tasks a few seconds to
 * find that out from the ps (they say so and exit), then stop the ps tasks
 * (unless --keep_ps), as at the end. The chief does not say it is done: a
 * sync step of that job keeps waiting for it meanwhile. */
static void chief_give_up(const train_config *c, ps_client *pc)
{
    ps_set_retry_ms(pc, 0);
    if (c->keep_ps)
        return;
    wait_others(c, pc, 5, 0);
    stop_ps_now(c, pc);
}

int train_chief_setup(const train_config *c, ps_client *pc, shards *sh, float *params)
{
    train_wait_for_all(c, pc, "/healthz", "the ps tasks");
    if (train_check_placement(c, pc, sh) != 0) /* a restarted chief with other flags */
        return 2;
    if (c->data_langid)
        langid_init_params(c, params);
    else
        model_init_params(&c->layout, params, c->seed);
    int created, existing;
    if (shards_create(sh, params, &created, &existing) != PS_OK) {
        fprintf(stderr, "workerd: creating the variables: %s\n", ps_error(pc));
        return 1;
    }
    if (existing)
        printf("%s: %d variables existed already (restored or created before): kept them; created %d\n",
               c->name, existing, created);
    else
        printf("%s: created %d variables (%zu parameters) on %d ps\n", c->name, created,
               c->layout.n_params, ps_shards(pc));
    json_t *map = placement_json(&sh->pl, &c->layout);
    if (c->data_langid)
        json_object_set_new(map, "sparse", langid_placement(c, ps_shards(pc)));
    for (int i = 0; i < ps_shards(pc); i++)
        if (ps_json(pc, i, "PUT", "/v1/placement", map, 1, NULL) != PS_OK) {
            fprintf(stderr, "workerd: sending the placement: %s\n", ps_error(pc));
            json_decref(map);
            return 1;
        }
    json_decref(map);
    json_t *cfg = config_json(c);
    for (int i = 0; i < ps_shards(pc); i++) {
        if (c->ps_replicas) /* the pipeline: each ps counts the pushes it gets */
            json_object_set_new(cfg, "replicas_to_aggregate", json_integer(c->ps_replicas[i]));
        int prc = ps_json(pc, i, "PUT", "/v1/config", cfg, 1, NULL);
        if (prc == PS_EHTTP && ps_http_status(pc) == 409) {
            /* the ps holds another job (a checkpoint of it, restored): say
             * what psd found and what to do, and end the job, so that no
             * task is left waiting or following that job's configuration */
            const char *why = strstr(ps_error(pc), "HTTP 409: ");
            fprintf(stderr, "workerd: %s: ps %d refused this job's training configuration: %s\n", c->name, i,
                    why ? why + strlen("HTTP 409: ") : ps_error(pc));
            json_decref(cfg);
            chief_give_up(c, pc);
            return 1;
        }
        if (prc != PS_OK) {
            fprintf(stderr, "workerd: sending the training configuration: %s\n", ps_error(pc));
            json_decref(cfg);
            return 1;
        }
    }
    json_decref(cfg);
    /* a checkpoint now, so that a ps that dies before its first periodic
     * one restarts with the variables and the configuration (409: its
     * checkpoints are off) */
    for (int i = 0; i < ps_shards(pc); i++)
        checkpoint_now(c, pc, i, "after initialization");
    return 0;
}

int train_chief_put_back(const train_config *c, ps_client *pc, shards *sh, const float *params, int i)
{
    const shard *s = &sh->s[i];
    int n = 0;
    char how[96] = "empty";
    if (s->back != 2)
        snprintf(how, sizeof(how), "behind the workers (global step went back from %lld to %lld)",
                 (long long)s->step, (long long)s->back_step);
    printf("%s: ps %d came back %s: putting back its %d variables at global step %lld "
           "(the optimizer's slots are not put back: %s)\n",
           c->name, i, how, s->n_p, (long long)s->step,
           s->back == 2 ? "they start fresh" : "they stay as the ps restored them");
    fflush(stdout);
    if (shards_put_back(sh, i, params, &n) != PS_OK) {
        fprintf(stderr, "workerd: putting back the variables of ps %d: %s\n", i, ps_error(pc));
        return -1;
    }
    json_t *map = placement_json(&sh->pl, &c->layout);
    int rc = ps_json(pc, i, "PUT", "/v1/placement", map, 1, NULL);
    json_decref(map);
    if (rc != PS_OK) {
        fprintf(stderr, "workerd: sending the placement to ps %d: %s\n", i, ps_error(pc));
        return -1;
    }
    json_t *cfg = config_json(c);
    if (c->ps_replicas)
        json_object_set_new(cfg, "replicas_to_aggregate", json_integer(c->ps_replicas[i]));
    json_object_set_new(cfg, "global_step", json_integer(s->step));
    rc = ps_json(pc, i, "PUT", "/v1/config", cfg, 1, NULL);
    json_decref(cfg);
    if (rc != PS_OK) {
        fprintf(stderr, "workerd: sending the training configuration to ps %d: %s\n", i, ps_error(pc));
        return -1;
    }
    checkpoint_now(c, pc, i, "after putting back its variables");
    printf("%s: ps %d has its %d variables again at global step %lld\n", c->name, i, n, (long long)s->step);
    return 0;
}

/* "worker 1 (host:port), worker 2 (host:port)": the training tasks other
 * than this one not in finished (psd's workers_finished), at most 8 named. */
static void name_unfinished(const train_config *c, const json_t *finished, char *out, size_t n)
{
    const cluster_spec *cs = c->cluster;
    int has_chief = cs->jobs[JOB_CHIEF].n > 0, named = 0, more = 0;
    size_t at = 0;
    out[0] = '\0';
    for (int t = 0; t < c->n_trainers; t++) {
        int fin = t == c->trainer;
        for (size_t i = 0; !fin && i < json_array_size(finished); i++)
            fin = json_integer_value(json_array_get(finished, i)) == t;
        if (fin)
            continue;
        if (named == 8) {
            more++;
            continue;
        }
        int job = has_chief && t == 0 ? JOB_CHIEF : JOB_WORKER, idx = has_chief && t > 0 ? t - 1 : t;
        const cluster_addr *task = &cs->jobs[job].tasks[idx];
        int k = snprintf(out + at, n - at, "%s%s %d (%s:%d)", named ? ", " : "", job == JOB_CHIEF ? "chief" : "worker",
                         idx, task->host, task->port);
        if (k < 0 || (size_t)k >= n - at)
            break;
        at += (size_t)k;
        named++;
    }
    if (more && at < n)
        snprintf(out + at, n - at, " and %d more", more);
}

/* Wait up to secs for the other tasks to say they finished (self_done: the
 * chief said so too), naming those it waits for. */
static void wait_others(const train_config *c, ps_client *pc, double secs, int self_done)
{
    double start = clk_mono_secs(), said = start;
    for (;;) {
        json_t *st;
        if (ps_status(pc, 0, &st) != PS_OK)
            return;
        int done = (int)json_integer_value(json_object_get(st, "workers_done"));
        char who[512];
        name_unfinished(c, json_object_get(st, "workers_finished"), who, sizeof(who));
        json_decref(st);
        /* workers_done counts the chief too: it said so before waiting */
        done = self_done && done > 0 ? done - 1 : done;
        if (done >= c->n_trainers - 1)
            return;
        if (clk_mono_secs() - start > secs || train_stop_requested()) {
            printf("%s: %d of %d other tasks said they finished; not waiting longer for %s\n", c->name,
                   done, c->n_trainers - 1, who);
            return;
        }
        if (clk_mono_secs() - said > 5) {
            printf("%s: waiting for %d other task%s to finish: %s\n", c->name, c->n_trainers - 1 - done,
                   c->n_trainers - 1 - done == 1 ? "" : "s", who);
            said = clk_mono_secs();
        }
        train_sleep(0.1);
    }
}

/* After the chief's last step: wait (bounded) for the others to finish. */
void train_chief_wait_others(const train_config *c, ps_client *pc) { wait_others(c, pc, 60, 1); }

/* An evaluator reports to ps 0 (eval in /v1/status) and evaluates the final
 * model as soon as the global step reaches --train_steps: before the ps
 * tasks stop, wait (60 s at most, saying so every 5 s) for its report of
 * that step, so the evaluator's last line and the page show the final
 * model. An evaluator is known to ps 0 once it polled /readyz?evaluator=1
 * or reported (evaluator_seen); none known: no wait. */
static void wait_evaluator(const train_config *c, ps_client *pc)
{
    double start = clk_mono_secs(), said = start;
    int first = 1;
    for (;;) {
        json_t *st;
        if (ps_status(pc, 0, &st) != PS_OK)
            return;
        int64_t step = json_integer_value(json_object_get(st, "global_step"));
        const json_t *ev = json_object_get(st, "eval");
        int64_t at = json_is_object(ev) ? json_integer_value(json_object_get(ev, "global_step")) : -1;
        int seen = json_is_true(json_object_get(st, "evaluator_seen")) || at >= 0;
        json_decref(st);
        int64_t want = step < c->train_steps ? step : c->train_steps;
        if (!seen || at >= want)
            return;
        double waited = clk_mono_secs() - start;
        if (waited > 60 || train_stop_requested()) {
            printf("%s: the evaluator has not reported global step %lld (its last report: %s%lld); "
                   "not waiting longer\n", c->name, (long long)want, at >= 0 ? "global step " : "none, ",
                   (long long)at);
            return;
        }
        if (first || clk_mono_secs() - said > 5) {
            if (at >= 0)
                printf("%s: waiting for the evaluator's report of global step %lld (its last: global step %lld; "
                       "at most %.0f s more)\n", c->name, (long long)want, (long long)at, 60 - waited);
            else
                printf("%s: waiting for the evaluator's report of global step %lld (none yet; at most %.0f s "
                       "more)\n", c->name, (long long)want, 60 - waited);
            fflush(stdout);
            said = clk_mono_secs();
            first = 0;
        }
        train_sleep(0.1);
    }
}

/* Ask every ps task to stop, now. */
static void stop_ps_now(const train_config *c, ps_client *pc)
{
    for (int i = 0; i < ps_shards(pc); i++)
        if (ps_json(pc, i, "POST", "/v1/shutdown", NULL, 0, NULL) != PS_OK)
            fprintf(stderr, "workerd: shutdown: %s\n", ps_error(pc));
    printf("%s: asked the ps tasks to stop (--keep_ps keeps them)\n", c->name);
}

void train_chief_stop_ps(const train_config *c, ps_client *pc)
{
    if (c->keep_ps)
        return;
    wait_evaluator(c, pc);
    stop_ps_now(c, pc);
}
