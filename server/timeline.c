/* timeline.c - the workers' step spans (timeline.h). */
#include "timeline.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "errmsg.h"
#include "request.h"
#include "store.h"

static const char *const kinds[] = {"pull", "wait", "compute", "push"};
#define N_KINDS (int)(sizeof(kinds) / sizeof(kinds[0]))

typedef struct {
    int kind;
    int64_t step;
    double t0, t1; /* seconds since the timeline began */
    char why[TIMELINE_WHY_MAX + 1];
} span;

typedef struct {
    span *s; /* TIMELINE_SPANS, a ring; NULL until the worker sends one */
    int first, n;
} lane;

struct timeline {
    pthread_mutex_t mu;
    double base; /* clk_mono_secs() when it began */
    lane w[STORE_MAX_WORKERS];
};

struct timeline *timeline_new(void)
{
    struct timeline *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    pthread_mutex_init(&t->mu, NULL);
    t->base = clk_mono_secs();
    return t;
}

void timeline_free(struct timeline *t)
{
    if (!t)
        return;
    for (int i = 0; i < STORE_MAX_WORKERS; i++)
        free(t->w[i].s);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static int kind_of(const char *s)
{
    for (int k = 0; k < N_KINDS; k++)
        if (strcmp(s, kinds[k]) == 0)
            return k;
    return -1;
}

/* One entry checked into *out (times still relative, in ms): 0, or -1 with err. */
static int parse_span(const json_t *e, size_t i, span *out, char *err, size_t errlen)
{
    size_t n = json_is_array(e) ? json_array_size(e) : 0;
    if (n != 4 && n != 5)
        return errmsg(err, errlen, "timeline[%zu]: must be [kind, step, start_ms, end_ms] or [..., why]", i), -1;
    const json_t *k = json_array_get(e, 0), *st = json_array_get(e, 1), *a = json_array_get(e, 2),
                 *b = json_array_get(e, 3), *why = n == 5 ? json_array_get(e, 4) : NULL;
    if (!json_is_string(k) || (out->kind = kind_of(json_string_value(k))) < 0)
        return errmsg(err, errlen, "timeline[%zu]: kind must be pull, wait, compute or push", i), -1;
    if (!json_is_integer(st) || json_integer_value(st) < 0 || json_integer_value(st) > META_INT_MAX)
        return errmsg(err, errlen, "timeline[%zu]: step must be an integer from 0 to %lld", i, (long long)META_INT_MAX),
               -1;
    out->step = (int64_t)json_integer_value(st);
    if (!json_is_number(a) || !json_is_number(b))
        return errmsg(err, errlen, "timeline[%zu]: start_ms and end_ms must be numbers", i), -1;
    double t0 = json_number_value(a), t1 = json_number_value(b);
    if (!isfinite(t0) || !isfinite(t1) || t0 < -TIMELINE_BACK_MS || t0 > t1 || t1 > 0)
        return errmsg(err, errlen, "timeline[%zu]: need -%.0f <= start_ms <= end_ms <= 0 (ms before now)", i,
                      TIMELINE_BACK_MS),
               -1;
    out->t0 = t0;
    out->t1 = t1;
    out->why[0] = '\0';
    if (why) {
        const char *s = json_is_string(why) ? json_string_value(why) : NULL;
        size_t len = s ? strlen(s) : 0;
        if (!s || len > TIMELINE_WHY_MAX)
            return errmsg(err, errlen, "timeline[%zu]: why must be a string of at most %d bytes", i,
                          TIMELINE_WHY_MAX),
                   -1;
        for (size_t c = 0; c < len; c++)
            if ((unsigned char)s[c] < 0x20 || s[c] == 0x7f)
                return errmsg(err, errlen, "timeline[%zu]: why holds a control character", i), -1;
        memcpy(out->why, s, len + 1);
    }
    return 0;
}

int timeline_add(struct timeline *t, int worker, const json_t *spans, char *err, size_t errlen)
{
    if (worker < 0 || worker >= STORE_MAX_WORKERS)
        return errmsg(err, errlen, "worker out of range"), -1;
    if (!json_is_array(spans) || json_array_size(spans) > TIMELINE_MAX_BATCH)
        return errmsg(err, errlen, "timeline must be an array of at most %d spans", TIMELINE_MAX_BATCH), -1;
    size_t n = json_array_size(spans);
    if (n == 0)
        return 0;
    span *in = malloc(n * sizeof(*in));
    if (!in)
        return errmsg(err, errlen, "out of memory"), -1;
    for (size_t i = 0; i < n; i++)
        if (parse_span(json_array_get(spans, i), i, &in[i], err, errlen) != 0) {
            free(in);
            return -1;
        }
    pthread_mutex_lock(&t->mu);
    lane *l = &t->w[worker];
    if (!l->s && !(l->s = calloc(TIMELINE_SPANS, sizeof(span)))) {
        pthread_mutex_unlock(&t->mu);
        free(in);
        return errmsg(err, errlen, "out of memory"), -1;
    }
    double now = clk_mono_secs() - t->base;
    for (size_t i = 0; i < n; i++) {
        in[i].t0 = now + in[i].t0 / 1e3;
        in[i].t1 = now + in[i].t1 / 1e3;
        if (l->n == TIMELINE_SPANS) {
            l->first = (l->first + 1) % TIMELINE_SPANS;
            l->n--;
        }
        l->s[(l->first + l->n++) % TIMELINE_SPANS] = in[i];
    }
    pthread_mutex_unlock(&t->mu);
    free(in);
    return 0;
}

static double usec(double x) { return round(x * 1e6) / 1e6; }

json_t *timeline_json(struct timeline *t, double secs)
{
    json_t *o = json_object(), *ws = json_array();
    if (!o || !ws) {
        json_decref(o);
        json_decref(ws);
        return NULL;
    }
    pthread_mutex_lock(&t->mu);
    double now = clk_mono_secs() - t->base;
    for (int w = 0; w < STORE_MAX_WORKERS; w++) {
        lane *l = &t->w[w];
        if (!l->s || l->n == 0)
            continue;
        json_t *a = json_array();
        for (int i = 0; a && i < l->n; i++) {
            const span *s = &l->s[(l->first + i) % TIMELINE_SPANS];
            if (s->t1 < now - secs)
                continue;
            json_t *e = json_pack("{s:s,s:I,s:f,s:f}", "kind", kinds[s->kind], "step", (json_int_t)s->step,
                                  "start", usec(s->t0), "end", usec(s->t1));
            if (e && s->why[0])
                json_object_set_new(e, "for", json_string(s->why));
            if (e)
                json_array_append_new(a, e);
        }
        if (a && json_array_size(a) > 0)
            json_array_append_new(ws, json_pack("{s:i,s:o}", "worker", w, "spans", a));
        else
            json_decref(a);
    }
    pthread_mutex_unlock(&t->mu);
    json_object_set_new(o, "now", json_real(usec(now)));
    json_object_set_new(o, "secs", json_real(secs));
    json_object_set_new(o, "workers", ws);
    return o;
}
