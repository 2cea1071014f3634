/* test_sparse_table.c - common/sparse_table.c against a plain reference: a
 * list of (id, value, last update) kept by hand, with least-recently-updated
 * eviction, over thousands of random updates of random ids (many colliding
 * in the hash, some near 2^62), so that the hash's deletions (backward
 * shift), the swap on eviction and the LRU list are all exercised; and the
 * checks of ids, the initializer, duplicate ids, the row limit. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"
#include "sparse_table.h"

#define DIM 3
#define MAXR 50

typedef struct ref_row {
    int64_t id;
    float v[DIM];
    int64_t when;
} ref_row;

static ref_row ref[MAXR + 32];
static int n_ref;

static int ref_find(int64_t id)
{
    for (int i = 0; i < n_ref; i++)
        if (ref[i].id == id)
            return i;
    return -1;
}

static void raw_ids(const int64_t *ids, int n, unsigned char *out)
{
    memcpy(out, ids, 8 * (size_t)n);
}

/* One update of n distinct ids with gradient g (sgd, lr 1) on both. */
static void update_both(sparse_table *t, const sparse_decl *d, const optim_config *c, const int64_t *ids,
                        const float *g, int n, int64_t now)
{
    unsigned char raw[8 * 32];
    raw_ids(ids, n, raw);
    sparse_acc a;
    sparse_acc_init(&a, DIM);
    assert_int_equal(sparse_acc_add(&a, raw, g, n), 0);
    char err[256];
    assert_int_equal(sparse_prepare(t, &a, err, sizeof(err)), 0);
    sparse_apply(t, &a, c, 1.0f, 0);
    sparse_acc_free(&a);
    /* the reference: touched rows updated now, created from the initializer, then the oldest others
     * evicted. Within one update the rows held count as updated first, in the update's order, then the
     * new ones in that order (a tie the table breaks so: sparse_table.h) */
    int64_t rank = 0, t0 = now * 64;
    int held[32];
    for (int k = 0; k < n; k++)
        held[k] = ref_find(ids[k]) >= 0;
    for (int pass = 1; pass >= 0; pass--)
        for (int k = 0; k < n; k++) {
            if (held[k] != pass)
                continue;
            int i = ref_find(ids[k]);
            if (i < 0) {
                i = n_ref++;
                ref[i].id = ids[k];
                sparse_init_row(d, ids[k], ref[i].v);
            }
            for (int j = 0; j < DIM; j++)
                ref[i].v[j] = ref[i].v[j] - 1.0f * g[k * DIM + j];
            ref[i].when = t0 + rank++;
        }
    while (n_ref > MAXR) {
        int old = 0;
        for (int i = 1; i < n_ref; i++)
            if (ref[i].when < ref[old].when)
                old = i;
        assert_true(ref[old].when < t0); /* never a row this update touched */
        ref[old] = ref[--n_ref];
    }
}

static void check_same(const sparse_table *t, const sparse_decl *d, const int64_t *pool, int n_pool)
{
    assert_int_equal(t->n, n_ref);
    for (int p = 0; p < n_pool; p++) {
        unsigned char raw[8];
        float got[DIM], want[DIM];
        raw_ids(&pool[p], 1, raw);
        sparse_lookup(t, raw, 1, got);
        int i = ref_find(pool[p]);
        if (i >= 0)
            memcpy(want, ref[i].v, sizeof(want));
        else
            sparse_init_row(d, pool[p], want);
        assert_memory_equal(got, want, sizeof(want));
    }
    /* oldest first: the reference's order by last update */
    int64_t prev_when = -1, k = 0;
    for (int64_t r = sparse_oldest(t); r >= 0; r = sparse_newer(t, r), k++) {
        int i = ref_find(t->ids[r]);
        assert_true(i >= 0);
        assert_true(ref[i].when >= prev_when);
        prev_when = ref[i].when;
    }
    assert_int_equal(k, n_ref);
}

static void test_random_updates_match_the_reference(void **state)
{
    (void)state;
    sparse_decl d = {.rows = 0, .dim = DIM, .max_rows = MAXR, .init = SPARSE_INIT_UNIFORM, .init_scale = 0.5f,
                     .seed = 7, .shard = 0, .shards = 1};
    char err[256];
    assert_int_equal(sparse_decl_check(&d, err, sizeof(err)), 0);
    optim_config c;
    optim_defaults(&c, OPTIM_SGD, 1.0f);
    sparse_table t;
    assert_int_equal(sparse_table_init(&t, "emb", &d), 0);
    assert_int_equal(sparse_ensure_slots(&t, &c), 0);
    n_ref = 0;
    uint64_t st = 12345;
    int64_t pool[200];
    for (int i = 0; i < 200; i++) /* small ids (colliding home slots) and ids near 2^62 */
        pool[i] = i < 100 ? (int64_t)i * 64 : ((int64_t)1 << 62) - (int64_t)rng_below(&st, 1000000);
    for (int64_t now = 1; now <= 3000; now++) {
        int n = 1 + (int)rng_below(&st, 20);
        int64_t ids[32];
        float g[32 * DIM];
        for (int k = 0; k < n; k++) {
            int64_t id;
            int dup;
            do { /* distinct within the update: the reference sums nothing */
                id = pool[rng_below(&st, 200)];
                dup = 0;
                for (int j = 0; j < k; j++)
                    dup |= ids[j] == id;
            } while (dup);
            ids[k] = id;
            for (int j = 0; j < DIM; j++)
                g[k * DIM + j] = (float)((int)rng_below(&st, 9) - 4) * 0.25f;
        }
        update_both(&t, &d, &c, ids, g, n, now);
        if (now % 97 == 0 || now > 2990)
            check_same(&t, &d, pool, 200);
    }
    assert_true(t.evicted > 1000);
    sparse_table_free(&t);
}

