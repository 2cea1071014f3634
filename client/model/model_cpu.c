/* model_cpu.c - the CPU backend of model.h, the reference the CUDA backend is
 * tested against. Each layer is a forward and a backward function, outputs
 * first, then inputs, then weights, then sizes (as llm.c writes them):
 *   dense    one cblas_sgemm forward (x @ W), two backward (x^T @ dy, dy @ W^T),
 *            bias and its column sums in single-pass loops;
 *   conv2d   im2col + cblas_sgemm forward, and both backward products (col^T @ dy
 *            for the kernel, dy @ W^T then col2im for the input), in chunks of
 *            examples so the column buffer stays small;
 *   maxpool  the argmax of every output saved forward, the gradient sent there;
 *   relu, dropout (the mask of dropout_mask.h, saved), flatten (the same floats:
 *            no copy), and the softmax cross-entropy head.
 * The workspace is allocated (and touched) once in create(); a step allocates
 * nothing. mlp:100 computes, bit for bit, what the MLP-only mlp_cpu.c did: the
 * same sgemm calls on the same operands, the same bias, ReLU and softmax
 * arithmetic in the same order. */
#include "errmsg.h"
#include "model/model.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/dropout_mask.h"

/* The column buffer holds at most this many floats (1 MiB), or one example's:
 * measured with the cnn at batch 100 (one OpenBLAS Zen thread), conv 1's three
 * products ran at 17-19 GFLOP/s in chunks of 26 examples (16 MiB) and 22-26 in
 * chunks of one (627 KB): a chunk this size stays in L2/L3 between im2col, the
 * packing and the kernel. (-DCOL_BUDGET=N builds with another, to measure.) */
#ifndef COL_BUDGET
#define COL_BUDGET ((size_t)1 << 18)
#endif

typedef struct model_cpu {
    model base; /* first: a model_cpu * is a model * */
    /* act[l]: layer l's output [max_batch, out_numel] in the last forward: own[l]
     * (the layer's block), or its input's for a flatten and for a ReLU whose
     * conv below computed it in place. in[l]: layer l's input in the last
     * forward. */
    float *act[MODEL_MAX_LAYERS];
    float *own[MODEL_MAX_LAYERS];
    const float *in[MODEL_MAX_LAYERS];
    uint8_t *keep[MODEL_MAX_LAYERS];   /* dropout: 1 kept, 0 dropped [max_batch, numel] */
    int dropout_on[MODEL_MAX_LAYERS];  /* the last forward applied the mask */
    int32_t *argmax[MODEL_MAX_LAYERS]; /* maxpool: input index per output [max_batch, out_numel] */
    float *col;                        /* im2col / dcol, col_floats */
    size_t col_floats;
    float *d[2];                       /* gradients, [max_batch, max_act] each */
    float *conv_grad;                  /* backward_range_add: a convolution's kernel and bias gradients */
    size_t conv_grad_floats;           /* the largest convolution's kernel + bias */
    int fwd_first, fwd_last, fwd_batch; /* the forward backward_range pairs with; first -1: none */
    void *blocks[3 * MODEL_MAX_LAYERS + 4];
    int n_blocks;
} model_cpu;

void model_cpu_set_threads(int n)
{
    openblas_set_num_threads(n < 1 ? 1 : n);
}

const char *model_cpu_blas_core(void)
{
    return openblas_get_corename();
}

/* ---- the layers --------------------------------------------------------- */

/* The elementwise loops work in fixed chunks of VEC floats with restrict
 * pointers: at -O2, GCC vectorizes only loops it can replace whole, and a
 * chunk of known length is one. */
#define VEC 16

/* z[B, N] += b */
static void bias_add(float *restrict z, const float *restrict b, size_t B, int N)
{
    for (size_t i = 0; i < B; i++) {
        float *restrict zi = z + i * (size_t)N;
        int j = 0;
        for (; j + VEC <= N; j += VEC)
            for (int k = 0; k < VEC; k++)
                zi[j + k] += b[j + k];
        for (; j < N; j++)
            zi[j] += b[j];
    }
}

/* z[B, N] = max(z + b, 0): bias_add and the ReLU after it in one pass (the same floats) */
static void bias_relu(float *restrict z, const float *restrict b, size_t B, int N)
{
    for (size_t i = 0; i < B; i++) {
        float *restrict zi = z + i * (size_t)N;
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

/* db[N] = column sums of d[B, N] (rows in order, from 0). */
static void col_sums(float *restrict db, const float *restrict d, size_t B, int N, int add)
{
    if (!add)
        memset(db, 0, (size_t)N * sizeof(float));
    for (size_t i = 0; i < B; i++) {
        const float *restrict di = d + i * (size_t)N;
        int j = 0;
        for (; j + VEC <= N; j += VEC)
            for (int k = 0; k < VEC; k++)
                db[j + k] += di[j + k];
        for (; j < N; j++)
            db[j] += di[j];
    }
}

/* out[B, N] = in[B, K] @ W[K, N] + b[N] */
static void dense_forward(float *out, const float *in, const float *W, const float *b, int B, int K,
                          int N)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, N, K, 1.0f, in, K, W, N, 0.0f, out, N);
    bias_add(out, b, (size_t)B, N);
}

/* dW = in^T @ dout, db = column sums of dout, din = dout @ W^T (din NULL: not wanted).
 * dW with beta 1 on a zeroed dW: the same floats as beta 0 (0 + x), and
 * memset zeroes faster than OpenBLAS's beta pass (fc0 of the cnn, 12.8 MB:
 * 10.0 -> 9.4 ms at batch 100, one Zen thread, CPU time, best of 11).
 * (Blocks of dW's rows, or of din's columns, would be faster still, 9.2 and
 * 9.5 instead of 10.9 ms for din, but OpenBLAS then sums some elements in
 * another order: not the same floats.) */
static void dense_backward(float *din, float *dW, float *db, const float *dout, const float *in,
                           const float *W, int B, int K, int N, int add)
{
    col_sums(db, dout, (size_t)B, N, add);
    if (!add) /* add: the sgemm's beta 1 adds to the sum the caller keeps */
        memset(dW, 0, (size_t)K * N * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, N, B, 1.0f, in, K, dout, N, 1.0f, dW, N);
    if (din)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, K, N, 1.0f, dout, N, W, N, 0.0f, din,
                    K);
}

/* The taps kx0..kx1-1 of a window row whose left edge is at input column x0
 * (the others over the padding): kx0 = max(-x0, 0), kx1 = min(W - x0, KW). */
static inline void window_cols(int x0, int W, int KW, int *kx0, int *kx1)
{
    *kx0 = x0 < 0 ? -x0 : 0;
    *kx1 = W - x0 < KW ? W - x0 : KW;
    if (*kx1 < *kx0)
        *kx1 = *kx0;
}

/* col[nb * OH * OW, KH * KW * C] from in[nb, H, W, C]: row (e, oy, ox), column
 * (ky, kx, c), zero where the window is over the padding. The taps of one
 * window row that are inside the input are one run of memory (NHWC), copied
 * at once. */
static void im2col(float *restrict col, const float *restrict in, int nb, const model_layer *l)
{
    const int H = l->in.h, W = l->in.w, C = l->in.c, OH = l->out.h, OW = l->out.w;
    const int KH = l->kh, KW = l->kw, S = l->stride;
    const size_t rowlen = (size_t)KH * KW * C, wrow = (size_t)KW * C;
    float *restrict r = col;
    for (int e = 0; e < nb; e++) {
        const float *ie = in + (size_t)e * l->in_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++, r += rowlen) {
                const int x0 = ox * S - l->pad_left;
                int kx0, kx1;
                window_cols(x0, W, KW, &kx0, &kx1);
                float *restrict q = r;
                for (int ky = 0; ky < KH; ky++, q += wrow) {
                    int iy = oy * S - l->pad_top + ky;
                    if (iy < 0 || iy >= H) {
                        memset(q, 0, wrow * sizeof(float));
                        continue;
                    }
                    if (kx0 > 0)
                        memset(q, 0, (size_t)kx0 * C * sizeof(float));
                    if (kx1 > kx0)
                        memcpy(q + (size_t)kx0 * C, ie + ((size_t)iy * W + x0 + kx0) * C,
                               (size_t)(kx1 - kx0) * C * sizeof(float));
                    if (kx1 < KW)
                        memset(q + (size_t)kx1 * C, 0, (size_t)(KW - kx1) * C * sizeof(float));
                }
            }
    }
}

