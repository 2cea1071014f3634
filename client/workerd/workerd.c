/* workerd.c - the worker process: flags and TF_CONFIG, then the role (a
 * training worker, the chief, the evaluator, or --local training). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/model.h"
#include "cluster.h"
#include "flags.h"
#include "data/data.h"
#include "libps/libps.h"
#include "pipeline/pipeline.h"
#include "ring/ring.h"
#include "tls_priorities.h"
#include "token.h"
#include "workerd/train.h"

/* The optimizer's other flags into c (kind and defaults set); 0, or -1
 * after one line on stderr. */
static int set_optim_flags(optim_config *c, int nesterov, float rmsprop_decay, float init_accum,
                           float clip_norm, float weight_decay, const char *lr_schedule,
                           int decay_steps, float decay_rate, int staircase, float alpha)
{
    const char *bad = NULL;
    if (nesterov && c->kind != OPTIM_MOMENTUM)
        bad = "--nesterov needs --optimizer=momentum";
    else if (!(rmsprop_decay >= 0 && rmsprop_decay < 1))
        bad = "--rmsprop_decay must be in [0, 1)";
    else if (!(init_accum > 0) || isinf(init_accum))
        bad = "--initial_accumulator_value must be positive";
    else if (!(clip_norm >= 0) || isinf(clip_norm))
        bad = "--clip_norm must be >= 0 (0: off)";
    else if (!(weight_decay >= 0) || isinf(weight_decay))
        bad = "--weight_decay must be >= 0 (0: off)";
    else if (optim_schedule_from_name(lr_schedule, &c->lr_schedule) != 0)
        bad = "--lr_schedule must be constant, exponential or cosine";
    else if (c->lr_schedule != OPTIM_LR_CONSTANT && decay_steps < 1)
        bad = "--lr_schedule=exponential and cosine need --decay_steps >= 1";
    else if (c->lr_schedule == OPTIM_LR_EXPONENTIAL && (!(decay_rate > 0) || isinf(decay_rate)))
        bad = "--lr_schedule=exponential needs --decay_rate > 0";
    else if (!(alpha >= 0 && alpha <= 1))
        bad = "--alpha must be in [0, 1]";
    if (bad) {
        fprintf(stderr, "workerd: %s\n", bad);
        return -1;
    }
    c->nesterov = nesterov;
    c->rmsprop_decay = rmsprop_decay;
    c->initial_accumulator_value = init_accum;
    c->clip_norm = clip_norm;
    c->weight_decay = weight_decay;
    c->decay_steps = decay_steps > 0 ? decay_steps : 0;
    c->decay_rate = decay_rate;
    c->staircase = staircase;
    c->alpha = alpha;
    optim_clear_unused(c);
    return 0;
}

