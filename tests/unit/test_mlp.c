/* test_mlp.c - client/mlp.c and the CPU backend (mlp_cpu.c).
 * Gradients are checked against central finite differences of a double-precision
 * forward pass written here from the formulas in mlp.h (no BLAS, no shared
 * code); the loss of a zero model against log(n_out); the initialization against
 * the moments of a normal truncated at two standard deviations. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernel.h"
#include "mlp.h"

/* ---- a test-local generator (not rng.h: the test stays independent) ---- */

static uint64_t lcg_state;
static double urand(void) /* uniform [0, 1), 53 bits; Knuth's MMIX LCG */
{
    lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(lcg_state >> 11) * (1.0 / 9007199254740992.0);
}
static float frand(float lo, float hi)
{
    return lo + (hi - lo) * (float)urand();
}

/* ---- double-precision reference ---- */

/* Mean softmax cross-entropy of the model in double. If zmin is given, it gets
 * the smallest |pre-activation| of any hidden unit (distance to a ReLU kink). */
static double ref_loss(const mlp_layout *ly, const double *p, const float *x,
                       const uint8_t *labels, int B, double *zmin)
{
    const int L = ly->n_layers;
    double total = 0, zm = INFINITY;
    double a[64], z[64];
    for (int i = 0; i < B; i++) {
        int K = ly->dims[0];
        for (int k = 0; k < K; k++)
            a[k] = x[(size_t)i * K + k];
        for (int l = 0; l < L; l++) {
            const int N = ly->dims[l + 1];
            const double *W = p + ly->tensors[2 * l].offset, *b = p + ly->tensors[2 * l + 1].offset;
            for (int j = 0; j < N; j++) {
                double s = b[j];
                for (int k = 0; k < K; k++)
                    s += a[k] * W[(size_t)k * N + j];
                z[j] = s;
            }
            if (l < L - 1)
                for (int j = 0; j < N; j++) {
                    if (fabs(z[j]) < zm)
                        zm = fabs(z[j]);
                    a[j] = z[j] > 0 ? z[j] : 0;
                }
            K = N;
        }
        /* log-sum-exp of z[0..K) minus z[label] */
        double mx = z[0], s = 0;
        for (int j = 1; j < K; j++)
            mx = z[j] > mx ? z[j] : mx;
        for (int j = 0; j < K; j++)
            s += exp(z[j] - mx);
        total += mx + log(s) - z[labels[i]];
    }
    if (zmin)
        *zmin = zm;
    return total / B;
}

typedef struct model_case {
    int n_in, hidden[4], n_hidden, n_out, batch;
} model_case;

/* Random float parameters (weights and biases both nonzero) and inputs, with
 * every hidden pre-activation at least `margin` away from the ReLU kink so a
 * finite difference never straddles it. */
static void random_problem(const mlp_layout *ly, float *params, float *x, uint8_t *labels, int B,
                           double margin)
{
    double *pd = malloc(ly->n_params * sizeof(double));
    for (int attempt = 0; attempt < 1000; attempt++) {
        for (size_t i = 0; i < ly->n_params; i++)
            params[i] = frand(-0.8f, 0.8f);
        for (int i = 0; i < B * ly->dims[0]; i++)
            x[i] = frand(-1.0f, 1.0f);
        for (int i = 0; i < B; i++)
            labels[i] = (uint8_t)(urand() * ly->dims[ly->n_layers]);
        for (size_t i = 0; i < ly->n_params; i++)
            pd[i] = params[i];
        double zmin;
        ref_loss(ly, pd, x, labels, B, &zmin);
        if (zmin >= margin) {
            free(pd);
            return;
        }
    }
    free(pd);
    fail_msg("no random problem with ReLU inputs %g away from 0", margin);
}

/* Central differences in double, h = 1e-6 (truncation ~h^2, rounding ~1e-16/h). */
static void fd_grads(const mlp_layout *ly, const float *params, const float *x,
                     const uint8_t *labels, int B, double *fd)
{
    const double h = 1e-6;
    double *p = malloc(ly->n_params * sizeof(double));
    for (size_t i = 0; i < ly->n_params; i++)
        p[i] = params[i];
    for (size_t i = 0; i < ly->n_params; i++) {
        double keep = p[i];
        p[i] = keep + h;
        double up = ref_loss(ly, p, x, labels, B, NULL);
        p[i] = keep - h;
        double down = ref_loss(ly, p, x, labels, B, NULL);
        p[i] = keep;
        fd[i] = (up - down) / (2 * h);
    }
    free(p);
}

