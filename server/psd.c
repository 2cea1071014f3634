/* psd.c - the parameter-server daemon: flags, cluster, listening socket,
 * libmicrohttpd, clean stop on SIGTERM/SIGINT. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "pem.h"
#include "token.h"
#include "flags.h"
#include "history.h"
#include "shard_view.h"
#include "metrics.h"
#include "task_claims.h"
#include "timeline.h"
#include "workers.h"
#include "log.h"
#include "routes.h"
#include "saver.h"
#include "summaries.h"
#include "membership.h"
#include "changes.h"
#include "http_server.h"
#include "tls_priorities.h"
#include "server.h"

static volatile sig_atomic_t stop_requested;
/* Set when psd begins to stop: from then on new connections are accepted and
 * closed at once (see accept_policy). */
static atomic_bool closing;

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

/* A host name that means this machine only. */
static int is_loopback(const char *host)
{
    return !strcmp(host, "localhost") || !strncmp(host, "127.", 4) || !strcmp(host, "::1");
}

/* Open the listening socket ourselves so --port=0 and --bind work the same
 * on every libmicrohttpd version. -1 with err on failure. */
static int listen_on(const char *host, int port, int sndbuf, int *bound_port, char *err,
                     size_t errlen)
{
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char portstr[16];
    snprintf(portstr, sizeof(portstr), "%d", port);
    int rc = getaddrinfo(host[0] ? host : NULL, portstr, &hints, &res);
    if (rc != 0) {
        snprintf(err, errlen, "unable to resolve bind address '%s': %s", host, gai_strerror(rc));
        return -1;
    }
    int fd = -1, last_errno = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        /* accepted connections inherit it */
        if (sndbuf > 0)
            setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) {
            struct sockaddr_storage ss;
            socklen_t sl = sizeof(ss);
            getsockname(fd, (struct sockaddr *)&ss, &sl);
            *bound_port = ntohs(ss.ss_family == AF_INET6
                                    ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                    : ((struct sockaddr_in *)&ss)->sin_port);
            break;
        }
        last_errno = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        snprintf(err, errlen, "unable to listen on %s:%d: %s", host[0] ? host : "*", port,
                 strerror(last_errno));
    return fd;
}

static void random_instance(char out[17])
{
    unsigned char b[8];
    if (getrandom(b, sizeof(b), 0) != (ssize_t)sizeof(b)) {
        struct timespec t = clk_unix_ts();
        uint64_t x = (uint64_t)t.tv_nsec ^ ((uint64_t)t.tv_sec << 20) ^ (uint64_t)getpid();
        memcpy(b, &x, 8);
    }
    for (int i = 0; i < 8; i++)
        sprintf(out + 2 * i, "%02x", b[i]);
}

/* libmicrohttpd's accept policy: no new connections once psd is stopping. This,
 * not MHD_quiesce_daemon, is how psd stops taking connections: in epoll mode
 * quiescing races the polling threads, which remove the listening socket from
 * their epoll sets themselves, and the loser's EPOLL_CTL_DEL fails with ENOENT,
 * which libmicrohttpd 0.9.75 treats as fatal ("Failed to remove listen FD from
 * epoll set", an abort on SIGTERM now and then). A client connecting during
 * the drain sees its connection closed, as it would after the stop. */
static enum MHD_Result accept_policy(void *cls, const struct sockaddr *addr, socklen_t len)
{
    (void)cls;
    (void)addr;
    (void)len;
    return atomic_load(&closing) ? MHD_NO : MHD_YES;
}

static void mhd_panic(void *cls, const char *file, unsigned int line, const char *reason)
{
    (void)cls;
    log_error("libmicrohttpd: fatal error at %s:%u: %s", file, line, reason ? reason : "");
    abort();
}

/* Leave before the server starts: free what was built (a clean exit under
 * the leak checker too). */
static int fail(server *srv, int status)
{
    free(srv->tls_cert_pem);
    free(srv->tls_key_pem);
    cluster_spec_free(&srv->cfg.cluster);
    free(srv->cfg.auth_token);
    free(srv);
    return status;
}

