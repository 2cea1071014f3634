/* bulk.c - the worker's path: every variable of the shard in one safetensors
 * body (GET /v1/params), and one safetensors body of gradients applied as one
 * update (POST /v1/grads). */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "token.h"
#include "routes.h"
#include "workers.h"

/* The largest step or clock a request may carry: exact in JSON (2^53), and far
 * from INT64_MAX, so step and clock arithmetic cannot overflow. */
#define META_INT_MAX (1LL << 53)

/* A non-negative integer query argument: 0 absent, 1 ok, -1 bad. */
static int query_int(request *r, const char *key, long long *out)
{
    const char *s = http_query(r, key);
    if (!s)
        return 0;
    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    *out = strtoll(s, &end, 10);
    return (*end || errno) ? -1 : 1;
}

#define LONG_POLL_DEFAULT_MS 30000
#define LONG_POLL_MAX_MS 300000

/* Suspend the request and park it until channel ch of the waiters reaches
 * min (or timeout_ms passes); the handler runs again once it is resumed. */
static enum MHD_Result park(request *r, int ch, int64_t min, long long timeout_ms)
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
    if (query_int(r, "min_step", &min_step) < 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "min_step must be a non-negative integer");
    if (query_int(r, "worker", &worker) < 0 || worker >= STORE_MAX_WORKERS)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "worker must be an integer from 0 to %d",
                                STORE_MAX_WORKERS - 1);
    if (query_int(r, "timeout_ms", &timeout_ms) < 0 || timeout_ms > LONG_POLL_MAX_MS)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "timeout_ms must be an integer from 0 to %d",
                                LONG_POLL_MAX_MS);
    long long min_clock = -1, clock = -1, avg = 0;
    if (query_int(r, "moving_average", &avg) < 0 || avg > 1)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "moving_average must be 0 or 1");
    if (avg) {
        store_config mc;
        if (!store_get_config(&srv->store, &mc) || !(mc.moving_average_decay > 0))
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                    "moving_average=1: the training configuration has no moving_average_decay");
    }
    if (query_int(r, "min_clock", &min_clock) < 0 || query_int(r, "clock", &clock) < 0)
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
        return park(r, WAIT_CLOCK, min_clock, timeout_ms);
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
    if (worker >= 0 && step < min_step && !req_psd(r)->parked && store_get_config(&srv->store, &cfg) &&
        cfg.sync)
        lost = !pending;
    if (step < min_step && !lost && !req_psd(r)->parked && timeout_ms > 0 && !atomic_load(&srv->stopping)) {
        /* long poll: park until the step exists (or the deadline); answered
         * when resumed, with whatever step the shard is at then */
        store_snaps_release(v, n);
        return park(r, WAIT_STEP, min_step, timeout_ms);
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
    st_desc *d = malloc(sizeof(st_desc) * (size_t)(n ? n : 1));
    struct http_part *parts = malloc(sizeof(*parts) * (size_t)(n ? n : 1));
    blob **hold = malloc(sizeof(blob *) * (size_t)(n ? n : 1));
    enum MHD_Result rc;
    if (!d || !parts || !hold) {
        rc = http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        d[i] = (st_desc){v[i].name, "F32", &v[i].shape};
        parts[i] = (struct http_part){v[i].data->data, (size_t)v[i].numel * 4};
        hold[i] = v[i].data;
    }
    char step_s[32], task_s[48];
    snprintf(step_s, sizeof(step_s), "%lld", (long long)step);
    snprintf(task_s, sizeof(task_s), "%s:%d", cluster_job_name(srv->cfg.cluster.job),
             srv->cfg.cluster.task_index);
    const char *meta[] = {"global_step", step_s, "task", task_s, "moving_average", "1"};
    char *head, err[256];
    size_t head_len;
    if (st_header_build(d, n, meta, avg ? 3 : 2, &head, &head_len, err, sizeof(err)) != 0) {
        rc = http_reply_error(r, MHD_HTTP_INTERNAL_SERVER_ERROR, "%s", err);
        goto out;
    }
    const char *headers[] = {"X-Global-Step", step_s, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store",
                             NULL};
    /* zero-copy: the stored versions go out as they are */
    rc = reply_blobs(r, MHD_HTTP_OK, "application/octet-stream", head, head_len, parts, n,
                          hold, n, headers);
out:
    free(d);
    free(parts);
    free(hold);
    store_snaps_release(v, n);
    return rc;
}

