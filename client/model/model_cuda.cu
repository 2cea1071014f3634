/* model_cuda.cu - the CUDA backend of model.h, function for function the CPU
 * reference (model_cpu.c):
 *   dense    one cublasSgemm forward (x @ W), two backward (x^T @ dy, dy @ W^T);
 *            the bias add a kernel, its gradient (column sums) a cublasSgemv
 *            with a vector of ones;
 *   conv2d   an im2col kernel + cublasSgemm forward, and both backward products
 *            (col^T @ dy for the kernel, dy @ W^T then a col2im kernel for the
 *            input), in chunks of examples as the CPU (a larger column budget);
 *   maxpool  the argmax of every output saved forward (the FIRST maximum in
 *            row-major window order, padding ignored), the gradient gathered
 *            back per input;
 *   relu, dropout (dropout_mask.h's mask, the same bits as the CPU, saved),
 *   flatten (the same floats: no copy), and the softmax cross-entropy head.
 * col2im and the pooling backward gather per input element (no atomics): each
 * input sums its contributions in the order the CPU adds them, so those two
 * are deterministic and, given equal operands, equal to the CPU bit for bit.
 *
 * Row-major on cuBLAS's column-major: a row-major [M, N] matrix is the
 * column-major [N, M] matrix (its transpose) with the same leading dimension,
 * so row-major C = A @ B is computed as C^T = B^T A^T.
 *
 * Everything lives on the device, allocated once in create(): the parameter
 * and gradient buffers in the layout's order, the activations, the saved
 * masks and argmaxes, the batch. The caller's buffers are host memory: the
 * copies go by DMA directly from and to them when they lie in memory this
 * instance's host_alloc pinned (a table of those ranges says so), else
 * through the instance's own pinned staging buffers with a host memcpy, in
 * pieces so that the memcpy of one piece overlaps the DMA of the next. One
 * compute stream carries the copies in, the compute and the copies out, one
 * synchronization per call; two more streams overlap copies with compute:
 *  - out: with pinned gradients, each layer's gradient leaves as soon as the
 *    backward pass has computed it (an event per layer);
 *  - in: with pinned parameters, forward_backward's uploads of every layer's
 *    parameters but the first one's, layer by layer after the step's first
 *    copies, each with an event the compute stream waits for just before that
 *    layer, so the layers before it hide its upload; and the next batch, when
 *    the caller stages it ahead (stage_batch) into a second device batch
 *    buffer (slot 1; slot 0 takes every batch a call copies itself), with an
 *    event the step that uses it waits for.
 * Every function returns with every stream idle, failures included, so no DMA
 * touches a caller's buffer after the call; the one exception is stage_batch,
 * whose copy from the caller's pinned batch may run until the call that ends
 * the staging (model.h), which waits for it.
 *
 * TF32 is off by default (CUBLAS_DEFAULT_MATH: full FP32 sgemm, within ~1e-6
 * of the CPU); model_cuda_use(..., tf32 = 1) opts in.
 *
 * Every CUDA and cuBLAS call is checked (file, line, the call, the library's
 * error string), every kernel launch by cudaGetLastError right after it. A
 * failure inside a call prints that line on stderr (the backend table has no
 * error buffer) and returns -1.
 *
 * Linking: the CUDA runtime is static (it loads the driver, libcuda.so, when
 * first used) and cuBLAS is loaded with dlopen once a device is chosen:
 * libcublas + libcublasLt are ~600 MB, and linking them made every workerd
 * start 0.8 s slower, GPU or not. So workerd starts on any machine; only
 * --device=cuda/auto on a machine with a device needs libcublas.so.N (the
 * toolkit's major version), on the library path or in the build's toolkit. */
extern "C" {
#include "errmsg.h"
#include "model/model.h"
}

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/dropout_mask.h"

/* The device chosen by model_cuda_use (process-wide, like the CPU backend's
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
/* after a kernel launch: a bad configuration shows here, a fault at the sync;
 * what names the kernel */
#define CKL(what)                                                                           \
    do {                                                                                    \
        cudaError_t e_ = cudaGetLastError();                                                \
        if (e_ != cudaSuccess) {                                                            \
            errmsg(err, errlen, "%s:%d: launch of %s: %s", __FILE__, __LINE__, what,        \
                   cudaGetErrorString(e_));                                                 \
            goto fail;                                                                      \
        }                                                                                   \
    } while (0)

/* pinned host memory handed out by host_alloc: [base, base + bytes) */
typedef struct pinned_range {
    uintptr_t base;
    size_t bytes;
} pinned_range;

/* The im2col column buffer holds at most this many floats (256 MiB), or one
 * example's: the CPU's chunking with a budget a GPU affords. */
#define COL_BUDGET ((size_t)1 << 26)
/* the pieces of the staged copies */
#define PIECE_BYTES ((size_t)2 << 20)
#define OUT_PIECES 8
#define MAX_DBLOCKS (3 * MODEL_MAX_LAYERS + 24)

typedef struct model_cuda {
    model base; /* first: a model_cuda * is a model * */
    int device;
    cudaStream_t stream;                  /* the compute stream (and the call's own copies) */
    cudaStream_t in;                      /* staged batches */
    cudaStream_t out;                     /* direct gradient copies, layer by layer */
    cublasHandle_t blas;
    /* device */
    float *params, *grads;                /* n_params each, the layout's offsets */
    float *xs[2];                         /* [max_batch, n_in]: slot 0 the call's, 1 the staged */
    uint8_t *ys[2];                       /* [max_batch] each, the same */
    float *rin;                           /* [max_batch, max_act]: forward_range's input */
    float *act[MODEL_MAX_LAYERS];         /* layer l's output [max_batch, out_numel]; a flatten's
                                           * is its input's, set by the forward */
    const float *inp[MODEL_MAX_LAYERS];   /* layer l's input in the last forward (device) */
    uint8_t *keep[MODEL_MAX_LAYERS];      /* dropout: 1 kept, 0 dropped */
    int dropout_on[MODEL_MAX_LAYERS];     /* the last forward applied the mask */
    int32_t *argmax[MODEL_MAX_LAYERS];    /* maxpool: input index (within the example) per output */
    float *col;                           /* im2col / dcol, col_floats */
    size_t col_floats;
    float *d[2];                          /* gradients, [max_batch, max_act] each */
    float *ones;                          /* [n_ones] of 1.0f: column sums by gemv */
    size_t n_ones;
    uint64_t *rowhash;                    /* [max_batch]: dropout_row_hash of each row */
    double *rowloss;                      /* [max_batch] */
    int *rowright;                        /* [max_batch]: argmax == label */
    double *sums;                         /* [2]: loss sum, correct count */
    void *dblocks[MAX_DBLOCKS];
    size_t dsizes[MAX_DBLOCKS];
    int n_dblocks;
    /* pinned host: the staging buffers (each used at most once per call) */
    float *h_params, *h_grads;            /* n_params */
    float *h_x, *h_out;                   /* [max_batch, max(n_in, max_act)]: in, out */
    uint8_t *h_y;                         /* [max_batch] */
    uint64_t *h_rowhash;                  /* [max_batch] */
    double *h_sums;                       /* [2] */
    void *hblocks[8];
    int n_hblocks;
    cudaEvent_t piece_done[OUT_PIECES];   /* copy_out's pieces */
    int n_events;
    cudaEvent_t layer_done[MODEL_MAX_LAYERS]; /* layer l's gradients are computed */
    cudaEvent_t param_ready[MODEL_MAX_LAYERS]; /* layer l's W and b are on the device (in stream) */
    int n_layer_events, n_param_events;
    cudaEvent_t in0_done;                 /* the step's first copies are queued on the compute stream */
    cudaEvent_t staged_ev;                /* the staged batch is in slot 1 */
    int staged;                           /* stage_batch's batch: in or on its way to slot 1 */
    const float *st_x;                    /* ... from these host buffers, this batch */
    const uint8_t *st_y;
    int st_B;
    pinned_range *pinned;                 /* host_alloc's pinned memory */
    int n_pinned, cap_pinned;
    int warned_unpinned;                  /* host_alloc's fallback said so once */
    int fwd_first, fwd_last, fwd_batch;   /* the forward backward_range pairs with; first -1: none */
    const float *y_last;                  /* that forward's output (device) */
} model_cuda;

