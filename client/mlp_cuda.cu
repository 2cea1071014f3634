/* mlp_cuda.cu - the CUDA backend of mlp.h, function for function the CPU
 * backend (mlp_cpu.c): every linear layer is one cublasSgemm forward and two
 * backward; small kernels do the bias add, the ReLU and its gradient, the
 * softmax cross-entropy with its gradient, and the loss and accuracy sums; the
 * bias gradients (column sums) are one cublasSgemv with a vector of ones.
 *
 * Row-major on cuBLAS's column-major: a row-major [M, N] matrix is the
 * column-major [N, M] matrix (its transpose) with the same leading dimension,
 * so row-major C = A @ B is computed as C^T = B^T A^T.
 *
 * Everything lives on the device, allocated once in create(): one parameter
 * buffer and one gradient buffer in the CPU layout, the activations, the
 * batch. The caller's params, batch, labels and gradients travel by DMA from
 * and to pinned host memory (cudaHostAlloc): directly from and to the
 * caller's buffers when they are pinned, that is when they lie in memory this
 * instance's host_alloc handed out (mlp_host_alloc; a table of those ranges
 * says so, exactly and cheaply); otherwise through the instance's own pinned
 * staging buffers, with a host memcpy (e.g. evaluate's x, the dataset's
 * images). One compute stream, one synchronization per step: the copies in,
 * the compute and the copies out are queued back to back. Three streams
 * around it overlap copies with the compute:
 *  - in: parameters coming in directly arrive layer by layer: W_0, b_0 (and
 *    the batch) on the compute stream, W_l, b_l for l >= 1 on in, after them,
 *    each with an event the compute stream waits for just before layer l's
 *    forward sgemm, so layer l-1's forward hides layer l's upload.
 *  - in also carries the next batch, when the caller stages it ahead
 *    (stage_batch, mlp.h's mlp_stage_batch) into a second device batch
 *    buffer (slot 1; slot 0 takes every batch copied in the step itself), with
 *    an event the step that uses it waits for.
 *  - out: gradients going out directly leave layer by layer, each layer's as
 *    soon as the backward pass has computed it (an event per layer),
 *    overlapping the rest of the backward pass.
 * The staged copies are cut into pieces so that the host's memcpy into (out
 * of) the staging buffer of one piece overlaps the DMA of the previous one.
 * Every function returns with every stream idle, failures included, so no
 * DMA touches a caller's buffer after the call; the one exception is
 * stage_batch, whose copy from the caller's pinned batch may run until the
 * next forward_backward (or evaluate, stage_batch, host_free of that buffer,
 * destroy), which waits for it.
 *
 * TF32 is off by default (CUBLAS_DEFAULT_MATH: full FP32 sgemm, results match
 * the CPU reference to ~1e-6); mlp_cuda_use(..., tf32 = 1) opts in.
 *
 * Every CUDA and cuBLAS call is checked: file, line, the call and the
 * library's error string. A failure inside a step prints that line on stderr
 * (the backend table's functions have no error buffer) and returns -1.
 *
 * Linking: the CUDA runtime is static (it loads the driver, libcuda.so, itself
 * when first used) and cuBLAS is loaded with dlopen once a device is chosen:
 * libcublas + libcublasLt are ~600 MB, and linking them made every workerd
 * start 0.8 s slower, GPU or not. So workerd starts on any machine; only
 * --device=cuda/auto on a machine with a device needs libcublas.so.N (the
 * toolkit's major version), found on the library path or in the toolkit's
 * lib64 the build used. */
extern "C" {
#include "errmsg.h"
#include "mlp.h"
}

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The device chosen by mlp_cuda_use (process-wide, like the CPU backend's
 * thread count); -1: none chosen yet (create() then uses device 0). */
static int g_device = -1;
static int g_tf32 = 0;

#ifndef RESTPS_CUDA_LIBDIR
#define RESTPS_CUDA_LIBDIR "/usr/local/cuda/lib64"
#endif
#define STR_(x) #x
#define STR(x) STR_(x)
#define CUBLAS_SONAME "libcublas.so." STR(CUBLAS_VER_MAJOR)

/* The cuBLAS functions this file calls, from dlopen (see the top). */
static struct {
    void *lib;
    decltype(&cublasCreate_v2) Create;
    decltype(&cublasDestroy_v2) Destroy;
    decltype(&cublasSetStream_v2) SetStream;
    decltype(&cublasSetMathMode) SetMathMode;
    decltype(&cublasSgemm_v2) Sgemm;
    decltype(&cublasSgemv_v2) Sgemv;
} blas;

/* 0, or -1 with err; once per process (the first caller is the main thread). */
static int blas_load(char *err, size_t errlen)
{
    if (blas.lib)
        return 0;
    const char *names[] = {CUBLAS_SONAME, RESTPS_CUDA_LIBDIR "/" CUBLAS_SONAME};
    char first[512] = "";
    void *h = NULL;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !h; i++) {
        h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!h && !first[0])
            snprintf(first, sizeof(first), "%s", dlerror());
    }
    if (!h)
        return errmsg(err, errlen,
                      "cannot load cuBLAS (%s, nor in " RESTPS_CUDA_LIBDIR "): %s; install the "
                      "CUDA toolkit's libcublas or add its folder to LD_LIBRARY_PATH",
                      CUBLAS_SONAME, first);
