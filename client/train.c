/* train.c - the training loop and the roles around it.
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
#include "train.h"

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
#include "heartbeat.h"
#include "progress.h"
#include "rng.h"
#include "safetensors.h"
#include "shards.h"

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

static void sleep_secs(double s)
{
    struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&t, &t) != 0 && errno == EINTR && !stop_flag) {
    }
}

/* ---- data ---- */

/* Each epoch is one permutation of the training set, the same on every task
 * (idx_epoch_order from --seed and the epoch). The tasks take turns along it
 * in blocks of one batch: task i's k-th batch is positions
 * [(k*N + i)*b, (k*N + i + 1)*b). So the N tasks together see every example
 * once per epoch, and N sync tasks with batch b compute exactly the step one
 * task with batch N*b would. */
/* typedef struct batcher: in train.h (ring_train.c uses it too) */

int batcher_init(batcher *b, const idx_split *split, uint64_t seed, int trainer, int n_trainers)
{
    memset(b, 0, sizeof(*b));
    b->split = split;
    b->seed = seed;
    b->trainer = trainer;
    b->n_trainers = n_trainers;
    b->order = malloc(sizeof(uint32_t) * (size_t)(split->n ? split->n : 1));
    if (!b->order)
        return -1;
    return idx_epoch_order(split->n, seed, 0, 0, 1, b->order, &b->count);
}

/* Batch number k of this task: epoch k / P and block k % P of it, where P =
 * the rounds of N blocks that fit in an epoch (the remainder is left out, as
 * drop_remainder). A function of k alone, so a restarted task (sync: k is the
 * global step) picks up its place in the data where it was. */
void batcher_at(batcher *b, int64_t k, int batch, int n_features, float *x, uint8_t *y,
                int64_t *example0)
{
    int64_t round = (int64_t)b->n_trainers * batch;
    int64_t per_epoch = b->count / round;
    uint64_t epoch = (uint64_t)(k / per_epoch);
    if (epoch != b->epoch) {
        b->epoch = epoch;
        idx_epoch_order(b->split->n, b->seed, b->epoch, 0, 1, b->order, &b->count);
    }
    int64_t at = (k % per_epoch) * round + (int64_t)b->trainer * batch;
    if (example0)
        *example0 = (int64_t)epoch * b->count + at;
    for (int i = 0; i < batch; i++) {
        uint32_t e = b->order[at + i];
        memcpy(x + (size_t)i * n_features, b->split->images + (size_t)e * n_features,
               sizeof(float) * (size_t)n_features);
        y[i] = b->split->labels[e];
    }
    b->k = k + 1;
}

int batch_pair_alloc(batch_pair *p, model *m, int batch, int n_features)
{
    const size_t xbytes = sizeof(float) * (size_t)batch * (size_t)n_features;
    for (int i = 0; i < 2; i++) {
        p->x[i] = model_host_alloc(m, xbytes);
        p->y[i] = model_host_alloc(m, (size_t)batch);
    }
    return p->x[0] && p->x[1] && p->y[0] && p->y[1] ? 0 : -1;
}

