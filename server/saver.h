/* saver.h - the ps task's checkpoints over time, as tf.train.Supervisor's
 * saver: restore the newest valid checkpoint at start, save every
 * --save_checkpoint_secs when something changed, on request (POST
 * /v1/checkpoint) and at a clean stop; keep the newest --keep_checkpoints.
 *
 * A save takes its snapshot under the store's read lock (references to the
 * variables, a copy of the optimizer state) and writes the file outside it,
 * so training waits only for the copy. A failed save changes nothing on disk
 * (the previous checkpoint stays), is logged and counted, and is tried again
 * at the next interval; psd keeps serving.
 *
 * Saves run on the saver's own thread: the periodic ones, and the requested
 * ones handed to it with saver_save_async (POST /v1/checkpoint suspends its
 * connection meanwhile, so no HTTP thread waits for the disk).
 *
 * Test hook: RESTPS_TEST_SAVE_PAUSE_MS=N pauses each write for N ms half-way
 * through its data (the crash tests kill psd inside a write). */
#ifndef RESTPS_SAVER_H
#define RESTPS_SAVER_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"

typedef struct saver saver;

/* dir: this task's folder (created when missing); interval_secs 0 = no
 * periodic saves. NULL when out of memory. */
saver *saver_new(store *st, bufpool *pool, const char *dir, int interval_secs, int keep,
                 const ckpt_info *info);
void saver_free(saver *sv); /* stops the thread first */

/* At start, before serving: remove leftover temp files, restore the newest
 * checkpoint that validates into the store, set aside (rename to *.invalid)
 * the newer ones that do not, logging which file was used and why the
 * others were passed over. 1 restored, 0 nothing to restore. */
int saver_restore(saver *sv);

/* Start the saver's thread (periodic saves when interval_secs > 0, and the
 * requested ones). */
int saver_start(saver *sv);
/* Stop it (waits for a save in progress). */
void saver_stop(saver *sv);

/* A requester is resumed at the latest this long after it queued its save,
 * done or not: below psd's 5 s grace for the requests in flight at a stop,
 * so no connection is still suspended when the HTTP server stops (which
 * libmicrohttpd refuses with an abort). A save that takes longer is waited
 * for by saver_result, on the requester's thread, as before. */
#define SAVER_SUSPEND_MAX_MS 4000

/* Queue a forced save (saver_save(force=1)) for the saver's thread. `key`
 * names the requester (a suspended connection); resume(key) is called from
 * a saver thread once the save is done, or after SAVER_SUSPEND_MAX_MS,
 * whichever comes first. Saves queued while one runs share the next one.
 * -1 when the thread does not run (stopping): save with saver_save. */
int saver_save_async(saver *sv, void *key, void (*resume)(void *key));
/* The outcome of key's queued save, as saver_save's (0 or -1; the job is
 * then forgotten), waiting for it when it is not done yet; -2 when key
 * queued none. */
int saver_result(saver *sv, void *key, char *path, size_t cap, int64_t *step, char *err,
                 size_t errlen);

/* Save now. force: even when nothing changed since the last checkpoint.
 * 0 saved (path and step of the file), 1 skipped (nothing changed: path and
 * step of the last one), -1 failed (err). Saves run one at a time. */
int saver_save(saver *sv, int force, char *path, size_t cap, int64_t *step, char *err,
               size_t errlen);

/* The newest checkpoint this task wrote or restored: 0 and its path and
 * step, -1 when there is none. */
int saver_latest(saver *sv, char *path, size_t cap, int64_t *step);

/* The "checkpoint" object of /v1/status. */
json_t *saver_status_json(saver *sv);

typedef struct saver_stats {
    int has_last;
    double age_secs;      /* since the newest checkpoint was written */
    int64_t last_step;
    double last_duration_secs;
    uint64_t saves, failures;
} saver_stats;
void saver_get_stats(saver *sv, saver_stats *out);

#endif