/* ---- kernels ------------------------------------------------------------ */

/* Grid-stride loops over size_t indices: any n with a capped 1-D grid. */
#define GRID_MAX 4096u
static unsigned grid_for(size_t n, unsigned threads)
{
    size_t g = (n + threads - 1) / threads;
    return (unsigned)(g < GRID_MAX ? (g ? g : 1) : GRID_MAX);
}
#define FOR_N(i, n)                                                                      \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n);               \
         i += (size_t)gridDim.x * blockDim.x)

/* The geometry of a conv2d or maxpool layer, by value. */
typedef struct geom {
    int H, W, C, OH, OW, OC, KH, KW, S, pt, pl;
    size_t in_numel, out_numel;
} geom;

static geom geom_of(const model_layer *l)
{
    geom g;
    g.H = l->in.h;
    g.W = l->in.w;
    g.C = l->in.c;
    g.OH = l->out.h;
    g.OW = l->out.w;
    g.OC = l->out.c;
    g.KH = l->kh;
    g.KW = l->kw;
    g.S = l->stride;
    g.pt = l->pad_top;
    g.pl = l->pad_left;
    g.in_numel = l->in_numel;
    g.out_numel = l->out_numel;
    return g;
}

static __global__ void k_fill(float *p, float v, size_t n)
{
    FOR_N(i, n)
        p[i] = v;
}

/* z[rows, N] += b[N], one thread per element (a conv's N is its few channels:
 * a row per block would leave most threads idle) */
static __global__ void k_bias_add(float *z, const float *b, size_t rows, int N)
{
    const size_t total = rows * (size_t)N;
    FOR_N(i, total)
        z[i] += b[i % (size_t)N];
}

static __global__ void k_relu(float *out, const float *in, size_t n)
{
    FOR_N(i, n)
    {
        float v = in[i];
        out[i] = v > 0.0f ? v : 0.0f;
    }
}

/* din = dout where the output was > 0, else 0 */
static __global__ void k_relu_back(float *din, const float *dout, const float *out, size_t n)
{
    FOR_N(i, n)
        din[i] = out[i] > 0.0f ? dout[i] : 0.0f;
}

/* out = keep ? in * scale : 0 with keep from the contract's mask (row r's hash
 * rowhash[r], unit u within the example); keep saved. Rows on y, units on x. */
static __global__ void k_dropout(float *out, uint8_t *keep, const float *in, const uint64_t *rowhash,
                                 int B, size_t n, uint32_t li, float rate, float scale)
{
    for (int r = blockIdx.y; r < B; r += gridDim.y) {
        const uint64_t rh = rowhash[r];
        const size_t base = (size_t)r * n;
        for (size_t u = blockIdx.x * (size_t)blockDim.x + threadIdx.x; u < n;
             u += (size_t)gridDim.x * blockDim.x) {
            const uint8_t k = (uint8_t)dropout_keep(rh, li, (uint64_t)u, rate);
            keep[base + u] = k;
            out[base + u] = k ? in[base + u] * scale : 0.0f;
        }
    }
}

static __global__ void k_dropout_back(float *din, const float *dout, const uint8_t *keep, size_t n,
                                      float scale)
{
    FOR_N(i, n)
        din[i] = keep[i] ? dout[i] * scale : 0.0f;
}

/* col[nb * OH * OW, KH * KW * C] from in[nb, H, W, C]: row (e, oy, ox), column
 * (ky, kx, c), zero where the window is over the padding. One thread per
 * element of col. */
static __global__ void k_im2col(float *col, const float *in, int nb, geom g)
{
    const size_t rowlen = (size_t)g.KH * g.KW * g.C;
    const size_t total = (size_t)nb * g.OH * g.OW * rowlen;
    FOR_N(idx, total)
    {
        size_t j = idx % rowlen, r = idx / rowlen;
        const int c = (int)(j % g.C);
        j /= g.C;
        const int kx = (int)(j % g.KW), ky = (int)(j / g.KW);
        const int ox = (int)(r % g.OW);
        r /= g.OW;
        const int oy = (int)(r % g.OH);
        const size_t e = r / g.OH;
        const int iy = oy * g.S - g.pt + ky, ix = ox * g.S - g.pl + kx;
        float v = 0.0f;
        if (iy >= 0 && iy < g.H && ix >= 0 && ix < g.W)
            v = in[e * g.in_numel + ((size_t)iy * g.W + ix) * g.C + c];
        col[idx] = v;
    }
}

/* The adjoint of im2col, gathered: din[nb, H, W, C] = the sum of col's entries
 * that im2col took from each input, in the order of their output position
 * (oy, ox) ascending, as the CPU's col2im adds them (ky, kx descending). Every
 * element of din is written. */
static __global__ void k_col2im(float *din, const float *col, int nb, geom g)
{
    const size_t rowlen = (size_t)g.KH * g.KW * g.C;
    const size_t total = (size_t)nb * g.in_numel;
    FOR_N(idx, total)
    {
        size_t t = idx;
        const int c = (int)(t % g.C);
        t /= g.C;
        const int ix = (int)(t % g.W);
        t /= g.W;
        const int iy = (int)(t % g.H);
        const size_t e = t / g.H;
        const float *ce = col + e * (size_t)g.OH * g.OW * rowlen;
        float s = 0.0f;
        for (int ky = g.KH - 1; ky >= 0; ky--) {
            const int ty = iy + g.pt - ky; /* oy * S */
            if (ty < 0 || ty % g.S != 0 || ty / g.S >= g.OH)
                continue;
            const int oy = ty / g.S;
            for (int kx = g.KW - 1; kx >= 0; kx--) {
                const int tx = ix + g.pl - kx;
                if (tx < 0 || tx % g.S != 0 || tx / g.S >= g.OW)
                    continue;
                const int ox = tx / g.S;
                s += ce[((size_t)oy * g.OW + ox) * rowlen + ((size_t)ky * g.KW + kx) * g.C + c];
            }
        }
        din[idx] = s;
    }
}

/* out[B, OH, OW, C] = the window maxima of in[B, H, W, C] (padding ignored);
 * argmax gets the input index (within the example) of the first maximum in
 * row-major window order. One thread per output element. */
static __global__ void k_maxpool(float *out, int32_t *argmax, const float *in, int B, geom g)
{
    const size_t total = (size_t)B * g.out_numel;
    FOR_N(idx, total)
    {
        size_t t = idx;
        const int c = (int)(t % g.C);
        t /= g.C;
        const int ox = (int)(t % g.OW);
        t /= g.OW;
        const int oy = (int)(t % g.OH);
        const size_t e = t / g.OH;
        const float *ie = in + e * g.in_numel;
        float m = 0.0f;
        int32_t a = -1;
        for (int ky = 0; ky < g.KH; ky++) {
            const int iy = oy * g.S - g.pt + ky;
            if (iy < 0 || iy >= g.H)
                continue;
            for (int kx = 0; kx < g.KW; kx++) {
                const int ix = ox * g.S - g.pl + kx;
                if (ix < 0 || ix >= g.W)
                    continue;
                const int32_t k = (int32_t)(((size_t)iy * g.W + ix) * g.C + c);
                const float v = ie[k];
                if (a < 0 || v > m) {
                    m = v;
                    a = k;
                }
            }
        }
        out[idx] = m;
        argmax[idx] = a;
    }
}

/* din[B, H, W, C] = the sum of the gradients of the outputs whose argmax is
 * this input, in output order (as the CPU adds them); every element written. */
