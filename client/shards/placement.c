/* placement.c - variables over ps tasks (see placement.h). */
#include "shards/placement.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *place_policy_name(place_policy p) { return p == PLACE_BYTES ? "bytes" : "round_robin"; }

int place_policy_from_name(const char *name, place_policy *out)
{
    if (strcmp(name, "bytes") == 0)
        *out = PLACE_BYTES;
    else if (strcmp(name, "round_robin") == 0)
        *out = PLACE_ROUND_ROBIN;
    else
        return -1;
    return 0;
}

void placement_free(placement *p)
{
    free(p->pieces);
    free(p->bytes);
    memset(p, 0, sizeof(*p));
}

int placement_compute(placement *p, const model_layout *L, int n_ps, place_policy policy,
                      uint64_t partition_bytes, char *err, size_t errlen)
{
    memset(p, 0, sizeof(*p));
    p->policy = policy;
    p->partition_bytes = partition_bytes;
    p->n_ps = n_ps;
    p->pieces = calloc((size_t)L->n_tensors * (size_t)n_ps, sizeof(place_piece));
    p->bytes = calloc((size_t)n_ps, sizeof(uint64_t));
    int *whole = malloc(sizeof(int) * (size_t)L->n_tensors); /* unpartitioned tensors */
    if (!p->pieces || !p->bytes || !whole) {
        free(whole);
        placement_free(p);
        snprintf(err, errlen, "out of memory for the placement");
        return -1;
    }
    int n_whole = 0;
    /* partitioned tensors first: part i on ps i */
    for (int t = 0; t < L->n_tensors; t++) {
        const model_tensor *mt = &L->tensors[t];
        int64_t rows = mt->shape.dims[0];
        uint64_t bytes = (uint64_t)mt->numel * 4;
        int parts = bytes > partition_bytes && n_ps > 1 ? (rows < n_ps ? (int)rows : n_ps) : 1;
        if (parts <= 1) {
            whole[n_whole++] = t;
            continue;
        }
        size_t row_numel = mt->numel / (size_t)rows;
        int64_t q = rows / parts, r = rows % parts, at = 0;
        for (int i = 0; i < parts; i++) {
            place_piece *pc = &p->pieces[p->n++];
            int64_t nrows = q + (i < r ? 1 : 0);
            snprintf(pc->name, sizeof(pc->name), "%s/part_%d", mt->name, i);
            pc->tensor = t;
            pc->ps = i;
            pc->part = i;
            pc->parts = parts;
            pc->shape = mt->shape;
            pc->shape.dims[0] = nrows;
            pc->row0 = at;
            pc->offset = mt->offset + (size_t)at * row_numel;
            pc->numel = (size_t)nrows * row_numel;
            p->bytes[i] += (uint64_t)pc->numel * 4;
            at += nrows;
        }
    }
    /* the others: round-robin in model order, or the greediest balance of bytes */
    if (policy == PLACE_BYTES)
        for (int i = 1; i < n_whole; i++) /* stable insertion sort by size, decreasing */
            for (int j = i; j > 0 && L->tensors[whole[j]].numel > L->tensors[whole[j - 1]].numel; j--) {
                int x = whole[j];
                whole[j] = whole[j - 1];
                whole[j - 1] = x;
            }
    for (int k = 0; k < n_whole; k++) {
        const model_tensor *mt = &L->tensors[whole[k]];
        int ps = k % n_ps;
        if (policy == PLACE_BYTES) {
            ps = 0;
            for (int i = 1; i < n_ps; i++)
                if (p->bytes[i] < p->bytes[ps])
                    ps = i;
        }
        place_piece *pc = &p->pieces[p->n++];
        snprintf(pc->name, sizeof(pc->name), "%s", mt->name);
        pc->tensor = whole[k];
        pc->ps = ps;
        pc->parts = 1;
        pc->shape = mt->shape;
        pc->offset = mt->offset;
        pc->numel = mt->numel;
        p->bytes[ps] += (uint64_t)mt->numel * 4;
    }
    free(whole);
    /* model order: by offset in the buffer */
    for (int i = 1; i < p->n; i++)
        for (int j = i; j > 0 && p->pieces[j].offset < p->pieces[j - 1].offset; j--) {
            place_piece x = p->pieces[j];
            p->pieces[j] = p->pieces[j - 1];
            p->pieces[j - 1] = x;
        }
    return 0;
}

json_t *placement_json(const placement *p, const model_layout *L)
{
    json_t *vars = json_array(), *bytes = json_array();
    for (int i = 0; i < p->n_ps; i++)
        json_array_append_new(bytes, json_integer((json_int_t)p->bytes[i]));
    for (int k = 0; k < p->n;) {
        const model_tensor *mt = &L->tensors[p->pieces[k].tensor];
        json_t *shape = json_array(), *parts = json_array();
        for (int d = 0; d < mt->shape.ndim; d++)
            json_array_append_new(shape, json_integer(mt->shape.dims[d]));
        int t = p->pieces[k].tensor;
        for (; k < p->n && p->pieces[k].tensor == t; k++) {
            const place_piece *pc = &p->pieces[k];
            json_array_append_new(parts, json_pack("{s:s,s:i,s:[I,I]}", "name", pc->name, "ps",
                                                   pc->ps, "rows", (json_int_t)pc->row0,
                                                   (json_int_t)(pc->row0 + pc->shape.dims[0])));
        }
        json_array_append_new(vars, json_pack("{s:s,s:o,s:o}", "name", mt->name, "shape", shape,
                                              "parts", parts));
    }
    char shape_s[64];
    model_shape_format(L->input, shape_s, sizeof(shape_s));
    return json_pack("{s:s,s:s,s:s,s:I,s:i,s:o,s:o}", "model", L->spec, "input_shape", shape_s,
                     "policy", place_policy_name(p->policy),
                     "partition_bytes", (json_int_t)p->partition_bytes, "ps_tasks", p->n_ps,
                     "bytes_per_ps", bytes, "variables", vars);
}
