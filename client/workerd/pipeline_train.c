/* pipeline_train.c - workerd --pipeline_stages=K: model parallelism by
 * layers. The training tasks form a grid of K stages x R replicas
 * (pipeline_plan.h), with no ps: each stage holds only its layers'
 * parameters, gradients and optimizer slots and applies the optimizer to
 * them itself, exactly as --local applies it to the whole model. With R > 1
 * each replica takes its block of the data order (as R sync workers do),
 * and at the end of a step every stage sends its gradient sum to the same
 * stage of the other replicas; each adds the R sums up in replica order (the
 * same floats on every replica) and applies their mean, so R replicas with
 * --batch_size B train what --local trains with R x B. With --allreduce=ring
 * the same stages all-reduce their sums in a ring instead
 * (pipeline_ring.h: the same floats on every replica too, 2 (R - 1) / R of
 * the sum sent a step where the exchange sends R - 1 times it).
 *
 * A step: the batch (--batch_size) is cut into --micro_batches=M
 * micro-batches of batch/M examples. Stage 0 reads the data; the last stage
 * reads the same data order (same seed, same batcher) for the labels and
 * computes the loss. Each stage runs its row of the schedule table
 * (pipeline_schedule.h): a forward takes the micro-batch's activations from
 * stage s-1 (stage 0: the images), runs layers first..last (dropout's mask
 * follows the example, so micro-batches get the masks the whole batch
 * would) and sends its output to stage s+1 (the last stage: the loss and
 * its gradient); a backward takes the gradient of its output from stage s+1
 * (the last stage: the loss's), runs the layers' backward, adds their
 * parameter gradients to the step's sum and sends the input's gradient to
 * stage s-1. The loss's gradient is the mean over the micro-batch; the
 * update applies the sum over the M micro-batches scaled by 1/M, the mean
 * over the whole batch, as --local with the same batch. Each forward keeps
 * its model instance (the activations the backward needs) until its
 * backward: gpipe needs M instances, 1f1b at most K - s.
 *
 * Memory: a stage's instances are of its range layout (model_layout_range:
 * workspace for its layers only), and its parameters, gradients, step sum
 * and optimizer slots are buffers of its own parameters (4 floats per
 * parameter, 6 with replicas (the ring: 4 and a chunk of 1 / R), one more
 * where the backend cannot add a micro-batch's gradients to the sum itself:
 * model_state_bytes). --max_model_bytes=N
 * refuses to start a stage whose buffers exceed N; stage 0 also counts the
 * whole model's parameters it gathers at the end for the test accuracy and
 * --export, after its training buffers are freed: the whole buffer (4 bytes
 * per parameter) and the other stages' parameters twice while they arrive
 * (the HTTP body and the mailbox's copy: 8 bytes per parameter). Its
 * mailbox refuses them (503, the senders retry) until then, so the two
 * never overlap.
 *
 * Every receive waits at most --pipeline_timeout_secs (the first step at
 * least PIPE_START_SECS, while the others start): then the stage says which
 * stage and which message it waited for and exits 1. At the end the other
 * stages send their parameters to stage 0 (the chief), which reports the
 * test accuracy and writes --export. */
#include "workerd/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/random.h>
#include <unistd.h>

#include "clock.h"
#include "crc32c.h"
#include "shards/shards.h"
#include "pipeline/pipeline.h"
#include "workerd/progress.h"
#include "workerd/workerd_flags.h"

#define PIPE_START_SECS 30.0

/* The stage's link, for the receives' abort test: a stop, or a queued send that failed. */
static pipe_link *abort_link;

static int stop_or_send_failed(void)
{
    return train_stop_requested() || (abort_link && pipe_link_failed(abort_link));
}

/* After a wait that stopped: 2 for a signal; 1 after the failed send's message. */
static int stopped_why(const train_config *c, pipe_link *link, int s, int K)
{
    char err[1024];
    if (train_stop_requested() || pipe_link_flush(link, err, sizeof(err)) != -1)
        return 2;
    fprintf(stderr, "workerd: %s (stage %d of %d): %s; stopping\n", c->name, s, K, err);
    return 1;
}

int pipe_plan_for(const train_config *c, pipe_plan *p, char *err, size_t errlen)
{
    if (c->stage_layers)
        return pipe_split_parse(&c->layout, c->stage_layers, c->pipeline_stages, p, err, errlen);
    return pipe_split_balanced(&c->layout, c->pipeline_stages, p, err, errlen);
}

int train_pipeline_flags(train_config *c, const workerd_flags *f)
{
    if (!(f->pipeline_stages || f->stage_layers || f->micro_batches_given || f->pipeline_schedule_given ||
          f->pipeline_timeout_given || f->pipeline_updates_given))
        return 0;
    char err[512];
    const char *bad = NULL;
    pipe_schedule_kind sk = PIPE_1F1B;
    if (!f->pipeline_stages)
        bad = "--stage_layers, --micro_batches, --pipeline_schedule, --pipeline_timeout_secs and --pipeline_updates "
              "need --pipeline_stages";
    else if (f->pipeline_stages < PIPE_MIN_STAGES || f->pipeline_stages > PIPE_MAX_STAGES)
        bad = "--pipeline_stages must be 2 to 8";
    else if (f->local)
        bad = "--pipeline_stages is not for --local (--local is the one-process reference it is compared with)";
    else if (c->ring && (f->ring_tls_cert || f->ring_timeout_given || f->ring_piece_given || f->save_ckpt_given))
        bad = "--pipeline_stages --allreduce=ring runs the ring over the stages' own endpoints (HTTP, "
              "--pipeline_timeout_secs, whole chunks, no checkpoints): not with --ring_tls_cert, "
              "--ring_timeout_secs, --ring_piece_bytes or --save_checkpoint_secs";
    else if (c->ring && strcmp(f->pipeline_updates, "ps") == 0)
        bad = "--allreduce=ring is for --pipeline_updates=local: with the ps, the ps averages the replicas";
    else if (strcmp(f->pipeline_updates, "auto") != 0 && strcmp(f->pipeline_updates, "ps") != 0 &&
             strcmp(f->pipeline_updates, "local") != 0)
        bad = "--pipeline_updates must be ps, local or auto";
    else if (f->micro_batches < 1 || f->micro_batches > PIPE_MAX_MICRO || f->batch % f->micro_batches != 0)
        bad = "--micro_batches must be 1 to 256 and divide --batch_size";
    else if (pipe_schedule_from_name(f->pipeline_schedule, &sk) != 0)
        bad = "--pipeline_schedule must be gpipe or 1f1b";
    else if (!(f->pipeline_timeout > 0) || f->pipeline_timeout > 86400)
        bad = "--pipeline_timeout_secs must be > 0 (and at most a day)";
    if (bad) {
        fprintf(stderr, "workerd: %s\n", bad);
        return 2;
    }
    c->pipeline_stages = f->pipeline_stages;
    c->stage_layers = f->stage_layers;
    c->pipeline_schedule = (int)sk;
    c->micro_batches = f->micro_batches;
    c->pipeline_timeout_secs = f->pipeline_timeout;
    pipe_plan plan;
    if (pipe_plan_for(c, &plan, err, sizeof(err)) != 0) {
        if (f->stage_layers)
            fprintf(stderr, "workerd: --stage_layers=%s: %s\n", f->stage_layers, err);
        else
            fprintf(stderr, "workerd: --pipeline_stages=%d: %s\n", f->pipeline_stages, err);
        return 2;
    }
    return 0;
}