/* p[n] += q[n] */
static inline __attribute__((always_inline)) void add_to(float *restrict p, const float *restrict q,
                                                         size_t n)
{
    size_t j = 0;
    for (; j + VEC <= n; j += VEC)
        for (int k = 0; k < VEC; k++)
            p[j + k] += q[j + k];
    for (; j < n; j++)
        p[j] += q[j];
}

/* The adjoint of im2col: din[nb, H, W, C] += col's entries at their inputs
 * (each window row's inside taps as one run, the same sums in the same order
 * as one tap at a time). Inlined into col2im and, on x86-64, col2im_avx2
 * (the same adds, 8 floats a vector instead of 4). */
static inline __attribute__((always_inline)) void col2im_body(float *restrict din,
                                                              const float *restrict col, int nb,
                                                              const model_layer *l)
{
    const int H = l->in.h, W = l->in.w, C = l->in.c, OH = l->out.h, OW = l->out.w;
    const int KH = l->kh, KW = l->kw, S = l->stride;
    const size_t rowlen = (size_t)KH * KW * C, wrow = (size_t)KW * C;
    const float *restrict r = col;
    for (int e = 0; e < nb; e++) {
        float *de = din + (size_t)e * l->in_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++, r += rowlen) {
                const int x0 = ox * S - l->pad_left;
                int kx0, kx1;
                window_cols(x0, W, KW, &kx0, &kx1);
                const float *restrict q = r;
                for (int ky = 0; ky < KH; ky++, q += wrow) {
                    int iy = oy * S - l->pad_top + ky;
                    if (iy < 0 || iy >= H || kx1 <= kx0)
                        continue;
                    add_to(de + ((size_t)iy * W + x0 + kx0) * C, q + (size_t)kx0 * C,
                           (size_t)(kx1 - kx0) * C);
                }
            }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static void col2im_avx2(float *restrict din, const float *restrict col,
                                                         int nb, const model_layer *l)
{
    col2im_body(din, col, nb, l);
}
#endif

static void col2im(float *restrict din, const float *restrict col, int nb, const model_layer *l)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2")) {
        col2im_avx2(din, col, nb, l);
        return;
    }
#endif
    col2im_body(din, col, nb, l);
}

/* Examples per im2col chunk of layer l. */
static int conv_chunk(const model_layer *l, int B)
{
    size_t per = (size_t)l->out.h * l->out.w * (size_t)l->kh * l->kw * l->in.c;
    size_t nb = per ? COL_BUDGET / per : (size_t)B;
    if (nb < 1)
        nb = 1;
    return nb > (size_t)B ? B : (int)nb;
}

/* out[B, OH, OW, Cout] = conv(in[B, H, W, Cin], W[KH, KW, Cin, Cout]) + b, or
 * with relu != 0 max(that, 0), the ReLU that follows, applied with the bias
 * chunk by chunk while the chunk is in the cache (the same floats as
 * relu_forward on the convolution's output, which is not kept). */
static void conv_forward(float *out, int relu, float *col, const float *in, const float *W,
                         const float *b, int B, const model_layer *l)
{
    const int K = l->kh * l->kw * l->in.c, N = l->out.c, P = l->out.h * l->out.w;
    const int nb_max = conv_chunk(l, B);
    for (int e0 = 0; e0 < B; e0 += nb_max) {
        int nb = B - e0 < nb_max ? B - e0 : nb_max;
        im2col(col, in + (size_t)e0 * l->in_numel, nb, l);
        float *o = out + (size_t)e0 * l->out_numel;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb * P, N, K, 1.0f, col, K, W, N, 0.0f,
                    o, N);
        if (relu)
            bias_relu(o, b, (size_t)nb * P, N);
        else
            bias_add(o, b, (size_t)nb * P, N);
    }
}

/* conv2d with C_in = 1 (the first layer of an image model), computed directly:
 * im2col's rows would be only KH * KW floats long, too short for sgemm (2-3
 * GFLOP/s measured for conv 0 of the cnn). The output channels in blocks of
 * C1_BLOCK held in four vector accumulators (GCC's vector extension: plain
 * arrays were kept on the stack), the rest one at a time. */
typedef float v4f __attribute__((vector_size(16)));
#define C1_BLOCK 32
/* X(i) for the eight 4-float parts of a block */
#define C1_PARTS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

static inline v4f v4_load(const float *p)
{
    v4f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void v4_store(float *p, v4f v)
{
    memcpy(p, &v, sizeof(v));
}

/* p[n] = max(p[n], 0) */
static void relu_inplace(float *restrict p, size_t n)
{
    size_t j = 0;
    for (; j + VEC <= n; j += VEC)
        for (int k = 0; k < VEC; k++) {
            float v = p[j + k];
            p[j + k] = v > 0.0f ? v : 0.0f;
        }
    for (; j < n; j++) {
        float v = p[j];
        p[j] = v > 0.0f ? v : 0.0f;
    }
}

/* out[p, n] = (sum over the taps in the input, row-major, of in[tap] * W[tap, n]) + b[n],
 * or with relu != 0 max(that, 0), each pixel's while it is in the cache. */
static void conv1_forward(float *out, int relu, const float *in, const float *W, const float *b,
                          int B, const model_layer *l)
{
    const int H = l->in.h, Wd = l->in.w, OH = l->out.h, OW = l->out.w, N = l->out.c;
    const int KH = l->kh, KW = l->kw, S = l->stride;
    for (int e = 0; e < B; e++) {
        const float *ie = in + (size_t)e * l->in_numel;
        float *oe = out + (size_t)e * l->out_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                float *o = oe + ((size_t)oy * OW + ox) * N;
                const int y0 = oy * S - l->pad_top, x0 = ox * S - l->pad_left;
                const int ky0 = y0 < 0 ? -y0 : 0, ky1 = H - y0 < KH ? H - y0 : KH;
                const int kx0 = x0 < 0 ? -x0 : 0, kx1 = Wd - x0 < KW ? Wd - x0 : KW;
                int n0 = 0;
                for (; n0 + C1_BLOCK <= N; n0 += C1_BLOCK) {
#define C1_ZERO(i) v4f a##i = {0};
#define C1_FMA(i) a##i += v * v4_load(w + 4 * (i));
#define C1_OUT(i) v4_store(o + n0 + 4 * (i), a##i + v4_load(b + n0 + 4 * (i)));
                    C1_PARTS(C1_ZERO)
                    for (int ky = ky0; ky < ky1; ky++)
                        for (int kx = kx0; kx < kx1; kx++) {
                            const float v = ie[(size_t)(y0 + ky) * Wd + x0 + kx];
                            const float *w = W + (size_t)(ky * KW + kx) * N + n0;
                            C1_PARTS(C1_FMA)
                        }
                    C1_PARTS(C1_OUT)
                }
                for (; n0 < N; n0++) {
                    float acc = 0.0f;
                    for (int ky = ky0; ky < ky1; ky++)
                        for (int kx = kx0; kx < kx1; kx++)
                            acc += ie[(size_t)(y0 + ky) * Wd + x0 + kx] * W[(size_t)(ky * KW + kx) * N + n0];
                    o[n0] = acc + b[n0];
                }
                if (relu)
                    relu_inplace(o, (size_t)N);
            }
    }
}

/* The backward of conv1_forward: db = column sums of dout; dW = sum over the
 * examples (in order) of each example's sum over its pixels (row-major) of
 * in[tap] * dout[p, :], that sum in acc [KH * KW * N] (per tap, the channels
 * in vector accumulators); din (NULL: not wanted) += dout[p, :] . W[tap, :]
 * for each pixel and tap. */
