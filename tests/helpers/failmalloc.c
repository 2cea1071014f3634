/* failmalloc.c - an LD_PRELOAD shim for the allocation-failure test
 * (test_chaos.py), in the style of jansson's test_chaos.c: while armed, the
 * Nth allocation of the process fails (returns NULL, errno ENOMEM), once.
 *
 * The test drives it through a small file that both map (FAILMALLOC_CTL
 * names it; 32 bytes, native endianness):
 *   int32 armed   the test sets 1 before a request and 0 after it
 *   int32 fail_at N (1-based) among the allocations made while armed
 *   int64 count   allocations made while armed (the test zeroes it)
 *   int64 failed  allocations made to fail so far
 * With count < N after a request, the Nth allocation never came: every N
 * for that request has been tried.
 *
 * malloc, calloc, realloc, memalign, posix_memalign, aligned_alloc and
 * valloc are replaced by glibc's own __libc_* entry points (no dlsym, which
 * allocates itself); strdup, asprintf, json_dumps and libmicrohttpd's pools
 * all come through here, since glibc's own calls to malloc go through the
 * interposable symbol. free is left alone. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

struct ctl {
    volatile int32_t armed;
    volatile int32_t fail_at;
    volatile int64_t count;
    volatile int64_t failed;
};

static struct ctl *ctl;

__attribute__((constructor)) static void failmalloc_init(void)
{
    const char *path = getenv("FAILMALLOC_CTL");
    if (!path)
        return;
    int fd = open(path, O_RDWR);
    if (fd < 0)
        return;
    void *m = mmap(NULL, sizeof(struct ctl), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m != MAP_FAILED)
        ctl = m;
}

/* 1: this allocation fails. */
static int fail_now(void)
{
    if (!ctl || !ctl->armed)
        return 0;
    int64_t n = __atomic_add_fetch(&ctl->count, 1, __ATOMIC_SEQ_CST);
    if (n != ctl->fail_at)
        return 0;
    __atomic_add_fetch(&ctl->failed, 1, __ATOMIC_SEQ_CST);
    errno = ENOMEM;
    return 1;
}

void *malloc(size_t n)
{
    return fail_now() ? NULL : __libc_malloc(n);
}

void *calloc(size_t a, size_t b)
{
    return fail_now() ? NULL : __libc_calloc(a, b);
}

void *realloc(void *p, size_t n)
{
    /* realloc(p, 0) frees: not an allocation that can fail */
    if (p && n == 0)
        return __libc_realloc(p, 0);
    return fail_now() ? NULL : __libc_realloc(p, n);
}

void *memalign(size_t align, size_t n)
{
    return fail_now() ? NULL : __libc_memalign(align, n);
}

void *aligned_alloc(size_t align, size_t n)
{
    return fail_now() ? NULL : __libc_memalign(align, n);
}

void *valloc(size_t n)
{
    return fail_now() ? NULL : __libc_memalign((size_t)sysconf(_SC_PAGESIZE), n);
}

int posix_memalign(void **out, size_t align, size_t n)
{
    if (fail_now())
        return ENOMEM;
    void *p = __libc_memalign(align, n);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}
