/* idx.c - MNIST-format IDX files into float pixels and byte labels; the
 * train/validation/test split; the per-epoch shuffle shared by all workers.
 *
 * zlib's gzread reads both gzipped and plain files (a file without the gzip
 * magic is passed through), so one reader serves NAME and NAME.gz. Pixels are
 * converted chunk by chunk straight into the float array: no byte-sized copy of
 * the whole file is kept. */
#include "errmsg.h"
#include "data/idx.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "rng.h"

/* bytes per gzread; the fuzz build makes it small, so that small inputs
 * cross chunk boundaries (and zlib's buffers are not 1 MiB per run) */
#ifndef IDX_CHUNK
#define IDX_CHUNK (1u << 18)
#endif
#define CHUNK IDX_CHUNK
#define MAX_ITEMS ((uint64_t)1 << 32)    /* bytes of data one file may declare */

int idx_find(const char *dir, const char *name, char *path, size_t pathlen, char *err,
             size_t errlen)
{
    struct stat st;
    const char *sep = (dir[0] && dir[strlen(dir) - 1] != '/') ? "/" : "";
    int n = snprintf(path, pathlen, "%s%s%s", dir, sep, name);
    if (n < 0 || (size_t)n + 3 >= pathlen)
        return errmsg(err, errlen, "idx: %s%s%s: path too long", dir, sep, name);
    if (stat(path, &st) == 0)
        return 0;
    int first_errno = errno;
    strcat(path, ".gz");
    if (stat(path, &st) == 0)
        return 0;
    path[n] = '\0';
    if (first_errno == ENOENT && errno == ENOENT)
        return errmsg(err, errlen, "idx: %s: not found (nor %s.gz)", path, name);
    return errmsg(err, errlen, "idx: %s: %s", path, strerror(first_errno != ENOENT ? first_errno : errno));
}

/* Read exactly len bytes. 0; 1 when the file ended first (*got says where);
 * -1 on a zlib error (*zmsg says which; a gzip stream cut short is
 * Z_BUF_ERROR, reported as truncated by the callers). */
static int read_exact(gzFile f, void *buf, size_t len, size_t *got, int *zerrnum,
                      const char **zmsg)
{
    unsigned char *p = buf;
    size_t done = 0;
    while (done < len) {
        size_t want = len - done;
        if (want > CHUNK)
            want = CHUNK;
        int r = gzread(f, p + done, (unsigned)want);
        if (r < 0) {
            *got = done;
            *zmsg = gzerror(f, zerrnum);
            return -1;
        }
        if (r == 0) {
            /* The end of a plain file, or of a gzip stream cut short (zlib then
             * records Z_BUF_ERROR "unexpected end of file" and returns 0). */
            *got = done;
            *zmsg = gzerror(f, zerrnum);
            return 1;
        }
        done += (size_t)r;
    }
    *got = done;
    return 0;
}

/* zlib's message without the "path: " it puts in front. */
static const char *zlib_msg(const char *path, const char *zmsg)
{
    size_t n = strlen(path);
    if (!zmsg)
        return "unknown zlib error";
    if (strncmp(zmsg, path, n) == 0 && zmsg[n] == ':' && zmsg[n + 1] == ' ')
        return zmsg + n + 2;
    return zmsg;
}

static int read_fail(const char *path, int rc, size_t got, size_t want, const char *what,
                     int zerrnum, const char *zmsg, char *err, size_t errlen)
{
    if (rc == 1 || zerrnum == Z_BUF_ERROR) {
        if (zerrnum == Z_BUF_ERROR) /* zlib reads ahead: where it ended is not known */
            return errmsg(err, errlen, "idx: %s: truncated: the gzip stream ends early", path);
        return errmsg(err, errlen, "idx: %s: truncated: expected %zu bytes (%s), the file ends after %zu",
                    path, want, what, got);
    }
    return errmsg(err, errlen, "idx: %s: corrupt: %s", path, zlib_msg(path, zmsg));
}

/* Make room for `need` elements of `elem` bytes in *buf (capacity *cap),
 * doubling, never past `max`. The header's count alone never sizes an
 * allocation: a short file that declares 4 GiB ends as "truncated" having
 * asked for about twice the bytes it holds. 0, or -1 (buf untouched). */