#define SYM(field, name)                                                                    \
    if (!(blas.field = (decltype(blas.field))dlsym(h, name))) {                             \
        errmsg(err, errlen, "%s has no %s: a cuBLAS older than this build's (%d)",        \
               CUBLAS_SONAME, name, CUBLAS_VER_MAJOR);                                      \
        dlclose(h);                                                                         \
        return -1;                                                                          \
    }
    SYM(Create, "cublasCreate_v2")
    SYM(Destroy, "cublasDestroy_v2")
    SYM(SetStream, "cublasSetStream_v2")
    SYM(SetMathMode, "cublasSetMathMode")
    SYM(Sgemm, "cublasSgemm_v2")
    SYM(Sgemv, "cublasSgemv_v2")
#undef SYM
    blas.lib = h;
    return 0;
}

static const char *cublas_name(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_(unknown)";
    }
}

/* In a function with `char *err, size_t errlen` and a `fail:` label. */
#define CK(call)                                                                            \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            errmsg(err, errlen, "%s:%d: %s: %s", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(e_));                                                 \
            goto fail;                                                                      \
        }                                                                                   \
    } while (0)
#define CKB(call)                                                                           \
    do {                                                                                    \
        cublasStatus_t s_ = (call);                                                         \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                  \
            errmsg(err, errlen, "%s:%d: %s: %s", __FILE__, __LINE__, #call, cublas_name(s_)); \
            goto fail;                                                                      \
        }                                                                                   \
    } while (0)
/* after a kernel launch: a bad configuration shows here, a fault at the sync */
#define CKL() CK(cudaGetLastError())

/* pinned host memory handed out by host_alloc: [base, base + bytes) */
typedef struct pinned_range {
    uintptr_t base;
    size_t bytes;
} pinned_range;

typedef struct mlp_cuda {
    mlp base; /* first: an mlp_cuda * is an mlp * */
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    /* device */
    float *params, *grads;               /* n_params each, the CPU layout */
    float *xs[2];                        /* [max_batch, n_in] each: slot 0 the step's, 1 the staged */
    uint8_t *ys[2];                      /* [max_batch] each, the same */
    float *act[MLP_MAX_LAYERS + 1];      /* act[l], l = 1..L as in mlp_cpu.c */
    float *d[2];                         /* [max_batch, max dims[1..L]] each */
    float *ones;                         /* [max_batch] of 1.0f: column sums by gemv */
    double *rowloss;                     /* [max_batch] */
    int *rowright;                       /* [max_batch]: argmax == label */
    double *sums;                        /* [2]: loss sum, correct count */
    void *dmem;                          /* owns all device memory above */
    /* pinned host: the staging buffers */
    float *h_params, *h_grads, *h_x;
    uint8_t *h_y;
    double *h_sums;
    void *hmem;                          /* owns all pinned memory above */
    cudaEvent_t piece_done[8];           /* copy_out's pieces */
    int n_events;
    cudaStream_t out;                    /* direct gradient copies, layer by layer */
    cudaEvent_t layer_done[MLP_MAX_LAYERS]; /* layer l's gradients are computed */
    int n_layer_events;
    cudaStream_t in;                     /* direct parameter uploads (l >= 1), staged batches */
    cudaEvent_t in0_done;                /* the compute stream's copies in are queued before it */
    cudaEvent_t param_ready[MLP_MAX_LAYERS]; /* W_l, b_l (l >= 1) are on the device */
    int n_param_events;
    cudaEvent_t staged_ev;               /* the staged batch is in slot 1 */
    int staged;                          /* stage_batch's batch: in or on its way to slot 1 */
    const float *st_x;                   /* ... from these host buffers, this batch */
    const uint8_t *st_y;
    int st_B;
    pinned_range *pinned;                /* host_alloc's pinned memory */
    int n_pinned, cap_pinned;
    int warned_unpinned;                 /* host_alloc's fallback said so once */
} mlp_cuda;

/* the pieces of copy_in and copy_out */
#define PIECE_BYTES ((size_t)2 << 20)
#define OUT_PIECES 8

/* ---- kernels ---- */

/* z[B, N] = relu(z + b) (relu = 1) or z + b (relu = 0); blocks stride over
 * the rows (y) and the columns (x), so no index needs a division. */
static __global__ void k_bias_act(float *z, const float *b, int B, int N, int relu)
{
    for (int r = blockIdx.y; r < B; r += gridDim.y) {
        float *zr = z + (size_t)r * N;
        for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < N; j += gridDim.x * blockDim.x) {
            float v = zr[j] + b[j];
            zr[j] = relu ? (v > 0.0f ? v : 0.0f) : v;
        }
    }
}

/* The ReLU's backward: d = d * (a > 0) */
static __global__ void k_relu_back(float *d, const float *a, size_t total)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        d[i] = a[i] > 0.0f ? d[i] : 0.0f;
}

static __global__ void k_fill(float *p, float v, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = v;
}

/* One thread per row of logits [B, C], as mlp_cpu.c's loop: the stable
 * softmax cross-entropy into rowloss[i], argmax == label (the first maximum
 * wins a tie) into rowright[i], and, when dz is not NULL,
 * dz[i] = (softmax - onehot) / B. */
