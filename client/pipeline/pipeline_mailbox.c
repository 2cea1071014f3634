/* pipeline_mailbox.c - the receive buffer of a pipeline stage (see
 * pipeline_mailbox.h): a slot per (step parity, direction, micro-batch),
 * each stamped with the step it was filled for. */
#include "pipeline/pipeline_mailbox.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "ring_schedule.h"

enum { SLOT_EMPTY, SLOT_FULL, SLOT_TAKEN };

typedef struct mslot {
    int64_t step; /* what it was filled for; -1 never */
    int state;
    float *data;  /* malloc'd while full */
    int64_t tag;
} mslot;

struct pipe_mailbox {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int micro, stages;
    size_t act, grad;
    size_t params[PIPE_MAX_STAGES];
    int has_params;
    int params_open; /* stage 0 takes the stages' parameters (503 before: it still trains) */
    int replicas;
    size_t reduce;
    int ring;                                /* PIPE_RING instead of PIPE_REDUCE */
    size_t ring_floats[2 * PIPE_MAX_REPLICAS]; /* the chunk each ring step brings */
    int64_t step;
    mslot *slots; /* [2 parities][2 dirs][micro], [PIPE_MAX_STAGES] params, [2 parities][PIPE_MAX_REPLICAS] sums,
                   * [2 parities][2 PIPE_MAX_REPLICAS] ring chunks */
};

static size_t n_slots(const pipe_mailbox *m)
{
    return 4 * (size_t)m->micro + PIPE_MAX_STAGES + 6 * PIPE_MAX_REPLICAS;
}

/* The slot of k (its numbers range-checked by the caller) and its size. */
static mslot *slot_of(pipe_mailbox *m, const pipe_key *k, size_t *want)
{
    size_t base = 4 * (size_t)m->micro;
    if (k->dir == PIPE_PARAMS) {
        *want = m->params[k->mb];
        return &m->slots[base + (size_t)k->mb];
    }
    if (k->dir == PIPE_REDUCE) {
        *want = m->reduce;
        return &m->slots[base + PIPE_MAX_STAGES + (size_t)(k->step & 1) * PIPE_MAX_REPLICAS + (size_t)k->mb];
    }
    if (k->dir == PIPE_RING) {
        *want = m->ring_floats[k->mb];
        return &m->slots[base + PIPE_MAX_STAGES + 2 * PIPE_MAX_REPLICAS +
                         (size_t)(k->step & 1) * 2 * PIPE_MAX_REPLICAS + (size_t)k->mb];
    }
    *want = k->dir == PIPE_ACT ? m->act : m->grad;
    return &m->slots[((size_t)(k->step & 1) * 2 + (size_t)k->dir) * (size_t)m->micro + (size_t)k->mb];
}

const char *pipe_dir_name(pipe_dir d)
{
    return d == PIPE_ACT ? "activations" : d == PIPE_GRAD ? "gradients" : d == PIPE_PARAMS ? "parameters"
                                               : d == PIPE_REDUCE                      ? "gradient sums"
                                                                                       : "ring chunks";
}

const char *pipe_dir_unit(pipe_dir d)
{
    return d == PIPE_PARAMS ? "stage" : d == PIPE_REDUCE ? "replica" : d == PIPE_RING ? "ring step" : "micro-batch";
}

const char *pipe_dir_wire(pipe_dir d)
{
    return d == PIPE_ACT ? "act" : d == PIPE_GRAD ? "grad" : d == PIPE_PARAMS ? "params" : d == PIPE_REDUCE ? "reduce"
                                                                                                        : "ring";
}

int pipe_dir_from_wire(const char *s, pipe_dir *out)
{
    for (int d = PIPE_ACT; d <= PIPE_RING; d++)
        if (s && strcmp(s, pipe_dir_wire((pipe_dir)d)) == 0) {
            *out = (pipe_dir)d;
            return 0;
        }
    return -1;
}

pipe_mailbox *pipe_mailbox_new(int micro, size_t act_floats, size_t grad_floats, int stages,
                               const size_t *param_floats, int replicas, size_t reduce_floats)
{
    if (micro < 1 || stages < 1 || stages > PIPE_MAX_STAGES || replicas < 1 || replicas > PIPE_MAX_REPLICAS)
        return NULL;
    pipe_mailbox *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    m->micro = micro;
    size_t n = n_slots(m);
    m->slots = calloc(n, sizeof(mslot));
    if (!m->slots) {
        free(m);
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        m->slots[i].step = -1;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    m->micro = micro;
    m->stages = stages;
    m->act = act_floats;
    m->grad = grad_floats;
    m->replicas = replicas;
    m->reduce = reduce_floats;
    if (param_floats) {
        m->has_params = 1;
        memcpy(m->params, param_floats, sizeof(size_t) * (size_t)stages);
    }
    return m;
}

void pipe_mailbox_free(pipe_mailbox *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < n_slots(m); i++)
        free(m->slots[i].data);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    free(m->slots);
    free(m);
}

void pipe_mailbox_set_ring(pipe_mailbox *m, int replica)
{
    pthread_mutex_lock(&m->mu);
    m->ring = 1;
    for (int t = 0; t < ring_steps(m->replicas); t++) {
        size_t off;
        m->ring_floats[t] =
            ring_chunk(m->reduce, m->replicas, ring_recv_chunk(m->replicas, replica, t), &off);
    }
    pthread_mutex_unlock(&m->mu);
}

void pipe_mailbox_open_params(pipe_mailbox *m)
{
    pthread_mutex_lock(&m->mu);
    m->params_open = 1;
    pthread_mutex_unlock(&m->mu);
}

void pipe_mailbox_set_step(pipe_mailbox *m, int64_t step)
{
    pthread_mutex_lock(&m->mu);
    m->step = step;
    pthread_mutex_unlock(&m->mu);
}

