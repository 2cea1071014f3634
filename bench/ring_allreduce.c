/* ring_allreduce.c - one member of a ring all-reduce (client/ring.c) with no
 * model around it: sums a float buffer (from --input, or a pattern) over the
 * workers in --worker_hosts --steps times, and reports the time and the bytes
 * sent per all-reduce. The system test checks its --output against a sum
 * computed directly; bench/ring.py times it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cluster.h"
#include "flags.h"
#include "ring/ring.h"

static double now_secs(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const char *hosts = NULL, *input = NULL, *output = NULL, *tls_cert = NULL, *tls_key = NULL,
               *tls_ca = NULL, *tls_prio = NULL, *edges_arg = NULL;
    int rank = -1, steps = 1, warmup = 1;
    uint64_t floats = 0, piece = 1 << 20;
    float timeout = 30;
    flag flags[] = {
        {"worker_hosts", FLAG_STRING, &hosts, "comma-separated host:port of the ring, in rank order", 0},
        {"task_index", FLAG_INT, &rank, "this worker's rank", 0},
        {"floats", FLAG_U64, &floats, "buffer length (with no --input: element i of rank r is r + 1 + i % 7 / 8)", 0},
        {"input", FLAG_STRING, &input, "raw little-endian float32 file to sum (sets --floats)", 0},
        {"output", FLAG_STRING, &output, "write the last sum here, raw float32", 0},
        {"steps", FLAG_INT, &steps, "all-reduces to run (default 1)", 0},
        {"warmup", FLAG_INT, &warmup, "the first this many are not timed (default 1; below --steps, or the one all-reduce of --steps=1 is timed)", 0},
        {"piece_bytes", FLAG_U64, &piece, "pieces of at most this many bytes (default 1048576)", 0},
        {"timeout_secs", FLAG_FLOAT, &timeout, "wait this long for a neighbour (default 30)", 0},
        {"edges", FLAG_STRING, &edges_arg, "comma-separated float indices, increasing, each in (0, --floats): the buffer is summed in buckets split there, the last first (as workerd --overlap; the same sums)", 0},
        {"tls_cert", FLAG_STRING, &tls_cert, "serve and speak HTTPS, with this PEM certificate (needs --tls_key)", 0},
        {"tls_key", FLAG_STRING, &tls_key, "the PEM private key of --tls_cert", 0},
        {"tls_ca", FLAG_STRING, &tls_ca, "with --tls_cert: the CA(s) the neighbours' certificates must chain to (default: the system's)", 0},
        {"tls_priorities", FLAG_STRING, &tls_prio, "with --tls_cert: the GnuTLS priority string served, whose TLS versions the pushes offer (default psd's; one GnuTLS rejects, or without TLS 1.2 or 1.3, exits 2)", 0},
    };
    int nf = (int)(sizeof(flags) / sizeof(flags[0]));
    char err[512];
    int fr = flags_parse(flags, nf, argc, argv, err, sizeof(err));
    if (fr == 1) {
        flags_help(stdout, "usage: ring_allreduce --worker_hosts=h:p,h:p --task_index=R [--floats=N | --input=F]",
                   flags, nf);
        return 0;
    }
    if (fr < 0 || !hosts || rank < 0 || steps < 1 || piece < 4 || !(timeout > 0) || warmup < 0 ||
        (steps > 1 && warmup >= steps)) {
        fprintf(stderr, "ring_allreduce: %s\n",
                fr < 0 ? err : "--worker_hosts and --task_index are required, --steps >= 1, 0 <= --warmup < --steps");
        return 2;
    }
    if (tls_prio && ring_tls_priorities_check(tls_prio, err, sizeof(err)) != 0) {
        fprintf(stderr, "ring_allreduce: --tls_priorities=%s: %s\n", tls_prio, err);
        return 2;
    }
    static size_t edges[RING_MAX_EDGES];
    int n_edges = 0;
    for (const char *e = edges_arg; e && *e;) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(e, &end, 10);
        if (end == e || errno || (*end && *end != ',') || *e == '-' || n_edges == RING_MAX_EDGES) {
            fprintf(stderr, "ring_allreduce: --edges=%s: comma-separated float indices, at most %d\n", edges_arg,
                    RING_MAX_EDGES);
            return 2;
        }
        edges[n_edges++] = (size_t)v;
        e = *end ? end + 1 : end;
    }
    float *in = NULL;
    if (input) {
        FILE *f = fopen(input, "rb");
        if (!f || fseek(f, 0, SEEK_END) != 0) {
            fprintf(stderr, "ring_allreduce: cannot read '%s'\n", input);
            return 2;
        }
        long len = ftell(f);
        rewind(f);
        floats = (uint64_t)len / 4;
        in = malloc((size_t)len + 4);
        if (!in || fread(in, 1, (size_t)len, f) != (size_t)len) {
            fprintf(stderr, "ring_allreduce: cannot read '%s'\n", input);
            return 2;
        }
        fclose(f);
    } else {
        in = malloc(floats * 4 + 4);
        if (!in)
            return 1;
        for (uint64_t i = 0; i < floats; i++)
            in[i] = (float)(rank + 1) + (float)(i % 7) / 8;
    }
    cluster_input ci = {.job_name = "worker", .task_index = rank, .worker_hosts = hosts, .default_job = "worker"};
    cluster_spec cs;
    if (cluster_spec_build(&ci, &cs, err, sizeof(err)) != 0) {
        fprintf(stderr, "ring_allreduce: %s\n", err);
        return 2;
    }
    char name[32];
    snprintf(name, sizeof(name), "worker %d", rank);
    ring_options o = {.peers = cs.jobs[JOB_WORKER].tasks, .n = cs.jobs[JOB_WORKER].n, .rank = rank,
                      .n_floats = floats, .piece_bytes = piece, .timeout_secs = timeout, .name = name,
                      .tls_cert = tls_cert, .tls_key = tls_key, .tls_ca = tls_ca, .tls_priorities = tls_prio,
                      .tls_names = {"--tls_cert", "--tls_key", "--tls_ca", "--tls_priorities"},
                      .edges = n_edges ? edges : NULL, .n_edges = n_edges};
    ring *r = ring_new(&o, err, sizeof(err));
    if (!r) {
        fprintf(stderr, "ring_allreduce: %s\n", err);
        cluster_spec_free(&cs);
        free(in);
        return 1;
    }
    float *buf = malloc(floats * 4 + 4);
    if (steps == 1)
        warmup = 0;
    double total = 0, first = 0, *times = malloc(sizeof(double) * (size_t)steps);
    int rc = 0, timed = 0;
    if (!times) {
        fprintf(stderr, "ring_allreduce: out of memory\n");
        return 1;
    }
    if (!buf) {
        fprintf(stderr, "ring_allreduce: out of memory\n");
        rc = 1;
    }
    for (int s = 0; s < steps && buf && rc == 0; s++) {
        memcpy(buf, in, floats * 4);
        double t0 = now_secs();
        if (ring_allreduce(r, s, buf, s == 0 ? 60 : 0, err, sizeof(err)) != 0) {
            fprintf(stderr, "ring_allreduce: %s\n", err);
            rc = 1;
            break;
        }
        double dt = now_secs() - t0;
        if (s == 0)
            first = dt;
        if (s >= warmup) {
            total += dt;
            times[timed++] = dt;
        }
    }
    if (rc == 0 && output) {
        FILE *f = fopen(output, "wb");
        if (!f || fwrite(buf, 4, floats, f) != floats || fclose(f) != 0) {
            fprintf(stderr, "ring_allreduce: cannot write '%s'\n", output);
            rc = 1;
        }
    }
    if (rc == 0) {
        int n = o.n;
        qsort(times, (size_t)timed, sizeof(double), cmp_double);
        double median = timed % 2 ? times[timed / 2] : (times[timed / 2 - 1] + times[timed / 2]) / 2;
        printf("ring_allreduce: rank %d of %d: %llu floats, %d all-reduces, %.6f s each after the first %d "
               "(median %.6f s over %d; the first %.6f s), %.0f bytes sent each (2(N-1)/N x bytes = %.0f)\n",
               rank, n, (unsigned long long)floats, steps, total / timed, warmup, median, timed, first,
               (double)ring_bytes_sent(r) / steps, 2.0 * (n - 1) / n * (double)floats * 4);
        fflush(stdout);
    }
    /* the right neighbour may still be reading our last pieces: they were
     * answered, so it has them; nothing to wait for */
    ring_free(r);
    cluster_spec_free(&cs);
    free(buf);
    free(times);
    free(in);
    return rc;
}
