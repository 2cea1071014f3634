/* test_idx.c - client/idx.c: IDX files written here byte by byte (raw and
 * gzipped) load into the expected floats and labels; broken files fail with the
 * file named; the epoch order is a permutation shared out exactly among workers;
 * the installed Fashion-MNIST loads as 55,000 / 5,000 / 10,000 and matches the
 * file's bytes read independently. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "data/idx.h"

#ifndef FASHION_DIR
#define FASHION_DIR "/usr/share/datasets/fashion-mnist"
#endif

static char tmpdir[256];

/* ---- writing IDX files ---- */

static void put_be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

/* The bytes of an IDX file: magic, dims, data. *len receives the length. */
static unsigned char *idx_bytes(uint32_t magic, int ndim, const uint32_t *dims,
                                const uint8_t *data, size_t *len)
{
    size_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= dims[i];
    *len = 4 + 4 * (size_t)ndim + n;
    unsigned char *b = malloc(*len);
    assert_non_null(b);
    put_be32(b, magic);
    for (int i = 0; i < ndim; i++)
        put_be32(b + 4 + 4 * i, dims[i]);
    memcpy(b + 4 + 4 * ndim, data, n);
    return b;
}

static void path_of(char *out, size_t outlen, const char *name, int gz)
{
    snprintf(out, outlen, "%s/%s%s", tmpdir, name, gz ? ".gz" : "");
}

static void write_file(const char *name, int gz, const unsigned char *b, size_t len)
{
    char p[512];
    path_of(p, sizeof(p), name, gz);
    if (gz) {
        gzFile f = gzopen(p, "wb");
        assert_non_null(f);
        assert_int_equal(gzwrite(f, b, (unsigned)len), (int)len);
        assert_int_equal(gzclose(f), Z_OK);
    } else {
        FILE *f = fopen(p, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(b, 1, len, f), len);
        assert_int_equal(fclose(f), 0);
    }
}

static void remove_all(void)
{
    const char *names[] = {IDX_TRAIN_IMAGES, IDX_TRAIN_LABELS, IDX_TEST_IMAGES, IDX_TEST_LABELS};
    char p[512];
    for (int i = 0; i < 4; i++)
        for (int gz = 0; gz < 2; gz++) {
            path_of(p, sizeof(p), names[i], gz);
            unlink(p);
        }
}

/* Synthetic set: n_train images of 3x4 and n_test, pixel k of image i =
 * (7*i + 13*k + salt) % 256, label i % 10 (train) / (i + 3) % 10 (test). */
#define ROWS 3
#define COLS 4
static uint8_t pixel(int64_t i, int k, int salt)
{
    return (uint8_t)((7 * i + 13 * k + salt) % 256);
}

static void write_images(const char *name, int gz, uint32_t n, int salt, uint32_t magic)
{
    uint8_t *data = malloc((size_t)n * ROWS * COLS);
    assert_non_null(data);
    for (uint32_t i = 0; i < n; i++)
        for (int k = 0; k < ROWS * COLS; k++)
            data[(size_t)i * ROWS * COLS + k] = pixel(i, k, salt);
    uint32_t dims[3] = {n, ROWS, COLS};
    size_t len;
    unsigned char *b = idx_bytes(magic, 3, dims, data, &len);
    write_file(name, gz, b, len);
    free(b);
    free(data);
}

static void write_labels(const char *name, int gz, uint32_t n, int shift)
{
    uint8_t *data = malloc(n);
    assert_non_null(data);
    for (uint32_t i = 0; i < n; i++)
        data[i] = (uint8_t)((i + (uint32_t)shift) % 10);
    uint32_t dims[1] = {n};
    size_t len;
    unsigned char *b = idx_bytes(IDX_MAGIC_LABELS, 1, dims, data, &len);
    write_file(name, gz, b, len);
    free(b);
    free(data);
}

/* All four files; gz_mask bit i gzips file i (train images, train labels, test
 * images, test labels). */
static void write_set(uint32_t n_train, uint32_t n_test, int gz_mask)
{
    remove_all();
    write_images(IDX_TRAIN_IMAGES, gz_mask & 1, n_train, 0, IDX_MAGIC_IMAGES);
    write_labels(IDX_TRAIN_LABELS, gz_mask & 2, n_train, 0);
    write_images(IDX_TEST_IMAGES, gz_mask & 4, n_test, 100, IDX_MAGIC_IMAGES);
    write_labels(IDX_TEST_LABELS, gz_mask & 8, n_test, 3);
}

