/* model.h - the worker's model: a sequence of layers (dense, conv2d, maxpool,
 * relu, dropout, flatten) ending in logits, trained with the mean softmax
 * cross-entropy over the batch. Replaces mlp.h (the MLP is the spec "mlp:H,...").
 *
 * Three parts:
 *  - the layout (model.c, model_spec.c): the spec parsed into layers, each
 *    with its per-example input and output shapes, and the model's tensors,
 *    their names, shapes and offsets in ONE contiguous float buffer; gradients
 *    use a second buffer with the same layout. Pull and push are one copy of
 *    that buffer. Plus the initialization.
 *  - the compute backends: a table of functions that each backend implements
 *    function for function (model_cpu.c: OpenBLAS; model_cuda.cu: cuBLAS).
 *    The CPU backend is the reference the others are tested against; both can
 *    be linked into one program and chosen at run time (model_device.c).
 *  - the front door (model.c): checks the arguments, dispatches to the backend.
 *
 * The spec (--model=SPEC; the README and the model contract say it in full):
 *   mlp:H1,H2,...   dense H1 + relu, dense H2 + relu, ..., dense n_classes.
 *                   mlp:100 is the default (784-100-10: hid_w hid_b sm_w sm_b),
 *                   "mlp:" softmax regression (sm_w sm_b), more than one hidden
 *                   layer hid0_w hid0_b hid1_w ...
 *   cnn             conv:5x5x32,pool:2,conv:5x5x64,pool:2,dense:1024,dropout:0.4,dense:10
 *   a layer list    conv:KHxKWxC[/S][:same|:valid]  (+ relu; stride 1, same)
 *                   pool:K[/S][:same|:valid]        (K x K max pooling; S = K, same)
 *                   dense:N                          (+ relu unless it is the last item,
 *                                                     which must be dense:n_classes)
 *                   dropout:R                        (0 <= R < 1, training only)
 *                   A flatten is implicit before a dense whose input is not flat
 *                   (after a conv or pool, and on the [28, 28, 1] images).
 *   Padding is TensorFlow's: same: out = ceil(in / S), pad_total =
 *   max((out - 1) * S + K - in, 0), pad_before = floor(pad_total / 2), the rest
 *   after; valid: out = ceil((in - K + 1) / S). Max pooling ignores padded
 *   positions and sends each gradient to the FIRST maximum of its window in
 *   row-major window order.
 *
 * Layouts (row-major float32): activations NHWC [B, H, W, C]; conv kernel HWIO
 * [KH, KW, C_in, C_out]; conv bias [C_out]; dense kernel [fan_in, fan_out]
 * (x @ W); dense bias [fan_out]. Flatten of NHWC is the row-major order of
 * [H, W, C]. Names: conv0_w conv0_b conv1_w ..., fc0_w fc0_b ... for the dense
 * layers of a list, sm_w sm_b for the logits layer; buffer order = layer order,
 * each layer W then b, packed with no padding.
 *
 * Dropout (dropout_mask.h): the mask of example e at step t with seed s is a
 * hash of (s, t, e, the dropout's ordinal, the unit), the same on every
 * backend and in numpy, so that 2 workers x B/2 compute what 1 worker x B does. */
#ifndef RESTPS_MODEL_H
#define RESTPS_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "model/blas_kernel.h"
#include "tensor.h"

#define MODEL_MAX_ITEMS 16                 /* items in a spec's layer list (or mlp hidden layers + 1) */
#define MODEL_MAX_LAYERS 48                /* layers after expansion (relu, flatten added) */
#define MODEL_MAX_TENSORS 32               /* 2 per dense or conv layer */
#define MODEL_MAX_DIM (1 << 20)            /* units, channels, kernel sides, spatial sides */
#define MODEL_MAX_ACT ((size_t)1 << 24)    /* floats in one example's activation of one layer */
#define MODEL_MAX_PARAMS ((size_t)1 << 31) /* floats in the parameter buffer */
#define MODEL_NAME_MAX 32
#define MODEL_SPEC_MAX 512                 /* bytes of a spec, canonical or given, with the NUL */
#define MODEL_DEFAULT_SPEC "mlp:100"

