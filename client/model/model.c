/* model.c - the model's tensors (lookup, initialization) and the front door
 * that checks the arguments and dispatches to a backend. The layout itself
 * comes from the spec (model_spec.c); nothing here computes the model: see
 * model_cpu.c (and model_cuda.cu). */
#include "errmsg.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"

int model_layout_find(const model_layout *layout, const char *name)
{
    for (int i = 0; i < layout->n_tensors; i++)
        if (strcmp(layout->tensors[i].name, name) == 0)
            return i;
    return -1;
}

const char *model_layer_kind_name(layer_kind kind)
{
    switch (kind) {
    case LAYER_DENSE: return "dense";
    case LAYER_CONV2D: return "conv2d";
    case LAYER_MAXPOOL: return "maxpool";
    case LAYER_RELU: return "relu";
    case LAYER_DROPOUT: return "dropout";
    case LAYER_FLATTEN: return "flatten";
    }
    return "?";
}

void model_init_params(const model_layout *layout, float *params, uint64_t seed)
{
    for (int i = 0; i < layout->n_tensors; i++) {
        const model_tensor *t = &layout->tensors[i];
        float *p = params + t->offset;
        if (t->fan_in == 0) { /* bias */
            memset(p, 0, t->numel * sizeof(float));
            continue;
        }
        double stddev = 1.0 / sqrt((double)t->fan_in);
        uint64_t st = rng_stream(seed, (uint64_t)(layout->range_tensor0 + i));
        for (size_t k = 0; k < t->numel; k++)
            p[k] = (float)(stddev * rng_truncated_normal(&st));
    }
}

int model_layout_range(const model_layout *whole, int first, int last, model_layout *out, char *err,
                       size_t errlen)
{
    if (!whole || !out || first < 0 || first > last || last >= whole->n_layers) {
        errmsg(err, errlen, "model: layers %d-%d are not a range of the %d layers of %s", first, last,
               whole ? whole->n_layers : 0, whole ? whole->spec : "?");
        return -1;
    }
    model_layout r;
    memset(&r, 0, sizeof(r));
    memcpy(r.spec, whole->spec, sizeof(r.spec));
    r.input = whole->layers[first].in;
    r.n_classes = whole->n_classes;
    r.n_layers = last - first + 1;
    r.n_in = whole->layers[first].in_numel;
    r.range_first = whole->range_first + first;
    r.range_tensor0 = -1;
    int t0 = -1;
    for (int li = first; li <= last; li++) {
        model_layer l = whole->layers[li];
        if (l.in_numel > r.max_act)
            r.max_act = l.in_numel;
        if (l.out_numel > r.max_act)
            r.max_act = l.out_numel;
        if (l.kind == LAYER_DROPOUT)
            r.n_dropout++;
        /* the layer's tensors (buffer order is layer order, W then b) */
        int *idx[2] = {&l.w, &l.b};
        for (int k = 0; k < 2; k++) {
            if (*idx[k] < 0)
                continue;
            const model_tensor *t = &whole->tensors[*idx[k]];
            if (t0 < 0) {
                t0 = *idx[k];
                r.range_tensor0 = whole->range_tensor0 + t0;
                r.range_offset = whole->range_offset + t->offset;
            }
            model_tensor *u = &r.tensors[r.n_tensors];
            *u = *t;
            u->offset = t->offset - whole->tensors[t0].offset;
            u->layer = li - first;
            if (u->offset != r.n_params) { /* a layout not packed in layer order */
                errmsg(err, errlen, "model: the tensors of layers %d-%d of %s are not one run of the buffer", first,
                       last, whole->spec);
                return -1;
            }
            r.n_params += u->numel;
            *idx[k] = r.n_tensors++;
        }
        r.layers[li - first] = l;
    }
    if (t0 < 0) { /* no parameters in the range: where the next tensor would start */
        r.range_tensor0 = whole->range_tensor0 + whole->n_tensors;
        r.range_offset = whole->range_offset + whole->n_params;
        for (int k = 0; k < whole->n_tensors; k++)
            if (whole->tensors[k].layer > last) {
                r.range_tensor0 = whole->range_tensor0 + k;
                r.range_offset = whole->range_offset + whole->tensors[k].offset;
                break;
            }
    }
    *out = r;
    return 0;
}

model *model_new(const model_backend *backend, const model_layout *layout, int max_batch,
                 char *err, size_t errlen)
{
    if (!backend || !layout || layout->n_layers < 1) {
        errmsg(err, errlen, "model: no backend or no layout");
        return NULL;
    }
    if (max_batch < 1) {
        errmsg(err, errlen, "model: max batch %d (must be >= 1)", max_batch);
        return NULL;
    }
    return backend->create(layout, max_batch, err, errlen);
}

