/* route_status.c - GET /healthz and GET /v1/status. */
#include <stdlib.h>
#include <time.h>

#include "clock.h"
#include "history.h"
#include "membership.h"
#include "saver.h"
#include "routes.h"
#include "shard_view.h"
#include "workers.h"

enum MHD_Result h_healthz(request *r)
{
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:s}", "status", "ok"));
}

/* {name: {rows, dim, max_rows, held_rows, bytes, evicted_rows, updates}} of the sparse variables. */
static json_t *sparse_status(server *srv)
{
    store_sparse_stat *st;
    int n;
    if (store_sparse_stats(&srv->store, &st, &n) != STORE_OK)
        return NULL;
    json_t *o = json_object();
    for (int i = 0; i < n; i++)
        json_object_set_new(o, st[i].name,
                            json_pack("{s:I,s:i,s:I,s:I,s:I,s:I,s:I,s:i,s:i}", "rows", (json_int_t)st[i].decl.rows,
                                      "dim", st[i].decl.dim, "max_rows", (json_int_t)st[i].decl.max_rows, "held_rows",
                                      (json_int_t)st[i].held, "bytes", (json_int_t)st[i].bytes, "evicted_rows",
                                      (json_int_t)st[i].evicted, "updates", (json_int_t)st[i].updates, "shard",
                                      st[i].decl.shard, "shards", st[i].decl.shards));
    free(st);
    return o;
}

json_t *status_json(server *srv)
{
    int n;
    uint64_t bytes;
    int64_t step;
    int has_loss;
    double loss;
    store_totals(&srv->store, &n, &bytes, &step, &has_loss, &loss);
    double up = clk_mono_since(&srv->started);
    json_t *o = json_pack("{s:{s:s,s:i},s:I,s:o,s:i,s:I,s:f,s:I,s:f}", "task", "type",
                          cluster_job_name(srv->cfg.cluster.job), "index",
                          srv->cfg.cluster.task_index, "global_step", (json_int_t)step,
                          "last_loss", has_loss ? json_real(loss) : json_null(), "variables", n,
                          "bytes", (json_int_t)bytes, "uptime_secs", up, "requests_served",
                          (json_int_t)atomic_load(&srv->requests), "learning_rate", 0.0);
    store_config c;
    int ready = store_get_config(&srv->store, &c) == STORE_OK;
    json_object_set_new(o, "learning_rate", json_real(c.optim.learning_rate));
    json_object_set_new(o, "ready", json_boolean(ready));
    json_object_set_new(o, "mode", json_string(c.sync ? "sync" : "async"));
    json_object_set_new(o, "optimizer", json_string(optim_name(c.optim.kind)));
    json_object_set_new(o, "replicas_to_aggregate", json_integer(c.replicas_to_aggregate));
    json_object_set_new(o, "workers", json_integer(c.workers));
    store_counts sc;
    store_get_counts(&srv->store, &sc);
    json_object_set_new(o, "stale_dropped", json_integer(sc.stale_dropped));
    json_object_set_new(o, "pending_gradients", json_integer(sc.pending));
    json_object_set_new(o, "waiting_pulls", json_integer(waiters_count(srv->waiters, WAIT_STEP) + waiters_count(srv->waiters, WAIT_CLOCK)));
    pthread_mutex_lock(&srv->info_mu);
    json_object_set_new(o, "workers_done", json_integer(srv->n_done));
    json_t *fin = json_array(); /* which: the chief's wait at the end names the others */
    for (int i = 0; fin && i < STORE_MAX_WORKERS && (int)json_array_size(fin) < srv->n_done; i++)
        if (srv->done[i])
            json_array_append_new(fin, json_integer(i));
    if (fin)
        json_object_set_new(o, "workers_finished", fin);
    if (srv->eval.has)
        json_object_set_new(o, "eval",
                            json_pack("{s:I,s:f,s:f,s:I}", "global_step",
                                      (json_int_t)srv->eval.global_step, "loss", srv->eval.loss,
                                      "accuracy", srv->eval.accuracy, "examples",
                                      (json_int_t)srv->eval.examples));
    else
        json_object_set_new(o, "eval", json_null());
    json_object_set_new(o, "evaluator_seen", json_boolean(srv->eval.has || srv->evaluator_asked));
    pthread_mutex_unlock(&srv->info_mu);
    json_t *sync = membership_json(srv);
    if (!sync) { /* out of memory (its member list): no status without it */
        json_decref(o);
        return NULL;
    }
    /* the workers a sync step waits for: live, not yet in (as /v1/sync) */
    json_object_set_new(o, "waiting_for", json_deep_copy(json_object_get(sync, "waiting_for")));
    json_object_set_new(o, "sync", sync);
    json_object_set_new(o, "staleness", store_staleness_json(&srv->store));
    json_object_set_new(o, "checkpoint", srv->saver ? saver_status_json(srv->saver) : json_null());
    json_t *sp = sparse_status(srv);
    if (!sp) {
        json_decref(o);
        return NULL;
    }
    json_object_set_new(o, "sparse", sp);
    workers_status(srv->workers, &srv->store, o);
    history_status(srv->history, o);
    shard_view_status(srv->shards, o);
    return o;
}

enum MHD_Result h_status(request *r)
{
    json_t *st = status_json(req_srv(r));
    if (!st)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory building the status");
    return http_reply_json(r, MHD_HTTP_OK, st);
}
