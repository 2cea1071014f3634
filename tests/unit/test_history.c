/* test_history.c - common/history.c alone (with common/log.o; the
 * TensorBoard writer faked here: tfevents_scalar records its calls). Every
 * answer is parsed back with jansson and compared with what the test works out
 * itself:
 * - empty history: no points, last step 0, 0 steps/s, the three fields;
 * - points: (step, loss, unix time) in order; no loss or a non-finite one is
 *   not kept but the feed moves; an older step is dropped, the same step again
 *   replaces the last point; the evaluator's reports likewise;
 * - bounded memory: the last HISTORY_RECENT points, and of the ones pushed out
 *   every stride-th, the stride the smallest power of two that fits
 *   HISTORY_LONG_SLOTS (worked out here from the count, not from the code);
 * - since: only the points after it; the JSON's numbers and framing;
 * - steps_per_sec over a rate window; the synthetic prefill hook;
 * - the event writers get every kept point, with its step, value and time;
 * - a writer against readers: every answer is ascending and consistent. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "history.h"
#include "tfevents.h"

/* ---- fake TensorBoard writer: every scalar queued, in order ---- */

struct tfevents {
    int id;
};

#define MAX_EV 64
static struct {
    struct tfevents *w;
    char tag[16];
    int64_t step;
    double t, v;
} ev[MAX_EV];
static int n_ev;

void tfevents_scalar(tfevents *w, const char *tag, int64_t step, double wall_time, double value)
{
    if (!w)
        return;
    assert_true(n_ev < MAX_EV);
    ev[n_ev].w = w;
    snprintf(ev[n_ev].tag, sizeof(ev[n_ev].tag), "%s", tag);
    ev[n_ev].step = step;
    ev[n_ev].t = wall_time;
    ev[n_ev].v = value;
    n_ev++;
}

/* ---- helpers ---- */

/* history_json parsed; its framing checked (one trailing newline, the
 * length, exactly the three fields with their types) */
static json_t *answer(struct history *h, long long since, int64_t gs)
{
    size_t len = 0;
    char *text = history_json(h, since, gs, &len);
    assert_non_null(text);
    assert_int_equal(len, strlen(text));
    assert_true(len >= 2 && text[len - 1] == '\n' && text[len - 2] == '}');
    json_error_t err;
    json_t *j = json_loadb(text, len, 0, &err);
    if (!j)
        fail_msg("history_json is not JSON: %s (at %d)", err.text, err.position);
    free(text);
    assert_true(json_is_object(j));
    assert_int_equal(json_object_size(j), 3);
    assert_true(json_is_integer(json_object_get(j, "global_step")));
    assert_true(json_integer_value(json_object_get(j, "global_step")) == gs);
    assert_true(json_is_array(json_object_get(j, "points")));
    assert_true(json_is_array(json_object_get(j, "eval")));
    return j;
}

static json_t *points(json_t *j) { return json_object_get(j, "points"); }
static json_t *evals(json_t *j) { return json_object_get(j, "eval"); }

static int64_t step_at(json_t *arr, size_t i)
{
    json_t *e = json_array_get(arr, i);
    assert_true(json_is_array(e));
    assert_true(json_is_integer(json_array_get(e, 0)));
    return json_integer_value(json_array_get(e, 0));
}

static double num_at(json_t *arr, size_t i, size_t k)
{
    json_t *v = json_array_get(json_array_get(arr, i), k);
    assert_true(json_is_number(v));
    return json_number_value(v);
}

/* printed with 10 significant digits */
static void assert_close(double got, double want)
{
    if (!(fabs(got - want) <= 6e-10 * fabs(want) + 1e-300))
        fail_msg("got %.17g, want %.17g", got, want);
}

static int moves;
static void on_move(void *ctx)
{
    (void)ctx;
    moves++;
}

static int setup(void **state)
{
    unsetenv("RESTPS_TEST_SYNTHETIC_HISTORY");
    struct history *h = history_new();
    if (!h)
        return -1;
    moves = 0;
    n_ev = 0;
    history_on_move(h, on_move, NULL);
    *state = h;
    return 0;
}

static int teardown(void **state)
{
    history_free(*state);
    return 0;
}

