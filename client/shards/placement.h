/* placement.h - where each variable of the model lives: a deterministic
 * function of the model's variable list and the number of ps tasks, which
 * every task computes alike (as TensorFlow's device setters do).
 *
 * - A variable larger than partition_bytes is split by rows (its first
 *   dimension) into one part per ps task (at most one per row), as
 *   tf.fixed_size_partitioner(num_ps): part i holds rows
 *   [i*q + min(i, r), ...) with q, r = divmod(rows, parts) — the first r
 *   parts get one row more — is named "<name>/part_<i>" and goes to ps i.
 *   Rows of a row-major tensor are one run of the buffer, so a part is pulled
 *   into and pushed from its place in the one parameter buffer: the client
 *   joins the parts by where it reads them.
 * - The other variables: PLACE_BYTES (the default) puts them in decreasing
 *   order of size (then model order) on the ps holding the fewest bytes so
 *   far (then the lowest index); PLACE_ROUND_ROBIN puts the k-th on ps
 *   k % n_ps in model order (TensorFlow's replica_device_setter). */
#ifndef RESTPS_PLACEMENT_H
#define RESTPS_PLACEMENT_H

#include <jansson.h>
#include <stdint.h>

#include "model/model.h"

typedef enum { PLACE_BYTES, PLACE_ROUND_ROBIN } place_policy;

typedef struct place_piece {
    char name[MODEL_NAME_MAX + 16]; /* "hid_w", or "hid_w/part_1" */
    int tensor;                   /* the layout's tensor */
    int ps;
    int part, parts;              /* parts = 1: not partitioned */
    tensor_shape shape;           /* this piece's shape (rows of the tensor) */
    int64_t row0;                 /* first row of the tensor it holds */
    size_t offset, numel;         /* in the parameter buffer, in floats */
} place_piece;

typedef struct placement {
    place_policy policy;
    uint64_t partition_bytes;
    int n_ps;
    int n;                /* pieces, in model order (a partitioned tensor's parts in a row) */
    place_piece *pieces;
    uint64_t *bytes;      /* per ps */
} placement;

const char *place_policy_name(place_policy p);
/* -1 when name is not "bytes" or "round_robin". */
int place_policy_from_name(const char *name, place_policy *out);

/* 0, or -1 with err (out of memory). Free with placement_free. */
int placement_compute(placement *p, const model_layout *L, int n_ps, place_policy policy,
                      uint64_t partition_bytes, char *err, size_t errlen);
void placement_free(placement *p);

/* The map as GET /v1/placement shows it:
 * {"model" (the canonical spec), "input_shape" ("28,28,1"), "policy",
 *  "partition_bytes", "ps_tasks", "bytes_per_ps": [...],
 *  "variables": [{"name", "shape", "parts": [{"name", "ps", "rows": [begin, end]}...]}...]} */
json_t *placement_json(const placement *p, const model_layout *L);

#endif
