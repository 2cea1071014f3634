/* embed_bag.c - the embedding bag on the CPU (model.h: bag_forward,
 * bag_backward), the reference of the CUDA mirror, and the front door's
 * checks of both. */
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

int model_cpu_bag_forward(model *m, const float *rows, int64_t n_rows, int dim, const int32_t *idx,
                          const int64_t *off, int batch, int mean, float *out)
{
    (void)m;
    (void)n_rows;
    const size_t D = (size_t)dim;
    for (int b = 0; b < batch; b++) {
        float *o = out + (size_t)b * D;
        memset(o, 0, sizeof(float) * D);
        for (int64_t j = off[b]; j < off[b + 1]; j++) {
            const float *r = rows + (size_t)idx[j] * D;
            for (size_t k = 0; k < D; k++)
                o[k] += r[k];
        }
        int64_t cnt = off[b + 1] - off[b];
        if (mean && cnt > 0) {
            const float inv = 1.0f / (float)cnt;
            for (size_t k = 0; k < D; k++)
                o[k] *= inv;
        }
    }
    return 0;
}

int model_cpu_bag_backward(model *m, const float *dout, int64_t n_rows, int dim, const int32_t *idx,
                           const int64_t *off, int batch, int mean, float *drows)
{
    (void)m;
    const size_t D = (size_t)dim;
    memset(drows, 0, sizeof(float) * D * (size_t)n_rows);
    for (int b = 0; b < batch; b++) {
        int64_t cnt = off[b + 1] - off[b];
        const float s = mean && cnt > 0 ? 1.0f / (float)cnt : 1.0f;
        const float *g = dout + (size_t)b * D;
        for (int64_t j = off[b]; j < off[b + 1]; j++) {
            float *d = drows + (size_t)idx[j] * D;
            for (size_t k = 0; k < D; k++)
                d[k] += g[k] * s;
        }
    }
    return 0;
}

static int bag_args_ok(const model *m, int64_t n_rows, int dim, const int32_t *idx, const int64_t *off,
                       int batch)
{
    if (!m || !idx || !off || dim < 1 || n_rows < 0 || batch < 1 || off[0] != 0)
        return 0;
    for (int b = 0; b < batch; b++)
        if (off[b + 1] < off[b])
            return 0;
    for (int64_t j = 0; j < off[batch]; j++)
        if (idx[j] < 0 || idx[j] >= n_rows)
            return 0;
    return 1;
}

int model_bag_forward(model *m, const float *rows, int64_t n_rows, int dim, const int32_t *idx,
                      const int64_t *off, int batch, int mean, float *out)
{
    if (!bag_args_ok(m, n_rows, dim, idx, off, batch) || !out || (n_rows && !rows) || !m->backend->bag_forward)
        return -1;
    return m->backend->bag_forward(m, rows, n_rows, dim, idx, off, batch, mean, out);
}

int model_bag_backward(model *m, const float *dout, int64_t n_rows, int dim, const int32_t *idx,
                       const int64_t *off, int batch, int mean, float *drows)
{
    if (!bag_args_ok(m, n_rows, dim, idx, off, batch) || !dout || (n_rows && !drows) ||
        !m->backend->bag_backward)
        return -1;
    return m->backend->bag_backward(m, dout, n_rows, dim, idx, off, batch, mean, drows);
}