/* Largest |g - fd| / max(|g|, |fd|, floor): relative, except near zero where
 * an absolute error of floor * 1e-4 is what float arithmetic can promise. */
static double max_rel_err(const float *g, const double *fd, size_t n, double floor,
                          size_t *worst)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)g[i] - fd[i]);
        double s = fmax(fmax(fabs((double)g[i]), fabs(fd[i])), floor);
        if (!(d / s <= m)) { /* also catches NaN */
            m = isnan(d) ? INFINITY : d / s;
            if (worst)
                *worst = i;
        }
    }
    return m;
}

#define REL_TOL 1e-4
#define REL_FLOOR 1e-3

static void check_case(const model_case *mc, uint64_t seed)
{
    mlp_layout ly;
    char err[256] = "";
    lcg_state = seed;
    assert_int_equal(mlp_layout_init(&ly, mc->n_in, mc->hidden, mc->n_hidden, mc->n_out, err,
                                     sizeof(err)), 0);
    const int B = mc->batch;
    float *params = malloc(ly.n_params * sizeof(float));
    float *grads = malloc(ly.n_params * sizeof(float));
    double *fd = malloc(ly.n_params * sizeof(double));
    float *x = malloc((size_t)B * mc->n_in * sizeof(float));
    uint8_t *labels = malloc((size_t)B);
    random_problem(&ly, params, x, labels, B, 1e-3);

    mlp *m = mlp_new(&mlp_backend_cpu, &ly, B + 3, err, sizeof(err)); /* batch < max_batch */
    assert_non_null(m);
    for (size_t i = 0; i < ly.n_params; i++)
        grads[i] = NAN; /* every element must be written */
    double loss = NAN;
    assert_int_equal(mlp_forward_backward(m, params, x, labels, B, grads, &loss), 0);

    double *pd = malloc(ly.n_params * sizeof(double));
    for (size_t i = 0; i < ly.n_params; i++)
        pd[i] = params[i];
    double want = ref_loss(&ly, pd, x, labels, B, NULL);
    free(pd);
    assert_true(fabs(loss - want) <= 1e-5 * fmax(1.0, fabs(want)));

    fd_grads(&ly, params, x, labels, B, fd);
    size_t worst = 0;
    double e = max_rel_err(grads, fd, ly.n_params, REL_FLOOR, &worst);
    print_message("    %d", mc->n_in);
    for (int i = 0; i < mc->n_hidden; i++)
        print_message("-%d", mc->hidden[i]);
    print_message("-%d batch %d: loss %.6f, max rel err %.2e (param %zu: %g vs %g)\n", mc->n_out,
                  B, loss, e, worst, grads[worst], fd[worst]);
    assert_true(e <= REL_TOL);

    /* The check can fail: a gradient off by 0.1% in one element, or the sum
     * instead of the mean over the batch, is caught. */
    size_t big = 0;
    for (size_t i = 1; i < ly.n_params; i++)
        if (fabsf(grads[i]) > fabsf(grads[big]))
            big = i;
    float keep = grads[big];
    grads[big] = keep * 1.001f;
    assert_true(max_rel_err(grads, fd, ly.n_params, REL_FLOOR, NULL) > REL_TOL);
    grads[big] = keep;
    if (B > 1) {
        for (size_t i = 0; i < ly.n_params; i++)
            grads[i] *= (float)B;
        assert_true(max_rel_err(grads, fd, ly.n_params, REL_FLOOR, NULL) > REL_TOL);
    }

    mlp_free(m);
    free(params);
    free(grads);
    free(fd);
    free(x);
    free(labels);
}

