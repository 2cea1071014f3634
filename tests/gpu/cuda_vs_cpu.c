/* cuda_vs_cpu.c - the CUDA backend (model_cuda.cu) against the CPU reference
 * (model_cpu.c) on fresh random inputs, through model.h:
 *  1. every layer type alone (forward_range/backward_range of one layer):
 *     dense, conv2d (same and valid, strides 1-3, odd and even kernels,
 *     TensorFlow's uneven 'same' padding), maxpool (same and valid,
 *     overlapping windows, windows that skip inputs, exact ties: the first
 *     maximum wins), relu, dropout, flatten: the outputs, the input gradient
 *     and the layer's parameter gradients; the other gradient tensors must be
 *     left as they were;
 *  2. the dropout masks: equal bit for bit to the CPU's and to dropout_mask.h
 *     computed here, for an example array and for example0, and none at
 *     inference;
 *  3. whole small CNNs and the full `cnn` step (batch 100, dropout on): the
 *     loss and every gradient of forward_backward; forward_range(0, L-1) +
 *     loss_head + backward_range(0, L-1) with the input gradient; the range
 *     interface on a split (layers 0..k-1 on one instance, k..L-1 on
 *     another, as model parallelism runs them) equal to the whole step;
 *     evaluate's loss and accuracy in uneven chunks;
 *  4. MLPs (mlp:, mlp:100, mlp:1024,1024, ...), a small CNN and the cnn with
 *     the buffers from malloc and from model_host_alloc (pinned: direct DMA,
 *     the parameters uploaded layer by layer; checked zeroed and
 *     page-locked), and the staged batches of model_stage_batch (used,
 *     replaced, refilled, of another size, ended by evaluate);
 *  5. bad arguments (a label >= n_classes, a backward that pairs with no
 *     forward) refused as the CPU refuses them.
 * Every output buffer is poisoned with NaN before each call, so an element
 * the backend does not write shows. Error of a tensor: max |cuda - cpu| /
 * max |cpu| (the max-norm relative error); the limit is 1e-4 (TF32 off).
 *
 * Whole models get "exact" inputs: pixels k/4, weights ±1/16 or 0 (mostly
 * 0), biases j/16: every pre-activation is then a sum that FP32 holds exactly
 * whatever the summation order, so the CPU and the GPU agree bit for bit on
 * which ReLUs are on and which input is a pool's maximum (with continuous
 * inputs a pre-activation within rounding of 0 may be on for one and off for
 * the other: a real but irrelevant disagreement that would make the check
 * flaky). Single layers get continuous inputs (and maxpool exact ones too).
 *
 * Output: one PASS or FAIL line per check, then "cuda_vs_cpu: N passed, M
 * failed" and "all agree" or "FAILED".
 *   cuda_vs_cpu [--seed=N]   exit 0 all agree, 1 a mismatch or a CUDA failure,
 *                            77 no CUDA device (skipped; the reason on stdout)
 *   cuda_vs_cpu --probe      exit 0 when a device is visible, else 77 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "model/blas_kernel.h"
#include "model/dropout_mask.h"
#include "model/model.h"
#include "rng.h"

#define LIMIT 1e-4

static int failures, passes;
static const model_shape IMG = {28, 28, 1};

static double rel_err(const float *got, const float *want, size_t n, long *nan_at)
{
    double num = 0, den = 0;
    *nan_at = -1;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(want[i])) {
            *nan_at = (long)i;
            return INFINITY;
        }
        double d = fabs((double)got[i] - (double)want[i]);
        num = d > num ? d : num;
        den = fabs((double)want[i]) > den ? fabs((double)want[i]) : den;
    }
    return den > 0 ? num / den : num;
}

static void poison(float *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = NAN;
}

static void result(int ok, const char *what, const char *detail)
{
    if (ok)
        passes++;
    else
        failures++;
    printf("%s %-58s %s\n", ok ? "PASS" : "FAIL", what, detail);
}

/* one tensor (or any float vector) against the CPU's */
static void check(const char *what, const char *name, const float *got, const float *want, size_t n)
{
    char w[320], d[128];
    long nan_at;
    double e = rel_err(got, want, n, &nan_at);
    snprintf(w, sizeof(w), "%s: %s", what, name);
    if (nan_at >= 0)
        snprintf(d, sizeof(d), "element %ld is not finite (cuda %g, cpu %g): unwritten?", nan_at,
                 (double)got[nan_at], (double)want[nan_at]);
    else
        snprintf(d, sizeof(d), "rel err %.2e (%zu floats)", e, n);
    result(e <= LIMIT, w, d);
}

static void check_loss(const char *what, const char *name, double got, double want)
{
    float g = (float)got, c = (float)want;
    check(what, name, &g, &c, 1);
}

static void check_rc(const char *what, int rc_cpu, int rc_gpu)
{
    if (rc_cpu == 0 && rc_gpu == 0)
        return;
    char d[96];
    snprintf(d, sizeof(d), "returned cpu %d, cuda %d", rc_cpu, rc_gpu);
    result(0, what, d);
}

