/* test_store.c - server/store.c: put/get and versions, SGD updates (values
 * computed here by hand; adagrad with a schedule and weight decay), all-or-nothing
 * bulk pushes, push-id idempotence,
 * copy-on-write snapshots, and a concurrent pushers-vs-readers check. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bufpool.h"
#include "store.h"
#include "store_fixture.h"

typedef store_fixture fixture;

static int setup_half(void **state) { return store_fixture_setup(state, 0.5f); }
static int setup_one(void **state) { return store_fixture_setup(state, 1.0f); }
static int setup_tenth(void **state) { return store_fixture_setup(state, 0.1f); }
static int teardown(void **state) { return store_fixture_teardown(state); }

static blob *fblob(bufpool *p, const float *v, size_t n)
{
    blob *b = blob_new(p, n * 4);
    assert_non_null(b);
    if (n)
        memcpy(b->data, v, n * 4);
    return b;
}

static tensor_shape shape1(int64_t d0)
{
    tensor_shape s = {.ndim = 1, .dims = {d0}};
    return s;
}

static void put_new(store *s, bufpool *p, const char *name, tensor_shape sh, const float *v)
{
    int created = -1;
    uint64_t version = 0;
    int64_t n = tensor_shape_numel(&sh);
    assert_int_equal(store_put(s, name, &sh, fblob(p, v, (size_t)n), 0, &created, &version),
                     STORE_OK);
    assert_int_equal(created, 1);
    assert_int_equal(version, 1);
}

/* Snapshot `name` and compare its values with want[0..n). Reports the caller's
 * line (cmocka's _fail) for the XML report. */
static void expect_values_at(const char *file, int line, store *s, const char *name,
                             const float *want, int64_t n, uint64_t version)
{
    store_snap snap;
    if (store_get(s, name, &snap) != STORE_OK) {
        print_error("no variable '%s'\n", name);
        _fail(file, line);
    }
    int bad = 0;
    if (strcmp(snap.name, name) != 0 || snap.numel != n || snap.version != version ||
        snap.data->len < (size_t)n * 4) {
        print_error("%s: name '%s' numel %lld version %llu, want numel %lld version %llu\n",
                    name, snap.name, (long long)snap.numel, (unsigned long long)snap.version,
                    (long long)n, (unsigned long long)version);
        bad = 1;
    }
    const float *got = (const float *)snap.data->data;
    for (int64_t i = 0; !bad && i < n; i++)
        if (got[i] != want[i]) {
            print_error("%s[%lld] = %.9g, want %.9g\n", name, (long long)i, (double)got[i],
                        (double)want[i]);
            bad = 1;
        }
    store_snap_release(&snap);
    if (bad)
        _fail(file, line);
}
#define expect_values(...) expect_values_at(__FILE__, __LINE__, __VA_ARGS__)

static int64_t step_of(store *s)
{
    int n;
    uint64_t bytes;
    int64_t step;
    int has_loss;
    double loss;
    store_totals(s, &n, &bytes, &step, &has_loss, &loss);
    return step;
}

static void test_put_get_versions(void **state)
{
    fixture *fx = *state;
    store *s = &fx->s;
    tensor_shape sh = {.ndim = 2, .dims = {2, 2}};
    const float v1[4] = {1, 2, 3, 4};
    put_new(s, fx->pool, "w", sh, v1);
    expect_values(s, "w", v1, 4, 1);

    store_snap snap;
    assert_int_equal(store_get(s, "w", &snap), STORE_OK);
    assert_int_equal(snap.shape.ndim, 2);
    assert_int_equal(snap.shape.dims[0], 2);
    assert_int_equal(snap.shape.dims[1], 2);
    store_snap_release(&snap);
    assert_null(snap.data);

    /* replace with another shape: version 2, not created */
    const float v2[3] = {-1, -2, -3};
    tensor_shape s3 = shape1(3);
    int created = -1;
    uint64_t version = 0;
    assert_int_equal(store_put(s, "w", &s3, fblob(fx->pool, v2, 3), 0, &created, &version),
                     STORE_OK);
    assert_int_equal(created, 0);
    assert_int_equal(version, 2);
    expect_values(s, "w", v2, 3, 2);
    tensor_shape peek;
    assert_int_equal(store_peek(s, "w", &peek), STORE_OK);
    assert_true(tensor_shape_equal(&peek, &s3));
    assert_int_equal(store_peek(s, "w", NULL), STORE_OK);
    /* a third put: version 3 */
    assert_int_equal(store_put(s, "w", &s3, fblob(fx->pool, v2, 3), 0, &created, &version),
                     STORE_OK);
    assert_int_equal(version, 3);

    /* unknown names */
    assert_int_equal(store_get(s, "nope", &snap), STORE_ENOENT);
    assert_int_equal(store_peek(s, "nope", &peek), STORE_ENOENT);

    /* more variables, put out of order: kept sorted, totals add up */
    const float z[5] = {0};
    put_new(s, fx->pool, "c", shape1(5), z);
    put_new(s, fx->pool, "a", shape1(1), z);
    put_new(s, fx->pool, "b/x", shape1(2), z);
    int n;
    uint64_t bytes;
    int64_t step;
    int has_loss;
    double loss;
    store_totals(s, &n, &bytes, &step, &has_loss, &loss);
    assert_int_equal(n, 4);
    assert_int_equal(bytes, (3 + 5 + 1 + 2) * 4);
    assert_int_equal(step, 0);
    assert_int_equal(has_loss, 0);

    store_snap *all = NULL;
    int na = 0;
    int64_t gs = -1;
    assert_int_equal(store_get_all(s, &all, &na, &gs), STORE_OK);
    assert_int_equal(na, 4);
    assert_int_equal(gs, 0);
    assert_string_equal(all[0].name, "a");
    assert_string_equal(all[1].name, "b/x");
    assert_string_equal(all[2].name, "c");
    assert_string_equal(all[3].name, "w");
    assert_int_equal(all[3].version, 3);
    assert_int_equal(all[2].numel, 5);
    store_snaps_release(all, na);

    /* replacing with a bigger tensor adjusts the byte count: w 3 -> 6 floats */
    tensor_shape s6 = {.ndim = 2, .dims = {3, 2}};
    const float six[6] = {1, 2, 3, 4, 5, 6};
    assert_int_equal(store_put(s, "w", &s6, fblob(fx->pool, six, 6), 0, &created, &version),
                     STORE_OK);
    store_totals(s, &n, &bytes, &step, &has_loss, &loss);
    assert_int_equal(bytes, (6 + 5 + 1 + 2) * 4);
    expect_values(s, "w", six, 6, 4);

    /* an empty store's get_all */
    store empty;
    assert_int_equal(store_init(&empty, 1.0f, NULL), STORE_OK);
    assert_int_equal(store_get_all(&empty, &all, &na, &gs), STORE_OK);
    assert_int_equal(na, 0);
    store_snaps_release(all, na);
    store_destroy(&empty);
}

