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

int train_local(const train_config *c)
{
    idx_dataset ds;
    int rc = train_load(c, &ds);
    if (rc)
        return rc;
    char err[512];
    model *m = model_new(model_device_backend(), &c->layout, c->batch_size, err, sizeof(err));
    size_t np = c->layout.n_params;
    /* the step's buffers from the backend (pinned on a GPU); the slots are the CPU's */
    float *params = model_host_alloc(m, np * sizeof(float));
    float *grads = model_host_alloc(m, np * sizeof(float));
    float *s0 = calloc(np, sizeof(float)), *s1 = calloc(np, sizeof(float));
    /* two batch buffers: step n computes on one while the other is filled
     * with batch n+1 and staged (model_stage_batch), its copy to the device
     * overlapping the optimizer's update */
    batch_pair bp;
    const int bp_ok = batch_pair_alloc(&bp, m, c->batch_size, ds.n_features) == 0;
    int cur = 0, ready = 0; /* ready: bp.x[cur], bp.y[cur] hold this step's batch */
    batcher b = {0};
    rc = 1;
    if (!m || !params || !grads || !s0 || !s1 || !bp_ok ||
        batcher_init(&b, &ds.train, c->seed, 0, 1) != 0) {
        fprintf(stderr, "workerd: %s\n", m ? "out of memory" : err);
        goto out;
    }
    model_init_params(&c->layout, params, c->seed);
    printf("%s: training locally (no ps), %s, batch %d, %lld steps; %s\n",
           c->name, optim_name(c->optim.kind), c->batch_size, (long long)c->train_steps,
           model_device_describe(c->threads));
    fflush(stdout);
    double t_log = clk_mono_secs(), t0 = t_log;
    int64_t ex_since = 0;
    progress bar;
    progress_init(&bar, c->name, c->train_steps, -1);
    for (int64_t step = 0; step < c->train_steps; step++) {
        if (!ready)
            batcher_at(&b, step, c->batch_size, ds.n_features, bp.x[cur], bp.y[cur], &bp.example0[cur]);
        double loss;
        const model_ctx ctx = {.seed = c->seed, .step = step, .example0 = bp.example0[cur]};
        if (model_forward_backward(m, params, bp.x[cur], bp.y[cur], c->batch_size, &ctx, grads, &loss) != 0) {
            /* the backend printed what failed (a CUDA or cuBLAS call) */
            progress_clear(&bar);
            fprintf(stderr, "workerd: forward/backward failed at step %lld\n", (long long)step);
            goto out;
        }
        /* the next batch now, on its way to the device during the update
         * (staging is only faster: a failure leaves the copy to the step) */
        ready = step + 1 < c->train_steps;
        if (ready) {
            cur ^= 1;
            batcher_at(&b, step + 1, c->batch_size, ds.n_features, bp.x[cur], bp.y[cur],
                       &bp.example0[cur]);
            (void)model_stage_batch(m, bp.x[cur], bp.y[cur], c->batch_size);
        }
        /* one update per variable, as the ps applies them (clipping is per
         * variable); the slots share the parameters' offsets */
        for (int k = 0; k < c->layout.n_tensors; k++) {
            const model_tensor *t = &c->layout.tensors[k];
            optim_apply(&c->optim, params + t->offset, params + t->offset, grads + t->offset, 1.0f,
                        s0 + t->offset, s1 + t->offset, step + 1, step, t->numel);
        }
        ex_since += c->batch_size;
        progress_update(&bar, step + 1, loss,
                        (double)((step + 1) * c->batch_size) / (clk_mono_secs() - t0));
        if (!bar.on && c->log_every > 0 && (step + 1) % c->log_every == 0) {
            double t = clk_mono_secs();
            printf("%s: step %lld loss %.4f examples/s %.0f\n", c->name, (long long)(step + 1),
                   loss, (double)ex_since / (t - t_log));
            fflush(stdout);
            t_log = t;
            ex_since = 0;
        }
    }
    progress_clear(&bar);
    double secs = clk_mono_secs() - t0;
    printf("%s: %lld steps in %.2f s: %.1f steps/s\n", c->name, (long long)c->train_steps, secs,
           (double)c->train_steps / secs);
    rc = final_report(c, m, params, &ds, c->train_steps) != 0;
    if (c->export_path && export_model(c, params, c->train_steps) != 0)
        rc = 1;
out:
    free(b.order);
    model_host_free(m, params); /* before model_free */
    model_host_free(m, grads);
    batch_pair_free(&bp, m);
    model_free(m);
    free(s0);
    free(s1);
    idx_dataset_free(&ds);
    return rc;
}

