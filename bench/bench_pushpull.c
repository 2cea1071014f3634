/* bench_pushpull.c - one training step's traffic (a bulk push of gradients
 * and a bulk pull of parameters to and from every ps at once, libcurl multi)
 * for a model of a given size split evenly over the ps tasks given.
 *
 *   bench_pushpull --hosts=H:P[,H:P...] --mib=N [--reps=K] [--ca=PEM]
 * Creates one variable per ps ("w<i>", N MiB / ps tasks each), then times K
 * steps (sgd pushes, async) and prints one line: ps tasks, MiB, median ms per
 * push and per pull, and GB/s of the two together. Exit 1 when a request fails.
 * --ca=PEM talks HTTPS to psd --tls_cert, trusting that CA (bench/tls.sh). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "libps/libps.h"
#include "safetensors.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    const char *hosts_s = NULL;
    double mib = 1;
    int reps = 9;
    ps_options opt = {.retries = 3};
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "--hosts=", 8))
            hosts_s = argv[i] + 8;
        else if (!strncmp(argv[i], "--mib=", 6))
            mib = atof(argv[i] + 6);
        else if (!strncmp(argv[i], "--reps=", 7))
            reps = atoi(argv[i] + 7);
        else if (!strncmp(argv[i], "--ca=", 5)) {
            opt.tls = 1;
            opt.ca_file = argv[i] + 5;
        } else {
            fprintf(stderr, "usage: bench_pushpull --hosts=H:P[,H:P...] --mib=N [--reps=K] [--ca=PEM]\n");
            return 2;
        }
    }
    if (!hosts_s || mib <= 0 || reps < 1) {
        fprintf(stderr, "usage: bench_pushpull --hosts=H:P[,H:P...] --mib=N [--reps=K] [--ca=PEM]\n");
        return 2;
    }
    char *copy = strdup(hosts_s), *hosts[16];
    int n = 0;
    for (char *t = strtok(copy, ","); t && n < 16; t = strtok(NULL, ","))
        hosts[n++] = t;
    char err[512];
    ps_client *c = ps_client_new((const char *const *)hosts, n, &opt, err, sizeof(err));
    if (!c) {
        fprintf(stderr, "bench_pushpull: %s\n", err);
        return 1;
    }
    size_t per = (size_t)(mib * 1048576.0 / 4 / n); /* floats per ps */
    float *data = calloc(per, sizeof(float));
    unsigned char **rx = calloc((size_t)n, sizeof(*rx));
    char **heads = calloc((size_t)n, sizeof(*heads));
    size_t *hl = calloc((size_t)n, sizeof(*hl)), cap = per * 4 + 4096;
    tensor_shape shape = {.ndim = 1, .dims = {(int64_t)per}};
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof(name), "w%d", i);
        if (ps_put(c, i, name, &shape, data, 0, NULL) != PS_OK) {
            fprintf(stderr, "bench_pushpull: %s\n", ps_error(c));
            return 1;
        }
        rx[i] = malloc(cap);
        memset(rx[i], 0, cap);
        st_desc d = {name, "F32", &shape};
        if (st_header_build(&d, 1, NULL, 0, &heads[i], &hl[i], err, sizeof(err)) != 0)
            return 1;
    }
    double *tpush = calloc((size_t)reps, sizeof(double)), *tpull = calloc((size_t)reps, sizeof(double));
    for (int r = 0; r < reps + 1; r++) {
        ps_push_req pr[16];
        ps_pull_req qr[16];
        for (int i = 0; i < n; i++) {
            pr[i] = (ps_push_req){.shard = i, .head = heads[i], .head_len = hl[i], .data = data,
                                  .data_len = per * 4};
            qr[i] = (ps_pull_req){.shard = i, .min_step = -1, .worker = -1, .buf = rx[i], .cap = cap};
        }
        double t0 = now();
        if (ps_push_grads_many(c, pr, n) != PS_OK) {
            fprintf(stderr, "bench_pushpull: %s\n", ps_error(c));
            return 1;
        }
        double t1 = now();
        if (ps_pull_params_many(c, qr, n) != PS_OK) {
            fprintf(stderr, "bench_pushpull: %s\n", ps_error(c));
            return 1;
        }
        double t2 = now();
        if (r > 0) { /* the first is a warm-up */
            tpush[r - 1] = t1 - t0;
            tpull[r - 1] = t2 - t1;
        }
    }
    qsort(tpush, (size_t)reps, sizeof(double), cmp);
    qsort(tpull, (size_t)reps, sizeof(double), cmp);
    double push = tpush[reps / 2], pull = tpull[reps / 2];
    double bytes = (double)per * 4 * n;
    printf("%d %g %.3f %.3f %.3f\n", n, mib, push * 1e3, pull * 1e3, 2 * bytes / (push + pull) / 1e9);
    for (int i = 0; i < n; i++) {
        free(rx[i]);
        free(heads[i]);
    }
    free(rx);
    free(heads);
    free(hl);
    free(tpush);
    free(tpull);
    free(data);
    free(copy);
    ps_client_free(c);
    return 0;
}
