/* store.h - the shard's variables: named float32 tensors with versions, the
 * shard's global_step, and the updates applied to them. Its state is opaque
 * (store.c); two modules of its own hold parts of it: sync_agg.h (a sync
 * step's gradients, the push ids) and worker_state.h (leases, clocks,
 * staleness). One change hook tells psd what moved (store_on_change).
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
#include "optim.h"
#include "safetensors.h"
#include "sparse_table.h"
#include "tensor.h"

enum {
    STORE_OK = 0,
    STORE_ENOENT = -2,   /* unknown variable */
    STORE_EEXIST = -3,   /* create-only and it exists */
    STORE_ESHAPE = -4,   /* shape or length mismatch */
    STORE_EINVAL = -5,   /* bad input (message in err) */
    STORE_ENOMEM = -6,
    STORE_EAHEAD = -7,   /* sync: a gradient from a step this shard has not reached */
    STORE_EMODE = -8,    /* not allowed in the current mode (message in err) */
    STORE_ECONFLICT = -9, /* a different configuration after training started */
    STORE_ECHANGED = -10, /* a streamed push: its variables changed meanwhile (push again) */
};

/* What became of a push (store_apply_grads' *outcome). */
enum {
    STORE_PUSH_APPLIED = 0,   /* applied now (async, or the push that completed a sync step) */
    STORE_PUSH_DUPLICATE = 1, /* its push id or (worker, step) was seen: not applied again */
    STORE_PUSH_STALE = 2,     /* sync: computed from an older step; dropped and counted */
    STORE_PUSH_PENDING = 3,   /* sync: kept until the step has its replicas */
};

#define STORE_MAX_WORKERS 4096

/* The training configuration the chief sends (PUT /v1/config). */
typedef struct store_config {
    optim_config optim;
    int sync;                  /* 0 async, 1 sync */
    int replicas_to_aggregate; /* sync: gradients per step */
    int workers;               /* how many workers train */
    int max_staleness;         /* async: drop gradients staler than this; -1 = no limit */
    int staleness;             /* stale-synchronous bound; -1 = none (plain async) */
    float moving_average_decay; /* 0: off; else 0 < D < 1, a shadow copy of each variable */
} store_config;


/* A consistent view of one variable; holds a reference to its data. */
typedef struct store_snap {
    char name[TENSOR_NAME_MAX + 1];
    tensor_shape shape;
    int64_t numel;
    uint64_t version;
    blob *data;
} store_snap;

#define STORE_PUSH_ID_MAX 64

/* The shard's state lives in store.c: nothing outside it reads or locks it.
 * A handle, so a server can hold one by value. */
typedef struct store_state store_state;
typedef struct store {
    store_state *st;
} store;

/* One variable as a checkpoint holds it. */
typedef struct store_saved_var {
    char name[TENSOR_NAME_MAX + 1];
    tensor_shape shape;
    int64_t numel;
    uint64_t version;
    int64_t updates;
    blob *data;   /* a reference */
    float *slots; /* n_slots arrays of numel floats, malloc'd (a copy), or NULL */
    int n_slots;
    float *shadow; /* the moving average, numel floats, malloc'd (a copy), or NULL (= data) */
} store_saved_var;

/* One sparse variable as a checkpoint holds it: its rows held, least
 * recently updated first (a restore keeps the eviction order). */
typedef struct store_saved_sparse {
    char name[TENSOR_NAME_MAX + 1];
    sparse_decl decl;
    int64_t n;       /* rows held */
    int64_t updates, evicted;
    uint64_t version;
    int64_t *ids;    /* n, malloc'd */
    float *values;   /* n * dim, malloc'd */
    float *slots;    /* n_slots arrays of n * dim, malloc'd, or NULL */
    int n_slots;
} store_saved_sparse;

/* What a checkpoint of the shard holds: taken at one instant, or read back. */
typedef struct store_saved {
    int64_t global_step;
    store_config config;
    int configured;
    int has_loss;
    double last_loss;
    int64_t stale_dropped, pushes_applied;
    uint64_t changes;
    char *placement;       /* the chief's placement map (JSON text, malloc'd), or NULL */
    int n;
    store_saved_var *vars; /* sorted by name */
    int n_sparse;
    store_saved_sparse *sparse; /* sorted by name */
} store_saved;

