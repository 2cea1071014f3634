/* shards.h - the model's variables on the ps tasks: the placement
 * (placement.h: balanced by bytes or round-robin, large variables
 * partitioned by rows), and moving the whole parameter and gradient buffers
 * to and from every shard at once (libcurl multi): one bulk request per
 * shard, one copy between the wire and the contiguous buffer. */
#ifndef RESTPS_SHARDS_H
#define RESTPS_SHARDS_H

#include <stdint.h>

#include "libps/libps.h"
#include "safetensors.h"
#include "wire_dtype.h"
#include "model/model.h"
#include "shards/heartbeat.h"
#include "shards/placement.h"
#include "shards/topk.h"

typedef struct shard {
    int n_p;                    /* pieces on this shard, in buffer order */
    int *p;                     /* their indices in the placement */
    size_t floats;              /* their total size */
    unsigned char *rx;          /* a pull lands here (pre-touched) */
    uint16_t *wbuf;             /* the 16-bit gradients of a push (shards_set_wire) */
    size_t rx_cap;
    float *stage;               /* gradients gathered when not contiguous in the buffer */
    int contiguous;             /* the shard's pieces are one run of the buffer */
    size_t first;               /* its offset then */
    int64_t step;               /* the shard's global_step in the last pull */
    int64_t want;               /* sync: the step to wait for in the next pull */
    int back;                   /* guarded pulls: 1 the shard came back behind its step, 2 empty */
    int64_t back_step;          /* its global_step then */
} shard;

/* Streaming (overlap.h sets it while a transfer runs on its thread): pull
 * 1: pulls (and ?return=params answers) tell landed as their bytes land and
 * leave params alone (the overlap copies each layer as it comes); push 1:
 * a push's body holds its tensors last layer first, each read once
 * layer_ready(arg, its layer) returned 0 (float32, no extra tensors). */
typedef struct shards_stream {
    int pull, push;
    ps_landed_fn landed;
    int (*layer_ready)(void *arg, int layer);
    void *arg;
} shards_stream;

typedef struct shards {
    ps_client *c;
    const model_layout *L;
    placement pl;
    int n;
    shard *s;
    /* -1 (shards_init): pulls copy what every shard sends. >= 0: a shard
     * that answers without the model's variables, or with a global_step
     * more than guard below the step this task last pulled from it (it
     * restarted empty, or from an older checkpoint), is not copied: the
     * parameters keep what this task pulled last from it, its step stays,
     * its back is set (n_back counts them) until a pull finds it caught up */
    int guard;
    int n_back;
    /* the wire (shards_set_wire): float32, or 16-bit bodies both ways; fp16
     * gradients are sent times loss_scale (dynamic: halved when the cast
     * would overflow, doubled after SCALE_GROWTH_STEPS clean pushes), the ps
     * divides it out */
    wire_dtype wire;
    double loss_scale;
    int64_t clean;     /* pushes since the scale last moved */
    int64_t backoffs;  /* times it was halved */
    shards_stream st;
    topk tk; /* --topk_ratio (shards_set_topk): ratio 0 = off */
} shards;

int shards_init(shards *sh, ps_client *c, const model_layout *L, place_policy policy,
                uint64_t partition_bytes, char *err, size_t errlen);
void shards_free(shards *sh);

/* Create every variable (each part of a partitioned one) with a create-only
 * PUT (If-None-Match: *); one that exists already (restored, or another
 * chief's) is left as it is. *created / *existing count them. */
int shards_create(shards *sh, const float *params, int *created, int *existing);

/* Put back shard i's variables from params (plain PUTs: created, or
 * replacing what is there); *n counts them. */
int shards_put_back(shards *sh, int i, const float *params, int *n);

/* Pull every shard into params; *step = ps 0's global_step. min_step >= 0
 * long-polls each shard until it reaches min_step (or timeout_ms). */
int shards_pull(shards *sh, float *params, int64_t min_step, long timeout_ms, int64_t *step);

/* Sync: pull every shard, each long-polling (up to timeout_ms) for the step
 * after the one this worker last pushed to it. *step = ps 0's step;
 * *behind = some shard is still below the step it was waited for (the long
 * poll timed out, or the shard no longer holds this worker's gradient, e.g.
 * it restarted): the caller computes and pushes for the current steps again.
 * last_step: once ps 0 is there, training is over: shards are read as they
 * are (they may stand at other steps after one of them restarted). */
int shards_pull_sync(shards *sh, float *params, int worker, long timeout_ms, int64_t last_step,
                     int64_t *step, int *behind);

/* Async with a staleness bound: pull, first waiting (ps 0) until the slowest
 * live worker completed min_clock iterations, and announcing that this worker
 * starts iteration `clock`; the other shards are read after ps 0 answered
 * (one round trip more with several ps), so they hold what the wait waited
 * for. */
int shards_pull_ssp(shards *sh, float *params, int worker, int64_t clock, int64_t min_clock,
                    long timeout_ms, int64_t *step);

/* Sync: pull without waiting next time (after a shard refused a gradient
 * from a step it has not reached: it restarted behind us). */
void shards_rewind(shards *sh);

typedef struct push_meta {
    int worker;
    int64_t step;
    double loss;
    int batch_size;
    const char *push_id;
    int64_t clock;      /* stale-synchronous: this worker's iteration; -1 = not sent */
} push_meta;

/* Push grads to every shard, each stamped with the step pulled from that
 * shard (m->step is ignored); *step and *outcome are ps 0's answer. */
int shards_push(shards *sh, const float *grads, const push_meta *m, int64_t *step, int *outcome);

/* Bodies in dtype d both ways from now on (WIRE_F32: as before). 0, or -1
 * when out of memory. fp16's loss scale starts at 2^16. */
#define SHARDS_SCALE_START 65536.0
#define SHARDS_SCALE_GROWTH_STEPS 1000
int shards_set_wire(shards *sh, wire_dtype d);

/* --topk_ratio: from now on a push carries the largest ratio of each
 * piece's gradient by ids (topk.h; ratio 0: whole again). 0, or -1 out of
 * memory. */
int shards_set_topk(shards *sh, double ratio);

/* shards_push, one round trip: each shard answers with its variables after
 * the update (POST /v1/grads?return=params), copied into params as a pull
 * copies them (*step: ps 0's step then). min_clock > 0: ps 0 answers once the
 * slowest live worker completed min_clock iterations, and the worker starts
 * iteration clock (> 0) then (stale-synchronous); when ps 0 had to wait, the
 * other shards (whose answers came before that) are pulled again after it. */
int shards_push_pull(shards *sh, const float *grads, const push_meta *m, float *params, int64_t min_clock,
                     int64_t clock, long timeout_ms, int64_t *step, int *outcome);

/* Tensors a push carries beside a shard's dense gradients (a sparse
 * variable's "NAME:ids" and "NAME:values", psd's store.h): n of them, each
 * described by d[k] with its bytes at data[k]. */
typedef struct shard_extra {
    int n;
    const st_desc *d;
    const void *const *data;
} shard_extra;
/* shards_push with extra[i] (extra may be NULL; extra[i].n may be 0) in
 * shard i's body, in the same request: a sync step gets both or neither. A
 * shard with no dense piece gets a push when it has extra tensors. */
int shards_push_extra(shards *sh, const float *grads, const push_meta *m, const shard_extra *extra, int64_t *step,
                      int *outcome);

#endif