static int setup(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/test_idx.XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    remove_all();
    return rmdir(tmpdir);
}

/* ---- loading ---- */

static void check_synthetic(const idx_dataset *ds, int64_t n_train, int64_t n_val, int64_t n_test)
{
    assert_int_equal(ds->rows, ROWS);
    assert_int_equal(ds->cols, COLS);
    assert_int_equal(ds->n_features, ROWS * COLS);
    assert_int_equal(ds->validation.n, n_val);
    assert_int_equal(ds->train.n, n_train - n_val);
    assert_int_equal(ds->test.n, n_test);
    const float scale = (float)(1.0 / 255.0); /* numpy: uint8 -> float32, * (1/255) */
    for (int64_t i = 0; i < n_train; i++) {
        /* example i of the file: validation if i < n_val, else train[i - n_val] */
        const idx_split *s = i < n_val ? &ds->validation : &ds->train;
        int64_t r = i < n_val ? i : i - n_val;
        assert_int_equal(s->labels[r], i % 10);
        for (int k = 0; k < ROWS * COLS; k++) {
            float want = (float)pixel(i, k, 0) * scale;
            assert_true(s->images[r * ROWS * COLS + k] == want);
        }
    }
    for (int64_t i = 0; i < n_test; i++) {
        assert_int_equal(ds->test.labels[i], (i + 3) % 10);
        for (int k = 0; k < ROWS * COLS; k++)
            assert_true(ds->test.images[i * ROWS * COLS + k] == (float)pixel(i, k, 100) * scale);
    }
}

static void test_load_raw(void **state)
{
    (void)state;
    write_set(23, 7, 0);
    idx_dataset ds;
    char err[512] = "";
    assert_int_equal(idx_load_dataset_split(tmpdir, 4, &ds, err, sizeof(err)), 0);
    check_synthetic(&ds, 23, 4, 7);
    /* pixels 0 and 255 map to exactly 0 and 1 */
    idx_dataset_free(&ds);
    assert_null(ds.train_images_mem);
    idx_dataset_free(&ds); /* twice is harmless */
}

static void test_load_gz_and_mixed(void **state)
{
    (void)state;
    for (int mask = 1; mask < 16; mask += 7) { /* 1, 8, 15: some and all gzipped */
        write_set(23, 7, mask);
        idx_dataset ds;
        char err[512] = "";
        int rc = idx_load_dataset_split(tmpdir, 5, &ds, err, sizeof(err));
        if (rc != 0)
            print_error("mask %d: %s\n", mask, err);
        assert_int_equal(rc, 0);
        check_synthetic(&ds, 23, 5, 7);
        idx_dataset_free(&ds);
    }
}

static void test_pixel_extremes(void **state)
{
    (void)state;
    /* one 1x2 image: 0 and 255 */
    uint8_t px[2] = {0, 255};
    uint32_t dims[3] = {1, 1, 2};
    size_t len;
    unsigned char *b = idx_bytes(IDX_MAGIC_IMAGES, 3, dims, px, &len);
    remove_all();
    write_file(IDX_TRAIN_IMAGES, 1, b, len);
    free(b);
    char p[512], err[512] = "";
    path_of(p, sizeof(p), IDX_TRAIN_IMAGES, 1);
    float *img = NULL;
    int64_t n = 0;
    int rows = 0, cols = 0;
    assert_int_equal(idx_read_images(p, &img, &n, &rows, &cols, err, sizeof(err)), 0);
    assert_int_equal(n, 1);
    assert_int_equal(rows, 1);
    assert_int_equal(cols, 2);
    assert_true(img[0] == 0.0f);
    assert_true(img[1] == 1.0f);
    free(img);
}

static void test_default_validation_is_first_5000(void **state)
{
    (void)state;
    write_set(IDX_VALIDATION_SIZE + 17, 3, 15);
    idx_dataset ds;
    char err[512] = "";
    assert_int_equal(idx_load_dataset(tmpdir, &ds, err, sizeof(err)), 0);
    check_synthetic(&ds, IDX_VALIDATION_SIZE + 17, 5000, 3);
    assert_int_equal(ds.train.n, 17);
    idx_dataset_free(&ds);
}

