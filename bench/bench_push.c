/* bench_push.c - a push against a pull of the same bytes, and several pushers
 * at once, against one psd, interleaved in one run (issue 20 section 2).
 *
 *   bench_push --psd=HOST:PORT --psd_pid=N [--reps=N] [--verbose]
 * bench/push.sh starts the psd (async, sgd) and passes its address. Creates
 * "big" (4096x4096 float32, 64 MiB) and "small" (79510 floats, 318 KB, the
 * example's MLP), then in each repetition, in a rotated order:
 *   - 64 MiB: ps_pull (GET /v1/vars/big) and ps_push_grads (POST /v1/grads)
 *   - 318 KB: the same, as requests per second on one connection
 *   - 1 pusher against 2 pushers at once (a thread and a connection each),
 *     64 MiB and 318 KB: the total bytes (requests) per second
 *   - 318 KB pulls per second while another connection pushes 64 MiB
 *     without pause, against the same pulls alone (no target: what a pull
 *     waits for while a push is applied)
 * and prints medians, the paired ratios and the targets. The
 * gradients are zeros (w - lr * 0 == w), so the stored bytes stay the same
 * and are checked at the end. psd's peak RSS (VmHWM, reset through
 * /proc/PID/clear_refs) is read over pushes of 64 MiB alone.
 * Exit status: 0 when everything ran (whatever the figures), 1 when something
 * broke, 2 on usage. */
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "libps/libps.h"
#include "safetensors.h"

#define SMALL_N 79510
#define BIG_N ((size_t)16 << 20)
#define SMALL_BYTES ((size_t)SMALL_N * 4)
#define BIG_BYTES (BIG_N * 4)
#define MAX_REPS 64

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("bench_push: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *touched(size_t n, int byte)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n) != 0)
        die("out of memory for %zu bytes", n);
    memset(p, byte, n);
    return p;
}

typedef struct series {
    double v[MAX_REPS];
    int n;
} series;

static void add(series *s, double v)
{
    if (s->n < MAX_REPS)
        s->v[s->n++] = v;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const series *s)
{
    if (s->n == 0)
        return 0;
    double t[MAX_REPS];
    memcpy(t, s->v, sizeof(double) * (size_t)s->n);
    qsort(t, (size_t)s->n, sizeof(double), cmp_double);
    return s->n % 2 ? t[s->n / 2] : (t[s->n / 2 - 1] + t[s->n / 2]) / 2;
}

static double smax(const series *s)
{
    double m = 0;
    for (int i = 0; i < s->n; i++)
        m = s->v[i] > m ? s->v[i] : m;
    return m;
}

/* The median of the per-repetition ratios: both sides ran back to back. */
static double paired(const series *a, const series *b)
{
    series r = {0};
    for (int i = 0; i < a->n && i < b->n; i++)
        if (b->v[i] > 0)
            add(&r, a->v[i] / b->v[i]);
    return median(&r);
}

static int verbose;

static void row(const char *what, const char *unit, double k, const series *a, const char *peer,
                const series *b, double target)
{
    double r = paired(a, b);
    printf("  %-34s %8.2f %s (best %8.2f)  %-9s %8.2f (best %8.2f)  %5.2fx", what, median(a) * k,
           unit, smax(a) * k, peer, median(b) * k, smax(b) * k, r);
    if (target > 0)
        printf("  >= %.2fx  %s", target, r >= target ? "PASS" : "BELOW");
    printf("\n");
    if (verbose) {
        printf("    ");
        for (int i = 0; i < a->n; i++)
            printf(" %.4g/%.4g", a->v[i] * k, i < b->n ? b->v[i] * k : 0);
        printf("\n");
    }
}

/* ---- libps ---- */

static ps_client *client_for(const char *host)
{
    char err[512];
    ps_options o = {.retries = 0};
    ps_client *c = ps_client_new(&host, 1, &o, err, sizeof(err));
    if (!c)
        die("ps_client_new(%s): %s", host, err);
    return c;
}

static void put_or_die(ps_client *c, const char *name, const float *src, size_t numel)
{
    tensor_shape sh = {.ndim = 1, .dims = {(int64_t)numel}};
    if (numel == BIG_N)
        sh = (tensor_shape){.ndim = 2, .dims = {4096, 4096}};
    if (ps_put(c, 0, name, &sh, src, 0, NULL) != PS_OK)
        die("ps_put %s: %s", name, ps_error(c));
}

