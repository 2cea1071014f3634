/* bench_pull.c - moves tensors through libps to psd and the same bytes through
 * a plain libcurl handle from nginx, in one run, interleaved, and prints the
 * medians, the ratios and the targets.
 *
 * bench/run.sh starts the servers and passes their addresses:
 *   bench_pull --psd=HOST:PORT --psd_pid=N     psd --http_threads=2 (epoll pool)
 *              --psd0=HOST:PORT --psd0_pid=N   psd --http_threads=1 (one epoll thread)
 *              --nginx=HOST:PORT --docroot=DIR  nginx serving DIR (this program writes
 *                                               small.bin and big.bin there first)
 *              [--reps=N] [--scale=X] [--verbose]
 * --scale multiplies every batch size; --verbose prints each repetition's figure.
 * Exit status: 0 when everything ran (whatever the figures), 1 when something
 * broke (a request failed, a body differed from what was stored), 2 on usage. */
#include <curl/curl.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "libps/libps.h"
#include "safetensors.h"

#define SMALL_N 79510                    /* 784*100 + 100 + 100*10 + 10: the example MLP */
#define BIG_N ((size_t)16 << 20)         /* 64 MiB of float32 */
#define SMALL_BYTES ((size_t)SMALL_N * 4)
#define BIG_BYTES (BIG_N * 4)
#define MAX_REPS 64
#define MT_THREADS 8

/* ---- small helpers ---- */

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("bench_pull: ", stderr);
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

/* A buffer already faulted in (the hot path never touches fresh pages). */
static void *touched(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n) != 0)
        die("out of memory for %zu bytes", n);
    memset(p, 0x5a, n);
    return p;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
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

static int verbose;

