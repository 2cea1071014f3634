/* ring_train.c - workerd --allreduce=ring: the training tasks as peers in a
 * ring, no ps. The chief (the chief task, else worker 0) initializes the
 * parameters, or restores them with the optimizer's slots from its newest
 * checkpoint in --logdir, and publishes them; the others fetch them. Each
 * step every task computes the gradient of its own batch (the same batches
 * as ps sync mode: batch number = global step), the ring sums the gradients
 * (and the losses, one float appended), and every task applies the average
 * with the same optimizer, so all replicas stay bit-identical. The chief
 * serves /v1/status and the monitoring page, writes a checkpoint every
 * --save_checkpoint_secs, at the end, on a stop and when the ring breaks, and
 * exports the model at the end. With --auth_token_file the ring endpoints
 * want the token on the pieces and the state fetch, and send it. The chief
 * also writes TensorBoard event files in <logdir>/train/ (common/tfevents.h):
 * "loss" (the mean over the tasks) every step, "global_step/sec",
 * "examples/sec" (all tasks) and "learning_rate" once a second. */
#include "workerd/train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "crc32c.h"
#include "workerd/progress.h"
#include "ring/ring.h"
#include "tfevents.h"

#define RING_START_SECS 120.0 /* the first exchange waits this long for everyone to start */
#define RING_KEEP_CKPTS 5
#define RING_EVENTS_FLUSH_MS 1000

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* The chief's rates at step: steps global steps in secs seconds, n tasks. */
static void write_rates(tfevents *tb, const train_config *c, int n, int64_t step, int64_t steps,
                        double secs)
{
    double wall = clk_unix_secs(), sps = secs > 0 ? (double)steps / secs : 0.0;
    tfevents_scalar(tb, "global_step/sec", step, wall, sps);
    tfevents_scalar(tb, "examples/sec", step, wall, sps * n * c->batch_size);
    tfevents_scalar(tb, "learning_rate", step, wall, c->optim.learning_rate);
}

