/* langid_train.h - what --data=langid's roles share (langid_train.c): the
 * data, the dense part of the model, a batch's bags over the rows it
 * touches, evaluation and the export. */
#ifndef RESTPS_LANGID_TRAIN_H
#define RESTPS_LANGID_TRAIN_H

#include <stdint.h>

#include "sparse_table.h"
#include "workerd/train.h"

/* A batch: n examples' bags as indices into the n_uniq distinct ids it touches. */
typedef struct langid_batch {
    int n;
    uint8_t *labels;  /* n */
    int64_t *off;     /* n + 1 */
    int32_t *idx;     /* off[n]: into uniq */
    int64_t *uniq;    /* n_uniq distinct ids, first-seen order */
    int64_t n_uniq, cap;
    int32_t *hash;
    size_t hcap;
} langid_batch;

typedef struct langid_state {
    const train_config *c;
    langid_dataset ds;
    model *m;
    sparse_decl decl;     /* the table's (init: uniform 1/dim, the seed) */
    float *params, *grads, *s0, *s1; /* the dense layers (s0, s1: --local's slots) */
    float *x, *dx, *logits, *dlogits;
    float *rows, *drows;  /* the batch's rows and their gradients [n_uniq, dim] */
    size_t rows_cap;
    langid_batch b;
    uint32_t *order, *test_ex;
    int64_t epoch;
} langid_state;

/* "embed:ROWSxDIM[,mean|sum],REST" into out: 0, or -1 with err. */
int langid_parse_spec(const char *spec, langid_model *out, char *err, size_t errlen);

int langid_state_init(langid_state *st, const train_config *c, int max_batch, char *err, size_t errlen);
void langid_state_free(langid_state *st);
/* The batch of local step `step` of worker of n_workers into st->b (its
 * slice of each epoch's order, idx_epoch_order). 0 or -1. */
int langid_next_batch(langid_state *st, int64_t step, int worker, int n_workers);
/* With st->rows holding the batch's rows: loss, dense gradients into
 * st->grads, the rows' gradients into st->drows. 0 or -1. */
int langid_forward_backward(langid_state *st, double *loss);
/* Test loss and accuracy, the rows of each batch from lookup (0 or -1). */
int langid_evaluate(langid_state *st, int (*lookup)(void *ctx, const int64_t *ids, int64_t n, float *out), void *ctx,
                    double *loss, double *acc);
/* The dense tensors and the table's rows held (emb:ids, emb:values) to path. */
int langid_export(langid_state *st, const char *path, const int64_t *ids, const float *values, int64_t n_rows,
                  int64_t step, char *err, size_t errlen);

#endif
