/* test_retry.c - libps's retry policy (client/transfer.c) against a fake
 * server: a thread on a loopback socket that answers each request as a
 * script says (a status and body, or a connection closed without an answer,
 * or a body cut short) and records what it was sent. What is retried (network
 * errors and 503 for idempotent requests; only a connection never made for
 * the others), how often (retries, retry_ms), how long it waits (backoff,
 * doubled, capped), what an abort stops, and that a retried request sends the
 * same body and its answer lands in the caller's buffer from the start. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fake_ps.h"
#include "libps/libps.h"

enum { ANSWER, CLOSE, PARTIAL };

typedef struct reply {
    int what;
    int status;
    const char *body;    /* JSON or raw bytes */
    const char *headers; /* extra header lines, each ending \r\n (may be NULL) */
} reply;

#define MAX_REQ 32
typedef struct fake {
    fake_ps ps; /* the socket and the thread (fake_ps.h) */
    const reply *script;
    int n_script;        /* past the end: the last entry again */
    pthread_mutex_t mu;
    int served;
    char req[MAX_REQ][512]; /* request line */
    char body[MAX_REQ][512];
    size_t body_len[MAX_REQ];
    double at_ms[MAX_REQ];  /* arrival, ms since fake_start */
    struct timespec t0;
} fake;

static double ms_since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

/* One request on a fresh connection: read the head and a Content-Length
 * body, record them, answer as the script says, close. */