static void conv1_backward(float *din, float *dW, float *db, float *acc, const float *dout,
                           const float *in, const float *W, int B, const model_layer *l)
{
    const int H = l->in.h, Wd = l->in.w, OH = l->out.h, OW = l->out.w, N = l->out.c;
    const int KH = l->kh, KW = l->kw, S = l->stride;
    const size_t nw = (size_t)KH * KW * N;
    col_sums(db, dout, (size_t)B * OH * OW, N, 0);
    if (din)
        memset(din, 0, (size_t)B * l->in_numel * sizeof(float));
    for (int e = 0; e < B; e++) {
        const float *ie = in + (size_t)e * l->in_numel;
        const float *de = dout + (size_t)e * l->out_numel;
        float *g = e == 0 ? dW : acc;
        for (int ky = 0; ky < KH; ky++)
            for (int kx = 0; kx < KW; kx++) {
                float *gt = g + (size_t)(ky * KW + kx) * N;
                /* the outputs whose window puts this tap inside the input */
                int oy0 = 0, oy1 = OH, ox0 = 0, ox1 = OW;
                while (oy0 < OH && oy0 * S - l->pad_top + ky < 0)
                    oy0++;
                while (oy1 > oy0 && (oy1 - 1) * S - l->pad_top + ky >= H)
                    oy1--;
                while (ox0 < OW && ox0 * S - l->pad_left + kx < 0)
                    ox0++;
                while (ox1 > ox0 && (ox1 - 1) * S - l->pad_left + kx >= Wd)
                    ox1--;
                int n0 = 0;
                for (; n0 + C1_BLOCK <= N; n0 += C1_BLOCK) {
#define C1_ACC(i) a##i += v * v4_load(w + 4 * (i));
#define C1_SAVE(i) v4_store(gt + n0 + 4 * (i), a##i);
                    C1_PARTS(C1_ZERO)
                    for (int oy = oy0; oy < oy1; oy++) {
                        const float *row = ie + (size_t)(oy * S - l->pad_top + ky) * Wd;
                        for (int ox = ox0; ox < ox1; ox++) {
                            const float v = row[ox * S - l->pad_left + kx];
                            const float *w = de + ((size_t)oy * OW + ox) * N + n0;
                            C1_PARTS(C1_ACC)
                        }
                    }
                    C1_PARTS(C1_SAVE)
                }
                for (; n0 < N; n0++) {
                    float a = 0.0f;
                    for (int oy = oy0; oy < oy1; oy++)
                        for (int ox = ox0; ox < ox1; ox++)
                            a += ie[(size_t)(oy * S - l->pad_top + ky) * Wd + ox * S - l->pad_left + kx] *
                                 de[((size_t)oy * OW + ox) * N + n0];
                    gt[n0] = a;
                }
                if (din) {
                    float *dine = din + (size_t)e * l->in_numel;
                    const float *w = W + (size_t)(ky * KW + kx) * N;
                    for (int oy = oy0; oy < oy1; oy++)
                        for (int ox = ox0; ox < ox1; ox++) {
                            const float *d = de + ((size_t)oy * OW + ox) * N;
                            float s = 0.0f;
                            for (int m = 0; m < N; m++)
                                s += d[m] * w[m];
                            dine[(size_t)(oy * S - l->pad_top + ky) * Wd + ox * S - l->pad_left + kx] += s;
                        }
                }
            }
        if (e > 0)
            for (size_t j = 0; j < nw; j++)
                dW[j] += acc[j];
    }
}

/* conv2d with C_in = 1 on AVX2 (x86-64 CPUs that have it, chosen at run time):
 * the same sums as conv1_forward and conv1_backward's dW, bit for bit, twice
 * as wide. Each example is first copied into pad [PH, PW], zero around it
 * (conv1_pad), so that every pixel sees the whole window: a tap over the
 * padding adds 0 * w, which leaves a sum as it is (a sum of products never is
 * -0, so adding +-0 changes nothing), and the taps are still added in the
 * same row-major order. Forward: two pixels at a time, four 8-float
 * accumulators each, sharing the weight loads; dW: two taps at a time,
 * sharing the loads of dout. Without FMA contraction (ISO C: fp-contract
 * off), as the SSE code. */
/* Where the padded example starts in the workspace (after conv1_backward's acc; conv1_forward_avx2 and conv1_dW_avx2's). */
static size_t conv1_pad_offset(const model_layer *l)
{
    return ((size_t)l->kh * l->kw * l->out.c + 15) & ~(size_t)15;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define X86_AVX2 1
typedef float v8f __attribute__((vector_size(32)));
#define C8_PARTS(X) X(0) X(1) X(2) X(3) /* the four 8-float parts of a block of C1_BLOCK */

/* The padded input's sides: enough rows and columns for every window. */
static void conv1_pad_dims(const model_layer *l, int *PH, int *PW)
{
    *PH = (l->out.h - 1) * l->stride + l->kh;
    *PW = (l->out.w - 1) * l->stride + l->kw;
    if (*PH < l->pad_top + l->in.h)
        *PH = l->pad_top + l->in.h;
    if (*PW < l->pad_left + l->in.w)
        *PW = l->pad_left + l->in.w;
}

/* pad[PH, PW] = the example ie[H, W] at (pad_top, pad_left), zero elsewhere */
static void conv1_pad(float *pad, const float *ie, int PH, int PW, const model_layer *l)
{
    memset(pad, 0, (size_t)PH * PW * sizeof(float));
    for (int y = 0; y < l->in.h; y++)
        memcpy(pad + (size_t)(y + l->pad_top) * PW + l->pad_left, ie + (size_t)y * l->in.w,
               (size_t)l->in.w * sizeof(float));
}

__attribute__((target("avx2"))) static void conv1_forward_avx2(float *out, int relu, float *pad,
                                                                const float *in, const float *W,
                                                                const float *b, int B,
                                                                const model_layer *l)
{
    const int OH = l->out.h, OW = l->out.w, N = l->out.c, KH = l->kh, KW = l->kw, S = l->stride;
    int PH, PW;
    conv1_pad_dims(l, &PH, &PW);
    const v8f zero = {0};
    for (int e = 0; e < B; e++) {
        conv1_pad(pad, in + (size_t)e * l->in_numel, PH, PW, l);
        float *oe = out + (size_t)e * l->out_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox += 2) {
                const int two = ox + 1 < OW;
                const float *p0 = pad + (size_t)oy * S * PW + (size_t)ox * S;
                const float *p1 = two ? p0 + S : p0; /* one pixel: computed twice, stored once */
                float *o0 = oe + ((size_t)oy * OW + ox) * N, *o1 = o0 + N;
                int n0 = 0;
                for (; n0 + C1_BLOCK <= N; n0 += C1_BLOCK) {
#define C8_ZERO(i) v8f a##i = zero, c##i = zero;
#define C8_MAC(i)                                                                                  \
    {                                                                                              \
        v8f w;                                                                                     \
        memcpy(&w, wt + 8 * (i), sizeof(w));                                                       \
        a##i += v0 * w;                                                                            \
        c##i += v1 * w;                                                                            \
    }
#define C8_STORE(o, acc, i)                                                                        \
    {                                                                                              \
        v8f bb, z;                                                                                 \
        memcpy(&bb, b + n0 + 8 * (i), sizeof(bb));                                                 \
        z = acc##i + bb;                                                                           \
        if (relu)                                                                                  \
            z = __builtin_ia32_maxps256(z, zero);                                                  \
        memcpy((o) + n0 + 8 * (i), &z, sizeof(z));                                                 \
    }
#define C8_OUT0(i) C8_STORE(o0, a, i)
#define C8_OUT1(i) C8_STORE(o1, c, i)
                    C8_PARTS(C8_ZERO)
                    for (int ky = 0; ky < KH; ky++)
                        for (int kx = 0; kx < KW; kx++) {
                            const float s0 = p0[(size_t)ky * PW + kx], s1 = p1[(size_t)ky * PW + kx];
                            const v8f v0 = {s0, s0, s0, s0, s0, s0, s0, s0};
                            const v8f v1 = {s1, s1, s1, s1, s1, s1, s1, s1};
                            const float *wt = W + (size_t)(ky * KW + kx) * N + n0;
                            C8_PARTS(C8_MAC)
                        }
                    C8_PARTS(C8_OUT0)
                    if (two)
                        C8_PARTS(C8_OUT1)
                }
                for (; n0 < N; n0++)
                    for (int k = 0; k <= two; k++) {
                        const float *pk = k ? p1 : p0;
                        float acc = 0.0f;
                        for (int ky = 0; ky < KH; ky++)
                            for (int kx = 0; kx < KW; kx++)
                                acc += pk[(size_t)ky * PW + kx] * W[(size_t)(ky * KW + kx) * N + n0];
                        float z = acc + b[n0];
                        (k ? o1 : o0)[n0] = relu && !(z > 0.0f) ? 0.0f : z;
                    }
            }
    }
}