static void test_duplicates_are_summed_and_the_limit_refuses(void **state)
{
    (void)state;
    sparse_decl d = {.rows = 10, .dim = 2, .max_rows = 3, .init = SPARSE_INIT_ZEROS, .shard = 0, .shards = 1};
    optim_config c;
    optim_defaults(&c, OPTIM_SGD, 0.5f);
    sparse_table t;
    assert_int_equal(sparse_table_init(&t, "e", &d), 0);
    int64_t ids[4] = {2, 5, 2, 2};
    float g[8] = {1, 2, 10, 20, 100, 200, 1000, 2000};
    unsigned char raw[32];
    raw_ids(ids, 4, raw);
    sparse_acc a;
    sparse_acc_init(&a, 2);
    assert_int_equal(sparse_acc_add(&a, raw, g, 4), 0);
    assert_int_equal(a.n, 2);
    char err[256];
    assert_int_equal(sparse_prepare(&t, &a, err, sizeof(err)), 0);
    sparse_apply(&t, &a, &c, 1.0f, 0);
    float out[4];
    int64_t q[2] = {2, 5};
    raw_ids(q, 2, raw);
    sparse_lookup(&t, raw, 2, out);
    assert_true(out[0] == -0.5f * 1101 && out[1] == -0.5f * 2202 && out[2] == -5 && out[3] == -10);
    sparse_acc_free(&a);
    /* four distinct rows in one update: more than max_rows 3 */
    int64_t four[4] = {0, 1, 3, 4};
    raw_ids(four, 4, raw);
    sparse_acc_init(&a, 2);
    assert_int_equal(sparse_acc_add(&a, raw, g, 4), 0);
    assert_int_equal(sparse_prepare(&t, &a, err, sizeof(err)), -2);
    assert_non_null(strstr(err, "max_rows"));
    sparse_acc_free(&a);
    sparse_table_free(&t);
}

static void test_ids_are_checked(void **state)
{
    (void)state;
    sparse_decl d = {.rows = 100, .dim = 1, .max_rows = 100, .shard = 1, .shards = 3};
    sparse_table t;
    assert_int_equal(sparse_table_init(&t, "e", &d), 0);
    char err[256];
    int64_t ok[2] = {1, 97}, neg[1] = {-3}, big[1] = {100}, other[1] = {5};
    unsigned char raw[16];
    raw_ids(ok, 2, raw);
    assert_int_equal(sparse_check_ids(&t, raw, 2, err, sizeof(err)), 0);
    raw_ids(neg, 1, raw);
    assert_int_equal(sparse_check_ids(&t, raw, 1, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "negative"));
    raw_ids(big, 1, raw);
    assert_int_equal(sparse_check_ids(&t, raw, 1, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "out of range"));
    raw_ids(other, 1, raw);
    assert_int_equal(sparse_check_ids(&t, raw, 1, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "shard 2 of 3"));
    sparse_table_free(&t);
}

static void test_adagrad_rows_start_and_stay_lazy(void **state)
{
    (void)state;
    sparse_decl d = {.rows = 0, .dim = 1, .max_rows = 10, .shard = 0, .shards = 1};
    optim_config c;
    optim_defaults(&c, OPTIM_ADAGRAD, 1.0f); /* initial_accumulator_value 0.1 */
    sparse_table t;
    assert_int_equal(sparse_table_init(&t, "e", &d), 0);
    assert_int_equal(sparse_ensure_slots(&t, &c), 0);
    char err[256];
    for (int step = 0; step < 3; step++) {
        int64_t id = step == 0 ? 7 : 9; /* 7 once, 9 twice: 9 is new at the table's second update */
        float g = 2.0f;
        unsigned char raw[8];
        raw_ids(&id, 1, raw);
        sparse_acc a;
        sparse_acc_init(&a, 1);
        assert_int_equal(sparse_acc_add(&a, raw, &g, 1), 0);
        assert_int_equal(sparse_prepare(&t, &a, err, sizeof(err)), 0);
        sparse_apply(&t, &a, &c, 1.0f, step);
        sparse_acc_free(&a);
    }
    /* row 7: accum 0.1 + 4 once; row 9: 0.1 + 4 + 4 (started at 0.1 though t was 2) */
    for (int64_t r = 0; r < t.n; r++) {
        float want = t.ids[r] == 7 ? 4.1f : 8.1f;
        assert_true(fabsf(t.slot0[r] - want) < 1e-6f);
    }
    sparse_table_free(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_updates_match_the_reference),
        cmocka_unit_test(test_duplicates_are_summed_and_the_limit_refuses),
        cmocka_unit_test(test_ids_are_checked),
        cmocka_unit_test(test_adagrad_rows_start_and_stay_lazy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
