/* test_placement.c - where each variable lives (client/placement.c): the
 * bytes and round-robin policies on layouts worked out by hand, the
 * partitioning of large tensors by rows (TensorFlow's fixed_size_partitioner:
 * the first rows % parts parts one row longer), ties, and, over many
 * layouts, that the pieces tile the parameter buffer exactly once and that
 * every task computes the same map. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shards/placement.h"

/* A layout of n tensors with the given names and 1-D or 2-D shapes (rows,
 * cols; cols 0 = 1-D), laid out one after the other. */
typedef struct spec {
    const char *name;
    int64_t rows, cols;
} spec;

static model_layout layout_of(const spec *s, int n)
{
    model_layout L;
    memset(&L, 0, sizeof(L));
    snprintf(L.spec, sizeof(L.spec), "test");
    L.input = (model_shape){1, 1, 8};
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        model_tensor *t = &L.tensors[i];
        snprintf(t->name, sizeof(t->name), "%s", s[i].name);
        t->shape.ndim = s[i].cols ? 2 : 1;
        t->shape.dims[0] = s[i].rows;
        if (s[i].cols)
            t->shape.dims[1] = s[i].cols;
        t->numel = (size_t)s[i].rows * (size_t)(s[i].cols ? s[i].cols : 1);
        t->offset = at;
        at += t->numel;
    }
    L.n_tensors = n;
    L.n_params = at;
    return L;
}

static placement place(const model_layout *L, int n_ps, place_policy pol, uint64_t part_bytes)
{
    placement p;
    char err[128];
    assert_int_equal(placement_compute(&p, L, n_ps, pol, part_bytes, err, sizeof(err)), 0);
    return p;
}

/* 4-3-2: W0 [4,3] 48 bytes, b0 [3] 12, W1 [3,2] 24, b1 [2] 8 */
static const spec SMALL[] = {{"w0", 4, 3}, {"b0", 3, 0}, {"w1", 3, 2}, {"b1", 2, 0}};

static void test_policy_names(void **state)
{
    (void)state;
    place_policy p = PLACE_ROUND_ROBIN;
    assert_int_equal(place_policy_from_name("bytes", &p), 0);
    assert_int_equal(p, PLACE_BYTES);
    assert_int_equal(place_policy_from_name("round_robin", &p), 0);
    assert_int_equal(p, PLACE_ROUND_ROBIN);
    assert_string_equal(place_policy_name(PLACE_BYTES), "bytes");
    assert_string_equal(place_policy_name(PLACE_ROUND_ROBIN), "round_robin");
    p = PLACE_BYTES;
    assert_int_equal(place_policy_from_name("Bytes", &p), -1);
    assert_int_equal(place_policy_from_name("", &p), -1);
    assert_int_equal(place_policy_from_name("round-robin", &p), -1);
    assert_int_equal(p, PLACE_BYTES); /* a refused name changes nothing */
}

/* Largest first onto the lightest ps: w0 (48) -> 0, w1 (24) -> 1,
 * b0 (12) -> 1 (24 < 48), b1 (8) -> 1 (36 < 48). */
static void test_bytes_policy_by_hand(void **state)
{
    (void)state;
    model_layout L = layout_of(SMALL, 4);
    placement p = place(&L, 2, PLACE_BYTES, UINT64_MAX);
    assert_int_equal(p.n, 4);
    const int want_ps[] = {0, 1, 1, 1}; /* in model order: w0 b0 w1 b1 */
    for (int i = 0; i < 4; i++) {
        assert_string_equal(p.pieces[i].name, SMALL[i].name);
        assert_int_equal(p.pieces[i].tensor, i);
        assert_int_equal(p.pieces[i].ps, want_ps[i]);
        assert_int_equal(p.pieces[i].parts, 1);
        assert_int_equal(p.pieces[i].row0, 0);
        assert_int_equal(p.pieces[i].offset, L.tensors[i].offset);
        assert_int_equal(p.pieces[i].numel, L.tensors[i].numel);
    }
    assert_int_equal(p.bytes[0], 48);
    assert_int_equal(p.bytes[1], 44);
    placement_free(&p);
}

/* The k-th variable on ps k % n in model order: w0, w1 -> 0; b0, b1 -> 1. */
static void test_round_robin_by_hand(void **state)
{
    (void)state;
    model_layout L = layout_of(SMALL, 4);
    placement p = place(&L, 2, PLACE_ROUND_ROBIN, UINT64_MAX);
    const int want_ps[] = {0, 1, 0, 1};
    for (int i = 0; i < 4; i++)
        assert_int_equal(p.pieces[i].ps, want_ps[i]);
    assert_int_equal(p.bytes[0], 72);
    assert_int_equal(p.bytes[1], 20);
    placement_free(&p);
    /* more ps than variables: the last ones hold nothing */
    p = place(&L, 6, PLACE_ROUND_ROBIN, UINT64_MAX);
    for (int i = 0; i < 4; i++)
        assert_int_equal(p.pieces[i].ps, i);
    assert_int_equal(p.bytes[4], 0);
    assert_int_equal(p.bytes[5], 0);
    placement_free(&p);
}

