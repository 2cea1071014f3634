/* saver.c - restore at start, periodic and requested saves (see saver.h). */
#include "saver.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"

/* A requested save (saver_save_async). */
typedef struct job {
    void *key;
    void (*resume)(void *key);
    int taken; /* the save that answers it has begun */
    int done;  /* answered (saved, failed or refused) and resumed */
    int rc;
    char path[PATH_MAX];
    int64_t step;
    char err[512];
    struct job *next;
} job;

struct saver {
    store *st;
    bufpool *pool;
    char dir[PATH_MAX];
    int interval, keep;
    ckpt_info info;
    long pause_ms; /* test hook */

    pthread_t thread;
    int running;
    pthread_mutex_t mu; /* guards what follows and the thread's wake-ups */
    pthread_cond_t cv;
    int stop;
    int draining;   /* psd is stopping: no more requested saves (saver_drain) */
    job *jobs;      /* queued and done-but-not-collected requested saves */
    int n_queued;   /* of them not done yet */
    int n_sync;     /* saver_save_requested in progress (on HTTP threads) */
    pthread_cond_t done_cv; /* a requested save finished (or was forgotten) */

    pthread_mutex_t save_mu; /* one save at a time */
    uint64_t saved_changes;  /* the store's change counter in the newest checkpoint */
    int has_saved;

    /* status, under mu */
    int has_last;
    char last_path[PATH_MAX];
    int64_t last_step;
    uint64_t last_bytes;
    double last_duration;
    struct timespec last_at; /* CLOCK_REALTIME of the write (or the file's mtime when restored) */
    int restored;
    char restored_path[PATH_MAX];
    int64_t restored_step;
    int invalid_set_aside;
    int told_passed_over; /* pruning said once what it leaves alone */
    uint64_t saves, failures, consecutive_failures;
    char last_error[512];
    struct timespec last_error_at;
};

static double since(const struct timespec *t)
{
    struct timespec now = clk_unix_ts();
    return (double)(now.tv_sec - t->tv_sec) + (double)(now.tv_nsec - t->tv_nsec) / 1e9;
}

saver *saver_new(store *st, bufpool *pool, const char *dir, int interval_secs, int keep,
                 const ckpt_info *info)
{
    saver *sv = calloc(1, sizeof(*sv));
    if (!sv)
        return NULL;
    sv->st = st;
    sv->pool = pool;
    snprintf(sv->dir, sizeof(sv->dir), "%s", dir);
    sv->interval = interval_secs;
    sv->keep = keep;
    sv->info = *info;
    const char *p = getenv("RESTPS_TEST_SAVE_PAUSE_MS");
    sv->pause_ms = p ? atol(p) : 0;
    pthread_mutex_init(&sv->mu, NULL);
    pthread_mutex_init(&sv->save_mu, NULL);
    clk_mono_cond_init(&sv->cv);
    clk_mono_cond_init(&sv->done_cv);
    return sv;
}

/* Whether a file can be made in dir now: a probe file created and removed
 * (its name is no checkpoint's nor a temp file's). 1, or 0 with err. */
static int writable(const char *dir, char *err, size_t errlen)
{
    char p[PATH_MAX];
    if (snprintf(p, sizeof(p), "%s/.psd-write-test.%ld", dir, (long)getpid()) >= (int)sizeof(p)) {
        snprintf(err, errlen, "path too long");
        return 0;
    }
    int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0 && errno == EEXIST && unlink(p) == 0) /* one a killed psd of this pid left */
        fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        return 0;
    }
    close(fd);
    unlink(p);
    return 1;
}