/* ---- tests ---- */

static void test_empty_history(void **state)
{
    struct history *h = *state;
    assert_int_equal(history_last_step(h), 0);
    assert_true(history_steps_per_sec(h) == 0.0);
    assert_int_equal(history_version(h), 0);
    json_t *j = answer(h, -1, 0);
    assert_int_equal(json_array_size(points(j)), 0);
    assert_int_equal(json_array_size(evals(j)), 0);
    json_decref(j);
    j = answer(h, 5, 123456789012345LL); /* global_step is the caller's */
    assert_int_equal(json_array_size(points(j)), 0);
    json_decref(j);
    json_t *st = json_object();
    history_status(h, st);
    assert_true(json_is_real(json_object_get(st, "steps_per_sec")));
    assert_true(json_real_value(json_object_get(st, "steps_per_sec")) == 0.0);
    json_decref(st);
    /* no history at all: nothing happens */
    history_record(NULL, 1, 1, 1.0);
    history_record_eval(NULL, 1, 1.0, 0.5);
    history_status(NULL, NULL);
    history_free(NULL);
}

static void test_points_in_order_with_time(void **state)
{
    struct history *h = *state;
    const double loss[] = {2.302585093, 1.5, 0.1, 1e-300, 12345.678901234, -2.5, 7.0e12};
    const int n = (int)(sizeof(loss) / sizeof(loss[0]));
    double t0 = clk_unix_secs();
    for (int i = 0; i < n; i++)
        history_record(h, 10 * (i + 1), 1, loss[i]);
    double t1 = clk_unix_secs();
    assert_int_equal(history_last_step(h), 10 * n);
    assert_int_equal(moves, n);
    assert_int_equal(history_version(h), (uint64_t)n);
    json_t *j = answer(h, -1, 10 * n);
    json_t *p = points(j);
    assert_int_equal(json_array_size(p), n);
    for (int i = 0; i < n; i++) {
        assert_int_equal(json_array_size(json_array_get(p, i)), 3);
        assert_int_equal(step_at(p, i), 10 * (i + 1));
        assert_close(num_at(p, i, 1), loss[i]);
        double t = num_at(p, i, 2); /* printed to the millisecond */
        assert_true(t >= t0 - 0.0006 && t <= t1 + 0.0006);
        if (i)
            assert_true(t >= num_at(p, i - 1, 2));
    }
    assert_int_equal(json_array_size(evals(j)), 0);
    json_decref(j);
}

static void test_no_loss_or_non_finite_is_not_kept_but_moves_the_feed(void **state)
{
    struct history *h = *state;
    history_record(h, 1, 0, 0.0);
    history_record(h, 2, 1, NAN);
    history_record(h, 3, 1, INFINITY);
    history_record(h, 4, 1, -INFINITY);
    assert_int_equal(history_last_step(h), 0);
    assert_int_equal(moves, 4);
    assert_int_equal(history_version(h), 4);
    history_record(h, 5, 1, 0.75);
    history_record_eval(h, 5, NAN, 0.5);
    history_record_eval(h, 6, 0.5, INFINITY);
    assert_int_equal(moves, 7);
    assert_int_equal(history_version(h), 7);
    json_t *j = answer(h, -1, 6);
    assert_int_equal(json_array_size(points(j)), 1);
    assert_int_equal(step_at(points(j), 0), 5);
    assert_close(num_at(points(j), 0, 1), 0.75);
    assert_int_equal(json_array_size(evals(j)), 0);
    json_decref(j);
    assert_int_equal(history_last_step(h), 5);
}

