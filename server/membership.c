/* membership.c - the sync step's membership (see membership.h). */
#include "membership.h"

#include <stdlib.h>

#include "clock.h"
#include "server.h"

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
    store_sync_view v;
    if (store_get_sync_view(&srv->store, &v) != STORE_OK)
        return NULL;
    json_t *have = json_array(), *waiting = json_array(), *dead = json_array(),
           *left = json_array();
    static const int in_async[4] = {[STORE_MEMBER_HAVE] = 1}; /* membership means nothing in async mode */
    json_t *const lists[] = {[STORE_MEMBER_HAVE] = have, [STORE_MEMBER_WAITING] = waiting,
                             [STORE_MEMBER_DEAD] = dead, [STORE_MEMBER_LEFT] = left};
    for (int w = 0; w < v.workers; w++)
        if (v.sync || in_async[v.member[w]])
            json_array_append_new(lists[v.member[w]], json_integer(w));
    free(v.member);
    int needed = v.live < v.replicas ? v.live : v.replicas;
    return json_pack("{s:s,s:I,s:i,s:i,s:i,s:i,s:o,s:o,s:o,s:o,s:f,s:f,s:f}", "mode",
                     v.sync ? "sync" : "async", "global_step", (json_int_t)v.global_step,
                     "workers", v.workers, "replicas_to_aggregate", v.replicas, "live_workers",
                     v.live, "needed", needed > 0 ? needed : 1, "have", have, "waiting_for",
                     waiting, "dead", dead, "left", left, "lease_secs",
                     (double)v.lease_ms / 1000.0, "step_secs", v.step_secs, "waiting_secs",
                     v.waiting_secs);
}
