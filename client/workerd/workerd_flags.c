/* workerd_flags.c - workerd's flag table: the flags' defaults, their --help
 * text and the command line parsed into a workerd_flags; what the values
 * must be is main's to check (workerd.c), and the pipeline's
 * (pipeline_train.c). */
#include "workerd/workerd_flags.h"

#include <stdio.h>

#include "flags.h"
#include "data/langid.h"
#include "model/model.h"
#include "tls_priorities.h"

int workerd_parse_flags(workerd_flags *o, int argc, char **argv)
{
    *o = (workerd_flags){.data_dir = "/usr/share/datasets/fashion-mnist", .optimizer = "adam", .placement_s = "bytes", .wire_dtype_s = "fp32", .one_round_trip = 1,
                         .overlap_min = 1ULL << 20,
                         .partition_bytes = 4ULL << 20, .task_index = -1, .timeout_ms = 30000, .batch = 100,
                         .issync = -1, .log_every = 100, .threads = 1, .train_steps = 10000, .seed = 1,
                         .lr = 0.01f, .momentum = 0.9f, .recovery_wait = 1, .eval_secs = 10, .retry_secs = 120,
                         .backoff_ms = 100, .backoff_max_ms = 2000, .max_staleness = -1, .staleness = -1,
                         .lr_schedule = "constant", .rmsprop_decay = 0.9f, .init_accum = 0.1f,
                         .allreduce = "none", .logdir = "logs/ring", .ring_timeout = 30, .ring_piece = 1ULL << 20,
                         .save_ckpt_secs = 60, .device = "auto", .micro_batches = 4, .pipeline_schedule = "1f1b",
                         .pipeline_updates = "auto", .pipeline_timeout = 60, .data = "fashion-mnist",
                         .langid_words = 20000};
    flag flags[] = {
        {"job_name", FLAG_STRING, &o->job_name, "this task's job: worker (default), chief or evaluator", 0},
        {"task_index", FLAG_INT, &o->task_index, "this task's index in its job (default 0)", 0},
        {"ps_hosts", FLAG_STRING, &o->ps_hosts, "comma-separated host:port of the ps tasks (default localhost:2222)", 0},
        {"worker_hosts", FLAG_STRING, &o->worker_hosts, "comma-separated host:port of the worker tasks (default localhost:2223)", 0},
        {"chief_hosts", FLAG_STRING, &o->chief_hosts, "host:port of the chief task, if the cluster has one (else worker 0 is the chief)", 0},
        {"data_dir", FLAG_STRING, &o->data_dir, "folder of the MNIST-format IDX files, raw or .gz (default /usr/share/datasets/fashion-mnist)", 0},
        {"data", FLAG_STRING, &o->data, "the task: fashion-mnist (default: the IDX files of --data_dir) or langid (language identification of single words from Debian's word lists in /usr/share/dict, or --data_dir: character n-grams 2-5 hashed into an embedding table, a sparse variable on the ps; default model " LANGID_DEFAULT_SPEC "; trains --local, or with the ps tasks async or sync (the table sharded by id mod the ps tasks); the ring, the pipeline and the evaluator refuse it)", 0},
        {"langid_words", FLAG_U64, &o->langid_words, "--data=langid: words taken per language (default 20000; 10% of them are the test set)", 0},
        {"model", FLAG_STRING, &o->model_s, "the model (default mlp:100, the example's 784-100-10): mlp:H1,H2,... (dense layers + ReLU, then dense 10), cnn (the TensorFlow layers tutorial's: conv:5x5x32,pool:2,conv:5x5x64,pool:2,dense:1024,dropout:0.4,dense:10), or a layer list of conv:KHxKWxC[/S][:same|:valid] (+ ReLU), pool:K[/S][:same|:valid] (max), dense:N (+ ReLU, except the last, which must be dense:10) and dropout:R; every task must use the same", 0},
        {"hidden_units", FLAG_STRING, &o->hidden_s, "the example's name for --model=mlp:H1,H2,...: hidden layer sizes, e.g. 100 or 256,128", 0},
        {"evaluate_model", FLAG_STRING, &o->evaluate_path, "evaluate this exported safetensors file (its model from its __metadata__ alone) on the test set of --data_dir, print the test loss and accuracy, and exit", 0},
        {"batch_size", FLAG_INT, &o->batch, "examples per step on each task (default 100)", 0},
        {"train_steps", FLAG_U64, &o->train_steps, "train until global_step reaches this (default 10000)", 0},
        {"optimizer", FLAG_STRING, &o->optimizer, "sgd, momentum, adam, adagrad or rmsprop, as tf.compat.v1.train's (default adam); the chief's choice is used", 0},
        {"learning_rate", FLAG_FLOAT, &o->lr, "learning rate (default 0.01)", 0},
        {"momentum", FLAG_FLOAT, &o->momentum, "momentum for --optimizer=momentum (default 0.9) and rmsprop (default 0.0)", 0},
        {"nesterov", FLAG_BOOL, &o->nesterov, "--optimizer=momentum: Nesterov momentum, as use_nesterov (default false)", 0},
        {"rmsprop_decay", FLAG_FLOAT, &o->rmsprop_decay, "--optimizer=rmsprop: the decay of the mean square (default 0.9; epsilon 1e-10)", 0},
        {"initial_accumulator_value", FLAG_FLOAT, &o->init_accum, "--optimizer=adagrad: the accumulator's start (default 0.1)", 0},
        {"clip_norm", FLAG_FLOAT, &o->clip_norm, "clip each variable's gradient to this L2 norm, as tf.clip_by_norm (default 0: off)", 0},
        {"weight_decay", FLAG_FLOAT, &o->weight_decay, "decoupled weight decay: each update first takes learning_rate x weight_decay x w off w (default 0: off)", 0},
        {"lr_schedule", FLAG_STRING, &o->lr_schedule, "learning rate by global_step: constant (default), exponential (needs --decay_steps, --decay_rate) or cosine (needs --decay_steps)", 0},
        {"decay_steps", FLAG_INT, &o->decay_steps, "the schedule's decay_steps (exponential, cosine)", 0},
        {"decay_rate", FLAG_FLOAT, &o->decay_rate, "exponential: learning_rate x decay_rate^(global_step / decay_steps)", 0},
        {"staircase", FLAG_BOOL, &o->staircase, "exponential: floor(global_step / decay_steps), a step decay (default false)", 0},
        {"alpha", FLAG_FLOAT, &o->alpha, "cosine: the rate it decays to, a fraction of --learning_rate (default 0)", 0},
        {"sync", FLAG_BOOL, &o->sync, "synchronous training: one update per step from replicas_to_aggregate gradients (default false)", 0},
        {"issync", FLAG_INT, &o->issync, "the original example's name for --sync: 1 sync, 0 async", 0},
        {"replicas_to_aggregate", FLAG_INT, &o->replicas, "sync: gradients per step (default: every training task)", 0},
        {"seed", FLAG_U64, &o->seed, "seed of the initialization and the data order (default 1)", 0},
        {"log_every", FLAG_INT, &o->log_every, "print a line every this many local steps (default 100; 0 = never)", 0},
        {"recovery_wait_secs", FLAG_FLOAT, &o->recovery_wait, "seconds between polls while waiting for the ps or the chief (default 1)", 0},
        {"eval_secs", FLAG_FLOAT, &o->eval_secs, "evaluator: seconds from the start of one evaluation to the next (default 10); the final step, once the global step reaches --train_steps, is evaluated at once", 0},
        {"export", FLAG_STRING, &o->export_path, "chief (or --local): write the trained model to this safetensors file", 0},
        {"export_onnx", FLAG_STRING, &o->onnx_path, "chief (or --local): write the trained model (the moving averages with --moving_average_decay, as --export) to this ONNX file (opset 13: input NHWC [batch, H, W, C], outputs logits and probabilities); with --convert_model (or --evaluate_model), the file the conversion writes", 0},
        {"convert_model", FLAG_STRING, &o->convert_path, "convert this exported safetensors file (its model from its __metadata__ alone, as --evaluate_model) to the ONNX file --export_onnx names, and exit", 0},
        {"evaluate_logits", FLAG_STRING, &o->logits_path, "with --evaluate_model: also write the test set's logits to this safetensors file (tensors logits [n, 10] F32 and labels [n] U8)", 0},
        {"keep_ps", FLAG_BOOL, &o->keep_ps, "chief: leave the ps tasks running at the end (default: ask them to stop)", 0},
        {"local", FLAG_BOOL, &o->local, "train in this process alone, no ps (the reference for correctness and overhead)", 0},
        {"threads", FLAG_INT, &o->threads, "OpenBLAS threads (default 1: the safe choice beside other busy processes)", 0},
        {"device", FLAG_STRING, &o->device,
         model_cuda_built() ? "where the model computes: auto (default: cuda when a CUDA device is visible and usable, else cpu; the first line says which), cpu, or cuda (cuBLAS; no device is an error)"
                          : "where the model computes: auto (default) or cpu; cuda is an error: this workerd was built without CUDA", 0},
        {"gpu", FLAG_INT, &o->gpu, "cuda: the device to use, counted among those CUDA_VISIBLE_DEVICES leaves (default 0)", 0},
        {"tf32", FLAG_BOOL, &o->tf32, "cuda: let cuBLAS use TF32 tensor cores for the matrix products (faster, ~1e-3 relative error; default false: full FP32, as the cpu)", 0},
        {"tls", FLAG_BOOL, &o->tls, "talk HTTPS to the ps tasks (psd --tls_cert), trusting the system's CAs (default false)", 0},
        {"tls_ca", FLAG_STRING, &o->tls_ca, "talk HTTPS to the ps tasks, trusting the CA(s) in this PEM file; with --ring_tls_cert, the CA(s) every ring neighbour's certificate must chain to (default: the system's)", 0},
        {"auth_token_file", FLAG_STRING, &o->token_file, "file holding the bearer token psd was started with; with --allreduce=ring it guards the ring too: every task requires it on the gradient pieces it receives and on GET /v1/ring/state, and sends it (/v1/status, /healthz and the page stay open; every task needs the same file)", 0},
        {"timeout_ms", FLAG_INT, &o->timeout_ms, "per-request timeout in milliseconds (default 30000)", 0},
        {"placement", FLAG_STRING, &o->placement_s, "how variables go over the ps tasks: bytes (balance the bytes; default) or round_robin (TensorFlow's replica_device_setter); every task must use the same", 0},
        {"wire_dtype", FLAG_STRING, &o->wire_dtype_s, "the float type of the worker's pushes and pulls on the wire: fp32 (default), bf16 (round-to-nearest-even; half the bytes) or fp16 (the gradients times a dynamic loss scale, halved when the cast would overflow, which the ps divides out); the ps keeps float32 variables and optimizer slots either way, and the chief's final pull, its export and the evaluator read float32; --local, --allreduce=ring, --pipeline_stages and --data=langid take fp32 only", 0},
        {"overlap", FLAG_BOOL, &o->overlap, "the transfers beside the compute, layer by layer. With the ps (ByteScheduler's order): a push sends each layer's gradients as soon as the backward pass has them, last layer first, and the forward pass starts a layer as soon as the pull brought its parameters (float32 on the wire only: with --wire_dtype=bf16 or fp16 it is off). With --allreduce=ring (PyTorch DDP's buckets): the gradients are summed in buckets of whole layers, the last first, each as soon as the backward pass wrote it (every task needs the same --overlap and --overlap_min_bytes). The same floats as without (default false; off, saying so, where less than --overlap_min_bytes of the model lies past its first layer, which nothing can hide)", 0},
        {"overlap_min_bytes", FLAG_U64, &o->overlap_min, "--overlap: leave it off where fewer than this many bytes of the model lie past its first layer (default 1048576: on loopback about what the transfer thread's hand-offs cost a step; 0: always on); with --allreduce=ring also a bucket's least size (0: a bucket a layer)", 0},
        {"topk_ratio", FLAG_FLOAT, &o->topk_ratio, "top-k sparsification with error feedback (Deep Gradient Compression without its momentum correction): a push carries only the largest (by magnitude) R of each gradient's elements, as ids and values (POST /v1/grads, NAME:ids and NAME:values), and the rest is kept and added to the next step's gradient, so nothing is lost, only late; a tensor that would not get smaller goes whole. 0 (default): off; else above 0 and below 1 (0.01: 1 percent). For training with the ps; the pulls stay dense (--wire_dtype casts them); --overlap is off with it", 0},
        {"one_round_trip", FLAG_BOOL, &o->one_round_trip, "async and stale-synchronous: a push answers with the parameters after it (POST /v1/grads?return=params), so a step is one request to each ps instead of a push and a pull (default true; false: push, then pull)", 0},
        {"partition_bytes", FLAG_U64, &o->partition_bytes, "a variable larger than this is split by rows over the ps tasks (default 4194304)", 0},
        {"moving_average_decay", FLAG_FLOAT, &o->moving_average_decay, "(chief) the ps keeps an exponential moving average of each variable, shadow = D * shadow + (1 - D) * variable after each update, as tf.train.ExponentialMovingAverage(D) (constant decay, no num_updates); the evaluator and --export use the averages (default 0: off; else 0 < D < 1)", 0},
        {"max_staleness", FLAG_INT, &o->max_staleness, "async (chief): the ps drops gradients computed more than this many steps ago, as DropStaleGradientOptimizer (default -1: never)", 0},
        {"staleness", FLAG_INT, &o->staleness, "async (chief): stale-synchronous parallel: a worker runs at most this many iterations ahead of the slowest live worker (default -1: no bound; 0 waits for everyone like sync)", 0},
        {"num_epochs", FLAG_FLOAT, &o->num_epochs, "leave the job after this many epochs of this task's own batches, as an input pipeline that runs out (default 0: no end; the others go on)", 0},
        {"step_delay_ms", FLAG_INT, &o->step_delay_ms, "test hook: sleep this long in every step, as a slow worker (default 0)", 0},
        {"ps_retry_secs", FLAG_FLOAT, &o->retry_secs, "once training runs, keep retrying a ps that does not answer for this long, e.g. while it restarts from its checkpoint (default 120; the evaluator waits at most 2 x --eval_secs, 10 at least)", 0},
        {"ps_backoff_ms", FLAG_INT, &o->backoff_ms, "first wait before retrying a ps, doubled each time, with jitter (default 100)", 0},
        {"ps_backoff_max_ms", FLAG_INT, &o->backoff_max_ms, "longest wait between retries (default 2000)", 0},
        {"allreduce", FLAG_STRING, &o->allreduce, "none (default): train against the ps tasks; ring: no ps, the chief and the workers sum their gradients in a ring all-reduce over HTTP (HTTPS with --ring_tls_cert), each serving it on its own --worker_hosts (or --chief_hosts) address, and every task applies the average (always synchronous; the ps flags are ignored); with --pipeline_stages, the same stage of the R replicas all-reduces its step's gradient sum in a ring over the stages' own endpoints (plain HTTP, --pipeline_timeout_secs) instead of sending it to the R - 1 others", 0},
        {"ring_timeout_secs", FLAG_FLOAT, &o->ring_timeout, "ring: a neighbour silent this long has died; the job stops (default 30; the first step waits at least 120 for every task to start)", 0},
        {"ring_tls_cert", FLAG_STRING, &o->ring_tls_cert, "ring: serve this task's ring endpoint over HTTPS only, with this PEM certificate (chain), which must name its --worker_hosts (or --chief_hosts) host, and send to the neighbours over HTTPS, verifying theirs against --tls_ca (default: the system's CAs), host name included; needs --ring_tls_key; every task needs one (a neighbour that speaks the other protocol, or whose certificate does not verify, stops this task at once, naming it)", 0},
        {"ring_tls_key", FLAG_STRING, &o->ring_tls_key, "ring: the PEM private key of --ring_tls_cert", 0},
        {"ring_tls_priorities", FLAG_STRING, &o->ring_tls_prio, "ring, with --ring_tls_cert: the GnuTLS priority string of the ring endpoint this task serves, which picks its TLS versions and cipher suites; this task's own requests (its pushes, the chief's state) offer those TLS versions alone (default psd's, " TLS_PRIORITIES_DEFAULT ": TLS 1.3/1.2, AEAD suites with AES-GCM first, ECDHE, the server's order); one GnuTLS rejects exits 2 naming the part, as does one that enables no TLS 1.2 or 1.3 (libcurl on OpenSSL 3 takes neither 1.0 nor 1.1); a task whose right neighbour or chief refuses a handshake offering its TLS versions but takes one offering any (twice in a row) stops at once, naming it", 0},
        {"ring_piece_bytes", FLAG_U64, &o->ring_piece, "ring: chunks travel in pieces of at most this many bytes, so sending and receiving overlap (default 1048576)", 0},
        {"logdir", FLAG_STRING, &o->logdir, "ring: the chief's checkpoints, <logdir>/model.ckpt-<global_step>.safetensors (the newest valid one is restored at start), and its TensorBoard event files, <logdir>/train/events.out.tfevents.* (loss, global_step/sec, examples/sec, learning_rate) (default logs/ring); empty = neither", 0},
        {"save_checkpoint_secs", FLAG_INT, &o->save_ckpt_secs, "ring: the chief writes a checkpoint this often (default 60; 0 = only at the end, on a stop and when the ring breaks)", 0},
        {"log_param_hash", FLAG_BOOL, &o->log_param_hash, "ring: print a CRC-32C of the parameters after every step (replicas must agree; default false)", 0},
        {"pipeline_stages", FLAG_INT, &o->pipeline_stages, "model parallelism: split the model's layers into K (2 to 8) contiguous stages, one per training task: task i (the chief task first, then the workers) is stage i mod K; each holds only its layers' parameters (and, without the ps, their optimizer slots), activations go forward and their gradients back to the neighbouring stage as HTTP POSTs to its own --worker_hosts (or --chief_hosts) address, and the chief (stage 0) reports and exports the whole model at the end. The training tasks number K x R: R replicas (task i is in replica i / K) each take their block of every batch, as sync workers do. Where the updates happen: see --pipeline_updates (default 0: off)", 0},
        {"pipeline_updates", FLAG_STRING, &o->pipeline_updates, "--pipeline_stages: ps: the chief (stage 0 of replica 0) initializes the variables on the ps tasks and configures them as a sync chief does (each ps aggregates the gradients of the stages whose variables it holds, R per variable), every stage pulls its layers' variables at a step's start and pushes its gradient mean over the micro-batches at its end (always sync; the ps keeps the optimizer, moving averages and checkpoints; the chief pulls the whole model at the end); local: no ps, each stage applies the optimizer to its own layers and the replicas exchange their gradient sums stage to stage (with --allreduce=ring: in a ring; the ps flags are ignored); auto (default): ps when --ps_hosts is given (or TF_CONFIG names ps tasks) and --allreduce is not ring, else local", 0},
        {"stage_layers", FLAG_STRING, &o->stage_layers, "--pipeline_stages: the stages' layer ranges, e.g. 0-3,4-6,7-9 (the layers of the expanded model: flatten and ReLU count; the start line prints the split); default: balance the estimated forward+backward FLOPs", 0},
        {"pipeline_schedule", FLAG_STRING, &o->pipeline_schedule, "--pipeline_stages: gpipe (every micro-batch forward, then every backward: M activations in flight) or 1f1b (one forward, one backward in the steady state: at most K in flight; default)", 0},
        {"micro_batches", FLAG_INT, &o->micro_batches, "--pipeline_stages: cut each --batch_size batch into this many micro-batches (1 to 256, dividing --batch_size; default 4); the update is the mean over the whole batch, as one worker's", 0},
        {"max_model_bytes", FLAG_U64, &o->max_model_bytes, "--local and --pipeline_stages (not with the ps): refuse to start (exit 2, saying what counts) when this task would hold more than this many bytes of model state: the parameters it trains, their gradients and the optimizer's two slots, 4 bytes each per parameter (--local: the whole model), a stage's gradients being its step's sum (4; with replicas 6, with --allreduce=ring 4 and a chunk of 4/R; one more where the backend does not add a micro-batch's gradients to the sum itself, as the CUDA one does not yet); stage 0 also gathers the whole model's parameters at the end, its training buffers freed (4 bytes per parameter, and 8 more per parameter of the other stages while their messages arrive). Activations and workspace are not counted (default 0: no limit)", 0},
        {"pipeline_timeout_secs", FLAG_FLOAT, &o->pipeline_timeout, "--pipeline_stages: a stage that waits this long for a neighbour's message says which stage and which message and stops, exit 1 (default 60; the first step waits at least 30 while the others start)", 0},
    };
    int nflags = (int)(sizeof(flags) / sizeof(flags[0]));
    char err[512];
    int fr = flags_parse_prog("workerd", flags, nflags, argc, argv, err, sizeof(err));
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
                   "one, is used as it is. The training line says which kernel and why.\n"
                   "Exit statuses: 0 done, 1 failed, 2 bad flags or input, 3 nothing to train\n"
                   "(the ps tasks restored a checkpoint at or past --train_steps: a rerun on the\n"
                   "last run's --logdir; give them a new --logdir, or remove it, to train again).",
                   flags, nflags);
        return 0;
    }
    if (fr < 0) {
        fprintf(stderr, "workerd: %s\n", err); /* the hint is in err */
        return 2;
    }
    o->task_index_given = flags_get(flags, nflags, "task_index")->given;
    o->sync_given = flags_get(flags, nflags, "sync")->given;
    o->momentum_given = flags_get(flags, nflags, "momentum")->given;
    o->micro_batches_given = flags_get(flags, nflags, "micro_batches")->given;
    o->pipeline_schedule_given = flags_get(flags, nflags, "pipeline_schedule")->given;
    o->pipeline_timeout_given = flags_get(flags, nflags, "pipeline_timeout_secs")->given;
    o->pipeline_updates_given = flags_get(flags, nflags, "pipeline_updates")->given;
    o->ring_timeout_given = flags_get(flags, nflags, "ring_timeout_secs")->given;
    o->ring_piece_given = flags_get(flags, nflags, "ring_piece_bytes")->given;
    o->save_ckpt_given = flags_get(flags, nflags, "save_checkpoint_secs")->given;
    return -1;
}