static __global__ void k_softmax_xent(const float *logits, const uint8_t *y, int B, int C, float invB,
                               float *dz, double *rowloss, int *rowright)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B)
        return;
    const float *zi = logits + (size_t)i * C;
    float mx = zi[0];
    int arg = 0;
    for (int j = 1; j < C; j++)
        if (zi[j] > mx) {
            mx = zi[j];
            arg = j;
        }
    float s = 0.0f;
    float *di = dz ? dz + (size_t)i * C : NULL;
    for (int j = 0; j < C; j++) {
        float e = expf(zi[j] - mx);
        if (di)
            di[j] = e;
        s += e;
    }
    const int yi = y[i];
    rowloss[i] = (double)logf(s) - (double)(zi[yi] - mx);
    rowright[i] = arg == yi;
    if (di) {
        const float k = invB / s;
        for (int j = 0; j < C; j++)
            di[j] *= k;
        di[yi] -= invB;
    }
}

/* sums[0] (+)= sum rowloss, sums[1] (+)= sum rowright; one block of
 * SUM_THREADS threads, in double, deterministic. */
#define SUM_THREADS 256
static __global__ void k_sum_rows(const double *rowloss, const int *rowright, int B, double *sums,
                           int accumulate)
{
    __shared__ double sl[SUM_THREADS], sr[SUM_THREADS];
    double l = 0.0, r = 0.0;
    for (int i = threadIdx.x; i < B; i += SUM_THREADS) {
        l += rowloss[i];
        r += rowright[i];
    }
    sl[threadIdx.x] = l;
    sr[threadIdx.x] = r;
    __syncthreads();
    for (int w = SUM_THREADS / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w) {
            sl[threadIdx.x] += sl[threadIdx.x + w];
            sr[threadIdx.x] += sr[threadIdx.x + w];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        sums[0] = (accumulate ? sums[0] : 0.0) + sl[0];
        sums[1] = (accumulate ? sums[1] : 0.0) + sr[0];
    }
}

static unsigned grid_for(size_t n, unsigned threads)
{
    size_t g = (n + threads - 1) / threads;
    return (unsigned)(g < 4096 ? (g ? g : 1) : 4096); /* grid-stride loops do the rest */
}

/* ---- helpers of the header ---- */

extern "C" int mlp_cuda_built(void)
{
    return 1;
}

extern "C" int mlp_cuda_device_count(char *err, size_t errlen)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        /* no driver, no device: "no device", not a failure */
        errmsg(err, errlen, "no CUDA device (cudaGetDeviceCount: %s)", cudaGetErrorString(e));
        (void)cudaGetLastError(); /* clear it */
        return 0;
    }
    if (n == 0)
        errmsg(err, errlen, "no CUDA device (cudaGetDeviceCount found none)");
    return n;
}

extern "C" int mlp_cuda_use(int gpu, int tf32, char *desc, size_t desclen, char *err,
                            size_t errlen)
{
    char why[256] = "";
    int n = mlp_cuda_device_count(why, sizeof(why));
    cudaDeviceProp p;
    size_t free_b = 0, total_b = 0;
    if (n < 1)
        return errmsg(err, errlen, "%s", why);
    if (gpu < 0 || gpu >= n)
        return errmsg(err, errlen, "--gpu=%d: this process sees %d CUDA device%s (0 to %d; "
                                   "CUDA_VISIBLE_DEVICES narrows and renumbers them)",
                      gpu, n, n == 1 ? "" : "s", n - 1);
    if (blas_load(err, errlen) != 0)
        return -1;
    CK(cudaSetDevice(gpu));
    CK(cudaGetDeviceProperties(&p, gpu));
    CK(cudaMemGetInfo(&free_b, &total_b));
    g_device = gpu;
    g_tf32 = tf32 != 0;
    if (desc && desclen)
        snprintf(desc, desclen, "GPU %d of %d: %s, sm_%d%d, %.1f GiB free of %.1f, TF32 %s", gpu, n,
                 p.name, p.major, p.minor, free_b / 1073741824.0, total_b / 1073741824.0,
                 g_tf32 ? "on" : "off");
    return 0;
fail:
    return -1;
}

extern "C" const mlp_backend *mlp_cuda_backend(void)
{
    return &mlp_backend_cuda;
}

/* ---- the backend ---- */

static void cuda_destroy(mlp *m);

