/* libps.c - the endpoint calls of psd's HTTP contract (libps.h): each builds
 * its path and headers, runs it on the transfer engine (transfer.h) and reads
 * the answer. */
#include "libps/libps.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "libps/transfer.h"
#include "safetensors.h"

static int check_name(ps_client *c, const char *name)
{
    char e[256];
    if (!name || tensor_name_check(name, e, sizeof(e)) != 0) {
        xfer_seterr(c, "bad variable name: %s", name ? e : "NULL");
        return PS_EINVAL;
    }
    return PS_OK;
}

int ps_pull(ps_client *c, int shard, const char *name, float *dst, size_t cap, ps_var_info *info)
{
    int rc = check_name(c, name);
    if (rc)
        return rc;
    char path[TENSOR_NAME_MAX + 32];
    snprintf(path, sizeof(path), "/v1/vars/%s", name);
    sink s = {.buf = (unsigned char *)dst, .cap = cap * sizeof(float)};
    const char *extra[] = {"Accept: application/octet-stream", NULL};
    rc = xfer_one(c, shard, "GET", path, extra, NULL, &s, RETRY_ANY);
    if (rc)
        return rc;
    tensor_shape shape;
    char e[256];
    if (!s.has_shape || tensor_shape_parse(s.shape, &shape, e, sizeof(e)) != 0 ||
        (size_t)tensor_shape_numel(&shape) * sizeof(float) != s.len) {
        xfer_seterr(c, "%s: GET %s: X-Shape '%s' does not match the %zu bytes received",
                c->label[shard], path, s.has_shape ? s.shape : "(none)", s.len);
        return PS_EPROTO;
    }
    if (info) {
        snprintf(info->name, sizeof(info->name), "%s", name);
        info->shape = shape;
        info->version = s.version;
        info->bytes = s.len;
    }
    return PS_OK;
}

int ps_put(ps_client *c, int shard, const char *name, const tensor_shape *shape,
           const float *data, int only_create, int *created)
{
    int rc = check_name(c, name);
    if (rc)
        return rc;
    int64_t numel = tensor_shape_numel(shape);
    char path[TENSOR_NAME_MAX + 32], xs[256] = "X-Shape: ";
    snprintf(path, sizeof(path), "/v1/vars/%s", name);
    tensor_shape_header(shape, xs + 9, sizeof(xs) - 9);
    const char *extra[] = {xs, "Content-Type: application/octet-stream", "X-Dtype: float32",
                           only_create ? "If-None-Match: *" : NULL, NULL};
    source src = {.part = {(const unsigned char *)data, NULL},
                  .len = {(size_t)numel * sizeof(float), 0}};
    sink s = {.growable = 1};
    rc = xfer_one(c, shard, "PUT", path, extra, &src, &s, RETRY_ANY);
    free(s.buf);
    if (rc == PS_OK && created)
        *created = c->status == 201;
    return rc;
}

static int step_from(ps_client *c, int shard, json_t *j, const char *what, int64_t *global_step)
{
    json_t *gs = json_object_get(j, "global_step");
    if (!json_is_integer(gs)) {
        xfer_seterr(c, "%s: %s: answer lacks global_step", c->label[shard], what);
        return PS_EPROTO;
    }
    if (global_step)
        *global_step = json_integer_value(gs);
    return PS_OK;
}

int ps_push_grad(ps_client *c, int shard, const char *name, const float *grad, size_t numel,
                 int64_t *global_step)
{
    int rc = check_name(c, name);
    if (rc)
        return rc;
    char path[TENSOR_NAME_MAX + 32];
    snprintf(path, sizeof(path), "/v1/vars/%s/grad", name);
    const char *extra[] = {"Content-Type: application/octet-stream", NULL};
    source src = {.part = {(const unsigned char *)grad, NULL}, .len = {numel * sizeof(float), 0}};
    json_t *j;
    /* not idempotent: retried only when the connection was never made */
    rc = xfer_json(c, shard, "POST", path, extra, &src, RETRY_CONNECT_ONLY, &j);
    if (rc)
        return rc;
    rc = step_from(c, shard, j, path, global_step);
    json_decref(j);
    return rc;
}

int ps_pull_params(ps_client *c, int shard, void *buf, size_t cap, size_t *len,
                   int64_t *global_step)
{
    sink s = {.buf = buf, .cap = cap};
    int rc = xfer_one(c, shard, "GET", "/v1/params", NULL, NULL, &s, RETRY_ANY);
    if (rc)
        return rc;
    *len = s.len;
    if (global_step) {
        if (!s.has_step) {
            xfer_seterr(c, "%s: GET /v1/params: no X-Global-Step header", c->label[shard]);
            return PS_EPROTO;
        }
        *global_step = s.global_step;
    }
    return PS_OK;
}

