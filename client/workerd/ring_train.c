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
#include "ring/ring_overlap.h"
#include "tensor.h"
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

/* One run of --allreduce=ring: the role buffers, the ring, the chief's
 * state and events, and the step loop's counters. */
typedef struct ring_run {
    const train_config *c;
    role_bufs rb;
    ring *r;
    ring_overlap *ov; /* --overlap: the buckets beside the backward pass; NULL: after it */
    size_t *layer_start; /* with ov: where each layer's gradients start */
    /* with ov: step rr->step's buckets are being summed (pending), applied
     * one by one as the next forward pass reaches their layers (next_apply:
     * the first not applied yet), then the step is accounted; hook_rc: what
     * stopped a forward pass in its hook (1 broken, after a message; 2 a stop) */
    int pending, next_apply, hook_rc;
    int last_param_layer; /* with ov: the last layer that has parameters */
    tfevents *tb;  /* the chief's TensorBoard events, or NULL */
    ring_state st; /* the parameters and slots, as checkpointed and published */
    int n, chief;
    int ready; /* ready: batch buffer rb.cur holds this step's batch */
    int64_t step, local, saved_step, rates_step;
    double t_saved, t_rates, t_comm;
    int stopped, broken;
    int diverged; /* the parameters went non-finite: no checkpoint of them */
    int rc; /* the exit status when a step says leave */
} ring_run;

/* The chief checkpoints (into --logdir). */
static int ckpt_on(const ring_run *rr) { return rr->chief && rr->c->logdir && *rr->c->logdir; }

/* --overlap: the buckets' edges at the layers' starts (each bucket at least
 * --overlap_min_bytes, the last layers' first; rr->layer_start set), or 0
 * (off: not asked for, a model whose gradients are not in layer order, no
 * layer past the first that holds enough, or out of memory), saying why
 * where it was asked for. */
static int overlap_edges(ring_run *rr, size_t *edges, int cap)
{
    const train_config *c = rr->c;
    const model_layout *L = &c->layout;
    if (!c->overlap || rr->n < 2 || L->n_layers < 2)
        return 0;
    if (!(rr->layer_start = malloc((size_t)L->n_layers * sizeof(size_t))))
        return 0;
    /* layer l's start: its first tensor's, or (none) the next layer's */
    size_t next = L->n_params;
    for (int l = L->n_layers - 1; l >= 0; l--) {
        size_t at = next;
        for (int t = 0; t < L->n_tensors; t++)
            if (L->tensors[t].layer == l && L->tensors[t].offset < at)
                at = L->tensors[t].offset;
        rr->layer_start[l] = next = at;
    }
    for (int t = 0; t < L->n_tensors; t++) { /* a layer's tensors must lie in its range */
        int l = L->tensors[t].layer;
        if (l > rr->last_param_layer)
            rr->last_param_layer = l;
        size_t end = l + 1 < L->n_layers ? rr->layer_start[l + 1] : L->n_params;
        if (L->tensors[t].offset < rr->layer_start[l] || L->tensors[t].offset + L->tensors[t].numel > end) {
            printf("%s: --overlap: the model's gradients are not in layer order: the all-reduce after the backward "
                   "pass\n", c->name);
            return 0;
        }
    }
    int n = ring_overlap_edges(rr->layer_start, L->n_layers, L->n_params + 1, c->overlap_min_bytes / 4, edges, cap);
    if (n == 0)
        printf("%s: --overlap: no bucket past the first layers holds --overlap_min_bytes=%llu: the all-reduce after "
               "the backward pass\n", c->name, (unsigned long long)c->overlap_min_bytes);
    return n;
}

/* The ring: the chief task (when there is one), then the workers; 0, or -1
 * after a message. */