/* dW (din is conv1_backward's): per example, per tap, the sum over the
 * pixels (row-major) of pad[tap's input] * dout[p, :]; acc and pad as there.
 * db, the column sums of dout, in the pass of the first two taps, which reads
 * dout's rows in order (the same sums as col_sums: from 0, the rows in order,
 * example after example), instead of a pass of its own over dout. */
__attribute__((target("avx2"))) static void conv1_dW_avx2(float *dW, float *db, float *acc, float *pad,
                                                           const float *dout, const float *in,
                                                           int B, const model_layer *l)
{
    const int OH = l->out.h, OW = l->out.w, N = l->out.c, KH = l->kh, KW = l->kw, S = l->stride;
    const int T = KH * KW;
    const size_t nw = (size_t)T * N;
    int PH, PW;
    conv1_pad_dims(l, &PH, &PW);
    const v8f zero = {0};
    memset(db, 0, (size_t)N * sizeof(float));
    for (int e = 0; e < B; e++) {
        conv1_pad(pad, in + (size_t)e * l->in_numel, PH, PW, l);
        const float *de = dout + (size_t)e * l->out_numel;
        float *g = e == 0 ? dW : acc;
        for (int t = 0; t < T; t += 2) {
            const int two = t + 1 < T;
            const int t1 = two ? t + 1 : t;
            const float *q0 = pad + (size_t)(t / KW) * PW + t % KW;
            const float *q1 = pad + (size_t)(t1 / KW) * PW + t1 % KW;
            float *g0 = g + (size_t)t * N, *g1 = g + (size_t)t1 * N;
            int n0 = 0;
            for (; n0 + C1_BLOCK <= N; n0 += C1_BLOCK) {
#define C8_ACC(i)                                                                                  \
    {                                                                                              \
        v8f d;                                                                                     \
        memcpy(&d, dp + 8 * (i), sizeof(d));                                                       \
        a##i += v0 * d;                                                                            \
        c##i += v1 * d;                                                                            \
    }
#define C8_SAVE0(i) memcpy(g0 + n0 + 8 * (i), &a##i, sizeof(a##i));
#define C8_SAVE1(i) memcpy(g1 + n0 + 8 * (i), &c##i, sizeof(c##i));
                C8_PARTS(C8_ZERO)
                if (t == 0) {
#define C8_DB_LOAD(i) v8f sb##i; memcpy(&sb##i, db + n0 + 8 * (i), sizeof(sb##i));
#define C8_DB_ADD(i)                                                                               \
    {                                                                                              \
        v8f d;                                                                                     \
        memcpy(&d, dp + 8 * (i), sizeof(d));                                                       \
        sb##i += d;                                                                                \
    }
#define C8_DB_SAVE(i) memcpy(db + n0 + 8 * (i), &sb##i, sizeof(sb##i));
                    C8_PARTS(C8_DB_LOAD)
                    for (int oy = 0; oy < OH; oy++) {
                        const float *r0 = q0 + (size_t)oy * S * PW, *r1 = q1 + (size_t)oy * S * PW;
                        const float *drow = de + (size_t)oy * OW * N + n0;
                        for (int ox = 0; ox < OW; ox++) {
                            const float s0 = r0[(size_t)ox * S], s1 = r1[(size_t)ox * S];
                            const v8f v0 = {s0, s0, s0, s0, s0, s0, s0, s0};
                            const v8f v1 = {s1, s1, s1, s1, s1, s1, s1, s1};
                            const float *dp = drow + (size_t)ox * N;
                            C8_PARTS(C8_ACC)
                            C8_PARTS(C8_DB_ADD)
                        }
                    }
                    C8_PARTS(C8_DB_SAVE)
                } else {
                    for (int oy = 0; oy < OH; oy++) {
                        const float *r0 = q0 + (size_t)oy * S * PW, *r1 = q1 + (size_t)oy * S * PW;
                        const float *drow = de + (size_t)oy * OW * N + n0;
                        for (int ox = 0; ox < OW; ox++) {
                            const float s0 = r0[(size_t)ox * S], s1 = r1[(size_t)ox * S];
                            const v8f v0 = {s0, s0, s0, s0, s0, s0, s0, s0};
                            const v8f v1 = {s1, s1, s1, s1, s1, s1, s1, s1};
                            const float *dp = drow + (size_t)ox * N;
                            C8_PARTS(C8_ACC)
                        }
                    }
                }
                C8_PARTS(C8_SAVE0)
                if (two)
                    C8_PARTS(C8_SAVE1)
            }
            for (; n0 < N; n0++) {
                for (int k = 0; k <= two; k++) {
                    const float *qk = k ? q1 : q0;
                    float a = 0.0f;
                    for (int oy = 0; oy < OH; oy++)
                        for (int ox = 0; ox < OW; ox++)
                            a += qk[(size_t)oy * S * PW + (size_t)ox * S] * de[((size_t)oy * OW + ox) * N + n0];
                    (k ? g1 : g0)[n0] = a;
                }
                if (t == 0) {
                    float sb = db[n0];
                    for (int p = 0; p < OH * OW; p++)
                        sb += de[(size_t)p * N + n0];
                    db[n0] = sb;
                }
            }
        }
        if (e > 0)
            for (size_t j = 0; j < nw; j++)
                dW[j] += acc[j];
    }
}

static int avx2_ok(void)
{
    static int ok = -1;
    if (ok < 0)
        ok = __builtin_cpu_supports("avx2") ? 1 : 0;
    return ok;
}
#endif

/* dW = sum over chunks col^T @ dout, db = column sums of dout, din = col2im(dout @ W^T). */
static void conv_backward(float *din, float *dW, float *db, float *col, const float *dout,
                          const float *in, const float *W, int B, const model_layer *l)
{
    const int K = l->kh * l->kw * l->in.c, N = l->out.c, P = l->out.h * l->out.w;
    const int nb_max = conv_chunk(l, B);
    col_sums(db, dout, (size_t)B * P, N, 0);
    for (int e0 = 0; e0 < B; e0 += nb_max) {
        int nb = B - e0 < nb_max ? B - e0 : nb_max;
        const float *d = dout + (size_t)e0 * l->out_numel;
        im2col(col, in + (size_t)e0 * l->in_numel, nb, l);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, N, nb * P, 1.0f, col, K, d, N,
                    e0 == 0 ? 0.0f : 1.0f, dW, N);
        if (din) {
            memset(din + (size_t)e0 * l->in_numel, 0, (size_t)nb * l->in_numel * sizeof(float));
            /* beta 1 on a zeroed col: the same floats as beta 0 (0 + x), and
             * memset zeroes faster than OpenBLAS's beta pass (sgemm_beta) */
            memset(col, 0, (size_t)nb * P * K * sizeof(float));
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb * P, K, N, 1.0f, d, N, W, N, 1.0f,
                        col, K);
            col2im(din + (size_t)e0 * l->in_numel, col, nb, l);
        }
    }
}

