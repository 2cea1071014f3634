/* cuda_vs_cpu.c - the CUDA backend against the CPU reference (mlp_cpu.c) on
 * fresh random inputs: the loss and every gradient tensor of forward_backward,
 * and evaluate's loss and accuracy, for several shapes (no hidden layer, the
 * example's, deep and odd-sized ones, batch below max_batch, evaluation in
 * uneven chunks), plus exact ties (the first maximum wins) and bad arguments.
 * Outputs are poisoned with NaN before each run, so an element the backend
 * does not write shows. Error of a tensor: max |cuda - cpu| / max |cpu|
 * (the relative error in the max norm); the limit is 1e-4.
 *
 * Models with hidden layers get "exact" random inputs: pixels k/4, weights and
 * biases j/16 (|j| <= 2), so every pre-activation of the forward pass is a sum
 * of products that FP32 holds exactly, whatever the summation order: the CPU
 * and the GPU then agree bit for bit on which ReLUs are on. With continuous
 * inputs a pre-activation within rounding of 0 (about one in a million) may
 * be on for one and off for the other, and that example's whole gradient
 * through the unit differs: a real but irrelevant disagreement that would make
 * the check flaky. The backward pass is then compared with its rounding.
 * The model without hidden layers gets continuous inputs.
 *
 * Each shape runs with the CUDA backend's buffers (params, gradients, x,
 * labels) from malloc (its copies go through its staging buffers) and from
 * mlp_host_alloc (pinned: direct DMA; checked to be zeroed and page-locked
 * with cudaPointerGetAttributes); two shapes also mixed (params and gradients
 * pinned, x and labels from malloc, as the worker's evaluation of the
 * dataset). The CPU computes on the same buffers.
 *
 * The overlapped copies (issue 7) against the CPU too, in every buffer mode:
 * with pinned params the upload is per layer (W_0, b_0 on the compute
 * stream, the other layers on a copy stream with an event each; deep and
 * 8-hidden-layer models, the parameters changed between steps so every
 * layer's upload is checked), and mlp_stage_batch (the next batch copied
 * ahead into the second device batch buffer): a staged batch used; a staged
 * batch followed by a step on another one (which must compute on that one);
 * then the staged one without staging; one staged buffer refilled with new
 * contents and used unstaged (nothing stale); staging replaced by a second
 * stage; a staged batch of another size; staging ended by evaluate; and the
 * same with a staged batch from malloc (copied at once).
 *
 *   cuda_vs_cpu [--seed=N]      exit 0 all agree, 1 a mismatch or a CUDA
 *                               failure, 77 no CUDA device (skipped; the
 *                               reason on stdout)
 *   cuda_vs_cpu --probe         exit 0 when a device is visible, else 77 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "blas_kernel.h"
#include "mlp.h"
#include "rng.h"

#define LIMIT 1e-4

static int failures;

static double rel_err(const float *got, const float *want, size_t n, int *nan_at)
{
    double num = 0, den = 0;
    *nan_at = -1;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(want[i])) {
            *nan_at = (int)i;
            return INFINITY;
        }
        double d = fabs((double)got[i] - (double)want[i]);
        num = d > num ? d : num;
        den = fabs((double)want[i]) > den ? fabs((double)want[i]) : den;
    }
    return den > 0 ? num / den : num;
}

static void fill_poison(float *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = NAN;
}

static void report(const char *what, const char *tensor, double err, int nan_at)
{
    int bad = !(err <= LIMIT);
    if (bad)
        failures++;
    if (nan_at >= 0)
        printf("  %-4s %-36s %-8s element %d is not finite (unwritten?)\n", bad ? "FAIL" : "ok", what,
               tensor, nan_at);
    else
        printf("  %-4s %-36s %-8s rel err %.2e\n", bad ? "FAIL" : "ok", what, tensor, err);
}

/* One shape: forward_backward at batch B (max_batch mb) and evaluate over
 * n_eval examples; zero_weights gives all-equal logits (ties). */
/* A random input value: continuous in [0, 1) with a quarter exact zeros, or
 * exact (k/4). */
