/* bufpool.c - reference-counted blobs and the idle pool behind them. */
#include "bufpool.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define HUGE_ALIGN ((size_t)2 << 20)

struct bufpool {
    pthread_mutex_t mu;
    size_t keep_bytes, idle_bytes;
    size_t limit_bytes; /* the store's share: keep at most min(keep, limit) */
    blob *idle; /* singly linked, most recently returned first */
};

bufpool *bufpool_new(size_t keep_bytes)
{
    bufpool *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    pthread_mutex_init(&p->mu, NULL);
    p->keep_bytes = keep_bytes;
    p->limit_bytes = keep_bytes;
    return p;
}

static void blob_destroy(blob *b)
{
    free(b->data);
    free(b);
}

void bufpool_free(bufpool *p)
{
    if (!p)
        return;
    while (p->idle) {
        blob *b = p->idle;
        p->idle = b->next_idle;
        blob_destroy(b);
    }
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static blob *blob_alloc(bufpool *p, size_t len)
{
    blob *b = calloc(1, sizeof(*b));
    if (!b)
        return NULL;
    size_t cap = len < 64 ? 64 : (len + 63) & ~(size_t)63;
    size_t align = cap >= 2 * HUGE_ALIGN ? HUGE_ALIGN : 64;
    /* large: whole 2 MiB pages and one more, never touched by a tensor of
     * len bytes (no RSS), so that a tensor's buffer and a push body of the
     * same tensor (len + its header) fit in each other when pooled */
    if (align == HUGE_ALIGN)
        cap = ((cap + HUGE_ALIGN - 1) & ~(HUGE_ALIGN - 1)) + HUGE_ALIGN;
    void *d = NULL;
    if (posix_memalign(&d, align, cap) != 0) {
        free(b);
        return NULL;
    }
    if (align == HUGE_ALIGN)
        madvise(d, cap, MADV_HUGEPAGE); /* large tensors fault in 2 MiB at a time */
    b->data = d;
    b->cap = cap;
    b->pool = p;
    return b;
}

blob *blob_new(bufpool *p, size_t len)
{
    blob *b = NULL;
    if (p) {
        pthread_mutex_lock(&p->mu);
        /* best fit among idle blobs no more than 2x too large */
        blob **best = NULL;
        for (blob **pp = &p->idle; *pp; pp = &(*pp)->next_idle) {
            size_t c = (*pp)->cap;
            if (c >= len && c / 2 <= (len < 64 ? 64 : len) && (!best || c < (*best)->cap))
                best = pp;
        }
        if (best) {
            b = *best;
            *best = b->next_idle;
            p->idle_bytes -= b->cap;
        }
        pthread_mutex_unlock(&p->mu);
    }
    if (!b)
        b = blob_alloc(p, len);
    if (!b)
        return NULL;
    atomic_store(&b->refs, 1);
    b->len = len;
    b->next_idle = NULL;
    b->parent = NULL;
    return b;
}

blob *blob_view(blob *parent, size_t off, size_t len)
{
    if (off > parent->cap || len > parent->cap - off)
        return NULL;
    blob *v = calloc(1, sizeof(*v));
    if (!v)
        return NULL;
    atomic_store(&v->refs, 1);
    v->cap = v->len = len;
    v->data = parent->data + off;
    v->parent = blob_ref(parent);
    return v;
}

blob *blob_ref(blob *b)
{
    atomic_fetch_add(&b->refs, 1);
    return b;
}

void blob_unref(blob *b)
{
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1)
        return;
    if (b->parent) { /* a view: its bytes are the parent's */
        blob *parent = b->parent;
        free(b);
        blob_unref(parent);
        return;
    }
    bufpool *p = b->pool;
    blob *drop = b;
    if (p) {
        pthread_mutex_lock(&p->mu);
        size_t keep = p->keep_bytes < p->limit_bytes ? p->keep_bytes : p->limit_bytes;
        if (b->cap <= keep) {
            /* the newest is kept: the oldest idle ones make room for it (a
             * tensor's old buffer must not hold the place of the next body) */
            drop = NULL;
            while (p->idle_bytes + b->cap > keep) {
                blob **last = &p->idle;
                while ((*last)->next_idle)
                    last = &(*last)->next_idle;
                blob *old = *last;
                *last = NULL;
                p->idle_bytes -= old->cap;
                old->next_idle = drop;
                drop = old;
            }
            b->next_idle = p->idle;
            p->idle = b;
            p->idle_bytes += b->cap;
        }
        pthread_mutex_unlock(&p->mu);
    }
    while (drop) {
        blob *d = drop;
        drop = d == b ? NULL : d->next_idle;
        blob_destroy(d);
    }
}

blob *blob_grow(blob *b, size_t len)
{
    if (len <= b->cap) {
        b->len = len;
        return b;
    }
    size_t want = b->cap * 2 > len ? b->cap * 2 : len;
    blob *n = blob_new(b->pool, want);
    if (!n)
        return NULL;
    memcpy(n->data, b->data, b->len);
    n->len = len;
    blob_unref(b);
    return n;
}

void bufpool_set_limit(bufpool *p, size_t limit)
{
    blob *drop = NULL;
    pthread_mutex_lock(&p->mu);
    p->limit_bytes = limit;
    size_t keep = p->keep_bytes < limit ? p->keep_bytes : limit;
    while (p->idle && p->idle_bytes > keep) { /* oldest are last: drop from the front is fine */
        blob *b = p->idle;
        p->idle = b->next_idle;
        p->idle_bytes -= b->cap;
        b->next_idle = drop;
        drop = b;
    }
    pthread_mutex_unlock(&p->mu);
    while (drop) {
        blob *b = drop;
        drop = b->next_idle;
        blob_destroy(b);
    }
}

size_t bufpool_idle_bytes(bufpool *p)
{
    pthread_mutex_lock(&p->mu);
    size_t n = p->idle_bytes;
    pthread_mutex_unlock(&p->mu);
    return n;
}
