/* routes.c - psd's route table and what psd asks of the endpoint layer for
 * it (routes.h); the checks every request passes first are the layer's
 * (common/http_server.c). */
#include "routes.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "push_stream.h"
#include "saver.h"
#include "tensor.h"

enum {
    WRITE = HTTP_ROUTE_AUTH, /* needs the token when --auth_token_file is set */
    OPEN = HTTP_ROUTE_OPEN,  /* never needs a token (health checks) */
    BODY = HTTP_ROUTE_BODY,  /* takes a request body (up to --max_body_bytes) */
};

static const http_route routes[] = {
    {"GET", "/", 0, 0, NULL, h_web, "the monitoring page"},
    {"GET", "/app.js", 0, 0, NULL, h_web, "the monitoring page's script"},
    {"GET", "/style.css", 0, 0, NULL, h_web, "the monitoring page's style sheet"},
    {"GET", "/healthz", OPEN, 0, NULL, h_healthz, "liveness"},
    {"GET", "/metrics", 0, 0, NULL, h_metrics, "Prometheus text exposition"},
    {"GET", "/v1/history", 0, 0, NULL, h_history, "global_step and loss over time"},
    {"GET", "/v1/events", 0, 0, NULL, h_events, "live status as Server-Sent Events"},
    {"GET", "/readyz", OPEN, 0, NULL, h_readyz, "200 once the chief initialized the variables"},
    {"GET", "/v1/status", 0, 0, NULL, h_status, "task status"},
    {"GET", "/v1/vars", 0, 0, NULL, h_vars_list, "list variables"},
    {"GET", "/v1/vars/{name}", 0, 0, NULL, h_var_get, "read a variable"},
    {"PUT", "/v1/vars/{name}", WRITE | BODY, 0, h_var_put_check, h_var_put, "create or replace a variable"},
    {"GET", "/v1/vars/{name}/stats", 0, 0, NULL, h_var_stats, "summary statistics"},
    {"PUT", "/v1/vars/{name}/sparse", WRITE | BODY, 0, NULL, h_sparse_put, "declare a row-sparse variable"},
    {"GET", "/v1/vars/{name}/rows", 0, 0, NULL, h_rows_get, "rows of a sparse variable by ids"},
    {"POST", "/v1/vars/{name}/rows", BODY, 0, NULL, h_rows_post, "rows of a sparse variable by ids (safetensors)"},
    {"POST", "/v1/vars/{name}/rows/grad", WRITE | BODY, 0, NULL, h_rows_grad,
     "apply a gradient by ids to one sparse variable"},
    {"POST", "/v1/vars/{name}/grad", WRITE | BODY, 0, h_var_grad_check, h_var_grad,
     "apply a gradient to one variable"},
    {"GET", "/v1/params", 0, 0, NULL, h_params_get, "every variable, one safetensors body"},
    {"POST", "/v1/grads", WRITE | BODY, 0, h_grads_before, h_grads_post, "apply gradients from one safetensors body"},
    {"GET", "/v1/config", 0, 0, NULL, h_config_get, "the training configuration"},
    {"PUT", "/v1/config", WRITE | BODY, 0, NULL, h_config_put, "set the training configuration (the chief)"},
    {"POST", "/v1/eval", WRITE | BODY, 0, NULL, h_eval_post, "the evaluator's report"},
    {"POST", "/v1/done", WRITE | BODY, 0, NULL, h_done_post, "a worker finished"},
    {"GET", "/v1/checkpoint", 0, 0, NULL, h_checkpoint_get, "the newest checkpoint file"},
    {"POST", "/v1/checkpoint", WRITE, 0, NULL, h_checkpoint_post, "save a checkpoint now"},
    {"GET", "/v1/placement", 0, 0, NULL, h_placement_get, "where every variable lives"},
    {"PUT", "/v1/placement", WRITE | BODY, 0, NULL, h_placement_put, "the chief's placement map"},
    {"GET", "/v1/sync", 0, 0, NULL, h_sync, "the sync step in progress: gradients in, workers waited for"},
    {"POST", "/v1/heartbeat", WRITE | BODY, 0, NULL, h_heartbeat, "a worker renews its lease"},
    {"GET", "/v1/timeline", 0, 0, NULL, h_timeline, "the workers' last steps: pull, wait, compute, push"},
    {"POST", "/v1/shutdown", WRITE, 0, NULL, h_shutdown_post, "stop this ps task"},
};
#define N_ROUTES (sizeof(routes) / sizeof(routes[0]))