int main(int argc, char **argv)
{
    const char *job_name = NULL, *ps_hosts = NULL, *worker_hosts = NULL, *chief_hosts = NULL;
    const char *ring_tls_cert = NULL, *ring_tls_key = NULL, *ring_tls_prio = NULL;
    const char *token_file = NULL, *tls_ca = NULL, *data_dir = "/usr/share/datasets/fashion-mnist";
    const char *hidden_s = NULL, *model_s = NULL, *evaluate_path = NULL, *optimizer = "adam", *export_path = NULL, *placement_s = "bytes";
    uint64_t partition_bytes = 4ULL << 20;
    int task_index = -1, timeout_ms = 30000, batch = 100, sync = 0, issync = -1, replicas = 0;
    int log_every = 100, keep_ps = 0, local = 0, threads = 1, tls = 0;
    uint64_t train_steps = 10000, seed = 1;
    float lr = 0.01f, momentum = 0.9f, recovery_wait = 1, eval_secs = 10, retry_secs = 120;
    int backoff_ms = 100, backoff_max_ms = 2000, step_delay_ms = 0;
    float num_epochs = 0;
    int max_staleness = -1, staleness = -1;
    float moving_average_decay = 0;
    const char *lr_schedule = "constant";
    int nesterov = 0, staircase = 0, decay_steps = 0;
    float clip_norm = 0, weight_decay = 0, decay_rate = 0, alpha = 0, rmsprop_decay = 0.9f,
          init_accum = 0.1f;
    const char *allreduce = "none", *logdir = "logs/ring";
    float ring_timeout = 30;
    uint64_t ring_piece = 1ULL << 20;
    uint64_t max_model_bytes = 0; /* --max_model_bytes: 0 = no limit */
    int save_ckpt_secs = 60, log_param_hash = 0;
    const char *device = "auto";
    int gpu = 0, tf32 = 0;
    int pipeline_stages = 0, micro_batches = 4;
    const char *stage_layers = NULL, *pipeline_schedule = "1f1b", *pipeline_updates = "auto";
    float pipeline_timeout = 60;
    flag flags[] = {
        {"job_name", FLAG_STRING, &job_name, "this task's job: worker (default), chief or evaluator", 0},
        {"task_index", FLAG_INT, &task_index, "this task's index in its job (default 0)", 0},
        {"ps_hosts", FLAG_STRING, &ps_hosts, "comma-separated host:port of the ps tasks (default localhost:2222)", 0},
        {"worker_hosts", FLAG_STRING, &worker_hosts, "comma-separated host:port of the worker tasks (default localhost:2223)", 0},
        {"chief_hosts", FLAG_STRING, &chief_hosts, "host:port of the chief task, if the cluster has one (else worker 0 is the chief)", 0},
        {"data_dir", FLAG_STRING, &data_dir, "folder of the MNIST-format IDX files, raw or .gz (default /usr/share/datasets/fashion-mnist)", 0},
        {"model", FLAG_STRING, &model_s, "the model (default mlp:100, the example's 784-100-10): mlp:H1,H2,... (dense layers + ReLU, then dense 10), cnn (the TensorFlow layers tutorial's: conv:5x5x32,pool:2,conv:5x5x64,pool:2,dense:1024,dropout:0.4,dense:10), or a layer list of conv:KHxKWxC[/S][:same|:valid] (+ ReLU), pool:K[/S][:same|:valid] (max), dense:N (+ ReLU, except the last, which must be dense:10) and dropout:R; every task must use the same", 0},
        {"hidden_units", FLAG_STRING, &hidden_s, "the example's name for --model=mlp:H1,H2,...: hidden layer sizes, e.g. 100 or 256,128", 0},
        {"evaluate_model", FLAG_STRING, &evaluate_path, "evaluate this exported safetensors file (its model from its __metadata__ alone) on the test set of --data_dir, print the test loss and accuracy, and exit", 0},
        {"batch_size", FLAG_INT, &batch, "examples per step on each task (default 100)", 0},
        {"train_steps", FLAG_U64, &train_steps, "train until global_step reaches this (default 10000)", 0},
        {"optimizer", FLAG_STRING, &optimizer, "sgd, momentum, adam, adagrad or rmsprop, as tf.compat.v1.train's (default adam); the chief's choice is used", 0},
        {"learning_rate", FLAG_FLOAT, &lr, "learning rate (default 0.01)", 0},
        {"momentum", FLAG_FLOAT, &momentum, "momentum for --optimizer=momentum (default 0.9) and rmsprop (default 0.0)", 0},
        {"nesterov", FLAG_BOOL, &nesterov, "--optimizer=momentum: Nesterov momentum, as use_nesterov (default false)", 0},
        {"rmsprop_decay", FLAG_FLOAT, &rmsprop_decay, "--optimizer=rmsprop: the decay of the mean square (default 0.9; epsilon 1e-10)", 0},
        {"initial_accumulator_value", FLAG_FLOAT, &init_accum, "--optimizer=adagrad: the accumulator's start (default 0.1)", 0},
        {"clip_norm", FLAG_FLOAT, &clip_norm, "clip each variable's gradient to this L2 norm, as tf.clip_by_norm (default 0: off)", 0},
        {"weight_decay", FLAG_FLOAT, &weight_decay, "decoupled weight decay: each update first takes learning_rate x weight_decay x w off w (default 0: off)", 0},
        {"lr_schedule", FLAG_STRING, &lr_schedule, "learning rate by global_step: constant (default), exponential (needs --decay_steps, --decay_rate) or cosine (needs --decay_steps)", 0},
        {"decay_steps", FLAG_INT, &decay_steps, "the schedule's decay_steps (exponential, cosine)", 0},
        {"decay_rate", FLAG_FLOAT, &decay_rate, "exponential: learning_rate x decay_rate^(global_step / decay_steps)", 0},
        {"staircase", FLAG_BOOL, &staircase, "exponential: floor(global_step / decay_steps), a step decay (default false)", 0},
        {"alpha", FLAG_FLOAT, &alpha, "cosine: the rate it decays to, a fraction of --learning_rate (default 0)", 0},
        {"sync", FLAG_BOOL, &sync, "synchronous training: one update per step from replicas_to_aggregate gradients (default false)", 0},
        {"issync", FLAG_INT, &issync, "the original example's name for --sync: 1 sync, 0 async", 0},
        {"replicas_to_aggregate", FLAG_INT, &replicas, "sync: gradients per step (default: every training task)", 0},
        {"seed", FLAG_U64, &seed, "seed of the initialization and the data order (default 1)", 0},
        {"log_every", FLAG_INT, &log_every, "print a line every this many local steps (default 100; 0 = never)", 0},
        {"recovery_wait_secs", FLAG_FLOAT, &recovery_wait, "seconds between polls while waiting for the ps or the chief (default 1)", 0},
        {"eval_secs", FLAG_FLOAT, &eval_secs, "evaluator: seconds between evaluations (default 10)", 0},
        {"export", FLAG_STRING, &export_path, "chief (or --local): write the trained model to this safetensors file", 0},
        {"keep_ps", FLAG_BOOL, &keep_ps, "chief: leave the ps tasks running at the end (default: ask them to stop)", 0},
        {"local", FLAG_BOOL, &local, "train in this process alone, no ps (the reference for correctness and overhead)", 0},
        {"threads", FLAG_INT, &threads, "OpenBLAS threads (default 1: the safe choice beside other busy processes)", 0},
        {"device", FLAG_STRING, &device,
         model_cuda_built() ? "where the model computes: auto (default: cuda when a CUDA device is visible and usable, else cpu; the first line says which), cpu, or cuda (cuBLAS; no device is an error)"
                          : "where the model computes: auto (default) or cpu; cuda is an error: this workerd was built without CUDA", 0},
        {"gpu", FLAG_INT, &gpu, "cuda: the device to use, counted among those CUDA_VISIBLE_DEVICES leaves (default 0)", 0},
        {"tf32", FLAG_BOOL, &tf32, "cuda: let cuBLAS use TF32 tensor cores for the matrix products (faster, ~1e-3 relative error; default false: full FP32, as the cpu)", 0},
        {"tls", FLAG_BOOL, &tls, "talk HTTPS to the ps tasks (psd --tls_cert), trusting the system's CAs (default false)", 0},
        {"tls_ca", FLAG_STRING, &tls_ca, "talk HTTPS to the ps tasks, trusting the CA(s) in this PEM file; with --ring_tls_cert, the CA(s) every ring neighbour's certificate must chain to (default: the system's)", 0},
        {"auth_token_file", FLAG_STRING, &token_file, "file holding the bearer token psd was started with; with --allreduce=ring it guards the ring too: every task requires it on the gradient pieces it receives and on GET /v1/ring/state, and sends it (/v1/status, /healthz and the page stay open; every task needs the same file)", 0},
        {"timeout_ms", FLAG_INT, &timeout_ms, "per-request timeout in milliseconds (default 30000)", 0},
        {"placement", FLAG_STRING, &placement_s, "how variables go over the ps tasks: bytes (balance the bytes; default) or round_robin (TensorFlow's replica_device_setter); every task must use the same", 0},
        {"partition_bytes", FLAG_U64, &partition_bytes, "a variable larger than this is split by rows over the ps tasks (default 4194304)", 0},
        {"moving_average_decay", FLAG_FLOAT, &moving_average_decay, "(chief) the ps keeps an exponential moving average of each variable, shadow = D * shadow + (1 - D) * variable after each update, as tf.train.ExponentialMovingAverage(D) (constant decay, no num_updates); the evaluator and --export use the averages (default 0: off; else 0 < D < 1)", 0},
        {"max_staleness", FLAG_INT, &max_staleness, "async (chief): the ps drops gradients computed more than this many steps ago, as DropStaleGradientOptimizer (default -1: never)", 0},
        {"staleness", FLAG_INT, &staleness, "async (chief): stale-synchronous parallel: a worker runs at most this many iterations ahead of the slowest live worker (default -1: no bound; 0 waits for everyone like sync)", 0},
        {"num_epochs", FLAG_FLOAT, &num_epochs, "leave the job after this many epochs of this task's own batches, as an input pipeline that runs out (default 0: no end; the others go on)", 0},
        {"step_delay_ms", FLAG_INT, &step_delay_ms, "test hook: sleep this long in every step, as a slow worker (default 0)", 0},
        {"ps_retry_secs", FLAG_FLOAT, &retry_secs, "once training runs, keep retrying a ps that does not answer for this long, e.g. while it restarts from its checkpoint (default 120; the evaluator waits at most 2 x --eval_secs, 10 at least)", 0},
        {"ps_backoff_ms", FLAG_INT, &backoff_ms, "first wait before retrying a ps, doubled each time, with jitter (default 100)", 0},
        {"ps_backoff_max_ms", FLAG_INT, &backoff_max_ms, "longest wait between retries (default 2000)", 0},
        {"allreduce", FLAG_STRING, &allreduce, "none (default): train against the ps tasks; ring: no ps, the chief and the workers sum their gradients in a ring all-reduce over HTTP (HTTPS with --ring_tls_cert), each serving it on its own --worker_hosts (or --chief_hosts) address, and every task applies the average (always synchronous; the ps flags are ignored); with --pipeline_stages, the same stage of the R replicas all-reduces its step's gradient sum in a ring over the stages' own endpoints (plain HTTP, --pipeline_timeout_secs) instead of sending it to the R - 1 others", 0},
        {"ring_timeout_secs", FLAG_FLOAT, &ring_timeout, "ring: a neighbour silent this long has died; the job stops (default 30; the first step waits at least 120 for every task to start)", 0},
        {"ring_tls_cert", FLAG_STRING, &ring_tls_cert, "ring: serve this task's ring endpoint over HTTPS only, with this PEM certificate (chain), which must name its --worker_hosts (or --chief_hosts) host, and send to the neighbours over HTTPS, verifying theirs against --tls_ca (default: the system's CAs), host name included; needs --ring_tls_key; every task needs one (a neighbour that speaks the other protocol, or whose certificate does not verify, stops this task at once, naming it)", 0},
        {"ring_tls_key", FLAG_STRING, &ring_tls_key, "ring: the PEM private key of --ring_tls_cert", 0},
        {"ring_tls_priorities", FLAG_STRING, &ring_tls_prio, "ring, with --ring_tls_cert: the GnuTLS priority string of the ring endpoint this task serves, which picks its TLS versions and cipher suites; this task's own requests (its pushes, the chief's state) offer those TLS versions alone (default psd's, " TLS_PRIORITIES_DEFAULT ": TLS 1.3/1.2, AEAD suites with AES-GCM first, ECDHE, the server's order); one GnuTLS rejects exits 2 naming the part, as does one that enables no TLS 1.2 or 1.3 (libcurl on OpenSSL 3 takes neither 1.0 nor 1.1); a task whose right neighbour or chief refuses a handshake offering its TLS versions but takes one offering any (twice in a row) stops at once, naming it", 0},
        {"ring_piece_bytes", FLAG_U64, &ring_piece, "ring: chunks travel in pieces of at most this many bytes, so sending and receiving overlap (default 1048576)", 0},
        {"logdir", FLAG_STRING, &logdir, "ring: the chief's checkpoints, <logdir>/model.ckpt-<global_step>.safetensors (the newest valid one is restored at start), and its TensorBoard event files, <logdir>/train/events.out.tfevents.* (loss, global_step/sec, examples/sec, learning_rate) (default logs/ring); empty = neither", 0},
        {"save_checkpoint_secs", FLAG_INT, &save_ckpt_secs, "ring: the chief writes a checkpoint this often (default 60; 0 = only at the end, on a stop and when the ring breaks)", 0},
        {"log_param_hash", FLAG_BOOL, &log_param_hash, "ring: print a CRC-32C of the parameters after every step (replicas must agree; default false)", 0},
        {"pipeline_stages", FLAG_INT, &pipeline_stages, "model parallelism: split the model's layers into K (2 to 8) contiguous stages, one per training task: task i (the chief task first, then the workers) is stage i mod K; each holds only its layers' parameters (and, without the ps, their optimizer slots), activations go forward and their gradients back to the neighbouring stage as HTTP POSTs to its own --worker_hosts (or --chief_hosts) address, and the chief (stage 0) reports and exports the whole model at the end. The training tasks number K x R: R replicas (task i is in replica i / K) each take their block of every batch, as sync workers do. Where the updates happen: see --pipeline_updates (default 0: off)", 0},
        {"pipeline_updates", FLAG_STRING, &pipeline_updates, "--pipeline_stages: ps: the chief (stage 0 of replica 0) initializes the variables on the ps tasks and configures them as a sync chief does (each ps aggregates the gradients of the stages whose variables it holds, R per variable), every stage pulls its layers' variables at a step's start and pushes its gradient mean over the micro-batches at its end (always sync; the ps keeps the optimizer, moving averages and checkpoints; the chief pulls the whole model at the end); local: no ps, each stage applies the optimizer to its own layers and the replicas exchange their gradient sums stage to stage (with --allreduce=ring: in a ring; the ps flags are ignored); auto (default): ps when --ps_hosts is given (or TF_CONFIG names ps tasks) and --allreduce is not ring, else local", 0},
        {"stage_layers", FLAG_STRING, &stage_layers, "--pipeline_stages: the stages' layer ranges, e.g. 0-3,4-6,7-9 (the layers of the expanded model: flatten and ReLU count; the start line prints the split); default: balance the estimated forward+backward FLOPs", 0},
        {"pipeline_schedule", FLAG_STRING, &pipeline_schedule, "--pipeline_stages: gpipe (every micro-batch forward, then every backward: M activations in flight) or 1f1b (one forward, one backward in the steady state: at most K in flight; default)", 0},
        {"micro_batches", FLAG_INT, &micro_batches, "--pipeline_stages: cut each --batch_size batch into this many micro-batches (1 to 256, dividing --batch_size; default 4); the update is the mean over the whole batch, as one worker's", 0},
        {"max_model_bytes", FLAG_U64, &max_model_bytes, "--local and --pipeline_stages (not with the ps): refuse to start (exit 2, saying what counts) when this task would hold more than this many bytes of model state: the parameters it trains, their gradients and the optimizer's two slots, 4 bytes each per parameter (--local: the whole model), a stage's gradients being its step's sum (4; with replicas 6, with --allreduce=ring 4 and a chunk of 4/R; one more where the backend does not add a micro-batch's gradients to the sum itself, as the CUDA one does not yet); stage 0 also gathers the whole model's parameters at the end, its training buffers freed (4 bytes per parameter, and 8 more per parameter of the other stages while their messages arrive). Activations and workspace are not counted (default 0: no limit)", 0},
        {"pipeline_timeout_secs", FLAG_FLOAT, &pipeline_timeout, "--pipeline_stages: a stage that waits this long for a neighbour's message says which stage and which message and stops, exit 1 (default 60; the first step waits at least 30 while the others start)", 0},
    };
    int nflags = (int)(sizeof(flags) / sizeof(flags[0]));
    char err[512];
    int fr = flags_parse(flags, nflags, argc, argv, err, sizeof(err));
    if (fr == 1) {
        flags_help(stdout,
                   "usage: workerd [flags]\n"
                   "The restps worker: trains a model (--model: the example's MLP, a CNN, or a\n"
                   "list of layers) on MNIST-format data against the ps tasks, as TensorFlow's\n"
                   "distributed MNIST example. The cluster comes from the flags\n"
                   "or the TF_CONFIG environment variable; flags win. The chief (the chief task,\n"
                   "else worker 0) creates the variables, sends the training configuration,\n"
                   "prints the final accuracy and stops the ps tasks at the end.\n"
                   "With --allreduce=ring there are no ps tasks: the chief and the workers form a\n"
                   "ring, each serving a small HTTP endpoint on its own cluster address; the chief\n"
                   "also serves /v1/status and the monitoring page there, and writes checkpoints.\n"
                   "With --pipeline_stages=K the training tasks are K stages x R replicas (task i is\n"
                   "stage i mod K of replica i / K), each serving its stage's endpoint on its own\n"
                   "address; with --ps_hosts (--pipeline_updates) the stages pull and push their\n"
                   "layers' variables on the ps tasks (sync), else each applies its own optimizer.\n"
                   "On the CPU, OpenBLAS's kernel set is chosen from what the cpu can run (cpuid:\n"
                   "AVX-512, AVX2+FMA), not its model name, and checked with a small sgemm\n"
                   "against a plain C product; one that fails is not used. This may re-execute\n"
                   "workerd once per kernel tried, with OPENBLAS_CORETYPE set (same PID and\n"
                   "arguments). An OPENBLAS_CORETYPE already in the environment, even an empty\n"
                   "one, is used as it is. The training line says which kernel and why.",
                   flags, nflags);
        return 0;
    }
    if (fr < 0) {
        fprintf(stderr, "workerd: %s (see workerd --help)\n", err);
        return 2;
    }
    if (flags_get(flags, nflags, "task_index")->given && task_index < 0) {
        fprintf(stderr, "workerd: --task_index=%d is negative\n", task_index);
        return 2;
    }
    if (issync >= 0) {
        if (issync > 1) {
            fprintf(stderr, "workerd: --issync must be 0 or 1\n");
            return 2;
        }
        if (flags_get(flags, nflags, "sync")->given && sync != issync) {
            fprintf(stderr, "workerd: --sync and --issync disagree\n");
            return 2;
        }
        sync = issync;
    }
    train_config c = {0};
    optim_kind kind;
    if (optim_from_name(optimizer, &kind) != 0) {
        fprintf(stderr, "workerd: --optimizer must be " OPTIM_NAMES ", got '%s'\n", optimizer);
        return 2;
    }
    if (!(lr > 0) || !(momentum >= 0 && momentum < 1) || batch < 1 || batch > 1000000 ||
        threads < 1 || timeout_ms < 1 || recovery_wait <= 0 || eval_secs <= 0 || train_steps < 1 ||
        !(retry_secs >= 0) || backoff_ms < 1 || backoff_max_ms < backoff_ms || !(num_epochs >= 0) ||
        step_delay_ms < 0) {
        fprintf(stderr, "workerd: --learning_rate, --batch_size, --train_steps, --threads, --timeout_ms, "
                        "--recovery_wait_secs, --eval_secs and --ps_backoff_ms must be positive, "
                        "--ps_retry_secs, --num_epochs and --step_delay_ms >= 0, --ps_backoff_max_ms >= --ps_backoff_ms, "
                        "--momentum in [0, 1)\n");
        return 2;
    }
    if (place_policy_from_name(placement_s, &c.placement) != 0) {
        fprintf(stderr, "workerd: --placement must be bytes or round_robin, got '%s'\n", placement_s);
        return 2;
    }
    if (partition_bytes < 4) {
        fprintf(stderr, "workerd: --partition_bytes must be at least 4\n");
        return 2;
    }
    c.partition_bytes = partition_bytes;
    optim_defaults(&c.optim, kind, lr);
    if (kind == OPTIM_MOMENTUM || flags_get(flags, nflags, "momentum")->given)
        c.optim.momentum = momentum;
    if (set_optim_flags(&c.optim, nesterov, rmsprop_decay, init_accum, clip_norm, weight_decay,
                        lr_schedule, decay_steps, decay_rate, staircase, alpha) != 0)
        return 2;
    /* --hidden_units=H is --model=mlp:H; the images are 28 x 28 x 1
     * (train_load checks the data against it) */
    char spec[MODEL_SPEC_MAX];
    if (hidden_s && model_s) {
        fprintf(stderr, "workerd: --hidden_units and --model both given: --hidden_units=H is --model=mlp:H\n");
        return 2;
    }
    if (hidden_s && strlen(hidden_s) + 5 > sizeof(spec)) {
        fprintf(stderr, "workerd: --hidden_units is too long\n");
        return 2;
    }
    if (hidden_s)
        snprintf(spec, sizeof(spec), "mlp:%s", hidden_s);
    else
        snprintf(spec, sizeof(spec), "%s", model_s ? model_s : MODEL_DEFAULT_SPEC);
    if (model_layout_init(&c.layout, spec, (model_shape){28, 28, 1}, IDX_N_CLASSES, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --%s: %s\n", hidden_s ? "hidden_units" : "model", err);
        return 2;
    }
    c.data_dir = data_dir;
    c.batch_size = batch;
    c.train_steps = (int64_t)train_steps;
    c.sync = sync;
    c.seed = seed;
    c.log_every = log_every;
    c.recovery_wait_secs = recovery_wait;
    c.eval_secs = eval_secs;
    c.export_path = export_path;
    c.keep_ps = keep_ps;
    c.timeout_ms = timeout_ms;
    c.tls = tls || tls_ca;
    c.tls_ca = tls_ca;
    if (tls_ca && access(tls_ca, R_OK) != 0) {
        fprintf(stderr, "workerd: --tls_ca=%s: %s\n", tls_ca, strerror(errno));
        return 2;
    }
    c.retry_secs = retry_secs;
    c.num_epochs = num_epochs;
    c.max_staleness = max_staleness;
    c.staleness = staleness;
    if (moving_average_decay != 0 && !optim_ema_decay_ok(moving_average_decay)) {
        fprintf(stderr, "workerd: --moving_average_decay must be 0 (off) or between 0 and 1, both excluded, as a float32\n");
        return 2;
    }
    c.moving_average_decay = moving_average_decay;
    if (max_staleness < -1 || staleness < -1 || max_staleness > 1000000 || staleness > 1000000) {
        fprintf(stderr, "workerd: --max_staleness and --staleness must be -1 (none) or 0 to 1000000\n");
        return 2;
    }
    c.step_delay_ms = step_delay_ms;
    c.backoff_ms = backoff_ms;
    c.backoff_max_ms = backoff_max_ms;
    c.threads = threads;
    /* before anything is printed: it may re-execute workerd (same PID, argv) */
    if (blas_kernel_choose(argv, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 1;
    }
    model_cpu_set_threads(threads);
    char device_line[512];
    if (model_device_choose(device, gpu, tf32, device_line, sizeof(device_line), err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    printf("workerd: %s\n", device_line);
    fflush(stdout);
    if (token_file && !(c.token = token_load(token_file, err, sizeof(err)))) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    if (strcmp(allreduce, "ring") == 0) {
        if (!(ring_timeout > 0) || ring_piece < 4 || save_ckpt_secs < 0 || local || num_epochs > 0) {
            fprintf(stderr, "workerd: --allreduce=ring needs --ring_timeout_secs > 0, --ring_piece_bytes >= 4, "
                            "--save_checkpoint_secs >= 0, no --local and no --num_epochs (one task leaving "
                            "stops the ring: use --train_steps)\n");
            free((char *)c.token);
            return 2;
        }
        if (!ring_tls_cert != !ring_tls_key || (ring_tls_prio && !ring_tls_cert)) {
            fprintf(stderr, "workerd: --ring_tls_cert and --ring_tls_key go together (and --ring_tls_priorities "
                            "needs them)\n");
            free((char *)c.token);
            return 2;
        }
        if (ring_tls_prio && ring_tls_priorities_check(ring_tls_prio, err, sizeof(err)) != 0) {
            fprintf(stderr, "workerd: --ring_tls_priorities=%s: %s\n", ring_tls_prio, err);
            free((char *)c.token);
            return 2;
        }
        const char *pem[] = {ring_tls_cert, ring_tls_key};
        for (int i = 0; i < 2 && ring_tls_cert; i++)
            if (access(pem[i], R_OK) != 0) {
                fprintf(stderr, "workerd: --%s=%s: %s\n", i ? "ring_tls_key" : "ring_tls_cert", pem[i],
                        strerror(errno));
                free((char *)c.token);
                return 2;
            }
        c.ring = 1;
    } else if (strcmp(allreduce, "none") != 0) {
        fprintf(stderr, "workerd: --allreduce must be none or ring, got '%s'\n", allreduce);
        free((char *)c.token);
        return 2;
    } else if (ring_tls_cert || ring_tls_key || ring_tls_prio) {
        fprintf(stderr, "workerd: --ring_tls_cert, --ring_tls_key and --ring_tls_priorities need --allreduce=ring "
                        "(to the ps tasks: --tls or --tls_ca)\n");
        free((char *)c.token);
        return 2;
    }
    c.ring_tls_cert = ring_tls_cert;
    c.ring_tls_key = ring_tls_key;
    c.ring_tls_priorities = ring_tls_prio;
    c.ring_timeout_secs = ring_timeout;
    c.ring_piece_bytes = (size_t)ring_piece;
    c.logdir = logdir;
    c.save_checkpoint_secs = save_ckpt_secs;
    c.log_param_hash = log_param_hash;
    if (evaluate_path) {
        c.name = "workerd";
        int rc = train_evaluate_file(&c, evaluate_path);
        free((char *)c.token);
        return rc;
    }
    if (c.moving_average_decay > 0 && (local || c.ring)) {
        fprintf(stderr, "workerd: --moving_average_decay needs the ps tasks (they keep the averages): not with --%s\n",
                local ? "local" : "allreduce=ring");
        free((char *)c.token);
        return 2;
    }
    if (pipeline_stages || stage_layers || flags_get(flags, nflags, "micro_batches")->given ||
        flags_get(flags, nflags, "pipeline_schedule")->given ||
        flags_get(flags, nflags, "pipeline_timeout_secs")->given ||
        flags_get(flags, nflags, "pipeline_updates")->given) {
        const char *bad = NULL;
        pipe_schedule_kind sk = PIPE_1F1B;
        if (!pipeline_stages)
            bad = "--stage_layers, --micro_batches, --pipeline_schedule, --pipeline_timeout_secs and --pipeline_updates "
                  "need --pipeline_stages";
        else if (pipeline_stages < PIPE_MIN_STAGES || pipeline_stages > PIPE_MAX_STAGES)
            bad = "--pipeline_stages must be 2 to 8";
        else if (local)
            bad = "--pipeline_stages is not for --local (--local is the one-process reference it is compared with)";
        else if (c.ring && (ring_tls_cert || flags_get(flags, nflags, "ring_timeout_secs")->given ||
                            flags_get(flags, nflags, "ring_piece_bytes")->given ||
                            flags_get(flags, nflags, "save_checkpoint_secs")->given))
            bad = "--pipeline_stages --allreduce=ring runs the ring over the stages' own endpoints (HTTP, "
                  "--pipeline_timeout_secs, whole chunks, no checkpoints): not with --ring_tls_cert, "
                  "--ring_timeout_secs, --ring_piece_bytes or --save_checkpoint_secs";
        else if (c.ring && strcmp(pipeline_updates, "ps") == 0)
            bad = "--allreduce=ring is for --pipeline_updates=local: with the ps, the ps averages the replicas";
        else if (strcmp(pipeline_updates, "auto") != 0 && strcmp(pipeline_updates, "ps") != 0 &&
                 strcmp(pipeline_updates, "local") != 0)
            bad = "--pipeline_updates must be ps, local or auto";
        else if (micro_batches < 1 || micro_batches > PIPE_MAX_MICRO || batch % micro_batches != 0)
            bad = "--micro_batches must be 1 to 256 and divide --batch_size";
        else if (pipe_schedule_from_name(pipeline_schedule, &sk) != 0)
            bad = "--pipeline_schedule must be gpipe or 1f1b";
        else if (!(pipeline_timeout > 0) || pipeline_timeout > 86400)
            bad = "--pipeline_timeout_secs must be > 0 (and at most a day)";
        if (bad) {
            fprintf(stderr, "workerd: %s\n", bad);
            free((char *)c.token);
            return 2;
        }
        c.pipeline_stages = pipeline_stages;
        c.stage_layers = stage_layers;
        c.pipeline_schedule = (int)sk;
        c.micro_batches = micro_batches;
        c.pipeline_timeout_secs = pipeline_timeout;
        pipe_plan plan;
        if (pipe_plan_for(&c, &plan, err, sizeof(err)) != 0) {
            if (stage_layers)
                fprintf(stderr, "workerd: --stage_layers=%s: %s\n", stage_layers, err);
            else
                fprintf(stderr, "workerd: --pipeline_stages=%d: %s\n", pipeline_stages, err);
            free((char *)c.token);
            return 2;
        }
    }
    if (max_model_bytes && !local && !pipeline_stages) {
        fprintf(stderr, "workerd: --max_model_bytes is for --local and --pipeline_stages\n");
        free((char *)c.token);
        return 2;
    }
    c.max_model_bytes = max_model_bytes;
    if (local && max_model_bytes &&
        model_state_bytes(c.layout.n_params, MODEL_STATE_FLOATS_LOCAL) > max_model_bytes) {
        fprintf(stderr, "workerd: --local: the model %s has %zu parameters, %llu bytes with their gradients and "
                        "optimizer slots (%d floats each): more than --max_model_bytes=%llu; split it into stages "
                        "(--pipeline_stages)\n",
                c.layout.spec, c.layout.n_params,
                (unsigned long long)model_state_bytes(c.layout.n_params, MODEL_STATE_FLOATS_LOCAL),
                MODEL_STATE_FLOATS_LOCAL, (unsigned long long)max_model_bytes);
        free((char *)c.token);
        return 2;
    }
    if (local) {
        c.name = "local";
        c.n_trainers = 1;
        c.is_chief = 1;
        int rc = train_local(&c);
        free((char *)c.token);
        return rc;
    }

    const char *tf = getenv("TF_CONFIG");
    cluster_input in = {.job_name = job_name,
                        .task_index = task_index,
                        .ps_hosts = ps_hosts,
                        .worker_hosts = worker_hosts ? worker_hosts : (tf && *tf ? NULL : "localhost:2223"),
                        .chief_hosts = chief_hosts,
                        .tf_config = tf,
                        .default_job = "worker"};
    cluster_spec cs;
    if (cluster_spec_build(&in, &cs, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        free((char *)c.token);
        return 2;
    }
    if (cs.job == JOB_PS) {
        fprintf(stderr, "workerd: this task is ps %d: run psd for ps tasks\n", cs.task_index);
        cluster_spec_free(&cs);
        free((char *)c.token);
        return 2;
    }
    c.cluster = &cs;
    int has_chief = cs.jobs[JOB_CHIEF].n > 0;
    c.n_trainers = cs.jobs[JOB_WORKER].n + (has_chief ? 1 : 0);
    if (cs.job == JOB_CHIEF) {
        c.trainer = 0;
        c.is_chief = 1;
    } else if (cs.job == JOB_WORKER) {
        c.trainer = cs.task_index + (has_chief ? 1 : 0);
        c.is_chief = !has_chief && cs.task_index == 0;
    }
    if (replicas < 0 || replicas > c.n_trainers) {
        fprintf(stderr, "workerd: --replicas_to_aggregate=%d: must be 1 to %d (the training tasks)\n",
                replicas, c.n_trainers);
        cluster_spec_free(&cs);
        free((char *)c.token);
        return 2;
    }
    c.replicas_to_aggregate = replicas ? replicas : c.n_trainers;
    if (c.pipeline_stages) {
        /* the rule: the ps when asked for, or (auto) when ps tasks are named and there is no ring */
        c.pipeline_ps = strcmp(pipeline_updates, "ps") == 0 ||
                        (strcmp(pipeline_updates, "auto") == 0 && !c.ring &&
                         (ps_hosts || (tf && *tf && cs.jobs[JOB_PS].n > 0)));
        const char *bad = NULL;
        if (!c.pipeline_ps && c.moving_average_decay > 0)
            bad = "--moving_average_decay needs the ps tasks: not with --pipeline_updates=local (give --ps_hosts)";
        else if (c.pipeline_ps && ((flags_get(flags, nflags, "sync")->given && !sync) || issync == 0))
            bad = "--pipeline_stages with the ps is synchronous: not with --sync=0 (the stages' gradients of one "
                  "step must meet one version of the parameters)";
        else if (c.pipeline_ps && replicas)
            bad = "--replicas_to_aggregate is not for --pipeline_stages (every stage of every replica counts; the "
                  "chief sets each ps's count)";
        else if (c.pipeline_ps && max_model_bytes)
            bad = "--max_model_bytes is not for --pipeline_stages with the ps yet (a stage pulls whole ps shards, "
                  "the chief initializes and pulls the whole model): use --pipeline_updates=local";
        else if (c.pipeline_ps && c.num_epochs > 0)
            bad = "--num_epochs is not for --pipeline_stages (one stage leaving stops the pipeline): use --train_steps";
        if (bad) {
            fprintf(stderr, "workerd: %s\n", bad);
            cluster_spec_free(&cs);
            free((char *)c.token);
            return 2;
        }
        if (c.pipeline_ps)
            c.sync = 1;
    }
    /* with the ps an evaluator task evaluates the ps's variables, as it does for sync workers */
    if (c.pipeline_stages && ((cs.job == JOB_EVALUATOR && !c.pipeline_ps) || c.n_trainers % c.pipeline_stages != 0 ||
                              c.n_trainers / c.pipeline_stages > PIPE_MAX_REPLICAS)) {
        if (cs.job == JOB_EVALUATOR)
            fprintf(stderr, "workerd: --pipeline_stages without the ps has no evaluator task (the variables are "
                            "the stages' own): the chief prints the test accuracy at the end; with --ps_hosts an "
                            "evaluator task evaluates the ps's\n");
        else if (c.n_trainers % c.pipeline_stages != 0)
            fprintf(stderr, "workerd: --pipeline_stages=%d: %d training tasks (chief + workers) are not whole "
                            "pipelines: they must number K x R (stages x replicas)\n",
                    c.pipeline_stages, c.n_trainers);
        else
            fprintf(stderr, "workerd: --pipeline_stages=%d: %d training tasks would be %d replicas: at most %d\n",
                    c.pipeline_stages, c.n_trainers, c.n_trainers / c.pipeline_stages, PIPE_MAX_REPLICAS);
        cluster_spec_free(&cs);
        free((char *)c.token);
        return 2;
    }
    char name[64];
    snprintf(name, sizeof(name), "%s %d", cluster_job_name(cs.job), cs.task_index);
    c.name = name;
    train_handle_signals();
    if (c.ring && cs.job == JOB_EVALUATOR) {
        fprintf(stderr, "workerd: --allreduce=ring has no evaluator task (it reads from the ps): "
                        "the chief prints the test accuracy at the end\n");
        cluster_spec_free(&cs);
        free((char *)c.token);
        return 2;
    }
    int rc = cs.job == JOB_EVALUATOR ? train_evaluator(&c)
             : c.pipeline_stages       ? train_pipeline(&c)
             : c.ring                  ? train_ring(&c)
                                       : train_worker(&c);
    cluster_spec_free(&cs);
    free((char *)c.token);
    return rc;
}