/* the tensors of layers first..last: [lo, hi) floats; 0 when none */
static int range_tensors(const model_layout *ly, int first, int last, size_t *lo, size_t *hi)
{
    int any = 0;
    for (int li = first; li <= last; li++) {
        const model_layer *l = &ly->layers[li];
        if (l->w < 0)
            continue;
        if (!any)
            *lo = ly->tensors[l->w].offset;
        *hi = ly->tensors[l->b].offset + ly->tensors[l->b].numel;
        any = 1;
    }
    return any;
}

/* every gradient tensor of layers first..last against the CPU's; the others
 * must still hold the poison on the GPU's side */
static void check_grads(const char *what, const model_layout *ly, int first, int last, const float *g_gpu,
                        const float *g_cpu)
{
    size_t lo = 0, hi = 0;
    int any = range_tensors(ly, first, last, &lo, &hi);
    for (int i = 0; i < ly->n_tensors; i++) {
        const model_tensor *t = &ly->tensors[i];
        if (any && t->offset >= lo && t->offset < hi) {
            char n[64];
            snprintf(n, sizeof(n), "grad.%s", t->name);
            check(what, n, g_gpu + t->offset, g_cpu + t->offset, t->numel);
        } else {
            size_t touched = 0;
            for (size_t k = 0; k < t->numel; k++)
                touched += !isnan(g_gpu[t->offset + k]);
            if (touched) {
                char w[320], d[96];
                snprintf(w, sizeof(w), "%s: grad.%s outside the range", what, t->name);
                snprintf(d, sizeof(d), "%zu of %zu floats overwritten", touched, t->numel);
                result(0, w, d);
            }
        }
    }
}

/* ---- inputs ---- */

static float cont(uint64_t *st) /* continuous in [-1, 1) */
{
    return (float)(2.0 * rng_uniform_open0(st) - 1.0);
}

/* exact parameters (see the top), or the initialization with random biases
 * (exact 0) */
static void fill_params(const model_layout *ly, float *p, uint64_t *st, uint64_t seed, int exact)
{
    model_init_params(ly, p, seed);
    for (int i = 0; i < ly->n_tensors; i++) {
        const model_tensor *t = &ly->tensors[i];
        for (size_t k = 0; k < t->numel; k++) {
            float *v = &p[t->offset + k];
            if (exact && t->fan_in) /* a kernel: 0 with probability 1/2, else ±1/16 */
                *v = rng_below(st, 2) ? 0.0f : (rng_below(st, 2) ? 1.0f : -1.0f) / 16.0f;
            else if (exact)
                *v = (float)((int)rng_below(st, 5) - 2) / 16.0f;
            else if (!t->fan_in) /* non-zero biases, so the bias paths show */
                *v = (float)(0.1 * rng_normal(st));
        }
    }
}

static void fill_x(float *x, size_t n, uint64_t *st, int exact)
{
    for (size_t k = 0; k < n; k++)
        x[k] = exact ? (float)rng_below(st, 5) / 4.0f : (rng_below(st, 4) == 0 ? 0.0f : (float)rng_uniform_open0(st));
}

static void fill_labels(uint8_t *y, size_t n, uint64_t *st, int classes)
{
    for (size_t k = 0; k < n; k++)
        y[k] = (uint8_t)rng_below(st, (uint64_t)classes);
}

/* ---- buffers ---- */

/* Where the CUDA backend's buffers come from. */
enum { PLAIN, PINNED, MIXED };
static const char *const mode_name[] = {"malloc", "pinned", "mixed"};

/* bytes from model_host_alloc(m) when pinned, else malloc; NULL with a FAIL
 * line when model_host_alloc's memory is not zeroed or not page-locked */
static void *buf_alloc(model *m, int pinned, size_t bytes, const char *what)
{
    if (!pinned)
        return malloc(bytes ? bytes : 1);
    unsigned char *p = model_host_alloc(m, bytes);
    if (!p)
        return NULL;
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; i++)
        nonzero += p[i] != 0;
    struct cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    int locked = e == cudaSuccess && a.type == cudaMemoryTypeHost;
    if (nonzero || !locked) {
        char d[160];
        snprintf(d, sizeof(d), "model_host_alloc(%zu): %zu bytes not zero, %s", bytes, nonzero,
                 locked ? "page-locked" : e != cudaSuccess ? cudaGetErrorString(e) : "NOT page-locked");
        (void)cudaGetLastError();
        result(0, what, d);
        model_host_free(m, p);
        return NULL;
    }
    return p;
}

static void buf_free(model *m, int pinned, void *p)
{
    if (pinned)
        model_host_free(m, p);
    else
        free(p);
}

static int layout_or_fail(model_layout *ly, const char *spec, model_shape in)
{
    char err[512];
    if (model_layout_init(ly, spec, in, 10, err, sizeof(err)) == 0)
        return 0;
    result(0, spec, err);
    return -1;
}

/* a CPU and a CUDA instance of ly; 0, or -1 with a FAIL line */
static int pair_new(const model_layout *ly, int mb, model **mc, model **mg, const char *what)
{
    char err[512];
    *mc = model_new(&model_backend_cpu, ly, mb, err, sizeof(err));
    *mg = *mc ? model_new(&model_backend_cuda, ly, mb, err, sizeof(err)) : NULL;
    if (*mc && *mg)
        return 0;
    result(0, what, err);
    model_free(*mc);
    *mc = NULL;
    return -1;
}

/* ---- 1. every layer alone ---- */

