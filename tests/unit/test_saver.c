/* test_saver.c - server/saver.c's requested saves at a stop, and a request
 * that ends without collecting its outcome: saver_drain waits for a save on
 * a requester's own thread (saver_save_requested: thread per connection),
 * refuses one that starts once it began, and saver_forget drops a job, done
 * or still queued, so that a later requester with the same key gets a save
 * of its own and a forgotten one is never resumed. Each write pauses 300 ms
 * (RESTPS_TEST_SAVE_PAUSE_MS) so the saves overlap what the test does.
 * Issue 37: in a folder that also holds another cluster's and another
 * task's checkpoints, a folder, a FIFO and a broken file, all named like
 * checkpoints, the restore passes them over without blocking on the FIFO,
 * and pruning counts and removes only this task's own, never the newest. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bufpool.h"
#include "saver.h"
#include "store.h"
#include "store_fixture.h"

#define PAUSE_MS 300

typedef struct fixture {
    store_fixture sf; /* the store and its pool */
    saver *sv;
    char dir[64];
} fixture;

static int setup(void **state)
{
    fixture *fx = calloc(1, sizeof(*fx));
    if (!fx)
        return -1;
    snprintf(fx->dir, sizeof(fx->dir), "/tmp/test_saver.XXXXXX");
    if (!mkdtemp(fx->dir))
        return -1;
    setenv("RESTPS_TEST_SAVE_PAUSE_MS", "300", 1);
    if (store_fixture_init(&fx->sf, 0.5f, (size_t)1 << 20) != 0)
        return -1;
    /* a variable: the test hook pauses a write half-way through its data */
    tensor_shape sh = {.ndim = 1, .dims = {4}};
    blob *b = blob_new(fx->sf.pool, 16);
    if (!b)
        return -1;
    memset(b->data, 0, 16);
    int created;
    uint64_t version;
    if (store_put(&fx->sf.s, "w", &sh, b, 0, &created, &version) != STORE_OK)
        return -1;
    ckpt_info ci = {0, 1};
    fx->sv = saver_new(&fx->sf.s, fx->sf.pool, fx->dir, 0, 0, &ci);
    if (!fx->sv || saver_start(fx->sv) != 0)
        return -1;
    *state = fx;
    return 0;
}

static int teardown(void **state)
{
    fixture *fx = *state;
    saver_free(fx->sv);
    store_fixture_destroy(&fx->sf);
    DIR *d = opendir(fx->dir); /* the checkpoints (no subfolders) */
    for (struct dirent *e; d && (e = readdir(d));) {
        char p[PATH_MAX];
        if (e->d_name[0] != '.' && snprintf(p, sizeof(p), "%s/%s", fx->dir, e->d_name) > 0)
            unlink(p);
    }
    if (d)
        closedir(d);
    if (rmdir(fx->dir) != 0)
        fprintf(stderr, "cannot remove %s\n", fx->dir);
    free(fx);
    return 0;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* A write is under way (paused half-way): its temp file is in the folder. */
static void wait_for_a_write(const char *dir)
{
    for (int i = 0; i < 1000; i++) {
        DIR *d = opendir(dir);
        assert_non_null(d);
        int n = 0;
        for (struct dirent *e; (e = readdir(d));)
            n += e->d_name[0] != '.';
        closedir(d);
        if (n)
            return;
        sleep_ms(5);
    }
    fail_msg("no write began in %s", dir);
}

static uint64_t saves(saver *sv)
{
    saver_stats s;
    saver_get_stats(sv, &s);
    return s.saves;
}

typedef struct sync_req {
    saver *sv;
    int rc;
    char path[PATH_MAX], err[512];
    int64_t step;
} sync_req;

static void *save_on_own_thread(void *arg)
{
    sync_req *q = arg;
    q->rc = saver_save_requested(q->sv, q->path, sizeof(q->path), &q->step, q->err,
                                 sizeof(q->err));
    return NULL;
}

/* Thread per connection: a stop waits for the save on the requester's own
 * thread (it used to stop with it half-way, past psd's 5 s grace closing the
 * connection), and a request once the stop began is refused. */
static void test_drain_waits_for_a_save_on_the_requesters_thread(void **state)
{
    fixture *fx = *state;
    sync_req q = {.sv = fx->sv, .rc = 99};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, save_on_own_thread, &q), 0);
    wait_for_a_write(fx->dir); /* the save is in its pause */
    assert_int_equal(saver_drain(fx->sv), 1);
    /* the save was written before drain returned */
    assert_int_equal(saves(fx->sv), 1);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(q.rc, 0);
    assert_non_null(strstr(q.path, "model.ckpt-0.safetensors"));

    sync_req late = {.sv = fx->sv, .rc = 99};
    save_on_own_thread(&late);
    assert_int_equal(late.rc, SAVER_STOPPING);
    assert_string_equal(late.err, SAVER_STOPPING_MSG);
    assert_int_equal(saves(fx->sv), 1);
}