static mlp *cuda_create(const mlp_layout *layout, int max_batch, char *err, size_t errlen)
{
    const int L = layout->n_layers;
    const size_t B = (size_t)max_batch, P = layout->n_params, D = (size_t)layout->dims[0];
    /* forward_backward copies layer l's gradients out as one range from W_l's
     * start to b_l's end: the layout must be W_0 b_0 W_1 b_1 ... back to back */
    for (int l = 0, t = 0; l < L; l++, t += 2)
        if (layout->tensors[t].offset != (l ? layout->tensors[t - 1].offset + layout->tensors[t - 1].numel : 0) ||
            layout->tensors[t + 1].offset != layout->tensors[t].offset + layout->tensors[t].numel ||
            (l == L - 1 && layout->tensors[t + 1].offset + layout->tensors[t + 1].numel != P)) {
            errmsg(err, errlen, "mlp_cuda: the layout is not W_0 b_0 W_1 b_1 ... back to back");
            return NULL;
        }
    size_t dmax = 0, nact = 0;
    for (int l = 1; l <= L; l++) {
        nact += B * (size_t)layout->dims[l];
        if ((size_t)layout->dims[l] > dmax)
            dmax = (size_t)layout->dims[l];
    }
    /* the device block: floats (256-byte aligned pieces), then the rest */
#define ALIGN(n) (((n) + 255) & ~(size_t)255)
    size_t off_params = 0, off_grads = ALIGN(P * 4), off_x = off_grads + ALIGN(P * 4);
    size_t off_act = off_x + 2 * ALIGN(B * D * 4), off_d = off_act + ALIGN(nact * 4);
    size_t off_ones = off_d + ALIGN(2 * B * dmax * 4), off_rowloss = off_ones + ALIGN(B * 4);
    size_t off_rowright = off_rowloss + ALIGN(B * 8), off_sums = off_rowright + ALIGN(B * 4);
    size_t off_y = off_sums + ALIGN(2 * 8), dbytes = off_y + 2 * ALIGN(B);
    /* pinned host: params, grads, x, y, sums */
    size_t h_grads = ALIGN(P * 4), h_x = h_grads + ALIGN(P * 4), h_y = h_x + ALIGN(B * D * 4);
    size_t h_sums = h_y + ALIGN(B), hbytes = h_sums + ALIGN(2 * 8);
    const size_t x_slot = ALIGN(B * D * 4), y_slot = ALIGN(B);
#undef ALIGN
    char *dm, *hm;
    cudaError_t e;
    mlp_cuda *c = (mlp_cuda *)calloc(1, sizeof(*c));
    if (!c) {
        errmsg(err, errlen, "mlp_cuda: out of host memory");
        return NULL;
    }
    c->base.backend = &mlp_backend_cuda;
    c->base.layout = *layout;
    c->base.max_batch = max_batch;
    c->device = g_device < 0 ? 0 : g_device;
    if (blas_load(err, errlen) != 0)
        goto fail;
    CK(cudaSetDevice(c->device));
    e = cudaMalloc(&c->dmem, dbytes);
    if (e == cudaErrorMemoryAllocation) {
        size_t fr = 0, tot = 0;
        (void)cudaGetLastError();
        cudaMemGetInfo(&fr, &tot);
        errmsg(err, errlen,
               "%s:%d: out of device memory: the model (%zu parameters) at batch %d needs %zu "
               "bytes on GPU %d, %zu of %zu are free",
               __FILE__, __LINE__, P, max_batch, dbytes, c->device, fr, tot);
        goto fail;
    }
    CK(e);
    e = cudaHostAlloc(&c->hmem, hbytes, cudaHostAllocDefault);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        errmsg(err, errlen, "%s:%d: cudaHostAlloc: out of pinned host memory: %zu bytes asked",
               __FILE__, __LINE__, hbytes);
        goto fail;
    }
    CK(e);
    dm = (char *)c->dmem;
    hm = (char *)c->hmem;
    c->params = (float *)(dm + off_params);
    c->grads = (float *)(dm + off_grads);
    c->xs[0] = (float *)(dm + off_x);
    c->xs[1] = (float *)(dm + off_x + x_slot);
    {
        float *p = (float *)(dm + off_act);
        for (int l = 1; l <= L; l++) {
            c->act[l] = p;
            p += B * (size_t)layout->dims[l];
        }
    }
    c->d[0] = (float *)(dm + off_d);
    c->d[1] = c->d[0] + B * dmax;
    c->ones = (float *)(dm + off_ones);
    c->rowloss = (double *)(dm + off_rowloss);
    c->rowright = (int *)(dm + off_rowright);
    c->sums = (double *)(dm + off_sums);
    c->ys[0] = (uint8_t *)(dm + off_y);
    c->ys[1] = (uint8_t *)(dm + off_y + y_slot);
    c->h_params = (float *)hm;
    c->h_grads = (float *)(hm + h_grads);
    c->h_x = (float *)(hm + h_x);
    c->h_y = (uint8_t *)(hm + h_y);
    c->h_sums = (double *)(hm + h_sums);
    memset(c->hmem, 0, hbytes); /* touch the pinned pages now */
    CK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    for (; c->n_events < OUT_PIECES; c->n_events++)
        CK(cudaEventCreateWithFlags(&c->piece_done[c->n_events], cudaEventDisableTiming));
    CK(cudaStreamCreateWithFlags(&c->out, cudaStreamNonBlocking));
    for (; c->n_layer_events < L; c->n_layer_events++)
        CK(cudaEventCreateWithFlags(&c->layer_done[c->n_layer_events], cudaEventDisableTiming));
    CK(cudaStreamCreateWithFlags(&c->in, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&c->in0_done, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&c->staged_ev, cudaEventDisableTiming));
    for (; c->n_param_events < L; c->n_param_events++)
        CK(cudaEventCreateWithFlags(&c->param_ready[c->n_param_events], cudaEventDisableTiming));
    CKB(blas.Create(&c->blas));
    CKB(blas.SetStream(c->blas, c->stream));
    CKB(blas.SetMathMode(c->blas, g_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    CK(cudaMemsetAsync(c->dmem, 0, dbytes, c->stream));
    k_fill<<<grid_for(B, 256), 256, 0, c->stream>>>(c->ones, 1.0f, B);
    CKL();
    CK(cudaStreamSynchronize(c->stream));
    return &c->base;
fail:
    cuda_destroy(&c->base);
    return NULL;
}

static void cuda_destroy(mlp *m)
{
    mlp_cuda *c = (mlp_cuda *)m;
    if (!c)
        return;
    cudaSetDevice(c->device);
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    if (c->out)
        cudaStreamSynchronize(c->out);
    if (c->in)
        cudaStreamSynchronize(c->in);
    if (c->blas)
        blas.Destroy(c->blas);
    for (int i = 0; i < c->n_events; i++)
        cudaEventDestroy(c->piece_done[i]);
    for (int i = 0; i < c->n_layer_events; i++)
        cudaEventDestroy(c->layer_done[i]);
    for (int i = 0; i < c->n_param_events; i++)
        cudaEventDestroy(c->param_ready[i]);
    if (c->in0_done)
        cudaEventDestroy(c->in0_done);
    if (c->staged_ev)
        cudaEventDestroy(c->staged_ev);
    if (c->in)
        cudaStreamDestroy(c->in);
    if (c->out)
        cudaStreamDestroy(c->out);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    cudaFree(c->dmem);
    cudaFreeHost(c->hmem);
    /* host_alloc's memory the caller did not free (mlp.h: free it before) */
    for (int i = 0; i < c->n_pinned; i++)
        cudaFreeHost((void *)c->pinned[i].base);
    free(c->pinned);
    free(c);
}

/* 1 when host [p, p + bytes) lies inside one range host_alloc handed out
 * (pinned: DMA-able as it is), else 0. */
static int is_pinned(const mlp_cuda *c, const void *p, size_t bytes)
{
    const uintptr_t q = (uintptr_t)p;
    for (int i = 0; i < c->n_pinned; i++) {
        const pinned_range *r = &c->pinned[i];
        if (q >= r->base && bytes <= r->bytes && q - r->base <= r->bytes - bytes)
            return 1;
    }
    return 0;
}

/* mlp_host_alloc: pinned, zeroed, recorded in c->pinned; when pinned memory
 * cannot be had, calloc (one warning line per instance); NULL only when
 * there is no host memory at all. */
static void *cuda_host_alloc(mlp *m, size_t bytes)
{
    mlp_cuda *c = (mlp_cuda *)m;
    char err[512];
    const size_t errlen = sizeof(err);
    void *p = NULL;
    if (bytes == 0)
        bytes = 1;
    if (c->n_pinned == c->cap_pinned) { /* room first: a pinned block is never untracked */
        int cap = c->cap_pinned ? 2 * c->cap_pinned : 8;
        void *t = realloc(c->pinned, (size_t)cap * sizeof(*c->pinned));
        if (!t)
            return calloc(1, bytes); /* untracked: ordinary memory, staged copies */
        c->pinned = (pinned_range *)t;
        c->cap_pinned = cap;
    }
    CK(cudaSetDevice(c->device));
    /* Default, not write-combined: the host reads these too (the optimizer,
     * the HTTP client), and write-combined memory is slow to read */
    CK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
    memset(p, 0, bytes); /* zeroed, and the pages touched now */
    c->pinned[c->n_pinned].base = (uintptr_t)p;
    c->pinned[c->n_pinned].bytes = bytes;
    c->n_pinned++;
    return p;
fail:
    (void)cudaGetLastError(); /* clear it: a later CKL() must not see it */
    if (!c->warned_unpinned) {
        fprintf(stderr, "mlp_cuda: warning: no pinned host memory (%s); using ordinary memory, "
                        "copied through the staging buffers (slower)\n", err);
        c->warned_unpinned = 1;
    }
    return calloc(1, bytes);
}

/* The staging (stage_batch) ends without its batch being used: wait for its
 * copy, which may still be reading the caller's buffers. */
static void stage_end(mlp_cuda *c)
{
    if (!c->staged)
        return;
    c->staged = 0;
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->in);
    if (e != cudaSuccess) {
        fprintf(stderr, "mlp_cuda: the staged batch's copy: %s\n", cudaGetErrorString(e));
        (void)cudaGetLastError(); /* reported here: a later CKL() must not see it */
    }
}

