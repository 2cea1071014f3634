/* mlp_cpu.c - the CPU backend of mlp.h: every linear layer is one OpenBLAS
 * cblas_sgemm (row-major) forward and two backward; bias, ReLU, softmax and the
 * column sums for the bias gradients are fused single-pass loops around them.
 * The workspace is allocated (and touched) once in create(); a step allocates
 * nothing. This is the reference the CUDA backend is tested against. */
#include "errmsg.h"
#include "mlp.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct mlp_cpu {
    mlp base; /* first: an mlp_cpu * is an mlp * */
    /* act[l], l = 1..L: the output of layer l-1, [max_batch, dims[l]];
     * hidden ones after ReLU, act[L] the logits. act[0] is the caller's x. */
    float *act[MLP_MAX_LAYERS + 1];
    /* Two [max_batch, max dims[1..L]] buffers for dL/dz and dL/da, used in turn. */
    float *d[2];
    float *mem; /* owns all of the above */
} mlp_cpu;

void mlp_cpu_set_threads(int n)
{
    openblas_set_num_threads(n < 1 ? 1 : n);
}

const char *mlp_cpu_blas_core(void)
{
    return openblas_get_corename();
}

static mlp *cpu_create(const mlp_layout *layout, int max_batch, char *err, size_t errlen)
{
    const int L = layout->n_layers;
    size_t B = (size_t)max_batch, total = 0, dmax = 0;
    for (int l = 1; l <= L; l++) {
        total += B * (size_t)layout->dims[l];
        if ((size_t)layout->dims[l] > dmax)
            dmax = (size_t)layout->dims[l];
    }
    total += 2 * B * dmax;
    mlp_cpu *c = calloc(1, sizeof(*c));
    /* 64-byte aligned; the size rounded up to a multiple of the alignment. */
    size_t bytes = (total * sizeof(float) + 63) & ~(size_t)63;
    float *mem = c ? aligned_alloc(64, bytes) : NULL;
    if (!c || !mem) {
        free(c);
        errmsg(err, errlen, "mlp: out of memory for a %zu-byte workspace (batch %d)", bytes, max_batch);
        return NULL;
    }
    memset(mem, 0, bytes); /* touch every page now, not in the first step */
    c->base.backend = &mlp_backend_cpu;
    c->base.layout = *layout;
    c->base.max_batch = max_batch;
    c->mem = mem;
    float *p = mem;
    for (int l = 1; l <= L; l++) {
        c->act[l] = p;
        p += B * (size_t)layout->dims[l];
    }
    c->d[0] = p;
    c->d[1] = p + B * dmax;
    return &c->base;
}

/* The elementwise loops below work in fixed chunks of VEC floats with
 * restrict pointers: at -O2, GCC vectorizes only loops it can replace whole,
 * and a chunk of known length is one; the branchless vector select also avoids
 * the branch mispredictions a scalar ReLU suffers on random signs. */
#define VEC 16

/* z[B, N] = relu(z + b) */
static void bias_relu(float *restrict z, const float *restrict b, int B, int N)
{
    for (int i = 0; i < B; i++) {
        float *restrict zi = z + (size_t)i * N;
        int j = 0;
        for (; j + VEC <= N; j += VEC)
            for (int k = 0; k < VEC; k++) {
                float v = zi[j + k] + b[j + k];
                zi[j + k] = v > 0.0f ? v : 0.0f;
            }
        for (; j < N; j++) {
            float v = zi[j] + b[j];
            zi[j] = v > 0.0f ? v : 0.0f;
        }
    }
}

/* z[B, N] += b */
static void bias_add(float *restrict z, const float *restrict b, int B, int N)
{
    for (int i = 0; i < B; i++) {
        float *restrict zi = z + (size_t)i * N;
        int j = 0;
        for (; j + VEC <= N; j += VEC)
            for (int k = 0; k < VEC; k++)
                zi[j + k] += b[j + k];
        for (; j < N; j++)
            zi[j] += b[j];
    }
}

/* The ReLU's backward: d[B, K] = d * (a > 0), and db[K] = column sums of the result. */
static void relu_back_colsum(float *restrict d, const float *restrict a, float *restrict db, int B,
                             int K)
{
    memset(db, 0, (size_t)K * sizeof(float));
    for (int i = 0; i < B; i++) {
        float *restrict di = d + (size_t)i * K;
        const float *restrict ai = a + (size_t)i * K;
        int j = 0;
        for (; j + VEC <= K; j += VEC)
            for (int k = 0; k < VEC; k++) {
                float v = ai[j + k] > 0.0f ? di[j + k] : 0.0f;
                di[j + k] = v;
                db[j + k] += v;
            }
        for (; j < K; j++) {
            float v = ai[j] > 0.0f ? di[j] : 0.0f;
            di[j] = v;
            db[j] += v;
        }
    }
}

static void cpu_destroy(mlp *m)
{
    mlp_cpu *c = (mlp_cpu *)m;
    free(c->mem);
    free(c);
}