/* The flags' values, as main's table fills them. */
typedef struct psd_flags {
    const char *job_name, *ps_hosts, *worker_hosts, *chief_hosts;
    const char *bind_host, *auth_file, *logdir;
    const char *tls_cert, *tls_key, *tls_ca, *tls_prio;
    int task_index, task_index_given, port, http_threads, conn_timeout, max_conns;
    int auth_reads, print_routes, sndbuf_kib, save_secs, keep_ckpts;
    float lease_secs, lr;
    uint64_t max_body, pool_mib, max_rows;
} psd_flags;

/* The command line into o: -1 to go on, else the exit status (--help and
 * --routes: 0, a bad flag: 2). */
static int parse_flags(psd_flags *o, int argc, char **argv)
{
    *o = (psd_flags){.logdir = "./logs", .task_index = -1, .port = -1, .http_threads = 2,
                     .conn_timeout = 60, .max_conns = 1024, .sndbuf_kib = -1, .save_secs = 60,
                     .keep_ckpts = 5, .lease_secs = 10, .lr = 0.01f, .max_body = 1ULL << 30,
                     .pool_mib = 256, .max_rows = 1u << 20};
    flag flags[] = {
        {"job_name", FLAG_STRING, &o->job_name, "this task's job: ps (default) or another job in the cluster", 0},
        {"task_index", FLAG_INT, &o->task_index, "this task's index in its job (default 0)", 0},
        {"ps_hosts", FLAG_STRING, &o->ps_hosts, "comma-separated host:port of the ps tasks (default localhost:2222)", 0},
        {"worker_hosts", FLAG_STRING, &o->worker_hosts, "comma-separated host:port of the worker tasks", 0},
        {"chief_hosts", FLAG_STRING, &o->chief_hosts, "host:port of the chief task, if the cluster has one", 0},
        {"port", FLAG_INT, &o->port, "listen on this port instead of the one in this task's entry; 0 = any free port", 0},
        {"bind", FLAG_STRING, &o->bind_host, "address to listen on (default: loopback when this task's host is localhost/127.x, else all)", 0},
        {"learning_rate", FLAG_FLOAT, &o->lr, "learning rate until the chief sends the training configuration (default 0.01, plain SGD, async)", 0},
        {"max_body_bytes", FLAG_U64, &o->max_body, "largest request body accepted, in bytes (default 1073741824); larger is refused with 413 before it is read", 0},
        {"http_threads", FLAG_INT, &o->http_threads, "HTTP threads polling with epoll (default 2), 1..256", 0},
        {"connection_timeout", FLAG_INT, &o->conn_timeout, "close a connection idle for this many seconds, or whose request headers take longer to arrive; past this many seconds a body must average 1 KiB/s or is cut off (default 60; long polls wait on)", 0},
        {"max_connections", FLAG_INT, &o->max_conns, "most connections served at once; more wait in the listen queue (default 1024)", 0},
        {"auth_token_file", FLAG_STRING, &o->auth_file, "file holding a bearer token that every PUT/POST must carry (default: none, writes are open)", 0},
        {"auth_reads", FLAG_BOOL, &o->auth_reads, "require the token for reads too, except /healthz (default false)", 0},
        {"max_rows", FLAG_U64, &o->max_rows, "a dynamic sparse variable (rows 0) declared without max_rows holds at most this many rows; past it the least recently updated rows are evicted (default 1048576)", 0},
        {"buffer_pool_mib", FLAG_U64, &o->pool_mib, "MiB of idle buffers kept for reuse (default 256)", 0},
        {"sndbuf_kib", FLAG_INT, &o->sndbuf_kib, "socket send buffer in KiB; 0 = the kernel's autotuning (default: 256 when bound to loopback, where autotuned buffers slow small answers after large ones, else 0)", 0},
        {"tls_cert", FLAG_STRING, &o->tls_cert, "serve HTTPS with this PEM certificate (chain); needs --tls_key", 0},
        {"tls_key", FLAG_STRING, &o->tls_key, "the PEM private key of --tls_cert", 0},
        {"tls_priorities", FLAG_STRING, &o->tls_prio, "with --tls_cert: the GnuTLS priority string that picks the TLS versions and cipher suites (default " TLS_PRIORITIES_DEFAULT ": TLS 1.3/1.2, AEAD suites with AES-GCM first, ECDHE, the server's order)", 0},
        {"tls_ca", FLAG_STRING, &o->tls_ca, "with --tls_cert: the CA(s) to trust for the other ps tasks' certificates (ps 0 polls their status; default: the system's)", 0},
        {"logdir", FLAG_STRING, &o->logdir, "folder for checkpoints and TensorBoard event files, as tf.train.Supervisor's logdir; this task's checkpoints go in <logdir>/ps-<task_index>/ and the newest valid one is restored at start; ps 0 also writes TensorBoard's events.out.tfevents.* files: loss, global_step/sec, examples/sec, learning_rate, staleness in <logdir>/train/, the evaluator's loss and accuracy in <logdir>/eval/ (default ./logs); empty = no checkpoints, no event files", 0},
        {"save_checkpoint_secs", FLAG_INT, &o->save_secs, "save a checkpoint this often when something changed (default 60); 0 = only on POST /v1/checkpoint and at a clean stop", 0},
        {"keep_checkpoints", FLAG_INT, &o->keep_ckpts, "keep the newest this many checkpoints (default 5)", 0},
        {"worker_lease_secs", FLAG_FLOAT, &o->lease_secs, "sync: a worker not heard from for this long no longer holds up a step (it counts again from its next request; default 10)", 0},
        {"routes", FLAG_BOOL, &o->print_routes, "print the HTTP route table and exit", 0},
    };
    int nflags = (int)(sizeof(flags) / sizeof(flags[0]));
    char err[512];
    int fr = flags_parse_prog("psd", flags, nflags, argc, argv, err, sizeof(err));
    if (fr == 1) {
        flags_help(stdout,
                   "usage: psd [flags]\n"
                   "The restps parameter server: holds a shard of the model's variables and serves\n"
                   "them over HTTP. The cluster comes from the flags or the TF_CONFIG environment\n"
                   "variable (TensorFlow's JSON); flags win.",
                   flags, nflags);
        return 0;
    }
    if (fr < 0) {
        fprintf(stderr, "psd: %s\n", err); /* the hint is in err */
        return 2;
    }
    if (o->print_routes) {
        routes_print(stdout);
        return 0;
    }
    o->task_index_given = flags_get(flags, nflags, "task_index")->given;
    return -1;
}