/* mlp_host_free: cudaFreeHost what host_alloc pinned, free() its fallbacks;
 * a staged batch in the block is waited for first. */
static void cuda_host_free(mlp *m, void *p)
{
    mlp_cuda *c = (mlp_cuda *)m;
    char err[512];
    const size_t errlen = sizeof(err);
    int i = 0;
    while (i < c->n_pinned && c->pinned[i].base != (uintptr_t)p)
        i++;
    if (c->staged) {
        const uintptr_t lo = (uintptr_t)p, n = i < c->n_pinned ? c->pinned[i].bytes : 1;
        const uintptr_t sx = (uintptr_t)c->st_x, sy = (uintptr_t)c->st_y;
        if ((sx >= lo && sx - lo < n) || (sy >= lo && sy - lo < n))
            stage_end(c);
    }
    if (i == c->n_pinned) {
        free(p);
        return;
    }
    CK(cudaSetDevice(c->device));
    CK(cudaFreeHost(p));
    c->pinned[i] = c->pinned[--c->n_pinned]; /* freed: no longer tracked (else destroy retries) */
    return;
fail:
    fprintf(stderr, "mlp_cuda: host_free: %s\n", err);
}

/* Queue host src -> device dst on stream s: one DMA when src is pinned
 * (host_alloc's), else through the staging buffer pinned, in pieces: the
 * memcpy of a piece overlaps the DMA of the one before. */
