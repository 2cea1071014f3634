/* model_dump.c - one training step's loss, logits and gradients of the CPU
 * backend on inputs read from a safetensors file, for the independent numpy
 * implementation (tests/system/test_model_numpy.py) to compare against.
 *
 *   model_dump SPEC IN.safetensors OUT.safetensors
 *
 * IN: float32 tensors: every parameter by its name (shapes as model.h says),
 *     x [B, H, W, C] (the images, [B, 28, 28, 1]), labels [B] (float32 holding
 *     integer class ids 0..9), and __metadata__ with optional keys seed, step
 *     (dropout's s and t; default 0) and example0 (row i is example
 *     example0 + i; default 0), decimal integers.
 * OUT: float32 tensors loss [1] (the mean loss), logits [B, 10] and
 *     grad.<name> for every parameter (the gradient of the mean loss), in the
 *     layout's order, and __metadata__ model (the canonical spec) and
 *     input_shape. The step runs through the range interface: forward over
 *     every layer, the loss head, backward.
 * Exit 0, or 2 with one line on stderr for a bad spec or a bad file. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/blas_kernel.h"
#include "model/model.h"
#include "safetensors.h"

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("model_dump: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static unsigned char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        die("%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    for (;;) {
        if (!buf)
            die("%s: out of memory", path);
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        cap *= 2;
        buf = realloc(buf, cap);
    }
    int bad = ferror(f);
    fclose(f);
    if (bad)
        die("%s: read error", path);
    *len = n;
    return buf;
}

/* A metadata integer: decimal digits (a leading '-' where allowed), or the default. */
static int64_t meta_int(const st_file *f, const char *key, int allow_negative, const char *path)
{
    const char *v = st_meta_get(f, key);
    if (!v)
        return 0;
    const char *p = v + (allow_negative && *v == '-');
    if (!*p || strspn(p, "0123456789") != strlen(p))
        die("%s: __metadata__ %s \"%s\" is not a decimal integer", path, key, v);
    errno = 0;
    long long x = strtoll(v, NULL, 10);
    if (errno)
        die("%s: __metadata__ %s \"%s\" is out of range", path, key, v);
    return (int64_t)x;
}

/* Tensor name of f as float32 with the given shape (NULL: any), its data. */
static const float *tensor(const st_file *f, const unsigned char *buf, const char *name,
                           const tensor_shape *want, const char *path)
{
    int i = st_find(f, name);
    if (i < 0)
        die("%s: no tensor \"%s\"", path, name);
    const st_tensor *t = &f->tensors[i];
    if (strcmp(t->dtype, "F32") != 0)
        die("%s: tensor \"%s\" is %s, want F32", path, name, t->dtype);
    if (want && !tensor_shape_equal(&t->shape, want)) {
        char a[128], b[128];
        tensor_shape_format(&t->shape, a, sizeof(a));
        tensor_shape_format(want, b, sizeof(b));
        die("%s: tensor \"%s\" has shape [%s], want [%s]", path, name, a, b);
    }
    return (const float *)(buf + f->data_start + t->begin);
}

