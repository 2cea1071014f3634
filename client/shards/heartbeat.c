/* heartbeat.c - the lease-renewing thread (see heartbeat.h). */
#include "shards/heartbeat.h"

#include <errno.h>
#include <pthread.h>
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
};

static void *beat(void *arg)
{
    heartbeat *h = arg;
    pthread_mutex_lock(&h->mu);
    while (!h->stop) {
        step_timeline *tl = h->tl;
        pthread_mutex_unlock(&h->mu);
        json_t *body = json_pack("{s:i}", "worker", h->worker);
        json_t *spans = tl ? step_timeline_take(tl, clk_mono_secs()) : NULL;
        if (body && spans)
            json_object_set_new(body, "timeline", spans);
        else
            json_decref(spans);
        for (int i = 0; body && i < ps_shards(h->pc); i++)
            ps_json(h->pc, i, "POST", "/v1/heartbeat", body, 1, NULL);
        json_decref(body);
        pthread_mutex_lock(&h->mu);
        struct timespec at = clk_mono_after_ms(h->interval_ms);
        while (!h->stop && pthread_cond_timedwait(&h->cv, &h->mu, &at) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&h->mu);
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