static void test_raw_preferred_over_gz(void **state)
{
    (void)state;
    write_set(10, 4, 0);
    /* a .gz beside the raw file with other contents: the raw one is read */
    write_images(IDX_TRAIN_IMAGES, 1, 10, 55, IDX_MAGIC_IMAGES);
    idx_dataset ds;
    char err[512] = "";
    assert_int_equal(idx_load_dataset_split(tmpdir, 2, &ds, err, sizeof(err)), 0);
    check_synthetic(&ds, 10, 2, 4);
    idx_dataset_free(&ds);
}

/* Load must fail, err must name the file (full path) and contain `what`. */
static void expect_fail(const char *file, int gz, const char *what, int64_t validation)
{
    idx_dataset ds;
    char err[1024] = "", p[512];
    memset(&ds, 0x5a, sizeof(ds));
    int rc = idx_load_dataset_split(tmpdir, validation, &ds, err, sizeof(err));
    print_message("    err: %s\n", err);
    assert_true(rc < 0);
    path_of(p, sizeof(p), file, gz);
    assert_non_null(strstr(err, p));
    assert_non_null(strstr(err, what));
    assert_non_null(strstr(err, "idx: "));
    assert_null(strchr(err, '\n')); /* one line */
    assert_null(ds.train_images_mem);  /* nothing left behind */
    assert_int_equal(ds.train.n, 0);
}

static void test_bad_magic(void **state)
{
    (void)state;
    for (int gz = 0; gz < 2; gz++) {
        write_set(10, 4, gz ? 15 : 0);
        write_images(IDX_TRAIN_IMAGES, gz, 10, 0, 0x00000000);
        expect_fail(IDX_TRAIN_IMAGES, gz, "bad magic 0x00000000", 2);
        /* a labels file where images are expected */
        write_set(10, 4, gz ? 15 : 0);
        write_labels(IDX_TEST_IMAGES, gz, 4, 0);
        expect_fail(IDX_TEST_IMAGES, gz, "bad magic 0x00000801", 2);
    }
}

static void write_cut(const char *name, int gz, const unsigned char *b, size_t len, size_t keep)
{
    if (!gz) {
        write_file(name, 0, b, keep);
        return;
    }
    /* gzip it whole, then cut the compressed file */
    write_file(name, 1, b, len);
    char p[512];
    path_of(p, sizeof(p), name, 1);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(truncate(p, st.st_size * (off_t)keep / (off_t)len), 0);
}