int store_init(store *s, float learning_rate, bufpool *pool);
void store_destroy(store *s);

/* What moved, for the one hook (store_on_change): the global_step (step is
 * the new one), a worker's clock or the live workers (the stale-synchronous
 * level: store_min_clock). */
#define STORE_CHANGED_STEP 1u
#define STORE_CHANGED_CLOCK 2u
/* fn(ctx, what, step) runs after each change, with no store lock held, on the
 * changing thread. Set once, before anyone is served. */
void store_on_change(store *s, void (*fn)(void *ctx, unsigned what, int64_t step), void *ctx);

/* Snapshot one variable (reference taken; release with store_snap_release). */
int store_get(store *s, const char *name, store_snap *out);
void store_snap_release(store_snap *snap);

/* The moving averages (--moving_average_decay) instead of the variables:
 * store_get_all's and store_get's snapshots whose blobs hold the shadow
 * copies (fresh blobs; a variable not updated since EMA started is its own
 * average). STORE_EMODE when the configuration has no moving average. */
int store_get_all_average(store *s, store_snap **out, int *n, int64_t *global_step);
int store_get_average(store *s, const char *name, store_snap *out);

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

/* One gradient for one variable, applied at once with the optimizer (async
 * only: STORE_EMODE in sync mode); bumps its version and global_step. */
int store_apply_grad(store *s, const char *name, const float *g, int64_t numel,
                     int64_t *global_step, uint64_t *version);

/* Metadata a worker sends with a bulk push. */
typedef struct store_push_meta {
    const char *push_id; /* NULL or 1..64 chars */
    int has_loss;
    double loss;
    long long worker;    /* -1 when not given (sync needs it) */
    long long step;      /* the global_step the gradient was computed from; -1 not given */
    long long clock;     /* the worker's iteration (stale-synchronous); -1 not given */
    blob *body;          /* the blob holding data; sync keeps a reference */
    /* 1: data lies in body, which the store may write and keep, and nobody
     * checked the gradients for NaN and Inf yet: the store does (a refused
     * push changes nothing, a lease included). An async sgd push is checked
     * and applied in one pass, its next values written over the gradients in
     * the body, which become the variables' data (views, bufpool.h); other
     * pushes are checked first. 0: the caller checked them. */
    int in_body;
} store_push_meta;

/* 1 when a push with in_body would be checked and applied in one pass now
 * (async, sgd); the caller then leaves the NaN/Inf check to the store. */
int store_push_in_body(store *s);

/* Apply every gradient of a parsed safetensors body (data = the data section)
 * as one update: all names must exist with equal shapes and dtype F32, else
 * nothing changes and err says why. Async: applied at once. Sync: kept until
 * replicas_to_aggregate gradients for the current step are in, then summed in
 * worker-index order, averaged and applied once (sync_agg.h). The caller
 * keeps f on every path (sync keeps a copy of its tensors and a reference to
 * meta->body). *outcome is a STORE_PUSH_* value. A push_id already seen is
 * not applied again (*global_step is the step it was for). */
int store_apply_grads(store *s, const st_file *f, const unsigned char *data,
                      const store_push_meta *meta, int64_t *global_step, int *outcome,
                      char *err, size_t errlen);

/* A push applied as its body arrives (server/push_stream.c): async sgd
 * without clipping or moving averages, dense float32 variables. Begun once
 * the body's header is in, the next versions are computed piece by piece
 * from the versions of that moment (held, so nobody writes them) into blobs
 * of their own, without a lock; nothing is visible until the commit, which
 * publishes them all at once (a push refused before, for a NaN or a body
 * cut short, changes nothing: store_stream_end). Other pushes of the same
 * variables applied meanwhile (POST /v1/grads, /v1/vars/NAME/grad) keep
 * their gradients (up to 64 of them and twice the stream's bytes), and the
 * commit applies them again on top of the streamed push, in their order:
 * the result is those updates one after the other, each with the floats of
 * optim_apply. Anything else that changes the variables meanwhile (a PUT, a
 * restore, another configuration, more pushes than that) makes the commit
 * STORE_ECHANGED. One stream at a time per store, begun only while no other
 * push arrives. */