static void test_only_create_and_shape(void **state)
{
    fixture *fx = *state;
    store *s = &fx->s;
    const float v[2] = {5, 6}, other[2] = {7, 8};
    put_new(s, fx->pool, "x", shape1(2), v);
    tensor_shape sh = shape1(2);
    int created = -1;
    uint64_t version = 0;
    /* only_create on an existing name: EEXIST, nothing changes, blob still ours */
    blob *b = fblob(fx->pool, other, 2);
    assert_int_equal(store_put(s, "x", &sh, b, 1, &created, &version), STORE_EEXIST);
    blob_unref(b);
    expect_values(s, "x", v, 2, 1);
    /* only_create on a new name works */
    b = fblob(fx->pool, other, 2);
    assert_int_equal(store_put(s, "y", &sh, b, 1, &created, &version), STORE_OK);
    assert_int_equal(created, 1);
    assert_int_equal(version, 1);
    /* data length not numel*4: ESHAPE, nothing stored */
    tensor_shape s3 = shape1(3);
    b = fblob(fx->pool, other, 2);
    assert_int_equal(store_put(s, "x", &s3, b, 0, &created, &version), STORE_ESHAPE);
    assert_int_equal(store_put(s, "z", &s3, b, 0, &created, &version), STORE_ESHAPE);
    blob_unref(b);
    expect_values(s, "x", v, 2, 1);
    store_snap snap;
    assert_int_equal(store_get(s, "z", &snap), STORE_ENOENT);
    /* a scalar is one float */
    tensor_shape scalar = {.ndim = 0};
    const float one = 1.5f;
    b = fblob(fx->pool, &one, 1);
    assert_int_equal(store_put(s, "scalar", &scalar, b, 0, &created, &version), STORE_OK);
    expect_values(s, "scalar", &one, 1, 1);

    /* apply_grad: wrong length or unknown name changes nothing */
    int64_t gs = 99;
    uint64_t ver = 99;
    const float g[3] = {1, 1, 1};
    assert_int_equal(store_apply_grad(s, "x", g, 3, &gs, &ver), STORE_ESHAPE);
    assert_int_equal(store_apply_grad(s, "x", g, 1, &gs, &ver), STORE_ESHAPE);
    assert_int_equal(store_apply_grad(s, "nope", g, 2, &gs, &ver), STORE_ENOENT);
    expect_values(s, "x", v, 2, 1);
    assert_int_equal(step_of(s), 0);
}