static void serve_one(void *arg, int c)
{
    fake *f = arg;
    char buf[8192];
    size_t len = 0;
    char *end = NULL;
    while (!end && len < sizeof(buf) - 1) {
        ssize_t k = recv(c, buf + len, sizeof(buf) - 1 - len, 0);
        if (k <= 0)
            return;
        len += (size_t)k;
        buf[len] = '\0';
        end = strstr(buf, "\r\n\r\n");
    }
    if (!end)
        return;
    size_t head = (size_t)(end + 4 - buf), want = 0;
    for (char *h = strcasestr(buf, "\r\ncontent-length:"); h && h < end; h = NULL)
        want = strtoull(h + 17, NULL, 10);
    while (len - head < want && len < sizeof(buf) - 1) {
        ssize_t k = recv(c, buf + len, sizeof(buf) - 1 - len, 0);
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    pthread_mutex_lock(&f->mu);
    int i = f->served < MAX_REQ ? f->served : MAX_REQ - 1;
    const reply *r = &f->script[f->served < f->n_script ? f->served : f->n_script - 1];
    size_t line = (size_t)(strstr(buf, "\r\n") - buf);
    snprintf(f->req[i], sizeof(f->req[i]), "%.*s", (int)line, buf);
    f->body_len[i] = len - head < sizeof(f->body[i]) ? len - head : sizeof(f->body[i]);
    memcpy(f->body[i], buf + head, f->body_len[i]);
    f->at_ms[i] = ms_since(&f->t0);
    f->served++;
    pthread_mutex_unlock(&f->mu);
    if (r->what == CLOSE)
        return;
    size_t blen = strlen(r->body);
    char hdr[1024];
    int hl = snprintf(hdr, sizeof(hdr),
                      "HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                      "%sConnection: close\r\n\r\n",
                      r->status, blen, r->headers ? r->headers : "");
    fake_ps_send_all(c, hdr, (size_t)hl);
    fake_ps_send_all(c, r->body, r->what == PARTIAL ? blen / 2 : blen);
}

/* A fake ps on 127.0.0.1:<free port>; listening now, or (listening = 0)
 * refusing connections until fake_listen. */
static fake *fake_start(const reply *script, int n, int listening)
{
    fake *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    f->script = script;
    f->n_script = n;
    pthread_mutex_init(&f->mu, NULL);
    clock_gettime(CLOCK_MONOTONIC, &f->t0);
    fake_ps_start(&f->ps, 0, listening, serve_one, f);
    return f;
}

static void fake_listen(fake *f) { fake_ps_listen(&f->ps); }

static int fake_served(fake *f)
{
    pthread_mutex_lock(&f->mu);
    int n = f->served;
    pthread_mutex_unlock(&f->mu);
    return n;
}

static void fake_stop(fake *f)
{
    fake_ps_stop(&f->ps);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

static ps_client *client_for(fake **fs, int n, const ps_options *opt)
{
    int ports[4];
    for (int i = 0; i < n; i++)
        ports[i] = fs[i]->ps.port;
    return fake_ps_client(ports, n, opt);
}

/* short waits so the tests are quick; retries as given */
static ps_options quick(int retries)
{
    return (ps_options){.retries = retries, .backoff_ms = 10, .backoff_max_ms = 20,
                        .timeout_ms = 5000, .connect_timeout_ms = 2000};
}

static const reply R503 = {ANSWER, 503, "{\"error\":\"restoring a checkpoint\"}", NULL};
static const reply R200 = {ANSWER, 200, "{\"ok\":1}", NULL};

/* POST {"x":1} through ps_json; returns its rc, *out the answer (or NULL). */
static int post(ps_client *c, int idempotent, json_t **out)
{
    json_t *body = json_pack("{s:i}", "x", 1);
    *out = NULL;
    int rc = ps_json(c, 0, "POST", "/v1/thing", body, idempotent, out);
    json_decref(body);
    return rc;
}

static void test_idempotent_503_is_retried_with_the_same_body(void **state)
{
    (void)state;
    const reply script[] = {R503, R503, R200};
    fake *f = fake_start(script, 3, 1);
    ps_options o = quick(3);
    ps_client *c = client_for(&f, 1, &o);
    json_t *out;
    assert_int_equal(post(c, 1, &out), PS_OK);
    assert_int_equal(json_integer_value(json_object_get(out, "ok")), 1);
    assert_int_equal(ps_http_status(c), 200);
    json_decref(out);
    assert_int_equal(fake_served(f), 3);
    for (int i = 0; i < 3; i++) {
        assert_string_equal(f->req[i], "POST /v1/thing HTTP/1.1");
        assert_int_equal(f->body_len[i], 7);
        assert_memory_equal(f->body[i], "{\"x\":1}", 7);
    }
    ps_client_free(c);
    fake_stop(f);
}

static void test_retries_bound_the_tries_and_the_last_error_is_reported(void **state)
{
    (void)state;
    const reply script[] = {R503};
    fake *f = fake_start(script, 1, 1);
    ps_options o = quick(1);
    ps_client *c = client_for(&f, 1, &o);
    json_t *out;
    assert_int_equal(post(c, 1, &out), PS_EHTTP);
    assert_null(out);
    assert_int_equal(fake_served(f), 2); /* the first try and one retry */
    assert_int_equal(ps_http_status(c), 503);
    assert_non_null(strstr(ps_error(c), "HTTP 503"));
    assert_non_null(strstr(ps_error(c), "restoring a checkpoint")); /* the server's own words */
    assert_non_null(strstr(ps_error(c), "ps 0 (127.0.0.1:"));
    ps_client_free(c);
    fake_stop(f);
}

static void test_a_request_that_is_not_idempotent_is_not_retried_after_an_answer(void **state)
{
    (void)state;
    const reply script[] = {R503, R200};
    fake *f = fake_start(script, 2, 1);
    ps_options o = quick(3);
    ps_client *c = client_for(&f, 1, &o);
    json_t *out;
    assert_int_equal(post(c, 0, &out), PS_EHTTP);
    assert_int_equal(fake_served(f), 1);
    assert_int_equal(ps_http_status(c), 503);
    ps_client_free(c);
    fake_stop(f);
}

static void test_other_statuses_are_never_retried(void **state)
{
    (void)state;
    const int statuses[] = {400, 404, 409, 500};
    for (size_t k = 0; k < sizeof(statuses) / sizeof(statuses[0]); k++) {
        const reply script[] = {{ANSWER, statuses[k], "{\"error\":\"no such thing\"}", NULL}, R200};
        fake *f = fake_start(script, 2, 1);
        ps_options o = quick(3);
        ps_client *c = client_for(&f, 1, &o);
        json_t *out;
        assert_int_equal(post(c, 1, &out), PS_EHTTP);
        assert_int_equal(fake_served(f), 1);
        assert_int_equal(ps_http_status(c), statuses[k]);
        assert_non_null(strstr(ps_error(c), "no such thing"));
        ps_client_free(c);
        fake_stop(f);
    }
}

/* The server read the request and closed without answering: it may have
 * applied it, so only an idempotent request goes again. */
static void test_a_lost_answer_is_retried_only_when_idempotent(void **state)
{
    (void)state;
    const reply script[] = {{CLOSE, 0, "", NULL}, R200};
    for (int idem = 0; idem <= 1; idem++) {
        fake *f = fake_start(script, 2, 1);
        ps_options o = quick(3);
        ps_client *c = client_for(&f, 1, &o);
        json_t *out;
        int rc = post(c, idem, &out);
        if (idem) {
            assert_int_equal(rc, PS_OK);
            assert_int_equal(fake_served(f), 2);
            json_decref(out);
        } else {
            assert_int_equal(rc, PS_ENET);
            assert_int_equal(fake_served(f), 1);
            assert_int_equal(ps_http_status(c), 0);
        }
        ps_client_free(c);
        fake_stop(f);
    }
}

/* A push with an id is idempotent (psd drops the duplicate): its lost answer
 * is retried with the same id and the same bytes; without an id it is not. */
static void test_a_push_id_makes_a_push_retriable(void **state)
{
    (void)state;
    const reply script[] = {{CLOSE, 0, "", NULL}, {ANSWER, 200, "{\"global_step\":7}", NULL}};
    const char head[] = "HEAD", data[] = "0123456789";
    for (int with_id = 0; with_id <= 1; with_id++) {
        fake *f = fake_start(script, 2, 1);
        ps_options o = quick(3);
        ps_client *c = client_for(&f, 1, &o);
        int64_t step = -1;
        int dup = -1;
        int rc = ps_push_grads(c, 0, head, 4, data, 10, with_id ? "w0-s6" : NULL, &step, &dup);
        if (with_id) {
            assert_int_equal(rc, PS_OK);
            assert_int_equal(step, 7);
            assert_int_equal(dup, 0);
            assert_int_equal(fake_served(f), 2);
            for (int i = 0; i < 2; i++) {
                assert_int_equal(f->body_len[i], 14);
                assert_memory_equal(f->body[i], "HEAD0123456789", 14);
            }
        } else {
            assert_int_equal(rc, PS_ENET);
            assert_int_equal(fake_served(f), 1);
        }
        ps_client_free(c);
        fake_stop(f);
    }
}

static void *listen_later(void *arg)
{
    usleep(300 * 1000);
    fake_listen(arg);
    return NULL;
}

/* A connection never made applied nothing: retried for every request, and
 * for retry_ms in all (a ps restarting) even past `retries`. */
static void test_a_refused_connection_is_retried_for_retry_ms(void **state)
{
    (void)state;
    const reply script[] = {R200};
    fake *f = fake_start(script, 1, 0);
    ps_options o = quick(0);
    o.retry_ms = 20000;
    ps_client *c = client_for(&f, 1, &o);
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    pthread_t lt; /* the fake starts listening 300 ms from now */
    assert_int_equal(pthread_create(&lt, NULL, listen_later, f), 0);
    json_t *out;
    assert_int_equal(post(c, 0, &out), PS_OK); /* not idempotent, yet retried: nothing was sent */
    json_decref(out);
    pthread_join(lt, NULL);
    assert_true(ms_since(&t) >= 300);
    assert_int_equal(fake_served(f), 1);
    ps_client_free(c);
    fake_stop(f);
}

static void test_without_retry_ms_a_refused_connection_fails_after_the_retries(void **state)
{
    (void)state;
    const reply script[] = {R200};
    fake *f = fake_start(script, 1, 0);
    ps_options o = quick(2);
    o.backoff_ms = 40;
    o.backoff_max_ms = 1000;
    ps_client *c = client_for(&f, 1, &o);
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    json_t *out;
    assert_int_equal(post(c, 1, &out), PS_ENET);
    /* two waits: [20, 40] then [40, 80] ms */
    assert_true(ms_since(&t) >= 60);
    assert_non_null(strstr(ps_error(c), "ps 0 (127.0.0.1:"));
    assert_int_equal(fake_served(f), 0);
    ps_client_free(c);
    fake_stop(f);
}

/* The waits double from backoff_ms, each drawn from [w/2, w], and never grow
 * past backoff_max_ms. */
static void test_backoff_doubles_with_jitter_and_stops_at_the_cap(void **state)
{
    (void)state;
    const reply script[] = {R503};
    fake *f = fake_start(script, 1, 1);
    ps_options o = quick(6);
    o.backoff_ms = 20;
    o.backoff_max_ms = 80;
    ps_client *c = client_for(&f, 1, &o);
    json_t *out;
    assert_int_equal(post(c, 1, &out), PS_EHTTP);
    assert_int_equal(fake_served(f), 7);
    const double lo[] = {10, 20, 40, 40, 40, 40}; /* w/2 of 20, 40, 80, then 80 (capped) */
    for (int i = 0; i < 6; i++) {
        double gap = f->at_ms[i + 1] - f->at_ms[i];
        if (gap < lo[i])
            fail_msg("wait %d was %.1f ms, under %.0f", i, gap, lo[i]);
    }
    /* uncapped, the last wait would be drawn from [320, 640] ms */
    double last = f->at_ms[6] - f->at_ms[5];
    if (last >= 250)
        fail_msg("the last wait took %.1f ms: the cap of 80 did not hold", last);
    ps_client_free(c);
    fake_stop(f);
}

static int abort_now(void) { return 1; }

static void test_an_abort_stops_the_retries(void **state)
{
    (void)state;
    const reply script[] = {R503};
    fake *f = fake_start(script, 1, 1);
    ps_options o = quick(5);
    o.retry_ms = 60000;
    ps_client *c = client_for(&f, 1, &o);
    ps_set_abort(c, abort_now);
    json_t *out;
    assert_int_not_equal(post(c, 1, &out), PS_OK);
    assert_true(fake_served(f) <= 1);
    ps_client_free(c);
    fake_stop(f);
}

/* A body cut short is a network error: the pull goes again and the second
 * answer lands at the start of the caller's buffer, not after the first's
 * bytes. */
static void test_a_cut_body_is_pulled_again_into_the_same_place(void **state)
{
    (void)state;
    const reply script[] = {{PARTIAL, 200, "AAAAAAAAAAAAAAAAAAAA", "X-Global-Step: 3\r\n"},
                            {ANSWER, 200, "BBBBBBBBBBBBBBBBBBBB", "X-Global-Step: 4\r\n"}};
    fake *f = fake_start(script, 2, 1);
    ps_options o = quick(3);
    ps_client *c = client_for(&f, 1, &o);
    char buf[64];
    memset(buf, 'z', sizeof(buf));
    size_t len = 0;
    int64_t step = -1;
    assert_int_equal(ps_pull_params(c, 0, buf, sizeof(buf), &len, &step), PS_OK);
    assert_int_equal(len, 20);
    assert_int_equal(step, 4);
    assert_memory_equal(buf, "BBBBBBBBBBBBBBBBBBBB", 20);
    assert_int_equal(buf[20], 'z');
    assert_int_equal(fake_served(f), 2);
    ps_client_free(c);
    fake_stop(f);
}

/* Several shards at once: only the one that failed goes again. */
static void test_a_batch_retries_only_the_shard_that_failed(void **state)
{
    (void)state;
    const reply ok[] = {{ANSWER, 200, "0123", "X-Global-Step: 5\r\n"}};
    const reply flaky[] = {R503, {ANSWER, 200, "4567", "X-Global-Step: 5\r\n"}};
    fake *fs[2] = {fake_start(ok, 1, 1), fake_start(flaky, 2, 1)};
    ps_options o = quick(3);
    ps_client *c = client_for(fs, 2, &o);
    char b0[16], b1[16];
    ps_pull_req r[2] = {{.shard = 0, .min_step = -1, .worker = -1, .buf = b0, .cap = sizeof(b0)},
                        {.shard = 1, .min_step = -1, .worker = -1, .buf = b1, .cap = sizeof(b1)}};
    assert_int_equal(ps_pull_params_many(c, r, 2), PS_OK);
    assert_int_equal(fake_served(fs[0]), 1);
    assert_int_equal(fake_served(fs[1]), 2);
    assert_int_equal(r[0].len, 4);
    assert_int_equal(r[1].len, 4);
    assert_memory_equal(b0, "0123", 4);
    assert_memory_equal(b1, "4567", 4);
    assert_int_equal(r[1].global_step, 5);
    ps_client_free(c);
    fake_stop(fs[0]);
    fake_stop(fs[1]);
}

/* A failure in a batch names the first failing shard in the order given. */
static void test_a_batch_reports_the_first_failing_shard(void **state)
{
    (void)state;
    const reply ok[] = {{ANSWER, 200, "0123", "X-Global-Step: 5\r\n"}};
    const reply conflict[] = {{ANSWER, 409, "{\"error\":\"conflict here\"}", NULL}};
    const reply gone[] = {{ANSWER, 404, "{\"error\":\"gone\"}", NULL}};
    fake *fs[3] = {fake_start(ok, 1, 1), fake_start(conflict, 1, 1), fake_start(gone, 1, 1)};
    ps_options o = quick(3);
    ps_client *c = client_for(fs, 3, &o);
    char b[3][16];
    ps_pull_req r[3];
    for (int i = 0; i < 3; i++)
        r[i] = (ps_pull_req){.shard = i, .min_step = -1, .worker = -1, .buf = b[i], .cap = 16};
    assert_int_equal(ps_pull_params_many(c, r, 3), PS_EHTTP);
    assert_int_equal(ps_http_status(c), 409);
    assert_non_null(strstr(ps_error(c), "ps 1 ("));
    assert_non_null(strstr(ps_error(c), "conflict here"));
    for (int i = 0; i < 3; i++) {
        assert_int_equal(fake_served(fs[i]), 1);
        fake_stop(fs[i]);
    }
    ps_client_free(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_idempotent_503_is_retried_with_the_same_body),
        cmocka_unit_test(test_retries_bound_the_tries_and_the_last_error_is_reported),
        cmocka_unit_test(test_a_request_that_is_not_idempotent_is_not_retried_after_an_answer),
        cmocka_unit_test(test_other_statuses_are_never_retried),
        cmocka_unit_test(test_a_lost_answer_is_retried_only_when_idempotent),
        cmocka_unit_test(test_a_push_id_makes_a_push_retriable),
        cmocka_unit_test(test_a_refused_connection_is_retried_for_retry_ms),
        cmocka_unit_test(test_without_retry_ms_a_refused_connection_fails_after_the_retries),
        cmocka_unit_test(test_backoff_doubles_with_jitter_and_stops_at_the_cap),
        cmocka_unit_test(test_an_abort_stops_the_retries),
        cmocka_unit_test(test_a_cut_body_is_pulled_again_into_the_same_place),
        cmocka_unit_test(test_a_batch_retries_only_the_shard_that_failed),
        cmocka_unit_test(test_a_batch_reports_the_first_failing_shard),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
