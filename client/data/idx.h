/* idx.h - the worker's data: MNIST-format IDX files (raw or gzipped) loaded into
 * float pixels and byte labels, split train/validation/test as TensorFlow's
 * input_data.read_data_sets does, and a deterministic per-epoch shuffle that
 * shards each epoch among the workers.
 *
 * IDX: a big-endian header, magic 0x00000803 (uint8, 3 dims) for images and
 * 0x00000801 (uint8, 1 dim) for labels, one big-endian uint32 per dimension,
 * then the bytes row-major. */
#ifndef RESTPS_IDX_H
#define RESTPS_IDX_H

#include <stddef.h>
#include <stdint.h>

#define IDX_MAGIC_IMAGES 0x00000803u
#define IDX_MAGIC_LABELS 0x00000801u
#define IDX_N_CLASSES 10
/* read_data_sets(validation_size=5000): the FIRST 5,000 training examples. */
#define IDX_VALIDATION_SIZE 5000

#define IDX_TRAIN_IMAGES "train-images-idx3-ubyte"
#define IDX_TRAIN_LABELS "train-labels-idx1-ubyte"
#define IDX_TEST_IMAGES "t10k-images-idx3-ubyte"
#define IDX_TEST_LABELS "t10k-labels-idx1-ubyte"

/* Examples of one split. Borrowed views into the dataset's buffers. */
typedef struct idx_split {
    int64_t n;             /* examples */
    const float *images;   /* n x n_features, row-major, each pixel/255 in [0,1] */
    const uint8_t *labels; /* n, each in [0, IDX_N_CLASSES) */
} idx_split;

typedef struct idx_dataset {
    int rows, cols;  /* image size (28 x 28) */
    int n_features;  /* rows * cols (784) */
    idx_split train, validation, test;
    /* owned: validation is train_images[0..V), train the rest */
    float *train_images_mem, *test_images_mem;
    uint8_t *train_labels_mem, *test_labels_mem;
} idx_dataset;

/* Find `name` in `dir`: dir/name if it exists, else dir/name.gz. Writes the path
 * found into path (pathlen bytes). 0, or -1 with err ("idx: DIR/NAME: not found
 * (nor NAME.gz)"). */
int idx_find(const char *dir, const char *name, char *path, size_t pathlen, char *err,
             size_t errlen);

/* Read one images file (magic 0x803, 3 dims), gzipped or raw (zlib reads both),
 * into a malloc'd n x rows*cols float array scaled by 1/255. The file must hold
 * exactly the bytes its header declares (a short file is "truncated", a longer
 * one has "trailing bytes"). 0, or -1 with err naming the path. */
int idx_read_images(const char *path, float **images, int64_t *n, int *rows, int *cols,
                    char *err, size_t errlen);

/* Read one labels file (magic 0x801, 1 dim) into a malloc'd byte array; every
 * label must be < n_classes. 0 or -1 with err naming the path. */
int idx_read_labels(const char *path, int n_classes, uint8_t **labels, int64_t *n, char *err,
                    size_t errlen);

/* Load the four files of an MNIST-format set from dir (each NAME or NAME.gz):
 * train = training examples [validation_size, N), validation = [0,
 * validation_size), test = the t10k files. Image and label counts must agree,
 * train and test images must have the same size, labels < 10.
 * 0, or a negative value with a one-line err; *ds is then empty. */
int idx_load_dataset_split(const char *dir, int64_t validation_size, idx_dataset *ds,
                           char *err, size_t errlen);

/* idx_load_dataset_split with validation_size = IDX_VALIDATION_SIZE (5,000):
 * Fashion-MNIST gives 55,000 / 5,000 / 10,000. */
int idx_load_dataset(const char *dir, idx_dataset *ds, char *err, size_t errlen);

/* Frees what idx_load_dataset* allocated; *ds becomes empty. Safe on an empty ds. */
void idx_dataset_free(idx_dataset *ds);

/* Worker `worker` of `n_workers`' slice [*begin, *end) of n items:
 * begin = floor(n*worker/n_workers). Slices tile [0, n); sizes differ by <= 1. */
void idx_shard_range(int64_t n, int worker, int n_workers, int64_t *begin, int64_t *end);

/* The examples worker `worker` of `n_workers` visits in epoch `epoch`, in order.
 *
 * One permutation of [0, n) per (seed, epoch), the same on every worker: a
 * Fisher-Yates shuffle (Durstenfeld: for i = n-1 down to 1, swap i with a
 * uniform j in [0, i]) driven by splitmix64 (rng.h) seeded with
 * rng_stream(seed, epoch), j drawn by rng_below (rejection, no modulo bias).
 * The worker takes its contiguous slice idx_shard_range(n, worker, n_workers) of
 * that permutation, so together the workers see every example exactly once per
 * epoch.
 *
 * out_idx must hold n entries (it is used for the whole permutation); on return
 * out_idx[0..*count) is this worker's slice. 0, or -1 on bad arguments (n < 0,
 * n > UINT32_MAX, n_workers < 1, worker outside [0, n_workers)). */
int idx_epoch_order(int64_t n, uint64_t seed, uint64_t epoch, int worker, int n_workers,
                    uint32_t *out_idx, int64_t *count);

#endif
