/* store.h - the shard's variables: named float32 tensors with versions, the
 * shard's global_step, and the updates applied to them.
 *
 * Readers take a reference to a variable's blob under the read lock and then
 * read it without any lock: the store never writes a blob someone else holds
 * (it writes the next version into a fresh blob instead), so every pull sees
 * one consistent version, and /v1/params one consistent version of the shard. */
#ifndef RESTPS_STORE_H
#define RESTPS_STORE_H

#include <pthread.h>
#include <stdint.h>

#include "bufpool.h"
#include "safetensors.h"
#include "tensor.h"

enum {
    STORE_OK = 0,
    STORE_ENOENT = -2,   /* unknown variable */
    STORE_EEXIST = -3,   /* create-only and it exists */
    STORE_ESHAPE = -4,   /* shape or length mismatch */
    STORE_EINVAL = -5,   /* bad input (message in err) */
    STORE_ENOMEM = -6,
};

typedef struct store_var {
    char name[TENSOR_NAME_MAX + 1];
    tensor_shape shape;
    int64_t numel;
    uint64_t version;
    blob *data; /* the store's reference; len = numel * 4 */
} store_var;

/* A consistent view of one variable; holds a reference to its data. */
typedef struct store_snap {
    char name[TENSOR_NAME_MAX + 1];
    tensor_shape shape;
    int64_t numel;
    uint64_t version;
    blob *data;
} store_snap;

#define STORE_PUSH_IDS 1024
#define STORE_PUSH_ID_MAX 64

typedef struct store {
    pthread_rwlock_t lock;
    store_var *vars; /* sorted by name */
    int n, cap;
    int64_t global_step;
    uint64_t bytes;
    double last_loss;
    int has_loss;
    float learning_rate;
    bufpool *pool;
    /* recently applied push ids, a ring */
    struct {
        char id[STORE_PUSH_ID_MAX + 1];
        int64_t step;
    } pushes[STORE_PUSH_IDS];
    int push_next;
} store;

int store_init(store *s, float learning_rate, bufpool *pool);
void store_destroy(store *s);

/* Snapshot one variable (reference taken; release with store_snap_release). */
int store_get(store *s, const char *name, store_snap *out);
void store_snap_release(store_snap *snap);

/* Whether a variable exists and its shape (for checks before a body arrives). */
int store_peek(store *s, const char *name, tensor_shape *shape);

/* Snapshot every variable and global_step at one instant. *out is malloc'd
 * (n entries); release with store_snaps_release. */
int store_get_all(store *s, store_snap **out, int *n, int64_t *global_step);
void store_snaps_release(store_snap *snaps, int n);

/* Create or replace `name` with `data` (len numel*4), taking ownership of the
 * caller's reference. only_create: STORE_EEXIST when it exists. *created set. */
int store_put(store *s, const char *name, const tensor_shape *shape, blob *data,
              int only_create, int *created, uint64_t *version);

/* w -= lr * g for one variable; bumps its version and global_step. */
int store_apply_grad(store *s, const char *name, const float *g, int64_t numel,
                     int64_t *global_step, uint64_t *version);

/* Metadata a worker sends with a bulk push. */
typedef struct store_push_meta {
    const char *push_id; /* NULL or 1..64 chars */
    int has_loss;
    double loss;
} store_push_meta;

/* Apply every gradient of a parsed safetensors body (data = the data section)
 * as one update: all names must exist with equal shapes and dtype F32, else
 * nothing changes and err says why. A push_id already applied is not applied
 * again: *duplicate = 1 and *global_step is the step it produced. */
int store_apply_grads(store *s, const st_file *f, const unsigned char *data,
                      const store_push_meta *meta, int64_t *global_step, int *duplicate,
                      char *err, size_t errlen);

/* Counters for /v1/status. */
void store_totals(store *s, int *n_vars, uint64_t *bytes, int64_t *global_step, int *has_loss,
                  double *last_loss);

#endif
