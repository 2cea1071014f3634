/* route_grads.c - POST /v1/grads: one safetensors body of gradients (the
 * worker's push), applied as one update, or kept for its sync step. An
 * async sgd push is checked and applied by the store in one pass over its
 * body (store.h, in_body). BF16 and F16 gradients are widened to float32
 * first (wire_dtype.h; F16 divided by the metadata's loss_scale), each value
 * checked finite as the float32 it becomes. ?return=params answers with the
 * shard's variables after the update, as GET /v1/params would (min_step:
 * once the shard reaches it), so a worker's step is one round trip. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grad_slices.h"
#include "push_stream.h"
#include "routes.h"
#include "sparse_set.h"
#include "wire_dtype.h"
#include "workers.h"

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

#define RETURN_WAIT_DEFAULT_MS 30000
#define RETURN_WAIT_MAX_MS 300000

static const char *const outcomes[] = {"applied", "duplicate", "stale", "pending"};

/* What ?return=params asks: the answer's dtype, and what it waits for. */
typedef struct ret_query {
    int ret; /* 1: the variables are asked for */
    long long min_step, timeout_ms, worker, min_clock, clock;
    wire_dtype dt;
} ret_query;

/* ?return=params, min_step, timeout_ms, dtype (the answer's), and the
 * stale-synchronous worker, min_clock and clock (as GET /v1/params): 0, or
 * -1 with err. */
static int grads_query(request *r, ret_query *o, char *err, size_t errlen)
{
    const char *q = http_query(r, "return");
    *o = (ret_query){.min_step = -1, .timeout_ms = RETURN_WAIT_DEFAULT_MS, .worker = -1, .min_clock = -1,
                     .clock = -1};
    int *ret = &o->ret;
    long long *min_step = &o->min_step, *timeout_ms = &o->timeout_ms;
    wire_dtype *dt = &o->dt;
    if (q && strcmp(q, "params") != 0) {
        snprintf(err, errlen, "return must be params");
        return -1;
    }
    *ret = q != NULL;
    if (http_query_int(r, "min_step", META_INT_MAX, min_step) < 0) {
        snprintf(err, errlen, "min_step must be an integer from 0 to %lld", META_INT_MAX);
        return -1;
    }
    if (http_query_int(r, "timeout_ms", RETURN_WAIT_MAX_MS, timeout_ms) < 0) {
        snprintf(err, errlen, "timeout_ms must be an integer from 0 to %d", RETURN_WAIT_MAX_MS);
        return -1;
    }
    if (params_query_dtype(r, dt) != 0) {
        snprintf(err, errlen, "dtype must be fp32, bf16 or fp16");
        return -1;
    }
    if (http_query_int(r, "worker", STORE_MAX_WORKERS - 1, &o->worker) < 0 ||
        http_query_int(r, "min_clock", META_INT_MAX, &o->min_clock) < 0 ||
        http_query_int(r, "clock", META_INT_MAX, &o->clock) < 0) {
        snprintf(err, errlen, "worker (0 to %d), min_clock and clock (0 to %lld) must be integers",
                 STORE_MAX_WORKERS - 1, META_INT_MAX);
        return -1;
    }
    if ((o->min_clock >= 0 || o->clock >= 0) && o->worker < 0) {
        snprintf(err, errlen, "min_clock and clock need worker");
        return -1;
    }
    if (o->min_step >= 0 && o->min_clock >= 0) {
        snprintf(err, errlen, "min_step and min_clock: one wait at a time");
        return -1;
    }
    if (!*ret && (*min_step >= 0 || o->worker >= 0 || o->min_clock >= 0 || o->clock >= 0 || http_query(r, "dtype") ||
                  http_query(r, "timeout_ms"))) {
        snprintf(err, errlen, "min_step, min_clock, clock, worker, timeout_ms and dtype need return=params");
        return -1;
    }
    return 0;
}

/* The answer of ?return=params: the shard's variables now (after the push),
 * or once its step reaches min_step (parked; resumed: as they are then). */
