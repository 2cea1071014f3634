/* test_safetensors.c - common/safetensors.c against the format's definition:
 * 8-byte little-endian header length N, N bytes of JSON, then the data, with
 * data_offsets relative to the data section. The files here are written out
 * byte by byte; lengths were counted by hand. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

/* A valid file, as torch's safetensors would lay it out (metadata first, tensor
 * data not in header order). The JSON is 153 bytes, padded with 7 spaces to 160
 * = 0xa0; data: b = [0.5, -1.0] at [0,8), w = [[1,2],[3,4]] at [8,24). */
static const char HAND_FILE[] =
    "\xa0\x00\x00\x00\x00\x00\x00\x00"
    "{\"__metadata__\":{\"format\":\"pt\",\"step\":\"12\"},"
    "\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[8,24]},"
    "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}"
    "       "
    "\x00\x00\x00\x3f" "\x00\x00\x80\xbf"                                     /* 0.5, -1.0 */
    "\x00\x00\x80\x3f" "\x00\x00\x00\x40" "\x00\x00\x40\x40" "\x00\x00\x80\x40"; /* 1,2,3,4 */
#define HAND_LEN (sizeof(HAND_FILE) - 1)

static void test_hand_written_file(void **state)
{
    (void)state;
    assert_int_equal(HAND_LEN, 8 + 160 + 24); /* checks the literal itself */
    st_file f;
    char err[256] = "";
    int rc = st_parse(HAND_FILE, HAND_LEN, &f, err, sizeof(err));
    if (rc != 0)
        fail_msg("st_parse: %s", err);
    assert_int_equal(f.header_len, 160);
    assert_int_equal(f.data_start, 168);
    assert_int_equal(f.data_len, 24);
    assert_int_equal(f.n_tensors, 2);
    int w = st_find(&f, "w"), b = st_find(&f, "b");
    assert_true(w >= 0 && b >= 0 && w != b);
    assert_int_equal(st_find(&f, "nope"), -1);
    assert_int_equal(st_find(&f, "__metadata__"), -1);
    assert_string_equal(f.tensors[w].dtype, "F32");
    assert_int_equal(f.tensors[w].shape.ndim, 2);
    assert_int_equal(f.tensors[w].shape.dims[0], 2);
    assert_int_equal(f.tensors[w].shape.dims[1], 2);
    assert_int_equal(f.tensors[w].begin, 8);
    assert_int_equal(f.tensors[w].end, 24);
    assert_int_equal(f.tensors[b].shape.ndim, 1);
    assert_int_equal(f.tensors[b].shape.dims[0], 2);
    assert_int_equal(f.tensors[b].begin, 0);
    assert_int_equal(f.tensors[b].end, 8);
    /* header order is kept */
    assert_string_equal(f.tensors[0].name, "w");
    assert_string_equal(f.tensors[1].name, "b");
    assert_int_equal(f.n_meta, 2);
    assert_string_equal(st_meta_get(&f, "format"), "pt");
    assert_string_equal(st_meta_get(&f, "step"), "12");
    assert_null(st_meta_get(&f, "worker"));
    /* the floats land where the offsets say */
    const unsigned char *data = (const unsigned char *)HAND_FILE + f.data_start;
    float v[4];
    memcpy(v, data + f.tensors[w].begin, 16);
    assert_true(v[0] == 1.0f && v[1] == 2.0f && v[2] == 3.0f && v[3] == 4.0f);
    memcpy(v, data + f.tensors[b].begin, 8);
    assert_true(v[0] == 0.5f && v[1] == -1.0f);
    st_file_free(&f);

    /* st_read_prefix reads the same N */
    uint64_t hl = 0;
    assert_int_equal(st_read_prefix(HAND_FILE, HAND_LEN, &hl, err, sizeof(err)), 0);
    assert_int_equal(hl, 160);
}

