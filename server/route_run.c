/* route_run.c - how a run goes on a ps task: POST /v1/eval (the evaluator's
 * report), POST /v1/done (a worker finished: a sync step no longer waits for
 * it) and POST /v1/shutdown (stop this task once the answer is out). */
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>

#include "clock.h"
#include "history.h"
#include "log.h"
#include "routes.h"

enum MHD_Result h_eval_post(request *r)
{
    char err[256];
    json_t *j = req_body_json(r, err, sizeof(err));
    if (!j)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    double loss = 0, acc = 0;
    json_t *js = json_object_get(j, "global_step"), *je = json_object_get(j, "examples");
    int ok = body_number(j, "loss", &loss) == 1 && body_number(j, "accuracy", &acc) == 1 &&
             (!js || (json_is_integer(js) && json_integer_value(js) >= 0)) &&
             (!je || (json_is_integer(je) && json_integer_value(je) >= 0)) &&
             isfinite(loss) && loss >= 0 && acc >= 0 && acc <= 1;
    int64_t step = ok && js ? json_integer_value(js) : 0;
    int64_t ex = ok && je ? json_integer_value(je) : 0;
    json_decref(j);
    if (!ok)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "eval report needs loss >= 0 and accuracy in [0, 1]; global_step and "
                                "examples are optional non-negative integers");
    server *srv = req_srv(r);
    pthread_mutex_lock(&srv->info_mu);
    srv->eval.has = 1;
    srv->eval.loss = loss;
    srv->eval.accuracy = acc;
    srv->eval.global_step = step;
    srv->eval.examples = ex;
    srv->eval.at = clk_mono_ts();
    pthread_mutex_unlock(&srv->info_mu);
    history_record_eval(srv->history, step, loss, acc);
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:s}", "status", "recorded"));
}

enum MHD_Result h_done_post(request *r)
{
    char err[256];
    json_t *j = req_body_json(r, err, sizeof(err));
    if (!j)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    int idx = body_worker(j);
    json_decref(j);
    if (idx < 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "body must be {\"worker\": index}");
    server *srv = req_srv(r);
    store_leave(&srv->store, idx); /* a step no longer waits for it */
    store_sync_tick(&srv->store);
    pthread_mutex_lock(&srv->info_mu);
    if (!srv->done[idx]) {
        srv->done[idx] = 1;
        srv->n_done++;
    }
    int n = srv->n_done;
    pthread_mutex_unlock(&srv->info_mu);
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:i}", "workers_done", n));
}

enum MHD_Result h_shutdown_post(request *r)
{
    server *srv = req_srv(r);
    atomic_store(&srv->stopping, 1);
    log_info("psd: shutdown requested over HTTP");
    enum MHD_Result rc = http_reply_json(r, MHD_HTTP_ACCEPTED, json_pack("{s:s}", "status", "stopping"));
    kill(getpid(), SIGTERM); /* main stops the server cleanly after this answer goes out */
    return rc;
}
