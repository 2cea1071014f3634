/* test_sync.c - the store's sync aggregation, worker leases, stale-synchronous
 * clocks and its one change hook, through the store's API (values computed
 * here by hand, learning rate 1, plain SGD):
 * - replicas: a step waits for replicas_to_aggregate gradients of its step,
 *   then applies their mean once; a second push of a worker for the step is a
 *   duplicate, an older step's is dropped as stale (counted), a newer one is
 *   STORE_EAHEAD; sync needs worker and step metadata of a worker of the run;
 * - backup workers: 3 workers, 2 replicas: the first two complete the step,
 *   the third's late gradient is stale;
 * - push ids in sync mode: a retried push is a duplicate even while pending;
 * - leases: a worker whose lease ran out (or that left) does not hold the step
 *   (store_sync_tick completes it), and counts again from its next request;
 * - SSP clocks: raised, never lowered; the minimum over live workers;
 * - the hook: the step and the clock level, each when they moved;
 * - async --max_staleness at its edge: a push exactly that stale is
 *   applied, one step staler dropped. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bufpool.h"
#include "store.h"
#include "store_fixture.h"

typedef store_fixture fixture;

static int setup(void **state) { return store_fixture_setup(state, 1.0f); }
static int teardown(void **state) { return store_fixture_teardown(state); }

static void nap_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* w = [1, 2], configured: sgd, lr 1, the mode and sizes given, and
 * max_staleness (async: drop a gradient staler than it; -1: no limit). */
static void start_bounded(fixture *fx, int sync, int workers, int replicas, int staleness,
                          int max_staleness)
{
    tensor_shape sh = {.ndim = 1, .dims = {2}};
    blob *b = blob_new(fx->pool, 8);
    assert_non_null(b);
    const float w[2] = {1, 2};
    memcpy(b->data, w, 8);
    int created;
    uint64_t version;
    assert_int_equal(store_put(&fx->s, "w", &sh, b, 0, &created, &version), STORE_OK);
    store_config c;
    memset(&c, 0, sizeof(c));
    optim_defaults(&c.optim, OPTIM_SGD, 1.0f);
    c.sync = sync;
    c.workers = workers;
    c.replicas_to_aggregate = replicas;
    c.max_staleness = max_staleness;
    c.staleness = staleness;
    char err[256];
    assert_int_equal(store_configure(&fx->s, &c, err, sizeof(err)), STORE_OK);
}

static void start(fixture *fx, int sync, int workers, int replicas, int staleness)
{
    start_bounded(fx, sync, workers, replicas, staleness, -1);
}

typedef struct outcome {
    int rc, outcome;
    int64_t step;
} outcome;

/* Push gradient g for w as worker (step, clock, push id as given): a body of
 * its own, parsed as psd's handler leaves it. */
static outcome push(fixture *fx, long long worker, long long step, long long clock,
                    const char *id, float g0, float g1)
{
    blob *body = blob_new(fx->pool, 8);
    assert_non_null(body);
    const float g[2] = {g0, g1};
    memcpy(body->data, g, 8);
    st_file f;
    memset(&f, 0, sizeof(f));
    f.tensors = calloc(1, sizeof(st_tensor));
    assert_non_null(f.tensors);
    f.n_tensors = 1;
    f.tensors[0].name = strdup("w");
    snprintf(f.tensors[0].dtype, sizeof(f.tensors[0].dtype), "F32");
    f.tensors[0].shape = (tensor_shape){.ndim = 1, .dims = {2}};
    f.tensors[0].end = 8;
    f.data_len = 8;
    store_push_meta meta = {.push_id = id, .worker = worker, .step = step, .clock = clock,
                            .body = body};
    outcome o = {0, -1, -1};
    char err[256] = "";
    o.rc = store_apply_grads(&fx->s, &f, body->data, &meta, &o.step, &o.outcome, err, sizeof(err));
    assert_int_equal(f.n_tensors, 1); /* the caller keeps f on every path */
    assert_string_equal(f.tensors[0].name, "w");
    st_file_free(&f);
    blob_unref(body); /* the store holds its own reference while pending */
    return o;
}

static void expect_w(fixture *fx, float w0, float w1)
{
    store_snap snap;
    assert_int_equal(store_get(&fx->s, "w", &snap), STORE_OK);
    const float *v = (const float *)snap.data->data;
    if (v[0] != w0 || v[1] != w1)
        fail_msg("w = [%g, %g], want [%g, %g]", (double)v[0], (double)v[1], (double)w0,
                 (double)w1);
    store_snap_release(&snap);
}