typedef enum layer_kind {
    LAYER_DENSE = 0,   /* y = x @ W + b, x flat [B, K], W [K, N] */
    LAYER_CONV2D = 1,  /* y = conv(x, W) + b, NHWC, HWIO, stride, padding */
    LAYER_MAXPOOL = 2, /* K x K window, stride, padding; saves the argmax */
    LAYER_RELU = 3,
    LAYER_DROPOUT = 4, /* inverted dropout, training only */
    LAYER_FLATTEN = 5, /* [B, H, W, C] -> [B, H*W*C]: the same floats */
} layer_kind;

/* One example's activation: [h, w, c] (a flat vector is [1, 1, n]). */
typedef struct model_shape {
    int h, w, c;
} model_shape;

typedef struct model_layer {
    layer_kind kind;
    model_shape in, out;     /* per example */
    size_t in_numel, out_numel; /* h * w * c of each */
    /* conv2d, maxpool: */
    int kh, kw;              /* window (kernel) size */
    int stride;              /* the same along H and W */
    int same;                /* 1: TF 'same' padding, 0: 'valid' */
    int pad_top, pad_left;   /* padding before (after: the rest, see pad_total) */
    int pad_bottom, pad_right;
    /* dropout: */
    float rate;              /* drop rate R, 0 <= R < 1 */
    float scale;             /* 1.0f / (1.0f - R), computed once in float32 */
    int dropout_index;       /* ordinal among the model's dropout layers (the mask's li) */
    /* dense, conv2d: tensor indices of the kernel and the bias; -1 elsewhere */
    int w, b;
} model_layer;

typedef struct model_tensor {
    char name[MODEL_NAME_MAX]; /* "hid_w", "conv0_b", "fc1_w", "sm_w", ... */
    tensor_shape shape;        /* dense [K, N], conv [KH, KW, C_in, C_out], bias [N] */
    size_t offset;             /* in floats, from the start of the buffer */
    size_t numel;
    int layer;                 /* the layer it belongs to */
    int fan_in;                /* the initializer's: K for dense, KH*KW*C_in for conv; 0 for a bias */
} model_tensor;

typedef struct model_layout {
    char spec[MODEL_SPEC_MAX]; /* canonical: what model_layout_init gets back to this layout */
    model_shape input;         /* per example, e.g. 28, 28, 1 */
    int n_classes;
    int n_layers;
    model_layer layers[MODEL_MAX_LAYERS];
    int n_tensors;
    model_tensor tensors[MODEL_MAX_TENSORS];
    size_t n_params;           /* floats in the whole buffer */
    size_t n_in;               /* input floats per example: h * w * c */
    size_t max_act;            /* the largest in_numel or out_numel of any layer */
    int n_dropout;             /* dropout layers */
    /* A range layout (model_layout_range) is layers range_first.. of a whole
     * model; these say where it sits in the whole one (all 0 for a whole model):
     * its layer 0 is the whole model's layer range_first, its tensor 0 the
     * whole one's tensor range_tensor0, its offset 0 the whole buffer's
     * range_offset. */
    int range_first;
    int range_tensor0;
    size_t range_offset;
} model_layout;

/* Parse spec (above) for examples of shape input and n_classes classes into
 * layout. 0, or -1 with one line in err naming the bad part (an unknown item,
 * a zero, negative or too large size, a non-dense last item, a last dense with
 * != n_classes units, more than MODEL_MAX_ITEMS items, a window larger than its
 * padded input, too many parameters, ...). (model_spec.c) */
int model_layout_init(model_layout *layout, const char *spec, model_shape input, int n_classes,
                      char *err, size_t errlen);

/* TensorFlow's padding along one axis for input size in, window k, stride s:
 * the output size, and the padding before and after (both 0 for valid).
 * 0, or -1 when the output would be empty (valid with k > in). (model_spec.c) */
int model_tf_padding(int in, int k, int s, int same, int *out, int *pad_before, int *pad_after);

/* "28,28,1" from a shape, and back (three positive integers; 0 or -1). */
int model_shape_format(model_shape s, char *buf, size_t buflen);
int model_shape_parse(const char *s, model_shape *out);

