/* test_topk.c - top-k sparsification with error feedback
 * (client/shards/topk.c) against a reference written here another way: a
 * full sort of the elements by magnitude, ties by the lower index (qsort),
 * where topk.c selects in linear time. Over several pushes with random
 * gradients (ties on purpose: values from a small set), each pick's ids and
 * values and the residual after it must be the reference's bit for bit; a
 * push that failed (no commit) leaves the residual as it was; and what went
 * plus what is left is every gradient's sum (error feedback loses nothing). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "shards/topk.h"

typedef struct ref_el {
    float mag;
    int32_t id;
} ref_el;

static int by_mag_desc(const void *a, const void *b)
{
    const ref_el *x = a, *y = b;
    if (x->mag != y->mag)
        return x->mag > y->mag ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static int by_id(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The reference pick over acc (numel, acc = residual + gradient): ids
 * ascending into ids, those elements' values into vals, zeroed in acc. */
static void ref_pick(float *acc, int64_t numel, int64_t k, int32_t *ids, float *vals)
{
    ref_el *e = malloc(sizeof(ref_el) * (size_t)numel);
    assert_non_null(e);
    for (int64_t i = 0; i < numel; i++)
        e[i] = (ref_el){fabsf(acc[i]), (int32_t)i};
    qsort(e, (size_t)numel, sizeof(ref_el), by_mag_desc);
    for (int64_t i = 0; i < k; i++)
        ids[i] = e[i].id;
    qsort(ids, (size_t)k, sizeof(int32_t), by_id);
    for (int64_t i = 0; i < k; i++) {
        vals[i] = acc[ids[i]];
        acc[ids[i]] = 0;
    }
    free(e);
}

static float rnd(unsigned *s, int ties)
{
    *s = *s * 1103515245u + 12345u;
    int v = (int)((*s >> 8) % 2001) - 1000;
    return ties ? (float)(v % 7) * 0.25f : (float)v / 997.0f;
}

static void picks_match_the_sorted_reference(void **state)
{
    (void)state;
    /* two tensors in one buffer, at offsets 0 and 300 */
    const int64_t numel[2] = {300, 1001};
    const size_t off[2] = {0, 300}, n = 1301;
    topk t;
    assert_int_equal(topk_init(&t, 0.05, n), 0);
    float *grad = malloc(sizeof(float) * n), *ref = calloc(n, sizeof(float)), *sum = calloc(n, sizeof(float));
    float *sent = calloc(n, sizeof(float));
    int32_t ids[64], rids[64];
    float vals[64], rvals[64];
    unsigned seed = 7;
    for (int push = 0; push < 12; push++) {
        int ties = push % 3 == 1, fail = push == 5;
        for (size_t i = 0; i < n; i++)
            grad[i] = rnd(&seed, ties);
        float before[1301];
        memcpy(before, t.resid, sizeof(before));
        float acc[1301];
        for (size_t i = 0; i < n; i++)
            acc[i] = ref[i] + grad[i];
        for (int j = 0; j < 2; j++) {
            int64_t k = topk_count(&t, numel[j], 4, 4);
            assert_int_equal(k, (int64_t)ceil(0.05 * (double)numel[j]));
            assert_int_equal(topk_pick(&t, grad + off[j], off[j], numel[j], k, ids, vals), 0);
            ref_pick(acc + off[j], numel[j], k, rids, rvals);
            assert_memory_equal(ids, rids, sizeof(int32_t) * (size_t)k);
            assert_memory_equal(vals, rvals, sizeof(float) * (size_t)k);
            if (!fail)
                for (int64_t i = 0; i < k; i++)
                    sent[off[j] + (size_t)ids[i]] += vals[i];
        }
        if (fail) { /* not committed: the residual stays */
            assert_memory_equal(t.resid, before, sizeof(before));
            continue;
        }
        topk_commit(&t);
        memcpy(ref, acc, sizeof(acc));
        assert_memory_equal(t.resid, ref, sizeof(float) * n);
        for (size_t i = 0; i < n; i++)
            sum[i] += grad[i];
    }
    /* nothing lost: what went plus what is left is the gradients' sum
     * (float sums in another order: within rounding) */
    for (size_t i = 0; i < n; i++)
        assert_true(fabsf(sent[i] + t.resid[i] - sum[i]) <= 1e-4f * (1 + fabsf(sum[i])));
    free(grad);
    free(ref);
    free(sum);
    free(sent);
    topk_free(&t);
}

static void a_pick_that_would_not_be_smaller_goes_whole(void **state)
{
    (void)state;
    topk t;
    assert_int_equal(topk_init(&t, 0.3, 10), 0);
    /* 0.3 of 10: 3 picks of 8 bytes (4-byte ids, 4-byte values) = 24 < 40 */
    assert_int_equal(topk_count(&t, 10, 4, 4), 3);
    /* 16-bit dense: 3 x 6 = 18 < 20; but one element: never */
    assert_int_equal(topk_count(&t, 10, 2, 2), 3);
    assert_int_equal(topk_count(&t, 1, 4, 4), 0);
    assert_int_equal(topk_count(&t, (int64_t)INT32_MAX + 1, 4, 4), 0); /* past 4-byte ids */
    topk_free(&t);
    assert_int_equal(topk_init(&t, 0.5, 10), 0);
    assert_int_equal(topk_count(&t, 10, 4, 4), 0); /* 5 x 8 = 40: not smaller */
    /* whole: nothing is left of it */
    float g[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    int32_t ids[5];
    float vals[5];
    assert_int_equal(topk_pick(&t, g, 0, 10, 5, ids, vals), 0);
    topk_commit(&t);
    float left = 0;
    for (int i = 0; i < 10; i++)
        left += t.resid[i];
    assert_true(left == 15.0f); /* 1..5 kept */
    topk_sent_whole(&t, 0, 10);
    topk_commit(&t);
    for (int i = 0; i < 10; i++)
        assert_true(t.resid[i] == 0.0f);
    topk_free(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(picks_match_the_sorted_reference),
        cmocka_unit_test(a_pick_that_would_not_be_smaller_goes_whole),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