static void test_gradients_finite_differences(void **state)
{
    (void)state;
    const model_case cases[] = {
        {7, {5}, 1, 3, 5},
        {6, {4, 4}, 2, 3, 5},
        {5, {0}, 0, 4, 5},          /* softmax regression */
        {9, {8, 3, 6}, 3, 10, 7},
        {4, {3}, 1, 2, 1},          /* batch of one, two classes */
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
        for (uint64_t seed = 1; seed <= 3; seed++)
            check_case(&cases[c], seed * 7919 + c);
}

static void test_layout_example_names(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256];
    int h[] = {100};
    assert_int_equal(mlp_layout_init(&ly, 784, h, 1, 10, err, sizeof(err)), 0);
    assert_int_equal(ly.n_layers, 2);
    assert_int_equal(ly.n_tensors, 4);
    const struct { const char *name; int ndim; int64_t d0, d1; size_t off; } want[] = {
        {"hid_w", 2, 784, 100, 0},
        {"hid_b", 1, 100, 0, 78400},
        {"sm_w", 2, 100, 10, 78500},
        {"sm_b", 1, 10, 0, 79500},
    };
    for (int i = 0; i < 4; i++) {
        const mlp_tensor *t = &ly.tensors[i];
        assert_string_equal(t->name, want[i].name);
        assert_int_equal(t->shape.ndim, want[i].ndim);
        assert_int_equal(t->shape.dims[0], want[i].d0);
        if (want[i].ndim == 2)
            assert_int_equal(t->shape.dims[1], want[i].d1);
        assert_int_equal(t->offset, want[i].off);
        assert_int_equal(t->numel, (size_t)tensor_shape_numel(&t->shape));
        assert_int_equal(mlp_layout_find(&ly, want[i].name), i);
        char e2[128];
        assert_int_equal(tensor_name_check(t->name, e2, sizeof(e2)), 0);
    }
    assert_int_equal(ly.n_params, 79510);
    assert_int_equal(mlp_layout_find(&ly, "hid0_w"), -1);
}

static void test_layout_deep_names(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256];
    int h[] = {256, 128};
    assert_int_equal(mlp_layout_init(&ly, 784, h, 2, 10, err, sizeof(err)), 0);
    const char *names[] = {"hid0_w", "hid0_b", "hid1_w", "hid1_b", "sm_w", "sm_b"};
    const int64_t d0[] = {784, 256, 256, 128, 128, 10};
    size_t off = 0;
    assert_int_equal(ly.n_tensors, 6);
    for (int i = 0; i < 6; i++) {
        assert_string_equal(ly.tensors[i].name, names[i]);
        assert_int_equal(ly.tensors[i].shape.dims[0], d0[i]);
        assert_int_equal(ly.tensors[i].offset, off); /* packed, in order */
        off += ly.tensors[i].numel;
    }
    assert_int_equal(ly.n_params, off);
    assert_int_equal(off, 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);

    assert_int_equal(mlp_layout_init(&ly, 5, NULL, 0, 3, err, sizeof(err)), 0);
    assert_int_equal(ly.n_tensors, 2);
    assert_string_equal(ly.tensors[0].name, "sm_w");
    assert_string_equal(ly.tensors[1].name, "sm_b");
}

static void test_layout_rejects(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256] = "";
    int h[MLP_MAX_HIDDEN + 1] = {4, 4, 4, 4, 4, 4, 4, 4, 4};
    int bad[] = {4, 0};
    assert_true(mlp_layout_init(&ly, 0, h, 1, 10, err, sizeof(err)) < 0);
    assert_true(err[0]);
    assert_true(mlp_layout_init(&ly, 784, h, 1, 1, err, sizeof(err)) < 0);
    assert_true(mlp_layout_init(&ly, 784, bad, 2, 10, err, sizeof(err)) < 0);
    assert_non_null(strstr(err, "hidden layer 1"));
    assert_true(mlp_layout_init(&ly, 784, h, MLP_MAX_HIDDEN + 1, 10, err, sizeof(err)) < 0);
    assert_int_equal(mlp_layout_init(&ly, 784, h, MLP_MAX_HIDDEN, 10, err, sizeof(err)), 0);
    int huge[] = {MLP_MAX_DIM, MLP_MAX_DIM};
    assert_true(mlp_layout_init(&ly, MLP_MAX_DIM, huge, 2, 10, err, sizeof(err)) < 0);
    assert_non_null(strstr(err, "parameters"));
}

