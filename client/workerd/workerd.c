/* workerd.c - the worker process: flags and TF_CONFIG, then the role (a
 * training worker, the chief, the evaluator, or --local training). main is
 * its steps: parse_flags (workerd_flags.c), configure, run_role. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/model.h"
#include "cluster.h"
#include "data/data.h"
#include "libps/libps.h"
#include "pipeline/pipeline.h"
#include "ring/ring.h"
#include "tls_priorities.h"
#include "wire_dtype.h"
#include "token.h"
#include "workerd/langid_train.h"
#include "workerd/train.h"
#include "workerd/workerd_flags.h"

/* The optimizer's other flags into c (kind and defaults set); 0, or -1
 * after one line on stderr. */
static int set_optim_flags(optim_config *c, const workerd_flags *f)
{
    const char *bad = NULL;
    if (f->nesterov && c->kind != OPTIM_MOMENTUM)
        bad = "--nesterov needs --optimizer=momentum";
    else if (!(f->rmsprop_decay >= 0 && f->rmsprop_decay < 1))
        bad = "--rmsprop_decay must be in [0, 1)";
    else if (!(f->init_accum > 0) || isinf(f->init_accum))
        bad = "--initial_accumulator_value must be positive";
    else if (!(f->clip_norm >= 0) || isinf(f->clip_norm))
        bad = "--clip_norm must be >= 0 (0: off)";
    else if (!(f->weight_decay >= 0) || isinf(f->weight_decay))
        bad = "--weight_decay must be >= 0 (0: off)";
    else if (optim_schedule_from_name(f->lr_schedule, &c->lr_schedule) != 0)
        bad = "--lr_schedule must be constant, exponential or cosine";
    else if (c->lr_schedule != OPTIM_LR_CONSTANT && f->decay_steps < 1)
        bad = "--lr_schedule=exponential and cosine need --decay_steps >= 1";
    else if (c->lr_schedule == OPTIM_LR_EXPONENTIAL && (!(f->decay_rate > 0) || isinf(f->decay_rate)))
        bad = "--lr_schedule=exponential needs --decay_rate > 0";
    else if (!(f->alpha >= 0 && f->alpha <= 1))
        bad = "--alpha must be in [0, 1]";
    if (bad) {
        fprintf(stderr, "workerd: %s\n", bad);
        return -1;
    }
    c->nesterov = f->nesterov;
    c->rmsprop_decay = f->rmsprop_decay;
    c->initial_accumulator_value = f->init_accum;
    c->clip_norm = f->clip_norm;
    c->weight_decay = f->weight_decay;
    c->decay_steps = f->decay_steps > 0 ? f->decay_steps : 0;
    c->decay_rate = f->decay_rate;
    c->staircase = f->staircase;
    c->alpha = f->alpha;
    optim_clear_unused(c);
    return 0;
}

/* The task index, --sync/--issync (into c->sync), the ranges of the
 * numbers, the placement and the optimizer (into c->optim): 0, or 2 after
 * a line on stderr. */
