/* LD_PRELOAD shim for test_stop.py: delays every EPOLL_CTL_DEL made on the
 * process's main thread by 100 ms. psd's main thread is the one that stops the
 * HTTP server on SIGTERM; the delay lets the polling threads run their loop in
 * between, which turns a rare shutdown race in libmicrohttpd's epoll mode
 * (MHD_quiesce_daemon against the pool's own removal of the listening socket)
 * into one that happened on every stop. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <unistd.h>

__attribute__((constructor)) static void say_loaded(void)
{
    fputs("slow_epoll_del: loaded\n", stderr);
}

int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
    static int (*real)(int, int, int, struct epoll_event *);
    if (!real)
        *(void **)&real = dlsym(RTLD_NEXT, "epoll_ctl");
    if (op == EPOLL_CTL_DEL && syscall(SYS_gettid) == getpid())
        usleep(100 * 1000);
    return real(epfd, op, fd, ev);
}
