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
#include "metrics.h"
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
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
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

int main(int argc, char **argv)
{
    const char *job_name = NULL, *ps_hosts = NULL, *worker_hosts = NULL, *chief_hosts = NULL;
    const char *bind_host = NULL, *auth_file = NULL, *logdir = "./logs";
    const char *tls_cert = NULL, *tls_key = NULL, *tls_ca = NULL, *tls_prio = NULL;
    int task_index = -1, port = -1, http_threads = 2, conn_timeout = 60, max_conns = 1024;
    int auth_reads = 0, print_routes = 0, sndbuf_kib = -1, save_secs = 60, keep_ckpts = 5;
    float lease_secs = 10;
    float lr = 0.01f;
    uint64_t max_body = 1ULL << 30, pool_mib = 256;
    flag flags[] = {
        {"job_name", FLAG_STRING, &job_name, "this task's job: ps (default) or another job in the cluster", 0},
        {"task_index", FLAG_INT, &task_index, "this task's index in its job (default 0)", 0},
        {"ps_hosts", FLAG_STRING, &ps_hosts, "comma-separated host:port of the ps tasks (default localhost:2222)", 0},
        {"worker_hosts", FLAG_STRING, &worker_hosts, "comma-separated host:port of the worker tasks", 0},
        {"chief_hosts", FLAG_STRING, &chief_hosts, "host:port of the chief task, if the cluster has one", 0},
        {"port", FLAG_INT, &port, "listen on this port instead of the one in this task's entry; 0 = any free port", 0},
        {"bind", FLAG_STRING, &bind_host, "address to listen on (default: loopback when this task's host is localhost/127.x, else all)", 0},
        {"learning_rate", FLAG_FLOAT, &lr, "learning rate until the chief sends the training configuration (default 0.01, plain SGD, async)", 0},
        {"max_body_bytes", FLAG_U64, &max_body, "largest request body accepted, in bytes (default 1073741824); larger is refused with 413 before it is read", 0},
        {"http_threads", FLAG_INT, &http_threads, "HTTP threads polling with epoll (default 2), 1..256", 0},
        {"connection_timeout", FLAG_INT, &conn_timeout, "close a connection idle for this many seconds, or whose request headers take longer to arrive; past this many seconds a body must average 1 KiB/s or is cut off (default 60; long polls wait on)", 0},
        {"max_connections", FLAG_INT, &max_conns, "most connections served at once; more wait in the listen queue (default 1024)", 0},
        {"auth_token_file", FLAG_STRING, &auth_file, "file holding a bearer token that every PUT/POST must carry (default: none, writes are open)", 0},
        {"auth_reads", FLAG_BOOL, &auth_reads, "require the token for reads too, except /healthz (default false)", 0},
        {"buffer_pool_mib", FLAG_U64, &pool_mib, "MiB of idle buffers kept for reuse (default 256)", 0},
        {"sndbuf_kib", FLAG_INT, &sndbuf_kib, "socket send buffer in KiB; 0 = the kernel's autotuning (default: 256 when bound to loopback, where autotuned buffers slow small answers after large ones, else 0)", 0},
        {"tls_cert", FLAG_STRING, &tls_cert, "serve HTTPS with this PEM certificate (chain); needs --tls_key", 0},
        {"tls_key", FLAG_STRING, &tls_key, "the PEM private key of --tls_cert", 0},
        {"tls_priorities", FLAG_STRING, &tls_prio, "with --tls_cert: the GnuTLS priority string that picks the TLS versions and cipher suites (default " TLS_PRIORITIES_DEFAULT ": TLS 1.3/1.2, AEAD suites with AES-GCM first, ECDHE, the server's order)", 0},
        {"tls_ca", FLAG_STRING, &tls_ca, "with --tls_cert: the CA(s) to trust for the other ps tasks' certificates (ps 0 polls their status; default: the system's)", 0},
        {"logdir", FLAG_STRING, &logdir, "folder for checkpoints and TensorBoard event files, as tf.train.Supervisor's logdir; this task's checkpoints go in <logdir>/ps-<task_index>/ and the newest valid one is restored at start; ps 0 also writes TensorBoard's events.out.tfevents.* files: loss, global_step/sec, examples/sec, learning_rate, staleness in <logdir>/train/, the evaluator's loss and accuracy in <logdir>/eval/ (default ./logs); empty = no checkpoints, no event files", 0},
        {"save_checkpoint_secs", FLAG_INT, &save_secs, "save a checkpoint this often when something changed (default 60); 0 = only on POST /v1/checkpoint and at a clean stop", 0},
        {"keep_checkpoints", FLAG_INT, &keep_ckpts, "keep the newest this many checkpoints (default 5)", 0},
        {"worker_lease_secs", FLAG_FLOAT, &lease_secs, "sync: a worker not heard from for this long no longer holds up a step (it counts again from its next request; default 10)", 0},
        {"routes", FLAG_BOOL, &print_routes, "print the HTTP route table and exit", 0},
    };
    int nflags = (int)(sizeof(flags) / sizeof(flags[0]));
    char err[512];
    int fr = flags_parse(flags, nflags, argc, argv, err, sizeof(err));
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
        fprintf(stderr, "psd: %s (see psd --help)\n", err);
        return 2;
    }
    if (print_routes) {
        routes_print(stdout);
        return 0;
    }

    server *srv = calloc(1, sizeof(*srv));
    if (!srv) {
        fprintf(stderr, "psd: out of memory\n");
        return 1;
    }
    if (flags_get(flags, nflags, "task_index")->given && task_index < 0) {
        fprintf(stderr, "psd: --task_index=%d is negative\n", task_index);
        return fail(srv, 2);
    }
    cluster_input in = {.job_name = job_name,
                        .task_index = task_index,
                        .ps_hosts = ps_hosts,
                        .worker_hosts = worker_hosts,
                        .chief_hosts = chief_hosts,
                        .tf_config = getenv("TF_CONFIG"),
                        .default_job = "ps"};
    if (cluster_spec_build(&in, &srv->cfg.cluster, err, sizeof(err)) != 0) {
        fprintf(stderr, "psd: %s\n", err);
        return fail(srv, 2);
    }
    if (srv->cfg.cluster.job != JOB_PS) {
        fprintf(stderr, "psd: this task is %s %d, but psd serves ps tasks only\n",
                cluster_job_name(srv->cfg.cluster.job), srv->cfg.cluster.task_index);
        return fail(srv, 2);
    }
    const cluster_addr *self = cluster_self(&srv->cfg.cluster);
    if (port < -1 || port > 65535) {
        fprintf(stderr, "psd: --port=%d is out of range 0..65535\n", port);
        return fail(srv, 2);
    }
    if (!(lr > 0)) {
        fprintf(stderr, "psd: --learning_rate must be positive, got %g\n", (double)lr);
        return fail(srv, 2);
    }
    if (http_threads == 0) {
        /* a thread per connection measured no faster than the epoll pool
         * (0.6-1.1x) and needed a second, blocking path for every wait */
        fprintf(stderr, "psd: --http_threads=0 (a thread per connection) is no longer supported: "
                        "it was no faster than the epoll pool; use 1..256\n");
        return fail(srv, 2);
    }
    if (http_threads < 1 || http_threads > 256) {
        fprintf(stderr, "psd: --http_threads must be 1..256, got %d\n", http_threads);
        return fail(srv, 2);
    }
    if (sndbuf_kib < -1 || sndbuf_kib > 1024 * 1024) {
        fprintf(stderr, "psd: --sndbuf_kib must be 0..1048576, got %d\n", sndbuf_kib);
        return fail(srv, 2);
    }
    if (conn_timeout < 1 || max_conns < 1 || max_body < 1) {
        fprintf(stderr, "psd: --connection_timeout, --max_connections and --max_body_bytes must be positive\n");
        return fail(srv, 2);
    }
    if (!(lease_secs >= 0.5 && lease_secs <= 86400)) {
        fprintf(stderr, "psd: --worker_lease_secs must be from 0.5 to 86400, got %g\n", (double)lease_secs);
        return fail(srv, 2);
    }
    if (!tls_cert != !tls_key || ((tls_ca || tls_prio) && !tls_cert)) {
        fprintf(stderr, "psd: --tls_cert and --tls_key go together (and --tls_ca and --tls_priorities need them)\n");
        return fail(srv, 2);
    }
    if (tls_prio && tls_priorities_check(tls_prio, err, sizeof(err)) != 0) {
        fprintf(stderr, "psd: --tls_priorities=%s: %s\n", tls_prio, err);
        return fail(srv, 2);
    }
    if (tls_cert && (!(srv->tls_cert_pem = pem_read(tls_cert, err, sizeof(err))) ||
                     !(srv->tls_key_pem = pem_read(tls_key, err, sizeof(err))))) {
        fprintf(stderr, "psd: %s\n", err);
        return fail(srv, 2);
    }
    if (save_secs < 0 || keep_ckpts < 1) {
        fprintf(stderr, "psd: --save_checkpoint_secs must be >= 0 and --keep_checkpoints >= 1\n");
        return fail(srv, 2);
    }
    if (auth_reads && !auth_file) {
        fprintf(stderr, "psd: --auth_reads needs --auth_token_file\n");
        return fail(srv, 2);
    }
    server_config *cfg = &srv->cfg;
    if (auth_file && !(cfg->auth_token = token_load(auth_file, err, sizeof(err)))) {
        fprintf(stderr, "psd: %s\n", err);
        return fail(srv, 2);
    }
    cfg->auth_reads = auth_reads;
    cfg->port = port >= 0 ? port : self->port;
    if (bind_host)
        snprintf(cfg->bind_host, sizeof(cfg->bind_host), "%s", bind_host);
    else if (is_loopback(self->host))
        /* the task's own loopback address: 127.0.0.1 does not answer for 127.0.0.2 */
        snprintf(cfg->bind_host, sizeof(cfg->bind_host), "%s",
                 !strcmp(self->host, "localhost") ? "127.0.0.1" : self->host);
    else
        cfg->bind_host[0] = '\0'; /* every address */
    cfg->learning_rate = lr;
    cfg->max_body_bytes = max_body;
    cfg->http_threads = http_threads;
    cfg->conn_timeout_secs = conn_timeout;
    cfg->max_connections = max_conns;
    cfg->pool_bytes = (size_t)pool_mib << 20;

    srv->pool = bufpool_new(cfg->pool_bytes);
    if (!srv->pool || store_init(&srv->store, lr, srv->pool) != 0) {
        fprintf(stderr, "psd: out of memory\n");
        return 1;
    }
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* Block the stop signals in every thread (before any is created); main waits for them in sigsuspend. */
    sigset_t stopset, waitmask;
    sigemptyset(&stopset);
    sigaddset(&stopset, SIGTERM);
    sigaddset(&stopset, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stopset, &waitmask);
    sigdelset(&waitmask, SIGTERM);
    sigdelset(&waitmask, SIGINT);

    pthread_mutex_init(&srv->info_mu, NULL);
    srv->ticker = ticker_new();
    srv->waiters = srv->ticker ? waiters_new(srv->ticker) : NULL;
    srv->metrics = metrics_new();
    srv->workers = workers_new();
    srv->history = history_new();
    if (!srv->waiters || !srv->metrics || !srv->workers || !srv->history) {
        fprintf(stderr, "psd: out of memory\n");
        return 1;
    }
    store_set_lease_ms(&srv->store, (int64_t)(lease_secs * 1000));
    /* RESTPS_TEST_SYNTHETIC_HISTORY (history.h): the run goes on from there */
    store_start_at(&srv->store, history_last_step(srv->history));
    if (logdir[0]) {
        char dir[4096];
        ckpt_info ci = {cfg->cluster.task_index, cfg->cluster.jobs[JOB_PS].n};
        snprintf(dir, sizeof(dir), "%s/ps-%d", logdir, cfg->cluster.task_index);
        if (!(srv->saver = saver_new(&srv->store, srv->pool, dir, save_secs, keep_ckpts, &ci))) {
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
    summaries_start(srv, logdir); /* ps 0: TensorBoard event files, from the restored step on */
    changes_follow(srv); /* the store and the history tell the waiters from now on */
    random_instance(srv->instance);
    srv->started = clk_mono_ts();

    int bound = 0;
    if (sndbuf_kib < 0)
        sndbuf_kib = cfg->bind_host[0] && is_loopback(cfg->bind_host) ? 256 : 0;
    int fd = listen_on(cfg->bind_host, cfg->port, sndbuf_kib * 1024, &bound, err, sizeof(err));
    if (fd < 0) {
        fprintf(stderr, "psd: %s\n", err);
        return 1;
    }


    const char *shown = cfg->bind_host[0] ? cfg->bind_host : self->host;
    char listening[CLUSTER_HOST_MAX + 16];
    snprintf(listening, sizeof(listening), strchr(shown, ':') ? "[%s]:%d" : "%s:%d", shown, bound);
    /* before the server answers anyone: /v1/status reads what this sets */
    if (tls_cert)
        history_set_tls(srv->history, tls_ca);
    history_start_shards(srv->history, &cfg->cluster, cfg->auth_token, listening);

    MHD_set_panic_func(mhd_panic, NULL);
    /* slowloris: a deadline for request heads, beside the idle timeout, and
     * past it a body must average 1 KiB/s */
    http_server_config hc = {
        .name = "psd",
        .listen_fd = fd,
        .threads = http_threads,
        .suspend = 1,
        .idle_timeout_secs = (unsigned)conn_timeout,
        .header_timeout_secs = (unsigned)conn_timeout,
        .body_min_rate = 1024,
        .max_conns = (unsigned)max_conns,
        .conn_memory = 128 * 1024,
        .token = cfg->auth_token,
        .tls_cert_pem = srv->tls_cert_pem,
        .tls_key_pem = srv->tls_key_pem,
        .tls_priorities = tls_prio,
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
        return 1;
    }
    if (http_server_start(hs, err, sizeof(err)) < 0) {
        fprintf(stderr, "psd: unable to start the HTTP server on port %d: %s\n", bound, err);
        return 1;
    }
    if (membership_start(srv) != 0) {
        fprintf(stderr, "psd: out of memory\n");
        return 1;
    }
    if (srv->saver && saver_start(srv->saver) != 0) {
        fprintf(stderr, "psd: cannot start the checkpoint thread\n");
        return 1;
    }
    printf("psd: listening on %s://%s\n", tls_cert ? "https" : "http", listening);
    fflush(stdout);
    log_info("psd: ps task %d of %d, learning_rate %g, epoll thread pool of %d, max body %llu bytes%s",
             cfg->cluster.task_index, cfg->cluster.jobs[JOB_PS].n, (double)lr, http_threads,
             (unsigned long long)max_body, cfg->auth_token ? ", writes need a token" : "");


    while (!stop_requested)
        sigsuspend(&waitmask);

    log_info("psd: stopping (%llu requests served)",
             (unsigned long long)atomic_load(&srv->requests));
    /* no new connections; answer the parked long polls and SSE streams and
     * the checkpoint requests (once the save they wait for is written,
     * however long that takes; new ones are refused), let the requests in
     * flight finish (at most 5 s more), then stop. Nothing is suspended when
     * MHD_stop_daemon runs: libmicrohttpd aborts the process if something is. */
    atomic_store(&closing, true);
    history_stop(srv->history);
    waiters_wake_all(srv->waiters);
    if (srv->saver)
        saver_drain(srv->saver);
    for (int i = 0; i < 500 && atomic_load(&srv->in_flight) > 0; i++) {
        struct timespec t = {0, 10 * 1000000L};
        nanosleep(&t, NULL);
    }
    if (atomic_load(&srv->in_flight) > 0)
        log_info("psd: %d requests still in flight after 5 s: closing them",
                 atomic_load(&srv->in_flight));
    http_server_free(hs); /* closes the listening socket, stops the connection tracker */
    fd = -1;
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
    workers_free(srv->workers);
    metrics_free(srv->metrics);
    if (fd >= 0)
        close(fd);
    store_destroy(&srv->store);
    bufpool_free(srv->pool);
    cluster_spec_free(&cfg->cluster);
    free(cfg->auth_token);
    free(srv->tls_cert_pem);
    free(srv->tls_key_pem);
    free(srv);
    return status;
}