static __global__ void k_maxpool_back(float *din, const float *dout, const int32_t *argmax, int B,
                                      geom g)
{
    const size_t total = (size_t)B * g.in_numel;
    FOR_N(idx, total)
    {
        size_t t = idx;
        const int c = (int)(t % g.C);
        t /= g.C;
        const int ix = (int)(t % g.W);
        t /= g.W;
        const int iy = (int)(t % g.H);
        const size_t e = t / g.H;
        const int32_t k = (int32_t)(((size_t)iy * g.W + ix) * g.C + c);
        /* the outputs whose window covers (iy, ix): oy * S - pt <= iy <= oy * S - pt + KH - 1 */
        const int ly = iy + g.pt - g.KH + 1, lx = ix + g.pl - g.KW + 1;
        const int oy0 = ly <= 0 ? 0 : (ly + g.S - 1) / g.S, ox0 = lx <= 0 ? 0 : (lx + g.S - 1) / g.S;
        const int oy1 = min((iy + g.pt) / g.S, g.OH - 1), ox1 = min((ix + g.pl) / g.S, g.OW - 1);
        const int32_t *ae = argmax + e * g.out_numel;
        const float *de = dout + e * g.out_numel;
        float s = 0.0f;
        for (int oy = oy0; oy <= oy1; oy++)
            for (int ox = ox0; ox <= ox1; ox++) {
                const size_t o = ((size_t)oy * g.OW + ox) * g.C + c;
                if (ae[o] == k)
                    s += de[o];
            }
        din[idx] = s;
    }
}

/* One thread per row of logits [B, C] (grid-stride: any B), as model_cpu.c's
 * loops: the stable softmax cross-entropy into rowloss[i], argmax == label
 * (the first maximum wins a tie) into rowright[i], and, when dz is not NULL,
 * dz[i] = (softmax - onehot) / B. */
static __global__ void k_softmax_xent(const float *logits, const uint8_t *y, int B, int C, float invB,
                                      float *dz, double *rowloss, int *rowright)
{
    FOR_N(i, (size_t)B)
    {
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

/* a 2-D grid for rows x cols kernels: x over the columns (capped), y over the
 * rows (at most 65535, the limit of gridDim.y; the kernels stride) */
static dim3 grid_rows(size_t rows, size_t cols, unsigned threads)
{
    size_t gx = (cols + threads - 1) / threads;
    gx = gx < 1 ? 1 : gx > 64 ? 64 : gx;
    size_t gy = rows < 1 ? 1 : rows > 65535 ? 65535 : rows;
    return dim3((unsigned)gx, (unsigned)gy);
}

/* ---- helpers of the header ---------------------------------------------- */

extern "C" const model_backend model_backend_cuda;

extern "C" int model_cuda_built(void)
{
    return 1;
}

extern "C" const model_backend *model_cuda_backend(void)
{
    return &model_backend_cuda;
}

extern "C" int model_cuda_device_count(char *err, size_t errlen)
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

extern "C" int model_cuda_use(int gpu, int tf32, char *desc, size_t desclen, char *err,
                              size_t errlen)
{
    char why[256] = "";
    int n = model_cuda_device_count(why, sizeof(why));
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

/* ---- the instance ------------------------------------------------------- */

static void cuda_destroy(model *m);

/* Examples per im2col chunk of layer l (as conv_chunk in model_cpu.c). */
static int conv_chunk(const model_layer *l, int B)
{
    size_t per = (size_t)l->out.h * l->out.w * (size_t)l->kh * l->kw * l->in.c;
    size_t nb = per ? COL_BUDGET / per : (size_t)B;
    if (nb < 1)
        nb = 1;
    return nb > (size_t)B ? B : (int)nb;
}

/* device memory, owned by c->dblocks; 0, or -1 with err */
static int dalloc(model_cuda *c, void **p, size_t bytes, char *err, size_t errlen)
{
    if (bytes == 0)
        bytes = 256;
    if (c->n_dblocks == MAX_DBLOCKS)
        return errmsg(err, errlen, "model_cuda: more than %d device blocks", MAX_DBLOCKS);
    cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaErrorMemoryAllocation) {
        size_t fr = 0, tot = 0;
        (void)cudaGetLastError();
        (void)cudaMemGetInfo(&fr, &tot);
        (void)cudaGetLastError();
        return errmsg(err, errlen,
                      "%s:%d: cudaMalloc(%zu): out of device memory: the model (%zu parameters) at "
                      "batch %d does not fit on GPU %d (%zu of %zu bytes free)",
                      __FILE__, __LINE__, bytes, c->base.layout.n_params, c->base.max_batch, c->device,
                      fr, tot);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return errmsg(err, errlen, "%s:%d: cudaMalloc(%zu): %s", __FILE__, __LINE__, bytes,
                      cudaGetErrorString(e));
    }
    c->dblocks[c->n_dblocks] = *p;
    c->dsizes[c->n_dblocks++] = bytes;
    return 0;
}

/* pinned host staging memory, owned by c->hblocks, zeroed; 0, or -1 with err */
static int halloc(model_cuda *c, void **p, size_t bytes, char *err, size_t errlen)
{
    if (bytes == 0)
        bytes = 64;
    cudaError_t e = cudaHostAlloc(p, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return errmsg(err, errlen, "%s:%d: cudaHostAlloc(%zu) for a staging buffer: %s", __FILE__,
                      __LINE__, bytes, cudaGetErrorString(e));
    }
    memset(*p, 0, bytes); /* touch the pinned pages now */
    c->hblocks[c->n_hblocks++] = *p;
    return 0;
}

/* The tensors of layers first..last: [*lo, *hi) floats of the buffer (the
 * layout is packed in layer order, checked in create); 0 when there are none. */
static int range_tensors(const model_layout *ly, int first, int last, size_t *lo, size_t *hi)
{
    int any = 0;
    for (int li = first; li <= last; li++) {
        const model_layer *l = &ly->layers[li];
        if (l->w < 0)
            continue;
        if (!any)
            *lo = ly->tensors[l->w].offset;
        *hi = ly->tensors[l->b].offset + ly->tensors[l->b].numel;
        any = 1;
    }
    return any;
}

static model *cuda_create(const model_layout *layout, int max_batch, char *err, size_t errlen)
{
    const size_t B = (size_t)max_batch, P = layout->n_params;
    const int L = layout->n_layers;
    /* the gradients of a range go out as one block [first W, last b): the
     * layout must be W b W b ... in layer order, back to back */
    size_t expect = 0;
    for (int li = 0; li < L; li++) {
        const model_layer *l = &layout->layers[li];
        if (l->w < 0)
            continue;
        const model_tensor *w = &layout->tensors[l->w], *b = &layout->tensors[l->b];
        if (w->offset != expect || b->offset != w->offset + w->numel) {
            errmsg(err, errlen, "model_cuda: the layout is not W b W b ... in layer order, back to back");
            return NULL;
        }
        expect = b->offset + b->numel;
    }
    if (expect != P) {
        errmsg(err, errlen, "model_cuda: the layout's tensors do not fill its %zu parameters", P);
        return NULL;
    }
    /* cuBLAS takes int sizes: every activation of the batch, and every im2col
     * chunk, within INT_MAX floats */
    size_t rows_max = B; /* rows of a bias gradient: B (dense), B * OH * OW (conv) */
    for (int li = 0; li < L; li++) {
        const model_layer *l = &layout->layers[li];
        if (B * l->in_numel > (size_t)INT_MAX || B * l->out_numel > (size_t)INT_MAX) {
            errmsg(err, errlen, "model_cuda: batch %d x layer %d's %zu floats is over 2^31-1 (cuBLAS "
                   "sizes are int): use a smaller batch", max_batch, li,
                   l->in_numel > l->out_numel ? l->in_numel : l->out_numel);
            return NULL;
        }
        if (l->kind == LAYER_CONV2D) {
            size_t per = (size_t)l->out.h * l->out.w * (size_t)l->kh * l->kw * l->in.c;
            if (per > (size_t)INT_MAX) {
                errmsg(err, errlen, "model_cuda: layer %d's im2col has %zu floats per example (over "
                       "2^31-1)", li, per);
                return NULL;
            }
            size_t r = B * l->out.h * l->out.w;
            rows_max = r > rows_max ? r : rows_max;
        }
    }
    const size_t amax = layout->max_act > layout->n_in ? layout->max_act : layout->n_in;
    model_cuda *c = (model_cuda *)calloc(1, sizeof(*c));
    if (!c) {
        errmsg(err, errlen, "model_cuda: out of host memory");
        return NULL;
    }
    c->base.backend = &model_backend_cuda;
    c->base.layout = *layout;
    c->base.max_batch = max_batch;
    c->device = g_device < 0 ? 0 : g_device;
    c->fwd_first = -1;
    if (blas_load(err, errlen) != 0)
        goto fail;
    CK(cudaSetDevice(c->device));
#define DA(ptr, bytes)                                                     \
    do {                                                                   \
        if (dalloc(c, (void **)&(ptr), (bytes), err, errlen) != 0)         \
            goto fail;                                                     \
    } while (0)
#define HA(ptr, bytes)                                                     \
    do {                                                                   \
        if (halloc(c, (void **)&(ptr), (bytes), err, errlen) != 0)         \
            goto fail;                                                     \
    } while (0)
    DA(c->params, P * sizeof(float));
    DA(c->grads, P * sizeof(float));
    for (int s = 0; s < 2; s++) {
        DA(c->xs[s], B * layout->n_in * sizeof(float));
        DA(c->ys[s], B);
    }
    DA(c->rin, B * amax * sizeof(float));
    for (int li = 0; li < L; li++) {
        const model_layer *l = &layout->layers[li];
        if (l->kind != LAYER_FLATTEN)
            DA(c->act[li], B * l->out_numel * sizeof(float));
        if (l->kind == LAYER_DROPOUT)
            DA(c->keep[li], B * l->out_numel);
        if (l->kind == LAYER_MAXPOOL)
            DA(c->argmax[li], B * l->out_numel * sizeof(int32_t));
        if (l->kind == LAYER_CONV2D) {
            size_t f = (size_t)conv_chunk(l, max_batch) * l->out.h * l->out.w * l->kh * l->kw * l->in.c;
            if (f > c->col_floats)
                c->col_floats = f;
        }
    }
    if (c->col_floats)
        DA(c->col, c->col_floats * sizeof(float));
    DA(c->d[0], B * amax * sizeof(float));
    DA(c->d[1], B * amax * sizeof(float));
    c->n_ones = rows_max;
    DA(c->ones, c->n_ones * sizeof(float));
    DA(c->rowhash, B * sizeof(uint64_t));
    DA(c->rowloss, B * sizeof(double));
    DA(c->rowright, B * sizeof(int));
    DA(c->sums, 2 * sizeof(double));
    HA(c->h_params, P * sizeof(float));
    HA(c->h_grads, P * sizeof(float));
    HA(c->h_x, B * amax * sizeof(float));
    HA(c->h_out, B * amax * sizeof(float));
    HA(c->h_y, B);
    HA(c->h_rowhash, B * sizeof(uint64_t));
    HA(c->h_sums, 2 * sizeof(double));
#undef DA
#undef HA
    CK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&c->in, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&c->out, cudaStreamNonBlocking));
    for (; c->n_events < OUT_PIECES; c->n_events++)
        CK(cudaEventCreateWithFlags(&c->piece_done[c->n_events], cudaEventDisableTiming));
    for (; c->n_layer_events < L; c->n_layer_events++)
        CK(cudaEventCreateWithFlags(&c->layer_done[c->n_layer_events], cudaEventDisableTiming));
    for (; c->n_param_events < L; c->n_param_events++)
        CK(cudaEventCreateWithFlags(&c->param_ready[c->n_param_events], cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&c->in0_done, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&c->staged_ev, cudaEventDisableTiming));
    CKB(blas.Create(&c->blas));
    CKB(blas.SetStream(c->blas, c->stream));
    CKB(blas.SetMathMode(c->blas, g_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    for (int i = 0; i < c->n_dblocks; i++) /* the workspace starts zeroed, as the CPU's */
        CK(cudaMemsetAsync(c->dblocks[i], 0, c->dsizes[i], c->stream));
    k_fill<<<grid_for(c->n_ones, 256), 256, 0, c->stream>>>(c->ones, 1.0f, c->n_ones);
    CKL("k_fill");
    CK(cudaStreamSynchronize(c->stream));
    return &c->base;
fail:
    cuda_destroy(&c->base);
    return NULL;
}

static void cuda_destroy(model *m)
{
    model_cuda *c = (model_cuda *)m;
    if (!c)
        return;
    (void)cudaSetDevice(c->device);
    if (c->stream)
        (void)cudaStreamSynchronize(c->stream);
    if (c->out)
        (void)cudaStreamSynchronize(c->out);
    if (c->in)
        (void)cudaStreamSynchronize(c->in);
    if (c->blas)
        blas.Destroy(c->blas);
    for (int i = 0; i < c->n_events; i++)
        (void)cudaEventDestroy(c->piece_done[i]);
    for (int i = 0; i < c->n_layer_events; i++)
        (void)cudaEventDestroy(c->layer_done[i]);
    for (int i = 0; i < c->n_param_events; i++)
        (void)cudaEventDestroy(c->param_ready[i]);
    if (c->in0_done)
        (void)cudaEventDestroy(c->in0_done);
    if (c->staged_ev)
        (void)cudaEventDestroy(c->staged_ev);
    if (c->in)
        (void)cudaStreamDestroy(c->in);
    if (c->out)
        (void)cudaStreamDestroy(c->out);
    if (c->stream)
        (void)cudaStreamDestroy(c->stream);
    for (int i = 0; i < c->n_dblocks; i++)
        (void)cudaFree(c->dblocks[i]);
    for (int i = 0; i < c->n_hblocks; i++)
        (void)cudaFreeHost(c->hblocks[i]);
    /* host_alloc's memory the caller did not free (model.h: free it before) */
    for (int i = 0; i < c->n_pinned; i++)
        (void)cudaFreeHost((void *)c->pinned[i].base);
    free(c->pinned);
    (void)cudaGetLastError();
    free(c);
}

/* 1 when host [p, p + bytes) lies inside one range host_alloc handed out
 * (pinned: DMA-able as it is), else 0. */
static int is_pinned(const model_cuda *c, const void *p, size_t bytes)
{
    const uintptr_t q = (uintptr_t)p;
    for (int i = 0; i < c->n_pinned; i++) {
        const pinned_range *r = &c->pinned[i];
        if (q >= r->base && bytes <= r->bytes && q - r->base <= r->bytes - bytes)
            return 1;
    }
    return 0;
}

/* model_host_alloc: pinned, zeroed, recorded in c->pinned; when pinned memory
 * cannot be had, calloc (one warning line per instance); NULL only when
 * there is no host memory at all. */
static void *cuda_host_alloc(model *m, size_t bytes)
{
    model_cuda *c = (model_cuda *)m;
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
        fprintf(stderr, "model_cuda: warning: no pinned host memory (%s); using ordinary memory, "
                        "copied through the staging buffers (slower)\n", err);
        c->warned_unpinned = 1;
    }
    return calloc(1, bytes);
}

/* The staging (stage_batch) ends without its batch being used: wait for its
 * copy, which may still be reading the caller's buffers. */
static void stage_end(model_cuda *c)
{
    if (!c->staged)
        return;
    c->staged = 0;
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->in);
    if (e != cudaSuccess) {
        fprintf(stderr, "model_cuda: the staged batch's copy: cudaStreamSynchronize: %s\n",
                cudaGetErrorString(e));
        (void)cudaGetLastError(); /* reported here: a later CKL() must not see it */
    }
}

