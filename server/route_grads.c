/* route_grads.c - POST /v1/grads: one safetensors body of gradients (the
 * worker's push), applied as one update, or kept for its sync step. An
 * async sgd push is checked and applied by the store in one pass over its
 * body (store.h, in_body). */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "routes.h"
#include "sparse_set.h"
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
        /* a metadata value that must be an integer >= 0 (absent: -1) */
        int got = http_parse_uint(st_meta_get(&f, ints[i].key), ints[i].max, outs[i]);
        if (got == -1) {
            rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                  "metadata worker, step, batch_size and clock must be non-negative integers");
            goto out;
        }
        if (got == -2) {
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
        if (strcmp(f.tensors[k].dtype, "F32") != 0 && !sparse_ids_tensor(&f.tensors[k])) {
            rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                  "gradient '%s' has dtype %s, only F32 is accepted",
                                  f.tensors[k].name, f.tensors[k].dtype);
            goto out;
        }
    /* async sgd: the store checks for NaN and Inf in the pass that applies
     * (the next versions are written over the gradients in the body) */
    meta.in_body = store_push_in_body(&req_srv(r)->store);
    for (int k = 0; !meta.in_body && k < f.n_tensors; k++) {
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
