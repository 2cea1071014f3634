/* ps_stress.c - concurrent pushers and pullers through libps against one psd,
 * checking that every pull sees one consistent version.
 *
 * Set-up: variables stress/a (rows x cols) and stress/b (cols) all zero, and
 * stress/c (rows). psd must run with --learning_rate=0.5. Bulk pushers send
 * gradient 2 for a and b together (each push moves both by exactly -1);
 * single pushers send gradient 2 for c. Pullers check that:
 *   - every tensor pulled alone is uniform (all elements equal, an integer <= 0)
 *   - in one /v1/params body, a and b hold the same value (one consistent
 *     version of the shard) and global_step >= -value
 *   - values never go back up for the same puller.
 * At the end the final values must equal -(successful pushes), exactly.
 * Prints one JSON line with the counts; exit 0 when every check held. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "libps/libps.h"
#include "safetensors.h"

static const char *host;
static int rows = 300, cols = 100, seconds = 3;
static atomic_long bulk_pushes, single_pushes, pulls, param_pulls, violations, errors;
static atomic_int stop;

static void fail(const char *what, const char *detail)
{
    if (atomic_fetch_add(&violations, 1) < 10)
        fprintf(stderr, "ps_stress: %s: %s\n", what, detail);
}

static ps_client *client(void)
{
    char err[256];
    const char *hosts[] = {host};
    ps_options o = {.timeout_ms = 20000, .retries = 0};
    ps_client *c = ps_client_new(hosts, 1, &o, err, sizeof(err));
    if (!c) {
        fprintf(stderr, "ps_stress: %s\n", err);
        exit(2);
    }
    return c;
}

static int uniform(const float *x, size_t n, float *v)
{
    for (size_t i = 1; i < n; i++)
        if (x[i] != x[0])
            return 0;
    *v = x[0];
    return 1;
}

static void *bulk_pusher(void *arg)
{
    (void)arg;
    ps_client *c = client();
    size_t na = (size_t)rows * cols, nb = (size_t)cols;
    float *g = malloc((na + nb) * sizeof(float));
    for (size_t i = 0; i < na + nb; i++)
        g[i] = 2.0f;
    tensor_shape sa = {2, {rows, cols}}, sb = {1, {cols}};
    st_desc d[2] = {{"stress/a", "F32", &sa}, {"stress/b", "F32", &sb}};
    const char *meta[] = {"worker", "0", "step", "0", "batch_size", "100", "loss", "1.5"};
    char *head, err[256];
    size_t hl;
    if (st_header_build(d, 2, meta, 4, &head, &hl, err, sizeof(err)) != 0) {
        fprintf(stderr, "ps_stress: %s\n", err);
        exit(2);
    }
    while (!atomic_load(&stop)) {
        int64_t step;
        int dup;
        if (ps_push_grads(c, 0, head, hl, g, (na + nb) * 4, NULL, &step, &dup) == PS_OK)
            atomic_fetch_add(&bulk_pushes, 1);
        else if (atomic_fetch_add(&errors, 1) < 5)
            fprintf(stderr, "ps_stress: push: %s\n", ps_error(c));
    }
    free(head);
    free(g);
    ps_client_free(c);
    return NULL;
}

static void *single_pusher(void *arg)
{
    (void)arg;
    ps_client *c = client();
    float *g = malloc((size_t)rows * sizeof(float));
    for (int i = 0; i < rows; i++)
        g[i] = 2.0f;
    while (!atomic_load(&stop)) {
        int64_t step;
        if (ps_push_grad(c, 0, "stress/c", g, (size_t)rows, &step) == PS_OK)
            atomic_fetch_add(&single_pushes, 1);
        else if (atomic_fetch_add(&errors, 1) < 5)
            fprintf(stderr, "ps_stress: grad: %s\n", ps_error(c));
    }
    free(g);
    ps_client_free(c);
    return NULL;
}

static void *puller(void *arg)
{
    long id = (long)arg;
    ps_client *c = client();
    size_t na = (size_t)rows * cols;
    float *buf = malloc(na * sizeof(float));
    size_t pcap = na * 4 + cols * 4 + rows * 4 + 4096;
    unsigned char *pbuf = malloc(pcap);
    float last_a = 0, last_bulk = 0;
    char msg[256];
    while (!atomic_load(&stop)) {
        ps_var_info info;
        float v;
        if (id % 2 == 0) {
            if (ps_pull(c, 0, "stress/a", buf, na, &info) != PS_OK) {
                atomic_fetch_add(&errors, 1);
                continue;
            }
            atomic_fetch_add(&pulls, 1);
            if (!uniform(buf, na, &v)) {
                fail("torn read", "stress/a pulled alone is not uniform");
                continue;
            }
            if (v > last_a || v != (float)(long)v) {
                snprintf(msg, sizeof(msg), "stress/a went from %g to %g", (double)last_a, (double)v);
                fail("order", msg);
            }
            last_a = v;
        } else {
            size_t len;
            int64_t step;
            if (ps_pull_params(c, 0, pbuf, pcap, &len, &step) != PS_OK) {
                atomic_fetch_add(&errors, 1);
                continue;
            }
            atomic_fetch_add(&param_pulls, 1);
            st_file f;
            char err[256];
            if (st_parse(pbuf, len, &f, err, sizeof(err)) != 0) {
                fail("params body", err);
                continue;
            }
            int ia = st_find(&f, "stress/a"), ib = st_find(&f, "stress/b"), ic = st_find(&f, "stress/c");
            const char *gs = st_meta_get(&f, "global_step");
            if (ia < 0 || ib < 0 || ic < 0 || !gs || atoll(gs) != step) {
                fail("params body", "missing tensor or global_step metadata");
                st_file_free(&f);
                continue;
            }
            /* copy out: the data section need not be 4-byte aligned in our buffer */
            const unsigned char *data = pbuf + f.data_start;
            float va, vb;
            size_t la = f.tensors[ia].end - f.tensors[ia].begin, lb = f.tensors[ib].end - f.tensors[ib].begin;
            memcpy(buf, data + f.tensors[ia].begin, la);
            int ua = uniform(buf, la / 4, &va);
            memcpy(buf, data + f.tensors[ib].begin, lb);
            int ub = uniform(buf, lb / 4, &vb);
            if (!ua || !ub) {
                fail("torn read", "a tensor in /v1/params is not uniform");
            } else if (va != vb) {
                snprintf(msg, sizeof(msg), "stress/a is %g but stress/b is %g in one /v1/params body",
                         (double)va, (double)vb);
                fail("inconsistent shard", msg);
            } else if ((double)step < -(double)va || va > last_bulk) {
                snprintf(msg, sizeof(msg), "global_step %lld, value %g, previous %g", (long long)step,
                         (double)va, (double)last_bulk);
                fail("order", msg);
            } else {
                last_bulk = va;
            }
            st_file_free(&f);
        }
    }
    free(buf);
    free(pbuf);
    ps_client_free(c);
    return NULL;
}