static void test_truncated(void **state)
{
    (void)state;
    uint8_t data[10 * ROWS * COLS];
    memset(data, 7, sizeof(data));
    uint32_t dims[3] = {10, ROWS, COLS};
    size_t len;
    unsigned char *b = idx_bytes(IDX_MAGIC_IMAGES, 3, dims, data, &len);
    for (int gz = 0; gz < 2; gz++) {
        /* in the data, in the header, right after the magic */
        size_t cuts[] = {len - 1, len / 2, 10, 4, 2, 0};
        for (size_t c = 0; c < sizeof(cuts) / sizeof(cuts[0]); c++) {
            if (gz && cuts[c] < 4)
                continue; /* a few bytes of a gzip stream: covered by the raw case */
            write_set(10, 4, gz ? 15 : 0);
            write_cut(IDX_TRAIN_IMAGES, gz, b, len, cuts[c]);
            print_message("    cut at %zu of %zu (%s)\n", cuts[c], len, gz ? "gz" : "raw");
            expect_fail(IDX_TRAIN_IMAGES, gz, "truncated", 2);
        }
    }
    free(b);
    /* a labels file one label short of its header */
    uint8_t lab[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    uint32_t ld[1] = {8};
    b = idx_bytes(IDX_MAGIC_LABELS, 1, ld, lab, &len);
    write_set(8, 4, 0);
    write_file(IDX_TRAIN_LABELS, 0, b, len - 1);
    expect_fail(IDX_TRAIN_LABELS, 0, "truncated", 2);
    free(b);
}

/* Found by tests/fuzz/fuzz_idx: a header declaring 4G labels (or 65535x65535
 * pixels) made the reader allocate all of it before reading a byte. Now a short
 * file fails as truncated having asked for about what it holds: under an
 * address-space limit of 256 MiB over what the process has (not under ASan,
 * whose shadow memory needs terabytes of address space). */
#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
static void test_huge_declared_count_is_not_allocated(void **state)
{
    (void)state;
    struct rlimit old;
    assert_int_equal(getrlimit(RLIMIT_AS, &old), 0);
#ifndef UNDER_ASAN
    long vm_kb = 0;
    FILE *st = fopen("/proc/self/status", "r");
    char line[256];
    while (st && fgets(line, sizeof(line), st))
        if (sscanf(line, "VmSize: %ld kB", &vm_kb) == 1)
            break;
    if (st)
        fclose(st);
    assert_true(vm_kb > 0);
    struct rlimit lim = {(rlim_t)vm_kb * 1024 + ((rlim_t)256 << 20), old.rlim_max};
    assert_int_equal(setrlimit(RLIMIT_AS, &lim), 0);
#endif
    char p[512], err[512];
    unsigned char lab[8] = {0, 0, 0x08, 0x01, 0xff, 0xff, 0xff, 0xfb};
    path_of(p, sizeof(p), "huge-labels", 0);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(lab, 1, sizeof(lab), f), sizeof(lab));
    fclose(f);
    uint8_t *labels = NULL;
    int64_t n = 0;
    int rc = idx_read_labels(p, IDX_N_CLASSES, &labels, &n, err, sizeof(err));
    unsigned char img[16 + 100] = {0, 0, 0x08, 0x03, 0, 0, 0, 1, 0, 0, 0xff, 0xff, 0, 0, 0xff, 0xff};
    path_of(p, sizeof(p), "huge-images", 0);
    f = fopen(p, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(img, 1, sizeof(img), f), sizeof(img));
    fclose(f);
    float *images = NULL;
    int rows, cols;
    char err2[512];
    int rc2 = idx_read_images(p, &images, &n, &rows, &cols, err2, sizeof(err2));
    assert_int_equal(setrlimit(RLIMIT_AS, &old), 0);
    unlink(p);
    path_of(p, sizeof(p), "huge-labels", 0);
    unlink(p);
    print_message("    %s\n    %s\n", err, err2);
    assert_int_equal(rc, -1);
    assert_null(labels);
    assert_non_null(strstr(err, "truncated"));
    assert_int_equal(rc2, -1);
    assert_null(images);
    assert_non_null(strstr(err2, "truncated"));
}

