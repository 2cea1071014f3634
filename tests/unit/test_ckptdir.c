/* test_ckptdir.c - common/ckptdir.c, the folder of checkpoints psd and the
 * ring's chief share: the step read from a name (garbage, signs, overflow at
 * INT64_MAX), the listing of a folder with odd names in it (numeric newest
 * first, ties by name, missing and unreadable folders), pruning (what is
 * kept, what above a step is left, nothing else touched; psd's: only the
 * caller's own regular files count, never the protected one), leftover temp
 * files, mkdir -p, and the atomic write into the folder leaving no temp file
 * and the previous file intact when it fails (before the rename, and half-way
 * through the data). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckptdir.h"
#include "safetensors.h"

static void make_tmpdir(char *out, size_t cap)
{
    snprintf(out, cap, "%s/test_ckptdir.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    assert_non_null(mkdtemp(out));
}

static void touch(const char *dir, const char *name, const char *text)
{
    char p[PATH_MAX];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

static int exists(const char *dir, const char *name)
{
    char p[PATH_MAX];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

/* entries in dir, "." and ".." aside; with `infix` only those holding it */
static int count(const char *dir, const char *infix)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0 &&
            (!infix || strstr(e->d_name, infix)))
            n++;
    closedir(d);
    return n;
}

/* rm -r of a test folder one level deep (plus empty sub-folders) */
static void remove_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char p[PATH_MAX];
        snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
        if (unlink(p) != 0)
            remove_tree(p);
    }
    closedir(d);
    rmdir(dir);
}

static void step_from_a_name_takes_only_plain_decimal_steps(void **state)
{
    (void)state;
    int64_t s = -5;
    assert_int_equal(ckptdir_step("model.ckpt-0.safetensors", &s), 0);
    assert_int_equal(s, 0);
    assert_int_equal(ckptdir_step("model.ckpt-1234.safetensors", &s), 0);
    assert_int_equal(s, 1234);
    assert_int_equal(ckptdir_step("model.ckpt-007.safetensors", &s), 0);
    assert_int_equal(s, 7);
    /* the largest step there is, and one past it */
    assert_int_equal(ckptdir_step("model.ckpt-9223372036854775807.safetensors", &s), 0);
    assert_true(s == INT64_MAX);
    const char *bad[] = {
        "model.ckpt-9223372036854775808.safetensors",
        "model.ckpt-99999999999999999999.safetensors",
        "model.ckpt-00000000000000000000000000009223372036854775808.safetensors",
        "model.ckpt-.safetensors",
        "model.ckpt--1.safetensors",
        "model.ckpt-+1.safetensors",
        "model.ckpt- 1.safetensors",
        "model.ckpt-1 .safetensors",
        "model.ckpt-0x10.safetensors",
        "model.ckpt-12a.safetensors",
        "model.ckpt-1.5.safetensors",
        "model.ckpt-5.safetensors.tmp.123",
        "model.ckpt-5.safetensors.invalid",
        "model.ckpt-5.safetensor",
        "model.ckpt-5",
        "Model.ckpt-5.safetensors",
        "xmodel.ckpt-5.safetensors",
        "model.ckpt-5.safetensors.safetensorsx",
        ".safetensors",
        "model.ckpt-",
        "",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        s = -5;
        if (ckptdir_step(bad[i], &s) != CKPT_EINVALID || s != -5)
            fail_msg("'%s' was taken for step %lld", bad[i], (long long)s);
    }
    /* leading zeros and an overflow still caught past them */
    assert_int_equal(ckptdir_step("model.ckpt-0009223372036854775807.safetensors", &s), 0);
    assert_true(s == INT64_MAX);
}

static void path_is_dir_prefix_step_suffix_and_refuses_what_does_not_fit(void **state)
{
    (void)state;
    char p[64];
    assert_int_equal(ckptdir_path("/x/ps-0", 42, p, sizeof(p)), 0);
    assert_string_equal(p, "/x/ps-0/model.ckpt-42.safetensors");
    int64_t s;
    assert_int_equal(ckptdir_step(strrchr(p, '/') + 1, &s), 0);
    assert_int_equal(s, 42);
    char small[20];
    assert_int_equal(ckptdir_path("/x/ps-0", 42, small, sizeof(small)), CKPT_EWRITE);
}

