/* onnx_export.h - a trained model as an ONNX file: the layer library's graph
 * (model/model.h) with its parameters as initializers, serialized by protobuf-c
 * from onnx.proto as the ONNX project ships it (client/onnx/onnx.proto, from
 * the PyPI onnx package; the Makefile runs protoc-c on it).
 *
 * The graph (opset ONNX_EXPORT_OPSET of the default domain, IR version
 * ONNX_EXPORT_IR_VERSION):
 *   input          "input", float32 [N, H, W, C] (NHWC, as restps takes its data;
 *                  N symbolic "batch")
 *   conv2d         Transpose to NCHW once before the first conv or pool, then
 *                  Conv with the kernel turned from HWIO to OIHW, explicit pads
 *                  (TensorFlow's same or valid, as the layout computed them)
 *   maxpool        MaxPool, the same pads (padded positions never win a max)
 *   relu           Relu
 *   dropout        Identity (inference)
 *   flatten        Transpose back to NHWC (the layout's flatten is the
 *                  row-major order of [H, W, C]), then Flatten(axis 1)
 *   dense          Gemm(x, W [K, N], b [N])
 *   outputs        "logits" [N, n_classes] and "probabilities" = Softmax(logits, axis 1)
 * The file's metadata_props carry the restps model file's metadata (model,
 * input_shape, global_step, moving_average_decay when set). */
#ifndef RESTPS_ONNX_EXPORT_H
#define RESTPS_ONNX_EXPORT_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

#define ONNX_EXPORT_OPSET 13
#define ONNX_EXPORT_IR_VERSION 7

/* The metadata written beside the graph (each may be NULL: left out). */
typedef struct onnx_export_meta {
    int64_t global_step;     /* < 0: not written */
    float moving_average_decay; /* > 0: written (the parameters are the averages) */
    const char *producer_version;
} onnx_export_meta;

/* Write the model of layout L (a whole model, not a range) with params
 * (L->n_params floats, the layout's offsets) to path as an ONNX ModelProto.
 * 0, or -1 with err (an unsupported layout, out of memory, the write). */
int onnx_export_write(const model_layout *L, const float *params, const onnx_export_meta *meta,
                      const char *path, char *err, size_t errlen);

/* The same model serialized into a buffer of *len bytes (free() it), or NULL
 * with err. */
uint8_t *onnx_export_pack(const model_layout *L, const float *params, const onnx_export_meta *meta,
                          size_t *len, char *err, size_t errlen);

#endif
