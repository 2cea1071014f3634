/* batcher.c - the data order every training task follows (batcher_*) and the
 * two staged batch buffers of a training loop (batch_pair_*); see batcher.h. */
#include "data/batcher.h"

#include <stdlib.h>
#include <string.h>

/* Each epoch is one permutation of the training set, the same on every task
 * (idx_epoch_order from --seed and the epoch). The tasks take turns along it
 * in blocks of one batch: task i's k-th batch is positions
 * [(k*N + i)*b, (k*N + i + 1)*b). So the N tasks together see every example
 * once per epoch, and N sync tasks with batch b compute exactly the step one
 * task with batch N*b would. */
/* typedef struct batcher: in train.h (ring_train.c uses it too) */

int batcher_init(batcher *b, const idx_split *split, uint64_t seed, int trainer, int n_trainers)
{
    memset(b, 0, sizeof(*b));
    b->split = split;
    b->seed = seed;
    b->trainer = trainer;
    b->n_trainers = n_trainers;
    b->order = malloc(sizeof(uint32_t) * (size_t)(split->n ? split->n : 1));
    if (!b->order)
        return -1;
    return idx_epoch_order(split->n, seed, 0, 0, 1, b->order, &b->count);
}

/* Batch number k of this task: epoch k / P and block k % P of it, where P =
 * the rounds of N blocks that fit in an epoch (the remainder is left out, as
 * drop_remainder). A function of k alone, so a restarted task (sync: k is the
 * global step) picks up its place in the data where it was. */
void batcher_at(batcher *b, int64_t k, int batch, int n_features, float *x, uint8_t *y,
                int64_t *example0)
{
    int64_t round = (int64_t)b->n_trainers * batch;
    int64_t per_epoch = b->count / round;
    uint64_t epoch = (uint64_t)(k / per_epoch);
    if (epoch != b->epoch) {
        b->epoch = epoch;
        idx_epoch_order(b->split->n, b->seed, b->epoch, 0, 1, b->order, &b->count);
    }
    int64_t at = (k % per_epoch) * round + (int64_t)b->trainer * batch;
    if (example0)
        *example0 = (int64_t)epoch * b->count + at;
    for (int i = 0; i < batch; i++) {
        uint32_t e = b->order[at + i];
        memcpy(x + (size_t)i * n_features, b->split->images + (size_t)e * n_features,
               sizeof(float) * (size_t)n_features);
        y[i] = b->split->labels[e];
    }
    b->k = k + 1;
}

int batch_pair_alloc(batch_pair *p, model *m, int batch, int n_features)
{
    const size_t xbytes = sizeof(float) * (size_t)batch * (size_t)n_features;
    for (int i = 0; i < 2; i++) {
        p->x[i] = model_host_alloc(m, xbytes);
        p->y[i] = model_host_alloc(m, (size_t)batch);
    }
    return p->x[0] && p->x[1] && p->y[0] && p->y[1] ? 0 : -1;
}

void batch_pair_free(batch_pair *p, model *m)
{
    for (int i = 0; i < 2; i++) {
        model_host_free(m, p->x[i]);
        model_host_free(m, p->y[i]);
    }
}