typedef struct store_stream store_stream;

/* A push's body starts (+1) or stops (-1) arriving: a push is streamed
 * only while no other one arrives. */
void store_push_arriving(store *s, int delta);
/* STORE_OK and *out when f (with meta) can be streamed now; else
 * STORE_EMODE (the caller reads the body whole and applies it as before). */
int store_stream_begin(store *s, const st_file *f, const store_push_meta *meta, store_stream **out);
/* Elements [at, at + n) of tensor k (f's header order) of the gradient,
 * finite float32 values: their next values. No lock: one thread per stream. */
void store_stream_apply(store_stream *ss, int k, size_t at, const float *g, size_t n);
/* The same from n little-endian float32 at g (any alignment), checked in
 * the same pass: -1, or the index of the first NaN or Inf among them. */
int64_t store_stream_apply_bytes(store_stream *ss, int k, size_t at, const unsigned char *g, size_t n);
/* Publish (store_apply_grads' outcomes, the staleness rules, push ids,
 * clocks and the lease as there). Then store_stream_end. */
int store_stream_commit(store *s, store_stream *ss, const store_push_meta *meta, int64_t *global_step,
                        int *outcome, char *err, size_t errlen);
/* The stream ends (after the commit, or instead of it: nothing changes);
 * NULL is fine. */
void store_stream_end(store *s, store_stream *ss);

/* Set the training configuration (and mark the shard ready). Setting a
 * different one after global_step > 0 is STORE_ECONFLICT. */
int store_configure(store *s, const store_config *c, char *err, size_t errlen);
/* STORE_OK and *out when configured, else STORE_ENOENT (*out: the defaults). */
int store_get_config(store *s, store_config *out);

/* A consistent copy of everything a checkpoint holds, taken under the read
 * lock: references to the variables' current blobs (no copy: the store never
 * writes a blob someone else holds) and copies of the optimizer state. */
int store_save(store *s, store_saved *out);
void store_saved_free(store_saved *sv);
/* The store's change counter (a save is needed when it moved). */
uint64_t store_changes(store *s);

/* Replace the whole store with a checkpoint's contents (at start-up, before
 * anyone is served). Takes the blobs and slots of sv (left empty). */
int store_restore(store *s, store_saved *sv);

/* store_get_all, and in the same instant whether worker's gradient for the
 * current step is kept (*pending; sync). */
int store_get_all_pending(store *s, store_snap **out, int *n, int64_t *global_step, int worker,
                          int *pending);

/* Membership (sync). A worker's lease runs lease_ms from its last request
 * that named it (a push, a long poll with worker=, a heartbeat); configuring
 * gives every worker a fresh lease. A step needs min(replicas_to_aggregate,
 * live workers) gradients (at least 1), so a dead or finished worker never
 * holds the others up; a worker whose lease ran out counts again from its
 * next request. */
void store_touch(store *s, int worker);
/* The worker finished (or stops): it leaves the run now. */
void store_leave(store *s, int worker);
/* Complete the current sync step if the live workers' gradients are in
 * (called periodically: leases run out between pushes). 1 when it stepped.
 * Tells the hook the step when it stepped, and the clock level every time
 * (a lease that ran out may lift the stale-synchronous bound). */
int store_sync_tick(store *s);

/* The chief's placement map (JSON text; copied). NULL clears it. */
int store_set_placement(store *s, const char *json_text);
/* A malloc'd copy of it, or NULL when there is none. */
char *store_get_placement(store *s);

/* Stale-synchronous clocks: worker announces it starts iteration `clock`. */
void store_clock_start(store *s, int worker, int64_t clock);
/* The worker has completed `done` iterations (a push of iteration done - 1,
 * or a pull announcing iteration done): raises its count, never lowers it.
 * 1 when it raised it (and the hook is told). */
