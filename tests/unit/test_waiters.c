/* test_waiters.c - server/waiters.c and server/ticker.c alone: the one list
 * of parked requests (levels stored and read from a function, per channel;
 * deadlines and departed clients through the ticker; park, remove, wake_all,
 * counts) and the ticker's jobs (periods, ticker_at bringing a run forward,
 * also from inside the job). libmicrohttpd's three calls are faked here: a
 * connection is a struct of this file, resumed means counted. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "ticker.h"
#include "waiters.h"

/* ---- fake libmicrohttpd: a connection, its suspends and resumes ---- */

struct MHD_Connection {
    atomic_int suspended, resumed;
    int fd; /* -1: no socket (never looks departed) */
};

void MHD_suspend_connection(struct MHD_Connection *c)
{
    atomic_fetch_add(&c->suspended, 1);
}

void MHD_resume_connection(struct MHD_Connection *c)
{
    atomic_fetch_add(&c->resumed, 1);
}

const union MHD_ConnectionInfo *MHD_get_connection_info(struct MHD_Connection *c,
                                                        enum MHD_ConnectionInfoType t, ...)
{
    static _Thread_local union MHD_ConnectionInfo ci;
    if (t != MHD_CONNECTION_INFO_CONNECTION_FD || c->fd < 0)
        return NULL;
    ci.connect_fd = c->fd;
    return &ci;
}

static void conn_init(struct MHD_Connection *c)
{
    atomic_store(&c->suspended, 0);
    atomic_store(&c->resumed, 0);
    c->fd = -1;
}

static void nap_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Wait up to ms for c to be resumed; 1 when it was. */
static int resumed_within(struct MHD_Connection *c, int ms)
{
    for (int i = 0; i < ms / 5; i++) {
        if (atomic_load(&c->resumed))
            return 1;
        nap_ms(5);
    }
    return atomic_load(&c->resumed) > 0;
}

enum { CH_A, CH_B };

typedef struct fixture {
    ticker *t;
    waiters *w;
} fixture;

static int setup(void **state)
{
    fixture *fx = calloc(1, sizeof(*fx));
    if (!fx || !(fx->t = ticker_new()) || !(fx->w = waiters_new(fx->t)))
        return -1;
    *state = fx;
    return 0;
}

static int teardown(void **state)
{
    fixture *fx = *state;
    ticker_free(fx->t);
    waiters_free(fx->w);
    free(fx);
    return 0;
}

static int64_t far(void) { return clk_mono_ms() + 60000; }

static void test_stored_level(void **state)
{
    fixture *fx = *state;
    struct MHD_Connection a, b, c;
    conn_init(&a);
    conn_init(&b);
    conn_init(&c);
    int fa = 0, fb = 0, fc = 0;
    waiters_add(fx->w, CH_A, &a, 5, far(), &fa);
    waiters_add(fx->w, CH_A, &b, 7, far(), &fb);
    waiters_add(fx->w, CH_B, &c, 1, far(), &fc); /* another channel */
    assert_int_equal(waiters_count(fx->w, CH_A), 2);
    assert_int_equal(waiters_count(fx->w, CH_B), 1);
    waiters_raise(fx->w, CH_A, 4);
    assert_int_equal(atomic_load(&a.resumed) + fa, 0);
    waiters_raise(fx->w, CH_A, 6); /* a's mark, not b's */
    assert_int_equal(atomic_load(&a.resumed), 1);
    assert_int_equal(fa, 1);
    assert_int_equal(atomic_load(&b.resumed) + fb, 0);
    waiters_raise(fx->w, CH_A, 3); /* never down: b still waits, a new wait for 6 does not */
    int fd = 0;
    struct MHD_Connection d;
    conn_init(&d);
    waiters_add(fx->w, CH_A, &d, 6, far(), &fd);
    assert_int_equal(atomic_load(&d.resumed), 1);
    assert_int_equal(fd, 1);
    assert_int_equal(waiters_count(fx->w, CH_A), 1);
    assert_int_equal(atomic_load(&c.resumed), 0); /* CH_B never moved */
    waiters_raise(fx->w, CH_A, 7);
    assert_int_equal(fb, 1);
    waiters_raise(fx->w, CH_B, 1);
    assert_int_equal(fc, 1);
    assert_int_equal(waiters_count(fx->w, CH_A) + waiters_count(fx->w, CH_B), 0);
    /* each resumed exactly once */
    assert_int_equal(atomic_load(&a.resumed) + atomic_load(&b.resumed) + atomic_load(&c.resumed), 3);
}

static int64_t level_now;
static int level_reads;
static int64_t read_level(void *arg)
{
    (void)arg;
    level_reads++;
    return level_now;
}