int ps_pull_rows(ps_client *c, int shard, const char *name, const int64_t *ids, int64_t n, int dim, float *dst,
                 void *buf, size_t cap, int64_t *global_step)
{
    char path[TENSOR_NAME_MAX + 32], err[256];
    if (n < 1 || dim < 1 || strlen(name) > TENSOR_NAME_MAX) {
        xfer_seterr(c, "ps_pull_rows: bad arguments");
        return PS_EINVAL;
    }
    snprintf(path, sizeof(path), "/v1/vars/%s/rows", name);
    tensor_shape is = {.ndim = 1, .dims = {n}};
    st_desc d = {"ids", "I64", &is};
    char *head;
    size_t hl;
    if (st_header_build(&d, 1, NULL, 0, &head, &hl, err, sizeof(err)) != 0) {
        xfer_seterr(c, "ps_pull_rows: %s", err);
        return PS_ENOMEM;
    }
    const char *extra[] = {"Content-Type: application/octet-stream", NULL};
    source src = {.part = {(const unsigned char *)head, (const unsigned char *)ids}, .len = {hl, (size_t)n * 8}};
    sink s = {.buf = buf, .cap = cap};
    int rc = xfer_one(c, shard, "POST", path, extra, &src, &s, RETRY_ANY); /* a read: retried */
    free(head);
    if (rc)
        return rc;
    st_file f;
    if (st_parse(buf, s.len, &f, err, sizeof(err)) != 0) {
        xfer_seterr(c, "%s: POST %s: %s", c->label[shard], path, err);
        return PS_EPROTO;
    }
    int k = st_find(&f, "values");
    if (k < 0 || strcmp(f.tensors[k].dtype, "F32") != 0 || f.tensors[k].shape.ndim != 2 ||
        f.tensors[k].shape.dims[0] != n || f.tensors[k].shape.dims[1] != dim) {
        st_file_free(&f);
        xfer_seterr(c, "%s: POST %s: the answer is not values F32 [%lld, %d]", c->label[shard], path, (long long)n, dim);
        return PS_EPROTO;
    }
    memcpy(dst, (const unsigned char *)buf + f.data_start + f.tensors[k].begin, (size_t)n * (size_t)dim * 4);
    st_file_free(&f);
    if (global_step && s.has_step)
        *global_step = s.global_step;
    return PS_OK;
}

/* An outcome word of POST /v1/grads as PS_PUSH_*. */
static int outcome_of(json_t *j)
{
    const char *o = json_string_value(json_object_get(j, "outcome"));
    int r = json_is_true(json_object_get(j, "duplicate")) ? PS_PUSH_DUPLICATE : PS_PUSH_APPLIED;
    if (o && strcmp(o, "stale") == 0)
        r = PS_PUSH_STALE;
    else if (o && strcmp(o, "pending") == 0)
        r = PS_PUSH_PENDING;
    return r;
}

int ps_push_grads(ps_client *c, int shard, const void *head, size_t head_len, const void *data,
                  size_t data_len, const char *push_id, int64_t *global_step, int *duplicate)
{
    char idh[128];
    const char *extra[] = {"Content-Type: application/octet-stream", NULL, NULL};
    if (push_id) {
        if (strlen(push_id) > 64) {
            xfer_seterr(c, "push id longer than 64 characters");
            return PS_EINVAL;
        }
        snprintf(idh, sizeof(idh), "X-Push-Id: %s", push_id);
        extra[1] = idh;
    }
    source src = {.part = {head, data}, .len = {head_len, data_len}};
    json_t *j;
    int rc = xfer_json(c, shard, "POST", "/v1/grads", extra, &src,
                       push_id ? RETRY_ANY : RETRY_CONNECT_ONLY, &j);
    if (rc)
        return rc;
    rc = step_from(c, shard, j, "POST /v1/grads", global_step);
    if (rc == PS_OK && duplicate)
        *duplicate = outcome_of(j) == PS_PUSH_DUPLICATE;
    json_decref(j);
    return rc;
}

int ps_status(ps_client *c, int shard, json_t **out)
{
    return xfer_json(c, shard, "GET", "/v1/status", NULL, NULL, RETRY_ANY, out);
}

int ps_json(ps_client *c, int shard, const char *method, const char *path, json_t *body,
            int idempotent, json_t **out)
{
    char *text = NULL;
    if (body && !(text = json_dumps(body, JSON_COMPACT))) {
        xfer_seterr(c, "out of memory");
        return PS_ENOMEM;
    }
    source src = {.part = {(const unsigned char *)text, NULL}, .len = {text ? strlen(text) : 0, 0}};
    const char *extra[] = {"Content-Type: application/json", NULL};
    json_t *j = NULL;
    int rc = xfer_json(c, shard, method, path, body ? extra : NULL, body ? &src : NULL,
                      idempotent ? RETRY_ANY : RETRY_CONNECT_ONLY, &j);
    free(text);
    if (rc == PS_OK && out)
        *out = j;
    else
        json_decref(j);
    return rc;
}

