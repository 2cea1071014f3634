/* fake_ps.h - the fake ps that libps's unit tests talk to (test_retry,
 * test_while_waiting), its part they share: a thread on a loopback socket
 * that accepts one connection at a time and hands it to the test's serve
 * function, and a libps client of such fakes. What a fake answers, and what
 * it records, is each test's own. Linked with libps.a. */
#ifndef RESTPS_TEST_FAKE_PS_H
#define RESTPS_TEST_FAKE_PS_H

#include <pthread.h>
#include <stddef.h>

#include "libps/libps.h"

typedef struct fake_ps {
    int fd, port;
    volatile int listening; /* 0: bound but refusing until fake_ps_listen */
    volatile int stop;
    pthread_t th;
    void (*serve)(void *arg, int c); /* one accepted connection; closed after */
    void *arg;
} fake_ps;

/* ps bound to 127.0.0.1:<free port> (rcvbuf > 0: a receive buffer of that
 * size, which accept passes on), listening now, or (listening = 0) refusing
 * connections until fake_ps_listen; its thread serves each connection with
 * serve(arg, fd). Fails the test on an error. */
void fake_ps_start(fake_ps *ps, int rcvbuf, int listening, void (*serve)(void *arg, int c), void *arg);
/* Connections accepted from now on. */
void fake_ps_listen(fake_ps *ps);
/* The thread stopped and joined, the socket closed. */
void fake_ps_stop(fake_ps *ps);
/* All n bytes of p to fd, or up to the first failed send. */
void fake_ps_send_all(int fd, const char *p, size_t n);
/* A libps client of the fakes on 127.0.0.1 at ports (n <= 4); fails the test
 * on an error. */
ps_client *fake_ps_client(const int *ports, int n, const ps_options *opt);

#endif