/* The layout of layers first..last (0 <= first <= last < n_layers) of whole,
 * as a model of its own: the same layers (shapes, windows, dropout ordinals)
 * renumbered from 0, only their tensors, with offsets from the range's first
 * tensor, so that n_params is the range's parameters alone and max_act the
 * range's largest activation. A model_new on it sizes its workspace for
 * these layers only and takes parameter and gradient buffers of the range's
 * n_params floats; its forward_range(0, last - first) computes the floats
 * forward_range(first, last) of a whole-model instance computes (the
 * backends see an ordinary layout). input is layers[first].in; n_classes is
 * whole's (it means something only when the range ends at the logits);
 * model_init_params on it writes what it writes into the whole buffer at
 * range_offset. A range of a range is relative to the range. 0, or -1 with
 * err. (model.c) */
int model_layout_range(const model_layout *whole, int first, int last, model_layout *out, char *err,
                       size_t errlen);

/* The bytes a task holds per parameter float it trains: the parameters, the
 * gradients and the optimizer's two slot buffers (4 x 4 bytes; --local); a
 * pipeline stage's micro-batches add their gradients into the step's sum, its
 * gradient buffer (4 x 4), two more with replicas (6 x 4), and one more, a
 * micro-batch's own gradients, where the backend cannot add them itself
 * (model_adds_gradients 0): what workerd's --max_model_bytes counts. The
 * activations and workspace are not counted (they scale with the batch). */
#define MODEL_STATE_FLOATS_LOCAL 4
#define MODEL_STATE_FLOATS_STAGE 4
#define MODEL_STATE_FLOATS_STAGE_REPLICAS 6
static inline uint64_t model_state_bytes(size_t n_params, int floats_per_param)
{
    return (uint64_t)n_params * (uint64_t)floats_per_param * sizeof(float);
}

/* Index of the tensor called name, or -1. */
int model_layout_find(const model_layout *layout, const char *name);

/* "dense", "conv2d", "maxpool", "relu", "dropout", "flatten" (logs, tests). */
const char *model_layer_kind_name(layer_kind kind);

/* The example's initialization, deterministic from seed: every kernel from a
 * normal with stddev 1/sqrt(fan_in) truncated at 2 stddev (redrawn beyond, like
 * tf.truncated_normal), fan_in = K for dense and KH*KW*C_in for conv; biases 0.
 * Each tensor has its own stream, rng_stream(seed, tensor index) (rng.h),
 * filled in row-major order (mlp:100 gets what mlp_init_params gave); the
 * index in the whole model (range_tensor0 + i for a range layout). */
void model_init_params(const model_layout *layout, float *params, uint64_t seed);

/* What a training step's dropout depends on. Row i of a batch is example
 * example[i] when example is not NULL, else example0 + i (the index in the
 * epoch order the batcher uses). inference != 0: no dropout (evaluation). A
 * NULL ctx is {seed 0, step 0, example0 0, training}: model_dump's defaults. */
typedef struct model_ctx {
    uint64_t seed;          /* workerd's --seed */
    int64_t step;           /* the global step the gradient is for */
    const int64_t *example; /* [batch] or NULL */
    int64_t example0;
    int inference;
    /* Overlap hooks (workerd --overlap; NULL: none), called from inside
     * model_forward_backward on its thread: wait_params(arg, l) before layer l
     * (one with parameters) reads them, nonzero stops the step (the call
     * returns -1); loss_done(arg, loss) once the loss is known, nonzero stops
     * the step; grads_done(arg, l) once layer l's parameter gradients are
     * written (the last layer first). The floats are those of a call without
     * hooks. A backend with layer_hooks 0 gets them all called around its
     * forward_backward by the front door (no overlap, the same order). */
    int (*wait_params)(void *arg, int layer);
    int (*loss_done)(void *arg, double loss);
    void (*grads_done)(void *arg, int layer);
    void *hook_arg;
} model_ctx;