/* a folder with checkpoints and the other things found beside them */
static void fill(const char *dir)
{
    const char *names[] = {
        "model.ckpt-3.safetensors", "model.ckpt-10.safetensors", "model.ckpt-2.safetensors",
        "model.ckpt-7.safetensors", "model.ckpt-007.safetensors",
        /* not checkpoints */
        "model.ckpt-11.safetensors.tmp.123", "model.ckpt-12.safetensors.invalid",
        "model.ckpt-x.safetensors", "model.ckpt-99999999999999999999.safetensors",
        "model.ckpt-.safetensors", "model.ckpt--1.safetensors", "notes.txt", "checkpoint",
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        touch(dir, names[i], names[i]);
}

static void list_is_newest_first_by_number_and_skips_odd_names(void **state)
{
    (void)state;
    char dir[256], err[256] = "";
    make_tmpdir(dir, sizeof(dir));
    fill(dir);
    ckptdir_entry *e;
    int n;
    assert_int_equal(ckptdir_list(dir, &e, &n, err, sizeof(err)), 0);
    assert_int_equal(n, 5);
    /* 10 before 7 before 3 before 2 (numbers, not "10" < "2"); the two
     * step-7 files by name */
    const int64_t steps[] = {10, 7, 7, 3, 2};
    const char *want[] = {"model.ckpt-10.safetensors", "model.ckpt-007.safetensors",
                          "model.ckpt-7.safetensors", "model.ckpt-3.safetensors",
                          "model.ckpt-2.safetensors"};
    for (int i = 0; i < n; i++) {
        char p[PATH_MAX];
        snprintf(p, sizeof(p), "%s/%s", dir, want[i]);
        assert_string_equal(e[i].path, p);
        assert_true(e[i].step == steps[i]);
    }
    ckptdir_list_free(e, n);
    remove_tree(dir);
}

static void list_of_a_missing_folder_is_empty_and_of_a_file_an_error(void **state)
{
    (void)state;
    char dir[256], p[PATH_MAX + 16], err[256] = "";
    make_tmpdir(dir, sizeof(dir));
    snprintf(p, sizeof(p), "%s/none", dir);
    ckptdir_entry *e = (ckptdir_entry *)1;
    int n = -1;
    assert_int_equal(ckptdir_list(p, &e, &n, err, sizeof(err)), 0);
    assert_null(e);
    assert_int_equal(n, 0);
    ckptdir_list_free(e, n);
    touch(dir, "file", "x");
    snprintf(p, sizeof(p), "%s/file", dir);
    assert_int_equal(ckptdir_list(p, &e, &n, err, sizeof(err)), CKPT_EREAD);
    assert_null(e);
    assert_int_equal(n, 0);
    char want[PATH_MAX + 64];
    snprintf(want, sizeof(want), "cannot read '%s': %s", p, strerror(ENOTDIR));
    assert_string_equal(err, want);
    remove_tree(dir);
}

static void prune_keeps_the_newest_and_touches_nothing_else(void **state)
{
    (void)state;
    char dir[256];
    make_tmpdir(dir, sizeof(dir));
    fill(dir);
    int others = count(dir, NULL) - 5;
    assert_int_equal(ckptdir_prune(dir, 0, INT64_MAX), 0);
    assert_int_equal(ckptdir_prune(dir, -1, INT64_MAX), 0);
    assert_int_equal(count(dir, NULL), others + 5);
    assert_int_equal(ckptdir_prune(dir, 2, INT64_MAX), 3);
    assert_true(exists(dir, "model.ckpt-10.safetensors"));
    assert_true(exists(dir, "model.ckpt-007.safetensors"));
    assert_false(exists(dir, "model.ckpt-7.safetensors"));
    assert_false(exists(dir, "model.ckpt-3.safetensors"));
    assert_false(exists(dir, "model.ckpt-2.safetensors"));
    assert_int_equal(count(dir, NULL), others + 2);
    assert_true(exists(dir, "model.ckpt-11.safetensors.tmp.123"));
    assert_true(exists(dir, "model.ckpt-12.safetensors.invalid"));
    assert_true(exists(dir, "model.ckpt-99999999999999999999.safetensors"));
    /* a second time: nothing more to do */
    assert_int_equal(ckptdir_prune(dir, 2, INT64_MAX), 0);
    remove_tree(dir);
}

static void prune_up_to_a_step_leaves_the_newer_ones_uncounted(void **state)
{
    (void)state;
    char dir[256];
    make_tmpdir(dir, sizeof(dir));
    fill(dir);
    /* the ring's chief wrote step 3 with a newer (not its own) 10 and 7 there */
    assert_int_equal(ckptdir_prune(dir, 1, 3), 1);
    assert_true(exists(dir, "model.ckpt-10.safetensors"));
    assert_true(exists(dir, "model.ckpt-7.safetensors"));
    assert_true(exists(dir, "model.ckpt-007.safetensors"));
    assert_true(exists(dir, "model.ckpt-3.safetensors"));
    assert_false(exists(dir, "model.ckpt-2.safetensors"));
    /* the same folder under psd's rule: every one counts */
    assert_int_equal(ckptdir_prune(dir, 1, INT64_MAX), 3);
    assert_true(exists(dir, "model.ckpt-10.safetensors"));
    assert_false(exists(dir, "model.ckpt-3.safetensors"));
    remove_tree(dir);
}


/* owned: a file whose text begins "mine" */
static int mine(const char *path, char *why, size_t whylen, void *ctx)
{
    (void)ctx;
    char buf[8] = "";
    FILE *f = fopen(path, "r");
    size_t got = f ? fread(buf, 1, 4, f) : 0;
    if (f)
        fclose(f);
    if (got == 4 && memcmp(buf, "mine", 4) == 0)
        return 1;
    snprintf(why, whylen, "another's");
    return 0;
}

static void tell(const char *path, const char *why, void *ctx)
{
    char *seen = ctx;
    const char *base = strrchr(path, '/') + 1;
    size_t at = strlen(seen);
    snprintf(seen + at, 1024 - at, "%s: %s\n", base, why);
}

static void prune_owned_counts_only_owned_regular_files_and_never_the_protected_one(void **state)
{
    (void)state;
    char dir[256], p[PATH_MAX], seen[1024] = "";
    make_tmpdir(dir, sizeof(dir));
    touch(dir, "model.ckpt-1.safetensors", "mine 1");
    touch(dir, "model.ckpt-2.safetensors", "mine 2");
    touch(dir, "model.ckpt-3.safetensors", "mine 3");
    touch(dir, "model.ckpt-20.safetensors", "theirs");
    snprintf(p, sizeof(p), "%s/model.ckpt-30.safetensors", dir);
    assert_int_equal(mkdir(p, 0755), 0);
    snprintf(p, sizeof(p), "%s/model.ckpt-31.safetensors", dir);
    assert_int_equal(mkfifo(p, 0644), 0);
    snprintf(p, sizeof(p), "%s/model.ckpt-32.safetensors", dir);
    assert_int_equal(symlink("model.ckpt-3.safetensors", p), 0);
    assert_int_equal(ckptdir_prune_owned(dir, 0, NULL, mine, tell, seen), 0);
    assert_string_equal(seen, "");
    /* keep 1 of the owned, protecting 1 (say, the one just written) */
    char protect[PATH_MAX];
    snprintf(protect, sizeof(protect), "%s/model.ckpt-1.safetensors", dir);
    assert_int_equal(ckptdir_prune_owned(dir, 1, protect, mine, tell, seen), 1);
    assert_string_equal(seen, "model.ckpt-32.safetensors: not a regular file (a symbolic link)\n"
                              "model.ckpt-31.safetensors: not a regular file (a fifo)\n"
                              "model.ckpt-30.safetensors: not a regular file (a folder)\n"
                              "model.ckpt-20.safetensors: another's\n");
    assert_true(exists(dir, "model.ckpt-3.safetensors"));
    assert_false(exists(dir, "model.ckpt-2.safetensors"));
    assert_true(exists(dir, "model.ckpt-1.safetensors"));
    assert_true(exists(dir, "model.ckpt-20.safetensors"));
    assert_true(exists(dir, "model.ckpt-30.safetensors"));
    assert_true(exists(dir, "model.ckpt-31.safetensors"));
    assert_true(exists(dir, "model.ckpt-32.safetensors"));
    /* unprotected, with no one told */
    assert_int_equal(ckptdir_prune_owned(dir, 1, NULL, mine, NULL, NULL), 1);
    assert_false(exists(dir, "model.ckpt-1.safetensors"));
    assert_true(exists(dir, "model.ckpt-3.safetensors"));
    remove_tree(dir);
}

static void remove_temps_removes_only_the_temp_files_of_checkpoints(void **state)
{
    (void)state;
    char dir[256], p[PATH_MAX + 16];
    make_tmpdir(dir, sizeof(dir));
    fill(dir);
    touch(dir, "model.ckpt-4.safetensors.tmp.99", "x");
    touch(dir, "other.safetensors.tmp.1", "x");
    int before = count(dir, NULL);
    assert_int_equal(ckptdir_remove_temps(dir), 2);
    assert_int_equal(count(dir, NULL), before - 2);
    assert_false(exists(dir, "model.ckpt-4.safetensors.tmp.99"));
    assert_false(exists(dir, "model.ckpt-11.safetensors.tmp.123"));
    assert_true(exists(dir, "other.safetensors.tmp.1"));
    assert_true(exists(dir, "model.ckpt-12.safetensors.invalid"));
    assert_int_equal(ckptdir_remove_temps(dir), 0);
    snprintf(p, sizeof(p), "%s/none", dir);
    assert_int_equal(ckptdir_remove_temps(p), 0);
    remove_tree(dir);
}

static void make_creates_every_parent_and_refuses_a_file(void **state)
{
    (void)state;
    char dir[256], p[PATH_MAX + 32], err[PATH_MAX + 128] = "";
    make_tmpdir(dir, sizeof(dir));
    snprintf(p, sizeof(p), "%s/a/b/c", dir);
    assert_int_equal(ckptdir_make(p, err, sizeof(err)), 0);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    assert_true(S_ISDIR(st.st_mode));
    assert_int_equal(ckptdir_make(p, err, sizeof(err)), 0); /* already there */
    snprintf(p, sizeof(p), "%s/a/b/c/", dir);
    assert_int_equal(ckptdir_make(p, err, sizeof(err)), 0);
    touch(dir, "file", "x");
    char want[PATH_MAX + 128];
    snprintf(p, sizeof(p), "%s/file", dir);
    assert_int_equal(ckptdir_make(p, err, sizeof(err)), CKPT_EWRITE);
    snprintf(want, sizeof(want), "'%s' is not a folder", p);
    assert_string_equal(err, want);
    snprintf(p, sizeof(p), "%s/file/sub", dir);
    assert_int_equal(ckptdir_make(p, err, sizeof(err)), CKPT_EWRITE);
    snprintf(want, sizeof(want), "cannot create '%s': %s", p, strerror(ENOTDIR));
    assert_string_equal(err, want);
    assert_int_equal(ckptdir_make("", err, sizeof(err)), CKPT_EWRITE);
    remove_tree(dir);
}

/* A checkpoint of one tensor of n floats, all v, written as both sides
 * write theirs: st_write_file_parts to ckptdir_path. */
static int write_ckpt(const char *dir, int64_t step, int n, float v, char *err, size_t errlen)
{
    float *data = malloc(sizeof(float) * (size_t)n);
    assert_non_null(data);
    for (int i = 0; i < n; i++)
        data[i] = v;
    tensor_shape shape = {1, {n}};
    st_desc d = {"w", "F32", &shape};
    st_part part = {data, sizeof(float) * (size_t)n};
    const char *meta[] = {"format", "test"};
    char p[PATH_MAX];
    assert_int_equal(ckptdir_path(dir, step, p, sizeof(p)), 0);
    int rc = st_write_file_parts(p, &d, 1, meta, 1, &part, 1, NULL, NULL, err, errlen);
    free(data);
    return rc;
}

static long file_size(const char *dir, const char *name)
{
    char p[PATH_MAX];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    struct stat st;
    return stat(p, &st) == 0 ? (long)st.st_size : -1;
}

static void atomic_write_that_fails_leaves_no_temp_file_and_the_old_one_intact(void **state)
{
    (void)state;
    char dir[256], err[PATH_MAX + 128] = "";
    make_tmpdir(dir, sizeof(dir));
    assert_int_equal(write_ckpt(dir, 1, 16, 1.0f, err, sizeof(err)), 0);
    long good = file_size(dir, "model.ckpt-1.safetensors");
    assert_true(good > 64);
    assert_int_equal(count(dir, ST_TEMP_INFIX), 0);

    /* the rename fails: a folder holds the name */
    char p[PATH_MAX + 32];
    snprintf(p, sizeof(p), "%s/model.ckpt-2.safetensors", dir);
    assert_int_equal(mkdir(p, 0755), 0);
    touch(p, "inside", "x"); /* not empty: rename cannot replace it */
    assert_int_not_equal(write_ckpt(dir, 2, 16, 2.0f, err, sizeof(err)), 0);
    assert_non_null(strstr(err, "model.ckpt-2.safetensors"));
    assert_int_equal(count(dir, ST_TEMP_INFIX), 0);

    /* the data fails half-way (a file size limit: EFBIG), over an older
     * checkpoint of the same step */
    assert_int_equal(write_ckpt(dir, 3, 16, 3.0f, err, sizeof(err)), 0);
    long old3 = file_size(dir, "model.ckpt-3.safetensors");
    struct rlimit was, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &was), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    lim = was;
    lim.rlim_cur = 4096;
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int rc = write_ckpt(dir, 3, 64 * 1024, 4.0f, err, sizeof(err));
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &was), 0);
    signal(SIGXFSZ, prev);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(err, ST_TEMP_INFIX));
    assert_int_equal(count(dir, ST_TEMP_INFIX), 0);
    assert_int_equal(file_size(dir, "model.ckpt-3.safetensors"), old3);

    /* what is left lists as before: the two good ones */
    ckptdir_entry *e;
    int n;
    assert_int_equal(ckptdir_list(dir, &e, &n, err, sizeof(err)), 0);
    /* the folder named model.ckpt-2.safetensors is listed by its name too */
    assert_int_equal(n, 3);
    assert_true(e[0].step == 3 && e[1].step == 2 && e[2].step == 1);
    ckptdir_list_free(e, n);
    assert_int_equal(file_size(dir, "model.ckpt-1.safetensors"), good);
    remove_tree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(step_from_a_name_takes_only_plain_decimal_steps),
        cmocka_unit_test(path_is_dir_prefix_step_suffix_and_refuses_what_does_not_fit),
        cmocka_unit_test(list_is_newest_first_by_number_and_skips_odd_names),
        cmocka_unit_test(list_of_a_missing_folder_is_empty_and_of_a_file_an_error),
        cmocka_unit_test(prune_keeps_the_newest_and_touches_nothing_else),
        cmocka_unit_test(prune_up_to_a_step_leaves_the_newer_ones_uncounted),
        cmocka_unit_test(prune_owned_counts_only_owned_regular_files_and_never_the_protected_one),
        cmocka_unit_test(remove_temps_removes_only_the_temp_files_of_checkpoints),
        cmocka_unit_test(make_creates_every_parent_and_refuses_a_file),
        cmocka_unit_test(atomic_write_that_fails_leaves_no_temp_file_and_the_old_one_intact),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