int ps_pull_params_many(ps_client *c, ps_pull_req *r, int n)
{
    xfer *xs = calloc((size_t)(n ? n : 1), sizeof(xfer));
    sink *ss = calloc((size_t)(n ? n : 1), sizeof(sink));
    char (*paths)[192] = calloc((size_t)(n ? n : 1), sizeof(*paths));
    int rc = PS_OK;
    if (!xs || !ss || !paths) {
        xfer_seterr(c, "out of memory");
        rc = PS_ENOMEM;
        goto out;
    }
    long extra = 0;
    for (int i = 0; i < n; i++) {
        if (r[i].min_step >= 0) {
            if (r[i].timeout_ms < 0 || r[i].timeout_ms > 300000) {
                xfer_seterr(c, "timeout_ms must be in [0, 300000]");
                rc = PS_EINVAL;
                goto out;
            }
            int k = snprintf(paths[i], sizeof(paths[i]), "/v1/params?min_step=%lld&timeout_ms=%ld",
                             (long long)r[i].min_step, r[i].timeout_ms);
            if (r[i].worker >= 0)
                k += snprintf(paths[i] + k, sizeof(paths[i]) - (size_t)k, "&worker=%d", r[i].worker);
            if (r[i].worker >= 0 && r[i].min_clock > 0)
                k += snprintf(paths[i] + k, sizeof(paths[i]) - (size_t)k, "&min_clock=%lld",
                              (long long)r[i].min_clock);
            if (r[i].worker >= 0 && r[i].clock > 0)
                k += snprintf(paths[i] + k, sizeof(paths[i]) - (size_t)k, "&clock=%lld",
                              (long long)r[i].clock);
            if (r[i].dtype)
                snprintf(paths[i] + k, sizeof(paths[i]) - (size_t)k, "&dtype=%.8s", r[i].dtype);
            if (r[i].timeout_ms > extra)
                extra = r[i].timeout_ms;
        } else {
            snprintf(paths[i], sizeof(paths[i]), "%s%s%.8s",
                     c->moving_average ? "/v1/params?moving_average=1" : "/v1/params",
                     !r[i].dtype ? "" : c->moving_average ? "&dtype=" : "?dtype=", r[i].dtype ? r[i].dtype : "");
        }
        ss[i] = (sink){.buf = r[i].buf, .cap = r[i].cap, .landed = r[i].landed, .landed_arg = r[i].landed_arg,
                       .shard = r[i].shard};
        xs[i] = (xfer){.shard = r[i].shard, .method = "GET", .path = paths[i], .s = &ss[i],
                       .mode = RETRY_ANY};
    }
    c->extra_timeout_ms = extra;
    if ((rc = xfer_run(c, xs, n)) != PS_OK)
        goto out;
    for (int i = 0; i < n; i++) {
        if (!ss[i].has_step) {
            xfer_seterr(c, "%s: GET /v1/params: no X-Global-Step header", c->label[r[i].shard]);
            rc = PS_EPROTO;
            goto out;
        }
        r[i].len = ss[i].len;
        r[i].global_step = ss[i].global_step;
    }
out:
    c->extra_timeout_ms = 0;
    free(xs);
    free(ss);
    free(paths);
    return rc;
}

/* The path of a push: /v1/grads, or with ?return=params and its conditions. */
static void push_path(const ps_push_req *r, char *path, size_t cap, long *wait_ms)
{
    if (!r->ret_buf) {
        snprintf(path, cap, "/v1/grads");
        return;
    }
    int k = snprintf(path, cap, "/v1/grads?return=params");
    if (r->ret_dtype)
        k += snprintf(path + k, cap - (size_t)k, "&dtype=%.8s", r->ret_dtype);
    if (r->ret_min_step >= 0 || r->ret_min_clock > 0) {
        k += snprintf(path + k, cap - (size_t)k, "&timeout_ms=%ld", r->ret_timeout_ms);
        if (r->ret_timeout_ms > *wait_ms)
            *wait_ms = r->ret_timeout_ms;
    }
    if (r->ret_min_step >= 0)
        k += snprintf(path + k, cap - (size_t)k, "&min_step=%lld", (long long)r->ret_min_step);
    if (r->ret_worker >= 0 && (r->ret_min_clock > 0 || r->ret_clock > 0))
        k += snprintf(path + k, cap - (size_t)k, "&worker=%d", r->ret_worker);
    if (r->ret_worker >= 0 && r->ret_min_clock > 0)
        k += snprintf(path + k, cap - (size_t)k, "&min_clock=%lld", (long long)r->ret_min_clock);
    if (r->ret_worker >= 0 && r->ret_clock > 0)
        snprintf(path + k, cap - (size_t)k, "&clock=%lld", (long long)r->ret_clock);
}

