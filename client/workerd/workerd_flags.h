/* workerd_flags.h - workerd's command line: the flags' values as its flag
 * table (workerd_flags.c) fills them, for main's checks (workerd.c) and the
 * pipeline's (pipeline_train.c). */
#ifndef RESTPS_WORKERD_FLAGS_H
#define RESTPS_WORKERD_FLAGS_H

#include <stdint.h>

typedef struct workerd_flags {
    const char *job_name, *ps_hosts, *worker_hosts, *chief_hosts;
    const char *ring_tls_cert, *ring_tls_key, *ring_tls_prio;
    const char *token_file, *tls_ca, *data_dir;
    const char *data;   /* --data: fashion-mnist (default) or langid */
    const char *wire_dtype_s; /* --wire_dtype: fp32 (default), bf16, fp16 */
    float topk_ratio;         /* --topk_ratio: 0 (off) or the fraction of each gradient pushed */
    int one_round_trip;       /* --one_round_trip (default 1) */
    int overlap;              /* --overlap (default 0) */
    uint64_t overlap_min;     /* --overlap_min_bytes (default 1 MiB) */
    uint64_t langid_words;
    const char *hidden_s, *model_s, *evaluate_path, *optimizer, *export_path, *placement_s;
    const char *onnx_path, *convert_path, *logits_path; /* --export_onnx, --convert_model, --evaluate_logits */
    uint64_t partition_bytes;
    int task_index, timeout_ms, batch, sync, issync, replicas;
    int log_every, keep_ps, local, threads, tls;
    uint64_t train_steps, seed;
    float lr, momentum, recovery_wait, eval_secs, retry_secs;
    int backoff_ms, backoff_max_ms, step_delay_ms;
    float num_epochs;
    int max_staleness, staleness;
    float moving_average_decay;
    const char *lr_schedule;
    int nesterov, staircase, decay_steps;
    float clip_norm, weight_decay, decay_rate, alpha, rmsprop_decay, init_accum;
    const char *allreduce, *logdir;
    float ring_timeout;
    uint64_t ring_piece;
    uint64_t max_model_bytes; /* --max_model_bytes: 0 = no limit */
    int save_ckpt_secs, log_param_hash;
    const char *device;
    int gpu, tf32;
    int pipeline_stages, micro_batches;
    const char *stage_layers, *pipeline_schedule, *pipeline_updates;
    float pipeline_timeout;
    /* which of the flags the checks ask about were on the command line */
    int task_index_given, sync_given, momentum_given;
    int micro_batches_given, pipeline_schedule_given, pipeline_timeout_given, pipeline_updates_given;
    int ring_timeout_given, ring_piece_given, save_ckpt_given;
} workerd_flags;

/* The command line into o: -1 to go on, else the exit status (--help: 0,
 * a bad flag: 2 after a line on stderr). */
int workerd_parse_flags(workerd_flags *o, int argc, char **argv);

#endif
