/* mlp.h - the worker's model: a multi-layer perceptron (ReLU hidden layers, a
 * softmax output, cross-entropy averaged over the batch), as in TensorFlow's
 * distributed MNIST example, with any number of hidden layers.
 *
 * Two parts:
 *  - the layout (mlp.c): which tensors the model has, their names, shapes and
 *    offsets in ONE contiguous float buffer; gradients use a second buffer with
 *    the same layout. Pull and push are one copy of that buffer. Plus the
 *    example's initialization.
 *  - the compute backends: a table of functions that each backend implements
 *    function for function (mlp_cpu.c: OpenBLAS; mlp_cuda.cu: cuBLAS).
 *    The CPU backend is the reference the others are tested against; both can
 *    be linked into one program and chosen at run time.
 *
 * Tensors, layer l = 0 .. n_layers-1 (dims[0] = n_in, dims[n_layers] = n_out):
 *   W_l [dims[l], dims[l+1]] row-major (x @ W, TensorFlow's convention), b_l [dims[l+1]].
 * Names: one hidden layer: hid_w, hid_b, sm_w, sm_b (the example's);
 *        more: hid0_w, hid0_b, hid1_w, hid1_b, ..., sm_w, sm_b;
 *        none (softmax regression): sm_w, sm_b.
 * Buffer order: W_0, b_0, W_1, b_1, ..., packed with no padding.
 *
 * Forward:  a_0 = x [B, n_in]; a_{l+1} = relu(a_l @ W_l + b_l) for hidden layers;
 *           logits = a_L-1 @ W_L-1 + b_L-1; loss = mean_i -log softmax(logits_i)[label_i]. */
#ifndef RESTPS_MLP_H
#define RESTPS_MLP_H

#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

#define MLP_MAX_HIDDEN 8
#define MLP_MAX_LAYERS (MLP_MAX_HIDDEN + 1)
#define MLP_MAX_TENSORS (2 * MLP_MAX_LAYERS)
#define MLP_MAX_DIM (1 << 20)          /* units per layer */
#define MLP_MAX_PARAMS ((size_t)1 << 31) /* floats in the parameter buffer */
#define MLP_NAME_MAX 32

typedef struct mlp_tensor {
    char name[MLP_NAME_MAX]; /* "hid_w", "hid0_b", "sm_w", ... */
    tensor_shape shape;      /* [fan_in, fan_out] for a weight, [fan_out] for a bias */
    size_t offset;           /* in floats, from the start of the buffer */
    size_t numel;
} mlp_tensor;

typedef struct mlp_layout {
    int n_layers;                    /* linear layers: hidden layers + 1 */
    int dims[MLP_MAX_LAYERS + 1];    /* dims[0] = n_in, ..., dims[n_layers] = n_out */
    int n_tensors;                   /* 2 * n_layers: tensors[2l] = W_l, tensors[2l+1] = b_l */
    mlp_tensor tensors[MLP_MAX_TENSORS];
    size_t n_params;                 /* floats in the whole buffer */
} mlp_layout;

/* Describe an n_in - hidden[0] - ... - hidden[n_hidden-1] - n_out model.
 * 0, or -1 with err (a size <= 0 or > MLP_MAX_DIM, n_out < 2, n_hidden outside
 * [0, MLP_MAX_HIDDEN], more than MLP_MAX_PARAMS parameters). */
int mlp_layout_init(mlp_layout *layout, int n_in, const int *hidden, int n_hidden, int n_out,
                    char *err, size_t errlen);

/* Parse a hidden-layer list "100" or "256,128" ("" = none) into hidden[]
 * (MLP_MAX_HIDDEN entries). 0 or -1 with err. */
int mlp_parse_hidden(const char *s, int *hidden, int *n_hidden, char *err, size_t errlen);

/* Index of the tensor called name, or -1. */
int mlp_layout_find(const mlp_layout *layout, const char *name);

/* The example's initialization, deterministic from seed: every weight from a
 * normal with stddev 1/sqrt(fan_in) truncated at 2 stddev (redrawn beyond, like
 * tf.truncated_normal), biases 0. Each tensor has its own stream,
 * rng_stream(seed, tensor index) (rng.h), filled in row-major order. */