/* Where p[c] > o[c] (strictly: the first maximum stays): o[c] = p[c], a[c] =
 * base + c. Branch-free, 4 channels at a time in vector registers (GCC's
 * vector extension: a comparison gives a mask of all ones where it holds;
 * GCC did not vectorize the scalar form, and its branch is unpredictable). */
typedef int32_t v4i __attribute__((vector_size(16)));

static void maxpool_merge(float *restrict o, int32_t *restrict a, const float *restrict p,
                          int32_t base, int C)
{
    int c = 0;
    for (; c + 4 <= C; c += 4) {
        v4i pv, ov, av;
        memcpy(&pv, p + c, sizeof(pv));
        memcpy(&ov, o + c, sizeof(ov));
        memcpy(&av, a + c, sizeof(av));
        v4f pf, of;
        memcpy(&pf, &pv, sizeof(pf));
        memcpy(&of, &ov, sizeof(of));
        const v4i gt = pf > of;
        const int32_t i0 = base + c;
        const v4i idx = {i0, i0 + 1, i0 + 2, i0 + 3};
        ov = (pv & gt) | (ov & ~gt);
        av = (idx & gt) | (av & ~gt);
        memcpy(o + c, &ov, sizeof(ov));
        memcpy(a + c, &av, sizeof(av));
    }
    for (; c < C; c++)
        if (p[c] > o[c]) {
            o[c] = p[c];
            a[c] = base + c;
        }
}

/* Do the windows of maxpool layer l tile its input (window = stride, no
 * padding, every input in exactly one window), with whole 4-float groups of
 * channels? Then the pooling takes maxpool_forward_tiled and
 * maxpool_backward_tiled. */
static int maxpool_tiles(const model_layer *l)
{
    const int S = l->stride;
    return l->kh == S && l->kw == S && l->pad_top == 0 && l->pad_left == 0 && l->out.h * S == l->in.h &&
           l->out.w * S == l->in.w && l->in.c % 4 == 0;
}

/* maxpool_forward (the same floats and argmax) where the windows tile the
 * input: no bounds to check, 4 channels at a time through a window's taps in
 * row-major order, the first one taken, a later one where it is strictly
 * greater. */
static void maxpool_forward_tiled(float *out, int32_t *argmax, const float *in, int B,
                                  const model_layer *l)
{
    const int W = l->in.w, C = l->in.c, OH = l->out.h, OW = l->out.w, S = l->stride;
    for (int e = 0; e < B; e++) {
        const float *ie = in + (size_t)e * l->in_numel;
        float *oe = out + (size_t)e * l->out_numel;
        int32_t *ae = argmax + (size_t)e * l->out_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                float *o = oe + ((size_t)oy * OW + ox) * C;
                int32_t *a = ae + ((size_t)oy * OW + ox) * C;
                const int32_t base0 = (int32_t)(((size_t)oy * S * W + (size_t)ox * S) * C);
                for (int c = 0; c < C; c += 4) {
                    v4i ov, av = {base0 + c, base0 + c + 1, base0 + c + 2, base0 + c + 3};
                    memcpy(&ov, ie + base0 + c, sizeof(ov));
                    for (int ky = 0; ky < S; ky++)
                        for (int kx = ky == 0 ? 1 : 0; kx < S; kx++) {
                            const int32_t b = base0 + (int32_t)(((size_t)ky * W + kx) * C) + c;
                            v4i pv;
                            v4f pf, of;
                            memcpy(&pv, ie + b, sizeof(pv));
                            memcpy(&pf, &pv, sizeof(pf));
                            memcpy(&of, &ov, sizeof(of));
                            const v4i gt = pf > of;
                            const v4i idx = {b, b + 1, b + 2, b + 3};
                            ov = (pv & gt) | (ov & ~gt);
                            av = (idx & gt) | (av & ~gt);
                        }
                    memcpy(o + c, &ov, sizeof(ov));
                    memcpy(a + c, &av, sizeof(av));
                }
            }
    }
}

#ifdef X86_AVX2
typedef int32_t v8i __attribute__((vector_size(32)));

/* maxpool_forward_tiled for 2x2 windows and C % 8 == 0 on AVX2: 8 channels at
 * a time, the four taps unrolled (the same floats and argmax). */
__attribute__((target("avx2"))) static void maxpool2_forward_avx2(float *out, int32_t *argmax,
                                                                   const float *in, int B,
                                                                   const model_layer *l)
{
    const int W = l->in.w, C = l->in.c, OH = l->out.h, OW = l->out.w;
    const int32_t dx = C, dy = W * C;
    for (int e = 0; e < B; e++) {
        const float *ie = in + (size_t)e * l->in_numel;
        float *oe = out + (size_t)e * l->out_numel;
        int32_t *ae = argmax + (size_t)e * l->out_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                const size_t k0 = ((size_t)oy * OW + ox) * C;
                const int32_t base0 = (int32_t)(((size_t)oy * 2 * W + (size_t)ox * 2) * C);
                for (int c = 0; c < C; c += 8) {
                    const int32_t b = base0 + c;
                    const v8i iota = {0, 1, 2, 3, 4, 5, 6, 7};
                    v8i ov, av = iota + b;
                    memcpy(&ov, ie + b, sizeof(ov));
#define P2_TAP(off)                                                                                \
    {                                                                                              \
        v8i pv;                                                                                    \
        v8f pf, of;                                                                                \
        memcpy(&pv, ie + b + (off), sizeof(pv));                                                   \
        memcpy(&pf, &pv, sizeof(pf));                                                              \
        memcpy(&of, &ov, sizeof(of));                                                              \
        const v8i gt = pf > of;                                                                    \
        ov = (pv & gt) | (ov & ~gt);                                                               \
        av = ((iota + (b + (off))) & gt) | (av & ~gt);                                             \
    }
                    P2_TAP(dx)
                    P2_TAP(dy)
                    P2_TAP(dy + dx)
#undef P2_TAP
                    memcpy(oe + k0 + c, &ov, sizeof(ov));
                    memcpy(ae + k0 + c, &av, sizeof(av));
                }
            }
    }
}

/* maxpool_backward_tiled for 2x2 windows and C % 8 == 0 on AVX2 (the same floats). */
__attribute__((target("avx2"))) static void maxpool2_backward_avx2(float *din, const float *dout,
                                                                    const int32_t *argmax,
                                                                    const float *out, int relu, int B,
                                                                    const model_layer *l)
{
    const int W = l->in.w, C = l->in.c, OH = l->out.h, OW = l->out.w;
    const int32_t dx = C, dy = W * C;
    const v8f zero = {0};
    for (int e = 0; e < B; e++) {
        float *de = din + (size_t)e * l->in_numel;
        const size_t e_out = (size_t)e * l->out_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                const size_t k0 = e_out + ((size_t)oy * OW + ox) * C;
                const int32_t base0 = (int32_t)(((size_t)oy * 2 * W + (size_t)ox * 2) * C);
                for (int c = 0; c < C; c += 8) {
                    const int32_t b = base0 + c;
                    const v8i iota = {0, 1, 2, 3, 4, 5, 6, 7};
                    v8f d, o;
                    v8i a, gi, keep = {-1, -1, -1, -1, -1, -1, -1, -1};
                    memcpy(&d, dout + k0 + c, sizeof(d));
                    memcpy(&a, argmax + k0 + c, sizeof(a));
                    if (relu) {
                        memcpy(&o, out + k0 + c, sizeof(o));
                        keep = o > zero;
                    }
                    const v8f g = zero + d;
                    memcpy(&gi, &g, sizeof(gi));
                    gi &= keep;
#define P2_BACK(off)                                                                               \
    {                                                                                              \
        const v8i v = gi & (a == iota + (b + (off)));                                              \
        memcpy(de + b + (off), &v, sizeof(v));                                                     \
    }
                    P2_BACK(0)
                    P2_BACK(dx)
                    P2_BACK(dy)
                    P2_BACK(dy + dx)
#undef P2_BACK
                }
            }
    }
}
#endif

