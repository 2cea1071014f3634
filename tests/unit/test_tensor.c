/* test_tensor.c - common/tensor.c: names, shapes, finite checks.
 * Expected values are written out by hand from the rules in tensor.h. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor.h"

static int name_ok(const char *name)
{
    char err[256] = "";
    int rc = tensor_name_check(name, err, sizeof(err));
    if (rc != 0)
        assert_true(err[0] != '\0'); /* a rejection always says why */
    return rc == 0;
}

static void test_name_valid(void **state)
{
    (void)state;
    assert_true(name_ok("w"));
    assert_true(name_ok("layer1/weights"));
    assert_true(name_ok("a.b-c_d/E.9/x"));
    assert_true(name_ok("hidden/biases"));
    assert_true(name_ok("gradient"));      /* only the whole segment is reserved */
    assert_true(name_ok("a/stats/b"));     /* reserved only as the last segment */
    assert_true(name_ok("mystats"));
    assert_true(name_ok("grad_norm"));
    assert_true(name_ok("a.b"));           /* a single dot is fine */

    char n128[129];
    memset(n128, 'x', 128);
    n128[128] = '\0';
    assert_true(name_ok(n128));
}

static void test_name_invalid(void **state)
{
    (void)state;
    char n129[130];
    memset(n129, 'x', 129);
    n129[129] = '\0';
    assert_false(name_ok(n129));
    assert_false(name_ok(""));
    assert_false(name_ok(NULL));
    /* ".." anywhere */
    assert_false(name_ok(".."));
    assert_false(name_ok("a/../b"));
    assert_false(name_ok("a..b"));
    /* empty segments */
    assert_false(name_ok("a//b"));
    assert_false(name_ok("/a"));
    assert_false(name_ok("a/"));
    assert_false(name_ok("/"));
    /* reserved last segment */
    assert_false(name_ok("stats"));
    assert_false(name_ok("grad"));
    assert_false(name_ok("layer/stats"));
    assert_false(name_ok("layer/grad"));
    /* characters outside [A-Za-z0-9_./-] */
    assert_false(name_ok("a b"));
    assert_false(name_ok("a?b"));
    assert_false(name_ok("a%2Fb"));
    assert_false(name_ok("a:b"));
    assert_false(name_ok("a\\b"));
    assert_false(name_ok("caf\xc3\xa9"));
    assert_false(name_ok("a\nb"));
    assert_false(name_ok("a+b"));
}

/* Helpers report the caller's line (cmocka's _fail), so a failure in the XML
 * report points at the case that failed. */
static void expect_shape_at(const char *file, int line, const char *s, int ndim,
                            const int64_t *dims, int64_t numel)
{
    tensor_shape sh;
    char err[256] = "";
    if (tensor_shape_parse(s, &sh, err, sizeof(err)) != 0) {
        print_error("shape '%s' rejected: %s\n", s, err);
        _fail(file, line);
    }
    int ok = sh.ndim == ndim && tensor_shape_numel(&sh) == numel;
    for (int i = 0; ok && i < ndim; i++)
        ok = sh.dims[i] == dims[i];
    if (!ok) {
        print_error("shape '%s' parsed to ndim %d numel %lld\n", s, sh.ndim,
                    (long long)tensor_shape_numel(&sh));
        _fail(file, line);
    }
}
#define expect_shape(...) expect_shape_at(__FILE__, __LINE__, __VA_ARGS__)

static void expect_bad_shape_at(const char *s, const char *file, int line)
{
    tensor_shape sh;
    char err[256] = "";
    if (tensor_shape_parse(s, &sh, err, sizeof(err)) == 0 || err[0] == '\0') {
        print_error("shape '%s' was accepted (ndim %d) or no reason given\n", s ? s : "(null)",
                    sh.ndim);
        _fail(file, line);
    }
}
#define expect_bad_shape(s) expect_bad_shape_at(s, __FILE__, __LINE__)

static void test_shape_parse_ok(void **state)
{
    (void)state;
    expect_shape("784,100", 2, (int64_t[]){784, 100}, 78400);
    expect_shape("10", 1, (int64_t[]){10}, 10);
    expect_shape("1,1,1,1,1,1,1,1", 8, (int64_t[]){1, 1, 1, 1, 1, 1, 1, 1}, 1);
    expect_shape("2,3,4", 3, (int64_t[]){2, 3, 4}, 24);
    /* Spaces around dimensions are tolerated. */
    expect_shape(" 784 , 100 ", 2, (int64_t[]){784, 100}, 78400);
    expect_shape("010", 1, (int64_t[]){10}, 10);
    /* Exactly TENSOR_MAX_ELEMS = 2^40 = 1099511627776 elements is allowed. */
    expect_shape("1099511627776", 1, (int64_t[]){1099511627776LL}, 1099511627776LL);
    expect_shape("1048576,1048576", 2, (int64_t[]){1048576, 1048576}, 1099511627776LL);
}