/* The example index of row i under ctx (NULL: i). */
static inline int64_t model_ctx_example(const model_ctx *ctx, int i)
{
    if (!ctx)
        return i;
    return ctx->example ? ctx->example[i] : ctx->example0 + i;
}

/* A model instance on some backend: the layout plus that backend's workspace,
 * allocated once by create() for batches up to max_batch. Backends embed this
 * as the first member of their own struct. */
typedef struct model_backend model_backend;
typedef struct model {
    const model_backend *backend;
    model_layout layout;
    int max_batch;
} model;

/* The functions every backend implements. All pointers passed in are host
 * memory (a device backend copies what it needs, fastest from and to memory
 * its host_alloc handed out); params and grads are buffers of layout.n_params
 * floats; x is [batch, n_in] row-major (NHWC); labels are in [0, n_classes);
 * grads must not overlap params or x. Return 0, or a negative value on bad
 * arguments or a backend failure. The front door (model_*) checks the
 * arguments first (batch in [1, max_batch], ranges, NULLs), so a backend may
 * assume them; labels are checked by the backend (forward_backward, evaluate,
 * loss_head) as it reads them. Not for several threads at once on one
 * instance. */
struct model_backend {
    const char *name; /* "cpu", "cuda" */
    model *(*create)(const model_layout *layout, int max_batch, char *err, size_t errlen);
    void (*destroy)(model *m);
    /* One training step's gradient: forward through every layer (dropout per
     * ctx), the mean softmax cross-entropy over the batch into *loss, and its
     * gradient with respect to every parameter into grads (overwritten, not
     * added to). The same floats as forward_range(0, L-1), loss_head and
     * backward_range(0, L-1, din NULL) in turn. */
    int (*forward_backward)(model *m, const float *params, const float *x, const uint8_t *labels,
                            int batch, const model_ctx *ctx, float *grads, double *loss);
    /* Mean loss and the fraction of argmax(logits) == label (the first maximum
     * wins a tie) over n >= 1 examples, in batches of max_batch, no dropout. */
    int (*evaluate)(model *m, const float *params, const float *x, const uint8_t *labels,
                    int64_t n, double *loss, double *accuracy);
    /* Optional (NULL: calloc and free): host memory for the buffers passed to
     * the functions here, zeroed, that this instance moves fastest (CUDA:
     * page-locked); NULL when out of memory. host_free takes what host_alloc
     * gave (or NULL). */
    void *(*host_alloc)(model *m, size_t bytes);
    void (*host_free)(model *m, void *p);
    /* Optional (NULL: nothing to stage, as on the CPU): start moving the batch
     * the next forward_backward will get to the device and return at once;
     * see model_stage_batch. */
    int (*stage_batch)(model *m, const float *x, const uint8_t *labels, int batch);
    /* The range interface (model parallelism by layers runs one range per
     * worker; the whole step is the range over all layers):
     * forward_range: layers first..last (inclusive, 0 <= first <= last <
     *   n_layers) on in [batch, layers[first].in_numel] into out [batch,
     *   layers[last].out_numel], dropout per ctx. The instance keeps what the
     *   backward of these layers needs (the activations inside the range, the
     *   argmax, the dropout mask), and may keep a pointer to in: the caller
     *   leaves in unchanged until the matching backward_range returns.
     * backward_range: the same first, last and batch as the forward_range just
     *   before (the instance holds one forward at a time); dout [batch,
     *   layers[last].out_numel] the loss's gradient with respect to out; din
     *   [batch, layers[first].in_numel] gets the gradient with respect to in
     *   (NULL: not computed, as for layer 0 of a whole step); grads (n_params
     *   floats, the layout's offsets) gets the gradients of the tensors of
     *   layers first..last, overwritten; its other tensors are left as they are.
     * loss_head: the mean softmax cross-entropy of logits [batch, n_classes]
     *   against labels into *loss and, when dlogits is not NULL, its gradient
     *   (softmax - onehot) / batch into dlogits [batch, n_classes]. */
    int (*forward_range)(model *m, int first, int last, const float *params, const float *in,
                         int batch, const model_ctx *ctx, float *out);
    int (*backward_range)(model *m, int first, int last, const float *params, const float *dout,
                          int batch, float *din, float *grads);
    int (*loss_head)(model *m, const float *logits, const uint8_t *labels, int batch,
                     float *dlogits, double *loss);
    /* Optional (NULL: model_backward_range_add does it with backward_range
     * and a sum): backward_range, but the parameter gradients of layers
     * first..last are added to grads' floats instead of overwriting them (a
     * pipeline stage sums its micro-batches' gradients so, without a pass of
     * its own over them). */
    int (*backward_range_add)(model *m, int first, int last, const float *params, const float *dout,
                              int batch, float *din, float *grads);
    /* The embedding bag (embed:ROWSxDIM[,mean|sum], embed_bag.c; the CUDA
     * mirror in model_cuda.cu). rows [n_rows, dim]: the rows a batch
     * touches, gathered into one buffer; example b's bag is rows idx[j] for
     * j in off[b]..off[b+1] (idx [off[batch]] in 0..n_rows-1).
     * bag_forward: out [batch, dim] = the sum of its bag's rows, or their
     *   mean (mean 1; an empty bag gives 0).
     * bag_backward: drows [n_rows, dim] (overwritten) = the gradient of the
     *   loss with respect to the rows, from dout [batch, dim]: dout[b] (over
     *   the bag's size for the mean) added to each of b's rows (a row twice
     *   in a bag gets it twice). */
    int (*bag_forward)(model *m, const float *rows, int64_t n_rows, int dim, const int32_t *idx,
                       const int64_t *off, int batch, int mean, float *out);
    int (*bag_backward)(model *m, const float *dout, int64_t n_rows, int dim, const int32_t *idx,
                        const int64_t *off, int batch, int mean, float *drows);
    int layer_hooks; /* 1: forward_backward calls model_ctx's overlap hooks itself, layer by layer */
};