static void test_level_from_a_function(void **state)
{
    fixture *fx = *state;
    level_now = 3;
    level_reads = 0;
    waiters_level_from(fx->w, CH_B, read_level, NULL);
    struct MHD_Connection a;
    conn_init(&a);
    int fa = 0;
    waiters_add(fx->w, CH_B, &a, 4, far(), &fa);
    assert_int_equal(fa, 0);
    level_now = 2; /* it may go down (a worker rejoined) */
    waiters_changed(fx->w, CH_B);
    assert_int_equal(fa, 0);
    level_now = 4;
    assert_int_equal(fa, 0); /* not read until told */
    int before = level_reads;
    waiters_changed(fx->w, CH_B);
    assert_true(level_reads > before);
    assert_int_equal(fa, 1);
    assert_int_equal(atomic_load(&a.resumed), 1);
    /* a new wait reads the level afresh: 2 now, so a wait for 3 parks */
    level_now = 2;
    struct MHD_Connection b;
    conn_init(&b);
    int fb = 0;
    waiters_add(fx->w, CH_B, &b, 3, far(), &fb);
    assert_int_equal(fb, 0);
    assert_int_equal(waiters_count(fx->w, CH_B), 1);
    waiters_wake_all(fx->w);
    assert_int_equal(fb, 1);
}

static void test_deadline_through_the_ticker(void **state)
{
    fixture *fx = *state;
    struct MHD_Connection a, b;
    conn_init(&a);
    conn_init(&b);
    int fa = 0, fb = 0;
    int64_t t0 = clk_mono_ms();
    waiters_add(fx->w, CH_A, &a, 100, far(), &fa);    /* a long deadline first */
    waiters_add(fx->w, CH_A, &b, 100, t0 + 80, &fb); /* then a sooner one: the ticker is told */
    assert_true(resumed_within(&b, 2000));
    int64_t took = clk_mono_ms() - t0;
    assert_true(took >= 80);
    assert_true(took < 1500);
    assert_int_equal(fb, 1);
    assert_int_equal(atomic_load(&a.resumed), 0);
    assert_int_equal(waiters_count(fx->w, CH_A), 1);
}

static void test_park_and_remove(void **state)
{
    fixture *fx = *state;
    struct MHD_Connection a;
    conn_init(&a);
    waiters_raise(fx->w, CH_A, 5);
    /* there already, or the deadline passed: not parked, not suspended */
    assert_int_equal(waiters_park(fx->w, CH_A, &a, 5, far()), 0);
    assert_int_equal(waiters_park(fx->w, CH_A, &a, 9, clk_mono_ms() - 1), 0);
    assert_int_equal(atomic_load(&a.suspended), 0);
    /* parked: suspended by waiters_park, resumed by the level */
    assert_int_equal(waiters_park(fx->w, CH_A, &a, 6, far()), 1);
    assert_int_equal(atomic_load(&a.suspended), 1);
    assert_int_equal(waiters_count(fx->w, CH_A), 1);
    waiters_raise(fx->w, CH_A, 6);
    assert_int_equal(atomic_load(&a.resumed), 1);
    /* INT64_MAX: only the deadline ends it */
    struct MHD_Connection b;
    conn_init(&b);
    assert_int_equal(waiters_park(fx->w, CH_A, &b, INT64_MAX, clk_mono_ms() + 60), 1);
    waiters_raise(fx->w, CH_A, 1000);
    assert_int_equal(atomic_load(&b.resumed), 0);
    assert_true(resumed_within(&b, 2000));
    /* a connection closed while parked is forgotten, not resumed */
    struct MHD_Connection c;
    conn_init(&c);
    int fc = 0;
    waiters_add(fx->w, CH_B, &c, 1, far(), &fc);
    waiters_remove(fx->w, &c);
    assert_int_equal(waiters_count(fx->w, CH_B), 0);
    waiters_raise(fx->w, CH_B, 1);
    assert_int_equal(atomic_load(&c.resumed) + fc, 0);
}

