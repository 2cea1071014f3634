/* wire_dtype.c - float32 <-> bfloat16 / float16 casts and the widening of a
 * body's 16-bit tensors (wire_dtype.h). The float16 casts are the branch-free
 * ones of Maratyszcza's FP16 library (they rely on the FPU's
 * round-to-nearest-even, C's default); on x86-64, F16C (float16) and AVX2
 * (bfloat16) do the arrays where the CPU has them, with the same bits. */
#include "wire_dtype.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int wire_dtype_parse(const char *s, wire_dtype *out)
{
    static const struct {
        const char *name;
        wire_dtype d;
    } names[] = {{"fp32", WIRE_F32},     {"float32", WIRE_F32}, {"F32", WIRE_F32},
                 {"bf16", WIRE_BF16},    {"bfloat16", WIRE_BF16}, {"BF16", WIRE_BF16},
                 {"fp16", WIRE_F16},     {"float16", WIRE_F16}, {"F16", WIRE_F16}};
    for (size_t i = 0; s && i < sizeof(names) / sizeof(names[0]); i++)
        if (strcmp(s, names[i].name) == 0) {
            *out = names[i].d;
            return 0;
        }
    return -1;
}

const char *wire_dtype_name(wire_dtype d)
{
    return d == WIRE_BF16 ? "bf16" : d == WIRE_F16 ? "fp16" : "fp32";
}

const char *wire_dtype_st(wire_dtype d)
{
    return d == WIRE_BF16 ? "BF16" : d == WIRE_F16 ? "F16" : "F32";
}

int wire_dtype_of_st(const char *st_dtype)
{
    if (strcmp(st_dtype, "F32") == 0)
        return WIRE_F32;
    if (strcmp(st_dtype, "BF16") == 0)
        return WIRE_BF16;
    if (strcmp(st_dtype, "F16") == 0)
        return WIRE_F16;
    return -1;
}

size_t wire_dtype_size(wire_dtype d)
{
    return d == WIRE_F32 ? 4 : 2;
}

uint16_t wire_f32_to_bf16(float f)
{
    uint32_t x = bits_of(f);
    uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16; /* to nearest, ties to even */
    uint32_t nan = (x >> 16) | 0x40u;                          /* quiet, never rounded into Inf */
    return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

float wire_bf16_to_f32(uint16_t h)
{
    return float_of((uint32_t)h << 16);
}

uint16_t wire_f32_to_f16(float f)
{
    const float to_inf = 0x1.0p+112f, to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * to_inf) * to_zero;
    const uint32_t w = bits_of(f), shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xff000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = bits_of(base);
    const uint32_t nonsign = ((b >> 13) & 0x7c00u) + (b & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

float wire_f16_to_f32(uint16_t h)
{
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = float_of((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
    const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
    return float_of(sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized)));
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
/* float16 by the F16C instructions (round-to-nearest-even, as the portable
 * casts above: the same bits), where the CPU has them. */
static int have_f16c(void)
{
    /* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports
     * knows no "f16c" (the fuzzers' build) */
    unsigned a, b, c, d;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}

__attribute__((target("avx,f16c"))) static void f16_encode_f16c(const float *src, size_t n, float scale, uint16_t *o)
{
    size_t i = 0;
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(o + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), s), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        o[i] = wire_f32_to_f16(src[i] * scale);
}

static int have_avx2(void)
{
    return __builtin_cpu_supports("avx2");
}

/* wire_f32_to_bf16 on 16 floats at a time (the same bits). */
__attribute__((target("avx2"))) static void bf16_encode_avx2(const float *src, size_t n, float scale, uint16_t *o)
{
    size_t i = 0;
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    for (; i + 16 <= n; i += 16) {
        __m256i r[2];
        for (int k = 0; k < 2; k++) {
            __m256i x = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8 * k), s));
            __m256i hi = _mm256_srli_epi32(x, 16);
            __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(bias, _mm256_and_si256(hi, one))), 16);
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, absm), inf);
            r[k] = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, quiet), nan);
        }
        /* 32 -> 16 bits (each at most 0xffff): packus works per 128-bit lane, then the lanes in order */
        _mm256_storeu_si256((__m256i *)(o + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8));
    }
    for (; i < n; i++)
        o[i] = wire_f32_to_bf16(src[i] * scale);
}

__attribute__((target("avx,f16c"))) static void f16_decode_f16c(const uint16_t *src, size_t n, float scale, float *o)
{
    size_t i = 0;
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))), s));
    for (; i < n; i++)
        o[i] = wire_f16_to_f32(src[i]) * scale;
}
#else
static int have_f16c(void)
{
    return 0;
}
static int have_avx2(void)
{
    return 0;
}
static void bf16_encode_avx2(const float *src, size_t n, float scale, uint16_t *o)
{
    (void)src, (void)n, (void)scale, (void)o;
}
static void f16_encode_f16c(const float *src, size_t n, float scale, uint16_t *o)
{
    (void)src, (void)n, (void)scale, (void)o;
}
static void f16_decode_f16c(const uint16_t *src, size_t n, float scale, float *o)
{
    (void)src, (void)n, (void)scale, (void)o;
}
#endif

