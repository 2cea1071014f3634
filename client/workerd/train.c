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
#include "shards/overlap.h"
#include "shards/shards.h"
#include "workerd/progress.h"

/* One training worker: the role buffers, the ps, the mode the chief chose
 * and the step loop's state. */
typedef struct worker {
    const train_config *c;
    role_bufs rb;
    ps_client *pc;
    shards sh;
    json_t *cfg; /* the chief's configuration, as a worker reads it */
    heartbeat *hb;
    step_timeline *tl; /* the steps' spans, to the ps with the heartbeat */
    overlap *ov;       /* --overlap: the transfer thread, or NULL */
    int64_t ov_pulls, ov_pushes; /* --overlap: steps whose parameters streamed in, pushes from the backward */
    struct ov_job *ov_push;      /* --overlap: the push job */
    int pending;                 /* --overlap: it is still out, its answer streaming into this step */
    int ov_plain;                /* --overlap: the next step pulls first (after a pull again) */
    int sync;
    const char *opt_name;
    int64_t ssp;       /* stale-synchronous: the staleness bound, or -1 */
    int64_t max_local; /* --num_epochs: leave after this many local steps, or -1 */
    unsigned nonce;
    int64_t step, local, last_step, k, pushes;
    int64_t next_k; /* the batch number bp.x[cur ^ 1] holds (staged), or -1 */
    int stopped, near_end, ran_out;
    int returned; /* the last push answered with the parameters (one round trip): no pull */
    char instance[128]; /* this process's claim on its task id (task_claim.c) */
    /* what ps 0 restored from its checkpoint (-1: nothing) and where; doubtful:
     * this task follows a restored configuration its flags differ from,
     * which the chief may refuse (then the ps tasks stop: leave within
     * seconds, not --ps_retry_secs) */
    int64_t restored_step;
    char restored_dir[256];
    int doubtful;
    double loss;   /* this step's */
    int64_t after; /* the global step ps 0 answered this push with */
    int rc;        /* the exit status when a step says leave */
} worker;

/* What a step's phase says: go on, pull again (a shard restarted), the
 * loop ends (a stop, the end), leave at once with w->rc. */
enum { GO_ON, PULL_AGAIN, END_LOOP, LEAVE };

/* The next batch, gathered into the other buffer and staged while a push's
 * answer is awaited (ps_set_while_waiting): the ps reads and applies the
 * gradient meanwhile. */
typedef struct next_batch {
    role_bufs *rb;
    int idx;
    int64_t k, *next_k;
} next_batch;

static void stage_next_batch(void *arg)
{
    next_batch *n = arg;
    role_bufs_stage(n->rb, n->k, n->idx);
    *n->next_k = n->k;
}

/* The ps connection and the shards; 0, or -1 after a message. */
static int connect_ps(worker *w)
{
    const train_config *c = w->c;
    char err[512];
    w->pc = train_connect_ps(c, c->timeout_ms);
    if (!w->pc ||
        shards_init(&w->sh, w->pc, &c->layout, c->placement, c->partition_bytes, err, sizeof(err)) != 0 ||
        shards_set_wire(&w->sh, (wire_dtype)c->wire) != 0 || shards_set_topk(&w->sh, c->topk_ratio) != 0) {
        fprintf(stderr, "workerd: out of memory\n");
        return -1;
    }
    return 0;
}

/* What ps 0 restored from its checkpoint when it started (its global step,
 * or -1: nothing, into w->restored_step and w->restored_dir) and its global
 * step now (-1 when it does not say). */
static int64_t ps_restored(worker *w)
{
    json_t *st = NULL;
    int64_t now = -1;
    w->restored_step = -1;
    if (ps_status(w->pc, 0, &st) != PS_OK)
        return -1;
    json_t *gs = json_object_get(st, "global_step");
    if (json_is_integer(gs))
        now = json_integer_value(gs);
    json_t *rf = json_object_get(json_object_get(st, "checkpoint"), "restored_from");
    const char *file = json_string_value(json_object_get(rf, "file"));
    if (file && json_is_integer(json_object_get(rf, "global_step"))) {
        w->restored_step = json_integer_value(json_object_get(rf, "global_step"));
        snprintf(w->restored_dir, sizeof(w->restored_dir), "%s", file);
        char *slash = strrchr(w->restored_dir, '/');
        if (slash && slash != w->restored_dir)
            *slash = '\0';
        else
            snprintf(w->restored_dir, sizeof(w->restored_dir), ".");
    }
    json_decref(st);
    return now;
}

/* A job already done: the ps tasks restored a checkpoint at or past
 * --train_steps (a rerun on the same --logdir). Say so, leave the job (the
 * chief: once the others left, stop the ps tasks); TRAIN_NOTHING_TO_DO. */
static int nothing_to_train(worker *w, int64_t now);

/* The chief sets the job up; the others wait for it, check its placement and
 * follow its mode and optimizer; 0, or -1 with w->rc. */