static int copy_in(mlp_cuda *c, cudaStream_t s, void *dst, void *pinned, const void *src,
                   size_t bytes, char *err, size_t errlen)
{
    if (is_pinned(c, src, bytes)) {
        CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
        return 0;
    }
    for (size_t off = 0; off < bytes; off += PIECE_BYTES) {
        size_t n = bytes - off < PIECE_BYTES ? bytes - off : PIECE_BYTES;
        memcpy((char *)pinned + off, (const char *)src + off, n);
        CK(cudaMemcpyAsync((char *)dst + off, (char *)pinned + off, n, cudaMemcpyHostToDevice, s));
    }
    return 0;
fail:
    return -1;
}

/* Queue device src -> the staging buffer pinned, then wait for it piece by
 * piece, copying each piece to host dst as soon as it has arrived. Ends with
 * the stream idle. (A pinned dst needs none of this: forward_backward copies
 * into it directly.) */
static int copy_out(mlp_cuda *c, void *dst, void *pinned, const void *src, size_t bytes, char *err,
                    size_t errlen)
{
    size_t piece = (bytes + OUT_PIECES - 1) / OUT_PIECES;
    piece = (piece + 255) & ~(size_t)255;
    int n = 0;
    for (size_t off = 0; off < bytes; off += piece, n++) {
        size_t len = bytes - off < piece ? bytes - off : piece;
        CK(cudaMemcpyAsync((char *)pinned + off, (const char *)src + off, len,
                           cudaMemcpyDeviceToHost, c->stream));
        CK(cudaEventRecord(c->piece_done[n], c->stream));
    }
    n = 0;
    for (size_t off = 0; off < bytes; off += piece, n++) {
        size_t len = bytes - off < piece ? bytes - off : piece;
        CK(cudaEventSynchronize(c->piece_done[n]));
        memcpy((char *)dst + off, (const char *)pinned + off, len);
    }
    CK(cudaStreamSynchronize(c->stream));
    return 0;
fail:
    return -1;
}

/* Queue the forward pass of x [B, n_in] (already on the device, or on its
 * way before the compute stream's position); logits land in act[L]. With
 * layer_waits, layer l >= 1 waits for param_ready[l] (its parameters are
 * coming in on the in stream). */
static int forward(mlp_cuda *c, const float *x, int B, int layer_waits, char *err, size_t errlen)
{
    const mlp_layout *ly = &c->base.layout;
    const int L = ly->n_layers;
    const float one = 1.0f, zero = 0.0f;
    const float *a = x;
    for (int l = 0; l < L; l++) {
        const int K = ly->dims[l], N = ly->dims[l + 1];
        const float *W = c->params + ly->tensors[2 * l].offset; /* [K, N] */
        const float *b = c->params + ly->tensors[2 * l + 1].offset;
        float *z = c->act[l + 1];                               /* [B, N] */
        if (layer_waits && l > 0)
            CK(cudaStreamWaitEvent(c->stream, c->param_ready[l], 0));
        /* z = a @ W, as z^T [N, B] = W^T [N, K] a^T [K, B] */
        CKB(blas.Sgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_N, N, B, K, &one, W, N, a, K, &zero, z, N));
        dim3 grid((N + 255) / 256 < 64 ? (N + 255) / 256 : 64, B < 8192 ? B : 8192);
        k_bias_act<<<grid, 256, 0, c->stream>>>(z, b, B, N, l < L - 1);
        CKL();
        a = z;
    }
    return 0;
fail:
    return -1;
}

static int check_labels(const uint8_t *labels, int64_t n, int n_out)
{
    for (int64_t i = 0; i < n; i++)
        if (labels[i] >= n_out)
            return -1;
    return 0;
}

