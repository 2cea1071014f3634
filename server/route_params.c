/* route_params.c - GET /v1/params: every variable of the shard in one
 * safetensors body, the worker's pull, as a long poll on the step
 * (?min_step=) or the slowest clock (?min_clock=, stale-synchronous). */
#include <errno.h>
#include <math.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "etag.h"
#include "wire_dtype.h"
#include "token.h"
#include "routes.h"
#include "workers.h"

#define LONG_POLL_DEFAULT_MS 30000
#define LONG_POLL_MAX_MS 300000

enum MHD_Result params_park(request *r, int ch, int64_t min, long long timeout_ms)
{
    req_psd(r)->parked = 1;
    req_psd(r)->parked_on = req_srv(r)->waiters;
    MHD_suspend_connection(r->conn);
    waiters_add(req_srv(r)->waiters, ch, r->conn, min, clk_mono_ms() + timeout_ms, &req_psd(r)->resumed);
    return MHD_YES;
}

enum MHD_Result h_params_get(request *r)
{
    server *srv = req_srv(r);
    long long min_step = -1, timeout_ms = LONG_POLL_DEFAULT_MS, worker = -1;
    if (http_query_int(r, "min_step", LLONG_MAX, &min_step) < 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "min_step must be a non-negative integer");
    if (http_query_int(r, "worker", LLONG_MAX, &worker) < 0 || worker >= STORE_MAX_WORKERS)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "worker must be an integer from 0 to %d",
                                STORE_MAX_WORKERS - 1);
    if (http_query_int(r, "timeout_ms", LLONG_MAX, &timeout_ms) < 0 || timeout_ms > LONG_POLL_MAX_MS)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "timeout_ms must be an integer from 0 to %d",
                                LONG_POLL_MAX_MS);
    long long min_clock = -1, clock = -1, avg = 0;
    wire_dtype dt;
    if (params_query_dtype(r, &dt) != 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "dtype must be fp32, bf16 or fp16");
    if (http_query_int(r, "moving_average", LLONG_MAX, &avg) < 0 || avg > 1)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "moving_average must be 0 or 1");
    if (avg) {
        store_config mc;
        if (store_get_config(&srv->store, &mc) != STORE_OK || !(mc.moving_average_decay > 0))
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                    "moving_average=1: the training configuration has no moving_average_decay");
    }
    if (http_query_int(r, "min_clock", LLONG_MAX, &min_clock) < 0 || http_query_int(r, "clock", LLONG_MAX, &clock) < 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "min_clock and clock must be non-negative integers");
    if (min_step > META_INT_MAX || min_clock > META_INT_MAX || clock > META_INT_MAX)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s must be an integer from 0 to %lld",
                                min_step > META_INT_MAX ? "min_step" : min_clock > META_INT_MAX ? "min_clock" : "clock",
                                META_INT_MAX);
    /* With --auth_token_file, only a request that carries the token may act
     * for a worker (renew its lease, move its clocks): an anonymous read is
     * a read (a reader polling as worker 1 kept a dead worker 1 alive and
     * held the sync step). */
    int may_write = !srv->cfg.auth_token || token_header_ok(srv->cfg.auth_token, http_header(r, "Authorization"));
    if (worker >= 0 && may_write)
        store_touch(&srv->store, (int)worker); /* a long poll renews the lease */
    /* stale-synchronous: a worker starts iteration `clock` only after its push
     * of iteration clock - 1 is answered, so the pull proves `clock` completed
     * iterations. After a restart from a checkpoint the clocks start at 0:
     * without this, workers whose pulls came before their next push would
     * wait for each other until the long poll's deadline. Taken once (not
     * again when a parked request resumes), and only from a caller that may
     * push (with --auth_token_file: the token), so a mere reader cannot lift
     * the bound. (Its push raised the count already, but for after a
     * restart: only a raise re-levels the waiters.) */
    if (worker >= 0 && clock >= 0 && !req_psd(r)->parked && may_write)
        store_clock_done(&srv->store, (int)worker, clock); /* a raise: the store tells the waiters */
    /* stale-synchronous: wait until the slowest live worker completed min_clock iterations */
    if (min_clock >= 0 && !req_psd(r)->parked && timeout_ms > 0 && !atomic_load(&srv->stopping) &&
        store_min_clock(&srv->store) < min_clock)
        return params_park(r, WAIT_CLOCK, min_clock, timeout_ms);
    /* the worker starts iteration `clock` now (after any wait for the bound) */
    if (worker >= 0 && clock >= 0 && may_write)
        store_clock_start(&srv->store, (int)worker, clock);
    store_snap *v;
    int n, pending = 0;
    int64_t step;
    if (store_get_all_pending(&srv->store, &v, &n, &step, (int)worker, &pending) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    /* sync: a worker waiting for the step after the one its gradient is for,
     * when this shard does not hold that gradient (it restarted from a
     * checkpoint, say), would wait for nothing: answer now with the current
     * step, so the worker computes its gradient for it again. (The step and
     * the pending gradients are read in one instant: a step that completes in
     * between would otherwise look like a lost gradient.) */
    int lost = 0;
    store_config cfg;
    if (worker >= 0 && step < min_step && !req_psd(r)->parked && store_get_config(&srv->store, &cfg) == STORE_OK &&
        cfg.sync)
        lost = !pending;
    if (step < min_step && !lost && !req_psd(r)->parked && timeout_ms > 0 && !atomic_load(&srv->stopping)) {
        /* long poll: park until the step exists (or the deadline); answered
         * when resumed, with whatever step the shard is at then */
        store_snaps_release(v, n);
        return params_park(r, WAIT_STEP, min_step, timeout_ms);
    }
    if (avg) { /* the shadow copies, in the same format */
        store_snaps_release(v, n);
        int ar = store_get_all_average(&srv->store, &v, &n, &step);
        if (ar == STORE_EMODE)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                    "moving_average=1: the training configuration has no moving_average_decay");
        if (ar != STORE_OK)
            return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    }
    enum MHD_Result rc = params_reply(r, v, n, step, (int)avg, dt, NULL);
    store_snaps_release(v, n);
    return rc;
}