/* A ?return=params answer: its step (X-Global-Step) and outcome (the
 * body's metadata). */
static int returned(ps_client *c, ps_push_req *r, const sink *s)
{
    st_file f;
    char err[256];
    if (!s->has_step || st_parse(s->buf, s->len, &f, err, sizeof(err)) != 0) {
        xfer_seterr(c, "%s: POST /v1/grads?return=params: %s", c->label[r->shard],
                    s->has_step ? err : "no X-Global-Step header");
        return PS_EPROTO;
    }
    const char *o = st_meta_get(&f, "outcome"), *waited = st_meta_get(&f, "waited");
    r->ret_waited = waited && strcmp(waited, "1") == 0;
    r->outcome = !o ? PS_PUSH_APPLIED
                 : strcmp(o, "duplicate") == 0 ? PS_PUSH_DUPLICATE
                 : strcmp(o, "stale") == 0   ? PS_PUSH_STALE
                 : strcmp(o, "pending") == 0 ? PS_PUSH_PENDING
                                             : PS_PUSH_APPLIED;
    st_file_free(&f);
    r->ret_len = s->len;
    r->global_step = s->global_step;
    return PS_OK;
}

int ps_push_grads_many(ps_client *c, ps_push_req *r, int n)
{
    xfer *xs = calloc((size_t)(n ? n : 1), sizeof(xfer));
    sink *ss = calloc((size_t)(n ? n : 1), sizeof(sink));
    source *src = calloc((size_t)(n ? n : 1), sizeof(source));
    char (*idh)[128] = calloc((size_t)(n ? n : 1), sizeof(*idh));
    const char *(*extra)[3] = calloc((size_t)(n ? n : 1), sizeof(*extra));
    char (*paths)[256] = calloc((size_t)(n ? n : 1), sizeof(*paths));
    long wait_ms = 0;
    int rc = PS_OK;
    if (!xs || !ss || !src || !idh || !extra || !paths) {
        xfer_seterr(c, "out of memory");
        rc = PS_ENOMEM;
        goto out;
    }
    for (int i = 0; i < n; i++) {
        extra[i][0] = "Content-Type: application/octet-stream";
        if (r[i].push_id) {
            if (strlen(r[i].push_id) > 64) {
                xfer_seterr(c, "push id longer than 64 characters");
                rc = PS_EINVAL;
                goto out;
            }
            snprintf(idh[i], sizeof(idh[i]), "X-Push-Id: %s", r[i].push_id);
            extra[i][1] = idh[i];
        }
        src[i] = (source){.part = {r[i].head, r[i].data}, .len = {r[i].head_len, r[i].data_len},
                          .more = r[i].parts, .n_more = r[i].n_parts, .gate = r[i].gate, .gate_arg = r[i].gate_arg};
        ss[i] = r[i].ret_buf ? (sink){.buf = r[i].ret_buf, .cap = r[i].ret_cap, .landed = r[i].landed,
                                      .landed_arg = r[i].landed_arg, .shard = r[i].shard}
                             : (sink){.growable = 1};
        push_path(&r[i], paths[i], sizeof(paths[i]), &wait_ms);
        xs[i] = (xfer){.shard = r[i].shard, .method = "POST", .path = paths[i], .extra = extra[i],
                       .src = &src[i], .s = &ss[i],
                       .mode = r[i].push_id ? RETRY_ANY : RETRY_CONNECT_ONLY};
    }
    c->extra_timeout_ms = wait_ms;
    if ((rc = xfer_run(c, xs, n)) != PS_OK)
        goto out;
    for (int i = 0; i < n && rc == PS_OK; i++) {
        if (r[i].ret_buf) {
            rc = returned(c, &r[i], &ss[i]);
            continue;
        }
        json_error_t je;
        json_t *j = json_loadb((const char *)ss[i].buf, ss[i].len, 0, &je);
        if (!j) {
            xfer_seterr(c, "%s: POST /v1/grads: answer is not JSON: %s", c->label[r[i].shard], je.text);
            rc = PS_EPROTO;
            break;
        }
        rc = step_from(c, r[i].shard, j, "POST /v1/grads", &r[i].global_step);
        r[i].outcome = outcome_of(j);
        json_decref(j);
    }
out:
    c->extra_timeout_ms = 0;
    for (int i = 0; ss && i < n; i++)
        if (!r[i].ret_buf)
            free(ss[i].buf);
    free(paths);
    free(xs);
    free(ss);
    free(src);
    free(idh);
    free(extra);
    return rc;
}
