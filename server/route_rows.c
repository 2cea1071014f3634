/* route_rows.c - row-sparse variables (store.h, sparse_table.h) by ids:
 * PUT /v1/vars/{name}/sparse (declare), GET /v1/vars/{name}/rows?ids=
 * (curl's read: raw float32 rows in the order asked, or JSON), POST
 * /v1/vars/{name}/rows (the worker's pull: a safetensors body of I64 ids,
 * answered with F32 values[n, dim]) and POST /v1/vars/{name}/rows/grad (a
 * gradient by ids for one variable, async only; a worker pushes its rows in
 * POST /v1/grads beside the dense gradients). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jsonmem.h"
#include "routes.h"
#include "sparse_set.h"

/* How many ids one request may name (a GET's query, a pull's body). */
#define ROWS_MAX_IDS (1 << 20)
#define ROWS_MAX_QUERY_IDS 65536

static const char *init_name(sparse_init_kind k)
{
    return k == SPARSE_INIT_UNIFORM ? "uniform" : "zeros";
}

static json_t *decl_json(const char *name, const sparse_decl *d)
{
    return json_pack("{s:s,s:I,s:i,s:I,s:s,s:f,s:I,s:i,s:i}", "name", name, "rows", (json_int_t)d->rows, "dim",
                     d->dim, "max_rows", (json_int_t)d->max_rows, "init", init_name(d->init), "init_scale",
                     (double)d->init_scale, "seed", (json_int_t)d->seed, "shard", d->shard, "shards", d->shards);
}

/* An integer field of the declaration within [lo, hi]: 0 absent, 1 set, -1 bad. */
static int decl_int(json_t *o, const char *key, long long lo, long long hi, long long *out)
{
    json_t *v = json_object_get(o, key);
    if (!v)
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return -1;
    *out = json_integer_value(v);
    return 1;
}

enum MHD_Result h_sparse_put(request *r)
{
    server *srv = req_srv(r);
    char err[256];
    json_t *o = req_body_json(r, err, sizeof(err));
    if (!o)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    static const char *const known[] = {"rows", "dim", "max_rows", "init", "init_scale", "seed", "shard", "shards"};
    const char *key;
    json_t *val;
    json_object_foreach(o, key, val)
    {
        size_t i = 0;
        while (i < sizeof(known) / sizeof(known[0]) && strcmp(known[i], key) != 0)
            i++;
        if (i == sizeof(known) / sizeof(known[0])) {
            enum MHD_Result rc = http_reply_error(r, MHD_HTTP_BAD_REQUEST, "unknown field '%.64s' (known: rows, dim, "
                                                  "max_rows, init, init_scale, seed, shard, shards)", key);
            json_decref(o); /* key is o's */
            return rc;
        }
    }
    long long rows = -1, dim = -1, max_rows = -1, seed = 0, shard = 0, shards = 1;
    int bad = decl_int(o, "rows", 0, SPARSE_ROWS_MAX, &rows) != 1 || decl_int(o, "dim", 1, SPARSE_DIM_MAX, &dim) != 1 ||
              decl_int(o, "max_rows", 1, SPARSE_ROWS_MAX, &max_rows) < 0 ||
              decl_int(o, "seed", 0, META_INT_MAX, &seed) < 0 || decl_int(o, "shards", 1, 4096, &shards) < 0 ||
              decl_int(o, "shard", 0, 4095, &shard) < 0;
    if (bad) {
        json_decref(o);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "rows (0: dynamic, to 2^40) and dim (1 to %d) are needed; max_rows 1 to 2^40, "
                                "seed 0 to 2^53, shards 1 to 4096, shard below shards, as integers",
                                SPARSE_DIM_MAX);
    }
    sparse_decl d = {.rows = rows, .dim = (int)dim, .seed = (uint64_t)seed, .shard = (int)shard, .shards = (int)shards};
    d.max_rows = max_rows > 0 ? max_rows : rows > 0 ? rows : (int64_t)srv->cfg.max_rows;
    json_t *init = json_object_get(o, "init");
    if (init && (!json_is_string(init) || (strcmp(json_string_value(init), "zeros") != 0 &&
                                           strcmp(json_string_value(init), "uniform") != 0))) {
        json_decref(o);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "init must be \"zeros\" or \"uniform\"");
    }
    d.init = init && strcmp(json_string_value(init), "uniform") == 0 ? SPARSE_INIT_UNIFORM : SPARSE_INIT_ZEROS;
    double scale = 0;
    int got = body_number(o, "init_scale", &scale);
    json_decref(o);
    if (got < 0 || !isfinite(scale) || scale < 0 || scale > 1e6)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "init_scale must be a number from 0 to 1e6");
    d.init_scale = got ? (float)scale : d.init == SPARSE_INIT_UNIFORM ? 0.05f : 0.0f;
    if (d.init == SPARSE_INIT_ZEROS && d.init_scale != 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "init_scale is for init \"uniform\"");
    if (d.rows > 0 && d.max_rows > d.rows)
        d.max_rows = d.rows;
    int created = 0;
    int rc = store_sparse_declare(&srv->store, r->name, &d, &created, err, sizeof(err));
    if (rc == STORE_EINVAL)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    if (rc == STORE_ECONFLICT)
        return http_reply_error(r, MHD_HTTP_CONFLICT, "%s", err);
    if (rc != STORE_OK)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    json_t *out = decl_json(r->name, &d);
    json_object_set_new(out, "created", json_boolean(created));
    return http_reply_json(r, created ? MHD_HTTP_CREATED : MHD_HTTP_OK, out);
}