int params_query_dtype(request *r, wire_dtype *dt)
{
    const char *q = http_query(r, "dtype");
    *dt = WIRE_F32;
    return q && wire_dtype_parse(q, dt) != 0 ? -1 : 0;
}

/* The 16-bit copies of v[0..n) in one fresh blob (*out), part i of parts at
 * its place; 0, or -1 after answering (out of memory; a float16 overflow). */
static int cast_all(request *r, const store_snap *v, int n, wire_dtype dt, struct http_part *parts, blob **out,
                    enum MHD_Result *rc)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += (size_t)v[i].numel * 2;
    blob *b = blob_new(req_srv(r)->pool, total ? total : 1);
    if (!b) {
        *rc = http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
        return -1;
    }
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        int64_t bad = wire_encode(dt, (const float *)v[i].data->data, (size_t)v[i].numel, 1.0f, b->data + at);
        if (bad >= 0) {
            float x = ((const float *)v[i].data->data)[bad];
            blob_unref(b);
            *rc = http_reply_error(r, MHD_HTTP_CONFLICT,
                                   "variable '%s' holds %g at element %lld, which %s cannot hold: ask for dtype bf16 or fp32",
                                   v[i].name, (double)x, (long long)bad, wire_dtype_name(dt));
            return -1;
        }
        parts[i] = (struct http_part){b->data + at, (size_t)v[i].numel * 2};
        at += (size_t)v[i].numel * 2;
    }
    *out = b;
    return 0;
}

enum MHD_Result params_reply(request *r, const store_snap *v, int n, int64_t step, int avg, wire_dtype dt,
                             const char *outcome)
{
    server *srv = req_srv(r);
    char etag[96], step_s[32];
    etag_of_params(etag, sizeof(etag), srv->instance, v, n, step, dt, avg);
    snprintf(step_s, sizeof(step_s), "%lld", (long long)step);
    /* a pull whose If-None-Match names these very values: 304, no body (a
     * push is never conditional: its answer only carries the tag) */
    if (!outcome && etag_matches(http_header(r, MHD_HTTP_HEADER_IF_NONE_MATCH), etag)) {
        const char *h304[] = {MHD_HTTP_HEADER_ETAG, etag, "X-Global-Step", step_s, MHD_HTTP_HEADER_CACHE_CONTROL,
                              "no-store", NULL};
        return reply_blobs(r, MHD_HTTP_NOT_MODIFIED, "application/octet-stream", NULL, 0, NULL, 0, NULL, 0, h304);
    }
    st_desc *d = malloc(sizeof(st_desc) * (size_t)(n ? n : 1));
    struct http_part *parts = malloc(sizeof(*parts) * (size_t)(n ? n : 1));
    blob **hold = malloc(sizeof(blob *) * (size_t)(n ? n : 1));
    enum MHD_Result rc;
    int n_hold = n;
    if (!d || !parts || !hold) {
        rc = http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        d[i] = (st_desc){v[i].name, wire_dtype_st(dt), &v[i].shape};
        parts[i] = (struct http_part){v[i].data->data, (size_t)v[i].numel * 4};
        hold[i] = v[i].data;
    }
    if (dt != WIRE_F32) { /* a cast of the float32 values, into a blob of its own */
        if (cast_all(r, v, n, dt, parts, &hold[0], &rc) != 0)
            goto out;
        n_hold = 1;
    }
    char task_s[48];
    snprintf(task_s, sizeof(task_s), "%s:%d", cluster_job_name(srv->cfg.cluster.job),
             srv->cfg.cluster.task_index);
    const char *meta[8] = {"global_step", step_s, "task", task_s};
    int n_meta = 2;
    if (avg) {
        meta[2 * n_meta] = "moving_average";
        meta[2 * n_meta++ + 1] = "1";
    }
    if (outcome) {
        meta[2 * n_meta] = "outcome";
        meta[2 * n_meta++ + 1] = outcome;
    }
    if (outcome && req_psd(r)->parked) { /* a push's answer that waited (min_step, min_clock) */
        meta[2 * n_meta] = "waited";
        meta[2 * n_meta++ + 1] = "1";
    }
    char *head, err[256];
    size_t head_len;
    if (st_header_build(d, n, meta, n_meta, &head, &head_len, err, sizeof(err)) != 0) {
        if (dt != WIRE_F32)
            blob_unref(hold[0]);
        rc = http_reply_error(r, MHD_HTTP_INTERNAL_SERVER_ERROR, "%s", err);
        goto out;
    }
    const char *headers[] = {"X-Global-Step", step_s, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store",
                             MHD_HTTP_HEADER_ETAG, etag, outcome ? "X-Push-Outcome" : NULL, outcome, NULL};
    /* zero-copy: the stored versions go out as they are (a cast: its blob) */
    rc = reply_blobs(r, MHD_HTTP_OK, "application/octet-stream", head, head_len, parts, n, hold, n_hold,
                     headers);
    if (dt != WIRE_F32)
        blob_unref(hold[0]); /* reply_blobs took a reference of its own */
out:
    free(d);
    free(parts);
    free(hold);
    return rc;
}