static int configure_basics(train_config *c, const workerd_flags *f)
{
    if (f->task_index_given && f->task_index < 0) {
        fprintf(stderr, "workerd: --task_index=%d is negative\n", f->task_index);
        return 2;
    }
    c->sync = f->sync;
    if (f->issync >= 0) {
        if (f->issync > 1) {
            fprintf(stderr, "workerd: --issync must be 0 or 1\n");
            return 2;
        }
        if (f->sync_given && f->sync != f->issync) {
            fprintf(stderr, "workerd: --sync and --issync disagree\n");
            return 2;
        }
        c->sync = f->issync;
    }
    optim_kind kind;
    if (optim_from_name(f->optimizer, &kind) != 0) {
        fprintf(stderr, "workerd: --optimizer must be " OPTIM_NAMES ", got '%s'\n", f->optimizer);
        return 2;
    }
    if (!(f->lr > 0) || !(f->momentum >= 0 && f->momentum < 1) || f->batch < 1 || f->batch > 1000000 ||
        f->threads < 1 || f->timeout_ms < 1 || f->recovery_wait <= 0 || f->eval_secs <= 0 || f->train_steps < 1 ||
        !(f->retry_secs >= 0) || f->backoff_ms < 1 || f->backoff_max_ms < f->backoff_ms || !(f->num_epochs >= 0) ||
        f->step_delay_ms < 0) {
        fprintf(stderr, "workerd: --learning_rate, --batch_size, --train_steps, --threads, --timeout_ms, "
                        "--recovery_wait_secs, --eval_secs and --ps_backoff_ms must be positive, "
                        "--ps_retry_secs, --num_epochs and --step_delay_ms >= 0, --ps_backoff_max_ms >= --ps_backoff_ms, "
                        "--momentum in [0, 1)\n");
        return 2;
    }
    if (place_policy_from_name(f->placement_s, &c->placement) != 0) {
        fprintf(stderr, "workerd: --placement must be bytes or round_robin, got '%s'\n", f->placement_s);
        return 2;
    }
    if (f->partition_bytes < 4) {
        fprintf(stderr, "workerd: --partition_bytes must be at least 4\n");
        return 2;
    }
    c->partition_bytes = f->partition_bytes;
    optim_defaults(&c->optim, kind, f->lr);
    if (kind == OPTIM_MOMENTUM || f->momentum_given)
        c->optim.momentum = f->momentum;
    if (set_optim_flags(&c->optim, f) != 0)
        return 2;
    return 0;
}