/* model_host_free: cudaFreeHost what host_alloc pinned, free() its fallbacks;
 * a staged batch in the block is waited for first. */
static void cuda_host_free(model *m, void *p)
{
    model_cuda *c = (model_cuda *)m;
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
    (void)cudaGetLastError();
    fprintf(stderr, "model_cuda: host_free: %s\n", err);
}

/* Queue host src -> device dst on stream s: one DMA when src is pinned
 * (host_alloc's), else through the staging buffer `pinned` (which no other
 * copy of this call uses), in pieces: the memcpy of a piece overlaps the DMA
 * of the one before. */
static int copy_in(model_cuda *c, cudaStream_t s, void *dst, void *pinned, const void *src,
                   size_t bytes, char *err, size_t errlen)
{
    if (bytes == 0)
        return 0;
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

/* Device src -> host dst after everything queued on the compute stream:
 * directly when dst is pinned, else through the staging buffer `pinned`,
 * piece by piece, each piece copied to dst as soon as it has arrived. Ends
 * with the compute stream idle. */
static int copy_out(model_cuda *c, void *dst, void *pinned, const void *src, size_t bytes, char *err,
                    size_t errlen)
{
    if (bytes == 0 || is_pinned(c, dst, bytes)) {
        if (bytes)
            CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
        CK(cudaStreamSynchronize(c->stream));
        return 0;
    }
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
    }
    CK(cudaStreamSynchronize(c->stream));
    return 0;
fail:
    return -1;
}