static void pull_or_die(ps_client *c, const char *name, float *dst, size_t numel)
{
    ps_var_info info;
    if (ps_pull(c, 0, name, dst, numel, &info) != PS_OK)
        die("ps_pull %s: %s", name, ps_error(c));
    if (info.bytes != numel * 4)
        die("ps_pull %s: %llu bytes, expected %zu", name, (unsigned long long)info.bytes, numel * 4);
}

typedef struct grad_body {
    char *head;
    size_t head_len;
    const float *data;
    size_t bytes;
} grad_body;

static grad_body grads_for(const char *name, size_t numel, const float *zeros, int worker)
{
    tensor_shape sh = {.ndim = 1, .dims = {(int64_t)numel}};
    if (numel == BIG_N)
        sh = (tensor_shape){.ndim = 2, .dims = {4096, 4096}};
    st_desc d = {name, "F32", &sh};
    char w[16];
    snprintf(w, sizeof(w), "%d", worker);
    const char *meta[] = {"worker", w, "batch_size", "100", "loss", "0.5"};
    grad_body g = {.data = zeros, .bytes = numel * 4};
    char err[256];
    if (st_header_build(&d, 1, meta, 3, &g.head, &g.head_len, err, sizeof(err)) != 0)
        die("st_header_build: %s", err);
    return g;
}

static void push_or_die(ps_client *c, const grad_body *g)
{
    int64_t step;
    int dup;
    if (ps_push_grads(c, 0, g->head, g->head_len, g->data, g->bytes, NULL, &step, &dup) != PS_OK)
        die("ps_push_grads: %s", ps_error(c));
}

/* ---- pushers at once: a thread and a connection each ---- */

typedef struct pusher {
    pthread_t th;
    ps_client *c;
    grad_body g;
    int count;
    pthread_barrier_t *go;
} pusher;

static void *push_run(void *arg)
{
    pusher *p = arg;
    pthread_barrier_wait(p->go);
    for (int i = 0; i < p->count; i++)
        push_or_die(p->c, &p->g);
    return NULL;
}

/* Pushes per second over n pushers, each pushing `each` times. */
static double pushes_at_once(pusher *ps, int n, int each)
{
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, (unsigned)n + 1);
    for (int i = 0; i < n; i++) {
        ps[i].count = each;
        ps[i].go = &go;
        if (pthread_create(&ps[i].th, NULL, push_run, &ps[i]) != 0)
            die("pthread_create failed");
    }
    pthread_barrier_wait(&go);
    double t0 = now();
    for (int i = 0; i < n; i++)
        pthread_join(ps[i].th, NULL);
    double dt = now() - t0;
    pthread_barrier_destroy(&go);
    return (double)n * each / dt;
}

/* Pulls of 318 KB per second on c while p pushes 64 MiB without pause
 * (until the pulls are done): what a pull waits for while a push is applied. */
typedef struct pusher_bg {
    pthread_t th;
    ps_client *c;
    grad_body g;
    atomic_int stop;
} pusher_bg;

static void *push_bg_run(void *arg)
{
    pusher_bg *p = arg;
    while (!atomic_load(&p->stop))
        push_or_die(p->c, &p->g);
    return NULL;
}

static double pulls_beside_pushes(ps_client *c, float *dst, int count, pusher_bg *p)
{
    atomic_store(&p->stop, 0);
    if (pthread_create(&p->th, NULL, push_bg_run, p) != 0)
        die("pthread_create failed");
    struct timespec ms = {0, 5000000};
    nanosleep(&ms, NULL); /* the first push under way */
    double t0 = now();
    for (int i = 0; i < count; i++)
        pull_or_die(c, "small", dst, SMALL_N);
    double dt = now() - t0;
    atomic_store(&p->stop, 1);
    pthread_join(p->th, NULL);
    return count / dt;
}

/* ---- psd's memory ---- */

static long status_kib(long pid, const char *key)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%ld/status", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        die("cannot read %s", path);
    long v = -1;
    size_t kl = strlen(key);
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, key, kl) == 0 && line[kl] == ':')
            v = strtol(line + kl + 1, NULL, 10);
    fclose(f);
    if (v < 0)
        die("%s: no %s line", path, key);
    return v;
}

/* VmHWM back to the current RSS (Linux >= 4.0): 0, or -1 when refused. */
static int reset_hwm(long pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%ld/clear_refs", pid);
    int fd = open(path, O_WRONLY);
    if (fd < 0)
        return -1;
    int ok = write(fd, "5", 1) == 1;
    close(fd);
    return ok ? 0 : -1;
}

