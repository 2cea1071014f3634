/* mlp.c - the model's layout (names, shapes, offsets in one flat buffer), its
 * initialization, and the front door that dispatches to a backend. Nothing here
 * computes the model: see mlp_cpu.c (and mlp_cuda.cu). */
#include "errmsg.h"
#include "mlp.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"

static void set_tensor(mlp_tensor *t, const char *name, int ndim, int d0, int d1, size_t offset)
{
    memset(t, 0, sizeof(*t));
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->shape.ndim = ndim;
    t->shape.dims[0] = d0;
    if (ndim == 2)
        t->shape.dims[1] = d1;
    t->numel = ndim == 2 ? (size_t)d0 * (size_t)d1 : (size_t)d0;
    t->offset = offset;
}

int mlp_layout_init(mlp_layout *layout, int n_in, const int *hidden, int n_hidden, int n_out,
                    char *err, size_t errlen)
{
    memset(layout, 0, sizeof(*layout));
    if (n_hidden < 0 || n_hidden > MLP_MAX_HIDDEN || (n_hidden > 0 && !hidden))
        return errmsg(err, errlen, "mlp: %d hidden layers (0..%d allowed)", n_hidden, MLP_MAX_HIDDEN);
    if (n_in < 1 || n_in > MLP_MAX_DIM)
        return errmsg(err, errlen, "mlp: %d inputs (1..%d allowed)", n_in, MLP_MAX_DIM);
    if (n_out < 2 || n_out > MLP_MAX_DIM)
        return errmsg(err, errlen, "mlp: %d outputs (2..%d allowed)", n_out, MLP_MAX_DIM);
    for (int i = 0; i < n_hidden; i++)
        if (hidden[i] < 1 || hidden[i] > MLP_MAX_DIM)
            return errmsg(err, errlen, "mlp: hidden layer %d has %d units (1..%d allowed)", i,
                        hidden[i], MLP_MAX_DIM);

    int L = n_hidden + 1;
    layout->n_layers = L;
    layout->dims[0] = n_in;
    for (int i = 0; i < n_hidden; i++)
        layout->dims[i + 1] = hidden[i];
    layout->dims[L] = n_out;

    size_t off = 0;
    for (int l = 0; l < L; l++) {
        char wn[MLP_NAME_MAX], bn[MLP_NAME_MAX];
        if (l == L - 1) {
            snprintf(wn, sizeof(wn), "sm_w");
            snprintf(bn, sizeof(bn), "sm_b");
        } else if (n_hidden == 1) {
            snprintf(wn, sizeof(wn), "hid_w");
            snprintf(bn, sizeof(bn), "hid_b");
        } else {
            snprintf(wn, sizeof(wn), "hid%d_w", l);
            snprintf(bn, sizeof(bn), "hid%d_b", l);
        }
        int fan_in = layout->dims[l], fan_out = layout->dims[l + 1];
        set_tensor(&layout->tensors[2 * l], wn, 2, fan_in, fan_out, off);
        off += layout->tensors[2 * l].numel;
        set_tensor(&layout->tensors[2 * l + 1], bn, 1, fan_out, 0, off);
        off += layout->tensors[2 * l + 1].numel;
        if (off > MLP_MAX_PARAMS)
            return errmsg(err, errlen, "mlp: more than %zu parameters", MLP_MAX_PARAMS);
    }
    layout->n_tensors = 2 * L;
    layout->n_params = off;
    return 0;
}

int mlp_parse_hidden(const char *s, int *hidden, int *n_hidden, char *err, size_t errlen)
{
    *n_hidden = 0;
    if (!s)
        return errmsg(err, errlen, "mlp: no hidden layer list");
    const char *p = s;
    while (*p) {
        if (*n_hidden == MLP_MAX_HIDDEN)
            return errmsg(err, errlen, "mlp: hidden layers \"%s\": more than %d", s, MLP_MAX_HIDDEN);
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 1 || v > MLP_MAX_DIM || (*end && *end != ','))
            return errmsg(err, errlen,
                        "mlp: hidden layers \"%s\": want positive unit counts like \"100\" or \"256,128\"",
                        s);
        hidden[(*n_hidden)++] = (int)v;
        p = end;
        if (*p == ',') {
            p++;
            if (!*p)
                return errmsg(err, errlen, "mlp: hidden layers \"%s\": trailing comma", s);
        }
    }
    return 0;
}

int mlp_layout_find(const mlp_layout *layout, const char *name)
{
    for (int i = 0; i < layout->n_tensors; i++)
        if (strcmp(layout->tensors[i].name, name) == 0)
            return i;
    return -1;
}

void mlp_init_params(const mlp_layout *layout, float *params, uint64_t seed)
{
    for (int i = 0; i < layout->n_tensors; i++) {
        const mlp_tensor *t = &layout->tensors[i];
        float *p = params + t->offset;
        if (t->shape.ndim == 1) { /* bias */
            memset(p, 0, t->numel * sizeof(float));
            continue;
        }
        double stddev = 1.0 / sqrt((double)t->shape.dims[0]);
        uint64_t st = rng_stream(seed, (uint64_t)i);
        for (size_t k = 0; k < t->numel; k++)
            p[k] = (float)(stddev * rng_truncated_normal(&st));
    }
}

mlp *mlp_new(const mlp_backend *backend, const mlp_layout *layout, int max_batch, char *err,
             size_t errlen)
{
    if (!backend || !layout || layout->n_layers < 1) {
        errmsg(err, errlen, "mlp: no backend or no layout");
        return NULL;
    }
    if (max_batch < 1) {
        errmsg(err, errlen, "mlp: max batch %d (must be >= 1)", max_batch);
        return NULL;
    }
    return backend->create(layout, max_batch, err, errlen);
}

void mlp_free(mlp *m)
{
    if (m)
        m->backend->destroy(m);
}

int mlp_forward_backward(mlp *m, const float *params, const float *x, const uint8_t *labels,
                         int batch, float *grads, double *loss)
{
    return m->backend->forward_backward(m, params, x, labels, batch, grads, loss);
}

int mlp_evaluate(mlp *m, const float *params, const float *x, const uint8_t *labels, int64_t n,
                 double *loss, double *accuracy)
{
    return m->backend->evaluate(m, params, x, labels, n, loss, accuracy);
}

void *mlp_host_alloc(mlp *m, size_t bytes)
{
    if (m && m->backend->host_alloc)
        return m->backend->host_alloc(m, bytes);
    return calloc(1, bytes ? bytes : 1);
}

void mlp_host_free(mlp *m, void *p)
{
    if (!p)
        return;
    if (m && m->backend->host_free)
        m->backend->host_free(m, p);
    else
        free(p);
}

int mlp_stage_batch(mlp *m, const float *x, const uint8_t *labels, int batch)
{
    if (!m || !x || !labels || batch < 1 || batch > m->max_batch)
        return -1;
    if (!m->backend->stage_batch)
        return 0; /* nothing to move ahead of time (the CPU computes on x itself) */
    return m->backend->stage_batch(m, x, labels, batch);
}
