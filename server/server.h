/* server.h - psd's one server struct: configuration, the store, counters. */
#ifndef RESTPS_SERVER_H
#define RESTPS_SERVER_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cluster.h"
#include "store.h"

typedef struct server_config {
    cluster_spec cluster;
    char bind_host[CLUSTER_HOST_MAX + 1];
    int port;             /* 0 = any free port */
    float learning_rate;
    uint64_t max_body_bytes;
    int http_threads;     /* 0 = a thread per connection */
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
} server;

#endif