static void test_wake_all(void **state)
{
    fixture *fx = *state;
    struct MHD_Connection c[3];
    int f[3] = {0};
    for (int i = 0; i < 3; i++)
        conn_init(&c[i]);
    waiters_add(fx->w, CH_A, &c[0], 10, far(), &f[0]);
    waiters_add(fx->w, CH_B, &c[1], 10, far(), &f[1]);
    assert_int_equal(waiters_park(fx->w, CH_A, &c[2], 10, far()), 1);
    assert_int_equal(waiters_stopping(fx->w), 0);
    assert_int_equal(waiters_wake_all(fx->w), 3);
    assert_int_equal(waiters_stopping(fx->w), 1);
    for (int i = 0; i < 3; i++)
        assert_int_equal(atomic_load(&c[i].resumed), 1);
    assert_int_equal(f[0] + f[1], 2);
    /* from now on nobody is parked */
    struct MHD_Connection d;
    conn_init(&d);
    int fd = 0;
    waiters_add(fx->w, CH_A, &d, 10, far(), &fd);
    assert_int_equal(fd, 1);
    assert_int_equal(waiters_park(fx->w, CH_A, &d, 10, far()), 0);
    assert_int_equal(waiters_count(fx->w, CH_A), 0);
}

static void test_departed_client(void **state)
{
    fixture *fx = *state;
    int sv[2], tv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, tv), 0);
    struct MHD_Connection gone, stays, stream;
    conn_init(&gone);
    conn_init(&stays);
    conn_init(&stream);
    gone.fd = sv[0];
    stays.fd = tv[0];
    stream.fd = sv[0]; /* a parked stream is not watched: its next write finds out */
    int fg = 0, fs = 0;
    waiters_add(fx->w, CH_A, &gone, 10, far(), &fg);
    waiters_add(fx->w, CH_A, &stays, 10, far(), &fs);
    assert_int_equal(waiters_park(fx->w, CH_A, &stream, 10, far()), 1);
    close(sv[1]); /* gone's client hangs up */
    assert_true(resumed_within(&gone, 3000)); /* about once a second */
    assert_int_equal(fg, 1);
    nap_ms(50);
    assert_int_equal(atomic_load(&stays.resumed), 0);
    assert_int_equal(atomic_load(&stream.resumed), 0);
    assert_int_equal(waiters_count(fx->w, CH_A), 2);
    waiters_wake_all(fx->w);
    close(sv[0]);
    close(tv[0]);
    close(tv[1]);
}

/* ---- the ticker alone ---- */

typedef struct counter {
    atomic_int runs;
    int64_t period;
    ticker *t;
    int self_id, ask_self; /* ask_self: the job asks for itself again at once, once */
} counter;

static int64_t count_job(void *arg, int64_t now)
{
    counter *c = arg;
    int n = atomic_fetch_add(&c->runs, 1) + 1;
    if (c->ask_self && n == 1)
        ticker_at(c->t, c->self_id, now); /* from inside: kept over what it returns */
    return c->period ? now + c->period : TICKER_IDLE;
}

static void test_ticker_periods_and_at(void **state)
{
    (void)state;
    ticker *t = ticker_new();
    assert_non_null(t);
    counter every = {.period = 20}, idle = {.period = 0}, self = {.period = 0};
    int64_t now = clk_mono_ms();
    assert_true(ticker_add(t, count_job, &every, now) >= 0);
    int id = ticker_add(t, count_job, &idle, TICKER_IDLE);
    assert_true(id >= 0);
    self.t = t;
    self.ask_self = 1;
    self.self_id = ticker_add(t, count_job, &self, now);
    nap_ms(300);
    int n = atomic_load(&every.runs);
    assert_true(n >= 3);  /* every 20 ms: ~15 in 300 ms, 3 on a loaded machine */
    assert_true(n <= 16);
    assert_int_equal(atomic_load(&idle.runs), 0); /* never asked */
    assert_int_equal(atomic_load(&self.runs), 2); /* once, and once more as it asked */
    ticker_at(t, id, clk_mono_ms());
    for (int i = 0; i < 400 && !atomic_load(&idle.runs); i++)
        nap_ms(5);
    assert_int_equal(atomic_load(&idle.runs), 1);
    ticker_at(t, id, clk_mono_ms() + 60000); /* later than planned (idle): stands */
    ticker_at(t, id, TICKER_IDLE);
    nap_ms(30);
    assert_int_equal(atomic_load(&idle.runs), 1);
    ticker_free(t);
    int after = atomic_load(&every.runs);
    nap_ms(60);
    assert_int_equal(atomic_load(&every.runs), after); /* stopped */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_stored_level, setup, teardown),
        cmocka_unit_test_setup_teardown(test_level_from_a_function, setup, teardown),
        cmocka_unit_test_setup_teardown(test_deadline_through_the_ticker, setup, teardown),
        cmocka_unit_test_setup_teardown(test_park_and_remove, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wake_all, setup, teardown),
        cmocka_unit_test_setup_teardown(test_departed_client, setup, teardown),
        cmocka_unit_test(test_ticker_periods_and_at),
    };
    return cmocka_run_group_tests_name("waiters", tests, NULL, NULL);
}
