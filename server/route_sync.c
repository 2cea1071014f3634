/* route_sync.c - GET /v1/sync (the sync step in progress: gradients in,
 * workers waited for; membership.h) and POST /v1/heartbeat (a worker renews
 * its lease). */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>

#include "clock.h"
#include "membership.h"
#include "routes.h"
#include "task_claims.h"
#include "timeline.h"

enum MHD_Result h_sync(request *r)
{
    json_t *m = membership_json(req_srv(r));
    if (!m)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory building the sync state");
    return http_reply_json(r, MHD_HTTP_OK, m);
}

/* The request's peer as "ip:port" ("?" when libmicrohttpd does not say). */
static void peer_addr(request *r, char *out, size_t n)
{
    snprintf(out, n, "?");
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (!ci || !ci->client_addr)
        return;
    char ip[INET6_ADDRSTRLEN];
    if (ci->client_addr->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ci->client_addr;
        if (inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip)))
            snprintf(out, n, "%s:%u", ip, (unsigned)ntohs(a->sin_port));
    } else if (ci->client_addr->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ci->client_addr;
        if (inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof(ip)))
            snprintf(out, n, "[%s]:%u", ip, (unsigned)ntohs(a->sin6_port));
    }
}

/* A holder not heard from for this long gives its task id way (a process
 * killed and restarted at once); heartbeats come every second. */
#define CLAIM_FRESH_MS 3000

/* The heartbeat's instance (task_claims.h): NULL absent, "" malformed. */
static const char *heartbeat_instance(json_t *j)
{
    json_t *in = json_object_get(j, "instance");
    if (!in)
        return NULL;
    const char *s = json_string_value(in);
    return s && task_instance_valid(s) ? s : "";
}

/* {"global_step", "lease_secs"}: the shard's step, how long a lease runs. */
static enum MHD_Result heartbeat_answer(request *r)
{
    int64_t step = store_global_step(&req_srv(r)->store);
    return http_reply_json(r, MHD_HTTP_OK,
                           json_pack("{s:I,s:f}", "global_step", (json_int_t)step, "lease_secs",
                                     (double)store_lease_ms(&req_srv(r)->store) / 1000.0));
}

enum MHD_Result h_heartbeat(request *r)
{
    json_error_t je;
    json_t *j = json_loadb((const char *)req_body(r)->data, req_body(r)->len, JSON_REJECT_DUPLICATES, &je);
    int idx = body_worker(j);
    if (idx < 0) {
        json_decref(j);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "body must be {\"worker\": index}");
    }
    /* which process holds this task id: a second one is refused */
    const char *inst = heartbeat_instance(j);
    if (inst && !*inst) {
        json_decref(j);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST,
                                "instance must be a string of 1 to %d printable characters (no quotes, spaces "
                                "or backslashes)",
                                TASK_INSTANCE_MAX);
    }
    json_t *leaving = json_object_get(j, "leaving");
    if (leaving && !json_is_boolean(leaving)) {
        json_decref(j);
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "leaving must be true or false");
    }
    if (inst && json_is_true(leaving)) { /* its last beat: the id is free, nothing renewed */
        task_claims_release(req_srv(r)->claims, idx, inst);
        json_decref(j);
        return heartbeat_answer(r);
    }
    if (inst) {
        char from[80], holder[TASK_INSTANCE_MAX + 1], addr[64];
        int64_t ago = 0;
        peer_addr(r, from, sizeof(from));
        int c = task_claims_heard(req_srv(r)->claims, idx, inst, from, clk_mono_ms(), CLAIM_FRESH_MS, holder,
                                  sizeof(holder), addr, sizeof(addr), &ago);
        if (c != 0) {
            json_decref(j);
            if (c < 0)
                return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory");
            return http_reply_error(r, MHD_HTTP_CONFLICT,
                                    "worker task %d is held by another process: %s from %s, heard from %.1f s "
                                    "ago (two workers started with --task_index=%d?)",
                                    idx, holder, addr, (double)ago / 1000.0, idx);
        }
    }
    /* the worker's step spans for the live timeline: kept for the run's
     * workers only (memory bounded by the configuration), checked whole */
    const json_t *spans = json_object_get(j, "timeline");
    if (spans) {
        store_sync_view v;
        int workers = 0;
        if (store_get_sync_view(&req_srv(r)->store, &v) == STORE_OK) {
            workers = v.workers;
            free(v.member);
        }
        char err[256];
        if (idx < workers && timeline_add(req_srv(r)->timeline, idx, spans, err, sizeof(err)) != 0) {
            json_decref(j);
            return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "%s", err);
        }
    }
    json_decref(j);
    store_touch(&req_srv(r)->store, idx);
    return heartbeat_answer(r);
}
