/* onnx_export.c - the model as an ONNX graph (onnx_export.h), built as
 * protobuf-c messages of onnx.proto and packed by protobuf-c. Every message,
 * string and array of one export comes from one arena, freed at the end. */
#include "onnx/onnx_export.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "onnx.pb-c.h"

/* ---------------------------------------------------------------- arena */

typedef struct arena {
    void **blocks;
    size_t n, cap;
    int failed;
} arena;

static void *arena_alloc(arena *a, size_t bytes)
{
    if (a->failed)
        return NULL;
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        void **b = realloc(a->blocks, cap * sizeof(*b));
        if (!b) {
            a->failed = 1;
            return NULL;
        }
        a->blocks = b;
        a->cap = cap;
    }
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        a->failed = 1;
        return NULL;
    }
    a->blocks[a->n++] = p;
    return p;
}

static void arena_free(arena *a)
{
    for (size_t i = 0; i < a->n; i++)
        free(a->blocks[i]);
    free(a->blocks);
    memset(a, 0, sizeof(*a));
}

static char *arena_printf(arena *a, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    char *s = arena_alloc(a, strlen(buf) + 1);
    if (s)
        strcpy(s, buf);
    return s;
}

/* ---------------------------------------------------------------- the graph being built */

#define MAX_NODES (3 * MODEL_MAX_LAYERS + 8)
#define MAX_ATTRS 4

typedef struct graph_build {
    arena a;
    Onnx__NodeProto *nodes[MAX_NODES];
    size_t n_nodes;
    Onnx__TensorProto *inits[MODEL_MAX_TENSORS];
    size_t n_inits;
    int n_values; /* names t0, t1, ... of intermediate values */
} graph_build;

static Onnx__AttributeProto *attr_ints(graph_build *g, const char *name, const int64_t *v, size_t n)
{
    Onnx__AttributeProto *at = arena_alloc(&g->a, sizeof(*at));
    int64_t *ints = arena_alloc(&g->a, n * sizeof(int64_t));
    if (!at || !ints)
        return NULL;
    onnx__attribute_proto__init(at);
    at->name = arena_printf(&g->a, "%s", name);
    at->has_type = 1;
    at->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS;
    memcpy(ints, v, n * sizeof(int64_t));
    at->n_ints = n;
    at->ints = ints;
    return at;
}

static Onnx__AttributeProto *attr_int(graph_build *g, const char *name, int64_t v)
{
    Onnx__AttributeProto *at = arena_alloc(&g->a, sizeof(*at));
    if (!at)
        return NULL;
    onnx__attribute_proto__init(at);
    at->name = arena_printf(&g->a, "%s", name);
    at->has_type = 1;
    at->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT;
    at->has_i = 1;
    at->i = v;
    return at;
}

/* A node op(inputs) -> out (NULL: a fresh intermediate name), with attrs;
 * its output name, or NULL when out of memory or nodes. */
static const char *add_node(graph_build *g, const char *op, const char *const *inputs, size_t n_in,
                            const char *out, Onnx__AttributeProto **attrs, size_t n_attrs)
{
    if (g->n_nodes == MAX_NODES || g->a.failed)
        return NULL;
    Onnx__NodeProto *nd = arena_alloc(&g->a, sizeof(*nd));
    char **in = arena_alloc(&g->a, n_in * sizeof(char *));
    char **outs = arena_alloc(&g->a, sizeof(char *));
    Onnx__AttributeProto **at = arena_alloc(&g->a, (n_attrs ? n_attrs : 1) * sizeof(*at));
    if (!nd || !in || !outs || !at)
        return NULL;
    onnx__node_proto__init(nd);
    for (size_t i = 0; i < n_in; i++)
        in[i] = arena_printf(&g->a, "%s", inputs[i]);
    outs[0] = out ? arena_printf(&g->a, "%s", out) : arena_printf(&g->a, "t%d", g->n_values++);
    for (size_t i = 0; i < n_attrs; i++) {
        if (!attrs[i])
            return NULL;
        at[i] = attrs[i];
    }
    nd->n_input = n_in;
    nd->input = in;
    nd->n_output = 1;
    nd->output = outs;
    nd->name = arena_printf(&g->a, "%s_%zu", op, g->n_nodes);
    nd->op_type = arena_printf(&g->a, "%s", op);
    nd->n_attribute = n_attrs;
    nd->attribute = n_attrs ? at : NULL;
    if (g->a.failed)
        return NULL;
    g->nodes[g->n_nodes++] = nd;
    return outs[0];
}

