/* gpu_bench.c - the CUDA backend's speed (tests/gpu/check.sh), through model.h:
 *   gpu_bench step SPEC BATCH SECS [tf32] [plain]   forward_backward of the
 *       model SPEC (--model's grammar: mlp:1024,1024, cnn, a layer list) on
 *       28x28x1 images at BATCH for about SECS seconds, with the host copies
 *       the worker makes: its params, gradients, x and labels from
 *       model_host_alloc (pinned, as the worker allocates them: direct DMA),
 *       or with plain, from malloc (copied through the backend's staging
 *       buffers); prints steps/s, GFLOP/s and which buffers it used (checked
 *       with cudaPointerGetAttributes).
 *   gpu_bench step SPEC BATCH SECS local [stage]   the step as workerd --local
 *       makes it: two pinned batches in turn, and between the steps the
 *       host's SGD update of the parameters (the optimizer's pass over them);
 *       with stage, each step's batch is staged (model_stage_batch) right
 *       after the step before, so its copy to the device overlaps that
 *       update: the two rows' ratio is what staging buys.
 *   gpu_bench cpu SPEC BATCH SECS [THREADS]  the same step on the CPU backend
 *       (OpenBLAS, THREADS threads, default 1), for the CPU-vs-GPU ratio.
 *   gpu_bench sgemm N SECS                  cublasSgemm N x N x N (FP32,
 *       CUBLAS_DEFAULT_MATH, as the backend) for about SECS; prints GFLOP/s.
 *   gpu_bench gemms DIMS BATCH SECS         only an MLP step's sgemm calls
 *       (DIMS e.g. 784,1024,1024,10; the shapes the backend uses, on zeros),
 *       back to back: the step's ceiling without the copies and the small
 *       kernels; prints GFLOP/s.
 * Output: one line "key=value ..." for the script, after a readable one.
 * Exit 77 with the reason when there is no CUDA device (the step, sgemm and
 * gemms commands), 1 on a failure. */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/model.h"
#include "rng.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* 1 when every pointer is page-locked host memory */
static int all_pinned(void *const *ps, int n)
{
    for (int i = 0; i < n; i++) {
        struct cudaPointerAttributes a;
        if (cudaPointerGetAttributes(&a, ps[i]) != cudaSuccess) {
            (void)cudaGetLastError();
            return 0;
        }
        if (a.type != cudaMemoryTypeHost)
            return 0;
    }
    return 1;
}

/* The sgemm FLOP of one forward_backward at batch B: per dense or conv layer
 * the forward product, the kernel's gradient, and the input's gradient where
 * a layer with parameters lies below (the backends compute it only there). */
static double step_flop(const model_layout *ly, int B)
{
    double f = 0;
    int below = 0;
    for (int li = 0; li < ly->n_layers; li++) {
        const model_layer *l = &ly->layers[li];
        double one = 0;
        if (l->kind == LAYER_DENSE)
            one = 2.0 * B * (double)l->in_numel * (double)l->out_numel;
        else if (l->kind == LAYER_CONV2D)
            one = 2.0 * B * (double)l->out.h * l->out.w * (double)l->kh * l->kw * l->in.c * l->out.c;
        else
            continue;
        f += one * (below ? 3 : 2);
        below = 1;
    }
    return f;
}

static int bench_step(const char *spec, int B, double secs, int tf32, int plain, int local, int stage,
                      int cpu_threads)
{
    char err[512], desc[256] = "";
    model_layout ly;
    const model_shape img = {28, 28, 1};
    if (B < 1 || model_layout_init(&ly, spec, img, 10, err, sizeof(err)) != 0) {
        fprintf(stderr, "gpu_bench: bad model %s or batch %d: %s\n", spec, B, B < 1 ? "batch < 1" : err);
        return 1;
    }
    const int on_cpu = cpu_threads > 0;
    if (on_cpu) {
        model_cpu_set_threads(cpu_threads);
        snprintf(desc, sizeof(desc), "cpu backend, OpenBLAS %s, %d thread%s", model_cpu_blas_core(),
                 cpu_threads, cpu_threads == 1 ? "" : "s");
    } else if (model_cuda_use(0, tf32, desc, sizeof(desc), err, sizeof(err)) != 0) {
        fprintf(stderr, "gpu_bench: %s\n", err);
        return 1;
    }
    const size_t P = ly.n_params, D = ly.n_in;
    model *m = model_new(on_cpu ? &model_backend_cpu : &model_backend_cuda, &ly, B, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "gpu_bench: %s\n", err);
        return 1;
    }
#define ALLOC(bytes) (plain ? malloc(bytes) : model_host_alloc(m, bytes))
    float *params = ALLOC(P * 4), *grads = ALLOC(P * 4), *x = ALLOC((size_t)B * D * 4);
    uint8_t *y = ALLOC((size_t)B);
    /* local: the second batch */
    float *x2 = local ? ALLOC((size_t)B * D * 4) : x;
    uint8_t *y2 = local ? ALLOC((size_t)B) : y;
