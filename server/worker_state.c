/* worker_state.c - each worker's lease, clocks and gradient staleness (see worker_state.h). */
#include "worker_state.h"

#include <stdio.h>
#include <string.h>

static int valid(int worker) { return worker >= 0 && worker < STORE_MAX_WORKERS; }

void worker_state_init(worker_state *ws)
{
    memset(ws, 0, sizeof(*ws));
    ws->lease_ms = 10000;
    atomic_store(&ws->n_workers, 1);
}

void worker_state_start(worker_state *ws, int n, int64_t now_ms)
{
    for (int w = 0; w < n && w < STORE_MAX_WORKERS; w++) {
        atomic_store(&ws->lease_until[w], now_ms + ws->lease_ms);
        atomic_store(&ws->left[w], 0);
    }
    atomic_store(&ws->n_workers, n);
}

void worker_state_touch(worker_state *ws, int worker, int64_t now_ms)
{
    if (!valid(worker))
        return;
    atomic_store(&ws->lease_until[worker], now_ms + ws->lease_ms);
    atomic_store(&ws->left[worker], 0);
}

void worker_state_leave(worker_state *ws, int worker)
{
    if (valid(worker))
        atomic_store(&ws->left[worker], 1);
}

int worker_state_alive(const worker_state *ws, int worker, int64_t now_ms)
{
    return valid(worker) && !atomic_load(&ws->left[worker]) &&
           atomic_load(&ws->lease_until[worker]) > now_ms;
}

int worker_state_left(const worker_state *ws, int worker)
{
    return valid(worker) && atomic_load(&ws->left[worker]);
}

void worker_state_clock_start(worker_state *ws, int worker, int64_t clock)
{
    if (valid(worker))
        atomic_store(&ws->clock_started[worker], clock);
}

int worker_state_clock_done(worker_state *ws, int worker, int64_t done)
{
    if (!valid(worker))
        return 0;
    /* max-only: a late or repeated report never lowers it */
    int64_t was = atomic_load(&ws->clock_done[worker]);
    while (done > was)
        if (atomic_compare_exchange_weak(&ws->clock_done[worker], &was, done))
            return 1;
    return 0;
}

int64_t worker_state_min_clock(const worker_state *ws, int64_t now_ms)
{
    int64_t m = INT64_MAX;
    int n = atomic_load(&ws->n_workers);
    for (int w = 0; w < n && w < STORE_MAX_WORKERS; w++)
        if (worker_state_alive(ws, w, now_ms)) {
            int64_t d = atomic_load(&ws->clock_done[w]);
            if (d < m)
                m = d;
        }
    return m;
}

void worker_state_staleness(worker_state *ws, int64_t staleness)
{
    int b = staleness < 4 ? (int)staleness : staleness < 8 ? 4 : staleness < 16 ? 5
          : staleness < 32 ? 6 : staleness < 64 ? 7 : 8;
    ws->staleness_hist[b]++;
    ws->staleness_sum += staleness;
    ws->staleness_count++;
    if (staleness > ws->staleness_max)
        ws->staleness_max = staleness;
}

json_t *worker_state_staleness_json(const worker_state *ws)
{
    static const char *const le[WORKER_STALENESS_BUCKETS] = {"0", "1", "2", "3", "7", "15", "31", "63", "+Inf"};
    json_t *b = json_array();
    for (int i = 0; i < WORKER_STALENESS_BUCKETS; i++)
        json_array_append_new(b, json_pack("{s:s,s:I}", "le", le[i], "count",
                                           (json_int_t)ws->staleness_hist[i]));
    double mean = ws->staleness_count ? (double)ws->staleness_sum / (double)ws->staleness_count : 0.0;
    return json_pack("{s:I,s:f,s:I,s:o}", "count", (json_int_t)ws->staleness_count, "mean", mean,
                     "max", (json_int_t)ws->staleness_max, "buckets", b);
}

json_t *worker_state_clocks_json(const worker_state *ws, int workers)
{
    json_t *clocks = json_object();
    for (int w = 0; w < workers && w < STORE_MAX_WORKERS; w++) {
        char k[16];
        snprintf(k, sizeof(k), "%d", w);
        json_object_set_new(clocks, k, json_pack("{s:I,s:I}", "started",
                                                 (json_int_t)atomic_load(&ws->clock_started[w]),
                                                 "done", (json_int_t)atomic_load(&ws->clock_done[w])));
    }
    return clocks;
}