/* Equal sizes keep model order, and an equal load goes to the lowest index. */
static void test_bytes_policy_ties(void **state)
{
    (void)state;
    const spec s[] = {{"a", 2, 2}, {"b", 4, 0}, {"c", 1, 4}, {"d", 2, 2}, {"e", 4, 0}};
    model_layout L = layout_of(s, 5);
    placement p = place(&L, 3, PLACE_BYTES, UINT64_MAX);
    const int want_ps[] = {0, 1, 2, 0, 1};
    for (int i = 0; i < 5; i++)
        assert_int_equal(p.pieces[i].ps, want_ps[i]);
    placement_free(&p);
}

/* w0 (48 bytes) over partition_bytes 40 on 3 ps: rows 4 = 2 + 1 + 1, part i
 * on ps i, named w0/part_i, each a run of the buffer. The others then go by
 * bytes onto loads 24, 12, 12: w1 (24) -> 1, b0 (12) -> 2, b1 (8) -> 0. */
static void test_a_large_tensor_is_split_by_rows(void **state)
{
    (void)state;
    model_layout L = layout_of(SMALL, 4);
    placement p = place(&L, 3, PLACE_BYTES, 40);
    assert_int_equal(p.n, 6);
    const char *names[] = {"w0/part_0", "w0/part_1", "w0/part_2", "b0", "w1", "b1"};
    const int ps[] = {0, 1, 2, 2, 1, 0};
    const int64_t rows[] = {2, 1, 1, 3, 3, 2}, row0[] = {0, 2, 3, 0, 0, 0};
    const size_t off[] = {0, 6, 9, 12, 15, 21}, numel[] = {6, 3, 3, 3, 6, 2};
    for (int i = 0; i < 6; i++) {
        assert_string_equal(p.pieces[i].name, names[i]);
        assert_int_equal(p.pieces[i].ps, ps[i]);
        assert_int_equal(p.pieces[i].shape.dims[0], rows[i]);
        assert_int_equal(p.pieces[i].row0, row0[i]);
        assert_int_equal(p.pieces[i].offset, off[i]);
        assert_int_equal(p.pieces[i].numel, numel[i]);
    }
    for (int i = 0; i < 3; i++) {
        assert_int_equal(p.pieces[i].parts, 3);
        assert_int_equal(p.pieces[i].part, i);
        assert_int_equal(p.pieces[i].shape.ndim, 2);
        assert_int_equal(p.pieces[i].shape.dims[1], 3);
    }
    assert_int_equal(p.bytes[0], 24 + 8);
    assert_int_equal(p.bytes[1], 12 + 24);
    assert_int_equal(p.bytes[2], 12 + 12);
    placement_free(&p);
}

/* At most one part per row; a tensor of exactly partition_bytes stays whole;
 * one ps never partitions. */
static void test_partition_limits(void **state)
{
    (void)state;
    const spec s[] = {{"wide", 2, 8}, {"exact", 10, 0}};
    model_layout L = layout_of(s, 2);
    placement p = place(&L, 4, PLACE_BYTES, 40);
    assert_int_equal(p.n, 3); /* wide in 2 parts (2 rows), exact (40 bytes) whole */
    assert_string_equal(p.pieces[0].name, "wide/part_0");
    assert_string_equal(p.pieces[1].name, "wide/part_1");
    assert_int_equal(p.pieces[1].row0, 1);
    assert_int_equal(p.pieces[1].offset, 8);
    assert_string_equal(p.pieces[2].name, "exact");
    assert_int_equal(p.pieces[2].parts, 1);
    assert_int_equal(p.pieces[2].ps, 2); /* loads 32, 32, 0, 0 */
    placement_free(&p);
    p = place(&L, 1, PLACE_BYTES, 1);
    assert_int_equal(p.n, 2);
    assert_int_equal(p.pieces[0].parts, 1);
    assert_int_equal(p.bytes[0], 104);
    placement_free(&p);
}

/* Over many layouts, ps counts, policies and partition sizes: the pieces in
 * model order tile the buffer (each starts where the last ended), a
 * partitioned tensor's parts sit on ps 0..parts-1 with rows differing by at
 * most one, the per-ps bytes add up, and a second computation (another task)
 * gives the same map. */