/* After a failure: no queued DMA may touch the caller's buffers after the
 * return; the error, if a wait has one, is the one already reported. */
static void drain(model_cuda *c)
{
    (void)cudaStreamSynchronize(c->stream);
    (void)cudaStreamSynchronize(c->out);
    (void)cudaStreamSynchronize(c->in);
    (void)cudaGetLastError();
}

/* Queue the dropout rows' hashes (model_ctx_example, dropout_mask.h) when
 * layers first..last have a dropout and ctx is not inference. */
static int queue_rowhash(model_cuda *c, int first, int last, int B, const model_ctx *ctx, char *err,
                         size_t errlen)
{
    const model_layout *ly = &c->base.layout;
    int any = 0;
    for (int li = first; li <= last; li++)
        any |= ly->layers[li].kind == LAYER_DROPOUT;
    if (!any || (ctx && ctx->inference))
        return 0;
    const uint64_t seed = ctx ? ctx->seed : 0;
    const int64_t step = ctx ? ctx->step : 0;
    for (int i = 0; i < B; i++)
        c->h_rowhash[i] = dropout_row_hash(seed, step, model_ctx_example(ctx, i));
    CK(cudaMemcpyAsync(c->rowhash, c->h_rowhash, (size_t)B * sizeof(uint64_t), cudaMemcpyHostToDevice,
                       c->stream));
    return 0;
fail:
    return -1;
}

/* Queue layers first..last on device input x [B, layers[first].in_numel]
 * with the parameters on the device (c->params), or, for the layers with
 * parameters after layer wait_after, on their way there on the in stream
 * (each waited for with its param_ready event just before its layer; pass
 * last to wait for none), and, for dropout, the row hashes (queue_rowhash);
 * c->y_last gets the last layer's output. */
static int forward(model_cuda *c, int first, int last, const float *x, int B, const model_ctx *ctx,
                   int wait_after, char *err, size_t errlen)
{
    const model_layout *ly = &c->base.layout;
    const float one = 1.0f, zero = 0.0f;
    for (int li = first; li <= last; li++) {
        const model_layer *l = &ly->layers[li];
        float *y = c->act[li];
        const size_t n_out = (size_t)B * l->out_numel;
        c->inp[li] = x;
        if (li > wait_after && l->w >= 0)
            CK(cudaStreamWaitEvent(c->stream, c->param_ready[li], 0));
        switch (l->kind) {
        case LAYER_DENSE: {
            const int K = (int)l->in_numel, N = (int)l->out_numel;
            const float *W = c->params + ly->tensors[l->w].offset; /* [K, N] */
            const float *b = c->params + ly->tensors[l->b].offset;
            /* y = x @ W, as y^T [N, B] = W^T [N, K] x^T [K, B] */
            CKB(blas.Sgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_N, N, B, K, &one, W, N, x, K, &zero, y, N));
            k_bias_add<<<grid_for((size_t)B * N, 256), 256, 0, c->stream>>>(y, b, (size_t)B, N);
            CKL("k_bias_add (dense)");
            break;
        }
        case LAYER_CONV2D: {
            const int K = l->kh * l->kw * l->in.c, N = l->out.c, P = l->out.h * l->out.w;
            const float *W = c->params + ly->tensors[l->w].offset; /* [K, N] = HWIO */
            const float *b = c->params + ly->tensors[l->b].offset;
            const int nb_max = conv_chunk(l, B);
            const geom g = geom_of(l);
            for (int e0 = 0; e0 < B; e0 += nb_max) {
                const int nb = B - e0 < nb_max ? B - e0 : nb_max;
                const size_t cn = (size_t)nb * P * K;
                k_im2col<<<grid_for(cn, 256), 256, 0, c->stream>>>(c->col, x + (size_t)e0 * l->in_numel,
                                                                   nb, g);
                CKL("k_im2col");
                /* o [nb*P, N] = col [nb*P, K] @ W [K, N] */
                CKB(blas.Sgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_N, N, nb * P, K, &one, W, N, c->col, K,
                               &zero, y + (size_t)e0 * l->out_numel, N));
            }
            k_bias_add<<<grid_for((size_t)B * P * N, 256), 256, 0, c->stream>>>(
                y, b, (size_t)B * P, N);
            CKL("k_bias_add (conv2d)");
            break;
        }
        case LAYER_MAXPOOL:
            k_maxpool<<<grid_for(n_out, 256), 256, 0, c->stream>>>(y, c->argmax[li], x, B, geom_of(l));
            CKL("k_maxpool");
            break;
        case LAYER_RELU:
            k_relu<<<grid_for(n_out, 256), 256, 0, c->stream>>>(y, x, n_out);
            CKL("k_relu");
            break;
        case LAYER_DROPOUT:
            c->dropout_on[li] = !(ctx && ctx->inference);
            if (c->dropout_on[li]) {
                k_dropout<<<grid_rows((size_t)B, l->out_numel, 256), 256, 0, c->stream>>>(
                    y, c->keep[li], x, c->rowhash, B, l->out_numel, (uint32_t)l->dropout_index, l->rate,
                    l->scale);
                CKL("k_dropout");
            } else {
                CK(cudaMemcpyAsync(y, x, n_out * sizeof(float), cudaMemcpyDeviceToDevice, c->stream));
            }
            break;
        case LAYER_FLATTEN:
            c->act[li] = (float *)x; /* the same floats; never written through */
            y = c->act[li];
            break;
        }
        x = y;
    }
    c->fwd_first = first;
    c->fwd_last = last;
    c->fwd_batch = B;
    c->y_last = x;
    return 0;
fail:
    c->fwd_first = -1;
    return -1;
}

/* Does any layer in [first, upto) have parameters (so the gradient must reach it)? */
static int params_below(const model_layout *ly, int first, int upto)
{
    for (int k = first; k < upto; k++)
        if (ly->layers[k].w >= 0)
            return 1;
    return 0;
}

/* Queue the backward of the forward just before (first, last, B) from device
 * dout [B, layers[last].out_numel] (d[0], d[1] or another device buffer),
 * with the parameters on the device: every gradient of layers first..last
 * into c->grads; with want_din, *din_dev gets the device gradient of the
 * input. With grads_direct (the host's gradient buffer, pinned), each layer's
 * gradients leave for it on the out stream as soon as they are computed. */