static float rand_x(uint64_t *st, int exact)
{
    if (exact)
        return (float)rng_below(st, 5) / 4.0f;
    return rng_below(st, 4) == 0 ? 0.0f : (float)rng_uniform_open0(st);
}

/* Where the CUDA backend's buffers come from. */
enum { PLAIN, PINNED, MIXED };
static const char *const mode_name[] = {"malloc", "pinned", "mixed"};

/* bytes from mlp_host_alloc(m) when pinned, else malloc; NULL with a FAIL
 * line when mlp_host_alloc's memory is not zeroed or not page-locked */
static void *buf_alloc(mlp *m, int pinned, size_t bytes, const char *what, const char *name)
{
    if (!pinned)
        return malloc(bytes);
    unsigned char *p = mlp_host_alloc(m, bytes);
    if (!p)
        return NULL;
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; i++)
        nonzero += p[i] != 0;
    struct cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    int locked = e == cudaSuccess && a.type == cudaMemoryTypeHost;
    if (nonzero || !locked) {
        printf("  FAIL %-36s %-8s mlp_host_alloc(%zu): %zu bytes not zero, %s\n", what, name, bytes,
               nonzero, locked ? "page-locked" : e != cudaSuccess ? cudaGetErrorString(e) : "NOT page-locked");
        (void)cudaGetLastError();
        failures++;
        mlp_host_free(m, p);
        return NULL;
    }
    return p;
}

static void buf_free(mlp *m, int pinned, void *p)
{
    if (pinned)
        mlp_host_free(m, p);
    else
        free(p);
}

/* Parameters for a check: exact (j/den, |j| <= 2; den > 0) or the example's
 * initialization with non-zero biases (den 0), or all 0. */
static void fill_params(const mlp_layout *ly, float *params, uint64_t *st, uint64_t seed, int den,
                        int zero_weights)
{
    mlp_init_params(ly, params, seed);
    for (int i = 0; i < ly->n_tensors; i++) {
        const mlp_tensor *t = &ly->tensors[i];
        for (size_t k = 0; k < t->numel; k++)
            if (zero_weights)
                params[t->offset + k] = 0.0f;
            else if (den > 0)
                params[t->offset + k] = (float)((int)rng_below(st, 5) - 2) / (float)den;
            else if (t->shape.ndim == 1) /* non-zero biases, so the bias paths show */
                params[t->offset + k] = (float)(0.1 * rng_normal(st));
    }
}

static void step_check(mlp *mc, mlp *mg, const mlp_layout *ly, const float *params, const float *x,
                       const uint8_t *y, int B, float *g_cpu, float *g_gpu, const char *what,
                       const char *check);