/* 1 when a 16-bit value is Inf or NaN (all exponent bits set). */
static int bad16(wire_dtype d, uint16_t h)
{
    return d == WIRE_BF16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
}

int64_t wire_encode(wire_dtype d, const float *src, size_t n, float scale, void *dst)
{
    if (d == WIRE_F32) {
        float *o = dst;
        for (size_t i = 0; i < n; i++)
            o[i] = src[i] * scale;
        return tensor_find_nonfinite(o, n);
    }
    uint16_t *o = dst;
    const size_t CH = 4096; /* cast a chunk, then look at it while it is in cache */
    const uint16_t expo = d == WIRE_BF16 ? 0x7f80u : 0x7c00u;
    const int fast = d == WIRE_F16 ? have_f16c() : have_avx2();
    for (size_t at = 0; at < n; at += CH) {
        size_t m = n - at < CH ? n - at : CH;
        if (d == WIRE_BF16 && fast)
            bf16_encode_avx2(src + at, m, scale, o + at);
        else if (d == WIRE_BF16)
            for (size_t i = 0; i < m; i++)
                o[at + i] = wire_f32_to_bf16(src[at + i] * scale);
        else if (fast)
            f16_encode_f16c(src + at, m, scale, o + at);
        else
            for (size_t i = 0; i < m; i++)
                o[at + i] = wire_f32_to_f16(src[at + i] * scale);
        unsigned any = 0;
        for (size_t i = 0; i < m; i++)
            any |= (unsigned)((o[at + i] & expo) == expo);
        if (any)
            for (size_t i = 0; i < m; i++)
                if (bad16(d, o[at + i]))
                    return (int64_t)(at + i);
    }
    return -1;
}

int64_t wire_decode(wire_dtype d, const void *src, size_t n, float scale, float *dst)
{
    if (d == WIRE_F32) {
        const float *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = s[i] * scale;
        return tensor_find_nonfinite(dst, n);
    }
    const uint16_t *s = src;
    if (d == WIRE_BF16)
        for (size_t i = 0; i < n; i++)
            dst[i] = wire_bf16_to_f32(s[i]) * scale;
    else if (have_f16c())
        f16_decode_f16c(s, n, scale, dst);
    else
        for (size_t i = 0; i < n; i++)
            dst[i] = wire_f16_to_f32(s[i]) * scale;
    /* checked as the float32 each becomes */
    return tensor_find_nonfinite(dst, n);
}

size_t wire_widened_len(const st_file *f)
{
    size_t len = 0;
    int any = 0;
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
        int d = wire_dtype_of_st(t->dtype);
        size_t b = (size_t)(t->end - t->begin);
        if (d == WIRE_BF16 || d == WIRE_F16) {
            any = 1;
            b *= 2;
        }
        len += (b + 7) & ~(size_t)7;
    }
    return any ? len : 0;
}

int wire_widen(st_file *f, const unsigned char *data, float scale, unsigned char *dst, char *err,
               size_t errlen)
{
    uint64_t *at = malloc(sizeof(uint64_t) * (size_t)(f->n_tensors ? f->n_tensors : 1));
    if (!at) {
        snprintf(err, errlen, "out of memory widening the body");
        return -1;
    }
    uint64_t pos = 0;
    for (int k = 0; k < f->n_tensors; k++) {
        const st_tensor *t = &f->tensors[k];
        int d = wire_dtype_of_st(t->dtype);
        size_t b = (size_t)(t->end - t->begin);
        at[k] = pos;
        if (d == WIRE_BF16 || d == WIRE_F16) {
            int64_t bad = wire_decode((wire_dtype)d, data + t->begin, b / 2, scale, (float *)(dst + pos));
            if (bad >= 0) {
                float v = ((float *)(dst + pos))[bad];
                snprintf(err, errlen, "gradient '%s' has %s at element %lld (as float32)", t->name,
                         isnan(v) ? "NaN" : "Inf", (long long)bad);
                free(at);
                return -1;
            }
            b *= 2;
        } else {
            memcpy(dst + pos, data + t->begin, b);
            int64_t bad = d == WIRE_F32 ? tensor_find_nonfinite((const float *)(dst + pos), b / 4) : -1;
            if (bad >= 0) { /* the float32 ones beside them too: the whole body is checked */
                float v = ((const float *)(dst + pos))[bad];
                snprintf(err, errlen, "gradient '%s' has %s at element %lld", t->name, isnan(v) ? "NaN" : "Inf",
                         (long long)bad);
                free(at);
                return -1;
            }
        }
        pos += (b + 7) & ~(size_t)7;
    }
    for (int k = 0; k < f->n_tensors; k++) {
        st_tensor *t = &f->tensors[k];
        int d = wire_dtype_of_st(t->dtype);
        uint64_t b = t->end - t->begin;
        if (d == WIRE_BF16 || d == WIRE_F16) {
            b *= 2;
            snprintf(t->dtype, sizeof(t->dtype), "F32");
        }
        t->begin = at[k];
        t->end = at[k] + b;
    }
    f->data_len = pos;
    free(at);
    return 0;
}