/* Does maxpool layer l take the AVX2 2x2 code? */
static int maxpool2_avx2(const model_layer *l)
{
#ifdef X86_AVX2
    return l->stride == 2 && l->in.c % 8 == 0 && avx2_ok();
#else
    (void)l;
    return 0;
#endif
}

/* out[B, OH, OW, C] = the window maxima of in[B, H, W, C] (padding ignored);
 * argmax gets the input index (within the example) of the first maximum. */
static void maxpool_forward(float *out, int32_t *argmax, const float *in, int B, const model_layer *l)
{
    const int H = l->in.h, W = l->in.w, C = l->in.c, OH = l->out.h, OW = l->out.w, S = l->stride;
    if (maxpool_tiles(l)) {
#ifdef X86_AVX2
        if (maxpool2_avx2(l)) {
            maxpool2_forward_avx2(out, argmax, in, B, l);
            return;
        }
#endif
        maxpool_forward_tiled(out, argmax, in, B, l);
        return;
    }
    for (int e = 0; e < B; e++) {
        const float *ie = in + (size_t)e * l->in_numel;
        float *oe = out + (size_t)e * l->out_numel;
        int32_t *ae = argmax + (size_t)e * l->out_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                float *o = oe + ((size_t)oy * OW + ox) * C;
                int32_t *a = ae + ((size_t)oy * OW + ox) * C;
                int first = 1;
                for (int ky = 0; ky < l->kh; ky++) {
                    int iy = oy * S - l->pad_top + ky;
                    if (iy < 0 || iy >= H)
                        continue;
                    for (int kx = 0; kx < l->kw; kx++) {
                        int ix = ox * S - l->pad_left + kx;
                        if (ix < 0 || ix >= W)
                            continue;
                        int32_t base = (int32_t)(((size_t)iy * W + ix) * C);
                        const float *p = ie + base;
                        if (first) {
                            for (int c = 0; c < C; c++) {
                                o[c] = p[c];
                                a[c] = base + c;
                            }
                            first = 0;
                        } else {
                            maxpool_merge(o, a, p, base, C);
                        }
                    }
                }
            }
    }
}

/* maxpool_backward where the windows tile the input (maxpool_tiles): every
 * input element is written once, with 0 + the gradient of the output whose
 * argmax it is (the float memset-then-add gives: -0 becomes +0) or 0, so
 * nothing is zeroed first. relu != 0: only where the pooled output out is >
 * 0, which is the ReLU's output at the argmax (the pool copied it). */
static void maxpool_backward_tiled(float *din, const float *dout, const int32_t *argmax,
                                   const float *out, int relu, int B, const model_layer *l)
{
    const int W = l->in.w, C = l->in.c, OH = l->out.h, OW = l->out.w, S = l->stride;
    const v4f zero = {0};
    for (int e = 0; e < B; e++) {
        float *de = din + (size_t)e * l->in_numel;
        const size_t e_out = (size_t)e * l->out_numel;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                const size_t k0 = e_out + ((size_t)oy * OW + ox) * C;
                const int32_t base0 = (int32_t)(((size_t)oy * S * W + (size_t)ox * S) * C);
                for (int c = 0; c < C; c += 4) {
                    v4f d, o;
                    v4i a, keep = {-1, -1, -1, -1};
                    memcpy(&d, dout + k0 + c, sizeof(d));
                    memcpy(&a, argmax + k0 + c, sizeof(a));
                    if (relu) {
                        memcpy(&o, out + k0 + c, sizeof(o));
                        keep = o > zero;
                    }
                    v4f g = zero + d;
                    v4i gi;
                    memcpy(&gi, &g, sizeof(gi));
                    for (int ky = 0; ky < S; ky++)
                        for (int kx = 0; kx < S; kx++) {
                            const int32_t b = base0 + (int32_t)(((size_t)ky * W + kx) * C) + c;
                            const v4i idx = {b, b + 1, b + 2, b + 3};
                            const v4i v = gi & (keep & (a == idx));
                            memcpy(de + b, &v, sizeof(v));
                        }
                }
            }
    }
}

/* din = the gradient of each output at its argmax; relu_out (NULL: none): the
 * output of a ReLU right below, whose backward this does too (the same floats
 * as relu_backward on the result: a position's sum is kept whole or zeroed);
 * out: the pooled output (the tiled path's ReLU test). */
static void maxpool_backward(float *din, const float *dout, const int32_t *argmax, const float *out,
                             const float *relu_out, int B, const model_layer *l)
{
    if (maxpool_tiles(l)) {
#ifdef X86_AVX2
        if (maxpool2_avx2(l)) {
            maxpool2_backward_avx2(din, dout, argmax, out, relu_out != NULL, B, l);
            return;
        }
#endif
        maxpool_backward_tiled(din, dout, argmax, out, relu_out != NULL, B, l);
        return;
    }
    for (int e = 0; e < B; e++) {
        float *de = din + (size_t)e * l->in_numel;
        memset(de, 0, l->in_numel * sizeof(float)); /* an example at a time: it stays in the cache */
        const float *d = dout + (size_t)e * l->out_numel;
        const int32_t *a = argmax + (size_t)e * l->out_numel;
        if (relu_out) {
            const float *r = relu_out + (size_t)e * l->in_numel;
            for (size_t k = 0; k < l->out_numel; k++)
                if (r[a[k]] > 0.0f)
                    de[a[k]] += d[k];
        } else {
            for (size_t k = 0; k < l->out_numel; k++)
                de[a[k]] += d[k];
        }
    }
}

/* out = max(in, 0) */
static void relu_forward(float *restrict out, const float *restrict in, size_t n)
{
    size_t j = 0;
    for (; j + VEC <= n; j += VEC)
        for (int k = 0; k < VEC; k++) {
            float v = in[j + k];
            out[j + k] = v > 0.0f ? v : 0.0f;
        }
    for (; j < n; j++) {
        float v = in[j];
        out[j] = v > 0.0f ? v : 0.0f;
    }
}

/* din = dout where the output was > 0, else 0. Both loaded unconditionally
 * and kept out of line (noinline): inlined into backward() with dout's load
 * under the condition, gcc made it a scalar loop with a branch and its
 * pointers reloaded from the stack each element, ~7% of a dense stage's
 * time (perf, mlp:2048,...'s stage 1); so it is a compare and a blend. */
__attribute__((noinline)) static void relu_backward(float *restrict din, const float *restrict dout,
                                                    const float *restrict out, size_t n)
{
    size_t j = 0;
    for (; j + VEC <= n; j += VEC)
        for (int k = 0; k < VEC; k++) {
            const float d = dout[j + k], o = out[j + k];
            din[j + k] = o > 0.0f ? d : 0.0f;
        }
    for (; j < n; j++) {
        const float d = dout[j], o = out[j];
        din[j] = o > 0.0f ? d : 0.0f;
    }
}

/* out = keep ? in * scale : 0, keep from the contract's mask, saved. */
static void dropout_forward(float *out, uint8_t *keep, const float *in, int B, const model_ctx *ctx,
                            const model_layer *l)
{
    const size_t n = l->out_numel;
    const uint64_t seed = ctx ? ctx->seed : 0;
    const int64_t step = ctx ? ctx->step : 0;
    for (int i = 0; i < B; i++) {
        uint64_t rh = dropout_row_hash(seed, step, model_ctx_example(ctx, i));
        const float *x = in + (size_t)i * n;
        float *y = out + (size_t)i * n;
        uint8_t *k = keep + (size_t)i * n;
        for (size_t u = 0; u < n; u++) {
            k[u] = (uint8_t)dropout_keep(rh, (uint32_t)l->dropout_index, (uint64_t)u, l->rate);
            y[u] = k[u] ? x[u] * l->scale : 0.0f;
        }
    }
}

static void dropout_backward(float *din, const float *dout, const uint8_t *keep, size_t n, float scale)
{
    for (size_t j = 0; j < n; j++)
        din[j] = keep[j] ? dout[j] * scale : 0.0f;
}