static int64_t stale_dropped(fixture *fx)
{
    store_saved sv;
    assert_int_equal(store_save(&fx->s, &sv), STORE_OK);
    int64_t n = sv.stale_dropped;
    store_saved_free(&sv);
    return n;
}

#define expect_push(o, want_rc, want_outcome, want_step)                                             \
    do {                                                                                             \
        outcome o_ = (o);                                                                            \
        assert_int_equal(o_.rc, want_rc);                                                            \
        if (want_rc == STORE_OK) {                                                                   \
            assert_int_equal(o_.outcome, want_outcome);                                              \
            assert_int_equal(o_.step, want_step);                                                    \
        }                                                                                            \
    } while (0)

static void test_replicas_duplicates_stale(void **state)
{
    fixture *fx = *state;
    start(fx, 1, 2, 2, -1);
    expect_push(push(fx, 1, 0, -1, NULL, 4, 8), STORE_OK, STORE_PUSH_PENDING, 0);
    expect_w(fx, 1, 2); /* nothing applied yet */
    expect_push(push(fx, 1, 0, -1, NULL, 100, 100), STORE_OK, STORE_PUSH_DUPLICATE, 0);
    expect_push(push(fx, 0, 0, -1, NULL, 2, 4), STORE_OK, STORE_PUSH_APPLIED, 1);
    expect_w(fx, 1 - 3, 2 - 6); /* the mean of (2, 4) and (4, 8), once */
    assert_int_equal(stale_dropped(fx), 0);
    expect_push(push(fx, 0, 0, -1, NULL, 1, 1), STORE_OK, STORE_PUSH_STALE, 1);
    assert_int_equal(stale_dropped(fx), 1);
    expect_push(push(fx, 0, 5, -1, NULL, 1, 1), STORE_EAHEAD, 0, 0);
    expect_push(push(fx, -1, 1, -1, NULL, 1, 1), STORE_EINVAL, 0, 0); /* no worker */
    expect_push(push(fx, 0, -1, -1, NULL, 1, 1), STORE_EINVAL, 0, 0); /* no step */
    expect_push(push(fx, 2, 1, -1, NULL, 1, 1), STORE_EINVAL, 0, 0);  /* not of the run */
    expect_w(fx, -2, -4);
    /* the next step the same way */
    expect_push(push(fx, 0, 1, -1, NULL, 2, 2), STORE_OK, STORE_PUSH_PENDING, 1);
    expect_push(push(fx, 1, 1, -1, NULL, 0, 2), STORE_OK, STORE_PUSH_APPLIED, 2);
    expect_w(fx, -3, -6);
}

static void test_backup_workers(void **state)
{
    fixture *fx = *state;
    start(fx, 1, 3, 2, -1); /* 3 workers, 2 replicas: one backup */
    expect_push(push(fx, 2, 0, -1, NULL, 2, 2), STORE_OK, STORE_PUSH_PENDING, 0);
    expect_push(push(fx, 0, 0, -1, NULL, 4, 0), STORE_OK, STORE_PUSH_APPLIED, 1);
    expect_w(fx, 1 - 3, 2 - 1);
    expect_push(push(fx, 1, 0, -1, NULL, 50, 50), STORE_OK, STORE_PUSH_STALE, 1); /* the late one */
    expect_w(fx, -2, 1);
    assert_int_equal(stale_dropped(fx), 1);
}

static void test_push_ids_in_sync(void **state)
{
    fixture *fx = *state;
    start(fx, 1, 2, 2, -1);
    expect_push(push(fx, 0, 0, -1, "w0:s0", 2, 2), STORE_OK, STORE_PUSH_PENDING, 0);
    /* the retry of a push kept pending: a duplicate, not a second gradient */
    expect_push(push(fx, 0, 0, -1, "w0:s0", 2, 2), STORE_OK, STORE_PUSH_DUPLICATE, 0);
    expect_push(push(fx, 1, 0, -1, "w1:s0", 0, 0), STORE_OK, STORE_PUSH_APPLIED, 1);
    expect_w(fx, 0, 1);
    /* retried after the step: still a duplicate, reporting the step it was for */
    expect_push(push(fx, 1, 0, -1, "w1:s0", 0, 0), STORE_OK, STORE_PUSH_DUPLICATE, 0);
    expect_push(push(fx, 0, 0, -1, "w0:s0", 2, 2), STORE_OK, STORE_PUSH_DUPLICATE, 0);
    assert_int_equal(stale_dropped(fx), 0);
}