/* A float32 initializer name of dims (n_dims) holding data (copied). */
static int add_init(graph_build *g, const char *name, const int64_t *dims, size_t n_dims, const float *data,
                    size_t numel)
{
    Onnx__TensorProto *t = arena_alloc(&g->a, sizeof(*t));
    int64_t *d = arena_alloc(&g->a, n_dims * sizeof(int64_t));
    uint8_t *raw = arena_alloc(&g->a, numel * sizeof(float));
    if (!t || !d || !raw || g->n_inits == MODEL_MAX_TENSORS)
        return -1;
    onnx__tensor_proto__init(t);
    memcpy(d, dims, n_dims * sizeof(int64_t));
    memcpy(raw, data, numel * sizeof(float)); /* little-endian float32: the host's (x86-64, aarch64) */
    t->n_dims = n_dims;
    t->dims = d;
    t->has_data_type = 1;
    t->data_type = ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT;
    t->name = arena_printf(&g->a, "%s", name);
    t->has_raw_data = 1;
    t->raw_data.len = numel * sizeof(float);
    t->raw_data.data = raw;
    g->inits[g->n_inits++] = t;
    return g->a.failed ? -1 : 0;
}

/* A float32 tensor value: name, dims (a dim < 0 is the symbolic "batch"). */
static Onnx__ValueInfoProto *value_info(graph_build *g, const char *name, const int64_t *dims, size_t n)
{
    Onnx__ValueInfoProto *v = arena_alloc(&g->a, sizeof(*v));
    Onnx__TypeProto *tp = arena_alloc(&g->a, sizeof(*tp));
    Onnx__TypeProto__Tensor *tt = arena_alloc(&g->a, sizeof(*tt));
    Onnx__TensorShapeProto *sh = arena_alloc(&g->a, sizeof(*sh));
    Onnx__TensorShapeProto__Dimension **dim = arena_alloc(&g->a, n * sizeof(*dim));
    if (!v || !tp || !tt || !sh || !dim)
        return NULL;
    onnx__value_info_proto__init(v);
    onnx__type_proto__init(tp);
    onnx__type_proto__tensor__init(tt);
    onnx__tensor_shape_proto__init(sh);
    for (size_t i = 0; i < n; i++) {
        dim[i] = arena_alloc(&g->a, sizeof(**dim));
        if (!dim[i])
            return NULL;
        onnx__tensor_shape_proto__dimension__init(dim[i]);
        if (dims[i] < 0) {
            dim[i]->value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_PARAM;
            dim[i]->dim_param = arena_printf(&g->a, "batch");
        } else {
            dim[i]->value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE;
            dim[i]->dim_value = dims[i];
        }
    }
    sh->n_dim = n;
    sh->dim = dim;
    tt->has_elem_type = 1;
    tt->elem_type = ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT;
    tt->shape = sh;
    tp->value_case = ONNX__TYPE_PROTO__VALUE_TENSOR_TYPE;
    tp->tensor_type = tt;
    v->name = arena_printf(&g->a, "%s", name);
    v->type = tp;
    return g->a.failed ? NULL : v;
}

/* ---------------------------------------------------------------- the layers */

static const int64_t TO_NCHW[4] = {0, 3, 1, 2}, TO_NHWC[4] = {0, 2, 3, 1};

static const char *transpose(graph_build *g, const char *x, const int64_t perm[4])
{
    Onnx__AttributeProto *at[1] = {attr_ints(g, "perm", perm, 4)};
    return add_node(g, "Transpose", &x, 1, NULL, at, 1);
}

/* Conv or MaxPool of layer ly on x (NCHW). */
static const char *window_op(graph_build *g, const model_layout *L, const model_layer *ly, const float *params,
                             const char *x)
{
    int64_t k[2] = {ly->kh, ly->kw}, s[2] = {ly->stride, ly->stride};
    int64_t pads[4] = {ly->pad_top, ly->pad_left, ly->pad_bottom, ly->pad_right};
    Onnx__AttributeProto *at[4] = {attr_ints(g, "kernel_shape", k, 2), attr_ints(g, "strides", s, 2),
                                   attr_ints(g, "pads", pads, 4), NULL};
    if (ly->kind == LAYER_MAXPOOL)
        return add_node(g, "MaxPool", &x, 1, NULL, at, 3);
    int64_t dil[2] = {1, 1};
    at[3] = attr_ints(g, "dilations", dil, 2);
    const model_tensor *w = &L->tensors[ly->w], *b = &L->tensors[ly->b];
    /* HWIO [KH, KW, C_in, C_out] -> OIHW [C_out, C_in, KH, KW] */
    int kh = ly->kh, kw = ly->kw, ci = ly->in.c, co = ly->out.c;
    float *oihw = arena_alloc(&g->a, w->numel * sizeof(float));
    if (!oihw)
        return NULL;
    const float *hwio = params + w->offset;
    for (int y = 0; y < kh; y++)
        for (int xx = 0; xx < kw; xx++)
            for (int i = 0; i < ci; i++)
                for (int o = 0; o < co; o++)
                    oihw[(((size_t)o * ci + i) * kh + y) * kw + xx] = hwio[(((size_t)y * kw + xx) * ci + i) * co + o];
    int64_t wd[4] = {co, ci, kh, kw}, bd[1] = {co};
    if (add_init(g, w->name, wd, 4, oihw, w->numel) != 0 || add_init(g, b->name, bd, 1, params + b->offset, b->numel) != 0)
        return NULL;
    const char *in[3] = {x, w->name, b->name};
    return add_node(g, "Conv", in, 3, NULL, at, 4);
}

