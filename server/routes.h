/* routes.h - psd's route table (method, path as in openapi.yaml, flags,
 * handler) and what psd asks of the endpoint layer (common/http_server.h)
 * for it: the token on writes (and reads with --auth_reads), a {name} that
 * is a variable name, bodies in blobs of the server's pool up to
 * --max_body_bytes, and per request the parked state, the metrics and the
 * requests in flight. */
#ifndef RESTPS_ROUTES_H
#define RESTPS_ROUTES_H

#include <microhttpd.h>
#include <stdio.h>

#include "request.h"
#include "wire_dtype.h"

/* psd's module: the table, srv as every handler's context. The body ops
 * live in srv (its pool); the module points at them. */
void routes_module(server *srv, http_module *out);
/* The server-wide hooks (http_server_config begin/end, cls srv): the
 * requests in flight, the metrics. */
void routes_begin(void *srv, http_req *r);
void routes_end(void *srv, http_req *r, int completed_ok);

/* Print the table, one "METHOD PATH flags" line each (psd --routes). */
void routes_print(FILE *out);

/* The handlers, by route file (each named for its paths). */
/* route_status.c; status_json is also the payload of /v1/events */
json_t *status_json(server *srv);
enum MHD_Result h_healthz(request *r);
enum MHD_Result h_status(request *r);
/* route_vars.c */
enum MHD_Result h_vars_list(request *r);
enum MHD_Result h_var_get(request *r);
enum MHD_Result h_var_put_check(request *r);
enum MHD_Result h_var_put(request *r);
enum MHD_Result h_var_stats(request *r);
enum MHD_Result h_sparse_put(request *r);
enum MHD_Result h_rows_get(request *r);
enum MHD_Result h_rows_post(request *r);
enum MHD_Result h_rows_grad(request *r);
enum MHD_Result h_var_grad_check(request *r);
enum MHD_Result h_var_grad(request *r);
/* route_params.c, route_grads.c */
enum MHD_Result h_params_get(request *r);
enum MHD_Result h_grads_post(request *r);
/* route_grads.c: POST /v1/grads's before_body (push_stream.h) */
enum MHD_Result h_grads_before(request *r);
/* route_params.c, for route_grads.c's ?return=params: suspend the request
 * until channel ch of the waiters reaches min (or timeout_ms passes; the
 * handler runs again once resumed); the shard's variables v[0..n) at step as
 * one safetensors body in dtype dt (a cast of the float32 values; float16
 * that cannot hold one: 409), outcome (may be NULL) in its metadata and in
 * X-Push-Outcome (and "waited" when the request was parked); the dtype=
 * query (absent: fp32), -1 when it is bad. */
enum MHD_Result params_park(request *r, int ch, int64_t min, long long timeout_ms);
enum MHD_Result params_reply(request *r, const store_snap *v, int n, int64_t step, int avg, wire_dtype dt,
                             const char *outcome);
int params_query_dtype(request *r, wire_dtype *dt);
/* route_config.c */
enum MHD_Result h_config_get(request *r);
enum MHD_Result h_config_put(request *r);
enum MHD_Result h_readyz(request *r);
/* route_run.c */
enum MHD_Result h_eval_post(request *r);
enum MHD_Result h_done_post(request *r);
enum MHD_Result h_shutdown_post(request *r);
/* route_placement.c */
enum MHD_Result h_placement_get(request *r);
enum MHD_Result h_placement_put(request *r);
/* route_sync.c */
enum MHD_Result h_sync(request *r);
enum MHD_Result h_heartbeat(request *r);
enum MHD_Result h_timeline(request *r);
/* route_checkpoint.c */
enum MHD_Result h_checkpoint_get(request *r);
enum MHD_Result h_checkpoint_post(request *r);
/* route_web.c, route_metrics.c, route_history.c, route_events.c */
enum MHD_Result h_web(request *r);
enum MHD_Result h_metrics(request *r);
enum MHD_Result h_history(request *r);
enum MHD_Result h_events(request *r);

#endif
