/* request.c - what psd's route files read from a request alike (request.h). */
#include "request.h"

#include <stdio.h>

json_t *req_body_json(request *r, char *err, size_t errlen)
{
    json_error_t je;
    json_t *j = json_loadb((const char *)req_body(r)->data, req_body(r)->len, JSON_REJECT_DUPLICATES, &je);
    if (!j)
        snprintf(err, errlen, "body is not JSON: %s", je.text);
    else if (!json_is_object(j)) {
        snprintf(err, errlen, "body must be a JSON object");
        json_decref(j);
        j = NULL;
    }
    return j;
}

/* A number field; 0 absent, 1 ok, -1 present but not a number. */
int body_number(json_t *o, const char *key, double *out)
{
    json_t *v = json_object_get(o, key);
    if (!v)
        return 0;
    if (!json_is_number(v))
        return -1;
    *out = json_number_value(v);
    return 1;
}

int body_worker(json_t *o)
{
    json_t *w = o ? json_object_get(o, "worker") : NULL;
    if (!json_is_integer(w) || json_integer_value(w) < 0 || json_integer_value(w) >= STORE_MAX_WORKERS)
        return -1;
    return (int)json_integer_value(w);
}
