/* pipeline_ring.c - the ring all-reduce between a pipeline's replicas (see
 * pipeline_ring.h). */
#include "pipeline/pipeline_ring.h"

#include "clock.h"

int pipe_ring_steps(int replicas) { return 2 * (replicas - 1); }

static int mod(int a, int m) { return ((a % m) + m) % m; }

int pipe_ring_send_chunk(int replicas, int r, int t)
{
    /* reduce-scatter: one's own chunk, then the one just summed; all-gather:
     * the chunk summed here (r + 1), then the one just received */
    return t < replicas - 1 ? mod(r - t, replicas) : mod(r + 1 - (t - (replicas - 1)), replicas);
}

int pipe_ring_recv_chunk(int replicas, int r, int t) { return pipe_ring_send_chunk(replicas, r - 1, t); }

size_t pipe_ring_chunk(size_t n, int replicas, int c, size_t *off)
{
    size_t a = n / (size_t)replicas * (size_t)c + (n % (size_t)replicas) * (size_t)c / (size_t)replicas;
    size_t b = n / (size_t)replicas * (size_t)(c + 1) + (n % (size_t)replicas) * (size_t)(c + 1) / (size_t)replicas;
    *off = a;
    return b - a;
}

int pipe_ring_allreduce(pipe_ring_send_fn send, void *ctx, pipe_mailbox *box, int replicas, int r, int64_t step,
                        float *buf, size_t n, float *tmp, double wait, int (*abort)(void), double *idle,
                        int *ring_step, char *err, size_t errlen)
{
    const int right = mod(r + 1, replicas);
    for (int t = 0; t < pipe_ring_steps(replicas); t++) {
        size_t so, ro;
        size_t sn = pipe_ring_chunk(n, replicas, pipe_ring_send_chunk(replicas, r, t), &so);
        size_t rn = pipe_ring_chunk(n, replicas, pipe_ring_recv_chunk(replicas, r, t), &ro);
        const pipe_key k = {step, t, PIPE_RING};
        /* (workerd's send queues a copy: the chunk travels while this one waits for its left neighbour's) */
        if (send(ctx, right, &k, buf + so, sn, wait, err, errlen) != 0)
            return -3;
        const int reduce = t < replicas - 1;
        double t0 = clk_mono_secs();
        int rc = pipe_mailbox_take(box, &k, reduce ? tmp : buf + ro, NULL, t0 + wait, abort);
        *idle += clk_mono_secs() - t0;
        if (rc != 0) {
            *ring_step = t;
            return rc == -2 ? -2 : -1;
        }
        for (size_t u = 0; reduce && u < rn; u++)
            buf[ro + u] += tmp[u];
    }
    return 0;
}
