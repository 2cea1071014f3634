/* rng.h - the worker's one pseudo-random generator: splitmix64, with unbiased
 * bounded integers and truncated normals on top. Header-only, no global state:
 * the caller owns the 64-bit state, so every stream is reproducible from its seed.
 *
 * splitmix64 is Steele, Lea and Flood's SplittableRandom step ("Fast splittable
 * pseudorandom number generators", OOPSLA 2014) as written in Vigna's reference
 * splitmix64.c: state += 0x9E3779B97F4A7C15, then a 64-bit finalizer of the state.
 * It passes BigCrush and is what xoshiro's authors recommend for seeding. */
#ifndef RESTPS_RNG_H
#define RESTPS_RNG_H

#include <math.h>
#include <stdint.h>

#define RNG_GOLDEN 0x9E3779B97F4A7C15ULL

/* The finalizer alone: a bijective mix of 64 bits (used to derive stream seeds). */
static inline uint64_t rng_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Next 64 random bits; advances *state. */
static inline uint64_t rng_next(uint64_t *state)
{
    *state += RNG_GOLDEN;
    return rng_mix64(*state);
}

/* The seed of sub-stream `k` of `seed` (per epoch, per tensor, ...): distinct
 * (seed, k) pairs give unrelated streams. */
static inline uint64_t rng_stream(uint64_t seed, uint64_t k)
{
    return rng_mix64(seed ^ rng_mix64(k + RNG_GOLDEN));
}

/* Uniform integer in [0, bound), bound >= 1, without modulo bias: draws that
 * fall in the incomplete last block of 2^64 are rejected and redrawn. */
static inline uint64_t rng_below(uint64_t *state, uint64_t bound)
{
    uint64_t limit = UINT64_MAX - UINT64_MAX % bound; /* a multiple of bound */
    uint64_t r;
    do
        r = rng_next(state);
    while (r >= limit);
    return r % bound;
}

/* Uniform double in (0, 1]: 53 random bits. */
static inline double rng_uniform_open0(uint64_t *state)
{
    return (double)((rng_next(state) >> 11) + 1) * (1.0 / 9007199254740992.0);
}

/* Standard normal by Box-Muller (the cosine half only: two draws per value). */
static inline double rng_normal(uint64_t *state)
{
    double u1 = rng_uniform_open0(state);
    double u2 = rng_uniform_open0(state);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* Standard normal truncated to [-2, 2] the way TensorFlow's truncated_normal
 * does it: a value beyond two standard deviations is dropped and redrawn. */
static inline double rng_truncated_normal(uint64_t *state)
{
    double z;
    do
        z = rng_normal(state);
    while (fabs(z) > 2.0);
    return z;
}

#endif