static void test_older_step_dropped_same_step_replaces(void **state)
{
    struct history *h = *state;
    struct tfevents train = {1}, eval = {2};
    history_set_events(h, &train, &eval);
    history_record(h, 5, 1, 1.0);
    history_record(h, 3, 1, 9.0); /* older: dropped */
    history_record(h, 5, 1, 0.9); /* the same step: the newer value wins */
    history_record(h, 7, 1, 0.8);
    history_record(h, 7, 0, 0.0); /* no loss: nothing */
    history_record(h, 6, 1, 9.0); /* older than the last kept */
    assert_int_equal(history_last_step(h), 7);
    assert_int_equal(moves, 6);

    history_record_eval(h, 10, 0.5, 0.80);
    history_record_eval(h, 10, 0.4, 0.85); /* replaces */
    history_record_eval(h, 4, 0.1, 0.99);  /* older: not kept */
    history_record_eval(h, 20, 0.3, 0.90);
    assert_int_equal(moves, 10);

    json_t *j = answer(h, -1, 20);
    json_t *p = points(j), *e = evals(j);
    assert_int_equal(json_array_size(p), 2);
    assert_int_equal(step_at(p, 0), 5);
    assert_close(num_at(p, 0, 1), 0.9);
    assert_int_equal(step_at(p, 1), 7);
    assert_close(num_at(p, 1, 1), 0.8);
    assert_int_equal(json_array_size(e), 2);
    assert_int_equal(json_array_size(json_array_get(e, 0)), 4);
    assert_int_equal(step_at(e, 0), 10);
    assert_close(num_at(e, 0, 1), 0.4);
    assert_close(num_at(e, 0, 2), 0.85);
    assert_int_equal(step_at(e, 1), 20);
    assert_close(num_at(e, 1, 1), 0.3);
    assert_close(num_at(e, 1, 2), 0.90);

    /* the writers: every kept point (a replacement again), in order; the last
     * one of each step is what the history answers, with its time */
    static const struct {
        int w;
        const char *tag;
        int64_t step;
        double v;
    } want[] = {{1, "loss", 5, 1.0},      {1, "loss", 5, 0.9},      {1, "loss", 7, 0.8},
                {2, "loss", 10, 0.5},     {2, "accuracy", 10, 0.80}, {2, "loss", 10, 0.4},
                {2, "accuracy", 10, 0.85}, {2, "loss", 20, 0.3},     {2, "accuracy", 20, 0.90}};
    assert_int_equal(n_ev, (int)(sizeof(want) / sizeof(want[0])));
    for (int i = 0; i < n_ev; i++) {
        assert_int_equal(ev[i].w->id, want[i].w);
        assert_string_equal(ev[i].tag, want[i].tag);
        assert_int_equal(ev[i].step, want[i].step);
        assert_true(ev[i].v == want[i].v);
    }
    assert_true(fabs(ev[1].t - num_at(p, 0, 2)) <= 0.0006);
    assert_true(fabs(ev[2].t - num_at(p, 1, 2)) <= 0.0006);
    assert_true(ev[5].t == ev[6].t && fabs(ev[5].t - num_at(e, 0, 3)) <= 0.0006);
    assert_true(fabs(ev[7].t - num_at(e, 1, 3)) <= 0.0006);
    json_decref(j);

    history_set_events(h, NULL, NULL); /* detached: no more */
    history_record(h, 8, 1, 0.7);
    history_record_eval(h, 30, 0.2, 0.95);
    assert_int_equal(n_ev, 9);
    assert_int_equal(history_last_step(h), 8);
}

/* What stays of steps step0, step0 + gap, ... (n of them): the last
 * HISTORY_RECENT, and of the E before them the k-th (0-based) when k % s ==
 * 0, s the smallest power of two with ceil(E / s) <= HISTORY_LONG_SLOTS. */
static int expected_steps(int64_t n, int64_t step0, int64_t gap, int64_t *out)
{
    int64_t e = n > HISTORY_RECENT ? n - HISTORY_RECENT : 0, s = 1;
    while ((e + s - 1) / s > HISTORY_LONG_SLOTS)
        s *= 2;
    int m = 0;
    for (int64_t k = 0; k < e; k += s)
        out[m++] = step0 + gap * k;
    for (int64_t k = e; k < n; k++)
        out[m++] = step0 + gap * k;
    return m;
}

static double loss_of(int64_t step) { return 1.0 + 1.0 / (double)(step + 1); }