static int join_ring(ring_run *rr)
{
    const train_config *c = rr->c;
    const cluster_spec *cs = c->cluster;
    int has_chief = cs->jobs[JOB_CHIEF].n > 0, n = rr->n;
    char err[512];
    cluster_addr *peers = calloc((size_t)n, sizeof(*peers));
    if (!peers) {
        fprintf(stderr, "workerd: out of memory\n");
        return -1;
    }
    if (has_chief)
        peers[0] = cs->jobs[JOB_CHIEF].tasks[0];
    for (int i = 0; i < cs->jobs[JOB_WORKER].n; i++)
        peers[i + has_chief] = cs->jobs[JOB_WORKER].tasks[i];
    size_t edges[RING_MAX_EDGES];
    int n_edges = overlap_edges(rr, edges, RING_MAX_EDGES);
    ring_options ro = {.peers = peers, .n = n, .rank = c->trainer, .n_floats = c->layout.n_params + 1,
                       .piece_bytes = c->ring_piece_bytes, .timeout_secs = c->ring_timeout_secs,
                       .name = c->name, .abort = train_stop_requested, .token = c->token,
                       .tls_cert = c->ring_tls_cert, .tls_key = c->ring_tls_key, .tls_ca = c->tls_ca,
                       .tls_priorities = c->ring_tls_priorities,
                       .tls_names = {.cert = "--ring_tls_cert", .key = "--ring_tls_key", .ca = "--tls_ca",
                                     .priorities = "--ring_tls_priorities"},
                       .first_step = RING_STEP_UNKNOWN /* the chief's state says */,
                       .edges = n_edges > 0 ? edges : NULL, .n_edges = n_edges > 0 ? n_edges : 0};
    rr->r = ring_new(&ro, err, sizeof(err));
    free(peers);
    if (!rr->r) {
        fprintf(stderr, "workerd: ring: %s\n", err);
        return -1;
    }
    ring *r = rr->r;
    if (n_edges > 0 && !(rr->ov = ring_overlap_new(r, rr->layer_start, c->layout.n_layers, c->layout.n_params)))
        fprintf(stderr, "workerd: %s: no thread for --overlap: the all-reduce after the backward pass\n", c->name);
    if (n_edges > 0)
        printf("%s: --overlap: the all-reduce in %d buckets beside the backward pass, the last layers' first\n",
               c->name, n_edges + 1);
    if (ring_tls(r))
        printf("%s: serving the ring on %s (%s, neighbours' certificates checked against %s)\n", c->name,
               ring_url(r), ring_tls(r), c->tls_ca ? c->tls_ca : "the system's CAs");
    else
        printf("%s: serving the ring on %s (plain HTTP: --ring_tls_cert for HTTPS)\n", c->name, ring_url(r));
    fflush(stdout);
    ring_info info = {.task_type = cluster_job_name(cs->job), .task_index = cs->task_index,
                      .optimizer = optim_name(c->optim.kind),
                      .learning_rate = c->optim.learning_rate, .train_steps = c->train_steps};
    ring_set_info(r, &info);
    return 0;
}

/* The chief's start: restore the newest checkpoint in --logdir, else
 * initialize, and publish it; 0, or -1 with rr->rc after a message. */