static void test_apply_grad_math(void **state)
{
    fixture *fx = *state; /* learning rate 0.5 */
    store *s = &fx->s;
    const float w[6] = {1, -2, 3.25f, 0, 1e6f, -0.125f};
    const float g[6] = {2, 4, -0.5f, 1, 2, 0.25f};
    /* w - 0.5*g, worked out by hand (all exact in float32) */
    const float want1[6] = {0, -4, 3.5f, -0.5f, 999999, -0.25f};
    const float want2[6] = {-1, -6, 3.75f, -1, 999998, -0.375f};
    put_new(s, fx->pool, "w", shape1(6), w);
    put_new(s, fx->pool, "v", shape1(1), w);
    int64_t gs = -1;
    uint64_t ver = 0;
    assert_int_equal(store_apply_grad(s, "w", g, 6, &gs, &ver), STORE_OK);
    assert_int_equal(gs, 1);
    assert_int_equal(ver, 2);
    expect_values(s, "w", want1, 6, 2);
    assert_int_equal(store_apply_grad(s, "w", g, 6, &gs, &ver), STORE_OK);
    assert_int_equal(gs, 2);
    assert_int_equal(ver, 3);
    expect_values(s, "w", want2, 6, 3);
    /* another variable: its own version, the shared global_step */
    const float gv = 4;
    const float wantv = -1; /* 1 - 0.5*4 */
    assert_int_equal(store_apply_grad(s, "v", &gv, 1, &gs, &ver), STORE_OK);
    assert_int_equal(gs, 3);
    assert_int_equal(ver, 2);
    expect_values(s, "v", &wantv, 1, 2);
    assert_int_equal(step_of(s), 3);
}

static void test_apply_grad_inexact(void **state)
{
    fixture *fx = *state; /* learning rate 0.1f */
    store *s = &fx->s;
    enum { N = 100 };
    float w[N], g[N];
    for (int i = 0; i < N; i++) {
        w[i] = (float)(i - 50) * 0.37f;
        g[i] = (float)((i * 7919) % 101 - 50) / 13.0f;
    }
    put_new(s, fx->pool, "w", shape1(N), w);
    int64_t gs;
    uint64_t ver;
    assert_int_equal(store_apply_grad(s, "w", g, N, &gs, &ver), STORE_OK);
    store_snap snap;
    assert_int_equal(store_get(s, "w", &snap), STORE_OK);
    const float *got = (const float *)snap.data->data;
    for (int i = 0; i < N; i++) {
        double want = (double)w[i] - (double)0.1f * (double)g[i];
        if (fabs((double)got[i] - want) > 1e-6 * (1 + fabs(want)))
            fail_msg("w[%d] = %.9g, want %.9g", i, (double)got[i], want);
    }
    store_snap_release(&snap);
}

/* A hand-made st_file for store_apply_grads (what st_parse would produce). */
typedef struct push {
    st_tensor t[4];
    char names[4][32];
    st_file f;
} push;

static void push_add(push *p, const char *name, const char *dtype, tensor_shape sh)
{
    int k = p->f.n_tensors;
    uint64_t at = k ? p->t[k - 1].end : 0;
    snprintf(p->names[k], sizeof(p->names[k]), "%s", name);
    memset(&p->t[k], 0, sizeof(p->t[k]));
    p->t[k].name = p->names[k];
    snprintf(p->t[k].dtype, sizeof(p->t[k].dtype), "%s", dtype);
    p->t[k].shape = sh;
    p->t[k].begin = at;
    p->t[k].end = at + (uint64_t)tensor_shape_numel(&sh) * 4;
    p->f.tensors = p->t;
    p->f.n_tensors = k + 1;
    p->f.data_len = p->t[k].end;
}

static void setup_ab(fixture *fx)
{
    const float a[2] = {1, 2}, b[3] = {10, 20, 30};
    put_new(&fx->s, fx->pool, "a", shape1(2), a);
    put_new(&fx->s, fx->pool, "b", shape1(3), b);
}

static void test_apply_grads(void **state)
{
    fixture *fx = *state; /* learning rate 1 */
    store *s = &fx->s;
    setup_ab(fx);
    push p = {0};
    push_add(&p, "b", "F32", shape1(3));
    push_add(&p, "a", "F32", shape1(2));
    const float data[5] = {1, 2, 3, /* b */ 0.5f, 0.5f /* a */};
    store_push_meta meta = {.push_id = NULL, .has_loss = 1, .loss = 0.75};
    int64_t gs = -1;
    int dup = -1;
    char err[256] = "";
    int rc = store_apply_grads(s, &p.f, (const unsigned char *)data, &meta, &gs, &dup, err,
                               sizeof(err));
    if (rc != STORE_OK)
        fail_msg("apply_grads: %d %s", rc, err);
    assert_int_equal(gs, 1); /* one push, one step */
    assert_int_equal(dup, 0);
    const float wa[2] = {0.5f, 1.5f}, wb[3] = {9, 18, 27};
    expect_values(s, "a", wa, 2, 2);
    expect_values(s, "b", wb, 3, 2);
    int n;
    uint64_t bytes;
    int64_t step;
    int has_loss;
    double loss;
    store_totals(s, &n, &bytes, &step, &has_loss, &loss);
    assert_int_equal(step, 1);
    assert_int_equal(has_loss, 1);
    assert_true(loss == 0.75);

    /* a subset: only a */
    push q = {0};
    push_add(&q, "a", "F32", shape1(2));
    const float ga[2] = {-1, -2};
    meta.has_loss = 0;
    assert_int_equal(store_apply_grads(s, &q.f, (const unsigned char *)ga, &meta, &gs, &dup, err,
                                       sizeof(err)),
                     STORE_OK);
    assert_int_equal(gs, 2);
    const float wa2[2] = {1.5f, 3.5f};
    expect_values(s, "a", wa2, 2, 3);
    expect_values(s, "b", wb, 3, 2);
    store_totals(s, &n, &bytes, &step, &has_loss, &loss);
    assert_true(loss == 0.75); /* a push without loss keeps the last one */
}