static int join(worker *w)
{
    const train_config *c = w->c;
    train_task_instance(w->instance, sizeof(w->instance));
    if (c->is_chief) {
        /* a second process with this task id must not configure the job */
        train_wait_for_all(c, w->pc, "/healthz", "the ps tasks");
        if (train_claim_task(c, w->pc, w->instance) != 0) {
            w->rc = 2;
            return -1;
        }
        int rc = train_chief_setup(c, w->pc, &w->sh, w->rb.params);
        if (rc != 0)
            w->rc = rc;
        return rc != 0 ? -1 : 0;
    }
    train_wait_for_all(c, w->pc, "/readyz", "the chief to initialize the variables");
    if (train_claim_task(c, w->pc, w->instance) != 0) {
        w->rc = 2;
        return -1;
    }
    if (train_check_placement(c, w->pc, &w->sh) != 0) {
        w->rc = 2;
        return -1;
    }
    /* the chief's configuration decides the mode and the optimizer */
    if (ps_json(w->pc, 0, "GET", "/v1/config", NULL, 1, &w->cfg) == PS_OK) {
        json_t *js = json_object_get(w->cfg, "sync");
        if (json_is_boolean(js) && json_is_true(js) != w->sync) {
            int64_t now = ps_restored(w);
            if (w->restored_step >= 0 && now == w->restored_step && now < c->train_steps) {
                /* the configuration may be the checkpoint's, not the chief's */
                printf("%s: ps 0 holds %s training restored from the checkpoint in %s at global step %lld "
                       "(this task's flags say %s): following it; if the chief refuses that job, this "
                       "task ends when the ps tasks stop\n",
                       c->name, json_is_true(js) ? "sync" : "async", w->restored_dir, (long long)now,
                       w->sync ? "sync" : "async");
                w->doubtful = 1;
            } else if (now < c->train_steps) {
                printf("%s: the chief chose %s training: following it\n", c->name,
                       json_is_true(js) ? "sync" : "async");
            }
            w->sync = json_is_true(js);
        }
        const char *o = json_string_value(json_object_get(w->cfg, "optimizer"));
        if (o)
            w->opt_name = o;
    }
    return 0;
}

static struct ov_job *ov_job_new(void);

/* What the overlap can hide is the bytes of every layer but the first with
 * parameters (the last the backward pass writes, the first the forward pass
 * reads): below --overlap_min_bytes (1 MiB: loopback moves it in ~0.4 ms,
 * about what the transfer thread's hand-offs cost a step) it only adds
 * them, and is left off, saying so. */
static int overlap_worth_it(const worker *w)
{
    const model_layout *L = &w->c->layout;
    size_t first = 0;
    for (int l = 0; l < L->n_layers && !first; l++)
        for (int t = 0; t < L->n_tensors; t++)
            if (L->tensors[t].layer == l)
                first += L->tensors[t].numel * 4;
    size_t hidden = L->n_params * 4 - first;
    if ((uint64_t)hidden >= w->c->overlap_min_bytes)
        return 1;
    printf("%s: --overlap: all but %zu KB of the model's %zu KB are its first layer's, which no compute can "
           "hide: training without it\n", w->c->name, hidden >> 10, (L->n_params * 4) >> 10);
    return 0;
}

/* Before the steps: the retries, the staleness bound, the lease, the end of
 * this task's data, the start line, the push ids' nonce and the clocks. */
static void prepare(worker *w)
{
    const train_config *c = w->c;
    /* from here on a ps that stops answering is retried for --ps_retry_secs
     * (it may be restarting from its checkpoint); following a restored
     * configuration the chief may refuse, a few seconds only */
    ps_set_retry_ms(w->pc, w->doubtful ? 2000 : (long)(c->retry_secs * 1000));
    ps_set_abort(w->pc, train_stop_requested);
    /* async with a staleness bound (the chief's --staleness): stale-synchronous */
    {
        json_t *cf = NULL;
        if (!w->sync && ps_json(w->pc, 0, "GET", "/v1/config", NULL, 1, &cf) == PS_OK) {
            json_t *st = json_object_get(cf, "staleness");
            if (json_is_integer(st) && json_integer_value(st) >= 0)
                w->ssp = json_integer_value(st);
        }
        json_decref(cf);
    }
    if (w->ssp >= 0)
        printf("%s: stale-synchronous: at most %lld iterations ahead of the slowest live worker\n",
               c->name, (long long)w->ssp);
    {
        /* the lease on every ps (sync, SSP: a long step is not a dead
         * worker), and the steps' spans for the live timeline (every mode) */
        ps_client *hpc = train_connect_ps(c, 5000);
        w->hb = hpc ? heartbeat_start(hpc, c->trainer, 1000) : NULL;
        heartbeat_set_instance(w->hb, w->instance);
        w->tl = w->hb ? step_timeline_new() : NULL;
        heartbeat_set_timeline(w->hb, w->tl);
    }
    /* --overlap: the transfers on a thread of their own (float32 only: a
     * 16-bit push is cast, and scaled, whole) */
    if (c->overlap && c->topk_ratio > 0)
        printf("%s: --overlap is off with --topk_ratio (a push picks over each whole gradient)\n", c->name);
    if (c->overlap && c->wire == WIRE_F32 && c->topk_ratio == 0 && overlap_worth_it(w) &&
        (!(w->ov_push = ov_job_new()) || !(w->ov = overlap_new(&w->sh))))
        fprintf(stderr, "workerd: %s: no thread for --overlap: training without it\n", c->name);
    w->max_local = c->num_epochs > 0
                       ? (int64_t)(c->num_epochs * (double)(w->rb.b.count / ((int64_t)c->n_trainers * c->batch_size)))
                       : -1;
    printf("%s: training %s, %s, %d tasks, batch %d, until global step %lld; %s\n",
           c->name, w->sync ? "sync" : "async", w->opt_name, c->n_trainers,
           c->batch_size, (long long)c->train_steps, model_device_describe(c->threads));
    fflush(stdout);

    if (getrandom(&w->nonce, sizeof(w->nonce), 0) != sizeof(w->nonce))
        w->nonce = (unsigned)getpid();
    role_bufs_start(&w->rb);
}