static void test_parse_hidden(void **state)
{
    (void)state;
    int h[MLP_MAX_HIDDEN], n = -1;
    char err[256];
    assert_int_equal(mlp_parse_hidden("100", h, &n, err, sizeof(err)), 0);
    assert_int_equal(n, 1);
    assert_int_equal(h[0], 100);
    assert_int_equal(mlp_parse_hidden("256,128", h, &n, err, sizeof(err)), 0);
    assert_int_equal(n, 2);
    assert_int_equal(h[1], 128);
    assert_int_equal(mlp_parse_hidden("", h, &n, err, sizeof(err)), 0);
    assert_int_equal(n, 0);
    const char *bad[] = {"0", "-5", "10,", ",10", "10,,5", "abc", "10x", "1,2,3,4,5,6,7,8,9",
                         "99999999999"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_true(mlp_parse_hidden(bad[i], h, &n, err, sizeof(err)) < 0);
}

static void test_zero_model_loss_is_log_n_out(void **state)
{
    (void)state;
    const int outs[] = {10, 3, 2};
    for (size_t c = 0; c < 3; c++) {
        mlp_layout ly;
        char err[256];
        int h[] = {16, 8};
        int C = outs[c], B = 12;
        assert_int_equal(mlp_layout_init(&ly, 20, h, 2, C, err, sizeof(err)), 0);
        float *params = calloc(ly.n_params, sizeof(float));
        float *grads = malloc(ly.n_params * sizeof(float));
        float x[12 * 20];
        uint8_t labels[12];
        lcg_state = 99 + c;
        for (int i = 0; i < B * 20; i++)
            x[i] = frand(0, 1);
        int freq[10] = {0};
        for (int i = 0; i < B; i++) {
            labels[i] = (uint8_t)(i * 7 % C);
            freq[labels[i]]++;
        }
        mlp *m = mlp_new(&mlp_backend_cpu, &ly, B, err, sizeof(err));
        assert_non_null(m);
        double loss;
        assert_int_equal(mlp_forward_backward(m, params, x, labels, B, grads, &loss), 0);
        assert_true(fabs(loss - log((double)C)) < 1e-6);
        /* every logit 0: dL/dsm_b[j] = 1/C - freq[j]/B; everything else 0 */
        const mlp_tensor *smb = &ly.tensors[mlp_layout_find(&ly, "sm_b")];
        for (size_t i = 0; i < ly.n_params; i++) {
            if (i >= smb->offset && i < smb->offset + smb->numel) {
                int j = (int)(i - smb->offset);
                assert_true(fabs(grads[i] - (1.0 / C - (double)freq[j] / B)) < 1e-6);
            } else {
                assert_true(grads[i] == 0.0f);
            }
        }
        double el, acc;
        assert_int_equal(mlp_evaluate(m, params, x, labels, B, &el, &acc), 0);
        assert_true(fabs(el - log((double)C)) < 1e-6);
        /* all logits tie: the first class wins */
        assert_true(fabs(acc - (double)freq[0] / B) < 1e-12);
        mlp_free(m);
        free(params);
        free(grads);
    }
}

static void test_init_statistics(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256];
    int h[] = {100};
    assert_int_equal(mlp_layout_init(&ly, 784, h, 1, 10, err, sizeof(err)), 0);
    float *p = malloc(ly.n_params * sizeof(float));
    float *q = malloc(ly.n_params * sizeof(float));
    memset(p, 0x7f, ly.n_params * sizeof(float));
    mlp_init_params(&ly, p, 2017);

    /* A standard normal truncated to [-2, 2]: std sqrt(1 - 4 phi(2) / (2 Phi(2) - 1))
     * = 0.87962; P(|z| > 1) = (0.95450 - 0.68269) / 0.95450 = 0.28477. */
    const double tstd = 0.879626, tout = 0.284766;
    for (int t = 0; t < ly.n_tensors; t++) {
        const mlp_tensor *T = &ly.tensors[t];
        const float *v = p + T->offset;
        if (T->shape.ndim == 1) {
            for (size_t i = 0; i < T->numel; i++)
                assert_true(v[i] == 0.0f);
            continue;
        }
        double sd = 1.0 / sqrt((double)T->shape.dims[0]); /* 1/28, then 1/10 */
        double sum = 0, sq = 0, mx = 0;
        size_t beyond1 = 0;
        for (size_t i = 0; i < T->numel; i++) {
            double z = v[i] / sd;
            assert_true(fabs(z) <= 2.0 + 1e-6); /* truncated at 2 stddev */
            sum += z;
            sq += z * z;
            mx = fmax(mx, fabs(z));
            beyond1 += fabs(z) > 1.0;
        }
        double n = (double)T->numel, mean = sum / n, std = sqrt(sq / n - mean * mean);
        double frac = (double)beyond1 / n;
        print_message("    %s: n %zu, mean %+.4f sd, std %.4f sd (want %.4f), max |z| %.4f, "
                      "P(|z|>1) %.4f (want %.4f)\n",
                      T->name, T->numel, mean, std, tstd, mx, frac, tout);
        /* tolerances: 5 standard errors of each estimate */
        assert_true(fabs(mean) < 5 * tstd / sqrt(n));
        assert_true(fabs(std - tstd) < 5 * 0.6 / sqrt(n) + 1e-3);
        assert_true(fabs(frac - tout) < 5 * sqrt(tout * (1 - tout) / n));
        assert_true(mx > 1.9); /* reaches out to the cut, not beyond */
    }
    /* deterministic in the seed, different for another */
    mlp_init_params(&ly, q, 2017);
    assert_memory_equal(p, q, ly.n_params * sizeof(float));
    mlp_init_params(&ly, q, 2018);
    assert_memory_not_equal(p, q, 100 * sizeof(float));
    free(p);
    free(q);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256] = "";
    int h[] = {4};
    assert_int_equal(mlp_layout_init(&ly, 3, h, 1, 3, err, sizeof(err)), 0);
    assert_null(mlp_new(&mlp_backend_cpu, &ly, 0, err, sizeof(err)));
    assert_true(err[0]);
    mlp *m = mlp_new(&mlp_backend_cpu, &ly, 4, err, sizeof(err));
    assert_non_null(m);
    float params[64] = {0}, grads[64], x[5 * 3] = {0};
    uint8_t labels[5] = {0, 1, 2, 0, 1};
    double loss, acc;
    assert_true(mlp_forward_backward(m, params, x, labels, 0, grads, &loss) < 0);
    assert_true(mlp_forward_backward(m, params, x, labels, 5, grads, &loss) < 0); /* > max */
    labels[2] = 3; /* >= n_out */
    assert_true(mlp_forward_backward(m, params, x, labels, 4, grads, &loss) < 0);
    assert_true(mlp_evaluate(m, params, x, labels, 4, &loss, &acc) < 0);
    labels[2] = 2;
    assert_true(mlp_evaluate(m, params, x, labels, 0, &loss, &acc) < 0);
    assert_int_equal(mlp_forward_backward(m, params, x, labels, 4, grads, &loss), 0);
    mlp_free(m);
    mlp_free(NULL);
    const char *core = mlp_cpu_blas_core();
    assert_non_null(core);
    assert_true(core[0] != '\0');
    print_message("    OpenBLAS core: %s (%s)\n", core, blas_kernel_reason());
}