static atomic_int resumed_a, resumed_b;
static void resume_a(void *key)
{
    (void)key;
    atomic_fetch_add(&resumed_a, 1);
}
static void resume_b(void *key)
{
    (void)key;
    atomic_fetch_add(&resumed_b, 1);
}

static void wait_resumed(atomic_int *n, int want)
{
    for (int i = 0; i < 1000 && atomic_load(n) < want; i++)
        sleep_ms(10);
    assert_int_equal(atomic_load(n), want);
}

/* A done job whose requester left is dropped: the key gets nothing back, and
 * a later request under the same key gets its own, later save. */
static void test_forget_a_done_job(void **state)
{
    fixture *fx = *state;
    int conn; /* stands for a connection's address */
    char path[PATH_MAX], err[512];
    int64_t step;
    atomic_store(&resumed_a, 0);
    assert_int_equal(saver_save_async(fx->sv, &conn, resume_a), 0);
    wait_resumed(&resumed_a, 1);
    saver_forget(fx->sv, &conn);
    assert_int_equal(saver_result(fx->sv, &conn, path, sizeof(path), &step, err, sizeof(err)),
                     SAVER_ENOJOB);
    saver_forget(fx->sv, &conn); /* nothing: fine */

    /* the store moves on; the same key asks again: a save of now */
    float g[4] = {1, 1, 1, 1};
    int64_t gs = -1;
    uint64_t version;
    assert_int_equal(store_apply_grad(&fx->sf.s, "w", g, 4, &gs, &version), STORE_OK);
    assert_int_equal(gs, 1);
    assert_int_equal(saver_save_async(fx->sv, &conn, resume_a), 0);
    wait_resumed(&resumed_a, 2);
    assert_int_equal(saver_result(fx->sv, &conn, path, sizeof(path), &step, err, sizeof(err)), 0);
    assert_int_equal(step, 1);
    assert_non_null(strstr(path, "model.ckpt-1.safetensors"));
    assert_int_equal(saves(fx->sv), 2);
}

/* Jobs forgotten before their save is done (one taken by the save in
 * progress, one queued behind it) are never resumed, and a stop does not
 * wait for them. */
static void test_forget_queued_jobs(void **state)
{
    fixture *fx = *state;
    int a, b;
    atomic_store(&resumed_a, 0);
    atomic_store(&resumed_b, 0);
    assert_int_equal(saver_save_async(fx->sv, &a, resume_a), 0);
    wait_for_a_write(fx->dir); /* a's save is in its pause */
    assert_int_equal(saver_save_async(fx->sv, &b, resume_b), 0);
    saver_forget(fx->sv, &b);
    saver_forget(fx->sv, &a);
    double t0 = now_s();
    assert_int_equal(saver_drain(fx->sv), 0);
    assert_true(now_s() - t0 < 0.2); /* a's save is still paused */
    sleep_ms(PAUSE_MS + 200); /* a's save is over */
    assert_int_equal(atomic_load(&resumed_a), 0);
    assert_int_equal(atomic_load(&resumed_b), 0);
    assert_int_equal(saves(fx->sv), 1); /* a's only: b's was not run */
}


static void path_of(const fixture *fx, int64_t step, char *out, size_t cap)
{
    assert_int_equal(ckptdir_path(fx->dir, step, out, cap), 0);
}

static int there(const fixture *fx, int64_t step)
{
    char p[PATH_MAX];
    struct stat st;
    path_of(fx, step, p, sizeof(p));
    return lstat(p, &st) == 0; /* a dangling symbolic link is there too */
}