int saver_restore(saver *sv)
{
    char err[512];
    if (ckptdir_make(sv->dir, err, sizeof(err)) != 0) {
        log_error("psd: checkpoints: %s; psd serves anyway, with no checkpoint to restore, and "
                  "every save fails until the folder can be made (each one tries again)", err);
        return 0;
    }
    if (!writable(sv->dir, err, sizeof(err)))
        log_error("psd: checkpoints: cannot write in '%s': %s; psd serves anyway, and every save "
                  "fails until it is writable", sv->dir, err);
    int temps = ckptdir_remove_temps(sv->dir);
    if (temps)
        log_info("psd: checkpoints: removed %d temp file%s left by a write that never finished",
                 temps, temps == 1 ? "" : "s");
    ckptdir_entry *e;
    int n;
    if (ckptdir_list(sv->dir, &e, &n, err, sizeof(err)) != 0) {
        log_error("psd: checkpoints: %s", err);
        return 0;
    }
    int restored = 0;
    for (int i = 0; i < n && !restored; i++) {
        store_saved saved;
        int rr = ckpt_read(e[i].path, sv->pool, &sv->info, &saved, err, sizeof(err));
        if (rr == CKPT_EREAD || rr == CKPT_EOTHER) {
            /* not broken: left where it is */
            log_error("psd: checkpoints: passing over %s: %s", e[i].path, err);
            continue;
        }
        if (rr != 0) {
            char aside[PATH_MAX + 16];
            snprintf(aside, sizeof(aside), "%s.invalid", e[i].path);
            int moved = rename(e[i].path, aside) == 0;
            log_error("psd: checkpoints: passing over %s: %s%s%s", e[i].path, err,
                      moved ? "; set aside as " : "", moved ? aside : "");
            sv->invalid_set_aside += moved;
            continue;
        }
        if (saved.global_step != e[i].step)
            log_info("psd: checkpoints: %s holds global step %lld (its name says %lld)", e[i].path,
                     (long long)saved.global_step, (long long)e[i].step);
        int64_t step = saved.global_step;
        int nv = saved.n;
        uint64_t changes = saved.changes;
        /* the job it is of, for the log line: mode, optimizer, model */
        char job[160] = "";
        if (saved.configured) {
            json_t *pj = saved.placement ? json_loads(saved.placement, 0, NULL) : NULL;
            const char *spec = json_string_value(json_object_get(pj, "model"));
            snprintf(job, sizeof(job), " (%s, %s%s%.100s)", saved.config.sync ? "sync" : "async",
                     optim_name(saved.config.optim.kind), spec ? ", " : "", spec ? spec : "");
            json_decref(pj);
        }
        if (store_restore(sv->st, &saved) != STORE_OK) {
            log_error("psd: checkpoints: out of memory restoring %s", e[i].path);
            store_saved_free(&saved);
            break;
        }
        store_saved_free(&saved);
        struct stat stt;
        pthread_mutex_lock(&sv->mu);
        sv->has_last = 1;
        snprintf(sv->last_path, sizeof(sv->last_path), "%s", e[i].path);
        sv->last_step = step;
        if (stat(e[i].path, &stt) == 0) {
            sv->last_at = stt.st_mtim;
            sv->last_bytes = (uint64_t)stt.st_size;
        } else
            sv->last_at = clk_unix_ts();
        sv->restored = 1;
        snprintf(sv->restored_path, sizeof(sv->restored_path), "%s", e[i].path);
        sv->restored_step = step;
        pthread_mutex_unlock(&sv->mu);
        sv->saved_changes = changes;
        sv->has_saved = 1;
        log_info("psd: checkpoints: restored %s: global step %lld, %d variable%s%s", e[i].path,
                 (long long)step, nv, nv == 1 ? "" : "s", job);
        restored = 1;
    }
    if (!restored)
        log_info("psd: checkpoints: %s in %s; starting empty", n ? "no valid checkpoint" : "none yet",
                 sv->dir);
    ckptdir_list_free(e, n);
    return restored;
}

static void pause_hook(void *ctx, int i)
{
    saver *sv = ctx;
    if (i == 0 && sv->pause_ms > 0) {
        log_info("psd: checkpoints: test hook: pausing the write for %ld ms", sv->pause_ms);
        struct timespec t = {sv->pause_ms / 1000, (sv->pause_ms % 1000) * 1000000L};
        while (nanosleep(&t, &t) != 0 && errno == EINTR) {
        }
    }
}

/* What pruning passed over, for its one log line. */
typedef struct passed_over {
    saver *sv;
    int n;
    char names[512];
} passed_over;

static int owned(const char *path, char *why, size_t whylen, void *ctx)
{
    passed_over *po = ctx;
    return ckpt_owned(path, &po->sv->info, why, whylen) == 0;
}

static void skipped(const char *path, const char *why, void *ctx)
{
    passed_over *po = ctx;
    size_t at = strlen(po->names);
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (po->n < 3)
        snprintf(po->names + at, sizeof(po->names) - at, "%s%s (%.120s)", po->n ? ", " : "", base,
                 why);
    else if (po->n == 3)
        snprintf(po->names + at, sizeof(po->names) - at, ", ...");
    po->n++;
}

/* Keep the newest --keep_checkpoints of this task's own checkpoints
 * (ckpt_owned: regular files whose header says they are this ps task's, of
 * this cluster), never `newest` (the one just written); everything else in
 * the folder (another cluster's checkpoints, folders, FIFOs, broken files)
 * is neither counted nor removed, and said once. How many were removed. */
