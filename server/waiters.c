/* waiters.c - psd's one list of parked requests (see waiters.h). */
#include "waiters.h"

#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "clock.h"

#define GONE_CHECK_MS 1000 /* how often parked long polls are checked for a departed client */

typedef struct waiter {
    struct MHD_Connection *conn;
    int ch;
    int64_t min, deadline_ms;
    int *flag;       /* set to 1 when resumed, or NULL */
    int watch_gone;  /* resume it when its client hung up */
    struct waiter *next;
} waiter;

typedef struct channel {
    int64_t level;
    int64_t (*level_fn)(void *); /* set: the level is read from it, under mu */
    void *level_arg;
    int count;
} channel;

struct waiters {
    pthread_mutex_t mu;
    ticker *ticker;
    int job; /* the deadlines' job on the ticker */
    int stopping;
    int64_t next_gone_check;
    channel ch[WAITERS_CHANNELS];
    waiter *list;
};

/* Resume and unlink every waiter `pred` selects. Caller holds mu. */
static void resume_where(waiters *w, int (*pred)(const waiters *, const waiter *, int64_t),
                         int64_t arg)
{
    waiter **pp = &w->list;
    while (*pp) {
        waiter *x = *pp;
        if (pred(w, x, arg)) {
            *pp = x->next;
            if (x->flag)
                *x->flag = 1;
            MHD_resume_connection(x->conn);
            w->ch[x->ch].count--;
            free(x);
        } else {
            pp = &x->next;
        }
    }
}

/* A level set by a function is read afresh under mu each time it is used:
 * callers that computed it outside the lock could otherwise store an old
 * value after a newer one. Caller holds mu. */
static int64_t level(waiters *w, int ch)
{
    channel *c = &w->ch[ch];
    if (c->level_fn)
        c->level = c->level_fn(c->level_arg);
    return c->level;
}

static int reached(const waiters *w, const waiter *x, int64_t ch)
{
    return x->ch == ch && w->ch[ch].level >= x->min;
}
static int deadline_passed(const waiters *w, const waiter *x, int64_t now)
{
    (void)w;
    return now >= x->deadline_ms;
}
/* The client hung up (or half-closed) while parked. libmicrohttpd does not
 * watch a suspended connection, so without this a departed long poll kept its
 * connection slot and counted in waiting_pulls until its deadline (up to 300
 * s). Resumed, it is answered (the write fails) or closed by libmicrohttpd
 * when it reads the end of the stream; a client that only half-closed is
 * answered early or closed. */