static enum MHD_Result reply_params(request *r, int outcome)
{
    server *srv = req_srv(r);
    char err[160];
    ret_query q;
    if (grads_query(r, &q, err, sizeof(err)) != 0) /* checked before */
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    int may_wait = !req_psd(r)->parked && q.timeout_ms > 0 && !atomic_load(&srv->stopping);
    /* stale-synchronous: until the slowest live worker completed min_clock iterations */
    if (may_wait && q.min_clock >= 0 && store_min_clock(&srv->store) < q.min_clock) {
        req_psd(r)->push_outcome = outcome;
        return params_park(r, WAIT_CLOCK, q.min_clock, q.timeout_ms);
    }
    if (q.clock >= 0) /* the worker starts iteration `clock` now */
        store_clock_start(&srv->store, (int)q.worker, q.clock);
    store_snap *v;
    int n;
    int64_t step;
    if (store_get_all(&srv->store, &v, &n, &step) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    if (may_wait && step < q.min_step) {
        store_snaps_release(v, n);
        req_psd(r)->push_outcome = outcome;
        return params_park(r, WAIT_STEP, q.min_step, q.timeout_ms);
    }
    enum MHD_Result rc = params_reply(r, v, n, step, 0, q.dt, outcomes[outcome]);
    store_snaps_release(v, n);
    return rc;
}

int grads_check_head(request *r, const st_file *f, grads_head *h, int *status, char *err, size_t errlen)
{
    *h = (grads_head){.worker = -1, .step = -1, .batch = -1, .clock = -1, .loss_scale = 1};
    *status = MHD_HTTP_BAD_REQUEST;
    /* each in range before any arithmetic on it (a clock of INT64_MAX
     * overflowed at clock + 1; a worker of 2^32 became worker 0) */
    static const struct {
        const char *key;
        long long max;
    } ints[] = {{"worker", STORE_MAX_WORKERS - 1},
                {"step", META_INT_MAX},
                {"batch_size", INT32_MAX},
                {"clock", META_INT_MAX}};
    long long *outs[] = {&h->worker, &h->step, &h->batch, &h->clock};
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++) {
        /* a metadata value that must be an integer >= 0 (absent: -1) */
        int got = http_parse_uint(st_meta_get(f, ints[i].key), ints[i].max, outs[i]);
        if (got == -1) {
            snprintf(err, errlen, "metadata worker, step, batch_size and clock must be non-negative integers");
            return -1;
        }
        if (got == -2) {
            snprintf(err, errlen, "metadata %s '%.32s' must be an integer from 0 to %lld", ints[i].key,
                     st_meta_get(f, ints[i].key), ints[i].max);
            return -1;
        }
    }
    store_push_meta *meta = &h->meta;
    *meta = (store_push_meta){.worker = h->worker, .step = h->step, .clock = h->clock};
    const char *loss = st_meta_get(f, "loss");
    if (loss) {
        char *end;
        errno = 0;
        meta->loss = strtod(loss, &end);
        if (!*loss || *end || errno || !isfinite(meta->loss)) {
            snprintf(err, errlen, "metadata loss '%.32s' is not a finite number", loss);
            return -1;
        }
        meta->has_loss = 1;
    }
    meta->push_id = http_header(r, "X-Push-Id");
    if (meta->push_id && !push_id_ok(meta->push_id)) {
        snprintf(err, errlen, "X-Push-Id must be 1 to %d characters of [A-Za-z0-9._:-]", STORE_PUSH_ID_MAX);
        return -1;
    }
    for (int k = 0; k < f->n_tensors; k++)
        if (wire_dtype_of_st(f->tensors[k].dtype) < 0 && !sparse_ids_tensor(&f->tensors[k])) {
            snprintf(err, errlen, "gradient '%s' has dtype %s, only F32, BF16 and F16 are accepted",
                     f->tensors[k].name, f->tensors[k].dtype);
            return -1;
        }
    const char *ls = st_meta_get(f, "loss_scale");
    if (ls) {
        char *end;
        errno = 0;
        double scale = strtod(ls, &end);
        int e;
        if (!*ls || *end || errno || !(scale >= 1 && scale <= WIRE_LOSS_SCALE_MAX) || frexp(scale, &e) != 0.5) {
            snprintf(err, errlen, "metadata loss_scale '%.32s' must be a power of two from 1 to 2^24", ls);
            return -1;
        }
        h->loss_scale = scale;
    }
    return 0;
}

/* 16-bit gradients widened to float32 into a blob of the pool (*wide, with
 * *f and *data describing it); scale (the loss scale) divides them. 0
 * (*wide NULL: none to widen), or -1 with err and *status. */
static int widen_body(request *r, st_file *f, double scale, unsigned char **data, blob **wide, int *status,
                      char *err, size_t errlen)
{
    *wide = NULL;
    size_t len = wire_widened_len(f);
    if (len == 0)
        return 0;
    blob *w = blob_new(req_srv(r)->pool, len);
    if (!w) {
        *status = MHD_HTTP_SERVICE_UNAVAILABLE;
        snprintf(err, errlen, "out of memory widening the push");
        return -1;
    }
    if (wire_widen(f, *data, (float)(1.0 / scale), w->data, err, errlen) != 0) {
        blob_unref(w);
        *status = MHD_HTTP_BAD_REQUEST;
        return -1;
    }
    w->len = len;
    *data = w->data;
    *wide = w;
    return 0;
}