static int prune(saver *sv, const char *newest)
{
    passed_over po = {.sv = sv};
    int removed = ckptdir_prune_owned(sv->dir, sv->keep, newest, owned, skipped, &po);
    if (po.n && !sv->told_passed_over) {
        sv->told_passed_over = 1;
        log_info("psd: checkpoints: pruning leaves alone %d entr%s of %s that %s not this task's "
                 "checkpoints, neither counting nor removing them: %s",
                 po.n, po.n == 1 ? "y" : "ies", sv->dir, po.n == 1 ? "is" : "are", po.names);
    }
    return removed;
}

int saver_save(saver *sv, int force, char *path, size_t cap, int64_t *step, char *err,
               size_t errlen)
{
    pthread_mutex_lock(&sv->save_mu);
    store_saved snap;
    int rc = -1;
    struct timespec t0 = clk_mono_ts();
    if (store_save(sv->st, &snap) != STORE_OK) {
        snprintf(err, errlen, "out of memory taking the snapshot");
        goto failed;
    }
    if (!force && ((sv->has_saved && snap.changes == sv->saved_changes) ||
                   (!sv->has_saved && snap.changes == 0))) {
        store_saved_free(&snap);
        pthread_mutex_lock(&sv->mu);
        if (sv->has_last) {
            snprintf(path, cap, "%s", sv->last_path);
            *step = sv->last_step;
        } else {
            snprintf(path, cap, "%s", "");
            *step = -1;
        }
        pthread_mutex_unlock(&sv->mu);
        pthread_mutex_unlock(&sv->save_mu);
        return 1;
    }
    char p[PATH_MAX];
    if (ckptdir_make(sv->dir, err, errlen) != 0 ||
        (ckptdir_path(sv->dir, snap.global_step, p, sizeof(p)) != 0 &&
         snprintf(err, errlen, "%s: path too long", sv->dir) > 0) ||
        ckpt_write(p, &snap, &sv->info, pause_hook, sv, err, errlen) != 0) {
        store_saved_free(&snap);
        goto failed;
    }
    double secs = clk_mono_since(&t0);
    struct stat fst;
    uint64_t bytes = stat(p, &fst) == 0 ? (uint64_t)fst.st_size : 0; /* the file's size, as after a restore */
    sv->saved_changes = snap.changes;
    sv->has_saved = 1;
    int64_t gs = snap.global_step;
    store_saved_free(&snap);
    pthread_mutex_lock(&sv->mu);
    sv->has_last = 1;
    snprintf(sv->last_path, sizeof(sv->last_path), "%s", p);
    sv->last_step = gs;
    sv->last_bytes = bytes;
    sv->last_duration = secs;
    sv->last_at = clk_unix_ts();
    sv->saves++;
    sv->consecutive_failures = 0;
    pthread_mutex_unlock(&sv->mu);
    int pruned = prune(sv, p);
    log_info("psd: checkpoints: saved global step %lld to %s (%.1f MB in %.3f s)%s", (long long)gs,
             p, (double)bytes / 1e6, secs, pruned ? "; removed older ones" : "");
    snprintf(path, cap, "%s", p);
    *step = gs;
    rc = 0;
    pthread_mutex_unlock(&sv->save_mu);
    return rc;
failed:
    pthread_mutex_lock(&sv->mu);
    sv->failures++;
    sv->consecutive_failures++;
    snprintf(sv->last_error, sizeof(sv->last_error), "%s", err);
    sv->last_error_at = clk_unix_ts();
    int had = sv->has_last;
    pthread_mutex_unlock(&sv->mu);
    log_error("psd: checkpoints: save failed: %s (%s; retrying at the next interval)", err,
              had ? "the previous checkpoint is intact" : "no checkpoint has been saved yet");
    pthread_mutex_unlock(&sv->save_mu);
    return -1;
}

/* Run one forced save for every queued request (called with mu held, some
 * queued); each is resumed with the outcome. Requests queued during the save
 * wait for the next one: its snapshot may predate them. */
static void run_requested(saver *sv)
{
    for (job *j = sv->jobs; j; j = j->next)
        if (!j->done)
            j->taken = 1;
    pthread_mutex_unlock(&sv->mu);
    char path[PATH_MAX] = "", err[512] = "";
    int64_t step = -1;
    int rc = saver_save(sv, 1, path, sizeof(path), &step, err, sizeof(err));
    pthread_mutex_lock(&sv->mu);
    for (job *j = sv->jobs; j; j = j->next) {
        if (j->done || !j->taken)
            continue;
        j->done = 1;
        j->rc = rc;
        j->step = step;
        snprintf(j->path, sizeof(j->path), "%s", path);
        snprintf(j->err, sizeof(j->err), "%s", err);
        sv->n_queued--;
        j->resume(j->key);
    }
    pthread_cond_broadcast(&sv->done_cv);
}