#undef ALLOC
    if (!params || !grads || !x || !y || !x2 || !y2) {
        fprintf(stderr, "gpu_bench: out of host memory\n");
        return 1;
    }
    void *bufs[] = {params, grads, x, y, x2, y2};
    const char *path = on_cpu ? "host" : all_pinned(bufs, 6) ? "pinned" : "malloc";
    if (!on_cpu && !plain && strcmp(path, "pinned") != 0)
        fprintf(stderr, "gpu_bench: warning: model_host_alloc gave memory that is not page-locked\n");
    model_init_params(&ly, params, 1);
    uint64_t st = rng_stream(7, 0);
    for (size_t k = 0; k < (size_t)B * D; k++) {
        x[k] = (float)rng_uniform_open0(&st);
        x2[k] = (float)rng_uniform_open0(&st);
    }
    for (int k = 0; k < B; k++) {
        y[k] = (uint8_t)rng_below(&st, 10);
        y2[k] = (uint8_t)rng_below(&st, 10);
    }
    float *xs[2] = {x, x2};
    uint8_t *ys[2] = {y, y2};
    double loss;
    const double flop = step_flop(&ly, B);
    model_ctx ctx = {.seed = 1};
    for (int i = 0; i < 3; i++)
        if (model_forward_backward(m, params, x, y, B, &ctx, grads, &loss) != 0)
            return 1;
    long n = 0;
    double t0 = now(), t;
    if (stage && model_stage_batch(m, xs[0], ys[0], B) != 0)
        return 1;
    do {
        const int i = (int)(n & 1);
        ctx.step = n;
        ctx.example0 = (int64_t)n * B;
        if (model_forward_backward(m, params, xs[i], ys[i], B, &ctx, grads, &loss) != 0)
            return 1;
        if (stage && model_stage_batch(m, xs[i ^ 1], ys[i ^ 1], B) != 0)
            return 1;
        if (local) /* SGD with a rate that keeps the model where it is */
            for (size_t k = 0; k < P; k++)
                params[k] -= 1e-9f * grads[k];
        n++;
        t = now() - t0;
    } while (t < secs);
    double sps = n / t;
    printf("gpu_bench %s %s batch %d%s%s%s: %ld steps in %.2f s: %.2f steps/s, %.1f GFLOP/s (%.3f "
           "GFLOP a step), loss %.4f; host buffers %s (%s)\n",
           on_cpu ? "cpu" : "step", ly.spec, B, tf32 ? " tf32" : "", local ? " local (+ host SGD update)" : "",
           stage ? " staged" : "", n, t, sps, sps * flop / 1e9, flop / 1e9, loss, path, desc);
    printf("steps_per_s=%.3f gflops=%.3f flop_per_step=%.0f host_buffers=%s\n", sps, sps * flop / 1e9,
           flop, path);
    if (plain) {
        free(params);
        free(grads);
        free(x);
        free(y);
        if (local) {
            free(x2);
            free(y2);
        }
    } else { /* before model_free */
        model_host_free(m, params);
        model_host_free(m, grads);
        model_host_free(m, x);
        model_host_free(m, y);
        if (local) {
            model_host_free(m, x2);
            model_host_free(m, y2);
        }
    }
    model_free(m);
    return 0;
}

#define CKC(call)                                                                                  \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)
#define CKB(call)                                                                        \
    do {                                                                                 \
        cublasStatus_t s_ = (call);                                                      \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                               \
            fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #call, \
                    (int)s_);                                                            \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

static int bench_sgemm(int N, double secs)
{
    char err[512], desc[256];
    if (model_cuda_use(0, 0, desc, sizeof(desc), err, sizeof(err)) != 0) {
        fprintf(stderr, "gpu_bench: %s\n", err);
        return 1;
    }
    size_t bytes = (size_t)N * N * sizeof(float);
    float *a, *b, *c;
    CKC(cudaMalloc((void **)&a, bytes));
    CKC(cudaMalloc((void **)&b, bytes));
    CKC(cudaMalloc((void **)&c, bytes));
    CKC(cudaMemset(a, 0, bytes)); /* the values do not change an sgemm's speed */
    CKC(cudaMemset(b, 0, bytes));
    cublasHandle_t h;
    CKB(cublasCreate(&h));
    CKB(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < 3; i++)
        CKB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, N, N, N, &one, a, N, b, N, &zero, c, N));
    CKC(cudaDeviceSynchronize());
    long n = 0;
    double t0 = now(), t;
    do { /* in groups of 10, timed at the synchronization */
        for (int i = 0; i < 10; i++)
            CKB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, N, N, N, &one, a, N, b, N, &zero, c, N));
        CKC(cudaDeviceSynchronize());
        n += 10;
        t = now() - t0;
    } while (t < secs);
    double gf = 2.0 * N * N * (double)N * n / t / 1e9;
    printf("gpu_bench sgemm %d: %ld in %.2f s: %.1f GFLOP/s (%s)\n", N, n, t, gf, desc);
    printf("sgemm_gflops=%.3f\n", gf);
    cublasDestroy(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    return 0;
}

