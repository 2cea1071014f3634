/* conntrack.c - a deadline for each request's headers (see conntrack.h). */
#include "conntrack.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "clock.h"
#include "log.h"

typedef struct entry {
    int fd;
    struct sockaddr_storage peer; /* to tell a reused descriptor from this one */
    socklen_t peer_len;
    atomic_int in_request;
    atomic_llong since_ms; /* waiting for headers since */
    int cut;
    struct entry *prev, *next;
} entry;

struct conntrack {
    pthread_t thread;
    pthread_mutex_t mu; /* the list, and stop */
    pthread_cond_t cv;
    entry *head;
    int stop;
    long long timeout_ms;
    int n, cap;         /* tracked connections; past cap the oldest waiting one goes */
    int evicted;        /* since the last log line */
    char evicted_peer[64];
    long long evicted_waited_ms;
    char who[128]; /* the log lines' prefix: the program's ("psd", "workerd: ring endpoint") */
};

static void peer_name(const entry *e, char *out, size_t cap)
{
    char host[INET6_ADDRSTRLEN] = "?";
    unsigned port = 0;
    if (e->peer.ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)&e->peer;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        port = ntohs(a->sin_port);
    } else if (e->peer.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&e->peer;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
        port = ntohs(a->sin6_port);
    }
    snprintf(out, cap, e->peer.ss_family == AF_INET6 ? "[%s]:%u" : "%s:%u", host, port);
}

/* The descriptor still belongs to the connection the entry was made for. */
static int same_peer(const entry *e);

/* At the cap: shut down the connection that has waited longest for a
 * request's headers (idle after an answer, or with a head half sent), never
 * one whose request is being served, nor `keep`. Caller holds t->mu. */
static void evict_oldest(struct conntrack *t, const entry *keep, long long now)
{
    entry *old = NULL;
    for (entry *e = t->head; e; e = e->next)
        if (e != keep && !e->cut && !atomic_load(&e->in_request) &&
            (!old || atomic_load(&e->since_ms) <= atomic_load(&old->since_ms)))
            old = e;
    if (!old || !same_peer(old))
        return;
    shutdown(old->fd, SHUT_RDWR); /* libmicrohttpd sees the end and closes it */
    old->cut = 1;
    if (t->evicted++ == 0) {
        peer_name(old, t->evicted_peer, sizeof(t->evicted_peer));
        t->evicted_waited_ms = now - atomic_load(&old->since_ms);
    }
}

void conntrack_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
                      enum MHD_ConnectionNotificationCode toe)
{
    struct conntrack *t = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *fd =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        entry *e = fd ? calloc(1, sizeof(*e)) : NULL;
        if (!e)
            return; /* untracked: only the idle timeout applies to it */
        e->fd = fd->connect_fd;
        e->peer_len = sizeof(e->peer);
        if (getpeername(e->fd, (struct sockaddr *)&e->peer, &e->peer_len) != 0)
            e->peer_len = 0;
        atomic_store(&e->since_ms, clk_mono_ms());
        pthread_mutex_lock(&t->mu);
        e->next = t->head;
        if (t->head)
            t->head->prev = e;
        t->head = e;
        if (++t->n > t->cap && t->cap > 0)
            evict_oldest(t, e, atomic_load(&e->since_ms));
        pthread_mutex_unlock(&t->mu);
        *socket_context = e;
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED && *socket_context) {
        entry *e = *socket_context;
        pthread_mutex_lock(&t->mu);
        if (e->prev)
            e->prev->next = e->next;
        else
            t->head = e->next;
        if (e->next)
            e->next->prev = e->prev;
        t->n--;
        pthread_mutex_unlock(&t->mu);
        free(e);
        *socket_context = NULL;
    }
}

static entry *entry_of(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

void conntrack_request_begins(struct MHD_Connection *conn)
{
    entry *e = entry_of(conn);
    if (e)
        atomic_store(&e->in_request, 1);
}

void conntrack_request_ends(struct MHD_Connection *conn)
{
    entry *e = entry_of(conn);
    if (e) {
        atomic_store(&e->since_ms, clk_mono_ms());
        atomic_store(&e->in_request, 0);
    }
}

static int same_peer(const entry *e)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof(ss);
    return e->peer_len && getpeername(e->fd, (struct sockaddr *)&ss, &len) == 0 &&
           len == e->peer_len && memcmp(&ss, &e->peer, len) == 0;
}

static void *reap(void *arg)
{
    struct conntrack *t = arg;
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        struct timespec at = clk_mono_after_ms(250);
        while (!t->stop && pthread_cond_timedwait(&t->cv, &t->mu, &at) != ETIMEDOUT) {
        }
        if (t->stop)
            break;
        long long now = clk_mono_ms();
        int n = 0;
        for (entry *e = t->head; e; e = e->next)
            if (!e->cut && !atomic_load(&e->in_request) &&
                now - atomic_load(&e->since_ms) > t->timeout_ms && same_peer(e)) {
                shutdown(e->fd, SHUT_RDWR); /* libmicrohttpd sees the end and closes it */
                e->cut = 1;
                n++;
            }
        if (n)
            log_info("%s: closed %d connection%s whose request headers did not come within %lld s",
                     t->who, n, n == 1 ? "" : "s", t->timeout_ms / 1000);
        if (t->evicted) {
            log_info("%s: %d connections open, over %d: closed %d that had no request in "
                     "progress, the oldest waiting first (the first from %s, waiting %lld ms)",
                     t->who, t->n, t->cap, t->evicted, t->evicted_peer, t->evicted_waited_ms);
            t->evicted = 0;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

struct conntrack *conntrack_start(const char *who, int timeout_secs, int max_conns)
{
    struct conntrack *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    snprintf(t->who, sizeof(t->who), "%s", who && *who ? who : "http");
    t->timeout_ms = (long long)timeout_secs * 1000;
    /* room below libmicrohttpd's limit, so a new connection is always
     * accepted (and can push out an idle one) */
    int room = max_conns / 16 < 1 ? 1 : max_conns / 16 > 64 ? 64 : max_conns / 16;
    t->cap = max_conns > 1 ? max_conns - room : 0;
    pthread_mutex_init(&t->mu, NULL);
    clk_mono_cond_init(&t->cv);
    if (pthread_create(&t->thread, NULL, reap, t) != 0) {
        pthread_cond_destroy(&t->cv);
        pthread_mutex_destroy(&t->mu);
        free(t);
        return NULL;
    }
    return t;
}

void conntrack_stop(struct conntrack *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->thread, NULL);
    while (t->head) { /* none after MHD_stop_daemon; just in case */
        entry *e = t->head;
        t->head = e->next;
        free(e);
    }
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}