static void test_empty_and_scalar(void **state)
{
    (void)state;
    st_file f;
    char err[256];
    /* "{}" padded to 8: no tensors, no data. */
    static const char empty[] = "\x08\x00\x00\x00\x00\x00\x00\x00{}      ";
    assert_int_equal(st_parse(empty, sizeof(empty) - 1, &f, err, sizeof(err)), 0);
    assert_int_equal(f.n_tensors, 0);
    assert_int_equal(f.n_meta, 0);
    assert_int_equal(f.data_len, 0);
    st_file_free(&f);
    /* a scalar (shape []) is one element; the 53-byte JSON is padded with 3
     * spaces to 56 = 0x38 */
    static const char scalar[] = "\x38\x00\x00\x00\x00\x00\x00\x00"
                                 "{\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,8]}}"
                                 "   "
                                 "\x00\x00\x00\x00\x00\x00\xf0\x3f"; /* 1.0 as F64 */
    assert_int_equal(sizeof(scalar) - 1, 8 + 56 + 8);
    if (st_parse(scalar, sizeof(scalar) - 1, &f, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_int_equal(f.n_tensors, 1);
    assert_int_equal(f.tensors[0].shape.ndim, 0);
    assert_string_equal(f.tensors[0].dtype, "F64");
    st_file_free(&f);
}

static void test_dtype_sizes(void **state)
{
    (void)state;
    assert_int_equal(st_dtype_size("F32"), 4);
    assert_int_equal(st_dtype_size("F64"), 8);
    assert_int_equal(st_dtype_size("F16"), 2);
    assert_int_equal(st_dtype_size("BF16"), 2);
    assert_int_equal(st_dtype_size("I64"), 8);
    assert_int_equal(st_dtype_size("I32"), 4);
    assert_int_equal(st_dtype_size("I8"), 1);
    assert_int_equal(st_dtype_size("U8"), 1);
    assert_int_equal(st_dtype_size("BOOL"), 1);
    assert_int_equal(st_dtype_size("f32"), 0);
    assert_int_equal(st_dtype_size("F33"), 0);
    assert_int_equal(st_dtype_size(""), 0);
}

/* Build prefix + header around `json` (padded to 8 with spaces), then `data_len`
 * zero bytes. Caller frees. */
static unsigned char *make_file(const char *json, size_t data_len, size_t *len)
{
    size_t jl = strlen(json), hl = (jl + 7) / 8 * 8;
    unsigned char *b = calloc(1, 8 + hl + data_len + 1);
    assert_non_null(b);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, json, jl);
    memset(b + 8 + jl, ' ', hl - jl);
    *len = 8 + hl + data_len;
    return b;
}

/* Helpers report the caller's line (cmocka's _fail) for the XML report. */
static void expect_ok_at(const char *json, size_t data_len, const char *file, int line)
{
    size_t len;
    unsigned char *b = make_file(json, data_len, &len);
    st_file f;
    char err[256] = "";
    int rc = st_parse(b, len, &f, err, sizeof(err));
    free(b);
    if (rc != 0) {
        print_error("rejected %s: %s\n", json, err);
        _fail(file, line);
    }
    st_file_free(&f);
}
#define expect_ok(json, data_len) expect_ok_at(json, data_len, __FILE__, __LINE__)

static void expect_reject_at(const char *json, size_t data_len, const char *file, int line)
{
    size_t len;
    unsigned char *b = make_file(json, data_len, &len);
    st_file f;
    char err[256] = "";
    int rc = st_parse(b, len, &f, err, sizeof(err));
    free(b);
    if (rc == 0) {
        st_file_free(&f);
        print_error("accepted %s with %zu data bytes\n", json, data_len);
        _fail(file, line);
    }
    if (err[0] == '\0') {
        print_error("rejected %s without a reason\n", json);
        _fail(file, line);
    }
}
#define expect_reject(json, data_len) expect_reject_at(json, data_len, __FILE__, __LINE__)

#define T(name, dt, shape, b, e)                                                                 \
    "\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

static void test_prefix_rejects(void **state)
{
    (void)state;
    char err[256];
    uint64_t hl;
    /* header length past the buffer: says 100, only 50 bytes follow */
    unsigned char b[64] = {100, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    assert_int_equal(st_read_prefix(b, 58, &hl, err, sizeof(err)), -1);
    st_file f;
    assert_int_equal(st_parse(b, 58, &f, err, sizeof(err)), -1);
    /* exactly fits: accepted by the prefix reader */
    assert_int_equal(st_read_prefix(b, 108, &hl, err, sizeof(err)), 0);
    assert_int_equal(hl, 100);
    /* a length with high bytes set (2^56 + 2): far past anything */
    unsigned char hi[8] = {2, 0, 0, 0, 0, 0, 0, 1};
    assert_int_equal(st_read_prefix(hi, UINT64_MAX, &hl, err, sizeof(err)), -1);
    /* > ST_MAX_HEADER (100 MiB = 0x06400000) even when the body claims to be larger */
    unsigned char big[8] = {0x01, 0x00, 0x40, 0x06, 0, 0, 0, 0}; /* 100 MiB + 1 */
    assert_int_equal(st_read_prefix(big, (uint64_t)1 << 40, &hl, err, sizeof(err)), -1);
    unsigned char max[8] = {0x00, 0x00, 0x40, 0x06, 0, 0, 0, 0}; /* exactly 100 MiB */
    assert_int_equal(st_read_prefix(max, (uint64_t)1 << 40, &hl, err, sizeof(err)), 0);
    assert_int_equal(hl, (uint64_t)100 << 20);
    /* shorter than the prefix */
    assert_int_equal(st_read_prefix(b, 7, &hl, err, sizeof(err)), -1);
    assert_int_equal(st_parse(b, 0, &f, err, sizeof(err)), -1);
}

/* Issue 37: a header that ends 1 to 8 bytes past the body (a bound that
 * forgot the prefix's 8 bytes) is refused by the prefix reader and by
 * st_parse, for every body length n from the smallest to past 256 (a
 * length byte carries): header lengths n - 7 .. n are refused, n - 8 (it
 * ends exactly at the body's end) is accepted by the prefix reader. */
static void test_prefix_header_past_the_body_by_up_to_8(void **state)
{
    (void)state;
    char err[256];
    uint64_t hl;
    static unsigned char b[8 + 300];
    for (uint64_t n = 10; n <= sizeof(b); n++) {
        for (uint64_t h = n - 8; h <= n + 8; h++) {
            memset(b, ' ', sizeof(b));
            for (int i = 0; i < 8; i++)
                b[i] = (unsigned char)(h >> (8 * i));
            b[8] = '{';
            b[8 + 1] = '}'; /* "{}" then spaces: a valid empty header */
            hl = 0;
            int rc = st_read_prefix(b, n, &hl, err, sizeof(err));
            if (h + 8 <= n) {
                if (rc != 0 || hl != h)
                    fail_msg("body %llu, header %llu (ends at the body's end): refused: %s",
                             (unsigned long long)n, (unsigned long long)h, err);
            } else {
                if (rc != -1)
                    fail_msg("body %llu, header %llu (ends %llu bytes past it): accepted",
                             (unsigned long long)n, (unsigned long long)h,
                             (unsigned long long)(h + 8 - n));
                if (!strstr(err, "runs past the body"))
                    fail_msg("body %llu, header %llu: '%s'", (unsigned long long)n,
                             (unsigned long long)h, err);
                st_file f;
                if (st_parse(b, n, &f, err, sizeof(err)) != -1)
                    fail_msg("st_parse: body %llu, header %llu: accepted", (unsigned long long)n,
                             (unsigned long long)h);
            }
        }
        /* the largest that fits parses whole: "{}" and n - 10 spaces, no data */
        uint64_t h = n - 8;
        for (int i = 0; i < 8; i++)
            b[i] = (unsigned char)(h >> (8 * i));
        st_file f;
        if (st_parse(b, n, &f, err, sizeof(err)) != 0)
            fail_msg("st_parse: body %llu, header %llu: %s", (unsigned long long)n,
                     (unsigned long long)h, err);
        assert_int_equal(f.data_len, 0);
        assert_int_equal(f.data_start, n);
        st_file_free(&f);
    }
}

static void test_header_rejects(void **state)
{
    (void)state;
    /* sanity: the well-formed base case is accepted */
    expect_ok("{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[1]", 8, 12) "}", 12);
    /* JSON that is not an object */
    expect_reject("[1,2]", 0);
    expect_reject("\"x\"", 0);
    expect_reject("42", 0);
    expect_reject("null", 0);
    expect_reject("{", 0);
    expect_reject("{\"a\":}", 0);
    expect_reject("{}x", 0);
    /* an entry that is not an object / lacks fields */
    expect_reject("{\"a\":1}", 0);
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4);
    /* unknown dtype */
    expect_reject("{" T("a", "F33", "[2]", 0, 8) "}", 8);
    expect_reject("{" T("a", "f32", "[2]", 0, 8) "}", 8);
    /* duplicate names */
    expect_reject("{" T("a", "F32", "[1]", 0, 4) "," T("a", "F32", "[1]", 4, 8) "}", 8);
    /* offsets out of range */
    expect_reject("{" T("a", "F32", "[2]", 0, 8) "}", 4);
    expect_reject("{" T("a", "F32", "[1]", 8, 4) "}", 8); /* begin > end */
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4);
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4);
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8);
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,\"4\"]}}", 4);
    /* overlapping: a [0,8), b [4,12) of 12 bytes (no hole, no excess) */
    expect_reject("{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 4, 12) "}", 12);
    /* a hole: a [0,8), b [12,20) of 20 bytes */
    expect_reject("{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 12, 20) "}", 20);
    /* a hole at the start, and uncovered bytes at the end */
    expect_reject("{" T("a", "F32", "[1]", 4, 8) "}", 8);
    expect_reject("{" T("a", "F32", "[1]", 0, 4) "}", 8);
    expect_reject("{}", 4);
    /* size not matching the shape */
    expect_reject("{" T("a", "F32", "[3]", 0, 8) "}", 8);
    expect_reject("{" T("a", "F64", "[2]", 0, 8) "}", 8);
    expect_reject("{" T("a", "F32", "[]", 0, 8) "}", 8);
    /* non-string metadata */
    expect_reject("{\"__metadata__\":{\"step\":7}," T("a", "F32", "[1]", 0, 4) "}", 4);
    expect_reject("{\"__metadata__\":{\"loss\":null}}", 0);
    expect_reject("{\"__metadata__\":\"x\"}", 0);
    /* negative / non-integer dims */
    expect_reject("{" T("a", "F32", "[-1]", 0, 4) "}", 4);
    expect_reject("{" T("a", "F32", "[2,-2]", 0, 16) "}", 16);
    expect_reject("{" T("a", "F32", "[1.5]", 0, 4) "}", 4);
    expect_reject("{" T("a", "F32", "[\"2\"]", 0, 8) "}", 8);
    /* more than 8 dims */
    expect_reject("{" T("a", "U8", "[1,1,1,1,1,1,1,1,1]", 0, 1) "}", 1);
    /* zero-sized tensors are fine in the format */
    expect_ok("{" T("z", "F32", "[0,3]", 0, 0) "," T("a", "F32", "[1]", 0, 4) "}", 4);
    /* an empty name, which st_header_build cannot write (found by
     * tests/fuzz/fuzz_safetensors: corpus file crash-empty-tensor-name) */
    expect_reject("{" T("", "F32", "[1]", 0, 4) "}", 4);
    expect_reject("{" T("a", "F32", "[1]", 0, 4) "," T("", "F32", "[0]", 4, 4) "}", 4);
}