/* ---- the instance ------------------------------------------------------- */

static void *block(model_cpu *c, size_t bytes)
{
    bytes = (bytes + 63) & ~(size_t)63;
    if (bytes == 0)
        bytes = 64;
    void *p = aligned_alloc(64, bytes);
    if (!p)
        return NULL;
    memset(p, 0, bytes); /* touch every page now, not in the first step */
    c->blocks[c->n_blocks++] = p;
    return p;
}

static void cpu_destroy(model *m)
{
    model_cpu *c = (model_cpu *)m;
    for (int i = 0; i < c->n_blocks; i++)
        free(c->blocks[i]);
    free(c);
}

static model *cpu_create(const model_layout *layout, int max_batch, char *err, size_t errlen)
{
    model_cpu *c = calloc(1, sizeof(*c));
    if (!c) {
        errmsg(err, errlen, "model: out of memory");
        return NULL;
    }
    c->base.backend = &model_backend_cpu;
    c->base.layout = *layout;
    c->base.max_batch = max_batch;
    c->fwd_first = -1;
    const size_t B = (size_t)max_batch;
    size_t total = 0;
    int ok = 1;
    for (int li = 0; li < layout->n_layers && ok; li++) {
        const model_layer *l = &layout->layers[li];
        if (l->kind != LAYER_FLATTEN) {
            c->act[li] = c->own[li] = block(c, B * l->out_numel * sizeof(float));
            ok = ok && c->act[li];
            total += B * l->out_numel * sizeof(float);
        }
        if (l->kind == LAYER_DROPOUT) {
            c->keep[li] = block(c, B * l->out_numel);
            ok = ok && c->keep[li];
        }
        if (l->kind == LAYER_MAXPOOL) {
            c->argmax[li] = block(c, B * l->out_numel * sizeof(int32_t));
            ok = ok && c->argmax[li];
        }
        if (l->kind == LAYER_CONV2D) {
            size_t f = (size_t)conv_chunk(l, max_batch) * l->out.h * l->out.w * l->kh * l->kw * l->in.c;
            if (l->in.c == 1) { /* conv1_backward's per-example dW, then the padded example */
                int PH = 0, PW = 0;
#ifdef X86_AVX2
                conv1_pad_dims(l, &PH, &PW);
#endif
                f = conv1_pad_offset(l) + (size_t)PH * PW;
            }
            if (f > c->col_floats)
                c->col_floats = f;
            const size_t g = (size_t)l->kh * l->kw * l->in.c * l->out.c + (size_t)l->out.c;
            if (g > c->conv_grad_floats)
                c->conv_grad_floats = g;
        }
    }
    if (ok && c->col_floats) {
        c->col = block(c, c->col_floats * sizeof(float));
        c->conv_grad = block(c, c->conv_grad_floats * sizeof(float));
        ok = c->col && c->conv_grad;
    }
    for (int k = 0; k < 2 && ok; k++) {
        c->d[k] = block(c, B * layout->max_act * sizeof(float));
        ok = c->d[k] != NULL;
    }
    if (!ok) {
        errmsg(err, errlen, "model: out of memory for the workspace (batch %d, %zu bytes of activations)",
               max_batch, total);
        cpu_destroy(&c->base);
        return NULL;
    }
    return &c->base;
}

/* Layers first..last on in; returns the last layer's output (internal), or
 * NULL when hooks' wait_params stopped it (model_ctx's overlap hooks; hooks
 * NULL: none). */