/* ids=3,17,99 into raw little-endian int64s (malloc'd): n, or -1 with err. */
static int64_t parse_ids(const char *s, unsigned char **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!s || !*s) {
        snprintf(err, errlen, "ids= is needed: decimal ids separated by commas, e.g. ids=3,17,99");
        return -1;
    }
    int64_t n = 1;
    for (const char *p = s; *p; p++)
        n += *p == ',';
    if (n > ROWS_MAX_QUERY_IDS) {
        snprintf(err, errlen, "%lld ids are too many for a query (at most %d): POST them", (long long)n,
                 ROWS_MAX_QUERY_IDS);
        return -1;
    }
    unsigned char *ids = malloc(8 * (size_t)n);
    if (!ids) {
        snprintf(err, errlen, "out of memory");
        return -2;
    }
    const char *p = s;
    for (int64_t i = 0; i < n; i++) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        char buf[24];
        long long v = -1;
        if (len > 0 && len < sizeof(buf)) {
            memcpy(buf, p, len);
            buf[len] = '\0';
            if (http_parse_uint(buf, INT64_MAX, &v) != 1)
                v = -1;
        }
        if (v < 0) {
            snprintf(err, errlen, "id %lld of ids= ('%.*s') is not a non-negative decimal integer", (long long)i,
                     (int)(len < 24 ? len : 24), p);
            free(ids);
            return -1;
        }
        int64_t id = v;
        memcpy(ids + 8 * i, &id, 8);
        p = e ? e + 1 : p + len;
    }
    *out = ids;
    return n;
}

static enum MHD_Result lookup_error(request *r, int rc, const char *err)
{
    if (rc == STORE_ENOENT)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "%s", err);
    if (rc == STORE_EINVAL)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
}

/* An answer of nv floats past --max_body_bytes (an answer as large as the
 * largest body psd takes), or past 2^20 values as JSON: 400 sent, 1. */
static int answer_too_big(request *r, size_t nv, int json)
{
    const uint64_t bytes = (uint64_t)nv * 4, max = req_srv(r)->cfg.max_body_bytes;
    if (json && nv > ((size_t)1 << 20)) {
        http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%zu values are too many for JSON (at most 1048576): ask for "
                                                  "fewer ids, or the raw form", nv);
        return 1;
    }
    if (bytes > max) {
        http_reply_error(r, MHD_HTTP_BAD_REQUEST, "the rows asked for are %llu bytes, over --max_body_bytes (%llu): "
                                                  "ask for fewer ids at a time", (unsigned long long)bytes,
                         (unsigned long long)max);
        return 1;
    }
    return 0;
}