/* The flags checked and into srv->cfg (the cluster, the token, the TLS
 * files read): 0, or 2 with a one-line message. */
static int configure(server *srv, const psd_flags *o)
{
    char err[512];
    if (o->task_index_given && o->task_index < 0) {
        fprintf(stderr, "psd: --task_index=%d is negative\n", o->task_index);
        return 2;
    }
    cluster_input in = {.job_name = o->job_name,
                        .task_index = o->task_index,
                        .ps_hosts = o->ps_hosts,
                        .worker_hosts = o->worker_hosts,
                        .chief_hosts = o->chief_hosts,
                        .tf_config = getenv("TF_CONFIG"),
                        .default_job = "ps"};
    if (cluster_spec_build(&in, &srv->cfg.cluster, err, sizeof(err)) != 0) {
        fprintf(stderr, "psd: %s\n", err);
        return 2;
    }
    if (srv->cfg.cluster.job != JOB_PS) {
        fprintf(stderr, "psd: this task is %s %d, but psd serves ps tasks only\n",
                cluster_job_name(srv->cfg.cluster.job), srv->cfg.cluster.task_index);
        return 2;
    }
    const cluster_addr *self = cluster_self(&srv->cfg.cluster);
    if (o->port < -1 || o->port > 65535) {
        fprintf(stderr, "psd: --port=%d is out of range 0..65535\n", o->port);
        return 2;
    }
    if (!(o->lr > 0)) {
        fprintf(stderr, "psd: --learning_rate must be positive, got %g\n", (double)o->lr);
        return 2;
    }
    if (o->http_threads == 0) {
        /* a thread per connection measured no faster than the epoll pool
         * (0.6-1.1x) and needed a second, blocking path for every wait */
        fprintf(stderr, "psd: --http_threads=0 (a thread per connection) is no longer supported: "
                        "it was no faster than the epoll pool; use 1..256\n");
        return 2;
    }
    if (o->http_threads < 1 || o->http_threads > 256) {
        fprintf(stderr, "psd: --http_threads must be 1..256, got %d\n", o->http_threads);
        return 2;
    }
    if (o->sndbuf_kib < -1 || o->sndbuf_kib > 1024 * 1024) {
        fprintf(stderr, "psd: --sndbuf_kib must be 0..1048576, got %d\n", o->sndbuf_kib);
        return 2;
    }
    if (o->conn_timeout < 1 || o->max_conns < 1 || o->max_body < 1) {
        fprintf(stderr, "psd: --connection_timeout, --max_connections and --max_body_bytes must be positive\n");
        return 2;
    }
    if (!(o->lease_secs >= 0.5 && o->lease_secs <= 86400)) {
        fprintf(stderr, "psd: --worker_lease_secs must be from 0.5 to 86400, got %g\n", (double)o->lease_secs);
        return 2;
    }
    if (!o->tls_cert != !o->tls_key || ((o->tls_ca || o->tls_prio) && !o->tls_cert)) {
        fprintf(stderr, "psd: --tls_cert and --tls_key go together (and --tls_ca and --tls_priorities need them)\n");
        return 2;
    }
    if (o->tls_prio && tls_priorities_check(o->tls_prio, err, sizeof(err)) != 0) {
        fprintf(stderr, "psd: --tls_priorities=%s: %s\n", o->tls_prio, err);
        return 2;
    }
    if (o->tls_cert && (!(srv->tls_cert_pem = pem_read(o->tls_cert, err, sizeof(err))) ||
                        !(srv->tls_key_pem = pem_read(o->tls_key, err, sizeof(err))))) {
        fprintf(stderr, "psd: %s\n", err);
        return 2;
    }
    if (o->save_secs < 0 || o->keep_ckpts < 1) {
        fprintf(stderr, "psd: --save_checkpoint_secs must be >= 0 and --keep_checkpoints >= 1\n");
        return 2;
    }
    if (o->max_rows < 1 || o->max_rows > ((uint64_t)1 << 40)) {
        fprintf(stderr, "psd: --max_rows must be 1 to 2^40\n");
        return 2;
    }
    if (o->auth_reads && !o->auth_file) {
        fprintf(stderr, "psd: --auth_reads needs --auth_token_file\n");
        return 2;
    }
    server_config *cfg = &srv->cfg;
    if (o->auth_file && !(cfg->auth_token = token_load(o->auth_file, err, sizeof(err)))) {
        fprintf(stderr, "psd: %s\n", err);
        return 2;
    }
    cfg->auth_reads = o->auth_reads;
    cfg->port = o->port >= 0 ? o->port : self->port;
    if (o->bind_host)
        snprintf(cfg->bind_host, sizeof(cfg->bind_host), "%s", o->bind_host);
    else if (is_loopback(self->host))
        /* the task's own loopback address: 127.0.0.1 does not answer for 127.0.0.2 */
        snprintf(cfg->bind_host, sizeof(cfg->bind_host), "%s",
                 !strcmp(self->host, "localhost") ? "127.0.0.1" : self->host);
    else
        cfg->bind_host[0] = '\0'; /* every address */
    cfg->learning_rate = o->lr;
    cfg->max_body_bytes = o->max_body;
    cfg->http_threads = o->http_threads;
    cfg->conn_timeout_secs = o->conn_timeout;
    cfg->max_connections = o->max_conns;
    cfg->pool_bytes = (size_t)o->pool_mib << 20;
    cfg->max_rows = o->max_rows;
    return 0;
}

