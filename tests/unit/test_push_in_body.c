/* test_push_in_body.c - a push applied in its own body (server/store.c
 * apply_in_body, store.h in_body) and what it rests on (server/bufpool.c):
 * views keep their parent, the pool keeps its newest idle blob; the next
 * values against the same float expression computed here, the variable's data
 * a view of the body afterwards, a NaN in the last element refused with
 * nothing changed, a snapshot taken before the push keeping the old values,
 * and a variable left alone in an old body getting a blob of its own. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bufpool.h"
#include "store.h"
#include "store_fixture.h"

#define LR 0.5f
#define N_BIG (3 * 4096 + 5) /* several of the apply's chunks and a tail */

typedef store_fixture fixture;

static int setup(void **state) { return store_fixture_setup(state, LR); }
static int teardown(void **state) { return store_fixture_teardown(state); }

static float val(int i, int seed) { return (float)((i * 37 + seed * 11) % 101) * 0.03125f - 1.5f; }

static void put(fixture *fx, const char *name, int n, int seed)
{
    blob *b = blob_new(fx->pool, (size_t)n * 4);
    assert_non_null(b);
    for (int i = 0; i < n; i++)
        ((float *)b->data)[i] = val(i, seed);
    tensor_shape sh = {.ndim = 1, .dims = {n}};
    int created;
    uint64_t version;
    assert_int_equal(store_put(&fx->s, name, &sh, b, 1, &created, &version), STORE_OK);
}

/* A push body as POST /v1/grads keeps it: 8 + 56 header bytes, then the
 * tensors' data, in a blob of the pool; f describes it. */
typedef struct body {
    blob *b;
    st_tensor t[2];
    char names[2][16];
    st_file f;
    unsigned char *data;
} body;

static void body_make(fixture *fx, body *bd, const char *const *names, const int *ns, int n, int seed)
{
    memset(bd, 0, sizeof(*bd));
    size_t bytes = 0;
    for (int k = 0; k < n; k++)
        bytes += (size_t)ns[k] * 4;
    bd->b = blob_new(fx->pool, 64 + bytes);
    assert_non_null(bd->b);
    bd->data = bd->b->data + 64;
    uint64_t at = 0;
    for (int k = 0; k < n; k++) {
        snprintf(bd->names[k], sizeof(bd->names[k]), "%s", names[k]);
        bd->t[k].name = bd->names[k];
        snprintf(bd->t[k].dtype, sizeof(bd->t[k].dtype), "F32");
        bd->t[k].shape = (tensor_shape){.ndim = 1, .dims = {ns[k]}};
        bd->t[k].begin = at;
        bd->t[k].end = at + (uint64_t)ns[k] * 4;
        for (int i = 0; i < ns[k]; i++)
            ((float *)(bd->data + at))[i] = val(i, seed + k);
        at = bd->t[k].end;
    }
    bd->f.tensors = bd->t;
    bd->f.n_tensors = n;
    bd->f.data_len = at;
}

static int apply(fixture *fx, body *bd, char *err, size_t errlen)
{
    store_push_meta meta = {.worker = -1, .step = -1, .clock = -1, .body = bd->b, .in_body = 1};
    int64_t gs;
    int outcome;
    return store_apply_grads(&fx->s, &bd->f, bd->data, &meta, &gs, &outcome, err, errlen);
}

/* name holds w_seed - LR * g_gseed (optim_apply's sgd expression) */
static void expect_sgd(fixture *fx, const char *name, int n, int wseed, int gseed, uint64_t version)
{
    store_snap sn;
    assert_int_equal(store_get(&fx->s, name, &sn), STORE_OK);
    const float *got = (const float *)sn.data->data;
    for (int i = 0; i < n; i++) {
        float w = val(i, wseed), wi = w - (LR * 0.0f) * w;
        float want = wi - LR * (val(i, gseed) * 1.0f);
        if (memcmp(&got[i], &want, 4) != 0)
            fail_msg("%s[%d] = %.9g, want %.9g", name, i, (double)got[i], (double)want);
    }
    assert_int_equal(sn.version, version);
    store_snap_release(&sn);
}