void mlp_init_params(const mlp_layout *layout, float *params, uint64_t seed);

/* A model instance on some backend: the layout plus that backend's workspace,
 * allocated once by new() for batches up to max_batch. Backends embed this as
 * the first member of their own struct. */
typedef struct mlp_backend mlp_backend;
typedef struct mlp {
    const mlp_backend *backend;
    mlp_layout layout;
    int max_batch;
} mlp;

/* The functions every backend implements. All pointers passed in are host
 * memory (a device backend copies what it needs, fastest from and to memory
 * its host_alloc handed out: mlp_host_alloc); params and grads are buffers
 * of layout.n_params floats; x is [batch, n_in] row-major; labels are in
 * [0, n_out); grads must not overlap params or x. Return 0, or a negative
 * value on bad arguments (batch outside [1, max_batch], a label >= n_out) or a
 * backend failure. */
struct mlp_backend {
    const char *name; /* "cpu", "cuda" */
    mlp *(*create)(const mlp_layout *layout, int max_batch, char *err, size_t errlen);
    void (*destroy)(mlp *m);
    /* Mean softmax cross-entropy over the batch into *loss, and its gradient
     * with respect to every parameter into grads (overwritten, not added to). */
    int (*forward_backward)(mlp *m, const float *params, const float *x, const uint8_t *labels,
                            int batch, float *grads, double *loss);
    /* Mean loss and the fraction of argmax(logits) == label (the first maximum
     * wins a tie) over n >= 1 examples, in batches of max_batch. */
    int (*evaluate)(mlp *m, const float *params, const float *x, const uint8_t *labels,
                    int64_t n, double *loss, double *accuracy);
    /* Optional (NULL: calloc and free): host memory for the buffers passed to
     * the functions above, zeroed, that this instance moves fastest (the
     * CUDA backend: page-locked, so the copies skip its staging buffers);
     * NULL when out of memory. host_free takes what host_alloc gave (or NULL). */
    void *(*host_alloc)(mlp *m, size_t bytes);
    void (*host_free)(mlp *m, void *p);
    /* Optional (NULL: nothing to stage, as on the CPU): start moving the batch
     * the next forward_backward will get (x, labels, batch) to the device,
     * and return at once; see mlp_stage_batch. Arguments already checked by
     * the front door. */
    int (*stage_batch)(mlp *m, const float *x, const uint8_t *labels, int batch);
};

/* The OpenBLAS backend (mlp_cpu.c). */
extern const mlp_backend mlp_backend_cpu;

/* The cuBLAS backend (mlp_cuda.cu). Exists only in a build with CUDA (the
 * Makefile builds it when nvcc is found; make CUDA=0 leaves it out): use
 * mlp_cuda_backend() where the build may lack it. */
extern const mlp_backend mlp_backend_cuda;

/* CUDA helpers (mlp_cuda.cu; mlp_cuda_stub.c in a build without CUDA), safe
 * on a machine with no NVIDIA driver or no device:
 *  mlp_cuda_built: 1 when this build has the CUDA backend, else 0.
 *  mlp_cuda_backend: &mlp_backend_cuda, or NULL in a build without CUDA.
 *  mlp_cuda_device_count: the devices this process sees (CUDA_VISIBLE_DEVICES
 *    applies); 0 with the reason in err when there is none, no driver or no
 *    backend.
 *  mlp_cuda_use: make device gpu this process's device for the models created
 *    after it, TF32 sgemm on or off (off: full FP32, matches the CPU); desc
 *    gets "GPU 0 of 1: <name>, sm_90, ..."; 0, or -1 with err. */
int mlp_cuda_built(void);
const mlp_backend *mlp_cuda_backend(void);
int mlp_cuda_device_count(char *err, size_t errlen);
int mlp_cuda_use(int gpu, int tf32, char *desc, size_t desclen, char *err, size_t errlen);

/* Which backend this process computes with (mlp_device.c), from workerd's
 * --device, --gpu and --tf32: "auto" takes CUDA when the build has it and
 * device gpu is visible and usable (cuBLAS loads), else the CPU; "cuda"
 * without all that is an error; "cpu" is the CPU. On success, line gets one
 * sentence saying which and why (workerd prints it first). 0, or -1 with err. */
