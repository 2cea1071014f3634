/* saver.h - the ps task's checkpoints over time, as tf.train.Supervisor's
 * saver: restore the newest valid checkpoint at start, save every
 * --save_checkpoint_secs when something changed, on request (POST
 * /v1/checkpoint) and at a clean stop; keep the newest --keep_checkpoints
 * of this task's own (regular files whose header says this ps task, this
 * cluster shape: ckpt_owned), never the one just written, and leave
 * whatever else the folder holds alone (said once in the log).
 *
 * A save takes its snapshot under the store's read lock (references to the
 * variables, a copy of the optimizer state) and writes the file outside it,
 * so training waits only for the copy. A failed save changes nothing on disk
 * (the previous checkpoint stays), is logged and counted, and is tried again
 * at the next interval; psd keeps serving.
 *
 * Saves run on the saver's own thread: the periodic ones, and the requested
 * ones handed to it with saver_save_async (POST /v1/checkpoint suspends its
 * connection until its save is done, so no HTTP thread waits for the disk,
 * however long the save takes). A request that could not be queued (out of
 * memory) saves with saver_save_requested on the HTTP thread that took the
 * request (the one blocking path left there). At a stop, saver_drain lets
 * the requested saves of both kinds finish and answers them before psd stops its HTTP server.
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
 * others were passed over (another task's or cluster's, and what is not a
 * regular file, are left where they are; a FIFO is never opened in a way
 * that blocks). A folder that cannot be made or written is logged, and psd
 * serves anyway. 1 restored, 0 nothing to restore. */
int saver_restore(saver *sv);

/* Start the saver's thread (periodic saves when interval_secs > 0, and the
 * requested ones). */
int saver_start(saver *sv);
/* Stop it (waits for a save in progress). */
void saver_stop(saver *sv);

/* Queue a forced save (saver_save(force=1)) for the saver's thread. `key`
 * names the requester (a suspended connection); resume(key) is called, from
 * the saver's thread, once its save is done, however long it takes (the
 * connection stays suspended meanwhile and holds no thread). Saves queued
 * while one runs share the next one. Once saver_drain began (psd is
 * stopping) nothing is queued: the request is refused at once (resume(key)
 * is called before this returns, and saver_result says SAVER_STOPPING).
 * 0 queued or refused; -1 not queued (out of memory, or the thread does not
 * run): save with saver_save_requested. */
int saver_save_async(saver *sv, void *key, void (*resume)(void *key));
/* The outcome of key's queued save, as saver_save's (0 or -1, with path,
 * step, err), or SAVER_STOPPING (refused: psd is stopping; err says so); the
 * job is then forgotten. SAVER_ENOJOB when key queued none. */
#define SAVER_ENOJOB (-2)
#define SAVER_STOPPING (-3)
#define SAVER_STOPPING_MSG \
    "psd is stopping: no checkpoint on request now (the final checkpoint is written as psd exits)"
int saver_result(saver *sv, void *key, char *path, size_t cap, int64_t *step, char *err,
                 size_t errlen);
/* key's request is over without collecting its outcome (its client hung up
 * while it waited: libmicrohttpd may then close the connection after the
 * resume without calling the handler again): forget its job, so that it
 * neither stays until saver_free nor answers a later requester that happens
 * to get the same key. A job not saved yet is dropped from the queue and
 * not resumed. Nothing happens when key has no job. */
void saver_forget(saver *sv, void *key);
/* A requested save on the caller's own thread (one saver_save_async could
 * not queue): saver_save(force=1), counted so that saver_drain waits for
 * it too; SAVER_STOPPING (err says so) once saver_drain began. */
int saver_save_requested(saver *sv, char *path, size_t cap, int64_t *step, char *err,
                         size_t errlen);
/* At a stop, before the HTTP server stops (libmicrohttpd aborts when it
 * stops with a connection still suspended, and closes the connections whose
 * request still runs): take no more requested saves, and wait until every
 * queued one is saved and its requester resumed with the outcome (the save
 * in progress finishes; the ones queued during it share one more), and
 * until every saver_save_requested in progress returned. Returns how many
 * requests it waited for. */
int saver_drain(saver *sv);

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