static void compare(const char *shape, int n_in, const int *hidden, int n_hidden, int n_out, int mb,
                    int B, int n_eval, uint64_t seed, int zero_weights, int mode)
{
    char err[512], what[128];
    mlp_layout ly;
    snprintf(what, sizeof(what), "%s, %s", shape, mode_name[mode]);
    if (mlp_layout_init(&ly, n_in, hidden, n_hidden, n_out, err, sizeof(err)) != 0) {
        printf("  FAIL %s: layout: %s\n", what, err);
        failures++;
        return;
    }
    size_t P = ly.n_params;
    int64_t nx = n_eval > B ? n_eval : B;
    const int pin_p = mode != PLAIN, pin_x = mode == PINNED; /* params and grads; x and y */
    mlp *mc = mlp_new(&mlp_backend_cpu, &ly, mb, err, sizeof(err));
    mlp *mg = mc ? mlp_new(&mlp_backend_cuda, &ly, mb, err, sizeof(err)) : NULL;
    float *params = NULL, *g_cpu = NULL, *g_gpu = NULL, *x = NULL;
    uint8_t *y = NULL;
    if (!mc || !mg) {
        printf("  FAIL %s: %s\n", what, err);
        failures++;
        goto out;
    }
    params = buf_alloc(mg, pin_p, P * sizeof(float), what, "params");
    g_gpu = buf_alloc(mg, pin_p, P * sizeof(float), what, "grads");
    g_cpu = malloc(P * sizeof(float));
    x = buf_alloc(mg, pin_x, (size_t)nx * n_in * sizeof(float), what, "x");
    y = buf_alloc(mg, pin_x, (size_t)nx, what, "labels");
    if (!params || !g_cpu || !g_gpu || !x || !y) {
        printf("  FAIL %s: out of (pinned) host memory, or see above\n", what);
        failures++;
        goto out;
    }
    if (mode != PLAIN)
        printf("  ok   %-36s %-8s mlp_host_alloc: zeroed, page-locked\n", what, "buffers");
    uint64_t st = rng_stream(seed, 1000);
    const int exact = n_hidden > 0;
    fill_params(&ly, params, &st, seed, exact ? 16 : 0, zero_weights);
    for (int64_t k = 0; k < nx * n_in; k++) /* like pixels in [0, 1], some exactly 0 */
        x[k] = rand_x(&st, exact);
    for (int64_t k = 0; k < nx; k++)
        y[k] = (uint8_t)rng_below(&st, (uint64_t)n_out);

    double l_cpu = NAN, l_gpu = NAN;
    fill_poison(g_cpu, P);
    fill_poison(g_gpu, P);
    int rc_c = mlp_forward_backward(mc, params, x, y, B, g_cpu, &l_cpu);
    int rc_g = mlp_forward_backward(mg, params, x, y, B, g_gpu, &l_gpu);
    if (rc_c != 0 || rc_g != 0) {
        printf("  FAIL %s: forward_backward returned cpu %d, cuda %d\n", what, rc_c, rc_g);
        failures++;
        goto out;
    }
    float lc = (float)l_cpu, lg = (float)l_gpu;
    int nan_at;
    double e = rel_err(&lg, &lc, 1, &nan_at); /* before nan_at is read */
    report(what, "loss", e, nan_at);
    for (int i = 0; i < ly.n_tensors; i++) {
        const mlp_tensor *t = &ly.tensors[i];
        e = rel_err(g_gpu + t->offset, g_cpu + t->offset, t->numel, &nan_at);
        report(what, t->name, e, nan_at);
    }
    /* a second step with other inputs on the same instances: nothing stale */
    for (int64_t k = 0; k < (int64_t)B * n_in; k++)
        x[k] = rand_x(&st, exact);
    step_check(mc, mg, &ly, params, x, y, B, g_cpu, g_gpu, what, "step 2");

    double el_c = NAN, ea_c = NAN, el_g = NAN, ea_g = NAN;
    rc_c = mlp_evaluate(mc, params, x, y, n_eval, &el_c, &ea_c);
    rc_g = mlp_evaluate(mg, params, x, y, n_eval, &el_g, &ea_g);
    if (rc_c != 0 || rc_g != 0) {
        printf("  FAIL %s: evaluate returned cpu %d, cuda %d\n", what, rc_c, rc_g);
        failures++;
        goto out;
    }
    lc = (float)el_c;
    lg = (float)el_g;
    e = rel_err(&lg, &lc, 1, &nan_at);
    report(what, "eval.loss", e, nan_at);
    /* accuracy: an argmax may flip where two logits are within rounding (the
     * logits of a deep model may round); all-equal logits must not differ */
    int acc_bad = !(fabs(ea_g - ea_c) <= (zero_weights ? 0.0 : 2.0 / n_eval));
    if (acc_bad)
        failures++;
    printf("  %-4s %-36s %-8s cpu %.6f cuda %.6f\n", acc_bad ? "FAIL" : "ok", what, "eval.acc", ea_c,
           ea_g);
    if (zero_weights) { /* all logits equal: class 0 wins, on both */
        int64_t zeros = 0;
        for (int64_t k = 0; k < n_eval; k++)
            zeros += y[k] == 0;
        int tie_bad = fabs(ea_g - (double)zeros / n_eval) > 1e-12;
        failures += tie_bad;
        printf("  %-4s %-36s %-8s first maximum wins: want %.6f, cuda %.6f\n", tie_bad ? "FAIL" : "ok",
               what, "ties", (double)zeros / n_eval, ea_g);
    }
    /* bad arguments: refused, as the CPU refuses them */
    y[0] = (uint8_t)n_out;
    int r1 = mlp_forward_backward(mg, params, x, y, B, g_gpu, &l_gpu);
    int r2 = mlp_forward_backward(mg, params, x, y, mb + 1, g_gpu, &l_gpu);
    int r3 = mlp_evaluate(mg, params, x, y, n_eval, &el_g, &ea_g);
    if (r1 >= 0 || r2 >= 0 || r3 >= 0) {
        printf("  FAIL %s: a label >= n_out or batch > max_batch was accepted (%d %d %d)\n", what,
               r1, r2, r3);
        failures++;
    }
out:
    if (mg) { /* mlp_host_alloc's memory before its instance */
        buf_free(mg, pin_p, params);
        buf_free(mg, pin_p, g_gpu);
        buf_free(mg, pin_x, x);
        buf_free(mg, pin_x, y);
    }
    free(g_cpu);
    mlp_free(mc);
    mlp_free(mg);
}