static void test_leases(void **state)
{
    fixture *fx = *state;
    store_set_lease_ms(&fx->s, 300);
    start(fx, 1, 2, 2, -1); /* configuring gives both a lease */
    expect_push(push(fx, 0, 0, -1, NULL, 2, 2), STORE_OK, STORE_PUSH_PENDING, 0);
    assert_int_equal(store_sync_tick(&fx->s), 0); /* worker 1's lease runs: the step waits */
    nap_ms(400);
    /* worker 1's lease ran out (worker 0's too, but its gradient is in) */
    assert_int_equal(store_sync_tick(&fx->s), 1);
    expect_w(fx, -1, 0);
    assert_int_equal(store_sync_tick(&fx->s), 0); /* nothing pending */
    /* worker 1 counts again from its next request */
    store_touch(&fx->s, 1);
    store_touch(&fx->s, 0);
    expect_push(push(fx, 0, 1, -1, NULL, 1, 1), STORE_OK, STORE_PUSH_PENDING, 1);
    assert_int_equal(store_sync_tick(&fx->s), 0);
    /* a worker that left does not hold the step either, at once */
    store_leave(&fx->s, 1);
    assert_int_equal(store_sync_tick(&fx->s), 1);
    expect_w(fx, -2, -1);
    store_touch(&fx->s, 1); /* back */
    expect_push(push(fx, 1, 2, -1, NULL, 1, 1), STORE_OK, STORE_PUSH_PENDING, 2);
    assert_int_equal(store_sync_tick(&fx->s), 0);
}

static void test_ssp_clocks(void **state)
{
    fixture *fx = *state;
    store_set_lease_ms(&fx->s, 300);
    start(fx, 0, 2, 1, 1);
    assert_int_equal(store_min_clock(&fx->s), 0);
    assert_int_equal(store_clock_done(&fx->s, 0, 3), 1);
    assert_int_equal(store_clock_done(&fx->s, 0, 2), 0); /* never lowered */
    assert_int_equal(store_clock_done(&fx->s, 0, 3), 0);
    assert_int_equal(store_min_clock(&fx->s), 0);       /* worker 1 has done none */
    /* a push of iteration 4 completes 5 (async: applied at once) */
    expect_push(push(fx, 1, 0, 4, NULL, 1, 1), STORE_OK, STORE_PUSH_APPLIED, 1);
    assert_int_equal(store_min_clock(&fx->s), 3);
    assert_int_equal(store_clock_done(&fx->s, 4095, 1), 1);  /* any index of a worker */
    assert_int_equal(store_clock_done(&fx->s, 4096, 1), 0);  /* out of range: ignored */
    assert_int_equal(store_clock_done(&fx->s, -1, 1), 0);
    store_leave(&fx->s, 0); /* the slowest left: it no longer holds the others */
    assert_int_equal(store_min_clock(&fx->s), 5);
    store_touch(&fx->s, 0);
    assert_int_equal(store_min_clock(&fx->s), 3);
    nap_ms(400); /* every lease ran out: nobody bounds anyone */
    assert_true(store_min_clock(&fx->s) == INT64_MAX);
}

typedef struct heard {
    int n;
    unsigned what[16];
    int64_t step[16];
} heard;

static void hear(void *ctx, unsigned what, int64_t step)
{
    heard *h = ctx;
    if (h->n < 16) {
        h->what[h->n] = what;
        h->step[h->n] = step;
    }
    h->n++;
}