/* Write a checkpoint of st (the chief); 0 or -1 after a message. */
static int save(const train_config *c, ring *r, const ring_state *st)
{
    char path[4200], err[512];
    if (ring_ckpt_write(c->logdir, st, RING_KEEP_CKPTS, path, sizeof(path), err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: checkpoint: %s\n", err);
        return -1;
    }
    ring_set_checkpoint(r, st->step, path);
    printf("%s: wrote checkpoint %s (global step %lld)\n", c->name, path, (long long)st->step);
    fflush(stdout);
    return 0;
}

int train_ring(const train_config *c)
{
    idx_dataset ds;
    int rc = train_load(c, &ds);
    if (rc)
        return rc;
    char err[512];
    const model_layout *L = &c->layout;
    size_t np = L->n_params;
    model *m = model_new(model_device_backend(), L, c->batch_size, err, sizeof(err));
    /* the gradient buffer carries the loss after the gradients: the ring sums both;
     * the step's buffers come from the backend (pinned on a GPU) */
    float *params = model_host_alloc(m, np * sizeof(float));
    float *grads = model_host_alloc(m, (np + 1) * sizeof(float));
    float *s0 = calloc(np, sizeof(float)), *s1 = calloc(np, sizeof(float));
    /* two batch buffers: after the all-reduce the next batch goes into the
     * other one and is staged (model_stage_batch), its copy to the device
     * overlapping the optimizer's update */
    batch_pair bp;
    const int bp_ok = batch_pair_alloc(&bp, m, c->batch_size, ds.n_features) == 0;
    int cur = 0, ready = 0; /* ready: bp.x[cur], bp.y[cur] hold this step's batch */
    batcher b = {0};
    ring *r = NULL;
    tfevents *tb = NULL; /* the chief's TensorBoard events, or NULL */
    rc = 1;
    if (!m || !params || !grads || !s0 || !s1 || !bp_ok ||
        batcher_init(&b, &ds.train, c->seed, c->trainer, c->n_trainers) != 0) {
        fprintf(stderr, "workerd: %s\n", m ? "out of memory" : err);
        goto out;
    }

    /* the ring: the chief task (when there is one), then the workers */
    const cluster_spec *cs = c->cluster;
    int has_chief = cs->jobs[JOB_CHIEF].n > 0, n = c->n_trainers;
    cluster_addr *peers = calloc((size_t)n, sizeof(*peers));
    if (!peers) {
        fprintf(stderr, "workerd: out of memory\n");
        goto out;
    }
    if (has_chief)
        peers[0] = cs->jobs[JOB_CHIEF].tasks[0];
    for (int i = 0; i < cs->jobs[JOB_WORKER].n; i++)
        peers[i + has_chief] = cs->jobs[JOB_WORKER].tasks[i];
    ring_options ro = {.peers = peers, .n = n, .rank = c->trainer, .n_floats = np + 1,
                       .piece_bytes = c->ring_piece_bytes, .timeout_secs = c->ring_timeout_secs,
                       .name = c->name, .abort = train_stop_requested, .token = c->token,
                       .tls_cert = c->ring_tls_cert, .tls_key = c->ring_tls_key, .tls_ca = c->tls_ca,
                       .tls_priorities = c->ring_tls_priorities,
                       .tls_names = {.cert = "--ring_tls_cert", .key = "--ring_tls_key", .ca = "--tls_ca",
                                     .priorities = "--ring_tls_priorities"}};
    r = ring_new(&ro, err, sizeof(err));
    free(peers);
    if (!r) {
        fprintf(stderr, "workerd: ring: %s\n", err);
        goto out;
    }
    if (ring_tls(r))
        printf("%s: serving the ring on %s (%s, neighbours' certificates checked against %s)\n", c->name,
               ring_url(r), ring_tls(r), c->tls_ca ? c->tls_ca : "the system's CAs");
    else
        printf("%s: serving the ring on %s (plain HTTP: --ring_tls_cert for HTTPS)\n", c->name, ring_url(r));
    fflush(stdout);
    int chief = c->trainer == 0;
    ring_info info = {.task_type = cluster_job_name(cs->job), .task_index = cs->task_index,
                      .optimizer = optim_name(c->optim.kind),
                      .learning_rate = c->optim.learning_rate, .train_steps = c->train_steps};
    ring_set_info(r, &info);

    /* the start: the chief's parameters and slots on every task */
    ring_state st = {.layout = L, .optimizer = c->optim.kind, .params = params, .slot0 = s0,
                     .slot1 = s1, .step = 0, .workers = n};
    if (chief) {
        char path[4200];
        int got = c->logdir && *c->logdir
                      ? ring_ckpt_restore(c->logdir, &st, path, sizeof(path), err, sizeof(err))
                      : 0;
        if (got < 0) {
            fprintf(stderr, "workerd: %s\n", err);
            rc = 2;
            goto out;
        }
        if (got) {
            printf("%s: restored global step %lld from %s (written by a ring of %d)\n", c->name,
                   (long long)st.step, path, st.workers);
            ring_set_checkpoint(r, st.step, path);
        } else {
            model_init_params(L, params, c->seed);
        }
        st.workers = n;
        void *body;
        size_t len;
        if (ring_state_encode(&st, &body, &len, err, sizeof(err)) != 0) {
            fprintf(stderr, "workerd: %s\n", err);
            goto out;
        }
        ring_publish(r, body, len);
    } else {
        void *body = NULL;
        size_t len = 0;
        int frc = ring_fetch_state(r, 0, RING_START_SECS, &body, &len, err, sizeof(err));
        if (frc == -2) {
            printf("%s: stopped by a signal while waiting for the chief\n", c->name);
            rc = 0;
            goto out;
        }
        if (frc != 0) {
            fprintf(stderr, "workerd: ring: %s\n", err);
            goto out;
        }
        int drc = ring_state_decode(body, len, &st, err, sizeof(err));
        free(body);
        if (drc != 0) {
            fprintf(stderr, "workerd: the chief's parameters: %s%s\n", err,
                    drc == -3 ? ": start every task with the same --hidden_units and --optimizer" : "");
            rc = 2;
            goto out;
        }
        st.workers = n;
    }
    int64_t step = st.step;
    ring_set_progress(r, step, NAN);
    if (chief && c->logdir && *c->logdir) {
        char tbdir[4200];
        snprintf(tbdir, sizeof(tbdir), "%s/train", c->logdir);
        if (tfevents_open(&tb, "workerd", tbdir, RING_EVENTS_FLUSH_MS, NULL, NULL) == 0)
            printf("%s: tensorboard event files go in %s\n", c->name, tbdir);
        else
            fprintf(stderr, "workerd: cannot start the tensorboard event writer: none written\n");
    }
    printf("%s: training ring all-reduce, %s, %d tasks, batch %d, from global step %lld until %lld; "
           "left %s, right %s; %s\n",
           c->name, optim_name(c->optim.kind), n, c->batch_size, (long long)step,
           (long long)c->train_steps, ring_peer(r, (c->trainer + n - 1) % n),
           ring_peer(r, (c->trainer + 1) % n), model_device_describe(c->threads));
    fflush(stdout);

    double t_start = clk_mono_secs(), t_log = t_start, t_saved = t_start, t_comm = 0;
    int64_t local = 0, ex_since = 0, saved_step = chief && st.step > 0 ? st.step : -1;
    int stopped = 0, broken = 0;
    double t_rates = t_start;
    int64_t rates_step = step;
    progress bar;
    progress_init(&bar, c->name, c->train_steps, -1);
    while (step < c->train_steps) {
        if (train_stop_requested()) {
            stopped = 1;
            break;
        }
        if (!ready)
            batcher_at(&b, step, c->batch_size, ds.n_features, bp.x[cur], bp.y[cur], &bp.example0[cur]);
        ready = 0;
        double loss;
        const model_ctx ctx = {.seed = c->seed, .step = step, .example0 = bp.example0[cur]};
        if (model_forward_backward(m, params, bp.x[cur], bp.y[cur], c->batch_size, &ctx, grads, &loss) != 0) {
            /* the parameters are intact: the chief still writes its checkpoint */
            progress_clear(&bar);
            fprintf(stderr, "workerd: %s: forward/backward failed at global step %lld; stopping\n",
                    c->name, (long long)step);
            broken = 1;
            break;
        }
        grads[np] = (float)loss;
        if (c->step_delay_ms > 0) /* test hook: a slow worker */
            sleep_ms(c->step_delay_ms);
        double t0 = clk_mono_secs();
        int arc = ring_allreduce(r, step, grads, local == 0 ? RING_START_SECS : 0, err, sizeof(err));
        t_comm += clk_mono_secs() - t0;
        if (arc == -2) {
            stopped = 1;
            break;
        }
        if (arc != 0) {
            progress_clear(&bar);
            fprintf(stderr, "workerd: %s: ring broken at global step %lld: %s; stopping%s\n", c->name,
                    (long long)step, err,
                    chief && c->logdir && *c->logdir ? " (the last checkpoint is written now)" : "");
            broken = 1;
            break;
        }
        /* the next batch now, on its way to the device during the update;
         * after the all-reduce, not before, so as not to delay the ring */
        if (step + 1 < c->train_steps) {
            cur ^= 1;
            batcher_at(&b, step + 1, c->batch_size, ds.n_features, bp.x[cur], bp.y[cur],
                       &bp.example0[cur]);
            (void)model_stage_batch(m, bp.x[cur], bp.y[cur], c->batch_size); /* -1: copied then */
            ready = 1;
        }
        /* every variable, as the ps applies them: the average of the N gradients */
        float scale = 1.0f / (float)n;
        for (int k = 0; k < L->n_tensors; k++) {
            const model_tensor *t = &L->tensors[k];
            optim_apply(&c->optim, params + t->offset, params + t->offset, grads + t->offset, scale,
                        s0 + t->offset, s1 + t->offset, step + 1, step, t->numel);
        }
        double mean_loss = (double)grads[np] / n;
        step++;
        local++;
        ex_since += c->batch_size;
        ring_set_progress(r, step, mean_loss);
        if (tb) {
            double t = clk_mono_secs(), wall = clk_unix_secs();
            tfevents_scalar(tb, "loss", step, wall, mean_loss);
            if (t - t_rates >= 1.0) {
                write_rates(tb, c, n, step, step - rates_step, t - t_rates);
                t_rates = t;
                rates_step = step;
            }
        }
        if (c->log_param_hash) {
            printf("%s: global step %lld params crc32c %08x\n", c->name, (long long)step,
                   crc32c(params, np * 4));
            fflush(stdout);
        }
        progress_update(&bar, step, mean_loss,
                        (double)(local * c->batch_size) / (clk_mono_secs() - t_start));
        if (!bar.on && c->log_every > 0 && local % c->log_every == 0) {
            double t = clk_mono_secs();
            printf("%s: step %lld (global step %lld) loss %.4f examples/s %.0f\n", c->name,
                   (long long)local, (long long)step, mean_loss, (double)ex_since / (t - t_log));
            fflush(stdout);
            t_log = t;
            ex_since = 0;
        }
        if (chief && c->logdir && *c->logdir && c->save_checkpoint_secs > 0 &&
            clk_mono_secs() - t_saved >= c->save_checkpoint_secs) {
            st.step = step;
            if (save(c, r, &st) == 0)
                saved_step = step;
            t_saved = clk_mono_secs();
        }
    }
    progress_clear(&bar);
    if (tb && step > rates_step) /* the rates since the last point, at the last step */
        write_rates(tb, c, n, step, step - rates_step, clk_mono_secs() - t_rates);
    st.step = step;
    if (chief && c->logdir && *c->logdir && step != saved_step && step > 0)
        save(c, r, &st);
    double secs = clk_mono_secs() - t_start;
    uint64_t sent = ring_bytes_sent(r);
    int64_t ars = ring_allreduces(r);
    printf("%s: ring: %lld all-reduces, %llu bytes sent (%.0f per step; 2(N-1)/N x %zu bytes = %.0f), "
           "%.4f s per step in the all-reduce\n",
           c->name, (long long)ars, (unsigned long long)sent, ars ? (double)sent / (double)ars : 0.0,
           (np + 1) * 4, 2.0 * (n - 1) / n * (double)((np + 1) * 4), ars ? t_comm / (double)ars : 0.0);
    if (broken)
        goto out;
    if (stopped) {
        printf("%s: stopped by a signal after %lld local steps (global step %lld)%s\n", c->name,
               (long long)local, (long long)step,
               chief && c->logdir && *c->logdir ? "; a restart resumes from the checkpoint" : "");
        rc = 0;
        goto out;
    }
    printf("%s: finished after %lld local steps in %.2f s: %.1f steps/s\n", c->name, (long long)local,
           secs, secs > 0 ? (double)local / secs : 0.0);
    fflush(stdout);
    rc = 0;
    if (chief) {
        if (final_report(c, m, params, &ds, step) != 0)
            rc = 1;
        if (c->export_path && export_model(c, params, step) != 0)
            rc = 1;
    }
out:
    fflush(stdout);
    tfevents_close(tb); /* writes what is queued */
    ring_free(r);
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