/* Layer li of ly alone, batch B of max_batch mb: forward_range(li, li) and
 * backward_range(li, li) with din, on continuous inputs (exact = 1: k/4). */
static void layer_check(const model_layout *ly, const char *spec, int li, int B, int mb, uint64_t seed,
                        int exact)
{
    const model_layer *l = &ly->layers[li];
    char what[192];
    snprintf(what, sizeof(what), "%s layer %d %s%s", spec, li, model_layer_kind_name(l->kind),
             exact ? " (exact, ties)" : "");
    model *mc, *mg;
    if (pair_new(ly, mb, &mc, &mg, what) != 0)
        return;
    const size_t P = ly->n_params, nin = (size_t)B * l->in_numel, nout = (size_t)B * l->out_numel;
    float *params = malloc(P * sizeof(float)), *x = malloc(nin * sizeof(float));
    float *yc = malloc(nout * sizeof(float)), *yg = malloc(nout * sizeof(float));
    float *dy = malloc(nout * sizeof(float));
    float *dxc = malloc(nin * sizeof(float)), *dxg = malloc(nin * sizeof(float));
    float *gc = malloc(P * sizeof(float)), *gg = malloc(P * sizeof(float));
    uint64_t st = rng_stream(seed, 100 + (uint64_t)li);
    int64_t ex[64];
    for (int i = 0; i < B && i < 64; i++)
        ex[i] = (int64_t)rng_below(&st, 60000);
    const model_ctx ctx = {.seed = seed, .step = 77, .example = ex};
    fill_params(ly, params, &st, seed, 0);
    for (size_t k = 0; k < nin; k++)
        x[k] = exact ? (float)rng_below(&st, 3) / 4.0f : cont(&st);
    for (size_t k = 0; k < nout; k++)
        dy[k] = cont(&st);
    poison(yc, nout);
    poison(yg, nout);
    int rc = model_forward_range(mc, li, li, params, x, B, &ctx, yc);
    int rg = model_forward_range(mg, li, li, params, x, B, &ctx, yg);
    check_rc(what, rc, rg);
    if (rc == 0 && rg == 0) {
        check(what, "output", yg, yc, nout);
        poison(dxc, nin);
        poison(dxg, nin);
        poison(gc, P);
        poison(gg, P);
        rc = model_backward_range(mc, li, li, params, dy, B, dxc, gc);
        rg = model_backward_range(mg, li, li, params, dy, B, dxg, gg);
        check_rc(what, rc, rg);
        if (rc == 0 && rg == 0) {
            check(what, "input gradient", dxg, dxc, nin);
            check_grads(what, ly, li, li, gg, gc);
        }
    }
    free(params);
    free(x);
    free(yc);
    free(yg);
    free(dy);
    free(dxc);
    free(dxg);
    free(gc);
    free(gg);
    model_free(mc);
    model_free(mg);
}