/* mlp_host_alloc on the CPU backend (no host_alloc in its table: calloc) and
 * with no instance: zeroed, writable, freed by mlp_host_free (ASan checks the
 * pairing), and a step on such buffers equals one on ordinary buffers. */
static void test_host_alloc(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256] = "";
    int h[] = {4};
    assert_int_equal(mlp_layout_init(&ly, 3, h, 1, 3, err, sizeof(err)), 0);
    mlp *m = mlp_new(&mlp_backend_cpu, &ly, 4, err, sizeof(err));
    assert_non_null(m);
    assert_null(mlp_backend_cpu.host_alloc);
    const size_t P = ly.n_params;
    float params[64], grads[64], x[4 * 3];
    uint8_t labels[4] = {0, 1, 2, 0};
    assert_true(P <= 64);
    float *hp = mlp_host_alloc(m, P * sizeof(float)), *hg = mlp_host_alloc(m, P * sizeof(float));
    float *hx = mlp_host_alloc(m, sizeof(x));
    uint8_t *hy = mlp_host_alloc(m, sizeof(labels));
    unsigned char *none = mlp_host_alloc(NULL, 100), *empty = mlp_host_alloc(m, 0);
    assert_non_null(hp);
    assert_non_null(hg);
    assert_non_null(hx);
    assert_non_null(hy);
    assert_non_null(none);
    for (size_t i = 0; i < P; i++)
        assert_true(hp[i] == 0.0f && hg[i] == 0.0f);
    for (int i = 0; i < 100; i++)
        assert_int_equal(none[i], 0);
    mlp_init_params(&ly, params, 5);
    for (int i = 0; i < 12; i++)
        x[i] = (float)(i % 5) / 4.0f;
    memcpy(hp, params, P * sizeof(float));
    memcpy(hx, x, sizeof(x));
    memcpy(hy, labels, sizeof(labels));
    double l1 = 0, l2 = 0;
    assert_int_equal(mlp_forward_backward(m, params, x, labels, 4, grads, &l1), 0);
    assert_int_equal(mlp_forward_backward(m, hp, hx, hy, 4, hg, &l2), 0);
    assert_true(l1 == l2);
    assert_memory_equal(grads, hg, P * sizeof(float));
    mlp_host_free(m, hp);
    mlp_host_free(m, hg);
    mlp_host_free(m, hx);
    mlp_host_free(m, hy);
    mlp_host_free(m, empty);
    mlp_host_free(m, NULL);
    mlp_host_free(NULL, none);
    mlp_free(m);
}