static int grow(void **buf, uint64_t *cap, uint64_t need, uint64_t max, size_t elem)
{
    if (need <= *cap)
        return 0;
    uint64_t c = *cap ? *cap : CHUNK;
    while (c < need)
        c *= 2;
    if (c > max)
        c = max;
    void *p = realloc(*buf, c * elem);
    if (!p)
        return -1;
    *buf = p;
    *cap = c;
    return 0;
}

/* Open, check the magic, read ndim dims. */
static int open_header(const char *path, uint32_t magic, int ndim, gzFile *out, uint32_t *dims,
                       char *err, size_t errlen)
{
    errno = 0;
    gzFile f = gzopen(path, "rb");
    if (!f)
        return errmsg(err, errlen, "idx: %s: %s", path, errno ? strerror(errno) : "cannot open");
    gzbuffer(f, CHUNK);
    unsigned char h[4 + 4 * 3];
    size_t hlen = 4 + 4 * (size_t)ndim, got = 0;
    int zerrnum = 0;
    const char *zmsg = NULL;
    /* The magic first, so a file that is not IDX at all says "bad magic". */
    int rc = read_exact(f, h, 4, &got, &zerrnum, &zmsg);
    if (rc != 0) {
        read_fail(path, rc, got, hlen, "header", zerrnum, zmsg, err, errlen);
        gzclose(f);
        return -1;
    }
    uint32_t m = (uint32_t)h[0] << 24 | (uint32_t)h[1] << 16 | (uint32_t)h[2] << 8 | h[3];
    if (m != magic) {
        gzclose(f);
        return errmsg(err, errlen, "idx: %s: bad magic 0x%08x (expected 0x%08x, %s)", path, m, magic,
                    magic == IDX_MAGIC_IMAGES ? "uint8 images, 3 dims" : "uint8 labels, 1 dim");
    }
    rc = read_exact(f, h + 4, hlen - 4, &got, &zerrnum, &zmsg);
    if (rc != 0) {
        read_fail(path, rc, got + 4, hlen, "header", zerrnum, zmsg, err, errlen);
        gzclose(f);
        return -1;
    }
    for (int i = 0; i < ndim; i++) {
        const unsigned char *d = h + 4 + 4 * i;
        dims[i] = (uint32_t)d[0] << 24 | (uint32_t)d[1] << 16 | (uint32_t)d[2] << 8 | d[3];
        if (dims[i] == 0) {
            gzclose(f);
            return errmsg(err, errlen, "idx: %s: dimension %d is 0", path, i);
        }
    }
    *out = f;
    return 0;
}

/* After the declared data: the file must end there, with a valid gzip trailer. */
static int check_end(gzFile f, const char *path, uint64_t declared, char *err, size_t errlen)
{
    unsigned char extra[1];
    int r = gzread(f, extra, 1);
    if (r > 0)
        return errmsg(err, errlen, "idx: %s: trailing bytes after the %llu bytes of data the header declares",
                    path, (unsigned long long)declared);
    int zerrnum = Z_OK;
    const char *zmsg = gzerror(f, &zerrnum);
    if (zerrnum == Z_BUF_ERROR) /* returned 0 or -1: the gzip trailer is cut */
        return errmsg(err, errlen, "idx: %s: truncated: the gzip stream ends early", path);
    if (r < 0 || zerrnum != Z_OK)
        return errmsg(err, errlen, "idx: %s: corrupt: %s", path, zlib_msg(path, zmsg));
    return 0;
}