static void layers(uint64_t seed)
{
    static const struct {
        const char *spec;
        model_shape in;
    } cases[] = {
        /* conv same stride 1 (pads 1, 1), pool 2/2 same on odd sides (pad after only) */
        {"conv:3x3x4,pool:2,dense:10", {9, 11, 3}},
        /* conv valid stride 2, pool 3/1 same (overlapping windows), dropout 0.5 */
        {"conv:5x5x6/2:valid,pool:3/1,dense:7,dropout:0.5,dense:10", {13, 12, 2}},
        /* even kernel, stride 3 same (pad_total 3: 1 before, 2 after), pool 2/3 valid (skips inputs) */
        {"conv:4x4x3/3,pool:2/3:valid,dense:10", {10, 11, 2}},
        /* even kernel same stride 1 (pad 0 before, 1 after), then stride 2 same, dropout on the input */
        {"dropout:0.3,conv:2x2x5,conv:3x3x3/2,pool:2,dense:16,dense:10", {8, 7, 4}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        model_layout ly;
        if (layout_or_fail(&ly, cases[i].spec, cases[i].in) != 0)
            continue;
        for (int li = 0; li < ly.n_layers; li++) {
            layer_check(&ly, cases[i].spec, li, 3, 4, seed + i, 0);
            if (ly.layers[li].kind == LAYER_MAXPOOL || ly.layers[li].kind == LAYER_RELU)
                layer_check(&ly, cases[i].spec, li, 3, 4, seed + i, 1);
        }
    }
    /* the tutorial's layers at their sizes, batch 7 */
    model_layout ly;
    if (layout_or_fail(&ly, "cnn", IMG) == 0)
        for (int li = 0; li < ly.n_layers; li++)
            layer_check(&ly, "cnn", li, 7, 8, seed + 50, 0);
}

/* ---- 2. the dropout masks ---- */

static void masks(uint64_t seed)
{
    const char *spec = "dropout:0.3,dense:10";
    const model_shape in = {5, 6, 7};
    const int B = 9;
    model_layout ly;
    if (layout_or_fail(&ly, spec, in) != 0)
        return;
    model *mc, *mg;
    if (pair_new(&ly, B, &mc, &mg, "dropout masks") != 0)
        return;
    const model_layer *l = &ly.layers[0];
    const size_t n = l->in_numel, N = (size_t)B * n;
    float *params = calloc(ly.n_params, sizeof(float)), *x = malloc(N * sizeof(float));
    float *yc = malloc(N * sizeof(float)), *yg = malloc(N * sizeof(float));
    for (size_t k = 0; k < N; k++)
        x[k] = 1.0f;
    int64_t ex[9] = {0, 1, 59999, 5, 1000000007LL, 3, 4, INT64_MAX, 12};
    const model_ctx ctxs[3] = {
        {.seed = seed | (1ULL << 63), .step = 12345, .example = ex}, /* an example array, a seed above 2^63 */
        {.seed = seed, .example0 = 400},         /* example0 + i */
        {.seed = seed, .step = 3, .example = ex, .inference = 1}, /* inference: no dropout */
    };
    const char *names[3] = {"dropout masks, example array", "dropout masks, example0", "dropout at inference"};
    for (int k = 0; k < 3; k++) {
        poison(yc, N);
        poison(yg, N);
        int rc = model_forward_range(mc, 0, 0, params, x, B, &ctxs[k], yc);
        int rg = model_forward_range(mg, 0, 0, params, x, B, &ctxs[k], yg);
        check_rc(names[k], rc, rg);
        if (rc || rg)
            continue;
        size_t differ = 0, wrong = 0, kept = 0;
        for (int i = 0; i < B; i++)
            for (size_t u = 0; u < n; u++) {
                const size_t j = (size_t)i * n + u;
                int keep = ctxs[k].inference ||
                           dropout_keep_unit(ctxs[k].seed, ctxs[k].step, model_ctx_example(&ctxs[k], i), 0,
                                             u, l->rate);
                float want = ctxs[k].inference ? 1.0f : keep ? 1.0f * l->scale : 0.0f;
                differ += memcmp(&yg[j], &yc[j], sizeof(float)) != 0;
                wrong += memcmp(&yg[j], &want, sizeof(float)) != 0;
                kept += keep;
            }
        char d[160];
        snprintf(d, sizeof(d), "%zu of %zu units differ from the CPU, %zu from dropout_mask.h; kept %.3f",
                 differ, N, wrong, (double)kept / N);
        /* kept: a fraction near 0.7 (n = 1890: 5 sigma is 0.053) */
        int ok = differ == 0 && wrong == 0 &&
                 (ctxs[k].inference ? kept == N : fabs((double)kept / N - 0.7) < 0.06);
        result(ok, names[k], d);
    }
    free(params);
    free(x);
    free(yc);
    free(yg);
    model_free(mc);
    model_free(mg);
}

/* ---- 3. whole models ---- */

/* forward_backward, the whole range with din, a split at every k in splits,
 * and evaluate over n_eval examples; batch B of max_batch mb, exact inputs. */
static void whole(const char *spec, model_shape in, int B, int mb, int n_eval, const int *splits,
                  int n_splits, uint64_t seed)
{
    model_layout ly;
    if (layout_or_fail(&ly, spec, in) != 0)
        return;
    char what[192];
    model *mc, *mg;
    if (pair_new(&ly, mb, &mc, &mg, spec) != 0)
        return;
    const int L = ly.n_layers, C = ly.n_classes;
    const size_t P = ly.n_params, D = ly.n_in;
    const int64_t nx = n_eval > B ? n_eval : B;
    float *params = malloc(P * sizeof(float)), *x = malloc((size_t)nx * D * sizeof(float));
    uint8_t *y = malloc((size_t)nx);
    float *gc = malloc(P * sizeof(float)), *gg = malloc(P * sizeof(float)), *gw = malloc(P * sizeof(float));
    float *zc = malloc((size_t)B * C * sizeof(float)), *zg = malloc((size_t)B * C * sizeof(float));
    float *dzc = malloc((size_t)B * C * sizeof(float)), *dzg = malloc((size_t)B * C * sizeof(float));
    float *dxc = malloc((size_t)B * D * sizeof(float)), *dxg = malloc((size_t)B * D * sizeof(float));
    float *mid = malloc((size_t)B * ly.max_act * sizeof(float));
    float *dmid = malloc((size_t)B * ly.max_act * sizeof(float));
    uint64_t st = rng_stream(seed, 3000);
    fill_params(&ly, params, &st, seed, 1);
    fill_x(x, (size_t)nx * D, &st, 1);
    fill_labels(y, (size_t)nx, &st, C);
    const model_ctx ctx = {.seed = seed, .step = 41, .example0 = 1234};

    /* forward_backward */
    double lc = NAN, lg = NAN;
    poison(gc, P);
    poison(gg, P);
    snprintf(what, sizeof(what), "%s batch %d of %d, forward_backward", spec, B, mb);
    int rc = model_forward_backward(mc, params, x, y, B, &ctx, gc, &lc);
    int rg = model_forward_backward(mg, params, x, y, B, &ctx, gg, &lg);
    check_rc(what, rc, rg);
    if (rc == 0 && rg == 0) {
        check_loss(what, "loss", lg, lc);
        check_grads(what, &ly, 0, L - 1, gg, gc);
    }
    memcpy(gw, gg, P * sizeof(float)); /* the GPU's whole step, for the split */

    /* the whole range with the input gradient */
    snprintf(what, sizeof(what), "%s batch %d, ranges 0..%d + loss_head", spec, B, L - 1);
    poison(zc, (size_t)B * C);
    poison(zg, (size_t)B * C);
    rc = model_forward_range(mc, 0, L - 1, params, x, B, &ctx, zc);
    rg = model_forward_range(mg, 0, L - 1, params, x, B, &ctx, zg);
    check_rc(what, rc, rg);
    if (rc == 0 && rg == 0) {
        check(what, "logits", zg, zc, (size_t)B * C);
        poison(dzc, (size_t)B * C);
        poison(dzg, (size_t)B * C);
        rc = model_loss_head(mc, zc, y, B, dzc, &lc);
        rg = model_loss_head(mg, zc, y, B, dzg, &lg); /* the same logits: the head alone */
        check_rc(what, rc, rg);
        check_loss(what, "loss_head loss", lg, lc);
        check(what, "loss_head dlogits", dzg, dzc, (size_t)B * C);
        poison(gc, P);
        poison(gg, P);
        poison(dxc, (size_t)B * D);
        poison(dxg, (size_t)B * D);
        rc = model_backward_range(mc, 0, L - 1, params, dzc, B, dxc, gc);
        rg = model_backward_range(mg, 0, L - 1, params, dzc, B, dxg, gg);
        check_rc(what, rc, rg);
        if (rc == 0 && rg == 0) {
            check(what, "input gradient", dxg, dxc, (size_t)B * D);
            check_grads(what, &ly, 0, L - 1, gg, gc);
        }
        /* a backward that pairs with no forward: refused by both */
        rc = model_backward_range(mc, 0, L - 2, params, dzc, B, NULL, gc);
        rg = model_backward_range(mg, 0, L - 2, params, dzc, B, NULL, gg);
        result(rc < 0 && rg < 0, what, rc < 0 && rg < 0 ? "an unpaired backward_range refused"
                                                         : "an unpaired backward_range was accepted");
    }

    /* splits: layers 0..k-1 on instance a, k..L-1 on instance b, on the GPU,
     * against the GPU's whole step and the CPU's */
    for (int s = 0; s < n_splits; s++) {
        const int k = splits[s];
        char err[512];
        snprintf(what, sizeof(what), "%s batch %d, split 0..%d | %d..%d", spec, B, k - 1, k, L - 1);
        model *a = model_new(&model_backend_cuda, &ly, mb, err, sizeof(err));
        model *b = a ? model_new(&model_backend_cuda, &ly, mb, err, sizeof(err)) : NULL;
        if (!a || !b) {
            result(0, what, err);
            model_free(a);
            continue;
        }
        const size_t nmid = (size_t)B * ly.layers[k].in_numel;
        double ls = NAN;
        poison(gg, P);
        poison(mid, nmid);
        poison(zg, (size_t)B * C);
        int r = model_forward_range(a, 0, k - 1, params, x, B, &ctx, mid);
        r |= model_forward_range(b, k, L - 1, params, mid, B, &ctx, zg);
        r |= model_loss_head(b, zg, y, B, dzg, &ls);
        r |= model_backward_range(b, k, L - 1, params, dzg, B, dmid, gg);
        r |= model_backward_range(a, 0, k - 1, params, dmid, B, NULL, gg);
        if (r != 0) {
            result(0, what, "a range call failed (see stderr)");
        } else {
            check_loss(what, "loss vs the CPU's step", ls, lc);
            float *cpu_whole = gc; /* the CPU's whole-range gradients, from above */
            check_grads(what, &ly, 0, L - 1, gg, cpu_whole);
            long nan_at;
            double e = rel_err(gg, gw, P, &nan_at);
            char d[96];
            snprintf(d, sizeof(d), "rel err %.2e against the GPU's forward_backward", e);
            result(e <= LIMIT, what, d);
        }
        model_free(a);
        model_free(b);
    }

    /* evaluate in uneven chunks of mb, no dropout */
    double elc = NAN, eac = NAN, elg = NAN, eag = NAN;
    snprintf(what, sizeof(what), "%s evaluate %d in chunks of %d", spec, n_eval, mb);
    rc = model_evaluate(mc, params, x, y, n_eval, &elc, &eac);
    rg = model_evaluate(mg, params, x, y, n_eval, &elg, &eag);
    check_rc(what, rc, rg);
    if (rc == 0 && rg == 0) {
        check_loss(what, "loss", elg, elc);
        char d[96];
        snprintf(d, sizeof(d), "accuracy cpu %.6f cuda %.6f", eac, eag);
        result(eac == eag, what, d); /* exact logits: the same argmax */
    }
    /* bad labels: refused */
    y[0] = (uint8_t)C;
    rc = model_forward_backward(mg, params, x, y, B, &ctx, gg, &lg);
    rg = model_evaluate(mg, params, x, y, n_eval, &elg, &eag);
    int rh = model_loss_head(mg, zc, y, B, NULL, &lg);
    result(rc < 0 && rg < 0 && rh < 0, what,
           rc < 0 && rg < 0 && rh < 0 ? "a label >= n_classes refused" : "a label >= n_classes ACCEPTED");
    free(params);
    free(x);
    free(y);
    free(gc);
    free(gg);
    free(gw);
    free(zc);
    free(zg);
    free(dzc);
    free(dzg);
    free(dxc);
    free(dxg);
    free(mid);
    free(dmid);
    model_free(mc);
    model_free(mg);
}

/* ---- 4. MLPs, buffer modes, staging ---- */

/* One CUDA step against the CPU's on the same inputs: the loss and every
 * gradient (the worst of them as one line). */
static void step_check(model *mc, model *mg, const model_layout *ly, const float *params, const float *x,
                       const uint8_t *y, int B, float *gc, float *gg, const char *what, const char *step)
{
    const size_t P = ly->n_params;
    double lc = NAN, lg = NAN;
    char w[320], d[128];
    snprintf(w, sizeof(w), "%s: %s", what, step);
    poison(gc, P);
    poison(gg, P);
    int rc = model_forward_backward(mc, params, x, y, B, NULL, gc, &lc);
    int rg = model_forward_backward(mg, params, x, y, B, NULL, gg, &lg);
    if (rc != 0 || rg != 0) {
        snprintf(d, sizeof(d), "forward_backward returned cpu %d, cuda %d", rc, rg);
        result(0, w, d);
        return;
    }
    float fc = (float)lc, fg = (float)lg;
    long nan_at;
    double worst = rel_err(&fg, &fc, 1, &nan_at);
    for (int i = 0; i < ly->n_tensors && nan_at < 0; i++) {
        const model_tensor *t = &ly->tensors[i];
        double e = rel_err(gg + t->offset, gc + t->offset, t->numel, &nan_at);
        worst = e > worst ? e : worst;
    }
    if (nan_at >= 0)
        snprintf(d, sizeof(d), "a gradient is not finite (unwritten?)");
    else
        snprintf(d, sizeof(d), "rel err %.2e (loss and every gradient)", worst);
    result(nan_at < 0 && worst <= LIMIT, w, d);
}

static void modes(const char *spec, int mb, int B, int n_eval, uint64_t seed, int mode)
{
    char what[192];
    model_layout ly;
    snprintf(what, sizeof(what), "%s batch %d of %d, %s", spec, B, mb, mode_name[mode]);
    if (layout_or_fail(&ly, spec, IMG) != 0)
        return;
    model *mc, *mg;
    if (pair_new(&ly, mb, &mc, &mg, what) != 0)
        return;
    const size_t P = ly.n_params, xn = (size_t)mb * ly.n_in;
    const int pin_p = mode != PLAIN, pin_x = mode == PINNED; /* params and grads; x and y */
    const int64_t ne = n_eval > mb ? n_eval : mb;
    float *params = buf_alloc(mg, pin_p, P * sizeof(float), what);
    float *gg = buf_alloc(mg, pin_p, P * sizeof(float), what), *gc = malloc(P * sizeof(float));
    float *xa = buf_alloc(mg, pin_x, (size_t)ne * ly.n_in * sizeof(float), what);
    float *xb = buf_alloc(mg, pin_x, xn * sizeof(float), what);
    uint8_t *ya = buf_alloc(mg, pin_x, (size_t)ne, what), *yb = buf_alloc(mg, pin_x, (size_t)mb, what);
    if (!params || !gg || !gc || !xa || !xb || !ya || !yb) {
        result(0, what, "out of (pinned) host memory, or see above");
        goto out;
    }
    if (mode != PLAIN)
        result(1, what, "model_host_alloc: zeroed, page-locked");
    uint64_t st = rng_stream(seed, 2000);
    const int exact = ly.n_layers > 1;
    fill_params(&ly, params, &st, seed, exact);
    fill_x(xa, (size_t)ne * ly.n_in, &st, exact);
    fill_x(xb, xn, &st, exact);
    fill_labels(ya, (size_t)ne, &st, 10);
    fill_labels(yb, (size_t)mb, &st, 10);
    step_check(mc, mg, &ly, params, xa, ya, B, gc, gg, what, "step");
    step_check(mc, mg, &ly, params, xb, yb, B, gc, gg, what, "step 2, other inputs");
    int rs = 0;
#define STAGE(x, y, n) (rs |= model_stage_batch(mg, x, y, n))
    STAGE(xa, ya, B);
    step_check(mc, mg, &ly, params, xa, ya, B, gc, gg, what, "staged a, step a");
    STAGE(xb, yb, B);
    step_check(mc, mg, &ly, params, xa, ya, B, gc, gg, what, "staged b, step a");
    step_check(mc, mg, &ly, params, xb, yb, B, gc, gg, what, "then b unstaged");
    STAGE(xa, ya, B);
    step_check(mc, mg, &ly, params, xa, ya, B, gc, gg, what, "staged a again");
    fill_x(xa, xn, &st, exact); /* a's buffer refilled: nothing of the staging may stay */
    fill_labels(ya, (size_t)mb, &st, 10);
    step_check(mc, mg, &ly, params, xa, ya, B, gc, gg, what, "a refilled, unstaged");
    STAGE(xa, ya, B);
    STAGE(xb, yb, B); /* replaces a's */
    step_check(mc, mg, &ly, params, xb, yb, B, gc, gg, what, "staged a then b, step b");
    STAGE(xb, yb, B > 1 ? B - 1 : B);
    step_check(mc, mg, &ly, params, xb, yb, B, gc, gg, what, "staged b of B-1, step B");
    fill_params(&ly, params, &st, seed + 1, exact); /* new parameters */
    STAGE(xb, yb, B);
    step_check(mc, mg, &ly, params, xb, yb, B, gc, gg, what, "new params, staged b");
    /* evaluate ends a staging: the step after it copies its batch */
    STAGE(xa, ya, B);
    {
        double elc = NAN, eac = NAN, elg = NAN, eag = NAN;
        int rc = model_evaluate(mc, params, xa, ya, n_eval, &elc, &eac);
        int rg = model_evaluate(mg, params, xa, ya, n_eval, &elg, &eag);
        char w[320], d[96];
        snprintf(w, sizeof(w), "%s: staged a, evaluate %d", what, n_eval);
        check_rc(w, rc, rg);
        if (rc == 0 && rg == 0) {
            check_loss(w, "loss", elg, elc);
            snprintf(d, sizeof(d), "accuracy cpu %.6f cuda %.6f", eac, eag);
            /* an argmax may flip where two logits are within rounding (no hidden layer: continuous) */
            result(fabs(eac - eag) <= (exact ? 0.0 : 2.0 / n_eval), w, d);
        }
    }
    step_check(mc, mg, &ly, params, xa, ya, B, gc, gg, what, "then a, unstaged");
#undef STAGE
    result(rs == 0, what, rs == 0 ? "model_stage_batch: 0 every time" : "model_stage_batch failed (see stderr)");
    /* pinned, staged and left: model_host_free waits for its copy (below) */
    if (pin_x && model_stage_batch(mg, xa, ya, B) != 0)
        result(0, what, "model_stage_batch before the free failed");
out:
    buf_free(mg, pin_p, params);
    buf_free(mg, pin_p, gg);
    buf_free(mg, pin_x, xa);
    buf_free(mg, pin_x, xb);
    buf_free(mg, pin_x, ya);
    buf_free(mg, pin_x, yb);
    free(gc);
    model_free(mc);
    model_free(mg);
}

/* all weights 0: every logit equal, the first maximum (class 0) wins on both */
static void ties(void)
{
    model_layout ly;
    if (layout_or_fail(&ly, "conv:3x3x4,pool:2,dense:10", IMG) != 0)
        return;
    model *mc, *mg;
    if (pair_new(&ly, 50, &mc, &mg, "ties") != 0)
        return;
    const int n = 130;
    float *params = calloc(ly.n_params, sizeof(float)), *x = malloc((size_t)n * ly.n_in * sizeof(float));
    uint8_t *y = malloc((size_t)n);
    uint64_t st = rng_stream(5, 5);
    fill_x(x, (size_t)n * ly.n_in, &st, 0);
    fill_labels(y, (size_t)n, &st, 10);
    double lc, ac, lg, ag;
    int zeros = 0;
    for (int i = 0; i < n; i++)
        zeros += y[i] == 0;
    int rc = model_evaluate(mc, params, x, y, n, &lc, &ac);
    int rg = model_evaluate(mg, params, x, y, n, &lg, &ag);
    char d[128];
    snprintf(d, sizeof(d), "accuracy want %.6f, cpu %.6f, cuda %.6f; loss cpu %.6f cuda %.6f",
             (double)zeros / n, ac, ag, lc, lg);
    result(rc == 0 && rg == 0 && ag == (double)zeros / n && ac == ag && fabs(lg - lc) <= 1e-6,
           "all weights 0: the first maximum wins", d);
    free(params);
    free(x);
    free(y);
    model_free(mc);
    model_free(mg);
}

/* ---- 6. the embedding bag (embed:ROWSxDIM[,mean|sum]) ---- */

/* bag_forward and bag_backward, CUDA against the CPU: B bags of 0 to 40
 * indices (a row may repeat, an empty bag gives 0) over n_rows rows, mean
 * and sum. */
static void bag(int B, int64_t n_rows, int D, uint64_t seed)
{
    model_layout ly;
    char what[96];
    if (layout_or_fail(&ly, "dense:10", (model_shape){1, 1, D}) != 0)
        return;
    model *mc, *mg;
    snprintf(what, sizeof(what), "embedding bag B=%d rows=%lld dim=%d", B, (long long)n_rows, D);
    if (pair_new(&ly, B, &mc, &mg, what) != 0)
        return;
    uint64_t st = seed;
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(B + 1));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)B * 40 + 4);
    float *rows = malloc(sizeof(float) * (size_t)n_rows * (size_t)D);
    float *dout = malloc(sizeof(float) * (size_t)B * (size_t)D);
    float *oc = malloc(sizeof(float) * (size_t)B * (size_t)D), *og = malloc(sizeof(float) * (size_t)B * (size_t)D);
    float *dc = malloc(sizeof(float) * (size_t)n_rows * (size_t)D), *dg = malloc(sizeof(float) * (size_t)n_rows * (size_t)D);
    if (!off || !idx || !rows || !dout || !oc || !og || !dc || !dg) {
        result(0, what, "out of memory");
        goto out;
    }
    off[0] = 0;
    for (int b = 0; b < B; b++) {
        int len = (int)rng_below(&st, 41); /* 0..40 */
        for (int j = 0; j < len; j++)
            idx[off[b] + j] = (int32_t)rng_below(&st, (uint64_t)n_rows);
        off[b + 1] = off[b] + len;
    }
    for (size_t i = 0; i < (size_t)n_rows * (size_t)D; i++)
        rows[i] = cont(&st);
    for (size_t i = 0; i < (size_t)B * (size_t)D; i++)
        dout[i] = cont(&st);
    for (int mean = 0; mean <= 1; mean++) {
        char w2[128];
        snprintf(w2, sizeof(w2), "%s %s", what, mean ? "mean" : "sum");
        poison(og, (size_t)B * (size_t)D);
        poison(dg, (size_t)n_rows * (size_t)D);
        int rc = model_bag_forward(mc, rows, n_rows, D, idx, off, B, mean, oc);
        int rg = model_bag_forward(mg, rows, n_rows, D, idx, off, B, mean, og);
        check_rc(w2, rc, rg);
        if (rc == 0 && rg == 0)
            check(w2, "forward out", og, oc, (size_t)B * (size_t)D);
        rc = model_bag_backward(mc, dout, n_rows, D, idx, off, B, mean, dc);
        rg = model_bag_backward(mg, dout, n_rows, D, idx, off, B, mean, dg);
        check_rc(w2, rc, rg);
        if (rc == 0 && rg == 0)
            check(w2, "backward drows", dg, dc, (size_t)n_rows * (size_t)D);
    }
