/* checkpoint.h - a ps shard on disk: the checkpoint file format, writing it
 * atomically, reading it back with every check. The folder of them (names,
 * listing, pruning, temp files) is common/ckptdir.h.
 *
 * A checkpoint is one safetensors file, <dir>/model.ckpt-<global_step>.safetensors:
 * - every variable under its own name, F32;
 * - the optimizer's state beside it as "<name>:<slot>" (momentum's
 *   "momentum", adam's "adam_m" and "adam_v"); ':' never occurs in a
 *   variable name, so the two cannot collide;
 * - __metadata__ (all strings): format "restps-checkpoint", format_version
 *   "1", global_step, task ("ps:0"), ps_tasks, saved_at (UTC, ISO 8601),
 *   config (JSON: the training configuration, or null before the chief sent
 *   one), variables (JSON: name -> {version, updates, slots: [...]}),
 *   placement (JSON: this ps task, the number of ps tasks, its variables),
 *   state (JSON: last_loss, stale_dropped, pushes_applied), crc32c (JSON:
 *   tensor name -> CRC-32C of its bytes, 8 hex digits), and meta_crc32c: the
 *   CRC-32C of every other metadata entry, in byte order of the keys, each as
 *   key NUL value NUL.
 * A file validates when its header parses (offsets inside the file, tiling
 * the data), both checksums match, and every variable has the slots its
 * optimizer needs. */
#ifndef RESTPS_CHECKPOINT_H
#define RESTPS_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "ckptdir.h"
#include "store.h"

#define CKPT_FORMAT "restps-checkpoint"
#define CKPT_FORMAT_VERSION "1"

typedef struct ckpt_info {
    int task_index; /* this ps task */
    int ps_tasks;   /* how many the cluster has */
} ckpt_info;

/* Write sv atomically to path (temp file, fsync, rename, fsync of the
 * folder); path is untouched on failure. after_part: see st_write_file_parts. */
int ckpt_write(const char *path, const store_saved *sv, const ckpt_info *info,
               void (*after_part)(void *ctx, int i), void *ctx, char *err, size_t errlen);

/* Read and validate path; on success (0) *out holds it (blobs from pool;
 * free with store_saved_free). Only the header is read whole: each tensor is
 * read from the file straight into its blob and checked there, so the peak
 * memory is the model once (plus the header), not the file plus the model. Otherwise err says why and the result says
 * what that means: CKPT_EINVALID the file is broken (truncated, checksums,
 * ...), CKPT_EREAD it could not be read now (I/O error, out of memory: the
 * file may be fine), CKPT_EOTHER it is valid but another task's or another
 * cluster's (info: this task; NULL = no check). What is not a regular file
 * (a folder, a FIFO, ...) is CKPT_EREAD, "not a regular file (a fifo)", and
 * is never opened in a way that blocks. The codes: ckptdir.h. */
int ckpt_read(const char *path, bufpool *pool, const ckpt_info *info, store_saved *out, char *err,
              size_t errlen);

/* Whether path is one of this task's checkpoints as far as its header goes,
 * for pruning (saver.c), without reading the tensors: 0 when it is a regular
 * file (not followed through a symbolic link) whose header parses, whose
 * format and metadata checksum are right and which says it is self's (task
 * and number of ps tasks); otherwise err says why: CKPT_EREAD (it could not
 * be read, or is not a regular file: a folder, a FIFO, ... never opened in a
 * way that blocks), CKPT_EINVALID (broken header or metadata) or CKPT_EOTHER
 * (another task's or cluster's). */
int ckpt_owned(const char *path, const ckpt_info *self, char *err, size_t errlen);

#endif
