/* test_onnx_export.c - the ONNX graph workerd writes (client/onnx/onnx_export.c),
 * read back with protobuf-c's own unpacker of onnx.proto: opset and IR
 * version, the input NHWC with a symbolic batch, one node per layer in order
 * (a Transpose before the first conv or pool and back before the flatten),
 * TensorFlow's pads as the layout computed them (same and valid, strides), the
 * conv kernel's HWIO -> OIHW element by element, the dense kernel as is, the
 * metadata, and what it refuses (a range layout). onnxruntime runs the files
 * in tests/system/test_onnx.py. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "onnx.pb-c.h"
#include "onnx/onnx_export.h"

static Onnx__ModelProto *export_unpacked(const model_layout *L, const float *params, int64_t step, float decay)
{
    char err[256];
    size_t n = 0;
    onnx_export_meta meta = {step, decay, NULL};
    uint8_t *buf = onnx_export_pack(L, params, &meta, &n, err, sizeof(err));
    if (!buf)
        fail_msg("pack: %s", err);
    Onnx__ModelProto *m = onnx__model_proto__unpack(NULL, n, buf);
    free(buf);
    assert_non_null(m);
    return m;
}

static float *params_of(const model_layout *L)
{
    float *p = malloc(L->n_params * sizeof(float));
    assert_non_null(p);
    for (size_t i = 0; i < L->n_params; i++)
        p[i] = (float)i * 0.5f - 3.0f; /* every value its own, to see where it went */
    return p;
}

static const Onnx__TensorProto *init_named(const Onnx__GraphProto *g, const char *name)
{
    for (size_t i = 0; i < g->n_initializer; i++)
        if (strcmp(g->initializer[i]->name, name) == 0)
            return g->initializer[i];
    fail_msg("no initializer %s", name);
    return NULL;
}

static const Onnx__AttributeProto *attr_named(const Onnx__NodeProto *nd, const char *name)
{
    for (size_t i = 0; i < nd->n_attribute; i++)
        if (strcmp(nd->attribute[i]->name, name) == 0)
            return nd->attribute[i];
    fail_msg("node %s has no attribute %s", nd->op_type, name);
    return NULL;
}

static const char *meta_value(const Onnx__ModelProto *m, const char *key)
{
    for (size_t i = 0; i < m->n_metadata_props; i++)
        if (strcmp(m->metadata_props[i]->key, key) == 0)
            return m->metadata_props[i]->value;
    return NULL;
}

static void test_mlp_is_flatten_gemm_relu_gemm_softmax(void **state)
{
    (void)state;
    model_layout L;
    char err[256];
    assert_int_equal(model_layout_init(&L, "mlp:100", (model_shape){28, 28, 1}, 10, err, sizeof(err)), 0);
    float *p = params_of(&L);
    Onnx__ModelProto *m = export_unpacked(&L, p, 42, 0);
    assert_true(m->has_ir_version && m->ir_version == ONNX_EXPORT_IR_VERSION);
    assert_int_equal(m->n_opset_import, 1);
    assert_string_equal(m->opset_import[0]->domain, "");
    assert_int_equal(m->opset_import[0]->version, 13);
    const Onnx__GraphProto *g = m->graph;
    const char *ops[] = {"Flatten", "Gemm", "Relu", "Gemm", "Softmax"};
    assert_int_equal(g->n_node, 5);
    for (size_t i = 0; i < 5; i++)
        assert_string_equal(g->node[i]->op_type, ops[i]);
    assert_string_equal(g->node[3]->output[0], "logits");
    assert_string_equal(g->node[4]->output[0], "probabilities");
    /* the input: [batch, 28, 28, 1] */
    const Onnx__TensorShapeProto *sh = g->input[0]->type->tensor_type->shape;
    assert_string_equal(g->input[0]->name, "input");
    assert_int_equal(sh->n_dim, 4);
    assert_string_equal(sh->dim[0]->dim_param, "batch");
    assert_int_equal(sh->dim[1]->dim_value, 28);
    assert_int_equal(sh->dim[3]->dim_value, 1);
    /* the dense kernel is restps's [784, 100], the same floats */
    const Onnx__TensorProto *w = init_named(g, "hid_w");
    assert_int_equal(w->n_dims, 2);
    assert_int_equal(w->dims[0], 784);
    assert_int_equal(w->dims[1], 100);
    assert_int_equal(w->raw_data.len, 784 * 100 * 4);
    assert_memory_equal(w->raw_data.data, p + L.tensors[model_layout_find(&L, "hid_w")].offset, 784 * 100 * 4);
    assert_string_equal(meta_value(m, "global_step"), "42");
    assert_string_equal(meta_value(m, "model"), "mlp:100");
    assert_null(meta_value(m, "moving_average_decay"));
    onnx__model_proto__free_unpacked(m, NULL);
    free(p);
}