static void check_capacity(int64_t n)
{
    struct history *h = history_new();
    assert_non_null(h);
    const int64_t step0 = 7, gap = 3;
    for (int64_t k = 0; k < n; k++) {
        int64_t st = step0 + gap * k;
        history_record(h, st, 1, loss_of(st));
        if (k % 2 == 0)
            history_record_eval(h, st, loss_of(st) / 2, 0.5);
    }
    static int64_t want[HISTORY_RECENT + HISTORY_LONG_SLOTS], want_e[HISTORY_RECENT + HISTORY_LONG_SLOTS];
    int m = expected_steps(n, step0, gap, want);
    int me = expected_steps((n + 1) / 2, step0, 2 * gap, want_e);
    assert_true(m <= HISTORY_RECENT + HISTORY_LONG_SLOTS);
    assert_int_equal(history_last_step(h), step0 + gap * (n - 1));
    json_t *j = answer(h, -1, n);
    json_t *p = points(j), *e = evals(j);
    assert_int_equal(json_array_size(p), m);
    for (int i = 0; i < m; i++) {
        if (step_at(p, i) != want[i])
            fail_msg("n %lld: point %d is step %lld, want %lld", (long long)n, i,
                     (long long)step_at(p, i), (long long)want[i]);
        assert_close(num_at(p, i, 1), loss_of(want[i]));
    }
    assert_int_equal(json_array_size(e), me);
    for (int i = 0; i < me; i++) {
        assert_int_equal(step_at(e, i), want_e[i]);
        assert_close(num_at(e, i, 1), loss_of(want_e[i]) / 2);
    }
    json_decref(j);

    /* since: exactly the expected points after it */
    const int64_t sinces[] = {want[0] - 1, want[0], want[m / 3], want[m / 2] + 1, want[m - 1] - 1,
                              want[m - 1]};
    for (size_t si = 0; si < sizeof(sinces) / sizeof(sinces[0]); si++) {
        int first = 0;
        while (first < m && want[first] <= sinces[si])
            first++;
        j = answer(h, sinces[si], n);
        p = points(j);
        assert_int_equal(json_array_size(p), m - first);
        for (int i = first; i < m; i++)
            assert_int_equal(step_at(p, (size_t)(i - first)), want[i]);
        for (size_t i = 0; i < json_array_size(evals(j)); i++)
            assert_true(step_at(evals(j), i) > sinces[si]);
        json_decref(j);
    }
    j = answer(h, LLONG_MAX, n);
    assert_int_equal(json_array_size(points(j)), 0);
    assert_int_equal(json_array_size(evals(j)), 0);
    json_decref(j);
    history_free(h);
}

static void test_ring_and_decimated_long_history(void **state)
{
    (void)state;
    /* full without eviction; one pushed out; the long history just full;
     * one more (stride 2); several doublings; many */
    const int64_t ns[] = {1, HISTORY_RECENT, HISTORY_RECENT + 1, HISTORY_RECENT + HISTORY_LONG_SLOTS,
                          HISTORY_RECENT + HISTORY_LONG_SLOTS + 1,
                          HISTORY_RECENT + 8 * HISTORY_LONG_SLOTS + 5, 100000};
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++)
        check_capacity(ns[i]);
}

static void test_json_numbers(void **state)
{
    struct history *h = *state;
    const int64_t big = (int64_t)1 << 62;
    history_record(h, big, 1, 3.0e-7);
    history_record(h, big + 1, 1, 1.0 / 3.0);
    history_record_eval(h, big, 1.0e-320, 1.0); /* a subnormal loss */
    json_t *j = answer(h, -1, INT64_MAX);
    assert_int_equal(step_at(points(j), 0), big);
    assert_int_equal(step_at(points(j), 1), big + 1);
    assert_close(num_at(points(j), 0, 1), 3.0e-7);
    assert_close(num_at(points(j), 1, 1), 1.0 / 3.0);
    assert_int_equal(step_at(evals(j), 0), big);
    assert_true(num_at(evals(j), 0, 1) > 0 && num_at(evals(j), 0, 1) < 1e-319);
    assert_true(num_at(evals(j), 0, 2) == 1.0);
    json_decref(j);
    j = answer(h, big, -1);
    assert_int_equal(json_array_size(points(j)), 1);
    assert_int_equal(json_array_size(evals(j)), 0);
    json_decref(j);
}

