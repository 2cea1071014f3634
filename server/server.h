/* server.h - psd's one server struct: configuration, the store, counters. */
#ifndef RESTPS_SERVER_H
#define RESTPS_SERVER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cluster.h"
#include "store.h"
#include "ticker.h"
#include "waiters.h"

/* What a request parked in the waiters waits for (a channel each). */
enum {
    WAIT_STEP,  /* GET /v1/params?min_step=: the shard's global_step */
    WAIT_CLOCK, /* ?min_clock= (stale-synchronous): the slowest live worker's clock */
    WAIT_FEED,  /* GET /v1/events: the history's feed version */
};

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
    uint64_t max_rows;    /* a dynamic sparse variable's default row limit (--max_rows) */
} server_config;

typedef struct server {
    server_config cfg;
    store store;
    bufpool *pool;
    char instance[17]; /* random per start; part of every ETag */
    struct timespec started;
    atomic_uint_fast64_t requests;
    ticker *ticker;        /* the timed work: deadlines, the sync step's lease tick */
    waiters *waiters;      /* parked long polls and SSE streams (changes.c moves their levels) */
    struct metrics *metrics;   /* counters and histograms for /metrics (metrics.c) */
    struct workers *workers;   /* each worker's last step, last seen, stale drops (workers.c) */
    struct timeline *timeline; /* the workers' step spans, for the page (timeline.c) */
    struct task_claims *claims; /* which process holds each worker task id (task_claims.c) */
    struct history *history;   /* global_step and loss over time (history.c) */
    struct shard_view *shards; /* ps 0's view of the other shards (shard_view.c) */
    struct summaries *summaries; /* ps 0's TensorBoard event files (summaries.c), or NULL */
    atomic_int stopping;   /* POST /v1/shutdown was accepted */
    atomic_int in_flight;  /* requests begun and not yet completed */
    struct saver *saver;   /* checkpoints (saver.c); NULL when --logdir is empty */
    char *tls_cert_pem, *tls_key_pem; /* --tls_cert/--tls_key contents (HTTPS), or NULL */
    pthread_mutex_t info_mu; /* guards what follows */
    struct {
        int has;
        int64_t global_step, examples;
        double loss, accuracy;
        struct timespec at;
    } eval;                /* the evaluator's last report */
    int evaluator_asked;   /* an evaluator polled GET /readyz?evaluator=1: the chief waits for its last report */
    unsigned char done[STORE_MAX_WORKERS]; /* workers that said they finished */
    int n_done;
} server;

#endif