int train_pipeline_cluster_flags(train_config *c, const workerd_flags *f)
{
    const cluster_spec *cs = c->cluster;
    if (c->pipeline_stages) {
        const char *tf = getenv("TF_CONFIG");
        /* the rule: the ps when asked for, or (auto) when ps tasks are named and there is no ring */
        c->pipeline_ps = strcmp(f->pipeline_updates, "ps") == 0 ||
                         (strcmp(f->pipeline_updates, "auto") == 0 && !c->ring &&
                          (f->ps_hosts || (tf && *tf && cs->jobs[JOB_PS].n > 0)));
        const char *bad = NULL;
        if (!c->pipeline_ps && c->moving_average_decay > 0)
            bad = "--moving_average_decay needs the ps tasks: not with --pipeline_updates=local (give --ps_hosts)";
        else if (c->pipeline_ps && ((f->sync_given && !c->sync) || f->issync == 0))
            bad = "--pipeline_stages with the ps is synchronous: not with --sync=0 (the stages' gradients of one "
                  "step must meet one version of the parameters)";
        else if (c->pipeline_ps && f->replicas)
            bad = "--replicas_to_aggregate is not for --pipeline_stages (every stage of every replica counts; the "
                  "chief sets each ps's count)";
        else if (c->pipeline_ps && f->max_model_bytes)
            bad = "--max_model_bytes is not for --pipeline_stages with the ps yet (a stage pulls whole ps shards, "
                  "the chief initializes and pulls the whole model): use --pipeline_updates=local";
        else if (c->pipeline_ps && c->num_epochs > 0)
            bad = "--num_epochs is not for --pipeline_stages (one stage leaving stops the pipeline): use --train_steps";
        if (bad) {
            fprintf(stderr, "workerd: %s\n", bad);
            return 2;
        }
        if (c->pipeline_ps)
            c->sync = 1;
    }
    /* with the ps an evaluator task evaluates the ps's variables, as it does for sync workers */
    if (c->pipeline_stages && ((cs->job == JOB_EVALUATOR && !c->pipeline_ps) || c->n_trainers % c->pipeline_stages != 0 ||
                               c->n_trainers / c->pipeline_stages > PIPE_MAX_REPLICAS)) {
        if (cs->job == JOB_EVALUATOR)
            fprintf(stderr, "workerd: --pipeline_stages without the ps has no evaluator task (the variables are "
                            "the stages' own): the chief prints the test accuracy at the end; with --ps_hosts an "
                            "evaluator task evaluates the ps's\n");
        else if (c->n_trainers % c->pipeline_stages != 0)
            fprintf(stderr, "workerd: --pipeline_stages=%d: %d training tasks (chief + workers) are not whole "
                            "pipelines: they must number K x R (stages x replicas)\n",
                    c->pipeline_stages, c->n_trainers);
        else
            fprintf(stderr, "workerd: --pipeline_stages=%d: %d training tasks would be %d replicas: at most %d\n",
                    c->pipeline_stages, c->n_trainers, c->n_trainers / c->pipeline_stages, PIPE_MAX_REPLICAS);
        return 2;
    }
    return 0;
}

/* The training buffers, freed once the last step is done (before the final
 * parameters travel); what acc was the sum of with one replica is not freed twice. */
typedef struct train_bufs {
    float **grads, **acc, **sum, **s0, **s1, **theirs;
} train_bufs;

static void free_training_state(train_bufs b)
{
    if (*b.sum != *b.acc)
        free(*b.sum);
    free(*b.grads);
    free(*b.acc);
    free(*b.s0);
    free(*b.s1);
    free(*b.theirs);
    *b.grads = *b.acc = *b.sum = *b.s0 = *b.s1 = *b.theirs = NULL;
}

/* What every stage must agree on, as text and its CRC-32C. */
static uint32_t plan_text(const train_config *c, const pipe_plan *p, char *buf, size_t len)
{
    char split[128];
    pipe_plan_format(p, split, sizeof(split));
    snprintf(buf, len, "--model=%s --stage_layers=%s --pipeline_schedule=%s --micro_batches=%d --batch_size=%d "
                       "--seed=%llu --train_steps=%lld",
             c->layout.spec, split, pipe_schedule_name((pipe_schedule_kind)c->pipeline_schedule),
             c->micro_batches, c->batch_size, (unsigned long long)c->seed, (long long)c->train_steps);
    return crc32c(buf, strlen(buf));
}

typedef struct stage_run {
    const train_config *c;
    pipe_link *link;
    pipe_mailbox *box;
    pipe_link_state st;
    int s, K;
    double busy0, t_wait; /* the time spent waiting so far */
} stage_run;

/* Take k from stage `from` into dst, saying what we wait for meanwhile. 0,
 * 1 after the timeout message, 2 on a stop. */
static int receive(stage_run *r, const pipe_key *k, int from, float *dst, int64_t *tag, double wait)
{
    r->st.waiting = 1;
    r->st.wait_key = *k;
    r->st.wait_from = from;
    pipe_link_set_state(r->link, &r->st);
    double t0 = clk_mono_secs();
    int rc = pipe_mailbox_take(r->box, k, dst, tag, t0 + wait, stop_or_send_failed);
    double t1 = clk_mono_secs();
    r->st.idle_secs += t1 - t0;
    r->st.waiting = 0;
    pipe_link_set_state(r->link, &r->st);
    if (rc == -2)
        return stopped_why(r->c, r->link, r->s, r->K);
    if (rc != 0) {
        fprintf(stderr, "workerd: %s (stage %d of %d): no %s of step %lld, %s %d from stage %d (%s) "
                        "within %.0f s (--pipeline_timeout_secs): stage %d died or is stuck; stopping\n",
                r->c->name, r->s, r->K, pipe_dir_name(k->dir), (long long)k->step,
                k->dir == PIPE_PARAMS ? "stage" : "micro-batch", k->mb, from,
                pipe_link_peer(r->link, from), wait, from);
        return 1;
    }
    return 0;
}