/* The answer to a push the store took (src): a refusal, or the outcome. */
static enum MHD_Result grads_answer(request *r, int src, const char *err, const grads_head *h, int64_t gstep,
                                    int outcome)
{
    if (src == STORE_ENOMEM)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory applying the push");
    if (src == STORE_ECHANGED)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "%s", err);
    if (src == STORE_EAHEAD)
        return http_reply_error(r, MHD_HTTP_CONFLICT, "%s", err);
    if (src != STORE_OK)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    workers_seen(req_srv(r)->workers, h->worker, h->step, h->batch, outcome);
    if (http_query(r, "return"))
        return reply_params(r, outcome);
    return http_reply_json(r, MHD_HTTP_OK,
                           json_pack("{s:I,s:b,s:s}", "global_step", (json_int_t)gstep, "duplicate",
                                     outcome == STORE_PUSH_DUPLICATE, "outcome", outcomes[outcome]));
}

enum MHD_Result h_grads_before(request *r)
{
    char err[256];
    ret_query q;
    store_push_arriving(&req_srv(r)->store, 1);
    req_psd(r)->arriving = 1;
    /* a length to stream against, a query the handler will take, and a
     * store that applies pushes in one pass (async sgd); else as before */
    if (r->expect_len == UINT64_MAX || r->expect_len < PUSH_STREAM_MIN_BYTES ||
        grads_query(r, &q, err, sizeof(err)) != 0 || !store_push_in_body(&req_srv(r)->store))
        return MHD_YES;
    req_psd(r)->stream = push_stream_start(r);
    return MHD_YES;
}

enum MHD_Result h_grads_post(request *r)
{
    char err[256];
    if (req_psd(r)->arriving) { /* the body is in (a cut one: request_done) */
        store_push_arriving(&req_srv(r)->store, -1);
        req_psd(r)->arriving = 0;
    }
    if (req_psd(r)->parked) /* ?return=params&min_step=: resumed, the push is in */
        return reply_params(r, req_psd(r)->push_outcome);
    {
        ret_query q;
        if (grads_query(r, &q, err, sizeof(err)) != 0)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    }
    blob *b = req_body(r), *wide = NULL;
    push_stream *ps = req_psd(r)->stream;
    if (ps) {
        int oom;
        if (!(b = push_stream_body(ps, &oom))) {
            if (oom)
                return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory for the body");
            const grads_head *sh; /* applied as it came: publish it */
            int64_t gstep = 0;
            int outcome = STORE_PUSH_APPLIED;
            int src = push_stream_commit(ps, &sh, &gstep, &outcome, err, sizeof(err));
            return grads_answer(r, src, err, sh, gstep, outcome);
        }
    }
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
    /* a dense variable's gradient by ids (top-k): its dense gradient from now on */
    blob *dense = NULL;
    {
        int dr = grad_slices_densify(&req_srv(r)->store, req_srv(r)->pool, &f, data, &dense, err, sizeof(err));
        if (dr != 0) {
            rc = http_reply_error(r, dr == -2 ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_BAD_REQUEST, "%s", err);
            goto out;
        }
        if (dense) {
            st_file_free(&f);
            f = (st_file){0};
            b = dense;
            if (st_read_prefix(b->data, b->len, &hl, err, sizeof(err)) != 0 ||
                st_parse_header(b->data + 8, hl, b->len - 8 - hl, &f, err, sizeof(err)) != 0) {
                rc = http_reply_error(r, MHD_HTTP_INTERNAL_SERVER_ERROR, "%s", err);
                goto out;
            }
            data = b->data + 8 + hl;
        }
    }
    grads_head h;
    {
        int status;
        if (grads_check_head(r, &f, &h, &status, err, sizeof(err)) != 0) {
            rc = http_reply_error(r, status, "%s", err);
            goto out;
        }
        if (widen_body(r, &f, h.loss_scale, &data, &wide, &status, err, sizeof(err)) != 0) {
            rc = http_reply_error(r, status, "%s", err);
            goto out;
        }
    }
    store_push_meta meta = h.meta;
    meta.body = wide ? wide : b; /* wide: the float32 gradients, checked finite */
    /* async sgd: the store checks for NaN and Inf in the pass that applies
     * (the next versions are written over the gradients in the body) */
    meta.in_body = store_push_in_body(&req_srv(r)->store);
    for (int k = 0; !meta.in_body && !wide && k < f.n_tensors; k++) { /* (wide: wire_widen checked them all) */
        const st_tensor *t = &f.tensors[k];
        if (sparse_ids_tensor(t))
            continue; /* a sparse gradient's ids (I64) */
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
    int src = store_apply_grads(&req_srv(r)->store, &f, data, &meta, &gstep, &outcome, err, sizeof(err));
    rc = grads_answer(r, src, err, &h, gstep, outcome);
out:
    blob_unref(wide);
    blob_unref(dense);
    st_file_free(&f);
    return rc;
}