static void test_steps_per_sec(void **state)
{
    struct history *h = *state;
    int64_t t0 = clk_mono_ms();
    history_record(h, 1, 0, 0.0); /* the first sample: step 1 now */
    history_record(h, 101, 0, 0.0); /* 100 steps later, in less than RATE_SAMPLE_MS */
    history_record(h, 50, 0, 0.0); /* lower: not a sample, the step stays 101 */
    double sps = history_steps_per_sec(h);
    json_t *st = json_object();
    history_status(h, st);
    double sps2 = json_real_value(json_object_get(st, "steps_per_sec"));
    json_decref(st);
    double secs = (double)(clk_mono_ms() - t0) / 1000.0;
    /* 100 steps over at least 1 s: 100/s unless this took longer than that */
    double lo = 100.0 / (secs > 1.0 ? secs + 0.002 : 1.0);
    assert_true(sps <= 100.0 && sps >= lo);
    assert_true(sps2 <= 100.0 && sps2 >= lo);
    assert_int_equal(history_last_step(h), 0); /* no loss: no point */
}

static void test_synthetic_prefill(void **state)
{
    (void)state;
    const int64_t n = 10000;
    setenv("RESTPS_TEST_SYNTHETIC_HISTORY", "10000", 1);
    double t0 = clk_unix_secs();
    struct history *h = history_new();
    double t1 = clk_unix_secs();
    unsetenv("RESTPS_TEST_SYNTHETIC_HISTORY");
    assert_non_null(h);
    assert_int_equal(history_last_step(h), n);
    static int64_t want[HISTORY_RECENT + HISTORY_LONG_SLOTS];
    int m = expected_steps(n, 1, 1, want);
    json_t *j = answer(h, -1, n);
    json_t *p = points(j), *e = evals(j);
    assert_int_equal(json_array_size(p), m);
    double tau = (double)n * 0.15;
    double tn = num_at(p, (size_t)m - 1, 2);
    assert_true(tn >= t0 - 0.0006 && tn <= t1 + 0.0006); /* ending now */
    for (int i = 0; i < m; i++) {
        assert_int_equal(step_at(p, i), want[i]);
        double base = 0.25 + 2.05 * exp(-(double)want[i] / tau);
        double l = num_at(p, i, 1);
        assert_true(l >= base * 0.95 - 1e-9 && l <= base * 1.05 + 1e-9);
        /* one step per millisecond */
        assert_true(fabs(num_at(p, i, 2) - (tn - (double)(n - want[i]) / 1000.0)) <= 0.0015);
    }
    /* an evaluator report every n/50 steps */
    assert_int_equal(json_array_size(e), 50);
    for (int i = 0; i < 50; i++) {
        int64_t s = (int64_t)(i + 1) * (n / 50);
        assert_int_equal(step_at(e, i), s);
        assert_close(num_at(e, i, 1), (0.25 + 2.05 * exp(-(double)s / tau)) * 1.08);
        assert_close(num_at(e, i, 2), 0.95 - 0.85 * exp(-(double)s / tau));
    }
    json_decref(j);
    history_free(h);

    /* out of range or not a number: ignored (logged) */
    const char *bad[] = {"0", "-5", "100000001", "abc", "12x", "99999999999999999999"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        setenv("RESTPS_TEST_SYNTHETIC_HISTORY", bad[i], 1);
        h = history_new();
        unsetenv("RESTPS_TEST_SYNTHETIC_HISTORY");
        assert_non_null(h);
        assert_int_equal(history_last_step(h), 0);
        j = answer(h, -1, 0);
        assert_int_equal(json_array_size(points(j)), 0);
        assert_int_equal(json_array_size(evals(j)), 0);
        json_decref(j);
        history_free(h);
    }
}

/* ---- a writer against readers ---- */

#define WRITES 20000
static atomic_int writer_done;

static void *writer(void *arg)
{
    struct history *h = arg;
    for (int64_t s = 1; s <= WRITES; s++) {
        history_record(h, s, 1, loss_of(s));
        if (s % 10 == 0)
            history_record_eval(h, s, loss_of(s) / 2, 0.5);
    }
    atomic_store(&writer_done, 1);
    return NULL;
}