static void test_pieces_tile_the_buffer_and_every_task_agrees(void **state)
{
    (void)state;
    unsigned seed = 12345;
    for (int trial = 0; trial < 300; trial++) {
        spec s[MODEL_MAX_TENSORS];
        char names[MODEL_MAX_TENSORS][16];
        int n = 1 + (int)(rand_r(&seed) % MODEL_MAX_TENSORS);
        for (int i = 0; i < n; i++) {
            snprintf(names[i], sizeof(names[i]), "t%d", i);
            s[i] = (spec){names[i], 1 + rand_r(&seed) % 40, rand_r(&seed) % 3 ? rand_r(&seed) % 9 : 0};
        }
        model_layout L = layout_of(s, n);
        int n_ps = 1 + (int)(rand_r(&seed) % 5);
        place_policy pol = rand_r(&seed) % 2 ? PLACE_BYTES : PLACE_ROUND_ROBIN;
        uint64_t pb = rand_r(&seed) % 4 ? 1 + (uint64_t)(rand_r(&seed) % 600) : UINT64_MAX;
        placement a = place(&L, n_ps, pol, pb), b = place(&L, n_ps, pol, pb);
        assert_int_equal(a.n, b.n);
        assert_memory_equal(a.pieces, b.pieces, sizeof(place_piece) * (size_t)a.n);
        assert_memory_equal(a.bytes, b.bytes, sizeof(uint64_t) * (size_t)n_ps);
        size_t at = 0;
        uint64_t sum[8] = {0};
        for (int k = 0; k < a.n; k++) {
            const place_piece *pc = &a.pieces[k];
            const model_tensor *t = &L.tensors[pc->tensor];
            assert_int_equal(pc->offset, at);
            at += pc->numel;
            assert_true(pc->ps >= 0 && pc->ps < n_ps);
            sum[pc->ps] += pc->numel * 4;
            int parts = t->shape.dims[0] < n_ps ? (int)t->shape.dims[0] : n_ps;
            if ((uint64_t)t->numel * 4 <= pb || parts <= 1) {
                assert_int_equal(pc->parts, 1);
                assert_string_equal(pc->name, t->name);
                continue;
            }
            assert_int_equal(pc->parts, parts);
            assert_int_equal(pc->ps, pc->part);
            int64_t q = t->shape.dims[0] / parts;
            assert_true(pc->shape.dims[0] == q || pc->shape.dims[0] == q + 1);
            assert_int_equal(pc->numel * (size_t)t->shape.dims[0], t->numel * (size_t)pc->shape.dims[0]);
        }
        assert_int_equal(at, L.n_params);
        for (int i = 0; i < n_ps; i++)
            assert_int_equal(sum[i], a.bytes[i]);
        placement_free(&a);
        placement_free(&b);
    }
}

/* GET /v1/placement's body for the split case, against the text by hand. */
static void test_json_shows_the_map(void **state)
{
    (void)state;
    model_layout L = layout_of(SMALL, 4);
    placement p = place(&L, 3, PLACE_BYTES, 40);
    json_t *j = placement_json(&p, &L);
    char *text = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(j);
    json_error_t je;
    json_t *got = json_loads(text, 0, &je), *want = json_loads(
        "{\"model\":\"test\",\"input_shape\":\"1,1,8\",\"policy\":\"bytes\",\"partition_bytes\":40,\"ps_tasks\":3,\"bytes_per_ps\":[32,36,24],"
        "\"variables\":["
        "{\"name\":\"w0\",\"shape\":[4,3],\"parts\":[{\"name\":\"w0/part_0\",\"ps\":0,\"rows\":[0,2]},"
        "{\"name\":\"w0/part_1\",\"ps\":1,\"rows\":[2,3]},{\"name\":\"w0/part_2\",\"ps\":2,\"rows\":[3,4]}]},"
        "{\"name\":\"b0\",\"shape\":[3],\"parts\":[{\"name\":\"b0\",\"ps\":2,\"rows\":[0,3]}]},"
        "{\"name\":\"w1\",\"shape\":[3,2],\"parts\":[{\"name\":\"w1\",\"ps\":1,\"rows\":[0,3]}]},"
        "{\"name\":\"b1\",\"shape\":[2],\"parts\":[{\"name\":\"b1\",\"ps\":0,\"rows\":[0,2]}]}]}",
        0, &je);
    assert_non_null(got);
    assert_non_null(want);
    if (!json_equal(got, want))
        fail_msg("placement_json: %s", text);
    free(text);
    json_decref(got);
    json_decref(want);
    placement_free(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policy_names),
        cmocka_unit_test(test_bytes_policy_by_hand),
        cmocka_unit_test(test_round_robin_by_hand),
        cmocka_unit_test(test_bytes_policy_ties),
        cmocka_unit_test(test_a_large_tensor_is_split_by_rows),
        cmocka_unit_test(test_partition_limits),
        cmocka_unit_test(test_pieces_tile_the_buffer_and_every_task_agrees),
        cmocka_unit_test(test_json_shows_the_map),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