void model_free(model *m)
{
    if (m)
        m->backend->destroy(m);
}

int model_forward_backward(model *m, const float *params, const float *x, const uint8_t *labels,
                           int batch, const model_ctx *ctx, float *grads, double *loss)
{
    if (!m || !params || !x || !labels || !grads || !loss || batch < 1 || batch > m->max_batch)
        return -1;
    if (!ctx || m->backend->layer_hooks || (!ctx->wait_params && !ctx->loss_done && !ctx->grads_done))
        return m->backend->forward_backward(m, params, x, labels, batch, ctx, grads, loss);
    /* a backend that does not call the overlap hooks: all of them around it */
    const model_layout *ly = &m->layout;
    for (int l = 0; l < ly->n_layers; l++)
        if (ly->layers[l].w >= 0 && ctx->wait_params && ctx->wait_params(ctx->hook_arg, l) != 0)
            return -1;
    model_ctx plain = *ctx;
    plain.wait_params = NULL;
    plain.loss_done = NULL;
    plain.grads_done = NULL;
    int rc = m->backend->forward_backward(m, params, x, labels, batch, &plain, grads, loss);
    if (rc != 0 || (ctx->loss_done && ctx->loss_done(ctx->hook_arg, *loss) != 0))
        return -1;
    for (int l = ly->n_layers - 1; l >= 0; l--)
        if (ly->layers[l].w >= 0 && ctx->grads_done)
            ctx->grads_done(ctx->hook_arg, l);
    return 0;
}

int model_evaluate(model *m, const float *params, const float *x, const uint8_t *labels,
                   int64_t n, double *loss, double *accuracy)
{
    if (!m || !params || !x || !labels || !loss || !accuracy || n < 1)
        return -1;
    return m->backend->evaluate(m, params, x, labels, n, loss, accuracy);
}

static int range_ok(const model *m, int first, int last, int batch)
{
    return m && first >= 0 && first <= last && last < m->layout.n_layers && batch >= 1 &&
           batch <= m->max_batch;
}

int model_forward_range(model *m, int first, int last, const float *params, const float *in,
                        int batch, const model_ctx *ctx, float *out)
{
    if (!range_ok(m, first, last, batch) || !params || !in || !out)
        return -1;
    return m->backend->forward_range(m, first, last, params, in, batch, ctx, out);
}

int model_backward_range(model *m, int first, int last, const float *params, const float *dout,
                         int batch, float *din, float *grads)
{
    if (!range_ok(m, first, last, batch) || !params || !dout || !grads)
        return -1;
    return m->backend->backward_range(m, first, last, params, dout, batch, din, grads);
}

int model_adds_gradients(const model_backend *backend)
{
    return backend && backend->backward_range_add != NULL;
}

int model_backward_range_add(model *m, int first, int last, const float *params, const float *dout,
                             int batch, float *din, float *sum, float *scratch)
{
    if (!range_ok(m, first, last, batch) || !params || !dout || !sum)
        return -1;
    if (m->backend->backward_range_add)
        return m->backend->backward_range_add(m, first, last, params, dout, batch, din, sum);
    if (!scratch || m->backend->backward_range(m, first, last, params, dout, batch, din, scratch) != 0)
        return -1;
    const model_layout *ly = &m->layout;
    for (int li = first; li <= last; li++) {
        const model_layer *l = &ly->layers[li];
        const int t[2] = {l->w, l->b};
        for (int k = 0; k < 2; k++) {
            if (t[k] < 0)
                continue;
            const size_t off = ly->tensors[t[k]].offset, n = ly->tensors[t[k]].numel;
            for (size_t i = 0; i < n; i++)
                sum[off + i] += scratch[off + i];
        }
    }
    return 0;
}

int model_loss_head(model *m, const float *logits, const uint8_t *labels, int batch,
                    float *dlogits, double *loss)
{
    if (!m || !logits || !labels || !loss || batch < 1 || batch > m->max_batch)
        return -1;
    return m->backend->loss_head(m, logits, labels, batch, dlogits, loss);
}

void *model_host_alloc(model *m, size_t bytes)
{
    if (m && m->backend->host_alloc)
        return m->backend->host_alloc(m, bytes);
    return calloc(1, bytes ? bytes : 1);
}

void model_host_free(model *m, void *p)
{
    if (!p)
        return;
    if (m && m->backend->host_free)
        m->backend->host_free(m, p);
    else
        free(p);
}

int model_stage_batch(model *m, const float *x, const uint8_t *labels, int batch)
{
    if (!m || !x || !labels || batch < 1 || batch > m->max_batch)
        return -1;
    if (!m->backend->stage_batch)
        return 0; /* nothing to move ahead of time (the CPU computes on x itself) */
    return m->backend->stage_batch(m, x, labels, batch);
}
