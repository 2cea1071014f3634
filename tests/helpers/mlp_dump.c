/* mlp_dump.c - runs one forward/backward of the CPU backend on inputs read from
 * files and writes the results as raw float32, for tests/system/test_mlp_numpy.py
 * to compare against an independent numpy implementation. The MLP-only
 * tool's interface kept on the layer library: the model is mlp:HIDDEN on
 * flat inputs of n_in values with n_out classes (model_dump is the general tool).
 *
 *   mlp_dump --spec=FILE --params=FILE --x=FILE --labels=FILE
 *            --loss_out=FILE --grads_out=FILE [--eval_out=FILE]
 *
 * spec:   one line of text "n_in=7 hidden=5,4 n_out=3 batch=5" (hidden= empty: none)
 * params: n_params little-endian float32 in the layout of model.h
 * x:      batch * n_in float32, row-major;  labels: batch bytes
 * loss_out:  one float32, the mean loss;  grads_out: n_params float32
 * eval_out:  two float32, model_evaluate's loss and accuracy over the same batch
 * stdout: the layout, one line per tensor: "tensor NAME D0[,D1] OFFSET".
 * stderr: "mlp_dump: OpenBLAS CORE (kernel: ...)", the kernel chosen as workerd
 * chooses it (blas_kernel_choose).
 * Exit status 0, 1 on bad input (a message on stderr), 2 on usage. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/blas_kernel.h"
#include "model/model.h"

static void die(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
static void die(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("mlp_dump: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(code);
}

/* The whole file, which must be exactly `want` bytes. */
static void *read_exact_file(const char *path, size_t want)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        die(1, "%s: cannot open", path);
    void *buf = malloc(want ? want : 1);
    if (!buf)
        die(1, "%s: out of memory", path);
    size_t got = fread(buf, 1, want, f);
    int extra = fgetc(f);
    fclose(f);
    if (got != want || extra != EOF)
        die(1, "%s: expected exactly %zu bytes", path, want);
    return buf;
}

static void write_file(const char *path, const void *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0)
        die(1, "%s: cannot write", path);
}

int main(int argc, char **argv)
{
    const char *spec = NULL, *params_p = NULL, *x_p = NULL, *labels_p = NULL, *loss_p = NULL,
               *grads_p = NULL, *eval_p = NULL;
    struct { const char *flag; const char **dst; } flags[] = {
        {"--spec=", &spec},         {"--params=", &params_p},   {"--x=", &x_p},
        {"--labels=", &labels_p},   {"--loss_out=", &loss_p},   {"--grads_out=", &grads_p},
        {"--eval_out=", &eval_p},
    };
    for (int i = 1; i < argc; i++) {
        size_t k;
        for (k = 0; k < sizeof(flags) / sizeof(flags[0]); k++)
            if (strncmp(argv[i], flags[k].flag, strlen(flags[k].flag)) == 0) {
                *flags[k].dst = argv[i] + strlen(flags[k].flag);
                break;
            }
        if (k == sizeof(flags) / sizeof(flags[0]))
            die(2, "unknown argument %s (see the comment at the top of mlp_dump.c)", argv[i]);
    }
    if (!spec || !params_p || !x_p || !labels_p || !loss_p || !grads_p)
        die(2, "usage: mlp_dump --spec=F --params=F --x=F --labels=F --loss_out=F --grads_out=F "
               "[--eval_out=F]");

    char line[1024] = "", hidden_s[512] = "";
    FILE *f = fopen(spec, "r");
    if (!f || !fgets(line, sizeof(line), f))
        die(1, "%s: cannot read", spec);
    fclose(f);
    int n_in = 0, n_out = 0, batch = 0;
    char err[512];
    if (blas_kernel_choose(argv, err, sizeof(err)) != 0)
        die(1, "%s", err);
    fprintf(stderr, "mlp_dump: OpenBLAS %s (%s)\n", blas_kernel_name(), blas_kernel_reason());
    for (char *tok = strtok(line, " \t\r\n"); tok; tok = strtok(NULL, " \t\r\n")) {
        if (sscanf(tok, "n_in=%d", &n_in) == 1 || sscanf(tok, "n_out=%d", &n_out) == 1 ||
            sscanf(tok, "batch=%d", &batch) == 1)
            continue;
        if (strncmp(tok, "hidden=", 7) == 0 && strlen(tok + 7) < sizeof(hidden_s)) {
            strcpy(hidden_s, tok + 7);
            continue;
        }
        die(1, "%s: unknown item \"%s\"", spec, tok);
    }
    char mspec[600];
    snprintf(mspec, sizeof(mspec), "mlp:%s", hidden_s);
    model_layout ly;
    if (n_in < 1 || n_in > MODEL_MAX_DIM)
        die(1, "%s: n_in=%d", spec, n_in);
    if (model_layout_init(&ly, mspec, (model_shape){1, 1, n_in}, n_out, err, sizeof(err)) != 0)
        die(1, "%s: %s", spec, err);
    if (batch < 1)
        die(1, "%s: batch %d", spec, batch);

    float *params = read_exact_file(params_p, ly.n_params * sizeof(float));
    float *x = read_exact_file(x_p, (size_t)batch * n_in * sizeof(float));
    uint8_t *labels = read_exact_file(labels_p, (size_t)batch);
    float *grads = malloc(ly.n_params * sizeof(float));
    model *m = model_new(&model_backend_cpu, &ly, batch, err, sizeof(err));
    if (!grads || !m)
        die(1, "%s", m ? "out of memory" : err);
    double loss;
    if (model_forward_backward(m, params, x, labels, batch, NULL, grads, &loss) != 0)
        die(1, "forward_backward failed (a label >= n_out?)");
    float lf = (float)loss;
    write_file(loss_p, &lf, sizeof(lf));
    write_file(grads_p, grads, ly.n_params * sizeof(float));
    if (eval_p) {
        double el, acc;
        if (model_evaluate(m, params, x, labels, batch, &el, &acc) != 0)
            die(1, "evaluate failed");
        float ev[2] = {(float)el, (float)acc};
        write_file(eval_p, ev, sizeof(ev));
    }
    for (int i = 0; i < ly.n_tensors; i++) {
        const model_tensor *t = &ly.tensors[i];
        if (t->shape.ndim == 2)
            printf("tensor %s %lld,%lld %zu\n", t->name, (long long)t->shape.dims[0],
                   (long long)t->shape.dims[1], t->offset);
        else
            printf("tensor %s %lld %zu\n", t->name, (long long)t->shape.dims[0], t->offset);
    }
    model_free(m);
    free(params);
    free(x);
    free(labels);
    free(grads);
    return 0;
}