/* SIGTERM/SIGINT set stop_requested, blocked in every thread created from
 * now on (call before any); *waitmask: the mask main waits with. */
static void handle_signals(sigset_t *waitmask)
{
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    sigset_t stopset;
    sigemptyset(&stopset);
    sigaddset(&stopset, SIGTERM);
    sigaddset(&stopset, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stopset, waitmask);
    sigdelset(waitmask, SIGTERM);
    sigdelset(waitmask, SIGINT);
}

/* The server's parts in order (the pool and store are made by main before
 * the signals): ticker, waiters, metrics, workers, history, the saver with
 * its restore, the summaries, the change notification. 0, or 1 with a
 * message. */
static int build_parts(server *srv, const psd_flags *o)
{
    server_config *cfg = &srv->cfg;
    pthread_mutex_init(&srv->info_mu, NULL);
    srv->ticker = ticker_new();
    srv->waiters = srv->ticker ? waiters_new(srv->ticker) : NULL;
    srv->metrics = metrics_new();
    srv->workers = workers_new();
    srv->timeline = timeline_new();
    srv->claims = task_claims_new();
    srv->history = history_new();
    srv->shards = shard_view_new();
    if (!srv->waiters || !srv->metrics || !srv->workers || !srv->timeline || !srv->claims || !srv->history ||
        !srv->shards) {
        fprintf(stderr, "psd: out of memory\n");
        return 1;
    }
    store_set_lease_ms(&srv->store, (int64_t)(o->lease_secs * 1000));
    /* RESTPS_TEST_SYNTHETIC_HISTORY (history.h): the run goes on from there */
    store_start_at(&srv->store, history_last_step(srv->history));
    if (o->logdir[0]) {
        char dir[4096];
        ckpt_info ci = {cfg->cluster.task_index, cfg->cluster.jobs[JOB_PS].n};
        snprintf(dir, sizeof(dir), "%s/ps-%d", o->logdir, cfg->cluster.task_index);
        if (!(srv->saver = saver_new(&srv->store, srv->pool, dir, o->save_secs, o->keep_ckpts, &ci))) {
            fprintf(stderr, "psd: out of memory\n");
            return 1;
        }
        if (saver_restore(srv->saver)) {
            int n, has_loss;
            uint64_t bytes;
            int64_t gs;
            double loss;
            store_totals(&srv->store, &n, &bytes, &gs, &has_loss, &loss);
            history_record(srv->history, gs, has_loss, loss);
        }
    } else {
        log_info("psd: --logdir is empty: no checkpoints");
    }
    summaries_start(srv, o->logdir); /* ps 0: TensorBoard event files, from the restored step on */
    changes_follow(srv); /* the store and the history tell the waiters from now on */
    random_instance(srv->instance);
    srv->started = clk_mono_ts();
    return 0;
}

