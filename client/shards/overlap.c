/* overlap.c - a step's transfers on a thread of their own, streamed layer by
 * layer against the compute (overlap.h). */
#include "shards/overlap.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

enum { JOB_IDLE, JOB_QUEUED, JOB_RUNNING, JOB_DONE };

struct overlap {
    shards *sh;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* every change below: one condition, broadcast */
    int (*fn)(void *);
    void *arg;
    int state, rc, quit, cancel;
    /* the pull's answers, per shard: bytes landed, X-Global-Step, taken from */
    size_t *len;
    int64_t *gs;
    int *taken;
    int torn;
    int copying; /* the training thread copies out of an rx buffer (no new try writes there meanwhile) */
    /* the training thread's own: each shard's step before the pull, its
     * answer's header once parsed (1; -1: unusable) */
    int64_t *before;
    st_file *hdr;
    int *hdr_state;
    /* the push: layers ready_from.. have their gradients */
    int ready_from;
};

static void *transfer_main(void *arg)
{
    overlap *o = arg;
    pthread_mutex_lock(&o->mu);
    for (;;) {
        while (o->state != JOB_QUEUED && !o->quit)
            pthread_cond_wait(&o->cv, &o->mu);
        if (o->quit)
            break;
        o->state = JOB_RUNNING;
        pthread_mutex_unlock(&o->mu);
        int rc = o->fn(o->arg);
        pthread_mutex_lock(&o->mu);
        o->rc = rc;
        o->state = JOB_DONE;
        pthread_cond_broadcast(&o->cv);
    }
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

/* shards_stream.landed, on the transfer thread. */
static void landed(void *arg, int shard, size_t len, int64_t global_step)
{
    overlap *o = arg;
    pthread_mutex_lock(&o->mu);
    if (len < o->len[shard] && o->taken[shard]) {
        o->torn = 1; /* a new try, after bytes of the last one were taken */
        /* its bytes go where a copy may be reading: wait for that copy (the
         * transfer thread calls this before the try writes anything) */
        while (o->copying)
            pthread_cond_wait(&o->cv, &o->mu);
    }
    o->len[shard] = len;
    if (global_step >= 0)
        o->gs[shard] = global_step;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

/* shards_stream.layer_ready, on the transfer thread. */
static int layer_ready(void *arg, int layer)
{
    overlap *o = arg;
    pthread_mutex_lock(&o->mu);
    while (o->ready_from > layer && !o->cancel)
        pthread_cond_wait(&o->cv, &o->mu);
    int rc = o->cancel ? -1 : 0;
    pthread_mutex_unlock(&o->mu);
    return rc;
}


/* What overlap_new made (the thread joined or never started). */
static void release(overlap *o)
{
    free(o->len);
    free(o->gs);
    free(o->taken);
    free(o->before);
    free(o->hdr);
    free(o->hdr_state);
    pthread_mutex_destroy(&o->mu);
    pthread_cond_destroy(&o->cv);
    free(o);
}

overlap *overlap_new(shards *sh)
{
    overlap *o = calloc(1, sizeof(*o));
    if (!o)
        return NULL;
    const size_t n = (size_t)(sh->n > 0 ? sh->n : 1);
    o->sh = sh;
    o->len = calloc(n, sizeof(*o->len));
    o->gs = calloc(n, sizeof(*o->gs));
    o->taken = calloc(n, sizeof(*o->taken));
    o->before = calloc(n, sizeof(*o->before));
    o->hdr = calloc(n, sizeof(*o->hdr));
    o->hdr_state = calloc(n, sizeof(*o->hdr_state));
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
    if (!o->len || !o->gs || !o->taken || !o->before || !o->hdr || !o->hdr_state ||
        pthread_create(&o->th, NULL, transfer_main, o) != 0) {
        release(o);
        return NULL;
    }
    sh->st.landed = landed;
    sh->st.layer_ready = layer_ready;
    sh->st.arg = o;
    return o;
}

void overlap_free(overlap *o)
{
    if (!o)
        return;
    overlap_cancel(o);
    overlap_wait(o);
    pthread_mutex_lock(&o->mu);
    o->quit = 1;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
    pthread_join(o->th, NULL);
    for (int i = 0; i < o->sh->n; i++)
        if (o->hdr_state[i] == 1)
            st_file_free(&o->hdr[i]);
    o->sh->st = (shards_stream){0};
    release(o);
}

void overlap_run(overlap *o, int (*fn)(void *), void *arg)
{
    pthread_mutex_lock(&o->mu);
    o->fn = fn;
    o->arg = arg;
    o->state = JOB_QUEUED;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

int overlap_wait(overlap *o)
{
    pthread_mutex_lock(&o->mu);
    while (o->state == JOB_QUEUED || o->state == JOB_RUNNING)
        pthread_cond_wait(&o->cv, &o->mu);
    int rc = o->state == JOB_DONE ? o->rc : 0;
    o->state = JOB_IDLE;
    pthread_mutex_unlock(&o->mu);
    return rc;
}

void overlap_cancel(overlap *o)
{
    pthread_mutex_lock(&o->mu);
    o->cancel = 1;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

void overlap_pull_begin(overlap *o)
{
    shards *sh = o->sh;
    for (int i = 0; i < sh->n; i++) {
        if (o->hdr_state[i] == 1)
            st_file_free(&o->hdr[i]);
        o->hdr_state[i] = 0;
        o->before[i] = sh->s[i].step;
        o->len[i] = 0;
        o->gs[i] = -1;
        o->taken[i] = 0;
    }
    o->torn = 0;
    o->cancel = 0;
    sh->st.pull = 1;
}

int overlap_pull_end(overlap *o)
{
    o->sh->st.pull = 0;
    pthread_mutex_lock(&o->mu);
    int torn = o->torn;
    pthread_mutex_unlock(&o->mu);
    return torn;
}

/* Wait (o->mu held) until shard i has `need` bytes, or they will not come;
 * 0 when they are there. */
static int wait_bytes(overlap *o, int i, size_t need)
{
    while (o->len[i] < need && o->state != JOB_DONE && o->state != JOB_IDLE && !o->cancel && !o->torn)
        pthread_cond_wait(&o->cv, &o->mu);
    return o->len[i] >= need && !o->cancel && !o->torn ? 0 : -1;
}

/* Shard i's answer's header, parsed (o->mu held); 0, or -1 when it is not
 * to be used. The data's size is the shard's pieces' as float32, unless the
 * answer holds more: then it is read once the whole answer is in. */
static int header_of(overlap *o, int i)
{
    shards *sh = o->sh;
    shard *s = &sh->s[i];
    if (o->hdr_state[i])
        return o->hdr_state[i] == 1 ? 0 : -1;
    o->hdr_state[i] = -1;
    uint64_t hl = 0;
    char err[256];
    if (wait_bytes(o, i, 8) != 0 || st_read_prefix(s->rx, s->rx_cap, &hl, err, sizeof(err)) != 0 ||
        wait_bytes(o, i, 8 + hl) != 0)
        return -1;
    /* the guard: a shard that came back behind this task is not read */
    if (sh->guard >= 0 && s->n_p > 0 && (o->gs[i] < 0 || o->gs[i] < o->before[i] - sh->guard))
        return -1;
    o->taken[i] = 1;
    if (st_parse_header(s->rx + 8, hl, s->floats * 4, &o->hdr[i], err, sizeof(err)) != 0) {
        while (o->state != JOB_DONE && o->state != JOB_IDLE && !o->cancel && !o->torn)
            pthread_cond_wait(&o->cv, &o->mu);
        if (o->cancel || o->torn || o->len[i] < 8 + hl ||
            st_parse_header(s->rx + 8, hl, o->len[i] - 8 - hl, &o->hdr[i], err, sizeof(err)) != 0)
            return -1;
    }
    o->hdr_state[i] = 1;
    return 0;
}

int overlap_take_layer(overlap *o, int layer, float *params)
{
    shards *sh = o->sh;
    int rc = 0;
    pthread_mutex_lock(&o->mu);
    for (int k = 0; k < sh->pl.n && rc == 0; k++) {
        const place_piece *pc = &sh->pl.pieces[k];
        if (sh->L->tensors[pc->tensor].layer != layer)
            continue;
        const int i = pc->ps;
        if (header_of(o, i) != 0) {
            rc = -1;
            break;
        }
        const st_file *f = &o->hdr[i];
        int j = st_find(f, pc->name);
        if (j < 0 || strcmp(f->tensors[j].dtype, "F32") != 0 ||
            f->tensors[j].end - f->tensors[j].begin != (uint64_t)pc->numel * 4 ||
            wait_bytes(o, i, f->data_start + f->tensors[j].end) != 0) {
            rc = -1;
            break;
        }
        /* the bytes are in and stay while copied (a new try of the transfer
         * marks torn, and waits for the copy before it writes) */
        o->copying = 1;
        pthread_mutex_unlock(&o->mu);
        memcpy(params + pc->offset, sh->s[i].rx + f->data_start + f->tensors[j].begin, pc->numel * 4);
        pthread_mutex_lock(&o->mu);
        o->copying = 0;
        pthread_cond_broadcast(&o->cv);
    }
    if (o->torn)
        rc = -1;
    pthread_mutex_unlock(&o->mu);
    return rc;
}

void overlap_push_begin(overlap *o)
{
    pthread_mutex_lock(&o->mu);
    o->ready_from = o->sh->L->n_layers;
    o->cancel = 0;
    pthread_mutex_unlock(&o->mu);
    o->sh->st.push = 1;
}

void overlap_grads_done(overlap *o, int layer)
{
    pthread_mutex_lock(&o->mu);
    if (layer < o->ready_from) {
        o->ready_from = layer;
        pthread_cond_broadcast(&o->cv);
    }
    pthread_mutex_unlock(&o->mu);
}

void overlap_push_end(overlap *o) { o->sh->st.push = 0; }