static void dump(const char *what, const series *s)
{
    if (!verbose)
        return;
    printf("    %-28s", what);
    for (int i = 0; i < s->n; i++)
        printf(" %.4g", s->v[i]);
    printf("\n");
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

static double smin(const series *s)
{
    double m = s->n ? s->v[0] : 0;
    for (int i = 1; i < s->n; i++)
        m = s->v[i] < m ? s->v[i] : m;
    return m;
}

static double smax(const series *s)
{
    double m = s->n ? s->v[0] : 0;
    for (int i = 1; i < s->n; i++)
        m = s->v[i] > m ? s->v[i] : m;
    return m;
}

/* ---- libps side ---- */

static ps_client *client_for(const char *host)
{
    char err[512];
    ps_options o = {.retries = 0}; /* a failure is a failure, not a slow figure */
    ps_client *c = ps_client_new(&host, 1, &o, err, sizeof(err));
    if (!c)
        die("ps_client_new(%s): %s", host, err);
    return c;
}

static void ps_pull_or_die(ps_client *c, const char *name, float *dst, size_t numel)
{
    ps_var_info info;
    if (ps_pull(c, 0, name, dst, numel, &info) != PS_OK)
        die("ps_pull %s: %s", name, ps_error(c));
    if (info.bytes != numel * 4)
        die("ps_pull %s: %llu bytes, expected %zu", name, (unsigned long long)info.bytes,
            numel * 4);
}

static double ps_pull_batch(ps_client *c, const char *name, float *dst, size_t numel, int count)
{
    double t0 = now();
    for (int i = 0; i < count; i++)
        ps_pull_or_die(c, name, dst, numel);
    return now() - t0;
}

static void put_or_die(ps_client *c, const char *name, const float *src, size_t numel)
{
    tensor_shape sh = {.ndim = 1, .dims = {(int64_t)numel}};
    if (numel == BIG_N)
        sh = (tensor_shape){.ndim = 2, .dims = {4096, 4096}};
    if (ps_put(c, 0, name, &sh, src, 0, NULL) != PS_OK)
        die("ps_put %s: %s", name, ps_error(c));
}

static double ps_put_batch(ps_client *c, const float *src, int count)
{
    double t0 = now();
    for (int i = 0; i < count; i++)
        put_or_die(c, "big", src, BIG_N);
    return now() - t0;
}

/* One safetensors gradient body for "big": head (prefix + JSON), data follows. */
static char *grads_head(size_t *head_len)
{
    tensor_shape sh = {.ndim = 2, .dims = {4096, 4096}};
    st_desc d = {"big", "F32", &sh};
    const char *meta[] = {"worker", "0", "step", "0", "batch_size", "100", "loss", "0.5"};
    char *head, err[256];
    if (st_header_build(&d, 1, meta, 4, &head, head_len, err, sizeof(err)) != 0)
        die("st_header_build: %s", err);
    return head;
}

static double ps_grads_batch(ps_client *c, const char *head, size_t head_len, const float *g,
                             int count)
{
    double t0 = now();
    for (int i = 0; i < count; i++) {
        int64_t step;
        int dup;
        if (ps_push_grads(c, 0, head, head_len, g, BIG_BYTES, NULL, &step, &dup) != PS_OK)
            die("ps_push_grads: %s", ps_error(c));
    }
    return now() - t0;
}

/* ---- the nginx side: a plain libcurl easy handle, kept alive ---- */

typedef struct peer {
    CURL *h;
    char url_small[256], url_big[256];
    unsigned char *dst;
    size_t cap, len;
} peer;

static size_t peer_write(char *p, size_t size, size_t nmemb, void *ud)
{
    peer *pr = ud;
    size_t n = size * nmemb;
    if (pr->len + n > pr->cap)
        return 0;
    memcpy(pr->dst + pr->len, p, n);
    pr->len += n;
    return n;
}

static void peer_init(peer *pr, const char *host, const char *small_path, const char *big_path,
                      void *dst, size_t cap)
{
    if (!(pr->h = curl_easy_init()))
        die("curl_easy_init failed");
    snprintf(pr->url_small, sizeof(pr->url_small), "http://%s%s", host, small_path);
    snprintf(pr->url_big, sizeof(pr->url_big), "http://%s%s", host, big_path);
    pr->dst = dst;
    pr->cap = cap;
    curl_easy_setopt(pr->h, CURLOPT_WRITEFUNCTION, peer_write);
    curl_easy_setopt(pr->h, CURLOPT_WRITEDATA, pr);
    curl_easy_setopt(pr->h, CURLOPT_BUFFERSIZE, 1L << 20);
    curl_easy_setopt(pr->h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(pr->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(pr->h, CURLOPT_PROXY, "");
    curl_easy_setopt(pr->h, CURLOPT_TIMEOUT_MS, 30000L);
}

static void peer_get(peer *pr, const char *url, size_t expect)
{
    pr->len = 0;
    curl_easy_setopt(pr->h, CURLOPT_URL, url);
    CURLcode rc = curl_easy_perform(pr->h);
    long code = 0;
    curl_easy_getinfo(pr->h, CURLINFO_RESPONSE_CODE, &code);
    if (rc != CURLE_OK || code != 200 || pr->len != expect)
        die("GET %s: %s, HTTP %ld, %zu bytes (expected %zu)", url, curl_easy_strerror(rc), code,
            pr->len, expect);
}

static double peer_batch(peer *pr, int big, int count)
{
    double t0 = now();
    for (int i = 0; i < count; i++)
        peer_get(pr, big ? pr->url_big : pr->url_small, big ? BIG_BYTES : SMALL_BYTES);
    return now() - t0;
}

/* ---- several connections at once: one thread and one ps_client each ---- */

typedef struct mt_worker {
    pthread_t th;
    ps_client *c;
    float *dst;
    int count;
    pthread_barrier_t *go;
} mt_worker;

static void *mt_run(void *arg)
{
    mt_worker *w = arg;
    pthread_barrier_wait(w->go);
    for (int i = 0; i < w->count; i++)
        ps_pull_or_die(w->c, "small", w->dst, SMALL_N);
    return NULL;
}

/* Pulls per second of `small` over n connections, each pulling `each` times. */
static double mt_pulls(mt_worker *ws, int n, int each)
{
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, (unsigned)n + 1);
    for (int i = 0; i < n; i++) {
        ws[i].count = each;
        ws[i].go = &go;
        if (pthread_create(&ws[i].th, NULL, mt_run, &ws[i]) != 0)
            die("pthread_create failed");
    }
    pthread_barrier_wait(&go);
    double t0 = now();
    for (int i = 0; i < n; i++)
        pthread_join(ws[i].th, NULL);
    double dt = now() - t0;
    pthread_barrier_destroy(&go);
    return (double)n * each / dt;
}

/* ---- psd's memory ---- */

static long status_kib(long pid, const char *key)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%ld/status", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        die("cannot read %s (is psd %ld running?)", path, pid);
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

/* ---- data and checks ---- */

static void write_file(const char *dir, const char *name, const void *p, size_t n)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        die("cannot create %s", path);
    for (size_t off = 0; off < n;) {
        ssize_t w = write(fd, (const char *)p + off, n - off);
        if (w <= 0)
            die("cannot write %s", path);
        off += (size_t)w;
    }
    fdatasync(fd); /* no writeback later, in the middle of a measurement */
    close(fd);
}

static void check_same(const char *what, const void *got, const void *want, size_t n)
{
    if (memcmp(got, want, n) != 0)
        die("%s: the body differs from the stored bytes", what);
}

/* ---- output ---- */

static const char *verdict(double ratio, double target) { return ratio >= target ? "PASS" : "BELOW"; }

/* The median of the per-repetition ratios a[i]/b[i]: both were measured in the
 * same repetition, so slow drift of the machine cancels out. */
static double paired_ratio(const series *a, const series *b)
{
    series r = {0};
    for (int i = 0; i < a->n && i < b->n; i++)
        if (b->v[i] > 0)
            add(&r, a->v[i] / b->v[i]);
    return median(&r);
}

static void row_rate(const char *what, const series *a, const char *peer_name, const series *b,
                     double target)
{
    double ma = median(a), mb = median(b), r = paired_ratio(a, b);
    printf("  %-30s %8.0f/s [%6.0f-%6.0f]  %-6s %8.0f/s [%6.0f-%6.0f]  %5.2fx", what, ma, smin(a),
           smax(a), peer_name, mb, smin(b), smax(b), r);
    if (target > 0)
        printf("  >= %.2fx  %s", target, verdict(r, target));
    printf("\n");
    dump(what, a);
    dump(peer_name, b);
}

static void row_gbs(const char *what, const series *a, const char *peer_name, const series *b,
                    double target)
{
    double ma = median(a), mb = median(b), r = paired_ratio(a, b);
    printf("  %-30s %6.2f GB/s [%4.2f-%4.2f]  %-6s %6.2f GB/s [%4.2f-%4.2f]  %5.2fx", what, ma,
           smin(a), smax(a), peer_name, mb, smin(b), smax(b), r);
    if (target > 0)
        printf("  >= %.2fx  %s", target, verdict(r, target));
    printf("\n");
    dump(what, a);
    dump(peer_name, b);
}

/* ---- main ---- */

static const char *arg_val(const char *a, const char *key)
{
    size_t k = strlen(key);
    return strncmp(a, key, k) == 0 && a[k] == '=' ? a + k + 1 : NULL;
}

int main(int argc, char **argv)
{
    const char *psd = NULL, *psd0 = NULL, *ngx = NULL, *docroot = NULL, *v;
    long psd_pid = 0, psd0_pid = 0;
    int reps = 15;
    double load_before = 0;
    getloadavg(&load_before, 1);
    double scale = 1.0;
    for (int i = 1; i < argc; i++) {
        if ((v = arg_val(argv[i], "--psd")))
            psd = v;
        else if ((v = arg_val(argv[i], "--psd_pid")))
            psd_pid = atol(v);
        else if ((v = arg_val(argv[i], "--psd0")))
            psd0 = v;
        else if ((v = arg_val(argv[i], "--psd0_pid")))
            psd0_pid = atol(v);
        else if ((v = arg_val(argv[i], "--nginx")))
            ngx = v;
        else if ((v = arg_val(argv[i], "--docroot")))
            docroot = v;
        else if ((v = arg_val(argv[i], "--reps")))
            reps = atoi(v);
        else if ((v = arg_val(argv[i], "--scale")))
            scale = atof(v);
        else if (strcmp(argv[i], "--verbose") == 0)
            verbose = 1;
        else {
            fprintf(stderr, "bench_pull: unknown argument %s (see bench/run.sh)\n", argv[i]);
            return 2;
        }
    }
    if (!psd || !psd0 || !ngx || !docroot || psd_pid <= 0 || psd0_pid <= 0 || reps < 1 ||
        reps > MAX_REPS || !(scale > 0)) {
        fprintf(stderr, "usage: bench_pull --psd=H:P --psd_pid=N --psd0=H:P --psd0_pid=N "
                        "--nginx=H:P --docroot=DIR [--reps=1..%d] [--scale=X]\n",
                MAX_REPS);
        return 2;
    }
#define SCALED(n) ((int)((n) * scale) > 0 ? (int)((n) * scale) : 1)
    const int n_small = SCALED(800), n_big = SCALED(5), n_put = SCALED(4), n_grads = SCALED(3);
    const int n_mt1 = SCALED(800), n_mt8 = SCALED(150), n_mtbig = SCALED(4);

    /* The tensors: finite, varied, the same bytes for psd and nginx. */
    float *small = touched(SMALL_BYTES), *big = touched(BIG_BYTES), *zero = touched(BIG_BYTES);
    for (size_t i = 0; i < SMALL_N; i++)
        small[i] = (float)((i * 2654435761u) % 100003) * 1e-5f - 0.5f;
    for (size_t i = 0; i < BIG_N; i++)
        big[i] = (float)((i * 2654435761u) % 1000003) * 1e-6f - 0.5f;
    memset(zero, 0, BIG_BYTES); /* w - lr*0 == w: pushes keep the stored bytes */
    write_file(docroot, "small.bin", small, SMALL_BYTES);
    write_file(docroot, "big.bin", big, BIG_BYTES);
    float *dst = touched(BIG_BYTES);       /* where 64 MiB bodies land, both sides */
    float *dst_s = touched(SMALL_BYTES);   /* where 318 KB bodies land, both sides */
    size_t head_len;
    char *head = grads_head(&head_len);

    /* Connections: c2/c0 and ng carry the 64 MiB transfers; cs, ngs and pcs
     * only ever carry 318 KB (a connection that has moved 64 MiB serves small
     * bodies 2-3x slower on loopback, server and client alike: see the
     * diagnostics), so the 318 KB figures do not depend on the order. */
    ps_client *c2 = client_for(psd), *c0 = client_for(psd0), *cs = client_for(psd);
    put_or_die(c2, "small", small, SMALL_N);
    put_or_die(c2, "big", big, BIG_N);
    put_or_die(c0, "small", small, SMALL_N);
    put_or_die(c0, "big", big, BIG_N);
    long rss_loaded = status_kib(psd_pid, "VmRSS");
    peer ng, ngs, pcs, pcb; /* nginx; the same plain libcurl handle against psd */
    peer_init(&ng, ngx, "/small.bin", "/big.bin", dst, BIG_BYTES);
    peer_init(&ngs, ngx, "/small.bin", "/big.bin", dst_s, SMALL_BYTES);
    peer_init(&pcs, psd, "/v1/vars/small", "/v1/vars/big", dst_s, SMALL_BYTES);
    peer_init(&pcb, psd, "/v1/vars/small", "/v1/vars/big", dst, BIG_BYTES);

    mt_worker w2[MT_THREADS], w0[MT_THREADS];
    for (int i = 0; i < MT_THREADS; i++) {
        w2[i] = (mt_worker){.c = client_for(psd), .dst = touched(SMALL_BYTES)};
        w0[i] = (mt_worker){.c = client_for(psd0), .dst = touched(SMALL_BYTES)};
    }

    /* Warm up every path once (connections made, pages touched) and check that
     * every side delivers exactly the stored bytes. */
    ps_pull_or_die(cs, "small", dst_s, SMALL_N);
    check_same("libps pull small from psd", dst_s, small, SMALL_BYTES);
    ps_pull_or_die(c2, "big", dst, BIG_N);
    check_same("libps pull big from psd", dst, big, BIG_BYTES);
    ps_pull_or_die(c0, "big", dst, BIG_N);
    check_same("libps pull big from psd --http_threads=1", dst, big, BIG_BYTES);
    ps_pull_or_die(c2, "small", dst, SMALL_N);
    peer_get(&ngs, ngs.url_small, SMALL_BYTES);
    check_same("nginx small.bin", dst_s, small, SMALL_BYTES);
    peer_get(&ng, ng.url_big, BIG_BYTES);
    check_same("nginx big.bin", dst, big, BIG_BYTES);
    peer_get(&ng, ng.url_small, SMALL_BYTES);
    peer_get(&pcs, pcs.url_small, SMALL_BYTES);
    check_same("plain libcurl GET small from psd", dst_s, small, SMALL_BYTES);
    peer_get(&pcb, pcb.url_big, BIG_BYTES);
    check_same("plain libcurl GET big from psd", dst, big, BIG_BYTES);
    ps_put_batch(c2, big, 1);
    ps_grads_batch(c2, head, head_len, zero, 1);
    mt_pulls(w2, MT_THREADS, 10);
    mt_pulls(w0, MT_THREADS, 10);

    series s_ps = {0}, s_ng = {0}, s_pc = {0}, s_ps_after = {0}, s_ng_after = {0};
    series b_ps = {0}, b_ng = {0}, b_pc = {0}, put_b = {0}, grads_b = {0};
    series e1 = {0}, t1 = {0}, e8 = {0}, t8 = {0}, ebig = {0}, tbig = {0};
    const double gb_big = (double)BIG_BYTES / 1e9;
    double t_start = now();
    for (int r = 0; r < reps; r++) {
        /* Each group runs in a rotated order, so drift hits every side alike. */
        for (int k = 0; k < 5; k++)
            switch ((k + r) % 5) {
            case 0: add(&s_ps, n_small / ps_pull_batch(cs, "small", dst_s, SMALL_N, n_small)); break;
            case 1: add(&s_ng, n_small / peer_batch(&ngs, 0, n_small)); break;
            case 2: add(&s_pc, n_small / peer_batch(&pcs, 0, n_small)); break;
            case 3: add(&s_ps_after, n_small / ps_pull_batch(c2, "small", dst, SMALL_N, n_small)); break;
            default: add(&s_ng_after, n_small / peer_batch(&ng, 0, n_small)); break;
            }
        for (int k = 0; k < 3; k++)
            switch ((k + r) % 3) {
            case 0: add(&b_ps, n_big * gb_big / ps_pull_batch(c2, "big", dst, BIG_N, n_big)); break;
            case 1: add(&b_ng, n_big * gb_big / peer_batch(&ng, 1, n_big)); break;
            default: add(&b_pc, n_big * gb_big / peer_batch(&pcb, 1, n_big)); break;
            }
        for (int k = 0; k < 2; k++)
            if ((k + r) % 2 == 0)
                add(&put_b, n_put * gb_big / ps_put_batch(c2, big, n_put));
            else
                add(&grads_b, n_grads * (double)(BIG_BYTES + head_len) / 1e9 /
                                  ps_grads_batch(c2, head, head_len, zero, n_grads));
        for (int k = 0; k < 2; k++)
            if ((k + r) % 2 == 0) {
                add(&e1, mt_pulls(w2, 1, n_mt1));
                add(&e8, mt_pulls(w2, MT_THREADS, n_mt8));
                add(&ebig, n_mtbig * gb_big / ps_pull_batch(c2, "big", dst, BIG_N, n_mtbig));
            } else {
                add(&t1, mt_pulls(w0, 1, n_mt1));
                add(&t8, mt_pulls(w0, MT_THREADS, n_mt8));
                add(&tbig, n_mtbig * gb_big / ps_pull_batch(c0, "big", dst, BIG_N, n_mtbig));
            }
    }
    double t_run = now() - t_start;

    /* After all the pushes: still exactly the stored bytes (zero gradients). */
    ps_pull_or_die(c2, "big", dst, BIG_N);
    check_same("libps pull big after the pushes", dst, big, BIG_BYTES);

    uint64_t stored = stored_bytes(c2);
    long rss = status_kib(psd_pid, "VmRSS"), hwm = status_kib(psd_pid, "VmHWM");
    long rss0 = status_kib(psd0_pid, "VmRSS");
    double bound_kib = 1.5 * (double)stored / 1024 + 32 * 1024;

    const char *obc = getenv("OPENBLAS_CORETYPE");
    printf("\nrestps bench: loopback, %ld CPUs online, load average %.2f before the bench "
           "(other work on the machine adds noise)\n",
           sysconf(_SC_NPROCESSORS_ONLN), load_before);
    printf("%d interleaved repetitions in %.1f s; figures are median [min-max];\n"
           "ratio = median of the per-repetition ratios (both sides measured back to back)\n",
           reps, t_run);
    printf("OPENBLAS_CORETYPE: %s%s%s (left as found; these transfers use no BLAS)\n",
           obc ? "\"" : "", obc ? obc : "unset: OpenBLAS picks its kernels by CPUID",
           obc ? "\"" : "");
    printf("psd = --http_threads=2 (epoll pool); nginx 1.22 sendfile to a reused libcurl "
           "handle; 1 MiB curl buffers both sides\n\n");
    printf("  %-30s %-27s  %-6s %-27s  %6s  %s\n", "", "libps <- psd", "peer", "", "ratio",
           "target");
    row_rate("pull 318 KB, 1 conn", &s_ps, "nginx", &s_ng, 0.8);
    printf("  %-30s %6.2f GB/s %6.0f us/pull          nginx %6.2f GB/s %6.0f us/pull\n",
           "  (same, as bandwidth/latency)", median(&s_ps) * SMALL_BYTES / 1e9,
           1e6 / median(&s_ps), median(&s_ng) * SMALL_BYTES / 1e9, 1e6 / median(&s_ng));
    row_gbs("pull 64 MiB, 1 conn", &b_ps, "nginx", &b_ng, 0.8);
    row_gbs("push 64 MiB ps_put", &put_b, "pull", &b_ps, 0.6);
    row_gbs("push 64 MiB ps_push_grads", &grads_b, "pull", &b_ps, 0.9); /* issue 20: bench/push.sh */

    printf("\n  libmicrohttpd threading: --http_threads=2 (epoll pool) vs 1 (one epoll "
           "thread)\n");
    row_rate("pull 318 KB, 1 conn", &e1, "x1", &t1, 0);
    row_rate("pull 318 KB, 8 conns", &e8, "x1", &t8, 0);
    row_gbs("pull 64 MiB, 1 conn", &ebig, "x1", &tbig, 0);

    printf("\n  diagnostics: libps vs a plain libcurl GET of the same psd URL (client cost)\n");
    row_rate("pull 318 KB, 1 conn", &s_ps, "curl", &s_pc, 0);
    row_gbs("pull 64 MiB, 1 conn", &b_ps, "curl", &b_pc, 0);
    printf("  318 KB pulls on a connection that has carried 64 MiB (as a worker's does)\n");
    row_rate("libps, after 64 MiB", &s_ps_after, "fresh", &s_ps, 0);
    row_rate("nginx, after 64 MiB", &s_ng_after, "fresh", &s_ng, 0);
    row_rate("libps vs nginx, after 64 MiB", &s_ps_after, "nginx", &s_ng_after, 0);

    printf("\n  psd RSS: %.1f MiB after loading, %.1f MiB after the run (peak %.1f MiB); "
           "stored %.1f MiB;\n  bound 1.5 x stored + 32 MiB = %.1f MiB: %s"
           "   (--http_threads=1 psd: %.1f MiB)\n",
           rss_loaded / 1024.0, rss / 1024.0, hwm / 1024.0, (double)stored / 1048576.0,
           bound_kib / 1024.0, rss <= bound_kib ? "PASS" : "BELOW (over the bound)",
           rss0 / 1024.0);

    for (int i = 0; i < MT_THREADS; i++) {
        ps_client_free(w2[i].c);
        ps_client_free(w0[i].c);
        free(w2[i].dst);
        free(w0[i].dst);
    }
    ps_client_free(c2);
    ps_client_free(c0);
    ps_client_free(cs);
    curl_easy_cleanup(ng.h);
    curl_easy_cleanup(ngs.h);
    curl_easy_cleanup(pcs.h);
    curl_easy_cleanup(pcb.h);
    free(dst_s);
    free(head);
    free(small);
    free(big);
    free(zero);
    free(dst);
    return 0;
}