static int cuda_forward_backward(mlp *m, const float *params, const float *x,
                                 const uint8_t *labels, int B, float *grads, double *loss)
{
    mlp_cuda *c = (mlp_cuda *)m;
    const mlp_layout *ly = &m->layout;
    const int L = ly->n_layers, C = ly->dims[L], D = ly->dims[0];
    const size_t P = ly->n_params;
    const float one = 1.0f, zero = 0.0f;
    char err[512];
    const size_t errlen = sizeof(err);
    int cur = 0;
    if (B < 1 || B > m->max_batch || !params || !x || !labels || !grads || !loss ||
        check_labels(labels, B, C) != 0) {
        stage_end(c); /* every call ends the staging (mlp.h) */
        return -1;
    }
    /* the staged batch when it is this one (slot 1), else the step copies x
     * and labels itself (slot 0); either way this call ends the staging */
    const int staged = c->staged && x == c->st_x && labels == c->st_y && B == c->st_B;
    const float *dx = c->xs[staged];
    const uint8_t *dy = c->ys[staged];
    /* params pinned: layer by layer, W_l, b_l for l >= 1 on the in stream,
     * each awaited just before its layer's forward sgemm */
    const int direct_in = is_pinned(c, params, P * sizeof(float));
    const size_t end0 = ly->tensors[1].offset + ly->tensors[1].numel; /* W_0, b_0 */
    /* grads pinned: each layer's gradients go out directly as soon as they
     * are computed (on c->out), else all at the end through the staging buffer */
    const int direct_out = is_pinned(c, grads, P * sizeof(float));
    CK(cudaSetDevice(c->device));
    /* in, on the compute stream: W_0, b_0 (all of the parameters when they
     * are not pinned: through the staging buffer), then the batch */
    if (direct_in)
        CK(cudaMemcpyAsync(c->params, params, end0 * sizeof(float), cudaMemcpyHostToDevice,
                           c->stream));
    else if (copy_in(c, c->stream, c->params, c->h_params, params, P * sizeof(float), err, errlen) != 0)
        goto fail;
    if (staged)
        CK(cudaStreamWaitEvent(c->stream, c->staged_ev, 0));
    else if (copy_in(c, c->stream, c->xs[0], c->h_x, x, (size_t)B * D * sizeof(float), err, errlen) != 0 ||
             copy_in(c, c->stream, c->ys[0], c->h_y, labels, (size_t)B, err, errlen) != 0)
        goto fail;
    if (direct_in && L > 1) {
        /* the other layers' after those (layer 0 needs them first), while
         * the forward pass runs */
        CK(cudaEventRecord(c->in0_done, c->stream));
        CK(cudaStreamWaitEvent(c->in, c->in0_done, 0));
        for (int l = 1; l < L; l++) {
            const size_t lo = ly->tensors[2 * l].offset;
            const size_t hi = ly->tensors[2 * l + 1].offset + ly->tensors[2 * l + 1].numel;
            CK(cudaMemcpyAsync(c->params + lo, params + lo, (hi - lo) * sizeof(float),
                               cudaMemcpyHostToDevice, c->in));
            CK(cudaEventRecord(c->param_ready[l], c->in));
        }
    }

    if (forward(c, dx, B, direct_in && L > 1, err, errlen) != 0)
        goto fail;

    /* dz [B, C] = (softmax - onehot) / B, the row losses; db_L-1 = column sums */
    k_softmax_xent<<<grid_for((size_t)B, 128), 128, 0, c->stream>>>(
        c->act[L], dy, B, C, 1.0f / (float)B, c->d[0], c->rowloss, c->rowright);
    CKL();
    k_sum_rows<<<1, SUM_THREADS, 0, c->stream>>>(c->rowloss, c->rowright, B, c->sums, 0);
    CKL();
    /* db [C] = dz^T ones: the column-major [C, B] matrix times ones [B] */
    CKB(blas.Sgemv(c->blas, CUBLAS_OP_N, C, B, &one, c->d[0], C, c->ones, 1, &zero,
                    c->grads + ly->tensors[2 * (L - 1) + 1].offset, 1));

    /* Backward, layer L-1 down to 0, as mlp_cpu.c:
     *   dW_l [K, N] = a_l^T @ dz: dW^T [N, K] = dz^T [N, B] (a^T)^T;
     *   da_l [B, K] = dz @ W_l^T: da^T [K, B] = (W^T)^T [K, N] dz^T [N, B];
     *   dz_{l-1} = da_l * (a_l > 0), db_{l-1} = its column sums. */
    for (int l = L - 1; l >= 0; l--) {
        const int K = ly->dims[l], N = ly->dims[l + 1];
        const float *a = l == 0 ? dx : c->act[l];
        const float *W = c->params + ly->tensors[2 * l].offset;
        float *dW = c->grads + ly->tensors[2 * l].offset;
        const float *dzl = c->d[cur];
        CKB(blas.Sgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_T, N, K, B, &one, dzl, N, a, K, &zero, dW, N));
        if (direct_out) {
            /* dW_l and db_l (the one before: the gemv at the end of the
             * previous iteration, or before the loop) are done: W_l, b_l are
             * adjacent in the layout, one copy from W_l's start to b_l's end */
            const size_t lo = ly->tensors[2 * l].offset;
            const size_t hi = ly->tensors[2 * l + 1].offset + ly->tensors[2 * l + 1].numel;
            CK(cudaEventRecord(c->layer_done[l], c->stream));
            CK(cudaStreamWaitEvent(c->out, c->layer_done[l], 0));
            CK(cudaMemcpyAsync(grads + lo, c->grads + lo, (hi - lo) * sizeof(float),
                               cudaMemcpyDeviceToHost, c->out));
        }
        if (l == 0)
            break;
        float *da = c->d[cur ^ 1];
        CKB(blas.Sgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, K, B, N, &one, W, N, dzl, N, &zero, da, K));
        size_t total = (size_t)B * K;
        k_relu_back<<<grid_for(total, 256), 256, 0, c->stream>>>(da, a, total);
        CKL();
        CKB(blas.Sgemv(c->blas, CUBLAS_OP_N, K, B, &one, da, K, c->ones, 1, &zero,
                        c->grads + ly->tensors[2 * (l - 1) + 1].offset, 1));
        cur ^= 1;
    }

    /* out: the loss sum first (it is small), then the gradients (already on
     * their way when they go out directly) */
    CK(cudaMemcpyAsync(c->h_sums, c->sums, 2 * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    if (direct_out) {
        CK(cudaStreamSynchronize(c->stream));
        CK(cudaStreamSynchronize(c->out));
    } else if (copy_out(c, grads, c->h_grads, c->grads, P * sizeof(float), err, errlen) != 0) {
        goto fail;
    }
    /* the parameter uploads on in are done (the compute waited for each); a
     * staged batch this call did not use may still be coming in */
    CK(cudaStreamSynchronize(c->in));
    c->staged = 0;
    *loss = c->h_sums[0] / B;
    return 0;
fail:
    fprintf(stderr, "mlp_cuda: forward_backward: %s\n", err);
    /* no queued DMA may touch the caller's buffers after the return; the
     * error, if the wait has one, is the one just reported */
    (void)cudaStreamSynchronize(c->stream);
    (void)cudaStreamSynchronize(c->out);
    (void)cudaStreamSynchronize(c->in);
    (void)cudaGetLastError();
    c->staged = 0;
    *loss = NAN;
    return -1;
}

static int cuda_evaluate(mlp *m, const float *params, const float *x, const uint8_t *labels,
                         int64_t n, double *loss, double *accuracy)
{
    mlp_cuda *c = (mlp_cuda *)m;
    const mlp_layout *ly = &m->layout;
    const int L = ly->n_layers, C = ly->dims[L], D = ly->dims[0];
    const size_t P = ly->n_params;
    char err[512];
    const size_t errlen = sizeof(err);
    stage_end(c); /* evaluate ends the staging too (mlp.h); it uses slot 0 */
    if (n < 1 || !params || !x || !labels || !loss || !accuracy)
        return -1;
    if (check_labels(labels, n, C) != 0)
        return -1;
    CK(cudaSetDevice(c->device));
    if (copy_in(c, c->stream, c->params, c->h_params, params, P * sizeof(float), err, errlen) != 0)
        goto fail;
    for (int64_t start = 0; start < n; start += m->max_batch) {
        int B = (int)(n - start < m->max_batch ? n - start : m->max_batch);
        /* a staging buffer is reused: the previous chunk's copy from it must
         * be done (the caller's pinned memory needs no wait) */
        if (start > 0 && (!is_pinned(c, x + (size_t)start * D, (size_t)B * D * sizeof(float)) ||
                          !is_pinned(c, labels + start, (size_t)B)))
            CK(cudaStreamSynchronize(c->stream));
        if (copy_in(c, c->stream, c->xs[0], c->h_x, x + (size_t)start * D,
                    (size_t)B * D * sizeof(float), err, errlen) != 0 ||
            copy_in(c, c->stream, c->ys[0], c->h_y, labels + start, (size_t)B, err, errlen) != 0)
            goto fail;
        if (forward(c, c->xs[0], B, 0, err, errlen) != 0)
            goto fail;
        k_softmax_xent<<<grid_for((size_t)B, 128), 128, 0, c->stream>>>(
            c->act[L], c->ys[0], B, C, 1.0f, NULL, c->rowloss, c->rowright);
        CKL();
        k_sum_rows<<<1, SUM_THREADS, 0, c->stream>>>(c->rowloss, c->rowright, B, c->sums, start > 0);
        CKL();
    }
    CK(cudaMemcpyAsync(c->h_sums, c->sums, 2 * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    *loss = c->h_sums[0] / (double)n;
    *accuracy = c->h_sums[1] / (double)n;
    return 0;
fail:
    fprintf(stderr, "mlp_cuda: evaluate: %s\n", err);
    (void)cudaStreamSynchronize(c->stream); /* as in forward_backward */
    (void)cudaGetLastError();
    *loss = NAN;
    *accuracy = NAN;
    return -1;
}

/* mlp_stage_batch: x and labels into slot 1 on the in stream, with staged_ev
 * after them; from pinned memory asynchronously, from other memory through
 * the staging buffers, waited for here (the step's own copies reuse them). */
static int cuda_stage_batch(mlp *m, const float *x, const uint8_t *labels, int B)
{
    mlp_cuda *c = (mlp_cuda *)m;
    char err[512];
    const size_t errlen = sizeof(err);
    stage_end(c); /* one staged batch at a time: this one replaces it */
    if (B < 1 || B > m->max_batch || !x || !labels)
        return -1;
    const size_t xbytes = (size_t)B * (size_t)m->layout.dims[0] * sizeof(float);
    const int direct = is_pinned(c, x, xbytes) && is_pinned(c, labels, (size_t)B);
    CK(cudaSetDevice(c->device));
    if (copy_in(c, c->in, c->xs[1], c->h_x, x, xbytes, err, errlen) != 0 ||
        copy_in(c, c->in, c->ys[1], c->h_y, labels, (size_t)B, err, errlen) != 0)
        goto fail;
    CK(cudaEventRecord(c->staged_ev, c->in));
    if (!direct)
        CK(cudaStreamSynchronize(c->in));
    c->staged = 1;
    c->st_x = x;
    c->st_y = labels;
    c->st_B = B;
    return 0;
fail:
    fprintf(stderr, "mlp_cuda: stage_batch: %s\n", err);
    (void)cudaStreamSynchronize(c->in); /* nothing staged: no copy may go on */
    (void)cudaGetLastError();
    return -1;
}

extern "C" const mlp_backend mlp_backend_cuda = {
    "cuda", cuda_create, cuda_destroy, cuda_forward_backward, cuda_evaluate,
    cuda_host_alloc, cuda_host_free, cuda_stage_batch,
};