static int bench_gemms(const char *dims_s, int B, double secs)
{
    int dims[MODEL_MAX_ITEMS + 2], nd = 0, maxd = 0;
    char err[512], desc[256];
    for (const char *p = dims_s; *p && nd < MODEL_MAX_ITEMS + 2;) {
        dims[nd] = atoi(p);
        maxd = dims[nd] > maxd ? dims[nd] : maxd;
        nd++;
        p = strchr(p, ',');
        if (!p)
            break;
        p++;
    }
    if (nd < 2 || B < 1 || maxd < 1) {
        fprintf(stderr, "gpu_bench: bad dims %s or batch %d\n", dims_s, B);
        return 1;
    }
    if (model_cuda_use(0, 0, desc, sizeof(desc), err, sizeof(err)) != 0) {
        fprintf(stderr, "gpu_bench: %s\n", err);
        return 1;
    }
    size_t n = (size_t)maxd * (B > maxd ? B : maxd), bytes = n * sizeof(float);
    float *a, *w, *z;
    CKC(cudaMalloc((void **)&a, bytes));
    CKC(cudaMalloc((void **)&w, bytes));
    CKC(cudaMalloc((void **)&z, bytes));
    CKC(cudaMemset(a, 0, bytes));
    CKC(cudaMemset(w, 0, bytes));
    cublasHandle_t h;
    CKB(cublasCreate(&h));
    CKB(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    const float one = 1.0f, zero = 0.0f;
    double flop = 0;
    long steps = 0;
    double t0 = 0, t = 0;
    for (int round = 0; round < 2; round++) { /* round 0: warm-up, one step */
        if (round == 1)
            t0 = now();
        do {
            for (int l = nd - 2; l >= 0; l--) { /* forward, dW, dA as model_cuda.cu */
                int K = dims[l], N = dims[l + 1];
                CKB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, N, B, K, &one, w, N, a, K, &zero, z, N));
                CKB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, N, K, B, &one, a, N, z, K, &zero, w, N));
                if (l > 0)
                    CKB(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, K, B, N, &one, w, N, a, N, &zero, z, K));
                if (round == 1 && steps == 0)
                    flop += 2.0 * B * K * N * (l == 0 ? 2 : 3);
            }
            CKC(cudaDeviceSynchronize());
            if (round == 0)
                break;
            steps++;
            t = now() - t0;
        } while (t < secs);
    }
    double sps = steps / t;
    printf("gpu_bench gemms %s batch %d: %ld steps' sgemms in %.2f s: %.1f steps/s, %.1f GFLOP/s\n",
           dims_s, B, steps, t, sps, sps * flop / 1e9);
    printf("steps_per_s=%.3f gflops=%.3f flop_per_step=%.0f\n", sps, sps * flop / 1e9, flop);
    cublasDestroy(h);
    cudaFree(a);
    cudaFree(w);
    cudaFree(z);
    return 0;
}

#define USAGE                                                                                   \
    "usage: gpu_bench step SPEC BATCH SECS [tf32] [plain] [local [stage]] | gpu_bench cpu SPEC "    \
    "BATCH SECS [THREADS] | gpu_bench sgemm N SECS | gpu_bench gemms DIMS BATCH SECS\n"

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    char why[256] = "";
    if (argc < 2 || (strcmp(argv[1], "step") != 0 && strcmp(argv[1], "cpu") != 0 &&
                     strcmp(argv[1], "sgemm") != 0 && strcmp(argv[1], "gemms") != 0)) {
        fprintf(stderr, USAGE);
        return 2;
    }
    if (strcmp(argv[1], "cpu") == 0 && (argc == 5 || argc == 6)) {
        int threads = argc == 6 ? atoi(argv[5]) : 1;
        if (threads >= 1)
            return bench_step(argv[2], atoi(argv[3]), atof(argv[4]), 0, 0, 0, 0, threads);
    }
    if (strcmp(argv[1], "cpu") != 0 && model_cuda_device_count(why, sizeof(why)) < 1) {
        printf("SKIP: %s\n", why);
        return 77;
    }
    if (strcmp(argv[1], "step") == 0 && argc >= 5) {
        int tf32 = 0, plain = 0, local = 0, stage = 0, bad = 0;
        for (int i = 5; i < argc; i++) {
            if (strcmp(argv[i], "tf32") == 0)
                tf32 = 1;
            else if (strcmp(argv[i], "plain") == 0)
                plain = 1;
            else if (strcmp(argv[i], "local") == 0)
                local = 1;
            else if (strcmp(argv[i], "stage") == 0)
                stage = 1;
            else
                bad = 1;
        }
        if (stage && !local)
            bad = 1; /* staging needs a second batch to stage */
        if (!bad)
            return bench_step(argv[2], atoi(argv[3]), atof(argv[4]), tf32, plain, local, stage, 0);
    }
    if (strcmp(argv[1], "sgemm") == 0 && argc >= 4)
        return bench_sgemm(atoi(argv[2]), atof(argv[3]));
    if (strcmp(argv[1], "gemms") == 0 && argc >= 5)
        return bench_gemms(argv[2], atoi(argv[3]), atof(argv[4]));
    fprintf(stderr, USAGE);
    return 2;
}
