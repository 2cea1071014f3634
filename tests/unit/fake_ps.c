/* fake_ps.c - the shared part of libps's unit tests' fake ps (fake_ps.h):
 * the loopback listener, its accepting thread, and a client of the fakes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fake_ps.h"

/* The fake's thread: each connection, once listening, to serve, then closed. */
static void *fake_ps_main(void *arg)
{
    fake_ps *f = arg;
    while (!f->stop) {
        if (!f->listening) {
            usleep(5000);
            continue;
        }
        struct pollfd p = {.fd = f->fd, .events = POLLIN};
        if (poll(&p, 1, 20) <= 0)
            continue;
        int c = accept(f->fd, NULL, NULL);
        if (c < 0)
            continue;
        f->serve(f->arg, c);
        close(c);
    }
    return NULL;
}

void fake_ps_start(fake_ps *f, int rcvbuf, int listening, void (*serve)(void *arg, int c), void *arg)
{
    f->serve = serve;
    f->arg = arg;
    f->fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(f->fd >= 0);
    if (rcvbuf > 0) /* the kernel doubles it */
        assert_int_equal(setsockopt(f->fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf)), 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(f->fd, (struct sockaddr *)&a, sizeof(a)), 0);
    socklen_t al = sizeof(a);
    assert_int_equal(getsockname(f->fd, (struct sockaddr *)&a, &al), 0);
    f->port = ntohs(a.sin_port);
    if (listening)
        fake_ps_listen(f);
    assert_int_equal(pthread_create(&f->th, NULL, fake_ps_main, f), 0);
}

void fake_ps_listen(fake_ps *f)
{
    assert_int_equal(listen(f->fd, 16), 0);
    f->listening = 1;
}

void fake_ps_stop(fake_ps *f)
{
    f->stop = 1;
    pthread_join(f->th, NULL);
    close(f->fd);
}

void fake_ps_send_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k <= 0)
            return;
        p += k;
        n -= (size_t)k;
    }
}

ps_client *fake_ps_client(const int *ports, int n, const ps_options *opt)
{
    char hosts[4][64];
    const char *hp[4];
    for (int i = 0; i < n; i++) {
        snprintf(hosts[i], sizeof(hosts[i]), "127.0.0.1:%d", ports[i]);
        hp[i] = hosts[i];
    }
    char err[256];
    ps_client *c = ps_client_new(hp, n, opt, err, sizeof(err));
    if (!c)
        fail_msg("ps_client_new: %s", err);
    return c;
}