/* The worst error of one CUDA step against the CPU's on the same inputs:
 * the loss and every gradient tensor; poisons both gradient buffers first. */
static void step_check(mlp *mc, mlp *mg, const mlp_layout *ly, const float *params, const float *x,
                       const uint8_t *y, int B, float *g_cpu, float *g_gpu, const char *what,
                       const char *check)
{
    const size_t P = ly->n_params;
    double l_cpu = NAN, l_gpu = NAN;
    fill_poison(g_cpu, P);
    fill_poison(g_gpu, P);
    int rc_c = mlp_forward_backward(mc, params, x, y, B, g_cpu, &l_cpu);
    int rc_g = mlp_forward_backward(mg, params, x, y, B, g_gpu, &l_gpu);
    if (rc_c != 0 || rc_g != 0) {
        printf("  FAIL %-36s %-8s forward_backward returned cpu %d, cuda %d\n", what, check, rc_c,
               rc_g);
        failures++;
        return;
    }
    float lc = (float)l_cpu, lg = (float)l_gpu;
    int nan_at, any_nan;
    double worst = rel_err(&lg, &lc, 1, &any_nan);
    for (int i = 0; i < ly->n_tensors && any_nan < 0; i++) {
        const mlp_tensor *t = &ly->tensors[i];
        double e = rel_err(g_gpu + t->offset, g_cpu + t->offset, t->numel, &nan_at);
        worst = e > worst ? e : worst;
        any_nan = nan_at >= 0 ? (int)t->offset + nan_at : -1;
    }
    report(what, check, worst, any_nan);
}

/* The overlapped copies of one shape against the CPU (see the top): batch B
 * of max_batch mb, two batches a and b, in buffer mode `mode`; den as
 * fill_params (0 for a model without hidden layers: continuous inputs). */
