/* route_vars.c - one variable at a time: GET /v1/vars (the list), GET and
 * PUT /v1/vars/{name} (read raw, JSON, slices, ETag; create or replace), GET
 * /v1/vars/{name}/stats and POST /v1/vars/{name}/grad (a gradient for one
 * variable). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jsonmem.h"
#include "etag.h"
#include "routes.h"

static unsigned status_of(int rc)
{
    switch (rc) {
    case STORE_ENOENT: return MHD_HTTP_NOT_FOUND;
    case STORE_EEXIST: return MHD_HTTP_PRECONDITION_FAILED;
    case STORE_ESHAPE:
    case STORE_EINVAL: return MHD_HTTP_BAD_REQUEST;
    default: return MHD_HTTP_SERVICE_UNAVAILABLE;
    }
}

static json_t *shape_json(const tensor_shape *s)
{
    json_t *a = json_array();
    for (int i = 0; i < s->ndim; i++)
        json_array_append_new(a, json_integer(s->dims[i]));
    return a;
}

enum MHD_Result h_vars_list(request *r)
{
    store_snap *v;
    int n;
    int64_t step;
    if (store_get_all(&req_srv(r)->store, &v, &n, &step) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    json_t *arr = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(arr, json_pack("{s:s,s:s,s:o,s:I,s:I}", "name", v[i].name, "dtype",
                                             "float32", "shape", shape_json(&v[i].shape), "version",
                                             (json_int_t)v[i].version, "bytes",
                                             (json_int_t)(v[i].numel * 4)));
    store_snaps_release(v, n);
    return http_reply_json(r, MHD_HTTP_OK,
                           json_pack("{s:I,s:o}", "global_step", (json_int_t)step, "vars", arr));
}

/* Parse a non-negative integer query argument; -1 when absent, -2 when bad. */
static int64_t query_count(request *r, const char *key)
{
    const char *s = http_query(r, key);
    if (!s)
        return -1;
    if (*s < '0' || *s > '9')
        return -2;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (*end || errno || v < 0)
        return -2;
    return v;
}

static int wants_json(request *r, int *bad)
{
    const char *f = http_query(r, "format");
    *bad = 0;
    if (f) {
        if (strcmp(f, "json") == 0)
            return 1;
        if (strcmp(f, "raw") == 0 || strcmp(f, "binary") == 0)
            return 0;
        *bad = 1;
        return 0;
    }
    const char *acc = http_header(r, MHD_HTTP_HEADER_ACCEPT);
    return acc && strstr(acc, "application/json") && !strstr(acc, "application/octet-stream");
}

/* A JSON answer costs ~16 bytes per value, twice: cap what one request can ask. */
#define JSON_MAX_VALUES (1 << 20)

/* A JSON body is formatted as libmicrohttpd sends it (a content reader), so
 * a client that does not read costs a block, not the whole text: 40 clients
 * of a million values that read nothing held 6.8 MiB each when the text was
 * built first. The stored version is held (a reference) until it is sent. */
#define JSON_BLOCK (32 * 1024)

typedef struct json_stream {
    blob *hold;
    const float *x;
    int64_t n, i;
    char *head; /* {"name":...,"values":[ */
    size_t head_len, head_at;
    char carry[40]; /* a value (or the tail) that did not fit the last block */
    size_t carry_len, carry_at;
    int tail;
} json_stream;

static ssize_t json_stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    json_stream *j = cls;
    size_t out = 0;
    while (out < max) {
        if (j->carry_at < j->carry_len) {
            size_t k = j->carry_len - j->carry_at < max - out ? j->carry_len - j->carry_at : max - out;
            memcpy(buf + out, j->carry + j->carry_at, k);
            j->carry_at += k;
            out += k;
        } else if (j->head_at < j->head_len) {
            size_t k = j->head_len - j->head_at < max - out ? j->head_len - j->head_at : max - out;
            memcpy(buf + out, j->head + j->head_at, k);
            j->head_at += k;
            out += k;
        } else if (j->i < j->n) {
            /* %.9g round-trips a float32; NaN and Inf become null */
            float v = j->x[j->i];
            const char *sep = j->i ? "," : "";
            int w = isfinite(v) ? snprintf(j->carry, sizeof(j->carry), "%s%.9g", sep, (double)v)
                                : snprintf(j->carry, sizeof(j->carry), "%snull", sep);
            j->carry_len = (size_t)w;
            j->carry_at = 0;
            j->i++;
        } else if (!j->tail) {
            memcpy(j->carry, "]}\n", 3);
            j->carry_len = 3;
            j->carry_at = 0;
            j->tail = 1;
        } else {
            break;
        }
    }
    return out ? (ssize_t)out : MHD_CONTENT_READER_END_OF_STREAM;
}