void routes_print(FILE *out)
{
    for (size_t i = 0; i < N_ROUTES; i++)
        fprintf(out, "%s %s%s%s\n", routes[i].method, routes[i].path, routes[i].flags & WRITE ? " write" : "",
                routes[i].flags & OPEN ? " open" : "");
}

/* {name} is a variable name (common/tensor.h). */
static enum MHD_Result check_name(request *r)
{
    char err[256];
    if (!r->name_ok || strlen(r->name) > TENSOR_NAME_MAX)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "variable name must be 1 to %d characters",
                                TENSOR_NAME_MAX);
    if (tensor_name_check(r->name, err, sizeof(err)) != 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    return MHD_YES;
}

/* Bodies are blobs of the server's pool: a push's body is kept by the sync
 * aggregation as it came (no copy). */
static void *body_alloc(void *pool, size_t cap, unsigned char **data, size_t *got)
{
    blob *b = blob_new(pool, cap);
    if (b) {
        *data = b->data;
        *got = b->cap;
        b->len = 0;
    }
    return b;
}

static void *body_grow(void *pool, void *h, size_t used, size_t cap, unsigned char **data, size_t *got)
{
    (void)pool;
    ((blob *)h)->len = used; /* what blob_grow keeps */
    blob *g = blob_grow(h, cap);
    if (g) {
        g->len = used; /* blob_grow set it to cap */
        *data = g->data;
        *got = g->cap;
    }
    return g;
}

static void body_done(void *pool, void *h, size_t len)
{
    (void)pool;
    ((blob *)h)->len = len;
}

static void body_release(void *pool, void *h)
{
    (void)pool;
    blob_unref(h);
}

/* One psd per process: its pool is the body ops' cls. */
static http_body_ops body_ops = {body_alloc, body_grow, body_done, body_release, NULL};

/* A parked request whose connection ended, a save whose client left. */
static void request_done(request *r, int completed_ok)
{
    (void)completed_ok;
    server *srv = req_srv(r);
    psd_req *p = req_psd(r);
    if (p->parked && !p->resumed && p->parked_on)
        waiters_remove(p->parked_on, r->conn);
    if (p->saver_job && srv->saver) /* POST /v1/checkpoint whose client left */
        saver_forget(srv->saver, r->conn);
    push_stream_free(p->stream); /* a streamed push, committed or cut short */
    p->stream = NULL;
    if (p->arriving) /* POST /v1/grads whose body never came whole */
        store_push_arriving(&srv->store, -1);
    p->arriving = 0;
}

void routes_module(server *srv, http_module *out)
{
    body_ops.cls = srv->pool;
    *out = (http_module){
        .name = "psd",
        .routes = routes,
        .n_routes = N_ROUTES,
        .ctx = srv,
        .token_reads = srv->cfg.auth_reads,
        .max_body = srv->cfg.max_body_bytes,
        .max_body_flag = "--max_body_bytes",
        .length_header = "X-Shape",
        .ext_size = sizeof(psd_req),
        .body = &body_ops,
        .check_name = check_name,
        .done = request_done,
    };
}

void routes_begin(void *cls, http_req *r)
{
    (void)r;
    server *srv = cls;
    atomic_fetch_add(&srv->in_flight, 1);
}

void routes_end(void *cls, http_req *r, int completed_ok)
{
    server *srv = cls;
    metrics_observe(srv->metrics, r, completed_ok);
    atomic_fetch_add(&srv->requests, 1);
    atomic_fetch_sub(&srv->in_flight, 1);
}
