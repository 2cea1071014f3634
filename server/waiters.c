/* waiters.c - parked long-poll requests and the thread that expires them. */
#include "waiters.h"

#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "clock.h"

typedef struct waiter {
    struct MHD_Connection *conn;
    int64_t min_step, deadline_ms;
    int *flag;
    struct waiter *next;
} waiter;

struct waiters {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t timer;
    int stopping;
    int64_t step;
    int64_t (*level_fn)(void *); /* set: the level is read from it, under mu */
    void *level_arg;
    waiter *list;
    int count;
};

/* Resume and unlink every waiter `pred` selects. Caller holds mu. */
static void resume_where(waiters *w, int (*pred)(const waiter *, int64_t), int64_t arg)
{
    waiter **pp = &w->list;
    while (*pp) {
        waiter *x = *pp;
        if (pred(x, arg)) {
            *pp = x->next;
            *x->flag = 1;
            MHD_resume_connection(x->conn);
            free(x);
            w->count--;
        } else {
            pp = &x->next;
        }
    }
}

/* A level set by a function is read afresh under mu each time it is used:
 * callers that computed it outside the lock could otherwise store an old
 * value after a newer one. Caller holds mu. */
static void refresh(waiters *w)
{
    if (w->level_fn)
        w->step = w->level_fn(w->level_arg);
}

static int step_reached(const waiter *x, int64_t step) { return step >= x->min_step; }
static int deadline_passed(const waiter *x, int64_t now) { return now >= x->deadline_ms; }
/* The client hung up (or half-closed) while parked. libmicrohttpd does not
 * watch a suspended connection, so without this a departed long poll kept its
 * connection slot and counted in waiting_pulls until its deadline (up to 300
 * s). Resumed, it is answered (the write fails) or closed by libmicrohttpd
 * when it reads the end of the stream; a client that only half-closed is
 * answered early or closed. */
static int conn_gone(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 0;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static int client_gone(const waiter *x, int64_t unused)
{
    (void)unused;
    return conn_gone(x->conn);
}

static int always(const waiter *x, int64_t unused)
{
    (void)x;
    (void)unused;
    return 1;
}

static void *timer_main(void *arg)
{
    waiters *w = arg;
    pthread_mutex_lock(&w->mu);
    while (!w->stopping) {
        int64_t now = clk_mono_ms(), next = now + 1000;
        resume_where(w, deadline_passed, now);
        resume_where(w, client_gone, 0); /* checked about once a second */
        for (waiter *x = w->list; x; x = x->next)
            if (x->deadline_ms < next)
                next = x->deadline_ms;
        struct timespec ts = clk_mono_after_ms(next - now);
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

waiters *waiters_new(int64_t step)
{
    waiters *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    w->step = step;
    if (pthread_create(&w->timer, NULL, timer_main, w) != 0) {
        free(w);
        return NULL;
    }
    return w;
}

void waiters_free(waiters *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stopping = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_lock(&w->mu);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->timer, NULL);
    resume_where(w, always, 0);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

void waiters_add(waiters *w, struct MHD_Connection *conn, int64_t min_step, int64_t deadline_ms,
                 int *flag)
{
    pthread_mutex_lock(&w->mu);
    refresh(w);
    if (w->step >= min_step || w->stopping) {
        *flag = 1;
        MHD_resume_connection(conn);
        pthread_mutex_unlock(&w->mu);
        return;
    }
    waiter *x = malloc(sizeof(*x));
    if (!x) { /* answer now rather than never */
        *flag = 1;
        MHD_resume_connection(conn);
        pthread_mutex_unlock(&w->mu);
        return;
    }
    *x = (waiter){conn, min_step, deadline_ms, flag, w->list};
    w->list = x;
    w->count++;
    pthread_cond_signal(&w->cv); /* the timer may need to wake sooner */
    pthread_mutex_unlock(&w->mu);
}

static int is_conn(const waiter *x, int64_t conn) { return (int64_t)(intptr_t)x->conn == conn; }

void waiters_remove(waiters *w, struct MHD_Connection *conn)
{
    pthread_mutex_lock(&w->mu);
    waiter **pp = &w->list;
    while (*pp) {
        waiter *x = *pp;
        if (is_conn(x, (int64_t)(intptr_t)conn)) {
            *pp = x->next;
            free(x);
            w->count--;
        } else {
            pp = &x->next;
        }
    }
    pthread_mutex_unlock(&w->mu);
}

void waiters_step(waiters *w, int64_t step)
{
    pthread_mutex_lock(&w->mu);
    if (step > w->step)
        w->step = step;
    resume_where(w, step_reached, w->step);
    pthread_mutex_unlock(&w->mu);
}

void waiters_level_from(waiters *w, int64_t (*fn)(void *), void *arg)
{
    pthread_mutex_lock(&w->mu);
    w->level_fn = fn;
    w->level_arg = arg;
    refresh(w);
    pthread_mutex_unlock(&w->mu);
}

void waiters_relevel(waiters *w)
{
    pthread_mutex_lock(&w->mu);
    refresh(w);
    resume_where(w, step_reached, w->step);
    pthread_mutex_unlock(&w->mu);
}

void waiters_wake_all(waiters *w)
{
    pthread_mutex_lock(&w->mu);
    w->stopping = 1; /* from now on nobody is parked */
    pthread_cond_signal(&w->cv);
    resume_where(w, always, 0);
    pthread_mutex_unlock(&w->mu);
}

int waiters_count(waiters *w)
{
    pthread_mutex_lock(&w->mu);
    int n = w->count;
    pthread_mutex_unlock(&w->mu);
    return n;
}
