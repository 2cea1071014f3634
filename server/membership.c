/* membership.c - the sync step's membership (see membership.h). */
#include "membership.h"

#include "clock.h"
#include "routes.h"

#define TICK_MS 100

/* On the ticker, every TICK_MS: a step whose live workers have all pushed
 * completes (leases run out between pushes); the store tells the waiters. */
static int64_t tick(void *arg, int64_t now)
{
    server *srv = arg;
    store_sync_tick(&srv->store);
    return now + TICK_MS;
}

int membership_start(server *srv)
{
    return ticker_add(srv->ticker, tick, srv, clk_mono_ms() + TICK_MS) < 0 ? -1 : 0;
}

json_t *membership_json(server *srv)
{
    store *s = &srv->store;
    int64_t now = clk_mono_ms();
    pthread_rwlock_rdlock(&s->lock);
    int sync = s->configured && s->config.sync;
    json_t *have = json_array(), *waiting = json_array(), *dead = json_array(),
           *left = json_array();
    int live = 0;
    for (int w = 0; w < s->config.workers; w++) {
        int pending = 0;
        for (int i = 0; i < s->n_pending; i++)
            pending |= s->pending[i].worker == w;
        int gone = atomic_load(&s->left[w]), alive = atomic_load(&s->lease_until[w]) > now;
        live += pending || (!gone && alive);
        if (pending)
            json_array_append_new(have, json_integer(w));
        else if (!sync)
            continue; /* membership means nothing in async mode */
        else if (gone)
            json_array_append_new(left, json_integer(w));
        else if (!alive)
            json_array_append_new(dead, json_integer(w));
        else
            json_array_append_new(waiting, json_integer(w));
    }
    int r = s->config.replicas_to_aggregate;
    int needed = live < r ? live : r;
    json_t *o = json_pack(
        "{s:s,s:I,s:i,s:i,s:i,s:i,s:o,s:o,s:o,s:o,s:f,s:f,s:f}", "mode", sync ? "sync" : "async",
        "global_step", (json_int_t)s->global_step, "workers", s->config.workers,
        "replicas_to_aggregate", r, "live_workers", live, "needed", needed > 0 ? needed : 1,
        "have", have, "waiting_for", waiting, "dead", dead, "left", left, "lease_secs",
        (double)s->lease_ms / 1000.0, "step_secs", (double)(now - s->step_started_ms) / 1000.0,
        "waiting_secs",
        s->first_pending_ms ? (double)(now - s->first_pending_ms) / 1000.0 : 0.0);
    pthread_rwlock_unlock(&s->lock);
    return o;
}

enum MHD_Result h_sync(request *r)
{
    return http_reply_json(r, MHD_HTTP_OK, membership_json(r->srv));
}

enum MHD_Result h_heartbeat(request *r)
{
    json_error_t je;
    json_t *j = json_loadb((const char *)r->body->data, r->body->len, JSON_REJECT_DUPLICATES, &je);
    json_t *w = j ? json_object_get(j, "worker") : NULL;
    int ok = json_is_integer(w) && json_integer_value(w) >= 0 &&
             json_integer_value(w) < STORE_MAX_WORKERS;
    int idx = ok ? (int)json_integer_value(w) : 0;
    json_decref(j);
    if (!ok)
        return http_reply_error(r, MHD_HTTP_BAD_REQUEST, "body must be {\"worker\": index}");
    store_touch(&r->srv->store, idx);
    int n, has_loss;
    uint64_t bytes;
    int64_t step;
    double loss;
    store_totals(&r->srv->store, &n, &bytes, &step, &has_loss, &loss);
    return http_reply_json(r, MHD_HTTP_OK,
                           json_pack("{s:I,s:f}", "global_step", (json_int_t)step, "lease_secs",
                                     (double)r->srv->store.lease_ms / 1000.0));
}
