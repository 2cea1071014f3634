/* dropout_mask.h - the dropout mask of the model contract, the same bits on
 * the CPU, in CUDA and in numpy (tests/system/test_model_numpy.py):
 *   mix64(z): z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27;
 *             z *= 0x94d049bb133111eb; z ^= z >> 31
 *   h = mix64(s + 0x9E3779B97F4A7C15 * (t + 1)); h = mix64(h ^ e);
 *   h = mix64(h ^ ((li << 32) | u)); r = (float)(h >> 40) * 2^-24
 *   keep iff r >= R; y = keep ? x * scale : 0, scale = 1.0f / (1.0f - R) (float32)
 * s: the seed, t: the global step, e: the example's index in the epoch order,
 * li: the dropout's ordinal among the model's dropout layers, u: the unit (the
 * flat row-major HWC index within the example's activation), all uint64
 * arithmetic with wraparound. Header-only, usable from C and CUDA. */
#ifndef RESTPS_DROPOUT_MASK_H
#define RESTPS_DROPOUT_MASK_H

#include <stdint.h>

#ifdef __CUDACC__
#define DROPOUT_FN static inline __host__ __device__
#else
#define DROPOUT_FN static inline
#endif

DROPOUT_FN uint64_t dropout_mix64(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

/* The per-(seed, step, example) part of the hash, computed once per row. */
DROPOUT_FN uint64_t dropout_row_hash(uint64_t seed, int64_t step, int64_t example)
{
    uint64_t h = dropout_mix64(seed + 0x9E3779B97F4A7C15ULL * ((uint64_t)step + 1u));
    return dropout_mix64(h ^ (uint64_t)example);
}

/* r in [0, 1) for unit u of dropout li, from the row's hash. */
DROPOUT_FN float dropout_uniform(uint64_t row_hash, uint32_t li, uint64_t u)
{
    uint64_t h = dropout_mix64(row_hash ^ (((uint64_t)li << 32) | u));
    return (float)(h >> 40) * (1.0f / 16777216.0f);
}

/* 1 when the unit is kept (r >= rate), else 0. */
DROPOUT_FN int dropout_keep(uint64_t row_hash, uint32_t li, uint64_t u, float rate)
{
    return dropout_uniform(row_hash, li, u) >= rate;
}

/* The whole contract for one unit: 1 when kept. */
DROPOUT_FN int dropout_keep_unit(uint64_t seed, int64_t step, int64_t example, uint32_t li,
                                 uint64_t u, float rate)
{
    return dropout_keep(dropout_row_hash(seed, step, example), li, u, rate);
}

#undef DROPOUT_FN
#endif