/* Every variable, version and global_step as they are now. */
typedef struct state_copy {
    float a[2], b[3];
    uint64_t va, vb;
    int64_t step;
} state_copy;

static state_copy copy_state(store *s)
{
    state_copy c;
    store_snap snap;
    assert_int_equal(store_get(s, "a", &snap), STORE_OK);
    memcpy(c.a, snap.data->data, sizeof(c.a));
    c.va = snap.version;
    store_snap_release(&snap);
    assert_int_equal(store_get(s, "b", &snap), STORE_OK);
    memcpy(c.b, snap.data->data, sizeof(c.b));
    c.vb = snap.version;
    store_snap_release(&snap);
    c.step = step_of(s);
    return c;
}

static void expect_unchanged(store *s, const state_copy *before)
{
    state_copy now = copy_state(s);
    assert_memory_equal(now.a, before->a, sizeof(now.a));
    assert_memory_equal(now.b, before->b, sizeof(now.b));
    assert_int_equal(now.va, before->va);
    assert_int_equal(now.vb, before->vb);
    assert_int_equal(now.step, before->step);
}

static void test_apply_grads_all_or_nothing(void **state)
{
    fixture *fx = *state;
    store *s = &fx->s;
    setup_ab(fx);
    state_copy before = copy_state(s);
    const float data[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    store_push_meta meta = {.push_id = "bad-push", .has_loss = 1, .loss = 9};
    int64_t gs;
    int dup;
    char err[256];

    /* good a, good b, then an unknown name last */
    push p = {0};
    push_add(&p, "a", "F32", shape1(2));
    push_add(&p, "b", "F32", shape1(3));
    push_add(&p, "zz", "F32", shape1(1));
    err[0] = '\0';
    int rc = store_apply_grads(s, &p.f, (const unsigned char *)data, &meta, &gs, &dup, err,
                               sizeof(err));
    assert_int_not_equal(rc, STORE_OK);
    assert_true(err[0] != '\0');
    expect_unchanged(s, &before);

    /* good a, then b with the wrong shape */
    push q = {0};
    push_add(&q, "a", "F32", shape1(2));
    push_add(&q, "b", "F32", shape1(2));
    err[0] = '\0';
    rc = store_apply_grads(s, &q.f, (const unsigned char *)data, &meta, &gs, &dup, err,
                           sizeof(err));
    assert_int_equal(rc, STORE_ESHAPE);
    assert_true(err[0] != '\0');
    expect_unchanged(s, &before);

    /* same element count, other shape: [3] vs [1,3] */
    push r = {0};
    push_add(&r, "a", "F32", shape1(2));
    tensor_shape s13 = {.ndim = 2, .dims = {1, 3}};
    push_add(&r, "b", "F32", s13);
    rc = store_apply_grads(s, &r.f, (const unsigned char *)data, &meta, &gs, &dup, err,
                           sizeof(err));
    assert_int_equal(rc, STORE_ESHAPE);
    expect_unchanged(s, &before);

    /* a non-F32 gradient */
    push t = {0};
    push_add(&t, "a", "F32", shape1(2));
    push_add(&t, "b", "F16", shape1(3));
    rc = store_apply_grads(s, &t.f, (const unsigned char *)data, &meta, &gs, &dup, err,
                           sizeof(err));
    assert_int_equal(rc, STORE_EINVAL);
    expect_unchanged(s, &before);

    /* no gradients at all */
    push e = {0};
    e.f.tensors = e.t;
    rc = store_apply_grads(s, &e.f, (const unsigned char *)data, &meta, &gs, &dup, err,
                           sizeof(err));
    assert_int_equal(rc, STORE_EINVAL);
    expect_unchanged(s, &before);

    int n;
    uint64_t bytes;
    int64_t step;
    int has_loss;
    double loss;
    store_totals(s, &n, &bytes, &step, &has_loss, &loss);
    assert_int_equal(has_loss, 0); /* the failed pushes' loss was not recorded */

    /* the failed pushes' id was not recorded: the same id now applies */
    push ok = {0};
    push_add(&ok, "a", "F32", shape1(2));
    rc = store_apply_grads(s, &ok.f, (const unsigned char *)data, &meta, &gs, &dup, err,
                           sizeof(err));
    assert_int_equal(rc, STORE_OK);
    assert_int_equal(dup, 0);
    assert_int_equal(gs, 1);
    const float wa[2] = {0, 1};
    expect_values(s, "a", wa, 2, 2);
}

static void test_push_id_duplicates(void **state)
{
    fixture *fx = *state; /* learning rate 1 */
    store *s = &fx->s;
    setup_ab(fx);
    push p = {0};
    push_add(&p, "a", "F32", shape1(2));
    const float g1[2] = {1, 1}, g2[2] = {100, 100};
    store_push_meta meta = {.push_id = "worker0:step1"};
    int64_t gs = -1;
    int dup = -1;
    char err[256];
    /* an unrelated step first, so "the step it produced" is not just 1 */
    int64_t gs0;
    uint64_t v0;
    const float gb[3] = {0, 0, 0};
    assert_int_equal(store_apply_grad(s, "b", gb, 3, &gs0, &v0), STORE_OK);
    assert_int_equal(gs0, 1);

    assert_int_equal(store_apply_grads(s, &p.f, (const unsigned char *)g1, &meta, &gs, &dup,
                                       err, sizeof(err)),
                     STORE_OK);
    assert_int_equal(dup, 0);
    assert_int_equal(gs, 2);
    const float want[2] = {0, 1};
    expect_values(s, "a", want, 2, 2);

    /* the same id again, even with other gradients: not applied, reports step 2 */
    gs = -1;
    dup = -1;
    assert_int_equal(store_apply_grads(s, &p.f, (const unsigned char *)g2, &meta, &gs, &dup,
                                       err, sizeof(err)),
                     STORE_OK);
    assert_int_equal(dup, 1);
    assert_int_equal(gs, 2);
    expect_values(s, "a", want, 2, 2);
    assert_int_equal(step_of(s), 2);

    /* another id applies */
    store_push_meta meta2 = {.push_id = "worker0:step2"};
    assert_int_equal(store_apply_grads(s, &p.f, (const unsigned char *)g1, &meta2, &gs, &dup,
                                       err, sizeof(err)),
                     STORE_OK);
    assert_int_equal(dup, 0);
    assert_int_equal(gs, 3);
    const float want3[2] = {-1, 0};
    expect_values(s, "a", want3, 2, 3);
    /* and the first id is still known, with its own step */
    assert_int_equal(store_apply_grads(s, &p.f, (const unsigned char *)g1, &meta, &gs, &dup,
                                       err, sizeof(err)),
                     STORE_OK);
    assert_int_equal(dup, 1);
    assert_int_equal(gs, 2);
    /* no id: never a duplicate */
    store_push_meta none = {0};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(store_apply_grads(s, &p.f, (const unsigned char *)g1, &none, &gs, &dup,
                                           err, sizeof(err)),
                         STORE_OK);
        assert_int_equal(dup, 0);
    }
    assert_int_equal(gs, 5);
    const float want5[2] = {-3, -2};
    expect_values(s, "a", want5, 2, 5);
    /* a prefix of a known id is a different id */
    store_push_meta pre = {.push_id = "worker0:step"};
    assert_int_equal(store_apply_grads(s, &p.f, (const unsigned char *)g1, &pre, &gs, &dup, err,
                                       sizeof(err)),
                     STORE_OK);
    assert_int_equal(dup, 0);
    assert_int_equal(gs, 6);
}

