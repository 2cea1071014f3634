/* train.c - a training worker's loop. What every role shares (stopping on a
 * signal, loading the data, the ps connection, waiting for the ps, the
 * placement check, the final report) is in role_common.c; the other roles:
 * chief.c (the chief's set-up and end), evaluator.c, local.c (--local),
 * ring_train.c (--allreduce=ring), pipeline_train.c (--pipeline_stages); the
 * data order: data/batcher.c; the model's files: model_file.c.
 *
 * Start-up follows tf.train.Supervisor.prepare_or_wait_for_session: the chief
 * waits for every ps, creates the variables with create-only PUTs (leaving
 * any that exist, e.g. restored), sends the training configuration, which
 * marks each ps ready; the other tasks poll /readyz. Nobody gives up because
 * a ps or the chief is not up yet.
 *
 * One step: pull every shard (sync: long-poll for the step we need), forward
 * and backward on this task's next batch, push the gradients with an id that
 * makes a retry harmless. */
#include "workerd/train.h"

#include <errno.h>
#include <signal.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"
#include "shards/shards.h"
#include "workerd/progress.h"

/* The next batch, gathered into the other buffer and staged while a push's
 * answer is awaited (ps_set_while_waiting): the ps reads and applies the
 * gradient meanwhile. */
typedef struct next_batch {
    batcher *b;
    batch_pair *bp;
    model *m;
    int idx, batch, n_features;
    int64_t k, *next_k;
} next_batch;

static void stage_next_batch(void *arg)
{
    next_batch *n = arg;
    batcher_at(n->b, n->k, n->batch, n->n_features, n->bp->x[n->idx], n->bp->y[n->idx],
               &n->bp->example0[n->idx]);
    (void)model_stage_batch(n->m, n->bp->x[n->idx], n->bp->y[n->idx], n->batch); /* -1: copied then */
    *n->next_k = n->k;
}