static void json_stream_free(void *cls)
{
    json_stream *j = cls;
    blob_unref(j->hold);
    free(j->head);
    free(j);
}

enum MHD_Result h_var_get(request *r)
{
    server *srv = req_srv(r);
    int bad_format;
    int json = wants_json(r, &bad_format);
    if (bad_format)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "format must be json or raw");
    int64_t off = query_count(r, "offset"), cnt = query_count(r, "count");
    if (off == -2 || cnt == -2)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "offset and count must be non-negative integers");
    int64_t avg = query_count(r, "moving_average");
    if (avg == -2 || avg > 1)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "moving_average must be 0 or 1");
    store_snap v;
    int got = avg == 1 ? store_get_average(&srv->store, r->name, &v) : store_get(&srv->store, r->name, &v);
    if (got == STORE_EMODE)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "moving_average=1: the training configuration has no moving_average_decay");
    if (got == STORE_ENOMEM)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    if (got != STORE_OK)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no variable '%s'", r->name);
    int sliced = off >= 0 || cnt >= 0;
    if (off < 0)
        off = 0;
    if (off > v.numel) {
        store_snap_release(&v);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "offset %lld is past the %lld elements of '%s'",
                                (long long)off, (long long)v.numel, r->name);
    }
    if (cnt < 0)
        cnt = v.numel - off;
    if (cnt > v.numel - off) {
        store_snap_release(&v);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "offset %lld + count %lld is past the %lld elements of '%s'",
                                (long long)off, (long long)cnt, (long long)v.numel, r->name);
    }
    char etag[112], shape[160], version[32];
    int el = snprintf(etag, sizeof(etag), "\"%s-%llu", srv->instance, (unsigned long long)v.version);
    if (json)
        el += snprintf(etag + el, sizeof(etag) - (size_t)el, "-json");
    if (avg == 1) /* the average of a version is another entity than its value */
        el += snprintf(etag + el, sizeof(etag) - (size_t)el, "-avg");
    if (sliced)
        el += snprintf(etag + el, sizeof(etag) - (size_t)el, "-%lld-%lld", (long long)off,
                       (long long)cnt);
    snprintf(etag + el, sizeof(etag) - (size_t)el, "\"");
    snprintf(version, sizeof(version), "%llu", (unsigned long long)v.version);
    if (sliced)
        snprintf(shape, sizeof(shape), "%lld", (long long)cnt);
    else
        tensor_shape_header(&v.shape, shape, sizeof(shape));
    const char *headers[] = {MHD_HTTP_HEADER_ETAG, etag, "X-Shape", shape, "X-Dtype", "float32",
                             "X-Version", version, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache",
                             NULL};

    if (etag_matches(http_header(r, MHD_HTTP_HEADER_IF_NONE_MATCH), etag)) {
        store_snap_release(&v);
        return reply_blobs(r, MHD_HTTP_NOT_MODIFIED, "application/octet-stream", NULL, 0,
                                NULL, 0, NULL, 0, headers);
    }
    const float *x = (const float *)v.data->data + off;
    enum MHD_Result rc;
    if (json && cnt > JSON_MAX_VALUES) {
        store_snap_release(&v);
        return http_reply_error(r, MHD_HTTP_CONTENT_TOO_LARGE,
                                "%lld values are too many for JSON (at most %d): use the raw form, or "
                                "?offset=K&count=M",
                                (long long)cnt, JSON_MAX_VALUES);
    }
    if (json) {
        json_t *meta = json_pack("{s:s,s:s,s:o,s:I}", "name", v.name, "dtype", "float32", "shape",
                                 shape_json(&v.shape), "version", (json_int_t)v.version);
        if (sliced) {
            json_object_set_new(meta, "offset", json_integer(off));
            json_object_set_new(meta, "count", json_integer(cnt));
        }
        char *head = json_dumps_checked(meta, JSON_COMPACT);
        json_decref(meta);
        json_stream *j = calloc(1, sizeof(*j));
        char *h = head ? malloc(strlen(head) + 16) : NULL;
        if (!j || !h) {
            free(j);
            free(h);
            free(head);
            store_snap_release(&v);
            return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
        }
        /* head is {...}: ,"values":[ goes before its } */
        size_t hl = strlen(head);
        memcpy(h, head, hl - 1);
        j->head_len = hl - 1 + (size_t)sprintf(h + hl - 1, ",\"values\":[");
        free(head);
        j->head = h;
        j->hold = blob_ref(v.data);
        j->x = x;
        j->n = cnt;
        rc = http_reply_stream(r, MHD_HTTP_OK, "application/json", JSON_BLOCK, json_stream_read, j,
                               json_stream_free, headers);
    } else {
        /* zero-copy: the response reads the stored version directly */
        struct http_part part = {x, (size_t)cnt * 4};
        rc = reply_blobs(r, MHD_HTTP_OK, "application/octet-stream", NULL, 0, &part, 1,
                              &v.data, 1, headers);
    }
    store_snap_release(&v);
    return rc;
}