enum MHD_Result h_rows_get(request *r)
{
    server *srv = req_srv(r);
    char err[256];
    const char *f = http_query(r, "format");
    if (f && strcmp(f, "json") != 0 && strcmp(f, "raw") != 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "format must be json or raw");
    int json = f && strcmp(f, "json") == 0;
    sparse_decl d;
    if (store_sparse_peek(&srv->store, r->name, &d) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no sparse variable '%s'", r->name);
    unsigned char *ids;
    int64_t n = parse_ids(http_query(r, "ids"), &ids, err, sizeof(err));
    if (n < 0)
        return http_reply_error(r, n == -2 ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_BAD_REQUEST, "%s", err);
    size_t nv = (size_t)n * (size_t)d.dim;
    if (answer_too_big(r, nv, json)) {
        free(ids);
        return MHD_YES;
    }
    float *vals = malloc(sizeof(float) * nv);
    int64_t step;
    int rc = vals ? store_sparse_lookup(&srv->store, r->name, ids, n, vals, &step, err, sizeof(err)) : STORE_ENOMEM;
    if (rc != STORE_OK) {
        free(ids);
        free(vals);
        return lookup_error(r, rc, err);
    }
    char shape[48], gs[24];
    snprintf(shape, sizeof(shape), "%lld,%d", (long long)n, d.dim);
    snprintf(gs, sizeof(gs), "%lld", (long long)step);
    const char *headers[] = {"X-Shape", shape, "X-Dtype", "float32", "X-Global-Step", gs,
                             MHD_HTTP_HEADER_CACHE_CONTROL, "no-store", NULL};
    if (!json) {
        free(ids);
        return reply_blobs(r, MHD_HTTP_OK, "application/octet-stream", (char *)vals, nv * sizeof(float), NULL, 0,
                           NULL, 0, headers);
    }
    json_t *aid = json_array(), *av = json_array();
    for (int64_t i = 0; i < n; i++) {
        json_t *row = json_array();
        for (int j = 0; j < d.dim; j++) {
            float v = vals[(size_t)i * (size_t)d.dim + (size_t)j];
            json_array_append_new(row, isfinite(v) ? json_real(v) : json_null());
        }
        json_array_append_new(av, row);
        json_array_append_new(aid, json_integer(sparse_id_at(ids, i)));
    }
    free(ids);
    free(vals);
    json_t *doc = json_pack("{s:s,s:i,s:I,s:o,s:o}", "name", r->name, "dim", d.dim, "global_step", (json_int_t)step,
                            "ids", aid, "values", av);
    char *text = doc ? json_dumps_checked(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    if (!text)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    size_t tl = strlen(text);
    text[tl] = '\n'; /* over the NUL: the answer ends with a newline, as the others */
    return reply_blobs(r, MHD_HTTP_OK, "application/json", text, tl + 1, NULL, 0, NULL, 0, headers);
}

/* The body's safetensors tensors (data aligned for floats): 0, or an answer sent. */
static int parse_body(request *r, st_file *f, unsigned char **data, enum MHD_Result *sent)
{
    char err[256];
    blob *b = req_body(r);
    uint64_t hl;
    if (st_read_prefix(b->data, b->len, &hl, err, sizeof(err)) != 0) {
        *sent = http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
        return -1;
    }
    uint64_t data_len = b->len - 8 - hl;
    int pr = st_parse_header(b->data + 8, hl, data_len, f, err, sizeof(err));
    if (pr != 0) {
        *sent = http_reply_error(r, pr == ST_ENOMEM ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_BAD_REQUEST, "%s",
                                 err);
        return -1;
    }
    *data = b->data + 8 + hl;
    size_t mis = (uintptr_t)*data % 4;
    if (mis) {
        memmove(*data - mis, *data, data_len);
        *data -= mis;
    }
    return 0;
}

/* f's ids tensor: I64 [n] (n >= 1): its index, or -1 with an answer sent. */
static int ids_tensor(request *r, const st_file *f, int64_t max, enum MHD_Result *sent)
{
    int k = st_find(f, "ids");
    if (k < 0 || strcmp(f->tensors[k].dtype, "I64") != 0 || f->tensors[k].shape.ndim != 1 ||
        f->tensors[k].shape.dims[0] < 1 || f->tensors[k].shape.dims[0] > max) {
        *sent = http_reply_error(r, MHD_HTTP_BAD_REQUEST, "the body needs a tensor 'ids': I64 [n], 1 <= n <= %lld",
                                 (long long)max);
        return -1;
    }
    return k;
}

enum MHD_Result h_rows_post(request *r)
{
    server *srv = req_srv(r);
    char err[256];
    st_file f;
    unsigned char *data;
    enum MHD_Result sent;
    if (parse_body(r, &f, &data, &sent) != 0)
        return sent;
    int k = ids_tensor(r, &f, ROWS_MAX_IDS, &sent);
    if (k < 0 || f.n_tensors != 1) {
        if (k >= 0)
            sent = http_reply_error(r, MHD_HTTP_BAD_REQUEST, "the body holds 'ids' only");
        st_file_free(&f);
        return sent;
    }
    int64_t n = f.tensors[k].shape.dims[0];
    sparse_decl d;
    if (store_sparse_peek(&srv->store, r->name, &d) != STORE_OK) {
        st_file_free(&f);
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no sparse variable '%s'", r->name);
    }
    if (answer_too_big(r, (size_t)n * (size_t)d.dim, 0)) {
        st_file_free(&f);
        return MHD_YES;
    }
    tensor_shape vs = {.ndim = 2, .dims = {n, d.dim}};
    st_desc desc = {"values", "F32", &vs};
    char *head;
    size_t hl;
    if (st_header_build(&desc, 1, NULL, 0, &head, &hl, err, sizeof(err)) != 0) {
        st_file_free(&f);
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "%s", err);
    }
    size_t vb = sizeof(float) * (size_t)n * (size_t)d.dim;
    char *out = realloc(head, hl + vb);
    int64_t step;
    int rc = out ? store_sparse_lookup(&srv->store, r->name, data + f.tensors[k].begin, n, (float *)(out + hl), &step,
                                       err, sizeof(err))
                 : STORE_ENOMEM;
    st_file_free(&f);
    if (rc != STORE_OK) {
        free(out ? out : head);
        return lookup_error(r, rc, err);
    }
    char gs[24];
    snprintf(gs, sizeof(gs), "%lld", (long long)step);
    const char *headers[] = {"X-Global-Step", gs, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store", NULL};
    return reply_blobs(r, MHD_HTTP_OK, "application/octet-stream", out, hl + vb, NULL, 0, NULL, 0, headers);
}

enum MHD_Result h_rows_grad(request *r)
{
    server *srv = req_srv(r);
    char err[256];
    store_config cfg;
    if (store_get_config(&srv->store, &cfg) == STORE_OK && cfg.sync)
        return http_reply_error(r, MHD_HTTP_CONFLICT,
                                "sync training: push rows with the step's gradients (POST /v1/grads, '%s:ids' and "
                                "'%s:values')", r->name, r->name);
    sparse_decl d;
    if (store_sparse_peek(&srv->store, r->name, &d) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no sparse variable '%s'", r->name);
    st_file f;
    unsigned char *data;
    enum MHD_Result sent;
    if (parse_body(r, &f, &data, &sent) != 0)
        return sent;
    int k = ids_tensor(r, &f, ROWS_MAX_IDS, &sent), v = st_find(&f, "values");
    if (k < 0 || v < 0 || f.n_tensors != 2) {
        if (k >= 0)
            sent = http_reply_error(r, MHD_HTTP_BAD_REQUEST, "the body holds 'ids' and 'values' only");
        st_file_free(&f);
        return sent;
    }
    if (strcmp(f.tensors[v].dtype, "F32") == 0) {
        const float *g = (const float *)(data + f.tensors[v].begin);
        int64_t bad = tensor_find_nonfinite(g, (size_t)((f.tensors[v].end - f.tensors[v].begin) / 4));
        if (bad >= 0) {
            st_file_free(&f);
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "gradient 'values' has %s at element %lld",
                                    isnan(g[bad]) ? "NaN" : "Inf", (long long)bad);
        }
    }
    /* the store's push: the two tensors under the names of a bulk push */
    char nid[sizeof(r->name) + 8], nval[sizeof(r->name) + 8];
    snprintf(nid, sizeof(nid), "%s:ids", r->name);
    snprintf(nval, sizeof(nval), "%s:values", r->name);
    st_tensor t2[2] = {f.tensors[k], f.tensors[v]};
    t2[0].name = nid;
    t2[1].name = nval;
    st_file g = {.n_tensors = 2, .tensors = t2, .data_len = f.data_len};
    store_push_meta meta = {.worker = -1, .step = -1, .clock = -1};
    int64_t gstep = 0;
    int outcome;
    int rc = store_apply_grads(&srv->store, &g, data, &meta, &gstep, &outcome, err, sizeof(err));
    st_file_free(&f);
    if (rc == STORE_ENOMEM)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory applying the push");
    if (rc != STORE_OK)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    return http_reply_json(r, MHD_HTTP_OK, json_pack("{s:I}", "global_step", (json_int_t)gstep));
}