static void test_a_view_keeps_its_parent(void **state)
{
    fixture *fx = *state;
    blob *p = blob_new(fx->pool, 1000);
    memset(p->data, 7, 1000);
    assert_null(blob_view(p, p->cap - 100, 101)); /* past the end */
    assert_null(blob_view(p, p->cap + 1, 0));
    blob *v = blob_view(p, 100, 800);
    assert_non_null(v);
    assert_ptr_equal(v->data, p->data + 100);
    assert_int_equal(v->len, 800);
    assert_ptr_equal(v->parent, p);
    blob_unref(p); /* the view holds it */
    assert_int_equal(v->data[799], 7);
    blob_unref(v);
}

static void test_the_pool_keeps_its_newest_idle_blob(void **state)
{
    (void)state;
    bufpool *pool = bufpool_new((size_t)10 << 20); /* one 4 MiB blob (6 MiB cap), not two */
    blob *a = blob_new(pool, (size_t)4 << 20), *b = blob_new(pool, (size_t)4 << 20);
    unsigned char *bd = b->data;
    blob_unref(a);
    blob_unref(b); /* no room for both: a goes, b stays */
    assert_int_equal(bufpool_idle_bytes(pool), b->cap);
    blob *c = blob_new(pool, (size_t)4 << 20);
    assert_ptr_equal(c->data, bd);
    blob_unref(c);
    bufpool_free(pool);
}

static void test_next_values_are_written_into_the_body(void **state)
{
    fixture *fx = *state;
    put(fx, "w", N_BIG, 1);
    body bd;
    const char *names[] = {"w"};
    const int ns[] = {N_BIG};
    body_make(fx, &bd, names, ns, 1, 2);
    char err[256] = "";
    if (apply(fx, &bd, err, sizeof(err)) != STORE_OK)
        fail_msg("apply: %s", err);
    expect_sgd(fx, "w", N_BIG, 1, 2, 2);
    store_snap sn;
    assert_int_equal(store_get(&fx->s, "w", &sn), STORE_OK);
    assert_ptr_equal(sn.data->parent, bd.b); /* no copy: the body's bytes */
    assert_ptr_equal(sn.data->data, bd.data);
    store_snap_release(&sn);
    blob_unref(bd.b); /* the request's reference; the variable keeps the bytes */
    expect_sgd(fx, "w", N_BIG, 1, 2, 2);
    assert_int_equal(store_global_step(&fx->s), 1);
}

static void test_nan_in_the_last_element_changes_nothing(void **state)
{
    fixture *fx = *state;
    put(fx, "a", 5, 3);
    put(fx, "w", N_BIG, 1);
    body bd;
    const char *names[] = {"a", "w"};
    const int ns[] = {5, N_BIG};
    body_make(fx, &bd, names, ns, 2, 4);
    ((float *)(bd.data + bd.t[1].begin))[N_BIG - 1] = NAN;
    char err[256] = "";
    assert_int_equal(apply(fx, &bd, err, sizeof(err)), STORE_EINVAL);
    char want[64];
    snprintf(want, sizeof(want), "gradient 'w' has NaN at element %d", N_BIG - 1);
    assert_string_equal(err, want);
    blob_unref(bd.b);
    store_snap sn;
    assert_int_equal(store_get(&fx->s, "w", &sn), STORE_OK);
    for (int i = 0; i < N_BIG; i++)
        assert_true(((float *)sn.data->data)[i] == val(i, 1));
    assert_int_equal(sn.version, 1);
    assert_null(sn.data->parent);
    store_snap_release(&sn);
    assert_int_equal(store_get(&fx->s, "a", &sn), STORE_OK);
    for (int i = 0; i < 5; i++)
        assert_true(((float *)sn.data->data)[i] == val(i, 3));
    assert_int_equal(sn.version, 1);
    store_snap_release(&sn);
    assert_int_equal(store_global_step(&fx->s), 0);
}

static void test_a_snapshot_keeps_the_version_it_took(void **state)
{
    fixture *fx = *state;
    put(fx, "w", N_BIG, 1);
    store_snap old;
    assert_int_equal(store_get(&fx->s, "w", &old), STORE_OK); /* a pull in flight */
    for (int k = 0; k < 2; k++) {
        body bd;
        const char *names[] = {"w"};
        const int ns[] = {N_BIG};
        body_make(fx, &bd, names, ns, 1, 2);
        char err[256] = "";
        if (apply(fx, &bd, err, sizeof(err)) != STORE_OK)
            fail_msg("apply: %s", err);
        blob_unref(bd.b);
    }
    for (int i = 0; i < N_BIG; i++)
        assert_true(((float *)old.data->data)[i] == val(i, 1));
    assert_int_equal(old.version, 1);
    store_snap_release(&old);
    assert_int_equal(store_global_step(&fx->s), 2);
}

