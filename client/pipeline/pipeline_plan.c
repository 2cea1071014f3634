/* pipeline_plan.c - the split of the layers into stages and the grid (see
 * pipeline_plan.h). */
#include "pipeline/pipeline_plan.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t pipe_layer_flops(const model_layer *l)
{
    uint64_t in = l->in_numel, out = l->out_numel;
    switch (l->kind) {
    case LAYER_DENSE:
        return 6 * in * out;
    case LAYER_CONV2D:
        return 6 * (uint64_t)l->out.h * (uint64_t)l->out.w * (uint64_t)l->kh * (uint64_t)l->kw *
               (uint64_t)l->in.c * (uint64_t)l->out.c;
    case LAYER_MAXPOOL:
        return 2 * out * (uint64_t)l->kh * (uint64_t)l->kw;
    case LAYER_RELU:
    case LAYER_DROPOUT:
        return 2 * out;
    case LAYER_FLATTEN:
        return 0;
    }
    return 0;
}

uint64_t pipe_layer_cost(const model_layout *L, int i)
{
    const model_layer *l = &L->layers[i];
    int params_below = 0;
    for (int k = 0; k < i; k++)
        params_below |= L->layers[k].w >= 0;
    uint64_t full = pipe_layer_flops(l);
    if (params_below)
        return full;
    switch (l->kind) {
    case LAYER_DENSE:
    case LAYER_CONV2D:
        return full / 6 * 4; /* the forward and the kernel's gradient: no input gradient */
    case LAYER_MAXPOOL:
    case LAYER_RELU:
    case LAYER_DROPOUT:
        return full / 2; /* the forward only: the backward stops above */
    case LAYER_FLATTEN:
        return 0;
    }
    return full;
}

/* The fewest ranges of cost <= bound that layers [from, n) split into, or
 * n + 1 when one layer alone is over it. */
static int parts_needed(const uint64_t *cost, int from, int n, uint64_t bound)
{
    int parts = 0;
    uint64_t run = 0;
    for (int i = from; i < n; i++) {
        if (cost[i] > bound)
            return n + 1;
        if (parts == 0 || run + cost[i] > bound) {
            parts++;
            run = 0;
        }
        run += cost[i];
    }
    return parts;
}

/* Layers [from, n) can make k stages of cost <= bound each. */
static int feasible(const uint64_t *cost, int from, int n, int k, uint64_t bound)
{
    return n - from >= k && parts_needed(cost, from, n, bound) <= k;
}

int pipe_split_balanced(const model_layout *L, int K, pipe_plan *p, char *err, size_t errlen)
{
    const int n = L->n_layers;
    if (K < PIPE_MIN_STAGES || K > PIPE_MAX_STAGES) {
        snprintf(err, errlen, "%d stages: must be %d to %d", K, PIPE_MIN_STAGES, PIPE_MAX_STAGES);
        return -1;
    }
    if (K > n) {
        snprintf(err, errlen, "%d stages but the model %s has %d layers: at most one stage per layer",
                 K, L->spec, n);
        return -1;
    }
    uint64_t cost[MODEL_MAX_LAYERS], total = 0;
    for (int i = 0; i < n; i++)
        total += cost[i] = pipe_layer_cost(L, i);
    /* the smallest bound that K stages can meet: bisection over integers */
    uint64_t lo = 0, hi = total;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (feasible(cost, 0, n, K, mid))
            hi = mid;
        else
            lo = mid + 1;
    }
    memset(p, 0, sizeof(*p));
    p->stages = K;
    int at = 0;
    for (int s = 0; s < K; s++) {
        /* the longest range from `at` within the bound that leaves a feasible rest */
        int end = at; /* exclusive */
        uint64_t run = 0;
        if (s == K - 1) {
            end = n;
            for (int i = at; i < n; i++)
                run += cost[i];
        } else {
            /* feasibility of the rest is not monotone in where this range
             * ends (a rest of fewer layers needs fewer stages within the
             * bound but may lack layers): try every end within the bound */
            uint64_t acc = 0;
            for (int e = at; e < n && acc + cost[e] <= lo; e++) {
                acc += cost[e];
                if (feasible(cost, e + 1, n, K - s - 1, lo)) {
                    end = e + 1;
                    run = acc;
                }
            }
            if (end == at) { /* cannot happen when the bound is feasible; one layer at least */
                run = cost[at];
                end = at + 1;
            }
        }
        p->first[s] = at;
        p->last[s] = end - 1;
        p->cost[s] = run;
        at = end;
    }
    return 0;
}

