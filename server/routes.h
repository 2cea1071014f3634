/* routes.h - the route table (method, path as in openapi.yaml, flags, handler)
 * and the libmicrohttpd callbacks that check a request against it before any
 * handler runs: unknown path 404, wrong method 405, bad name 400, missing
 * token 401, body over --max_body_bytes 413 (before it is read). */
#ifndef RESTPS_ROUTES_H
#define RESTPS_ROUTES_H

#include <microhttpd.h>
#include <stdio.h>

#include "http.h"

enum {
    ROUTE_WRITE = 1, /* needs the token when --auth_token_file is set */
    ROUTE_OPEN = 2,  /* never needs a token (health checks) */
    ROUTE_BODY = 4,  /* takes a request body */
};

typedef struct route {
    const char *method; /* GET routes also answer HEAD */
    const char *path;   /* "/v1/vars/{name}" */
    int flags;
    /* Optional: runs when the headers are in, before the body is read; may
     * answer (then the body is never read). Returns MHD_NO to drop. */
    enum MHD_Result (*before_body)(request *r);
    enum MHD_Result (*handle)(request *r);
    const char *summary;
} route;

enum MHD_Result routes_access(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_data_size, void **req_cls);
void routes_completed(void *cls, struct MHD_Connection *conn, void **req_cls,
                      enum MHD_RequestTerminationCode toe);

/* MHD_OPTION_UNESCAPE_CALLBACK: %XX decoding that leaves %00 alone. */
size_t routes_unescape(void *cls, struct MHD_Connection *conn, char *s);

/* Print the table, one "METHOD PATH flags" line each (psd --routes). */
void routes_print(FILE *out);

/* Handlers (vars.c, bulk.c, status.c). */
/* The /v1/status object (status.c); also the payload of /v1/events. */
json_t *status_json(server *srv);

enum MHD_Result h_healthz(request *r);
enum MHD_Result h_status(request *r);
enum MHD_Result h_vars_list(request *r);
enum MHD_Result h_var_get(request *r);
enum MHD_Result h_var_put_check(request *r);
enum MHD_Result h_var_put(request *r);
enum MHD_Result h_var_stats(request *r);
enum MHD_Result h_var_grad_check(request *r);
enum MHD_Result h_var_grad(request *r);
enum MHD_Result h_params_get(request *r);
enum MHD_Result h_grads_post(request *r);
enum MHD_Result h_readyz(request *r);
enum MHD_Result h_web(request *r);      /* web.c */
enum MHD_Result h_metrics(request *r);  /* metrics.c */
enum MHD_Result h_history(request *r);  /* history.c */
enum MHD_Result h_events(request *r);   /* events.c */
enum MHD_Result h_config_get(request *r);
enum MHD_Result h_config_put(request *r);
enum MHD_Result h_eval_post(request *r);
enum MHD_Result h_done_post(request *r);
enum MHD_Result h_shutdown_post(request *r);
enum MHD_Result h_checkpoint_get(request *r);  /* checkpoint_routes.c */
enum MHD_Result h_checkpoint_post(request *r);
enum MHD_Result h_placement_get(request *r);
enum MHD_Result h_placement_put(request *r);
enum MHD_Result h_sync(request *r);       /* membership.c */
enum MHD_Result h_heartbeat(request *r);

#endif