static const char *dense_op(graph_build *g, const model_layout *L, const model_layer *ly, const float *params,
                            const char *x, const char *out)
{
    const model_tensor *w = &L->tensors[ly->w], *b = &L->tensors[ly->b];
    int64_t wd[2] = {(int64_t)ly->in_numel, (int64_t)ly->out_numel}, bd[1] = {(int64_t)ly->out_numel};
    if (add_init(g, w->name, wd, 2, params + w->offset, w->numel) != 0 ||
        add_init(g, b->name, bd, 1, params + b->offset, b->numel) != 0)
        return NULL;
    const char *in[3] = {x, w->name, b->name};
    return add_node(g, "Gemm", in, 3, out, NULL, 0);
}

/* The nodes of every layer, "input" to "logits" and "probabilities". 0 or -1 with err. */
static int build_nodes(graph_build *g, const model_layout *L, const float *params, char *err, size_t errlen)
{
    const char *x = "input";
    int nchw = 0, flat = 0; /* the current value's layout: NCHW (after a transpose), [N, K] */
    for (int l = 0; l < L->n_layers; l++) {
        const model_layer *ly = &L->layers[l];
        const char *out = l == L->n_layers - 1 ? "logits" : NULL;
        switch (ly->kind) {
        case LAYER_CONV2D:
        case LAYER_MAXPOOL:
            if (flat) {
                snprintf(err, errlen, "layer %d (%s) takes a flat input: not a model of the layer library", l,
                         model_layer_kind_name(ly->kind));
                return -1;
            }
            if (!nchw && !(x = transpose(g, x, TO_NCHW)))
                break;
            nchw = 1;
            x = window_op(g, L, ly, params, x);
            break;
        case LAYER_FLATTEN:
        case LAYER_DENSE:
            if (!flat) {
                if (nchw && !(x = transpose(g, x, TO_NHWC)))
                    break;
                nchw = 0;
                Onnx__AttributeProto *at[1] = {attr_int(g, "axis", 1)};
                x = add_node(g, "Flatten", &x, 1, ly->kind == LAYER_FLATTEN ? out : NULL, at, 1);
                flat = 1;
            }
            if (x && ly->kind == LAYER_DENSE)
                x = dense_op(g, L, ly, params, x, out);
            break;
        case LAYER_RELU:
            x = add_node(g, "Relu", &x, 1, out, NULL, 0);
            break;
        case LAYER_DROPOUT:
            x = add_node(g, "Identity", &x, 1, out, NULL, 0);
            break;
        default:
            snprintf(err, errlen, "layer %d: kind %d has no ONNX form here", l, (int)ly->kind);
            return -1;
        }
        if (!x) {
            snprintf(err, errlen, "out of memory building the ONNX graph");
            return -1;
        }
    }
    if (L->layers[L->n_layers - 1].kind != LAYER_DENSE || !flat) {
        snprintf(err, errlen, "the model does not end in a dense layer (the logits)");
        return -1;
    }
    Onnx__AttributeProto *at[1] = {attr_int(g, "axis", 1)};
    if (!add_node(g, "Softmax", &x, 1, "probabilities", at, 1)) {
        snprintf(err, errlen, "out of memory building the ONNX graph");
        return -1;
    }
    return 0;
}

static Onnx__StringStringEntryProto *meta_entry(graph_build *g, const char *k, const char *v)
{
    Onnx__StringStringEntryProto *e = arena_alloc(&g->a, sizeof(*e));
    if (!e)
        return NULL;
    onnx__string_string_entry_proto__init(e);
    e->key = arena_printf(&g->a, "%s", k);
    e->value = arena_printf(&g->a, "%s", v);
    return e;
}

