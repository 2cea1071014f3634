/* test_model.c - the layer library: the spec parser (model_spec.c), the
 * layouts and the initialization (model.c), and the CPU backend (model_cpu.c).
 * Every layer type's gradients, and a whole small CNN's, are checked against
 * central finite differences of a double-precision forward written here from
 * the formulas of model.h (direct loops: no im2col, no BLAS, no shared code);
 * the dropout mask against values computed by hand from the contract (Python
 * integers); TensorFlow's padding against hand-worked sizes. (mlp:100 was
 * checked bit for bit against the MLP-only mlp_cpu.c, loss, gradients and
 * evaluation, before that code was removed: commit 2f07a4e's test.) */
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

#include "model/dropout_mask.h"
#include "model/model.h"

static const model_shape IMG = {28, 28, 1};

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

/* ---- the contract's mask, written again ---- */

static uint64_t ref_mix64(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

static int ref_keep(uint64_t s, int64_t t, int64_t e, uint64_t li, uint64_t u, float R)
{
    uint64_t h = ref_mix64(s + 0x9E3779B97F4A7C15ULL * (uint64_t)(t + 1));
    h = ref_mix64(h ^ (uint64_t)e);
    h = ref_mix64(h ^ ((li << 32) | u));
    float r = (float)(h >> 40) * (1.0f / 16777216.0f);
    return r >= R;
}

/* ---- double-precision reference ---- */

typedef struct ref_stats {
    double zmin;   /* smallest |input| of a ReLU (distance to its kink) */
    double gapmin; /* smallest gap between a pooling window's two largest inputs */
} ref_stats;

static void ref_layer(const model_layout *ly, int li, const double *p, const double *in, int B,
                      const model_ctx *ctx, double *out, ref_stats *st)
{
    const model_layer *l = &ly->layers[li];
    const size_t ni = l->in_numel, no = l->out_numel;
    switch (l->kind) {
    case LAYER_DENSE: {
        const double *W = p + ly->tensors[l->w].offset, *b = p + ly->tensors[l->b].offset;
        for (int i = 0; i < B; i++)
            for (size_t j = 0; j < no; j++) {
                double s = b[j];
                for (size_t k = 0; k < ni; k++)
                    s += in[i * ni + k] * W[k * no + j];
                out[i * no + j] = s;
            }
        break;
    }
    case LAYER_CONV2D: {
        const double *W = p + ly->tensors[l->w].offset, *b = p + ly->tensors[l->b].offset;
        const int H = l->in.h, Wd = l->in.w, C = l->in.c, OC = l->out.c;
        for (int e = 0; e < B; e++)
            for (int oy = 0; oy < l->out.h; oy++)
                for (int ox = 0; ox < l->out.w; ox++)
                    for (int co = 0; co < OC; co++) {
                        double s = b[co];
                        for (int ky = 0; ky < l->kh; ky++)
                            for (int kx = 0; kx < l->kw; kx++) {
                                int iy = oy * l->stride - l->pad_top + ky;
                                int ix = ox * l->stride - l->pad_left + kx;
                                if (iy < 0 || iy >= H || ix < 0 || ix >= Wd)
                                    continue;
                                for (int ci = 0; ci < C; ci++)
                                    s += in[e * ni + ((size_t)iy * Wd + ix) * C + ci] *
                                         W[(((size_t)ky * l->kw + kx) * C + ci) * OC + co];
                            }
                        out[e * no + ((size_t)oy * l->out.w + ox) * OC + co] = s;
                    }
        break;
    }
    case LAYER_MAXPOOL: {
        const int H = l->in.h, Wd = l->in.w, C = l->in.c;
        for (int e = 0; e < B; e++)
            for (int oy = 0; oy < l->out.h; oy++)
                for (int ox = 0; ox < l->out.w; ox++)
                    for (int c = 0; c < C; c++) {
                        double best = -INFINITY, second = -INFINITY;
                        for (int ky = 0; ky < l->kh; ky++)
                            for (int kx = 0; kx < l->kw; kx++) {
                                int iy = oy * l->stride - l->pad_top + ky;
                                int ix = ox * l->stride - l->pad_left + kx;
                                if (iy < 0 || iy >= H || ix < 0 || ix >= Wd)
                                    continue;
                                double v = in[e * ni + ((size_t)iy * Wd + ix) * C + c];
                                if (v > best) {
                                    second = best;
                                    best = v;
                                } else if (v > second) {
                                    second = v;
                                }
                            }
                        out[e * no + ((size_t)oy * l->out.w + ox) * C + c] = best;
                        /* a tie at 0 (ReLU outputs) passes no gradient either way */
                        if (st && second > -INFINITY && best != 0.0 && best - second < st->gapmin)
                            st->gapmin = best - second;
                    }
        break;
    }
    case LAYER_RELU:
        for (size_t k = 0; k < (size_t)B * ni; k++) {
            out[k] = in[k] > 0 ? in[k] : 0;
            if (st && fabs(in[k]) < st->zmin)
                st->zmin = fabs(in[k]);
        }
        break;
    case LAYER_DROPOUT:
        for (int i = 0; i < B; i++) {
            int64_t e = ctx ? (ctx->example ? ctx->example[i] : ctx->example0 + i) : i;
            for (size_t u = 0; u < ni; u++) {
                int keep = ctx && ctx->inference
                               ? 1
                               : ref_keep(ctx ? ctx->seed : 0, ctx ? ctx->step : 0, e,
                                          (uint64_t)l->dropout_index, u, l->rate);
                double scale = ctx && ctx->inference ? 1.0 : (double)(1.0f / (1.0f - l->rate));
                out[i * ni + u] = keep ? in[i * ni + u] * scale : 0;
            }
        }
        break;
    case LAYER_FLATTEN:
        memcpy(out, in, (size_t)B * ni * sizeof(double));
        break;
    }
}

/* Layers first..last on in into out (both B * the sizes). */
static void ref_range(const model_layout *ly, int first, int last, const double *p, const double *in,
                      int B, const model_ctx *ctx, double *out, ref_stats *st)
{
    size_t cap = (size_t)B * ly->max_act;
    double *a = malloc(cap * sizeof(double)), *b = malloc(cap * sizeof(double));
    memcpy(a, in, (size_t)B * ly->layers[first].in_numel * sizeof(double));
    for (int li = first; li <= last; li++) {
        ref_layer(ly, li, p, a, B, ctx, b, st);
        double *t = a;
        a = b;
        b = t;
    }
    memcpy(out, a, (size_t)B * ly->layers[last].out_numel * sizeof(double));
    free(a);
    free(b);
}

static double ref_ce(const double *z, const uint8_t *labels, int B, int C)
{
    double total = 0;
    for (int i = 0; i < B; i++) {
        const double *zi = z + (size_t)i * C;
        double mx = zi[0], s = 0;
        for (int j = 1; j < C; j++)
            mx = zi[j] > mx ? zi[j] : mx;
        for (int j = 0; j < C; j++)
            s += exp(zi[j] - mx);
        total += mx + log(s) - zi[labels[i]];
    }
    return total / B;
}

static double ref_loss(const model_layout *ly, const double *p, const double *x, const uint8_t *labels,
                       int B, const model_ctx *ctx, ref_stats *st)
{
    double *z = malloc((size_t)B * ly->n_classes * sizeof(double));
    ref_range(ly, 0, ly->n_layers - 1, p, x, B, ctx, z, st);
    double l = ref_ce(z, labels, B, ly->n_classes);
    free(z);
    return l;
}

/* Largest |g - fd| / max(|g|, |fd|, floor). */
static double max_rel_err(const float *g, const double *fd, size_t n, double floor, size_t *worst)
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

#define REL_TOL 2e-4
#define REL_FLOOR 1e-3
#define FD_H 1e-6
#define KINK_MARGIN 2e-5

static double *to_double(const float *f, size_t n)
{
    double *d = malloc((n ? n : 1) * sizeof(double));
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

static void layout_or_fail(model_layout *ly, const char *spec, model_shape in)
{
    char err[512] = "";
    if (model_layout_init(ly, spec, in, 10, err, sizeof(err)) != 0)
        fail_msg("%s: %s", spec, err);
}

/* ---- the spec and the layouts ---- */

static void expect_tensor(const model_layout *ly, int i, const char *name, int ndim, const int64_t *dims,
                          size_t offset)
{
    const model_tensor *t = &ly->tensors[i];
    assert_string_equal(t->name, name);
    assert_int_equal(t->shape.ndim, ndim);
    size_t n = 1;
    for (int k = 0; k < ndim; k++) {
        assert_int_equal(t->shape.dims[k], dims[k]);
        n *= (size_t)dims[k];
    }
    assert_int_equal(t->numel, n);
    assert_int_equal(t->offset, offset);
    assert_int_equal(model_layout_find(ly, name), i);
}

static void test_layout_mlp(void **state)
{
    (void)state;
    model_layout ly;
    layout_or_fail(&ly, "mlp:100", IMG);
    assert_string_equal(ly.spec, "mlp:100");
    assert_int_equal(ly.n_tensors, 4);
    expect_tensor(&ly, 0, "hid_w", 2, (int64_t[]){784, 100}, 0);
    expect_tensor(&ly, 1, "hid_b", 1, (int64_t[]){100}, 78400);
    expect_tensor(&ly, 2, "sm_w", 2, (int64_t[]){100, 10}, 78500);
    expect_tensor(&ly, 3, "sm_b", 1, (int64_t[]){10}, 79500);
    assert_int_equal(ly.n_params, 79510);
    const layer_kind kinds[] = {LAYER_FLATTEN, LAYER_DENSE, LAYER_RELU, LAYER_DENSE};
    assert_int_equal(ly.n_layers, 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(ly.layers[i].kind, kinds[i]);
    assert_int_equal(model_layout_find(&ly, "nope"), -1);

    layout_or_fail(&ly, "mlp:256,128", IMG);
    assert_int_equal(ly.n_tensors, 6);
    expect_tensor(&ly, 0, "hid0_w", 2, (int64_t[]){784, 256}, 0);
    expect_tensor(&ly, 2, "hid1_w", 2, (int64_t[]){256, 128}, 784 * 256 + 256);
    expect_tensor(&ly, 5, "sm_b", 1, (int64_t[]){10}, ly.n_params - 10);

    layout_or_fail(&ly, "mlp:", IMG); /* softmax regression */
    assert_string_equal(ly.spec, "mlp:");
    assert_int_equal(ly.n_tensors, 2);
    expect_tensor(&ly, 0, "sm_w", 2, (int64_t[]){784, 10}, 0);
    assert_int_equal(ly.n_params, 7850);

    /* a flat input has no flatten */
    layout_or_fail(&ly, "mlp:5", (model_shape){1, 1, 7});
    assert_int_equal(ly.layers[0].kind, LAYER_DENSE);
    assert_int_equal(ly.n_layers, 3);
}

static void test_layout_cnn(void **state)
{
    (void)state;
    model_layout ly, ly2;
    layout_or_fail(&ly, "cnn", IMG);
    assert_string_equal(ly.spec, "conv:5x5x32/1:same,pool:2/2:same,conv:5x5x64/1:same,pool:2/2:same,"
                                 "dense:1024,dropout:0.4,dense:10");
    expect_tensor(&ly, 0, "conv0_w", 4, (int64_t[]){5, 5, 1, 32}, 0);
    expect_tensor(&ly, 1, "conv0_b", 1, (int64_t[]){32}, 800);
    expect_tensor(&ly, 2, "conv1_w", 4, (int64_t[]){5, 5, 32, 64}, 832);
    expect_tensor(&ly, 3, "conv1_b", 1, (int64_t[]){64}, 52032);
    expect_tensor(&ly, 4, "fc0_w", 2, (int64_t[]){3136, 1024}, 52096);
    expect_tensor(&ly, 5, "fc0_b", 1, (int64_t[]){1024}, 52096 + 3136 * 1024);
    expect_tensor(&ly, 6, "sm_w", 2, (int64_t[]){1024, 10}, 52096 + 3136 * 1024 + 1024);
    expect_tensor(&ly, 7, "sm_b", 1, (int64_t[]){10}, 52096 + 3136 * 1024 + 1024 + 10240);
    assert_int_equal(ly.n_params, 3274634); /* the tutorial's model's count */
    const layer_kind kinds[] = {LAYER_CONV2D, LAYER_RELU, LAYER_MAXPOOL, LAYER_CONV2D, LAYER_RELU,
                                LAYER_MAXPOOL, LAYER_FLATTEN, LAYER_DENSE, LAYER_RELU, LAYER_DROPOUT,
                                LAYER_DENSE};
    assert_int_equal(ly.n_layers, 11);
    for (int i = 0; i < 11; i++)
        assert_int_equal(ly.layers[i].kind, kinds[i]);
    assert_int_equal(ly.layers[2].out.h, 14);
    assert_int_equal(ly.layers[5].out.h, 7);
    assert_int_equal(ly.layers[5].out.c, 64);
    assert_int_equal(ly.layers[0].pad_top, 2);
    assert_int_equal(ly.layers[0].pad_bottom, 2);
    assert_true(ly.layers[9].rate == 0.4f);
    assert_true(ly.layers[9].scale == 1.0f / (1.0f - 0.4f));
    assert_int_equal(ly.n_dropout, 1);
    /* the canonical spec gives the same layout back */
    layout_or_fail(&ly2, ly.spec, IMG);
    assert_string_equal(ly2.spec, ly.spec);
    assert_memory_equal(&ly2, &ly, sizeof(ly));
}

static void test_layout_list(void **state)
{
    (void)state;
    model_layout ly, ly2;
    layout_or_fail(&ly, "conv:3x3x8/2:valid,pool:3/1,dense:16,dropout:0.25,dense:10", IMG);
    assert_string_equal(ly.spec, "conv:3x3x8/2:valid,pool:3/1:same,dense:16,dropout:0.25,dense:10");
    const layer_kind kinds[] = {LAYER_CONV2D, LAYER_RELU, LAYER_MAXPOOL, LAYER_FLATTEN,
                                LAYER_DENSE, LAYER_RELU, LAYER_DROPOUT, LAYER_DENSE};
    assert_int_equal(ly.n_layers, 8);
    for (int i = 0; i < 8; i++)
        assert_int_equal(ly.layers[i].kind, kinds[i]);
    assert_int_equal(ly.layers[0].out.h, 13); /* ceil((28 - 3 + 1) / 2) */
    assert_int_equal(ly.layers[0].pad_top + ly.layers[0].pad_bottom, 0);
    assert_int_equal(ly.layers[2].out.h, 13); /* same, stride 1 */
    assert_int_equal(ly.layers[2].pad_top, 1);
    assert_int_equal(ly.layers[2].pad_bottom, 1);
    expect_tensor(&ly, 0, "conv0_w", 4, (int64_t[]){3, 3, 1, 8}, 0);
    expect_tensor(&ly, 1, "conv0_b", 1, (int64_t[]){8}, 72);
    expect_tensor(&ly, 2, "fc0_w", 2, (int64_t[]){1352, 16}, 80);
    expect_tensor(&ly, 3, "fc0_b", 1, (int64_t[]){16}, 21712);
    expect_tensor(&ly, 4, "sm_w", 2, (int64_t[]){16, 10}, 21728);
    expect_tensor(&ly, 5, "sm_b", 1, (int64_t[]){10}, 21888);
    assert_int_equal(ly.n_params, 21898);
    assert_int_equal(ly.tensors[0].fan_in, 9);
    assert_int_equal(ly.tensors[2].fan_in, 1352);
    assert_int_equal(ly.tensors[1].fan_in, 0);
    layout_or_fail(&ly2, ly.spec, IMG);
    assert_memory_equal(&ly2, &ly, sizeof(ly));
    /* a dense list without conv: fc names, and a two-dropout ordinal */
    layout_or_fail(&ly, "dense:8,dropout:0.5,dense:4,dropout:0.1,dense:10", IMG);
    assert_string_equal(ly.tensors[0].name, "fc0_w");
    assert_string_equal(ly.tensors[2].name, "fc1_w");
    assert_string_equal(ly.tensors[4].name, "sm_w");
    int seen = 0;
    for (int i = 0; i < ly.n_layers; i++)
        if (ly.layers[i].kind == LAYER_DROPOUT)
            assert_int_equal(ly.layers[i].dropout_index, seen++);
    assert_int_equal(seen, 2);
    /* only the logits layer: softmax regression as a list */
    layout_or_fail(&ly, "dense:10", IMG);
    assert_int_equal(ly.n_tensors, 2);
    assert_string_equal(ly.tensors[0].name, "sm_w");
}

static void test_tf_padding(void **state)
{
    (void)state;
    struct { int in, k, s, same, out, before, after; } c[] = {
        {28, 5, 1, 1, 28, 2, 2}, {28, 2, 2, 1, 14, 0, 0}, {7, 2, 2, 1, 4, 0, 1},
        {5, 4, 3, 1, 2, 1, 1},   {6, 3, 2, 1, 3, 0, 1},   {1, 5, 1, 1, 1, 2, 2},
        {28, 5, 1, 0, 24, 0, 0}, {28, 5, 2, 0, 12, 0, 0}, {7, 2, 2, 0, 3, 0, 0},
        {5, 5, 3, 0, 1, 0, 0},   {3, 4, 1, 1, 3, 1, 2},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        int out = -1, b = -1, a = -1;
        assert_int_equal(model_tf_padding(c[i].in, c[i].k, c[i].s, c[i].same, &out, &b, &a), 0);
        if (out != c[i].out || b != c[i].before || a != c[i].after)
            fail_msg("in %d k %d s %d %s: got %d (%d, %d), want %d (%d, %d)", c[i].in, c[i].k, c[i].s,
                     c[i].same ? "same" : "valid", out, b, a, c[i].out, c[i].before, c[i].after);
    }
    int out;
    assert_int_equal(model_tf_padding(4, 5, 1, 0, &out, NULL, NULL), -1); /* valid, kernel too big */
    model_shape s;
    char buf[32];
    model_shape_format(IMG, buf, sizeof(buf));
    assert_string_equal(buf, "28,28,1");
    assert_int_equal(model_shape_parse("28,28,1", &s), 0);
    assert_int_equal(s.h * 100 + s.w * 10 + s.c, 28 * 100 + 28 * 10 + 1);
    assert_int_equal(model_shape_parse("28,28", &s), -1);
    assert_int_equal(model_shape_parse("28,0,1", &s), -1);
    assert_int_equal(model_shape_parse("28,28,1,", &s), -1);
    assert_int_equal(model_shape_parse("", &s), -1);
}

static void test_spec_rejects(void **state)
{
    (void)state;
    char many[512] = "";
    for (int i = 0; i < 17; i++)
        strcat(many, "dense:4,");
    strcat(many, "dense:10");
    struct { const char *spec, *want; } c[] = {
        {"", "empty"},
        {"mlp:0", "\"0\""},
        {"mlp:100,", "trailing comma"},
        {"mlp:abc", "\"abc\""},
        {"mlp:100,x", "\"x\""},
        {"mlp:2000000", "\"2000000\""},
        {"conv:0x5x32,dense:10", "item 1 \"conv:0x5x32\""},
        {"conv:5x5,dense:10", "\"conv:5x5\""},
        {"conv:3x3x8:bogus,dense:10", "\"conv:3x3x8:bogus\""},
        {"conv:3x3x8/0,dense:10", "\"conv:3x3x8/0\""},
        {"pool:2/0,dense:10", "\"pool:2/0\""},
        {"pool:-2,dense:10", "\"pool:-2\""},
        {"conv:5x5x32,dense:9", "dense:10"},
        {"conv:5x5x32,pool:2", "last item \"pool:2\""},
        {"dense:10,dropout:0.5", "last item \"dropout:0.5\""},
        {"foo:3,dense:10", "item 1 \"foo:3\""},
        {"dense:4,foo,dense:10", "item 2 \"foo\""},
        {"dropout:1,dense:10", "\"dropout:1\""},
        {"dropout:-0.1,dense:10", "\"dropout:-0.1\""},
        {"dropout:nan,dense:10", "\"dropout:nan\""},
        {"dropout:0.5x,dense:10", "\"dropout:0.5x\""},
        {"dropout:0.99999999999,dense:10", "\"dropout:0.99999999999\""},
        {"conv:29x29x1:valid,dense:10", "larger than"},
        {"pool:30:valid,dense:10", "larger than"},
        {"dense:10,,dense:10", "empty item"},
        {",dense:10", "empty item"},
        {"dense:10,", "empty item"},
        {"dense:16,conv:3x3x8,dense:10", "item 2 \"conv:3x3x8\" follows a dense"},
        {many, "more than 16 items"},
        {"dense:1048576,dense:1048576,dense:10", "parameters"},
        {"mlp:100 ", "space"},
        {"dense:10x", "\"dense:10x\""},
        {"cnn2", "\"cnn2\""},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        model_layout ly;
        char err[512] = "";
        ly.n_params = 123;
        if (model_layout_init(&ly, c[i].spec, IMG, 10, err, sizeof(err)) != -1)
            fail_msg("accepted \"%s\"", c[i].spec);
        if (!strstr(err, c[i].want) || strchr(err, '\n'))
            fail_msg("\"%s\": message \"%s\" does not name \"%s\" on one line", c[i].spec, err, c[i].want);
        assert_int_equal(ly.n_params, 0); /* nothing half-built left */
    }
    model_layout ly;
    char err[256];
    assert_int_equal(model_layout_init(&ly, "mlp:10", (model_shape){0, 28, 1}, 10, err, sizeof(err)), -1);
    assert_int_equal(model_layout_init(&ly, "mlp:10", IMG, 1, err, sizeof(err)), -1);
    assert_int_equal(model_layout_init(&ly, NULL, IMG, 10, err, sizeof(err)), -1);
}

/* ---- the dropout mask ---- */

static void test_dropout_mask_values(void **state)
{
    (void)state;
    /* r * 2^24 from the contract's formula, computed with Python's integers */
    struct { uint64_t s; int64_t t, e; uint32_t li; uint64_t u; uint32_t r24; } c[] = {
        {0, 0, 0, 0, 0, 3407499},
        {1, 0, 0, 0, 0, 669790},
        {42, 7, 12345, 1, 99, 6461759},
        {UINT64_MAX, 1000000000000LL, 59999, 3, 3135, 1282898},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        float r = dropout_uniform(dropout_row_hash(c[i].s, c[i].t, c[i].e), c[i].li, c[i].u);
        assert_true(r == (float)c[i].r24 / 16777216.0f);
        float R = (float)c[i].r24 / 16777216.0f;
        assert_int_equal(dropout_keep_unit(c[i].s, c[i].t, c[i].e, c[i].li, c[i].u, R), 1);
        assert_int_equal(dropout_keep_unit(c[i].s, c[i].t, c[i].e, c[i].li, c[i].u,
                                           nextafterf(R, 1.0f)), 0);
    }
    /* the kept fraction is about 1 - R, and the test's copy agrees bit for bit */
    int kept = 0, n = 20000;
    for (int u = 0; u < n; u++) {
        int k = dropout_keep_unit(9, 3, 77, 0, (uint64_t)u, 0.4f);
        assert_int_equal(k, ref_keep(9, 3, 77, 0, (uint64_t)u, 0.4f));
        kept += k;
    }
    assert_true(fabs((double)kept / n - 0.6) < 0.02);
}

/* Two calls with B/2 rows and example0 offsets, or per-row indices, give one
 * call's B rows: what 2 workers x B/2 and 1 worker x B compute. */
static void test_dropout_rows_split(void **state)
{
    (void)state;
    model_layout ly;
    layout_or_fail(&ly, "dense:64,dropout:0.5,dense:10", (model_shape){1, 1, 8});
    const int B = 8, D = 64, li = 2;
    assert_int_equal(ly.layers[li].kind, LAYER_DROPOUT);
    char err[256];
    model *m = model_new(&model_backend_cpu, &ly, B, err, sizeof(err));
    assert_non_null(m);
    float *params = calloc(ly.n_params, sizeof(float));
    float in[8 * 64], whole[8 * 64], half[8 * 64];
    lcg_state = 5;
    for (int i = 0; i < B * D; i++)
        in[i] = frand(0.5f, 1.5f);
    model_ctx ctx = {.seed = 77, .step = 12, .example0 = 1000};
    assert_int_equal(model_forward_range(m, li, li, params, in, B, &ctx, whole), 0);
    ctx.example0 = 1000;
    assert_int_equal(model_forward_range(m, li, li, params, in, B / 2, &ctx, half), 0);
    ctx.example0 = 1000 + B / 2;
    assert_int_equal(model_forward_range(m, li, li, params, in + B / 2 * D, B / 2, &ctx,
                                         half + B / 2 * D), 0);
    assert_memory_equal(whole, half, sizeof(whole));
    int64_t ex[8];
    for (int i = 0; i < B; i++)
        ex[i] = 1000 + i;
    model_ctx ctx2 = {.seed = 77, .step = 12, .example = ex};
    assert_int_equal(model_forward_range(m, li, li, params, in, B, &ctx2, half), 0);
    assert_memory_equal(whole, half, sizeof(whole));
    /* the exact values: x * 2 or 0 by the test's mask */
    int zeros = 0;
    for (int i = 0; i < B; i++)
        for (int u = 0; u < D; u++) {
            float want = ref_keep(77, 12, 1000 + i, 0, (uint64_t)u, 0.5f) ? in[i * D + u] * 2.0f : 0.0f;
            assert_true(whole[i * D + u] == want);
            zeros += want == 0.0f;
        }
    assert_true(zeros > B * D / 4 && zeros < 3 * B * D / 4);
    /* another step, seed or example changes the mask; inference has none */
    ctx.example0 = 1000;
    ctx.step = 13;
    assert_int_equal(model_forward_range(m, li, li, params, in, B, &ctx, half), 0);
    assert_true(memcmp(whole, half, sizeof(whole)) != 0);
    ctx.inference = 1;
    assert_int_equal(model_forward_range(m, li, li, params, in, B, &ctx, half), 0);
    assert_memory_equal(in, half, sizeof(in));
    model_free(m);
    free(params);
}

/* ---- gradients: one layer (or a range) against finite differences ---- */

/* J = sum(out .* R) over the range first..last of spec on input shape in:
 * the backward's din and parameter gradients against central differences of
 * the double reference. */
static void check_range(const char *spec, model_shape ishape, int first, int last, layer_kind kind, int B,
                        uint64_t seed)
{
    model_layout ly;
    layout_or_fail(&ly, spec, ishape);
    assert_true(last < ly.n_layers);
    assert_int_equal(ly.layers[first].kind, kind);
    const size_t ni = (size_t)B * ly.layers[first].in_numel, no = (size_t)B * ly.layers[last].out_numel;
    float *params = malloc(ly.n_params * sizeof(float)), *grads = malloc(ly.n_params * sizeof(float));
    float *in = malloc(ni * sizeof(float)), *out = malloc(no * sizeof(float));
    float *R = malloc(no * sizeof(float)), *din = malloc(ni * sizeof(float));
    double *fd = malloc((ly.n_params + ni) * sizeof(double));
    double *ro = malloc(no * sizeof(double));
    const model_ctx ctx = {.seed = seed, .step = 4, .example0 = 31};
    lcg_state = seed;
    double *pd = NULL, *id = NULL;
    int attempt;
    for (attempt = 0; attempt < 200; attempt++) {
        for (size_t i = 0; i < ly.n_params; i++)
            params[i] = frand(-0.6f, 0.6f);
        for (size_t i = 0; i < ni; i++)
            in[i] = frand(-1.0f, 1.0f);
        for (size_t i = 0; i < no; i++)
            R[i] = frand(-1.0f, 1.0f);
        free(pd);
        free(id);
        pd = to_double(params, ly.n_params);
        id = to_double(in, ni);
        ref_stats st = {INFINITY, INFINITY};
        ref_range(&ly, first, last, pd, id, B, &ctx, ro, &st);
        if (st.zmin >= KINK_MARGIN && st.gapmin >= KINK_MARGIN)
            break;
    }
    assert_true(attempt < 200);

    char err[256];
    model *m = model_new(&model_backend_cpu, &ly, B + 2, err, sizeof(err));
    assert_non_null(m);
    for (size_t i = 0; i < no; i++)
        out[i] = NAN;
    assert_int_equal(model_forward_range(m, first, last, params, in, B, &ctx, out), 0);
    for (size_t i = 0; i < no; i++)
        if (!(fabs(out[i] - ro[i]) <= 1e-5 * fmax(1.0, fabs(ro[i]))))
            fail_msg("%s layers %d..%d: out[%zu] %g, reference %g", spec, first, last, i, out[i], ro[i]);

    /* the range's tensors poisoned, the others set: backward writes exactly its own */
    int in_range[MODEL_MAX_TENSORS];
    for (int t = 0; t < ly.n_tensors; t++) {
        in_range[t] = ly.tensors[t].layer >= first && ly.tensors[t].layer <= last;
        for (size_t k = 0; k < ly.tensors[t].numel; k++)
            grads[ly.tensors[t].offset + k] = in_range[t] ? NAN : 7.0f;
    }
    for (size_t i = 0; i < ni; i++)
        din[i] = NAN;
    assert_int_equal(model_backward_range(m, first, last, params, R, B, din, grads), 0);

    /* finite differences of J in double, over the range's parameters and the input */
    size_t n_fd = 0;
    float *g = malloc((ly.n_params + ni) * sizeof(float));
    for (int t = 0; t < ly.n_tensors; t++) {
        const model_tensor *mt = &ly.tensors[t];
        if (!in_range[t]) {
            for (size_t k = 0; k < mt->numel; k++)
                assert_true(grads[mt->offset + k] == 7.0f);
            continue;
        }
        for (size_t k = 0; k < mt->numel; k++) {
            double *p = &pd[mt->offset + k], keep = *p, up = 0, down = 0;
            *p = keep + FD_H;
            ref_range(&ly, first, last, pd, id, B, &ctx, ro, NULL);
            for (size_t i = 0; i < no; i++)
                up += ro[i] * R[i];
            *p = keep - FD_H;
            ref_range(&ly, first, last, pd, id, B, &ctx, ro, NULL);
            for (size_t i = 0; i < no; i++)
                down += ro[i] * R[i];
            *p = keep;
            fd[n_fd] = (up - down) / (2 * FD_H);
            g[n_fd++] = grads[mt->offset + k];
        }
    }
    for (size_t j = 0; j < ni; j++) {
        double keep = id[j], up = 0, down = 0;
        id[j] = keep + FD_H;
        ref_range(&ly, first, last, pd, id, B, &ctx, ro, NULL);
        for (size_t i = 0; i < no; i++)
            up += ro[i] * R[i];
        id[j] = keep - FD_H;
        ref_range(&ly, first, last, pd, id, B, &ctx, ro, NULL);
        for (size_t i = 0; i < no; i++)
            down += ro[i] * R[i];
        id[j] = keep;
        fd[n_fd] = (up - down) / (2 * FD_H);
        g[n_fd++] = din[j];
    }
    size_t worst = 0;
    double e = max_rel_err(g, fd, n_fd, REL_FLOOR, &worst);
    print_message("    %-8s %s [%d..%d] batch %d: %zu gradients, max rel err %.2e\n",
                  model_layer_kind_name(kind), spec, first, last, B, n_fd, e);
    if (!(e <= REL_TOL))
        fail_msg("gradient %zu: %g, finite differences %g", worst, g[worst], fd[worst]);
    /* the check can fail: one element 0.1% off is caught */
    size_t big = 0;
    for (size_t i = 1; i < n_fd; i++)
        if (fabsf(g[i]) > fabsf(g[big]))
            big = i;
    g[big] *= 1.001f;
    assert_true(max_rel_err(g, fd, n_fd, REL_FLOOR, NULL) > REL_TOL);

    /* din NULL: the parameter gradients alone, the same floats */
    float *grads2 = malloc(ly.n_params * sizeof(float));
    memcpy(grads2, grads, ly.n_params * sizeof(float));
    assert_int_equal(model_forward_range(m, first, last, params, in, B, &ctx, out), 0);
    assert_int_equal(model_backward_range(m, first, last, params, R, B, NULL, grads2), 0);
    assert_memory_equal(grads2, grads, ly.n_params * sizeof(float));
    free(grads2);

    model_free(m);
    free(params);
    free(grads);
    free(in);
    free(out);
    free(R);
    free(din);
    free(fd);
    free(ro);
    free(pd);
    free(id);
    free(g);
}

static void test_layer_gradients(void **state)
{
    (void)state;
    const model_shape s6 = {6, 5, 3}, s7 = {7, 7, 2}, flat = {1, 1, 7};
    /* dense (layer 0 of a flat input) */
    check_range("dense:5,dense:10", flat, 0, 0, LAYER_DENSE, 4, 11);
    /* conv: same, stride 1 and 2; valid; a kernel wider than tall */
    check_range("conv:3x3x4,dense:10", s6, 0, 0, LAYER_CONV2D, 2, 12);
    check_range("conv:3x3x4/2,dense:10", s7, 0, 0, LAYER_CONV2D, 2, 13);
    check_range("conv:2x3x3/2:valid,dense:10", s7, 0, 0, LAYER_CONV2D, 3, 14);
    check_range("conv:4x4x2/3,dense:10", s7, 0, 0, LAYER_CONV2D, 2, 15);
    /* maxpool: same (padded, uneven), valid, overlapping windows */
    check_range("pool:2,dense:10", s7, 0, 0, LAYER_MAXPOOL, 2, 16);
    check_range("pool:3/2:valid,dense:10", s7, 0, 0, LAYER_MAXPOOL, 2, 17);
    check_range("pool:3/1,dense:10", s6, 0, 0, LAYER_MAXPOOL, 2, 18);
    /* relu, dropout, flatten */
    check_range("conv:3x3x2,dense:10", s6, 1, 1, LAYER_RELU, 3, 19);
    check_range("dropout:0.3,dense:10", s6, 0, 0, LAYER_DROPOUT, 3, 20);
    check_range("pool:2,dense:10", s6, 1, 1, LAYER_FLATTEN, 2, 21);
    /* a range of several layers, not starting at 0 */
    check_range("conv:3x3x3,pool:2,dense:6,dropout:0.5,dense:10", s7, 1, 7, LAYER_RELU, 2, 22);
}

/* ---- a whole small CNN: loss and gradients ---- */

static void test_cnn_gradients(void **state)
{
    (void)state;
    const char *spec = "conv:3x3x3,pool:2,conv:2x2x4/1:valid,pool:2/1,dense:6,dropout:0.3,dense:10";
    const model_shape ishape = {7, 7, 2};
    const int B = 3;
    model_layout ly;
    layout_or_fail(&ly, spec, ishape);
    const size_t nx = (size_t)B * ly.n_in;
    float *params = malloc(ly.n_params * sizeof(float)), *grads = malloc(ly.n_params * sizeof(float));
    float *x = malloc(nx * sizeof(float));
    uint8_t labels[3];
    double *fd = malloc(ly.n_params * sizeof(double));
    const model_ctx ctx = {.seed = 5, .step = 3, .example0 = 11};
    double *pd = NULL, *xd = NULL, want = 0;
    lcg_state = 99;
    int attempt;
    for (attempt = 0; attempt < 500; attempt++) {
        for (size_t i = 0; i < ly.n_params; i++)
            params[i] = frand(-0.7f, 0.7f);
        for (size_t i = 0; i < nx; i++)
            x[i] = frand(0.0f, 1.0f);
        for (int i = 0; i < B; i++)
            labels[i] = (uint8_t)(urand() * 10);
        free(pd);
        free(xd);
        pd = to_double(params, ly.n_params);
        xd = to_double(x, nx);
        ref_stats st = {INFINITY, INFINITY};
        want = ref_loss(&ly, pd, xd, labels, B, &ctx, &st);
        if (st.zmin >= KINK_MARGIN && st.gapmin >= KINK_MARGIN)
            break;
    }
    assert_true(attempt < 500);
    char err[256];
    model *m = model_new(&model_backend_cpu, &ly, B, err, sizeof(err));
    assert_non_null(m);
    for (size_t i = 0; i < ly.n_params; i++)
        grads[i] = NAN;
    double loss = NAN;
    assert_int_equal(model_forward_backward(m, params, x, labels, B, &ctx, grads, &loss), 0);
    assert_true(fabs(loss - want) <= 1e-5 * fmax(1.0, fabs(want)));
    for (size_t i = 0; i < ly.n_params; i++) {
        double keep = pd[i];
        pd[i] = keep + FD_H;
        double up = ref_loss(&ly, pd, xd, labels, B, &ctx, NULL);
        pd[i] = keep - FD_H;
        double down = ref_loss(&ly, pd, xd, labels, B, &ctx, NULL);
        pd[i] = keep;
        fd[i] = (up - down) / (2 * FD_H);
    }
    size_t worst = 0;
    double e = max_rel_err(grads, fd, ly.n_params, REL_FLOOR, &worst);
    print_message("    %s on 7x7x2, batch 3: loss %.6f, %zu gradients, max rel err %.2e\n", spec, loss,
                  ly.n_params, e);
    if (!(e <= REL_TOL))
        fail_msg("gradient %zu (%s...): %g, finite differences %g", worst, ly.tensors[0].name,
                 grads[worst], fd[worst]);
    /* the sum instead of the mean is caught */
    float *g3 = malloc(ly.n_params * sizeof(float));
    for (size_t i = 0; i < ly.n_params; i++)
        g3[i] = grads[i] * B;
    assert_true(max_rel_err(g3, fd, ly.n_params, REL_FLOOR, NULL) > REL_TOL);

    /* forward_backward is the range over every layer, the loss head and the backward */
    const int L = ly.n_layers;
    float logits[30], dlogits[30];
    double loss2;
    assert_int_equal(model_forward_range(m, 0, L - 1, params, x, B, &ctx, logits), 0);
    assert_int_equal(model_loss_head(m, logits, labels, B, dlogits, &loss2), 0);
    assert_true(loss2 == loss);
    for (size_t i = 0; i < ly.n_params; i++)
        g3[i] = NAN;
    assert_int_equal(model_backward_range(m, 0, L - 1, params, dlogits, B, NULL, g3), 0);
    assert_memory_equal(g3, grads, ly.n_params * sizeof(float));
    /* and two ranges chained (the model-parallel split) give the same again */
    const int cut = 4;
    float *mid = malloc((size_t)B * ly.layers[cut].out_numel * sizeof(float));
    float *dmid = malloc((size_t)B * ly.layers[cut].out_numel * sizeof(float));
    char err2[256];
    model *m2 = model_new(&model_backend_cpu, &ly, B, err2, sizeof(err2));
    assert_non_null(m2);
    assert_int_equal(model_forward_range(m, 0, cut, params, x, B, &ctx, mid), 0);
    assert_int_equal(model_forward_range(m2, cut + 1, L - 1, params, mid, B, &ctx, logits), 0);
    assert_int_equal(model_loss_head(m2, logits, labels, B, dlogits, &loss2), 0);
    assert_true(loss2 == loss);
    for (size_t i = 0; i < ly.n_params; i++)
        g3[i] = NAN;
    assert_int_equal(model_backward_range(m2, cut + 1, L - 1, params, dlogits, B, dmid, g3), 0);
    assert_int_equal(model_backward_range(m, 0, cut, params, dmid, B, NULL, g3), 0);
    for (size_t i = 0; i < ly.n_params; i++)
        assert_true(fabsf(g3[i] - grads[i]) <= 1e-6f * fmaxf(1.0f, fabsf(grads[i])));
    /* backward_range_add adds the same gradients to a sum (the pipeline's
     * micro-batches), the CPU's own (dense: the sgemm's beta 1; conv: a
     * buffer) and model.c's for a backend without one (backward_range into
     * scratch, then the sum), over both chained ranges */
    model_backend no_add = model_backend_cpu;
    no_add.backward_range_add = NULL;
    float *scratch = malloc(ly.n_params * sizeof(float));
    for (int way = 0; way < 2; way++) {
        m2->backend = way ? &no_add : &model_backend_cpu;
        m->backend = m2->backend;
        for (size_t i = 0; i < ly.n_params; i++)
            g3[i] = 0.25f - 0.001f * (float)(i % 500);
        for (int rep = 0; rep < 2; rep++) { /* twice: the second adds to the first */
            assert_int_equal(model_forward_range(m, 0, cut, params, x, B, &ctx, mid), 0);
            assert_int_equal(model_forward_range(m2, cut + 1, L - 1, params, mid, B, &ctx, logits), 0);
            assert_int_equal(model_loss_head(m2, logits, labels, B, dlogits, &loss2), 0);
            assert_int_equal(model_backward_range_add(m2, cut + 1, L - 1, params, dlogits, B, dmid, g3, scratch), 0);
            assert_int_equal(model_backward_range_add(m, 0, cut, params, dmid, B, NULL, g3, scratch), 0);
        }
        for (size_t i = 0; i < ly.n_params; i++) {
            const float want_i = 0.25f - 0.001f * (float)(i % 500) + 2.0f * grads[i];
            if (!(fabsf(g3[i] - want_i) <= 2e-6f * fmaxf(1.0f, fabsf(want_i))))
                fail_msg("backward_range_add (%s) parameter %zu: %g, want %g", way ? "model.c's" : "the CPU's", i,
                         g3[i], want_i);
        }
    }
    /* without scratch, a backend without its own add is refused */
    assert_int_equal(model_backward_range_add(m, 0, cut, params, dmid, B, NULL, g3, NULL), -1);
    m->backend = m2->backend = &model_backend_cpu;
    free(scratch);
    /* evaluation has no dropout: its loss is the reference's without it */
    double el, acc;
    assert_int_equal(model_evaluate(m, params, x, labels, B, &el, &acc), 0);
    const model_ctx inf = {.inference = 1};
    double want_eval = ref_loss(&ly, pd, xd, labels, B, &inf, NULL);
    assert_true(fabs(el - want_eval) <= 1e-5 * fmax(1.0, want_eval));
    assert_true(fabs(el - loss) > 1e-6); /* the dropout made a difference in training */
    model_free(m2);
    model_free(m);
    free(mid);
    free(dmid);
    free(g3);
    free(params);
    free(grads);
    free(x);
    free(fd);
    free(pd);
    free(xd);
}

/* ---- init, arguments, evaluation ---- */

/* ---- the overlap hooks (workerd --overlap) ---- */

/* What the hooks saw: each call in order ('w' layer, 'L', 'g' layer), and
 * at each grads_done the layer's gradients as they were then. */
typedef struct hook_log {
    const model_layout *ly;
    const float *grads;
    float *seen;       /* n_params floats: each layer's gradients when announced */
    char kind[64];
    int layer[64];
    int n;
    int stop_at;       /* wait_params of this layer answers 1 (-1: never) */
} hook_log;

static int log_wait(void *arg, int layer)
{
    hook_log *h = arg;
    h->kind[h->n] = 'w';
    h->layer[h->n++] = layer;
    return layer == h->stop_at;
}

static int log_loss(void *arg, double loss)
{
    hook_log *h = arg;
    (void)loss;
    h->kind[h->n] = 'L';
    h->layer[h->n++] = -1;
    return 0;
}

static void log_grads(void *arg, int layer)
{
    hook_log *h = arg;
    h->kind[h->n] = 'g';
    h->layer[h->n++] = layer;
    for (int t = 0; t < h->ly->n_tensors; t++)
        if (h->ly->tensors[t].layer == layer)
            memcpy(h->seen + h->ly->tensors[t].offset, h->grads + h->ly->tensors[t].offset,
                   h->ly->tensors[t].numel * sizeof(float));
}

/* One forward_backward with the hooks on backend b against one without:
 * the same floats; the waits first, for each layer with parameters in
 * order, then the loss, then each such layer's gradients last layer first,
 * final when announced; a wait that says stop stops the step. */
static void check_hooks(const model_backend *b)
{
    model_layout ly;
    layout_or_fail(&ly, "conv:3x3x4,pool:2,dense:16,dropout:0.5,dense:10", (model_shape){8, 8, 1});
    const int B = 6;
    char err[256];
    model *m = model_new(b, &ly, B, err, sizeof(err));
    assert_non_null(m);
    float *params = malloc(ly.n_params * sizeof(float)), *g0 = calloc(ly.n_params, sizeof(float));
    float *g1 = calloc(ly.n_params, sizeof(float)), *seen = calloc(ly.n_params, sizeof(float));
    float x[6 * 64];
    uint8_t y[6] = {0, 3, 9, 1, 1, 7};
    model_init_params(&ly, params, 3);
    lcg_state = 9;
    for (int i = 0; i < B * 64; i++)
        x[i] = frand(0.0f, 1.0f);
    double l0, l1;
    model_ctx ctx = {.seed = 4, .step = 2, .example0 = 10};
    assert_int_equal(model_forward_backward(m, params, x, y, B, &ctx, g0, &l0), 0);
    hook_log h = {.ly = &ly, .grads = g1, .seen = seen, .stop_at = -1};
    ctx.wait_params = log_wait;
    ctx.loss_done = log_loss;
    ctx.grads_done = log_grads;
    ctx.hook_arg = &h;
    assert_int_equal(model_forward_backward(m, params, x, y, B, &ctx, g1, &l1), 0);
    assert_true(l0 == l1);
    assert_memory_equal(g0, g1, ly.n_params * sizeof(float));
    assert_memory_equal(g0, seen, ly.n_params * sizeof(float));
    int with[MODEL_MAX_LAYERS], n = 0;
    for (int l = 0; l < ly.n_layers; l++)
        if (ly.layers[l].w >= 0)
            with[n++] = l;
    assert_int_equal(n, 3);
    assert_int_equal(h.n, 2 * n + 1);
    for (int k = 0; k < n; k++) {
        assert_int_equal(h.kind[k], 'w');
        assert_int_equal(h.layer[k], with[k]);
        assert_int_equal(h.kind[n + 1 + k], 'g');
        assert_int_equal(h.layer[n + 1 + k], with[n - 1 - k]);
    }
    assert_int_equal(h.kind[n], 'L');
    /* a wait that says stop: -1, no loss, no gradients announced */
    h = (hook_log){.ly = &ly, .grads = g1, .seen = seen, .stop_at = with[1]};
    assert_int_equal(model_forward_backward(m, params, x, y, B, &ctx, g1, &l1), -1);
    for (int k = 0; k < h.n; k++)
        assert_int_equal(h.kind[k], 'w');
    model_free(m);
    free(params);
    free(g0);
    free(g1);
    free(seen);
}

static void test_overlap_hooks(void **state)
{
    (void)state;
    check_hooks(&model_backend_cpu);
    /* a backend that does not call them: the front door calls them around it */
    model_backend plain = model_backend_cpu;
    plain.layer_hooks = 0;
    check_hooks(&plain);
}

static void test_init(void **state)
{
    (void)state;
    model_layout ly;
    layout_or_fail(&ly, "cnn", IMG);
    float *p = malloc(ly.n_params * sizeof(float)), *q = malloc(ly.n_params * sizeof(float));
    model_init_params(&ly, p, 7);
    model_init_params(&ly, q, 7);
    assert_memory_equal(p, q, ly.n_params * sizeof(float));
    model_init_params(&ly, q, 8);
    assert_true(memcmp(p, q, ly.n_params * sizeof(float)) != 0);
    for (int t = 0; t < ly.n_tensors; t++) {
        const model_tensor *mt = &ly.tensors[t];
        const float *v = p + mt->offset;
        if (mt->fan_in == 0) {
            for (size_t k = 0; k < mt->numel; k++)
                assert_true(v[k] == 0.0f);
            continue;
        }
        /* a normal truncated at 2 stddev: variance 0.7737 stddev^2, |v| <= 2 stddev */
        const double sd = 1.0 / sqrt((double)mt->fan_in);
        double s2 = 0;
        for (size_t k = 0; k < mt->numel; k++) {
            assert_true(fabs(v[k]) <= 2 * sd * (1 + 1e-6));
            s2 += (double)v[k] * v[k];
        }
        double var = s2 / (double)mt->numel / (sd * sd);
        if (mt->numel > 5000 && fabs(var - 0.7737) > 0.03)
            fail_msg("%s: variance %g stddev^2, want 0.774", mt->name, var);
    }
    free(p);
    free(q);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    model_layout ly;
    layout_or_fail(&ly, "conv:3x3x2,pool:2,dense:10", (model_shape){4, 4, 1});
    char err[256];
    assert_null(model_new(&model_backend_cpu, &ly, 0, err, sizeof(err)));
    assert_null(model_new(NULL, &ly, 4, err, sizeof(err)));
    model *m = model_new(&model_backend_cpu, &ly, 4, err, sizeof(err));
    assert_non_null(m);
    float params[256] = {0}, grads[256], x[64] = {0}, out[256], d[256] = {0};
    assert_true(ly.n_params <= 256);
    uint8_t labels[4] = {0, 1, 2, 9}, bad[4] = {0, 10, 0, 0};
    double loss, acc;
    assert_int_equal(model_forward_backward(m, params, x, labels, 4, NULL, grads, &loss), 0);
    assert_true(fabs(loss - log(10.0)) < 1e-6); /* a zero model: uniform over the classes */
    assert_int_equal(model_forward_backward(m, params, x, labels, 5, NULL, grads, &loss), -1);
    assert_int_equal(model_forward_backward(m, params, x, labels, 0, NULL, grads, &loss), -1);
    assert_int_equal(model_forward_backward(m, params, x, bad, 4, NULL, grads, &loss), -1);
    assert_int_equal(model_forward_backward(m, NULL, x, labels, 4, NULL, grads, &loss), -1);
    assert_int_equal(model_evaluate(m, params, x, bad, 4, &loss, &acc), -1);
    assert_int_equal(model_evaluate(m, params, x, labels, 0, &loss, &acc), -1);
    assert_int_equal(model_loss_head(m, out, bad, 4, NULL, &loss), -1);
    assert_int_equal(model_forward_range(m, 1, 0, params, x, 4, NULL, out), -1);
    assert_int_equal(model_forward_range(m, 0, ly.n_layers, params, x, 4, NULL, out), -1);
    assert_int_equal(model_forward_range(m, -1, 0, params, x, 4, NULL, out), -1);
    /* a backward must pair with the forward before it */
    assert_int_equal(model_forward_range(m, 0, 1, params, x, 4, NULL, out), 0);
    assert_int_equal(model_backward_range(m, 0, 2, params, d, 4, NULL, grads), -1);
    assert_int_equal(model_backward_range(m, 0, 1, params, d, 3, NULL, grads), -1);
    assert_int_equal(model_backward_range(m, 0, 1, params, d, 4, NULL, grads), 0);
    assert_int_equal(model_evaluate(m, params, x, labels, 4, &loss, &acc), 0);
    assert_int_equal(model_backward_range(m, 0, 1, params, d, 4, NULL, grads), -1);
    /* host memory: zeroed, freed through the instance; staging is a no-op on the CPU */
    float *h = model_host_alloc(m, 1000);
    assert_non_null(h);
    for (int i = 0; i < 250; i++)
        assert_true(h[i] == 0.0f);
    assert_int_equal(model_stage_batch(m, x, labels, 4), 0);
    assert_int_equal(model_stage_batch(m, x, labels, 5), -1);
    model_host_free(m, h);
    model_host_free(m, NULL);
    model_free(m);
    model_free(NULL);
}

/* evaluate against the reference: loss, and accuracy with argmax over batches */
static void test_evaluate(void **state)
{
    (void)state;
    model_layout ly;
    layout_or_fail(&ly, "conv:3x3x2,pool:2,dense:8,dropout:0.5,dense:10", (model_shape){6, 6, 1});
    const int n = 23;
    float *params = malloc(ly.n_params * sizeof(float)), *x = malloc((size_t)n * ly.n_in * sizeof(float));
    uint8_t labels[23];
    lcg_state = 3;
    for (size_t i = 0; i < ly.n_params; i++)
        params[i] = frand(-1, 1);
    for (size_t i = 0; i < (size_t)n * ly.n_in; i++)
        x[i] = frand(0, 1);
    for (int i = 0; i < n; i++)
        labels[i] = (uint8_t)(urand() * 10);
    double *pd = to_double(params, ly.n_params), *xd = to_double(x, (size_t)n * ly.n_in);
    double *z = malloc((size_t)n * 10 * sizeof(double));
    const model_ctx inf = {.inference = 1};
    ref_range(&ly, 0, ly.n_layers - 1, pd, xd, n, &inf, z, NULL);
    int correct = 0;
    for (int i = 0; i < n; i++) {
        int arg = 0;
        for (int j = 1; j < 10; j++)
            if (z[i * 10 + j] > z[i * 10 + arg])
                arg = j;
        correct += arg == labels[i];
    }
    labels[0] = labels[0]; /* keep */
    char err[256];
    model *m = model_new(&model_backend_cpu, &ly, 5, err, sizeof(err)); /* 23 = 4 x 5 + 3 */
    assert_non_null(m);
    double loss, acc;
    assert_int_equal(model_evaluate(m, params, x, labels, n, &loss, &acc), 0);
    assert_true(fabs(loss - ref_ce(z, labels, n, 10)) < 1e-5);
    assert_true(acc == (double)correct / n);
    model_free(m);
    free(params);
    free(x);
    free(pd);
    free(xd);
    free(z);
}


int main(void)
{
    model_cpu_set_threads(1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_mlp),
        cmocka_unit_test(test_layout_cnn),
        cmocka_unit_test(test_layout_list),
        cmocka_unit_test(test_tf_padding),
        cmocka_unit_test(test_spec_rejects),
        cmocka_unit_test(test_dropout_mask_values),
        cmocka_unit_test(test_dropout_rows_split),
        cmocka_unit_test(test_layer_gradients),
        cmocka_unit_test(test_cnn_gradients),
        cmocka_unit_test(test_init),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_evaluate),
        cmocka_unit_test(test_overlap_hooks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