out:
    free(off);
    free(idx);
    free(rows);
    free(dout);
    free(oc);
    free(og);
    free(dc);
    free(dg);
    model_free(mc);
    model_free(mg);
}

int main(int argc, char **argv)
{
    uint64_t seed = (uint64_t)time(NULL);
    int probe = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--probe") == 0)
            probe = 1;
        else if (strncmp(argv[i], "--seed=", 7) == 0)
            seed = strtoull(argv[i] + 7, NULL, 10);
        else {
            fprintf(stderr, "usage: cuda_vs_cpu [--seed=N | --probe]\n");
            return 2;
        }
    }
    char why[256] = "", desc[256] = "", err[512];
    /* the CPU reference on the kernel workerd would use (may re-execute) */
    if (blas_kernel_choose(argv, err, sizeof(err)) != 0) {
        fprintf(stderr, "cuda_vs_cpu: %s\n", err);
        return 1;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (model_cuda_device_count(why, sizeof(why)) < 1) {
        printf("SKIP: %s\n", why);
        return 77;
    }
    if (probe)
        return 0;
    if (model_cuda_use(0, 0, desc, sizeof(desc), err, sizeof(err)) != 0) {
        printf("FAIL: %s\n", err);
        return 1;
    }
    model_cpu_set_threads(1);
    printf("cuda_vs_cpu: %s; seed %llu; limit %.0e\n", desc, (unsigned long long)seed, LIMIT);
    time_t t0 = time(NULL);
    /* 1, 2 */
    layers(seed);
    masks(seed);
    /* 3: small CNNs (a split at every layer boundary of one), the full cnn */
    {
        const int all[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        model_layout ly;
        const char *s1 = "conv:3x3x8,pool:2,dense:32,dropout:0.5,dense:10";
        if (layout_or_fail(&ly, s1, IMG) == 0)
            whole(s1, IMG, 5, 8, 21, all, ly.n_layers - 1 < 15 ? ly.n_layers - 1 : 15, seed + 60);
        const int two[] = {2, 4};
        whole("conv:5x5x6/2:valid,pool:3/1,conv:2x2x4,pool:2/3:valid,dense:7,dropout:0.5,dense:10", IMG,
              9, 9, 40, two, 2, seed + 61);
        whole("conv:4x4x3/3,dense:10", (model_shape){10, 11, 2}, 3, 4, 11, two, 1, seed + 62);
        model_layout cnn;
        if (layout_or_fail(&cnn, "cnn", IMG) == 0) {
            int k = 0; /* split at the first dense (its flatten: as the model-parallel issue would) */
            while (k < cnn.n_layers && cnn.layers[k].kind != LAYER_FLATTEN)
                k++;
            whole("cnn", IMG, 100, 100, 250, &k, 1, seed + 63);
        }
    }
    /* 4: MLPs and CNNs in every buffer mode, with staging */
    for (int mode = PLAIN; mode <= MIXED; mode++) {
        modes("mlp:", 64, 64, 150, seed + 71, mode);
        modes("mlp:100", 100, 100, 1000, seed + 72, mode);
        modes("mlp:64,33", 8, 5, 21, seed + 73, mode);
        modes("mlp:1024,1024", 256, 256, 600, seed + 74, mode);
        modes("mlp:12,12,12,12,12,12,12,12", 40, 33, 100, seed + 75, mode);
        modes("conv:3x3x8,pool:2,dense:32,dropout:0.5,dense:10", 12, 11, 30, seed + 76, mode);
    }
    modes("cnn", 20, 20, 45, seed + 77, PINNED);
    ties();
    bag(1, 1, 1, seed + 81);
    bag(100, 3000, 16, seed + 82);
    bag(257, 50, 33, seed + 83); /* few rows: many additions to each */
    printf("cuda_vs_cpu: %d passed, %d failed in %ld s\n", passes, failures, (long)(time(NULL) - t0));
    printf("cuda_vs_cpu: %s\n", failures ? "FAILED" : "all agree");
    return failures ? 1 : 0;
}
