/* model_file.c - the model as a file: the metadata every model file carries
 * (the export, psd's and the ring's checkpoints name the model they hold) and
 * --export and --export_onnx. */
#include "workerd/train.h"

#include <stdio.h>
#include <string.h>

#include "onnx/onnx_export.h"
#include "safetensors.h"

void model_file_meta(const model_layout *L, char *shape, size_t shape_len, char *layers,
                     size_t layers_len)
{
    model_shape_format(L->input, shape, shape_len);
    snprintf(layers, layers_len, "%zu", L->n_in);
    for (int l = 0; l < L->n_layers; l++)
        if (L->layers[l].w >= 0) {
            size_t k = strlen(layers);
            snprintf(layers + k, layers_len - k, ",%zu", L->layers[l].out_numel);
        }
}

/* --export_onnx: the same parameters as an ONNX graph (onnx/onnx_export.h). */
static int export_onnx(const train_config *c, const float *params, int64_t step)
{
    char err[512];
    onnx_export_meta meta = {step, c->moving_average_decay, NULL};
    if (onnx_export_write(&c->layout, params, &meta, c->onnx_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --export_onnx: %s\n", err);
        return -1;
    }
    printf("%s: exported the model (global step %lld) as ONNX (opset %d) to %s\n", c->name, (long long)step,
           ONNX_EXPORT_OPSET, c->onnx_path);
    return 0;
}

int export_model(const train_config *c, const float *params, int64_t step)
{
    /* the safetensors file first: a model ONNX cannot take still leaves it */
    if (!c->export_path)
        return c->onnx_path ? export_onnx(c, params, step) : 0;
    const model_layout *L = &c->layout;
    st_desc d[MODEL_MAX_TENSORS];
    for (int t = 0; t < L->n_tensors; t++)
        d[t] = (st_desc){L->tensors[t].name, "F32", &L->tensors[t].shape};
    char step_s[32], shape[64], layers[512];
    snprintf(step_s, sizeof(step_s), "%lld", (long long)step);
    model_file_meta(L, shape, sizeof(shape), layers, sizeof(layers));
    /* with --moving_average_decay the parameters are the averages (the
     * caller pulled them so), and the metadata says so */
    char decay_s[32];
    snprintf(decay_s, sizeof(decay_s), "%.9g", (double)c->moving_average_decay);
    const char *meta[] = {"global_step", step_s, "model", L->spec, "input_shape", shape,
                          "layers", layers, "format", "restps-model-1",
                          "moving_average_decay", decay_s};
    int n_meta = c->moving_average_decay > 0 ? 6 : 5;
    char err[512];
    if (st_write_file(c->export_path, d, L->n_tensors, meta, n_meta, params, L->n_params * 4, err,
                      sizeof(err)) != 0) {
        fprintf(stderr, "workerd: export: %s\n", err);
        return -1;
    }
    printf("%s: exported the model (global step %lld) to %s\n", c->name, (long long)step,
           c->export_path);
    return c->onnx_path ? export_onnx(c, params, step) : 0;
}