static void test_snapshot_isolation(void **state)
{
    fixture *fx = *state; /* learning rate 1 */
    store *s = &fx->s;
    enum { N = 1024 };
    float ones[N], g[N];
    for (int i = 0; i < N; i++) {
        ones[i] = 1;
        g[i] = 0.25f;
    }
    put_new(s, fx->pool, "w", shape1(N), ones);

    store_snap old;
    assert_int_equal(store_get(s, "w", &old), STORE_OK);
    int64_t gs;
    uint64_t ver;
    assert_int_equal(store_apply_grad(s, "w", g, N, &gs, &ver), STORE_OK);
    /* the snapshot taken before still reads the old values and version */
    assert_int_equal(old.version, 1);
    const float *ov = (const float *)old.data->data;
    for (int i = 0; i < N; i++)
        if (ov[i] != 1.0f)
            fail_msg("old snapshot changed: [%d] = %g", i, (double)ov[i]);
    /* a new snapshot reads the new ones */
    float want[N];
    for (int i = 0; i < N; i++)
        want[i] = 0.75f;
    expect_values(s, "w", want, N, 2);

    /* the same through a bulk push and store_get_all */
    store_snap *all;
    int na;
    int64_t step_before;
    assert_int_equal(store_get_all(s, &all, &na, &step_before), STORE_OK);
    push p = {0};
    push_add(&p, "w", "F32", shape1(N));
    store_push_meta meta = {0};
    int dup;
    char err[256];
    assert_int_equal(store_apply_grads(s, &p.f, (const unsigned char *)g, &meta, &gs, &dup, err,
                                       sizeof(err)),
                     STORE_OK);
    assert_int_equal(step_before, 1);
    assert_int_equal(na, 1);
    assert_int_equal(all[0].version, 2);
    const float *av = (const float *)all[0].data->data;
    for (int i = 0; i < N; i++)
        if (av[i] != 0.75f)
            fail_msg("get_all snapshot changed: [%d] = %g", i, (double)av[i]);
    for (int i = 0; i < N; i++)
        want[i] = 0.5f;
    expect_values(s, "w", want, N, 3);

    /* and through a replacing put */
    float twos[N];
    for (int i = 0; i < N; i++)
        twos[i] = 2;
    tensor_shape sh = shape1(N);
    int created;
    assert_int_equal(store_put(s, "w", &sh, fblob(fx->pool, twos, N), 0, &created, &ver),
                     STORE_OK);
    for (int i = 0; i < N; i++)
        if (av[i] != 0.75f || ov[i] != 1.0f)
            fail_msg("a snapshot changed after put at [%d]", i);
    expect_values(s, "w", twos, N, 4);
    store_snaps_release(all, na);
    store_snap_release(&old);

    /* with nobody holding the data, updates stay right (in place or not) */
    assert_int_equal(store_apply_grad(s, "w", g, N, &gs, &ver), STORE_OK);
    assert_int_equal(store_apply_grad(s, "w", g, N, &gs, &ver), STORE_OK);
    for (int i = 0; i < N; i++)
        want[i] = 1.5f;
    expect_values(s, "w", want, N, 6);
}