static void test_a_variable_left_in_an_old_body_gets_its_own_blob(void **state)
{
    fixture *fx = *state;
    put(fx, "big", N_BIG, 1);
    put(fx, "c", 5, 3);
    body both, alone;
    const char *n2[] = {"big", "c"}, *n1[] = {"big"};
    const int ns2[] = {N_BIG, 5}, ns1[] = {N_BIG};
    body_make(fx, &both, n2, ns2, 2, 4);
    char err[256] = "";
    assert_int_equal(apply(fx, &both, err, sizeof(err)), STORE_OK);
    blob_unref(both.b);
    store_snap sn;
    assert_int_equal(store_get(&fx->s, "c", &sn), STORE_OK);
    assert_ptr_equal(sn.data->parent, both.b);
    store_snap_release(&sn);
    /* big alone: c would keep all of the first body alive */
    body_make(fx, &alone, n1, ns1, 1, 6);
    assert_int_equal(apply(fx, &alone, err, sizeof(err)), STORE_OK);
    blob_unref(alone.b);
    assert_int_equal(store_get(&fx->s, "c", &sn), STORE_OK);
    assert_null(sn.data->parent);
    for (int i = 0; i < 5; i++) {
        float want = val(i, 3) - LR * val(i, 5);
        assert_true(((float *)sn.data->data)[i] == want);
    }
    assert_int_equal(sn.version, 2); /* the same value, the same version */
    store_snap_release(&sn);
}

/* A small gradient behind a large header (a body of 1 MiB for 5 floats)
 * is applied into a blob of the variable's own, not kept as a view that
 * would hold the whole body; checked for NaN all the same. */
static void test_a_body_mostly_header_is_not_kept(void **state)
{
    fixture *fx = *state;
    put(fx, "c", 5, 3);
    const char *names[] = {"c"};
    const int ns[] = {5};
    body bd;
    body_make(fx, &bd, names, ns, 1, 5);
    blob *big = blob_new(fx->pool, (size_t)1 << 20); /* the same body, a 1 MiB header before it */
    assert_non_null(big);
    memcpy(big->data + big->len - 20, bd.data, 20);
    blob_unref(bd.b);
    bd.b = big;
    bd.data = big->data + big->len - 20;
    ((float *)bd.data)[4] = NAN;
    char err[256] = "";
    assert_int_equal(apply(fx, &bd, err, sizeof(err)), STORE_EINVAL);
    assert_string_equal(err, "gradient 'c' has NaN at element 4");
    ((float *)bd.data)[4] = val(4, 5);
    if (apply(fx, &bd, err, sizeof(err)) != STORE_OK)
        fail_msg("apply: %s", err);
    store_snap sn;
    assert_int_equal(store_get(&fx->s, "c", &sn), STORE_OK);
    assert_null(sn.data->parent);
    store_snap_release(&sn);
    blob_unref(bd.b);
    expect_sgd(fx, "c", 5, 3, 5, 2);
}

/* The one pass (optim_sgd_into_grad, in the body, split over two threads
 * from 2^21 floats) against optim_apply's sgd (a push with in_body 0 goes
 * through update_into), bit for bit: weight decay, the learning-rate
 * schedules, clipping that applies and that does not, a moving average;
 * three pushes each, so the schedule and the average move. */
#define N_SPLIT ((1 << 21) + 7)

static void configure(store *s, const optim_config *o, float ema)
{
    store_config c = {.optim = *o, .replicas_to_aggregate = 1, .workers = 1, .max_staleness = -1,
                      .staleness = -1, .moving_average_decay = ema};
    char err[256] = "";
    if (store_configure(s, &c, err, sizeof(err)) != STORE_OK)
        fail_msg("store_configure: %s", err);
}