static void test_cnn_pads_strides_and_the_kernel_turned_to_oihw(void **state)
{
    (void)state;
    model_layout L;
    char err[256];
    const char *spec = "conv:3x2x4/2:same,pool:3/2:valid,dense:8,dropout:0.5,dense:10";
    assert_int_equal(model_layout_init(&L, spec, (model_shape){9, 7, 2}, 10, err, sizeof(err)), 0);
    float *p = params_of(&L);
    Onnx__ModelProto *m = export_unpacked(&L, p, 3, 0.99f);
    const Onnx__GraphProto *g = m->graph;
    const char *ops[] = {"Transpose", "Conv", "Relu", "MaxPool", "Transpose", "Flatten",
                         "Gemm", "Relu", "Identity", "Gemm", "Softmax"};
    assert_int_equal(g->n_node, sizeof(ops) / sizeof(ops[0]));
    for (size_t i = 0; i < g->n_node; i++)
        assert_string_equal(g->node[i]->op_type, ops[i]);
    const model_layer *conv = &L.layers[0], *pool = &L.layers[2];
    assert_int_equal(conv->kind, LAYER_CONV2D);
    assert_int_equal(pool->kind, LAYER_MAXPOOL);
    const Onnx__AttributeProto *pads = attr_named(g->node[1], "pads");
    assert_int_equal(pads->n_ints, 4);
    int64_t want[4] = {conv->pad_top, conv->pad_left, conv->pad_bottom, conv->pad_right};
    for (int i = 0; i < 4; i++)
        assert_int_equal(pads->ints[i], want[i]);
    assert_true(want[2] + want[3] > 0); /* same with a stride: some padding */
    assert_int_equal(attr_named(g->node[1], "strides")->ints[0], 2);
    assert_int_equal(attr_named(g->node[1], "kernel_shape")->ints[0], 3);
    assert_int_equal(attr_named(g->node[1], "kernel_shape")->ints[1], 2);
    const Onnx__AttributeProto *ppads = attr_named(g->node[3], "pads");
    for (int i = 0; i < 4; i++)
        assert_int_equal(ppads->ints[i], 0); /* valid */
    assert_int_equal(attr_named(g->node[0], "perm")->ints[1], 3); /* NHWC -> NCHW */
    assert_int_equal(attr_named(g->node[4], "perm")->ints[3], 1); /* NCHW -> NHWC */
    /* OIHW [4, 2, 3, 2]: element (o, i, y, x) is HWIO's (y, x, i, o) */
    const Onnx__TensorProto *w = init_named(g, "conv0_w");
    assert_int_equal(w->n_dims, 4);
    assert_int_equal(w->dims[0], 4);
    assert_int_equal(w->dims[1], 2);
    assert_int_equal(w->dims[2], 3);
    assert_int_equal(w->dims[3], 2);
    const float *hwio = p + L.tensors[conv->w].offset, *oihw = (const float *)w->raw_data.data;
    for (int o = 0; o < 4; o++)
        for (int i = 0; i < 2; i++)
            for (int y = 0; y < 3; y++)
                for (int x = 0; x < 2; x++) {
                    float a, b;
                    memcpy(&a, oihw + ((o * 2 + i) * 3 + y) * 2 + x, 4);
                    b = hwio[((y * 2 + x) * 2 + i) * 4 + o];
                    assert_true(a == b);
                }
    assert_string_equal(meta_value(m, "moving_average_decay"), "0.99000001");
    onnx__model_proto__free_unpacked(m, NULL);
    free(p);
}

static void test_a_range_layout_is_refused(void **state)
{
    (void)state;
    model_layout L, R;
    char err[256];
    assert_int_equal(model_layout_init(&L, "mlp:16,8", (model_shape){28, 28, 1}, 10, err, sizeof(err)), 0);
    assert_int_equal(model_layout_range(&L, 2, L.n_layers - 1, &R, err, sizeof(err)), 0);
    float *p = params_of(&R);
    size_t n = 0;
    err[0] = '\0';
    assert_null(onnx_export_pack(&R, p, NULL, &n, err, sizeof(err)));
    assert_non_null(strstr(err, "whole model"));
    free(p);
}

static void test_the_file_is_the_packed_bytes(void **state)
{
    (void)state;
    model_layout L;
    char err[256], path[] = "/tmp/test_onnx_export_XXXXXX";
    assert_int_equal(model_layout_init(&L, "mlp:4", (model_shape){28, 28, 1}, 10, err, sizeof(err)), 0);
    float *p = params_of(&L);
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(onnx_export_write(&L, p, NULL, path, err, sizeof(err)), 0);
    size_t n = 0;
    uint8_t *buf = onnx_export_pack(&L, p, NULL, &n, err, sizeof(err));
    assert_non_null(buf);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint8_t *got = malloc(n + 1);
    assert_int_equal(fread(got, 1, n + 1, f), n);
    fclose(f);
    assert_memory_equal(got, buf, n);
    /* a folder that does not exist: -1 naming it, nothing left behind */
    assert_int_equal(onnx_export_write(&L, p, NULL, "/nonexistent-dir/m.onnx", err, sizeof(err)), -1);
    assert_non_null(strstr(err, "/nonexistent-dir/m.onnx"));
    remove(path);
    free(got);
    free(buf);
    free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_is_flatten_gemm_relu_gemm_softmax),
        cmocka_unit_test(test_cnn_pads_strides_and_the_kernel_turned_to_oihw),
        cmocka_unit_test(test_a_range_layout_is_refused),
        cmocka_unit_test(test_the_file_is_the_packed_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