/* The socket, the shards poller, the HTTP server on the endpoint layer, the
 * ticker's sync tick and the saver's thread; says where it listens. The
 * server, or NULL (exit 1) with a message. */
static http_server *serve(server *srv, const psd_flags *o)
{
    server_config *cfg = &srv->cfg;
    const cluster_addr *self = cluster_self(&cfg->cluster);
    char err[512];
    int bound = 0, sndbuf_kib = o->sndbuf_kib;
    if (sndbuf_kib < 0)
        sndbuf_kib = cfg->bind_host[0] && is_loopback(cfg->bind_host) ? 256 : 0;
    int fd = listen_on(cfg->bind_host, cfg->port, sndbuf_kib * 1024, &bound, err, sizeof(err));
    if (fd < 0) {
        fprintf(stderr, "psd: %s\n", err);
        return NULL;
    }
    const char *shown = cfg->bind_host[0] ? cfg->bind_host : self->host;
    char listening[CLUSTER_HOST_MAX + 16];
    snprintf(listening, sizeof(listening), strchr(shown, ':') ? "[%s]:%d" : "%s:%d", shown, bound);
    /* before the server answers anyone: /v1/status reads what this sets */
    if (o->tls_cert)
        shard_view_set_tls(srv->shards, o->tls_ca);
    shard_view_start(srv->shards, &cfg->cluster, cfg->auth_token, listening);

    MHD_set_panic_func(mhd_panic, NULL);
    /* slowloris: a deadline for request heads, beside the idle timeout, and
     * past it a body must average 1 KiB/s */
    http_server_config hc = {
        .name = "psd",
        .listen_fd = fd,
        .threads = o->http_threads,
        .suspend = 1,
        .idle_timeout_secs = (unsigned)o->conn_timeout,
        .header_timeout_secs = (unsigned)o->conn_timeout,
        .body_min_rate = 1024,
        .max_conns = (unsigned)o->max_conns,
        .conn_memory = 128 * 1024,
        .token = cfg->auth_token,
        .tls_cert_pem = srv->tls_cert_pem,
        .tls_key_pem = srv->tls_key_pem,
        .tls_priorities = o->tls_prio,
        .accept = accept_policy,
        .begin = routes_begin,
        .end = routes_end,
        .cls = srv,
    };
    http_module psd_routes;
    routes_module(srv, &psd_routes);
    http_server *hs = http_server_new(&hc, err, sizeof(err));
    if (!hs || http_server_add(hs, &psd_routes, err, sizeof(err)) != 0) {
        fprintf(stderr, "psd: %s\n", err);
        return NULL;
    }
    if (http_server_start(hs, err, sizeof(err)) < 0) {
        fprintf(stderr, "psd: unable to start the HTTP server on port %d: %s\n", bound, err);
        return NULL;
    }
    if (membership_start(srv) != 0) {
        fprintf(stderr, "psd: out of memory\n");
        return NULL;
    }
    if (srv->saver && saver_start(srv->saver) != 0) {
        fprintf(stderr, "psd: cannot start the checkpoint thread\n");
        return NULL;
    }
    printf("psd: listening on %s://%s\n", o->tls_cert ? "https" : "http", listening);
    fflush(stdout);
    log_info("psd: ps task %d of %d, learning_rate %g, epoll thread pool of %d, max body %llu bytes%s",
             cfg->cluster.task_index, cfg->cluster.jobs[JOB_PS].n, (double)o->lr, o->http_threads,
             (unsigned long long)o->max_body, cfg->auth_token ? ", writes need a token" : "");
    return hs;
}

