/* ckptdir.h - a folder of checkpoints, as psd's ps tasks (server/saver.c) and
 * the ring's chief (client/ring_ckpt.c) keep one: every checkpoint is
 * <dir>/model.ckpt-<global_step>.safetensors, the newest of which a restart
 * resumes from. This module names the files, reads the step back from a
 * name, lists a folder newest first, creates it, removes the temp files a
 * killed write left and prunes it to the newest N.
 *
 * The write itself is st_write_file_parts (safetensors.h), atomic for both:
 * a temp file <name>.tmp.<pid> beside the checkpoint, fsync, rename over it,
 * fsync of the folder; on failure the temp file is removed and the folder is
 * as it was. What a file holds is each reader's own (server/checkpoint.h,
 * client/ring_ckpt.h); the outcomes of reading one are the CKPT_E* codes
 * below, the same for both. */
#ifndef RESTPS_CKPTDIR_H
#define RESTPS_CKPTDIR_H

#include <stddef.h>
#include <stdint.h>

#define CKPT_PREFIX "model.ckpt-"
#define CKPT_SUFFIX ".safetensors"

/* Why a checkpoint was not used, or a folder could not be:
 * CKPT_EINVALID the file is broken (truncated, checksums, not a checkpoint's
 * name, ...); CKPT_EREAD it could not be read now (I/O error, out of memory:
 * the file may be fine) or the folder could not be listed; CKPT_EOTHER it is
 * valid but not this job's (another task's, cluster's, model's or
 * optimizer's); CKPT_EWRITE the folder could not be made or named. */
enum { CKPT_EINVALID = -1, CKPT_EREAD = -2, CKPT_EOTHER = -3, CKPT_EWRITE = -4 };

/* <dir>/model.ckpt-<step>.safetensors into out; CKPT_EWRITE when it does not
 * fit in cap. */
int ckptdir_path(const char *dir, int64_t step, char *out, size_t cap);

/* The step in a file name (no folder): 0 and *step for
 * "model.ckpt-<decimal digits>.safetensors" whose digits fit in an int64_t;
 * CKPT_EINVALID for any other name (signs, spaces, temp files, ".invalid"
 * ones, an empty or too large number). */
int ckptdir_step(const char *name, int64_t *step);

typedef struct ckptdir_entry {
    char *path;   /* <dir>/<name>, owned */
    int64_t step; /* from the file name */
} ckptdir_entry;

/* The checkpoints in dir, newest (highest step) first; among equal steps
 * ("-7" and "-007") by name. A missing folder is an empty list. CKPT_EREAD
 * with err when it cannot be read (or out of memory). Free with
 * ckptdir_list_free. */
int ckptdir_list(const char *dir, ckptdir_entry **out, int *n, char *err, size_t errlen);
void ckptdir_list_free(ckptdir_entry *e, int n);

/* mkdir -p dir: 0 when it is (now) a folder; CKPT_EWRITE with err
 * ("cannot create '<dir>': ...", "'<dir>' is not a folder") otherwise. */
int ckptdir_make(const char *dir, char *err, size_t errlen);

/* Remove the temp files (model.ckpt-*.safetensors.tmp.*) of writes that
 * never finished; how many were removed. */
int ckptdir_remove_temps(const char *dir);

/* Keep the newest `keep` checkpoints whose step is at most `newest`, remove
 * the older ones; the ones above `newest` are left and not counted
 * (INT64_MAX: every one counts). keep <= 0 removes nothing. How many were
 * removed. */
int ckptdir_prune(const char *dir, int keep, int64_t newest);

/* Prune only what the caller owns: among the entries of dir named like
 * checkpoints, those that are regular files (lstat: not a folder, FIFO or
 * symbolic link) and that owned(path, ctx) accepts (1) count; keep the
 * newest `keep` of them and remove the older ones, except `protect` (a path
 * as ckptdir_list makes them, or NULL), which is never removed. Everything
 * else is left as it is and not counted; skipped(path, why, ctx), when not
 * NULL, is told of each (why: "a folder", or what owned put in its why
 * buffer). keep <= 0 removes nothing. How many were removed. */
int ckptdir_prune_owned(const char *dir, int keep, const char *protect,
                        int (*owned)(const char *path, char *why, size_t whylen, void *ctx),
                        void (*skipped)(const char *path, const char *why, void *ctx), void *ctx);

#endif