static int chief_start(ring_run *rr)
{
    const train_config *c = rr->c;
    ring_state *st = &rr->st;
    char path[4200], err[512];
    int got = c->logdir && *c->logdir
                  ? ring_ckpt_restore(c->logdir, st, path, sizeof(path), err, sizeof(err))
                  : 0;
    if (got < 0) {
        fprintf(stderr, "workerd: %s\n", err);
        rr->rc = 2;
        return -1;
    }
    if (got) {
        printf("%s: restored global step %lld from %s (written by a ring of %d)\n", c->name,
               (long long)st->step, path, st->workers);
        ring_set_checkpoint(rr->r, st->step, path);
    } else {
        model_init_params(&c->layout, rr->rb.params, c->seed);
    }
    st->workers = rr->n;
    void *body;
    size_t len;
    if (ring_state_encode(st, &body, &len, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return -1;
    }
    ring_publish(rr->r, body, len);
    return 0;
}

/* The others' start: fetch the chief's state; 0, or -1 with rr->rc (0 on a
 * stop) after a message. */
static int fetch_start(ring_run *rr)
{
    const train_config *c = rr->c;
    char err[512];
    void *body = NULL;
    size_t len = 0;
    int frc = ring_fetch_state(rr->r, 0, RING_START_SECS, &body, &len, err, sizeof(err));
    if (frc == -2) {
        printf("%s: stopped by a signal while waiting for the chief\n", c->name);
        rr->rc = 0;
        return -1;
    }
    if (frc != 0) {
        fprintf(stderr, "workerd: ring: %s\n", err);
        return -1;
    }
    int drc = ring_state_decode(body, len, &rr->st, err, sizeof(err));
    free(body);
    if (drc != 0) {
        fprintf(stderr, "workerd: the chief's parameters: %s%s\n", err,
                drc == -3 ? ": start every task with the same --hidden_units and --optimizer" : "");
        rr->rc = 2;
        return -1;
    }
    rr->st.workers = rr->n;
    return 0;
}

/* The chief's TensorBoard event writer in <logdir>/train (none without a
 * --logdir, or when it cannot start). */
static void open_events(ring_run *rr)
{
    const train_config *c = rr->c;
    if (!ckpt_on(rr))
        return;
    char tbdir[4200];
    snprintf(tbdir, sizeof(tbdir), "%s/train", c->logdir);
    if (tfevents_open(&rr->tb, "workerd", tbdir, RING_EVENTS_FLUSH_MS, NULL, NULL) == 0)
        printf("%s: tensorboard event files go in %s\n", c->name, tbdir);
    else
        fprintf(stderr, "workerd: cannot start the tensorboard event writer: none written\n");
}

/* This task's own gradient (or loss) at float bad is a NaN or an Inf: the
 * message; -1 (broken). */
static int own_nonfinite(ring_run *rr, int64_t bad)
{
    const train_config *c = rr->c;
    progress_clear(&rr->rb.bar);
    fprintf(stderr,
            "workerd: %s: this task's %s at global step %lld is non-finite (%s at float %lld): training "
            "diverged (a lower --learning_rate?); stopping, %s%s\n",
            c->name, (size_t)bad == c->layout.n_params ? "loss" : "gradient", (long long)rr->step,
            isnan(rr->rb.grads[bad]) ? "NaN" : "Inf", (long long)bad,
            rr->diverged ? "its first layers' buckets were applied" : "nothing applied",
            !ckpt_on(rr) ? "" : rr->diverged ? " (the last checkpoint stays)"
                                             : " (the checkpoint of the last finite parameters is written now)");
    rr->broken = 1;
    return -1;
}

static void account(ring_run *rr, double mean_loss);
static int params_nonfinite(ring_run *rr);

/* The bucket that holds float i. */
static int bucket_of(const ring_run *rr, size_t i)
{
    int nb = ring_buckets(rr->r);
    for (int b = 0; b < nb; b++) {
        size_t a, e;
        ring_bucket_range(rr->r, b, &a, &e);
        if (i < e)
            return b;
    }
    return nb - 1;
}

/* --overlap: the pending step's buckets up to `upto` summed and applied (the
 * variables in each, as role_bufs_apply applies them); after the last, the
 * parameters checked and the step accounted, and (next) the next step's
 * all-reduce begun. 0; -1 broken after a message, or a stop. */
static int apply_pending(ring_run *rr, int upto, int next)
{
    const train_config *c = rr->c;
    role_bufs *rb = &rr->rb;
    const size_t np = c->layout.n_params;
    const int nb = ring_buckets(rr->r);
    while (rr->pending && rr->next_apply <= upto) {
        const int b = rr->next_apply;
        char err[512];
        int64_t bad = -1;
        double t0 = clk_mono_secs();
        int rc = ring_overlap_wait_bucket(rr->ov, b, &bad, err, sizeof(err));
        rr->t_comm += clk_mono_secs() - t0;
        if (rc) {
            ring_overlap_end(rr->ov, NULL, NULL, 0);
            rr->pending = 0;
            if (b > 0)
                rr->diverged = 1; /* the first buckets are applied: no checkpoint of a half step */
            if (rc == -3)
                return own_nonfinite(rr, bad);
            if (rc == -2) {
                rr->stopped = 1;
                return -1;
            }
            progress_clear(&rb->bar);
            fprintf(stderr, "workerd: %s: ring broken at global step %lld: %s; stopping%s\n", c->name,
                    (long long)rr->step, rc == -1 ? err : "the all-reduce thread stopped",
                    !ckpt_on(rr) ? "" : b > 0 ? " (its first layers were updated: the last checkpoint stays)"
                                              : " (the last checkpoint is written now)");
            rr->broken = 1;
            return -1;
        }
        size_t a, e;
        ring_bucket_range(rr->r, b, &a, &e);
        bad = tensor_find_nonfinite(rb->grads + a, e - a);
        if (bad >= 0) {
            ring_overlap_end(rr->ov, NULL, NULL, 0);
            rr->pending = 0;
            rr->diverged = b > 0;
            progress_clear(&rb->bar);
            fprintf(stderr,
                    "workerd: %s: the all-reduce at global step %lld summed a non-finite %s (%s at float %lld of "
                    "%zu): a task diverged or sent NaN/Inf; stopping, %s\n",
                    c->name, (long long)rr->step, (size_t)(a + bad) == np ? "loss" : "gradient",
                    isnan(rb->grads[a + bad]) ? "NaN" : "Inf", (long long)(a + bad), np + 1,
                    b == 0 ? "nothing applied" : "the first layers' buckets were applied (no checkpoint of them)");
            rr->broken = 1;
            return -1;
        }
        /* the average, per variable, as role_bufs_apply */
        const float scale = 1.0f / (float)rr->n;
        for (int k = 0; k < c->layout.n_tensors; k++) {
            const model_tensor *t = &c->layout.tensors[k];
            if (t->offset >= a && t->offset < e)
                optim_apply(&c->optim, rb->params + t->offset, rb->params + t->offset, rb->grads + t->offset,
                            scale, rb->s0 + t->offset, rb->s1 + t->offset, rr->step + 1, rr->step, t->numel);
        }
        rr->next_apply++;
        if (rr->next_apply == nb) {
            ring_overlap_end(rr->ov, NULL, NULL, 0); /* both channels are done */
            rr->pending = 0;
            if (params_nonfinite(rr))
                return -1;
            account(rr, (double)rb->grads[np] / rr->n);
            if (next)
                ring_overlap_begin(rr->ov, rr->step, rb->grads, 0);
        }
    }
    return 0;
}

/* model_ctx's hooks (arg: the ring_run): before layer l reads its
 * parameters, the pending step's buckets up to layer l's are applied (the
 * last one accounts the step and begins this one's all-reduce); the loss and
 * the layers' gradients go to the all-reduce thread. */
static int hook_wait_params(void *arg, int layer)
{
    ring_run *rr = arg;
    if (!rr->pending)
        return 0;
    /* the last layer with parameters applies every bucket (the loss's too) */
    int upto = layer >= rr->last_param_layer ? ring_buckets(rr->r) - 1 : bucket_of(rr, rr->layer_start[layer]);
    if (train_stop_requested()) {
        rr->hook_rc = 2;
        rr->stopped = 1;
        return 1;
    }
    if (apply_pending(rr, upto, 1) != 0) {
        rr->hook_rc = 1;
        return 1;
    }
    return 0;
}

static int hook_loss_done(void *arg, double loss)
{
    ring_run *rr = arg;
    if (rr->pending) /* a model whose last layers read no parameters: the step before ends here */
        if (apply_pending(rr, ring_buckets(rr->r) - 1, 1) != 0) {
            rr->hook_rc = 1;
            return 1;
        }
    return ring_overlap_loss(rr->ov, loss);
}

static void hook_grads_done(void *arg, int layer) { ring_overlap_grads(((ring_run *)arg)->ov, layer); }

/* A step's gradient of this task's batch, the loss appended; 0, or -1
 * (broken) after a message. */
static int compute(ring_run *rr)
{
    const train_config *c = rr->c;
    role_bufs *rb = &rr->rb;
    const int64_t step = rr->step + rr->pending; /* --overlap: the step before may still be summed */
    if (!rr->ready)
        role_bufs_gather(rb, step, rb->cur);
    rr->ready = 0;
    double loss;
    int fb;
    if (rr->ov) { /* the buckets go as the backward pass writes them */
        if (!rr->pending)
            ring_overlap_begin(rr->ov, step, rb->grads, rr->local == 0 ? RING_START_SECS : 0);
        rr->hook_rc = 0;
        const model_ctx ctx = {.seed = c->seed, .step = step, .example0 = rb->bp.example0[rb->cur],
                               .wait_params = hook_wait_params, .loss_done = hook_loss_done,
                               .grads_done = hook_grads_done, .hook_arg = rr};
        fb = model_forward_backward(rb->m, rb->params, rb->bp.x[rb->cur], rb->bp.y[rb->cur], c->batch_size, &ctx,
                                    rb->grads, &loss);
        if (fb != 0 && rr->hook_rc) /* the step before ended the pass (said so), or a stop */
            return -1;
        if (fb == 0) { /* the loss: its hook wrote it */
            ring_overlap_all_written(rr->ov);
            rr->pending = 1;
            rr->next_apply = 0;
        } else {
            ring_overlap_cancel(rr->ov);
            ring_overlap_end(rr->ov, NULL, NULL, 0);
        }
    } else if ((fb = role_bufs_forward_backward(rb, rr->step, &loss)) == 0) {
        rb->grads[c->layout.n_params] = (float)loss;
    }
    if (fb != 0) {
        /* the parameters are intact: the chief still writes its checkpoint */
        progress_clear(&rb->bar);
        fprintf(stderr, "workerd: %s: forward/backward failed at global step %lld; stopping\n",
                c->name, (long long)rr->step);
        rr->broken = 1;
        return -1;
    }
    /* a diverged task says so here: its neighbour would refuse the piece
     * (400); with --overlap the all-reduce thread checks each bucket before
     * it sends it, and apply_pending says so (the buckets are being summed now) */
    int64_t bad = rr->ov ? -1 : tensor_find_nonfinite(rb->grads, c->layout.n_params + 1);
    if (bad >= 0)
        return own_nonfinite(rr, bad);
    if (c->step_delay_ms > 0) /* test hook: a slow worker */
        sleep_ms(c->step_delay_ms);
    return 0;
}

/* The ring sums the gradients and the losses; 0, or -1 on a stop or (after
 * a message) a broken ring. */
static int reduce(ring_run *rr)
{
    const train_config *c = rr->c;
    char err[512];
    double t0 = clk_mono_secs();
    int arc = ring_allreduce(rr->r, rr->step, rr->rb.grads, rr->local == 0 ? RING_START_SECS : 0, err,
                             sizeof(err));
    rr->t_comm += clk_mono_secs() - t0;
    if (arc == -2) {
        rr->stopped = 1;
        return -1;
    }
    if (arc != 0) {
        progress_clear(&rr->rb.bar);
        fprintf(stderr, "workerd: %s: ring broken at global step %lld: %s; stopping%s\n", c->name,
                (long long)rr->step, err, ckpt_on(rr) ? " (the last checkpoint is written now)" : "");
        rr->broken = 1;
        return -1;
    }
    return 0;
}

/* The all-reduce's sum (the gradients and the loss) finite; else 1 after a
 * message (every task got the same sum, so every task stops alike). */
static int sum_nonfinite(ring_run *rr)
{
    const train_config *c = rr->c;
    size_t np = c->layout.n_params;
    int64_t bad = tensor_find_nonfinite(rr->rb.grads, np + 1);
    if (bad < 0)
        return 0;
    progress_clear(&rr->rb.bar);
    fprintf(stderr,
            "workerd: %s: the all-reduce at global step %lld summed a non-finite %s (%s at float %lld of %zu): "
            "a task diverged or sent NaN/Inf; stopping, nothing applied%s\n",
            c->name, (long long)rr->step, (size_t)bad == np ? "loss" : "gradient",
            isnan(rr->rb.grads[bad]) ? "NaN" : "Inf", (long long)bad, np + 1,
            ckpt_on(rr) ? " (the checkpoint of the last finite parameters is written now)" : "");
    rr->broken = 1;
    return 1;
}

/* The parameters after the update finite; else 1 after a message. */
static int params_nonfinite(ring_run *rr)
{
    const train_config *c = rr->c;
    int64_t bad = tensor_find_nonfinite(rr->rb.params, c->layout.n_params);
    if (bad < 0)
        return 0;
    progress_clear(&rr->rb.bar);
    fprintf(stderr,
            "workerd: %s: the parameters went non-finite at global step %lld (%s at float %lld): training "
            "diverged (a lower --learning_rate?); stopping%s\n",
            c->name, (long long)rr->step + 1, isnan(rr->rb.params[bad]) ? "NaN" : "Inf", (long long)bad,
            ckpt_on(rr) ? " (no checkpoint of them: the last finite one is kept)" : "");
    rr->broken = rr->diverged = 1;
    return 1;
}

/* After the update: the counters, the status, the events, the log and the
 * chief's checkpoint every --save_checkpoint_secs. */
static void account(ring_run *rr, double mean_loss)
{
    const train_config *c = rr->c;
    int64_t step = ++rr->step;
    rr->local++;
    ring_set_progress(rr->r, step, mean_loss);
    if (rr->tb) {
        double t = clk_mono_secs(), wall = clk_unix_secs();
        tfevents_scalar(rr->tb, "loss", step, wall, mean_loss);
        if (t - rr->t_rates >= 1.0) {
            write_rates(rr->tb, c, rr->n, step, step - rr->rates_step, t - rr->t_rates);
            rr->t_rates = t;
            rr->rates_step = step;
        }
    }
    if (c->log_param_hash) {
        printf("%s: global step %lld params crc32c %08x\n", c->name, (long long)step,
               crc32c(rr->rb.params, c->layout.n_params * 4));
        fflush(stdout);
    }
    role_bufs_step_done(&rr->rb, rr->local, step, 1, step, mean_loss);
    if (ckpt_on(rr) && c->save_checkpoint_secs > 0 &&
        clk_mono_secs() - rr->t_saved >= c->save_checkpoint_secs) {
        rr->st.step = step;
        if (save(c, rr->r, &rr->st) == 0)
            rr->saved_step = step;
        rr->t_saved = clk_mono_secs();
    }
}

/* One step: the gradient, the all-reduce, the next batch staged, the update
 * with the average, the accounting; 0, or -1 when the loop ends (a stop, or
 * broken). */
static int ring_step(ring_run *rr)
{
    const train_config *c = rr->c;
    role_bufs *rb = &rr->rb;
    if (train_stop_requested()) {
        rr->stopped = 1;
        return -1;
    }
    if (rr->ov) { /* the sum goes on; the next forward pass applies it (hook_wait_params) */
        if (compute(rr) != 0)
            return -1;
        if (rr->step + 1 < c->train_steps) {
            rb->cur ^= 1;
            role_bufs_stage(rb, rr->step + 1, rb->cur);
            rr->ready = 1;
        }
        return 0;
    }
    if (compute(rr) != 0 || reduce(rr) != 0 || sum_nonfinite(rr))
        return -1;
    /* the next batch now, on its way to the device during the update;
     * after the all-reduce, not before, so as not to delay the ring */
    if (rr->step + 1 < c->train_steps) {
        rb->cur ^= 1;
        role_bufs_stage(rb, rr->step + 1, rb->cur);
        rr->ready = 1;
    }
    /* every variable, as the ps applies them: the average of the N gradients */
    float scale = 1.0f / (float)rr->n;
    role_bufs_apply(rb, scale, rr->step);
    if (params_nonfinite(rr))
        return -1;
    account(rr, (double)rb->grads[c->layout.n_params] / rr->n);
    return 0;
}

/* The end: the last rates and checkpoint, the ring's figures, what ended it
 * and (the chief, done) the report and the export; the exit status. */
static int ring_end(ring_run *rr)
{
    const train_config *c = rr->c;
    int64_t step = rr->step;
    int n = rr->n;
    size_t np = c->layout.n_params;
    progress_clear(&rr->rb.bar);
    if (rr->tb && step > rr->rates_step) /* the rates since the last point, at the last step */
        write_rates(rr->tb, c, rr->n, step, step - rr->rates_step, clk_mono_secs() - rr->t_rates);
    rr->st.step = step;
    if (ckpt_on(rr) && step != rr->saved_step && step > 0 && !rr->diverged)
        save(c, rr->r, &rr->st);
    double secs = clk_mono_secs() - rr->rb.t_start;
    uint64_t sent = ring_bytes_sent(rr->r);
    int64_t ars = ring_allreduces(rr->r);
    printf("%s: ring: %lld all-reduces, %llu bytes sent (%.0f per step; 2(N-1)/N x %zu bytes = %.0f), "
           "%.4f s per step in the all-reduce\n",
           c->name, (long long)ars, (unsigned long long)sent, ars ? (double)sent / (double)ars : 0.0,
           (np + 1) * 4, 2.0 * (n - 1) / n * (double)((np + 1) * 4), ars ? rr->t_comm / (double)ars : 0.0);
    if (rr->broken)
        return 1;
    if (rr->stopped) {
        printf("%s: stopped by a signal after %lld local steps (global step %lld)%s\n", c->name,
               (long long)rr->local, (long long)step,
               ckpt_on(rr) ? "; a restart resumes from the checkpoint" : "");
        return 0;
    }
    printf("%s: finished after %lld local steps in %.2f s: %.1f steps/s\n", c->name, (long long)rr->local,
           secs, secs > 0 ? (double)rr->local / secs : 0.0);
    fflush(stdout);
    int rc = 0;
    if (rr->chief) {
        if (final_report(c, rr->rb.m, rr->rb.params, &rr->rb.ds, step) != 0)
            rc = 1;
        if ((c->export_path || c->onnx_path) && export_model(c, rr->rb.params, step) != 0)
            rc = 1;
    }
    return rc;
}

int train_ring(const train_config *c)
{
    ring_run rr = {.c = c, .n = c->n_trainers, .chief = c->trainer == 0, .rc = 1};
    /* the gradient buffer carries the loss after the gradients: the ring sums both */
    int rc = role_bufs_init(&rr.rb, c, 1, 1);
    if (rc)
        return rc;
    /* the start: the chief's parameters and slots on every task */
    rr.st = (ring_state){.layout = &c->layout, .optimizer = c->optim.kind, .params = rr.rb.params,
                         .slot0 = rr.rb.s0, .slot1 = rr.rb.s1, .step = 0, .workers = rr.n};
    if (join_ring(&rr) != 0 || (rr.chief ? chief_start(&rr) : fetch_start(&rr)) != 0)
        goto out;
    rr.step = rr.st.step;
    /* pieces of the first all-reduce (or the next) from now on; until now 503 */
    ring_expect_first_step(rr.r, rr.step);
    ring_set_progress(rr.r, rr.step, NAN);
    open_events(&rr);
    printf("%s: training ring all-reduce, %s, %d tasks, batch %d, from global step %lld until %lld; "
           "left %s, right %s; %s\n",
           c->name, optim_name(c->optim.kind), rr.n, c->batch_size, (long long)rr.step,
           (long long)c->train_steps, ring_peer(rr.r, (c->trainer + rr.n - 1) % rr.n),
           ring_peer(rr.r, (c->trainer + 1) % rr.n), model_device_describe(c->threads));
    fflush(stdout);
    role_bufs_start(&rr.rb);
    rr.t_saved = rr.t_rates = rr.rb.t_start;
    rr.saved_step = rr.chief && rr.st.step > 0 ? rr.st.step : -1;
    rr.rates_step = rr.step;
    while (rr.step + rr.pending < c->train_steps && ring_step(&rr) == 0) {
    }
    /* --overlap: the last step's sum, applied (also on a stop: the checkpoint is of a whole step) */
    if (rr.pending && apply_pending(&rr, ring_buckets(rr.r) - 1, 0) != 0)
        rr.pending = 0;
    rr.rc = ring_end(&rr);
out:
    fflush(stdout);
    tfevents_close(rr.tb); /* writes what is queued */
    ring_overlap_free(rr.ov);
    ring_free(rr.r);
    free(rr.layer_start);
    role_bufs_free(&rr.rb);
    return rr.rc;
}