static void *loop(void *arg)
{
    saver *sv = arg;
    struct timespec at = clk_mono_after_ms((int64_t)sv->interval * 1000);
    pthread_mutex_lock(&sv->mu);
    for (;;) {
        /* requested saves first, stopping or not: their requesters wait */
        if (sv->n_queued > 0) {
            run_requested(sv);
            continue;
        }
        if (sv->stop)
            break;
        int timed_out = 0;
        if (sv->interval > 0)
            timed_out = pthread_cond_timedwait(&sv->cv, &sv->mu, &at) == ETIMEDOUT;
        else
            pthread_cond_wait(&sv->cv, &sv->mu);
        if (sv->stop)
            break;
        if (timed_out) {
            pthread_mutex_unlock(&sv->mu);
            char path[PATH_MAX], err[512];
            int64_t step;
            saver_save(sv, 0, path, sizeof(path), &step, err, sizeof(err));
            pthread_mutex_lock(&sv->mu);
            at = clk_mono_after_ms((int64_t)sv->interval * 1000);
        }
    }
    pthread_mutex_unlock(&sv->mu);
    return NULL;
}

int saver_start(saver *sv)
{
    pthread_mutex_lock(&sv->mu);
    int rc = pthread_create(&sv->thread, NULL, loop, sv) == 0 ? 0 : -1;
    sv->running = rc == 0;
    pthread_mutex_unlock(&sv->mu);
    return rc;
}

void saver_stop(saver *sv)
{
    if (!sv)
        return;
    pthread_mutex_lock(&sv->mu);
    int running = sv->running;
    sv->stop = 1;
    sv->running = 0;
    pthread_cond_broadcast(&sv->cv);
    pthread_cond_broadcast(&sv->done_cv); /* saver_drain: nobody saves any more */
    pthread_mutex_unlock(&sv->mu);
    if (running)
        pthread_join(sv->thread, NULL);
}

int saver_save_async(saver *sv, void *key, void (*resume)(void *key))
{
    pthread_mutex_lock(&sv->mu);
    if (!sv->draining && (!sv->running || sv->stop)) {
        pthread_mutex_unlock(&sv->mu);
        return -1;
    }
    job *j = calloc(1, sizeof(*j));
    if (!j) {
        pthread_mutex_unlock(&sv->mu);
        return -1;
    }
    j->key = key;
    j->resume = resume;
    j->next = sv->jobs;
    sv->jobs = j;
    if (sv->draining) {
        /* refused: a save now would race the final checkpoint at the stop,
         * which holds everything anyway */
        j->done = 1;
        j->rc = SAVER_STOPPING;
        snprintf(j->err, sizeof(j->err), "%s", SAVER_STOPPING_MSG);
        resume(key);
    } else {
        sv->n_queued++;
        pthread_cond_broadcast(&sv->cv);
    }
    pthread_mutex_unlock(&sv->mu);
    return 0;
}

int saver_result(saver *sv, void *key, char *path, size_t cap, int64_t *step, char *err,
                 size_t errlen)
{
    pthread_mutex_lock(&sv->mu);
    for (job **pp = &sv->jobs; *pp; pp = &(*pp)->next) {
        job *x = *pp;
        if (x->key != key)
            continue;
        /* resumed only once done; should a requester look earlier, it
         * waits (the saver's thread finishes every save it took) */
        while (!x->done && sv->running)
            pthread_cond_wait(&sv->done_cv, &sv->mu);
        if (!x->done) /* the thread stopped without it (not after saver_drain) */
            break;
        for (pp = &sv->jobs; *pp != x; pp = &(*pp)->next) {
        }
        int rc = x->rc;
        snprintf(path, cap, "%s", x->path);
        *step = x->step;
        snprintf(err, errlen, "%s", x->err);
        *pp = x->next;
        free(x);
        pthread_mutex_unlock(&sv->mu);
        return rc;
    }
    pthread_mutex_unlock(&sv->mu);
    return SAVER_ENOJOB;
}

void saver_free(saver *sv)
{
    if (!sv)
        return;
    saver_stop(sv);
    while (sv->jobs) {
        job *x = sv->jobs;
        sv->jobs = x->next;
        free(x);
    }
    pthread_mutex_destroy(&sv->mu);
    pthread_mutex_destroy(&sv->save_mu);
    pthread_cond_destroy(&sv->cv);
    pthread_cond_destroy(&sv->done_cv);
    free(sv);
}

