/* batcher.h - the data order and the batch buffers (batcher.c): every
 * training task of a job takes its own block of each epoch's permutation of
 * the training split, so N tasks of batch b see what one task of batch N*b
 * sees. */
#ifndef RESTPS_BATCHER_H
#define RESTPS_BATCHER_H

#include <stdint.h>

#include "data/idx.h"
#include "model/model.h"

/* The data order: task `trainer` of n_trainers takes the k-th
 * block of each epoch's permutation; see batcher_at. */
typedef struct batcher {
    const idx_split *split;
    uint32_t *order;
    int64_t count, k;
    uint64_t epoch, seed;
    int trainer, n_trainers;
} batcher;
int batcher_init(batcher *b, const idx_split *split, uint64_t seed, int trainer, int n_trainers);
/* Batch k into x and y; *example0 gets the index of its first example in the
 * epoch order (epoch * examples + position; row i is *example0 + i), what
 * dropout's mask depends on: N tasks x batch b give the rows the indices one
 * task x N*b gives them. */
void batcher_at(batcher *b, int64_t k, int batch, int n_features, float *x, uint8_t *y,
                int64_t *example0);
/* Two batch buffers from model_host_alloc (pinned on a GPU): a step computes
 * on one while the next batch is gathered into the other and staged
 * (model_stage_batch). alloc: 0, or -1 when out of memory (free it still);
 * free takes what alloc left, before model_free(m). */
typedef struct batch_pair {
    float *x[2];
    uint8_t *y[2];
    int64_t example0[2]; /* each buffer's batcher_at example0 */
} batch_pair;
int batch_pair_alloc(batch_pair *p, model *m, int batch, int n_features);
void batch_pair_free(batch_pair *p, model *m);

#endif
