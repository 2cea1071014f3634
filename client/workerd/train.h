/* train.h - the roles workerd plays: a training worker (the chief among them
 * initializes, configures, reports and exports), the evaluator, and --local
 * training in one process with no ps. */
#ifndef RESTPS_TRAIN_H
#define RESTPS_TRAIN_H

#include <stdint.h>

#include "cluster.h"
#include "data/data.h"
#include "model/model.h"
#include "optim.h"
#include "shards/shards.h"
#include "workerd/progress.h"

typedef struct train_config {
    const cluster_spec *cluster;
    int trainer;        /* this task's index among the training tasks */
    int n_trainers;     /* chief (when the cluster has one) + workers */
    int is_chief;
    const char *name;   /* "worker 1", "chief 0" for log lines */
    const char *data_dir;
    model_layout layout;    /* from --model (the canonical spec in layout.spec) */
    int batch_size;
    int64_t train_steps;
    optim_config optim;
    int sync;
    int replicas_to_aggregate;
    uint64_t seed;
    int log_every;
    double recovery_wait_secs;
    double eval_secs;
    const char *export_path;
    const char *onnx_path;  /* --export_onnx: the model as ONNX too (or alone) */
    const char *logits_path; /* --evaluate_logits (with --evaluate_model) */
    int keep_ps;
    const char *token;
    int tls;                /* HTTPS to the ps tasks */
    const char *tls_ca;     /* CA file to trust (NULL: the system's) */
    long timeout_ms;
    double retry_secs;      /* keep retrying a ps that does not answer this long */
    long backoff_ms, backoff_max_ms;
    int threads;
    place_policy placement;
    uint64_t partition_bytes;
    int max_staleness;      /* async: drop gradients staler than this; -1 none */
    int staleness;          /* stale-synchronous bound; -1 none */
    float moving_average_decay; /* the ps keeps moving averages (0: off); the evaluator and the export read them */
    double num_epochs;      /* leave after this many epochs of own batches; 0 = no end */
    int step_delay_ms;      /* test hook: sleep this long in each step */
    int wire;               /* --wire_dtype: a wire_dtype (WIRE_F32, WIRE_BF16, WIRE_F16) */
    double topk_ratio;      /* --topk_ratio: 0, or the fraction of each gradient a push carries */
    int one_round_trip;     /* async/SSP: the push answers with the parameters (no pull) */
    int overlap;            /* --overlap: transfers layer by layer beside the compute (shards/overlap.h) */
    uint64_t overlap_min_bytes; /* ... where at least this many bytes lie past the model's first layer */
    /* --allreduce=ring (ring_train.c): workers as peers, no ps */
    int ring;
    double ring_timeout_secs;   /* wait this long for a neighbour */
    size_t ring_piece_bytes;    /* chunks travel in pieces of this size */
    const char *ring_tls_cert;  /* PEM files: the ring over HTTPS (trusting tls_ca); NULL: HTTP */
    const char *ring_tls_key;
    const char *ring_tls_priorities; /* with ring_tls_cert: the GnuTLS priority string; NULL: the default */
    const char *logdir;         /* the chief's checkpoints; "" = none */
    int save_checkpoint_secs;   /* 0 = only at the end (and on a stop or a broken ring) */
    int log_param_hash;         /* print a CRC-32C of the parameters after every step */
    /* --pipeline_stages=K (pipeline_train.c): the model's layers split over K stages */
    int pipeline_stages;        /* 0 = off */
    const char *stage_layers;   /* --stage_layers, or NULL: the balanced split */
    int pipeline_schedule;      /* pipe_schedule_kind: gpipe or 1f1b */
    int micro_batches;          /* M; --batch_size is a multiple of it */
    double pipeline_timeout_secs; /* wait this long for a neighbouring stage */
    uint64_t max_model_bytes;   /* --local, a stage: refuse to train more model state than this (model_state_bytes); 0: no limit */
    int pipeline_ps;            /* --pipeline_updates=ps: the stages pull and push their variables on the ps (sync) */
    const int *ps_replicas;     /* the chief's configuration: replicas_to_aggregate per ps task; NULL: replicas_to_aggregate on every one */
    /* --data=langid (langid_train.c): the embedding bag and the word lists */
    int data_langid;
    langid_model langid;        /* layout is the dense layers of langid.rest, on [1, 1, dim] */
    int64_t langid_words;       /* words per language (--langid_words) */
    const char *data_dir_langid; /* the word lists' folder (NULL: /usr/share/dict) */
} train_config;