/* the store as it is now, written as `step` with info */
static void write_as(fixture *fx, int64_t step, int task, int ps_tasks)
{
    store_saved snap;
    assert_int_equal(store_save(&fx->sf.s, &snap), STORE_OK);
    snap.global_step = step;
    ckpt_info ci = {task, ps_tasks};
    char p[PATH_MAX], err[256];
    path_of(fx, step, p, sizeof(p));
    assert_int_equal(ckpt_write(p, &snap, &ci, NULL, NULL, err, sizeof(err)), 0);
    store_saved_free(&snap);
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char m[] = "test_saver: blocked (on the FIFO?)\n";
    if (write(2, m, sizeof(m) - 1) < 0) {
    }
    _exit(3);
}

static void test_prune_counts_only_this_tasks_own(void **state)
{
    fixture *fx = *state;
    char p[PATH_MAX], err[256];
    write_as(fx, 3, 0, 1);   /* this task's */
    write_as(fx, 100, 0, 2); /* ps 0 of another cluster shape */
    write_as(fx, 101, 1, 1); /* another task's */
    path_of(fx, 102, p, sizeof(p));
    assert_int_equal(mkdir(p, 0755), 0);
    path_of(fx, 103, p, sizeof(p));
    assert_int_equal(mkfifo(p, 0644), 0);
    /* ckpt_owned: the header alone, never blocking */
    signal(SIGALRM, on_alarm);
    alarm(10);
    ckpt_info me = {0, 1};
    assert_int_equal(ckpt_owned(p, &me, err, sizeof(err)), CKPT_EREAD);
    assert_string_equal(err, "not a regular file (a fifo)");
    store_saved got;
    assert_int_equal(ckpt_read(p, fx->sf.pool, &me, &got, err, sizeof(err)), CKPT_EREAD);
    assert_string_equal(err, "not a regular file (a fifo)");
    path_of(fx, 100, p, sizeof(p));
    assert_int_equal(ckpt_owned(p, &me, err, sizeof(err)), CKPT_EOTHER);
    path_of(fx, 3, p, sizeof(p));
    assert_int_equal(ckpt_owned(p, &me, err, sizeof(err)), 0);
    /* a symbolic link to this task's checkpoint is not counted as one */
    char link[PATH_MAX];
    snprintf(link, sizeof(link), "%s/model.ckpt-104.safetensors", fx->dir);
    assert_int_equal(symlink(p, link), 0);
    assert_int_equal(ckpt_owned(link, &me, err, sizeof(err)), CKPT_EREAD);

    /* keep 1, no pause: the restore passes over the others (without blocking
     * on the FIFO) and takes ckpt-3 (first through the link, which reads the
     * same file) */
    saver_free(fx->sv);
    setenv("RESTPS_TEST_SAVE_PAUSE_MS", "0", 1);
    fx->sv = saver_new(&fx->sf.s, fx->sf.pool, fx->dir, 0, 1, &me);
    assert_non_null(fx->sv);
    assert_int_equal(saver_restore(fx->sv), 1);
    alarm(0);
    char path[PATH_MAX];
    int64_t step;
    assert_int_equal(saver_latest(fx->sv, path, sizeof(path), &step), 0);
    assert_int_equal(step, 3);
    /* each save keeps the newest one of this task's own, and nothing else moves */
    float g[4] = {1, 1, 1, 1};
    uint64_t version;
    for (int64_t want = 4; want <= 5; want++) {
        int64_t gs;
        assert_int_equal(store_apply_grad(&fx->sf.s, "w", g, 4, &gs, &version), STORE_OK);
        assert_int_equal(gs, want);
        assert_int_equal(saver_save(fx->sv, 1, path, sizeof(path), &step, err, sizeof(err)), 0);
        assert_int_equal(step, want);
        assert_true(there(fx, want));
        assert_false(there(fx, want - 1));
        for (int64_t other = 100; other <= 104; other++)
            assert_true(there(fx, other));
    }
    /* a checkpoint of this task's newer than the one just written stays, and
     * the one just written is never removed */
    write_as(fx, 50, 0, 1);
    assert_int_equal(saver_save(fx->sv, 1, path, sizeof(path), &step, err, sizeof(err)), 0);
    assert_int_equal(step, 5);
    assert_true(there(fx, 50) && there(fx, 5));
    assert_int_equal(saver_latest(fx->sv, path, sizeof(path), &step), 0);
    assert_int_equal(access(path, F_OK), 0);
    path_of(fx, 102, p, sizeof(p));
    assert_int_equal(rmdir(p), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_drain_waits_for_a_save_on_the_requesters_thread,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_forget_a_done_job, setup, teardown),
        cmocka_unit_test_setup_teardown(test_forget_queued_jobs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prune_counts_only_this_tasks_own, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