/* Before a step: a stop, the end of this task's data, the end near. */
static int step_begin(worker *w)
{
    const train_config *c = w->c;
    if (train_stop_requested()) {
        w->stopped = 1;
        return END_LOOP;
    }
    if (w->max_local >= 0 && w->local + w->pending >= w->max_local) {
        w->ran_out = 1;
        return END_LOOP;
    }
    /* near the end a ps that went away was most likely stopped by the
     * chief: do not wait the whole retry budget for it */
    if (!w->near_end && w->last_step + c->n_trainers >= c->train_steps) {
        w->near_end = 1;
        if (!w->pending) /* (else the transfer thread holds the client: ov_push_done does it) */
            ps_set_retry_ms(w->pc, 2000);
    }
    return GO_ON;
}

/* A pull or a push (what) that failed: the loop ends on a stop; else leave,
 * with status 0 when the ps stopped at the end, after a message. */
static int ps_failed(worker *w, int prc, const char *what)
{
    if (train_stop_requested()) {
        w->stopped = 1;
        return END_LOOP;
    }
    if (prc == PS_ENET && w->near_end) {
        printf("%s: the ps stopped at the end of training\n", w->c->name);
        w->rc = 0;
    } else if (prc == PS_ENET && w->doubtful) {
        fprintf(stderr, "workerd: %s: the ps tasks stopped while this task followed the configuration they "
                        "restored from %s (global step %lld): most likely the chief refused that job, see its "
                        "message; start the job again with a new --logdir for the ps tasks, or that one removed\n",
                w->c->name, w->restored_dir, (long long)w->restored_step);
    } else if (prc == PS_ENET) {
        fprintf(stderr, "workerd: %s: %s: %s: gave up after retrying for %.0f s (--ps_retry_secs); the ps "
                        "task is down or unreachable: start it again (it restores its newest checkpoint), then "
                        "this worker\n",
                w->c->name, what, ps_error(w->pc), w->c->retry_secs);
    } else {
        fprintf(stderr, "workerd: %s: %s\n", what, ps_error(w->pc));
    }
    return LEAVE;
}

/* 1 when a shard that came back came back without the model's variables. */
static int came_back_empty(const shards *sh)
{
    for (int i = 0; i < sh->n; i++)
        if (sh->s[i].back == 2)
            return 1;
    return 0;
}

/* A pull found shards that came back empty or behind this task (they
 * restarted with no checkpoint, or an older one): the chief puts back what
 * it pulled last from them; the others wait (polling) until the ps is
 * caught up, or, after a while with no change, go on from it (in async and
 * stale-synchronous mode at once, unless a shard is empty). */
static int ps_came_back(worker *w)
{
    const train_config *c = w->c;
    shards *sh = &w->sh;
    if (c->is_chief) {
        for (int i = 0; i < sh->n; i++)
            if (sh->s[i].back && train_chief_put_back(c, w->pc, sh, w->rb.params, i) != 0) {
                if (train_stop_requested()) {
                    w->stopped = 1;
                    return END_LOOP;
                }
                return LEAVE;
            }
        shards_rewind(sh);
        return PULL_AGAIN;
    }
    if (!c->sync && !came_back_empty(sh)) {
        /* async and stale-synchronous: a push applies to whatever the ps
         * holds, so there is nothing to wait for (and the bound of
         * --staleness would hold the chief back while this task waited): go
         * on from the ps as it is; the chief's put-back raises it again */
        for (int i = 0; i < sh->n; i++)
            if (sh->s[i].back) {
                printf("%s: ps %d came back behind the workers (global step %lld, this task's %lld): going on "
                       "from there (the chief puts back what it holds)\n",
                       c->name, i, (long long)sh->s[i].back_step, (long long)sh->s[i].step);
                sh->s[i].step = sh->s[i].back_step;
                sh->s[i].back = 0;
            }
        fflush(stdout);
        sh->n_back = 0;
        shards_rewind(sh);
        return PULL_AGAIN;
    }
    double start = clk_mono_secs();
    for (int i = 0; i < sh->n; i++)
        if (sh->s[i].back)
            printf("%s: ps %d came back %s (global step %lld, this task's %lld): waiting for the chief to put its variables back\n",
                   c->name, i, sh->s[i].back == 2 ? "empty" : "behind the workers", (long long)sh->s[i].back_step,
                   (long long)sh->s[i].step);
    fflush(stdout);
    int64_t seen[sh->n];
    for (int i = 0; i < sh->n; i++)
        seen[i] = sh->s[i].back ? sh->s[i].back_step : -1;
    shards_rewind(sh);
    for (;;) {
        train_sleep(0.2);
        if (train_stop_requested()) {
            w->stopped = 1;
            return END_LOOP;
        }
        int64_t step;
        int prc = shards_pull(sh, w->rb.params, -1, 0, &step);
        if (prc != PS_OK)
            return ps_failed(w, prc, "pull");
        int waiting = 0;
        for (int i = 0; i < sh->n; i++) {
            if (seen[i] < 0)
                continue;
            /* the chief raised its step, or the ps went on from where it is */
            int moved = sh->s[i].back != 2 && sh->s[i].back_step > seen[i];
            if (sh->s[i].back && !moved && clk_mono_secs() - start < 10) {
                waiting = 1;
                continue;
            }
            if (sh->s[i].back) { /* the chief left it as it is: go on from it */
                sh->s[i].step = sh->s[i].back_step;
                sh->s[i].back = 0;
                prc = shards_pull(sh, w->rb.params, -1, 0, &step);
                if (prc != PS_OK)
                    return ps_failed(w, prc, "pull");
                if (sh->s[i].back) {
                    waiting = 1;
                    continue;
                }
            }
            printf("%s: ps %d is back at global step %lld: going on\n", c->name, i, (long long)sh->s[i].step);
            seen[i] = -1;
        }
        if (!waiting)
            break;
        if (clk_mono_secs() - start > c->retry_secs) {
            fprintf(stderr, "workerd: %s: the ps tasks did not get their variables back in %.0f s\n", c->name,
                    c->retry_secs);
            return LEAVE;
        }
    }
    shards_rewind(sh);
    return PULL_AGAIN;
}

