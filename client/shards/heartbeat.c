/* heartbeat.c - the lease-renewing thread (see heartbeat.h). */
#include "shards/heartbeat.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "clock.h"

struct heartbeat {
    ps_client *pc;
    int worker;
    long interval_ms;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    step_timeline *tl; /* guarded by mu */
    char instance[128]; /* guarded by mu; "" none */
    int said_taken;
};

static void *beat(void *arg)
{
    heartbeat *h = arg;
    pthread_mutex_lock(&h->mu);
    while (!h->stop) {
        step_timeline *tl = h->tl;
        json_t *body = json_pack("{s:i}", "worker", h->worker);
        if (body && h->instance[0])
            json_object_set_new(body, "instance", json_string(h->instance));
        pthread_mutex_unlock(&h->mu);
        json_t *spans = tl ? step_timeline_take(tl, clk_mono_secs()) : NULL;
        if (body && spans)
            json_object_set_new(body, "timeline", spans);
        else
            json_decref(spans);
        for (int i = 0; body && i < ps_shards(h->pc); i++)
            if (ps_json(h->pc, i, "POST", "/v1/heartbeat", body, 1, NULL) == PS_EHTTP &&
                ps_http_status(h->pc) == 409 && !h->said_taken) {
                fprintf(stderr, "workerd: worker %d: ps %d: %s: another process took this task id\n", h->worker, i,
                        ps_error(h->pc));
                h->said_taken = 1;
            }
        json_decref(body);
        pthread_mutex_lock(&h->mu);
        struct timespec at = clk_mono_after_ms(h->interval_ms);
        while (!h->stop && pthread_cond_timedwait(&h->cv, &h->mu, &at) != ETIMEDOUT) {
        }
    }
    /* the last beat frees the task id at once (a rerun need not wait for
     * the claim to lapse) */
    json_t *last = h->instance[0] ? json_pack("{s:i,s:s,s:b}", "worker", h->worker, "instance", h->instance,
                                              "leaving", 1)
                                  : NULL;
    pthread_mutex_unlock(&h->mu);
    for (int i = 0; last && i < ps_shards(h->pc); i++)
        ps_json(h->pc, i, "POST", "/v1/heartbeat", last, 1, NULL);
    json_decref(last);
    return NULL;
}

void heartbeat_set_timeline(heartbeat *h, step_timeline *t)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    h->tl = t;
    pthread_mutex_unlock(&h->mu);
}

void heartbeat_set_instance(heartbeat *h, const char *instance)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    snprintf(h->instance, sizeof(h->instance), "%s", instance ? instance : "");
    pthread_mutex_unlock(&h->mu);
}

heartbeat *heartbeat_start(ps_client *pc, int worker, long interval_ms)
{
    heartbeat *h = calloc(1, sizeof(*h));
    if (!h) {
        ps_client_free(pc);
        return NULL;
    }
    h->pc = pc;
    h->worker = worker;
    h->interval_ms = interval_ms;
    pthread_mutex_init(&h->mu, NULL);
    clk_mono_cond_init(&h->cv);
    if (pthread_create(&h->thread, NULL, beat, h) != 0) {
        pthread_mutex_destroy(&h->mu);
        pthread_cond_destroy(&h->cv);
        ps_client_free(pc);
        free(h);
        return NULL;
    }
    return h;
}

void heartbeat_stop(heartbeat *h)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    h->stop = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->thread, NULL);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    ps_client_free(h->pc);
    free(h);
}
