/* sparse_set.h - a shard's row-sparse variables (sparse_table.h) as the
 * store holds them, and their part of a push body: a table NAME's gradient is
 * two tensors, "NAME:ids" (I64 [n]) and "NAME:values" (F32 [n, dim]); ':'
 * never occurs in a variable's name, so they cannot collide with a dense
 * variable's gradient. An update is made in two steps: sparse_set_prepare
 * (every check, duplicates summed, memory reserved: nothing visible changes,
 * so a push refused later changes nothing) and sparse_set_commit.
 *
 * No lock of its own: the store calls it under its lock. */
#ifndef RESTPS_SPARSE_SET_H
#define RESTPS_SPARSE_SET_H

#include "safetensors.h"
#include "sparse_table.h"

typedef struct sparse_set {
    sparse_table *t; /* sorted by name */
    int n, cap;
} sparse_set;

/* One table's piece of a push. */
typedef struct sparse_piece {
    int table;
    const unsigned char *ids; /* raw little-endian int64 */
    const float *vals;        /* n * dim */
    int64_t n;
} sparse_piece;

/* An update ready to commit: one accumulation per table touched. */
typedef struct sparse_batch {
    int n;
    int *table;
    sparse_acc *acc;
} sparse_batch;

void sparse_set_free(sparse_set *s);
/* Index of name, or -1. */
int sparse_set_find(const sparse_set *s, const char *name);
/* Declare name: 0 and *created (1 new, 0 the same declaration again), -1 out
 * of memory, -2 declared with another declaration (err says). */
int sparse_set_declare(sparse_set *s, const char *name, const sparse_decl *d, int *created, char *err,
                       size_t errlen);

/* 1 when tensor name is a sparse gradient's ("...:ids" or "...:values"). */
int sparse_tensor_name(const char *name);
/* 1 when t is a sparse gradient's ids: "...:ids", I64 (the one tensor of a
 * push that is not F32). */
int sparse_ids_tensor(const st_tensor *t);
/* The sparse pieces of a push (tensors named as above; the others are
 * passed over): each table known, ids I64 [n] checked (range, sign, shard),
 * values F32 [n, dim], both halves present. *pieces malloc'd (NULL when
 * none); 0, -1 bad (err says), -2 out of memory. */
int sparse_set_pieces(const sparse_set *s, const st_file *f, const unsigned char *data,
                      sparse_piece **pieces, int *n, char *err, size_t errlen);
/* Sum pieces (in order) per table and make room: 0, -1 out of memory, -2 an
 * update larger than a table's max_rows (err says). On failure b is empty. */
int sparse_set_prepare(sparse_set *s, const sparse_piece *p, int n, const optim_config *c,
                       sparse_batch *b, char *err, size_t errlen);
/* Apply b with gradient * scale; frees b. */
void sparse_set_commit(sparse_set *s, sparse_batch *b, const optim_config *c, float scale, int64_t step);
void sparse_batch_free(sparse_batch *b);

#endif