/* After the parameters came (a pull, or a push's answer): a shard that came
 * back, the step, the end. */
static int pulled(worker *w)
{
    const train_config *c = w->c;
    if (w->sh.n_back > 0)
        return ps_came_back(w);
    if (w->step < w->last_step - c->n_trainers && !w->near_end)
        printf("%s: global step went back from %lld to %lld: a ps restarted from its checkpoint; going on from there\n",
               c->name, (long long)w->last_step, (long long)w->step);
    w->last_step = w->step;
    if (w->step >= c->train_steps)
        return END_LOOP;
    return GO_ON;
}

/* The pull of this mode into params (k: this task's iteration); *step =
 * ps 0's global step. */
static int pull_request(worker *w, int64_t k, int64_t *step)
{
    const train_config *c = w->c;
    int behind = 0;
    if (w->sync) /* sync: behind or not, a gradient for the current step goes out; a
                    shard that holds ours already answers "duplicate" */
        return shards_pull_sync(&w->sh, w->rb.params, c->trainer, 30000, c->train_steps, step, &behind);
    if (w->ssp >= 0 && k >= 0)
        /* stale-synchronous: iteration k starts once the slowest live
         * worker completed k - S (a long poll on ps 0) */
        return shards_pull_ssp(&w->sh, w->rb.params, c->trainer, k, k - w->ssp, 30000, step);
    return shards_pull(&w->sh, w->rb.params, -1, 0, step);
}

/* A pull's spans, from t0 to t1: the wait for the answer's first byte
 * (sync, the step's other gradients; stale-synchronous, the slowest
 * worker), then the parameters' transfer. */
static void pull_spans(worker *w, double t0, double t1, double waited)
{
    if (waited > t1 - t0)
        waited = t1 - t0;
    if (waited >= 0.0005)
        step_timeline_add(w->tl, TL_WAIT, w->step, t0, t0 + waited,
                          w->sync ? "the step's gradients" : w->ssp >= 0 ? "the slowest worker" : "the ps");
    step_timeline_add(w->tl, TL_PULL, w->step, t0 + waited, t1, NULL);
}

/* Pull every shard (sync: long-poll for the step we need). */
static int step_pull(worker *w)
{
    if (w->returned) { /* the push's answer held them: one round trip a step */
        w->returned = 0;
        return pulled(w);
    }
    double t0 = clk_mono_secs();
    int prc = pull_request(w, w->k, &w->step);
    if (prc != PS_OK)
        return ps_failed(w, prc, "pull");
    pull_spans(w, t0, clk_mono_secs(), ps_last_wait_secs(w->pc));
    return pulled(w);
}

/* This step's batch into rb->cur. */
static void choose_batch(worker *w)
{
    const train_config *c = w->c;
    role_bufs *rb = &w->rb;
    /* the data: sync, batch number = the global step, so a task that
     * restarts, or recomputes a step a ps lost, takes the same batch;
     * async, this task's own count, started where the others are */
    if (w->k < 0)
        w->k = w->step / c->n_trainers;
    /* the batch staged after the last push (in the other buffer) when it
     * is this one, else gathered now into the last step's buffer (a
     * staged one must stay as it is until the step below) */
    if (w->next_k == (w->sync ? w->step : w->k))
        rb->cur ^= 1;
    else
        role_bufs_gather(rb, w->sync ? w->step : w->k, rb->cur);
    w->next_k = -1; /* the forward_backward below ends the staging either way */
    w->k++;
}