static void test_trailing_bytes(void **state)
{
    (void)state;
    uint8_t lab[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    uint32_t ld[1] = {9};
    size_t len;
    unsigned char *b = idx_bytes(IDX_MAGIC_LABELS, 1, ld, lab, &len);
    put_be32(b + 4, 8); /* the header says 8, the file holds 9 */
    for (int gz = 0; gz < 2; gz++) {
        write_set(8, 4, gz ? 15 : 0);
        write_file(IDX_TRAIN_LABELS, gz, b, len);
        expect_fail(IDX_TRAIN_LABELS, gz, "trailing bytes", 2);
    }
    free(b);
}

static void test_corrupt_gzip(void **state)
{
    (void)state;
    write_set(50, 4, 15);
    /* flip a byte in the middle of the compressed stream */
    char p[512];
    path_of(p, sizeof(p), IDX_TRAIN_IMAGES, 1);
    FILE *f = fopen(p, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long size = ftell(f);
    assert_int_equal(fseek(f, size - 6, SEEK_SET), 0); /* inside the CRC32 trailer */
    int c = fgetc(f);
    assert_int_equal(fseek(f, size - 6, SEEK_SET), 0);
    fputc(c ^ 0xff, f);
    assert_int_equal(fclose(f), 0);
    expect_fail(IDX_TRAIN_IMAGES, 1, "corrupt", 2);
}

static void test_count_mismatch(void **state)
{
    (void)state;
    write_set(12, 4, 0);
    write_labels(IDX_TRAIN_LABELS, 0, 11, 0);
    expect_fail(IDX_TRAIN_LABELS, 0, "11 labels but", 2);
    expect_fail(IDX_TRAIN_IMAGES, 0, "has 12 images", 2); /* names both files */
    write_set(12, 4, 15);
    write_labels(IDX_TEST_LABELS, 1, 5, 0);
    expect_fail(IDX_TEST_LABELS, 1, "5 labels but", 2);
}

static void test_missing_file(void **state)
{
    (void)state;
    const char *names[] = {IDX_TRAIN_IMAGES, IDX_TRAIN_LABELS, IDX_TEST_IMAGES, IDX_TEST_LABELS};
    for (int i = 0; i < 4; i++) {
        write_set(10, 4, 0);
        char p[512];
        path_of(p, sizeof(p), names[i], 0);
        assert_int_equal(unlink(p), 0);
        expect_fail(names[i], 0, "not found", 2);
    }
    /* a directory that does not exist */
    idx_dataset ds;
    char err[512] = "";
    assert_true(idx_load_dataset("/nonexistent/dir", &ds, err, sizeof(err)) < 0);
    assert_non_null(strstr(err, "/nonexistent/dir/" IDX_TRAIN_IMAGES));
}

static void test_label_out_of_range(void **state)
{
    (void)state;
    write_set(10, 4, 0);
    uint8_t lab[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 10};
    uint32_t ld[1] = {10};
    size_t len;
    unsigned char *b = idx_bytes(IDX_MAGIC_LABELS, 1, ld, lab, &len);
    write_file(IDX_TRAIN_LABELS, 0, b, len);
    free(b);
    expect_fail(IDX_TRAIN_LABELS, 0, "label 10 at index 9", 2);
}

static void test_image_size_mismatch_and_validation_too_big(void **state)
{
    (void)state;
    write_set(10, 4, 0);
    uint8_t data[4 * 5 * 5] = {0};
    uint32_t dims[3] = {4, 5, 5};
    size_t len;
    unsigned char *b = idx_bytes(IDX_MAGIC_IMAGES, 3, dims, data, &len);
    write_file(IDX_TEST_IMAGES, 0, b, len);
    free(b);
    expect_fail(IDX_TEST_IMAGES, 0, "5x5 images", 2);

    write_set(10, 4, 0);
    expect_fail(IDX_TRAIN_IMAGES, 0, "fewer than the validation size 11", 11);
    idx_dataset ds;
    char err[256];
    assert_true(idx_load_dataset_split(tmpdir, -1, &ds, err, sizeof(err)) < 0);
    /* validation = everything is allowed: train is empty */
    assert_int_equal(idx_load_dataset_split(tmpdir, 10, &ds, err, sizeof(err)), 0);
    assert_int_equal(ds.train.n, 0);
    assert_int_equal(ds.validation.n, 10);
    idx_dataset_free(&ds);
}

/* ---- epoch order ---- */

static uint32_t *order_all(int64_t n, uint64_t seed, uint64_t epoch)
{
    uint32_t *o = malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    int64_t count = -1;
    assert_non_null(o);
    assert_int_equal(idx_epoch_order(n, seed, epoch, 0, 1, o, &count), 0);
    assert_int_equal(count, n);
    return o;
}

static void test_epoch_order_is_permutation_split_among_workers(void **state)
{
    (void)state;
    const int64_t sizes[] = {0, 1, 2, 5, 1003, 55000};
    const int workers[] = {1, 2, 3, 4, 7, 16};
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        int64_t n = sizes[si];
        uint32_t *full = order_all(n, 42, 3);
        /* a permutation */
        char *seen = calloc((size_t)n + 1, 1);
        for (int64_t i = 0; i < n; i++) {
            assert_true(full[i] < n);
            assert_int_equal(seen[full[i]], 0);
            seen[full[i]] = 1;
        }
        free(seen);
        for (size_t wi = 0; wi < sizeof(workers) / sizeof(workers[0]); wi++) {
            int N = workers[wi];
            uint32_t *o = malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
            int64_t pos = 0, minc = INT64_MAX, maxc = 0;
            for (int w = 0; w < N; w++) {
                int64_t count = -1;
                assert_int_equal(idx_epoch_order(n, 42, 3, w, N, o, &count), 0);
                /* worker w's slice is the next stretch of the one permutation */
                assert_true(pos + count <= n);
                if (count)
                    assert_memory_equal(o, full + pos, (size_t)count * sizeof(uint32_t));
                pos += count;
                minc = count < minc ? count : minc;
                maxc = count > maxc ? count : maxc;
            }
            assert_int_equal(pos, n); /* together: every example exactly once */
            assert_true(maxc - minc <= 1);
            free(o);
        }
        free(full);
    }
}

static void test_epoch_order_deterministic_and_varies(void **state)
{
    (void)state;
    const int64_t n = 1000;
    uint32_t *a = order_all(n, 7, 0), *b = order_all(n, 7, 0);
    assert_memory_equal(a, b, n * sizeof(uint32_t));
    uint32_t *c = order_all(n, 7, 1), *d = order_all(n, 8, 0);
    int same_c = 0, same_d = 0, fixed = 0;
    for (int64_t i = 0; i < n; i++) {
        same_c += a[i] == c[i];
        same_d += a[i] == d[i];
        fixed += a[i] == (uint32_t)i;
    }
    /* independent random permutations agree in ~1 place on average */
    assert_true(same_c < 10);
    assert_true(same_d < 10);
    assert_true(fixed < 10); /* shuffled at all */
    free(a);
    free(b);
    free(c);
    free(d);
}

static void test_epoch_order_uniform(void **state)
{
    (void)state;
    /* All 24 orders of 4 items over 24,000 epochs: a chi-square test of
     * uniformity. 23 degrees of freedom; 60 is beyond p = 1e-4. A classic
     * Fisher-Yates slip (j drawn from [0, n) instead of [0, i]) gives > 1000. */
    int counts[24] = {0};
    uint32_t o[4];
    for (uint64_t e = 0; e < 24000; e++) {
        int64_t count;
        assert_int_equal(idx_epoch_order(4, 1234, e, 0, 1, o, &count), 0);
        /* Lehmer code of the permutation */
        int code = 0, avail[4] = {0, 1, 2, 3}, left = 4;
        for (int i = 0; i < 4; i++) {
            int k = 0;
            while (avail[k] != (int)o[i])
                k++;
            code = code * left + k;
            memmove(avail + k, avail + k + 1, (size_t)(left - k - 1) * sizeof(int));
            left--;
        }
        counts[code]++;
    }
    double chi2 = 0;
    for (int i = 0; i < 24; i++)
        chi2 += (counts[i] - 1000.0) * (counts[i] - 1000.0) / 1000.0;
    print_message("    chi-square over 24 orders: %.1f\n", chi2);
    assert_true(chi2 < 60.0);
}

static void test_epoch_order_bad_args(void **state)
{
    (void)state;
    uint32_t o[4];
    int64_t count;
    assert_true(idx_epoch_order(-1, 0, 0, 0, 1, o, &count) < 0);
    assert_true(idx_epoch_order(4, 0, 0, 0, 0, o, &count) < 0);
    assert_true(idx_epoch_order(4, 0, 0, 2, 2, o, &count) < 0);
    assert_true(idx_epoch_order(4, 0, 0, -1, 2, o, &count) < 0);
    assert_true(idx_epoch_order((int64_t)UINT32_MAX + 1, 0, 0, 0, 1, o, &count) < 0);
    /* more workers than examples: some get nothing, none gets more than one */
    int64_t total = 0;
    for (int w = 0; w < 9; w++) {
        assert_int_equal(idx_epoch_order(4, 0, 0, w, 9, o, &count), 0);
        assert_true(count <= 1);
        total += count;
    }
    assert_int_equal(total, 4);
}

/* ---- the real set ---- */

/* Bytes [off, off+len) of the decompressed file, read with zlib directly. */
static void read_gz_bytes(const char *path, long off, unsigned char *out, unsigned len)
{
    gzFile f = gzopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(gzseek(f, off, SEEK_SET), off);
    assert_int_equal(gzread(f, out, len), (int)len);
    gzclose(f);
}

static void test_fashion_mnist(void **state)
{
    (void)state;
    struct stat st;
    if (stat(FASHION_DIR, &st) != 0) {
        print_message("SKIP reason: %s is absent (Debian package dataset-fashion-mnist)\n",
                      FASHION_DIR);
        skip();
    }
    idx_dataset ds;
    char err[1024] = "";
    int rc = idx_load_dataset(FASHION_DIR, &ds, err, sizeof(err));
    if (rc != 0)
        print_error("%s\n", err);
    assert_int_equal(rc, 0);
    assert_int_equal(ds.train.n, 55000);
    assert_int_equal(ds.validation.n, 5000);
    assert_int_equal(ds.test.n, 10000);
    assert_int_equal(ds.rows, 28);
    assert_int_equal(ds.cols, 28);
    assert_int_equal(ds.n_features, 784);

    /* Fashion-MNIST is balanced: 6,000 training and 1,000 test images per class. */
    int64_t cls[10] = {0}, tcls[10] = {0};
    for (int64_t i = 0; i < ds.validation.n; i++)
        cls[ds.validation.labels[i]]++;
    for (int64_t i = 0; i < ds.train.n; i++)
        cls[ds.train.labels[i]]++;
    for (int64_t i = 0; i < ds.test.n; i++)
        tcls[ds.test.labels[i]]++;
    for (int c = 0; c < 10; c++) {
        assert_int_equal(cls[c], 6000);
        assert_int_equal(tcls[c], 1000);
    }
    float mn = 1, mx = 0;
    for (int64_t i = 0; i < ds.train.n * 784; i++) {
        mn = ds.train.images[i] < mn ? ds.train.images[i] : mn;
        mx = ds.train.images[i] > mx ? ds.train.images[i] : mx;
    }
    assert_true(mn == 0.0f);
    assert_true(mx == 1.0f);

    /* Against the file's bytes read here: validation[0] is file image 0,
     * train[0] is file image 5000, test[9999] the last test image; labels too. */
    char p[512];
    unsigned char px[784], lb[1];
    const float scale = (float)(1.0 / 255.0);
    struct { const float *img; const uint8_t *lab; const char *file, *lfile; long idx; } cases[] = {
        {ds.validation.images, ds.validation.labels, IDX_TRAIN_IMAGES, IDX_TRAIN_LABELS, 0},
        {ds.train.images, ds.train.labels, IDX_TRAIN_IMAGES, IDX_TRAIN_LABELS, 5000},
        {ds.train.images + 54999 * 784, ds.train.labels + 54999, IDX_TRAIN_IMAGES, IDX_TRAIN_LABELS, 59999},
        {ds.test.images + 9999 * 784, ds.test.labels + 9999, IDX_TEST_IMAGES, IDX_TEST_LABELS, 9999},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        snprintf(p, sizeof(p), "%s/%s.gz", FASHION_DIR, cases[c].file);
        read_gz_bytes(p, 16 + cases[c].idx * 784, px, 784);
        for (int k = 0; k < 784; k++)
            assert_true(cases[c].img[k] == (float)px[k] * scale);
        snprintf(p, sizeof(p), "%s/%s.gz", FASHION_DIR, cases[c].lfile);
        read_gz_bytes(p, 8 + cases[c].idx, lb, 1);
        assert_int_equal(cases[c].lab[0], lb[0]);
    }
    idx_dataset_free(&ds);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_raw),
        cmocka_unit_test(test_load_gz_and_mixed),
        cmocka_unit_test(test_pixel_extremes),
        cmocka_unit_test(test_default_validation_is_first_5000),
        cmocka_unit_test(test_raw_preferred_over_gz),
        cmocka_unit_test(test_bad_magic),
        cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_huge_declared_count_is_not_allocated),
        cmocka_unit_test(test_trailing_bytes),
        cmocka_unit_test(test_corrupt_gzip),
        cmocka_unit_test(test_count_mismatch),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_label_out_of_range),
        cmocka_unit_test(test_image_size_mismatch_and_validation_too_big),
        cmocka_unit_test(test_epoch_order_is_permutation_split_among_workers),
        cmocka_unit_test(test_epoch_order_deterministic_and_varies),
        cmocka_unit_test(test_epoch_order_uniform),
        cmocka_unit_test(test_epoch_order_bad_args),
        cmocka_unit_test(test_fashion_mnist),
    };
    return cmocka_run_group_tests_name("idx", tests, setup, teardown);
}
