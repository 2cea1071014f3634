/* local.c - --local: the same model trained in one process, no ps, one
 * update per variable as the ps applies them: the reference for correctness
 * and speed. */
#include "workerd/train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "workerd/progress.h"

/* One step on batch `step` (gathered now unless staged): forward, backward,
 * the next batch staged, the update; 0, or 1 after a message. */
static int local_step(role_bufs *rb, int64_t step, int *ready)
{
    const train_config *c = rb->c;
    if (!*ready)
        role_bufs_gather(rb, step, rb->cur);
    double loss;
    if (role_bufs_forward_backward(rb, step, &loss) != 0) {
        /* the backend printed what failed (a CUDA or cuBLAS call) */
        progress_clear(&rb->bar);
        fprintf(stderr, "workerd: forward/backward failed at step %lld\n", (long long)step);
        return 1;
    }
    /* the next batch now, on its way to the device during the update
     * (staging is only faster: a failure leaves the copy to the step) */
    *ready = step + 1 < c->train_steps;
    if (*ready) {
        rb->cur ^= 1;
        role_bufs_stage(rb, step + 1, rb->cur);
    }
    /* one update per variable, as the ps applies them */
    role_bufs_apply(rb, 1.0f, step);
    role_bufs_step_done(rb, step + 1, step + 1, 0, 0, loss);
    return 0;
}

int train_local(const train_config *c)
{
    role_bufs rb;
    int rc = role_bufs_init(&rb, c, 0, 1);
    if (rc)
        return rc;
    model_init_params(&c->layout, rb.params, c->seed);
    printf("%s: training locally (no ps), %s, batch %d, %lld steps; %s\n",
           c->name, optim_name(c->optim.kind), c->batch_size, (long long)c->train_steps,
           model_device_describe(c->threads));
    fflush(stdout);
    int ready = 0; /* ready: batch buffer rb.cur holds this step's batch */
    role_bufs_start(&rb);
    for (int64_t step = 0; step < c->train_steps; step++)
        if ((rc = local_step(&rb, step, &ready)) != 0)
            goto out;
    progress_clear(&rb.bar);
    double secs = clk_mono_secs() - rb.t_start;
    printf("%s: %lld steps in %.2f s: %.1f steps/s\n", c->name, (long long)c->train_steps, secs,
           (double)c->train_steps / secs);
    rc = final_report(c, rb.m, rb.params, &rb.ds, c->train_steps) != 0;
    if ((c->export_path || c->onnx_path) && export_model(c, rb.params, c->train_steps) != 0)
        rc = 1;
out:
    role_bufs_free(&rb);
    return rc;
}