static int client_gone(const waiters *w, const waiter *x, int64_t unused)
{
    (void)w;
    (void)unused;
    if (!x->watch_gone)
        return 0;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(x->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 0;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}
static int always(const waiters *w, const waiter *x, int64_t unused)
{
    (void)w;
    (void)x;
    (void)unused;
    return 1;
}

/* The ticker's job: resume the waits whose deadline passed and (about once
 * a second) those whose client left; run again at the nearest deadline. */
static int64_t expire(void *arg, int64_t now)
{
    waiters *w = arg;
    pthread_mutex_lock(&w->mu);
    resume_where(w, deadline_passed, now);
    if (now >= w->next_gone_check) {
        resume_where(w, client_gone, 0);
        w->next_gone_check = now + GONE_CHECK_MS;
    }
    int64_t next = TICKER_IDLE;
    for (waiter *x = w->list; x; x = x->next) {
        if (x->deadline_ms < next)
            next = x->deadline_ms;
        if (x->watch_gone && w->next_gone_check < next)
            next = w->next_gone_check;
    }
    pthread_mutex_unlock(&w->mu);
    return next;
}

waiters *waiters_new(ticker *t)
{
    waiters *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    pthread_mutex_init(&w->mu, NULL);
    w->ticker = t;
    if ((w->job = ticker_add(t, expire, w, TICKER_IDLE)) < 0) {
        pthread_mutex_destroy(&w->mu);
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
    resume_where(w, always, 0);
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

void waiters_level_from(waiters *w, int ch, int64_t (*fn)(void *), void *arg)
{
    pthread_mutex_lock(&w->mu);
    w->ch[ch].level_fn = fn;
    w->ch[ch].level_arg = arg;
    level(w, ch);
    pthread_mutex_unlock(&w->mu);
}

void waiters_raise(waiters *w, int ch, int64_t to)
{
    pthread_mutex_lock(&w->mu);
    if (to > w->ch[ch].level)
        w->ch[ch].level = to;
    if (w->ch[ch].count)
        resume_where(w, reached, ch);
    pthread_mutex_unlock(&w->mu);
}

void waiters_changed(waiters *w, int ch)
{
    pthread_mutex_lock(&w->mu);
    level(w, ch);
    if (w->ch[ch].count)
        resume_where(w, reached, ch);
    pthread_mutex_unlock(&w->mu);
}

/* Link a new waiter in; the ticker looks at it by its deadline (and, when
 * watched, by the next check for a departed client). Caller holds mu. */
static void link_in(waiters *w, waiter *x)
{
    w->list = x;
    w->ch[x->ch].count++;
    int64_t at = x->deadline_ms;
    if (x->watch_gone) {
        int64_t now = clk_mono_ms();
        if (w->next_gone_check <= now)
            w->next_gone_check = now + GONE_CHECK_MS;
        if (w->next_gone_check < at)
            at = w->next_gone_check;
    }
    ticker_at(w->ticker, w->job, at);
}

void waiters_add(waiters *w, int ch, struct MHD_Connection *conn, int64_t min, int64_t deadline_ms,
                 int *flag)
{
    pthread_mutex_lock(&w->mu);
    waiter *x = NULL;
    if (level(w, ch) >= min || w->stopping || !(x = malloc(sizeof(*x)))) {
        /* there already, stopping, or out of memory: answer now rather than never */
        *flag = 1;
        MHD_resume_connection(conn);
        pthread_mutex_unlock(&w->mu);
        return;
    }
    *x = (waiter){conn, ch, min, deadline_ms, flag, 1, w->list};
    link_in(w, x);
    pthread_mutex_unlock(&w->mu);
}

int waiters_park(waiters *w, int ch, struct MHD_Connection *conn, int64_t min, int64_t deadline_ms)
{
    waiter *x = malloc(sizeof(*x));
    pthread_mutex_lock(&w->mu);
    if (!x || w->stopping || level(w, ch) >= min || clk_mono_ms() >= deadline_ms) {
        pthread_mutex_unlock(&w->mu);
        free(x);
        if (!x) { /* out of memory: a short nap rather than a busy loop */
            struct timespec nap = {0, 10 * 1000000L};
            nanosleep(&nap, NULL);
        }
        return 0;
    }
    /* suspended before anyone can see it, so nobody resumes it too early */
    MHD_suspend_connection(conn);
    *x = (waiter){conn, ch, min, deadline_ms, NULL, 0, w->list};
    link_in(w, x);
    pthread_mutex_unlock(&w->mu);
    return 1;
}

void waiters_remove(waiters *w, struct MHD_Connection *conn)
{
    pthread_mutex_lock(&w->mu);
    waiter **pp = &w->list;
    while (*pp) {
        waiter *x = *pp;
        if (x->conn == conn) {
            *pp = x->next;
            w->ch[x->ch].count--;
            free(x);
        } else {
            pp = &x->next;
        }
    }
    pthread_mutex_unlock(&w->mu);
}

int waiters_wake_all(waiters *w)
{
    pthread_mutex_lock(&w->mu);
    w->stopping = 1; /* from now on nobody is parked */
    int n = 0;
    for (int c = 0; c < WAITERS_CHANNELS; c++)
        n += w->ch[c].count;
    resume_where(w, always, 0);
    pthread_mutex_unlock(&w->mu);
    return n;
}

int waiters_stopping(waiters *w)
{
    pthread_mutex_lock(&w->mu);
    int s = w->stopping;
    pthread_mutex_unlock(&w->mu);
    return s;
}

int waiters_count(waiters *w, int ch)
{
    pthread_mutex_lock(&w->mu);
    int n = w->ch[ch].count;
    pthread_mutex_unlock(&w->mu);
    return n;
}
