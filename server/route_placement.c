/* route_placement.c - GET/PUT /v1/placement: the chief's map of where every
 * variable lives, its model spec and input shape (they go into every
 * checkpoint). */
#include <stdlib.h>
#include <string.h>

#include "jsonmem.h"
#include "routes.h"

/* The chief's placement map (client/placement.h), kept for GET /v1/placement
 * and the checkpoints; psd checks its shape, not its arithmetic. */
#define PLACEMENT_MAX (1 << 20)
enum MHD_Result h_placement_put(request *r)
{
    char err[256];
    json_t *j = req_body_json(r, err, sizeof(err));
    if (!j)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
    json_t *n = json_object_get(j, "ps_tasks"), *vars = json_object_get(j, "variables"),
           *pol = json_object_get(j, "policy");
    int ps = req_srv(r)->cfg.cluster.jobs[JOB_PS].n;
    if (!json_is_integer(n) || !json_is_array(vars) || !json_is_string(pol)) {
        json_decref(j);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "placement must be an object with policy, ps_tasks and variables");
    }
    if (json_integer_value(n) != ps) {
        json_int_t got = json_integer_value(n);
        json_decref(j);
        return http_reply_error(r, MHD_HTTP_CONFLICT,
                                "placement is for %lld ps tasks, this cluster has %d",
                                (long long)got, ps);
    }
    /* the model the chief trains (client/model.h's canonical spec) and its
     * input shape: they go into every checkpoint's __metadata__ */
    static const struct { const char *key; size_t max; } named[] = {{"model", 511}, {"input_shape", 63}};
    for (size_t i = 0; i < sizeof(named) / sizeof(named[0]); i++) {
        json_t *v = json_object_get(j, named[i].key);
        if (!v)
            continue;
        const char *t = json_string_value(v);
        size_t len = t ? json_string_length(v) : 0;
        int ok = t && len >= 1 && len <= named[i].max;
        for (size_t k = 0; ok && k < len; k++)
            ok = t[k] > ' ' && t[k] <= '~'; /* printable, no space: also no NUL inside */
        if (!ok) {
            json_decref(j);
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                    "placement %s must be a string of 1 to %zu printable characters",
                                    named[i].key, named[i].max);
        }
    }
    json_object_del(j, "this_ps"); /* psd's own, added on GET */
    char *text = json_dumps_checked(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(j);
    if (text && strlen(text) > PLACEMENT_MAX) {
        free(text);
        return http_reply_error(r, MHD_HTTP_CONTENT_TOO_LARGE,
                                "placement map over %d bytes (it goes into every checkpoint)",
                                PLACEMENT_MAX);
    }
    if (!text || store_set_placement(&req_srv(r)->store, text) != STORE_OK) {
        free(text);
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
    }
    free(text);
    return h_placement_get(r);
}

enum MHD_Result h_placement_get(request *r)
{
    char *text = store_get_placement(&req_srv(r)->store);
    if (!text)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "no placement yet: the chief sends it");
    json_t *j = json_loads(text, 0, NULL);
    free(text);
    if (!j)
        return http_reply_error(r, MHD_HTTP_INTERNAL_SERVER_ERROR, "stored placement is not JSON");
    int n;
    uint64_t bytes;
    int64_t step;
    int has_loss;
    double loss;
    store_totals(&req_srv(r)->store, &n, &bytes, &step, &has_loss, &loss);
    json_object_set_new(j, "this_ps", json_pack("{s:i,s:i,s:I}", "task", req_srv(r)->cfg.cluster.task_index,
                                                "variables", n, "bytes", (json_int_t)bytes));
    return http_reply_json(r, MHD_HTTP_OK, j);
}
