/* clock: the one place the code reads the clocks.
 *
 * CLOCK_MONOTONIC for durations, deadlines, rates and timed waits; CLOCK_REALTIME
 * (Unix time) only for wall-clock stamps that leave the process (history points,
 * event files). Timed waits take an absolute CLOCK_MONOTONIC timespec: make the
 * condition variable with clk_mono_cond_init.
 *
 * Header-only (static inline), so every binary and test that includes it links
 * as before. Prefix clk_ (POSIX reserves clock_ in <time.h>). */
#ifndef RESTPS_CLOCK_H
#define RESTPS_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* CLOCK_MONOTONIC now, in whole milliseconds (truncated) */
static inline int64_t clk_mono_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* CLOCK_MONOTONIC now, in nanoseconds */
static inline uint64_t clk_mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* CLOCK_MONOTONIC now, in seconds */
static inline double clk_mono_secs(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* CLOCK_REALTIME now, in seconds since the Unix epoch */
static inline double clk_unix_secs(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* CLOCK_REALTIME now, as a timespec (a wall-clock stamp that leaves the
 * process: a file's time, a log line) */
static inline struct timespec clk_unix_ts(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return t;
}

/* CLOCK_MONOTONIC now, as a timespec (a stamp for clk_mono_since) */
static inline struct timespec clk_mono_ts(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t;
}

/* seconds from the CLOCK_MONOTONIC stamp `t` to now */
static inline double clk_mono_since(const struct timespec *t)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t->tv_sec) + (double)(now.tv_nsec - t->tv_nsec) / 1e9;
}

/* the absolute time `ms` (a clk_mono_ms() value, >= 0) as a timespec */
static inline struct timespec clk_ts_of_ms(int64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    return ts;
}

/* the absolute CLOCK_MONOTONIC time `ms` (>= 0) milliseconds from now, for
 * pthread_cond_timedwait on a CLOCK_MONOTONIC condition variable */
static inline struct timespec clk_mono_after_ms(int64_t ms)
{
    struct timespec at;
    clock_gettime(CLOCK_MONOTONIC, &at);
    at.tv_sec += (time_t)(ms / 1000);
    at.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (at.tv_nsec >= 1000000000L) {
        at.tv_sec++;
        at.tv_nsec -= 1000000000L;
    }
    return at;
}

/* a condition variable whose timed waits take CLOCK_MONOTONIC times
 * (clk_ts_of_ms, clk_mono_after_ms); 0, or pthread_cond_init's error */
static inline int clk_mono_cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
}

#endif