int mlp_device_choose(const char *device, int gpu, int tf32, char *line, size_t linelen,
                      char *err, size_t errlen);
/* The chosen backend (the CPU one until mlp_device_choose picks another). */
const mlp_backend *mlp_device_backend(void);
/* For start-up lines: "cpu backend (OpenBLAS Haswell, 1 thread; kernel: ...)"
 * (blas_kernel_reason: which kernel and why) or
 * "cuda backend (GPU 0 of 1: NVIDIA H200, sm_90, ...)"; a static buffer. */
const char *mlp_device_describe(int threads);

/* Front door (mlp.c): dispatch to the instance's backend. */
mlp *mlp_new(const mlp_backend *backend, const mlp_layout *layout, int max_batch, char *err,
             size_t errlen);
void mlp_free(mlp *m);
int mlp_forward_backward(mlp *m, const float *params, const float *x, const uint8_t *labels,
                         int batch, float *grads, double *loss);
int mlp_evaluate(mlp *m, const float *params, const float *x, const uint8_t *labels, int64_t n,
                 double *loss, double *accuracy);
/* Host memory for params, grads, x and labels: bytes zeroed, or NULL when out
 * of memory. From the backend's host_alloc (the CUDA backend: pinned memory,
 * which its copies to and from the device use directly, with no memcpy
 * through its staging buffers; when pinned memory runs out, ordinary memory
 * and one warning line on stderr), else, and when m is NULL, calloc. Any host
 * memory works with every backend; this is only faster. Free with
 * mlp_host_free on the same m (NULL with NULL), BEFORE mlp_free(m): the
 * pinned memory belongs to the instance's device. Not for several threads at
 * once on one instance, like the functions above. */
void *mlp_host_alloc(mlp *m, size_t bytes);
void mlp_host_free(mlp *m, void *p);

/* Prefetch: start copying the batch (x [batch, n_in], labels [batch]) that
 * the caller will pass to its next mlp_forward_backward, and return at once,
 * so that the copy overlaps what the caller does in between (the optimizer's
 * update, the network pull and push). An optimization only: the results are
 * identical, bit for bit, with or without it. The contract:
 *  - the next mlp_forward_backward called with the same x, labels and batch
 *    (the same pointers, not merely equal contents) uses the staged copy;
 *    called with anything else it copies its own x and labels as always.
 *    Either way that call ends the staging; so do mlp_evaluate, a later
 *    mlp_stage_batch (which replaces it) and mlp_free. Nothing carries over
 *    to a second call: stage again for every batch.
 *  - from this call until the call that ends the staging returns, the
 *    caller must neither modify nor free x and labels (the copy may still be
 *    reading them; mlp_host_free of a staged buffer waits for it first).
 *  - from memory mlp_host_alloc handed out (pinned: direct DMA) the copy is
 *    asynchronous; from other memory it may be made before this returns
 *    (through the backend's staging buffers), which costs the caller that
 *    time and gains nothing.
 *  - on a backend without a device (the CPU) it does nothing and returns 0.
 * 0, or -1 on bad arguments (no m, x or labels; batch outside
 * [1, max_batch]) or a backend failure (the backend said why on stderr);
 * after a -1 nothing is staged and mlp_forward_backward still copies as
 * usual, so a caller may ignore the result. Labels are checked by the
 * forward_backward that uses them, not here. */
int mlp_stage_batch(mlp *m, const float *x, const uint8_t *labels, int batch);

/* CPU backend only: OpenBLAS threads for this process (process-wide; 1 is the
 * safe default beside other busy processes, see PERF-NOTES). */
void mlp_cpu_set_threads(int n);

/* CPU backend only: the kernel set OpenBLAS uses ("SkylakeX", "Haswell", ...),
 * for the worker's start-up log. OpenBLAS 0.3.21 takes a CPU it does not know
 * for "Prescott" (SSE3, several times slower); blas_kernel_choose
 * (blas_kernel.h) chooses from the CPU's features instead, and an
 * OPENBLAS_CORETYPE the user set wins. */
const char *mlp_cpu_blas_core(void);

#endif