enum MHD_Result h_var_stats(request *r)
{
    store_snap v;
    if (store_get(&req_srv(r)->store, r->name, &v) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no variable '%s'", r->name);
    const float *x = (const float *)v.data->data;
    double sum = 0, sq = 0, mn = INFINITY, mx = -INFINITY;
    int64_t nan = 0, inf = 0, fin = 0;
    for (int64_t i = 0; i < v.numel; i++) {
        float f = x[i];
        if (isnan(f)) {
            nan++;
        } else if (isinf(f)) {
            inf++;
        } else {
            fin++;
            sum += f;
            sq += (double)f * f;
            if (f < mn)
                mn = f;
            if (f > mx)
                mx = f;
        }
    }
    json_t *o = json_pack("{s:s,s:o,s:I,s:I,s:I,s:I}", "name", v.name, "shape",
                          shape_json(&v.shape), "version", (json_int_t)v.version, "count",
                          (json_int_t)v.numel, "nan_count", (json_int_t)nan, "inf_count",
                          (json_int_t)inf);
    json_object_set_new(o, "min", fin ? json_real(mn) : json_null());
    json_object_set_new(o, "max", fin ? json_real(mx) : json_null());
    json_object_set_new(o, "mean", fin ? json_real(sum / (double)fin) : json_null());
    json_object_set_new(o, "l2_norm", json_real(sqrt(sq)));
    store_snap_release(&v);
    return http_reply_json(r, MHD_HTTP_OK, o);
}

/* PUT: shape, dtype and length are known before the body; check them first. */
enum MHD_Result h_var_put_check(request *r)
{
    char err[256];
    tensor_shape shape;
    const char *xs = http_header(r, "X-Shape");
    if (!xs)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "PUT needs an X-Shape header, e.g. 'X-Shape: 784,100'");
    if (tensor_shape_parse(xs, &shape, err, sizeof(err)) != 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "X-Shape: %s", err);
    const char *dt = http_header(r, "X-Dtype");
    if (dt && strcmp(dt, "float32") != 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "X-Dtype '%.32s' is not supported, only float32", dt);
    uint64_t need = (uint64_t)tensor_shape_numel(&shape) * 4;
    if (need > req_srv(r)->cfg.max_body_bytes)
        return http_reply_error(r, MHD_HTTP_CONTENT_TOO_LARGE,
                                "shape [%s] needs %llu bytes, over the limit of %llu (--max_body_bytes)",
                                xs, (unsigned long long)need,
                                (unsigned long long)req_srv(r)->cfg.max_body_bytes);
    if (r->expect_len != UINT64_MAX && r->expect_len != need)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "body of %llu bytes does not match shape [%s] (%llu bytes of float32)",
                                (unsigned long long)r->expect_len, xs, (unsigned long long)need);
    sparse_decl sd;
    if (store_sparse_peek(&req_srv(r)->store, r->name, &sd) == STORE_OK)
        return http_reply_error(r, MHD_HTTP_CONFLICT,
                                "'%s' is a sparse variable: its rows are read and pushed by ids (/v1/vars/%s/rows)",
                                r->name, r->name);
    const char *inm = http_header(r, MHD_HTTP_HEADER_IF_NONE_MATCH);
    if (inm && strcmp(inm, "*") == 0 && store_peek(&req_srv(r)->store, r->name, NULL) == STORE_OK)
        return http_reply_error(r, MHD_HTTP_PRECONDITION_FAILED, "variable '%s' exists", r->name);
    if (r->expect_len == UINT64_MAX)
        r->expect_len = need; /* chunked: still allocate once */
    return MHD_YES;
}