/* Forward and backward on this task's next batch. */
static int step_compute(worker *w)
{
    const train_config *c = w->c;
    role_bufs *rb = &w->rb;
    choose_batch(w);
    double t0 = clk_mono_secs();
    if (role_bufs_forward_backward(rb, w->step, &w->loss) != 0) {
        fprintf(stderr, "workerd: forward/backward failed\n");
        return LEAVE;
    }
    if (c->step_delay_ms > 0) /* test hook: a slow worker */
        train_sleep((double)c->step_delay_ms / 1000.0);
    step_timeline_add(w->tl, TL_COMPUTE, w->step, t0, clk_mono_secs(), NULL);
    return GO_ON;
}

static int push_result(worker *w, int prc, int ret, double t0, double t1);

/* Push the gradients with an id that makes a retry harmless. */
static int step_push(worker *w)
{
    const train_config *c = w->c;
    int sync = w->sync;
    char id[64];
    snprintf(id, sizeof(id), "t%d-%08x-%lld", c->trainer, w->nonce, (long long)w->pushes++);
    push_meta pm = {c->trainer, w->step, w->loss, c->batch_size, id, w->ssp >= 0 ? w->k - 1 : -1};
    int outcome;
    /* the next batch (as predicted below) while the ps applies this push */
    next_batch nb = {&w->rb, w->rb.cur ^ 1, sync ? w->step + 1 : w->k, &w->next_k};
    if ((w->max_local < 0 || w->local + 1 < w->max_local) && (!sync || nb.k < c->train_steps))
        ps_set_while_waiting(w->pc, stage_next_batch, &nb);
    double t0 = clk_mono_secs();
    /* async and stale-synchronous: the push answers with the parameters
     * after it (and, SSP, once the next iteration may start), which saves
     * the pull */
    int ret = c->one_round_trip && !sync;
    int prc = ret ? shards_push_pull(&w->sh, w->rb.grads, &pm, w->rb.params, w->ssp >= 0 ? w->k - w->ssp : 0,
                                     w->ssp >= 0 ? w->k : 0, 30000, &w->after, &outcome)
                  : shards_push(&w->sh, w->rb.grads, &pm, &w->after, &outcome);
    ps_set_while_waiting(w->pc, NULL, NULL); /* nb goes out of scope */
    return push_result(w, prc, ret, t0, clk_mono_secs());
}

/* What a push from t0 to t1 (ret: with the parameters back) says: its span,
 * the next step's parameters, or pull again (a shard restarted), or leave. */
static int push_result(worker *w, int prc, int ret, double t0, double t1)
{
    const train_config *c = w->c;
    int sync = w->sync;
    if (prc == PS_OK)
        step_timeline_add(w->tl, TL_PUSH, w->step, t0, t1, NULL);
    if (ret && prc == PS_OK) { /* the parameters came with the answer: the next step's */
        w->returned = 1;
        w->step = w->after;
    }
    if (prc == PS_EHTTP && ps_http_status(w->pc) == 409 && sync) {
        /* a shard is behind the step we computed from: it restarted
         * from a checkpoint; pull again and compute for its step */
        printf("%s: %s: pulling again\n", c->name, ps_error(w->pc));
        shards_rewind(&w->sh);
        return PULL_AGAIN;
    }
    if (prc == PS_EHTTP && (ps_http_status(w->pc) == 400 || ps_http_status(w->pc) == 409) &&
        strstr(ps_error(w->pc), "unknown variable")) {
        /* a ps restarted empty: the pull finds it so and puts it back (the chief) or waits */
        printf("%s: %s: pulling again\n", c->name, ps_error(w->pc));
        shards_rewind(&w->sh);
        return PULL_AGAIN;
    }
    if (prc != PS_OK)
        return ps_failed(w, prc, "push");
    return GO_ON;
}

/* After a push: the counters, the log, and the next batch on its way. */
static int step_account(worker *w)
{
    const train_config *c = w->c;
    int sync = w->sync;
    w->local++;
    if (!sync)
        w->last_step = w->after;
    role_bufs_step_done(&w->rb, w->local, sync ? w->step + 1 : w->after, 1, sync ? w->step : w->after,
                        w->loss);
    if (!sync && w->after >= c->train_steps)
        return END_LOOP;
    /* the next batch, as predicted (sync: the next global step, async:
     * this task's next), into the other buffer and on its way to the
     * device while the pull waits; gathered here, not before the push,
     * so as not to delay the push the other workers may be waiting for */
    int64_t nk = sync ? w->step + 1 : w->k;
    if (w->next_k != nk && (w->max_local < 0 || w->local < w->max_local) && (!sync || nk < c->train_steps)) {
        role_bufs_stage(&w->rb, nk, w->rb.cur ^ 1);
        w->next_k = nk;
    }
    return GO_ON;
}

/* --overlap (shards/overlap.h): a transfer thread's job, what it takes
 * and what it gives back. */
typedef struct ov_job {
    worker *w;
    int64_t k;          /* the pull: this task's iteration */
    int64_t step;       /* the pull: ps 0's global step */
    push_meta pm;       /* the push */
    char id[64];
    int ret;            /* the push answers with the parameters */
    int streams;        /* ... which stream into the next step's forward pass */
    int64_t min_clock, clock, after;
    int outcome;
    int prc;
    double t0, t1, waited;
} ov_job;

static ov_job *ov_job_new(void) { return calloc(1, sizeof(ov_job)); }