/* A metadata value that must be an integer >= 0; 0 absent, 1 ok, -1 bad. */
static int meta_int(const st_file *f, const char *key, long long *out)
{
    const char *s = st_meta_get(f, key);
    if (!s)
        return 0;
    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    *out = strtoll(s, &end, 10);
    return (*end || errno) ? -1 : 1;
}

static int push_id_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > STORE_PUSH_ID_MAX)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.' || c == ':'))
            return 0;
    }
    return 1;
}

enum MHD_Result h_grads_post(request *r)
{
    char err[256];
    blob *b = req_body(r);
    uint64_t hl;
    if (st_read_prefix(b->data, b->len, &hl, err, sizeof(err)) != 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    st_file f;
    uint64_t data_len = b->len - 8 - hl;
    int pr = st_parse_header(b->data + 8, hl, data_len, &f, err, sizeof(err));
    if (pr != 0)
        return http_reply_error(r, pr == ST_ENOMEM ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_BAD_REQUEST,
                                "%s", err);
    enum MHD_Result rc;
    unsigned char *data = b->data + 8 + hl;
    size_t mis = (uintptr_t)data % 4;
    if (mis) { /* another writer's unpadded header: align the floats in place */
        memmove(data - mis, data, data_len);
        data -= mis;
    }
    long long worker = -1, step = -1, batch = -1, clock = -1;
    /* each in range before any arithmetic on it (a clock of INT64_MAX
     * overflowed at clock + 1; a worker of 2^32 became worker 0) */
    static const struct {
        const char *key;
        long long max;
    } ints[] = {{"worker", STORE_MAX_WORKERS - 1},
                {"step", META_INT_MAX},
                {"batch_size", INT32_MAX},
                {"clock", META_INT_MAX}};
    long long *outs[] = {&worker, &step, &batch, &clock};
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++) {
        if (meta_int(&f, ints[i].key, outs[i]) < 0) {
            rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                  "metadata worker, step, batch_size and clock must be non-negative integers");
            goto out;
        }
        if (*outs[i] > ints[i].max) {
            rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                  "metadata %s '%.32s' must be an integer from 0 to %lld", ints[i].key,
                                  st_meta_get(&f, ints[i].key), ints[i].max);
            goto out;
        }
    }
    store_push_meta meta = {.worker = worker, .step = step, .clock = clock, .body = b};
    const char *loss = st_meta_get(&f, "loss");
    if (loss) {
        char *end;
        errno = 0;
        meta.loss = strtod(loss, &end);
        if (!*loss || *end || errno || !isfinite(meta.loss)) {
            rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST, "metadata loss '%.32s' is not a finite number",
                                  loss);
            goto out;
        }
        meta.has_loss = 1;
    }
    meta.push_id = http_header(r, "X-Push-Id");
    if (meta.push_id && !push_id_ok(meta.push_id)) {
        rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                              "X-Push-Id must be 1 to %d characters of [A-Za-z0-9._:-]",
                              STORE_PUSH_ID_MAX);
        goto out;
    }
    for (int k = 0; k < f.n_tensors; k++)
        if (strcmp(f.tensors[k].dtype, "F32") != 0) {
            rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                  "gradient '%s' has dtype %s, only F32 is accepted",
                                  f.tensors[k].name, f.tensors[k].dtype);
            goto out;
        }
    for (int k = 0; k < f.n_tensors; k++) {
        const st_tensor *t = &f.tensors[k];
        const float *g = (const float *)(data + t->begin);
        int64_t bad = tensor_find_nonfinite(g, (size_t)((t->end - t->begin) / 4));
        if (bad >= 0) {
            rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST, "gradient '%s' has %s at element %lld",
                                  t->name, isnan(g[bad]) ? "NaN" : "Inf", (long long)bad);
            goto out;
        }
    }
    int64_t gstep;
    int outcome;
    static const char *const outcomes[] = {"applied", "duplicate", "stale", "pending"};
    int src = store_apply_grads(&req_srv(r)->store, &f, data, &meta, &gstep, &outcome, err, sizeof(err));
    if (src == STORE_ENOMEM)
        rc = http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory applying the push");
    else if (src == STORE_EAHEAD)
        rc = http_reply_error(r, MHD_HTTP_CONFLICT, "%s", err);
    else if (src != STORE_OK)
        rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    else {
        workers_seen(req_srv(r)->workers, worker, step, batch, outcome);
        rc = http_reply_json(r, MHD_HTTP_OK,
                             json_pack("{s:I,s:b,s:s}", "global_step", (json_int_t)gstep, "duplicate",
                                       outcome == STORE_PUSH_DUPLICATE, "outcome", outcomes[outcome]));
    }
out:
    st_file_free(&f);
    return rc;
}