static void test_shape_parse_scalar(void **state)
{
    (void)state;
    expect_shape("", 0, NULL, 1);
    expect_shape("   ", 0, NULL, 1);
}

static void test_shape_parse_bad(void **state)
{
    (void)state;
    expect_bad_shape(NULL);
    expect_bad_shape("0");
    expect_bad_shape("784,0");
    expect_bad_shape("-1");
    expect_bad_shape("3,-4");
    expect_bad_shape("abc");
    expect_bad_shape("3,x");
    expect_bad_shape("3x");
    expect_bad_shape("0x10");
    expect_bad_shape("+3");
    expect_bad_shape("1.5");
    expect_bad_shape("3,");
    expect_bad_shape(",3");
    expect_bad_shape("3,,4");
    expect_bad_shape("7 84");      /* a space inside a number */
    expect_bad_shape("3;4");
    expect_bad_shape("3\t,4");
    /* 9 dimensions */
    expect_bad_shape("1,1,1,1,1,1,1,1,1");
    expect_bad_shape("2,2,2,2,2,2,2,2,2");
    /* one dimension past int64 (2^63 = 9223372036854775808) */
    expect_bad_shape("9223372036854775808");
    expect_bad_shape("99999999999999999999999");
    /* a product that would overflow int64: 2^32 * 2^32 = 2^64 */
    expect_bad_shape("4294967296,4294967296");
    /* 2^31 * 2^31 * 2^31 would overflow; each partial product already > 2^40 */
    expect_bad_shape("2147483648,2147483648,2147483648");
    /* just over TENSOR_MAX_ELEMS = 2^40 */
    expect_bad_shape("1099511627777");
    expect_bad_shape("1048576,1048577");
    expect_bad_shape("1048576,1048576,2");
    expect_bad_shape("1024,1024,1024,1025"); /* 2^30 * 1025 > 2^40 */
    expect_shape("1024,1024,1024,1024", 4, (int64_t[]){1024, 1024, 1024, 1024},
                 1099511627776LL);
}

static void test_shape_format(void **state)
{
    (void)state;
    char buf[128];
    tensor_shape sh = {.ndim = 2, .dims = {784, 100}};
    assert_int_equal(tensor_shape_format(&sh, buf, sizeof(buf)), 7);
    assert_string_equal(buf, "784,100");

    tensor_shape scalar = {.ndim = 0};
    assert_int_equal(tensor_shape_format(&scalar, buf, sizeof(buf)), 0);
    assert_string_equal(buf, "");

    tensor_shape big = {.ndim = 2, .dims = {1099511627776LL, 1}};
    assert_int_equal(tensor_shape_format(&big, buf, sizeof(buf)), 15);
    assert_string_equal(buf, "1099511627776,1");

    /* Truncation: always NUL-terminated, never past the buffer. */
    char small[5];
    memset(small, 'Z', sizeof(small));
    int n = tensor_shape_format(&sh, small, sizeof(small));
    assert_true(n >= 0 && n <= 4);
    assert_int_equal(small[n], '\0');
    assert_int_equal((int)strlen(small), n);
    assert_memory_equal(small, "784,100", (size_t)n);
}

static void test_shape_round_trip(void **state)
{
    (void)state;
    const char *cases[] = {"784,100", "1", "2,3,4,5,6,7,8,9", "1099511627776", "",
                           "65536,16777216", "10,1"};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        tensor_shape a, b;
        char err[256], buf[256];
        assert_int_equal(tensor_shape_parse(cases[i], &a, err, sizeof(err)), 0);
        int n = tensor_shape_format(&a, buf, sizeof(buf));
        assert_int_equal(n, (int)strlen(cases[i]));
        assert_string_equal(buf, cases[i]);
        assert_int_equal(tensor_shape_parse(buf, &b, err, sizeof(err)), 0);
        assert_true(tensor_shape_equal(&a, &b));
    }
    /* Spaces are normalised away by a round trip. */
    tensor_shape c;
    char err[256], buf[64];
    assert_int_equal(tensor_shape_parse(" 3 , 4", &c, err, sizeof(err)), 0);
    tensor_shape_format(&c, buf, sizeof(buf));
    assert_string_equal(buf, "3,4");
}

static void test_shape_equal_numel(void **state)
{
    (void)state;
    tensor_shape a = {.ndim = 2, .dims = {3, 4}}, b = {.ndim = 2, .dims = {3, 4}},
                 c = {.ndim = 2, .dims = {4, 3}}, d = {.ndim = 1, .dims = {12}},
                 s = {.ndim = 0};
    assert_true(tensor_shape_equal(&a, &b));
    assert_false(tensor_shape_equal(&a, &c));
    assert_false(tensor_shape_equal(&a, &d));
    assert_false(tensor_shape_equal(&d, &s));
    assert_int_equal(tensor_shape_numel(&a), 12);
    assert_int_equal(tensor_shape_numel(&d), 12);
    assert_int_equal(tensor_shape_numel(&s), 1);
}