int main(int argc, char **argv)
{
    if (argc != 4)
        die("usage: model_dump SPEC IN.safetensors OUT.safetensors");
    const char *spec = argv[1], *in_path = argv[2], *out_path = argv[3];
    char err[1024];
    if (blas_kernel_choose(argv, err, sizeof(err)) != 0)
        die("%s", err);
    model_cpu_set_threads(1);

    size_t len;
    unsigned char *raw = read_all(in_path, &len);
    /* the data 4-byte aligned for the float views: copy it behind an aligned start */
    unsigned char *buf = aligned_alloc(64, (len + 63) & ~(size_t)63);
    if (!buf)
        die("%s: out of memory", in_path);
    memcpy(buf, raw, len);
    free(raw);
    st_file f;
    if (st_parse(buf, len, &f, err, sizeof(err)) != 0)
        die("%s: %s", in_path, err);
    if (f.data_start % 4 != 0)
        die("%s: the data section is not 4-byte aligned", in_path);

    int xi = st_find(&f, "x");
    if (xi < 0)
        die("%s: no tensor \"x\"", in_path);
    const tensor_shape *xs = &f.tensors[xi].shape;
    if (xs->ndim != 4 || xs->dims[0] < 1 || xs->dims[0] > 100000 || xs->dims[1] < 1 ||
        xs->dims[1] > MODEL_MAX_DIM || xs->dims[2] < 1 || xs->dims[2] > MODEL_MAX_DIM ||
        xs->dims[3] < 1 || xs->dims[3] > MODEL_MAX_DIM)
        die("%s: x must be [B, H, W, C] with B in 1..100000", in_path);
    const int B = (int)xs->dims[0];
    model_shape ishape = {(int)xs->dims[1], (int)xs->dims[2], (int)xs->dims[3]};
    model_layout ly;
    if (model_layout_init(&ly, spec, ishape, 10, err, sizeof(err)) != 0)
        die("%s", err);
    const float *x = tensor(&f, buf, "x", NULL, in_path);
    tensor_shape lshape = {.ndim = 1, .dims = {B}};
    const float *lf = tensor(&f, buf, "labels", &lshape, in_path);
    uint8_t *labels = malloc((size_t)B);
    float *params = malloc(ly.n_params * sizeof(float)), *grads = calloc(ly.n_params, sizeof(float));
    float *logits = malloc((size_t)B * 10 * sizeof(float)), *dlogits = malloc((size_t)B * 10 * sizeof(float));
    if (!labels || !params || !grads || !logits || !dlogits)
        die("out of memory");
    for (int i = 0; i < B; i++) {
        float v = lf[i];
        if (!(v >= 0.0f && v <= 9.0f) || v != (float)(int)v)
            die("%s: labels[%d] = %g is not a class id 0..9", in_path, i, (double)v);
        labels[i] = (uint8_t)v;
    }
    for (int t = 0; t < ly.n_tensors; t++) {
        const model_tensor *mt = &ly.tensors[t];
        memcpy(params + mt->offset, tensor(&f, buf, mt->name, &mt->shape, in_path),
               mt->numel * sizeof(float));
    }
    model_ctx ctx = {
        .seed = (uint64_t)meta_int(&f, "seed", 0, in_path),
        .step = meta_int(&f, "step", 0, in_path),
        .example0 = meta_int(&f, "example0", 0, in_path),
    };

    model *m = model_new(&model_backend_cpu, &ly, B, err, sizeof(err));
    if (!m)
        die("%s", err);
    double loss;
    const int L = ly.n_layers;
    if (model_forward_range(m, 0, L - 1, params, x, B, &ctx, logits) != 0 ||
        model_loss_head(m, logits, labels, B, dlogits, &loss) != 0 ||
        model_backward_range(m, 0, L - 1, params, dlogits, B, NULL, grads) != 0)
        die("the step failed");
    float lossf = (float)loss;

    /* loss, logits, grad.<name>... */
    const int n = 2 + ly.n_tensors;
    st_desc *d = calloc((size_t)n, sizeof(*d));
    st_part *parts = calloc((size_t)n, sizeof(*parts));
    char (*names)[MODEL_NAME_MAX + 8] = calloc((size_t)ly.n_tensors + 1, sizeof(*names));
    if (!d || !parts || !names)
        die("out of memory");
    tensor_shape s_loss = {.ndim = 1, .dims = {1}}, s_logits = {.ndim = 2, .dims = {B, 10}};
    d[0] = (st_desc){"loss", "F32", &s_loss};
    parts[0] = (st_part){&lossf, sizeof(lossf)};
    d[1] = (st_desc){"logits", "F32", &s_logits};
    parts[1] = (st_part){logits, (size_t)B * 10 * sizeof(float)};
    for (int t = 0; t < ly.n_tensors; t++) {
        snprintf(names[t], sizeof(names[t]), "grad.%s", ly.tensors[t].name);
        d[2 + t] = (st_desc){names[t], "F32", &ly.tensors[t].shape};
        parts[2 + t] = (st_part){grads + ly.tensors[t].offset, ly.tensors[t].numel * sizeof(float)};
    }
    char shape_s[64];
    model_shape_format(ly.input, shape_s, sizeof(shape_s));
    const char *meta[] = {"model", ly.spec, "input_shape", shape_s};
    if (st_write_file_parts(out_path, d, n, meta, 2, parts, n, NULL, NULL, err, sizeof(err)) != 0)
        die("%s: %s", out_path, err);

    model_free(m);
    st_file_free(&f);
    free(buf);
    free(labels);
    free(params);
    free(grads);
    free(logits);
    free(dlogits);
    free(d);
    free(parts);
    free(names);
    return 0;
}
