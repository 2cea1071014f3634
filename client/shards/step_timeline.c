/* step_timeline.c - a worker's step spans, kept for the heartbeat (step_timeline.h). */
#include "shards/step_timeline.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A heartbeat a second takes them; a step of 1 ms makes 4 spans a ms. */
#define TL_CAP 256
#define TL_WHY 48

typedef struct {
    tl_kind kind;
    int64_t step;
    double t0, t1;
    char why[TL_WHY];
} span;

struct step_timeline {
    pthread_mutex_t mu;
    span s[TL_CAP];
    int first, n; /* a ring: the oldest at first */
};

static const char *const names[TL_KINDS] = {"pull", "wait", "compute", "push"};

const char *tl_kind_name(tl_kind k) { return k >= 0 && k < TL_KINDS ? names[k] : "?"; }

step_timeline *step_timeline_new(void)
{
    step_timeline *t = calloc(1, sizeof(*t));
    if (t)
        pthread_mutex_init(&t->mu, NULL);
    return t;
}

void step_timeline_free(step_timeline *t)
{
    if (!t)
        return;
    pthread_mutex_destroy(&t->mu);
    free(t);
}

void step_timeline_add(step_timeline *t, tl_kind k, int64_t step, double t0, double t1, const char *why)
{
    if (!t || t1 < t0)
        return;
    pthread_mutex_lock(&t->mu);
    if (t->n == TL_CAP) { /* the oldest goes */
        t->first = (t->first + 1) % TL_CAP;
        t->n--;
    }
    span *s = &t->s[(t->first + t->n++) % TL_CAP];
    *s = (span){.kind = k, .step = step, .t0 = t0, .t1 = t1};
    if (why)
        snprintf(s->why, sizeof(s->why), "%s", why);
    pthread_mutex_unlock(&t->mu);
}

json_t *step_timeline_take(step_timeline *t, double now)
{
    if (!t)
        return NULL;
    json_t *a = NULL;
    pthread_mutex_lock(&t->mu);
    if (t->n > 0 && (a = json_array())) {
        for (int i = 0; i < t->n; i++) {
            const span *s = &t->s[(t->first + i) % TL_CAP];
            /* whole microseconds: the ps keeps no more */
            json_t *e = json_pack("[s,I,f,f]", names[s->kind], (json_int_t)s->step,
                                  (double)(int64_t)((s->t0 - now) * 1e6) / 1e3,
                                  (double)(int64_t)((s->t1 - now) * 1e6) / 1e3);
            if (e && s->why[0])
                json_array_append_new(e, json_string(s->why));
            if (e)
                json_array_append_new(a, e);
        }
        t->first = t->n = 0;
    }
    pthread_mutex_unlock(&t->mu);
    return a;
}