/* st_header_build against what the format says, byte by byte. */
static void test_header_build_bytes(void **state)
{
    (void)state;
    tensor_shape sa = {.ndim = 2, .dims = {2, 3}}, sb = {.ndim = 1, .dims = {5}},
                 sc = {.ndim = 0};
    st_desc d[3] = {{"a", NULL, &sa}, {"b", "I8", &sb}, {"c", "F32", &sc}};
    const char *meta[] = {"step", "7"};
    char *out = NULL, err[256];
    size_t len = 0;
    assert_int_equal(st_header_build(d, 3, meta, 1, &out, &len, err, sizeof(err)), 0);
    /* a: 6 F32 = 24 bytes at [0,24); b: 5 I8 at [24,29); c: 1 F32 at [29,33).
     * The compact JSON is 193 bytes; padded to 200 = 0xc8 with 7 spaces. */
    static const char want_json[] =
        "{\"__metadata__\":{\"step\":\"7\"},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
        "\"b\":{\"dtype\":\"I8\",\"shape\":[5],\"data_offsets\":[24,29]},"
        "\"c\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[29,33]}}";
    assert_int_equal(sizeof(want_json) - 1, 193);
    assert_int_equal(len, 8 + 200);
    assert_int_equal(len % 8, 0); /* the data starts 8-byte aligned */
    static const unsigned char want_prefix[8] = {0xc8, 0, 0, 0, 0, 0, 0, 0};
    assert_memory_equal(out, want_prefix, 8);
    /* The JSON means exactly this (checked with an independent parse, whatever
     * the key order) ... */
    json_error_t je;
    json_t *got = json_loadb(out + 8, len - 8, 0, &je);
    json_t *want = json_loads(want_json, 0, &je);
    assert_non_null(got);
    assert_non_null(want);
    assert_true(json_equal(got, want));
    json_decref(got);
    json_decref(want);
    /* ... and is byte for byte the compact form in insertion order, then spaces. */
    assert_memory_equal(out + 8, want_json, 193);
    for (size_t i = 8 + 193; i < len; i++)
        assert_int_equal(out[i], ' ');

    /* parses back with the data appended */
    unsigned char *file = calloc(1, len + 33);
    assert_non_null(file);
    memcpy(file, out, len);
    st_file f;
    if (st_parse(file, len + 33, &f, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_int_equal(f.header_len, 200);
    assert_int_equal(f.data_start, 208);
    assert_int_equal(f.n_tensors, 3);
    int ia = st_find(&f, "a"), ib = st_find(&f, "b"), ic = st_find(&f, "c");
    assert_true(ia >= 0 && ib >= 0 && ic >= 0);
    assert_int_equal(f.tensors[ia].begin, 0);
    assert_int_equal(f.tensors[ia].end, 24);
    assert_string_equal(f.tensors[ib].dtype, "I8");
    assert_int_equal(f.tensors[ib].begin, 24);
    assert_int_equal(f.tensors[ib].end, 29);
    assert_int_equal(f.tensors[ic].shape.ndim, 0);
    assert_int_equal(f.tensors[ic].begin, 29);
    assert_int_equal(f.tensors[ic].end, 33);
    assert_string_equal(st_meta_get(&f, "step"), "7");
    st_file_free(&f);
    /* one byte of data short: rejected */
    assert_int_equal(st_parse(file, len + 32, &f, err, sizeof(err)), -1);
    free(file);
    free(out);
}

static void test_header_build_no_padding(void **state)
{
    (void)state;
    /* {"xyz":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} is 56 bytes: a
     * multiple of 8, so no padding at all. */
    tensor_shape s = {.ndim = 1, .dims = {1}};
    st_desc d = {"xyz", NULL, &s};
    char *out = NULL, err[256];
    size_t len = 0;
    assert_int_equal(st_header_build(&d, 1, NULL, 0, &out, &len, err, sizeof(err)), 0);
    static const char want[] = "\x38\x00\x00\x00\x00\x00\x00\x00"
                               "{\"xyz\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    assert_int_equal(sizeof(want) - 1, 64);
    assert_int_equal(len, 64);
    assert_memory_equal(out, want, 64);
    free(out);

    /* an unknown dtype is refused */
    st_desc bad = {"x", "F33", &s};
    out = NULL;
    assert_int_equal(st_header_build(&bad, 1, NULL, 0, &out, &len, err, sizeof(err)), -1);
    assert_null(out);
    assert_true(err[0] != '\0');
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_written_file),
        cmocka_unit_test(test_empty_and_scalar),
        cmocka_unit_test(test_dtype_sizes),
        cmocka_unit_test(test_prefix_rejects),
        cmocka_unit_test(test_prefix_header_past_the_body_by_up_to_8),
        cmocka_unit_test(test_header_rejects),
        cmocka_unit_test(test_header_build_bytes),
        cmocka_unit_test(test_header_build_no_padding),
    };
    return cmocka_run_group_tests_name("safetensors", tests, NULL, NULL);
}
