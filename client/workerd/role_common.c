/* role_common.c - what every role of workerd shares (train.h): stopping on a
 * signal, loading the data, the ps connection, waiting for the ps, the
 * placement check, the final report of the validation and test figures, and
 * the role buffers (the data, the model, its step buffers, the data order and
 * the step loop's log) of the roles that step on their own batches. It calls
 * no role: the roles (train.c, chief.c, evaluator.c, local.c,
 * ring_train.c, pipeline_train.c) call it. */
#include "workerd/train.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "shards/shards.h"

static volatile sig_atomic_t stop_flag;

static void on_stop(int sig)
{
    (void)sig;
    stop_flag = 1;
}

void train_handle_signals(void)
{
    struct sigaction sa = {0};
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

int train_stop_requested(void) { return stop_flag != 0; }

void train_sleep(double s)
{
    struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&t, &t) != 0 && errno == EINTR && !stop_flag) {
    }
}

int train_load(const train_config *c, idx_dataset *ds)
{
    char err[512];
    if (idx_load_dataset(c->data_dir, ds, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    if (ds->rows != c->layout.input.h || ds->cols != c->layout.input.w || c->layout.input.c != 1 ||
        (size_t)ds->n_features != c->layout.n_in) {
        fprintf(stderr, "workerd: %s: images are %dx%d, the model %s takes %dx%dx%d\n", c->data_dir,
                ds->rows, ds->cols, c->layout.spec, c->layout.input.h, c->layout.input.w,
                c->layout.input.c);
        idx_dataset_free(ds);
        return 2;
    }
    int min_train = c->batch_size * c->n_trainers;
    if (ds->train.n < min_train) {
        fprintf(stderr, "workerd: %s: %lld training examples are fewer than one batch of %d for each of %d tasks\n",
                c->data_dir, (long long)ds->train.n, c->batch_size, c->n_trainers);
        idx_dataset_free(ds);
        return 2;
    }
    return 0;
}

/* ---- the cluster ---- */

/* What a request to a ps waits for, said as it waits (ps_set_stall_report):
 * a ps or its link down shows in the log within seconds, not after the
 * request's limit and the retry budget. Retries are said once in 5 s. */
static void say_stall(void *arg, const ps_stall *s)
{
    static _Thread_local double retry_said = -1e9;
    static _Thread_local int said; /* a wait was printed: its end is printed too */
    const train_config *c = arg;
    int plen = (int)strcspn(s->path, "?");
    if (strncmp(s->path, "/v1/heartbeat", 13) == 0)
        return; /* the beat in the background: the request the task waits on says it */
    if (s->again) {
        if (!said)
            return;
        said = 0;
        printf("%s: %s answers again after %.0f s\n", c->name, s->label, s->secs);
    } else if (s->err) {
        /* before training runs (no retry budget yet) the caller's own wait says it */
        if (s->budget <= 0)
            return;
        double now = clk_mono_secs();
        if (now - retry_said < 5 && s->secs > 0)
            return;
        retry_said = now;
        size_t ll = strlen(s->label);
        const char *why = strncmp(s->err, s->label, ll) == 0 && s->err[ll] == ':' ? s->err + ll + 2 : s->err;
        /* since when, on the wall clock, for the operator's logs */
        time_t since = time(NULL) - (time_t)s->secs;
        struct tm tm;
        char hms[16] = "?";
        if (localtime_r(&since, &tm))
            strftime(hms, sizeof(hms), "%H:%M:%S", &tm);
        double left = s->budget - s->secs;
        said = 1;
        printf("%s: %s %s since %s (%s); retrying for %.0f s more (--ps_retry_secs)\n", c->name, s->label,
               strstr(why, ": HTTP ") ? "not ready" : "unreachable", hms, why, left > 0 ? left : 0);
    } else if (s->long_poll) {
        said = 1;
        printf("%s: waiting for %s: %.0f s without an answer to %s %.*s (a step that waits for other "
               "workers' gradients, or the ps or its link down)\n",
               c->name, s->label, s->secs, s->method, plen, s->path);
    } else {
        said = 1;
        printf("%s: waiting for %s: nothing moved for %.0f s in %s %.*s (the ps or its link down?); the "
               "request gives up after --timeout_ms, then retries for %.0f s (--ps_retry_secs)\n",
               c->name, s->label, s->secs, s->method, plen, s->path, c->retry_secs);
    }
    fflush(stdout);
}

ps_client *train_connect_ps(const train_config *c, long timeout_ms)
{
    const cluster_job *ps = &c->cluster->jobs[JOB_PS];
    char **hosts = calloc((size_t)ps->n, sizeof(char *));
    char err[512];
    ps_client *pc = NULL;
    if (!hosts)
        return NULL;
    for (int i = 0; i < ps->n; i++) {
        const char *fmt = strchr(ps->tasks[i].host, ':') ? "[%s]:%d" : "%s:%d";
        if (asprintf(&hosts[i], fmt, ps->tasks[i].host, ps->tasks[i].port) < 0)
            goto out;
    }
    ps_options o = {.timeout_ms = timeout_ms, .retries = 3, .backoff_ms = c->backoff_ms,
                    .backoff_max_ms = c->backoff_max_ms, .token = c->token, .tls = c->tls,
                    .ca_file = c->tls_ca};
    pc = ps_client_new((const char *const *)hosts, ps->n, &o, err, sizeof(err));
    if (!pc)
        fprintf(stderr, "workerd: %s\n", err);
    else
        ps_set_stall_report(pc, say_stall, (void *)c);
out:
    for (int i = 0; i < ps->n; i++)
        free(hosts[i]);
    free(hosts);
    return pc;
}

/* Poll `path` on every ps until each answers 200, saying what it waits for. */
void train_wait_for_all(const train_config *c, ps_client *pc, const char *path, const char *what)
{
    double last_said = -1e9;
    for (int i = 0; i < ps_shards(pc); i++) {
        for (;;) {
            int rc = ps_json(pc, i, "GET", path, NULL, 0, NULL);
            if (rc == PS_OK)
                break;
            if ((rc == PS_EHTTP && ps_http_status(pc) == 401) || rc == PS_ETLS) {
                fprintf(stderr, "workerd: %s\n", ps_error(pc));
                exit(1); /* a wrong token or an untrusted certificate does not fix itself */
            }
            if (train_stop_requested()) {
                printf("%s: stopped by a signal while waiting for %s\n", c->name, what);
                exit(0);
            }
            if (clk_mono_secs() - last_said > 5) {
                const cluster_addr *d = c->cluster->ps_default ? &c->cluster->jobs[JOB_PS].tasks[0] : NULL;
                if (d) /* say that nobody asked for this address */
                    printf("%s: waiting for %s, ps 0 at %s:%d (the default: no --ps_hosts or TF_CONFIG given): %s\n",
                           c->name, what, d->host, d->port, ps_error(pc));
                else
                    printf("%s: waiting for %s: %s\n", c->name, what, ps_error(pc));
                fflush(stdout);
                last_said = clk_mono_secs();
            }
            train_sleep(c->recovery_wait_secs);
        }
    }
}

/* The chief's placement (GET /v1/placement on ps 0) must be this task's:
 * the same model, --placement and --partition_bytes. 0 when it is. */
int train_check_placement(const train_config *c, ps_client *pc, const shards *sh)
{
    json_t *theirs = NULL, *mine = placement_json(&sh->pl, &c->layout);
    if (c->data_langid)
        json_object_set_new(mine, "sparse", langid_placement(c, ps_shards(pc)));
    int rc = ps_json(pc, 0, "GET", "/v1/placement", NULL, 1, &theirs);
    if (rc == PS_EHTTP && ps_http_status(pc) == 404) {
        json_decref(mine);
        return 0; /* a chief of an older kind: nothing to compare */
    }
    int bad = rc != PS_OK;
    if (!bad) {
        json_object_del(theirs, "this_ps");
        bad = !json_equal(theirs, mine);
    }
    const char *their_model = theirs ? json_string_value(json_object_get(theirs, "model")) : NULL;
    if (bad && their_model && strcmp(their_model, c->layout.spec) != 0) {
        fprintf(stderr, "workerd: the chief trains --model=%s; this task was started with --model=%s: "
                        "start every task with the same --model\n",
                their_model, c->layout.spec);
    } else if (bad) {
        const char *pol = theirs ? json_string_value(json_object_get(theirs, "policy")) : NULL;
        json_t *pb = theirs ? json_object_get(theirs, "partition_bytes") : NULL;
        if (rc != PS_OK)
            fprintf(stderr, "workerd: reading the placement: %s\n", ps_error(pc));
        else
            fprintf(stderr, "workerd: the chief placed the variables otherwise (--placement=%s --partition_bytes=%lld; "
                            "this task: --placement=%s --partition_bytes=%llu, or another model): "
                            "start every task with the same flags\n",
                    pol ? pol : "?", (long long)json_integer_value(pb),
                    place_policy_name(c->placement), (unsigned long long)c->partition_bytes);
    }
    json_decref(theirs);
    json_decref(mine);
    return bad ? -1 : 0;
}

/* The final evaluation's progress (final_report): a model whose evaluation
 * takes long (the CNN's 15,000 examples: 10-40 s on 2 cores, more for a
 * pipeline's small batches) says what it computes once 2 s went by, then
 * every 5 s, instead of a silence before the result. */
typedef struct {
    const train_config *c;
    int64_t step, done, total;
    double t0, said;
} eval_progress;

/* model_evaluate over split's n examples, in pieces of about 1,000 (whole
 * batches of m's), the loss summed and the right answers counted as
 * model_evaluate does, saying how far it is as eval_progress says. 0 or -1. */
static int evaluate_said(model *m, const float *params, const idx_split *sp, eval_progress *pg, double *loss, double *acc)
{
    int64_t piece = ((1000 + m->max_batch - 1) / m->max_batch) * (int64_t)m->max_batch, right = 0;
    double total = 0;
    for (int64_t i = 0; i < sp->n; i += piece) {
        int64_t b = sp->n - i < piece ? sp->n - i : piece;
        double l, a;
        if (model_evaluate(m, params, sp->images + (size_t)i * m->layout.n_in, sp->labels + i, b, &l, &a) != 0)
            return -1;
        total += l * (double)b;
        right += (int64_t)(a * (double)b + 0.5);
        pg->done += b;
        double now = clk_mono_secs();
        if (pg->done < pg->total && now - pg->t0 > 2 && (pg->said == 0 || now - pg->said > 5)) {
            printf("%s: computing the validation cross-entropy and the test accuracy of global step %lld: "
                   "%lld of %lld examples in %.0f s\n",
                   pg->c->name, (long long)pg->step, (long long)pg->done, (long long)pg->total, now - pg->t0);
            fflush(stdout);
            pg->said = now;
        }
    }
    *loss = total / (double)sp->n;
    *acc = (double)right / (double)sp->n;
    return 0;
}

int final_report(const train_config *c, model *m, const float *params, const idx_dataset *ds,
                 int64_t step)
{
    double vloss = 0, vacc = 0, tloss = 0, tacc = 0;
    eval_progress pg = {c, step, 0, ds->validation.n + ds->test.n, clk_mono_secs(), 0};
    if ((ds->validation.n > 0 &&
         evaluate_said(m, params, &ds->validation, &pg, &vloss, &vacc) != 0) ||
        evaluate_said(m, params, &ds->test, &pg, &tloss, &tacc) != 0) {
        /* the backend printed the call that failed */
        fprintf(stderr, "workerd: the final evaluation failed at global step %lld\n", (long long)step);
        return -1;
    }
    printf("%s: training done at global step %lld: validation cross-entropy %.4f, test loss %.4f, "
           "test accuracy %.4f\n",
           c->name, (long long)step, vloss, tloss, tacc);
    fflush(stdout);
    return 0;
}

/* ---- the role buffers ---- */

int role_bufs_init(role_bufs *rb, const train_config *c, size_t grad_extra, int slots)
{
    memset(rb, 0, sizeof(*rb));
    rb->c = c;
    int rc = train_load(c, &rb->ds);
    if (rc)
        return rc;
    char err[512];
    size_t np = c->layout.n_params;
    rb->m = model_new(model_device_backend(), &c->layout, c->batch_size, err, sizeof(err));
    /* the step's buffers from the backend (pinned on a GPU), so the step's
     * copies skip a memcpy; the slots are the CPU's */
    rb->params = model_host_alloc(rb->m, np * sizeof(float));
    rb->grads = model_host_alloc(rb->m, (np + grad_extra) * sizeof(float));
    if (slots) {
        rb->s0 = calloc(np, sizeof(float));
        rb->s1 = calloc(np, sizeof(float));
    }
    const int bp_ok = batch_pair_alloc(&rb->bp, rb->m, c->batch_size, rb->ds.n_features) == 0;
    if (!rb->m || !rb->params || !rb->grads || (slots && (!rb->s0 || !rb->s1)) || !bp_ok ||
        batcher_init(&rb->b, &rb->ds.train, c->seed, c->trainer, c->n_trainers) != 0) {
        fprintf(stderr, "workerd: %s\n", rb->m ? "out of memory" : err);
        role_bufs_free(rb);
        return 1;
    }
    return 0;
}

void role_bufs_free(role_bufs *rb)
{
    free(rb->b.order);
    model_host_free(rb->m, rb->params); /* before model_free: the memory is m's device's */
    model_host_free(rb->m, rb->grads);
    batch_pair_free(&rb->bp, rb->m);
    model_free(rb->m);
    free(rb->s0);
    free(rb->s1);
    idx_dataset_free(&rb->ds);
    memset(rb, 0, sizeof(*rb));
}

void role_bufs_gather(role_bufs *rb, int64_t k, int i)
{
    batcher_at(&rb->b, k, rb->c->batch_size, rb->ds.n_features, rb->bp.x[i], rb->bp.y[i],
               &rb->bp.example0[i]);
}

void role_bufs_stage(role_bufs *rb, int64_t k, int i)
{
    role_bufs_gather(rb, k, i);
    (void)model_stage_batch(rb->m, rb->bp.x[i], rb->bp.y[i], rb->c->batch_size); /* -1: copied then */
}

int role_bufs_forward_backward(role_bufs *rb, int64_t step, double *loss)
{
    const train_config *c = rb->c;
    int i = rb->cur;
    /* dropout's mask: this step, the seed, the rows' places in the epoch */
    const model_ctx ctx = {.seed = c->seed, .step = step, .example0 = rb->bp.example0[i]};
    return model_forward_backward(rb->m, rb->params, rb->bp.x[i], rb->bp.y[i], c->batch_size, &ctx,
                                  rb->grads, loss);
}

void role_bufs_apply(role_bufs *rb, float scale, int64_t step)
{
    const train_config *c = rb->c;
    float *params = rb->params, *grads = rb->grads, *s0 = rb->s0, *s1 = rb->s1;
    /* clipping is per variable */
    for (int k = 0; k < c->layout.n_tensors; k++) {
        const model_tensor *t = &c->layout.tensors[k];
        optim_apply(&c->optim, params + t->offset, params + t->offset, grads + t->offset, scale,
                    s0 + t->offset, s1 + t->offset, step + 1, step, t->numel);
    }
}

void role_bufs_start(role_bufs *rb)
{
    rb->t_start = rb->t_log = clk_mono_secs();
    rb->ex_since = 0;
    progress_init(&rb->bar, rb->c->name, rb->c->train_steps, -1);
}

void role_bufs_step_done(role_bufs *rb, int64_t local, int64_t bar_step, int global,
                         int64_t log_step, double loss)
{
    const train_config *c = rb->c;
    rb->ex_since += c->batch_size;
    progress_update(&rb->bar, bar_step, loss,
                    (double)(local * c->batch_size) / (clk_mono_secs() - rb->t_start));
    if (!rb->bar.on && c->log_every > 0 && local % c->log_every == 0) {
        double t = clk_mono_secs();
        if (global)
            printf("%s: step %lld (global step %lld) loss %.4f examples/s %.0f\n", c->name,
                   (long long)local, (long long)log_step, loss, (double)rb->ex_since / (t - rb->t_log));
        else
            printf("%s: step %lld loss %.4f examples/s %.0f\n", c->name, (long long)local, loss,
                   (double)rb->ex_since / (t - rb->t_log));
        fflush(stdout);
        rb->t_log = t;
        rb->ex_since = 0;
    }
}