static int job_pull(void *arg)
{
    ov_job *j = arg;
    j->t0 = clk_mono_secs();
    j->prc = pull_request(j->w, j->k, &j->step);
    j->t1 = clk_mono_secs();
    j->waited = ps_last_wait_secs(j->w->pc);
    return j->prc;
}

static int job_push(void *arg)
{
    ov_job *j = arg;
    worker *w = j->w;
    j->t0 = clk_mono_secs();
    j->prc = j->ret ? shards_push_pull(&w->sh, w->rb.grads, &j->pm, w->rb.params, j->min_clock, j->clock, 30000,
                                       &j->after, &j->outcome)
                    : shards_push(&w->sh, w->rb.grads, &j->pm, &j->after, &j->outcome);
    j->t1 = clk_mono_secs();
    return j->prc;
}

/* One overlapped step, as its hooks see it. */
typedef struct ov_step {
    worker *w;
    ov_job pull;
    int pulling;       /* parameters stream into this forward pass */
    int from_push;     /* ... from the last push's answer (w->pending) */
    int pushing;       /* the push job runs */
    int64_t predicted; /* the step the pull is for, as the batch was chosen */
    int verdict;       /* a hook stopped the step: what the loop does, or -1 */
    double computing;  /* when the first layer's parameters were in (the compute span's start), or 0 */
} ov_step;

/* The streamed pull, waited for: its spans, and what it says (pulled).
 * A try that started over after some of it was taken, or a step that is
 * not the one the batch was chosen for, pulls again (in the usual way). */
static int ov_pull_done(ov_step *x)
{
    worker *w = x->w;
    overlap_wait(w->ov);
    int torn = overlap_pull_end(w->ov);
    x->pulling = 0;
    if (x->pull.prc != PS_OK)
        return ps_failed(w, x->pull.prc, "pull");
    w->step = x->pull.step;
    pull_spans(w, x->pull.t0, x->pull.t1, x->pull.waited);
    int r = pulled(w);
    if (r == GO_ON && (torn || (w->sync && w->step != x->predicted)))
        return PULL_AGAIN;
    return r;
}

static int step_account(worker *w);

/* The push job, waited for: what it says (push_result), the step counted
 * (step_account); when its answer streamed into this step's forward pass
 * (w->pending), what the parameters it brought say (pulled), or pull again
 * when a try of it started over after some of it was taken. */
static int ov_push_done(worker *w)
{
    ov_job *j = w->ov_push;
    overlap_wait(w->ov);
    overlap_push_end(w->ov);
    if (w->near_end)
        ps_set_retry_ms(w->pc, 2000);
    int torn = j->streams ? overlap_pull_end(w->ov) : 0;
    int pending = w->pending;
    w->pending = 0;
    w->ov_pushes++;
    w->after = j->after;
    int r = push_result(w, j->prc, j->ret, j->t0, j->t1);
    if (r == GO_ON)
        r = step_account(w);
    if (r != GO_ON || !pending)
        return r;
    w->returned = 0; /* they are here (in params, by the layers' takes) */
    if (torn) {
        printf("%s: the push's answer was sent again while it was being read: pulling\n", w->c->name);
        return PULL_AGAIN;
    }
    return pulled(w);
}

static int hook_wait_params(void *arg, int layer)
{
    ov_step *x = arg;
    int rc = x->pulling ? overlap_take_layer(x->w->ov, layer, x->w->rb.params) : 0;
    if (x->computing == 0) /* the wait for the first layer is the pull's, not the compute's */
        x->computing = clk_mono_secs();
    return rc;
}

/* The loss is there: the parameters' transfer is over (their last layer
 * came); the push starts, each layer's gradients going out as the backward
 * pass has them. Its answer streams into the next step when it brings the
 * parameters (async, stale-synchronous) and the next step may start before
 * it is read: with no dropout (whose mask is the step the answer says),
 * not stale-synchronous over several ps (whose answers may be read again
 * after ps 0's wait) and not this task's last step. */
static int hook_loss_done(void *arg, double loss)
{
    ov_step *x = arg;
    worker *w = x->w;
    const train_config *c = w->c;
    w->loss = loss;
    if (x->pulling) {
        int r = x->from_push ? (x->pulling = 0, ov_push_done(w)) : ov_pull_done(x);
        if (r != GO_ON) {
            x->verdict = r;
            return 1;
        }
    }
    ov_job *j = w->ov_push;
    *j = (ov_job){.w = w, .ret = c->one_round_trip && !w->sync, .min_clock = w->ssp >= 0 ? w->k - w->ssp : 0,
                  .clock = w->ssp >= 0 ? w->k : 0};
    j->streams = j->ret && c->layout.n_dropout == 0 && !(w->ssp >= 0 && w->sh.n > 1) &&
                 (w->max_local < 0 || w->local + 1 < w->max_local);
    snprintf(j->id, sizeof(j->id), "t%d-%08x-%lld", c->trainer, w->nonce, (long long)w->pushes++);
    j->pm = (push_meta){c->trainer, w->step, w->loss, c->batch_size, j->id, w->ssp >= 0 ? w->k - 1 : -1};
    if (j->streams)
        overlap_pull_begin(w->ov);
    overlap_push_begin(w->ov);
    overlap_run(w->ov, job_push, j);
    x->pushing = 1;
    return 0;
}

