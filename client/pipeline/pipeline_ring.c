/* pipeline_ring.c - the ring all-reduce between a pipeline's replicas (see
 * pipeline_ring.h). */
#include "pipeline/pipeline_ring.h"

#include "clock.h"

int pipe_ring_allreduce(pipe_ring_send_fn send, void *ctx, pipe_mailbox *box, int replicas, int r, int64_t step,
                        float *buf, size_t n, float *tmp, double wait, int (*abort)(void), double *idle,
                        int *ring_step, char *err, size_t errlen)
{
    const int right = ring_mod(r + 1, replicas);
    for (int t = 0; t < ring_steps(replicas); t++) {
        size_t so, ro;
        size_t sn = ring_chunk(n, replicas, ring_send_chunk(replicas, r, t), &so);
        size_t rn = ring_chunk(n, replicas, ring_recv_chunk(replicas, r, t), &ro);
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