static int backward(model_cuda *c, int first, int last, const float *dout, int B, int want_din,
                    const float **din_dev, float *grads_direct, char *err, size_t errlen)
{
    const model_layout *ly = &c->base.layout;
    const float one = 1.0f, zero = 0.0f;
    if (c->fwd_first != first || c->fwd_last != last || c->fwd_batch != B)
        return errmsg(err, errlen, "backward_range(%d, %d, batch %d) does not pair with the forward "
                      "before it", first, last, B);
    const float *g = dout;
    for (int li = last; li >= first; li--) {
        const model_layer *l = &ly->layers[li];
        const int want = want_din || params_below(ly, first, li);
        if (!want && l->w < 0)
            break; /* nothing below needs a gradient, and this layer has no parameters */
        float *dx = NULL;
        if (want)
            dx = g == c->d[0] ? c->d[1] : c->d[0];
        const size_t n_in = (size_t)B * l->in_numel;
        const float *x = c->inp[li];
        switch (l->kind) {
        case LAYER_DENSE: {
            const int K = (int)l->in_numel, N = (int)l->out_numel;
            const float *W = c->params + ly->tensors[l->w].offset;
            float *dW = c->grads + ly->tensors[l->w].offset, *db = c->grads + ly->tensors[l->b].offset;
            /* db [N] = dout^T ones: the column-major [N, B] matrix times ones [B] */
            CKB(blas.Sgemv(c->blas, CUBLAS_OP_N, N, B, &one, g, N, c->ones, 1, &zero, db, 1));
            /* dW [K, N] = x^T @ dout: dW^T [N, K] = dout^T [N, B] (x^T)^T */
            CKB(blas.Sgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_T, N, K, B, &one, g, N, x, K, &zero, dW, N));
            /* dx [B, K] = dout @ W^T: dx^T [K, B] = (W^T)^T [K, N] dout^T [N, B] */
            if (dx)
                CKB(blas.Sgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, K, B, N, &one, W, N, g, N, &zero, dx,
                               K));
            break;
        }
        case LAYER_CONV2D: {
            const int K = l->kh * l->kw * l->in.c, N = l->out.c, P = l->out.h * l->out.w;
            const float *W = c->params + ly->tensors[l->w].offset;
            float *dW = c->grads + ly->tensors[l->w].offset, *db = c->grads + ly->tensors[l->b].offset;
            const int nb_max = conv_chunk(l, B);
            const geom gm = geom_of(l);
            CKB(blas.Sgemv(c->blas, CUBLAS_OP_N, N, B * P, &one, g, N, c->ones, 1, &zero, db, 1));
            for (int e0 = 0; e0 < B; e0 += nb_max) {
                const int nb = B - e0 < nb_max ? B - e0 : nb_max;
                const float *d = g + (size_t)e0 * l->out_numel;
                const size_t cn = (size_t)nb * P * K;
                const float beta = e0 == 0 ? 0.0f : 1.0f;
                k_im2col<<<grid_for(cn, 256), 256, 0, c->stream>>>(c->col, x + (size_t)e0 * l->in_numel,
                                                                   nb, gm);
                CKL("k_im2col (backward)");
                /* dW [K, N] (+)= col^T [K, nb*P] @ d [nb*P, N] */
                CKB(blas.Sgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_T, N, K, nb * P, &one, d, N, c->col, K,
                               &beta, dW, N));
                if (dx) {
                    /* dcol [nb*P, K] = d [nb*P, N] @ W^T [N, K], then col2im */
                    CKB(blas.Sgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, K, nb * P, N, &one, W, N, d, N,
                                   &zero, c->col, K));
                    const size_t in_n = (size_t)nb * l->in_numel;
                    k_col2im<<<grid_for(in_n, 256), 256, 0, c->stream>>>(dx + (size_t)e0 * l->in_numel,
                                                                         c->col, nb, gm);
                    CKL("k_col2im");
                }
            }
            break;
        }
        case LAYER_MAXPOOL:
            k_maxpool_back<<<grid_for(n_in, 256), 256, 0, c->stream>>>(dx, g, c->argmax[li], B, geom_of(l));
            CKL("k_maxpool_back");
            break;
        case LAYER_RELU:
            k_relu_back<<<grid_for(n_in, 256), 256, 0, c->stream>>>(dx, g, c->act[li], n_in);
            CKL("k_relu_back");
            break;
        case LAYER_DROPOUT:
            if (c->dropout_on[li]) {
                k_dropout_back<<<grid_for(n_in, 256), 256, 0, c->stream>>>(dx, g, c->keep[li], n_in,
                                                                           l->scale);
                CKL("k_dropout_back");
            } else {
                CK(cudaMemcpyAsync(dx, g, n_in * sizeof(float), cudaMemcpyDeviceToDevice, c->stream));
            }
            break;
        case LAYER_FLATTEN:
            dx = (float *)g; /* the same floats */
            break;
        }
        if (grads_direct && l->w >= 0) {
            /* W and b of this layer are adjacent (create checked): one copy */
            const size_t lo = ly->tensors[l->w].offset;
            const size_t hi = ly->tensors[l->b].offset + ly->tensors[l->b].numel;
            CK(cudaEventRecord(c->layer_done[li], c->stream));
            CK(cudaStreamWaitEvent(c->out, c->layer_done[li], 0));
            CK(cudaMemcpyAsync(grads_direct + lo, c->grads + lo, (hi - lo) * sizeof(float),
                               cudaMemcpyDeviceToHost, c->out));
        }
        g = dx;
    }
    if (din_dev)
        *din_dev = want_din ? g : NULL;
    return 0;
fail:
    return -1;
}

/* The gradients of layers first..last (computed on the device) to the host's
 * grads, unless they went out directly; ends with every stream but in idle. */
static int grads_out(model_cuda *c, float *grads, int direct, int first, int last, char *err,
                     size_t errlen)
{
    size_t lo = 0, hi = 0;
    if (direct) {
        CK(cudaStreamSynchronize(c->stream));
        CK(cudaStreamSynchronize(c->out));
        return 0;
    }
    if (range_tensors(&c->base.layout, first, last, &lo, &hi))
        return copy_out(c, grads + lo, c->h_grads + lo, c->grads + lo, (hi - lo) * sizeof(float), err,
                        errlen);
    CK(cudaStreamSynchronize(c->stream));
    return 0;
fail:
    return -1;
}

static int check_labels(const uint8_t *labels, int64_t n, int n_classes)
{
    for (int64_t i = 0; i < n; i++)
        if (labels[i] >= n_classes)
            return -1;
    return 0;
}

/* The parameters of layers first..last to the device, on the compute stream. */
static int params_in(model_cuda *c, const float *params, int first, int last, char *err, size_t errlen)
{
    size_t lo = 0, hi = 0;
    if (!range_tensors(&c->base.layout, first, last, &lo, &hi))
        return 0;
    return copy_in(c, c->stream, c->params + lo, c->h_params + lo, params + lo,
                   (hi - lo) * sizeof(float), err, errlen);
}

/* ---- the table ---------------------------------------------------------- */