/* The OpenBLAS backend (model_cpu.c). */
extern const model_backend model_backend_cpu;

/* The cuBLAS backend (model_cuda.cu). Exists only in a build with CUDA (the
 * Makefile builds it when nvcc is found; make CUDA=0 leaves it out): use
 * model_cuda_backend() where the build may lack it. */
extern const model_backend model_backend_cuda;

/* CUDA helpers (model_cuda.cu; model_cuda_stub.c in a build without CUDA),
 * safe on a machine with no NVIDIA driver or no device:
 *  model_cuda_built: 1 when this build has the CUDA backend, else 0.
 *  model_cuda_backend: &model_backend_cuda, or NULL in a build without CUDA.
 *  model_cuda_device_count: the devices this process sees (CUDA_VISIBLE_DEVICES
 *    applies); 0 with the reason in err when there is none, no driver or no
 *    backend.
 *  model_cuda_use: make device gpu this process's device for the models
 *    created after it, TF32 sgemm on or off (off: full FP32, matches the CPU);
 *    desc gets "GPU 0 of 1: <name>, sm_90, ..."; 0, or -1 with err. */
int model_cuda_built(void);
const model_backend *model_cuda_backend(void);
int model_cuda_device_count(char *err, size_t errlen);
int model_cuda_use(int gpu, int tf32, char *desc, size_t desclen, char *err, size_t errlen);

/* Which backend this process computes with (model_device.c), from workerd's
 * --device, --gpu and --tf32: "auto" takes CUDA when the build has it and
 * device gpu is visible and usable (cuBLAS loads), else the CPU; "cuda"
 * without all that is an error; "cpu" is the CPU. On success, line gets one
 * sentence saying which and why (workerd prints it first). 0, or -1 with err. */
int model_device_choose(const char *device, int gpu, int tf32, char *line, size_t linelen,
                        char *err, size_t errlen);
/* The chosen backend (the CPU one until model_device_choose picks another). */
const model_backend *model_device_backend(void);
/* For start-up lines: "cpu backend (OpenBLAS Haswell, 1 thread; kernel: ...)"
 * or "cuda backend (GPU 0 of 1: NVIDIA H200, sm_90, ...)"; a static buffer. */
const char *model_device_describe(int threads);