int idx_read_images(const char *path, float **images, int64_t *n, int *rows, int *cols,
                    char *err, size_t errlen)
{
    gzFile f;
    uint32_t dims[3];
    *images = NULL;
    if (open_header(path, IDX_MAGIC_IMAGES, 3, &f, dims, err, errlen) != 0)
        return -1;
    uint64_t per = (uint64_t)dims[1] * dims[2];
    uint64_t total = per * dims[0];
    if (dims[1] > 65535 || dims[2] > 65535 || total > MAX_ITEMS) {
        gzclose(f);
        return errmsg(err, errlen, "idx: %s: %ux%ux%u images is too large", path, dims[0], dims[1],
                    dims[2]);
    }

    /* numpy's images.astype(float32) * (1.0/255.0): the scale rounded to float. */
    float lut[256];
    const float scale = (float)(1.0 / 255.0);
    for (int i = 0; i < 256; i++)
        lut[i] = (float)i * scale;

    float *out = NULL;
    uint64_t cap = 0;
    unsigned char *buf = malloc(CHUNK);
    if (!buf) {
        gzclose(f);
        return errmsg(err, errlen, "idx: %s: out of memory", path);
    }
    uint64_t done = 0;
    while (done < total) {
        size_t want = total - done < CHUNK ? (size_t)(total - done) : CHUNK, got = 0;
        int zerrnum = 0;
        const char *zmsg = NULL;
        int rc = read_exact(f, buf, want, &got, &zerrnum, &zmsg);
        if (rc != 0) {
            char what[96];
            snprintf(what, sizeof(what), "header + %ux%ux%u pixels", dims[0], dims[1], dims[2]);
            read_fail(path, rc, 16 + done + got, 16 + total, what, zerrnum, zmsg, err, errlen);
            goto fail;
        }
        if (grow((void **)&out, &cap, done + want, total, sizeof(float)) != 0) {
            errmsg(err, errlen, "idx: %s: out of memory for %llu pixels", path,
                   (unsigned long long)total);
            goto fail;
        }
        for (size_t i = 0; i < want; i++)
            out[done + i] = lut[buf[i]];
        done += want;
    }
    if (check_end(f, path, total, err, errlen) != 0)
        goto fail;
    free(buf);
    gzclose(f);
    *images = out;
    *n = dims[0];
    *rows = (int)dims[1];
    *cols = (int)dims[2];
    return 0;
fail:
    free(out);
    free(buf);
    gzclose(f);
    return -1;
}

int idx_read_labels(const char *path, int n_classes, uint8_t **labels, int64_t *n, char *err,
                    size_t errlen)
{
    gzFile f;
    uint32_t dims[1];
    *labels = NULL;
    if (open_header(path, IDX_MAGIC_LABELS, 1, &f, dims, err, errlen) != 0)
        return -1;
    uint8_t *out = NULL;
    uint64_t cap = 0, done = 0;
    while (done < dims[0]) {
        size_t want = dims[0] - done < CHUNK ? (size_t)(dims[0] - done) : CHUNK, got = 0;
        if (grow((void **)&out, &cap, done + want, dims[0], 1) != 0) {
            errmsg(err, errlen, "idx: %s: out of memory for %u labels", path, dims[0]);
            goto fail;
        }
        int zerrnum = 0;
        const char *zmsg = NULL;
        int rc = read_exact(f, out + done, want, &got, &zerrnum, &zmsg);
        if (rc != 0) {
            char what[64];
            snprintf(what, sizeof(what), "header + %u labels", dims[0]);
            read_fail(path, rc, 8 + done + got, 8 + (size_t)dims[0], what, zerrnum, zmsg, err,
                      errlen);
            goto fail;
        }
        done += want;
    }
    if (check_end(f, path, dims[0], err, errlen) != 0)
        goto fail;
    for (uint32_t i = 0; i < dims[0]; i++)
        if (out[i] >= n_classes) {
            errmsg(err, errlen, "idx: %s: label %u at index %u is out of range (0..%d)", path,
                 out[i], i, n_classes - 1);
            goto fail;
        }
    gzclose(f);
    *labels = out;
    *n = dims[0];
    return 0;
fail:
    free(out);
    gzclose(f);
    return -1;
}

void idx_dataset_free(idx_dataset *ds)
{
    if (!ds)
        return;
    free(ds->train_images_mem);
    free(ds->test_images_mem);
    free(ds->train_labels_mem);
    free(ds->test_labels_mem);
    memset(ds, 0, sizeof(*ds));
}

/* Images and labels of one split, checked against each other. */
static int load_pair(const char *img_path, const char *lab_path, float **images,
                     uint8_t **labels, int64_t *n, int *rows, int *cols, char *err, size_t errlen)
{
    int64_t n_img = 0, n_lab = 0;
    if (idx_read_images(img_path, images, &n_img, rows, cols, err, errlen) != 0)
        return -1;
    if (idx_read_labels(lab_path, IDX_N_CLASSES, labels, &n_lab, err, errlen) != 0)
        return -1;
    if (n_img != n_lab)
        return errmsg(err, errlen, "idx: %s: %lld labels but %s has %lld images", lab_path,
                    (long long)n_lab, img_path, (long long)n_img);
    *n = n_img;
    return 0;
}