/* mlp_stage_batch on the CPU backend (no stage_batch in its table): bad
 * arguments refused on every backend by the front door, good ones a no-op
 * returning 0; a step on a staged batch, and a step on another batch after
 * one was staged, equal the same steps without staging, bit for bit. */
static void test_stage_batch(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256] = "";
    int h[] = {5};
    assert_int_equal(mlp_layout_init(&ly, 3, h, 1, 3, err, sizeof(err)), 0);
    mlp *m = mlp_new(&mlp_backend_cpu, &ly, 4, err, sizeof(err));
    assert_non_null(m);
    assert_null(mlp_backend_cpu.stage_batch);
    const size_t P = ly.n_params;
    float params[64], g_ref[2][64], g[64], xa[4 * 3], xb[4 * 3];
    uint8_t ya[4] = {0, 1, 2, 0}, yb[4] = {2, 2, 1, 0};
    assert_true(P <= 64);
    mlp_init_params(&ly, params, 9);
    for (int i = 0; i < 12; i++) {
        xa[i] = (float)(i % 5) / 4.0f;
        xb[i] = (float)((i * 7) % 3) / 2.0f;
    }
    assert_true(mlp_stage_batch(NULL, xa, ya, 4) < 0);
    assert_true(mlp_stage_batch(m, NULL, ya, 4) < 0);
    assert_true(mlp_stage_batch(m, xa, NULL, 4) < 0);
    assert_true(mlp_stage_batch(m, xa, ya, 0) < 0);
    assert_true(mlp_stage_batch(m, xa, ya, 5) < 0); /* > max_batch */
    double la, lb, l;
    assert_int_equal(mlp_forward_backward(m, params, xa, ya, 4, g_ref[0], &la), 0);
    assert_int_equal(mlp_forward_backward(m, params, xb, yb, 4, g_ref[1], &lb), 0);
    assert_true(la != lb);
    /* staged, then used */
    assert_int_equal(mlp_stage_batch(m, xa, ya, 4), 0);
    assert_int_equal(mlp_forward_backward(m, params, xa, ya, 4, g, &l), 0);
    assert_true(l == la);
    assert_memory_equal(g, g_ref[0], P * sizeof(float));
    /* staged, then another batch: that one's result */
    assert_int_equal(mlp_stage_batch(m, xa, ya, 4), 0);
    assert_int_equal(mlp_forward_backward(m, params, xb, yb, 4, g, &l), 0);
    assert_true(l == lb);
    assert_memory_equal(g, g_ref[1], P * sizeof(float));
    /* staged twice (the second replaces the first), then a smaller batch
     * from the same buffer: no stale staging */
    assert_int_equal(mlp_stage_batch(m, xb, yb, 4), 0);
    assert_int_equal(mlp_stage_batch(m, xa, ya, 4), 0);
    assert_int_equal(mlp_forward_backward(m, params, xa, ya, 4, g, &l), 0);
    assert_true(l == la);
    assert_int_equal(mlp_stage_batch(m, xa, ya, 4), 0);
    assert_int_equal(mlp_forward_backward(m, params, xa, ya, 3, g, &l), 0);
    assert_true(l != la);
    mlp_free(m);
}