/* SIGTERM and SIGINT ask a worker to stop after the step in flight (exit 0). */
void train_handle_signals(void);
int train_stop_requested(void);

/* Each returns the process exit status: 0 done, 1 failed, 2 bad input (data),
 * TRAIN_NOTHING_TO_DO (train_worker) the ps tasks restored a checkpoint at or
 * past --train_steps: nothing trained, nothing reported or exported. */
#define TRAIN_NOTHING_TO_DO 3
int train_worker(const train_config *c);
/* --data=langid: --local, and a worker or the chief against the ps tasks. */
int train_langid_local(const train_config *c);
int train_langid_worker(const train_config *c);
/* The dense layers' start: model_init_params, the last layer zero (langid_train.c). */
void langid_init_params(const train_config *c, float *params);
/* The placement map's "sparse" list: the embedding table, its rows by id mod ps_tasks. */
json_t *langid_placement(const train_config *c, int ps_tasks);
int train_evaluator(const train_config *c);
int train_local(const train_config *c);
int train_ring(const train_config *c);
int train_pipeline(const train_config *c);
/* The split --pipeline_stages and --stage_layers give (pipeline_plan.h); 0,
 * or -1 with err. (pipeline_train.c) */
struct pipe_plan;
int pipe_plan_for(const train_config *c, struct pipe_plan *p, char *err, size_t errlen);
/* workerd's checks of --pipeline_stages and the flags only about it
 * (pipeline_train.c): train_pipeline_flags before the role is known (into
 * c: the stages, schedule, micro-batches, timeout; the split checked),
 * train_pipeline_cluster_flags once c->cluster is (where the updates
 * happen, the tasks as K x R). 0, or 2 after a line on stderr. */
struct workerd_flags;
int train_pipeline_flags(train_config *c, const struct workerd_flags *f);
int train_pipeline_cluster_flags(train_config *c, const struct workerd_flags *f);

/* Shared by the roles (role_common.c, model_file.c). */

/* Load and check --data_dir; 0 or 2 after a message. */
int train_load(const train_config *c, idx_dataset *ds);
/* Write --export (a safetensors file of the model); 0 or -1 after a message. */
int export_model(const train_config *c, const float *params, int64_t step);
/* Print the validation and test figures of params; 0, or -1 after a message
 * when the backend failed (a CUDA or cuBLAS call). */
int final_report(const train_config *c, model *m, const float *params, const idx_dataset *ds,
                 int64_t step);
/* The metadata every model file carries (export, checkpoints): "model" (the
 * canonical spec) and "input_shape" ("28,28,1"), and the old "layers" (the
 * input and each dense or conv layer's output size: "784,100,10" for
 * mlp:100). shape and layers are the caller's buffers. */
void model_file_meta(const model_layout *L, char *shape, size_t shape_len, char *layers,
                     size_t layers_len);
/* --evaluate_model=FILE: rebuild the model from the file's metadata alone and
 * print its test loss and accuracy; 0, 1 failed, 2 bad file or data. */
int train_evaluate_file(const train_config *c, const char *path);
/* --convert_model=FILE --export_onnx=OUT: the same model file as ONNX; 0, 1
 * failed, 2 bad file. */
int train_convert_file(const train_config *c, const char *path, const char *onnx_path);

/* Shared by the role files (train.c, chief.c, evaluator.c, local.c). */
/* Sleep secs, or less when a stop was requested. */
void train_sleep(double secs);
/* A libps client of the cluster's ps tasks; NULL after a message. */
ps_client *train_connect_ps(const train_config *c, long timeout_ms);
/* Poll path on every ps until each answers 200, saying what it waits for
 * (exits on a wrong token or certificate, or on a stop). */
void train_wait_for_all(const train_config *c, ps_client *pc, const char *path, const char *what);
/* This process's instance string (host, pid, random: task_claim.c) into
 * out (at least 80 bytes). */