static uint64_t stored_bytes(ps_client *c)
{
    json_t *j;
    if (ps_status(c, 0, &j) != PS_OK)
        die("GET /v1/status: %s", ps_error(c));
    json_t *b = json_object_get(j, "bytes");
    if (!json_is_integer(b))
        die("GET /v1/status: no integer \"bytes\"");
    uint64_t v = (uint64_t)json_integer_value(b);
    json_decref(j);
    return v;
}

static const char *arg_val(const char *a, const char *key)
{
    size_t k = strlen(key);
    return strncmp(a, key, k) == 0 && a[k] == '=' ? a + k + 1 : NULL;
}

int main(int argc, char **argv)
{
    const char *psd = NULL, *v;
    long pid = 0;
    int reps = 9;
    for (int i = 1; i < argc; i++) {
        if ((v = arg_val(argv[i], "--psd")))
            psd = v;
        else if ((v = arg_val(argv[i], "--psd_pid")))
            pid = atol(v);
        else if ((v = arg_val(argv[i], "--reps")))
            reps = atoi(v);
        else if (strcmp(argv[i], "--verbose") == 0)
            verbose = 1;
        else {
            fprintf(stderr, "bench_push: unknown argument %s (see bench/push.sh)\n", argv[i]);
            return 2;
        }
    }
    if (!psd || pid <= 0 || reps < 1 || reps > MAX_REPS) {
        fprintf(stderr, "usage: bench_push --psd=H:P --psd_pid=N [--reps=1..%d] [--verbose]\n", MAX_REPS);
        return 2;
    }
    double load = 0;
    getloadavg(&load, 1);
    const int n_big = 4, n_small = 400, n_big2 = 3, n_small2 = 300;

    float *big = touched(BIG_BYTES, 0), *small = touched(SMALL_BYTES, 0);
    for (size_t i = 0; i < BIG_N; i++)
        big[i] = (float)((i * 2654435761u) % 1000003) * 1e-6f - 0.5f;
    for (size_t i = 0; i < SMALL_N; i++)
        small[i] = (float)((i * 2654435761u) % 100003) * 1e-5f - 0.5f;
    float *zeros = touched(BIG_BYTES, 0);
    float *dst = touched(BIG_BYTES, 0x5a), *dst_s = touched(SMALL_BYTES, 0x5a);

    /* the 64 MiB and the 318 KB figures on connections of their own (a
     * connection that has carried 64 MiB serves small bodies slower) */
    ps_client *cb = client_for(psd), *cs = client_for(psd);
    put_or_die(cb, "big", big, BIG_N);
    put_or_die(cb, "small", small, SMALL_N);
    grad_body gb = grads_for("big", BIG_N, zeros, 0), gs = grads_for("small", SMALL_N, zeros, 0);
    pusher pb[2], pss[2];
    for (int i = 0; i < 2; i++) {
        pb[i] = (pusher){.c = client_for(psd), .g = grads_for("big", BIG_N, zeros, i)};
        pss[i] = (pusher){.c = client_for(psd), .g = grads_for("small", SMALL_N, zeros, i)};
    }
    pusher_bg bg = {.c = client_for(psd), .g = grads_for("big", BIG_N, zeros, 1)};
    /* warm up every path once */
    pull_or_die(cb, "big", dst, BIG_N);
    push_or_die(cb, &gb);
    pull_or_die(cs, "small", dst_s, SMALL_N);
    push_or_die(cs, &gs);
    pushes_at_once(pb, 2, 1);
    pushes_at_once(pss, 2, 10);

    series pull_b = {0}, push_b = {0}, pull_s = {0}, push_s = {0};
    series one_b = {0}, two_b = {0}, one_s = {0}, two_s = {0}, alone_s = {0}, beside_s = {0};
    double t_start = now();
    for (int r = 0; r < reps; r++) {
        for (int k = 0; k < 4; k++) {
            double t0 = now();
            switch ((k + r) % 4) {
            case 0:
                for (int i = 0; i < n_big; i++)
                    pull_or_die(cb, "big", dst, BIG_N);
                add(&pull_b, n_big / (now() - t0));
                break;
            case 1:
                for (int i = 0; i < n_big; i++)
                    push_or_die(cb, &gb);
                add(&push_b, n_big / (now() - t0));
                break;
            case 2:
                for (int i = 0; i < n_small; i++)
                    pull_or_die(cs, "small", dst_s, SMALL_N);
                add(&pull_s, n_small / (now() - t0));
                break;
            default:
                for (int i = 0; i < n_small; i++)
                    push_or_die(cs, &gs);
                add(&push_s, n_small / (now() - t0));
                break;
            }
        }
        for (int k = 0; k < 2; k++)
            if ((k + r) % 2 == 0) {
                add(&one_b, pushes_at_once(pb, 1, 2 * n_big2));
                add(&one_s, pushes_at_once(pss, 1, 2 * n_small2));
            } else {
                add(&two_b, pushes_at_once(pb, 2, n_big2));
                add(&two_s, pushes_at_once(pss, 2, n_small2));
            }
        for (int k = 0; k < 2; k++)
            if ((k + r) % 2 == 0) {
                double t0 = now();
                for (int i = 0; i < n_small2; i++)
                    pull_or_die(cs, "small", dst_s, SMALL_N);
                add(&alone_s, n_small2 / (now() - t0));
            } else {
                add(&beside_s, pulls_beside_pushes(cs, dst_s, n_small2, &bg));
            }
    }
    double t_run = now() - t_start;

    /* peak RSS over 64 MiB pushes alone */
    int hwm_ok = reset_hwm(pid) == 0;
    long rss_before = status_kib(pid, "VmRSS");
    for (int i = 0; i < n_big; i++)
        push_or_die(cb, &gb);
    long hwm = status_kib(pid, "VmHWM"), rss_after = status_kib(pid, "VmRSS");
    uint64_t stored = stored_bytes(cb);
    /* the versions before and after a push of everything (all or nothing),
     * the next ones in pooled memory (no page cleared per push) */
    double bound_mib = 2.0 * (double)stored / 1048576.0 + 32;

    pull_or_die(cb, "big", dst, BIG_N);
    if (memcmp(dst, big, BIG_BYTES) != 0)
        die("big after the pushes differs from what was stored (zero gradients)");
    pull_or_die(cs, "small", dst_s, SMALL_N);
    if (memcmp(dst_s, small, SMALL_BYTES) != 0)
        die("small after the pushes differs from what was stored (zero gradients)");

    const double gib = (double)BIG_BYTES / 1e9;
    printf("\nrestps push bench: loopback, %ld CPUs online, load average %.2f before; "
           "%d interleaved repetitions in %.1f s;\nfigures median (best); ratio = median of the "
           "per-repetition ratios\n\n",
           sysconf(_SC_NPROCESSORS_ONLN), load, reps, t_run);
    row("push 64 MiB (ps_push_grads)", "GB/s", gib, &push_b, "pull", &pull_b, 0.9);
    row("push 318 KB, 1 conn", "k/s ", 1e-3, &push_s, "pull", &pull_s, 0.9);
    row("2 pushers at once, 64 MiB, total", "GB/s", gib, &two_b, "1 pusher", &one_b, 1.2);
    row("2 pushers at once, 318 KB, total", "k/s ", 1e-3, &two_s, "1 pusher", &one_s, 1.2);
    row("pull 318 KB beside 64 MiB pushes", "k/s ", 1e-3, &beside_s, "alone", &alone_s, 0);
    if (hwm_ok)
        printf("\n  psd peak RSS over %d pushes of 64 MiB: %.1f MiB (RSS %.1f before, %.1f after); "
               "stored %.1f MiB;\n  bound 2 x stored + 32 MiB = %.1f MiB: %s\n",
               n_big, hwm / 1024.0, rss_before / 1024.0, rss_after / 1024.0,
               (double)stored / 1048576.0, bound_mib, hwm / 1024.0 <= bound_mib ? "PASS" : "BELOW");
    else
        printf("\n  psd peak RSS: /proc/%ld/clear_refs refused, not measured\n", pid);

    for (int i = 0; i < 2; i++) {
        ps_client_free(pb[i].c);
        ps_client_free(pss[i].c);
        free(pb[i].g.head);
        free(pss[i].g.head);
    }
    ps_client_free(bg.c);
    free(bg.g.head);
    free(gb.head);
    free(gs.head);
    ps_client_free(cb);
    ps_client_free(cs);
    free(big);
    free(small);
    free(zeros);
    free(dst);
    free(dst_s);
    return 0;
}
