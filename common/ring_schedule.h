/* ring_schedule.h - the schedule of a ring all-reduce of n members, shared by
 * both rings: client/ring/ring.c's between workers and
 * client/pipeline/pipeline_ring.c's between a pipeline stage's replicas. The
 * buffer of len floats is cut into n chunks,
 * chunk c being floats [c len / n, (c + 1) len / n). In the reduce-scatter
 * (ring steps 0 to n - 2) member r sends chunk r - t to member r + 1 and adds
 * chunk r - t - 1 from member r - 1 into its own; it then holds chunk r + 1
 * summed over all members, and in the all-gather (ring steps n - 1 to
 * 2n - 3) the summed chunks go round and are copied (indices mod n). Each
 * chunk is summed along one path in one order, so every member ends with the
 * same floats. Pure arithmetic: no state, nothing exits. */
#ifndef RESTPS_RING_SCHEDULE_H
#define RESTPS_RING_SCHEDULE_H

#include <stddef.h>

/* The ring steps of one all-reduce: 2 (n - 1). */
static inline int ring_steps(int n) { return 2 * (n - 1); }

static inline int ring_mod(int a, int m) { return ((a % m) + m) % m; }

/* The chunk member r sends at ring step t: in the reduce-scatter its own
 * chunk, then the one just summed; in the all-gather the chunk summed here
 * (r + 1), then the one just received. */
static inline int ring_send_chunk(int n, int r, int t)
{
    return t < n - 1 ? ring_mod(r - t, n) : ring_mod(r + 1 - (t - (n - 1)), n);
}

/* The chunk member r receives at ring step t: its left neighbour's send. */
static inline int ring_recv_chunk(int n, int r, int t) { return ring_send_chunk(n, r - 1, t); }

/* The first float of chunk c of len floats (c = n: len), floor(c len / n)
 * without overflow. */
static inline size_t ring_chunk_start(size_t len, int n, int c)
{
    return len / (size_t)n * (size_t)c + (len % (size_t)n) * (size_t)c / (size_t)n;
}

/* Chunk c of len floats: its first float in *off, its length returned. */
static inline size_t ring_chunk(size_t len, int n, int c, size_t *off)
{
    *off = ring_chunk_start(len, n, c);
    return ring_chunk_start(len, n, c + 1) - *off;
}

#endif