static void test_change_hook(void **state)
{
    fixture *fx = *state;
    heard h = {0};
    start(fx, 0, 2, 1, 1);
    store_on_change(&fx->s, hear, &h);
    /* async push with a clock: the step and the clock level, in one call */
    expect_push(push(fx, 0, 0, 0, NULL, 1, 1), STORE_OK, STORE_PUSH_APPLIED, 1);
    assert_int_equal(h.n, 1);
    assert_int_equal(h.what[0], STORE_CHANGED_STEP | STORE_CHANGED_CLOCK);
    assert_int_equal(h.step[0], 1);
    /* the same clock again: only the step */
    expect_push(push(fx, 0, 1, 0, NULL, 1, 1), STORE_OK, STORE_PUSH_APPLIED, 2);
    assert_int_equal(h.n, 2);
    assert_int_equal(h.what[1], STORE_CHANGED_STEP);
    assert_int_equal(h.step[1], 2);
    /* a pull's clock: told only when raised */
    assert_int_equal(store_clock_done(&fx->s, 1, 4), 1);
    assert_int_equal(store_clock_done(&fx->s, 1, 4), 0);
    assert_int_equal(h.n, 3);
    assert_int_equal(h.what[2], STORE_CHANGED_CLOCK);
    /* the tick: the clock level every time (leases run out), the step when it stepped */
    store_sync_tick(&fx->s);
    assert_int_equal(h.n, 4);
    assert_int_equal(h.what[3], STORE_CHANGED_CLOCK);
    int64_t gs;
    uint64_t v;
    const float g[2] = {0, 0};
    assert_int_equal(store_apply_grad(&fx->s, "w", g, 2, &gs, &v), STORE_OK);
    assert_int_equal(h.n, 5);
    assert_int_equal(h.what[4], STORE_CHANGED_STEP);
    assert_int_equal(h.step[4], 3);
    assert_int_equal(store_apply_grad(&fx->s, "nope", g, 2, &gs, &v), STORE_ENOENT);
    expect_push(push(fx, 0, 9, -1, "x", 1, 1), STORE_OK, STORE_PUSH_APPLIED, 4);
    expect_push(push(fx, 0, 9, -1, "x", 1, 1), STORE_OK, STORE_PUSH_DUPLICATE, 4);
    assert_int_equal(h.n, 6); /* a refused and a duplicate push: nothing */
}

/* Async with --max_staleness: a gradient computed exactly max_staleness
 * steps ago is applied, one a step staler is dropped (counted, w and the
 * step unchanged); the bound is global_step - the push's step, so it is
 * checked at the edge for a bound of 2 and of 0 (only the newest step).
 * Before, only test_elastic (PyPI venv) looked at it, and only loosely. */
static void test_async_max_staleness_edge(void **state)
{
    fixture *fx = *state;
    start_bounded(fx, 0, 2, 1, -1, 2);
    /* steps 0, 1, 2 pushed fresh: global step 3, w = [1 - 3, 2 - 3] */
    for (int i = 0; i < 3; i++)
        expect_push(push(fx, 0, i, -1, NULL, 1, 1), STORE_OK, STORE_PUSH_APPLIED, i + 1);
    expect_w(fx, -2, -1);
    /* computed at step 1, global step 3: staleness 2 = the bound: applied */
    expect_push(push(fx, 1, 1, -1, NULL, 1, 0), STORE_OK, STORE_PUSH_APPLIED, 4);
    expect_w(fx, -3, -1);
    assert_int_equal(stale_dropped(fx), 0);
    /* computed at step 1, global step 4: staleness 3 = the bound + 1: dropped */
    expect_push(push(fx, 1, 1, -1, NULL, 100, 100), STORE_OK, STORE_PUSH_STALE, 4);
    expect_w(fx, -3, -1);
    assert_int_equal(stale_dropped(fx), 1);
    /* step 2 at global step 4: staleness 2 again: applied */
    expect_push(push(fx, 0, 2, -1, NULL, 0, 1), STORE_OK, STORE_PUSH_APPLIED, 5);
    expect_w(fx, -3, -2);
    assert_int_equal(stale_dropped(fx), 1);
}

static void test_async_max_staleness_zero(void **state)
{
    fixture *fx = *state;
    start_bounded(fx, 0, 2, 1, -1, 0);
    expect_push(push(fx, 0, 0, -1, NULL, 1, 1), STORE_OK, STORE_PUSH_APPLIED, 1);
    /* staleness 0 (the step it reads): applied; 1: dropped */
    expect_push(push(fx, 1, 1, -1, NULL, 1, 1), STORE_OK, STORE_PUSH_APPLIED, 2);
    expect_push(push(fx, 1, 1, -1, NULL, 100, 100), STORE_OK, STORE_PUSH_STALE, 2);
    expect_w(fx, -1, 0);
    assert_int_equal(stale_dropped(fx), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_replicas_duplicates_stale, setup, teardown),
        cmocka_unit_test_setup_teardown(test_backup_workers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_push_ids_in_sync, setup, teardown),
        cmocka_unit_test_setup_teardown(test_leases, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ssp_clocks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_change_hook, setup, teardown),
        cmocka_unit_test_setup_teardown(test_async_max_staleness_edge, setup, teardown),
        cmocka_unit_test_setup_teardown(test_async_max_staleness_zero, setup, teardown),
    };
    return cmocka_run_group_tests_name("sync", tests, NULL, NULL);
}