static void expect_same(store *a, store *b, const char *what, int average)
{
    store_snap x, y;
    if (average) {
        assert_int_equal(store_get_average(a, "w", &x), STORE_OK);
        assert_int_equal(store_get_average(b, "w", &y), STORE_OK);
    } else {
        assert_int_equal(store_get(a, "w", &x), STORE_OK);
        assert_int_equal(store_get(b, "w", &y), STORE_OK);
        assert_int_equal(x.version, y.version);
    }
    const float *p = (const float *)x.data->data, *q = (const float *)y.data->data;
    for (int i = 0; i < N_SPLIT; i++)
        if (memcmp(&p[i], &q[i], 4) != 0)
            fail_msg("%s%s: w[%d] = %.9g in the body, %.9g by optim_apply", what,
                     average ? " (average)" : "", i, (double)p[i], (double)q[i]);
    store_snap_release(&x);
    store_snap_release(&y);
}

static void test_the_one_pass_gives_optim_applys_floats(void **state)
{
    (void)state;
    struct {
        const char *what;
        float wd, clip, ema;
        optim_schedule sched;
    } cases[] = {
        {"weight decay, exponential", 0.01f, 0, 0, OPTIM_LR_EXPONENTIAL},
        {"clipped, cosine", 0, 3.0f, 0, OPTIM_LR_COSINE},
        {"clip above the norm, average", 0, 1e9f, 0.9f, OPTIM_LR_CONSTANT},
        {"weight decay, average", 0.02f, 0, 0.99f, OPTIM_LR_EXPONENTIAL},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        fixture fa, fb;
        assert_int_equal(store_fixture_init(&fa, LR, (size_t)64 << 20), 0);
        assert_int_equal(store_fixture_init(&fb, LR, (size_t)64 << 20), 0);
        optim_config o;
        optim_defaults(&o, OPTIM_SGD, LR);
        o.weight_decay = cases[c].wd;
        o.clip_norm = cases[c].clip;
        o.lr_schedule = cases[c].sched;
        o.decay_steps = 2;
        o.decay_rate = 0.5f;
        o.staircase = 0;
        configure(&fa.s, &o, cases[c].ema);
        configure(&fb.s, &o, cases[c].ema);
        put(&fa, "w", N_SPLIT, 1);
        put(&fb, "w", N_SPLIT, 1);
        assert_int_equal(store_push_in_body(&fa.s), 1);
        for (int t = 0; t < 3; t++) {
            const char *names[] = {"w"};
            const int ns[] = {N_SPLIT};
            body ba, bb;
            body_make(&fa, &ba, names, ns, 1, 10 + t);
            body_make(&fb, &bb, names, ns, 1, 10 + t);
            char err[256] = "";
            if (apply(&fa, &ba, err, sizeof(err)) != STORE_OK)
                fail_msg("%s: in the body: %s", cases[c].what, err);
            store_push_meta meta = {.worker = -1, .step = -1, .clock = -1, .body = bb.b, .in_body = 0};
            int64_t gs;
            int outcome;
            if (store_apply_grads(&fb.s, &bb.f, bb.data, &meta, &gs, &outcome, err, sizeof(err)) != STORE_OK)
                fail_msg("%s: optim_apply: %s", cases[c].what, err);
            blob_unref(ba.b);
            blob_unref(bb.b);
            expect_same(&fa.s, &fb.s, cases[c].what, 0);
            if (cases[c].ema > 0)
                expect_same(&fa.s, &fb.s, cases[c].what, 1);
        }
        store_snap sn; /* the positive control: the values moved */
        assert_int_equal(store_get(&fa.s, "w", &sn), STORE_OK);
        assert_true(((const float *)sn.data->data)[1] != val(1, 1));
        store_snap_release(&sn);
        store_fixture_destroy(&fa);
        store_fixture_destroy(&fb);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_a_view_keeps_its_parent, setup, teardown),
        cmocka_unit_test(test_the_pool_keeps_its_newest_idle_blob),
        cmocka_unit_test_setup_teardown(test_next_values_are_written_into_the_body, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nan_in_the_last_element_changes_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_snapshot_keeps_the_version_it_took, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_variable_left_in_an_old_body_gets_its_own_blob, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_a_body_mostly_header_is_not_kept, setup, teardown),
        cmocka_unit_test(test_the_one_pass_gives_optim_applys_floats),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