enum MHD_Result h_var_put(request *r)
{
    char err[256], shape_s[160];
    tensor_shape shape;
    if (tensor_shape_parse(http_header(r, "X-Shape"), &shape, err, sizeof(err)) != 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "X-Shape: %s", err);
    tensor_shape_format(&shape, shape_s, sizeof(shape_s));
    uint64_t need = (uint64_t)tensor_shape_numel(&shape) * 4;
    if (req_body(r)->len != need)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "body of %zu bytes does not match shape [%s] (%llu bytes of float32)",
                                req_body(r)->len, shape_s, (unsigned long long)need);
    const char *inm = http_header(r, MHD_HTTP_HEADER_IF_NONE_MATCH);
    int only_create = inm && strcmp(inm, "*") == 0, created = 0;
    uint64_t version = 0;
    blob *data = http_take_body(r);
    int rc = store_put(&req_srv(r)->store, r->name, &shape, data, only_create, &created, &version);
    if (rc != STORE_OK) {
        blob_unref(data);
        if (rc == STORE_EEXIST)
            return http_reply_error(r, MHD_HTTP_PRECONDITION_FAILED, "variable '%s' exists", r->name);
        return http_reply_error(r, status_of(rc), "cannot store '%s'", r->name);
    }
    return http_reply_json(r, created ? MHD_HTTP_CREATED : MHD_HTTP_OK,
                           json_pack("{s:s,s:o,s:I,s:b}", "name", r->name, "shape", shape_json(&shape),
                                     "version", (json_int_t)version, "created", created));
}

enum MHD_Result h_var_grad_check(request *r)
{
    tensor_shape have, given;
    char err[256], a[160], b[160];
    if (store_peek(&req_srv(r)->store, r->name, &have) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no variable '%s'", r->name);
    tensor_shape_format(&have, b, sizeof(b));
    const char *xs = http_header(r, "X-Shape");
    if (xs) {
        if (tensor_shape_parse(xs, &given, err, sizeof(err)) != 0)
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "X-Shape: %s", err);
        if (!tensor_shape_equal(&given, &have)) {
            tensor_shape_format(&given, a, sizeof(a));
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                    "gradient shape [%s] does not match variable '%s' of shape [%s]",
                                    a, r->name, b);
        }
    }
    uint64_t need = (uint64_t)tensor_shape_numel(&have) * 4;
    if (r->expect_len != UINT64_MAX && r->expect_len != need)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "gradient of %llu bytes does not match variable '%s' of shape [%s] (%llu bytes)",
                                (unsigned long long)r->expect_len, r->name, b,
                                (unsigned long long)need);
    if (r->expect_len == UINT64_MAX)
        r->expect_len = need;
    return MHD_YES;
}

enum MHD_Result h_var_grad(request *r)
{
    tensor_shape have;
    if (store_peek(&req_srv(r)->store, r->name, &have) != STORE_OK)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no variable '%s'", r->name);
    int64_t numel = tensor_shape_numel(&have);
    if (req_body(r)->len != (size_t)numel * 4)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "gradient of %zu bytes does not match variable '%s' (%lld bytes)",
                                req_body(r)->len, r->name, (long long)numel * 4);
    const float *g = (const float *)req_body(r)->data;
    int64_t bad = tensor_find_nonfinite(g, (size_t)numel);
    if (bad >= 0)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "gradient for '%s' has %s at element %lld",
                                r->name, isnan(g[bad]) ? "NaN" : "Inf", (long long)bad);
    int64_t step;
    uint64_t version;
    int rc = store_apply_grad(&req_srv(r)->store, r->name, g, numel, &step, &version);
    if (rc == STORE_EMODE)
        return http_reply_error(r, MHD_HTTP_CONFLICT,
                                "sync training aggregates whole steps: push with POST /v1/grads");
    if (rc != STORE_OK)
        return http_reply_error(r, status_of(rc), rc == STORE_ESHAPE
                                                      ? "variable '%s' changed shape during the push"
                                                      : "cannot apply the gradient to '%s'",
                                r->name);
    return http_reply_json(r, MHD_HTTP_OK,
                           json_pack("{s:I,s:I}", "global_step", (json_int_t)step, "version",
                                     (json_int_t)version));
}