/* ---- concurrency: pushers add constants, readers check every snapshot ---- */

enum { MT_PUSHERS = 2, MT_READERS = 2, MT_ITERS = 300, MT_N = 4096, MT_NC = 1024 };

typedef struct mt {
    store *s;
    atomic_int pushers_left;
    atomic_int failures;
    atomic_long reads;
    char first_failure[256];
    pthread_mutex_t mu;
} mt;

static void mt_fail(mt *m, const char *fmt, ...)
{
    pthread_mutex_lock(&m->mu);
    if (atomic_fetch_add(&m->failures, 1) == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m->first_failure, sizeof(m->first_failure), fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&m->mu);
}

static float minus_one[2 * MT_N]; /* g = -1 with lr = 1: w += 1; set before the threads */

typedef struct pusher_arg {
    mt *m;
    int id;
} pusher_arg;

static void *pusher(void *arg)
{
    pusher_arg *pa = arg;
    mt *m = pa->m;
    push p = {0};
    push_add(&p, "a", "F32", shape1(MT_N));
    push_add(&p, "b", "F32", shape1(MT_N));
    for (int it = 0; it < MT_ITERS; it++) {
        char id[32];
        snprintf(id, sizeof(id), "p%d-%d", pa->id, it);
        store_push_meta meta = {.push_id = id};
        int64_t gs;
        int dup;
        char err[256];
        int rc = store_apply_grads(m->s, &p.f, (const unsigned char *)minus_one, &meta, &gs,
                                   &dup, err, sizeof(err));
        if (rc != STORE_OK || dup)
            mt_fail(m, "pusher %d: apply_grads rc %d dup %d: %s", pa->id, rc, dup, err);
        uint64_t ver;
        rc = store_apply_grad(m->s, "c", minus_one, MT_NC, &gs, &ver);
        if (rc != STORE_OK)
            mt_fail(m, "pusher %d: apply_grad rc %d", pa->id, rc);
    }
    atomic_fetch_sub(&m->pushers_left, 1);
    return NULL;
}

/* 1 when every value of snap equals version - 1. */
static int uniform(const store_snap *snap, float *value)
{
    const float *v = (const float *)snap->data->data;
    float want = (float)(snap->version - 1);
    for (int64_t i = 0; i < snap->numel; i++)
        if (v[i] != want)
            return 0;
    *value = want;
    return 1;
}

static void *reader(void *arg)
{
    mt *m = arg;
    store_snap held;
    int have_held = 0;
    float held_value = 0;
    while (atomic_load(&m->pushers_left) > 0) {
        store_snap one;
        float val = -1;
        if (store_get(m->s, "a", &one) != STORE_OK) {
            mt_fail(m, "reader: get a failed");
            break;
        }
        if (!uniform(&one, &val))
            mt_fail(m, "reader: snapshot of a v%llu not uniform",
                    (unsigned long long)one.version);
        /* keep one snapshot across a few rounds: it must not change under us */
        if (have_held) {
            float again;
            if (!uniform(&held, &again) || again != held_value)
                mt_fail(m, "reader: a held snapshot changed");
            store_snap_release(&held);
        }
        held = one;
        held_value = val;
        have_held = 1;

        store_snap *all;
        int n;
        int64_t step;
        if (store_get_all(m->s, &all, &n, &step) != STORE_OK || n != 3) {
            mt_fail(m, "reader: get_all failed");
            break;
        }
        float va, vb, vc;
        /* sorted: a, b, c */
        if (!uniform(&all[0], &va) || !uniform(&all[1], &vb) || !uniform(&all[2], &vc))
            mt_fail(m, "reader: get_all snapshot not uniform");
        else if (all[0].version != all[1].version)
            mt_fail(m, "reader: a v%llu and b v%llu in one snapshot",
                    (unsigned long long)all[0].version, (unsigned long long)all[1].version);
        else if ((uint64_t)step != (all[0].version - 1) + (all[2].version - 1))
            mt_fail(m, "reader: global_step %lld, but %llu bulk + %llu single updates",
                    (long long)step, (unsigned long long)all[0].version - 1,
                    (unsigned long long)all[2].version - 1);
        store_snaps_release(all, n);
        atomic_fetch_add(&m->reads, 1);
    }
    if (have_held)
        store_snap_release(&held);
    return NULL;
}

