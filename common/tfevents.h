/* tfevents.h - TensorBoard event files (events.out.tfevents.*) written in C,
 * so that `tensorboard --logdir=logs` shows a run: TFRecord framing (the
 * data's length as a little-endian uint64, its masked CRC-32C, the data, the
 * data's masked CRC-32C) of tensorflow.Event protocol buffers encoded by hand
 * (no protobuf library): the first record says file_version "brain.Event:2",
 * every other one is a scalar summary, Event{wall_time = 1, step = 2,
 * summary = 5 {value = 1 {tag = 1, simple_value = 2}}}.
 *
 * The writer queues encoded records in memory (a mutex and a copy: a caller
 * on a request path never waits for the disk); a thread of its own appends
 * them to the file every flush period and at tfevents_close, so a clean stop
 * loses nothing. The file is created (and its folder, with parents) at the
 * first flush with something to write, named as TensorFlow names them:
 * events.out.tfevents.<unix seconds>.<hostname>.<pid>. An I/O error is
 * logged once (until a write succeeds again); the records of a failed write
 * are dropped and a partly written record is cut off again, so the file
 * stays readable. Nothing here exits the process. */
#ifndef RESTPS_TFEVENTS_H
#define RESTPS_TFEVENTS_H

#include <stddef.h>
#include <stdint.h>

#define TFEVENTS_FILE_VERSION "brain.Event:2"
#define TFEVENTS_FRAME_BYTES 16 /* length 8, length CRC 4, data CRC 4 */
#define TFEVENTS_TAG_MAX 128
/* A queue beyond this many bytes (the disk is stuck) drops new records. */
#define TFEVENTS_QUEUE_MAX (16u << 20)

/* ---- the format ---- */

/* TFRecord's masked CRC-32C: ((crc >> 15) | (crc << 17)) + 0xa282ead8. */
uint32_t tfevents_masked_crc(const void *buf, size_t len);
/* Frame len bytes of data as one TFRecord into out (room for
 * len + TFEVENTS_FRAME_BYTES). Returns the bytes written. */
size_t tfevents_frame(unsigned char *out, const void *data, size_t len);
/* Encode Event{wall_time, step, summary{value{tag, simple_value}}} into out
 * (cap bytes). Returns its length, -EINVAL for an empty tag or one over
 * TFEVENTS_TAG_MAX bytes, -ENOSPC when cap is too small. */
int tfevents_encode_scalar(unsigned char *out, size_t cap, double wall_time, int64_t step,
                           const char *tag, float value);
/* Encode Event{wall_time, file_version = TFEVENTS_FILE_VERSION}: the first
 * record of a file. Returns its length or -ENOSPC. */
int tfevents_encode_version(unsigned char *out, size_t cap, double wall_time);

/* ---- the writer ---- */

typedef struct tfevents tfevents;
/* Called from the writer's thread before each flush and once at
 * tfevents_close, with no lock of the writer's held: where a caller adds
 * the scalars it samples (rates) with tfevents_scalar. */
typedef void (*tfevents_sample_fn)(void *ctx, tfevents *w);

/* A writer for folder dir; who: the subject of its log lines ("psd").
 * flush_ms: how often its thread writes (at least 10). sample: NULL or see
 * above. 0, or -ENOMEM / -EAGAIN (no thread) with *out NULL. */
int tfevents_open(tfevents **out, const char *who, const char *dir, int flush_ms,
                  tfevents_sample_fn sample, void *ctx);
/* Queue one scalar (a non-finite value is queued too: TensorBoard shows it). */
void tfevents_scalar(tfevents *w, const char *tag, int64_t step, double wall_time, double value);
/* Write what is queued now (any thread): 0, or a negative errno of the
 * failed write (already logged). */
int tfevents_flush(tfevents *w);
/* Sample, write what is queued, close the file, free. NULL is fine. */
void tfevents_close(tfevents *w);
/* The file's path ("" until the first write created it), copied to out. */
void tfevents_path(tfevents *w, char *out, size_t cap);
/* Records dropped so far (failed writes, a full queue). */
uint64_t tfevents_dropped(tfevents *w);

#endif