int main(int argc, char **argv)
{
    int n_bulk = 2, n_single = 1, n_pull = 4;
    if (argc < 2) {
        fprintf(stderr, "usage: ps_stress HOST:PORT [seconds] [bulk_pushers] [single_pushers] [pullers]\n");
        return 2;
    }
    host = argv[1];
    if (argc > 2) seconds = atoi(argv[2]);
    if (argc > 3) n_bulk = atoi(argv[3]);
    if (argc > 4) n_single = atoi(argv[4]);
    if (argc > 5) n_pull = atoi(argv[5]);

    ps_client *c = client();
    size_t na = (size_t)rows * cols;
    float *zero = calloc(na, sizeof(float));
    tensor_shape sa = {2, {rows, cols}}, sb = {1, {cols}}, sc = {1, {rows}};
    if (ps_put(c, 0, "stress/a", &sa, zero, 0, NULL) || ps_put(c, 0, "stress/b", &sb, zero, 0, NULL) ||
        ps_put(c, 0, "stress/c", &sc, zero, 0, NULL)) {
        fprintf(stderr, "ps_stress: set-up: %s\n", ps_error(c));
        return 2;
    }
    int64_t step0;
    json_t *st;
    if (ps_status(c, 0, &st) != PS_OK) {
        fprintf(stderr, "ps_stress: %s\n", ps_error(c));
        return 2;
    }
    step0 = json_integer_value(json_object_get(st, "global_step"));
    json_decref(st);

    int nt = n_bulk + n_single + n_pull;
    pthread_t *t = calloc((size_t)nt, sizeof(*t));
    int k = 0;
    for (int i = 0; i < n_bulk; i++)
        pthread_create(&t[k++], NULL, bulk_pusher, NULL);
    for (int i = 0; i < n_single; i++)
        pthread_create(&t[k++], NULL, single_pusher, NULL);
    for (long i = 0; i < n_pull; i++)
        pthread_create(&t[k++], NULL, puller, (void *)i);
    struct timespec ts = {seconds, 0};
    nanosleep(&ts, NULL);
    atomic_store(&stop, 1);
    for (int i = 0; i < nt; i++)
        pthread_join(t[i], NULL);

    /* final state: exactly one -1 per successful push */
    ps_var_info info;
    float va, vc;
    float *buf = malloc(na * sizeof(float));
    if (ps_pull(c, 0, "stress/a", buf, na, &info) || !uniform(buf, na, &va) ||
        ps_pull(c, 0, "stress/c", buf, (size_t)rows, &info) || !uniform(buf, (size_t)rows, &vc)) {
        fail("final", "stress/a or stress/c unreadable or not uniform");
        va = vc = 1;
    }
    if (va != -(float)atomic_load(&bulk_pushes) || vc != -(float)atomic_load(&single_pushes)) {
        char msg[256];
        snprintf(msg, sizeof(msg), "a=%g after %ld bulk pushes, c=%g after %ld single pushes", (double)va,
                 atomic_load(&bulk_pushes), (double)vc, atomic_load(&single_pushes));
        fail("final", msg);
    }
    ps_status(c, 0, &st);
    int64_t step1 = json_integer_value(json_object_get(st, "global_step"));
    json_decref(st);
    if (step1 - step0 != atomic_load(&bulk_pushes) + atomic_load(&single_pushes))
        fail("final", "global_step did not advance once per push");
    printf("{\"bulk_pushes\":%ld,\"single_pushes\":%ld,\"pulls\":%ld,\"param_pulls\":%ld,"
           "\"violations\":%ld,\"errors\":%ld,\"global_step\":%lld}\n",
           atomic_load(&bulk_pushes), atomic_load(&single_pushes), atomic_load(&pulls),
           atomic_load(&param_pulls), atomic_load(&violations), atomic_load(&errors),
           (long long)step1);
    free(buf);
    free(zero);
    free(t);
    ps_client_free(c);
    return atomic_load(&violations) || atomic_load(&errors) ? 1 : 0;
}