static void compare_staged(const char *shape, int n_in, const int *hidden, int n_hidden, int n_out,
                           int mb, int B, uint64_t seed, int den, int mode)
{
    char err[512], what[128];
    mlp_layout ly;
    snprintf(what, sizeof(what), "%s, %s", shape, mode_name[mode]);
    if (mlp_layout_init(&ly, n_in, hidden, n_hidden, n_out, err, sizeof(err)) != 0) {
        printf("  FAIL %s: layout: %s\n", what, err);
        failures++;
        return;
    }
    const size_t P = ly.n_params, xn = (size_t)mb * n_in;
    const int pin_p = mode != PLAIN, pin_x = mode == PINNED;
    mlp *mc = mlp_new(&mlp_backend_cpu, &ly, mb, err, sizeof(err));
    mlp *mg = mc ? mlp_new(&mlp_backend_cuda, &ly, mb, err, sizeof(err)) : NULL;
    float *params = NULL, *g_cpu = NULL, *g_gpu = NULL, *xa = NULL, *xb = NULL;
    uint8_t *ya = NULL, *yb = NULL;
    if (!mc || !mg) {
        printf("  FAIL %s: %s\n", what, err);
        failures++;
        goto out;
    }
    params = buf_alloc(mg, pin_p, P * sizeof(float), what, "params");
    g_gpu = buf_alloc(mg, pin_p, P * sizeof(float), what, "grads");
    g_cpu = malloc(P * sizeof(float));
    xa = buf_alloc(mg, pin_x, xn * sizeof(float), what, "x a");
    xb = buf_alloc(mg, pin_x, xn * sizeof(float), what, "x b");
    ya = buf_alloc(mg, pin_x, (size_t)mb, what, "labels a");
    yb = buf_alloc(mg, pin_x, (size_t)mb, what, "labels b");
    if (!params || !g_cpu || !g_gpu || !xa || !xb || !ya || !yb) {
        printf("  FAIL %s: out of (pinned) host memory, or see above\n", what);
        failures++;
        goto out;
    }
    uint64_t st = rng_stream(seed, 2000);
    const int exact = den > 0;
    fill_params(&ly, params, &st, seed, den, 0);
    for (size_t k = 0; k < xn; k++) {
        xa[k] = rand_x(&st, exact);
        xb[k] = rand_x(&st, exact);
    }
    for (int k = 0; k < mb; k++) {
        ya[k] = (uint8_t)rng_below(&st, (uint64_t)n_out);
        yb[k] = (uint8_t)rng_below(&st, (uint64_t)n_out);
    }
    int rs = 0;
#define STAGE(x, y, n) (rs |= mlp_stage_batch(mg, x, y, n))
    STAGE(xa, ya, B);
    step_check(mc, mg, &ly, params, xa, ya, B, g_cpu, g_gpu, what, "staged a, step a");
    STAGE(xb, yb, B);
    step_check(mc, mg, &ly, params, xa, ya, B, g_cpu, g_gpu, what, "staged b, step a");
    step_check(mc, mg, &ly, params, xb, yb, B, g_cpu, g_gpu, what, "then b unstaged");
    STAGE(xa, ya, B);
    step_check(mc, mg, &ly, params, xa, ya, B, g_cpu, g_gpu, what, "staged a again");
    for (size_t k = 0; k < xn; k++) /* a's buffer refilled: nothing of the staging may stay */
        xa[k] = rand_x(&st, exact);
    for (int k = 0; k < mb; k++)
        ya[k] = (uint8_t)rng_below(&st, (uint64_t)n_out);
    step_check(mc, mg, &ly, params, xa, ya, B, g_cpu, g_gpu, what, "a refilled, unstaged");
    STAGE(xa, ya, B);
    STAGE(xb, yb, B); /* replaces a's */
    step_check(mc, mg, &ly, params, xb, yb, B, g_cpu, g_gpu, what, "staged a then b, step b");
    STAGE(xb, yb, B > 1 ? B - 1 : B);
    step_check(mc, mg, &ly, params, xb, yb, B, g_cpu, g_gpu, what, "staged b of B-1, step B");
    /* new parameters: every layer's upload again (per layer when pinned) */
    fill_params(&ly, params, &st, seed + 1, den, 0);
    STAGE(xb, yb, B);
    step_check(mc, mg, &ly, params, xb, yb, B, g_cpu, g_gpu, what, "new params, staged b");
    /* evaluate ends a staging: the step after it copies its batch */
    STAGE(xa, ya, B);
    double el_c = NAN, ea_c = NAN, el_g = NAN, ea_g = NAN;
    int rc_c = mlp_evaluate(mc, params, xb, yb, mb, &el_c, &ea_c);
    int rc_g = mlp_evaluate(mg, params, xb, yb, mb, &el_g, &ea_g);
    float lc = (float)el_c, lg = (float)el_g;
    int nan_at;
    double e = rel_err(&lg, &lc, 1, &nan_at);
    if (rc_c != 0 || rc_g != 0) {
        printf("  FAIL %-36s %-8s evaluate returned cpu %d, cuda %d\n", what, "staged a, eval b",
               rc_c, rc_g);
        failures++;
    } else {
        report(what, "staged a, eval b", e, nan_at);
    }
    step_check(mc, mg, &ly, params, xa, ya, B, g_cpu, g_gpu, what, "then a, unstaged");
#undef STAGE
    if (rs != 0) {
        printf("  FAIL %-36s %-8s mlp_stage_batch returned an error (see stderr)\n", what, "stage");
        failures++;
    }
    if (mlp_stage_batch(mg, xa, ya, mb + 1) >= 0 || mlp_stage_batch(mg, xa, ya, 0) >= 0) {
        printf("  FAIL %-36s %-8s mlp_stage_batch accepted a batch outside [1, %d]\n", what, "stage", mb);
        failures++;
    }
    /* pinned, staged and left: mlp_host_free waits for its copy (below) */
    if (pin_x && mlp_stage_batch(mg, xa, ya, B) != 0) {
        printf("  FAIL %-36s %-8s mlp_stage_batch before the free\n", what, "stage");
        failures++;
    }
out:
    if (mg) {
        buf_free(mg, pin_p, params);
        buf_free(mg, pin_p, g_gpu);
        buf_free(mg, pin_x, xa);
        buf_free(mg, pin_x, xb);
        buf_free(mg, pin_x, ya);
        buf_free(mg, pin_x, yb);
    }
    free(g_cpu);
    mlp_free(mc);
    mlp_free(mg);
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
    if (mlp_cuda_device_count(why, sizeof(why)) < 1) {
        printf("SKIP: %s\n", why);
        return 77;
    }
    if (probe)
        return 0;
    if (mlp_cuda_use(0, 0, desc, sizeof(desc), err, sizeof(err)) != 0) {
        printf("FAIL: %s\n", err);
        return 1;
    }
    mlp_cpu_set_threads(1);
    printf("cuda_vs_cpu: %s; seed %llu; limit %.0e\n", desc, (unsigned long long)seed, LIMIT);
    const int h100[] = {100}, h2[] = {64, 33}, hbig[] = {1024, 1024}, h3[] = {300, 200, 100};
    for (int mode = PLAIN; mode <= PINNED; mode++) {
        compare("784-10 (softmax regression)", 784, NULL, 0, 10, 64, 64, 150, seed + 1, 0, mode);
        compare("784-100-10 batch 100", 784, h100, 1, 10, 100, 100, 1000, seed + 2, 0, mode);
        compare("37-64-33-3 batch 5 of 8", 37, h2, 2, 3, 8, 5, 21, seed + 3, 0, mode);
        compare("784-1024-1024-10 batch 256", 784, hbig, 2, 10, 256, 256, 600, seed + 4, 0, mode);
        compare("50-300-200-100-17 batch 129", 50, h3, 3, 17, 129, 129, 300, seed + 5, 0, mode);
        compare("784-100-10 all weights 0", 784, h100, 1, 10, 100, 100, 250, seed + 6, 1, mode);
    }
    compare("37-64-33-3 batch 5 of 8", 37, h2, 2, 3, 8, 5, 21, seed + 3, 0, MIXED);
    compare("784-1024-1024-10 batch 256", 784, hbig, 2, 10, 256, 256, 600, seed + 4, 0, MIXED);
    /* the overlapped copies: per-layer upload (pinned params), staged batches */
    const int h8[] = {12, 12, 12, 12, 12, 12, 12, 12};
    for (int mode = PLAIN; mode <= MIXED; mode++) {
        compare_staged("784-10 batch 64", 784, NULL, 0, 10, 64, 64, seed + 11, 0, mode);
        compare_staged("37-64-33-3 batch 5 of 8", 37, h2, 2, 3, 8, 5, seed + 12, 16, mode);
        compare_staged("784-1024-1024-10 batch 256", 784, hbig, 2, 10, 256, 256, seed + 13, 16, mode);
        compare_staged("16-12x8-4 batch 33 of 40", 16, h8, 8, 4, 40, 33, seed + 14, 4, mode);
    }
    printf("cuda_vs_cpu: %s\n", failures ? "FAILED" : "all agree");
    return failures ? 1 : 0;
}