static const float *forward(model_cpu *c, int first, int last, const float *params, const float *in,
                            int B, const model_ctx *ctx, const model_ctx *hooks)
{
    const model_layout *ly = &c->base.layout;
    const float *x = in;
    int relu_done = 0; /* layer li is a ReLU its conv computed */
    int pool_done = 0; /* layer li is a maxpool the conv two below computed */
    for (int li = first; li <= last; li++) {
        const model_layer *l = &ly->layers[li];
        c->in[li] = x;
        if (relu_done) { /* the conv below wrote this ReLU's output in its own place */
            relu_done = 0;
            c->act[li] = (float *)x;
            continue;
        }
        if (pool_done) {
            pool_done = 0;
            x = c->act[li] = c->own[li];
            continue;
        }
        if (hooks && l->w >= 0 && hooks->wait_params && hooks->wait_params(hooks->hook_arg, li) != 0)
            return NULL; /* its parameters did not come */
        if (l->kind != LAYER_FLATTEN)
            c->act[li] = c->own[li]; /* a ReLU fused in an earlier forward pointed elsewhere */
        float *y = c->act[li];
        switch (l->kind) {
        case LAYER_DENSE:
            dense_forward(y, x, params + ly->tensors[l->w].offset, params + ly->tensors[l->b].offset, B,
                          (int)l->in_numel, (int)l->out_numel);
            break;
        case LAYER_CONV2D: {
            /* the ReLU that follows, in the same pass: y gets its output (the
             * convolution's own is not kept: nothing reads it) */
            const int r = li < last && ly->layers[li + 1].kind == LAYER_RELU;
            relu_done = r;
            /* and a maxpool after the ReLU: chunk by chunk of examples, each
             * chunk pooled while the conv's output of it is in the cache (the
             * same floats: every example is computed on its own) */
            const model_layer *pl = r && li + 2 <= last && ly->layers[li + 2].kind == LAYER_MAXPOOL
                                        ? &ly->layers[li + 2] : NULL;
            pool_done = pl != NULL;
            const int chunk = !pl ? B : l->in.c == 1 ? 2 : conv_chunk(l, B);
            const float *W = params + ly->tensors[l->w].offset, *b = params + ly->tensors[l->b].offset;
            for (int e0 = 0; e0 < B; e0 += chunk) {
                const int nb = B - e0 < chunk ? B - e0 : chunk;
                float *ye = y + (size_t)e0 * l->out_numel;
                const float *xe = x + (size_t)e0 * l->in_numel;
#ifdef X86_AVX2
                if (l->in.c == 1 && avx2_ok())
                    conv1_forward_avx2(ye, r, c->col + conv1_pad_offset(l), xe, W, b, nb, l);
                else
#endif
                if (l->in.c == 1)
                    conv1_forward(ye, r, xe, W, b, nb, l);
                else
                    conv_forward(ye, r, c->col, xe, W, b, nb, l);
                if (pl)
                    maxpool_forward(c->own[li + 2] + (size_t)e0 * pl->out_numel,
                                    c->argmax[li + 2] + (size_t)e0 * pl->out_numel, ye, nb, pl);
            }
            break;
        }
        case LAYER_MAXPOOL:
            maxpool_forward(y, c->argmax[li], x, B, l);
            break;
        case LAYER_RELU:
            relu_forward(y, x, (size_t)B * l->out_numel);
            break;
        case LAYER_DROPOUT:
            c->dropout_on[li] = !(ctx && ctx->inference);
            if (c->dropout_on[li])
                dropout_forward(y, c->keep[li], x, B, ctx, l);
            else
                memcpy(y, x, (size_t)B * l->out_numel * sizeof(float));
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
    return x;
}

/* Does any layer in [first, upto) have parameters (so the gradient must reach it)? */
static int params_below(const model_layout *ly, int first, int upto)
{
    for (int k = first; k < upto; k++)
        if (ly->layers[k].w >= 0)
            return 1;
    return 0;
}

/* add 0: grads gets the range's parameter gradients; 1: they are added to
 * its floats (a dense layer's sgemm adds them itself; a convolution's go
 * through a buffer of the layer's size, then are added). hooks (may be
 * NULL): its grads_done after each layer's parameter gradients. */
static int backward(model_cpu *c, int first, int last, const float *params, const float *dout, int B,
                    float *din, float *grads, int add, const model_ctx *hooks)
{
    const model_layout *ly = &c->base.layout;
    if (c->fwd_first != first || c->fwd_last != last || c->fwd_batch != B)
        return -1;
    const float *g = dout;
    int relu_skip = 0; /* layer li is a ReLU whose backward the maxpool above did */
    for (int li = last; li >= first; li--) {
        const model_layer *l = &ly->layers[li];
        if (relu_skip) {
            relu_skip = 0;
            continue; /* g already is this layer's input gradient */
        }
        const int want = din != NULL || params_below(ly, first, li);
        if (!want && l->w < 0)
            break; /* nothing below needs a gradient, and this layer has no parameters */
        float *dx = NULL;
        if (want)
            dx = li == first ? din : (g == c->d[0] ? c->d[1] : c->d[0]);
        const size_t n_in = (size_t)B * l->in_numel;
        switch (l->kind) {
        case LAYER_DENSE:
            dense_backward(dx, grads + ly->tensors[l->w].offset, grads + ly->tensors[l->b].offset, g,
                           c->in[li], params + ly->tensors[l->w].offset, B, (int)l->in_numel,
                           (int)l->out_numel, add);
            break;
        case LAYER_CONV2D: {
            const size_t wn = ly->tensors[l->w].numel, bn = ly->tensors[l->b].numel;
            float *tmp = c->conv_grad; /* add: wn + bn <= conv_grad_floats */
            float *dW = add ? tmp : grads + ly->tensors[l->w].offset;
            float *db = add ? tmp + wn : grads + ly->tensors[l->b].offset;
#ifdef X86_AVX2
            if (l->in.c == 1 && !dx && avx2_ok()) {
                conv1_dW_avx2(dW, db, c->col, c->col + conv1_pad_offset(l), g, c->in[li], B, l);
            } else
#endif
            if (l->in.c == 1)
                conv1_backward(dx, dW, db, c->col, g, c->in[li], params + ly->tensors[l->w].offset, B, l);
            else
                conv_backward(dx, dW, db, c->col, g, c->in[li], params + ly->tensors[l->w].offset, B, l);
            if (add) {
                float *gw = grads + ly->tensors[l->w].offset, *gb = grads + ly->tensors[l->b].offset;
                for (size_t k = 0; k < wn; k++)
                    gw[k] += tmp[k];
                for (size_t k = 0; k < bn; k++)
                    gb[k] += tmp[wn + k];
            }
            break;
        }
        case LAYER_MAXPOOL:
            if (li - 1 > first && ly->layers[li - 1].kind == LAYER_RELU && dx) {
                /* the ReLU below in the same pass: its gradient lands in dx too */
                maxpool_backward(dx, g, c->argmax[li], c->act[li], c->act[li - 1], B, l);
                relu_skip = 1;
            } else {
                maxpool_backward(dx, g, c->argmax[li], c->act[li], NULL, B, l);
            }
            break;
        case LAYER_RELU:
            relu_backward(dx, g, c->act[li], n_in);
            break;
        case LAYER_DROPOUT:
            if (c->dropout_on[li])
                dropout_backward(dx, g, c->keep[li], n_in, l->scale);
            else
                memcpy(dx, g, n_in * sizeof(float));
            break;
        case LAYER_FLATTEN:
            if (li == first)
                memcpy(dx, g, n_in * sizeof(float));
            else
                dx = (float *)g; /* the same floats */
            break;
        }
        if (hooks && hooks->grads_done && l->w >= 0)
            hooks->grads_done(hooks->hook_arg, li);
        g = dx;
    }
    return 0;
}

/* Mean softmax cross-entropy (max subtracted), and (softmax - onehot) / B into d. */
static int loss_and_grad(const float *logits, const uint8_t *labels, int B, int C, float *d,
                         double *loss)
{
    for (int i = 0; i < B; i++)
        if (labels[i] >= C)
            return -1;
    const float invB = 1.0f / (float)B;
    double total = 0.0;
    for (int i = 0; i < B; i++) {
        const float *zi = logits + (size_t)i * C;
        float mx = zi[0];
        for (int j = 1; j < C; j++)
            mx = zi[j] > mx ? zi[j] : mx;
        float s = 0.0f;
        if (d) {
            float *di = d + (size_t)i * C;
            for (int j = 0; j < C; j++) {
                float e = expf(zi[j] - mx);
                di[j] = e;
                s += e;
            }
            const float k = invB / s;
            for (int j = 0; j < C; j++)
                di[j] *= k;
            di[labels[i]] -= invB;
        } else {
            for (int j = 0; j < C; j++)
                s += expf(zi[j] - mx);
        }
        total += (double)logf(s) - (double)(zi[labels[i]] - mx);
    }
    *loss = total / B;
    return 0;
}

/* ---- the table ---------------------------------------------------------- */

static int cpu_forward_range(model *m, int first, int last, const float *params, const float *in,
                             int B, const model_ctx *ctx, float *out)
{
    model_cpu *c = (model_cpu *)m;
    const float *y = forward(c, first, last, params, in, B, ctx, NULL);
    if (y != out)
        memmove(out, y, (size_t)B * m->layout.layers[last].out_numel * sizeof(float));
    return 0;
}

static int cpu_backward_range(model *m, int first, int last, const float *params, const float *dout,
                              int B, float *din, float *grads)
{
    return backward((model_cpu *)m, first, last, params, dout, B, din, grads, 0, NULL);
}

static int cpu_backward_range_add(model *m, int first, int last, const float *params, const float *dout,
                                  int B, float *din, float *grads)
{
    return backward((model_cpu *)m, first, last, params, dout, B, din, grads, 1, NULL);
}

static int cpu_loss_head(model *m, const float *logits, const uint8_t *labels, int B, float *dlogits,
                         double *loss)
{
    return loss_and_grad(logits, labels, B, m->layout.n_classes, dlogits, loss);
}

static int cpu_forward_backward(model *m, const float *params, const float *x,
                                const uint8_t *labels, int B, const model_ctx *ctx, float *grads,
                                double *loss)
{
    model_cpu *c = (model_cpu *)m;
    const int L = m->layout.n_layers;
    const model_ctx *hooks = ctx && (ctx->wait_params || ctx->loss_done || ctx->grads_done) ? ctx : NULL;
    const float *logits = forward(c, 0, L - 1, params, x, B, ctx, hooks);
    if (!logits || loss_and_grad(logits, labels, B, m->layout.n_classes, c->d[0], loss) != 0)
        return -1;
    if (hooks && hooks->loss_done && hooks->loss_done(hooks->hook_arg, *loss) != 0)
        return -1;
    return backward(c, 0, L - 1, params, c->d[0], B, NULL, grads, 0, hooks);
}

static int cpu_evaluate(model *m, const float *params, const float *x, const uint8_t *labels,
                        int64_t n, double *loss, double *accuracy)
{
    model_cpu *c = (model_cpu *)m;
    const model_layout *ly = &m->layout;
    const int L = ly->n_layers, C = ly->n_classes;
    for (int64_t i = 0; i < n; i++)
        if (labels[i] >= C)
            return -1;
    const model_ctx inference = {.inference = 1};
    double total = 0.0;
    int64_t correct = 0;
    for (int64_t start = 0; start < n; start += m->max_batch) {
        int B = (int)(n - start < m->max_batch ? n - start : m->max_batch);
        const float *logits = forward(c, 0, L - 1, params, x + (size_t)start * ly->n_in, B, &inference, NULL);
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
    c->fwd_first = -1; /* no backward pairs with an evaluation */
    *loss = total / (double)n;
    *accuracy = (double)correct / (double)n;
    return 0;
}

const model_backend model_backend_cpu = {
    .name = "cpu",
    .layer_hooks = 1,
    .create = cpu_create,
    .destroy = cpu_destroy,
    .forward_backward = cpu_forward_backward,
    .evaluate = cpu_evaluate,
    /* no host_alloc (calloc does), no stage_batch: the CPU computes on the
     * caller's x itself, there is nothing to move ahead */
    .forward_range = cpu_forward_range,
    .backward_range = cpu_backward_range,
    .backward_range_add = cpu_backward_range_add,
    .loss_head = cpu_loss_head,
    .bag_forward = model_cpu_bag_forward,
    .bag_backward = model_cpu_bag_backward,
};