/* --model or --hidden_units into c->layout: 0, or 2 after a line on stderr. */
static int configure_model(train_config *c, const workerd_flags *f)
{
    char err[512];
    if (strcmp(f->data, "langid") == 0) {
        const char *spec = f->model_s ? f->model_s : LANGID_DEFAULT_SPEC;
        if (f->hidden_s) {
            fprintf(stderr, "workerd: --data=langid takes --model=embed:ROWSxDIM[,mean|sum],LAYERS..., not --hidden_units\n");
            return 2;
        }
        if (langid_parse_spec(spec, &c->langid, err, sizeof(err)) != 0 ||
            model_layout_init(&c->layout, c->langid.rest, (model_shape){1, 1, c->langid.dim}, LANGID_N_LANGS, err,
                              sizeof(err)) != 0) {
            fprintf(stderr, "workerd: --model: %s\n", err);
            return 2;
        }
        snprintf(c->langid.spec, sizeof(c->langid.spec), "%s", spec);
        if (f->langid_words < 100 || f->langid_words > 10000000) {
            fprintf(stderr, "workerd: --langid_words must be 100 to 10000000\n");
            return 2;
        }
        if (strcmp(f->allreduce, "none") != 0 || f->pipeline_stages) {
            /* the ring and the pipeline move whole dense buffers; the table is a sparse variable of the ps */
            fprintf(stderr, "workerd: --data=langid trains with the ps (async or sync) or --local: %s moves dense "
                            "variables only, and the embedding table is a sparse variable on the ps\n",
                    f->pipeline_stages ? "--pipeline_stages" : "--allreduce=ring");
            return 2;
        }
        c->data_langid = 1;
        c->langid_words = (int64_t)f->langid_words;
        c->data_dir_langid = strcmp(f->data_dir, "/usr/share/datasets/fashion-mnist") ? f->data_dir : NULL;
        return 0;
    }
    if (strcmp(f->data, "fashion-mnist") != 0) {
        fprintf(stderr, "workerd: --data must be fashion-mnist or langid, not '%s'\n", f->data);
        return 2;
    }
    /* --hidden_units=H is --model=mlp:H; the images are 28 x 28 x 1
     * (train_load checks the data against it) */
    char spec[MODEL_SPEC_MAX];
    const char *given = f->model_s ? f->model_s : MODEL_DEFAULT_SPEC;
    if (f->hidden_s && f->model_s) {
        fprintf(stderr, "workerd: --hidden_units and --model both given: --hidden_units=H is --model=mlp:H\n");
        return 2;
    }
    if (f->hidden_s && strlen(f->hidden_s) + 5 > sizeof(spec)) {
        fprintf(stderr, "workerd: --hidden_units is too long\n");
        return 2;
    }
    if (f->hidden_s)
        snprintf(spec, sizeof(spec), "mlp:%s", f->hidden_s);
    /* --model as given: a copy would cut a long one to another model */
    if (model_layout_init(&c->layout, f->hidden_s ? spec : given, (model_shape){28, 28, 1}, IDX_N_CLASSES, err,
                          sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --%s: %s\n", f->hidden_s ? "hidden_units" : "model", err);
        return 2;
    }
    return 0;
}

/* The data, the ps connection, staleness and moving averages into c: 0,
 * or 2 after a line on stderr. */
static int configure_ps_flags(train_config *c, const workerd_flags *f)
{
    c->data_dir = f->data_dir;
    c->batch_size = f->batch;
    c->train_steps = (int64_t)f->train_steps;
    c->seed = f->seed;
    c->log_every = f->log_every;
    c->recovery_wait_secs = f->recovery_wait;
    c->eval_secs = f->eval_secs;
    c->export_path = f->export_path;
    c->onnx_path = f->onnx_path;
    c->logits_path = f->logits_path;
    c->keep_ps = f->keep_ps;
    c->timeout_ms = f->timeout_ms;
    c->tls = f->tls || f->tls_ca;
    c->tls_ca = f->tls_ca;
    if (f->tls_ca && access(f->tls_ca, R_OK) != 0) {
        fprintf(stderr, "workerd: --tls_ca=%s: %s\n", f->tls_ca, strerror(errno));
        return 2;
    }
    c->retry_secs = f->retry_secs;
    c->num_epochs = f->num_epochs;
    c->max_staleness = f->max_staleness;
    c->staleness = f->staleness;
    if (f->moving_average_decay != 0 && !optim_ema_decay_ok(f->moving_average_decay)) {
        fprintf(stderr, "workerd: --moving_average_decay must be 0 (off) or between 0 and 1, both excluded, as a float32\n");
        return 2;
    }
    c->moving_average_decay = f->moving_average_decay;
    if (f->max_staleness < -1 || f->staleness < -1 || f->max_staleness > 1000000 || f->staleness > 1000000) {
        fprintf(stderr, "workerd: --max_staleness and --staleness must be -1 (none) or 0 to 1000000\n");
        return 2;
    }
    c->step_delay_ms = f->step_delay_ms;
    wire_dtype wd;
    if (wire_dtype_parse(f->wire_dtype_s, &wd) != 0 || strcmp(f->wire_dtype_s, wire_dtype_name(wd)) != 0) {
        fprintf(stderr, "workerd: --wire_dtype must be fp32, bf16 or fp16, got '%s'\n", f->wire_dtype_s);
        return 2;
    }
    c->wire = (int)wd;
    if (!(f->topk_ratio == 0 || (f->topk_ratio > 0 && f->topk_ratio < 1))) {
        fprintf(stderr, "workerd: --topk_ratio must be 0 (off) or above 0 and below 1, got %g\n", (double)f->topk_ratio);
        return 2;
    }
    c->topk_ratio = f->topk_ratio;
    c->one_round_trip = f->one_round_trip;
    c->overlap = f->overlap;
    c->overlap_min_bytes = f->overlap_min;
    c->backoff_ms = f->backoff_ms;
    c->backoff_max_ms = f->backoff_max_ms;
    c->threads = f->threads;
    return 0;
}

/* OpenBLAS's kernel and threads, and --device (its line printed): 0, 1
 * when no kernel works, 2 for a bad --device, after a line on stderr. */
static int choose_device(const workerd_flags *f, char **argv)
{
    char err[512];
    /* before anything is printed: it may re-execute workerd (same PID, argv) */
    if (blas_kernel_choose(argv, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 1;
    }
    model_cpu_set_threads(f->threads);
    char device_line[512];
    if (model_device_choose(f->device, f->gpu, f->tf32, device_line, sizeof(device_line), err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    printf("workerd: %s\n", device_line);
    fflush(stdout);
    return 0;
}

/* --allreduce and the ring's flags into c: 0, or 2 after a line on stderr. */
static int configure_ring(train_config *c, const workerd_flags *f)
{
    char err[512];
    if (strcmp(f->allreduce, "ring") == 0) {
        if (!(f->ring_timeout > 0) || f->ring_piece < 4 || f->save_ckpt_secs < 0 || f->local || f->num_epochs > 0) {
            fprintf(stderr, "workerd: --allreduce=ring needs --ring_timeout_secs > 0, --ring_piece_bytes >= 4, "
                            "--save_checkpoint_secs >= 0, no --local and no --num_epochs (one task leaving "
                            "stops the ring: use --train_steps)\n");
            return 2;
        }
        if (!f->ring_tls_cert != !f->ring_tls_key || (f->ring_tls_prio && !f->ring_tls_cert)) {
            fprintf(stderr, "workerd: --ring_tls_cert and --ring_tls_key go together (and --ring_tls_priorities "
                            "needs them)\n");
            return 2;
        }
        if (f->ring_tls_prio && ring_tls_priorities_check(f->ring_tls_prio, err, sizeof(err)) != 0) {
            fprintf(stderr, "workerd: --ring_tls_priorities=%s: %s\n", f->ring_tls_prio, err);
            return 2;
        }
        const char *pem[] = {f->ring_tls_cert, f->ring_tls_key};
        for (int i = 0; i < 2 && f->ring_tls_cert; i++)
            if (access(pem[i], R_OK) != 0) {
                fprintf(stderr, "workerd: --%s=%s: %s\n", i ? "ring_tls_key" : "ring_tls_cert", pem[i],
                        strerror(errno));
                return 2;
            }
        c->ring = 1;
    } else if (strcmp(f->allreduce, "none") != 0) {
        fprintf(stderr, "workerd: --allreduce must be none or ring, got '%s'\n", f->allreduce);
        return 2;
    } else if (f->ring_tls_cert || f->ring_tls_key || f->ring_tls_prio) {
        fprintf(stderr, "workerd: --ring_tls_cert, --ring_tls_key and --ring_tls_priorities need --allreduce=ring "
                        "(to the ps tasks: --tls or --tls_ca)\n");
        return 2;
    }
    c->ring_tls_cert = f->ring_tls_cert;
    c->ring_tls_key = f->ring_tls_key;
    c->ring_tls_priorities = f->ring_tls_prio;
    c->ring_timeout_secs = f->ring_timeout;
    c->ring_piece_bytes = (size_t)f->ring_piece;
    c->logdir = f->logdir;
    c->save_checkpoint_secs = f->save_ckpt_secs;
    c->log_param_hash = f->log_param_hash;
    return 0;
}

/* The flags every role reads checked and into c, in the order of their
 * messages (the device chosen and its line printed, the token read on the
 * way): 0, or the exit status after a line on stderr. */
static int configure(train_config *c, const workerd_flags *f, char **argv)
{
    char err[512];
    int st;
    if ((st = configure_basics(c, f)) != 0 || (st = configure_model(c, f)) != 0 ||
        (st = configure_ps_flags(c, f)) != 0 || (st = choose_device(f, argv)) != 0)
        return st;
    if (f->token_file && !(c->token = token_load(f->token_file, err, sizeof(err)))) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    return configure_ring(c, f);
}

/* The training roles' own checks (--evaluate_model does not meet them):
 * moving averages, the pipeline's flags (pipeline_train.c) and
 * --max_model_bytes. 0, or 2 after a line on stderr. */
static int configure_training(train_config *c, const workerd_flags *f)
{
    if (c->moving_average_decay > 0 && (f->local || c->ring)) {
        fprintf(stderr, "workerd: --moving_average_decay needs the ps tasks (they keep the averages): not with --%s\n",
                f->local ? "local" : "allreduce=ring");
        return 2;
    }
    if (train_pipeline_flags(c, f) != 0)
        return 2;
    if (f->max_model_bytes && !f->local && !f->pipeline_stages) {
        fprintf(stderr, "workerd: --max_model_bytes is for --local and --pipeline_stages\n");
        return 2;
    }
    c->max_model_bytes = f->max_model_bytes;
    if (f->local && f->max_model_bytes &&
        model_state_bytes(c->layout.n_params, MODEL_STATE_FLOATS_LOCAL) > f->max_model_bytes) {
        fprintf(stderr, "workerd: --local: the model %s has %zu parameters, %llu bytes with their gradients and "
                        "optimizer slots (%d floats each): more than --max_model_bytes=%llu; split it into stages "
                        "(--pipeline_stages)\n",
                c->layout.spec, c->layout.n_params,
                (unsigned long long)model_state_bytes(c->layout.n_params, MODEL_STATE_FLOATS_LOCAL),
                MODEL_STATE_FLOATS_LOCAL, (unsigned long long)f->max_model_bytes);
        return 2;
    }
    return 0;
}

/* The cluster (flags, else TF_CONFIG) into cs and c: this task's place
 * among the training tasks, --replicas_to_aggregate, the pipeline's checks
 * against the cluster (pipeline_train.c) and the task's name (into name).
 * 0, or 2 after a line on stderr (cs freed). */
static int configure_cluster(train_config *c, const workerd_flags *f, cluster_spec *cs, char *name, size_t len)
{
    char err[512];
    const char *tf = getenv("TF_CONFIG");
    cluster_input in = {.job_name = f->job_name,
                        .task_index = f->task_index,
                        .ps_hosts = f->ps_hosts,
                        .worker_hosts = f->worker_hosts ? f->worker_hosts : (tf && *tf ? NULL : "localhost:2223"),
                        .chief_hosts = f->chief_hosts,
                        .tf_config = tf,
                        .default_job = "worker",
                        /* the ring and a pipeline without the ps use no ps: localhost:2222 is
                         * then no default ps (it may be a worker's own address) */
                        .no_default_ps = c->ring || (f->pipeline_stages && strcmp(f->pipeline_updates, "ps") != 0)};
    if (cluster_spec_build(&in, cs, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    if (cs->job == JOB_PS) {
        fprintf(stderr, "workerd: this task is ps %d: run psd for ps tasks\n", cs->task_index);
        cluster_spec_free(cs);
        return 2;
    }
    c->cluster = cs;
    int has_chief = cs->jobs[JOB_CHIEF].n > 0;
    c->n_trainers = cs->jobs[JOB_WORKER].n + (has_chief ? 1 : 0);
    if (cs->job == JOB_CHIEF) {
        c->trainer = 0;
        c->is_chief = 1;
    } else if (cs->job == JOB_WORKER) {
        c->trainer = cs->task_index + (has_chief ? 1 : 0);
        c->is_chief = !has_chief && cs->task_index == 0;
    }
    if (f->replicas < 0 || f->replicas > c->n_trainers) {
        fprintf(stderr, "workerd: --replicas_to_aggregate=%d: must be 1 to %d (the training tasks)\n",
                f->replicas, c->n_trainers);
        cluster_spec_free(cs);
        return 2;
    }
    c->replicas_to_aggregate = f->replicas ? f->replicas : c->n_trainers;
    if (train_pipeline_cluster_flags(c, f) != 0) {
        cluster_spec_free(cs);
        return 2;
    }
    snprintf(name, len, "%s %d", cluster_job_name(cs->job), cs->task_index);
    c->name = name;
    if (c->ring && cs->job == JOB_EVALUATOR) {
        fprintf(stderr, "workerd: --allreduce=ring has no evaluator task (it reads from the ps): "
                        "the chief prints the test accuracy at the end\n");
        cluster_spec_free(cs);
        return 2;
    }
    return 0;
}

/* The role: --evaluate_model, --local, or this task's role in the cluster
 * (the evaluator, a pipeline stage, a ring member, a worker), each after the
 * checks of the flags it reads (configure_training, configure_cluster). The
 * exit status. */
static int run_role(train_config *c, const workerd_flags *f)
{
    if (f->convert_path) {
        c->name = "workerd";
        if (!f->onnx_path) {
            fprintf(stderr, "workerd: --convert_model=%s needs --export_onnx=FILE, the ONNX file to write\n",
                    f->convert_path);
            return 2;
        }
        return train_convert_file(c, f->convert_path, f->onnx_path);
    }
    if (f->evaluate_path) {
        c->name = "workerd";
        return train_evaluate_file(c, f->evaluate_path);
    }
    int st = configure_training(c, f);
    if (st != 0)
        return st;
    if (c->wire != WIRE_F32 && (f->local || c->data_langid || c->pipeline_stages || c->ring)) {
        /* what moves there is not the bulk push and pull --wire_dtype casts */
        fprintf(stderr, "workerd: --wire_dtype=%s is for training with the ps (async, sync, stale-synchronous); %s "
                        "moves float32\n", wire_dtype_name((wire_dtype)c->wire),
                f->local ? "--local" : c->data_langid ? "--data=langid" : c->pipeline_stages ? "--pipeline_stages"
                                                                                           : "--allreduce=ring");
        return 2;
    }
    if (c->topk_ratio > 0 && (f->local || c->data_langid || c->pipeline_stages || c->ring)) {
        fprintf(stderr, "workerd: --topk_ratio is for training with the ps (async, sync, stale-synchronous); %s "
                        "sends its tensors whole\n",
                f->local ? "--local" : c->data_langid ? "--data=langid" : c->pipeline_stages ? "--pipeline_stages"
                                                                                           : "--allreduce=ring");
        return 2;
    }
    if (c->data_langid && c->onnx_path) {
        fprintf(stderr, "workerd: --export_onnx: a --data=langid model (an embedding bag over hashed n-grams, a "
                        "sparse table) has no ONNX export; --export=FILE writes it as safetensors\n");
        return 2;
    }
    if (f->local) {
        c->name = "local";
        c->n_trainers = 1;
        c->is_chief = 1;
        return c->data_langid ? train_langid_local(c) : train_local(c);
    }
    cluster_spec cs;
    char name[64];
    if ((st = configure_cluster(c, f, &cs, name, sizeof(name))) != 0)
        return st;
    train_handle_signals();
    if (c->data_langid && cs.job == JOB_EVALUATOR) {
        fprintf(stderr, "workerd: --data=langid has no evaluator task: the evaluator pulls /v1/params, the dense "
                        "variables only, and the embedding table is a sparse variable on the ps (the chief reports "
                        "the test accuracy at the end)\n");
        cluster_spec_free(&cs);
        return 2;
    }
    st = c->data_langid              ? train_langid_worker(c)
         : cs.job == JOB_EVALUATOR ? train_evaluator(c)
         : c->pipeline_stages    ? train_pipeline(c)
         : c->ring               ? train_ring(c)
                                 : train_worker(c);
    cluster_spec_free(&cs);
    return st;
}

int main(int argc, char **argv)
{
    /* a line as soon as it is written, also into a pipe or a file (systemd's
     * journal, kubectl logs, a test reading the log as the job runs) */
    setvbuf(stdout, NULL, _IOLBF, 0);
    workerd_flags f;
    int st = workerd_parse_flags(&f, argc, argv);
    if (st >= 0)
        return st;
    train_config c = {0};
    if ((st = configure(&c, &f, argv)) == 0)
        st = run_role(&c, &f);
    free((char *)c.token);
    return st;
}
