/* status.c - /healthz and /v1/status. */
#include <time.h>

#include "routes.h"

enum MHD_Result h_healthz(request *r)
{
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:s}", "status", "ok"));
}

enum MHD_Result h_status(request *r)
{
    server *srv = r->srv;
    int n;
    uint64_t bytes;
    int64_t step;
    int has_loss;
    double loss;
    store_totals(&srv->store, &n, &bytes, &step, &has_loss, &loss);
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double up = (double)(now.tv_sec - srv->started.tv_sec) +
                (double)(now.tv_nsec - srv->started.tv_nsec) / 1e9;
    json_t *o = json_pack("{s:{s:s,s:i},s:I,s:o,s:i,s:I,s:f,s:I,s:f}", "task", "type",
                          cluster_job_name(srv->cfg.cluster.job), "index",
                          srv->cfg.cluster.task_index, "global_step", (json_int_t)step,
                          "last_loss", has_loss ? json_real(loss) : json_null(), "variables", n,
                          "bytes", (json_int_t)bytes, "uptime_secs", up, "requests_served",
                          (json_int_t)atomic_load(&srv->requests), "learning_rate",
                          (double)srv->store.learning_rate);
    return http_reply_json(r, MHD_HTTP_OK, o);
}