int train_worker(const train_config *c)
{
    idx_dataset ds;
    int rc = train_load(c, &ds);
    if (rc)
        return rc;
    char err[512];
    model *m = model_new(model_device_backend(), &c->layout, c->batch_size, err, sizeof(err));
    /* from the backend: pinned on a GPU, so the step's copies skip a memcpy */
    float *params = model_host_alloc(m, c->layout.n_params * sizeof(float));
    float *grads = model_host_alloc(m, c->layout.n_params * sizeof(float));
    /* two batch buffers: after a push the predicted next batch goes into the
     * other one and is staged (model_stage_batch), its copy to the device
     * overlapping the pull */
    batch_pair bp;
    const int bp_ok = batch_pair_alloc(&bp, m, c->batch_size, ds.n_features) == 0;
    int cur = 0;
    int64_t next_k = -1; /* the batch number bp.x[cur ^ 1] holds (staged), or -1 */
    ps_client *pc = train_connect_ps(c, c->timeout_ms);
    shards sh = {0};
    batcher b = {0};
    json_t *cfg = NULL; /* the chief's configuration, as a worker reads it */
    heartbeat *hb = NULL;
    rc = 1;
    if (!m || !params || !grads || !bp_ok || !pc) {
        fprintf(stderr, "workerd: %s\n", m ? "out of memory" : err);
        goto out;
    }
    if (shards_init(&sh, pc, &c->layout, c->placement, c->partition_bytes, err, sizeof(err)) != 0 ||
        batcher_init(&b, &ds.train, c->seed, c->trainer, c->n_trainers) != 0) {
        fprintf(stderr, "workerd: out of memory\n");
        goto out;
    }
    int sync = c->sync;
    const char *opt_name = optim_name(c->optim.kind);
    if (c->is_chief) {
        if ((rc = train_chief_setup(c, pc, &sh, params)) != 0)
            goto out;
        rc = 1;
    } else {
        train_wait_for_all(c, pc, "/readyz", "the chief to initialize the variables");
        if (train_check_placement(c, pc, &sh) != 0) {
            rc = 2;
            goto out;
        }
        /* the chief's configuration decides the mode and the optimizer */
        if (ps_json(pc, 0, "GET", "/v1/config", NULL, 1, &cfg) == PS_OK) {
            json_t *js = json_object_get(cfg, "sync");
            if (json_is_boolean(js) && json_is_true(js) != sync) {
                printf("%s: the chief chose %s training: following it\n", c->name,
                       json_is_true(js) ? "sync" : "async");
                sync = json_is_true(js);
            }
            const char *o = json_string_value(json_object_get(cfg, "optimizer"));
            if (o)
                opt_name = o;
        }
    }
    /* from here on a ps that stops answering is retried for --ps_retry_secs
     * (it may be restarting from its checkpoint) */
    ps_set_retry_ms(pc, (long)(c->retry_secs * 1000));
    ps_set_abort(pc, train_stop_requested);
    /* async with a staleness bound (the chief's --staleness): stale-synchronous */
    int64_t ssp = -1;
    {
        json_t *cf = NULL;
        if (!sync && ps_json(pc, 0, "GET", "/v1/config", NULL, 1, &cf) == PS_OK) {
            json_t *st = json_object_get(cf, "staleness");
            if (json_is_integer(st) && json_integer_value(st) >= 0)
                ssp = json_integer_value(st);
        }
        json_decref(cf);
    }
    if (ssp >= 0)
        printf("%s: stale-synchronous: at most %lld iterations ahead of the slowest live worker\n",
               c->name, (long long)ssp);
    if (sync || ssp >= 0) {
        /* the lease on every ps: a long step is not a dead worker */
        ps_client *hpc = train_connect_ps(c, 5000);
        hb = hpc ? heartbeat_start(hpc, c->trainer, 1000) : NULL;
    }
    int64_t max_local = c->num_epochs > 0
                            ? (int64_t)(c->num_epochs * (double)(b.count / ((int64_t)c->n_trainers * c->batch_size)))
                            : -1;
    printf("%s: training %s, %s, %d tasks, batch %d, until global step %lld; %s\n",
           c->name, sync ? "sync" : "async", opt_name, c->n_trainers,
           c->batch_size, (long long)c->train_steps, model_device_describe(c->threads));
    fflush(stdout);

    unsigned nonce = 0;
    if (getrandom(&nonce, sizeof(nonce), 0) != sizeof(nonce))
        nonce = (unsigned)getpid();
    int64_t step = 0, local = 0, last_step = 0, ex_since = 0, k = -1, pushes = 0;
    double t_log = clk_mono_secs(), t_start = t_log;
    int stopped = 0, near_end = 0, ran_out = 0;
    progress bar;
    progress_init(&bar, c->name, c->train_steps, -1);
    for (;;) {
        if (train_stop_requested()) {
            stopped = 1;
            break;
        }
        if (max_local >= 0 && local >= max_local) {
            ran_out = 1;
            break;
        }
        /* near the end a ps that went away was most likely stopped by the
         * chief: do not wait the whole retry budget for it */
        if (!near_end && last_step + c->n_trainers >= c->train_steps) {
            near_end = 1;
            ps_set_retry_ms(pc, 2000);
        }
        int behind = 0, prc;
        if (sync)
            prc = shards_pull_sync(&sh, params, c->trainer, 30000, c->train_steps, &step, &behind);
        else if (ssp >= 0 && k >= 0)
            /* stale-synchronous: iteration k starts once the slowest live
             * worker completed k - S (a long poll on ps 0) */
            prc = shards_pull_ssp(&sh, params, c->trainer, k, k - ssp, 30000, &step);
        else
            prc = shards_pull(&sh, params, -1, 0, &step);
        if (prc != PS_OK && train_stop_requested()) {
            stopped = 1;
            break;
        }
        if (prc != PS_OK) {
            if (prc == PS_ENET && near_end) {
                printf("%s: the ps stopped at the end of training\n", c->name);
                rc = 0;
            } else {
                fprintf(stderr, "workerd: pull: %s\n", ps_error(pc));
            }
            goto out;
        }
        if (step < last_step - c->n_trainers && !near_end)
            printf("%s: global step went back from %lld to %lld: a ps restarted from its checkpoint; going on from there\n",
                   c->name, (long long)last_step, (long long)step);
        last_step = step;
        if (step >= c->train_steps)
            break;
        /* the data: sync, batch number = the global step, so a task that
         * restarts, or recomputes a step a ps lost, takes the same batch;
         * async, this task's own count, started where the others are */
        if (k < 0)
            k = step / c->n_trainers;
        /* the batch staged after the last push (in the other buffer) when it
         * is this one, else gathered now into the last step's buffer (a
         * staged one must stay as it is until the step below) */
        if (next_k == (sync ? step : k))
            cur ^= 1;
        else
            batcher_at(&b, sync ? step : k, c->batch_size, ds.n_features, bp.x[cur], bp.y[cur],
                       &bp.example0[cur]);
        next_k = -1; /* the forward_backward below ends the staging either way */
        k++;
        (void)behind; /* sync: behind or not, a gradient for the current step goes out; a
                         shard that holds ours already answers "duplicate" */
        double loss;
        /* dropout's mask: this step, the seed, the rows' places in the epoch */
        const model_ctx ctx = {.seed = c->seed, .step = step, .example0 = bp.example0[cur]};
        if (model_forward_backward(m, params, bp.x[cur], bp.y[cur], c->batch_size, &ctx, grads, &loss) != 0) {
            fprintf(stderr, "workerd: forward/backward failed\n");
            goto out;
        }
        if (c->step_delay_ms > 0) /* test hook: a slow worker */
            train_sleep((double)c->step_delay_ms / 1000.0);
        char id[64];
        snprintf(id, sizeof(id), "t%d-%08x-%lld", c->trainer, nonce, (long long)pushes++);
        push_meta pm = {c->trainer, step, loss, c->batch_size, id, ssp >= 0 ? k - 1 : -1};
        int64_t after;
        int outcome;
        /* the next batch (as predicted below) while the ps applies this push */
        next_batch nb = {&b, &bp, m, cur ^ 1, c->batch_size, ds.n_features, sync ? step + 1 : k, &next_k};
        if ((max_local < 0 || local + 1 < max_local) && (!sync || nb.k < c->train_steps))
            ps_set_while_waiting(pc, stage_next_batch, &nb);
        prc = shards_push(&sh, grads, &pm, &after, &outcome);
        ps_set_while_waiting(pc, NULL, NULL); /* nb goes out of scope */
        if (prc == PS_EHTTP && ps_http_status(pc) == 409 && sync) {
            /* a shard is behind the step we computed from: it restarted
             * from a checkpoint; pull again and compute for its step */
            printf("%s: %s: pulling again\n", c->name, ps_error(pc));
            shards_rewind(&sh);
            continue;
        }
        if (prc != PS_OK && train_stop_requested()) {
            stopped = 1;
            break;
        }
        if (prc != PS_OK) {
            if (prc == PS_ENET && near_end) {
                printf("%s: the ps stopped at the end of training\n", c->name);
                rc = 0;
            } else {
                fprintf(stderr, "workerd: push: %s\n", ps_error(pc));
            }
            goto out;
        }
        local++;
        ex_since += c->batch_size;
        if (!sync)
            last_step = after;
        progress_update(&bar, sync ? step + 1 : after, loss,
                        (double)(local * c->batch_size) / (clk_mono_secs() - t_start));
        if (!bar.on && c->log_every > 0 && local % c->log_every == 0) {
            double t = clk_mono_secs();
            printf("%s: step %lld (global step %lld) loss %.4f examples/s %.0f\n", c->name,
                   (long long)local, (long long)(sync ? step : after), loss,
                   (double)ex_since / (t - t_log));
            fflush(stdout);
            t_log = t;
            ex_since = 0;
        }
        if (!sync && after >= c->train_steps)
            break;
        /* the next batch, as predicted (sync: the next global step, async:
         * this task's next), into the other buffer and on its way to the
         * device while the pull waits; gathered here, not before the push,
         * so as not to delay the push the other workers may be waiting for */
        int64_t nk = sync ? step + 1 : k;
        if (next_k != nk && (max_local < 0 || local < max_local) && (!sync || nk < c->train_steps)) {
            batcher_at(&b, nk, c->batch_size, ds.n_features, bp.x[cur ^ 1], bp.y[cur ^ 1],
                       &bp.example0[cur ^ 1]);
            (void)model_stage_batch(m, bp.x[cur ^ 1], bp.y[cur ^ 1], c->batch_size); /* -1: copied then */
            next_k = nk;
        }
    }
    heartbeat_stop(hb);
    hb = NULL;
    if (ran_out)
        printf("%s: its data ended after %g epochs (%lld local steps, global step %lld): leaving the job\n",
               c->name, c->num_epochs, (long long)local, (long long)last_step);
    if (stopped) {
        progress_clear(&bar);
        printf("%s: stopped by a signal after %lld local steps (global step %lld); a restart goes on from the ps\n",
               c->name, (long long)local, (long long)last_step);
        /* leave the job, so sync steps do not wait for the lease to run out
         * (a restart rejoins); the ps may be gone: a few quick tries only */
        ps_set_abort(pc, NULL);
        ps_set_retry_ms(pc, 0);
        json_t *bye = json_pack("{s:i}", "worker", c->trainer);
        for (int i = 0; i < ps_shards(pc); i++)
            ps_json(pc, i, "POST", "/v1/done", bye, 1, NULL);
        json_decref(bye);
        rc = 0;
        goto out;
    }
    progress_clear(&bar);
    /* every ps: a sync step no longer waits for this worker */
    json_t *done = json_pack("{s:i}", "worker", c->trainer);
    for (int i = 0; i < ps_shards(pc); i++)
        ps_json(pc, i, "POST", "/v1/done", done, 1, NULL);
    json_decref(done);
    double secs = clk_mono_secs() - t_start;
    printf("%s: finished after %lld local steps in %.2f s: %.1f steps/s\n", c->name,
           (long long)local, secs, (double)local / secs);
    fflush(stdout);
    rc = 0;
    if (c->is_chief) {
        train_chief_wait_others(c, pc);
        int64_t final_step;
        /* the report and the export read the moving averages when on */
        ps_set_moving_average(pc, c->moving_average_decay > 0);
        if (shards_pull(&sh, params, -1, 0, &final_step) != PS_OK) {
            fprintf(stderr, "workerd: final pull: %s\n", ps_error(pc));
            rc = 1;
            goto out;
        }
        if (final_report(c, m, params, &ds, final_step) != 0)
            rc = 1;
        if (c->export_path && export_model(c, params, final_step) != 0)
            rc = 1;
        train_chief_stop_ps(c, pc);
    }
out:
    heartbeat_stop(hb);
    json_decref(cfg);
    free(b.order);
    shards_free(&sh);
    ps_client_free(pc);
    model_host_free(m, params); /* before model_free: the memory is m's device's */
    model_host_free(m, grads);
    batch_pair_free(&bp, m);
    model_free(m);
    idx_dataset_free(&ds);
    return rc;
}

