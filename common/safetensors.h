/* safetensors.h - the one reader/writer of the safetensors format, used for bulk
 * pull/push bodies, checkpoints and exported models.
 *
 * Format: 8-byte little-endian header length N, N bytes of JSON object
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {"key": "string", ...}}, then the data; offsets are relative
 * to the first byte after the header. */
#ifndef RESTPS_SAFETENSORS_H
#define RESTPS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

#define ST_MAX_HEADER ((uint64_t)100 << 20) /* as the reference implementation */

typedef struct st_tensor {
    char *name;          /* owned */
    char dtype[12];      /* "F32", "BF16", ... */
    tensor_shape shape;  /* dims may be 0 here */
    uint64_t begin, end; /* byte offsets into the data section */
} st_tensor;

typedef struct st_meta {
    char *key, *value; /* owned */
} st_meta;

typedef struct st_file {
    int n_tensors;
    st_tensor *tensors; /* in header order */
    int n_meta;
    st_meta *meta;
    uint64_t header_len; /* N */
    uint64_t data_start; /* 8 + N */
    uint64_t data_len;
} st_file;

/* Bytes per element of a safetensors dtype name, or 0 when unknown. */
size_t st_dtype_size(const char *dtype);

/* All of len bytes at offset off of fd into buf (pread, EINTR retried). 0, or
 * -1 with errno (EIO when the file ended early) and, when err is not NULL,
 * err ("read failed at byte N: ..."). */
int st_pread_all(int fd, void *buf, size_t len, uint64_t off, char *err, size_t errlen);

/* Read the 8-byte prefix: header length, or -1 with err when it cannot fit in
 * `total_len` bytes or exceeds ST_MAX_HEADER. */
int st_read_prefix(const void *buf8, uint64_t total_len, uint64_t *header_len, char *err,
                   size_t errlen);

/* Parse and validate a header (the N JSON bytes) for a data section of
 * `data_len` bytes: known dtypes, sizes that match the shapes, offsets inside
 * the data that tile it exactly (no overlap, no hole), no duplicate names,
 * string metadata. On success fills *out (free with st_file_free); -1 with
 * err for a bad header, ST_ENOMEM when memory ran out (not the sender's fault). */
#define ST_ENOMEM (-2)
int st_parse_header(const void *header, uint64_t header_len, uint64_t data_len,
                    st_file *out, char *err, size_t errlen);

/* Prefix + header + data in one buffer. */
int st_parse(const void *buf, uint64_t len, st_file *out, char *err, size_t errlen);

void st_file_free(st_file *f);

/* Metadata value for key, or NULL. Borrowed from f. */
const char *st_meta_get(const st_file *f, const char *key);

/* Index of the tensor called name, or -1. */
int st_find(const st_file *f, const char *name);

/* Describes one tensor to write; its data follows the previous one's. */
typedef struct st_desc {
    const char *name;
    const char *dtype; /* NULL = "F32" */
    const tensor_shape *shape;
} st_desc;

/* Build prefix + JSON header, padded with spaces so the data starts 8-byte
 * aligned. Tensor i's data goes at data offset sum of the sizes before it.
 * meta_kv holds n_meta key/value pairs (keys[0], vals[0], keys[1], ...).
 * *out is malloc'd; *out_len is its length (= where the data starts). */
int st_header_build(const st_desc *t, int n, const char *const *meta_kv, int n_meta,
                    char **out, size_t *out_len, char *err, size_t errlen);

/* Write a whole safetensors file atomically: a temp file beside path, write,
 * fsync, rename over path, fsync of the folder. data holds the tensors in
 * order (their sizes summed). 0 or -1 with err; on failure path is untouched. */
int st_write_file(const char *path, const st_desc *t, int n, const char *const *meta_kv,
                  int n_meta, const void *data, size_t data_len, char *err, size_t errlen);

/* The temp file st_write_file writes first is named path + ST_TEMP_INFIX + pid. */
#define ST_TEMP_INFIX ".tmp."

/* One piece of the data section. */
typedef struct st_part {
    const void *data;
    size_t len;
} st_part;

/* st_write_file with the data in pieces (their lengths must sum to the
 * tensors' sizes). after_part (may be NULL) runs after each piece is written. */
int st_write_file_parts(const char *path, const st_desc *t, int n, const char *const *meta_kv,
                        int n_meta, const st_part *parts, int n_parts,
                        void (*after_part)(void *ctx, int i), void *ctx, char *err, size_t errlen);

#endif
