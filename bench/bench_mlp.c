/* bench_mlp.c - speed of the CPU backend's training step for the MLP
 * (model_forward_backward on mlp:100 and mlp:1024,1024) against plain
 * cblas_sgemm, on one BLAS thread. (Before the MLP-only client/mlp_cpu.c was
 * removed, it also timed that code's step in the same run: mlp:100 at batch
 * 100, new/old 0.99 and 0.95 in two runs on a loaded machine.)
 *
 *   bench_mlp [--seconds=S] [--reps=N] [--threads=T]
 *
 * For 784-100-10 at batch 100 (the example) and 784-1024-1024-10 at batch 256 it
 * prints steps/s and the GFLOP/s they amount to (FLOPs = the GEMMs: 2*B*K*N per
 * layer forward, twice that backward except the first layer's input gradient,
 * which is not computed), next to two references with the same FLOPs:
 *  - gemm-only: the step's own sgemm calls, same shapes, nothing else
 *    (what the fused bias/ReLU/softmax loops cost is the difference);
 *  - square: one n x n x n sgemm with n^3 * 2 ~ the step's FLOPs.
 * Figures are medians of N runs of S seconds each, interleaved. The kernel is
 * chosen as workerd chooses it (blas_kernel_choose: an OPENBLAS_CORETYPE in
 * the environment wins); the first lines say which and why. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/blas_kernel.h"
#include "model/model.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct bench_case {
    const char *label, *spec;
    int batch;
} bench_case;

typedef struct gemm_call {
    int ta, tb, M, N, K;
    const float *A, *B;
    float *C;
    int lda, ldb, ldc;
} gemm_call;

int main(int argc, char **argv)
{
    double seconds = 1.0;
    int reps = 5, threads = 1;
    for (int i = 1; i < argc; i++) {
        if (sscanf(argv[i], "--seconds=%lf", &seconds) == 1 || sscanf(argv[i], "--reps=%d", &reps) == 1 ||
            sscanf(argv[i], "--threads=%d", &threads) == 1)
            continue;
        fprintf(stderr, "usage: bench_mlp [--seconds=S] [--reps=N] [--threads=T]\n");
        return 2;
    }
    if (reps < 1 || reps > 99 || seconds <= 0) {
        fprintf(stderr, "bench_mlp: bad --reps or --seconds\n");
        return 2;
    }
    char kerr[512];
    if (blas_kernel_choose(argv, kerr, sizeof(kerr)) != 0) {
        fprintf(stderr, "bench_mlp: %s\n", kerr);
        return 1;
    }
    model_cpu_set_threads(threads);
    const char *ct = getenv("OPENBLAS_CORETYPE");
    printf("OpenBLAS %s, core %s, OPENBLAS_CORETYPE=%s, %d thread(s)\n%s\n", openblas_get_config(),
           model_cpu_blas_core(), ct ? ct : "(unset)", threads, blas_kernel_reason());

    const bench_case cases[] = {
        {"784-100-10", "mlp:100", 100},
        {"784-1024-1024-10", "mlp:1024,1024", 256},
    };
    int status = 0;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const bench_case *bc = &cases[c];
        model_layout ly;
        char err[256];
        if (model_layout_init(&ly, bc->spec, (model_shape){28, 28, 1}, 10, err, sizeof(err)) != 0) {
            fprintf(stderr, "bench_mlp: %s\n", err);
            return 1;
        }
        /* the dense layers: dims[0] inputs, dims[l + 1] layer l's units */
        int dims[MODEL_MAX_LAYERS + 1], L = 0;
        dims[0] = (int)ly.n_in;
        for (int l = 0; l < ly.n_layers; l++)
            if (ly.layers[l].kind == LAYER_DENSE)
                dims[++L] = (int)ly.layers[l].out_numel;
        const int B = bc->batch;
        float *params = malloc(ly.n_params * sizeof(float));
        float *grads = malloc(ly.n_params * sizeof(float));
        float *x = malloc((size_t)B * 784 * sizeof(float));
        uint8_t *labels = malloc((size_t)B);
        model_init_params(&ly, params, 1);
        uint64_t s = 12345;
        for (int i = 0; i < B * 784; i++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            x[i] = (float)(s >> 40) / (float)(1 << 24);
        }
        for (int i = 0; i < B; i++)
            labels[i] = (uint8_t)(i % 10);
        model *m = model_new(&model_backend_cpu, &ly, B, err, sizeof(err));
        if (!m) {
            fprintf(stderr, "bench_mlp: %s\n", err);
            return 1;
        }
        const model_ctx ctx = {.seed = 1};

        /* The same GEMMs as a step, on scratch buffers of the same sizes. */
        gemm_call calls[3 * MODEL_MAX_LAYERS];
        int n_calls = 0;
        double flops = 0;
        size_t dmax = 0;
        for (int l = 1; l <= L; l++)
            dmax = (size_t)dims[l] > dmax ? (size_t)dims[l] : dmax;
        float *scratch = calloc((size_t)B * dmax * (size_t)(L + 3), sizeof(float));
        float *gscratch = calloc(ly.n_params, sizeof(float));
        for (int l = 0; l < L; l++) {
            int K = dims[l], N = dims[l + 1];
            const float *a = l == 0 ? x : scratch + (size_t)l * B * dmax;
            float *z = scratch + (size_t)(l + 1) * B * dmax;
            const float *W = params + ly.tensors[2 * l].offset;
            calls[n_calls++] = (gemm_call){CblasNoTrans, CblasNoTrans, B, N, K, a, W, z, K, N, N};
            float *dz = scratch + (size_t)(L + 1) * B * dmax, *da = scratch + (size_t)(L + 2) * B * dmax;
            calls[n_calls++] = (gemm_call){CblasTrans, CblasNoTrans, K, N, B, a, dz,
                                           gscratch + ly.tensors[2 * l].offset, K, N, N};
            flops += 4.0 * B * K * N;
            if (l > 0) {
                calls[n_calls++] = (gemm_call){CblasNoTrans, CblasTrans, B, K, N, dz, W, da, N, N, K};
                flops += 2.0 * B * K * N;
            }
        }
        int n = (int)lround(cbrt(flops / 2));
        float *sa = calloc((size_t)n * n, sizeof(float)), *sb = calloc((size_t)n * n, sizeof(float)),
              *sc = calloc((size_t)n * n, sizeof(float));
        for (size_t i = 0; i < (size_t)n * n; i++) {
            sa[i] = (float)(i % 7) * 0.1f;
            sb[i] = (float)(i % 5) * 0.1f;
        }

        double r_step[100], r_gemm[100], r_sq[100];
        double loss = 0;
        for (int rep = -1; rep < reps; rep++) { /* rep -1: warm-up, not counted */
            double t0 = now(), t;
            long k = 0;
            do {
                if (model_forward_backward(m, params, x, labels, B, &ctx, grads, &loss) != 0) {
                    fprintf(stderr, "bench_mlp: forward_backward failed\n");
                    return 1;
                }
                k++;
            } while ((t = now() - t0) < seconds);
            if (rep >= 0)
                r_step[rep] = (double)k / t;

            t0 = now();
            k = 0;
            do {
                for (int i = 0; i < n_calls; i++) {
                    const gemm_call *g = &calls[i];
                    cblas_sgemm(CblasRowMajor, g->ta, g->tb, g->M, g->N, g->K, 1.0f, g->A, g->lda,
                                g->B, g->ldb, 0.0f, g->C, g->ldc);
                }
                k++;
            } while ((t = now() - t0) < seconds);
            if (rep >= 0)
                r_gemm[rep] = (double)k / t;

            t0 = now();
            k = 0;
            do {
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, sa, n, sb, n,
                            0.0f, sc, n);
                k++;
            } while ((t = now() - t0) < seconds);
            if (rep >= 0)
                r_sq[rep] = (double)k / t;
        }
        double step = median(r_step, reps), gemm = median(r_gemm, reps), sq = median(r_sq, reps);
        double sqflops = 2.0 * n * n * n;
        printf("%s batch %d: %.1f MFLOP/step (GEMMs)\n", bc->label, B, flops / 1e6);
        printf("  model_forward_backward (%s): %9.1f steps/s  %7.3f ms/step  %6.1f GFLOP/s\n", ly.spec,
               step, 1e3 / step, step * flops / 1e9);
        printf("  gemm-only (same calls): %7.1f steps/s  %7.3f ms/step  %6.1f GFLOP/s  step/gemm-only %.2f\n",
               gemm, 1e3 / gemm, gemm * flops / 1e9, step / gemm);
        printf("  square sgemm n=%d:     %7.1f /s        %7.3f ms        %6.1f GFLOP/s  step/square %.2f\n",
               n, sq, 1e3 / sq, sq * sqflops / 1e9, step * flops / (sq * sqflops));
        printf("  (loss %.4f)\n", loss);
        if (!isfinite(loss))
            status = 1;
        model_free(m);
        free(params);
        free(grads);
        free(x);
        free(labels);
        free(scratch);
        free(gscratch);
        free(sa);
        free(sb);
        free(sc);
    }
    return status;
}
