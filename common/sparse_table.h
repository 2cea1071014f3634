/* sparse_table.h - one row-sparse variable (an embedding table) of a ps
 * shard, or of workerd's --local training: rows of `dim` floats by int64 id, held only once pushed, with
 * per-row optimizer slots, a row limit with least-recently-updated eviction
 * and a deterministic initializer for rows not held.
 *
 * - rows > 0: a fixed table, ids 0..rows-1; rows == 0: a dynamic table, any
 *   id 0..INT64_MAX (TFRA/Monolith's dynamic embedding). Either way only the
 *   rows pushed at least once take memory (bounded by max_rows, never by the
 *   id space).
 * - A row not held reads as its initial value (sparse_init_row: zeros, or
 *   uniform in [-scale, scale) from splitmix64 of seed and id), so a lookup
 *   never creates a row; the first push of an id creates it from that value,
 *   its slots as the optimizer starts them (adagrad's accumulator at
 *   initial_accumulator_value, rmsprop's ms at 1, the others 0).
 * - An update touches only the pushed rows (lazy, as TF's LazyAdam): a row
 *   not pushed keeps its value and its slots; adam's bias correction counts
 *   the table's updates (t), as TF's beta powers count the variable's.
 * - A full table (max_rows held) evicts its least recently updated rows,
 *   never one the same update touches; an update touching more distinct
 *   rows than max_rows is refused.
 * - Shard shard of shards holds the ids with id % shards == shard.
 *
 * No lock of its own: the store calls it under its lock. */
#ifndef RESTPS_SPARSE_TABLE_H
#define RESTPS_SPARSE_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "optim.h"
#include "tensor.h"

#define SPARSE_DIM_MAX 65536
#define SPARSE_ROWS_MAX ((int64_t)1 << 40) /* a fixed table's rows; max_rows too */

typedef enum { SPARSE_INIT_ZEROS, SPARSE_INIT_UNIFORM } sparse_init_kind;

typedef struct sparse_decl {
    int64_t rows;     /* fixed: ids 0..rows-1; 0: dynamic */
    int dim;          /* 1..SPARSE_DIM_MAX */
    int64_t max_rows; /* rows held at most (1..SPARSE_ROWS_MAX); beyond: eviction */
    sparse_init_kind init;
    float init_scale; /* uniform: [-init_scale, init_scale) */
    uint64_t seed;
    int shard, shards; /* this table holds the ids with id % shards == shard */
} sparse_decl;

/* One update's gradient: distinct ids (first-seen order) with their summed rows. */
typedef struct sparse_acc {
    int dim;
    int64_t n, cap;
    int64_t *ids;
    float *vals;  /* n * dim */
    int64_t *hash; /* index into ids, or -1; hcap entries */
    size_t hcap;
} sparse_acc;

typedef struct sparse_table {
    char name[TENSOR_NAME_MAX + 1];
    sparse_decl d;
    int64_t n, cap;     /* rows held, room */
    int64_t *ids;       /* cap: row -> id */
    float *values;      /* cap * dim */
    float *slot0, *slot1; /* cap * dim each, or NULL (the optimizer's slots) */
    int n_slots;
    int64_t *prev, *next; /* least recently updated list over rows (-1 ends) */
    int64_t head, tail; /* head: the most recent */
    int64_t *hash;      /* open addressing: row index or -1; hcap entries */
    size_t hcap;
    int64_t updates;    /* updates applied (adam's t) */
    uint64_t version;
    int64_t evicted;    /* rows evicted so far */
} sparse_table;

/* A declaration that can be held, else -1 and err says why. */
int sparse_decl_check(const sparse_decl *d, char *err, size_t errlen);
int sparse_decl_equal(const sparse_decl *a, const sparse_decl *b);

/* 0 or -1 (out of memory). No slots until sparse_ensure_slots. */
int sparse_table_init(sparse_table *t, const char *name, const sparse_decl *d);
void sparse_table_free(sparse_table *t);
/* Bytes held (values and slots of the rows held). */
uint64_t sparse_table_bytes(const sparse_table *t);

/* 0 when every id (n, read unaligned from raw little-endian int64) belongs
 * here: non-negative, below rows for a fixed table, this shard's; else -1
 * with err naming the first that does not. */
int sparse_check_ids(const sparse_table *t, const unsigned char *ids, int64_t n, char *err,
                     size_t errlen);
/* Read id i of raw little-endian int64 ids. */
int64_t sparse_id_at(const unsigned char *ids, int64_t i);

/* The rows of ids (checked) into out (n * dim floats): held or initial. */
void sparse_lookup(const sparse_table *t, const unsigned char *ids, int64_t n, float *out);
/* Row id's initial value (dim floats). */
void sparse_init_row(const sparse_decl *d, int64_t id, float *out);

/* Gradient accumulation: duplicates summed (IndexedSlices semantics). */
int sparse_acc_init(sparse_acc *a, int dim);
void sparse_acc_free(sparse_acc *a);
/* Add n rows (ids raw, vals n * dim floats): 0 or -1 (out of memory, a
 * no-op then as far as the sum goes: the caller gives up). */
int sparse_acc_add(sparse_acc *a, const unsigned char *ids, const float *vals, int64_t n);

/* Make room for the update a (memory only, nothing visible changes):
 * 0, -1 out of memory, -2 more distinct rows than max_rows (err says). */
int sparse_prepare(sparse_table *t, const sparse_acc *a, char *err, size_t errlen);
/* Apply a (prepared) with gradient a * scale: creates the rows not held,
 * evicts the least recently updated beyond max_rows, updates only a's rows.
 * c's clip_norm applies to the whole update (tf.clip_by_norm of the
 * IndexedSlices' values). step: the global_step before it (the schedule). */
void sparse_apply(sparse_table *t, const sparse_acc *a, const optim_config *c, float scale,
                  int64_t step);

/* The rows held, least recently updated first: sparse_oldest, then
 * sparse_newer of each until -1. */
int64_t sparse_oldest(const sparse_table *t);
int64_t sparse_newer(const sparse_table *t, int64_t row);
/* Put a row back (restore) as the most recently updated: 0, -1 out of
 * memory, -2 a duplicate id or a full table. s0, s1: the slots (dim floats)
 * or NULL. */
int sparse_restore_row(sparse_table *t, int64_t id, const float *value, const float *s0,
                       const float *s1);
/* Hold the slots optimizer c needs (0..2 arrays), the rows held starting
 * them as a new row's: 0 or -1 (out of memory, nothing changed). */
int sparse_ensure_slots(sparse_table *t, const optim_config *c);

#endif