int idx_load_dataset_split(const char *dir, int64_t validation_size, idx_dataset *ds,
                           char *err, size_t errlen)
{
    char p_tri[4096], p_trl[4096], p_tei[4096], p_tel[4096];
    memset(ds, 0, sizeof(*ds));
    if (!dir || !dir[0])
        return errmsg(err, errlen, "idx: no data directory given");
    if (validation_size < 0)
        return errmsg(err, errlen, "idx: validation size %lld is negative", (long long)validation_size);
    /* Every file is found before any is read: a missing one fails at once. */
    if (idx_find(dir, IDX_TRAIN_IMAGES, p_tri, sizeof(p_tri), err, errlen) != 0 ||
        idx_find(dir, IDX_TRAIN_LABELS, p_trl, sizeof(p_trl), err, errlen) != 0 ||
        idx_find(dir, IDX_TEST_IMAGES, p_tei, sizeof(p_tei), err, errlen) != 0 ||
        idx_find(dir, IDX_TEST_LABELS, p_tel, sizeof(p_tel), err, errlen) != 0)
        return -1;

    int64_t n_train = 0, n_test = 0;
    int rows = 0, cols = 0, trows = 0, tcols = 0;
    if (load_pair(p_tri, p_trl, &ds->train_images_mem, &ds->train_labels_mem, &n_train, &rows,
                  &cols, err, errlen) != 0)
        goto fail;
    if (load_pair(p_tei, p_tel, &ds->test_images_mem, &ds->test_labels_mem, &n_test, &trows,
                  &tcols, err, errlen) != 0)
        goto fail;
    if (trows != rows || tcols != cols) {
        errmsg(err, errlen, "idx: %s: %dx%d images but %s has %dx%d", p_tei, trows, tcols, p_tri,
             rows, cols);
        goto fail;
    }
    if (validation_size > n_train) {
        errmsg(err, errlen, "idx: %s: %lld training images, fewer than the validation size %lld",
             p_tri, (long long)n_train, (long long)validation_size);
        goto fail;
    }
    ds->rows = rows;
    ds->cols = cols;
    ds->n_features = rows * cols;
    /* As tensorflow/examples/tutorials/mnist (contrib/learn/.../mnist.py)
     * read_data_sets: validation_images = train_images[:validation_size],
     * train_images = train_images[validation_size:]; the first examples of the
     * training file are the validation set, no shuffle before the split. */
    size_t nf = (size_t)ds->n_features;
    ds->validation.n = validation_size;
    ds->validation.images = ds->train_images_mem;
    ds->validation.labels = ds->train_labels_mem;
    ds->train.n = n_train - validation_size;
    ds->train.images = ds->train_images_mem + (size_t)validation_size * nf;
    ds->train.labels = ds->train_labels_mem + validation_size;
    ds->test.n = n_test;
    ds->test.images = ds->test_images_mem;
    ds->test.labels = ds->test_labels_mem;
    return 0;
fail:
    idx_dataset_free(ds);
    return -1;
}

int idx_load_dataset(const char *dir, idx_dataset *ds, char *err, size_t errlen)
{
    return idx_load_dataset_split(dir, IDX_VALIDATION_SIZE, ds, err, errlen);
}

void idx_shard_range(int64_t n, int worker, int n_workers, int64_t *begin, int64_t *end)
{
    /* n <= UINT32_MAX and n_workers < 2^31: the products fit in 64 bits. */
    *begin = n * worker / n_workers;
    *end = n * (worker + 1) / n_workers;
}

int idx_epoch_order(int64_t n, uint64_t seed, uint64_t epoch, int worker, int n_workers,
                    uint32_t *out_idx, int64_t *count)
{
    if (n < 0 || (uint64_t)n > UINT32_MAX || n_workers < 1 || worker < 0 || worker >= n_workers ||
        (n > 0 && !out_idx) || !count)
        return -1;
    for (int64_t i = 0; i < n; i++)
        out_idx[i] = (uint32_t)i;
    uint64_t st = rng_stream(seed, epoch);
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)rng_below(&st, (uint64_t)i + 1);
        uint32_t t = out_idx[i];
        out_idx[i] = out_idx[j];
        out_idx[j] = t;
    }
    int64_t b, e;
    idx_shard_range(n, worker, n_workers, &b, &e);
    if (b > 0)
        memmove(out_idx, out_idx + b, (size_t)(e - b) * sizeof(uint32_t));
    *count = e - b;
    return 0;
}