static void test_concurrent_push_and_read(void **state)
{
    fixture *fx = *state; /* learning rate 1 */
    store *s = &fx->s;
    float *zeros = calloc(MT_N, sizeof(float));
    assert_non_null(zeros);
    put_new(s, fx->pool, "a", shape1(MT_N), zeros);
    put_new(s, fx->pool, "b", shape1(MT_N), zeros);
    put_new(s, fx->pool, "c", shape1(MT_NC), zeros);
    free(zeros);

    for (int i = 0; i < 2 * MT_N; i++)
        minus_one[i] = -1;
    mt m;
    memset(&m, 0, sizeof(m));
    m.s = s;
    pthread_mutex_init(&m.mu, NULL);
    atomic_store(&m.pushers_left, MT_PUSHERS);
    pthread_t pt[MT_PUSHERS], rt[MT_READERS];
    pusher_arg pa[MT_PUSHERS];
    for (int i = 0; i < MT_READERS; i++)
        assert_int_equal(pthread_create(&rt[i], NULL, reader, &m), 0);
    for (int i = 0; i < MT_PUSHERS; i++) {
        pa[i].m = &m;
        pa[i].id = i;
        assert_int_equal(pthread_create(&pt[i], NULL, pusher, &pa[i]), 0);
    }
    for (int i = 0; i < MT_PUSHERS; i++)
        pthread_join(pt[i], NULL);
    for (int i = 0; i < MT_READERS; i++)
        pthread_join(rt[i], NULL);
    pthread_mutex_destroy(&m.mu);
    if (atomic_load(&m.failures))
        fail_msg("%d failures, first: %s", atomic_load(&m.failures), m.first_failure);
    print_message("concurrent: %ld consistent reads during %d pushes\n", atomic_load(&m.reads),
                  MT_PUSHERS * MT_ITERS * 2);

    /* every update landed exactly once */
    const int total = MT_PUSHERS * MT_ITERS;
    float *want = malloc(MT_N * sizeof(float));
    assert_non_null(want);
    for (int i = 0; i < MT_N; i++)
        want[i] = (float)total;
    expect_values(s, "a", want, MT_N, (uint64_t)total + 1);
    expect_values(s, "b", want, MT_N, (uint64_t)total + 1);
    expect_values(s, "c", want, MT_NC, (uint64_t)total + 1);
    free(want);
    assert_int_equal(step_of(s), 2 * total);
}

/* Adagrad with a staircase schedule and weight decay, values worked out by
 * hand (exact in float32): the accumulator starts at initial_accumulator_value
 * on the first update, the rate halves each global step, the decay is
 * lr_t * wd * w. Then the configuration, once training started, is accepted
 * again as is and refused with one field changed. */
static void test_adagrad_schedule_and_decay(void **state)
{
    fixture *fx = *state;
    store *s = &fx->s;
    const float w[2] = {1, 2};
    put_new(s, fx->pool, "w", shape1(2), w);
    store_config c;
    memset(&c, 0, sizeof(c));
    optim_defaults(&c.optim, OPTIM_ADAGRAD, 0.5f);
    c.optim.initial_accumulator_value = 0.4375f;
    c.optim.weight_decay = 0.5f;
    c.optim.lr_schedule = OPTIM_LR_EXPONENTIAL;
    c.optim.decay_steps = 1;
    c.optim.decay_rate = 0.5f;
    c.optim.staircase = 1;
    c.workers = c.replicas_to_aggregate = 1;
    c.max_staleness = c.staleness = -1;
    char err[256];
    assert_int_equal(store_configure(s, &c, err, sizeof(err)), STORE_OK);
    int64_t gs;
    uint64_t ver;
    /* step 0, lr 0.5: w = w - 0.25 w; accum = 0.4375 + g^2 = {1, 0.4375};
     * w0 = 0.75 - 0.5 * 0.75 / 1 */
    const float g1[2] = {0.75f, 0}, want1[2] = {0.375f, 1.5f};
    assert_int_equal(store_apply_grad(s, "w", g1, 2, &gs, &ver), STORE_OK);
    expect_values(s, "w", want1, 2, 2);
    /* step 1, lr 0.25: w = w - 0.125 w; accum = {1, 1}; w1 -= 0.25 * 0.75 / 1 */
    const float g2[2] = {0, 0.75f}, want2[2] = {0.328125f, 1.125f};
    assert_int_equal(store_apply_grad(s, "w", g2, 2, &gs, &ver), STORE_OK);
    expect_values(s, "w", want2, 2, 3);
    store_saved sv;
    assert_int_equal(store_save(s, &sv), STORE_OK);
    assert_int_equal(sv.n, 1);
    assert_int_equal(sv.vars[0].n_slots, 1);
    assert_true(sv.vars[0].slots[0] == 1.0f && sv.vars[0].slots[1] == 1.0f);
    store_saved_free(&sv);
    assert_int_equal(store_configure(s, &c, err, sizeof(err)), STORE_OK);
    store_config d = c;
    d.optim.clip_norm = 1;
    assert_int_equal(store_configure(s, &d, err, sizeof(err)), STORE_ECONFLICT);
}