/* Front door (model.c): check the arguments, dispatch to the instance's backend. */
model *model_new(const model_backend *backend, const model_layout *layout, int max_batch,
                 char *err, size_t errlen);
void model_free(model *m);
int model_forward_backward(model *m, const float *params, const float *x, const uint8_t *labels,
                           int batch, const model_ctx *ctx, float *grads, double *loss);
int model_evaluate(model *m, const float *params, const float *x, const uint8_t *labels,
                   int64_t n, double *loss, double *accuracy);
int model_forward_range(model *m, int first, int last, const float *params, const float *in,
                        int batch, const model_ctx *ctx, float *out);
int model_backward_range(model *m, int first, int last, const float *params, const float *dout,
                         int batch, float *din, float *grads);
/* 1 when backend adds a range's gradients to a sum itself
 * (backward_range_add), so model_backward_range_add needs no scratch. */
int model_adds_gradients(const model_backend *backend);
/* model_backward_range that adds the gradients of layers first..last's
 * tensors to sum; scratch (the layout's n_params floats) is where they go
 * first when the backend has no backward_range_add (its floats are then
 * overwritten). 0, or -1. */
int model_backward_range_add(model *m, int first, int last, const float *params, const float *dout,
                             int batch, float *din, float *sum, float *scratch);
int model_loss_head(model *m, const float *logits, const uint8_t *labels, int batch,
                    float *dlogits, double *loss);
/* The backend's bag_forward and bag_backward (above), the arguments checked
 * (idx within n_rows, off non-decreasing from 0): 0, or -1. */
int model_bag_forward(model *m, const float *rows, int64_t n_rows, int dim, const int32_t *idx,
                      const int64_t *off, int batch, int mean, float *out);
int model_bag_backward(model *m, const float *dout, int64_t n_rows, int dim, const int32_t *idx,
                       const int64_t *off, int batch, int mean, float *drows);
/* The CPU's (embed_bag.c), the reference of every backend's. */
int model_cpu_bag_forward(model *m, const float *rows, int64_t n_rows, int dim, const int32_t *idx,
                          const int64_t *off, int batch, int mean, float *out);
int model_cpu_bag_backward(model *m, const float *dout, int64_t n_rows, int dim, const int32_t *idx,
                           const int64_t *off, int batch, int mean, float *drows);
/* Host memory for params, grads, x and labels: bytes zeroed, or NULL when out
 * of memory. From the backend's host_alloc (CUDA: pinned memory, which its
 * copies use directly; when pinned memory runs out, ordinary memory and one
 * warning line on stderr), else, and when m is NULL, calloc. Any host memory
 * works with every backend; this is only faster. Free with model_host_free on
 * the same m (NULL with NULL), BEFORE model_free(m). */
void *model_host_alloc(model *m, size_t bytes);
void model_host_free(model *m, void *p);

/* Prefetch: start copying the batch (x [batch, n_in], labels [batch]) that
 * the caller will pass to its next model_forward_backward, and return at once,
 * so that the copy overlaps what the caller does in between. An optimization
 * only: the results are identical, bit for bit, with or without it. The
 * contract (as mlp_stage_batch's was):
 *  - the next model_forward_backward called with the same x, labels and batch
 *    (the same pointers, not merely equal contents) uses the staged copy;
 *    called with anything else it copies its own x and labels as always.
 *    Either way that call ends the staging; so do model_evaluate,
 *    model_forward_range, a later model_stage_batch (which replaces it) and
 *    model_free. Stage again for every batch.
 *  - from this call until the call that ends the staging returns, the caller
 *    must neither modify nor free x and labels.
 *  - on a backend without a device (the CPU) it does nothing and returns 0.
 * 0, or -1 on bad arguments or a backend failure (then nothing is staged and
 * the next model_forward_backward copies as usual: a caller may ignore it). */
int model_stage_batch(model *m, const float *x, const uint8_t *labels, int batch);

/* CPU backend only: OpenBLAS threads for this process (process-wide). */
void model_cpu_set_threads(int n);
/* CPU backend only: the kernel set OpenBLAS uses ("SkylakeX", "Haswell", ...). */
const char *model_cpu_blas_core(void);

#endif