static void hook_grads_done(void *arg, int layer)
{
    ov_step *x = arg;
    if (x->pushing)
        overlap_grads_done(x->w->ov, layer);
}

/* Where this step's parameters come from: the last push's answer, still
 * streaming (w->pending), a pull that streams (sync: when the step it waits
 * for is known, the one after the last push; async and stale-synchronous:
 * with no dropout, whose mask is the step the pull brings), or the usual
 * pull (or a push's answer, read whole) first. */
static int ov_params(ov_step *x)
{
    worker *w = x->w;
    const train_config *c = w->c;
    x->predicted = w->sync ? w->sh.s[0].want : w->step;
    if (w->pending) {
        x->pulling = x->from_push = 1;
    } else if (!w->ov_plain && !w->returned && w->k >= 0 &&
               (w->sync ? x->predicted > 0 : c->layout.n_dropout == 0)) {
        x->pull = (ov_job){.w = w, .k = w->k};
        overlap_pull_begin(w->ov);
        overlap_run(w->ov, job_pull, &x->pull);
        x->pulling = 1;
        w->step = x->predicted;
    } else {
        /* after a pull again the usual pull: it takes the step the ps
         * answers with (a ps that restarted, a step that is not the
         * predicted one), where a streamed one would ask again for the
         * predicted step, which may wait for this task's own gradient */
        w->ov_plain = 0;
        return step_pull(w);
    }
    w->ov_pulls++;
    return GO_ON;
}

/* A step with its transfers beside its compute (ov_params, the hooks
 * above); the next batch is staged while the push goes on. */
static int step_overlapped(worker *w)
{
    const train_config *c = w->c;
    role_bufs *rb = &w->rb;
    ov_step x = {.w = w, .verdict = -1};
    int r = ov_params(&x);
    if (r != GO_ON)
        return r;
    choose_batch(w);
    const model_ctx ctx = {.seed = c->seed, .step = w->step, .example0 = rb->bp.example0[rb->cur],
                           .wait_params = hook_wait_params, .loss_done = hook_loss_done,
                           .grads_done = hook_grads_done, .hook_arg = &x};
    double t0 = clk_mono_secs();
    int rc = model_forward_backward(rb->m, rb->params, rb->bp.x[rb->cur], rb->bp.y[rb->cur], c->batch_size, &ctx,
                                    rb->grads, &w->loss);
    if (x.pulling) { /* a layer's tensors did not come: the transfer says why, or pull again */
        r = x.from_push ? ov_push_done(w) : ov_pull_done(&x);
        w->k--; /* this batch again */
        return r == GO_ON ? PULL_AGAIN : r;
    }
    if (x.verdict >= 0) {
        if (x.verdict == PULL_AGAIN)
            w->k--;
        return x.verdict;
    }
    if (rc != 0) {
        if (x.pushing) {
            overlap_cancel(w->ov);
            overlap_wait(w->ov);
            overlap_push_end(w->ov);
            if (w->ov_push->streams)
                overlap_pull_end(w->ov);
        }
        fprintf(stderr, "workerd: forward/backward failed\n");
        return LEAVE;
    }
    overlap_grads_done(w->ov, 0);
    if (c->step_delay_ms > 0) /* test hook: a slow worker */
        train_sleep((double)c->step_delay_ms / 1000.0);
    step_timeline_add(w->tl, TL_COMPUTE, w->step, x.computing > t0 ? x.computing : t0, clk_mono_secs(), NULL);
    /* the next batch (as predicted) while the push goes on */
    int64_t nk = w->sync ? w->step + 1 : w->k;
    if ((w->max_local < 0 || w->local + 1 < w->max_local) && (!w->sync || nk < c->train_steps)) {
        role_bufs_stage(rb, nk, rb->cur ^ 1);
        w->next_k = nk;
    }
    if (w->ov_push->streams) { /* its answer streams into the next step */
        w->pending = 1;
        return GO_ON;
    }
    return ov_push_done(w);
}

/* The steps until the last one, a stop or the end of this task's data; 0,
 * or -1 to leave at once with w->rc. */
static int run_steps(worker *w)
{
    for (;;) {
        int r = step_begin(w);
        if (r == GO_ON && w->ov) {
            r = step_overlapped(w);
            w->ov_plain = r == PULL_AGAIN;
        } else if (r == GO_ON) {
            r = step_pull(w);
            if (r == GO_ON)
                r = step_compute(w);
            if (r == GO_ON)
                r = step_push(w);
            if (r == GO_ON)
                r = step_account(w);
        }
        if (r != GO_ON && r != PULL_AGAIN && w->pending) {
            /* the last push is still out: its answer, its count */
            int r2 = ov_push_done(w);
            r = r == LEAVE || r2 == LEAVE ? LEAVE : r;
        }
        if (r == END_LOOP)
            return 0;
        if (r == LEAVE)
            return -1;
    }
}

/* Say to every ps this worker is done: a sync step no longer waits for it. */
static void post_done(worker *w)
{
    json_t *done = json_pack("{s:i}", "worker", w->c->trainer);
    for (int i = 0; i < ps_shards(w->pc); i++)
        ps_json(w->pc, i, "POST", "/v1/done", done, 1, NULL);
    json_decref(done);
}