/* Forward through every layer for rows x[0..B); logits land in act[L]. */
static void forward(mlp_cpu *c, const float *params, const float *x, int B)
{
    const mlp_layout *ly = &c->base.layout;
    const int L = ly->n_layers;
    const float *a = x;
    for (int l = 0; l < L; l++) {
        const int K = ly->dims[l], N = ly->dims[l + 1];
        const float *W = params + ly->tensors[2 * l].offset; /* [K, N] */
        const float *b = params + ly->tensors[2 * l + 1].offset;
        float *z = c->act[l + 1];                            /* [B, N] */
        /* z = a @ W */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, N, K, 1.0f, a, K, W, N, 0.0f,
                    z, N);
        if (l < L - 1)
            bias_relu(z, b, B, N);
        else
            bias_add(z, b, B, N); /* the logits */
        a = z;
    }
}

static int check_labels(const uint8_t *labels, int64_t n, int n_out)
{
    for (int64_t i = 0; i < n; i++)
        if (labels[i] >= n_out)
            return -1;
    return 0;
}

static int cpu_forward_backward(mlp *m, const float *params, const float *x,
                                const uint8_t *labels, int B, float *grads, double *loss)
{
    mlp_cpu *c = (mlp_cpu *)m;
    const mlp_layout *ly = &m->layout;
    const int L = ly->n_layers, C = ly->dims[L];
    if (B < 1 || B > m->max_batch || !params || !x || !labels || !grads || !loss)
        return -1;
    if (check_labels(labels, B, C) != 0)
        return -1;

    forward(c, params, x, B);

    /* Softmax cross-entropy, stable (max subtracted), fused with dL/dlogits and
     * its column sum (the output bias gradient).
     * logits [B, C]; dz [B, C] = (softmax - onehot) / B; dsm_b [C] = sum_i dz_i. */
    const float *logits = c->act[L];
    float *dz = c->d[0];
    float *db = grads + ly->tensors[2 * (L - 1) + 1].offset;
    memset(db, 0, (size_t)C * sizeof(float));
    const float invB = 1.0f / (float)B;
    double total = 0.0;
    for (int i = 0; i < B; i++) {
        const float *zi = logits + (size_t)i * C;
        float *di = dz + (size_t)i * C;
        float mx = zi[0];
        for (int j = 1; j < C; j++)
            mx = zi[j] > mx ? zi[j] : mx;
        float s = 0.0f;
        for (int j = 0; j < C; j++) {
            float e = expf(zi[j] - mx);
            di[j] = e;
            s += e;
        }
        const int y = labels[i];
        total += (double)logf(s) - (double)(zi[y] - mx);
        const float k = invB / s;
        for (int j = 0; j < C; j++)
            di[j] *= k;
        di[y] -= invB;
        for (int j = 0; j < C; j++)
            db[j] += di[j];
    }
    *loss = total / B;

    /* Backward, layer L-1 down to 0; dz holds dL/dz_l [B, N]:
     *   dW_l [K, N] = a_l^T @ dz;  da_l [B, K] = dz @ W_l^T;
     *   dz_{l-1} = da_l * (a_l > 0), db_{l-1} = column sums, in one pass. */
    int cur = 0;
    for (int l = L - 1; l >= 0; l--) {
        const int K = ly->dims[l], N = ly->dims[l + 1];
        const float *a = l == 0 ? x : c->act[l];
        const float *W = params + ly->tensors[2 * l].offset;
        float *dW = grads + ly->tensors[2 * l].offset;
        const float *dzl = c->d[cur];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, N, B, 1.0f, a, K, dzl, N, 0.0f,
                    dW, N);
        if (l == 0)
            break;
        float *da = c->d[cur ^ 1];
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, K, N, 1.0f, dzl, N, W, N, 0.0f,
                    da, K);
        /* dz_{l-1} in place of da_l; its column sums are b_{l-1}'s gradient */
        relu_back_colsum(da, a, grads + ly->tensors[2 * (l - 1) + 1].offset, B, K);
        cur ^= 1;
    }
    return 0;
}

static int cpu_evaluate(mlp *m, const float *params, const float *x, const uint8_t *labels,
                        int64_t n, double *loss, double *accuracy)
{
    mlp_cpu *c = (mlp_cpu *)m;
    const mlp_layout *ly = &m->layout;
    const int L = ly->n_layers, C = ly->dims[L], D = ly->dims[0];
    if (n < 1 || !params || !x || !labels || !loss || !accuracy)
        return -1;
    if (check_labels(labels, n, C) != 0)
        return -1;
    double total = 0.0;
    int64_t correct = 0;
    for (int64_t start = 0; start < n; start += m->max_batch) {
        int B = (int)(n - start < m->max_batch ? n - start : m->max_batch);
        forward(c, params, x + (size_t)start * D, B);
        const float *logits = c->act[L];
        for (int i = 0; i < B; i++) {
            const float *zi = logits + (size_t)i * C;
            int arg = 0;
            float mx = zi[0];
            for (int j = 1; j < C; j++)
                if (zi[j] > mx) {
                    mx = zi[j];
                    arg = j;
                }
            float s = 0.0f;
            for (int j = 0; j < C; j++)
                s += expf(zi[j] - mx);
            const int y = labels[start + i];
            total += (double)logf(s) - (double)(zi[y] - mx);
            correct += arg == y;
        }
    }
    *loss = total / (double)n;
    *accuracy = (double)correct / (double)n;
    return 0;
}

const mlp_backend mlp_backend_cpu = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .forward_backward = cpu_forward_backward,
    .evaluate = cpu_evaluate,
    /* no host_alloc (calloc does), no stage_batch: the CPU computes on the
     * caller's x itself, there is nothing to move ahead */
};