/* evaluate in batches of max_batch (n not a multiple) against the reference. */
static void test_evaluate_matches_reference(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256];
    int h[] = {12, 7};
    assert_int_equal(mlp_layout_init(&ly, 10, h, 2, 5, err, sizeof(err)), 0);
    const int n = 23;
    float *params = malloc(ly.n_params * sizeof(float));
    float x[23 * 10];
    uint8_t labels[23];
    lcg_state = 4242;
    random_problem(&ly, params, x, labels, n, 0);
    double *pd = malloc(ly.n_params * sizeof(double));
    for (size_t i = 0; i < ly.n_params; i++)
        pd[i] = params[i];
    double want_loss = ref_loss(&ly, pd, x, labels, n, NULL);
    /* reference accuracy: argmax of each example's logits, one at a time */
    int correct = 0;
    for (int i = 0; i < n; i++) {
        int best = -1;
        double bl = INFINITY;
        for (int c = 0; c < 5; c++) { /* the loss with label c is smallest for the argmax */
            uint8_t l = (uint8_t)c;
            double v = ref_loss(&ly, pd, x + i * 10, &l, 1, NULL);
            if (v < bl) {
                bl = v;
                best = c;
            }
        }
        correct += best == labels[i];
    }
    for (int mb = 1; mb <= 30; mb += 4) {
        mlp *m = mlp_new(&mlp_backend_cpu, &ly, mb, err, sizeof(err));
        double loss, acc;
        assert_int_equal(mlp_evaluate(m, params, x, labels, n, &loss, &acc), 0);
        assert_true(fabs(loss - want_loss) < 1e-5 * fmax(1, want_loss));
        assert_true(fabs(acc - (double)correct / n) < 1e-12);
        mlp_free(m);
    }
    print_message("    eval: loss %.6f, accuracy %d/%d\n", want_loss, correct, n);
    free(pd);
    free(params);
}

/* Plain SGD on three separable Gaussian blobs learns them: the gradients point
 * downhill over many steps, not just at one point. */
static void test_sgd_learns_blobs(void **state)
{
    (void)state;
    mlp_layout ly;
    char err[256];
    int h[] = {16};
    assert_int_equal(mlp_layout_init(&ly, 6, h, 1, 3, err, sizeof(err)), 0);
    float *params = malloc(ly.n_params * sizeof(float));
    float *grads = malloc(ly.n_params * sizeof(float));
    mlp_init_params(&ly, params, 5);
    enum { N = 300, B = 20 };
    float x[N * 6];
    uint8_t y[N];
    lcg_state = 77;
    for (int i = 0; i < N; i++) {
        y[i] = (uint8_t)(i % 3);
        for (int k = 0; k < 6; k++)
            x[i * 6 + k] = (k % 3 == y[i] ? 1.5f : 0.0f) + frand(-0.5f, 0.5f);
    }
    mlp *m = mlp_new(&mlp_backend_cpu, &ly, B, err, sizeof(err));
    double loss0, acc0, loss, acc;
    assert_int_equal(mlp_evaluate(m, params, x, y, N, &loss0, &acc0), 0);
    for (int step = 0; step < 300; step++) {
        int s = (step * B) % N;
        double l;
        assert_int_equal(mlp_forward_backward(m, params, x + s * 6, y + s, B, grads, &l), 0);
        for (size_t i = 0; i < ly.n_params; i++)
            params[i] -= 0.5f * grads[i];
    }
    assert_int_equal(mlp_evaluate(m, params, x, y, N, &loss, &acc), 0);
    print_message("    blobs: loss %.4f -> %.4f, accuracy %.3f -> %.3f\n", loss0, loss, acc0, acc);
    assert_true(loss < 0.1 * loss0);
    assert_true(acc > 0.99);
    mlp_free(m);
    free(params);
    free(grads);
}

int main(int argc, char **argv)
{
    (void)argc;
    char err[512];
    /* the kernel workerd would use (may re-execute this test) */
    if (blas_kernel_choose(argv, err, sizeof(err)) != 0) {
        fprintf(stderr, "test_mlp: %s\n", err);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_example_names),
        cmocka_unit_test(test_layout_deep_names),
        cmocka_unit_test(test_layout_rejects),
        cmocka_unit_test(test_parse_hidden),
        cmocka_unit_test(test_gradients_finite_differences),
        cmocka_unit_test(test_zero_model_loss_is_log_n_out),
        cmocka_unit_test(test_init_statistics),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_host_alloc),
        cmocka_unit_test(test_stage_batch),
        cmocka_unit_test(test_evaluate_matches_reference),
        cmocka_unit_test(test_sgd_learns_blobs),
    };
    return cmocka_run_group_tests_name("mlp", tests, NULL, NULL);
}
