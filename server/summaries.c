/* summaries.c - ps 0's TensorBoard event files (see summaries.h): two
 * writers, the history's points written as they are kept, and the rates
 * sampled once a second on the training writer's own thread. */
#include "summaries.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "history.h"
#include "log.h"
#include "tfevents.h"
#include "workers.h"

#define SUMMARIES_FLUSH_MS 1000

struct summaries {
    tfevents *train, *eval;
    int64_t sampled_step; /* the writer thread's own: the step of the last rates */
};

/* The training writer's thread, once a second: the rates, when the step moved. */
static void sample(void *ctx, tfevents *w)
{
    server *srv = ctx;
    struct summaries *s = srv->summaries;
    int64_t step = store_global_step(&srv->store);
    if (!s || step <= s->sampled_step)
        return;
    s->sampled_step = step;
    double now = clk_unix_secs();
    tfevents_scalar(w, "global_step/sec", step, now, history_steps_per_sec(srv->history));
    tfevents_scalar(w, "examples/sec", step, now, workers_examples_per_sec(srv->workers));
    store_config c;
    store_get_config(&srv->store, &c);
    tfevents_scalar(w, "learning_rate", step, now, c.optim.learning_rate);
    json_t *st = store_staleness_json(&srv->store);
    json_t *count = json_object_get(st, "count"), *mean = json_object_get(st, "mean");
    if (json_integer_value(count) > 0 && json_is_number(mean))
        tfevents_scalar(w, "staleness", step, now, json_number_value(mean));
    json_decref(st);
}

int summaries_start(server *srv, const char *logdir)
{
    if (!logdir || !logdir[0] || srv->cfg.cluster.task_index != 0)
        return 0;
    struct summaries *s = calloc(1, sizeof(*s));
    if (!s) {
        log_error("psd: out of memory for the tensorboard event files: none written");
        return -ENOMEM;
    }
    char dir[4200];
    s->sampled_step = store_global_step(&srv->store);
    srv->summaries = s; /* before the thread: sample() reads it */
    snprintf(dir, sizeof(dir), "%s/train", logdir);
    int rc = tfevents_open(&s->train, "psd", dir, SUMMARIES_FLUSH_MS, sample, srv);
    snprintf(dir, sizeof(dir), "%s/eval", logdir);
    if (rc == 0)
        rc = tfevents_open(&s->eval, "psd", dir, SUMMARIES_FLUSH_MS, NULL, NULL);
    if (rc != 0) {
        log_error("psd: cannot start the tensorboard event writer: %s: none written", strerror(-rc));
        tfevents_close(s->train);
        srv->summaries = NULL;
        free(s);
        return rc;
    }
    history_set_events(srv->history, s->train, s->eval);
    log_info("psd: tensorboard event files go in %s/train/ and %s/eval/", logdir, logdir);
    return 0;
}

void summaries_stop(server *srv)
{
    struct summaries *s = srv->summaries;
    if (!s)
        return;
    history_set_events(srv->history, NULL, NULL);
    tfevents_close(s->train); /* its last round samples: srv->summaries still set */
    tfevents_close(s->eval);
    srv->summaries = NULL;
    free(s);
}