/* Finite values: ordinary, zero, -0, the extremes and denormals. */
static float finite_value(size_t i)
{
    static const float v[] = {1.0f, -2.5f, 0.0f, -0.0f, FLT_MAX, -FLT_MAX, FLT_MIN,
                              1e-45f /* smallest denormal */, -1e-40f, 3.0e38f, 0.1f};
    return v[i % (sizeof(v) / sizeof(v[0]))];
}

static void test_find_nonfinite_all_finite(void **state)
{
    (void)state;
    const size_t lens[] = {0, 1, 7, 8, 9, 1000};
    float *x = malloc(1000 * sizeof(float));
    assert_non_null(x);
    for (size_t i = 0; i < 1000; i++)
        x[i] = finite_value(i);
    for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++)
        assert_int_equal(tensor_find_nonfinite(x, lens[k]), -1);
    /* denormals only, FLT_MAX only */
    float den[9], big[9];
    for (int i = 0; i < 9; i++) {
        den[i] = (i & 1) ? -1.4e-45f : 1.0e-39f;
        big[i] = (i & 1) ? -FLT_MAX : FLT_MAX;
    }
    assert_true(fpclassify(den[0]) == FP_SUBNORMAL);
    assert_int_equal(tensor_find_nonfinite(den, 9), -1);
    assert_int_equal(tensor_find_nonfinite(big, 9), -1);
    free(x);
}

static void test_find_nonfinite_positions(void **state)
{
    (void)state;
    const size_t lens[] = {1, 7, 8, 9, 1000};
    const float bad[] = {NAN, -NAN, INFINITY, -INFINITY};
    float *x = malloc(1000 * sizeof(float));
    assert_non_null(x);
    for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
        size_t n = lens[k];
        size_t pos[3] = {0, n / 2, n - 1};
        for (int p = 0; p < 3; p++) {
            for (size_t b = 0; b < sizeof(bad) / sizeof(bad[0]); b++) {
                for (size_t i = 0; i < n; i++)
                    x[i] = finite_value(i);
                x[pos[p]] = bad[b];
                int64_t got = tensor_find_nonfinite(x, n);
                if (got != (int64_t)pos[p])
                    fail_msg("n=%zu bad#%zu at %zu: got %lld", n, b, pos[p], (long long)got);
            }
        }
    }
    /* Two bad values: the first one is reported. */
    for (size_t i = 0; i < 1000; i++)
        x[i] = finite_value(i);
    x[700] = NAN;
    x[300] = -INFINITY;
    assert_int_equal(tensor_find_nonfinite(x, 1000), 300);
    /* A bad value just past n is not looked at. */
    for (size_t i = 0; i < 9; i++)
        x[i] = 1.0f;
    x[8] = INFINITY;
    assert_int_equal(tensor_find_nonfinite(x, 8), -1);
    assert_int_equal(tensor_find_nonfinite(x, 9), 8);
    /* Every NaN payload / Inf bit pattern, built from bits. */
    const uint32_t pats[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffffffffu,
                             0x7fbfffffu};
    for (size_t i = 0; i < sizeof(pats) / sizeof(pats[0]); i++) {
        for (size_t j = 0; j < 9; j++)
            x[j] = 2.0f;
        memcpy(&x[5], &pats[i], 4);
        assert_int_equal(tensor_find_nonfinite(x, 9), 5);
    }
    /* Largest finite bit pattern (FLT_MAX) and the largest denormal are finite. */
    const uint32_t fin[] = {0x7f7fffffu, 0xff7fffffu, 0x007fffffu, 0x80000001u};
    for (size_t i = 0; i < sizeof(fin) / sizeof(fin[0]); i++) {
        for (size_t j = 0; j < 9; j++)
            memcpy(&x[j], &fin[i], 4);
        assert_int_equal(tensor_find_nonfinite(x, 9), -1);
    }
    free(x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_name_valid),
        cmocka_unit_test(test_name_invalid),
        cmocka_unit_test(test_shape_parse_ok),
        cmocka_unit_test(test_shape_parse_scalar),
        cmocka_unit_test(test_shape_parse_bad),
        cmocka_unit_test(test_shape_format),
        cmocka_unit_test(test_shape_round_trip),
        cmocka_unit_test(test_shape_equal_numel),
        cmocka_unit_test(test_find_nonfinite_all_finite),
        cmocka_unit_test(test_find_nonfinite_positions),
    };
    return cmocka_run_group_tests_name("tensor", tests, NULL, NULL);
}