static int cuda_forward_backward(model *m, const float *params, const float *x, const uint8_t *labels,
                                 int B, const model_ctx *ctx, float *grads, double *loss)
{
    model_cuda *c = (model_cuda *)m;
    const model_layout *ly = &m->layout;
    const int L = ly->n_layers, C = ly->n_classes;
    const size_t P = ly->n_params;
    char err[512];
    const size_t errlen = sizeof(err);
    if (check_labels(labels, B, C) != 0) {
        stage_end(c); /* every call ends the staging (model.h) */
        return -1;
    }
    /* the staged batch when it is this one (slot 1), else the step copies x
     * and labels itself (slot 0); either way this call ends the staging */
    const int staged = c->staged && x == c->st_x && labels == c->st_y && B == c->st_B;
    const float *dx = c->xs[staged];
    const uint8_t *dy = c->ys[staged];
    const int direct_out = is_pinned(c, grads, P * sizeof(float));
    /* params pinned: the first layer with parameters (p0) comes in on the
     * compute stream, ahead of the batch; the other layers' on the in stream
     * after it, each awaited just before its layer (forward), so a layer's
     * compute hides the next ones' upload */
    const int direct_in = is_pinned(c, params, P * sizeof(float));
    int p0 = 0;
    while (p0 < L - 1 && ly->layers[p0].w < 0)
        p0++;
    CK(cudaSetDevice(c->device));
    if (direct_in) {
        const model_layer *l0 = &ly->layers[p0];
        const size_t hi0 = ly->tensors[l0->b].offset + ly->tensors[l0->b].numel; /* from 0 */
        CK(cudaMemcpyAsync(c->params, params, hi0 * sizeof(float), cudaMemcpyHostToDevice, c->stream));
    } else if (params_in(c, params, 0, L - 1, err, errlen) != 0) {
        goto fail;
    }
    if (staged)
        CK(cudaStreamWaitEvent(c->stream, c->staged_ev, 0));
    else if (copy_in(c, c->stream, c->xs[0], c->h_x, x, (size_t)B * ly->n_in * sizeof(float), err,
                     errlen) != 0 ||
             copy_in(c, c->stream, c->ys[0], c->h_y, labels, (size_t)B, err, errlen) != 0)
        goto fail;
    if (queue_rowhash(c, 0, L - 1, B, ctx, err, errlen) != 0)
        goto fail;
    if (direct_in && p0 < L - 1) {
        CK(cudaEventRecord(c->in0_done, c->stream));
        CK(cudaStreamWaitEvent(c->in, c->in0_done, 0));
        for (int li = p0 + 1; li < L; li++) {
            const model_layer *l = &ly->layers[li];
            if (l->w < 0)
                continue;
            const size_t lo = ly->tensors[l->w].offset;
            const size_t hi = ly->tensors[l->b].offset + ly->tensors[l->b].numel;
            CK(cudaMemcpyAsync(c->params + lo, params + lo, (hi - lo) * sizeof(float),
                               cudaMemcpyHostToDevice, c->in));
            CK(cudaEventRecord(c->param_ready[li], c->in));
        }
    }
    if (forward(c, 0, L - 1, dx, B, ctx, direct_in ? p0 : L - 1, err, errlen) != 0)
        goto fail;
    /* d[0] [B, C] = (softmax - onehot) / B, the row losses */
    k_softmax_xent<<<grid_for((size_t)B, 128), 128, 0, c->stream>>>(c->y_last, dy, B, C, 1.0f / (float)B,
                                                                    c->d[0], c->rowloss, c->rowright);
    CKL("k_softmax_xent");
    k_sum_rows<<<1, SUM_THREADS, 0, c->stream>>>(c->rowloss, c->rowright, B, c->sums, 0);
    CKL("k_sum_rows");
    CK(cudaMemcpyAsync(c->h_sums, c->sums, 2 * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    if (backward(c, 0, L - 1, c->d[0], B, 0, NULL, direct_out ? grads : NULL, err, errlen) != 0 ||
        grads_out(c, grads, direct_out, 0, L - 1, err, errlen) != 0)
        goto fail;
    /* the parameter uploads on in are done (the compute waited for each); a
     * staged batch this call did not use may still be coming in */
    CK(cudaStreamSynchronize(c->in));
    c->staged = 0;
    *loss = c->h_sums[0] / B;
    return 0;
fail:
    fprintf(stderr, "model_cuda: forward_backward: %s\n", err);
    drain(c);
    c->staged = 0;
    c->fwd_first = -1;
    *loss = NAN;
    return -1;
}

static int cuda_evaluate(model *m, const float *params, const float *x, const uint8_t *labels,
                         int64_t n, double *loss, double *accuracy)
{
    model_cuda *c = (model_cuda *)m;
    const model_layout *ly = &m->layout;
    const int L = ly->n_layers, C = ly->n_classes;
    const size_t D = ly->n_in;
    const model_ctx inference = {0, 0, NULL, 0, 1, NULL, NULL, NULL, NULL};
    char err[512];
    const size_t errlen = sizeof(err);
    stage_end(c); /* evaluate ends the staging too (model.h); it uses slot 0 */
    c->fwd_first = -1; /* no backward pairs with an evaluation */
    if (check_labels(labels, n, C) != 0)
        return -1;
    CK(cudaSetDevice(c->device));
    if (params_in(c, params, 0, L - 1, err, errlen) != 0)
        goto fail;
    for (int64_t start = 0; start < n; start += m->max_batch) {
        int B = (int)(n - start < m->max_batch ? n - start : m->max_batch);
        /* a staging buffer is reused: the previous chunk's copy from it must
         * be done (the caller's pinned memory needs no wait) */
        if (start > 0 && (!is_pinned(c, x + (size_t)start * D, (size_t)B * D * sizeof(float)) ||
                          !is_pinned(c, labels + start, (size_t)B)))
            CK(cudaStreamSynchronize(c->stream));
        if (copy_in(c, c->stream, c->xs[0], c->h_x, x + (size_t)start * D, (size_t)B * D * sizeof(float),
                    err, errlen) != 0 ||
            copy_in(c, c->stream, c->ys[0], c->h_y, labels + start, (size_t)B, err, errlen) != 0)
            goto fail;
        if (forward(c, 0, L - 1, c->xs[0], B, &inference, L - 1, err, errlen) != 0)
            goto fail;
        k_softmax_xent<<<grid_for((size_t)B, 128), 128, 0, c->stream>>>(
            c->y_last, c->ys[0], B, C, 1.0f, NULL, c->rowloss, c->rowright);
        CKL("k_softmax_xent (evaluate)");
        k_sum_rows<<<1, SUM_THREADS, 0, c->stream>>>(c->rowloss, c->rowright, B, c->sums, start > 0);
        CKL("k_sum_rows (evaluate)");
    }
    CK(cudaMemcpyAsync(c->h_sums, c->sums, 2 * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    c->fwd_first = -1;
    *loss = c->h_sums[0] / (double)n;
    *accuracy = c->h_sums[1] / (double)n;
    return 0;
fail:
    fprintf(stderr, "model_cuda: evaluate: %s\n", err);
    drain(c);
    c->fwd_first = -1;
    *loss = NAN;
    *accuracy = NAN;
    return -1;
}

static int cuda_forward_range(model *m, int first, int last, const float *params, const float *in,
                              int B, const model_ctx *ctx, float *out)
{
    model_cuda *c = (model_cuda *)m;
    const model_layout *ly = &m->layout;
    char err[512];
    const size_t errlen = sizeof(err);
    stage_end(c); /* forward_range ends the staging (model.h) */
    CK(cudaSetDevice(c->device));
    /* in goes to rin, which stays until the matching backward_range */
    if (params_in(c, params, first, last, err, errlen) != 0 ||
        copy_in(c, c->stream, c->rin, c->h_x, in, (size_t)B * ly->layers[first].in_numel * sizeof(float),
                err, errlen) != 0 ||
        queue_rowhash(c, first, last, B, ctx, err, errlen) != 0 ||
        forward(c, first, last, c->rin, B, ctx, last, err, errlen) != 0 ||
        copy_out(c, out, c->h_out, c->y_last, (size_t)B * ly->layers[last].out_numel * sizeof(float),
                 err, errlen) != 0)
        goto fail;
    return 0;
fail:
    fprintf(stderr, "model_cuda: forward_range(%d, %d): %s\n", first, last, err);
    drain(c);
    c->fwd_first = -1;
    return -1;
}

static int cuda_backward_range(model *m, int first, int last, const float *params, const float *dout,
                               int B, float *din, float *grads)
{
    model_cuda *c = (model_cuda *)m;
    const model_layout *ly = &m->layout;
    char err[512];
    const size_t errlen = sizeof(err);
    const float *din_dev = NULL;
    size_t lo = 0, hi = 0;
    const int has = range_tensors(ly, first, last, &lo, &hi);
    const int direct_out = has && is_pinned(c, grads + lo, (hi - lo) * sizeof(float));
    if (c->fwd_first != first || c->fwd_last != last || c->fwd_batch != B)
        return -1; /* as the CPU: no forward of this range to pair with */
    CK(cudaSetDevice(c->device));
    /* the parameters again (the CPU reads the ones passed here), dout to d[0] */
    if (params_in(c, params, first, last, err, errlen) != 0 ||
        copy_in(c, c->stream, c->d[0], c->h_x, dout, (size_t)B * ly->layers[last].out_numel * sizeof(float),
                err, errlen) != 0 ||
        backward(c, first, last, c->d[0], B, din != NULL, &din_dev, direct_out ? grads : NULL, err,
                 errlen) != 0)
        goto fail;
    if (din && copy_out(c, din, c->h_out, din_dev, (size_t)B * ly->layers[first].in_numel * sizeof(float),
                        err, errlen) != 0)
        goto fail;
    if (grads_out(c, grads, direct_out, first, last, err, errlen) != 0)
        goto fail;
    return 0;
fail:
    fprintf(stderr, "model_cuda: backward_range(%d, %d): %s\n", first, last, err);
    drain(c);
    return -1;
}

static int cuda_loss_head(model *m, const float *logits, const uint8_t *labels, int B, float *dlogits,
                          double *loss)
{
    model_cuda *c = (model_cuda *)m;
    const int C = m->layout.n_classes;
    char err[512];
    const size_t errlen = sizeof(err);
    /* d[0], d[1] and slot 0: nothing a forward_range keeps for its backward,
     * nor the staged batch */
    if (check_labels(labels, B, C) != 0)
        return -1;
    CK(cudaSetDevice(c->device));
    if (copy_in(c, c->stream, c->d[0], c->h_x, logits, (size_t)B * C * sizeof(float), err, errlen) != 0 ||
        copy_in(c, c->stream, c->ys[0], c->h_y, labels, (size_t)B, err, errlen) != 0)
        goto fail;
    k_softmax_xent<<<grid_for((size_t)B, 128), 128, 0, c->stream>>>(
        c->d[0], c->ys[0], B, C, 1.0f / (float)B, dlogits ? c->d[1] : NULL, c->rowloss, c->rowright);
    CKL("k_softmax_xent (loss_head)");
    k_sum_rows<<<1, SUM_THREADS, 0, c->stream>>>(c->rowloss, c->rowright, B, c->sums, 0);
    CKL("k_sum_rows (loss_head)");
    CK(cudaMemcpyAsync(c->h_sums, c->sums, 2 * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    if (dlogits) {
        if (copy_out(c, dlogits, c->h_out, c->d[1], (size_t)B * C * sizeof(float), err, errlen) != 0)
            goto fail;
    } else {
        CK(cudaStreamSynchronize(c->stream));
    }
    *loss = c->h_sums[0] / B;
    return 0;
fail:
    fprintf(stderr, "model_cuda: loss_head: %s\n", err);
    drain(c);
    *loss = NAN;
    return -1;
}

/* The embedding bag (model.h: bag_forward, bag_backward), the CPU's
 * embed_bag.c mirrored: one thread per output float forward (the bag's rows
 * summed in order, so the sum is the CPU's); backward one thread per
 * (index, column), atomicAdd into the row (the order of a row's additions
 * varies: within float rounding of the CPU's). Its buffers are allocated
 * per call on the instance's device (a bag's sizes vary from batch to
 * batch). */
static __global__ void k_bag_forward(float *out, const float *rows, const int32_t *idx, const int64_t *off,
                                     int B, int D, int mean)
{
    const size_t total = (size_t)B * (size_t)D;
    FOR_N(i, total) {
        int b = (int)(i / (size_t)D), k = (int)(i % (size_t)D);
        float acc = 0.0f;
        for (int64_t j = off[b]; j < off[b + 1]; j++)
            acc += rows[(size_t)idx[j] * D + k];
        int64_t cnt = off[b + 1] - off[b];
        if (mean && cnt > 0)
            acc *= 1.0f / (float)cnt;
        out[i] = acc;
    }
}

static __global__ void k_bag_backward(float *drows, const float *dout, const int32_t *idx, const int32_t *ex,
                                      const int64_t *off, int64_t nnz, int D, int mean)
{
    const size_t total = (size_t)nnz * (size_t)D;
    FOR_N(i, total) {
        int64_t j = (int64_t)(i / (size_t)D);
        int k = (int)(i % (size_t)D), b = ex[j];
        int64_t cnt = off[b + 1] - off[b];
        float s = mean && cnt > 0 ? 1.0f / (float)cnt : 1.0f;
        atomicAdd(&drows[(size_t)idx[j] * D + k], dout[(size_t)b * D + k] * s);
    }
}

static int cuda_bag(model_cuda *c, int fwd, const float *in, int64_t n_rows, int D, const int32_t *idx,
                    const int64_t *off, int B, int mean, float *out)
{
    char err[512];
    const size_t errlen = sizeof(err);
    const int64_t nnz = off[B];
    float *d_in = NULL, *d_out = NULL;
    int32_t *d_idx = NULL, *d_ex = NULL, *h_ex = NULL;
    int64_t *d_off = NULL;
    const size_t in_n = (fwd ? (size_t)n_rows : (size_t)B) * (size_t)D;
    const size_t out_n = (fwd ? (size_t)B : (size_t)n_rows) * (size_t)D;
    CK(cudaSetDevice(c->device));
    CK(cudaMalloc((void **)&d_in, (in_n ? in_n : 1) * sizeof(float)));
    CK(cudaMalloc((void **)&d_out, (out_n ? out_n : 1) * sizeof(float)));
    CK(cudaMalloc((void **)&d_idx, (size_t)(nnz ? nnz : 1) * sizeof(int32_t)));
    CK(cudaMalloc((void **)&d_off, (size_t)(B + 1) * sizeof(int64_t)));
    /* on the instance's stream, from and to ordinary memory: each copy waited for (cudaMemcpyAsync
     * returns once pageable memory is staged; the synchronize makes the order plain) */
    CK(cudaMemcpyAsync(d_in, in, in_n * sizeof(float), cudaMemcpyHostToDevice, c->stream));
    CK(cudaMemcpyAsync(d_idx, idx, (size_t)nnz * sizeof(int32_t), cudaMemcpyHostToDevice, c->stream));
    CK(cudaMemcpyAsync(d_off, off, (size_t)(B + 1) * sizeof(int64_t), cudaMemcpyHostToDevice, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    if (fwd) {
        k_bag_forward<<<grid_for(out_n, 256), 256, 0, c->stream>>>(d_out, d_in, d_idx, d_off, B, D, mean);
        CKL("k_bag_forward");
    } else {
        /* each index's example, so a thread finds its bag at once */
        if (!(h_ex = (int32_t *)malloc((size_t)(nnz ? nnz : 1) * sizeof(int32_t)))) {
            errmsg(err, errlen, "out of memory");
            goto fail;
        }
        for (int b = 0; b < B; b++)
            for (int64_t j = off[b]; j < off[b + 1]; j++)
                h_ex[j] = b;
        CK(cudaMalloc((void **)&d_ex, (size_t)(nnz ? nnz : 1) * sizeof(int32_t)));
        CK(cudaMemcpyAsync(d_ex, h_ex, (size_t)nnz * sizeof(int32_t), cudaMemcpyHostToDevice, c->stream));
        CK(cudaStreamSynchronize(c->stream));
        CK(cudaMemset(d_out, 0, (out_n ? out_n : 1) * sizeof(float)));
        if (nnz > 0) {
            k_bag_backward<<<grid_for((size_t)nnz * (size_t)D, 256), 256, 0, c->stream>>>(d_out, d_in, d_idx, d_ex,
                                                                                          d_off, nnz, D, mean);
            CKL("k_bag_backward");
        }
    }
    CK(cudaMemcpyAsync(out, d_out, out_n * sizeof(float), cudaMemcpyDeviceToHost, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    cudaFree(d_in);
    cudaFree(d_out);
    cudaFree(d_idx);
    cudaFree(d_off);
    cudaFree(d_ex);
    free(h_ex);
    return 0;
fail:
    fprintf(stderr, "model_cuda: %s: %s\n", fwd ? "bag_forward" : "bag_backward", err);
    cudaFree(d_in);
    cudaFree(d_out);
    cudaFree(d_idx);
    cudaFree(d_off);
    cudaFree(d_ex);
    free(h_ex);
    return -1;
}

static int cuda_bag_forward(model *m, const float *rows, int64_t n_rows, int dim, const int32_t *idx,
                            const int64_t *off, int batch, int mean, float *out)
{
    return cuda_bag((model_cuda *)m, 1, rows, n_rows, dim, idx, off, batch, mean, out);
}

static int cuda_bag_backward(model *m, const float *dout, int64_t n_rows, int dim, const int32_t *idx,
                             const int64_t *off, int batch, int mean, float *drows)
{
    return cuda_bag((model_cuda *)m, 0, dout, n_rows, dim, idx, off, batch, mean, drows);
}

/* model_stage_batch: x and labels into slot 1 on the in stream, with
 * staged_ev after them; from pinned memory asynchronously, from other memory
 * through the staging buffers, waited for here (the call's own copies reuse
 * them). */
static int cuda_stage_batch(model *m, const float *x, const uint8_t *labels, int B)
{
    model_cuda *c = (model_cuda *)m;
    char err[512];
    const size_t errlen = sizeof(err);
    stage_end(c); /* one staged batch at a time: this one replaces it */
    const size_t xbytes = (size_t)B * m->layout.n_in * sizeof(float);
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
    fprintf(stderr, "model_cuda: stage_batch: %s\n", err);
    (void)cudaStreamSynchronize(c->in); /* nothing staged: no copy may go on */
    (void)cudaGetLastError();
    return -1;
}

/* (positional: C++17 has no designated initializers; model.h's order) */
extern "C" const model_backend model_backend_cuda = {
    "cuda",
    cuda_create,
    cuda_destroy,
    cuda_forward_backward,
    cuda_evaluate,
    cuda_host_alloc,
    cuda_host_free,
    cuda_stage_batch,
    cuda_forward_range,
    cuda_backward_range,
    cuda_loss_head,
    nullptr, /* backward_range_add: model_backward_range_add's sum over backward_range */
    cuda_bag_forward,
    cuda_bag_backward,
    0, /* layer_hooks: the front door calls model_ctx's overlap hooks around forward_backward */
};