void saver_forget(saver *sv, void *key)
{
    pthread_mutex_lock(&sv->mu);
    for (job **pp = &sv->jobs; *pp; pp = &(*pp)->next) {
        job *x = *pp;
        if (x->key != key)
            continue;
        *pp = x->next;
        if (!x->done) {
            /* not resumed yet (the saver's thread looks only at the jobs
             * still listed when its save is over) */
            sv->n_queued--;
            log_info("psd: checkpoints: a checkpoint request ended before its save was done: "
                     "not answered (a save already under way still completes)");
            pthread_cond_broadcast(&sv->done_cv);
        } else if (x->rc == 0) {
            log_info("psd: checkpoints: the client of the checkpoint request answered by %s "
                     "(global step %lld) left before reading it",
                     x->path, (long long)x->step);
        }
        free(x);
        break;
    }
    pthread_mutex_unlock(&sv->mu);
}

int saver_save_requested(saver *sv, char *path, size_t cap, int64_t *step, char *err,
                         size_t errlen)
{
    pthread_mutex_lock(&sv->mu);
    if (sv->draining) {
        /* as in saver_save_async */
        pthread_mutex_unlock(&sv->mu);
        snprintf(err, errlen, "%s", SAVER_STOPPING_MSG);
        return SAVER_STOPPING;
    }
    sv->n_sync++;
    pthread_mutex_unlock(&sv->mu);
    int rc = saver_save(sv, 1, path, cap, step, err, errlen);
    pthread_mutex_lock(&sv->mu);
    sv->n_sync--;
    pthread_cond_broadcast(&sv->done_cv);
    pthread_mutex_unlock(&sv->mu);
    return rc;
}

int saver_drain(saver *sv)
{
    pthread_mutex_lock(&sv->mu);
    sv->draining = 1;
    int n = sv->n_queued + sv->n_sync;
    if (n)
        log_info("psd: checkpoints: stopping once the %d checkpoint request%s waiting %s answered",
                 n, n == 1 ? "" : "s", n == 1 ? "is" : "are");
    /* a save on a requester's own thread finishes whatever the saver's
     * thread does */
    while ((sv->n_queued > 0 && sv->running) || sv->n_sync > 0)
        pthread_cond_wait(&sv->done_cv, &sv->mu);
    pthread_mutex_unlock(&sv->mu);
    return n;
}

int saver_latest(saver *sv, char *path, size_t cap, int64_t *step)
{
    pthread_mutex_lock(&sv->mu);
    int ok = sv->has_last;
    if (ok) {
        snprintf(path, cap, "%s", sv->last_path);
        *step = sv->last_step;
    }
    pthread_mutex_unlock(&sv->mu);
    return ok ? 0 : -1;
}

json_t *saver_status_json(saver *sv)
{
    pthread_mutex_lock(&sv->mu);
    json_t *o = json_pack("{s:s,s:i,s:i,s:I,s:I,s:I}", "dir", sv->dir, "interval_secs",
                          sv->interval, "keep", sv->keep, "saves", (json_int_t)sv->saves,
                          "failures", (json_int_t)sv->failures, "consecutive_failures",
                          (json_int_t)sv->consecutive_failures);
    if (sv->has_last)
        json_object_set_new(o, "last",
                            json_pack("{s:s,s:I,s:f,s:I,s:f}", "file", sv->last_path,
                                      "global_step", (json_int_t)sv->last_step, "age_secs",
                                      since(&sv->last_at), "bytes", (json_int_t)sv->last_bytes,
                                      "duration_secs", sv->last_duration));
    else
        json_object_set_new(o, "last", json_null());
    if (sv->restored)
        json_object_set_new(o, "restored_from",
                            json_pack("{s:s,s:I}", "file", sv->restored_path, "global_step",
                                      (json_int_t)sv->restored_step));
    else
        json_object_set_new(o, "restored_from", json_null());
    json_object_set_new(o, "invalid_set_aside", json_integer(sv->invalid_set_aside));
    if (sv->failures)
        json_object_set_new(o, "last_error",
                            json_pack("{s:s,s:f}", "message", sv->last_error, "age_secs",
                                      since(&sv->last_error_at)));
    else
        json_object_set_new(o, "last_error", json_null());
    pthread_mutex_unlock(&sv->mu);
    return o;
}

void saver_get_stats(saver *sv, saver_stats *out)
{
    pthread_mutex_lock(&sv->mu);
    out->has_last = sv->has_last;
    out->age_secs = sv->has_last ? since(&sv->last_at) : 0;
    out->last_step = sv->last_step;
    out->last_duration_secs = sv->last_duration;
    out->saves = sv->saves;
    out->failures = sv->failures;
    pthread_mutex_unlock(&sv->mu);
}