int store_clock_done(store *s, int worker, int64_t done);
/* The fewest iterations completed by a live worker of the run (INT64_MAX
 * when none is live): a worker may start iteration k once this is >= k - S. */
int64_t store_min_clock(store *s);
/* {"count", "mean", "max", "buckets": [{"le": .., "count": ..}...], "clocks": ...} */
struct json_t;
struct json_t *store_staleness_json(store *s);

/* The lease a worker's request gives it (default 10 s); set before anyone
 * is served (psd's --worker_lease_secs). */
void store_set_lease_ms(store *s, int64_t ms);
int64_t store_lease_ms(store *s);
/* Start the run at global_step `step` (before anyone is served: psd's
 * synthetic-history test hook). */
void store_start_at(store *s, int64_t step);

/* Counters for /v1/status and /metrics, read in one instant. */
typedef struct store_counts {
    int configured;        /* the chief sent the configuration */
    int64_t stale_dropped; /* gradients dropped as stale */
    int pending;           /* sync gradients kept for the current step */
    int64_t pushes_streamed; /* pushes applied as their body arrived (store_stream) */
    int64_t push_replays;    /* pushes applied again on top of a streamed one */
} store_counts;
void store_get_counts(store *s, store_counts *out);

/* Where the sync step stands, read in one instant (GET /v1/sync). */
enum { STORE_MEMBER_HAVE, STORE_MEMBER_WAITING, STORE_MEMBER_DEAD, STORE_MEMBER_LEFT };
typedef struct store_sync_view {
    int sync;               /* configured, in sync mode */
    int workers, replicas;  /* of the configuration */
    int live;               /* workers whose gradient is in or whose lease runs */
    int64_t global_step, lease_ms;
    double step_secs;       /* since the step began */
    double waiting_secs;    /* since its first gradient came (0: none yet) */
    unsigned char *member;  /* workers entries, STORE_MEMBER_*; malloc'd (free it), or NULL */
} store_sync_view;
/* 0, or STORE_ENOMEM. */
int store_get_sync_view(store *s, store_sync_view *v);

/* Row-sparse variables (sparse_table.h): pulled and pushed by ids. A push's
 * part for table NAME is "NAME:ids" (I64 [n]) and "NAME:values" (F32 [n,
 * dim]) beside the dense gradients of store_apply_grads' body, applied (or
 * kept for the sync step, then summed by id in worker order and averaged
 * over the step's gradients) with the dense ones, all or nothing. */
/* Declare name (create-only, idempotent): STORE_OK and *created; the same
 * name dense or declared otherwise: STORE_ECONFLICT (err says);
 * STORE_EINVAL a bad declaration. */
int store_sparse_declare(store *s, const char *name, const sparse_decl *d, int *created, char *err,
                         size_t errlen);
/* STORE_OK and its declaration when name is a sparse variable, else STORE_ENOENT. */
int store_sparse_peek(store *s, const char *name, sparse_decl *d);
/* The rows of ids (n raw little-endian int64) into out (n * dim floats),
 * rows not held as their initial value, and *global_step: STORE_OK,
 * STORE_ENOENT, STORE_EINVAL (an id that is not this table's: err). */
int store_sparse_lookup(store *s, const char *name, const unsigned char *ids, int64_t n, float *out,
                        int64_t *global_step, char *err, size_t errlen);
/* What /v1/status and /metrics show of each sparse variable. */
typedef struct store_sparse_stat {
    char name[TENSOR_NAME_MAX + 1];
    sparse_decl decl;
    int64_t held, evicted, updates;
    uint64_t bytes, version;
} store_sparse_stat;
/* *out malloc'd (n entries, NULL when none); STORE_OK or STORE_ENOMEM. */
int store_sparse_stats(store *s, store_sparse_stat **out, int *n);

/* Counters for /v1/status. */
void store_totals(store *s, int *n_vars, uint64_t *bytes, int64_t *global_step, int *has_loss,
                  double *last_loss);
/* The shard's global_step now. */
int64_t store_global_step(store *s);

#endif