void batch_pair_free(batch_pair *p, model *m)
{
    for (int i = 0; i < 2; i++) {
        model_host_free(m, p->x[i]);
        model_host_free(m, p->y[i]);
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

/* ---- the model at the end ---- */

void model_file_meta(const model_layout *L, char *shape, size_t shape_len, char *layers,
                     size_t layers_len)
{
    model_shape_format(L->input, shape, shape_len);
    snprintf(layers, layers_len, "%zu", L->n_in);
    for (int l = 0; l < L->n_layers; l++)
        if (L->layers[l].w >= 0) {
            size_t k = strlen(layers);
            snprintf(layers + k, layers_len - k, ",%zu", L->layers[l].out_numel);
        }
}

int export_model(const train_config *c, const float *params, int64_t step)
{
    const model_layout *L = &c->layout;
    st_desc d[MODEL_MAX_TENSORS];
    for (int t = 0; t < L->n_tensors; t++)
        d[t] = (st_desc){L->tensors[t].name, "F32", &L->tensors[t].shape};
    char step_s[32], shape[64], layers[512];
    snprintf(step_s, sizeof(step_s), "%lld", (long long)step);
    model_file_meta(L, shape, sizeof(shape), layers, sizeof(layers));
    const char *meta[] = {"global_step", step_s, "model", L->spec, "input_shape", shape,
                          "layers", layers, "format", "restps-model-1"};
    char err[512];
    if (st_write_file(c->export_path, d, L->n_tensors, meta, 5, params, L->n_params * 4, err,
                      sizeof(err)) != 0) {
        fprintf(stderr, "workerd: export: %s\n", err);
        return -1;
    }
    printf("%s: exported the model (global step %lld) to %s\n", c->name, (long long)step,
           c->export_path);
    return 0;
}

int final_report(const train_config *c, model *m, const float *params, const idx_dataset *ds,
                 int64_t step)
{
    double vloss = 0, vacc = 0, tloss = 0, tacc = 0;
    if ((ds->validation.n > 0 &&
         model_evaluate(m, params, ds->validation.images, ds->validation.labels, ds->validation.n,
                      &vloss, &vacc) != 0) ||
        model_evaluate(m, params, ds->test.images, ds->test.labels, ds->test.n, &tloss, &tacc) != 0) {
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

int train_evaluate_file(const train_config *c, const char *path)
{
    char err[512];
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        fprintf(stderr, "workerd: --evaluate_model=%s: %s\n", path, strerror(errno));
        return 2;
    }
    unsigned char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            cap = cap ? 2 * cap : (size_t)1 << 20;
            unsigned char *nb = realloc(buf, cap);
            if (!nb) {
                fclose(fp);
                free(buf);
                fprintf(stderr, "workerd: --evaluate_model=%s: out of memory\n", path);
                return 1;
            }
            buf = nb;
        }
        size_t got = fread(buf + len, 1, cap - len, fp);
        len += got;
        if (got == 0)
            break;
    }
    fclose(fp);
    st_file f;
    memset(&f, 0, sizeof(f));
    int rc = 2;
    model *m = NULL;
    float *params = NULL;
    idx_dataset ds;
    int have_ds = 0;
    train_config cc = *c;
    if (st_parse(buf, len, &f, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --evaluate_model=%s: not a safetensors file: %s\n", path, err);
        goto out;
    }
    const char *spec = st_meta_get(&f, "model"), *shape_s = st_meta_get(&f, "input_shape");
    model_shape shape;
    if (!spec || !shape_s) {
        fprintf(stderr, "workerd: --evaluate_model=%s: the file has no model and input_shape in its "
                        "__metadata__ (exported by an older workerd?): cannot rebuild the model\n",
                path);
        goto out;
    }
    if (model_shape_parse(shape_s, &shape) != 0) {
        fprintf(stderr, "workerd: --evaluate_model=%s: input_shape \"%.64s\" is not H,W,C\n", path, shape_s);
        goto out;
    }
    if (model_layout_init(&cc.layout, spec, shape, IDX_N_CLASSES, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --evaluate_model=%s: %s\n", path, err);
        goto out;
    }
    m = model_new(model_device_backend(), &cc.layout, 1000, err, sizeof(err));
    params = model_host_alloc(m, cc.layout.n_params * sizeof(float));
    if (!m || !params) {
        fprintf(stderr, "workerd: %s\n", m ? "out of memory" : err);
        rc = 1;
        goto out;
    }
    for (int t = 0; t < cc.layout.n_tensors; t++) {
        const model_tensor *mt = &cc.layout.tensors[t];
        int i = st_find(&f, mt->name);
        if (i < 0 || strcmp(f.tensors[i].dtype, "F32") != 0 ||
            !tensor_shape_equal(&f.tensors[i].shape, &mt->shape)) {
            fprintf(stderr, "workerd: --evaluate_model=%s: tensor %s is missing or not F32 of the shape %s gives it\n",
                    path, mt->name, cc.layout.spec);
            goto out;
        }
        memcpy(params + mt->offset, buf + f.data_start + f.tensors[i].begin, mt->numel * sizeof(float));
    }
    cc.n_trainers = 1;
    if ((rc = train_load(&cc, &ds)) != 0)
        goto out;
    have_ds = 1;
    double loss, acc;
    if (model_evaluate(m, params, ds.test.images, ds.test.labels, ds.test.n, &loss, &acc) != 0) {
        fprintf(stderr, "workerd: the evaluation failed\n");
        rc = 1;
        goto out;
    }
    const char *gs = st_meta_get(&f, "global_step");
    printf("%s: %s (model %s, global step %s): test loss %.4f, test accuracy %.4f on %lld examples\n",
           c->name, path, cc.layout.spec, gs ? gs : "?", loss, acc, (long long)ds.test.n);
    fflush(stdout);
    rc = 0;
out:
    if (have_ds)
        idx_dataset_free(&ds);
    model_host_free(m, params);
    model_free(m);
    st_file_free(&f);
    free(buf);
    return rc;
}

/* ---- the cluster ---- */

static ps_client *connect_ps(const train_config *c, long timeout_ms)
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
out:
    for (int i = 0; i < ps->n; i++)
        free(hosts[i]);
    free(hosts);
    return pc;
}

/* Poll `path` on every ps until each answers 200, saying what it waits for. */
static void wait_for_all(const train_config *c, ps_client *pc, const char *path, const char *what)
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
            if (stop_flag) {
                printf("%s: stopped by a signal while waiting for %s\n", c->name, what);
                exit(0);
            }
            if (clk_mono_secs() - last_said > 5) {
                printf("%s: waiting for %s: %s\n", c->name, what, ps_error(pc));
                fflush(stdout);
                last_said = clk_mono_secs();
            }
            sleep_secs(c->recovery_wait_secs);
        }
    }
}