/* Send; 0, 1 after a message, 2 on a stop. */
static int send_to(stage_run *r, int to, const pipe_key *k, const float *data, size_t n, int64_t example0,
                   double wait)
{
    char err[1024];
    /* queued: the sender thread sends it while this stage computes on */
    if (pipe_link_post(r->link, 0, to, k, data, n, example0, clk_mono_secs() + wait, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s (stage %d of %d): %s; stopping\n", r->c->name, r->s, r->K, err);
        return 1;
    }
    return 0;
}

/* The gradient sum to / from this stage of replica k; as send_to, receive. */
static int send_replica(stage_run *r, int k, const pipe_key *key, const float *data, size_t n, double wait)
{
    char err[1024];
    if (pipe_link_post(r->link, 1, k, key, data, n, 0, clk_mono_secs() + wait, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s (stage %d of %d): %s; stopping\n", r->c->name, r->s, r->K, err);
        return 1;
    }
    return 0;
}

static int receive_replica(stage_run *r, const pipe_key *key, int k, float *dst, double wait)
{
    double t0 = clk_mono_secs();
    int rc = pipe_mailbox_take(r->box, key, dst, NULL, t0 + wait, stop_or_send_failed);
    r->st.idle_secs += clk_mono_secs() - t0;
    if (rc == -2)
        return stopped_why(r->c, r->link, r->s, r->K);
    if (rc != 0) {
        fprintf(stderr, "workerd: %s (stage %d of %d): no gradient sum of step %lld from replica %d (%s) within "
                        "%.0f s (--pipeline_timeout_secs): that task died or is stuck; stopping\n",
                r->c->name, r->s, r->K, (long long)key->step, k, pipe_link_replica_peer(r->link, k), wait);
        return 1;
    }
    return 0;
}

/* pipeline_ring's send: queued on the link to this stage of replica `to`. */
static int ring_send(void *ctx, int to, const pipe_key *k, const float *data, size_t n, double wait, char *err,
                     size_t errlen)
{
    return pipe_link_post(((stage_run *)ctx)->link, 1, to, k, data, n, 0, clk_mono_secs() + wait, err, errlen);
}

/* --allreduce=ring: buf summed over the R replicas in place; as receive. */
static int ring_reduce(stage_run *r, int R, int replica, int64_t step, float *buf, size_t n, float *tmp,
                       double wait)
{
    char err[1024];
    int t = 0;
    int rc = pipe_ring_allreduce(ring_send, r, r->box, R, replica, step, buf, n, tmp, wait, stop_or_send_failed,
                                 &r->st.idle_secs, &t, err, sizeof(err));
    if (rc == -2)
        return stopped_why(r->c, r->link, r->s, r->K);
    if (rc == -3) {
        fprintf(stderr, "workerd: %s (stage %d of %d): %s; stopping\n", r->c->name, r->s, r->K, err);
        return 1;
    }
    if (rc != 0) {
        int left = (replica + R - 1) % R;
        fprintf(stderr, "workerd: %s (stage %d of %d): no ring chunk of step %lld, ring step %d, from replica %d "
                        "(%s) within %.0f s (--pipeline_timeout_secs): that task died or is stuck; stopping\n",
                r->c->name, r->s, r->K, (long long)step, t, left, pipe_link_replica_peer(r->link, left), wait);
        return 1;
    }
    return 0;
}

static json_t *info_json(const train_config *c, const pipe_plan *p, const pipe_schedule *sch,
                         const pipe_grid *g, const char *plan)
{
    char split[128];
    pipe_plan_format(p, split, sizeof(split));
    json_t *table = json_array(), *stages = json_array();
    for (int k = 0; k < p->stages; k++) {
        char row[PIPE_MAX_MICRO * 10];
        pipe_schedule_format(sch, k, row, sizeof(row));
        json_array_append_new(table, json_string(row));
        json_array_append_new(stages, json_pack("{s:[i,i],s:I,s:i}", "layers", p->first[k], p->last[k],
                                                "flops_per_example", (json_int_t)p->cost[k],
                                                "max_inflight", sch->max_inflight[k]));
    }
    return json_pack("{s:i,s:i,s:i,s:i,s:s,s:s,s:s,s:i,s:i,s:o,s:o,s:s}", "stage", g->stage, "stages",
                     p->stages, "replica", g->replica, "replicas", g->replicas, "model", c->layout.spec, "stage_layers", split, "schedule",
                     pipe_schedule_name(sch->kind), "micro_batches", sch->micro, "batch_size",
                     c->batch_size, "split", stages, "table", table, "plan", plan);
}

/* --pipeline_updates=ps: the ps tasks restored a checkpoint at or past
 * --train_steps (the same job run again on its --logdir), st being ps 0's
 * /v1/status: say so and what to do, leave the job; the chief waits for
 * the other stages to leave, then stops the ps tasks (unless --keep_ps).
 * Nothing is trained, reported or exported (as train.c's nothing_to_train). */
static void nothing_to_train(const train_config *c, ps_client *pc, const json_t *st, int64_t now)
{
    const char *file =
        json_string_value(json_object_get(json_object_get(json_object_get(st, "checkpoint"), "restored_from"), "file"));
    char dir[256];
    snprintf(dir, sizeof(dir), "%s", file ? file : "its --logdir");
    char *slash = file ? strrchr(dir, '/') : NULL;
    if (slash && slash != dir)
        *slash = '\0';
    printf("%s: already at step %lld: nothing to train (ps 0 restored it from the checkpoint in %s); to train "
           "again, give the ps tasks a new --logdir, or remove %s\n",
           c->name, (long long)now, dir, dir);
    fflush(stdout);
    json_t *done = json_pack("{s:i}", "worker", c->trainer);
    for (int i = 0; i < ps_shards(pc); i++)
        ps_json(pc, i, "POST", "/v1/done", done, 1, NULL);
    json_decref(done);
    if (c->is_chief) {
        train_chief_wait_others(c, pc);
        train_chief_stop_ps(c, pc);
    }
}

/* --pipeline_updates=ps, at the start: the ps client, this stage's pieces,
 * the chief's set-up as a sync chief's (the whole model initialized once,
 * each ps told how many pushes make its step) or the others' wait for it,
 * and the step to start from (ps 0's: a restart goes on from the ps's
 * checkpoint). 0, or the exit status after a message. */
static int ps_start(const train_config *c, const size_t *poff, const size_t *pn, int K, int R, int s,
                    ps_client **pcp, pipe_ps *pps, int64_t *step0)
{
    char err[512];
    const model_layout *L = &c->layout;
    ps_client *pc = *pcp = train_connect_ps(c, c->timeout_ms);
    if (!pc)
        return 1;
    if (pipe_ps_init(pps, pc, L, c->placement, c->partition_bytes, poff[s], pn[s], err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 1;
    }
    if (c->is_chief) {
        shards sh;
        int reps[pps->pl.n_ps];
        float *whole = NULL;
        pipe_ps_pushers(&pps->pl, poff, pn, K, R, reps);
        if (shards_init(&sh, pc, L, c->placement, c->partition_bytes, err, sizeof(err)) != 0 ||
            !(whole = calloc(L->n_params ? L->n_params : 1, sizeof(float)))) {
            fprintf(stderr, "workerd: out of memory for the chief's initialization\n");
            shards_free(&sh);
            return 1;
        }
        train_config cc = *c;
        cc.ps_replicas = reps;
        cc.replicas_to_aggregate = K * R;
        int rc = train_chief_setup(&cc, pc, &sh, whole); /* the whole init, freed at once */
        free(whole);
        shards_free(&sh);
        if (rc != 0)
            return rc;
    } else {
        train_wait_for_all(c, pc, "/readyz", "the chief to initialize the variables");
        shards mine = {.pl = pps->pl}; /* the check reads the placement alone */
        if (train_check_placement(c, pc, &mine) != 0)
            return 2;
    }
    ps_set_retry_ms(pc, (long)(c->retry_secs * 1000));
    ps_set_abort(pc, train_stop_requested);
    json_t *st = NULL;
    if (ps_status(pc, 0, &st) != PS_OK || !json_is_integer(json_object_get(st, "global_step"))) {
        fprintf(stderr, "workerd: reading ps 0's global_step: %s\n", ps_error(pc));
        json_decref(st);
        return 1;
    }
    *step0 = json_integer_value(json_object_get(st, "global_step"));
    if (*step0 >= c->train_steps) {
        nothing_to_train(c, pc, st, *step0);
        json_decref(st);
        return TRAIN_NOTHING_TO_DO;
    }
    json_decref(st);
    char where[256];
    int at = 0;
    for (int i = 0; i < pps->n_sh && at < (int)sizeof(where) - 16; i++)
        at += snprintf(where + at, sizeof(where) - (size_t)at, "%s%d", i ? "," : "", pps->sh[i].ps);
    printf("%s: stage %d's variables (%zu parameters) on ps %s; sync: the ps averages each over the %d replica%s; "
           "from global step %lld\n",
           c->name, s, pn[s], pps->n_sh ? where : "(none)", R, R > 1 ? "s" : "", (long long)*step0);
    fflush(stdout);
    return 0;
}

/* --pipeline_updates=ps, at the end: every ps told this task is done; the
 * chief waits for the others, pulls the whole model (the moving averages
 * when on), reports, exports and stops the ps tasks (unless --keep_ps).
 * The report evaluates in batches of eval_batch (--batch_size, not a
 * micro-batch: fewer, larger GEMMs; the CNN's 15,000 examples took 4.5 s
 * instead of 5.1 here). The exit status. */
static int ps_finish(const train_config *c, ps_client *pc, const idx_dataset *ds, int eval_batch)
{
    char err[512];
    ps_set_abort(pc, NULL);
    json_t *done = json_pack("{s:i}", "worker", c->trainer);
    for (int i = 0; i < ps_shards(pc); i++)
        ps_json(pc, i, "POST", "/v1/done", done, 1, NULL);
    json_decref(done);
    if (!c->is_chief)
        return 0;
    train_chief_wait_others(c, pc);
    const model_layout *L = &c->layout;
    shards sh;
    float *whole = NULL;
    model *eval = NULL;
    int64_t fs = -1;
    int rc = 1;
    if (shards_init(&sh, pc, L, c->placement, c->partition_bytes, err, sizeof(err)) != 0 ||
        !(whole = malloc(sizeof(float) * (L->n_params ? L->n_params : 1))) ||
        !(eval = model_new(model_device_backend(), L, eval_batch, err, sizeof(err)))) {
        fprintf(stderr, "workerd: %s\n", eval || !whole ? "out of memory for the whole model" : err);
        goto out;
    }
    if (shards_pull(&sh, whole, c->train_steps, 30000, &fs) != PS_OK ||
        (c->moving_average_decay > 0 &&
         (ps_set_moving_average(pc, 1), shards_pull(&sh, whole, -1, 0, &fs)) != PS_OK)) {
        fprintf(stderr, "workerd: final pull: %s\n", ps_error(pc));
        goto out;
    }
    rc = 0;
    if (final_report(c, eval, whole, ds, fs) != 0)
        rc = 1;
    if ((c->export_path || c->onnx_path) && export_model(c, whole, fs) != 0)
        rc = 1;
    train_chief_stop_ps(c, pc);
out:
    model_free(eval);
    free(whole);
    shards_free(&sh);
    return rc;
}

/* One stage's training, as train_pipeline's steps share it: the plan and
 * what follows from it for this stage, its buffers, its link and ps
 * client, and the step loop's state and clocks. */
typedef struct stage_train {
    const train_config *c;
    const model_layout *L;
    int K, M, B, mb;
    pipe_grid g;
    pipe_plan p;
    pipe_schedule sch;
    int s, first, last, is_last, R;
    size_t in_n, out_n, np;
    size_t poff[PIPE_MAX_STAGES], pn[PIPE_MAX_STAGES];
    model_layout RL; /* this stage's layers as a model: its instances and buffers are of them alone */
    int rlast, adds;
    int reduce, xchg, ringx, floats;
    size_t chunk_n;
    char plan[1024];
    uint32_t plan_id;
    idx_dataset ds;
    int have_data, P;
    model *inst[PIPE_MAX_MICRO];
    float *inbuf[PIPE_MAX_MICRO], *dlog[PIPE_MAX_MICRO];
    int owner[PIPE_MAX_MICRO];
    float *params, *grads, *acc, *sum, *theirs_g, *s0, *s1;
    float *whole; /* stage 0 at the end: every stage's parameters */
    model *eval;
    float *out, *dout, *din, *x;
    uint8_t *y;
    batcher b;
    pipe_mailbox *box;
    pipe_link *link;
    cluster_addr *peers, *rpeers;
    ps_client *pc;
    pipe_ps pps;
    heartbeat *hb;
    int64_t step0, step, example0;
    unsigned nonce;
    stage_run r;
    double tmo;
    double loss_sum, mb_loss[PIPE_MAX_MICRO]; /* the micro-batches' losses, passed back with the gradients */
    double t_start, t_log;
    /* the steady state: from the end of step 0 (the start's waits left out) */
    double t_steady, busy_steady, idle_steady;
    uint64_t msgs;
    progress bar;
} stage_train;

/* This task's place in the grid, the split, the schedule, and what follows
 * for its stage (its layers, parameters and buffers' sizes, how the
 * replicas' sums meet): 0, or 2 after a message. */
static int plan_stage(stage_train *t)
{
    char err[1024];
    const train_config *c = t->c;
    const model_layout *L = t->L = &c->layout;
    const int K = t->K = c->pipeline_stages, M = t->M = c->micro_batches;
    t->B = c->batch_size;
    t->mb = t->B / M;
    if (pipe_grid_place(c->n_trainers, K, c->trainer, &t->g, err, sizeof(err)) != 0 ||
        pipe_plan_for(c, &t->p, err, sizeof(err)) != 0 ||
        pipe_schedule_build(&t->sch, (pipe_schedule_kind)c->pipeline_schedule, K, M, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    const int s = t->s = t->g.stage, first = t->first = t->p.first[s], last = t->last = t->p.last[s];
    t->is_last = s == K - 1;
    const int R = t->R = t->g.replicas;
    t->in_n = L->layers[first].in_numel;
    t->out_n = L->layers[last].out_numel;
    t->np = L->n_params;
    for (int k = 0; k < K; k++)
        pipe_stage_params(L, &t->p, k, &t->poff[k], &t->pn[k]);
    if (model_layout_range(L, first, last, &t->RL, err, sizeof(err)) != 0 || t->RL.n_params != t->pn[s]) {
        fprintf(stderr, "workerd: %s\n", err);
        pipe_schedule_free(&t->sch);
        return 2;
    }
    t->rlast = last - first;
    t->adds = model_adds_gradients(model_device_backend());
    /* with the ps, the replicas' sums are the ps's; without, the ring sums in
     * place with a chunk's buffer, the exchange into a buffer of its own with one for each sum received;
     * a stage without parameters (a ReLU and a pool, say) has nothing to add up */
    t->reduce = R > 1 && !c->pipeline_ps && t->pn[s] > 0;
    t->xchg = t->reduce && !c->ring;
    t->ringx = t->reduce && c->ring;
    t->chunk_n = t->ringx ? t->pn[s] / (size_t)R + 1 : 0;
    t->floats = (t->xchg ? MODEL_STATE_FLOATS_STAGE_REPLICAS : MODEL_STATE_FLOATS_STAGE) + !t->adds;
    return 0;
}

/* --max_model_bytes: this stage's buffers, and stage 0's gather at the
 * end, within it; 0, or 2 after a message. */
static int check_model_bytes(const stage_train *t)
{
    const train_config *c = t->c;
    const int s = t->s, K = t->K;
    const size_t np = t->np;
    uint64_t need = model_state_bytes(t->pn[s], t->floats) + t->chunk_n * sizeof(float);
    /* the whole buffer, and the others' parameters twice while they arrive (the HTTP body, the mailbox's copy) */
    uint64_t gather = s == 0 ? (uint64_t)(np + 2 * (np - t->pn[0])) * sizeof(float) : 0;
    if (c->max_model_bytes && (need > c->max_model_bytes || gather > c->max_model_bytes)) {
        if (need > c->max_model_bytes)
            fprintf(stderr, "workerd: %s (stage %d of %d): layers %d-%d hold %zu parameters, %llu bytes with "
                            "their gradients, step sum and optimizer slots (%d floats each%s): more than "
                            "--max_model_bytes=%llu; split the model into more stages\n",
                    c->name, s, K, t->first, t->last, t->pn[s], (unsigned long long)need, t->floats,
                    t->ringx ? ", and the ring's chunk" : "", (unsigned long long)c->max_model_bytes);
        else
            fprintf(stderr, "workerd: %s (stage 0 of %d): the whole model's %zu parameters, which stage 0 gathers "
                            "at the end (%llu bytes with the two copies of the messages they arrive in), are more than "
                            "--max_model_bytes=%llu\n",
                    c->name, K, np, (unsigned long long)gather, (unsigned long long)c->max_model_bytes);
        return 2;
    }
    return 0;
}

/* The stage's buffers, its model instances (one per micro-batch in
 * flight), the data order and the mailbox: 0, or 1 after a message. */
static int alloc_stage(stage_train *t)
{
    char err[1024];
    const train_config *c = t->c;
    const int s = t->s, is_last = t->is_last, mb = t->mb, have_data = t->have_data;
    const size_t *pn = t->pn, in_n = t->in_n, out_n = t->out_n;
    t->P = t->sch.max_inflight[s];
    t->params = calloc(pn[s] ? pn[s] : 1, sizeof(float)); /* this stage's run of the whole buffer */
    /* a micro-batch's gradients, before they are added to the step's sum: only
     * for a backend that cannot add them itself (the CPU's sgemm does) */
    t->grads = t->adds ? NULL : calloc(pn[s] ? pn[s] : 1, sizeof(float));
    t->acc = calloc(pn[s] ? pn[s] : 1, sizeof(float));
    /* with the ps, the optimizer slots are the ps's */
    const size_t nslot = c->pipeline_ps || !pn[s] ? 1 : pn[s];
    t->sum = t->xchg ? calloc(pn[s] ? pn[s] : 1, sizeof(float)) : t->acc; /* the replicas' sums added up */
    /* the exchange: each replica's sum as it comes; the ring: a chunk */
    t->theirs_g = t->xchg ? calloc(pn[s] ? pn[s] : 1, sizeof(float)) : t->ringx ? calloc(t->chunk_n, sizeof(float)) : NULL;
    t->s0 = calloc(nslot, sizeof(float));
    t->s1 = calloc(nslot, sizeof(float));
    t->out = malloc(sizeof(float) * (size_t)mb * out_n);
    t->dout = malloc(sizeof(float) * (size_t)mb * out_n);
    t->din = malloc(sizeof(float) * (size_t)mb * in_n);
    t->x = have_data ? malloc(sizeof(float) * (size_t)t->B * t->L->n_in) : NULL;
    t->y = have_data ? malloc((size_t)t->B) : NULL;
    int ok = t->params && (t->adds || t->grads) && t->acc && t->sum && (!(t->xchg || t->ringx) || t->theirs_g) &&
             t->s0 && t->s1 && t->out && t->dout && t->din && (!have_data || (t->x && t->y));
    for (int i = 0; ok && i < t->P; i++) {
        t->owner[i] = -1;
        t->inst[i] = model_new(model_device_backend(), &t->RL, mb, err, sizeof(err));
        if (!t->inst[i]) {
            fprintf(stderr, "workerd: %s\n", err);
            return 1;
        }
        if (s > 0 && !(t->inbuf[i] = malloc(sizeof(float) * (size_t)mb * in_n)))
            ok = 0;
        if (is_last && !(t->dlog[i] = malloc(sizeof(float) * (size_t)mb * out_n)))
            ok = 0;
    }
    if (ok && have_data && batcher_init(&t->b, &t->ds.train, c->seed, t->g.replica, t->g.replicas) != 0)
        ok = 0;
    if (ok)
        t->box = pipe_mailbox_new(t->M, s > 0 ? (size_t)mb * in_n : 0, is_last ? 0 : (size_t)mb * out_n, t->K,
                                  s == 0 ? pn : NULL, t->R, pn[s]);
    if (!ok || !t->box) {
        fprintf(stderr, "workerd: out of memory\n");
        return 1;
    }
    if (t->ringx)
        pipe_mailbox_set_ring(t->box, t->g.replica);
    return 0;
}

/* The addresses of this replica's stages and of this stage's replicas; 0,
 * or 1 after a message. */
static int place_peers(stage_train *t)
{
    const pipe_grid *g = &t->g;
    /* this replica's stages, by the grid rule: the chief task (when there is one), then the workers */
    const cluster_spec *cs = t->c->cluster;
    int has_chief = cs->jobs[JOB_CHIEF].n > 0;
    if (!(t->peers = calloc((size_t)t->K, sizeof(*t->peers))) || !(t->rpeers = calloc((size_t)t->R, sizeof(*t->rpeers)))) {
        fprintf(stderr, "workerd: out of memory\n");
        return 1;
    }
#define TASK_ADDR(t) (has_chief ? ((t) == 0 ? cs->jobs[JOB_CHIEF].tasks[0] : cs->jobs[JOB_WORKER].tasks[(t) - 1]) \
                                : cs->jobs[JOB_WORKER].tasks[(t)])
    for (int k = 0; k < t->K; k++)
        t->peers[k] = TASK_ADDR(pipe_grid_task(g, k, g->replica));
    for (int k = 0; k < t->R; k++)
        t->rpeers[k] = TASK_ADDR(pipe_grid_task(g, t->s, k));
#undef TASK_ADDR
    return 0;
}

/* The parameters' start: with the ps, its client, the chief's set-up and
 * the step to go on from, a heartbeat and the push ids' nonce; else this
 * stage's run of the whole initialization. 0, or the exit status. */
static int start_params(stage_train *t)
{
    const train_config *c = t->c;
    if (c->pipeline_ps) {
        /* the variables are the ps's: each step pulls them. Before the
         * endpoint opens: a neighbour's first message (of a restored step)
         * finds the mailbox at that step, or retries until it listens */
        int rc = ps_start(c, t->poff, t->pn, t->K, t->R, t->s, &t->pc, &t->pps, &t->step0);
        if (rc != 0)
            return rc;
        pipe_mailbox_set_step(t->box, t->step0);
        t->hb = heartbeat_start(train_connect_ps(c, 5000), c->trainer, 1000); /* a long step is no dead stage */
        if (getrandom(&t->nonce, sizeof(t->nonce), 0) != sizeof(t->nonce))
            t->nonce = (unsigned)getpid();
    } else {
        /* the parameters: this stage's run of the whole initialization */
        model_init_params(&t->RL, t->params, c->seed);
    }
    return 0;
}

/* The stage's endpoint and its link to the others, and the start lines;
 * 0, or 1 after a message. */
static int open_link(stage_train *t)
{
    char err[1024];
    const train_config *c = t->c;
    const int s = t->s, K = t->K, R = t->R;
    pipe_link_options lo = {.peers = t->peers, .stages = K, .stage = s, .mailbox = t->box,
                            .replica_peers = t->rpeers, .replicas = R, .replica = t->g.replica,
                            .plan_id = t->plan_id, .plan_text = t->plan, .token = c->token,
                            .name = c->name, .abort = train_stop_requested,
                            .info = info_json(c, &t->p, &t->sch, &t->g, t->plan)};
    if (!(t->link = pipe_link_new(&lo, err, sizeof(err)))) {
        fprintf(stderr, "workerd: pipeline: %s\n", err);
        return 1;
    }
    abort_link = t->link;
    char split[128], row[PIPE_MAX_MICRO * 10];
    pipe_plan_format(&t->p, split, sizeof(split));
    pipe_schedule_format(&t->sch, s, row, sizeof(row));
    printf("%s: pipeline stage %d of %d, replica %d of %d (layers %d-%d of %s, split %s), %s, %d micro-batches "
           "of %d, %s, until step %lld; serving on %s; %s\n",
           c->name, s, K, t->g.replica, R, t->first, t->last, t->L->spec, split, pipe_schedule_name(t->sch.kind),
           t->M, t->mb, optim_name(c->optim.kind), (long long)c->train_steps, pipe_link_peer(t->link, s),
           model_device_describe(c->threads));
    printf("%s: table %s (at most %d in flight)\n", c->name, row, t->P);
    if (R > 1 && !c->pipeline_ps)
        printf("%s: the %d replicas' gradient sums of stage %d (%zu floats): %s\n", c->name, R, s, t->pn[s],
               !t->reduce ? "none (the stage has no parameters)"
               : t->ringx ? "a ring all-reduce (--allreduce=ring: each sends 2(R-1)/R of its sum a step)"
                          : "exchanged (each sends its sum to the R - 1 others)");
    fflush(stdout);
    return 0;
}

/* --pipeline_updates=ps: the step's parameters, once every stage pushed
 * the last step's gradients; 0, 1 after a message, 2 on a stop. */
static int pull_params(stage_train *t, int64_t step, double wait)
{
    char err[1024];
    double t0 = clk_mono_secs();
    int64_t got;
    int e = pipe_ps_pull(&t->pps, t->params, step, wait, stop_or_send_failed, &got, err, sizeof(err));
    t->r.st.idle_secs += clk_mono_secs() - t0;
    if (e == -2) /* a signal, or a queued send that failed (a neighbour died): say which */
        return stopped_why(t->c, t->link, t->s, t->K);
    if (e) {
        char who[512];
        pipe_ps_missing(&t->pps, t->poff, t->pn, t->K, t->R, step, who, sizeof(who));
        fprintf(stderr, "workerd: %s (stage %d of %d): %s%s; stopping\n", t->c->name, t->s, t->K, err, who);
        return 1;
    }
    return 0;
}

/* A forward of micro-batch j: its input (stage 0: the images; else the
 * activations from stage s-1), the layers, the output to stage s+1 (the
 * last stage: the loss and its gradient); 0, 1 after a message, 2 on a stop. */
static int forward_slot(stage_train *t, int64_t step, int j, double wait)
{
    const train_config *c = t->c;
    const int s = t->s, mb = t->mb, is_last = t->is_last;
    int q, e;
    for (q = 0; q < t->P && t->owner[q] >= 0; q++) {
    }
    t->owner[q] = j;
    const float *in = s == 0 ? t->x + (size_t)j * mb * t->L->n_in : t->inbuf[q];
    /* the micro-batch's first example: from the data, or (a stage
     * without it) from the activations' sender */
    int64_t ex0 = t->example0 + (int64_t)j * mb, theirs = ex0;
    if (s > 0 && (e = receive(&t->r, &(pipe_key){step, j, PIPE_ACT}, s - 1, t->inbuf[q], &theirs, wait)) != 0)
        return e;
    if (!t->have_data) {
        ex0 = theirs;
    } else if (theirs != ex0) {
        fprintf(stderr, "workerd: %s (stage %d): stage %d sent micro-batch %d of step %lld from example %lld "
                        "of its data order, this stage reads example %lld there: start every stage with "
                        "the same --data_dir and --seed\n",
                c->name, s, s - 1, j, (long long)step, (long long)theirs, (long long)ex0);
        return 1;
    }
    double t0 = clk_mono_secs();
    const model_ctx ctx = {.seed = c->seed, .step = step, .example0 = ex0};
    double loss = 0;
    if (model_forward_range(t->inst[q], 0, t->rlast, t->params, in, mb, &ctx, t->out) != 0 ||
        (is_last && model_loss_head(t->inst[q], t->out, t->y + (size_t)j * mb, mb, t->dlog[q], &loss) != 0)) {
        fprintf(stderr, "workerd: %s: the forward of step %lld, micro-batch %d failed\n", c->name,
                (long long)step, j);
        return 1;
    }
    t->loss_sum += loss;
    t->mb_loss[j] = loss;
    t->r.st.busy_secs += clk_mono_secs() - t0;
    if (!is_last)
        return send_to(&t->r, s + 1, &(pipe_key){step, j, PIPE_ACT}, t->out, (size_t)mb * t->out_n, ex0, wait);
    return 0;
}

/* A backward of micro-batch j: its output's gradient (from stage s+1, or
 * the loss's), the layers' backward into the step's sum, the input's
 * gradient to stage s-1; 0, 1 after a message, 2 on a stop. */
static int backward_slot(stage_train *t, int64_t step, int j, double wait)
{
    const train_config *c = t->c;
    const int s = t->s, mb = t->mb, is_last = t->is_last;
    int q, e;
    for (q = 0; q < t->P && t->owner[q] != j; q++) {
    }
    const float *d = is_last ? t->dlog[q] : t->dout;
    int64_t ltag;
    if (!is_last && (e = receive(&t->r, &(pipe_key){step, j, PIPE_GRAD}, s + 1, t->dout, &ltag, wait)) != 0)
        return e;
    if (!is_last) {
        t->mb_loss[j] = pipe_tag_loss(ltag); /* a NaN when the stage after did not name it */
        t->loss_sum += t->mb_loss[j];
    }
    double t0 = clk_mono_secs();
    /* the micro-batch's parameter gradients are added to the step's sum (acc) */
    if (model_backward_range_add(t->inst[q], 0, t->rlast, t->params, d, mb, s > 0 ? t->din : NULL, t->acc,
                                 t->grads) != 0) {
        fprintf(stderr, "workerd: %s: the backward of step %lld, micro-batch %d failed\n", c->name,
                (long long)step, j);
        return 1;
    }
    t->owner[q] = -1;
    t->r.st.busy_secs += clk_mono_secs() - t0;
    if (s > 0)
        return send_to(&t->r, s - 1, &(pipe_key){step, j, PIPE_GRAD}, t->din, (size_t)mb * t->in_n,
                       pipe_loss_tag(t->mb_loss[j]), wait);
    return 0;
}

/* --pipeline_updates=ps: the mean over the micro-batches to the ps, which
 * averages the R replicas'; 0, 1 after a message, 2 on a stop. */
static int push_grads(stage_train *t, int64_t step)
{
    char err[1024];
    const train_config *c = t->c;
    const float inv = 1.0f / (float)t->M;
    for (size_t k = 0; k < t->pn[t->s]; k++)
        t->acc[k] *= inv; /* in place: the next step starts its sum from 0 */
    char id[64];
    snprintf(id, sizeof(id), "t%d-%08x-%lld", c->trainer, t->nonce, (long long)step);
    double t0 = clk_mono_secs();
    if (pipe_ps_push(&t->pps, t->acc, c->trainer, step, t->B, t->loss_sum / t->M, id, err,
                     sizeof(err)) != 0) {
        if (train_stop_requested())
            return 2;
        fprintf(stderr, "workerd: %s (stage %d of %d): %s; stopping\n", c->name, t->s, t->K, err);
        return 1;
    }
    t->r.st.idle_secs += clk_mono_secs() - t0;
    return 0;
}

/* The replicas' sums: every stage adds the R sums in replica order (the
 * exchange into sum, the ring in acc); 0, 1 after a message, 2 on a stop. */
static int reduce_replicas(stage_train *t, int64_t step, double wait)
{
    const size_t n = t->pn[t->s];
    const int R = t->R, replica = t->g.replica;
    if (t->xchg) {
        int e = 0;
        const pipe_key rk = {step, replica, PIPE_REDUCE};
        for (int k = 0; k < R && !e; k++)
            if (k != replica)
                e = send_replica(&t->r, k, &rk, t->acc, n, wait);
        memset(t->sum, 0, sizeof(float) * n);
        for (int k = 0; k < R && !e; k++) {
            const float *src = t->acc;
            if (k != replica) {
                e = receive_replica(&t->r, &(pipe_key){step, k, PIPE_REDUCE}, k, t->theirs_g, wait);
                src = t->theirs_g;
            }
            for (size_t u = 0; u < n && !e; u++)
                t->sum[u] += src[u];
        }
        return e;
    }
    if (t->ringx)
        return ring_reduce(&t->r, R, replica, step, t->acc, n, t->theirs_g, wait);
    return 0;
}

/* Without the ps: the optimizer on this stage's layers with the mean over
 * the batch (all replicas'): the sum over the micro-batches / (M R). */
static void apply_update(stage_train *t, int64_t step)
{
    const train_config *c = t->c;
    double t0 = clk_mono_secs();
    const float scale = 1.0f / (float)(t->M * t->R);
    for (int k = 0; k < t->RL.n_tensors && !c->pipeline_ps; k++) {
        const model_tensor *mt = &t->RL.tensors[k];
        optim_apply(&c->optim, t->params + mt->offset, t->params + mt->offset, t->sum + mt->offset, scale,
                    t->s0 + mt->offset, t->s1 + mt->offset, step + 1, step, mt->numel);
    }
    t->r.st.busy_secs += clk_mono_secs() - t0;
}

/* After a step: the link's state (for /v1/status and the page), the
 * message count, the steady state's start, and the last stage's progress
 * bar or log line. */
static void step_done(stage_train *t, int64_t step)
{
    const train_config *c = t->c;
    const int M = t->M, B = t->B, R = t->R;
    /* every stage has the micro-batches' losses (the last stage computed them, the
     * gradients brought them back): its replica's step loss, for /v1/status and the page */
    double loss = t->loss_sum / M;
    t->r.st.loss = loss;
    t->r.st.step = step + 1;
    pipe_link_set_state(t->link, &t->r.st);
    t->msgs += (uint64_t)(t->s > 0) * M + (uint64_t)(!t->is_last) * M +
               (uint64_t)(t->xchg ? R - 1 : t->ringx ? ring_steps(R) : 0);
    if (step == t->step0) {
        t->t_steady = clk_mono_secs();
        t->busy_steady = t->r.st.busy_secs;
        t->idle_steady = t->r.st.idle_secs;
    }
    if (t->is_last) {
        progress_update(&t->bar, step + 1, loss, (double)((step + 1) * B) / (clk_mono_secs() - t->t_start));
        if (!t->bar.on && c->log_every > 0 && (step + 1) % c->log_every == 0) {
            double tn = clk_mono_secs();
            printf("%s: step %lld loss %.4f examples/s %.0f\n", c->name, (long long)(step + 1), loss,
                   (double)c->log_every * B / (tn - t->t_log));
            fflush(stdout);
            t->t_log = tn;
        }
    }
}

/* One step: the batch, (the ps's parameters,) this stage's row of the
 * schedule table, (the push to the ps,) the replicas' sums, the update;
 * 0, 1 after a message, 2 on a stop. */
static int run_step(stage_train *t, int64_t step)
{
    const train_config *c = t->c;
    double wait = step == t->step0 && t->tmo < PIPE_START_SECS ? PIPE_START_SECS : t->tmo;
    pipe_mailbox_set_step(t->box, step);
    t->r.st.step = step;
    if (t->have_data)
        batcher_at(&t->b, step, t->B, t->ds.n_features, t->x, t->y, &t->example0);
    int e;
    if (c->pipeline_ps && (e = pull_params(t, step, wait)) != 0)
        return e;
    memset(t->acc, 0, sizeof(float) * t->pn[t->s]);
    t->loss_sum = 0;
    for (int i = 0; i < t->sch.n; i++) {
        const pipe_slot *sl = pipe_schedule_at(&t->sch, t->s, i);
        t->r.st.slot = i;
        e = sl->op == PIPE_FWD ? forward_slot(t, step, sl->mb, wait) : backward_slot(t, step, sl->mb, wait);
        if (e)
            return e;
    }
    if (c->pipeline_ps && (e = push_grads(t, step)) != 0)
        return e;
    if ((e = reduce_replicas(t, step, wait)) != 0)
        return e;
    apply_update(t, step);
    step_done(t, step);
    return 0;
}

/* The steps from step0 to --train_steps (t->step: where they ended), then
 * the link's state done: 0 all done, 1 failed (after a message), 2
 * stopped by a signal (after its line). */
static int run_steps(stage_train *t)
{
    const train_config *c = t->c;
    t->r = (stage_run){.c = c, .link = t->link, .box = t->box, .s = t->s, .K = t->K};
    t->r.st.loss = NAN;
    t->tmo = c->pipeline_timeout_secs;
    t->t_start = clk_mono_secs();
    t->t_log = t->t_start;
    t->step = t->step0;
    t->example0 = 0;
    t->t_steady = t->t_start;
    t->busy_steady = t->idle_steady = 0;
    t->msgs = 0;
    progress_init(&t->bar, c->name, c->train_steps, t->is_last ? -1 : 0);
    int e = 0;
    for (; t->step < c->train_steps; t->step++) {
        if (train_stop_requested()) {
            e = 2;
            break;
        }
        if ((e = run_step(t, t->step)) != 0)
            break;
    }
    progress_clear(&t->bar);
    t->r.st.done = 1;
    pipe_link_set_state(t->link, &t->r.st);
    if (e == 2)
        printf("%s: stopped by a signal at step %lld (stage %d of %d); the pipeline stops\n", c->name,
               (long long)t->step, t->s, t->K);
    return e;
}

/* The stage's figures: the whole run, and the steady state (steps 2..). */
static void report_times(const stage_train *t, double secs, double steady)
{
    const train_config *c = t->c;
    const int s = t->s;
    double busy1 = t->r.st.busy_secs - t->busy_steady, idle1 = t->r.st.idle_secs - t->idle_steady;
    printf("%s: stage %d finished %lld steps in %.2f s: %.2f steps/s, busy %.2f s, idle %.2f s (%.1f%% idle), "
           "%llu bytes sent\n",
           c->name, s, (long long)c->train_steps, secs, secs > 0 ? (double)c->train_steps / secs : 0.0,
           t->r.st.busy_secs, t->r.st.idle_secs, secs > 0 ? 100.0 * t->r.st.idle_secs / secs : 0.0,
           (unsigned long long)pipe_link_bytes_sent(t->link));
    if (c->train_steps > 1 && steady > 0)
        /* idle fraction: the part of the wall time not computing (the bubble, and the sends) */
        printf("%s: stage %d steady state (steps 2-%lld): %.3f steps/s, %.3f s, busy %.3f s, waiting %.3f s, "
               "idle fraction %.4f; received %llu messages; sends %.4f s in all\n",
               c->name, s, (long long)c->train_steps, (double)(c->train_steps - 1) / steady, steady, busy1, idle1,
               1.0 - busy1 / steady, (unsigned long long)t->msgs, pipe_link_send_secs(t->link));
    fflush(stdout);
}

/* Stage 0 at the end: its training buffers freed, then the whole model's
 * parameters (its own, the others' as they arrive), the test accuracy (in
 * batches of --batch_size, not of a micro-batch, as ps_finish) and
 * --export. The exit status. */
static int gather_and_report(stage_train *t, int64_t fin)
{
    char err[1024];
    const train_config *c = t->c;
    for (int i = 0; i < t->P; i++) {
        model_free(t->inst[i]);
        t->inst[i] = NULL;
    }
    if (!(t->whole = malloc(sizeof(float) * (t->np ? t->np : 1))) ||
        !(t->eval = model_new(model_device_backend(), t->L, t->B, err, sizeof(err)))) {
        fprintf(stderr, "workerd: %s\n", t->whole ? err : "out of memory for the whole model's parameters");
        return 1;
    }
    memcpy(t->whole + t->poff[0], t->params, sizeof(float) * t->pn[0]);
    free(t->params);
    t->params = NULL;
    pipe_mailbox_open_params(t->box); /* the others' parameters: refused (503, retried) until now */
    for (int k = 1; k < t->K; k++)
        if (receive(&t->r, &(pipe_key){fin, k, PIPE_PARAMS}, k, t->whole + t->poff[k], NULL, t->tmo) != 0)
            return 1;
    int rc = 0;
    if (final_report(c, t->eval, t->whole, &t->ds, c->train_steps) != 0)
        rc = 1;
    if ((c->export_path || c->onnx_path) && export_model(c, t->whole, c->train_steps) != 0)
        rc = 1;
    return rc;
}

/* After the last step: what is queued delivered, the figures, the training
 * buffers freed, then the end: with the ps, ps_finish; else every stage's
 * parameters to stage 0 (replica 0's), which reports. The exit status. */
static int finish(stage_train *t)
{
    char err[1024];
    const train_config *c = t->c;
    const int s = t->s, K = t->K;
    double t_end = clk_mono_secs(), secs = t_end - t->t_start, steady = t_end - t->t_steady;
    { /* what is queued delivered (the bytes below are all the steps') */
        int f = pipe_link_flush(t->link, err, sizeof(err));
        if (f == -1)
            fprintf(stderr, "workerd: %s (stage %d of %d): %s; stopping\n", c->name, s, K, err);
        if (f != 0)
            return f == -2 ? 0 : 1;
    }
    report_times(t, secs, steady);
    /* then every stage's parameters to stage 0 */
    const int64_t fin = c->train_steps - 1;
    free_training_state((train_bufs){&t->grads, &t->acc, &t->sum, &t->s0, &t->s1, &t->theirs_g});
    if (c->pipeline_ps) {
        heartbeat_stop(t->hb);
        t->hb = NULL;
        for (int i = 0; i < t->P; i++) { /* the chief's whole model comes next */
            model_free(t->inst[i]);
            t->inst[i] = NULL;
        }
        return ps_finish(c, t->pc, &t->ds, t->B);
    }
    if (t->g.replica > 0) /* replica 0 holds the same parameters */
        return 0;
    if (s > 0) {
        if (send_to(&t->r, 0, &(pipe_key){fin, s, PIPE_PARAMS}, t->params, t->pn[s], 0, t->tmo) != 0)
            return 1;
        int f = pipe_link_flush(t->link, err, sizeof(err));
        if (f == -1)
            fprintf(stderr, "workerd: %s (stage %d of %d): %s; stopping\n", c->name, s, K, err);
        return f == 0 ? 0 : f == -2 ? 0 : 1;
    }
    return gather_and_report(t, fin);
}

/* Everything the stage holds, freed (the link before the mailbox it fills). */
static void free_stage(stage_train *t)
{
    fflush(stdout);
    heartbeat_stop(t->hb);
    pipe_ps_free(&t->pps);
    ps_client_free(t->pc);
    abort_link = NULL;
    pipe_link_free(t->link); /* before the mailbox it fills */
    pipe_mailbox_free(t->box);
    free(t->peers);
    free(t->rpeers);
    if (t->sum != t->acc)
        free(t->sum);
    model_free(t->eval);
    free(t->whole);
    free(t->theirs_g);
    for (int i = 0; i < t->P; i++) {
        model_free(t->inst[i]);
        free(t->inbuf[i]);
        free(t->dlog[i]);
    }
    free(t->b.order);
    free(t->params);
    free(t->grads);
    free(t->acc);
    free(t->s0);
    free(t->s1);
    free(t->out);
    free(t->dout);
    free(t->din);
    free(t->x);
    free(t->y);
    pipe_schedule_free(&t->sch);
    if (t->have_data)
        idx_dataset_free(&t->ds);
}

int train_pipeline(const train_config *c)
{
    stage_train t = {.c = c};
    int rc = plan_stage(&t);
    if (rc != 0)
        return rc;
    if ((rc = check_model_bytes(&t)) != 0) {
        pipe_schedule_free(&t.sch);
        return rc;
    }
    t.plan_id = plan_text(c, &t.p, t.plan, sizeof(t.plan));
    t.have_data = t.s == 0 || t.is_last;
    if (t.have_data && (rc = train_load(c, &t.ds)) != 0) {
        pipe_schedule_free(&t.sch);
        return rc;
    }
    if ((rc = alloc_stage(&t)) == 0 && (rc = place_peers(&t)) == 0 && (rc = start_params(&t)) == 0 &&
        (rc = open_link(&t)) == 0) {
        int e = run_steps(&t);
        rc = e == 0 ? finish(&t) : e == 2 ? 0 : 1;
    }
    free_stage(&t);
    return rc;
}