void train_task_instance(char *out, size_t n);
/* Claim this task's id on ps 0 (POST /v1/heartbeat with the instance): 0
 * claimed (or a ps that does not know claims); -1 after a message naming
 * the process and address that hold it (after waiting a few seconds for a
 * previous process's claim to lapse). */
int train_claim_task(const train_config *c, ps_client *pc, const char *instance);
/* The chief's placement (GET /v1/placement on ps 0) must be this task's: the
 * same model, --placement and --partition_bytes. 0 when it is, else -1
 * after a message (naming both models when they differ). */
int train_check_placement(const train_config *c, ps_client *pc, const shards *sh);
/* The chief (chief.c): create the variables, send the placement and the
 * configuration (0, 1 failed, 2 other flags than the ps have; a ps that
 * refuses the configuration (409: it holds another job, e.g. restored from
 * a checkpoint) is named with psd's reason and what to do, and the ps tasks
 * are stopped, unless --keep_ps, after a few seconds for the others to
 * leave: 1); at the end,
 * wait (bounded) for the other tasks to say they finished. */
int train_chief_setup(const train_config *c, ps_client *pc, shards *sh, float *params);
void train_chief_wait_others(const train_config *c, ps_client *pc);
/* The chief, when ps i came back empty or behind (sh->s[i].back): put its
 * variables back from params (what the chief pulled last from it, at
 * sh->s[i].step), the placement, the configuration with that global_step,
 * and a checkpoint; 0, or -1 after a message. */
int train_chief_put_back(const train_config *c, ps_client *pc, shards *sh, const float *params, int i);
/* The chief at the very end: ask every ps task to stop, unless --keep_ps. */
void train_chief_stop_ps(const train_config *c, ps_client *pc);

/* The role buffers (role_common.c): what a training role that steps on this
 * task's batches holds (train.c, ring_train.c, local.c): the data, the model,
 * the parameters and gradients (from the backend: pinned on a GPU), the
 * optimizer's slots (the CPU's), two batch buffers, the data order (task
 * c->trainer of c->n_trainers; --local is task 0 of 1), and the step loop's
 * clocks and progress bar. */
typedef struct role_bufs {
    const train_config *c;
    idx_dataset ds;
    model *m;
    float *params, *grads; /* grads: n_params + grad_extra floats */
    float *s0, *s1;        /* with slots; else NULL */
    /* two batch buffers: a step computes on bp.x[cur], bp.y[cur] while the
     * next batch goes into the other one and is staged (model_stage_batch),
     * its copy to the device overlapping what the role does in between */
    batch_pair bp;
    int cur;
    batcher b;
    progress bar;
    double t_start, t_log; /* the loop's start, the last log line */
    int64_t ex_since;      /* examples since the last log line */
} role_bufs;
/* Load --data_dir and allocate them: grad_extra more floats after the
 * gradients, the slots when slots. 0; 2 bad data (after train_load's
 * message); 1 after a message (out of memory, or the model's error), what
 * was allocated freed. */
int role_bufs_init(role_bufs *rb, const train_config *c, size_t grad_extra, int slots);
/* Free them, the backend's memory before the model. */
void role_bufs_free(role_bufs *rb);
/* This task's batch number k into batch buffer i. */
void role_bufs_gather(role_bufs *rb, int64_t k, int i);
/* The same, then on its way to the device (model_stage_batch; a failure
 * leaves the copy to the step). */
void role_bufs_stage(role_bufs *rb, int64_t k, int i);
/* Forward and backward on batch buffer cur for global step `step` into
 * grads; model_forward_backward's status. */
int role_bufs_forward_backward(role_bufs *rb, int64_t step, double *loss);
/* One update per variable, as the ps applies them, with gradient scale
 * `scale` (the slots share the parameters' offsets), for global step `step`. */
void role_bufs_apply(role_bufs *rb, float scale, int64_t step);
/* Start the step loop's clocks and its progress bar. */
void role_bufs_start(role_bufs *rb);
/* After a step: `local` steps done by this task, the bar at global step
 * bar_step; every --log_every local steps (the bar off) the log line, naming
 * global step log_step when global (not --local). */
void role_bufs_step_done(role_bufs *rb, int64_t local, int64_t bar_step, int global,
                         int64_t log_step, double loss);

#endif