/* The chief's end: wait for the others, pull the result (the moving
 * averages when on), report, export and stop the ps; the exit status. */
static int chief_end(worker *w)
{
    const train_config *c = w->c;
    int rc = 0;
    train_chief_wait_others(c, w->pc);
    int64_t final_step;
    /* the report and the export read the moving averages when on */
    ps_set_moving_average(w->pc, c->moving_average_decay > 0);
    shards_set_wire(&w->sh, WIRE_F32); /* the report and the export: the float32 values */
    if (shards_pull(&w->sh, w->rb.params, -1, 0, &final_step) != PS_OK) {
        fprintf(stderr, "workerd: final pull: %s\n", ps_error(w->pc));
        return 1;
    }
    if (final_report(c, w->rb.m, w->rb.params, &w->rb.ds, final_step) != 0)
        rc = 1;
    if ((c->export_path || c->onnx_path) && export_model(c, w->rb.params, final_step) != 0)
        rc = 1;
    train_chief_stop_ps(c, w->pc);
    return rc;
}

/* After the loop: why it ended, leaving the job, and (the chief) the end;
 * the exit status. */
static int finish(worker *w)
{
    const train_config *c = w->c;
    heartbeat_stop(w->hb);
    w->hb = NULL;
    if (w->ran_out)
        printf("%s: its data ended after %g epochs (%lld local steps, global step %lld): leaving the job\n",
               c->name, c->num_epochs, (long long)w->local, (long long)w->last_step);
    if (w->stopped) {
        progress_clear(&w->rb.bar);
        printf("%s: stopped by a signal after %lld local steps (global step %lld); a restart goes on from the ps\n",
               c->name, (long long)w->local, (long long)w->last_step);
        /* leave the job, so sync steps do not wait for the lease to run out
         * (a restart rejoins); the ps may be gone: a few quick tries only */
        ps_set_abort(w->pc, NULL);
        ps_set_retry_ms(w->pc, 0);
        post_done(w);
        return 0;
    }
    progress_clear(&w->rb.bar);
    post_done(w);
    double secs = clk_mono_secs() - w->rb.t_start;
    printf("%s: finished after %lld local steps in %.2f s: %.1f steps/s\n", c->name,
           (long long)w->local, secs, (double)w->local / secs);
    if (w->ov)
        printf("%s: --overlap: %lld steps' parameters streamed into the forward pass (a pull, or a push's "
               "answer), %lld pushes from the backward pass\n", c->name, (long long)w->ov_pulls,
               (long long)w->ov_pushes);
    fflush(stdout);
    return c->is_chief ? chief_end(w) : 0;
}

static int nothing_to_train(worker *w, int64_t now)
{
    const train_config *c = w->c;
    const char *mode = "", *opt = "", *mine = "";
    json_t *cfg = NULL;
    if (ps_json(w->pc, 0, "GET", "/v1/config", NULL, 1, &cfg) == PS_OK) {
        int sync = json_is_true(json_object_get(cfg, "sync"));
        mode = sync ? "sync, " : "async, ";
        opt = json_string_value(json_object_get(cfg, "optimizer"));
        opt = opt ? opt : "";
        if (sync != c->sync)
            mine = sync ? "; this task's flags say async" : "; this task's flags say sync";
    }
    printf("%s: already at step %lld: nothing to train (ps 0 restored it from the checkpoint in %s, "
           "%s%s%s); to train again, give the ps tasks a new --logdir, or remove %s\n",
           c->name, (long long)now, w->restored_dir, mode, opt, mine, w->restored_dir);
    fflush(stdout);
    json_decref(cfg);
    post_done(w);
    if (c->is_chief) {
        train_chief_wait_others(c, w->pc);
        train_chief_stop_ps(c, w->pc);
    }
    return TRAIN_NOTHING_TO_DO;
}

/* Free what the worker holds; its exit status. */
static int leave(worker *w)
{
    overlap_free(w->ov);
    w->ov = NULL;
    free(w->ov_push);
    heartbeat_stop(w->hb);
    step_timeline_free(w->tl);
    json_decref(w->cfg);
    shards_free(&w->sh);
    ps_client_free(w->pc);
    role_bufs_free(&w->rb);
    return w->rc;
}

int train_worker(const train_config *c)
{
    worker w = {.c = c, .sync = c->sync, .opt_name = optim_name(c->optim.kind), .ssp = -1, .k = -1,
                .next_k = -1, .rc = 1};
    int rc = role_bufs_init(&w.rb, c, 0, 0);
    if (rc)
        return rc;
    if (connect_ps(&w) != 0 || join(&w) != 0)
        return leave(&w);
    {
        /* a rerun on a job already done: nothing to train */
        int doubtful = w.doubtful;
        int64_t now = ps_restored(&w);
        w.doubtful = doubtful && w.restored_step >= 0;
        if (w.restored_step >= c->train_steps && now >= c->train_steps) {
            w.rc = nothing_to_train(&w, now);
            return leave(&w);
        }
    }
    prepare(&w);
    /* from here on a ps that comes back empty or behind is not read over
     * what this task holds */
    w.sh.guard = 0;
    if (run_steps(&w) != 0)
        return leave(&w);
    w.rc = finish(&w);
    return leave(&w);
}