/* No new connections; answer the parked long polls and SSE streams and the
 * checkpoint requests (once the save they wait for is written, however long
 * that takes; new ones are refused), let the requests in flight finish (at
 * most 5 s more). Nothing is suspended when the daemon stops after this:
 * libmicrohttpd aborts the process if something is. */
static void drain(server *srv)
{
    log_info("psd: stopping (%llu requests served)", (unsigned long long)atomic_load(&srv->requests));
    atomic_store(&closing, true);
    shard_view_stop(srv->shards);
    waiters_wake_all(srv->waiters);
    if (srv->saver)
        saver_drain(srv->saver);
    for (int i = 0; i < 500 && atomic_load(&srv->in_flight) > 0; i++) {
        struct timespec t = {0, 10 * 1000000L};
        nanosleep(&t, NULL);
    }
    if (atomic_load(&srv->in_flight) > 0)
        log_info("psd: %d requests still in flight after 5 s: closing them", atomic_load(&srv->in_flight));
}

/* Stop the HTTP server and the threads, write the final checkpoint, free
 * everything: the exit status (1 when the final checkpoint failed). */
static int stop(server *srv, http_server *hs)
{
    http_server_free(hs); /* closes the listening socket, stops the connection tracker */
    ticker_free(srv->ticker); /* the sync tick and the deadlines: nothing is parked any more */
    summaries_stop(srv); /* nothing records any more: write the rest of the events */
    int status = 0;
    if (srv->saver) {
        /* nothing changes any more: the last checkpoint holds everything */
        char path[4096], serr[512];
        int64_t step;
        saver_stop(srv->saver);
        int k = saver_save(srv->saver, 0, path, sizeof(path), &step, serr, sizeof(serr));
        if (k < 0) {
            log_error("psd: the final checkpoint failed: %s", serr);
            status = 1;
        } else if (k == 1 && step >= 0) {
            log_info("psd: nothing changed since %s (global step %lld)", path, (long long)step);
        }
        saver_free(srv->saver);
    }
    waiters_free(srv->waiters);
    history_free(srv->history);
    shard_view_free(srv->shards);
    workers_free(srv->workers);
    timeline_free(srv->timeline);
    task_claims_free(srv->claims);
    metrics_free(srv->metrics);
    store_destroy(&srv->store);
    bufpool_free(srv->pool);
    cluster_spec_free(&srv->cfg.cluster);
    free(srv->cfg.auth_token);
    free(srv->tls_cert_pem);
    free(srv->tls_key_pem);
    free(srv);
    return status;
}

int main(int argc, char **argv)
{
    psd_flags o;
    int st = parse_flags(&o, argc, argv);
    if (st >= 0)
        return st;
    server *srv = calloc(1, sizeof(*srv));
    if (!srv) {
        fprintf(stderr, "psd: out of memory\n");
        return 1;
    }
    if ((st = configure(srv, &o)) != 0)
        return fail(srv, st);
    srv->pool = bufpool_new(srv->cfg.pool_bytes);
    if (!srv->pool || store_init(&srv->store, o.lr, srv->pool) != 0) {
        fprintf(stderr, "psd: out of memory\n");
        return 1;
    }
    sigset_t waitmask;
    handle_signals(&waitmask);
    if (build_parts(srv, &o) != 0)
        return 1;
    http_server *hs = serve(srv, &o);
    if (!hs)
        return 1;
    while (!stop_requested)
        sigsuspend(&waitmask);
    drain(srv);
    return stop(srv, hs);
}