uint8_t *onnx_export_pack(const model_layout *L, const float *params, const onnx_export_meta *meta,
                          size_t *len, char *err, size_t errlen)
{
    if (!L || !params || !len || L->n_layers < 1 || L->range_first != 0 || L->range_tensor0 != 0) {
        snprintf(err, errlen, "onnx export: a whole model's layout and parameters are needed");
        return NULL;
    }
    graph_build *g = calloc(1, sizeof(*g));
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    uint8_t *buf = NULL;
    if (build_nodes(g, L, params, err, errlen) != 0)
        goto out;
    snprintf(err, errlen, "out of memory building the ONNX model");
    int64_t in_dims[4] = {-1, L->input.h, L->input.w, L->input.c}, out_dims[2] = {-1, L->n_classes};
    Onnx__ValueInfoProto *vin = value_info(g, "input", in_dims, 4);
    Onnx__ValueInfoProto **outs = arena_alloc(&g->a, 2 * sizeof(*outs));
    Onnx__ValueInfoProto **ins = arena_alloc(&g->a, sizeof(*ins));
    Onnx__GraphProto *graph = arena_alloc(&g->a, sizeof(*graph));
    Onnx__ModelProto *mp = arena_alloc(&g->a, sizeof(*mp));
    Onnx__OperatorSetIdProto *ops = arena_alloc(&g->a, sizeof(*ops));
    Onnx__OperatorSetIdProto **opsp = arena_alloc(&g->a, sizeof(*opsp));
    Onnx__StringStringEntryProto **props = arena_alloc(&g->a, 5 * sizeof(*props));
    if (!vin || !outs || !ins || !graph || !mp || !ops || !opsp || !props)
        goto out;
    outs[0] = value_info(g, "logits", out_dims, 2);
    outs[1] = value_info(g, "probabilities", out_dims, 2);
    ins[0] = vin;
    onnx__graph_proto__init(graph);
    graph->name = arena_printf(&g->a, "restps");
    graph->doc_string = arena_printf(&g->a, "restps model %.200s", L->spec);
    graph->n_node = g->n_nodes;
    graph->node = g->nodes;
    graph->n_initializer = g->n_inits;
    graph->initializer = g->inits;
    graph->n_input = 1;
    graph->input = ins;
    graph->n_output = 2;
    graph->output = outs;
    onnx__operator_set_id_proto__init(ops);
    ops->domain = arena_printf(&g->a, "%s", ""); /* ai.onnx, the default domain */
    ops->has_version = 1;
    ops->version = ONNX_EXPORT_OPSET;
    opsp[0] = ops;
    onnx__model_proto__init(mp);
    mp->has_ir_version = 1;
    mp->ir_version = ONNX_EXPORT_IR_VERSION;
    mp->n_opset_import = 1;
    mp->opset_import = opsp;
    mp->producer_name = arena_printf(&g->a, "restps");
    mp->producer_version = arena_printf(&g->a, "%s", meta && meta->producer_version ? meta->producer_version : "1");
    mp->graph = graph;
    char shape[64], v[64];
    model_shape_format(L->input, shape, sizeof(shape));
    size_t np = 0;
    props[np++] = meta_entry(g, "model", L->spec);
    props[np++] = meta_entry(g, "input_shape", shape);
    props[np++] = meta_entry(g, "format", "restps-model-1");
    if (meta && meta->global_step >= 0) {
        snprintf(v, sizeof(v), "%lld", (long long)meta->global_step);
        props[np++] = meta_entry(g, "global_step", v);
    }
    if (meta && meta->moving_average_decay > 0) {
        snprintf(v, sizeof(v), "%.9g", (double)meta->moving_average_decay);
        props[np++] = meta_entry(g, "moving_average_decay", v);
    }
    mp->n_metadata_props = np;
    mp->metadata_props = props;
    if (g->a.failed || !outs[0] || !outs[1])
        goto out;
    size_t n = onnx__model_proto__get_packed_size(mp);
    buf = malloc(n ? n : 1);
    if (!buf)
        goto out;
    if (onnx__model_proto__pack(mp, buf) != n) {
        snprintf(err, errlen, "protobuf-c packed a size other than it measured");
        free(buf);
        buf = NULL;
        goto out;
    }
    *len = n;
out:
    arena_free(&g->a);
    free(g);
    return buf;
}

int onnx_export_write(const model_layout *L, const float *params, const onnx_export_meta *meta,
                      const char *path, char *err, size_t errlen)
{
    size_t n = 0;
    uint8_t *buf = onnx_export_pack(L, params, meta, &n, err, errlen);
    if (!buf)
        return -1;
    /* a temporary beside it, renamed over: a reader never sees half a file */
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp)) {
        snprintf(err, errlen, "'%.200s': path too long", path);
        free(buf);
        return -1;
    }
    FILE *fp = fopen(tmp, "wb");
    if (!fp) {
        snprintf(err, errlen, "unable to open '%.200s': %s", tmp, strerror(errno));
        free(buf);
        return -1;
    }
    int ok = fwrite(buf, 1, n, fp) == n;
    ok = (fclose(fp) == 0) && ok;
    free(buf);
    if (!ok || rename(tmp, path) != 0) {
        snprintf(err, errlen, "unable to write '%.200s': %s", path, strerror(errno));
        remove(tmp);
        return -1;
    }
    return 0;
}
