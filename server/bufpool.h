/* bufpool.h - reference-counted byte buffers ("blobs") and a bounded pool of idle
 * ones, so the hot path (a pull answered from a stored tensor, a push read
 * straight into its buffer) never faults in fresh pages per request.
 *
 * A blob is immutable while more than one reference exists: the store writes
 * in place only when it holds the sole reference. */
#ifndef RESTPS_BUFPOOL_H
#define RESTPS_BUFPOOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

typedef struct bufpool bufpool;

typedef struct blob {
    atomic_int refs;
    size_t cap;     /* bytes usable at data */
    size_t len;     /* bytes in use */
    bufpool *pool;  /* where it returns when the last reference goes */
    struct blob *next_idle;
    unsigned char *data; /* 64-byte aligned (a view's: where its bytes start) */
    struct blob *parent; /* a view's: the blob its bytes lie in (referenced); else NULL */
} blob;

/* keep_bytes: at most this many bytes of idle blobs are kept for reuse. */
bufpool *bufpool_new(size_t keep_bytes);
void bufpool_free(bufpool *p);

/* A blob of at least `len` bytes (len set), one reference, contents undefined.
 * NULL when out of memory. */
blob *blob_new(bufpool *p, size_t len);
blob *blob_ref(blob *b);
void blob_unref(blob *b); /* NULL is fine */

/* A view: a blob of its own (one reference, len = cap = len) over parent's
 * bytes [off, off + len), which keeps parent alive until the view's last
 * reference goes. Writes through it land in parent (the store writes a push's
 * next versions into the push's own body and keeps them as views). Not for
 * blob_grow, never pooled. NULL when out of memory or out of range. */
blob *blob_view(blob *parent, size_t off, size_t len);

/* Grow b to hold at least `len` bytes, keeping its contents; b must have one
 * reference. Returns the (possibly new) blob, or NULL (b untouched) when out of memory. */
blob *blob_grow(blob *b, size_t len);

/* Lower the idle allowance (never above keep_bytes); idle blobs over it are
 * freed now. The store sets it from what it holds, so psd's memory stays
 * within 2x the stored bytes plus a little. */
void bufpool_set_limit(bufpool *p, size_t limit);

/* Idle bytes held right now. */
size_t bufpool_idle_bytes(bufpool *p);

#endif
