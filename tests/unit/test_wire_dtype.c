/* test_wire_dtype.c - common/wire_dtype.c: the 16-bit casts and the widening
 * of a body. Expected values are written out by hand from IEEE 754's
 * round-to-nearest-even (tests/system/test_wire.py holds the casts against
 * numpy); the F16C path (where the CPU has it) against the portable casts. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "wire_dtype.h"

static float f_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_every_16bit_value_comes_back(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float b = wire_bf16_to_f32((uint16_t)h), f = wire_f16_to_f32((uint16_t)h);
        if (isnan(b))
            assert_true(isnan(wire_bf16_to_f32(wire_f32_to_bf16(b))));
        else
            assert_int_equal(wire_f32_to_bf16(b), h);
        if (isnan(f))
            assert_true(isnan(wire_f16_to_f32(wire_f32_to_f16(f))));
        else
            assert_int_equal(wire_f32_to_f16(f), h);
    }
}

static void test_ties_go_to_even(void **state)
{
    (void)state;
    /* bfloat16: 7 fraction bits, so 1 + 2^-8 is halfway between 1 and 1 + 2^-7 */
    assert_int_equal(wire_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);              /* to 1 (even) */
    assert_int_equal(wire_f32_to_bf16(1.0f + 0x1p-7f + 0x1p-8f), 0x3f82);    /* to 1 + 2^-6 (even) */
    assert_int_equal(wire_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);   /* past halfway: up */
    assert_int_equal(wire_f32_to_bf16(-1.0f - 0x1p-8f), 0xbf80);
    assert_int_equal(wire_f32_to_bf16(f_of(0x7f7fffff)), 0x7f80);            /* FLT_MAX rounds to Inf */
    assert_int_equal(wire_f32_to_bf16(f_of(0x00000001)), 0x0000);            /* the smallest subnormal: to 0 */
    assert_int_equal(wire_f32_to_bf16(f_of(0x00008000)), 0x0000);            /* a subnormal tie: to even 0 */
    assert_int_equal(wire_f32_to_bf16(f_of(0x00018000)), 0x0002);            /* ... and to even 2 */
    assert_int_equal(wire_f32_to_bf16(f_of(0x7fa00000)) & 0x7fc0, 0x7fc0);   /* a signalling NaN: quiet NaN */
    /* float16: 10 fraction bits; 65504 its largest, 65520 halfway to 2^16 */
    assert_int_equal(wire_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(wire_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(wire_f32_to_f16(65520.0f), 0x7c00);                     /* to even: Inf */
    assert_int_equal(wire_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
    assert_int_equal(wire_f32_to_f16(1.0f + 0x1p-10f + 0x1p-11f), 0x3c02);
    assert_int_equal(wire_f32_to_f16(0x1p-24f), 0x0001);                     /* the smallest subnormal */
    assert_int_equal(wire_f32_to_f16(0x1p-25f), 0x0000);                     /* half of it: to even 0 */
    assert_int_equal(wire_f32_to_f16(0x1.8p-24f), 0x0002);                   /* 1.5 of it: to even 2 */
    assert_int_equal(wire_f32_to_f16(-0.0f), 0x8000);
}

/* wire_encode and wire_decode (F16C and AVX2 where the CPU has them) give
 * the portable casts' bits, over float32 values of every exponent and every
 * float16 pattern. */
static void test_the_fast_casts_are_the_portable_ones(void **state)
{
    (void)state;
    enum { N = 1 << 16 };
    float *x = malloc(N * sizeof(float)), *back = malloc(N * sizeof(float));
    uint16_t *h = malloc(N * 2);
    assert_non_null(x);
    assert_non_null(back);
    assert_non_null(h);
    for (uint64_t base = 0; base < (1ull << 32); base += (uint64_t)N * 61) {
        int n = 0, nb = 0;
        for (uint64_t k = 0; k < N; k++) { /* (a value past a type's range stops the cast: tested below) */
            float v = f_of((uint32_t)(base + k * 61));
            if (fabsf(v) <= 65504.0f)
                x[n++] = v;
        }
        assert_int_equal(wire_encode(WIRE_F16, x, (size_t)n, 1.0f, h), -1);
        for (int i = 0; i < n; i++)
            if (h[i] != wire_f32_to_f16(x[i]))
                fail_msg("%a: %04x, the portable cast %04x", (double)x[i], h[i], wire_f32_to_f16(x[i]));
        for (uint64_t k = 0; k < N; k++) {
            float v = f_of((uint32_t)(base + k * 61));
            if (fabsf(v) < 0x1p127f)
                x[nb++] = v;
        }
        assert_int_equal(wire_encode(WIRE_BF16, x, (size_t)nb, 1.0f, h), -1);
        for (int i = 0; i < nb; i++)
            if (h[i] != wire_f32_to_bf16(x[i]))
                fail_msg("%a: %04x, the portable bf16 cast %04x", (double)x[i], h[i], wire_f32_to_bf16(x[i]));
    }
    for (uint32_t k = 0; k < N; k++)
        h[k] = (uint16_t)k;
    wire_decode(WIRE_F16, h, N, 1.0f, back);
    for (uint32_t k = 0; k < N; k++) {
        float want = wire_f16_to_f32(h[k]);
        if (!isnan(want) && memcmp(&back[k], &want, 4) != 0)
            fail_msg("%04x: %a, the portable cast %a", h[k], (double)back[k], (double)want);
    }
    free(x);
    free(back);
    free(h);
}

static void test_encode_names_the_first_overflow(void **state)
{
    (void)state;
    float x[20];
    uint16_t h[20];
    for (int i = 0; i < 20; i++)
        x[i] = 1000.0f;
    assert_int_equal(wire_encode(WIRE_F16, x, 20, 64.0f, h), -1); /* 64000 fits */
    assert_int_equal(h[0], wire_f32_to_f16(64000.0f));
    x[13] = 2000.0f;
    assert_int_equal(wire_encode(WIRE_F16, x, 20, 64.0f, h), 13); /* 128000 does not */
    assert_int_equal(wire_encode(WIRE_BF16, x, 20, 64.0f, h), -1);
    x[7] = NAN;
    assert_int_equal(wire_encode(WIRE_BF16, x, 20, 1.0f, h), 7);
}

/* A body of an F32, a BF16 and an I64 tensor, widened: offsets 8-aligned,
 * the BF16 one divided by the scale; a NaN leaves the description as it was. */
static void test_widen_a_body(void **state)
{
    (void)state;
    static const char hdr[] = "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
                              "\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[12,18]},"
                              "\"c:ids\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[18,26]}}";
    unsigned char data[26];
    float a[3] = {1.5f, -2.0f, 3.0f};
    uint16_t b[3] = {wire_f32_to_bf16(8.0f), wire_f32_to_bf16(-0.5f), wire_f32_to_bf16(3.0f)};
    int64_t id = 42;
    memcpy(data, a, 12);
    memcpy(data + 12, b, 6);
    memcpy(data + 18, &id, 8);
    st_file f;
    char err[256];
    assert_int_equal(st_parse_header(hdr, strlen(hdr), sizeof(data), &f, err, sizeof(err)), 0);
    size_t len = wire_widened_len(&f);
    assert_int_equal(len, 16 + 16 + 8);
    unsigned char *out = aligned_alloc(64, 64);
    assert_int_equal(wire_widen(&f, data, 0.25f, out, err, sizeof(err)), 0);
    int kb = st_find(&f, "b"), kc = st_find(&f, "c:ids");
    assert_string_equal(f.tensors[kb].dtype, "F32");
    assert_int_equal(f.tensors[kb].begin % 8, 0);
    assert_int_equal(f.tensors[kb].end - f.tensors[kb].begin, 12);
    const float *wb = (const float *)(out + f.tensors[kb].begin);
    assert_true(wb[0] == 2.0f && wb[1] == -0.125f && wb[2] == 0.75f);
    assert_memory_equal(out + f.tensors[st_find(&f, "a")].begin, a, 12);
    assert_memory_equal(out + f.tensors[kc].begin, &id, 8);
    assert_string_equal(f.tensors[kc].dtype, "I64");
    assert_int_equal(f.data_len, len);
    assert_int_equal(wire_widened_len(&f), 0); /* nothing 16-bit left */
    st_file_free(&f);

    b[2] = 0x7fc1; /* a NaN */
    memcpy(data + 12, b, 6);
    assert_int_equal(st_parse_header(hdr, strlen(hdr), sizeof(data), &f, err, sizeof(err)), 0);
    assert_int_equal(wire_widen(&f, data, 1.0f, out, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "gradient 'b' has NaN at element 2"));
    kb = st_find(&f, "b");
    assert_string_equal(f.tensors[kb].dtype, "BF16");
    assert_int_equal(f.tensors[kb].begin, 12);
    assert_int_equal(f.data_len, sizeof(data));
    st_file_free(&f);
    free(out);
}

static void test_names(void **state)
{
    (void)state;
    wire_dtype d;
    assert_int_equal(wire_dtype_parse("bf16", &d), 0);
    assert_int_equal(d, WIRE_BF16);
    assert_int_equal(wire_dtype_parse("F16", &d), 0);
    assert_int_equal(d, WIRE_F16);
    assert_int_equal(wire_dtype_parse("fp8", &d), -1);
    assert_int_equal(wire_dtype_parse(NULL, &d), -1);
    assert_int_equal(wire_dtype_of_st("I64"), -1);
    assert_string_equal(wire_dtype_st(WIRE_BF16), "BF16");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_16bit_value_comes_back),
        cmocka_unit_test(test_ties_go_to_even),
        cmocka_unit_test(test_the_fast_casts_are_the_portable_ones),
        cmocka_unit_test(test_encode_names_the_first_overflow),
        cmocka_unit_test(test_widen_a_body),
        cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