/* The chief's placement (GET /v1/placement on ps 0) must be this task's:
 * the same model, --placement and --partition_bytes. 0 when it is. */
static int check_placement(const train_config *c, ps_client *pc, const shards *sh)
{
    json_t *theirs = NULL, *mine = placement_json(&sh->pl, &c->layout);
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

static int chief_setup(const train_config *c, ps_client *pc, shards *sh, float *params)
{
    wait_for_all(c, pc, "/healthz", "the ps tasks");
    if (check_placement(c, pc, sh) != 0) /* a restarted chief with other flags */
        return 2;
    model_init_params(&c->layout, params, c->seed);
    int created, existing;
    if (shards_create(sh, params, &created, &existing) != PS_OK) {
        fprintf(stderr, "workerd: creating the variables: %s\n", ps_error(pc));
        return 1;
    }
    if (existing)
        printf("%s: %d variables existed already (restored or created before): kept them; created %d\n",
               c->name, existing, created);
    else
        printf("%s: created %d variables (%zu parameters) on %d ps\n", c->name, created,
               c->layout.n_params, ps_shards(pc));
    json_t *map = placement_json(&sh->pl, &c->layout);
    for (int i = 0; i < ps_shards(pc); i++)
        if (ps_json(pc, i, "PUT", "/v1/placement", map, 1, NULL) != PS_OK) {
            fprintf(stderr, "workerd: sending the placement: %s\n", ps_error(pc));
            json_decref(map);
            return 1;
        }
    json_decref(map);
    json_t *cfg = json_pack("{s:s,s:f,s:b,s:i,s:i}", "optimizer", optim_name(c->optim.kind),
                            "learning_rate", (double)c->optim.learning_rate, "sync", c->sync,
                            "replicas_to_aggregate", c->replicas_to_aggregate, "workers",
                            c->n_trainers);
    const optim_config *o = &c->optim;
    if (o->kind == OPTIM_MOMENTUM || o->kind == OPTIM_RMSPROP)
        json_object_set_new(cfg, "momentum", json_real(o->momentum));
    if (o->kind == OPTIM_MOMENTUM && o->nesterov)
        json_object_set_new(cfg, "nesterov", json_true());
    if (o->kind == OPTIM_RMSPROP)
        json_object_set_new(cfg, "rmsprop_decay", json_real(o->rmsprop_decay));
    if (o->kind == OPTIM_ADAGRAD)
        json_object_set_new(cfg, "initial_accumulator_value", json_real(o->initial_accumulator_value));
    if (o->clip_norm > 0)
        json_object_set_new(cfg, "clip_norm", json_real(o->clip_norm));
    if (o->weight_decay > 0)
        json_object_set_new(cfg, "weight_decay", json_real(o->weight_decay));
    if (o->lr_schedule != OPTIM_LR_CONSTANT) {
        json_object_set_new(cfg, "lr_schedule", json_string(optim_schedule_name(o->lr_schedule)));
        json_object_set_new(cfg, "decay_steps", json_integer(o->decay_steps));
    }
    if (o->lr_schedule == OPTIM_LR_EXPONENTIAL) {
        json_object_set_new(cfg, "decay_rate", json_real(o->decay_rate));
        json_object_set_new(cfg, "staircase", json_boolean(o->staircase));
    }
    if (o->lr_schedule == OPTIM_LR_COSINE)
        json_object_set_new(cfg, "alpha", json_real(o->alpha));
    if (c->max_staleness >= 0)
        json_object_set_new(cfg, "max_staleness", json_integer(c->max_staleness));
    if (c->staleness >= 0)
        json_object_set_new(cfg, "staleness", json_integer(c->staleness));
    for (int i = 0; i < ps_shards(pc); i++)
        if (ps_json(pc, i, "PUT", "/v1/config", cfg, 1, NULL) != PS_OK) {
            fprintf(stderr, "workerd: sending the training configuration: %s\n", ps_error(pc));
            json_decref(cfg);
            return 1;
        }
    json_decref(cfg);
    return 0;
}

/* After the chief's last step: wait (bounded) for the others to finish. */
static void chief_wait_others(const train_config *c, ps_client *pc)
{
    double start = clk_mono_secs(), said = start;
    for (;;) {
        json_t *st;
        if (ps_status(pc, 0, &st) != PS_OK)
            return;
        int done = (int)json_integer_value(json_object_get(st, "workers_done"));
        json_decref(st);
        /* workers_done counts the chief too: it said so before waiting */
        done = done > 0 ? done - 1 : 0;
        if (done >= c->n_trainers - 1)
            return;
        if (clk_mono_secs() - start > 60 || stop_flag) {
            printf("%s: %d of %d other tasks said they finished; not waiting longer\n", c->name,
                   done, c->n_trainers - 1);
            return;
        }
        if (clk_mono_secs() - said > 5) {
            printf("%s: waiting for %d other tasks to finish\n", c->name, c->n_trainers - 1 - done);
            said = clk_mono_secs();
        }
        sleep_secs(0.1);
    }
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
    ps_client *pc = connect_ps(c, c->timeout_ms);
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
        if ((rc = chief_setup(c, pc, &sh, params)) != 0)
            goto out;
        rc = 1;
    } else {
        wait_for_all(c, pc, "/readyz", "the chief to initialize the variables");
        if (check_placement(c, pc, &sh) != 0) {
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
        ps_client *hpc = connect_ps(c, 5000);
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
            sleep_secs((double)c->step_delay_ms / 1000.0);
        char id[64];
        snprintf(id, sizeof(id), "t%d-%08x-%lld", c->trainer, nonce, (long long)pushes++);
        push_meta pm = {c->trainer, step, loss, c->batch_size, id, ssp >= 0 ? k - 1 : -1};
        int64_t after;
        int outcome;
        prc = shards_push(&sh, grads, &pm, &after, &outcome);
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
        if ((max_local < 0 || local < max_local) && (!sync || nk < c->train_steps)) {
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
        chief_wait_others(c, pc);
        int64_t final_step;
        if (shards_pull(&sh, params, -1, 0, &final_step) != PS_OK) {
            fprintf(stderr, "workerd: final pull: %s\n", ps_error(pc));
            rc = 1;
            goto out;
        }
        if (final_report(c, m, params, &ds, final_step) != 0)
            rc = 1;
        if (c->export_path && export_model(c, params, final_step) != 0)
            rc = 1;
        if (!c->keep_ps) {
            for (int i = 0; i < ps_shards(pc); i++)
                if (ps_json(pc, i, "POST", "/v1/shutdown", NULL, 0, NULL) != PS_OK)
                    fprintf(stderr, "workerd: shutdown: %s\n", ps_error(pc));
            printf("%s: asked the ps tasks to stop (--keep_ps keeps them)\n", c->name);
        }
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

int train_evaluator(const train_config *c)
{
    idx_dataset ds;
    int rc = train_load(c, &ds);
    if (rc)
        return rc;
    char err[512];
    model *m = model_new(model_device_backend(), &c->layout, 1000, err, sizeof(err));
    float *params = model_host_alloc(m, c->layout.n_params * sizeof(float));
    ps_client *pc = connect_ps(c, c->timeout_ms);
    shards sh = {0};
    rc = 1;
    if (!m || !params || !pc ||
        shards_init(&sh, pc, &c->layout, c->placement, c->partition_bytes, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", m ? "out of memory" : err);
        goto out;
    }
    wait_for_all(c, pc, "/readyz", "the chief to initialize the variables");
    if (check_placement(c, pc, &sh) != 0) {
        rc = 2;
        goto out;
    }
    /* the evaluator is not part of training: it rides through a short ps
     * restart, but does not outlive a job that ended by much */
    double budget = c->eval_secs * 2 > 10 ? c->eval_secs * 2 : 10;
    ps_set_retry_ms(pc, (long)((budget < c->retry_secs ? budget : c->retry_secs) * 1000));
    int64_t last = -1;
    for (;;) {
        int64_t step;
        if (shards_pull(&sh, params, -1, 0, &step) != PS_OK) {
            if (ps_http_status(pc) == 0 && last >= 0) {
                printf("%s: the ps stopped; last evaluated global step %lld\n", c->name, (long long)last);
                rc = 0;
            } else {
                fprintf(stderr, "workerd: pull: %s\n", ps_error(pc));
            }
            goto out;
        }
        if (step != last) {
            double loss, acc;
            if (model_evaluate(m, params, ds.test.images, ds.test.labels, ds.test.n, &loss, &acc) != 0) {
                fprintf(stderr, "workerd: evaluation failed at global step %lld\n", (long long)step);
                goto out;
            }
            printf("%s: global step %lld: test loss %.4f, test accuracy %.4f\n", c->name,
                   (long long)step, loss, acc);
            fflush(stdout);
            json_t *rep = json_pack("{s:I,s:f,s:f,s:I}", "global_step", (json_int_t)step, "loss",
                                    loss, "accuracy", acc, "examples", (json_int_t)ds.test.n);
            if (ps_json(pc, 0, "POST", "/v1/eval", rep, 1, NULL) != PS_OK)
                fprintf(stderr, "workerd: eval report: %s\n", ps_error(pc));
            json_decref(rep);
            last = step;
        }
        if (step >= c->train_steps) {
            rc = 0;
            goto out;
        }
        sleep_secs(c->eval_secs);
        if (stop_flag) {
            printf("%s: stopped by a signal; last evaluated global step %lld\n", c->name,
                   (long long)last);
            rc = 0;
            goto out;
        }
    }
out:
    shards_free(&sh);
    ps_client_free(pc);
    model_host_free(m, params); /* before model_free */
    model_free(m);
    idx_dataset_free(&ds);
    return rc;
}

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
