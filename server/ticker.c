/* ticker.c - one thread for psd's timed work (see ticker.h). */
#include "ticker.h"

#include <pthread.h>
#include <stdlib.h>

#include "clock.h"

typedef struct job {
    ticker_fn fn;
    void *arg;
    int64_t next;   /* when it runs next (TICKER_IDLE: when asked) */
    int running;
    int64_t asked;  /* ticker_at while it ran: kept over what it returns */
} job;

struct ticker {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC */
    pthread_t thread;
    int stop;
    job *jobs;
    int n, cap;
};

static void *run(void *arg)
{
    ticker *t = arg;
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        int64_t now = clk_mono_ms(), soonest = TICKER_IDLE;
        for (int i = 0; i < t->n && !t->stop; i++) {
            job *j = &t->jobs[i];
            if (j->next > now) {
                if (j->next < soonest)
                    soonest = j->next;
                continue;
            }
            j->running = 1;
            j->asked = TICKER_IDLE;
            ticker_fn fn = j->fn;
            void *a = j->arg;
            pthread_mutex_unlock(&t->mu);
            int64_t next = fn(a, now);
            pthread_mutex_lock(&t->mu);
            j = &t->jobs[i]; /* ticker_add may have moved the array */
            j->running = 0;
            j->next = next < j->asked ? next : j->asked;
            now = clk_mono_ms();
            i = -1; /* look at every job again: one may be due meanwhile */
            soonest = TICKER_IDLE;
        }
        if (t->stop)
            break;
        if (soonest == TICKER_IDLE) {
            pthread_cond_wait(&t->cv, &t->mu); /* nothing planned: no wake-ups at all */
        } else {
            struct timespec ts = clk_ts_of_ms(soonest);
            pthread_cond_timedwait(&t->cv, &t->mu, &ts);
        }
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

ticker *ticker_new(void)
{
    ticker *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    pthread_mutex_init(&t->mu, NULL);
    clk_mono_cond_init(&t->cv);
    if (pthread_create(&t->thread, NULL, run, t) != 0) {
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
        free(t);
        return NULL;
    }
    return t;
}

void ticker_free(ticker *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->thread, NULL);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t->jobs);
    free(t);
}

int ticker_add(ticker *t, ticker_fn fn, void *arg, int64_t first_ms)
{
    pthread_mutex_lock(&t->mu);
    if (t->n == t->cap) {
        int nc = t->cap ? 2 * t->cap : 4;
        job *nj = realloc(t->jobs, sizeof(*nj) * (size_t)nc);
        if (!nj) {
            pthread_mutex_unlock(&t->mu);
            return -1;
        }
        t->jobs = nj;
        t->cap = nc;
    }
    int id = t->n++;
    t->jobs[id] = (job){fn, arg, first_ms, 0, TICKER_IDLE};
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    return id;
}

void ticker_at(ticker *t, int id, int64_t at_ms)
{
    pthread_mutex_lock(&t->mu);
    if (id >= 0 && id < t->n) {
        job *j = &t->jobs[id];
        if (j->running) {
            if (at_ms < j->asked)
                j->asked = at_ms;
        } else if (at_ms < j->next) {
            j->next = at_ms;
            pthread_cond_signal(&t->cv);
        }
    }
    pthread_mutex_unlock(&t->mu);
}