/* cmocka's asserts belong to the test's thread: a reader counts what it
 * found wrong, the test checks the count */
static atomic_int reader_bad;
static char reader_why[160];

static void reader_fail(const char *why, long long a, long long b)
{
    if (atomic_fetch_add(&reader_bad, 1) == 0)
        snprintf(reader_why, sizeof(reader_why), "%s (%lld, %lld)", why, a, b);
}

static void *reader(void *arg)
{
    struct history *h = arg;
    int64_t last_seen = 0;
    long reads = 0;
    while (!atomic_load(&writer_done) || reads < 2) {
        int64_t ls = history_last_step(h);
        if (ls < last_seen)
            reader_fail("last step went back", (long long)ls, (long long)last_seen);
        size_t len;
        char *text = history_json(h, -1, ls, &len);
        json_t *j = text ? json_loadb(text, len, 0, NULL) : NULL;
        free(text);
        json_t *p = json_object_get(j, "points"), *e = json_object_get(j, "eval");
        if (!json_is_array(p) || !json_is_array(e)) {
            reader_fail("no points or eval array", reads, 0);
            json_decref(j);
            break;
        }
        size_t np = json_array_size(p);
        if (np > HISTORY_RECENT + HISTORY_LONG_SLOTS)
            reader_fail("too many points", (long long)np, 0);
        int64_t prev = 0;
        for (size_t i = 0; i < np; i++) {
            json_t *pt = json_array_get(p, i);
            int64_t s = json_integer_value(json_array_get(pt, 0));
            double l = json_number_value(json_array_get(pt, 1));
            if (json_array_size(pt) != 3 || s <= prev)
                reader_fail("not ascending", (long long)s, (long long)prev);
            if (!(fabs(l - loss_of(s)) <= 6e-10 * loss_of(s)))
                reader_fail("wrong loss at step", (long long)s, 0);
            prev = s;
        }
        if (np) {
            int64_t first = json_integer_value(json_array_get(json_array_get(p, 0), 0));
            if (first != 1)
                reader_fail("the first point went", (long long)first, 0);
            if (prev < ls)
                reader_fail("last point below last step", (long long)prev, (long long)ls);
            last_seen = prev;
        }
        for (size_t i = 0; i < json_array_size(e); i++) {
            int64_t s = json_integer_value(json_array_get(json_array_get(e, i), 0));
            if (s <= 0 || s % 10)
                reader_fail("an eval step not written", (long long)s, 0);
        }
        json_decref(j);
        reads++;
    }
    return NULL;
}

static void test_writer_against_readers(void **state)
{
    struct history *h = *state;
    atomic_store(&writer_done, 0);
    atomic_store(&reader_bad, 0);
    pthread_t w, r[2];
    assert_int_equal(pthread_create(&r[0], NULL, reader, h), 0);
    assert_int_equal(pthread_create(&r[1], NULL, reader, h), 0);
    assert_int_equal(pthread_create(&w, NULL, writer, h), 0);
    pthread_join(w, NULL);
    pthread_join(r[0], NULL);
    pthread_join(r[1], NULL);
    if (atomic_load(&reader_bad))
        fail_msg("%d wrong answers, the first: %s", atomic_load(&reader_bad), reader_why);
    assert_int_equal(history_version(h), WRITES + WRITES / 10);
    assert_int_equal(moves, WRITES + WRITES / 10); /* only the writer moves it */
    assert_int_equal(history_last_step(h), WRITES);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_empty_history, setup, teardown),
        cmocka_unit_test_setup_teardown(test_points_in_order_with_time, setup, teardown),
        cmocka_unit_test_setup_teardown(test_no_loss_or_non_finite_is_not_kept_but_moves_the_feed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_older_step_dropped_same_step_replaces, setup, teardown),
        cmocka_unit_test(test_ring_and_decimated_long_history),
        cmocka_unit_test_setup_teardown(test_json_numbers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_steps_per_sec, setup, teardown),
        cmocka_unit_test(test_synthetic_prefill),
        cmocka_unit_test_setup_teardown(test_writer_against_readers, setup, teardown),
    };
    return cmocka_run_group_tests_name("history", tests, NULL, NULL);
}
