/* test_while_waiting.c - ps_set_while_waiting (client/transfer.c): the work a
 * caller gives to do while a push's answer is awaited, against a fake ps (a
 * thread on a loopback socket that reads a whole request, checks its body
 * against the bytes the test sent, notes when it had the last byte, waits
 * ANSWER_DELAY_MS and answers). The work runs once, after the server could
 * have the whole body and before the answer came; the request's body and
 * answer are what they are without it; it is one-shot; a GET does not use
 * it; a push whose connection was refused never calls it; a batch of
 * several shards (one after the other, and at once over the multi
 * interface) calls it once, after the last body. */
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

#define ANSWER_DELAY_MS 150

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

typedef struct fake {
    fake_ps ps; /* the socket and the thread (fake_ps.h) */
    const unsigned char *want; /* the body a POST must carry (head + data) */
    size_t want_len;
    pthread_mutex_t mu;
    int served, bodies_ok;
    size_t received; /* body bytes read so far, all requests */
    double got_body_ms[8]; /* when the last body byte came */
    double answered_ms[8]; /* when the answer went out */
} fake;

/* Requests on one keep-alive connection until the client closes it. */
static void serve(void *arg, int c)
{
    fake *f = arg;
    size_t cap = f->want_len + 65536, len = 0;
    unsigned char *buf = malloc(cap + 1);
    assert_non_null(buf);
    for (;;) {
        char *end = NULL;
        while (!end) {
            ssize_t k = recv(c, buf + len, cap - len, 0);
            if (k <= 0)
                goto out;
            len += (size_t)k;
            buf[len] = '\0';
            end = strstr((char *)buf, "\r\n\r\n");
        }
        size_t head = (size_t)((unsigned char *)end + 4 - buf), want = 0;
        char *cl = strcasestr((char *)buf, "\r\ncontent-length:");
        if (cl && cl < end)
            want = strtoull(cl + 17, NULL, 10);
        pthread_mutex_lock(&f->mu);
        f->received += len - head < want ? len - head : want;
        pthread_mutex_unlock(&f->mu);
        while (len - head < want) {
            ssize_t k = recv(c, buf + len, cap - len, 0);
            if (k <= 0)
                goto out;
            len += (size_t)k;
            pthread_mutex_lock(&f->mu);
            f->received += (size_t)k;
            pthread_mutex_unlock(&f->mu);
        }
        double got = now_ms();
        int is_post = strncmp((char *)buf, "POST ", 5) == 0;
        pthread_mutex_lock(&f->mu);
        int i = f->served < 8 ? f->served : 7;
        f->got_body_ms[i] = got;
        if (is_post && want == f->want_len && memcmp(buf + head, f->want, want) == 0)
            f->bodies_ok++;
        pthread_mutex_unlock(&f->mu);
        usleep(ANSWER_DELAY_MS * 1000);
        char hdr[256], body[128];
        int bl, hl;
        if (is_post) {
            bl = snprintf(body, sizeof(body), "{\"global_step\":%d,\"duplicate\":false,\"outcome\":\"applied\"}",
                          i + 1);
            hl = snprintf(hdr, sizeof(hdr), "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                            "Content-Length: %d\r\n\r\n", bl);
        } else {
            bl = 8;
            memcpy(body, "\0\0\0\0\0\0\0\0", 8);
            hl = snprintf(hdr, sizeof(hdr), "HTTP/1.1 200 OK\r\nX-Global-Step: 7\r\nContent-Length: 8\r\n\r\n");
        }
        pthread_mutex_lock(&f->mu);
        f->answered_ms[i] = now_ms();
        f->served++;
        pthread_mutex_unlock(&f->mu);
        fake_ps_send_all(c, hdr, (size_t)hl);
        fake_ps_send_all(c, body, (size_t)bl);
        memmove(buf, buf + head + want, len - head - want);
        len -= head + want;
    }
out:
    free(buf);
}

static void fake_listen(fake *f) { fake_ps_listen(&f->ps); }

static fake *fake_start(const unsigned char *want, size_t want_len, int listening)
{
    fake *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    f->want = want;
    f->want_len = want_len;
    pthread_mutex_init(&f->mu, NULL);
    /* a small receive buffer (the kernel doubles it), inherited by accept */
    fake_ps_start(&f->ps, 64 << 10, listening, serve, f);
    return f;
}

static void fake_stop(fake *f)
{
    fake_ps_stop(&f->ps);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

static ps_client *client_for(fake **fs, int n)
{
    int ports[4];
    for (int i = 0; i < n; i++)
        ports[i] = fs[i]->ps.port;
    ps_options opt = {.retries = 0, .backoff_ms = 10, .timeout_ms = 10000, .connect_timeout_ms = 2000};
    return fake_ps_client(ports, n, &opt);
}

/* What the work saw: how often it ran, when, and what the fakes had by then. */
typedef struct seen {
    int calls;
    double at_ms;
    fake **fs;
    int n;
    int answered_before; /* answers the fakes had sent when the work ran */
    size_t received_before; /* body bytes the fakes had read by then */
} seen;

static void work(void *arg)
{
    seen *s = arg;
    s->calls++;
    s->at_ms = now_ms();
    for (int i = 0; i < s->n; i++) {
        pthread_mutex_lock(&s->fs[i]->mu);
        s->answered_before += s->fs[i]->served;
        s->received_before += s->fs[i]->received;
        pthread_mutex_unlock(&s->fs[i]->mu);
    }
}

/* head + data: a 24-byte "header" and `floats` floats of a pattern. */
typedef struct body {
    unsigned char *all;
    size_t head_len, data_len;
} body;

static body body_make(size_t floats)
{
    body b = {.head_len = 24, .data_len = floats * sizeof(float)};
    b.all = malloc(b.head_len + b.data_len);
    assert_non_null(b.all);
    for (size_t i = 0; i < b.head_len + b.data_len; i++)
        b.all[i] = (unsigned char)(i * 131 + 7);
    return b;
}

static int push(ps_client *c, int shard, const body *b, int64_t *step)
{
    return ps_push_grads(c, shard, b->all, b->head_len, b->all + b->head_len, b->data_len, "t0-1-1", step,
                         NULL);
}

static void test_the_work_runs_once_between_the_body_and_the_answer(void **state)
{
    (void)state;
    body b = body_make(80000); /* the example's gradients: 320 KB */
    fake *f = fake_start(b.all, b.head_len + b.data_len, 1);
    ps_client *c = client_for(&f, 1);
    seen s = {.fs = &f, .n = 1};
    ps_set_while_waiting(c, work, &s);
    double t0 = now_ms();
    int64_t step = 0;
    assert_int_equal(push(c, 0, &b, &step), PS_OK);
    double t1 = now_ms();
    assert_int_equal(s.calls, 1);
    assert_int_equal(step, 1);                    /* the answer, parsed as without the work */
    assert_int_equal(f->bodies_ok, 1);            /* the body, byte for byte */
    assert_int_equal(s.answered_before, 0);       /* before the answer went out */
    assert_true(s.at_ms < f->answered_ms[0]);
    assert_true(s.at_ms >= t0 && s.at_ms <= t1);
    /* one-shot: the next push does not call it */
    assert_int_equal(push(c, 0, &b, &step), PS_OK);
    assert_int_equal(s.calls, 1);
    assert_int_equal(step, 2);
    assert_int_equal(f->bodies_ok, 2);
    ps_client_free(c);
    fake_stop(f);
    free(b.all);
}

/* The most a sending socket may hold (tcp_wmem's maximum). */
static size_t wmem_max(void)
{
    unsigned long lo = 0, def = 0, max = 4 << 20;
    FILE *fp = fopen("/proc/sys/net/ipv4/tcp_wmem", "r");
    if (fp) {
        if (fscanf(fp, "%lu %lu %lu", &lo, &def, &max) != 3)
            max = 4 << 20;
        fclose(fp);
    }
    return max;
}

static void test_a_body_bigger_than_the_socket_buffers_is_all_sent_first(void **state)
{
    (void)state;
    body b = body_make(6 << 20); /* 24 MiB: more than the send and receive buffers hold */
    size_t total = b.head_len + b.data_len;
    fake *f = fake_start(b.all, total, 1);
    ps_client *c = client_for(&f, 1);
    seen s = {.fs = &f, .n = 1};
    ps_set_while_waiting(c, work, &s);
    int64_t step = 0;
    assert_int_equal(push(c, 0, &b, &step), PS_OK);
    assert_int_equal(s.calls, 1);
    assert_int_equal(f->bodies_ok, 1);
    assert_int_equal(s.answered_before, 0);
    /* when the work ran, all but what the sending socket and the fake's
     * small receive buffer can hold had reached the fake */
    size_t held = wmem_max() + (1 << 20);
    assert_true(total > held + (4 << 20)); /* else the check below says nothing */
    if (s.received_before + held < total)
        fail_msg("the work ran when the fake had %zu of %zu bytes", s.received_before, total);
    assert_true(s.at_ms < f->answered_ms[0]);
    ps_client_free(c);
    fake_stop(f);
    free(b.all);
}

static void test_a_get_does_not_use_it_and_the_next_push_does(void **state)
{
    (void)state;
    body b = body_make(1000);
    fake *f = fake_start(b.all, b.head_len + b.data_len, 1);
    ps_client *c = client_for(&f, 1);
    seen s = {.fs = &f, .n = 1};
    ps_set_while_waiting(c, work, &s);
    unsigned char rx[64];
    size_t len = 0;
    int64_t gs = 0;
    assert_int_equal(ps_pull_params(c, 0, rx, sizeof(rx), &len, &gs), PS_OK);
    assert_int_equal(len, 8);
    assert_int_equal(gs, 7);
    assert_int_equal(s.calls, 0);
    int64_t step = 0;
    assert_int_equal(push(c, 0, &b, &step), PS_OK);
    assert_int_equal(s.calls, 1);
    assert_int_equal(s.answered_before, 1); /* the GET's answer only */
    ps_client_free(c);
    fake_stop(f);
    free(b.all);
}

static void test_a_refused_push_never_calls_it_and_clears_it(void **state)
{
    (void)state;
    body b = body_make(1000);
    fake *f = fake_start(b.all, b.head_len + b.data_len, 0); /* bound, not listening */
    ps_client *c = client_for(&f, 1);
    seen s = {.fs = &f, .n = 1};
    ps_set_while_waiting(c, work, &s);
    int64_t step = 0;
    assert_int_equal(push(c, 0, &b, &step), PS_ENET);
    assert_int_equal(s.calls, 0);
    /* and it is gone: the next push, answered, does not call it */
    fake_listen(f);
    assert_int_equal(push(c, 0, &b, &step), PS_OK);
    assert_int_equal(f->bodies_ok, 1);
    assert_int_equal(s.calls, 0);
    ps_client_free(c);
    fake_stop(f);
    free(b.all);
}

/* A batch to two shards: small bodies go one after the other, 1 MiB and
 * more at once over the multi interface; either way the work runs once,
 * after the second shard has its body too and before any answer. */
static void batch(size_t floats)
{
    body b = body_make(floats);
    fake *fs[2] = {fake_start(b.all, b.head_len + b.data_len, 1), fake_start(b.all, b.head_len + b.data_len, 1)};
    ps_client *c = client_for(fs, 2);
    seen s = {.fs = fs, .n = 2};
    ps_set_while_waiting(c, work, &s);
    ps_push_req r[2];
    for (int i = 0; i < 2; i++)
        r[i] = (ps_push_req){.shard = i, .head = b.all, .head_len = b.head_len, .data = b.all + b.head_len,
                             .data_len = b.data_len, .push_id = "t0-1-2"};
    assert_int_equal(ps_push_grads_many(c, r, 2), PS_OK);
    assert_int_equal(s.calls, 1);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(fs[i]->bodies_ok, 1);
        assert_int_equal(r[i].global_step, 1);
        assert_int_equal(r[i].outcome, PS_PUSH_APPLIED);
    }
    /* one after the other: shard 0 answered before the work ran, shard 1 not;
     * at once: neither */
    assert_int_equal(s.answered_before, floats * sizeof(float) < (1 << 20) ? 1 : 0);
    assert_true(s.at_ms < fs[1]->answered_ms[0]);
    ps_client_free(c);
    fake_stop(fs[0]);
    fake_stop(fs[1]);
    free(b.all);
}

static void test_a_batch_of_small_bodies_calls_it_once_after_the_last(void **state)
{
    (void)state;
    batch(20000);
}

static void test_a_batch_at_once_calls_it_once_after_every_body(void **state)
{
    (void)state;
    batch(1 << 19); /* 2 MiB each */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_the_work_runs_once_between_the_body_and_the_answer),
        cmocka_unit_test(test_a_body_bigger_than_the_socket_buffers_is_all_sent_first),
        cmocka_unit_test(test_a_get_does_not_use_it_and_the_next_push_does),
        cmocka_unit_test(test_a_refused_push_never_calls_it_and_clears_it),
        cmocka_unit_test(test_a_batch_of_small_bodies_calls_it_once_after_the_last),
        cmocka_unit_test(test_a_batch_at_once_calls_it_once_after_every_body),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
