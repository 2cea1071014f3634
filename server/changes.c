/* changes.c - psd's one change notification (see changes.h). */
#include "changes.h"

#include "history.h"

static void on_store(void *ctx, unsigned what, int64_t step)
{
    server *srv = ctx;
    if (what & STORE_CHANGED_STEP) {
        waiters_raise(srv->waiters, WAIT_STEP, step);
        int n, has_loss;
        uint64_t bytes;
        int64_t gs;
        double loss;
        store_totals(&srv->store, &n, &bytes, &gs, &has_loss, &loss);
        history_record(srv->history, step, has_loss, loss); /* moves the feed */
    }
    if (what & STORE_CHANGED_CLOCK)
        waiters_changed(srv->waiters, WAIT_CLOCK);
}

static void on_feed(void *ctx)
{
    server *srv = ctx;
    waiters_changed(srv->waiters, WAIT_FEED);
}

/* the stale-synchronous level: the fewest iterations a live worker
 * completed (lock-free: read under the waiters' mutex) */
static int64_t min_clock_of(void *st) { return store_min_clock(st); }
static int64_t feed_of(void *h) { return (int64_t)history_version(h); }

void changes_follow(server *srv)
{
    waiters_raise(srv->waiters, WAIT_STEP, store_global_step(&srv->store));
    waiters_level_from(srv->waiters, WAIT_CLOCK, min_clock_of, &srv->store);
    waiters_level_from(srv->waiters, WAIT_FEED, feed_of, srv->history);
    history_on_move(srv->history, on_feed, srv);
    store_on_change(&srv->store, on_store, srv);
}