/* The slot of k and its expected size, or the refusal (mu held). */
static unsigned locate(pipe_mailbox *m, const pipe_key *k, size_t floats, mslot **out,
                       size_t *want, char *msg, size_t cap)
{
    if (k->dir == PIPE_PARAMS) {
        if (!m->has_params || k->mb < 1 || k->mb >= m->stages) {
            snprintf(msg, cap, "this stage takes no parameters from stage %d", k->mb);
            return 400;
        }
        if (!m->params_open) {
            snprintf(msg, cap, "stage 0 takes the stages' parameters once its training buffers are freed: "
                               "retry");
            return 503;
        }
    } else if (k->dir == PIPE_REDUCE) {
        if (m->ring) {
            snprintf(msg, cap, "this stage takes its replicas' gradients as ring chunks (--allreduce=ring)");
            return 400;
        }
        if (m->replicas < 2 || k->mb < 0 || k->mb >= m->replicas) {
            snprintf(msg, cap, "gradient sums of replica %d: this pipeline has %d replicas", k->mb, m->replicas);
            return 400;
        }
    } else if (k->dir == PIPE_RING) {
        if (!m->ring) {
            snprintf(msg, cap, "this stage takes no ring chunks (it was not started with --allreduce=ring)");
            return 400;
        }
        if (k->mb < 0 || k->mb >= ring_steps(m->replicas)) {
            snprintf(msg, cap, "ring step %d: %d replicas' ring has steps 0 to %d", k->mb, m->replicas,
                     ring_steps(m->replicas) - 1);
            return 400;
        }
    } else {
        size_t w = k->dir == PIPE_ACT ? m->act : m->grad;
        if (w == 0) {
            snprintf(msg, cap, "this stage takes no %s", pipe_dir_name(k->dir));
            return 400;
        }
        if (k->mb < 0 || k->mb >= m->micro) {
            snprintf(msg, cap, "micro-batch %d: this pipeline has micro-batches 0 to %d", k->mb,
                     m->micro - 1);
            return 400;
        }
    }
    *out = slot_of(m, k, want);
    if (k->step != m->step && k->step != m->step + 1) {
        snprintf(msg, cap, "%s for step %lld: this stage is at step %lld (it takes that step and the next)",
                 pipe_dir_name(k->dir), (long long)k->step, (long long)m->step);
        return 409;
    }
    if ((*out)->step == k->step && (*out)->state != SLOT_EMPTY) {
        snprintf(msg, cap, "%s of step %lld, %s %d: received already (a duplicate)",
                 pipe_dir_name(k->dir), (long long)k->step,
                 pipe_dir_unit(k->dir), k->mb);
        return 409;
    }
    if (floats > *want) {
        snprintf(msg, cap, "%zu floats of %s: more than the %zu expected", floats,
                 pipe_dir_name(k->dir), *want);
        return 413;
    }
    if (floats != *want) {
        snprintf(msg, cap, "%zu floats of %s: %zu expected", floats, pipe_dir_name(k->dir), *want);
        return 400;
    }
    return 0;
}

unsigned pipe_mailbox_check(pipe_mailbox *m, const pipe_key *k, size_t floats, char *msg, size_t cap)
{
    mslot *s;
    size_t want;
    pthread_mutex_lock(&m->mu);
    unsigned st = locate(m, k, floats, &s, &want, msg, cap);
    pthread_mutex_unlock(&m->mu);
    return st;
}

unsigned pipe_mailbox_put(pipe_mailbox *m, const pipe_key *k, const void *data, size_t floats,
                          int64_t tag, char *msg, size_t cap)
{
    /* copy outside the lock, into memory of the expected size */
    float *copy = malloc(floats ? floats * sizeof(float) : 1);
    if (!copy) {
        snprintf(msg, cap, "out of memory");
        return 503;
    }
    if (floats)
        memcpy(copy, data, floats * sizeof(float));
    mslot *s;
    size_t want;
    pthread_mutex_lock(&m->mu);
    unsigned st = locate(m, k, floats, &s, &want, msg, cap);
    if (st == 0) {
        free(s->data);
        s->data = copy;
        copy = NULL;
        s->step = k->step;
        s->tag = tag;
        s->state = SLOT_FULL;
        pthread_cond_broadcast(&m->cv);
    }
    pthread_mutex_unlock(&m->mu);
    free(copy);
    return st;
}

int pipe_mailbox_take(pipe_mailbox *m, const pipe_key *k, float *dst, int64_t *tag, double deadline,
                      int (*abort)(void))
{
    mslot *s;
    size_t want;
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    /* the slot the key names (a message for it may be there already) */
    s = slot_of(m, k, &want);
    while (!(s->step == k->step && s->state == SLOT_FULL)) {
        double now = clk_mono_secs();
        if (abort && abort()) {
            rc = -2;
            break;
        }
        if (now >= deadline) {
            rc = -1;
            break;
        }
        double until = now + 0.05 < deadline ? now + 0.05 : deadline;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double add = until - now;
        ts.tv_sec += (time_t)add;
        ts.tv_nsec += (long)((add - (double)(time_t)add) * 1e9);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&m->cv, &m->mu, &ts);
    }
    if (rc == 0) {
        if (want)
            memcpy(dst, s->data, want * sizeof(float));
        if (tag)
            *tag = s->tag;
        free(s->data);
        s->data = NULL;
        s->state = SLOT_TAKEN;
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

int pipe_mailbox_pending(pipe_mailbox *m)
{
    int n = 0;
    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < n_slots(m); i++)
        n += m->slots[i].state == SLOT_FULL;
    pthread_mutex_unlock(&m->mu);
    return n;
}