/* A non-negative decimal integer at *s (advanced past it); -1 when none. */
static long parse_index(const char **s)
{
    const char *q = *s;
    if (*q < '0' || *q > '9')
        return -1;
    errno = 0;
    char *end;
    long v = strtol(q, &end, 10);
    if (errno || v > 1000000)
        return -1;
    *s = end;
    return v;
}

int pipe_split_parse(const model_layout *L, const char *s, int K, pipe_plan *p, char *err,
                     size_t errlen)
{
    const int n = L->n_layers;
    memset(p, 0, sizeof(*p));
    int k = 0, expect = 0;
    const char *q = s;
    if (!*q) {
        snprintf(err, errlen, "is empty");
        return -1;
    }
    for (;;) {
        const char *part = q;
        long a = parse_index(&q), b = a;
        if (a >= 0 && *q == '-') {
            q++;
            b = parse_index(&q);
        }
        size_t plen = strcspn(part, ",");
        if (a < 0 || b < 0 || (*q && *q != ',')) {
            snprintf(err, errlen, "'%.*s' is not a layer range FIRST-LAST", (int)(plen > 40 ? 40 : plen), part);
            return -1;
        }
        if (k == PIPE_MAX_STAGES || k == K) {
            snprintf(err, errlen, "has more than %d ranges: one per stage (--pipeline_stages=%d)",
                     k, K);
            return -1;
        }
        if (b < a) {
            snprintf(err, errlen, "'%.*s' ends before it starts", (int)plen, part);
            return -1;
        }
        if (a != expect) {
            snprintf(err, errlen, "'%.*s' starts at layer %ld, not %d: the ranges must follow each other from layer 0",
                     (int)plen, part, a, expect);
            return -1;
        }
        if (b >= n) {
            snprintf(err, errlen, "'%.*s' goes past the last layer, %d, of the model %s", (int)plen,
                     part, n - 1, L->spec);
            return -1;
        }
        p->first[k] = (int)a;
        p->last[k] = (int)b;
        for (long i = a; i <= b; i++)
            p->cost[k] += pipe_layer_cost(L, (int)i);
        k++;
        expect = (int)b + 1;
        if (!*q)
            break;
        q++; /* the comma */
    }
    if (k != K) {
        snprintf(err, errlen, "has %d ranges, --pipeline_stages=%d wants %d", k, K, K);
        return -1;
    }
    if (expect != n) {
        snprintf(err, errlen, "ends at layer %d: the last stage must end at the model's last layer, %d",
                 expect - 1, n - 1);
        return -1;
    }
    p->stages = K;
    return 0;
}

void pipe_plan_format(const pipe_plan *p, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = 0;
    for (int s = 0; s < p->stages && at < len; s++) {
        int w = snprintf(buf + at, len - at, "%s%d-%d", s ? "," : "", p->first[s], p->last[s]);
        if (w < 0)
            break;
        at += (size_t)w;
    }
}

void pipe_stage_params(const model_layout *L, const pipe_plan *p, int s, size_t *offset,
                       size_t *numel)
{
    size_t lo = 0, hi = 0;
    int any = 0;
    for (int k = 0; k < L->n_tensors; k++) {
        const model_tensor *t = &L->tensors[k];
        if (t->layer < p->first[s] || t->layer > p->last[s])
            continue;
        if (!any || t->offset < lo)
            lo = t->offset;
        if (!any || t->offset + t->numel > hi)
            hi = t->offset + t->numel;
        any = 1;
    }
    if (!any) { /* no parameters (a relu, a pool): an empty run where the next one starts */
        lo = hi = L->n_params;
        for (int k = 0; k < L->n_tensors; k++)
            if (L->tensors[k].layer > p->last[s]) {
                lo = hi = L->tensors[k].offset;
                break;
            }
    }
    *offset = lo;
    *numel = hi - lo;
}

int pipe_grid_place(int n_tasks, int K, int task, pipe_grid *g, char *err, size_t errlen)
{
    if (K < 1 || n_tasks % K != 0 || n_tasks < K) {
        snprintf(err, errlen, "%d training tasks do not make whole pipelines of %d stages: "
                              "the chief and workers must number K x R (stages x replicas)",
                 n_tasks, K);
        return -1;
    }
    if (task < 0 || task >= n_tasks) {
        snprintf(err, errlen, "task %d is not one of the %d training tasks", task, n_tasks);
        return -1;
    }
    g->stages = K;
    g->replicas = n_tasks / K;
    g->stage = task % K;
    g->replica = task / K;
    return 0;
}