/* --moving_average_decay, values exact in float32: sgd lr 1, decay 0.75.
 * The average starts from the value before the first update and follows
 * shadow = 0.75 shadow + 0.25 w after each; off, reading it is STORE_EMODE;
 * it survives a save and restore, and a restore without it starts it from
 * the variable. Then optim_ema itself against a double reference and
 * optim_ema_decay_ok's edges. */
static void test_moving_average(void **state)
{
    fixture *fx = *state;
    store *s = &fx->s;
    const float w[2] = {1, 2};
    put_new(s, fx->pool, "w", shape1(2), w);
    store_snap sn;
    store_config c;
    memset(&c, 0, sizeof(c));
    optim_defaults(&c.optim, OPTIM_SGD, 1.0f);
    c.workers = c.replicas_to_aggregate = 1;
    c.max_staleness = c.staleness = -1;
    char err[256];
    assert_int_equal(store_configure(s, &c, err, sizeof(err)), STORE_OK);
    assert_int_equal(store_get_average(s, "w", &sn), STORE_EMODE);
    c.moving_average_decay = 0.75f;
    assert_int_equal(store_configure(s, &c, err, sizeof(err)), STORE_OK);
    assert_int_equal(store_get_average(s, "nope", &sn), STORE_ENOENT);
    int64_t gs;
    uint64_t ver;
    /* w = {1, 2} - {4, 8} = {-3, -6}; shadow = 0.75 {1, 2} + 0.25 {-3, -6} = {0, 0} */
    const float g1[2] = {4, 8}, g2[2] = {-3, 2};
    assert_int_equal(store_apply_grad(s, "w", g1, 2, &gs, &ver), STORE_OK);
    assert_int_equal(store_get_average(s, "w", &sn), STORE_OK);
    const float *a = (const float *)sn.data->data;
    assert_true(a[0] == 0.0f && a[1] == 0.0f);
    store_snap_release(&sn);
    /* w = {0, -8}; shadow = 0.75 {0, 0} + 0.25 {0, -8} = {0, -2} */
    assert_int_equal(store_apply_grad(s, "w", g2, 2, &gs, &ver), STORE_OK);
    store_snap *all;
    int n;
    int64_t step;
    assert_int_equal(store_get_all_average(s, &all, &n, &step), STORE_OK);
    assert_int_equal(n, 1);
    assert_int_equal(step, 2);
    a = (const float *)all[0].data->data;
    assert_true(a[0] == 0.0f && a[1] == -2.0f);
    store_snaps_release(all, n);
    store_saved sv;
    assert_int_equal(store_save(s, &sv), STORE_OK);
    assert_non_null(sv.vars[0].shadow);
    assert_true(sv.vars[0].shadow[1] == -2.0f);
    assert_int_equal(store_restore(s, &sv), STORE_OK);
    store_saved_free(&sv);
    assert_int_equal(store_get_average(s, "w", &sn), STORE_OK);
    a = (const float *)sn.data->data;
    assert_true(a[0] == 0.0f && a[1] == -2.0f);
    store_snap_release(&sn);
    /* a checkpoint without the averages: they start from the variable {0, -8} */
    assert_int_equal(store_save(s, &sv), STORE_OK);
    free(sv.vars[0].shadow);
    sv.vars[0].shadow = NULL;
    assert_int_equal(store_restore(s, &sv), STORE_OK);
    store_saved_free(&sv);
    assert_int_equal(store_get_average(s, "w", &sn), STORE_OK);
    a = (const float *)sn.data->data;
    assert_true(a[0] == 0.0f && a[1] == -8.0f);
    store_snap_release(&sn);

    float sh[37], x[37];
    double ref[37];
    for (int i = 0; i < 37; i++) {
        sh[i] = (float)(i * 0.37 - 3);
        x[i] = (float)(1.5 - i * 0.11);
        ref[i] = 0.99 * (double)sh[i] + 0.01 * (double)x[i];
    }
    optim_ema(sh, x, 0.99f, 37);
    for (int i = 0; i < 37; i++)
        assert_true(fabs((double)sh[i] - ref[i]) <= 1e-6 * (1 + fabs(ref[i])));
    assert_true(optim_ema_decay_ok(0.99) && optim_ema_decay_ok(1e-30));
    assert_false(optim_ema_decay_ok(0) || optim_ema_decay_ok(1) || optim_ema_decay_ok(-0.5) ||
                 optim_ema_decay_ok(0.99999999999) || optim_ema_decay_ok(1e-50) ||
                 optim_ema_decay_ok(NAN) || optim_ema_decay_ok(INFINITY) ||
                 optim_ema_decay_ok(1e300));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_put_get_versions, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_only_create_and_shape, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_apply_grad_math, setup_half, teardown),
        cmocka_unit_test_setup_teardown(test_apply_grad_inexact, setup_tenth, teardown),
        cmocka_unit_test_setup_teardown(test_adagrad_schedule_and_decay, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_apply_grads, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_apply_grads_all_or_nothing, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_push_id_duplicates, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_snapshot_isolation, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_push_and_read, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_moving_average, setup_one, teardown),
    };
    return cmocka_run_group_tests_name("store", tests, NULL, NULL);
}
