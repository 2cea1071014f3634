/* server.h - psd's one server struct: configuration, the store, counters. */
#ifndef RESTPS_SERVER_H
#define RESTPS_SERVER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cluster.h"
#include "store.h"
#include "waiters.h"

typedef struct server_config {
    cluster_spec cluster;
    char bind_host[CLUSTER_HOST_MAX + 1];
    int port;             /* 0 = any free port */
    float learning_rate;
    uint64_t max_body_bytes;
    int http_threads;     /* the epoll pool's size, 1..256 */
    int conn_timeout_secs;
    int max_connections;
    char *auth_token;     /* NULL = writes are open */
    int auth_reads;
    size_t pool_bytes;
} server_config;

typedef struct server {
    server_config cfg;
    store store;
    bufpool *pool;
    char instance[17]; /* random per start; part of every ETag */
    struct timespec started;
    atomic_uint_fast64_t requests;
    waiters *waiters;      /* long polls on /v1/params?min_step= */
    waiters *clock_waiters; /* long polls on /v1/params?min_clock= (stale-synchronous) */
    struct metrics *metrics;   /* counters and histograms for /metrics (metrics.c) */
    struct workers *workers;   /* each worker's last step, last seen, stale drops (workers.c) */
    struct history *history;   /* global_step and loss over time (history.c) */
    struct summaries *summaries; /* ps 0's TensorBoard event files (summaries.c), or NULL */
    atomic_int stopping;   /* POST /v1/shutdown was accepted */
    atomic_int in_flight;  /* requests begun and not yet completed */
    struct saver *saver;   /* checkpoints (saver.c); NULL when --logdir is empty */
    struct membership *membership; /* the sync step's ticker (membership.c) */
    struct conntrack *conntrack;   /* a deadline for each request's headers (conntrack.c) */
    char *tls_cert_pem, *tls_key_pem; /* --tls_cert/--tls_key contents (HTTPS), or NULL */
    pthread_mutex_t info_mu; /* guards what follows */
    struct {
        int has;
        int64_t global_step, examples;
        double loss, accuracy;
        struct timespec at;
    } eval;                /* the evaluator's last report */
    unsigned char done[STORE_MAX_WORKERS]; /* workers that said they finished */
    int n_done;
} server;

#endif
